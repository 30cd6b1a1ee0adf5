"""A decoding step's product of a few query rows with cached keys stored along the positions
(a CPU cache's `keys_last`: K^T (N, D, S) with S contiguous), four ways, in turns, with the
caches flushed before each call (a read of 128 MB, as a step's weights stream through them):

    whole   torch.bmm(rows, K^T)
    pieces  the product over D in pieces of kernels.KEY_STREAMS rows of K^T, added in place
    keys_times  what kernels.keys_times runs (pieces for 2 to KEY_ROWS rows on a CPU, else whole)
    by_row  each row on its own, R matrix-vector products (kT read R times; from cache after the
            first where it fits)

beside a plain sum over the same keys (what reading them once costs). One thread.

    python benchmarks/keys_product.py
    python benchmarks/keys_product.py --quick     # small shapes, a few turns
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels  # noqa: E402

# (key heads x batch N, query rows R, D, keys S): the indexer (4 rows of 64) at batch 1 and 8;
# Qwen3-0.6B's grouped heads (8 key heads, 2 query rows of 128); a sweep of the row count
SHAPES = [(1, 4, 64, 32768), (8, 4, 64, 32768), (8, 2, 128, 32768)] + \
         [(12, R, 64, 16384) for R in (1, 2, 4, 8, 16, 24, 32, 64)]
QUICK = [(1, 4, 64, 2048), (2, 24, 64, 2048)]


def pieces(rows, kT):
    """The product over D in pieces of KEY_STREAMS rows of kT, each added in place, whatever
    the row count."""
    step = kernels.KEY_STREAMS
    out = torch.bmm(rows[..., :step], kT[:, :step])
    for d0 in range(step, kT.shape[1], step):
        out.baddbmm_(rows[..., d0:d0 + step], kT[:, d0:d0 + step])
    return out


def by_row(rows, kT):
    """One product per query row: BLAS's matrix-vector product, which streams at a sum's speed."""
    return torch.cat([torch.bmm(rows[:, r:r + 1], kT) for r in range(rows.shape[1])], 1)


def measure(N, R, D, S, turns, flush):
    """{form: median ms} over `turns` turns of every form, the caches flushed before each call."""
    g = torch.Generator().manual_seed(0)
    kT = torch.randn(N, D, S + 1024, generator=g)[..., :S]  # spare capacity after each row, as a cache's
    rows = torch.randn(N, R, D, generator=g)
    forms = {"whole": lambda: torch.bmm(rows, kT), "pieces": lambda: pieces(rows, kT),
             "keys_times": lambda: kernels.keys_times(rows, kT), "by_row": lambda: by_row(rows, kT),
             "sum": lambda: kT.sum()}
    want = forms["whole"]()
    for name in ("pieces", "keys_times", "by_row"):
        torch.testing.assert_close(forms[name](), want, rtol=1e-4, atol=1e-4)
    times = {name: [] for name in forms}
    for _ in range(turns):
        for name, form in forms.items():
            flush.sum()
            t0 = time.perf_counter()
            form()
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes, a few turns")
    p.add_argument("--turns", type=int, default=15)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    shapes, turns = (QUICK, 3) if args.quick else (SHAPES, args.turns)
    flush = torch.randn((1 << 20) if args.quick else (32 << 20))
    print(f"keys_product.py: torch {torch.__version__}, 1 thread, {turns} turns, KEY_STREAMS {kernels.KEY_STREAMS}, "
          f"KEY_ROWS {kernels.KEY_ROWS}")
    print()
    print("| N | rows | D | keys | MB | whole ms | pieces ms | pieces / whole | keys_times ms | sum ms | keys_times / sum "
          "| by row ms | by row / keys_times |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for N, R, D, S in shapes:
        ms = measure(N, R, D, S, turns, flush)
        print(f"| {N} | {R} | {D} | {S} | {N * D * S * 4 / 1e6:.1f} | {ms['whole']:.2f} | {ms['pieces']:.2f} | "
              f"{ms['pieces'] / ms['whole']:.2f} | {ms['keys_times']:.2f} | {ms['sum']:.2f} | "
              f"{ms['keys_times'] / ms['sum']:.2f} | {ms['by_row']:.2f} | {ms['by_row'] / ms['keys_times']:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
