"""kernels_triton.py's kernels. asga's, against the definition
(attention.pair_gated_attention): the output and every gradient (q, k, v, the query and key
terms, w2, b2, the head scale), both gate spaces, GQA, a chunk of queries after a prefix,
hidden widths that are and are not powers of two, bf16 inputs, both backward forms (split,
fused); the op inside torch.compile. nsa's block scores, against kernels.chunked_block_scores (itself held to attention.py's eqs.
8-9 by tests/test_kernels.py): every eq. 9 geometry the config allows, GQA, a chunk after a
prefix, bf16 inputs, the blocks chosen from them, and a model on the GPU path.

Without a GPU they run on CPU tensors through Triton's interpreter, which runs the kernels'
own code program by program: in a child process (this file run as a script), because
TRITON_INTERPRET=1 must be set before triton is first imported. Triton comes with torch's
CUDA builds; on a CPU it is an extra (`pip install -r requirements-dev.txt`, which CI installs
before running this file again). With CUDA the same checks run the compiled kernels, here."""
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attention  # noqa: E402

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.cuda] if CUDA else []  # on a GPU, gpu_check's `pytest -m cuda` runs them
SMALL_TILES = dict(fwd=(16, 16, 4), bwd_kv=(16, 16, 4), bwd_q=(16, 16, 4))  # several tiles at T ~ 40


