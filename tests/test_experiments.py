"""The experiments' own logic: the recall task's metadata, the verdict rule, and RESULTS.md
reading its numbers from the logs (fabricated small logs; nothing is trained here)."""
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))

import recall  # noqa: E402
import sweep  # noqa: E402
from data import load_shard, main as data_main, recall_sequences  # noqa: E402


def test_recall_queries_are_the_earlier_value_at_the_stated_distance():
    n_keys, n_values = 8, 16
    tokens, q = recall_sequences(20, seq_len=64, n_keys=n_keys, n_values=n_values, seed=3)
    assert tokens.shape == (20, 64) and len(q["pos"]) > 100
    checked = 0
    for s in range(20):
        row = tokens[s].astype(int)
        assert (row[0::2] < n_keys).all() and (row[1::2] >= n_keys).all()
        mine = {int(p): (a, d) for seq, p, a, d in zip(q["seq"], q["pos"], q["answer"], q["distance"]) if seq == s}
        last = {}
        for p in range(0, 64, 2):  # brute force: every key seen before is a query
            key = row[p]
            if key in last:
                prev = last[key]
                assert mine.pop(p) == (row[prev + 1], p - prev)
                assert row[p + 1] == row[prev + 1]  # one mapping per sequence
                checked += 1
            last[key] = p
        assert not mine  # no query that is not a repeated key
    assert checked == len(q["pos"])


def test_recall_is_deterministic_per_seed():
    a = recall_sequences(4, seed=7)
    b = recall_sequences(4, seed=7)
    c = recall_sequences(4, seed=8)
    assert np.array_equal(a[0], b[0]) and all(np.array_equal(a[1][k], b[1][k]) for k in a[1])
    assert not np.array_equal(a[0], c[0])


def test_recall_shards(tmp_path):
    assert data_main(["--source=recall", f"--out_dir={tmp_path}", "--max_tokens=20480",
                      "--recall=64,8,16,5"]) == 0
    val = load_shard(tmp_path / "recall_val_000000.bin")
    train = load_shard(tmp_path / "recall_train_000001.bin")
    assert len(val) == 2048 and len(train) == 18432
    # val: seed + 1, train: seed; whole sequences back to back
    assert np.array_equal(np.asarray(train), recall_sequences(288, 64, 8, 16, 5)[0].reshape(-1))
    assert np.array_equal(np.asarray(val), recall_sequences(32, 64, 8, 16, 6)[0].reshape(-1))


def test_accuracy_buckets():
    correct = np.array([1, 0, 1, 1, 0, 0], dtype=bool)
    distance = np.array([2, 32, 33, 64, 65, 200])
    b = recall.accuracy_by_bucket(correct, distance, window=32, n_layer=2)
    assert [(v["n"], v["acc"]) for v in b.values()] == [(2, 0.5), (2, 1.0), (2, 0.0)]


@pytest.mark.parametrize("ours,spread,paper,expected", [
    (-0.10, 0.02, -0.28, "reproduced"),
    (+0.10, 0.02, +0.09, "reproduced"),
    (+0.10, 0.02, -0.28, "not reproduced"),
    (-0.05, 0.02, +0.22, "not reproduced"),
    (-0.01, 0.02, -0.28, "inconclusive"),
    (+0.02, 0.02, -0.28, "inconclusive"),
])
def test_verdict(ours, spread, paper, expected):
    assert sweep.verdict(ours, spread, paper) == expected


def _fake_run(root, name, seed, vals, tok_s, mem, finished=True):
    run = root / "lm" / f"{name}_s{seed}"
    run.mkdir(parents=True)
    steps = [{"event": "start", "step": 0}, {"step": 0, "val": 11.0}]
    for i, (v, t, m) in enumerate(zip(vals, tok_s, mem), 1):
        steps.append({"step": i * 10, "loss": v + 0.1, "tok_s": t, "mem_gb": m, "val": v})
    if finished:
        steps.append({"event": "end", "step": len(vals) * 10})
    (run / "log.jsonl").write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    (run / "command.txt").write_text(f"python train.py --attn=x --seed={seed} --out_dir=out/lm/{name}_s{seed}\n")
    (run / "config.json").write_text(json.dumps({"num_params": 3e6, "train": {"max_steps": 10 * len(vals), "total_batch_tokens": 2048}}))


