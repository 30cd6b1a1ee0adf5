"""The Qwen3 decoder, exactly (same math as Hugging Face transformers' Qwen3 given the same
weights), with the attention variant chosen by `ModelConfig.attn` (see attention.py).

    x = embed(idx)
    for each block:  x = x + attn(rmsnorm(x));  x = x + mlp(rmsnorm(x))
    logits = head(rmsnorm(x))            head tied to the embedding by default

`python model.py` prints the parameter count of every preset.
"""
import copy
import json
import math
import os
import pickle
import random
import re
import sys
import time
import types
import zipfile
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
import torch.nn as nn
import torch.fx.experimental._config  # noqa: F401 - compile_decoding patches its duck sizing
import torch.nn.functional as F

from attention import VARIANTS, AttentionConfig, RMSNorm, RopeTable
from kernels import compiled_helper_usable


@dataclass
class ModelConfig(AttentionConfig):
    """The decoder's sizes. The attention's settings, the heads' shape among them, are
    AttentionConfig's (attention.py), one comment each."""
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64
    n_layer: int = 2
    mlp_hidden: int = 192
    tie_embeddings: bool = True
    # moba: the last this-many layers use full attention ([MoBA] §3.2's layer-wise hybrid: 3 of
    # 32 layers for Llama-8B-1M); for runs that follow the paper's long-context recipe
    moba_full_last: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.attn == "moba" and not 0 <= self.moba_full_last <= self.n_layer:
            raise ValueError(f"moba_full_last={self.moba_full_last} must be in 0 .. n_layer={self.n_layer}")


# Named sizes. qwen-134m: this project's choice of a 134M-parameter Qwen3 (12 layers, 12 heads
# of 64, d_model 768, MLP width set so the tied-embedding count is ~134M), matching the
# parameter count the papers state. The papers' own shapes differ (short names as in
# attention.py's references): [DSA] 12 heads of 128; [DSA-A] d_model 1536, FFN 8960, 28 layers,
# ~1.4B parameters. small: ~16M, trains at ~800 tok/s on 2 CPU cores.
PRESETS = {
    "tiny": dict(n_layer=2, n_head=4, n_kv_head=4, head_dim=16, d_model=64, mlp_hidden=192),
    # bytes: the CPU default (train.py's cpu preset) on byte shards, ~0.9M parameters; the
    # shape of nanoGPT's CPU character-level Shakespeare model (4 layers, d_model 128).
    "bytes": dict(n_layer=4, n_head=4, n_kv_head=4, head_dim=32, d_model=128, mlp_hidden=384,
                  tie_embeddings=False, vocab_size=256),  # train.py sets the data folder's vocab anyway
    "small": dict(n_layer=4, n_head=4, n_kv_head=4, head_dim=64, d_model=256, mlp_hidden=768),
    "qwen-134m": dict(n_layer=12, n_head=12, n_kv_head=12, head_dim=64, d_model=768, mlp_hidden=2432),
}
MODEL_FIELDS = {f.name for f in fields(ModelConfig)}


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def layer_variant(cfg, layer):
    """The attention class of layer `layer`: moba_full_last puts full attention in MoBA's last
    layers ([MoBA] §3.2's layer-wise hybrid); every other layer gets cfg.attn."""
    if cfg.attn == "moba" and layer >= cfg.n_layer - cfg.moba_full_last:
        return VARIANTS["full"]
    return VARIANTS[cfg.attn]


