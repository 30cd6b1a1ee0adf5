"""Training-step benchmark: one step (forward, backward, gradient clipping, AdamW) of the
model per attention configuration, on CPU, as a ratio to `full` measured side by side.

    python benchmarks/train_step.py                 # both shapes, every configuration, 2 threads
    python benchmarks/train_step.py --quick         # a tiny shape and 2 configurations (the test)
    python benchmarks/train_step.py --only=asga,caa --shapes=study --rounds=7

Shapes: `cpu` is train.py's CPU preset (the `bytes` model, 4 layers, T = 256, batch 16, one
micro-batch of the 4096-token step, the preset's window of 64 and nsa's and moba's sizes);
`study` is experiments/sweep.py's text runs (2 layers, T = 512, batch 2, window 64).
Configurations: every variant in attention.VARIANTS at its defaults, plus each flag that
changes the cost (asga's gate space, fixed gate, no gate; caa's forced branches; dsa's
windows; see CONFIGS).

Time: every model is built and stepped once (warm-up: AdamW state, compiled tiles), then
each configuration is timed in rounds interleaved with `full` (A B A B ..., `steps` steps a
sample); its tok/s is the median of its samples and its ratio the median of the per-round
ratios full_time / its_time, so both runs of a round saw the same machine load. The same
ratio of CPU time (time.process_time: this process's threads, busy, not waiting; OpenMP's
idle threads sleep, OMP_WAIT_POLICY=PASSIVE) is printed beside it: on a loaded shared
machine a step's wall time swings with the other jobs, its CPU time much less. Timing runs
under train.py's allocator settings (config.keep_freed_memory: glibc keeps freed blocks), as
a training run does. Why: under glibc's defaults a step's time depended on the process's
allocation history (glibc's dynamic mmap threshold, raised by whichever earlier allocation
freed the largest mapped block): asga's step faulted in 0 to ~600 MB of fresh pages (0 to
160k minor faults, up to ~20% of its time) from one run to the next, with the same code,
which read as asga's ratio falling from 0.38x (3621804) to 0.30x (f97b6dd)
(benchmarks/train_step_regression.md).
Memory: each configuration in a forked child process (forked before the parent runs any
torch op): after one warm-up step the peak resident set is reset (/proc/self/clear_refs)
and one step is run; `step_mb` is its peak resident set (VmHWM) minus the resident set
before the step (activations, gradients, transients: what the step adds to the model and
optimizer state), `peak_mb` the process's whole peak (what train.py's mem_gb reports).
The child keeps glibc's default trimming, so freed blocks go back to the OS and the next
step's peak is not hidden in memory kept from the warm-up.

Writes one Markdown table to stdout and the rows to --out (benchmarks/train_step_cpu.json).
"""
import argparse
import gc
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train.py: idle threads sleep on a shared CPU

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import attention  # noqa: E402
import kernels  # noqa: E402
from attention import rope_cos_sin  # noqa: E402
from config import TRAIN_PRESETS, keep_freed_memory  # noqa: E402
from model import MODEL_FIELDS, PRESETS, Model, ModelConfig  # noqa: E402

# (name, variant, flags): each flag that changes the cost of a step. Variants added to
# attention.VARIANTS later (nsa, moba) join at their defaults (see `configs`).
CONFIGS = [
    ("full", "full", {}),
    ("local", "local", {}),
    ("dsa", "dsa", {"dsa_window": "adaptive"}),
    ("dsa_fixed", "dsa", {"dsa_window": "fixed"}),
    ("dsa_nowin", "dsa", {"dsa_window": "none"}),
    ("asga", "asga", {}),
    ("asga_prob", "asga", {"asga_gate_space": "prob"}),
    ("asga_fixed", "asga", {"asga_gate": "fixed"}),
    ("asga_off", "asga", {"asga_gate": "off"}),
    ("caa", "caa", {}),
    ("caa_local", "caa", {"caa_gate": "local"}),
    ("caa_global", "caa", {"caa_gate": "global"}),
    ("combiner", "combiner", {}),
]

