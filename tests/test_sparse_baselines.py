"""nsa and moba ([NSA], [MoBA]; attention.py): each against a plain-Python loop written here
from the paper's equations (one query at a time), reduction to full attention, causality and
prefix invariance, the selection equal to a brute-force sort with the forced blocks in it, no
gradient through the selection, the core op `block_attention` through the blockwise and
FlexAttention paths equal to the reference (outputs and gradients, after cached keys too),
bf16, cached decoding, a graph without breaks, and the configuration errors.

Errors are relative, max|a - b| / max|b|, as in tests/test_kernels.py.
"""
import dataclasses
import math
import warnings

import pytest
import torch

import attention
import kernels
from model import PRESETS, Model, ModelConfig
from test_flex_selection import dense_flex

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
# Small sizes: T = 45 spans 11 selection blocks of 4 (nsa) and 5 blocks of 8 (moba).
NSA = dict(nsa_cmp_block=4, nsa_cmp_stride=2, nsa_block=8, nsa_topk=4, nsa_window=5)
MOBA = dict(moba_block=8, moba_topk=3)


pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors (conftest.py)


def make(attn, seed=0, **flags):
    cfg = ModelConfig(**dict(PRESETS["tiny"], attn=attn, n_head=4, n_kv_head=2, head_dim=8, d_model=16,
                             **dict(NSA if attn == "nsa" else MOBA, **flags)))
    torch.manual_seed(seed)
    module = attention.VARIANTS[attn](cfg)
    for p in module.parameters():
        p.data.normal_(0, 0.3)
    return module


def inputs(module, T, B=1, seed=1, S=None):
    cfg, S = module.cfg, S or T
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, cfg.n_head, T, cfg.head_dim, generator=g)
    k = torch.randn(B, cfg.n_kv_head, S, cfg.head_dim, generator=g)
    v = torch.randn(B, cfg.n_kv_head, S, cfg.head_dim, generator=g)
    x = torch.randn(B, T, cfg.d_model, generator=g)
    return q, k, v, x


def run(module, kernel, q, k, v, x, q_start=0):
    cfg = module.cfg
    module.cfg = dataclasses.replace(cfg, kernel=kernel)
    try:
        out = module.attend(q, k, v, x, q_start, 0)
        if module.notes is not None:  # recording: what forward notes after attend
            module.notes = {}
            module.observe(q, k, v, x, q_start, 0, None)
        return out
    finally:
        module.cfg = cfg


