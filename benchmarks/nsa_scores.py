"""nsa's selection ([NSA] eqs. 8-12) on a GPU: its block scores through kernels_triton.block_scores
(one kernel) against kernels.chunked_block_scores (torch ops a chunk of queries at a time), and
the blocks chosen from each, against kernels_triton.top_blocks, which scores and chooses in one
kernel (what nsa runs on CUDA), side by side in one run; or, without a GPU, both kernels (and
moba's choice, kernels_triton.moba_blocks) compiled for sm_90 and sm_80 with ptxas's registers
and spills.

    python benchmarks/nsa_scores.py                  # on a GPU: ms at T = 4096, 16384
    python benchmarks/nsa_scores.py --compile        # any machine with triton: sm_90 / sm_80 cubins

qwen-134m's attention (12 heads of 64, no GQA), B = 4, bf16 q and compressed keys as nsa's
attend hands them over (under autocast), the defaults l, d, l' = 16, 8, 32, n = 8. Each row:
the scores alone, then the chosen blocks (attention.nsa_top_blocks: torch.topk over the
scores; or the fused kernel), the scores kernel's largest difference from the torch form
relative to the largest score, and the share of rows whose chosen blocks differ from the torch
form's (float32 sums in another order flip near ties; on an H200 "same blocks" was False).
"""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent))  # asga_kernel's compile_for; after the root (attention.py)

import torch  # noqa: E402

H, D, B = 12, 64, 4
LENGTH, STRIDE, BLOCK, TOPK = 16, 8, 32, 8


