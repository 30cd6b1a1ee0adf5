"""The Qwen3 decoder, exactly (same math as Hugging Face transformers' Qwen3 given the same
weights), with the attention variant chosen by `ModelConfig.attn` (see attention.py).

    x = embed(idx)
    for each block:  x = x + attn(rmsnorm(x));  x = x + mlp(rmsnorm(x))
    logits = head(rmsnorm(x))            head tied to the embedding by default

`python model.py` prints the parameter count of every preset.
"""
import math
import os
import pickle
import sys
import zipfile
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import VARIANTS, AttentionConfig, RMSNorm, rope_cos_sin


@dataclass
class ModelConfig(AttentionConfig):
    """The decoder's sizes. The attention's settings, the heads' shape among them, are
    AttentionConfig's (attention.py), one comment each."""
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64
    n_layer: int = 2
    mlp_hidden: int = 192
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    # moba: the last this-many layers use full attention ([MoBA] §3.2's layer-wise hybrid: 3 of
    # 32 layers for Llama-8B-1M); for runs that follow the paper's long-context recipe
    moba_full_last: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.attn == "moba" and not 0 <= self.moba_full_last <= self.n_layer:
            raise ValueError(f"moba_full_last={self.moba_full_last} must be in 0 .. n_layer={self.n_layer}")


# Named sizes. qwen-134m: this project's choice of a 134M-parameter Qwen3 (12 layers, 12 heads
# of 64, d_model 768, MLP width set so the tied-embedding count is ~134M), matching the
# parameter count the papers state. The papers' own shapes differ (short names as in
# attention.py's references): [DSA] 12 heads of 128; [DSA-A] d_model 1536, FFN 8960, 28 layers,
# ~1.4B parameters. small: ~16M, trains at ~800 tok/s on 2 CPU cores.
PRESETS = {
    "tiny": dict(n_layer=2, n_head=4, n_kv_head=4, head_dim=16, d_model=64, mlp_hidden=192),
    # bytes: the CPU default (train.py's cpu preset) on byte shards, ~0.9M parameters; the
    # shape of nanoGPT's CPU character-level Shakespeare model (4 layers, d_model 128).
    "bytes": dict(n_layer=4, n_head=4, n_kv_head=4, head_dim=32, d_model=128, mlp_hidden=384,
                  tie_embeddings=False, vocab_size=256),  # train.py sets the data folder's vocab anyway
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


def layer_variant(cfg, layer):
    """The attention class of layer `layer`: moba_full_last puts full attention in MoBA's last
    layers ([MoBA] §3.2's layer-wise hybrid); every other layer gets cfg.attn."""
    if cfg.attn == "moba" and layer >= cfg.n_layer - cfg.moba_full_last:
        return VARIANTS["full"]
    return VARIANTS[cfg.attn]


class Block(nn.Module):
    def __init__(self, cfg, layer=0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = layer_variant(cfg, layer)(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, start, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class KVCache:
    """One layer's keys (post-norm, post-RoPE) and values, for the positions start .. end - 1
    (Python ints: nothing is read back from the device).

    After each step the attention layer trims what no later query can see
    (`oldest_key_needed`), so windowed variants keep a rolling cache of at most `window` keys
    between steps (window + 1 while a query attends)."""

    def __init__(self):
        self.k = self.v = None
        self.start = self.end = 0
        self.state = {}  # what a variant keeps beside keys and values (combiner's block summaries)

    def update(self, k, v, start):
        """Append keys/values (B, Hkv, T, D) of positions start ..; returns all cached keys,
        values and the position of the first."""
        if start != self.end:
            raise ValueError(f"the cache holds positions up to {self.end}, not {start}: feed tokens in order")
        if self.k is None:
            self.k, self.v, self.start = k, v, start
        else:
            self.k = torch.cat([self.k, k], dim=2)  # (B, Hkv, S, D)
            self.v = torch.cat([self.v, v], dim=2)
        self.end = start + k.shape[2]
        return self.k, self.v, self.start

    def trim(self, oldest):
        if oldest > self.start:
            self.k, self.v = self.k[:, :, oldest - self.start:], self.v[:, :, oldest - self.start:]
            self.start = oldest

    def __len__(self):
        return self.end - self.start


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)])
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
        start = 0 if cache is None else cache[0].end  # position of idx[:, 0], a Python int
        pos = torch.arange(start, start + T, device=idx.device)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta)
        x = self.embed_tokens(idx)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos.to(x.dtype), sin.to(x.dtype), start, None if cache is None else cache[i])
        logits = self.lm_head(self.norm(x)).float()
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def indexer_loss(self):
        """The sum over layers of the indexer's KL loss ([DS32]; attention.IndexerAttention)
        from the last training-mode forward; None when no layer has one. The training loss
        adds it: it reaches the indexers alone."""
        losses = [layer.self_attn.indexer_loss for layer in self.layers
                  if getattr(layer.self_attn, "indexer_loss", None) is not None]
        return sum(losses) if losses else None

    def record_gates(self, on=True):
        """Make every attention layer keep what it notes (gates, selections; attention.py's
        `note`) from the next forward passes on."""
        for layer in self.layers:
            layer.self_attn.record_gates(on)

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