def inputs(B, H, Hkv, T, S, D, r, tensor_scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    scale = ((torch.rand(H, generator=g, dtype=torch.float64) + 0.5) * D ** -0.5) if tensor_scale else D ** -0.5
    return [x(B, H, T, D), x(B, Hkv, S, D), x(B, Hkv, S, D), x(B, H, T, r), x(B, H, S, r), 0.5 * x(H, r), 0.3 * x(H),
            scale]


def run(fn, leaves, scale, q_start, k_start, gate_space, dtype, device, do):
    """fn's output and the gradients of (out * do).sum() for every leaf (and the scale if a tensor)."""
    xs = [t.detach().to(device, dtype).requires_grad_(True) for t in leaves]
    sc = scale.detach().to(device, dtype).requires_grad_(True) if torch.is_tensor(scale) else scale
    out = fn(*xs, sc, q_start, k_start, gate_space)
    wrt = xs + ([sc] if torch.is_tensor(scale) else [])
    grads = torch.autograd.grad((out.double() * do.to(device)).sum(), wrt)
    return [out.double().cpu()] + [gr.double().cpu() for gr in grads]


NAMES = ["out", "dq", "dk", "dv", "dq_term", "dk_term", "dw2", "db2", "dscale"]
CASES = {  # B, H, Hkv, T, S, D, r, q_start, k_start, gate_space, tensor_scale, dtype
    "logit, GQA, r = 5": (2, 4, 2, 37, 37, 16, 5, 0, 0, "logit", True, "float32"),
    "prob, GQA, r = 5": (2, 4, 2, 37, 37, 16, 5, 0, 0, "prob", True, "float32"),
    "a chunk after a prefix, r = 16": (1, 2, 2, 20, 50, 16, 16, 30, 0, "logit", True, "float32"),
    "offset positions, float scale": (1, 2, 1, 33, 33, 32, 4, 5, 5, "logit", False, "float32"),
    "bf16, logit": (1, 2, 1, 40, 40, 32, 16, 0, 0, "logit", True, "bfloat16"),
    "bf16, prob": (1, 2, 1, 40, 40, 32, 16, 0, 0, "prob", True, "bfloat16"),
}


def compare(kt, case, device):
    """{tensor name: its largest error relative to its largest entry} against the float64 definition."""
    B, H, Hkv, T, S, D, r, q_start, k_start, gate_space, tensor_scale, dtype = case
    *leaves, scale = inputs(B, H, Hkv, T, S, D, r, tensor_scale)
    do = torch.randn(B, H, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = run(attention.pair_gated_attention, leaves, scale, q_start, k_start, gate_space, torch.float64, "cpu", do)
    got = run(kt.pair_gated_attention, leaves, scale, q_start, k_start, gate_space, getattr(torch, dtype), device, do)
    return {n: ((a - b).abs().max() / b.abs().max()).item() for n, a, b in zip(NAMES, got, want)}


def no_key_rows(kt, device):
    """Queries before the first key (q_start = 0 < k_start = 5): (their outputs all 0, their
    log-sum-exp all -inf, the other rows' largest difference from the definition)."""
    *leaves, scale = inputs(1, 2, 2, 10, 10, 16, 4, True)
    q, k, v, qt, ktm, w2, b2 = (t.float().to(device) for t in leaves)
    out, lse = kt.forward(q, k, v, qt, ktm, w2, b2, scale.float().to(device), 0, 5, False)
    want = attention.pair_gated_attention(*leaves, scale, 0, 5)
    return [bool((out[:, :, :5] == 0).all()), bool(torch.isinf(lse[:, :, :5]).all()),
            (out[:, :, 5:].double().cpu() - want[:, :, 5:]).abs().max().item()]


def compiled_equals_eager(kt, device):
    """Gradients of a function calling the op as the model does (kernels.flex_pair_gated_attention,
    which picks these kernels), compiled (inductor, fullgraph: no graph break) and eager: equal?"""
    import kernels
    *leaves, scale = inputs(1, 2, 1, 24, 24, 16, 5, True)  # r = 5: w2's gradient a slice of its padded sum
    xs = [t.float().to(device).requires_grad_(True) for t in leaves + [scale]]

    def f(q, k, v, qt, ktm, w2, b2, sc):
        return kernels.flex_pair_gated_attention(q, k, v, qt, ktm, w2, b2, sc, 0, 0).square().sum()

    eager = torch.autograd.grad(f(*xs), xs)
    compiled = torch.autograd.grad(torch.compile(f, fullgraph=True)(*xs), xs)  # inductor checks each output's strides
    return all(torch.equal(a, b) for a, b in zip(eager, compiled))


def model_through_the_gpu_path(device):
    """A 2-layer asga model with kernel='flex' (its pair-gated attention through
    kernels.flex_pair_gated_attention, which hands it to these kernels: ASGA_KERNEL=triton in the
    child, the default on CUDA) against kernel='ref' (attention.py as written), same weights:
    (the path kernels.py chose, the loss's difference, the largest gradient error relative to
    that gradient's largest entry)."""
    import kernels
    from model import Model, ModelConfig
    cfg = dict(vocab_size=64, n_layer=2, attn="asga", asga_hidden=5)
    torch.manual_seed(0)
    ref = Model(ModelConfig(**cfg, kernel="ref")).to(device)
    gpu_path = Model(ModelConfig(**cfg, kernel="flex")).to(device)
    gpu_path.load_state_dict(ref.state_dict())
    idx = torch.randint(0, 64, (2, 41), generator=torch.Generator().manual_seed(0)).to(device)
    losses, grads = [], []
    for model in (ref, gpu_path):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    error = max(((grads[1][n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item() for n, g in grads[0].items())
    return [kernels.pair_gate_kernels(idx.new_zeros(1, 1, 1, 16, dtype=torch.float32))[0],
            abs(losses[0] - losses[1]), error]


DEFAULT_TILES_CASE = (1, 2, 2, 100, 100, 64, 16, 0, 0, "logit", True, "float32")  # qwen-134m's D and r


# nsa's block scores: B, H, Hkv, T, D, (l, d, l') = nsa_cmp_block, nsa_cmp_stride, nsa_block, q_start, dtype
SCORE_CASES = {
    "the defaults (16, 8, 32), GQA": (2, 4, 2, 77, 16, (16, 8, 32), 0, "float32"),
    "the paper's (32, 16, 64), a chunk after a prefix": (1, 2, 1, 50, 16, (32, 16, 64), 70, "float32"),
    "l = d: no overlap (8, 8, 16)": (1, 2, 2, 70, 16, (8, 8, 16), 0, "float32"),
    "l = l' (16, 4, 16): a key over four blocks' segments": (1, 2, 2, 70, 16, (16, 4, 16), 3, "float32"),
    "block = stride (8, 8, 8)": (1, 1, 1, 40, 16, (8, 8, 8), 0, "float32"),
    "bf16 q and keys": (1, 2, 1, 90, 32, (16, 8, 32), 5, "bfloat16"),
}
SMALL_SCORE_TILES = (16, 16, 16, 4)
# the fused choice: rows with more valid blocks than slots (the scores rank them), and short
# rows (n = 16: every valid block, forced first, then -1; n = 3: the forced blocks alone), and
# rows whose blocks span several tiles (the running top merged with each tile's)
CHOICES = {
    "GQA, 7 blocks of 16, n = 5": ((1, 4, 2, 112, 16, (8, 4, 16), 0, "float32"), 5),
    "(16, 8, 16), a chunk after a prefix, n = 4": ((1, 2, 1, 60, 16, (16, 8, 16), 100, "float32"), 4),
    "l = d (8, 8, 16), n = 6": ((1, 2, 2, 112, 16, (8, 8, 16), 0, "float32"), 6),
    "bf16, n = 5": ((1, 2, 1, 128, 32, (16, 8, 16), 5, "bfloat16"), 5),
    "short rows, GQA, n = 16": ((2, 4, 2, 77, 16, (16, 8, 32), 0, "float32"), 16),
    "short rows, n = 3": ((1, 2, 1, 77, 16, (16, 8, 32), 0, "float32"), 3),
    "40 blocks of 8 (three tiles merged), GQA, n = 5": ((1, 4, 2, 320, 16, (8, 4, 8), 0, "float32"), 5),
}


def score_inputs(B, H, Hkv, T, D, geometry, q_start, seed=0):
    length, stride, block = geometry
    C = max(0, (q_start + T - length) // stride + 1)  # the compressed keys complete by the last query
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g), 2 * torch.randn(B, Hkv, C, D, generator=g), D ** -0.5, q_start,
            length, stride, block, -(-(q_start + T) // block))


def compare_scores(kt, case, device):
    """(the kernel's largest error relative to the largest score, the largest score, the blocks
    attention.nsa_top_blocks chooses from each equal?) against kernels.chunked_block_scores on
    the same (rounded) inputs."""
    import kernels
    B, H, Hkv, T, D, geometry, q_start, dtype = case
    q, k, *rest = score_inputs(B, H, Hkv, T, D, geometry, q_start)
    q, k = q.to(getattr(torch, dtype)), k.to(getattr(torch, dtype))
    want = kernels.chunked_block_scores(q, k, *rest)
    got = kt.nsa_block_scores(q.to(device), k.to(device), *rest).cpu()
    choose = [attention.nsa_top_blocks(s, q_start, geometry[2], 4, Hkv) for s in (got, want)]
    return [((got - want).abs().max() / want.abs().max()).item(), want.abs().max().item(),
            torch.equal(*choose)]


def compare_choices(kt, case, n, device):
    """The fused choice (kernels_triton.top_blocks: (B, Hkv, T, n), the scores never stored)
    equal to attention.nsa_top_blocks over kernels.chunked_block_scores, every slot?"""
    import kernels
    B, H, Hkv, T, D, geometry, q_start, dtype = case
    q, k, *rest = score_inputs(B, H, Hkv, T, D, geometry, q_start)
    q, k = q.to(getattr(torch, dtype)), k.to(getattr(torch, dtype))
    want = attention.nsa_top_blocks(kernels.chunked_block_scores(q, k, *rest), q_start, geometry[2], n, Hkv)
    got = kt.nsa_top_blocks(q.to(device), k.to(device), *rest, n).cpu()
    return torch.equal(attention.expand_kv(got, H), want)


# moba's choice: B, H, Hkv, T, D, block, q_start, topk
MOBA_CASES = {
    "12 blocks of 8, k = 3": (1, 2, 1, 100, 16, 8, 0, 3),
    "GQA, a chunk after a prefix, k = 5": (2, 4, 2, 77, 16, 4, 30, 5),
    "k = 16: a whole tile of slots, -1 after": (1, 2, 2, 64, 16, 8, 0, 16),
    "k = 1: the own block alone": (1, 2, 1, 60, 32, 4, 0, 1),
}
SMALL_MOBA_TILES = (16, 16, 4)


def compare_moba(kt, case, device):
    """kernels_triton.moba_blocks equal to attention.moba_select, every slot?"""
    B, H, Hkv, T, D, block, q_start, topk = case
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, q_start + T, D, generator=g)
    means = attention.block_means(k, block)
    want = attention.moba_select(q, means, q_start, block, topk)
    return torch.equal(kt.moba_select(q.to(device), means.to(device), q_start, block, topk).cpu(), want)


def model_choosing_through_the_kernels(device, attn):
    """A 2-layer nsa or moba model with kernel='flex' (its choice through kernels_triton's
    kernel: SELECTION_KERNEL=triton in the child, the default on CUDA) against kernel='ref',
    same weights: (the path kernels.py chose, the loss's difference, the largest gradient error
    relative to that gradient's largest entry, 0 on a CPU: FlexAttention there has no
    backward). T = 80: nsa at the cpu preset's sizes (8, 4, 16), 19 compressed keys, 5 blocks,
    4 chosen; moba 10 blocks of 8, 3 chosen."""
    import kernels
    from model import Model, ModelConfig
    sizes = dict(nsa=dict(nsa_cmp_block=8, nsa_cmp_stride=4, nsa_block=16, nsa_topk=4, nsa_window=16),
                 moba=dict(moba_block=8, moba_topk=3))[attn]
    cfg = dict(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, attn=attn, **sizes)
    torch.manual_seed(0)
    ref = Model(ModelConfig(**cfg, kernel="ref")).to(device)
    gpu_path = Model(ModelConfig(**cfg, kernel="flex")).to(device)
    gpu_path.load_state_dict(ref.state_dict())
    idx = torch.randint(0, 64, (2, 81), generator=torch.Generator().manual_seed(0)).to(device)
    losses, grads = [], []
    for model in (ref, gpu_path):
        with torch.set_grad_enabled(device != "cpu"):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        if loss.requires_grad:
            loss.backward()
            grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        losses.append(loss.item())
    error = max(((grads[1][n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
                for n, g in grads[0].items()) if grads else 0.0
    q = idx.new_zeros(1, 1, 1, 16, dtype=torch.float32)
    path = kernels.block_score_kernels(q, 8, 4, 16) if attn == "nsa" else kernels.moba_select_kernels(q, 3)
    return [path[0], abs(losses[0] - losses[1]), error]


def mixed_dtypes_under_autocast(device):
    """kernels.flex_compressed_branch as nsa's attend calls it under bf16 autocast: RoPE hands
    over a float32 q beside bf16 compressed keys (a Triton dot of the two does not compile).
    The blocks the fused kernel chooses equal attention.nsa_top_blocks over the torch form's
    scores of both in bf16, autocast's dtype (or the error, as text)."""
    import functools
    import kernels
    q, k, scale, q_start, length, stride, block, J = score_inputs(1, 4, 2, 112, 16, (8, 4, 16), 0)
    choose = functools.partial(attention.nsa_top_blocks, block=block, n=5, n_kv_head=2)
    try:
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            _, got = kernels.flex_compressed_branch(q.to(device), k.bfloat16().to(device), k.bfloat16().to(device), scale,
                                                    q_start, length, stride, block, choose)
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:300]}"
    want = choose(kernels.chunked_block_scores(q.bfloat16(), k.bfloat16(), scale, q_start, length, stride, block, J),
                  q_start)
    return torch.equal(got.cpu(), want)


def scores_compiled_equal_eager(kt, device):
    """Each op inside a compiled function (fullgraph: no graph break) gives the eager call's
    scores and blocks (nsa's, and moba's over 4 block means)."""
    q, k, *rest = score_inputs(1, 2, 1, 40, 16, (16, 8, 32), 0)

    def f(q, k):
        return (kt.nsa_block_scores(q, k, *rest) * 2, kt.nsa_top_blocks(q, k, *rest, 4) + 1,
                kt.moba_select(q, k[:, :, :4], 0, 8, 3) + 1)

    q, k = q.to(device), k.to(device)
    return all(torch.equal(a, b) for a, b in zip(f(q, k), torch.compile(f, fullgraph=True)(q, k)))


def attempt(fn, *args):
    """fn(*args), or {"error": its traceback's last lines}: one check that raises fails its own
    tests (`got`), not every test of the module through the fixture (a GPU run's 32 errors
    printed no traceback before the timeout cut pytest)."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - reported by the tests that read this check
        return {"error": "".join(traceback.format_exc().splitlines(keepends=True)[-12:])}


def got(measured, *keys):
    """measured[keys[0]][keys[1]]..., failing the test with the check's own traceback where it raised."""
    value = measured
    for key in keys:
        value = value[key]
    if isinstance(value, dict) and set(value) == {"error"}:
        pytest.fail(f"{'/'.join(keys)} raised:\n{value['error']}", pytrace=False)
    return value


def measure(device):
    import kernels_triton as kt
    default = kt.TILES
    if device == "cpu":
        kt.TILES = SMALL_TILES
    cases = {name: attempt(compare, kt, case, device) for name, case in CASES.items()}
    kt.TILES = default  # the tiles a GPU runs (64 x 64 forward, 32 x 32 backward), T not a multiple of them
    cases["default tiles, D = 64, r = 16"] = attempt(compare, kt, DEFAULT_TILES_CASE, device)
    kt.TILES = SMALL_TILES if device == "cpu" else default
    kt.BACKWARD = "fused"  # the one-pass backward: every case again
    fused = {name: attempt(compare, kt, case, device) for name, case in CASES.items()}
    kt.TILES = default
    fused["default tiles, D = 64, r = 16"] = attempt(compare, kt, DEFAULT_TILES_CASE, device)
    kt.TILES, kt.BACKWARD = SMALL_TILES if device == "cpu" else default, "split"
    result = dict(cases=cases, fused=fused, no_key_rows=attempt(no_key_rows, kt, device),
                  compiled_equals_eager=attempt(compiled_equals_eager, kt, device),
                  model=attempt(model_through_the_gpu_path, device))
    default = kt.SCORE_TILES
    if device == "cpu":
        kt.SCORE_TILES = SMALL_SCORE_TILES
    scores = {name: attempt(compare_scores, kt, case, device) for name, case in SCORE_CASES.items()}
    choices = {name: attempt(compare_choices, kt, case, n, device) for name, (case, n) in CHOICES.items()}
    kt.SCORE_TILES = default  # a GPU's tiles: 32 rows, 16 blocks of 4 keys a tile
    scores["default tiles, D = 64"] = attempt(compare_scores, kt, (1, 2, 1, 200, 64, (16, 8, 32), 0, "float32"), device)
    choices["default tiles, D = 64, n = 4"] = attempt(compare_choices, kt, (1, 2, 1, 200, 64, (16, 8, 16), 0, "float32"), 4, device)
    kt.SCORE_TILES = SMALL_SCORE_TILES if device == "cpu" else default
    default = kt.MOBA_TILES
    if device == "cpu":
        kt.MOBA_TILES = SMALL_MOBA_TILES
    moba = {name: attempt(compare_moba, kt, case, device) for name, case in MOBA_CASES.items()}
    kt.MOBA_TILES = default
    moba["default tiles, D = 64, k = 4"] = attempt(compare_moba, kt, (1, 2, 1, 200, 64, 8, 0, 4), device)
    kt.MOBA_TILES = SMALL_MOBA_TILES if device == "cpu" else default
    return dict(result, scores=scores, choices=choices, moba=moba, scores_compiled=attempt(scores_compiled_equal_eager, kt, device),
                mixed_dtypes=attempt(mixed_dtypes_under_autocast, device),
                models={attn: attempt(model_choosing_through_the_kernels, device, attn) for attn in ("nsa", "moba")})


@pytest.fixture(scope="module")
def measured():
    """Every check's numbers: in this process on CUDA, else in a child under Triton's interpreter."""
    pytest.importorskip("triton", reason="triton is not installed (the CPU wheel of torch comes without it): "
                                         "pip install -r requirements-dev.txt")
    if CUDA:
        return measure("cuda")
    r = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "TRITON_INTERPRET": "1", "ASGA_KERNEL": "triton", "SELECTION_KERNEL": "triton"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][-1] == "float32"] + ["default tiles, D = 64, r = 16"])
def test_output_and_every_gradient_equal_the_definition(measured, case):
    """float32: within 2e-6 of the float64 definition, relative to each tensor's largest entry
    (measured: 1e-7 to 1e-6; a dropped term or a swapped gradient is off by O(1))."""
    errors = got(measured, "cases", case)
    assert max(errors.values()) < 2e-6, errors


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][-1] == "bfloat16"])
def test_bf16_inputs_stay_within_bf16s_rounding(measured, case):
    """bf16 q, k, v and gate inputs (their rounding alone moves the result ~1e-2): within 3e-2
    of the float64 definition on the unrounded inputs (measured: 4e-3 to 1.2e-2)."""
    errors = got(measured, "cases", case)
    assert max(errors.values()) < 3e-2, errors


