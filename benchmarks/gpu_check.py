"""The GPU node check: one command that runs what only a GPU can show, and writes it down.

    python benchmarks/gpu_check.py                 # on a GPU node: ~20-40 min on one H100 (not yet measured)
    python benchmarks/gpu_check.py --tiny          # the same steps at a tiny shape (the default on a CPU)
    python benchmarks/gpu_check.py --profile       # where the time goes: ~8 min on one H100, compiles included
    python benchmarks/gpu_check.py --profile --dry_run   # the same code path at the tiny shape (seconds, any device)

1. tests: the CUDA-only tests (`pytest -m cuda tests`): compiled FlexAttention's gradients
   for q, k, v against the reference, for every variant (FlexAttention has no CPU backward).
2. attention: each configuration's attention core, forward + backward in bf16 autocast at
   T = 1024 .. 8192 (qwen-134m's 12 heads of 64, batch 4), its time and peak memory, and its
   time over flash SDPA's (causal) on the same q, k, v.
3. training: 30 steps of each configuration at the qwen-134m shape (bf16 autocast, compiled
   as train.py compiles, block by block: model.compile_blocks; AdamW, random tokens, train.py's
   own optimizer and preflight), printing tokens/s, MFU (flops.py), peak memory and the first
   step's seconds, compiles included (when training is ready); a configuration whose kernels
   fail the preflight says which path it fell back to, and one that fails outright keeps its
   error in its row.

--profile (instead of 1-3, inside --budget_s, 480 s by default): for every variant (its
default flags; full, then the selecting variants, asga last: PROFILE_ORDER), at T = 4096 then
16384 (B = 4, bf16, qwen-134m heads), the attention core compiled as train.py's compiled
blocks run it (torch.compile of its `attend`; eager where that fails, and the row says so;
eager on a CPU), its first forward + backward (the compile, after torch._dynamo.reset():
"compile s"), at 4096 the top kernels of one forward + backward by device time
(torch.profiler; CPU time on a CPU) with the number of kernels launched, and each length's
time over SDPA causal's in the same run; then training steps, compiled, as far as the budget
goes. A row that the budget does not leave time for says so ("skipped"); every row is saved as
it is measured.

Everything goes to one JSON (`--out`, default gpu_check.json) and one Markdown table (the
same name, .md) to paste into an issue, with the device, torch, CUDA and git commit. On a CPU
the tiny shape (the 2-layer `tiny` model, T = 64 .. 128, 3 steps) runs every step in about a
minute, float32 with kernel=fused (blockwise) and no compile: the suite runs it that way
(tests/test_benchmarks.py), so the command is known to work before it meets a GPU.
"""
import argparse
import atexit
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from contextlib import nullcontext

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import flops  # noqa: E402
import train  # noqa: E402
from attention import VARIANTS  # noqa: E402
from config import TrainConfig, preflight, tf32_matmuls  # noqa: E402
from model import PRESETS, Model, ModelConfig, compile_blocks  # noqa: E402

# Every variant, and each flag that changes the kernels (gpu_compile_check's configurations).
CONFIGS = [
    ("full", {}), ("local", {}), ("dsa", {}), ("dsa-fixed", dict(dsa_window="fixed")),
    ("asga", {}), ("asga-prob", dict(asga_gate_space="prob")), ("asga-noscale", dict(asga_scale=False)),
    ("asga-fixed", dict(asga_gate="fixed")), ("caa", {}), ("caa-all", dict(caa_topk="all")),
    ("combiner", {}), ("nsa", {}), ("moba", {}), ("indexer", {}),
]
# --profile's order, as its budget may not reach the last rows: SDPA's own path first, then the
# selecting variants (nsa, moba, the indexer: the GPU path rebuilt so that their work follows
# the selection, not yet timed on a GPU), and asga last, whose pair-gate kernel compiles longest.
PROFILE_ORDER = ("full", "nsa", "moba", "indexer", "combiner", "local", "dsa", "caa", "asga")


