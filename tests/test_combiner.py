"""`combiner`: Combiner-Fixed, causal (Ren et al. 2021). The reference against a
loop over positions that spells out the equations; causality, prefix invariance, exact
KV-cache decoding past several block boundaries, gradients, bf16; the core op
`combiner_attention` of kernels.BLOCKWISE (kernel='fused' on CPU) and kernels.FLEX against
the reference, and the blockwise path's memory shape (no (T, T) tensor)."""
import contextlib

import pytest
import torch

import attention
import kernels
from attention import CombinerAttention, combiner_summaries, to_blocks
from model import PRESETS, Model, ModelConfig
from test_kernels import LargestTensor, rows_against_truth, run  # run: module.attend with cfg.kernel switched

S = 4  # block size of the small cases
LENGTHS = (1, 7, S - 1, S, S + 1, 3 * S + 5)


pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors (conftest.py)


def loop_combiner(q, k, v, block, scale):
    """The equations of CombinerAttention's docstring, one query and one head at a time, in float64.
    q (B, H, T, D), k, v (B, Hkv, T, D), positions 0 .. T-1."""
    B, H, T, D = q.shape
    group = H // k.shape[1]
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            qh, kh, vh = q[b, h], k[b, h // group], v[b, h // group]
            for i in range(T):
                own = i // block
                logits, values = [], []
                for j in range(own * block, i + 1):  # direct: i's own block, up to i
                    logits.append(qh[i] @ kh[j] * scale)
                    values.append(vh[j])
                for r in range(own):  # one span per earlier, completed block
                    rows = range(r * block, (r + 1) * block)
                    k_max = torch.stack([kh[j] for j in rows]).max(0).values
                    q_max = torch.stack([qh[j] for j in rows]).max(0).values
                    inner = torch.softmax(torch.stack([q_max @ kh[j] * scale for j in rows]), 0)
                    logits.append(qh[i] @ k_max * scale)
                    values.append(sum(w * vh[j] for w, j in zip(inner, rows)))
                p = torch.softmax(torch.stack(logits), 0)
                out[b, h, i] = sum(w * val for w, val in zip(p, values))
    return out


def make_module(seed=0, window=S, **overrides):
    cfg = dict(PRESETS["tiny"], attn="combiner", window=window, n_head=4, n_kv_head=2, head_dim=8, d_model=32)
    cfg.update(overrides)
    torch.manual_seed(seed)
    return CombinerAttention(ModelConfig(**cfg))


def qkv(T, B=2, H=4, Hkv=2, D=8, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, T, D, generator=g).to(device).requires_grad_() for h in (H, Hkv, Hkv)]


def rel_error(a, b):
    """max|a - b| / max|b|; where b is exactly 0 (dq at T = 1: one key, softmax 1 whatever q),
    max|a| / 1e-2."""
    scale = b.abs().max()
    return ((a - b).abs().max() / (scale if scale > 0 else 1e-2)).item()


# ---------------------------------------------------------------------------- the reference

@pytest.mark.parametrize("T", LENGTHS)
def test_reference_equals_the_equations(T):
    module = make_module()
    q, k, v = qkv(T)
    out = module.attend(q, k, v, None, 0, 0)
    expected = loop_combiner(q.detach(), k.detach(), v.detach(), S, module.scale)
    assert rel_error(out.double(), expected) < 1e-6


def test_the_loop_check_can_fail():
    """A sliding window instead of the aligned block (or mean instead of max) is seen."""
    T = 3 * S + 5
    q, k, v = qkv(T)
    expected = loop_combiner(q.detach(), k.detach(), v.detach(), S, 0.3)
    n = (T - 1) // S
    qbar = to_blocks(q, 0, S, 0.0)[:, :, :n].mean(3)  # mean-pooled queries: not the paper's
    kbar, vbar = combiner_summaries(qbar, to_blocks(k, 0, S, 0.0)[:, :, :n], to_blocks(v, 0, S, 0.0)[:, :, :n], 0.3)
    wrong = attention.combiner_attention(q, k, v, kbar, vbar, 0.3, 0, 0, S)
    assert rel_error(wrong.double(), expected) > 1e-3


