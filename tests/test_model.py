"""The model and the reference attention variants: causality, exact windows,
reductions to `full`, top-k counts, gate gradients, learning, odd lengths, and parity with
Hugging Face's Qwen3."""
import dataclasses
import math
from pathlib import Path

import pytest
import torch

import attention
from attention import VARIANTS, allowed, rope_cos_sin, topk_mask
from conftest import requires_gpt2
from model import PRESETS, Model, ModelConfig

SMALL_VOCAB = 512  # enough for structural tests; learning tests use GPT-2's real vocabulary
# kernel="ref": this file tests attention.py as written; tests/test_kernels.py holds the fast
# paths to it, output and gradient.
WINDOWS = dict(window=6, caa_window_max=12, dsa_threshold=512, kernel="ref")

# Every variant with every ablation flag (ablations are flags of these classes, not classes).
CONFIGS = [
    ("full", {}),
    ("local", {}),
    *[("dsa", dict(dsa_gate=g, dsa_window=w)) for g in (True, False) for w in ("adaptive", "fixed", "none")],
    *[("asga", dict(asga_gate=g, asga_scale=s)) for g in ("learned", "fixed", "off") for s in (True, False)],
    ("asga", dict(asga_gate="learned", asga_gate_space="prob")),
    ("caa", dict(caa_gate_norm=True)),
    *[("caa", dict(caa_gate=g, caa_topk=k)) for g in ("learned", "local", "global") for k in ("sqrt", "all")],
]
IDS = [f"{a}-" + "-".join(f"{v}" for v in o.values()) for a, o in CONFIGS]


def make_model(attn, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = dict(PRESETS["tiny"], vocab_size=SMALL_VOCAB, attn=attn, **WINDOWS)
    cfg.update(overrides)
    return Model(ModelConfig(**cfg)).eval()


def make_attention(attn, seed=0, **overrides):
    """One attention module with its inputs, for tests that look inside a single layer."""
    cfg = dict(PRESETS["tiny"], attn=attn, **WINDOWS)
    cfg.update(overrides)
    cfg = ModelConfig(**cfg)
    torch.manual_seed(seed)
    module = VARIANTS[attn](cfg)
    for p in module.parameters():  # non-trivial weights everywhere, gates included
        p.data.normal_(0, 0.3)
    return module, cfg


def run_attention(module, cfg, x):
    pos = torch.arange(x.shape[1])
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)
    return module(x, cos, sin, 0)


def perturb_after(idx, t, vocab=SMALL_VOCAB):
    other = idx.clone()
    other[:, t + 1:] = (idx[:, t + 1:] + 1 + torch.randint(0, vocab - 1, idx[:, t + 1:].shape)) % vocab
    return other


