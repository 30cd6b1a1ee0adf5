"""analyze.py: on real tiny train.py runs of full, dsa and caa it writes non-empty figures and
a table whose numbers are the logs' own; the table's rules (target loss, median speed,
resumed and truncated logs) on hand-made logs; clear failures for missing or unreadable runs;
the attention-weight helper against the attention it explains."""
import json
import os
import signal
import statistics
import subprocess
import sys

import numpy as np
import pytest
import torch

import analyze
import attention
from conftest import ENGLISH, ROOT, requires_gpt2
from model import Model, ModelConfig

# Shards are tokenized with GPT-2's BPE: without its files these tests cannot run.
pytestmark = requires_gpt2

# The tiny model on 32-token sequences, small windows so every variant's rule is exercised.
TRAIN = ["--model=tiny", "--seq_len=32", "--batch_size=4", "--total_batch_tokens=128",
         "--val_tokens=256", "--warmup_steps=2", "--max_steps=6", "--eval_every=2", "--window=8"]
RUNS = {"full": ["--attn=full"],
        "dsa": ["--attn=dsa", "--dsa_threshold=16"],
        "caa": ["--attn=caa", "--caa_window_max=16"]}


def read_log(run_dir):
    with open(os.path.join(run_dir, "log.jsonl")) as f:
        return [r for r in map(json.loads, f) if "event" not in r]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Three real train.py runs (6 steps, val every 2) on shards of our own English text."""
    import tiktoken

    import data
    import train

    tmp = tmp_path_factory.mktemp("analyze")
    text = (ENGLISH + "Maria and Tomas sailed from Lisbon to Oslo in 1998. ") * 40
    tokens = np.array(tiktoken.get_encoding("gpt2").encode_ordinary(text), dtype=np.uint16)
    shards = tmp / "shards"
    shards.mkdir()
    data.write_shard(str(shards / "english_val_000000.bin"), tokens[:2000])
    data.write_shard(str(shards / "english_train_000001.bin"), tokens[2000:])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for name, args in RUNS.items():  # in-process: one torch import for all three
            train.main([*TRAIN, *args, f"--data_dir={shards}", f"--out_dir={tmp / 'out' / name}"])
    finally:
        for s, h in handlers.items():  # train.py installs its own stop handlers
            signal.signal(s, h)
    return tmp


def test_real_runs_give_figures_and_the_logs_numbers(trained, capsys):
    out = trained / "analysis"
    runs = [str(trained / "out" / name) for name in RUNS]
    analyze.main([*runs, f"--out_dir={out}"])
    printed = capsys.readouterr().out
    assert f"to {out}/" in printed

    summary = json.loads((out / "summary.json").read_text())
    expected = {"loss.png", "positions.png", "attention.png", "gates_dsa.png", "gates_caa.png", "dynamics_caa.png",
                "categories_dsa.png", "categories_caa.png"}
    assert expected <= set(summary["figures"]), summary["notes"]
    assert "gates_full.png" not in summary["figures"]  # full has no gates
    import matplotlib.image

    for name in summary["figures"]:
        pixels = matplotlib.image.imread(out / name)
        assert pixels.shape[0] > 100 and pixels.std() > 0.05, f"{name} looks blank"

    # Every number in the table, recomputed from the logs here.
    logs = {name: read_log(trained / "out" / name) for name in RUNS}
    full_val = [r["val"] for r in logs["full"] if "val" in r][-1]
    assert summary["target_loss"] == full_val
    rows = {r["name"]: r for r in summary["runs"]}
    table = (out / "summary.md").read_text()
    for name, log in logs.items():
        row, evals = rows[name], [r for r in log if "val" in r]
        speeds = [r["tok_s"] for r in log if "tok_s" in r]
        assert [r["step"] for r in evals] == [0, 2, 4, 6]
        assert row["final_val"] == evals[-1]["val"] and row["final_val_step"] == 6
        assert row["tok_s"] == statistics.median(speeds[1:])
        assert row["mem_gb"] == max(r["mem_gb"] for r in log if "mem_gb" in r)
        assert row["steps_to_target"] == next(r["step"] for r in evals if r["val"] <= full_val)
        full = rows["full"]
        assert row["tok_s_vs_full"] == pytest.approx(row["tok_s"] / full["tok_s"])
        assert row["mem_gb_vs_full"] == pytest.approx(row["mem_gb"] / full["mem_gb"])
        assert f"| {name} | {row['variant']} | tiny | {evals[-1]['val']:.4f} (6) | {row['tok_s']:.0f} |" in table
    assert rows["dsa"]["variant"] == "dsa (window=8, dsa_threshold=16)"
    assert rows["caa"]["variant"] == "caa (window=8, caa_window_max=16)"

    # Gate by token category, measured on the run's validation shard.
    by_cat = summary["gate_by_category"]
    assert set(by_cat) == {"dsa", "caa"} and set(by_cat["caa"]) == {"mix_gate", "window", "count"}
    assert all(n > 0 for n in by_cat["dsa"]["count"].values())  # our text has every category
    widths = [v for per_layer in by_cat["caa"]["window"].values() for v in per_layer]
    assert all(8 <= w <= 16 for w in widths)  # caa's width lives in [window, caa_window_max]


def test_no_arguments_analyse_the_newest_run_of_each_configuration(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    make_run(tmp_path / "out" / "old_full", "full", [(0, 6.0), (2, 5.0)])
    make_run(tmp_path / "out" / "new_full", "full", [(0, 6.0), (2, 4.0)])
    make_run(tmp_path / "out" / "dsa", "dsa", [(0, 6.0), (2, 4.5)])
    (tmp_path / "out" / "empty").mkdir()  # not a run: ignored
    os.utime(tmp_path / "out" / "old_full" / "log.jsonl", (1, 1))  # make it clearly older
    analyze.main([])
    summary = json.loads((tmp_path / "out" / "analysis" / "summary.json").read_text())
    assert sorted(r["name"] for r in summary["runs"]) == ["dsa", "new_full"]
    assert "out/analysis/" in capsys.readouterr().out


def make_run(path, attn, evals, speeds=(100.0, 900.0, 1000.0, 1100.0), extra_lines=()):
    """A run folder in train.py's format (config.json, log.jsonl), without a checkpoint."""
    path.mkdir(parents=True)
    model = {"attn": attn, "window": 256, "dsa_window": "adaptive", "dsa_threshold": 512}
    config = {"device": "cpu", "train": {"model": "tiny", "seq_len": 32}, "model": model}
    (path / "config.json").write_text(json.dumps(config))
    lines = [json.dumps({"event": "start", "step": 0, **config})]
    val = dict(evals)
    for step in range(0, max(val) + 1):
        record = {"step": step}
        if step:
            record.update(loss=7.0 - step / 10, tok_s=speeds[(step - 1) % len(speeds)], mem_gb=0.1 * step)
        if step in val:
            record.update(val=val[step], gates={"head_gate": {"mean": [[0.5, 0.6]], "std": [[0, 0]],
                                                              "frac_gt_half": [[0, 1]]}} if attn == "dsa" else {})
        lines.append(json.dumps(record))
    (path / "log.jsonl").write_text("\n".join([*lines, *extra_lines]) + "\n")
    return path


