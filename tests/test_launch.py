"""How train.py is launched: defaults chosen by the device, the plan and --dry_run, the data
budget, any number of torchrun processes, errors printed once, --resume=auto and surviving a
torchrun restart after a worker is killed.

Shards here are data.py's synthetic recall shards (no tokenizer needed, so nothing skips on a
fresh clone). Subprocesses run with OMP_NUM_THREADS=1 (the machines are shared).
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import data
import train
from conftest import ROOT
from model import read_checkpoint

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
# A small run: the tiny model on 2 x 32-token micro-batches per process.
SMALL = ["--model=tiny", "--seq_len=32", "--batch_size=2", "--total_batch_tokens=128",
         "--val_tokens=128", "--warmup_steps=2", "--eval_every=1000"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("recall")
    data.write_recall_shards(str(out), max_tokens=200_000, seq_len=128)  # 180k train, 20k val tokens
    return str(out)


def run(cmd, check=True, timeout=300):
    """Run cmd in its own process group; on a timeout kill the whole group (torchrun's
    workers too) and fail with what it printed."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    out, err = finish(proc, timeout)
    if check:
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def finish(proc, timeout):
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")


def plan(capsys, *args, world=None, monkeypatch=None):
    """train.py --dry_run=True in this process -> what it printed."""
    if world:
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", str(world))):
            monkeypatch.setenv(k, v)
    train.main(["--dry_run=True", *args])
    return capsys.readouterr().out


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def step_losses(out_dir):
    return {r["step"]: r["loss"] for r in read_log(out_dir) if "loss" in r}


# ----------------------------------------------------------------------------- defaults and plan

def test_cuda_dry_run_plans_the_papers_model(capsys, tmp_path):
    out = plan(capsys, "--device=cuda", "--attn=asga", f"--data_dir={tmp_path / 'none'}")
    params = float(re.search(r"qwen-134m \(([\d.]+)M parameters\)", out).group(1))
    assert 130 < params < 140, out
    assert "bfloat16 autocast, float32 master weights, TF32" in out
    assert "compile     on" in out and "524,288 tokens/step" in out and "asga" in out
    assert f"no shards found at {tmp_path / 'none'}" in out


def test_cpu_dry_run_plans_the_cpu_default_and_presets_win(capsys, tmp_path):
    cpu = plan(capsys, "--device=cpu", f"--data_dir={tmp_path}")
    assert "preset cpu" in cpu and "float32" in cpu and "bfloat16" not in cpu and "compile     off" in cpu
    if not torch.cuda.is_available():  # no --device: this machine's default is the CPU one
        assert plan(capsys, f"--data_dir={tmp_path}") == cpu
    forced = plan(capsys, "--device=cuda", "--preset=cpu", f"--data_dir={tmp_path}")
    assert "preset cpu" in forced and "bytes (0.9M parameters)" in forced and "qwen-134m" not in forced
    paper = plan(capsys, "--device=cpu", "--preset=004", "--max_steps=7", f"--data_dir={tmp_path}")
    assert "qwen-134m" in paper and "preset 004" in paper and "steps       7," in paper


def test_data_budget_warning_names_epochs_and_the_shards_to_fetch(capsys, shards):
    step_tokens = train.TRAIN_PRESETS["cpu"]["total_batch_tokens"]
    found = sum(len(data.load_shard(p)) for p in data.find_shards(shards, "train"))  # 179,968
    out = plan(capsys, "--device=cpu", f"--data_dir={shards}", "--max_steps=1000")
    assert f"{found:,} training tokens found" in out
    warning = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and f"{1000 * step_tokens / found:.2f} epochs" in warning[0], out
    assert f"python data.py --source=fineweb-gpt2 --out_dir={shards} --shards=1" in warning[0]
    big = plan(capsys, "--device=cpu", f"--data_dir={shards}", f"--max_steps={250_000_000 // step_tokens}")
    assert "--shards=3" in big  # 250M tokens: 3 shards of 100M
    assert "warning" not in plan(capsys, "--device=cpu", f"--data_dir={shards}", f"--max_steps={found // step_tokens}")


def test_defaults_fit_any_world_size_and_typed_values_do_not(capsys, monkeypatch, tmp_path):
    # cpu default: 16 x 256 x 2 processes = 8192 > 4096 tokens: the global batch stays, batch_size halves
    out = plan(capsys, "--device=cpu", f"--data_dir={tmp_path}", world=2, monkeypatch=monkeypatch)
    assert "note: batch_size 16 -> 8" in out and "4,096 tokens/step = 8 seq x 256 tokens x 2 process(es) x 1" in out
    # 3 processes cannot split 4096 tokens of 256-token sequences: the global batch moves to
    # the nearest multiple of 16 x 256 x 3
    out = plan(capsys, "--device=cpu", f"--data_dir={tmp_path}", world=3, monkeypatch=monkeypatch)
    assert "note: total_batch_tokens 4,096 -> 12,288" in out
    # the GPU default on 3 GPUs: 2^19 -> 11 x (16 x 1024 x 3)
    out = plan(capsys, "--device=cuda", f"--data_dir={tmp_path}", world=3, monkeypatch=monkeypatch)
    assert "note: total_batch_tokens 524,288 -> 540,672" in out and "x 3 process(es) x 11 accumulation" in out
    with pytest.raises(SystemExit):  # typed values are the user's: an error, not a silent change
        plan(capsys, "--device=cpu", "--total_batch_tokens=1024", "--batch_size=8", world=3, monkeypatch=monkeypatch)
    assert "not divisible" in capsys.readouterr().err


