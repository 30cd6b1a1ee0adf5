"""Attention benchmark: each variant's attention core, forward + backward, against causal SDPA.

    python benchmarks/attention.py [--quick] [--threads 1] [--out PATH]

On CPU (what kernels.py's benchmark did before it moved here): the reference (kernel='ref'),
the fused path (kernel='fused', kernels.py's blockwise loops) and causal SDPA, each row in a
forked child process, float32, memory as the peak resident set; then a Markdown table and
the CPU targets (fused `local` at T=8192 >= 6x faster than causal SDPA and >= 12x than the
reference, memory <= 1/8; windowed paths <= 2.3x per doubling of T; `asga` fused >= 2x faster
and <= 1/10 the memory of the reference at T=2048; `combiner` fused memory, which grows as
T (s + T/s) with s = window, <= 2.3x per doubling of T from 4096 to 16384).
benchmarks/combiner_cpu.json holds `combiner` rows measured the same way (forked process,
VmHWM, 1 thread) before this benchmark took the variant: paths 'reference', 'fused', 'sdpa',
T = 1024 .. 16384 (fused memory 67, 201, 263, 316, 573 MB; the reference past 6 GiB from 8192).

nsa, moba and indexer ([NSA], [MoBA], [DS32]): fused memory <= 2.3x per doubling of T from
2048 to 16384 and, at T=8192, faster than causal SDPA (as `local` is). The indexer's step
includes the backward of its KL loss (part of its training step). Memory is measured with
glibc's heap trimmed (`keep_rss_honest`); rows measured before that are in the older JSON files.

On CUDA: the fused path (kernel='fused': FlexAttention + SDPA, compiled) against flash SDPA
causal at T in 1024 .. 16384, bf16 autocast as in training, peak memory from
torch.cuda.max_memory_allocated, and the GPU goal ratios at T=4096 (local and dsa <= 1.0x,
caa <= 2x, asga <= 3x the time of flash SDPA causal). Goals until a GPU measures them.
"""
import argparse
import ctypes
import dataclasses
import json
import multiprocessing
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

BENCH = dict(B=1, H=8, D=64, d_model=512, window=256)
VARIANT_NAMES = ("full", "local", "dsa", "asga", "caa", "combiner", "nsa", "moba", "indexer")
# The reference's peak memory in units of one fp32 (B, H, T, T) score matrix, plus asga's
# (B, H, T, T, r) pair tensors: measured with this benchmark at T = 1024 and 2048 (3.3 for
# full/local/dsa, 8.8 for caa, 3.1 pair tensors for asga; 3.3 (T, T + T/s) for combiner) and rounded up. Used only to skip a
# reference that cannot fit in the memory budget; the row then says OOM, with the prediction.
REF_SCORES = dict(full=4, local=4, dsa=4.5, asga=4, caa=10, combiner=5,
                  nsa=8, moba=6, indexer=8)  # not measured: the (T, S, n) block comparisons, rounded up
REF_PAIRS = dict(asga=3.5)
GPU_GOALS = dict(local=1.0, dsa=1.0, caa=2.0, asga=3.0)  # fused / flash SDPA time at T=4096


def predicted_ref_bytes(variant, T, r=16):
    scores = BENCH["B"] * BENCH["H"] * T * T * 4
    attn = parse_variant(variant)[0]
    return scores * (REF_SCORES[attn] + REF_PAIRS.get(attn, 0) * r)


def parse_variant(spec):
    """'dsa' or 'dsa:dsa_window=fixed,dsa_gate=False' -> ('dsa', {flag: typed value})."""
    from model import ModelConfig

    attn, _, rest = spec.partition(":")
    types = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    flags = {}
    for item in filter(None, rest.split(",")):
        key, value = item.split("=")
        flags[key] = value == "True" if types[key] is bool else types[key](value)
    return attn, flags



# ---------------------------------------------------------------------------- CPU