# ----------------------------------------------------------------------------- checkpoints
# One saver and one loader for every checkpoint: train.py writes and resumes with them,
# sample.py, analyze.py and experiments/recall.py load models through them.

def set_kernel(model, kernel):
    """Switch every module of `model` to the core-op path `kernel` (attention.ops), on a copy
    of each module's config (the caller's ModelConfig, saved in checkpoints, is left as is)."""
    for m in model.modules():
        if isinstance(getattr(m, "cfg", None), ModelConfig):
            m.cfg = replace(m.cfg, kernel=kernel)


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the file and the problem."""


def save_checkpoint(path, ckpt):
    """Write `ckpt` (tensors, numbers, strings, None, lists, tuples and dicts only, so that
    read_checkpoint can load it weights-only). Atomic: a temporary file in the same folder,
    fsync, then a rename over the old one, so a kill at any moment leaves either the previous
    checkpoint or the new one, never half of one."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(ckpt, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)


def check_checkpoint_format(path):
    """A clear error for a file that is no checkpoint at all (a text file, a data shard, a
    .zip of something else) or a checkpoint cut short, before torch.load reports it as a
    refused pickle. torch.save writes a zip archive holding `<name>/data.pkl`; files from
    torch < 1.6 are a bare pickle, which starts with the PROTO opcode 0x80."""
    fix = "give a run folder holding ckpt.pt (e.g. out/run) or the ckpt.pt file train.py wrote"
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:2] != b"PK" and head[:1] != b"\x80":
        raise CheckpointError(f"{path}: not a checkpoint: torch.save writes a zip archive, and this "
                              f"file starts with {head!r}; {fix}")
    if head[:2] == b"PK":
        if not zipfile.is_zipfile(path):
            raise CheckpointError(f"{path}: a damaged checkpoint: the zip archive has no end (cut "
                                  f"short by a copy still in progress or a full disk?); copy it again, "
                                  f"or resume from the run folder, whose ckpt.pt is written atomically")
        with zipfile.ZipFile(path) as z:
            if not any(name.split("/")[-1] == "data.pkl" for name in z.namelist()):
                raise CheckpointError(f"{path}: not a checkpoint: a zip archive without the data.pkl "
                                      f"that torch.save writes; {fix}")


def read_checkpoint(path, device="cpu"):
    """A run folder (holding ckpt.pt) or a checkpoint file -> the checkpoint dict.

    Always weights-only (torch.load(weights_only=True)): unpickling may only build tensors
    and plain containers, so a checkpoint from someone else cannot run code on this machine.
    A file holding anything else is refused before any of it runs."""
    path = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else str(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint (give a run folder holding ckpt.pt, "
                              f"or the .pt file itself)")
    check_checkpoint_format(path)
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [line for line in str(e).splitlines() if "GLOBAL" in line or "nsupported" in line]
        reason = lines[0].strip() if lines else str(e).splitlines()[0]
        raise CheckpointError(
            f"{path}: refused: it holds objects other than tensors, numbers, strings, lists and "
            f"dicts ({reason}); checkpoints are loaded weights-only, so code inside one never "
            f"runs. A file you got from elsewhere may be malicious: open it by hand only if you "
            f"trust its source") from None
    except Exception as e:  # a truncated file, not a torch file, ...
        raise CheckpointError(f"{path}: cannot read the checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise CheckpointError(f"{path}: not a train.py checkpoint (expected a dict with "
                              f"'model' and 'model_config')")
    return ckpt


def load_checkpoint(path, device="cpu", kernel=None):
    """A run folder or checkpoint file -> (Model in eval mode on `device`, checkpoint dict).

    The model config travels in the checkpoint. `kernel` ('ref' | 'fused') overrides the
    saved one (the weights are the same). Config keys this ModelConfig does not know (a
    checkpoint from another version of this code) are dropped with a note."""
    ckpt = read_checkpoint(path, device)
    path = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else str(path)
    known = {f.name for f in fields(ModelConfig)}
    config = dict(ckpt["model_config"])
    unknown = sorted(set(config) - known)
    if unknown:
        print(f"note: {path}: ignoring model_config keys this ModelConfig lacks: {unknown}", file=sys.stderr)
    config = {k: v for k, v in config.items() if k in known}
    if kernel is not None:
        config["kernel"] = kernel
    try:
        model = Model(ModelConfig(**config))
        model.load_state_dict(ckpt["model"])
    except (ValueError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"{path}: the checkpoint does not fit the model ({e})") from None
    return model.to(device).eval(), ckpt


if __name__ == "__main__":
    for name, preset in PRESETS.items():
        model = Model(ModelConfig(**preset))
        print(f"{name:10s} {model.num_params() / 1e6:8.2f}M parameters ({', '.join(f'{k}={v}' for k, v in preset.items())})")
