"""What a decoding step costs: counted, not timed. A TorchDispatchMode counts every aten op a
one-token step dispatches and the bytes its inputs address, at two cache lengths: `local`'s
and `dsa`'s step does not grow at all; nsa's, moba's and combiner's grows with their
summaries (one per stride or block), not with the cached keys; no variant's op count grows
(no loop over blocks or keys). Then the cache itself: written in place (a step copies none
of it), its summaries appended as windows complete, and a stale summary seen by the decode
check. tests/test_sample.py holds every variant's cached greedy tokens equal to recomputation.
"""
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import attention
import model as model_module
from model import Model, ModelConfig

SIZES = dict(vocab_size=64, n_layer=1, n_head=4, n_kv_head=2, head_dim=16, d_model=64, mlp_hidden=64, window=32,
             nsa_cmp_block=8, nsa_cmp_stride=4, nsa_block=8, nsa_topk=4, nsa_window=16, moba_block=16, moba_topk=3,
             index_topk=32, index_heads=2, index_head_dim=16, caa_window_max=48)
VARIANTS = {
    "full": {}, "local": {}, "dsa": dict(dsa_window="fixed"), "combiner": {}, "nsa": {}, "moba": {},
    "indexer": {}, "caa": {}, "asga": {},
}
# positions per summary, for the variants whose step reads summaries of the cached keys
UNIT = {"nsa": SIZES["nsa_cmp_stride"], "moba": SIZES["moba_block"], "combiner": SIZES["window"]}
SHORT, LONG = 512, 2048


pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors (conftest.py)


# Ops that read their first input at the positions an index names: they read what they return.
GATHERS = {torch.ops.aten.index.Tensor, torch.ops.aten.gather.default, torch.ops.aten.index_select.default,
           torch.ops.aten.embedding.default}
# Ops that sum rows of their first input (weight) that their indices name: they read those rows.
BAGS = {torch.ops.aten._embedding_bag.default, torch.ops.aten._embedding_bag_forward_only.default}


def addressed(t):
    """Bytes of the distinct elements a tensor addresses (a broadcast dimension counts once)."""
    distinct = 1
    for size, stride in zip(t.shape, t.stride()):
        distinct *= size if stride else 1
    return distinct * t.element_size()


class StepCounter(TorchDispatchMode):
    """Counts the aten ops dispatched and the bytes their tensor inputs address; a view reads
    nothing, a gather what it returns (and its indices), a bag sum the rows it names."""

    def __init__(self):
        super().__init__()
        self.ops = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.ops += 1
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            named = 0
            if func in GATHERS:  # the source's rows that are read, and the indices
                inputs = [out] + inputs[1:]
            elif func in BAGS:  # the rows the indices name, and the indices and weights
                weight, indices = inputs[:2]
                named = indices.numel() * weight[0].numel() * weight.element_size()
                inputs = inputs[1:]
            self.bytes += named + sum(addressed(t) for t in inputs if t.layout == torch.strided)
        return out


def tiny(attn, **flags):
    torch.manual_seed(0)
    return Model(ModelConfig(**SIZES, attn=attn, kernel="fused", **flags)).eval()


def step_cost(attn, S, flags):
    """(ops, bytes) of the decoding step that follows S cached tokens (the fewest of 3 steps)."""
    model = tiny(attn, **flags)
    idx = torch.randint(0, 64, (1, S + 3), generator=torch.Generator().manual_seed(1))
    costs = []
    with torch.no_grad():
        cache = model.new_cache()
        model(idx[:, :S], cache=cache)
        for t in range(S, S + 3):
            with StepCounter() as counter:
                model(idx[:, t:t + 1], cache=cache)
            costs.append((counter.ops, counter.bytes))
    return min(costs)


@pytest.fixture(scope="module")
def costs():
    return {(name, S): step_cost(name, S, flags) for name, flags in VARIANTS.items() for S in (SHORT, LONG)}


@pytest.mark.parametrize("name", VARIANTS)
def test_no_step_runs_more_ops_on_a_longer_cache(costs, name):
    assert costs[name, LONG][0] == costs[name, SHORT][0], (name, costs[name, SHORT], costs[name, LONG])


@pytest.mark.parametrize("name", ["local", "dsa"])
def test_a_windowed_step_reads_the_same_bytes_whatever_the_cache(costs, name):
    assert costs[name, LONG][1] == costs[name, SHORT][1], (name, costs[name, SHORT], costs[name, LONG])


@pytest.mark.parametrize("name", UNIT)
def test_a_summarising_step_grows_with_its_summaries_not_its_keys(costs, name):
    """Bytes added per cached key, against `full`'s (which reads each key and value once):
    at most 4 / unit of it, unit = the positions one summary covers (nsa: one compressed key
    and value per stride, each read at most twice; moba: a mean per block; combiner: a kbar
    and a vbar per block), and far below full's own growth."""
    grown = (costs[name, LONG][1] - costs[name, SHORT][1]) / (LONG - SHORT)
    full = (costs["full", LONG][1] - costs["full", SHORT][1]) / (LONG - SHORT)
    assert 0 < grown <= 4 * full / UNIT[name], (name, grown, full)


def test_full_grows_with_every_key(costs):
    """The check can see growth: full's step reads each added key and value."""
    per_key = 2 * SIZES["n_kv_head"] * SIZES["head_dim"] * 4  # bytes of one position's key and value
    assert (costs["full", LONG][1] - costs["full", SHORT][1]) >= per_key * (LONG - SHORT)