@pytest.mark.parametrize("attn,overrides", CONFIGS, ids=IDS)
def test_causal_and_prefix_invariant(attn, overrides):
    """Logits at positions <= t never depend on tokens after t, nor on whether they exist.
    dsa runs past its 512-token switch so the adaptive rule is checked on both sides."""
    T = 530 if attn == "dsa" else 40
    model = make_model(attn, **overrides)
    idx = torch.randint(0, SMALL_VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, _ = model(idx)
        for t in ([5, 100, 515] if attn == "dsa" else [5, 23]):
            changed, _ = model(perturb_after(idx, t))
            assert (changed[:, : t + 1] - logits[:, : t + 1]).abs().max() < 1e-6
            assert (changed[:, t + 1:] - logits[:, t + 1:]).abs().max() > 1e-4  # the check can see change
            prefix, _ = model(idx[:, : t + 1])
            assert (prefix - logits[:, : t + 1]).abs().max() < 1e-6


@pytest.mark.parametrize("attn,overrides,query", [
    ("local", {}, 30),
    ("asga", dict(asga_gate="fixed"), 30),
    ("dsa", dict(dsa_window="fixed"), 30),
    ("dsa", dict(dsa_window="adaptive", dsa_threshold=20), 30),
])
def test_window_is_exact(attn, overrides, query):
    """A key more than `window` back has no influence on a query; a key exactly `window`
    back does."""
    module, cfg = make_attention(attn, **overrides)
    x = torch.randn(1, 40, cfg.d_model)
    with torch.no_grad():
        base = run_attention(module, cfg, x)
        for dist, moves in [(cfg.window + 1, False), (cfg.window + 5, False), (cfg.window, True)]:
            x2 = x.clone()
            x2[:, query - dist] += torch.randn(cfg.d_model)
            diff = (run_attention(module, cfg, x2)[:, query] - base[:, query]).abs().max()
            assert (diff > 1e-4) if moves else (diff == 0), (dist, diff)


def test_adaptive_window_switches_at_threshold():
    """dsa's adaptive window = the unwindowed version before position 512, the windowed after."""
    T = 600
    outs = {}
    x = torch.randn(1, T, PRESETS["tiny"]["d_model"], generator=torch.Generator().manual_seed(3))
    for mode in ("adaptive", "fixed", "none"):
        module, cfg = make_attention("dsa", dsa_window=mode, window=64, dsa_threshold=512)
        with torch.no_grad():
            outs[mode] = run_attention(module, cfg, x)
    assert (outs["adaptive"][:, :512] - outs["none"][:, :512]).abs().max() < 1e-6
    assert (outs["adaptive"][:, 512:] - outs["fixed"][:, 512:]).abs().max() < 1e-6
    assert (outs["fixed"][:, :512] - outs["none"][:, :512]).abs().max() > 1e-4  # they do differ


@pytest.mark.parametrize("attn,overrides", [
    ("asga", dict(asga_gate="off", asga_scale=False)),
    ("dsa", dict(dsa_gate=False, dsa_window="none")),
    ("caa", dict(caa_gate="global", caa_topk="all")),
])
def test_reduces_to_full(attn, overrides):
    """With every extra off, a variant computes `full` exactly, given the same weights."""
    full = make_model("full", seed=0)
    for p in full.parameters():
        p.data.normal_(0, 0.2)
    variant = make_model(attn, seed=1, **overrides)
    missing, unexpected = variant.load_state_dict(full.state_dict(), strict=False)
    assert not unexpected
    idx = torch.randint(0, SMALL_VOCAB, (2, 50))
    with torch.no_grad():
        assert (variant(idx)[0] - full(idx)[0]).abs().max() < 1e-5


def test_caa_global_branch_keeps_ceil_sqrt_keys():
    """Query i keeps exactly ceil(sqrt(i + 1)) keys, the highest-scoring ones, and only
    those keys' values reach its output."""
    module, cfg = make_attention("caa", caa_gate="global")
    T = 70
    k_per_query, _ = module.k_per_query(0, T, "cpu")
    logits = torch.randn(1, cfg.n_head, T, T)
    causal = allowed(T, T, 0, 0, "cpu")
    keep = topk_mask(logits, causal, k_per_query)
    expected = torch.tensor([math.ceil(math.sqrt(i + 1)) for i in range(T)])
    assert torch.equal(keep.sum(-1), expected.expand(1, cfg.n_head, T))
    assert not (keep & ~causal).any()
    # the kept keys are the top scores: every kept score >= every visible dropped score
    visible = logits.masked_fill(~causal, float("-inf"))
    lowest_kept = visible.masked_fill(~keep, float("inf")).min(-1).values
    highest_dropped = visible.masked_fill(keep, float("-inf")).max(-1).values
    assert (lowest_kept >= highest_dropped).all()

    # through the module: changing the value of a dropped key leaves the output alone
    q, k, v = (torch.randn(1, cfg.n_head, T, cfg.head_dim) for _ in range(3))
    x = torch.randn(1, T, cfg.d_model)
    with torch.no_grad():
        scores = (q @ k.transpose(-2, -1)) * module.scale
        keep = topk_mask(scores, causal, k_per_query)
        base = module.attend(q, k, v, x, 0, 0)
        i, h = 60, 0
        dropped = (~keep[0, h, i] & causal[i]).nonzero()[0].item()
        kept = keep[0, h, i].nonzero()[0].item()
        for j, moves in [(dropped, False), (kept, True)]:
            v2 = v.clone()
            v2[0, h, j] += 1.0
            diff = (module.attend(q, k, v2, x, 0, 0)[0, h, i] - base[0, h, i]).abs().max()
            assert (diff > 1e-4) if moves else (diff == 0)


GATE_PARAMS = ("head_gate", "gamma", "w1_q", "w1_k", "b1", "w2", "b2", "mix_gate", "width", "branch_gate", "indexer")


@pytest.mark.parametrize("attn", list(VARIANTS))
def test_every_parameter_gets_gradient(attn):
    """Every learned gate and scale parameter (and every other one) receives a non-zero
    gradient from the LM loss (indexer's lightning indexer: from its own KL loss, which
    train.py adds)."""
    model = make_model(attn, window=4, caa_window_max=8).train()
    idx = torch.randint(0, SMALL_VOCAB, (2, 33))
    _, loss = model(idx[:, :-1], idx[:, 1:])
    (loss + (model.indexer_loss() or 0)).backward()
    gate_params = 0
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, name
        gate_params += any(g in name for g in GATE_PARAMS)
    assert gate_params > 0 or attn in ("full", "local", "combiner", "moba")  # no parameters of their own


@requires_gpt2
@pytest.mark.parametrize("attn", list(VARIANTS))
def test_init_loss_and_learns_a_batch(attn, english_text):
    """At init the loss on random tokens is ~ln(vocab); a few dozen AdamW steps on one batch
    of real English text (GPT-2 tokens) at least halve it."""
    import tiktoken

    torch.manual_seed(0)
    cfg = ModelConfig(**PRESETS["tiny"], attn=attn, window=16, caa_window_max=32, dsa_threshold=32, kernel="ref")
    model = Model(cfg)
    rand = torch.randint(0, 50257, (4, 65))
    with torch.no_grad():
        _, loss0 = model(rand[:, :-1], rand[:, 1:])
    assert abs(loss0.item() - math.log(cfg.vocab_size)) < 0.3

    tokens = torch.tensor(tiktoken.get_encoding("gpt2").encode_ordinary(english_text)[:97])[None]
    x, y = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        _, loss = model(x, y)
        first = first or loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first / 2, (first, loss.item())


@pytest.mark.parametrize("attn", list(VARIANTS))
def test_odd_lengths(attn):
    """T = 1, 7, 300, 777: forward and backward run and give finite values of the right shape."""
    model = make_model(attn, window=64, caa_window_max=128, dsa_threshold=256, n_head=2, n_kv_head=2).train()
    for T in (1, 7, 300, 777):
        idx = torch.randint(0, SMALL_VOCAB, (1, T + 1))
        logits, loss = model(idx[:, :-1], idx[:, 1:])
        assert logits.shape == (1, T, SMALL_VOCAB) and torch.isfinite(logits).all()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        model.zero_grad()


def test_bad_config_names_the_valid_choices():
    with pytest.raises(ValueError, match="full, local, dsa, asga, caa"):
        ModelConfig(attn="flash")
    with pytest.raises(ValueError, match="n_kv_head"):
        ModelConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="asga_gate_space='probability' is not one of: logit, prob"):
        ModelConfig(asga_gate_space="probability")