def test_table_rules_on_hand_made_logs(tmp_path):
    # A resumed run logs step 4 twice (the last one counts) and was killed mid-line.
    make_run(tmp_path / "full", "full", [(0, 6.0), (2, 5.5), (4, 5.0)])
    dsa = make_run(tmp_path / "dsa", "dsa", [(0, 6.0), (2, 4.9), (4, 4.5)],
                   extra_lines=['{"event": "resume", "step": 2}',
                                json.dumps({"step": 4, "val": 4.8, "tok_s": 50.0, "mem_gb": 9.0}),
                                '{"step": 5, "loss": 3.'])
    runs = [analyze.load_run(tmp_path / "full"), analyze.load_run(dsa)]
    table = analyze.build_table(runs)
    full, d = table["runs"]
    assert table["target_loss"] == 5.0 and "full" in table["target_rule"]
    assert d["final_val"] == 4.8 and d["final_val_step"] == 4  # the resumed record wins
    assert d["steps_to_target"] == 2 and full["steps_to_target"] == 4
    assert full["tok_s"] == statistics.median([900.0, 1000.0, 1100.0])  # step 1 left out
    assert d["tok_s"] == statistics.median([900.0, 1000.0, 50.0])
    assert d["mem_gb"] == 9.0 and d["mem_gb_vs_full"] == pytest.approx(9.0 / 0.4)
    assert analyze.build_table(runs, target_loss=4.85)["runs"][1]["steps_to_target"] == 4
    assert analyze.build_table(runs, target_loss=1.0)["runs"][1]["steps_to_target"] is None
    # Without a full run: the worst final loss is the target and there are no ratios.
    alone = analyze.build_table(runs[1:])
    assert alone["target_loss"] == 4.8 and alone["runs"][0]["tok_s_vs_full"] is None
    assert "| – |" in analyze.table_markdown(alone) and "not reached" in analyze.table_markdown(
        analyze.build_table(runs, target_loss=1.0))

    # No checkpoint: the table and training figures still come, with a note for the rest.
    summary = analyze.analyze(runs, dict(analyze.DEFAULTS, out_dir=str(tmp_path / "a")))
    assert "gates_dsa.png" in summary["figures"] and any("ckpt.pt" in n for n in summary["notes"])


