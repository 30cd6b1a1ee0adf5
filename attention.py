"""The attention variants. Read top to bottom: for each variant, its definition (dense
reference functions, the paper's equations in named stages, with their numbers) directly
above its class, which is only the model-facing glue (projections, gate parameters and their
initialisation, calling the operations through `self.ops`). What only the plan, the FLOP
count, the budget check, the KV cache, conversion and analysis read sits at the end of each
class under one marker line, `# -- not the method (skip it)`; helpers two methods share sit
in a labelled section before both. `python attention.py` draws which keys each query reads
under every variant (`--show=NAME` for one).

This file is not what runs by default. kernel='fused' (the default) runs kernels.py's fast
forms of these functions: FLEX (FlexAttention + SDPA) on CUDA, BLOCKWISE on CPU, DECODE for
a decoding step's few query rows; only kernel='ref' runs this file as written (`ops`, at the
end). Tests hold the two equal, outputs
and gradients: tests/test_kernels.py (every variant and flag, both paths),
test_sparse_baselines.py (nsa, moba), test_indexer.py (indexer), test_combiner.py (combiner);
and tests/test_meaning.py holds this file to the equations written out as loops.

References (the short names are used everywhere below):
  [DSA]   "Dynamic Sparse Attention with Learned Head Gating: Methods and Analysis" (Aardvark,
          2025; unpublished, no public link) — dynamic head gating, always-on window W = 256.
  [DSA-A] "Dynamic Sparse Attention for Efficient Language Modeling" (Aardvark, 2025;
          unpublished) — the same head gating, windowed only past 512 tokens.
  [ASGA]  "Adaptive Sparse-Geometric Attention: A Comprehensive Empirical Analysis" (Aardvark,
          2025; unpublished).
  [CAA]   "Context-Adaptive Attention: A Balanced Approach for Efficient Language Modeling"
          (Aardvark, 2025; unpublished).
  [RoPE]  Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding",
          https://arxiv.org/abs/2104.09864
  [Longformer] Beltagy et al. 2020, "Longformer: The Long-Document Transformer",
          https://arxiv.org/abs/2004.05150
  [Flash] Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with
          IO-Awareness", https://arxiv.org/abs/2205.14135 (kernels.py's blockwise loops)
  [Qwen3] Qwen Team 2025, "Qwen3 Technical Report", https://arxiv.org/abs/2505.09388 (the
          attention block around every variant)
  [Combiner] Ren et al. 2021, "Combiner: Full Attention Transformer with Sparse Computation
          Cost", https://arxiv.org/abs/2107.05768 (the "Sparse [Combiner]" row of [CAA])
  [NSA]   Yuan et al. 2025, "Native Sparse Attention: Hardware-Aligned and Natively Trainable
          Sparse Attention", https://arxiv.org/abs/2502.11089
  [MoBA]  Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs",
          https://arxiv.org/abs/2502.13189 (code: https://github.com/MoonshotAI/MoBA)
  [DS32]  DeepSeek-AI 2025, "DeepSeek-V3.2: Pushing the Frontier of Open Large Language
          Models", https://arxiv.org/abs/2512.02556 (code: DeepSeek-V3.2-Exp's
          inference/model.py, https://github.com/deepseek-ai/DeepSeek-V3.2-Exp)
  Codes that pin down NSA's details (compared in the project's notes on the baselines):
  [fla]   flash-linear-attention, fla/ops/nsa/naive.py, https://github.com/fla-org/flash-linear-attention
  [fla-nsa] fla-org's first NSA code, https://github.com/fla-org/native-sparse-attention
  [xl]    Xunhao Lai's NSA, https://github.com/XunhaoLai/native-sparse-attention-triton
  [lr]    lucidrains' NSA, https://github.com/lucidrains/native-sparse-attention-pytorch
The four seed papers report their runs on FineWeb with a 134M-parameter Qwen model; their
numbers are quoted below with the paper they come from.

The map: which keys query t reads, what chooses them, and what mixes the results.
  variant   query t reads                             chosen by              mixed by
  full      every key s <= t                          causality              -
  local     the window t - W <= s <= t                position               -
  dsa       local's window (all keys while t < 512)   position               a gate g(x_t) per head scales it
  asga      every key s <= t                          causality              a gate s(q_t, k_s) per pair scales a logit
  caa       a window of learned width W .. W_max, and position; the top q.k  a gate g(x_t) per head mixes the
            the top ceil(sqrt(t + 1)) keys by q . k                          two softmaxes
  combiner  its own aligned block, and one summary    position               one softmax over keys and summaries
            (a max-pooled key) per earlier block
  nsa       compressed keys (block means), the top-n  position; blocks by    gates g(x_t) per head mix three
            blocks, and a window                      q . compressed keys    softmaxes
  moba      its own block and the top k-1 earlier     blocks by q . mean(k)  one softmax over the chosen blocks
  indexer   the top k keys                            a learned indexer      one softmax over the chosen keys
The selecting ones in [fla]'s 2 x 2 (fla/ops/dsa/README.md):
                scored by pooled keys     scored by a learned indexer
    blocks      nsa, moba                 -
    tokens      (caa: by the raw q . k)   indexer

Conventions. q is (B, H, T, D); k and v are (B, Hkv, S, D), S counting keys (S = T in a plain
forward pass, S = cached + T when decoding with a KV cache). Positions enter as two Python
ints: query t sits at absolute position q_start + t, key s at k_start + s, and the queries
are the last keys (q_start + T == k_start + S). Every rule is written in absolute positions,
never in sequence lengths, so a query's output depends only on its own context: prefixes,
batches and KV-cache decoding compute the same function (Python ints, not position tensors,
so nothing is read back from the device). Grouped-query attention: query head h reads key
head h // (H / Hkv) (`expand_kv`). Materialising (T, S) score matrices is deliberate in this
file: it is for reading.

Which implementation runs. A variant calls a few operations through `self.ops(q)`: the
core attentions (`attention`, `pair_gated_attention`, `topk_attention`, `combiner_attention`,
`block_attention`, `selected_attention`, each defined directly above the first variant that
uses it) and the stages that need a fast form (nsa's `compressed_branch`, the indexer's
`indexer_topk` and `indexer_kl`, asga's recorded `mean_pair_gate`, the selections'
`top_n`). `ops` at the end of this file is the one place that picks this file's definitions
(kernel='ref') or kernels.py's fast forms of the same functions (chunked, checkpointed,
fused, or read from a KV cache; tested against these).
Imports run one way: kernels.py imports nothing from here.

Summaries. nsa's compressed keys, moba's block means, combiner's spans, the indexer's keys
and asga's per-key gate term are functions of the keys of one window of positions each
(`summarise`, in the method; `summary_window`, under the marker). `attend` computes them from
every key unless it is handed them: a decoding step is (model.KVCache keeps each summary from
the step that completes its window), so a step reads the summaries and what the selection
names, not every cached key.

A new variant is a subclass of CausalSelfAttention (its reference above it, an entry in
VARIANTS); a new fast stage is a reference function here, an `Ops` field, and its versions in
kernels.BLOCKWISE and kernels.FLEX.
"""
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels

# ---------------------------------------------------------------------------- settings


@dataclass
class AttentionConfig:
    """Every attention setting and its default (model.ModelConfig adds the decoder's sizes).
    Defaults of the shape are the `tiny` model's; the variants' sizes are for T = 1024 (the
    cpu preset scales them to T = 256). Each variant's `check_config` rejects sizes it cannot
    use."""
    n_head: int = 4  # H, query heads
    n_kv_head: int = 4  # Hkv, key/value heads; < n_head for grouped-query attention (`expand_kv`)
    head_dim: int = 16  # D; the scale is 1 / sqrt(D)
    d_model: int = 64  # the width of the block's input x (gates and the indexer read x)
    rope_theta: float = 10000.0  # [RoPE]'s base, for the main keys and the indexer's
    norm_eps: float = 1e-6  # every RMSNorm's eps, q_norm's and k_norm's too (Hugging Face's one rms_norm_eps)
    attn: str = "full"  # the variant: a key of VARIANTS
    # `window` has four meanings, by variant: the window W, a query at i seeing i - W .. i (local,
    # dsa, asga_gate=fixed, nsa's own is nsa_window); the smallest width of caa's learned window
    # (its hard cut is caa_window_max, which caa's check_config holds >= window); combiner's block
    # size; and, with index_topk = 0, the indexer's k. `settings(cfg)` names what each variant reads.
    window: int = 256
    kernel: str = "fused"  # ref: this file as written; fused: best for the device; flex; blockwise (`ops`)
    dsa_gate: bool = True  # the head gate (False: [DSA-A]'s "No Gating")
    dsa_window: str = "adaptive"  # adaptive ([DSA-A], 4.904) | fixed ([DSA], W=256 always, 4.6498) | none
    dsa_threshold: int = 512  # adaptive: windowed only for query positions >= this
    asga_gate: str = "learned"  # learned | fixed (a mask: keys beyond the window excluded) | off
    asga_gate_space: str = "logit"  # logit: softmax(alpha * s) ([ASGA] eq. 3) | prob: softmax(alpha + log s) (ours)
    asga_scale: bool = True  # softplus(gamma) per head ([ASGA] eq. 2); False: 1
    asga_hidden: int = 16  # r, the pair gate's hidden width
    caa_gate: str = "learned"  # learned | local | global (the mix gate forced to 1 | 0)
    caa_topk: str = "sqrt"  # sqrt: k_i = ceil(sqrt(i + 1)); all: every visible key
    caa_hidden: int = 64  # the mix gate MLP's width; for matching a parameter budget (the paper gives none)
    caa_window_max: int = 512  # W_max: caa's learned local width w = W + (W_max - W) sigmoid(u . x) lies in [W, W_max]
    caa_tau: float = 8.0  # softness in tokens of the local window's edge; for studying how sharp a learned width acts
    caa_gate_norm: bool = False  # LayerNorm on the gate MLP's hidden layer ([CAA]'s "careful normalization")
    nsa_cmp_block: int = 16  # l: positions per compressed key (paper: 32 at 8k tokens)
    nsa_cmp_stride: int = 8  # d: stride between compressed keys, d | l and d | l' (paper: 16)
    nsa_block: int = 32  # l': positions per selection block (paper: 64)
    nsa_topk: int = 8  # n: blocks selected per query, counting the 3 forced ones (paper: 16)
    nsa_window: int = 128  # the window branch sees t - nsa_window .. t (paper: 512)
    nsa_compress: str = "mean"  # mean ([fla]) | mlp ([NSA]'s learnable phi, as [lr]): for studying the compressor
    nsa_branches: str = "cmp,slc,win"  # the branches summed; for [NSA]'s branch ablations, e.g. slc,win
    moba_block: int = 64  # B: positions per block (paper: 512 at 8k tokens)
    moba_topk: int = 4  # k: blocks per query, counting its own (paper: 3)
    index_topk: int = 0  # k: keys per query (0: the window W; `local` reads W + 1)
    index_heads: int = 4  # J, the lightning indexer's heads (paper: 64); for trading its cost against its choice
    index_head_dim: int = 64  # d^I, their size, RoPE on the first half (paper: 128)

    CHOICES = dict(kernel=("ref", "fused", "flex", "blockwise"), dsa_window=("adaptive", "fixed", "none"),
                   asga_gate=("learned", "fixed", "off"), asga_gate_space=("logit", "prob"),
                   caa_gate=("learned", "local", "global"), caa_topk=("sqrt", "all"), nsa_compress=("mean", "mlp"))

    def __post_init__(self):
        if self.attn not in VARIANTS:
            raise ValueError(f"unknown attention variant {self.attn!r}; valid: {', '.join(VARIANTS)}")
        for name, valid in self.CHOICES.items():
            if getattr(self, name) not in valid:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of: {', '.join(valid)}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        VARIANTS[self.attn].check_config(self)


# ---------------------------------------------------------------------------- conventions

class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: x / sqrt(mean(x^2) + eps) * weight, computed in float32. F.rms_norm
    is that formula: on a CPU the same five ops in the same order (the same bits), on a GPU
    one fused kernel where the formula launched five (4 launches fewer a norm: 36 of the
    122 of an eager one-token step of a 2-layer `full`, docs/performance_log.md)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_cos_sin(pos, head_dim, theta):
    """cos, sin of shape (T, D) for absolute positions `pos`, in Hugging Face's layout:
    frequencies theta^(-2i/D) for i < D/2, repeated twice along the last dim (rotate-half)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=pos.device).float() / head_dim)
    freqs = pos.float()[:, None] * inv_freq[None, :]  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    return emb.cos(), emb.sin()


class RopeTable:
    """rope_cos_sin of positions 0 .. n - 1, computed once: `table(start, T, device)` is the
    rows of positions start .. start + T - 1, two views, the numbers rope_cos_sin computes
    for them (the same elementwise ops). A decoding step's RoPE then costs two slices, where
    computing it for the step's one position took a dozen small ops (on a GPU a kernel launch
    each), in every step (nanochat precomputes its rotary table likewise). n doubles past the
    positions asked for; a table on another device is made anew. Inside a compiled graph the
    positions asked for are computed in place (inductor fuses them into the step's kernels)."""

    MIN_POSITIONS = 4096

    def __init__(self, head_dim, theta):
        self.head_dim, self.theta = head_dim, theta
        self.cos = self.sin = None

    def __call__(self, start, T, device):
        if torch.compiler.is_compiling():
            return rope_cos_sin(torch.arange(start, start + T, device=device), self.head_dim, self.theta)
        if self.cos is None or self.cos.device != device or self.cos.shape[0] < start + T:
            n = max(self.MIN_POSITIONS, 1 << (start + T - 1).bit_length())
            # a plain tensor even when first asked for in inference mode: training reads it later
            with torch.inference_mode(False), torch.no_grad():
                self.cos, self.sin = rope_cos_sin(torch.arange(n, device=device), self.head_dim, self.theta)
        return self.cos[start:start + T], self.sin[start:start + T]


def apply_rope(x_BHTD, cos, sin):
    """Rotate-half [RoPE] (as in Hugging Face's Qwen3): x*cos + rotate_half(x)*sin."""
    x1, x2 = x_BHTD.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x_BHTD * cos + rotated * sin).to(x_BHTD.dtype)