@pytest.mark.parametrize("case", list(CASES) + ["default tiles, D = 64, r = 16"])
def test_the_fused_backward_equals_the_definition_too(measured, case):
    """kernels_triton.BACKWARD = "fused" (one pass over key blocks, the per-row gradients by
    atomic adds): every gradient within the split pair's bounds (float32 2e-6, bf16 3e-2)."""
    errors = got(measured, "fused", case)
    bound = 3e-2 if CASES.get(case, ("float32",))[-1] == "bfloat16" else 2e-6
    assert max(errors.values()) < bound, errors


def test_a_row_that_sees_no_key_gives_zero(measured):
    """Queries before the first key see nothing: output 0 and log-sum-exp -inf, as
    FlexAttention gives; the other rows as the definition."""
    zero, no_lse, rest = got(measured, "no_key_rows")
    assert zero and no_lse and rest < 1e-5, measured["no_key_rows"]


def test_the_op_inside_torch_compile_gives_the_same_gradients(measured):
    """train.py compiles each block: the kernels are custom ops, so a compiled function calls
    them as they are (fullgraph: no graph break) and its gradients are the eager call's;
    inductor asserts each output's strides are the op's fake implementation's (w2's gradient,
    a slice of a padded sum at r = 5, once was not)."""
    assert got(measured, "compiled_equals_eager")


