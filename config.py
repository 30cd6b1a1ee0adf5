"""The run's configuration and set-up: what train.py does before its first step, and the
command line that sample.py, evaluate.py and analyze.py share with it.

- `parse_flags` / `fail`: the `--key=value` command line of every script (nanoGPT's
  configurator, typed: a value takes its default's type, an unknown key lists the valid ones)
- `TrainConfig`, `TRAIN_PRESETS`; `parse_args`: train.py's flags -> (TrainConfig, ModelConfig)
- a pretrained start (`--init_from`: a Hugging Face Qwen3): its ModelConfig, tokenizer and
  weights (`pretrained_config`, `pretrained_tokenizer`, `init_model`; `load_pretrained` for
  sample.py and evaluate.py) and the stages of `--warmup_new_steps`
- this machine, the device, the processes and the data: `set_up`, `fit_batch`, `open_data`
- the plan train.py prints before its first step and what a run does with its folder
  (`plan_run`), which is all a dry run does
- the preflight: the chosen attention path checked against the reference before step 1

This module imports no script (train.py, sample.py, evaluate.py, analyze.py import it), so the
imports run one way.
"""
import ctypes
import json
import math
import os
import random
import re
import resource
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace

# ----------------------------------------------------------------------------- this machine
# Workarounds for the machine rather than the method, one line each on why.

# Set before torch loads OpenMP: idle threads sleep instead of spinning; on a CPU shared with
# other processes (2-core machines, CI, torchrun ranks) spinning made training 10x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def keep_freed_memory():
    """CPU with glibc: keep freed blocks in the heap. Each step frees and re-allocates the
    (B*T, vocab) logits and their gradient (200 MB each at the CPU default); glibc returned
    them to the OS and faulting them in again cost half of each step (1.5k -> 2.5k tok/s
    measured, peak RSS 1.3 -> 2.0 GB)."""
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


def peak_memory_gb(device):
    """GPU: torch.cuda.max_memory_allocated. CPU: the process's peak RSS."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss * (1 if sys.platform == "darwin" else 1024) / 1e9

import numpy as np
import torch
import torch.distributed as dist

import data
import flops
from attention import VARIANTS, attention_path
from model import (HF_SIZES, NEW, PRESETS, CheckpointError, Model, ModelConfig, hf_folder, hf_model_config, hf_parameters,
                   load_hf, set_kernel)


# ----------------------------------------------------------------------------- configuration


@dataclass
class TrainConfig:
    preset: str = "cpu"  # a name in TRAIN_PRESETS (default: chosen by the device, DEVICE_PRESETS)
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
    resume: str = "false"  # false | true | auto (auto: continue if out_dir has a checkpoint)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | bfloat16 | float32: the autocast dtype; weights stay float32
    compile: bool = False  # torch.compile the model (worth it on GPU)
    dry_run: bool = False  # print the plan and exit (needs neither a GPU nor data)
    preflight: str = "auto"  # auto (on CUDA) | on | off: check the attention path against the reference first
    # at the end of the run (evaluate.py): eval.json in out_dir
    eval_seqs: int = 8  # val sequences per length for loss by position and bits per byte (0: off)
    hellaswag: str = "auto"  # auto | true | false: HellaSwag (auto: on CUDA, off on CPU)
    # indexer ([DS32]): the first steps attend densely while the lightning indexer learns
    indexer_warmup: int = 50  # steps of dense attention (the paper's dense warm-up); 0: sparse from step 1
    indexer_lr: float = 1e-3  # the indexer's peak lr (the paper's warm-up lr), same schedule shape
    # a pretrained start: a Hugging Face Qwen3 folder or Hub id; its config.json gives the sizes,
    # --attn and the variant's settings the rest (model.load_hf)
    init_from: str = ""
    warmup_new_steps: int = 0  # with init_from: the first N steps train the variant's new parameters alone


# Named setups; a preset's values replace the TrainConfig defaults above.
# What the papers state, and what is this project's choice:
#  - 002 (dsa adaptive) states batch size 32, sequence length 32768, lr 3e-4, weight decay
#    0.1, gradient accumulation 16 and 399 steps. We train on 2048-token sequences (32768
#    does not fit a 134M model's activations in memory here), so its step is 32 x 2048 x 16
#    = 1M tokens; warm-up and schedule are ours.
#  - 003 (asga) states batch size 32, lr 6e-4 with cosine decay and 50,000 steps. The
#    sequence length (1024), warm-up, betas, weight decay and clipping are ours.
#  - 004 (caa) states batch size 512 (with gradient accumulation), AdamW with lr 3e-4,
#    beta1 0.9, beta2 0.98. The sequence length (1024), 5000 steps, warm-up, schedule,
#    weight decay and clipping are ours.
#  - qwen-134m, the GPU default, is ours: the papers' model at 1024 tokens, a global batch of
#    2^19 tokens (as nanoGPT's GPT-2 runs), 5000 steps = 2.6B tokens, about 20 tokens per
#    parameter (the compute-optimal ratio of Hoffmann et al., 2022).
#  - cpu is ours: the 0.9M-parameter `bytes` model on byte shards, a few minutes on 2 cores.
# Every preset not stating them uses the defaults above: warm-up then cosine to 0.1 x lr,
# AdamW betas (0.9, 0.95), weight decay 0.1 on matrices, gradient clipping at 1.0.
TRAIN_PRESETS = {
    # The main CPU command, on byte shards (data.py --tokenizer=byte): 4.1M bytes through the
    # 0.9M-parameter `bytes` model (its figures: assets/cpu_main_job.txt). The windows are
    # shorter than the 256-byte sequence, so that `local`, `dsa`, `asga_gate=fixed` and caa's
    # local branch differ from `full`: the papers' W = 256 of 1024 tokens is a quarter of the
    # sequence, as 64 of 256 is; caa's width range keeps its paper's [W, 2W]; dsa's adaptive
    # threshold keeps [DSA-A]'s 512 of 1024 (half the positions attend fully).
    "cpu": dict(model="bytes", data_dir="data/bytes", seq_len=256, batch_size=16, total_batch_tokens=4096, lr=3e-3,
                warmup_steps=50, max_steps=1000, eval_every=100, val_tokens=65536, ckpt_every=250,
                window=64, caa_window_max=128, dsa_threshold=128,
                # nsa and moba sized for T = 256 (the GPU defaults in model.py are for T = 1024)
                nsa_cmp_block=8, nsa_cmp_stride=4, nsa_block=16, nsa_topk=5, nsa_window=32, moba_block=16),
    "qwen-134m": dict(model="qwen-134m", data_dir="data/fineweb10B", seq_len=1024, batch_size=16,
                      total_batch_tokens=2**19, lr=6e-4, warmup_steps=200, max_steps=5000,
                      eval_every=250, val_tokens=2**20, ckpt_every=500, compile=True),
    "002": dict(model="qwen-134m", data_dir="data/fineweb10B", seq_len=2048, batch_size=4,
                total_batch_tokens=32 * 2048 * 16, lr=3e-4, weight_decay=0.1, max_steps=399,
                warmup_steps=40, eval_every=50, val_tokens=2**20, ckpt_every=100, compile=True),
    "003": dict(model="qwen-134m", data_dir="data/fineweb10B", seq_len=1024, batch_size=4,
                total_batch_tokens=32 * 1024, lr=6e-4, max_steps=50000, warmup_steps=1000,
                eval_every=1000, val_tokens=2**20, ckpt_every=2000, compile=True),
    "004": dict(model="qwen-134m", data_dir="data/fineweb10B", seq_len=1024, batch_size=16,
                total_batch_tokens=512 * 1024, lr=3e-4, beta2=0.98, max_steps=5000,
                warmup_steps=250, eval_every=250, val_tokens=2**20, ckpt_every=500, compile=True),
}
DEVICE_PRESETS = {"cuda": "qwen-134m", "cpu": "cpu"}  # the preset a run gets without --preset
TRAIN_DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}
MODEL_DEFAULTS = {f.name: f.default for f in fields(ModelConfig)}
SHARD_TOKENS = 100_000_000  # tokens in one train shard of `data.py --source=fineweb-gpt2`


# ----------------------------------------------------------------------------- command line
# One `--key=value` parser for train.py, sample.py, evaluate.py and analyze.py. It lives here,
# not in model.py, because it is about running scripts rather than the model.

def fail(msg, code=2):
    """Print `error: msg` and exit. Under torchrun every rank meets the same configuration,
    data and checkpoint problems at the same point, so only rank 0 prints; the others wait a
    moment before exiting, so that rank 0's message is out before torchrun stops the group."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {msg}", file=sys.stderr, flush=True)
    else:
        time.sleep(2)
    sys.exit(code)


