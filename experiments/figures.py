"""The study's figures, drawn from the numbers experiments/sweep.py reads out of the logs:

    assets/study_loss.png     validation loss per configuration (seed mean, band = min..max over seeds)
                              and its paired difference from `full` at each evaluation
    assets/study_window.png   `local`'s paired Δ from `full` against the window W (95% intervals)
    assets/study_recall.png   recall accuracy by lag, a panel per family beside full and local, chance line
    assets/study_positions.png loss by position of the final evaluation's longest sequences (4x
                              the trained length), and each variant's paired difference from `full`

`python experiments/sweep.py --results_only` redraws them.
"""
from pathlib import Path

import recall


# The columns of every figure: a family of configurations, by name prefix.
FAMILIES = [("full / local", ("local",)), ("dsa", ("dsa",)), ("asga", ("asga",)),
            ("caa / combiner", ("caa", "combiner"))]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def loss_curves(stats, configs, path, families=FAMILIES, unit="nats / byte"):
    """One column per family (full/local, dsa, asga, caa/combiner). Top: validation loss, seed
    mean and min..max band. Bottom: the paired difference from `full` at the same seed and
    step, mean and band (what the tables report, at every evaluation)."""
    plt = _plt()
    full = stats.get("full")
    fig, axes = plt.subplots(2, len(families), figsize=(4.2 * len(families), 6.4), sharey="row", sharex=True)
    for col, (title, prefixes) in enumerate(families):
        top, bottom = axes[0, col], axes[1, col]
        for name, *_ in configs:
            s = stats.get(name)
            if s is None or not (name == "full" or name.startswith(prefixes)):
                continue
            seeds = sorted(s["runs"])
            curves = {seed: dict(s["runs"][seed]["evals"]) for seed in seeds}
            steps = sorted(set.intersection(*(set(c) for c in curves.values())) - {0})
            if not steps:
                continue
            vals = [[curves[seed][t] for seed in seeds] for t in steps]
            line, = top.plot(steps, [sum(v) / len(v) for v in vals], label=f"{name} ({len(seeds)} seeds)",
                             lw=2 if name == "full" else 1.2, color="black" if name == "full" else None)
            top.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=line.get_color(), alpha=0.2)
            if name == "full" or full is None:
                continue
            paired = [seed for seed in seeds if seed in full["runs"]]
            full_curves = {seed: dict(full["runs"][seed]["evals"]) for seed in paired}
            dsteps = [t for t in steps if all(t in full_curves[seed] for seed in paired)]
            if not paired or not dsteps:
                continue
            d = [[curves[seed][t] - full_curves[seed][t] for seed in paired] for t in dsteps]
            bottom.plot(dsteps, [sum(v) / len(v) for v in d], color=line.get_color(), lw=1.2)
            bottom.fill_between(dsteps, [min(v) for v in d], [max(v) for v in d], color=line.get_color(), alpha=0.2)
        bottom.axhline(0, color="black", lw=1)
        top.set_title(title)
        bottom.set_xlabel("step")
        top.legend(fontsize=7)
    axes[0, 0].set_ylabel(f"validation loss ({unit})")
    axes[1, 0].set_ylabel("paired Δ vs full")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def window_figure(windows, path):
    plt = _plt()
    rows = [(w, s) for w, s in windows.items() if s is not None and s["delta"] is not None]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    if rows:
        ws = [w for w, _ in rows]
        ax.errorbar(ws, [s["delta"] for _, s in rows], yerr=[s["hw"] or 0 for _, s in rows], fmt="o-", capsize=4,
                    label="local(W) - full, mean and 95% interval")
        for w, s in rows:
            ax.scatter([w] * len(s["deltas"]), s["deltas"], s=10, color="gray", zorder=3)
    ax.axhline(0, color="black", lw=1, label="full")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("window W (bytes)")
    ax.set_ylabel("Δ validation loss vs full (paired)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def recall_figure(rec, path):
    """One panel per family (as in the loss figure), each with `full` (black) and `local`
    (gray) as the two positive controls, W and L*W marked, and the chance line."""
    plt = _plt()
    W, L = recall.TRAIN["window"], recall.TRAIN["n_layer"]
    fig, axes = plt.subplots(1, len(FAMILIES), figsize=(4.2 * len(FAMILIES), 3.6), sharey=True)
    for ax, (title, prefixes) in zip(axes, FAMILIES):
        for name, r in rec.items():
            control = name in ("full", "local")
            if not (control or name.startswith(prefixes)):
                continue
            bins = r["by_lag"]
            style = dict(color="black", lw=2) if name == "full" else dict(color="gray", lw=2) if name == "local" \
                else dict(lw=1.2)
            ax.plot([(lo + hi) / 2 for lo, hi, _, _ in bins], [acc for *_, acc in bins], marker=".",
                    label=f"{name} ({r['overall']:.2f})", **style)
        ax.axvline(W, color="gray", ls="--", lw=1)
        ax.axvline(L * W, color="gray", ls=":", lw=1)
        ax.axhline(1 / recall.TASK["n_values"], color="red", lw=1, label="chance")
        ax.text(W, 1.02, " W", fontsize=8)
        ax.text(L * W, 1.02, f" {L}W", fontsize=8)
        ax.set_ylim(0, 1.08)
        ax.set_title(title)
        ax.set_xlabel("lag (positions back to the answer)")
        ax.legend(fontsize=7, loc="center right")
    axes[0].set_ylabel("recall accuracy (overall in the legend)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _longest(ev):
    """The eval.json record's longest evaluated length: ((seq_len, n_seq), buckets), or None.
    Two records pair only when both match (the same val sequences)."""
    done = [r for r in (ev or {}).get("positions") or [] if "buckets" in r]
    return ((done[-1]["seq_len"], done[-1].get("n_seq")), done[-1]["buckets"]) if done else None


def positions_figure(stats, configs, trained_len, path, unit="bytes"):
    """Left: `full`'s and `local`'s loss by position (seed mean, band = min..max over seeds) on
    the final evaluation's longest sequences; right: each variant's (configuration names
    without '_': no ablations) paired difference from `full`, seed mean. Positions are causal,
    so those up to the trained length (dashed line) see what they saw in training."""
    full = stats.get("full")
    if not full:
        return False
    full_ev = {seed: _longest(r.get("eval")) for seed, r in full["runs"].items()}
    full_ev = {seed: v for seed, v in full_ev.items() if v}
    if not full_ev:
        return False
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    drawn = False
    for name, *_ in configs:
        s = stats.get(name)
        if s is None or "_" in name:
            continue
        mine = {seed: _longest(r.get("eval")) for seed, r in s["runs"].items()}
        seeds = [seed for seed, v in mine.items() if v and seed in full_ev and v[0] == full_ev[seed][0]]
        if not seeds:
            continue
        buckets = mine[seeds[0]][1]
        x = [(b["first"] * b["last"]) ** 0.5 for b in buckets]
        style = dict(color="black", lw=2) if name == "full" else dict(color="gray", lw=2) if name == "local" \
            else dict(lw=1.2)
        if name in ("full", "local"):
            vals = [[mine[seed][1][i]["mean"] for seed in seeds] for i in range(len(buckets))]
            line, = left.plot(x, [sum(v) / len(v) for v in vals], marker=".", label=f"{name} ({len(seeds)} seeds)", **style)
            left.fill_between(x, [min(v) for v in vals], [max(v) for v in vals], color=line.get_color(), alpha=0.2)
        if name != "full":
            d = [[mine[seed][1][i]["mean"] - full_ev[seed][1][i]["mean"] for seed in seeds] for i in range(len(buckets))]
            right.plot(x, [sum(v) / len(v) for v in d], marker=".", label=name, **style)
            drawn = True
    for ax in (left, right):
        ax.set_xscale("log")
        ax.axvline(trained_len, color="gray", ls="--", lw=1)
        ax.set_xlabel(f"position ({unit} of context; buckets 1, 2-3, 4-7, ...; dashed: trained length {trained_len})")
        ax.legend(fontsize=7)
    right.axhline(0, color="black", lw=1)
    left.set_ylabel(f"val loss (nats / {unit.rstrip('s')})")
    right.set_ylabel("paired Δ vs full (seed mean)")
    left.set_title("loss by position")
    right.set_title("difference from full by position")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def all_figures(out, assets, stats, windows, rec, configs, trained_len=None):
    assets = Path(assets)
    assets.mkdir(exist_ok=True)
    if any(stats.values()):
        loss_curves(stats, configs, assets / "study_loss.png")
    if any(s is not None for s in windows.values()):
        window_figure(windows, assets / "study_window.png")
    if rec:
        recall_figure(rec, assets / "study_recall.png")
    if trained_len and any(stats.values()):
        positions_figure(stats, configs, trained_len, assets / "study_positions.png")
