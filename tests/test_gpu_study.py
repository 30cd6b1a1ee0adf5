"""experiments/gpu_study.py: the printed plan and its FLOP-model hours, the tiny study end to
end (every column of RESULTS_GPU.md filled, each number the one in the run's logs), a finished
study skipped, a changed plan refused with one line and --replan moving runs aside, SIGTERM
reaching the training and the same command resuming it, and torchrun with 2 processes (the
children form their own process group; paired runs start from `full`'s shared weights).

Shards: our own English sentences as bytes, made here; HellaSwag: tests/fixtures' 6 items.
Subprocesses run with OMP_NUM_THREADS=1 (the machines are shared)."""
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import data
import flops
from conftest import ENGLISH, ROOT
from model import PRESETS, Model, ModelConfig, read_checkpoint

sys.path.insert(0, str(ROOT / "experiments"))
import gpu_study  # noqa: E402
import sweep  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "hellaswag_tiny.jsonl"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STUDY = [sys.executable, "experiments/gpu_study.py"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def run(cmd, timeout=600):
    """cmd in its own session, so a timeout can kill its whole tree; fails with its output."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """~70k train and 6k val bytes: 2 sequences of 4 x 256 + 1 for the longest evaluation."""
    sentences = [s.strip() + "." for s in ENGLISH.split(". ") if s.strip()]
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.permutation(sentences)[: rng.integers(2, 6)]) for _ in range(300)]
    out = tmp_path_factory.mktemp("bytes")
    data.tokenize_to_shards(docs, str(out), "en", shard_tokens=100_000, val_tokens=6000, workers=1, tokenizer="byte")
    return out


def tiny(shards, out, *more):
    return STUDY + ["--tiny", "--configs=full,dsa", f"--data_dir={shards}", f"--out_dir={out}", *more]


@pytest.fixture(scope="module")
def study(shards, tmp_path_factory):
    """The tiny study (full and dsa, their timing jobs, HellaSwag on the fixture), one process."""
    out = tmp_path_factory.mktemp("study")
    r = run(tiny(shards, out, f"--hellaswag_file={FIXTURE}"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r


def table(md, header):
    """The rows (lists of cells) of the Markdown table whose header starts with `header`."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def log(run_dir):
    """log.jsonl's records (a line being written is left out)."""
    records = []
    for line in Path(run_dir, "log.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def snapshot(folder):
    return {p.relative_to(folder): (p.stat().st_size, p.stat().st_mtime_ns) for p in Path(folder).rglob("*") if p.is_file()}


# ----------------------------------------------------------------------------- the plan

def test_dry_run_plans_every_configuration_with_its_flop_hours_and_says_what_is_missing(capsys, tmp_path):
    """The real configuration, on this machine: no GPU, no shards. --assumed_mfu is set low so
    that two decimals of hours resolve the validation term (0.3% of the work)."""
    out, none = tmp_path / "study", tmp_path / "none"
    assert gpu_study.main(["--dry_run", "--gpus=8", "--assumed_mfu=0.003", f"--out_dir={out}", f"--data_dir={none}"]) == 0
    text = capsys.readouterr().out
    import attention
    assert {attn for _, attn, _ in gpu_study.CONFIGS} == set(attention.VARIANTS)
    rows = {m.group(1): (float(m.group(2)), float(m.group(3)), m.group(4)) for m in
            re.finditer(r"^  (\S+_s0)\s+([\d.]+)\s+([\d.]+)\s+–\s+(.+)$", text, re.M)}
    assert list(rows) == [f"{name}_s0" for name, *_ in sorted(gpu_study.CONFIGS, key=lambda c: c[0] != "full")]
    assert "5,000 steps x 524,288 tokens = 2,621,440,000 tokens at seq_len 1024" in text
    # full's hours from the FLOP model, computed here: training at 6N + attention, validation
    # (21 evaluations of 2^20 tokens) at a third of it, on 8 H100s at 0.3% of 989 TFLOP/s
    with torch.device("meta"):
        model = Model(ModelConfig(**PRESETS["qwen-134m"], vocab_size=50304, attn="full"))
    per_token = flops.flops_per_token(model, 1024)
    hours = (2_621_440_000 * per_token + 21 * 2**20 * per_token / 3) / (8 * 989e12 * 0.003) / 3600
    assert rows["full_s0"][:2] == (round(per_token / 1e6, 1), round(hours, 2)), (rows["full_s0"], per_token, hours)
    assert all(state == "to run" for *_, state in rows.values())
    total = float(re.search(r"^  total left\s+([\d.]+)", text, re.M).group(1))
    assert total == pytest.approx(sum(h for _, h, _ in rows.values()), abs=0.1 + 0.01 * len(rows))
    assert f"data: no shards at {none}" in text and f"--out_dir={none} --shards=27" in text
    if not torch.cuda.is_available():
        assert "a GPU: CUDA is not available here" in text
    assert "dry run: nothing was run or written" in text and not out.exists()


def test_a_run_is_finished_only_by_an_end_record_at_the_planned_step(tmp_path):
    """train.py writes `end` also after a job stopped early by --stop_step, and a resumed run
    logs steps after an earlier `end`: neither is a finished run of the plan."""
    def write(*records):
        Path(tmp_path, "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    step = lambda n: {"step": n, "loss": 1.0}  # noqa: E731
    write(step(1), step(2), {"event": "end", "step": 2})
    assert gpu_study.finished(tmp_path, 2) and not gpu_study.finished(tmp_path, 8)
    assert gpu_study.run_state(tmp_path, 8) == "to run"  # no checkpoint to resume from
    write(step(1), step(2), {"event": "end", "step": 2}, {"event": "resume", "step": 2}, step(3))
    assert not gpu_study.finished(tmp_path, 2) and not gpu_study.finished(tmp_path, 3)
    Path(tmp_path, "ckpt.pt").write_bytes(b"")
    assert gpu_study.run_state(tmp_path, 8) == "resumes (step 3 logged)"


# ----------------------------------------------------------------------------- the tiny study

def test_tiny_study_fills_every_column_from_the_runs_logs(study):
    out, r = study
    assert r.stdout.index("GPU study: 2 runs") < r.stdout.index("timing full:") < r.stdout.index("[1/2] full_s0:")
    md = (out / "RESULTS_GPU.md").read_text()
    configs = {row[0]: row for row in table(md, "| config | flags |")}
    runs = {row[0]: row for row in table(md, "| run | seqs |")}
    assert list(configs) == ["full", "dsa"] and list(runs) == ["full_s0", "dsa_s0"]
    for row in list(configs.values()) + list(runs.values()):
        assert all(c and c not in ("–", "pending") and not c.startswith(("–", "skipped", "not run")) for c in row), row
    vals = {}
    for name in ("full", "dsa"):
        records = log(out / f"{name}_s0")
        steps = [x for x in records if "loss" in x]
        assert records[-1]["event"] == "end" and records[-1]["step"] == 8
        vals[name] = [x["val"] for x in records if "val" in x and "event" not in x][-1]
        row = configs[name]
        assert row[3] == f"{vals[name]:.4f}"
        assert row[5] == f"{statistics.median(x['tok_s'] for x in steps if x['step'] > 1):,.0f}"
        assert row[7] == f"n/a on cpu: {statistics.median(x['flop_s'] for x in steps if x['step'] > 1) / 1e12:.3g} TFLOP/s"
        assert row[8] == f"{max(x['mem_gb'] for x in steps):.2f} GB"
        ev = json.loads((out / f"{name}_s0" / "eval.json").read_text())
        hs = json.loads((out / f"{name}_s0" / "hellaswag.json").read_text())["hellaswag"]
        cells = runs[f"{name}_s0"]
        assert cells[2:4] == [f"{ev['nats_per_token']:.4f}", f"{ev['bits_per_byte']:.4f}"]
        assert cells[4:9] == [f"{sweep.range_loss(ev, f, a, b):.4f}" for _, f, a, b in sweep.position_ranges(256)]
        assert cells[9:] == [f"{hs['acc']:.4f}", f"{hs['acc_norm']:.4f}", "6 (file)"]
    assert configs["full"][4] == "baseline" and configs["dsa"][4] == f"{vals['dsa'] - vals['full']:+.4f} (1 seed)"
    state = json.loads((out / "study.json").read_text())
    assert list(state["plan"]["runs"]) == ["full_s0", "dsa_s0"]
    assert all(state["timing"][name]["s_per_step"] > 0 and state["timing"][name]["world"] == 1 for name in ("full", "dsa"))
    for figure in ("figures/loss.png", "figures/positions.png", "analysis/summary.md"):
        assert (out / figure).exists() and f"]({figure})" in md


def test_a_finished_study_runs_nothing_again(study, shards):
    out, _ = study
    logs = {name: (out / name / "log.jsonl").stat().st_mtime_ns for name in ("full_s0", "dsa_s0")}
    r = run(tiny(shards, out, f"--hellaswag_file={FIXTURE}"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[1/2] full_s0: done before" in r.stdout and "[2/2] dsa_s0: done before" in r.stdout
    assert "timing" not in r.stdout.replace("timing job", "") and "step 1/" not in r.stdout
    assert logs == {name: (out / name / "log.jsonl").stat().st_mtime_ns for name in logs}


@pytest.mark.parametrize("change, named", [
    (["--max_steps=9"], "--max_steps 8 -> 9 (every run)"),
    (["--configs=full,dsa,local"], "configurations added: local"),
    (["--seeds=0,1"], "seeds 0 -> 0,1"),
    (["--preset=004"], "--preset cpu -> 004 (every run)"),
])
def test_a_changed_plan_is_refused_with_one_line_and_nothing_changes(study, shards, capsys, change, named):
    out, _ = study
    before = snapshot(out)
    configs = [] if change[0].startswith("--configs") else ["--configs=full,dsa"]
    assert gpu_study.main(["--tiny", f"--data_dir={shards}", f"--out_dir={out}"] + configs + change) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and named in err, err
    assert "--replan" in err and "--out_dir" in err
    assert snapshot(out) == before


def test_replan_moves_the_runs_it_changes_aside_and_runs_them_again(study, shards, tmp_path):
    old, _ = study
    out = tmp_path / "study"
    shutil.copytree(old, out)
    r = run(tiny(shards, out, "--configs=full", "--max_steps=9", "--replan", "--no_timing"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    aside = list((out / "replaced").glob("*/full_s0"))
    assert len(aside) == 1 and log(aside[0])[-1]["step"] == 8  # the old run, kept whole
    end = log(out / "full_s0")[-1]
    assert end["event"] == "end" and end["step"] == 9
    assert snapshot(out / "dsa_s0") == snapshot(old / "dsa_s0")  # not in the new plan: left alone
    plan = json.loads((out / "study.json").read_text())["plan"]
    assert list(plan["runs"]) == ["full_s0"] and "--max_steps=9" in plan["runs"]["full_s0"]
    assert [row[0] for row in table((out / "RESULTS_GPU.md").read_text(), "| config | flags |")] == ["full"]


def test_sigterm_checkpoints_the_run_and_the_same_command_resumes_it(shards, tmp_path):
    """The study passes SIGTERM to its training child (in a session of its own): train.py
    finishes the step, writes a checkpoint and exits 143; the study stops with 143; the same
    command then resumes the run from the checkpoint and finishes it."""
    out = tmp_path / "study"
    cmd = STUDY + ["--tiny", "--configs=full", f"--data_dir={shards}", f"--out_dir={out}", "--no_timing",
                   "--max_steps=60", "--eval_every=1000", "--ckpt_every=1000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 300
        while not (out / "full_s0" / "log.jsonl").exists() or not any("loss" in x for x in log(out / "full_s0")):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # the study alone: its child is in another session
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, stdout[-2000:] + stderr[-2000:]
    assert "stopped during full_s0" in stderr
    stopped = [x for x in log(out / "full_s0") if x.get("event") == "stopped"]
    assert len(stopped) == 1 and stopped[0]["step"] < 60 and (out / "full_s0" / "ckpt.pt").exists()
    r = run(cmd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resumed from step {stopped[0]['step']}" in r.stdout
    assert log(out / "full_s0")[-1]["event"] == "end" and log(out / "full_s0")[-1]["step"] == 60


# ----------------------------------------------------------------------------- torchrun

@pytest.mark.slow
def test_torchrun_two_processes_run_each_run_as_one_group_and_pair_the_initial_weights(shards, tmp_path):
    """Each rank runs the same children; every run is one 2-process group (its log says so and
    both ranks end with the same weights); rank 0 alone prints the plan. With lr 0 the final
    weights are the initial ones: dsa's shared parameters equal full's (experiments/paired.py)."""
    out = tmp_path / "study"
    r = run(TORCHRUN + tiny(shards, out, "--no_timing", "--lr=0", f"--hellaswag_file={FIXTURE}")[1:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("GPU study: 2 runs") == 1 and r.stdout.count("step 8/8") == 2
    for name in ("full_s0", "dsa_s0"):
        assert json.loads((out / name / "config.json").read_text())["world_size"] == 2
        end = log(out / name)[-1]
        assert end["event"] == "end" and len(set(end["param_sha256_per_rank"])) == 1 == len(end["param_sha256_per_rank"]) - 1
        assert json.loads((out / name / "hellaswag.json").read_text())["hellaswag"]["items"] == 6
    full = read_checkpoint(str(out / "full_s0" / "ckpt.pt"), "cpu")["model"]
    dsa = read_checkpoint(str(out / "dsa_s0" / "ckpt.pt"), "cpu")["model"]
    shared = [k for k in full if k in dsa]
    assert len(shared) == len(full) and len(dsa) > len(full)  # dsa adds its head gates
    assert all(torch.equal(full[k], dsa[k]) for k in shared)
