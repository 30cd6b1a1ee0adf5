"""The attention variants, one readable class each, and the dense reference of the few core
attention operations they call.

References (the short names are used everywhere below):
  [DSA]   "Dynamic Sparse Attention with Learned Head Gating: Methods and Analysis" —
          dynamic head gating with an always-on local window (W = 256).
  [DSA-A] "Dynamic Sparse Attention for Efficient Language Modeling" — the same head gating,
          windowed only for sequences longer than 512 tokens.
  [ASGA]  "Adaptive Sparse-Geometric Attention: A Comprehensive Empirical Analysis".
  [CAA]   "Context-Adaptive Attention: A Balanced Approach for Efficient Language Modeling".
  [RoPE]  Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding".
  [Longformer] Beltagy et al. 2020, "Longformer: The Long-Document Transformer".
  [Flash] Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with
          IO-Awareness" (kernels.py's blockwise loops).
  [Qwen3] Qwen Team 2025, "Qwen3 Technical Report" (the attention block around every variant).
  [Combiner] Ren et al. 2021, "Combiner: Full Attention Transformer with Sparse Computation
          Cost" (NeurIPS 2021, arXiv 2107.05768) — the "Sparse [Combiner]" row of [CAA]'s table.
  [NSA]   Yuan et al. 2025, "Native Sparse Attention: Hardware-Aligned and Natively Trainable
          Sparse Attention" (arXiv 2502.11089).
  [MoBA]  Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs"
          (arXiv 2502.13189; code: MoonshotAI/MoBA).
  [DS32]  DeepSeek-AI 2025, "DeepSeek-V3.2: Pushing the Frontier of Open Large Language Models"
          (arXiv 2512.02556; DeepSeek-V3.2-Exp's code, inference/model.py) — DeepSeek Sparse
          Attention: a lightning indexer and top-k token selection (the `indexer` variant).
The four method papers report their runs on FineWeb with a 134M-parameter Qwen model; their
numbers are quoted in the docstrings below with the paper they come from.

Layout: q is (B, H, T, D); k and v are (B, Hkv, S, D) where S counts keys (S = T in a plain
forward pass, S = cached + T when decoding with a KV cache). Positions enter as two Python
ints: query t sits at absolute position q_start + t, key s at k_start + s, and the queries
are the last keys (q_start + T == k_start + S). Every rule is written in terms of these
absolute positions, never of sequence lengths, so a query's output depends only on its own
context: prefixes, batches and KV-cache decoding compute the same function. Python ints,
not position tensors, so nothing is read back from the device (no host sync, no graph break).

Core operations (same signatures in kernels.py, which holds their fused versions):
  attention(q, k, v, scale, q_start, k_start, window=None, window_from=0, bias=None)
  pair_gated_attention(q, k, v, q_term, k_term, w2, b2, scale, q_start, k_start, gate_space)
  topk_attention(q, k, v, scale, q_start, k_start, k_per_query, k_max)
  combiner_attention(q, k, v, kbar, vbar, scale, q_start, k_start, block)
  block_attention(q, k, v, scale, q_start, k_start, block, blocks)
  selected_attention(q, k, v, scale, q_start, k_start, keys)
A variant computes its gates, masks and biases once and calls these through
`self.ops(device)`; which set runs (this file's reference, kernels.py's blockwise CPU path,
or FlexAttention + SDPA) is decided in `ops` alone. Imports run one way: this file imports
kernels.py; kernels.py imports nothing from here. Materialising the (T, S) score matrix is
deliberate in this file: it is for reading.

A new variant is a subclass of CausalSelfAttention whose `attend` builds its gates and calls
the core operations, plus an entry in VARIANTS. A new core operation is a reference function
here, an `Ops` field, and its versions in kernels.BLOCKWISE and kernels.FLEX.
"""
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import kernels


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: x / sqrt(mean(x^2) + eps) * weight, computed in float32."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(pos, head_dim, theta):
    """cos, sin of shape (T, D) for absolute positions `pos`, in Hugging Face's layout:
    frequencies theta^(-2i/D) for i < D/2, repeated twice along the last dim (rotate-half)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=pos.device).float() / head_dim)
    freqs = pos.float()[:, None] * inv_freq[None, :]  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    return emb.cos(), emb.sin()


def apply_rope(x_BHTD, cos, sin):
    """Rotate-half [RoPE] (as in Hugging Face's Qwen3): x*cos + rotate_half(x)*sin."""
    x1, x2 = x_BHTD.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x_BHTD * cos + rotated * sin).to(x_BHTD.dtype)


# ---------------------------------------------------------------------------- core operations

expand_kv = kernels.expand_kv  # grouped-query attention: repeat each key/value head for its query heads


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


def per_head(scale):
    """scale: a Python float, or a (H,) tensor (one scale per head) shaped to (1, H, 1, 1)."""
    return scale[None, :, None, None] if torch.is_tensor(scale) else scale


def attention(q, k, v, scale, q_start, k_start, window=None, window_from=0, bias=None):
    """(B, H, T, D): softmax_j(q_t . k_j * scale + bias) v over the keys `allowed` (causal,
    windowed if `window`). scale: a float or a (H,) tensor, one per head (`per_head`). bias: None, or a function bias(b, h, t, dist) of the batch, head and
    query index and the query-minus-key distance (index tensors that broadcast), returning
    the additive logit bias; written once, it is evaluated here on (B, 1, T, S) broadcasts,
    in kernels.py on its blocks or as a FlexAttention score_mod."""
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


def pair_gate_logit(q_term, k_term, w2, b2):
    """(B, H, T, S): w2 . GELU(q_term_t + k_term_s) + b2 per head ([ASGA] eq. 1 before its
    sigmoid). q_term (B, H, T, r), k_term (B, H, S, r), w2 (H, r), b2 (H,). Builds the
    (B, H, T, S, r) pair tensor: reference only."""
    hidden = F.gelu(q_term[:, :, :, None, :] + k_term[:, :, None, :, :])  # (B, H, T, S, r)
    return (hidden * w2[None, :, None, None, :]).sum(-1) + b2[None, :, None, None]


def pair_gated_attention(q, k, v, q_term, k_term, w2, b2, scale, q_start, k_start, gate_space="logit"):
    """(B, H, T, D): causal attention whose logits alpha = q . k * scale (float or per head)
    meet a pair gate
    s = sigmoid(pair_gate_logit): gate_space 'logit' takes softmax(alpha * s) ([ASGA] eq. 3),
    'prob' takes softmax(alpha + log s), i.e. weights exp(alpha) * s renormalised."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    k, v = expand_kv(k, H), expand_kv(v, H)
    logits = (q @ k.transpose(-2, -1)) * per_head(scale)  # (B, H, T, S)
    z = pair_gate_logit(q_term, k_term, w2, b2)
    logits = logits * torch.sigmoid(z) if gate_space == "logit" else logits + F.logsigmoid(z)
    return masked_softmax_attend(logits, allowed(T, S, q_start, k_start, q.device), v)


def topk_attention(q, k, v, scale, q_start, k_start, k_per_query, k_max):
    """(B, H, T, D): query t attends, with a softmax, to its k_per_query[t] highest-scoring
    visible keys alone (never a future key, even when fewer are visible). k_max: a Python int
    >= every k_per_query (the fused paths size their buffers with it)."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    k, v = expand_kv(k, H), expand_kv(v, H)
    logits = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
    causal = allowed(T, S, q_start, k_start, q.device)
    return masked_softmax_attend(logits, topk_mask(logits.detach(), causal, k_per_query), v)


