"""What the runs learned: loss curves, gate dynamics, gates by token category, attention maps.

    python analyze.py                               # the most recent runs under out/
    python analyze.py out/full out/dsa out/caa      # these runs
    python analyze.py RUN ... [--out_dir=out/analysis] [--target_loss=5.0] [--text=FILE]
                      [--layer=-1] [--head=0] [--n_tokens=2048] [--max_runs=8]

A run is a train.py output folder: config.json, log.jsonl (one record per step; evaluation
steps carry `val` and the gate statistics of model.gate_stats()) and ckpt.pt. Figures and
`summary.md` (a table of the runs) go to --out_dir; `summary.json` holds the same numbers.

Table columns, all read from log.jsonl: the last logged validation loss; tokens/s, the
median of the per-step `tok_s` (step 1 left out: it pays for warm-up and compilation);
peak memory, the largest `mem_gb` logged (GPU: max_memory_allocated; CPU: peak RSS); both
also as a ratio to the `full` run when one is present; and the first evaluation step whose
validation loss is <= the target loss (the seeds' "convergence speed"). The target is
--target_loss when given, else the final validation loss of the `full` run (steps to
match the baseline), else the highest final validation loss among the runs (so every run
reaches it).

Loss by position (positions.png) is drawn from each run's eval.json (evaluate.py, which
train.py runs at the end of a run); runs without one are left out of that figure.

What analyze.py draws beyond every gate's statistics is what the run's attention class
declares (attention.py): its `settings` name the run, its `DYNAMICS` get a figure over
training, and a variant that selects (`selection_unit`: nsa, moba, indexer) gets one figure
of what it selected (`selection_stats`): how far back the selected blocks or keys lie, by
layer, and a selection map; the gates of its `BRANCHES` (nsa's three) by layer x head and by
position; the indexer's kept mass (the share of the dense attention's mass on the selected
keys) and KL over training, from log.jsonl.

Gates by token category, attention maps and selections need the checkpoint and some text: --text (a
.txt or .jsonl file), else the run's validation shard (train_config's data_dir); without
either these figures are skipped with a note in summary.md.
"""
import json
import math
import statistics
import sys
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from attention import VARIANTS

DEFAULT_ROOT = "out"  # train.py's out_dir is out/run: one folder per run under out/
DEFAULTS = dict(out_dir="out/analysis", target_loss=0.0, text="", layer=-1, head=0,
                n_tokens=2048, attn_tokens=48, max_runs=8, root=DEFAULT_ROOT)
CATEGORIES = ("punctuation", "digits", "function words", "capitalised", "other")
# Common English function words (articles, pronouns, prepositions, conjunctions, auxiliaries).
FUNCTION_WORDS = frozenset("""
a an the and or but nor so yet if then than as of to in on at by for with from into onto
about over under after before between through during without within up down out off
is are was were be been being am do does did have has had will would can could shall should
may might must it its this that these those he him his she her hers they them their we us
our you your i me my not no who whom whose which what when where why how there here all
any some each every such""".split())


class RunError(Exception):
    """A run folder that cannot be analysed; the message names the path and the problem."""


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ----------------------------------------------------------------------------- runs

def load_run(path):
    """A run folder -> {'name', 'path', 'model', 'train', 'steps': [records], 'evals': [...]}.

    `steps` are log.jsonl's per-step records (event records such as start/end are left out,
    lines cut short by a kill are skipped, and a step logged twice (a resumed run) keeps its
    last record); `evals` are the ones with a validation loss."""
    path = Path(path)
    if not path.exists():
        raise RunError(f"{path}: no such run folder")
    if not path.is_dir():
        path = path.parent  # a run's ckpt.pt or log.jsonl was named
    log_path = path / "log.jsonl"
    if not log_path.is_file():
        raise RunError(f"{path}: not a train.py run (no log.jsonl)")
    try:
        lines = log_path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise RunError(f"{log_path}: cannot read ({e})") from None
    by_step, start = {}, {}
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            continue
        if "event" in record:
            if record["event"] in ("start", "resume"):
                start = record
            continue
        by_step[record["step"]] = record
    if not by_step:
        raise RunError(f"{log_path}: holds no step records")
    config = {}
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = start  # the start record carries the same run information
    model, train = config.get("model"), config.get("train")
    if not isinstance(model, dict) or "attn" not in model:
        raise RunError(f"{path}: no model config (config.json missing or unreadable, and no "
                       f"start record in log.jsonl)")
    steps = [by_step[s] for s in sorted(by_step)]
    return {"name": path.name, "path": path, "model": model, "train": train or {},
            "device": config.get("device", "?"), "steps": steps,
            "evals": [r for r in steps if isinstance(r.get("val"), (int, float))]}


