"""Seconds per optimizer step of each variant at the study's sizes (sweep.TEXT, recall.TRAIN),
for the sweep's budget (sweep.STEP_SECONDS). Short runs in a temporary folder, one at a time:

    OMP_NUM_THREADS=1 python experiments/calibrate.py --steps=15 [--part=text|recall] [--attn=full,local]

Prints the median step time (steps after the first two, which pay for warm-up) and the
machine's load average, since other jobs on a shared machine change the absolute numbers.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import recall  # noqa: E402
import sweep  # noqa: E402


def step_seconds(cmd, out_dir):
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=sweep.ROOT)
    records = [json.loads(line) for line in Path(out_dir, "log.jsonl").read_text().splitlines()]
    per_step = [r for r in records if "tok_s" in r and r["step"] > 2]
    batch = json.loads(Path(out_dir, "config.json").read_text())["train"]["total_batch_tokens"]
    return statistics.median(batch / r["tok_s"] for r in per_step)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--part", choices=("text", "recall"), default="text")
    p.add_argument("--attn", default="full,local,dsa,asga,caa")
    p.add_argument("--data_dir", default=str(sweep.ROOT / "experiments" / "data" / "text"))
    p.add_argument("--recall_data_dir", default=str(sweep.ROOT / "experiments" / "data" / "recall"))
    p.add_argument("--kernel", default=None)
    args = p.parse_args(argv)
    kernel = args.kernel or sweep.kernel_default()
    short = dict(max_steps=args.steps, eval_every=10 ** 6, warmup_steps=1, ckpt_every=10 ** 6)
    result = {}
    for attn in args.attn.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            if args.part == "text":
                cmd = sweep.text_command(attn, {}, 0, tmp, args.data_dir, kernel, **short)
            else:
                recall.make_data(args.recall_data_dir)
                cmd = recall.train_command(attn, 0, args.recall_data_dir, tmp, kernel=kernel, **short)
            result[attn] = round(step_seconds(cmd, tmp), 3)
        print(f"{args.part} {attn}: {result[attn]:.3f} s/step | load {os.getloadavg()[0]:.1f}", flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
