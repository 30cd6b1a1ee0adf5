"""benchmarks/decode.py's prefill and decoding (batch 1, and --batch where the checkout's cache
can repeat its batch) for several checkouts (commits), in one process, each variant's time and
its ratio to that checkout's `full`, so a change to the decoding path is measured before and
after under the same machine load.

    git worktree add --detach /tmp/old 42bd2e2
    python benchmarks/decode_ab.py before=/tmp/old after=. --lengths=2048,8192 --batch=8

Each checkout's model.py, attention.py and kernels.py are imported apart (train_step_ab.load);
its model is built with decode.py's settings (2 layers of qwen-134m widths, vocab 256, float32,
kernel='fused', one thread) and driven only through `new_cache()` and `model(idx, cache=...)`,
which every checkout has. Per T and variant, every checkout prefills (one after the other),
then their decoding steps take turns (--rounds rounds of --steps / --rounds steps each, at
batch 1, then at --batch), each checkout's median over all its steps: a drift of the
machine's speed between runs (30% here) falls on both sides alike. --prefills=N: the
prefills too, N rounds in turns, the checkouts' order reversed every other round (A B B A),
the median of each checkout's N: one prefill a side falls wherever the machine's drift puts
it (30% here), as decoding steps do. Each timed prefill follows an untimed one of the same
prompt by the same model, as decode.py's does: a first prefill pays for touching its memory
(on a VM that hands freed memory to its host, up to ~3 ms a MB) and compiles a checkout's
helpers, so whichever checkout ran first paid more; and the C allocator keeps the memory
the process frees, as decode.py's (`keep_freed_memory`; --malloc=system: not), or that touch
would not carry over to the timed prefill.

Each checkout takes one untimed step at each batch first (its kernels.GatheredDots compiles at
its first call), as decode.py does. --compile: each checkout's steps through its own
`model.compile_decoding`, its cache made with a fixed capacity and untimed warm-up steps at
each batch first (decode.py's `warm_steps`), as decode.py --compile measures them; a checkout
without compile_decoding is refused by name.
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode import clock, decode_steps, keep_freed_memory, warm_steps  # noqa: E402
from train_step_ab import load  # noqa: E402


def prefill(models, attn, T, capacity=0):
    """(model, cache, prefill s) of `attn` at T for one checkout (capacity: the cache's, 0 to grow)."""
    cfg = models.ModelConfig(**dict(models.PRESETS["qwen-134m"], n_layer=2, vocab_size=256, attn=attn,
                                    kernel="fused"))
    torch.manual_seed(0)
    model = models.Model(cfg).eval()
    idx = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(idx, cache=model.new_cache())  # untimed: compiles, and touches the prefill's memory
        cache = model.new_cache(capacity) if capacity else model.new_cache()
        t0 = clock("cpu")
        model(idx, cache=cache)
        return model, cache, clock("cpu") - t0


def interleaved(held, steps, rounds, batch):
    """{label: median ms} of one-token steps at this batch, the checkouts taking turns: `rounds`
    rounds of steps / rounds steps each, so that a drift of the machine's speed (30% here) falls
    on every checkout alike. held: {label: (step, cache, untimed warm-up steps first)}."""
    times = {label: [] for label in held}
    with torch.no_grad():
        for step, cache, warm in held.values():
            decode_steps(step, cache, batch, warm, "cpu")
        for _ in range(rounds):
            for label, (step, cache, _) in held.items():
                times[label] += decode_steps(step, cache, batch, max(1, steps // rounds), "cpu")
    return {label: 1e3 * statistics.median(t) for label, t in times.items()}


def run(models, attn, T, steps, batch, rounds=1, compile=False, prefills=1):
    """{label: (prefill s, median decode ms at batch 1, at `batch`)} of `attn` at T, every
    checkout prefilled (`prefills` rounds in turns, the order reversed every other round; the
    median, and the last round's cache kept), then their steps interleaved (`interleaved`); the
    last None where batch is 1 or a checkout's cache cannot repeat its batch (before
    KVCache.repeat_batch). compile: the steps through each checkout's compile_decoding, warmed
    up at each batch first."""
    for label, m in models.items():
        if compile and not hasattr(m, "compile_decoding"):
            raise SystemExit(f"decode_ab.py --compile: checkout {label!r} has no model.compile_decoding "
                             "(it came after 39f007a): compare it without --compile")
    capacity = T + 2 * (steps + 32) if compile else 0  # fixed buffers: a growth is a graph of its own
    built, times = {}, {label: [] for label in models}
    for r in range(prefills):
        for label, m in list(models.items())[::1 if r % 2 == 0 else -1]:
            built.pop(label, None)  # the last round's model and cache free before the next is made
            model, cache, seconds = prefill(m, attn, T, capacity)
            built[label] = model, cache
            times[label].append(seconds)
            print(f"  T={T} {attn} {label}: prefill {seconds:.2f} s", flush=True)
    held, prefilled = {}, {label: statistics.median(t) for label, t in times.items()}
    for label, m in models.items():
        (model, cache), warm, how = built[label], 1, "eager"  # one untimed step: a compiled helper compiles in it
        if compile:
            (model, how), warm = m.compile_decoding(model), warm_steps(model)
        held[label] = (model, cache, warm)
        print(f"  T={T} {attn} {label}: steps {how}", flush=True)
    one = interleaved(held, steps, rounds, 1)
    many = dict.fromkeys(held)
    if batch > 1 and all(hasattr(layer, "repeat_batch") for _, cache, _ in held.values() for layer in cache):
        for _, cache, _ in held.values():
            for layer in cache:
                layer.repeat_batch(batch)
        many = interleaved(held, steps, rounds, batch)
    return {label: (prefilled[label], one[label], many[label]) for label in held}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkouts", nargs="+", help="label=path of a checkout (the first is the baseline)")
    p.add_argument("--lengths", default="2048,8192")
    p.add_argument("--variants", default="full,local,combiner,nsa,moba,indexer")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=1, help="also decode at this batch (the cache repeated)")
    p.add_argument("--rounds", type=int, default=5, help="the checkouts' decoding steps taken in turns, this many rounds")
    p.add_argument("--compile", action="store_true", help="the steps through each checkout's model.compile_decoding")
    p.add_argument("--prefills", type=int, default=1, help="each checkout's prefill this many times, in turns (median)")
    p.add_argument("--malloc", default="kept", choices=("kept", "system"),
                   help="kept: the C allocator keeps freed memory for reuse (decode.keep_freed_memory); system: as it is")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    malloc = "kept" if args.malloc == "kept" and keep_freed_memory() else "system"
    print(f"decode_ab.py: freed memory {'kept for reuse' if malloc == 'kept' else 'as the C allocator does'} "
          f"(--malloc={args.malloc})", flush=True)
    trees = [c.split("=", 1) for c in args.checkouts]
    models = {label: load(label, root) for label, root in trees}
    variants = args.variants.split(",")
    if "full" not in variants:
        variants = ["full"] + variants
    rows = {}
    for T in (int(t) for t in args.lengths.split(",")):
        for attn in variants:
            for label, row in run(models, attn, T, args.steps, args.batch, args.rounds, args.compile, args.prefills).items():
                rows[T, attn, label] = row
                print(f"  T={T} {attn} {label}: decode {row[1]:.1f} ms" + (f", batch {args.batch} {row[2]:.1f} ms"
                                                                          if row[2] else ""), flush=True)
    wide = f" decode ms, batch {args.batch} | x full | / first checkout's |" if args.batch > 1 else ""
    print(f"\n| variant | T | checkout | prefill s | x full | prefill / first checkout's | decode ms | x full "
          f"| decode / first checkout's |{wide}")
    print("|---|---|---|---|---|---|---|---|---|" + "---|---|---|" * bool(wide))
    first = trees[0][0]
    for (T, attn, label), (prefill, ms, many) in rows.items():
        full, before = rows[T, "full", label], rows[T, attn, first]
        line = (f"| {attn} | {T} | {label} | {prefill:.2f} | {prefill / full[0]:.2f} | {prefill / before[0]:.2f} "
                f"| {ms:.1f} | {ms / full[1]:.2f} | {ms / before[1]:.2f} |")
        if wide:
            cells = ["-", "-", "-"] if many is None else [f"{many:.1f}", f"{many / full[2]:.2f}",
                                                          f"{many / before[2]:.2f}" if before[2] else "-"]
            line += "".join(f" {c} |" for c in cells)
        print(line)


if __name__ == "__main__":
    main()