def test_the_cache_is_written_in_place():
    """A step writes its key and value into the buffer the cache already holds: the same
    storage before and after, and a window's cache rolls within twice its length."""
    model = tiny("local")
    idx = torch.randint(0, 64, (1, 300), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model.new_cache()
        model(idx[:, :100], cache=cache)
        moved, sizes = 0, set()
        for t in range(100, 300):
            before = cache[0].k.data.untyped_storage().data_ptr()
            model(idx[:, t:t + 1], cache=cache)
            moved += cache[0].k.data.untyped_storage().data_ptr() != before
            sizes.add(cache[0].k.data.shape[-2])
    W = SIZES["window"]
    assert len(cache[0]) == W
    # 200 steps, a new buffer at most once per W steps: the prompt's trim left its W keys in
    # 2 W rows, which ran out once, then buffers of 2 (W + 1) rows, each moved after W + 1 more steps
    assert moved <= 200 // W + 1, moved
    assert sizes <= {2 * W, 2 * (W + 1)}, sizes


def test_a_step_computes_no_rope_tables(monkeypatch):
    """A decoding step reads its RoPE cos and sin from the tables made by the prefill (the
    model's, and the indexer's for its queries and keys in each layer): rope_cos_sin is not
    called in a step, where it was computed four times for the indexer and once for the
    model; decoding still equals recomputation."""
    import attention

    torch.manual_seed(0)
    model = Model(ModelConfig(**dict(SIZES, n_layer=2), attn="indexer", kernel="fused")).eval()
    idx = torch.randint(0, 64, (1, 60), generator=torch.Generator().manual_seed(4))
    calls = []
    rope_cos_sin = attention.rope_cos_sin
    monkeypatch.setattr(attention, "rope_cos_sin", lambda *a: calls.append(a[1]) or rope_cos_sin(*a))
    with torch.no_grad():
        cache = model.new_cache()
        model(idx[:, :50], cache=cache)
        # one table each: the model's, and each layer's indexer's
        assert sorted(calls) == sorted([SIZES["head_dim"]] + [SIZES["index_head_dim"] // 2] * 2), calls
        calls.clear()
        model(idx[:, 50:51], cache=cache)
    assert calls == [], calls
    assert decodes_as_recomputed(model, idx, 50)


def test_rope_table_rows_are_rope_cos_sin_of_their_positions():
    """The table's rows for start .. start + T - 1 are rope_cos_sin of those positions, past
    its first size too (it grows), and after a move to another device (a new table)."""
    import attention

    table = attention.RopeTable(64, 10000.0)
    for start, T in [(0, 7), (5, 1), (4095, 1), (4095, 3), (9000, 20), (0, 1)]:
        cos, sin = table(start, T, torch.device("cpu"))
        want_cos, want_sin = attention.rope_cos_sin(torch.arange(start, start + T), 64, 10000.0)
        torch.testing.assert_close(cos, want_cos, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin, want_sin, rtol=1e-6, atol=1e-6)
    assert table.cos.shape[0] == 16384  # grown by doubling to hold position 9019
    table.cos = table.cos.to("meta")  # as if made on another device: made anew here
    assert table(3, 2, torch.device("cpu"))[0].device.type == "cpu"


def decodes_as_recomputed(model, idx, prefill):
    """Logits of a prefill then one-token steps equal the uncached forward's."""
    with torch.no_grad():
        full, _ = model(idx)
        cache = model.new_cache()
        steps = [model(idx[:, :prefill], cache=cache)[0]]
        steps += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(prefill, idx.shape[1])]
    return (torch.cat(steps, 1) - full).abs().max().item() < 1e-4 * full.abs().max().item()


@pytest.mark.parametrize("name", ["nsa", "moba", "combiner", "indexer"])
def test_the_summaries_are_appended_as_windows_complete(name):
    model = tiny(name)
    idx = torch.randint(0, 64, (1, 150), generator=torch.Generator().manual_seed(3))
    assert decodes_as_recomputed(model, idx, 37)
    length, stride = model.layers[0].self_attn.summary_window()
    cache = model.new_cache()
    with torch.no_grad():
        model(idx, cache=cache)
    assert len(cache[0].summaries[0]) == (150 - length) // stride + 1


@pytest.mark.parametrize("capacity", [0, 700])
@pytest.mark.parametrize("name", ["nsa", "moba", "combiner", "indexer"])
def test_the_cache_keeps_only_the_incomplete_windows_inputs(name, capacity):
    """A prefill and the steps after it leave the cache holding the queries and inputs of the
    positions past the last complete summary window only (fewer than a window's length), in
    buffers sized by a window and the positions still to come (`capacity`), not by the
    prompt: a prefill copied the prompt's queries and inputs whole, into buffers of twice it."""
    model = tiny(name)
    length, stride = model.layers[0].self_attn.summary_window()
    idx = torch.randint(0, 64, (1, 620), generator=torch.Generator().manual_seed(4))
    cache = model.new_cache(capacity)
    with torch.no_grad():
        model(idx[:, :600], cache=cache)
        for t in range(600, 620):
            for rows in cache[0].pending:
                assert rows.end == t and len(rows) < length
                assert rows.data.shape[-2] <= (capacity - 600 + length + 1 if capacity else 2 * length)
            model(idx[:, t:t + 1], cache=cache)


@pytest.mark.parametrize("name", ["nsa", "moba", "combiner", "indexer"])
def test_a_stale_summary_fails_the_decode_check(name, monkeypatch):
    """The summaries frozen after the prefill (the newer windows never summarised, as a cache
    that forgot to append its block means would be): decoding no longer equals recomputation."""
    model = tiny(name)
    idx = torch.randint(0, 64, (1, 150), generator=torch.Generator().manual_seed(3))
    summarise = model_module.KVCache.summarise

    def stale(self, layer, window, q, x):
        views = summarise(self, layer, window, q, x)
        if getattr(self, "frozen", None) is None:
            self.frozen = views
        return self.frozen

    monkeypatch.setattr(model_module.KVCache, "summarise", stale)
    assert not decodes_as_recomputed(model, idx, 37)


@pytest.mark.parametrize("name", ["nsa", "moba"])
def test_a_block_gather_past_the_last_row_reads_zeros(name):
    """A decoding step reads whole blocks (kernels._cached_rows), which may read rows past
    the cache's last, into its spare capacity, and masks them; a NaN there would survive
    the mask (0 * NaN), so model.Rows fills spare capacity with zeros. Run with torch's
    deterministic mode, which fills uninitialised memory with NaN: decoding still equals
    recomputation (with the buffers made by new_empty, it does not)."""
    model = tiny(name)
    idx = torch.randint(0, 64, (1, 150), generator=torch.Generator().manual_seed(3))
    torch.use_deterministic_algorithms(True)
    try:
        assert decodes_as_recomputed(model, idx, 37)
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_decoded_top_k_keeps_every_key_tied_with_the_kth():
    """caa's top-k in a decoding step (kernels.DECODE, which reads the values of the kept keys
    only): with every key repeated 10 times, so that 10 logits tie with the k-th highest,
    every tied key is kept (attention.topk_mask's rule): equal to the reference."""
    import attention
    import kernels
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, S = 2, 4, 2, 8, 50
    k = torch.randn(B, Hkv, 5, D, generator=g).repeat(1, 1, 10, 1)  # 5 distinct keys, 10 copies each
    v = torch.randn(B, Hkv, S, D, generator=g)
    q = torch.randn(B, H, 2, D, generator=g)
    k_per_query = torch.tensor([3, 7])
    ref = attention.topk_attention(q, k, v, 0.3, S - 2, 0, k_per_query, 7)
    out = kernels.DECODE.topk_attention(q, k, v, 0.3, S - 2, 0, k_per_query, 7)
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("keys_last", [False, True])
def test_rows_keep_their_values_in_either_layout(keys_last):
    """model.Rows grown past its capacity, rolled and repeated along the batch holds the rows
    appended, whichever layout it stores (keys_last: positions the fastest-moving dim, on a
    CPU), and says which through its strides."""
    from model import Rows

    rows, g = Rows(keys_last=keys_last), torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 25, 4, generator=g)
    for t0, t1 in [(0, 7), (7, 8), (8, 20), (20, 25)]:  # the buffer grows twice
        rows.append(x[:, :, t0:t1])
    assert torch.equal(rows.view(), x)
    rows.drop_before(5)
    assert torch.equal(rows.view(), x[:, :, 5:]) and rows.start == 5
    rows.repeat_batch(2)
    assert torch.equal(rows.view(), x[:, :, 5:].repeat_interleave(2, dim=0))
    assert (rows.view().stride(-2) == 1) == keys_last and (rows.view().stride(-1) == 1) != keys_last


@pytest.mark.parametrize("keys_last", [False, True])
def test_the_indexers_step_selects_the_reference_keys_either_way_its_keys_lie(keys_last):
    """kernels.decode_indexer_topk takes its product whichever way the indexer keys lie (along
    the keys, a CPU cache's: the query rows times K^T; as rows: key-major) and selects what
    attention.indexer_topk selects: a one-token step, a few rows with future keys, and a row
    whose scores all tie (w = 0: the most recent keys). A CPU cache stores them along the keys."""
    import attention
    import kernels

    g = torch.Generator().manual_seed(0)
    B, S, J, d, n = 2, 300, 3, 8, 16
    k_idx = (torch.randn(B, d, S + 5, generator=g)[..., :S].transpose(1, 2) if keys_last
             else torch.randn(B, S, d, generator=g))
    assert (k_idx.stride(1) == 1) == keys_last
    for T in (1, 4):
        q_idx, w = torch.randn(B, T, J, d, generator=g), torch.randn(B, T, J, generator=g)
        w[1, 0] = 0.0  # every score of this row 0
        got = kernels.decode_indexer_topk(q_idx, k_idx, w, S - T, 0, n)
        assert torch.equal(got, attention.indexer_topk(q_idx, k_idx, w, S - T, 0, n))
        assert sorted(got[1, 0].tolist()) == list(range(S - T + 1 - n, S - T + 1))
    model = tiny("indexer")
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 40), generator=g), cache=cache)
    assert cache[0].summaries[0].view().stride(1) == 1


