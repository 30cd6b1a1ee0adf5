"""asga's pair-gated attention: kernels_triton.py's kernels against FlexAttention's and flash
SDPA causal, forward + backward, side by side in one run; or, without a GPU, the kernels
compiled for sm_90 and sm_80 with ptxas's registers and spills for each.

    python benchmarks/asga_kernel.py                       # on a GPU: ms and x SDPA, T = 1024..16384
    python benchmarks/asga_kernel.py --tiles=64,64,8/32,64,4/64,32,4 --tiles=64,32,4/32,32,4/32,32,4
    python benchmarks/asga_kernel.py --backward=split,fused  # the two backward forms side by side
    python benchmarks/asga_kernel.py --flex                # FlexAttention's too (its compile: minutes)
    python benchmarks/asga_kernel.py --compile             # any machine with triton: sm_90 / sm_80 cubins

qwen-134m's attention (12 heads of 64), B = 4, r = 16, bf16 q, k, v and float32 gate terms,
as asga's attend hands them over. --tiles: (query rows, keys, warps) of the forward / the
backward over key blocks / over query blocks; each set is one more row per length.

The float32 floor of eq. 1 at these shapes (exact GELU, r = 16): ~1000 instructions per
visible (query, key) pair forward + backward, so at T = 4096 ~4e11, ~12 ms on an H200; with
the attention's own, ~8.5x flash SDPA (benchmarks/gpu_runs/h200_2026-11-28b.md).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

H, D, R, B = 12, 64, 16, 4


def parse_tiles(text):
    """'64,64,8/32,64,4/64,32,4' -> kernels_triton.TILES."""
    parts = [tuple(int(x) for x in p.split(",")) for p in text.split("/")]
    if len(parts) != 3 or any(len(p) != 3 for p in parts):
        raise SystemExit(f"--tiles={text}: want fwd/bwd_kv/bwd_q, each 'rows,keys,warps', e.g. 64,64,8/32,64,4/64,32,4")
    return dict(fwd=parts[0], bwd_kv=parts[1], bwd_q=parts[2])


def inputs(T, device):
    g = torch.Generator(device).manual_seed(0)
    x = lambda *s, dtype=torch.bfloat16: torch.randn(*s, generator=g, device=device, dtype=dtype)  # noqa: E731
    q, k, v = (x(B, H, T, D).requires_grad_(True) for _ in range(3))
    qt, kt = (x(B, H, T, R, dtype=torch.float32).requires_grad_(True) for _ in range(2))
    w2 = (0.02 * x(H, R, dtype=torch.float32)).requires_grad_(True)
    b2 = torch.zeros(H, device=device, requires_grad=True)
    scale = torch.full((H,), D ** -0.5, device=device, requires_grad=True)
    return q, k, v, qt, kt, w2, b2, scale


def step_fn(fn, args):
    def step():
        out = fn(*args)
        out.float().sum().backward()
    return step


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(step, runs=10):
    """(median ms of runs, the first call's s): CUDA-synchronised wall time."""
    t0 = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t0
    times = []
    for _ in range(runs):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), first


