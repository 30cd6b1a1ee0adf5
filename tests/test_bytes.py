"""The byte-level tokenizer (data.py's `--tokenizer=byte`): round trips, the shard folder's record of
its tokenizer, train.py's vocabulary from it, sample.py's decoding, the unigram baseline.

Needs no GPT-2 files: byte shards are made without tiktoken."""
import json
import math
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from conftest import CORPUS, ENGLISH, ROOT, requires_corpus
from model import read_checkpoint
import data
import sample

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# Multibyte characters of every UTF-8 length (2, 3 and 4 bytes) beside ASCII.
MIXED = "naïve café, Ελληνικά, 日本語, emoji 🙂🚀 and a tab\there.\n"


def write_jsonl(path, docs):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")


@pytest.fixture(scope="module")
def byte_shards(tmp_path_factory):
    """Our own English sentences (plus the multibyte line), shuffled into 200 documents,
    through `python data.py --tokenizer=byte` as a user would run it."""
    sentences = [s.strip() + "." for s in ENGLISH.split(". ") if s.strip()] + [MIXED]
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.permutation(sentences)[: rng.integers(2, 6)]) for _ in range(200)]
    tmp = tmp_path_factory.mktemp("bytes")
    write_jsonl(tmp / "docs.jsonl", docs)
    out = tmp / "shards"
    r = subprocess.run([sys.executable, str(ROOT / "data.py"), "--tokenizer=byte",
                        f"--source={tmp / 'docs.jsonl'}", f"--out_dir={out}", "--val_tokens=4000",
                        "--workers=1"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return out, docs, r.stdout


def test_bytes_round_trip_any_utf8():
    rng = np.random.default_rng(0)
    # Random code points of every UTF-8 length, surrogates (not encodable) left out.
    points = [p for p in rng.integers(1, 0x110000, size=3000) if not 0xD800 <= p < 0xE000]
    texts = [MIXED, "", "\x00inside", "".join(map(chr, points))]
    for text in texts:
        tokens = data.encode_bytes(text)
        assert tokens.dtype == np.uint16 and len(tokens) == len(text.encode("utf-8"))
        assert int(tokens.max(initial=0)) < 256
        assert data.decode_bytes(tokens) == text
    assert data.encode_bytes("é").tolist() == [0xC3, 0xA9]  # two bytes, two tokens


def test_shards_hold_each_document_after_a_nul(byte_shards):
    out, docs, _ = byte_shards
    val = np.asarray(data.load_shard(data.find_shards(out, "val")[0])).tolist()
    train = [t for p in data.find_shards(out, "train") for t in np.asarray(data.load_shard(p)).tolist()]
    encoded = [[data.BYTE_EOT] + list(d.encode("utf-8")) for d in docs]
    # The val shard holds whole documents up to 4000 bytes, the one crossing it cut there and
    # its rest dropped; training starts with the next document.
    ends = np.cumsum([len(e) for e in encoded])
    crossing = int(np.searchsorted(ends, 4000, side="left"))
    assert len(val) == 4000 and val == [t for e in encoded[: crossing + 1] for t in e][:4000]
    assert train == [t for e in encoded[crossing + 1:] for t in e]


def test_folder_records_its_tokenizer(byte_shards, tmp_path):
    out, _, _ = byte_shards
    assert json.loads((out / data.TOKENIZER_FILE).read_text()) == {"name": "byte", "vocab_size": 256}
    assert data.tokenizer_of(out) == ("byte", 256)
    # A folder without the record holds GPT-2 tokens (public shards, older folders).
    assert data.tokenizer_of(tmp_path) == ("gpt2", 50257)
    (tmp_path / data.TOKENIZER_FILE).write_text("{not json")
    with pytest.raises(data.ShardError, match="tokenizer.json.*re-create"):
        data.tokenizer_of(tmp_path)


def test_recall_folder_records_its_ids(tmp_path):
    assert data.main(["--source=recall", f"--out_dir={tmp_path}", "--max_tokens=20000",
                      "--recall=64,8,16,0"]) == 0
    assert data.tokenizer_of(tmp_path) == ("recall", 24)
    assert data.main(["--source=recall", "--tokenizer=byte", f"--out_dir={tmp_path}"]) == 1


def test_unigram_loss_equals_a_hand_computation(tmp_path):
    train, val = [1, 1, 1, 2, 0, 3], [1, 2, 2, 255]
    data.write_shard(tmp_path / "t_val_000000.bin", np.array(val, dtype=np.uint16))
    data.write_shard(tmp_path / "t_train_000001.bin", np.array(train, dtype=np.uint16))
    data.write_tokenizer(tmp_path, "byte", 256)
    counts = Counter(train)
    # add-one smoothing over the 256 byte values: p(v) = (count + 1) / (6 + 256)
    by_hand = -sum(math.log((counts[v] + 1) / (len(train) + 256)) for v in val) / len(val)
    assert data.unigram_loss(tmp_path) == pytest.approx(by_hand, rel=1e-12)
    first_two = -(math.log(4 / 262) + math.log(2 / 262)) / 2
    assert data.unigram_loss(tmp_path, val_tokens=2) == pytest.approx(first_two, rel=1e-12)


def test_data_py_prints_the_baseline(byte_shards):
    out, _, stdout = byte_shards
    line = [l for l in stdout.splitlines() if l.startswith("unigram baseline")]
    assert len(line) == 1 and f"{data.unigram_loss(out):.4f} nats per byte" in line[0], stdout


def train(*args):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=180)


TINY = ["--model=tiny", "--seq_len=32", "--batch_size=4", "--total_batch_tokens=128",
        "--val_tokens=256", "--warmup_steps=2", "--max_steps=4", "--eval_every=2"]


@pytest.fixture(scope="module")
def byte_run(byte_shards, tmp_path_factory):
    """A dsa run on the byte shards (windows inside the 32-byte sequence), the run that the
    vocabulary, sampling and analyze.py tests read (one train.py run for the three)."""
    out, _, _ = byte_shards
    run = tmp_path_factory.mktemp("run") / "bytes"
    r = train(*TINY, "--attn=dsa", "--window=8", "--dsa_threshold=16", f"--data_dir={out}", f"--out_dir={run}")
    assert r.returncode == 0, r.stderr[-2000:]
    return run


def test_train_takes_the_vocabulary_from_the_folder(byte_run, byte_shards, tmp_path):
    config = json.loads((byte_run / "config.json").read_text())
    assert config["model"]["vocab_size"] == 256 and config["tokenizer"] == "byte"
    ckpt = read_checkpoint(byte_run)
    assert ckpt["tokenizer"] == "byte" and ckpt["model"]["embed_tokens.weight"].shape[0] == 256
    # An explicit --vocab_size wins, but one too small for the recorded ids is refused.
    out, _, _ = byte_shards
    r = train(*TINY, "--max_steps=1", "--vocab_size=320", f"--data_dir={out}", f"--out_dir={tmp_path / 'a'}")
    assert r.returncode == 0 and json.loads((tmp_path / "a" / "config.json").read_text())["model"]["vocab_size"] == 320
    r = train(*TINY, "--vocab_size=100", f"--data_dir={out}", f"--out_dir={tmp_path / 'b'}")
    assert r.returncode != 0 and "--vocab_size=100" in r.stderr and "256 token ids" in r.stderr, r.stderr


def test_sample_decodes_bytes(byte_run, capsys):
    encode, decode, start = sample.text_codec("byte")
    assert encode(MIXED) == list(MIXED.encode("utf-8")) and decode(encode(MIXED)) == MIXED
    # A model may emit bytes that are not UTF-8: replaced, never an exception.
    assert decode([0xFF, ord("h"), 0xC3, ord("i"), 0xE6, 0x97]) == "\ufffdh\ufffdi\ufffd"
    assert start == data.BYTE_EOT and decode([start, ord("a")]) == "\na"  # a document start shows as a line break
    with pytest.raises(sample.CheckpointError, match="recall"):
        sample.text_codec("recall")
    sample.main([f"--ckpt={byte_run}", "--prompt=The café", "--max_new_tokens=30", "--seed=3"])
    text = capsys.readouterr().out.split("\n---\n")[0]
    assert text.startswith("The café") and len(text.encode("utf-8")) >= len("The café".encode()) + 10


@requires_corpus
def test_byte_baseline_of_the_corpus_is_a_few_nats(tmp_path):
    """English bytes: about 3.3 nats of unigram entropy (measured 3.27 on this corpus), far
    below the ln 256 = 5.55 of uniform bytes: the number a trained model must beat."""
    with open(CORPUS / "fineweb_legalpilot_val.jsonl") as f:
        docs = [json.loads(next(f))["text"] for _ in range(40)]
    data.tokenize_to_shards(docs, str(tmp_path), "fw", shard_tokens=10**6, val_tokens=20000,
                            workers=1, tokenizer="byte")
    assert 2.8 < data.unigram_loss(tmp_path) < 3.6


def test_analyze_reads_a_byte_run_as_bytes_without_gpt2(byte_shards, byte_run, tmp_path, monkeypatch):
    """analyze.py's gate-by-category figure decodes a byte run's tokens as bytes (GPT-2's BPE
    is never loaded: here it cannot be), and a run read as GPT-2 while the BPE files cannot
    be loaded gets one note, not a traceback, and still its attention map."""
    import shutil

    import analyze
    import tiktoken

    def offline(name):
        raise ConnectionError("Name or service not known")  # what requests raises offline: an OSError

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    out, _, _ = byte_shards
    run = tmp_path / "dsa"
    shutil.copytree(byte_run, run)  # a copy: its config.json is edited below
    analyze.main([str(run), f"--out_dir={tmp_path / 'a'}", "--n_tokens=512"])
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    counts = summary["gate_by_category"]["dsa"]["count"]
    # our sentences' bytes: capital letters start them, full stops end them
    assert counts["capitalised"] > 0 and counts["punctuation"] > 0 and sum(counts.values()) > 0
    assert "categories_dsa.png" in summary["figures"]
    # the same run, its data folder without tokenizer.json: read as GPT-2, which cannot load
    unlabelled = tmp_path / "unlabelled"
    shutil.copytree(out, unlabelled)
    (unlabelled / data.TOKENIZER_FILE).unlink()
    config = json.loads((run / "config.json").read_text())
    config["train"]["data_dir"] = str(unlabelled)
    (run / "config.json").write_text(json.dumps(config))
    analyze.main([str(run), f"--out_dir={tmp_path / 'b'}", "--n_tokens=512"])
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert sum("BPE files could not be loaded" in n for n in summary["notes"]) == 1, summary["notes"]
    assert "attention.png" in summary["figures"] and "categories_dsa.png" not in summary["figures"]
