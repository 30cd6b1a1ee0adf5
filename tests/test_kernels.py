"""kernels.py computes what attention.py computes: outputs and gradients of every variant
and flag through the blockwise CPU path (kernel='fused' on CPU) and the FlexAttention path
(kernel='flex') against the reference, KV-cache decoding, training to the same losses, bf16
autocast, no graph breaks, and the recorded gate statistics' memory bound.

Relative error of a tensor a against the reference b: max|a - b| / max|b|, below 1e-5 for
outputs and 1e-4 for gradients (float32). Where the reference gradient is identically zero
(the output does not depend on that input: q at T = 1), the fused one must be below 1e-6 in
absolute value instead, since a relative error is undefined there (SDPA's backward leaves
~1e-7 of rounding in dq at T = 1). Left out, as ill-conditioned rather than wrong: caa with
top-k 'all' when every key is inside the local window, where the two branches differ only
through the far soft boundary and the mix gate's gradient is the rounding noise of their
difference. FlexAttention has no CPU backward for q, k, v: on CPU its forward and the
gradients of the gate tensors its score_mod captures are checked; q, k, v gradients through
it run on CUDA only.
"""
import dataclasses
import warnings

import pytest
import torch

import attention
import kernels
from attention import VARIANTS
from model import PRESETS, Model, ModelConfig

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
OUT_TOL, GRAD_TOL, ZERO_TOL = 1e-5, 1e-4, 1e-6
LENGTHS = (1, 7, 255, 256, 257, 1000)
# Windows shorter than every T but 1 (and than the band's block of 16), shorter than T from
# 255 on (and not a multiple of the block), longer than every T. caa's boundary is kept
# sharp enough (tau) that its width gradient is not a sum that cancels to rounding noise.
WINDOWS = {
    "w5": dict(window=5, caa_window_max=9, caa_tau=2.0),
    "w100": dict(window=100, caa_window_max=150, caa_tau=8.0),
    "w2000": dict(window=2000, caa_window_max=3000, caa_tau=8.0),
}
SMALL = dict(n_head=2, n_kv_head=2, head_dim=16, d_model=32, dsa_threshold=100, asga_hidden=4, caa_hidden=8)

CONFIGS = [
    ("full", {}),
    ("local", {}),
    *[("dsa", dict(dsa_gate=g, dsa_window=w)) for g in (True, False) for w in ("adaptive", "fixed", "none")],
    *[("asga", dict(asga_gate=g, asga_scale=s)) for g in ("learned", "fixed", "off") for s in (True, False)],
    ("asga", dict(asga_gate="learned", asga_scale=True, asga_gate_space="prob")),
    *[("caa", dict(caa_gate=g, caa_topk=k)) for g in ("learned", "local", "global") for k in ("sqrt", "all")],
    ("caa", dict(caa_gate="learned", caa_topk="sqrt", caa_gate_norm=True)),
    ("combiner", {}),  # its block is `window`
]
IDS = [f"{a}-" + "-".join(f"{v}" for v in o.values()) for a, o in CONFIGS]


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are small: on the shared 2-core machines, OpenMP's barrier waits made
    every op ~10x slower with 2 threads than with 1 (measured). Restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def uses_window(attn, flags):
    return (attn in ("local", "caa", "combiner") or (attn == "dsa" and flags["dsa_window"] != "none")
            or (attn == "asga" and flags["asga_gate"] == "fixed"))


def make_module(attn, seed=0, **overrides):
    cfg = ModelConfig(**dict(PRESETS["tiny"], attn=attn, **dict(SMALL, **overrides)))
    torch.manual_seed(seed)
    module = VARIANTS[attn](cfg)
    for p in module.parameters():  # random everywhere, gates included (their init is often 0)
        p.data.normal_(0, 0.3)
    return module


def inputs(module, T, B, p0, k0, seed, grad=True):
    cfg = module.cfg
    S = p0 + T - k0
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, cfg.n_head, T, cfg.head_dim, generator=g).requires_grad_(grad)
    k = torch.randn(B, cfg.n_kv_head, S, cfg.head_dim, generator=g).requires_grad_(grad)
    v = torch.randn(B, cfg.n_kv_head, S, cfg.head_dim, generator=g).requires_grad_(grad)
    x = torch.randn(B, T, cfg.d_model, generator=g).requires_grad_(grad)
    cotangent = torch.randn(B, cfg.n_head, T, cfg.head_dim, generator=g)
    return q, k, v, x, cotangent