def topk_mask(logits, causal, k_per_query):
    """(B, H, T, S) bool: the k_per_query[t] highest-scoring visible keys of each query."""
    order = logits.masked_fill(~causal, float("-inf")).argsort(dim=-1, descending=True)
    rank = order.argsort(dim=-1)  # rank of each key within its query's row
    return (rank < k_per_query[:, None]) & causal  # & causal: never a future key


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


def softmax_or_zero(logits, mask):
    """float32 softmax over the allowed entries; a row with none allowed gives all zeros (and
    zero gradients), as FlexAttention returns for it, instead of NaN."""
    some = mask.any(-1, keepdim=True)
    logits = logits.float().masked_fill(~mask, float("-inf")).masked_fill(~some, 0.0)
    return torch.softmax(logits, dim=-1) * some


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
    slot = torch.where(keys < 0, S, keys)  # -1 -> a spare column, dropped
    chosen = torch.zeros(B, T, S + 1, dtype=torch.bool, device=q.device).scatter_(-1, slot, True)[..., :S]
    mask = chosen[:, None] & allowed(T, S, q_start, k_start, q.device)  # (B, 1, T, S)
    return softmax_or_zero(logits, mask).to(v.dtype) @ v


REFERENCE = kernels.Ops("reference (attention.py, dense)", attention, pair_gated_attention, topk_attention,
                        combiner_attention, block_attention, selected_attention)


def ops(kernel, device):
    """The one place that picks which implementation of the core operations runs.
    'ref': this file. 'flex': kernels.py's FlexAttention + SDPA path on any device.
    'fused': the best path for the device: FlexAttention + SDPA on CUDA; on CPU, where
    FlexAttention has no backward, kernels.py's blockwise path (faster than the reference
    at every measured length, see benchmarks/attention.py). 'blockwise': that path on any
    device (train.py's preflight falls back to it where FlexAttention fails on a GPU)."""
    if kernel == "ref":
        return REFERENCE
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
    return f"kernel={cfg.kernel}: {chosen.name}{how}, on {kind}"


def gate_summary(gate):
    """Per-head mean, std and fraction above 0.5 of a gate tensor whose last dim is heads."""
    g = gate.detach().float().reshape(-1, gate.shape[-1])
    return {"mean": g.mean(0).tolist(), "std": g.std(0, unbiased=False).tolist(),
            "frac_gt_half": (g > 0.5).float().mean(0).tolist()}



# ---------------------------------------------------------------------------- the variants

class CausalSelfAttention(nn.Module):
    """`full`: softmax(q k^T / sqrt(d)) v over every j <= i — the baseline of every paper
    (validation loss 4.9266 at 134M on FineWeb, reported by [DSA], [DSA-A] and [CAA]).

    The [Qwen3] attention block around every variant: q, k, v, o projections without bias,
    grouped-query heads (`n_kv_head`), per-head RMSNorm on q and k *before* RoPE,
    scale 1/sqrt(head_dim).
    """

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim)
        self.k_norm = RMSNorm(cfg.head_dim)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.record = False  # when True, `attend` keeps its gates in self.gates (for analysis)
        self.gates = {}

    def forward(self, x_BTC, cos, sin, start, cache=None):
        """x: the block's normalized input (B, T, C); cos/sin: (T, D) for positions start ..
        start + T - 1 (`start` a Python int). With a `KVCache`, keys/values of earlier tokens
        are read from it and these appended."""
        B, T, _ = x_BTC.shape
        q = self.q_proj(x_BTC).view(B, T, self.n_head, self.head_dim)
        k = self.k_proj(x_BTC).view(B, T, self.n_kv_head, self.head_dim)
        v = self.v_proj(x_BTC).view(B, T, self.n_kv_head, self.head_dim)
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)  # (B, H, T, D)
        k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)  # (B, Hkv, T, D)
        v = v.transpose(1, 2)  # (B, Hkv, T, D)
        k_start = start
        if self.record:
            self.gates = {}
        if cache is not None:
            k, v, k_start = cache.update(k, v, start)  # (B, Hkv, S, D), S = cached + T
        y = self.attend(q, k, v, x_BTC, start, k_start)  # (B, H, T, D)
        if cache is not None:
            cache.trim(self.oldest_key_needed(start + T))
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))

    def ops(self, device):
        return ops(self.cfg.kernel, device)

    def attend(self, q, k, v, x, q_start, k_start):
        """(B, H, T, D) from q (B, H, T, D), k, v (B, Hkv, S, D), the block input x (B, T, C)
        and the absolute positions of the first query and the first key (Python ints)."""
        return self.ops(q.device).attention(q, k, v, self.scale, q_start, k_start)

    def oldest_key_needed(self, next_pos):
        """The smallest key position that any query at position >= next_pos can see."""
        return 0

    def init_gates(self):
        """Set the variant's own parameters to their documented init (Model calls this after
        its generic init, which would otherwise overwrite them)."""

    def gate_stats(self):
        """JSON-ready summaries of the gates recorded in the last forward with record=True."""
        return {name: gate_summary(g) for name, g in self.gates.items()}


class LocalAttention(CausalSelfAttention):
    """`local`: softmax(q k^T / sqrt(d)) v over i - W <= j <= i (sliding window, as in
    [Longformer]; the "Local" row of [CAA], validation loss 5.021). W = cfg.window (256)."""

    def attend(self, q, k, v, x, q_start, k_start):
        return self.ops(q.device).attention(q, k, v, self.scale, q_start, k_start, window=self.cfg.window)

    def oldest_key_needed(self, next_pos):
        return max(0, next_pos - self.cfg.window)


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

    def attend(self, q, k, v, x, q_start, k_start):
        window, window_from = self.window()
        y = self.ops(q.device).attention(q, k, v, self.scale, q_start, k_start, window, window_from)
        if not self.cfg.dsa_gate:
            return y
        g = torch.sigmoid(self.head_gate(x))  # (B, T, H)
        if self.record:
            self.gates["head_gate"] = g.detach()
        return y * g.transpose(1, 2).unsqueeze(-1).to(y.dtype)

    def oldest_key_needed(self, next_pos):
        window, window_from = self.window()
        if window is None or next_pos < window_from:
            return 0
        return max(0, next_pos - window)


