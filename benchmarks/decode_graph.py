"""Decoding steps with static shapes, replayed as one CUDA graph: what a step of `full` and of
`moba` costs on a GPU once its kernel launches are gone, beside the model's own eager step.

    python benchmarks/decode_graph.py --device=cuda --lengths=8192,32768   # bf16, batch 1 and 16
    python benchmarks/decode_graph.py                                      # CPU: the check alone

Why: the model's decoding step follows the cache's length, a Python int (its slices, its
block counts), so every token has new shapes and no CUDA graph can hold it; on an H200 an
eager 2-layer step of `full` took ~2.5 ms at any length and batch, 34x the time to read its
cache, and the sparse steps, which launch more kernels, 1.7-3x that
(benchmarks/gpu_runs/h200_2026-12-04.md). A step of static shapes, gpt-fast's design, is
captured once and replayed: the keys and values in buffers of fixed capacity, written at a
position held in a tensor, and read under a mask of that position. Before the model's cache
and every variant's decoding ops are rebuilt that way, this file measures what it would buy:
`StaticStep` builds such a step from the model's own modules (embedding, norms, projections,
RoPE table, MLP, head) for its `full` and `moba` layers, checks that its logits follow the
model's own steps, and on CUDA times its replay beside the model's eager step.

What the static step reads: `full` every slot up to the capacity (the mask hides those past
the position; the capacity here is the prompt plus the steps taken), `moba` one mean per block
of the capacity and its top-k blocks' keys and values, gathered by index; moba's own block's
mean is written at every step (a partial mean until the block completes: its own block is
forced, never ranked, so the partial mean is never compared, as in [MoBA]).
"""
import argparse
import copy
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # after the project: benchmarks/attention.py is not attention.py

import kernels  # noqa: E402
from attention import CausalSelfAttention, MixtureOfBlockAttention  # noqa: E402
from decode import build, clock  # noqa: E402

VARIANTS = ("full", "moba")


