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
function below; small elementwise work (a softmax, a gate's sigmoid) is not counted, except
asga's pair MLP, which runs per score (4 r FLOPs per head: a quarter of the score's 4 D at r = 16, D = 64).

MFU = achieved FLOP/s per GPU / PEAK_BF16 of the device (dense, no sparsity), None for a
device not in the table (the log then shows FLOP/s only).
"""
import math

import torch
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
    """N: the weights that multiply each token once (see the module docstring)."""
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and ".compress_mlp." not in f".{name}.":
            n += m.weight.numel()
        if isinstance(m, A.ASGAttention) and m.cfg.asga_gate == "learned":
            n += m.w1_q.numel() + m.w1_k.numel()
    return n


def mean_keys(T, keys):
    """The mean over positions t = 0 .. T-1 of keys(t), a tensor function of t (float64)."""
    t = torch.arange(T, dtype=torch.float64, device="cpu")
    return keys(t).mean().item()


def causal(t, window=None, window_from=0):
    """Keys a causal query at t sees: t + 1, or window + 1 at positions >= window_from."""
    if window is None:
        return t + 1
    return torch.where(t >= window_from, torch.clamp(t + 1, max=window + 1), t + 1)


def blocks(t, block, n):
    """Keys of n selected blocks of `block` positions: the own block up to t, plus up to
    n - 1 complete earlier ones (nsa's and moba's selection)."""
    return t % block + 1 + block * torch.clamp(torch.div(t, block, rounding_mode="floor"), max=n - 1)


def attention_flops(module, T):
    """(with gradient, without) forward FLOPs per token of one layer's attention core."""
    cfg = module.cfg
    H, D = cfg.n_head, cfg.head_dim
    per_key = 4 * H * D
    full = mean_keys(T, causal)
    if isinstance(module, A.LocalAttention):
        return per_key * mean_keys(T, lambda t: causal(t, cfg.window)), 0.0
    if isinstance(module, A.DynamicSparseAttention):
        window, window_from = module.window()
        return per_key * mean_keys(T, lambda t: causal(t, window, window_from)), 0.0
    if isinstance(module, A.ASGAttention):
        if cfg.asga_gate == "fixed":
            return per_key * mean_keys(T, lambda t: causal(t, cfg.window)), 0.0
        if cfg.asga_gate == "off":
            return per_key * full, 0.0
        # the pair MLP per score and head: r units of add, GELU (one), multiply-add with w2
        return (per_key + 4 * cfg.asga_hidden * H) * full, 0.0
    if isinstance(module, A.ContextAdaptiveAttention):
        grad = nograd = 0.0
        if cfg.caa_gate != "global":  # the local branch reads up to caa_window_max keys
            grad += per_key * mean_keys(T, lambda t: causal(t, cfg.caa_window_max))
        if cfg.caa_gate != "local":
            if cfg.caa_topk == "all":
                grad += per_key * full
            else:  # every visible score to find the top k_i = ceil(sqrt(t + 1)), then attend to those
                nograd += per_key / 2 * full
                grad += per_key * mean_keys(T, lambda t: torch.ceil(torch.sqrt(t + 1)))
        return grad, nograd
    if isinstance(module, A.CombinerAttention):
        s = cfg.window  # own block up to t, one summary per earlier block, and building them (s keys a block)
        return per_key * (mean_keys(T, lambda t: t % s + 1 + torch.div(t, s, rounding_mode="floor")) + 1), 0.0
    if isinstance(module, A.NativeSparseAttention):
        l, d = cfg.nsa_cmp_block, cfg.nsa_cmp_stride
        cmp = mean_keys(T, lambda t: torch.clamp(torch.div(t + 1 - l, d, rounding_mode="floor") + 1, min=0))
        grad = per_key * cmp  # the compressed branch always runs: its scores pick the blocks
        if "slc" in module.branches:
            grad += per_key * mean_keys(T, lambda t: blocks(t, cfg.nsa_block, cfg.nsa_topk))
        if "win" in module.branches:
            grad += per_key * mean_keys(T, lambda t: causal(t, cfg.nsa_window))
        if cfg.nsa_compress == "mlp":  # run once per compressed key (every d positions), for k and v
            grad += 2 * sum(p.numel() for n, p in module.compress_mlp.named_parameters() if n.endswith("weight")) / d
        return grad, 0.0
    if isinstance(module, A.MixtureOfBlockAttention):
        B, k = cfg.moba_block, cfg.moba_topk
        routing = 2 * H * D * mean_keys(T, lambda t: torch.div(t, B, rounding_mode="floor"))  # q . block means
        return per_key * mean_keys(T, lambda t: blocks(t, B, k)), routing
    if isinstance(module, A.IndexerAttention):
        J, dI = cfg.index_heads, cfg.index_head_dim
        index = (2 * J * dI + 2 * J) * full  # I[t, s] for every visible key: J dots, ReLU and weight
        kl_target = per_key / 2 * full  # the main q.k over the visible keys (no gradient)
        return per_key * mean_keys(T, lambda t: torch.clamp(t + 1, max=module.topk)) + index, kl_target
    if type(module) is A.CausalSelfAttention:
        return per_key * full, 0.0
    raise NotImplementedError(f"no FLOP count for {type(module).__name__}: add one to flops.py")


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
