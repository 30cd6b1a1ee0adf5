"""Associative recall by distance: what a window throws away, and whether a variant can use
a token beyond it (the recall probe of the study; experiments/sweep.py runs it for every
configuration in sweep.RECALL_CONFIGS).

    python experiments/recall.py --attn=local --seed=0 --out_dir=experiments/results/recall/local_s0

The task is multi-query associative recall (MQAR, from the Zoology study of efficient
attention: Arora et al. 2023, "Zoology: Measuring and Improving Recall in Efficient Language
Models"): each sequence draws a fresh random map key -> value and is a stream of `key value`
pairs with keys drawn at random, so a key recurs at many distances; where a key recurs, the
model must predict its value, seen after the key's previous occurrence (data.recall_sequences
makes the stream; dense supervision at every recurring key, as in Zoology's MQAR).

The paper's form (`form=zoology`: the value is a token of its own, which does not say which
key it belongs to) needs a two-layer induction circuit: one layer copies the key into the
value's position, the next matches the query against it. This project's choice, measured
below: `form=onehop` (the default) writes each value as the token (key, value), so one
attention hop retrieves it - a query matches any earlier token of its own key and copies
the value - and the only thing between a variant and the answer is whether the query can
attend to it. The answer stays unpredictable without the earlier occurrence: given the key,
its value is uniform over n_values, so chance is 1 / n_values.

Distance. lag = query position minus the position of the nearest earlier (key, value) token
of the queried key. A query at i attends to j when 0 <= i - j <= W, so `local` sees the
answer in one hop iff lag <= W; L stacked layers could in principle relay it up to L x W.
Buckets: lag <= W | W < lag <= L*W | L*W < lag <= 4W | lag > 4W (beyond `local`'s receptive
field both; there `local` should be at chance).

Calibration (`full`, seed 0, lr 3e-3, 2 layers of d_model 128 with 2 heads of 64: head_dim
64 loosens the QK-norm bound on a logit, about sqrt(head_dim) x the norm gains, to 8; 16 keys,
16 values; commands: train.py with these TRAIN values on shards of each form):
- form=zoology, 256 tokens, batch 16 x 256, 600 steps (2.8 min at load 0.3, 2 threads): val
  loss 2.59, flat since step 350 - "one of the values in context", no retrieval.
- form=zoology, 64 tokens, batch 32 x 64, 444 steps: val 2.73, flat (stopped).
- form=onehop, 64 tokens, batch 32 x 64: val 2.19 at step 500, 2.11 at 1000, 1.995 at 1500
  (the loss of perfect recall is 1.992: keys and first occurrences of a key are
  unpredictable, ln 16 each); accuracy 1.000 in every lag bucket on 512 held-out sequences.
- the same with 1000 steps: `full` 0.925 / 0.922 / 0.905 / 0.911 by bucket (lag <= 8, 8-16,
  16-32, > 32), `local` (W=8) 0.469 / 0.059 / 0.057 / 0.065: at chance (0.0625) beyond its
  window, and 1000 steps leave `full` too close to 0.9, hence max_steps=1500 below.
Step times at this size (s/step, one thread; `python experiments/calibrate.py --part=recall
--steps=15 --attn=full,local,dsa,asga,caa`): full 0.20, local 0.16, dsa 0.24, asga 0.16, caa
0.15 with the machine nearly quiet (load 2.8); 0.9-1.4 under load 7-8 from other jobs.
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

from data import TOKENIZER_FILE, recall_sequences, write_shard, write_tokenizer  # noqa: E402

# Window W = 8 with 2 layers: receptive field 16; at 16 keys a key's previous occurrence is
# further than 16 positions for (15/16)^8 = 60% of the queries, further than 32 for 36%.
TASK = dict(form="onehop", seq_len=64, n_keys=16, n_values=16, seed=0)
DATA_TOKENS = 4_000_000  # train + val tokens in the recall shards
VAL_TOKENS = 131_072
EVAL_SEED, EVAL_SEQS = 10_000, 512  # held-out sequences: a seed no shard uses
# train.py overrides of every recall run. Geometry scaled from the papers' (W=256, dsa's
# adaptive threshold 512 = 2W, caa's width 256..512 = W..2W) to W = 8: threshold 16 (so
# dsa_window=adaptive windows the 48 of 64 positions >= 16: 75%), caa width 8..16.
TRAIN = dict(model="tiny", vocab_size=TASK["n_keys"] * (1 + TASK["n_values"]), tie_embeddings=False,
             n_layer=2, d_model=128, n_head=2, n_kv_head=2, head_dim=64, mlp_hidden=256,
             window=8, dsa_threshold=16, caa_window_max=16,
             seq_len=TASK["seq_len"], batch_size=32, total_batch_tokens=2048,
             lr=3e-3, warmup_steps=30, max_steps=1500, eval_every=250, val_tokens=8192,
             ckpt_every=500,  # resumable: a cut run continues from its last 500 steps
             # nsa, moba, indexer sized as the text runs are, scaled to W = 8: nsa's compressed
             # blocks of 4 every 2, 4 selected blocks of 4, a window of W; moba's 2 blocks of 4
             # (its own + 1) = W keys; the indexer's top W keys
             nsa_cmp_block=4, nsa_cmp_stride=2, nsa_block=4, nsa_topk=4, nsa_window=8,
             moba_block=4, moba_topk=2, index_head_dim=16)


def mqar_sequences(n_seq, seq_len, n_keys, n_values, seed, form="onehop"):
    """(tokens int64 (N, T), queries) as data.recall_sequences, plus queries['lag'] (query
    position minus the position of the answer's earlier token). form='onehop' rewrites each
    value token v (ids n_keys..n_keys+n_values-1) as n_keys + key * n_values + (v - n_keys),
    and the answers with it; form='zoology' leaves the stream as it is."""
    tokens, q = recall_sequences(n_seq, seq_len, n_keys, n_values, seed)
    tokens = tokens.astype(np.int64)  # (N, T): keys at even positions, values at odd
    q = {k: v.copy() for k, v in q.items()}
    if form == "onehop":
        tokens[:, 1::2] = onehop_token(tokens[:, 0::2], tokens[:, 1::2] - n_keys, n_keys, n_values)  # (N, T/2)
        q["answer"] = tokens[q["seq"], q["pos"] + 1]
    elif form != "zoology":
        raise ValueError(f"unknown recall form {form!r}; valid: onehop, zoology")
    q["lag"] = q["distance"] - 1  # the answer sits right after the key's previous occurrence
    return tokens, q


def onehop_token(key, value, n_keys, n_values):
    """The id of the token (key, value) of form=onehop (value in 0 .. n_values-1): ids
    n_keys .. n_keys * (1 + n_values) - 1, after the n_keys key ids."""
    return n_keys + key * n_values + value


@torch.no_grad()
def predictions(model, tokens, batch=128):
    """The model's argmax at every position of tokens (int64 (N, T)) -> int64 array (N, T)."""
    # Train mode under no_grad: the model has no dropout, so the outputs are the same, and
    # caa's fused forward in eval mode measured 3x slower (22.7 s vs 7.4 s on 64 x 256 tokens).
    model.train()
    x = torch.from_numpy(tokens)  # (N, T)
    return torch.cat([model(x[i: i + batch])[0].argmax(-1) for i in range(0, len(x), batch)]).numpy()


def correct_answers(pred, q):
    """Per query (bool): the prediction at the query's position is its answer."""
    return pred[q["seq"], q["pos"]] == q["answer"]


def make_data(data_dir):
    """The recall shards, made once: a val shard (seed + 1) and a train shard (seed), whole
    sequences back to back (a marker file records the task they were made for)."""
    marker = Path(data_dir) / "recall_task.json"
    if marker.exists() and json.loads(marker.read_text()) == TASK:
        if not Path(data_dir, TOKENIZER_FILE).exists():  # folders made before the record existed
            write_tokenizer(data_dir, "mqar", TASK["n_keys"] * (1 + TASK["n_values"]))
        return
    os.makedirs(data_dir, exist_ok=True)
    args = (TASK["seq_len"], TASK["n_keys"], TASK["n_values"])
    for split, n_tok, seed in (("val", VAL_TOKENS, TASK["seed"] + 1), ("train", DATA_TOKENS - VAL_TOKENS, TASK["seed"])):
        tokens, _ = mqar_sequences(n_tok // TASK["seq_len"], *args, seed, TASK["form"])
        write_shard(Path(data_dir) / f"recall_{split}_{0 if split == 'val' else 1:06d}.bin",
                    tokens.reshape(-1).astype(np.uint16))
    # token ids without text: evaluate.py then reports loss by position but no bits per byte
    write_tokenizer(data_dir, "mqar", TASK["n_keys"] * (1 + TASK["n_values"]))
    marker.write_text(json.dumps(TASK))


def train_command(attn, seed, data_dir, out_dir, flags=None, **overrides):
    """The command line of one recall run (a list, for subprocess): train.py's flags, run
    through experiments/paired.py (shared parameters start as `full`'s at this seed)."""
    args = {**TRAIN, **overrides, "attn": attn, **(flags or {}), "seed": seed,
            "data_dir": _rel(data_dir), "out_dir": _rel(out_dir)}
    return [sys.executable, "experiments/paired.py"] + [f"--{k}={v}" for k, v in args.items()]


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
    """[(label, lo, hi)]: lags lo < lag <= hi."""
    reach = n_layer * window
    return [(f"lag <= {window}", -1, window), (f"{window} < lag <= {reach}", window, reach),
            (f"{reach} < lag <= {4 * window}", reach, 4 * window), (f"lag > {4 * window}", 4 * window, float("inf"))]


def accuracy_by_bucket(correct, lag, window, n_layer):
    """{label: {'acc', 'n', 'lo', 'hi'}} from per-query correctness (bool) and lag."""
    out = {}
    for label, lo, hi in bucket_edges(window, n_layer):
        sel = (lag > lo) & (lag <= hi)
        n = int(sel.sum())
        out[label] = {"acc": float(correct[sel].mean()) if n else None, "n": n, "lo": lo,
                      "hi": None if hi == float("inf") else hi}
    return out


def accuracy_by_lag(correct, lag, width=4):
    """[(lo, hi, n, acc)] over lag bins lo < lag <= hi of `width` (for the figure)."""
    rows = []
    for lo in range(0, int(lag.max()), width):  # lag >= 1: bins (0, 4], (4, 8], ... line up with W
        sel = (lag > lo) & (lag <= lo + width)
        if sel.any():
            rows.append((lo, lo + width, int(sel.sum()), float(correct[sel].mean())))
    return rows


@torch.no_grad()
def evaluate(run_dir, n_seq=EVAL_SEQS, seed=EVAL_SEED, batch=128):
    """Recall accuracy of the checkpoint in run_dir on n_seq fresh sequences."""
    from model import load_checkpoint

    model, ckpt = load_checkpoint(run_dir, "cpu")
    cfg = model.cfg
    tokens, q = mqar_sequences(n_seq, TASK["seq_len"], TASK["n_keys"], TASK["n_values"], seed, TASK["form"])
    correct = correct_answers(predictions(model, tokens, batch), q)
    return {"attn": cfg.attn, "seed": ckpt["train_config"]["seed"], "step": ckpt["step"],
            "window": cfg.window, "n_layer": cfg.n_layer, "chance": 1 / TASK["n_values"],
            "overall": float(correct.mean()), "n_queries": int(len(correct)),
            "buckets": accuracy_by_bucket(correct, q["lag"], cfg.window, cfg.n_layer),
            "by_lag": accuracy_by_lag(correct, q["lag"]),
            "task": TASK, "eval_seed": seed, "eval_seqs": n_seq}


def run(attn, seed, out_dir, data_dir, flags=None, name=None, **overrides):
    """Make data, train (unless finished), evaluate; writes and returns out_dir/recall.json."""
    make_data(data_dir)
    cmd = train_command(attn, seed, data_dir, out_dir, flags, **overrides)
    done = Path(out_dir, "recall.json")
    if run_finished(out_dir) and done.exists():  # a resumed sweep: scored already
        return json.loads(done.read_text())
    if not run_finished(out_dir):
        if (Path(out_dir) / "ckpt.pt").exists():
            cmd.append("--resume=True")
        os.makedirs(out_dir, exist_ok=True)
        with open(Path(out_dir, "stdout.txt"), "a") as f:
            subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    result = evaluate(out_dir)
    result["name"] = name or attn
    result["command"] = " ".join(["python"] + [a for a in cmd[1:] if a != "--resume=True"])
    Path(out_dir, "recall.json").write_text(json.dumps(result, indent=1))
    line = " | ".join(f"{k}: {v['acc']:.3f} (n={v['n']})" for k, v in result["buckets"].items() if v["n"])
    print(f"recall {result['name']} seed {seed}: {line} | chance {result['chance']:.3f}")
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