def test_a_block_start_sees_only_itself_directly():
    """Aligned blocks, not a sliding window: at i = s the only direct key is i itself, so
    changing k, v at i - 1 changes the output at i only through block 0's summary."""
    module = make_module()
    T = 2 * S
    q, k, v = (t.detach() for t in qkv(T))
    with torch.no_grad():
        kbar, vbar = module.summarise(q, k, v, None, 0)
        zero_spans = torch.zeros_like(vbar)  # remove block 0's summary value
        out = attention.combiner_attention(q, k, v, kbar, zero_spans, module.scale, 0, 0, S)
        v2 = v.clone()
        v2[:, :, S - 1] += 10.0  # the last key of block 0
        out2 = attention.combiner_attention(q, k, v2, kbar, zero_spans, module.scale, 0, 0, S)
    assert torch.equal(out[:, :, S:], out2[:, :, S:])
    assert (out[:, :, S - 1] - out2[:, :, S - 1]).abs().max() > 1  # the check can see change


def test_analyze_reads_its_mixing_weights():
    """analyze.py's attention_weights (attend with v = identity) gives, per query, weights over
    the keys that sum to 1, none on a future key, and reproduce the output."""
    import analyze

    module = make_module()
    T = 3 * S + 2
    q, k, v = (t.detach() for t in qkv(T))
    w = analyze.attention_weights(module, q, k, None, 0, 0)  # (B, H, T, T)
    assert torch.allclose(w.sum(-1), torch.ones(()), atol=1e-6)
    assert w.masked_select(~torch.ones(T, T, dtype=torch.bool).tril()).abs().max() == 0
    out = module.attend(q, k, v, None, 0, 0)
    assert rel_error(w @ v.repeat_interleave(2, dim=1), out) < 1e-5


# ---------------------------------------------------------------------------- in the model

