"""Peak memory and time of `combiner`'s fused path (kernels.combiner_attention) against its
reference (attention.CombinerAttention.attend) and dense causal SDPA, forward + backward,
on CPU in float32 (issue 14: memory grows as T (s + T/s), not T^2).

    OMP_NUM_THREADS=1 python benchmarks/combiner_memory.py                # T = 1024 .. 16384
    OMP_NUM_THREADS=1 python benchmarks/combiner_memory.py --lengths=1024,2048 --out=rows.json

Each case runs in its own forked process: memory is the peak resident set during the runs
(VmHWM, reset through /proc/self/clear_refs once the inputs exist) minus the resident set at
that moment, i.e. everything forward and backward held at once. Time: the median of the runs
after a warm-up. A reference predicted to exceed the memory budget is not run (its row says
so). `combiner_memory(...)` returns the rows, for a benchmark script to include.
"""
import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels  # noqa: E402
from attention import CombinerAttention  # noqa: E402
from model import ModelConfig  # noqa: E402

SHAPE = dict(B=1, H=8, D=64, block=256)
# The reference holds about 5 float32 (H, T, T + T/s) tensors at its peak (masked logits,
# probabilities, their gradients; measured 3.3 at T = 2048 and rounded up): used
# only to skip a reference that would not fit.
REF_COPIES = 5


def predicted_ref_bytes(T, B=SHAPE["B"], H=SHAPE["H"], block=SHAPE["block"]):
    return REF_COPIES * 4 * B * H * T * (T + T // block)


def _rss_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def _measure(path, T, runs, threads, conn):
    try:
        torch.set_num_threads(threads)
        B, H, D, block = SHAPE["B"], SHAPE["H"], SHAPE["D"], SHAPE["block"]
        module = CombinerAttention(ModelConfig(n_head=H, n_kv_head=H, head_dim=D, d_model=H * D,
                                               window=block, attn="combiner"))
        scale = 1 / math.sqrt(D)

        def case(n):
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(B, H, n, D, generator=g).requires_grad_() for _ in range(3))
            pos, cotangent = torch.arange(n), torch.randn(B, H, n, D, generator=g)
            fn = {"reference": lambda: module.attend(q, k, v, None, pos, pos),
                  "fused": lambda: kernels.combiner_attention(q, k, v, block, scale),
                  "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)}[path]

            def step():
                start = time.perf_counter()
                fn().backward(cotangent)
                q.grad = k.grad = v.grad = None
                return time.perf_counter() - start
            return step

        case(min(T, 2 * block))()  # page in code and thread pools first
        step = case(T)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident set to the current one
        base = _rss_kb("VmRSS:")
        times = [step() for _ in range(runs + 1)][1:]
        conn.send(dict(ms=1e3 * statistics.median(times), peak_mb=(_rss_kb("VmHWM:") - base) / 1024))
    except Exception as e:  # noqa: BLE001 - reported in the row
        conn.send(dict(error=str(e).splitlines()[0][:200] if str(e) else type(e).__name__))


def combiner_memory(lengths=(1024, 2048, 4096, 8192, 16384), paths=("reference", "fused", "sdpa"),
                    runs=2, threads=1, max_bytes=6 * 2**30):
    """[row]: one per (T, path), each measured alone in a forked process."""
    ctx = multiprocessing.get_context("fork")
    rows = []
    for T in lengths:
        for path in paths:
            row = dict(T=T, path=path, threads=threads, torch=torch.__version__, **SHAPE)
            if path == "reference" and predicted_ref_bytes(T) > max_bytes:
                row.update(skipped=f"predicted {predicted_ref_bytes(T) / 2**30:.1f} GiB > "
                                   f"{max_bytes / 2**30:.1f} GiB budget")
            else:
                recv, send = ctx.Pipe(duplex=False)
                child = ctx.Process(target=_measure, args=(path, T, runs, threads, send))
                child.start()
                child.join()
                row.update(recv.recv() if recv.poll() else dict(error=f"child exited with {child.exitcode}"))
            rows.append(row)
            print(f"  T={T} {path}: {row}", flush=True)
    return rows


def table(rows):
    get = {(r["T"], r["path"]): r for r in rows}
    show = lambda r, key, f: f.format(r[key]) if key in r else ("skipped" if "skipped" in r else "—")  # noqa: E731
    lines = ["| T | ref ms | fused ms | SDPA ms | ref MB | fused MB | SDPA MB | fused MB / T (KB) |",
             "|---|---|---|---|---|---|---|---|"]
    for T in sorted({r["T"] for r in rows}):
        ref, fused, sdpa = (get.get((T, p), {}) for p in ("reference", "fused", "sdpa"))
        per_token = f"{fused['peak_mb'] * 1024 / T:.1f}" if "peak_mb" in fused else "—"
        lines.append(f"| {T} | {show(ref, 'ms', '{:.0f}')} | {show(fused, 'ms', '{:.0f}')} | "
                     f"{show(sdpa, 'ms', '{:.0f}')} | {show(ref, 'peak_mb', '{:.0f}')} | "
                     f"{show(fused, 'peak_mb', '{:.0f}')} | {show(sdpa, 'peak_mb', '{:.0f}')} | {per_token} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=lambda s: [int(t) for t in s.split(",")],
                        default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--paths", type=lambda s: s.split(","), default=["reference", "fused", "sdpa"])
    parser.add_argument("--runs", type=int, default=2, help="timed runs after the warm-up")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-gb", type=float, default=6.0, help="skip a reference predicted above this")
    parser.add_argument("--out", help="write the raw rows to this JSON file")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {args.threads} threads, B={SHAPE['B']} H={SHAPE['H']} "
          f"D={SHAPE['D']} s={SHAPE['block']} fp32, forward+backward", flush=True)
    rows = combiner_memory(args.lengths, args.paths, args.runs, args.threads, int(args.max_gb * 2**30))
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
