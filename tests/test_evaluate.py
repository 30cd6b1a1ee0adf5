"""evaluate.py: loss by position against a loop over positions written here, bits per byte
against the text's own UTF-8 length, HellaSwag's acc and acc_norm against a stub model with a
known preference (on our own fixture items, offline), the download's checks with a fake
server, and the command line on a tiny checkpoint."""
import io
import json
import math
import urllib.request
from dataclasses import asdict

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import data
import evaluate
from conftest import ENGLISH, ROOT, requires_gpt2
from model import Model, ModelConfig, save_checkpoint

FIXTURE = ROOT / "tests" / "fixtures" / "hellaswag_tiny.jsonl"
TINY_BYTES = dict(n_layer=1, n_head=2, n_kv_head=2, head_dim=8, d_model=16, mlp_hidden=32, vocab_size=256)


class Unigram(nn.Module):
    """A stub language model: the same next-token log-probabilities at every position,
    whatever the context (`log_p` (V,))."""

    def __init__(self, log_p):
        super().__init__()
        self.log_p = log_p

    def forward(self, idx, targets=None):
        return self.log_p.expand(*idx.shape, -1).clone(), None  # (B, T, V)


def favouring(chars, weight=3.0, V=256):
    """A byte-level Unigram stub that prefers the bytes of `chars` (logit `weight`, others 0)."""
    w = torch.zeros(V)
    w[list(chars.encode())] = weight
    return Unigram(torch.log_softmax(w, 0))


def test_position_buckets_are_powers_of_two_up_to_T():
    assert evaluate.position_buckets(1) == [(1, 1)]
    assert evaluate.position_buckets(3) == [(1, 1), (2, 3)]
    assert evaluate.position_buckets(12) == [(1, 1), (2, 3), (4, 7), (8, 12)]
    assert evaluate.position_buckets(16) == [(1, 1), (2, 3), (4, 7), (8, 16)]  # 16 alone joins 8-15
    assert evaluate.position_buckets(100)[-2:] == [(32, 63), (64, 100)]


def test_loss_by_position_equals_a_loop_over_sequences_and_positions():
    torch.manual_seed(0)
    model = Model(ModelConfig(**TINY_BYTES)).eval()
    L, n = 12, 5
    tokens = np.random.default_rng(0).integers(1, 256, size=n * L + 7)
    r = evaluate.loss_by_position(model, tokens, L, n_seq=n, batch_size=2)
    # The loop: each sequence on its own, position p = tokens of context = index + 1.
    per_pos = np.zeros((n, L))
    for i in range(n):
        seq = torch.tensor(tokens[i * L: i * L + L + 1])
        with torch.no_grad():
            logits = model(seq[None, :-1])[0][0]
        for t in range(L):
            per_pos[i, t] = F.cross_entropy(logits[t], seq[t + 1]).item()
    buckets = {(1, 1): [1], (2, 3): [2, 3], (4, 7): [4, 5, 6, 7], (8, 12): [8, 9, 10, 11, 12]}
    assert [(b["first"], b["last"]) for b in r["buckets"]] == list(buckets)
    t975_df4 = 2.776
    for b, positions in zip(r["buckets"], buckets.values()):
        per_seq = per_pos[:, [p - 1 for p in positions]].mean(axis=1)  # (n,)
        assert b["mean"] == pytest.approx(per_seq.mean(), abs=1e-5)
        assert b["ci95"] == pytest.approx(t975_df4 * per_seq.std(ddof=1) / math.sqrt(n), rel=1e-3)
    assert r["n_seq"] == n and r["nats_per_token"] == pytest.approx(per_pos.mean(), abs=1e-5)
    # A length the stream cannot fill twice is skipped, saying why.
    skipped = evaluate.loss_by_position(model, tokens, 40, n_seq=n)
    assert "skipped" in skipped and "fewer than 2 sequences" in skipped["skipped"]


