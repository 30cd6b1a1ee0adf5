"""Long-context inference, every variant beside `full` in one process: the prefill of T tokens
through a KV cache, then the median time of a one-token decoding step after it, at batch 1
and at a larger batch (the cache filled at batch 1, then repeated along the batch), each
relative to `full` at the same T and batch; the KV cache's bytes per layer; and each step
against the time to read once what its definition reads (the memory bound).

    python benchmarks/decode.py                    # CPU: T = 2048, 8192, 32768; batch 1 and 8
    python benchmarks/decode.py --device=cuda      # bf16; batch 1 and 16
    python benchmarks/decode.py --lengths=2048 --variants=full,nsa --steps=5   # a quick look
    python benchmarks/decode.py --compile --lengths=8192   # the steps through model.compile_decoding
    python benchmarks/decode.py --variants=full,nsa --attention=nsa_cmp_block=32,nsa_cmp_stride=16,nsa_block=64,nsa_topk=16,nsa_window=512
                                                   # other attention settings (here NSA's paper's sizes) for every model

The model: qwen-134m's widths (12 heads of 64, no GQA, d_model 768, MLP 2432) cut to
--layers=2, random weights, kernel='fused' (its decoding steps run kernels.DECODE), float32
on a CPU (bf16 autocast on CUDA), the embedding and head at a 256-id vocabulary (--vocab), so
that what a step reads is the layers and their caches. One thread by default (--threads).
--attention sets attention.AttentionConfig fields for every model built (each variant's
defaults otherwise; the settings line and the JSON record them, so saved rows of other
settings are measured again).
On a CPU, THP_MEM_ALLOC_ENABLE=1 in the environment (PyTorch's CPU allocator then puts every
tensor of 2 MB or more on transparent huge pages) spares a long prefill's large temporaries
their 4 KB page faults; the settings record it when it is set (docs/performance.md). And on a
CPU the C allocator keeps the memory the process frees (`keep_freed_memory`; --malloc=system
leaves it as it is; the settings say which), as a GPU's caching allocator does: otherwise
each large temporary of a prefill is fresh memory faulted in again, untimed prefill or not.

What is printed, per variant and T:
- prefill: seconds for the T-token prompt (one run, after one untimed prefill of the same
  prompt: on CUDA it compiles the GPU path for that shape; on a CPU a compiled helper
  compiles at its first call, kernels.GatheredDots for the indexer's listed keys, ~10 s once
  a process, and the prefill's memory is touched once before it is timed), and that over
  `full`'s. Why the whole prompt on a CPU: on a VM whose guest hands freed memory back to
  its host (free page reporting: this project's CI machine, a Firecracker guest reporting
  free 8 MB chunks), a process's first touch of memory it has not held yet costs a fault
  in the host too, up to ~3 ms a MB. A first prefill of T paid it for every temporary: one
  layer of nsa at 16384, 8.1 s first, 6.0 and 6.1 s after, `full`'s 8.2-8.4 s each time,
  since a variant pays it by the memory it touches, not by the work it does. After an
  untimed prefill of 4096 tokens (what this did before), nsa's two layers at 32768 took
  0.62-0.64 of `full`'s.
- decode: the median ms of --steps one-token steps (after one untimed step, `measure`), its
  spread (min - max over the steps) and that over `full`'s median, at batch 1 and at
  --batch. `full`'s steps for that ratio are taken in turns with the row's own (--rounds
  rounds, `full` held prefilled beside each row): the machine's speed drifts by 30% between
  rows here, and the ratio is what the table is for. Each turn's first step is untimed
  (`turns`): it pays for the other model's reads, as no step of a decoding loop does.
  Between rows `full` keeps its batch-1 cache only; its --batch cache is repeated from it
  for the row's batch turns and dropped after (`batch_beside`), so a row's prefill runs
  beside `full`'s model and one cache (0.4 GB at 32768), not the 3.6 GB of both: `full`'s
  own prefill ran beside nothing, and with 3.6 GB held beside it (touched, one process
  each, this AMD host) nsa's two-layer prefill at 32768 took 36.1 and 36.9 s, without
  32.8 and 34.1.
- the settings line (and the JSON's settings): the machine (`host`: CPU model, cores,
  last-level cache, torch's CPU kernels; or the GPU), since the goals' floors move with it.
- cache: the KV cache's bytes per layer after the prefill at batch 1 (model.KVCache.nbytes:
  keys, values, summaries, and the inputs of the windows not yet summarised), and in
  brackets the bytes of the buffers they lie in (`allocated`: with the rows kept for the
  steps to come; the cache made as sample.generate makes it, for the prompt and the steps).
- read: what a step's definition reads per layer at batch 1 (`definition_reads`, MB), and x
  bound: the batch-1 step over the time to read once the model's weights and every layer's
  definition reads, at the read bandwidth measured right after that row's steps (the faster
  of a sum and a matrix-vector product over a tensor of that size, at least 256 MB,
  `read_bandwidth`: the machine's bandwidth moves between runs, by 30% here).
  Above the table, what no variant's step avoids: the weights' products alone, one token
  at batch 1 and at --batch (`weight_products`), the first over the time to read the
  weights once, and both over `full`'s step at each T: a floor under every variant's ratio
  to `full` on this machine (every step runs the same products).
- ops a step: the aten ops one eager one-token step at batch 1 dispatches, views left out
  (counted in an untimed step after the first; the eager step's even under --compile): on
  a GPU each launches a kernel or a few, and an eager step there costs its launches
  (benchmarks/gpu_runs/h200_2026-11-28b.md: `full`'s 2-layer step 2.4-2.7 ms at any cache).

--compile: each model's one-token steps through `model.compile_decoding` (torch.compile,
dynamic shapes; caa stays eager, said in its row), and untimed warm-up steps at each batch
before the timed ones (`warm_steps`), which take the step's graphs; `full` beside compiled
alike. Its rows go to decode_<device>_compiled.json.

A variant whose prefill would take longer than --budget seconds, extrapolated from its time
at the last length as T^2 (asga's pair gate and caa's ranking score every (query, key) pair),
is skipped at the longer lengths, and the table says so. Rows are saved to --out as they are
measured; a rerun keeps the rows already there for the same settings (--fresh: measure all).
"""
import argparse
import copy
import ctypes
import glob
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention import AttentionConfig  # noqa: E402
from config import convert, tf32_matmuls  # noqa: E402
from model import PRESETS, Model, ModelConfig, compile_decoding  # noqa: E402

