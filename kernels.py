"""Fast forms of attention.py's operations, with the same signatures (`Ops`):

  attention(q, k, v, scale, q_start, k_start, window=None, window_from=0, bias=None)
  pair_gated_attention(q, k, v, q_term, k_term, w2, b2, scale, q_start, k_start, gate_space)
  topk_attention(q, k, v, scale, q_start, k_start, k_per_query, k_max)
  combiner_attention(q, k, v, kbar, vbar, scale, q_start, k_start, block)
  block_attention(q, k, v, scale, q_start, k_start, block, blocks)
  selected_attention(q, k, v, scale, q_start, k_start, keys)
  compressed_branch(q, k_cmp, v_cmp, scale, q_start, length, stride, block, choose) (nsa)
  indexer_topk(q_idx, k_idx, w, q_start, k_start, n)                              (indexer)
  indexer_kl(q, k, scale, q_idx, k_idx, w, q_start, k_start, keys)                (indexer)
  mean_pair_gate(q_term, k_term, w2, b2, q_start, k_start)           (asga, recorded statistic)
  top_n(scores, n)                                   (the tie rule of every selection: nsa, moba)

(attention.py documents what each computes; its variants call them through attention.ops,
the one place that picks a set.) Three sets: FLEX (the GPU path), BLOCKWISE (the CPU's) and
DECODE (a call of at most DECODE_ROWS query rows, on any device: a decoding step). Some
stages are shared: nsa's eq. 9 as sliding sums (FLEX's block scores a chunk of queries at a
time), the indexer's top-k and dense-warm-up loss chunked, asga's recorded gate statistic
chunked, so memory stays linear in T (see "both sets" below); the sparse stage of the
indexer's loss differs (FLEX reads the listed keys by index).

FLEX, the GPU path (also forced on any device by kernel='flex'): plain causal attention
through F.scaled_dot_product_attention (flash on CUDA); everything else through
FlexAttention, compiled on CUDA: windows as block masks built once per shape and cached;
dsa's threshold inside its mask; caa's soft window boundary as a score_mod bias; asga's
pair gate as a score_mod over the captured per-query and per-key terms (never a (T, S, r)
tensor); caa's top-k as a per-query threshold (found chunk by chunk without grad, so no
(T, S) tensor is kept) applied in a score_mod; combiner's aligned blocks and summaries as a
block mask over the keys [k; kbar] (the tiles outside the blocks are skipped). q, k, v
enter in one dtype (the autocast dtype under autocast, so bf16 on a GPU); FlexAttention and
SDPA keep their softmax statistics in float32. GQA through the kernels' own support (enable_gqa). On CPU,
FlexAttention runs uncompiled and has no backward for q, k, v (torch raises); gradients
of tensors a score_mod captures (the gates) it does compute. torch.compile of a whole model
traces this path without a graph break (tests/test_kernels.py); on CPU, inductor's C++
FlexAttention template then refuses parts of it (torch 2.13: "epilogue_nodes" for dsa's
gate multiply, "no choices" for the asga and caa score_mods; `local` compiles and matches
the reference to 2e-7), so CPU runs stay uncompiled.
Compiled on a GPU (Triton templates): run on an H100 and an H200 (benchmarks/gpu_runs/, every
CUDA-only test passing), before the selecting variants' gathered forms. What a GPU's compile rejects is
kept out: a score_mod reads each captured tensor that needs a gradient once (`units`), and
by row or key, never by head alone (`per_row`); tests/test_lowering.py checks both on the
joint graphs inductor receives, and benchmarks/gpu_compile/ holds the whole CUDA compile
of every variant for an H100 and an A100, made on a CPU (kernels, shared memory, spills).

BLOCKWISE, the CPU training path (kernel='fused' on CPU): plain PyTorch loops built for a
few CPU cores, in float32 (autocast is switched off inside: CPU bf16 matmuls gain nothing
here and the loops write into float32 buffers):
- causal attention: SDPA, `is_causal` when queries and keys are the same positions.
- windowed attention: `BandAttention`. Queries are cut into blocks of Bq; block b sees a band
  of L = Bq + Wp keys (Wp = the window rounded up to a multiple of Bq), a strided view of the
  keys (no copy). Blocks are processed a cache-sized chunk at a time, as in [Flash]: the
  forward keeps only its output, the backward recomputes each chunk's scores. Time grows as
  T * (Bq + W), memory as T * D. A bias enters as an addition on the band.
- pair-gated attention: `PairGatedAttention`. The gate is built one (query block x key
  chunk) tile at a time, only for keys j <= i, by `GateTile`: compiled with torch.compile
  (the pair MLP's add, GELU and sum over r in one pass, no (T, S, r) hidden tile; eager, in
  reused buffers, where compiling fails, and the run says so once); the forward keeps output
  and row log-sum-exp, the backward recomputes each tile once ([Flash]-2's loop). Memory
  O(T * (D + r)) kept, O(Bq * S) transient; time O(T^2 r).
- top-k attention: `TopkAttention`. Per query block, dense scores pick each query's k_i
  keys; only the chosen indices and probabilities, (T, k_max) per head, are kept.
- combiner attention: `combiner_blocks`. Direct logits (s, s) inside each aligned block of
  s queries and span logits (s, R) against the R block summaries, one softmax: one SDPA
  call (flash on CPU, forward and backward) whose "heads" are the blocks, each over its
  own keys and the summaries, with one (n, s, s + R) mask: time O(T (s + R)), memory
  O(T (s + R)) bools for the mask plus O(T D), never (T, S).
- block attention (nsa's selected branch, moba): `block_dispatch`. The (query, slot) pairs
  are grouped by the (batch, head, block) they chose, as a mixture of experts routes tokens,
  each group cut into tiles of DISPATCH_TILE pairs; one batched matmul per span of tiles
  against their blocks' keys, one softmax per query over its n blocks. Time O(T n block D)
  in matmuls, memory O(T n block) for the probabilities a backward needs; without a
  gradient (a prefill) one span's, each span's logits computed in both of the softmax's
  passes.
- nsa's compressed branch: `CompressedAttention`, one chunk of queries against the compressed
  keys it can see; the chunk's probabilities give its output and its block scores, from
  which it chooses its blocks at once (no (T, J) scores kept); the backward recomputes the
  probabilities. (FLEX: one FlexAttention call for the output, and the block scores
  recomputed a chunk at a time without gradient by `chunked_block_scores`.)
- moba's selection: `chunked_moba_select`, the block scores and their top-n a chunk of
  queries at a time (no (T, J) scores kept).
- selected attention (indexer): `blockwise_selected_attention`. A chunk of queries at a time
  gathers the n keys each lists (shared by the heads of a key head), one softmax; each chunk
  recomputed in the backward. Without a gradient (a prefill) the listed rows are read where
  they lie instead (`listed_rows_attention`, as a decoding step reads them). Time O(T n H D),
  memory O(T D) plus one chunk. While a query sees fewer than SELECTED_DENSE x n keys
  (LISTED_DENSE x n without gradient), SDPA over every visible key with a mask of the listed
  ones instead: more pairs, but each ~27x (~8x) cheaper here than a key read by index.
FLEX's selected attention (`flex_selected_attention`): one FlexAttention call whose mask_mod
reads each query's listed keys as bits and whose query tiles list the key tiles any of their
queries chose: per-token choices touch nearly every tile, so the work is about dense, on
tensor cores (reading the keys by index, O(T n) work, ran 24x flash SDPA's time on an H100).
FLEX's block attention (nsa's selected branch, moba): [MoBA]'s efficient form in one
FlexAttention call (`selection_rows`, `flex_block_attention`). Every (query, key tile it
reads) pair is one row of a virtual query sequence sorted by tile (one sort, a few scatters,
no loop over blocks), each tile's rows starting at a query-tile boundary, so a query tile
lists only the key tiles of its one group; FlexAttention returns each row's output and
log-sum-exp, and a query's rows are merged by their log-sum-exp. Rebuilt in every call (the
selection depends on the data), in a static number of rows (one compile per shape). Work
(tiles x area / keys the definition reads, qwen-134m sizes, random choices, T = 4096 and
16384, one diagonal band of 128-key tiles included): moba 2.4x / 2.5x, nsa 3.4x / 3.9x with
a backward (tiles 128 x 128: sm_90's bf16 backward has no kernel for a smaller key tile),
1.4x and 1.3x without one (key tile = the block); the BlockMask it replaced, the union of a
128-query tile's blocks, listed 9.7x / 36x (moba) and 9.0x / 34x (nsa). Decode-sized calls
run DECODE, which gathers their blocks from the cache (`decode_block_attention`).
FLEX's compressed branch (nsa): one FlexAttention call over the C compressed keys, its
BlockMask cached per shape (the keys read plus a band of boundary tiles: 1.26x at T = 4096,
1.06x at 16384); its block scores and choice, on CUDA, one Triton kernel
(kernels_triton.top_blocks: neither p^cmp nor the block scores in memory). Combiner's BlockMask leaves 2.3x / 2.0x the keys its definition reads (own
block up to the query, one summary per earlier block), 1.35x / 1.19x without the band.

Both need the queries to be the last keys (q_start + T == k_start + S), as in every forward
of model.py. This file imports nothing from attention.py ([Flash] etc. are its references).
The benchmark is benchmarks/attention.py.
"""
import functools
import getpass
import math
import os
import re
import sys
import tempfile
from collections import namedtuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention
from torch.utils._python_dispatch import is_in_torch_dispatch_mode


