"""Train any attention variant on token shards, on one CPU or many GPUs.

    torchrun --nproc_per_node=8 train.py --attn=asga    # GPUs: the papers' 134M model on FineWeb
    python train.py --attn=dsa                          # CPU: the tiny model in a few minutes
    python train.py --attn=dsa --dry_run=True           # print the plan and exit
    torchrun --nproc_per_node=8 train.py --init_from=Qwen/Qwen3-0.6B --attn=indexer   # from a pretrained Qwen3

The device picks the defaults: on CUDA the `qwen-134m` preset (the papers' model, 1024-token
sequences, ~0.5M-token global batch, bf16 autocast, torch.compile, data/fineweb10B), on CPU
the `cpu` preset. `--preset=NAME` or any `--key=value` (every TrainConfig and ModelConfig
field) overrides them. The global batch is fixed in tokens: any number of processes works,
gradient accumulation makes up the rest. Rank 0 prints the plan before the first step.

The run folder (`out_dir`) holds config.json, log.jsonl (one JSON record per step, with gate
statistics at each evaluation, read by analyze.py), ckpt.pt (loaded weights-only, see
model.read_checkpoint) and eval.json (evaluate.py at the end: loss by position, bits per
byte, and on CUDA HellaSwag). Continuing a run: `--resume=True` continues the run in out_dir,
`--resume=auto` continues it when there is a checkpoint and starts one when there is none;
a torchrun restart (`--max-restarts=N`) always resumes as `auto`. SIGTERM / Ctrl-C finish
the current step, write a checkpoint of it and exit with 128 + the signal number (143 / 130),
so schedulers see an interrupted run (torchrun then reports its own SignalException); a
second Ctrl-C on a single process abandons the step at once without a checkpoint.
`--init_from` starts from a Hugging Face Qwen3's weights, converted to `--attn`;
`--warmup_new_steps=N` trains the variant's new parameters alone first (docs/training.md).
"""
import gc
import hashlib
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

# config.py first: it sets this machine's OpenMP policy, which must happen before torch loads
from config import (StopRequest, fail, fit_batch, git_commit, init_model, new_parameters, open_data, parse_args,
                    peak_memory_gb, plan_run, preflight, preflight_on, set_up)

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import data
import flops
from evaluate import evaluate_model  # the end-of-run evaluations (train.py's own evaluate() is the val loss)
from model import CheckpointError, Model, compile_blocks, read_checkpoint, rng_state, save_checkpoint, set_rng_state


# ----------------------------------------------------------------------------- the loop
# main() is the run from top to bottom; the functions after it are its parts, in the order it uses them.