def convert(key, raw, default, choices=None):
    """A command-line string -> the default's type. Bools accept True/False/true/false/1/0,
    ints accept 1e6 and 1_000_000, `choices` lists the valid (lower-case) strings."""
    kind = type(default)
    try:
        if choices:
            value = {"1": "true", "0": "false"}.get(raw.lower(), raw.lower())
            if value not in choices:
                raise ValueError
            return value
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return raw.lower() in ("true", "1")
        if kind is int:
            value = float(raw.replace("_", ""))
            if not value.is_integer():
                raise ValueError
            return int(value)
        return kind(raw)
    except ValueError:
        expected = " | ".join(choices) if choices else kind.__name__ + (" (True/False/1/0)" if kind is bool else "")
        fail(f"--{key}={raw}: expected {expected}")


def parse_flags(argv, groups, program, positional=False, choices=None, doc=""):
    """`--key=value` strings -> ({key: typed value} for the keys given, [other arguments]).

    groups: {"training keys": {key: default}, ...}; a value takes its default's type. A bare
    `--key` means True for a bool key (and "true" for a key whose choices include it).
    Arguments without `--` are returned when `positional`, refused otherwise."""
    choices = choices or {}
    defaults = {k: v for group in groups.values() for k, v in group.items()}
    if "-h" in argv or "--help" in argv:
        print(doc + "".join(f"\n{name}: {', '.join(keys)}" for name, keys in groups.items()))
        sys.exit(0)
    given, rest = {}, []
    for arg in argv:
        if not arg.startswith("--"):
            if not positional:
                fail(f"{program}: unexpected argument {arg!r}; use --key=value")
            rest.append(arg)
            continue
        key, eq, raw = arg[2:].partition("=")
        if key not in defaults:
            fail(f"{program}: unknown config key --{key}" + "".join(
                f"\n  valid {name}: {', '.join(keys)}" for name, keys in groups.items()))
        if not eq:
            if type(defaults[key]) is not bool and "true" not in choices.get(key, ()):
                fail(f"{program}: --{key} needs a value; use --{key}=VALUE")
            raw = "true"
        given[key] = convert(key, raw, defaults[key], choices.get(key))
    return given, rest


# ----------------------------------------------------------------------------- train.py's command line

