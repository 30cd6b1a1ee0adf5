"""benchmarks/train_step.py --quick: the structure of its JSON and the meaning of its ratio
(no timing is asserted: speed lives in the benchmark's printed ratios)."""
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import train_step  # noqa: E402


def test_train_step_quick_json(tmp_path):
    out = tmp_path / "train_step.json"
    train_step.main(["--quick", f"--out={out}"])
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
    tokens = local["T"] * local["B"] * report["steps_per_sample"]
    assert abs(local["tok_s"] - tokens / statistics.median(local["seconds"])) < 1e-2 * local["tok_s"]
    for r in rows.values():
        assert "error" not in r, r
        assert r["tok_s"] > 0 and r["peak_mb"] > 0 and r["step_mb"] >= 0
        assert r["peak_mb"] >= r["step_mb"]