def recent_runs(root, max_runs):
    """The newest run of each distinct configuration under root, at most max_runs of them,
    oldest first. Folders that are not readable runs are skipped with a note."""
    root = Path(root)
    if not root.is_dir():
        raise RunError(f"{root}: no runs folder (train.py writes runs to out/NAME; or name "
                       f"the runs: python analyze.py RUN [RUN ...])")
    candidates = sorted((p for p in root.iterdir() if (p / "log.jsonl").is_file()),
                        key=lambda p: (p / "log.jsonl").stat().st_mtime, reverse=True)
    runs, seen = [], set()
    for path in candidates:
        try:
            run = load_run(path)
        except RunError as e:
            print(f"note: skipping {e}", file=sys.stderr)
            continue
        key = (describe(run), run["train"].get("model"))
        if key not in seen:
            seen.add(key)
            runs.append(run)
        if len(runs) == max_runs:
            break
    if not runs:
        raise RunError(f"{root}: holds no readable runs (folders with log.jsonl)")
    return runs[::-1]


def describe(run):
    """'dsa (dsa_window=fixed, window=8)': the variant and its flags that are not at their
    default, among those its class names (`settings`; a variant no longer in VARIANTS: none)."""
    from model import ModelConfig

    defaults = {f.name: f.default for f in fields(ModelConfig)}
    m = run["model"]
    variant = VARIANTS.get(m["attn"])
    settings = variant.settings(SimpleNamespace(**{**defaults, **m})) if variant else ()
    flags = [f"{k}={m[k]}" for k in settings if k in m and m[k] != defaults.get(k)]
    return m["attn"] + (f" ({', '.join(flags)})" if flags else "")


def _title(run):
    """'run_name: variant (flags)', or just the variant when the run is named after it."""
    return describe(run) if run["name"] == describe(run) else f"{run['name']}: {describe(run)}"


# ----------------------------------------------------------------------------- table

def _tok_s(record):
    return record["tok_s"] if isinstance(record.get("tok_s"), (int, float)) else None


def _mem_gb(record):
    return record["mem_gb"] if isinstance(record.get("mem_gb"), (int, float)) else None


def summarize(run):
    """The table's numbers for one run, straight from its log (module docstring)."""
    speeds = [v for r in run["steps"] if (v := _tok_s(r)) is not None]
    speeds = speeds[1:] or speeds  # the first timed step pays for warm-up and compilation
    mems = [v for r in run["steps"] if (v := _mem_gb(r)) is not None]
    last = run["evals"][-1] if run["evals"] else None
    return {"name": run["name"], "path": str(run["path"]), "variant": describe(run),
            "attn": run["model"]["attn"], "model": run["train"].get("model", "?"),
            "device": run["device"], "last_step": run["steps"][-1]["step"],
            "final_val": last["val"] if last else None, "final_val_step": last["step"] if last else None,
            "tok_s": statistics.median(speeds) if speeds else None,
            "mem_gb": max(mems) if mems else None}


def steps_to_target(run, target):
    """The first evaluation step whose validation loss is <= target (None: never)."""
    return next((r["step"] for r in run["evals"] if r["val"] <= target), None)


def choose_target(rows, given):
    finals = [r["final_val"] for r in rows if r["final_val"] is not None]
    full = [r["final_val"] for r in rows if r["attn"] == "full" and r["final_val"] is not None]
    if given > 0:
        return given, "given with --target_loss"
    if full:
        return full[-1], "the final validation loss of the `full` run (steps to match the baseline)"
    if finals:
        return max(finals), "the highest final validation loss among these runs (every run reaches it)"
    return None, "no run has a validation loss"


def build_table(runs, target_loss=0.0):
    rows = [summarize(run) for run in runs]
    target, rule = choose_target(rows, target_loss)
    full = next((r for r in rows if r["attn"] == "full"), None)
    for run, row in zip(runs, rows):
        row["steps_to_target"] = steps_to_target(run, target) if target is not None else None
        for key in ("tok_s", "mem_gb"):
            ok = full is not None and full[key] and row[key] is not None
            row[f"{key}_vs_full"] = row[key] / full[key] if ok else None
    return {"target_loss": target, "target_rule": rule, "runs": rows}


def _fmt(value, spec, suffix=""):
    return "–" if value is None else format(value, spec) + suffix