# model: a model.PRESETS name plus overrides; T, B: sequence length and sequences per step.
SHAPES = {
    # train.py's CPU preset with its attention sizes (windows of 64, nsa's and moba's blocks for
    # T = 256): at the model's defaults for T = 1024 (window 256, dsa's threshold 512) local, dsa
    # and the indexer ran full attention here
    "cpu": dict(model="bytes", overrides={k: v for k, v in TRAIN_PRESETS["cpu"].items() if k in MODEL_FIELDS},
                T=256, B=16),
    # experiments/sweep.py's TEXT (the study's text runs): one micro-batch is the whole step
    "study": dict(model="tiny", overrides=dict(vocab_size=256, n_layer=2, d_model=128, n_head=4, n_kv_head=4,
                                               head_dim=32, mlp_hidden=384, window=64, dsa_threshold=128,
                                               caa_window_max=128), T=512, B=2),
    "quick": dict(model="tiny", overrides=dict(vocab_size=256, window=16, dsa_threshold=32, caa_window_max=32),
                  T=64, B=2),
}
QUICK = dict(shapes=["quick"], only=["full", "local"], rounds=3, steps=1)
# The goals (ratio of tok/s to full's, 2 cores): the variant at its defaults
GOALS = dict(asga=0.6, asga_prob=0.6, caa=0.8, combiner=0.9, local=0.95, dsa=0.95, dsa_fixed=0.95,
             nsa=0.8, moba=0.8)
LR, WEIGHT_DECAY, GRAD_CLIP = 3e-3, 0.1, 1.0  # train.py's cpu preset (the lr does not change the cost)


def configs(only=None):
    """CONFIGS plus any variant of attention.VARIANTS they do not name, at its defaults."""
    rows = CONFIGS + [(v, v, {}) for v in attention.VARIANTS if v not in {c[1] for c in CONFIGS}]
    if only:
        unknown = set(only) - {c[0] for c in rows}
        if unknown:
            raise SystemExit(f"unknown configuration(s) {sorted(unknown)}; valid: {', '.join(c[0] for c in rows)}")
        rows = [c for c in rows if c[0] in only or c[0] == "full"]  # full: every ratio's other half
    return rows


