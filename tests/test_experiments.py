"""The study's own logic (experiments/): the recall task and its distance buckets, paired
initialisation, byte shards, the paired statistics, and RESULTS.md reading its numbers from
the logs (fabricated small logs; nothing is trained here except where stated)."""
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))

import paired  # noqa: E402
import recall  # noqa: E402
import sweep  # noqa: E402
import text_data  # noqa: E402
import data  # noqa: E402
from data import load_shard, recall_sequences  # noqa: E402
from model import PRESETS, Model, ModelConfig  # noqa: E402


@pytest.mark.parametrize("form", ["onehop", "zoology"])
def test_mqar_answers_are_the_earlier_token_at_the_stated_lag(form):
    n_keys, n_values, T = 8, 16, 64
    tokens, q = recall.mqar_sequences(20, T, n_keys, n_values, seed=3, form=form)
    assert len(q["pos"]) > 100
    for s, p, a, lag in zip(q["seq"], q["pos"], q["answer"], q["lag"]):
        key = tokens[s, p]
        assert key < n_keys and tokens[s, p + 1] == a  # the answer is the next token
        assert tokens[s, p - lag] == a  # ... and sits lag positions back
        earlier = tokens[s, 0:p:2]  # no nearer occurrence of the key
        assert key not in earlier[(p - lag - 1) // 2 + 1:]
        if form == "onehop":  # the value token says which key it belongs to
            assert (a - n_keys) // n_values == key
        else:
            assert n_keys <= a < n_keys + n_values


def test_onehop_values_given_the_key_are_uniform_over_n_values():
    tokens, q = recall.mqar_sequences(400, 64, 4, 8, seed=1)
    values = (q["answer"] - 4) % 8
    counts = np.bincount(values, minlength=8)
    assert counts.min() > 0.8 * counts.mean()  # chance is 1 / n_values, not less


def test_recall_shards_are_the_task_sequences(tmp_path, monkeypatch):
    monkeypatch.setattr(recall, "TASK", dict(form="onehop", seq_len=32, n_keys=4, n_values=4, seed=5))
    monkeypatch.setattr(recall, "DATA_TOKENS", 32 * 40)
    monkeypatch.setattr(recall, "VAL_TOKENS", 32 * 8)
    recall.make_data(tmp_path)
    train = np.asarray(load_shard(tmp_path / "recall_train_000001.bin"))
    val = np.asarray(load_shard(tmp_path / "recall_val_000000.bin"))
    assert np.array_equal(train, recall.mqar_sequences(32, 32, 4, 4, 5)[0].reshape(-1))
    assert np.array_equal(val, recall.mqar_sequences(8, 32, 4, 4, 6)[0].reshape(-1))
    # the folder says its ids are no text (a folder without the record is read as GPT-2's, and
    # a run's final evaluation then tried to fetch GPT-2's BPE for bits per byte), also for a
    # folder made before the record existed
    assert data.tokenizer_of(tmp_path) == ("mqar", 4 * (1 + 4))  # n_keys (1 + n_values) ids
    (tmp_path / data.TOKENIZER_FILE).unlink()
    recall.make_data(tmp_path)
    assert data.tokenizer_of(tmp_path)[0] == "mqar"


def test_accuracy_buckets():
    correct = np.array([1, 0, 1, 1, 0, 0, 1], dtype=bool)
    lag = np.array([1, 8, 9, 16, 17, 32, 33])
    b = recall.accuracy_by_bucket(correct, lag, window=8, n_layer=2)
    assert [(v["n"], v["acc"]) for v in b.values()] == [(2, 0.5), (2, 1.0), (2, 0.0), (1, 1.0)]
    rows = recall.accuracy_by_lag(correct, lag, width=8)
    assert sum(n for _, _, n, _ in rows) == len(lag)


@pytest.mark.parametrize("attn", ["dsa", "asga", "caa"])
def test_paired_init_gives_every_variant_fulls_shared_parameters(attn):
    """With it, the shared weights equal `full`'s at the same seed (plain train.py shifts them
    today: see paired.py's docstring), and the variant's own gates keep their documented init."""
    cfg = ModelConfig(**PRESETS["tiny"], vocab_size=64)
    torch.manual_seed(7)
    full = dict(Model(cfg).named_parameters())
    torch.manual_seed(7)
    model = paired.paired_model_class(7)(ModelConfig(**PRESETS["tiny"], vocab_size=64, attn=attn))
    mine = dict(model.named_parameters())
    shared = [n for n in full if n in mine]
    assert len(shared) == len(full)
    assert all(torch.equal(mine[n], full[n]) for n in shared)
    own = [n for n in mine if n not in full]
    assert own
    torch.manual_seed(7)
    reference = Model(ModelConfig(**PRESETS["tiny"], vocab_size=64, attn=attn))
    reference_own = dict(reference.named_parameters())
    for n in own:  # the variant's own init: same recipe (zeros / constants are exactly equal)
        if (reference_own[n] == reference_own[n].flatten()[0]).all():
            assert torch.equal(mine[n], reference_own[n])


def test_byte_shards(tmp_path):
    docs = [{"text": "héllo world"}, {"text": "abc"}]
    src = tmp_path / "t.jsonl"
    src.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    counts = text_data.write_byte_shards(str(src), str(src), tmp_path / "out", val_tokens=5, max_tokens=100)
    val = np.asarray(load_shard(tmp_path / "out" / "text_val_000000.bin"))
    train = np.asarray(load_shard(tmp_path / "out" / "text_train_000001.bin"))
    assert bytes(val.astype(np.uint8)) == b"\0h\xc3\xa9l"  # whole documents until the limit, cut there
    assert bytes(train.astype(np.uint8)) == b"\0h\xc3\xa9llo world\0abc"
    assert counts == {"val": 5, "train": len(train)}


def test_byte_shards_record_their_tokenizer(tmp_path):
    """The study's byte folder says it holds bytes (else data.tokenizer_of reads it as GPT-2
    and evaluate.py loses bits per byte), also when it was made before the record existed."""
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps({"text": "a few bytes of text"}) + "\n")
    out = tmp_path / "out"
    text_data.make(str(src), str(src), str(out), val_tokens=8, max_tokens=40)
    assert data.tokenizer_of(str(out)) == ("byte", 256)
    (out / data.TOKENIZER_FILE).unlink()  # a folder from before: shards and marker only
    text_data.make(str(src), str(src), str(out), val_tokens=8, max_tokens=40)
    assert data.tokenizer_of(str(out)) == ("byte", 256)


