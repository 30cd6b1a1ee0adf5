"""Long-range recall probe: what a window throws away, measured by distance.

    python experiments/recall.py --attn=local --seed=0 --out_dir=experiments/results/recall/local_s0

Makes the synthetic recall shards once (`data.py --source=recall`, see
`data.recall_sequences`: streams of `key value` pairs, a fresh random key -> value map per
sequence, keys recurring at many distances), trains a model on them through train.py (skipped
when the run already finished), then scores it on held-out sequences that it regenerates from
their own seed: accuracy = argmax of the logits at a query position equals the value paired
with that key earlier in the sequence. Queries are bucketed by distance relative to the window
W and the stacked receptive field of a windowed model, n_layer x W:
    d <= W            every variant can see the answer (at distance d - 1) in one hop
    W < d <= L*W      beyond one window, inside the stacked receptive field
    d > L*W           beyond anything `local` can reach; chance is 1 / n_values
Writes OUT_DIR/recall.json (accuracy and count per bucket, chance, the command).

Scaled-down geometry so that it is cheap on a CPU: sequences of 256, window 32 (dsa's
adaptive threshold 64, caa's widest window 64), the tiny 2-layer model with an untied LM head
(with the tied head the tiny model stalled at the unigram loss on this vocabulary).

Tuning, measured on this CPU (full attention; chance 1/16): 32 keys / 64 values stayed at the
bigram loss for 350 steps of 32 x 256 tokens; 16 keys / 16 values learns, slowly: 17%
accuracy (18.5% at d <= 32, 11% at d > 64) after 500 steps of 8 x 256 tokens at lr 3e-3;
lr 1e-2 learned more slowly. With the settings below but 600 steps (8 x 256, seed 0, 512
held-out sequences) `full` scored 0.174 / 0.141 / 0.108 in the three buckets and `local`
0.193 / 0.109 / 0.071 (chance 0.0625). No sharp induction transition happened within these
budgets, so the probe measures early, partial retrieval: compare variants, not absolute
numbers.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from data import recall_sequences  # noqa: E402

TASK = dict(seq_len=256, n_keys=16, n_values=16, seed=0)
DATA_TOKENS = 4_000_000  # train + val tokens in the recall shards
EVAL_SEED, EVAL_SEQS = 10_000, 256  # held-out sequences: a seed no shard uses
# train.py overrides of every recall run (the sweep may change max_steps).
TRAIN = dict(model="tiny", vocab_size=256, tie_embeddings=False, window=32, dsa_threshold=64,
             caa_window_max=64, seq_len=TASK["seq_len"], batch_size=8, total_batch_tokens=2048,
             lr=3e-3, warmup_steps=30, max_steps=500, eval_every=100, val_tokens=4096,
             ckpt_every=100000)


def make_data(data_dir):
    """The recall shards, made once (a marker file records the task they were made for)."""
    marker = Path(data_dir) / "recall_task.json"
    if marker.exists() and json.loads(marker.read_text()) == TASK:
        return
    task = ",".join(str(TASK[k]) for k in ("seq_len", "n_keys", "n_values", "seed"))
    subprocess.run([sys.executable, str(ROOT / "data.py"), "--source=recall", f"--out_dir={data_dir}",
                    f"--max_tokens={DATA_TOKENS}", f"--recall={task}"], check=True)
    marker.write_text(json.dumps(TASK))


def train_command(attn, seed, data_dir, out_dir, flags=None, **overrides):
    """The train.py command line of one recall run (a list, for subprocess)."""
    args = {**TRAIN, **overrides, "attn": attn, **(flags or {}), "seed": seed,
            "data_dir": _rel(data_dir), "out_dir": _rel(out_dir)}
    return [sys.executable, "train.py"] + [f"--{k}={v}" for k, v in args.items()]


def _rel(path):
    """Paths inside the repository as relative ones (train.py runs from its root), so the
    committed commands run anywhere."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def run_finished(out_dir):
    """True when out_dir's log.jsonl ends with train.py's `end` record."""
    log = Path(out_dir) / "log.jsonl"
    if not log.exists():
        return False
    for line in reversed(log.read_text().splitlines()):
        try:
            return json.loads(line).get("event") == "end"
        except json.JSONDecodeError:
            continue
    return False