def time_rows(lengths, tile_sets, flex, device="cuda", runs=10, backwards=("split",)):
    import kernels
    import kernels_triton
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton's interpreter: the script checked, not timed)"
    print(f"asga_kernel on {name}, torch {torch.__version__}, B={B} H={H} D={D} r={R}, bf16", flush=True)
    rows = []
    columns = [(tiles, backward) for tiles in tile_sets for backward in backwards]
    for T in lengths:
        q, k, v, qt, kt, w2, b2, scale = inputs(T, device)
        sdpa, _ = timed(step_fn(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), ()), runs)
        row = dict(T=T, sdpa=sdpa)
        for i, (tiles, backward) in enumerate(columns):
            kernels_triton.TILES, kernels_triton.BACKWARD = tiles, backward
            call = lambda: kernels_triton.pair_gated_attention(q, k, v, qt, kt, w2, b2, scale, 0, 0)  # noqa: E731
            try:
                row[f"triton {i}"] = timed(step_fn(call, ()), runs)
            except Exception as e:  # noqa: BLE001 - a tile set that does not fit says so
                row[f"triton {i}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
            print(f"  T={T} tiles {tiles}, {backward} backward: {row[f'triton {i}']}", flush=True)
        if flex:
            kernels.ASGA_KERNEL = "flex"
            call = lambda: kernels.flex_pair_gated_attention(q, k, v, qt, kt, w2, b2, scale, 0, 0)  # noqa: E731
            row["flex"] = timed(step_fn(call, ()), min(runs, 3))
            kernels.ASGA_KERNEL = "auto"
            print(f"  T={T} FlexAttention: {row['flex']}", flush=True)
        rows.append(row)
    print("\n| T | flash SDPA ms | " + " | ".join(f"triton {i}: ms (x SDPA), first s" for i in range(len(columns)))
          + (" | FlexAttention ms (x SDPA), first s" if flex else "") + " |")
    print("|---" * (2 + len(columns) + flex) + "|")
    for row in rows:
        cells = []
        for key in [f"triton {i}" for i in range(len(columns))] + (["flex"] if flex else []):
            value = row[key]
            cells.append(value if isinstance(value, str) else f"{value[0]:.2f} ({value[0] / row['sdpa']:.2f}x), {value[1]:.1f}")
        print(f"| {row['T']} | {row['sdpa']:.2f} | " + " | ".join(cells) + " |")
    for i, (tiles, backward) in enumerate(columns):
        print(f"triton {i}: tiles {tiles}, the {backward} backward (kernels_triton.BACKWARD)")


def compile_for(fn, pointers, const, arch, warps):
    """Triton's jit function `fn` compiled for sm_`arch` (no GPU needed): pointers {arg: '*bf16',
    ...}, const {constexpr arg: value}, the other args i32. (registers, (spill stores, spill
    loads) bytes, cubin bytes, error or None), by ptxas -v on the kernel's PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    names = fn.arg_names
    signature = {n: "constexpr" if n in const else pointers.get(n, "i32") for n in names}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(c),): v for c, v in const.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps))
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        r = subprocess.run([str(ptxas), "-v", f"--gpu-name={gpu}", str(ptx), "-o", os.devnull],
                           capture_output=True, text=True)
    regs = re.findall(r"Used (\d+) registers", r.stderr)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    return (int(regs[0]) if regs else None, tuple(int(x) for x in spills[0]) if spills else None,
            len(compiled.asm["cubin"]), None if regs else r.stderr[-300:])


def compile_rows(tile_sets, archs=(90, 80), gate_spaces=("logit", "prob")):
    """Each kernel compiled for each arch (no GPU needed), with ptxas -v's registers and spill
    bytes: a list of dicts, each printed as a table row."""
    import triton

    import kernels_triton as kt
    print(f"asga_kernel --compile: triton {triton.__version__}, D={D} r={R}, bf16 q, k, v", flush=True)
    common = dict(Q="*bf16", K="*bf16", V="*bf16", QT="*fp32", KT="*fp32", W2="*fp32", B2="*fp32", SC="*fp32")
    grads = dict(DO="*bf16", LSE="*fp32", DELTA="*fp32")
    kernels = dict(
        fwd=(kt._fwd_kernel, dict(common, O="*bf16", LSE="*fp32")),
        bwd_kv=(kt._bwd_kv_kernel, dict(common, **grads, DK="*fp32", DV="*fp32", DKT="*fp32")),
        bwd_q=(kt._bwd_q_kernel, dict(common, **grads, DQ="*fp32", DQT="*fp32", DSC="*fp32", DB2="*fp32", DW2="*fp32")),
        bwd_fused=(kt._bwd_fused_kernel, dict(common, **grads, DQ="*fp32", DK="*fp32", DV="*fp32", DQT="*fp32",
                                              DKT="*fp32", DSC="*fp32", DB2="*fp32", DW2="*fp32")))
    print("\n| arch | gate space | kernel | tile (rows x keys, warps) | registers | spill stores / loads, bytes | s |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for arch in archs:
        for space in gate_spaces:
            for tiles in tile_sets:
                for name, (fn, pointers) in kernels.items():
                    BM, BN, warps = tiles["bwd_kv" if name == "bwd_fused" else name]  # the fused one at bwd_kv's
                    const = dict(D=D, R=R, PROB=space == "prob", IEEE=0, BM=BM, BN=BN)
                    if name != "fwd":
                        const["RP"] = R
                    t0 = time.time()
                    registers, spills, cubin_bytes, error = compile_for(fn, pointers, const, arch, warps)
                    row = dict(arch=arch, gate_space=space, kernel=name, tile=(BM, BN, warps),
                               registers=registers, spills=spills, cubin_bytes=cubin_bytes, error=error)
                    rows.append(row)
                    print(f"| sm_{arch} | {space} | {name} | {BM} x {BN}, {warps} | {row['registers']} "
                          f"| {' / '.join(map(str, row['spills'])) if row['spills'] else row['error']} "
                          f"| {time.time() - t0:.1f} |", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="1024,4096,16384")
    p.add_argument("--tiles", action="append", help="fwd/bwd_kv/bwd_q tiles, each 'rows,keys,warps' (repeatable); "
                   "default kernels_triton.TILES")
    p.add_argument("--backward", default="split", help="comma-separated kernels_triton.BACKWARD forms, each a "
                   "column per tile set: split (two kernels, no atomics), fused (one, atomic adds)")
    p.add_argument("--flex", action="store_true", help="FlexAttention's kernels too (each length compiles, minutes)")
    p.add_argument("--compile", action="store_true", help="no GPU needed: compile for sm_90 and sm_80, ptxas's counts")
    p.add_argument("--runs", type=int, default=10, help="timed steps per row (the median)")
    args = p.parse_args(argv)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # this script's own check, on CPU tensors
    if not (args.compile or torch.cuda.is_available() or interpreted):
        raise SystemExit("asga_kernel.py times CUDA kernels: run it on a GPU, or --compile here")
    import kernels_triton
    tile_sets = [parse_tiles(t) for t in args.tiles] if args.tiles else [kernels_triton.TILES]
    if args.compile:
        return compile_rows(tile_sets)
    backwards = args.backward.split(",")
    if not set(backwards) <= {"split", "fused"}:
        raise SystemExit(f"--backward={args.backward}: each of split, fused")
    time_rows([int(t) for t in args.lengths.split(",")], tile_sets, args.flex,
              "cuda" if torch.cuda.is_available() else "cpu", args.runs, backwards)


if __name__ == "__main__":
    main()