def test_paired_runs_train_py(tmp_path, capsys):
    """paired.py drives train.py's own parse_args and main: a dry run of it plans the run,
    through the paired Model (the plan counts its parameters)."""
    assert paired.main(["--dry_run=True", "--attn=asga", "--model=tiny", f"--data_dir={tmp_path}",
                        f"--out_dir={tmp_path / 'run'}"]) is None
    assert "model       tiny" in capsys.readouterr().out


def test_paired_statistics_and_verdict():
    mean, sd, hw = sweep.paired([0.10, 0.12, 0.14])
    assert mean == pytest.approx(0.12) and sd == pytest.approx(0.02)
    assert hw == pytest.approx(4.303 * 0.02 / 3 ** 0.5)
    assert sweep.verdict(mean, hw, +0.2) == "same sign"
    assert sweep.verdict(mean, hw, -0.2) == "opposite sign"
    assert sweep.verdict(0.01, 0.05, -0.2) == "not resolved"
    assert sweep.verdict(0.01, None, -0.2) == "1 seed: no interval"
    assert sweep.windowed_share(512, 128) == 0.75 and sweep.windowed_share(1024, 512) == 0.5


def _fake_run(root, name, seed, vals, tok_s, mem, finished=True, part="text"):
    run = root / part / (f"{name}_s{seed}" if part == "text" else name)
    run.mkdir(parents=True)
    steps = [{"event": "start", "step": 0}, {"step": 0, "val": 5.5}]
    for i, (v, t, m) in enumerate(zip(vals, tok_s, mem), 1):
        steps.append({"step": i * 10, "loss": v + 0.1, "tok_s": t, "mem_gb": m, "val": v})
    if finished:
        steps.append({"event": "end", "step": len(vals) * 10})
    (run / "log.jsonl").write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    (run / "command.txt").write_text(f"python experiments/paired.py --seed={seed} --out_dir=out/text/{name}_s{seed}\n")


