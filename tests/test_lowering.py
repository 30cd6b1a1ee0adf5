"""The GPU path's FlexAttention calls, put through the part of inductor's CUDA lowering that
runs without a GPU (issue: the headline `train.py --attn=asga` stopped at its first backward
pass on a GPU, and no CPU test could tell).

For every variant and flag whose FLEX path calls FlexAttention, each call is traced as
torch.compile traces it on a GPU: dynamo lifts the tensors the score_mod and mask_mod capture
into graph inputs, AOTAutograd (with inductor's decompositions and partitioner) builds the
backward graph, whose `flex_attention_backward` holds the score_mod's forward graph, its joint
graph (made by torch's own `create_fw_bw_graph`) and the mask_mod's graph. That backward graph
then goes to inductor's own compile_fx_inner, whose `flex_attention_backward` lowering (torch
2.13, torch/_inductor/kernel/flex/flex_attention.py) is the same on CPU and CUDA up to the
choice of a kernel: it lowers the score_mod's forward graph, eliminates dead code in the joint
graph, runs `validate_joint_graph` (NotImplementedError where a captured tensor that needs a
gradient is indexed more than once: asga's first backward on a GPU), lowers the joint graph
and the mask graph, and only then asks which template to use. The test stops it there (the
first question, `_use_flex_flash_attention_backward`) and fails on any error before it. The
forward's own lowering builds the same score_mod and mask_mod graphs with the same
`build_subgraph_buffer` (on CPU it takes the C++ template instead, so it is not run here).

Then, beyond what inductor checks, the gradient of every captured tensor
(`flex_lib.zeros_and_scatter`, an atomic add per score on a GPU) must be indexed by batch,
head and query or key: no element takes more adds than one query has keys (kernels.per_row).

What this cannot reach on a CPU: Triton's code generation, shared memory and registers.
The README's GPU check command runs those on a GPU node; the whole CUDA compile, run on a
CPU with torch's CUDA build and no GPU, is recorded in benchmarks/gpu_compile/.

FlexAttention refuses a CPU backward for q, k, v (`_validate_device`): the guard is lifted
while tracing, as on a GPU q, k, v need gradients; the backward graph is lowered, never run.
"""
import contextlib
import functools
import warnings
from unittest import mock

import pytest
import torch
import torch._inductor.kernel.flex.flex_attention as flex_lowering
import torch.nn.attention.flex_attention as nn_flex
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._guards import detect_fake_mode
from torch._inductor.compile_fx import compile_fx_inner, partition_fn
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.kernel.flex.flex_attention import validate_joint_graph
from torch.nn.attention.flex_attention import flex_attention

import kernels
from attention import VARIANTS
from model import PRESETS, ModelConfig

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")

SMALL = dict(n_head=2, n_kv_head=1, head_dim=16, d_model=32, window=8, caa_window_max=12,
             dsa_threshold=10, asga_hidden=3, caa_hidden=4)
T = 24
# Every configuration whose FLEX path calls FlexAttention ("full" and dsa without a window
# take SDPA).
CONFIGS = [
    ("local", {}),
    ("dsa", dict(dsa_window="adaptive")),
    ("dsa", dict(dsa_window="fixed")),
    ("asga", dict(asga_gate="fixed")),
    ("asga", dict(asga_gate="off")),
    *[("asga", dict(asga_gate="learned", asga_gate_space=g, asga_scale=s))
      for g in ("logit", "prob") for s in (True, False)],
    *[("caa", dict(caa_topk=k)) for k in ("sqrt", "all")],
    ("combiner", {}),
    ("nsa", dict(nsa_block=8, nsa_cmp_block=8, nsa_cmp_stride=4, nsa_window=8, nsa_topk=3)),
    ("moba", dict(moba_block=8, moba_topk=2)),
    ("indexer", dict(index_head_dim=8)),
]
IDS = [f"{a}-" + "-".join(f"{v}" for v in o.values()) for a, o in CONFIGS]
CAPTURING = [c for c in CONFIGS if c[0] in ("asga", "caa")]  # score_mods that capture parameters


