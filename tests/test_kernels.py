"""kernels.py computes what attention.py computes: outputs and gradients of every variant
and flag through the blockwise CPU path (kernel='fused' on CPU) and the FlexAttention path
(kernel='flex') against the reference, KV-cache decoding, training to the same losses, bf16
autocast, no graph breaks, and the recorded gate statistics' memory bound.

Tolerances come from the problem, not from one CPU's rounding (`parity_bound`): every
comparison also runs the reference in float64, the truth; the path under test may be at most
RATIO = 16 times as far from it as the float32 reference is, plus a floor of float32's
rounding in a sum of n terms, 2^-24 sqrt(n) max|truth|, n the length of the sum (an
output or a per-position gradient: one row of D-term dot products per head; a parameter's
gradient: all B H T S scores). So a tensor that float32 itself computes poorly (caa's
mix-gate gradient when both branches nearly agree, a width bias summed over every score)
gets a bound as wide as float32's own error, and one it computes well a tight one; the
same test passes whatever the CPU's vector width (`.ci/run` runs the parity tests under
ATEN_CPU_CAPABILITY=default and =avx2 as well). FlexAttention has no CPU backward for q, k,
v: on CPU its forward and the gradients of the gate tensors its score_mod captures are
checked; q, k, v gradients through it run on CUDA only.
"""
import copy
import dataclasses
import math
import unittest.mock
import warnings

import pytest
import torch

import attention
import kernels
from attention import VARIANTS
from model import PRESETS, Model, ModelConfig

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
RATIO = 16  # how much farther from the float64 truth than the float32 reference a fast path may be
EPS32 = 2.0 ** -24  # float32's unit roundoff
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


pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors (conftest.py)


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
    """module.attend(*args) with cfg.kernel = kernel (and, while recording, what forward notes
    after it: `observe`)."""
    cfg = module.cfg
    module.cfg = dataclasses.replace(cfg, kernel=kernel)
    try:
        out = module.attend(*args)
        if module.notes is not None:
            module.notes = {}
            module.observe(*args, None)
        return out
    finally:
        module.cfg = cfg


def parity_bound(ref, truth, n, floor_scale=0.0):
    """The largest error max|a - truth| allowed of a path that computes what the float32
    reference `ref` computes, `truth` being the float64 reference: RATIO times ref's own
    error, plus the rounding float32 makes in a sum of n terms of size max|truth|,
    2^-24 sqrt(n) max|truth|. A gradient can be near 0 by cancellation while its terms are
    not (q at T = 1, a scale's gradient at T = 1: one key, softmax 1 whatever the logit),
    so the floor's size is at least `floor_scale` (the output's times the cotangent's)."""
    scale = max(truth.abs().max().item(), floor_scale)
    return RATIO * (ref - truth).abs().max().item() + EPS32 * math.sqrt(n) * scale


PER_POSITION = ("q", "k", "v", "x", "kbar", "vbar")  # tensors with one row per position (or block)


def rows_against_truth(named, fast, ref, truth, scores, D, cotangent):
    """[(what, max|fast - truth| / scale, bound / scale)]: the output, then each gradient
    (named: their names; a missing gradient is zero), relative to scale = max|truth| (1
    where truth is identically 0). scores = (B, H, T, S). The sums: an output element's
    runs over its S keys' D-term dot products (n = S D); a per-position gradient's over a
    row or column of scores in every head (n = H max(T, S) D); a parameter's over every
    score (n = B H T S D)."""
    B, H, T, S = scores
    (out, grads), (ref_out, ref_grads), (true_out, true_grads) = fast, ref, truth
    pairs = [("output", out, ref_out, true_out, 0.0, S * D)]
    if true_grads is not None:
        zero = lambda g, like: torch.zeros_like(like) if g is None else g  # noqa: E731
        floor = true_out.abs().max().item() * cotangent.abs().max().item()
        pairs += [(f"grad {name}", zero(a, t), zero(b, t), zero(c, t), floor,
                   H * max(T, S) * D if name in PER_POSITION else B * H * T * S * D)
                  for name, t, a, b, c in zip(named, named.values(), grads, ref_grads, true_grads)]
    rows = []
    for what, a, b, c, floor, n in pairs:
        a, b, c = a.double(), b.double(), c.double()
        scale = c.abs().max().item() or 1.0
        rows.append((what, (a - c).abs().max().item() / scale, parity_bound(b, c, n, floor) / scale))
    return rows


def compare(module, T, B=2, p0=0, k0=0, seed=1, kernel="fused", grads=True, device="cpu"):
    """Reference vs `kernel` on random inputs, both against the reference in float64
    (`parity_bound`): [(what, error, bound)] for the output and the gradients of q, k, v, x
    and every parameter (flex: of the gate parameters its score_mod captures, and of the
    parameters outside the attention core, with q, k, v constant; on CUDA of q, k, v too)."""
    qkv_grads = not (kernel == "flex" and device == "cpu")
    q, k, v, x, cotangent = inputs(module, T, B, p0, k0, seed, grad=qkv_grads)
    x.requires_grad_(True)
    exact = copy.deepcopy(module).double()
    results = []
    for which, mod, cast in (("ref", module, torch.float32), (kernel, module, torch.float32),
                             ("ref", exact, torch.float64)):
        q_, k_, v_, x_ = (t.detach().to(device, cast).requires_grad_(t.requires_grad) for t in (q, k, v, x))
        named = dict(x=x_, **dict(mod.named_parameters()))
        if qkv_grads:
            named = dict(q=q_, k=k_, v=v_, **named)
        with torch.set_grad_enabled(grads):
            out = run(mod, which, q_, k_, v_, x_, p0, k0)
        differentiate = grads and out.requires_grad  # flex `full`: nothing to differentiate
        g = (torch.autograd.grad(out, list(named.values()), cotangent.to(device, cast), allow_unused=True)
             if differentiate else None)
        results.append((out.detach(), g))
    if any(r[1] is None for r in results):
        results = [(out, None) for out, _ in results]
    ref, fused, truth = results
    return rows_against_truth(named, fused, ref, truth, (B, module.cfg.n_head, T, k.shape[2]), q.shape[-1], cotangent)