def test_results_md_numbers_come_from_the_logs(tmp_path):
    full = {0: 2.50, 1: 2.60, 2: 2.40}
    dsa = {0: 2.55, 1: 2.66, 2: 2.44}  # paired deltas +0.05, +0.06, +0.04
    for s in full:  # the sweep's runs' own tok/s and memory are not the cost columns' ...
        _fake_run(tmp_path, "full", s, [3.0, full[s]], [300, 300], [9.0, 9.0])
        _fake_run(tmp_path, "dsa", s, [3.0, dsa[s]], [900, 900], [9.0, 9.0])
        _fake_run(tmp_path, "local_w16", s, [3.0, full[s] + 0.2], [2000, 2000], [1.0, 1.0])
    # ... the cost runs' are (measured back to back); local's cost run is unfinished
    _fake_run(tmp_path, "full", 0, [3.0], [1000, 1000], [1.0, 1.0], part="cost")
    _fake_run(tmp_path, "dsa", 0, [3.0], [500, 500], [2.0, 2.0], part="cost")
    _fake_run(tmp_path, "local", 0, [3.0], [700, 700], [1.0, 1.0], part="cost", finished=False)
    _fake_run(tmp_path, "asga", 0, [3.0, 2.0], [100, 100], [1.0, 1.0], finished=False)
    md_path = tmp_path / "RESULTS.md"
    sweep.write_results(tmp_path, md_path)
    md = md_path.read_text()
    rows = {}
    for line in md.splitlines():
        if line.startswith("| ") and not line.startswith("| config") and not line.startswith("| paper"):
            cells = [c.strip() for c in line.split("|")[1:-1]]
            rows.setdefault(cells[0], []).append(cells)
    hw = 4.303 * 0.01 / 3 ** 0.5
    dsa_row = rows["dsa"][-1]  # the text table's row (recall's comes first)
    assert dsa_row[3] == f"{(2.55 + 2.66 + 2.44) / 3:.4f}"
    assert dsa_row[4] == "+0.0500, +0.0600, +0.0400"
    assert dsa_row[5] == f"+0.0500 ± {hw:.4f}"
    assert dsa_row[6] == "0.50x (500)" and dsa_row[7] == "2.00x (2.00 GB)"
    assert rows["full"][-1][6] == "1.00x (1000)"
    # the papers' table: dsa (adaptive) is 002's 4.904 (Δ -0.0226): ours is worse -> opposite sign
    paper = [l for l in md.splitlines() if l.startswith("| 002 | Full Model")][0]
    assert "+0.0500" in paper and paper.rstrip(" |").endswith("opposite sign") and "22 GB" in paper
    assert "4.6498" in md and "dsa_fixed" in md and "5.1300" in md and "0.012" in md and "66.6 GB" in md
    # window control: W=16 resolved (+0.2, no spread), others pending
    w16 = [r for r in rows["16"] if len(r) == 6][0]
    assert w16[1] == "33" and w16[4].startswith("+0.2000") and w16[5] == "yes: worse than full"
    assert "`local` at W = 16 is measurably worse than `full`" in md
    # an unfinished run is pending, as are the configurations without runs
    asga = rows["asga"][-1]
    assert "pending" in asga[3]
    assert "pending" in " ".join(rows["caa"][-1])
    # every 4-decimal number outside the papers' table comes from the logs above
    allowed = {f"{x:.4f}" for x in (*full.values(), *dsa.values(), sum(full.values()) / 3, sum(dsa.values()) / 3,
                                    0.05, 0.06, 0.04, hw, 0.2, 0.0, sum(full.values()) / 3 + 0.2, 0.0625)}
    body = md.split("## The papers' numbers beside ours")[0]
    for number in re.findall(r"\d+\.\d{4}", body):
        assert number in allowed, number


def _fake_eval(run, n_seq, value_at, bpb):
    """eval.json as evaluate.py writes it, at 1x, 2x and 4x TEXT's seq_len, each bucket's mean
    value_at(factor, first)."""
    import evaluate
    T = sweep.TEXT["seq_len"]
    positions = [{"seq_len": f * T, "factor": f, "n_seq": n_seq, "bits_per_byte": bpb if f == 1 else None,
                  "buckets": [{"first": a, "last": b, "mean": value_at(f, a), "ci95": 0.1}
                              for a, b in evaluate.position_buckets(f * T)]} for f in (1, 2, 4)]
    (run / "eval.json").write_text(json.dumps({"positions": positions, "bits_per_byte": bpb}))