def parse_args(argv, doc=""):
    """train.py's --key=value strings -> (TrainConfig, ModelConfig, the keys typed on the
    command line); doc: the text --help prints first (train.py's docstring).

    The preset is --preset, else the device's (DEVICE_PRESETS); its values replace the
    TrainConfig defaults, and typed keys replace those."""
    given, _ = parse_flags(argv, {"training keys": TRAIN_DEFAULTS, "model keys": MODEL_DEFAULTS},
                           "train.py", choices={"resume": ("false", "true", "auto"), "preflight": ("auto", "on", "off"),
                                                "hellaswag": ("auto", "true", "false")},
                           doc=doc + f"\npresets: {', '.join(TRAIN_PRESETS)}; model sizes: "
                           f"{', '.join(PRESETS)}; --attn: {', '.join(VARIANTS)}")
    device = given.get("device", "auto")
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        fail(f"unknown --device={device}; valid: auto, cpu, cuda")
    preset = given.get("preset") or DEVICE_PRESETS[resolve_device(device).split(":")[0]]
    if preset not in TRAIN_PRESETS:
        fail(f"unknown --preset={preset}; valid presets: {', '.join(TRAIN_PRESETS)}")
    train = {**TRAIN_PRESETS[preset], "preset": preset}
    train.update({k: v for k, v in given.items() if k in TRAIN_DEFAULTS})
    tc = TrainConfig(**{k: v for k, v in train.items() if k in TRAIN_DEFAULTS})
    if tc.model not in PRESETS:
        fail(f"unknown --model={tc.model}; valid model presets: {', '.join(PRESETS)}")
    if tc.dtype not in ("auto", "bfloat16", "float32"):
        fail(f"unknown --dtype={tc.dtype}; valid: auto, bfloat16, float32")
    for key in ("max_steps", "seq_len", "batch_size", "eval_every", "ckpt_every", "total_batch_tokens"):
        if getattr(tc, key) < 1:
            fail(f"--{key}={getattr(tc, key)}: must be at least 1")
    model_keys = {k: v for k, v in given.items() if k in MODEL_DEFAULTS}
    model_keys.update({k: v for k, v in train.items() if k in MODEL_DEFAULTS and k not in given})
    if tc.init_from:
        mc = pretrained_config(tc, model_keys, {k for k in given if k in MODEL_DEFAULTS})
        tc = pretrained_stages(tc, mc, given)
    else:
        if "warmup_new_steps" in given and tc.warmup_new_steps:
            fail(f"--warmup_new_steps={tc.warmup_new_steps} needs --init_from: from scratch every parameter is new")
        mc = model_config(tc, model_keys)
    try:  # a selection covering the whole sequence would be dense attention: the class says when
        VARIANTS[mc.attn].check_budget(mc, tc.seq_len)
    except ValueError as e:
        fail(str(e))
    if tc.eval_seqs < 0:
        fail(f"--eval_seqs={tc.eval_seqs}: must be >= 0 (0 turns loss by position off)")
    if mc.attn == "indexer" and not 0 <= tc.indexer_warmup <= tc.max_steps:
        fail(f"--indexer_warmup={tc.indexer_warmup}: must be in 0 .. max_steps={tc.max_steps} (steps of dense "
             f"attention before the indexer's selection takes over)")
    return tc, mc, set(given)


def pretrained_config(tc, model_keys, typed):
    """The ModelConfig of --init_from: the sizes from its config.json, the vocabulary exactly as
    there, attn and the variant's settings from the preset and the command line (a size typed on
    the command line is refused: config.json owns it). The data folder, when it holds shards,
    must be of the checkpoint's own tokenizer."""
    settings = {k: v for k, v in model_keys.items() if k in typed or k not in HF_OWNED}
    try:
        mc = hf_model_config(tc.init_from, **settings)
        try:
            tok = pretrained_tokenizer(tc.init_from, mc)
        except CheckpointError as e:
            if not tc.dry_run:
                raise
            print(f"warning: {e} (a real run stops here)", flush=True)
            return mc
        if os.path.exists(os.path.join(tc.data_dir, data.TOKENIZER_FILE)) or train_tokens_found(tc.data_dir)[0]:
            data.check_tokenizer(tc.data_dir, tok)
    except (CheckpointError, data.ShardError) as e:
        fail(str(e), code=1)
    except ValueError as e:  # a size config.json owns, an unknown setting
        fail(f"--init_from={tc.init_from}: {e}")
    return mc


HF_OWNED = set(HF_SIZES) | {"rope_theta"}  # ModelConfig fields a pretrained checkpoint's config.json sets


# the model keys sample.py and evaluate.py take with --init_from: attn and the variant's settings
VARIANT_DEFAULTS = {k: v for k, v in MODEL_DEFAULTS.items() if k not in HF_OWNED}


def parse_source_flags(argv, defaults, program, doc=""):
    """sample.py's and evaluate.py's command line: `--key=value` overrides of defaults, one of
    --ckpt (a train.py run) or --init_from (a Hugging Face Qwen3), and with --init_from the
    variant's settings -> (args, settings). --kernel is the script's own key (defaults)."""
    variant_keys = {k: v for k, v in VARIANT_DEFAULTS.items() if k != "kernel"}
    given, _ = parse_flags(argv, {"keys": defaults, "model keys (with --init_from)": variant_keys}, program, doc=doc)
    args = {**defaults, **{k: v for k, v in given.items() if k in defaults}}
    settings = {k: v for k, v in given.items() if k in variant_keys}
    if bool(args["ckpt"]) == bool(args["init_from"]):
        fail(f"{program}: give --ckpt=RUN_DIR_OR_FILE (a train.py run) or --init_from=PATH (a Hugging Face Qwen3 "
             f"folder or Hub id), one of them")
    if args["ckpt"] and settings:
        fail(f"{program}: --{next(iter(settings))} applies to --init_from; a checkpoint's model config is its own")
    return args, settings