def expand_kv(k_BHSD, n_head):
    """Grouped-query attention: (B, Hkv, S, D) -> (B, H, S, D), key head g repeated for the
    G = H / Hkv consecutive query heads g G .. g G + G - 1 that read it (Hugging Face's
    repeat_kv), so query head h reads key head h // G."""
    return k_BHSD.repeat_interleave(n_head // k_BHSD.shape[1], dim=1)


def grouped_dots(q, keys):
    """(B, H, T, N): q @ expand_kv(keys, H)^T for q (B, H, T, D) and keys (B, Hkv, N, D), each
    query head against its key head's N keys without a copy of them per query head: the G
    query heads of a key head enter one product as its G T rows (`kernels._head_rows`)."""
    B, H, T, _ = q.shape
    return (kernels._head_rows(q, keys.shape[1]) @ keys.transpose(-2, -1)).view(B, H, T, keys.shape[2])


def distances(T, S, q_start, k_start, device):
    """(T, S) long: query position minus key position."""
    q_pos = torch.arange(q_start, q_start + T, device=device)
    k_pos = torch.arange(k_start, k_start + S, device=device)
    return q_pos[:, None] - k_pos[None, :]


def allowed(T, S, q_start, k_start, device, window=None, window_from=0):
    """(T, S) bool, True where query t may see key s: causal (distance >= 0) and, if `window`
    is given, distance <= window for queries at positions >= window_from."""
    dist = distances(T, S, q_start, k_start, device)
    mask = dist >= 0
    if window is not None:
        q_pos = torch.arange(q_start, q_start + T, device=device)[:, None]
        mask = mask & ((dist <= window) | (q_pos < window_from))
    return mask


def at_least_float32(x):
    """x in float32, or kept in float64: the softmax runs in float32 at least, and a float64
    reference stays float64 (the parity tests measure float32's own error against it)."""
    return x if x.dtype == torch.float64 else x.float()


def masked_softmax_attend(logits_BHTS, mask, v_BHSD):
    """softmax over the allowed keys (in float32 at least), then the weighted sum of values."""
    logits = at_least_float32(logits_BHTS).masked_fill(~mask, float("-inf"))
    return torch.softmax(logits, dim=-1).to(v_BHSD.dtype) @ v_BHSD


def softmax_or_zero(logits, mask):
    """float32 softmax over the allowed entries; a row with none allowed gives all zeros (and
    zero gradients), as FlexAttention returns for it, instead of NaN."""
    some = mask.any(-1, keepdim=True)
    logits = logits.float().masked_fill(~mask, float("-inf")).masked_fill(~some, 0.0)
    return torch.softmax(logits, dim=-1) * some


def per_head(scale):
    """scale: a Python float, or a (H,) tensor (one scale per head) shaped to (1, H, 1, 1)."""
    return scale[None, :, None, None] if torch.is_tensor(scale) else scale


def ceil_div(a, b):
    return -(-a // b)


def top_n(scores, n):
    """(.., n) long: the indices of each row's n highest scores, highest first. The tie rule
    of every selection here: equal scores go to the higher index, i.e. the more recent key or
    block. A slot whose score is -inf (a row with fewer than n finite scores) is -1.
    scores (.., S), float32 at most; no gradient (a selection is discrete).
    How: one top-k over a key that orders by score, then by index. A float32's bits, read as
    an int32, order like the float once the negative ones flip their 31 magnitude bits; that
    int, times 2^32, plus the index is the key. (-0.0 is made 0.0 first: the two are equal.)"""
    S = scores.shape[-1]
    if S < n:  # fewer columns than slots: the spare slots stay empty
        scores = F.pad(scores, (0, n - S), value=float("-inf"))
    bits = (scores.detach().float() + 0.0).view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: magnitude bits flipped
    index = torch.arange(scores.shape[-1], device=scores.device)
    top = ((ordered.long() << 32) | index).topk(n, dim=-1).indices
    return top.masked_fill(scores.gather(-1, top) == float("-inf"), -1)


# ---------------------------------------------------------------------------- full

def attention(q, k, v, scale, q_start, k_start, window=None, window_from=0, bias=None):
    """(B, H, T, D): softmax_s(q_t . k_s * scale + bias) v over the keys `allowed` (causal,
    windowed if `window`). scale: a float or a (H,) tensor, one per head (`per_head`). bias:
    None, or a function bias(b, h, t, dist) of the batch, head and query index and the
    query-minus-key distance (index tensors that broadcast), returning the additive logit
    bias; written once, it is evaluated here on (B, 1, T, S) broadcasts, in kernels.py on its
    blocks or as a FlexAttention score_mod."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    k, v = expand_kv(k, H), expand_kv(v, H)
    logits = (q @ k.transpose(-2, -1)) * per_head(scale)  # (B, H, T, S)
    if bias is not None:
        b = torch.arange(B, device=q.device)[:, None, None, None]
        h = torch.arange(H, device=q.device)[None, :, None, None]
        t = torch.arange(T, device=q.device)[None, None, :, None]
        logits = logits + bias(b, h, t, distances(T, S, q_start, k_start, q.device)[None, None])
    return masked_softmax_attend(logits, allowed(T, S, q_start, k_start, q.device, window, window_from), v)


class CausalSelfAttention(nn.Module):
    """`full`: softmax(q k^T / sqrt(d)) v over every j <= i — the baseline of every paper
    (validation loss 4.9266 at 134M on FineWeb, reported by [DSA], [DSA-A] and [CAA]).

    The [Qwen3] attention block around every variant: q, k, v, o projections without bias,
    grouped-query heads (`n_kv_head`), per-head RMSNorm on q and k *before* RoPE,
    scale 1/sqrt(head_dim); the heads' outputs, concatenated, go through o_proj. Every
    variant is this class with its own `attend`, and, where its selection reads summaries of
    the keys (one per window of positions: nsa's compressed keys, moba's block means,
    combiner's span summaries, the indexer's own keys), its own `summarise`.
    """

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.notes = None  # while recording (`record_gates`): {name: tensor} of the last forward

    def project(self, x_BTC, cos, sin):
        """q (B, H, T, D), k and v (B, Hkv, T, D) from the block's normalized input x (B, T, C):
        the projections, RMSNorm on each head of q and k, then RoPE (cos, sin: (T, D))."""
        B, T, _ = x_BTC.shape
        q = self.q_proj(x_BTC).view(B, T, self.n_head, self.head_dim)
        k = self.k_proj(x_BTC).view(B, T, self.n_kv_head, self.head_dim)
        v = self.v_proj(x_BTC).view(B, T, self.n_kv_head, self.head_dim)
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)  # (B, H, T, D)
        k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)  # (B, Hkv, T, D)
        return q, k, v.transpose(1, 2)

    def attend(self, q, k, v, x, q_start, k_start, summary=None):
        """(B, H, T, D) from q (B, H, T, D), k, v (B, Hkv, S, D), the block input x (B, T, C)
        and the absolute positions of the first query and the first key (Python ints).
        summary: what the variant's `summarise` makes of every key from position 0, when the
        caller has it (by default it is computed here, which needs k_start = 0)."""
        return self.ops(q).attention(q, k, v, self.scale, q_start, k_start)

    def init_gates(self):
        """Set the variant's own parameters to their documented init (Model calls this after
        its generic init, which would otherwise overwrite them)."""

    # -- not the method (skip it): how it runs (forward, KV cache, operations, recording), and what the plan,
    # FLOP count, budget check, conversion, analysis read
    # Every variant groups these members at the end of its class, under this line.

    def forward(self, x_BTC, cos, sin, start, cache=None):
        """x: the block's normalized input (B, T, C); cos/sin: (T, D) for positions start ..
        start + T - 1 (`start` a Python int). With a model.KVCache, the keys, values and
        summaries of earlier tokens are read from it, and this step's written into it."""
        B, T, _ = x_BTC.shape
        q, k, v = self.project(x_BTC, cos, sin)
        k_start, summary = start, None
        if cache is not None:
            k, v, k_start, summary = cache.update(self, q, k, v, x_BTC, start)  # (B, Hkv, S, D), S = cached + T
        if self.notes is not None:  # recording: this forward's notes only
            self.notes = {}
        y = self.attend(q, k, v, x_BTC, start, k_start, summary)  # (B, H, T, D)
        if cache is not None:
            cache.trim(self.oldest_key_needed(start + T))
        if self.notes is not None:
            self.observe(q, k, v, x_BTC, start, k_start, summary)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))

    def ops(self, q):
        """The operations that run for the queries q (attention.ops: the config's kernel, the
        device, and how many query rows: a decoding step's few rows get kernels.DECODE); given a
        device instead of q, those for many rows."""
        if torch.is_tensor(q):
            return ops(self.cfg.kernel, q.device, q.shape[2])
        return ops(self.cfg.kernel, q)

    def summarise(self, q, k, v, x, start):
        """The summaries of the keys the variant's selection reads, one per window of positions
        (`summary_window`), of the complete windows among positions start .. (q, k, v, x of
        those positions, start a window boundary); None for a variant without."""
        return None

    def summary_window(self):
        """(length, stride) of the windows `summarise` summarises (window i covers positions
        i stride .. i stride + length - 1), or None. The KV cache appends a window's summary
        once its last position arrives."""
        return None

    # whether the KV cache stores this layer's summaries with the positions as the fastest-moving
    # dim on a CPU (model.Rows), for a decoding kernel that reads them along the keys: one bool
    # for every summary, or one per summary
    keys_last_summaries = False

    # the same for its keys and values: stored along the keys on a CPU, a decoding step's one
    # row of q K^T and of p V streams down the positions for each element of D, where reading
    # rows of D through a transposed view ran at a third to a half of the read bandwidth (op by
    # op at 8192-32768 keys: q K^T 2.2-2.6x, p V 1.8-1.9x as fast). A variant that gathers
    # cached rows by index (its selected blocks or keys), or reads only a window's last keys,
    # keeps them as rows of D (local's step was 1.05x as long along the keys)
    keys_last_kv = (True, True)

    def observe(self, q, k, v, x, q_start, k_start, summary):
        """While recording (`record_gates`), after `attend`: note what analysis reads of this
        forward (gates, selections), from the same stages `attend` ran on the same inputs."""

    # How --init_from finds it: what its new parameters start as on a pretrained dense model
    FROM_PRETRAINED = "the checkpoint's own attention"
    # what analysis reads: one mechanism, `note`; and what analyze.py draws of the notes
    DYNAMICS = ()  # (note, caption, a line per head?): drawn over training in a figure of their own
    BRANCHES = ()  # the branches a gate per branch mixes, each gate noted as gate_<branch> (nsa)

    def oldest_key_needed(self, next_pos):
        """The smallest key position that any query at position >= next_pos can see (KVCache.trim)."""
        return 0

    def record_gates(self, on=True):
        """Keep what `attend` notes (gates, selections) from the next forward passes on."""
        self.notes = {} if on else None

    def note(self, name, value):
        """Keep `value` (a tensor, or a function computing one: run only while recording)
        under `name` for analysis; a no-op unless recording."""
        if self.notes is not None:
            with torch.no_grad():
                self.notes[name] = (value() if callable(value) else value).detach()

    @property
    def gates(self):
        """{name: (B, T, H), (B, T, 1) or (1, 1, H)} gate statistics of the last recorded forward."""
        return {name: t for name, t in (self.notes or {}).items() if name != "selection"}

    @property
    def selection(self):
        """What the last recorded forward selected (nsa, moba: (B, H, T, n) blocks; indexer:
        (B, T, n) keys), or None."""
        return (self.notes or {}).get("selection")

    def gate_stats(self):
        """JSON-ready summaries of the gates recorded in the last forward."""
        return {name: gate_summary(g) for name, g in self.gates.items()}

    @classmethod
    def selection_unit(cls, cfg):
        """Positions per unit of the `selection` it notes (a block's size; 1: single keys), or
        None when it selects nothing (analyze.py's selection figure)."""
        return None

    # what the rest of the code asks of a variant: the plan, its checks, flops.py, run names

    @classmethod
    def settings(cls, cfg):
        """The config fields that set this variant (its sizes and ablations) and that matter
        given the others; analyze.py names a run by those not at their default. Fields of
        model.ModelConfig may appear: moba's moba_full_last says which layers run the variant."""
        return ()

    @classmethod
    def check_config(cls, cfg):
        """A ValueError naming the setting this variant cannot use (AttentionConfig calls it)."""

    @classmethod
    def describe(cls, cfg, T):
        """(what a query of a T-token sequence attends, a line of the printed plan; a warning
        when that is full attention in disguise, or None)."""
        return f"none: every key j <= i, of a {T}-token sequence", None

    @classmethod
    def check_budget(cls, cfg, T):
        """A ValueError when these settings, at T tokens, are not the method (e.g. a selection
        covering the whole sequence)."""

    def attention_flops(self, T):
        """(with gradient, without): forward FLOPs per token of this layer's attention core,
        averaged over the T positions: 4 H D per (query, key) score (q.k and p.v), flops.py
        multiplies the first by 3 for training."""
        return self.per_key() * mean_keys(T, causal_keys), 0.0

    def per_key(self):
        return 4 * self.n_head * self.head_dim

    def matmul_params(self):
        """Weights of this layer that multiply every token once (flops.py's N)."""
        return sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))


