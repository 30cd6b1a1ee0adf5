"""Triton kernels of this project's own, where FlexAttention's generated ones fall short.

asga's pair-gated attention ([ASGA] eqs. 1-3; attention.pair_gated_attention is the
definition). Through FlexAttention the gate is a score_mod reading 3 r + 2 captured tensors
that need gradients, and FlexAttention's backward makes each such gradient by an atomic add
per score: on an H200 at T = 4096 its backward took 212 of 245 ms, 151x flash SDPA
(benchmarks/gpu_runs/h200_2026-11-28b.md). Here, FlashAttention-2's split:

  forward   one program per (query block, head): the key blocks in turn, the gate recomputed
            per tile from the r query and key terms, an online softmax; keeps out and LSE.
  backward  two passes that recompute the tile. Per key block (dk, dv and the key terms'
            gradients: sums over a tile's rows, kept in registers); per query block (dq and the
            per-row gradients: query terms, b2, the head scale; w2's a partial sum a block).
            No atomics; every gradient written once.

The gate, with a = scale * q.k and z = b2 + sum_c w2_c GELU(qt_c + kt_c) (exact GELU):
  gate_space 'logit' (the paper's eq. 3):   m = a * sigmoid(z)
  gate_space 'prob'  (this project's):      m = a + log sigmoid(z) - log sigmoid(b2)
(the constant in 'prob' is kernels.flex_pair_gated_attention's: the softmax ignores it, and
it keeps b2's gradient from cancelling terms). P = softmax over visible keys of m, out = P v.
Backward, with dM = P (dP - rowsum(dO * out)):
  'logit': da = dM sigmoid(z), dz = dM a sigmoid(z) (1 - sigmoid(z)), db2 = sum dz
  'prob':  da = dM, dz = dM (1 - sigmoid(z)), db2 = sum dM (sigmoid(b2) - sigmoid(z))
  dqt_c = sum_j dz w2_c GELU'(x_c), dkt_c = sum_i (same), dw2_c = sum_ij dz GELU(x_c),
  dscale = sum_ij da q.k; dq, dk from da * scale, dv from P, as in any attention.

nsa's selection ([NSA] eqs. 8-12): `block_scores` and `top_blocks` at the end of this file,
forward only, the compressed attention's probabilities a tile at a time in registers where
the torch form (kernels.chunked_block_scores) writes them to memory; `top_blocks` chooses
the blocks in the same pass, the (T, J) block scores never stored.

Imported only where it runs: a CUDA tensor (kernels.flex_pair_gated_attention,
kernels.flex_compressed_branch), or Triton's interpreter on CPU tensors (TRITON_INTERPRET=1,
tests/test_kernels_triton.py).
"""
import os

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
INV_SQRT2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)

# (query rows, keys, warps) of each kernel's tile. The gate's r GELUs per score set the
# registers: these compile for sm_90 and sm_80 without spilling, by ptxas -v
# (`python benchmarks/asga_kernel.py --compile`: benchmarks/gpu_compile/asga_triton_sm90_sm80_2026-11-28.txt;
# 32 x 64 backward tiles spill 300-700 bytes on sm_80). Not yet timed on a GPU; the
# interpreter's tests use smaller ones.
TILES = dict(fwd=(64, 64, 8), bwd_kv=(32, 32, 4), bwd_q=(32, 32, 4))
# The backward: "split", one kernel over key blocks (dk, dv, the key terms') and one over query
# blocks (dq and the per-row gradients), each computing the gate and its derivative, no atomics
# (bit-reproducible); or "fused" (`_bwd_fused_kernel`, at bwd_kv's tiles): one pass, the gate
# once, the per-row gradients by atomic adds. On an H200 the split pair took 60 of asga's 74 ms
# at T = 4096 (benchmarks/gpu_runs/h200_2026-12-04.md); the fused one is not yet timed there
# (`python benchmarks/asga_kernel.py --backward=split,fused`). ASGA_BACKWARD=fused chooses it.
BACKWARD = os.environ.get("ASGA_BACKWARD", "split")


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """tl.dot: 0 the inputs' own (bf16 on tensor cores, float32 accumulation); 1 float32 in
    full precision (TF32 would lose the reference's 1e-5); 2 16-bit inputs widened first, for
    Triton's interpreter, whose dot misreads them (the products are the same: a bf16 x bf16
    product is exact in float32)."""
    if IEEE == 1:
        return tl.dot(a, b, input_precision="ieee")
    if IEEE == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


def _precision(dtype):
    """_dot's IEEE for inputs of this dtype."""
    if dtype == torch.float32:
        return 1
    return 2 if os.environ.get("TRITON_INTERPRET") == "1" else 0


@triton.jit
def _gelu(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * INV_SQRT2))


@triton.jit
def _gelu_and_grad(x):
    """(GELU(x), GELU'(x)) from one erf."""
    cdf = 0.5 * (1.0 + tl.math.erf(x * INV_SQRT2))
    return x * cdf, cdf + x * INV_SQRT_2PI * tl.exp(-0.5 * x * x)


@triton.jit
def _log_sigmoid(z):
    return tl.minimum(z, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(z)))


@triton.jit
def _unit_input(qt_ptr, kt_ptr, offs_m, offs_n, T, S, R: tl.constexpr, c):
    """x (BM, BN): hidden unit c's input qt[i, c] + kt[j, c] ([ASGA] eq. 1's W1 [LN q; LN k] + b1)."""
    qc = tl.load(qt_ptr + offs_m * R + c, mask=offs_m < T, other=0.0)
    kc = tl.load(kt_ptr + offs_n * R + c, mask=offs_n < S, other=0.0)
    return qc[:, None] + kc[None, :]


@triton.jit
def _row_block(X, bh, offs_m, offs_d, T, D: tl.constexpr):
    """Rows offs_m of head bh's (T, D) slice of X, zeros past T."""
    return tl.load(X + bh * T * D + offs_m[:, None] * D + offs_d[None, :], mask=offs_m[:, None] < T, other=0.0)


