"""The study: the papers' configurations at a scale that can tell them apart where a
difference is known to exist, run by run, resumable, and RESULTS.md written from the logs.

    python experiments/sweep.py --text_source=TRAIN.jsonl --text_val_source=VAL.jsonl
    python experiments/sweep.py --plan            # the runs, which are done, the time left
    python experiments/sweep.py --only=recall     # one part: recall | window | text | long | cost
    python experiments/sweep.py --results_only    # rewrite RESULTS.md (and figures) from the logs

Five parts, each a list of train.py runs (through experiments/paired.py, so that at one seed
every variant starts from `full`'s values of the parameters they share, and data.py's loader
gives every variant the same batches):

1. recall (experiments/recall.py): multi-query associative recall, scored by distance, for
   every configuration in RECALL_CONFIGS (seed 0). The positive control is `full` (it must
   reach >= 0.9) and `local` (it must sit at chance beyond its receptive field).
2. window: the positive control on text. `local` with W in WINDOWS and `full`, paired seeds:
   how much context the small model uses, so which differences this scale can resolve.
3. text: every configuration in TEXT_CONFIGS (the papers' tables, both dsa configurations,
   the new flags), paired seeds; each reported as its paired difference from `full`.
4. long: `full` and `local` at W = LONG_WINDOW for LONG_STEPS steps, seed 0: the budget at
   which the loss starts to show context use beyond a few bytes.
5. cost: every text configuration for COST_STEPS steps, back to back, for the tok/s and memory
   columns (run it alone: its numbers are only comparable when nothing else competes).

Text runs read byte-level shards (experiments/text_data.py; vocabulary 256, so no 50k head)
made from --text_source / --text_val_source on first use. Run folders under --out_dir
(experiments/results): recall/NAME_sSEED, text/NAME_sSEED (window runs are text/local_wW_sSEED),
long/NAME_s0 and cost/NAME, each train.py's (config.json, log.jsonl, command.txt; recall adds
recall.json). A run whose log ends with train.py's `end` record is skipped, one with a
checkpoint is resumed, so the sweep can be finished over several sittings; commit the logs
(not ckpt.pt) as you go.
Figures go to assets/study_*.png.

Budget: 16 recall runs of 1500 steps, 30 window runs and 36 more text runs of 500 steps
(12 more configurations x 3 seeds), 2 long runs of LONG_STEPS steps and 14 cost runs of
COST_STEPS steps. `--plan` adds up STEP_SECONDS (one thread) for the runs left. Run as two
sweeps given disjoint --configs (never the same run twice at once): 39 of the runs took 46 min
and the long pair 22 min, then `--only=cost` alone 2.6 min; the whole study, summed from the
runs' times, is roughly 2.5 h of the 2-core machine.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

import pretrained  # noqa: E402
import recall  # noqa: E402
import recall_grid  # noqa: E402
import text_data  # noqa: E402

SEEDS = (0, 1, 2)

# ----------------------------------------------------------------------------- configurations
# (name, attn, flags). Edit here when a flag's name changes; a configuration whose attn or
# flag this checkout does not have is listed as pending (see `unavailable`), never guessed.
# This project's own flags beside the papers' configurations: asga_gate_space='prob' (the
# probability-space gate, softmax(alpha + log s), our variant of 003's eq. 3) and
# caa_gate_norm (a LayerNorm on caa's gate MLP: our reading of 004's "careful normalization").
TEXT_CONFIGS = [
    ("full", "full", {}),
    ("local", "local", {}),
    ("dsa", "dsa", {"dsa_window": "adaptive"}),
    ("dsa_fixed", "dsa", {"dsa_window": "fixed"}),
    ("dsa_nogate", "dsa", {"dsa_window": "adaptive", "dsa_gate": False}),
    ("dsa_nowin", "dsa", {"dsa_window": "none"}),
    ("asga", "asga", {}),
    ("asga_noscale", "asga", {"asga_scale": False}),
    ("asga_fixed", "asga", {"asga_gate": "fixed"}),
    ("asga_off", "asga", {"asga_gate": "off", "asga_scale": False}),
    ("asga_prob", "asga", {"asga_gate_space": "prob"}),
    ("caa", "caa", {}),
    ("caa_gatenorm", "caa", {"caa_gate_norm": True}),
    ("combiner", "combiner", {}),
    # The later baselines (baselines.md), at as many keys per query as `local` (TEXT, recall.TRAIN):
    ("nsa", "nsa", {}),
    ("moba", "moba", {}),
    ("indexer", "indexer", {}),  # dense for its first indexer_warmup steps (train.py's default)
    ("indexer_nowarm", "indexer", {"indexer_warmup": 0}),  # sparse from step 1 (an ablation)
]
# Recall adds caa with each branch forced (what each branch alone can reach).
RECALL_CONFIGS = TEXT_CONFIGS + [
    ("caa_local", "caa", {"caa_gate": "local"}),
    ("caa_global", "caa", {"caa_gate": "global"}),
]
# The study's planned windows 16..256, plus 1, 2, 4 and 8: at this budget a 16-byte window already
# matches `full` (seed 0: 2.294 vs 2.316), so the smaller ones find where a difference appears.
# A window W sees keys i-W..i, so with 2 layers a prediction can draw on 2W+1 bytes.
WINDOWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# Text runs: bytes, sequences of 512, W = 64 for every windowed variant (the papers' geometry
# W=256 / dsa threshold 512 = 2W / caa width 256..512 = W..2W, scaled by 1/4: one byte is
# about a quarter of a GPT-2 token). dsa_window=adaptive then windows the positions >= 128:
# 384 of 512 (75%; at the papers' seq_len 1024 it is 50%, at 002's 32768 98.4%).
TEXT = dict(model="tiny", vocab_size=256, n_layer=2, d_model=128, n_head=4, n_kv_head=4, head_dim=32,
            mlp_hidden=384, window=64, dsa_threshold=128, caa_window_max=128,
            seq_len=512, batch_size=2, total_batch_tokens=1024, lr=3e-3, warmup_steps=20,
            max_steps=500, eval_every=100, val_tokens=16384, gate_batch=2, ckpt_every=100,
            # the final evaluation (evaluate.py): loss by position and bits per byte on 64 val
            # sequences at 1x, 2x and 4x seq_len (train.py's default of 8 leaves 95% intervals
            # of ~0.15 nats on the whole-sequence mean; the paired differences need fewer)
            eval_seqs=64,
            # nsa: lucidrains' byte-level enwik8 setting at T = 512 (baselines.md 1.5): compressed
            # blocks of 16 every 8, 4 selected blocks of 16 (3 forced), a window of W; moba: 4
            # blocks of 16 (its own + 3) = W keys; indexer: the top W keys (index_topk = 0),
            # scored by 4 heads of 32 (one head's size here).
            nsa_cmp_block=16, nsa_cmp_stride=8, nsa_block=16, nsa_topk=4, nsa_window=64,
            moba_block=16, moba_topk=4, index_head_dim=32)

# A long pair beside the window control: `full` and `local` at W = LONG_WINDOW, seed 0, for
# LONG_STEPS steps (40x the study's budget, most of one epoch of the 24 MB train split): how
# much training the loss needs before it shows any use of context beyond a few bytes. Scored on
# up to LONG_VAL_TOKENS val bytes (the whole 0.5 MB val shard here): at the study's 16,384 the
# evaluation noise (~0.02) is as large as the difference being looked for.
LONG_STEPS = 20000
LONG_WINDOW = 4
LONG_VAL_TOKENS = 2 ** 19

# Cost: every text configuration timed for COST_STEPS steps (seed 0, one thread), all back to
# back in one sitting (`--only=cost`, on an otherwise quiet machine), so the tok/s and memory
# columns compare runs measured side by side. The sweep's own runs ran two at a time beside
# other work, so their tok/s says more about the machine's load than about the variant.
COST_STEPS = 40

# Seconds per optimizer step with OMP_NUM_THREADS=1, measured at 06:15 UTC while the shared
# machine was nearly quiet (load average 1.8-2.8): `python experiments/calibrate.py --steps=15
# --part=text` and `--part=recall --attn=full,local,dsa,asga,caa`. Variants without a number
# (flags not in this checkout) count as `full`. Under load 7-14 (four other jobs) the same
# steps took 3-6x longer (text at 2048 bytes/step: full 1.44, local 1.54, dsa 1.31, asga 5.22,
# caa 1.78 s; recall: full 1.03, dsa 0.88, asga 1.39, caa 0.87 s). The last 39 runs (2026-11-22,
# two sweeps side by side, one thread each) took, per run with evaluations and start-up: text
# asga/asga_noscale/asga_prob 160-185 s (0.35 s/step: these estimates are 2.7x too high), caa
# 90-104 s, dsa/asga_off/asga_fixed/combiner 36-53 s; recall asga 430-498 s (0.3 s/step: 2x too
# low), caa and asga_off 158-192 s.
STEP_SECONDS = {
    "text": {"full": 0.151, "local": 0.130, "dsa": 0.169, "asga": 0.928, "caa": 0.197},
    "recall": {"full": 0.204, "local": 0.158, "dsa": 0.242, "asga": 0.162, "caa": 0.154},
}

def ngram_baselines(data_dir, val_tokens):
    """Cross-entropy (nats per byte) on the validation bytes the runs are scored on of the
    train split's unigram and bigram statistics (bigram counts + 0.01): the losses a model
    must get below to be using more than one previous byte."""
    import numpy as np
    from data import find_shards, load_shard

    train = np.concatenate([np.asarray(load_shard(p)) for p in find_shards(data_dir, "train")]).astype(np.int64)
    val = np.asarray(load_shard(find_shards(data_dir, "val")[0]))[:val_tokens].astype(np.int64)
    uni = np.bincount(train, minlength=256) + 1.0
    bi = np.full((256, 256), 0.01)
    np.add.at(bi, (train[:-1], train[1:]), 1)
    return {"unigram": float(-np.log(uni[val] / uni.sum()).mean()),
            "bigram": float(-np.log((bi / bi.sum(1, keepdims=True))[val[:-1], val[1:]]).mean()),
            "val_bytes": int(len(val))}


def windowed_share(seq_len, threshold):
    """Share of query positions that dsa_window=adaptive windows (positions >= threshold)."""
    return max(0, seq_len - threshold) / seq_len


# ----------------------------------------------------------------------------- the papers
# Every number of the papers' tables, checked against the paper texts: (paper, the paper's
# row, validation loss, its ± if given, memory, speed as the paper gives it, our config).
PAPERS = {
    "000": "Dynamic Sparse Attention with Learned Head Gating: Methods and Analysis (000; 001 is a plain-text rendering of it)",
    "002": "Dynamic Sparse Attention for Efficient Language Modeling (002)",
    "003": "Adaptive Sparse-Geometric Attention: A Comprehensive Empirical Analysis, ASGA (003)",
    "004": "Context-Adaptive Attention: A Balanced Approach for Efficient Language Modeling, CAA (004)",
}
PAPER_BASELINES = {"000": 4.9266, "002": 4.9266, "003": 4.927, "004": 4.9266}
PAPER_ROWS = [
    ("000", "Baseline Attention", "4.9266", None, None, "24.5 h training", "full"),
    ("000", "Our Method", "4.6498", None, None, "25.1 h training", "dsa_fixed"),
    ("002", "Qwen baseline", "4.9266", None, "28 GB", "13,200 tok/s", "full"),
    ("002", "Full Model", "4.904", None, "22 GB", "12,500 tok/s (0.95x)", "dsa"),
    ("002", "No Gating", "4.918", None, None, None, "dsa_nogate"),
    ("002", "Fixed Window", "4.927", None, None, None, "dsa_fixed"),
    ("002", "No Window", "5.012", None, None, None, "dsa_nowin"),
    ("002", "Probabilistic Positional Attention", "5.1300", None, None, None, None),
    ("003", "Qwen Baseline", "4.927", 0.012, None, "1.00x", "full"),
    ("003", "Dynamic Sparse", "4.904", 0.011, None, "1.15x", "dsa"),
    ("003", "ASGA (Ours)", "5.148", 0.015, None, "0.92x", "asga"),
    ("003", "Removing geometric scaling", "5.201", None, None, None, "asga_noscale"),
    ("003", "Fixed sparsity patterns", "5.087", None, None, None, "asga_fixed"),
    ("003", "Disabling both components", "4.930", None, None, None, "asga_off"),
    ("004", "Baseline", "4.9266", None, "31.5 GB", "1.00x", "full"),
    ("004", "Sparse [Combiner]", "4.904", None, "29.8 GB", "1.05x", "combiner"),
    ("004", "Local [Longformer]", "5.021", None, "30.2 GB", "1.03x", "local"),
    ("004", "CAA", "4.712", None, "66.6 GB", "0.82x", "caa"),
]
PAPER_NOTES = [
    "**dsa's two configurations.** 000/001 window every query (W=256, no threshold): "
    "4.6498 belongs to `dsa_fixed` (`--dsa_window=fixed`). 002 windows only queries at "
    "positions >= 512 (its \"adaptive window\"): 4.904 belongs to `dsa` "
    "(`--dsa_window=adaptive`); 002's own \"Fixed Window\" ablation (4.927) is the same "
    "configuration as 000's method, so the two papers disagree about it by 0.28. 003's "
    "\"Dynamic Sparse\" row repeats 002's 4.904 without naming a configuration; we place it "
    "with `dsa`. The adaptive rule's effect depends on how many positions it windows: "
    "{share_study} of the study's {seq_len}-byte sequences (threshold {threshold}), 50% at "
    "the papers' seq_len 1024, 98.4% at 002's 32768.",
    "**Probabilistic Positional Attention (002, 5.13)** is not built: it has no published "
    "definition to implement. The only paper by that name reports 5.13 as the validation loss "
    "of its *baseline* run and says its own mechanism never ran (shape mismatches).",
    "**Sparse [Combiner] (004, 4.904)**: 004 cites Combiner (Yao et al. 2021, \"Combiner: "
    "Full Attention Transformer with Sparse Computation Cost\") for this row; our `combiner` "
    "configuration is this project's implementation of that paper.",
    "**Efficiency columns.** 000 gives training hours, 002 memory and tokens/s, 003 a "
    "\"relative efficiency\" it does not define, 004 memory and relative throughput; ours are "
    "tokens/s and peak memory relative to `full` on a CPU, which show cost, not GPU speed.",
]


# ----------------------------------------------------------------------------- the later baselines
# The headline results of the three later baselines (nsa, moba, indexer), typed by hand with the
# place each is printed and the setting it came from. Checked against:
# [NSA] arXiv:2502.11089 (its text: §4.1, §4.3 Tables 1-3, Figure 5, §5.1, §5.2 Table 4);
# [MoBA] arXiv:2502.13189, the MoBA_Tech_Report.pdf of github.com/MoonshotAI/MoBA @ 61e456b;
# [DS32] github.com/deepseek-ai/DeepSeek-V3.2-Exp @ 3b99a53: DeepSeek_V3_2.pdf and README.md.
# A result a source gives only as a figure is described in words, never read off the plot.
# Per paper: its name, citation, our configurations, the setting, the direction it reports,
# rows (result, sparse, full, where), speed / cost claims, and what was not typed and why.
LATER_PAPERS = [
    {"name": "NSA (Native Sparse Attention)",
     "cite": "Yuan et al. 2025, arXiv:2502.11089",
     "configs": ("nsa",),
     "setting": "a 27B-parameter MoE with 3B active (30 layers, hidden 2560, GQA with 4 groups "
                "and 64 heads), NSA and full attention each pretrained on 270B tokens of 8k-length "
                "text, then continued training and SFT at 32k with YaRN; NSA with compression blocks "
                "of 32 every 16, 16 selected blocks of 64, a window of 512 (§4.1)",
     "baseline": "Full Attention", "direction": "sparse at or above full",
     "rows": [
         ("general benchmarks, average of 9 (MMLU, MMLU-PRO, CMMLU, BBH, GSM8K, MATH, DROP, MBPP, "
          "HumanEval); NSA ahead on 7 of 9", "0.456", "0.443", "§4.3, Table 1"),
         ("LongBench average (the sparse baselines at 2560 keys per query)", "0.469", "0.437",
          "§4.3, Table 2"),
         ("needle in a haystack at 64k context", "perfect retrieval at every position",
          "not reported", "§4.3, Figure 5"),
         ("AIME 24 after SFT on 10B tokens of 32k-length reasoning traces, generation limit 8k / 16k",
          "0.121 / 0.146", "0.046 / 0.092", "§4.3, Table 3"),
     ],
     "speed": [
         "training kernels (Triton NSA against Triton FlashAttention-2, on an 8-GPU A100 system): "
         "up to 9.0x faster forward and 6.0x backward at 64k context (§5.1, Figure 6)",
         "decoding: 5632 keys loaded per step against 65536 at 64k, an expected 11.6x speed-up "
         "(§5.2, Table 4; estimated from memory-access volume, not a measured time)",
     ],
     "unchecked": "the pretraining loss curves (Figure 4: NSA below full throughout) are a figure "
                  "only, so no loss number is typed"},
    {"name": "MoBA (Mixture of Block Attention)",
     "cite": "Lu et al. 2025, arXiv:2502.13189",
     "configs": ("moba",),
     "setting": "(a) scaling-law runs: 5 models of 545M to 2.1B non-embedding parameters trained on "
                "10.8B to 36.9B tokens (Table 1), 8K sequences, blocks of 512, top-3 (§3.1); "
                "(b) Llama-8B-1M-MoBA: Llama 3.1 8B continually pretrained from 128K to 1M context, "
                "then MoBA for 100B tokens with blocks of 4096, top-12, the last 3 of 32 layers full, "
                "against Llama-8B-1M-Full trained the same way; MoBA only for prefill in the "
                "evaluations (§3.3)",
     "baseline": "full attention (b: Llama-8B-1M-Full)", "direction": "sparse close to full",
     "rows": [
         ("(a) fitted LM loss at seqlen 8K against compute C (PFLOP/s-days); the two stay within "
          "1e-3 of each other (§3.1)", "2.625 × C^-0.063", "2.622 × C^-0.063", "§3.1, Figure 3c"),
         ("(a) fitted trailing LM loss (seqlen 32K, last 2K tokens); MoBA slightly higher at all 5 "
          "sizes, the gap narrowing", "1.546 × C^-0.108", "1.464 × C^-0.097", "§3.1, Figure 3c"),
         ("(b) LongBench @32K", "0.4828", "0.4821", "§3.3, Table 2"),
         ("(b) RULER @128K (MoBA up to 62.5% sparse here)", "0.7818", "0.7849", "§3.3, Table 2"),
         ("(b) MMLU, 0-shot", "0.4903", "0.4904", "§3.3, Table 2"),
         ("(b) GSM8K, 5-shot", "0.7278", "0.7142", "§3.3, Table 2"),
     ],
     "speed": [
         "attention-layer forward time of the two (b) models, MoBA against FlashAttention: up to "
         "6.5x faster when prefilling 1M tokens (§3.4, Figure 2a)",
         "at a fixed 95.31% sparsity (64 blocks, top-3), 16x less attention time at 10M tokens "
         "(§3.4, Figure 2b); the report does not name the GPUs",
     ],
     "unchecked": "the needle-in-a-haystack result up to 1M (Figure 7, \"satisfactory\") is a "
                  "figure only, so no accuracy is typed"},
    {"name": "DeepSeek Sparse Attention (DeepSeek-V3.2-Exp)",
     "cite": "DeepSeek-AI 2025, the report DeepSeek_V3_2.pdf and README of "
             "github.com/deepseek-ai/DeepSeek-V3.2-Exp (the later DeepSeek-V3.2 report: arXiv:2512.02556)",
     "configs": ("indexer", "indexer_nowarm"),
     "setting": "DeepSeek-V3.1-Terminus (the 671B MoE of the repository's config_671B_v3.2.json; "
                "MLA in MQA mode) continually pretrained from its 128K checkpoint: a dense warm-up "
                "training only the indexer (1000 steps, 2.1B tokens, lr 1e-3), then sparse training "
                "with the top 2048 keys per query (15000 steps, 943.7B tokens, lr 7.3e-6), then the "
                "same post-training as V3.1-Terminus (§2)",
     "baseline": "DeepSeek-V3.1-Terminus (dense)", "direction": "sparse on par with dense",
     "rows": [
         ("MMLU-Pro (EM)", "85.0", "85.0", "Table 1; README"),
         ("GPQA-Diamond (Pass@1)", "79.9", "80.7", "Table 1; README"),
         ("Humanity's Last Exam (Pass@1)", "19.8", "21.7", "Table 1; README"),
         ("AIME 2025 (Pass@1)", "89.3", "88.4", "Table 1; README"),
         ("Codeforces-Div1 (rating)", "2121", "2046", "Table 1; README"),
         ("BrowseComp (Acc.)", "40.1", "38.5", "Table 1; README"),
         ("SWE Verified (agent mode)", "67.8", "68.4", "Table 1; README"),
     ],
     "speed": [
         "core attention from O(L²) to O(Lk) with k = 2048; the indexer stays O(L²) but is much "
         "cheaper than MLA (§3)",
         "cost per million tokens against token position, estimated from the service on H800 GPUs "
         "at 2 USD per GPU hour: V3.2-Exp's is far below V3.1-Terminus's at long positions and the "
         "gap widens up to 128K, for prefilling and decoding; near position 0 the two are close "
         "(§3, Figure 3; short prefills run a masked MHA mode)",
     ],
     "note": "Table 1's caption puts V3.2-Exp's lower GPQA, HLE and HMMT 2025 scores down to it "
             "generating fewer reasoning tokens, a gap that closes at intermediate checkpoints "
             "producing as many",
     "unchecked": "the cost curves (Figure 3, the README's cost.jpg) are a figure only, so no "
                  "dollar amount is typed"},
]


# ----------------------------------------------------------------------------- running

def kernel_default():
    """fused once kernels.py is committed (its parity tests with it), else the reference."""
    out = subprocess.run(["git", "ls-files", "kernels.py"], cwd=ROOT, capture_output=True, text=True)
    return "fused" if out.stdout.strip() else "ref"


def unavailable(attn, flags):
    """None if this checkout can build the configuration, else why not (a flag or variant
    another branch adds that is not here yet)."""
    import dataclasses

    from attention import VARIANTS
    from model import PRESETS, Model, ModelConfig
    from config import TrainConfig

    if attn not in VARIANTS:
        return f"--attn={attn} is not in this checkout's attention.py"
    train_keys = {f.name for f in dataclasses.fields(TrainConfig)}  # e.g. indexer_warmup
    try:
        TrainConfig(**{k: v for k, v in flags.items() if k in train_keys})
        Model(ModelConfig(**{**PRESETS["tiny"], "vocab_size": 64, "attn": attn,
                             **{k: v for k, v in flags.items() if k not in train_keys}}))
    except (TypeError, ValueError, AssertionError) as e:
        return f"{' '.join(f'--{k}={v}' for k, v in flags.items())} is not accepted here ({type(e).__name__})"
    return None


def rel(path):
    """Paths inside the repository as relative ones, so committed commands run anywhere."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def text_command(attn, flags, seed, out_dir, data_dir, kernel, **overrides):
    args = {**TEXT, **overrides, "attn": attn, **flags, "seed": seed, "kernel": kernel,
            "data_dir": rel(data_dir), "out_dir": rel(out_dir)}
    return [sys.executable, "experiments/paired.py"] + [f"--{k}={v}" for k, v in args.items()]


