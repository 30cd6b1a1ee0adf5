"""indexer, DeepSeek Sparse Attention ([DS32]; attention.IndexerAttention): the indexer's
scores, the selection and the attention against plain loops written here from the paper's
equations (one query at a time), ties toward the most recent key, k >= t + 1 and k >= T
(then `full`), causality and prefix invariance, cached decoding, the KL training loss against
a hand computation in both stages, where its gradients go (and the language-model loss's),
the core op `selected_attention` through the blockwise and FlexAttention paths equal to the
reference (outputs and gradients, after cached keys too), bf16, and the configuration errors.

Errors are relative, max|a - b| / max|b|, as in tests/test_kernels.py.
"""
import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import attention
import kernels
from model import PRESETS, Model, ModelConfig

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
SMALL = dict(n_head=4, n_kv_head=2, head_dim=8, d_model=16, window=6, index_heads=3, index_head_dim=8)


pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors (conftest.py)


def make(seed=0, **flags):
    cfg = ModelConfig(**dict(PRESETS["tiny"], attn="indexer", **dict(SMALL, **flags)))
    torch.manual_seed(seed)
    module = attention.VARIANTS["indexer"](cfg)
    for p in module.parameters():
        p.data.normal_(0, 0.3)
    return module


def inputs(module, T, B=1, seed=1):
    cfg = module.cfg
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, cfg.n_head, T, cfg.head_dim, generator=g)
    k = torch.randn(B, cfg.n_kv_head, T, cfg.head_dim, generator=g)
    v = torch.randn(B, cfg.n_kv_head, T, cfg.head_dim, generator=g)
    x = torch.randn(B, T, cfg.d_model, generator=g)
    return q, k, v, x


def run(module, kernel, q, k, v, x, q_start=0):
    cfg = module.cfg
    module.cfg = dataclasses.replace(cfg, kernel=kernel)
    try:
        out = module.attend(q, k, v, x, q_start, q_start)
        if module.notes is not None:  # recording: what forward notes after attend
            module.notes = {}
            module.observe(q, k, v, x, q_start, q_start, None)
        return out
    finally:
        module.cfg = cfg


def index_scores(module, x):
    """(B, T, T) float32: the indexer's scores I of every query of x among its keys ([DS32] eq. 1)."""
    return attention.lightning_scores(*module.indexer(x.detach(), 0), 0, 0)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-2)).item()


# ---------------------------------------------------------------------------- the paper's loops