# ---------------------------------------------------------------------------- local

class LocalAttention(CausalSelfAttention):
    """`local`: softmax(q k^T / sqrt(d)) v over i - W <= j <= i (sliding window, as in
    [Longformer]; the "Local" row of [CAA], validation loss 5.021). W = cfg.window (256)."""

    def attend(self, q, k, v, x, q_start, k_start, summary=None):
        return self.ops(q).attention(q, k, v, self.scale, q_start, k_start, window=self.cfg.window)

    # -- not the method (skip it): what the plan, FLOP count, budget check, KV cache, conversion, analysis read
    FROM_PRETRAINED = "no new parameters: the window over the pretrained weights, training-free"

    keys_last_kv = (False, False)  # it reads the cache's last keys, a slice: contiguous rows of D

    def oldest_key_needed(self, next_pos):
        return max(0, next_pos - self.cfg.window)

    @classmethod
    def settings(cls, cfg):
        return ("window",)

    @classmethod
    def describe(cls, cfg, T):
        return f"{cfg.window} keys back, of a {T}-token sequence", covers_all("local", cfg.window, T)

    def attention_flops(self, T):
        return self.per_key() * mean_keys(T, lambda t: causal_keys(t, self.cfg.window)), 0.0


# ---------------------------------------------------------------------------- dsa

class DynamicSparseAttention(CausalSelfAttention):
    """`dsa`: dynamic head gating with a local window ([DSA] and [DSA-A]).

        g = sigmoid(W_g x + b_g)  in R^H per token        ([DSA] §3.2, [DSA-A] §3.1)
        y = W_o concat_h(g_h * o_h)
        o_h = softmax over j in window(i) of q_i k_j / sqrt(d), times v

    The papers say, and the two configurations (`dsa_window`):
      'fixed':    [DSA]'s configuration: every query windowed, i - W <= j <= i, W = 256.
                  [DSA] reports validation loss 4.6498 with it.
      'adaptive': [DSA-A]'s: windowed "for sequences longer than 512 tokens". This project
                  applies the rule per query position (queries at positions < dsa_threshold
                  = 512 see every earlier key), so outputs never depend on later tokens.
                  [DSA-A] reports 4.904 with it. At seq_len T a share min(1, 512 / T) of the
                  positions attends fully: half of them at T = 1024, all at T <= 512.
      'none':     never windowed ([DSA-A] Table 1's "No Window" ablation).
    dsa_gate=False sets g = 1 ([DSA-A]'s "No Gating").

    This project's choice: init W_g = 0, b_g = 0, so g = 0.5 for every token and head: the
    variant starts as the baseline with its output projection halved (no information lost),
    and the gate sits at the sigmoid's steepest point, where it learns fastest.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.dsa_gate:
            self.head_gate = nn.Linear(cfg.d_model, cfg.n_head)
        self.init_gates()

    def init_gates(self):
        if self.cfg.dsa_gate:
            nn.init.zeros_(self.head_gate.weight)
            nn.init.zeros_(self.head_gate.bias)

    def window(self):
        """(window, window_from) for the core `attention` op."""
        cfg = self.cfg
        if cfg.dsa_window == "none":
            return None, 0
        return cfg.window, (cfg.dsa_threshold if cfg.dsa_window == "adaptive" else 0)

    def attend(self, q, k, v, x, q_start, k_start, summary=None):
        window, window_from = self.window()
        y = self.ops(q).attention(q, k, v, self.scale, q_start, k_start, window, window_from)
        if not self.cfg.dsa_gate:
            return y
        g = torch.sigmoid(self.head_gate(x))  # (B, T, H)
        return y * g.transpose(1, 2).unsqueeze(-1).to(y.dtype)

    # -- not the method (skip it): what the plan, FLOP count, budget check, KV cache, conversion, analysis read
    FROM_PRETRAINED = "not neutral: its head gates start at sigmoid(0) = 0.5, halving every head's output"

    def observe(self, q, k, v, x, q_start, k_start, summary):
        if self.cfg.dsa_gate:
            self.note("head_gate", lambda: torch.sigmoid(self.head_gate(x)))

    keys_last_kv = (False, False)  # it reads the cache's last keys, a slice: contiguous rows of D

    def oldest_key_needed(self, next_pos):
        window, window_from = self.window()
        if window is None or next_pos < window_from:
            return 0
        return max(0, next_pos - window)

    @classmethod
    def settings(cls, cfg):
        if cfg.dsa_window == "none":
            return ("dsa_gate", "dsa_window")
        if cfg.dsa_window == "fixed":
            return ("dsa_gate", "dsa_window", "window")
        return ("dsa_gate", "dsa_window", "window", "dsa_threshold")

    @classmethod
    def describe(cls, cfg, T):
        W, of = cfg.window, f", of a {T}-token sequence"
        if cfg.dsa_window == "fixed":
            return f"{W} keys back for every query{of}", covers_all("dsa", W, T)
        if cfg.dsa_window == "adaptive":
            line = (f"{W} keys back for queries at positions >= {cfg.dsa_threshold} (dsa_threshold), every key "
                    f"below it{of}")
            if cfg.dsa_threshold >= T:
                return line, (f"dsa: dsa_threshold {cfg.dsa_threshold} >= seq_len {T}: no query is windowed, so it "
                              f"computes full attention; pass --dsa_threshold below {T}")
            return line, covers_all("dsa", W, T)
        return super().describe(cfg, T)

    def attention_flops(self, T):
        window, window_from = self.window()
        return self.per_key() * mean_keys(T, lambda t: causal_keys(t, window, window_from)), 0.0


# ---------------------------------------------------------------------------- asga
# [ASGA]'s equations, which the two functions below and ASGAttention compute:
#     s_ij^h     = sigmoid(w2_h . GELU(W1_h [LN(q_i^h); LN(k_j^h)] + b1_h) + b2_h)   (eq. 1)
#     alpha_ij^h = softplus(gamma_h) * q_i^h . k_j^h / sqrt(d)                      (eq. 2)
#     y_i^h      = softmax_{j <= i}(alpha^h ⊙ s^h) v^h                              (eq. 3)

def pair_gate_logit(q_term, k_term, w2, b2):
    """(B, H, T, S): w2 . GELU(q_term_t + k_term_s) + b2 per head ([ASGA] eq. 1 before its
    sigmoid). q_term (B, H, T, r), k_term (B, H, S, r), w2 (H, r), b2 (H,). Builds the
    (B, H, T, S, r) pair tensor: reference only."""
    hidden = F.gelu(q_term[:, :, :, None, :] + k_term[:, :, None, :, :])  # (B, H, T, S, r)
    return (hidden * w2[None, :, None, None, :]).sum(-1) + b2[None, :, None, None]


def pair_gated_attention(q, k, v, q_term, k_term, w2, b2, scale, q_start, k_start, gate_space="logit"):
    """(B, H, T, D): causal attention whose logits alpha = q . k * scale (float or per head)
    meet a pair gate s = sigmoid(pair_gate_logit): gate_space 'logit' takes
    softmax(alpha * s) ([ASGA] eq. 3), 'prob' takes softmax(alpha + log s), i.e. weights
    exp(alpha) * s renormalised."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    k, v = expand_kv(k, H), expand_kv(v, H)
    logits = (q @ k.transpose(-2, -1)) * per_head(scale)  # (B, H, T, S)
    z = pair_gate_logit(q_term, k_term, w2, b2)
    logits = logits * torch.sigmoid(z) if gate_space == "logit" else logits + F.logsigmoid(z)
    return masked_softmax_attend(logits, allowed(T, S, q_start, k_start, q.device), v)


class ASGAttention(CausalSelfAttention):
    """`asga`: Adaptive Sparse-Geometric Attention ([ASGA]; validation loss 5.148).

    The paper says eqs. 1-3 (at the top of this section) and ablates "fixed sparsity
    patterns" (5.087) and the geometric scale.

    What eq. 3 does: s in (0, 1) multiplies the logits, so it is a per-pair *temperature*,
    not a sparsifier: a lower s pulls a logit toward 0, which *raises* the weight of a key
    whose logit is negative (logit -3 among others at 0: weight 0.005 at s = 1, 0.024 at
    s = 0.5, 0.100 at s = 0). It stays the default because it is the paper's equation.
    asga_gate_space='prob' is this project's variant that does sparsify: the gate acts on
    the probabilities, weights exp(alpha) * s renormalised, i.e. softmax(alpha + log s).

    This project's choices: q and k are the post-norm, post-RoPE vectors the logits use; LN
    is LayerNorm over head_dim without affine parameters (W1 follows, so a gain and bias would
    be absorbed exactly); W1 [a; b] = W1a a + W1b b, so the pair term is a per-query vector
    plus a per-key vector (`pair_terms`), never a (T, S, r) tensor outside the reference.
    Hidden width r = asga_hidden. Ablations: asga_scale=False (softplus(gamma) = 1);
    asga_gate='fixed' (a fixed mask: keys more than W back are excluded, the "fixed sparsity
    patterns" row); asga_gate='off' (s = 1; with the scale off too this is `full` exactly).

    Init (ours): softplus(gamma) = 1 (gamma = log(e - 1)), so the scale starts neutral;
    W1 ~ N(0, 1/D) keeps the hidden pre-activations O(1); w2 ~ N(0, 0.02) and b2 = 0 start s
    at 0.5, nearly input-independent, at the sigmoid's steepest point.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        H, D, r = cfg.n_head, cfg.head_dim, cfg.asga_hidden
        if cfg.asga_scale:
            self.gamma = nn.Parameter(torch.empty(H))
        if cfg.asga_gate == "learned":
            self.w1_q = nn.Parameter(torch.empty(H, D, r))
            self.w1_k = nn.Parameter(torch.empty(H, D, r))
            self.b1 = nn.Parameter(torch.empty(H, r))
            self.w2 = nn.Parameter(torch.empty(H, r))
            self.b2 = nn.Parameter(torch.empty(H))
        self.init_gates()

    def init_gates(self):
        if self.cfg.asga_scale:
            nn.init.constant_(self.gamma, math.log(math.e - 1))  # softplus(gamma) = 1
        if self.cfg.asga_gate == "learned":
            nn.init.normal_(self.w1_q, std=self.head_dim ** -0.5)
            nn.init.normal_(self.w1_k, std=self.head_dim ** -0.5)
            nn.init.zeros_(self.b1)
            nn.init.normal_(self.w2, std=0.02)
            nn.init.zeros_(self.b2)

    def pair_terms(self, q, k):
        """The per-query and per-key halves of W1 [LN(q); LN(k)] + b1: (B,H,T,r), (B,H,S,r)."""
        return self.query_terms(q), self.summarise(q, k, None, None, 0)

    def query_terms(self, q):
        """LN(q) W1_q + b1 (B, H, T, r)."""
        return torch.einsum("bhtd,hdr->bhtr", F.layer_norm(q, (q.shape[-1],)), self.w1_q) + self.b1[None, :, None, :]

    def summarise(self, q, k, v, x, start):
        """LN(k) W1_k (B, H, S, r), one per key (k expanded to the query heads first: W1 is per
        query head)."""
        k = expand_kv(k, self.n_head)
        return torch.einsum("bhsd,hdr->bhsr", F.layer_norm(k, (k.shape[-1],)), self.w1_k)

    def attend(self, q, k, v, x, q_start, k_start, summary=None):
        cfg, op = self.cfg, self.ops(q)
        scale = self.scale  # alpha = softplus(gamma) q.k / sqrt(d): one scale per head
        if cfg.asga_scale:
            scale = F.softplus(self.gamma) * self.scale  # (H,)
        if cfg.asga_gate == "off":
            return op.attention(q, k, v, scale, q_start, k_start)
        if cfg.asga_gate == "fixed":
            return op.attention(q, k, v, scale, q_start, k_start, window=cfg.window)
        q_term = self.query_terms(q)  # (B, H, T, r)
        k_term = self.summarise(q, k, v, x, k_start) if summary is None else summary  # (B, H, S, r)
        return op.pair_gated_attention(q, k, v, q_term, k_term, self.w2, self.b2, scale,
                                       q_start, k_start, cfg.asga_gate_space)

    # -- not the method (skip it): what the plan, FLOP count, budget check, KV cache, conversion, analysis read
    FROM_PRETRAINED = ("not neutral: its pair gate starts near s = 0.5, which halves every logit (a "
                       "temperature of 2)")
    DYNAMICS = (("scale", "softplus(gamma) per head", True), ("pair_gate", "mean pair gate s per layer", False))

    def summary_window(self):
        # the learned gate's per-key term, one per key: a decoding step computes its own key's only
        return (1, 1) if self.cfg.asga_gate == "learned" else None

    keys_last_summaries = True  # the compiled decoding gate reads the per-key terms along the keys

    def observe(self, q, k, v, x, q_start, k_start, summary):
        if self.cfg.asga_scale:
            self.note("scale", lambda: F.softplus(self.gamma)[None, None, :])  # (1, 1, H)
        if self.cfg.asga_gate == "learned":
            self.note("pair_gate", lambda: self.ops(q).mean_pair_gate(*self.pair_terms(q, k), self.w2, self.b2,
                                                                      q_start, k_start))

    def oldest_key_needed(self, next_pos):
        return max(0, next_pos - self.cfg.window) if self.cfg.asga_gate == "fixed" else 0

    @classmethod
    def settings(cls, cfg):
        gate = {"learned": ("asga_hidden", "asga_gate_space"), "fixed": ("window",)}.get(cfg.asga_gate, ())
        return ("asga_gate", "asga_scale") + gate

    @classmethod
    def describe(cls, cfg, T):
        if cfg.asga_gate == "fixed":
            return f"{cfg.window} keys back, of a {T}-token sequence", covers_all("asga", cfg.window, T)
        if cfg.asga_gate == "learned":
            return f"none: a learned pair gate on every key j <= i, of a {T}-token sequence", None
        return super().describe(cfg, T)

    def attention_flops(self, T):
        cfg = self.cfg
        if cfg.asga_gate == "fixed":
            return self.per_key() * mean_keys(T, lambda t: causal_keys(t, cfg.window)), 0.0
        if cfg.asga_gate == "off":
            return self.per_key() * mean_keys(T, causal_keys), 0.0
        # the pair MLP per score and head: r units of add, GELU (one), multiply-add with w2
        return (self.per_key() + 4 * cfg.asga_hidden * self.n_head) * mean_keys(T, causal_keys), 0.0

    def matmul_params(self):  # w1_q and w1_k multiply every token's q and k once
        learned = self.cfg.asga_gate == "learned"
        return super().matmul_params() + (self.w1_q.numel() + self.w1_k.numel() if learned else 0)


# ---------------------------------------------------------------------------- caa

def topk_attention(q, k, v, scale, q_start, k_start, k_per_query, k_max):
    """(B, H, T, D): query t attends, with a softmax, to its k_per_query[t] highest-scoring
    visible keys alone (`topk_mask`, whose tie rule every path follows; never a future key,
    even when fewer are visible). k_max: a Python int >= every k_per_query (the fused paths
    size their buffers with it)."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    k, v = expand_kv(k, H), expand_kv(v, H)
    logits = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
    causal = allowed(T, S, q_start, k_start, q.device)
    return masked_softmax_attend(logits, topk_mask(logits.detach(), causal, k_per_query), v)


