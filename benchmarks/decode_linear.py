"""A decoding step's weight products on this CPU: each form of model.DecodeLinear.FORMS timed
at every (rows, weight shape) of decode.py's model, in cache (the weight just read) and out of
it (run through copies of the weight, DecodeLinear.COLD_BYTES of them, as DecodeLinear times
them: in a step every weight is read from memory). The ranking out of cache is the one that
holds in a step; in cache the forms can rank otherwise (on an AMD EPYC with AVX-512, F.linear
first at 1 x 768 -> 768 in cache, oneDNN's linear first at every size out of it).

    python benchmarks/decode_linear.py [--batch=1,8] [--threads=1] [--cold_mb=64]

--steps=T: instead, whole decoding steps of decode.py's model (2 layers, vocab 256) after a
prefill of T tokens, each form fixed for every product in turns (DecodeLinear.FORM, as
DECODE_LINEAR fixes one), --rounds rounds of 4 timed steps each after an untimed one: the
median step of each form and its ratio to oneDNN's, per variant of --variants and batch.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model import PRESETS, DecodeLinear, Model, ModelConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import build  # noqa: E402


def best_ms(run, calls, repeats=5):
    """The best of `repeats` timings of run(i) for i < calls, per call, in ms."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(calls):
            run(i)
        best = min(best, (time.perf_counter() - t0) / calls)
    return 1e3 * best


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,8", help="comma-separated rows of a step's products")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cold_mb", type=int, default=DecodeLinear.COLD_BYTES >> 20,
                   help="the copies of a weight a timing out of cache runs through (more than the CPU's caches)")
    p.add_argument("--steps", type=int, default=0, help="T: time whole decoding steps after T tokens instead")
    p.add_argument("--variants", default="full,local,nsa")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.steps:
        return steps(args)
    model = Model(ModelConfig(**dict(PRESETS["qwen-134m"], n_layer=1, vocab_size=256, attn="full")))
    shapes = sorted({(m.out_features, m.in_features) for m in model.modules() if isinstance(m, DecodeLinear)},
                    key=lambda s: -s[0] * s[1])
    print(f"threads {args.threads}, torch {torch.__version__}; ms a product, the best of 5; "
          f"out of cache: through {args.cold_mb} MB of copies of the weight")
    print("| rows x in -> out | form | in cache, ms | out of cache, ms | GB/s out of cache | x F.linear out of cache |")
    print("|---|---|---|---|---|---|")
    with torch.no_grad():
        for rows in (int(b) for b in args.batch.split(",")):
            for out, inp in shapes:
                weight = torch.randn(out, inp) * 0.02
                copies = DecodeLinear.cold_copies(weight, args.cold_mb << 20)
                x = torch.randn(rows, 1, inp)
                times = {}
                for name, form in DecodeLinear.FORMS.items():
                    try:
                        form(x, weight, None)
                    except (RuntimeError, AttributeError) as e:  # (no oneDNN in this torch)
                        print(f"| {rows} x {inp} -> {out} | {name} | refused: {str(e)[:60]} | | | |")
                        continue
                    hot = best_ms(lambda i: form(x, weight, None), 20)
                    cold = best_ms(lambda i: form(x, copies[i], None), len(copies))
                    times[name] = hot, cold
                ref = times["F.linear"][1]
                for name, (hot, cold) in sorted(times.items(), key=lambda kv: kv[1][1]):
                    print(f"| {rows} x {inp} -> {out} | {name} | {hot:.3f} | {cold:.3f} | "
                          f"{weight.nbytes / cold / 1e6:.1f} | {cold / ref:.2f} |")


def steps(args):
    """Decoding steps of each variant with each form of DecodeLinear.FORMS fixed in turns."""
    print(f"threads {args.threads}, torch {torch.__version__}; ms a decoding step after {args.steps} tokens, "
          f"2 layers of qwen-134m widths, the median of {4 * args.rounds} steps a form, the forms in turns")
    forms = list(DecodeLinear.FORMS)
    print("| variant | batch | " + " | ".join(f"{f} ms" for f in forms) + " | " + " | ".join(f"{f} / oneDNN" for f in forms) + " |")
    print("|---|---|" + "---|" * 2 * len(forms))
    idx = torch.randint(0, 256, (1, args.steps), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for attn in args.variants.split(","):
            model = build(attn, layers=2, vocab=256, device="cpu")  # decode.py's model
            cache = model.new_cache()
            model(idx, cache=cache)
            for batch in (int(b) for b in args.batch.split(",")):
                held = cache[0].k.view().shape[0]  # the batch the cache holds now
                for layer in cache:
                    layer.repeat_batch(batch // held)
                token = torch.zeros(batch, 1, dtype=torch.long)
                times = {f: [] for f in forms}
                for _ in range(args.rounds):
                    for f in forms:
                        DecodeLinear.FORM = f
                        model(token, cache=cache)  # untimed: the step after another form's
                        for _ in range(4):
                            t0 = time.perf_counter()
                            model(token, cache=cache)
                            times[f].append(time.perf_counter() - t0)
                DecodeLinear.FORM = None
                ms = {f: 1e3 * statistics.median(t) for f, t in times.items()}
                print(f"| {attn} | {batch} | " + " | ".join(f"{ms[f]:.2f}" for f in forms) + " | "
                      + " | ".join(f"{ms[f] / ms['oneDNN']:.2f}" for f in forms) + " |", flush=True)


if __name__ == "__main__":
    main()