def check(module, T, **kw):
    for what, error, bound in compare(module, T, **kw):
        assert error <= bound, f"{what}: error {error:.2e} > bound {bound:.2e} at T={T} {kw} window={module.cfg.window}"


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
        check(module, T, p0=p0, k0=k0)


@pytest.mark.parametrize("attn", list(VARIANTS))
def test_fused_equals_reference_gqa(attn):
    module = make_module(attn, n_head=4, n_kv_head=2, **WINDOWS["w5"])
    for T in (7, 257):
        check(module, T)
    # NEEDS_SUMMARIES; nsa, moba keep every key (k_start = 0); indexer needs its cached indexer keys
    # (tests/test_indexer.py checks it after cached keys)
    if attn not in ("combiner", "nsa", "moba", "indexer"):
        check(module, 7, p0=300, k0=150)


@pytest.mark.parametrize("attn,flags", CONFIGS, ids=IDS)
def test_flex_equals_reference(attn, flags):
    """FlexAttention (uncompiled on CPU): forward at every length, with GQA and with a KV
    cache, and the gradients of x and the variant's parameters (q, k, v held constant).
    Two query heads sharing one key/value head: GQA."""
    module = make_module(attn, n_head=2, n_kv_head=1, **flags, **WINDOWS["w100"])
    for T in LENGTHS:  # gradients up to T = 257 (at 1000, uncompiled flex is slow, not different)
        check(module, T, B=1, kernel="flex", grads=T < 1000)
    for p0, k0, T in [(300, 150, 7), (95, 0, 7), (300, 0, 1)] if attn != "combiner" else []:  # NEEDS_SUMMARIES
        check(module, T, B=1, p0=p0, k0=k0, kernel="flex")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward for q, k, v "
                    "needs CUDA (on CPU torch raises NotImplementedError)")
@pytest.mark.parametrize("attn,flags", CONFIGS, ids=IDS)
def test_flex_gradients_on_cuda(attn, flags):
    """q, k, v, x and parameter gradients through compiled FlexAttention equal the reference."""
    module = make_module(attn, n_head=4, n_kv_head=2, **flags, **WINDOWS["w100"]).cuda()
    for T in (7, 257, 1000):
        check(module, T, B=1, kernel="flex", device="cuda")


def test_flex_log_sigmoid_equals_logsigmoid():
    """kernels.log_sigmoid, which score_mods and biases use for log sigmoid (asga's prob gate,
    caa's soft window edge), equals F.logsigmoid in both its forms: on a plain CPU tensor
    (F.logsigmoid itself) and under vmap (-softplus(-z), the form every score_mod takes, as
    uncompiled FlexAttention runs them): value and gradient within 4 machine epsilons of the
    float64 truth (plus the smallest normal number, for values that underflow), in float32 and
    in float64, for z from -1e30 to 1e30 (softplus's threshold sits at -z = 40: the default,
    20, misses by 4e5 epsilons in float64)."""
    z64 = torch.cat([torch.linspace(-200, 200, 40001, dtype=torch.float64),
                     torch.tensor([-1e30, -1e4, -41.0, -40.0, -39.0, -0.0, 0.0, 1e4, 1e30], dtype=torch.float64)])
    forms = {"plain": (kernels.log_sigmoid, "LogSigmoidBackward0"),
             "vmap": (torch.vmap(kernels.log_sigmoid), "NegBackward0")}
    for dtype in (torch.float32, torch.float64):
        info = torch.finfo(dtype)
        for form, (fn, grad_fn) in forms.items():
            z = z64.to(dtype).requires_grad_(True)
            value = fn(z)
            assert value.grad_fn.name() == grad_fn, (form, value.grad_fn.name())  # the form named above ran
            (grad,) = torch.autograd.grad(value.sum(), z)
            truth = torch.nn.functional.logsigmoid(z.detach().double())
            truth_grad = torch.sigmoid(-z.detach().double())
            for what, got, want in (("value", value, truth), ("gradient", grad, truth_grad)):
                error = (got.double() - want).abs()
                allowed = 4 * info.eps * want.abs() + info.tiny
                worst = (error - allowed).argmax()
                assert (error <= allowed).all(), (f"{form} {dtype} {what} at z = {z[worst].item()}: "
                                                  f"{got[worst].item()} vs {want[worst].item()}")