def test_missing_and_unreadable_runs_exit_with_a_message_naming_them(tmp_path, capsys):
    (tmp_path / "no_log").mkdir()
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "log.jsonl").write_bytes(b"\x00\xff not json\n")
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "log.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    for bad in ("does_not_exist", "no_log", "garbage", "no_config"):
        with pytest.raises(SystemExit) as e:
            analyze.main([str(tmp_path / bad), f"--out_dir={tmp_path / 'a'}"])
        assert str(tmp_path / bad) in str(e.value), str(e.value)
    with pytest.raises(SystemExit, match="no runs folder"):
        analyze.main([f"--root={tmp_path / 'nothing_here'}"])
    with pytest.raises(SystemExit):
        analyze.main(["--targetloss=3"])
    assert "unknown config key --targetloss" in capsys.readouterr().err
    # From the shell: a non-zero exit and the path, no traceback.
    r = subprocess.run([sys.executable, str(ROOT / "analyze.py"), str(tmp_path / "missing_run")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and str(tmp_path / "missing_run") in r.stderr
    assert "Traceback" not in r.stderr


def test_unreadable_checkpoint_is_a_note_not_a_crash(tmp_path):
    run = make_run(tmp_path / "dsa", "dsa", [(0, 6.0), (2, 4.5)])
    (run / "ckpt.pt").write_bytes(b"truncated")
    summary = analyze.analyze([analyze.load_run(run)], dict(analyze.DEFAULTS, out_dir=str(tmp_path / "a")))
    assert any(str(run / "ckpt.pt") in n and "not a checkpoint" in n for n in summary["notes"])
    assert "summary.md" in os.listdir(tmp_path / "a")


VARIANTS = {"full": {}, "local": dict(attn="local"), "dsa": dict(attn="dsa", dsa_window="fixed"),
            "asga": dict(attn="asga"), "caa": dict(attn="caa", caa_window_max=12)}


@pytest.mark.parametrize("name", VARIANTS)
def test_attention_weights_are_what_attend_applies(name):
    kw = {"attn": "full", **VARIANTS[name]}
    cfg = ModelConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, head_dim=8, d_model=32,
                      mlp_hidden=64, window=6, **kw)
    torch.manual_seed(0)
    model = Model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.4)
    idx = torch.randint(0, 64, (2, 20))
    seen = analyze.capture_attend_inputs(model, idx, layer=1)
    attn = model.layers[1].self_attn
    w = analyze.attention_weights(attn, seen["q"], seen["k"], seen["x"], seen["q_start"], seen["k_start"])
    assert w.shape == (2, 4, 20, 20)
    y = attn.attend(seen["q"], seen["k"], seen["v"], seen["x"], seen["q_start"], seen["k_start"])
    v = seen["v"].repeat_interleave(2, dim=1)  # (B, H, S, D)
    torch.testing.assert_close(w @ v, y)  # the weights reproduce the layer's output
    assert torch.all(w.triu(1) == 0)  # causal
    rows = w.sum(-1)
    if name == "dsa":  # rows sum to the head gate
        gate = torch.sigmoid(attn.head_gate(seen["x"])).transpose(1, 2)
        torch.testing.assert_close(rows, gate)
        assert torch.all(w.tril(-7) == 0)  # fixed window 6: j >= i - 6
    else:
        torch.testing.assert_close(rows, torch.ones_like(rows))
    if name == "local":
        assert torch.all(w.tril(-7) == 0)
        assert torch.all(w.diagonal(-6, dim1=-2, dim2=-1) > 0)  # the window's edge is seen
    if name == "full":
        q, k = seen["q"], seen["k"].repeat_interleave(2, dim=1)
        logits = (q @ k.transpose(-2, -1)) / 8 ** 0.5
        expected = logits.masked_fill(torch.ones(20, 20).triu(1).bool(), float("-inf")).softmax(-1)
        torch.testing.assert_close(w, expected)
    assert "attend" not in vars(attn)  # the spy is gone