def main(argv=None):
    # -- set-up: configuration, processes, device, the batch for this world size
    tc, mc, typed = parse_args(sys.argv[1:] if argv is None else argv, doc=__doc__)
    run = set_up(tc)
    device, master, ddp, world = run["device"], run["master"], run["ddp"], run["world"]
    log = print if master else (lambda *a, **k: None)
    tc, accum, note = fit_batch(tc, world, typed)
    ckpt_path = os.path.join(tc.out_dir, "ckpt.pt")

    # -- plan: printed once (rank 0), before anything is loaded; a dry run prints it whatever
    # the folder holds, says what a real run would do with it, and stops
    resumed = plan_run(tc, mc, run, accum, note)
    if tc.dry_run:
        return

    # -- data, model, optimizer, resume, log
    loader, val_loader = open_data(tc, mc, run)
    # unwrapped and uncompiled: its state dict goes in checkpoints. A resumed run's checkpoint
    # holds every weight, --init_from's too. (Model by this name: experiments/paired.py replaces it.)
    raw_model = init_model(tc, mc, run) if tc.init_from and not resumed else Model(mc).to(device)
    os.makedirs(tc.out_dir, exist_ok=True)  # after what can fail on bad input: nothing is left behind
    optimizer = make_optimizer(raw_model, tc)
    step = resume(ckpt_path, mc, raw_model, optimizer, loader, device) if resumed else 0  # optimizer steps done
    gate_x = next(iter(val_loader))[0][: tc.gate_batch].to(device)  # (gate_batch, T), fixed
    if preflight_on(tc, device):
        preflight(raw_model, gate_x[:2], mc, run, typed)
    # --warmup_new_steps: the first steps train the variant's new parameters alone (see set_trainable)
    new_only = list(new_parameters(raw_model)) if step < tc.warmup_new_steps else None
    set_trainable(raw_model, new_only)
    model = wrap(raw_model, gate_x, tc, run)
    eval_model = model.module if ddp else model
    runlog = open_log(tc, mc, run, accum, raw_model, step, resumed)
    stop = StopRequest(ddp)

    def checkpoint():
        # A finite loss can still be followed by an update that overflows the weights; never
        # replace a good checkpoint with those (checked on every rank: the weights are equal).
        if not all(torch.isfinite(p).all() for p in raw_model.parameters()):
            diverged(f"non-finite weights after step {step}", step)
        if master:
            save(ckpt_path, step, raw_model, optimizer, loader, tc, mc, device)

    def diverged(problem, at_step):
        runlog.write({"event": "non_finite", "step": at_step, "problem": problem})
        fail(f"{problem}; stopping without a checkpoint, so {ckpt_path} still holds the last good "
             f"step; lower --lr or raise --warmup_steps, then continue with --resume=True", code=1)

    # -- the loop
    target_step = None
    last_step = min(tc.max_steps, tc.stop_step or tc.max_steps)
    if step == 0:
        val, tail, gates = evaluate(eval_model, raw_model, val_loader, gate_x, run)
        log(f"step 0/{tc.max_steps} | val {val:.4f} | tail {tail:.4f}")
        runlog.write({"step": 0, "val": val, "val_tail": tail, "gates": gates})
    while step < last_step:
        if new_only is not None and step >= tc.warmup_new_steps:  # the new parameters' warm-up is over
            new_only = None
            set_trainable(raw_model, None)
            model = wrap(raw_model, gate_x, tc, run)  # DDP registers the parameters that need gradients
            eval_model = model.module if ddp else model
            log(f"step {step}: the new parameters' warm-up is over; all parameters train from step {step + 1}")
        t0 = time.time()
        lr = lr_at(step, tc)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        dense = set_dense_warmup(raw_model, step < tc.indexer_warmup)
        loss_sum = torch.zeros((), device=device)
        kl_sum = torch.zeros((), device=device)
        for micro in range(accum):
            x, y = loader.next_batch()  # (B, T) each, this rank's slice of the global batch
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with model.no_sync() if ddp and micro < accum - 1 else nullcontext():  # all-reduce on the last only
                with run["autocast"]:
                    _, loss = model(x, y)
                    kl = raw_model.indexer_loss()  # [DS32]'s KL: it reaches the indexers alone
                ((loss if kl is None else loss + kl) / accum).backward()
            loss_sum += loss.detach().float()
            if kl is not None:
                kl_sum += kl.detach().float() / accum
        # One all-reduce carries the loss and any stop request, so every rank takes the same
        # decision (a rank leaving alone would hang the others).
        stats = torch.stack([loss_sum / accum, torch.tensor(float(stop.signum is not None), device=device)])
        if ddp:
            dist.all_reduce(stats)
            stats[0] /= world
        loss_value = stats[0].item()
        # Gradients are already all-reduced, so every rank sees the same norm.
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip if tc.grad_clip > 0 else float("inf")).item()
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            diverged(f"non-finite loss ({loss_value}) or gradient norm ({grad_norm}) at step {step + 1}", step + 1)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        dt = time.time() - t0
        record = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm, "tok_s": tc.total_batch_tokens / dt,
                  "mem_gb": peak_memory_gb(device), "tokens": step * tc.total_batch_tokens}
        record.update(throughput(record["tok_s"], runlog.info, world))
        if dense is not None:  # the indexer's KL (this rank's), summed over layers, and its stage
            record.update(indexer_kl=kl_sum.item(), indexer_stage="dense" if dense else "sparse")
        if tc.warmup_new_steps:
            record["trained"] = "new" if new_only is not None else "all"
        # -- evaluation
        if step % tc.eval_every == 0 or step == tc.max_steps:
            record["val"], record["val_tail"], record["gates"] = evaluate(eval_model, raw_model, val_loader, gate_x, run)
            if target_step is None and tc.target_loss > 0 and record["val"] <= tc.target_loss:
                target_step = record["steps_to_target"] = step
        val_text = f" | val {record['val']:.4f} | tail {record['val_tail']:.4f}" if "val" in record else ""
        if "indexer_kl" in record:
            val_text += f" | kl {record['indexer_kl']:.4f} ({record['indexer_stage']})"
        kept = record.get("gates", {}).get("kept_mass")
        if kept:  # share of the dense attention's mass on the selected keys, mean over layers
            val_text += f" | kept {sum(m[0] for m in kept['mean']) / len(kept['mean']):.3f}"
        use = f"mfu {100 * record['mfu']:.1f}%" if "mfu" in record else f"{record['flop_s'] / 1e12:.3g} TFLOP/s"
        log(f"step {step}/{tc.max_steps} | loss {loss_value:.4f}{val_text} | {record['tok_s'] / 1e3:.1f}k tok/s "
            f"| {use} | {record['mem_gb']:.1f} GB | lr {lr:.1e}")
        runlog.write(record)
        # -- checkpoint
        if stats[1] > 0:
            checkpoint()
            name = signal.Signals(stop.signum).name if stop.signum else "signal on another rank"
            log(f"stopped by {name} after step {step}; checkpoint in {ckpt_path}; continue with --resume=True")
            runlog.write({"event": "stopped", "step": step, "signal": name})
            sys.exit(128 + (stop.signum or signal.SIGTERM))
        if step % tc.ckpt_every == 0 or step == last_step:
            checkpoint()

    # -- end: evaluate.py's evaluations (loss by position, bits per byte, HellaSwag on GPUs)
    final_eval(raw_model, tc, run, step, runlog, log)

    # -- end: every rank must hold the same weights; check it rather than trust it
    hashes = [param_hash(raw_model)]
    if ddp:
        hashes = [None] * world
        dist.all_gather_object(hashes, param_hash(raw_model))
    runlog.write({"event": "end", "step": step, "param_sha256_per_rank": hashes, "steps_to_target": target_step})
    if ddp:
        # Close the group now, its gloo threads joined, not at the interpreter's shutdown (where
        # they aborted finished runs: config.init_process_group). DDP's reducer holds it too.
        del model, eval_model
        gc.collect()
        dist.destroy_process_group()
    if len(set(hashes)) != 1:
        fail(f"ranks ended with different weights: {hashes}", code=1)