def bits_per_byte_case(encode, eos, text, vocab, tokenizer):
    """A stream of k documents, each the document separator then `text`; sequences of L
    cover all of it, so the targets are everything after the first separator."""
    doc = [eos] + encode(text)
    k = 4
    stream = np.array(doc * k + [eos])
    L = (len(stream) - 1) // 2
    stream = stream[: 2 * L + 1]
    log_p = torch.zeros(vocab)  # uniform: every target costs ln V nats
    uni = np.log(np.arange(1, vocab + 1) / np.arange(1, vocab + 1).sum())
    r = evaluate.loss_by_position(Unigram(log_p), stream, L, n_seq=2,
                                  bytes_per_token=evaluate.token_bytes(tokenizer, vocab), unigram_log_p=uni)
    targets = stream[1:]
    text_targets = targets[targets != eos]
    n_bytes = (len(targets) - (targets == eos).sum()) // len(encode(text)) * len(text.encode("utf-8"))
    assert r["bytes"] == n_bytes
    assert r["bits_per_byte"] == pytest.approx(len(text_targets) * math.log(vocab) / n_bytes / math.log(2))
    assert r["unigram_bits_per_byte"] == pytest.approx(-uni[text_targets].sum() / n_bytes / math.log(2))
    assert r["unigram_nats_per_token"] == pytest.approx(-uni[targets].mean())
    return r


TEXT = "Café crème, naïve façade — 東京 and Zürich. "  # multi-byte characters: bytes != characters


def test_bits_per_byte_of_the_byte_tokenizer_counts_one_byte_a_token():
    r = bits_per_byte_case(lambda s: list(s.encode("utf-8")), data.BYTE_EOT, TEXT, 256, "byte")
    assert r["bits_per_byte"] == pytest.approx(math.log(256) / math.log(2))  # 8 bits: uniform over bytes


@requires_gpt2
def test_bits_per_byte_of_gpt2_counts_each_tokens_utf8_bytes():
    import tiktoken

    enc = tiktoken.get_encoding("gpt2")
    tokens = enc.encode_ordinary(TEXT)
    counts = evaluate.token_bytes("gpt2", 50304)
    assert counts[tokens].sum() == len(TEXT.encode("utf-8")) > len(tokens)  # tokens cut characters: still exact
    assert counts[data.EOT] == 0 and counts[50257:].sum() == 0  # no text: the separator and the padding
    bits_per_byte_case(enc.encode_ordinary, data.EOT, TEXT, 50304, "gpt2")


def test_tokens_without_text_get_no_bits_per_byte():
    assert evaluate.token_bytes("recall", 96) is None
    with pytest.raises(evaluate.EvalError, match="no text"):
        evaluate.encoder("recall")


# ----------------------------------------------------------------------------- HellaSwag

def stub_sums_and_means(stub, item):
    """The stub's summed and mean loss of each ending, computed here from its table."""
    sums, means = [], []
    for ending in item["endings"]:
        costs = [-stub.log_p[b].item() for b in (" " + ending).encode()]
        sums.append(sum(costs))
        means.append(sum(costs) / len(costs))
    return sums, means


def test_hellaswag_picks_the_stubs_preferred_ending_and_acc_differs_from_acc_norm():
    items = evaluate.read_items(FIXTURE)[:3]
    stub = favouring("a ")
    sums, means = stub_sums_and_means(stub, items[0])
    # The construction: item 0's label (a long ending of cheap bytes) has the least mean but
    # not the least sum; items 1 and 2 have one cheap ending, the label of 1 and not of 2.
    assert int(np.argmin(means)) == items[0]["label"] != int(np.argmin(sums))
    r = evaluate.hellaswag(stub, items, "byte", batch_items=2)
    assert r["items"] == 3
    assert r["acc"] == pytest.approx(1 / 3)  # item 1 only
    assert r["acc_norm"] == pytest.approx(2 / 3)  # items 0 and 1
    # A stub preferring what item 2's label is made of picks it (and nothing else).
    r = evaluate.hellaswag(favouring("efg", weight=6.0), items[2:], "byte")
    assert r["acc"] == r["acc_norm"] == 1.0


def test_batched_ending_losses_equal_each_ending_scored_alone():
    torch.manual_seed(0)
    model = Model(ModelConfig(**TINY_BYTES)).eval()
    items = evaluate.read_items(FIXTURE)
    encode = evaluate.encoder("byte")
    rows, masks = [], []
    for item in items:
        r, m, _ = evaluate.render(item, encode, max_len=64)
        rows += r
        masks += m
    summed, mean = evaluate.ending_losses(model, rows, masks)  # one padded batch of 24 rows
    for i, item in enumerate(items):
        for j, ending in enumerate(item["endings"]):
            end = encode(" " + ending)
            ctx_j = encode(item["ctx"])[-max(1, 64 - len(end)):]
            seq = torch.tensor(ctx_j + end)
            with torch.no_grad():
                logits = model(seq[None, :-1])[0][0]
            losses = F.cross_entropy(logits, seq[1:], reduction="none")[-len(end):]  # the ending's tokens
            assert summed[4 * i + j].item() == pytest.approx(losses.sum().item(), rel=1e-5)
            assert mean[4 * i + j].item() == pytest.approx(losses.mean().item(), rel=1e-5)
    # The batched accuracy equals the argmins of those per-ending losses.
    r = evaluate.hellaswag(model, items, "byte", max_len=64, batch_items=4)
    labels = torch.tensor([item["label"] for item in items])
    assert r["acc"] == pytest.approx((summed.view(-1, 4).argmin(1) == labels).float().mean().item())
    assert r["acc_norm"] == pytest.approx((mean.view(-1, 4).argmin(1) == labels).float().mean().item())


