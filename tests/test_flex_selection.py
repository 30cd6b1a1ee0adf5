"""FLEX's selecting kernels (kernels.py, "selected blocks"): block attention (nsa's selected
branch, moba) as one FlexAttention call over a virtual query sequence sorted by key tile,
merged by log-sum-exp; the work each BlockMask leaves against the keys the definition reads
(the GPU path's goal: work that follows the selection); combiner's BlockMask likewise.

On CPU, eager FlexAttention has no backward for q, k, v. The gradients of everything around
the kernel (the gather of the queries, the merge) are tested with `dense_flex` in place of
kernels._run_flex: the same attention computed densely from the BlockMask's mask_mod on index
grids, restricted to the tiles the BlockMask lists, and an error where the mask_mod needs a
key in a tile it does not list. The kernel itself (eager FlexAttention) is compared for
outputs; GPU kernels: /work/shared/tools/gpu_*_check.py.
"""
import warnings

import pytest
import torch

import attention
import kernels

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-2)).item()


def listed(block_mask, B, H, Tq, S):
    """(B, H, Tq, S) bool: the elements inside the tiles a BlockMask lists (partial or full)."""
    qb, kb = block_mask.BLOCK_SIZE
    tiles = block_mask.to_dense().bool()  # (B or 1, H or 1, nq, nk)
    dense = tiles.repeat_interleave(qb, 2).repeat_interleave(kb, 3)[:, :, :Tq, :S]
    return dense.expand(B, H, Tq, S)


def dense_flex(q, k, v, score_mod, block_mask, scale, lse=False, kernel_options=None):
    """kernels._run_flex computed densely (differentiable on CPU): mask_mod and score_mod on
    index grids, only inside the listed tiles; raises where the mask_mod keeps a key outside
    them (a tile the BlockMask fails to list)."""
    B, H, Tq, D = q.shape
    S = k.shape[2]
    b, h, i, j = (torch.arange(n).view([-1 if d == a else 1 for d in range(4)])
                  for a, n in enumerate((B, H, Tq, S)))
    need = block_mask.mask_mod(b, h, i, j).expand(B, H, Tq, S)
    inside = listed(block_mask, B, H, Tq, S)
    missing = (need & ~inside).sum().item()
    assert missing == 0, f"{missing} (row, key) pairs the mask_mod keeps lie in tiles the BlockMask does not list"
    mask = need & inside
    k, v = kernels.expand_kv(k, H), kernels.expand_kv(v, H)
    scores = (q @ k.transpose(-2, -1)) * scale
    if score_mod is not None:
        scores = score_mod(scores, b, h, i, j)
    out = kernels._softmax_or_zero(scores, mask).to(v.dtype) @ v
    if not lse:
        return out
    return out, torch.logsumexp(scores.float().masked_fill(~mask, float("-inf")), -1)


def random_blocks(B, H, T, q_start, block, n, seed, empty=0.2):
    """The own block, random earlier ones (repeats possible), some empty slots."""
    g = torch.Generator().manual_seed(seed)
    own = (q_start + torch.arange(T)) // block
    blocks = torch.stack([torch.randint(0, 10**6, (B, H, T), generator=g) % (own + 1) for _ in range(n - 1)], -1)
    blocks = torch.cat([own.expand(B, H, T)[..., None], blocks], -1)
    return blocks.masked_fill(torch.rand(B, H, T, n, generator=g) < empty, -1)


CASES = [  # T, q_start, k_start, block, n: T not a multiple of the block or tile, cached keys
    (45, 0, 0, 8, 3), (257, 0, 0, 16, 4), (300, 0, 0, 160, 3), (40, 300, 0, 16, 4),
    (40, 300, 150, 16, 3), (33, 300, 260, 32, 2), (200, 0, 0, 4, 5), (130, 0, 0, 32, 8)]


