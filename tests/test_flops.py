"""flops.py: model FLOPs per token against formulas written out by hand here, and each
sparse variant's key count against the keys its own selection picks."""
import pytest
import torch

import attention as A
import flops
import train
from model import PRESETS, Model, ModelConfig

T = 96


def build(**kw):
    torch.manual_seed(0)
    return Model(ModelConfig(**{**dict(n_layer=2, n_head=4, n_kv_head=2, head_dim=16, d_model=64, mlp_hidden=96,
                                       vocab_size=300, window=20), **kw}))


@pytest.mark.parametrize("tie", [True, False])
def test_full_is_6n_plus_the_causal_attention_term(tie):
    """PaLM / nanoGPT: 6N + 12 L H D T for attention over all T keys; causal, a query at t
    reads t + 1 keys, so 6 L H D (T + 1). N by hand: q, k, v, o, the SwiGLU MLP and the head
    (the embedding lookup is no matmul, tied or not)."""
    m = build(tie_embeddings=tie)
    c = m.cfg
    per_layer = (c.d_model * c.n_head * c.head_dim * 2 + 2 * c.d_model * c.n_kv_head * c.head_dim
                 + 3 * c.d_model * c.mlp_hidden)
    N = c.n_layer * per_layer + c.vocab_size * c.d_model
    assert flops.matmul_params(m) == N
    assert flops.flops_per_token(m, T) == pytest.approx(6 * N + 6 * c.n_layer * c.n_head * c.head_dim * (T + 1))


def visible_keys(T, window=None, window_from=0):
    """The mean number of keys per query that attention.allowed lets through."""
    return A.allowed(T, T, 0, 0, "cpu", window, window_from).sum().item() / T


@pytest.mark.parametrize("attn, kw, window, window_from", [
    ("local", {}, 20, 0),
    ("dsa", dict(dsa_window="adaptive", dsa_threshold=40), 20, 40),
    ("dsa", dict(dsa_window="fixed"), 20, 0),
    ("dsa", dict(dsa_window="none"), None, 0),
    ("asga", dict(asga_gate="fixed"), 20, 0),
    ("asga", dict(asga_gate="off"), None, 0),
])
def test_windowed_variants_count_the_keys_their_mask_allows(attn, kw, window, window_from):
    m = build(attn=attn, **kw)
    grad, nograd = flops.attention_flops(m.layers[0].self_attn, T)
    assert nograd == 0
    assert grad == pytest.approx(4 * 4 * 16 * visible_keys(T, window, window_from))


def test_asga_learned_adds_its_pair_mlp_per_score():
    m = build(attn="asga", asga_hidden=8)
    grad, _ = flops.attention_flops(m.layers[0].self_attn, T)
    assert grad == pytest.approx((4 * 4 * 16 + 4 * 8 * 4) * visible_keys(T))
    n_w1 = 2 * 4 * 16 * 8  # w1_q and w1_k multiply each token once
    assert flops.matmul_params(m) == flops.matmul_params(build()) + 2 * n_w1


def selected_keys(blocks, block, T):
    """Mean over queries (and batch, heads) of the causal keys in the selected blocks."""
    t = torch.arange(T)[:, None]
    start = blocks * block
    count = (torch.minimum(start + block, t + 1) - start).clamp(min=0)
    return torch.where(blocks >= 0, count, 0).sum(-1).float().mean().item()


def test_moba_and_nsa_count_the_keys_their_selection_picks():
    x = torch.randn(2, T, 64)
    for attn, kw in [("moba", dict(moba_block=8, moba_topk=3)),
                     ("nsa", dict(nsa_cmp_block=8, nsa_cmp_stride=4, nsa_block=8, nsa_topk=4, nsa_window=10))]:
        m = build(attn=attn, **kw)
        m.record_gates(True)
        m(torch.randint(0, 300, (2, T)))
        mod = m.layers[0].self_attn
        block = mod.cfg.moba_block if attn == "moba" else mod.cfg.nsa_block
        picked = selected_keys(mod.selection, block, T)
        keys = A.mean_keys(T, lambda t: A.block_keys(t, block, kw.get("moba_topk", kw.get("nsa_topk"))))
        assert keys == pytest.approx(picked), attn
    # nsa: the compressed keys a query at t sees are those whose window ends by t
    l, d = 8, 4
    visible = sum(sum(1 for i in range(T) if i * d + l - 1 <= t) for t in range(T)) / T
    cmp = A.mean_keys(T, lambda t: torch.clamp(torch.div(t + 1 - l, d, rounding_mode="floor") + 1, min=0))
    assert cmp == pytest.approx(visible)


def test_indexer_and_caa_count_their_top_k():
    m = build(attn="indexer", index_topk=12, index_heads=2, index_head_dim=8)
    mod = m.layers[0].self_attn
    x = torch.randn(1, T, 64)
    q_idx, k_idx, w = mod.indexer(x, 0)
    picked = (A.indexer_topk(q_idx, k_idx, w, 0, 0, mod.topk) >= 0).sum(-1).float().mean().item()
    grad, nograd = flops.attention_flops(mod, T)
    index = (2 * 2 * 8 + 2 * 2) * visible_keys(T)
    assert grad == pytest.approx(4 * 4 * 16 * picked + index)
    assert nograd == pytest.approx(2 * 4 * 16 * visible_keys(T))  # the KL's target: q.k, no gradient

    caa = build(attn="caa", caa_window_max=30).layers[0].self_attn
    k_i, _ = caa.k_per_query(0, T, "cpu")
    grad, nograd = flops.attention_flops(caa, T)
    assert grad == pytest.approx(4 * 4 * 16 * (visible_keys(T, 30) + k_i.double().mean().item()))
    assert nograd == pytest.approx(2 * 4 * 16 * visible_keys(T))


def test_combiner_counts_its_block_and_one_summary_per_earlier_block():
    m = build(attn="combiner", window=16)
    direct = sum(t % 16 + 1 + t // 16 for t in range(T)) / T
    grad, _ = flops.attention_flops(m.layers[0].self_attn, T)
    assert grad == pytest.approx(4 * 4 * 16 * (direct + 1))


def test_every_variant_has_a_count_and_the_sparse_ones_save_at_length():
    """At the 134M shape and T = 8192, every variant that reads a fixed budget of keys per
    query costs less than full; asga's learned gate costs more (every score, plus its MLP)."""
    with torch.device("meta"):
        models = {v: Model(ModelConfig(**PRESETS["qwen-134m"], attn=v)) for v in A.VARIANTS}
    cost = {v: flops.flops_per_token(m, 8192) for v, m in models.items()}
    for v in ("local", "dsa", "combiner", "nsa", "moba", "indexer", "caa"):
        assert cost[v] < cost["full"], v
    assert cost["asga"] > cost["full"]


def test_mfu_uses_the_devices_bf16_peak():
    assert flops.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert flops.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert flops.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert flops.peak_flops("NVIDIA H200") == 989e12
    assert flops.peak_flops("Tesla T4") is None
    info = dict(flops_per_token=1e9, device="cuda:0", device_name="NVIDIA H100 80GB HBM3")
    # 8 GPUs together at 3.2M tok/s: 400k tok/s each, 4e14 FLOP/s each
    assert train.throughput(3.2e6, info, 8) == pytest.approx(dict(flop_s=4e14, mfu=4e14 / 989e12))
    assert train.throughput(3.2e6, {**info, "device_name": "Tesla T4"}, 8) == dict(flop_s=4e14)
    assert "mfu" not in train.throughput(1e3, {**info, "device": "cpu", "device_name": "cpu"}, 1)