def test_loss_by_position_table_pairs_each_range_with_full(tmp_path):
    """RESULTS.md's loss-by-position table: `full`'s own mean over each range (its buckets
    weighted by their widths), every other configuration's paired Δ per seed range, bold and
    listed where the 95% interval excludes 0; an evaluation of other sequences is not paired."""
    T = sweep.TEXT["seq_len"]
    late = {0: 0.1, 1: 0.2, 2: 0.3}  # dsa minus full over 128..T: mean 0.2, not resolved
    for s in (0, 1, 2):
        _fake_run(tmp_path, "full", s, [3.0, 2.5], [1, 1], [1, 1])
        _fake_run(tmp_path, "dsa", s, [3.0, 2.5], [1, 1], [1, 1])
        _fake_run(tmp_path, "local", s, [3.0, 2.5], [1, 1], [1, 1])
        full_at = lambda f, a, s=s: 2.0 + 0.01 * s + (0.5 if a >= 256 else 0.0)  # noqa: E731
        _fake_eval(tmp_path / "text" / f"full_s{s}", 64, full_at, 3.0 + s)
        _fake_eval(tmp_path / "text" / f"dsa_s{s}", 64,
                   lambda f, a, s=s, full_at=full_at: full_at(f, a) + (late[s] if f == 1 and a >= 128 else 0)
                   + (0.5 if f == 4 and a >= 2 * T else 0), 3.1 + s)
        _fake_eval(tmp_path / "text" / f"local_s{s}", 8, full_at, 3.0 + s)  # other sequences
    md = sweep.results_markdown(tmp_path, tmp_path)[0]
    section = md.split("## Loss by position")[1].split("\n## ")[0]
    rows = {c[0]: c for c in ([x.strip() for x in line.split("|")[1:-1]] for line in section.splitlines()
                             if line.startswith("| ") and not line.startswith("| config"))}
    assert rows["full"][1] == "3" and rows["full"][2] == "4.0000"
    # 128..T: the bucket 128-255 at 2.0 + 0.01 s and 256-T at 2.5 + 0.01 s, weighted 128 : 257
    assert rows["full"][5] == f"{(2.01 * 128 + 2.51 * (T - 255)) / (T - 127):.4f}"
    hw = 4.303 * 0.1 / 3 ** 0.5
    assert rows["dsa"][2] == "4.1000 (**+0.1000 ± 0.0000**)"
    assert rows["dsa"][3] == rows["dsa"][4] == "+0.0000 ± 0.0000"
    assert rows["dsa"][5] == f"+0.2000 ± {hw:.4f}"  # 128..T: not resolved
    assert rows["dsa"][6] == "+0.0000 ± 0.0000" and rows["dsa"][7] == "**+0.5000 ± 0.0000**"
    assert rows["local"][1:] == ["–"] * 7
    resolved = section.split("Resolved (95% interval excludes 0): ")[1].split("\n")[0]
    assert "dsa above `full` at bits per byte" in resolved and f"dsa above `full` at {2 * T}–{4 * T} at 4x" in resolved
    assert "128–" not in resolved and "Not evaluated yet: local" in resolved


def test_gpu_speed_section_divides_by_full_on_the_same_card(tmp_path):
    """RESULTS.md's GPU speed rows come from the newest committed gpu_check training rows:
    each config's tokens/s over `full`'s of the same run, beside the seeds' own ratios; a
    failed row says so and a config the run did not reach says "not yet run"."""
    run = tmp_path / "h100_2099-01-01"
    run.mkdir()
    rows = [dict(config="full", T=1024, batch=16, tok_s=200e3, mfu=0.2),
            dict(config="combiner", T=1024, batch=16, tok_s=150e3, mfu=0.15),
            dict(config="indexer", T=1024, batch=16, error="OutOfMemoryError: CUDA out of memory.")]
    env = dict(device_name="H100", torch="2.11", cuda="13.0", git_commit="abc1234")
    (run / "training.json").write_text(json.dumps(dict(environment=env, training=rows)))
    lines = sweep.gpu_speed_section(lambda p: str(p), runs=tmp_path)
    table = {c[0]: c for c in ([x.strip() for x in line.split("|")[1:-1]] for line in lines
                               if line.startswith("| ") and not line.startswith("| config"))}
    assert table["combiner"][1] == "1.05x (004)" and table["combiner"][2] == "0.75x" and table["combiner"][3] == "15.0%"
    assert table["indexer"][2] == "out of memory" and table["indexer"][1] == "– (goal 0.8x)"
    assert table["asga"][2] == "not yet run" and table["asga"][1] == "0.92x (003)"
    assert "commit abc1234" in lines[2] and "200.0k tokens/s" in lines[2]


