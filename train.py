"""Train any attention variant on token shards, on one CPU or many GPUs.

    python train.py --attn=dsa                                   # CPU default: tiny model
    torchrun --nproc_per_node=8 train.py --preset=qwen-134m --attn=asga
    python train.py --out_dir=out/run --resume=True              # continue a run

Every TrainConfig and ModelConfig field is a `--key=value` override. The run folder
(`out_dir`) holds config.json, log.jsonl (one JSON record per step, with gate statistics at
each evaluation, read by analyze.py) and ckpt.pt. SIGTERM / Ctrl-C finish the current step,
write a checkpoint of it and exit with 128 + the signal number (143 / 130), so schedulers
see an interrupted run (torchrun then reports its own SignalException and exits 1); a second
Ctrl-C on a single process abandons the step at once without a checkpoint.
"""
import ctypes
import hashlib
import json
import math
import os
import random
import resource
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

# Before torch loads OpenMP: its threads otherwise spin while waiting, and on a CPU shared
# with other processes (2-core dev machines, CI) that made training 10x slower (measured).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from attention import VARIANTS
from data import DistributedLoader, ShardError, ValLoader, check_vocab, tokenizer_of
from model import PRESETS, Model, ModelConfig


@dataclass
class TrainConfig:
    preset: str = "cpu"  # a name in TRAIN_PRESETS; its values are the defaults of this run
    model: str = "tiny"  # size preset in model.PRESETS; single model fields override it
    data_dir: str = "data/fineweb"
    out_dir: str = "out/run"
    seed: int = 1337
    max_steps: int = 400  # optimizer steps; the lr schedule ends here
    stop_step: int = 0  # end this job after this step, schedule unchanged (0: at max_steps)
    seq_len: int = 128
    batch_size: int = 8  # sequences per micro-step per process
    total_batch_tokens: int = 1024  # the global batch, whatever the number of processes
    lr: float = 3e-3
    min_lr_frac: float = 0.1  # cosine decays to lr * min_lr_frac at max_steps
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm (0: off)
    eval_every: int = 100
    val_tokens: int = 16384  # the fixed prefix of the val shard used at every evaluation
    gate_batch: int = 4  # val sequences the gate statistics are collected on
    target_loss: float = 0.0  # log the first step whose val loss is <= this (0: off)
    ckpt_every: int = 200
    resume: bool = False
    device: str = "auto"  # auto | cpu | cuda
    compile: bool = False  # torch.compile the model (worth it on GPU)


# Named setups. The papers' presets (002-004) run the seeds' 134M model on GPUs. The seeds
# give lr, decay and accumulation but not the context length or the global batch in tokens,
# so those below are our choices: 002's 32768-token sequences are replaced by 2048
# (32 sequences x 2048 x 16 accumulation = 1M tokens per step on 8 GPUs), 003's "batch
# size 32" is 32 sequences of 1024, 004's "batch size 512" is 512 sequences of 1024.
TRAIN_PRESETS = {
    # The main CPU command, on byte shards (data.py --tokenizer=byte): 4.1M bytes through the
    # 0.9M-parameter `bytes` model. On the FineWeb slice: val 1.84 nats per byte against a
    # unigram baseline of 3.25, samples made of English words (assets/sample_cpu.txt); 580 s
    # of CPU time, i.e. about 5 minutes on 2 idle cores (measured on a loaded machine: 21 min).
    "cpu": dict(model="bytes", seq_len=256, batch_size=16, total_batch_tokens=4096, lr=3e-3,
                warmup_steps=50, max_steps=1000, eval_every=100, val_tokens=65536, ckpt_every=250),
    "qwen-134m": dict(model="qwen-134m", seq_len=1024, batch_size=16, total_batch_tokens=2**19,
                      lr=6e-4, warmup_steps=200, max_steps=10000, eval_every=250,
                      val_tokens=2**20, ckpt_every=1000, compile=True),
    "002": dict(model="qwen-134m", seq_len=2048, batch_size=4, total_batch_tokens=32 * 2048 * 16,
                lr=3e-4, weight_decay=0.1, max_steps=399, warmup_steps=40, eval_every=50,
                val_tokens=2**20, ckpt_every=100, compile=True),
    "003": dict(model="qwen-134m", seq_len=1024, batch_size=4, total_batch_tokens=32 * 1024,
                lr=6e-4, max_steps=50000, warmup_steps=1000, eval_every=1000,
                val_tokens=2**20, ckpt_every=2000, compile=True),
    "004": dict(model="qwen-134m", seq_len=1024, batch_size=16, total_batch_tokens=512 * 1024,
                lr=3e-4, beta2=0.98, max_steps=5000, warmup_steps=250, eval_every=250,
                val_tokens=2**20, ckpt_every=500, compile=True),
}
TRAIN_FIELDS = {f.name: f for f in fields(TrainConfig)}
MODEL_FIELDS = {f.name: f for f in fields(ModelConfig)}