# ----------------------------------------------------------------------------- the model

def wrap(raw_model, gate_x, tc, run):
    """The model the loop calls: its blocks compiled when tc.compile (model.compile_blocks: one
    layer's graph, compiled once for all), wrapped in DDP under torchrun."""
    model = compile_blocks(raw_model) if tc.compile else raw_model
    if run["ddp"]:
        # DDP must know of parameters that get no gradient (a variant's ablated gate); probe
        # once on the raw model rather than pay find_unused_parameters's search every step.
        # Frozen parameters (--warmup_new_steps) are not DDP's: it registers those that need one.
        raw_model(gate_x[:1])[0].sum().backward()
        unused = any(p.grad is None for p in raw_model.parameters() if p.requires_grad)
        raw_model.zero_grad(set_to_none=True)
        cuda = run["device"].startswith("cuda")
        model = DDP(model, device_ids=[torch.device(run["device"])] if cuda else None, find_unused_parameters=unused)
    return model


# ----------------------------------------------------------------------------- optimisation

def set_dense_warmup(model, on):
    """Switch the indexer layers' dense warm-up ([DS32] §2.1) on or off; None when the model
    has no indexer, else `on`."""
    layers = [layer.self_attn for layer in model.layers if hasattr(layer.self_attn, "dense_warmup")]
    for attn in layers:
        attn.dense_warmup = on
    return on if layers else None


def set_trainable(model, only=None):
    """Freeze every parameter but those named in `only`, or unfreeze all (only=None): the
    stages of --warmup_new_steps.

    Freezing is requires_grad=False, not a parameter group at lr 0: a frozen parameter gets no
    gradient, so AdamW skips it (no update, no weight decay: its weights stay bit-exact), it
    has no optimizer state until its first step (which then starts AdamW's bias correction at
    1, as for a fresh parameter), the clipped gradient norm is the trained parameters' alone,
    and backward computes no weight gradient for it. The stage is a function of the step, and
    the optimizer state holds exactly the parameters that have stepped, so resume is exact
    across the switch. (At lr 0 the moments would fill with gradients of the frozen stage and
    the clipping norm would count parameters that do not move.)"""
    for name, p in model.named_parameters():
        p.requires_grad_(only is None or name in only)


