"""The training step of `full` and some configurations from several checkouts (commits), in one
process: benchmarks/train_step.py's step, shape and configurations, interleaved across the
checkouts round by round, so that a commit's ratio to `full` and its time against another
commit's are measured under the same machine load (on a shared CPU, runs of train_step.py
one after another see different loads).

    git worktree add --detach /tmp/old 3621804
    python benchmarks/train_step_ab.py --rounds=10 --only=asga,caa old=/tmp/old main=.

Each checkout's model.py, attention.py and kernels.py are imported as modules of their own
(label_model, ...), so its models run its code. Every model is built and stepped twice
(warm-up: AdamW state, compiled tiles), then each round steps, for each configuration and each
checkout (the checkouts' order rotated every round), `full` then the configuration, `steps`
steps a sample. Per configuration and checkout: the median over rounds of full's time / its
time (wall and CPU time, as train_step.py), and the median of its time / the first
checkout's (same round). Prints a Markdown table; --out writes the samples as JSON. Timing
runs under train.py's allocator settings (this checkout's config.keep_freed_memory), as
train_step.py's does, so a checkout's allocations do not change another's time.
"""
import argparse
import importlib
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train.py: idle threads sleep on a shared CPU

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_step import SHAPES, build, configs, train_step  # noqa: E402
from config import keep_freed_memory  # noqa: E402 (train_step put the checkout on sys.path)

OWN = ("model", "attention", "kernels")  # the modules each checkout brings


def load(label, root):
    """The checkout's model module, its model/attention/kernels imported apart from any other's."""
    saved = {m: sys.modules.pop(m) for m in OWN if m in sys.modules}
    sys.path.insert(0, os.path.abspath(root))
    try:
        model = importlib.import_module("model")
    finally:
        sys.path.pop(0)
        for m in OWN:
            sys.modules[f"{label}_{m}"] = sys.modules.pop(m)
        sys.modules.update(saved)
    return model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkouts", nargs="+", help="label=path of a checkout (the first is the baseline)")
    p.add_argument("--only", default="asga,caa", help="comma-separated train_step.py configuration names")
    p.add_argument("--shape", default="cpu", help=f"one of: {', '.join(SHAPES)}")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=1, help="training steps per sample")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON path for the samples")
    args = p.parse_args(argv)
    keep_freed_memory()  # as train.py and train_step.py time: this checkout's config.py
    torch.set_num_threads(args.threads)
    trees = [c.split("=", 1) for c in args.checkouts]
    labels = [label for label, _ in trees]
    names = args.only.split(",")
    configs(names)  # an unknown name: one clear error
    flags = {name: (attn, f) for name, attn, f in configs()}  # the variants CONFIGS does not name too (nsa, ...)
    models = {label: load(label, root) for label, root in trees}
    built = {(label, n): build(args.shape, *flags[n], models=models[label]) for label in labels for n in ["full"] + names}
    started = time.time()
    for _ in range(2):
        for b in built.values():
            train_step(*b)
    print(f"warm-up {time.time() - started:.0f} s", flush=True)
    load_before = os.getloadavg()[0]
    samples = {f"{label}/{n}/{other}": [] for label in labels for n in names for other in ("full", n)}
    for r in range(args.rounds):
        order = labels[r % len(labels):] + labels[:r % len(labels)]
        for n in names:
            for label in order:
                for other in ("full", n):
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(args.steps):
                        train_step(*built[(label, other)])
                    samples[f"{label}/{n}/{other}"].append((time.perf_counter() - t0, time.process_time() - c0))
    med = statistics.median
    rows = ["| config | checkout | vs full (wall) | rounds' range | vs full (CPU time) | step s | full's step s "
            f"| time / {labels[0]}'s |", "|---|---|---|---|---|---|---|---|"]
    for n in names:
        for label in labels:
            full, own, base = (samples[f"{lb}/{n}/{o}"] for lb, o in ((label, "full"), (label, n), (labels[0], n)))
            wall = [f[0] / o[0] for f, o in zip(full, own)]
            rows.append(f"| {n} | {label} | {med(wall):.3f}x | {min(wall):.2f}-{max(wall):.2f} | "
                        f"{med(f[1] / o[1] for f, o in zip(full, own)):.3f}x | {med(o[0] for o in own) / args.steps:.2f} | "
                        f"{med(f[0] for f in full) / args.steps:.2f} | {med(o[0] / b[0] for o, b in zip(own, base)):.3f} |")
    loads = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print("\n".join(rows))
    print(f"load average {loads}, torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(command=" ".join(["python benchmarks/train_step_ab.py"] + (argv or sys.argv[1:])),
                           checkouts=dict(trees), load_average=loads, samples=samples), f, indent=1)


if __name__ == "__main__":
    main()
