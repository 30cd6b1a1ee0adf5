"""The GPU path's FlexAttention calls, put through the part of inductor's CUDA lowering that
runs without a GPU (issue: the headline `train.py --attn=asga` stopped at its first backward
pass on a GPU, and no CPU test could tell).

For every variant and flag whose FLEX path calls FlexAttention, each call's score_mod and
mask_mod are traced as torch.compile traces them on a GPU: dynamo lifts the tensors the
score_mod captures into graph inputs, and AOTAutograd builds the backward graph, whose
`flex_attention_backward` holds the score_mod's joint graph (made by torch's own
`create_fw_bw_graph`). On that joint graph, as inductor's `flex_attention_backward` lowering
does before it generates a kernel (torch 2.13, torch/_inductor/kernel/flex/flex_attention.py):
dead-code elimination, then `validate_joint_graph`, which raises NotImplementedError where a
captured tensor that needs a gradient is indexed more than once. Then, beyond what inductor
checks, the gradient of every captured tensor (`flex_lib.zeros_and_scatter`, an atomic add
per score on a GPU) must be indexed by batch, head and query or key: no element takes more
adds than one query has keys (kernels.per_row).

What this cannot reach on a CPU: Triton's code generation, shared memory and registers.
The README's GPU check command runs those on a GPU node; the whole CUDA compile, run on a
CPU with torch's CUDA build and no GPU, is recorded in benchmarks/gpu_compile/.

q, k, v enter without gradients (FlexAttention refuses a CPU backward for them); the
parameters the score_mods capture keep theirs, which is what the joint graph differentiates.
"""
import dataclasses
import warnings

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
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
# take SDPA; combiner's call captures nothing and is covered by its mask).
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
]
IDS = [f"{a}-" + "-".join(f"{v}" for v in o.values()) for a, o in CONFIGS]


def joint_graphs(attn, flags):
    """The joint graphs of every FlexAttention call in one forward of the variant (FLEX path),
    as AOTAutograd hands them to inductor."""
    cfg = ModelConfig(**dict(PRESETS["tiny"], attn=attn, kernel="flex", **dict(SMALL, **flags)))
    torch.manual_seed(0)
    module = VARIANTS[attn](cfg)
    for p in module.parameters():
        p.data.normal_(0, 0.3)
    found = []

    def capture_backward(gm, example_inputs):
        found.extend(m for name, m in gm.named_children() if name.startswith("joint_graph"))
        return make_boxed_func(gm)

    def traced_flex(q, k, v, score_mod, block_mask, scale):
        def call(q, k, v):
            return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                  enable_gqa=q.shape[1] != k.shape[1])
        backend = aot_autograd(fw_compiler=lambda gm, ex: make_boxed_func(gm), bw_compiler=capture_backward)
        torch._dynamo.reset()
        out = torch.compile(call, backend=backend, fullgraph=True)(q.detach(), k.detach(), v.detach())
        if out.requires_grad:
            out.sum().backward(retain_graph=True)  # builds (and hands over) the backward graph
        return out

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, cfg.n_head, T, cfg.head_dim, generator=g)
    k = torch.randn(1, cfg.n_kv_head, T, cfg.head_dim, generator=g)
    v = torch.randn(1, cfg.n_kv_head, T, cfg.head_dim, generator=g)
    x = torch.randn(1, T, cfg.d_model, generator=g)
    original = kernels._run_flex
    kernels._run_flex = traced_flex
    try:
        module.attend(q, k, v, x, 0, 0)
    finally:
        kernels._run_flex = original
        torch._dynamo.reset()
    return found


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
    graphs = joint_graphs(attn, flags)
    if attn in ("asga", "caa"):  # score_mods that capture parameters: a backward graph exists
        assert graphs, f"{attn} {flags}: no FlexAttention backward graph was traced"
    for gm in graphs:
        gm.graph.eliminate_dead_code()
        validate_joint_graph(gm.graph)  # raises where CUDA's lowering would


@pytest.mark.parametrize("attn,flags", [c for c in CONFIGS if c[0] in ("asga", "caa")],
                         ids=[i for i, c in zip(IDS, CONFIGS) if c[0] in ("asga", "caa")])
def test_captured_gradients_are_per_row(attn, flags):
    """No captured tensor's gradient is a sum over every score of a head (or of all heads):
    each is read by batch, head, and query or key, so one element takes at most one query's
    keys' (or one key's queries') atomic adds on a GPU."""
    graphs = joint_graphs(attn, flags)
    scatters = [idx for gm in graphs for idx in scatter_indices(gm.graph)]
    assert scatters, f"{attn} {flags}: no captured tensor takes a gradient"
    for idx in scatters:
        assert {"b", "h"} <= idx and idx & {"i", "j"}, f"{attn} {flags}: a captured gradient indexed by {sorted(idx)}"


@pytest.mark.parametrize("attn", sorted(VARIANTS))
def test_decoding_does_not_recompile_per_token(attn, monkeypatch):
    """With the compiled FlexAttention path forced on (as on CUDA), a prompt and then 20
    cached decoding steps compile at most twice: decode-sized calls (kernels.DECODE_ROWS)
    run uncompiled, instead of one compile per cache length (dynamo stops at 8). The compiles
    are counted by dynamo with a counting backend (no code generated)."""
    from torch._dynamo.testing import CompileCounter

    import sample
    from model import Model

    counter = CompileCounter()
    torch._dynamo.reset()
    monkeypatch.setattr(kernels, "COMPILE_FLEX", True)
    monkeypatch.setattr(kernels, "_compiled_flex", torch.compile(flex_attention, backend=counter, dynamic=False))
    cfg = ModelConfig(**dict(PRESETS["tiny"], attn=attn, kernel="flex", **SMALL))
    torch.manual_seed(0)
    model = Model(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 40))
    with torch.no_grad():
        sample.generate(model, prompt, 20, temperature=0.0)
    torch._dynamo.reset()
    assert counter.frame_count <= 2, f"{attn}: {counter.frame_count} compiles over 20 decoding steps"