def test_qwen_134m_parameter_count():
    """The papers' stated model size, counted the way `python model.py` prints it."""
    with torch.device("meta"):
        n = Model(ModelConfig(**PRESETS["qwen-134m"])).num_params()
    assert 130e6 <= n <= 140e6, n


def test_meta_model_is_the_runs_model_without_loading_dynamo():
    """config.meta_model_of (train.py's plan counts its parameters): every variant's parameter
    names and shapes as Model builds them, and no torch._dynamo import on the way (a meta
    tensor's random fill imports it: ~3 s of a dry run's 7-8). The import is watched
    in a fresh process: this one may have loaded it already."""
    import subprocess
    import sys

    import config
    for attn in VARIANTS:
        cfg = ModelConfig(**dict(PRESETS["tiny"], attn=attn))
        meta = {n: (p.shape, p.device.type) for n, p in config.meta_model_of(cfg).named_parameters()}
        real = {n: (p.shape, "meta") for n, p in Model(cfg).named_parameters()}
        assert meta == real, attn
    code = ("import sys, config; from model import ModelConfig, PRESETS\n"
            "for attn in ('full', 'nsa', 'indexer', 'asga'):\n"
            "    config.meta_model_of(ModelConfig(**dict(PRESETS['qwen-134m'], attn=attn)))\n"
            "print('torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(config.__file__).parent, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "False", "building a meta model imported torch._dynamo"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_qwen3s_formula_to_the_bit(dtype):
    """RMSNorm runs F.rms_norm (one fused kernel on a GPU); on a CPU that is Qwen3's formula,
    x / sqrt(mean(x^2) + eps) in float32, cast back, times the weight: the same output and
    gradients, bit for bit, in float32 and bf16 (an eps dropped or the weight applied before
    the cast would show)."""
    torch.manual_seed(0)
    norm = attention.RMSNorm(48, eps=0.25)
    norm.weight.data.uniform_(0.5, 1.5)
    x = (torch.randn(3, 5, 48) * 0.4).to(dtype).requires_grad_()
    y = norm(x)
    x2 = x.detach().clone().requires_grad_()
    xf = x2.float()
    ref = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 0.25)).to(dtype)
    assert y.dtype == ref.dtype and torch.equal(y, ref)
    dy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, norm.weight), dy)
    gx2, gw2 = torch.autograd.grad(ref, (x2, norm.weight), dy)
    assert torch.equal(gx, gx2) and torch.equal(gw, gw2)


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_matches_huggingface_qwen3(n_kv_head):
    """Same weights, same logits as transformers' Qwen3ForCausalLM (eps, RoPE convention,
    norm-before-RoPE order, GQA)."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only "
                                       "dependency for this parity check (pip install transformers)")
    cfg = ModelConfig(**dict(PRESETS["tiny"], n_kv_head=n_kv_head), vocab_size=SMALL_VOCAB, rope_theta=1e6)
    torch.manual_seed(0)
    ours = Model(cfg).eval()
    for p in ours.parameters():
        p.data.normal_(0, 0.1)
    hf_cfg = transformers.Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_hidden,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=True, attention_bias=False, max_position_embeddings=4096,
        attn_implementation="eager")
    hf_cfg.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    hf = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    state = {("" if k.startswith("lm_head") else "model.") + k: v for k, v in ours.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    idx = torch.randint(0, SMALL_VOCAB, (2, 37))
    with torch.no_grad():
        diff = (hf(idx).logits - ours(idx)[0]).abs().max()
    assert diff < 1e-5, diff


def one_layer(attn, **flags):
    torch.manual_seed(0)
    cfg = dict(PRESETS["tiny"], vocab_size=SMALL_VOCAB, n_layer=1, attn=attn, **dict(WINDOWS, **flags))
    model = Model(ModelConfig(**cfg)).eval()
    for name, p in model.named_parameters():
        if "self_attn" in name and "proj" not in name and "norm" not in name:
            p.data.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("attn,flags,moves", [
    ("asga", dict(asga_gate="fixed"), False),
    ("asga", dict(asga_gate="learned"), True),
    ("full", {}, True),
])
def test_asga_fixed_gate_is_a_mask(attn, flags, moves):
    """One layer, so the receptive field is the window: with asga_gate='fixed' a token more
    than W back cannot change the output at i; with the learned gate and with `full` it does."""
    model = one_layer(attn, **flags)
    idx = torch.randint(0, SMALL_VOCAB, (1, 30), generator=torch.Generator().manual_seed(7))
    i, W = 29, WINDOWS["window"]
    other = idx.clone()
    other[0, i - W - 1] = (idx[0, i - W - 1] + 1) % SMALL_VOCAB
    with torch.no_grad():
        diff = (model(other)[0][0, i] - model(idx)[0][0, i]).abs().max()
    assert (diff > 1e-5) if moves else (diff == 0), diff


@pytest.mark.parametrize("kernel", ["ref", "fused", "flex"])
def test_asga_probability_space_gate(kernel):
    """asga_gate_space='prob': the weights are exp(alpha) * s renormalised (checked against a
    direct computation through v = identity), and with s = 1 it equals the default."""
    module, cfg = make_attention("asga", asga_gate="learned", asga_gate_space="prob", kernel=kernel)
    T = cfg.head_dim  # v = identity: the fused paths want values as wide as queries
    g = torch.Generator().manual_seed(8)
    q, k = (torch.randn(1, cfg.n_head, T, cfg.head_dim, generator=g) for _ in range(2))
    x = torch.randn(1, T, cfg.d_model, generator=g)
    eye = torch.eye(T).expand(1, cfg.n_kv_head, T, T)
    with torch.no_grad():
        weights = module.attend(q, k, eye, x, 0, 0)  # (1, H, T, T): the mixing weights
        alpha = (q @ k.transpose(-2, -1)) * module.scale * torch.nn.functional.softplus(module.gamma)[None, :, None, None]
        s = torch.sigmoid(attention.pair_gate_logit(*module.pair_terms(q, k), module.w2, module.b2))
        direct = torch.exp(alpha - alpha.max()) * s * allowed(T, T, 0, 0, "cpu")
        direct = direct / direct.sum(-1, keepdim=True)
        assert (weights - direct).abs().max() < 1e-5
        assert (weights.sum(-1) - 1).abs().max() < 1e-5
        module.b2.fill_(100.0)  # s = sigmoid(100 + ...) = 1 in float32
        module.w2.zero_()
        prob = module.attend(q, k, eye, x, 0, 0)
        module.cfg = dataclasses.replace(module.cfg, asga_gate_space="logit")
        logit = module.attend(q, k, eye, x, 0, 0)
    assert (prob - logit).abs().max() < 1e-6


def test_dsa_configurations_masks():
    """dsa_window='fixed' ([DSA]): every query windowed; 'adaptive' ([DSA-A]): queries at
    positions < dsa_threshold see every earlier key, later ones the window; 'none': causal."""
    T, W, threshold = 40, 6, 20
    masks = {}
    for mode in ("fixed", "adaptive", "none"):
        module, cfg = make_attention("dsa", dsa_window=mode, window=W, dsa_threshold=threshold)
        window, window_from = module.window()
        masks[mode] = allowed(T, T, 0, 0, "cpu", window, window_from)
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    assert torch.equal(masks["fixed"], (j <= i) & (i - j <= W))
    assert torch.equal(masks["none"], j <= i)
    assert torch.equal(masks["adaptive"], (j <= i) & ((i - j <= W) | (i < threshold)))


def test_forward_reads_no_tensor_back(monkeypatch):
    """Positions are Python ints: a forward, cached or not, never converts a tensor to a
    Python number (a host sync on a GPU). Checked by making those conversions fail."""
    model = make_model("dsa", dsa_threshold=10)
    cache = model.new_cache()
    idx = torch.randint(0, SMALL_VOCAB, (1, 20))

    def read_back(self, *args):
        raise AssertionError("a tensor was read back to the host")

    for name in ("__int__", "__index__", "__bool__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, read_back)
    with torch.no_grad():
        model(idx[:, :12], cache=cache)
        model(idx[:, 12:13], cache=cache)
        model(idx)


@pytest.mark.parametrize("attn,overrides,graphs", [("local", {}, 1), ("moba", dict(moba_full_last=1), 2)])
def test_compile_blocks_traces_one_layer_for_all(attn, overrides, graphs):
    """model.compile_blocks (train.py's compile): dynamo traces Block.forward once and all
    n_layer blocks reuse that graph, one per block class (moba_full_last's full layers: a
    second); each graph holds one layer's 7 projections (q, k, v, o, gate, up, down), not the
    whole model's; the tail (norm, head, loss) is one more graph, with the head's projection.
    The view trains the same weights to the same loss and gradients as the
    eager model, which itself stays uncompiled, with the same state dict."""
    from model import compile_blocks
    model = make_model(attn, n_layer=3, **overrides).train()
    keys = list(model.state_dict())
    traced = []

    def backend(gm, example_inputs):
        traced.append(sum(n.target is torch.nn.functional.linear for n in gm.graph.nodes))
        return gm.forward

    view = compile_blocks(model, backend=backend)
    idx = torch.randint(0, SMALL_VOCAB, (2, 41), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    losses, grads = [], []
    for run in (model, view):
        _, loss = run(idx[:, :-1], idx[:, 1:])
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    assert traced == [7] * graphs + [1], traced
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))
    assert all(a is b for a, b in zip(model.parameters(), view.parameters()))
    assert all(type(layer).__name__ == "Block" for layer in model.layers) and list(model.state_dict()) == keys
