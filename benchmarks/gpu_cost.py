"""What each configuration's GPU path costs, measured on a CPU: the work its attention kernels
are given, and what runs around them.

    python benchmarks/gpu_cost.py                          # T = 2048, 8192, 16384, every configuration
    python benchmarks/gpu_cost.py --T=4096 --only=nsa,moba --out=cost.md
    python benchmarks/gpu_cost.py --quick                  # T = 512, 1024, a few configurations (the tests)

One attention layer (the variant's module: projections, `attend`, output projection) at
qwen-134m's attention shapes (12 heads of 64, d_model 768), B = 1, float32, kernel='flex'
(kernels.FLEX, the GPU path) on the CPU, each variant at its own default sizes (attention.py
gives them "for T = 1024"; they are not rescaled with T). Per configuration and T:

- work: the score elements the attention kernels (`intercept`) are given, per query (and per head):
  each FlexAttention call's BlockMask lists tiles (kv_num_blocks + full_kv_num_blocks), and
  a tile is BLOCK_SIZE[0] x BLOCK_SIZE[1] scores, whatever the mask_mod then drops inside it;
  an SDPA call (kernels.causal_attention, flash on a GPU) counts what FlexAttention would
  list for the same causal mask: every 128 x 128 tile holding a key at or before one of its
  queries. Summed over the layer's calls, divided by T (and by the mask's batch x heads).
- "x dense": that work over dense causal attention's at the same tile granularity,
  nq (nq + 1) / 2 tiles of 128 x 128 for nq = ceil(T / 128) query tiles.
- "x keys": that work over the keys the definition reads per query, averaged over the
  queries and summed over the variant's softmaxes (`definition_keys`): attention_flops's
  with-gradient FLOPs over per_key() (nsa: compressed + selected + window keys; moba: its
  blocks; combiner: its own block, one summary per earlier block, and building those;
  caa: its local window and its top-k keys), except asga's learned gate and the indexer,
  whose FLOPs hold more than keys (the pair gate per key; the indexer's scores): for those
  the keys themselves (asga: every causal key; the indexer: min(t + 1, top-k)).
- ops, GiB: the aten ops dispatched outside the attention kernels, and the bytes of the new
  storages they allocate, in the forward and in the backward (a TorchDispatchMode). An op
  in the backward belongs to the forward region whose autograd node runs it. Built once per
  shape and cached, kernels' fixed block masks (`kernels.create_block_mask`) are not counted.
- largest / T^2: the largest tensor allocated outside the kernels, in elements over T^2
  (any "other" tensor at >= 1 holds T x T elements: T^2 memory, not what a fast form should
  keep), and the same within the parts that are T^2 by definition (`T2_PARTS`: caa's
  ranking of every key, the indexer's scores and its loss, nsa's compressed scores), which
  must be split into pieces sized for a GPU.

Each FlexAttention call (`kernels._run_flex`), SDPA call (`kernels.causal_attention`) and, where
kernels has one (checkouts before the indexer's selected attention became a FlexAttention
call), gathered selected attention (`kernels._gathered_attention`, compiled into one kernel on
a GPU; its work: the n listed keys of each query) and the indexer's sparse-stage loss
over its listed keys (`kernels._listed_kl`, likewise compiled) is intercepted: its BlockMask
read, and a stand-in of the same output shape returned (zeros,
an autograd function whose backward returns zero gradients for q, k, v and the captured
tensors that need them), so the backward of everything around it still runs. FlexAttention
on a CPU has no backward for q, k, v, and run eagerly at T = 16384 it would materialise the
scores. kernels' chunk budgets that depend on the device (a dict with 'cpu' and 'cuda' keys)
take their 'cuda' value, so the chunks are the GPU's. The selections are made from random
inputs, so a data-dependent BlockMask shows a layer at initialisation.

The tests (tests/test_gpu_cost.py) pin what the table shows.
"""
import argparse
import contextlib
import math
import os
import sys
import time
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_check
sys.path.insert(0, ROOT)  # before benchmarks/, whose attention.py is the benchmark