def test_a_model_on_the_gpu_path_runs_these_kernels_and_trains_as_the_definition(measured):
    """kernel='flex' (the GPU path) hands asga's attention to these kernels, and a 2-layer
    model's loss and every parameter's gradient equal attention.py's as written (float32:
    measured ~1e-6; FlexAttention on a CPU has no backward for q, k, v at all)."""
    path, loss_diff, grad_error = got(measured, "model")
    assert path == "triton" and loss_diff < 1e-5 and grad_error < 1e-4, measured["model"]


@pytest.mark.parametrize("case", list(SCORE_CASES) + ["default tiles, D = 64"])
def test_nsa_block_scores_equal_the_torch_form(measured, case):
    """Within 2e-6 of kernels.chunked_block_scores relative to the largest score (measured
    ~1e-7: the online softmax's and the product's rounding; a dropped overlap term, a block
    shifted by one or an unnormalised row is off by O(1)), and the same blocks chosen."""
    error, largest, same_blocks = got(measured, "scores", case)
    assert error < 2e-6 and largest > 0.5 and same_blocks, measured["scores"][case]


@pytest.mark.parametrize("case", list(CHOICES) + ["default tiles, D = 64, n = 4"])
def test_nsa_fused_choice_equals_the_choice_over_the_scores(measured, case):
    """kernels_triton.top_blocks (eq. 10's sum over a key head's query heads, the forced blocks,
    the valid ones, attention.top_n's tie rule, -1 for the slots no valid block fills: what a
    GPU's nsa runs) chooses every slot as attention.nsa_top_blocks over the torch form's scores."""
    assert got(measured, "choices", case), case