def load_pretrained(path, device, settings, program):
    """--init_from for sample.py and evaluate.py -> (model in eval mode on device, its
    data.TextTokenizer, model.load_hf's summary); bad input is one line and exit 1 (2 for a
    setting the command line gets wrong)."""
    try:
        mc = hf_model_config(path, **settings)
        tok = pretrained_tokenizer(path, mc)
        model, summary = load_hf(path, device, **settings)
    except CheckpointError as e:
        fail(f"{program}: {e}", code=1)
    except ValueError as e:  # a size config.json owns, an unknown setting
        fail(f"{program}: --init_from={path}: {e}")
    return model, tok, summary


def pretrained_tokenizer(path, mc):
    """The tokenizer of a Hugging Face checkpoint (its tokenizer.json; a byte model's export holds
    the byte tokenizer's) -> data.TextTokenizer, checked to fit the embedding. CheckpointError
    when the folder has none or it does not fit."""
    folder = hf_folder(path, weights=False)
    file = os.path.join(folder, data.TOKENIZER_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{folder}: no tokenizer.json, so the text its token ids stand for is unknown; "
                              f"copy the checkpoint's tokenizer.json into the folder")
    try:
        tok = data.load_tokenizer(file)
    except data.ShardError as e:
        raise CheckpointError(str(e)) from None
    if tok.n_ids > mc.vocab_size:
        raise CheckpointError(f"{file} writes {tok.n_ids} token ids but config.json's vocab_size is {mc.vocab_size}, "
                              f"so ids {mc.vocab_size}..{tok.n_ids - 1} have no embedding row: the tokenizer is not "
                              f"this checkpoint's; put the tokenizer.json it was trained with in {folder}")
    return tok