def inductor_cache_per_cpu_capability():
    """A workaround for torch (2.13), not for the method: inductor keys its on-disk FX-graph
    cache without the CPU capability ATen runs at (ATEN_CPU_CAPABILITY), so a graph compiled
    under one is loaded under another, its C++ rebuilt for the other vector width, and it
    computes garbage (measured on an AVX-512 machine: asga's compiled gate tile gave a NaN
    loss, and once a double free, under =avx2 after a native run; =default failed to
    compile). `.ci/run` reruns the parity tests under =avx2 and =default, so each capability
    gets its own cache directory, <torch's default>-<capability>. Nothing changes where
    TORCHINDUCTOR_CACHE_DIR is set. Runs at import, before anything here compiles. The
    default is named here as torch._inductor.runtime.cache_dir_utils names it (<tmp>/
    torchinductor_<user>): importing that module loads torch._dynamo, 3 s of the 6.6 that
    `import model` took on a CPU, compiling or not (sample.py, evaluate.py, analyze.py;
    train.py until its optimizer: torch.optim's Optimizer imports it)."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        try:
            user = getpass.getuser()
        except (KeyError, ModuleNotFoundError, OSError):
            user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
        default = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
        cap = torch.backends.cpu.get_cpu_capability().lower()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}-{cap}"


inductor_cache_per_cpu_capability()


NEG_INF = float("-inf")
# The operations a variant calls through attention.ops: the core attentions, and the stages of
# a variant that need a fast form (attention.py defines each; its docstring says what it computes).
Ops = namedtuple("Ops", "name attention pair_gated_attention topk_attention combiner_attention block_attention "
                       "selected_attention compressed_branch indexer_topk indexer_kl mean_pair_gate "
                       "top_n moba_select")


def expand_kv(k_BHSD, n_head):
    """Grouped-query attention: repeat each key/value head for the query heads that share it,
    as attention.expand_kv does (a copy: the FlexAttention path uses enable_gqa instead, the
    DECODE path stacks a key head's query heads as rows, `_head_rows`). Without GQA the
    tensor itself, contiguous: repeat_interleave copies even one repeat (at T = 32768 nsa's
    prefill made four such copies a layer, 100 MB each at qwen-134m's 12 heads), while a
    cache that keeps its keys along the positions (`full`'s, asga's) hands over a transposed
    view, which SDPA's flash kernel on a CPU does not take (it needs D contiguous): given one,
    SDPA falls back to its math form, a (T, S) array per head (48 GiB at T = 32768). The
    loops here only read what it returns."""
    G = n_head // k_BHSD.shape[1]
    return k_BHSD.contiguous() if G == 1 else k_BHSD.repeat_interleave(G, dim=1)


def ceil_div(a, b):
    return -(-a // b)


def repeated(blocks):
    """(.., n) bool: the slots of blocks (.., n) that repeat an earlier slot's block (a block
    listed twice counts once)."""
    same = blocks[..., :, None] == blocks[..., None, :]  # [.., s, s']
    return same.tril_(-1).any(-1)  # an equal slot s' < s


def key_offset(q, k, q_start, k_start):
    """Keys before the first query (query t is key off + t); a clear error where the
    queries are not the last keys."""
    T, S = q.shape[2], k.shape[2]
    if q_start + T != k_start + S or k_start > q_start:
        raise ValueError(f"the fused attention paths need the queries to be the last keys: "
                         f"q_start={q_start}, T={T}, k_start={k_start}, S={S}; use kernel='ref'")
    return q_start - k_start


# ---------------------------------------------------------------------------- full causal (both sets)

def causal_attention(q, k, v, off, scale):
    """(B, H, T, D): softmax over keys s <= off + t of q_t . k_s * scale, times v (SDPA, GQA
    through enable_gqa). Query t sits at key index off + t."""
    T, S = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if off == 0 and S == T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if off + T == S and T == 1:  # decoding: the one query sees every cached key
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    # SDPA's is_causal aligns its mask top-left; with a KV cache the queries are the last
    # keys, so pass the (T, S) mask (T is small when there is a cache).
    mask = torch.arange(S, device=q.device) <= off + torch.arange(T, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


# ---------------------------------------------------------------------------- BLOCKWISE: windowed

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
        self.nb = ceil_div(T, self.Bq)
        self.Tp = self.nb * self.Bq  # queries padded to whole blocks
        self.n = ceil_div(window, self.Bq)  # key blocks before the diagonal one
        self.Wp = self.n * self.Bq
        self.L = self.Bq + self.Wp
        self.R = (self.nb + self.n) * self.Bq  # keys one head's bands cover: [off - Wp, off + Tp)
        self.flat = off == 0
        blocks = G * self.nb if self.flat else self.nb  # what one chunk may span
        per_chunk = max(1, self.CHUNK // (self.Bq * self.L))
        self.chunk = ceil_div(blocks, ceil_div(blocks, per_chunk))  # the fewest chunks, of equal size
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
        blocks = min(self.nb, max(0, ceil_div(self.Wp - self.off, self.Bq)))
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
        # as_strided: consecutive bands overlap by Wp rows, which no view() can express
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
        """Index into bias.view(-1, Bq, L) of blocks i0 .. i1-1: bias has a row per head
        (B * H rows), or is shared by the heads of a batch row (B rows), or by all (1 row)."""
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
    chunk, as in [Flash]: the forward keeps only its output, the backward recomputes each
    chunk's probabilities, so no (T, L) tensor outlives a chunk; chunks reuse the same
    buffers (fresh pages cost as much as the matmuls here).

    q (G, T, D) already scaled; k, v (G, S, D); bias None (the window's mask only) or
    (R, nb, Bq, L), R = 1, B or G rows, masking included (see `Band.bias_rows`)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, band):
        Bq, L = band.Bq, band.L
        qb = band.pad_queries(q)  # (G*nb, Bq, D)
        kbuf, vbuf = band.key_buffer(k), band.key_buffer(v)
        o = torch.empty_like(qb)
        work, work_p = qb.new_empty(band.chunk, Bq, L), qb.new_empty(band.chunk, Bq, L)
        for i0, i1 in band.chunks():
            s = band.scores(work[:i1 - i0], qb[i0:i1], kbuf, i0, i1, bias)
            p = _softmax_into(s, work_p[:i1 - i0])
            torch.bmm(p, band.bands(vbuf, i0, i1), out=o[i0:i1])
        ctx.band = band
        ctx.save_for_backward(qb, kbuf, vbuf, o, bias)
        return band.unpad(o)

    @staticmethod
    def backward(ctx, do):
        band = ctx.band
        Bq, L, D = band.Bq, band.L, do.shape[-1]
        qb, kbuf, vbuf, o, bias = ctx.saved_tensors
        do = band.pad_queries(do)  # (G*nb, Bq, D)
        delta = (do * o).sum(-1, keepdim=True)  # sum over keys of p * dp ([Flash]'s D)
        dq, dk, dv = torch.empty_like(qb), torch.zeros_like(kbuf), torch.zeros_like(vbuf)
        d_bias = torch.zeros_like(bias) if ctx.needs_input_grad[3] else None
        work, work_p, work_dp = (qb.new_empty(band.chunk, Bq, L) for _ in range(3))
        # each chunk's key gradients, (chunk, L, D), go in `work` once its scores are spent
        # (D <= Bq), else in a buffer of their own
        work_k = work if D <= Bq else qb.new_empty(band.chunk, L, D)
        for i0, i1 in band.chunks():
            i = slice(i0, i1)
            s = band.scores(work[:i1 - i0], qb[i], kbuf, i0, i1, bias)  # the forward's, again
            p = _softmax_into(s, work_p[:i1 - i0])
            ds = torch.bmm(do[i], band.bands(vbuf, i0, i1).transpose(1, 2), out=work_dp[:i1 - i0])
            ds.sub_(delta[i]).mul_(p)  # d logits
            torch.bmm(ds, band.bands(kbuf, i0, i1), out=dq[i])
            # One (L, Bq) x (Bq, D) matmul per band, then its n + 1 sub-blocks of Bq key rows
            # added where the bands overlap: n + 1 small matmuls on strided slices of p and ds
            # ran at a few GFLOP/s (profiled: baddbmm_ was 40% of the band's time).
            for grad, w, x in ((dv, p, do[i]), (dk, ds, qb[i])):
                g = torch.bmm(w.transpose(1, 2), x, out=work_k.view(-1)[:(i1 - i0) * L * D].view(i1 - i0, L, D))
                for m in range(band.n + 1):  # sub-block m of every band: Bq rows of the key buffer
                    rows = slice(band.row(i0) + m * Bq, band.row(i0) + (i1 - i0 + m) * Bq)
                    grad[rows].view(i1 - i0, Bq, D).add_(g[:, m * Bq:(m + 1) * Bq])
            if d_bias is not None:
                d_bias.view(-1, Bq, L).index_add_(0, band.bias_rows(bias, i0, i1), ds)
        return band.unpad(dq), band.key_grad(dk), band.key_grad(dv), d_bias, None


def _softmax_into(s, out):
    """softmax over the last dim into a reused buffer (out may be s itself: each row is read
    before it is written). The private out= variant: the public torch.softmax allocates,
    and a fresh (chunk, Bq, L) allocation per chunk cost as much as the matmuls here
    (measured)."""
    return torch.ops.aten._softmax.out(s, -1, False, out=out)


# ---------------------------------------------------------------------------- BLOCKWISE: pair-gated

def _mask_future_(logits, t0, off, c0=0):
    """logits (G, bq, c) of queries t0 + a and keys c0 + j: -inf where the key comes after
    the query, c0 + j > off + t0 + a (in place)."""
    bq, c = logits.shape[1:]
    if c0 + c - 1 > off + t0:  # the tile reaches past the diagonal
        a = torch.arange(bq, device=logits.device)[:, None]
        j = torch.arange(c, device=logits.device)
        logits.masked_fill_(c0 + j > off + t0 + a, NEG_INF)
    return logits


def gate_tile_logits(qt, kt, w2):
    """(G, bq, c): sum_r w2[g, r] GELU(qt[g, r, i] + kt[g, r, j]), the gate logit of each
    (query, key) pair of a tile before b2 ([ASGA] eq. 1); qt (G, r, bq), kt (G, r, c), w2
    (G, r). As written it builds the (G, r, bq, c) hidden tensor; torch.compile turns it into
    one loop over (g, i, j) with the sum over r inside, so no hidden tensor is written or
    read back (`GateTile`)."""
    hidden = qt[:, :, :, None] + kt[:, :, None, :]  # (G, r, bq, c)
    return (F.gelu(hidden) * w2[:, :, None, None]).sum(1)


def gate_tile_grads(qt, kt, dz):
    """Gradients of sum(dz * gate_tile_logits(qt, kt, w2)) for dz (G, bq, c), w2 left out of
    the first two (the caller multiplies by it once, outside the loops): (sum_j dz GELU'
    (G, r, bq), sum_i dz GELU' (G, r, c), sum_ij dz GELU (G, r)). Compiled like
    `gate_tile_logits`: reductions over the tile, no (G, r, bq, c) tensor."""
    hidden = qt[:, :, :, None] + kt[:, :, None, :]  # (G, r, bq, c)
    dz = dz[:, None]
    d_hidden = torch.ops.aten.gelu_backward(dz.expand_as(hidden), hidden)
    return d_hidden.sum(3), d_hidden.sum(2), (F.gelu(hidden) * dz).sum((2, 3))


def compiled_helper_usable():
    """Whether this file's torch.compile'd CPU helpers (GateTile, GatheredDots) may be called:
    not under a Python dispatch mode (an op counter, a profiler's or a benchmark's, fake
    tensors), where they run their uncompiled maths. Called once under one, a compiled helper
    ran its later calls uncompiled too, after the mode had ended: the indexer's prefill at
    16384 took 69-76 s after one counted nsa step in the process, against 19 s (benchmarks/
    decode.py counts a step's ops so, and its indexer row at 32768 read 2.5-2.7x `full`'s)."""
    return not is_in_torch_dispatch_mode()


class GateTile:
    """asga's gate over one (query block x key chunk) tile, forward and backward: compiled
    (`gate_tile_logits` and `gate_tile_grads` through torch.compile, inductor's C++ on CPU:
    the pair MLP's add, GELU and contraction with w2 fused into one pass over the tile), or
    eager where compiling is off (GateTile.COMPILE = False), fails, or is inside an outer
    torch.compile (which then traces the eager ops). The eager tile runs op by op through
    (G, r, bq, c) buffers reused across tiles. Which one ran is said once (`path`).

    Why compiled: op by op, every hidden element is written and read back several times
    (add, GELU, contraction; in the backward GELU's derivative and three sums), so the gate
    cost ~10x the q.k^T bmm of the same tile; fused, the loop is bound by GELU's erf
    (benchmarks/train_step.py, README "Performance")."""

    # False: the eager tile always. ASGA_COMPILED_GATE=0 sets it for a process and its children
    # (the test suite does, so that every test process does not pay the compile; tests/
    # test_gate_tile.py turns it back on).
    COMPILE = os.environ.get("ASGA_COMPILED_GATE", "1") != "0"
    TILE = 1 << 21  # eager: elements of one hidden buffer (8 MB), measured best
    SCORES = 1 << 21  # compiled: elements of one (G, bq, c) score tile of the backward
    _compiled = None  # (logits, grads) once compiled; False once compiling failed
    path = None  # 'compiled (torch.compile)' or 'eager (why)', set at first use

    def __init__(self, qt_r, kt_r, w2, n_buffers):
        """qt_r (G, r, T), kt_r (G, r, S) r-major; w2 (G, r); buffers for the eager tile."""
        self.qt_r, self.kt_r, self.w2 = qt_r, kt_r, w2
        G, r = qt_r.shape[:2]
        self.compiled = self._compile() if qt_r.shape[-1] > 1 else None  # decoding: one query, eager
        if self.compiled is None:
            self.chunk = max(16, self.TILE // (G * r * PairGatedAttention.BLOCK))
            self.buffers = [qt_r.new_empty(G * r * PairGatedAttention.BLOCK * self.chunk) for _ in range(n_buffers)]
        else:
            self.chunk = max(16, self.SCORES // (G * PairGatedAttention.BLOCK))

    @classmethod
    def _compile(cls):
        """The compiled (logits, grads), or None (eager). Compiled and run once on a small
        tile at first use, so that a failure (no C++ compiler) shows before any real tile."""
        if torch.compiler.is_compiling():  # traced into the caller's graph (no print: it would break the graph)
            return None
        if not cls.COMPILE:
            cls._say("eager (GateTile.COMPILE is False)")
            return None
        if cls._compiled is None:
            try:
                fns = (torch.compile(gate_tile_logits, dynamic=True), torch.compile(gate_tile_grads, dynamic=True))
                qt, kt, w2, dz = torch.ones(2, 3, 4), torch.ones(2, 3, 5), torch.ones(2, 3), torch.ones(2, 4, 5)
                fns[0](qt, kt, w2), fns[1](qt, kt, dz)
                cls._compiled = fns
            except Exception as e:  # no C++ compiler, an inductor error: the same maths, eager
                cls._failed(e)
        if cls._compiled:
            cls._say("compiled (torch.compile)")
        return cls._compiled or None

    @classmethod
    def _failed(cls, e):
        cls._compiled = False
        cls._say(f"eager (torch.compile failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:160]}; "
                 "a C++ compiler gives the compiled tile)")

    @classmethod
    def _say(cls, path):
        if cls.path != path:
            cls.path = path
            print(f"kernels.py: asga's gate tile: {path}", file=sys.stderr, flush=True)

    @classmethod
    def run_compiled(cls, compiled, which, *args):
        """compiled[which](*args) (0 logits, 1 grads) outside a tile (a decoding step's gate);
        should a new shape fail to compile, the uncompiled function, and the failure said.
        Under a dispatch mode, the uncompiled function (`compiled_helper_usable`)."""
        if not compiled_helper_usable():
            return (gate_tile_logits, gate_tile_grads)[which](*args)
        try:
            return compiled[which](*args)
        except Exception as e:
            cls._failed(e)
            return (gate_tile_logits, gate_tile_grads)[which](*args)

    def _run(self, which, *args):
        """The compiled function `which` (0 logits, 1 grads). Should a later compile fail (a
        new shape), this call finishes with the uncompiled functions and the next calls run
        the eager tile."""
        out = GateTile.run_compiled(self.compiled, which, *args)
        if GateTile._compiled is False:  # failed: this tile's later calls run uncompiled
            self.compiled = (gate_tile_logits, gate_tile_grads)
        return out

    def logits(self, t0, t1, c0, c1):
        """(G, t1 - t0, c1 - c0) gate logits before b2 of queries t0..t1 and keys c0..c1."""
        qt, kt = self.qt_r[:, :, t0:t1], self.kt_r[:, :, c0:c1]
        if self.compiled is not None:
            self.tile = (qt, kt)
            return self._run(0, qt, kt, self.w2)
        G, r = self.qt_r.shape[:2]
        shape = (G, r, t1 - t0, c1 - c0)
        n = shape[0] * shape[1] * shape[2] * shape[3]
        hidden = torch.add(qt[:, :, :, None], kt[:, :, None, :], out=self.buffers[0][:n].view(shape))
        act = torch.ops.aten.gelu.out(hidden, out=self.buffers[1][:n].view(shape))  # out=: no allocation per tile
        self.tile = (hidden, act)
        return torch.bmm(self.w2[:, None, :], act.view(G, r, -1)).view(G, t1 - t0, c1 - c0)

    def grads(self, dz):
        """For dz (G, bq, c), the tile of the last `logits`: (d qt (G, r, bq), d kt (G, r, c))
        without the w2 factor, and d w2 (G, r)."""
        if self.compiled is not None:
            return self._run(1, *self.tile, dz)
        hidden, act = self.tile
        G, r = hidden.shape[:2]
        dw2 = torch.bmm(act.view(G, r, -1), dz.reshape(G, -1, 1)).view(G, r)
        # GELU's derivative times dz, into a reused buffer (the out= form of its backward)
        dh = torch.ops.aten.gelu_backward.grad_input(dz[:, None].expand_as(hidden), hidden,
                                                     grad_input=self.buffers[2][:hidden.numel()].view(hidden.shape))
        return dh.sum(-1), dh.sum(2), dw2


class PairGatedAttention(torch.autograd.Function):
    """y_i = softmax_{s <= off+i}(q_i . k_s * sigmoid(z_is)) v, z_is = w2 . GELU(qt_i + kt_s) + b2
(prob=True: softmax of q_i . k_s + log sigmoid(z_is), the probability-space gate).

    q (G, T, D) already scaled (1/sqrt(d) and softplus(gamma)); k, v (G, S, D); qt (G, T, r),
    kt (G, S, r) the two halves of W1 [LN(q); LN(k)] + b1; w2 (G, r), b2 (G,).
    The gate exists one (query block x key chunk) tile at a time (`GateTile`: compiled,
    no hidden tensor; eager, a (G, r, Bq, chunk) hidden tile in reused buffers). Forward: per
    query block, the gate logits of every visible key, then one softmax; saves output and
    log-sum-exp. Backward, FlashAttention-2 style (Dao 2023): per (query block, key chunk)
    tile, the gate and the probabilities are recomputed from the log-sum-exp and every
    gradient is accumulated from that tile alone: each gate logit is computed twice in all,
    once in the forward, once in the backward."""

    BLOCK = 64  # queries per block

    @staticmethod
    def forward(ctx, q, k, v, qt, kt, w2, b2, off, prob):
        G, T, _ = q.shape
        S = k.shape[1]
        qt_r, kt_r = qt.transpose(1, 2).contiguous(), kt.transpose(1, 2).contiguous()  # (G, r, T|S)
        gate = GateTile(qt_r, kt_r, w2, n_buffers=2)
        o, lse = torch.empty_like(q), q.new_empty(G, T, 1)
        rows = [q.new_empty(G * PairGatedAttention.BLOCK * S) for _ in range(2)]  # (G, bq, K) each
        for t0 in range(0, T, PairGatedAttention.BLOCK):
            t1 = min(T, t0 + PairGatedAttention.BLOCK)
            K = min(S, off + t1)  # keys any query of this block may see
            z = rows[0][:G * (t1 - t0) * K].view(G, t1 - t0, K)
            for c0 in range(0, K, gate.chunk):
                c1 = min(K, c0 + gate.chunk)
                z[:, :, c0:c1] = gate.logits(t0, t1, c0, c1)
            z.add_(b2[:, None, None])
            logits = torch.bmm(q[:, t0:t1], k[:, :K].transpose(1, 2), out=rows[1][:z.numel()].view(z.shape))
            logits = logits.add_(F.logsigmoid(z)) if prob else logits.mul_(torch.sigmoid_(z))
            logits = _mask_future_(logits, t0, off)
            lse[:, t0:t1] = torch.logsumexp(logits, -1, keepdim=True)
            o[:, t0:t1] = torch.bmm(logits.sub_(lse[:, t0:t1]).exp_(), v[:, :K])
        ctx.off, ctx.prob = off, prob
        ctx.save_for_backward(q, k, v, qt_r, kt_r, w2, b2, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, qt_r, kt_r, w2, b2, o, lse = ctx.saved_tensors
        off, prob = ctx.off, ctx.prob
        G, T, _ = q.shape
        S, r = k.shape[1], qt_r.shape[1]
        gate = GateTile(qt_r, kt_r, w2, n_buffers=3)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dqt_r, dkt_r = torch.zeros_like(qt_r), torch.zeros_like(kt_r)  # without the w2 factor
        dw2, db2 = q.new_zeros(G, r), torch.zeros_like(b2)
        delta = (do * o).sum(-1, keepdim=True)  # (G, T, 1): sum over keys of p * dp
        for t0 in range(0, T, PairGatedAttention.BLOCK):
            t1 = min(T, t0 + PairGatedAttention.BLOCK)
            qb, dob = q[:, t0:t1], do[:, t0:t1]
            for c0 in range(0, min(S, off + t1), gate.chunk):
                c1 = min(S, off + t1, c0 + gate.chunk)
                z = gate.logits(t0, t1, c0, c1)
                s = torch.sigmoid(z.add_(b2[:, None, None]))  # (G, bq, c)
                qk = torch.bmm(qb, k[:, c0:c1].transpose(1, 2))
                logits = qk + F.logsigmoid(z) if prob else qk * s
                p = _mask_future_(logits, t0, off, c0).sub_(lse[:, t0:t1]).exp_()
                dv[:, c0:c1] += torch.bmm(p.transpose(1, 2), dob)
                dlogits = torch.bmm(dob, v[:, c0:c1].transpose(1, 2)).sub_(delta[:, t0:t1]).mul_(p)
                dqk = dlogits if prob else dlogits * s
                dq[:, t0:t1] += torch.bmm(dqk, k[:, c0:c1])
                dk[:, c0:c1] += torch.bmm(dqk.transpose(1, 2), qb)
                # d gate logit: d log sigmoid(z) = 1 - s; d (qk * sigmoid(z)) = qk * s * (1 - s)
                dz = dlogits.mul_(1 - s) if prob else dlogits.mul_(qk).mul_(s).mul_(1 - s)
                db2 += dz.sum((1, 2))
                dqt_c, dkt_c, dw2_c = gate.grads(dz)  # d hidden / w2 = dz * GELU'(hidden), summed
                dqt_r[:, :, t0:t1] += dqt_c
                dkt_r[:, :, c0:c1] += dkt_c
                dw2 += dw2_c
        dqt = (dqt_r * w2[:, :, None]).transpose(1, 2)
        dkt = (dkt_r * w2[:, :, None]).transpose(1, 2)
        return dq, dk, dv, dqt, dkt, dw2, db2, None, None


# ---------------------------------------------------------------------------- BLOCKWISE: top-k

class TopkAttention(torch.autograd.Function):
    """y_t = softmax over the k_t highest-scoring keys s <= off + t of q_t . k_s, times v
    (every key tied with the k_t-th kept, attention.topk_mask's tie rule).

    q (G, T, D) already scaled; k, v (G, S, D); k_per_query (T,) long, k_max >= all of
    them (a Python int: no host sync to size the buffers). Per query block the
    dense scores pick the keys (topk) and give their logits; the probabilities are scattered
    into that block's (G, Bq, K) buffer for dense matmuls, which beat gathering the chosen
    keys on CPU. Saves only each query's chosen key indices and probabilities, (G, T, max k)."""

    SCORES = 1 << 22  # elements of one block's (G, Bq, K) scores: 16 MB
    QUERY_BLOCK = 64

    @staticmethod
    def forward(ctx, q, k, v, k_per_query, k_max, off):
        G, T, D = q.shape
        S = k.shape[1]
        o = torch.empty_like(q)
        chosen = []
        # Query blocks of at most 64: block b's scores stop at its last query's key, so the
        # causal triangle's upper half is not scored, top-k'ed, zeroed and multiplied (one
        # block of all T rows did ~1.6x the work at T = 256), and a block's scores stay in cache.
        block = min(TopkAttention.QUERY_BLOCK, max(16, TopkAttention.SCORES // (G * S)))
        work = q.new_empty(G * block * S)  # one buffer for every block: no heap fragments
        for t0 in range(0, T, block):
            t1 = min(T, t0 + block)
            K = min(S, off + t1)
            scores = torch.bmm(q[:, t0:t1], k[:, :K].transpose(1, 2), out=work[:G * (t1 - t0) * K].view(G, t1 - t0, K))
            scores = _mask_future_(scores, t0, off)
            width = min(K, k_max + 1)  # one past every k_t: shows whether a tie runs past the k_t-th
            logits, idx = scores.topk(width, -1)  # (G, bq, width), best first
            k_t = (k_per_query[t0:t1] - 1).clamp(max=width - 1).view(1, -1, 1).expand(G, -1, 1)
            kth = logits.gather(-1, k_t)  # (G, bq, 1): the k_t-th highest score (-inf: fewer keys)
            # attention.topk_mask's tie rule: every key tied with the k_t-th is kept, so where an
            # exact tie runs past the buffer (never, but for equal scores), widen it to the ties
            if width < K and ((logits[..., -1:] >= kth) & (kth > NEG_INF)).any():
                logits, idx = scores.topk(int(((scores >= kth) & (kth > NEG_INF)).sum(-1).max()), -1)
            # A key after the query is never chosen, even where a row has fewer than k_t keys.
            keep = (logits >= kth) & (idx <= off + torch.arange(t0, t1, device=q.device)[:, None])
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
        D = q.shape[-1]
        work_kd = q.new_empty(G * S * D)  # one (G, K, D) key gradient at a time: as large as dk
        for b, (idx, p) in enumerate(ctx.chosen):
            t0 = b * ctx.block
            t1 = t0 + idx.shape[1]
            K = min(S, ctx.off + t1)
            qb, dob = q[:, t0:t1], do[:, t0:t1]
            shape = (G, t1 - t0, K)
            dense = work[:G * (t1 - t0) * K].view(shape).zero_().scatter_(-1, idx, p)
            # bmm into a contiguous buffer, then add: baddbmm_ into the slice dv[:, :K] ran as
            # one addmm_ per row g (profiled: 384 calls, a fifth of the op's time)
            dv[:, :K] += torch.bmm(dense.transpose(1, 2), dob, out=work_kd[:G * K * D].view(G, K, D))
            dp = torch.bmm(dob, v[:, :K].transpose(1, 2), out=work_dp[:dense.numel()].view(shape)).gather(-1, idx)
            dlogits = p * (dp - (dp * p).sum(-1, keepdim=True))  # softmax's backward
            dense.zero_().scatter_(-1, idx, dlogits)
            dq[:, t0:t1] = torch.bmm(dense, k[:, :K])
            dk[:, :K] += torch.bmm(dense.transpose(1, 2), qb, out=work_kd[:G * K * D].view(G, K, D))
        return dq, dk, dv, None, None, None


# ---------------------------------------------------------------------------- BLOCKWISE: combiner

def to_blocks(x_BhLD, block):
    """(B, h, L, D) -> (B, h, n, s, D): zero rows after the L rows, up to n whole blocks of s."""
    pad = -x_BhLD.shape[2] % block
    x = F.pad(x_BhLD, (0, 0, 0, pad)) if pad else x_BhLD  # F.pad would copy even when pad = 0
    return x.unflatten(2, (-1, block))


def combiner_blocks(q, k, v, kbar, vbar, first_block, block, scale):
    """[Combiner]'s joint softmax block by block: direct logits (s, s) inside each aligned
    block, causal, and span logits (s, R) against the summaries, one softmax over both.

    q (B, H, L, D), k, v (B, Hkv, L, D) at the same positions, the first one the start of
    block `first_block`; kbar (B, Hkv, R, D), vbar (B, H, R, D) the summaries of blocks
    0 .. R-1. What it fuses: each block of s queries is one "head" of a single SDPA call
    (flash on CPU too: tiled, forward and backward, no (s, s + R) logits kept) over its own
    s keys followed by the R summaries, with one (n, s, s + R) mask (causal inside the
    block, summary r visible to block n when r < first_block + n). Why: the einsum, mask,
    concatenation and softmax of each block done op by op spent more time copying than
    multiplying (profiled: aten::copy_ was 44% of a training step). The only copies
    left are the summaries repeated once per block, (n, R, D), and GQA's key heads: memory
    O(T D + n R D + T (s + R)) (the mask), time O(T (s + R) D). Without summaries (R = 0:
    one block, as at train.py's CPU preset) it is SDPA's causal attention over each block."""
    B, H, L, D = q.shape
    R = kbar.shape[2]
    qb = to_blocks(q, block)  # (B, H, nb, s, D); padded rows are dropped at the end
    nb = qb.shape[2]
    kb, vb = to_blocks(expand_kv(k, H), block), to_blocks(expand_kv(v, H), block)  # (B, H, nb, s, D)
    if R == 0:
        out = F.scaled_dot_product_attention(qb.flatten(0, 1), kb.flatten(0, 1), vb.flatten(0, 1),
                                             is_causal=True, scale=scale)  # (B*H, nb, s, D)
    else:
        keys = torch.cat([kb, expand_kv(kbar, H)[:, :, None].expand(B, H, nb, R, D)], 3)  # (B, H, nb, s + R, D)
        values = torch.cat([vb, vbar[:, :, None].expand(B, H, nb, R, vbar.shape[-1])], 3)
        causal = torch.ones(block, block, dtype=torch.bool, device=q.device).tril()  # (s, s)
        earlier = (torch.arange(R, device=q.device)
                   < first_block + torch.arange(nb, device=q.device)[:, None])  # (nb, R): spans r < block
        # 4-d: a 3-d mask sends SDPA on CPU to its math path (the whole (s, s + R) logits, op by op)
        mask = torch.cat([causal.expand(nb, block, block), earlier[:, None].expand(nb, block, R)], 2)
        out = F.scaled_dot_product_attention(qb.flatten(0, 1), keys.flatten(0, 1), values.flatten(0, 1),
                                             attn_mask=mask[None], scale=scale)  # (B*H, nb, s, D)
    return out.reshape(B, H, nb * block, -1)[:, :, :L]


# ---------------------------------------------------------------------------- BLOCKWISE: block attention

DISPATCH_TILE = 32  # rows of one tile: each group's pairs are cut into tiles of this many, its last one padded
DISPATCH_PAIRS = 1 << 13  # padded pairs per span of `BlockDispatch`'s loops: 2 MB of float32 query rows at D = 64


def tile_layout(group, G, tile):
    """Where each pair goes when every group's pairs are cut into tiles of `tile` rows, the
    groups in order, each group's last tile padded: group (P,) the sorted pairs' groups
    (ascending), G the number of groups. Returns pos (P,), each pair's row in the padded
    order, and tile_group (M,), each tile's group (M tiles, M x tile rows in all)."""
    sizes = torch.bincount(group, minlength=G)
    tiles = (sizes + tile - 1) // tile
    tile_group = torch.repeat_interleave(torch.arange(G, device=group.device), tiles)
    first = (sizes.cumsum(0) - sizes)[group]  # each pair's group's first sorted position
    pos = ((tiles.cumsum(0) - tiles) * tile)[group] + torch.arange(group.numel(), device=group.device) - first
    return pos, tile_group


class BlockDispatch(torch.autograd.Function):
    """`block_dispatch`'s attention once the (query, slot) pairs are routed: q (BHT, D), its
    rows multiplied by `scale` as a span gathers them (q * scale in whole would be another
    (BHT, D) array, 100 MB at T = 32768 and 12 heads); the key and value blocks kb, vb (G,
    block, D); rows (M x tile,) the query row of each padded pair (BHT: padding), the pairs
    sorted by group and each group's cut into tiles of `tile` rows; tile_group (M,) each
    tile's group (none where no query lists a block); masked (K,), ascending, the padded pairs
    that do not see their whole block (a query's own block, a block that starts before the
    first key, a padding row), and lo, hi (K,) the keys of its block each of them sees, lo <=
    key <= hi (lo > hi for a padding row). Only those rows are masked: every other pair sees
    all its block's keys (nsa at T = 32768: K is ~1/6 of the pairs; masking every row cost
    ~0.4 s of a one-layer prefill's selected branch of 2-3 s).

    Everything stays in the pairs' sorted order, as [MoBA]'s own code keeps it (its varlen
    attention over each block's queries): a span of tiles at a time, its queries' rows
    gathered in one index_select and its tiles' key blocks in another, one batched matmul
    gives its (tiles, tile, block) logits; each query's softmax over its n slots then runs as
    a segmented one, the max over a query's pairs by scatter_reduce (a first pass over the
    spans), the sum by index_add_ (a query that sees no key gets 0, as does a padding row);
    per span its unnormalised probabilities @ its tiles' value blocks in one batched matmul,
    added into its queries' outputs, divided by the sums at the end. One matmul per group
    instead (a Python loop over the (batch, head, block) groups, run on one thread: each tiny
    product handed to a second OpenMP thread cost more than it saved) left one of two cores
    idle: nsa's and moba's training steps at train.py's CPU preset ran at 0.45x and 0.56x of
    `full`'s, 0.59x and 0.81x with the tiles, side by side
    (benchmarks/train_step_regression.md). Placing each pair's logits at its query (a (BHT
    n, block) array, one softmax over each row) took 1.5-1.7x the sorted form.
    With a gradient to take, the logits of every span are kept (M x tile, block), become the
    probabilities the backward uses (rowsum(dP * P) = dO . O for the softmax, [Flash]; no
    segmented op). Without one (a prefill), no (M x tile, block) array exists: each pass
    computes a span's logits again into one span-sized buffer. At T = 32768 (nsa, qwen-134m's
    12 heads) the kept array is 430 MB: without it a one-layer prefill's peak memory fell from
    2.64 to 2.05 GB, its time within the spread (the second pass's products ~0.2 s of it).
    Why a Function: autograd over the span's gathers and matmuls kept every gathered row and
    key block."""

    @staticmethod
    def forward(ctx, q, kb, vb, rows, tile_group, tile, masked, lo, hi, scale):
        BHT, D = q.shape
        M, block = tile_group.numel(), kb.shape[1]
        at = rows.clamp(max=BHT - 1)  # a padding row reads some query's row; its logits are hidden
        step = max(1, DISPATCH_PAIRS // tile)  # tiles per span
        spans = [(m0 * tile, min(M, m0 + step) * tile, m0, min(M, m0 + step)) for m0 in range(0, M, step)]
        # the masked rows of each span: masked[cut[i]:cut[i + 1]] lie in span i
        cut = torch.searchsorted(masked, torch.tensor([r0 for r0, *_ in spans] + [M * tile], device=q.device)).tolist()
        keep = any(ctx.needs_input_grad[:3])
        logits = q.new_empty(M * tile if keep else min(M, step) * tile, block)
        inside = torch.arange(block, device=q.device)

        def span_logits(i, r0, r1, m0, m1):  # span i's masked logits: rows r0 .. r1 - 1 of the padded pairs
            s = logits[r0:r1] if keep else logits[:r1 - r0]
            q_rows = q.index_select(0, at[r0:r1]).mul_(scale).view(m1 - m0, tile, D)
            torch.bmm(q_rows, kb.index_select(0, tile_group[m0:m1]).transpose(1, 2), out=s.view(m1 - m0, tile, block))
            a, b = cut[i], cut[i + 1]
            if b > a:
                part = masked[a:b] - r0
                s[part] = s[part].masked_fill_((inside < lo[a:b, None]) | (inside > hi[a:b, None]), NEG_INF)
            return s

        top = q.new_full((BHT + 1,), NEG_INF)  # each query's max
        for i, (r0, r1, m0, m1) in enumerate(spans):
            top.scatter_reduce_(0, rows[r0:r1], span_logits(i, r0, r1, m0, m1).amax(-1), "amax")
        top.masked_fill_(top == NEG_INF, 0.0)  # a query that sees no key: its logits stay -inf, exp 0
        total, out = q.new_zeros(BHT + 1), q.new_zeros(BHT + 1, vb.shape[-1])
        for i, (r0, r1, m0, m1) in enumerate(spans):
            p = (logits[r0:r1] if keep else span_logits(i, r0, r1, m0, m1)).sub_(top[rows[r0:r1], None]).exp_()
            total.index_add_(0, rows[r0:r1], p.sum(-1))
            out.index_add_(0, rows[r0:r1], torch.bmm(p.view(m1 - m0, tile, block),
                                                     vb.index_select(0, tile_group[m0:m1])).view(-1, D))
        total.clamp_(min=1.0)  # total >= 1 wherever a key is seen (its max term is exp 0)
        out = out[:BHT].div_(total[:BHT, None])
        if keep:
            ctx.save_for_backward(q, kb, vb, logits.div_(total[rows, None]), rows, tile_group, out)
            ctx.tile, ctx.scale = tile, scale
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, kb, vb, p, rows, tile_group, out = ctx.saved_tensors
        BHT, D = q.shape
        M, tile, block = tile_group.numel(), ctx.tile, kb.shape[1]
        at = rows.clamp(max=BHT - 1)
        step = max(1, DISPATCH_PAIRS // tile)
        d_out = d_out.contiguous()
        dot = (d_out * out).sum(-1)  # (BHT,) rowsum(dP * P) of each query's softmax
        dq = q.new_zeros(BHT + 1, D)
        dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)
        p_tiles = p.view(M, tile, block)
        for m0 in range(0, M, step):
            m1 = min(M, m0 + step)
            r, a = rows[m0 * tile:m1 * tile], at[m0 * tile:m1 * tile]
            d_rows = d_out.index_select(0, a).view(m1 - m0, tile, -1)  # a padding row's p is 0: it adds nothing
            q_rows = q.index_select(0, a).mul_(ctx.scale).view(m1 - m0, tile, D)
            kt, vt = kb.index_select(0, tile_group[m0:m1]), vb.index_select(0, tile_group[m0:m1])
            pt = p_tiles[m0:m1]
            dvb.index_add_(0, tile_group[m0:m1], torch.bmm(pt.transpose(1, 2), d_rows))
            d_logits = torch.bmm(d_rows, vt.transpose(1, 2))
            d_logits.sub_(dot[a].view(m1 - m0, tile, 1)).mul_(pt)  # softmax's backward
            dq.index_add_(0, r, torch.bmm(d_logits, kt).view(-1, D))
            dkb.index_add_(0, tile_group[m0:m1], torch.bmm(d_logits.transpose(1, 2), q_rows))
        return dq[:BHT].mul_(ctx.scale), dkb, dvb, *[None] * 7


def block_dispatch(q, k, v, blocks, off, block, first, scale):
    """attention.block_attention for q (B, H, T, D), its logits times `scale`, and k, v (B, H, S, D)
    whose key s sits at absolute position first + s, query t at first + off + t. blocks
    (B, H, T, n): absolute block numbers, -1 = none.

    Routed as a mixture of experts is ([MoBA]'s own reading of its selection): every
    (query, slot) pair joins the pairs that chose the same (batch, head, block), and each
    group's pairs, in tiles of DISPATCH_TILE (`tile_layout`), are (tile, D) @ (D, block)
    products against its block's keys, so a block's keys are read once per tile instead of
    once per query (gathering every query's keys, (T, n * block, D), made this op 10x slower
    than dense causal SDPA at T = 2048). Then one softmax per query over its n * block
    logits, and per tile (tile, block) @ (block, D) into the outputs. Time O(T n block D) in
    batched matmuls, a span of tiles each; memory O(T n block) for the probabilities the
    backward keeps (none without a gradient: one span's), never (T, S). The routing is
    computed here, the attention over the tiles is `BlockDispatch`."""
    B, H, T, D = q.shape
    S, n = k.shape[2], blocks.shape[-1]
    before = first % block  # positions of block first // block that precede the first key
    # (B H apart, block, D): (batch, head) i's block j at row i apart + j, block 0 = first // block
    (kb, apart), (vb, _) = (key_blocks(x, block, before) for x in (k, v))
    nb = ceil_div(before + S, block)
    rel = blocks - first // block  # (B, H, T, n) block index in kb
    ok = (blocks >= 0) & (rel >= 0) & (rel < nb)
    ok = ok & ~repeated(blocks)  # a block listed twice counts once
    group = torch.arange(B * H, device=q.device).view(B, H, 1, 1) * apart + rel.clamp(0, nb - 1)  # (B, H, T, n)
    pair = ok.flatten().nonzero().squeeze(1)  # (P,) valid (query, slot) pairs, index into B * H * T * n
    order = torch.argsort(group.flatten()[pair], stable=True)
    pair = pair[order]
    pos, tile_group = tile_layout(group.flatten()[pair], kb.shape[0], DISPATCH_TILE)
    rows = torch.full((tile_group.numel() * DISPATCH_TILE,), B * H * T, device=q.device)  # B H T: padding
    rows[pos] = pair // n
    # visible: the keys j of a listed block at offsets lo <= j <= hi, lo = first - its start (keys
    # before the first: only in block first // block), hi = the query's position - its start (the
    # query's own block, or a later one); every other listed block is visible whole
    start = (blocks * block).flatten()[pair]
    lo = torch.full_like(rows, block, dtype=torch.int16)  # a padding row: lo = block > hi = -1, every key hidden
    hi = torch.full_like(rows, -1, dtype=torch.int16)
    lo[pos] = (first - start).clamp_(0, block).to(torch.int16)
    hi[pos] = (first + off + pair // n % T - start).clamp_(-1, block - 1).to(torch.int16)
    masked = ((lo > 0) | (hi < block - 1)).nonzero().squeeze(1)  # the pairs that see part of their block
    out = BlockDispatch.apply(q.reshape(B * H * T, D), kb, vb, rows, tile_group, DISPATCH_TILE, masked, lo[masked],
                              hi[masked], scale)
    return out.view(B, H, T, D)


def key_blocks(x, block, before):
    """(x's blocks (rows, block, D), apart): the keys x (B, H, S, D), `before` zero rows put
    ahead of them and zeros after up to whole blocks, as rows of `block` keys, (batch, head) i's
    j-th at row i apart + j. Where no zero row is needed and each head's rows lie `apart` whole
    blocks after the last's, as in a KV cache's buffer, a view of x's memory (no gradient
    taken): in an nsa prefill at T = 32768 (12 heads) the keys' and values' copies were 200 MB
    of fresh memory a layer; otherwise (B H nb, block, D) copied, apart = nb."""
    B, H, S, D = x.shape
    step = x.stride(1) if H > 1 else x.stride(0)  # elements from one (batch, head)'s keys to the next's
    view = (before == 0 and S % block == 0 and x.stride(-1) == 1 and x.stride(-2) == D
            and step % (block * D) == 0 and (B == 1 or x.stride(0) == H * step)
            and not (torch.is_grad_enabled() and x.requires_grad))
    if view:
        apart = step // (block * D) if B * H > 1 else S // block
        return x.as_strided(((B * H - 1) * apart + S // block, block, D), (block * D, D, 1)), apart
    # padded only where the keys do not start at a block (F.pad copies even a pad of 0)
    xb = to_blocks(F.pad(x, (0, 0, before, 0)) if before else x, block)
    return xb.reshape(-1, block, D), xb.shape[2]


# ---------------------------------------------------------------------------- BLOCKWISE: the core ops

def _float32(*tensors):
    """The blockwise loops run in float32 (see the module docstring)."""
    return [t.float() for t in tensors]


def _scaled(q, scale):
    """q * scale, scale a float or one per head (H,), contiguous: the blockwise loops take q
    pre-scaled, and a band's query blocks are a view of it. q from the projections lies
    positions-major ((B, T, H, D) transposed), and q * scale kept that layout, so the bands
    copied it again to make their blocks: one copy (and one fresh 100 MB array at T = 32768,
    12 heads) a window branch saves."""
    s = scale.float()[None, :, None, None] if torch.is_tensor(scale) else scale
    return q * s if q.is_contiguous() else q.contiguous().mul_(s)


def _heads(x, n_head):
    """expand_kv for the loops that only read the keys and values and copy what they need of
    them (a band's key buffer, the selected branch's blocks): without GQA, x as it lies when
    each head's (S, D) rows are contiguous, as a KV cache's view is (its capacity between the
    heads), instead of expand_kv's contiguous copy (two 100 MB copies a branch in an nsa
    prefill at T = 32768, 12 heads)."""
    if n_head == x.shape[1] and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        return x
    return expand_kv(x, n_head)


def blockwise_attention(q, k, v, scale, q_start, k_start, window=None, window_from=0, bias=None):
    """attention.attention: SDPA where no window binds, `BandAttention` where one does."""
    with torch.autocast(q.device.type, enabled=False):
        off = key_offset(q, k, q_start, k_start)
        B, H, T, D = q.shape
        q, k, v = _float32(_scaled(q, scale), _heads(k, H), _heads(v, H))
        # queries before window_from see every earlier key (dsa's adaptive window)
        split = T if window is None else min(T, max(0, window_from - q_start))
        parts = []
        if split > 0:
            parts.append(_banded(q[:, :, :split], k[:, :, :off + split], v[:, :, :off + split],
                                 off, None, bias, 0))
        if 0 < split < T and off == 0 and bias is None:
            # the band of every query, the first split's outputs dropped: without keys before the
            # first query a band's blocks may span heads (`Band.chunks`); the later queries alone
            # start at a real key, and their bands went one head at a time (dsa's CPU training
            # step at train.py's preset: 0.74x `full`'s, its bands' 512 per-head chunks 190 of its
            # 445 ms under torch.profiler; 0.90x in one pass)
            parts.append(_banded(q, k, v, off, window, bias, 0)[:, :, split:])
        elif split < T:
            parts.append(_banded(q[:, :, split:], k, v, off + split, window, bias, split))
        return parts[0] if len(parts) == 1 else torch.cat(parts, 2)


def _banded(q, k, v, off, window, bias, t0):
    """Causal (window None) or windowed attention of q, already scaled (queries t0 .. of the
    caller), with an optional bias(b, h, t, dist), evaluated on the band's geometry."""
    B, H, T, D = q.shape
    if window is None or window >= off + T - 1:
        if bias is None:
            return causal_attention(q, k, v, off, 1.0)
        window = off + T - 1  # a band holding every causal key
    band = Band(B * H, T, k.shape[2], off, window, q.device)
    bias_BnbBqL = None
    if bias is not None:  # bias(b, h, t, dist) on (B or 1, H or 1, nb, Bq, L), heads flattened
        b = torch.arange(B, device=q.device)[:, None, None, None, None]
        h = torch.arange(H, device=q.device)[None, :, None, None, None]
        t = (torch.arange(band.Tp, device=q.device).clamp(max=T - 1) + t0).view(1, 1, band.nb, band.Bq, 1)
        # padded query rows reuse row T-1; rows of the bias: per batch row or per (b, h)
        bias_BnbBqL = band.mask_bias() + bias(b, h, t, band.dist).float().flatten(0, 1)
    out = BandAttention.apply(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), bias_BnbBqL, band)
    return out.view(B, H, T, D)


def blockwise_pair_gated_attention(q, k, v, q_term, k_term, w2, b2, scale, q_start, k_start,
                                   gate_space="logit"):
    """attention.pair_gated_attention through `PairGatedAttention`."""
    with torch.autocast(q.device.type, enabled=False):
        off = key_offset(q, k, q_start, k_start)
        B, H, T, D = q.shape
        q, k, v, q_term, k_term, w2, b2 = _float32(_scaled(q, scale), expand_kv(k, H), expand_kv(v, H),
                                                   q_term, k_term, w2, b2)
        y = PairGatedAttention.apply(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                     q_term.flatten(0, 1), k_term.flatten(0, 1), w2.repeat(B, 1),
                                     b2.repeat(B), off, gate_space == "prob")
        return y.view(B, H, T, D)


def blockwise_topk_attention(q, k, v, scale, q_start, k_start, k_per_query, k_max):
    """attention.topk_attention through `TopkAttention`."""
    with torch.autocast(q.device.type, enabled=False):
        off = key_offset(q, k, q_start, k_start)
        B, H, T, D = q.shape
        q, k, v = _float32(q, expand_kv(k, H), expand_kv(v, H))
        y = TopkAttention.apply((q * scale).flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                k_per_query, k_max, off)
        return y.view(B, H, T, D)


def blockwise_combiner_attention(q, k, v, kbar, vbar, scale, q_start, k_start, block):
    """attention.combiner_attention through `combiner_blocks`: the queries are padded back to
    the start of the first query's block, whose keys must be in k (combiner's KV cache keeps
    them)."""
    with torch.autocast(q.device.type, enabled=False):
        key_offset(q, k, q_start, k_start)
        first = q_start // block * block  # where the first query's block starts
        if first < k_start:
            raise ValueError(f"combiner needs the keys of the first query's block, from position {first}; "
                             f"they start at {k_start}")
        keys = slice(first - k_start, None)
        if q_start > first:
            q = F.pad(q, (0, 0, q_start - first, 0))  # (B, H, q_start - first + T, D)
        q, k, v, kbar, vbar = _float32(q, k[:, :, keys], v[:, :, keys], kbar, vbar)
        return combiner_blocks(q, k, v, kbar, vbar, first // block, block, scale)[:, :, q_start - first:]


def blockwise_block_attention(q, k, v, scale, q_start, k_start, block, blocks):
    """attention.block_attention through `block_dispatch`."""
    with torch.autocast(q.device.type, enabled=False):
        off = key_offset(q, k, q_start, k_start)
        H = q.shape[1]
        q, k, v = _float32(q, _heads(k, H), _heads(v, H))
        return block_dispatch(q, k, v, blocks, off, block, k_start, scale)


# ---------------------------------------------------------------------------- BLOCKWISE: nsa's compressed keys

def _compressed_probs(q, k, scale, q_start, length, stride, group, work=None):
    """(N, G T, C) float32 probabilities of attention.compressed_probs for q (N, G T, D),
    the G = group query heads of a key head stacked along the rows, k (N, C, D): one matmul,
    the invisible keys set to -inf in place (only the columns from the first query's first
    invisible key: the rest every query sees), one softmax in place, the rows that see no
    key set to 0 (the first length - 1 positions: all -inf gives NaN). work: a float32
    buffer of at least N G T C elements the logits and probabilities are written into (the
    caller's, reused chunk after chunk: `blockwise_compressed_branch`), else a new one."""
    N, rows, C = q.shape[0], q.shape[1], k.shape[1]
    T = rows // group
    logits = q.new_empty(N, rows, C) if work is None else work[:N * rows * C].view(N, rows, C)
    torch.bmm(q * scale, k.transpose(1, 2), out=logits)  # (N, G T, C)
    first = _seen(C, q_start, length, stride)  # the keys the chunk's first query sees
    q_pos = torch.arange(q_start, q_start + T, device=q.device)[:, None]
    hidden = torch.arange(first, C, device=q.device) * stride + length - 1 > q_pos  # (T, C - first): not yet complete
    logits = logits.view(N, group, T, C)
    logits[..., first:].masked_fill_(hidden, NEG_INF)
    p = _softmax_into(logits, logits)
    empty = min(T, max(0, length - 1 - q_start))  # queries before the first complete compressed key
    if empty:
        p[:, :, :empty] = 0.0
    return p.view(N, rows, C)


class CompressedAttention(torch.autograd.Function):
    """attention.compressed_branch's output for q (N, T, D), k, v (N, C, D) in float32: returns
    the output (N, T, D) and, when J > 0, the block scores (N, T, J) of the same probabilities
    (`sliding_block_scores`, no gradient: they only choose blocks). Keeps q, k, v and the
    output; the backward recomputes the probabilities once ([Flash]'s recomputation) and uses
    rowsum(dO * O) for the softmax's backward. Why not attention.py's function under a
    checkpoint (what ran before): the checkpoint recomputed the output too, and the
    reference's out-of-place masks and zero-row handling made five passes over each (T, C)
    chunk per direction; here the masking is one in-place pass."""

    @staticmethod
    def forward(ctx, q, k, v, scale, q_start, length, stride, group, block, J, work):
        p = _compressed_probs(q, k, scale, q_start, length, stride, group, work)
        out = torch.bmm(p, v)
        scores = sliding_block_scores(p, J, length, stride, block) if J else out.new_zeros(0)
        ctx.mark_non_differentiable(scores)
        ctx.save_for_backward(q, k, v, out)
        ctx.geometry = scale, q_start, length, stride, group
        return out, scores

    @staticmethod
    def backward(ctx, d_out, _):
        q, k, v, out = ctx.saved_tensors
        scale = ctx.geometry[0]
        p = _compressed_probs(q, k, *ctx.geometry)
        dv = torch.bmm(p.transpose(1, 2), d_out)
        dp = torch.bmm(d_out, v.transpose(1, 2))  # (N, T, C)
        dlogits = dp.sub_((d_out * out).sum(-1, keepdim=True)).mul_(p).mul_(scale)  # softmax's backward, scaled
        return torch.bmm(dlogits, k), torch.bmm(dlogits.transpose(1, 2), q), dv, *[None] * 8


def _grouped(q, k_cmp):
    """q (B, H, T, D) -> (B Hkv, G T, D), the G = H / Hkv query heads of a key head stacked
    along the rows (a view when G = 1), and k_cmp (B, Hkv, C, D) -> (B Hkv, C, D): the
    compressed keys enter as views, never copied per query head (expand_kv), so the chunks
    that each keep the keys they see stay linear in T."""
    B, H, T, D = q.shape
    Hkv = k_cmp.shape[1]
    return q.reshape(B * Hkv, H // Hkv * T, D), k_cmp.flatten(0, 1), H // Hkv


def _blockwise_compressed_chunk(q, k_cmp, v_cmp, scale, q_start, length, stride, block, J, work=None):
    """One chunk of queries of attention.compressed_branch through `CompressedAttention`
    (float32; scale a float): the output (B, H, T, D) and the block scores (B, H, T, J) (J = 0:
    none). No checkpoint needed, the function keeps O(T D)."""
    with torch.autocast(q.device.type, enabled=False):
        B, H, T, D = q.shape
        q, k, v = _float32(q, k_cmp, v_cmp)
        q_rows, k_rows, group = _grouped(q, k)
        out, scores = CompressedAttention.apply(q_rows, k_rows, v.flatten(0, 1), float(scale), q_start, length, stride,
                                                group, block, J, work)
        return out.view(B, H, T, -1), scores.view(B, H, T, J) if J else None


# ---------------------------------------------------------------------------- BLOCKWISE: selected keys

SELECTED_GATHER = 1 << 22  # gathered key elements of one chunk of queries (16 MB in float32)
# Without a gradient (a prefill), a chunk of queries reads its listed rows where they lie
# (`listed_rows_attention`), keeping only (query head, listed key) logits: its chunk is set by
# those pairs, and larger, so that a head's keys are read by many queries in a row while they
# are in cache (the chunk's rows go head by head). At SELECTED_GATHER's chunk (21 queries at
# 12 heads, k = 256) every chunk swept all 12 heads' keys: the indexer's selected attention at
# T = 32768 took 1.5-1.7x this chunk's time (1365 queries).
LISTED_PAIRS = 1 << 22  # (query head, listed key) pairs of one chunk read in place (16 MB of logits)
# Below this many visible keys per listed key, the selected attention runs dense (SDPA over
# every visible key, a mask keeping the listed ones) instead of gathering: on this project's
# CPU a key gathered for the backward cost ~27x a key in SDPA's tiles (116 ns against 4.3 ns a
# (query, key) pair at T = 8192, 12 heads, k = 256: 2.9 s against 1.7 s), so dense is cheaper
# while the mean query sees fewer than ~27 k keys (T < ~14k at k = 256, from the start). Read
# in place without gradient a listed key costs ~8x a pair in SDPA (T = 8192: 0.7-1.1 s
# against 1.7-1.8 s; T = 2048 about even, T = 1024 dense 2x as fast): LISTED_DENSE.
SELECTED_DENSE, LISTED_DENSE = 24, 4
SELECTED_MASK = 1 << 22  # (chunk, S) mask elements of one chunk of queries in the dense form


def blockwise_selected_attention(q, k, v, scale, q_start, k_start, keys):
    """attention.selected_attention: a chunk of queries at a time gathers the n keys each
    lists, (B, Hkv, chunk, n, D), one softmax over them; each chunk checkpointed (its
    gathered keys are rebuilt in the backward, not kept). The heads of a key head share its
    gather (the selection is per query, not per head). Time O(T n H D), memory O(T (H D + n))
    plus one chunk, never (T, S). A key listed twice would count twice (the selection never
    lists one twice). While the keys a query sees are few (SELECTED_DENSE), the dense form
    (`_dense_selected_attention`) instead, whose backward keeps each chunk's (chunk, S) mask:
    T S / 2 bytes in all where it is chosen (33 MB at T = 8192)."""
    with torch.autocast(q.device.type, enabled=False):
        off = key_offset(q, k, q_start, k_start)
        # no gradient (a prefill, an evaluation): the listed rows read where they lie, not copied
        # out and read again (10 of the indexer's 26 s of prefill at T = 16384)
        in_place = not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
        if k.shape[2] - q.shape[2] / 2 <= (LISTED_DENSE if in_place else SELECTED_DENSE) * keys.shape[-1]:
            return _dense_selected_attention(*_float32(q, k, v), scale, off, keys)
        q, k, v = _float32(q * scale, k, v)
        # contiguous once: each chunk reads k, v as rows (a view of a projection's transposed
        # output would be copied whole in every chunk, T / chunk copies: 307 s at T = 32768)
        k, v = k.contiguous(), v.contiguous()
        B, H, T, D = q.shape
        if in_place:
            run, step = listed_rows_attention, max(1, LISTED_PAIRS // (B * H * keys.shape[-1]))
        else:
            run, step = _selected_chunk, max(1, SELECTED_GATHER // (B * k.shape[1] * keys.shape[-1] * D))
            if step < T:
                run = functools.partial(torch.utils.checkpoint.checkpoint, _selected_chunk, use_reentrant=False)
        return torch.cat([run(q[:, :, t0:t0 + step], k, v, keys[:, t0:t0 + step], off + t0)
                          for t0 in range(0, T, step)], dim=2)


def _dense_selected_attention(q, k, v, scale, off, keys):
    """blockwise_selected_attention while the keys a query sees are few (SELECTED_DENSE): a
    chunk of queries at a time, SDPA over every key up to the chunk's last query with a mask
    of the keys each lists and sees. A query that sees none gets 0, as in the reference (its
    row is given its own key to stay finite, then zeroed: a row SDPA sees wholly masked was
    NaN before torch 2.5). Which listed keys count is decided on the (chunk, n) list, then
    scattered once into the (chunk, S) mask: five passes over the mask (comparisons, an any,
    an and, an or) took ~0.45 s of the indexer's 8.6 s prefill at T = 8192, k = 256."""
    B, H, T, D = q.shape
    S = k.shape[2]
    step = max(1, SELECTED_MASK // S)
    out = []
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        last = off + t1  # keys 0 .. last - 1 are visible to some query of the chunk
        listed = keys[:, t0:t1]
        own = off + torch.arange(t0, t1, device=q.device)[:, None]  # each query's own key index
        seen = (listed >= 0) & (listed <= own)
        some = seen.any(-1, keepdim=True)  # (B, c, 1)
        slot = torch.where(seen, listed, last)  # else a spare column, dropped
        slot[..., :1] = torch.where(some, slot[..., :1], own)  # a query seeing none: its own key, zeroed below
        ok = torch.zeros(B, t1 - t0, last + 1, dtype=torch.bool, device=q.device).scatter_(-1, slot, True)[..., :last]
        o = F.scaled_dot_product_attention(q[:, :, t0:t1], k[:, :, :last], v[:, :, :last], attn_mask=ok[:, None],
                                           scale=scale, enable_gqa=H != k.shape[1])
        out.append(o * some[:, None].to(o.dtype))
    return torch.cat(out, 2)


def _selected_chunk(q, k, v, keys, first):
    """blockwise_selected_attention for the queries q (B, H, c, D), scaled, at key indices
    first .. first + c - 1; keys (B, c, n)."""
    B, H, c, D = q.shape
    Hkv = k.shape[1]
    S, n = k.shape[2], keys.shape[-1]
    # rows of k flattened to (B * Hkv * S, D): index_select's backward is an index_add, several
    # times faster on CPU than advanced indexing's accumulating index_put
    rows = (torch.arange(B * Hkv, device=q.device).view(B, Hkv, 1, 1) * S + keys.clamp(min=0)[:, None]).flatten()
    keys_g = k.reshape(-1, D).index_select(0, rows).view(B, Hkv, c, n, D)
    values_g = v.reshape(-1, D).index_select(0, rows).view(B, Hkv, c, n, D)
    logits = torch.einsum("bkgcd,bkcnd->bkgcn", q.view(B, Hkv, H // Hkv, c, D), keys_g)  # (B, Hkv, g, c, n)
    ok = (keys >= 0) & (keys <= first + torch.arange(c, device=q.device)[:, None])  # (B, c, n) visible
    ok = ok[:, None, None]
    some = ok.any(-1, keepdim=True)  # a query with no visible key gets 0, as in the reference
    p = torch.softmax(logits.masked_fill(~ok, NEG_INF).masked_fill(~some, 0.0), -1) * some
    return torch.einsum("bkgcn,bkcnd->bkgcd", p, values_g).reshape(B, H, c, D)


# ---------------------------------------------------------------------------- both sets: stages a chunk of queries at a time
# nsa's compressed branch and block scores, the indexer's scores and its KL loss, and asga's
# recorded gate statistic read every visible key of every query: T^2 by definition, each
# would keep a (T, S) tensor per head (or per indexer head). Here they run a chunk of
# queries at a time, each chunk at most these many elements, so memory stays linear in T.
# Per device: on a GPU the pieces are large (few passes: each is a launch, and in a
# compiled graph unrolled code), on a CPU cache-sized.
COMPRESSED_SCORES = dict(cpu=1 << 22, cuda=1 << 27)  # (B, H, chunk, C) compressed-branch scores
INDEX_SCORES = dict(cpu=1 << 22, cuda=1 << 28)  # (B, chunk, heads, S) indexer scores or main attention logits
RECORD_ELEMENTS = 1 << 20  # (B, H, chunk, S, r) pair-gate hidden units (4 MB in float32)


def query_chunks(T, per_query, budget, device="cpu"):
    """(t0, t1): the T queries in chunks of at most `budget` elements at `per_query` each
    (one query at least). budget: a number, or {device type: number}."""
    if isinstance(budget, dict):
        budget = budget.get(torch.device(device).type, budget["cpu"])
    rows = max(1, budget // per_query)
    return [(t0, min(T, t0 + rows)) for t0 in range(0, T, rows)]


def _softmax_or_zero(logits, mask):
    """attention.softmax_or_zero without its gradient (every caller here runs without one):
    float32 softmax over the allowed entries, 0 for a row with none (mask None: every entry
    allowed). A row with none gives NaN in the softmax, replaced by zeros after it, where the
    definition first set that row's logits to 0 (to keep NaN out of its gradient): four ops
    where it took seven, and a decoding step runs this once per softmax (on a GPU, each op a
    launch). The same bits for every row with an allowed entry. Traced for a CPU, the softmax's
    sum is taken in pieces (`_softmax_in_pieces`)."""
    logits = logits.float() if mask is None else torch.where(mask, logits.float(), NEG_INF)
    in_pieces = torch.compiler.is_compiling() and logits.device.type == "cpu" and logits.shape[-1] > 0
    p = _softmax_in_pieces(logits) if in_pieces else torch.softmax(logits, dim=-1)
    return p if mask is None else torch.where(mask.any(-1, keepdim=True), p, 0.0)


# _softmax_in_pieces: the entries of a row summed SOFTMAX_PIECE at a time, then those sums
SOFTMAX_PIECE = 64


def _softmax_in_pieces(logits):
    """torch.softmax over the last dim, its sum taken over pieces of SOFTMAX_PIECE entries, then
    over the pieces (the row padded with zeros to a whole piece). For a compiled decoding
    step on a CPU, whose rows grow with the cache: inductor's CPU code sums more than 4096
    float32 entries through a cascade helper and guards on the length to choose it, so a
    row crossing 4096 compiled the step anew (nsa's 4096th compressed key, at position
    32783: 51.0 s and 31.5 s in two steps for one layer of qwen-134m's widths, none in
    pieces). Summed in pieces, the row's length reaches that guard at 64 x 4096 entries.
    Equal to torch.softmax to float32 rounding, not to the bit."""
    m = logits.amax(-1, keepdim=True)
    e = (logits - m).exp()
    pieces = F.pad(e, (0, -e.shape[-1] % SOFTMAX_PIECE)).unflatten(-1, (-1, SOFTMAX_PIECE))
    return e / pieces.sum(-1).sum(-1, keepdim=True)


def _seen(C, last, length, stride):
    """How many compressed keys the query at position `last` sees (i stride + length - 1 <= last):
    a chunk of queries needs no more (causal: the rest would be masked)."""
    return min(C, max(0, (last - length + 1) // stride + 1))


def blockwise_compressed_branch(q, k_cmp, v_cmp, scale, q_start, length, stride, block, choose):
    """attention.compressed_branch a chunk of queries at a time (`COMPRESSED_SCORES`): C ~ T /
    stride compressed keys per query would otherwise keep (T, C) per head, memory quadratic in
    T. A chunk takes only the compressed keys its last query can see (half the work over a
    sequence); its probabilities p^cmp, computed once, give both its output and its block
    scores (eq. 9, over the blocks up to its last query), from which `choose` picks its
    blocks at once: no (T, J) scores are kept, and eq. 8 runs once where the output and the
    selection each ran it. `CompressedAttention` recomputes the probabilities in the backward.
    Every chunk's logits, then its probabilities (the softmax in place), go into one buffer
    made for the call: a new (B H, chunk, C) tensor per chunk (16 MB) came back from the
    allocator as fresh pages, faulted in on first touch: in a one-layer nsa prefill at T =
    32768 (qwen-134m widths) the branch took 6.2 s with 785k page faults, 4.6 s with 60k.
    (FLEX: `flex_compressed_branch`.)"""
    B, H, T, _ = q.shape
    C = k_cmp.shape[2]
    outs, blocks = [], []
    chunks = query_chunks(T, B * H * max(1, C), COMPRESSED_SCORES, q.device)
    rows = B * H * max((t1 - t0 for t0, t1 in chunks), default=0)
    work = torch.empty(rows * C, device=q.device)  # every chunk's logits, then its probabilities
    for t0, t1 in chunks:
        seen = _seen(C, q_start + t1 - 1, length, stride)
        J = ceil_div(q_start + t1, block) if choose is not None else 0
        out, scores = _blockwise_compressed_chunk(q[:, :, t0:t1], k_cmp[:, :, :seen], v_cmp[:, :, :seen], scale,
                                                  q_start + t0, length, stride, block, J, work)
        outs.append(out)
        if choose is not None:
            blocks.append(choose(scores, q_start + t0))
    return torch.cat(outs, 2), torch.cat(blocks, 2) if blocks else None


@torch.no_grad()
def chunked_block_scores(q, k_cmp, scale, q_start, length, stride, block, J):
    """The block scores of attention.compressed_branch ([NSA] eqs. 8-9) a chunk of queries at
    a time (`COMPRESSED_SCORES`), for FLEX: the probabilities p^cmp (T x T / stride per head,
    quadratic by definition) exist one chunk at a time, turned at once into the chunk's
    (chunk, J) block scores by `sliding_block_scores`. The query heads of a key head share
    one matmul (`_grouped`)."""
    with torch.autocast(q.device.type, enabled=False):
        B, H, T, D = q.shape
        C = k_cmp.shape[2]
        q, k = _float32(q, k_cmp)
        out = []
        for t0, t1 in query_chunks(T, B * H * max(1, C), COMPRESSED_SCORES, q.device):
            seen = _seen(C, q_start + t1 - 1, length, stride)
            q_rows, k_rows, group = _grouped(q[:, :, t0:t1], k[:, :, :seen])
            p = _compressed_probs(q_rows, k_rows, float(scale), q_start + t0, length, stride, group)
            out.append(sliding_block_scores(p.view(B, H, t1 - t0, seen), J, length, stride, block))
        return torch.cat(out, 2)


def sliding_block_scores(p_cmp, J, length, stride, block):
    """Eq. 9 of attention.compressed_branch, p_cmp (.., C) @ block_overlap(C, J, ...), without
    the (C, J) matrix, in O(C) per query instead of O(C J): at T = 8192 the matmul was 4x the
    FLOPs of the compressed branch's own q k^T (J = T / block columns). Compressed key i covers the
    stride-segments i .. i + covers - 1 (covers = length / stride), each holding stride
    positions worth p_i / stride each, so block j (segments j pb .. j pb + pb - 1, pb = block
    / stride) gets sum_i p_i #(the segments both hold): a weighted sum over the keys j pb -
    covers + 1 .. j pb + pb - 1, with weights ones(covers) convolved with ones(pb) (a
    trapezoid), summed as `width` strided slices of the keys, each added in place with its
    weight over the blocks whose key exists (a matmul over the overlapping windows copied
    them per row, 2.6x slower; the keys zero-padded first, a copy of every probability, and
    a product per slice took 2x this).
    Needs stride | length and stride | block (nsa's check_config)."""
    covers, per_block = length // stride, block // stride
    width = per_block + covers - 1
    C = p_cmp.shape[-1]
    out = p_cmp.new_zeros(*p_cmp.shape[:-1], J)
    for w in range(width):
        shift = w - (covers - 1)  # block j's w-th key: j pb + shift, where 0 <= it < C
        j0 = 0 if shift >= 0 else (per_block - 1 - shift) // per_block
        j1 = min(J, (C - 1 - shift) // per_block + 1) if C - 1 - shift >= 0 else 0
        if j1 > j0:
            first = j0 * per_block + shift
            weight = _trapezoid(w, covers, per_block)
            out[..., j0:j1].add_(p_cmp[..., first:first + (j1 - j0 - 1) * per_block + 1:per_block], alpha=weight)
    return out


def _trapezoid(w, covers, per_block):
    """Eq. 9's weight of a block's w-th overlapping compressed key: ones(covers) convolved
    with ones(per_block) at w."""
    return min(w + 1, covers, per_block, per_block + covers - 1 - w)


def padded_block_scores(p_cmp, J, length, stride, block):
    """`sliding_block_scores` for a decoding step: p_cmp zero-padded to cover every block
    (covers - 1 zeros before it, after it up to J blocks), so each of the `width` slices
    has the same J terms and no bound depends on C or J. The same sums in the same order
    (a padded zero adds nothing), but no Python min or branch on the cache's length: under
    torch.compile those would guard the graph on it, and a decoding step recompiled as it
    grew (dynamo's guards on `min(J, ...)`)."""
    covers, per_block = length // stride, block // stride
    width = per_block + covers - 1
    C = p_cmp.shape[-1]
    padded = F.pad(p_cmp, (covers - 1, J * per_block + per_block - C))  # key i at i + covers - 1
    out = p_cmp.new_zeros(*p_cmp.shape[:-1], J)
    for w in range(width):  # block j's w-th key, j pb + w - (covers - 1), sits at j pb + w
        out.add_(padded[..., w:w + (J - 1) * per_block + 1:per_block], alpha=_trapezoid(w, covers, per_block))
    return out


def _lightning_scores(q_idx, k_idx, w, q_start, k_start):
    """attention.lightning_scores ([DS32] eq. 1) as written there, for a chunk of queries."""
    B, T, J, d = q_idx.shape
    S = k_idx.shape[1]
    dots = torch.einsum("btjd,bsd->btjs", q_idx.float(), k_idx.float()) / math.sqrt(d)  # (B, T, J, S)
    scores = (F.relu(dots) * w.float()[..., None]).sum(2)  # (B, T, S)
    q_pos = q_start + torch.arange(T, device=q_idx.device)[:, None]
    return scores.masked_fill(k_start + torch.arange(S, device=q_idx.device) > q_pos, NEG_INF)  # future keys


# _index_scores' keys per tile, by device: on a CPU a chunk's dots with every key, (chunk J, S)
# (16 MB at 64 queries, S = 16384), streamed through memory in each of their passes (the
# scale, the ReLU, J weighted adds); a tile's, (chunk J, 2048), stay in cache between them.
# On a GPU one product over every key (each tile would be a launch of each op).
INDEX_KEY_TILE = dict(cpu=1 << 11, cuda=1 << 30)


def _scale_on_weights(d):
    """Whether 1 / sqrt(d) is a power of two (d = 4, 16, 64, 256, ...): eq. 1's scale may then
    move from the dots onto the heads' weights without changing a bit of the scores."""
    root = math.isqrt(d)
    return root * root == d and root & (root - 1) == 0


@torch.no_grad()
def _index_scores(q_idx, k_idx, w, q_start, k_start):
    """_lightning_scores without gradient (the selection's): every indexer head's dots in one
    product ((T J, d) rows against the keys: one larger matmul runs faster than J of T rows,
    0.86x side by side at T = 32 rows, S = 32768), scaled and ReLU'd in place, then summed
    with the heads' weights into the (B, T, S) scores: the weighted copies are never made,
    each a pass through memory. The keys are taken a tile at a time (`INDEX_KEY_TILE`): the
    scale, ReLU and sums then read each tile's dots from cache, 0.47-0.58x the time of the
    untiled form on 64 queries x 16384 keys. Per element, the operations and their order are
    those of one head at a time: the same scores in our checks, to the bit. Where 1 / sqrt(d)
    is a power of two (d = 4, 16, 64, 256), the heads' weights take it instead of the dots:
    ReLU(x / sqrt(d)) w = ReLU(x) (w / sqrt(d)) to the bit (a power of two scales a float
    exactly), and the (T J, S) dots skip a pass (0.7 s of the 10 s a layer at T = 32768)."""
    B, T, J, d = q_idx.shape
    S = k_idx.shape[1]
    q_rows, k, w = q_idx.float().reshape(B, T * J, d), k_idx.float(), w.float()
    on_weights = _scale_on_weights(d)
    w = w / math.sqrt(d) if on_weights else w
    scores = q_rows.new_empty(B, T, S)
    for s0, s1 in query_chunks(S, 1, INDEX_KEY_TILE, q_idx.device):  # the keys in tiles
        dots = torch.bmm(q_rows, k[:, s0:s1].transpose(1, 2))
        dots = (dots if on_weights else dots.div_(math.sqrt(d))).relu_().view(B, T, J, s1 - s0)
        out = scores[..., s0:s1]
        torch.mul(dots[:, :, 0], w[:, :, 0, None], out=out)
        for j in range(1, J):
            out.addcmul_(dots[:, :, j], w[:, :, j, None])
    first = max(0, q_start + 1 - k_start)  # the keys before it every query of the call sees
    if first < S:
        q_pos = q_start + torch.arange(T, device=q_idx.device)[:, None]
        scores[..., first:].masked_fill_(k_start + torch.arange(first, S, device=q_idx.device) > q_pos, NEG_INF)
    return scores


# _top_n(narrow=True) on a CPU narrows rows of at least TOP_N_NARROWED x n scores first, in
# calls of at least TOP_N_NARROWED_CALL scores (below, the narrowing's few passes cost more
# than they save). The CPU's sets ask for it (BLOCKWISE, DECODE); FLEX's never does, so that
# the GPU path run on CPU tensors (benchmarks/gpu_cost.py) dispatches what it does on a GPU.
TOP_N_NARROWED, TOP_N_NARROWED_CALL = 8, 1 << 17


# _top_n(narrow=True) on a CPU takes n <= TOP_N_OF_FLOATS (nsa's and moba's blocks) from a
# top-k of the float scores themselves (`_top_n_of_floats`), in calls of at least
# TOP_N_NARROWED_CALL scores: torch's top-k over 4-byte floats ran 2-4x as fast as over the
# 8-byte (score, index) key on rows of 512-1024 block scores (with the key's sort and the tie
# check, 0.55-0.9x the narrowed top-n's time there; on rows of 256, 1.13x in one reading).
TOP_N_OF_FLOATS = 16


# torch's top-k on a CPU takes a row's k highest by a partial sort (a heap of k) when the row
# holds at least 64 k entries, and by nth_element below that: per entry 3-4x slower there on
# rows of random scores (k = 9, nsa's top 8 and one more: 2.8 us a row of 288, 5.5 us one of
# 567, 2.1-2.2 us either padded to 576). `_cpu_topk` pads rows of TOPK_PADDED_FROM k entries
# and more with -inf up to 64 k (below, the padding costs more than it saves: 0.66-0.89x the
# time at 24 k, 1.1-1.6x at 8-16 k, for k = 4, 9 and 17).
TOPK_HEAP, TOPK_PADDED_FROM = 64, 24


# _top_n(maxima=True) (FLEX's) takes n <= TOP_N_BY_MAXIMA as n running maxima of the key: on an
# H200, moba's top-3 through torch.topk (a radix select over int64 keys) was 9.4 of 26.8 ms of
# its core at T = 16384 (benchmarks/gpu_runs/h200_2026-11-28b.md); n reductions, each fused
# with the key's making in a compiled block, read the scores n times instead.
TOP_N_BY_MAXIMA = 4


def _top_n(scores, n, narrow=False, maxima=False):
    """attention.top_n: each row's n highest scores' indices, highest first, ties to the higher
    index, -1 where the score is -inf; one top-k over the same (score, index) key, built in
    place in one int64 buffer (each fresh buffer of the size of the scores costs a pass).
    narrow: on a CPU, rows much longer than n are first narrowed to their candidates
    (`_top_n_narrowed`), except inside a compiled step: the candidates' count is data (a
    nonzero), where dynamo breaks the graph (the indexer's compiled decoding step at batch 8,
    T = 32768: 53 ms with the break, 34 ms with the top-k traced whole; 39 ms eager).
    maxima: n <= TOP_N_BY_MAXIMA as n maxima of the key, each below the last (every key is
    distinct: it holds its index), in place of the top-k."""
    S = scores.shape[-1]
    narrow = narrow and not torch.compiler.is_compiling() and scores.device.type == "cpu"
    if narrow and _floats_top_k(scores, n):
        return _top_n_of_floats(scores, n)
    if narrow and S >= TOP_N_NARROWED * n and scores.numel() >= TOP_N_NARROWED_CALL:
        return _top_n_narrowed(scores, n)
    if S < n:
        scores = F.pad(scores, (0, n - S), value=NEG_INF)
    if maxima and n <= TOP_N_BY_MAXIMA:
        return _top_n_by_maxima(scores, n)
    top = _order_key(scores).topk(n, dim=-1).indices
    return top.masked_fill(scores.gather(-1, top) == NEG_INF, -1)


def _floats_top_k(scores, n):
    """Whether `_top_n(narrow=True)` takes the float scores' top-k (`_top_n_of_floats`): on a CPU,
    outside a compiled step, n below the row's length and at most TOP_N_OF_FLOATS."""
    return (not torch.compiler.is_compiling() and scores.device.type == "cpu" and n < scores.shape[-1]
            and n <= TOP_N_OF_FLOATS and scores.numel() >= TOP_N_NARROWED_CALL)


def _order_key(scores):
    """attention.top_n's int64 key of each score, (score's ordered bits, index): the bits
    ordered as int32, in place, and widened once, by the one add that writes the key (the
    int32 times 2^32 plus the index; where the wide key was built first and then shifted and
    or-ed in place, each of those passes moved twice the bytes: 0.54-0.68x the time for rows
    of 32768 scores)."""
    return torch.add(torch.arange(scores.shape[-1], device=scores.device), _ordered_bits(scores), alpha=1 << 32)


def _ordered_bits(scores):
    """Each float32 score's bits as an int32 ordered as the scores are (-0.0 made 0.0)."""
    bits = (scores.detach().float() + 0.0).view(torch.int32)  # -0.0 made 0.0
    bits ^= (bits >> 31).bitwise_and_(0x7FFFFFFF)  # negative floats: their 31 magnitude bits flipped
    return bits


_NEG_INF_BITS = int(_ordered_bits(torch.tensor([NEG_INF])))  # -inf's, the lowest of every score


def _top_n_by_maxima(scores, n):
    """_top_n's result as n maxima of the (score, index) key, the i-th the largest key below
    the (i-1)-th: the key is attention.top_n's, so the order and the ties are too."""
    key = _order_key(scores)
    tops = [key.amax(-1)]
    for _ in range(n - 1):  # the maxima found so far out, in place (a copy of the key is a pass)
        tops.append(key.masked_fill_(key >= tops[-1][..., None], torch.iinfo(torch.long).min).amax(-1))
    top = torch.stack(tops, -1) & 0xFFFFFFFF  # the index: the key's low 32 bits
    return top.masked_fill(scores.gather(-1, top) == NEG_INF, -1)


def _top_n_of_floats(scores, n):
    """_top_n's result from a top-k of the float scores (n + 1 of them, highest first; rows
    padded to torch's faster sort, `_cpu_topk`), for n < the row's length: where the n-th
    score is above the next, the n listed are the row's n highest whatever the order of equal
    scores, and their keys sorted give the order (ties to the higher index); a row whose n-th
    score equals the next (a tie across the cut), or with a NaN among them, takes the key's
    top-k. A row's -inf scores are -1, as ever."""
    S = scores.shape[-1]
    s = scores.detach().float().reshape(-1, S)
    values, cols = _cpu_topk(s, n + 1)
    cut, next_ = values[:, n - 1], values[:, n]
    # equal -inf scores list -1 either way; a NaN ranks by its sign bit in the key, first in torch's top-k
    across = ((cut == next_) & (cut != NEG_INF)) | values.isnan().any(-1)
    key = torch.add(cols[:, :n], _ordered_bits(values[:, :n]), alpha=1 << 32).sort(-1, descending=True).values
    top = (key & 0xFFFFFFFF).masked_fill_(key >> 32 == _NEG_INF_BITS, -1)  # the index: the key's low 32 bits
    if across.any():
        rows = across.nonzero()[:, 0]
        top[rows] = _top_n(s[rows], n)
    return top.view(*scores.shape[:-1], n)


def _cpu_topk(s, k):
    """s.topk(k, -1) for s (R, S) float32 on a CPU, a row of TOPK_PADDED_FROM k .. 64 k entries
    padded with -inf to 64 k first (`TOPK_HEAP`): the same k highest values, highest first, and
    their columns, but where fewer than k are finite the -inf ones may list a padded column
    (>= S): the callers turn every -inf slot into -1."""
    S = s.shape[-1]
    if TOPK_PADDED_FROM * k <= S < TOPK_HEAP * k:
        s = F.pad(s, (0, TOPK_HEAP * k - S), value=NEG_INF)
    return s.topk(k, -1)


def _top_n_narrowed(scores, n):
    """_top_n's result, for rows much longer than n: each row narrowed first to the scores
    that reach a threshold at least n of them reach (the n-th highest of the maxima of 4 n
    groups of the row, group g the columns g, g + 4 n, ...: n groups hold a score at least
    that high), so every score above or tied with the n-th highest is a candidate; then
    _top_n over the candidates alone, packed in column order (so ties still go to the
    higher index) and padded with -inf to the longest row's count. A top-k costs ~4 ns a
    score on this project's CPU (torch's partial sort); the group maxima (a reduction across
    rows of 4 n contiguous scores), the comparison and the packing a fraction of that, and
    the candidates are a few times n: 3.5x faster on 64 rows of 16384 scores at n = 256, the
    indexer's prefill. (A NaN score is never a candidate.)"""
    S = scores.shape[-1]
    s = scores.detach().float().reshape(-1, S)
    R, G = s.shape[0], 4 * n
    maxima = s[:, :S // G * G].view(R, S // G, G).amax(1)  # (R, G): the columns past the last whole row of groups left out
    threshold = maxima.topk(n, -1, sorted=False).values.amin(-1, keepdim=True).nan_to_num(nan=NEG_INF)
    rows, cols = (s >= threshold).nonzero(as_tuple=True)  # row-major: each row's candidates in column order
    count = torch.bincount(rows, minlength=R)  # at least n a row, ties with the n-th included
    slot = torch.arange(rows.numel(), device=s.device) - (count.cumsum(0) - count)[rows]
    at = torch.zeros(R, max(n, int(count.max())), dtype=torch.long, device=s.device)
    at[rows, slot] = cols
    values = torch.full(at.shape, NEG_INF, device=s.device)
    values[rows, slot] = s[rows, cols]
    top = _top_n(values, n, narrow=False)  # positions among the candidates, -1 where -inf
    return torch.where(top >= 0, at.gather(-1, top.clamp(min=0)), -1).view(*scores.shape[:-1], n)


TOP_N_ELEMENTS = 1 << 18  # chunked_top_n: scores of one chunk of rows (its int64 key: 2 MB, cache-sized)


def chunked_top_n(scores, n):
    """attention.top_n a chunk of rows at a time (BLOCKWISE: the CPU's), so that each pass of
    `_top_n` over its int64 key stays in cache instead of streaming (T, J) tensors through
    memory (nsa's and moba's block scores, T x T / block per head). Where `_top_n` takes the
    float scores' top-k (`_top_n_of_floats`: n <= TOP_N_OF_FLOATS), no key of the rows is
    built and torch's top-k goes row by row: all the rows in one call (nsa's prefill at T =
    32768 cut its choice's 393k rows into 1536 calls of ~15 ops each)."""
    flat = scores.reshape(-1, scores.shape[-1])
    step = max(1, TOP_N_ELEMENTS // max(1, flat.shape[-1]))
    if step >= flat.shape[0] or _floats_top_k(flat, n):
        return _top_n(scores, n, narrow=True)
    return torch.cat([_top_n(flat[r:r + step], n, narrow=True)
                      for r in range(0, flat.shape[0], step)]).view(*scores.shape[:-1], n)


@torch.no_grad()
def chunked_indexer_topk(q_idx, k_idx, w, q_start, k_start, n, narrow=False):
    """attention.indexer_topk a chunk of queries at a time (`INDEX_SCORES`): the (B, T, J, S)
    scores never exist at once, and a chunk scores only the keys up to its last query (the
    later ones it cannot see: half of the causal square). narrow: `_top_n`'s (BLOCKWISE's)."""
    B, T, J, _ = q_idx.shape
    S = k_idx.shape[1]
    chunks = query_chunks(T, B * J * S, INDEX_SCORES, q_idx.device)
    return torch.cat([_top_n(_index_scores(q_idx[:, t0:t1], k_idx[:, :q_start + t1 - k_start], w[:, t0:t1],
                                           q_start + t0, k_start), min(n, S), narrow) for t0, t1 in chunks], dim=1)


def _kl_chunk(q, k, scale, q_idx, k_idx, w, q_start, k_start, keys):
    """The sum over a chunk's queries of attention.indexer_kl's KL(p_t || softmax(I_t)), as
    written there."""
    S = k.shape[2]
    scores = _lightning_scores(q_idx, k_idx, w, q_start, k_start)  # (B, c, S), -inf where not visible
    with torch.no_grad():
        logits = (q.detach().float() @ expand_kv(k.detach().float(), q.shape[1]).transpose(-2, -1)) * scale
        visible = scores.isfinite()[:, None]  # (B, 1, c, S)
        if keys is not None:
            slot = torch.where(keys < 0, S, keys)
            chosen = torch.zeros(*keys.shape[:2], S + 1, dtype=torch.bool, device=q.device)
            visible = visible & chosen.scatter_(-1, slot, True)[..., :S][:, None]
        p = _softmax_or_zero(logits, visible).mean(1)  # (B, c, S)
    log_i = torch.log_softmax(scores.masked_fill(~visible[:, 0], NEG_INF), dim=-1)
    return (torch.xlogy(p, p) - p * log_i.masked_fill(p == 0, 0.0)).sum()


def chunked_indexer_kl(q, k, scale, q_idx, k_idx, w, q_start, k_start, keys):
    """attention.indexer_kl a chunk of queries at a time (`INDEX_SCORES`), each chunk
    checkpointed, so no (T, S) tensor per head is kept for the backward."""
    B, H, T, _ = q.shape
    S, J = k.shape[2], q_idx.shape[2]
    run = _kl_chunk
    if torch.is_grad_enabled():
        run = functools.partial(torch.utils.checkpoint.checkpoint, _kl_chunk, use_reentrant=False)
    total = 0.0
    for t0, t1 in query_chunks(T, B * max(H, J) * S, INDEX_SCORES, q.device):
        total = total + run(q[:, :, t0:t1], k, scale, q_idx[:, t0:t1], k_idx, w[:, t0:t1], q_start + t0, k_start,
                            None if keys is None else keys[:, t0:t1])
    return total / (B * T)


@torch.no_grad()
def chunked_mean_pair_gate(q_term, k_term, w2, b2, q_start, k_start):
    """attention.mean_pair_gate a chunk of query rows at a time: besides the (B, H, T, r) and
    (B, H, S, r) terms the forward builds anyway, two (B, H, rows, S, r) transients at a time
    (the hidden units and their w2-weighted copy) of at most max(RECORD_ELEMENTS, B H S r)
    elements each: 4 MB each in float32 when RECORD_ELEMENTS binds; at T = 2048, B = 16 with
    the qwen-134m shapes and r = 16 (one query row per chunk), 25 MB each. Not the
    (B, H, T, S, r) pair tensor (at T = 2048 with those shapes: 3.2 GB per sequence)."""
    B, H, T, r = q_term.shape
    S = k_term.shape[2]
    w2, b2 = w2.float()[None, :, None, None], b2.float()[None, :, None, None]
    out = []
    for t0, t1 in query_chunks(T, B * H * S * r, RECORD_ELEMENTS):
        hidden = F.gelu(q_term[:, :, t0:t1, None, :].float() + k_term[:, :, None, :, :].float())  # (B, H, rows, S, r)
        s = torch.sigmoid((hidden * w2).sum(-1) + b2)  # (B, H, rows, S), [ASGA] eq. 1
        dist = (q_start + torch.arange(t0, t1, device=s.device)[:, None]) - (k_start + torch.arange(S, device=s.device))
        visible = dist >= 0
        out.append((s * visible).sum(-1) / visible.sum(-1))
    return torch.cat(out, 2).transpose(1, 2)  # (B, T, H)


def moba_select(q, means, q_start, block, topk, select=None):
    """attention.moba_select ([MoBA] eqs. 5-6) with this file's helpers and a path's top-n
    (`select`, an Ops' top_n): the (B, H, T, J) scores q . K_bar in float32, the own block
    forced, the earlier ones ranked."""
    B, H, T, D = q.shape
    J = ceil_div(q_start + T, block)
    with torch.autocast(q.device.type, enabled=False):  # float32 under autocast too
        scores = (_head_rows(q.detach().float(), means.shape[1]) @ means.detach().float().transpose(-2, -1))
    scores = F.pad(scores.view(B, H, T, means.shape[2]), (0, J - means.shape[2]))  # the incomplete block: forced only
    own = torch.arange(q_start, q_start + T, device=q.device)[:, None] // block
    j = torch.arange(J, device=q.device)
    fill = torch.where(j == own, float("inf"), NEG_INF).to(scores.dtype)
    return select(torch.where(j < own, scores, fill, out=scores), topk)


MOBA_SCORES = 1 << 22  # (B, H, chunk, J) block scores of one chunk of queries in `chunked_moba_select`


def chunked_moba_select(q, means, q_start, block, topk):
    """`moba_select` a chunk of queries at a time (BLOCKWISE): the (B, H, T, J) scores, T x T /
    block a head, exist one cache-sized chunk at a time (at T = 32768, 12 heads and blocks of
    64, the whole was 0.8 GB, and its padded copy as much again)."""
    B, H, T, _ = q.shape
    chunks = query_chunks(T, B * H * max(1, ceil_div(q_start + T, block)), MOBA_SCORES, q.device)
    return torch.cat([moba_select(q[:, :, t0:t1], means[:, :, :ceil_div(q_start + t1, block)],  # the blocks it can see
                                  q_start + t0, block, topk, select=chunked_top_n) for t0, t1 in chunks], 2)


BLOCKWISE = Ops(
    name="blockwise (kernels.py, CPU loops, float32)", attention=blockwise_attention,
    pair_gated_attention=blockwise_pair_gated_attention, topk_attention=blockwise_topk_attention,
    combiner_attention=blockwise_combiner_attention, block_attention=blockwise_block_attention,
    selected_attention=blockwise_selected_attention, compressed_branch=blockwise_compressed_branch,
    indexer_topk=functools.partial(chunked_indexer_topk, narrow=True), indexer_kl=chunked_indexer_kl,
    mean_pair_gate=chunked_mean_pair_gate, top_n=chunked_top_n,
    moba_select=chunked_moba_select)


# ---------------------------------------------------------------------------- FLEX: the core ops

COMPILE_FLEX = None  # compile FlexAttention and the gathers: None = on CUDA only; True/False forces it (tests)
_compiled = {}  # function -> its compiled form, made on first use by `compile_fn`
compile_fn = functools.partial(torch.compile, dynamic=False)
# The compiles one process may make of each function: one per shape and score_mod. dynamo's
# own limit, 8, is reached by a process that prefills a few prompt lengths with a few
# variants, and past it dynamo runs the function uncompiled, silently: for FlexAttention that
# materialises the (T, S) scores (on an H100, benchmarks/decode.py asked for 574 GiB at
# T = 32768). Past this limit the call fails instead, saying so.
RECOMPILE_LIMIT = 64


def compiled_on_gpu(fn, q):
    """fn compiled where the GPU path compiles (CUDA, or COMPILE_FLEX forced) outside an outer
    torch.compile (inside one, the plain function is traced into that graph); fn itself
    elsewhere. (Decode-sized calls never come here: attention.ops gives them DECODE.)"""
    if (q.device.type == "cuda" if COMPILE_FLEX is None else COMPILE_FLEX) and not torch.compiler.is_compiling():
        if fn not in _compiled:
            _compiled[fn] = _never_uncompiled(compile_fn(fn), fn.__name__)
        return _compiled[fn]
    return fn


def _never_uncompiled(compiled, name):
    """compiled, allowed RECOMPILE_LIMIT compiles, and an error past them where dynamo would
    fall back to running the function eagerly."""
    def call(*args, **kwargs):
        try:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
                return compiled(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as e:
            raise RuntimeError(
                f"{name} has been compiled for {RECOMPILE_LIMIT} shapes or score_mods in this process "
                f"(kernels.RECOMPILE_LIMIT), and run uncompiled it would materialise every score; raise "
                f"kernels.RECOMPILE_LIMIT, or call it with fewer distinct lengths (pad prompts to a few)") from e
    return call


_block_masks = {}  # (T, S, q_start, k_start, window, window_from, device) -> BlockMask
MAX_CACHED_MASKS = 64  # a prefill per prompt length makes a shape each: keep the cache bounded


def _run_flex(q, k, v, score_mod, mask, scale, lse=False, kernel_options=None):
    """FlexAttention, compiled on CUDA (uncompiled, it materializes the scores); inside an
    outer torch.compile the plain function is traced into that graph instead. Triton tile sizes for its kernels come as kernel_options,
    or in a score_mod's `kernel_options` attribute (`PAIR_GATE_TILES`). lse: also return each
    row's log-sum-exp (B, H, T) float32, natural log, -inf for a row that sees no key (and
    whose output is 0); it differentiates."""
    fn = compiled_on_gpu(flex_attention, q)
    options = kernel_options or getattr(score_mod, "kernel_options", None)
    aux = dict(return_aux=AuxRequest(lse=True)) if lse else {}
    out = fn(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
             kernel_options=options, **aux)
    return (out[0], out[1].lse) if lse else out


def _same_dtype(*tensors):
    """FlexAttention and SDPA want q, k, v of one dtype: the autocast dtype under autocast
    (RMSNorm and RoPE hand back float32 q, k beside a bf16 v), else the widest."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
    return [t.to(dtype) for t in tensors]


def block_mask(T, S, q_start, k_start, window, window_from, device):
    """FlexAttention's block mask of `allowed` (causal, windowed for queries at positions
    >= window_from), built once per shape and cached (rebuilt in a compiled graph, where
    building it is part of the graph)."""
    def mask_mod(b, h, i, j):
        dist = (q_start + i) - (k_start + j)
        keep = dist >= 0
        if window is not None:
            near = dist <= window
            if window_from > 0:
                near = near | (q_start + i < window_from)
            keep = keep & near
        return keep

    return cached_block_mask((T, S, q_start, k_start, window, window_from), mask_mod, T, S, device)


def cached_block_mask(key, mask_mod, T, S, device):
    """create_block_mask(mask_mod) over (T, S), built once per `key` (the shape and rule) and
    cached; rebuilt in a compiled graph, where building it is part of the graph."""
    if torch.compiler.is_compiling():
        return create_block_mask(mask_mod, None, None, T, S, device=device)
    key = key + (str(device),)
    if key not in _block_masks:
        if len(_block_masks) >= MAX_CACHED_MASKS:
            _block_masks.clear()
        _block_masks[key] = create_block_mask(mask_mod, None, None, T, S, device=device)
    return _block_masks[key]


def per_row(x, B, T):
    """(B, H, T, ...) contiguous copy of a per-head tensor x (H, ...): one element per query
    row, for a score_mod to read at [b, h, i]. Why: on CUDA, the gradient of a captured
    tensor is an atomic add from every score that reads it into the element it reads. Read
    by head alone (w2[h], b2[h], scale[h]), one element takes the adds of B * T * S scores
    (millions at T = 1024); read by row, those of one query's keys. Autograd then sums the
    rows outside the kernel (the expand's backward)."""
    return x[None, :, None].expand(B, -1, T, *x.shape[1:]).contiguous()


def units(x):
    """x (..., r) -> r contiguous tensors (...): inductor allows a score_mod to index a
    captured tensor that needs a gradient only once (torch 2.13, validate_joint_graph in
    torch/_inductor/kernel/flex/flex_attention.py raises NotImplementedError otherwise, at
    the first backward on a GPU), so a score_mod that loops over hidden units reads one
    tensor per unit."""
    return x.movedim(-1, 0).contiguous().unbind(0)


def log_sigmoid(z):
    """log sigmoid(z), for score_mods and biases: F.logsigmoid on a plain CPU tensor, else
    -softplus(-z). Why: on CUDA, F.logsigmoid's op returns a second, empty output ("buffer"),
    and the vmap that uncompiled FlexAttention runs a score_mod under (kernel=flex off CUDA,
    or with its compile off) fails on it ("SmallVector unable to grow", torch 2.11 on an H100); so
    -softplus(-z) wherever a score_mod may run: on a GPU, under a functorch transform (vmap)
    or while compiling. On a CPU that buffer is full-sized, so the failure cannot happen there
    (tests/test_kernels.py re-creates it by giving the CPU op CUDA's empty buffer), and the
    blockwise path evaluates a bias (caa's soft window edge) once on whole (B H, blocks, Bq,
    L) bands, where -softplus(-z) is three passes each way and F.logsigmoid one (at train.py's
    CPU preset, 4.7M elements a layer: 11 ms forward and backward against 21-63 ms, 2 threads,
    i.e. 2-10% of caa's step; benchmarks/train_step_regression.md).
    softplus returns its input x above `threshold`, dropping log1p(e^-x), <= 4.3e-18 from
    x = 40 on: below float64's resolution of x, so both forms equal log sigmoid in float64 too
    (at the default threshold, 20, it is off by 1e-10 relative)."""
    if z.device.type == "cpu" and not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active():
        return F.logsigmoid(z)
    return -F.softplus(-z, threshold=40.0)


def flex_attention_op(q, k, v, scale, q_start, k_start, window=None, window_from=0, bias=None):
    """attention.attention: flash SDPA where no window, bias or per-head scale applies,
    else FlexAttention with the cached block mask and a score_mod for the bias and scale."""
    B, H, T = q.shape[:3]
    S = k.shape[2]
    q, k, v = _same_dtype(q, k, v)
    scale, head_scale = (1.0, scale) if torch.is_tensor(scale) else (scale, None)
    if window is not None and (window >= q_start + T - 1 - k_start or q_start + T - 1 < window_from):
        window = None  # no query of this call is ever cut by the window
    if window is None and bias is None and head_scale is None:
        return causal_attention(q, k, v, key_offset(q, k, q_start, k_start), scale)
    score_mod = None
    if bias is not None or head_scale is not None:
        scale_rows = None if head_scale is None else per_row(head_scale, B, T)  # (B, H, T)

        def score_mod(score, b, h, i, j):
            if scale_rows is not None:  # a per-head scale, captured (it may need a gradient)
                score = score * scale_rows[b, h, i]
            if bias is not None:
                score = score + bias(b, h, i, (q_start + i) - (k_start + j))
            return score
    mask = block_mask(T, S, q_start, k_start, window, window_from, q.device)
    return _run_flex(q, k, v, score_mod, mask, scale)


# Triton tiles for the pair gate's kernels: 16 scores per thread (64 x 32 forward, 32 x 64 and
# 64 x 32 backward, 4 warps). Inductor's defaults for head_dim 64 in bf16 give a thread 128
# scores on an H100 (128 x 128 forward), each with r = 16 GELUs: the forward kernel's PTX
# came to 14.8 MB (240k lines) and ptxas ran over an hour on it; with these tiles it is
# 1.9 MB (benchmarks/gpu_compile/, made on a CPU). The other score_mods keep the defaults.
PAIR_GATE_TILES = dict(fwd_BLOCK_M=64, fwd_BLOCK_N=32, fwd_num_warps=4, bwd_BLOCK_M1=32, bwd_BLOCK_N1=64,
                       bwd_BLOCK_M2=64, bwd_BLOCK_N2=32, bwd_num_warps=4)


# Which kernels run asga's pair-gated attention on the GPU path: 'auto' (kernels_triton.py's
# on CUDA, FlexAttention elsewhere), 'triton' (on any device: on a CPU under Triton's
# interpreter, TRITON_INTERPRET=1) or 'flex'. FlexAttention's backward makes each captured gate
# tensor's gradient by an atomic add per score: 151x flash SDPA at T = 4096 on an H200.
ASGA_KERNEL = os.environ.get("ASGA_KERNEL", "auto")
if ASGA_KERNEL not in ("auto", "triton", "flex"):
    raise ValueError(f"ASGA_KERNEL={ASGA_KERNEL!r}: use auto (Triton's kernels on CUDA), triton or flex")


def pair_gate_kernels(q):
    """('triton' or 'flex', why) for q's device and head dim; said once per answer, outside
    a compile."""
    why = "ASGA_KERNEL=flex"
    if ASGA_KERNEL == "triton" or (ASGA_KERNEL == "auto" and q.is_cuda):
        try:
            import kernels_triton
            why = kernels_triton.unsupported(q)
        except ImportError as e:
            why = f"triton not importable ({e})"
        if why is None:
            return _say_once("asga's pair-gated attention", "triton", "kernels_triton.py, no atomics")
    elif ASGA_KERNEL == "auto":
        why = "not a CUDA tensor"
    return _say_once("asga's pair-gated attention", "flex", why)


_said = set()


def _say_once(what, path, why):
    """Print which path `what` takes, once per (what, path) a process, outside a compile."""
    if (what, path) not in _said and not torch.compiler.is_compiling():
        _said.add((what, path))
        print(f"kernels.py: {what}: {path} ({why})", file=sys.stderr, flush=True)
    return path, why


def flex_pair_gated_attention(q, k, v, q_term, k_term, w2, b2, scale, q_start, k_start, gate_space="logit"):
    """attention.pair_gated_attention. On CUDA through kernels_triton.py's kernels
    (`pair_gate_kernels`); else the gate is a score_mod reading the captured per-query and
    per-key terms, so the (T, S, r) pair tensor never exists (in compiled FlexAttention, not
    even one (T, S) score tile outlives its block)."""
    q, k, v = _same_dtype(q, k, v)
    if pair_gate_kernels(q)[0] == "triton":
        import kernels_triton
        return kernels_triton.pair_gated_attention(q, k, v, q_term, k_term, w2, b2, scale, q_start, k_start,
                                                   gate_space)
    B, H, T = q.shape[:3]
    S = k.shape[2]
    scale, head_scale = (1.0, scale) if torch.is_tensor(scale) else (scale, None)
    # Every captured tensor is read once, by row ([b, h, i]) or by key ([b, h, j]): see
    # `units` and `per_row`. Each is (B, H, T) or (B, H, S); r + r + r + 2 of them. All are
    # float32 at least (under autocast q_term, k_term come in bf16): FlexAttention sums a
    # captured tensor's gradient, over a row's or a column's scores, in that tensor's dtype.
    q_units, k_units = (units(t if t.dtype == torch.float64 else t.float()) for t in (q_term, k_term))
    w2_units = units(per_row(w2, B, T))
    b2_rows = per_row(b2, B, T)
    scale_rows = None if head_scale is None else per_row(head_scale, B, T)

    def gate(score, b, h, i, j):
        if scale_rows is not None:
            score = score * scale_rows[b, h, i]
        # [ASGA] eq. 1, one hidden unit at a time: pointwise, as a score_mod must be
        z = z0 = b2_rows[b, h, i]  # z0: the gate's logit at a zero pair term
        for q_c, k_c, w2_c in zip(q_units, k_units, w2_units):
            z = z + w2_c[b, h, i] * F.gelu(q_c[b, h, i] + k_c[b, h, j])
        if gate_space == "logit":
            return score * torch.sigmoid(z)
        # prob: + log s - log sigmoid(z0), a constant in each row, which the softmax ignores.
        # Why: b2's gradient is sum_ij dS_ij sigmoid(-z_ij), with sigmoid(-z) nearly the same
        # for every key, so mostly sum_j dS_ij: 0 exactly, but FlexAttention's backward
        # subtracts rowsum(out * d_out) with out rounded to bf16, which leaves sum_j dS_ij
        # ~1e-3 of sum_j |dS_ij| (1e-7 in float32) and b2's gradient 4-7e-2 off. With the
        # constant, b2's terms are dS_ij (sigmoid(-z_ij) - sigmoid(-b2)) and that error goes.
        return score + (log_sigmoid(z) - log_sigmoid(z0))

    gate.kernel_options = PAIR_GATE_TILES
    return _run_flex(q, k, v, gate, block_mask(T, S, q_start, k_start, None, 0, q.device), scale)


# Elements of one chunk of scores while finding the thresholds: 16 MB on CPU; 1 GB on a GPU,
# where fewer, larger chunks also keep a compiled graph short (the loop is unrolled in it).
TOPK_SCORES = dict(cpu=1 << 22, cuda=1 << 28)


@torch.no_grad()
def topk_threshold(q, k, scale, q_start, k_start, k_per_query, k_max):
    """(B, H, T) float32: a logit between each query's k_i-th highest visible score and the
    highest one below it (-inf where none is below), so `score >= threshold` keeps its top
    k_i and every key tied with the k_i-th (attention.topk_mask's tie rule). The midpoint, not
    the k_i-th score itself, so that FlexAttention's own rounding of the same score cannot
    flip the choice. Scores exist a chunk of query rows at a time (GQA through a view: each
    key head's queries in one matmul)."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    kk = min(k_max, S)
    out = []
    for t0, t1 in query_chunks(T, B * H * S, TOPK_SCORES, q.device):
        qc = q[:, :, t0:t1].float().view(B, Hkv, H // Hkv, t1 - t0, D)
        scores = (qc @ k.float()[:, :, None].transpose(-2, -1)).view(B, H, t1 - t0, S) * scale
        dist = (q_start + t0 + torch.arange(t1 - t0, device=q.device)[:, None]
                - k_start - torch.arange(S, device=q.device))
        scores = scores.masked_fill_(dist < 0, NEG_INF)  # in place: scores is this chunk's own
        top = scores.topk(kk, -1).values  # (B, H, rows, kk)
        k_i = k_per_query[t0:t1].view(1, 1, -1, 1).expand(B, H, -1, 1)
        kth = top.gather(-1, (k_i - 1).clamp(max=kk - 1))  # the k_i-th highest (-inf: fewer keys)
        after = scores.masked_fill_(scores >= kth, NEG_INF).amax(-1, keepdim=True)  # the highest below it
        out.append(torch.where(after > NEG_INF, (kth + after) / 2, NEG_INF)[..., 0])
    return torch.cat(out, 2)


def flex_topk_attention(q, k, v, scale, q_start, k_start, k_per_query, k_max):
    """attention.topk_attention: a per-query threshold (`topk_threshold`, no gradient: the
    choice of keys is not differentiable) applied by a score_mod, then causal FlexAttention."""
    T, S = q.shape[2], k.shape[2]
    q, k, v = _same_dtype(q, k, v)
    threshold = topk_threshold(q, k, scale, q_start, k_start, k_per_query, k_max)

    def keep_top(score, b, h, i, j):
        return torch.where(score >= threshold[b, h, i], score, NEG_INF)

    return _run_flex(q, k, v, keep_top, block_mask(T, S, q_start, k_start, None, 0, q.device), scale)


def combiner_block_mask(T, S, R, q_start, k_start, block, device):
    """The block mask of [Combiner] over keys [k; kbar] (S keys, then R summaries): query i
    sees key j < S in its own aligned block, at or before it, and summary S + r of every
    block r before its own. Cached like `block_mask`."""
    def visible(b, h, i, j):
        q_pos, k_pos = q_start + i, k_start + j
        direct = (j < S) & (k_pos <= q_pos) & (k_pos // block == q_pos // block)
        span = (j >= S) & (j - S < q_pos // block)
        return direct | span

    return cached_block_mask(("combiner", T, S, R, q_start, k_start, block), visible, T, S + R, device)


def flex_combiner_attention(q, k, v, kbar, vbar, scale, q_start, k_start, block):
    """attention.combiner_attention: FlexAttention over keys [k; kbar] and values [v; vbar]
    with `combiner_block_mask`, whose skipped tiles keep the work O(T (s + R)), up to
    FlexAttention's 128-token tiles. vbar has one head per query head, so grouped key heads
    are expanded here (a copy of k and v)."""
    T, S, R = q.shape[2], k.shape[2], kbar.shape[2]
    H = q.shape[1]
    q, k, v, kbar, vbar = _same_dtype(q, k, v, kbar, vbar)
    keys = expand_kv(torch.cat([k, kbar], dim=2), H)  # (B, H, S + R, D)
    values = torch.cat([expand_kv(v, H), vbar], dim=2)  # (B, H, S + R, D)
    mask = combiner_block_mask(T, S, R, q_start, k_start, block, q.device)
    return _run_flex(q, keys, values, None, mask, scale)


def flex_compressed_attention(q, k_cmp, v_cmp, scale, q_start, length, stride):
    """attention.compressed_branch's output ([NSA] eqs. 7-8): one FlexAttention call over the C ~
    T / stride compressed keys, compressed key i visible to the query at position p once
    i stride + length - 1 <= p; a row that sees none gets 0, as in the reference. Its
    BlockMask (built once per shape, cached) lists, per 128-query tile, the 128-key tiles
    up to that boundary: the keys read (T C / 2 for a sequence) plus one band of boundary
    tiles (the boundary moves 128 / stride keys per query tile), and the backward is
    FlexAttention's, never a (T, C) tensor."""
    B, H, T, _ = q.shape
    C = k_cmp.shape[2]
    if C == 0:  # fewer keys than one compressed key covers: no query sees any
        return q.new_zeros(B, H, T, v_cmp.shape[-1])
    q, k_cmp, v_cmp = _same_dtype(q, k_cmp, v_cmp)

    def complete(b, h, i, j):
        return j * stride + length - 1 <= q_start + i

    mask = cached_block_mask(("compressed", T, C, q_start, length, stride), complete, T, C, q.device)
    return _run_flex(q, k_cmp, v_cmp, None, mask, scale)


def flex_compressed_branch(q, k_cmp, v_cmp, scale, q_start, length, stride, block, choose):
    """attention.compressed_branch: the output through `flex_compressed_attention`, the blocks
    apart (FlexAttention returns an output, not the probabilities). On CUDA through
    kernels_triton.py, p^cmp a tile at a time in registers: for nsa's own choice
    (attention's nsa_top_blocks with its sizes as keywords, n <= 16) one kernel scores and
    chooses, the (T, J) scores never
    stored; for any other `choose` one kernel writes the scores. Elsewhere the scores come
    from `chunked_block_scores`, a chunk of queries at a time. Then `choose` over all queries."""
    out = flex_compressed_attention(q, k_cmp, v_cmp, scale, q_start, length, stride)
    if choose is None:
        return out, None
    J = ceil_div(q_start + q.shape[2], block)
    if block_score_kernels(q, length, stride, block)[0] == "triton":
        import kernels_triton
        # one dtype, as the torch form's products have: under autocast RoPE hands over a float32
        # q beside bf16 compressed keys, and a Triton dot of the two does not compile
        q_, k_ = _same_dtype(q.detach(), k_cmp.detach())
        n = getattr(choose, "keywords", {}).get("n")  # nsa's own choice (a partial of nsa_top_blocks) says its n
        if isinstance(n, int) and n <= kernels_triton.SCORE_TILES[2] and k_cmp.shape[2]:
            blocks = kernels_triton.nsa_top_blocks(q_, k_, scale, q_start, length, stride, block, J, n)
            return out, expand_kv(blocks, q.shape[1])
        return out, choose(kernels_triton.nsa_block_scores(q_, k_, scale, q_start, length, stride, block, J), q_start)
    return out, choose(chunked_block_scores(q, k_cmp, scale, q_start, length, stride, block, J), q_start)


# nsa's and moba's selection on FLEX: auto (kernels_triton.py's kernels on CUDA, the torch forms
# elsewhere) | triton (any device: Triton's interpreter on a CPU) | torch
SELECTION_KERNEL = os.environ.get("SELECTION_KERNEL", "auto")
if SELECTION_KERNEL not in ("auto", "triton", "torch"):
    raise ValueError(f"SELECTION_KERNEL={SELECTION_KERNEL!r}: use auto (Triton's kernels on CUDA), triton or torch")


def block_score_kernels(q, length, stride, block):
    """('triton' or 'torch', why): the path of nsa's selection (its block scores, and its choice
    where fused) on FLEX; said once per answer, outside a compile."""
    return _selection_path("nsa's selection", q, lambda kt: kt.block_scores_unsupported(q, length, stride, block))


def _selection_path(what, q, unsupported):
    """`SELECTION_KERNEL`'s answer for q: kernels_triton.py's kernel where Triton imports and
    unsupported(kernels_triton) says None, else the torch form; said once per answer."""
    why = "SELECTION_KERNEL=torch"
    if SELECTION_KERNEL == "triton" or (SELECTION_KERNEL == "auto" and q.is_cuda):
        try:
            import kernels_triton
            why = unsupported(kernels_triton)
        except ImportError as e:
            why = f"triton not importable ({e})"
        if why is None:
            return _say_once(what, "triton", "kernels_triton.py, the scores never in memory")
    elif SELECTION_KERNEL == "auto":
        why = "not a CUDA tensor"
    return _say_once(what, "torch", why)


FLEX_TILE = 128  # FlexAttention's default BLOCK_SIZE; selection blocks may be smaller or larger


# nsa's selected branch and moba: each (query, slot) reads one block of `block` keys, chosen
# per token (and per head). A BlockMask over the queries as they stand lists, per 128-query
# tile, the union of its queries' blocks: every tile, once the choices differ from token to
# token (measured before this form: at T = 4096, 1.15x the tiles of dense causal attention for nsa, 3.8x the
# keys its definition reads per query; moba 1.03x, 8.5x). So the queries are regrouped first,
# as MoBA's efficient form gathers the queries of each block ([MoBA] moba_efficient.py):
# every (query, group of blocks) pair becomes one row of a virtual query sequence, sorted by
# group, each group's rows starting at a query-tile boundary, so a query tile lists only its
# group's key tiles; the rows of one query are then merged by their log-sum-exp (the softmax
# over the union of the query's blocks is the lse-weighted mix of the softmaxes over each).
#
# The tile shape. FlexAttention's backward on a GPU takes its Triton tiles from a fixed table
# and drops those that do not divide the BlockMask's (torch 2.13,
# flex_attention_backward in torch/_inductor/kernel/flex/flex_attention.py; kernel_options
# apply only after that check): bf16, head_dim 64 on sm_90 is (BLOCK_M1, BLOCK_N1, BLOCK_M2,
# BLOCK_N2) = (64, 128, 128, 64), so a BlockMask whose key tile is under 128 has no backward
# kernel there ("no choices"; sm_80's (64, 64, 64, 64) would take 64). With a backward, the
# tiles stay 128 x 128 and a row is a (query, 128-key tile) pair: all of the query's blocks
# in that tile at once (a bit mask), so nsa's own block and the one before it, and any
# neighbours its scores pick, cost one row. Without a backward (evaluation, sampling) the
# forward's tiles can be set (fwd_BLOCK_N), so the key tile is the selection block (at least
# 16, Triton's smallest dot; 128 at most) and a row is a (query, block) pair.
#
# The work each BlockMask leaves (tiles listed x tile area, against the keys the definition
# reads, about n x block per query): rows x key tile, rows = T x (the key tiles a query's n
# blocks fall in) plus each group's last partial tile of rows (< 128 rows a group, at most
# S / span groups). Measured at qwen-134m sizes with random choices (no locality, the worst
# case for sharing a tile), T = 4096 / 16384, without the diagonal band: with a backward,
# moba (block 64, n 4) 1.8x / 2.0x the keys read, nsa (block 32, n 8) 2.9x / 3.3x (most of
# its 8 blocks in tiles of their own, a row reading 32 of a tile's 128 keys; less where its
# choices neighbour each other); without one, 0.8x for both (the band holds the rest). Either
# way the work per query no longer grows with T; the union BlockMask this replaces grew as T.
# nsa with a backward within 2.5x (tests/test_gpu_cost.py's bound without the band) would
# need key tiles of 64 (sm_80's backward table allows them, sm_90's not) or a kernel choice
# outside the table (max_autotune lists 32 x 32 backward tiles).
SELECTION_Q_TILE = 128  # rows per query tile: sm_90's bf16 backward needs a multiple of 128 (BLOCK_M2)
SELECTION_KV_TILE = 128  # key tile when a backward is needed (sm_90's BLOCK_N1); see above
SELECTION_BITS = 16  # blocks one row may hold (a bit mask read by the mask_mod)

SelectionRows = namedtuple("SelectionRows", "query mask pair_row rows")


def selection_tiles(block, grad):
    """(query tile, key tile, kernel_options) for `selection_rows`: 128 x 128 where a backward
    runs; otherwise the key tile matched to the selection block (a power of two in 16 .. 128)
    and the forward kernel's BLOCK_N set to it (its default, 64 or 128, must divide it)."""
    if grad:
        return SELECTION_Q_TILE, SELECTION_KV_TILE, None
    kv = 16
    while kv * 2 <= min(block, FLEX_TILE):
        kv *= 2
    return SELECTION_Q_TILE, kv, (None if kv == FLEX_TILE else dict(fwd_BLOCK_N=kv))


def selection_rows(blocks, T, S, q_start, k_start, block, q_tile, kv_tile):
    """The virtual query sequence of `flex_block_attention` for a selection blocks (B, H, T, n)
    (absolute block numbers, -1 empty), in a few tensor passes (one sort, no loop over blocks):

      group    = block // per, per = the blocks one key tile holds (1 for a block >= the tile)
      row      = one per (query, group it reads): its blocks in that group as a bit mask
      order    = rows sorted by (group, query); each group padded to whole query tiles
      R        = T n + min(groups, T n) (q_tile - 1), rounded up to q_tile: a static size (one
                 compile per shape); tiles past the last group list nothing

    Returns SelectionRows: query (B, H, R) the query of each row (0 in padding), mask the
    BlockMask (BLOCK_SIZE (q_tile, kv_tile)) over (R rows, S keys) whose query tile lists the
    key tiles of its one group up to its last row's position, pair_row (B, H, T, n) the row
    of each slot (R where the slot reads nothing new: empty, repeated, outside the keys, or
    in a group an earlier slot of the query opened) and R."""
    B, H, _, n = blocks.shape
    device = blocks.device
    per = max(1, min(SELECTION_BITS, kv_tile // block))
    span = per * block  # positions a group covers
    n_groups = ceil_div(k_start + S, span)
    P = T * n
    R = ceil_div(P + min(n_groups, P) * (q_tile - 1), q_tile) * q_tile
    # slots that read a key: not empty, not repeated, and a block inside the keys
    earlier = torch.ones(n, n, dtype=torch.bool, device=device).tril(-1)  # [s, s']: s' < s
    real = (blocks >= 0) & ~repeated(blocks) & ((blocks + 1) * block > k_start) & (blocks * block < k_start + S)
    group = torch.where(real, blocks // per, n_groups)  # (B, H, T, n) each slot's group; n_groups: nothing
    same = (group[..., :, None] == group[..., None, :]) & real[..., None, :]  # [s, s'] same group
    opens = real & ~(same & earlier).any(-1)  # the first slot of a query in each of its groups
    bit = torch.where(real, 1 << (blocks - group * per).clamp(0, per - 1), 0).int()
    bits = (same.int() * bit[..., None, :]).sum(-1, dtype=torch.int32)  # the group's blocks, on its first slot
    opened = torch.where(opens, group, n_groups).view(B, H, P)  # the group each pair opens; n_groups: none
    t = torch.arange(T, device=device).repeat_interleave(n)  # query of each pair
    # rows sorted by (group, query); unused pairs last
    key, order = (opened * T + t).sort(dim=-1, stable=True)
    g_sorted, t_sorted = key // T, key % T
    count = torch.zeros(B, H, n_groups + 1, dtype=torch.long, device=device)
    count.scatter_add_(-1, opened, torch.ones_like(opened))
    count = count[..., :n_groups]
    padded = ceil_div(count, q_tile) * q_tile
    first_row = F.pad(padded.cumsum(-1) - padded, (0, 1), value=R)  # (B, H, n_groups + 1)
    first_pair = F.pad(count.cumsum(-1) - count, (0, 1), value=P)
    rank = torch.arange(P, device=device) - first_pair.gather(-1, g_sorted)
    row = torch.where(g_sorted < n_groups, first_row.gather(-1, g_sorted) + rank, R)  # (B, H, P), R: none
    pair_row = torch.empty_like(row).scatter_(-1, order, row).view(B, H, T, n)

    def by_row(values, fill):  # (B, H, P) sorted pair values -> (B, H, R) by row
        out = torch.full((B, H, R + 1), fill, dtype=values.dtype, device=device)
        return out.scatter_(-1, row, values)[..., :R].contiguous()

    query = by_row(t_sorted, 0)
    pos = by_row(q_start + t_sorted, -1)  # -1: a padding row, which sees no key
    row_group = by_row(g_sorted, -1)
    row_bits = by_row(bits.view(B, H, P).gather(-1, order), 0)
    row_first = row_group * per  # the first block of the row's group

    def mask_mod(b, h, i, j):
        k_pos = k_start + j
        local = k_pos // block - row_first[b, h, i]  # which block of the row's group
        inside = (local >= 0) & (local < per)
        chosen = ((row_bits[b, h, i] >> local.clamp(0, per - 1)) & 1) == 1
        return (k_pos <= pos[b, h, i]) & inside & chosen

    # each query tile: its group's key tiles, up to its last row's position (rows sorted by query)
    nq, nk = R // q_tile, ceil_div(S, kv_tile)
    tile_group = row_group[..., ::q_tile]  # (B, H, nq): a group's tiles start with a real row
    last_pos = pos.view(B, H, nq, q_tile).amax(-1)
    lo = (tile_group * span - k_start).clamp(min=0)
    hi = torch.minimum(torch.minimum((tile_group + 1) * span - 1 - k_start, last_pos - k_start),
                       torch.full_like(lo, S - 1))
    kv_num = torch.where((tile_group >= 0) & (hi >= lo), hi // kv_tile - lo // kv_tile + 1, 0).int()
    kv_idx = (lo[..., None] // kv_tile + torch.arange(nk, device=device)).clamp(max=nk - 1).int()
    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=(q_tile, kv_tile), mask_mod=mask_mod,
                                    seq_lengths=(R, S))
    return SelectionRows(query, mask, pair_row, R)


def flex_block_attention(q, k, v, scale, q_start, k_start, block, blocks):
    """attention.block_attention: one FlexAttention call over `selection_rows` (each row one
    query's blocks in one group: the blocks one key tile holds, or one block where a block
    spans several tiles; with its log-sum-exp), then each query's rows merged:
    out = sum_r exp(lse_r - logsumexp_r lse_r) out_r, 0 where no row sees a key."""
    B, H, T, D = q.shape
    S = k.shape[2]
    key_offset(q, k, q_start, k_start)
    q, k, v = _same_dtype(q, k, v)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    q_tile, kv_tile, options = selection_tiles(block, grad)
    rows = selection_rows(blocks, T, S, q_start, k_start, block, q_tile, kv_tile)
    q_rows = q.gather(2, rows.query[..., None].expand(-1, -1, -1, D))  # (B, H, R, D)
    out, lse = _run_flex(q_rows, k, v, None, rows.mask, scale, lse=True, kernel_options=options)
    n = blocks.shape[-1]
    at = rows.pair_row.view(B, H, T * n).clamp(max=rows.rows - 1)
    out = out.gather(2, at[..., None].expand(-1, -1, -1, D)).view(B, H, T, n, D)
    lse = lse.gather(2, at).view(B, H, T, n).masked_fill(rows.pair_row == rows.rows, NEG_INF)
    top = lse.amax(-1, keepdim=True)
    w = torch.exp(lse - torch.where(top > NEG_INF, top, 0.0))  # 0 for a row that sees no key
    w = w / w.sum(-1, keepdim=True).clamp(min=torch.finfo(w.dtype).tiny)
    return (w.unsqueeze(-2).to(out.dtype) @ out).squeeze(-2)


def flex_selected_attention(q, k, v, scale, q_start, k_start, keys):
    """attention.selected_attention as one FlexAttention call: the mask_mod reads each query's
    listed keys as one bit per key (`listed_bits`), and each query tile lists only the key
    tiles that hold a visible listed key of one of its queries (`listed_tiles`).

    Why tiles and not each query's n keys read by index (O(T n) work, what this path did
    before): on an H100 (benchmarks/gpu_runs/h100_2026-11-27.md) the gathered form ran at ~0.6
    TFLOP/s, gathers and atomic adds without tensor cores, 24x flash SDPA's time at T = 4096,
    n = 256, while FlexAttention's tiles run on tensor cores at hundreds of TFLOP/s. Per-token
    choices touch nearly every tile (1.03x the tiles of dense causal attention at T = 4096 on
    random data), so this is about dense work at FlexAttention's speed: less than the gathers
    cost up to T ~ 64k at n = 256 (estimated from the two rates; not yet timed). The query
    heads of a key head share the selection (it is per query)."""
    B, H, T, D = q.shape
    S = k.shape[2]
    q, k, v = _same_dtype(q, k, v)
    bits = listed_bits(keys, S)  # (B, T, ceil(S / 8)) uint8

    def mask_mod(b, h, i, j):
        chosen = ((bits[b, i, j // 8].to(torch.int32) >> (j % 8)) & 1) == 1
        return chosen & (k_start + j <= q_start + i)

    mask = listed_tiles(keys, T, S, q_start, k_start, mask_mod)
    return _run_flex(q, k, v, None, mask, scale)


def listed_bits(keys, S):
    """(B, T, ceil(S / 8)) uint8: bit j % 8 of byte j // 8 set where the query lists key j
    (keys (B, T, n), -1 empty, each key listed at most once, as a top-k lists them). Made by
    adding each listed key's bit into its byte (distinct bits: the sum is their union), so no
    (B, T, S) tensor exists; 1/8 of one, which the backward keeps."""
    B, T, _ = keys.shape
    words = ceil_div(S, 8)
    ok = (keys >= 0) & (keys < S)
    byte = torch.where(ok, keys // 8, words)  # empty -> a spare byte, dropped
    bit = torch.where(ok, 1 << (keys % 8), 0).int()
    packed = torch.zeros(B, T, words + 1, dtype=torch.int32, device=keys.device).scatter_add_(-1, byte, bit)
    return packed[..., :words].to(torch.uint8)


def listed_tiles(keys, T, S, q_start, k_start, mask_mod):
    """The BlockMask (FLEX_TILE x FLEX_TILE, one for every head) whose query tile lists the key
    tiles holding a visible listed key of any of its queries, in order; each tile partial
    (mask_mod decides per pair)."""
    B, _, n = keys.shape
    device = keys.device
    nq, nk = ceil_div(T, FLEX_TILE), ceil_div(S, FLEX_TILE)
    t = torch.arange(T, device=device)[:, None]
    visible = (keys >= 0) & (keys < S) & (k_start + keys <= q_start + t)  # (B, T, n)
    flat = torch.where(visible, (t // FLEX_TILE) * nk + keys // FLEX_TILE, nq * nk)  # nq * nk: none
    tiles = torch.zeros(B, nq * nk + 1, dtype=torch.bool, device=device).scatter_(1, flat.view(B, T * n), True)
    tiles = tiles[:, :nq * nk].view(B, 1, nq, nk)
    kv_num = tiles.sum(-1, dtype=torch.int32)
    kv_idx = torch.sort((~tiles).int(), dim=-1, stable=True).indices.int()  # the listed tiles first, in order
    return BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=FLEX_TILE, mask_mod=mask_mod, seq_lengths=(T, S))


def _listed_logits(q, k, scale, q_start, k_start, keys):
    """The main attention's float32 logits of each query's listed keys, (B, Hkv, G, T, n), read
    by index, with `ok` (B, 1, 1, T, n), listed and visible, and `some` (.., 1), the queries
    that see any (a query with none gets 0, as in the reference). keys (B, T, n) indices
    into the S keys, -1 empty."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    b = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    h = torch.arange(Hkv, device=q.device).view(1, Hkv, 1, 1)
    k_sel = k[b, h, keys.clamp(min=0)[:, None]].float()  # (B, Hkv, T, n, D): indexed loads when compiled
    logits = (q.view(B, Hkv, H // Hkv, T, 1, D).float() * k_sel[:, :, None]).sum(-1) * scale
    q_pos = q_start + torch.arange(T, device=q.device)[:, None]
    ok = ((keys >= 0) & (k_start + keys <= q_pos))[:, None, None]
    some = ok.any(-1, keepdim=True)
    return logits.masked_fill(~ok, NEG_INF).masked_fill(~some, 0.0), ok, some


def flex_indexer_kl(q, k, scale, q_idx, k_idx, w, q_start, k_start, keys):
    """attention.indexer_kl on the GPU path. The dense warm-up (keys None) fits L^I over every
    visible key: T^2 by definition, in GPU-sized chunks (`chunked_indexer_kl`). The sparse
    stage fits it over the n listed keys only, so it reads them by index (`_listed_kl`: the
    main attention's logits and the indexer's scores of the listed keys, compiled into
    indexed loads; no gradient flows to the main attention's q, k): O(T n) instead of the
    chunked (T, S) logits masked down to n keys, which made the indexer's training step
    quadratic in T (measured on a CPU at T = 16384: 124 GiB allocated per layer forward)."""
    if keys is None:
        return chunked_indexer_kl(q, k, scale, q_idx, k_idx, w, q_start, k_start, keys)
    return compiled_on_gpu(_listed_kl, q)(q, k, scale, q_idx, k_idx, w, q_start, k_start, keys)


def _listed_kl(q, k, scale, q_idx, k_idx, w, q_start, k_start, keys):
    """L^I over the listed keys: sum over queries of KL(p_t || softmax(I[t, keys])) / (B T),
    p_t the main attention's probabilities over the same keys (no gradient), summed over
    heads and L1-normalised; I with gradient into the indexer's q_idx, k_idx and w."""
    B, T, d = q.shape[0], q.shape[2], q_idx.shape[-1]
    with torch.no_grad():
        logits, ok, some = _listed_logits(q.detach(), k.detach(), scale, q_start, k_start, keys)
        p = (torch.softmax(logits.flatten(1, 2), -1) * some[:, 0]).mean(1)  # (B, T, n): summed over heads
    ok, some, s = ok[:, 0, 0], some[:, 0, 0], keys.clamp(min=0)  # (B, T, n), (B, T, 1), (B, T, n)
    k_listed = k_idx[torch.arange(B, device=q.device).view(B, 1, 1), s].float()  # (B, T, n, d)
    dots = (q_idx.float()[:, :, :, None, :] * k_listed[:, :, None]).sum(-1) / math.sqrt(d)  # (B, T, J, n)
    scores = (F.relu(dots) * w.float()[..., None]).sum(2)  # (B, T, n): [DS32] eq. 1 at the listed keys
    log_i = torch.log_softmax(scores.masked_fill(~ok, NEG_INF).masked_fill(~some, 0.0), dim=-1)
    kl = torch.xlogy(p, p) - p * log_i.masked_fill(p == 0, 0.0)
    return kl.sum() / (B * T)


def flex_moba_select(q, means, q_start, block, topk):
    """attention.moba_select on FLEX: on CUDA one Triton kernel (kernels_triton.moba_blocks: the
    (T, J) scores and their top-k never in memory; its products in float32, as the definition
    says), elsewhere `moba_select` with the running maxima of `_top_n`."""
    if moba_select_kernels(q, topk)[0] == "triton":
        import kernels_triton
        return kernels_triton.moba_select(q, means, q_start, block, topk)
    return moba_select(q, means, q_start, block, topk, functools.partial(_top_n, maxima=True))


def moba_select_kernels(q, topk):
    """('triton' or 'torch', why): the path of moba's choice on FLEX; said once per answer,
    outside a compile."""
    return _selection_path("moba's selection", q, lambda kt: kt.moba_unsupported(q, topk))


FLEX = Ops(
    name="FlexAttention + SDPA (kernels.py)", attention=flex_attention_op, pair_gated_attention=flex_pair_gated_attention,
    topk_attention=flex_topk_attention, combiner_attention=flex_combiner_attention,
    block_attention=flex_block_attention, selected_attention=flex_selected_attention,
    compressed_branch=flex_compressed_branch,
    indexer_topk=chunked_indexer_topk, indexer_kl=flex_indexer_kl, mean_pair_gate=chunked_mean_pair_gate,
    top_n=functools.partial(_top_n, maxima=True), moba_select=flex_moba_select)


# ---------------------------------------------------------------------------- DECODE: a few query rows against a long KV cache
# A decoding step has one query row (a short prompt a few) against a cache that grows every
# step, so what it costs is what it reads of the cache. These forms read the keys and
# summaries the selection names and nothing else: the window's keys as a slice (a view), the
# selected blocks and keys by index, the summaries the cache keeps (nsa's compressed keys,
# moba's block means, combiner's spans, the indexer's keys); only what a definition reads of
# every key does each step read whole (full's keys, asga's gate, caa's ranking, the indexer's
# scores). The query heads of a key head are stacked as rows of one matmul against that key
# head (`_head_rows`), so grouped keys are never copied per query head; nothing compiles and
# no BlockMask is built per cache length. attention.ops picks this set for calls of at most
# DECODE_ROWS query rows on every path but the reference (a few rows' (rows, S) scores are small).

DECODE_ROWS = 16


def _head_rows(q, Hkv):
    """q (B, H, T, D) -> (B, Hkv, G T, D): the G = H / Hkv query heads of each key head stacked
    as rows (row g T + t: head h = kv G + g, query t)."""
    B, H, T, D = q.shape
    return q.reshape(B, Hkv, H // Hkv * T, D)


@torch.library.custom_op("sparse_attention::cache_bmm", mutates_args=())
def cache_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm, opaque to inductor: inside a compiled decoding step the products with the
    cache stay ATen's (BLAS) calls. Inductor turns a bmm with one row (a decoding step's q k^T
    and p v without grouped heads) into its own multiply-and-sum loop on a CPU, which read the
    cache at 0.75x the speed: `full`'s compiled step took 73 ms at batch 8, T = 8192, against
    56 eager."""
    return torch.bmm(a, b)


@cache_bmm.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], a.shape[1], b.shape[2])


def _bmm(a, b):
    """a @ b for 3-d a, b: `cache_bmm` inside a compiled step without gradients (decoding; it
    has no backward), torch.bmm otherwise (a compiled training step's few-row calls too)."""
    return cache_bmm(a, b) if torch.compiler.is_compiling() and not torch.is_grad_enabled() else torch.bmm(a, b)


# keys_times: a CPU product of 2 to KEY_ROWS query rows with keys stored along the positions
# reads at most KEY_STREAMS of the D rows of K^T at once
KEY_STREAMS, KEY_ROWS = 16, 16


def keys_times(rows, kT):
    """rows @ kT (N, R, S): query rows (N, R, D) times cached keys kT (N, D, S). Where the keys
    lie along the positions (a CPU cache's `keys_last`, kT.stride(-1) == 1), 2 to KEY_ROWS
    float32 rows on a CPU take the product over D in pieces of KEY_STREAMS rows of kT, each
    piece after the first added to the result in place (baddbmm_): BLAS's product with a few
    rows reads every row of kT at once, a stream each, more than a CPU's prefetcher follows,
    and a piece's own product plus a sum would make two more passes over the (N, R, S)
    result. benchmarks/keys_product_cpu.md (one thread, caches flushed), on an AMD EPYC with
    AVX-512: the indexer's 4 rows x 64 x 32768 keys 0.67 ms so, 0.87 in pieces of 32 summed,
    0.95 whole, 0.21 for a plain sum over the keys; 12 key heads x 8 rows x 16384 keys 4.63,
    10.80, 6.78 and 1.67 ms; on an Intel AVX-512 host (pieces of 32 summed) 0.52-0.71x the
    whole product's time at 2-16 rows. One row is BLAS's matrix-vector product, which streams
    at a sum's speed: whole. Traced into a compiled step without gradients (decoding), the
    pieces are one call opaque to inductor (`cache_keys_times`), so that they run as they do
    eagerly: traced op by op, the in-place adds became a product and a sum each. Autocast's
    lower-precision products stay whole (each piece would round to its dtype)."""
    D, R = kT.shape[1], rows.shape[1]
    if (rows.device.type != "cpu" or not 2 <= R <= KEY_ROWS or D <= KEY_STREAMS or kT.stride(-1) != 1
            or rows.dtype != torch.float32 or torch.is_autocast_enabled("cpu")):
        return _bmm(rows, kT)
    if torch.compiler.is_compiling():
        return torch.bmm(rows, kT) if torch.is_grad_enabled() else cache_keys_times(rows, kT)
    return _keys_in_pieces(rows, kT)


def _keys_in_pieces(rows, kT):
    """keys_times' product in pieces of KEY_STREAMS rows of kT, each added in place."""
    out = torch.bmm(rows[..., :KEY_STREAMS], kT[:, :KEY_STREAMS])
    for d0 in range(KEY_STREAMS, kT.shape[1], KEY_STREAMS):
        out.baddbmm_(rows[..., d0:d0 + KEY_STREAMS], kT[:, d0:d0 + KEY_STREAMS])
    return out


@torch.library.custom_op("sparse_attention::cache_keys_times", mutates_args=())
def cache_keys_times(rows: torch.Tensor, kT: torch.Tensor) -> torch.Tensor:
    """`_keys_in_pieces`, opaque to inductor (a compiled decoding step's keys_times)."""
    return _keys_in_pieces(rows, kT)


@cache_keys_times.register_fake
def _(rows, kT):
    return rows.new_empty(rows.shape[0], rows.shape[1], kT.shape[2])


def _decode_logits(q, k, scale):
    """(B, H, T, S) float32 logits q . k * scale, k (B, Hkv, S, D) read once per key head;
    scale a float or one per head (H,)."""
    B, H, T, _ = q.shape
    logits = keys_times(_head_rows(q, k.shape[1]).flatten(0, 1), k.flatten(0, 1).transpose(1, 2))
    logits = logits.float().view(B, H, T, k.shape[2])
    return logits * (scale.float()[None, :, None, None] if torch.is_tensor(scale) else scale)


def _decode_output(p, v):
    """(B, H, T, D): the probabilities p (B, H, T, S) times the values v (B, Hkv, S, D)."""
    B, H, T, S = p.shape
    out = _bmm(p.to(v.dtype).reshape(B * v.shape[1], H // v.shape[1] * T, S), v.flatten(0, 1))
    return out.view(B, H, T, v.shape[-1])


def _cached_rows(x, H, first, length=1):
    """The rows x[b, h // G, first[b, h] + i] for i < length as indices into `table`, x's
    storage seen as (N, D) rows (a view, no copy): (table, rows (B, H, .., length) long, pos
    (.., length) the positions asked for); x (B, Hkv, S, D) a KV cache's view, H query heads
    (G = H / Hkv of them read a key head), first (B or 1, H or 1, ..) long. A position < 0
    or >= S (another head's row, spare capacity, or past the view's last row, clamped to it)
    is the caller's to mask. Rows, not elements: a row's D values are contiguous, so its
    address is one multiply-add (advanced indexing computed each element's offset: 3 ms for
    nsa's 8 x 32 keys a head at batch 8, 12 heads). `GatheredDots` and `gathered_sum` read
    the rows where they lie. Sizes and strides only (no storage or pointer queries): a
    compiled decoding step traces it whole."""
    if not _rows_contiguous(x):
        x = x.contiguous()
    B, Hkv, S, D = x.shape
    n_rows = (B - 1) * (x.stride(0) // D) + (Hkv - 1) * (x.stride(1) // D) + S  # up to the view's last row
    table = x.as_strided((n_rows, D), (D, 1))  # row r: the D elements from x's first + r D
    base = _head_rows_at(x, H).view(B, H, *(1,) * (first.dim() - 1))
    pos = first[..., None] + torch.arange(length, device=x.device)
    return table, (base + pos).clamp(0, n_rows - 1), pos


def _head_rows_at(x, H):
    """(B, H) long: the row of x[b, h // G, 0] in `_cached_rows`' table, for each batch row b
    and query head h; one arange where each batch row's heads lie one after another, as in a
    KV cache (four ops fewer a call than from two aranges and the strides)."""
    B, Hkv, _, D = x.shape
    sb, sh = x.stride(0) // D, x.stride(1) // D
    if sh > 0 and (B == 1 or sb == Hkv * sh):
        base = torch.arange(0, B * Hkv * sh, sh, device=x.device).view(B, Hkv)
    else:
        base = (torch.arange(B, device=x.device) * sb)[:, None] + torch.arange(Hkv, device=x.device) * sh
    return base if H == Hkv else base.repeat_interleave(H // Hkv, dim=1)


def _rows_contiguous(x):
    """Whether x's last dim is its rows' contiguous D values, one row after another along dim -2."""
    return x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


def _cached_kv_rows(k, v, H, first, length=1):
    """`_cached_rows` of a cache's keys and of its values: (k table, k rows, v table, v rows,
    pos), the row indices computed once where k and v lie alike in their storages (a
    KVCache's two `Rows` do)."""
    k_table, k_rows, pos = _cached_rows(k, H, first, length)
    if _rows_contiguous(k) and v.shape == k.shape and v.stride() == k.stride():
        return k_table, k_rows, v.as_strided(k_table.shape, k_table.stride()), k_rows, pos
    v_table, v_rows, _ = _cached_rows(v, H, first, length)
    return k_table, k_rows, v_table, v_rows, pos


def _gathered_dots(q, table, rows):
    """(Q, m) float32: q[i] . table[rows[i, j]], q (Q, D), rows (Q, m)."""
    return (q[:, None, :].float() * table[rows].float()).sum(-1)


class GatheredDots:
    """`_gathered_dots`, compiled where it can be: the dot of each query row with the cache
    rows its selection names, read where they lie (inductor's C++ on a CPU: one loop that
    loads each named row once, no (Q, m, D) copy). Op by op, the rows are first copied out
    (an index_select) and then read again by a product: for 16 random blocks of 64 keys a
    head at batch 8 from an 8192-key cache (12 heads of 64), the gathers and products of keys
    and values took 11 ms, this loop and `gathered_sum` 4 ms. Eager where compiling is off
    (GatheredDots.COMPILE = False) or fails. Inside an outer torch.compile (a compiled decoding
    step): on a CPU the custom op `gathered_dots`, which runs this loop; on a GPU
    `_gathered_dots` traced into the step's graph. Which ran is said once (`path`; nothing is
    said inside a trace)."""

    # DECODE_COMPILED_GATHER=0 sets COMPILE False for a process and its children (the test
    # suite does, so that each test process does not pay the compile; tests/test_decode.py
    # turns it back on).
    COMPILE = os.environ.get("DECODE_COMPILED_GATHER", "1") != "0"
    _compiled = None  # the compiled function once compiled; False once compiling failed
    path = None

    @classmethod
    def run(cls, q, table, rows):
        """_gathered_dots(q, table, rows): compiled on a CPU (on a GPU, where decoding is bound by
        launches, not bytes, the eager form: not yet timed there)."""
        if torch.compiler.is_compiling():  # in a compiled step: on a CPU this loop, opaque; else inductor's
            return gathered_dots(q, table, rows) if q.device.type == "cpu" else _gathered_dots(q, table, rows)
        fn = cls._compile() if q.device.type == "cpu" and compiled_helper_usable() else None
        if fn is not None:
            # every size may vary but D's, a head's width: with D fixed the loop over a row is
            # unrolled (1.6x faster than with D a symbol). maybe_: a size of 1 stays specialised
            for t, dims in ((q, (0,)), (table, (0,)), (rows, (0, 1))):
                torch._dynamo.maybe_mark_dynamic(t, dims)
            try:
                dots = fn(q, table, rows)
                cls._say("compiled (torch.compile)")
                return dots
            except Exception as e:  # no C++ compiler, an inductor error: this call and the next eager
                cls._failed(e)
        return torch.bmm(table[rows], q[:, :, None]).squeeze(-1).float()  # the rows copied, then one product

    @classmethod
    def _compile(cls):
        if not cls.COMPILE:
            cls._say("eager (GatheredDots.COMPILE is False)")
            return None
        if cls._compiled is None:
            cls._compiled = torch.compile(_gathered_dots, dynamic=False)  # compiled at the first call
        return cls._compiled or None

    @classmethod
    def _failed(cls, e):
        cls._compiled = False
        cls._say(f"eager (torch.compile failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:160]})")

    @classmethod
    def _say(cls, path):
        if cls.path != path:
            cls.path = path
            print(f"kernels.py: the dots with selected cache rows (GatheredDots): {path}", file=sys.stderr, flush=True)


@torch.library.custom_op("sparse_attention::gathered_dots", mutates_args=())
def gathered_dots(q: torch.Tensor, table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`GatheredDots.run`, opaque to inductor: inside a compiled decoding step on a CPU the dots
    with the named rows run this file's compiled loop, as the eager step does, on the query
    computed once. Traced into the step's graph, inductor fused the query's norm and RoPE (a
    power, a cosine and a sine per element) into its loop over the named rows, recomputing them
    for every row: nsa's loop took 7.8 ms a layer at batch 8, T = 8192 (256 rows per query
    head), where the compiled loop alone takes ~1.8 ms."""
    return GatheredDots.run(q, table, rows)


@gathered_dots.register_fake
def _(q, table, rows):
    return q.new_empty(rows.shape, dtype=torch.float32)


def gathered_sum(p, table, rows):
    """(Q, D): sum_j p[i, j] table[rows[i, j]], p and rows (Q, m): the probabilities times the
    values the selection names, read where they lie (`F.embedding_bag`: each row is a bag of
    m table rows, weighted; one pass over the rows named, where a gather and a product read
    them twice and wrote a copy between: 1.3 ms against 3.7 ms for nsa's 16 x 64 values a
    head at batch 8)."""
    return F.embedding_bag(rows, table, mode="sum", per_sample_weights=p.to(table.dtype))


def _positions(T, S, q_start, k_start, device):
    """(T, S) long: each query's position minus each key's."""
    return (q_start + torch.arange(T, device=device))[:, None] - (k_start + torch.arange(S, device=device))


def decode_attention(q, k, v, scale, q_start, k_start, window=None, window_from=0, bias=None):
    """attention.attention over the keys a query can see: with a window binding every query,
    the last window + T keys only (a slice of the cache, no copy)."""
    key_offset(q, k, q_start, k_start)
    q, k, v = _same_dtype(q, k, v)
    T = q.shape[2]
    if window is not None and q_start >= window_from:
        first = max(0, q_start - window - k_start)
        k, v, k_start = k[:, :, first:], v[:, :, first:], k_start + first
    every = _every_key_seen(T, k.shape[2], q_start, k_start, window, window_from)
    dist = _positions(T, k.shape[2], q_start, k_start, q.device) if bias is not None or not every else None
    seen = None if every else dist >= 0
    if seen is not None and window is not None:
        seen = seen & ((dist <= window) | (q_start + torch.arange(T, device=q.device)[:, None] < window_from))
    logits = _decode_logits(q, k, scale)
    if bias is not None:
        B, H = q.shape[:2]
        b = torch.arange(B, device=q.device)[:, None, None, None]
        h = torch.arange(H, device=q.device)[None, :, None, None]
        t = torch.arange(T, device=q.device)[None, None, :, None]
        logits = logits + bias(b, h, t, dist[None, None])
    return _decode_output(_softmax_or_zero(logits, seen), v)


def _every_key_seen(T, S, q_start, k_start, window=None, window_from=0):
    """Whether every query q_start .. q_start + T - 1 sees every key k_start .. k_start + S - 1
    (a one-token step after its cache, the window's keys sliced): then the softmax needs no
    mask, whose masked copies were each a pass over the (B, H, T, S) logits."""
    last_q, first_q, last_k = q_start + T - 1, q_start, k_start + S - 1
    return last_k <= first_q and (window is None or last_q < window_from or last_q - k_start <= window)


PAIR_GATE_HIDDEN = 1 << 24  # decode_pair_gated_attention: hidden units of one chunk of keys (64 MB)


def decode_pair_gated_attention(q, k, v, q_term, k_term, w2, b2, scale, q_start, k_start, gate_space="logit"):
    """attention.pair_gated_attention: the gate of every (query, key) pair ([ASGA] eq. 1, which
    reads every key). On a CPU through asga's compiled gate tile (`gate_tile_logits`, GateTile:
    the add, GELU and sum over r in one loop, no (B, H, T, S, r) hidden tensor; the per-key
    terms come from the cache stored along the keys, `keys_last_summaries`): a batch-8 step at
    T = 8192 took 1.9x `full`'s with the hidden tensor built op by op. Else built a chunk of
    keys at a time (at most PAIR_GATE_HIDDEN hidden units)."""
    key_offset(q, k, q_start, k_start)
    q, k, v = _same_dtype(q, k, v)
    B, H, T, _ = q.shape
    S, r = k.shape[2], q_term.shape[-1]
    logits = _decode_logits(q, k, scale)  # (B, H, T, S)
    tracing = torch.compiler.is_compiling()  # inside a compiled step: the tile's maths, fused in its graph
    compiled = GateTile._compile() if q.device.type == "cpu" and not tracing else None
    if compiled is not None or tracing:
        qt = q_term.float().reshape(B * H, T, r).transpose(1, 2).contiguous()  # (B H, r, T), as a tile's
        kt = k_term.float().transpose(-2, -1).reshape(B * H, r, S)  # a view of the cache's keys-last terms
        args = qt, kt, w2.float().repeat(B, 1)
        z = (gate_tile_logits(*args) if tracing else GateTile.run_compiled(compiled, 0, *args)).view(B, H, T, S)
    else:
        step = max(1, PAIR_GATE_HIDDEN // (B * H * T * r))
        z = torch.cat([torch.einsum("bhtsr,hr->bhts", F.gelu(q_term.float()[:, :, :, None] + k_term.float()[:, :, None, c0:c0 + step]),
                                    w2.float()) for c0 in range(0, S, step)], -1)
    z = z + b2.float()[None, :, None, None]  # (B, H, T, S)
    logits = logits * torch.sigmoid(z) if gate_space == "logit" else logits + F.logsigmoid(z)
    seen = None if _every_key_seen(T, S, q_start, k_start) else _positions(T, S, q_start, k_start, q.device) >= 0
    return _decode_output(_softmax_or_zero(logits, seen), v)


def decode_topk_attention(q, k, v, scale, q_start, k_start, k_per_query, k_max):
    """attention.topk_mask's keys attended: every visible key scored (the definition ranks them
    all), the k_max highest found by one top-k (a selection, not a sort), the k_i-th of them
    the threshold, every key reaching it kept (attention.topk_mask's tie rule); then one
    softmax over the kept keys alone, and only their values read, from the cache by index
    (`gathered_sum`): not the (rows, S) product with every value that a mask of zeros would
    multiply. Where no more keys reach the threshold than the top-k holds (always, unless
    scores tie across its end), the kept keys are the top-k's own: one count, read back once
    a call, says so; otherwise a second top-k over the count kept finds them. (A second top-k
    every call made caa's step 1.10x as long at batch 1, 1.17x at batch 8, T = 8192.)"""
    key_offset(q, k, q_start, k_start)
    q, k, v = _same_dtype(q, k, v)
    B, H, T, _ = q.shape
    S = k.shape[2]
    visible = _decode_logits(q, k, scale)
    if not _every_key_seen(T, S, q_start, k_start):
        visible = visible.masked_fill_(_positions(T, S, q_start, k_start, q.device) < 0, NEG_INF)
    logits, at = visible.topk(min(k_max, S), -1)  # (B, H, T, k_max), highest first
    kth = logits.gather(-1, (k_per_query - 1).clamp(max=logits.shape[-1] - 1).view(1, 1, T, 1).expand(*logits.shape[:3], 1))
    reach = int((visible >= kth).sum(-1).max())  # keys at or above the threshold, the most of any row
    if reach > logits.shape[-1]:  # ties past the top-k's end (or a row seeing fewer keys than k_i)
        logits, at = visible.topk(reach, -1)
    logits = logits.masked_fill(logits < kth, NEG_INF)  # the kept keys, then -inf (never seen: -inf already)
    table, rows, _ = _cached_rows(v, H, at)  # (B, H, T, m, 1)
    p = _softmax_or_zero(logits, logits > NEG_INF)
    m = at.shape[-1]
    return gathered_sum(p.reshape(-1, m), table, rows.reshape(-1, m)).view(B, H, T, v.shape[-1])


def decode_combiner_attention(q, k, v, kbar, vbar, scale, q_start, k_start, block):
    """attention.combiner_attention: one softmax over the keys of each query's own block (the
    cache keeps the last block's keys) and the summaries of every earlier block."""
    key_offset(q, k, q_start, k_start)
    q, k, v, kbar, vbar = _same_dtype(q, k, v, kbar, vbar)
    T, S, R = q.shape[2], k.shape[2], kbar.shape[2]
    q_pos = q_start + torch.arange(T, device=q.device)[:, None]  # (T, 1)
    k_pos = k_start + torch.arange(S, device=q.device)
    direct = (k_pos <= q_pos) & (k_pos // block == q_pos // block)  # (T, S)
    span = torch.arange(R, device=q.device) < q_pos // block  # (T, R)
    logits = torch.cat([_decode_logits(q, k, scale), _decode_logits(q, kbar, scale)], -1)  # (B, H, T, S + R)
    p = _softmax_or_zero(logits, torch.cat([direct, span], -1))
    return _decode_output(p[..., :S], v) + (p[..., S:].to(vbar.dtype) @ vbar)


def decode_block_attention(q, k, v, scale, q_start, k_start, block, blocks):
    """attention.block_attention: each query's n blocks gathered from the cache by index (T n
    block keys per head), one softmax over them."""
    key_offset(q, k, q_start, k_start)
    q, k, v = _same_dtype(q, k, v)
    B, H, T, D = q.shape
    k_table, k_rows, v_table, v_rows, pos = _cached_kv_rows(k, v, H, blocks * block - k_start, block)  # the blocks alone
    first = q_start - k_start  # the first query as a key index
    q_pos = torch.arange(first, first + T, device=q.device)[:, None, None]  # each query's key index
    # (B, H, T, n, block): a key of a listed block (an empty slot's, -1's, lie before
    # position 0), listed once, cached and seen (so < S)
    ok = ~repeated(blocks)[..., None] & (pos >= 0) & (pos <= q_pos)
    m = ok.shape[3] * block
    logits = GatheredDots.run(q.reshape(B * H * T, D), k_table, k_rows.reshape(-1, m)).view(B, H, T, m) * scale
    p = _softmax_or_zero(logits, ok.flatten(3, 4))
    return gathered_sum(p.view(-1, m), v_table, v_rows.reshape(-1, m)).view(B, H, T, D)


def decode_selected_attention(q, k, v, scale, q_start, k_start, keys):
    """attention.selected_attention: each query's listed keys read from the cache where they
    lie (`listed_rows_attention`), shared by the query heads of a key head."""
    key_offset(q, k, q_start, k_start)
    q, k, v = _same_dtype(q, k, v)
    return listed_rows_attention(q, k, v, keys, q_start - k_start, scale)


def listed_rows_attention(q, k, v, keys, first, scale=1.0):
    """One softmax over the keys each query lists, read where they lie in k and v (B, Hkv, S, D)
    (`_cached_kv_rows`, `GatheredDots`, `gathered_sum`), shared by the query heads of a key
    head: q (B, H, T, D), keys (B, T, n) indices into the S keys (-1 empty), query t at key
    index first + t (it sees keys <= that); a query seeing none gets 0, as in the reference."""
    B, H, T, D = q.shape
    n = keys.shape[-1]
    k_table, k_rows, v_table, v_rows, _ = _cached_kv_rows(k, v, H, keys.clamp(min=0)[:, None])  # (B, H, T, n, 1)
    logits = GatheredDots.run(q.reshape(B * H * T, D), k_table, k_rows.reshape(-1, n)).view(B, H, T, n) * scale
    ok = (keys >= 0) & (keys <= first + torch.arange(T, device=q.device)[:, None])  # (B, T, n) visible
    p = _softmax_or_zero(logits, ok[:, None])  # (B, H, T, n)
    return gathered_sum(p.view(-1, n), v_table, v_rows.reshape(-1, n)).view(B, H, T, D)


def _decode_compressed_probs(q, k_cmp, scale, q_start, length, stride):
    """(B, H, T, C) float32: attention.compressed_probs, the compressed keys read once per key head.
    Under autocast the logits are the autocast dtype's product, rounded to it (float32 products
    would read a float32 copy of the compressed keys each step, 5x the bytes of bf16's): a
    step's choice can differ from a prefill's where two block scores lie within that rounding."""
    T, C = q.shape[2], k_cmp.shape[2]
    seen = None  # every query sees every compressed key cached (a one-token step): no mask
    if not 0 < C or (C - 1) * stride + length - 1 > q_start:
        q_pos = q_start + torch.arange(T, device=q.device)[:, None]
        seen = torch.arange(C, device=q.device) * stride + length - 1 <= q_pos  # (T, C): complete by then
    return _softmax_or_zero(_decode_logits(q, k_cmp, scale), seen)


def decode_compressed_branch(q, k_cmp, v_cmp, scale, q_start, length, stride, block, choose):
    """attention.compressed_branch over the compressed keys the cache keeps: their
    probabilities computed once (the compressed keys read once), the output and the block
    scores (eq. 9 as sliding sums) both from them."""
    q, k_cmp, v_cmp = _same_dtype(q, k_cmp, v_cmp)
    p = _decode_compressed_probs(q, k_cmp, scale, q_start, length, stride)
    out = _decode_output(p, v_cmp)
    if choose is None:
        return out, None
    J = ceil_div(q_start + q.shape[2], block)
    return out, choose(padded_block_scores(p.detach(), J, length, stride, block), q_start)


@torch.no_grad()
def decode_indexer_topk(q_idx, k_idx, w, q_start, k_start, n):
    """attention.indexer_topk: the lightning scores of every cached indexer key (eq. 1 reads
    them all), then a top-n selection (`_top_n`). The product reads the cached keys (B, S, d)
    once, whichever way they lie: stored along the keys (a CPU's cache,
    `keys_last_summaries`), the step's few (T J) query rows times K^T, whose rows of S are
    then contiguous (`keys_times`, in pieces of 32 of them: with caches cold, 4 rows x 64 x
    32768 keys 1.3 ms, against 1.1 for a plain sum); stored as rows, key-major, the keys the
    long side of the product (as its short side, q k^T, it took 1.8x as long from memory at
    S = 8192)."""
    B, T, J, d = q_idx.shape
    S = k_idx.shape[1]
    # under autocast the products run in its dtype (bmm and einsum are autocast's), so the
    # cached keys are read as they are: cast to float32 first, they were cast back for the
    # product, two passes over every cached key a step for the same products, to the bit
    k = k_idx if torch.is_autocast_enabled(q_idx.device.type) else k_idx.float()
    q_rows = q_idx.float().reshape(B, T * J, d)
    if k.stride(1) == 1:  # positions the fastest-moving dim
        dots = keys_times(q_rows, k.transpose(1, 2)).div_(math.sqrt(d)).relu_().view(B, T, J, S)
        scores = torch.einsum("btjs,btj->bts", dots, w.float())
    else:
        dots = torch.bmm(k, q_rows.transpose(1, 2)).div_(math.sqrt(d)).relu_().view(B, S, T, J)  # (B, S, T, J)
        scores = torch.einsum("bstj,btj->bts", dots, w.float())  # the heads' weighted sum as a product
    if not _every_key_seen(T, S, q_start, k_start):  # a one-token step sees every cached key: no mask
        scores = scores.masked_fill_(_positions(T, S, q_start, k_start, q_idx.device) < 0, NEG_INF)  # future keys
    return _top_n(scores, min(n, S), narrow=True)


DECODE = Ops(
    name="decode (kernels.py: the cache's keys and summaries the selection names)", attention=decode_attention,
    pair_gated_attention=decode_pair_gated_attention, topk_attention=decode_topk_attention,
    combiner_attention=decode_combiner_attention, block_attention=decode_block_attention,
    selected_attention=decode_selected_attention, compressed_branch=decode_compressed_branch,
    indexer_topk=decode_indexer_topk, indexer_kl=chunked_indexer_kl,
    mean_pair_gate=chunked_mean_pair_gate, top_n=_top_n, moba_select=functools.partial(moba_select, select=_top_n))