class Block(nn.Module):
    # Without a gradient (a prefill, an evaluation), rows past this many go through the norm
    # and the MLP this many at a time, added into x in place: per row the same maths (to
    # rounding: a product's blocking may differ with its rows), but the MLP's (T, mlp_hidden)
    # activations of a long prompt (at T = 32768 and qwen-134m's widths, three of 320 MB) are
    # never made whole. On a CPU each such fresh tensor is faulted in page by page: a one-layer
    # `full` prefill at 32768 in a fresh process took 28.6-31.3 s with them, 27.3-28.2 s in
    # pieces, its peak memory 1.92 -> 1.42 GB (in a process that prefilled before, within the
    # spread: benchmarks/decode_ab_cpu.md).
    MLP_ROWS = 4096

    def __init__(self, cfg, layer=0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = layer_variant(cfg, layer)(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, start, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start, cache)
        T, rows = x.shape[1], self.MLP_ROWS
        if T <= rows or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return x + self.mlp(self.post_attention_layernorm(x))
        for t0 in range(0, T, rows):  # x is this block's own tensor (the sum above): written in place
            part = x[:, t0:t0 + rows]
            part += self.mlp(self.post_attention_layernorm(part))
        return x


def _onednn_linear(x, weight, bias):
    """oneDNN's linear (the op inductor's own CPU code calls for a linear)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _weight_major_linear(x, weight, bias):
    """x W^T + b computed as (W x^T)^T: MKL's product with the weight's rows as its long side,
    where F.linear hands it the few rows of x as that side (on an Intel AVX-512 CPU, 8 rows
    through qwen-134m's MLP: 0.7-0.85x F.linear's time)."""
    rows = x.reshape(-1, x.shape[-1]).t()
    y = torch.mm(weight, rows) if bias is None else torch.addmm(bias[:, None], weight, rows)
    return y.t().contiguous().view(*x.shape[:-1], weight.shape[0])


def _multiply_sum(row, weight):
    """row W^T as a product and a sum over the inputs, for inductor to compile."""
    return (row[:, None, :] * weight).sum(-1)


class FormRefused(RuntimeError):
    """A DecodeLinear form that does not take these inputs: the measuring drops it for the size,
    and a call through it (a form fixed by DECODE_LINEAR, or one measured before, called under
    a dispatch mode) runs F.linear instead."""


# _inductor_linear takes one row of x and a weight of at least INDUCTOR_WEIGHT elements: with more
# rows it reads the weight once a row (1.04-1.12x F.linear's time at 8 rows out of cache), and
# below this size a call's ~25 us outlasts the product (F.linear 5 us for 768 -> 12). So its
# graphs are one per input width of a model's large products (each loop unrolled), the output
# count dynamic: a few, well within dynamo's recompile limit.
INDUCTOR_WEIGHT = 1 << 16


def _inductor_linear(x, weight, bias):
    """x W^T + b for one row of x, as a multiply and a sum over the inputs compiled by inductor
    (C++ on a CPU) into one loop that reads each weight row once, the row from cache. MKL's and
    oneDNN's one-row products read a weight out of cache at 16-26 GB/s on an AMD EPYC with
    AVX-512, a plain sum over it at 27-35; this loop at 28-35 (benchmarks/decode_linear.py).
    FormRefused for more rows or a smaller weight (`INDUCTOR_WEIGHT`), from the first failed
    compile on (no C++ compiler), and under a Python dispatch mode (an op counter, a
    profiler's: a compiled call there runs its later calls uncompiled too,
    kernels.compiled_helper_usable), where DecodeLinear.product runs F.linear instead."""
    if x.numel() != x.shape[-1] or weight.numel() < INDUCTOR_WEIGHT:
        raise FormRefused(f"inductor's form takes one row and a weight of at least {INDUCTOR_WEIGHT} elements")
    if not compiled_helper_usable():
        raise FormRefused("inductor's form runs no compiled call under a Python dispatch mode")
    fn = DecodeLinear.multiply_sum()
    weight_ = weight.view(weight.shape)  # marked below: a view, not the parameter
    torch._dynamo.maybe_mark_dynamic(weight_, 0)  # any count of outputs
    try:
        y = fn(x.reshape(1, -1), weight_)
    except Exception as e:  # a new shape that fails to compile: this form is refused from now on
        DecodeLinear.multiply_sum_failed(e)
        raise FormRefused(f"the compiled multiply and sum failed: {DecodeLinear.compile_failure}") from e
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


@torch.library.custom_op("sparse_attention::decode_linear", mutates_args=())
def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`DecodeLinear.product` (the form measured fastest for this size), opaque to inductor:
    inside a compiled decoding step the weights' products run as the eager step runs them
    (inductor lowers a linear to MKL's mm; side by side, compiled steps with oneDNN's linear
    in its place took 0.93-0.96x the time at batch 8 on an AMD CPU)."""
    return DecodeLinear.product(x, weight, bias)


@decode_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class DecodeLinear(nn.Linear):
    """nn.Linear whose decode-sized products on a CPU (at most ROWS rows, float32, no gradient,
    outside autocast) run through the fastest of four forms of the same product, measured
    at the first call of each size (rows, weight shape) on that call's own inputs, in turns,
    each on weights out of the CPU's caches as a step finds them (`_measure`): oneDNN's
    linear, F.linear (MKL, the few rows as the long side), W x^T (MKL, the weight's rows
    as the long side) and inductor's compiled multiply and sum (`_inductor_linear`, one row's
    fastest on an AMD EPYC). They are the floor under every variant's step, and which
    is fastest depends on the CPU: on an AMD CPU oneDNN's took 0.86x F.linear's time at batch
    1 and 0.91x at batch 8; on an Intel AVX-512 CPU oneDNN's took 1.17x F.linear's at batch 1,
    and W x^T 0.76x at batch 8 (docs/performance_log.md). The forms round differently, so which
    one a size got is said once per form (outside a trace), and DECODE_LINEAR=<form> (a name
    of FORMS) fixes one for a process and its children: two runs then match to the bit.
    Larger calls, every gradient, every GPU and autocast run F.linear. Inside a compiled step
    the product is `decode_linear`. Model turns its nn.Linear modules into this class in
    place (the same parameters, ties and state_dict keys), so attention.py reads as
    nn.Linear."""
    ROWS = 64
    FORMS = {"oneDNN": _onednn_linear, "F.linear": F.linear, "W x^T": _weight_major_linear,
             "inductor": _inductor_linear}
    FORM = os.environ.get("DECODE_LINEAR") or None  # a name of FORMS: every decode-sized product through it
    MEASURES = 5  # timings of each form at a size's first call (the best of them compared)
    COLD_BYTES = 64 << 20  # the weights a timing runs through (`_measure`; more than a CPU's caches)
    chosen = {}  # (rows, out_features, in_features, bias) -> the name of its form
    usable = None  # whether decode-sized products take these forms (False: F.linear; found at the first call)
    path = None
    cast = None  # the weight in a compiled decoding step's autocast dtype (`hold_casts`)
    _compiled_product = None  # the "inductor" form's compiled function; False once a compile failed
    compile_failure = None

    def forward(self, x):
        if self.cast is not None and torch.compiler.is_compiling() and not torch.is_grad_enabled() \
                and torch.is_autocast_enabled(x.device.type) and torch.get_autocast_dtype(x.device.type) == self.cast.dtype:
            return F.linear(x, self.cast, self.bias)  # autocast casts x and the bias, as it would have the weight
        if (not torch.is_grad_enabled() and x.device.type == "cpu"  # a training step stops at the first test
                and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and x.numel() <= self.ROWS * x.shape[-1]
                and not torch.is_autocast_enabled("cpu")):
            if torch.compiler.is_compiling():  # a compiled step: `usable` found before (compile_decoding)
                if DecodeLinear.usable:
                    return decode_linear(x, self.weight, self.bias)
            elif self._usable():
                return DecodeLinear.product(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    @classmethod
    def product(cls, x, weight, bias):
        """x W^T + b through FORM, or the form measured fastest for this size."""
        name = cls.FORM
        if name is None:
            key = (x.numel() // x.shape[-1], *weight.shape, bias is not None)
            name = cls.chosen.get(key) or cls._measure(key, x, weight, bias)
        elif name not in cls.FORMS:
            raise ValueError(f"DECODE_LINEAR={name!r} names no form of DecodeLinear.FORMS: pass one of "
                             f"{', '.join(repr(n) for n in cls.FORMS)}, or unset it to measure them")
        else:
            cls._say(f"{name} (DECODE_LINEAR)")
        try:
            return cls.FORMS[name](x, weight, bias)
        except FormRefused:  # (a fixed form's refused products, or any under a dispatch mode)
            return F.linear(x, weight, bias)

    @classmethod
    def _measure(cls, key, x, weight, bias):
        """The name of the fastest form for this size, each timed MEASURES times on these inputs
        in turns (the best of each: the first call of a form pays its one-time setup); a form
        this torch lacks or that refuses the inputs drops out. A timing runs the form through
        copies of the weight, COLD_BYTES of them (the weight alone where it is that large), each
        product on a weight out of the CPU's caches, as a decoding step finds its weights:
        between two reads of one, a step reads every other weight and the cache. Timed on the
        weight just read, the forms ranked apart from a step's: on an AMD EPYC with AVX-512,
        F.linear first at 1 x 768 -> 768 in cache (0.044 ms, oneDNN 0.063 ms), where through
        copies oneDNN took 0.58-0.89x F.linear's time at every size of the step
        (benchmarks/decode_linear.py)."""
        weights = cls.cold_copies(weight)
        times = {}
        for _ in range(cls.MEASURES):
            for name, form in cls.FORMS.items():
                if times.get(name, ()) is None:
                    continue
                t0 = time.perf_counter()
                try:
                    for w in weights:
                        form(x, w, bias)
                except (RuntimeError, AttributeError):  # (no oneDNN in this torch, or an input it refuses)
                    times[name] = None
                    continue
                times.setdefault(name, []).append((time.perf_counter() - t0) / len(weights))
        best = {name: min(t) for name, t in times.items() if t}
        cls.chosen[key] = name = min(best, key=best.get)
        if name not in {cls.chosen[k] for k in cls.chosen if k != key}:  # each form said once, where it first wins
            rows, out, inp, _ = key
            cls._say(f"{name} for {rows} x {inp} -> {out}, the fastest at that size's first call ("
                     + ", ".join(f"{n} {1e3 * t:.3f} ms" for n, t in sorted(best.items(), key=lambda kv: kv[1]))
                     + "; DECODE_LINEAR=<form> fixes one)")
        return name
    @staticmethod
    def hold_casts(linears, device_type, held):
        """Give each DecodeLinear of `linears` its weight in the autocast dtype now active on
        device_type, every cast made again when any weight changed since (its version or its
        storage); drop the casts without autocast. `held`: a dict the caller keeps between
        calls (the key of the casts made): a step whose weights did not change compares one
        tuple of their versions and storages (~150 µs for 197 weights on a busy 2-core CPU). A compiled decoding step reads these casts (`compile_decoding`):
        traced, autocast is a cast of every weight inside the graph, run every step, where
        eager autocast keeps its casts while its region lasts. Under bf16 autocast on a GPU that
        cast was a step's largest read of its weights: each float32 weight read, written as
        bf16 and read again, 4x the bf16 weights' bytes (the head of a real vocabulary the
        most). The casts take the weights' size in that dtype, as autocast's own cache does."""
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        weights = [m._parameters["weight"] for m in linears]  # (m.weight, through nn.Module.__getattr__: 10x the time)
        key = dtype and (dtype, tuple((w._version, w.data_ptr()) for w in weights))
        if key == held.get("key"):
            return
        for m, w in zip(linears, weights):
            w = w.detach()
            if dtype is None or w.device.type != device_type or w.dtype == dtype:  # (nothing to cast)
                m.cast = None
            elif m.cast is None or m.cast.dtype != dtype or m.cast.shape != w.shape or m.cast.device != w.device:
                m.cast = w.to(dtype, copy=True)
            else:
                m.cast.copy_(w)  # in place: the same tensor, the graph's input, the new values
        held["key"] = key

    @classmethod
    def cold_copies(cls, weight, nbytes=None):
        """[weight, copies of it]: nbytes of them (COLD_BYTES by default), the weight alone where
        it is that large. Run through in turn, each product reads its weight from memory."""
        nbytes = cls.COLD_BYTES if nbytes is None else nbytes
        return [weight] + [weight.clone() for _ in range(nbytes // (weight.nbytes or 1) - 1)]

    @classmethod
    def multiply_sum(cls):
        """`_multiply_sum` through torch.compile (compiled at each new shape's first call);
        FormRefused once a compile failed."""
        if cls._compiled_product is None:
            cls._compiled_product = torch.compile(_multiply_sum, dynamic=False)
        if cls._compiled_product is False:
            raise FormRefused(f"the compiled multiply and sum failed: {cls.compile_failure}")
        return cls._compiled_product

    @classmethod
    def multiply_sum_failed(cls, e):
        cls._compiled_product = False
        cls.compile_failure = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
        cls._say(f"inductor's form refused from now on (torch.compile failed: {cls.compile_failure})")

    @classmethod
    def _usable(cls):
        if cls.usable is None:
            cls.usable = True
        return cls.usable

    @classmethod
    def _say(cls, path):
        if cls.path != path:
            cls.path = path
            print(f"model.py: decode-sized linear products on a CPU: {path}", file=sys.stderr, flush=True)


class Rows:
    """Rows of positions start .. end - 1 along dim -2 of a tensor grown in place: a step
    writes its rows into spare capacity, never copying what is held (`torch.cat` per token
    copied the whole cache every step). When the capacity runs out, the rows still held move
    to a new buffer of twice their size: a copy of each row at most once per that many rows
    written, so a step costs what it writes, amortised, and a window's cache, whose oldest
    rows are dropped as it rolls, stays within twice the window. Given the length to come
    (`capacity`), the first buffer holds that many rows and no more, as nanochat's KVCache and
    Hugging Face's static cache preallocate for a known maximum length."""

    def __init__(self, keys_last=False, capacity=0):
        self.data = None  # (..., capacity, X)
        self.capacity = capacity  # rows the first buffer holds (0: twice the first append's)
        self.lo = self.hi = 0  # rows lo .. hi - 1 of data hold positions start .. end - 1
        self.start = 0
        # On a CPU, store the positions as the fastest-moving dim ((..., X, capacity) in memory,
        # the same (..., capacity, X) tensor to every reader): for what a decoding step reads
        # along the keys (full's keys and values, asga's per-key gate term, nsa's compressed keys
        # and values: the layer's `keys_last_kv` and `keys_last_summaries`)
        self.keys_last = keys_last

    def _zeros(self, like, rows):
        """Zeros (..., rows, X) on like's device and dtype, laid out as `keys_last` says."""
        if self.keys_last and like.device.type == "cpu":
            return like.new_zeros(*like.shape[:-2], like.shape[-1], rows).transpose(-2, -1)
        return like.new_zeros(*like.shape[:-2], rows, like.shape[-1])

    @property
    def end(self):
        return self.start + self.hi - self.lo

    def __len__(self):
        return self.hi - self.lo

    def append(self, x):
        """Write x (..., n, X), the positions end .. end + n - 1, in place. Spare capacity is
        zeros, never uninitialised memory: a read of whole blocks (kernels._cached_rows) may
        read past the last row, and masks what it read there, which a NaN would survive."""
        n = x.shape[-2]
        if n == 0 and self.data is not None:  # nothing to write: a traced step's empty write
            return  # failed to lower for a GPU (a division by its zero size in inductor's Triton indexing)
        # a spare row always: a view never spans the whole buffer, so its layout (contiguous
        # or not) does not change with the step, which a compiled step would guard on
        if self.data is None or self.hi + n >= self.data.shape[-2]:
            self._move(self._size(len(self) + n, first=self.data is None), x)
        self.data[..., self.hi:self.hi + n, :] = x
        self.hi += n

    def _size(self, rows, first):
        """Rows of a new buffer that must hold `rows`: the first buffer `capacity` where that holds
        them and a spare (the positions the caller said are coming: a prompt and the tokens to
        generate, no more), else twice `rows`."""
        return self.capacity if first and self.capacity > rows else 2 * rows

    def _move(self, rows, like):
        """The rows held moved to the front of a new buffer of `rows` rows (zeros past them)."""
        held = self.view()
        data = self._zeros(like, rows)
        if held is not None:
            data[..., :len(self), :] = held
        self.data, self.lo, self.hi = data, 0, len(self)

    def view(self):
        """(..., end - start, X): the rows held, a view (no copy)."""
        return None if self.data is None else self.data[..., self.lo:self.hi, :]

    def drop_before(self, position, free=False):
        """Forget the rows of positions < position; past the last row held, the next row
        appended is then that position's. Nothing moves, unless `free` (after a prompt) and
        more rows were dropped than are held (a window keeps a long prompt's last keys): then
        the rows held move to a buffer without the dropped ones, as large as the rows held and
        the positions still to come in this one (with a capacity; else twice the rows held),
        so a window does not keep a long prompt's rows for its few keys. A one-token step's drop
        moves nothing: its buffer stays put, as a compiled step's graph needs."""
        drop = min(max(0, position - self.start), len(self))
        self.lo += drop
        self.start = max(self.start + drop, position)
        if free and self.lo > len(self):
            self._move(self.data.shape[-2] - self.lo if self.capacity else 2 * len(self), self.data)

    def repeat_batch(self, n):
        """Each batch row repeated n times (a benchmark fills a cache at batch 1, then reads it at batch n)."""
        if self.data is not None:
            held = self.view().repeat_interleave(n, dim=0)
            self.data = self._zeros(held, self._size(held.shape[-2], first=True))
            self.data[..., :held.shape[-2], :] = held
            self.lo, self.hi = 0, held.shape[-2]

    def nbytes(self):
        held = self.view()
        return 0 if held is None else held.numel() * held.element_size()

    def allocated(self):
        return 0 if self.data is None else self.data.numel() * self.data.element_size()


def _pending_span(rows, now, new, first, last):
    """Positions first .. last - 1 of the pending `rows` followed by `now` (positions new ..):
    a view of `now` where they all lie in it (a prefill's), else the two joined."""
    if first >= new:
        return now[..., first - new:last - new, :]
    return torch.cat([rows.view()[..., first - rows.start:, :], now], -2)[..., :last - first, :]


class KVCache:
    """One layer's keys (post-norm, post-RoPE) and values, for the positions start .. end - 1
    (Python ints: nothing is read back from the device), written in place (`Rows`), and the
    layer's `summaries`: what its selection reads instead of every key (MoBA's block means,
    NSA's compressed keys and values, Combiner's span summaries, the indexer's keys), one per
    window of positions (the layer's `summary_window()`, length and stride), appended when a
    window completes, so a decoding step reads the summaries and never recomputes them from
    every cached key.

    After each step the attention layer trims what no later query can see
    (`oldest_key_needed`), so windowed variants keep a rolling cache of at most `window` keys
    between steps (window + 1 while a query attends), in a buffer of those and the positions
    still to come once a prompt's trim has freed the rest."""

    def __init__(self, capacity=0):
        """capacity: the positions its buffers hold before they first grow (0: twice the first
        append's): the prompt plus the tokens to generate, as sample.generate gives it, so the
        buffers are allocated once at that size (and a compiled step, `compile_decoding`, whose
        graph a growth would branch, never sees one)."""
        self.capacity = capacity
        self.k, self.v = (Rows(capacity=capacity + 1 if capacity else 0) for _ in range(2))  # a spare row
        self.summaries = None  # a Rows per summary tensor, one row per window, from window 0
        self.pending = None  # Rows of q (B, H, ., D) and x (B, ., C) from the first incomplete window on
        self.prompt = False  # whether the last update wrote several positions (`trim` then frees rows)

    @property
    def start(self):
        return self.k.start

    @property
    def end(self):
        return self.k.end

    def __len__(self):
        return len(self.k)

    def update(self, layer, q, k, v, x, start):
        """Append the keys/values (B, Hkv, T, D) of positions start ..; add the summaries of the
        windows they complete (layer.summarise over those windows' queries, keys, values and
        inputs). Returns views of every cached key and value, the first one's position, and
        the summaries (a tensor or tuple, as layer.summarise gives them; None for a layer
        without)."""
        if start != self.end:
            raise ValueError(f"the cache holds positions up to {self.end}, not {start}: feed tokens in order")
        if torch.is_autocast_enabled(k.device.type):
            # the keys in the dtype attention reads them in (kernels._same_dtype casts q, k, v to
            # autocast's): RMSNorm and RoPE hand back float32 keys beside bf16 values, and a
            # float32 key cache took twice the memory and was cast again by every decoding step,
            # a read, a write and a read of every cached key where one read of bf16 would do
            dtype = torch.get_autocast_dtype(k.device.type)
            k, v = k.to(dtype), v.to(dtype)
        if self.k.data is None:  # the layer says how its keys and values lie (the first append allocates)
            self.k.keys_last, self.v.keys_last = layer.keys_last_kv
        self.k.append(k)
        self.v.append(v)
        self.prompt = k.shape[-2] > 1
        window = layer.summary_window()
        summary = None
        if window is not None:
            summary = self.summarise(layer, window, q, x)
        return self.k.view(), self.v.view(), self.k.start, summary

    def summarise(self, layer, window, q, x):
        length, stride = window
        new = self.end - q.shape[-2]  # q and x hold the positions new .. end - 1
        if self.pending is None:
            # the queries and inputs of the positions past the last complete window only (fewer
            # than a window's length), in buffers sized for them and the positions still to come:
            # a prompt's whole would take more memory than its keys and values
            spare = max(0, self.capacity - self.end) + length + 1 if self.capacity else 0
            self.pending = (Rows(capacity=spare), Rows(capacity=spare))
            self.pending[0].start = self.pending[1].start = new
        done = 0 if self.summaries is None else len(self.summaries[0])  # windows summarised
        complete = max(0, (self.end - length) // stride + 1)  # windows i with i stride + length <= end
        if complete > done or self.summaries is None:  # (none complete yet: empty summaries)
            first, last = done * stride, max(done * stride, (complete - 1) * stride + length)  # their positions
            k0 = first - self.k.start
            q_w, x_w = (_pending_span(rows, now, new, first, last) for rows, now in zip(self.pending, (q, x)))
            new_summaries = layer.summarise(q_w, self.k.view()[:, :, k0:k0 + last - first],
                                            self.v.view()[:, :, k0:k0 + last - first], x_w, first)
            new_summaries = new_summaries if isinstance(new_summaries, tuple) else (new_summaries,)
            if self.summaries is None:
                held = self.capacity // stride + 2 if self.capacity else 0  # windows in `capacity` positions, a spare
                keys_last = layer.keys_last_summaries
                keys_last = keys_last if isinstance(keys_last, tuple) else (keys_last,) * len(new_summaries)
                self.summaries = tuple(Rows(keys_last=last, capacity=held) for last in keys_last)
            for rows, s in zip(self.summaries, new_summaries):
                rows.append(s)
        keep = complete * stride  # the inputs of the windows still incomplete, from the first of them on
        for rows, now in zip(self.pending, (q, x)):
            rows.drop_before(keep)
            rows.append(now[..., rows.end - new:, :])  # the new positions from max(keep, new) on
        views = tuple(rows.view() for rows in self.summaries)
        return views if len(views) > 1 else views[0]

    def trim(self, oldest):
        """Forget the keys and values before position `oldest`; after a prompt (an update of
        several positions), free the rows they took (`Rows.drop_before`)."""
        self.k.drop_before(oldest, free=self.prompt)
        self.v.drop_before(oldest, free=self.prompt)

    def repeat_batch(self, n):
        """Every batch row repeated n times, in every tensor held (benchmarks/decode.py fills a
        cache at batch 1 and decodes at batch n)."""
        for rows in self.rows():
            rows.repeat_batch(n)

    def nbytes(self):
        """Bytes held: keys, values, summaries and the pending windows' inputs."""
        return sum(rows.nbytes() for rows in self.rows())

    def allocated(self):
        """Bytes of the buffers those lie in (`nbytes` and the spare rows)."""
        return sum(rows.allocated() for rows in self.rows())

    def rows(self):
        return [self.k, self.v, *(self.summaries or ()), *(self.pending or ())]


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.rope_table = RopeTable(cfg.head_dim, cfg.rope_theta)  # cos, sin, computed once
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # std 0.02 everywhere (PyTorch's N(0, 1) embedding tied to the head made CPU steps 7x
        # slower through denormals), GPT-2's scaled init for the projections that write into
        # the residual stream, then each variant's own gate init (its docstring says why).
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))
            elif name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        for layer in self.layers:
            layer.self_attn.init_gates()
        for module in self.modules():  # decode-sized CPU products through oneDNN (DecodeLinear)
            if type(module) is nn.Linear:
                module.__class__ = DecodeLinear

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def new_cache(self, capacity=0):
        """One KVCache per layer, empty: pass it to forward as `cache` (sample.generate does).
        capacity: the positions to hold without growing (see KVCache)."""
        return [KVCache(capacity) for _ in self.layers]

    def forward(self, idx, targets=None, cache=None, last_only=False):
        """idx (B, T) token ids -> (logits (B, T, V) float32, mean cross-entropy or None).
        With `cache` (from `new_cache()`), idx continues the tokens already cached.
        last_only: the logits of the last position only, (B, 1, V), all that generation reads
        of a prompt (nanoGPT's inference shortcut): the head over every position of a 32768-token
        prompt is 1.3 T multiply-adds at GPT-2's 50304 tokens, and 6.6 GB of float32 logits."""
        B, T = idx.shape
        start = 0 if cache is None else cache[0].end  # position of idx[:, 0], a Python int
        cos, sin = self.rope_table(start, T, idx.device)
        x = self.embed_tokens(idx)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos.to(x.dtype), sin.to(x.dtype), start, None if cache is None else cache[i])
        if last_only:
            if targets is not None:
                raise ValueError("Model.forward: last_only=True gives no loss (it needs every position's "
                                 "logits); drop targets, or last_only")
            x = x[:, -1:]
        return self.head_and_loss(x, targets)

    def head_and_loss(self, x, targets=None):
        """The last norm, the head's float32 logits (B, T, V) and their mean cross-entropy with
        targets (None without)."""
        logits = self.lm_head(self.norm(x)).float()
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def indexer_loss(self):
        """The sum over layers of the indexer's KL loss ([DS32]; attention.IndexerAttention)
        from the last training-mode forward; None when no layer has one. The training loss
        adds it: it reaches the indexers alone."""
        losses = [layer.self_attn.indexer_loss for layer in self.layers
                  if getattr(layer.self_attn, "indexer_loss", None) is not None]
        return sum(losses) if losses else None

    def record_gates(self, on=True):
        """Make every attention layer keep what it notes (gates, selections; attention.py's
        `note`) from the next forward passes on."""
        for layer in self.layers:
            layer.self_attn.record_gates(on)

    def gate_tensors(self):
        """[per layer] {name: tensor (B, T, H) or (1, 1, H)} from the last recorded forward."""
        return [layer.self_attn.gates for layer in self.layers]

    def gate_stats(self):
        """{name: {'mean'|'std'|'frac_gt_half': [per layer][per head]}}, JSON-ready."""
        out = {}
        for layer in self.layers:
            for name, summary in layer.self_attn.gate_stats().items():
                for stat, per_head in summary.items():
                    out.setdefault(name, {}).setdefault(stat, []).append(per_head)
        return out


def compile_blocks(model, **compile_kwargs):
    """A view of `model` whose blocks are torch.compile'd one by one (regional compilation, as
    torchtitan compiles its transformer blocks), for training on a GPU.

    Every block runs the same code on its own weights, so dynamo traces Block.forward once and
    every layer reuses that graph (a second one for moba_full_last's full-attention layers):
    the trace, the backward and inductor's lowering are done for one layer, not n_layer times
    over as under torch.compile(model). benchmarks/compile_time.py measures both side by side.
    The tail (`head_and_loss`: the last norm, the head, the float32 logits and the
    cross-entropy) is compiled on its own: run eagerly, the cast and the loss's softmax made
    several passes over (B, T, V) logits (3.3 GB in float32 at qwen-134m's 16 x 1024 batch), a
    cost every variant pays, which inductor fuses. The embedding runs eagerly.

    The view shares every parameter and buffer with `model`, which stays uncompiled: its state
    dict (checkpoints), its gate recording and evaluations at other lengths run eagerly."""
    view = copy.copy(model)
    view._modules = dict(model._modules)  # its own table of submodules, holding the same modules
    view.layers = nn.ModuleList([torch.compile(layer, **compile_kwargs) for layer in model.layers])
    view.head_and_loss = torch.compile(model.head_and_loss, **compile_kwargs)
    return view


DECODING_RECOMPILE_LIMIT = 16  # graphs one compiled decoding step may make (see compile_decoding)


def compile_decoding(model, **compile_kwargs):
    """`model` for one-token decoding steps through torch.compile (gpt-fast compiles its
    decoding step so): inductor fuses a step's few hundred small ops (norms, RoPE, the
    selection's scores and top-k, the gathers) into a few kernels, where eager mode pays for
    each one (on a GPU a kernel launch each). Feed it the steps after an eager prefill:
    `step(token, cache=cache)`, as `model(...)`; the prefill stays eager (one call, its own
    shapes). Returns (step, how: a line saying what runs).

    Sizes are symbolic (dynamic=True), so a cache that grows by a row each step reuses one
    graph: the step's Python arithmetic on the cache's length is written without branches
    on it (`kernels.padded_block_scores`). What still makes a graph of its own, each once: a
    batch of 1 against larger ones; a summary window completing in the step or not (the
    cache's `complete > done`); a buffer growing, unless the cache holds the whole generation
    (`new_cache(capacity)`, as sample.generate makes it); and, while the cache is short,
    sizes of 0 or 1 (no summary yet, one) and a selection wider than the cache (fewer blocks
    than its top-n). A softmax over the cache's length sums its row in pieces on a CPU
    (`kernels._softmax_in_pieces`): inductor's C++ code sums more than 4096 float32 elements
    through a cascade helper, a guard on the length, and nsa's 4096th compressed key, at
    position 32783, compiled both graphs again (51.0 s and 31.5 s in two steps for one layer
    of qwen-134m's widths). With the capacity and a prompt past those, at most 2 graphs a
    batch size (tests/test_decode.py counts them). caa runs eager: how many keys it keeps is read from the data (ties with its k-th score), a size each step
    would compile anew. Past DECODING_RECOMPILE_LIMIT graphs a step fails, saying so,
    where dynamo would silently run it uncompiled. Under autocast (bf16 on a GPU) the step
    reads each weight as cast once in that dtype (`DecodeLinear.hold_casts`), not a cast of
    every weight traced into the graph and run every step."""
    if any(layer.self_attn.cfg.attn == "caa" for layer in model.layers):
        return model, "eager (caa keeps a number of keys read from the data: each step would compile anew)"

    def forward(idx, cache):
        return model(idx, cache=cache)
    # a code object of this model's own: dynamo keeps graphs, and counts them against its
    # recompile limit, per code object, and Model.forward's would hold every model's compiled
    # in the process (a benchmark compiles nine)
    forward = types.FunctionType(forward.__code__.replace(), globals(), "decoding_step", None, forward.__closure__)
    DecodeLinear._usable()  # found eagerly: a compiled step reads it (a check inside the trace would break it)
    compiled = torch.compile(forward, dynamic=True, **compile_kwargs)
    linears, casts = [m for m in model.modules() if isinstance(m, DecodeLinear)], {}

    def step(idx, cache):
        DecodeLinear.hold_casts(linears, idx.device.type, casts)  # under autocast: each weight cast once, not every step
        try:
            # no duck sizing: two buffers of the same size by chance (a key cache and a summary's)
            # would share one size in the graph and recompile once they part
            with torch._dynamo.config.patch(recompile_limit=DECODING_RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True), \
                    torch.fx.experimental._config.patch(use_duck_shape=False):
                return compiled(idx, cache)
        except torch._dynamo.exc.FailOnRecompileLimitHit as e:
            raise RuntimeError(f"the compiled decoding step has made {DECODING_RECOMPILE_LIMIT} graphs "
                               "(model.DECODING_RECOMPILE_LIMIT): something in the step branches on the "
                               "cache's length; TORCH_LOGS=recompiles says where") from e
    return step, "compiled (torch.compile, dynamic shapes: the first steps compile)"


# ----------------------------------------------------------------------------- checkpoints
# One saver and one loader for every checkpoint: train.py writes and resumes with them,
# sample.py, analyze.py and experiments/recall.py load models through them.

def set_kernel(model, kernel):
    """Switch every module of `model` to the core-op path `kernel` (attention.ops), on a copy
    of each module's config (the caller's ModelConfig, saved in checkpoints, is left as is)."""
    for m in model.modules():
        if isinstance(getattr(m, "cfg", None), ModelConfig):
            m.cfg = replace(m.cfg, kernel=kernel)


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the file and the problem."""


def save_checkpoint(path, ckpt):
    """Write `ckpt` (tensors, numbers, strings, None, lists, tuples and dicts only, so that
    read_checkpoint can load it weights-only). Atomic: a temporary file in the same folder,
    fsync, then a rename over the old one, so a kill at any moment leaves either the previous
    checkpoint or the new one, never half of one."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(ckpt, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)


def check_checkpoint_format(path):
    """A clear error for a file that is no checkpoint at all (a text file, a data shard, a
    .zip of something else) or a checkpoint cut short, before torch.load reports it as a
    refused pickle. torch.save writes a zip archive holding `<name>/data.pkl`; files from
    torch < 1.6 are a bare pickle, which starts with the PROTO opcode 0x80."""
    fix = "give a run folder holding ckpt.pt (e.g. out/run) or the ckpt.pt file train.py wrote"
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:2] != b"PK" and head[:1] != b"\x80":
        raise CheckpointError(f"{path}: not a checkpoint: torch.save writes a zip archive, and this "
                              f"file starts with {head!r}; {fix}")
    if head[:2] == b"PK":
        if not zipfile.is_zipfile(path):
            raise CheckpointError(f"{path}: a damaged checkpoint: the zip archive has no end (cut "
                                  f"short by a copy still in progress or a full disk?); copy it again, "
                                  f"or resume from the run folder, whose ckpt.pt is written atomically")
        with zipfile.ZipFile(path) as z:
            if not any(name.split("/")[-1] == "data.pkl" for name in z.namelist()):
                raise CheckpointError(f"{path}: not a checkpoint: a zip archive without the data.pkl "
                                      f"that torch.save writes; {fix}")


def read_checkpoint(path, device="cpu"):
    """A run folder (holding ckpt.pt) or a checkpoint file -> the checkpoint dict.

    Always weights-only (torch.load(weights_only=True)): unpickling may only build tensors
    and plain containers, so a checkpoint from someone else cannot run code on this machine.
    A file holding anything else is refused before any of it runs."""
    path = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else str(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint (give a run folder holding ckpt.pt, "
                              f"or the .pt file itself)")
    check_checkpoint_format(path)
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [line for line in str(e).splitlines() if "GLOBAL" in line or "nsupported" in line]
        reason = lines[0].strip() if lines else str(e).splitlines()[0]
        raise CheckpointError(
            f"{path}: refused: it holds objects other than tensors, numbers, strings, lists and "
            f"dicts ({reason}); checkpoints are loaded weights-only, so code inside one never "
            f"runs. A file you got from elsewhere may be malicious: open it by hand only if you "
            f"trust its source") from None
    except Exception as e:  # a truncated file, not a torch file, ...
        raise CheckpointError(f"{path}: cannot read the checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise CheckpointError(f"{path}: not a train.py checkpoint (expected a dict with "
                              f"'model' and 'model_config')")
    return ckpt


def load_checkpoint(path, device="cpu", kernel=None):
    """A run folder or checkpoint file -> (Model in eval mode on `device`, checkpoint dict).

    The model config travels in the checkpoint. `kernel` ('ref' | 'fused') overrides the
    saved one (the weights are the same). Config keys this ModelConfig does not know (a
    checkpoint from another version of this code) are dropped with a note."""
    ckpt = read_checkpoint(path, device)
    path = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else str(path)
    known = {f.name for f in fields(ModelConfig)}
    config = dict(ckpt["model_config"])
    unknown = sorted(set(config) - known)
    if unknown:
        print(f"note: {path}: ignoring model_config keys this ModelConfig lacks: {unknown}", file=sys.stderr)
    config = {k: v for k, v in config.items() if k in known}
    if kernel is not None:
        config["kernel"] = kernel
    try:
        model = Model(ModelConfig(**config))
        model.load_state_dict(ckpt["model"])
    except (ValueError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"{path}: the checkpoint does not fit the model ({e})") from None
    return model.to(device).eval(), ckpt


def rng_state(device):
    """Every random generator the run draws from, as tensors, ints, floats, lists and None, so
    the checkpoint loads weights-only (model.read_checkpoint) and resume stays bit-exact."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()  # ('MT19937', (624,) uint32, ...)
    version, internal, gauss_next = random.getstate()  # (3, 625 ints, float or None)
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.startswith("cuda") else None,
            "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
            "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next}}


def set_rng_state(state, device):
    """The inverse of rng_state."""
    torch.set_rng_state(state["torch"].cpu())
    if device.startswith("cuda") and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))


# ----------------------------------------------------------------------------- Hugging Face Qwen3
# A pretrained Qwen3 in (any variant), and a `full` model out, as Hugging Face folders:
# config.json, model.safetensors (or shards listed in model.safetensors.index.json) and the
# tokenizer.json that data.load_tokenizer reads. Our parameter names are Hugging Face's without
# its "model." prefix (lm_head has none in either), so every pretrained tensor has one place; a
# variant's own parameters (its gates, indexers, compressors) are not in the checkpoint and keep
# the initialisation its init_gates documents.

HF_ARCHITECTURE = "Qwen3ForCausalLM"
NEW = "new, initialised by the variant"
# ModelConfig field <- Qwen3 config.json key; rope_theta is read apart (two spellings).
HF_SIZES = dict(vocab_size="vocab_size", n_layer="num_hidden_layers", n_head="num_attention_heads",
                n_kv_head="num_key_value_heads", head_dim="head_dim", d_model="hidden_size",
                mlp_hidden="intermediate_size", norm_eps="rms_norm_eps", tie_embeddings="tie_word_embeddings")
HF_WEIGHTS, HF_INDEX = "model.safetensors", "model.safetensors.index.json"


def hf_folder(name_or_path, weights=True):
    """A Hugging Face checkpoint folder, or a Hub id ('Qwen/Qwen3-0.6B') downloaded once with
    huggingface_hub into its cache (later calls, offline too, read the cache) -> the local
    folder. weights=False fetches the JSON files alone (a plan needs no weights)."""
    path = os.path.expanduser(str(name_or_path))
    if os.path.isdir(path):
        return path
    if os.path.exists(path) or not re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", path):
        what = "not a folder" if os.path.exists(path) else "no such folder"
        raise CheckpointError(f"{name_or_path}: {what}; give a Hugging Face Qwen3 folder (config.json, "
                              f"{HF_WEIGHTS}, tokenizer.json) or a Hub id like Qwen/Qwen3-0.6B")
    import huggingface_hub  # lazy: only Hub ids need it

    patterns = ["config.json", "tokenizer.json"] + ([HF_INDEX, "*.safetensors"] if weights else [])
    try:
        return huggingface_hub.snapshot_download(path, allow_patterns=patterns)
    except Exception as e:  # offline, unknown repository, gated, ...: the Hub's own words, first line
        reason = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{path}: no such folder here, and the Hugging Face Hub cannot give it "
                              f"({type(e).__name__}: {reason}); check the name, or where there is no "
                              f"network, download it on a machine that has one (`hf download {path}`), "
                              f"copy the folder here and pass its path") from None


def read_hf_config(folder):
    """config.json of a Qwen3ForCausalLM folder -> dict; a clear error for anything model.py
    does not compute exactly (another architecture, biases, sliding windows, scaled RoPE)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder}: no config.json; give a Hugging Face checkpoint folder")
    try:
        with open(path) as f:
            config = json.load(f)
    except ValueError as e:
        raise CheckpointError(f"{path}: not JSON ({e})") from None
    archs, model_type = config.get("architectures") or [], config.get("model_type")
    if model_type != "qwen3" or (archs and HF_ARCHITECTURE not in archs):
        raise CheckpointError(f"{path}: {', '.join(archs) or 'no architectures'} (model_type {model_type!r}) "
                              f"is not supported; model.py loads {HF_ARCHITECTURE} (model_type qwen3)")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in config:
            raise CheckpointError(f"{path}: no {key}; a Qwen3 config.json states it")
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {config['hidden_act']!r}: model.py's MLP is SwiGLU (silu)")
    if config.get("attention_bias"):
        raise CheckpointError(f"{path}: attention_bias is true: model.py's q, k, v, o projections have no bias")
    n_layer = config["num_hidden_layers"]
    windowed = config.get("use_sliding_window") and config.get("sliding_window") is not None
    layer_types = config.get("layer_types") or [  # how transformers' Qwen3Config derives them
        "sliding_attention" if windowed and i >= config.get("max_window_layers", n_layer) else "full_attention"
        for i in range(n_layer)]
    sliding = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
    if sliding:
        raise CheckpointError(f"{path}: sliding-window attention (sliding_window {config.get('sliding_window')}) "
                              f"in layer(s) {', '.join(map(str, sliding))}: model.py's Qwen3 attends to every "
                              f"earlier token in every layer")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CheckpointError(f"{path}: scaled RoPE ({json.dumps(rope)}): model.py computes plain RoPE only")
    return config


def hf_model_config(path, **settings):
    """The ModelConfig of a Hugging Face Qwen3 (folder or Hub id): the sizes from its
    config.json, the vocabulary exactly as there (no padding), attn and the variant's settings
    (ModelConfig's other fields) from `settings`."""
    folder = hf_folder(path, weights=False)
    config = read_hf_config(folder)
    sizes = {field: config[key] for field, key in HF_SIZES.items() if key in config}
    sizes.setdefault("n_kv_head", config["num_attention_heads"])
    sizes.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    sizes.setdefault("tie_embeddings", False)  # Qwen3Config's default
    rope = config.get("rope_parameters") or {}
    sizes["rope_theta"] = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    for key in settings:
        if key in sizes:
            raise ValueError(f"{key} comes from {folder}/config.json ({sizes[key]}); drop it")
        if key not in MODEL_FIELDS:
            raise ValueError(f"unknown model setting {key!r}; valid: {', '.join(sorted(MODEL_FIELDS - set(sizes)))}")
    try:
        return ModelConfig(**sizes, **settings)
    except ValueError as e:  # e.g. a variant whose sizes do not fit this checkpoint's heads
        attn = settings.get("attn", "full")
        raise CheckpointError(f"{folder}: attn={attn} cannot use this checkpoint: {e}") from None


def hf_shapes(cfg):
    """{Hugging Face tensor name: shape} of every weight of a Qwen3ForCausalLM of cfg's sizes."""
    C, D, F = cfg.d_model, cfg.head_dim, cfg.mlp_hidden
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, C), "model.norm.weight": (C,)}
    for i in range(cfg.n_layer):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,),
            p + "self_attn.q_proj.weight": (cfg.n_head * D, C), p + "self_attn.k_proj.weight": (cfg.n_kv_head * D, C),
            p + "self_attn.v_proj.weight": (cfg.n_kv_head * D, C), p + "self_attn.o_proj.weight": (C, cfg.n_head * D),
            p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
            p + "mlp.gate_proj.weight": (F, C), p + "mlp.up_proj.weight": (F, C), p + "mlp.down_proj.weight": (C, F)})
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, C)
    return shapes


