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
from dataclasses import asdict, replace

import pytest
import torch

import config
import data
import train
from attention import VARIANTS
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


def run(cmd, check=True, timeout=300, env=ENV):
    """Run cmd in its own process group; on a timeout kill the whole group (torchrun's
    workers too) and fail with what it printed."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
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


def plan(capsys, *args, out, world=None, monkeypatch=None):
    """train.py --dry_run=True in this process, with its run folder under `out` (a test's
    tmp_path, never the checkout's out/run) -> what it printed."""
    if world:
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", str(world))):
            monkeypatch.setenv(k, v)
    train.main(["--dry_run=True", f"--out_dir={out / 'run'}", *args])
    return capsys.readouterr().out


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def step_losses(out_dir):
    return {r["step"]: r["loss"] for r in read_log(out_dir) if "loss" in r}


# ----------------------------------------------------------------------------- defaults and plan

def test_cuda_dry_run_plans_the_papers_model(capsys, tmp_path):
    text = plan(capsys, "--device=cuda", "--attn=asga", f"--data_dir={tmp_path / 'none'}", out=tmp_path)
    params = float(re.search(r"qwen-134m \(([\d.]+)M parameters\)", text).group(1))
    assert 130 < params < 140, text
    assert "bfloat16 autocast, float32 master weights, TF32" in text
    assert "compile     on" in text and "524,288 tokens/step" in text and "asga" in text
    assert "preflight   on: kernel=fused" in text and "MFLOPs per token at T = 1024" in text
    assert f"no shards found at {tmp_path / 'none'}" in text


def test_cpu_dry_run_plans_the_cpu_default_and_presets_win(capsys, tmp_path):
    cpu = plan(capsys, "--device=cpu", f"--data_dir={tmp_path}", out=tmp_path)
    assert "preset cpu" in cpu and "float32" in cpu and "bfloat16" not in cpu and "compile     off" in cpu and "preflight   off" in cpu
    if not torch.cuda.is_available():  # no --device: this machine's default is the CPU one
        assert plan(capsys, f"--data_dir={tmp_path}", out=tmp_path) == cpu
    forced = plan(capsys, "--device=cuda", "--preset=cpu", f"--data_dir={tmp_path}", out=tmp_path)
    assert "preset cpu" in forced and "bytes (0.9M parameters)" in forced and "qwen-134m" not in forced
    paper = plan(capsys, "--device=cpu", "--preset=004", "--max_steps=7", f"--data_dir={tmp_path}", out=tmp_path)
    assert "qwen-134m" in paper and "preset 004" in paper and "steps       7," in paper


def test_data_budget_warning_names_epochs_and_the_shards_to_fetch(capsys, shards, tmp_path):
    step_tokens = config.TRAIN_PRESETS["cpu"]["total_batch_tokens"]
    found = sum(len(data.load_shard(p)) for p in data.find_shards(shards, "train"))  # 179,968
    text = plan(capsys, "--device=cpu", f"--data_dir={shards}", "--max_steps=1000", out=tmp_path)
    assert f"{found:,} training tokens found" in text
    warning = [line for line in text.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and f"{1000 * step_tokens / found:.2f} epochs" in warning[0], text
    assert f"python data.py --source=fineweb-gpt2 --out_dir={shards} --shards=1" in warning[0]
    big = plan(capsys, "--device=cpu", f"--data_dir={shards}", f"--max_steps={250_000_000 // step_tokens}", out=tmp_path)
    assert "--shards=3" in big  # 250M tokens: 3 shards of 100M
    assert "warning:" not in plan(capsys, "--device=cpu", f"--data_dir={shards}", f"--max_steps={found // step_tokens}",
                                 out=tmp_path)


@pytest.mark.parametrize("max_steps", [1000, 30_000])  # 4.1M tokens (the cpu preset), 123M (val capped at 10M)
def test_the_byte_command_the_plan_names_makes_enough_tokens(capsys, tmp_path, max_steps):
    """data.py's --max_tokens counts the val shard too: the command must leave room for it,
    or the run it was named for would repeat its data."""
    text = plan(capsys, "--device=cpu", f"--data_dir={tmp_path / 'none'}", f"--max_steps={max_steps}", out=tmp_path)
    max_tokens = int(re.search(r"--tokenizer=byte --source=fineweb \S+ --max_tokens=(\d+)", text).group(1))
    val = min(10_000_000, max(max_tokens // 10, 1))  # data.py's default val shard
    assert max_tokens - val >= max_steps * config.TRAIN_PRESETS["cpu"]["total_batch_tokens"], text


def test_defaults_fit_any_world_size_and_typed_values_do_not(capsys, monkeypatch, tmp_path):
    # cpu default: 16 x 256 x 2 processes = 8192 > 4096 tokens: the global batch stays, batch_size halves
    text = plan(capsys, "--device=cpu", f"--data_dir={tmp_path}", out=tmp_path, world=2, monkeypatch=monkeypatch)
    assert "note: batch_size 16 -> 8" in text and "4,096 tokens/step = 8 seq x 256 tokens x 2 process(es) x 1" in text
    # 3 processes cannot split 4096 tokens of 256-token sequences: the global batch moves to
    # the nearest multiple of 16 x 256 x 3
    text = plan(capsys, "--device=cpu", f"--data_dir={tmp_path}", out=tmp_path, world=3, monkeypatch=monkeypatch)
    assert "note: total_batch_tokens 4,096 -> 12,288" in text
    # the GPU default on 3 GPUs: 2^19 -> 11 x (16 x 1024 x 3)
    text = plan(capsys, "--device=cuda", f"--data_dir={tmp_path}", out=tmp_path, world=3, monkeypatch=monkeypatch)
    assert "note: total_batch_tokens 524,288 -> 540,672" in text and "x 3 process(es) x 11 accumulation" in text
    with pytest.raises(SystemExit):  # typed values are the user's: an error, not a silent change
        plan(capsys, "--device=cpu", "--total_batch_tokens=1024", "--batch_size=8", f"--data_dir={tmp_path}",
             out=tmp_path, world=3, monkeypatch=monkeypatch)
    assert "not divisible" in capsys.readouterr().err


# ----------------------------------------------------------------------------- windows

WINDOWED = [["--attn=local"], ["--attn=dsa"], ["--attn=dsa", "--dsa_window=fixed"], ["--attn=asga", "--asga_gate=fixed"],
            ["--attn=caa"], ["--attn=combiner"], ["--attn=nsa"], ["--attn=moba"]]


@pytest.mark.parametrize("preset", list(config.TRAIN_PRESETS))
def test_every_presets_windows_are_shorter_than_its_sequence(preset, tmp_path):
    for flags in WINDOWED:
        tc, mc, _ = config.parse_args(["--device=cpu", f"--preset={preset}", f"--data_dir={tmp_path}", *flags])
        line, warning = VARIANTS[mc.attn].describe(mc, tc.seq_len)
        assert warning is None and f"of a {tc.seq_len}-token sequence" in line, (preset, flags, line, warning)
    assert mc.window < tc.seq_len - 1 and mc.dsa_threshold < tc.seq_len


def test_the_plan_prints_each_variants_window_and_warns_when_it_covers_the_sequence(capsys, tmp_path):
    def window_lines(*flags):
        text = plan(capsys, "--device=cpu", f"--data_dir={tmp_path}", *flags, out=tmp_path)
        return [l for l in text.splitlines() if l.startswith("  window")
                or l.startswith("warning: ") and not l.startswith("warning: no shards")]
    assert window_lines("--attn=local") == ["  window      64 keys back, of a 256-token sequence"]
    assert window_lines("--attn=dsa") == ["  window      64 keys back for queries at positions >= 128 (dsa_threshold), "
                                          "every key below it, of a 256-token sequence"]
    caa, = window_lines("--attn=caa")
    assert "local branch 64 to 128 keys back" in caa and "top-k k_i = ceil(sqrt(i + 1))" in caa
    assert window_lines("--attn=full") == ["  window      none: every key j <= i, of a 256-token sequence"]
    for flags, cause in ((["--attn=local", "--window=255"], "local: window 255 covers the whole 256-token sequence"),
                         (["--attn=dsa", "--dsa_threshold=256"], "dsa: dsa_threshold 256 >= seq_len 256"),
                         (["--attn=caa", "--window=300", "--caa_window_max=400"], "caa: window 300 covers"),
                         (["--attn=combiner", "--window=256"], "combiner: block 256 >= seq_len 256"),
                         (["--attn=moba", "--moba_topk=16"], "moba: 16 blocks of 16 cover the whole 256-token sequence"),
                         (["--attn=nsa", "--nsa_topk=16"], "nsa: its 16 selected blocks of 16 cover the whole")):
        warning = window_lines(*flags)[-1]
        assert warning.startswith(f"warning: {cause}") and re.search(r"full attention; pass (a smaller )?--", warning), warning
    assert len(window_lines("--attn=local", "--window=254")) == 1  # 254 keys back: the first key is out of reach


def test_local_differs_from_full_under_the_cpu_preset(tmp_path):
    """The CPU examples' `local` is not full attention: with the same weights, logits agree up
    to position `window` (every key is within reach) and differ after it."""
    from model import Model
    tc, full_cfg, _ = config.parse_args(["--device=cpu", f"--data_dir={tmp_path}", "--vocab_size=256"])
    local_cfg = replace(full_cfg, attn="local")
    torch.manual_seed(0)
    full = Model(full_cfg).eval()
    local = Model(local_cfg).eval()
    local.load_state_dict(full.state_dict())
    x = torch.randint(0, 256, (1, tc.seq_len))
    with torch.no_grad():
        a, b = full(x)[0], local(x)[0]  # (1, T, V) logits
    W = local_cfg.window
    assert torch.allclose(a[:, : W + 1], b[:, : W + 1], atol=1e-5)
    assert (a[0, W + 1:] - b[0, W + 1:]).abs().amax(-1).min() > 1e-4  # every later position differs


# ----------------------------------------------------------------------------- a used run folder

def used_run_folder(path, **model_changes):
    """A run folder as a finished `python train.py` leaves it (ckpt.pt, config.json, log.jsonl);
    the dry run reads only the checkpoint's presence and config.json's model config."""
    tc, mc, _ = config.parse_args(["--device=cpu", f"--data_dir={path / 'no_data'}"])
    path.mkdir(parents=True)
    (path / "ckpt.pt").write_bytes(b"a checkpoint")
    (path / "config.json").write_text(json.dumps({"model": {**asdict(mc), **model_changes}}))
    (path / "log.jsonl").write_text('{"step": 1000, "val": 1.83}\n')
    return path


@pytest.mark.parametrize("resume, action", [("false", "refuse"), ("true", "resume the run in"), ("auto", "resume the run in")])
def test_dry_run_on_a_used_folder_prints_the_plan_and_what_a_run_would_do(capsys, tmp_path, resume, action):
    run = used_run_folder(tmp_path / "run")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    train.main(["--dry_run=True", "--device=cpu", f"--data_dir={tmp_path / 'no_data'}", f"--out_dir={run}",
                f"--resume={resume}"])
    text = capsys.readouterr().out
    assert text.startswith("plan\n") and "model       bytes" in text and "tokens      4,096,000 planned" in text
    assert f"dry run: a real run would {action} {run}" in text, text
    if action == "refuse":
        assert "already holds a run (ckpt.pt); pass --resume=True" in text and f"run folder  {run} (a real run would refuse it" in text
    else:
        assert f"run folder  {run} (resuming)" in text
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before  # a dry run writes nothing


def test_dry_run_says_a_run_would_start_refuse_an_empty_resume_or_another_model(capsys, tmp_path):
    args = ["--dry_run=True", "--device=cpu", f"--data_dir={tmp_path / 'no_data'}"]
    train.main([*args, f"--out_dir={tmp_path / 'new'}"])
    assert f"dry run: a real run would start a new run in {tmp_path / 'new'}\n" in capsys.readouterr().out
    train.main([*args, f"--out_dir={tmp_path / 'new'}", "--resume=True"])
    assert "would refuse" in (text := capsys.readouterr().out) and "ckpt.pt does not exist" in text
    other = used_run_folder(tmp_path / "other", n_layer=3)  # a run of a 3-layer model; the preset has 4
    train.main([*args, f"--out_dir={other}", "--resume=True"])
    text = capsys.readouterr().out
    assert "would refuse" in text and "model config differs" in text and "'n_layer': (3, 4)" in text, text
    assert not (tmp_path / "new").exists()  # nothing made


# ----------------------------------------------------------------------------- torchrun

@pytest.mark.parametrize("nproc, attn", [(2, "caa"), (3, "asga")])
def test_torchrun_with_only_a_data_folder_trains_and_checkpoints(shards, tmp_path, nproc, attn):
    """torchrun with 2 and with 3 processes and no flag but the data folder (and a variant with
    gates): one plan printed, a checkpoint, every rank ending with the same weights. dsa under
    torchrun: test_the_stages_under_torchrun_match_one_process (tests/test_init.py) and
    tests/test_gpu_study.py's torchrun study; asga at 2 processes adds nothing to asga at 3."""
    r = run([*TORCHRUN, f"--nproc_per_node={nproc}", "train.py", f"--attn={attn}",
             f"--data_dir={shards}", f"--out_dir={tmp_path / 'run'}", "--max_steps=1"],
            env=threads_at_exit_printed(tmp_path))
    ckpt = read_checkpoint(tmp_path / "run")
    assert ckpt["step"] == 1 and ckpt["model_config"]["attn"] == attn
    assert r.stdout.count("plan\n") == 1 and f"x {nproc} process(es)" in r.stdout
    end = read_log(tmp_path / "run")[-1]
    assert end["event"] == "end" and len(set(end["param_sha256_per_rank"])) == 1
    assert len(end["param_sha256_per_rank"]) == nproc
    # No gloo thread may outlive train.py into the interpreter's shutdown: one that touched
    # Python there aborted finished runs (rc -6), rarely, in CI.
    at_exit = re.findall(r"threads at exit: (.*)", r.stderr)
    assert len(at_exit) == nproc + 1, r.stderr[-3000:]  # the workers and torchrun's agent
    assert not any("gloo" in line for line in at_exit), at_exit


def threads_at_exit_printed(folder):
    """The environment for a subprocess that prints, when its interpreter begins to exit, the
    names of its native threads (a sitecustomize.py on PYTHONPATH; Linux's /proc names them,
    elsewhere it prints that it cannot)."""
    (folder / "sitecustomize.py").write_text(
        "import atexit, os, sys\n"
        "def _threads():\n"
        "    if not os.path.isdir('/proc/self/task'):\n"
        "        return sys.stderr.write('threads at exit: not listed (no /proc)\\n')\n"
        "    names = sorted(open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task'))\n"
        "    sys.stderr.write(f'threads at exit: {names}\\n')\n"
        "atexit.register(_threads)\n")
    return {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), ENV.get("PYTHONPATH")]))}


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
    # address from torchrun's store and failed to connect: config.init_process_group)
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
