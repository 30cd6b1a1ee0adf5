"""The attention variants, one readable class each: the reference that kernels.py must match.

Layout: q is (B, H, T, D); k and v are (B, Hkv, S, D) where S counts keys (S = T in a plain
forward pass, S = cached + T when decoding with a KV cache). Every rule is written in terms of
*positions* (`q_pos`, `k_pos`: absolute token indices), never of sequence lengths, so a
query's output depends only on its own context (SPEC.md): prefixes, padding-free batches
and KV-cache decoding all compute the same function.

Every class shares the constructor `(cfg)` and the forward signature of `CausalSelfAttention`;
a variant only overrides `attend` (and `oldest_key_needed`, which trims the KV cache).
Materialising the (T, S) score matrix is deliberate here: this file is for reading.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


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
    """Rotate-half RoPE (RoFormer, Su et al. 2021, as in HF Qwen3): x*cos + rotate_half(x)*sin."""
    x1, x2 = x_BHTD.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x_BHTD * cos + rotated * sin).to(x_BHTD.dtype)


def expand_kv(k_BHSD, n_head):
    """Grouped-query attention: repeat each key/value head for the query heads that share it."""
    return k_BHSD.repeat_interleave(n_head // k_BHSD.shape[1], dim=1)


def causal_mask(q_pos, k_pos, window=None):
    """(T, S) bool, True where query i may see key j: 0 <= i - j (<= window, if given)."""
    dist = q_pos[:, None] - k_pos[None, :]  # (T, S)
    mask = dist >= 0
    if window is not None:
        mask = mask & (dist <= window)
    return mask


def masked_softmax_attend(logits_BHTS, mask_TS, v_BHSD):
    """softmax over the allowed keys, then the weighted sum of values."""
    logits = logits_BHTS.masked_fill(~mask_TS, float("-inf"))
    return torch.softmax(logits.float(), dim=-1).to(v_BHSD.dtype) @ v_BHSD


def gate_summary(gate):
    """Per-head mean, std and fraction above 0.5 of a gate tensor whose last dim is heads."""
    g = gate.detach().float().reshape(-1, gate.shape[-1])
    return {"mean": g.mean(0).tolist(), "std": g.std(0, unbiased=False).tolist(),
            "frac_gt_half": (g > 0.5).float().mean(0).tolist()}


class CausalSelfAttention(nn.Module):
    """`full`: softmax(q k^T / sqrt(d)) v over every j <= i — the baseline of all seeds
    (validation loss 4.9266 at 134M on FineWeb, seeds 000/002/004).

    The Qwen3 attention block around every variant: q, k, v, o projections without bias,
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

    def forward(self, x_BTC, cos, sin, pos, cache=None):
        """x: the block's normalized input (B, T, C); cos/sin: (T, D) for positions `pos` (T,).
        With a `KVCache`, keys/values of earlier tokens are read from it and these appended."""
        B, T, _ = x_BTC.shape
        q = self.q_proj(x_BTC).view(B, T, self.n_head, self.head_dim)
        k = self.k_proj(x_BTC).view(B, T, self.n_kv_head, self.head_dim)
        v = self.v_proj(x_BTC).view(B, T, self.n_kv_head, self.head_dim)
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)  # (B, H, T, D)
        k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)  # (B, Hkv, T, D)
        v = v.transpose(1, 2)  # (B, Hkv, T, D)
        k_pos = pos
        if self.record:
            self.gates = {}
        if cache is not None:
            k, v, k_pos = cache.update(k, v, pos)  # (B, Hkv, S, D), S = cached + T
        if self.cfg.kernel == "fused" and not self.record:
            import kernels  # lazy: kernels.py builds on this file

            y = kernels.attend(self, q, k, v, x_BTC, pos, k_pos)
        else:
            y = self.attend(q, k, v, x_BTC, pos, k_pos)  # (B, H, T, D)
        if cache is not None:
            cache.trim(self.oldest_key_needed(int(pos[-1]) + 1))
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))

    def attend(self, q, k, v, x, q_pos, k_pos):
        k, v = expand_kv(k, self.n_head), expand_kv(v, self.n_head)
        logits = (q @ k.transpose(-2, -1)) * self.scale  # (B, H, T, S)
        return masked_softmax_attend(logits, causal_mask(q_pos, k_pos), v)

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
    """`local`: softmax(q k^T / sqrt(d)) v over i - W <= j <= i (Longformer-style sliding
    window; the "Local" row of seed 004, validation loss 5.021). W = cfg.window (256)."""

    def attend(self, q, k, v, x, q_pos, k_pos):
        k, v = expand_kv(k, self.n_head), expand_kv(v, self.n_head)
        logits = (q @ k.transpose(-2, -1)) * self.scale
        return masked_softmax_attend(logits, causal_mask(q_pos, k_pos, self.cfg.window), v)

    def oldest_key_needed(self, next_pos):
        return max(0, next_pos - self.cfg.window)