def test_results_md_numbers_come_from_the_logs(tmp_path):
    # tok_s: median over steps > 1 (step 10, 20, 30 here); mem: max; val: the last eval.
    _fake_run(tmp_path, "full", 0, [7.0, 6.50], [1000, 1100, 1200][:2], [1.0, 2.0])
    _fake_run(tmp_path, "full", 1, [7.1, 6.60], [1300, 1500], [1.5, 2.5])
    _fake_run(tmp_path, "dsa", 0, [6.9, 6.00], [900, 1000], [1.0, 3.0])
    _fake_run(tmp_path, "dsa", 1, [6.8, 6.20], [700, 800], [1.0, 3.5])
    _fake_run(tmp_path, "local", 0, [7.2, 6.56], [2000, 2000], [1.0, 1.0])
    _fake_run(tmp_path, "local", 1, [7.2, 6.58], [2000, 2000], [1.0, 1.0])
    _fake_run(tmp_path, "caa", 0, [7.5, 7.20], [500, 500], [4.0, 4.0])
    _fake_run(tmp_path, "dsa_nowin", 0, [7.5, 7.20], [500, 500], [4.0, 4.0], finished=False)
    md_path = tmp_path / "RESULTS.md"
    rows, _ = sweep.write_results(tmp_path, md_path)
    md = md_path.read_text()
    table = {line.split("|")[1].strip().split(" ")[0]: [c.strip() for c in line.split("|")[1:-1]]
             for line in md.splitlines() if line.startswith("| ") and not line.startswith("| config")}
    full_mean, full_spread = (6.50 + 6.60) / 2, 0.05
    assert table["full"][2] == f"{full_mean:.4f} ± {full_spread:.4f}"
    assert table["full"][6] == "baseline"
    # dsa: mean 6.10 ± 0.10; delta -0.45 ± 0.15, paper delta negative -> reproduced
    assert table["dsa"][2] == "6.1000 ± 0.1000"
    assert table["dsa"][3] == f"{6.10 - full_mean:+.4f} ± {0.10 + full_spread:.4f}"
    assert table["dsa"][5] == f"{4.6498 - 4.9266:+.4f} / {4.904 - 4.9266:+.4f}"
    assert table["dsa"][6] == "reproduced"
    assert table["dsa"][4] == "4.6498 (000) / 4.9040 (002)"
    # tok/s: seed means of the per-run medians (step 10 is step > 1 so it counts)
    full_tok = ((1000 + 1100) / 2 + (1300 + 1500) / 2) / 2
    dsa_tok = ((900 + 1000) / 2 + (700 + 800) / 2) / 2
    assert table["dsa"][7] == f"{dsa_tok / full_tok:.2f}x ({dsa_tok:.0f})"
    assert table["dsa"][8] == f"{3.25 / 2.25:.2f}x (3.25 GB)"
    assert table["dsa"][9] == "20/20"  # both seeds reach 6.55 at their second eval
    # local: +0.02 inside the spread 0.06 -> inconclusive; caa: one seed, worse -> not reproduced
    assert table["local"][6] == "inconclusive"
    assert table["caa"][1] == "1" and table["caa"][2] == "7.2000 ± 0.0000"
    assert table["caa"][6] == "inconclusive (1 seed: no spread)" and table["caa"][9] == "–"
    # a run without train.py's end record (still running, or killed) is left out
    assert "| dsa_nowin" in md and table["dsa_nowin"][2] == "not run (or unfinished)"
    assert "| asga_off" in md and "not run" in md  # configurations without runs are listed
    assert "--seed=SEED" in md and "full_sSEED" in md
    # every 4-decimal number in the table is one computed from the logs above
    allowed = {f"{abs(x):.4f}" for x in (full_mean, full_spread, 6.10, 0.10, 6.10 - full_mean, 0.15, 6.57, 0.01,
                                    6.57 - full_mean, 0.06, 7.20, 0.0, 7.20 - full_mean, 0.05)}
    allowed |= {f"{abs(p - 4.9266):.4f}" for p in (4.6498, 4.904, 5.021, 4.712)} | {"4.9266", "4.6498", "4.9040", "5.0210", "4.7120", "4.9180", "4.9270", "5.0120", "5.1480", "5.2010", "5.0870", "4.9300"}
    rows_text = "\n".join(l for l in md.splitlines() if l.startswith("| ") and not l.startswith("| config"))
    for number in re.findall(r"\d+\.\d{4}", rows_text):
        assert number in allowed, number


def test_committed_results_md_is_regenerated_from_committed_logs():
    """Every number in RESULTS.md comes from the committed run logs: rewriting it from
    experiments/results/ gives the committed file, byte for byte."""
    root = Path(__file__).resolve().parent.parent
    committed = root / "RESULTS.md"
    if not (root / "experiments" / "results" / "lm").is_dir():
        pytest.fail("experiments/results/lm is missing: RESULTS.md would have no source")
    out = root / f".RESULTS.check-{os.getpid()}.md"  # beside RESULTS.md: its links are relative
    try:
        sweep.write_results(root / "experiments" / "results", out)
        assert out.read_text() == committed.read_text()
    finally:
        out.unlink(missing_ok=True)
