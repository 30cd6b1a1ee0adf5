"""What an eager decoding step launches on a GPU, counted on a CPU: every variant's one-token
step (benchmarks/decode.py's model: qwen-134m's widths, 2 layers, batch 1) run on fake CUDA
tensors, each aten op it dispatches that computes a tensor on the GPU counted (views left out).

    python benchmarks/gpu_launches.py                         # T = 2048, every variant
    python benchmarks/gpu_launches.py --lengths=2048,8192 --variants=full,nsa --bf16

On a GPU an eager step costs its launches (a 2-layer `full` step took 2.4-4 ms at any cache
length on an H100 and an H200, and each sparse step's time over `full`'s followed its ops
over `full`'s: benchmarks/gpu_runs/h200_2026-11-28b.md), so this count is what an eager GPU
step costs, known without a GPU. It needs torch's CUDA build (the GPU's own dispatch: a
fused kernel where a CPU runs its parts, F.rms_norm's `_fused_rms_norm` for one), not a GPU:
the prefill runs on the CPU for real (float32, or bf16 autocast with --bf16), then the
model's parameters and the cache's tensors become fake CUDA tensors (FakeTensorMode: shapes,
dtypes and devices, no data) and two steps run on them, the second counted (under CUDA's
bf16 autocast with --bf16, as decode.py --device=cuda runs). A step that reads a value back
to the host would fail here (fake tensors hold none): no decoding step does (caa's count of
kept keys is data: its row says it could not run).
"""
import argparse
import contextlib
import os
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode import ORDER, build  # noqa: E402


# a reshape's view whose schema does not say so; a Python scalar wrapped as a 0-dim tensor
# (torch.where(m, x, 0.0) on fake tensors; on a GPU the kernel takes it as an argument)
NO_KERNEL = {torch.ops.aten._unsafe_view.default, torch.ops.aten.scalar_tensor.default}


class LaunchCounter(TorchDispatchMode):
    """The aten ops dispatched that compute a tensor on the GPU, by name (views, ops returning
    a dtype or a device, and NO_KERNEL left out)."""

    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        on_gpu = any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in pytree.tree_leaves(out))
        if on_gpu and not (func.is_view or func in NO_KERNEL):
            name = func._schema.name.split("::")[-1]
            self.ops[name] = self.ops.get(name, 0) + 1
        return out


def cuda_build():
    """Why this torch cannot make CUDA tensors, or None."""
    if not torch.backends.cuda.is_built():
        return f"torch {torch.__version__} is not built with CUDA (install torch's CUDA build; no GPU is needed)"
    return None


def to_fake_cuda(obj, mode, done=None):
    """obj with every tensor it holds (a module's parameters and buffers; a cache's tensors,
    through the attributes of this project's own objects, lists, tuples and dicts) replaced
    in place by a fake CUDA tensor of the same shape, strides and dtype."""
    done = {} if done is None else done  # id -> what it became (a tied weight: one fake tensor)
    if id(obj) in done:
        return done[id(obj)]
    done[id(obj)] = obj
    if isinstance(obj, torch.Tensor):
        fake = FakeTensor(mode, obj.detach().to("meta"), torch.device("cuda"))
        done[id(obj)] = torch.nn.Parameter(fake, obj.requires_grad) if isinstance(obj, torch.nn.Parameter) else fake
        return done[id(obj)]
    if isinstance(obj, torch.nn.Module):
        for m in obj.modules():
            for group in (m._parameters, m._buffers):
                for name, t in group.items():
                    if t is not None:
                        group[name] = to_fake_cuda(t, mode, done)
        return obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_fake_cuda(x, mode, done) for x in obj)
    if isinstance(obj, dict):
        return {k: to_fake_cuda(v, mode, done) for k, v in obj.items()}
    if type(obj).__module__ in ("model", "attention", "kernels") and hasattr(obj, "__dict__"):
        for k, v in list(vars(obj).items()):
            setattr(obj, k, to_fake_cuda(v, mode, done))
    return obj


def count(attn, T, bf16=False, vocab=256):
    """{op name: count} of one eager one-token step at batch 1 on fake CUDA tensors after a
    T-token prefill (on the CPU)."""
    model = build(attn, 2, vocab, "cpu")
    prompt = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        cache = model.new_cache()
        model(prompt, cache=cache)
    mode = FakeTensorMode()
    to_fake_cuda(model, mode)
    to_fake_cuda(cache, mode)
    token = to_fake_cuda(torch.zeros(1, 1, dtype=torch.long), mode)
    with mode, torch.no_grad(), cuda_autocast(bf16):
        model(token, cache=cache)  # the first step: what a step makes once (a buffer, a table, autocast's weight casts)
        with LaunchCounter() as counter:
            model(token, cache=cache)
    return counter.ops


@contextlib.contextmanager
def cuda_autocast(enabled):
    """torch.autocast("cuda", dtype=torch.bfloat16), which without a GPU disables itself
    (with a warning): its state set directly instead, as entering it would, one region for
    both steps as decode.py's (each weight cast once in it, then read from autocast's cache)."""
    if not enabled:
        yield
        return
    before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", before[0])
        torch.set_autocast_dtype("cuda", before[1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="2048")
    p.add_argument("--variants", default=",".join(ORDER))
    p.add_argument("--bf16", action="store_true", help="prefill under CPU bf16 autocast, the step under CUDA's")
    args = p.parse_args(argv)
    why = cuda_build()
    if why:
        raise SystemExit(f"gpu_launches.py: {why}")
    torch.set_num_threads(1)
    print(f"gpu_launches.py: torch {torch.__version__}, 2 layers of qwen-134m's widths, batch 1, "
          f"{'bf16 autocast' if args.bf16 else 'float32'}; an eager step's ops on fake CUDA tensors")
    print("\n| variant | T | launches a step | x full | the most frequent |\n|---|---|---|---|---|")
    for T in [int(t) for t in args.lengths.split(",")]:
        full = None
        for name in args.variants.split(","):
            try:
                ops = count(name, T, args.bf16)
            except Exception as e:  # noqa: BLE001 (a step that needs data: said in its row)
                print(f"| {name} | {T} | could not run on fake tensors: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:120]} | | |", flush=True)
                continue
            n = sum(ops.values())
            full = n if name == "full" else full
            top = ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:5])
            print(f"| {name} | {T} | {n} | {n / full:.2f} | {top} |" if full else f"| {name} | {T} | {n} | - | {top} |",
                  flush=True)


if __name__ == "__main__":
    main()