def lr_at(step, tc):
    """Linear warm-up to lr over warmup_steps, then cosine down to lr * min_lr_frac."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = min(1.0, (step - tc.warmup_steps) / max(1, tc.max_steps - tc.warmup_steps))
    min_lr = tc.lr * tc.min_lr_frac
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (tc.lr - min_lr)


def make_optimizer(model, tc):
    """AdamW; weight decay only on matrices. Norm weights, biases and gains (all 1-D) and the
    embedding (also the tied head) are not decayed, as in nanoGPT / GPT-3. The fused kernel
    exists on CPU too and is ~8x faster there than the default for-each one."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    indexer = {id(p) for name, p in model.named_parameters() if ".indexer." in name}
    decay, no_decay, index_decay, index_no_decay = [], [], [], []
    for p in model.parameters():  # parameters() yields a tied weight once
        matrix = p.dim() >= 2 and id(p) not in embeddings
        if id(p) in indexer:  # [DS32]'s indexer has its own lr (lr_scale: indexer_lr / lr)
            (index_decay if matrix else index_no_decay).append(p)
        else:
            (decay if matrix else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": tc.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if indexer:
        groups += [{"params": index_decay, "weight_decay": tc.weight_decay, "lr_scale": tc.indexer_lr / tc.lr},
                   {"params": index_no_decay, "weight_decay": 0.0, "lr_scale": tc.indexer_lr / tc.lr}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), fused=True)


# ----------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(model, raw_model, val_loader, gate_x, run):
    """(mean val loss over the fixed val tokens, its mean over the last quarter of positions:
    the tail loss; both of all ranks), plus gate stats on rank 0.

    The tail loss is what [MoBA]'s authors watch to decide that a converted model has recovered:
    the trailing positions are those whose keys a sparse variant drops most of."""
    device = run["device"]
    model.eval()
    total = torch.zeros(2, device=device)  # loss, tail loss
    for x, y in val_loader:
        x, y = x.to(device), y.to(device)
        with run["autocast"]:
            logits, loss = model(x, y)
        tail = y.shape[1] - y.shape[1] // 4  # (B, T - tail, V) logits of the last quarter
        total += torch.stack([loss.float(), F.cross_entropy(logits[:, tail:].float().flatten(0, 1), y[:, tail:].flatten())])
    total /= len(val_loader)
    if run["ddp"]:
        dist.all_reduce(total)  # gloo has no AVG: sum, then divide
        total /= run["world"]
    gates = {}
    if run["master"]:
        raw_model.record_gates(True)
        with run["autocast"]:
            raw_model(gate_x)
        gates = raw_model.gate_stats()
        raw_model.record_gates(False)
    model.train()
    return total[0].item(), total[1].item(), gates


def final_eval(raw_model, tc, run, step, runlog, log):
    """evaluate.py's evaluations of the final weights (every rank calls it): eval.json in the
    run folder and an `eval` record in log.jsonl. Nothing here fails the run (the checkpoint
    is already written): what cannot run is recorded with its reason."""
    hellaswag_on = tc.hellaswag == "true" or (tc.hellaswag == "auto" and run["device"].startswith("cuda"))
    if tc.eval_seqs == 0 and not hellaswag_on:
        return
    record = evaluate_model(
        raw_model, data_dir=tc.data_dir, tokenizer=data.tokenizer_spec(tc.data_dir), trained_len=tc.seq_len,
        step=step, n_seq=tc.eval_seqs, batch_size=tc.batch_size, device=run["device"], autocast=run["autocast"],
        hellaswag_on=hellaswag_on, rank=run["rank"], world=run["world"], log=log)
    if run["master"]:
        path = os.path.join(tc.out_dir, "eval.json")
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        summary = {"event": "eval", "step": step, "nats_per_token": record.get("nats_per_token"),
                   "bits_per_byte": record.get("bits_per_byte"), "unigram": record.get("unigram")}
        if "hellaswag" in record:
            summary["hellaswag"] = {k: v for k, v in record["hellaswag"].items() if k in ("acc", "acc_norm", "items", "skipped")}
        runlog.write(summary)
        log(f"wrote {path}: loss by position, bits per byte" + (", HellaSwag" if hellaswag_on else ""))