def test_caa_window_edge_on_cpu_is_one_op_each_way():
    """The blockwise path evaluates caa's soft window edge, log sigmoid, once on whole bands
    ((B H, blocks, Bq, L) elements per layer): there it is F.logsigmoid, one pass forward and
    one backward, not -softplus(-z)'s three each way (the two negations of the whole band
    cost 2-10% of caa's CPU training step, benchmarks/train_step_regression.md)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.called = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.called.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    module = make_module("caa", caa_gate="local", **WINDOWS["w5"])
    q, k, v, x, cotangent = inputs(module, 40, 1, 0, 0, seed=1)
    with Ops() as ops:
        run(module, "fused", q, k, v, x, 0, 0).backward(cotangent)
    assert ops.called.count("log_sigmoid_forward") == 1 and ops.called.count("log_sigmoid_backward") == 1, ops.called
    assert "softplus" not in ops.called and "neg" not in ops.called, ops.called


@pytest.fixture
def fresh_dynamo():
    """Uncompiled FlexAttention still traces each call with dynamo; once a call's score_mod
    captured one Python float (caa_tau), a call capturing another recompiles with that float
    made dynamic, and FlexAttention's backward then fails (torch 2.13:
    PendingUnbackedSymbolNotFound). The tests here that differentiate through it under
    another caa_tau than WINDOWS['w100']'s, or beside them, start and end with dynamo's
    caches cleared."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def log_sigmoid_as_on_cuda():
    """While active, the CPU's F.logsigmoid keeps CUDA's contract: its op, log_sigmoid_forward,
    returns an empty second output ('buffer'; the CPU kernel returns a full one, which the CPU
    backward reads), and the backward reads the input instead. This is what made every score_mod
    that called F.logsigmoid fail inside uncompiled FlexAttention's vmap on an H100 (torch 2.11:
    'SmallVector unable to grow'); a CPU cannot show it otherwise."""
    def forward(x):
        return torch.minimum(x.new_zeros(()), x) - torch.log1p(torch.exp(-x.abs())), x.new_empty((0,))

    def backward(grad, x, buffer):
        return grad * torch.sigmoid(-x)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        with torch.library._scoped_library("aten", "IMPL") as lib:
            lib.impl("log_sigmoid_forward", forward, "CPU")
            lib.impl("log_sigmoid_backward", backward, "CPU")
            yield


LOG_SIGMOID_CONFIGS = [("asga", dict(asga_gate="learned", asga_gate_space="prob")),
                       ("caa", dict(caa_gate="learned", caa_topk="sqrt"))]


@pytest.mark.parametrize("attn,flags", LOG_SIGMOID_CONFIGS, ids=["asga-prob", "caa"])
def test_flex_score_mods_run_where_logsigmoid_cannot(attn, flags, log_sigmoid_as_on_cuda, fresh_dynamo):
    """The score_mods that take a log sigmoid run under uncompiled FlexAttention (kernel=flex
    off CUDA, or with its compile off) with F.logsigmoid given CUDA's contract (the
    fixture), and their output and gate gradients equal the reference's. First, the fixture
    is shown to re-create the GPU's failure: a score_mod that calls F.logsigmoid fails in it.
    What this cannot show: anything else CUDA does differently under vmap; the tests marked
    cuda, on a GPU, are the check of that."""
    from torch.nn.attention.flex_attention import flex_attention
    q, k, v = (torch.randn(1, 1, 2, 16) for _ in range(3))
    with pytest.raises(RuntimeError, match="SmallVector"):
        flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + torch.nn.functional.logsigmoid(s))
    module = make_module(attn, n_head=2, n_kv_head=1, **flags, **WINDOWS["w100"])
    gates = [p for name, p in module.named_parameters() if "proj" not in name and "norm" not in name]
    for p0, T in ((300, 17), (0, 20)):  # queries after a cache; a prompt (above DECODE_ROWS: FlexAttention's path)
        q, k, v, x, cotangent = inputs(module, T, 1, p0, 0, seed=2, grad=False)
        results = []
        for kernel in ("flex", "ref"):
            out = run(module, kernel, q, k, v, x, p0, 0)
            results.append((out, torch.autograd.grad(out, gates, cotangent, allow_unused=True)))
        (out, grads), (ref, ref_grads) = results
        assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5), (attn, p0, T, (out - ref).abs().max())
        assert any(g is not None and g.abs().max() > 0 for g in ref_grads), "no gate takes a gradient"
        for g, g_ref in zip(grads, ref_grads):
            if g_ref is not None:
                assert torch.allclose(g, g_ref, rtol=1e-4, atol=1e-5 * g_ref.abs().max()), (attn, p0, T)


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
    """Three SGD steps (momentum 0.9) at T = 300 (past the window and dsa's threshold): the
    same losses, to 1e-5. SGD, not AdamW: AdamW's first step divides each gradient by its
    own size, so a gradient within float32's rounding of 0, of one sign in one path and the
    other in the other, moves the two models' weights apart (2e-4 measured), and a variant
    that picks keys by a hard top-k (caa, nsa, moba, indexer) then picks another key where
    two scores tie within that: over 8 data seeds on an AVX-512 CPU, caa's and the indexer's
    losses drifted apart by 1.4e-5 and 1.6e-5 by the third step. With SGD every variant's
    two runs stayed within 2e-7 on the same seeds, and the losses see a 1% error in
    `local`'s query gradient (1.8e-5 at the third step), which AdamW, blind to a gradient's
    scale, does not. The indexer's own loss: test_indexer_trains_like_the_reference."""
    idx = torch.randint(0, 512, (2, 301), generator=torch.Generator().manual_seed(2))
    losses = {}
    for kernel in ("ref", "fused"):
        model = tiny_model(attn, kernel)
        perturb_gates(model)
        opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
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


