"""How long a compiled training step takes to be ready: torch.compile(model) against
model.compile_blocks (each block compiled on its own, train.py's way), side by side.

    python benchmarks/compile_time.py                    # every variant (CPU: ~10 minutes on 2 cores)
    python benchmarks/compile_time.py --only=nsa,moba --T=256

One training step of the qwen-134m model on the GPU path (kernel='flex'),
after torch._dynamo.reset(), first as one compiled model, then block by block; per variant
the first step's seconds (the compile, plus one step), the second's (the step alone), the
compile's seconds (on CUDA first - second; on a CPU dynamo's own count, compilation_time_metrics,
as the CPU's step is slow and uneven), and the compile seconds of blocks over whole.

On CUDA this is the whole compile: inductor, Triton, bf16 autocast, its caches switched off.
On a CPU it is the part of a compile that is the same on every device: dynamo's trace and
AOTAutograd's forward and backward graphs (backend 'aot_eager'; inductor's CPU FlexAttention
has no backward), both traced in the first forward call, which is what is timed: the step is
a forward alone, run eagerly from those graphs with FlexAttention as its dense CPU reference
(hence the small T), which has no backward for the gates that asga's and caa's score_mods
capture. The graphs column counts the graphs dynamo traced:
one for the whole model; for compile_blocks one per block class (moba_full_last adds a second)
and one for the tail (the last norm, the head and the loss); compile_blocks traces one layer
where torch.compile(model) traces n_layer of them.
"""
import argparse
import os
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from attention import VARIANTS  # noqa: E402
from model import PRESETS, Model, ModelConfig, compile_blocks  # noqa: E402

SHAPE = "qwen-134m"


def allow_cpu_backward():
    """FlexAttention refuses a backward for CPU tensors before it is traced ("does not support
    backward on CPU"); the eager reference that aot_eager runs has one. Only tracing is timed
    here, so the guard is lifted in this process (a private torch function: gone, nothing to do)."""
    import torch.nn.attention.flex_attention as nn_fa
    if hasattr(nn_fa, "_validate_device"):
        nn_fa._validate_device = lambda *args, **kwargs: None


def first_steps(attn, how, T, B, device, backend, layers):
    """(first step s, second step s, graphs traced) of one training step of `attn` with
    `layers` layers, compiled `how` ('whole' or 'blocks')."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    cfg = {**PRESETS[SHAPE], "n_layer": layers, "vocab_size": 50304, "attn": attn, "kernel": "flex"}
    model = Model(ModelConfig(**cfg)).to(device)
    model.train()
    idx = torch.randint(0, 50304, (B, T + 1), device=device)
    torch._dynamo.reset()
    counters.clear()
    run = torch.compile(model, backend=backend) if how == "whole" else compile_blocks(model, backend=backend)
    cuda = device == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def step():
        t0 = time.perf_counter()
        with autocast:
            _, loss = run(idx[:, :-1], idx[:, 1:])
            kl = model.indexer_loss()
        if cuda:
            (loss if kl is None else loss + kl).backward()
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    from torch._dynamo.utils import compilation_time_metrics
    compilation_time_metrics.clear()
    first, second = step(), step()
    # the compile: on CUDA what the first step took beyond the second (inductor compiles the
    # backward at the first backward); on a CPU, whose eager FlexAttention reference makes a step
    # slow and uneven, dynamo's own count of the seconds it spent (its backend's included)
    compile_s = first - second if cuda else sum(compilation_time_metrics.get("_compile.compile_inner", []))
    return first, second, compile_s, counters["stats"]["unique_graphs"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="comma-separated variants (default: all)")
    parser.add_argument("--T", type=int, help="sequence length (default 1024 on CUDA, 256 on a CPU)")
    parser.add_argument("--B", type=int, default=1, help="batch")
    parser.add_argument("--layers", type=int, help=f"layers (default {SHAPE}'s, 12: whole traces each one, blocks one)")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(VARIANTS)
    unknown = set(names) - set(VARIANTS)
    if unknown:
        sys.exit(f"error: unknown --only {', '.join(sorted(unknown))}; valid: {', '.join(VARIANTS)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    T = args.T or (1024 if device == "cuda" else 256)
    if device == "cuda":
        backend = "inductor"
        import torch._inductor.config as icfg
        icfg.force_disable_caches = True  # every row compiles from nothing
    else:
        backend = "aot_eager"
        allow_cpu_backward()
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    layers = args.layers or PRESETS[SHAPE]["n_layer"]
    first_steps("full", "blocks", 16, 1, device, backend, layers)  # the process's one-time costs (imports), in no row
    print(f"compile_time: {SHAPE}, {layers} layers, T = {T}, B = {args.B}, kernel=flex on {device}, backend {backend}, "
          f"torch {torch.__version__}", flush=True)
    print("| config | whole: first step s | step s | compile s | graphs | blocks: first step s | step s | compile s "
          "| graphs | compile s, blocks / whole |")
    print("|---" * 10 + "|")
    for attn in names:
        whole = first_steps(attn, "whole", T, args.B, device, backend, layers)
        blocks = first_steps(attn, "blocks", T, args.B, device, backend, layers)
        cells = [f"{whole[0]:.1f}", f"{whole[1]:.2f}", f"{whole[2]:.1f}", whole[3],
                 f"{blocks[0]:.1f}", f"{blocks[1]:.2f}", f"{blocks[2]:.1f}", blocks[3], f"{blocks[2] / whole[2]:.2f}"]
        print(f"| {attn} | " + " | ".join(str(c) for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