def tiny_model(kernel="ref", window=S, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = dict(PRESETS["tiny"], vocab_size=256, attn="combiner", window=window, kernel=kernel,
               n_head=4, n_kv_head=2)
    cfg.update(overrides)
    return Model(ModelConfig(**cfg)).eval()


@pytest.mark.parametrize("kernel", ["ref", "fused"])
def test_causal_and_prefix_invariant(kernel):
    model = tiny_model(kernel)
    T = 5 * S + 3
    idx = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, _ = model(idx)
        for t in (0, S - 1, S, 2 * S + 1, T - 2):
            other = idx.clone()
            other[:, t + 1:] = (idx[:, t + 1:] + 1) % 256
            changed, _ = model(other)
            assert (changed[:, :t + 1] - logits[:, :t + 1]).abs().max() < 1e-6
            assert (changed[:, t + 1:] - logits[:, t + 1:]).abs().max() > 1e-4  # the check can see change
            prefix, _ = model(idx[:, :t + 1])
            assert (prefix - logits[:, :t + 1]).abs().max() < 1e-5


@pytest.mark.parametrize("kernel", ["ref", "fused"])
@pytest.mark.parametrize("chunks", [
    [1] * 30,  # token by token across 7 block boundaries
    [3, 5, 1, 4, 8, 2, 7],  # chunks that start and end inside, at and across boundaries
    [S, S, 1, S - 1, 2 * S + 3, 1, 1],
])
def test_cached_decoding_equals_full_forward(kernel, chunks):
    model = tiny_model(kernel)
    T = sum(chunks)
    idx = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full, _ = tiny_model("ref")(idx)
        cache = model.new_cache()
        steps, t = [], 0
        for n in chunks:
            steps.append(model(idx[:, t:t + n], cache=cache)[0])
            t += n
            # The cache holds the last token's block and one summary per completed block.
            assert len(cache[0]) <= S and len(cache[0].summaries[0]) == t // S
    decoded = torch.cat(steps, 1)
    assert (decoded - full).abs().max() < 1e-5 * full.abs().max()


def test_without_the_earlier_blocks_it_says_what_to_do():
    """Queries 10 .. 12 after keys from 8 (block 2 of 4, its first two queries not given):
    without the earlier blocks' summaries it says what to pass."""
    module = make_module()
    q, (_, k, v) = qkv(3)[0], qkv(5)
    with pytest.raises(ValueError, match="pass `summary`"):
        module.attend(q, k, v, None, 10, 8)


def test_gradients_reach_q_k_v_and_every_parameter():
    module = make_module()
    T = 3 * S + 5
    q, k, v = qkv(T)
    module.attend(q, k, v, None, 0, 0).pow(2).sum().backward()
    for name, t in dict(q=q, k=k, v=v).items():
        assert t.grad is not None and t.grad.abs().max() > 0, name
        assert (t.grad[:, :, :S].abs().amax((0, 1, 3)) > 0).all(), name  # block 0's keys reach later blocks
    model = tiny_model().train()
    idx = torch.randint(0, 256, (2, T + 1))
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, name


@pytest.mark.parametrize("kernel", ["ref", "fused"])
def test_bf16_autocast_forward_and_backward(kernel):
    idx = torch.randint(0, 256, (2, 3 * S + 6), generator=torch.Generator().manual_seed(5))
    losses = {}
    for bf16 in (False, True):
        model = tiny_model(kernel).train()
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        losses[bf16] = loss.item()
    assert abs(losses[True] - losses[False]) < 2e-2 * losses[False], losses


# ---------------------------------------------------------------------------- fused paths

def compare(kernel, T, H=4, Hkv=2, B=2, D=8, block=S, seed=1, backward=True, device="cpu"):
    """[(what, error, bound)] of module.attend with `kernel` against kernel='ref' on the same
    q, k, v, both against the reference in float64 (test_kernels.parity_bound): the output,
    and (backward=True) the gradients of q, k, v (through the summaries and the core op
    together)."""
    module = make_module(window=block, n_head=H, n_kv_head=Hkv)  # no parameters: stays on CPU
    q, k, v = qkv(T, B=B, H=H, Hkv=Hkv, D=D, seed=seed, device=device)
    cotangent = torch.randn(B, H, T, q.shape[-1], generator=torch.Generator().manual_seed(seed + 1)).to(device)
    results = []
    for which, dtype in (("ref", torch.float32), (kernel, torch.float32), ("ref", torch.float64)):
        inputs = [t.detach().to(dtype).requires_grad_(backward) for t in (q, k, v)]
        with torch.set_grad_enabled(backward):
            out = run(module, which, *inputs, None, 0, 0)
        grads = torch.autograd.grad(out, inputs, cotangent.to(dtype)) if backward else None
        results.append((out.detach(), grads))
    ref, fused, truth = results
    return rows_against_truth(dict(q=q, k=k, v=v), fused, ref, truth, (B, H, T, T), D, cotangent)


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("H,Hkv", [(4, 2), (2, 2)])
def test_fused_equals_reference(T, H, Hkv):
    """T <= S: one block, no summaries (kernels.combiner_blocks' causal SDPA); T > S: the
    summaries and the block mask."""
    for what, error, bound in compare("fused", T, H=H, Hkv=Hkv):
        assert error <= bound, f"{what}: {error:.2e} > {bound:.2e} at T={T} H={H} Hkv={Hkv}"


CACHE_CASES = [  # (first query position, first key position, T): keys from the first query's block on
    (13, 12, 1), (13, 12, 7), (12, 12, 1), (14, 8, 3), (16, 12, 5)]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kernel", ["fused", "flex"])
def test_core_op_after_cached_keys_equals_reference(kernel):
    """The core op alone, queries after cached keys (as when decoding), with given summaries
    of the earlier blocks: output (and for the blockwise path the gradients of q, k, v, kbar,
    vbar) equal the reference's."""
    op = attention.ops(kernel, "cpu").combiner_attention
    g = torch.Generator().manual_seed(7)
    for p0, k0, T in CACHE_CASES:
        n, R = p0 + T - k0, (p0 + T - 1) // S
        inputs = [torch.randn(2, h, m, 8, generator=g) for h, m in ((4, T), (2, n), (2, n), (2, R), (4, R))]
        cot = torch.randn(2, 4, T, 8, generator=g)
        backward = kernel != "flex"  # no CPU backward for q, k, v (see the CUDA test)
        results = []
        for fn, dtype in ((attention.combiner_attention, torch.float32), (op, torch.float32),
                          (attention.combiner_attention, torch.float64)):
            xs = [t.to(dtype).requires_grad_(backward) for t in inputs]
            with torch.set_grad_enabled(backward):
                out = fn(*xs, 0.3, p0, k0, S)
            results.append((out.detach(), torch.autograd.grad(out, xs, cot.to(dtype)) if backward else None))
        ref, fused, truth = results
        named = dict(zip("q k v kbar vbar".split(), inputs))
        for what, error, bound in rows_against_truth(named, fused, ref, truth, (2, 4, T, n + R), 8, cot):
            assert error <= bound, (what, error, bound, p0, k0, T)


def test_model_runs_the_fused_path(monkeypatch):
    """kernel='fused' on CPU sends combiner to the blockwise op, never to the reference; its
    output (with GQA) equals the reference's."""
    module = make_module()
    q, k, v = qkv(2 * S + 1)
    ref = run(module, "ref", q, k, v, None, 0, 0)
    fail = lambda *a: pytest.fail("fell back to the reference")  # noqa: E731
    monkeypatch.setattr(attention, "REFERENCE", attention.REFERENCE._replace(combiner_attention=fail))
    assert rel_error(run(module, "fused", q, k, v, None, 0, 0), ref) < 1e-5  # a smoke check: parity is above


def test_a_wrong_fused_kernel_fails_the_check(monkeypatch):
    """A block one token longer in the blockwise op is seen."""
    real = kernels.blockwise_combiner_attention
    wrong = lambda *a: real(*a[:-1], a[-1] + 1)  # noqa: E731
    monkeypatch.setattr(kernels, "BLOCKWISE", kernels.BLOCKWISE._replace(combiner_attention=wrong))
    assert max(e / b for _, e, b in compare("fused", 3 * S + 5)) > 1


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("T", (7, 3 * S + 5, 300))
def test_flex_forward_equals_reference(T):
    """FlexAttention's forward on CPU (its q/k/v backward does not run on CPU: see the CUDA test)."""
    [(what, error, bound)] = compare("flex", T, block=16 if T == 300 else S, backward=False)
    assert error <= bound, f"{what}: {error:.2e} > {bound:.2e} at T={T}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs CUDA (not implemented on CPU)")
