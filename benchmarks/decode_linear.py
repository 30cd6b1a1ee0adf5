"""A decoding step's weight products on this CPU: each form of model.DecodeLinear.FORMS timed
at every (rows, weight shape) of decode.py's model, in cache (the weight just read) and out of
it (run through copies of the weight, DecodeLinear.COLD_BYTES of them, as DecodeLinear times
them: in a step every weight is read from memory). The ranking out of cache is the one that
holds in a step; in cache the forms can rank otherwise (on an AMD EPYC with AVX-512, F.linear
first at 1 x 768 -> 768 in cache, oneDNN's linear first at every size out of it).

    python benchmarks/decode_linear.py [--batch=1,8] [--threads=1] [--cold_mb=64]
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model import PRESETS, DecodeLinear, Model, ModelConfig  # noqa: E402


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
    args = p.parse_args()
    torch.set_num_threads(args.threads)
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


if __name__ == "__main__":
    main()