def our_name(hf_name):
    return hf_name.removeprefix("model.")


def hf_files(folder):
    """{tensor name: safetensors file} of a folder's weights (one file, or the shards its index
    lists)."""
    from safetensors import safe_open

    index = os.path.join(folder, HF_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = {name: os.path.join(folder, file) for name, file in weight_map.items()}
        absent = sorted({f for f in files.values() if not os.path.isfile(f)})
        if absent:
            raise CheckpointError(f"{index} lists {os.path.basename(absent[0])}, which is not in {folder}; "
                                  f"download the checkpoint again")
        return files
    single = os.path.join(folder, HF_WEIGHTS)
    if not os.path.isfile(single):
        raise CheckpointError(f"{folder}: no {HF_WEIGHTS} or {HF_INDEX} (weights in other formats, e.g. "
                              f"pytorch_model.bin, are not read: save them with safetensors)")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def check_norm_eps(model):
    """Every RMSNorm must compute with cfg.norm_eps, Hugging Face's one rms_norm_eps."""
    for name, m in model.named_modules():
        if isinstance(m, RMSNorm) and m.eps != model.cfg.norm_eps:
            raise CheckpointError(f"{name} computes with eps={m.eps} but rms_norm_eps is {model.cfg.norm_eps}: "
                                  f"this model.py gives that norm a fixed eps, so it cannot match the checkpoint")


def load_hf(path, device="cpu", **settings):
    """A Hugging Face Qwen3 (folder or Hub id) -> (Model in eval mode on `device`, summary).

    The model's sizes come from config.json (hf_model_config), attn and the variant's settings
    from `settings`. Strict: every tensor of the checkpoint is used, and a missing, unexpected
    or misshapen one is named. With attn='full' the model computes Hugging Face's logits; any
    other variant keeps every pretrained projection and norm and adds its own parameters,
    initialised by its init_gates. summary: {'folder', 'tokenizer' (its tokenizer.json or
    None), 'parameters': {our name: the Hugging Face tensor it holds, or NEW}}."""
    from safetensors import safe_open

    folder = hf_folder(path)
    cfg = hf_model_config(folder, **settings)
    shapes, files = hf_shapes(cfg), hf_files(folder)
    where = os.path.join(folder, HF_INDEX if os.path.isfile(os.path.join(folder, HF_INDEX)) else HF_WEIGHTS)
    missing = [name for name in shapes if name not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}: missing {missing[0]}{more}, which a {HF_ARCHITECTURE} of "
                              f"config.json's sizes has")
    extra = [n for n in files if n not in shapes and n != "lm_head.weight" and not n.endswith("rotary_emb.inv_freq")]
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]}: not part of a {HF_ARCHITECTURE} of "
                              f"config.json's sizes, and model.py would ignore it")
    model = Model(cfg)
    check_norm_eps(model)
    ours = model.state_dict()  # tensors sharing the parameters' storage
    by_file = {}
    for name in files:
        if name in shapes or name == "lm_head.weight":  # lm_head of a tied model: checked below
            by_file.setdefault(files[name], []).append(name)
    tied_head = None
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name in names:
                    if name not in f.keys():
                        raise CheckpointError(f"{file}: missing {name}, which {where} says it holds")
                    shape = tuple(f.get_slice(name).get_shape())
                    expected = shapes.get(name, (cfg.vocab_size, cfg.d_model))
                    if shape != expected:
                        raise CheckpointError(f"{file}: {name} has shape {shape} but config.json's sizes "
                                              f"make it {expected}: the weights are not this config's")
                    if name not in shapes:
                        tied_head = f.get_tensor(name)
                        continue
                    if our_name(name) not in ours:
                        raise CheckpointError(f"attn={cfg.attn}: the variant has no parameter {our_name(name)} "
                                              f"to hold {name}")
                    ours[our_name(name)].copy_(f.get_tensor(name))
    embed = model.embed_tokens.weight
    if tied_head is not None and not torch.equal(tied_head.to(embed.dtype), embed):
        raise CheckpointError(f"{where}: lm_head.weight differs from model.embed_tokens.weight, but config.json "
                              f"ties them (tie_word_embeddings); the checkpoint contradicts its config")
    tokenizer = os.path.join(folder, "tokenizer.json")
    summary = dict(folder=folder, tokenizer=tokenizer if os.path.isfile(tokenizer) else None,
                   parameters=hf_parameters(model))
    return model.to(device).eval(), summary