def test_a_long_context_loses_its_first_tokens_never_the_endings():
    item = {"ctx": "x" * 50, "endings": ["ab", "abcd", "a", "abc"], "label": 0}
    rows, masks, cut = evaluate.render(item, evaluate.encoder("byte"), max_len=20)
    assert cut and all(len(r) == 20 for r in rows)
    assert [sum(m) for m in masks] == [3, 5, 2, 4]  # " " + the ending, whole


def test_ranks_split_the_items_and_their_counts_add_up(tmp_path):
    """Three ranks' shares, each scored through the all-reduce path (a one-process gloo
    group, so the all-reduce returns each share's own counts), add up to the whole."""
    import torch.distributed as dist

    items = evaluate.read_items(FIXTURE)
    stub = favouring("a ")
    whole = evaluate.hellaswag(stub, items, "byte")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        shares = [evaluate.hellaswag(stub, items, "byte", rank=rank, world=3) for rank in range(3)]
    finally:
        dist.destroy_process_group()
    assert [s["items"] for s in shares] == [2, 2, 2]
    assert sum(s["items"] for s in shares) == whole["items"] == len(items)
    for key in ("acc", "acc_norm"):
        assert sum(s[key] * s["items"] for s in shares) == pytest.approx(whole[key] * len(items))
    # item 0 (acc wrong, acc_norm right) is rank 0's; item 1 (both right) rank 1's; item 2 rank 2's
    assert (shares[0]["acc"], shares[0]["acc_norm"]) == (0.0, 0.5)


def test_a_tokenizer_that_cannot_render_the_task_is_one_clear_error():
    small = Model(ModelConfig(**{**TINY_BYTES, "vocab_size": 64})).eval()
    with pytest.raises(evaluate.EvalError, match="ids up to 255, beyond the model.s vocabulary of 64"):
        evaluate.hellaswag(small, evaluate.read_items(FIXTURE)[:1], "byte")
    with pytest.raises(evaluate.EvalError, match="'recall' tokens"):
        evaluate.hellaswag(small, evaluate.read_items(FIXTURE)[:1], "recall")


def test_the_download_is_checked_recorded_and_verified(tmp_path, monkeypatch):
    served = FIXTURE.read_bytes()
    calls = []

    def fake_urlopen(url, timeout):
        calls.append(url)
        return io.BytesIO(served)

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    monkeypatch.setattr(evaluate, "HELLASWAG_ITEMS", 6)  # the fixture's size stands in for 10,042
    items = evaluate.hellaswag_items(tmp_path)
    assert len(items) == 6 and calls == [evaluate.HELLASWAG_URL]
    record = tmp_path / "hellaswag_val.jsonl.sha256"
    assert record.read_text().strip() == evaluate.sha256_of(tmp_path / "hellaswag_val.jsonl")
    assert evaluate.hellaswag_items(tmp_path) == items and len(calls) == 1  # cached: no second download
    # A changed file is refused, naming the fix.
    with open(tmp_path / "hellaswag_val.jsonl", "ab") as f:
        f.write(b"\n")
    with pytest.raises(evaluate.EvalError, match="SHA-256 .* differs"):
        evaluate.hellaswag_items(tmp_path)
    # A download cut short (5 of 6 items) is refused and not kept.
    fresh = tmp_path / "fresh"
    served = b"".join(FIXTURE.read_bytes().splitlines(keepends=True)[:5])
    with pytest.raises(evaluate.EvalError, match="5 items, expected 6"):
        evaluate.hellaswag_items(fresh)
    assert not (fresh / "hellaswag_val.jsonl").exists()

    def offline(url, timeout):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(evaluate.EvalError, match="cannot download HellaSwag"):
        evaluate.hellaswag_items(tmp_path / "offline")


def test_a_malformed_item_names_its_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(FIXTURE.read_text().splitlines()[0] + "\n" + json.dumps({"ctx": "x", "endings": ["a"], "label": 0}) + "\n")
    with pytest.raises(evaluate.EvalError, match=r"bad.jsonl:2: not a HellaSwag item"):
        evaluate.read_items(bad)