def gathered_ops(compiled):
    """kernels.DECODE's block, selected and top-k attention with decoding's gathered rows
    compiled or eager (kernels.GatheredDots)."""
    import kernels
    old = kernels.GatheredDots.COMPILE
    kernels.GatheredDots.COMPILE = compiled
    return kernels, old


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gathered_rows_equal_the_reference(compiled):
    """The decode forms that read the rows a selection names where they lie in the cache
    (kernels._cached_rows, GatheredDots, gathered_sum) equal attention.py's block, selected and
    top-k attention: keys in a cache view with spare capacity, 10 queries after the first
    keys were trimmed (k_start > 0, so some listed blocks start before the cache's first key
    and run off its start), empty and repeated slots, and GQA. Fails if a row clamped into the
    storage keeps a visible position (it would count a key several times)."""
    import attention
    kernels, old = gathered_ops(compiled)
    try:
        g = torch.Generator().manual_seed(0)
        B, H, Hkv, D, S, T, block, k_start = 2, 4, 2, 8, 100, 10, 16, 20
        cap_k, cap_v = torch.randn(B, Hkv, 160, D, generator=g), torch.randn(B, Hkv, 160, D, generator=g)
        k, v = cap_k[:, :, 30:30 + S], cap_v[:, :, 30:30 + S]  # a view: rows before and after it
        q = torch.randn(B, H, T, D, generator=g)
        q_start = k_start + S - T
        blocks = torch.randint(-1, (k_start + S) // block + 1, (B, H, T, 3), generator=g)
        blocks[..., 2] = blocks[..., 1]  # a repeated slot
        ref = attention.block_attention(q, k, v, 0.3, q_start, k_start, block, blocks)
        out = kernels.DECODE.block_attention(q, k, v, 0.3, q_start, k_start, block, blocks)
        assert (out - ref).abs().max() < 1e-5
        out = kernels.DECODE.block_attention(q, k, v.contiguous(), 0.3, q_start, k_start, block, blocks)
        assert (out - ref).abs().max() < 1e-5  # values laid out unlike the keys: their own rows
        keys = torch.randint(-1, S, (B, T, 5), generator=g)
        keys = torch.where(keys >= 0, torch.stack([torch.randperm(S, generator=g)[:5] for _ in range(B * T)]).view(B, T, 5), -1)
        ref = attention.selected_attention(q, k, v, 0.3, q_start, k_start, keys)
        out = kernels.DECODE.selected_attention(q, k, v, 0.3, q_start, k_start, keys)
        assert (out - ref).abs().max() < 1e-5
        k_per_query = torch.arange(1, T + 1) * 3
        ref = attention.topk_attention(q, k, v, 0.3, q_start, k_start, k_per_query, 3 * T)
        out = kernels.DECODE.topk_attention(q, k, v, 0.3, q_start, k_start, k_per_query, 3 * T)
        assert (out - ref).abs().max() < 1e-5
        if compiled:
            assert kernels.GatheredDots.path == "compiled (torch.compile)", kernels.GatheredDots.path
    finally:
        kernels.GatheredDots.COMPILE = old


@pytest.mark.parametrize("name", ["nsa", "moba", "indexer", "caa"])
def test_decoding_through_the_compiled_gathered_rows_equals_recomputation(name):
    """Prefill, then one-token steps through the compiled gathered rows: the logits equal the
    uncached forward's. (caa gathers values only, by `gathered_sum`: no dots with gathered
    rows to compile, so its run says no path.)"""
    kernels, old = gathered_ops(True)
    try:
        kernels.GatheredDots.path = None
        idx = torch.randint(0, 64, (1, 150), generator=torch.Generator().manual_seed(3))
        assert decodes_as_recomputed(tiny(name), idx, 37)
        path = None if name == "caa" else "compiled (torch.compile)"
        assert kernels.GatheredDots.path == path, kernels.GatheredDots.path
    finally:
        kernels.GatheredDots.COMPILE = old


def test_a_compiled_step_keeps_its_products_with_the_weights_as_the_eager_step_runs_them():
    """Inside a compiled decoding step every weight product is model.decode_linear (the form
    DecodeLinear measured fastest, opaque to inductor, which would lower it to MKL's mm): the
    graph dynamo hands the backend calls it once per nn.Linear of the model, and calls no
    other linear or matmul."""
    from torch._dynamo.backends.debugging import aot_eager
    from torch._guards import CompileContext
    graphs = {}  # by compile id: a restarted analysis hands the backend one graph twice

    def recording(gm, example_inputs):
        graphs[str(CompileContext.current_compile_id())] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        return aot_eager(gm, example_inputs)

    model = tiny("full")
    idx = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(5))
    try:
        with torch.no_grad():
            cache = model.new_cache(60)
            model(idx[:, :-1], cache=cache)
            step, _ = model_module.compile_decoding(model, backend=recording)
            step(idx[:, -1:], cache)
    finally:
        torch._dynamo.reset()
    (targets,) = graphs.values()  # one step, one graph
    want = "sparse_attention.decode_linear.default"
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert targets.count(want) == linears, sorted(set(targets))
    others = [t for t in targets if t != want and any(w in t for w in ("linear", "matmul", "addmm", "method mm "))]
    assert not others, others