class Reached(Exception):
    """Raised where inductor's flex backward lowering picks a kernel: everything before passed."""


def _stop_at_kernel_choice(*args, **kwargs):
    raise Reached


def lower_backward(gm, example_inputs):
    """inductor's compile of a backward graph, up to the choice of FlexAttention's backward
    kernel: None when it got there, else the exception that stopped it."""
    with mock.patch.object(flex_lowering, "_use_flex_flash_attention_backward", _stop_at_kernel_choice):
        try:
            with detect_fake_mode(example_inputs) or contextlib.nullcontext():
                compile_fx_inner(gm, example_inputs, is_backward=True)
        except Exception as e:
            chain = [e]
            while chain[-1].__cause__ or chain[-1].__context__:
                chain.append(chain[-1].__cause__ or chain[-1].__context__)
            if any(isinstance(x, Reached) for x in chain):
                return None
            return chain[-1]
    return RuntimeError("inductor compiled a FlexAttention backward without choosing its kernel")


class _Stop(Exception):
    pass


@functools.lru_cache(maxsize=None)
def flex_calls(attn, flags_items):
    """One forward of the variant (FLEX path) with every FlexAttention call traced as on a GPU:
    [(its joint graphs as AOTAutograd hands them to inductor, the lowering's outcome)]."""
    flags = dict(flags_items)
    cfg = ModelConfig(**dict(PRESETS["tiny"], attn=attn, kernel="flex", **dict(SMALL, **flags)))
    torch.manual_seed(0)
    module = VARIANTS[attn](cfg)
    for p in module.parameters():
        p.data.normal_(0, 0.3)
    calls = []

    def capture_backward(gm, example_inputs):
        joints = [m for name, m in gm.named_children() if name.startswith("joint_graph")]
        # inspected as handed over, before the lowering edits them (dead-code elimination)
        scatters = [scatter_indices(j.graph) for j in joints]
        errors = []
        for j in joints:
            g = torch.fx.Graph()
            g.graph_copy(j.graph, {})
            g.eliminate_dead_code()
            try:
                validate_joint_graph(g)
            except NotImplementedError as e:
                errors.append(e)
        calls.append(dict(scatters=scatters, validate=errors, lowering=lower_backward(gm, example_inputs)))
        raise _Stop

    backend = aot_autograd(fw_compiler=lambda gm, ex: make_boxed_func(gm), bw_compiler=capture_backward,
                           partition_fn=partition_fn, decompositions=select_decomp_table())

    def traced_flex(q, k, v, score_mod, block_mask, scale, lse=False, kernel_options=None):
        def call(q, k, v):
            out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                 enable_gqa=q.shape[1] != k.shape[1], kernel_options=kernel_options,
                                 return_aux=nn_flex.AuxRequest(lse=True) if lse else None)
            return (out[0], out[1].lse) if lse else out
        torch._dynamo.reset()
        qc, kc, vc = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = torch.compile(call, backend=backend, fullgraph=True)(qc, kc, vc)
        try:  # the lse's gradient (a merge by log-sum-exp) enters the backward kernel too
            sum(o.sum() for o in (out if lse else (out,))).backward()  # capture_backward stops it
        except _Stop:
            pass
        except Exception as e:
            if not any(isinstance(x, _Stop) for x in (e, e.__cause__, e.__context__)):
                raise
        return (out[0].detach(), out[1].detach()) if lse else out.detach()

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, cfg.n_head, T, cfg.head_dim, generator=g)
    k = torch.randn(1, cfg.n_kv_head, T, cfg.head_dim, generator=g)
    v = torch.randn(1, cfg.n_kv_head, T, cfg.head_dim, generator=g)
    x = torch.randn(1, T, cfg.d_model, generator=g)
    with mock.patch.object(kernels, "_run_flex", traced_flex), \
            mock.patch.object(nn_flex, "_validate_device", lambda *a: None):
        try:
            module.attend(q, k, v, x, 0, 0)
        finally:
            torch._dynamo.reset()
    return calls