# ----------------------------------------------------------------------------- the command line

def test_command_line_on_a_checkpoint_writes_eval_json(tmp_path, capsys):
    shards = tmp_path / "bytes"
    shards.mkdir()
    stream = np.concatenate([[data.BYTE_EOT], data.encode_bytes(ENGLISH * 8)]).astype(np.uint16)
    data.write_shard(str(shards / "t_val_000000.bin"), stream[:500])  # sequences of 64 + 1: 7, of 128: 3, of 256: 1
    data.write_shard(str(shards / "t_train_000001.bin"), stream[700:])
    data.write_tokenizer(str(shards), "byte", 256)
    torch.manual_seed(0)
    model = Model(ModelConfig(**TINY_BYTES))
    run = tmp_path / "run"
    run.mkdir()
    save_checkpoint(str(run / "ckpt.pt"), {"model": model.state_dict(), "model_config": asdict(model.cfg),
                                           "train_config": {"seq_len": 64, "data_dir": str(shards)}, "step": 7,
                                           "tokenizer": "byte"})
    code = evaluate.main([f"--ckpt={run}", "--n_seq=3", "--hellaswag=True", f"--hellaswag_file={FIXTURE}"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    record = json.loads((run / "eval.json").read_text())
    lengths = {r["seq_len"]: r for r in record["positions"]}
    assert sorted(lengths) == [64, 128, 256]
    assert lengths[64]["n_seq"] == lengths[128]["n_seq"] == 3
    assert "fewer than 2 sequences" in lengths[256]["skipped"]
    assert record["bits_per_byte"] is not None and record["unigram"]["bits_per_byte"] > 0
    assert record["hellaswag"]["items"] == 6 and record["step"] == 7
    assert "hellaswag: acc" in printed and "length 256 (4x): skipped" in printed


def test_offline_gpt2_bpe_skips_bits_per_byte_but_keeps_loss_by_position(tmp_path, monkeypatch):
    """A run's final evaluation must not crash the finished run when tiktoken cannot fetch
    GPT-2's BPE files (no internet): loss by position is still recorded, bits per byte is not,
    and one line says why and what to do."""
    shards = tmp_path / "gpt2"
    shards.mkdir()
    rng = np.random.default_rng(0)
    data.write_shard(str(shards / "t_val_000000.bin"), rng.integers(1, 256, 600).astype(np.uint16))
    data.write_tokenizer(str(shards), "gpt2", 50257)  # ids < 256 suffice for the stub model

    def offline(*args):
        raise ConnectionError("Name or service not known")  # what requests raises: an OSError

    monkeypatch.setattr(evaluate, "token_bytes", offline)
    lines = []
    torch.manual_seed(0)
    model = Model(ModelConfig(**{**TINY_BYTES, "vocab_size": 50257}))  # GPT-2's ids
    record = evaluate.evaluate_model(model, data_dir=str(shards), tokenizer="gpt2", trained_len=64, n_seq=2,
                                     log=lines.append)
    assert record["positions"][0]["n_seq"] == 2 and record["nats_per_token"] > 0
    assert record["bits_per_byte"] is None
    assert sum("bits per byte: skipped" in line and "TIKTOKEN_CACHE_DIR" in line for line in lines) == 1


def test_a_byte_model_on_a_folder_read_as_gpt2_gets_no_wrong_bits_per_byte(tmp_path):
    """A folder without tokenizer.json is read as GPT-2 tokens (data.tokenizer_of); a model that
    embeds only 256 ids cannot have been trained on them, so bits per byte (which would count
    each id's GPT-2 text) is skipped with one line naming the missing record; the loss by
    position is still kept."""
    shards = tmp_path / "unlabelled"
    shards.mkdir()
    rng = np.random.default_rng(0)
    data.write_shard(str(shards / "t_val_000000.bin"), rng.integers(1, 256, 600).astype(np.uint16))
    assert data.tokenizer_of(str(shards))[0] == "gpt2"
    lines = []
    torch.manual_seed(0)
    model = Model(ModelConfig(**TINY_BYTES))
    record = evaluate.evaluate_model(model, data_dir=str(shards), tokenizer="gpt2", trained_len=64, n_seq=2,
                                     log=lines.append)
    assert record["positions"][0]["n_seq"] == 2 and record["nats_per_token"] > 0
    assert record["bits_per_byte"] is None
    assert sum("bits per byte: skipped" in line and "tokenizer.json" in line for line in lines) == 1