@pytest.mark.parametrize("name", list(VARIANTS))
def test_under_autocast_the_cache_keeps_keys_as_attention_reads_them(name):
    """Under bf16 autocast the cache holds keys and values in bf16 (RMSNorm and RoPE hand back
    float32 keys), and a decoding step never casts the cached keys: a float32 key cache was
    cast to bf16 by every step (kernels._same_dtype), a read and a write of every cached key."""
    model = tiny(name, **VARIANTS[name])
    idx = torch.randint(0, 64, (1, 201), generator=torch.Generator().manual_seed(1))

    class Casts(TorchDispatchMode):
        storages = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                self.storages.append(args[0].untyped_storage().data_ptr())
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache = model.new_cache()
        model(idx[:, :200], cache=cache)
        with Casts() as casts:
            model(idx[:, 200:], cache=cache)
    keys = cache[0].k.view()
    assert keys.dtype == cache[0].v.view().dtype == torch.bfloat16
    assert keys.untyped_storage().data_ptr() not in casts.storages


def test_an_empty_append_writes_nothing():
    """Rows.append of no rows (the indexer's and asga's pending windows, every step) runs no
    op once the buffer exists: traced, the write of zero rows lowered to a Triton kernel
    indexed by its zero size, which failed (a division by zero) when compiled for a GPU."""
    rows = model_module.Rows()
    rows.append(torch.ones(1, 2, 3, 4))

    class Ops(TorchDispatchMode):
        ran = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ran.append(str(func))
            return func(*args, **(kwargs or {}))

    empty = torch.ones(1, 2, 3, 4)[..., 3:, :]
    with Ops() as ops:
        rows.append(empty)
    assert ops.ran == [] and len(rows) == 3 and rows.view().eq(1).all()


@pytest.mark.parametrize("keys_last", [False, True])
def test_under_autocast_the_indexer_step_reads_its_cached_keys_uncast(keys_last):
    """Under autocast the indexer's decoding scores take its cached keys as they are: its
    products run in the autocast dtype, so a float32 copy of every cached key was cast back
    for the product each step. The top keys equal those from the float32 copy (the same
    products), and no cast reads the cached keys."""
    import kernels
    g = torch.Generator().manual_seed(3)
    B, J, d, S, n = 2, 4, 16, 3000, 64
    keys = torch.randn(B, S, d, generator=g).bfloat16()
    if keys_last:
        keys = keys.transpose(1, 2).contiguous().transpose(1, 2)  # positions the fastest-moving dim
    q, w = torch.randn(B, 1, J, d, generator=g).bfloat16(), torch.randn(B, 1, J, generator=g).bfloat16()

    class Casts(TorchDispatchMode):
        storages = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                self.storages.append(args[0].untyped_storage().data_ptr())
            return func(*args, **(kwargs or {}))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with Casts() as casts:
            got = kernels.decode_indexer_topk(q, keys, w, S, 0, n)
        want = kernels.decode_indexer_topk(q, keys.float(), w, S, 0, n)
    assert keys.untyped_storage().data_ptr() not in casts.storages
    assert torch.equal(got, want)