def profile_order(configs):
    """configs in PROFILE_ORDER, a variant not named there last."""
    rank = {name: i for i, name in enumerate(PROFILE_ORDER)}
    return sorted(configs, key=lambda c: rank.get(c[0].split("-")[0], len(rank)))


PROFILE_CONFIGS = profile_order([(n, f) for n, f in CONFIGS if n in VARIANTS])  # each variant at its defaults
GPU = dict(model="qwen-134m", lengths=(1024, 2048, 4096, 8192), attn_batch=4, T=1024, batch=16, steps=30)
TINY = dict(model="tiny", lengths=(64, 128), attn_batch=2, T=64, batch=4, steps=3)
# The tiny shape's sizes: every window, block and budget well inside T = 64.
PROFILE = dict(GPU, lengths=(4096, 16384), steps=5, budget_s=480)
PROFILE_TINY = dict(TINY, steps=2, budget_s=300)
TOP_KERNELS = 10
TINY_FLAGS = dict(window=16, dsa_threshold=32, caa_window_max=32, nsa_cmp_block=8, nsa_cmp_stride=4, nsa_block=8,
                  nsa_topk=3, nsa_window=16, moba_block=8, moba_topk=3, index_head_dim=16)


def config(name, flags, shape, kernel="fused"):
    attn = name.split("-")[0]
    extra = TINY_FLAGS if shape["model"] == "tiny" else {}
    return ModelConfig(**{**PRESETS[shape["model"]], "vocab_size": 512 if shape["model"] == "tiny" else 50304,
                          "attn": attn, "kernel": kernel, **extra, **flags})