def fail(msg, code=2):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(code)


def convert(key, raw, field):
    """A command-line string -> the field's type; bools accept True/False/true/false/1/0."""
    kind = field.type if isinstance(field.type, type) else type(field.default)
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return raw.lower() in ("true", "1")
        if kind is int:
            value = float(raw.replace("_", ""))  # accept 1e6 and 1_000_000 too
            if not value.is_integer():
                raise ValueError
            return int(value)
        return kind(raw)
    except ValueError:
        fail(f"--{key}={raw}: expected {kind.__name__}" + (" (True/False/1/0)" if kind is bool else ""))


def parse_args(argv):
    """--key=value strings -> (TrainConfig, ModelConfig): preset, then the overrides."""
    if "-h" in argv or "--help" in argv:
        print(f"{__doc__}\ntraining keys: {', '.join(TRAIN_FIELDS)}\nmodel keys: {', '.join(MODEL_FIELDS)}"
              f"\npresets: {', '.join(TRAIN_PRESETS)}; model sizes: {', '.join(PRESETS)}; --attn: {', '.join(VARIANTS)}")
        sys.exit(0)
    overrides = {}
    for arg in argv:
        if not arg.startswith("--"):
            fail(f"unexpected argument {arg!r}; use --key=value")
        key, eq, raw = arg[2:].partition("=")
        if not eq:  # a bare --flag means True for bool fields
            field = TRAIN_FIELDS.get(key) or MODEL_FIELDS.get(key)
            if field is None or field.type is not bool:
                fail(f"--{key} needs a value; use --{key}=VALUE")
            raw = "True"
        overrides[key] = raw
    preset = overrides.pop("preset", "cpu")
    if preset not in TRAIN_PRESETS:
        fail(f"unknown --preset={preset}; valid presets: {', '.join(TRAIN_PRESETS)}")
    train, model = {"preset": preset}, {}
    for key, value in TRAIN_PRESETS[preset].items():
        (train if key in TRAIN_FIELDS else model)[key] = value
    for key, raw in overrides.items():
        if key in TRAIN_FIELDS:
            train[key] = convert(key, raw, TRAIN_FIELDS[key])
        elif key in MODEL_FIELDS:
            model[key] = convert(key, raw, MODEL_FIELDS[key])
        else:
            fail(f"unknown config key --{key}\n  valid training keys: {', '.join(TRAIN_FIELDS)}"
                 f"\n  valid model keys: {', '.join(MODEL_FIELDS)}")
    tc = TrainConfig(**train)
    try:  # the data folder's tokenizer sets the vocabulary unless --vocab_size does
        n_ids = tokenizer_of(tc.data_dir)[1]
        model.setdefault("vocab_size", -(-n_ids // 64) * 64)  # a multiple of 64: GPT-2's 50257 -> 50304
        check_vocab(tc.data_dir, model["vocab_size"])
    except ShardError as e:
        fail(str(e), code=1)
    if tc.model not in PRESETS:
        fail(f"unknown --model={tc.model}; valid model presets: {', '.join(PRESETS)}")
    if model.get("attn", "full") not in VARIANTS:
        fail(f"unknown --attn={model['attn']}; valid attention variants: {', '.join(VARIANTS)}")
    if tc.device not in ("auto", "cpu", "cuda") and not tc.device.startswith("cuda:"):
        fail(f"unknown --device={tc.device}; valid: auto, cpu, cuda")
    for key in ("max_steps", "seq_len", "batch_size", "eval_every", "ckpt_every", "total_batch_tokens"):
        if getattr(tc, key) < 1:
            fail(f"--{key}={getattr(tc, key)}: must be at least 1")
    try:
        mc = ModelConfig(**{**PRESETS[tc.model], **model})
    except ValueError as e:
        fail(str(e))
    return tc, mc


def lr_at(step, tc):
    """Linear warm-up to lr over warmup_steps, then cosine down to lr * min_lr_frac."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = min(1.0, (step - tc.warmup_steps) / max(1, tc.max_steps - tc.warmup_steps))
    min_lr = tc.lr * tc.min_lr_frac
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (tc.lr - min_lr)


def make_optimizer(model, tc, device):
    """AdamW; weight decay only on matrices. Norm weights, biases and gains (all 1-D) and the
    embedding (also the tied head) are not decayed, as in nanoGPT / GPT-3. The fused kernel
    exists on CPU too and is ~8x faster there than the default for-each one."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a tied weight once
        (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": tc.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), fused=True)


def save_checkpoint(path, obj):
    """Atomic: write a temporary file in the same folder, fsync, rename over the old one, so a
    kill at any moment leaves either the previous checkpoint or the new one, never half."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)


def peak_memory_gb(device):
    """GPU: torch.cuda.max_memory_allocated. CPU: the process's peak RSS (getrusage)."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss * (1 if sys.platform == "darwin" else 1024) / 1e9


def keep_freed_memory():
    """CPU, Linux/glibc: every step frees and re-allocates the (B*T, vocab) logits and their
    gradient (200 MB each at the CPU default). glibc returns blocks that big to the OS on
    free, and faulting them in again cost half of each step in the kernel; raising the mmap
    and trim thresholds keeps them in the heap (1.5k -> 2.5k tok/s measured, peak RSS
    1.3 -> 2.0 GB)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to tune
        return
    libc.mallopt(-3, 2**30)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD


def git_commit():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def param_hash(model):
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def main(argv=None):
    tc, mc = parse_args(sys.argv[1:] if argv is None else argv)

    # -- processes and device: torchrun sets RANK / LOCAL_RANK / WORLD_SIZE
    ddp = "RANK" in os.environ
    rank, local_rank, world = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    device = tc.device if tc.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        device = f"cuda:{local_rank}"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()
    if ddp:
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    torch.manual_seed(tc.seed)
    np.random.seed(tc.seed)
    random.seed(tc.seed)
    # bf16 autocast on GPU only: CPU runs (tests, laptops) stay float32 and reproducible.
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else nullcontext()

    micro_tokens = tc.batch_size * tc.seq_len * world
    if tc.total_batch_tokens % micro_tokens:
        fail(f"total_batch_tokens={tc.total_batch_tokens} is not divisible by batch_size * seq_len * "
             f"world_size = {tc.batch_size} * {tc.seq_len} * {world} = {micro_tokens}; choose "
             f"--total_batch_tokens as a multiple of {micro_tokens} or change --batch_size")
    accum = tc.total_batch_tokens // micro_tokens
    try:
        loader = DistributedLoader(tc.data_dir, tc.batch_size, tc.seq_len, rank, world, tc.seed)
        val_loader = ValLoader(tc.data_dir, tc.batch_size, tc.seq_len, tc.val_tokens, rank, world)
        tokenizer = tokenizer_of(tc.data_dir)[0]  # recorded so that sample.py decodes with it
    except ShardError as e:
        fail(str(e), code=1)

    os.makedirs(tc.out_dir, exist_ok=True)
    ckpt_path, log_path = os.path.join(tc.out_dir, "ckpt.pt"), os.path.join(tc.out_dir, "log.jsonl")
    if not tc.resume and os.path.exists(ckpt_path):
        fail(f"{tc.out_dir} already holds a run (ckpt.pt); pass --resume=True to continue it, "
             f"or choose another --out_dir")
    if tc.resume and not os.path.exists(ckpt_path):
        fail(f"--resume=True but {ckpt_path} does not exist; drop --resume to start a new run")

    model = Model(mc).to(device)
    raw_model = model  # the unwrapped, uncompiled module: its state dict goes in checkpoints
    optimizer = make_optimizer(model, tc, device)
    step = 0  # optimizer steps completed
    if tc.resume:
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)  # our own file (RNG states are not tensors)
        changed = {k: (v, getattr(mc, k)) for k, v in ckpt["model_config"].items() if getattr(mc, k) != v}
        if changed:
            fail(f"the model config differs from the checkpoint's: {changed} (saved, now); resume with "
                 f"the same model settings as the run in {tc.out_dir}")
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loader"])
        step = ckpt["step"]
        torch.set_rng_state(ckpt["rng"]["torch"].cpu())
        np.random.set_state(ckpt["rng"]["numpy"])
        random.setstate(ckpt["rng"]["python"])
        if device.startswith("cuda") and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"].cpu())
        del ckpt

    gate_x = next(iter(val_loader))[0][: tc.gate_batch].to(device)  # (gate_batch, T), fixed
    if ddp:
        # DDP needs to know about parameters that get no gradient (e.g. a variant's ablated
        # gate); probe once on the raw model instead of paying find_unused every step.
        raw_model(gate_x[:1])[0].sum().backward()
        unused = any(p.grad is None for p in raw_model.parameters())
        raw_model.zero_grad(set_to_none=True)
    if tc.compile:
        model = torch.compile(model)
    if ddp:
        model = DDP(model, device_ids=[local_rank] if device.startswith("cuda") else None,
                    find_unused_parameters=unused)
    eval_model = model.module if ddp else model

    run_info = {"git_commit": git_commit(), "torch": torch.__version__, "device": device,
                "world_size": world, "grad_accum": accum, "num_params": raw_model.num_params(), "tokenizer": tokenizer,
                "memory": "cuda max_memory_allocated" if device.startswith("cuda") else "cpu peak RSS (getrusage)",
                "train": asdict(tc), "model": asdict(mc)}
    if master:
        log(json.dumps(run_info, indent=1))
        log(f"{raw_model.num_params() / 1e6:.2f}M parameters | grad accumulation {accum} | {world} process(es) on {device}")
        with open(os.path.join(tc.out_dir, "config.json"), "w") as f:
            json.dump(run_info, f, indent=1)
        records = []
        if tc.resume and os.path.exists(log_path):  # drop records of steps the checkpoint does not hold
            with open(log_path) as f:
                for line in f:
                    try:
                        if json.loads(line).get("step", 0) <= step:
                            records.append(line)
                    except json.JSONDecodeError:  # a line cut short by a SIGKILL
                        pass
        with open(log_path + ".tmp", "w") as f:
            f.writelines(records)
        os.replace(log_path + ".tmp", log_path)
    logfile = open(log_path, "a") if master else None

    def write_log(record):
        if master:
            logfile.write(json.dumps(record) + "\n")
            logfile.flush()

    write_log({"event": "resume" if tc.resume else "start", "step": step, "time": time.time(), **run_info})

    @torch.no_grad()
    def evaluate():
        """Mean val loss over the fixed val tokens (all ranks), plus gate stats on rank 0."""
        eval_model.eval()
        total = torch.zeros((), device=device)
        for x, y in val_loader:
            with autocast:
                total += eval_model(x.to(device), y.to(device))[1].float()
        total /= len(val_loader)
        if ddp:
            dist.all_reduce(total)  # gloo has no AVG: sum, then divide
            total /= world
        gates = {}
        if master:
            raw_model.eval()
            raw_model.record_gates(True)
            with autocast:
                raw_model(gate_x)
            gates = raw_model.gate_stats()
            raw_model.record_gates(False)
        eval_model.train()
        return total.item(), gates

    def diverged(problem, at_step):
        write_log({"event": "non_finite", "step": at_step, "problem": problem})
        fail(f"{problem}; stopping without a checkpoint, so {ckpt_path} still holds the last good "
             f"step; lower --lr or raise --warmup_steps, then continue with --resume=True", code=1)

    def checkpoint():
        # A finite loss can still be followed by an update that overflows the weights; never
        # replace a good checkpoint with those (checked on every rank: the weights are equal).
        if not all(torch.isfinite(p).all() for p in raw_model.parameters()):
            diverged(f"non-finite weights after step {step}", step)
        if master:
            save_checkpoint(ckpt_path, {
                "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                "train_config": asdict(tc), "model_config": asdict(mc), "tokenizer": tokenizer, "step": step,
                "loader": loader.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                        "cuda": torch.cuda.get_rng_state() if device.startswith("cuda") else None}})

    stop_signal = None

    def on_signal(signum, frame):
        nonlocal stop_signal
        # A second signal abandons the step at once (no checkpoint), but not under torchrun:
        # there a Ctrl-C reaches each rank twice (from the terminal, then forwarded by torchrun),
        # and torchrun itself SIGKILLs workers that have not exited within its timeout.
        if stop_signal is not None and not ddp:
            raise KeyboardInterrupt
        stop_signal = stop_signal or signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    target_step = None
    last_step = min(tc.max_steps, tc.stop_step or tc.max_steps)
    if step == 0:
        val, gates = evaluate()
        log(f"step 0/{tc.max_steps} | val {val:.4f}")
        write_log({"step": 0, "val": val, "gates": gates})
    while step < last_step:
        t0 = time.time()
        lr = lr_at(step, tc)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            x, y = loader.next_batch()  # (B, T) each, this rank's slice of the global batch
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # Gradients are all-reduced only on the last micro-step.
            with model.no_sync() if ddp and micro < accum - 1 else nullcontext():
                with autocast:
                    _, loss = model(x, y)
                (loss / accum).backward()
            loss_sum += loss.detach().float()
        # One all-reduce carries the loss and any stop request, so every rank takes the
        # same decision (a rank leaving alone would hang the others).
        stats = torch.stack([loss_sum / accum, torch.tensor(float(stop_signal is not None), device=device)])
        if ddp:
            dist.all_reduce(stats)
            stats[0] /= world
        loss_value = stats[0].item()
        # Gradients are already all-reduced, so every rank sees the same norm.
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip if tc.grad_clip > 0 else float("inf"))
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm.item())):
            diverged(f"non-finite loss ({loss_value}) or gradient norm ({grad_norm.item()}) at step {step + 1}", step + 1)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        dt = time.time() - t0
        record = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm.item(),
                  "tok_s": tc.total_batch_tokens / dt, "mem_gb": peak_memory_gb(device),
                  "tokens": step * tc.total_batch_tokens}
        if step % tc.eval_every == 0 or step == tc.max_steps:
            record["val"], record["gates"] = evaluate()
            if target_step is None and tc.target_loss > 0 and record["val"] <= tc.target_loss:
                target_step = record["steps_to_target"] = step
        val_text = f" | val {record['val']:.4f}" if "val" in record else ""
        log(f"step {step}/{tc.max_steps} | loss {loss_value:.4f}{val_text} | {record['tok_s'] / 1e3:.1f}k tok/s "
            f"| {record['mem_gb']:.1f} GB | lr {lr:.1e}")
        write_log(record)
        if stats[1] > 0:
            checkpoint()
            name = signal.Signals(stop_signal).name if stop_signal else "signal on another rank"
            log(f"stopped by {name} after step {step}; checkpoint in {ckpt_path}; continue with --resume=True")
            write_log({"event": "stopped", "step": step, "signal": name})
            sys.exit(128 + (stop_signal or signal.SIGTERM))
        if step % tc.ckpt_every == 0 or step == last_step:
            checkpoint()

    # Both ranks must hold the same weights; check it rather than trust it.
    hashes = [param_hash(raw_model)]
    if ddp:
        hashes = [None] * world
        dist.all_gather_object(hashes, param_hash(raw_model))
    write_log({"event": "end", "step": step, "param_sha256_per_rank": hashes, "steps_to_target": target_step})
    if ddp:
        dist.destroy_process_group()
    if len(set(hashes)) != 1:
        fail(f"ranks ended with different weights: {hashes}", code=1)


if __name__ == "__main__":
    main()
