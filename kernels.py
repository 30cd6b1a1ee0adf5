"""Fast, memory-lean paths for the attention variants: the same function as attention.py,
without its (T, S) score matrices, nor asga's (T, S, r) pair tensor.

`attend(module, q, k, v, x, q_pos, k_pos)` replaces `module.attend(...)` when
`cfg.kernel == "fused"`. Plain PyTorch operations only, so the same code runs on CPU and GPU.
Not used: torch.compile (on this CPU it gained 1.0-1.2x for 15-40 s of compiling) and
FlexAttention (its backward raises NotImplementedError on CPU). On CUDA a FlexAttention
block mask would be the natural next step for the windowed variants: not built, not measured.

How each part avoids the dense score matrix (q, k, v as in attention.py; G = B * H heads):
- Full causal attention (`full`; `dsa` before its threshold or without a window; `asga` with
  its gate off; `caa` with top-k 'all'): F.scaled_dot_product_attention, `is_causal` when
  queries and keys are the same positions, an explicit (T, S) mask with a KV cache.
- Windowed attention (`local`, `dsa`, `caa`'s local branch, `asga` fixed): `BandAttention`.
  Queries are cut into blocks of Bq; block b sees a band of L = Bq + Wp keys (Wp = the window
  rounded up to a multiple of Bq), a strided view of the keys (no copy). Blocks are processed
  a cache-sized chunk at a time, FlashAttention-style: the forward keeps only its output,
  the backward recomputes each chunk's scores (Dao et al. 2022). Time grows as T * (Bq + W),
  memory as T * D. `caa`'s soft window boundary enters as an additive bias on the band,
  whose gradient the backward returns.
- `asga` fixed: s is 1 inside the window and 0 outside, so every causal key beyond the window
  has logit exactly 0: together they act as one extra key with logit log(count) and value
  their mean (a prefix sum of v); the rest is windowed attention. O(T * W), not O(T * S).
- `asga` learned: `PairGatedAttention`. The gate is built one (query block x key chunk) tile
  at a time, only for keys j <= i (the upper triangle is skipped), in reused buffers; the
  forward keeps output and row log-sum-exp, the backward recomputes each tile once
  (FlashAttention-2's loop). Memory O(T * (D + r)) kept, O(Bq * S) transient; time O(T^2 r).
- `caa` top-k: `TopkAttention`. Per query block, dense scores pick each query's k_i keys;
  only the chosen indices and probabilities, (T, max k_i) per head, are kept for backward.
- `dsa`'s head gate and `caa`'s mixture multiply the kernels' outputs: (B, H, T, D) tensors,
  no (T, S) one.
- `combiner`: `combiner_blocks`, direct logits (nb, s, s) inside each aligned block and
  (T, T/s) span logits against the block summaries, one softmax: O(T (s + T/s)) time, a
  chunk of blocks at a time, each recomputed in the backward (memory O(T D) + one chunk).
  `combiner_flex_attention` computes it through FlexAttention (not dispatched to yet).

Falls back to `module.attend` (the reference) only where positions are not two contiguous
runs with every query among the keys (never the case in Model), for a module whose type has
no entry in `FUSED`, and for an instance whose `attend` was replaced. Decoding (T = 1) goes through the same fused code (with a trimmed
window it is full causal attention over the cached keys). Verified in float32 on CPU only;
under bf16 autocast on a GPU the kernels' softmax would run in bf16 where the reference's
runs in float32 (not measured).

`python kernels.py [--quick] [--out PATH]` benchmarks reference, fused and causal SDPA side by
side (see `benchmark`).
"""
import argparse
import dataclasses
import functools
import json
import multiprocessing
import os
import resource
import statistics
import time

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from attention import (ASGAttention, CausalSelfAttention, CombinerAttention, ContextAdaptiveAttention,
                       DynamicSparseAttention, LocalAttention, combiner_summaries_from_start, expand_kv,
                       to_blocks)

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------- full causal