class Timer:
    """Wall time of a step (synchronised on CUDA) and the peak memory since reset()."""

    def __init__(self, device):
        self.cuda = device.startswith("cuda")

    def reset(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def time(self, fn):
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def peak_gb(self):
        return torch.cuda.max_memory_allocated() / 1e9 if self.cuda else None


def first_line(e):
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def run_tests(device):
    """The CUDA-only tests (marked `cuda`), as a child pytest of the files that hold them:
    {'passed', 'failed', 'skipped', 'summary', ...}."""
    tests = os.path.join(ROOT, "tests")
    files = sorted(os.path.join(tests, f) for f in os.listdir(tests) if f.startswith("test_") and f.endswith(".py")
                   and "@pytest.mark.cuda" in open(os.path.join(tests, f)).read())
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider", *files],
                       cwd=ROOT, capture_output=True, text=True)
    lines = r.stdout.strip().splitlines()
    summary = lines[-1] if lines else r.stderr.strip()[-300:]
    counts = {k: 0 for k in ("passed", "failed", "skipped", "error")}
    for part in summary.strip("= ").split(","):
        words = part.split()
        if len(words) >= 2 and words[0].isdigit():
            key = words[1].rstrip("s") if words[1].startswith("error") else words[1]
            counts[key if key in counts else words[1]] = int(words[0])
    print(f"tests (pytest -m cuda): {summary}", flush=True)
    return {**counts, "summary": summary, "exit_code": r.returncode,
            "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))][:20]}


def fwd_bwd(fn, autocast):
    """One forward (under autocast) and backward of fn's output."""
    def step():
        with autocast:
            out = fn()
        out.float().sum().backward()
    return step


def timed(step, timer, runs):
    """(median ms of `runs` steps, peak GB since the first of them)."""
    timer.reset()
    return statistics.median(timer.time(step) for _ in range(runs)) * 1e3, timer.peak_gb()


def attention_inputs(shape, T, device):
    H, D = PRESETS[shape["model"]]["n_head"], PRESETS[shape["model"]]["head_dim"]
    d_model, B = PRESETS[shape["model"]]["d_model"], shape["attn_batch"]
    q, k, v = (torch.randn(B, H, T, D, device=device, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(B, T, d_model, device=device)


def attention_module(name, flags, shape, device):
    cfg = config(name, flags, shape, shape.get("kernel", "fused"))
    module = VARIANTS[cfg.attn](cfg).to(device)
    for p in module.parameters():
        p.data.normal_(0, 0.1)
    return module


def top_kernels(step, device, n=TOP_KERNELS):
    """The n kernels of most device time in one step (torch.profiler; on a CPU, the ops of most
    self CPU time), and how many kernels (ops) ran in all."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    if cuda:  # kernel events only (an aten op's device time repeats its kernels')
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        ms = [e.self_device_time_total / 1e3 for e in events]
    else:
        events = list(prof.key_averages())
        ms = [e.self_cpu_time_total / 1e3 for e in events]
    order = sorted(range(len(events)), key=lambda i: -ms[i])
    top = [dict(name=events[i].key[:100], ms=ms[i], calls=events[i].count) for i in order[:n]]
    return top, sum(e.count for e in events), sum(ms)


def first_step(module, inputs, autocast, timer, backend):
    """(step, its first run's seconds, compiles included, the path it took): the attention
    core's forward + backward through torch.compile(module.attend, backend=backend), as a
    block of train.py's compiled model runs it (its selection and merges fused around the
    kernels, no Python launch per op), or eagerly where backend is None or the compile fails
    (the path says why)."""
    q, k, v, x = inputs
    eager = fwd_bwd(lambda: module.attend(q, k, v, x, 0, 0), autocast)
    if backend is None:
        return eager, timer.time(eager), "eager"
    attend = torch.compile(module.attend, backend=backend)
    step = fwd_bwd(lambda: attend(q, k, v, x, 0, 0), autocast)
    try:
        return step, timer.time(step), "compiled"
    except Exception as e:  # noqa: BLE001 - the row says so and times the eager path
        while getattr(e, "inner_exception", None) or e.__cause__:  # dynamo's BackendCompilerFailed wraps
            e = getattr(e, "inner_exception", None) or e.__cause__  # the compiler's own error
        torch._dynamo.reset()
        return eager, timer.time(eager), f"eager: the compile failed ({first_line(e)})"


def profile_rows(shape, device, dtype, deadline, result, save, backend=None):
    """--profile: per variant, at each length (shortest first), the attention core's first step
    (compile s), its time over SDPA causal's, and at the first length its top kernels; the core
    compiled by `backend` (main: inductor on CUDA) or eager (None). A row is skipped when the
    time left before `deadline` is under twice what its first step is expected to take (its
    previous length's first step and runs, scaled by T^2)."""
    timer, runs = Timer(device), 3 if shape["model"] == "tiny" else 10
    autocast = torch.autocast(device.split(":")[0], dtype=dtype) if dtype != torch.float32 else nullcontext()
    rows = result.setdefault("profile", [])
    first_T = shape["lengths"][0]
    for T in shape["lengths"]:
        q, k, v, x = attention_inputs(shape, T, device)
        sdpa = fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), autocast)
        sdpa()
        sdpa_ms, _ = timed(sdpa, timer, runs)
        for name, flags in PROFILE_CONFIGS:
            row = dict(config=name, T=T, B=shape["attn_batch"], sdpa_ms=sdpa_ms)
            before = next((r for r in rows if r["config"] == name and "ms" in r), None)
            need = 30.0 if before is None else \
                2 * (before["compile_s"] + runs * before["ms"] / 1e3 * (T / before["T"]) ** 2)
            left = deadline - time.time()
            if left < need:
                row["skipped"] = shown = f"skipped: {left:.0f} s left of the budget, needs ~{need:.0f} s"
            else:
                try:
                    if device.startswith("cuda"):  # each variant compiles its own kernels: an honest compile time
                        torch._dynamo.reset()  # (on a CPU only asga's gate tile compiles, the same for every row)
                    module = attention_module(name, flags, shape, device)
                    step, row["compile_s"], row["path"] = first_step(module, (q, k, v, x), autocast, timer, backend)
                    if T == first_T:
                        row["top"], row["kernels"], row["kernel_ms"] = top_kernels(step, device)
                    row["ms"], row["gb"] = timed(step, timer, runs)
                    row["x_sdpa"] = row["ms"] / sdpa_ms
                    shown = (f"{row['ms']:9.2f} ms  {row['x_sdpa']:6.2f}x sdpa  first step {row['compile_s']:.1f} s  "
                             f"{row['path']}")
                    if "kernels" in row:
                        shown += f"  {row['kernels']} kernels"
                except Exception as e:  # noqa: BLE001 - kept in the row
                    row["error"] = shown = first_line(e)
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()
            rows.append(row)
            save()
            print(f"profile   {name:14s} T={T:5d} {shown}", flush=True)
            for top in row.get("top", [])[:TOP_KERNELS]:
                print(f"          {top['ms']:9.3f} ms {top['calls']:5d}x  {top['name']}", flush=True)
    return rows


def attention_rows(shape, device, dtype):
    """Each configuration's attention core against SDPA causal (flash on CUDA), fwd + bwd."""
    timer, rows, runs = Timer(device), [], 3 if shape["model"] == "tiny" else 10
    B = shape["attn_batch"]
    autocast = torch.autocast(device.split(":")[0], dtype=dtype) if dtype != torch.float32 else nullcontext()
    for T in shape["lengths"]:
        q, k, v, x = attention_inputs(shape, T, device)

        def measure(fn):
            step = fwd_bwd(fn, autocast)
            step()  # compile, warm up
            return timed(step, timer, runs)

        sdpa_ms, sdpa_gb = measure(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        for name, flags in CONFIGS:
            row = dict(config=name, T=T, B=B, sdpa_ms=sdpa_ms, sdpa_gb=sdpa_gb)
            try:
                module = attention_module(name, flags, shape, device)
                row["ms"], row["gb"] = measure(lambda: module.attend(q, k, v, x, 0, 0))
                row["x_sdpa"] = row["ms"] / sdpa_ms
                shown = f"{row['ms']:9.2f} ms  {row['x_sdpa']:6.2f}x sdpa"
            except Exception as e:  # noqa: BLE001 - kept in the row: the point is to report it
                row["error"] = shown = first_line(e)
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
            rows.append(row)
            print(f"attention {name:14s} T={T:5d} {shown}", flush=True)
    return rows


def training_rows(shape, device, dtype, compile_model, configs=None, deadline=None, need_s=120, rows=None,
                  save=lambda: None):
    """Steps of each configuration: tokens/s (median after the first step), MFU, peak memory.
    With a deadline, a configuration starts only with need_s seconds left before it. Rows go
    into `rows` (a new list by default), save() after each."""
    timer, rows = Timer(device), [] if rows is None else rows
    T, B, steps = shape["T"], shape["batch"], shape["steps"]
    autocast = torch.autocast(device.split(":")[0], dtype=dtype) if dtype != torch.float32 else nullcontext()
    run = dict(device=device, dtype="bfloat16" if dtype == torch.bfloat16 else "float32", autocast=autocast,
               ddp=False, master=True)
    tc = TrainConfig()
    for name, flags in configs or CONFIGS:
        row = dict(config=name, T=T, batch=B, steps=steps)
        if deadline is not None and deadline - time.time() < need_s:
            row["error"] = shown = f"skipped: {deadline - time.time():.0f} s left of the budget, needs ~{need_s:.0f} s"
            rows.append(row)
            save()
            print(f"training  {name:14s} T={T:5d} {shown}", flush=True)
            continue
        try:
            shown = train_one(name, flags, shape, device, run, tc, autocast, compile_model, timer, row)
        except SystemExit as e:  # config.fail inside the preflight: its line is on stderr
            row["error"] = shown = f"stopped by the preflight (exit {e.code})"
        except Exception as e:  # noqa: BLE001 - kept in the row
            row["error"] = shown = first_line(e)
        # The failed configuration's model and optimizer lived in train_one's frame, which the
        # exception held: free them before the next one (an out-of-memory error left 77 GiB
        # allocated on an H100, and every configuration after it failed).
        if compile_model:
            torch._dynamo.reset()
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        rows.append(row)
        save()
        print(f"training  {name:14s} T={T:5d} {shown}", flush=True)
    return rows


def train_one(name, flags, shape, device, run, tc, autocast, compile_model, timer, row):
    """One configuration's training steps, its numbers written into row; the line to print.
    Its model and optimizer live only in this frame."""
    T, B, steps = shape["T"], shape["batch"], shape["steps"]
    torch.manual_seed(0)
    mc = config(name, flags, shape)
    model = Model(mc).to(device)
    row["flops_per_token"] = flops.flops_per_token(model, T)
    tokens = torch.randint(0, mc.vocab_size, (B, T + 1), device=device)
    row["kernel"] = preflight(model, tokens[:2], mc, run, typed=set())
    optimizer = train.make_optimizer(model, tc)
    if compile_model:
        torch._dynamo.reset()  # a fresh compile per configuration (and no recompile limit reached)
    step_model = compile_blocks(model) if compile_model else model  # as train.py compiles

    def step():
        with autocast:
            _, loss = step_model(tokens[:, :-1], tokens[:, 1:])
            kl = model.indexer_loss()
        (loss if kl is None else loss + kl).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    row["first_step_s"] = timer.time(step)  # compiles included: when training is ready
    timer.reset()
    times = [timer.time(step) for _ in range(steps)]
    row["tok_s"] = B * T / statistics.median(times)
    row["peak_gb"] = timer.peak_gb()
    row["flop_s"] = row["flops_per_token"] * row["tok_s"]
    cuda = device.startswith("cuda")
    row["mfu"] = flops.mfu(row["flop_s"], torch.cuda.get_device_name(device)) if cuda else None
    use = f"mfu {100 * row['mfu']:5.1f}%" if row["mfu"] is not None else f"{row['flop_s'] / 1e12:.3g} TFLOP/s"
    return (f"{row['tok_s'] / 1e3:8.1f}k tok/s  {use}  kernel={row['kernel']}  "
            f"first step {row['first_step_s']:.1f} s")


def environment(device):
    import torch._inductor.config as inductor_config  # compile_threads: how many kernels compile at once
    env = dict(torch=torch.__version__, python=sys.version.split()[0], device=device,
               compile_threads=inductor_config.compile_threads, cpus=os.cpu_count())
    if device.startswith("cuda"):
        env.update(device_name=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   gpus=torch.cuda.device_count())
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                           text=True).stdout.strip() or None
    except OSError:
        env["git_commit"] = None
    return env


def markdown(result):
    env, lines = result["environment"], []
    lines.append(f"### gpu_check: {env.get('device_name', env['device'])}, torch {env['torch']}"
                 f"{', CUDA ' + env['cuda'] if env.get('cuda') else ''}, commit {env.get('git_commit')}, "
                 f"shape {result['shape']}")
    if "tests" in result:
        lines.append(f"\ntests (pytest -m cuda): {result['tests']['summary']}")
        lines += [f"- {f}" for f in result["tests"]["failures"]]
    if "attention" in result:
        lengths = sorted({r["T"] for r in result["attention"]})
        lines.append("\nattention core, forward + backward: ms (x SDPA causal)\n")
        lines.append("| config | " + " | ".join(f"T={T}" for T in lengths) + " |")
        lines.append("|---" * (len(lengths) + 1) + "|")
        by = {(r["config"], r["T"]): r for r in result["attention"]}
        for name, _ in CONFIGS:
            cells = []
            for T in lengths:
                r = by.get((name, T))
                cells.append("-" if r is None else r.get("error", f"{r['ms']:.2f} ({r['x_sdpa']:.2f}x)")[:60])
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("| SDPA causal | " + " | ".join(f"{by[(CONFIGS[0][0], T)]['sdpa_ms']:.2f}" for T in lengths) + " |")
    if "profile" in result:
        rows = result["profile"]
        lengths = sorted({r["T"] for r in rows})
        lines.append(f"\nattention core, forward + backward, B = {rows[0]['B']}: ms (x SDPA causal), first step s "
                     "(compiles included); the core through torch.compile unless a cell says eager\n" if rows else "")
        lines.append("| config | " + " | ".join(f"T={T} | first step s" for T in lengths) + " |")
        lines.append("|---" * (2 * len(lengths) + 1) + "|")
        by = {(r["config"], r["T"]): r for r in rows}
        for name in dict.fromkeys(r["config"] for r in rows):
            cells = []
            for T in lengths:
                r = by.get((name, T), {})
                if "ms" in r:
                    path = "" if r.get("path") == "compiled" else f", {r.get('path', 'eager')[:70]}"
                    cells += [f"{r['ms']:.2f} ({r['x_sdpa']:.2f}x){path}", f"{r['compile_s']:.1f}"]
                else:
                    cells += [(r.get("error") or r.get("skipped") or "-")[:70], ""]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("| SDPA causal | " + " | ".join(f"{next(r['sdpa_ms'] for r in rows if r['T'] == T):.2f} | "
                                                   for T in lengths) + " |")
        for r in rows:
            if r.get("top"):
                lines.append(f"\n{r['config']}, T = {r['T']}: {r['kernels']} kernels, {r['kernel_ms']:.2f} ms in all; "
                             f"the top {len(r['top'])}:\n")
                lines += [f"    {t['ms']:9.3f} ms {t['calls']:5d}x  {t['name']}" for t in r["top"]]
    if "training" in result:
        lines.append("\ntraining steps\n")
        lines.append("| config | T x batch | kernel | tok/s | MFU | TFLOP/s | peak GB | first step s (compiles) |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in result["training"]:
            shape = f"{r['T']} x {r['batch']}"
            if "error" in r:
                lines.append(f"| {r['config']} | {shape} | - | {r['error'][:80]} | | | | |")
                continue
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
            gb = f"{r['peak_gb']:.1f}" if r.get("peak_gb") is not None else "-"
            lines.append(f"| {r['config']} | {shape} | {r['kernel']} | {r['tok_s']:,.0f} | {mfu} | {r['flop_s'] / 1e12:.3g} | {gb} "
                         f"| {r['first_step_s']:.1f} |")
    return "\n".join(lines) + "\n"


def kernels_compiled():
    """Kernel binaries in Triton's and inductor's caches now (cubins, shared objects), or None:
    between two stack prints, whether a long compile is many kernels in turn (the count rises)
    or one that does not finish (it stays)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        dirs = [os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache"),
                cache_dir()]
        return sum(f.endswith((".cubin", ".so")) for d in dirs for _, _, files in os.walk(d) for f in files)
    except Exception:  # noqa: BLE001 - a diagnostic: never the reason a run stops
        return None


def print_stacks_every(seconds):
    """A thread that prints the main thread's Python stack to stderr every `seconds` (under
    the GIL, from sys._current_frames: faulthandler's watchdog crashed a run that was
    importing). Returns the function that stops it and waits for it: a daemon thread still
    alive when the interpreter shuts down can abort the process ("terminate called without an
    active exception"), after a run that had written everything."""
    main_id, t0, stop = threading.main_thread().ident, time.time(), threading.Event()

    def watch():
        while not stop.wait(seconds):
            frame = sys._current_frames().get(main_id)
            if frame is not None:
                print(f"--- gpu_check at {time.time() - t0:.0f} s, {kernels_compiled()} kernels compiled so far "
                      f"(Triton's and inductor's caches), the main thread:\n"
                      + "".join(traceback.format_stack(frame)), file=sys.stderr, flush=True)

    thread = threading.Thread(target=watch, name="gpu_check stacks", daemon=True)
    thread.start()

    def stop_and_join():
        stop.set()
        thread.join()

    return stop_and_join


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny shape (the default without CUDA)")
    parser.add_argument("--out", default="gpu_check.json", help="the JSON; the Markdown table goes beside it (.md)")
    parser.add_argument("--skip", default="", help="comma-separated steps to skip: tests, attention, training")
    parser.add_argument("--only", help="comma-separated configurations (default: all of CONFIGS)")
    parser.add_argument("--lengths", help="comma-separated sequence lengths for the attention step "
                        "(default: the shape's, 1024..8192 on a GPU)")
    parser.add_argument("--steps", type=int, help="timed training steps per configuration (default: the shape's)")
    parser.add_argument("--stacks_every", type=float, help="print every thread's Python stack to stderr every this many "
                        "seconds (faulthandler): where a step that runs past its timeout spends its time (compiling "
                        "which graph, or running)")
    parser.add_argument("--train_T", type=int, help="the training step's sequence length (default: the shape's, "
                        "1024 on a GPU); the batch shrinks to keep the tokens of a step (16 x 1024 on a GPU)")
    parser.add_argument("--profile", action="store_true", help="where the time goes, instead of the three steps: "
                        "compile s, top kernels and time over SDPA per variant at T = 4096 and 16384, then training")
    parser.add_argument("--dry_run", action="store_true", help="--profile at the tiny shape (any device, seconds)")
    parser.add_argument("--budget_s", type=float, help="--profile's time budget in seconds (default 480 on a GPU)")
    parser.add_argument("--row_s", type=float, default=120, help="--profile: a training row starts only with this "
                        "many seconds of the budget left (its compile and steps; a row cut short by a timeout "
                        "loses only itself: rows are saved as they finish)")
    args = parser.parse_args(argv)
    if args.stacks_every:
        atexit.register(print_stacks_every(args.stacks_every))  # stopped before the interpreter shuts down
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        tf32_matmuls()  # as train.py runs
    tiny = args.tiny or args.dry_run or device == "cpu"
    profiling = args.profile or args.dry_run
    shape = dict((PROFILE_TINY if tiny else PROFILE) if profiling else (TINY if tiny else GPU))
    if args.lengths:
        shape["lengths"] = tuple(int(t) for t in args.lengths.split(","))
    if args.steps:
        shape["steps"] = args.steps
    if args.train_T:
        shape["batch"] = max(1, shape["batch"] * shape["T"] // args.train_T)
        shape["T"] = args.train_T
    global CONFIGS, PROFILE_CONFIGS
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - {n for n, _ in CONFIGS}
        if unknown:
            sys.exit(f"error: unknown --only {', '.join(sorted(unknown))}; valid: {', '.join(n for n, _ in CONFIGS)}")
        CONFIGS = [c for c in CONFIGS if c[0] in wanted]
        PROFILE_CONFIGS = profile_order([c for c in CONFIGS if c[0] in wanted])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    skip = set(filter(None, args.skip.split(",")))
    result = dict(environment=environment(device), shape="tiny" if tiny else "qwen-134m", dtype=str(dtype),
                  mode="profile" if profiling else "check")
    print(f"gpu_check on {result['environment'].get('device_name', device)}, shape {result['shape']}, {dtype}",
          flush=True)
    t0 = time.time()
    md = os.path.splitext(args.out)[0] + ".md"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save():  # after each step, so a run cut short (a node's time limit) keeps what it measured
        result["seconds"] = time.time() - t0
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        with open(md, "w") as f:
            f.write(markdown(result))

    if profiling:
        deadline = t0 + (shape["budget_s"] if args.budget_s is None else args.budget_s)
        if "attention" not in skip:
            profile_rows(shape, device, dtype, deadline, result, save, backend="inductor" if device == "cuda" else None)
        if "training" not in skip:
            training_rows(shape, device, dtype, compile_model=device == "cuda", configs=PROFILE_CONFIGS,
                          deadline=deadline, need_s=args.row_s, rows=result.setdefault("training", []), save=save)
        skip |= {"tests", "attention", "training"}
    if "tests" not in skip:
        result["tests"] = run_tests(device)
        save()
    if "attention" not in skip:
        result["attention"] = attention_rows(shape, device, dtype)
        save()
    if "training" not in skip:
        result["training"] = training_rows(shape, device, dtype, compile_model=device == "cuda")
    save()
    print("\n" + markdown(result))
    print(f"wrote {args.out} and {md} ({result['seconds']:.0f} s); paste the .md into an issue", flush=True)
    failed = [r["config"] for r in result.get("training", []) + result.get("attention", []) + result.get("profile", [])
              if "error" in r and not r["error"].startswith("skipped")]
    return 1 if failed or result.get("tests", {}).get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