def test_the_cost_columns_name_the_commit_they_ran_at(tmp_path):
    """The CPU cost columns are one back-to-back sitting of runs: the text says at which commit
    (`full`'s cost run records it), so later kernel changes are not read into them."""
    assert sweep.cost_commit(tmp_path) is None
    run = tmp_path / "cost" / "full"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"git_commit": "abc1234def"}))
    assert sweep.cost_commit(tmp_path) == "abc1234"
    text = "\n".join(sweep.text_section({name: None for name, *_ in sweep.TEXT_CONFIGS}, str, "abc1234"))
    assert "The cost runs ran at commit abc1234" in text


def test_committed_results_md_is_regenerated_from_committed_logs():
    """Every number in RESULTS.md comes from the committed run logs: rewriting it from
    experiments/results/ gives the committed file, byte for byte."""
    text = sweep.results_markdown(ROOT / "experiments" / "results", ROOT)[0]  # links relative to the checkout
    assert text == (ROOT / "RESULTS.md").read_text()


def test_configurations_this_checkout_cannot_build_are_pending_not_guessed():
    from attention import VARIANTS

    assert sweep.unavailable("dsa", {"dsa_window": "fixed"}) is None
    assert sweep.unavailable("caa", {"caa_gate": "local"}) is None
    assert "not accepted" in sweep.unavailable("asga", {"asga_gate": "no-such-gate"})
    assert "not in this checkout" in sweep.unavailable("no_such_variant", {})
    assert (sweep.unavailable("combiner", {}) is None) == ("combiner" in VARIANTS)


def test_sweep_runs_every_configuration_with_paired_seeds(tmp_path):
    import argparse

    args = argparse.Namespace(out_dir=str(tmp_path), kernel="ref", recall_data_dir="r", data_dir="d")
    runs = [(part, Path(run).name) for part, _, run, *_ in sweep.jobs(args)]
    assert {n for p, n in runs if p == "recall"} == {f"{c[0]}_s0" for c in sweep.RECALL_CONFIGS}
    text = {n for p, n in runs if p in ("window", "text")}
    assert {n for p, n in runs if p == "cost"} == {c[0] for c in sweep.TEXT_CONFIGS}  # seed 0, back to back
    for name, *_ in sweep.TEXT_CONFIGS:
        assert {f"{name}_s{s}" for s in sweep.SEEDS} <= text
    for w in sweep.WINDOWS:
        assert {f"{sweep.window_run_name(w)}_s{s}" for s in sweep.SEEDS} <= text
    assert len(runs) == len(set(runs))  # no run twice (local at the study's W is the window control's)
    assert runs[0] == ("recall", "full_s0") and runs[1] == ("recall", "local_s0")


def test_every_cost_command_passes_train_pys_checks():
    """A cost run is COST_STEPS steps: a flag bounded by max_steps (the indexer's dense
    warm-up, 50 steps by default) must fit, or the sweep stops at that run."""
    from config import TrainConfig

    for name, attn, flags in sweep.TEXT_CONFIGS:
        cmd = sweep.cost_command(attn, flags, Path("o"), Path("d"), "fused")
        args = dict(a[2:].split("=", 1) for a in cmd[2:])
        assert int(args["max_steps"]) == sweep.COST_STEPS
        if attn == "indexer":
            warmup = int(args.get("indexer_warmup", TrainConfig.indexer_warmup))
            assert 0 <= warmup <= int(args["max_steps"]), (name, warmup)


def test_long_pair_sentence_names_the_step_from_which_full_stays_ahead():
    f = {"evals": [(0, 5.5), (1000, 2.5), (2000, 2.3), (3000, 2.1), (4000, 2.0)], "final_val": 2.0}
    l = {"evals": [(0, 5.5), (1000, 2.4), (2000, 2.35), (3000, 2.05), (4000, 2.1)], "final_val": 2.1}
    text = sweep.long_pair_sentence(f, l, "here", 4, 16384)
    # local - full: -0.1, +0.05, -0.05, +0.1: full is ahead for good only from step 4000
    assert "`full` is ahead from step 4000 on" in text and f"beyond {sweep.reach(4)} bytes" in text
    assert "+0.1000 at step 4000" in text and "-0.0500 at step 3000" in text
    l["evals"][-1] = (4000, 1.9)
    assert "had not yet overtaken a 4-byte window" in sweep.long_pair_sentence(f, l, "here", 4, 16384)