def build(shape, attn, flags, seed=0, models=None):
    """(model, optimizer, x, y): AdamW with decay on matrices, as train.py's make_optimizer.
    models: the model module to build from (train_step_ab.py passes another checkout's)."""
    s = SHAPES[shape]
    config_class, model_class, presets = (ModelConfig, Model, PRESETS) if models is None else \
        (models.ModelConfig, models.Model, models.PRESETS)
    cfg = config_class(**{**presets[s["model"]], **s["overrides"], "attn": attn, "kernel": "fused", **flags})
    torch.manual_seed(seed)
    model = model_class(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": other, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), fused=True)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (s["B"], s["T"] + 1), generator=g)
    return model, opt, tokens[:, :-1], tokens[:, 1:]


def train_step(model, opt, x, y):
    _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _status_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def _memory_child(shape, attn, flags, threads, conn):
    try:
        torch.set_num_threads(threads)
        model, opt, x, y = build(shape, attn, flags)
        train_step(model, opt, x, y)  # warm-up: AdamW state, compiled tiles
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident set
        base = _status_kb("VmRSS")
        train_step(model, opt, x, y)
        peak = _status_kb("VmHWM")
        conn.send(dict(step_mb=(peak - base) / 1024, peak_mb=peak / 1024))
    except Exception as e:  # the row says so; the benchmark goes on
        conn.send(dict(error=f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def memory(shape, rows, threads):
    """{name: {step_mb, peak_mb}}, each configuration in its own forked child."""
    ctx = multiprocessing.get_context("fork")
    out = {}
    for name, attn, flags in rows:
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_memory_child, args=(shape, attn, flags, threads, send))
        p.start()
        send.close()
        out[name] = recv.recv() if recv.poll(600) else dict(error="no answer in 600 s")
        p.join()
    return out


def timing(shape, rows, rounds, steps):
    """{name: {tok_s, ratio, samples}}: samples interleaved with full's, see the docstring."""
    built = {name: build(shape, attn, flags) for name, attn, flags in rows}
    for b in built.values():
        train_step(*b)  # warm-up
    tokens = SHAPES[shape]["B"] * SHAPES[shape]["T"] * steps

    def sample(name):
        """(wall seconds, CPU seconds of this process) of `steps` steps."""
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            train_step(*built[name])
        return time.perf_counter() - t0, time.process_time() - c0

    out, full_times, full_cpu = {}, [], []
    for name, _, _ in rows:
        if name == "full":
            continue
        pairs, cpu = [], []
        for _ in range(rounds):
            (a, ca), (b, cb) = sample("full"), sample(name)
            pairs.append((a, b))
            cpu.append((ca, cb))
        full_times += [a for a, _ in pairs]
        full_cpu += [a for a, _ in cpu]
        out[name] = dict(tok_s=tokens / statistics.median(b for _, b in pairs),
                         ratio=statistics.median(a / b for a, b in pairs),
                         cpu_ratio=statistics.median(a / b for a, b in cpu),
                         full_tok_s=tokens / statistics.median(a for a, _ in pairs),
                         seconds=[round(b, 6) for _, b in pairs], full_seconds=[round(a, 6) for a, _ in pairs],
                         cpu_seconds=[round(b, 6) for _, b in cpu], full_cpu_seconds=[round(a, 6) for a, _ in cpu])
    if not full_times:  # full alone
        full_times, full_cpu = map(list, zip(*[sample("full") for _ in range(rounds)]))
    for r in out.values():
        r["steps"] = steps
    out["full"] = dict(tok_s=tokens / statistics.median(full_times), ratio=1.0, cpu_ratio=1.0, steps=steps,
                       seconds=[round(t, 6) for t in full_times], cpu_seconds=[round(t, 6) for t in full_cpu])
    return out


def attention_cost(shape, rows, rounds, timing_rows):
    """What bounds each configuration: the forward + backward of the model's attention layers
    alone (every layer's self_attn on the same input, as the step runs them), interleaved with
    full's as in `timing`. {name: {attn_ms, attn_ratio (full's time / its, median of the
    rounds), attn_share (full's attention / full's whole step, from timing_rows), allows}}.
    allows = 1 / (1 - share + share / attn_ratio): the step's ratio to full's if everything
    but attention cost what it costs in full's step; a goal above it is out of reach for
    any change outside the attention kernel."""
    s = SHAPES[shape]
    layers = {}
    for name, attn, flags in rows:
        model = build(shape, attn, flags)[0]
        cfg = model.cfg
        g = torch.Generator().manual_seed(1)
        x = torch.randn(s["B"], s["T"], cfg.d_model, generator=g, requires_grad=True)
        cos, sin = rope_cos_sin(torch.arange(s["T"]), cfg.head_dim, cfg.rope_theta)
        layers[name] = (model, x, cos, sin)

    def run(name):
        model, x, cos, sin = layers[name]
        t0 = time.perf_counter()
        for layer in model.layers:
            layer.self_attn(x, cos, sin, 0).sum().backward()
        model.zero_grad(set_to_none=True)
        x.grad = None
        return time.perf_counter() - t0

    for name in layers:
        run(name)  # warm-up (compiled tiles)
    out, full_all = {}, []
    for name, _, _ in rows:
        if name == "full":
            continue
        pairs = [(run("full"), run(name)) for _ in range(rounds)]
        full_all += [a for a, _ in pairs]
        out[name] = dict(attn_ms=1e3 * statistics.median(b for _, b in pairs),
                         attn_ratio=statistics.median(a / b for a, b in pairs))
    out["full"] = dict(attn_ms=1e3 * statistics.median(full_all or [run("full") for _ in range(rounds)]), attn_ratio=1.0)
    steps = timing_rows["full"]
    full_step_ms = 1e3 * statistics.median(steps["seconds"]) / steps["steps"]
    share = min(1.0, out["full"]["attn_ms"] / full_step_ms)
    for r in out.values():
        r["attn_share"] = share
        r["allows"] = 1 / (1 - share + share / r["attn_ratio"])
    return out


def gate_bound(shape="cpu", rounds=5):
    """What bounds asga: on one tile of the shape's own sizes (G = B H rows, r hidden units,
    64 queries x T keys), the compiled gate tile's forward and backward (kernels.GateTile)
    against the q.k^T bmm of the same tile (ms, medians), and the arithmetic per score:
    attention's matmuls 2 D (q.k) + 2 D (p.v) forward, twice that backward; the pair MLP r
    GELUs (an erf each) plus 3 r adds and multiplies forward, r GELU derivatives (erf and
    exp) plus 4 r backward."""
    s = SHAPES[shape]
    cfg = ModelConfig(**{**PRESETS[s["model"]], **s["overrides"]})
    G, r, D, bq, c = s["B"] * cfg.n_head, cfg.asga_hidden, cfg.head_dim, 64, s["T"]
    g = torch.Generator().manual_seed(0)
    qt, kt, w2, dz = (torch.randn(*x, generator=g) for x in ((G, r, bq), (G, r, c), (G, r), (G, bq, c)))
    q, k = torch.randn(G, bq, D, generator=g), torch.randn(G, c, D, generator=g)
    tile = kernels.GateTile(qt, kt, w2, n_buffers=3)

    def ms(fn):
        fn()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    return dict(shape=shape, tile=f"G={G}, r={r}, {bq} queries x {c} keys, D={D}", gate_tile=kernels.GateTile.path,
                gate_forward_ms=ms(lambda: tile.logits(0, bq, 0, c)),
                gate_backward_ms=ms(lambda: (tile.logits(0, bq, 0, c), tile.grads(dz))),
                qk_bmm_ms=ms(lambda: torch.bmm(q, k.transpose(1, 2))),
                attention_flops_per_score=dict(forward=4 * D, backward=8 * D),
                pair_mlp_per_score=dict(forward=f"{r} GELU (erf) + {3 * r} flops",
                                        backward=f"{r} GELU' (erf, exp) + {r} GELU (erf) + {4 * r} flops"))


def table(rows):
    lines = ["| shape | config | tok/s | vs full (same rounds) | goal | vs full, CPU time | step memory MB | vs full "
             "| peak RSS MB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        full = next(f for f in rows if f["shape"] == r["shape"] and f["config"] == "full")
        mem = "error" if "error" in r else f"{r['step_mb']:.0f}"
        mem_rel = "" if "error" in r or "error" in full else f"{r['step_mb'] / max(full['step_mb'], 1e-9):.2f}x"
        goal = GOALS.get(r["config"])
        goal_s = "" if goal is None else f">= {goal}x {'met' if r['ratio'] >= goal else 'NOT met'}"
        peak = "" if "error" in r else f"{r['peak_mb']:.0f}"
        lines.append(f"| {r['shape']} | {r['config']} | {r['tok_s']:.0f} | {r['ratio']:.2f}x | {goal_s} | "
                     f"{r['cpu_ratio']:.2f}x | {mem} | "
                     f"{mem_rel} | {peak} |")
    return "\n".join(lines)


def bounds_table(rows):
    """What bounds each row (attention_cost): its attention layers against full's, and the step
    ratio that leaves; 'attention' where the goal is above it (the attention kernel bounds it)."""
    lines = ["What bounds each configuration: forward + backward of its attention layers alone, against "
             "full's (SDPA); share: full's attention / full's whole step; allows: the step ratio if "
             "everything else cost what it costs in full's step.", "",
             "| shape | config | attention ms | vs full | share of full's step | step ratio it allows | goal |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["config"] == "full" or "attn_ms" not in r:
            continue
        goal = GOALS.get(r["config"])
        verdict = "" if goal is None else (f">= {goal}x: " + ("within reach" if r["allows"] >= goal else
                                                              "out of reach of the attention kernel as it is"))
        lines.append(f"| {r['shape']} | {r['config']} | {r['attn_ms']:.1f} | {r['attn_ratio']:.2f}x | "
                     f"{r['attn_share']:.2f} | {r['allows']:.2f}x | {verdict} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shape, full and local, one step a sample")
    p.add_argument("--shapes", default="cpu,study", help=f"comma-separated, of: {', '.join(SHAPES)}")
    p.add_argument("--only", default="", help="comma-separated configuration names (full is always run)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved samples per configuration")
    p.add_argument("--steps", type=int, default=2, help="training steps per sample")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bounds", action="store_true", help="only asga's bound (gate_bound), added to --out's JSON")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/train_step_cpu.json; "
                                                "--quick writes none unless given)")
    args = p.parse_args(argv)
    shapes, only = args.shapes.split(","), [o for o in args.only.split(",") if o]
    rounds, steps = args.rounds, args.steps
    if args.quick:
        shapes, only, rounds, steps = QUICK["shapes"], QUICK["only"], QUICK["rounds"], QUICK["steps"]
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"unknown shape {s!r}; valid: {', '.join(SHAPES)}")
    if args.bounds:
        keep_freed_memory()
        torch.set_num_threads(args.threads)
        out = args.out or os.path.join(ROOT, "benchmarks", "train_step_cpu.json")
        report = json.load(open(out)) if os.path.exists(out) else {}
        report["bounds"] = [gate_bound(s) for s in shapes]
        report["bounds_load_average"] = round(os.getloadavg()[0], 2)
        print(json.dumps(report["bounds"], indent=1))
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
        return report
    rows = configs(only)
    # memory first: the children are forked before this process runs any torch op
    mem = {s: memory(s, rows, args.threads) for s in shapes}
    keep_freed_memory()  # after the children (they keep glibc's trimming): time as train.py runs
    torch.set_num_threads(args.threads)
    started = time.time()
    load_before = os.getloadavg()[0]
    results = []
    for s in shapes:
        times = timing(s, rows, rounds, steps)
        attn = attention_cost(s, rows, rounds, times)
        for name, attn_name, flags in rows:
            results.append(dict(shape=s, config=name, attn=attn_name, flags=flags, T=SHAPES[s]["T"], B=SHAPES[s]["B"],
                                **times[name], **mem[s][name], **attn[name]))
    report = dict(
        command=" ".join(["python benchmarks/train_step.py"] + (argv if argv is not None else sys.argv[1:])),
        torch=torch.__version__, threads=args.threads, rounds=rounds, steps_per_sample=steps,
        machine=f"{platform.machine()}, {os.cpu_count()} CPUs, ATen {torch.backends.cpu.get_cpu_capability()}",
        load_average=[round(load_before, 2), round(os.getloadavg()[0], 2)],
        seconds=round(time.time() - started, 1), gate_tile=kernels.GateTile.path,
        memory="step_mb: peak resident set (VmHWM) of a forked process during one training step minus its "
               "resident set before it; peak_mb: that process's VmHWM",
        rows=results)
    print(table(results))
    print()
    print(bounds_table(results))
    print(f"asga's gate tile: {report['gate_tile']}; load average {report['load_average']}; "
          f"{report['seconds']} s of timing")
    out = args.out or (None if args.quick else os.path.join(ROOT, "benchmarks", "train_step_cpu.json"))
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