class _NoRandomFills(torch.overrides.TorchFunctionMode):
    """nn.init's fills and Tensor.normal_'s kin return their tensor unfilled. On the meta device
    a random fill runs through torch._refs, whose first call imports torch._dynamo (~3 s), for
    values a meta model never holds: a dry run or a refused input stops before torch.optim's
    Optimizer, whose constructor imports it too (a dry run 7-8 s -> 4 s on a CPU)."""
    FILLS = {getattr(torch.nn.init, name) for name in dir(torch.nn.init) if name.endswith("_") and not name.startswith("_")}
    FILLS |= {torch.Tensor.normal_, torch.Tensor.uniform_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FILLS:
            return args[0] if args else kwargs["tensor"]  # nn.init's functions name it ``tensor``
        return func(*args, **(kwargs or {}))


def meta_model_of(mc):
    """Model(mc) on the meta device: its parameters' names and shapes, no memory, no values."""
    with torch.device("meta"), _NoRandomFills():
        return Model(mc)


def pretrained_stages(tc, mc, given):
    """--warmup_new_steps with --init_from. indexer follows [DS32] unless told otherwise: its
    dense warm-up (--indexer_warmup) is also the stage in which only the indexer trains, so
    either flag sets the other."""
    if mc.attn == "indexer":
        if "warmup_new_steps" not in given:
            tc = replace(tc, warmup_new_steps=tc.indexer_warmup)
        elif "indexer_warmup" not in given:
            tc = replace(tc, indexer_warmup=tc.warmup_new_steps)
    if not 0 <= tc.warmup_new_steps <= tc.max_steps:
        fail(f"--warmup_new_steps={tc.warmup_new_steps}: must be in 0 .. max_steps={tc.max_steps}")
    if tc.warmup_new_steps:
        new = [name for name, source in hf_parameters(meta_model_of(mc)).items() if source == NEW]
        if not new:
            fail(f"--warmup_new_steps={tc.warmup_new_steps}: attn={mc.attn} has no new parameters (every one is "
                 f"{tc.init_from}'s), so nothing would train; drop it")
    return tc


def init_model(tc, mc, run):
    """The model train.py starts from with --init_from: the checkpoint's weights, the variant's
    new parameters at their init_gates values, in training mode. Under torchrun rank 0 loads
    first, so a Hub id's weights are downloaded once (the other ranks of its node then read
    the cache)."""
    if run["ddp"] and not run["master"]:
        dist.barrier()
    try:
        model, _ = load_hf(tc.init_from, run["device"], **{k: getattr(mc, k) for k in MODEL_DEFAULTS if k not in HF_OWNED})
    except (CheckpointError, ValueError) as e:
        fail(str(e), code=1)
    if run["ddp"] and run["master"]:
        dist.barrier()
    if model.cfg != mc:  # the folder changed between the plan and now
        fail(f"{tc.init_from}: its config.json changed while this run started; start it again", code=1)
    return model.train()


def new_parameters(model):
    """{name: parameter} of a model's parameters that a pretrained Qwen3 does not hold (the
    variant's own: model.hf_parameters)."""
    sources = hf_parameters(model)
    return {name: p for name, p in model.named_parameters() if sources[name] == NEW}


def fold_layers(names):
    """Parameter names with layer numbers folded into '*', in order, each once."""
    return list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", name) for name in names))


def model_config(tc, overrides):
    """The ModelConfig of this run: the size preset tc.model, then single-field overrides."""
    if overrides.get("attn", "full") not in VARIANTS:
        fail(f"unknown --attn={overrides['attn']}; valid attention variants: {', '.join(VARIANTS)}")
    try:  # the data folder's tokenizer sets the vocabulary, unless --vocab_size does
        has_data = os.path.exists(os.path.join(tc.data_dir, data.TOKENIZER_FILE)) or train_tokens_found(tc.data_dir)[0]
        n_ids = data.tokenizer_of(tc.data_dir)[1] if has_data else PRESETS[tc.model].get("vocab_size", 50257)
        overrides = {"vocab_size": -(-n_ids // 64) * 64, **overrides}  # a multiple of 64: 50257 -> 50304
        data.check_vocab(tc.data_dir, overrides["vocab_size"])
    except data.ShardError as e:
        fail(str(e), code=1)
    try:
        return ModelConfig(**{**PRESETS[tc.model], **overrides})
    except ValueError as e:
        fail(str(e))


# ----------------------------------------------------------------------------- device and processes

def cuda_missing():
    """Why --device=cuda cannot run on this machine, with the fix; None when it can."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return (f"--device=cuda, but CUDA is not available: this torch {torch.__version__} is a "
                f"CPU-only build; install the CUDA build for your driver (https://pytorch.org, see "
                f"the README's Install), or pass --device=cpu (or auto)")
    return (f"--device=cuda, but CUDA is not available: torch {torch.__version__} (CUDA "
            f"{torch.version.cuda}) sees no GPU; check `nvidia-smi` and CUDA_VISIBLE_DEVICES, or pass "
            f"--device=cpu (or auto)")


def tf32_matmuls():
    """float32 matmuls outside autocast (the selections' float32 scores, master-weight maths)
    on TF32 tensor cores, as nanoGPT does: train.py, sample.py and the GPU benchmarks alike
    (without it an H100 ran nsa's and the indexer's float32 products on its FP32 units)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def resolve_device(name):
    """auto -> cuda when a GPU is visible, else cpu; cuda -> cuda:LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if name == "cuda" else name


def init_process_group(backend, rank, world):
    """dist.init_process_group, with a key prefix of its own for each torchrun restart.
    torchrun's agent keeps serving one key-value store at MASTER_ADDR:MASTER_PORT across
    restarts, and torch keys the default group's addresses by rank alone, so a restarted
    rank could read the address of the dead rank it replaces: gloo then failed with
    "Connection refused" or hung while connecting (3 of 3 restart tests run side by side
    failed without this prefix, 6 of 6 passed with it)."""
    # torch.distributed.nn's functions take `group=group.WORLD` as a default argument, and DDP
    # imports that module on its first use: imported after the group exists, ten defaults hold
    # the group, so destroy_process_group cannot free it and gloo's threads ran on into the
    # interpreter's shutdown, where one touching Python aborted a finished run ("terminate
    # called without an active exception", rc -6). Imported before, the defaults are None.
    import torch.distributed.nn  # noqa: F401
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restart == "0":
        dist.init_process_group(backend=backend)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"restart_{restart}", store),
                            rank=rank, world_size=world)


def set_up(tc):
    """Processes, device, seeds and precision -> a dict describing this process's run.
    torchrun sets RANK / LOCAL_RANK / WORLD_SIZE; a dry run joins no process group and
    touches no GPU, so `--device=cuda --dry_run=True` works anywhere."""
    ddp = "RANK" in os.environ
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = resolve_device(tc.device)
    cuda = device.startswith("cuda")
    dtype = tc.dtype if tc.dtype != "auto" else ("bfloat16" if cuda else "float32")
    if not tc.dry_run:
        if cuda:
            if cuda_missing():
                fail(cuda_missing())
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            if torch.cuda.device_count() < local_world:
                fail(f"{local_world} processes per node need {local_world} GPUs, but "
                     f"{torch.cuda.device_count()} are visible; lower --nproc_per_node"
                     + ("" if torch.cuda.device_count() else " or pass --device=cpu"))
            torch.cuda.set_device(device)
            tf32_matmuls()
        else:
            keep_freed_memory()
        if ddp:
            init_process_group("nccl" if cuda else "gloo", rank, world)
    torch.manual_seed(tc.seed)
    np.random.seed(tc.seed)
    random.seed(tc.seed)
    # Autocast runs the matmuls in bf16 while the weights, gradients and AdamW state stay
    # float32. CPU runs default to float32: exact and reproducible for tests and laptops.
    autocast = (torch.autocast(device.split(":")[0], dtype=torch.bfloat16)
                if dtype == "bfloat16" and not tc.dry_run else nullcontext())
    return dict(ddp=ddp, rank=rank, world=world, master=rank == 0, device=device, dtype=dtype,
                autocast=autocast)


def fit_batch(tc, world, typed):
    """The global batch of tc.total_batch_tokens -> (tc, gradient accumulation, note).

    It must be a whole number of micro-batches (batch_size x seq_len x world tokens). When the
    defaults do not divide for this world size, keep the global batch and lower batch_size
    (to no less than half), else move total_batch_tokens to its nearest valid value, and say
    so; values typed on the command line are never changed: they get an error instead."""
    micro = tc.batch_size * tc.seq_len * world
    if tc.total_batch_tokens % micro == 0:
        return tc, tc.total_batch_tokens // micro, None
    if "batch_size" not in typed:
        for b in range(tc.batch_size - 1, (tc.batch_size + 1) // 2 - 1, -1):
            if tc.total_batch_tokens % (b * tc.seq_len * world) == 0:
                accum = tc.total_batch_tokens // (b * tc.seq_len * world)
                return (replace(tc, batch_size=b), accum,
                        f"batch_size {tc.batch_size} -> {b}, so that {world} processes split "
                        f"the global batch of {tc.total_batch_tokens:,} tokens evenly")
    if "total_batch_tokens" not in typed:
        n = max(1, round(tc.total_batch_tokens / micro))
        return (replace(tc, total_batch_tokens=n * micro), n,
                f"total_batch_tokens {tc.total_batch_tokens:,} -> {n * micro:,}, the nearest "
                f"multiple of batch_size x seq_len x world_size = {tc.batch_size} x {tc.seq_len} x {world}")
    fail(f"total_batch_tokens={tc.total_batch_tokens} is not divisible by batch_size * seq_len * "
         f"world_size = {tc.batch_size} * {tc.seq_len} * {world} = {micro}; choose "
         f"--total_batch_tokens as a multiple of {micro} or change --batch_size")


def open_data(tc, mc, run):
    """The training loader and the fixed validation prefix of this rank."""
    try:
        loader = data.DistributedLoader(tc.data_dir, tc.batch_size, tc.seq_len, run["rank"], run["world"], tc.seed)
        val_loader = data.ValLoader(tc.data_dir, tc.batch_size, tc.seq_len, tc.val_tokens, run["rank"], run["world"])
    except data.NoShards as e:  # name the command that makes this run's kind of tokens
        fail(f"{e.problem}; make its shards with `{shards_command(tc, mc)}` (needs internet), or from "
             f"local text files with `{shards_command(tc, mc, local=True)}`", code=1)
    except data.ShardError as e:
        fail(str(e), code=1)
    return loader, val_loader


class StopRequest:
    """SIGTERM / SIGINT (Ctrl-C) ask the loop to stop after the current step; `signum` holds
    the first signal. A second signal abandons the step at once (no checkpoint), but not under
    torchrun: there a Ctrl-C reaches each rank twice (from the terminal, then forwarded by
    torchrun), and torchrun itself SIGKILLs workers that have not exited within its timeout."""

    def __init__(self, ddp):
        self.signum, self.ddp = None, ddp
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)

    def on_signal(self, signum, frame):
        if self.signum is not None and not self.ddp:
            raise KeyboardInterrupt
        self.signum = self.signum or signum


# ----------------------------------------------------------------------------- plan

def train_tokens_found(data_dir):
    """(train tokens in data_dir's shards, None) or (None, why there are none); reads only
    the shard headers."""
    try:
        return sum(len(data.load_shard(p)) for p in data.find_shards(data_dir, "train")), None
    except data.ShardError as e:
        return None, str(e)


DRY_RUN_ACTIONS = {"start": "start a new run in", "resume": "resume the run in", "refuse": "refuse"}
FOLDER_LINES = {"start": "new run", "resume": "resuming", "refuse": "a real run would refuse it: see the last line"}


def shards_command(tc, mc, local=False):
    """The data.py command that makes enough shards for this run in tc.data_dir: bytes for a
    byte model (vocab_size <= 256, or a folder recorded as bytes), else GPT-2 BPE tokens.
    local: from the user's own text files instead of a download."""
    recorded = os.path.exists(os.path.join(tc.data_dir, data.TOKENIZER_FILE))
    byte = (data.tokenizer_of(tc.data_dir)[0] if recorded else "byte" if mc.vocab_size <= 256 else "gpt2") == "byte"
    if tc.init_from:  # shards of the checkpoint's own tokenizer
        try:
            byte = pretrained_tokenizer(tc.init_from, mc).kind == "byte"
        except CheckpointError:  # no tokenizer.json yet (a dry run has warned): the folder's, once it has one
            byte = False
        if not byte:
            source = "'path/to/*.jsonl'" if local else "fineweb"
            planned = tc.max_steps * tc.total_batch_tokens
            total = planned + min(10_000_000, math.ceil(planned / 9))
            folder = hf_folder(tc.init_from, weights=False)  # a Hub id: its cached folder
            return (f"python data.py --tokenizer={folder} --source={source} --out_dir={tc.data_dir}"
                    + ("" if local else f" --max_tokens={math.ceil(total / 1e6) * 1_000_000}"))
    if local:
        return f"python data.py {'--tokenizer=byte ' if byte else ''}--source='path/to/*.jsonl' --out_dir={tc.data_dir}"
    planned = tc.max_steps * tc.total_batch_tokens
    if byte:  # data.py's --max_tokens counts the val shard too (a tenth, at most 10M): leave room for it
        total = planned + min(10_000_000, math.ceil(planned / 9))
        return f"python data.py --tokenizer=byte --source=fineweb --out_dir={tc.data_dir} --max_tokens={math.ceil(total / 1e6) * 1_000_000}"
    return f"python data.py --source=fineweb-gpt2 --out_dir={tc.data_dir} --shards={math.ceil(planned / SHARD_TOKENS)}"


def print_plan(tc, mc, run, accum, action):
    """The run's plan, printed once (rank 0) before the first step, with the data budget;
    action: what the run does with out_dir (folder_action)."""
    meta_model = meta_model_of(mc)  # the parameter count without allocating the weights
    n_params = meta_model.num_params()
    planned = tc.max_steps * tc.total_batch_tokens
    found, problem = train_tokens_found(tc.data_dir)
    make = shards_command(tc, mc)
    if found is None:
        data_line = f"no shards found at {tc.data_dir}" + (f" ({problem})" if "does not exist" not in problem else "")
    else:
        data_line = f"{found:,} training tokens found in {tc.data_dir}: {planned / found:.2f} epochs"
    window_line, window_warning = VARIANTS[mc.attn].describe(mc, tc.seq_len)
    precision = ("bfloat16 autocast, float32 master weights" if run["dtype"] == "bfloat16" else "float32")
    if run["device"].startswith("cuda"):
        precision += ", TF32 matmuls"
    model_line = (f"{tc.model} ({n_params / 1e6:.1f}M parameters)" if not tc.init_from else
                  f"{tc.init_from} ({n_params / 1e6:.1f}M parameters: {mc.n_layer} layers, {mc.n_head} query "
                  f"heads, {mc.n_kv_head} KV heads of {mc.head_dim}, d_model {mc.d_model}, vocab {mc.vocab_size}, "
                  f"from its config.json)")
    lines = [
        f"device      {run['device']} x {run['world']} process(es)" + (" (dry run)" if tc.dry_run else ""),
        f"precision   {precision}",
        f"model       {model_line}, preset {tc.preset}",
        *(init_plan(tc, meta_model) if tc.init_from else []),
        f"flops       {flops.describe(meta_model, tc.seq_len)} (flops.py; MFU in the log on A100/H100/H200)",
        f"attention   {mc.attn}, {attention_path(mc, run['device'])}",
        f"window      {window_line}",
        f"batch       {tc.total_batch_tokens:,} tokens/step = {tc.batch_size} seq x {tc.seq_len} tokens "
        f"x {run['world']} process(es) x {accum} accumulation",
        f"steps       {tc.max_steps:,}" + (f" (this job stops after {tc.stop_step:,})" if tc.stop_step else "")
        + f", lr {tc.lr:g}, warm-up {tc.warmup_steps}, cosine to {tc.min_lr_frac:g} x lr"
        + (f"; indexer lr {tc.indexer_lr:g}, dense for the first {tc.indexer_warmup} steps (indexer_warmup), "
           f"then sparse" if mc.attn == "indexer" else ""),
        f"tokens      {planned:,} planned; {data_line}",
        f"compile     " + ("on, block by block (model.compile_blocks: one layer's graph for all)" if tc.compile else "off"),
        f"preflight   " + ("on: kernel=" + mc.kernel + " checked against kernel=ref before step 1, with a fallback"
                           if preflight_on(tc, run["device"]) and mc.kernel != "ref" else "off"),
        f"run folder  {tc.out_dir} ({FOLDER_LINES[action]})",
    ]
    print("plan\n  " + "\n  ".join(lines), flush=True)
    if window_warning:
        print(f"warning: {window_warning}", flush=True)
    if found is None:
        print(f"warning: no shards found at {tc.data_dir}; this run needs {planned:,} tokens: {make}", flush=True)
    elif planned > found:
        print(f"warning: the run plans {planned:,} tokens but {tc.data_dir} holds {found:,} "
              f"training tokens, so it repeats the data ({planned / found:.2f} epochs); to see "
              f"each token once: {make}", flush=True)


def init_plan(tc, meta_model):
    """The plan's lines for --init_from: what comes from the checkpoint, what is new, and which
    parameters train in each stage (names with their layer numbers folded into '*')."""
    new = new_parameters(meta_model)
    total = meta_model.num_params()
    n_new = sum(p.numel() for p in new.values())
    lines = [f"init        {len(hf_parameters(meta_model)) - len(new)} tensors from {tc.init_from}"
             + (f"; new (initialised by the variant's init_gates): {', '.join(fold_layers(new))} "
                f"({len(new)} tensors, {n_new:,} parameters)" if new else "; no new parameters")]
    indexer = meta_model.cfg.attn == "indexer"
    kl = ", the indexer by its KL loss alone" if indexer else ""
    if tc.warmup_new_steps:
        dense = ""
        if indexer and tc.indexer_warmup:  # [DS32]: the two warm-ups are one unless both flags were given
            dense = (", dense attention ([DS32] warm-up)" if tc.indexer_warmup == tc.warmup_new_steps else
                     f", dense attention in steps 1-{tc.indexer_warmup}")
        lines.append(f"stages      steps 1-{tc.warmup_new_steps}: the new parameters alone ({n_new:,}; every pretrained "
                     f"one frozen){dense}{kl}; steps {tc.warmup_new_steps + 1}-{tc.max_steps}: all {total:,} "
                     f"parameters{kl}")
    else:
        lines.append(f"stages      all {total:,} parameters train from step 1 (--warmup_new_steps=N trains the new "
                     f"ones alone first)" if new else f"stages      all {total:,} parameters train from step 1")
    return lines


def plan_run(tc, mc, run, accum, note):
    """Print the plan (rank 0) and decide what the run does with out_dir -> whether it resumes.
    A dry run prints the plan whatever the folder holds and says what a real run would do with
    it; a real run stops at a folder it may not use (folder_action says why) before the plan."""
    # A real run leaves the model config's check to train.py's resume(), which reads the checkpoint.
    action, why = folder_action(tc, os.path.join(tc.out_dir, "ckpt.pt"), mc if tc.dry_run else None)
    if action == "refuse" and not tc.dry_run:
        fail(why)
    if run["master"]:
        print_plan(tc, mc, run, accum, action)
        if note:
            print(f"note: {note}")
        if tc.dry_run:
            print(f"dry run: a real run would {DRY_RUN_ACTIONS[action]} {tc.out_dir}" + (f": {why}" if why else ""))
    return action == "resume"


def folder_action(tc, ckpt_path, mc=None):
    """What the run does with out_dir -> ("start" | "resume" | "refuse", why it refuses).

    --resume=false refuses a folder that already holds a run, --resume=true a folder that
    holds none, --resume=auto takes whichever applies. A torchrun restart (the group was
    restarted after a worker died) resumes as auto, whatever the command line says. Given mc,
    a run of another model config (its config.json) is refused too, as `resume` would."""
    mode, exists = tc.resume, os.path.exists(ckpt_path)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        mode = "auto"
    if mode == "false" and exists:
        return "refuse", (f"{tc.out_dir} already holds a run (ckpt.pt); pass --resume=True to continue "
                          f"it, or choose another --out_dir")
    if mode == "true" and not exists:
        return "refuse", (f"--resume=True but {ckpt_path} does not exist; drop --resume (or use "
                          f"--resume=auto) to start a new run")
    if exists and mc is not None:
        try:
            with open(os.path.join(tc.out_dir, "config.json")) as f:
                saved = json.load(f)["model"]
        except (OSError, ValueError, KeyError, TypeError):
            saved = {}  # no readable config.json: resume() checks the checkpoint itself
        changed = {k: (v, getattr(mc, k, None)) for k, v in saved.items() if getattr(mc, k, None) != v}
        if changed:
            return "refuse", (f"the model config differs from the run in {tc.out_dir}: {changed} "
                              f"(saved, now); resume with the same model settings or choose another --out_dir")
    return ("resume" if exists else "start"), None


# ----------------------------------------------------------------------------- preflight

# Fallbacks, best first, for an attention path that fails its preflight.
FALLBACKS = ("blockwise", "ref")
# The tokens a preflight compares on, at most: the reference (attention.py as written) holds
# every layer's (T, T) scores for the backward, which at T = 8192 outgrew an H200's 140 GB
# (qwen-134m, batch 2); at 2048 the same kernels run, over fewer of their tiles.
PREFLIGHT_TOKENS = 2048


def preflight_on(tc, device):
    return tc.preflight == "on" or (tc.preflight == "auto" and device.startswith("cuda"))


def preflight(raw_model, x, mc, run, typed):
    """On CUDA (or --preflight=on): before the first step, run the chosen attention path's
    forward and backward on a slice of real data (x: (B, T) tokens, the first PREFLIGHT_TOKENS
    of each row, as the run's autocast runs it) against the reference path (kernel='ref',
    attention.py), and check the loss and every gradient. Where the chosen path raises (a kernel the GPU's compiler rejects, as
    asga's learned gate did on torch 2.13) or disagrees beyond rounding, the run switches to
    the first of FALLBACKS that passes and says so in one line; a --kernel typed on the command
    line stops the run with that line instead. Every rank checks every path and the ranks
    agree on the choice (one all-reduce), so they all run the same kernels. Returns the
    kernel the run uses; the model's modules are switched to it (model.set_kernel).

    Beyond rounding: in float32, a relative error above 1e-3 against the reference. In bf16,
    every path is compared with the reference run in float32, and may be as far from it as
    the reference run in bf16 is, twice over (and at least 5e-2): where a variant selects keys
    (caa's top-k, NSA's and MoBA's blocks, the indexer's keys) bf16's rounding flips the choice
    between nearly tied keys, which at initialisation are most of them, so two correct bf16
    paths differ by ~1e-1 (caa, two layers of qwen-134m, T = 1024, on a CPU: the bf16 reference
    1.2e-1 from float32, the fused path 1.1e-1, and 1.0e-1 from each other; on an H200, all 12
    layers, the fused path was 1.5e-1 from the bf16 reference, which a fixed 5e-2 bound failed).
    A wrong kernel inside that noise is left to the float32 tests and the interpret check."""
    chosen = mc.kernel
    if chosen == "ref":
        return chosen
    x = x[:, :PREFLIGHT_TOKENS + 1]
    device = run["device"]
    paths = [chosen] + [k for k in FALLBACKS if k != chosen]
    bf16 = run["dtype"] == "bfloat16"

    def loss_and_grads(kernel, autocast=run["autocast"]):
        set_kernel(raw_model, kernel)
        raw_model.zero_grad(set_to_none=True)
        with autocast:
            _, loss = raw_model(x[:, :-1], x[:, 1:])
            kl = raw_model.indexer_loss()
        (loss if kl is None else loss + kl).backward()
        grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float()
                           for p in raw_model.parameters()])
        raw_model.zero_grad(set_to_none=True)
        return loss.detach().float(), grads

    def error(a, b):  # relative error of a (loss, grads) against b, the worse of the two
        return max(abs(a[0] - b[0]).item() / max(abs(b[0]).item(), 1e-6),
                   ((a[1] - b[1]).norm() / b[1].norm().clamp(min=1e-12)).item())

    try:
        ref = loss_and_grads("ref")
        # bf16: the float32 reference, and how far the bf16 reference is from it
        base = loss_and_grads("ref", torch.autocast(device.split(":")[0], enabled=False)) if bf16 else ref
    except Exception as e:
        set_kernel(raw_model, chosen)
        fail(f"preflight: the reference attention path (kernel=ref) itself failed on {device}: "
             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; lower --seq_len or --batch_size, "
             f"or skip the check with --preflight=off", code=1)
    noise = error(ref, base) if bf16 else 0.0
    tol = max(5e-2, 2 * noise) if bf16 else 1e-3
    against = (f"the float32 reference (bound {tol:.1e}: twice the bf16 reference's {noise:.1e}, at least 5e-2)"
               if bf16 else f"the reference (bound {tol:g})")
    verdicts = {}
    for kernel in paths:
        if kernel == "ref":
            verdicts[kernel] = (True, "the reference")
            continue
        try:
            err = error(loss_and_grads(kernel), base)
            verdicts[kernel] = (err <= tol, f"relative error {err:.1e} against {against}")
        except Exception as e:  # a compile or launch error: the one-line reason
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            verdicts[kernel] = (False, f"{type(e).__name__}: {first[:300]}")
    passed = torch.tensor([float(verdicts[k][0]) for k in paths], device=device)
    if run["ddp"]:
        dist.all_reduce(passed, op=dist.ReduceOp.MIN)  # a path passes only where it passed on every rank
    use = next(k for k, ok in zip(paths, passed.tolist()) if ok)
    set_kernel(raw_model, use)
    name = lambda k: f"kernel={k} ({attention_path(replace(mc, kernel=k), device).split(': ', 1)[1]})"
    if use == chosen:
        if run["master"]:
            print(f"preflight: {name(chosen)} matches the reference: {verdicts[chosen][1]}", flush=True)
        return use
    why = verdicts[chosen][1] if not verdicts[chosen][0] else "failed on another rank"
    if "kernel" in typed:
        fail(f"preflight: {name(chosen)} failed: {why}; pick another --kernel ({', '.join(FALLBACKS)}; "
             f"{use} passed here) or skip the check with --preflight=off", code=1)
    if run["master"]:
        print(f"preflight: {name(chosen)} failed: {why}; this run uses {name(use)} instead "
              f"(slower; please report the failure with `python benchmarks/gpu_check.py`)", flush=True)
    return use
