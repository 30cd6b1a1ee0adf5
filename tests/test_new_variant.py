"""A variant describes itself once, in its class: a toy variant defined in this file alone
(registered in attention.VARIANTS for the test, as a new entry there would be) gets its plan
line, its FLOP count and its budget check, trains through train.py, and goes through
analyze.py's run names, gate figures and selection statistics, with no other file naming it.
A per-variant table anywhere on that path (a list of the variants that select, of each one's
flags, of the gates drawn over training) would leave the toy out, and this test fails."""
import json
import signal

import numpy as np
import pytest
import torch
import torch.nn as nn

import analyze
import attention
import config
import data
import flops
import train
from conftest import ENGLISH
from model import Model, ModelConfig

W = 4  # the toy's --window: its block, and its window
T = 32
BACK = (0, 2, 4)  # the blocks the toy selects: its own, and those 2 and 4 before it


class Strided(attention.CausalSelfAttention):
    """`toy`: two branches mixed by a gate per branch, head and token. 'sel' reads the blocks
    of W = cfg.window positions 0, 2 and 4 blocks back from the query's own (a selection of
    blocks, noted per query head); 'win' reads the window t - W .. t."""

    BRANCHES = ("sel", "win")
    DYNAMICS = (("gate_sel", "toy: the strided branch's gate per layer", False),)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.branch_gate = nn.Linear(cfg.d_model, 2 * cfg.n_head)

    def attend(self, q, k, v, x, q_start, k_start, cache=None):
        op, (B, H, T, _), W = self.ops(q.device), q.shape, self.cfg.window
        own = torch.arange(q_start, q_start + T, device=q.device)[:, None] // W  # (T, 1)
        blocks = own - torch.tensor(BACK, device=q.device)  # (T, 3) absolute block numbers
        blocks = blocks.masked_fill(blocks < 0, -1).expand(B, H, T, len(BACK)).contiguous()  # -1: empty
        out = {"sel": op.block_attention(q, k, v, self.scale, q_start, k_start, W, blocks),
               "win": op.attention(q, k, v, self.scale, q_start, k_start, window=W)}
        g = torch.sigmoid(self.branch_gate(x)).view(B, T, 2, H)  # (B, T, branch, H)
        for i, name in enumerate(self.BRANCHES):
            self.note(f"gate_{name}", g[:, :, i])
        self.note("selection", blocks)
        g = g.permute(0, 2, 3, 1).unsqueeze(-1)  # (B, branch, H, T, 1)
        return sum(g[:, i].to(out[name].dtype) * out[name] for i, name in enumerate(self.BRANCHES))

    @classmethod
    def settings(cls, cfg):
        return ("window",)

    @classmethod
    def selection_unit(cls, cfg):
        return cfg.window

    @classmethod
    def describe(cls, cfg, T):
        return f"toy: blocks of {cfg.window} 0, 2, 4 back and {cfg.window} keys back, of {T}", None

    @classmethod
    def check_budget(cls, cfg, T):
        if 4 * cfg.window >= T:
            raise ValueError(f"toy: --window={cfg.window}: a block 4 back lies before a {T}-token sequence")

    def attention_flops(self, T):
        W, t = self.cfg.window, torch.arange(T, dtype=torch.float64)
        earlier = sum(W * (torch.div(t, W, rounding_mode="floor") >= j) for j in BACK[1:])  # whole blocks
        return self.per_key() * (t % W + 1 + earlier + attention.causal_keys(t, W)).mean().item(), 0.0


def toy_keys_per_query(t):
    """What the toy computes scores for at position t, counted here without its class."""
    return t % W + 1 + sum(W for j in BACK[1:] if t // W >= j) + min(t + 1, W + 1)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(attention.VARIANTS, "toy", Strided)
    return Strided


@pytest.fixture(scope="module")
def byte_shards(tmp_path_factory):
    """Our own English sentences as byte shards (no tokenizer files needed)."""
    sentences = [s.strip() + "." for s in ENGLISH.split(". ") if s.strip()]
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.permutation(sentences)[: rng.integers(2, 6)]) for _ in range(120)]
    out = tmp_path_factory.mktemp("toy_shards")
    data.tokenize_to_shards(docs, str(out), "english", shard_tokens=10**6, val_tokens=2000, workers=1,
                            tokenizer="byte")
    return out