def hf_parameters(model):
    """{parameter name: the Hugging Face tensor load_hf fills it from, or NEW (the variant's own)}
    of a model of any variant (on the meta device too: a plan needs no weights)."""
    pretrained = {our_name(name): name for name in hf_shapes(model.cfg)}
    return {name: pretrained.get(name, NEW) for name, _ in model.named_parameters()}


def describe_hf_load(summary):
    """Lines for a run's plan: how many parameters came from the checkpoint, and which are
    new (layer numbers folded into '*')."""
    params = summary["parameters"]
    new = sorted({re.sub(r"\.\d+\.", ".*.", name) for name, source in params.items() if source == NEW})
    lines = [f"from {summary['folder']}: {len(params) - sum(s == NEW for s in params.values())} pretrained tensors"]
    lines += [f"  {name}: {NEW}" for name in new]
    return lines


def save_hf(model, out_dir, tokenizer_json=None, eos_token_id=None, dtype=None, max_position_embeddings=32768,
            tokenizer_config=None):
    """Write a `full` model as a Hugging Face Qwen3 folder that transformers' Qwen3ForCausalLM
    loads with the same logits: config.json, model.safetensors and, given its JSON text
    (data.TextTokenizer.json_text), tokenizer.json; given a dict, tokenizer_config.json (what
    transformers' AutoTokenizer reads beside it, e.g. data.BYTE_TOKENIZER_CONFIG). dtype: of
    the saved weights (default: the model's). max_position_embeddings: the context length
    config.json states (RoPE has no limit; transformers' generate stops there)."""
    from safetensors.torch import save_file

    cfg = model.cfg
    if cfg.attn != "full":
        raise CheckpointError(f"attn={cfg.attn}: only a 'full' model is a {HF_ARCHITECTURE}; a sparse "
                              f"variant attends to other keys (and may have parameters Qwen3 lacks), so "
                              f"keep it as a train.py checkpoint (save_checkpoint)")
    check_norm_eps(model)
    state = {("" if name.startswith("lm_head") else "model.") + name: t.detach().to(dtype or t.dtype).cpu().contiguous()
             for name, t in model.state_dict().items() if not (cfg.tie_embeddings and name == "lm_head.weight")}
    if set(state) != set(hf_shapes(cfg)):  # a model.py parameter Qwen3 lacks, or the reverse
        raise CheckpointError(f"the model's tensors are not a {HF_ARCHITECTURE}'s: "
                              f"{sorted(set(state) ^ set(hf_shapes(cfg)))[:3]}")
    config = {
        "architectures": [HF_ARCHITECTURE], "model_type": "qwen3",
        **{key: getattr(cfg, field) for field, key in HF_SIZES.items()},
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "rope_theta": cfg.rope_theta, "rope_scaling": None,  # transformers 4's spelling
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},  # transformers 5's
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layer,
        "max_position_embeddings": max_position_embeddings,
        "torch_dtype": str(next(iter(state.values())).dtype).removeprefix("torch."),
    }
    if eos_token_id is not None:
        config.update(bos_token_id=eos_token_id, eos_token_id=eos_token_id)
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, HF_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    if tokenizer_json is not None:
        with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(tokenizer_json)
    if tokenizer_config is not None:
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(tokenizer_config, f, indent=2)
            f.write("\n")
    return out_dir


if __name__ == "__main__":
    for name, preset in PRESETS.items():
        model = Model(ModelConfig(**preset))
        print(f"{name:10s} {model.num_params() / 1e6:8.2f}M parameters ({', '.join(f'{k}={v}' for k, v in preset.items())})")