def test_a_compiled_step_under_autocast_reads_each_weight_cast_once():
    """Under bf16 autocast a compiled decoding step's weight products take the weights as cast
    once (DecodeLinear.hold_casts): every linear in the graph dynamo hands the backend reads a
    bf16 weight, not a float32 parameter whose cast the graph would run every step. The
    logits equal the eager step's under autocast, also after a weight changes in place
    between steps (the cast is made again, not kept stale)."""
    import copy

    from torch._dynamo.backends.debugging import aot_eager
    weights = []  # the dtype of the weight each linear of each graph reads

    def recording(gm, example_inputs):
        weights.extend(n.args[1].meta["example_value"].dtype for n in gm.graph.nodes
                       if n.op == "call_function" and "linear" in str(n.target))
        return aot_eager(gm, example_inputs)

    model = tiny("full")
    idx = torch.randint(0, 64, (1, 50), generator=torch.Generator().manual_seed(5))

    def autocast():  # a region per step: eager autocast keeps its own casts while one lasts
        return torch.autocast("cpu", dtype=torch.bfloat16)
    worst = []
    try:
        with torch.no_grad():
            with autocast():
                eager_cache = model.new_cache(60)
                model(idx[:, :40], cache=eager_cache)
            compiled_cache = copy.deepcopy(eager_cache)
            step, _ = model_module.compile_decoding(model, backend=recording)
            for t in range(40, 48):
                if t == 44:
                    model.layers[0].mlp.up_proj.weight.mul_(1.5)
                token = idx[:, t:t + 1].clone()
                with autocast():
                    want = model(token, cache=eager_cache)[0]
                with autocast():
                    got = step(token, cache=compiled_cache)[0]
                worst.append(((want - got).abs().max() / want.abs().max()).item())
    finally:
        torch._dynamo.reset()
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert weights and len(weights) % linears == 0 and set(weights) == {torch.bfloat16}, weights
    assert max(worst) < 1e-6, worst


def test_decode_sized_products_take_the_form_measured_fastest_once_a_size(capsys, monkeypatch):
    """Every nn.Linear of a Model is a DecodeLinear (the same parameters, ties and state_dict
    keys). With no form fixed (DECODE_LINEAR unset), a no-grad float32 call of a few rows on a
    CPU times each form of DecodeLinear.FORMS at its size's first call, runs the fastest and
    says which, and times nothing more at that size; a call with a gradient, or of more rows,
    is F.linear itself. Each timing runs through COLD_BYTES of copies of the weight (each
    product on a weight out of the caches, as in a decoding step), the weight itself first.
    The forms here are stand-ins: the slow ones sleep and answer wrong."""
    import time

    DecodeLinear = model_module.DecodeLinear
    torch.manual_seed(0)
    model = Model(ModelConfig(**SIZES, attn="nsa", kernel="fused"))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is DecodeLinear for m in linears)
    assert model.lm_head.weight is model.embed_tokens.weight
    fresh = Model(ModelConfig(**SIZES, attn="nsa", kernel="fused"))
    assert fresh.load_state_dict(model.state_dict()) is not None
    calls, seen = [], []

    def form(name, delay, wrong):
        def run(x, weight, bias):
            calls.append(name)
            seen.append(weight)
            time.sleep(delay / copies)
            return torch.nn.functional.linear(x, weight, bias) + wrong
        return run
    monkeypatch.setattr(DecodeLinear, "FORMS", {"slow": form("slow", 0.004, 1.0), "fast": form("fast", 0.0, 0.0),
                                                "slower": form("slower", 0.008, 2.0)})
    for name, value in (("FORM", None), ("chosen", {}), ("path", None)):
        monkeypatch.setattr(DecodeLinear, name, value)
    layer = model.layers[0].self_attn.branch_gate  # a bias too
    copies = 3
    monkeypatch.setattr(DecodeLinear, "COLD_BYTES", copies * layer.weight.nbytes)
    x = torch.randn(3, 1, layer.in_features)
    with torch.no_grad():
        y = layer(x)
        assert sorted(calls) == sorted(["slow", "slower", "fast"] * copies * DecodeLinear.MEASURES + ["fast"])
        timing = seen[:copies]  # one form's timing: the weight, then copies of it apart from it
        assert timing[0] is layer.weight and len({w.data_ptr() for w in timing}) == copies
        assert all(torch.equal(w, layer.weight) for w in timing)
        assert f"fast for 3 x {layer.in_features} -> {layer.out_features}" in capsys.readouterr().err
        torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight, layer.bias))
        calls.clear()
        layer(x)  # the same size: measured already
        assert calls == ["fast"]
        calls.clear()
        layer(x[:2])  # a size of its own
        assert len(calls) == 3 * copies * DecodeLinear.MEASURES + 1 and calls[-1] == "fast"
        calls.clear()
        layer(torch.randn(2, DecodeLinear.ROWS, layer.in_features))  # a prefill's rows: F.linear
    layer(x)  # a gradient: F.linear
    assert calls == []


def test_every_decode_linear_form_equals_f_linear(capsys, monkeypatch):
    """Each form of DecodeLinear.FORMS, fixed as DECODE_LINEAR fixes one, computes F.linear
    (to float32 rounding) with and without a bias, for one row and for several, and says it
    runs; a name that is no form is refused, naming them."""
    DecodeLinear = model_module.DecodeLinear
    torch.manual_seed(0)
    with_bias, without = torch.nn.Linear(48, 40), torch.nn.Linear(48, 24, bias=False)
    for module in (with_bias, without):
        module.__class__ = DecodeLinear
    monkeypatch.setattr(DecodeLinear, "path", None)
    with torch.no_grad():
        for name in DecodeLinear.FORMS:
            monkeypatch.setattr(DecodeLinear, "FORM", name)
            for layer in (with_bias, without):
                for x in (torch.randn(1, 1, 48), torch.randn(5, 1, 48), torch.randn(2, 3, 48)):
                    y = layer(x)
                    assert y.shape == (*x.shape[:-1], layer.out_features) and y.is_contiguous()
                    torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight, layer.bias),
                                               rtol=1e-5, atol=1e-6)
            assert f"{name} (DECODE_LINEAR)" in capsys.readouterr().err
        monkeypatch.setattr(DecodeLinear, "FORM", "mkl")
        with pytest.raises(ValueError, match="DECODE_LINEAR='mkl' names no form.*'oneDNN', 'F.linear', 'W x\\^T', 'inductor'"):
            without(torch.randn(1, 48))