def rel(a, b):
    """Relative error; where b is identically 0 (q's gradient at T = 1), the absolute one."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-2)).item()


def softmax_attend(qv, keys, values, scale):
    """One query: softmax over the given key vectors, plain Python over them."""
    logits = [float(qv @ kv) * scale for kv in keys]
    m = max(logits)
    w = [math.exp(z - m) for z in logits]
    return sum(wi * vi for wi, vi in zip(w, values)) / sum(w)


# ---------------------------------------------------------------------------- the papers' loops

def moba_loop(q, k, v, block, topk, scale):
    """[MoBA] §2.2 / Algorithm 1, one query and head at a time: score each block wholly in
    the past by q . mean(k over the block), keep the topk - 1 best, add the own block, one
    softmax over the keys s <= t of those blocks."""
    B, H, T, D = q.shape
    group = H // k.shape[1]
    out = torch.zeros(B, H, T, D)
    for b in range(B):
        for h in range(H):
            kh, vh = k[b, h // group], v[b, h // group]
            for t in range(T):
                own = t // block
                past = sorted(range(own), key=lambda j: -float(q[b, h, t] @ kh[j * block:(j + 1) * block].mean(0)))
                chosen = set(past[:topk - 1]) | {own}
                keys = [s for s in range(t + 1) if s // block in chosen]
                out[b, h, t] = softmax_attend(q[b, h, t], [kh[s] for s in keys], [vh[s] for s in keys], scale)
    return out


def nsa_loop(module, q, k, v, x):
    """[NSA] eqs. 5-12, one query at a time: compressed keys are means over [i d, i d + l),
    visible once complete; eq. 8's probabilities are spread over the positions each
    compressed block covers (1/d per position, the overlap reading of eq. 9) and summed per
    selection block and over the query heads of a key head (eq. 10); the forced blocks (0,
    own, own - 1), then the best by score, n in all; the window t - W .. t; sigmoid gates."""
    cfg, scale = module.cfg, module.scale
    l, d, blk, n, W = cfg.nsa_cmp_block, cfg.nsa_cmp_stride, cfg.nsa_block, cfg.nsa_topk, cfg.nsa_window
    B, H, T, D = q.shape
    group = H // k.shape[1]
    gates = torch.sigmoid(x @ module.branch_gate.weight.T + module.branch_gate.bias)  # (B, T, 3H)
    out = torch.zeros(B, H, T, D)
    for b in range(B):
        for t in range(T):
            cmp_ids = [i for i in range(T) if i * d + l - 1 <= t]
            o_cmp, block_score = {}, {}
            for h in range(H):
                kh, vh = k[b, h // group], v[b, h // group]
                if not cmp_ids:
                    o_cmp[h] = torch.zeros(D)
                    continue
                kc = [kh[i * d:i * d + l].mean(0) for i in cmp_ids]
                vc = [vh[i * d:i * d + l].mean(0) for i in cmp_ids]
                logits = torch.tensor([float(q[b, h, t] @ kv) * scale for kv in kc])
                p = torch.softmax(logits, 0)
                o_cmp[h] = sum(pi * vi for pi, vi in zip(p, vc))
                for i, pi in zip(cmp_ids, p):
                    for pos in range(i * d, i * d + l):
                        key = (h // group, pos // blk)
                        block_score[key] = block_score.get(key, 0.0) + float(pi) / d
            own = t // blk
            for h in range(H):
                kh, vh = k[b, h // group], v[b, h // group]
                forced = [j for j in (0, own, own - 1) if 0 <= j <= own]
                rest = sorted((j for j in range(own + 1) if j not in forced),
                              key=lambda j: -block_score.get((h // group, j), 0.0))
                chosen = set(forced) | set(rest[:n - len(set(forced))])
                slc = [s for s in range(t + 1) if s // blk in chosen]
                win = [s for s in range(max(0, t - W), t + 1)]
                o_slc = softmax_attend(q[b, h, t], [kh[s] for s in slc], [vh[s] for s in slc], scale)
                o_win = softmax_attend(q[b, h, t], [kh[s] for s in win], [vh[s] for s in win], scale)
                g = [gates[b, t, c * H + h] for c in range(3)]
                out[b, h, t] = g[0] * o_cmp[h] + g[1] * o_slc + g[2] * o_win
    return out


@pytest.mark.parametrize("kernel", ["ref", "fused", "flex"])
def test_moba_equals_the_papers_loop(kernel):
    module = make("moba")
    q, k, v, x = inputs(module, 45)
    with torch.no_grad():
        out = run(module, kernel, q, k, v, x)
    assert rel(out, moba_loop(q, k, v, 8, 3, module.scale)) < 1e-5


@pytest.mark.parametrize("kernel", ["ref", "fused", "flex"])
def test_nsa_equals_the_papers_loop(kernel):
    module = make("nsa")
    q, k, v, x = inputs(module, 45)
    with torch.no_grad():
        out = run(module, kernel, q, k, v, x)
        expected = nsa_loop(module, q, k, v, x)
    assert rel(out, expected) < 1e-5


def test_nsa_compressed_branch_in_chunks_equals_the_loop(monkeypatch):
    """The compressed branch and the selection a few queries at a time: outputs equal to the
    paper's loop, gradients equal to one chunk's."""
    module = make("nsa")
    q, k, v, x = (t.requires_grad_() for t in inputs(module, 45))
    out = run(module, "fused", q, k, v, x)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, x))
    monkeypatch.setattr(kernels, "COMPRESSED_SCORES", 4 * 20 * 7)  # 6 queries a chunk
    chunked = run(module, "fused", q, k, v, x)
    with torch.no_grad():
        assert rel(chunked, nsa_loop(module, q, k, v, x)) < 1e-5
    for a, b in zip(torch.autograd.grad(chunked.square().sum(), (q, k, v, x)), grads):
        assert rel(a, b) < 1e-5


@pytest.mark.parametrize("ops", ["BLOCKWISE", "FLEX"])
@pytest.mark.parametrize("q_start", [0, 9])
def test_compressed_branch_in_chunks_equals_the_reference(monkeypatch, ops, q_start):
    """The ops alone (BLOCKWISE's `CompressedAttention` a few queries at a time; FLEX's one
    FlexAttention call, its gradients through `dense_flex`, its output through eager
    FlexAttention too), after earlier queries too: the compressed branch's output and the
    gradients of q and the compressed keys and values equal attention.compressed_branch's
    over all queries at once; so do the blocks chosen, and the block scores handed to
    `choose` chunk by chunk (BLOCKWISE: 5 queries a chunk, each with the blocks up to its
    last query), which carry no gradient (copied here: `choose` may overwrite them, nsa's does)."""
    monkeypatch.setattr(kernels, "COMPRESSED_SCORES", 2 * 4 * 12 * 5)  # 5 queries a chunk
    g = torch.Generator().manual_seed(6)
    T, C, length, stride, block = 23, 12, 4, 2, 8
    J = -(-(q_start + T) // block)
    q = torch.randn(2, 4, T, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, C, 8, generator=g, requires_grad=True) for _ in range(2))
    cot = torch.randn(2, 4, T, 8, generator=g)
    handed = []

    def choose(scores, t0):  # eqs. 10-12 as nsa applies them; the scores kept to compare
        handed.append((t0, scores.clone()))
        return attention.nsa_top_blocks(scores, t0, block, 3, 2)

    ref, ref_blocks = attention.compressed_branch(q, k, v, 0.3, q_start, length, stride, block, choose)
    ref_scores = handed.pop()[1]
    assert ref_scores.shape == (2, 4, T, J)
    ref_grads = torch.autograd.grad(ref, (q, k, v), cot)
    fast = getattr(kernels, ops)
    if ops == "FLEX":  # eager FlexAttention (no CPU backward for q, k, v), then the dense stand-in
        eager, _ = fast.compressed_branch(q.detach(), k.detach(), v.detach(), 0.3, q_start, length, stride, block, None)
        assert rel(eager, ref) < 1e-5
        monkeypatch.setattr(kernels, "_run_flex", dense_flex)
    out, blocks = fast.compressed_branch(q, k, v, 0.3, q_start, length, stride, block, choose)
    assert rel(out, ref) < 1e-5
    for a, b in zip(torch.autograd.grad(out, (q, k, v), cot), ref_grads):
        assert rel(a, b) < 1e-5
    assert torch.equal(blocks, ref_blocks)
    assert [t0 for t0, _ in handed] == ([q_start + t for t in range(0, T, 5)] if ops == "BLOCKWISE" else [q_start])
    for t0, scores in handed:
        rows = slice(t0 - q_start, t0 - q_start + scores.shape[2])
        assert scores.shape[3] == -(-(t0 + scores.shape[2]) // block) and not scores.requires_grad
        assert rel(scores, ref_scores[:, :, rows, :scores.shape[3]]) < 1e-5


def test_compressed_branch_chunks_write_one_buffer(monkeypatch):
    """BLOCKWISE's compressed branch writes each chunk's logits, then its probabilities, into
    one buffer made once for all its chunks: no op makes a new tensor of a chunk's (heads,
    chunk, C) logits, whatever the number of chunks (a fresh one per chunk was faulted in
    from the OS each time: in a one-layer nsa prefill at T = 32768 the branch took 6.2 s with
    785k page faults, 4.6 s with one buffer)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Fresh(TorchDispatchMode):  # the ops whose output of at least `size` elements is no input's storage
        def __init__(self, size):
            super().__init__()
            self.size, self.made = size, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                     if isinstance(t, torch.Tensor)}
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.numel() >= self.size and t.untyped_storage().data_ptr() not in given:
                    self.made.append(func.overloadpacket.__name__)
            return out

    g = torch.Generator().manual_seed(0)
    B, H, T, D, length, stride, block = 1, 2, 64, 4, 4, 2, 8
    C = (T - length) // stride + 1  # 31: a chunk's logits (H x 16 x 31) outnumber the output's H x T x D
    q_start = T  # queries after the keys (as in a second prefill): every chunk sees all C
    q = torch.randn(B, H, T, D, generator=g)
    k, v = (torch.randn(B, H, C, D, generator=g) for _ in range(2))

    def choose(scores, t0):
        return attention.nsa_top_blocks(scores, t0, block, 3, H)

    monkeypatch.setattr(kernels, "COMPRESSED_SCORES", B * H * C * 16)  # 4 chunks of 16 queries
    with torch.no_grad(), Fresh(B * H * 16 * C) as fresh:
        out, blocks = kernels.BLOCKWISE.compressed_branch(q, k, v, 0.5, q_start, length, stride, block, choose)
    assert fresh.made == ["empty"], fresh.made  # the logits' buffer, once
    ref, ref_blocks = attention.compressed_branch(q, k, v, 0.5, q_start, length, stride, block, choose)
    assert rel(out, ref) < 1e-5 and torch.equal(blocks, ref_blocks)


# ---------------------------------------------------------------------------- reductions, causality

def test_moba_with_every_block_is_full_attention():
    module = make("moba", moba_topk=6)  # 6 blocks of 8 cover T = 45
    q, k, v, x = inputs(module, 45)
    full = attention.attention(q, k, v, module.scale, 0, 0)
    for kernel in ("ref", "fused", "flex"):
        assert rel(run(module, kernel, q, k, v, x), full) < 1e-5, kernel
    one = make("moba", moba_topk=1)  # the own block alone: block-diagonal causal attention
    blockdiag = attention.attention(q, k, v, one.scale, 0, 0, window=7)
    out = run(one, "ref", q, k, v, x)
    assert rel(out[:, :, :8], blockdiag[:, :, :8]) < 1e-5 and rel(out[:, :, 8:9], v.repeat_interleave(2, 1)[:, :, 8:9]) < 1e-5


def test_nsa_with_every_block_and_a_whole_window_is_full_attention():
    q, k, v, x = inputs(make("nsa"), 45)
    for branch in ("slc", "win"):
        module = make("nsa", nsa_topk=6, nsa_window=44, nsa_branches=branch)
        module.init_gates()  # gates 0.5
        full = attention.attention(q, k, v, module.scale, 0, 0)
        for kernel in ("ref", "fused", "flex"):
            assert rel(run(module, kernel, q, k, v, x), 0.5 * full) < 1e-5, (branch, kernel)


@pytest.mark.parametrize("attn", ["nsa", "moba"])
def test_causal_and_prefix_invariant(attn):
    """The first 30 outputs and selections of a 45-token run equal those of its 30-token
    prefix, and changing the later q, k, v, x changes neither."""
    module = make(attn)
    module.record_gates(True)
    q, k, v, x = inputs(module, 45)
    out = run(module, "ref", q, k, v, x)
    sel = module.selection[:, :, :30].sort(-1).values  # as sets: the order of tied forced blocks is free
    q2, k2, v2, x2 = (t.clone() for t in (q, k, v, x))
    for t in (q2, k2, v2):
        t[:, :, 30:] = torch.randn_like(t[:, :, 30:])
    x2[:, 30:] = torch.randn_like(x2[:, 30:])
    for args in ((q[:, :, :30], k[:, :, :30], v[:, :, :30], x[:, :30]), (q2, k2, v2, x2)):
        out2 = run(module, "ref", *args)
        assert rel(out2[:, :, :30], out[:, :, :30]) < 1e-6
        assert torch.equal(module.selection[:, :, :30].sort(-1).values, sel)


# ---------------------------------------------------------------------------- the selection

def test_moba_selection_is_a_brute_force_sort():
    module = make("moba")
    q, k, _, _ = inputs(module, 45, B=2)
    blocks = attention.moba_select(q, attention.block_means(k, 8), 0, 8, 3)  # (B, H, T, 3)
    for b in range(2):
        for h in range(4):
            for t in range(45):
                own = t // 8
                means = [k[b, h // 2, j * 8:(j + 1) * 8].mean(0) for j in range(own)]
                order = sorted(range(own), key=lambda j: -float(q[b, h, t] @ means[j]))
                expected = {own} | set(order[:2])
                got = {int(j) for j in blocks[b, h, t] if j >= 0}
                assert got == expected, (b, h, t, got, expected)


def test_moba_selection_is_float32_under_autocast():
    """[MoBA]'s gate in float32 (attention.moba_select's docstring) under bf16 autocast too, on
    every path's form: the same blocks as without autocast (bf16 products of q . K_bar change
    a choice where two scores lie within bf16's rounding, 62 of 8192 slots here), and the same
    as kernels_triton.moba_blocks, which computes in float32 on a GPU."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 512, 64), torch.randn(1, 2, 512, 64)
    means = attention.block_means(k, 16)
    want = attention.moba_select(q, means, 0, 16, 4)
    forms = {"attention.py": attention.moba_select,
             "blockwise": kernels.BLOCKWISE.moba_select, "flex (torch form)": kernels.FLEX.moba_select}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for name, select in forms.items():
            assert torch.equal(select(q, means, 0, 16, 4), want), name


@pytest.mark.parametrize("budget", [1, 700, 1 << 22], ids=["a query a chunk", "chunks", "one chunk"])
@pytest.mark.parametrize("q_start", [0, 37])
def test_moba_selection_in_chunks_of_queries_equals_the_reference(monkeypatch, budget, q_start):
    """BLOCKWISE's selection a chunk of queries at a time (each chunk's scores against the
    blocks up to its last query's) lists the blocks attention.moba_select lists, slot for
    slot: after cached positions too, and with tied scores (small integer q and keys: ties go
    to the most recent block)."""
    monkeypatch.setattr(kernels, "MOBA_SCORES", budget)
    g = torch.Generator().manual_seed(budget + q_start)
    q = torch.randint(-2, 3, (2, 4, 60, 8), generator=g).float()
    k = torch.randint(-2, 3, (2, 2, q_start + 60, 8), generator=g).float()
    means = attention.block_means(k, 8)
    want = attention.moba_select(q, means, q_start, 8, 3)
    assert torch.equal(kernels.BLOCKWISE.moba_select(q, means, q_start, 8, 3), want)


def test_nsa_selection_is_float32_under_autocast():
    """[NSA]'s p^cmp and block scores (eqs. 8-9) in float32 under bf16 autocast on attention.py's
    form as on the fast forms (BLOCKWISE's loops and FLEX's chunks compute them in float32, as
    kernels_triton.block_scores does on a GPU): the same blocks from the same bf16 inputs.
    With the autocast's bf16 products attention.py's choice differed in 74 of 12288 slots."""
    torch.manual_seed(0)
    q, k_cmp, v_cmp = torch.randn(1, 4, 512, 64), torch.randn(1, 2, 63, 64), torch.randn(1, 2, 63, 64)
    args = (64 ** -0.5, 0, 16, 8, 32, lambda scores, q_start: attention.nsa_top_blocks(scores, q_start, 32, 6, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k_cmp, v_cmp = q.bfloat16(), k_cmp.bfloat16(), v_cmp.bfloat16()
        want = attention.compressed_branch(q, k_cmp, v_cmp, *args)[1]
        for ops in (kernels.BLOCKWISE, kernels.FLEX):
            assert torch.equal(ops.compressed_branch(q, k_cmp, v_cmp, *args)[1], want), ops.name


def test_moba_ties_go_to_the_most_recent_blocks():
    """The tie rule of `top_blocks`: with one key repeated, every block mean and every score is
    equal, and each query reads its own block and the k - 1 blocks just before it (a window)."""
    module = make("moba")
    q, k, _, _ = inputs(module, 45, B=2)
    k = k[:, :, :1].expand_as(k)
    blocks = attention.moba_select(q, attention.block_means(k, 8), 0, 8, 3)  # (B, H, T, 3)
    for t in range(45):
        want = {j for j in (t // 8, t // 8 - 1, t // 8 - 2) if j >= 0}
        for row in blocks[:, :, t].reshape(-1, 3).tolist():
            assert {j for j in row if j >= 0} == want, (t, row)


def test_nsa_ties_go_to_the_most_recent_blocks():
    """The tie rule of `top_blocks` in nsa's choice (eqs. 10-12): with every block score equal,
    a query reads the 3 forced blocks (the first, its own, the one before) and the most recent
    others, n in all."""
    scores = torch.zeros(1, 4, 45, 6)  # (B, H, T, J): blocks of 8, 6 up to the last query's own
    blocks = attention.nsa_top_blocks(scores, 0, 8, 5, 2)
    for t in range(45):
        own = t // 8
        want = {0, own, own - 1, own - 2, own - 3} if own >= 4 else set(range(own + 1))
        for row in blocks[:, :, t].reshape(-1, 5).tolist():
            assert {j for j in row if j >= 0} == want, (t, row)


def test_nsa_forced_blocks_and_selection_size():
    module = make("nsa", nsa_topk=5)
    q, k, v, x = inputs(module, 45, B=2)
    module.record_gates(True)
    run(module, "ref", q, k, v, x)
    blocks = module.selection  # (B, H, T, n)
    for t in range(45):
        own = t // 8
        for row in blocks[:, :, t].reshape(-1, 5):
            got = {int(j) for j in row if j >= 0}
            assert len(got) == min(5, own + 1) == int((row >= 0).sum())
            assert {j for j in (0, own, own - 1) if j >= 0} <= got and max(got) <= own
    assert torch.equal(blocks[:, 0], blocks[:, 1]) and torch.equal(blocks[:, 2], blocks[:, 3])  # eq. 10: per key head


@pytest.mark.parametrize("attn", ["nsa", "moba"])
def test_no_gradient_through_the_selection(attn):
    """The gradients of q, k, v equal those of the same attention with the selection held as
    constants: the choice of blocks passes no gradient."""
    module = make(attn, nsa_branches="slc")
    q, k, v, x = (t.requires_grad_() for t in inputs(module, 45))
    module.record_gates(True)
    out = run(module, "ref", q, k, v, x)
    blocks = module.selection.clone()
    assert not blocks.requires_grad
    block = module.cfg.nsa_block if attn == "nsa" else module.cfg.moba_block
    fixed = attention.block_attention(q, k, v, module.scale, 0, 0, block, blocks)
    if attn == "nsa":
        fixed = fixed * torch.sigmoid(module.branch_gate(x)).view(1, 45, 3, 4)[:, :, 1].transpose(1, 2)[..., None]
    cot = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), cot), torch.autograd.grad(fixed, (q, k, v), cot)):
        assert rel(a, b) < 1e-6


@pytest.mark.parametrize("length,stride,block,C,J", [(4, 2, 8, 21, 6), (4, 2, 8, 3, 6), (16, 8, 32, 30, 8),
                                                     (32, 16, 64, 40, 11), (8, 8, 8, 9, 9), (8, 4, 16, 0, 2)])
def test_nsa_block_scores_equal_the_overlap_matrix(length, stride, block, C, J):
    """kernels.sliding_block_scores (the fast paths') equals eq. 9's overlap matrix product
    p @ block_overlap (attention.compressed_branch's eq. 9), with fewer compressed keys than the blocks
    cover and more (the chunks cut C causally)."""
    p = torch.rand(2, 3, 5, C, dtype=torch.float64)
    expected = p @ attention.block_overlap(C, J, length, stride, block, "cpu").double()
    assert torch.allclose(kernels.sliding_block_scores(p, J, length, stride, block), expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------- the fast paths

def random_blocks(B, H, T, q_start, block, n, seed):
    """A selection as the variants make one: the own block, then random earlier blocks, and
    some empty slots."""
    g = torch.Generator().manual_seed(seed)
    own = (q_start + torch.arange(T)) // block
    blocks = torch.stack([torch.randint(0, 10**6, (B, H, T), generator=g) % (own + 1) for _ in range(n - 1)], -1)
    blocks = torch.cat([own.expand(B, H, T)[..., None], blocks], -1)
    return blocks.masked_fill(torch.rand(B, H, T, n, generator=g) < 0.2, -1)


@pytest.mark.parametrize("T,q_start,k_start,block", [(1, 0, 0, 16), (45, 0, 0, 8), (257, 0, 0, 16), (300, 0, 0, 160),
                                                      (7, 300, 0, 16), (7, 300, 150, 16), (1, 300, 260, 32)])
def test_block_attention_fast_paths_equal_the_reference(T, q_start, k_start, block):
    """Blockwise: outputs and gradients of q, k, v; FlexAttention (no CPU backward for q, k,
    v): outputs. GQA (4 query heads on 2 key heads), blocks below, equal to and above the
    128-key tile, after cached keys."""
    S = q_start + T - k_start
    g = torch.Generator().manual_seed(T + q_start)
    q = torch.randn(2, 4, T, 8, generator=g).requires_grad_()
    k, v = (torch.randn(2, 2, S, 8, generator=g).requires_grad_() for _ in range(2))
    blocks = random_blocks(2, 4, T, q_start, block, 3, T)
    cot = torch.randn(2, 4, T, 8, generator=g)
    ref = attention.block_attention(q, k, v, 0.3, q_start, k_start, block, blocks)
    ref_grads = torch.autograd.grad(ref, (q, k, v), cot)
    out = kernels.BLOCKWISE.block_attention(q, k, v, 0.3, q_start, k_start, block, blocks)
    assert rel(out, ref) < 1e-5
    for a, b in zip(torch.autograd.grad(out, (q, k, v), cot), ref_grads):
        assert rel(a, b) < 1e-4
    with torch.no_grad():  # a prefill's form: no probabilities kept
        assert rel(kernels.BLOCKWISE.block_attention(q, k, v, 0.3, q_start, k_start, block, blocks), ref) < 1e-5
    with torch.no_grad():
        flex = kernels.FLEX.block_attention(q.detach(), k.detach(), v.detach(), 0.3, q_start, k_start, block, blocks)
    assert rel(flex, ref) < 1e-5


@pytest.mark.parametrize("S,q_start,H", [(64, 0, 3), (64, 40, 3), (60, 40, 3), (64, 40, 1)])
def test_block_and_window_attention_read_a_caches_keys_in_place(S, q_start, H):
    """Without GQA, keys and values that are views of a KV cache's buffers (each head's rows
    contiguous, the buffer's spare capacity between the heads, 2 batch rows): the selected
    branch reads their blocks in place where the keys fill whole blocks (no copy: the blocks
    share the buffer's memory) and copies them otherwise, and both it and the window branch
    equal the reference, whose inputs are contiguous copies."""
    B, D, block, cap = 2, 8, 8, 96
    T = S - q_start
    g = torch.Generator().manual_seed(S + q_start)
    k_buf, v_buf = (torch.randn(B, H, cap, D, generator=g) for _ in range(2))
    k, v = k_buf[:, :, :S], v_buf[:, :, :S]  # what the cache hands over
    q = torch.randn(B, T, H, D, generator=g).transpose(1, 2)  # laid out as the projections make it
    blocks = random_blocks(B, H, T, q_start, block, 3, S)
    with torch.no_grad():
        kb, apart = kernels.key_blocks(k, block, 0)
        assert (kb.data_ptr() == k_buf.data_ptr()) == (S % block == 0)
        assert torch.equal(kb[apart * (H + H // 2) + 1], k[1, H // 2, block:2 * block])  # batch 1's middle head's 2nd
        ref = attention.block_attention(q, k.contiguous(), v.contiguous(), 0.3, q_start, 0, block, blocks)
        assert rel(kernels.BLOCKWISE.block_attention(q, k, v, 0.3, q_start, 0, block, blocks), ref) < 1e-5
        ref = attention.attention(q, k.contiguous(), v.contiguous(), 0.3, q_start, 0, window=5)
        assert rel(kernels.BLOCKWISE.attention(q, k, v, 0.3, q_start, 0, window=5), ref) < 1e-5


@pytest.mark.parametrize("span,tile", [(1, 1), (7, 3), (40, 4), (40, 64)])
def test_block_attention_over_many_spans_and_tiles_equals_the_reference(monkeypatch, span, tile):
    """The blockwise form's loops over spans of tiles (one tile a span, a few, all in one) and
    its groups cut into tiles (of one pair, a few, larger than every group: padding rows in
    most tiles): outputs and gradients as the reference's, and the outputs without a gradient
    to take (each span's logits computed in both passes, none kept)."""
    monkeypatch.setattr(kernels, "DISPATCH_PAIRS", span)
    monkeypatch.setattr(kernels, "DISPATCH_TILE", tile)
    T, q_start, k_start, block = 50, 20, 4, 8
    g = torch.Generator().manual_seed(span + tile)
    q = torch.randn(2, 4, T, 8, generator=g).requires_grad_()
    k, v = (torch.randn(2, 2, q_start + T - k_start, 8, generator=g).requires_grad_() for _ in range(2))
    blocks = random_blocks(2, 4, T, q_start, block, 4, span)
    cot = torch.randn(2, 4, T, 8, generator=g)
    ref = attention.block_attention(q, k, v, 0.3, q_start, k_start, block, blocks)
    out = kernels.BLOCKWISE.block_attention(q, k, v, 0.3, q_start, k_start, block, blocks)
    assert rel(out, ref) < 1e-5
    for a, b in zip(torch.autograd.grad(out, (q, k, v), cot), torch.autograd.grad(ref, (q, k, v), cot)):
        assert rel(a, b) < 1e-4
    with torch.no_grad():
        assert rel(kernels.BLOCKWISE.block_attention(q, k, v, 0.3, q_start, k_start, block, blocks), ref) < 1e-5


def test_tile_layout_cuts_each_group_into_padded_tiles_in_order():
    """Groups of 5, 0, 2 and 3 pairs in tiles of 2: 3 + 0 + 1 + 2 tiles, each group's pairs in
    order from its first tile's first row, the rows after a group's last pair left as padding."""
    group = torch.tensor([0, 0, 0, 0, 0, 2, 2, 3, 3, 3])
    pos, tile_group = kernels.tile_layout(group, 4, 2)
    assert tile_group.tolist() == [0, 0, 0, 2, 3, 3]
    assert pos.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]


def test_block_attention_with_no_visible_key_gives_zero():
    """A query whose list holds no visible key (all slots empty, or only a block before the
    first cached key) gets 0 and no NaN, on the blockwise path as in the reference."""
    T, q_start, k_start, block = 20, 40, 36, 8
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, T, 8, generator=g).requires_grad_()
    k, v = (torch.randn(1, 2, q_start + T - k_start, 8, generator=g).requires_grad_() for _ in range(2))
    blocks = random_blocks(1, 2, T, q_start, block, 2, 5)
    blocks[:, :, 3] = -1  # nothing listed
    blocks[:, 0, 7] = torch.tensor([3, -1])  # block 3 (positions 24 .. 31) ends before the first key (36)
    blocks[:, 1, 9] = torch.tensor([7, 7])  # query 49 lists only a future block (56 .. 63), twice
    cot = torch.randn(1, 2, T, 8, generator=g)
    ref = attention.block_attention(q, k, v, 0.3, q_start, k_start, block, blocks)
    out = kernels.BLOCKWISE.block_attention(q, k, v, 0.3, q_start, k_start, block, blocks)
    assert out[:, :, 3].abs().max() == out[:, 0, 7].abs().max() == out[:, 1, 9].abs().max() == 0
    assert rel(out, ref) < 1e-5
    for a, b in zip(torch.autograd.grad(out, (q, k, v), cot), torch.autograd.grad(ref, (q, k, v), cot)):
        assert rel(a, b) < 1e-4


def test_block_attention_with_no_block_listed_at_all_gives_zero():
    """No query lists any block (no pair to route, no tile): zeros and zero gradients, as in
    the reference, not an error."""
    q, k, v = (torch.randn(1, 2, 5, 8).requires_grad_() for _ in range(3))
    blocks = torch.full((1, 2, 5, 3), -1)
    out = kernels.BLOCKWISE.block_attention(q, k, v, 0.3, 0, 0, 4, blocks)
    assert torch.equal(out, attention.block_attention(q, k, v, 0.3, 0, 0, 4, blocks)) and out.abs().max() == 0
    assert all(g.abs().max() == 0 for g in torch.autograd.grad(out.sum(), (q, k, v)))


@pytest.mark.parametrize("attn,flags", [("nsa", {}), ("nsa", dict(nsa_compress="mlp")),
                                        ("nsa", dict(nsa_branches="cmp,win")), ("moba", {})])
def test_fused_and_flex_equal_the_reference(monkeypatch, attn, flags):
    """Whole variant, T = 45 and 130: fused and flex outputs and gradients of q, k, v, x and
    every parameter; flex's output through eager FlexAttention (no CPU backward for q, k,
    v), its gradients through `dense_flex` in its place."""
    module = make(attn, **flags)
    for T in (45, 130):
        q, k, v, x = (t.requires_grad_() for t in inputs(module, T, B=2))
        named = dict(q=q, k=k, v=v, x=x, **dict(module.named_parameters()))
        cot = torch.randn(2, 4, T, 8)
        ref = run(module, "ref", q, k, v, x)
        ref_grads = torch.autograd.grad(ref, list(named.values()), cot, allow_unused=True)
        with torch.no_grad():
            assert rel(run(module, "flex", q.detach(), k.detach(), v.detach(), x), ref) < 1e-5, ("eager flex", T)
        for kernel in ("fused", "flex"):
            with monkeypatch.context() as m:
                if kernel == "flex":
                    m.setattr(kernels, "_run_flex", dense_flex)
                out = run(module, kernel, q, k, v, x)
                assert rel(out, ref) < 1e-5, (kernel, T)
                grads = torch.autograd.grad(out, list(named.values()), cot, allow_unused=True)
            for name, a, b in zip(named, grads, ref_grads):
                if b is None or b.abs().max() == 0:
                    assert a is None or a.abs().max() < 1e-6, (kernel, name)
                elif name == "compress_mlp.k.2.bias":  # shifts every compressed key of a query's
                    # softmax alike: its gradient is 0 but for rounding (up to 1e-5 at T = 130)
                    assert (a - b).abs().max() < 1e-4, (kernel, name, T)
                else:
                    assert rel(a, b) < 1e-4, (kernel, name, T)


def tiny(attn, kernel, **flags):
    torch.manual_seed(0)
    cfg = dict(PRESETS["tiny"], vocab_size=512, attn=attn, kernel=kernel, **dict(NSA if attn == "nsa" else MOBA, **flags))
    model = Model(ModelConfig(**cfg))
    for name, p in model.named_parameters():  # gates off their neutral init
        if "branch_gate" in name or "compress" in name:
            p.data.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("attn,flags", [("nsa", dict(nsa_compress="mlp")),
                                        ("moba", dict(moba_full_last=1))])
def test_cached_decoding_equals_the_forward(attn, flags):
    """Prefill 20, decode one at a time to 50, then 10 at a time to 70: the fused path's
    logits equal the reference's uncached forward."""
    idx = torch.randint(0, 512, (1, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full, _ = tiny(attn, "ref", **flags)(idx)
        model = tiny(attn, "fused", **flags)
        cache = model.new_cache()
        steps = [model(idx[:, :20], cache=cache)[0]]
        steps += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(20, 50)]
        steps += [model(idx[:, t:t + 10], cache=cache)[0] for t in range(50, 70, 10)]
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-4 * full.abs().max()


def test_moba_full_last_layers_are_full_attention():
    model = tiny("moba", "ref", moba_full_last=1)
    assert [type(b.self_attn).__name__ for b in model.layers] == ["MixtureOfBlockAttention", "CausalSelfAttention"]


@pytest.mark.parametrize("attn", ["nsa", "moba"])
def test_bf16_forward_and_backward(attn):
    idx = torch.randint(0, 512, (2, 81), generator=torch.Generator().manual_seed(5))
    for kernel in ("ref", "fused", "flex"):
        model = tiny(attn, kernel)
        with torch.no_grad():
            _, loss32 = model(idx[:, :-1], idx[:, 1:])
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(kernel != "flex"):
            _, loss16 = model(idx[:, :-1], idx[:, 1:])
        if kernel != "flex":
            loss16.backward()
            assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        assert abs(loss16.item() - loss32.item()) < 2e-2 * loss32.item(), (kernel, loss16.item(), loss32.item())


@pytest.mark.parametrize("attn", ["nsa", "moba"])
def test_flex_forward_has_no_graph_breaks(attn):
    model = tiny(attn, "flex", n_layer=1).eval()
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(torch.randint(0, 512, (1, 150)))
    assert explanation.graph_break_count == 0, explanation.break_reasons


@pytest.mark.parametrize("flags,needle", [
    (dict(attn="nsa", nsa_cmp_stride=3), "nsa_cmp_stride=3 must divide"),
    (dict(attn="nsa", nsa_cmp_block=64), "nsa_cmp_block <= nsa_block"),
    (dict(attn="nsa", nsa_topk=2), "nsa_topk=2 must be >= 3"),
    (dict(attn="nsa", nsa_branches="cmp,foo"), "subset of cmp,slc,win"),
    (dict(attn="moba", moba_topk=0), "must be >= 1"),
    (dict(attn="moba", moba_full_last=3), "moba_full_last=3 must be in 0 .. n_layer=2"),
])
def test_bad_settings_name_the_flag(flags, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig(**flags)


def test_top_blocks_masks_a_copy_unless_the_scores_are_its_own():
    """top_blocks masks the scores in place only when the caller hands them over (owned=True,
    as moba_select and nsa_top_blocks do with the scores they just made); the choice is the same."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 5, 6, generator=g)
    j, own = torch.arange(6), torch.arange(5)[:, None] + 1
    valid, forced = j <= own, j == own
    kept = scores.clone()
    chosen = attention.top_blocks(scores, valid, forced, 3)
    assert torch.equal(scores, kept)
    assert torch.equal(attention.top_blocks(scores, valid, forced, 3, owned=True), chosen)
    assert not torch.equal(scores, kept) and torch.isinf(scores[..., ~valid]).all()


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2)])
def test_nsa_top_blocks_leaves_the_callers_scores_as_they_were(H, Hkv):
    """nsa_top_blocks masks in place only the per-key-head sums it makes (eq. 10, GQA): without
    GQA the scores it is handed are the caller's, and stay as they were."""
    scores = torch.randn(2, H, 40, 5, generator=torch.Generator().manual_seed(H + Hkv))
    kept = scores.clone()
    blocks = attention.nsa_top_blocks(scores, 0, 8, 3, Hkv)
    assert torch.equal(scores, kept)
    assert torch.equal(blocks, attention.nsa_top_blocks(kept.clone(), 0, 8, 3, Hkv))