def train(cmd, out_dir):
    """Run the command unless out_dir holds a finished run; resume from a checkpoint."""
    if recall.run_finished(out_dir):
        return False
    os.makedirs(out_dir, exist_ok=True)
    Path(out_dir, "command.txt").write_text(" ".join(["python"] + cmd[1:]) + "\n")
    resume = ["--resume=True"] if Path(out_dir, "ckpt.pt").exists() else []
    with open(Path(out_dir, "stdout.txt"), "a") as f:
        subprocess.run(cmd + resume, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    return True


def jobs(args):
    """[(part, label, run dir, config name, attn, flags, callable)] in the order they run: the
    positive controls first (recall full/local, then the window runs, `full` first), each
    configuration's seeds together, so a cut-short sweep has complete paired rows."""
    out, kernel = Path(args.out_dir), args.kernel
    found = []
    for name, attn, flags in sorted(RECALL_CONFIGS, key=lambda c: c[0] not in ("full", "local")):
        o = out / "recall" / f"{name}_s0"
        found.append(("recall", f"recall {name}", o, name, attn, flags, lambda a=attn, f=flags, o=o, n=name: recall.run(
            a, 0, o, args.recall_data_dir, flags=f, name=n, kernel=kernel)))
    for name, w in [("full", None)] + [(window_run_name(w), w) for w in WINDOWS]:
        for seed in SEEDS:
            o = out / "text" / f"{name}_s{seed}"
            attn, flags = ("full", {}) if w is None else ("local", {} if w == TEXT["window"] else {"window": w})
            cmd = text_command(attn, flags, seed, o, args.data_dir, kernel)
            found.append(("window", f"window {name} seed {seed}", o, name, attn, flags, lambda c=cmd, o=o: train(c, o)))
    for name, attn, flags in TEXT_CONFIGS:
        if name in ("full", "local"):
            continue  # run above with the window control
        for seed in SEEDS:
            o = out / "text" / f"{name}_s{seed}"
            found.append(("text", f"text {name} seed {seed}", o, name, attn, flags,
                          lambda c=text_command(attn, flags, seed, o, args.data_dir, kernel), o=o: train(c, o)))
    for name, attn, flags in (("full", "full", {}), (window_run_name(LONG_WINDOW), "local", {"window": LONG_WINDOW})):
        o = out / "long" / f"{name}_s0"
        cmd = text_command(attn, flags, 0, o, args.data_dir, kernel, max_steps=LONG_STEPS, eval_every=1000,
                           ckpt_every=1000, val_tokens=LONG_VAL_TOKENS)
        found.append(("long", f"long {name} seed 0", o, name, attn, flags, lambda c=cmd, o=o: train(c, o)))
    for name, attn, flags in TEXT_CONFIGS:
        o = out / "cost" / name
        cmd = cost_command(attn, flags, o, args.data_dir, kernel)
        found.append(("cost", f"cost {name}", o, name, attn, flags, lambda c=cmd, o=o: train(c, o)))
    return found


def cost_command(attn, flags, out_dir, data_dir, kernel):
    """A cost run: COST_STEPS steps at seed 0. The indexer's steps are timed sparse: its dense
    warm-up is a short start of a real run (and longer than COST_STEPS); a configuration's own
    indexer_warmup still wins."""
    warm = {"indexer_warmup": 0} if attn == "indexer" else {}
    return text_command(attn, flags, 0, out_dir, data_dir, kernel, max_steps=COST_STEPS,
                        eval_every=COST_STEPS, ckpt_every=COST_STEPS, **warm)


def window_run_name(w):
    """The window control's run for W: `local` itself at the study's W, else local_wW."""
    return "local" if w == TEXT["window"] else f"local_w{w}"


def done(part, run_dir):
    if part == "recall":
        return Path(run_dir, "recall.json").exists()
    return recall.run_finished(run_dir)


def sweep(args):
    t0 = time.time()
    names = set(args.configs.split(",")) if args.configs else None
    todo = [j for j in jobs(args) if args.only in (None, j[0]) and (names is None or j[3] in names)]
    for i, (part, label, run_dir, name, attn, flags, job) in enumerate(todo):
        why = unavailable(attn, flags)
        if why:
            print(f"[{i + 1}/{len(todo)}] {label}: pending ({why})", flush=True)
            continue
        if part != "recall":
            if args.text_source:
                text_data.make(args.text_source, args.text_val_source, args.data_dir)
            if not Path(args.data_dir, text_data.MARKER).exists():
                sys.exit(f"no byte shards in {args.data_dir}: pass --text_source=TRAIN.jsonl "
                         f"--text_val_source=VAL.jsonl (data.py's --source forms) to make them")
        baselines = Path(args.out_dir, "text", "baselines.json")
        if part != "recall" and not baselines.exists():
            baselines.parent.mkdir(parents=True, exist_ok=True)
            baselines.write_text(json.dumps(ngram_baselines(args.data_dir, TEXT["val_tokens"])) + "\n")
        t = time.time()
        ran = job()
        print(f"[{i + 1}/{len(todo)}] {label}: {'%.0f s' % (time.time() - t) if ran is not False else 'done before'}"
              f" | sweep {(time.time() - t0) / 60:.1f} min", flush=True)
        write_results(Path(args.out_dir), args.results_md, figures=False)
    write_results(Path(args.out_dir), args.results_md, figures=True)
    print(f"sweep finished in {(time.time() - t0) / 60:.1f} min; wrote {args.results_md}")


def plan(args):
    """Print every run, whether it is done, and the estimated time of those left."""
    total = 0.0
    for part, label, run_dir, name, attn, flags, _ in jobs(args):
        why = unavailable(attn, flags)
        steps = {"recall": recall.TRAIN["max_steps"], "cost": COST_STEPS, "long": LONG_STEPS}.get(part, TEXT["max_steps"])
        table = STEP_SECONDS["recall" if part == "recall" else "text"]
        sec = table.get(attn, table["full"])
        est = None if sec is None else sec * steps
        state = "done" if done(part, run_dir) else (f"pending: {why}" if why else "to run")
        if state == "to run" and est:
            total += est
        print(f"{label:32s} {state:12s} {'' if est is None else f'~{est / 60:.1f} min'}")
    print(f"estimated time left: {total / 3600:.2f} h at STEP_SECONDS (one thread, a nearly quiet "
          f"machine; evaluations add ~5%)")


# ----------------------------------------------------------------------------- reading logs

def read_log(run_dir):
    """log.jsonl -> {'evals': [(step, val)], 'final_val', 'tok_s': median per-step tok/s
    (step 1 left out: warm-up), 'mem_gb': max}; later records of a step (a resumed run)
    replace earlier ones."""
    by_step = {}
    for line in Path(run_dir, "log.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(r.get("step"), int) and "event" not in r:
            by_step[r["step"]] = {**by_step.get(r["step"], {}), **r}
    steps = [by_step[s] for s in sorted(by_step)]
    evals = [(r["step"], r["val"]) for r in steps if isinstance(r.get("val"), (int, float))]
    speeds = [r["tok_s"] for r in steps if "tok_s" in r and r["step"] > 1] or \
        [r["tok_s"] for r in steps if "tok_s" in r]
    mems = [r["mem_gb"] for r in steps if "mem_gb" in r]
    return {"evals": evals, "final_val": evals[-1][1] if evals else None,
            "tok_s": statistics.median(speeds) if speeds else None, "mem_gb": max(mems) if mems else None}


def text_runs(out, name):
    """{seed: read_log} of the finished text runs of one configuration, with 'eval': the run's
    final evaluation (eval.json: loss by position, bits per byte) or None."""
    runs = {}
    for seed in SEEDS:
        run = Path(out, "text", f"{name}_s{seed}")
        if recall.run_finished(run):
            runs[seed] = read_log(run)
            ev = Path(run, "eval.json")
            runs[seed]["eval"] = json.loads(ev.read_text()) if ev.exists() else None
    return runs


def command_of(out, name):
    for seed in SEEDS:
        cmd = Path(out, "text", f"{name}_s{seed}", "command.txt")
        if cmd.exists():
            return cmd.read_text().strip().replace(f"--seed={seed}", "--seed=SEED") \
                .replace(f"{name}_s{seed}", f"{name}_sSEED")
    return None


# Two-sided 95% quantiles of Student's t with n - 1 degrees of freedom (n = 2 .. 10 seeds).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def paired(deltas):
    """(mean, sample std, 95% half-width) of per-seed differences; None where undefined."""
    if not deltas:
        return None, None, None
    mean = statistics.fmean(deltas)
    if len(deltas) < 2:
        return mean, None, None
    sd = statistics.stdev(deltas)
    return mean, sd, T95[len(deltas) - 1] * sd / math.sqrt(len(deltas))


def verdict(mean, half_width, paper_delta):
    """Our paired difference against the paper's difference from its baseline: 'same sign'
    when the 95% interval excludes 0 on the paper's side, 'opposite sign' when it excludes 0
    on the other side, 'not resolved' when it contains 0."""
    if mean is None:
        return "pending"
    if half_width is None:
        return "1 seed: no interval"
    if abs(mean) <= half_width:
        return "not resolved"
    return "same sign" if (mean > 0) == (paper_delta > 0) else "opposite sign"


def cost_of(out, name):
    """read_log of the configuration's cost run (see COST_STEPS), None before it has run."""
    run = Path(out, "cost", name)
    return read_log(run) if recall.run_finished(run) else None


def config_stats(out, name, full_runs):
    """Per-configuration numbers: seeds, losses, paired deltas from `full`; speed and memory
    from the cost runs (measured side by side), None where either run is missing."""
    runs = text_runs(out, name)
    if not runs:
        return None
    seeds = sorted(runs)
    deltas = [runs[s]["final_val"] - full_runs[s]["final_val"] for s in seeds if s in full_runs]
    mean, sd, hw = paired(deltas) if name != "full" else (None, None, None)
    cost, full_cost = cost_of(out, name), cost_of(out, "full")
    tok, mem = (cost["tok_s"], cost["mem_gb"]) if cost else (None, None)
    full_tok, full_mem = (full_cost["tok_s"], full_cost["mem_gb"]) if full_cost else (None, None)
    return {"seeds": seeds, "vals": [runs[s]["final_val"] for s in seeds],
            "val": statistics.fmean([runs[s]["final_val"] for s in seeds]),
            "deltas": deltas, "delta": mean, "sd": sd, "hw": hw, "tok_s": tok, "mem_gb": mem,
            "tok_rel": tok / full_tok if tok and full_tok else None,
            "mem_rel": mem / full_mem if mem and full_mem else None,
            "runs": runs, "command": command_of(out, name)}


def position_ranges(T):
    """[(label, length factor, first, last)]: the ranges of positions (1-based, both included,
    unions of evaluate.position_buckets) that the loss-by-position table reports. At the trained
    length T: the first 15 positions, 16-127 and 128-T; beyond it, the last bucket of the 2T
    and 4T sequences (T..2T and 2T..4T: positions the model never saw in training)."""
    return [("1–15", 1, 1, 15), ("16–127", 1, 16, 127), (f"128–{T}", 1, 128, T),
            (f"{T}–{2 * T} at 2x", 2, T, 2 * T), (f"{2 * T}–{4 * T} at 4x", 4, 2 * T, 4 * T)]


def range_loss(record, factor, first, last):
    """Mean loss over positions first..last of an eval.json record's sequences at factor x
    the trained length: its buckets inside the range, weighted by their widths (each bucket
    mean is over the same sequences, so this is the mean over the range). None when that
    length was not evaluated or its buckets do not tile the range exactly."""
    for r in (record or {}).get("positions") or []:
        if r.get("factor") != factor or "buckets" not in r:
            continue
        inside = [b for b in r["buckets"] if b["first"] >= first and b["last"] <= last]
        width = sum(b["last"] - b["first"] + 1 for b in inside)
        if width != last - first + 1:
            return None
        return sum(b["mean"] * (b["last"] - b["first"] + 1) for b in inside) / width
    return None


def position_stats(stats):
    """{config: {'seeds', 'bpb', 'cells': [(mean, sd, hw) per column]}} from the final
    evaluations of the paired text runs: bits per byte at T and its paired Δ from `full`, then
    the paired Δ of the loss over each of position_ranges (seeds with both evals only; the
    same val sequences for every run, so the seeds carry the training noise). `full`'s cells
    are its own means."""
    full = stats.get("full")
    if not full:
        return {}
    T = TEXT["seq_len"]
    ranges = position_ranges(T)

    def columns(ev):
        return [ev.get("bits_per_byte")] + [range_loss(ev, f, a, b) for _, f, a, b in ranges]

    full_evals = {seed: r["eval"] for seed, r in full["runs"].items() if r.get("eval")}
    full_cols = {seed: columns(ev) for seed, ev in full_evals.items()}

    def same_sequences(ev, seed):  # an evaluation of other val sequences is not paired
        return [r.get("n_seq") for r in ev.get("positions") or []] == \
            [r.get("n_seq") for r in full_evals[seed].get("positions") or []]
    found = {}
    for name, s in stats.items():
        if not s:
            continue
        mine = {seed: columns(r["eval"]) for seed, r in s["runs"].items()
                if r.get("eval") and seed in full_evals and same_sequences(r["eval"], seed)}
        seeds = sorted(mine)
        if not seeds:
            continue
        cells = []
        for i in range(len(ranges) + 1):
            if name == "full":
                vals = [mine[seed][i] for seed in seeds if mine[seed][i] is not None]
                cells.append((statistics.fmean(vals), None, None) if vals else (None, None, None))
            else:
                d = [mine[seed][i] - full_cols[seed][i] for seed in seeds
                     if mine[seed][i] is not None and full_cols[seed][i] is not None]
                cells.append(paired(d))
        bpb = [mine[seed][0] for seed in seeds if mine[seed][0] is not None]
        found[name] = {"seeds": seeds, "bpb": statistics.fmean(bpb) if bpb else None, "cells": cells,
                       "n_seq": s["runs"][seeds[0]]["eval"]["positions"][0].get("n_seq")}
    return found


def _cell(c, absolute=False):
    mean, _, hw = c
    if mean is None:
        return "–"
    if absolute:
        return f"{mean:.4f}"
    if hw is None:
        return f"{mean:+.4f} (1 seed)"
    text = f"{mean:+.4f} ± {hw:.4f}"
    return f"**{text}**" if abs(mean) > hw else text


def position_section(stats, link):
    """RESULTS.md's loss by position and bits per byte."""
    T = TEXT["seq_len"]
    ranges = position_ranges(T)
    pos = position_stats(stats)
    L = ["## Loss by position and bits per byte: does any variant use distant context differently?", ""]
    if not pos:
        return L + [f"*{PENDING}* (the text runs' final evaluations, eval.json)", ""]
    n_seq = max(p["n_seq"] or 0 for p in pos.values())
    L += [f"Every text run above ends with evaluate.py's evaluation of its final weights (train.py "
          f"`--eval_seqs={TEXT['eval_seqs']}`; again on a run's checkpoint: `python evaluate.py "
          f"--ckpt=experiments/results/text/NAME_sSEED --n_seq={TEXT['eval_seqs']}`): the loss at each "
          f"position of {n_seq} validation sequences of T = {T} bytes, and of {2 * T} and {4 * T} "
          f"bytes (RoPE at positions the model was never trained on; a window or a sparse selection "
          f"sees no more keys there, `full` sees all of them). Bits per byte: the summed loss over the "
          f"text's UTF-8 bytes (the NUL before each document left out) / ln 2, at T. Columns: bits per "
          f"byte, then the mean loss (nats per byte) over each range of positions; `full`'s row holds "
          f"its own values, every other row the paired difference from `full` at the same seed, mean ± "
          f"95% half-width over seeds (t with n - 1 degrees of freedom), **bold** where the interval "
          f"excludes 0. The ranges beyond T are the last bucket of the longer sequences: T..2T of the "
          f"{2 * T}-byte ones, 2T..4T of the {4 * T}-byte ones.", "",
          "| config | seeds | bits/byte (Δ) | " + " | ".join(lab for lab, *_ in ranges) + " |",
          "|---|---|---|" + "---|" * len(ranges)]
    resolved = []
    for name, *_ in TEXT_CONFIGS:
        p = pos.get(name)
        if p is None:
            L.append(f"| {name} | – | – |" + " – |" * len(ranges))
            continue
        full_row = name == "full"
        bpb = f"{p['bpb']:.4f}" + ("" if full_row else f" ({_cell(p['cells'][0])})") if p["bpb"] is not None else "–"
        L.append(f"| {name} | {len(p['seeds'])} | {bpb} | " +
                 " | ".join(_cell(c, full_row) for c in p["cells"][1:]) + " |")
        if not full_row:
            for (lab, *_), (mean, _, hw) in zip([("bits per byte",)] + ranges, p["cells"]):
                if mean is not None and hw is not None and abs(mean) > hw:
                    resolved.append(f"{name} {'above' if mean > 0 else 'below'} `full` at {lab} ({mean:+.4f} ± {hw:.4f})")
    missing = [name for name, *_ in TEXT_CONFIGS if name not in pos]
    L += ["", "Resolved (95% interval excludes 0): " + ("; ".join(resolved) + "." if resolved else
          "none. No configuration's loss differs measurably from `full`'s over any range of positions, "
          "near, far or beyond the trained length, nor in bits per byte.") +
          (f" Not evaluated yet: {', '.join(missing)}." if missing else ""),
          "", f"![loss by position at {4 * T} bytes, and each variant's paired difference from full]"
              f"({link(ROOT / 'assets' / 'study_positions.png')})", ""]
    return L


def recall_results(out):
    """{config name: recall.json} of the scored recall runs (seed 0)."""
    found = {}
    for name, *_ in RECALL_CONFIGS:
        path = Path(out, "recall", f"{name}_s0", "recall.json")
        if path.exists():
            found[name] = json.loads(path.read_text())
    return found


# ----------------------------------------------------------------------------- RESULTS.md

PENDING = "pending: run `python experiments/sweep.py`"


def _f(x, spec, none="–"):
    return none if x is None else format(x, spec)


def _cost(rel, value, spec, unit):
    """'1.23x (value unit)', or – before the cost run."""
    return "–" if rel is None else f"{rel:.2f}x ({value:{spec}}{unit})"


def _delta(s):
    if s is None or s["delta"] is None:
        return "–"
    if s["hw"] is None:
        return f"{s['delta']:+.4f} (1 seed)"
    return f"{s['delta']:+.4f} ± {s['hw']:.4f}"


def write_results(out, md_path, figures=False):
    """RESULTS.md from the logs under out (and, with figures=True, assets/study_*.png)."""
    text, stats, windows, rec = results_markdown(out, Path(md_path).resolve().parent)
    Path(md_path).write_text(text)
    if figures:
        import figures as figs
        figs.all_figures(Path(out), ROOT / "assets", stats, windows, rec, TEXT_CONFIGS, TEXT["seq_len"])
    return stats, windows, rec


def results_markdown(out, md_dir):
    """(RESULTS.md's text from the logs under out, with links relative to md_dir, the folder it
    goes in; the text, window and recall statistics it quotes)."""
    out, md_dir = Path(out), Path(md_dir)
    full_runs = text_runs(out, "full")
    stats = {name: config_stats(out, name, full_runs) for name, *_ in TEXT_CONFIGS}
    windows = {w: config_stats(out, window_run_name(w), full_runs) for w in WINDOWS}
    rec = recall_results(out)
    link = lambda p: os.path.relpath(p, md_dir)  # noqa: E731
    L = ["# Results: the papers' configurations at a scale that can tell them apart", "",
         "Generated by `python experiments/sweep.py` (rewrite alone: `python experiments/sweep.py "
         f"--results_only`) from the run logs under `{os.path.relpath(out, ROOT)}/`; no number below "
         f"is typed by hand except the papers' own. A row marked *pending* has no finished log yet; "
         f"`python experiments/sweep.py` runs it (it skips every finished run and resumes a cut one). "
         f"The first text run needs the byte shards: add `--text_source=TRAIN.jsonl "
         f"--text_val_source=VAL.jsonl` (the corpus slice's train and validation files).", ""]
    L += setup_section(out)
    L += recall_section(rec, out, link)
    L += recall_grid.section(out / "recall_grid", link)
    L += window_section(windows, stats.get("full"), link)
    L += text_section(stats, link, cost_commit(out))
    L += position_section(stats, link)
    L += paper_section(stats)
    L += gpu_speed_section(link, md_dir / "benchmarks" / "gpu_runs")  # the checkout RESULTS.md is in
    L += later_baselines_section(stats, rec)
    L += scale_section(windows, rec, out, stats)
    L += pretrained.section(out / "pretrained", link)
    return "\n".join(L) + "\n", stats, windows, rec


def setup_section(out):
    t, r = TEXT, recall.TRAIN
    share = windowed_share(t["seq_len"], t["dsa_threshold"])
    path = Path(out, "text", "baselines.json")
    base = json.loads(path.read_text()) if path.exists() else None
    base_text = (f" On these validation bytes the train split's unigram statistics score "
                 f"{base['unigram']:.4f} and its bigram statistics {base['bigram']:.4f} nats per byte "
                 f"(a run below the bigram number uses more than the previous byte)." if base else "")
    return [
        "## Setup", "",
        f"- **Corpus**: a legal/news-skewed subset of FineWeb (FineWeb sample-10BT documents that "
        f"passed a legal-keyword filter, then scored for legal value; general web text with a "
        f"legal/news/government skew, not a uniform FineWeb sample), read as UTF-8 bytes "
        f"(vocabulary 256; `experiments/text_data.py`).",
        f"- **Text runs**: {t['n_layer']} layers, d_model {t['d_model']}, {t['n_head']} heads of "
        f"{t['head_dim']}, sequences of {t['seq_len']} bytes, {t['max_steps']} steps of "
        f"{t['total_batch_tokens']} bytes ({t['max_steps'] * t['total_batch_tokens']:,} bytes), lr "
        f"{t['lr']}, validation on the first {t['val_tokens']:,} val bytes. Window W = {t['window']} "
        f"for every windowed variant; dsa's adaptive threshold {t['dsa_threshold']} (2W, as 512 = 2 x 256 "
        f"in 002), so `dsa_window=adaptive` windows {share:.0%} of the positions; caa's width "
        f"{t['window']}..{t['caa_window_max']}.{base_text}",
        f"- **Paired seeds**: seeds {', '.join(map(str, SEEDS))}. At one seed every run reads the "
        f"same batches (data.py's loader permutes with its own generator seeded by the seed) and "
        f"starts from the same values of every parameter it shares with `full` "
        f"(`experiments/paired.py`: train.py alone would shift them, because a variant's extra "
        f"gate parameters are drawn in the middle of the init stream). A difference is reported "
        f"per seed against `full` at that seed, then as mean ± the 95% half-width "
        f"(t quantile x sample std / sqrt(n)).",
        f"- **Recall runs**: MQAR (`experiments/recall.py`), form `{recall.TASK['form']}`, "
        f"{recall.TASK['seq_len']} tokens, {recall.TASK['n_keys']} keys, {recall.TASK['n_values']} "
        f"values; {r['n_layer']} layers, d_model {r['d_model']}, {r['n_head']} heads of {r['head_dim']}, "
        f"{r['max_steps']} steps of {r['total_batch_tokens']} tokens, lr {r['lr']}; W = {r['window']}, "
        f"dsa threshold {r['dsa_threshold']} (windows {windowed_share(r['seq_len'], r['dsa_threshold']):.0%} "
        f"of the positions), caa width {r['window']}..{r['caa_window_max']}. Scored on "
        f"{recall.EVAL_SEQS} held-out sequences.", ""]


def recall_section(rec, out, link):
    L = ["## Recall by distance", ""]
    labels = [b[0] for b in recall.bucket_edges(recall.TRAIN["window"], recall.TRAIN["n_layer"])]
    W, Ln = recall.TRAIN["window"], recall.TRAIN["n_layer"]
    L += [f"Accuracy of the argmax at every recurring key (seed 0). lag = positions between the "
          f"query and the nearest earlier token holding its answer; a windowed layer sees lag <= W "
          f"= {W}, {Ln} stacked layers could relay at most {Ln * W}. Chance: 1/{recall.TASK['n_values']} "
          f"= {1 / recall.TASK['n_values']:.4f}. `full` must score >= 0.9 for the probe to mean "
          f"anything; `local` should be at chance beyond lag {Ln * W}.", "",
          "| config | overall | " + " | ".join(labels) + " | steps |",
          "|---|---|" + "---|" * len(labels) + "---|"]
    for name, attn, flags in RECALL_CONFIGS:
        r = rec.get(name)
        if r is None:
            why = unavailable(attn, flags)
            L.append(f"| {name} | {'pending: ' + why if why else PENDING} |" + " |" * len(labels) + " |")
            continue
        cells = [f"{_f(r['buckets'][k]['acc'], '.3f')} (n={r['buckets'][k]['n']})" for k in labels]
        L.append(f"| {name} | {r['overall']:.3f} | " + " | ".join(cells) + f" | {r['step']} |")
    if rec:
        L += ["", f"![recall accuracy by lag]({link(ROOT / 'assets' / 'study_recall.png')})", "",
              "Commands (the shards in experiments/data/recall are made by `recall.make_data`, which "
              "`python experiments/recall.py` and the sweep call first):", ""] + [f"- **{n}**: `{r['command']}`" for n, r in rec.items()]
    return L + [""]


def window_section(windows, full, link):
    L = ["## Positive control on text: validation loss against the window", "",
         f"`local` with window W and `full`, same budget, paired seeds. Reach: the bytes a prediction "
         f"can draw on through {TEXT['n_layer']} layers of windows (keys i-W..i in each). Δ: `local` minus "
         f"`full` at the same seed, mean ± 95% half-width.", "",
         "| W | reach (bytes) | seeds | val loss (mean) | Δ vs full | resolved? |", "|---|---|---|---|---|---|"]
    for w, s in list(windows.items()) + [("full", full)]:
        far = f"{TEXT['seq_len']} (all)" if w == "full" else reach(w)
        if s is None:
            L.append(f"| {w} | {far} | – | {PENDING} | – | – |")
            continue
        res = "–" if w == "full" else verdict(s["delta"], s["hw"], +1).replace("same sign", "yes: worse than full") \
            .replace("opposite sign", "yes: better than full")
        L.append(f"| {w} | {far} | {len(s['seeds'])} | {s['val']:.4f} | {'baseline' if w == 'full' else _delta(s)} | {res} |")
    if any(windows.values()):
        L += ["", f"![validation loss against the window]({link(ROOT / 'assets' / 'study_window.png')})"]
    return L + [""]


def cost_commit(out):
    """The commit the cost runs ran at (`full`'s run records it), None before they have run."""
    path = Path(out, "cost", "full", "config.json")
    if not path.exists():
        return None
    return (json.loads(path.read_text()).get("git_commit") or "")[:7] or None


def text_section(stats, link, commit=None):
    since = (f" The cost runs ran at commit {commit}; kernel changes since then are timed side by side "
             f"in [benchmarks/train_step_regression.md]({link(ROOT / 'benchmarks' / 'train_step_regression.md')})."
             if commit else "")
    L = ["## Every configuration: paired difference from `full`", "",
         "Final validation loss (nats per byte); Δ per seed and mean ± 95% half-width. Cost: tok/s "
         f"(median per-step throughput, step 1 left out) and peak memory (train.py's mem_gb: CPU "
         f"peak RSS of the whole process) relative to `full`, from a {COST_STEPS}-step run of each "
         f"configuration at seed 0, all run back to back on one thread by `python "
         f"experiments/sweep.py --only=cost` (a cost still to run shows –). This is the cost of the "
         f"CPU kernels (kernels.BLOCKWISE) at T = {TEXT['seq_len']}, not GPU speed: "
         f"`benchmarks/attention.py` is that.{since}", "",
         "| config | flags | seeds | val loss | Δ per seed | Δ vs full | tok/s vs full | peak mem vs full |",
         "|---|---|---|---|---|---|---|---|"]
    for name, attn, flags in TEXT_CONFIGS:
        s = stats[name]
        fl = " ".join(f"--{k}={v}" for k, v in {"attn": attn, **flags}.items())
        if s is None:
            why = unavailable(attn, flags)
            L.append(f"| {name} | `{fl}` | – | {'pending: ' + why if why else PENDING} | – | – | – | – |")
            continue
        per = ", ".join(f"{d:+.4f}" for d in s["deltas"]) if name != "full" else "–"
        L.append(f"| {name} | `{fl}` | {len(s['seeds'])} | {s['val']:.4f} | {per} | "
                 f"{'baseline' if name == 'full' else _delta(s)} | {_cost(s['tok_rel'], s['tok_s'], '.0f', '')} | "
                 f"{_cost(s['mem_rel'], s['mem_gb'], '.2f', ' GB')} |")
    commands = [(n, s["command"]) for n, s in stats.items() if s and s["command"]]
    if commands:
        L += ["", f"![validation loss, mean and range over seeds]({link(ROOT / 'assets' / 'study_loss.png')})",
              "", "Commands (SEED = each seed):", ""] + [f"- **{n}**: `{c}`" for n, c in commands]
    return L + [""]


def paper_section(stats):
    t = TEXT
    L = ["## The papers' numbers beside ours", "",
         "Every number of the papers' tables. Paper Δ: the row's loss minus its own paper's baseline "
         "(003's is 4.927, the others' 4.9266). Ours: the paired Δ from `full` above and our cost "
         "relative to `full`. Verdict: *same sign* / *opposite sign* when our 95% interval excludes "
         "0, *not resolved* when it does not (the papers' differences are a few hundredths at 134M "
         "parameters and billions of tokens; ours are at a far smaller scale, so only the sign is "
         "compared).", "",
         "| paper | paper's row | val loss | paper Δ | memory | speed / efficiency | our config | our Δ vs full "
         "| our tok/s vs full | our peak mem vs full | verdict |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    for paper, row, loss, pm, mem, speed, cfg in PAPER_ROWS:
        pdelta = float(loss) - PAPER_BASELINES[paper]
        s = stats.get(cfg) if cfg else None
        loss_text = loss + (f" ± {pm:.3f}" if pm is not None else "")
        base = cfg == "full"
        ours = "not built (see below)" if cfg is None else ("baseline" if base else (_delta(s) if s else "pending"))
        v = "–" if cfg is None or base else verdict(s["delta"] if s else None, s["hw"] if s else None, pdelta)
        L.append(f"| {paper} | {row} | {loss_text} | {'–' if base else f'{pdelta:+.4f}'} | {mem or '–'} | "
                 f"{speed or '–'} | {cfg or '–'} | {ours} | "
                 f"{_f(s and s['tok_rel'], '.2f')}{'x' if s and s['tok_rel'] else ''} | "
                 f"{_f(s and s['mem_rel'], '.2f')}{'x' if s and s['mem_rel'] else ''} | {v} |")
    notes = [n.format(share_study=f"{windowed_share(t['seq_len'], t['dsa_threshold']):.0%}",
                      seq_len=t["seq_len"], threshold=t["dsa_threshold"]) for n in PAPER_NOTES]
    L += [""] + [f"- {n}" for n in notes] + ["", "Papers: " + "; ".join(PAPERS.values()) + "."]
    return L + [""]


# This project's goals for the variants the seeds give no speed for (tokens/s relative to
# `full` on a GPU at qwen-134m, T = 1024).
GPU_SPEED_GOALS = {"moba": "0.9x", "nsa": "0.8x", "indexer": "0.8x"}


def gpu_speed_section(link, runs):
    """The seeds' tokens/s relative to their baselines beside ours on a GPU: the newest
    committed gpu_check training rows (`benchmarks/gpu_runs/*/training.json`), each relative
    to `full`'s on the same card; a configuration the run did not reach is "not yet run"."""
    found = sorted(runs.glob("*/training.json"))
    if not found:
        return []
    path = found[-1]
    run = json.loads(path.read_text())
    env, rows = run["environment"], {r["config"]: r for r in run["training"]}
    full = rows.get("full", {}).get("tok_s")
    if not full:
        return []
    seeds = {}
    for paper, _, _, _, _, speed, cfg in PAPER_ROWS:
        if cfg and cfg != "full" and speed and speed.rstrip(")").endswith("x"):
            seeds.setdefault(cfg, []).append(f"{speed} ({paper})")
    row0 = next(iter(run["training"]))
    L = ["### The seeds' speed beside a GPU's", "",
         f"The columns above are CPU costs. The seeds measured tokens/s on GPUs; ours: one "
         f"{env.get('device_name', 'GPU')}, torch {env.get('torch')}"
         f"{', CUDA ' + env['cuda'] if env.get('cuda') else ''}, commit {env.get('git_commit')}, bf16, qwen-134m, "
         f"T = {row0['T']}, batch {row0['batch']}, compiled block by block, AdamW "
         f"(`python benchmarks/gpu_check.py --profile`, [{path.parent.name}]({link(path.parent.parent / (path.parent.name + '.md'))})), "
         f"each relative to `full`'s {full / 1e3:.1f}k tokens/s on the same card. Where a seed gives no "
         f"number the goal is this project's.", "",
         "| config | seed's tokens/s vs its baseline | ours on the GPU | MFU |", "|---|---|---|---|"]
    for cfg in ("dsa", "local", "combiner", "caa", "asga", "moba", "nsa", "indexer"):
        r = rows.get(cfg)
        seed = ", ".join(seeds.get(cfg, [])) or f"– (goal {GPU_SPEED_GOALS.get(cfg, '–')})"
        if r is None:
            ours, mfu = "not yet run", ""
        elif "tok_s" in r:
            ours, mfu = f"{r['tok_s'] / full:.2f}x", f"{100 * r['mfu']:.1f}%" if r.get("mfu") else ""
        else:
            error = r.get("error", "")
            ours, mfu = ("out of memory" if error.startswith("OutOfMemoryError") else error[:60]), ""
        L.append(f"| {cfg} | {seed} | {ours} | {mfu} |")
    return L + [""]


def later_baselines_section(stats, rec):
    """The later baselines' (LATER_PAPERS) own headline results with their settings, and beside
    each our numbers for its configurations: the paired text Δ from `full`, tok/s relative to
    `full` and the recall probe's overall accuracy, "pending" until the run has finished."""
    t = TEXT
    full_rec = rec.get("full")
    L = ["## The later baselines' own results beside ours", "",
         "The headline results of the three later baselines as their sources print them (typed by "
         "hand; the place of each is beside it), with the setting each came from, then ours for "
         "the configuration that implements it. The scales differ by orders of magnitude: the papers "
         "train models of 545M to 671B parameters on 10.8B to 943.7B tokens at contexts of 8K to 1M "
         f"on GPU clusters; ours train {t['n_layer']} layers of width {t['d_model']} on "
         f"{t['max_steps'] * t['total_batch_tokens']:,} bytes at {t['seq_len']} bytes of context on one "
         "CPU thread. So only the direction is compared: does the sparse variant stay close to full "
         "attention, or not. A result that a source gives only as a figure is described in words, "
         "not read off the plot.", ""]
    for paper in LATER_PAPERS:
        L += [f"### {paper['name']}: {paper['cite']}; here `"
              + "`, `".join(paper["configs"]) + "`", "",
              f"Setting: {paper['setting']}. The paper's direction: {paper['direction']}.", "",
              f"| result | sparse | {paper['baseline']} | where |", "|---|---|---|---|"]
        L += [f"| {what} | {sparse} | {dense} | {where} |" for what, sparse, dense, where in paper["rows"]]
        L += [""] + [f"- Speed / cost: {claim}." for claim in paper["speed"]]
        L += [f"- Note: {paper['note']}."] if "note" in paper else []
        L += [f"- Not typed: {paper['unchecked']}.", "",
              "Ours (Δ: final validation loss minus `full`'s at the same seed, nats per byte, mean ± "
              "95% half-width; recall: overall accuracy on the probe, "
              + (f"`full` {full_rec['overall']:.3f}" if full_rec else "`full` pending") + "):", "",
              "| our config | text Δ vs full | told from full? | tok/s vs full | recall overall |",
              "|---|---|---|---|---|"]
        for cfg in paper["configs"]:
            s, r = stats.get(cfg), rec.get(cfg)
            told = "pending" if s is None else verdict(s["delta"], s["hw"], +1) \
                .replace("same sign", "yes: worse than full").replace("opposite sign", "yes: better than full") \
                .replace("not resolved", "no: not told apart")
            tok = "pending" if s is None or s["tok_rel"] is None else f"{s['tok_rel']:.2f}x"
            L.append(f"| {cfg} | {'pending' if s is None else _delta(s)} | {told} | {tok} | "
                     f"{'pending' if r is None else format(r['overall'], '.3f')} |")
        L.append("")
    return L


def reach(w):
    """Bytes a prediction can draw on through TEXT's layers of windows W (keys i-W..i)."""
    return TEXT["n_layer"] * w + 1


def long_pair_sentence(f, l, where, w, val_tokens):
    """What a longer `full` / `local`(w) pair at seed 0 shows: the Δ at four points and the
    step from which `full` stays ahead (if it does)."""
    at = lambda r, t: dict(r["evals"]).get(t)  # noqa: E731
    marks = [t for t, _ in f["evals"] if t > 0 and at(l, t) is not None]
    steps = marks[-1]
    shown = [t for t in marks if t in {marks[round(i * (len(marks) - 1) / 4)] for i in range(1, 5)}]
    deltas = {t: at(l, t) - at(f, t) for t in marks}
    ahead = next((t for t in marks if all(deltas[u] > 0 for u in marks if u >= t)), None)
    text = (f"A longer budget: with {steps} steps instead of {TEXT['max_steps']} ({steps * TEXT['total_batch_tokens']:,} "
            f"bytes; seed 0; validation on up to {val_tokens:,} bytes; {where}) `local` at W = {w} minus `full` was "
            + ", ".join(f"{deltas[t]:+.4f} at step {t}" for t in shown)
            + f" (final {l['final_val']:.4f} vs {f['final_val']:.4f}): ")
    if ahead is None:
        return text + (f"`full` had not yet overtaken a {w}-byte window. Telling context lengths apart on text "
                       f"needs a larger budget than this; the table of every configuration measures cost and "
                       f"gross failures.")
    return text + (f"`full` is ahead from step {ahead} on ({ahead * TEXT['total_batch_tokens']:,} bytes of "
                   f"training), so only a budget of that order lets the loss show context beyond "
                   f"{reach(w)} bytes (one seed: a sign, not an interval).")


def resolved_summary(stats, rec):
    """One generated paragraph: what each instrument of the study tells apart from `full`."""
    measured = {n: s for n, s in stats.items() if n != "full" and s and s["hw"] is not None}
    if not measured:
        return []
    final = [f"{n} ({s['delta']:+.4f} ± {s['hw']:.4f})" for n, s in measured.items() if abs(s["delta"]) > s["hw"]]
    pos = position_stats(stats)
    cells = sum(1 for n, p in pos.items() if n != "full" for m, _, hw in p["cells"] if m is not None and hw is not None)
    hits = [f"{n} at {lab}" for n, p in pos.items() if n != "full"
            for (lab, *_), (m, _, hw) in zip([("bits per byte",)] + position_ranges(TEXT["seq_len"]), p["cells"])
            if m is not None and hw is not None and abs(m) > hw]
    text = [f"What each instrument tells apart from `full` here: the final validation loss, "
            f"{len(final)} of {len(measured)} configurations" + (f" ({'; '.join(final)})" if final else "")]
    if cells:
        text.append(f"loss by position and bits per byte, {len(hits)} of {cells} paired cells"
                    + (f" ({'; '.join(hits)})" if hits else ""))
    full = rec.get("full")
    if full and full.get("n_queries"):
        def below(r):  # 95% interval of full's accuracy minus r's over their scored queries
            pf, pr = full["overall"], r["overall"]
            return pf - pr > 1.96 * math.sqrt(pf * (1 - pf) / full["n_queries"] + pr * (1 - pr) / r["n_queries"])
        others = {n: r for n, r in rec.items() if n != "full" and r.get("n_queries")}
        apart = [n for n, r in others.items() if below(r)]
        text.append(f"the recall probe, {len(apart)} of {len(others)} configurations below `full`'s "
                    f"{full['overall']:.3f} (95% interval of the difference over the scored queries: one "
                    f"training seed, so it covers the evaluation's sampling, not training's)")
    ending = (" At this budget the loss, overall or by position, separates no configuration from `full`: "
              "the recall probe (and the recall grid) is where they differ." if not final and not hits else "")
    return ["; ".join(text) + "." + ending, ""]


def scale_section(windows, rec, out, stats=None):
    """The plain sentences on what this scale resolves, from the numbers."""
    L = ["## What this scale can and cannot resolve", ""]
    L += resolved_summary(stats or {}, rec)
    measured = {w: s for w, s in windows.items() if s and s["hw"] is not None}
    worse = [w for w, s in measured.items() if s["delta"] > s["hw"]]
    better = [w for w, s in measured.items() if s["delta"] < -s["hw"]]
    same = [w for w in measured if w not in worse and w not in better]
    if not measured:
        L.append(f"The window control has not run yet ({PENDING}).")
    else:
        text = []
        if worse:
            text.append(f"`local` at W = {', '.join(map(str, worse))} is measurably worse than `full` "
                        f"(95% interval above 0)")
        if same:
            text.append(f"`local` at W = {', '.join(map(str, same))} cannot be told from `full`")
        if better:
            text.append(f"`local` at W = {', '.join(map(str, better))} is measurably *better* than `full` "
                        f"(a window is a locality prior that speeds early learning)")
        missing = [w for w in WINDOWS if w not in measured]
        deltas = [d for s in measured.values() for d in s["deltas"]]
        text.append(f"in {sum(d < 0 for d in deltas)} of {len(deltas)} paired comparisons `local` ends "
                    f"below `full`, and its mean Δ goes from {measured[min(measured)]['delta']:+.4f} at "
                    f"W = {min(measured)} to {measured[max(measured)]['delta']:+.4f} at W = {max(measured)}")
        sentence = "; ".join(text) + (f" (W = {', '.join(map(str, missing))}: not run yet)" if missing else "") + "."
        L.append(sentence[0].upper() + sentence[1:])
        L.append("")
        L.append("So at this model size and budget the loss shows "
                 + (f"the use of more than {reach(max(worse))} bytes of context" if worse
                    else f"no measurable use of context beyond {reach(min(measured))} bytes")
                 + ": any difference between variants that depends on tokens further back than that "
                   "(which is what the papers' windows of 256 tokens are about) cannot show in the loss "
                   "here, whatever it would do at the papers' scale. The recall probe is the test of what "
                   "a variant can reach; the loss table shows cost and gross failures.")
    for where, full_dir, local_dir, w, val_tokens in (
            ("`experiments/results/calibration/`, run in a temporary folder and its log copied there",
             Path(out, "calibration", "long_full_s0"), Path(out, "calibration", "long_local_w4_s0"), 4,
             TEXT["val_tokens"]),
            ("`python experiments/sweep.py --only=long`", Path(out, "long", "full_s0"),
             Path(out, "long", f"{window_run_name(LONG_WINDOW)}_s0"), LONG_WINDOW, LONG_VAL_TOKENS)):
        if recall.run_finished(full_dir) and recall.run_finished(local_dir):
            L += ["", long_pair_sentence(read_log(full_dir), read_log(local_dir), where, w, val_tokens)]
    full = rec.get("full")
    if full:
        L += ["", f"Recall: `full` scores {full['overall']:.3f} overall (the probe is "
                  f"{'valid' if full['overall'] >= 0.9 else 'NOT valid: full is below 0.9'})."]
        local = rec.get("local")
        if local:
            far = [k for k, b in local["buckets"].items() if b["lo"] >= recall.TRAIN["n_layer"] * recall.TRAIN["window"]]
            accs = ", ".join(f"{_f(local['buckets'][k]['acc'], '.3f')} ({k})" for k in far)
            L.append(f"`local` beyond its receptive field: {accs}; chance {local['chance']:.4f}.")
    return L


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text_source", default=None, help="train documents for the byte shards (data.py --source forms)")
    p.add_argument("--text_val_source", default=None)
    p.add_argument("--data_dir", default=str(ROOT / "experiments" / "data" / "text"))
    p.add_argument("--recall_data_dir", default=str(ROOT / "experiments" / "data" / "recall"))
    p.add_argument("--out_dir", default=str(ROOT / "experiments" / "results"))
    p.add_argument("--results_md", default=str(ROOT / "RESULTS.md"))
    p.add_argument("--kernel", default=None, help="ref | fused (default: fused if kernels.py is committed)")
    p.add_argument("--only", choices=("recall", "window", "text", "long", "cost"), default=None,
                   help="one part; run `cost` alone on an otherwise quiet machine")
    p.add_argument("--configs", default=None, help="only these configuration names (comma-separated; "
                   "window runs are named local_wW)")
    p.add_argument("--plan", action="store_true", help="list the runs and the estimated time left")
    p.add_argument("--results_only", action="store_true", help="only rewrite RESULTS.md and the figures")
    args = p.parse_args(argv)
    args.kernel = args.kernel or kernel_default()
    if args.results_only:
        write_results(Path(args.out_dir), args.results_md, figures=True)
        print(f"wrote {args.results_md}")
        return 0
    if args.plan:
        plan(args)
        return 0
    sweep(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