def test_token_categories():
    cats = {" the": "function words", "The": "function words", " 1999": "digits", "3.5": "digits",
            ",": "punctuation", " —": "punctuation", " London": "capitalised", " bread": "other",
            "\n": "other", "\ufffd": "other"}
    for piece, cat in cats.items():
        assert analyze.token_category(piece) == cat, piece


def test_gate_by_category_averages_each_category():
    cfg = ModelConfig(vocab_size=50304, n_layer=2, n_head=4, n_kv_head=4, head_dim=8, d_model=32,
                      mlp_hidden=64, attn="dsa")
    torch.manual_seed(0)
    model = Model(cfg).eval()
    for layer in model.layers:
        torch.nn.init.normal_(layer.self_attn.head_gate.weight, std=2.0)  # gates that vary by token
    import tiktoken

    enc = tiktoken.get_encoding("gpt2")
    idx = torch.tensor([enc.encode_ordinary(ENGLISH)[:40]])
    decode = lambda t: enc.decode([t])
    by_cat = analyze.gate_by_category(model, idx, decode)
    model.record_gates(True)
    model(idx)
    gates = [layer["head_gate"][0].mean(-1) for layer in model.gate_tensors()]  # (T,) per layer
    pieces = [decode(t) for t in idx[0].tolist()]
    for category in analyze.CATEGORIES:
        members = [i for i, p in enumerate(pieces) if analyze.token_category(p) == category]
        assert by_cat["count"][category] == len(members)
        for layer, g in enumerate(gates):
            expected = g[members].mean().item() if members else None
            assert by_cat["head_gate"][category][layer] == pytest.approx(expected)
    assert len({round(by_cat["head_gate"][c][0], 4) for c in analyze.CATEGORIES if by_cat["count"][c]}) > 1


# ----------------------------------------------------------------------------- nsa, moba, indexer: what they selected

SELECTING = {"nsa": dict(nsa_cmp_block=4, nsa_cmp_stride=2, nsa_block=4, nsa_topk=4, nsa_window=3),
             "moba": dict(moba_block=4, moba_topk=3, moba_full_last=1),
             "indexer": dict(index_topk=5, index_head_dim=16)}