@pytest.mark.parametrize("kv_tile", [128, 32, 16])
@pytest.mark.parametrize("T,q_start,k_start,block,n", CASES)
def test_block_attention_rows_equal_the_reference(monkeypatch, T, q_start, k_start, block, n, kv_tile):
    """Outputs and gradients of q, k, v against attention.block_attention, kernel = dense_flex;
    GQA (4 query heads on 2 key heads); key tiles of 128 (a row holds several blocks, or part
    of one of 160), 32 and 16 (a block over several tiles, or one tile per block)."""
    monkeypatch.setattr(kernels, "_run_flex", dense_flex)
    monkeypatch.setattr(kernels, "SELECTION_KV_TILE", kv_tile)
    S = q_start + T - k_start
    g = torch.Generator().manual_seed(T + q_start + block)
    q = torch.randn(2, 4, T, 8, generator=g, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(2, 2, S, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    blocks = random_blocks(2, 4, T, q_start, block, n, T)
    blocks[:, :, 5] = -1  # a query with nothing listed
    cot = torch.randn(2, 4, T, 8, generator=g, dtype=torch.float64)
    ref = attention.block_attention(q, k, v, 0.3, q_start, k_start, block, blocks)
    out = kernels.FLEX.block_attention(q, k, v, 0.3, q_start, k_start, block, blocks)
    assert out[:, :, 5].abs().max() == 0
    assert rel(out, ref) < 1e-5  # both softmaxes in float32
    for a, b in zip(torch.autograd.grad(out, (q, k, v), cot), torch.autograd.grad(ref, (q, k, v), cot)):
        assert rel(a, b) < 1e-5


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("T,q_start,k_start,block,n", CASES)
def test_block_attention_eager_flex_equals_the_reference(monkeypatch, T, q_start, k_start, block, n, grad):
    """The real (eager) FlexAttention call, with its log-sum-exp, in both geometries: 128 x 128
    tiles (a backward runs) and the key tile matched to the block (none does)."""
    tiles = kernels.selection_tiles
    monkeypatch.setattr(kernels, "selection_tiles", lambda block, _: tiles(block, grad))
    S = q_start + T - k_start
    g = torch.Generator().manual_seed(T + q_start)
    q = torch.randn(2, 4, T, 8, generator=g)
    k, v = (torch.randn(2, 2, S, 8, generator=g) for _ in range(2))
    blocks = random_blocks(2, 4, T, q_start, block, n, T)
    ref = attention.block_attention(q, k, v, 0.3, q_start, k_start, block, blocks)
    assert rel(kernels.FLEX.block_attention(q, k, v, 0.3, q_start, k_start, block, blocks), ref) < 1e-5


def test_decode_sized_calls_gather_their_blocks(monkeypatch):
    """T <= DECODE_ROWS: attention.ops gives DECODE, which gathers each query's blocks from the
    cache (no FlexAttention call, no compile per cache length); outputs and gradients equal
    the reference, repeated and empty slots included."""
    monkeypatch.setattr(kernels, "_run_flex", None)  # any call fails
    g = torch.Generator().manual_seed(3)
    for T, q_start, k_start in [(1, 300, 0), (16, 290, 100), (3, 40, 36)]:
        S = q_start + T - k_start
        q = torch.randn(1, 4, T, 8, generator=g, dtype=torch.float64).requires_grad_()
        k, v = (torch.randn(1, 2, S, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
        blocks = random_blocks(1, 4, T, q_start, 8, 4, T)
        blocks[0, 1, 0] = torch.tensor([q_start // 8, q_start // 8, -1, 0])  # a repeat; block 0 may be cached out
        ref = attention.block_attention(q, k, v, 0.3, q_start, k_start, 8, blocks)
        assert attention.ops("flex", "cpu", T) is kernels.DECODE is attention.ops("fused", "cuda", T)
        out = kernels.DECODE.block_attention(q, k, v, 0.3, q_start, k_start, 8, blocks)
        assert rel(out, ref) < 1e-5  # both softmaxes in float32
        for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
            assert rel(a, b) < 1e-5


# ---------------------------------------------------------------------------- work against the keys read

def work_of(call, *args):
    """(FlexAttention work: tiles listed x tile area, rows: its query rows) of one op call,
    with the kernel replaced by a stub that only reads the BlockMask."""
    seen = []

    def stub(q, k, v, score_mod, block_mask, scale, lse=False, kernel_options=None):
        m = block_mask
        reps = q.shape[0] * q.shape[1] // (m.kv_num_blocks.shape[0] * m.kv_num_blocks.shape[1])
        tiles = m.kv_num_blocks.sum() + (0 if m.full_kv_num_blocks is None else m.full_kv_num_blocks.sum())
        seen.append(tiles.item() * reps * m.BLOCK_SIZE[0] * m.BLOCK_SIZE[1])
        out = torch.zeros(*q.shape[:3], v.shape[-1])
        return (out, torch.zeros(q.shape[:3])) if lse else out

    saved, kernels._run_flex = kernels._run_flex, stub
    try:
        call(*args)
    finally:
        kernels._run_flex = saved
    return sum(seen)


def keys_read(blocks, block, q_start):
    """Keys attention.block_attention reads: each query's distinct listed blocks, up to itself."""
    n = blocks.shape[-1]
    repeat = ((blocks[..., :, None] == blocks[..., None, :]) & torch.ones(n, n, dtype=torch.bool).tril(-1)).any(-1)
    t = q_start + torch.arange(blocks.shape[2])[:, None]
    return (t - blocks * block + 1).clamp(0, block).masked_fill((blocks < 0) | repeat, 0).sum().item()


@pytest.mark.parametrize("block,n,grad,bound", [(64, 4, True, 2.5), (32, 8, True, 4.0), (64, 4, False, 1.5),
                                                (32, 8, False, 1.5)])
def test_block_attention_work_follows_the_keys_read(block, n, grad, bound):
    """moba's (block 64, 4 blocks) and nsa's (32, 8) sizes, random earlier blocks (no locality,
    the worst case for sharing tiles), T = 4096: tiles x area at most `bound` x the keys the
    definition reads plus one diagonal band of 128-key tiles (T x 128 a head). With a backward
    the tiles are 128 x 128 (the sm_90 backward's), so a 32-key block costs up to a 128-key tile
    (kernels.py, "selected blocks"); without one the key tile is the block."""
    B, H, T = 1, 2, 4096
    q = torch.zeros(B, H, T, 16, requires_grad=grad)
    k = v = torch.zeros(B, H, T, 16)
    blocks = random_blocks(B, H, T, 0, block, n, 0, empty=0.0)
    work = work_of(kernels.FLEX.block_attention, q, k, v, 0.25, 0, 0, block, blocks)
    assert work <= bound * keys_read(blocks, block, 0) + B * H * T * 128


def test_block_attention_work_does_not_grow_with_the_sequence():
    """The old BlockMask (the union of a 128-query tile's blocks) grew as T^2 with per-token
    choices; here the work per key read stays flat from T = 1024 to 8192."""
    ratios = []
    for T in (1024, 8192):
        blocks = random_blocks(1, 1, T, 0, 64, 4, 1, empty=0.0)
        q = torch.zeros(1, 1, T, 16, requires_grad=True)
        work = work_of(kernels.FLEX.block_attention, q, q, q, 0.25, 0, 0, 64, blocks)
        ratios.append(work / keys_read(blocks, 64, 0))
    assert ratios[1] < 1.1 * ratios[0]


def test_combiner_work_follows_the_keys_read():
    """combiner (block s = 256, T = 4096): its BlockMask's tiles x area at most 2.5 x the keys
    its definition reads (own block up to the query, one summary per earlier block) plus one
    diagonal band."""
    B, H, T, s = 1, 2, 4096, 256
    q = k = v = torch.zeros(B, H, T, 16)
    kbar, vbar = torch.zeros(B, H, T // s, 16), torch.zeros(B, H, T // s, 16)
    work = work_of(kernels.FLEX.combiner_attention, q, k, v, kbar, vbar, 0.25, 0, 0, s)
    t = torch.arange(T)
    read = B * H * (t % s + 1 + t // s).sum().item()
    assert work <= 2.5 * read + B * H * T * 128


# ---------------------------------------------------------------------------- nsa's compressed branch

def test_compressed_branch_decode_sized_and_empty():
    """The compressed branch for a few queries (DECODE: no FlexAttention call) and with no
    compressed key yet (C = 0, FLEX and DECODE): equal to the reference, outputs, gradients
    and the blocks chosen from its block scores."""
    g = torch.Generator().manual_seed(4)

    def choose(scores, t0):
        return attention.nsa_top_blocks(scores, t0, 4, 2, 2)

    for T, q_start, C in [(3, 40, 19), (16, 0, 3), (5, 0, 0)]:
        q = torch.randn(1, 4, T, 8, generator=g, dtype=torch.float64).requires_grad_()
        k, v = (torch.randn(1, 2, C, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
        ref, ref_blocks = attention.compressed_branch(q, k, v, 0.3, q_start, 4, 2, 4, choose)
        saved, kernels._run_flex = kernels._run_flex, None  # any FlexAttention call fails
        try:
            out, blocks = kernels.DECODE.compressed_branch(q, k, v, 0.3, q_start, 4, 2, 4, choose)
            if C == 0:
                assert torch.equal(kernels.FLEX.compressed_branch(q, k, v, 0.3, q_start, 4, 2, 4, None)[0], out)
        finally:
            kernels._run_flex = saved
        assert out.shape == ref.shape and rel(out, ref) < 1e-6
        assert torch.equal(blocks, ref_blocks)
        if C:
            for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
                assert rel(a, b) < 1e-6


def test_compressed_attention_work_is_the_keys_read():
    """nsa's sizes (l = 16, d = 8), T = 4096: one FlexAttention call whose tiles x area is at
    most the compressed keys the queries see plus one band of 128-key tiles; the chunked
    dense form it replaced read the same keys but kept each chunk's (rows, C) scores."""
    B, H, T = 1, 2, 4096
    C = (T - 16) // 8 + 1
    q, k = torch.zeros(B, H, T, 16), torch.zeros(B, H, C, 16)
    work = work_of(kernels.flex_compressed_attention, q, k, k, 0.25, 0, 16, 8)
    t = torch.arange(T)
    read = B * H * ((t - 15) // 8 + 1).clamp(min=0).sum().item()
    assert work <= read + B * H * T * 128
