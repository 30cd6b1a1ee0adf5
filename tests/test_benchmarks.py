"""benchmarks/train_step.py --quick: the structure of its JSON and the meaning of its ratio
(no timing is asserted: speed lives in the benchmark's printed ratios).

Run as its own process, as a user runs it: the benchmark forks a child per configuration
before it runs any torch op, and a child forked from this test process (whose OpenMP
threads earlier tests started) deadlocked in the full suite."""
import json
import statistics
import subprocess
import sys
from pathlib import Path

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