def test_nsa_block_scores_inside_torch_compile(measured):
    """A compiled block (train.py's) calls the kernels as custom ops, fullgraph, same results."""
    assert got(measured, "scores_compiled")


def test_nsa_choice_takes_a_float32_q_beside_bf16_keys_under_autocast(measured):
    """As nsa's attend hands them over under bf16 autocast (a GPU run's prefill failed with
    Triton's CompilationError before both were cast to autocast's dtype)."""
    assert got(measured, "mixed_dtypes") is True, measured["mixed_dtypes"]


@pytest.mark.parametrize("case", list(MOBA_CASES) + ["default tiles, D = 64, k = 4"])
def test_moba_choice_equals_the_definition(measured, case):
    """kernels_triton.moba_blocks (eq. 5's scores in float32, the own block forced, the earlier
    ones ranked by attention.top_n's tie rule, -1 where fewer than k are valid) chooses every
    slot as attention.moba_select."""
    assert got(measured, "moba", case), case


@pytest.mark.parametrize("attn", ["nsa", "moba"])
def test_a_model_on_the_gpu_path_chooses_through_the_kernel_and_trains_as_the_definition(measured, attn):
    """kernel='flex' hands nsa's (moba's) choice to its kernel, and a 2-layer model's loss (and
    on CUDA its gradients) equal attention.py's as written (for nsa a block chosen differently
    moved the loss by 4e-5 to 2e-4 at this size: blocks shifted by one, rows not normalised)."""
    path, loss_diff, grad_error = got(measured, "models", attn)
    assert path == "triton" and loss_diff < 1e-5 and grad_error < 1e-4, measured["models"][attn]


