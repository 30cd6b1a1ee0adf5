"""Checkpoints load weights-only: a file whose unpickling would run code is refused by the
shared loader (model.read_checkpoint), by sample.py and by train.py --resume, naming the file,
and the code in it never runs. Training state round-trips through weights-only loading."""
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import data
from conftest import ROOT
from model import (CheckpointError, Model, ModelConfig, load_checkpoint, read_checkpoint, rng_state, save_checkpoint,
                   set_rng_state)


class RunsCode:
    """Unpickling this calls os.system: what a malicious shared checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def evil_run(tmp_path):
    """A run folder whose ckpt.pt looks like train.py's but whose 'model' entry runs code."""
    marker = tmp_path / "code_ran"
    run = tmp_path / "run"
    run.mkdir()
    cfg = ModelConfig()
    torch.save({"model": RunsCode(marker), "model_config": vars(cfg), "step": 1}, run / "ckpt.pt")
    return run, marker


def test_shared_loader_refuses_a_checkpoint_that_would_run_code(evil_run):
    run, marker = evil_run
    for loader in (read_checkpoint, load_checkpoint):
        with pytest.raises(CheckpointError) as e:
            loader(run)
        assert str(run / "ckpt.pt") in str(e.value) and "weights-only" in str(e.value)
    assert not marker.exists()


def test_sample_refuses_it(evil_run):
    run, marker = evil_run
    r = subprocess.run([sys.executable, str(ROOT / "sample.py"), f"--ckpt={run}", "--prompt=hi"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert str(run / "ckpt.pt") in r.stderr and "refused" in r.stderr, r.stderr
    assert not marker.exists()


def test_train_resume_refuses_it(evil_run, tmp_path):
    run, marker = evil_run
    shards = tmp_path / "shards"
    data.write_recall_shards(str(shards), max_tokens=20_000, seq_len=64)  # no tokenizer needed
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), f"--data_dir={shards}", f"--out_dir={run}",
                        "--resume=True", "--seq_len=64", "--batch_size=2", "--total_batch_tokens=128",
                        "--val_tokens=128", "--max_steps=2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert str(run / "ckpt.pt") in r.stderr and "refused" in r.stderr, r.stderr
    assert not marker.exists()


def test_training_state_round_trips_weights_only(tmp_path):
    """Model, RNG states of torch / NumPy / Python: saved, loaded weights-only, restored, and
    every generator then draws exactly what it would have drawn."""
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.standard_normal()  # leaves NumPy with a cached Gaussian (has_gauss = 1)
    random.gauss(0, 1)  # and Python with gauss_next set
    m = Model(ModelConfig(attn="asga"))
    save_checkpoint(str(tmp_path / "ckpt.pt"), {"model": m.state_dict(), "model_config": vars(m.cfg),
                                                "step": 7, "rng": rng_state("cpu")})
    expected = (torch.rand(3), np.random.standard_normal(3), np.random.rand(2), random.random(), random.gauss(0, 1))
    torch.manual_seed(0), np.random.seed(0), random.seed(0)  # scramble
    loaded, ckpt = load_checkpoint(tmp_path)
    set_rng_state(ckpt["rng"], "cpu")
    got = (torch.rand(3), np.random.standard_normal(3), np.random.rand(2), random.random(), random.gauss(0, 1))
    assert torch.equal(expected[0], got[0]) and np.array_equal(expected[1], got[1])
    assert np.array_equal(expected[2], got[2]) and expected[3:] == got[3:]
    assert ckpt["step"] == 7 and loaded.cfg.attn == "asga"
    for k, v in m.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_a_checkpoint_with_a_removed_flag_still_loads(tmp_path, capsys):
    """A checkpoint written before nsa_kv was removed (every run used its default, 'shared'):
    it loads with a note naming the dropped key, and computes what was saved."""
    m = Model(ModelConfig(attn="nsa", vocab_size=64, nsa_cmp_block=4, nsa_cmp_stride=2, nsa_block=8, nsa_topk=3))
    save_checkpoint(str(tmp_path / "ckpt.pt"), {"model": m.state_dict(), "model_config": {**vars(m.cfg), "nsa_kv": "shared"}})
    loaded, _ = load_checkpoint(tmp_path)
    assert "ignoring model_config keys this ModelConfig lacks: ['nsa_kv']" in capsys.readouterr().err
    idx = torch.randint(0, 64, (1, 20))
    with torch.no_grad():
        assert torch.equal(loaded(idx)[0], m.eval()(idx)[0])


def test_no_loader_in_the_project_turns_weights_only_off():
    needle = "weights_only=" + "False"
    try:  # the project's own files: committed and new ones, not a user's out/ and data/
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.split("\n")
        paths = [ROOT / p for p in listed if p]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked archive)
        paths = [p for p in ROOT.rglob("*") if not {".git", "out", "data"} & set(p.relative_to(ROOT).parts)]
    found = [str(p.relative_to(ROOT)) for p in paths if p.suffix in (".py", ".md", "")
             and p.is_file() and needle in p.read_text(errors="ignore")]
    assert len(paths) > 20 and found == [], found