@pytest.mark.parametrize("T", (7, 3 * S + 5, 300))
def test_flex_gradients_equal_reference_cuda(T):
    """The compiled FlexAttention kernel (kernels._run_flex compiles on CUDA), forward and backward."""
    rows = compare("flex", T, block=16 if T == 300 else S, D=16, device="cuda")  # Triton tiles: D >= 16
    for what, error, bound in rows:
        assert error <= bound, f"{what}: {error:.2e} > {bound:.2e} at T={T}"


# ---------------------------------------------------------------------------- memory shape

def test_fused_path_makes_no_T_by_T_tensor():
    """Structural, not a timing: at T = 2048, s = 64 (one head), forward and backward of the
    fused path (summaries and blockwise op) produce no tensor of T * T elements; the biggest
    is O(T (s + T/s)). The reference does (the check can fail)."""
    T, block, D = 2048, 64, 16
    q, k, v = qkv(T, B=1, H=1, Hkv=1, D=D)
    module = make_module(window=block, n_head=1, n_kv_head=1, head_dim=D)
    for fused, bound_ok in ((True, True), (False, False)):
        with LargestTensor() as seen:
            out = run(module, "fused" if fused else "ref", q, k, v, None, 0, 0)
            out.sum().backward()
        assert (seen.largest < T * T) == bound_ok, (fused, seen.largest)
        if fused:
            assert seen.largest <= T * (block + T // block) + T * D, seen.largest