def _rss_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def keep_rss_honest():
    """glibc: serve allocations above 64 KB from mmap and trim the heap above 64 KB, so that
    freed tensors leave the resident set. Without it the heap kept freed pages and the peak
    resident set measured allocation history, not the step: the same moba case (T=1024)
    measured 35 MB and 908 MB in two runs. No-op off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 16)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 16)


def _measure(variant, T, path, threads, budget_s, limit_bytes, conn, memory=False):
    """Runs in a freshly forked process. Time (memory=False): forward + backward, the median
    of the runs after the first. Memory (memory=True, a second process): one step with
    glibc's heap trimmed (`keep_rss_honest`, which slows allocation, hence not while timing),
    the peak resident set (VmHWM, reset through /proc/self/clear_refs once the inputs exist)
    minus the resident set at that moment: everything the forward and backward held at once
    (saved tensors, transients, gradients), as the OS saw it. A run at T = 256 first pages in
    the code and thread pools, which would otherwise count."""
    try:
        from attention import VARIANTS
        from model import ModelConfig

        if memory:
            keep_rss_honest()
        torch.set_num_threads(threads)
        if limit_bytes:  # allocations past the budget raise (reported as OOM), not the OOM killer
            with open("/proc/self/statm") as f:
                vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (vm + limit_bytes, vm + limit_bytes))
        torch.manual_seed(0)
        attn, flags = parse_variant(variant)
        cfg = ModelConfig(n_head=BENCH["H"], n_kv_head=BENCH["H"], head_dim=BENCH["D"], d_model=BENCH["d_model"],
                          window=BENCH["window"], attn=attn, kernel="ref" if path == "ref" else "fused", **flags)
        module = VARIANTS[attn](cfg)
        for p in module.parameters():
            p.data.normal_(0, 0.1)
        B, H, D = BENCH["B"], BENCH["H"], BENCH["D"]

        def case(n):
            q, k, v = (torch.randn(B, H, n, D, requires_grad=True) for _ in range(3))
            x = torch.randn(B, n, BENCH["d_model"], requires_grad=True)
            cotangent = torch.randn(B, H, n, D)
            fn = {"ref": lambda: module.attend(q, k, v, x, 0, 0),  # cfg.kernel picks the path
                  "fused": lambda: module.attend(q, k, v, x, 0, 0),
                  "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}[path]

            def step():
                t = time.perf_counter()
                y = fn()
                # the indexer's KL (computed in a training-mode forward) is part of its training
                # step: its backward is timed too
                extra = getattr(module, "indexer_loss", None) if path != "sdpa" else None
                torch.autograd.backward([y] + ([extra] if extra is not None else []),
                                        [cotangent] + ([torch.ones(())] if extra is not None else []))
                for tensor in (q, k, v, x, *module.parameters()):
                    tensor.grad = None
                return time.perf_counter() - t
            return step

        case(min(T, 256))()
        step = case(T)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident set to the current one
        base = _rss_kb("VmRSS:")
        if memory:
            step()
            conn.send(dict(peak_mb=(_rss_kb("VmHWM:") - base) / 1024))
            return
        warmup, runs = step(), []
        while len(runs) < 5 and not (runs and sum(runs) > budget_s and (len(runs) >= 2 or runs[0] > budget_s / 2)):
            runs.append(step())
        times = [warmup] + runs
        conn.send(dict(ms=1e3 * statistics.median(runs), runs=len(runs),
                       peak_mb=(_rss_kb("VmHWM:") - base) / 1024, all_ms=[round(1e3 * t, 1) for t in times]))
    except Exception as e:  # noqa: BLE001 - reported in the row; an allocation failure is OOM
        message = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        conn.send(dict(oom=isinstance(e, MemoryError) or "allocate" in message, error=message))


def benchmark(lengths, variants, threads, budget_s, max_bytes, paths=("ref", "fused", "sdpa")):
    """[row]: one per (variant, T, path): the attention core alone (the module's `attend` with
    kernel='ref' or 'fused', or causal SDPA on the same q, k, v), forward + backward with a random
    cotangent, module parameters random. Each row is measured alone in two forked child
    processes, one for time and one for memory (see `_measure`), the three paths of a (variant, T) one after the other so that they
    share the machine's load. A reference predicted past max_bytes is not run: its row says
    oom, with the prediction; one that fails to allocate says oom too.

    threads: torch's intra-op threads. On a 2-core machine shared with other jobs, 2 threads
    make every op wait for a descheduled OpenMP thread: the same case measured 0.14 s and 7 s
    minutes apart. 1 thread gives repeatable numbers there."""
    ctx = multiprocessing.get_context("fork")  # the parent never runs torch ops: fork is safe
    rows = []
    for T in lengths:
        for variant in variants:
            for path in paths:
                row = dict(variant=variant, T=T, path=path, threads=threads, torch=torch.__version__, **BENCH)
                if path == "ref" and predicted_ref_bytes(variant, T) > max_bytes:
                    row.update(ms=None, peak_mb=None, oom=True,
                               error=f"predicted {predicted_ref_bytes(variant, T) / 2**30:.0f} GiB "
                                     f"> {max_bytes / 2**30:.0f} GiB budget")
                else:
                    def child_result(memory):
                        recv, send = ctx.Pipe(duplex=False)
                        child = ctx.Process(target=_measure, args=(variant, T, path, threads, budget_s,
                                                                   max_bytes, send, memory))
                        child.start()
                        child.join()
                        return recv.recv() if recv.poll() else dict(
                            oom=child.exitcode == -9, error=f"child exited with {child.exitcode}")

                    timed = child_result(memory=False)
                    # the timing process's own peak (heap not trimmed): kept, not the memory figure
                    timed["untrimmed_peak_mb"] = timed.pop("peak_mb", None)
                    row.update(dict(ms=None, peak_mb=None), **timed)
                    if "error" not in timed:
                        row.update(child_result(memory=True))
                rows.append(row)
                shown = "OOM" if row.get("oom") else row.get("error") or f"{row['ms']:9.1f} ms {row['peak_mb']:8.1f} MB"
                print(f"  {variant} T={T} {path} {shown}", flush=True)
    return rows


def table(rows):
    """Markdown table: per variant and T, the three paths and the fused path's ratios."""
    get = {(r["variant"], r["T"], r["path"]): r for r in rows}
    fmt = lambda x, f: "—" if x is None else f.format(x)  # noqa: E731
    lines = ["| variant | T | ref ms | fused ms | SDPA ms | ref/fused time | SDPA/fused time "
             "| ref MB | fused MB | SDPA MB | ref/fused mem | fused x time, x mem vs T/2 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for variant in dict.fromkeys(r["variant"] for r in rows):
        for T in sorted({r["T"] for r in rows if r["variant"] == variant}):
            ref, fused, sdpa = (get.get((variant, T, p), {}) for p in ("ref", "fused", "sdpa"))
            half = get.get((variant, T // 2, "fused"), {})
            ratio = lambda a, b: None if a.get("ms") is None or b.get("ms") is None else a["ms"] / b["ms"]  # noqa: E731
            mem = lambda a, b: None if a.get("peak_mb") is None or b.get("peak_mb") is None else a["peak_mb"] / max(b["peak_mb"], 1.0)  # noqa: E731
            growth = "—" if ratio(fused, half) is None else f"{ratio(fused, half):.2f}x, {mem(fused, half):.2f}x"
            lines.append(" | ".join([
                f"| {variant}", str(T), "OOM" if ref.get("oom") else fmt(ref.get("ms"), "{:.0f}"),
                fmt(fused.get("ms"), "{:.0f}"), fmt(sdpa.get("ms"), "{:.0f}"),
                fmt(ratio(ref, fused), "{:.1f}x"), fmt(ratio(sdpa, fused), "{:.1f}x"),
                "OOM" if ref.get("oom") else fmt(ref.get("peak_mb"), "{:.0f}"),
                fmt(fused.get("peak_mb"), "{:.0f}"), fmt(sdpa.get("peak_mb"), "{:.0f}"),
                fmt(mem(ref, fused), "{:.1f}x"), growth]) + " |")
    return "\n".join(lines)


def targets(rows):
    """The CPU targets, checked against the rows that exist: [line]."""
    get = {(r["variant"], r["T"], r["path"]): r.get("ms") for r in rows}
    mem = {(r["variant"], r["T"], r["path"]): r.get("peak_mb") for r in rows}
    checks = []

    def check(what, value, ok):
        if value is not None:
            checks.append(f"{'met ' if ok(value) else 'MISSED'} {what}: {value:.2f}")

    def ratio(table, a, b):
        return None if table.get(a) is None or table.get(b) is None else table[a] / table[b]

    check("local T=8192 SDPA/fused time (>= 6)", ratio(get, ("local", 8192, "sdpa"), ("local", 8192, "fused")), lambda x: x >= 6)
    check("local T=8192 ref/fused time (>= 12)", ratio(get, ("local", 8192, "ref"), ("local", 8192, "fused")), lambda x: x >= 12)
    check("local T=8192 ref/fused memory (>= 8)", ratio(mem, ("local", 8192, "ref"), ("local", 8192, "fused")), lambda x: x >= 8)
    for variant in ("local", "dsa"):  # the fused windowed paths
        check(f"{variant} fused time 8192/4096 (<= 2.3)", ratio(get, (variant, 8192, "fused"), (variant, 4096, "fused")), lambda x: x <= 2.3)
        check(f"{variant} fused memory 8192/4096 (<= 2.3)", ratio(mem, (variant, 8192, "fused"), (variant, 4096, "fused")), lambda x: x <= 2.3)
    check("asga T=2048 ref/fused time (>= 2)", ratio(get, ("asga", 2048, "ref"), ("asga", 2048, "fused")), lambda x: x >= 2)
    check("asga T=2048 fused/ref memory (<= 0.1)", ratio(mem, ("asga", 2048, "fused"), ("asga", 2048, "ref")), lambda x: x <= 0.1)
    for T in (8192, 16384):  # T (s + T/s): nearly linear while T/s < s = 256
        check(f"combiner fused memory {T}/{T // 2} (<= 2.3)",
              ratio(mem, ("combiner", T, "fused"), ("combiner", T // 2, "fused")), lambda x: x <= 2.3)
    for variant in ("nsa", "moba", "indexer"):  # the dynamic sparse baselines ([NSA], [MoBA], [DS32])
        for T in (4096, 8192, 16384):
            check(f"{variant} fused memory {T}/{T // 2} (<= 2.3)",
                  ratio(mem, (variant, T, "fused"), (variant, T // 2, "fused")), lambda x: x <= 2.3)
        check(f"{variant} T=8192 SDPA/fused time (> 1)", ratio(get, (variant, 8192, "sdpa"), (variant, 8192, "fused")),
              lambda x: x > 1)
    check("asga T=8192 fused runs, seconds", None if get.get(("asga", 8192, "fused")) is None
          else get[("asga", 8192, "fused")] / 1e3, lambda x: True)
    return checks


# ---------------------------------------------------------------------------- CUDA

def cuda_module(variant, B, H, D, d_model, window):
    from attention import VARIANTS
    from model import ModelConfig

    attn, flags = parse_variant(variant)
    cfg = ModelConfig(n_head=H, n_kv_head=H, head_dim=D, d_model=d_model, window=window, attn=attn,
                      kernel="fused", **flags)
    module = VARIANTS[attn](cfg).cuda()
    for p in module.parameters():
        p.data.normal_(0, 0.1)
    return module


def cuda_time(fn, args, cotangent, warmup=3, runs=10):
    """(median ms of forward + backward, peak MB allocated during one step)."""
    for _ in range(warmup):
        fn(*args).backward(cotangent)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args).backward(cotangent)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def benchmark_cuda(lengths, variants, B=8, H=12, D=64, d_model=768, window=256):
    """[row]: per (variant, T), the fused attention core and flash SDPA causal on the same
    bf16 q, k, v (the qwen-134m attention shapes), forward + backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for T in lengths:
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        x = torch.randn(B, T, d_model, device="cuda", requires_grad=True)
        cot = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)

        def flash(q, k, v, x):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        flash_ms, flash_mb = cuda_time(flash, (q, k, v, x), cot)
        for variant in variants:
            row = dict(variant=variant, T=T, B=B, H=H, D=D, flash_ms=flash_ms, flash_mb=flash_mb,
                       device=torch.cuda.get_device_name(), torch=torch.__version__)
            try:
                module = cuda_module(variant, B, H, D, d_model, window)

                def fused(q, k, v, x):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        return module.attend(q, k, v, x, 0, 0)
                row["ms"], row["mb"] = cuda_time(fused, (q, k, v, x), cot)
            except Exception as e:  # noqa: BLE001 - reported in the row (out of memory, say)
                row["error"] = (str(e).splitlines() or [type(e).__name__])[0][:200]
                torch.cuda.empty_cache()
            rows.append(row)
            shown = row.get("error") or f"{row['ms']:8.2f} ms ({row['ms'] / flash_ms:5.2f}x flash) {row['mb']:8.0f} MB"
            print(f"  {variant:30s} T={T:6d} {shown}   flash {flash_ms:7.2f} ms {flash_mb:7.0f} MB", flush=True)
    return rows


def cuda_goals(rows):
    """The GPU goal at T=4096: [line] 'met'/'MISSED' per variant."""
    lines = []
    for r in rows:
        attn = parse_variant(r["variant"])[0]
        if r["T"] == 4096 and attn in GPU_GOALS and r.get("ms") is not None:
            ratio = r["ms"] / r["flash_ms"]
            lines.append(f"{'met ' if ratio <= GPU_GOALS[attn] else 'MISSED'} {r['variant']} T=4096 fused / "
                         f"flash SDPA causal time (<= {GPU_GOALS[attn]:g}x): {ratio:.2f}x")
    return lines


# ---------------------------------------------------------------------------- main

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a reduced grid, under a minute on CPU")
    parser.add_argument("--out", help="write the raw rows to this JSON file")
    parser.add_argument("--lengths", type=lambda s: [int(t) for t in s.split(",")])
    parser.add_argument("--variants", type=lambda s: s.split(";"),
                        help="';'-separated, each a name with optional flags: 'dsa:dsa_window=fixed;caa'")
    parser.add_argument("--paths", type=lambda s: s.split(","), default=["ref", "fused", "sdpa"], help="CPU only")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU intra-op threads (1: repeatable on a shared machine, see `benchmark`)")
    parser.add_argument("--budget", type=float, default=20.0, help="CPU: seconds of runs per case, roughly")
    parser.add_argument("--max-gb", type=float, help="CPU: memory one case may use (default: 60%% of available)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    variants = args.variants or list(VARIANT_NAMES)
    if args.device == "cuda":
        lengths = args.lengths or ([1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384])
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, bf16 autocast, forward+backward, "
              f"fused (FlexAttention + SDPA) vs flash SDPA causal", flush=True)
        rows = benchmark_cuda(lengths, variants)
        print("\n".join(cuda_goals(rows)))
    else:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
        max_bytes = int(args.max_gb * 2**30) if args.max_gb else int(0.6 * available)
        lengths = args.lengths or ([512, 1024] if args.quick else [1024, 2048, 4096, 8192, 16384])
        budget = 0.5 if args.quick else args.budget
        print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs, "
              f"B={BENCH['B']} H={BENCH['H']} D={BENCH['D']} W={BENCH['window']} fp32, forward+backward, "
              f"memory budget {max_bytes / 2**30:.1f} GiB", flush=True)
        rows = benchmark(lengths, variants, args.threads, budget, max_bytes, args.paths)
        print(table(rows))
        print("\n".join(targets(rows)))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
