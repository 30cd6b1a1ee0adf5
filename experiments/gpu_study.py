"""The papers' comparison on a GPU node in one command: every configuration at qwen-134m on
FineWeb, paired, run by run, resumable, written up as RESULTS-style Markdown with figures.

    torchrun --nproc_per_node=8 experiments/gpu_study.py           # run, or continue, the study
    python experiments/gpu_study.py --dry_run --gpus=8              # the plan and what is missing; runs nothing
    python experiments/gpu_study.py --results_only                  # rewrite the Markdown and figures from the logs
    python experiments/gpu_study.py --tiny --data_dir=data/bytes    # the same on a CPU: tiny model, 3 configs, 8 steps

The runs. Every configuration of sweep.TEXT_CONFIGS (every variant in attention.VARIANTS, the
papers' ablations and this project's flags; `--configs=a,b` picks some) at each of `--seeds`
(default 0), with train.py's defaults for the preset (`qwen-134m`: 5000 steps of 2^19 tokens
on data/fineweb10B, which `python data.py --source=fineweb-gpt2` makes). Any other `--key=value`
is a train.py flag given to every run (e.g. `--max_steps=2000`). Runs go to OUT/NAME_sSEED
(OUT = --out_dir, default experiments/results/gpu), seed 0 of every configuration first.

Paired as the CPU study (experiments/sweep.py) is: each run is `experiments/paired.py` with the
run's train.py flags, so at one seed every configuration starts from `full`'s values of the
parameters it shares with it, and reads the same batches (data.py's loader permutes with its
own generator seeded by --seed).

Resumable run by run. OUT/study.json records the plan (every run's flags) before anything runs.
A run whose log ends with train.py's `end` record at the planned step is skipped; any other is
started with `--resume=auto`, so an interrupted one continues from its checkpoint. Given
another plan for the same OUT (other configurations, seeds, steps, preset...), the study stops
before running anything with one line naming what changed: keep the recorded plan, choose a
new --out_dir, or pass --replan (the new plan is recorded; a run folder whose flags changed is
moved to OUT/replaced/TIME/, never deleted).

The plan, printed before anything runs: every run, its tokens, and its hours estimated two ways:
from flops.py's FLOPs per token at an assumed MFU (ASSUMED_MFU, the one a GPU has measured) of
the GPUs' bf16 peak, and from a short timing job of each configuration (`--timing_steps` steps
after start-up and compilation, at the study's world size; `--no_timing` skips it), which also
shows that every configuration compiles and passes train.py's preflight before the long runs.

Processes. Each run is a child process (`python experiments/paired.py ...`) of every rank,
not train.main() called in this process, because one process cannot hold several runs
apart: CUDA's peak-memory counter (the memory column) and torch.compile's caches carry over
from one run to the next, and a run's fatal error (train.py exits) would end the study.
Under torchrun every rank starts the same child with its own RANK / LOCAL_RANK / WORLD_SIZE,
so the children form a process group exactly as train.py does under torchrun. Each child
group gets a store of its own (rank 0's host, a free port, sent to the ranks through
torchrun's store): on torchrun's store every run's group would write the same keys, and a
rank could read the previous group's address, the race config.init_process_group's docstring
describes for restarts. Rank 0 alone decides which runs remain, prints, and writes files.
SIGTERM / Ctrl-C reach the child, which writes a checkpoint after its current step and exits
143 / 130; the study then exits with the same code.

Results: OUT/RESULTS_GPU.md (every configuration's validation loss, paired Δ from `full`,
tokens/s, MFU and peak memory from log.jsonl; the papers' numbers beside ours; loss by
position, bits per byte and HellaSwag of every run from eval.json) and its figures in
OUT/figures/ and OUT/analysis/ (analyze.py), rewritten after every run. HellaSwag is run by
train.py at the end of each run on CUDA (downloaded once into data/hellaswag); with
`--hellaswag_file=PATH` (an offline node; the tests' items) the study scores that file
instead, with evaluate.py on each run's checkpoint, into RUN/hellaswag.json.
"""
import argparse
import ctypes
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import fields
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

import torch  # noqa: E402

import analyze  # noqa: E402
import config  # noqa: E402
import figures  # noqa: E402
import flops  # noqa: E402
import sweep  # noqa: E402
from model import Model, ModelConfig  # noqa: E402

CONFIGS = sweep.TEXT_CONFIGS  # (name, attn, flags): the CPU study's configurations, here at the papers' scale
PRESET = "qwen-134m"  # train.py's GPU default: the papers' model at 1024 tokens, 5000 steps of 2^19 tokens
OUT = ROOT / "experiments" / "results" / "gpu"
STATE = "study.json"
# The loss figure's columns: the CPU study's families of configurations, and the later baselines.
FAMILIES = figures.FAMILIES + [("nsa / moba / indexer", ("nsa", "moba", "indexer"))]
# The MFU the FLOP-model estimate assumes: `full` trained at 30.3% (local 29.4%, dsa 27.2%) at
# qwen-134m on one H100 (benchmarks/gpu_runs/h100_2026-11-25.md). A variant whose kernels are
# slower than SDPA (asga's attention core was 52x SDPA there) takes longer: the timing job measures it.
ASSUMED_MFU = 0.30
# --tiny: the CPU preset's geometry (T = 256, W = 64: windows narrower than the sequence) on
# the tiny model, a few steps, 3 configurations; for tests and for trying the study on a laptop.
TINY = dict(preset="cpu", configs="full,local,dsa", timing_steps=3,
            flags=dict(model="tiny", batch_size=2, total_batch_tokens=1024, max_steps=8, warmup_steps=2,
                       eval_every=4, ckpt_every=4, val_tokens=2048, gate_batch=2, eval_seqs=2))
# Flags the study sets itself, and the flag of the study to use instead.
OWN_FLAGS = {"attn": "--configs", "seed": "--seeds", "out_dir": "--out_dir", "resume": "(always auto)",
             "stop_step": "--max_steps", "dry_run": "--dry_run", "preset": "--preset", "data_dir": "--data_dir"}