class DynamicSparseAttention(CausalSelfAttention):
    """`dsa`: dynamic head gating with an adaptive window (seeds 000, 001, 002; validation
    loss 4.6498 in 000, 4.904 in 002).

        g = sigmoid(W_g x + b_g)  in R^H per token        (000 §3.2, 002 §3.1)
        y = W_o concat_h(g_h * o_h)
        o_h = softmax over j in window(i) of q_i k_j / sqrt(d), times v

    window(i): all j <= i while the query's own context is short (i < dsa_threshold = 512),
    i - W <= j <= i after that (002 §3.2, "for sequences longer than 512 tokens", applied per
    query position so outputs never depend on later tokens). Ablations (002 Table 1):
    dsa_gate=False (g = 1, "No Gating"); dsa_window='fixed' (always windowed), 'none'
    (never windowed, "No Window").

    Init: W_g = 0, b_g = 0, so g = 0.5 for every token and head: the variant starts as the
    baseline with its output projection halved (no information lost), and the gate sits at
    the sigmoid's steepest point, where it learns fastest.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        assert cfg.dsa_window in ("adaptive", "fixed", "none"), cfg.dsa_window
        if cfg.dsa_gate:
            self.head_gate = nn.Linear(cfg.d_model, cfg.n_head)
        self.init_gates()

    def init_gates(self):
        if self.cfg.dsa_gate:
            nn.init.zeros_(self.head_gate.weight)
            nn.init.zeros_(self.head_gate.bias)

    def window_mask(self, q_pos, k_pos):
        if self.cfg.dsa_window == "none":
            return causal_mask(q_pos, k_pos)
        windowed = causal_mask(q_pos, k_pos, self.cfg.window)
        if self.cfg.dsa_window == "fixed":
            return windowed
        short_context = (q_pos < self.cfg.dsa_threshold)[:, None]  # (T, 1): full attention
        return windowed | (short_context & causal_mask(q_pos, k_pos))

    def attend(self, q, k, v, x, q_pos, k_pos):
        k, v = expand_kv(k, self.n_head), expand_kv(v, self.n_head)
        logits = (q @ k.transpose(-2, -1)) * self.scale
        y = masked_softmax_attend(logits, self.window_mask(q_pos, k_pos), v)  # (B, H, T, D)
        if not self.cfg.dsa_gate:
            return y
        g = torch.sigmoid(self.head_gate(x))  # (B, T, H)
        if self.record:
            self.gates["head_gate"] = g.detach()
        return y * g.transpose(1, 2).unsqueeze(-1)

    def oldest_key_needed(self, next_pos):
        if self.cfg.dsa_window == "none":
            return 0
        if self.cfg.dsa_window == "adaptive" and next_pos < self.cfg.dsa_threshold:
            return 0
        return max(0, next_pos - self.cfg.window)


class ASGAttention(CausalSelfAttention):
    """`asga`: Adaptive Sparse-Geometric Attention (seed 003; validation loss 5.148).

        s_ij^h     = sigmoid(w2_h . GELU(W1_h [LN(q_i^h); LN(k_j^h)] + b1_h) + b2_h)   (003 eq. 1)
        alpha_ij^h = softplus(gamma_h) * q_i^h . k_j^h / sqrt(d)                      (003 eq. 2)
        y_i^h      = softmax_{j <= i}(alpha^h ⊙ s^h) v^h                              (003 eq. 3)

    q and k are the post-norm, post-RoPE vectors the logits use. LN is LayerNorm over
    head_dim without affine parameters (W1 follows, so a gain and bias would be absorbed
    exactly). W1 [a; b] = W1a a + W1b b: the pair term is a per-query vector plus a per-key
    vector, broadcast to (T, S, r) here and tiled in kernels.py. Hidden width r = asga_hidden.
    Ablations (003 §4.2): asga_scale=False (softplus(gamma) = 1); asga_gate='fixed' (s = 1
    inside the window W, 0 outside, multiplied into the logits exactly as the learned s is);
    asga_gate='off' (s = 1). With both off this is `full` exactly.

    Init: softplus(gamma) = 1 (gamma = log(e - 1)), so the scale starts neutral; W1 ~ N(0, 1/D)
    keeps the hidden pre-activations O(1); w2 ~ N(0, 0.02) and b2 = 0 start s at 0.5, nearly
    input-independent, at the sigmoid's steepest point: a uniform temperature of 2 that the
    q/k norm gains can absorb.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        assert cfg.asga_gate in ("learned", "fixed", "off"), cfg.asga_gate
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
        D = q.shape[-1]
        q_term = torch.einsum("bhtd,hdr->bhtr", F.layer_norm(q, (D,)), self.w1_q)
        k_term = torch.einsum("bhsd,hdr->bhsr", F.layer_norm(k, (D,)), self.w1_k)
        return q_term + self.b1[None, :, None, :], k_term

    def attend(self, q, k, v, x, q_pos, k_pos):
        k, v = expand_kv(k, self.n_head), expand_kv(v, self.n_head)
        mask = causal_mask(q_pos, k_pos)
        logits = (q @ k.transpose(-2, -1)) * self.scale  # (B, H, T, S)
        if self.cfg.asga_scale:
            logits = logits * F.softplus(self.gamma)[None, :, None, None]
        if self.cfg.asga_gate == "learned":
            q_term, k_term = self.pair_terms(q, k)
            hidden = F.gelu(q_term[:, :, :, None, :] + k_term[:, :, None, :, :])  # (B,H,T,S,r)
            s = torch.sigmoid(hidden @ self.w2[None, :, None, :, None]
                              + self.b2[None, :, None, None, None]).squeeze(-1)  # (B,H,T,S)
            logits = logits * s
        elif self.cfg.asga_gate == "fixed":
            logits = logits * causal_mask(q_pos, k_pos, self.cfg.window).to(logits.dtype)
        if self.record and self.cfg.asga_gate == "learned":
            mean_s = (s * mask).sum(-1) / mask.sum(-1)  # (B, H, T): mean gate over visible keys
            self.gates["pair_gate"] = mean_s.transpose(1, 2).detach()  # (B, T, H)
        if self.record and self.cfg.asga_scale:
            self.gates["scale"] = F.softplus(self.gamma).detach()[None, None, :]  # (1, 1, H)
        return masked_softmax_attend(logits, mask, v)


