"""Model FLOPs per training token, and MFU: how much of the GPU's dense bf16 peak a run uses.

    flops_per_token(model, T)  =  6 N  +  sum over layers of the attention core's FLOPs

N is the number of weights that multiply every token once (each nn.Linear's weight, the head
included, plus asga's w1_q and w1_k): 2 FLOPs per weight forward and 4 backward, the "6N" of
Kaplan et al. (2020) and of nanoGPT's / PaLM's MFU. Biases, norms, activations and the
embedding lookup are left out, as there. The attention core (what q, k, v go through between
their projections and o) is counted per variant as it computes it, per token and layer:

    4 H D per (query, key) score it computes: q.k (2 D) and p.v (2 D) for each of H heads,
    times 3 for training (forward, and a backward of twice the forward) where a gradient
    flows; once where it does not (the selections of caa, moba and nsa, the KL target of
    indexer). Averaged over the T positions of a sequence: a causal query at t sees t + 1 keys.

So `full` costs 6N + 6 L H D (T + 1) per token: PaLM's 6N + 12 L H D T with the causal half
counted exactly (tests/test_flops.py checks it). What each variant adds or saves is in its
class's `attention_flops` (attention.py); small elementwise work (a softmax, a gate's
sigmoid) is not counted, except asga's pair MLP, which runs per score (4 r FLOPs per head: a
quarter of the score's 4 D at r = 16, D = 64).

MFU = achieved FLOP/s per GPU / PEAK_BF16 of the device (dense, no sparsity), None for a
device not in the table (the log then shows FLOP/s only).
"""
import math

import torch.nn as nn

import attention as A

# Dense bf16 tensor-core peaks, FLOP/s per GPU, from NVIDIA's data sheets. Matched against
# torch.cuda.get_device_name(), most specific name first.
PEAK_BF16 = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    ("A100", 312e12),
]


def peak_flops(device_name):
    """The dense bf16 peak of a GPU named `device_name`, or None when it is not in PEAK_BF16."""
    for name, peak in PEAK_BF16:
        if name in device_name:
            return peak
    return None


def matmul_params(model):
    """N: the weights that multiply each token once (see the module docstring); each
    attention layer counts its own (`matmul_params`: asga adds its w1, nsa leaves out its
    compressor, which runs once per compressed key)."""
    layers = [m for m in model.modules() if isinstance(m, A.CausalSelfAttention)]
    inside = {id(m) for layer in layers for m in layer.modules()}
    outside = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and id(m) not in inside)
    return outside + sum(layer.matmul_params() for layer in layers)


def attention_flops(module, T):
    """(with gradient, without) forward FLOPs per token of one layer's attention core: what
    its class says it computes (attention.py, `attention_flops`)."""
    return module.attention_flops(T)


def flops_per_token(model, T):
    """Training FLOPs per token (forward + backward) of `model` on sequences of T tokens."""
    total = 6 * matmul_params(model)
    for layer in model.layers:
        grad, nograd = attention_flops(layer.self_attn, T)
        total += 3 * grad + nograd
    return total


def describe(model, T):
    """A line for the plan: FLOPs per token, and the attention's share of them."""
    total = flops_per_token(model, T)
    attn = total - 6 * matmul_params(model)
    return f"{total / 1e6:.1f} MFLOPs per token at T = {T} (attention {100 * attn / total:.0f}%)"


def mfu(flops_per_second, device_name):
    """The share of the device's dense bf16 peak, or None for a device not in PEAK_BF16."""
    peak = peak_flops(device_name)
    return None if peak is None or math.isnan(flops_per_second) else flops_per_second / peak