# ----------------------------------------------------------------------------- torchrun

@pytest.mark.parametrize("nproc, attn", [(2, "asga"), (2, "caa"), (3, "asga"), (3, "dsa")])
def test_torchrun_with_only_a_data_folder_trains_and_checkpoints(shards, tmp_path, nproc, attn):
    r = run([*TORCHRUN, f"--nproc_per_node={nproc}", "train.py", f"--attn={attn}",
             f"--data_dir={shards}", f"--out_dir={tmp_path}", "--max_steps=1"])
    ckpt = read_checkpoint(tmp_path)
    assert ckpt["step"] == 1 and ckpt["model_config"]["attn"] == attn
    assert r.stdout.count("plan\n") == 1 and f"x {nproc} process(es)" in r.stdout
    end = read_log(tmp_path)[-1]
    assert end["event"] == "end" and len(set(end["param_sha256_per_rank"])) == 1
    assert len(end["param_sha256_per_rank"]) == nproc


def test_an_error_under_torchrun_is_printed_once(shards, tmp_path):
    r = run([*TORCHRUN, "--nproc_per_node=2", "train.py", "--attn=flash", f"--data_dir={shards}",
             f"--out_dir={tmp_path}"], check=False)
    assert r.returncode != 0
    assert r.stderr.count("error: unknown --attn=flash") == 1, r.stderr


# ----------------------------------------------------------------------------- resume

def test_resume_auto_starts_continues_and_refuses_another_model(shards, tmp_path):
    args = [sys.executable, "train.py", *SMALL, f"--data_dir={shards}", f"--out_dir={tmp_path}",
            "--max_steps=4", "--resume=auto"]
    first = run([*args, "--stop_step=2"])  # an empty folder: a new run
    assert "new run" in first.stdout and read_checkpoint(tmp_path)["step"] == 2
    second = run(args)  # a checkpoint: continue it
    assert "resumed from step 2; lost 0 step(s)" in second.stdout
    assert read_checkpoint(tmp_path)["step"] == 4 and sorted(step_losses(tmp_path)) == [1, 2, 3, 4]
    other = run([*args, "--n_layer=3"], check=False)
    assert other.returncode != 0 and "model config differs" in other.stderr and "n_layer" in other.stderr


def worker_pid(parent, rank, timeout=60):
    """The pid of the torchrun worker with RANK=rank among parent's descendants."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if ppid == parent and f"RANK={rank}".encode() in env:
                return int(pid)
        time.sleep(0.05)
    raise TimeoutError(f"no worker with RANK={rank} under pid {parent}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the worker through /proc")
def test_torchrun_restart_after_a_killed_worker_resumes_exactly(shards, tmp_path):
    args = ["train.py", *SMALL, f"--data_dir={shards}", "--max_steps=30", "--ckpt_every=3"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run([*TORCHRUN, "--nproc_per_node=2", *args, f"--out_dir={straight}"], timeout=600)

    # --max-restarts=1: one restart must resume (a restarted group once read the dead rank's
    # address from torchrun's store and failed to connect: train.init_process_group)
    proc = subprocess.Popen([*TORCHRUN, "--nproc_per_node=2", "--max-restarts=1", *args, f"--out_dir={killed}"],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        victim = worker_pid(proc.pid, 1)
        deadline = time.time() + 300
        while time.time() < deadline:  # step 5 logged: the checkpoint of step 3 is on disk
            try:
                if max(step_losses(killed), default=0) >= 5:
                    break
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            assert proc.poll() is None, finish(proc, 60)
            time.sleep(0.02)
        os.kill(victim, signal.SIGKILL)
        out, err = finish(proc, 300)
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
    finally:  # never leave workers behind
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    resumed = [r for r in read_log(killed) if r.get("event") == "resumed"]
    assert len(resumed) == 1 and resumed[0]["restart"] == 1 and resumed[0]["step"] % 3 == 0
    at, restart, lost = resumed[0]["step"], resumed[0]["restart"], resumed[0]["lost_steps"]
    assert at >= 3 and f"torchrun restart {restart}: resumed from step {at}; lost {lost} step(s)" in out
    a, b = step_losses(straight), step_losses(killed)
    assert sorted(b) == list(range(1, 31))  # every step once: the lost ones were redone
    assert all(a[s] == b[s] for s in range(at + 1, 31)), [(s, a[s], b[s]) for s in range(at + 1, 31) if a[s] != b[s]]
    wa, wb = read_checkpoint(straight)["model"], read_checkpoint(killed)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