def test_the_inductor_form_takes_one_row_of_a_large_weight_and_drops_out_where_it_cannot_compile(capsys, monkeypatch):
    """DecodeLinear's "inductor" form (a compiled multiply and sum): fixed by DECODE_LINEAR, one
    row of x through a weight of at least INDUCTOR_WEIGHT elements runs the compiled loop
    (F.linear's product to float32 rounding); more rows, or a smaller weight, it refuses and
    F.linear runs them, to the bit. Measured, it is never chosen for what it refuses. Where
    its compile fails it is refused from then on: the size's measuring drops it, says why
    once, runs the fastest of the others, and later sizes never time it again. Under a Python
    dispatch mode (an op counter) it is refused: a call through it runs F.linear's product, not
    the compiled loop nor its uncompiled (rows, out, in) product, and a size measured there
    never chooses it."""
    from torch.utils._python_dispatch import TorchDispatchMode
    DecodeLinear = model_module.DecodeLinear
    torch.manual_seed(0)
    layer, small = torch.nn.Linear(256, 512), torch.nn.Linear(48, 40)
    assert layer.weight.numel() >= model_module.INDUCTOR_WEIGHT > small.weight.numel()
    for m in (layer, small):
        m.__class__ = DecodeLinear
    for name, value in (("FORM", "inductor"), ("chosen", {}), ("path", None), ("_compiled_product", None),
                        ("COLD_BYTES", 2 * layer.weight.nbytes)):
        monkeypatch.setattr(DecodeLinear, name, value)
    x = torch.randn(1, 1, 256)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert DecodeLinear._compiled_product is not None  # the compiled loop ran
        for m, xs in ((layer, torch.randn(3, 1, 256)), (small, torch.randn(1, 1, 48))):
            assert torch.equal(m(xs), torch.nn.functional.linear(xs, m.weight, m.bias))
        assert DecodeLinear._compiled_product not in (None, False)  # refused, not failed
        monkeypatch.setattr(DecodeLinear, "FORM", None)
        layer(torch.randn(3, 1, 256)), small(torch.randn(1, 1, 48))
        assert DecodeLinear.chosen[(3, 512, 256, True)] != "inductor" and DecodeLinear.chosen[(1, 40, 48, True)] != "inductor"
    calls = []

    def failing(rows, weight):
        calls.append(rows.shape)
        raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")
    monkeypatch.setattr(DecodeLinear, "_compiled_product", failing)
    capsys.readouterr()
    with torch.no_grad():
        y = layer(x)  # measured: the failing compile drops the form
        torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert len(calls) == 1 and DecodeLinear.chosen[(1, 512, 256, True)] != "inductor"
        assert DecodeLinear._compiled_product is False
        assert "inductor's form refused from now on (torch.compile failed: RuntimeError: InvalidCxxCompiler" \
            in capsys.readouterr().err
        wide = torch.nn.Linear(512, 256)
        wide.__class__ = DecodeLinear
        wide(torch.randn(1, 1, 512))  # a new size: the form is refused before any compile
        assert len(calls) == 1 and DecodeLinear.chosen[(1, 256, 512, True)] != "inductor"

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))
    monkeypatch.setattr(DecodeLinear, "_compiled_product", None)
    monkeypatch.setattr(DecodeLinear, "FORM", "inductor")
    ops = []
    with torch.no_grad(), Ops():
        y = layer(x)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert "addmm" in ops and "sum" not in ops and DecodeLinear._compiled_product is None, ops
    monkeypatch.setattr(DecodeLinear, "FORM", None)
    monkeypatch.setattr(DecodeLinear, "chosen", {(1, 512, 256, True): "inductor"})  # measured before the mode
    ops = []
    with torch.no_grad(), Ops():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert "addmm" in ops and "sum" not in ops, ops
        wide(torch.randn(1, 1, 512))  # measured under the mode: never the form it cannot time
    assert DecodeLinear.chosen[(1, 256, 512, True)] != "inductor" and DecodeLinear._compiled_product is None


@pytest.mark.parametrize("name", [v for v in VARIANTS if v != "caa"])
def test_a_decoding_step_traces_whole(name):
    """torch.compile of a model traces a decoding step without a graph break: the rows read
    where they lie are found from sizes and strides (no storage or pointer query), and the
    compiled helpers say nothing from inside a trace (a print breaks the graph). caa is the
    exception by its definition: how many keys it keeps depends on ties with the k-th score,
    a size read from the data."""
    breaks = graph_breaks(name)
    assert not breaks, breaks


def graph_breaks(name, T=100):
    """The reasons dynamo breaks the graph of `name`'s one-token step after T - 1 cached tokens."""
    model = tiny(name, **VARIANTS[name])
    idx = torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model.new_cache()
        model(idx[:, :-1], cache=cache)
        try:
            explained = torch._dynamo.explain(model)(idx[:, -1:], cache=cache)
        finally:
            torch._dynamo.reset()
    return [str(r.reason).splitlines()[0] for r in explained.break_reasons]


def test_a_traced_step_takes_its_top_k_whole_where_eager_narrows_it(monkeypatch):
    """kernels._top_n narrows long rows to their candidates first in an eager step (the
    indexer's top-k at batch 8, T = 32768), a count read from the data (a nonzero); inside a
    trace it is one top-k, so the step still traces whole (with the break, the indexer's
    compiled step at that size was slower than its eager one)."""
    import kernels
    monkeypatch.setattr(kernels, "TOP_N_NARROWED_CALL", 1)  # rows of 8 x index_topk keys narrow, as 32768 at batch 8 do
    narrowed = []
    real = kernels._top_n_narrowed
    monkeypatch.setattr(kernels, "_top_n_narrowed", lambda *a: narrowed.append(a) or real(*a))
    breaks = graph_breaks("indexer", T=8 * SIZES["index_topk"] + 50)
    assert narrowed, "the eager prefill never narrowed: the thresholds above no longer reach these sizes"
    assert not breaks, breaks