# ----------------------------------------------------------------------------- checkpoints and resume

def resume(ckpt_path, mc, raw_model, optimizer, loader, device):
    """Load the checkpoint's weights, optimizer, data position and RNG states -> its step."""
    try:
        ckpt = read_checkpoint(ckpt_path, device)
    except CheckpointError as e:
        fail(str(e), code=1)
    changed = {k: (v, getattr(mc, k, None)) for k, v in ckpt["model_config"].items() if getattr(mc, k, None) != v}
    if changed:
        fail(f"the model config differs from the checkpoint's: {changed} (saved, now); resume with "
             f"the same model settings as the run in {os.path.dirname(ckpt_path)}")
    raw_model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    try:
        loader.load_state_dict(ckpt["loader"])
    except data.ShardError as e:
        fail(str(e), code=1)
    set_rng_state(ckpt["rng"], device)
    return ckpt["step"]


def save(ckpt_path, step, raw_model, optimizer, loader, tc, mc, device):
    save_checkpoint(ckpt_path, {
        "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
        "train_config": asdict(tc), "model_config": asdict(mc), "step": step,
        "tokenizer": data.tokenizer_spec(tc.data_dir),  # sample.py decodes with it: data.load_tokenizer(spec)
        "loader": loader.state_dict(), "rng": rng_state(device)})


# ----------------------------------------------------------------------------- log

def open_log(tc, mc, run, accum, raw_model, step, resumed):
    """The run's config.json and log.jsonl (rank 0), and the resume line when resuming."""
    device = run["device"]
    run_info = {"git_commit": git_commit(), "torch": torch.__version__, "device": device, "dtype": run["dtype"],
                "world_size": run["world"], "grad_accum": accum, "num_params": raw_model.num_params(),
                "tokenizer": data.tokenizer_of(tc.data_dir)[0],
                "flops_per_token": flops.flops_per_token(raw_model, tc.seq_len),
                "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
                "memory": "cuda max_memory_allocated" if device.startswith("cuda") else "cpu peak RSS (getrusage)",
                "train": asdict(tc), "model": asdict(mc)}
    runlog = RunLog(tc.out_dir, run["master"], run_info, step, resumed)
    runlog.write({"event": "resume" if resumed else "start", "step": step, "time": time.time(), **run_info})
    if resumed:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        if run["master"]:
            print(f"{f'torchrun restart {restart}: ' if restart else ''}resumed from step {step}; "
                  f"lost {runlog.lost} step(s) run after that checkpoint", flush=True)
        runlog.write({"event": "resumed", "step": step, "lost_steps": runlog.lost, "restart": restart})
    return runlog


class RunLog:
    """config.json and log.jsonl in the run folder, written by rank 0 only (other ranks get a
    RunLog that writes nothing). On resume, records of steps after the checkpoint's (lost
    when the job died) are dropped, and `lost` says how many steps that was."""

    def __init__(self, out_dir, master, run_info, step, resumed):
        self.master, self.lost, self.file, self.info = master, 0, None, run_info
        if not master:
            return
        path = os.path.join(out_dir, "log.jsonl")
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(run_info, f, indent=1)
        kept, last = [], step
        if resumed and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:  # a line cut short by a SIGKILL
                        continue
                    last = max(last, record.get("step", 0) if "loss" in record else 0)
                    if record.get("step", 0) <= step:
                        kept.append(line)
        self.lost = last - step
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
        self.file = open(path, "a")

    def write(self, record):
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()


def param_hash(model):
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def throughput(tok_s, info, world):
    """FLOP/s per device from the run's tokens/s (all processes), and the MFU against the
    device's dense bf16 peak where flops.PEAK_BF16 knows the device (CUDA only)."""
    flop_s = info["flops_per_token"] * tok_s / world
    use = flops.mfu(flop_s, info["device_name"]) if info["device"].startswith("cuda") else None
    return {"flop_s": flop_s} if use is None else {"flop_s": flop_s, "mfu": use}


if __name__ == "__main__":
    main()
