"""The papers' tables at small scale: every variant and ablation, 2 seeds, then the recall
probe, analyze.py and RESULTS.md. One command (here, on the 2-core CPU: ~45-65 min, estimated
from single runs measured while other jobs shared the 2 cores (load ~4): an LM run of 60 steps
took 69 s for full and 275 s for asga, a 600-step recall run 59 s for full and 94 s for local):

    python experiments/sweep.py
    python experiments/sweep.py --data_dir=data/fineweb10B --model=small --tokens=50_000_000  # a GPU node
    python experiments/sweep.py --results_only          # rewrite RESULTS.md from the logs

Everything goes under --out_dir (default experiments/results): lm/NAME_sSEED/ and
recall/ATTN_sSEED/ are train.py run folders (config.json, log.jsonl, command.txt, ckpt.pt;
recall runs add recall.json), analysis/ is analyze.py's output over the LM runs. A run whose
log ends with train.py's `end` record is skipped and one with a checkpoint is resumed, so an
interrupted sweep continues where it stopped. RESULTS.md reads every number from those files.

Choices (CPU defaults; all are flags): the `tiny` model (2 layers, d_model 64, 4 heads of 16,
GPT-2 vocabulary, so most of its 3.3M parameters are the tied embedding), sequences of 1024
so that windows of 256 bind (dsa's adaptive rule windows only from position 512), global
batch 2 x 1024 tokens, lr 3e-3 with 10 warm-up steps and cosine decay to 0.1x, --tokens per
run (default 102,400 = 50 steps), validation on the first 8,192 val tokens every 10 steps.
The kernel: --kernel=fused when kernels.py is committed (`git ls-files kernels.py`), else ref.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

import recall  # noqa: E402

CORPUS = ROOT.parent / "shared" / "corpus"
PAPER_BASELINE = 4.9266  # full attention, 134M Qwen on FineWeb (seeds 000 / 002 / 004)
# (name, attn, model flags, [(seed paper, its validation loss)], note): the 11 configurations.
CONFIGS = [
    ("full", "full", {}, [], "baseline"),
    ("local", "local", {}, [("004", 5.021)], ""),
    ("dsa", "dsa", {}, [("000", 4.6498), ("002", 4.904)], ""),
    ("dsa_nogate", "dsa", {"dsa_gate": False}, [("002", 4.918)], "no gating"),
    ("dsa_fixedwin", "dsa", {"dsa_window": "fixed"}, [("002", 4.927)], "fixed window"),
    ("dsa_nowin", "dsa", {"dsa_window": "none"}, [("002", 5.012)], "no window"),
    ("asga", "asga", {}, [("003", 5.148)], ""),
    ("asga_noscale", "asga", {"asga_scale": False}, [("003", 5.201)], "no geometric scaling"),
    ("asga_fixed", "asga", {"asga_gate": "fixed"}, [("003", 5.087)], "fixed sparsity"),
    ("asga_off", "asga", {"asga_gate": "off", "asga_scale": False}, [("003", 4.930)], "both off"),
    ("caa", "caa", {}, [("004", 4.712)], "paper: 2.1x memory, 0.82x throughput"),
]
RECALL_VARIANTS = ["full", "local", "dsa", "asga", "caa"]
# Half the range over seeds: with 2 seeds it is |a - b| / 2, the population std.
SPREAD_RULE = "half the range over seeds ((max - min) / 2; with 2 seeds the population std)"


# ----------------------------------------------------------------------------- running

def kernel_default():
    """fused once kernels.py is committed (its parity tests with it), else the reference."""
    out = subprocess.run(["git", "ls-files", "kernels.py"], cwd=ROOT, capture_output=True, text=True)
    return "fused" if out.stdout.strip() else "ref"


def lm_overrides(args):
    batch = 2 * args.seq_len
    steps = max(1, args.tokens // batch)
    return dict(model=args.model, seq_len=args.seq_len, batch_size=2, total_batch_tokens=batch,
                lr=args.lr, warmup_steps=min(10, steps), max_steps=steps,
                eval_every=max(1, steps // 6), val_tokens=8192, gate_batch=2, ckpt_every=100000,
                kernel=args.kernel, data_dir=rel(args.data_dir))


def rel(path):
    """Paths inside the repository as relative ones, so committed commands run anywhere."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def train(cmd, out_dir):
    """Run train.py unless out_dir holds a finished run; resume from a checkpoint."""
    if recall.run_finished(out_dir):
        return False
    os.makedirs(out_dir, exist_ok=True)
    Path(out_dir, "command.txt").write_text(" ".join(["python", "train.py"] + cmd[2:]) + "\n")
    resume = ["--resume=True"] if Path(out_dir, "ckpt.pt").exists() else []
    with open(Path(out_dir, "stdout.txt"), "a") as f:
        subprocess.run(cmd + resume, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    return True


def make_corpus(data_dir):
    if Path(data_dir).is_dir():
        return
    subprocess.run([sys.executable, str(ROOT / "data.py"),
                    f"--source={CORPUS / 'fineweb_legalpilot_train.jsonl'}",
                    f"--val_source={CORPUS / 'fineweb_legalpilot_val.jsonl'}",
                    f"--out_dir={data_dir}"], check=True)


def sweep(args):
    out = Path(args.out_dir)
    if args.data_dir == DEFAULT_DATA:
        make_corpus(args.data_dir)
    seeds = [int(s) for s in args.seeds.split(",")]
    t0, jobs = time.time(), []
    for seed in seeds:  # every configuration of seed 0 first: a cut-short sweep still has one each
        for name, attn, flags, _, _ in CONFIGS:
            run_args = {**lm_overrides(args), "attn": attn, **flags, "seed": seed,
                        "out_dir": rel(out / "lm" / f"{name}_s{seed}")}
            cmd = [sys.executable, "train.py"] + [f"--{k}={v}" for k, v in run_args.items()]
            jobs.append((f"lm {name} seed {seed}", lambda c=cmd, o=ROOT / run_args["out_dir"]: train(c, o)))
    n_lm = len(jobs)
    if args.recall_steps > 0:
        for seed in seeds:
            for attn in RECALL_VARIANTS:
                o = str(out / "recall" / f"{attn}_s{seed}")
                jobs.append((f"recall {attn} seed {seed}", lambda a=attn, s=seed, o=o: recall.run(
                    a, s, o, args.recall_data_dir, kernel=args.kernel, max_steps=args.recall_steps)))
    for i, (label, job) in enumerate(jobs):
        t = time.time()
        ran = job()
        print(f"[{i + 1}/{len(jobs)}] {label}: {'%.0f s' % (time.time() - t) if ran is not False else 'done before'}"
              f" | sweep {(time.time() - t0) / 60:.1f} min", flush=True)
        if i + 1 == n_lm:  # tables of the LM runs before the recall probe starts
            report(out, args.results_md)
    report(out, args.results_md)
    print(f"sweep finished in {(time.time() - t0) / 60:.1f} min; wrote {args.results_md}")


def report(out, results_md):
    """analyze.py over the LM runs (figures, summary), then RESULTS.md."""
    lm_runs = sorted(str(p) for p in (out / "lm").iterdir() if p.is_dir())
    subprocess.run([sys.executable, str(ROOT / "analyze.py"), *lm_runs, f"--out_dir={out / 'analysis'}",
                    f"--max_runs={len(lm_runs)}"], check=False)
    write_results(out, results_md)


# ----------------------------------------------------------------------------- reading logs

def read_log(run_dir):
    """log.jsonl -> {'evals': [(step, val)], 'tok_s': median per-step tok/s (step 1 left
    out: warm-up), 'mem_gb': max, 'final_val': last eval's val}; later records of a step
    (a resumed run) replace earlier ones."""
    by_step = {}
    for line in Path(run_dir, "log.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(r.get("step"), int) and "event" not in r:
            by_step[r["step"]] = r
    steps = [by_step[s] for s in sorted(by_step)]
    evals = [(r["step"], r["val"]) for r in steps if isinstance(r.get("val"), (int, float))]
    speeds = [r["tok_s"] for r in steps if "tok_s" in r and r["step"] > 1] or \
        [r["tok_s"] for r in steps if "tok_s" in r]  # step 1 pays for warm-up (unless it is alone)
    mems = [r["mem_gb"] for r in steps if "mem_gb" in r]
    return {"evals": evals, "final_val": evals[-1][1] if evals else None,
            "tok_s": statistics.median(speeds) if speeds else None, "mem_gb": max(mems) if mems else None}


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def mean_spread(values):
    """(mean, half the range) of the values present; (None, None) when there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (max(values) - min(values)) / 2


def verdict(ours, ours_spread, paper, n_seeds=2):
    """Our delta vs full against the paper's delta vs its baseline: 'inconclusive' when our
    delta is inside the spread (|delta| <= spread) or there is no spread (fewer than 2 seeds
    on either side), else 'reproduced' when it has the paper's sign and 'not reproduced' when
    it has the opposite one."""
    if n_seeds < 2:
        return "inconclusive (1 seed: no spread)"
    if abs(ours) <= ours_spread:
        return "inconclusive"
    return "reproduced" if (ours > 0) == (paper > 0) else "not reproduced"


def collect(out):
    """{config name: {'seeds': {seed: read_log}, 'command': str}} for the LM runs present."""
    found = {}
    for name, *_ in CONFIGS:
        for run in sorted(Path(out, "lm").glob(f"{name}_s*")):
            seed = run.name[len(name) + 2:]
            if not seed.isdigit() or not recall.run_finished(run):  # unfinished: left out
                continue
            entry = found.setdefault(name, {"seeds": {}, "command": None})
            entry["seeds"][int(seed)] = read_log(run)
            cmd = Path(run, "command.txt")
            if cmd.exists() and entry["command"] is None:
                entry["command"] = cmd.read_text().strip().replace(f"--seed={seed}", "--seed=SEED") \
                    .replace(f"{run.name}", f"{name}_sSEED")
    return found


def lm_table(out):
    """Rows of the main table (dicts of numbers) and the target loss used."""
    found = collect(out)
    full = found.get("full")
    full_val, full_spread = mean_spread([r["final_val"] for r in full["seeds"].values()]) if full else (None, None)
    full_tok = _mean([r["tok_s"] for r in full["seeds"].values()]) if full else None
    full_mem = _mean([r["mem_gb"] for r in full["seeds"].values()]) if full else None
    target = full_val
    rows = []
    for name, attn, flags, paper, note in CONFIGS:
        entry = found.get(name)
        if entry is None:
            rows.append({"name": name, "missing": True, "paper": paper, "note": note})
            continue
        runs = [entry["seeds"][s] for s in sorted(entry["seeds"])]
        val, spread = mean_spread([r["final_val"] for r in runs])
        tok, mem = _mean([r["tok_s"] for r in runs]), _mean([r["mem_gb"] for r in runs])
        reach = [next((s for s, v in r["evals"] if target is not None and v <= target), None) for r in runs]
        row = {"name": name, "attn": attn, "flags": flags, "paper": paper, "note": note,
               "seeds": sorted(entry["seeds"]), "vals": [r["final_val"] for r in runs],
               "val": val, "spread": spread, "tok_s": tok, "mem_gb": mem,
               "tok_s_rel": tok / full_tok if tok and full_tok else None,
               "mem_rel": mem / full_mem if mem and full_mem else None,
               "steps_to_target": reach, "command": entry["command"]}
        if name != "full" and full_val is not None and val is not None:
            row["delta"] = val - full_val
            row["delta_spread"] = spread + full_spread  # both means are uncertain
            row["verdicts"] = [(src, p - PAPER_BASELINE,
                                verdict(row["delta"], row["delta_spread"], p - PAPER_BASELINE,
                                        min(len(runs), len(full["seeds"]))))
                               for src, p in paper]
        rows.append(row)
    return rows, target


def recall_table(out):
    """{attn: {'buckets': {label: (mean acc, half range, n seeds)}, 'chance', 'command'}}."""
    per = {}
    for path in sorted(Path(out, "recall").glob("*_s*/recall.json")):
        r = json.loads(path.read_text())
        per.setdefault(r["attn"], []).append(r)
    table = {}
    for attn in RECALL_VARIANTS + sorted(set(per) - set(RECALL_VARIANTS)):
        if attn not in per:
            continue
        results = per[attn]
        labels = list(results[0]["buckets"])
        table[attn] = {"chance": results[0]["chance"], "seeds": [r["seed"] for r in results],
                       "steps": results[0]["step"], "overall": mean_spread([r["overall"] for r in results]),
                       "n": {k: results[0]["buckets"][k]["n"] for k in labels},
                       "buckets": {k: mean_spread([r["buckets"][k]["acc"] for r in results]) for k in labels},
                       "command": results[0]["command"].replace(f"--seed={results[0]['seed']}", "--seed=SEED")
                       .replace(f"{attn}_s{results[0]['seed']}", f"{attn}_sSEED")}
    return table


# ----------------------------------------------------------------------------- RESULTS.md

def _f(x, spec):
    return "–" if x is None else format(x, spec)


DISCUSSION = """## What this scale can and cannot say

*(Template: the numbers in it are filled in by `experiments/sweep.py`; edit the prose in
`DISCUSSION` there, not here.)*

Each LM run trained a {params} model for {tokens:,} tokens ({steps} steps); the `full`
baseline ended at a validation loss of {full_val} against the papers' 4.9266 at 134M
parameters and billions of tokens. The seed spread of our losses ranges from {min_spread} to
{max_spread}: {n_inconclusive} of {n_verdicts} comparisons with a paper number fall inside it
(inconclusive), {n_reproduced} reproduce the paper's direction and {n_not} go the other way.
At this size and budget the model is still learning unigram and bigram statistics, a regime
where attention beyond a few hundred tokens contributes little, so validation loss can show
costs (speed, memory) and gross failures, not the papers' gains or losses of a few hundredths.
The recall probe asks the question that loss cannot: whether a variant can use a token beyond
its window. There `full` scored {full_far} beyond {reach} tokens and `local` {local_far}
(chance {chance}).
"""


def write_results(out, md_path):
    out = Path(out)
    rows, target = lm_table(out)
    rec = recall_table(out)
    lines = ["# Results: the papers' tables at small scale", "",
             "Generated by `python experiments/sweep.py` (rewrite alone: `python experiments/sweep.py "
             "--results_only`) from the run logs under "
             f"`{os.path.relpath(out, ROOT)}/`; no number below is typed by hand.", "",
             "## Validation loss, speed and memory, beside the papers", "",
             f"Our loss: the last evaluation's validation loss, mean ± spread over seeds, where "
             f"spread is {SPREAD_RULE}. Δ: our mean minus `full`'s; its spread is the sum of both "
             f"rows' spreads. Paper Δ: the paper's number minus its baseline {PAPER_BASELINE}. "
             f"Verdict: *reproduced* when our Δ has the paper's sign and |Δ| exceeds the spread, "
             f"*not reproduced* when it has the opposite sign and exceeds it, *inconclusive* when "
             f"|Δ| is within the spread. tok/s (median per-step throughput, step 1 left out) and "
             f"peak memory (train.py's mem_gb: CPU peak RSS, GPU max allocated) are seed means, "
             f"relative to `full`. Steps to target: the first evaluation step (per seed) whose "
             f"validation loss is <= `full`'s mean final loss ({_f(target, '.4f')}); – never.", "",
             "| config | seeds | our val loss | Δ vs full | paper | paper Δ | verdict | tok/s vs full "
             "| peak mem vs full | steps to target |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        paper = " / ".join(f"{p:.4f} ({src})" for src, p in r["paper"]) or f"{PAPER_BASELINE} (baseline)"
        if r.get("missing"):
            lines.append(f"| {r['name']} | – | not run (or unfinished) | – | {paper} | – | – | – | – | – |")
            continue
        val = f"{r['val']:.4f} ± {r['spread']:.4f}" if r["val"] is not None else "–"
        delta = f"{r['delta']:+.4f} ± {r['delta_spread']:.4f}" if "delta" in r else "–"
        paper_delta = " / ".join(f"{d:+.4f}" for _, d, _ in r.get("verdicts", [])) or "–"
        verdicts = [v for _, _, v in r.get("verdicts", [])]
        if not verdicts:
            verdict_text = "baseline" if r["name"] == "full" else "–"
        elif len(set(verdicts)) == 1:
            verdict_text = verdicts[0]
        else:
            verdict_text = " / ".join(f"{v} ({src})" for (src, _, v) in r["verdicts"])
        reach = "/".join("–" if s is None else str(s) for s in r["steps_to_target"])
        note = f" ({r['note']})" if r["note"] and r["name"] != "full" else ""
        lines.append(f"| {r['name']}{note} | {len(r['seeds'])} | {val} | {delta} | {paper} | {paper_delta} "
                     f"| {verdict_text} | {_f(r['tok_s_rel'], '.2f')}x ({_f(r['tok_s'], '.0f')}) "
                     f"| {_f(r['mem_rel'], '.2f')}x ({_f(r['mem_gb'], '.2f')} GB) | {reach} |")
    lines += ["", "Per-seed final losses and the command of each row (SEED = each seed):", ""]
    for r in rows:
        if not r.get("missing"):
            vals = ", ".join(f"seed {s}: {v:.4f}" for s, v in zip(r["seeds"], r["vals"]) if v is not None)
            lines.append(f"- **{r['name']}** ({vals}): `{r['command']}`")
    lines += ["", "## Recall by distance", ""]
    if rec:
        first = next(iter(rec.values()))
        labels = list(first["buckets"])
        lines += [f"Accuracy of the argmax at query positions on held-out recall sequences "
                  f"(`experiments/recall.py`; mean ± half the range over seeds; chance "
                  f"{first['chance']:.4f} = 1/n_values). d = positions since the key's previous "
                  f"occurrence; W = window, the stacked receptive field of the 2-layer "
                  f"windowed model is 2W. Queries per bucket: "
                  + ", ".join(f"{k}: {first['n'][k]}" for k in labels) + ".", "",
                  "| variant | seeds | steps | " + " | ".join(labels) + " | all |",
                  "|---|---|---|" + "---|" * (len(labels) + 1)]
        for attn, t in rec.items():
            cells = [f"{m:.3f} ± {s:.3f}" if m is not None else "–" for m, s in t["buckets"].values()]
            lines.append(f"| {attn} | {len(t['seeds'])} | {t['steps']} | " + " | ".join(cells)
                         + f" | {t['overall'][0]:.3f} ± {t['overall'][1]:.3f} |")
        lines += ["", "Commands:", ""] + [f"- **{a}**: `{t['command']}`" for a, t in rec.items()]
    else:
        lines.append("No recall runs yet.")
    lines += ["", "## Gate figures (analyze.py)", ""]
    analysis = out / "analysis"
    figs = sorted(p for p in analysis.glob("*.png") if p.stem.split("_", 1)[-1].startswith(("dsa_s", "caa_s")))
    lines += [f"- [{p.name}]({os.path.relpath(p, Path(md_path).resolve().parent)})" for p in figs] or ["No figures yet."]
    if (analysis / "summary.md").exists():
        lines.append(f"- analyze.py's full summary: [{os.path.relpath(analysis / 'summary.md', Path(md_path).resolve().parent)}]"
                     f"({os.path.relpath(analysis / 'summary.md', Path(md_path).resolve().parent)})")
    lines += ["", discussion(out, rows, rec)]
    Path(md_path).write_text("\n".join(lines) + "\n")
    return rows, rec


def discussion(out, rows, rec):
    verdicts = [v for r in rows for _, _, v in r.get("verdicts", [])]
    spreads = [r["spread"] for r in rows if r.get("spread") is not None]
    full = next((r for r in rows if r["name"] == "full" and not r.get("missing")), None)
    params = tokens = steps = "?"
    cfg_path = out / "lm" / "full_s0" / "config.json"
    if cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
        params = f"{cfg['num_params'] / 1e6:.2f}M-parameter"
        steps = cfg["train"]["max_steps"]
        tokens = steps * cfg["train"]["total_batch_tokens"]

    def far(attn):
        t = rec.get(attn)
        if not t:
            return "–"
        m, s = list(t["buckets"].values())[-1]
        return "–" if m is None else f"{m:.3f} ± {s:.3f}"

    reach = list(next(iter(rec.values()))["buckets"])[-1].split()[-1] if rec else "?"
    return DISCUSSION.format(
        params=params, tokens=tokens if isinstance(tokens, int) else 0, steps=steps,
        full_val=_f(full["val"] if full else None, ".4f"),
        min_spread=_f(min(spreads) if spreads else None, ".4f"), max_spread=_f(max(spreads) if spreads else None, ".4f"),
        n_verdicts=len(verdicts), n_inconclusive=verdicts.count("inconclusive"),
        n_reproduced=verdicts.count("reproduced"), n_not=verdicts.count("not reproduced"),
        full_far=far("full"), local_far=far("local"), reach=reach,
        chance=_f(next(iter(rec.values()))["chance"] if rec else None, ".4f"))


DEFAULT_DATA = str(ROOT / "experiments" / "data" / "corpus")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_dir", default=DEFAULT_DATA,
                   help="LM token shards (default: made from ../shared/corpus on first use)")
    p.add_argument("--out_dir", default=str(ROOT / "experiments" / "results"))
    p.add_argument("--results_md", default=str(ROOT / "RESULTS.md"))
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=102_400, help="training tokens per LM run")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--kernel", default=None, help="ref | fused (default: fused if kernels.py is committed)")
    p.add_argument("--recall_steps", type=int, default=recall.TRAIN["max_steps"], help="0: no recall probe")
    p.add_argument("--recall_data_dir", default=str(ROOT / "experiments" / "data" / "recall"))
    p.add_argument("--results_only", action="store_true", help="only rewrite RESULTS.md from the logs")
    args = p.parse_args(argv)
    if args.results_only:
        write_results(Path(args.out_dir), args.results_md)
        print(f"wrote {args.results_md}")
        return 0
    args.kernel = args.kernel or kernel_default()
    sweep(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