def run(module, kernel, *args):
    """module.attend(*args) with cfg.kernel = kernel."""
    cfg = module.cfg
    module.cfg = dataclasses.replace(cfg, kernel=kernel)
    try:
        return module.attend(*args)
    finally:
        module.cfg = cfg


def compare(module, T, B=2, p0=0, k0=0, seed=1, kernel="fused", grads=True):
    """Reference vs `kernel` on random inputs: [(what, error, bound)] for the output and the
    gradients of q, k, v, x and every parameter (flex: of the gate parameters its score_mod
    captures, and of the parameters outside the attention core, with q, k, v constant)."""
    flex = kernel == "flex"
    q, k, v, x, cotangent = inputs(module, T, B, p0, k0, seed, grad=not flex)
    x.requires_grad_(True)
    named = dict(x=x, **dict(module.named_parameters())) if flex else dict(q=q, k=k, v=v, x=x, **dict(module.named_parameters()))
    results = []
    for which in ("ref", kernel):
        with torch.set_grad_enabled(grads):
            out = run(module, which, q, k, v, x, p0, k0)
        differentiate = grads and out.requires_grad  # flex `full`: nothing to differentiate
        g = torch.autograd.grad(out, list(named.values()), cotangent, allow_unused=True) if differentiate else None
        results.append((out.detach(), g))
    (ref, ref_grads), (fused, fused_grads) = results
    rows = [("output", rel_error(fused, ref), OUT_TOL)]
    if ref_grads is None:
        return rows
    for name, a, b in zip(named, fused_grads, ref_grads):
        a = torch.zeros_like(named[name]) if a is None else a  # not used: a zero gradient
        b = torch.zeros_like(named[name]) if b is None else b
        if b.abs().max() == 0:
            rows.append((f"grad {name} (reference exactly 0)", a.abs().max().item(), ZERO_TOL))
        else:
            rows.append((f"grad {name}", rel_error(a, b), GRAD_TOL))
    return rows


def ill_conditioned(cfg, T, p0=0, k0=0):
    """caa with top-k 'all' where every key is inside the local window: the two branches
    differ only by the far soft boundary, so the mix gate's gradient is their difference,
    rounding noise (see the module docstring)."""
    return cfg.attn == "caa" and cfg.caa_topk == "all" and cfg.window >= p0 + T - 1 - k0


def rel_error(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def check(module, T, **kw):
    for what, error, bound in compare(module, T, **kw):
        assert error < bound, f"{what}: error {error:.2e} >= {bound:g} at T={T} {kw} window={module.cfg.window}"


def test_fused_on_cpu_is_the_blockwise_path():
    assert attention.ops("fused", "cpu") is kernels.BLOCKWISE
    assert attention.ops("fused", "cuda") is kernels.FLEX and attention.ops("flex", "cpu") is kernels.FLEX
    assert attention.ops("ref", "cuda") is attention.REFERENCE
    cfg = ModelConfig(kernel="fused")
    assert "blockwise" in attention.attention_path(cfg, "cpu") and "Flex" in attention.attention_path(cfg, "cuda")


@pytest.mark.parametrize("attn,flags", CONFIGS, ids=IDS)
def test_fused_equals_reference(attn, flags):
    """Every length, every window (where the variant has one), batch of 2 (1 at T=1000)."""
    for wname, window in WINDOWS.items():
        if not uses_window(attn, flags) and wname != "w100":
            continue
        module = make_module(attn, **flags, **window)
        for T in LENGTHS:
            if not ill_conditioned(module.cfg, T):
                check(module, T, B=1 if T == 1000 else 2)


NEEDS_SUMMARIES = ("combiner's earlier blocks' summaries live in a KVCache: tests/test_combiner.py checks "
                   "its core op after cached keys and its cached decoding")
CACHE_CASES = [  # (first query position, first key position, T): S = p0 + T - k0 > T
    (300, 0, 1), (300, 0, 7), (300, 150, 7), (95, 0, 7), (300, 260, 1), (200, 100, 100),
]


@pytest.mark.parametrize("attn,flags", CONFIGS, ids=IDS)
def test_fused_equals_reference_with_cache(attn, flags):
    """Queries after cached keys (k_start may be > 0, as after trimming a window's cache);
    dsa's threshold (100) falls inside the (95, 0, 7) case."""
    if attn == "combiner":
        pytest.skip(NEEDS_SUMMARIES)
    module = make_module(attn, **flags, **WINDOWS["w100"])
    for p0, k0, T in CACHE_CASES:
        if not ill_conditioned(module.cfg, T, p0, k0):
            check(module, T, p0=p0, k0=k0)


@pytest.mark.parametrize("attn", list(VARIANTS))
def test_fused_equals_reference_gqa(attn):
    module = make_module(attn, n_head=4, n_kv_head=2, **WINDOWS["w5"])
    for T in (7, 257):
        check(module, T)
    if attn not in ("combiner", "nsa", "moba"):  # NEEDS_SUMMARIES; nsa, moba keep every key (k_start = 0)
        check(module, 7, p0=300, k0=150)


@pytest.mark.parametrize("attn,flags", CONFIGS, ids=IDS)
def test_flex_equals_reference(attn, flags):
    """FlexAttention (uncompiled on CPU): forward at every length, with GQA and with a KV
    cache, and the gradients of x and the variant's parameters (q, k, v held constant).
    Two query heads sharing one key/value head: GQA."""
    module = make_module(attn, n_head=2, n_kv_head=1, **flags, **WINDOWS["w100"])
    for T in LENGTHS:  # gradients up to T = 257 (at 1000, uncompiled flex is slow, not different)
        if not ill_conditioned(module.cfg, T):
            check(module, T, B=1, kernel="flex", grads=T < 1000)
    for p0, k0, T in [(300, 150, 7), (95, 0, 7), (300, 0, 1)] if attn != "combiner" else []:  # NEEDS_SUMMARIES
        if not ill_conditioned(module.cfg, T, p0, k0):
            check(module, T, B=1, p0=p0, k0=k0, kernel="flex")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward for q, k, v "
                    "needs CUDA (on CPU torch raises NotImplementedError)")
