"""What attention.py says about each variant outside its equations: `python attention.py`'s
grids of which keys each query reads (pinned against the rules they draw), each class's
line of the plan and its budget check, and the recording and auxiliary-loss mechanisms
(`note`, the indexer's loss slot) that keep state out of the maths."""
import copy
import subprocess
import sys

import pytest
import torch

import attention
from attention import VARIANTS, AttentionConfig, grid, mixing_weights
from conftest import ROOT
from model import ModelConfig

T = 16


def read(variant, **settings):
    """(T, T) bool: the keys each query reads under `variant` (weight > 0)."""
    return mixing_weights(variant, T, **settings) > 0


def test_local_grid_is_a_band_of_width_window_plus_one():
    W = 4
    seen = read("local", window=W)
    t, s = torch.arange(T)[:, None], torch.arange(T)
    assert torch.equal(seen, (s <= t) & (t - s <= W))
    rows = grid(mixing_weights("local", T, window=W))
    assert rows[10] == "." * (10 - W) + "#" * (W + 1) + " " * (T - 11)


@pytest.mark.parametrize("variant,block,n,settings", [
    ("moba", 4, 2, dict(moba_block=4, moba_topk=2)),
    ("nsa", 2, 4, dict(nsa_branches="slc", nsa_cmp_block=2, nsa_cmp_stride=2, nsa_block=2, nsa_topk=4)),
])
def test_block_variants_read_whole_blocks(variant, block, n, settings):
    """moba and nsa's selected branch: a query reads its own block up to itself and min(n, own
    + 1) blocks in all, each earlier one whole (nsa: block 0 and the one before its own
    among them); nothing after the query."""
    seen = read(variant, **settings)
    assert not seen.triu(1).any()
    for t in range(T):
        own = t // block
        blocks = {s // block for s in range(t + 1) if seen[t, s]}
        assert len(blocks) == min(n, own + 1) and own in blocks, (t, blocks)
        for j in blocks - {own}:
            assert seen[t, j * block:(j + 1) * block].all(), (t, j)
        assert seen[t, own * block:t + 1].all()
        if variant == "nsa":
            assert {0, max(0, own - 1)} <= blocks


def test_indexer_grid_reads_its_top_k_and_caa_global_ceil_sqrt():
    counts = read("indexer", index_topk=4).sum(-1)
    assert torch.equal(counts, torch.clamp(torch.arange(T) + 1, max=4))
    counts = read("caa", window=4, caa_window_max=6, caa_gate="global").sum(-1)
    assert torch.equal(counts, torch.ceil(torch.sqrt(torch.arange(T) + 1.0)).long())


def test_python_attention_py_draws_every_variant():
    r = subprocess.run([sys.executable, "attention.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for label in ("local, window 4", "moba, blocks of 4, top 2", "slc: 4 blocks of 2", "indexer, top 4 keys"):
        assert label in r.stdout
    r = subprocess.run([sys.executable, "attention.py", "--show=local"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and "moba" not in r.stdout
    assert lines[1 + 10].split()[1] == "." * 6 + "#" * 5  # query 10, window 4


@pytest.mark.parametrize("settings,T,line,warning", [
    (dict(attn="full"), 1024, "none: every key j <= i, of a 1024-token sequence", None),
    (dict(attn="local", window=256), 1024, "256 keys back, of a 1024-token sequence", None),
    (dict(attn="local", window=256), 200, "256 keys back, of a 200-token sequence",
     "local: window 256 covers the whole 200-token sequence (a query has at most 199 keys before it), so it "
     "computes full attention; pass --window below 199"),
    (dict(attn="dsa"), 300, "256 keys back for queries at positions >= 512 (dsa_threshold), every key below it, "
     "of a 300-token sequence", "dsa: dsa_threshold 512 >= seq_len 300: no query is windowed, so it computes full "
     "attention; pass --dsa_threshold below 300"),
    (dict(attn="asga"), 64, "none: a learned pair gate on every key j <= i, of a 64-token sequence", None),
    (dict(attn="moba", moba_block=64, moba_topk=4), 1024,
     "its own block and the top 3 earlier blocks of 64 (256 keys), of a 1024-token sequence", None),
    (dict(attn="indexer", window=16), 128, "the top 16 keys per query by a lightning indexer of 4 heads of 64 "
     "(index_topk = the window), of a 128-token sequence", None),
])
def test_describe_says_what_a_query_reads(settings, T, line, warning):
    cfg = AttentionConfig(**settings)
    assert VARIANTS[cfg.attn].describe(cfg, T) == (line, warning)


def test_check_budget_refuses_a_dense_selection():
    cfg = AttentionConfig(attn="moba", moba_block=64, moba_topk=4)
    VARIANTS["moba"].check_budget(cfg, 256)
    with pytest.raises(ValueError, match=r"--moba_topk=4 x --moba_block=64 = 256 keys > seq_len=200: the selection "
                                         r"would be dense; use moba_topk in 1 \.\. 3"):
        VARIANTS["moba"].check_budget(cfg, 200)
    cfg = AttentionConfig(attn="nsa")
    with pytest.raises(ValueError, match=r"--nsa_topk=8 x --nsa_block=32 = 256 keys > seq_len=128"):
        VARIANTS["nsa"].check_budget(cfg, 128)
    for name in ("full", "local", "dsa", "asga", "caa", "combiner", "indexer"):
        VARIANTS[name].check_budget(AttentionConfig(attn=name), 8)  # nothing to refuse


def test_model_config_is_an_attention_config_with_the_decoders_sizes():
    cfg = ModelConfig(attn="caa", n_layer=3)
    assert isinstance(cfg, AttentionConfig) and cfg.n_layer == 3
    with pytest.raises(ValueError, match="caa_window_max=100 must be >= window=256"):
        ModelConfig(attn="caa", caa_window_max=100)  # caa's check_config, through AttentionConfig


def test_note_is_a_no_op_unless_recording():
    module = VARIANTS["dsa"](AttentionConfig(attn="dsa", window=4))
    module.note("never", lambda: 1 / 0)  # not recording: the function is not even called
    assert module.gates == {} and module.selection is None
    module.record_gates(True)
    q, k, v = torch.randn(1, 4, 6, 16), torch.randn(1, 4, 6, 16), torch.randn(1, 4, 6, 16)
    x = torch.randn(1, 6, 64)
    module(x, *attention.rope_cos_sin(torch.arange(6), 16, 10000.0), 0)
    assert module.gates["head_gate"].shape == (1, 6, 4) and not module.gates["head_gate"].requires_grad
    module.record_gates(False)
    assert module.gates == {}


def test_indexer_loss_survives_until_read_and_a_copy_starts_without_one():
    cfg = AttentionConfig(attn="indexer", window=4, index_head_dim=8, index_heads=2)
    module = VARIANTS["indexer"](cfg).train()
    q, k, v, x = torch.randn(1, 4, 6, 16), torch.randn(1, 4, 6, 16), torch.randn(1, 4, 6, 16), torch.randn(1, 6, 64)
    module.attend(q, k, v, x, 0, 0)
    assert module.indexer_loss is not None and module.indexer_loss.requires_grad
    clone = copy.deepcopy(module)  # the loss holds the forward's graph: not copied
    assert clone.indexer_loss is None and module.indexer_loss is not None
    module.indexer_loss.backward()
    assert module.indexer.q_proj.weight.grad is not None
    module.eval().attend(q, k, v, x, 0, 0)
    assert module.indexer_loss is None


def test_every_variant_is_built_by_name_and_none_overrides_forward():
    for name, cls in VARIANTS.items():
        assert cls.forward is attention.CausalSelfAttention.forward, name
        assert isinstance(cls(AttentionConfig(attn=name)), attention.CausalSelfAttention)


@pytest.mark.parametrize("q_start,k_start", [(0, 0), (9, 3)])
def test_recorded_pair_gate_in_chunks_equals_the_reference(monkeypatch, q_start, k_start):
    """kernels.chunked_mean_pair_gate (asga's recorded statistic on the fast paths, a few
    query rows at a time) equals attention.mean_pair_gate, after cached keys too."""
    import kernels

    monkeypatch.setattr(kernels, "RECORD_ELEMENTS", 2 * 3 * 20 * 4 * 3)  # 3 rows a chunk
    g = torch.Generator().manual_seed(0)
    T, S = 11, 11 + q_start - k_start
    q_term, k_term = torch.randn(2, 3, T, 4, generator=g), torch.randn(2, 3, S, 4, generator=g)
    w2, b2 = torch.randn(3, 4, generator=g), torch.randn(3, generator=g)
    ref = attention.mean_pair_gate(q_term, k_term, w2, b2, q_start, k_start)
    assert ref.shape == (2, T, 3)
    assert torch.allclose(kernels.chunked_mean_pair_gate(q_term, k_term, w2, b2, q_start, k_start), ref, atol=1e-6)