def bucket_edges(window, n_layer):
    """[(label, lo, hi)]: distances lo < d <= hi."""
    reach = n_layer * window
    return [(f"d <= {window}", 0, window), (f"{window} < d <= {reach}", window, reach),
            (f"d > {reach}", reach, float("inf"))]


def accuracy_by_bucket(correct, distance, window, n_layer):
    """{label: {'acc', 'n', 'lo', 'hi'}} from per-query correctness (bool) and distance."""
    out = {}
    for label, lo, hi in bucket_edges(window, n_layer):
        sel = (distance > lo) & (distance <= hi)
        n = int(sel.sum())
        out[label] = {"acc": float(correct[sel].mean()) if n else None, "n": n, "lo": lo,
                      "hi": None if hi == float("inf") else hi}
    return out


@torch.no_grad()
def evaluate(run_dir, n_seq=EVAL_SEQS, seed=EVAL_SEED, batch=64):
    """Recall accuracy of the checkpoint in run_dir on n_seq fresh sequences."""
    from model import load_checkpoint

    model, ckpt = load_checkpoint(run_dir, "cpu")
    cfg = model.cfg
    # Train mode under no_grad: the model has no dropout, so the outputs are the same, and
    # caa's fused forward in eval mode measured 3x slower (22.7 s vs 7.4 s on 64 x 256 tokens).
    model.train()
    tokens, q = recall_sequences(n_seq, TASK["seq_len"], TASK["n_keys"], TASK["n_values"], seed)
    x = torch.from_numpy(tokens.astype(np.int64))  # (N, T)
    pred = torch.cat([model(x[i: i + batch])[0].argmax(-1) for i in range(0, n_seq, batch)])  # (N, T)
    correct = pred.numpy()[q["seq"], q["pos"]] == q["answer"]
    return {"attn": cfg.attn, "seed": ckpt["train_config"]["seed"], "step": ckpt["step"],
            "window": cfg.window, "n_layer": cfg.n_layer, "chance": 1 / TASK["n_values"],
            "overall": float(correct.mean()), "n_queries": int(len(correct)),
            "buckets": accuracy_by_bucket(correct, q["distance"], cfg.window, cfg.n_layer),
            "task": TASK, "eval_seed": seed, "eval_seqs": n_seq}


def run(attn, seed, out_dir, data_dir, flags=None, **overrides):
    """Make data, train (unless finished), evaluate; writes and returns out_dir/recall.json."""
    make_data(data_dir)
    cmd = train_command(attn, seed, data_dir, out_dir, flags, **overrides)
    done = Path(out_dir, "recall.json")
    if run_finished(out_dir) and done.exists():  # a resumed sweep: scored already
        return json.loads(done.read_text())
    if not run_finished(out_dir):
        if (Path(out_dir) / "ckpt.pt").exists():
            cmd.append("--resume=True")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    result = evaluate(out_dir)
    result["command"] = " ".join(["python", "train.py"] + [a for a in cmd[2:] if a != "--resume=True"])
    Path(out_dir, "recall.json").write_text(json.dumps(result, indent=1))
    line = " | ".join(f"{k}: {v['acc']:.3f} (n={v['n']})" for k, v in result["buckets"].items() if v["n"])
    print(f"recall {attn} seed {seed}: {line} | chance {result['chance']:.3f}")
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attn", default="full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out_dir", required=True)
    p.add_argument("--data_dir", default="data/recall")
    p.add_argument("--max_steps", type=int, default=TRAIN["max_steps"])
    p.add_argument("--kernel", default="fused", help="ref | fused (kernels.py)")
    p.add_argument("--eval_only", action="store_true", help="score the checkpoint in --out_dir")
    args = p.parse_args(argv)
    if args.eval_only:
        print(json.dumps(evaluate(args.out_dir), indent=1))
        return 0
    run(args.attn, args.seed, args.out_dir, args.data_dir, max_steps=args.max_steps, kernel=args.kernel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