def topk_mask(logits, causal, k_per_query):
    """(B, H, T, S) bool: each query's visible keys scoring at least its k_i-th highest visible
    score, k_i = k_per_query[t]. The tie rule: keys tied with the k_i-th score are all kept, so
    a query reads more than k_i keys only where scores tie exactly (kernels.py's threshold,
    `score >= threshold`, cannot tell tied keys apart); every visible key when it sees <= k_i."""
    visible = logits.masked_fill(~causal, float("-inf"))
    kth = visible.sort(dim=-1, descending=True).values.gather(
        -1, (k_per_query - 1).clamp(max=logits.shape[-1] - 1).expand(*logits.shape[:-1])[..., None])
    return (visible >= kth) & causal  # & causal: never a future key, even where kth = -inf


def soft_edge(width_BHT, tau):
    """caa's soft window edge, as a bias(b, h, t, dist) for `attention`: query t (of batch row
    b, head h) and a key dist = (query position) - (key position) tokens back get
    log sigmoid((w_t - dist) / tau), about 0 for keys within the width w_t, falling by one
    per tau tokens past it. width_BHT (B, H, T): w_t for every query. (kernels.log_sigmoid:
    F.logsigmoid fails inside a FlexAttention score_mod on CUDA.)"""
    def bias(b, h, t, dist):
        return kernels.log_sigmoid((width_BHT[b, h, t] - dist) / tau)

    return bias


