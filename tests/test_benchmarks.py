"""benchmarks/train_step.py --quick and benchmarks/gpu_check.py (tiny): the structure of its JSON and the meaning of its ratio
(no timing is asserted: speed lives in the benchmark's printed ratios).

Run as its own process, as a user runs it: the benchmark forks a child per configuration
before it runs any torch op, and a child forked from this test process (whose OpenMP
threads earlier tests started) deadlocked in the full suite."""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

import attention
import kernels as kernels_of_this_process

ROOT = Path(__file__).resolve().parent.parent


def test_train_step_quick_json(tmp_path):
    out = tmp_path / "train_step.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--quick", f"--out={out}"],
                   cwd=tmp_path, check=True, timeout=600, capture_output=True)
    report = json.loads(out.read_text())
    for key in ("command", "torch", "threads", "rounds", "steps_per_sample", "load_average", "memory", "rows"):
        assert key in report, key
    rows = {r["config"]: r for r in report["rows"]}
    assert set(rows) == {"full", "local"} and all(r["shape"] == "quick" for r in rows.values())
    assert rows["full"]["ratio"] == 1.0
    local = rows["local"]
    # the ratio is full's time over local's, per interleaved round, then the median
    assert len(local["seconds"]) == len(local["full_seconds"]) == report["rounds"]
    expected = statistics.median(a / b for a, b in zip(local["full_seconds"], local["seconds"]))
    assert abs(local["ratio"] - expected) < 1e-2 * expected
    expected = statistics.median(a / b for a, b in zip(local["full_cpu_seconds"], local["cpu_seconds"]))
    assert abs(local["cpu_ratio"] - expected) < 1e-2 * expected
    tokens = local["T"] * local["B"] * report["steps_per_sample"]
    assert abs(local["tok_s"] - tokens / statistics.median(local["seconds"])) < 1e-2 * local["tok_s"]
    for r in rows.values():
        assert "error" not in r, r
        assert r["tok_s"] > 0 and r["peak_mb"] > 0 and r["step_mb"] >= 0
        assert r["peak_mb"] >= r["step_mb"]
    # what bounds it: the attention layers' own ratio, and the step ratio that ratio allows
    assert rows["full"]["attn_ratio"] == 1.0 and rows["full"]["allows"] == pytest.approx(1.0)
    share = rows["full"]["attn_ms"] / (1e3 * statistics.median(rows["full"]["seconds"]) / report["steps_per_sample"])
    assert 0 < local["attn_share"] == pytest.approx(min(1.0, share))
    assert local["allows"] == pytest.approx(1 / (1 - local["attn_share"] + local["attn_share"] / local["attn_ratio"]))


def test_gpu_check_runs_every_step_at_the_tiny_shape(tmp_path):
    """benchmarks/gpu_check.py, the command a GPU user runs first, runs on a CPU at its tiny
    shape: the CUDA-only tests (skipped here, each with its reason), every configuration's
    attention core against SDPA, and training steps of every configuration after the
    preflight, into one JSON and one Markdown table."""
    out = tmp_path / "check.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), f"--out={out}"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check
    names = [n for n, _ in gpu_check.CONFIGS]
    assert {n.split("-")[0] for n in names} == set(attention.VARIANTS)  # every variant is checked
    assert result["tests"]["skipped"] >= 2 and result["tests"]["failed"] == 0 and result["tests"]["passed"] == 0
    for section in ("attention", "training"):
        rows = result[section]
        assert not [r for r in rows if "error" in r], rows
        assert sorted({r["config"] for r in rows}) == sorted(names)
    for row in result["training"]:
        assert row["tok_s"] > 0 and row["kernel"] == "fused" and row["mfu"] is None
        assert row["flop_s"] == pytest.approx(row["flops_per_token"] * row["tok_s"])
    md = (tmp_path / "check.md").read_text()
    assert all(f"| {n} |" in md for n in names) and "tests (pytest -m cuda)" in md


def test_train_step_ab_runs_each_checkouts_own_code(tmp_path):
    """benchmarks/train_step_ab.py imports each checkout's model, attention and kernels apart:
    a second checkout's attention calls its own kernels (marked here), not the first's; and a
    tiny run writes one sample of full and of the configuration per checkout and round."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import train_step_ab
    finally:
        sys.path.pop(0)
    other = tmp_path / "other"
    other.mkdir()
    for name in ("model.py", "attention.py", "kernels.py"):
        text = (ROOT / name).read_text()
        (other / name).write_text(text + "\nMARK = 'other'\n" if name == "kernels.py" else text)
    train_step_ab.load("ab_here", ROOT)
    train_step_ab.load("ab_other", other)
    here_kernels, other_kernels = sys.modules["ab_here_kernels"], sys.modules["ab_other_kernels"]
    assert getattr(other_kernels, "MARK", None) == "other" and not hasattr(here_kernels, "MARK")
    assert sys.modules["ab_other_attention"].kernels is other_kernels
    assert sys.modules["ab_here_attention"].kernels is here_kernels
    assert sys.modules["ab_other_model"].RMSNorm is sys.modules["ab_other_attention"].RMSNorm
    assert sys.modules["kernels"] is kernels_of_this_process  # the test process's own stay in place

    out = tmp_path / "ab.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_step_ab.py"), f"a={ROOT}", f"b={other}",
                    "--shape=quick", "--only=local", "--rounds=2", f"--out={out}"],
                   cwd=tmp_path, check=True, timeout=600, capture_output=True)
    samples = json.loads(out.read_text())["samples"]
    assert set(samples) == {f"{c}/local/{o}" for c in "ab" for o in ("full", "local")}
    assert all(len(s) == 2 and all(wall > 0 and cpu > 0 for wall, cpu in s) for s in samples.values())
