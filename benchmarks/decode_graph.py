"""Decoding steps with static shapes, replayed as one CUDA graph: what a step of `full`, `local`,
`moba`, `nsa` and the indexer costs on a GPU once its kernel launches are gone, beside the
model's own eager step.

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
RoPE table, MLP, head) for its `full`, `local`, `moba`, `nsa` and `indexer` layers, checks that
its logits follow the model's own steps, and on CUDA times its replay beside the model's eager
step.

What the static step reads: `full` every slot up to the capacity (the mask hides those past
the position; the capacity here is the prompt plus the steps taken), `local` its window's W + 1
keys and values by index, `moba` one mean per block
of the capacity and its top-k blocks' keys and values, gathered by index; moba's own block's
mean is written at every step (a partial mean until the block completes: its own block is
forced, never ranked, so the partial mean is never compared, as in [MoBA]); nsa every
compressed key and value slot of the capacity (those not yet complete masked), its top-n
blocks and its window's keys and values by index, the compressed key whose window ends at the
position written at every step (into a spare slot while none ends there); the indexer every
indexer key slot of the capacity (eq. 1 scores them all; those past the position masked), the
step's own written first, then its top-k keys and values by index.
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
from attention import (CausalSelfAttention, IndexerAttention, LocalAttention, MixtureOfBlockAttention,  # noqa: E402
                       NativeSparseAttention, apply_rope)
from decode import build, clock  # noqa: E402

VARIANTS = ("full", "local", "moba", "nsa", "indexer")
STATIC = (CausalSelfAttention, LocalAttention, MixtureOfBlockAttention, NativeSparseAttention, IndexerAttention)


class StaticStep:
    """One-token decoding steps of `model` after a prefill into `cache` (model.new_cache()),
    with the same shapes at every token: `step(token)` -> logits (B, 1, V), the position
    advanced in place. Layers: `full`'s (CausalSelfAttention), local's, moba's, nsa's (its mean
    compressor) and the indexer's."""

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
            if type(attn) not in STATIC or (c.start != 0 and type(attn) is not LocalAttention) \
                    or getattr(attn.cfg, "nsa_compress", "mean") != "mean":
                raise ValueError(f"StaticStep runs {', '.join(VARIANTS)} (nsa_compress=mean) layers over a whole "
                                 f"cache (local's rolling one), not {type(attn).__name__}")
            k, v = c.k.view(), c.v.view()  # (B, Hkv, T - c.start, D): local's last W keys, the others' every key
            block = attn.cfg.moba_block if isinstance(attn, MixtureOfBlockAttention) else attn.cfg.nsa_block
            held = -(-capacity // block) * block  # whole blocks: a block's slots all exist
            buf = dict(k=k.new_zeros(*k.shape[:2], held, k.shape[3]), v=v.new_zeros(*v.shape[:2], held, v.shape[3]))
            buf["k"][:, :, c.start:T], buf["v"][:, :, c.start:T] = k, v  # each key at its position's slot
            if isinstance(attn, MixtureOfBlockAttention):
                means = c.summaries[0].view()  # (B, Hkv, complete blocks, D) float32
                buf["means"] = means.new_zeros(*means.shape[:2], held // block, means.shape[3])
                buf["means"][:, :, :means.shape[2]] = means
            if isinstance(attn, NativeSparseAttention):  # K^cmp, V^cmp: one slot per stride, and a spare
                for name, kept in zip(("k_cmp", "v_cmp"), (row.view() for row in c.summaries)):
                    buf[name] = kept.new_zeros(*kept.shape[:2], held // attn.cfg.nsa_cmp_stride + 1, kept.shape[3])
                    buf[name][:, :, :kept.shape[2]] = kept
            if isinstance(attn, IndexerAttention):  # k^I, one per position (B, held, d), in float32
                kept = c.summaries[0].view()
                buf["k_idx"] = kept.new_zeros(kept.shape[0], held, kept.shape[2], dtype=torch.float32)
                buf["k_idx"][:, :T] = kept
                cos_i, sin_i = attn.indexer.rope_table(0, held, device)
                buf["rope_idx"] = cos_i.clone(), sin_i.clone()
            self.buffers.append(buf)

    def __call__(self, token):
        model, pos = self.model, self.pos
        x = model.embed_tokens(token)  # (B, 1, C)
        cos, sin = self.cos.index_select(0, pos.view(1)).to(x.dtype), self.sin.index_select(0, pos.view(1)).to(x.dtype)
        for layer, buf in zip(model.layers, self.buffers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = attn.project(h, cos, sin)  # (B, H, 1, D), (B, Hkv, 1, D)
            buf["k"].index_copy_(2, pos.view(1), k.to(buf["k"].dtype))
            buf["v"].index_copy_(2, pos.view(1), v.to(buf["v"].dtype))
            if isinstance(attn, MixtureOfBlockAttention):
                y = self.moba(attn, q, buf)
            elif isinstance(attn, NativeSparseAttention):
                y = self.nsa(attn, q, h, buf)
            elif isinstance(attn, IndexerAttention):
                y = self.indexer(attn, q, h, buf)
            elif isinstance(attn, LocalAttention):  # the W + 1 keys pos - W .. pos
                keys = (pos - attn.cfg.window + torch.arange(attn.cfg.window + 1, device=pos.device)).expand(
                    q.shape[0], q.shape[1], -1)
                y = self.attend_rows(attn, q, buf, keys, keys >= 0)
            else:
                keys = torch.arange(buf["k"].shape[2], device=pos.device) <= pos  # the slots written so far
                y = F.scaled_dot_product_attention(q, buf["k"].to(q.dtype), buf["v"].to(q.dtype), attn_mask=keys.view(1, -1),
                                                   scale=attn.scale, enable_gqa=attn.n_head != attn.n_kv_head)
            x = x + attn.o_proj(y.transpose(1, 2).reshape(x.shape[0], 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.pos += 1
        return model.head_and_loss(x)[0]

    def attend_rows(self, attn, q, buf, keys, seen):
        """One softmax of q (B, H, 1, D) over the keys each query head lists, keys (B, H, m)
        positions read from its key head's buffer by index (any where seen (B, H, m) is False)."""
        B, H, _, D = q.shape
        Hkv, held = buf["k"].shape[1], buf["k"].shape[2]
        # each query head's key head's rows, in the buffer viewed as (B Hkv held) rows of D
        head = torch.arange(B, device=q.device)[:, None, None] * Hkv + torch.arange(H, device=q.device)[:, None] // (H // Hkv)
        rows = head * held + keys.clamp(min=0)
        k_rows = buf["k"].reshape(-1, D)[rows].to(q.dtype)  # (B, H, m, D)
        v_rows = buf["v"].reshape(-1, D)[rows].to(q.dtype)
        logits = (q @ k_rows.transpose(-2, -1)).float() * attn.scale  # (B, H, 1, m)
        p = torch.softmax(logits.masked_fill(~seen[:, :, None], float("-inf")), -1)  # its own key is always seen
        return p.to(v_rows.dtype) @ v_rows

    def blocks_attended(self, attn, q, buf, blocks, block):
        """attend_rows over the keys up to self.pos of the blocks (B, H, n) (-1: none) lists."""
        keys = blocks[..., None] * block + torch.arange(block, device=q.device)  # (B, H, n, block)
        seen = (blocks[..., None] >= 0) & (keys <= self.pos)
        return self.attend_rows(attn, q, buf, keys.flatten(2), seen.flatten(2))

    def moba(self, attn, q, buf):
        """[MoBA] eqs. 2-6 for the query at self.pos: the block means, its own block forced,
        the top k - 1 earlier blocks by q . K_bar, one softmax over their keys up to pos."""
        block, pos = attn.cfg.moba_block, self.pos
        B, H, _, D = q.shape
        Hkv = buf["k"].shape[1]
        own = pos // block
        slots = own * block + torch.arange(block, device=q.device)
        buf["means"].index_copy_(2, own.view(1), buf["k"].index_select(2, slots).float().mean(2, keepdim=True))
        with torch.autocast(q.device.type, enabled=False):
            scores = (q.float().reshape(B, Hkv, H // Hkv, D) @ buf["means"].transpose(-2, -1)).view(B, H, 1, -1)
        j = torch.arange(scores.shape[-1], device=q.device)
        scores = torch.where(j < own, scores, torch.where(j == own, float("inf"), float("-inf")))
        blocks = kernels._top_n(scores, attn.cfg.moba_topk)[:, :, 0]  # (B, H, k), -1 for a slot with no block
        return self.blocks_attended(attn, q, buf, blocks, block)

    def nsa(self, attn, q, x, buf):
        """[NSA] eqs. 5-12 for the query at self.pos: the compressed key and value whose window
        ends at pos written (into a spare slot while none does), p^cmp over the compressed keys
        seen, its block scores (eq. 9), the top-n blocks with the three forced, the window's
        W + 1 keys, the three branches mixed by their gates."""
        cfg, pos = attn.cfg, self.pos
        length, stride, block, W = cfg.nsa_cmp_block, cfg.nsa_cmp_stride, cfg.nsa_block, cfg.nsa_window
        B, H, _, D = q.shape
        Hkv, G = buf["k"].shape[1], H // buf["k"].shape[1]
        first = pos - length + 1  # the first position of the window ending at pos
        done = (first >= 0) & (first % stride == 0)
        slot = torch.where(done, first.div(stride, rounding_mode="floor"), buf["k_cmp"].shape[2] - 1).view(1)
        window = (first + torch.arange(length, device=q.device)).clamp(min=0)
        for name in ("k", "v"):  # eq. 7 with phi the mean
            buf[name + "_cmp"].index_copy_(2, slot, buf[name].index_select(2, window).mean(2, keepdim=True))
        C = buf["k_cmp"].shape[2]
        visible = torch.arange(C, device=q.device) * stride + length - 1 <= pos  # the spare slot never
        with torch.autocast(q.device.type, enabled=False):  # eq. 8 in float32
            logits = (q.float().reshape(B, Hkv, G, D) @ buf["k_cmp"].float().transpose(-2, -1)) * attn.scale
            p = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)  # none seen: 0
        out = {"cmp": (p.to(buf["v_cmp"].dtype) @ buf["v_cmp"]).view(B, H, 1, D).to(q.dtype)}
        J = buf["k"].shape[2] // block
        scores = kernels.padded_block_scores(p, J, length, stride, block).sum(2)  # eqs. 9-10: (B, Hkv, J)
        own, j = pos // block, torch.arange(J, device=q.device)
        forced = (j == 0) | (j == own) | (j == own - 1)
        scores = torch.where((j <= own) & ~forced, scores, torch.where(forced & (j <= own), float("inf"), float("-inf")))
        blocks = kernels._top_n(scores, cfg.nsa_topk).repeat_interleave(G, 1)  # (B, H, n): a key head's for its queries
        out["slc"] = self.blocks_attended(attn, q, buf, blocks, block)
        keys = (pos - W + torch.arange(W + 1, device=q.device)).expand(B, H, W + 1)
        out["win"] = self.attend_rows(attn, q, buf, keys, keys >= 0)
        g = attn.branch_gates(x)  # (3, B, H, 1, 1)
        return sum(g[attn.BRANCHES.index(name)].to(out[name].dtype) * out[name] for name in attn.branches)

    def indexer(self, attn, q, x, buf):
        """[DS32] eqs. 1-2 for the query at self.pos: the step's indexer key written at its
        slot, the lightning scores of every slot (those past pos -inf), the top-k keys
        (`kernels._top_n`, the model's tie rule: the most recent of equal scores), one softmax
        over them."""
        ix, pos = attn.indexer, self.pos
        B, H = q.shape[:2]
        J, d = ix.n_head, ix.head_dim
        cos, sin = (t.index_select(0, pos.view(1)) for t in buf["rope_idx"])  # (1, d / 2)

        def rope(z):  # RoPE on the first half of the last dim, as LightningIndexer.rope
            half = d // 2
            return torch.cat([apply_rope(z[..., :half], cos.to(z.dtype), sin.to(z.dtype)), z[..., half:]], -1)
        q_idx = rope(ix.q_proj(x).view(B, J, d))  # (B, J, d)
        w = ix.weights_proj(x).view(B, J) * J ** -0.5
        buf["k_idx"].index_copy_(1, pos.view(1), rope(ix.k_norm(ix.k_proj(x))).float())  # (B, 1, d)
        with torch.autocast(q.device.type, enabled=False):  # eq. 1, as kernels.decode_indexer_topk
            dots = torch.bmm(buf["k_idx"], q_idx.float().transpose(1, 2)).div_(d ** 0.5).relu_()  # (B, held, J)
            scores = torch.einsum("bsj,bj->bs", dots, w.float())
        slots = torch.arange(scores.shape[1], device=q.device)
        scores = scores.masked_fill(slots > pos, float("-inf"))
        keys = kernels._top_n(scores, attn.topk)  # (B, k), -1 past the keys seen
        keys = keys[:, None].expand(B, H, -1)  # one list for every head
        return self.attend_rows(attn, q, buf, keys, keys >= 0)


def check(attn, T=50, steps=20, device="cpu"):
    """The largest difference between the model's own steps' logits and StaticStep's over
    `steps` tokens after a T-token prompt (a small model with two query heads a key head, a
    window of 12 (local's, and the indexer's k), moba blocks of 8, nsa's sizes 4, 2, 8, 5, 6
    and its branch gates drawn at random, so that every
    branch and choice counts; its prompt through the blockwise path on any device, so that a GPU
    compiles no FlexAttention for it): (max |diff|, whether every step's argmax agreed)."""
    from model import Model, ModelConfig, PRESETS
    cfg = ModelConfig(**dict(PRESETS["tiny"], n_kv_head=2, vocab_size=64, attn=attn, kernel="blockwise", window=12, moba_block=8,
                             moba_topk=3, nsa_cmp_block=4, nsa_cmp_stride=2, nsa_block=8, nsa_topk=5, nsa_window=6))
    torch.manual_seed(0)
    model = Model(cfg).to(device).eval()
    for layer in model.layers:
        if isinstance(layer.self_attn, NativeSparseAttention):
            torch.nn.init.normal_(layer.self_attn.branch_gate.weight, std=0.5)
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