def test_indexer_trains_like_the_reference():
    """`indexer` with its KL loss L^I added, as train.py adds it (model.forward leaves it out,
    so above the indexer's own weights do not train): three AdamW steps of the reference at
    T = 300, and at each the fused model loaded with the reference's weights must select
    the same keys, give the same loss (1e-5) and every gradient within 1e-4 of its tensor's
    largest (float32's rounding in a sum over every score, 2^-24 sqrt(B H T S D), is 2e-4;
    measured below 1e-6). One layer, so that both paths' indexers read the same input (the
    embeddings): in a deeper model the previous layer's rounding (~1e-7) can move a score
    that ties another within it across the k-th (seen once in three steps on an AVX-512
    CPU), and one query's gradients then differ by a few percent."""
    idx = torch.randint(0, 512, (2, 301), generator=torch.Generator().manual_seed(2))
    ref, fused = tiny_model("indexer", "ref", n_layer=1), tiny_model("indexer", "fused", n_layer=1)
    perturb_gates(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for step in range(3):
        fused.load_state_dict(ref.state_dict())
        out = {}
        for name, model in (("ref", ref), ("fused", fused)):
            model.zero_grad(set_to_none=True)
            model.record_gates(True)
            _, loss = model(idx[:, :-1], idx[:, 1:])
            kl = model.indexer_loss()
            (loss + kl).backward()
            grads = {n: p.grad for n, p in model.named_parameters()}
            out[name] = (loss.item(), kl.item(), model.layers[0].self_attn.selection, grads)
        (loss_r, kl_r, keys_r, grads_r), (loss_f, kl_f, keys_f, grads_f) = out["ref"], out["fused"]
        assert torch.equal(keys_f, keys_r), f"step {step}: the paths selected different keys"
        assert abs(loss_f - loss_r) < 1e-5 * loss_r and abs(kl_f - kl_r) <= 1e-5 * kl_r, (step, out)
        g_index = grads_r["layers.0.self_attn.indexer.q_proj.weight"]
        assert g_index is not None and g_index.abs().max() > 0, "L^I does not reach the indexer"
        for n, g in grads_r.items():
            assert (g is None) == (grads_f[n] is None), (step, n)
            if g is not None:
                error, size = (grads_f[n] - g).abs().max().item(), g.abs().max().item()
                assert error <= 1e-4 * size, f"step {step}: grad {n}: {error:.2e} > 1e-4 x {size:.2e}"
        opt.step()
        losses.append(loss_r)
    assert losses[-1] < losses[0]  # it does train


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
    """A smoke test of whole models: under CPU bf16 autocast, kernel ref and fused run forward
    + backward to finite gradients and the loss stays within 2e-2 (relative) of float32's;
    flex runs its forward. Parity is `test_bf16_attention_equals_float32`'s."""
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


# bf16 parity. Each bf16 value is rounded to nearest with relative error <= u = 2^-8. An
# attention output passes through m = 7 such roundings (q, k, the logit, its scale, the
# softmax weight, v, the output; CPU bf16 matmuls accumulate in float32, so the length of
# a sum adds none), its gradients through m = 14 (the same again backward). Independent
# roundings add in quadrature: the relative error is <= lambda sqrt(m) u with probability
# >= 1 - 2 exp(-lambda^2 / 2) per element (Higham and Mary 2019, probabilistic rounding
# error analysis); lambda = 4 (7e-4 per element; the norm of a whole tensor is tighter
# still). So, normwise, outputs within 4 sqrt(7) u = 0.041 and gradients within 4 sqrt(14) u
# = 0.058 of the float32 reference. Measured (T = 40, window 8): outputs <= 1.3 u, gradients
# <= 5.1 u. A window moved by one key moves outputs and gradients by ~90 u, a module whose
# attention is removed by 256 u (`test_bf16_parity_sees_one_key_and_a_removed_attention`).
BF16_U = 2.0 ** -8
BF16_OUT_BOUND, BF16_GRAD_BOUND = 4 * math.sqrt(7) * BF16_U, 4 * math.sqrt(14) * BF16_U
BF16_WINDOWS = dict(window=8, caa_window_max=12, caa_tau=2.0, dsa_threshold=20)
# caa's top-k picks its keys from the scores: bf16's rounding of two nearly tied scores swaps
# a key, an O(1 / k) change no rounding bound covers (measured: 25-33 u in the worst row).
# Those configurations keep the smoke test; caa's branches are checked with top-k 'all'.
BF16_CONFIGS = [(a, f) for a, f in CONFIGS if not (a == "caa" and f.get("caa_gate") != "local" and f.get("caa_topk") == "sqrt")]


def bf16_errors(module, kernel, T=40, truth_module=None):
    """[(what, normwise relative error, bound)] of module.attend under CPU bf16 autocast
    with `kernel` against the float32 reference of truth_module (default: module itself):
    output, and gradients of q, k, v, x and every parameter (flex: of x and the parameters,
    q, k, v held constant, as FlexAttention has no CPU backward for them)."""
    truth_module = truth_module or module
    q, k, v, x, cotangent = inputs(module, T, 2, 0, 0, 1)
    qkv_grads = kernel != "flex"
    results = []
    for mod, which, bf16 in ((truth_module, "ref", False), (module, kernel, True)):
        q_, k_, v_, x_ = (t.detach().clone().requires_grad_(qkv_grads) for t in (q, k, v, x))
        x_.requires_grad_(True)
        named = dict(x=x_, **dict(mod.named_parameters()))
        if qkv_grads:
            named = dict(q=q_, k=k_, v=v_, **named)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = run(mod, which, q_, k_, v_, x_, 0, 0)
        grads = None
        if out.requires_grad:  # (not flex `full` with q, k, v constant: nothing to differentiate)
            grads = torch.autograd.grad(out, list(named.values()), cotangent.to(out.dtype), allow_unused=True)
        results.append((out.float(), grads))
    (ref, ref_grads), (out, grads) = results
    norm_rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
    rows = [("output", norm_rel(out, ref), BF16_OUT_BOUND)]
    for name, a, b in zip(named, grads or [], ref_grads or []):
        if b is not None and b.abs().max() > 0:
            a = torch.zeros_like(b) if a is None else a
            rows.append((f"grad {name}", norm_rel(a, b), BF16_GRAD_BOUND))
    return rows


@pytest.mark.parametrize("attn,flags", BF16_CONFIGS, ids=[IDS[CONFIGS.index(c)] for c in BF16_CONFIGS])
def test_bf16_attention_equals_float32(attn, flags, fresh_dynamo):
    """Under CPU bf16 autocast, every path's attention output and gradients (kernel ref and
    fused; flex all but q's, k's and v's) are within the bf16 bound of the float32 reference's."""
    module = make_module(attn, n_head=2, n_kv_head=1, **flags, **BF16_WINDOWS)
    for kernel in ("ref", "fused", "flex"):
        for what, error, bound in bf16_errors(module, kernel):
            assert error <= bound, f"{kernel} {what}: {error / BF16_U:.1f} u > {bound / BF16_U:.1f} u"


def test_bf16_flex_pair_gate_gradients(fresh_dynamo):
    """asga's prob gate near its init (w2 ~ N(0, 0.02): sigmoid(-z) nearly the same for every
    key), T = 256, bf16 on the flex path. b2's gradient, sum over every score of a head of
    dS_ij sigmoid(-z_ij), is within the bf16 bound of float32's, as every other gradient is:
    it was 47-60 u off while b2 took the rounding of FlexAttention's bf16 row sums of dS,
    sum_j dS_ij (0 exactly; see kernels.flex_pair_gated_attention). And the gradients of the
    pair MLP's per-key and per-query halves (w1_k, w1_q), sums of the same per-score terms
    over a key's queries or a query's keys, are as precise as each other (within 2x): w1_k's
    was 4x w1_q's while the captured per-key terms were bf16, as FlexAttention sums a captured
    tensor's gradient in that tensor's dtype."""
    module = make_module("asga", n_head=2, n_kv_head=1, asga_gate="learned", asga_gate_space="prob", **BF16_WINDOWS)
    module.w2.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
    rows = bf16_errors(module, "flex", T=256)
    errors = {what: error for what, error, _ in rows}
    assert "grad b2" in errors
    for what, error, bound in rows:
        assert error <= bound, f"flex {what}: {error / BF16_U:.1f} u > {bound / BF16_U:.1f} u"
    assert errors["grad w1_k"] <= 2 * errors["grad w1_q"], (errors["grad w1_k"] / BF16_U, errors["grad w1_q"] / BF16_U)


@pytest.mark.parametrize("q_start,k_start", [(0, 0), (6, 2)])
def test_caa_topk_keeps_every_key_tied_with_the_kth(q_start, k_start):
    """The tie rule of caa's top-k (attention.topk_mask): every visible key scoring at least the
    k_i-th highest is kept, so a group of keys tied at the k_i-th score is kept whole. Keys are
    one key times 1, 2 or 4 (exact ties, groups far wider than k_max + 1, so the blockwise
    path's buffer must widen), and every path equals a loop that keeps the tie group whole."""
    B, H, Hkv, T, D = 1, 2, 1, 40, 8
    S = q_start + T - k_start
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(D, generator=g, dtype=torch.float64) * torch.tensor([1.0, 2.0, 4.0])[
        torch.randint(0, 3, (S,), generator=g)][:, None]
    k, v = k.expand(B, Hkv, S, D), torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)
    pos = torch.arange(q_start, q_start + T)
    k_per_query, k_max = torch.ceil(torch.sqrt(pos.double() + 1)).long(), math.isqrt(q_start + T - 1) + 1
    want, wider = torch.zeros(B, H, T, D, dtype=torch.float64), 0
    for h in range(H):
        for t in range(T):
            visible = range(q_start + t - k_start + 1)
            score = {s: float(q[0, h, t] @ k[0, 0, s]) * D ** -0.5 for s in visible}
            kth = sorted(score.values(), reverse=True)[min(int(k_per_query[t]), len(score)) - 1]
            kept = [s for s in visible if score[s] >= kth]
            wider += len(kept) > k_per_query[t]
            p = torch.softmax(torch.tensor([score[s] for s in kept], dtype=torch.float64), 0)
            want[0, h, t] = p @ v[0, 0, kept]
    assert wider > T  # most rows keep more than k_i keys: the rule is exercised
    for op in (attention.REFERENCE, kernels.BLOCKWISE, kernels.FLEX):
        got = op.topk_attention(q.float(), k.float(), v.float(), D ** -0.5, q_start, k_start, k_per_query, k_max)
        assert (got.double() - want).abs().max() < 1e-5, op.name