def scatter_indices(graph):
    """For each captured tensor's gradient in a joint graph: the names of the score_mod's
    index arguments (b, h, i, j) its index reads."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    names = {placeholders[1]: "b", placeholders[2]: "h", placeholders[3]: "i", placeholders[4]: "j"}
    out = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.flex_lib.zeros_and_scatter.default:
            out.append({names[a] for a in node.args[1] if a in names})
    return out


@pytest.mark.parametrize("attn,flags", CONFIGS, ids=IDS)
def test_flex_backward_lowering_accepts_every_score_mod(attn, flags):
    """inductor's flex backward lowering gets to its choice of kernel for every call: the
    score_mod's forward and joint graphs and the mask_mod's graph lowered, the joint graph
    validated (what CUDA's first backward of asga raised)."""
    calls = flex_calls(attn, tuple(flags.items()))
    assert calls, f"{attn} {flags}: no FlexAttention call was traced (this test covers only variants that make one)"
    for n, call in enumerate(calls):
        for e in call["validate"]:
            raise AssertionError(f"{attn} {flags}, call {n}: validate_joint_graph: {e}")
        if call["lowering"] is not None:
            e = call["lowering"]
            raise AssertionError(f"{attn} {flags}, call {n}: inductor's flex backward lowering failed: "
                                 f"{type(e).__name__}: {str(e).strip()[:500]}")


@pytest.mark.parametrize("attn,flags", CAPTURING, ids=[i for i, c in zip(IDS, CONFIGS) if c in CAPTURING])
def test_captured_gradients_are_per_row(attn, flags):
    """No captured tensor's gradient is a sum over every score of a head (or of all heads):
    each is read by batch, head, and query or key, so one element takes at most one query's
    keys' (or one key's queries') atomic adds on a GPU."""
    calls = flex_calls(attn, tuple(flags.items()))
    scatters = [idx for call in calls for joint in call["scatters"] for idx in joint]
    assert scatters, f"{attn} {flags}: no captured tensor takes a gradient"
    for idx in scatters:
        assert {"b", "h"} <= idx and idx & {"i", "j"}, f"{attn} {flags}: a captured gradient indexed by {sorted(idx)}"


@pytest.mark.parametrize("attn", sorted(VARIANTS))
def test_decoding_does_not_recompile_per_token(attn, monkeypatch):
    """With the compiled GPU path forced on (as on CUDA: FlexAttention), a prompt and then 20 cached decoding steps compile at most twice:
    decode-sized calls (kernels.DECODE_ROWS) run kernels.DECODE, uncompiled, instead of one
    compile per cache length (dynamo stops at 8). The compiles are counted by dynamo with a counting
    backend (no code generated); the indexer's prompt is seen compiling its FlexAttention call."""
    from torch._dynamo.testing import CompileCounter

    import sample
    from model import Model

    counter = CompileCounter()
    torch._dynamo.reset()
    monkeypatch.setattr(kernels, "COMPILE_FLEX", True)
    monkeypatch.setattr(kernels, "_compiled", {})  # FlexAttention, compiled by the counter
    monkeypatch.setattr(kernels, "compile_fn", lambda fn: torch.compile(fn, backend=counter, dynamic=False))
    cfg = ModelConfig(**dict(PRESETS["tiny"], attn=attn, kernel="flex", **SMALL))
    torch.manual_seed(0)
    model = Model(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 40))
    with torch.no_grad():
        sample.generate(model, prompt, 20, temperature=0.0)
    torch._dynamo.reset()
    assert counter.frame_count <= 2, f"{attn}: {counter.frame_count} compiles over 20 decoding steps"
    if attn == "indexer":
        assert counter.frame_count >= 1, "the indexer's FlexAttention call was not compiled for the prompt"