@pytest.mark.parametrize("attn,flags", CONFIGS, ids=IDS)
def test_flex_gradients_on_cuda(attn, flags):
    """q, k, v, x and parameter gradients through compiled FlexAttention equal the reference."""
    module = make_module(attn, n_head=4, n_kv_head=2, **flags, **WINDOWS["w100"]).cuda()
    for T in (7, 257, 1000):
        if ill_conditioned(module.cfg, T):
            continue
        q, k, v, x, cot = (t.cuda().detach().requires_grad_(t.requires_grad) for t in inputs(module, T, 1, 0, 0, 1))
        named = dict(q=q, k=k, v=v, x=x, **dict(module.named_parameters()))
        res = []
        for kernel in ("ref", "flex"):
            out = run(module, kernel, q, k, v, x, 0, 0)
            res.append((out, torch.autograd.grad(out, list(named.values()), cot, allow_unused=True)))
        assert rel_error(res[1][0], res[0][0]) < OUT_TOL
        for name, a, b in zip(named, res[1][1], res[0][1]):
            if b is not None and b.abs().max() > 0:
                assert rel_error(a, b) < GRAD_TOL, name


def test_a_wrong_kernel_fails_the_check(monkeypatch):
    """The check can see a small error: a window one key too narrow fails it."""
    module = make_module("local", **WINDOWS["w100"])
    real = kernels.blockwise_attention
    wrong = lambda q, k, v, scale, qs, ks, window=None, *a, **kw: real(q, k, v, scale, qs, ks, window - 1, *a, **kw)  # noqa: E731
    monkeypatch.setattr(kernels, "BLOCKWISE", kernels.BLOCKWISE._replace(attention=wrong))
    with pytest.raises(AssertionError):
        check(module, 257)


def tiny_model(attn, kernel, **flags):
    torch.manual_seed(0)
    cfg = dict(PRESETS["tiny"], vocab_size=512, attn=attn, kernel=kernel, window=40,
               dsa_threshold=100, caa_window_max=60, **flags)
    return Model(ModelConfig(**cfg))


def perturb_gates(model, seed=4):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # move the gates off their neutral init
        if "self_attn" in name and "proj" not in name and "norm" not in name:
            p.data.add_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("attn", list(VARIANTS))