TRAIN = ["--model=tiny", f"--seq_len={T}", "--batch_size=4", "--total_batch_tokens=128", "--val_tokens=256",
         "--warmup_steps=1", "--max_steps=2", "--eval_every=1", "--eval_seqs=0", "--attn=toy", f"--window={W}"]


def run_train(argv):
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        train.main(argv)
    finally:
        for s, h in handlers.items():  # train.py installs its own stop handlers
            signal.signal(s, h)


def test_flops_and_budget_come_from_the_class(toy, capsys):
    cfg = ModelConfig(attn="toy", window=W, n_layer=2)
    model = Model(cfg)
    per_token = 3 * 4 * cfg.n_head * cfg.head_dim * np.mean([toy_keys_per_query(t) for t in range(T)])
    assert flops.flops_per_token(model, T) == pytest.approx(6 * flops.matmul_params(model) + cfg.n_layer * per_token)
    # its weights are counted once: the branch gate's Linear among them
    assert flops.matmul_params(model) > flops.matmul_params(Model(ModelConfig(attn="full", n_layer=2)))
    with pytest.raises(SystemExit):
        config.parse_args([*TRAIN, f"--window={T // 4}"])
    assert f"toy: --window={T // 4}: a block 4 back lies before a {T}-token sequence" in capsys.readouterr().err
    assert attention.show("toy").count("#") > T  # `python attention.py --show=toy`: one panel at its defaults


def test_a_new_variant_trains_and_is_analysed(toy, byte_shards, tmp_path, capsys):
    run = tmp_path / "toy"
    run_train([*TRAIN, f"--data_dir={byte_shards}", f"--out_dir={run}"])
    printed = capsys.readouterr().out
    assert f"window      toy: blocks of {W} 0, 2, 4 back and {W} keys back, of {T}" in printed
    model = Model(ModelConfig(attn="toy", window=W, vocab_size=256, n_layer=2))
    assert f"flops       {flops.describe(model, T)}" in printed
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r and "event" not in r]
    assert [r["step"] for r in steps] == [1, 2] and all(np.isfinite(r["loss"]) for r in steps)
    assert {"gate_sel", "gate_win"} <= set(steps[-1]["gates"])

    out = tmp_path / "analysis"
    analyze.main([str(run), f"--out_dir={out}"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"][0]["variant"] == f"toy (window={W})"  # its `settings`
    assert {"gates_toy.png", "dynamics_toy.png", "categories_toy.png", "selection_toy.png",
            "attention.png"} <= set(summary["figures"]), summary["notes"]
    assert set(summary["gate_by_category"]["toy"]) == {"gate_sel", "gate_win", "count"}

    # what it selected: blocks 0, 2 and 4 back, each as often as the queries (x heads) whose
    # block has one that far back, counted in its blocks of W
    selection = summary["selection"]["toy"]
    assert selection["unit"] == "blocks" and selection["block"] == W and selection["slots"] == len(BACK)
    H = ModelConfig().n_head
    for layer in selection["layers"]:
        n_seq = layer["counts"][0] // (H * T)  # every query head selects its own block once
        expected = [0] * (max(BACK) + 1)
        for t in range(T):
            for j in BACK:
                expected[j] += n_seq * H * (t // W >= j)
        assert n_seq > 0 and layer["counts"] == expected
        assert set(layer["gates"]) == {"sel", "win"}  # its BRANCHES' gates
    table = (out / "summary.md").read_text()
    assert "## toy: what toy selected" in table and "| gate sel | gate win |" in table