def selecting_model(attn):
    cfg = ModelConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, head_dim=8, d_model=32, mlp_hidden=64,
                      attn=attn, kernel="ref", **SELECTING[attn])
    torch.manual_seed(0)
    model = Model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # off the neutral init: gates and scores that vary by token
            p.normal_(0, 0.4)
    return model


def brute_selection(model, idx, layer):
    """Each query's selection recomputed from the module's public functions on the inputs its
    `attend` saw: {(n, head, t): [blocks or keys]} (indexer: head None, the heads share it)."""
    attn = model.layers[layer].self_attn
    seen = analyze.capture_attend_inputs(model, idx, layer)
    q, k, v, x = seen["q"], seen["k"], seen["v"], seen["x"]
    N, H, T, _ = q.shape
    out = {}
    if model.cfg.attn == "indexer":
        scores = attention.lightning_scores(*attn.indexer(x, 0), 0, 0)  # (N, T, S)
        for n in range(N):
            for t in range(T):
                ranked = sorted(range(t + 1), key=lambda s: (scores[n, t, s].item(), s), reverse=True)
                out[n, None, t] = ranked[:attn.topk]  # ties to the most recent key
        return out
    if model.cfg.attn == "nsa":
        cfg = model.cfg
        J = -(-T // cfg.nsa_block)
        k_cmp = attn.compress(k, "k")
        p = attention.compressed_probs(q, k_cmp, attn.scale, 0, cfg.nsa_cmp_block, cfg.nsa_cmp_stride)  # eq. 8
        scores = p @ attention.block_overlap(p.shape[-1], J, cfg.nsa_cmp_block, cfg.nsa_cmp_stride, cfg.nsa_block,
                                             p.device)  # eq. 9
        blocks = attention.nsa_top_blocks(scores, 0, cfg.nsa_block, cfg.nsa_topk, cfg.n_kv_head)
    else:
        blocks = attention.moba_select(q, attention.block_means(k, model.cfg.moba_block), 0, model.cfg.moba_block,
                                        model.cfg.moba_topk)
    for n in range(N):
        for h in range(H):
            for t in range(T):
                out[n, h, t] = [b for b in blocks[n, h, t].tolist() if b >= 0]
    return out


@pytest.mark.parametrize("attn", SELECTING)
def test_selection_stats_equal_a_brute_force_count(attn):
    model = selecting_model(attn)
    idx = torch.randint(0, 64, (2, 30))  # 30: not a multiple of the block
    stats = analyze.selection_stats(model, idx)
    block = 1 if attn == "indexer" else SELECTING[attn][f"{attn}_block"]
    assert stats["unit"] == ("tokens" if attn == "indexer" else "blocks") and stats["block"] == block
    for layer, s in enumerate(stats["layers"]):
        if attn == "moba" and layer == 1:  # moba_full_last=1: full attention, nothing selected
            assert s is None
            continue
        chosen = brute_selection(model, idx, layer)
        distances = [t // block - u for (n, h, t), units in chosen.items() for u in units]
        counts = [distances.count(d) for d in range(max(distances) + 1)]
        assert s["counts"] == counts
        assert s["mean"] == pytest.approx(sum(distances) / len(distances))
        assert s["own"] == pytest.approx(counts[0] / len(distances))
        slots = stats["slots"]
        assert s["recent"] == pytest.approx(sum(d < slots for d in distances) / len(distances))
        heads = [h for (n, h, t) in chosen if n == 0 and t == 0]
        for t in range(30):
            for u in range(s["map"].shape[1]):
                share = sum(u in chosen[0, h, t] for h in heads) / len(heads)
                assert s["map"][t, u] == pytest.approx(share)
        assert max(distances) > 1  # the test sees selections beyond the own and previous unit
        if attn == "nsa":
            x = analyze.capture_attend_inputs(model, idx, layer)["x"]
            g = torch.sigmoid(model.layers[layer].self_attn.branch_gate(x)).view(2, 30, 3, 4)
            for i, name in enumerate(("cmp", "slc", "win")):
                by_head = [g[:, :, i, h].mean().item() for h in range(4)]
                by_position = [g[:, t, i, :].mean().item() for t in range(30)]
                assert s["gates"][name]["by_head"] == pytest.approx(by_head, abs=1e-6)
                assert s["gates"][name]["by_position"] == pytest.approx(by_position, abs=1e-6)


def test_indexer_history_is_the_logs(tmp_path):
    path = make_run(tmp_path / "indexer", "indexer", [(0, 6.0), (2, 5.0), (4, 4.5)])
    lines = (path / "log.jsonl").read_text().splitlines()
    kept = {2: [[0.8], [0.6]], 4: [[0.9], [0.7]]}
    records = []
    for line in lines:
        r = json.loads(line)
        if "event" not in r and r["step"]:
            r.update(indexer_kl=1.0 / r["step"], indexer_stage="dense" if r["step"] <= 2 else "sparse")
        if r.get("step") in kept and "val" in r:
            r["gates"] = {"kept_mass": {"mean": kept[r["step"]], "std": [[0], [0]], "frac_gt_half": [[1], [1]]}}
        records.append(json.dumps(r))
    (path / "log.jsonl").write_text("\n".join(records) + "\n")
    history = analyze.indexer_history(analyze.load_run(path))
    steps, kl, stage = history["kl"]
    assert steps == [1, 2, 3, 4] and kl == [1.0, 0.5, 1 / 3, 0.25] and stage == ["dense", "dense", "sparse", "sparse"]
    kept_steps, kept_mass = history["kept"]
    assert kept_steps == [2, 4] and kept_mass.tolist() == [[0.8, 0.6], [0.9, 0.7]]


def test_real_selecting_runs_give_their_figures(trained, capsys):
    """Tiny real train.py runs of nsa, moba and indexer; `python analyze.py` on them draws what
    each selected, and the indexer's figure and table come from its checkpoint and log."""
    import train

    flags = {"nsa": ["--attn=nsa", "--nsa_cmp_block=4", "--nsa_cmp_stride=2", "--nsa_block=4", "--nsa_topk=4",
                     "--nsa_window=4"],
             "moba": ["--attn=moba", "--moba_block=4", "--moba_topk=3"],
             "indexer": ["--attn=indexer", "--index_topk=6", "--indexer_warmup=2"]}
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for name, args in flags.items():
            train.main([*TRAIN, *args, f"--data_dir={trained / 'shards'}", f"--out_dir={trained / 'out' / name}"])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    out = trained / "analysis_selecting"
    analyze.main([*(str(trained / "out" / name) for name in flags), f"--out_dir={out}"])
    summary = json.loads((out / "summary.json").read_text())
    import matplotlib.image

    for name in flags:
        assert f"selection_{name}.png" in summary["figures"], summary["notes"]
        pixels = matplotlib.image.imread(out / f"selection_{name}.png")
        assert pixels.shape[0] > 100 and pixels.std() > 0.05
    selection = summary["selection"]
    assert selection["nsa"]["unit"] == "blocks" and selection["indexer"]["unit"] == "tokens"
    assert all(len(s["layers"]) == 2 and "map" not in s["layers"][0] for s in selection.values())
    assert set(selection["nsa"]["layers"][0]["gates"]) == {"cmp", "slc", "win"}
    # the indexer's selection on the validation text: every query selects min(6, t + 1) keys
    n_tokens = sum(selection["indexer"]["layers"][0]["counts"])
    assert n_tokens % sum(min(6, t + 1) for t in range(32)) == 0
    log = read_log(trained / "out" / "indexer")
    assert [r["indexer_stage"] for r in log if "indexer_stage" in r] == ["dense"] * 2 + ["sparse"] * 4
    table = (out / "summary.md").read_text()
    assert "## indexer: what indexer selected" in table and "## nsa: what nsa selected" in table