def test_the_kernels_compile_for_h100_and_a100_without_spilling():
    """Each kernel at its default tiles (kernels_triton.TILES; the fused backward at bwd_kv's),
    both gate spaces, compiles to sm_90 and sm_80 cubins (Triton's own compiler and ptxas, no GPU needed) without spilling
    registers: the r GELUs per score are what fills them, and a tile or a change that spills
    (32 x 64 backward tiles spill 300-700 bytes on sm_80) runs at local memory's speed."""
    pytest.importorskip("triton", reason="triton is not installed (the CPU wheel of torch comes without it): "
                                         "pip install -r requirements-dev.txt")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import asga_kernel
    import kernels_triton
    rows = asga_kernel.compile_rows([kernels_triton.TILES])
    assert len(rows) == 16 and all(r["error"] is None and r["cubin_bytes"] > 0 for r in rows), rows
    assert all(r["spills"] == (0, 0) for r in rows), [r for r in rows if r["spills"] != (0, 0)]


def test_the_selection_kernels_compile_for_h100_and_a100_without_spilling():
    """nsa's two kernels (scores; scores and choice) at their default tiles
    (kernels_triton.SCORE_TILES), bf16 and float32 inputs, and moba's choice (float32), head
    dims 64 and 128, compile to sm_90 and sm_80 cubins without spilling (64 x 64 tiles at 4 warps spilled 0.4-44 KB with
    float32 inputs), but the choice with float32 inputs at D = 128, which spills 64-176 bytes
    at every tile shape tried (its running top-16 and the merge's 32 int64 keys a row on top
    of the product's registers; training on a GPU runs bf16)."""
    pytest.importorskip("triton", reason="triton is not installed (the CPU wheel of torch comes without it): "
                                         "pip install -r requirements-dev.txt")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import nsa_scores
    rows = nsa_scores.compile_rows()
    assert len(rows) == 20 and all(r["error"] is None and r["cubin_bytes"] > 0 for r in rows), rows
    known = [r for r in rows if (r["kernel"], r["dtype"], r["D"]) == ("choice", "fp32", 128)]
    assert len(known) == 2 and all(sum(r["spills"]) <= 512 for r in known), known
    spilling = [r for r in rows if r["spills"] != (0, 0) and r not in known]
    assert not spilling, spilling


if __name__ == "__main__":  # the child: TRITON_INTERPRET=1 is set, CPU tensors
    print(json.dumps(measure("cpu")))