def test_trains_to_the_same_losses(attn):
    """Three AdamW steps at T = 300 (past the window and dsa's threshold): same losses."""
    idx = torch.randint(0, 512, (2, 301), generator=torch.Generator().manual_seed(2))
    losses = {}
    for kernel in ("ref", "fused"):
        model = tiny_model(attn, kernel)
        perturb_gates(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        losses[kernel] = []
        for _ in range(3):
            _, loss = model(idx[:, :-1], idx[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[kernel].append(loss.item())
    assert losses["ref"][-1] < losses["ref"][0]  # it does train
    for a, b in zip(losses["fused"], losses["ref"]):
        assert abs(a - b) < 1e-5 * abs(b), (losses["fused"], losses["ref"])


@pytest.mark.parametrize("attn", list(VARIANTS))
def test_fused_decoding_with_cache_equals_full_forward(attn):
    """Prefill 50 tokens, decode one at a time to 110, then in chunks of 10 to 130, all
    through the fused path: the logits equal the reference's full forward (windows trimmed
    to 40, dsa switching at 100)."""
    idx = torch.randint(0, 512, (1, 130), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full, _ = tiny_model(attn, "ref")(idx)
        model = tiny_model(attn, "fused")
        cache = model.new_cache()
        steps = [model(idx[:, :50], cache=cache)[0]]
        steps += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(50, 110)]
        steps += [model(idx[:, t:t + 10], cache=cache)[0] for t in range(110, 130, 10)]
    decoded = torch.cat(steps, 1)
    assert (decoded - full).abs().max() < 1e-4 * full.abs().max()


@pytest.mark.parametrize("attn,flags", CONFIGS, ids=IDS)
def test_bf16_autocast(attn, flags):
    """Under CPU bf16 autocast, kernel ref and fused run forward + backward and the loss stays
    within 2e-2 (relative) of float32's; flex runs its forward."""
    idx = torch.randint(0, 512, (2, 161), generator=torch.Generator().manual_seed(5))
    for kernel in ("ref", "fused", "flex"):
        model = tiny_model(attn, kernel, **flags)
        perturb_gates(model)
        with torch.no_grad():
            _, loss32 = model(idx[:, :-1], idx[:, 1:])
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(kernel != "flex"):
            _, loss16 = model(idx[:, :-1], idx[:, 1:])
        if kernel != "flex":
            loss16.backward()
            assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        assert abs(loss16.item() - loss32.item()) < 2e-2 * loss32.item(), (kernel, loss16.item(), loss32.item())


GRAPH_CONFIGS = [("full", {}), ("local", {}), ("dsa", dict(dsa_window="adaptive")),
                 ("asga", dict(asga_gate="learned")), ("asga", dict(asga_gate_space="prob")),
                 ("asga", dict(asga_gate="fixed")), ("caa", dict(caa_topk="sqrt")), ("combiner", {})]


@pytest.mark.parametrize("attn,flags", GRAPH_CONFIGS, ids=[f"{a}-{o}" for a, o in GRAPH_CONFIGS])
def test_flex_forward_has_no_graph_breaks(attn, flags):
    """torch._dynamo.explain: the model's forward with kernel=flex traces as one graph
    (positions are Python ints; nothing is read back from a tensor). Every variant, and the
    flags that take another code path (tracing costs ~5-10 s each on CPU)."""
    model = tiny_model(attn, "flex", n_layer=1, **flags).eval()  # one layer: half the tracing
    idx = torch.randint(0, 512, (1, 150))
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(idx)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the element count of the largest tensor any op creates."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):  # nested outputs too
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_recorded_gate_statistics_stay_within_the_fused_memory():
    """asga at T = 2048 with record=True (gate statistics at evaluation): no tensor with
    T * T * r elements or more is created, and none larger than the fused forward's own
    largest or the stated bound (ASGAttention.record_pair_gate)."""
    T, r = 2048, 4
    module = make_module("asga", asga_hidden=r)
    q, k, v, x, _ = inputs(module, T, 1, 0, 0, 1, grad=False)
    with torch.no_grad():
        with LargestTensor() as plain:
            run(module, "fused", q, k, v, x, 0, 0)
        module.record = True
        with LargestTensor() as recorded:
            run(module, "fused", q, k, v, x, 0, 0)
        module.record = False
    H = module.cfg.n_head
    bound = max(module.RECORD_ELEMENTS, H * T * r)
    assert recorded.largest < T * T * r
    assert recorded.largest <= max(plain.largest, bound), (recorded.largest, plain.largest, bound)
    gate = module.gates["pair_gate"]  # (1, T, H), the mean over visible keys, as the reference has it
    s = torch.sigmoid(attention.pair_gate_logit(*module.pair_terms(q[:, :, -3:], k), module.w2, module.b2))
    expected = torch.stack([s[0, :, i, :T - 3 + i + 1].mean(-1) for i in range(3)])  # (3, H)
    assert torch.allclose(gate[0, -3:], expected, atol=1e-5)