import attention  # noqa: E402
import kernels  # noqa: E402
from attention import mean_keys, causal_keys  # noqa: E402
from gpu_check import CONFIGS  # noqa: E402  every variant, and each flag that changes its kernels
from model import PRESETS, ModelConfig  # noqa: E402

SHAPE = "qwen-134m"
TILE = 128  # FlexAttention's default BLOCK_SIZE, and the tile an SDPA call is counted in
LENGTHS = (2048, 8192, 16384)
QUICK = dict(lengths=(512, 1024), configs=("full", "local", "caa", "combiner", "nsa", "moba", "indexer"))
GIB = 1 << 30

# The parts that are T^2 by definition, where a fast form splits the work into chunks:
# label -> (where in kernels, the kernels budget that sizes its chunks, elements(B, H, T, module)
# of the whole score tensor the definition holds). Ops of an Ops field are found there; of a
# kernels function, by that name.
T2_PARTS = {
    "caa ranking": ("topk_threshold", "TOPK_SCORES", lambda B, H, T, m: B * H * T * T),
    "indexer top-k": ("FLEX.indexer_topk", "INDEX_SCORES", lambda B, H, T, m: B * m.cfg.index_heads * T * T),
    "indexer loss": ("FLEX.indexer_kl", "INDEX_SCORES",
                     lambda B, H, T, m: B * max(H, m.cfg.index_heads) * T * T),
    "nsa compressed": ("flex_compressed_attention", "COMPRESSED_SCORES",
                       lambda B, H, T, m: B * H * T * max(0, (T - m.cfg.nsa_cmp_block) // m.cfg.nsa_cmp_stride + 1)),
    "nsa block scores": ("chunked_block_scores", "COMPRESSED_SCORES",
                         lambda B, H, T, m: B * H * T * max(0, (T - m.cfg.nsa_cmp_block) // m.cfg.nsa_cmp_stride + 1)),
}
KERNELS = "kernels"  # the label of the intercepted FlexAttention and SDPA calls (not counted)
CACHED = "cached masks"  # kernels.create_block_mask: the fixed masks, built once per shape (not counted)
OTHER = "other"


def definition_keys(module, T):
    """Keys per query the variant's definition reads, averaged over t = 0 .. T-1 and summed
    over its softmaxes (see the module docstring)."""
    cfg = module.cfg
    if cfg.attn == "asga" and cfg.asga_gate == "learned":
        return mean_keys(T, causal_keys)
    if cfg.attn == "indexer":
        return mean_keys(T, lambda t: torch.clamp(t + 1, max=module.topk))
    return module.attention_flops(T)[0] / module.per_key()


def causal_tiles(T, S, off, tile=TILE):
    """Tiles of `tile` x `tile` scores holding a key at or before one of their queries, for T
    queries at key positions off .. off + T - 1 among S keys."""
    last = torch.minimum(torch.arange(tile, T + tile, tile), torch.tensor(T)) - 1 + off  # each tile's last query
    return int(torch.clamp(torch.div(last, tile, rounding_mode="floor") + 1, max=math.ceil(S / tile)).sum())


def dense_keys(T):
    """Dense causal attention's work per query, in keys, at `TILE` granularity."""
    return causal_tiles(T, T, 0) * TILE * TILE / T


def budget(name, device="cuda"):
    """A kernels chunk budget (elements) on `device`: a dict by device type, or one int; None
    where kernels has no such name."""
    value = getattr(kernels, name, None)
    return value.get(device, value.get("cpu")) if isinstance(value, dict) else value


def tensors(x):
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def captured(fn, seen=None):
    """The tensors a score_mod or mask_mod reads from its closure (nested functions too)."""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return []
    seen.add(id(fn))
    if isinstance(fn, (list, tuple)):
        return [t for x in fn for t in captured(x, seen)]
    if isinstance(fn, torch.Tensor):
        return [fn]
    found = []
    if isinstance(fn, types.FunctionType):
        for cell in fn.__closure__ or ():
            try:
                found += captured(cell.cell_contents, seen)
            except ValueError:  # an empty cell
                pass
    return found


class Recorder:
    """Per call of an attention kernel: its work; per (phase, label): ops, bytes, largest."""

    def __init__(self):
        self.calls = []
        self.stats = {}
        self.labels = [OTHER]  # the forward's region stack
        self.phase = "fwd"
        self.bwd_label = OTHER
        self.node_label = {}  # autograd node -> the label of the region that created it
        self.counting = True
        self.square_dim = None  # T: a tensor with two dims of at least this is (T, S)-shaped

    def label(self):
        return self.labels[-1] if self.phase == "fwd" else self.bwd_label

    def add(self, op, n_bytes, largest, square=0):
        s = self.stats.setdefault((self.phase, self.label()), dict(ops=0, bytes=0, largest=0, largest_op=None,
                                                                   square=0, square_op=None))
        s["ops"] += 1
        s["bytes"] += n_bytes
        if largest > s["largest"]:
            s["largest"], s["largest_op"] = largest, op
        if square > s["square"]:
            s["square"], s["square_op"] = square, op

    def total(self, phase, what, labels=None):
        rows = [s for (p, label), s in self.stats.items() if p == phase and label not in (KERNELS, CACHED)
                and (labels is None or label in labels)]
        return max((s[what] for s in rows), default=0) if what in ("largest", "square") else sum(s[what] for s in rows)

    def sequence_nr(self):
        """The number the next autograd node will get."""
        self.counting = False
        try:
            with torch.enable_grad():
                return (torch.zeros((), requires_grad=True) * 1).grad_fn._sequence_nr() + 1
        finally:
            self.counting = True

    @contextlib.contextmanager
    def region(self, label):
        """Ops run inside carry `label`, and so do the backward nodes they create (marked on
        the way out: the nodes reachable from the outputs that were created inside)."""
        first = self.sequence_nr()
        self.labels.append(label)
        outputs = []
        try:
            yield outputs
        finally:
            self.labels.pop()
        stack = [t.grad_fn for t in tensors(outputs) if t.grad_fn is not None]
        seen = set()
        while stack:
            node = stack.pop()
            if node is None or node in seen or type(node).__name__ == "AccumulateGrad" or node._sequence_nr() < first:
                continue
            seen.add(node)
            self.node_label.setdefault(node, label)  # an inner region's label stays
            stack += [n for n, _ in node.next_functions]

    def wrap(self, label, fn):
        def wrapped(*args, **kwargs):
            with self.region(label) as outputs:
                out = fn(*args, **kwargs)
                outputs.append(out)
            return out
        return wrapped

    def prepare_backward(self, loss):
        """Every node of loss's graph sets the backward's label before it runs."""
        stack, seen = [loss.grad_fn], set()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            label = self.node_label.get(node, OTHER)

            def enter(grad_outputs, label=label):
                self.bwd_label = label
            node.register_prehook(enter)
            stack += [n for n, _ in node.next_functions]
        self.phase, self.bwd_label = "bwd", OTHER


class Counter(TorchDispatchMode):
    """Counts every aten op and the bytes of the new storages its outputs hold."""

    def __init__(self, rec):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.rec.counting:
            old = {t.untyped_storage().data_ptr() for t in tensors((args, kwargs)) if t.layout == torch.strided}
            new, largest, square = {}, 0, 0
            for t in tensors(out):
                if t.layout != torch.strided:
                    continue
                storage = t.untyped_storage()
                if storage.data_ptr() not in old and storage.nbytes() > 0:
                    new[storage.data_ptr()] = storage.nbytes()
                    largest = max(largest, t.numel())
                    if self.rec.square_dim and sum(d >= self.rec.square_dim for d in t.shape) >= 2:
                        square = max(square, t.numel())  # (.., T, .., S, ..): a score-shaped tensor
            self.rec.add(str(func), sum(new.values()), largest, square)
        return out


class StandIn(torch.autograd.Function):
    """The output of an attention kernel, zeros, with zero gradients for its inputs."""

    @staticmethod
    def forward(ctx, shape, dtype, *inputs):
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in inputs]
        return inputs[0].new_zeros(shape, dtype=dtype)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, *[torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.inputs])


def stand_in(shape, dtype, inputs):
    """StandIn over the inputs that need a gradient (q's shape and device when none do)."""
    grads = [t for t in inputs if t.requires_grad and torch.is_grad_enabled()]
    if not grads:
        return inputs[0].new_zeros(shape, dtype=dtype)
    return StandIn.apply(shape, dtype, *grads)


def mask_work(block_mask, T, S):
    """(score elements per (batch, head) a call is given, its key tile): listed tiles x tile area."""
    if block_mask is None:
        return math.ceil(T / TILE) * math.ceil(S / TILE) * TILE * TILE, TILE
    size = block_mask.BLOCK_SIZE
    bq, bkv = (size, size) if isinstance(size, int) else size
    tiles = block_mask.kv_num_blocks.sum().item()
    if block_mask.full_kv_num_blocks is not None:
        tiles += block_mask.full_kv_num_blocks.sum().item()
    per = block_mask.kv_num_blocks.shape[0] * block_mask.kv_num_blocks.shape[1]  # broadcast masks: 1 x 1
    return tiles * bq * bkv / per, bkv


@contextlib.contextmanager
def intercept(rec):
    """kernels' FlexAttention and SDPA calls replaced by recorded stand-ins, its T^2 parts
    wrapped in labelled regions, its device-keyed budgets at their 'cuda' values."""
    saved = {}

    def patch(name, value):
        saved.setdefault(name, getattr(kernels, name))
        setattr(kernels, name, value)

    def run_flex(q, k, v, score_mod, block_mask, scale, **kwargs):
        with rec.region(KERNELS) as outputs:
            T, S = q.shape[2], k.shape[2]
            work, tile = mask_work(block_mask, T, S)
            rec.calls.append(dict(kind="flex", T=T, S=S, work=work, tile=tile))
            inputs = [q, k, v] + captured(score_mod) + (captured(block_mask.mask_mod) if block_mask is not None else [])
            out = stand_in((*q.shape[:3], v.shape[-1]), q.dtype, inputs)
            if kwargs.get("lse") or kwargs.get("return_lse"):  # kernels._run_flex(..., lse=True): (out, lse)
                out = (out, out.float().sum(-1) * 0)  # a log-sum-exp that carries a gradient, as FlexAttention's does
            elif kwargs.get("return_aux") is not None:
                from torch.nn.attention.flex_attention import AuxOutput
                out = (out, AuxOutput(lse=torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)))
            outputs.append(out)
        return out

    def causal(q, k, v, off, scale, *args, **kwargs):
        with rec.region(KERNELS) as outputs:
            T, S = q.shape[2], k.shape[2]
            rec.calls.append(dict(kind="sdpa", T=T, S=S, work=causal_tiles(T, S, off) * TILE * TILE, tile=TILE))
            out = stand_in(q.shape, q.dtype, [q, k, v])
            outputs.append(out)
        return out

    def gathered(q, k, v, scale, q_start, k_start, keys, *args, **kwargs):
        """The indexer's selected attention by index (one compiled kernel on a GPU): n keys a query."""
        with rec.region(KERNELS) as outputs:
            T, S = q.shape[2], k.shape[2]
            rec.calls.append(dict(kind="gather", T=T, S=S, work=T * keys.shape[-1], tile=0))
            out = stand_in(q.shape, v.dtype, [q, k, v])
            outputs.append(out)
        return out

    def listed_kl(q, k, scale, q_idx, k_idx, w, *args, **kwargs):
        """The indexer's sparse-stage KL over its listed keys by index (one compiled kernel
        on a GPU, like the gathered attention; eager it would gather T x n x D): a zero loss
        with zero gradients for the indexer's tensors."""
        with rec.region(KERNELS) as outputs:
            loss = sum(t.float().sum() * 0 for t in (q_idx, k_idx, w) if t.requires_grad) + q.new_zeros(())
            outputs.append(loss)
        return loss

    patch("_run_flex", run_flex)
    patch("causal_attention", causal)
    if hasattr(kernels, "_gathered_attention"):
        patch("_gathered_attention", gathered)
    if hasattr(kernels, "_listed_kl"):
        patch("_listed_kl", listed_kl)
    patch("create_block_mask", rec.wrap(CACHED, kernels.create_block_mask))
    fields = {}
    for label, (where, _, _) in T2_PARTS.items():
        if where.startswith("FLEX."):
            field = where.split(".")[1]
            if field in kernels.FLEX._fields:
                fields[field] = rec.wrap(label, getattr(kernels.FLEX, field))
        elif hasattr(kernels, where):
            patch(where, rec.wrap(label, getattr(kernels, where)))
    patch("FLEX", kernels.FLEX._replace(**fields))
    for name, value in list(vars(kernels).items()):
        if isinstance(value, dict) and {"cpu", "cuda"} <= set(value):
            patch(name, {**value, "cpu": value["cuda"]})
    try:
        yield rec
    finally:
        for name, value in saved.items():
            setattr(kernels, name, value)


def make_module(name, flags):
    attn = name.split("-")[0]
    cfg = ModelConfig(**{**PRESETS[SHAPE], "vocab_size": 50304, "attn": attn, "kernel": "flex", **flags})
    torch.manual_seed(0)
    return attention.VARIANTS[attn](cfg)


def measure(name, flags, T, B=1, backward=True, count=True, grad=True):
    """One layer of configuration `name` at T tokens: a dict of what the table shows, with
    the Recorder under "recorder". count=False: the kernels' work only (no op counting, no
    backward), of a forward with gradients enabled (grad=True: the tiles training uses) or
    without (grad=False: evaluation's, which may be smaller; kernels.selection_tiles)."""
    module = make_module(name, flags)
    module.train()
    cfg = module.cfg
    torch.manual_seed(1)
    x = torch.randn(B, T, cfg.d_model)
    cos, sin = attention.rope_cos_sin(torch.arange(T), cfg.head_dim, cfg.rope_theta)
    rec = Recorder()
    rec.square_dim = T
    t0 = time.perf_counter()
    with intercept(rec):
        if not count:
            with torch.set_grad_enabled(grad):
                module(x, cos, sin, 0)
        else:
            x.requires_grad_(True)
            with Counter(rec):
                y = module(x, cos, sin, 0)
                loss = y.sum()
                if getattr(module, "indexer_loss", None) is not None:
                    loss = loss + module.indexer_loss
            rec.prepare_backward(loss)
            if backward:
                with Counter(rec):
                    loss.backward()
            rec.node_label = {}  # lets the graph go
    flex = [c for c in rec.calls if c["kind"] == "flex"]
    work = sum(c["work"] for c in rec.calls) / T
    keys = definition_keys(module, T)
    row = dict(config=name, T=T, B=B, calls=len(rec.calls), flex_calls=len(flex),
               work_keys=work, dense_keys=dense_keys(T), definition_keys=keys,
               x_dense=work / dense_keys(T), x_keys=work / keys,
               band_keys=sum(c["tile"] for c in flex), seconds=time.perf_counter() - t0, recorder=rec, module=module)
    if count:
        parts = set(T2_PARTS)
        others = {OTHER}
        for phase in ("fwd", "bwd"):
            row[f"ops_{phase}"] = rec.total(phase, "ops")
            row[f"gib_{phase}"] = rec.total(phase, "bytes") / GIB
            row[f"ops_{phase}_other"] = rec.total(phase, "ops", others)
            row[f"ops_{phase}_parts"] = {p: rec.total(phase, "ops", {p}) for p in parts
                                         if (phase, p) in rec.stats}
        row["largest_other"] = max(rec.total(p, "largest", others) for p in ("fwd", "bwd"))
        row["square_other"] = max(rec.total(p, "square", others) for p in ("fwd", "bwd"))
        row["largest_parts"] = {p: max(rec.total(ph, "largest", {p}) for ph in ("fwd", "bwd")) for p in parts
                                if ("fwd", p) in rec.stats or ("bwd", p) in rec.stats}
    return row


def cells(r):
    T2 = r["T"] ** 2
    parts = r.get("largest_parts") or {}
    part_ops = sum(r["ops_fwd_parts"].values()), sum(r["ops_bwd_parts"].values())
    return [r["config"], r["T"], f"{r['x_dense']:.2f}", f"{r['x_keys']:.1f}", r["calls"],
            f"{r['ops_fwd']:,}", f"{r['ops_bwd']:,}", f"{part_ops[0]:,} / {part_ops[1]:,}" if parts else "-",
            f"{r['gib_fwd']:.2f}", f"{r['gib_bwd']:.2f}", f"{r['largest_other'] / T2:.3g}",
            f"{max(parts.values()) / T2:.3g}" if parts else "-"]


HEADER = ["config", "T", "work x dense", "work x keys", "calls", "ops fwd", "ops bwd", "of which T^2 parts",
          "GiB fwd", "GiB bwd", "largest / T^2", "largest in T^2 parts / T^2"]


def markdown(rows, note=""):
    lines = [f"### gpu_cost: one {SHAPE} attention layer (B = 1, float32, kernel=flex on CPU), "
             f"torch {torch.__version__}"]
    if note:
        lines.append(note)
    lines += ["", "| " + " | ".join(HEADER) + " |", "|---" * len(HEADER) + "|"]
    lines += ["| " + " | ".join(str(c) for c in cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", help=f"comma-separated lengths (default {','.join(map(str, LENGTHS))})")
    parser.add_argument("--only", help="comma-separated configurations (default: all of gpu_check.CONFIGS)")
    parser.add_argument("--quick", action="store_true", help=f"T = {QUICK['lengths']}, a few configurations")
    parser.add_argument("--out", help="also write the table as Markdown to this file")
    parser.add_argument("--calls", action="store_true", help="under each row, every kernel call's work per query "
                        "(keys, the diagonal band included) and its key tile")
    args = parser.parse_args(argv)
    lengths = QUICK["lengths"] if args.quick else LENGTHS
    if args.T:
        lengths = tuple(int(t) for t in args.T.split(","))
    configs = list(CONFIGS)
    wanted = args.only.split(",") if args.only else (QUICK["configs"] if args.quick else None)
    if wanted:
        unknown = set(wanted) - {n for n, _ in CONFIGS}
        if unknown:
            sys.exit(f"error: unknown --only {', '.join(sorted(unknown))}; valid: {', '.join(n for n, _ in CONFIGS)}")
        configs = [c for c in configs if c[0] in wanted]
    print(" | ".join(HEADER), flush=True)
    rows = []
    for T in lengths:
        for name, flags in configs:
            row = measure(name, flags, T)
            calls = row.pop("recorder").calls
            row.pop("module")
            rows.append(row)
            print(" | ".join(str(c) for c in cells(row)) + f"   ({row['seconds']:.1f} s)", flush=True)
            for c in calls if args.calls else ():
                print(f"    {c['kind']:6s} over {c['S']:6d} keys, key tile {c['tile']:3d}: {c['work'] / T:8.0f} keys per query")
    if args.out:
        with open(args.out, "w") as f:
            f.write(markdown(rows, f"\n    python benchmarks/gpu_cost.py {' '.join(argv or sys.argv[1:])}\n"))
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