def table_markdown(table):
    lines = ["| run | variant and flags | model | val loss (step) | tok/s | vs full | peak mem GB "
             "| vs full | steps to target |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in table["runs"]:
        val = "–" if r["final_val"] is None else f"{r['final_val']:.4f} ({r['final_val_step']})"
        reached = r["steps_to_target"] if r["steps_to_target"] is not None else "not reached"
        lines.append(f"| {r['name']} | {r['variant']} | {r['model']} | {val} | {_fmt(r['tok_s'], '.0f')} "
                     f"| {_fmt(r['tok_s_vs_full'], '.2f', 'x')} | {_fmt(r['mem_gb'], '.2f')} "
                     f"| {_fmt(r['mem_gb_vs_full'], '.2f', 'x')} "
                     f"| {reached} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- training figures

def plot_losses(runs, path):
    """Train loss (thin) and validation loss (markers) of every run on one plot."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        train = [(r["step"], r["loss"]) for r in run["steps"] if isinstance(r.get("loss"), (int, float))]
        if train:
            ax.plot(*zip(*train), color=color, alpha=0.35, lw=0.8)
        if run["evals"]:
            ax.plot([r["step"] for r in run["evals"]], [r["val"] for r in run["evals"]], "o-",
                    color=color, ms=3, label=_title(run))
    ax.set(xlabel="step", ylabel="loss", title="train (thin) and validation (dots) loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_loss_by_position(runs, path):
    """Loss by position (evaluate.py's eval.json in each run folder): one line per run and
    length (solid at the trained length, dashed 2x, dotted 4x), 95% intervals as bands, on
    log-scaled positions. Returns the runs drawn (none: no figure)."""
    drawn = []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, run in enumerate(runs):
        try:
            lengths = json.loads((run["path"] / "eval.json").read_text()).get("positions") or []
        except (OSError, ValueError, AttributeError):
            continue
        for r in lengths:
            if "buckets" not in r:  # a length the val data could not fill
                continue
            b = r["buckets"]
            x = [math.sqrt(k["first"] * k["last"]) for k in b]  # the bucket's geometric middle
            y, ci = np.array([k["mean"] for k in b]), np.array([k["ci95"] for k in b])
            style = {1: "-", 2: "--"}.get(r.get("factor"), ":")
            label = f"{_title(run)}, {r['seq_len']} tokens" + (f" ({r['factor']}x)" if r.get("factor", 1) > 1 else "")
            ax.plot(x, y, style, color=f"C{i % 10}", marker="o", ms=3, label=label)
            ax.fill_between(x, y - ci, y + ci, color=f"C{i % 10}", alpha=0.12)
        drawn += [run["name"]] if any("buckets" in r for r in lengths) else []
    if drawn:
        ax.set_xscale("log", base=2)
        ax.set(xlabel="position (tokens of context; buckets 1, 2-3, 4-7, ...)", ylabel="val loss (nats/token)",
               title="loss by position (eval.json; band: 95% interval over sequences)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def gate_history(run):
    """{gate name: (steps, array (n_evals, layers, heads) of per-head means)} from the log."""
    out = {}
    for r in run["evals"]:
        for name, stats in (r.get("gates") or {}).items():
            if isinstance(stats, dict) and stats.get("mean"):
                out.setdefault(name, ([], []))
                out[name][0].append(r["step"])
                out[name][1].append(np.array(stats["mean"], dtype=np.float64))
    return {name: (steps, np.stack(means)) for name, (steps, means) in out.items()
            if len({m.shape for m in means}) == 1}


def plot_gate_history(run, history, path):
    """Per gate: a heatmap of the per-head mean over training (rows layer.head, columns
    evaluation steps), and the final layer x head map beside it."""
    plt = _plt()
    names = sorted(history)
    fig, axes = plt.subplots(len(names), 2, figsize=(10, 2.6 * len(names) + 0.6), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]})
    for (ax, ax_final), name in zip(axes, names):
        steps, means = history[name]  # means (E, L, H)
        E, L, H = means.shape
        im = ax.imshow(means.reshape(E, L * H).T, aspect="auto", cmap="viridis", interpolation="nearest")
        ticks = range(0, E, max(1, E // 8))
        ax.set_xticks(list(ticks), [str(steps[t]) for t in ticks], fontsize=7)
        ax.set_yticks(range(L * H), [f"L{l}.H{h}" for l in range(L) for h in range(H)],
                      fontsize=max(4, 8 - L * H // 16))
        ax.set(xlabel="step", title=f"{name}: per-head mean over training")
        fig.colorbar(im, ax=ax).ax.ticklabel_format(useOffset=False)
        im = ax_final.imshow(means[-1], aspect="auto", cmap="viridis", interpolation="nearest")
        ax_final.set(xlabel="head", ylabel="layer", title=f"step {steps[-1]}")
        ax_final.set_xticks(range(H))
        ax_final.set_yticks(range(L))
        for l in range(L):
            for h in range(H):
                if L * H <= 64:
                    ax_final.text(h, l, f"{means[-1, l, h]:.2g}", ha="center", va="center",
                                  fontsize=6, color="w")
        fig.colorbar(im, ax=ax_final).ax.ticklabel_format(useOffset=False)
    fig.suptitle(_title(run), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_variant_dynamics(run, history, path):
    """The notes the run's attention class draws over training (its `DYNAMICS`: e.g. asga's
    softplus(gamma) per head and mean pair gate, caa's mix gate and learned window width, per
    layer), one panel each; False when it has none in the log."""
    variant = VARIANTS.get(run["model"]["attn"])
    panels = [p for p in (variant.DYNAMICS if variant else ()) if p[0] in history]
    if not panels:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (name, title, per_head) in zip(axes[0], panels):
        steps, means = history[name]  # (E, L, H)
        for l in range(means.shape[1]):
            if per_head:
                for h in range(means.shape[2]):
                    ax.plot(steps, means[:, l, h], color=f"C{l % 10}", lw=0.9, alpha=0.8,
                            label=f"layer {l}" if h == 0 else None)
            else:
                ax.plot(steps, means[:, l].mean(-1), "o-", ms=2.5, color=f"C{l % 10}", label=f"layer {l}")
        ax.set(xlabel="step", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(_title(run), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- text-based figures

def token_category(piece):
    """One of CATEGORIES for a decoded token (leading space ignored)."""
    s = piece.strip()
    if not s or "\ufffd" in s:  # whitespace, or a fragment of a multi-byte character
        return "other"
    if any(c.isdigit() for c in s) and not any(c.isalpha() for c in s):
        return "digits"
    if not any(c.isalnum() for c in s):
        return "punctuation"
    if s.lower() in FUNCTION_WORDS:
        return "function words"
    if s[0].isupper():
        return "capitalised"
    return "other"


def run_tokenizer(run):
    """The tokenizer of the run's shards (data.tokenizer_spec of its data_dir, as train.py
    records it in the checkpoint: what data.load_tokenizer reads); GPT-2 when the run names no
    data."""
    import data

    data_dir = run["train"].get("data_dir")
    try:
        return data.tokenizer_spec(data_dir) if data_dir else "gpt2"
    except data.ShardError:
        return "gpt2"


def text_codec(tokenizer):
    """(encode: str -> ids, or None; decode: one id -> str) of the run's tokenizer, from
    sample.text_codec: a byte of a multi-byte character decodes to U+FFFD (category 'other');
    tokens without text (the recall probe's): (None, None), no categories. Raises OSError when
    GPT-2's BPE files cannot be loaded (offline, first use)."""
    import sample

    try:
        encode, decode, _ = sample.text_codec(tokenizer)
    except sample.CheckpointError:
        return None, None
    return encode, lambda t: decode([t])


BPE_OFFLINE = ("GPT-2's BPE files could not be loaded (no internet?); connect once, or set TIKTOKEN_CACHE_DIR "
               "to a folder that holds them")


def load_text_tokens(run, text_path, n_tokens):
    """Token ids to analyse on, and where they came from; (None, why not) when there are none."""
    if text_path:
        path = Path(text_path)
        try:
            raw = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            return None, f"cannot read --text {path} ({e})"
        if path.suffix == ".jsonl":
            docs = []
            for line in raw.splitlines():
                try:
                    docs.append(json.loads(line)["text"])
                except (ValueError, KeyError, TypeError):
                    continue
                if sum(map(len, docs)) > 8 * n_tokens:
                    break
            raw = "\n\n".join(docs)
        tokenizer = run_tokenizer(run)
        try:
            encode = text_codec(tokenizer)[0]
        except OSError:
            return None, f"--text {path} cannot be tokenized: {BPE_OFFLINE}"
        if encode is None:
            name = tokenizer if isinstance(tokenizer, str) else tokenizer["name"]
            return None, f"--text {path}: the run was trained on {name} tokens, which have no text"
        tokens = encode(raw)[:n_tokens]
        return (tokens, f"--text {path}") if tokens else (None, f"--text {path} is empty")
    data_dir = run["train"].get("data_dir")
    if not data_dir:
        return None, "no --text and no data_dir in the run's config"
    import data

    try:
        shard = data.load_shard(data.find_shards(data_dir, "val")[0])
    except (data.ShardError, OSError) as e:
        return None, f"no --text and the run's validation data is unavailable ({e})"
    return np.asarray(shard[:n_tokens]).astype(np.int64).tolist(), f"validation shard of {data_dir}"


def _chunks(tokens, T, vocab):
    """(N, T) batch of whole chunks of at most T tokens (ids beyond the model's vocab dropped)."""
    tokens = [t for t in tokens if t < vocab]
    T = min(T, len(tokens))
    n = len(tokens) // T
    return torch.tensor(tokens[: n * T], dtype=torch.long).view(n, T)


@torch.no_grad()
def gate_by_category(model, idx, decode):
    """{gate: {category: [per-layer mean]}, 'count': {category: n}}: the per-token gate (mean
    over heads) averaged over the tokens of each category. idx (N, T)."""
    cats = torch.tensor([[CATEGORIES.index(token_category(decode(t))) for t in row] for row in idx.tolist()])
    model.record_gates(True)
    model(idx)
    layers = model.gate_tensors()
    model.record_gates(False)
    out = {}
    for layer in layers:
        for name, g in layer.items():
            if g.shape[:2] != idx.shape:  # per-head constants (asga's scale) have no tokens
                continue
            g = g.float().mean(-1)  # (N, T): mean over heads
            per_cat = [g[cats == c].mean().item() if (cats == c).any() else None for c in range(len(CATEGORIES))]
            for c, v in zip(CATEGORIES, per_cat):
                out.setdefault(name, {}).setdefault(c, []).append(v)
    out["count"] = {c: int((cats == i).sum()) for i, c in enumerate(CATEGORIES)}
    return out


def plot_gate_by_category(run, by_cat, path):
    plt = _plt()
    names = [n for n in by_cat if n != "count"]
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        L = len(next(iter(by_cat[name].values())))
        width = 0.8 / L
        for l in range(L):
            values = [by_cat[name][c][l] for c in CATEGORIES]
            xs = [i + (l - (L - 1) / 2) * width for i in range(len(CATEGORIES))]
            ax.bar(xs, [math.nan if v is None else v for v in values], width, color=f"C{l % 10}",
                   label=f"layer {l}")
        ax.set_xticks(range(len(CATEGORIES)),
                      [f"{c}\n(n={by_cat['count'][c]})" for c in CATEGORIES], fontsize=7)
        ax.set(title=f"{name} (mean over heads) by token category")
        values = [v for per_layer in by_cat[name].values() for v in per_layer if v is not None]
        if all(0 <= v <= 1 for v in values):  # gates and shares on [0, 1]; widths and distances on their own
            ax.set_ylim(0, 1)
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(_title(run), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def capture_attend_inputs(model, idx, layer):
    """Run model(idx) and return the arguments its layer's `attend` received:
    {'q', 'k', 'v', 'x', 'q_start', 'k_start'} (q (B, H, T, D), k and v (B, Hkv, S, D); the
    first query's and first key's positions, Python ints)."""
    attn = model.layers[layer].self_attn
    seen = {}

    def spy(q, k, v, x, q_start, k_start, summary=None):
        seen.update(q=q, k=k, v=v, x=x, q_start=q_start, k_start=k_start)
        return type(attn).attend(attn, q, k, v, x, q_start, k_start, summary)

    attn.attend = spy  # shadows the class's method on this instance only
    try:
        with torch.no_grad():
            model(idx)
    finally:
        del attn.attend
    return seen


@torch.no_grad()
def attention_weights(attn, q, k, x, q_start, k_start):
    """(B, H, T, S): the weights with which the layer mixes values, from its reference `attend`.

    Every variant's output is linear in v, so attend(q, k, v = identity) returns the mixing
    matrix itself: the softmax weights for full, local and asga; those times the head gate
    for dsa (rows sum to g); for caa the g-weighted sum of the local and the top-k weights."""
    B, n_kv, S, _ = k.shape
    eye = torch.eye(S, dtype=q.dtype, device=q.device).expand(B, n_kv, S, S)  # values = one-hot keys
    cfg = attn.cfg
    attn.cfg = replace(cfg, kernel="ref")  # the dense reference takes values of any width
    try:
        return attn.attend(q, k, eye, x, q_start, k_start)
    finally:
        attn.cfg = cfg


def plot_attention(maps, pieces, path):
    """maps: [(title, (T, T) weights)] of several runs on the same passage of tokens `pieces`."""
    plt = _plt()
    T = len(pieces)
    fig, axes = plt.subplots(1, len(maps), figsize=(4.6 * len(maps) + 1, 4.8), squeeze=False)
    labels = [repr(p)[1:-1][:10] for p in pieces]
    for i, (ax, (title, w)) in enumerate(zip(axes[0], maps)):
        ax.imshow(w, cmap="magma", vmin=0, interpolation="nearest")
        step = max(1, T // 24)
        ax.set_xticks(range(0, T, step), labels[::step], rotation=90, fontsize=5)
        ax.set_yticks(range(0, T, step), labels[::step] if i == 0 else [], fontsize=5)
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("key")
    axes[0][0].set_ylabel("query")
    fig.suptitle("attention weights (query rows, key columns)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def checkpoint_figures(runs, args, out, figures, notes, selections=None):
    """Gate by token category (per run), attention maps (all runs, one figure) and, for runs of
    a variant that selects (nsa, moba, indexer), what they selected (one figure each; their
    `selection_stats` go into `selections`), from the checkpoints, on one text for all runs:
    --text, else the first readable validation shard. Appends to figures and notes; returns
    {run: gate_by_category(...)}."""
    from model import CheckpointError, load_checkpoint

    models = {}
    for run in runs:
        try:
            models[run["name"]] = load_checkpoint(run["path"], "cpu", kernel="ref")[0]
        except CheckpointError as e:
            notes.append(f"{run['name']}: no gate-by-category or attention figure: {e}")
    why_not = "no run has a readable checkpoint"
    for run in (r for r in runs if r["name"] in models):
        tokens, source = load_text_tokens(run, args["text"], args["n_tokens"])
        if tokens is not None:
            break
        why_not = source
    if not models or tokens is None:
        notes.append(f"no gate-by-category or attention figures: {why_not}")
        return {}
    by_category, maps, passage = {}, [], None
    for run in (r for r in runs if r["name"] in models):
        model = models[run["name"]]
        try:
            decode = text_codec(run_tokenizer(run))[1]
        except OSError:
            notes.append(f"{run['name']}: no gate-by-category figure: {BPE_OFFLINE}")
            decode = None  # the maps below still draw
        idx = _chunks(tokens, run["train"].get("seq_len") or 256, model.cfg.vocab_size)  # (N, T)
        if idx.numel() == 0:
            notes.append(f"{run['name']}: the text ({source}) has no tokens the model knows")
            continue
        by_cat = gate_by_category(model, idx, decode) if decode else {}
        if len(by_cat) > 1:  # more than the token counts: the variant has per-token gates
            by_category[run["name"]] = by_cat
            plot_gate_by_category(run, by_cat, out / f"categories_{run['name']}.png")
            figures.append((f"categories_{run['name']}.png", f"{run['name']}: gate by token category ({source})"))
        layer, head = args["layer"] % model.cfg.n_layer, min(args["head"], model.cfg.n_head - 1)
        passage = idx[0, : args["attn_tokens"]] if passage is None else passage
        seen = capture_attend_inputs(model, passage[None], layer)
        w = attention_weights(model.layers[layer].self_attn, seen["q"], seen["k"], seen["x"],
                              seen["q_start"], seen["k_start"])  # (1, H, T, T)
        maps.append((f"{_title(run)}\nlayer {layer}, head {head}", w[0, head].numpy()))
        if VARIANTS[model.cfg.attn].selection_unit(model.cfg) is not None and selections is not None:
            stats = selections[run["name"]] = selection_stats(model, idx)
            plot_selection(run, stats, out / f"selection_{run['name']}.png", layer, indexer_history(run))
            figures.append((f"selection_{run['name']}.png", f"{run['name']}: what {model.cfg.attn} selected ({source})"))
    if maps:
        pieces = [(decode or str)(t) for t in passage.tolist()]  # ids where the text cannot be had
        plot_attention(maps, pieces, out / "attention.png")
        figures.append(("attention.png", f"attention weights on the first {len(pieces)} tokens of {source}"))
    return by_category


# ----------------------------------------------------------------------------- what a selecting variant selected

def selection_distances(selection, block):
    """How far back each selected unit lies from its query, -1 for an empty slot. selection
    (.., T, n): absolute block numbers (nsa, moba; block > 1) or key positions (indexer;
    block 1) of queries at positions 0 .. T - 1 (a forward without cache). Blocks back from
    the query's own block (0 = its own), or tokens back (0 = the query itself)."""
    T = selection.shape[-2]
    own = torch.arange(T, device=selection.device)[:, None] // block  # (T, 1)
    return torch.where(selection >= 0, own - selection, -1)


@torch.no_grad()
def selection_stats(model, idx):
    """What each layer of a selecting model (its class's `selection_unit`: nsa, moba,
    indexer) selected on idx (N, T), read from the selection its attention modules note
    (blocks of `selection_unit` positions, e.g. nsa, moba: (N, H, T, n) block numbers, one
    list per query head; single keys, e.g. the indexer: (N, T, n) key positions shared by the
    heads; -1 = empty slot). {'attn', 'unit' ('blocks' | 'tokens'), 'block', 'slots' (n),
    'layers': [per layer, None for a layer that selects nothing (moba_full_last)]}, each layer:
      counts[d]  selected units at distance d (`selection_distances`), summed over sequences,
                 queries, heads and slots, empty slots left out
      mean       their mean distance;  own: the share at distance 0
      recent     the share within the n most recent units (distance < n): what a window of
                 the same budget would have read
      map        (T, J) numpy: the share of heads that selected unit j for query t, first sequence
      gates      for a class with BRANCHES (nsa's g_cmp, g_slc, g_win): {branch: {'by_head':
                 [H] mean over sequences and positions, 'by_position': [T] mean over
                 sequences and heads}} of its noted gate_<branch>."""
    cfg = model.cfg
    block = VARIANTS[cfg.attn].selection_unit(cfg)
    model.record_gates(True)
    try:
        model(idx)
        layers, slots = [], 0
        for layer in model.layers:
            attn = layer.self_attn
            selection = getattr(attn, "selection", None)
            if selection is None:
                layers.append(None)
                continue
            slots = selection.shape[-1]
            dist = selection_distances(selection, block)
            picked = dist[dist >= 0]
            counts = torch.bincount(picked).tolist()
            per_head = selection if selection.dim() == 4 else selection[:, None]  # (N, H or 1, T, n)
            T = per_head.shape[2]
            J = -(-T // block)
            slot = torch.where(per_head[0] < 0, J, per_head[0])  # -1 -> a spare column, dropped
            chosen = torch.zeros(per_head.shape[1], T, J + 1).scatter_(-1, slot, 1.0)[..., :J]  # (H, T, J)
            entry = {"counts": counts, "mean": picked.float().mean().item(), "own": counts[0] / len(picked),
                     "recent": (picked < slots).float().mean().item(), "map": chosen.mean(0).numpy()}
            if attn.BRANCHES:
                entry["gates"] = {name: {"by_head": attn.gates[f"gate_{name}"].float().mean((0, 1)).tolist(),
                                         "by_position": attn.gates[f"gate_{name}"].float().mean((0, 2)).tolist()}
                                  for name in attn.BRANCHES}
            layers.append(entry)
    finally:
        model.record_gates(False)
    return {"attn": cfg.attn, "unit": "tokens" if block == 1 else "blocks", "block": block, "slots": slots,
            "layers": layers}


def selected_branches(stats):
    """The branches whose gates `selection_stats` summarised (nsa's cmp, slc, win), or []."""
    return next((list(s.get("gates", ())) for s in stats["layers"] if s is not None), [])


def indexer_history(run):
    """The indexer over training, from log.jsonl: {'kl': (steps, [KL summed over layers],
    [stage]) of every step that logged one, 'kept': (eval steps, (E, L) array) the share of
    the dense attention's mass on the selected keys, mean over the evaluation batch, per
    layer (logged only by evaluations in the sparse stage)}."""
    kl = [(r["step"], r["indexer_kl"], r.get("indexer_stage", "?")) for r in run["steps"]
          if isinstance(r.get("indexer_kl"), (int, float))]
    out = {"kl": tuple(map(list, zip(*kl))) if kl else ([], [], [])}
    kept = gate_history(run).get("kept_mass")
    out["kept"] = (kept[0], kept[1][..., 0]) if kept else ([], np.zeros((0, 0)))
    return out


def plot_selection(run, stats, path, layer, history=None):
    """One figure of what the variant selected: the distance histogram by layer, the selection
    map of `layer`; where it has branch gates (nsa), those by layer x head and by position;
    where the log has them (the indexer), the kept mass and KL over training (history, from
    `indexer_history`)."""
    plt = _plt()
    unit = stats["unit"]
    layers = [(l, s) for l, s in enumerate(stats["layers"]) if s is not None]
    branches = selected_branches(stats)
    panels = ["distance", "map"] + (["gate_head", "gate_position"] if branches else []) + (
        ["training"] if history and (history["kl"][0] or len(history["kept"][0])) else [])
    cols = 2 if len(panels) == 4 else len(panels)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, panel in zip(axes.flat, panels):
        if panel == "distance":
            for l, s in layers:
                counts = np.asarray(s["counts"], dtype=np.float64)
                share = counts / counts.sum()
                if unit == "tokens":  # keys: the cumulative share, on a log axis of distances
                    ax.step(np.arange(len(share)) + 1, np.cumsum(share), where="post", color=f"C{l % 10}",
                            label=f"layer {l} (mean {s['mean']:.1f})")
                else:
                    ax.plot(np.arange(len(share)), share, "o-", ms=3, color=f"C{l % 10}",
                            label=f"layer {l} (mean {s['mean']:.2f})")
            if unit == "tokens":
                ax.set_xscale("log")
                ax.axvline(stats["slots"], color="k", ls=":", lw=1, label=f"{stats['slots']} most recent")
                ax.set(xlabel="tokens back + 1", ylabel="share of selected keys within",
                       title="how far back the selected keys lie")
            else:
                ax.set(xlabel=f"blocks back (0 = own block of {stats['block']})", ylabel="share of selected blocks",
                       title="how far back the selected blocks lie")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
        elif panel == "map":
            l = layer % len(stats["layers"])
            s = stats["layers"][l] or layers[-1][1]
            l = l if stats["layers"][l] is not None else layers[-1][0]
            im = ax.imshow(s["map"], aspect="auto", cmap="magma", vmin=0, vmax=1, interpolation="nearest")
            if unit == "blocks":
                fig.colorbar(im, ax=ax, fraction=0.05)
            what = "key" if unit == "tokens" else f"block of {stats['block']}"
            heads = "" if unit == "tokens" else "\n(share of heads)"
            ax.set(xlabel=what, ylabel="query", title=f"layer {l}, first sequence: selected {what}s{heads}")
        elif panel == "gate_head":
            g = np.array([[s["gates"][b]["by_head"] for b in branches] for _, s in layers])  # (L, branches, H)
            L, n, H = g.shape
            im = ax.imshow(g.transpose(0, 2, 1).reshape(L * H, n), aspect="auto", cmap="viridis",
                           vmin=0, vmax=1, interpolation="nearest")
            ax.set_xticks(range(n), branches)
            ax.set_yticks(range(L * H), [f"L{l}.H{h}" for l, _ in layers for h in range(H)], fontsize=max(3, 7 - L * H // 16))
            ax.set_title("branch gate by layer and head (mean over tokens)")
            fig.colorbar(im, ax=ax, fraction=0.05)
        elif panel == "gate_position":
            for b, style in zip(branches, ("-", "--", ":", "-.")):
                for l, s in layers:
                    ax.plot(s["gates"][b]["by_position"], style, color=f"C{l % 10}", lw=1,
                            label=f"{b}, layer {l}")
            ax.set(xlabel="position", ylabel="gate (mean over heads)", title="branch gates by position", ylim=(0, 1))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=5, ncol=3)
        elif panel == "training":
            steps, kept = history["kept"]
            for l in range(kept.shape[1] if len(steps) else 0):
                ax.plot(steps, kept[:, l], "o-", ms=3, color=f"C{l % 10}", label=f"kept mass, layer {l}")
            ax.set(xlabel="step", ylabel="dense attention mass on the selected keys", ylim=(0, 1.02),
                   title="indexer over training")
            ax.grid(alpha=0.3)
            if history["kl"][0]:
                twin = ax.twinx()
                kl_steps, kl, stage = history["kl"]
                twin.plot(kl_steps, kl, color="0.4", lw=0.8, label="KL (sum over layers)")
                dense = [s for s, st in zip(kl_steps, stage) if st == "dense"]
                if dense:
                    ax.axvspan(min(dense), max(dense), color="0.85", zorder=0, label="dense warm-up")
                twin.set_ylabel("indexer KL")
                twin.legend(fontsize=6, loc="lower right")
            ax.legend(fontsize=6, loc="lower left")
    fig.suptitle(_title(run), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def selection_markdown(name, stats):
    """summary.md's table of one run's selection statistics (`selection_stats`)."""
    unit = stats["unit"]
    branches = selected_branches(stats)
    head = f"| layer | mean {unit} back | share at 0 | share within the {stats['slots']} most recent |"
    lines = [f"## {name}: what {stats['attn']} selected", "",
             head + "".join(f" gate {b} |" for b in branches),
             "|---|---|---|---|" + "---|" * len(branches)]
    for l, s in enumerate(stats["layers"]):
        if s is None:
            lines.append(f"| {l} | full attention | | |" + " |" * len(branches))
            continue
        row = f"| {l} | {s['mean']:.2f} | {s['own']:.3f} | {s['recent']:.3f} |"
        row += "".join(f" {np.mean(s['gates'][b]['by_head']):.3f} |" for b in branches)
        lines.append(row)
    return lines + [""]


# ----------------------------------------------------------------------------- main

def parse_args(argv):
    """Run folders and `--key=value` overrides of DEFAULTS (config.py's parser) -> (runs, args)."""
    from config import parse_flags

    given, runs = parse_flags(argv, {"keys": DEFAULTS}, "analyze.py", positional=True, doc=__doc__)
    return runs, {**DEFAULTS, **given}


def analyze(runs, args):
    """Write the figures, summary.md and summary.json for these runs into args['out_dir']."""
    out = Path(args["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    figures, notes = [], []
    taken = {}
    for run in runs:  # runs from different folders may share a name: figure files must not
        taken[run["name"]] = taken.get(run["name"], 0) + 1
        if taken[run["name"]] > 1:
            run["name"] = f"{run['name']}-{taken[run['name']]}"
    table = build_table(runs, args["target_loss"])

    plot_losses(runs, out / "loss.png")
    figures.append(("loss.png", "train and validation loss"))
    if plot_loss_by_position(runs, out / "positions.png"):
        figures.append(("positions.png", "validation loss by position (evaluate.py's eval.json)"))
    for run in runs:
        history = gate_history(run)
        if history:
            plot_gate_history(run, history, out / f"gates_{run['name']}.png")
            figures.append((f"gates_{run['name']}.png", f"{run['name']}: gate statistics over training"))
            if plot_variant_dynamics(run, history, out / f"dynamics_{run['name']}.png"):
                figures.append((f"dynamics_{run['name']}.png", f"{run['name']}: {run['model']['attn']} gate dynamics"))

    selections = {}
    by_category = checkpoint_figures(runs, args, out, figures, notes, selections)
    summary = {**table, "figures": [f for f, _ in figures], "gate_by_category": by_category,
               "selection": {name: {**s, "layers": [None if l is None else {k: v for k, v in l.items() if k != "map"}
                                                    for l in s["layers"]]} for name, s in selections.items()},
               "notes": notes}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    md = ["# Runs", "", table_markdown(table), "",
          f"Target validation loss {_fmt(table['target_loss'], '.4f')}: {table['target_rule']}. "
          "tok/s: median over steps after the first; peak memory: the largest logged "
          "(`mem_gb`; CPU runs log peak RSS).", ""]
    for name, by_cat in by_category.items():
        md += [f"## {name}: gate by token category (mean over heads)", "",
               "| gate | layer | " + " | ".join(CATEGORIES) + " |",
               "|---|---|" + "---|" * len(CATEGORIES)]
        for gate, per_cat in by_cat.items():
            if gate == "count":
                continue
            for l in range(len(per_cat[CATEGORIES[0]])):
                md.append(f"| {gate} | {l} | " + " | ".join(_fmt(per_cat[c][l], ".3f") for c in CATEGORIES) + " |")
        md += ["", "tokens per category: " + ", ".join(f"{c} {n}" for c, n in by_cat["count"].items()), ""]
    for name, stats in selections.items():
        md += selection_markdown(name, stats)
    md += ["## Figures", ""] + [f"![{caption}]({f})\n\n{caption}\n" for f, caption in figures]
    if notes:
        md += ["## Notes", ""] + [f"- {n}" for n in notes]
    (out / "summary.md").write_text("\n".join(md) + "\n")
    return summary


def main(argv=None):
    names, args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if names:
            runs, errors = [], []
            for name in names:
                try:
                    runs.append(load_run(name))
                except RunError as e:
                    errors.append(str(e))
            if errors:
                raise RunError("\n  ".join(errors))
        else:
            runs = recent_runs(args["root"], args["max_runs"])
    except RunError as e:
        sys.exit(f"analyze.py: cannot analyse:\n  {e}")
    print(f"analysing {len(runs)} run(s): {', '.join(str(r['path']) for r in runs)}")
    summary = analyze(runs, args)
    out = Path(args["out_dir"])
    print(table_markdown(summary))
    print(f"wrote {len(summary['figures'])} figures, summary.md and summary.json to {out}/")
    for note in summary["notes"]:
        print(f"note: {note}")


if __name__ == "__main__":
    main()