def _prefill_lengths(monkeypatch, lengths, limit=None):
    """Prefill a `local` model (one FlexAttention call a layer) at each length with the GPU
    path's compile forced on, compiled by a counting backend; the counter."""
    from torch._dynamo.testing import CompileCounter

    from model import Model

    counter = CompileCounter()
    torch._dynamo.reset()
    monkeypatch.setattr(kernels, "COMPILE_FLEX", True)
    monkeypatch.setattr(kernels, "_compiled", {})
    monkeypatch.setattr(kernels, "compile_fn", lambda fn: torch.compile(fn, backend=counter, dynamic=False))
    if limit is not None:
        monkeypatch.setattr(kernels, "RECOMPILE_LIMIT", limit)
    cfg = ModelConfig(**dict(PRESETS["tiny"], attn="local", kernel="flex", n_layer=1, **SMALL))
    torch.manual_seed(0)
    model = Model(cfg).eval()
    try:
        with torch.no_grad():
            for n in lengths:
                model(torch.randint(0, cfg.vocab_size, (1, n)), cache=model.new_cache())
    finally:
        torch._dynamo.reset()
    return counter


def test_a_process_compiles_flex_attention_for_more_than_eight_lengths(monkeypatch):
    """Each new prompt length compiles FlexAttention again (dynamic=False). Past dynamo's own
    limit of 8 compiles it ran the call uncompiled, silently, which on a GPU materialises the
    (T, S) scores (an H100 ran out of memory so at T = 32768): every length here compiles."""
    lengths = list(range(20, 31))
    counter = _prefill_lengths(monkeypatch, lengths)
    assert counter.frame_count == len(lengths), f"{counter.frame_count} compiles for {len(lengths)} lengths"


def test_past_the_recompile_limit_the_call_fails_instead_of_running_uncompiled(monkeypatch):
    with pytest.raises(RuntimeError, match="kernels.RECOMPILE_LIMIT"):
        _prefill_lengths(monkeypatch, [20, 21, 22], limit=2)


def test_pair_gate_kernels_get_small_tiles(monkeypatch):
    """asga's score_mod runs r = 16 GELUs per score: at inductor's default tiles (128 x 128
    forward on an H100, 128 scores a thread) its forward kernel's PTX was 14.8 MB and ptxas
    ran over an hour. Its FlexAttention call must ask for tiles of at most 16 scores a thread,
    forward and backward, that inductor accepts (its block-sparse tiles of 128 divisible by them)."""
    seen = {}

    def spy(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, kernel_options=None):
        seen["options"] = kernel_options
        return torch.zeros_like(q)

    monkeypatch.setattr(kernels, "flex_attention", spy)
    monkeypatch.setattr(kernels, "COMPILE_FLEX", False)
    B, H, T, D, r = 1, 2, 40, 16, 4
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    kernels.flex_pair_gated_attention(q, k, v, torch.randn(B, H, T, r), torch.randn(B, H, T, r),
                                      torch.randn(H, r), torch.randn(H), 0.25, 0, 0)
    o = seen["options"]
    assert o["fwd_BLOCK_M"] * o["fwd_BLOCK_N"] <= 16 * 32 * o["fwd_num_warps"]
    assert o["bwd_BLOCK_M1"] * o["bwd_BLOCK_N1"] <= 16 * 32 * o["bwd_num_warps"]
    assert o["bwd_BLOCK_M2"] * o["bwd_BLOCK_N2"] <= 16 * 32 * o["bwd_num_warps"]
    assert 128 % o["fwd_BLOCK_N"] == 0 and 128 % o["fwd_BLOCK_M"] == 0 and 128 % o["bwd_BLOCK_M2"] == 0
    assert o["bwd_BLOCK_N1"] % o["bwd_BLOCK_M1"] == 0 and o["bwd_BLOCK_M2"] % o["bwd_BLOCK_N2"] == 0