ORDER = ("full", "local", "dsa", "combiner", "nsa", "moba", "indexer", "caa", "asga")
MB = 1e6
THP = "THP_MEM_ALLOC_ENABLE"  # read by torch's allocator at its first allocation: set it before python starts
BANDWIDTH_BYTES = 1 << 28  # read_bandwidth reads at least this much: past any CPU's caches


def model_config(attn, layers, vocab, attention=None):
    """The benchmark's ModelConfig: qwen-134m's widths, `layers` layers, the variant's fused
    kernels, and --attention's settings over its defaults."""
    return ModelConfig(**dict(PRESETS["qwen-134m"], n_layer=layers, vocab_size=vocab, attn=attn, kernel="fused",
                              **(attention or {})))


def build(attn, layers, vocab, device, seed=0, attention=None):
    cfg = model_config(attn, layers, vocab, attention)
    torch.manual_seed(seed)
    return Model(cfg).to(device).eval()


def definition_reads(module, S, elem):
    """Bytes of the KV cache (and its summaries) that one decoding step's definition reads in
    one layer at batch 1, the query at position S - 1 after S - 1 cached keys: the keys and
    values it attends to, and the keys or summaries its selection scores."""
    cfg = module.cfg
    Hkv, H, D = cfg.n_kv_head, cfg.n_head, cfg.head_dim
    kv = 2 * Hkv * D  # one position's key and value
    name = cfg.attn
    if name == "local" or (name == "asga" and cfg.asga_gate == "fixed"):
        return elem * kv * min(S, cfg.window + 1)
    if name == "dsa":
        windowed = cfg.dsa_window == "fixed" or (cfg.dsa_window == "adaptive" and S - 1 >= cfg.dsa_threshold)
        return elem * kv * (min(S, cfg.window + 1) if windowed else S)
    if name == "combiner":  # its own block's keys, one summary (kbar per key head, vbar per query head) per block
        s = cfg.window
        return elem * (kv * ((S - 1) % s + 1) + (Hkv + H) * D * ((S - 1) // s))
    if name == "nsa":
        C = max(0, (S - cfg.nsa_cmp_block) // cfg.nsa_cmp_stride + 1)
        return elem * kv * (C + min(S, cfg.nsa_topk * cfg.nsa_block) + min(S, cfg.nsa_window + 1))
    if name == "moba":
        return elem * (Hkv * D * (S // cfg.moba_block) + kv * min(S, cfg.moba_topk * cfg.moba_block))
    if name == "indexer":  # every indexer key (eq. 1 scores them all), then k keys and values
        return elem * (cfg.index_head_dim * S + kv * min(S, module.topk))
    if name == "caa":  # every key to rank them; the values of the local window and the top k
        return elem * (Hkv * D * S + Hkv * D * (min(S, cfg.caa_window_max + 1) + math.isqrt(S - 1) + 1))
    return elem * kv * S  # full, asga (its gate reads every key)


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4


def keep_freed_memory():
    """Make this process's C allocator keep the memory it frees, for the next allocation, where
    it is glibc's: no large block from its own mmap (M_MMAP_MAX 0), and the heap's free top
    handed back to the system only past 2 GB (M_TRIM_THRESHOLD). Returns whether it could.
    Why: PyTorch's CPU allocator caches nothing, and glibc serves every block over 32 MB (less,
    by default) from an mmap of its own, unmapped when freed, so each large temporary of a
    prefill is fresh memory, faulted in page by page at its first touch, every time: the
    untimed prefill before the timed one touched memory the timed one did not get back. On a
    VM those faults cost the host too (this project's CI machine: up to ~3 ms a MB). One layer
    of nsa at T = 32768 (qwen-134m widths, Intel Xeon host), the second of two prefills in a
    process: 12.4 s, its selected branch 2.97 s; kept, 10.5 s and 1.92 s; `full`'s 19.0 s and
    17.7 s. A variant paid by the temporaries it makes, not by its work: a GPU's caching
    allocator, and the jemalloc or tcmalloc that PyTorch's CPU tuning guide preloads, reuse
    them too. `--malloc=system` leaves glibc as it is."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without it): as it is
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))


def host(device):
    """The machine a run measured, in words: the CPU's model, its cores, its last-level cache
    and the vector kernels torch dispatches to (or the GPU's name). The goals' floors move
    with it (a 32 MiB L3 holds none of the model's 64 MB of weights between steps, a 260 MiB
    one all of them: local's batch-8 ratio 0.28 on one, 0.19 on the other), so every record
    says which, and a rerun resumes only rows from the same machine."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    cache = ""
    for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"), reverse=True):
        try:
            with open(os.path.join(index, "level")) as f, open(os.path.join(index, "size")) as g:
                cache = f", L{f.read().strip()} {g.read().strip()}"
            break
        except OSError:
            continue
    return f"{model}, {os.cpu_count()} cores{cache}, torch CPU kernels {torch.backends.cpu.get_cpu_capability()}"


def read_bandwidth(nbytes, device, repeats=5):
    """Bytes per second of the faster of two reads of a float32 tensor of nbytes (median of
    `repeats` each): a sum over it, and a matrix-vector product over it as rows of 1024, the
    kind of read a step makes of its weights and keys. On one host the sum read 10.8 GB/s and
    the product 19.0; with the sum alone `full`'s step read 0.61x its bound
    (benchmarks/decode_cpu.md)."""
    x = torch.ones(max(1024, int(nbytes) // 4 // 1024 * 1024), device=device)
    rows, vector = x.view(-1, 1024), torch.ones(1024, device=device)
    best = 0.0
    for read in (x.sum, lambda: rows @ vector):
        times = []
        for _ in range(repeats):
            t0 = clock(device)
            read()
            times.append(clock(device) - t0)
        best = max(best, x.numel() * 4 / statistics.median(times))
    return best


def weight_products(layers, vocab, device, batch, repeats=5, attention=None):
    """Milliseconds of one token's products with every weight matrix of the model (each
    nn.Linear of `full`, in model order, at `batch` rows; median of `repeats` passes): what
    every variant's step does besides attention, and, at batch 1, a matrix-vector product
    per matrix, read from memory each pass (the matrices together outsize the caches)."""
    model = build("full", layers, vocab, device, attention=attention)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = [torch.randn(batch, m.in_features, device=device) for m in linears]
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            t0 = clock(device)
            for m, x in zip(linears, xs):
                m(x)
            times.append(clock(device) - t0)
    return 1e3 * statistics.median(times[1:])


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched, views left out: what an eager step computes op by op.
    On a GPU each launches a kernel (or a few), and an eager step is launch-bound there."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def step_ops(model, cache, device):
    """The aten ops (views left out) of one eager one-token step at the cache's batch."""
    token = torch.zeros((cache[0].k.view().shape[0], 1), dtype=torch.long, device=device)
    with OpCounter() as counter:
        model(token, cache=cache)
    return counter.ops


def clock(device):
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def decode_steps(step, cache, batch, steps, device, start_token=0):
    """Seconds of each of `steps` one-token steps at this batch (`step`: the model, or its
    compiled step)."""
    times = []
    token = torch.full((batch, 1), start_token, dtype=torch.long, device=device)
    for _ in range(steps):
        t0 = clock(device)
        logits, _ = step(token, cache=cache)
        times.append(clock(device) - t0)
        token = logits[:, -1:].argmax(-1)
    return times


def warm_steps(model):
    """Untimed steps before a compiled step is timed: enough for a summary window to complete
    (its own graph, `compile_decoding`)."""
    return 1 + max((layer.self_attn.summary_window() or (1, 1))[1] for layer in model.layers)


def turns(step, cache, beside, batch, args):
    """(this model's step seconds, `beside`'s) at this batch: --steps steps each, taken in turns
    over --rounds rounds when `beside` (full's step and cache at this batch) is given, so that
    a drift of the machine's speed between rows (30% here) falls on both alike. Each turn
    starts with one untimed step: the first step after the other model's runs on data its
    reads evicted from the CPU's caches, which no decoding loop's steps, one after another,
    are (one process, 2 layers at T = 8192, batch 1, the indexer's turns of 4 steps beside
    full's: 6.72 ms for a turn's first step, 5.71, 5.68, 5.51 for the next; nsa's 6.40 then
    5.80-5.60; full's own 7.98 then 7.98-7.79, local's 3.38 then 3.30-3.37)."""
    rounds = max(1, min(args.rounds, args.steps)) if beside else 1
    mine, theirs = [], []
    for i in range(rounds):
        n = args.steps // rounds + (i < args.steps % rounds)
        if beside:
            decode_steps(step, cache, batch, 1, args.device)
        mine += decode_steps(step, cache, batch, n, args.device)
        if beside:
            decode_steps(*beside, batch, 1, args.device)
            theirs += decode_steps(*beside, batch, n, args.device)
    return mine, theirs


def measure(attn, T, args, autocast, beside=None, keep=False):
    """One row: prefill and decoding of `attn` at T. With `beside` (`full`'s step and batch-1
    cache at T), full's steps are taken in turns with this row's (`turns`; at --batch on a
    cache repeated from that one, `batch_beside`) and kept in the row (full_decode_ms,
    full_decode_batch_ms): its decoding ratios divide by those. keep: also return this
    model's step and its batch-1 cache after its batch-1 steps (full's, for `beside`)."""
    model = build(attn, args.layers, args.vocab, args.device, attention=args.attention)
    idx = torch.randint(0, args.vocab, (1, T), generator=torch.Generator().manual_seed(1)).to(args.device)
    step, how = compile_decoding(model) if args.compile else (model, "eager")
    # untimed steps before the timed ones, at each batch: compiled, those that take the step's
    # graphs; eager, one, in which a compiled helper (kernels.GatheredDots, GateTile) compiles
    # at its first call (seconds, once a process: a row's spread showed it, or not, by which
    # variants had run before it)
    warm = warm_steps(model) if args.compile else 1
    # the cache made for the prompt and every step, as sample.generate makes it: allocated once at
    # that size, it never grows (compiled, a growth would be a graph of its own)
    capacity = T + 2 * (warm + args.steps + args.rounds) + 2  # + each turn's untimed step
    with torch.no_grad(), autocast:
        model(idx, cache=model.new_cache())  # untimed: compiles, and touches the prefill's memory (above)
        cache = model.new_cache(capacity)
        t0 = clock(args.device)
        model(idx, cache=cache)
        prefill = clock(args.device) - t0
        nbytes, allocated = cache[0].nbytes(), cache[0].allocated()
        decode_steps(step, cache, 1, warm, args.device)
        ops = step_ops(model, cache, args.device)  # eager, untimed: a step's ops (launches, on a GPU)
        one, full_one = turns(step, cache, beside, 1, args)
        kept = copy.deepcopy(cache) if keep else None
        for layer in cache:
            layer.repeat_batch(args.batch)
        decode_steps(step, cache, args.batch, warm, args.device)
        many, full_many = turns(step, cache, beside and batch_beside(beside, args.batch), args.batch, args)
    elem = 2 if args.device == "cuda" else 4
    reads = definition_reads(model.layers[0].self_attn, T + args.steps, elem)
    weights = sum(p.numel() * elem for p in model.parameters())
    row = dict(variant=attn, T=T, prefill_s=prefill, cache_bytes_per_layer=nbytes,
               cache_allocated_bytes_per_layer=allocated, step=how,
               decode_ms=[1e3 * t for t in one], decode_batch_ms=[1e3 * t for t in many],
               reads_per_layer=reads, weight_bytes=weights, ops_per_step=ops,
               read_bandwidth=read_bandwidth(max(weights + args.layers * reads, BANDWIDTH_BYTES), args.device))
    if beside:
        row.update(full_decode_ms=[1e3 * t for t in full_one], full_decode_batch_ms=[1e3 * t for t in full_many])
    if keep:
        return row, (step, kept)
    del cache, model
    return row


def batch_beside(beside, batch):
    """`full`'s step and a cache at `batch` repeated from its batch-1 cache (`beside`), made for
    one row's batch turns only: held between rows, it would sit beside each row's prefill."""
    step, cache = beside
    cache = copy.deepcopy(cache)
    for layer in cache:
        layer.repeat_batch(batch)
    return step, cache


def hold_full(T, args, autocast):
    """`full`'s step and batch-1 cache at T for `measure`'s beside, where its own row was kept
    from an earlier run."""
    return measure("full", T, args, autocast, keep=True)[1]


def spread(ms):
    return f"{min(ms):.1f}-{max(ms):.1f}"


def cache_mb(row):
    """The cache's MB a layer, held (allocated), for a row that has both."""
    held = f"{row['cache_bytes_per_layer'] / MB:.1f}"
    allocated = row.get("cache_allocated_bytes_per_layer")
    return held if allocated is None else f"{held} ({allocated / MB:.1f})"


def table(rows, args, bandwidth):
    """The Markdown table of `rows`, each relative to full's at the same T."""
    by = {(r["T"], r["variant"]): r for r in rows}
    out = [f"| variant | T | prefill s | x full | decode ms, batch 1 (spread) | x full | decode ms, batch "
           f"{args.batch} (spread) | x full | cache MB/layer (allocated) | reads MB/layer | x bound | ops a step (eager) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for T in args.lengths:
        base = by.get((T, "full"))
        for name in args.variants:
            r = by.get((T, name))
            if r is None:
                continue
            if "skipped" in r:
                out.append(f"| {name} | {T} | skipped: {r['skipped']} |" + " |" * 9)
                continue
            one, many = statistics.median(r["decode_ms"]), statistics.median(r["decode_batch_ms"])
            bound_ms = 1e3 * (r["weight_bytes"] + args.layers * r["reads_per_layer"]) / r.get("read_bandwidth", bandwidth)

            def rel(value, key, fn=statistics.median):
                if "full_" + key in r:  # full's steps taken in turns with this row's
                    return f"{value / fn(r['full_' + key]):.2f}"
                return f"{value / fn(base[key]):.2f}" if base else "-"
            out.append(f"| {name} | {T} | {r['prefill_s']:.3g} | {rel(r['prefill_s'], 'prefill_s', lambda x: x)} "
                       f"| {one:.1f} ({spread(r['decode_ms'])}) | {rel(one, 'decode_ms')} "
                       f"| {many:.1f} ({spread(r['decode_batch_ms'])}) | {rel(many, 'decode_batch_ms')} "
                       f"| {cache_mb(r)} | {r['reads_per_layer'] / MB:.2f} "
                       f"| {one / bound_ms:.2f} | {r.get('ops_per_step', '-')} |")
    return "\n".join(out)


# AttentionConfig's fields --attention may set, with their defaults: decode.py picks the variant and its kernel
ATTENTION_KEYS = {f: getattr(AttentionConfig, f) for f in AttentionConfig.__dataclass_fields__ if f not in ("attn", "kernel")}


def attention_settings(text, variants, layers, vocab):
    """--attention's "key=value,..." -> {field: value typed as its default}, checked against
    every variant asked for (its check_config's error, naming the variant, before any row)."""
    settings = {}
    for item in filter(None, text.split(",")):
        key, eq, raw = item.partition("=")
        if key not in ATTENTION_KEYS or not eq:
            sys.exit(f"decode.py: --attention: {item!r} is not key=value of an attention setting; valid keys: "
                     f"{', '.join(ATTENTION_KEYS)}")
        settings[key] = convert(key, raw, ATTENTION_KEYS[key], AttentionConfig.CHOICES.get(key))
    for name in variants:
        try:
            model_config(name, layers, vocab, settings)
        except ValueError as e:
            sys.exit(f"decode.py: --attention={text}: {name}: {e}")
    return settings


def main(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--lengths", default=None, help="comma-separated T (default 2048,8192,32768)")
    p.add_argument("--variants", default=",".join(ORDER))
    p.add_argument("--batch", type=int, default=None, help="the larger batch (default 8 on cpu, 16 on cuda)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5, help="each row's steps and full's taken in turns, this many rounds")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--budget", type=float, default=900.0, help="seconds a prefill may take (extrapolated as T^2)")
    p.add_argument("--out", default=None, help="JSON rows (default benchmarks/decode_<device>.json)")
    p.add_argument("--fresh", action="store_true", help="measure every row again")
    p.add_argument("--compile", action="store_true",
                   help="decoding steps through model.compile_decoding (caches of fixed capacity; untimed warm-up "
                        "steps take its graphs)")
    p.add_argument("--attention", default="",
                   help="attention settings for every model, comma-separated key=value of AttentionConfig's fields "
                        "(e.g. NSA's paper's sizes: nsa_cmp_block=32,nsa_cmp_stride=16,nsa_block=64,nsa_topk=16,"
                        "nsa_window=512); each variant's defaults otherwise")
    p.add_argument("--malloc", default="kept", choices=("kept", "system"),
                   help="on a CPU, kept: the C allocator keeps freed memory for reuse (keep_freed_memory); "
                        "system: as it is")
    args = p.parse_args(argv)
    if args.device == "cuda" and not cuda:
        sys.exit("decode.py: --device=cuda but torch.cuda.is_available() is False")
    if args.device == "cuda":
        tf32_matmuls()  # as sample.py runs
    args.lengths = [int(t) for t in (args.lengths or "2048,8192,32768").split(",")]
    args.variants = [v for v in args.variants.split(",")]
    unknown = set(args.variants) - set(ORDER)
    if unknown:
        sys.exit(f"decode.py: unknown variants {sorted(unknown)}; valid: {', '.join(ORDER)}")
    args.batch = args.batch or (16 if args.device == "cuda" else 8)
    args.attention = attention_settings(args.attention, args.variants, args.layers, args.vocab)
    args.out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        f"decode_{args.device}{'_compiled' if args.compile else ''}.json")
    torch.set_num_threads(args.threads)
    malloc = "kept" if args.device == "cpu" and args.malloc == "kept" and keep_freed_memory() else "system"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.device == "cuda")
    settings = dict(device=args.device, batch=args.batch, steps=args.steps, rounds=args.rounds, layers=args.layers, vocab=args.vocab,
                    threads=args.threads, torch=torch.__version__, host=host(args.device),
                    **({"compile": True} if args.compile else {}), **({"malloc": malloc} if args.device == "cpu" else {}),
                    **({"attention": args.attention} if args.attention else {}),
                    **({"thp_mem_alloc": os.environ[THP]} if THP in os.environ else {}))
    saved = {}
    if os.path.exists(args.out) and not args.fresh:
        old = json.load(open(args.out))
        if old.get("settings") == settings:
            saved = {(r["T"], r["variant"]): r for r in old["rows"]}
    rows = dict(saved)
    print(f"decode.py: {settings}, lengths {args.lengths}, variants {args.variants}", flush=True)
    for i, T in enumerate(args.lengths):
        beside = None  # full's model and caches at T, its steps taken in turns with each row's
        for name in args.variants:
            if (T, name) in rows:
                continue
            last = rows.get((args.lengths[i - 1], name)) if i else None
            if last and "prefill_s" in last and last["prefill_s"] * (T / args.lengths[i - 1]) ** 2 > args.budget:
                guess = last["prefill_s"] * (T / args.lengths[i - 1]) ** 2
                rows[T, name] = dict(variant=name, T=T, skipped=f"prefill ~{guess:.0f} s extrapolated as T^2 from "
                                     f"{last['prefill_s']:.0f} s at {args.lengths[i - 1]} (> --budget {args.budget:.0f})")
            elif last and "skipped" in last:
                rows[T, name] = dict(variant=name, T=T, skipped=f"skipped at {args.lengths[i - 1]}")
            else:
                try:
                    if name == "full":
                        rows[T, name], beside = measure(name, T, args, autocast, keep=True)
                    else:
                        full = rows.get((T, "full"))
                        if beside is None and "full" in args.variants and (full is None or "prefill_s" in full):
                            try:
                                beside = hold_full(T, args, autocast)
                            except Exception as e:  # noqa: BLE001 - the rows divide by full's row instead
                                print(f"  T={T}: full's steps alongside not available ({type(e).__name__}: "
                                      f"{str(e).strip()[:120]}); ratios divide by full's row", flush=True)
                                beside = False
                        rows[T, name] = measure(name, T, args, autocast, beside=beside or None)
                except Exception as e:  # noqa: BLE001 - the row says so and the others still run
                    text = str(e).strip()
                    rows[T, name] = dict(variant=name, T=T, skipped=f"failed: {type(e).__name__}: "
                                         f"{text.splitlines()[0][:200] if text else ''}")
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
            r = rows[T, name]
            print(f"  T={T} {name}{' (' + r['step'].split(' (')[0] + ')' if args.compile and 'step' in r else ''}: "
                  + (r["skipped"] if "skipped" in r else
                  f"prefill {r['prefill_s']:.3g} s, decode {statistics.median(r['decode_ms']):.1f} ms, batch "
                  f"{args.batch} {statistics.median(r['decode_batch_ms']):.1f} ms"), flush=True)
            with open(args.out, "w") as f:
                json.dump(dict(settings=settings, rows=list(rows.values())), f, indent=1)
    measured = [r for r in rows.values() if "prefill_s" in r and r["T"] in args.lengths]
    largest = max((r["weight_bytes"] + args.layers * r["reads_per_layer"] for r in measured), default=1 << 26)
    bandwidth = read_bandwidth(largest, args.device)
    print(f"\nread bandwidth now: {bandwidth / 1e9:.1f} GB/s (the faster of a sum and a matrix-vector product over {largest / MB:.0f} MB, {args.threads} thread(s)); "
          f"each row's own, measured after its steps: " + ", ".join(
              f"{r['read_bandwidth'] / 1e9:.1f}" for r in measured if "read_bandwidth" in r) + " GB/s")
    weights = next((r["weight_bytes"] for r in measured), None)
    if weights:
        one, many = (weight_products(args.layers, args.vocab, args.device, b, attention=args.attention)
                     for b in (1, args.batch))
        print(f"the weights' products alone (every nn.Linear, one token): {one:.1f} ms at batch 1 = "
              f"{one / (1e3 * weights / bandwidth):.2f}x the time to read the weights once; {many:.1f} ms at batch "
              f"{args.batch}")
        # every variant's step runs the same products, so their share of full's step is a floor under
        # every ratio to full on this machine (goal (b)'s at batch 8 moves with it: 0.09 to 0.20 at 8192)
        fulls = [r for r in measured if r["variant"] == "full"]
        if fulls:
            print("  over full's step, a floor under every variant's ratio to it: " + "; ".join(
                f"T = {r['T']}: {one / statistics.median(r['decode_ms']):.2f} at batch 1, "
                f"{many / statistics.median(r['decode_batch_ms']):.2f} at batch {args.batch}" for r in fulls))
    print()
    print(table(list(rows.values()), args, bandwidth))


if __name__ == "__main__":
    main()