# ----------------------------------------------------------------------------- the plan

def train_flag_names():
    return {f.name for f in fields(config.TrainConfig)} | {f.name for f in fields(ModelConfig)}


def parse_run(argv):
    """A run's train.py flags -> (TrainConfig, ModelConfig), exactly as train.py resolves them
    (the one place this file reads train.py's configuration)."""
    tc, mc, _ = config.parse_args(argv)
    return tc, mc


def make_plan(args):
    """{"preset", "configs": [[name, attn, flags]], "seeds", "runs": {run: train.py flags}}:
    everything that decides what the runs compute (the out_dir is not part of it)."""
    base = [f"--preset={args.preset}"] + ([f"--data_dir={sweep.rel(args.data_dir)}"] if args.data_dir else [])
    base += [f"--{k}={v}" for k, v in args.flags.items()]
    configs = [c for c in CONFIGS if c[0] in args.configs]
    runs = {}
    for seed in args.seeds:  # seed-major: a study cut short has complete pairs at its first seeds
        for name, attn, flags in sorted(configs, key=lambda c: c[0] != "full"):
            runs[f"{name}_s{seed}"] = base + [f"--attn={attn}"] + [f"--{k}={v}" for k, v in flags.items()] + [f"--seed={seed}"]
    return {"preset": args.preset, "configs": [list(c) for c in configs], "seeds": args.seeds, "runs": runs}


def unseeded(argv):
    """A run's flags less its seed: what its configuration's timing job measured."""
    return [a for a in argv if not a.startswith("--seed=")]


def flag_dict(argv):
    return dict(a[2:].partition("=")[::2] for a in argv)


def plan_changes(old, new):
    """What differs between two plans, in words (empty when they are the same)."""
    changes = []
    old_names, new_names = [c[0] for c in old["configs"]], [c[0] for c in new["configs"]]
    if added := [n for n in new_names if n not in old_names]:
        changes.append(f"configurations added: {', '.join(added)}")
    if removed := [n for n in old_names if n not in new_names]:
        changes.append(f"configurations removed: {', '.join(removed)}")
    if old["seeds"] != new["seeds"]:
        changes.append(f"seeds {','.join(map(str, old['seeds']))} -> {','.join(map(str, new['seeds']))}")
    differ = {}  # "--key old -> new": the runs it concerns
    for run in old["runs"].keys() & new["runs"].keys():
        a, b = flag_dict(old["runs"][run]), flag_dict(new["runs"][run])
        for key in sorted(a.keys() | b.keys()):
            if a.get(key) != b.get(key):
                differ.setdefault(f"--{key} {a.get(key, '(unset)')} -> {b.get(key, '(unset)')}", []).append(run)
    shared = len(old["runs"].keys() & new["runs"].keys())
    for what, runs in differ.items():
        changes.append(what + (" (every run)" if len(runs) == shared > 1 else f" ({', '.join(sorted(runs))})"))
    return changes


def load_state(out):
    path = Path(out, STATE)
    return json.loads(path.read_text()) if path.exists() else None


def save_state(out, state):
    Path(out).mkdir(parents=True, exist_ok=True)
    tmp = Path(out, STATE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, Path(out, STATE))


def replan(out, old, new):
    """Before the new plan is recorded: move every run folder whose flags it changes (or which
    the old plan did not hold) to OUT/replaced/TIME/ -> the folders moved."""
    moved = []
    aside = Path(out, "replaced", time.strftime("%Y%m%d-%H%M%S"))
    for run, argv in new["runs"].items():
        folder = Path(out, run)
        if folder.exists() and old["runs"].get(run) != argv:
            aside.mkdir(parents=True, exist_ok=True)
            shutil.move(str(folder), str(aside / run))
            moved.append(sweep.rel(aside / run))
    return moved


# ----------------------------------------------------------------------------- the runs' state

def last_records(run_dir):
    """(the last step record, the last `end` record) of a run's log.jsonl, None where absent."""
    step = end = None
    path = Path(run_dir, "log.jsonl")
    if not path.exists():
        return None, None
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("event") == "end":
            end = r
        elif "loss" in r:
            step, end = r, None  # an end record counts only after the last step
    return step, end


def finished(run_dir, max_steps):
    """True when the run's log ends with train.py's `end` record at max_steps (a job ended
    early with --stop_step also writes one)."""
    _, end = last_records(run_dir)
    return end is not None and end.get("step") == max_steps


def run_state(run_dir, max_steps, seconds=None):
    """done (in how long), resumes (from which step) or to run."""
    if finished(run_dir, max_steps):
        return "done" + ("" if seconds is None else f" in {seconds / 3600:.2f} h")
    step, _ = last_records(run_dir)
    if Path(run_dir, "ckpt.pt").exists() and step:
        return f"resumes (step {step['step']:,} logged)"
    return "to run"


# ----------------------------------------------------------------------------- processes

