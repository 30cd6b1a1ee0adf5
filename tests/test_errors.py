"""Errors a new user meets first name their cause and the fix: a missing data folder names
the data.py command for the run's kind of tokens, a file that is not a checkpoint is called
that (not a refused, possibly malicious pickle), and --device=cuda without CUDA says CUDA is
unavailable (not that the checkpoint cannot be read)."""
import os
import subprocess
import sys
import zipfile

import pytest
import torch

import config
import sample
import train
from conftest import ROOT
from model import CheckpointError, Model, ModelConfig, read_checkpoint, save_checkpoint

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_train(*args):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)


def test_a_missing_data_folder_names_the_command_for_the_runs_tokens(tmp_path):
    # the CPU default trains a byte model: the fix must make byte shards, not GPT-2 ones
    r = run_train("--device=cpu", f"--data_dir={tmp_path / 'bytes'}", f"--out_dir={tmp_path / 'run'}")
    error = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and error.startswith(f"error: data folder {tmp_path / 'bytes'} does not exist"), r.stderr
    assert f"`python data.py --tokenizer=byte --source=fineweb --out_dir={tmp_path / 'bytes'} --max_tokens=" in error
    assert f"`python data.py --tokenizer=byte --source='path/to/*.jsonl' --out_dir={tmp_path / 'bytes'}`" in error
    assert "fineweb-gpt2" not in error and not (tmp_path / "run").exists()


def test_a_gpt2_model_without_data_names_the_gpt2_shards(tmp_path):
    r = run_train("--device=cpu", "--model=tiny", "--vocab_size=50304", "--max_steps=100",
                  f"--data_dir={tmp_path / 'fw'}", f"--out_dir={tmp_path / 'run'}")
    error = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and f"`python data.py --source=fineweb-gpt2 --out_dir={tmp_path / 'fw'} --shards=1`" in error
    assert "--tokenizer=byte" not in error, error


def test_data_py_alone_names_both_tokenizers(tmp_path):
    import data
    with pytest.raises(data.NoShards) as e:
        data.find_shards(str(tmp_path / "none"), "train")
    assert "--tokenizer=byte" in str(e.value) and "--source=fineweb-gpt2" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(data.NoShards, match=r"no train shards .*--tokenizer=byte"):
        data.find_shards(str(tmp_path / "empty"), "train")


def a_checkpoint(path):
    model = Model(ModelConfig())
    save_checkpoint(path, {"model": model.state_dict(), "model_config": vars(model.cfg), "step": 1})
    return path


@pytest.mark.parametrize("name, content", [
    ("notes.txt", b"hello, this is text\n"),
    ("config.json", b'{"model": {"attn": "full"}}'),
    ("text_val_000000.bin", (20240520).to_bytes(4, "little") + bytes(1020)),  # a data shard
])
def test_a_file_that_is_not_a_checkpoint_is_called_that(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path)
    message = str(e.value)
    assert message.startswith(f"{path}: not a checkpoint") and "malicious" not in message
    assert "give a run folder holding ckpt.pt" in message
    with pytest.raises(SystemExit) as e:  # sample.py says the same, without a traceback
        sample.main([f"--ckpt={path}", "--device=cpu"])
    assert "not a checkpoint" in str(e.value.code)


def test_a_zip_or_a_cut_checkpoint_is_named_for_what_it_is(tmp_path):
    archive = tmp_path / "results.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("results/table.csv", "a,b\n")
    with pytest.raises(CheckpointError, match="not a checkpoint: a zip archive without the data.pkl"):
        read_checkpoint(archive)
    whole = a_checkpoint(tmp_path / "ckpt.pt")
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])  # a copy cut short
    with pytest.raises(CheckpointError, match="damaged checkpoint.*copy it again"):
        read_checkpoint(cut)
    assert read_checkpoint(whole)["step"] == 1  # the checks pass a real one


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_says_cuda_is_unavailable(tmp_path, capsys, monkeypatch):
    ckpt = a_checkpoint(tmp_path / "ckpt.pt")
    with pytest.raises(SystemExit):
        sample.main([f"--ckpt={ckpt}", "--device=cuda"])
    err = capsys.readouterr().err
    assert "--device=cuda, but CUDA is not available" in err and "pass --device=cpu" in err, err
    assert "cannot read the checkpoint" not in err
    with pytest.raises(SystemExit):  # train.py: before any data or folder is touched
        train.main(["--device=cuda", f"--data_dir={tmp_path / 'none'}", f"--out_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert "--device=cuda, but CUDA is not available" in err and not (tmp_path / "run").exists()
    # a CPU-only build says to install the CUDA one; a CUDA build that sees no GPU says to look for it
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "CPU-only build; install the CUDA build" in config.cuda_missing()
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert "sees no GPU; check `nvidia-smi` and CUDA_VISIBLE_DEVICES" in config.cuda_missing()