class ContextAdaptiveAttention(CausalSelfAttention):
    """`caa`: Context-Adaptive Attention ([CAA]; validation loss 4.712, 2.1x memory).

        y_i^h = g_h(x_i) Attn_L(i) + (1 - g_h(x_i)) Attn_G(i)                  ([CAA] eq. 1)

    The paper says: local windows of "256-512 tokens (input-dependent)"; global attention
    "top-k sparse with k = O(sqrt(n))"; the gate is a "2-layer MLP with sigmoid output";
    and "gate gradients require careful normalization".

    This project's choices (the paper gives no formula for any of them):
    - the width: w_i = W + (W_max - W) sigmoid(u . x_i) in [W, W_max] (W = window = 256,
      W_max = caa_window_max = 512), made differentiable by a soft boundary: the local
      logits get log sigmoid((w_i - (i - j)) / caa_tau), tau = 8 tokens, and keys more than
      W_max back are masked, so the branch stays local;
    - top-k: k_i = ceil(sqrt(i + 1)) per query position (k = O(sqrt(n)) applied to each
      query's own context), chosen among all keys j <= i, local ones included (the tie
      rule: `topk_mask`);
    - the gate: g(x) = sigmoid(W2 GELU(W1 x + b1) + b2) in R^H, one gate per head, hidden
      width caa_hidden; both branches share the q, k, v projections;
    - the gate-gradient normalization: caa_gate_norm=True puts a LayerNorm (no affine) on the
      gate MLP's hidden pre-activation, which bounds the scale of the gradient reaching W1 and
      x whatever the input's scale. Not a rescaling of the gate parameters' gradient: under
      AdamW, which divides each parameter's step by its own gradient RMS, that would change
      nothing. Off by default (the paper's number was not made with a known form of it).
    Ablation/debug flags: caa_gate='local'|'global' forces g = 1|0; caa_topk='all' keeps
    every key (with caa_gate='global' this is `full` exactly).

    Init (ours): W2 ~ N(0, 0.02), b2 = 0 (g ~ 0.5, an even mix, at the sigmoid's steepest
    point; not exactly 0 so that W1 gets a gradient from the first step); u = 0 and its bias
    0, so every width starts at the middle, (W + W_max) / 2 = 384.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        norm = nn.LayerNorm(cfg.caa_hidden, elementwise_affine=False) if cfg.caa_gate_norm else nn.Identity()
        self.mix_gate = nn.Sequential(nn.Linear(cfg.d_model, cfg.caa_hidden), norm, nn.GELU(),
                                      nn.Linear(cfg.caa_hidden, cfg.n_head))
        self.width = nn.Linear(cfg.d_model, 1)
        self.init_gates()

    def init_gates(self):
        nn.init.normal_(self.mix_gate[0].weight, std=0.02)
        nn.init.normal_(self.mix_gate[3].weight, std=0.02)
        for p in (self.mix_gate[0].bias, self.mix_gate[3].bias, self.width.weight, self.width.bias):
            nn.init.zeros_(p)

    def k_per_query(self, q_start, T, device):
        """((T,) long k_i = ceil(sqrt(i + 1)) for positions i = q_start .., the largest as an int)."""
        pos = torch.arange(q_start, q_start + T, device=device)
        return torch.ceil(torch.sqrt(pos.double() + 1)).long(), math.isqrt(q_start + T - 1) + 1

    def local_width(self, x):
        """(B, T): w = W + (W_max - W) sigmoid(u . x), in float32 at least (autocast's Linear
        gives bf16, where a width in [256, 512] moves in steps of 2 tokens)."""
        W, W_max = self.cfg.window, self.cfg.caa_window_max
        return W + (W_max - W) * torch.sigmoid(at_least_float32(self.width(x)[..., 0]))

    def mix(self, x):
        """(B, T, H): the gate g(x) = sigmoid(W2 GELU(W1 x + b1) + b2), in float32 at least."""
        return torch.sigmoid(at_least_float32(self.mix_gate(x)))

    def attend(self, q, k, v, x, q_start, k_start, summary=None):
        cfg, op = self.cfg, self.ops(q)
        T = q.shape[2]
        # A forced gate (g = 1 or 0) skips the branch it multiplies by zero.
        local = glob = None
        if cfg.caa_gate != "global":
            # the local width, one copy per head (kernels.py, `per_row`: a FlexAttention gradient
            # element then takes the atomic adds of one query's keys, not of every head's)
            width_BHT = self.local_width(x)[:, None, :].expand(-1, q.shape[1], -1).contiguous()
            local = op.attention(q, k, v, self.scale, q_start, k_start, window=cfg.caa_window_max,
                                 bias=soft_edge(width_BHT, cfg.caa_tau))
        if cfg.caa_gate != "local":
            if cfg.caa_topk == "all":
                glob = op.attention(q, k, v, self.scale, q_start, k_start)
            else:
                glob = op.topk_attention(q, k, v, self.scale, q_start, k_start, *self.k_per_query(q_start, T, q.device))
        if cfg.caa_gate != "learned":
            return glob if local is None else local
        g = self.mix(x).transpose(1, 2).unsqueeze(-1)  # (B, H, T, 1)
        # eq. 1, g L + (1 - g) G, written G + g (L - G) in float32 at least: the gate's gradient
        # is sum_d dy (L - G), which bf16 loses where the branches nearly agree
        dtype, local, glob = local.dtype, at_least_float32(local), at_least_float32(glob)
        return (glob + g * (local - glob)).to(dtype)

    # -- not the method (skip it): what the plan, FLOP count, budget check, KV cache, conversion, analysis read
    FROM_PRETRAINED = ("not neutral, but the scale is kept: its mix gate starts near 0.5, an even mix of two "
                       "normalised attentions (its local branch and its top-k branch)")
    DYNAMICS = (("mix_gate", "mix gate g (local share) per layer", False),
                ("window", "local window width (tokens) per layer", False))

    keys_last_kv = (True, False)  # every key scored along the keys; the top-k's values gathered as rows

    def observe(self, q, k, v, x, q_start, k_start, summary):
        cfg = self.cfg
        if cfg.caa_gate != "global":
            self.note("window", lambda: self.local_width(x)[..., None])
        if cfg.caa_gate == "learned":
            self.note("mix_gate", lambda: self.mix(x))
        else:  # forced to 1 (local) or 0 (global)
            self.note("mix_gate", lambda: torch.full((q.shape[0], q.shape[2], self.n_head),
                                                     float(cfg.caa_gate == "local"), device=q.device))

    @classmethod
    def check_config(cls, cfg):
        if cfg.caa_window_max < cfg.window:
            raise ValueError(f"caa_window_max={cfg.caa_window_max} must be >= window={cfg.window}")

    @classmethod
    def settings(cls, cfg):
        return ("caa_gate", "caa_topk", "window", "caa_window_max", "caa_tau", "caa_hidden", "caa_gate_norm")

    @classmethod
    def describe(cls, cfg, T):
        topk = "k_i = ceil(sqrt(i + 1))" if cfg.caa_topk == "sqrt" else "every key (caa_topk=all)"
        line = (f"local branch {cfg.window} to {cfg.caa_window_max} keys back (learned per token, soft edge "
                f"{cfg.caa_tau:g}), global branch top-k {topk}, gate {cfg.caa_gate}, of a {T}-token sequence")
        covers = covers_all("caa", cfg.window, T)
        return line, (covers.replace("so it computes full attention", "so its local branch is full attention")
                      if covers and cfg.caa_gate != "global" else None)

    def attention_flops(self, T):
        cfg, per_key = self.cfg, self.per_key()
        grad = nograd = 0.0
        if cfg.caa_gate != "global":  # the local branch reads up to caa_window_max keys
            grad += per_key * mean_keys(T, lambda t: causal_keys(t, cfg.caa_window_max))
        if cfg.caa_gate != "local":
            if cfg.caa_topk == "all":
                grad += per_key * mean_keys(T, causal_keys)
            else:  # every visible score to find the top k_i = ceil(sqrt(t + 1)), then attend to those
                nograd += per_key / 2 * mean_keys(T, causal_keys)
                grad += per_key * mean_keys(T, lambda t: torch.ceil(torch.sqrt(t + 1)))
        return grad, nograd


# ---------------------------------------------------------------------------- combiner

def combiner_attention(q, k, v, kbar, vbar, scale, q_start, k_start, block):
    """(B, H, T, D): [Combiner]'s factorized attention (§2-3, eqs. 4-9): one softmax over
    q_t . k_s * scale for the keys s of t's own aligned block of `block` positions, s <= t
    (direct), and q_t . kbar_r * scale for every block r before t's (one span each), applied
    to [v_s; vbar_r]. scale: a float. kbar (B, Hkv, R, D), vbar (B, H, R, D): the summaries of
    blocks 0 .. R-1 (`combiner_summaries`), R >= the last query's block. Plain attention over
    keys [k; kbar] and values [v; vbar] with one mask."""
    B, H, T, _ = q.shape
    S, R = k.shape[2], kbar.shape[2]
    keys = expand_kv(torch.cat([k, kbar], dim=2), H)  # (B, H, S + R, D)
    values = torch.cat([expand_kv(v, H), vbar], dim=2)  # (B, H, S + R, D)
    q_block = torch.arange(q_start, q_start + T, device=q.device)[:, None] // block  # (T, 1)
    k_block = torch.arange(k_start, k_start + S, device=q.device) // block  # (S,)
    direct = allowed(T, S, q_start, k_start, q.device) & (k_block == q_block)  # (T, S)
    span = torch.arange(R, device=q.device) < q_block  # (T, R)
    logits = (q @ keys.transpose(-2, -1)) * scale  # (B, H, T, S + R)
    return masked_softmax_attend(logits, torch.cat([direct, span], dim=1), values)


def combiner_summaries(qbar, k_blocks, v_blocks, scale):
    """One span per completed block r ([Combiner]-Fixed, §3.2):

        kbar_r = max_{j in r} k_j                                  (elementwise)
        vbar_r = sum_{j in r} softmax_j(qbar_r . k_j * scale) v_j  (no causal mask inside r)

    qbar (B, H, R, D): the elementwise max of each block's queries; k_blocks, v_blocks
    (B, Hkv, R, s, D). Returns kbar (B, Hkv, R, D) and vbar (B, H, R, D): vbar depends on the
    query head through qbar, so it has H heads even with grouped-query attention. Memory
    O(R * s) per head, so every implementation of `combiner_attention` takes these as inputs."""
    B, H, R, D = qbar.shape
    Hkv = k_blocks.shape[1]
    kbar = k_blocks.amax(dim=3)  # (B, Hkv, R, D)
    qbar = qbar.view(B, Hkv, H // Hkv, R, D)  # the query heads that share each key head
    logits = torch.einsum("bkgrd,bkrsd->bkgrs", qbar, k_blocks) * scale  # (B, Hkv, g, R, s)
    p = torch.softmax(at_least_float32(logits), dim=-1).to(v_blocks.dtype)
    vbar = torch.einsum("bkgrs,bkrsd->bkgrd", p, v_blocks)  # (B, Hkv, g, R, D)
    return kbar, vbar.reshape(B, H, R, v_blocks.shape[-1])


def to_blocks(x_BHTD, before, block, fill):
    """(B, H, T, D) -> (B, H, n, s, D): `before` rows of `fill`, the T rows, then `fill` up to
    a whole number n of blocks of s rows."""
    T = x_BHTD.shape[2]
    after = -(before + T) % block
    x = F.pad(x_BHTD, (0, 0, before, after), value=fill) if before or after else x_BHTD  # no copy if whole
    return x.view(*x.shape[:2], (before + T + after) // block, block, x.shape[-1])


class CombinerAttention(CausalSelfAttention):
    """`combiner`: [Combiner]-Fixed, causal (the "Sparse [Combiner]" row of [CAA]'s table,
    validation loss 4.904). Every earlier token is reached, directly or through one summary
    per block:

        direct(i) = {j : block(j) = block(i), j <= i},  block(i) = floor(i / s)
        kbar_r = max_{j in r} k_j,   qbar_r = max_{j in r} q_j            (elementwise)
        vbar_r = sum_{j in r} softmax_j(qbar_r . k_j / sqrt(d)) v_j
        y_i = softmax over [q_i . k_j / sqrt(d) for j in direct(i);
                            q_i . kbar_r / sqrt(d) for r < block(i)]  applied to [v_j; vbar_r]

    The paper says: the positions are partitioned into s-sized spans (Combiner-Fixed, §3.2),
    the query's own span is attended directly and causally, each earlier span through a
    max-pooled key and a value that is the span's own attention output (§3.2; google-research
    `combiner/`, TensorFlow `sqrt_fixed_full` with causal=True). The block is *aligned*, not
    a sliding window: a token at the start of a block sees only itself directly, plus the
    summaries of all earlier blocks. s = cfg.window (256). No parameters beyond q, k, v, o.
    Cost O(T (s + T/s)) time and memory (kernels.py), O(T sqrt T) at s ~ sqrt T.

    `summarise` makes kbar, vbar of every complete block; `attend` reads them and the keys of
    the queries' own blocks.
    """

    def summarise(self, q, k, v, x, start):
        """kbar (B, Hkv, R, D), vbar (B, H, R, D) of the R complete blocks among the positions
        start .. of q, k and v (start: a block's first position): a span's value needs the
        max over all of its block's queries, so the queries of every earlier block are read."""
        s = self.cfg.window
        if start % s or q.shape[2] != k.shape[2]:
            raise ValueError(f"combiner summarises whole blocks of {s} from their queries and keys (queries from "
                             f"{start}, {q.shape[2]} queries, {k.shape[2]} keys): run from position 0, or pass "
                             f"`summary`, the summaries of every earlier block")
        R = k.shape[2] // s
        qbar = to_blocks(q[:, :, :R * s], 0, s, 0.0).amax(dim=3)  # (B, H, R, D)
        return combiner_summaries(qbar, to_blocks(k[:, :, :R * s], 0, s, 0.0), to_blocks(v[:, :, :R * s], 0, s, 0.0),
                                  self.scale)

    def attend(self, q, k, v, x, q_start, k_start, summary=None):
        if summary is None:  # every block's, less the last query's own block on (it reads those keys directly)
            before = (q_start + q.shape[2] - 1) // self.cfg.window - k_start // self.cfg.window
            summary = tuple(t[:, :, :before] for t in self.summarise(q, k, v, x, k_start))
        kbar, vbar = summary
        return self.ops(q).combiner_attention(q, k, v, kbar, vbar, self.scale, q_start, k_start, self.cfg.window)

    # -- not the method (skip it): what the plan, FLOP count, budget check, KV cache, conversion, analysis read
    FROM_PRETRAINED = ("no new parameters: blocks and max-pooled summaries of the pretrained keys, "
                       "training-free")

    def summary_window(self):
        # one summary per block: a decoding step reads them and its own block's keys (the cache
        # keeps that block's keys and queries until it completes), O(s + T/s) per layer
        return self.cfg.window, self.cfg.window

    keys_last_kv = (False, False)  # it reads the cache's last keys, a slice: contiguous rows of D

    def oldest_key_needed(self, next_pos):
        # Keep the block of the last token: once complete, the next step summarises it.
        return (next_pos - 1) // self.cfg.window * self.cfg.window

    @classmethod
    def settings(cls, cfg):
        return ("window",)  # its block

    @classmethod
    def describe(cls, cfg, T):
        W = cfg.window
        return (f"blocks of {W} keys, plus one summary per completed block, of a {T}-token sequence",
                f"combiner: block {W} >= seq_len {T}: one block, so it computes full attention; pass "
                f"--window below {T}" if W >= T else None)

    def attention_flops(self, T):
        s = self.cfg.window  # own block up to t, one summary per earlier block, and building them (s keys a block)
        return self.per_key() * (mean_keys(T, lambda t: t % s + 1 + torch.div(t, s, rounding_mode="floor")) + 1), 0.0


# ---------------------------------------------------------------------------- shared by nsa and moba
# Block selection and block attention: `top_blocks` (nsa_top_blocks, moba_select) and
# `block_attention` (nsa's selected branch, moba's one branch).

def top_blocks(scores, valid, forced, n, select=top_n, owned=False):
    """(.., T, n) long: each query's n valid blocks of highest score, forced ones first, -1 in
    the slots left when fewer than n are valid; equal scores go to the most recent block
    (`top_n`, or an Ops' `select`, which computes the same), so equal scores read as a window.
    scores (.., T, J) float, overwritten if `owned` (the caller's: a copy is 0.8 GB for moba at
    T = 32768); valid, forced (T, J) bool. No gradient: the choice is discrete ([NSA] §6.1)."""
    fill = torch.where(forced, float("inf"), float("-inf")).to(scores.dtype)  # forced first, invalid never
    return select(torch.where(valid & ~forced, scores, fill, out=scores if owned else None), n)


def block_attention(q, k, v, scale, q_start, k_start, block, blocks):
    """(B, H, T, D): one softmax of q_t . k_s * scale over the keys s <= t of the blocks that
    query t lists, v-weighted ([MoBA] eq. 2; [NSA]'s selected branch, eqs. 11-12).
    blocks (B, H, T, n) long: absolute block numbers floor(position / block), one list per
    query head, -1 for an empty slot; no gradient (the choice of blocks is discrete). A query
    whose blocks hold no visible key gets 0. Builds a (B, H, T, S, n) comparison: reference only."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    k, v = expand_kv(k, H), expand_kv(v, H)
    logits = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
    key_block = torch.arange(k_start, k_start + S, device=q.device) // block  # (S,)
    chosen = (blocks[:, :, :, None, :] == key_block[:, None]).any(-1)  # (B, H, T, S)
    mask = chosen & allowed(T, S, q_start, k_start, q.device)
    return softmax_or_zero(logits, mask).to(v.dtype) @ v


# ---------------------------------------------------------------------------- nsa

def compressed_probs(q, k_cmp, scale, q_start, length, stride):
    """(B, H, T, C) float32: p^cmp_t = softmax_i(q_t . K^cmp_i * scale) ([NSA] eq. 8) over
    the compressed keys a query can see: key i summarises positions i*stride ..
    i*stride + length - 1 and is visible to query t once its last position is <= t ([xl],
    [fla] likewise); a query that sees none gets 0 ([fla-nsa], [xl])."""
    (B, H, T, _), C = q.shape, k_cmp.shape[2]
    with torch.autocast(q.device.type, enabled=False):  # float32 under autocast too, as every fast form
        logits = (at_least_float32(q) @ at_least_float32(expand_kv(k_cmp, H)).transpose(-2, -1)) * scale
    q_pos = torch.arange(q_start, q_start + T, device=q.device)[:, None]
    visible = torch.arange(C, device=q.device) * stride + length - 1 <= q_pos  # (T, C)
    return softmax_or_zero(logits, visible)


def compressed_branch(q, k_cmp, v_cmp, scale, q_start, length, stride, block, choose):
    """[NSA]'s compressed branch and the selection it drives, from one p^cmp (eq. 8): the
    output (B, H, T, D) = sum_i p^cmp_ti V^cmp_i (eqs. 7-8), and the blocks (B, H, T, n) that
    choose(p^slc, q_start) picks from the block scores p^slc (B, H, T, J) = eq. 9 of the same
    p^cmp in float32, J the blocks up to the last query's own (None without `choose`); a fast
    form may call `choose` a chunk of queries at a time, with the blocks up to its last query."""
    B, H, T, _ = q.shape
    p = compressed_probs(q, k_cmp, scale, q_start, length, stride)  # (B, H, T, C)
    out = p.to(v_cmp.dtype) @ expand_kv(v_cmp, H)
    if choose is None:
        return out, None
    with torch.autocast(q.device.type, enabled=False):  # eq. 9 in float32 under autocast too
        scores = p.detach() @ block_overlap(p.shape[-1], ceil_div(q_start + T, block), length, stride, block, p.device)
    return out, choose(scores, q_start)


def block_overlap(C, J, length, stride, block, device):
    """(C, J): positions compressed key i shares with selection block j, over the stride:
    [NSA] eq. 9 in its overlap reading ([xl]'s transform_score; eq. 9 as printed indexes
    backwards), the identity when length = stride = block."""
    start = torch.arange(C, device=device)[:, None] * stride
    first = torch.arange(J, device=device) * block
    shared = (torch.minimum(start + length, first + block) - torch.maximum(start, first)).clamp(min=0)
    return shared.float() / stride


def nsa_top_blocks(scores, q_start, block, n, n_kv_head, select=top_n, owned=False):
    """(B, H, T, n): the blocks each query reads ([NSA] eqs. 10-12), from its block scores
    (B, H, T, J; overwritten if `owned`). Eq. 10: the query heads of a key head sum their scores, choose together.
    §4.1: n counts 3 forced blocks, "the 1 initial block and 2 local blocks": block 0, the
    query's own and the one before ([xl], [fla]); the rest the best of its blocks j block <= t."""
    B, H, T, J = scores.shape
    scores = scores.view(B, n_kv_head, H // n_kv_head, T, J).sum(2) if H > n_kv_head else scores  # eq. 10
    own = torch.arange(q_start, q_start + T, device=scores.device)[:, None] // block  # (T, 1)
    j = torch.arange(J, device=scores.device)
    valid = j <= own
    forced = valid & ((j == 0) | (j == own) | (j == own - 1))
    return expand_kv(top_blocks(scores, valid, forced, n, select, owned=owned or H > n_kv_head), H)  # a sum is ours


class NativeSparseAttention(CausalSelfAttention):
    """`nsa`: Native Sparse Attention ([NSA]; DeepSeek's 27B-MoE runs, not at our scale).

        o_t = sum_{c in cmp, slc, win} g_t^c Attn(q_t, K_t^c, V_t^c)          ([NSA] eq. 5)
        cmp: K^cmp_i = phi(k over positions i*d .. i*d + l - 1), visible when i*d + l - 1 <= t
        slc: p^cmp = softmax(q_t K^cmp) (eq. 8) -> block scores p^slc (eq. 9) -> the top-n
             blocks of l' positions (eqs. 10-12); raw keys s <= t of those blocks
        win: the keys t - W <= s <= t (W + 1 keys: `local`'s rule)
        g_t = sigmoid(W_g x_t + b_g) in R^{3 H}: one gate per branch, head and token (§3.2)
    Three softmaxes over three key sets, mixed after normalisation (so no single mask).

    The paper says, and what this project chose instead:
    - phi is a learnable MLP with intra-block position encoding (§3.3.1). Here phi is a mean
      over the block by default ([fla]'s choice; no parameters, [NSA]'s MLP over l x D inputs
      costs (l D)^2 weights per layer for K and V); nsa_compress='mlp' is [lr]'s form,
      mean(block) + Linear(lD->lD) ReLU Linear(lD->D) over the block plus a learned position
      embedding, its last layer zero-initialised so it starts as the mean. Post-RoPE k pooled.
    - Eq. 9 in its overlap reading (`block_overlap`). Needs d | l, d | l'.
    - The paper gives each branch independent keys and values; every reference code ([fla],
      [fla-nsa], [xl], [lr]) shares one projection, and so does this one.
    - nsa_branches switches branches off ([NSA] ablates them): e.g. 'slc,win'. The scores
      still come from the compressed keys when the cmp branch is off (its output is then
      computed and left out of the sum).
    Sizes (`l`, `d`, `l'`, n, W) = nsa_cmp_block, nsa_cmp_stride, nsa_block, nsa_topk,
    nsa_window; paper: 32, 16, 64, 16, 512 at 8k tokens; defaults here for T = 1024: 16, 8,
    32, 8, 128 (~512 keys per query at t = 1023); the cpu preset at T = 256: 8, 4, 16, 5, 32.
    Init (ours): W_g = 0, b_g = 0, every gate 0.5 (the sigmoid's steepest point, like dsa's).
    """
    BRANCHES = ("cmp", "slc", "win")

    def __init__(self, cfg):
        super().__init__(cfg)
        D, l = cfg.head_dim, cfg.nsa_cmp_block
        self.branches = cfg.nsa_branches.split(",")
        self.branch_gate = nn.Linear(cfg.d_model, 3 * cfg.n_head)
        if cfg.nsa_compress == "mlp":
            self.compress_mlp = nn.ModuleDict({
                name: nn.Sequential(nn.Linear(l * D, l * D), nn.ReLU(), nn.Linear(l * D, D)) for name in "kv"})
            self.compress_pos = nn.Parameter(torch.empty(2, l, D))  # intra-block position, for k and v
        self.init_gates()

    def init_gates(self):
        nn.init.zeros_(self.branch_gate.weight)
        nn.init.zeros_(self.branch_gate.bias)
        if self.cfg.nsa_compress == "mlp":
            nn.init.normal_(self.compress_pos, std=0.02)
            for mlp in self.compress_mlp.values():
                nn.init.zeros_(mlp[2].weight)
                nn.init.zeros_(mlp[2].bias)

    def compress(self, x_BhSD, which):
        """(B, Hkv, C, D): phi of eq. 7 over the windows [i d, i d + l - 1] inside the S keys."""
        cfg = self.cfg
        B, Hkv, S, D = x_BhSD.shape
        if S < cfg.nsa_cmp_block:
            return x_BhSD.new_zeros(B, Hkv, 0, D)
        windows = x_BhSD.unfold(2, cfg.nsa_cmp_block, cfg.nsa_cmp_stride).transpose(-1, -2)  # (B, Hkv, C, l, D)
        pooled = windows.mean(3)
        if cfg.nsa_compress == "mlp":
            flat = (windows + self.compress_pos["kv".index(which)]).flatten(-2)  # (B, Hkv, C, l * D)
            pooled = pooled + self.compress_mlp[which](flat).to(pooled.dtype)
        return pooled

    def summarise(self, q, k, v, x, start):
        """K^cmp, V^cmp (B, Hkv, C, D): eq. 7 over the keys and values (start: a multiple of d)."""
        return self.compress(k, "k"), self.compress(v, "v")

    def choose(self, q):
        """Eqs. 10-12 on q's path: `nsa_top_blocks` with its sizes as keywords (a fast form may
        choose while it scores), called on block scores (B, H, T, J) and q_start."""
        return functools.partial(nsa_top_blocks, block=self.cfg.nsa_block, n=self.cfg.nsa_topk,
                                 n_kv_head=self.n_kv_head, select=self.ops(q).top_n, owned=True)

    def branch_gates(self, x):
        """(3, B, H, T, 1): g_t^c = sigmoid(W_g x_t + b_g), branch-major: the 3 H outputs of W_g
        are read as (branch, head), branches in the order cmp, slc, win (`BRANCHES`)."""
        B, T, _ = x.shape
        return torch.sigmoid(self.branch_gate(x)).view(B, T, 3, self.n_head).permute(2, 0, 3, 1)[..., None]

    def attend(self, q, k, v, x, q_start, k_start, summary=None):
        cfg, op = self.cfg, self.ops(q)
        k_cmp, v_cmp = self.summarise(q, k, v, x, k_start) if summary is None else summary  # eq. 7
        out = {}  # eqs. 8-12: one p^cmp weighs V^cmp (the cmp branch) and scores the blocks
        out["cmp"], blocks = op.compressed_branch(q, k_cmp, v_cmp, self.scale, q_start, cfg.nsa_cmp_block,
                                                  cfg.nsa_cmp_stride, cfg.nsa_block, self.choose(q))
        if "slc" in self.branches:
            out["slc"] = op.block_attention(q, k, v, self.scale, q_start, k_start, cfg.nsa_block, blocks)
        if "win" in self.branches:
            out["win"] = op.attention(q, k, v, self.scale, q_start, k_start, window=cfg.nsa_window)
        g = self.branch_gates(x)
        return sum(g[self.BRANCHES.index(name)].to(out[name].dtype) * out[name] for name in self.branches)  # eq. 5

    # -- not the method (skip it): what the plan, FLOP count, budget check, KV cache, conversion, analysis read
    FROM_PRETRAINED = ("not neutral: its three branch gates start at sigmoid(0) = 0.5, so the output is 1.5 "
                       "attention outputs")

    def summary_window(self):
        return self.cfg.nsa_cmp_block, self.cfg.nsa_cmp_stride  # one compressed key and value per window

    # the compressed keys and values stored along the keys on a CPU: a decoding step's one row
    # of q K^cmp^T and of p^cmp V^cmp then streams down C contiguous positions per element of
    # D, op by op 1.3-1.9x as fast as reading rows of D (values), 1.15x-1.7x (keys, 1023 to 4095
    # compressed keys at batch 8)
    keys_last_summaries = True
    keys_last_kv = (False, False)  # its selected blocks are gathered from the cache as rows

    def observe(self, q, k, v, x, q_start, k_start, summary):
        cfg = self.cfg
        k_cmp, v_cmp = self.summarise(q, k, v, x, k_start) if summary is None else summary
        with torch.no_grad():  # the blocks `attend` chose, from the same stage on the same inputs
            blocks = self.ops(q).compressed_branch(q, k_cmp, v_cmp, self.scale, q_start, cfg.nsa_cmp_block,
                                                   cfg.nsa_cmp_stride, cfg.nsa_block, self.choose(q))[1]
        g = self.branch_gates(x)
        for i, name in enumerate(self.BRANCHES):
            self.note(f"gate_{name}", g[i, ..., 0].transpose(1, 2))  # (B, T, H)
        self.note("selection", blocks)
        self.note("selected_distance", lambda: block_distance(blocks, q_start, self.cfg.nsa_block))

    @classmethod
    def check_config(cls, cfg):
        l, d, block = cfg.nsa_cmp_block, cfg.nsa_cmp_stride, cfg.nsa_block
        if d < 1 or l % d or block % d or l > block:
            raise ValueError(f"nsa_cmp_stride={d} must divide nsa_cmp_block={l} and nsa_block={block}, and "
                             f"nsa_cmp_block <= nsa_block ([NSA] eq. 9), e.g. 8, 16, 32")
        if cfg.nsa_topk < 3:
            raise ValueError(f"nsa_topk={cfg.nsa_topk} must be >= 3: it counts the 3 forced blocks "
                             f"(the first, the query's own and the one before)")
        if cfg.nsa_window < 0:
            raise ValueError(f"nsa_window={cfg.nsa_window} must be >= 0")
        branches = cfg.nsa_branches.split(",")
        if not branches or len(set(branches)) != len(branches) or set(branches) - set(cls.BRANCHES):
            raise ValueError(f"nsa_branches={cfg.nsa_branches!r} must be a comma-separated subset of cmp,slc,win")

    @classmethod
    def settings(cls, cfg):
        return ("nsa_cmp_block", "nsa_cmp_stride", "nsa_block", "nsa_topk", "nsa_window", "nsa_compress",
                "nsa_branches")

    @classmethod
    def selection_unit(cls, cfg):
        return cfg.nsa_block

    @classmethod
    def describe(cls, cfg, T):
        reach = cfg.nsa_topk * cfg.nsa_block
        line = (f"compressed keys of {cfg.nsa_cmp_block} every {cfg.nsa_cmp_stride}, the top {cfg.nsa_topk} blocks of "
                f"{cfg.nsa_block} ({reach} keys), a window {cfg.nsa_window} keys back, of a {T}-token sequence")
        return line, (f"nsa: its {cfg.nsa_topk} selected blocks of {cfg.nsa_block} cover the whole {T}-token sequence, "
                      f"so its selected branch is full attention; pass a smaller --nsa_topk or --nsa_block"
                      if reach >= T else None)

    @classmethod
    def check_budget(cls, cfg, T):
        if cfg.nsa_topk * cfg.nsa_block > T:
            raise ValueError(f"--nsa_topk={cfg.nsa_topk} x --nsa_block={cfg.nsa_block} = "
                             f"{cfg.nsa_topk * cfg.nsa_block} keys > seq_len={T}: the selection would be dense; use nsa_topk in 3 .. "
                             f"{max(3, T // cfg.nsa_block)}")

    def attention_flops(self, T):
        cfg, per_key = self.cfg, self.per_key()
        l, d = cfg.nsa_cmp_block, cfg.nsa_cmp_stride
        cmp = mean_keys(T, lambda t: torch.clamp(torch.div(t + 1 - l, d, rounding_mode="floor") + 1, min=0))
        grad = per_key * cmp  # the compressed branch always runs: its scores pick the blocks
        if "slc" in self.branches:
            grad += per_key * mean_keys(T, lambda t: block_keys(t, cfg.nsa_block, cfg.nsa_topk))
        if "win" in self.branches:
            grad += per_key * mean_keys(T, lambda t: causal_keys(t, cfg.nsa_window))
        if cfg.nsa_compress == "mlp":  # run once per compressed key (every d positions), for k and v
            grad += 2 * sum(p.numel() for n, p in self.compress_mlp.named_parameters() if n.endswith("weight")) / d
        return grad, 0.0

    def matmul_params(self):  # the compressor's MLP runs per compressed key, not per token (attention_flops)
        mlp = sum(m.weight.numel() for m in self.compress_mlp.modules() if isinstance(m, nn.Linear)) \
            if self.cfg.nsa_compress == "mlp" else 0
        return super().matmul_params() - mlp


# ---------------------------------------------------------------------------- moba

def block_means(k, block):
    """(B, Hkv, J, D) float32: K_bar_j, the mean of the keys k (B, Hkv, S, D) over each complete
    block j of `block` positions (block j: positions j B .. j B + B - 1 of k)."""
    B, Hkv, S, D = k.shape
    J = S // block
    return k[:, :, :J * block].float().view(B, Hkv, J, block, D).mean(3)


def moba_select(q, means, q_start, block, topk, select=top_n):
    """(B, H, T, topk): the blocks each query reads ([MoBA] eqs. 5-6), from q (B, H, T, D)
    and the means (B, Hkv, J, D) of the complete blocks from position 0 (`block_means`):
        s_j = q_t . K_bar_j                                                   (eq. 5)
        g_j = 1 iff j is the query's own block, or among the top k - 1 of its
              earlier blocks j < floor(t / B) by s_j                           (eq. 6)
    Per query head, in float32, without gradient (the gate is discrete)."""
    B, H, T, D = q.shape
    J = ceil_div(q_start + T, block)  # blocks up to the last query's own
    full = means.shape[2]  # complete blocks
    with torch.autocast(q.device.type, enabled=False):  # float32 under autocast too
        scores = grouped_dots(q.detach().float(), means.detach().float())  # (B, H, T, full): eq. 5
    # The incomplete last block has no mean; its score is a 0 pad, read only by that block's
    # own queries, for which it is forced (its score is never compared).
    scores = F.pad(scores, (0, J - full))
    own = torch.arange(q_start, q_start + T, device=q.device)[:, None] // block  # (T, 1)
    j = torch.arange(J, device=q.device)
    return top_blocks(scores, j <= own, j == own, topk, select, owned=True)


class MixtureOfBlockAttention(CausalSelfAttention):
    """`moba`: Mixture of Block Attention ([MoBA]; Kimi's long-context runs).

        o_t = softmax over the keys s <= t of the gated blocks (`moba_select`) of
              q_t . k_s / sqrt(d), times v                              ([MoBA] eqs. 2-4)
    One softmax over the union of the selected blocks, no parameters.

    The paper says, and this project follows ([MoBA] §2.2 and MoonshotAI's moba_naive):
    routing per query token and per head (GQA: per query head); only blocks wholly in the
    past (j < floor(t / B)) compete; the query's own block is always selected, causal inside,
    and k counts it ("top-k = 3: at most 2 history blocks and the current block"); the
    gate uses post-RoPE q, k in float32 and passes no gradient. moba_topk = 1 means the own
    block alone (the naive code's meaning; MoonshotAI's efficient code would fall back to
    full attention there). model.py's moba_full_last = m makes the last m layers full
    attention (the paper's layer-wise hybrid, §3.2: 3 of 32 layers for Llama-8B-1M).
    Sizes: the paper uses B = 512, k = 3 at 8K tokens (Table 1). Here B = moba_block = 64,
    k = moba_topk = 4 at T = 1024 (at most 256 keys a query; `local` at W = 256 reads 257);
    the cpu preset at T = 256: B = 16, k = 4 (at most 64 keys).
    """

    def summarise(self, q, k, v, x, start):
        """K_bar (B, Hkv, J, D): the means of the complete blocks of k (start: a block boundary)."""
        return block_means(k, self.cfg.moba_block)

    def attend(self, q, k, v, x, q_start, k_start, summary=None):
        cfg = self.cfg
        means = self.summarise(q, k, v, x, k_start) if summary is None else summary
        blocks = self.ops(q).moba_select(q, means, q_start, cfg.moba_block, cfg.moba_topk)  # (B, H, T, k)
        return self.ops(q).block_attention(q, k, v, self.scale, q_start, k_start, cfg.moba_block, blocks)

    # -- not the method (skip it): what the plan, FLOP count, budget check, KV cache, conversion, analysis read
    FROM_PRETRAINED = "no new parameters: blocks chosen by the pretrained keys' block means, training-free"

    def summary_window(self):
        return self.cfg.moba_block, self.cfg.moba_block  # one mean per block

    keys_last_kv = (False, False)  # its selected blocks are gathered from the cache as rows
    keys_last_summaries = True  # a decoding step's q . K_bar streams down the block means

    def observe(self, q, k, v, x, q_start, k_start, summary):
        means = self.summarise(q, k, v, x, k_start) if summary is None else summary
        blocks = self.ops(q).moba_select(q, means, q_start, self.cfg.moba_block, self.cfg.moba_topk)
        self.note("selection", blocks)
        self.note("selected_distance", lambda: block_distance(blocks, q_start, self.cfg.moba_block))

    @classmethod
    def check_config(cls, cfg):
        if cfg.moba_block < 1 or cfg.moba_topk < 1:
            raise ValueError(f"moba_block={cfg.moba_block} and moba_topk={cfg.moba_topk} must be >= 1")

    @classmethod
    def settings(cls, cfg):
        return ("moba_block", "moba_topk", "moba_full_last")  # the last: a ModelConfig field (which layers)

    @classmethod
    def selection_unit(cls, cfg):
        return cfg.moba_block

    @classmethod
    def describe(cls, cfg, T):
        reach = cfg.moba_topk * cfg.moba_block
        line = (f"its own block and the top {cfg.moba_topk - 1} earlier blocks of {cfg.moba_block} ({reach} keys), "
                f"of a {T}-token sequence")
        return line, (f"moba: {cfg.moba_topk} blocks of {cfg.moba_block} cover the whole {T}-token sequence, so it "
                      f"computes full attention; pass a smaller --moba_topk or --moba_block" if reach >= T else None)

    @classmethod
    def check_budget(cls, cfg, T):
        if cfg.moba_topk * cfg.moba_block > T:
            raise ValueError(f"--moba_topk={cfg.moba_topk} x --moba_block={cfg.moba_block} = "
                             f"{cfg.moba_topk * cfg.moba_block} keys > seq_len={T}: the selection would be dense; "
                             f"use moba_topk in 1 .. {max(1, T // cfg.moba_block)}")

    def attention_flops(self, T):
        B, k = self.cfg.moba_block, self.cfg.moba_topk
        routing = self.per_key() / 2 * mean_keys(T, lambda t: torch.div(t, B, rounding_mode="floor"))  # q . block means
        return self.per_key() * mean_keys(T, lambda t: block_keys(t, B, k)), routing


# ---------------------------------------------------------------------------- indexer (DeepSeek Sparse Attention)

class LightningIndexer(nn.Module):
    """[DS32]'s lightning indexer, in our model's terms (no MLA, no query latent: it reads the
    block's normalised input x, as the main q, k, v do):
        q^I_t = W_q x_t, split into J heads of d      k^I_t = LayerNorm(W_k x_t)  (one key per token)
        RoPE on the first d/2 dims of both (the model's rotate-half RoPE at d/2; [DS32] ropes
        its first rope_head_dim = d/2 too)     w_t = W_w x_t * J^{-1/2}  (may be negative)
    Sizes J = index_heads, d = index_head_dim. Its projections start as the model's
    initialisation leaves them (Model draws every Linear weight from N(0, 0.02)); LayerNorm
    starts at gain 1 and bias 0."""

    def __init__(self, cfg):
        super().__init__()
        J, d = cfg.index_heads, cfg.index_head_dim
        self.n_head, self.head_dim = J, d
        self.rope_table = RopeTable(d // 2, cfg.rope_theta)
        self.q_proj = nn.Linear(cfg.d_model, J * d, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, d, bias=False)
        self.k_norm = nn.LayerNorm(d)
        self.weights_proj = nn.Linear(cfg.d_model, J, bias=False)

    def rope(self, x, start):
        """RoPE on the first half of the last dim of x (B, T, .., d), positions start .."""
        T, half = x.shape[1], self.head_dim // 2
        cos, sin = self.rope_table(start, T, x.device)
        shape = (T,) + (1,) * (x.dim() - 3) + (half,)  # broadcast over the heads, if any
        rotated = apply_rope(x[..., :half], cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype))
        return torch.cat([rotated, x[..., half:]], dim=-1)

    def queries(self, x_BTC, start):
        """-> queries (B, T, J, d) and head weights (B, T, J) of positions start .."""
        B, T, _ = x_BTC.shape
        q = self.rope(self.q_proj(x_BTC).view(B, T, self.n_head, self.head_dim), start)
        return q, self.weights_proj(x_BTC) * self.n_head ** -0.5

    def keys(self, x_BTC, start):
        """-> keys (B, T, d) of positions start .."""
        return self.rope(self.k_norm(self.k_proj(x_BTC)), start)

    def forward(self, x_BTC, start):
        """-> queries (B, T, J, d), keys (B, T, d), head weights (B, T, J) of positions start .."""
        q, w = self.queries(x_BTC, start)
        return q, self.keys(x_BTC, start), w


def lightning_scores(q_BTJD, k_BSD, w_BTJ, q_start, k_start):
    """(B, T, S) float32, [DS32] eq. 1: I[t, s] = sum_j w[t, j] ReLU(q[t, j] . k[s] / sqrt(d)),
    -inf where key s is not visible to query t. q (B, T, J, d) the indexer's queries, k (B, S, d)
    its keys (one per token, shared by the J heads), w (B, T, J) its head weights. Under
    autocast the products q . k run in its dtype ([DS32]'s run in FP8), the weighted sum in float32."""
    B, T, J, d = q_BTJD.shape
    S = k_BSD.shape[1]
    dots = torch.einsum("btjd,bsd->btjs", q_BTJD.float(), k_BSD.float()) / math.sqrt(d)  # (B, T, J, S)
    scores = (F.relu(dots) * w_BTJ.float()[..., None]).sum(2)  # (B, T, S)
    return scores.masked_fill(~allowed(T, S, q_start, k_start, scores.device), float("-inf"))


def top_keys(scores, n):
    """(B, T, n) long: each query's n keys of highest score, -1 in the slots beyond its
    visible keys (-inf scores); equal scores go to the most recent key (`top_n`). ReLU makes
    exact zeros common, so ties are frequent: an indexer whose scores are all 0 picks the n
    most recent keys, a window. scores (B, T, S). No gradient."""
    return top_n(scores, n)


@torch.no_grad()
def indexer_topk(q_idx, k_idx, w, q_start, k_start, n):
    """(B, T, min(n, S)) long: each query's top keys by the lightning indexer (eq. 1, `top_keys`)."""
    return top_keys(lightning_scores(q_idx, k_idx, w, q_start, k_start), min(n, k_idx.shape[1]))


def listed(keys, S):
    """(B, T, S) bool: True at the keys each query lists in keys (B, T, n), -1 = none."""
    slot = torch.where(keys < 0, S, keys)  # -1 -> a spare column, dropped
    return torch.zeros(*keys.shape[:2], S + 1, dtype=torch.bool, device=keys.device).scatter_(-1, slot, True)[..., :S]


def selected_attention(q, k, v, scale, q_start, k_start, keys):
    """(B, H, T, D): one softmax of q_t . k_s * scale over the keys s that query t lists,
    v-weighted ([DS32] eq. 2). keys (B, T, n) long: indices into the S keys, one list per
    query shared by every head, -1 for an empty slot; no gradient (the choice is discrete).
    Only visible keys (s <= t) count; a query listing none gets 0. Builds the (B, T, S)
    choice: reference only."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    k, v = expand_kv(k, H), expand_kv(v, H)
    logits = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
    mask = listed(keys, S)[:, None] & allowed(T, S, q_start, k_start, q.device)  # (B, 1, T, S)
    return softmax_or_zero(logits, mask).to(v.dtype) @ v


def indexer_kl(q, k, scale, q_idx, k_idx, w, q_start, k_start, keys):
    """L^I ([DS32] §2.1, eqs. 3-4): the mean over queries of KL(p_t || softmax(I[t, :])) over
    the visible keys (keys None: the dense warm-up) or over the listed keys (B, T, n) (the
    sparse stage). p_t: the main attention's probabilities (q, k without gradient) summed over
    heads and L1-normalised, which is their mean over the H heads (each head's row sums to 1);
    I = lightning_scores, with gradient (into the indexer alone)."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    scores = lightning_scores(q_idx, k_idx, w, q_start, k_start)  # (B, T, S)
    with torch.no_grad():
        logits = (q.detach().float() @ expand_kv(k.detach().float(), H).transpose(-2, -1)) * scale
        visible = allowed(T, S, q_start, k_start, q.device)[None, None]  # (1, 1, T, S)
        if keys is not None:
            visible = visible & listed(keys, S)[:, None]  # (B, 1, T, S)
        p = softmax_or_zero(logits, visible).mean(1)  # (B, T, S): the heads' mean
    log_i = torch.log_softmax(scores.masked_fill(~visible[:, 0], float("-inf")), dim=-1)
    kl = torch.xlogy(p, p) - p * log_i.masked_fill(p == 0, 0.0)
    return kl.sum() / (B * T)


class IndexerAttention(CausalSelfAttention):
    """`indexer`: DeepSeek Sparse Attention ([DS32]; DeepSeek-V3.2, at 671B, not our scale).

        I[t, s] = sum_j w[t, j] ReLU(q^I[t, j] . k^I[s] / sqrt(d^I))         ([DS32] eq. 1)
        S_t = the min(k, t + 1) visible keys of highest I[t, :]
        u_t = softmax over s in S_t of q_t . k_s / sqrt(d), times v          ([DS32] eq. 2)
    One selection per query, shared by every head ([DS32]'s code adds one -inf mask to all
    heads); the tie rule is `top_keys`'s; the selection passes no gradient.
    Training ([DS32] §2.1): the indexer learns from L^I alone (`indexer_kl`, eqs. 3-4; its
    input x is detached), the main model from the language-model loss alone. After a forward
    in training mode L^I is `self.indexer_loss`, which train.py adds to the loss.
    `dense_warmup = True` attends to every visible key and fits L^I over them (the paper's
    dense warm-up; train.py sets it for its first --indexer_warmup steps); as built, the
    module is sparse. The mean over tokens (the paper writes a sum) keeps L^I independent of
    batch and length.

    What this project chose apart from the paper: no MLA and no query latent (the indexer
    reads x); no FP8 and no Hadamard rotation (numerics for speed). Sizes: index_heads = 4 of
    index_head_dim = 64 (the paper: 64 of 128; 4 x 64 against our 12 x 64 heads keeps the
    paper's indexer-to-attention cost per score); k = index_topk, 0 meaning the window W (so
    the indexer reads W keys a query where `local` reads W + 1; the paper: 2048 at up to
    128K). The scores are dense O(T^2) by design (the paper's are).
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        self.indexer = LightningIndexer(cfg)
        self.dense_warmup = False
        self.loss = LossSlot()

    @property
    def topk(self):
        return self.cfg.index_topk or self.cfg.window

    def summarise(self, q, k, v, x, start):
        """k^I (B, S, d): the indexer's key of every position start .. of x (its input is
        detached: the indexer learns from L^I alone)."""
        if x.shape[1] != k.shape[2]:
            raise ValueError(f"indexer: x holds {x.shape[1]} positions for {k.shape[2]} keys: its keys come from x at "
                             f"every key's position; pass `summary`, the indexer keys of the earlier positions")
        return self.indexer.keys(x.detach(), start)

    def attend(self, q, k, v, x, q_start, k_start, summary=None):
        op = self.ops(q)
        q_idx, w = self.indexer.queries(x.detach(), q_start)
        k_idx = self.summarise(q, k, v, x, k_start) if summary is None else summary
        keys = None  # the dense warm-up: every visible key
        if self.dense_warmup:
            y = op.attention(q, k, v, self.scale, q_start, k_start)
        else:
            keys = op.indexer_topk(q_idx, k_idx, w, q_start, k_start, self.topk)  # S_t, (B, T, n)
            y = op.selected_attention(q, k, v, self.scale, q_start, k_start, keys)  # eq. 2
        # L^I (eqs. 3-4), the indexer's own loss, after a forward in training mode (train.py adds it)
        self.indexer_loss = (op.indexer_kl(q, k, self.scale, q_idx, k_idx, w, q_start, k_start, keys)
                             if self.training else None)
        return y

    # -- not the method (skip it): what the plan, FLOP count, budget check, KV cache, conversion, analysis read
    FROM_PRETRAINED = ("not neutral: its indexer is random (the N(0, 0.02) init), so the top-k keys are random "
                       "until the indexer's KL warm-up trains it")

    @property
    def indexer_loss(self):
        """L^I of the last forward in training mode; None after one in eval mode. Held in a
        LossSlot (`self.loss`), which a copy of the module gets empty."""
        return self.loss.value

    @indexer_loss.setter
    def indexer_loss(self, value):
        self.loss.value = value

    def summary_window(self):
        return 1, 1  # one indexer key per position

    keys_last_kv = (False, False)  # its listed keys are gathered from the cache as rows
    keys_last_summaries = True  # a decoding step's q^I K^I^T streams down the positions (decode_indexer_topk)

    def observe(self, q, k, v, x, q_start, k_start, summary):
        if self.dense_warmup:
            return
        q_idx, w = self.indexer.queries(x.detach(), q_start)
        k_idx = self.summarise(q, k, v, x, k_start) if summary is None else summary
        keys = self.ops(q).indexer_topk(q_idx, k_idx, w, q_start, k_start, self.topk)
        self.note("selection", keys)
        self.note("selected_distance", lambda: key_distance(keys, q_start, k_start))
        self.note("kept_mass", lambda: kept_mass(q, k, self.scale, keys, q_start, k_start))

    @classmethod
    def check_config(cls, cfg):
        if cfg.index_topk < 0 or (cfg.index_topk == 0 and cfg.window < 1):
            raise ValueError(f"index_topk={cfg.index_topk} must be >= 1 (keys per query; 0 takes the "
                             f"window, {cfg.window}, which must then be >= 1)")
        if cfg.index_heads < 1:
            raise ValueError(f"index_heads={cfg.index_heads} must be >= 1")
        if cfg.index_head_dim < 4 or cfg.index_head_dim % 4:
            raise ValueError(f"index_head_dim={cfg.index_head_dim} must be a positive multiple of 4: RoPE "
                             f"rotates its first half in pairs (e.g. 32, 64)")

    @classmethod
    def settings(cls, cfg):
        return ("index_topk", "index_heads", "index_head_dim") + (() if cfg.index_topk else ("window",))

    @classmethod
    def selection_unit(cls, cfg):
        return 1  # single keys

    @classmethod
    def describe(cls, cfg, T):
        k = cfg.index_topk or cfg.window
        line = (f"the top {k} keys per query by a lightning indexer of {cfg.index_heads} heads of "
                f"{cfg.index_head_dim} (index_topk{'' if cfg.index_topk else ' = the window'}), "
                f"of a {T}-token sequence")
        return line, (f"indexer: {k} keys per query cover the whole {T}-token sequence, so it computes full "
                      f"attention; pass --index_topk below {T}" if k >= T else None)

    def attention_flops(self, T):
        cfg, per_key = self.cfg, self.per_key()
        full = mean_keys(T, causal_keys)
        index = (2 * cfg.index_heads * cfg.index_head_dim + 2 * cfg.index_heads) * full  # I[t, s]: J dots, ReLU, weight
        kl_target = per_key / 2 * full  # the main q.k over the visible keys (no gradient)
        return per_key * mean_keys(T, lambda t: torch.clamp(t + 1, max=self.topk)) + index, kl_target


# ---------------------------------------------------------------------------- every variant, by name

VARIANTS = {
    "full": CausalSelfAttention,
    "local": LocalAttention,
    "dsa": DynamicSparseAttention,
    "asga": ASGAttention,
    "caa": ContextAdaptiveAttention,
    "combiner": CombinerAttention,
    "nsa": NativeSparseAttention,
    "moba": MixtureOfBlockAttention,
    "indexer": IndexerAttention,
}


# ---------------------------------------------------------------------------- outside the methods
# What the plan (`describe`), flops.py (`attention_flops`) and analysis (`note`) use, and
# the indexer's loss slot.

def covers_all(name, W, T):
    """The plan's warning when a window of W keys back covers a T-token sequence, or None."""
    return (f"{name}: window {W} covers the whole {T}-token sequence (a query has at most {T - 1} keys "
            f"before it), so it computes full attention; pass --window below {T - 1}") if W >= T - 1 else None


def mean_keys(T, keys):
    """The mean over positions t = 0 .. T-1 of keys(t), a tensor function of t (float64)."""
    return keys(torch.arange(T, dtype=torch.float64, device="cpu")).mean().item()


def causal_keys(t, window=None, window_from=0):
    """Keys a causal query at t sees: t + 1, or window + 1 at positions >= window_from."""
    if window is None:
        return t + 1
    return torch.where(t >= window_from, torch.clamp(t + 1, max=window + 1), t + 1)


def block_keys(t, block, n):
    """Keys of n selected blocks of `block` positions: the own block up to t, plus up to n - 1
    complete earlier ones (nsa's and moba's selection)."""
    return t % block + 1 + block * torch.clamp(torch.div(t, block, rounding_mode="floor"), max=n - 1)


def gate_summary(gate):
    """Per-head mean, std and fraction above 0.5 of a gate tensor whose last dim is heads."""
    g = gate.detach().float().reshape(-1, gate.shape[-1])
    return {"mean": g.mean(0).tolist(), "std": g.std(0, unbiased=False).tolist(),
            "frac_gt_half": (g > 0.5).float().mean(0).tolist()}


def mean_pair_gate(q_term, k_term, w2, b2, q_start, k_start):
    """(B, T, H) float32: each query's mean gate s over its visible keys (what analysis records)."""
    T, S = q_term.shape[2], k_term.shape[2]
    s = torch.sigmoid(pair_gate_logit(q_term.float(), k_term.float(), w2.float(), b2.float()))  # (B, H, T, S)
    mask = allowed(T, S, q_start, k_start, s.device)
    return ((s * mask).sum(-1) / mask.sum(-1)).transpose(1, 2)


def block_distance(blocks, q_start, block):
    """(B, T, H) float: the mean, over a query's selected blocks, of how many blocks back
    from its own each lies (0 = its own block), for the recorded statistics."""
    T = blocks.shape[2]
    own = torch.arange(q_start, q_start + T, device=blocks.device)[:, None] // block  # (T, 1)
    ok = blocks >= 0
    back = ((own - blocks) * ok).sum(-1) / ok.sum(-1).clamp(min=1)  # (B, H, T)
    return back.float().transpose(1, 2)


def key_distance(keys, q_start, k_start):
    """(B, T, 1): the mean distance of each query's selected keys (recorded statistics)."""
    q_pos = torch.arange(q_start, q_start + keys.shape[1], device=keys.device)[:, None]  # (T, 1)
    ok = keys >= 0
    return (((q_pos - k_start - keys) * ok).sum(-1) / ok.sum(-1).clamp(min=1)).float()[..., None]


def kept_mass(q, k, scale, keys, q_start, k_start):
    """(B, T, 1): the share of the dense attention's mass (summed over heads, normalised) on
    each query's selected keys (recorded statistics)."""
    T, S = q.shape[2], k.shape[2]
    logits = (q.float() @ expand_kv(k.float(), q.shape[1]).transpose(-2, -1)) * scale  # (B, H, T, S)
    p = torch.softmax(logits.masked_fill(~allowed(T, S, q_start, k_start, q.device), float("-inf")), -1).mean(1)
    return p.gather(-1, keys.clamp(min=0)).masked_fill(keys < 0, 0.0).sum(-1)[..., None]


class LossSlot:
    """The auxiliary loss of a module's last training-mode forward. A copy of the module
    (copy.deepcopy) gets an empty slot: the loss holds that forward's autograd graph, which
    belongs to it and cannot be copied."""
    value = None

    def __deepcopy__(self, memo):
        return LossSlot()


# ---------------------------------------------------------------------------- which implementation runs

REFERENCE = kernels.Ops(
    name="reference (attention.py, dense)", attention=attention, pair_gated_attention=pair_gated_attention,
    topk_attention=topk_attention, combiner_attention=combiner_attention, block_attention=block_attention,
    selected_attention=selected_attention, compressed_branch=compressed_branch,
    indexer_topk=indexer_topk, indexer_kl=indexer_kl, mean_pair_gate=mean_pair_gate, top_n=top_n,
    moba_select=moba_select)


def ops(kernel, device, rows=None):
    """The one place that picks which implementation of the operations runs.
    'ref': this file. 'flex': kernels.py's FlexAttention + SDPA path on any device.
    'fused': the best path for the device: FlexAttention + SDPA on CUDA; on CPU, where
    FlexAttention has no backward, kernels.py's blockwise path (faster than the reference
    at every measured length, see benchmarks/attention.py). 'blockwise': that path on any
    device (train.py's preflight falls back to it where FlexAttention fails on a GPU).
    Whichever of the last three, a call of at most kernels.DECODE_ROWS query rows (`rows`: a
    decoding step, a short prompt) gets kernels.DECODE: forms that read, of a long KV cache,
    only the keys and summaries the selection names, with no compile and no mask per length."""
    if kernel == "ref":
        return REFERENCE
    if rows is not None and rows <= kernels.DECODE_ROWS:
        return kernels.DECODE
    if kernel == "blockwise":
        return kernels.BLOCKWISE
    if kernel == "flex" or torch.device(device).type == "cuda":
        return kernels.FLEX
    return kernels.BLOCKWISE


def attention_path(cfg, device):
    """One line for the run's plan: which implementation of the core operations runs, e.g.
    'kernel=fused: FlexAttention + SDPA (kernels.py), compiled, on cuda'."""
    chosen, kind = ops(cfg.kernel, device), torch.device(device).type
    how = ""
    if chosen is kernels.FLEX:
        how = ", compiled" if kind == "cuda" else ", uncompiled (no backward for q, k, v on CPU)"
    if chosen is not REFERENCE:
        how += f"; calls of <= {kernels.DECODE_ROWS} query rows (decoding): {kernels.DECODE.name}"
    return f"kernel={cfg.kernel}: {chosen.name}{how}, on {kind}"


# ---------------------------------------------------------------------------- see it: python attention.py

# Small sizes that make each pattern visible in 16 tokens: (label, settings) per panel.
SHOW = {
    "full": [("full", {})],
    "local": [("local, window 4", dict(window=4))],
    "dsa": [("dsa, window 4 from position 8", dict(window=4, dsa_threshold=8))],
    "asga": [("asga, learned gate (every key, reweighted)", {}),
             ("asga_gate=fixed, window 4", dict(asga_gate="fixed", window=4))],
    "caa": [("caa local branch, width 4..6", dict(window=4, caa_window_max=6, caa_gate="local")),
            ("global branch, top ceil(sqrt(t+1))", dict(window=4, caa_window_max=6, caa_gate="global")),
            ("the two mixed by g", dict(window=4, caa_window_max=6))],
    "combiner": [("combiner, blocks of 4 (earlier ones via summaries)", dict(window=4))],
    "nsa": [("nsa cmp: means of 2 every 2", dict(nsa_branches="cmp")),
            ("slc: 4 blocks of 2", dict(nsa_branches="slc")),
            ("win: 2 back", dict(nsa_branches="win")),
            ("the three, gated", {})],
    "moba": [("moba, blocks of 4, top 2", dict(moba_block=4, moba_topk=2))],
    "indexer": [("indexer, top 4 keys", dict(index_topk=4))],
}
SHOW_SIZES = dict(n_head=2, n_kv_head=1, head_dim=8, d_model=16, asga_hidden=4, caa_hidden=8, nsa_cmp_block=2,
                  nsa_cmp_stride=2, nsa_block=2, nsa_topk=4, nsa_window=2, index_heads=2, index_head_dim=8)


@torch.no_grad()
def mixing_weights(variant, T=16, seed=0, **settings):
    """(T, T): the weight with which query t (row) mixes the value of key s (column) under
    `variant` (head 0), through this file's reference: every variant is linear in v, so with
    one-hot values (v = the identity, one column per key) its output is its mixing matrix."""
    cfg = AttentionConfig(attn=variant, kernel="ref", **{**SHOW_SIZES, **settings})
    torch.manual_seed(seed)
    module = VARIANTS[variant](cfg).eval()
    q = torch.randn(1, cfg.n_head, T, cfg.head_dim)
    k = torch.randn(1, cfg.n_kv_head, T, cfg.head_dim)
    v = torch.eye(T).expand(1, cfg.n_kv_head, T, T)
    return module.attend(q, k, v, torch.randn(1, T, cfg.d_model), 0, 0)[0, 0]


def grid(weights):
    """Rows of characters: '#' a key the query reads (weight > 0), '.' an earlier key it does
    not read, ' ' a future key."""
    T = weights.shape[0]
    return ["".join("#" if weights[t, s] > 0 else "." if s <= t else " " for s in range(T)) for t in range(T)]


def show(variant, T=16):
    """The panels of `variant` side by side, one row per query (a variant SHOW does not list:
    one panel at SHOW_SIZES and its defaults)."""
    panels = [(label, grid(mixing_weights(variant, T, **settings)))
              for label, settings in SHOW.get(variant, [(variant, {})])]
    width = max(T, *(len(label) for label, _ in panels)) + 3
    lines = ["     " + "".join(label.ljust(width) for label, _ in panels)]
    for t in range(T):
        lines.append(f"{t:3d}  " + "".join(rows[t].ljust(width) for _, rows in panels))
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Which keys each query reads, for a 16-token example: '#' read, "
                                                 "'.' an earlier key not read (rows: queries, columns: keys).")
    parser.add_argument("--show", choices=list(VARIANTS), help="one variant (default: every one)")
    args = parser.parse_args()
    for name in [args.show] if args.show else VARIANTS:
        print(show(name), end="\n\n")