def causal_attention(q, k, v, off, scale):
    """(B, H, T, D): softmax over keys s <= off + t of q_t . k_s * scale, times v.
    Query t sits at key index off + t (off = keys before the first query)."""
    T, S = q.shape[-2], k.shape[-2]
    if off == 0 and S == T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if off + T == S and T == 1:  # decoding: the one query sees every cached key
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    # SDPA's is_causal aligns its mask top-left; with a KV cache the queries are the last
    # keys, so pass the (T, S) mask (T is small when there is a cache).
    mask = torch.arange(S, device=q.device) <= off + torch.arange(T, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


# ---------------------------------------------------------------------------- windowed

class Band:
    """Geometry of windowed attention. Query t (block b = t // Bq, row a = t % Bq) sees key s
    when 0 <= off + t - s <= window. Block b's band holds keys s = off + b*Bq - Wp + c,
    c in [0, L), whose distance to the query, a + Wp - c, is the same for every block."""

    BLOCK = 64  # largest query block; ~window/4 (a band wastes Bq/(Bq+W) of its work on masked keys)
    CHUNK = 1 << 22  # score elements per chunk (16 MB): few ops, yet O(chunk) memory, not O(T * L)

    def __init__(self, G, T, S, off, window, device):
        self.G, self.T, self.S, self.off, self.window = G, T, S, off, window
        bq = 16
        while bq * 2 <= min(self.BLOCK, window / 4):
            bq *= 2
        self.Bq = min(bq, T)
        self.nb = -(-T // self.Bq)
        self.Tp = self.nb * self.Bq  # queries padded to whole blocks
        self.n = -(-window // self.Bq)  # key blocks before the diagonal one
        self.Wp = self.n * self.Bq
        self.L = self.Bq + self.Wp
        self.R = (self.nb + self.n) * self.Bq  # keys one head's bands cover: [off - Wp, off + Tp)
        self.flat = off == 0
        blocks = G * self.nb if self.flat else self.nb  # what one chunk may span
        per_chunk = max(1, self.CHUNK // (self.Bq * self.L))
        self.chunk = -(-blocks // -(-blocks // per_chunk))  # blocks per chunk, balanced
        self.device = device
        self.dist = (torch.arange(self.Bq, device=device)[:, None] + self.Wp
                     - torch.arange(self.L, device=device))  # (Bq, L)
        in_window = (self.dist >= 0) & (self.dist <= window)
        self.band_mask = torch.zeros(self.Bq, self.L, device=device).masked_fill_(~in_window, NEG_INF)
        # Columns with a masked entry: c < Bq + Wp - window (before the window of the block's
        # last query) and c > Wp (after the block's first query); the rest needs no mask.
        self.masked_columns = [slice(0, min(self.L, self.Bq + self.Wp - window)), slice(self.Wp + 1, self.L)]
        self.edge = self.edge_mask()

    def edge_mask(self):
        """(blocks, Bq, L) -inf for the first blocks' keys before s = 0 (rows t < T only:
        padded rows keep their in-window keys, whatever they hold, so no row is all -inf).
        No real query sees a key s >= S, since off + T <= S."""
        blocks = min(self.nb, max(0, -(-(self.Wp - self.off) // self.Bq)))
        b = torch.arange(blocks, device=self.device)[:, None, None]
        s = self.off + b * self.Bq - self.Wp + torch.arange(self.L, device=self.device)  # (blocks, 1, L)
        t = b * self.Bq + torch.arange(self.Bq, device=self.device)[:, None]  # (blocks, Bq, 1)
        return torch.zeros(blocks, self.Bq, self.L, device=self.device).masked_fill_((s < 0) & (t < self.T), NEG_INF)

    def mask_bias(self):
        """(1, nb, Bq, L): 0 where the query may see the key, -inf elsewhere."""
        bias = self.band_mask.repeat(self.nb, 1, 1)
        bias[:len(self.edge)] += self.edge
        return bias[None]

    def pad_queries(self, x):
        """(G, T, X) -> (G * nb, Bq, X)."""
        if self.Tp != self.T:
            x = F.pad(x, (0, 0, 0, self.Tp - self.T))
        return x.reshape(self.G * self.nb, self.Bq, x.shape[-1])

    def unpad(self, x):
        """(G * nb, Bq, X) -> (G, T, X)."""
        return x.view(self.G, self.Tp, -1)[:, :self.T]

    def key_buffer(self, x):
        """(G, S, D) keys -> (rows, D), laid out so that the band of every block of a head is
        `Bq` rows after the previous one (`bands` is then a strided view, no copy). Without
        a cache (off = 0) the heads lie end to end after Wp rows, band (g, b) starting at row
        (g*nb + b)*Bq: a head's first bands overlap the previous head's last keys, at s < 0,
        which `edge` masks. With a cache the keys before off are real, so each head gets its
        own R rows, keys s in [off - Wp, off + Tp)."""
        D = x.shape[-1]
        if self.flat:
            buf = x.new_empty(self.Wp + self.G * self.Tp, D)
            buf[:self.Wp].zero_()
            heads = buf[self.Wp:].view(self.G, self.Tp, D)
            m = min(self.S, self.Tp)
            heads[:, :m] = x[:, :m]
            heads[:, m:].zero_()
            return buf
        buf = x.new_zeros(self.G, self.R, D)
        lo, hi = max(0, self.off - self.Wp), min(self.S, self.off + self.Tp)
        buf[:, lo - self.off + self.Wp: hi - self.off + self.Wp] = x[:, lo:hi]
        return buf.view(self.G * self.R, D)

    def key_grad(self, buf):
        """Adjoint of key_buffer: (rows, D) -> (G, S, D)."""
        D = buf.shape[-1]
        if self.flat:
            heads = buf[self.Wp:].view(self.G, self.Tp, D)
            return heads[:, :self.S] if self.S <= self.Tp else F.pad(heads, (0, 0, 0, self.S - self.Tp))
        out = buf.new_zeros(self.G, self.S, D)
        lo, hi = max(0, self.off - self.Wp), min(self.S, self.off + self.Tp)
        out[:, lo:hi] = buf.view(self.G, self.R, D)[:, lo - self.off + self.Wp: hi - self.off + self.Wp]
        return out

    def row(self, i):
        """Row of the key buffer where the band of block i (head i // nb) starts."""
        return i * self.Bq if self.flat else (i // self.nb) * self.R + (i % self.nb) * self.Bq

    def bands(self, buf, i0, i1):
        """(i1 - i0, L, D) view: the bands of blocks i0 .. i1-1 (of one head, with a cache)."""
        D = buf.shape[-1]
        return buf[self.row(i0):].as_strided((i1 - i0, self.L, D), (self.Bq * D, D, 1))

    def chunks(self):
        """(i0, i1): the G * nb blocks, at most `chunk` at a time; without a cache a chunk may
        span heads (their bands are equally spaced in the buffer), with one it may not."""
        if self.flat:
            for i0 in range(0, self.G * self.nb, self.chunk):
                yield i0, min(self.G * self.nb, i0 + self.chunk)
        else:
            for g in range(self.G):
                for b0 in range(0, self.nb, self.chunk):
                    yield g * self.nb + b0, g * self.nb + min(self.nb, b0 + self.chunk)

    def bias_rows(self, bias, i0, i1):
        """Index into bias.view(-1, Bq, L) of blocks i0 .. i1-1: bias is shared by the heads
        of a batch row (and by all of them when it has one row)."""
        i = torch.arange(i0, i1, device=self.device)
        return (i // self.nb) // (self.G // bias.shape[0]) * self.nb + i % self.nb

    def scores(self, out, qb, kbuf, i0, i1, bias):
        """Logits of blocks i0 .. i1-1 into out (i1 - i0, Bq, L), masked."""
        torch.bmm(qb, self.bands(kbuf, i0, i1).transpose(1, 2), out=out)
        if bias is not None:
            return out.add_(bias.view(-1, self.Bq, self.L).index_select(0, self.bias_rows(bias, i0, i1)))
        for cols in self.masked_columns:  # the window's two corners, not the whole band
            out[..., cols] += self.band_mask[:, cols]
        for g in range(i0 // self.nb, (i1 - 1) // self.nb + 1):  # each head's first blocks
            lo, hi = max(i0, g * self.nb), min(i1, g * self.nb + len(self.edge))
            if lo < hi:
                out[lo - i0:hi - i0] += self.edge[lo - g * self.nb:hi - g * self.nb]
        return out


class BandAttention(torch.autograd.Function):
    """softmax(q k^T + bias) v over each query block's band of keys (see `Band`), chunk by
    chunk, FlashAttention-style (Dao et al. 2022): the forward keeps only its output (and,
    with an extra key, each row's log-sum-exp), the backward recomputes each chunk's
    probabilities, so no (T, L) tensor outlives a chunk; chunks reuse the same buffers
    (fresh pages cost as much as the matmuls here).

    q (G, T, D) already scaled; k, v (G, S, D); bias None (the window's mask only) or
    (1 or B, nb, Bq, L), masking included, shared by the heads of a batch row. Optionally
    one extra key per query, logit extra_logit (T,) (no gradient) and value extra_value
    (G, T, D) (asga fixed)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, band, extra_logit=None, extra_value=None):
        nb, Bq, L = band.nb, band.Bq, band.L
        qb = band.pad_queries(q)  # (G*nb, Bq, D)
        kbuf, vbuf = band.key_buffer(k), band.key_buffer(v)
        o = torch.empty_like(qb)
        e = u = lse = None
        if extra_logit is not None:
            e = F.pad(extra_logit, (0, band.Tp - band.T), value=NEG_INF).view(nb, Bq, 1).repeat(band.G, 1, 1)
            u, lse = band.pad_queries(extra_value), qb.new_empty(band.G * nb, Bq, 1)
        work, work_p = qb.new_empty(band.chunk, Bq, L), qb.new_empty(band.chunk, Bq, L)
        for i0, i1 in band.chunks():
            i = slice(i0, i1)
            s = band.scores(work[:i1 - i0], qb[i], kbuf, i0, i1, bias)
            if e is None:  # torch's softmax: its exp is ~2x faster than exp_
                p = torch.ops.aten._softmax.out(s, -1, False, out=work_p[:i1 - i0])
            else:  # one more key, logit e, value u: the softmax through its log-sum-exp
                lse[i] = torch.logaddexp(torch.logsumexp(s, -1, keepdim=True), e[i])
                p = s.sub_(lse[i]).exp_()
            torch.bmm(p, band.bands(vbuf, i0, i1), out=o[i])
            if e is not None:
                o[i] += torch.exp(e[i] - lse[i]) * u[i]
        ctx.band = band
        ctx.save_for_backward(qb, kbuf, vbuf, o, bias, e, u, lse)
        return band.unpad(o)

    @staticmethod
    def backward(ctx, do):
        band = ctx.band
        nb, Bq, L, D = band.nb, band.Bq, band.L, do.shape[-1]
        qb, kbuf, vbuf, o, bias, e, u, lse = ctx.saved_tensors
        do = band.pad_queries(do)  # (G*nb, Bq, D)
        delta = (do * o).sum(-1, keepdim=True)  # sum over keys of p * dp (FlashAttention's D)
        dq, dk, dv = torch.empty_like(qb), torch.zeros_like(kbuf), torch.zeros_like(vbuf)
        d_bias = torch.zeros_like(bias) if ctx.needs_input_grad[3] else None
        d_extra = torch.zeros_like(u) if u is not None and ctx.needs_input_grad[6] else None
        work, work_p, work_dp = (qb.new_empty(band.chunk, Bq, L) for _ in range(3))
        for i0, i1 in band.chunks():
            i = slice(i0, i1)
            s = band.scores(work[:i1 - i0], qb[i], kbuf, i0, i1, bias)  # the forward's, again
            if e is None:
                p = torch.ops.aten._softmax.out(s, -1, False, out=work_p[:i1 - i0])
            else:
                p = s.sub_(lse[i]).exp_()
                if d_extra is not None:
                    d_extra[i] = torch.exp(e[i] - lse[i]) * do[i]
            ds = torch.bmm(do[i], band.bands(vbuf, i0, i1).transpose(1, 2), out=work_dp[:i1 - i0])
            ds.sub_(delta[i]).mul_(p)  # d logits
            torch.bmm(ds, band.bands(kbuf, i0, i1), out=dq[i])
            for m in range(band.n + 1):  # sub-block m of every band: Bq rows of the key buffer
                rows = slice(band.row(i0) + m * Bq, band.row(i0) + (i1 - i0 + m) * Bq)
                cols = slice(m * Bq, (m + 1) * Bq)
                dv[rows].view(i1 - i0, Bq, D).baddbmm_(p[..., cols].transpose(1, 2), do[i])
                dk[rows].view(i1 - i0, Bq, D).baddbmm_(ds[..., cols].transpose(1, 2), qb[i])
            if d_bias is not None:
                d_bias.view(-1, Bq, L).index_add_(0, band.bias_rows(bias, i0, i1), ds)
        d_extra = None if d_extra is None else band.unpad(d_extra)
        return band.unpad(dq), band.key_grad(dk), band.key_grad(dv), d_bias, None, None, d_extra


def windowed_attention(q, k, v, off, window, scale, bias_fn=None, beyond_window=False):
    """(B, H, T, D): softmax over keys 0 <= off + t - s <= window of q_t . k_s * scale
    (+ bias_fn(band), a (B, nb, Bq, L) addition to the logits), times v.
    beyond_window: the keys farther back than the window count too, each with logit 0
    (asga fixed); they enter as one extra key, logit log(count), value their mean."""
    B, H, T, D = q.shape
    S = k.shape[-2]
    if window >= off + T - 1 and bias_fn is None:  # the window holds every causal key
        return causal_attention(q, k, v, off, scale)
    band = Band(B * H, T, S, off, window, q.device)
    bias = None if bias_fn is None else band.mask_bias() + bias_fn(band)
    extra = ()
    if beyond_window:
        # Keys s < off + t - window: prefix sums of v (float64, so long sums stay exact).
        count = (off + torch.arange(T, device=q.device) - window).clamp(0, S)  # (T,)
        prefix = v.flatten(0, 1).double().cumsum(1)  # (G, S, D)
        total = prefix[:, (count - 1).clamp(min=0)]  # (G, T, D)
        mean = (total / count.clamp(min=1)[:, None]).to(v.dtype)
        extra = (count.to(q.dtype).log(), mean)  # log(0) = -inf: no such key
    out = BandAttention.apply((q * scale).flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), bias, band, *extra)
    return out.view(B, H, T, D)


# ---------------------------------------------------------------------------- asga learned

def _mask_future_(logits, t0, off, c0=0):
    """logits (G, bq, c) of queries t0 + a and keys c0 + j: -inf where the key comes after
    the query, c0 + j > off + t0 + a (in place)."""
    bq, c = logits.shape[1:]
    if c0 + c - 1 > off + t0:  # the tile reaches past the diagonal
        a = torch.arange(bq, device=logits.device)[:, None]
        j = torch.arange(c, device=logits.device)
        logits.masked_fill_(c0 + j > off + t0 + a, NEG_INF)
    return logits


class PairGatedAttention(torch.autograd.Function):
    """y_i = softmax_{s <= off+i}(q_i . k_s * sigmoid(w2 . GELU(qt_i + kt_s) + b2)) v.

    q (G, T, D) already scaled (1/sqrt(d) and softplus(gamma)); k, v (G, S, D); qt (G, T, r),
    kt (G, S, r) the two halves of W1 [LN(q); LN(k)] + b1; w2 (G, r), b2 (G,).
    The hidden tensor exists one (G, r, Bq, chunk) tile at a time, in buffers reused across
    tiles (a fresh allocation per tile cost more than the GELU), r-major so that the
    broadcast add and the GELU run over long contiguous rows. Forward: per query block,
    the gate logits of every visible key, then one softmax; saves output and log-sum-exp.
    Backward, FlashAttention-2 style (Dao 2023): per (query block, key chunk) tile, the
    gate and the probabilities are recomputed from the log-sum-exp and every gradient is
    accumulated from that tile alone: each hidden element is built twice in all, once in
    the forward, once in the backward."""

    BLOCK = 64  # queries per block
    TILE = 1 << 21  # elements of one hidden tile (8 MB): fewer, larger ops; measured best

    @staticmethod
    def _chunk(G, r):
        return max(16, PairGatedAttention.TILE // (G * r * PairGatedAttention.BLOCK))

    @staticmethod
    def _gate_tile(qt_r, kt_r, t0, t1, c0, c1, w2_row, buffers):
        """hidden = qt + kt, act = GELU(hidden) (G, r, bq, c) in the buffers, and the gate
        logit w2 . act (G, bq, c) (003 eq. 1 before b2 and the sigmoid)."""
        G, r = qt_r.shape[:2]
        shape = (G, r, t1 - t0, c1 - c0)
        n = shape[0] * shape[1] * shape[2] * shape[3]
        hidden = torch.add(qt_r[:, :, t0:t1, None], kt_r[:, :, None, c0:c1], out=buffers[0][:n].view(shape))
        act = torch._C._nn.gelu(hidden, out=buffers[1][:n].view(shape))
        return hidden, act, torch.bmm(w2_row, act.view(G, r, -1)).view(G, t1 - t0, c1 - c0)

    @staticmethod
    def forward(ctx, q, k, v, qt, kt, w2, b2, off):
        G, T, _ = q.shape
        S, r = k.shape[1], qt.shape[-1]
        qt_r, kt_r = qt.transpose(1, 2).contiguous(), kt.transpose(1, 2).contiguous()  # (G, r, T|S)
        w2_row, chunk = w2[:, None, :], PairGatedAttention._chunk(G, r)
        buffers = [q.new_empty(G * r * PairGatedAttention.BLOCK * chunk) for _ in range(2)]
        o, lse = torch.empty_like(q), q.new_empty(G, T, 1)
        rows = [q.new_empty(G * PairGatedAttention.BLOCK * S) for _ in range(2)]  # (G, bq, K) each
        for t0 in range(0, T, PairGatedAttention.BLOCK):
            t1 = min(T, t0 + PairGatedAttention.BLOCK)
            K = min(S, off + t1)  # keys any query of this block may see
            z = rows[0][:G * (t1 - t0) * K].view(G, t1 - t0, K)
            for c0 in range(0, K, chunk):
                c1 = min(K, c0 + chunk)
                z[:, :, c0:c1] = PairGatedAttention._gate_tile(qt_r, kt_r, t0, t1, c0, c1, w2_row, buffers)[2]
            s = torch.sigmoid_(z.add_(b2[:, None, None]))
            logits = torch.bmm(q[:, t0:t1], k[:, :K].transpose(1, 2), out=rows[1][:z.numel()].view(z.shape))
            logits = _mask_future_(logits.mul_(s), t0, off)
            lse[:, t0:t1] = torch.logsumexp(logits, -1, keepdim=True)
            o[:, t0:t1] = torch.bmm(logits.sub_(lse[:, t0:t1]).exp_(), v[:, :K])
        ctx.off = off
        ctx.save_for_backward(q, k, v, qt_r, kt_r, w2, b2, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, qt_r, kt_r, w2, b2, o, lse = ctx.saved_tensors
        off = ctx.off
        G, T, _ = q.shape
        S, r = k.shape[1], qt_r.shape[1]
        w2_row, chunk = w2[:, None, :], PairGatedAttention._chunk(G, r)
        buffers = [q.new_empty(G * r * PairGatedAttention.BLOCK * chunk) for _ in range(3)]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dqt_r, dkt_r = torch.zeros_like(qt_r), torch.zeros_like(kt_r)  # without the w2 factor
        dw2, db2 = q.new_zeros(G, r, 1), torch.zeros_like(b2)
        delta = (do * o).sum(-1, keepdim=True)  # (G, T, 1): sum over keys of p * dp
        for t0 in range(0, T, PairGatedAttention.BLOCK):
            t1 = min(T, t0 + PairGatedAttention.BLOCK)
            qb, dob = q[:, t0:t1], do[:, t0:t1]
            for c0 in range(0, min(S, off + t1), chunk):
                c1 = min(S, off + t1, c0 + chunk)
                hidden, act, z = PairGatedAttention._gate_tile(qt_r, kt_r, t0, t1, c0, c1, w2_row, buffers)
                s = torch.sigmoid(z.add_(b2[:, None, None]))  # (G, bq, c)
                qk = torch.bmm(qb, k[:, c0:c1].transpose(1, 2))
                p = _mask_future_(qk * s, t0, off, c0).sub_(lse[:, t0:t1]).exp_()
                dv[:, c0:c1] += torch.bmm(p.transpose(1, 2), dob)
                dlogits = torch.bmm(dob, v[:, c0:c1].transpose(1, 2)).sub_(delta[:, t0:t1]).mul_(p)
                dqk = dlogits * s
                dq[:, t0:t1] += torch.bmm(dqk, k[:, c0:c1])
                dk[:, c0:c1] += torch.bmm(dqk.transpose(1, 2), qb)
                dz = dlogits.mul_(qk).mul_(s).mul_(1 - s)  # d gate logit
                db2 += dz.sum((1, 2))
                dw2 += torch.bmm(act.view(G, r, -1), dz.view(G, -1, 1))
                # d hidden / w2 = dz * GELU'(hidden); w2 is applied once, to the sums
                dh = torch.ops.aten.gelu_backward.grad_input(dz[:, None].expand_as(hidden), hidden,
                                                             grad_input=buffers[2][:hidden.numel()].view(hidden.shape))
                dqt_r[:, :, t0:t1] += dh.sum(-1)
                dkt_r[:, :, c0:c1] += dh.sum(2)
        dqt = (dqt_r * w2[:, :, None]).transpose(1, 2)
        dkt = (dkt_r * w2[:, :, None]).transpose(1, 2)
        return dq, dk, dv, dqt, dkt, dw2.view(G, r), db2, None


# ---------------------------------------------------------------------------- caa top-k

class TopkAttention(torch.autograd.Function):
    """y_t = softmax over the k_t highest-scoring keys s <= off + t of q_t . k_s, times v.

    q (G, T, D) already scaled; k, v (G, S, D); k_per_query (T,) long. Per query block the
    dense scores pick the keys (topk) and give their logits; the probabilities are scattered
    into that block's (G, Bq, K) buffer for dense matmuls, which beat gathering the chosen
    keys on CPU. Saves only each query's chosen key indices and probabilities, (G, T, max k)."""

    SCORES = 1 << 22  # elements of one block's (G, Bq, K) scores: 16 MB

    @staticmethod
    def forward(ctx, q, k, v, k_per_query, off):
        G, T, D = q.shape
        S = k.shape[1]
        o = torch.empty_like(q)
        chosen = []
        block = max(16, TopkAttention.SCORES // (G * S))
        work = q.new_empty(G * block * S)  # one buffer for every block: no heap fragments
        for t0 in range(0, T, block):
            t1 = min(T, t0 + block)
            K = min(S, off + t1)
            scores = torch.bmm(q[:, t0:t1], k[:, :K].transpose(1, 2), out=work[:G * (t1 - t0) * K].view(G, t1 - t0, K))
            scores = _mask_future_(scores, t0, off)
            kmax = min(K, int(k_per_query[t0:t1].max()))
            logits, idx = scores.topk(kmax, -1)  # (G, bq, kmax), best first
            rank_ok = torch.arange(kmax, device=q.device) < k_per_query[t0:t1, None]  # (bq, kmax)
            # A key after the query is never chosen, even where a row has fewer than k_t keys.
            keep = rank_ok & (idx <= off + torch.arange(t0, t1, device=q.device)[:, None])
            p = torch.softmax(logits.masked_fill_(~keep, NEG_INF), -1)
            o[:, t0:t1] = torch.bmm(scores.zero_().scatter_(-1, idx, p), v[:, :K])
            chosen.append((idx, p))
        ctx.off, ctx.chosen, ctx.block = off, chosen, block
        ctx.save_for_backward(q, k, v)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        G, S = q.shape[0], k.shape[1]
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        work, work_dp = q.new_empty(G * ctx.block * S), q.new_empty(G * ctx.block * S)
        for b, (idx, p) in enumerate(ctx.chosen):
            t0 = b * ctx.block
            t1 = t0 + idx.shape[1]
            K = min(S, ctx.off + t1)
            qb, dob = q[:, t0:t1], do[:, t0:t1]
            shape = (G, t1 - t0, K)
            dense = work[:G * (t1 - t0) * K].view(shape).zero_().scatter_(-1, idx, p)
            dv[:, :K].baddbmm_(dense.transpose(1, 2), dob)
            dp = torch.bmm(dob, v[:, :K].transpose(1, 2), out=work_dp[:dense.numel()].view(shape)).gather(-1, idx)
            dlogits = torch.ops.aten._softmax_backward_data(dp, p, -1, p.dtype)
            dense.zero_().scatter_(-1, idx, dlogits)
            dq[:, t0:t1] = torch.bmm(dense, k[:, :K])
            dk[:, :K].baddbmm_(dense.transpose(1, 2), qb)
        return dq, dk, dv, None, None


# ---------------------------------------------------------------------------- the variants

def _full(m, q, k, v, x, q_pos, off):
    k, v = expand_kv(k, m.n_head), expand_kv(v, m.n_head)
    return causal_attention(q, k, v, off, m.scale)


def _local(m, q, k, v, x, q_pos, off):
    k, v = expand_kv(k, m.n_head), expand_kv(v, m.n_head)
    return windowed_attention(q, k, v, off, m.cfg.window, m.scale)


def _dsa(m, q, k, v, x, q_pos, off):
    cfg = m.cfg
    k, v = expand_kv(k, m.n_head), expand_kv(v, m.n_head)
    T = q.shape[2]
    if cfg.dsa_window == "none":
        y = causal_attention(q, k, v, off, m.scale)
    elif cfg.dsa_window == "fixed":
        y = windowed_attention(q, k, v, off, cfg.window, m.scale)
    else:  # adaptive: queries at positions < dsa_threshold attend to every earlier key
        split = min(T, max(0, cfg.dsa_threshold - int(q_pos[0])))
        parts = []
        if split > 0:
            parts.append(causal_attention(q[:, :, :split], k[:, :, :off + split], v[:, :, :off + split],
                                          off, m.scale))
        if split < T:
            parts.append(windowed_attention(q[:, :, split:], k, v, off + split, cfg.window, m.scale))
        y = parts[0] if len(parts) == 1 else torch.cat(parts, 2)
    if not cfg.dsa_gate:
        return y
    g = torch.sigmoid(m.head_gate(x))  # (B, T, H)
    return y * g.transpose(1, 2).unsqueeze(-1)


def _asga(m, q, k, v, x, q_pos, off):
    cfg = m.cfg
    B, H, T, D = q.shape
    k, v = expand_kv(k, m.n_head), expand_kv(v, m.n_head)
    if cfg.asga_scale:  # alpha = softplus(gamma) q.k / sqrt(d): fold the scale into q
        qs = q * (F.softplus(m.gamma) * m.scale)[None, :, None, None]
    else:
        qs = q * m.scale
    if cfg.asga_gate == "off":
        return causal_attention(qs, k, v, off, 1.0)
    if cfg.asga_gate == "fixed":
        return windowed_attention(qs, k, v, off, cfg.window, 1.0, beyond_window=True)
    q_term, k_term = m.pair_terms(q, k)  # (B, H, T, r), (B, H, S, r)
    y = PairGatedAttention.apply(qs.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                 q_term.flatten(0, 1), k_term.flatten(0, 1),
                                 m.w2.repeat(B, 1), m.b2.repeat(B), off)
    return y.view(B, H, T, D)


def _caa(m, q, k, v, x, q_pos, off):
    cfg = m.cfg
    B, H, T, D = q.shape
    k, v = expand_kv(k, m.n_head), expand_kv(v, m.n_head)
    # A forced gate (g = 1 or 0) skips the branch it multiplies by zero; that branch's own
    # parameters then get no gradient (None) where the reference gives zeros.
    local = glob = None
    if cfg.caa_gate != "global":
        width = cfg.window + (cfg.caa_window_max - cfg.window) * torch.sigmoid(m.width(x))  # (B, T, 1)

        def boundary(band):  # log sigmoid((w_i - (i - j)) / tau) on the band, (B, nb, Bq, L)
            w = F.pad(width[..., 0], (0, band.Tp - band.T)).view(B, band.nb, band.Bq, 1)
            return F.logsigmoid((w - band.dist.to(w.dtype)) / cfg.caa_tau)

        local = windowed_attention(q, k, v, off, cfg.caa_window_max, m.scale, bias_fn=boundary)
    if cfg.caa_gate != "local":
        if cfg.caa_topk == "all":
            glob = causal_attention(q, k, v, off, m.scale)
        else:
            k_per_query = torch.ceil(torch.sqrt(q_pos.float() + 1)).long()  # as in topk_mask
            glob = TopkAttention.apply((q * m.scale).flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                       k_per_query, off).view(B, H, T, D)
    if local is None or glob is None:
        return glob if local is None else local
    g = torch.sigmoid(m.mix_gate(x)).transpose(1, 2).unsqueeze(-1)  # (B, H, T, 1)
    return g * local + (1 - g) * glob


FUSED = {
    CausalSelfAttention: _full,
    LocalAttention: _local,
    DynamicSparseAttention: _dsa,
    ASGAttention: _asga,
    ContextAdaptiveAttention: _caa,
}


def key_offset(q_pos, k_pos):
    """off such that query t sits at key index off + t, or None if the positions are not two
    contiguous runs with every query among the keys."""
    T, S = len(q_pos), len(k_pos)
    p0, k0 = int(q_pos[0]), int(k_pos[0])
    off = p0 - k0
    if off < 0 or off + T > S:
        return None
    if not (torch.equal(q_pos, torch.arange(p0, p0 + T, device=q_pos.device))
            and torch.equal(k_pos, torch.arange(k0, k0 + S, device=k_pos.device))):
        return None
    return off


def attend(module, q, k, v, x, q_pos, k_pos):
    """The fused equivalent of `module.attend(q, k, v, x, q_pos, k_pos)`: (B, H, T, D)."""
    # Only for the exact classes, and not where an instance's `attend` was replaced (a spy, as
    # in analyze.py): a fused path computes its class's `attend`, nobody else's.
    fn = None if "attend" in vars(module) else FUSED.get(type(module))
    off = key_offset(q_pos, k_pos) if fn is not None else None
    if off is None:
        return module.attend(q, k, v, x, q_pos, k_pos)
    return fn(module, q, k, v, x, q_pos, off)


# ---------------------------------------------------------------------------- combiner

COMBINER_CHUNK = 1 << 22  # logits per chunk of blocks (16 MB in float32)


def combiner_blocks(q, k, v, kbar, vbar, first_block, block, scale):
    """Combiner-Fixed's joint softmax (attention.combiner_reference), block by block:
    direct logits (nb, s, s) per head, causal inside each aligned block, and span logits
    (T, R) against the summaries, one softmax over both.

    q (B, H, L, D), k, v (B, Hkv, L, D) at the same positions, the first one the start of block
    `first_block`; kbar (B, Hkv, R, D), vbar (B, H, R, D) summaries of blocks 0 .. R-1. Grouped
    heads share their key head through a (Hkv, g) split of the query heads, no copy. The
    softmax runs in float32 and its result is cast back (bf16-safe). Blocks go through a
    COMBINER_CHUNK of logits at a time; with autograd on and more than one chunk, each chunk
    keeps only its output and recomputes its probabilities in the backward (FlashAttention's
    trade, Dao et al. 2022, through torch.utils.checkpoint): memory O(T D) plus one chunk,
    O(T (s + R)) time."""
    B, H, L, D = q.shape
    Hkv, R = k.shape[1], kbar.shape[2]
    g = H // Hkv
    qb = to_blocks(q * scale, 0, block, 0.0)  # (B, H, nb, s, D); padded rows are dropped at the end
    nb = qb.shape[2]
    qb = qb.view(B, Hkv, g, nb, block, D)
    kb, vb = to_blocks(k, 0, block, 0.0), to_blocks(v, 0, block, 0.0)  # (B, Hkv, nb, s, D)
    vbar = vbar.view(B, Hkv, g, R, vbar.shape[-1])
    step = max(1, COMBINER_CHUNK // (B * H * block * (block + R)))  # blocks per chunk
    run = _combiner_chunk
    if step < nb and torch.is_grad_enabled():
        run = functools.partial(torch.utils.checkpoint.checkpoint, _combiner_chunk, use_reentrant=False)
    out = torch.cat([run(qb[:, :, :, n:n + step], kb[:, :, n:n + step], vb[:, :, n:n + step], kbar, vbar,
                         first_block + n) for n in range(0, nb, step)], dim=3)  # (B, Hkv, g, nb, s, D)
    return out.reshape(B, H, nb * block, -1)[:, :, :L]


def _combiner_chunk(qb, kb, vb, kbar, vbar, first_block):
    """combiner_blocks for the blocks first_block .. of qb (B, Hkv, g, n, s, D) (q scaled)."""
    n, block, R = qb.shape[3], qb.shape[4], kbar.shape[2]
    causal = torch.ones(block, block, dtype=torch.bool, device=qb.device).tril()  # (s, s)
    earlier = (torch.arange(R, device=qb.device)
               < first_block + torch.arange(n, device=qb.device)[:, None])  # (n, R)
    # In place: einsum's backward needs its inputs, not its output.
    direct = torch.einsum("bkgnid,bknjd->bkgnij", qb, kb)  # (B, Hkv, g, n, s, s)
    span = torch.einsum("bkgnid,bkrd->bkgnir", qb, kbar)  # (B, Hkv, g, n, s, R)
    direct.masked_fill_(~causal, NEG_INF)
    span.masked_fill_(~earlier[:, None, :], NEG_INF)
    logits = torch.cat([direct, span], dim=-1)  # (B, Hkv, g, n, s, s + R)
    p = torch.softmax(logits.float(), dim=-1).to(vb.dtype)
    return (torch.einsum("bkgnij,bknjd->bkgnid", p[..., :block], vb)
            + torch.einsum("bkgnir,bkgrd->bkgnid", p[..., block:], vbar))


def combiner_attention(q, k, v, block, scale):
    """Combiner-Fixed (causal) at positions 0 .. T-1, in O(T (s + T/s)) memory:
    q (B, H, T, D), k, v (B, Hkv, T, D) -> (B, H, T, D). The summaries of blocks 0 .. R-1
    (R = block of the last query) come from the reshaped blocks, then `combiner_blocks`."""
    kbar, vbar = combiner_summaries_from_start(q, k, v, block, scale)
    return combiner_blocks(q, k, v, kbar, vbar, 0, block, scale)


def combiner_flex_attention(q, k, v, block, scale, compiled=False):
    """The same function through FlexAttention (the GPU path; its forward also runs on CPU):
    keys [k; kbar], values [v; vbar], and a mask that lets query i see key j < T when j is in
    i's block and j <= i, and summary T + r when r < block(i). The block mask skips the
    tiles outside the blocks, so the work is O(T (s + T/s)) as well, up to FlexAttention's
    128-token tiles. vbar has one head per query head, so grouped key heads are expanded
    here (a copy of k and v). compiled=False runs FlexAttention's unfused eager version
    (it materialises the scores: for tests); True, the torch.compile'd kernel (on CPU the
    forward only, after ~1 min of compiling)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if compiled:
        flex_attention = torch.compile(flex_attention, fullgraph=True)  # compiled once, then cached

    B, H, T, D = q.shape
    kbar, vbar = combiner_summaries_from_start(q, k, v, block, scale)
    R = kbar.shape[2]
    keys = expand_kv(torch.cat([k, kbar], dim=2), H)  # (B, H, T + R, D)
    values = torch.cat([expand_kv(v, H), vbar], dim=2)

    def visible(b, h, i, j):
        direct = (j < T) & (j <= i) & (j // block == i // block)
        span = (j >= T) & (j - T < i // block)
        return direct | span

    mask = create_block_mask(visible, None, None, T, T + R, device=q.device)
    return flex_attention(q, keys, values, block_mask=mask, scale=scale)


def _combiner(m, q, k, v, x, q_pos, off):
    """CombinerAttention.attend, fused; with a KV cache too (its summaries as in the reference)."""
    s = m.cfg.window
    q_start = int(q_pos[0])
    k_start = q_start - off
    kbar, vbar = m.summaries(q, k, v, q_start, k_start)  # reads and extends a KV cache's state
    start = q_start // s * s  # the first query's block starts here: pad the queries back to it
    q = F.pad(q, (0, 0, q_start - start, 0))
    keys = slice(start - k_start, None)  # from the same block start (a cache keeps that block)
    out = combiner_blocks(q, k[:, :, keys], v[:, :, keys], kbar, vbar, start // s, s, m.scale)
    return out[:, :, q_start - start:]


FUSED[CombinerAttention] = _combiner


# ---------------------------------------------------------------------------- benchmark

BENCH = dict(B=1, H=8, D=64, d_model=512, window=256)
VARIANT_NAMES = ("full", "local", "dsa", "asga", "caa")
# The reference's peak memory in units of one fp32 (B, H, T, T) score matrix, plus asga's
# (B, H, T, T, r) pair tensors: measured with this benchmark at T = 1024 and 2048 (3.3 for
# full/local/dsa, 8.8 for caa, 3.1 pair tensors for asga) and rounded up. Used only to skip a
# reference that cannot fit in the memory budget; the row then says OOM, with the prediction.
REF_SCORES = dict(full=4, local=4, dsa=4.5, asga=4, caa=10)
REF_PAIRS = dict(asga=3.5)


def predicted_ref_bytes(variant, T, r=16):
    scores = BENCH["B"] * BENCH["H"] * T * T * 4
    attn = parse_variant(variant)[0]
    return scores * (REF_SCORES[attn] + REF_PAIRS.get(attn, 0) * r)


def parse_variant(spec):
    """'dsa' or 'dsa:dsa_window=fixed,dsa_gate=False' -> ('dsa', {flag: typed value})."""
    from model import ModelConfig

    attn, _, rest = spec.partition(":")
    types = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    flags = {}
    for item in filter(None, rest.split(",")):
        key, value = item.split("=")
        flags[key] = value == "True" if types[key] is bool else types[key](value)
    return attn, flags


def _rss_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def _measure(variant, T, path, threads, budget_s, limit_bytes, conn):
    """Runs in a freshly forked process. Time: forward + backward, the median of the runs
    after the first. Memory: the peak resident set (VmHWM, reset through /proc/self/clear_refs
    once the inputs exist) minus the resident set at that moment: everything the forward and
    backward held at once (saved tensors, transients, gradients), as the OS saw it. A run at
    T = 256 first pages in the code and thread pools, which would otherwise count."""
    try:
        from attention import VARIANTS
        from model import ModelConfig

        torch.set_num_threads(threads)
        if limit_bytes:  # allocations past the budget raise (reported as OOM), not the OOM killer
            with open("/proc/self/statm") as f:
                vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (vm + limit_bytes, vm + limit_bytes))
        torch.manual_seed(0)
        attn, flags = parse_variant(variant)
        cfg = ModelConfig(n_head=BENCH["H"], n_kv_head=BENCH["H"], head_dim=BENCH["D"],
                          d_model=BENCH["d_model"], window=BENCH["window"], attn=attn, **flags)
        module = VARIANTS[attn](cfg)
        for p in module.parameters():
            p.data.normal_(0, 0.1)
        B, H, D = BENCH["B"], BENCH["H"], BENCH["D"]

        def case(n):
            q, k, v = (torch.randn(B, H, n, D, requires_grad=True) for _ in range(3))
            x = torch.randn(B, n, BENCH["d_model"], requires_grad=True)
            pos, cotangent = torch.arange(n), torch.randn(B, H, n, D)
            fn = {"ref": lambda: module.attend(q, k, v, x, pos, pos),
                  "fused": lambda: attend(module, q, k, v, x, pos, pos),
                  "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}[path]

            def step():
                t = time.perf_counter()
                fn().backward(cotangent)
                for tensor in (q, k, v, x, *module.parameters()):
                    tensor.grad = None
                return time.perf_counter() - t
            return step

        case(min(T, 256))()
        step = case(T)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident set to the current one
        base = _rss_kb("VmRSS:")
        warmup, runs = step(), []
        while len(runs) < 5 and not (runs and sum(runs) > budget_s and (len(runs) >= 2 or runs[0] > budget_s / 2)):
            runs.append(step())
        times = [warmup] + runs
        conn.send(dict(ms=1e3 * statistics.median(runs), runs=len(runs),
                       peak_mb=(_rss_kb("VmHWM:") - base) / 1024, all_ms=[round(1e3 * t, 1) for t in times]))
    except Exception as e:  # noqa: BLE001 - reported in the row; an allocation failure is OOM
        message = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        conn.send(dict(oom=isinstance(e, MemoryError) or "allocate" in message, error=message))


def benchmark(lengths, variants, threads, budget_s, max_bytes, paths=("ref", "fused", "sdpa")):
    """[row]: one per (variant, T, path): the attention core alone (the module's `attend`,
    `kernels.attend`, or causal SDPA on the same q, k, v), forward + backward with a random
    cotangent, module parameters random. Each row is measured alone in a forked child process
    (see `_measure`), the three paths of a (variant, T) one after the other so that they
    share the machine's load. A reference predicted past max_bytes is not run: its row says
    oom, with the prediction; one that fails to allocate says oom too.

    threads: torch's intra-op threads. On a 2-core machine shared with other jobs, 2 threads
    make every op wait for a descheduled OpenMP thread: the same case measured 0.14 s and 7 s
    minutes apart. 1 thread gives repeatable numbers there."""
    ctx = multiprocessing.get_context("fork")  # the parent never runs torch ops: fork is safe
    rows = []
    for T in lengths:
        for variant in variants:
            for path in paths:
                row = dict(variant=variant, T=T, path=path, threads=threads, torch=torch.__version__, **BENCH)
                if path == "ref" and predicted_ref_bytes(variant, T) > max_bytes:
                    row.update(ms=None, peak_mb=None, oom=True,
                               error=f"predicted {predicted_ref_bytes(variant, T) / 2**30:.0f} GiB "
                                     f"> {max_bytes / 2**30:.0f} GiB budget")
                else:
                    recv, send = ctx.Pipe(duplex=False)
                    child = ctx.Process(target=_measure, args=(variant, T, path, threads, budget_s,
                                                               max_bytes, send))
                    child.start()
                    child.join()
                    result = recv.recv() if recv.poll() else dict(
                        oom=child.exitcode == -9, error=f"child exited with {child.exitcode}")
                    row.update(dict(ms=None, peak_mb=None), **result)
                rows.append(row)
                shown = "OOM" if row.get("oom") else f"{row['ms']:9.1f} ms {row['peak_mb']:8.1f} MB"
                print(f"  {variant} T={T} {path} {shown}", flush=True)
    return rows


def table(rows):
    """Markdown table: per variant and T, the three paths and the fused path's ratios."""
    get = {(r["variant"], r["T"], r["path"]): r for r in rows}
    fmt = lambda x, f: "—" if x is None else f.format(x)  # noqa: E731
    lines = ["| variant | T | ref ms | fused ms | SDPA ms | ref/fused time | SDPA/fused time "
             "| ref MB | fused MB | SDPA MB | ref/fused mem | fused x time, x mem vs T/2 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for variant in dict.fromkeys(r["variant"] for r in rows):
        for T in sorted({r["T"] for r in rows if r["variant"] == variant}):
            ref, fused, sdpa = (get.get((variant, T, p), {}) for p in ("ref", "fused", "sdpa"))
            half = get.get((variant, T // 2, "fused"), {})
            ratio = lambda a, b: None if a.get("ms") is None or b.get("ms") is None else a["ms"] / b["ms"]  # noqa: E731
            mem = lambda a, b: None if a.get("peak_mb") is None or b.get("peak_mb") is None else a["peak_mb"] / max(b["peak_mb"], 1.0)  # noqa: E731
            growth = "—" if ratio(fused, half) is None else f"{ratio(fused, half):.2f}x, {mem(fused, half):.2f}x"
            lines.append(" | ".join([
                f"| {variant}", str(T), "OOM" if ref.get("oom") else fmt(ref.get("ms"), "{:.0f}"),
                fmt(fused.get("ms"), "{:.0f}"), fmt(sdpa.get("ms"), "{:.0f}"),
                fmt(ratio(ref, fused), "{:.1f}x"), fmt(ratio(sdpa, fused), "{:.1f}x"),
                "OOM" if ref.get("oom") else fmt(ref.get("peak_mb"), "{:.0f}"),
                fmt(fused.get("peak_mb"), "{:.0f}"), fmt(sdpa.get("peak_mb"), "{:.0f}"),
                fmt(mem(ref, fused), "{:.1f}x"), growth]) + " |")
    return "\n".join(lines)


def targets(rows):
    """Issue 4's targets, checked against the rows that exist: [line]."""
    get = {(r["variant"], r["T"], r["path"]): r.get("ms") for r in rows}
    mem = {(r["variant"], r["T"], r["path"]): r.get("peak_mb") for r in rows}
    checks = []

    def check(what, value, ok):
        if value is not None:
            checks.append(f"{'met ' if ok(value) else 'MISSED'} {what}: {value:.2f}")

    def ratio(table, a, b):
        return None if table.get(a) is None or table.get(b) is None else table[a] / table[b]

    check("local T=8192 SDPA/fused time (>= 6)", ratio(get, ("local", 8192, "sdpa"), ("local", 8192, "fused")), lambda x: x >= 6)
    check("local T=8192 ref/fused time (>= 12)", ratio(get, ("local", 8192, "ref"), ("local", 8192, "fused")), lambda x: x >= 12)
    check("local T=8192 ref/fused memory (>= 8)", ratio(mem, ("local", 8192, "ref"), ("local", 8192, "fused")), lambda x: x >= 8)
    for variant in ("local", "dsa"):  # the fused windowed paths
        check(f"{variant} fused time 8192/4096 (<= 2.3)", ratio(get, (variant, 8192, "fused"), (variant, 4096, "fused")), lambda x: x <= 2.3)
        check(f"{variant} fused memory 8192/4096 (<= 2.3)", ratio(mem, (variant, 8192, "fused"), (variant, 4096, "fused")), lambda x: x <= 2.3)
    check("asga T=2048 ref/fused time (>= 2)", ratio(get, ("asga", 2048, "ref"), ("asga", 2048, "fused")), lambda x: x >= 2)
    check("asga T=2048 fused/ref memory (<= 0.1)", ratio(mem, ("asga", 2048, "fused"), ("asga", 2048, "ref")), lambda x: x <= 0.1)
    check("asga T=8192 fused runs, seconds", None if get.get(("asga", 8192, "fused")) is None
          else get[("asga", 8192, "fused")] / 1e3, lambda x: True)
    return checks


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a reduced grid, under a minute")
    parser.add_argument("--out", help="write the raw rows to this JSON file")
    parser.add_argument("--lengths", type=lambda s: [int(t) for t in s.split(",")])
    parser.add_argument("--variants", type=lambda s: s.split(";"),
                        help="';'-separated, each a name with optional flags: 'dsa:dsa_window=fixed;caa'")
    parser.add_argument("--paths", type=lambda s: s.split(","), default=["ref", "fused", "sdpa"])
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (1: repeatable on a shared machine, see `benchmark`)")
    parser.add_argument("--budget", type=float, default=20.0, help="seconds of runs per case, roughly")
    parser.add_argument("--max-gb", type=float, help="memory one case may use (default: 60%% of available)")
    args = parser.parse_args()
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    max_bytes = int(args.max_gb * 2**30) if args.max_gb else int(0.6 * available)
    lengths = args.lengths or ([512, 1024] if args.quick else [1024, 2048, 4096, 8192, 16384])
    variants = args.variants or list(VARIANT_NAMES)
    budget = 0.5 if args.quick else args.budget
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs, "
          f"B={BENCH['B']} H={BENCH['H']} D={BENCH['D']} W={BENCH['window']} fp32, forward+backward, "
          f"memory budget {max_bytes / 2**30:.1f} GiB", flush=True)
    rows = benchmark(lengths, variants, args.threads, budget, max_bytes, args.paths)
    print(table(rows))
    print("\n".join(targets(rows)))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
