"""asga's gate tile (kernels.GateTile): the compiled tile equals the eager one, forward and
backward; the whole asga op through the compiled tile passes the parity test against the
reference (tests/test_kernels.py's `check`); and where torch.compile fails the eager tile
runs, says so once, and gives the same result; and each CPU capability compiles into its own
inductor cache (kernels.inductor_cache_per_cpu_capability)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import GateTile
from test_kernels import check, make_module


@pytest.fixture
def compiled(monkeypatch):
    """The compiled tile on (the suite turns it off, conftest.py), restored afterwards."""
    monkeypatch.setattr(GateTile, "COMPILE", True)
    monkeypatch.setattr(GateTile, "path", None)
    yield
    if GateTile._compiled is False:  # a forced failure must not leak into the next test
        GateTile._compiled = None


def tile_inputs(G, r, bq, c, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for shape in ((G, r, bq), (G, r, c), (G, r), (G, bq, c))]


def reference_grads(qt, kt, w2, dz):
    """Autograd of sum(dz * z), z written out: sum_r w2 GELU(qt + kt)."""
    qt, kt, w2 = (t.clone().requires_grad_(True) for t in (qt, kt, w2))
    z = (F.gelu(qt[:, :, :, None] + kt[:, :, None, :]) * w2[:, :, None, None]).sum(1)
    return (z, *torch.autograd.grad((z * dz).sum(), (qt, kt, w2)))


@pytest.mark.parametrize("G,r,bq,c", [(3, 4, 64, 37), (2, 5, 3, 1), (4, 16, 17, 130)])
def test_compiled_gate_tile_equals_eager(compiled, G, r, bq, c):
    qt, kt, w2, dz = tile_inputs(G, r, bq, c)
    z_ref, dqt_ref, dkt_ref, dw2_ref = reference_grads(qt, kt, w2, dz)
    for compile_ in (True, False):
        GateTile.COMPILE = compile_
        tile = GateTile(qt, kt, w2, n_buffers=3)
        assert (tile.compiled is not None) == compile_ or GateTile.path.startswith("eager (torch.compile failed")
        z = tile.logits(0, bq, 0, c)
        dqt, dkt, dw2 = tile.grads(dz)
        assert GateTile.path.startswith("compiled" if compile_ else "eager"), GateTile.path
        torch.testing.assert_close(z, z_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dqt * w2[:, :, None], dqt_ref, rtol=1e-4, atol=1e-5)  # w2 left out of the tile
        torch.testing.assert_close(dkt * w2[:, :, None], dkt_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(dw2, dw2_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("space", ["logit", "prob"])
def test_asga_through_the_compiled_tile_equals_reference(compiled, space):
    module = make_module("asga", asga_gate_space=space, window=100)
    for T in (7, 129):  # a partial block; 129 = 2 blocks + 1 query
        check(module, T)
    check(module, 7, p0=300, k0=150)  # after cached keys
    assert GateTile.path == "compiled (torch.compile)"


def test_a_failed_compile_falls_back_to_the_eager_tile(compiled, monkeypatch, capsys):
    def broken(*args, **kwargs):
        def fails(*a, **k):
            raise RuntimeError("no C++ compiler (forced by the test)")
        return fails

    monkeypatch.setattr(GateTile, "_compiled", None)
    monkeypatch.setattr(kernels.torch, "compile", broken)
    module = make_module("asga", window=100)
    check(module, 70)
    check(module, 7)
    assert GateTile.path.startswith("eager (torch.compile failed: RuntimeError: no C++ compiler")
    said = [line for line in capsys.readouterr().err.splitlines() if "gate tile" in line]
    assert len(said) == 1, said  # said once


def test_each_cpu_capability_compiles_into_its_own_cache():
    """Importing kernels points inductor's cache at a directory of the CPU capability ATen
    runs at (kernels.inductor_cache_per_cpu_capability: torch loads one capability's graphs
    under another and computes garbage), and leaves a directory the user set alone."""
    root = Path(__file__).resolve().parent.parent
    show = "import os, kernels; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"

    def cache_dir(**env):
        base = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY")}
        out = subprocess.run([sys.executable, "-c", show], cwd=root, env={**base, **env},
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()

    dirs = {cap: cache_dir(ATEN_CPU_CAPABILITY=cap) for cap in ("default", "avx2")}
    assert dirs["default"].endswith("-default") and dirs["avx2"].endswith("-avx2"), dirs
    assert dirs["default"][:-len("default")] == dirs["avx2"][:-len("avx2")]  # beside each other
    assert cache_dir(ATEN_CPU_CAPABILITY="avx2", TORCHINDUCTOR_CACHE_DIR="/tmp/mine") == "/tmp/mine"


def test_decoding_through_the_compiled_gate_equals_reference(compiled):
    """A decoding step's gate (kernels.decode_pair_gated_attention) through the compiled tile,
    over the per-key terms the cache keeps along the keys (model.Rows, keys_last): a prefill
    then one-token steps, at batch 1 and then with the cache repeated to batch 3, give the
    reference's uncached logits."""
    from test_kernels import tiny_model

    idx = torch.randint(0, 512, (1, 90), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, _ = tiny_model("asga", "ref")(idx)
        model = tiny_model("asga", "fused")
        cache = model.new_cache()
        got = [model(idx[:, :60], cache=cache)[0]]
        got += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(60, 80)]
        term = cache[0].summaries[0].view()
        assert term.stride(-2) == 1, "asga's per-key terms are stored along the keys"
        for layer in cache:
            layer.repeat_batch(3)
        batched = [model(idx[:, t:t + 1].expand(3, 1), cache=cache)[0] for t in range(80, 90)]
    assert GateTile.path == "compiled (torch.compile)"
    got = torch.cat(got, 1)
    assert (got - want[:, :80]).abs().max() < 1e-4 * want.abs().max()
    for b in range(3):
        assert (torch.cat(batched, 1)[b] - want[0, 80:]).abs().max() < 1e-4 * want.abs().max()