@pytest.mark.parametrize("name", ["nsa", "moba"])
def test_a_prefill_through_the_top_n_of_floats_selects_the_references_blocks(name, monkeypatch):
    """With every selection call large enough for it, nsa's and moba's prefill takes its
    blocks from the CPU's top-n of floats (kernels._top_n_of_floats): the logits equal the
    reference's, and decoding after that prefill equals the reference's forward over the
    longer sequence, so the blocks it picked are attention.top_n's."""
    import kernels
    monkeypatch.setattr(kernels, "TOP_N_NARROWED_CALL", 1)
    taken, real = [], kernels._top_n_of_floats
    monkeypatch.setattr(kernels, "_top_n_of_floats", lambda s, n: taken.append(n) or real(s, n))
    idx = torch.randint(0, 64, (1, 170), generator=torch.Generator().manual_seed(5))
    reference, model = tiny(name), tiny(name)
    model_module.set_kernel(reference, "ref")
    with torch.no_grad():
        want = reference(idx)[0]
        cache = model.new_cache()
        got = [model(idx[:, :160], cache=cache)[0]]
        assert taken, "the prefill never took the top-n of floats: the thresholds above no longer reach it"
        got += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(160, 170)]
    got = torch.cat(got, 1)
    assert (got - want).abs().max() / want.abs().max() < 1e-5


def compiled_decoding(name, capacity, steps=96, prefill=100):
    """(the call_function targets of each graph the compiled step made, the largest difference
    of its logits from the eager step's, how it ran) over `steps` one-token steps after an
    eager prefill, through model.compile_decoding with a backend that records the graphs
    dynamo hands it (aot_eager: the guards inductor's tracing adds, without its compile time),
    the eager steps on a copy of the cache."""
    import copy

    from torch._dynamo.backends.debugging import aot_eager

    from torch._guards import CompileContext

    graphs = {}  # by dynamo's compile id (a restarted analysis hands the backend one graph twice)

    def recording(gm, example_inputs):
        graphs[str(CompileContext.current_compile_id())] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        return aot_eager(gm, example_inputs)

    model = tiny(name, **VARIANTS[name])
    idx = torch.randint(0, 64, (1, prefill + steps), generator=torch.Generator().manual_seed(1))
    worst = 0.0
    try:
        with torch.no_grad():
            eager_cache = model.new_cache(capacity)
            model(idx[:, :prefill], cache=eager_cache)
            compiled_cache = copy.deepcopy(eager_cache)
            step, how = model_module.compile_decoding(model, backend=recording)
            for t in range(prefill, prefill + steps):
                token = idx[:, t:t + 1].clone()  # its own storage, as a generated token's
                want, got = model(token, cache=eager_cache)[0], step(token, cache=compiled_cache)[0]
                worst = max(worst, (want - got).abs().max().item() / want.abs().max().item())
    finally:
        torch._dynamo.reset()
    return list(graphs.values()), worst, how


@pytest.mark.parametrize("name", [v for v in VARIANTS if v != "caa"])
def test_a_compiled_decoding_step_equals_eager_and_keeps_its_graphs(name):
    """model.compile_decoding over 96 steps (windows completing, blocks starting: 3 of
    combiner's blocks, 6 of moba's, 12 of nsa's) after a prompt of 100 (every summary count
    past 1, a size dynamo specialises) with a cache of fixed capacity: the logits equal the
    eager step's, and the step makes at most two graphs (a summary window completing in the
    step, or not), not one per cache length: the step's arithmetic on the length has no
    Python branch or min on it (kernels.padded_block_scores; with sliding_block_scores, nsa's
    step made 7 graphs in 60 steps at qwen-134m's sizes).
    In each graph of a variant that names cache rows (nsa's blocks, moba's, the indexer's
    keys), the dots of the query with those rows are kernels.gathered_dots, once a selecting
    layer (the eager step's compiled loop, opaque to inductor): traced, inductor fused the
    query's norm and RoPE into its loop over the rows and recomputed them per row (nsa's step
    at batch 8, T = 8192: 7.8 ms a layer in that loop)."""
    graphs, worst, how = compiled_decoding(name, capacity=400)
    assert how.startswith("compiled")
    assert worst < 1e-5
    assert 1 <= len(graphs) <= 2, len(graphs)
    if name in ("nsa", "moba", "indexer"):
        selecting = sum(type(layer.self_attn) is not attention.VARIANTS["full"] for layer in tiny(name).layers)
        assert selecting >= 1
        for targets in graphs:
            assert targets.count("sparse_attention.gathered_dots.default") == selecting, sorted(set(targets))


def test_caa_decodes_eager_under_compile_decoding():
    """caa's kept-key count is read from the data: compile_decoding leaves its step eager and says so."""
    graphs, worst, how = compiled_decoding("caa", capacity=400, steps=5)
    assert how.startswith("eager (caa") and graphs == [] and worst == 0.0