@triton.jit
def _head(QT, KT, W2, B2, SC, bh, T, S, H, HKV, R: tl.constexpr):
    """A program's (batch, head) row bh: (its key head's row of K and V, the head's scale and
    b2, and its pointers into the query terms, the key terms and w2)."""
    h = bh % H
    kvh = (bh // H) * HKV + h // (H // HKV)
    return kvh, tl.load(SC + h), tl.load(B2 + h), QT + bh * T * R, KT + bh * S * R, W2 + h * R


@triton.jit
def _row_stats(LSE, DELTA, bh, offs_m, T):
    """(lse, delta) of a block of query rows, the forward's log-sum-exp and rowsum(dO * O)."""
    return (tl.load(LSE + bh * T + offs_m, mask=offs_m < T, other=0.0),
            tl.load(DELTA + bh * T + offs_m, mask=offs_m < T, other=0.0))


@triton.jit
def _gate_logit(qt_ptr, kt_ptr, w2_ptr, b2, offs_m, offs_n, T, S, R: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr):
    """z (BM, BN) float32: b2 + sum_c w2_c GELU(qt[i, c] + kt[j, c]) ([ASGA] eq. 1)."""
    z = tl.zeros((BM, BN), dtype=tl.float32) + b2
    for c in range(R):
        z += tl.load(w2_ptr + c) * _gelu(_unit_input(qt_ptr, kt_ptr, offs_m, offs_n, T, S, R, c))
    return z


@triton.jit
def _tile(q, k, sc, z, b2, offs_m, offs_n, T, S, q_start, k_start, PROB: tl.constexpr, IEEE: tl.constexpr):
    """(qk, a, sigmoid(z), the modified logits m with invisible pairs at -inf, visible)."""
    qk = _dot(q, tl.trans(k), IEEE)
    a = qk * sc
    sig = tl.sigmoid(z)
    if PROB:
        m = a + _log_sigmoid(z) - _log_sigmoid(b2)
    else:
        m = a * sig
    visible = ((q_start + offs_m[:, None]) >= (k_start + offs_n[None, :])) & (offs_m[:, None] < T) & \
        (offs_n[None, :] < S)
    return qk, a, sig, tl.where(visible, m, float("-inf")), visible


@triton.jit
def _fwd_kernel(Q, K, V, QT, KT, W2, B2, SC, O, LSE, T, S, H, HKV, q_start, k_start,
                D: tl.constexpr, R: tl.constexpr, PROB: tl.constexpr, IEEE: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    kvh, sc, b2, qt_ptr, kt_ptr, w2_ptr = _head(QT, KT, W2, B2, SC, bh, T, S, H, HKV, R)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    q = _row_block(Q, bh, offs_m, offs_d, T, D)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    hi = tl.minimum(S, q_start + pid_m * BM + BM - k_start)  # past the last key this block sees
    for n0 in range(0, hi, BN):
        offs_n = n0 + tl.arange(0, BN)
        k, v = _row_block(K, kvh, offs_n, offs_d, S, D), _row_block(V, kvh, offs_n, offs_d, S, D)
        z = _gate_logit(qt_ptr, kt_ptr, w2_ptr, b2, offs_m, offs_n, T, S, R, BM, BN)
        _, _, _, m, _ = _tile(q, k, sc, z, b2, offs_m, offs_n, T, S, q_start, k_start, PROB, IEEE)
        m_new = tl.maximum(m_i, tl.max(m, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet
        p = tl.exp2((m - m_safe[:, None]) * LOG2E)
        alpha = tl.exp2((m_i - m_safe) * LOG2E)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(O + bh * T * D + offs_m[:, None] * D + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=offs_m[:, None] < T)
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(LSE + bh * T + offs_m, lse, mask=offs_m < T)


@triton.jit
def _backward_tile(q, k, v, do, lse, delta, sc, b2, qt_ptr, kt_ptr, w2_ptr, offs_m, offs_n, T, S, q_start, k_start,
                   R: tl.constexpr, PROB: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """A tile's (qk, p, dM, da, dz) of the backward (module docstring)."""
    z = _gate_logit(qt_ptr, kt_ptr, w2_ptr, b2, offs_m, offs_n, T, S, R, BM, BN)
    qk, a, sig, m, visible = _tile(q, k, sc, z, b2, offs_m, offs_n, T, S, q_start, k_start, PROB, IEEE)
    p = tl.where(visible, tl.exp2((m - lse[:, None]) * LOG2E), 0.0)
    dp = _dot(do, tl.trans(v), IEEE)
    dm = p * (dp - delta[:, None])
    if PROB:
        da = dm
        dz = dm * (1.0 - sig)
    else:
        da = dm * sig
        dz = dm * a * sig * (1.0 - sig)
    return qk, p, dm, da, dz, sig


@triton.jit
def _key_block(K, V, kvh, pid_n, S, q_start, k_start, D: tl.constexpr, RP: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr):
    """A backward program's key block: (its key offsets, the head dim's, the hidden units',
    its keys and values, the first query block that sees it)."""
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    k, v = _row_block(K, kvh, offs_n, offs_d, S, D), _row_block(V, kvh, offs_n, offs_d, S, D)
    lo = tl.maximum(0, k_start + pid_n * BN - q_start)  # the first query that sees this block
    return offs_n, offs_d, tl.arange(0, RP), k, v, (lo // BM) * BM


@triton.jit
def _store_key_grads(DK, DV, DKT, dk, dv, dkt, bh, offs_n, offs_d, units, S, R: tl.constexpr, D: tl.constexpr):
    """A key block's dk, dv and key terms' gradients, kept in registers over its query blocks."""
    out = bh * S * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(DK + out, dk, mask=offs_n[:, None] < S)
    tl.store(DV + out, dv, mask=offs_n[:, None] < S)
    tl.store(DKT + bh * S * R + offs_n[:, None] * R + units[None, :], dkt,
             mask=(offs_n[:, None] < S) & (units[None, :] < R))


@triton.jit
def _bwd_kv_kernel(Q, K, V, QT, KT, W2, B2, SC, DO, LSE, DELTA, DK, DV, DKT, T, S, H, HKV, q_start, k_start,
                   D: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, PROB: tl.constexpr, IEEE: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr):
    pid_n, bh = tl.program_id(0), tl.program_id(1)
    kvh, sc, b2, qt_ptr, kt_ptr, w2_ptr = _head(QT, KT, W2, B2, SC, bh, T, S, H, HKV, R)
    offs_n, offs_d, units, k, v, first = _key_block(K, V, kvh, pid_n, S, q_start, k_start, D, RP, BM, BN)
    dk = tl.zeros((BN, D), tl.float32)
    dv = tl.zeros((BN, D), tl.float32)
    dkt = tl.zeros((BN, RP), tl.float32)
    for m0 in range(first, T, BM):
        offs_m = m0 + tl.arange(0, BM)
        q, do = _row_block(Q, bh, offs_m, offs_d, T, D), _row_block(DO, bh, offs_m, offs_d, T, D)
        lse, delta = _row_stats(LSE, DELTA, bh, offs_m, T)
        _, p, _, da, dz, _ = _backward_tile(q, k, v, do, lse, delta, sc, b2, qt_ptr, kt_ptr, w2_ptr, offs_m, offs_n,
                                            T, S, q_start, k_start, R, PROB, IEEE, BM, BN)
        dv += _dot(tl.trans(p.to(do.dtype)), do, IEEE)
        dk += _dot(tl.trans((da * sc).to(q.dtype)), q, IEEE)
        for c in range(R):
            _, gelu_grad = _gelu_and_grad(_unit_input(qt_ptr, kt_ptr, offs_m, offs_n, T, S, R, c))
            g = tl.sum(dz * gelu_grad, 0) * tl.load(w2_ptr + c)  # (BN,)
            dkt += tl.where(units[None, :] == c, g[:, None], 0.0)
    _store_key_grads(DK, DV, DKT, dk, dv, dkt, bh, offs_n, offs_d, units, S, R, D)


@triton.jit
def _bwd_q_kernel(Q, K, V, QT, KT, W2, B2, SC, DO, LSE, DELTA, DQ, DQT, DSC, DB2, DW2, T, S, H, HKV, q_start, k_start,
                  D: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, PROB: tl.constexpr, IEEE: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    kvh, sc, b2, qt_ptr, kt_ptr, w2_ptr = _head(QT, KT, W2, B2, SC, bh, T, S, H, HKV, R)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    q, do = _row_block(Q, bh, offs_m, offs_d, T, D), _row_block(DO, bh, offs_m, offs_d, T, D)
    lse, delta = _row_stats(LSE, DELTA, bh, offs_m, T)
    dq = tl.zeros((BM, D), tl.float32)
    dqt = tl.zeros((BM, RP), tl.float32)
    dw2 = tl.zeros((RP,), tl.float32)
    dsc = tl.zeros((BM,), tl.float32)
    db2 = tl.zeros((BM,), tl.float32)
    units = tl.arange(0, RP)
    hi = tl.minimum(S, q_start + pid_m * BM + BM - k_start)
    for n0 in range(0, hi, BN):
        offs_n = n0 + tl.arange(0, BN)
        k, v = _row_block(K, kvh, offs_n, offs_d, S, D), _row_block(V, kvh, offs_n, offs_d, S, D)
        qk, _, dm, da, dz, sig = _backward_tile(q, k, v, do, lse, delta, sc, b2, qt_ptr, kt_ptr, w2_ptr, offs_m,
                                                offs_n, T, S, q_start, k_start, R, PROB, IEEE, BM, BN)
        dq += _dot((da * sc).to(k.dtype), k, IEEE)
        dsc += tl.sum(da * qk, 1)
        if PROB:
            db2 += tl.sum(dm * (tl.sigmoid(b2) - sig), 1)
        else:
            db2 += tl.sum(dz, 1)
        for c in range(R):
            gelu, gelu_grad = _gelu_and_grad(_unit_input(qt_ptr, kt_ptr, offs_m, offs_n, T, S, R, c))
            g = tl.sum(dz * gelu_grad, 1) * tl.load(w2_ptr + c)  # (BM,)
            dqt += tl.where(units[None, :] == c, g[:, None], 0.0)
            dw2 += tl.where(units == c, tl.sum(tl.sum(dz * gelu, 1), 0), 0.0)
    tl.store(DQ + bh * T * D + offs_m[:, None] * D + offs_d[None, :], dq, mask=offs_m[:, None] < T)
    tl.store(DQT + bh * T * R + offs_m[:, None] * R + units[None, :], dqt,
             mask=(offs_m[:, None] < T) & (units[None, :] < R))
    tl.store(DSC + bh * T + offs_m, dsc, mask=offs_m < T)
    tl.store(DB2 + bh * T + offs_m, db2, mask=offs_m < T)
    tl.store(DW2 + (bh * tl.num_programs(0) + pid_m) * RP + units, dw2)


@triton.jit
def _bwd_fused_kernel(Q, K, V, QT, KT, W2, B2, SC, DO, LSE, DELTA, DQ, DK, DV, DQT, DKT, DSC, DB2, DW2, T, S, H, HKV,
                      q_start, k_start, D: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, PROB: tl.constexpr,
                      IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """`BACKWARD = "fused"`: both backward kernels' work in one pass over key blocks, the gate
    and its derivative computed once per pair where the split pair computes them twice. A key
    block keeps dk, dv, its key terms' and w2's gradients in registers (as `_bwd_kv_kernel`);
    each tile adds its rows' dq, query terms', scale's and b2's gradients into DQ, DQT, DSC,
    DB2 (zeroed) by atomic adds: FlashAttention-2's dq, a (BM, D + r + 2) block a tile, not one
    add a score as FlexAttention's captured tensors take. Not bit-reproducible: float32 adds
    land in any order."""
    pid_n, bh = tl.program_id(0), tl.program_id(1)
    kvh, sc, b2, qt_ptr, kt_ptr, w2_ptr = _head(QT, KT, W2, B2, SC, bh, T, S, H, HKV, R)
    offs_n, offs_d, units, k, v, first = _key_block(K, V, kvh, pid_n, S, q_start, k_start, D, RP, BM, BN)
    dk = tl.zeros((BN, D), tl.float32)
    dv = tl.zeros((BN, D), tl.float32)
    dkt = tl.zeros((BN, RP), tl.float32)
    dw2 = tl.zeros((RP,), tl.float32)
    for m0 in range(first, T, BM):
        offs_m = m0 + tl.arange(0, BM)
        rows = bh * T + offs_m
        q, do = _row_block(Q, bh, offs_m, offs_d, T, D), _row_block(DO, bh, offs_m, offs_d, T, D)
        lse, delta = _row_stats(LSE, DELTA, bh, offs_m, T)
        qk, p, dm, da, dz, sig = _backward_tile(q, k, v, do, lse, delta, sc, b2, qt_ptr, kt_ptr, w2_ptr, offs_m,
                                                offs_n, T, S, q_start, k_start, R, PROB, IEEE, BM, BN)
        dv += _dot(tl.trans(p.to(do.dtype)), do, IEEE)
        dk += _dot(tl.trans((da * sc).to(q.dtype)), q, IEEE)
        tl.atomic_add(DQ + rows[:, None] * D + offs_d[None, :], _dot((da * sc).to(k.dtype), k, IEEE),
                      mask=offs_m[:, None] < T)
        tl.atomic_add(DSC + rows, tl.sum(da * qk, 1), mask=offs_m < T)
        if PROB:
            tl.atomic_add(DB2 + rows, tl.sum(dm * (tl.sigmoid(b2) - sig), 1), mask=offs_m < T)
        else:
            tl.atomic_add(DB2 + rows, tl.sum(dz, 1), mask=offs_m < T)
        dqt = tl.zeros((BM, RP), tl.float32)
        for c in range(R):
            gelu, gelu_grad = _gelu_and_grad(_unit_input(qt_ptr, kt_ptr, offs_m, offs_n, T, S, R, c))
            g = dz * gelu_grad * tl.load(w2_ptr + c)
            dkt += tl.where(units[None, :] == c, tl.sum(g, 0)[:, None], 0.0)
            dqt += tl.where(units[None, :] == c, tl.sum(g, 1)[:, None], 0.0)
            dw2 += tl.where(units == c, tl.sum(tl.sum(dz * gelu, 1), 0), 0.0)
        tl.atomic_add(DQT + rows[:, None] * R + units[None, :], dqt, mask=(offs_m[:, None] < T) & (units[None, :] < R))
    _store_key_grads(DK, DV, DKT, dk, dv, dkt, bh, offs_n, offs_d, units, S, R, D)
    tl.store(DW2 + (bh * tl.num_programs(0) + pid_n) * RP + units, dw2)


def _launch_args(q, k):
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    return B, H, T, D, Hkv, S


def forward(q, k, v, q_term, k_term, w2, b2, scale, q_start, k_start, prob):
    """(out (B, H, T, D) in q's dtype, lse (B, H, T) float32, natural log, -inf where a row
    sees no key, whose output is 0 as FlexAttention's). q (B, H, T, D); k, v (B, Hkv, S, D),
    one dtype; q_term (B, H, T, r), k_term (B, H, S, r), w2 (H, r), b2 (H,), scale (H,):
    float32; all contiguous."""
    B, H, T, D, Hkv, S = _launch_args(q, k)
    BM, BN, warps = TILES["fwd"]
    out = torch.empty_like(q)
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    _fwd_kernel[(triton.cdiv(T, BM), B * H)](
        q, k, v, q_term, k_term, w2, b2, scale, out, lse, T, S, H, Hkv, q_start, k_start,
        D=D, R=q_term.shape[-1], PROB=prob, IEEE=_precision(q.dtype), BM=BM, BN=BN, num_warps=warps)
    return out, lse


def backward(do, q, k, v, q_term, k_term, w2, b2, scale, out, lse, q_start, k_start, prob):
    """The gradients of forward's inputs, float32: dq, dk, dv (dk, dv summed over each key
    head's query heads), dq_term, dk_term, dw2, db2, dscale."""
    if BACKWARD not in ("split", "fused"):
        raise ValueError(f"kernels_triton.BACKWARD (ASGA_BACKWARD) is {BACKWARD!r}: 'split' or 'fused'")
    B, H, T, D, Hkv, S = _launch_args(q, k)
    R = q_term.shape[-1]
    RP = triton.next_power_of_2(R)
    f32 = dict(device=q.device, dtype=torch.float32)
    do = do.contiguous().to(q.dtype)
    delta = (do.float() * out.float()).sum(-1)  # (B, H, T): rowsum(dO * out)
    const = dict(D=D, R=R, RP=RP, PROB=prob, IEEE=_precision(q.dtype))
    BM, BN, warps = TILES["bwd_kv"]
    dk, dv = torch.empty(B, H, S, D, **f32), torch.empty(B, H, S, D, **f32)
    dkt = torch.empty(B, H, S, R, **f32)
    if BACKWARD == "fused":
        n_n = triton.cdiv(S, BN)
        dq, dqt = torch.zeros(B, H, T, D, **f32), torch.zeros(B, H, T, R, **f32)
        dsc, db2 = torch.zeros(B, H, T, **f32), torch.zeros(B, H, T, **f32)
        dw2 = torch.empty(B, H, n_n, RP, **f32)  # a partial sum per key block
        _bwd_fused_kernel[(n_n, B * H)](
            q, k, v, q_term, k_term, w2, b2, scale, do, lse, delta, dq, dk, dv, dqt, dkt, dsc, db2, dw2, T, S, H,
            Hkv, q_start, k_start, **const, BM=BM, BN=BN, num_warps=warps)
        return _reduced(dq, dk, dv, dqt, dkt, dw2, db2, dsc, Hkv)
    _bwd_kv_kernel[(triton.cdiv(S, BN), B * H)](
        q, k, v, q_term, k_term, w2, b2, scale, do, lse, delta, dk, dv, dkt, T, S, H, Hkv, q_start, k_start,
        **const, BM=BM, BN=BN, num_warps=warps)
    BM, BN, warps = TILES["bwd_q"]
    n_m = triton.cdiv(T, BM)
    dq, dqt = torch.empty(B, H, T, D, **f32), torch.empty(B, H, T, R, **f32)
    dsc, db2 = torch.empty(B, H, T, **f32), torch.empty(B, H, T, **f32)
    dw2 = torch.empty(B, H, n_m, RP, **f32)  # a partial sum per query block: no atomics
    _bwd_q_kernel[(n_m, B * H)](
        q, k, v, q_term, k_term, w2, b2, scale, do, lse, delta, dq, dqt, dsc, db2, dw2, T, S, H, Hkv,
        q_start, k_start, **const, BM=BM, BN=BN, num_warps=warps)
    return _reduced(dq, dk, dv, dqt, dkt, dw2, db2, dsc, Hkv)


def _reduced(dq, dk, dv, dqt, dkt, dw2, db2, dsc, Hkv):
    """The kernels' gradients summed to their inputs' shapes: dk, dv over each key head's query
    heads, w2's over its partial sums, b2's and the scale's over batch and rows."""
    B, H, S, D = dk.shape
    if Hkv != H:  # each key head's gradient sums its query heads'
        dk, dv = (t.view(B, Hkv, H // Hkv, S, D).sum(2) for t in (dk, dv))
    # Each contiguous, as the op's fake implementation (what a compiled graph plans with) says.
    return dq, dk, dv, dqt, dkt, dw2.sum((0, 2))[:, :dqt.shape[-1]].contiguous(), db2.sum((0, 2)), dsc.sum((0, 2))


# As custom ops, so a compiled model (train.py compiles each block) calls the kernels as they
# are, without tracing into them.
@torch.library.custom_op("attention_gym_lm::asga_forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_term: torch.Tensor, k_term: torch.Tensor,
                w2: torch.Tensor, b2: torch.Tensor, scale: torch.Tensor, q_start: int, k_start: int,
                prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(q, k, v, q_term, k_term, w2, b2, scale, q_start, k_start, prob)


@_forward_op.register_fake
def _(q, k, v, q_term, k_term, w2, b2, scale, q_start, k_start, prob):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("attention_gym_lm::asga_backward", mutates_args=())
def _backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_term: torch.Tensor,
                 k_term: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, q_start: int, k_start: int, prob: bool) -> list[torch.Tensor]:
    return list(backward(do, q, k, v, q_term, k_term, w2, b2, scale, out, lse, q_start, k_start, prob))


@_backward_op.register_fake
def _(do, q, k, v, q_term, k_term, w2, b2, scale, out, lse, q_start, k_start, prob):
    return [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v, q_term, k_term, w2, b2, scale)]


def _setup_context(ctx, inputs, output):
    *tensors, q_start, k_start, prob = inputs
    ctx.save_for_backward(*tensors, *output)
    ctx.meta = (q_start, k_start, prob)


def _backward(ctx, do, dlse):
    saved = ctx.saved_tensors
    grads = _backward_op(do, *saved, *ctx.meta)
    return (*(g.to(t.dtype) for g, t in zip(grads, saved)), None, None, None)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def pair_gated_attention(q, k, v, q_term, k_term, w2, b2, scale, q_start, k_start, gate_space="logit"):
    """attention.pair_gated_attention's signature (scale a float or a (H,) tensor) for q, k, v
    of one dtype (bf16 under autocast); the gate's terms and weights run in float32."""
    if not torch.is_tensor(scale):
        scale = torch.full((q.shape[1],), float(scale), device=q.device)
    terms = [t.float().contiguous() for t in (q_term, k_term, w2, b2, scale)]
    out, _ = _forward_op(q.contiguous(), k.contiguous(), v.contiguous(), *terms, int(q_start), int(k_start),
                         gate_space == "prob")
    return out


def unsupported(q):
    """Why this kernel cannot take q, or None: tl.dot wants a power-of-two head dim >= 16."""
    D = q.shape[-1]
    return None if D >= 16 and D & (D - 1) == 0 else f"head_dim {D} is not a power of two >= 16"


# ----------------------------------------------------------------------------- nsa's block scores
# The selection of [NSA] eqs. 8-9, forward only (the block scores choose blocks; nothing
# differentiates through them). Through torch ops (kernels.chunked_block_scores) a chunk of
# queries keeps its (chunk, C) probabilities p^cmp in memory and reads them five times or more
# (product, mask, softmax, the sliding sums of eq. 9); on an H100 the selection around
# FlexAttention took ~70% of nsa's attention time, and under torch.compile the chunk loop is
# unrolled (one set of kernels per chunk: 248 kernels for a block at T = 16384 against 107 at
# 4096). Here one program per (query block, head) keeps p^cmp in registers, a tile at a time:
#
#   pass 1   the compressed keys the block's queries see, in tiles of BN: each row's max m and
#            sum l of exp(s - m) (an online softmax, as FlashAttention's forward), s = scale q.k
#   pass 2   the blocks in tiles of NB: the tile's NB PB compressed keys again, p = exp(s - m) / l,
#            and the tile's block scores as one product p @ W, W (NB PB, NB) the overlap counts of
#            eq. 9 (how many stride-segments compressed key i and block j share: the trapezoid
#            of kernels.sliding_block_scores), the same for every tile
#
# PB = block / stride keys start in each block, and a block's score also takes the covers - 1
# keys before its first (covers = length / stride <= PB): each tile starts one block early
# (E = 1 when covers > 1) and keeps its last NB - E blocks only. Rows that see no key score 0.
#
#   choice   (`top_blocks`, nsa's own eqs. 10-12) one program per (query block, key head) sums
#            its G query heads' tile scores, forces and masks as attention.nsa_top_blocks does,
#            and keeps a running top-KEEP of attention.top_n's int64 keys (score bits, then
#            the index: the same tie rule; KEEP = n rounded up to a power of two), merged with
#            each tile's own top KEEP by tl.topk: the (T, J) scores
#            are never stored, and no torch.topk runs over them (moba's, over its block
#            scores, was the largest kernel of its step at T = 16384 on an H200)
#
# Like NSA's own kernels and fla's (which sort the scores in the same kernel), the probabilities
# never exist as (T, C).
# (query rows, keys in pass 1, blocks in pass 2, warps): of the shapes tried, the one that spills
# nothing on sm_90 and sm_80 with bf16 and float32 inputs at D = 64 and 128 (76-169 registers;
# 64 x 64 at 4 warps spilled 0.4-44 KB with float32 inputs, 64 x 32 at 8 warps 28 bytes on
# sm_80 at D = 128; `python benchmarks/nsa_scores.py --compile`)
SCORE_TILES = (32, 32, 16, 8)


@triton.jit
def _seen(offs, pos, C, LENGTH: tl.constexpr, STRIDE: tl.constexpr):
    """(rows, keys): compressed key offs exists and is complete by the row's position pos."""
    return (offs[None, :] >= 0) & (offs[None, :] < C) & (offs[None, :] * STRIDE + LENGTH - 1 <= pos[:, None])


@triton.jit
def _rows(pid_m, T, q_start, C, LENGTH: tl.constexpr, STRIDE: tl.constexpr, BM: tl.constexpr):
    """The block's rows, their positions, the last row's position, and n_end: the compressed
    keys the last row sees (key i is complete once i STRIDE + LENGTH - 1 <= pos)."""
    offs_m = pid_m * BM + tl.arange(0, BM)
    last = q_start + tl.minimum(pid_m * BM + BM, T) - 1
    return offs_m, q_start + offs_m, last, tl.minimum(C, tl.maximum(last - LENGTH + 1 + STRIDE, 0) // STRIDE)


@triton.jit
def _softmax_stats(q, K, kh, C, pos, n_end, scale, LENGTH: tl.constexpr, STRIDE: tl.constexpr, D: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
    """Pass 1: each row's max m and 1 / sum of exp(s - m) over the compressed keys it sees (0
    for a row that sees none)."""
    offs_d = tl.arange(0, D)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    for n0 in range(0, n_end, BN):
        offs_n = n0 + tl.arange(0, BN)
        k = tl.load(K + (kh * C + offs_n[:, None]) * D + offs_d[None, :], mask=offs_n[:, None] < C, other=0.0)
        s = tl.where(_seen(offs_n, pos, C, LENGTH, STRIDE), _dot(q, tl.trans(k), IEEE) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
        l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
        m = m_new
    return tl.where(m == float("-inf"), 0.0, m), tl.where(l > 0, 1.0 / tl.where(l > 0, l, 1.0), 0.0)


@triton.jit
def _overlaps(COVERS: tl.constexpr, PB: tl.constexpr, NB: tl.constexpr):
    """W (NB PB, NB): the stride-segments compressed key i (segments i .. i + COVERS - 1) shares
    with block j (j PB .. j PB + PB - 1), tile-relative: eq. 9's weights."""
    ki = tl.arange(0, NB * PB)[:, None]
    kj = tl.arange(0, NB)[None, :] * PB
    return tl.maximum(tl.minimum(ki + COVERS - 1, kj + PB - 1) - tl.maximum(ki, kj) + 1, 0).to(tl.float32)


@triton.jit
def _tile_scores(q, K, kh, C, pos, m, inv_l, W, j0, scale, LENGTH: tl.constexpr, STRIDE: tl.constexpr,
                 PB: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, IEEE: tl.constexpr):
    """Pass 2, one tile: (BM, NB) scores of the blocks j0 .. j0 + NB - 1 from their NB PB keys,
    p = exp(s - m) / l recomputed; the first block of a tile lacks the keys before its own."""
    offs_d = tl.arange(0, D)
    offs_k = j0 * PB + tl.arange(0, NB * PB)
    k = tl.load(K + (kh * C + offs_k[:, None]) * D + offs_d[None, :],
                mask=(offs_k[:, None] >= 0) & (offs_k[:, None] < C), other=0.0)
    s = _dot(q, tl.trans(k), IEEE) * scale
    p = tl.where(_seen(offs_k, pos, C, LENGTH, STRIDE), tl.exp(s - m[:, None]) * inv_l[:, None], 0.0)
    return tl.dot(p, W, input_precision="ieee")  # float32 throughout


@triton.jit
def _block_scores_kernel(Q, K, OUT, T, C, J, H, HKV, q_start, scale, LENGTH: tl.constexpr, STRIDE: tl.constexpr,
                         PB: tl.constexpr, COVERS: tl.constexpr, E: tl.constexpr, D: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, IEEE: tl.constexpr):
    """One program per (query block, head): the (BM, J) block scores, stored."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    kh = ((bh // H) * HKV + (bh % H) // (H // HKV)).to(tl.int64)  # the key head of this query head
    bh = bh.to(tl.int64)  # (B H T J) outgrows int32 at batch 16, T = 32768
    offs_m, pos, last, n_end = _rows(pid_m, T, q_start, C, LENGTH, STRIDE, BM)
    q = tl.load(Q + (bh * T + offs_m[:, None]) * D + tl.arange(0, D)[None, :], mask=offs_m[:, None] < T, other=0.0)
    m, inv_l = _softmax_stats(q, K, kh, C, pos, n_end, scale, LENGTH, STRIDE, D, BM, BN, IEEE)
    W = _overlaps(COVERS, PB, NB)
    jb_end = tl.minimum(J, (n_end + COVERS - 2) // PB + 1)  # the blocks the last seen key reaches
    for jb in range(0, jb_end, NB - E):  # each tile starts E blocks early and keeps its last NB - E
        acc = _tile_scores(q, K, kh, C, pos, m, inv_l, W, jb - E, scale, LENGTH, STRIDE, PB, D, NB, IEEE)
        offs_j = jb - E + tl.arange(0, NB)
        keep = (tl.arange(0, NB)[None, :] >= E) & (offs_j[None, :] < J) & (offs_m[:, None] < T)
        tl.store(OUT + (bh * T + offs_m[:, None]) * J + offs_j[None, :], acc, mask=keep)


@triton.jit
def _order_key(score, index):
    """attention.top_n's key, int64: a float32's bits as an int32 (negative ones' magnitude bits
    flipped: the int orders as the float), times 2^32, plus the index (ties: the higher index)."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)  # -0.0 made 0.0: the two are equal
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | index.to(tl.int64)


@triton.jit
def _top_blocks_kernel(Q, K, STATS, OUT, T, C, J, H, HKV, q_start, scale, LENGTH: tl.constexpr,
                       STRIDE: tl.constexpr, BLOCK: tl.constexpr, PB: tl.constexpr, COVERS: tl.constexpr,
                       E: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                       IEEE: tl.constexpr, KEEP: tl.constexpr):
    """One program per (query block, key head): attention.nsa_top_blocks over the scores, never
    stored. Eq. 10 sums the key head's G query heads' scores; block 0, the row's own and the
    one before are forced (+inf), blocks after its own invalid (-inf); a running top-KEEP of
    attention.top_n's keys (KEEP = n rounded up to a power of two), merged with each tile's
    own top KEEP by tl.topk. STATS (2, B H T): each query
    head's pass-1 m and 1 / l, kept for its pass 2."""
    pid_m, bk = tl.program_id(0), tl.program_id(1)
    G = H // HKV
    bk = bk.to(tl.int64)
    offs_m, pos, last, n_end = _rows(pid_m, T, q_start, C, LENGTH, STRIDE, BM)
    offs_d = tl.arange(0, D)
    first_head = (bk // HKV) * H + (bk % HKV) * G  # the key head's first query head, b H + h
    for g in range(0, G):
        rows = (first_head + g) * T + offs_m
        q = tl.load(Q + rows[:, None] * D + offs_d[None, :], mask=offs_m[:, None] < T, other=0.0)
        m, inv_l = _softmax_stats(q, K, bk, C, pos, n_end, scale, LENGTH, STRIDE, D, BM, BN, IEEE)
        tl.store(STATS + rows, m, mask=offs_m < T)
        tl.store(STATS + tl.num_programs(1) * G * T + rows, inv_l, mask=offs_m < T)
    tl.debug_barrier()  # the statistics' stores seen by every thread of the program before they are read back
    W = _overlaps(COVERS, PB, NB)
    own = pos // BLOCK
    empty = _order_key(tl.full([BM, KEEP], float("-inf"), tl.float32), tl.zeros([BM, KEEP], tl.int32))  # a -inf slot
    best = empty
    jv_end = tl.minimum(J, last // BLOCK + 1)  # every valid block: the forced own ones too
    for jb in range(0, jv_end, NB - E):
        acc = tl.zeros([BM, NB], tl.float32)
        for g in range(0, G):
            rows = (first_head + g) * T + offs_m
            q = tl.load(Q + rows[:, None] * D + offs_d[None, :], mask=offs_m[:, None] < T, other=0.0)
            m = tl.load(STATS + rows, mask=offs_m < T, other=0.0)
            inv_l = tl.load(STATS + tl.num_programs(1) * G * T + rows, mask=offs_m < T, other=0.0)
            acc += _tile_scores(q, K, bk, C, pos, m, inv_l, W, jb - E, scale, LENGTH, STRIDE, PB, D, NB, IEEE)
        offs_j = jb - E + tl.arange(0, NB)
        valid = (tl.arange(0, NB)[None, :] >= E) & (offs_j[None, :] <= own[:, None]) & (offs_j[None, :] < J)
        forced = valid & ((offs_j[None, :] == 0) | (offs_j[None, :] == own[:, None]) |
                          (offs_j[None, :] == own[:, None] - 1))
        score = tl.where(forced, float("inf"), tl.where(valid, acc, float("-inf")))
        key = _order_key(score, tl.maximum(offs_j, 0)[None, :] + tl.zeros([BM, NB], tl.int32))
        if KEEP < NB:
            key = tl.topk(key, KEEP)  # the tile's own top KEEP: no key outside it can enter the running ones
        best = tl.topk(tl.reshape(tl.join(best, key), [BM, 2 * KEEP]), KEEP)
    index = tl.where((best >> 32) == (empty >> 32), -1, best & 0xFFFFFFFF)
    tl.store(OUT + (bk * T + offs_m[:, None]) * KEEP + tl.arange(0, KEEP)[None, :], index, mask=offs_m[:, None] < T)


def _one_dtype(q, k_cmp):
    """The kernels take a dot of q and the compressed keys: one dtype, or one clear error
    (Triton's own is a CompilationError pointing inside the kernel)."""
    if q.dtype != k_cmp.dtype:
        raise TypeError(f"nsa's block scores: q is {q.dtype} and the compressed keys {k_cmp.dtype}; cast them to "
                        f"one dtype first (kernels._same_dtype: autocast's, else the wider)")


def block_scores(q, k_cmp, scale, q_start, length, stride, block, J):
    """kernels.chunked_block_scores: (B, H, T, J) float32 block scores ([NSA] eqs. 8-9) of q
    (B, H, T, D) over the compressed keys k_cmp (B, Hkv, C, D), one dtype; 0 for the blocks no
    seen key reaches."""
    _one_dtype(q, k_cmp)
    B, H, T, D = q.shape
    Hkv, C = k_cmp.shape[1], k_cmp.shape[2]
    covers, per_block = length // stride, block // stride
    BM, BN, NB, warps = SCORE_TILES
    out = torch.zeros(B, H, T, J, device=q.device, dtype=torch.float32)
    if C and J:
        _block_scores_kernel[(triton.cdiv(T, BM), B * H)](
            q.contiguous(), k_cmp.contiguous(), out, T, C, J, H, Hkv, q_start, float(scale),
            LENGTH=length, STRIDE=stride, PB=per_block, COVERS=covers, E=int(covers > 1), D=D,
            BM=BM, BN=BN, NB=NB, IEEE=_precision(q.dtype), num_warps=warps)
    return out


def top_blocks(q, k_cmp, scale, q_start, length, stride, block, J, n):
    """attention.nsa_top_blocks(block_scores(...), q_start, block, n, Hkv): (B, Hkv, T, n) long,
    each key head's chosen blocks, highest first, -1 where fewer than n are valid; the scores
    exist one (BM, NB) tile at a time. n <= NB (SCORE_TILES)."""
    _one_dtype(q, k_cmp)
    B, H, T, D = q.shape
    Hkv, C = k_cmp.shape[1], k_cmp.shape[2]
    covers, per_block = length // stride, block // stride
    BM, BN, NB, warps = SCORE_TILES
    keep = triton.next_power_of_2(n)  # the running top's slots
    out = torch.empty(B, Hkv, T, keep, device=q.device, dtype=torch.int64)
    stats = torch.empty(2, B * H * T, device=q.device, dtype=torch.float32)
    _top_blocks_kernel[(triton.cdiv(T, BM), B * Hkv)](
        q.contiguous(), k_cmp.contiguous(), stats, out, T, C, J, H, Hkv, q_start, float(scale),
        LENGTH=length, STRIDE=stride, BLOCK=block, PB=per_block, COVERS=covers, E=int(covers > 1), D=D,
        BM=BM, BN=BN, NB=NB, IEEE=_precision(q.dtype), KEEP=keep, num_warps=warps)
    return out[..., :n]


@torch.library.custom_op("attention_gym_lm::nsa_block_scores", mutates_args=())
def _block_scores_op(q: torch.Tensor, k_cmp: torch.Tensor, scale: float, q_start: int, length: int, stride: int,
                     block: int, J: int) -> torch.Tensor:
    return block_scores(q, k_cmp, scale, q_start, length, stride, block, J)


@_block_scores_op.register_fake
def _(q, k_cmp, scale, q_start, length, stride, block, J):
    return q.new_empty(*q.shape[:3], J, dtype=torch.float32)


@torch.library.custom_op("attention_gym_lm::nsa_top_blocks", mutates_args=())
def _top_blocks_op(q: torch.Tensor, k_cmp: torch.Tensor, scale: float, q_start: int, length: int, stride: int,
                   block: int, J: int, n: int) -> torch.Tensor:
    return top_blocks(q, k_cmp, scale, q_start, length, stride, block, J, n).contiguous()


@_top_blocks_op.register_fake
def _(q, k_cmp, scale, q_start, length, stride, block, J, n):
    return q.new_empty(q.shape[0], k_cmp.shape[1], q.shape[2], n, dtype=torch.int64)


def nsa_top_blocks(q, k_cmp, scale, q_start, length, stride, block, J, n):
    """`top_blocks` as a custom op: a compiled block calls the kernel as it is."""
    return _top_blocks_op(q, k_cmp, float(scale), int(q_start), int(length), int(stride), int(block), int(J), int(n))


def nsa_block_scores(q, k_cmp, scale, q_start, length, stride, block, J):
    """`block_scores` as a custom op: a compiled block calls the kernel as it is."""
    return _block_scores_op(q, k_cmp, float(scale), int(q_start), int(length), int(stride), int(block), int(J))


# ----------------------------------------------------------------------------- moba's choice
# [MoBA] eqs. 5-6 (attention.moba_select): s_j = q . K_bar_j over the complete blocks' means,
# the own block forced, the top k - 1 of the earlier ones. Through torch ops the (T, J) scores,
# their (T, J) int64 keys and k passes over them (kernels._top_n's running maxima) each reach
# memory; here one program per (query block, head) reads its means NB at a time and keeps a
# running top-KEEP of attention.top_n's keys, KEEP = k rounded up to a power of two (4 at
# the default k = 4): each tile's NB keys cut to their top KEEP, then merged with those, two
# small sorts where a running top-16 sorted 32 keys a tile (on an H200 at T = 16384 this
# kernel was the step's largest, 4.2 ms, with the top-16). Forward only, float32.


@triton.jit
def _moba_blocks_kernel(Q, MEANS, OUT, T, FULL, J, H, HKV, q_start, BLOCK: tl.constexpr, D: tl.constexpr,
                        BM: tl.constexpr, NB: tl.constexpr, KEEP: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    kh = ((bh // H) * HKV + (bh % H) // (H // HKV)).to(tl.int64)
    bh = bh.to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + (bh * T + offs_m[:, None]) * D + offs_d[None, :], mask=offs_m[:, None] < T, other=0.0)
    own = (q_start + offs_m) // BLOCK
    empty = _order_key(tl.full([BM, KEEP], float("-inf"), tl.float32), tl.zeros([BM, KEEP], tl.int32))
    best = empty
    j_end = tl.minimum(J, (q_start + tl.minimum(pid_m * BM + BM, T) - 1) // BLOCK + 1)  # the last row's own block
    for j0 in range(0, j_end, NB):
        offs_j = j0 + tl.arange(0, NB)
        means = tl.load(MEANS + (kh * FULL + offs_j[:, None]) * D + offs_d[None, :], mask=offs_j[:, None] < FULL,
                        other=0.0)
        s = tl.dot(q, tl.trans(means), input_precision="ieee")  # eq. 5, float32; 0 for the incomplete block
        earlier = offs_j[None, :] < own[:, None]
        score = tl.where(offs_j[None, :] == own[:, None], float("inf"), tl.where(earlier, s, float("-inf")))
        key = _order_key(score, offs_j[None, :] + tl.zeros([BM, NB], tl.int32))
        if KEEP < NB:
            key = tl.topk(key, KEEP)  # the tile's own top KEEP: no key outside it can enter the running ones
        best = tl.topk(tl.reshape(tl.join(best, key), [BM, 2 * KEEP]), KEEP)
    index = tl.where((best >> 32) == (empty >> 32), -1, best & 0xFFFFFFFF)
    tl.store(OUT + (bh * T + offs_m[:, None]) * KEEP + tl.arange(0, KEEP)[None, :], index, mask=offs_m[:, None] < T)


MOBA_TILES = (32, 16, 4)  # (query rows, blocks a tile, warps)


def moba_blocks(q, means, q_start, block, topk):
    """attention.moba_select: (B, H, T, topk) long, each query head's blocks, highest first (its
    own block first), -1 where fewer than topk are valid; q (B, H, T, D), means (B, Hkv, full,
    D) of the complete blocks. topk <= 16. The scores exist one (BM, NB) tile at a time."""
    B, H, T, D = q.shape
    Hkv, full = means.shape[1], means.shape[2]
    BM, NB, warps = MOBA_TILES
    J = -(-(q_start + T) // block)
    keep = triton.next_power_of_2(topk)  # the running top's slots
    out = torch.empty(B, H, T, keep, device=q.device, dtype=torch.int64)
    _moba_blocks_kernel[(triton.cdiv(T, BM), B * H)](
        q.float().contiguous(), means.float().contiguous(), out, T, full, J, H, Hkv, q_start, BLOCK=block, D=D,
        BM=BM, NB=NB, KEEP=keep, num_warps=warps)
    return out[..., :topk]


@torch.library.custom_op("attention_gym_lm::moba_blocks", mutates_args=())
def _moba_blocks_op(q: torch.Tensor, means: torch.Tensor, q_start: int, block: int, topk: int) -> torch.Tensor:
    return moba_blocks(q, means, q_start, block, topk).contiguous()


@_moba_blocks_op.register_fake
def _(q, means, q_start, block, topk):
    return q.new_empty(*q.shape[:3], topk, dtype=torch.int64)


def moba_select(q, means, q_start, block, topk):
    """`moba_blocks` as a custom op: a compiled block calls the kernel as it is."""
    return _moba_blocks_op(q.detach(), means.detach(), int(q_start), int(block), int(topk))


def moba_unsupported(q, topk):
    """Why `moba_blocks` cannot take these sizes, or None."""
    D = q.shape[-1]
    if not (D >= 16 and D & (D - 1) == 0):
        return f"head_dim {D} is not a power of two >= 16"
    if topk > MOBA_TILES[1]:
        return f"moba_topk={topk} > {MOBA_TILES[1]} (the kernel's tile of blocks, which bounds its running top-k)"
    return None


def block_scores_unsupported(q, length, stride, block):
    """Why `block_scores` cannot take these sizes, or None: tl.arange and tl.dot want powers of
    two (the head dim >= 16, block / stride)."""
    D, per_block = q.shape[-1], block // stride
    if not (D >= 16 and D & (D - 1) == 0):
        return f"head_dim {D} is not a power of two >= 16"
    if per_block & (per_block - 1):
        return f"nsa_block / nsa_cmp_stride = {per_block} is not a power of two"
    return None
