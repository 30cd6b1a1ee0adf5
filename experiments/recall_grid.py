"""The recall grid (MQAR): every variant trained at one length on sequences over n
key-value pairs, for n in KV_PAIRS, then tested at 1x, 2x and 4x that length.

    python experiments/recall_grid.py --list              # every run, its state and its command
    python experiments/recall_grid.py                     # run what is missing (resumable), then --report
    python experiments/recall_grid.py --only=full_kv8,local   # runs by name, variant or kvN
    python experiments/recall_grid.py --report            # RESULTS.md's section and assets/recall_grid.png

The task is the study's MQAR (experiments/recall.py, `recall.mqar_sequences`, form onehop:
Zoology's multi-query associative recall with dense supervision and one-hop value tokens)
with n_keys = n, the number of key-value pairs. A sequence of L tokens draws a fresh map of n
pairs (each key 0 .. n-1 gets a value uniform over N_VALUES) and is a stream of L/2 pairs
`k (k,v)`: even positions hold keys drawn uniformly from the n, the next position the token
(k, v). Every key that occurred before in the sequence is a query: at its position the model
must predict (k, v), which sits right after the key's previous occurrence (chance
1 / N_VALUES). lag = the query's position minus that token's position: about geometric with
mean 2n (a key recurs after n pairs on average), so n is also the distance axis of the grid.

"At 2x" (and 4x): the checkpoint trained at L = T is scored, unchanged (its windows, blocks
and thresholds stay those sized for T), on fresh sequences of L = 2T (4T) made by the same
rule over the same n pairs: one map of n pairs spread over a twice (4x) longer stream, so
each pair recurs twice (4x) as often and there are about twice (4x) as many queries per
sequence, with the same distribution of lags (except that a longer sequence lets the rare long
lags past T occur). What changes is where the queries are: positions T .. 4T-1, which the
model never saw in training (RoPE rotations beyond the trained ones; a softmax over 2x-4x as
many keys). So the 2x/4x columns test length generalisation at a fixed recall distance.

Calibration (the negative result that chose this layout): Zoology's own layout (the n pairs
listed first, then each key queried once at a random later place among filler tokens, so
that at 2x the distances double) gives n supervised positions per sequence instead of about
L/2 - n: `full` at n = 8, T = 128, 1000 steps reached only 0.30 at 1x (0.28 at 2x, 0.20 at 4x;
5.6 min). On the study's stream `full` at n = 8 is at 1.000 (every length) after the same 1000
steps (val loss flat from step 250), at n = 32 only at 0.41 (val 2.88, still falling; the
loss of perfect recall is about 2.33): 32 x 16 (key, value) tokens each need their key learnt
into their embedding. Hence 2000 steps at n = 32 (STEPS): 0.665 at 1x (0.656 / 0.653 at 2x /
4x; val 2.59, falling by ~0.01 per 250 steps at the end; 5.7 min). So the positive control
holds at 4, 8 and 16 pairs, not at 32, where the column compares variants with a `full` that
has not solved the task; solving it needs a larger model or a far larger budget than minutes.

Size: TRAIN below, 2 layers of d_model 128 (the study's recall shape), T = 128. Windows are
sized for T as the study sizes them for its recall runs (W = T/8, dsa's threshold and caa's
maximum width 2W), and the block variants see about as many keys as `local`: nsa's selection
blocks of 8 (3 forced + 1 chosen) beside a window of W, moba's blocks of 8 (its own + 1
chosen), the indexer's top W keys, combiner's blocks of W.

Each run trains through experiments/paired.py (shared parameters start as `full`'s at seed 0)
into RESULTS_DIR/NAME/ (train.py's logs and checkpoint; a cut run resumes), then writes
RESULTS_DIR/NAME.json; a run whose JSON exists is skipped, so the grid completes over
several sittings. Commit the JSONs and logs (not ckpt.pt).
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

import recall  # noqa: E402
from data import write_shard  # noqa: E402
from evaluate import FACTORS  # noqa: E402  (1, 2, 4: the lengths, as multiples of the trained one)

# The run order: the positive control first, then the windowed and sparse variants.
VARIANTS = ("full", "local", "asga", "caa", "dsa", "nsa", "moba", "indexer", "combiner")
KV_PAIRS = (4, 8, 16, 32)
N_VALUES = 16
SEQ_LEN = 128  # the trained length T
RESULTS_DIR = ROOT / "experiments" / "results" / "recall_grid"
DATA_DIR = ROOT / "experiments" / "data" / "recall_grid"
EVAL_SEED, EVAL_SEQS = 10_000, 256  # held-out sequences per length (seed + factor): no shard's seed
DATA_SEED = 0  # train shard; val shard DATA_SEED + 1
VAL_SEQS = 64
W = SEQ_LEN // 8
# Steps per kv count: the budget at which `full` solves it (calibration in the docstring).
STEPS = {4: 1000, 8: 1000, 16: 1000, 32: 2000}
# train.py overrides of every grid run (vocab_size is set per n: grid_vocab).
TRAIN = dict(model="tiny", tie_embeddings=False, n_layer=2, d_model=128, n_head=2, n_kv_head=2,
             head_dim=64, mlp_hidden=256, window=W, dsa_threshold=2 * W, caa_window_max=2 * W,
             nsa_cmp_block=8, nsa_cmp_stride=4, nsa_block=8, nsa_topk=4, nsa_window=W,
             moba_block=8, moba_topk=2, index_head_dim=16,
             seq_len=SEQ_LEN, batch_size=16, total_batch_tokens=2048, lr=3e-3, warmup_steps=30,
             eval_every=250, val_tokens=4096, ckpt_every=250, eval_seqs=0,
             kernel="fused")


def grid_vocab(n_pairs):
    """The keys and the (key, value) tokens of form onehop."""
    return n_pairs * (1 + N_VALUES)


def grid_sequences(n_seq, seq_len, n_pairs, seed):
    """(tokens int64 (N, L), queries): recall.mqar_sequences with n_pairs keys, form onehop.
    queries: int64 arrays, one entry per query: `seq`, `pos` (the key's position: the logits
    there predict the answer), `answer` (the (key, value) token, also at pos + 1) and `lag`
    (pos minus the position of the answer's previous occurrence)."""
    return recall.mqar_sequences(n_seq, seq_len, n_pairs, N_VALUES, seed, form="onehop")


def make_data(data_dir, n_pairs):
    """Shards for n pairs at SEQ_LEN, made once: train (enough sequences for every step of one
    run, each seen once) and val, whole sequences back to back."""
    data_dir = Path(data_dir)
    task = {"task": "recall_grid", "form": "onehop", "seq_len": SEQ_LEN, "n_pairs": n_pairs, "n_values": N_VALUES,
            "seed": DATA_SEED, "train_seqs": STEPS[n_pairs] * TRAIN["total_batch_tokens"] // SEQ_LEN + 1}
    marker = data_dir / "recall_grid_task.json"
    if marker.exists() and json.loads(marker.read_text()) == task:
        return
    data_dir.mkdir(parents=True, exist_ok=True)
    for split, n_seq, seed in (("val", VAL_SEQS, DATA_SEED + 1), ("train", task["train_seqs"], DATA_SEED)):
        tokens, _ = grid_sequences(n_seq, SEQ_LEN, n_pairs, seed)
        write_shard(data_dir / f"recall_grid_{split}_{0 if split == 'val' else 1:06d}.bin",
                    tokens.reshape(-1).astype(np.uint16))
    marker.write_text(json.dumps(task))


# ----------------------------------------------------------------------------- the runs

def runs(results_dir=RESULTS_DIR):
    """[{'name', 'attn', 'n_pairs', 'dir', 'result'}] in the order they run: every kv count of a
    variant together, variants in VARIANTS' order (`full` first)."""
    return [{"name": f"{attn}_kv{n}", "attn": attn, "n_pairs": n, "dir": Path(results_dir) / f"{attn}_kv{n}",
             "result": Path(results_dir) / f"{attn}_kv{n}.json"} for attn in VARIANTS for n in KV_PAIRS]


def select(all_runs, only):
    """The runs matching any comma-separated selector: a run name, a variant, or kvN."""
    if not only:
        return all_runs
    keys = set(only.split(","))
    chosen = [r for r in all_runs if keys & {r["name"], r["attn"], f"kv{r['n_pairs']}"}]
    unknown = keys - {k for r in all_runs for k in (r["name"], r["attn"], f"kv{r['n_pairs']}")}
    if unknown:
        raise SystemExit(f"--only: no run matches {', '.join(sorted(unknown))}; give run names (full_kv8), "
                         f"variants ({', '.join(VARIANTS)}) or kv counts ({', '.join(f'kv{n}' for n in KV_PAIRS)})")
    return chosen


def train_command(run, data_dir=DATA_DIR):
    """train.py's command line (a list) for one run, through experiments/paired.py."""
    return recall.train_command(run["attn"], 0, Path(data_dir) / f"kv{run['n_pairs']}", run["dir"],
                                **TRAIN, max_steps=STEPS[run["n_pairs"]], vocab_size=grid_vocab(run["n_pairs"]))


def score(model, n_pairs, n_seq=EVAL_SEQS, seed=EVAL_SEED, batch=32):
    """{factor: {'acc', 'n_queries', 'seq_len', 'lag_mean', 'by_lag'}}: accuracy at every query
    of n_seq fresh sequences of factor x SEQ_LEN tokens (seed + factor)."""
    out = {}
    for f in FACTORS:
        tokens, q = grid_sequences(n_seq, f * SEQ_LEN, n_pairs, seed + f)
        correct = recall.correct_answers(recall.predictions(model, tokens, max(1, batch // f)), q)
        out[str(f)] = {"acc": float(correct.mean()), "n_queries": int(len(correct)), "seq_len": f * SEQ_LEN,
                       "lag_mean": float(q["lag"].mean()),
                       "by_lag": recall.accuracy_by_lag(correct, q["lag"], width=SEQ_LEN // 4)}
    return out


def run_one(run, data_dir=DATA_DIR, log=print):
    """Train (resuming a cut run) and score one run; writes run['result']. Skipped (returns
    None) when the result exists."""
    if run["result"].exists():
        log(f"{run['name']}: done before ({run['result'].name})")
        return None
    from model import load_checkpoint

    make_data(Path(data_dir) / f"kv{run['n_pairs']}", run["n_pairs"])
    cmd = train_command(run, data_dir)
    t0 = time.time()
    if not recall.run_finished(run["dir"]):
        run["dir"].mkdir(parents=True, exist_ok=True)
        resume = ["--resume=True"] if (run["dir"] / "ckpt.pt").exists() else []
        with open(run["dir"] / "stdout.txt", "a") as f:
            subprocess.run(cmd + resume, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    t_train = time.time() - t0
    model, ckpt = load_checkpoint(run["dir"], "cpu")
    t1 = time.time()
    acc = score(model, run["n_pairs"])
    result = {"name": run["name"], "attn": run["attn"], "n_pairs": run["n_pairs"], "trained_len": SEQ_LEN,
              "step": ckpt["step"], "chance": 1 / N_VALUES, "eval_seqs": EVAL_SEQS, "eval_seed": EVAL_SEED,
              "by_factor": acc, "train_s": round(t_train), "eval_s": round(time.time() - t1),
              "command": " ".join(["python"] + cmd[1:])}
    run["result"].write_text(json.dumps(result, indent=1) + "\n")
    log(f"{run['name']}: " + " | ".join(f"{f}x {a['acc']:.3f}" for f, a in acc.items())
        + f" | train {t_train:.0f} s, score {result['eval_s']} s")
    return result


# ----------------------------------------------------------------------------- the report

def load_results(results_dir=RESULTS_DIR):
    """{(attn, n_pairs): result} of the finished runs."""
    found = {}
    for r in runs(results_dir):
        if r["result"].exists():
            found[(r["attn"], r["n_pairs"])] = json.loads(r["result"].read_text())
    return found


def section(results_dir, link):
    """RESULTS.md's lines for the grid (experiments/sweep.py puts them after the recall
    section); link(path) makes a path relative to RESULTS.md."""
    res = load_results(results_dir)
    L = ["## Recall grid: train at one length, test at 1x, 2x, 4x", "",
         f"MQAR (`experiments/recall_grid.py`; its docstring defines the task): a stream of key-value "
         f"pairs over a map of n pairs, every recurring key a query (lag about 2n on average); trained at "
         f"T = {SEQ_LEN} tokens for " + ", ".join(f"{s} steps at {n}" for n, s in STEPS.items())
         + f" pairs, of {TRAIN['total_batch_tokens']} tokens each "
         f"(seed 0, paired initialisation), scored on {EVAL_SEQS} fresh sequences per length. At 2x and "
         f"4x the same n pairs are spread over {2 * SEQ_LEN} / {4 * SEQ_LEN} tokens: the same lags, at "
         f"positions beyond the trained ones (RoPE length generalisation); windows "
         f"(W = {W}), thresholds and blocks stay those of the trained length. Accuracy of the argmax at "
         f"the queries, 1x / 2x / 4x; chance 1/{N_VALUES} = {1 / N_VALUES:.4f}. `full` at 1x is the "
         f"positive control (it must reach >= 0.9).", "",
         "| variant | " + " | ".join(f"{n} pairs" for n in KV_PAIRS) + " |",
         "|---|" + "---|" * len(KV_PAIRS)]
    for attn in VARIANTS:
        cells = []
        for n in KV_PAIRS:
            r = res.get((attn, n))
            cells.append("–" if r is None else " / ".join(f"{r['by_factor'][str(f)]['acc']:.3f}" for f in FACTORS))
        L.append(f"| {attn} | " + " | ".join(cells) + " |")
    lags = {n: next(r["by_factor"] for (a, m), r in res.items() if m == n) for n in KV_PAIRS
            if any(m == n for _, m in res)}
    if lags:
        L += ["", "Mean lag of the queries at 1x / 2x / 4x (a window of W = {} sees lag <= {}): ".format(W, W)
              + "; ".join(f"{n} pairs " + " / ".join(f"{b[str(f)]['lag_mean']:.1f}" for f in FACTORS)
                          for n, b in lags.items()) + "."]
    full = [(n, res[("full", n)]["by_factor"]["1"]["acc"]) for n in KV_PAIRS if ("full", n) in res]
    if full:
        ok = [n for n, a in full if a >= 0.9]
        short = [n for n, a in full if a < 0.9]
        L += ["", "Positive control: `full` at the trained length reaches >= 0.9 at "
              + (", ".join(f"{n}" for n in ok) + " pairs" if ok else "no kv count")
              + "; " + ", ".join(f"{a:.3f} at {n}" for n, a in full) + "."
              + (f" At {', '.join(map(str, short))} pairs it does not: there the column compares variants with a "
                 f"`full` that has not solved the task, not with a solved probe." if short else "")]
        L += ["", f"![recall accuracy against the number of pairs, at 1x, 2x, 4x the trained length]"
                  f"({link(ROOT / 'assets' / 'recall_grid.png')})"]
    missing = [r["name"] for r in runs(results_dir) if (r["attn"], r["n_pairs"]) not in res]
    if missing:
        L += ["", f"Not run yet ({len(missing)} of {len(VARIANTS) * len(KV_PAIRS)}): {', '.join(missing)}. "
                  f"`python experiments/recall_grid.py` runs them (finished runs are skipped, a cut run "
                  f"resumes), then `python experiments/recall_grid.py --report` rewrites this section."]
    if res:
        times = [r["train_s"] + r["eval_s"] for r in res.values()]
        L += ["", f"Time per run (training + scoring, one thread, on a shared 2-core machine): "
                  f"{min(times) / 60:.1f} to {max(times) / 60:.1f} min. A run's command is in its JSON "
                  f"(`experiments/results/recall_grid/NAME.json`, e.g. "
                  f"`{next(iter(res.values()))['command']}`)."]
    return L + [""]


def figure(results_dir, path):
    """Accuracy against the number of pairs, one line per variant, a panel per length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = load_results(results_dir)
    fig, axes = plt.subplots(1, len(FACTORS), figsize=(4.2 * len(FACTORS), 3.6), sharey=True)
    for ax, f in zip(axes, FACTORS):
        for attn in VARIANTS:
            pts = [(n, res[(attn, n)]["by_factor"][str(f)]["acc"]) for n in KV_PAIRS if (attn, n) in res]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=attn,
                        **(dict(color="black", lw=2) if attn == "full" else dict(lw=1.2)))
        ax.axhline(1 / N_VALUES, color="red", lw=1, label="chance")
        ax.set_xscale("log", base=2)
        ax.set_xticks(KV_PAIRS, [str(n) for n in KV_PAIRS])
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{f}x the trained length ({f * SEQ_LEN} tokens)")
        ax.set_xlabel("key-value pairs")
    axes[0].set_ylabel("recall accuracy")
    axes[-1].legend(fontsize=7, loc="center right")
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(results_dir=RESULTS_DIR, results_md=ROOT / "RESULTS.md"):
    """Rewrite RESULTS.md and draw assets/recall_grid.png. experiments/sweep.py writes the whole
    of RESULTS.md, this section included, from the committed results (its --results_only also
    redraws the study's figures from the same logs). It runs as a process of its own: sweep.py
    imports this module, and imports run one way."""
    subprocess.run([sys.executable, str(ROOT / "experiments" / "sweep.py"), "--results_only",
                    f"--out_dir={Path(results_dir).parent}", f"--results_md={results_md}"],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    if load_results(results_dir):
        figure(results_dir, ROOT / "assets" / "recall_grid.png")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help="comma-separated run names (full_kv8), variants or kvN")
    p.add_argument("--list", "--dry_run", dest="list", action="store_true",
                   help="print every selected run, whether it is done, and its command")
    p.add_argument("--report", action="store_true", help="only rewrite RESULTS.md and assets/recall_grid.png")
    p.add_argument("--results_dir", default=str(RESULTS_DIR))
    p.add_argument("--data_dir", default=str(DATA_DIR))
    args = p.parse_args(argv)
    todo = select(runs(args.results_dir), args.only)
    if args.list:
        print(f"# each command reads the shards in {recall._rel(args.data_dir)}/kvN, made by make_data, which a "
              f"run of this script without --list calls first")
        for r in todo:
            state = "done" if r["result"].exists() else "to run"
            print(f"{r['name']:14s} {state:7s} {' '.join(['python'] + train_command(r, args.data_dir)[1:])}")
        return 0
    if not args.report:
        for r in todo:
            run_one(r, args.data_dir)
    if Path(args.results_dir).resolve() == RESULTS_DIR.resolve():
        report(args.results_dir)
        print("wrote RESULTS.md" + (" and assets/recall_grid.png" if load_results(args.results_dir) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