def test_bf16_caa_window_edge_is_not_rounded():
    """Under bf16 autocast, caa's width w = W + (W_max - W) sigmoid(l) (the window edge its soft
    boundary's score_mod reads) differs from float32's by no more than bf16's rounding of the
    logit l explains, |dw| <= (W_max - W)/4 |dl| (sigmoid' <= 1/4), and not by a rounding of w itself:
    at W = 256 .. 512 a bf16 w moves in steps of 2 tokens."""
    module = make_module("caa", n_head=2, n_kv_head=1, window=256, caa_window_max=512)
    module.record_gates(True)
    q, k, v, x, _ = inputs(module, 40, 2, 0, 0, 1, grad=False)
    widths, logits = [], []
    for bf16 in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), torch.no_grad():
            run(module, "flex", q, k, v, x, 0, 0)
            logits.append(module.width(x)[..., 0].double())
        widths.append(module.gates["window"][..., 0].double())
    spread = module.cfg.caa_window_max - module.cfg.window
    explained = spread / 4 * (logits[1] - logits[0]).abs() + 1e-4  # (+ float32's rounding of w)
    excess = ((widths[1] - widths[0]).abs() - explained).max().item()
    assert excess <= 0, f"the bf16 width is {excess:.2f} tokens farther from float32's than its logit explains"


@pytest.mark.parametrize("attn,flags", [("local", {}), ("dsa", dict(dsa_window="fixed")),
                                        ("asga", dict(asga_gate="fixed"))])