def rope_first_half(vec, pos, theta):
    """Rotate-half RoPE on the first half of vec (d,), written out pair by pair."""
    d = vec.shape[0]
    r = d // 2
    out = vec.clone()
    for i in range(r // 2):
        angle = pos * theta ** (-2 * i / r)
        a, b = vec[i].item(), vec[i + r // 2].item()
        out[i] = a * math.cos(angle) - b * math.sin(angle)
        out[i + r // 2] = b * math.cos(angle) + a * math.sin(angle)
    return out


def scores_loop(module, x):
    """[DS32] eq. 1, one query and key at a time: I[t, s] = sum_j w[t, j] ReLU(q[t, j] . k[s]
    / sqrt(d)) for s <= t, -inf after; q = W_q x, k = LayerNorm(W_k x), RoPE on the first
    half of both, w = W_w x / sqrt(J)."""
    ix = module.indexer
    J, d = ix.n_head, ix.head_dim
    B, T, _ = x.shape
    out = torch.full((B, T, T), float("-inf"))
    for b in range(B):
        keys = []
        for s in range(T):
            raw = ix.k_proj.weight @ x[b, s]
            normed = (raw - raw.mean()) / torch.sqrt(raw.var(unbiased=False) + ix.k_norm.eps)
            keys.append(rope_first_half(normed * ix.k_norm.weight + ix.k_norm.bias, s, ix.rope_table.theta))
        for t in range(T):
            qs = (ix.q_proj.weight @ x[b, t]).view(J, d)
            w = (ix.weights_proj.weight @ x[b, t]) / math.sqrt(J)
            qs = [rope_first_half(qs[j], t, ix.rope_table.theta) for j in range(J)]
            for s in range(t + 1):
                out[b, t, s] = sum(w[j].item() * max(0.0, (qs[j] @ keys[s]).item() / math.sqrt(d)) for j in range(J))
    return out


def selection_loop(scores, k):
    """Per query t: the min(k, t + 1) keys s <= t of highest score, ties to the larger s."""
    B, T, _ = scores.shape
    return [[sorted(sorted(range(t + 1), key=lambda s: (-float(scores[b, t, s]), -s))[:k]) for t in range(T)]
            for b in range(B)]


def attention_loop(q, k, v, chosen, scale):
    """[DS32] eq. 2, one query and head at a time: softmax over the chosen keys."""
    B, H, T, D = q.shape
    group = H // k.shape[1]
    out = torch.zeros(B, H, T, D)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys = chosen[b][t]
                logits = torch.tensor([float(q[b, h, t] @ k[b, h // group, s]) * scale for s in keys])
                p = torch.softmax(logits, 0)
                out[b, h, t] = sum(pi * v[b, h // group, s] for pi, s in zip(p, keys))
    return out


def kl_loop(q, k, scores, chosen, scale):
    """[DS32] eqs. 3-4 by hand: per query, p = the heads' softmaxes over the set, summed and
    L1-normalised; KL(p || softmax(I over the set)); the mean over queries."""
    B, H, T, _ = q.shape
    group = H // k.shape[1]
    total = 0.0
    for b in range(B):
        for t in range(T):
            keys = chosen[b][t]
            p = sum(torch.softmax(torch.tensor([float(q[b, h, t] @ k[b, h // group, s]) * scale for s in keys]), 0)
                    for h in range(H))
            p = p / p.sum()
            log_i = torch.log_softmax(torch.tensor([float(scores[b, t, s]) for s in keys]), 0)
            total += float((p * (p.log() - log_i)).sum())
    return total / (B * T)


# ---------------------------------------------------------------------------- tests

def test_scores_equal_the_loop():
    module = make()
    x = inputs(module, 13, B=2)[3]
    with torch.no_grad():
        got = index_scores(module, x)
    want = scores_loop(module, x)
    assert got.shape == (2, 13, 13)
    assert torch.equal(got.isinf(), want.isinf())
    assert rel(got[want.isfinite()], want[want.isfinite()]) < 1e-5


def test_scores_of_the_last_queries_only():
    """lightning_scores of the last queries (q_start > k_start) are the last rows of all of them."""
    module = make()
    x = inputs(module, 13)[3]
    with torch.no_grad():
        q_idx, k_idx, w = module.indexer(x, 0)
        last = attention.lightning_scores(q_idx[:, 9:], k_idx, w[:, 9:], 9, 0)
        assert torch.equal(last, attention.lightning_scores(q_idx, k_idx, w, 0, 0)[:, 9:])


@pytest.mark.parametrize("tile", [3, 1 << 11])
def test_scores_in_key_tiles_equal_the_definition(tile, monkeypatch):
    """kernels._index_scores (the CPU selection's scores: the keys a tile at a time, the future
    keys masked from the call's first query on) equals lightning_scores: the finite scores to
    float32's rounding, -inf at the same (query, key) pairs, for queries after a prefix and
    keys that start after position 0; tiles of 3 keys end in a partial one."""
    monkeypatch.setattr(kernels, "INDEX_KEY_TILE", {"cpu": tile, "cuda": tile})
    module = make()
    x = inputs(module, 23, B=2)[3]
    with torch.no_grad():
        q_idx, k_idx, w = module.indexer(x, 0)
        for q_start, k_start in ((0, 0), (9, 0), (9, 4)):
            args = q_idx[:, q_start:], k_idx[:, k_start:], w[:, q_start:], q_start, k_start
            want, got = attention.lightning_scores(*args), kernels._index_scores(*args)
            assert torch.equal(got.isinf(), want.isinf()), (q_start, k_start)
            assert rel(got[want.isfinite()], want[want.isfinite()]) < 1e-6, (q_start, k_start)


@pytest.mark.parametrize("d", [16, 64])
def test_scale_moved_onto_the_weights_changes_no_bit(d, monkeypatch):
    """Where 1 / sqrt(d) is a power of two, kernels._index_scores multiplies the heads' weights
    by it instead of dividing the dots: the scores equal the divided form's to the bit."""
    assert kernels._scale_on_weights(d) and not any(map(kernels._scale_on_weights, (8, 12, 32, 36, 48)))
    g = torch.Generator().manual_seed(3)
    q_idx, k_idx = torch.randn(2, 30, 4, d, generator=g), torch.randn(2, 30, d, generator=g)
    w = torch.randn(2, 30, 4, generator=g)
    moved = kernels._index_scores(q_idx, k_idx, w, 0, 0)
    monkeypatch.setattr(kernels, "_scale_on_weights", lambda d: False)
    divided = kernels._index_scores(q_idx, k_idx, w, 0, 0)
    assert torch.equal(moved, divided)
    assert rel(moved[moved.isfinite()], attention.lightning_scores(q_idx, k_idx, w, 0, 0)[moved.isfinite()]) < 1e-6


@pytest.mark.parametrize("topk", [1, 4, 20])
def test_selection_and_attention_equal_the_loops(topk, monkeypatch):
    """The selection equals a brute-force sort (ties to the most recent key) and the output the
    loop over it, on every path (the fast paths' selection a few queries at a time); with one
    indexer head, ReLU zeroes about half the scores, so ties are exercised; k >= t + 1 takes
    every visible key."""
    module = make(index_topk=topk, index_heads=1)
    q, k, v, x = inputs(module, 17, B=2)
    monkeypatch.setattr(kernels, "INDEX_SCORES", 2 * 17 * 5)  # 5 queries a chunk
    monkeypatch.setattr(kernels, "INDEX_KEY_TILE", {"cpu": 4, "cuda": 4})  # their scores 4 keys a tile
    with torch.no_grad():
        scores = index_scores(module, x)
        assert (scores == 0).float().mean() > 0.2  # ties are frequent
        chosen = selection_loop(scores, topk)
        for select in (attention.indexer_topk, kernels.chunked_indexer_topk):
            keys = select(*module.indexer(x, 0), 0, 0, module.topk)
            got = [[sorted(s for s in row.tolist() if s >= 0) for row in keys[b]] for b in range(2)]
            assert got == chosen, select
        want = attention_loop(q, k, v, chosen, module.scale)
        for kernel in ("ref", "fused", "flex"):
            assert rel(run(module, kernel, q, k, v, x), want) < 1e-5, kernel


def test_zero_indexer_selects_the_window_of_recent_keys():
    """All scores 0 (w = 0): every tie goes to the most recent key, so the selection is the
    k most recent keys, and the output equals `local` with window k - 1."""
    module = make(index_topk=5)
    with torch.no_grad():
        module.indexer.weights_proj.weight.zero_()
    q, k, v, x = inputs(module, 20)
    with torch.no_grad():
        keys = attention.indexer_topk(*module.indexer(x, 0), 0, 0, module.topk)
        for t in range(20):
            assert sorted(s for s in keys[0, t].tolist() if s >= 0) == list(range(max(0, t - 4), t + 1))
        local = attention.attention(q, k, v, module.scale, 0, 0, window=4)
        for kernel in ("ref", "fused", "flex"):
            assert rel(run(module, kernel, q, k, v, x), local) < 1e-5, kernel


def test_topk_at_least_T_is_full_attention():
    module = make(index_topk=30)
    q, k, v, x = inputs(module, 25)
    with torch.no_grad():
        full = attention.attention(q, k, v, module.scale, 0, 0)
        for kernel in ("ref", "fused", "flex"):
            assert rel(run(module, kernel, q, k, v, x), full) < 1e-5


def test_index_topk_defaults_to_the_window():
    assert make(window=7).topk == 7
    assert make(window=7, index_topk=3).topk == 3


def test_kl_equals_the_hand_computation_in_both_stages():
    module = make(index_topk=4).train()
    q, k, v, x = inputs(module, 11, B=2)
    scores = index_scores(module, x).detach()
    for dense in (True, False):
        module.dense_warmup = dense
        run(module, "ref", q, k, v, x)
        if dense:
            chosen = [[list(range(t + 1)) for t in range(11)] for _ in range(2)]
        else:
            chosen = selection_loop(scores, 4)
        want = kl_loop(q, k, scores, chosen, module.scale)
        assert abs(module.indexer_loss.item() - want) < 1e-5 * max(1.0, want), (dense, module.indexer_loss.item(), want)
    module.eval()
    run(module, "ref", q, k, v, x)
    assert module.indexer_loss is None


@pytest.mark.parametrize("dense", [True, False])
def test_kl_in_chunks_equals_the_reference(dense, monkeypatch):
    """kernels.chunked_indexer_kl (the fast paths' L^I, a few queries at a time, each chunk
    checkpointed), after earlier queries too: the loss and its gradients into the indexer's
    queries, keys and weights equal attention.indexer_kl's."""
    monkeypatch.setattr(kernels, "INDEX_SCORES", 2 * 4 * 30 * 6)  # 6 queries a chunk
    module = make(index_topk=4)
    q, k, v, x = inputs(module, 30, B=2)
    q_idx, k_idx, w = (t.detach().requires_grad_() for t in module.indexer(x, 0))
    q_start = 11  # the last 19 positions' queries
    keys = None if dense else attention.indexer_topk(q_idx[:, q_start:], k_idx, w[:, q_start:], q_start, 0, 4)
    fns = (attention.indexer_kl, kernels.chunked_indexer_kl, kernels.FLEX.indexer_kl)
    losses = [fn(q[:, :, q_start:], k, module.scale, q_idx[:, q_start:], k_idx, w[:, q_start:], q_start, 0, keys)
              for fn in fns]
    grads = [torch.autograd.grad(loss, (q_idx, k_idx, w)) for loss in losses]
    for fn, loss, grad in zip(fns[1:], losses[1:], grads[1:]):
        assert abs(loss.item() - losses[0].item()) < 1e-6 * losses[0].item(), fn.__name__
        for a, b in zip(grad, grads[0]):
            assert rel(a, b) < 1e-5, fn.__name__


def test_flex_sparse_kl_reads_only_the_listed_keys():
    """The GPU path's sparse-stage L^I (kernels._listed_kl), compiled by inductor: the loss
    and its gradients into the indexer's queries, keys and weights equal the reference's, and
    the generated forward and backward code allocate nothing of T x S elements (the chunked
    form's masked (T, S) logits) nor of T x n x d (gathered indexer keys)."""
    from torch._inductor.utils import run_and_get_code
    import re

    module = make(index_topk=24, index_heads=2, index_head_dim=16)
    T, q_start = 96, 8
    q, k, v, x = inputs(module, T + q_start, B=1)
    q_idx, k_idx, w = (t.detach().requires_grad_() for t in module.indexer(x, 0))
    q, q_idx, w = q[:, :, q_start:], q_idx[:, q_start:], w[:, q_start:]
    keys = attention.indexer_topk(q_idx, k_idx, w, q_start, 0, 24)
    S, n, d = k.shape[2], keys.shape[-1], q_idx.shape[-1]
    ref = attention.indexer_kl(q, k, module.scale, q_idx, k_idx, w, q_start, 0, keys)
    ref_grads = torch.autograd.grad(ref, (q_idx, k_idx, w))
    torch._dynamo.reset()
    fn = torch.compile(kernels._listed_kl, dynamic=False)

    def forward_backward():
        loss = fn(q, k, module.scale, q_idx, k_idx, w, q_start, 0, keys)
        return loss, torch.autograd.grad(loss, (q_idx, k_idx, w))

    (loss, grads), codes = run_and_get_code(forward_backward)
    assert abs(loss.item() - ref.item()) < 1e-5 * ref.item()
    for a, b in zip(grads, ref_grads):
        assert rel(a, b) < 1e-4
    sizes = [math.prod(int(e) for e in shape.split(",") if e.strip())
             for code in codes for shape in re.findall(r"empty_strided_\w+\(\(([\d, ]*)\)", code)]
    assert len(codes) >= 2 and sizes
    assert max(sizes) < min(T * S, T * n * d), (max(sizes), T * S, T * n * d)


@pytest.mark.parametrize("dense", [True, False])
def test_gradients_are_separated(dense):
    """The KL reaches the indexer alone (none into x, q, k, v or the main projections); the
    attention output, hence the language-model loss, reaches everything but the indexer."""
    module = make(index_topk=4).train()
    module.dense_warmup = dense
    q, k, v, x = (t.requires_grad_() for t in inputs(module, 15, B=2))
    y = run(module, "fused", q, k, v, x)
    indexer = list(module.indexer.parameters())
    grads = torch.autograd.grad(module.indexer_loss, [q, k, v, x] + indexer, allow_unused=True)
    assert all(g is None or g.abs().max() == 0 for g in grads[:4])
    assert all(g is not None and g.abs().max() > 0 for g in grads[4:])
    grads = torch.autograd.grad(y.square().sum(), [q, k, v, x] + indexer, allow_unused=True)
    assert all(g is not None and g.abs().max() > 0 for g in grads[:3])
    assert all(g is None or g.abs().max() == 0 for g in grads[3:])


def tiny(kernel, **flags):
    torch.manual_seed(0)
    model = Model(ModelConfig(**dict(PRESETS["tiny"], vocab_size=512, attn="indexer", kernel=kernel,
                                     window=6, index_head_dim=16, **flags)))
    for name, p in model.named_parameters():  # an indexer whose scores are far from ties
        if "indexer" in name and p.dim() == 2:
            p.data.normal_(0, 0.3)
    return model


def test_causal_and_prefix_invariant():
    """A token's output depends on earlier tokens only: a prefix gives the same logits, and
    changing a later token leaves the earlier ones unchanged."""
    idx = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for kernel in ("ref", "fused"):
            model = tiny(kernel).eval()
            full, _ = model(idx)
            assert rel(model(idx[:, :23])[0], full[:, :23]) < 1e-5
            changed = idx.clone()
            changed[:, 30] = (changed[:, 30] + 1) % 512
            assert rel(model(changed)[0][:, :30], full[:, :30]) < 1e-5


def test_cached_decoding_equals_the_forward():
    """Prefill 20, decode one at a time to 50, then 10 at a time to 70 (indexer keys cached
    too): the fused path's logits equal the reference's uncached forward."""
    idx = torch.randint(0, 512, (1, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full, _ = tiny("ref").eval()(idx)
        model = tiny("fused").eval()
        cache = model.new_cache()
        steps = [model(idx[:, :20], cache=cache)[0]]
        steps += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(20, 50)]
        steps += [model(idx[:, t:t + 10], cache=cache)[0] for t in range(50, 70, 10)]
    assert rel(torch.cat(steps, 1), full) < 1e-4


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("q_start", [0, 37])
def test_selected_attention_paths_equal_the_reference(q_start, dense, monkeypatch):
    """The core op alone, on random selections (with empty slots, a query listing nothing and
    one listing only a future key), after cached keys too: blockwise outputs and q, k, v
    gradients in several chunks, and outputs without gradient (compiled and eager), gathered and dense (SDPA under a mask of the listed keys,
    which the blockwise path takes while queries see few keys); flex outputs (FlexAttention,
    eager)."""
    monkeypatch.setattr(kernels, "SELECTED_DENSE", 10 ** 9 if dense else 0)
    monkeypatch.setattr(kernels, "LISTED_DENSE", 10 ** 9 if dense else 0)
    monkeypatch.setattr(kernels, "SELECTED_MASK", 8 * (q_start + 45))  # 8 queries per dense chunk
    g = torch.Generator().manual_seed(4)
    B, H, Hkv, T, D, n = 2, 4, 2, 45, 8, 7
    S = q_start + T
    q = torch.randn(B, H, T, D, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, generator=g, requires_grad=True)
    scores = torch.rand(B, T, S, generator=g)
    scores = scores.masked_fill(~attention.allowed(T, S, q_start, 0, "cpu"), float("-inf"))
    keys = attention.top_keys(scores, n)
    assert (keys < 0).any() or q_start > 0
    keys[0, 3] = -1  # lists nothing: gets 0
    keys[1, 4] = torch.tensor([q_start + 6] + [-1] * (n - 1))  # only a later key (of its chunk): gets 0
    cot = torch.randn(B, H, T, D, generator=g)
    ref = attention.selected_attention(q, k, v, 0.3, q_start, 0, keys)
    ref_grads = torch.autograd.grad(ref, (q, k, v), cot)
    monkeypatch.setattr(kernels, "SELECTED_GATHER", B * Hkv * n * D * 8)  # 8 queries per chunk: several chunks
    monkeypatch.setattr(kernels, "LISTED_PAIRS", B * H * n * 8)  # the same without gradient
    out = kernels.BLOCKWISE.selected_attention(q, k, v, 0.3, q_start, 0, keys)
    assert rel(out, ref) < 1e-5
    for a, b in zip(torch.autograd.grad(out, (q, k, v), cot), ref_grads):
        assert rel(a, b) < 1e-4
    with torch.no_grad():  # a prefill's: the gathered form reads the listed rows where they lie, compiled or not
        for compiled in (False, True):
            monkeypatch.setattr(kernels.GatheredDots, "COMPILE", compiled)
            assert rel(kernels.BLOCKWISE.selected_attention(q, k, v, 0.3, q_start, 0, keys), ref) < 1e-5, compiled
    # eager FlexAttention has no CPU backward: its gradients are CUDA tests (and the interpret check)
    flex = kernels.FLEX.selected_attention(q.detach(), k.detach(), v.detach(), 0.3, q_start, 0, keys)
    assert rel(flex, ref) < 1e-5


def test_selected_attention_ignores_listed_future_keys():
    """selected_attention's rule "only visible keys count": a list that names future keys
    (which top_keys never makes) gives, on every path, what the same list without them gives;
    a query listing only future keys gets 0."""
    g = torch.Generator().manual_seed(8)
    B, H, Hkv, T, D, n, q_start = 1, 4, 2, 20, 8, 5, 3
    S = q_start + T
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    keys = torch.stack([torch.randperm(S, generator=g)[:n] for _ in range(T)])[None]  # distinct, as top_keys lists
    keys[:, 0, 1:] = -1
    keys[:, 0, 0] = S - 1  # the first query lists only a future key
    visible = keys <= q_start + torch.arange(T)[:, None]
    assert (~visible).any() and visible.any()
    clean = keys.masked_fill(~visible, -1)
    for ops in (attention.REFERENCE, kernels.BLOCKWISE, kernels.FLEX):
        out = ops.selected_attention(q, k, v, 0.3, q_start, 0, keys)
        assert rel(out, attention.selected_attention(q, k, v, 0.3, q_start, 0, clean)) < 1e-6, ops.name
        assert out[:, :, 0].abs().max() == 0, ops.name


@pytest.mark.parametrize("q_start,k_start", [(0, 0), (200, 0), (150, 90)])
def test_flex_selected_attention_lists_exactly_the_tiles_of_visible_listed_keys(q_start, k_start):
    """FLEX's selected attention is one FlexAttention call: its BlockMask lists, per query
    tile, exactly the key tiles holding a key that one of its queries lists and sees (in
    order, each once), and its mask_mod's bits are the listed keys (-1 none), so the tiles it
    computes follow the selection and nothing outside it counts."""
    g = torch.Generator().manual_seed(8)
    B, T, n = 2, 300, 9
    S = q_start + T - k_start
    keys = torch.rand(B, T, S, generator=g).topk(n, -1).indices  # distinct; future keys too: listed, not visible
    keys[torch.rand(B, T, n, generator=g) < 0.2] = -1
    listed = attention.listed(keys, S)
    bits = kernels.listed_bits(keys, S)
    unpacked = ((bits[..., :, None].int() >> torch.arange(8)) & 1).flatten(-2)[..., :S] == 1
    assert torch.equal(unpacked, listed)
    mask = kernels.listed_tiles(keys, T, S, q_start, k_start, lambda b, h, i, j: i >= 0)
    tile = kernels.FLEX_TILE
    visible = listed & attention.allowed(T, S, q_start, k_start, "cpu")  # (B, T, S)
    left_out = 0
    for b in range(B):
        for qt in range(-(-T // tile)):
            rows = visible[b, qt * tile:(qt + 1) * tile]
            want = [kt for kt in range(-(-S // tile)) if rows[:, kt * tile:(kt + 1) * tile].any()]
            got = mask.kv_indices[b, 0, qt, :mask.kv_num_blocks[b, 0, qt]].tolist()
            assert got == want, (b, qt, got, want)
            left_out += -(-S // tile) - len(want)
    assert left_out > 0, "no tile left out: the test would not see a mask that lists every tile"


def test_fused_and_flex_equal_the_reference():
    """Whole variant, T = 45 and 130 (past FlexAttention's 128 tile): fused outputs and the
    gradients of q, k, v, x and every parameter, and of the KL; flex outputs and the KL's
    gradients (flex's selected attention captures no tensor that needs one)."""
    module = make(index_topk=9).train()
    for T in (45, 130):
        q, k, v, x = (t.requires_grad_() for t in inputs(module, T, B=2))
        named = dict(q=q, k=k, v=v, x=x, **dict(module.named_parameters()))
        cot = torch.randn(2, 4, T, 8)
        ref = run(module, "ref", q, k, v, x)
        ref_grads = torch.autograd.grad((ref * cot).sum() + module.indexer_loss, list(named.values()), allow_unused=True)
        out = run(module, "fused", q, k, v, x)
        assert rel(out, ref) < 1e-5, T
        grads = torch.autograd.grad((out * cot).sum() + module.indexer_loss, list(named.values()), allow_unused=True)
        for name, a, b in zip(named, grads, ref_grads):
            if b is None:
                assert a is None, name
            else:
                assert rel(a, b) < 1e-4, (name, T)
        flex = run(module, "flex", q.detach(), k.detach(), v.detach(), x)  # no q, k, v backward on CPU
        assert rel(flex, ref) < 1e-5, T
        indexer = list(module.indexer.parameters())
        for a, b in zip(torch.autograd.grad(module.indexer_loss, indexer), ref_grads[-len(indexer):]):
            assert rel(a, b) < 1e-4, T


def test_bf16_forward_and_backward():
    idx = torch.randint(0, 512, (2, 81), generator=torch.Generator().manual_seed(5))
    for kernel in ("ref", "fused", "flex"):
        model = tiny(kernel).train()
        with torch.no_grad():
            _, loss32 = model(idx[:, :-1], idx[:, 1:])
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(kernel != "flex"):
            _, loss16 = model(idx[:, :-1], idx[:, 1:])
            kl = sum(layer.self_attn.indexer_loss for layer in model.layers)
        if kernel != "flex":
            (loss16 + kl).backward()
            assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
            assert all(p.grad is not None for p in model.parameters())
        assert torch.isfinite(kl)
        assert abs(loss16.item() - loss32.item()) < 2e-2 * loss32.item(), (kernel, loss16.item(), loss32.item())


@pytest.mark.parametrize("flags,needle", [
    (dict(index_topk=-1), "index_topk=-1 must be >= 1"),
    (dict(index_heads=0), "index_heads=0 must be >= 1"),
    (dict(index_head_dim=30), "index_head_dim=30 must be a positive multiple of 4"),
])
def test_bad_settings_name_the_flag(flags, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig(attn="indexer", **flags)


# ---------------------------------------------------------------------------- train.py

def train(*args, check=True):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "train.py"), *args], cwd=root, capture_output=True, text=True,
                       timeout=240, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def byte_shards(tmp_path_factory):
    import data
    words = "the indexer picks the keys the main attention would weigh most and learns from it".split()
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(words[i] for i in torch.randint(0, len(words), (60,), generator=g).tolist()) for _ in range(60)]
    out = tmp_path_factory.mktemp("bytes")
    data.tokenize_to_shards(docs, str(out), "words", shard_tokens=100_000, val_tokens=2000, workers=1, tokenizer="byte")
    return out


def test_train_runs_dense_then_sparse_and_logs_the_kl(byte_shards, tmp_path):
    """Four CPU steps, two of them dense (--indexer_warmup=2): the log lines show the KL and its
    stage; the JSONL records them; the indexer's parameter group has its own lr."""
    import json
    r = train("--preset=cpu", f"--data_dir={byte_shards}", f"--out_dir={tmp_path}", "--max_steps=4", "--eval_every=4",
              "--batch_size=2", "--total_batch_tokens=512", "--val_tokens=512", "--seq_len=128", "--attn=indexer",
              "--window=16", "--indexer_warmup=2", "--warmup_steps=1", "--indexer_lr=2e-3")
    assert "the top 16 keys per query by a lightning indexer" in r.stdout
    assert "indexer lr 0.002, dense for the first 2 steps" in r.stdout
    lines = [line for line in r.stdout.splitlines() if line.startswith("step ") and "loss" in line]
    assert [("(dense)" in line, "(sparse)" in line) for line in lines] == [(True, False)] * 2 + [(False, True)] * 2
    assert "| kept " in lines[-1]
    records = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    kls = [rec["indexer_kl"] for rec in records if "indexer_kl" in rec]
    assert len(kls) == 4 and all(k > 0 for k in kls)


def test_train_refuses_a_warmup_longer_than_the_run(tmp_path):
    r = train("--attn=indexer", "--max_steps=5", "--indexer_warmup=6", f"--out_dir={tmp_path}", "--dry_run", check=False)
    assert r.returncode != 0 and "--indexer_warmup=6: must be in 0 .. max_steps=5" in r.stderr


def test_cuda_dry_run_plan(tmp_path):
    """The GPU preset's plan for indexer, on a machine without a GPU (--dry_run needs none)."""
    r = train("--attn=indexer", "--preset=qwen-134m", "--device=cuda", "--dry_run", f"--out_dir={tmp_path / 'run'}", check=False)
    if "CUDA is not available" in r.stderr:
        pytest.skip("this train.py refuses --device=cuda without CUDA even for a dry run")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "FlexAttention" in r.stdout and "lightning indexer" in r.stdout