class ASGAttention(CausalSelfAttention):
    """`asga`: Adaptive Sparse-Geometric Attention ([ASGA]; validation loss 5.148).

    The paper says:
        s_ij^h     = sigmoid(w2_h . GELU(W1_h [LN(q_i^h); LN(k_j^h)] + b1_h) + b2_h)   (eq. 1)
        alpha_ij^h = softplus(gamma_h) * q_i^h . k_j^h / sqrt(d)                      (eq. 2)
        y_i^h      = softmax_{j <= i}(alpha^h ⊙ s^h) v^h                              (eq. 3)
    and ablates "fixed sparsity patterns" (5.087) and the geometric scale.

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

    # Query rows per chunk of the recorded gate statistic: a (B, H, rows, S, r) transient of
    # at most RECORD_ELEMENTS elements, whatever T (see `record_pair_gate`).
    RECORD_ELEMENTS = 1 << 20

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
        """The per-query and per-key halves of W1 [LN(q); LN(k)] + b1: (B,H,T,r), (B,H,S,r)
        (k is expanded to the query heads first: W1 is per query head)."""
        D = q.shape[-1]
        k = expand_kv(k, self.n_head)
        q_term = torch.einsum("bhtd,hdr->bhtr", F.layer_norm(q, (D,)), self.w1_q)
        k_term = torch.einsum("bhsd,hdr->bhsr", F.layer_norm(k, (D,)), self.w1_k)
        return q_term + self.b1[None, :, None, :], k_term

    def attend(self, q, k, v, x, q_start, k_start):
        cfg, op = self.cfg, self.ops(q.device)
        scale = self.scale  # alpha = softplus(gamma) q.k / sqrt(d): one scale per head
        if cfg.asga_scale:
            scale = F.softplus(self.gamma) * self.scale  # (H,)
            if self.record:
                self.gates["scale"] = F.softplus(self.gamma).detach()[None, None, :]  # (1, 1, H)
        if cfg.asga_gate == "off":
            return op.attention(q, k, v, scale, q_start, k_start)
        if cfg.asga_gate == "fixed":
            return op.attention(q, k, v, scale, q_start, k_start, window=cfg.window)
        q_term, k_term = self.pair_terms(q, k)  # (B, H, T, r), (B, H, S, r)
        if self.record:
            self.gates["pair_gate"] = self.record_pair_gate(q_term, k_term, q_start, k_start)
        return op.pair_gated_attention(q, k, v, q_term, k_term, self.w2, self.b2, scale,
                                       q_start, k_start, cfg.asga_gate_space)

    def oldest_key_needed(self, next_pos):
        return max(0, next_pos - self.cfg.window) if self.cfg.asga_gate == "fixed" else 0

    @torch.no_grad()
    def record_pair_gate(self, q_term, k_term, q_start, k_start):
        """(B, T, H): each query's mean gate s over its visible keys, computed a chunk of
        query rows at a time. Memory bound: besides the (B, H, T, r) and (B, H, S, r) terms the
        forward builds anyway, two (B, H, rows, S, r) transients at a time (the hidden units
        and their w2-weighted copy) of at most max(RECORD_ELEMENTS, B*H*S*r) elements each:
        4 MB each in float32 when RECORD_ELEMENTS binds; at T = 2048, B = 16 with the
        qwen-134m shapes and r = 16 (one query row per chunk), 25 MB each. Not the
        (B, H, T, S, r) pair tensor (at T = 2048 with the qwen-134m shapes and r = 16:
        12 * 2048^2 * 16 * 4 bytes = 3.2 GB per sequence)."""
        B, H, T, r = q_term.shape
        S = k_term.shape[2]
        rows = max(1, self.RECORD_ELEMENTS // (B * H * S * r))
        out = []
        for t0 in range(0, T, rows):
            t1 = min(T, t0 + rows)
            s = torch.sigmoid(pair_gate_logit(q_term[:, :, t0:t1].float(), k_term.float(),
                                              self.w2.float(), self.b2.float()))  # (B, H, rows, S)
            mask = allowed(t1 - t0, S, q_start + t0, k_start, s.device)
            out.append((s * mask).sum(-1) / mask.sum(-1))
        return torch.cat(out, 2).transpose(1, 2)  # (B, T, H)


class ContextAdaptiveAttention(CausalSelfAttention):
    """`caa`: Context-Adaptive Attention ([CAA]; validation loss 4.712, 2.1x memory).

        y_i^h = g_h(x_i) Attn_L(i) + (1 - g_h(x_i)) Attn_G(i)                  ([CAA] eq. 1)

    The paper says: local windows of "256-512 tokens (input-dependent)"; global attention
    "top-k sparse with k = O(sqrt(n))"; the gate is a "2-layer MLP with sigmoid output";
    and "gate gradients require careful normalization".

    This project's choices (the paper gives no formula for any of them):
    - the width: w_i = W + W' sigmoid(u . x_i) in [W, W + W'] (W = window = 256,
      W + W' = caa_window_max = 512), made differentiable by a soft boundary: the local
      logits get log sigmoid((w_i - (i - j)) / caa_tau), tau = 8 tokens, and keys more than
      caa_window_max back are masked, so the branch stays local;
    - top-k: k_i = ceil(sqrt(i + 1)) per query position (k = O(sqrt(n)) applied to each
      query's own context), chosen among all keys j <= i, local ones included;
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
    0, so every width starts at the middle, W + W'/2 = 384.
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

    def attend(self, q, k, v, x, q_start, k_start):
        cfg, op = self.cfg, self.ops(q.device)
        T = q.shape[2]
        # A forced gate (g = 1 or 0) skips the branch it multiplies by zero.
        local = glob = None
        if cfg.caa_gate != "global":
            # (B, T) in float32 at least (autocast's Linear gives bf16): in bf16 a width in [256,
            # 512] moves in steps of 2 tokens, and FlexAttention sums the gradient of the
            # tensor its score_mod captures (width_BHT) in that tensor's dtype
            width = cfg.window + (cfg.caa_window_max - cfg.window) * torch.sigmoid(at_least_float32(self.width(x)[..., 0]))
            if self.record:
                self.gates["window"] = width.detach()[..., None]

            # one copy per head: read by (b, h, t), a FlexAttention gradient element takes the
            # atomic adds of one query's keys, not of every head's (kernels.py, "captured")
            width_BHT = width[:, None, :].expand(-1, q.shape[1], -1).contiguous()

            def boundary(b, h, t, dist):  # log sigmoid((w_i - (i - j)) / tau), the soft window edge
                # (kernels.log_sigmoid: F.logsigmoid fails inside a FlexAttention score_mod on CUDA)
                return kernels.log_sigmoid((width_BHT[b, h, t] - dist) / cfg.caa_tau)

            local = op.attention(q, k, v, self.scale, q_start, k_start, window=cfg.caa_window_max, bias=boundary)
        if cfg.caa_gate != "local":
            if cfg.caa_topk == "all":
                glob = op.attention(q, k, v, self.scale, q_start, k_start)
            else:
                glob = op.topk_attention(q, k, v, self.scale, q_start, k_start, *self.k_per_query(q_start, T, q.device))
        if cfg.caa_gate != "learned":
            if self.record:
                self.gates["mix_gate"] = torch.full((q.shape[0], T, self.n_head), float(cfg.caa_gate == "local"),
                                                    device=q.device)
            return glob if local is None else local
        g = torch.sigmoid(at_least_float32(self.mix_gate(x)))  # (B, T, H)
        if self.record:
            self.gates["mix_gate"] = g.detach()
        g = g.transpose(1, 2).unsqueeze(-1)  # (B, H, T, 1)
        # g L + (1 - g) G written as G + g (L - G), in float32 at least: the gate's gradient is
        # sum_d dy (L - G), and where the branches nearly agree, bf16's rounding of the two sums
        # sum_d dy L and sum_d dy G before they cancel (under autocast) swamped it. What stays
        # cannot be helped here: L and G come out of FlexAttention rounded to bf16 (q's dtype),
        # and with top-k 'sqrt' bf16's rounding of q and k changes some of G's chosen keys.
        dtype, local, glob = local.dtype, at_least_float32(local), at_least_float32(glob)
        return (glob + g * (local - glob)).to(dtype)


# ---------------------------------------------------------------------------- combiner

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

    The summaries are computed here, once per call (`summaries`, O(T D) memory), and handed
    to the core op `combiner_attention` with the keys and values.

    This project's choice: with a KV cache, `cache.state` holds kbar, vbar of every completed
    block and the running max of the queries of the last token's block, and the cache keeps
    that block's keys only, so decoding is exact with O(s + T/s) keys per layer.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        self.cache = None  # the KVCache of the forward pass running now, if any (see forward)

    def forward(self, x_BTC, cos, sin, start, cache=None):
        # `attend` has no cache argument (every variant shares its signature), yet a summary
        # value needs the max over *all* its block's queries, which earlier decoding steps saw:
        # so the cache is lent to `summaries` for the duration of this call.
        if cache is None:
            return super().forward(x_BTC, cos, sin, start)
        self.cache = cache
        try:
            return super().forward(x_BTC, cos, sin, start, cache)
        finally:
            self.cache = None

    def summaries(self, q, k, v, q_start, k_start):
        """kbar (B, Hkv, R, D), vbar (B, H, R, D) of blocks 0 .. R-1, R = block of the last
        query: those cached (KVCache.state) and those completed since, from the keys in k.
        Queries sit at positions q_start.., keys at k_start.., both runs ending together."""
        s, T = self.cfg.window, q.shape[2]
        state = {} if self.cache is None else self.cache.state
        n = state["kbar"].shape[2] if state else 0  # blocks already summarised
        R = (q_start + T - 1) // s
        if k_start > n * s or (not state and q_start > n * s):
            raise ValueError(f"combiner needs every earlier block (queries from {q_start}, keys "
                             f"from {k_start}, block {s}): run from position 0, or decode with the "
                             "KVCache that holds the summaries of the earlier blocks")
        # qbar of blocks n .. R; the queries of block n before q_start came in earlier steps.
        qbar = to_blocks(q, q_start - n * s, s, float("-inf")).amax(dim=3)  # (B, H, R + 1 - n, D)
        if "qmax" in state:
            qbar = torch.cat([torch.maximum(qbar[:, :, :1], state["qmax"]), qbar[:, :, 1:]], 2)
        keys = slice(n * s - k_start, R * s - k_start)  # blocks n .. R-1, complete
        kbar, vbar = combiner_summaries(qbar[:, :, :R - n], to_blocks(k[:, :, keys], 0, s, 0.0),
                                        to_blocks(v[:, :, keys], 0, s, 0.0), self.scale)
        if state:
            kbar, vbar = torch.cat([state["kbar"], kbar], 2), torch.cat([state["vbar"], vbar], 2)
        if self.cache is not None:
            self.cache.state.update(kbar=kbar, vbar=vbar, qmax=qbar[:, :, -1:])
        return kbar, vbar

    def attend(self, q, k, v, x, q_start, k_start):
        kbar, vbar = self.summaries(q, k, v, q_start, k_start)
        return self.ops(q.device).combiner_attention(q, k, v, kbar, vbar, self.scale, q_start, k_start,
                                                     self.cfg.window)

    def oldest_key_needed(self, next_pos):
        # Keep the block of the last token: once complete, the next step summarises it.
        return (next_pos - 1) // self.cfg.window * self.cfg.window


# ---------------------------------------------------------------------------- block selection (nsa, moba)

def top_blocks(scores, valid, forced, n):
    """(.., T, n) long: each query's n valid blocks of highest score, forced ones first, -1 in
    the slots left when fewer than n are valid. scores (.., T, J) float, valid and forced
    (T, J) bool. No gradient: the choice of blocks is discrete ([NSA] §6.1, [MoBA] §2.2)."""
    scores = scores.detach().float()
    scores = scores.masked_fill(forced, float("inf")).masked_fill(~valid, float("-inf"))
    if scores.shape[-1] < n:  # fewer blocks than slots: the spare slots stay empty
        scores = F.pad(scores, (0, n - scores.shape[-1]), value=float("-inf"))
    top, idx = scores.topk(n, dim=-1)
    return idx.masked_fill(top == float("-inf"), -1)


def compressed_attention(q, k_cmp, v_cmp, scale, q_start, length, stride):
    """[NSA]'s compressed branch, dense (C compressed keys, C ~ T / stride): compressed key i
    summarises positions i*stride .. i*stride + length - 1 and is visible to query t once its
    last position is <= t ([NSA] eq. 7; [xl], [fla] likewise). Returns the output (B, H, T, D)
    and the probabilities p (B, H, T, C) in float32, which are also the importance scores of
    eq. 8 (no separate scorer). A query that sees no compressed key gets 0 ([fla-nsa], [xl])."""
    B, H, T, _ = q.shape
    C = k_cmp.shape[2]
    logits = (q @ expand_kv(k_cmp, H).transpose(-2, -1)) * scale  # (B, H, T, C)
    q_pos = torch.arange(q_start, q_start + T, device=q.device)[:, None]
    visible = torch.arange(C, device=q.device) * stride + length - 1 <= q_pos  # (T, C)
    p = softmax_or_zero(logits, visible)
    return p.to(v_cmp.dtype) @ expand_kv(v_cmp, H), p


def block_overlap(C, J, length, stride, block, device):
    """(C, J): positions compressed block i shares with selection block j, over the stride:
    [NSA] eq. 9 in its overlap reading ([xl]'s transform_score), the identity when
    length = stride = block. The readable definition: `block_scores` computes p @ it in O(C)."""
    start = torch.arange(C, device=device)[:, None] * stride
    first = torch.arange(J, device=device) * block
    shared = (torch.minimum(start + length, first + block) - torch.maximum(start, first)).clamp(min=0)
    return shared.float() / stride


def block_scores(p_cmp, J, length, stride, block):
    """(.., J) float: p_cmp (.., C) @ block_overlap(C, J, ...) without the (C, J) matrix
    (eq. 9, the overlap reading), in O(C) per query instead of O(C J): at T = 8192 the
    matmul was 4x the FLOPs of the compressed branch's own q k^T (J = T / block columns).
    Compressed block i covers the stride-segments i .. i + length/stride - 1, each holding
    stride positions worth p_i / stride each, so a segment's mass is the sum of the p_i that
    cover it (a sliding sum of length/stride terms), and a selection block's score the sum of
    its block/stride segments. Needs stride | length and stride | block (`check_nsa`)."""
    covers, per_block = length // stride, block // stride
    C = p_cmp.shape[-1]
    segments = sum(F.pad(p_cmp, (shift, covers - 1 - shift)) for shift in range(covers))  # (.., C + covers - 1)
    n = J * per_block  # segments inside blocks 0 .. J - 1: drop the rest, pad with empty ones
    segments = segments[..., :n] if C + covers - 1 >= n else F.pad(segments, (0, n - (C + covers - 1)))
    return segments.unflatten(-1, (J, per_block)).sum(-1)


class NativeSparseAttention(CausalSelfAttention):
    """`nsa`: Native Sparse Attention ([NSA]; DeepSeek's 27B-MoE runs, not at our scale).

        o_t = sum_{c in cmp, slc, win} g_t^c Attn(q_t, K_t^c, V_t^c)          ([NSA] eq. 5)
        cmp: K^cmp_i = phi(k over positions i*d .. i*d + l - 1), visible when i*d + l - 1 <= t
        slc: p^cmp = softmax(q_t K^cmp) (eq. 8) -> block scores p^slc (eq. 9) -> the top-n
             blocks of l' positions (eqs. 11-12); raw keys s <= t of those blocks
        win: the keys t - W <= s <= t (W + 1 keys: `local`'s rule)
        g_t = sigmoid(W_g x_t + b_g) in R^{3 H}: one gate per branch, head and token (§3.2)
    Three softmaxes over three key sets, mixed after normalisation (so no single mask).

    The paper says, and what this project chose instead:
    - phi is a learnable MLP with intra-block position encoding (§3.3.1). Here phi is a mean
      over the block by default ([fla]'s choice; no parameters, [NSA]'s MLP over l x D inputs
      costs (l D)^2 weights per layer for K and V); nsa_compress='mlp' is [lr]'s form,
      mean(block) + Linear(lD->lD) ReLU Linear(lD->D) over the block plus a learned position
      embedding, its last layer zero-initialised so it starts as the mean. Post-RoPE k pooled.
    - Eq. 9 as printed indexes backwards; its overlap reading ([xl]) is used: p^slc_j =
      sum_i p^cmp_i |block i ∩ block j| / d (`block_overlap`). Needs d | l, d | l'.
    - n counts 3 forced blocks (§4.1: "including fixed activating the 1 initial block and 2
      local blocks"): block 0, the query's own and the one before ([xl], [fla]).
    - Eq. 10's sum over a KV group's query heads: one selection per key head.
    - The paper gives each branch independent keys and values; every reference code shares
      one projection (nsa_kv='shared', the default). nsa_kv='independent' adds the cmp and
      win branches' own k, v projections (k_norm and RoPE shared with the main keys).
    - nsa_branches switches branches off ([NSA] ablates them): e.g. 'slc,win'. The scores
      still come from the compressed keys when the cmp branch is off.
    Sizes (`l`, `d`, `l'`, n, W) = nsa_cmp_block, nsa_cmp_stride, nsa_block, nsa_topk,
    nsa_window; paper: 32, 16, 64, 16, 512 at 8k tokens; defaults here for T = 1024: 16, 8,
    32, 8, 128 (~512 keys per query at t = 1023); the cpu preset at T = 256: 8, 4, 16, 5, 32.
    Init (ours): W_g = 0, b_g = 0, every gate 0.5 (the sigmoid's steepest point, like dsa's).
    The KV cache keeps every key (a later query may select any block).
    """

    BRANCHES = ("cmp", "slc", "win")
    SCORES = 1 << 22  # elements of one chunk's (B, H, chunk, C) compressed-branch scores

    def __init__(self, cfg):
        super().__init__(cfg)
        H, Hkv, D, l = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.nsa_cmp_block
        self.branches = cfg.nsa_branches.split(",")
        self.branch_gate = nn.Linear(cfg.d_model, 3 * H)
        if cfg.nsa_compress == "mlp":
            self.compress_mlp = nn.ModuleDict({
                name: nn.Sequential(nn.Linear(l * D, l * D), nn.ReLU(), nn.Linear(l * D, D)) for name in "kv"})
            self.compress_pos = nn.Parameter(torch.empty(2, l, D))  # intra-block position, for k and v
        if cfg.nsa_kv == "independent":
            self.branch_kv = nn.Linear(cfg.d_model, 4 * Hkv * D, bias=False)  # k, v of cmp and of win
        self.branch_keys = None  # the independent keys of the forward running now (see forward)
        self.selection = None  # the last recorded selection (B, H, T, n), for analyze.py
        self.init_gates()

    def init_gates(self):
        nn.init.zeros_(self.branch_gate.weight)
        nn.init.zeros_(self.branch_gate.bias)
        if self.cfg.nsa_compress == "mlp":
            nn.init.normal_(self.compress_pos, std=0.02)
            for mlp in self.compress_mlp.values():
                nn.init.zeros_(mlp[2].weight)
                nn.init.zeros_(mlp[2].bias)

    def forward(self, x_BTC, cos, sin, start, cache=None):
        if self.cfg.nsa_kv != "independent":
            return super().forward(x_BTC, cos, sin, start, cache)
        B, T, _ = x_BTC.shape
        kv = self.branch_kv(x_BTC).view(B, T, 4, self.n_kv_head, self.head_dim)
        k_cmp, v_cmp, k_win, v_win = kv.unbind(2)  # (B, T, Hkv, D) each
        k_cmp, k_win = (apply_rope(self.k_norm(t).transpose(1, 2), cos, sin) for t in (k_cmp, k_win))
        extra = [k_cmp, v_cmp.transpose(1, 2), k_win, v_win.transpose(1, 2)]  # (B, Hkv, T, D) each
        if cache is not None:  # appended like the main keys, which the cache never trims here
            if "branch_kv" in cache.state:
                extra = [torch.cat([a, b], 2) for a, b in zip(cache.state["branch_kv"], extra)]
            cache.state["branch_kv"] = extra
        self.branch_keys = dict(cmp=extra[:2], win=extra[2:])
        try:
            return super().forward(x_BTC, cos, sin, start, cache)
        finally:
            self.branch_keys = None

    def compress(self, x_BhSD, which):
        """(B, Hkv, C, D): phi over the windows [i d, i d + l - 1] inside the S keys."""
        cfg = self.cfg
        l, d = cfg.nsa_cmp_block, cfg.nsa_cmp_stride
        B, Hkv, S, D = x_BhSD.shape
        if S < l:
            return x_BhSD.new_zeros(B, Hkv, 0, D)
        windows = x_BhSD.unfold(2, l, d).transpose(-1, -2)  # (B, Hkv, C, l, D)
        pooled = windows.mean(3)
        if cfg.nsa_compress == "mlp":
            flat = (windows + self.compress_pos["kv".index(which)]).flatten(-2)  # (B, Hkv, C, l * D)
            pooled = pooled + self.compress_mlp[which](flat).to(pooled.dtype)
        return pooled

    def compressed_branch(self, q, k_cmp, v_cmp, q_start, S):
        """The compressed branch's output (B, H, T, D) and the blocks each query selects by its
        probabilities (B, H, T, n), a chunk of queries at a time (`SCORES` elements), each
        chunk's attention recomputed in the backward (checkpointed, or kernels.py's
        `CompressedAttention` on the CPU fused path): C ~ T / stride compressed
        keys per query would otherwise keep (T, C) per head, memory quadratic in T. A chunk
        takes only the compressed keys its last query can see (causal: the rest would be
        masked), which halves the branch's work over a sequence."""
        cfg = self.cfg
        l, d = cfg.nsa_cmp_block, cfg.nsa_cmp_stride
        k_cmp, v_cmp = self.compress(k_cmp, "k"), self.compress(v_cmp, "v")  # (B, Hkv, C, D)
        B, H, T, _ = q.shape
        C = k_cmp.shape[2]
        rows = max(1, self.SCORES // (B * H * max(1, C)))

        # kernel='fused' on CPU: kernels.py's version, which recomputes its probabilities in its
        # own backward (no checkpoint needed) and masks in place
        fused = self.ops(q.device) is kernels.BLOCKWISE
        attend = kernels.blockwise_compressed_attention if fused else compressed_attention

        def chunk(q_chunk, k_seen, v_seen, start):
            return attend(q_chunk, k_seen, v_seen, self.scale, start, l, d)
        run = chunk
        if rows < T and torch.is_grad_enabled() and not fused:
            run = functools.partial(torch.utils.checkpoint.checkpoint, chunk, use_reentrant=False)
        outs, blocks = [], []
        for t0 in range(0, T, rows):
            last = q_start + min(T, t0 + rows) - 1  # the chunk's last query position
            seen = min(C, max(0, (last - l + 1) // d + 1))  # compressed keys i with i d + l - 1 <= last
            o_cmp, p_cmp = run(q[:, :, t0:t0 + rows], k_cmp[:, :, :seen], v_cmp[:, :, :seen], q_start + t0)
            outs.append(o_cmp)
            blocks.append(self.select(p_cmp, q_start + t0, o_cmp.shape[2], S))
        return torch.cat(outs, 2), torch.cat(blocks, 2)

    def select(self, p_cmp, q_start, T, S):
        """(B, H, T, n) the blocks of nsa_block positions each query reads ([NSA] eqs. 8-12)."""
        cfg = self.cfg
        B, H = p_cmp.shape[:2]
        block = cfg.nsa_block
        J = ceil_div_int(q_start + T, block)  # blocks up to the last query's own
        scores = block_scores(p_cmp.detach(), J, cfg.nsa_cmp_block, cfg.nsa_cmp_stride, block)  # p_cmp @ block_overlap
        Hkv = self.n_kv_head
        scores = scores.view(B, Hkv, H // Hkv, T, J).sum(2)  # eq. 10: one choice per key head
        own = torch.arange(q_start, q_start + T, device=p_cmp.device)[:, None] // block  # (T, 1)
        j = torch.arange(J, device=p_cmp.device)
        valid = j <= own  # j * block <= t
        forced = valid & ((j == 0) | (j == own) | (j == own - 1))
        return expand_kv(top_blocks(scores, valid, forced, cfg.nsa_topk), H)

    def attend(self, q, k, v, x, q_start, k_start):
        cfg, op = self.cfg, self.ops(q.device)
        if k_start != 0:
            raise ValueError(f"nsa needs every key from position 0 (k_start={k_start}): its KV cache is never trimmed")
        B, H, T, _ = q.shape
        k_cmp, v_cmp = self.branch_keys["cmp"] if self.branch_keys else (k, v)
        k_win, v_win = self.branch_keys["win"] if self.branch_keys else (k, v)
        o_cmp, blocks = self.compressed_branch(q, k_cmp, v_cmp, q_start, k.shape[2])  # (B, H, T, D), (B, H, T, n)
        out = {"cmp": o_cmp}
        if "slc" in self.branches:
            out["slc"] = op.block_attention(q, k, v, self.scale, q_start, k_start, cfg.nsa_block, blocks)
        if "win" in self.branches:
            out["win"] = op.attention(q, k_win, v_win, self.scale, q_start, k_start, window=cfg.nsa_window)
        g = torch.sigmoid(self.branch_gate(x)).view(B, T, 3, H)  # (B, T, branch, H)
        if self.record:
            for i, name in enumerate(self.BRANCHES):
                self.gates[f"gate_{name}"] = g[:, :, i].detach()
            self.selection = blocks.detach()
            self.gates["selected_distance"] = block_distance(blocks, q_start, cfg.nsa_block)
        g = g.permute(0, 2, 3, 1).unsqueeze(-1)  # (B, branch, H, T, 1)
        return sum(g[:, self.BRANCHES.index(name)].to(out[name].dtype) * out[name] for name in self.branches)

    def oldest_key_needed(self, next_pos):
        return 0


def ceil_div_int(a, b):
    return -(-a // b)


def block_distance(blocks, q_start, block):
    """(B, T, H) float: the mean, over a query's selected blocks, of how many blocks back
    from its own each lies (0 = its own block), for the recorded statistics."""
    T = blocks.shape[2]
    own = torch.arange(q_start, q_start + T, device=blocks.device)[:, None] // block  # (T, 1)
    ok = blocks >= 0
    back = ((own - blocks) * ok).sum(-1) / ok.sum(-1).clamp(min=1)  # (B, H, T)
    return back.float().transpose(1, 2)


class MixtureOfBlockAttention(CausalSelfAttention):
    """`moba`: Mixture of Block Attention ([MoBA]; Kimi's long-context runs).

        K_bar_j = mean of k over block j (positions j B .. j B + B - 1)
        s_j = q_t . K_bar_j,  g_j = 1 iff s_j is among the top k          ([MoBA] eqs. 5-6)
        o_t = softmax over the keys s <= t of the gated blocks of q_t . k_s / sqrt(d), times v
    One softmax over the union of the selected blocks (eqs. 2-4), no parameters.

    The paper says, and this project follows ([MoBA] §2.2 and MoonshotAI's moba_naive):
    routing per query token and per head (GQA: per query head); only blocks wholly in the
    past (j < floor(t / B)) compete; the query's own block is always selected, causal inside,
    and k counts it ("top-k = 3: at most 2 history blocks and the current block"); the
    gate uses post-RoPE q, k in float32 and passes no gradient. moba_topk = 1 means the own
    block alone (the naive code's meaning; MoonshotAI's efficient code would fall back to
    full attention there). moba_full_last = m makes the last m layers full attention (the
    paper's layer-wise hybrid, §3.2: 3 of 32 layers for Llama-8B-1M).
    Sizes: the paper uses B = 512, k = 3 at 8K tokens (Table 1). Here B = moba_block = 64,
    k = moba_topk = 4 at T = 1024 (at most 256 keys, `local`'s budget at W = 256); the cpu
    preset at T = 256: B = 16, k = 4 (at most 64 keys). The KV cache keeps every key.
    """

    def select(self, q, k, q_start, k_start):
        """(B, H, T, k) the blocks each query reads."""
        cfg = self.cfg
        B, H, T, D = q.shape
        block = cfg.moba_block
        J = ceil_div_int(q_start + T, block)  # blocks up to the last query's own
        full = k.shape[2] // block  # complete blocks among the keys (k_start = 0)
        means = k[:, :, :full * block].float().view(B, k.shape[1], full, block, D).mean(3)  # (B, Hkv, full, D)
        scores = q.detach().float() @ expand_kv(means.detach(), H).transpose(-2, -1)  # (B, H, T, full)
        scores = F.pad(scores, (0, J - full))  # the incomplete block, which only its own queries see
        own = torch.arange(q_start, q_start + T, device=q.device)[:, None] // block  # (T, 1)
        j = torch.arange(J, device=q.device)
        return top_blocks(scores, j <= own, j == own, cfg.moba_topk)

    def attend(self, q, k, v, x, q_start, k_start):
        if k_start != 0:
            raise ValueError(f"moba needs every key from position 0 (k_start={k_start}): its KV cache is never trimmed")
        blocks = self.select(q, k, q_start, k_start)
        if self.record:
            self.selection = blocks.detach()
            self.gates["selected_distance"] = block_distance(blocks, q_start, self.cfg.moba_block)
        return self.ops(q.device).block_attention(q, k, v, self.scale, q_start, k_start, self.cfg.moba_block, blocks)

    def oldest_key_needed(self, next_pos):
        return 0

# ---------------------------------------------------------------------------- DeepSeek Sparse Attention (indexer)

def lightning_scores(q_BTJD, k_BSD, w_BTJ, q_start, k_start):
    """(B, T, S) float32, [DS32] eq. 1: I[t, s] = sum_j w[t, j] ReLU(q[t, j] . k[s] / sqrt(d)),
    -inf where key s is not visible to query t. q (B, T, J, d) the indexer's queries, k (B, S, d)
    its keys (one per token, shared by the J heads), w (B, T, J) its head weights. Builds a
    (B, T, J, S) tensor: callers pass a chunk of queries at a time."""
    B, T, J, d = q_BTJD.shape
    S = k_BSD.shape[1]
    dots = torch.einsum("btjd,bsd->btjs", q_BTJD.float(), k_BSD.float()) / math.sqrt(d)  # (B, T, J, S)
    scores = (F.relu(dots) * w_BTJ.float()[..., None]).sum(2)  # (B, T, S)
    return scores.masked_fill(~allowed(T, S, q_start, k_start, scores.device), float("-inf"))


def top_keys(scores, n):
    """(B, T, n) long: each query's n keys of highest score, ties broken toward the most recent
    key, -1 in the slots beyond its visible keys (-inf scores). scores (B, T, S). No gradient.
    ReLU makes exact zeros common, so ties are frequent: an indexer whose scores are all 0
    picks the n most recent keys, a window."""
    S = scores.shape[-1]
    recent_first = scores.detach().flip(-1)  # key S - 1 - c at column c
    if S < n:  # fewer keys than slots: the spare slots stay empty
        recent_first = F.pad(recent_first, (0, n - S), value=float("-inf"))
    # a stable sort keeps equal scores in column order, i.e. the most recent key first
    top, order = recent_first.sort(dim=-1, descending=True, stable=True)
    keys = S - 1 - order[..., :n]
    return keys.masked_fill(top[..., :n] == float("-inf"), -1)


class LightningIndexer(nn.Module):
    """[DS32]'s lightning indexer, in our model's terms (no MLA, no query latent: it reads the
    block's normalised input x, as the main q, k, v do):
        q^I_t = W_q x_t, split into J heads of d      k^I_t = LayerNorm(W_k x_t)  (one key per token)
        RoPE on the first d/2 dims of both (the model's rotate-half RoPE at d/2; [DS32] ropes
        its first rope_head_dim = d/2 too)     w_t = W_w x_t * J^{-1/2}  (may be negative)
    Sizes J = index_heads, d = index_head_dim. Init: the model's N(0, 0.02) for the three
    projections, LayerNorm gain 1 and bias 0."""

    def __init__(self, cfg):
        super().__init__()
        J, d = cfg.index_heads, cfg.index_head_dim
        self.n_head, self.head_dim, self.theta = J, d, cfg.rope_theta
        self.q_proj = nn.Linear(cfg.d_model, J * d, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, d, bias=False)
        self.k_norm = nn.LayerNorm(d)
        self.weights_proj = nn.Linear(cfg.d_model, J, bias=False)

    def rope(self, x, start):
        """RoPE on the first half of the last dim of x (B, T, .., d), positions start .."""
        T, half = x.shape[1], self.head_dim // 2
        cos, sin = rope_cos_sin(torch.arange(start, start + T, device=x.device), half, self.theta)
        shape = (T,) + (1,) * (x.dim() - 3) + (half,)  # broadcast over the heads, if any
        rotated = apply_rope(x[..., :half], cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype))
        return torch.cat([rotated, x[..., half:]], dim=-1)

    def forward(self, x_BTC, start):
        """-> queries (B, T, J, d), keys (B, T, d), head weights (B, T, J) of positions start .."""
        B, T, _ = x_BTC.shape
        q = self.rope(self.q_proj(x_BTC).view(B, T, self.n_head, self.head_dim), start)
        k = self.rope(self.k_norm(self.k_proj(x_BTC)), start)
        w = self.weights_proj(x_BTC) * self.n_head ** -0.5
        return q, k, w


class IndexerAttention(CausalSelfAttention):
    """`indexer`: DeepSeek Sparse Attention ([DS32]; DeepSeek-V3.2, at 671B, not our scale).

        I[t, s] = sum_j w[t, j] ReLU(q^I[t, j] . k^I[s] / sqrt(d^I))         ([DS32] eq. 1)
        S_t = the min(k, t + 1) visible keys of highest I[t, :]
        u_t = softmax over s in S_t of q_t . k_s / sqrt(d), times v          ([DS32] eq. 2)
    One selection per query, shared by every head ([DS32]'s code adds one -inf mask to all
    heads). Ties go to the most recent key (`top_keys`). The main attention is `full`'s, over
    S_t; the selection passes no gradient.

    Training ([DS32] §2.1, eqs. 3-4): the indexer learns only from
        L^I = mean_t KL(p_t || softmax(I[t, :]))  over the visible keys (dense warm-up)
                                                   or over S_t only (sparse stage),
    p_t = the main attention's probabilities over that set, summed over heads and
    L1-normalised, without gradient; the indexer's input x is detached, so the main model
    learns from the language-model loss alone and the indexer from L^I alone. After a forward
    in training mode, L^I is `self.indexer_loss` (a scalar; train.py adds it to the loss).
    `dense_warmup = True` attends over every visible key (the paper's dense warm-up); a module
    as built attends sparsely (dense_warmup = False); train.py switches it for its first
    --indexer_warmup steps. The mean over tokens (the paper writes a sum) makes L^I
    independent of batch and length.

    What this project chose apart from the paper: no MLA and no query latent (the indexer
    reads x); no FP8 and no Hadamard rotation (numerics for speed). Sizes: index_heads = 4 of
    index_head_dim = 64 (the paper: 64 of 128; 4 x 64 against our 12 x 64 heads keeps the
    paper's indexer-to-attention cost per score); k = index_topk, 0 meaning the window, so
    `indexer` and `local` see as many keys per query (the paper: 2048 at up to 128K).
    The scores are dense O(T^2) by design (the paper's are), computed a chunk of queries at a
    time (`SCORES` elements), so no (T, S) tensor per head is kept. The KV cache keeps every
    key and every indexer key (a later query may select any).
    """

    SCORES = 1 << 22  # elements of one chunk's (B, chunk, heads, S) scores

    def __init__(self, cfg):
        super().__init__(cfg)
        self.indexer = LightningIndexer(cfg)
        self.dense_warmup = False
        self.indexer_loss = None  # L^I of the last training-mode forward
        self.kept_mass = None  # share of the dense attention's mass on the selected keys (recorded)
        self.cache = None  # the KV cache of the forward running now (for the indexer keys)
        self.selection = None  # the last recorded selection (B, T, n), for analyze.py

    @property
    def topk(self):
        return self.cfg.index_topk or self.cfg.window

    def __getstate__(self):
        # a copy (copy.deepcopy, pickling) drops the last forward's loss, which holds its graph
        return dict(self.__dict__, indexer_loss=None, selection=None)

    def forward(self, x_BTC, cos, sin, start, cache=None):
        self.cache = cache
        try:
            return super().forward(x_BTC, cos, sin, start, cache)
        finally:
            self.cache = None

    def index_inputs(self, x, q_start, k_start, S):
        """The indexer's queries, weights (for the T queries in x) and keys (for the S keys),
        from the detached x; with a KV cache the earlier keys come from it."""
        q_idx, k_idx, w = self.indexer(x.detach(), q_start)
        if self.cache is not None:
            if "index_keys" in self.cache.state:
                k_idx = torch.cat([self.cache.state["index_keys"], k_idx], dim=1)  # (B, S, d)
            self.cache.state["index_keys"] = k_idx
        if k_idx.shape[1] != S:
            raise ValueError(f"indexer: {k_idx.shape[1]} indexer keys for {S} keys; decode through the model's "
                             f"KV cache, which keeps them")
        return q_idx, k_idx, w

    def index_scores(self, x, q_start, k_start):
        """(B, T, S) float32 scores I of the queries q_start .. among the keys k_start ..;
        x (B, S, C): the block's normalised inputs at the key positions k_start .., the
        queries being its last T = k_start + S - q_start. -inf where a key is not visible."""
        S = x.shape[1]
        q_idx, k_idx, w = self.indexer(x.detach(), k_start)
        T = k_start + S - q_start
        return torch.cat([lightning_scores(q_idx[:, S - T + t0:S - T + t1], k_idx, w[:, S - T + t0:S - T + t1],
                                           q_start + t0, k_start)
                          for t0, t1 in self.chunks(x.shape[0], T, S)], dim=1)

    def chunks(self, B, T, S):
        rows = max(1, self.SCORES // (B * max(self.n_head, self.cfg.index_heads) * S))
        return [(t0, min(T, t0 + rows)) for t0 in range(0, T, rows)]

    @torch.no_grad()
    def select(self, q_idx, k_idx, w, q_start, k_start):
        """(B, T, n) long: each query's top-n keys by the indexer (`top_keys`), n = min(k, S)."""
        n = min(self.topk, k_idx.shape[1])
        return torch.cat([top_keys(lightning_scores(q_idx[:, t0:t1], k_idx, w[:, t0:t1], q_start + t0, k_start), n)
                          for t0, t1 in self.chunks(q_idx.shape[0], q_idx.shape[1], k_idx.shape[1])], dim=1)

    def attend(self, q, k, v, x, q_start, k_start):
        op = self.ops(q.device)
        q_idx, k_idx, w = self.index_inputs(x, q_start, k_start, k.shape[2])
        keys = None
        if self.dense_warmup:
            y = op.attention(q, k, v, self.scale, q_start, k_start)
        else:
            keys = self.select(q_idx, k_idx, w, q_start, k_start)  # (B, T, n)
            y = op.selected_attention(q, k, v, self.scale, q_start, k_start, keys)
        self.indexer_loss = self.kl_loss(q, k, q_idx, k_idx, w, q_start, k_start, keys) if self.training else None
        if self.record:
            self.selection = keys
            self.record_selection(q, k, q_idx, k_idx, w, q_start, k_start, keys)
        return y

    def kl_loss(self, q, k, q_idx, k_idx, w, q_start, k_start, keys):
        """L^I, the mean over queries of KL(p_t || softmax(I[t, :])) over the visible keys
        (keys None: the dense warm-up) or over the listed keys (B, T, n) (the sparse stage).
        p from q, k without gradient; I with gradient into the indexer alone. A chunk of queries
        at a time, each chunk checkpointed, so no (T, S) tensor per head is kept."""
        B, T = q_idx.shape[:2]
        run = self.kl_chunk
        if torch.is_grad_enabled():
            run = functools.partial(torch.utils.checkpoint.checkpoint, self.kl_chunk, use_reentrant=False)
        total = 0.0
        for t0, t1 in self.chunks(B, T, k.shape[2]):
            total = total + run(q[:, :, t0:t1], k, q_idx[:, t0:t1], k_idx, w[:, t0:t1], q_start + t0, k_start,
                                None if keys is None else keys[:, t0:t1])
        return total / (B * T)

    def kl_chunk(self, q, k, q_idx, k_idx, w, q_start, k_start, keys):
        """The sum over the chunk's queries of KL(p_t || softmax(I_t)) (see `kl_loss`)."""
        S = k.shape[2]
        scores = lightning_scores(q_idx, k_idx, w, q_start, k_start)  # (B, c, S), -inf where not visible
        with torch.no_grad():
            logits = (q.detach().float() @ expand_kv(k.detach().float(), self.n_head).transpose(-2, -1)) * self.scale
            visible = scores.isfinite()[:, None]  # (B, 1, c, S)
            if keys is not None:
                slot = torch.where(keys < 0, S, keys)
                chosen = torch.zeros(*keys.shape[:2], S + 1, dtype=torch.bool, device=q.device)
                visible = visible & chosen.scatter_(-1, slot, True)[..., :S][:, None]
            target = softmax_or_zero(logits, visible).mean(1)  # (B, c, S): summed over heads, L1-normalised
        log_q = torch.log_softmax(scores.masked_fill(~visible[:, 0], float("-inf")), dim=-1)
        kl = torch.xlogy(target, target) - target * log_q.masked_fill(target == 0, 0.0)
        return kl.sum()

    @torch.no_grad()
    def record_selection(self, q, k, q_idx, k_idx, w, q_start, k_start, keys):
        """For analyze.py: the mean distance of the selected keys (B, T, 1) and the share of
        the dense attention's mass (summed over heads, normalised) they hold (B, T, 1)."""
        if keys is None:
            return
        T = q.shape[2]
        q_pos = torch.arange(q_start, q_start + T, device=q.device)[:, None]  # (T, 1)
        ok = keys >= 0
        dist = ((q_pos - k_start - keys) * ok).sum(-1) / ok.sum(-1).clamp(min=1)  # (B, T)
        self.gates["selected_distance"] = dist.float()[..., None]
        logits = (q.float() @ expand_kv(k.float(), self.n_head).transpose(-2, -1)) * self.scale  # (B, H, T, S)
        p = masked_softmax_attend_probs(logits, allowed(T, k.shape[2], q_start, k_start, q.device)).mean(1)
        self.gates["kept_mass"] = p.gather(-1, keys.clamp(min=0)).masked_fill(~ok, 0.0).sum(-1)[..., None]

    def oldest_key_needed(self, next_pos):
        return 0


def masked_softmax_attend_probs(logits, mask):
    """softmax over the allowed keys in float32 (the probabilities `masked_softmax_attend` uses)."""
    return torch.softmax(logits.float().masked_fill(~mask, float("-inf")), dim=-1)


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