class Ranks:
    """This process's place among the study's processes. Rank 0 decides; every other rank
    follows what rank 0 shares through torchrun's key-value store (the one at MASTER_ADDR:
    MASTER_PORT, served by torchrun's agent; another launcher's rank 0 serves it itself)."""

    def __init__(self):
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.distributed, self.store, self.sent = "RANK" in os.environ, None, 0
        if self.world > 1:
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), self.world,
                                               is_master=self.rank == 0 and not agent, timeout=timedelta(days=30))
            # a torchrun restart of the study finds the previous attempt's keys: a prefix of its own
            self.store = torch.distributed.PrefixStore(f"gpu_study_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)

    def share(self, message=None):
        """Rank 0's message (JSON) on every rank, in the order the ranks ask."""
        if self.store is None:
            return message
        key, self.sent = f"message_{self.sent}", self.sent + 1
        if self.rank == 0:
            self.store.set(key, json.dumps(message))
        return json.loads(self.store.get(key))

    def child_master(self):
        """The address a child process group rendezvouses at: this host (single node:
        torchrun's MASTER_ADDR; several: this host's name, as torchrun names its own), and a
        port free now (torchrun --standalone picks its own the same way)."""
        if not self.distributed:
            return None
        host = os.environ["MASTER_ADDR"] if self.local_world == self.world else socket.getfqdn()
        with socket.socket() as s:
            s.bind(("", 0))
            return [host, s.getsockname()[1]]


def die_with_parent():
    """Linux: the child gets SIGKILL when this process dies, so a study killed outright (as
    torchrun does after its grace period) leaves no training process holding a GPU."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def execute(argv, master, log_path=None, show=True):
    """Run `python ARGV` in the repository as a child of this rank -> its exit code. Under
    torchrun the child keeps this rank's RANK / WORLD_SIZE and rendezvouses at `master`, a
    fresh store of its own (not the agent's, which holds this study's keys). SIGTERM / SIGINT
    are passed on to it (it is in its own session, so a Ctrl-C reaches it once, through here).
    With log_path, its output is appended to that file, and shown too when `show`."""
    env = dict(os.environ)
    if master is not None:
        env["MASTER_ADDR"], env["MASTER_PORT"] = master[0], str(master[1])
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        env.pop("TORCHELASTIC_RESTART_COUNT", None)  # a child is a fresh group, not a restart
    out = subprocess.PIPE if log_path else None
    proc = subprocess.Popen([sys.executable] + argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                            text=True, start_new_session=True, preexec_fn=die_with_parent)
    forward = lambda signum, frame: proc.send_signal(signum)  # noqa: E731
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        if log_path:
            with open(log_path, "a") as log:
                for line in proc.stdout:
                    if show:
                        sys.stdout.write(line)
                        sys.stdout.flush()
                    log.write(line)
                    log.flush()
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def follow(ranks):
    """Ranks other than 0: run what rank 0 shares until it says stop -> the exit code."""
    while True:
        message = ranks.share()
        if "stop" in message:
            return message["stop"]
        code = execute(message["argv"], message["master"])
        if code:
            return code


def launch(ranks, argv, log_path, show=True):
    """Rank 0: every rank runs `python ARGV` (paths relative to the repository) -> rank 0's exit code."""
    message = ranks.share({"argv": argv, "master": ranks.child_master()})
    return execute(message["argv"], message["master"], log_path, show)


def stop_all(ranks, code):
    ranks.share({"stop": code})
    return code


# ----------------------------------------------------------------------------- estimates

def gpu_peak(args, timings):
    """(name, bf16 peak FLOP/s, where the name comes from) of the GPUs the estimate is for: the
    one the timing jobs ran on, else --gpu. (Asking CUDA here would start a CUDA context in this
    process, on the GPU its rank-0 child trains on.)"""
    for t in timings.values():
        if flops.peak_flops(t.get("device_name", "")):
            return t["device_name"], flops.peak_flops(t["device_name"]), "the timing jobs' GPU"
    return args.gpu, flops.peak_flops(args.gpu), "--gpu"


def run_sizes(plan):
    """{run: (TrainConfig, ModelConfig, parameters, training FLOPs per token)} of the plan."""
    out = {}
    for run, argv in plan["runs"].items():
        tc, mc = parse_run(argv)
        with torch.device("meta"):  # sizes only: no weights are allocated
            model = Model(mc)
        out[run] = (tc, mc, model.num_params(), flops.flops_per_token(model, tc.seq_len))
    return out


def eval_tokens(tc):
    """Tokens of the periodic validation (forward only) over a whole run."""
    return (tc.max_steps // tc.eval_every + 1) * tc.val_tokens


def flop_hours(tc, per_token, gpus, peak, mfu):
    """Hours of a run from the FLOP model: training tokens at per_token FLOPs, validation
    tokens at a third of it (forward only), on `gpus` GPUs at mfu x peak each."""
    work = tc.max_steps * tc.total_batch_tokens * per_token + eval_tokens(tc) * per_token / 3
    return work / (gpus * peak * mfu) / 3600


def measured_hours(tc, timing):
    """Hours of a run from its configuration's timing job: the steps at the measured step
    time, validation at three times the training throughput, and the job's start-up."""
    return (tc.max_steps * timing["s_per_step"] + eval_tokens(tc) / (3 * timing["tok_s"]) + timing["startup_s"]) / 3600


def print_plan(args, plan, state, sizes, gpus, out):
    """Every run: FLOPs per token, hours from the FLOP model and from the timing job, state."""
    timings = (state or {}).get("timing", {})
    name, peak, chosen = gpu_peak(args, timings)
    first = next(iter(sizes.values()))
    tc = first[0]
    tokens = tc.max_steps * tc.total_batch_tokens
    lines = [f"GPU study: {len(plan['runs'])} runs ({len(plan['configs'])} configurations x seeds "
             f"{','.join(map(str, plan['seeds']))}) in {sweep.rel(out)}",
             f"  each run    preset {plan['preset']}: {tc.model} ({first[2] / 1e6:.1f}M parameters in {next(iter(sizes))}), "
             f"{tc.max_steps:,} steps x {tc.total_batch_tokens:,} tokens = {tokens:,} tokens at seq_len {tc.seq_len}, "
             f"data {tc.data_dir}",
             "  paired      at one seed every run reads the same batches and starts from full's values of the "
             "parameters it shares with it (experiments/paired.py)",
             f"  estimates   FLOP model: flops.py's FLOPs per token at {args.assumed_mfu:.0%} MFU (--assumed_mfu) of "
             f"{gpus} x {name}, {'no known peak' if peak is None else f'{peak / 1e12:.0f} TFLOP/s bf16 each'} "
             f"({chosen}), as if every variant ran at full's MFU (a lower bound where its kernels are slower than "
             f"SDPA, as asga's are); measured: each configuration's timing job ({args.timing_steps} steps)",
             f"  {'run':22s} {'MFLOP/token':>11s} {'FLOP-model h':>12s} {'measured h':>10s}  state"]
    left = {"flop": 0.0, "measured": 0.0, "untimed": 0}  # over the runs still to do
    for run, (rtc, _, _, per_token) in sizes.items():
        state_text = run_state(out / run, rtc.max_steps, (state or {}).get("runs", {}).get(run))
        est = flop_hours(rtc, per_token, gpus, peak, args.assumed_mfu) if peak else None
        t = timings.get(run.rsplit("_s", 1)[0])
        meas = measured_hours(rtc, t) if t and (t["world"], t["flags"]) == (gpus, unseeded(plan["runs"][run])) else None
        if not state_text.startswith("done"):
            left["flop"] += est or 0.0
            left["measured"] += meas or 0.0
            left["untimed"] += meas is None
        lines.append(f"  {run:22s} {per_token / 1e6:11.1f} {'–' if est is None else f'{est:.2f}':>12s} "
                     f"{'–' if meas is None else f'{meas:.2f}':>10s}  {state_text}")
    runs_left = sum(not run_state(out / run, sizes[run][0].max_steps).startswith("done") for run in sizes)
    measured = "–" if left["untimed"] == runs_left else f"{left['measured']:.1f}"
    lines.append(f"  {'total left':22s} {'':11s} {left['flop']:12.1f} {measured:>10s}"
                 + (f"  ({left['untimed']} run(s) without a timing job: not in the measured total)"
                    if left["untimed"] and measured != "–" else ""))
    print("\n".join(lines), flush=True)


def device_of(tc):
    return tc.device if tc.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def missing(args, sizes):
    """What a real run of this plan lacks on this machine, one line each (empty: nothing)."""
    found = []
    tc, mc = next(iter(sizes.values()))[:2]
    on_gpu = tc.device.startswith("cuda") or (tc.device == "auto" and args.preset != "cpu")
    if args.preset != "cpu" and not torch.cuda.is_available():
        found.append(f"a GPU: CUDA is not available here (torch {torch.__version__}"
                     f"{', a CPU-only build' if torch.version.cuda is None else ''}); run the study on a GPU node, "
                     f"or try it here with --tiny")
    tokens = tc.max_steps * tc.total_batch_tokens
    have, _ = config.train_tokens_found(tc.data_dir)
    if have is None or have < tokens:
        what = f"no shards at {tc.data_dir}" if have is None else f"{have:,} training tokens at {tc.data_dir}"
        found.append(f"data: {what}; each run reads {tokens:,} tokens (the same ones at one seed): "
                     f"{config.shards_command(tc, mc)}")
    if args.hellaswag_file:
        if not Path(args.hellaswag_file).exists():
            found.append(f"HellaSwag: --hellaswag_file={args.hellaswag_file} does not exist")
    elif on_gpu and tc.hellaswag != "false" and not (ROOT / "data" / "hellaswag" / "hellaswag_val.jsonl").exists():
        found.append("HellaSwag: data/hellaswag/hellaswag_val.jsonl is not there; the first run's final evaluation "
                     "downloads it (internet), or copy it there, or pass --hellaswag_file=PATH")
    if mc.vocab_size > 256:  # GPT-2 tokens (train.py takes the vocabulary from the shards' tokenizer)
        try:
            import tiktoken

            tiktoken.get_encoding("gpt2")
        except Exception as e:  # offline and no cached BPE files
            found.append(f"GPT-2's BPE files (bits per byte and HellaSwag need them): tiktoken could not load them "
                         f"({type(e).__name__}); connect once, or set TIKTOKEN_CACHE_DIR to a folder holding them")
    return found


# ----------------------------------------------------------------------------- timing

def timing_argv(argv, out, config, steps):
    """The run's own flags, stopped after `steps` steps, without the final evaluations, in a
    scratch folder: what a step of that run costs, after its start-up, compilation and preflight.
    The indexer's steps are timed sparse, as nearly all of its run is (its dense warm-up is
    indexer_warmup steps at the start), unless the configuration sets indexer_warmup itself."""
    sparse = ["--indexer_warmup=0"] if "--attn=indexer" in argv and "indexer_warmup" not in flag_dict(argv) else []
    return ["experiments/paired.py"] + argv + sparse + [f"--out_dir={sweep.rel(out / 'timing' / config)}",
                                                        f"--stop_step={steps}", "--eval_seqs=0", "--hellaswag=false",
                                                        "--resume=false"]


def read_timing(folder, wall, world):
    """A timing job's numbers: median step time, tok/s and MFU over its second half of steps
    (the first pay for compilation), peak memory, and its start-up (wall time - the steps)."""
    run = analyze.load_run(folder)
    steps = [r for r in run["steps"] if "tok_s" in r]
    timed = steps[len(steps) // 2:]
    tok_s = statistics.median(r["tok_s"] for r in timed)
    total = run["train"]["total_batch_tokens"]
    mfu = [r["mfu"] for r in timed if "mfu" in r]
    return {"s_per_step": total / tok_s, "tok_s": tok_s, "steps": len(steps), "world": world,
            "mem_gb": max(r["mem_gb"] for r in steps), "mfu": statistics.median(mfu) if mfu else None,
            "startup_s": max(0.0, wall - sum(total / r["tok_s"] for r in steps)),
            "device_name": json.loads(Path(folder, "config.json").read_text()).get("device_name", "?")}


def time_configs(ranks, args, plan, state, sizes, out):
    """The timing job of each configuration that has a run left and no timing at this world
    size, recorded in the state as each finishes -> 0, or a failed job's exit code."""
    timings = state.setdefault("timing", {})
    for name, _, _ in plan["configs"]:
        runs = [r for r in plan["runs"] if r.rsplit("_s", 1)[0] == name]
        argv = plan["runs"][runs[0]]
        done = timings.get(name, {})
        if all(finished(out / r, sizes[r][0].max_steps) for r in runs) or \
                (done.get("world"), done.get("flags")) == (ranks.world, unseeded(argv)):
            continue
        folder = out / "timing" / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        print(f"timing {name}: {args.timing_steps} steps ({sweep.rel(folder / 'stdout.txt')})", flush=True)
        t0 = time.time()
        code = launch(ranks, timing_argv(argv, out, name, args.timing_steps), folder / "stdout.txt", show=False)
        if code:
            print(f"error: the timing job of {name} failed (exit {code}): see {sweep.rel(folder / 'stdout.txt')}; fix "
                  f"it, or pass --no_timing to start the runs without it", file=sys.stderr, flush=True)
            return code
        t = timings[name] = {**read_timing(folder, time.time() - t0, ranks.world), "flags": unseeded(argv)}
        Path(folder, "ckpt.pt").unlink(missing_ok=True)  # scratch: 1.6 GB at qwen-134m
        save_state(out, state)
        print(f"timing {name}: {t['s_per_step']:.3f} s/step, {t['tok_s']:,.0f} tok/s, "
              + ("" if t["mfu"] is None else f"MFU {t['mfu']:.1%}, ")
              + f"{t['mem_gb']:.2f} GB, start-up {t['startup_s']:.0f} s", flush=True)
    return 0


# ----------------------------------------------------------------------------- reading the runs

def read_run(run_dir):
    """One finished run's numbers: analyze.load_run's, the final validation loss, the median
    tok/s, MFU and FLOP/s per device over the steps after the first (it pays for compilation),
    the peak memory, its config.json, eval.json and (--hellaswag_file) hellaswag.json."""
    run = analyze.load_run(run_dir)
    steps = [r for r in run["steps"] if "tok_s" in r]
    later = [r for r in steps if r["step"] > 1] or steps

    def median(key):
        values = [r[key] for r in later if key in r]
        return statistics.median(values) if values else None

    def read(name):
        return json.loads(Path(run_dir, name).read_text()) if Path(run_dir, name).exists() else None
    return {"run": run, "config": read("config.json") or {}, "evals": [(r["step"], r["val"]) for r in run["evals"]],
            "final_val": run["evals"][-1]["val"] if run["evals"] else None,
            "tok_s": median("tok_s"), "mfu": median("mfu"), "flop_s": median("flop_s"),
            "mem_gb": max((r["mem_gb"] for r in steps if "mem_gb" in r), default=None),
            "eval": read("eval.json"), "hellaswag": read("hellaswag.json")}


def collect(out, plan, sizes):
    """{config: None before any of its runs has finished, else {"runs": {seed: read_run},
    "seeds", "val", "deltas" (paired, from `full`), "delta", "hw", "tok_s", "mfu", "flop_s",
    "mem_gb", "tok_rel", "mem_rel" (to `full`)}}: seed means, memory the largest. `runs` has
    the shape experiments/figures.py draws (sweep.config_stats's)."""
    stats = {}
    for name, attn, flags in plan["configs"]:
        runs = {seed: read_run(out / f"{name}_s{seed}") for seed in plan["seeds"]
                if finished(out / f"{name}_s{seed}", sizes[f"{name}_s{seed}"][0].max_steps)}
        stats[name] = {"runs": runs, "seeds": sorted(runs)} if runs else None
    full = stats.get("full")
    for name, s in stats.items():
        if s is None:
            continue
        rows = [s["runs"][k] for k in s["seeds"]]

        def mean(key):
            values = [r[key] for r in rows if r[key] is not None]
            return statistics.fmean(values) if values else None
        s["deltas"] = [s["runs"][k]["final_val"] - full["runs"][k]["final_val"]
                       for k in s["seeds"] if full and k in full["runs"]]
        s["delta"], s["sd"], s["hw"] = sweep.paired(s["deltas"]) if name != "full" else (None, None, None)
        s.update(val=mean("final_val"), tok_s=mean("tok_s"), mfu=mean("mfu"), flop_s=mean("flop_s"),
                 mem_gb=max((r["mem_gb"] for r in rows if r["mem_gb"] is not None), default=None),
                 device=rows[0]["config"].get("device_name", rows[0]["run"]["device"]))
    for s in stats.values():
        if s is not None:
            s["tok_rel"] = s["tok_s"] / full["tok_s"] if full and full["tok_s"] and s["tok_s"] else None
            s["mem_rel"] = s["mem_gb"] / full["mem_gb"] if full and full["mem_gb"] and s["mem_gb"] else None
    return stats


# ----------------------------------------------------------------------------- the Markdown

def _f(x, spec, none="–"):
    return none if x is None else format(x, spec)


def _flags(attn, flags):
    return " ".join(f"--{k}={v}" for k, v in {"attn": attn, **flags}.items())


def mfu_cell(s):
    """MFU where flops.py knows the device's peak, else the FLOP/s per device it reached."""
    if s["mfu"] is not None:
        return f"{s['mfu']:.1%}"
    return "–" if s["flop_s"] is None else f"n/a on {s['device']}: {s['flop_s'] / 1e12:.3g} TFLOP/s"


def hellaswag_cells(r):
    """[acc, acc_norm, items] of a run: the study's hellaswag.json, else train.py's eval.json."""
    h = (r["hellaswag"] or {}).get("hellaswag") or (r["eval"] or {}).get("hellaswag")
    if h is None:
        return ["not run (train.py runs it on CUDA; elsewhere --hellaswag_file=PATH)", "–", "–"]
    if "skipped" in h:
        return [f"skipped: {h['skipped'][:100]}", "–", "–"]
    return [f"{h['acc']:.4f}", f"{h['acc_norm']:.4f}", f"{h['items']:,}" + (" (file)" if r["hellaswag"] else "")]


def results_markdown(out, plan, sizes, md_dir):
    """(RESULTS_GPU.md's text from the run folders under out, with links relative to md_dir;
    the statistics it quotes)."""
    stats = collect(out, plan, sizes)
    tc = next(iter(sizes.values()))[0]
    shared = next(iter(plan["runs"].values()))
    finished_runs = [r for s in stats.values() if s for r in s["runs"].values()]
    devices = sorted({f"{r['config'].get('device_name', '?')} x {r['config'].get('world_size', '?')} process(es), "
                      f"torch {r['config'].get('torch', '?')}" for r in finished_runs})
    L = ["# The papers' comparison on a GPU node", "",
         f"Generated by `experiments/gpu_study.py` from the run folders under `{sweep.rel(out)}/` "
         f"({len(finished_runs)} of {len(plan['runs'])} runs finished); no number below is typed by hand except the "
         f"papers' own. The same command continues the study; `--results_only` rewrites this file and its figures.", "",
         "## Setup", "",
         f"- **Each run**: preset `{plan['preset']}`: the `{tc.model}` model, {tc.max_steps:,} steps of "
         f"{tc.total_batch_tokens:,} tokens ({tc.max_steps * tc.total_batch_tokens:,} tokens) at seq_len {tc.seq_len}, "
         f"lr {tc.lr:g} (warm-up {tc.warmup_steps}, cosine to {tc.min_lr_frac:g} x), on `{tc.data_dir}`; validation on "
         f"its first {tc.val_tokens:,} val tokens every {tc.eval_every} steps. train.py flags of every run: "
         f"`{' '.join(a for a in shared if not a.startswith(('--attn=', '--seed=')))}` plus the configuration's.",
         f"- **Devices**: {'; '.join(devices) or 'none yet'}.",
         f"- **Paired seeds**: {', '.join(map(str, plan['seeds']))}. At one seed every run reads the same batches and "
         f"starts from `full`'s values of every parameter it shares with it (`experiments/paired.py`), so each Δ is "
         f"taken against `full` at the same seed; over several seeds, mean ± the 95% half-width (t quantile x sample "
         f"std / sqrt(n)).", "",
         "## Every configuration", "",
         "Final validation loss (nats per token) and its Δ from `full`. tok/s: the median per-step throughput of all "
         "processes together (step 1 left out: compilation); MFU: per device against its dense bf16 peak (flops.py; "
         "A100 / H100 / H200, elsewhere the FLOP/s reached); peak memory: train.py's `mem_gb` (CUDA: "
         "max_memory_allocated on rank 0; CPU: peak RSS). All from each run's log.jsonl, averaged over seeds "
         "(memory: the largest).", "",
         "| config | flags | seeds | val loss | Δ vs full | tok/s | vs full | MFU | peak memory | vs full |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for name, attn, flags in plan["configs"]:
        s = stats[name]
        if s is None:
            L.append(f"| {name} | `{_flags(attn, flags)}` | – | pending | – | – | – | – | – | – |")
            continue
        delta = "baseline" if name == "full" else sweep._delta(s) if s["delta"] is not None else "– (no full run)"
        L.append(f"| {name} | `{_flags(attn, flags)}` | {len(s['seeds'])} | {s['val']:.4f} | {delta} | "
                 f"{_f(s['tok_s'], ',.0f')} | {_f(s['tok_rel'], '.2f')}x | {mfu_cell(s)} | {_f(s['mem_gb'], '.2f')} GB | "
                 f"{_f(s['mem_rel'], '.2f')}x |")
    link = lambda p: os.path.relpath(p, md_dir)  # noqa: E731
    L += [""] + paper_section(stats, plan) + position_section(stats, plan, tc.seq_len) + figure_section(out, link)
    return "\n".join(L) + "\n", stats


def paper_section(stats, plan):
    names = {c[0] for c in plan["configs"]}
    L = ["## The papers' numbers beside ours", "",
         "Every row of the papers' tables (experiments/sweep.py's PAPER_ROWS) whose configuration this study ran. "
         "Paper Δ: the row's loss minus its own paper's baseline. Ours: the final validation loss, the Δ from "
         "`full` and the cost relative to `full`, from the table above. Verdict: *same sign* / *opposite sign* "
         "when our 95% interval excludes 0, *not resolved* when it does not (both need several seeds).", "",
         "| paper | paper's row | val loss | paper Δ | memory | speed | our config | our val loss | our Δ vs full "
         "| our tok/s vs full | our peak mem vs full | verdict |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for paper, row, loss, pm, mem, speed, cfg in sweep.PAPER_ROWS:
        if cfg not in names:
            continue
        s, base = stats.get(cfg), cfg == "full"
        pdelta = float(loss) - sweep.PAPER_BASELINES[paper]
        ours = "pending" if s is None else "baseline" if base else sweep._delta(s) if s["delta"] is not None else "–"
        verdict = "–" if base else sweep.verdict(s["delta"] if s else None, s["hw"] if s else None, pdelta)
        L.append(f"| {paper} | {row} | {loss}{f' ± {pm:.3f}' if pm else ''} | {'–' if base else f'{pdelta:+.4f}'} | "
                 f"{mem or '–'} | {speed or '–'} | {cfg} | {_f(s and s['val'], '.4f', 'pending')} | {ours} | "
                 f"{_f(s and s['tok_rel'], '.2f')}x | {_f(s and s['mem_rel'], '.2f')}x | {verdict} |")
    return L + ["", "Papers: " + "; ".join(sweep.PAPERS.values()) + ".", ""]


def position_section(stats, plan, T):
    ranges = sweep.position_ranges(T)
    L = ["## Loss by position, bits per byte and HellaSwag, run by run", "",
         f"From each run's eval.json (evaluate.py, which train.py runs on the final weights): the mean loss (nats per "
         f"token) over ranges of positions of the validation sequences at T = {T}, and of sequences of 2T and 4T "
         f"(their last bucket: positions never trained on); bits per byte at T (the summed loss over the text's UTF-8 "
         f"bytes / ln 2); HellaSwag validation (acc: the ending of least summed loss; acc_norm: of least loss per "
         f"token; chance 0.25) from train.py's final evaluation, or, marked *(file)*, the study's evaluation of "
         f"`--hellaswag_file` (hellaswag.json).", "",
         "| run | seqs | nats/token | bits/byte | " + " | ".join(lab for lab, *_ in ranges)
         + " | HellaSwag acc | acc_norm | items |",
         "|---|---|---|---|" + "---|" * len(ranges) + "---|---|---|"]
    for name, *_ in plan["configs"]:
        for seed in plan["seeds"]:
            r = (stats.get(name) or {"runs": {}})["runs"].get(seed)
            if r is None:
                L.append(f"| {name}_s{seed} | pending |" + " – |" * (len(ranges) + 5))
                continue
            ev = r["eval"] or {}
            at_T = next((p for p in ev.get("positions") or [] if p.get("factor") == 1), {})
            cells = [_f(sweep.range_loss(ev, f, a, b), ".4f") for _, f, a, b in ranges]
            L.append(f"| {name}_s{seed} | {at_T.get('n_seq', '–')} | {_f(ev.get('nats_per_token'), '.4f')} | "
                     f"{_f(ev.get('bits_per_byte'), '.4f')} | " + " | ".join(cells + hellaswag_cells(r)) + " |")
    return L + [""]


def figure_section(out, link):
    L = ["## Figures", ""]
    for path, caption in (
            (out / "figures" / "loss.png", "validation loss per configuration (seed mean, band: min..max) and its "
                                           "paired Δ from `full` at every evaluation"),
            (out / "figures" / "positions.png", "loss by position on the longest evaluated sequences, and each "
                                                "variant's paired Δ from `full`"),
            (out / "analysis" / "summary.md", "analyze.py on every run: gate statistics over training, gates by "
                                              "token category, attention maps, what nsa, moba and indexer selected")):
        if path.exists():
            L += [f"- [analyze.py's summary]({link(path)}): {caption}" if path.suffix == ".md"
                  else f"![{caption}]({link(path)})", ""]
    return L if len(L) > 2 else L + ["Drawn when the study finishes (or with `--results_only`).", ""]


def write_results(out, plan, sizes, md_path, with_figures=False):
    """The Markdown (and, with_figures, its figures) from the run folders; -> the statistics."""
    md_path = Path(md_path)
    text, stats = results_markdown(out, plan, sizes, md_path.parent)
    if with_figures and any(stats.values()):
        (out / "figures").mkdir(parents=True, exist_ok=True)
        configs = [tuple(c) for c in plan["configs"]]
        T = next(iter(sizes.values()))[0].seq_len
        figures.loss_curves(stats, configs, out / "figures" / "loss.png", families=FAMILIES, unit="nats / token")
        figures.positions_figure(stats, configs, T, out / "figures" / "positions.png", unit="tokens")
        analyze.analyze([r["run"] for s in stats.values() if s for r in s["runs"].values()],
                        {**analyze.DEFAULTS, "out_dir": str(out / "analysis")})
        text, stats = results_markdown(out, plan, sizes, md_path.parent)  # now with the figures' links
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(text)
    return stats


# ----------------------------------------------------------------------------- main

def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
                                epilog="Any other --key=value is a train.py flag given to every run (and part of the plan).")
    p.add_argument("--out_dir", default=None, help=f"the study's folder (default {sweep.rel(OUT)}; --tiny: OUT/tiny)")
    p.add_argument("--configs", default=None, help="configuration names, comma-separated (default: every one of "
                   "sweep.TEXT_CONFIGS; --tiny: full,local,dsa)")
    p.add_argument("--seeds", default="0", help="paired seeds, comma-separated (default 0)")
    p.add_argument("--preset", default=None, help=f"train.py's preset (default {PRESET}; --tiny: cpu)")
    p.add_argument("--data_dir", default=None, help="the shards (default: the preset's, data/fineweb10B)")
    p.add_argument("--tiny", action="store_true", help="on a CPU: the tiny model, 8 steps, 3 configurations")
    p.add_argument("--dry_run", action="store_true", help="print the plan and what is missing; run and write nothing")
    p.add_argument("--results_only", action="store_true", help="rewrite the Markdown and figures from the logs")
    p.add_argument("--replan", action="store_true", help="make this the recorded plan (run folders whose flags "
                   "change move to OUT/replaced/)")
    p.add_argument("--no_timing", action="store_true", help="skip each configuration's timing job")
    p.add_argument("--timing_steps", type=int, default=None, help="steps of each timing job (default 10; --tiny: 3)")
    p.add_argument("--hellaswag_file", default="", help="score this HellaSwag items file with evaluate.py after "
                   "each run, instead of train.py's downloaded copy")
    p.add_argument("--results_md", default=None, help="the Markdown (default OUT/RESULTS_GPU.md)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs the estimates are for (default: this launch's "
                   "processes, WORLD_SIZE)")
    p.add_argument("--gpu", default="H100", help="the GPU the FLOP-model estimate assumes until a timing job has "
                   "run on one (a name in flops.PEAK_BF16)")
    p.add_argument("--assumed_mfu", type=float, default=ASSUMED_MFU, help="the MFU of the FLOP-model estimate")
    args, rest = p.parse_known_args(argv)
    known, given = train_flag_names(), {}
    for arg in rest:
        key, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if key in OWN_FLAGS:
            p.error(f"--{key} is set by the study for each run; use {OWN_FLAGS[key]}")
        if key not in known:
            p.error(f"unknown flag {arg!r}: neither a flag of gpu_study.py (see --help) nor a train.py key")
        given[key] = value if eq else "True"
    tiny = TINY if args.tiny else {}
    args.flags = {**tiny.get("flags", {}), **given}
    args.preset = args.preset or tiny.get("preset", PRESET)
    args.out_dir = Path(args.out_dir or (OUT / "tiny" if args.tiny else OUT)).resolve()
    args.results_md = Path(args.results_md or args.out_dir / "RESULTS_GPU.md")
    args.timing_steps = args.timing_steps or tiny.get("timing_steps", 10)
    names = [c[0] for c in CONFIGS]
    args.configs = (args.configs or tiny.get("configs") or ",".join(names)).split(",")
    if unknown := [c for c in args.configs if c not in names]:
        p.error(f"unknown configuration(s) {', '.join(unknown)}; valid: {', '.join(names)}")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds={args.seeds}: expected integers, comma-separated")
    return args


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    ranks = Ranks()
    if ranks.rank != 0:
        return follow(ranks)
    return stop_all(ranks, lead(ranks, args))


def fail(message):
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 2


def lead(ranks, args):
    """Rank 0: the plan and its checks, the timing jobs, the runs, the Markdown -> exit code."""
    out = args.out_dir
    state = load_state(out)
    if args.results_only:
        if state is None:
            return fail(f"no study in {sweep.rel(out)} (no {STATE}); pass the study's --out_dir")
        write_results(out, state["plan"], run_sizes(state["plan"]), args.results_md, with_figures=True)
        print(f"wrote {sweep.rel(args.results_md)}")
        return 0
    plan = make_plan(args)
    if pending := {name: why for name, attn, flags in plan["configs"] if (why := sweep.unavailable(attn, flags))}:
        return fail("not buildable in this checkout: " + "; ".join(f"{n}: {w}" for n, w in pending.items())
                    + "; leave them out with --configs")
    if state is not None and (changes := plan_changes(state["plan"], plan)) and not args.replan:
        return fail(f"{sweep.rel(out / STATE)} records another plan: {'; '.join(changes)}. Nothing was run or changed. "
                    f"Keep the recorded plan (drop those changes), choose a new --out_dir, or pass --replan to make "
                    f"this the plan (run folders whose flags change move to {sweep.rel(out / 'replaced')}/)")
    sizes = run_sizes(plan)
    gpus = args.gpus or ranks.world
    if args.dry_run:
        print_plan(args, plan, state, sizes, gpus, out)
        lacks = missing(args, sizes)
        print("missing\n  " + "\n  ".join(lacks) if lacks else "missing     nothing: a real run can start")
        print(f"dry run: nothing was run or written; a real run would {'continue' if state else 'start'} the study "
              f"in {sweep.rel(out)}" + (" under the new plan (--replan)" if state and args.replan else ""))
        return 0
    if device_of(next(iter(sizes.values()))[0]) == "cpu" and "device" not in args.flags and args.preset != "cpu":
        return fail(f"no GPU here, and preset {args.preset} is the GPU study; run it on a GPU node, try it on this "
                    f"CPU with --tiny, or pass --device=cpu to insist")
    if state is None or args.replan:
        moved = replan(out, state["plan"], plan) if state else []
        if moved:
            print(f"replan: moved {len(moved)} run folder(s) whose flags changed: {', '.join(moved)}")
        state = {"plan": plan, "timing": (state or {}).get("timing", {}), "runs": (state or {}).get("runs", {}),
                 "command": " ".join(["python", sweep.rel(__file__)] + sys.argv[1:])}
        save_state(out, state)
    print_plan(args, plan, state, sizes, gpus, out)
    if not args.no_timing:
        if code := time_configs(ranks, args, plan, state, sizes, out):
            return code
        print_plan(args, plan, state, sizes, gpus, out)
    t_study = time.time()
    for i, (run, argv) in enumerate(plan["runs"].items()):
        run_dir, head = out / run, f"[{i + 1}/{len(plan['runs'])}] {run}"
        if finished(run_dir, sizes[run][0].max_steps):
            print(f"{head}: done before", flush=True)
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            child = ["experiments/paired.py"] + argv + [f"--out_dir={sweep.rel(run_dir)}", "--resume=auto"]
            child += ["--hellaswag=false"] if args.hellaswag_file else []
            Path(run_dir, "command.txt").write_text(" ".join(["python"] + child) + "\n")
            print(f"{head}: python {' '.join(child)}", flush=True)
            t0 = time.time()
            code = launch(ranks, child, run_dir / "stdout.txt")
            state["runs"][run] = state["runs"].get(run, 0.0) + time.time() - t0  # seconds, over every job of the run
            save_state(out, state)
            if code:
                return child_failed(run, run_dir, code)
            print(f"{head}: finished in {(time.time() - t0) / 3600:.2f} h (study: {(time.time() - t_study) / 3600:.2f} h)",
                  flush=True)
        if args.hellaswag_file and not Path(run_dir, "hellaswag.json").exists():
            if code := score_hellaswag(ranks, args, run, run_dir):
                return code
        write_results(out, plan, sizes, args.results_md)
    write_results(out, plan, sizes, args.results_md, with_figures=True)
    print(f"study finished; wrote {sweep.rel(args.results_md)}", flush=True)
    return 0


def score_hellaswag(ranks, args, run, run_dir):
    """HellaSwag on --hellaswag_file's items: evaluate.py on the run's checkpoint, on every
    rank (the items are split over them) -> RUN/hellaswag.json; -> its exit code."""
    child = ["evaluate.py", f"--ckpt={sweep.rel(run_dir)}", "--n_seq=0", "--hellaswag=True",
             f"--hellaswag_file={Path(args.hellaswag_file).resolve()}", f"--out={sweep.rel(run_dir / 'hellaswag.json')}"]
    code = launch(ranks, child, run_dir / "stdout.txt")
    if code:
        fail(f"HellaSwag on {run} failed (exit {code}): see {sweep.rel(run_dir / 'stdout.txt')}; fix it and rerun "
             f"the same command (the finished run is kept)")
    return code


def child_failed(run, run_dir, code):
    if code in (128 + signal.SIGTERM, 128 + signal.SIGINT):
        print(f"stopped during {run}: its checkpoint is in {sweep.rel(run_dir)}; the same command continues the "
              f"study from there", file=sys.stderr, flush=True)
    else:
        fail(f"{run} failed (exit {code}): see {sweep.rel(run_dir / 'stdout.txt')}; fix the cause and rerun the same "
             f"command (finished runs are kept, this one resumes from its last checkpoint)")
    return code


if __name__ == "__main__":
    sys.exit(main())
