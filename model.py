"""The Qwen3 decoder, exactly (same math as Hugging Face transformers' Qwen3 given the same
weights), with the attention variant chosen by `ModelConfig.attn` (see attention.py).

    x = embed(idx)
    for each block:  x = x + attn(rmsnorm(x));  x = x + mlp(rmsnorm(x))
    logits = head(rmsnorm(x))            head tied to the embedding by default

`python model.py` prints the parameter count of every preset.
"""
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import VARIANTS, RMSNorm, rope_cos_sin


@dataclass
class ModelConfig:
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 4  # < n_head for grouped-query attention
    head_dim: int = 16
    d_model: int = 64
    mlp_hidden: int = 192
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    # attention variant and its settings (attention.py documents each)
    attn: str = "full"
    window: int = 256  # a query at i sees keys i - window .. i in windowed variants
    kernel: str = "fused"  # 'ref': attention.py as written; 'fused': kernels.py
    dsa_gate: bool = True
    dsa_window: str = "adaptive"  # adaptive | fixed | none
    dsa_threshold: int = 512  # adaptive: windowed only for query positions >= this
    asga_gate: str = "learned"  # learned | fixed | off
    asga_scale: bool = True
    asga_hidden: int = 16
    caa_gate: str = "learned"  # learned | local | global (forced)
    caa_topk: str = "sqrt"  # sqrt: k_i = ceil(sqrt(i + 1)); all: every visible key
    caa_hidden: int = 64
    caa_window_max: int = 512
    caa_tau: float = 8.0  # softness, in tokens, of the local branch's window boundary

    def __post_init__(self):
        if self.attn not in VARIANTS:
            raise ValueError(f"unknown attention variant {self.attn!r}; valid: {', '.join(VARIANTS)}")
        if self.kernel not in ("ref", "fused"):
            raise ValueError(f"kernel must be 'ref' or 'fused', not {self.kernel!r}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")


# Named sizes. qwen-134m: the seeds' model (12 layers, 12 heads of 64, d_model 768), MLP width
# chosen so the tied-embedding count is ~134M; small: ~16M, trains at ~800 tok/s on 2 CPU cores.
PRESETS = {
    "tiny": dict(n_layer=2, n_head=4, n_kv_head=4, head_dim=16, d_model=64, mlp_hidden=192),
    "small": dict(n_layer=4, n_head=4, n_kv_head=4, head_dim=64, d_model=256, mlp_hidden=768),
    "qwen-134m": dict(n_layer=12, n_head=12, n_kv_head=12, head_dim=64, d_model=768, mlp_hidden=2432),
}
MODEL_FIELDS = {f.name for f in fields(ModelConfig)}


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = VARIANTS[cfg.attn](cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, pos, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, pos, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class KVCache:
    """One layer's keys (post-norm, post-RoPE) and values, with their positions.

    After each step the attention layer trims what no later query can see
    (`oldest_key_needed`), so windowed variants keep a rolling cache of at most `window` keys
    between steps (window + 1 while a query attends)."""

    def __init__(self):
        self.k = self.v = self.pos = None
        self.state = {}  # what a variant keeps beside keys and values (combiner's block summaries)

    def update(self, k, v, pos):
        if self.k is None:
            self.k, self.v, self.pos = k, v, pos
        else:
            self.k = torch.cat([self.k, k], dim=2)  # (B, Hkv, S, D)
            self.v = torch.cat([self.v, v], dim=2)
            self.pos = torch.cat([self.pos, pos])
        return self.k, self.v, self.pos

    def trim(self, oldest):
        keep = self.pos >= oldest
        if not bool(keep.all()):
            self.k, self.v, self.pos = self.k[:, :, keep], self.v[:, :, keep], self.pos[keep]

    def __len__(self):
        return 0 if self.pos is None else len(self.pos)


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # std 0.02 everywhere (PyTorch's N(0, 1) embedding tied to the head made CPU steps 7x
        # slower through denormals), GPT-2's scaled init for the projections that write into
        # the residual stream, then each variant's own gate init (its docstring says why).
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))
            elif name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        for layer in self.layers:
            layer.self_attn.init_gates()

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def new_cache(self):
        return [KVCache() for _ in self.layers]

    def forward(self, idx, targets=None, cache=None):
        """idx (B, T) token ids -> (logits (B, T, V) float32, mean cross-entropy or None).
        With `cache` (from `new_cache()`), idx continues the tokens already cached."""
        B, T = idx.shape
        start = 0  # position of idx[:, 0]: right after the last cached token, if any
        if cache is not None and len(cache[0]):
            start = int(cache[0].pos[-1]) + 1
        pos = torch.arange(start, start + T, device=idx.device)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta)
        x = self.embed_tokens(idx)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos.to(x.dtype), sin.to(x.dtype), pos, None if cache is None else cache[i])
        logits = self.lm_head(self.norm(x)).float()
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def record_gates(self, on=True):
        """Make every attention layer keep its gate values from the next forward passes."""
        for layer in self.layers:
            layer.self_attn.record = on
            layer.self_attn.gates = {}

    def gate_tensors(self):
        """[per layer] {name: tensor (B, T, H) or (1, 1, H)} from the last recorded forward."""
        return [layer.self_attn.gates for layer in self.layers]

    def gate_stats(self):
        """{name: {'mean'|'std'|'frac_gt_half': [per layer][per head]}}, JSON-ready."""
        out = {}
        for layer in self.layers:
            for name, summary in layer.self_attn.gate_stats().items():
                for stat, per_head in summary.items():
                    out.setdefault(name, {}).setdefault(stat, []).append(per_head)
        return out


if __name__ == "__main__":
    for name, preset in PRESETS.items():
        model = Model(ModelConfig(**preset))
        print(f"{name:10s} {model.num_params() / 1e6:8.2f}M parameters ({', '.join(f'{k}={v}' for k, v in preset.items())})")
