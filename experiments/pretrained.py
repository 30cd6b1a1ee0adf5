"""From a pretrained dense model to every variant: the conversion study (RESULTS.md's section
"From a pretrained dense model"), the way sparse attention is used in practice (DeepSeek-V3.2's
sparse attention made from the dense V3.1; MoBA's continued training of a dense model).

    python experiments/pretrained.py --pretrained=RUN --data_dir=data/bytes   # all that is left
    python experiments/pretrained.py --plan                                   # the commands, what is done
    python experiments/pretrained.py --report                                 # rewrite RESULTS.md

1. The pretrained model: a `full` run of train.py's CPU preset (PRETRAIN: `python train.py
   --data_dir=data/bytes --max_steps=2000 --out_dir=RUN`, made here when RUN holds none). Its
   logs (not its checkpoint) are copied to experiments/results/pretrained/dense/.
2. Export through the Hugging Face path: model.save_hf writes RUN's model as a Qwen3 folder
   (--hf_dir), with the byte tokenizer as a tokenizer.json (data.byte_tokenizer_json: a byte-level
   BPE without merges, which transformers' AutoTokenizer encodes text with and data.load_tokenizer
   reads back as `byte`, so the byte shards stay this model's shards); transformers loads it and
   its logits are compared with ours (export.json).
3. Training-free, for every variant: `evaluate.py --init_from=HF --attn=X` (loss by position and
   the recall probe) -> VARIANT/before.json.
4. Continued training, for every variant and `full` (from the same weights, the same batches):
   `train.py --init_from=HF --attn=X` for STEPS steps (TRAIN) -> VARIANT/log.jsonl (its step-0
   val and val_tail are the converted model's, before any step), then `evaluate.py --ckpt` ->
   VARIANT/after.json. `indexer` follows [DS32]: its first steps are dense, with every pretrained
   parameter frozen and the indexer trained by its KL loss alone (train.py's default with
   --init_from); every other variant trains all its parameters from step 1.

A finished step is skipped and a cut training run resumes, so the study can run over several
sittings; commit experiments/results/pretrained/ as runs finish. The variant settings are the
CPU preset's (window 64 of 256 bytes, ...), for the conversion as for the training.
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recall import run_finished  # noqa: E402

RESULTS_DIR = ROOT / "experiments" / "results" / "pretrained"
PRETRAIN = dict(max_steps=2000)  # train.py's CPU preset otherwise (the command in dense/command.txt)
STEPS = 200
# Continued training: lr 5e-4 (a sixth of the pretraining's peak; its last step ran at 3e-4),
# a short warm-up for the fresh AdamW moments, cosine to 0.1 x lr; the CPU preset's batch; seed
# 1, not the pretraining's 1337, so that the batches are not the pretraining's first ones again.
TRAIN = dict(max_steps=STEPS, lr=5e-4, warmup_steps=20, eval_every=20, ckpt_every=50, eval_seqs=0, seed=1)
EVAL = dict(n_seq=16, recall=64)  # loss by position on 16 val sequences per length; recall on 64 sequences


def variants():
    from attention import VARIANTS
    return list(VARIANTS)


def preset_settings():
    """The CPU preset's variant settings (window, blocks, ...), which the training runs get from
    the preset and the training-free evaluations are given as flags."""
    import config
    return {k: v for k, v in config.TRAIN_PRESETS["cpu"].items() if k in config.VARIANT_DEFAULTS}


def rel(path):
    """A path inside the repository as a relative one (links kept: data/bytes may be one), so the
    committed commands run anywhere."""
    path = Path(os.path.abspath(path))
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def flags(d):
    return [f"--{k}={v}" for k, v in d.items()]


def commands(attn, hf_dir, data_dir, results_dir):
    """{'before', 'train', 'after'}: the three commands of one variant (lists, run from ROOT)."""
    out = Path(results_dir) / attn
    hf, data_dir = rel(hf_dir), rel(data_dir)
    settings = {k: v for k, v in preset_settings().items()}
    return {
        "before": ["python", "evaluate.py", f"--init_from={hf}", f"--attn={attn}", *flags(settings),
                   f"--data_dir={data_dir}", "--seq_len=256", *flags(EVAL), f"--out={rel(out / 'before.json')}"],
        "train": ["python", "train.py", "--preset=cpu", "--device=cpu", f"--init_from={hf}", f"--attn={attn}",
                  f"--data_dir={data_dir}", f"--out_dir={rel(out)}", *flags(TRAIN)],
        "after": ["python", "evaluate.py", f"--ckpt={rel(out)}", *flags(EVAL), f"--out={rel(out / 'after.json')}"],
    }


def run(cmd, out_dir, name):
    """Run one command from ROOT, its output appended to out_dir/stdout.txt (not committed)."""
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    with open(Path(out_dir) / "stdout.txt", "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        subprocess.run([sys.executable, *cmd[1:]], check=True, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    print(f"{name}: {time.time() - t0:.0f} s", flush=True)


# ----------------------------------------------------------------------------- 1-2: the pretrained model, exported

def pretrain(run_dir, data_dir, results_dir):
    """The pretrained `full` model in run_dir (trained here if it holds none), its logs copied
    to results_dir/dense with the command that made it."""
    cmd = ["python", "train.py", f"--data_dir={rel(data_dir)}", f"--out_dir={rel(run_dir)}", *flags(PRETRAIN)]
    if not run_finished(run_dir):
        if (Path(run_dir) / "ckpt.pt").exists():
            cmd.append("--resume=True")
        run(cmd, run_dir, "pretraining")
    dense = Path(results_dir) / "dense"
    dense.mkdir(parents=True, exist_ok=True)
    for name in ("log.jsonl", "config.json", "eval.json"):
        shutil.copyfile(Path(run_dir) / name, dense / name)
    config = json.loads((dense / "config.json").read_text())
    train = config["train"]
    command = (f"python train.py --data_dir={train['data_dir']} --out_dir={train['out_dir']} --max_steps="
               f"{train['max_steps']}  # at commit {config['git_commit']}, CPU preset otherwise")
    (dense / "command.txt").write_text(command + "\n")


def export(run_dir, hf_dir, results_dir):
    """RUN's model as a Hugging Face Qwen3 folder (model.save_hf), its tokenizer as a
    tokenizer.json, and transformers' logits on val text compared with ours -> export.json."""
    import numpy as np
    import torch

    import data
    from model import load_checkpoint, load_hf, save_hf

    model, ckpt = load_checkpoint(run_dir, "cpu")
    tok = data.load_tokenizer(ckpt.get("tokenizer", "gpt2"))
    if tok.kind == "gpt2":
        raise SystemExit("export: GPT-2's tokenizer has no tokenizer.json here (tiktoken); export a byte or "
                         "tokenizer-file model")
    tokenizer_json = data.byte_tokenizer_json() if tok.kind == "byte" else tok.json_text
    seq_len = ckpt["train_config"]["seq_len"]
    save_hf(model, hf_dir, tokenizer_json=tokenizer_json, eos_token_id=tok.eot, max_position_embeddings=4 * seq_len,
            tokenizer_config=data.BYTE_TOKENIZER_CONFIG if tok.kind == "byte" else None)
    weights = Path(hf_dir) / "model.safetensors"
    record = {"run": rel(run_dir), "hf_dir": rel(hf_dir), "files": sorted(os.listdir(hf_dir)),
              "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(), "tokenizer": tok.name,
              "step": ckpt["step"]}
    val = np.asarray(data.load_shard(data.find_shards(ckpt["train_config"]["data_dir"], "val")[0])[: 4 * seq_len])
    idx = torch.from_numpy(val.astype(np.int64)).view(4, seq_len)  # (4, T) val bytes
    back, _ = load_hf(hf_dir)  # our loader: the same weights, bit for bit
    record["reloaded_equal"] = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                                      back.state_dict().values()))
    try:
        import transformers
    except ImportError:
        record["transformers"] = "not installed: pip install transformers to check the folder with it"
    else:
        hf = transformers.Qwen3ForCausalLM.from_pretrained(hf_dir).eval()
        with torch.no_grad():
            diff = (hf(idx).logits - model(idx)[0]).abs().max().item()
        text = "The pretrained model, exported: naïve café, 日本語, <|endoftext|> as text."
        hf_ids = transformers.AutoTokenizer.from_pretrained(hf_dir)(text)["input_ids"]
        record["transformers"] = {"version": transformers.__version__, "max_abs_logit_diff": diff,
                                  "tokens": int(idx.numel()), "tokenizer_agrees": hf_ids == tok.encode(text)}
    (Path(results_dir) / "export.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"exported {rel(run_dir)} to {rel(hf_dir)}: {json.dumps(record.get('transformers'))}")
    return record


# ----------------------------------------------------------------------------- 3-4: every variant

def study(hf_dir, data_dir, results_dir, only=None):
    for attn in only or variants():
        out = Path(results_dir) / attn
        cmds = commands(attn, hf_dir, data_dir, results_dir)
        if not (out / "before.json").exists():
            run(cmds["before"], out, f"{attn}: training-free evaluation")
        if not run_finished(out):
            train = cmds["train"] + (["--resume=True"] if (out / "ckpt.pt").exists() else [])
            run(train, out, f"{attn}: {STEPS} steps of continued training")
        if not (out / "after.json").exists():
            run(cmds["after"], out, f"{attn}: evaluation after training")
        (out / "command.txt").write_text("\n".join(" ".join(c) for c in cmds.values()) + "\n")


# ----------------------------------------------------------------------------- RESULTS.md

def load(results_dir, attn):
    """{'log': [records], 'before': ..., 'after': ...} of one variant, what exists of it."""
    out = Path(results_dir) / attn
    found = {}
    if (out / "log.jsonl").exists():
        found["log"] = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
    for name in ("before", "after"):
        if (out / f"{name}.json").exists():
            found[name] = json.loads((out / f"{name}.json").read_text())
    return found


def val_at(log, step):
    """(val, val_tail) of train.py's evaluation at `step` (step 0: the converted model, before
    any update), or (None, None)."""
    for r in log:
        if r.get("step") == step and "val" in r and "event" not in r:
            return r["val"], r.get("val_tail")
    return None, None


def _f(x, spec=".4f"):
    return "–" if x is None else format(x, spec)


def recall_cells(rec):
    """'all / lag <= W / lag > W' accuracies of a recall_probe record."""
    if not rec or "buckets" not in rec:
        return "–"
    near = rec["buckets"][0]["acc"]
    far = [b for b in rec["buckets"][1:] if b["n"]]
    far_acc = sum(b["acc"] * b["n"] for b in far) / sum(b["n"] for b in far) if far else None
    return f"{_f(rec['accuracy'], '.2f')} / {_f(near, '.2f')} / {_f(far_acc, '.2f')}"


def section(results_dir, link):
    """RESULTS.md's lines for the conversion study (experiments/sweep.py puts them at the end);
    link(path) makes a path relative to RESULTS.md."""
    from attention import VARIANTS

    results_dir = Path(results_dir)
    L = ["## From a pretrained dense model: convert, score, continue training", ""]
    dense_cfg = results_dir / "dense" / "config.json"
    export_path = results_dir / "export.json"
    if not dense_cfg.exists():
        return L + ["Not run yet: `python experiments/pretrained.py --pretrained=RUN --data_dir=data/bytes`.", ""]
    config = json.loads(dense_cfg.read_text())
    dense_log = [json.loads(line) for line in (results_dir / "dense" / "log.jsonl").read_text().splitlines() if line]
    last = [r for r in dense_log if "val" in r and "loss" in r][-1]
    dense_eval = json.loads((results_dir / "dense" / "eval.json").read_text())
    t = config["train"]
    L += [f"`experiments/pretrained.py` (its docstring says each step; commands below). The pretrained model is a "
          f"`full` run of train.py's CPU preset ({config['num_params']:,} parameters, {t['max_steps']} steps of "
          f"{t['total_batch_tokens']:,} bytes of the FineWeb slice; val {last['val']:.4f} nats/byte, and "
          f"{dense_eval['nats_per_token']:.4f} on evaluate.py's sequences against the unigram's "
          f"{dense_eval['unigram']['nats_per_token']:.4f} there; its logs and command: "
          f"[{link(results_dir / 'dense')}]({link(results_dir / 'dense')})). It is exported with `model.save_hf` "
          f"as a Hugging Face Qwen3 folder; its byte tokenizer travels as a tokenizer.json (a byte-level BPE "
          f"without merges, id = byte, which transformers' AutoTokenizer reads and data.py reads back as `byte`)."]
    if export_path.exists():
        e = json.loads(export_path.read_text())
        tr = e.get("transformers")
        L[-1] += (f" transformers {tr['version']} loads the folder with the same logits (largest difference "
                  f"{tr['max_abs_logit_diff']:.1e} over {tr['tokens']} val bytes; its tokenizer encodes text as "
                  f"ours{'' if tr['tokenizer_agrees'] else ' NOT'}), and our loader reads the weights back "
                  f"{'bit for bit' if e['reloaded_equal'] else 'CHANGED'}." if isinstance(tr, dict) else f" ({tr})")
    L += ["", f"Then `--init_from=` that folder `--attn=X` for every variant (the CPU preset's settings: window 64 of "
              f"256 bytes, ...): scored training-free (evaluate.py), then trained for {STEPS} steps (lr "
              f"{TRAIN['lr']:g}, warm-up {TRAIN['warmup_steps']}, cosine to 0.1 x lr, the preset's 4,096 bytes per "
              f"step, seed {TRAIN['seed']}) and scored again; `full` continued for the same steps from the same weights "
              f"on the same batches is the control. `indexer` follows [DS32]: dense for its first "
              f"{config_indexer_warmup(results_dir)} steps with every pretrained parameter frozen and the indexer "
              f"trained by its KL loss alone, then sparse with all parameters; every other variant trains all its "
              f"parameters from step 1. val: train.py's validation loss (nats/byte, {t['val_tokens']:,} val bytes) "
              f"right after conversion (step 0) and after the last step, with its difference from `full`'s at the "
              f"same step; tail: the same over the last quarter of positions (192-255), where a window drops the "
              f"most keys; recovered: the first evaluation (every {TRAIN['eval_every']} steps) whose tail is within "
              f"{RECOVERED} of `full`'s at that step. Recall: the probe's accuracy (all queries / lag <= 64, the "
              f"window / lag > 64; chance 0.10), training-free and after the steps.", "",
          "| variant | its new parameters at conversion | val at conversion (Δ full) | tail | val after (Δ full) | tail "
          "| recovered | recall before | recall after |",
          "|---|---|---|---|---|---|---|---|---|"]
    rows = {attn: load(results_dir, attn) for attn in variants()}
    full_log = rows["full"].get("log", [])
    for attn, r in rows.items():
        log = r.get("log", [])
        cells = []
        for step in (0, STEPS):
            v, tail = val_at(log, step)
            ref = val_at(full_log, step)[0]
            cells += [_f(v) + (f" ({v - ref:+.4f})" if v is not None and ref is not None else ""), _f(tail)]
        start = VARIANTS[attn].FROM_PRETRAINED if attn in VARIANTS else "–"
        L.append(f"| {attn} | {start} | {' | '.join(cells)} | {recovered_at(log, full_log)} | "
                 f"{recall_cells((r.get('before') or {}).get('recall'))} | {recall_cells((r.get('after') or {}).get('recall'))} |")
    L += indexer_lines(rows["indexer"].get("log", []), full_log)
    L += [""] + position_lines(rows)
    full_recall = (rows["full"].get("before") or {}).get("recall")
    if full_recall and abs(full_recall["accuracy"] - full_recall["chance"]) < 0.02:
        L += ["", f"The dense model itself recalls at chance ({full_recall['accuracy']:.3f} of "
                  f"{full_recall['n_queries']:,} queries): a {config['num_params'] / 1e6:.1f}M-parameter byte model does "
                  f"not copy a value from its context, so at this size the probe cannot separate the variants. Nor "
                  f"does the loss by position show use of distant bytes: `local`'s window of 64 costs "
                  + _gap(rows, "local") + " at conversion, so this model mostly tells how well each conversion "
                  f"keeps its short-range computation, not how each variant reaches far."]
    missing = [a for a, r in rows.items() if "after" not in r]
    if missing:
        L += ["", f"Not finished yet: {', '.join(missing)}. `python experiments/pretrained.py --pretrained=RUN "
                  f"--data_dir=data/bytes` runs what is left, then `--report` rewrites this section."]
    for rerun in sorted(results_dir.glob("rerun_*.txt")):  # the study run again on a later commit
        L += ["", f"Run again: {rerun.read_text().splitlines()[0].lstrip('# ')} ([{rerun.name}]({link(rerun)}))."]
    example = commands("indexer", "out/pretrained/hf", "data/bytes", "experiments/results/pretrained")
    L += ["", "Commands (for every variant X; each run's are in experiments/results/pretrained/X/command.txt):", "",
          "```", "python experiments/pretrained.py --pretrained=RUN --data_dir=data/bytes   # all of it, resumable",
          *(" ".join(c) for c in example.values()), "```", ""]
    return L


RECOVERED = 0.01  # nats/byte: a conversion has recovered when its tail loss is this close to full's


def recovered_at(log, full_log):
    """The first evaluated step at which the tail loss is within RECOVERED of full's, or '–'."""
    full_tail = {r["step"]: r["val_tail"] for r in full_log if "val_tail" in r and "event" not in r}
    for r in log:  # the indexer's dense warm-up attends densely: not yet the converted model
        if "val_tail" in r and "event" not in r and r["step"] in full_tail and r.get("indexer_stage") != "dense":
            if r["val_tail"] - full_tail[r["step"]] <= RECOVERED:
                return f"step {r['step']}"
    return "–" if not log else "not by the end"


def indexer_lines(log, full_log):
    """What the indexer's log says of its [DS32] warm-up: the loss stays the pretrained model's
    while it runs (every pretrained weight frozen, attention dense), its KL falls, and the
    first sparse evaluation keeps some share of the dense attention's mass."""
    evals = [r for r in log if "val" in r and "loss" in r and "event" not in r]
    dense = [r for r in evals if r.get("indexer_stage") == "dense"]
    sparse = [r for r in evals if r.get("indexer_stage") == "sparse"]
    steps = [r for r in log if "indexer_kl" in r and "event" not in r]
    if not (dense and sparse and steps):
        return []
    pre = val_at(full_log, 0)[0]
    kl_end = [r for r in steps if r.get("indexer_stage") == "dense"][-1]
    first = sparse[0]
    kept = first.get("gates", {}).get("kept_mass", {}).get("mean")
    ref = val_at(full_log, first["step"])[0]
    vals = ", ".join(format(r["val"], ".4f") for r in dense)
    at = ", ".join(str(r["step"]) for r in dense)
    return ["", f"`indexer` during its warm-up: validation loss {vals} at step{'s' if len(dense) > 1 else ''} "
                f"{at}, " + ("bit for bit the pretrained model's" if all(r["val"] == pre for r in dense) else
                             "against the pretrained model's") + f" {pre:.4f} (every pretrained weight frozen, "
                f"attention dense), while the indexer's KL "
                f"loss (summed over layers) fell from {steps[0]['indexer_kl']:.3f} at step 1 to "
                f"{kl_end['indexer_kl']:.3f} at step {kl_end['step']}. At the first sparse evaluation (step "
                f"{first['step']}) its loss is {first['val']:.4f} ({first['val'] - ref:+.4f} from `full`'s)"
                + (f", its selection keeping {sum(m[0] for m in kept) / len(kept):.3f} of the dense attention's mass "
                   f"(mean over layers; {val_kept(log, 0):.3f} with the untrained indexer at step 0)" if kept else "")
                + "."]


def val_kept(log, step):
    r = next((r for r in log if r.get("step") == step and "gates" in r and "event" not in r), {})
    kept = r.get("gates", {}).get("kept_mass", {}).get("mean")
    return sum(m[0] for m in kept) / len(kept) if kept else float("nan")


def _gap(rows, attn):
    v, ref = val_at(rows[attn].get("log", []), 0)[0], val_at(rows["full"].get("log", []), 0)[0]
    return "–" if v is None or ref is None else f"{v - ref:+.4f} nats/byte"


def config_indexer_warmup(results_dir):
    path = Path(results_dir) / "indexer" / "log.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r.get("event") == "start":
                return r["train"]["warmup_new_steps"]
    return 50


def position_lines(rows):
    """Loss by position at the trained length, before and after, in three ranges of the
    window W = 64: inside it, one to two windows, beyond."""
    def ranges(rec):
        pos = next((p for p in (rec or {}).get("positions", []) if p.get("factor") == 1 and "buckets" in p), None)
        if pos is None:
            return None
        out = []
        for lo, hi in ((1, 63), (64, 127), (128, 256)):
            bs = [b for b in pos["buckets"] if b["first"] >= lo and b["last"] <= hi]
            n = sum(b["last"] - b["first"] + 1 for b in bs)
            out.append(sum(b["mean"] * (b["last"] - b["first"] + 1) for b in bs) / n if n else None)
        return out

    L = ["Loss by position (evaluate.py, nats/byte at 256 bytes, 16 val sequences; positions 1-63 / 64-127 / "
         "128-256), training-free and after the steps:", "",
         "| variant | training-free | after |", "|---|---|---|"]
    for attn, r in rows.items():
        cells = []
        for name in ("before", "after"):
            rs = ranges(r.get(name))
            cells.append("–" if rs is None else " / ".join(_f(x, ".3f") for x in rs))
        L.append(f"| {attn} | {cells[0]} | {cells[1]} |")
    return L


def report(results_dir=RESULTS_DIR, results_md=ROOT / "RESULTS.md"):
    """Rewrite RESULTS.md: experiments/sweep.py writes all of it, this section included. It runs
    as a process of its own: sweep.py imports this module, and imports run one way."""
    subprocess.run([sys.executable, str(ROOT / "experiments" / "sweep.py"), "--results_only",
                    f"--out_dir={Path(results_dir).parent}", f"--results_md={results_md}"],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pretrained", default="out/pretrained/dense", help="the pretrained full run (made if empty)")
    p.add_argument("--data_dir", default="data/bytes", help="byte shards (data.py --tokenizer=byte)")
    p.add_argument("--hf_dir", default="out/pretrained/hf", help="where the Hugging Face export goes")
    p.add_argument("--results_dir", default=str(RESULTS_DIR))
    p.add_argument("--only", default=None, help="comma-separated variants")
    p.add_argument("--plan", action="store_true", help="print every command and whether it is done")
    p.add_argument("--report", action="store_true", help="only rewrite RESULTS.md")
    args = p.parse_args(argv)
    only = args.only.split(",") if args.only else None
    if args.plan:
        for attn in only or variants():
            out = Path(args.results_dir) / attn
            done = {"before": (out / "before.json").exists(), "train": run_finished(out), "after": (out / "after.json").exists()}
            for step, cmd in commands(attn, args.hf_dir, args.data_dir, args.results_dir).items():
                print(f"{attn:9s} {step:6s} {'done' if done[step] else 'to run':6s} {' '.join(cmd)}")
        return 0
    if not args.report:
        pretrain(args.pretrained, args.data_dir, args.results_dir)
        if not (Path(args.hf_dir) / "model.safetensors").exists():
            export(args.pretrained, args.hf_dir, args.results_dir)
        study(args.hf_dir, args.data_dir, args.results_dir, only)
    if Path(args.results_dir).resolve() == RESULTS_DIR.resolve():
        report(args.results_dir)
        print("wrote RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