def test_bf16_parity_sees_one_key_and_a_removed_attention(attn, flags):
    """The bf16 bound is tight enough to see a window one key shorter (the bf16 module's
    window W - 1 against the float32 reference's W) and an attention output removed
    (zeroed), in the output and in the gradients."""
    module = make_module(attn, n_head=2, n_kv_head=1, **flags, **BF16_WINDOWS)
    shorter = copy.deepcopy(module)
    shorter.cfg = dataclasses.replace(module.cfg, window=module.cfg.window - 1)
    for kernel in ("ref", "fused"):
        rows = bf16_errors(shorter, kernel, truth_module=module)
        assert all(error > 2 * bound for what, error, bound in rows if what in ("output", "grad q", "grad k", "grad v")), rows
    removed = copy.deepcopy(module)
    removed.attend = lambda q, *args: q * 0  # this module's attention removed
    rows = bf16_errors(removed, "ref", truth_module=module)
    assert all(error > 2 * bound for what, error, bound in rows if what in ("output", "grad k", "grad v")), rows


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


TRAINING_GRAPH_FLAGS = dict(nsa=dict(nsa_cmp_block=8, nsa_cmp_stride=4, nsa_block=16, nsa_topk=3, nsa_window=16),
                            moba=dict(moba_block=16, moba_topk=3), indexer=dict(index_topk=24, index_head_dim=16))