class StaticStep:
    """One-token decoding steps of `model` after a prefill into `cache` (model.new_cache()),
    with the same shapes at every token: `step(token)` -> logits (B, 1, V), the position
    advanced in place. Layers: `full`'s (CausalSelfAttention) and `moba`'s."""

    def __init__(self, model, cache, capacity):
        T = cache[0].end
        if capacity <= T:
            raise ValueError(f"capacity {capacity} holds no step after the {T}-token prompt: pass more")
        self.model = model
        device = next(model.parameters()).device
        self.pos = torch.tensor(T, device=device)  # the position the next token takes
        cos, sin = model.rope_table(0, capacity, device)
        self.cos, self.sin = cos.clone(), sin.clone()
        self.buffers = []
        for layer, c in zip(model.layers, cache):
            attn = layer.self_attn
            if type(attn) not in (CausalSelfAttention, MixtureOfBlockAttention) or c.start != 0:
                raise ValueError(f"StaticStep runs full and moba layers over a whole cache, not {type(attn).__name__}")
            k, v = c.k.view(), c.v.view()  # (B, Hkv, T, D)
            held = capacity  # moba's: whole blocks, so that its own block's slots all exist
            if isinstance(attn, MixtureOfBlockAttention):
                held = -(-capacity // attn.cfg.moba_block) * attn.cfg.moba_block
            buf = dict(k=k.new_zeros(*k.shape[:2], held, k.shape[3]), v=v.new_zeros(*v.shape[:2], held, v.shape[3]))
            buf["k"][:, :, :T], buf["v"][:, :, :T] = k, v
            if isinstance(attn, MixtureOfBlockAttention):
                means = c.summaries[0].view()  # (B, Hkv, complete blocks, D) float32
                buf["means"] = means.new_zeros(*means.shape[:2], held // attn.cfg.moba_block, means.shape[3])
                buf["means"][:, :, :means.shape[2]] = means
            self.buffers.append(buf)

    def __call__(self, token):
        model, pos = self.model, self.pos
        x = model.embed_tokens(token)  # (B, 1, C)
        cos, sin = self.cos.index_select(0, pos.view(1)).to(x.dtype), self.sin.index_select(0, pos.view(1)).to(x.dtype)
        for layer, buf in zip(model.layers, self.buffers):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(x), cos, sin)  # (B, H, 1, D), (B, Hkv, 1, D)
            buf["k"].index_copy_(2, pos.view(1), k.to(buf["k"].dtype))
            buf["v"].index_copy_(2, pos.view(1), v.to(buf["v"].dtype))
            if isinstance(attn, MixtureOfBlockAttention):
                y = self.moba(attn, q, buf)
            else:
                keys = torch.arange(buf["k"].shape[2], device=pos.device) <= pos  # the slots written so far
                y = F.scaled_dot_product_attention(q, buf["k"].to(q.dtype), buf["v"].to(q.dtype), attn_mask=keys.view(1, -1),
                                                   scale=attn.scale, enable_gqa=attn.n_head != attn.n_kv_head)
            x = x + attn.o_proj(y.transpose(1, 2).reshape(x.shape[0], 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.pos += 1
        return model.head_and_loss(x)[0]

    def moba(self, attn, q, buf):
        """[MoBA] eqs. 2-6 for the query at self.pos: the block means, its own block forced,
        the top k - 1 earlier blocks by q . K_bar, one softmax over their keys up to pos."""
        block, pos = attn.cfg.moba_block, self.pos
        B, H, _, D = q.shape
        Hkv, capacity = buf["k"].shape[1], buf["k"].shape[2]
        own = pos // block
        slots = own * block + torch.arange(block, device=q.device)
        buf["means"].index_copy_(2, own.view(1), buf["k"].index_select(2, slots).float().mean(2, keepdim=True))
        with torch.autocast(q.device.type, enabled=False):
            scores = (q.float().reshape(B, Hkv, H // Hkv, D) @ buf["means"].transpose(-2, -1)).view(B, H, 1, -1)
        j = torch.arange(scores.shape[-1], device=q.device)
        scores = torch.where(j < own, scores, torch.where(j == own, float("inf"), float("-inf")))
        blocks = kernels._top_n(scores, attn.cfg.moba_topk)[:, :, 0]  # (B, H, k), -1 for a slot with no block
        keys = blocks[..., None] * block + torch.arange(block, device=q.device)  # (B, H, k, block)
        seen = ((blocks[..., None] >= 0) & (keys <= pos)).flatten(2)  # (B, H, k block); its own key always
        # each query head's keys as rows of its key head's buffer, viewed as (B Hkv capacity) rows of D
        head = torch.arange(B, device=q.device)[:, None, None] * Hkv + torch.arange(H, device=q.device)[:, None] // (H // Hkv)
        rows = head * capacity + keys.flatten(2).clamp(min=0)  # (B, H, k block)
        k_rows = buf["k"].reshape(-1, D)[rows].to(q.dtype)  # (B, H, k block, D)
        v_rows = buf["v"].reshape(-1, D)[rows].to(q.dtype)
        logits = (q @ k_rows.transpose(-2, -1)).float() * attn.scale  # (B, H, 1, k block)
        p = torch.softmax(logits.masked_fill(~seen[:, :, None], float("-inf")), -1)
        return p.to(v_rows.dtype) @ v_rows


def check(attn, T=50, steps=20, device="cpu"):
    """The largest difference between the model's own steps' logits and StaticStep's over
    `steps` tokens after a T-token prompt (a small model with moba blocks of 8): (max |diff|,
    whether every step's argmax agreed)."""
    from model import Model, ModelConfig, PRESETS
    cfg = ModelConfig(**dict(PRESETS["tiny"], vocab_size=64, attn=attn, kernel="fused", moba_block=8, moba_topk=3))
    torch.manual_seed(0)
    model = Model(cfg).to(device).eval()
    prompt = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        cache = model.new_cache()
        model(prompt, cache=cache)
        static = StaticStep(model, cache, T + steps + 1)
        token, worst, agree = prompt[:, -1:], 0.0, True
        for _ in range(steps):
            mine, theirs = static(token), model(token, cache=cache)[0]
            worst = max(worst, (mine - theirs).abs().max().item())
            agree &= torch.equal(mine.argmax(-1), theirs.argmax(-1))
            token = theirs[:, -1:].argmax(-1)
    return worst, agree


def median_ms(step, token, n, device):
    times = []
    for _ in range(n):
        t0 = clock(device)
        step(token)
        times.append(clock(device) - t0)
    return 1e3 * statistics.median(times)


def random_cache(model, T, batch, device):
    """model.new_cache() holding T positions of random keys and values (and the summaries the
    cache makes of them), written as a prefill writes them but without its attention: a step's
    time does not depend on what its cache holds, and a prefill at 32768 would first compile
    FlexAttention for that shape on a GPU (tens of seconds a variant)."""
    cache = model.new_cache()
    g = torch.Generator(device=device).manual_seed(0)
    for layer, c in zip(model.layers, cache):
        attn = layer.self_attn
        H, Hkv, D = attn.n_head, attn.n_kv_head, attn.head_dim
        q = torch.randn(batch, H, T, D, device=device, generator=g)
        k, v = (torch.randn(batch, Hkv, T, D, device=device, generator=g) for _ in range(2))
        c.update(attn, q, k, v, torch.randn(batch, T, attn.cfg.d_model, device=device, generator=g), 0)
    return cache


def time_row(attn, T, batch, steps):
    """(eager model step ms, static step ms uncaptured, static step ms replayed as a CUDA graph)
    at T cached tokens and this batch, bf16 on CUDA."""
    model = build(attn, 2, 256, "cuda")
    token = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    with torch.no_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            cache = random_cache(model, T, batch, "cuda")
            held = copy.deepcopy(cache)
            eager = median_ms(lambda t: model(t, cache=cache), token, steps, "cuda")
        # the static step reads bf16 weights cast once (as compile_decoding's step does), no autocast
        static = StaticStep(copy.deepcopy(model).to(torch.bfloat16), held, T + 4 * steps + 16)
        uncaptured = median_ms(static, token, steps, "cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up before capture, as torch.cuda.graphs asks
                static(token)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static(token)
        replayed = median_ms(lambda t: graph.replay(), token, steps, "cuda")
    return eager, uncaptured, replayed


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--lengths", default="8192,32768")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    for attn in VARIANTS:
        worst, agree = check(attn, device=args.device)
        print(f"{attn}: the static step's logits against the model's own steps: max |diff| {worst:.2e}, "
              f"argmax {'the same' if agree else 'DIFFERENT'} at every step", flush=True)
    if args.device != "cuda":
        return
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; 2 layers of qwen-134m's widths, bf16, "
          f"median of {args.steps} steps\n")
    print("| variant | T | batch | eager step ms | static, uncaptured ms | static, one CUDA graph ms | graph x eager | graph x full's graph |")
    print("|---|---|---|---|---|---|---|---|")
    for T in [int(t) for t in args.lengths.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            full = None
            for attn in VARIANTS:
                try:
                    eager, uncaptured, replayed = time_row(attn, T, batch, args.steps)
                except Exception as e:  # noqa: BLE001 (one row's failure is its row's line)
                    print(f"| {attn} | {T} | {batch} | failed: {type(e).__name__}: {str(e).splitlines()[0][:150]} | | | | |", flush=True)
                    continue
                full = replayed if attn == "full" else full
                ratio = f"{replayed / full:.2f}" if full else "-"
                print(f"| {attn} | {T} | {batch} | {eager:.2f} | {uncaptured:.2f} | {replayed:.3f} | "
                      f"{replayed / eager:.2f} | {ratio} |", flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