class ContextAdaptiveAttention(CausalSelfAttention):
    """`caa`: Context-Adaptive Attention (seed 004; validation loss 4.712, 2.1x memory).

        y_i^h = g_h(x_i) Attn_L(i) + (1 - g_h(x_i)) Attn_G(i)                  (004 eq. 1)
        g(x)  = sigmoid(W2 GELU(W1 x + b1) + b2)  in R^H   (2-layer MLP, width caa_hidden)

    Attn_L, local with an input-dependent width w_i = W + W' sigmoid(u . x_i) in [W, W + W']
    (W = window = 256, W + W' = caa_window_max = 512; 004 §3.2): the logits get a soft,
    differentiable boundary log sigmoid((w_i - (i - j)) / caa_tau), and keys more than
    caa_window_max back are masked, so the branch stays local. Attn_G, top-k: query i keeps
    its k_i = ceil(sqrt(i + 1)) highest-scoring keys among j <= i (k = O(sqrt(n)) applied per
    query position) and takes the softmax over those alone. Both share q, k, v.
    Ablation/debug flags: caa_gate='local'|'global' forces g = 1|0; caa_topk='all' keeps
    every key (with caa_gate='global' this is `full` exactly).

    Init: W2 ~ N(0, 0.02), b2 = 0 (g ~ 0.5, an even mix, at the sigmoid's steepest point; not
    exactly 0 so that W1 gets a gradient from the first step); u = 0 and its bias 0, so every
    width starts at the middle, W + W'/2 = 384.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        assert cfg.caa_gate in ("learned", "local", "global"), cfg.caa_gate
        assert cfg.caa_topk in ("sqrt", "all"), cfg.caa_topk
        assert cfg.caa_window_max >= cfg.window, "caa_window_max must be >= window"
        self.mix_gate = nn.Sequential(nn.Linear(cfg.d_model, cfg.caa_hidden), nn.GELU(),
                                      nn.Linear(cfg.caa_hidden, cfg.n_head))
        self.width = nn.Linear(cfg.d_model, 1)
        self.init_gates()

    def init_gates(self):
        nn.init.normal_(self.mix_gate[0].weight, std=0.02)
        nn.init.normal_(self.mix_gate[2].weight, std=0.02)
        for p in (self.mix_gate[0].bias, self.mix_gate[2].bias, self.width.weight, self.width.bias):
            nn.init.zeros_(p)

    def topk_mask(self, logits, q_pos, causal):
        """(B, H, T, S) bool: the k_i highest-scoring visible keys of each query."""
        if self.cfg.caa_topk == "all":
            return causal.expand_as(logits)
        k_i = torch.ceil(torch.sqrt(q_pos.float() + 1)).long()  # (T,)
        order = logits.masked_fill(~causal, float("-inf")).argsort(dim=-1, descending=True)
        rank = order.argsort(dim=-1)  # rank of each key within its query's row
        return (rank < k_i[:, None]) & causal  # & causal: never a future key, even if k_i > visible

    def attend(self, q, k, v, x, q_pos, k_pos):
        cfg = self.cfg
        k, v = expand_kv(k, self.n_head), expand_kv(v, self.n_head)
        logits = (q @ k.transpose(-2, -1)) * self.scale  # (B, H, T, S)
        causal = causal_mask(q_pos, k_pos)
        width = cfg.window + (cfg.caa_window_max - cfg.window) * torch.sigmoid(self.width(x))  # (B,T,1)
        dist = (q_pos[:, None] - k_pos[None, :]).to(logits.dtype)  # (T, S)
        boundary = F.logsigmoid((width - dist) / cfg.caa_tau)  # (B, T, S)
        local = masked_softmax_attend(logits + boundary[:, None],
                                      causal_mask(q_pos, k_pos, cfg.caa_window_max), v)
        glob = masked_softmax_attend(logits, self.topk_mask(logits.detach(), q_pos, causal), v)
        g = torch.sigmoid(self.mix_gate(x))  # (B, T, H)
        if cfg.caa_gate != "learned":
            g = torch.full_like(g, 1.0 if cfg.caa_gate == "local" else 0.0)
        if self.record:
            self.gates.update(mix_gate=g.detach(), window=width.detach())
        g = g.transpose(1, 2).unsqueeze(-1)  # (B, H, T, 1)
        return g * local + (1 - g) * glob


# ---------------------------------------------------------------------------- combiner

def combiner_summaries(qbar, k_blocks, v_blocks, scale):
    """One span per completed block r (Combiner-Fixed, Ren et al. 2021, §3.2):

        kbar_r = max_{j in r} k_j                                  (elementwise)
        vbar_r = sum_{j in r} softmax_j(qbar_r . k_j * scale) v_j  (no causal mask inside r)

    qbar (B, H, R, D): the elementwise max of each block's queries; k_blocks, v_blocks
    (B, Hkv, R, s, D). Returns kbar (B, Hkv, R, D) and vbar (B, H, R, D): vbar depends on the
    query head through qbar, so it has H heads even with grouped-query attention. Memory
    O(R * s) per head: this is already the fused path's computation (kernels.py uses it)."""
    B, H, R, D = qbar.shape
    Hkv = k_blocks.shape[1]
    kbar = k_blocks.amax(dim=3)  # (B, Hkv, R, D)
    qbar = qbar.view(B, Hkv, H // Hkv, R, D)  # the query heads that share each key head
    logits = torch.einsum("bkgrd,bkrsd->bkgrs", qbar, k_blocks) * scale  # (B, Hkv, g, R, s)
    p = torch.softmax(logits.float(), dim=-1).to(v_blocks.dtype)
    vbar = torch.einsum("bkgrs,bkrsd->bkgrd", p, v_blocks)  # (B, Hkv, g, R, D)
    return kbar, vbar.reshape(B, H, R, v_blocks.shape[-1])


def combiner_summaries_from_start(q, k, v, block, scale):
    """combiner_summaries of blocks 0 .. R-1 of a sequence at positions 0 .. T-1 (R = block of
    the last position): q (B, H, T, D), k, v (B, Hkv, T, D) -> kbar, vbar."""
    R = (q.shape[2] - 1) // block
    blocks = lambda x: x[:, :, :R * block].unflatten(2, (R, block))  # noqa: E731  (B, h, R, s, D)
    return combiner_summaries(blocks(q).amax(dim=3), blocks(k), blocks(v), scale)


def to_blocks(x_BHTD, before, block, fill):
    """(B, H, T, D) -> (B, H, n, s, D): `before` rows of `fill`, the T rows, then `fill` up to
    a whole number n of blocks of s rows."""
    T = x_BHTD.shape[2]
    after = -(before + T) % block
    x = F.pad(x_BHTD, (0, 0, before, after), value=fill)
    return x.view(*x.shape[:2], (before + T + after) // block, block, x.shape[-1])


def combiner_reference(q, k, v, kbar, vbar, q_pos, k_pos, block, scale):
    """y_i = sum_{j direct} p_ij v_j + sum_{r < block(i)} p_ir vbar_r, one softmax over
    logits q_i . k_j * scale (j in i's block, j <= i) and q_i . kbar_r * scale (r < block(i))
    (Combiner §2-3, eqs. 4-9: attention as the expectation under one factorized p(j | i)).
    Written as plain attention over keys [k; kbar] and values [v; vbar] with one mask; this
    materialises (T, S + R) logits, on purpose (kernels.py does not).
    q (B, H, T, D); k, v (B, Hkv, S, D); kbar (B, Hkv, R, D) and vbar (B, H, R, D) for
    blocks 0 .. R-1."""
    n_head, R = q.shape[1], kbar.shape[2]
    keys = expand_kv(torch.cat([k, kbar], dim=2), n_head)  # (B, H, S + R, D)
    values = torch.cat([expand_kv(v, n_head), vbar], dim=2)  # (B, H, S + R, D)
    q_block, k_block = q_pos // block, k_pos // block  # (T,), (S,)
    direct = causal_mask(q_pos, k_pos) & (k_block[None, :] == q_block[:, None])  # (T, S)
    span = torch.arange(R, device=q.device)[None, :] < q_block[:, None]  # (T, R)
    logits = (q @ keys.transpose(-2, -1)) * scale  # (B, H, T, S + R)
    return masked_softmax_attend(logits, torch.cat([direct, span], dim=1), values)


class CombinerAttention(CausalSelfAttention):
    """`combiner`: Combiner-Fixed, causal (Ren et al., "Combiner: Full Attention Transformer
    with Sparse Computation Cost", NeurIPS 2021, arXiv 2107.05768; the "Sparse [Combiner]"
    row of seed 004, validation loss 4.904). Every earlier token is reached, directly or
    through one summary per block:

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

    This project's choice: with a KV cache, `cache.state` holds kbar, vbar of every completed
    block and the running max of the queries of the last token's block, and the cache keeps
    that block's keys only, so decoding is exact with O(s + T/s) keys per layer.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        self.cache = None  # the KVCache of the forward pass running now, if any (see forward)

    def forward(self, x_BTC, cos, sin, pos, cache=None):
        # `attend` has no cache argument (every variant shares its signature), yet a summary
        # value needs the max over *all* its block's queries, which earlier decoding steps saw:
        # so the cache is lent to `summaries` for the duration of this call.
        if cache is None:
            return super().forward(x_BTC, cos, sin, pos)
        self.cache = cache
        try:
            return super().forward(x_BTC, cos, sin, pos, cache)
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

    def attend(self, q, k, v, x, q_pos, k_pos):
        kbar, vbar = self.summaries(q, k, v, int(q_pos[0]), int(k_pos[0]))
        return combiner_reference(q, k, v, kbar, vbar, q_pos, k_pos, self.cfg.window, self.scale)

    def oldest_key_needed(self, next_pos):
        # Keep the block of the last token: once complete, the next step summarises it.
        return (next_pos - 1) // self.cfg.window * self.cfg.window


VARIANTS = {
    "full": CausalSelfAttention,
    "local": LocalAttention,
    "dsa": DynamicSparseAttention,
    "asga": ASGAttention,
    "caa": ContextAdaptiveAttention,
    "combiner": CombinerAttention,
}