def test_a_cache_of_fixed_capacity_never_grows():
    """new_cache(capacity): the buffers allocated at the first write hold every later step in place."""
    model = tiny("nsa")
    idx = torch.randint(0, 64, (1, 150), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model.new_cache(150)
        model(idx[:, :20], cache=cache)
        buffers = [rows.data for rows in cache[0].rows()]
        for t in range(20, 150):
            model(idx[:, t:t + 1], cache=cache)
    after = [rows.data for rows in cache[0].rows()]
    assert len(after) == len(buffers) and all(a is b for a, b in zip(after, buffers))


@pytest.mark.parametrize("name", ["full", "nsa", "moba", "indexer"])
def test_a_cache_of_known_capacity_allocates_that_and_no_more(name):
    """new_cache(capacity) filled by a prompt of most of it (a long prompt, a few tokens to
    generate): its keys and values take capacity + 1 rows (a spare), its summaries the windows
    of capacity positions and a spare, each buffer allocated once, not twice the prompt, then
    the steps up to capacity fill them in place; one more position grows them (to twice what they
    hold). (A window's cache after a prompt: the test below.)"""
    model = tiny(name)
    capacity, prompt = 150, 140
    idx = torch.randint(0, 64, (1, capacity + 1), generator=torch.Generator().manual_seed(2))
    length, stride = model.layers[0].self_attn.summary_window() or (1, 1)
    with torch.no_grad():
        cache = model.new_cache(capacity)
        model(idx[:, :prompt], cache=cache)
        layer = cache[0]
        assert [rows.data.shape[-2] for rows in (layer.k, layer.v)] == [capacity + 1] * 2
        for rows in layer.summaries or ():
            assert rows.data.shape[-2] == capacity // stride + 2
        buffers = [rows.data for rows in layer.rows()]
        for t in range(prompt, capacity):
            model(idx[:, t:t + 1], cache=cache)
        assert all(a is b for a, b in zip((rows.data for rows in layer.rows()), buffers))
        model(idx[:, capacity:], cache=cache)
        assert layer.k.data is not buffers[0] and layer.k.data.shape[-2] == 2 * len(layer.k)  # twice what it holds


@pytest.mark.parametrize("capacity", [0, 150])
@pytest.mark.parametrize("name, flags", [("local", {}), ("dsa", dict(dsa_window="fixed")), ("combiner", {}),
                                         ("asga", dict(asga_gate="fixed"))])  # asga's cache lies along the keys
def test_a_window_keeps_its_last_keys_in_a_buffer_of_their_size_after_a_prompt(name, flags, capacity):
    """A prompt far longer than the window: after it, the keys and values the window keeps sit
    in a buffer of their size and the positions still to come (capacity - prompt; without a
    capacity, twice the rows kept), not in the prompt's rows; then the steps up to capacity
    write into it in place, and the logits equal the uncached forward's."""
    model = tiny(name, **flags)
    prompt = 140
    idx = torch.randint(0, 64, (1, 150), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, _ = model(idx)
        cache = model.new_cache(capacity)
        logits = [model(idx[:, :prompt], cache=cache)[0]]
        layer = cache[0]
        kept = len(layer)
        assert 0 < kept < prompt // 4
        want = kept + capacity - prompt + 1 if capacity else 2 * kept
        assert [rows.data.shape[-2] for rows in (layer.k, layer.v)] == [want] * 2
        buffers = [layer.k.data, layer.v.data]
        logits += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(prompt, 150)]
    assert capacity == 0 or all(a is b for a, b in zip((layer.k.data, layer.v.data), buffers))
    assert (torch.cat(logits, 1) - full).abs().max() < 1e-4 * full.abs().max()


def test_each_compiled_model_keeps_its_own_graphs(monkeypatch):
    """Three models compiled in one process, the limit at 2 graphs a step: each step counts
    its own graphs (a code object of its own), where through Model.forward's the third model
    found the first two's graphs counted against it and failed."""
    monkeypatch.setattr(model_module, "DECODING_RECOMPILE_LIMIT", 2)
    idx = torch.randint(0, 64, (1, 120), generator=torch.Generator().manual_seed(4))
    try:
        with torch.no_grad():
            for name in ("full", "local", "dsa"):
                model = tiny(name, **VARIANTS[name])
                cache = model.new_cache(120)
                model(idx[:, :100], cache=cache)
                step, _ = model_module.compile_decoding(model, backend="aot_eager")
                for t in range(100, 104):
                    step(idx[:, t:t + 1].clone(), cache=cache)
    finally:
        torch._dynamo.reset()


def test_a_compiled_helper_called_under_a_dispatch_mode_stays_compiled_after_it():
    """kernels.GatheredDots called inside a TorchDispatchMode (decode.py counts a step's ops in
    one) runs its uncompiled maths there, and its calls after the mode still run the compiled
    loop: without the guard, one call under a mode left every later call uncompiled (the
    profiler then shows the eager form's aten::index of every named row)."""
    from torch.profiler import profile
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    kernels, old = gathered_ops(True)
    try:
        g = torch.Generator().manual_seed(0)
        q, table = torch.randn(12, 16, generator=g), torch.randn(500, 16, generator=g)
        rows = torch.randint(0, 500, (12, 40), generator=g)
        want = (q[:, None, :] * table[rows]).sum(-1)
        torch.testing.assert_close(kernels.GatheredDots.run(q, table, rows), want)  # compiles
        with Passing():
            torch.testing.assert_close(kernels.GatheredDots.run(q[:6], table, rows[:6]), want[:6])
        with profile() as prof:
            torch.testing.assert_close(kernels.GatheredDots.run(q, table, rows), want)
        ran = {e.key for e in prof.key_averages()}
        assert "aten::index" not in ran, sorted(ran)
        assert any("Compiled" in name for name in ran), sorted(ran)
    finally:
        kernels.GatheredDots.COMPILE = old


@pytest.mark.parametrize("n_kv_head", [SIZES["n_head"], SIZES["n_head"] // 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", VARIANTS)
def test_every_prefill_hands_sdpa_keys_its_flash_kernel_takes(monkeypatch, name, n_kv_head):
    """A prefill through the cache, the second after cached tokens: every SDPA call of the
    fused path gets q, k, v with D contiguous. SDPA's flash kernel on a CPU needs it and,
    given a transposed view (a cache that keeps its keys along the positions, `full`'s),
    falls back silently to its math form, which keeps a (T, S) array per head: the same
    result at a test's sizes, 48 GiB at T = 32768 with 12 heads. Without GQA (qwen-134m's
    heads) and with it."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def checked(q, k, v, *args, **kwargs):
        calls.append(tuple(x.stride(-1) for x in (q, k, v)))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", checked)
    model = Model(ModelConfig(**dict(SIZES, n_kv_head=n_kv_head), attn=name, kernel="fused", **VARIANTS[name]))
    idx = torch.randint(0, 64, (1, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = model.new_cache()
        model(idx[:, :40], cache=cache)
        model(idx[:, 40:], cache=cache)
    assert all(strides == (1, 1, 1) for strides in calls), calls


@pytest.mark.parametrize("name", ["full", "nsa"])
def test_a_long_prefill_runs_the_mlp_in_pieces_with_the_same_logits(name, monkeypatch):
    """Without a gradient, a forward of more than Block.MLP_ROWS positions runs each block's
    norm and MLP that many rows at a time (its (T, mlp_hidden) activations never whole): the
    same logits as one piece, cached or not; with a gradient, one piece."""
    model = tiny(name)
    idx = torch.randint(0, 64, (1, 90), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = model(idx)[0]
    rows = []
    model.layers[0].mlp.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[1]))
    monkeypatch.setattr(model_module.Block, "MLP_ROWS", 32)
    with torch.no_grad():
        pieces = model(idx)[0]
        cached = model(idx, cache=model.new_cache())[0]
    assert rows == [32, 32, 26] * 2
    assert (pieces - whole).abs().max() <= 1e-5 * whole.abs().max()
    assert (cached - whole).abs().max() <= 1e-5 * whole.abs().max()
    rows.clear()
    model(idx)[0].sum().backward()
    assert rows == [90]