def time_rows(lengths, runs, device, batch):
    import attention
    import kernels
    import kernels_triton
    from asga_kernel import timed  # (median ms, first call's s), CUDA-synchronised
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton's interpreter: the script checked, not timed)"
    print(f"nsa_scores on {name}, torch {torch.__version__}, B={batch} H={H} D={D}, (l, d, l') = "
          f"({LENGTH}, {STRIDE}, {BLOCK}), n = {TOPK}, bf16", flush=True)
    print("\n| T | compressed keys | scores: torch ms | kernel ms | kernel x torch | chosen blocks: torch ms "
          "| scores kernel + torch.topk ms | fused kernel ms | fused x torch | largest score difference | rows choosing other blocks: kernel + topk / fused |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for T in lengths:
        C = (T - LENGTH) // STRIDE + 1
        J = -(-T // BLOCK)
        g = torch.Generator(device).manual_seed(0)
        q = torch.randn(batch, H, T, D, generator=g, device=device, dtype=torch.bfloat16)
        k = torch.randn(batch, H, C, D, generator=g, device=device, dtype=torch.bfloat16)
        args = (q, k, D ** -0.5, 0, LENGTH, STRIDE, BLOCK, J)
        scores = dict(torch=lambda: kernels.chunked_block_scores(*args), kernel=lambda: kernels_triton.nsa_block_scores(*args))
        chosen = {n: lambda s=s: attention.nsa_top_blocks(s(), 0, BLOCK, TOPK, H) for n, s in scores.items()}
        chosen["fused"] = lambda: kernels_triton.nsa_top_blocks(*args, TOPK)
        with torch.no_grad():
            a, b = scores["torch"](), scores["kernel"]()
            error = ((a - b).abs().max() / a.abs().max()).item()
            del a, b
            # float32 sums in another order move a score by ~1e-7 of the largest: a near tie can
            # flip, so the share of rows whose chosen blocks differ, not one bool for B H T rows
            want = chosen["torch"]()
            differ = {n: (chosen[n]() != want).any(-1).float().mean().item() for n in ("kernel", "fused")}
            ms = {n: timed(f, runs)[0] for n, f in scores.items()}
            ms_n = {n: timed(f, runs)[0] for n, f in chosen.items()}
        print(f"| {T} | {C} | {ms['torch']:.2f} | {ms['kernel']:.2f} | {ms['kernel'] / ms['torch']:.2f} "
              f"| {ms_n['torch']:.2f} | {ms_n['kernel']:.2f} | {ms_n['fused']:.2f} | {ms_n['fused'] / ms_n['torch']:.2f} "
              f"| {error:.1e} | {100 * differ['kernel']:.3f}% / {100 * differ['fused']:.3f}% |", flush=True)


def compile_rows(archs=(90, 80)):
    """nsa's two kernels (scores; scores and choice) at kernels_triton.SCORE_TILES, bf16 and
    float32 inputs, head dims 64 and 128 (Qwen3-0.6B's), compiled for each arch: (arch, kernel,
    dtype, D, registers, spills) rows."""
    import triton

    import kernels_triton as kt
    from asga_kernel import compile_for
    BM, BN, NB, warps = kt.SCORE_TILES
    print(f"nsa_scores --compile: triton {triton.__version__}, tiles (rows, keys, blocks, warps) = {kt.SCORE_TILES}, "
          f"(l, d, l') = ({LENGTH}, {STRIDE}, {BLOCK})", flush=True)
    print("\n| arch | kernel | inputs | D | registers | spill stores / loads, bytes | s |")
    print("|---|---|---|---|---|---|---|")
    kernels = dict(scores=(kt._block_scores_kernel, dict(OUT="*fp32"), {}),
                   choice=(kt._top_blocks_kernel, dict(STATS="*fp32", OUT="*i64"), dict(BLOCK=BLOCK, KEEP=TOPK)))
    rows = []
    for arch in archs:
        for d in (64, 128):  # moba's choice (kernels_triton.moba_blocks): float32 q and block means
            BMm, NBm, warps_m = kt.MOBA_TILES
            t0 = time.time()
            registers, spills, cubin_bytes, error = compile_for(
                kt._moba_blocks_kernel, dict(Q="*fp32", MEANS="*fp32", OUT="*i64"),
                dict(BLOCK=64, D=d, BM=BMm, NB=NBm, KEEP=4), arch, warps_m)  # moba_topk = 4: a running top 4
            rows.append(dict(arch=arch, kernel="moba choice", dtype="fp32", D=d, registers=registers, spills=spills,
                             cubin_bytes=cubin_bytes, error=error))
            print(f"| sm_{arch} | moba choice | fp32 | {d} | {registers} "
                  f"| {' / '.join(map(str, spills)) if spills else error} | {time.time() - t0:.1f} |", flush=True)
        for name, (fn, pointers, extra) in kernels.items():
            for dtype, ieee in (("bf16", 0), ("fp32", 1)):
                for d in (64, 128):
                    const = dict(LENGTH=LENGTH, STRIDE=STRIDE, PB=BLOCK // STRIDE, COVERS=LENGTH // STRIDE, E=1, D=d,
                                 BM=BM, BN=BN, NB=NB, IEEE=ieee, **extra)
                    t0 = time.time()
                    registers, spills, cubin_bytes, error = compile_for(
                        fn, dict(pointers, Q=f"*{dtype}", K=f"*{dtype}", scale="fp32"), const, arch, warps)
                    rows.append(dict(arch=arch, kernel=name, dtype=dtype, D=d, registers=registers, spills=spills,
                                     cubin_bytes=cubin_bytes, error=error))
                    print(f"| sm_{arch} | {name} | {dtype} | {d} | {registers} "
                          f"| {' / '.join(map(str, spills)) if spills else error} | {time.time() - t0:.1f} |", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="4096,16384")
    p.add_argument("--batch", type=int, default=B)
    p.add_argument("--compile", action="store_true", help="no GPU needed: compile for sm_90 and sm_80, ptxas's counts")
    p.add_argument("--runs", type=int, default=10, help="timed calls per row (the median)")
    args = p.parse_args(argv)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # this script's own check, on CPU tensors
    if not (args.compile or torch.cuda.is_available() or interpreted):
        raise SystemExit("nsa_scores.py times CUDA kernels: run it on a GPU, or --compile here")
    if args.compile:
        return compile_rows()
    time_rows([int(t) for t in args.lengths.split(",")], args.runs, "cuda" if torch.cuda.is_available() else "cpu",
              args.batch)


if __name__ == "__main__":
    main()