def test_later_baselines_section_puts_each_papers_results_beside_its_own_configs():
    """The section names NSA, MoBA and DeepSeek Sparse Attention with their headline numbers, and
    each of our rows carries that configuration's own numbers (distinct per config here, so a
    number wired to the wrong configuration shows), or "pending" before its run."""
    def stat(delta, hw, tok_rel):
        return {"delta": delta, "hw": hw, "tok_rel": tok_rel}
    stats = {"nsa": stat(0.0123, 0.0011, 0.41), "moba": None,  # moba's text runs not finished
             "indexer": stat(-0.0456, 0.0022, 0.52), "indexer_nowarm": stat(0.0789, 0.5, None)}
    rec = {"full": {"overall": 0.996}, "nsa": {"overall": 0.111}, "indexer": {"overall": 0.222},
           "indexer_nowarm": {"overall": 0.333}}
    md = "\n".join(sweep.later_baselines_section(stats, rec))
    for heading, numbers in (("### NSA", ("0.456", "0.443", "0.469", "0.437", "9.0x")),
                             ("### MoBA", ("0.4828", "0.4821", "0.7818", "0.7849", "6.5x")),
                             ("### DeepSeek Sparse Attention", ("85.0", "79.9", "80.7", "2048"))):
        part = md.split(heading)[1].split("\n### ")[0]
        assert all(n in part for n in numbers), heading
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in md.splitlines() if line.startswith("| ") and line.split("|")[1].strip() in stats}
    assert rows["nsa"] == ["+0.0123 ± 0.0011", "yes: worse than full", "0.41x", "0.111"]
    assert rows["moba"] == ["pending"] * 4
    assert rows["indexer"] == ["-0.0456 ± 0.0022", "yes: better than full", "0.52x", "0.222"]
    assert rows["indexer_nowarm"] == ["+0.0789 ± 0.5000", "no: not told apart", "pending", "0.333"]
    assert "orders of magnitude" in md and "only the direction is compared" in md
    assert "`full` 0.996" in md


def test_resolved_summary_counts_what_each_instrument_separates():
    """The generated sentence on what the study resolves: final-loss differences whose 95%
    interval excludes 0, and recall accuracies below full's beyond their sampling interval."""
    stats = {"full": {"delta": None, "hw": None, "runs": {}},
             "dsa": {"delta": 0.05, "hw": 0.01, "runs": {}},  # resolved
             "asga": {"delta": 0.01, "hw": 0.05, "runs": {}}}  # not
    rec = {"full": {"overall": 0.99, "n_queries": 10000},
           "near": {"overall": 0.989, "n_queries": 10000},  # 0.001 below: within the interval (~0.003)
           "far": {"overall": 0.5, "n_queries": 10000}}
    text = sweep.resolved_summary(stats, rec)[0]
    assert "the final validation loss, 1 of 2 configurations (dsa (+0.0500 ± 0.0100))" in text
    assert "the recall probe, 1 of 2 configurations below" in text
    assert "separates no configuration" not in text
    stats["dsa"]["delta"] = 0.005
    assert "separates no configuration" in sweep.resolved_summary(stats, rec)[0]


def test_positions_figure_pairs_only_evaluations_of_the_same_sequences(tmp_path):
    """assets/study_positions.png draws a configuration beside `full` only where both were
    evaluated on the same sequences (n_seq): none when they differ, the figure when they agree."""
    import figures

    for s in (0, 1):
        _fake_run(tmp_path, "full", s, [3.0, 2.5], [1, 1], [1, 1])
        _fake_run(tmp_path, "local", s, [3.0, 2.5], [1, 1], [1, 1])
        _fake_eval(tmp_path / "text" / f"full_s{s}", 64, lambda f, a: 2.0, 3.0)
        _fake_eval(tmp_path / "text" / f"local_s{s}", 8, lambda f, a: 2.0, 3.0)  # other sequences
    stats = sweep.results_markdown(tmp_path, tmp_path)[1]
    assert figures.positions_figure(stats, sweep.TEXT_CONFIGS, 512, tmp_path / "a.png") is False
    for s in (0, 1):
        _fake_eval(tmp_path / "text" / f"local_s{s}", 64, lambda f, a: 2.1, 3.0)
    stats = sweep.results_markdown(tmp_path, tmp_path)[1]
    assert figures.positions_figure(stats, sweep.TEXT_CONFIGS, 512, tmp_path / "b.png") is True
    assert (tmp_path / "b.png").stat().st_size > 10000