@pytest.mark.parametrize("attn", sorted(VARIANTS))
def test_flex_training_step_traces_as_one_graph(attn, monkeypatch):
    """What model.compile_blocks hands torch.compile on a GPU: a block's forward in training
    mode with gradients on (the selections' training tiles, the indexer's loss) traces as one
    graph, every variant, with sizes under T so that each selection selects. FlexAttention's
    CPU guard against a backward is lifted: only the trace is looked at."""
    import torch.nn.attention.flex_attention as nn_fa
    monkeypatch.setattr(nn_fa, "_validate_device", lambda *args, **kwargs: None)
    model = tiny_model(attn, "flex", n_layer=1, **TRAINING_GRAPH_FLAGS.get(attn, {})).train()
    idx = torch.randint(0, 512, (1, 151), generator=torch.Generator().manual_seed(0))

    def step(idx):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        kl = model.indexer_loss()
        return loss if kl is None else loss + kl

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(step)(idx)
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
    largest or the stated bound (kernels.chunked_mean_pair_gate)."""
    T, r = 2048, 4
    module = make_module("asga", asga_hidden=r)
    q, k, v, x, _ = inputs(module, T, 1, 0, 0, 1, grad=False)
    with torch.no_grad():
        with LargestTensor() as plain:
            run(module, "fused", q, k, v, x, 0, 0)
        module.record_gates(True)
        with LargestTensor() as recorded:
            run(module, "fused", q, k, v, x, 0, 0)
    H = module.cfg.n_head
    bound = max(kernels.RECORD_ELEMENTS, H * T * r)
    assert recorded.largest < T * T * r
    assert recorded.largest <= max(plain.largest, bound), (recorded.largest, plain.largest, bound)
    gate = module.gates["pair_gate"]  # (1, T, H), the mean over visible keys, as the reference has it
    s = torch.sigmoid(attention.pair_gate_logit(*module.pair_terms(q[:, :, -3:], k), module.w2, module.b2))
    expected = torch.stack([s[0, :, i, :T - 3 + i + 1].mean(-1) for i in range(3)])  # (3, H)
    assert torch.allclose(gate[0, -3:], expected, atol=1e-5)


def _top_n_rows(kind, shape, n, g):
    """Scores that stress a top-n's tie rule: normal, a few integers (ties wider than n),
    a causal -inf tail, no finite score, -0.0 beside 0.0, fewer finite scores than n."""
    x = torch.randn(*shape, generator=g)
    if kind == "ties":
        x = torch.randint(-3, 3, shape, generator=g).float()
    elif kind == "tail":
        x[..., shape[-1] // 3:] = float("-inf")
    elif kind == "no finite":
        x = torch.full(shape, float("-inf"))
    elif kind == "signed zeros":
        x = torch.zeros(shape)
        x[..., ::2] = -0.0
    elif kind == "fewer than n":
        x[..., n // 2:] = float("-inf")
    elif kind == "ties above the cut":  # the n highest all equal, the next lower: one order, by index
        x[..., torch.linspace(0, shape[-1] - 1, n).long()] = 10.0
    return x


TOP_N_KINDS = ["normal", "ties", "tail", "no finite", "signed zeros", "fewer than n", "ties above the cut"]


@pytest.mark.parametrize("kind", TOP_N_KINDS)
@pytest.mark.parametrize("shape,n", [((3, 5, 4096), 256), ((2, 7, 300), 8), ((5, 1000), 3), ((2, 7, 100), 3)])
def test_narrowed_top_n_is_attention_top_n(kind, shape, n):
    """kernels._top_n_narrowed (a CPU's top-n of long rows: candidates first, then a top-n of
    them) and _top_n_of_floats (a CPU's top-n of a few: a top-k of the floats, the key's
    where the n-th score ties across the cut) return attention.top_n exactly: the same
    indices in the same order, ties to the higher index, -1 for -inf; and _top_n(narrow=True)
    takes one of them for a large call of long rows. (Rows of 300 at n = 8 and of 100 at n = 3
    reach torch's top-k padded with -inf, `kernels._cpu_topk`; 1000 at n = 3 as they are.)"""
    x = _top_n_rows(kind, shape, n, torch.Generator().manual_seed(len(kind)))
    assert torch.equal(kernels._top_n_narrowed(x, n), attention.top_n(x, n))
    assert torch.equal(kernels._top_n_of_floats(x, n), attention.top_n(x, n))
    assert torch.equal(kernels._top_n(x, n, narrow=True), attention.top_n(x, n))


@pytest.mark.parametrize("kind", TOP_N_KINDS)
@pytest.mark.parametrize("shape,n", [((2, 7, 300), 3), ((5, 1000), 4), ((4, 2), 3), ((3, 50), 1)])
def test_top_n_by_maxima_is_attention_top_n(kind, shape, n):
    """FLEX's top-n of a few (moba's 3 blocks): n running maxima of the (score, index) key
    return attention.top_n exactly: order, ties to the higher index, -1 for -inf, rows
    shorter than n padded."""
    x = _top_n_rows(kind, shape, n, torch.Generator().manual_seed(len(kind) + n))
    assert torch.equal(kernels._top_n_by_maxima(x, n) if shape[-1] >= n else kernels._top_n(x, n, maxima=True),
                       attention.top_n(x, n))
    assert torch.equal(kernels.FLEX.top_n(x, n), attention.top_n(x, n))


def test_flex_takes_the_maxima_for_a_few_and_the_top_k_for_more(monkeypatch):
    taken = []
    monkeypatch.setattr(kernels, "_top_n_by_maxima", lambda s, n: taken.append(n) or attention.top_n(s, n))
    x = torch.randn(3, 64)
    kernels.FLEX.top_n(x, kernels.TOP_N_BY_MAXIMA)
    kernels.FLEX.top_n(x, kernels.TOP_N_BY_MAXIMA + 1)  # nsa's 16: the top-k
    kernels.BLOCKWISE.top_n(x, 3)  # the CPU's: its own chunked top-k
    assert taken == [kernels.TOP_N_BY_MAXIMA]


@pytest.mark.parametrize("S,k", [(9, 9), (215, 9), (216, 9), (575, 9), (576, 9), (100, 4), (300, 4)])
def test_a_cpu_top_k_padded_or_not_lists_what_torchs_lists(S, k):
    """kernels._cpu_topk pads rows of 24 k .. 64 k scores with -inf before torch's top-k (which
    sorts such rows by nth_element, 3-4x slower a score than its partial sort from 64 k): the
    same values, and the same columns wherever the value is finite; the rows it hands torch
    are 64 k wide exactly where it pads."""
    g = torch.Generator().manual_seed(S + k)
    s = torch.randn(6, S, generator=g)
    s[0, S // 2:] = float("-inf")  # fewer finite scores than k in one row
    s[1] = float("-inf")
    widths = []
    real = torch.Tensor.topk
    with unittest.mock.patch.object(torch.Tensor, "topk", lambda x, *a, **kw: widths.append(x.shape[-1]) or real(x, *a, **kw)):
        values, cols = kernels._cpu_topk(s, k)
    want_values, want_cols = real(s, k, -1)
    assert widths == [64 * k if 24 * k <= S < 64 * k else S]
    assert torch.equal(values, want_values)
    finite = values > float("-inf")
    assert torch.equal(cols[finite], want_cols[finite]) and (cols[~finite] < max(S, 64 * k)).all()


def test_top_n_of_floats_ranks_a_nan_as_the_key_does():
    """A NaN ranks by its bits in attention.top_n's key (a NaN with the sign bit set below
    -inf, one without above +inf), first of all in torch's float top-k: _top_n_of_floats
    gives such rows to the key."""
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    x[0, 5] = float("nan")
    x[1, 7] = -float("nan")
    x[2, 9] = x[2, 11] = -float("nan")
    assert x[1, 7].view(torch.int32) < 0  # the sign bit set
    assert torch.equal(kernels._top_n_of_floats(x, 3), attention.top_n(x, 3))


def test_top_n_narrows_large_cpu_calls_of_long_rows(monkeypatch):
    taken = []
    monkeypatch.setattr(kernels, "_top_n_narrowed", lambda s, n: taken.append(("narrowed", n)) or attention.top_n(s, n))
    monkeypatch.setattr(kernels, "_top_n_of_floats", lambda s, n: taken.append(("floats", n)) or attention.top_n(s, n))
    large = torch.randn(64, kernels.TOP_N_NARROWED_CALL // 64)
    few, many = kernels.TOP_N_OF_FLOATS, kernels.TOP_N_OF_FLOATS + 1
    kernels._top_n(large, few, narrow=True)  # nsa's and moba's blocks
    kernels._top_n(large, many, narrow=True)  # the indexer's keys
    kernels._top_n(large, few)  # FLEX's (the GPU path's, even on CPU tensors): never narrowed
    kernels._top_n(torch.randn(2, 100), 8, narrow=True)  # a decoding step's few scores: the plain top-k
    assert taken == [("floats", few), ("narrowed", many)]
    assert kernels.BLOCKWISE.indexer_topk.keywords == {"narrow": True}
    assert kernels.FLEX.indexer_topk is kernels.chunked_indexer_topk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_or_zero_is_the_definitions_to_the_bit(dtype):
    """kernels._softmax_or_zero (four ops) equals attention.softmax_or_zero (seven) bit for bit:
    rows with some keys allowed, a row with none (zeros, not NaN), a row with one."""
    torch.manual_seed(0)
    logits = (torch.randn(2, 3, 5, 17) * 4).to(dtype)
    mask = torch.rand(2, 3, 5, 17) < 0.5
    mask[0, 0, 0] = False  # no key allowed
    mask[1, 2, 4] = False
    mask[1, 2, 4, 3] = True  # one
    got, want = kernels._softmax_or_zero(logits, mask), attention.softmax_or_zero(logits, mask)
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
    assert not got[0, 0, 0].any() and got[1, 2, 4, 3] == 1


@pytest.mark.parametrize("layout", ["cache", "padded_heads", "one_key_head"])
def test_cached_rows_name_each_query_heads_key_rows(layout):
    """kernels._cached_rows' row indices read x[b, h // G, first + i] for every batch row b
    and query head h: on a cache's layout (heads one after another in each batch row, spare
    capacity after each head's rows), and on views whose batch stride is not the heads'
    (the two-arange form), with G = 2 query heads a key head, and with one key head."""
    B, S, D = 3, 10, 4
    x = {"cache": torch.randn(B, 4, 16, D)[:, :, 2:2 + S],
         "padded_heads": torch.randn(B, 5, S, D)[:, :4],
         "one_key_head": torch.randn(B, 2, S, D)[:, 1:]}[layout]
    Hkv = x.shape[1]
    H = 2 * Hkv
    first = torch.randint(0, S - 3, (B, H, 2))
    table, rows, pos = kernels._cached_rows(x, H, first, length=3)
    got = table[rows]  # (B, H, 2, 3, D)
    want = torch.stack([torch.stack([x[b, h // 2, pos[b, h].flatten()].view(2, 3, D) for h in range(H)])
                        for b in range(B)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("layout", ["keys_last", "rows"])
def test_keys_times_reads_keys_along_the_positions_in_pieces(layout):
    """kernels.keys_times equals torch.bmm (query rows times K^T) for keys stored along the
    positions (a CPU cache's keys_last, spare capacity after each row) and as rows of D, with
    one query row, a few and more than KEY_ROWS, D a multiple of KEY_STREAMS and not. Along the
    positions with 2 to KEY_ROWS rows, no bmm it runs reads more than KEY_STREAMS rows of K^T;
    as rows, with one query row or more than KEY_ROWS, or off a CPU (meta tensors), it runs
    one bmm."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Bmms(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.depths = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.bmm.default:
                self.depths.append(args[1].shape[1])  # the rows of K^T it reads
            elif func is torch.ops.aten.baddbmm_.default:  # a piece added in place
                self.depths.append(args[2].shape[1])
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    N, S, streams = 3, 50, kernels.KEY_STREAMS
    for D in (2 * streams, 2 * streams + streams // 2):
        kT = (torch.randn(N, D, S + 7, generator=g)[..., :S] if layout == "keys_last"
              else torch.randn(N, S, D, generator=g).transpose(1, 2))
        for R in (1, 4, kernels.KEY_ROWS + 1):
            rows = torch.randn(N, R, D, generator=g)
            with Bmms() as seen:
                got = kernels.keys_times(rows, kT)
            torch.testing.assert_close(got, torch.bmm(rows, kT), rtol=1e-5, atol=1e-5)
            if layout == "keys_last" and 1 < R <= kernels.KEY_ROWS:
                assert len(seen.depths) == math.ceil(D / streams) and max(seen.depths) <= streams
            else:
                assert seen.depths == [D]
            with Bmms() as seen:  # off a CPU (a GPU's cache lies as rows): whole, whatever the strides
                kernels.keys_times(rows.to("meta"), kT.to("meta"))
            assert seen.depths == [D]


def test_keys_times_traced_without_gradients_is_one_opaque_call_of_its_pieces():
    """Traced by torch.compile without gradients (a compiled decoding step), kernels.keys_times
    over keys stored along the positions is one call of the custom op cache_keys_times, which
    runs the eager pieces (their in-place adds): the graph has no bmm of its own, and the
    result equals the eager one to the bit. With gradients it traces torch.bmm."""
    from torch._dynamo.backends.debugging import aot_eager
    graphs = []

    def recording(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return aot_eager(gm, example_inputs)

    g = torch.Generator().manual_seed(0)
    kT = torch.randn(2, 2 * kernels.KEY_STREAMS, 60, generator=g)[..., :50]
    rows = torch.randn(2, 4, 2 * kernels.KEY_STREAMS, generator=g)
    try:
        with torch.no_grad():
            got = torch.compile(kernels.keys_times, backend=recording, fullgraph=True)(rows, kT)
        assert torch.equal(got, kernels.keys_times(rows, kT))
        (targets,) = graphs
        assert targets.count("sparse_attention.cache_keys_times.default") == 1, targets
        assert not any("bmm" in t for t in targets), targets
        torch._dynamo.reset()
        graphs.clear()
        torch.compile(kernels.keys_times, backend=recording, fullgraph=True)(rows.requires_grad_(), kT)
        (targets,) = graphs
        assert "cache_keys_times" not in str(targets) and any("bmm" in t for t in targets), targets
    finally:
        torch._dynamo.reset()


def test_a_compiled_cpu_softmax_sums_in_pieces_and_keeps_one_graph_past_4096():
    """kernels._softmax_or_zero traced for a CPU with symbolic sizes, as a compiled decoding
    step traces it: its sum over a row is taken in pieces (`_softmax_in_pieces`), so rows
    crossing 4096 entries (where inductor's CPU sum switches to its cascade helper, a guard on
    the length) reuse the first graph; the probabilities equal the eager softmax's to float32
    rounding, and a row with no allowed entry is zeros."""
    from torch._inductor.compile_fx import compile_fx

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda x, mask: kernels._softmax_or_zero(x, mask), dynamic=True, backend=counting)
        for C in (3000, 4100, 5003):
            torch.manual_seed(C)
            x = torch.randn(2, 3, 1, C) * 4
            mask = torch.rand(2, 3, 1, C) > 0.2
            mask[1, 2] = False  # a row with no allowed entry
            got, want = compiled(x, mask), kernels._softmax_or_zero(x, mask)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
            assert torch.equal(got[1, 2], torch.zeros_like(got[1, 2]))
        assert len(graphs) == 1, len(graphs)
    finally:
        torch._dynamo.reset()
