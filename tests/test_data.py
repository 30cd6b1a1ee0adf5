"""data.py: shard format, sources, header checks, and the DDP-invariant loader."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import tiktoken
import torch

from conftest import CORPUS, ENGLISH, HAVE_GPT2, ROOT, requires_corpus, requires_gpt2
import data
from data import EOT, DistributedLoader, ShardError, ValLoader, load_shard, write_shard

# Shards are tokenized with GPT-2's BPE: without its files these tests cannot run.
pytestmark = requires_gpt2

enc = tiktoken.get_encoding("gpt2") if HAVE_GPT2 else None


def documents(n, seed=0):
    """n short English documents made of our own sentences in varying orders."""
    sentences = [s.strip() + "." for s in ENGLISH.split(". ") if s.strip()]
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(sentences, size=rng.integers(1, 5))) for _ in range(n)]


def expected_stream(docs):
    out = []
    for d in docs:
        out += [EOT] + enc.encode_ordinary(d)
    return out


def shard_tokens_of(out_dir, split):
    return [np.asarray(load_shard(p)).tolist() for p in data.find_shards(out_dir, split)]


def test_local_sources_tokenize_to_llmc_shards(tmp_path, english_text):
    """jsonl + txt + parquet -> one stream; EOT before every document; val shard first."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = documents(30)
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "a.jsonl", "w") as f:
        for d in docs[:10]:
            f.write(json.dumps({"text": d, "id": 1}) + "\n")
    pq.write_table(pa.table({"text": docs[10:20]}), src / "b.parquet")
    (src / "c.txt").write_text(english_text)  # a .txt file is one document
    out = tmp_path / "shards"
    rc = data.main([f"--source={src}/*", f"--out_dir={out}", "--val_tokens=50",
                    "--shard_tokens=100", "--workers=2"])
    assert rc == 0
    names = sorted(os.listdir(out))
    assert names[0] == "text_train_000001.bin" and "text_val_000000.bin" in names
    # Header: magic, version, count, then uint16.
    header = np.fromfile(out / "text_val_000000.bin", dtype=np.int32, count=256)
    assert header[:3].tolist() == [20240520, 1, 50]
    val, train = shard_tokens_of(out, "val"), shard_tokens_of(out, "train")
    assert [len(t) for t in train[:-1]] == [100] * (len(train) - 1)
    stream = expected_stream(docs[:20] + [english_text])
    # The document crossing the val limit is cut there and its rest dropped (no overlap).
    first_train_doc = stream.index(EOT, 50)
    assert val[0] == stream[:50]
    assert sum(train, []) == stream[first_train_doc:]
    assert enc.decode(sum(train, [])).endswith(english_text)


def test_max_tokens_and_val_source(tmp_path):
    docs = documents(200, seed=1)
    train_file, val_file = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train_file.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    val_file.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(5, seed=2)))
    out = tmp_path / "shards"
    assert data.main([f"--source={train_file}", f"--val_source={val_file}", f"--out_dir={out}",
                      "--max_tokens=1000", "--val_tokens=10000", "--workers=2"]) == 0
    val, train = shard_tokens_of(out, "val"), shard_tokens_of(out, "train")
    assert val[0] == expected_stream(documents(5, seed=2))  # the whole val file fits
    assert len(val[0]) + sum(map(len, train)) == 1000  # max_tokens counts val too
    assert sum(train, []) == expected_stream(docs)[: 1000 - len(val[0])]


def test_public_fineweb_gpt2_layout_loads(tmp_path):
    """Shards written the way modded-nanogpt / llm.c write them load unchanged."""
    rng = np.random.default_rng(0)
    for name in ("fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"):
        toks = rng.integers(0, 50257, size=700, dtype=np.uint16)
        with open(tmp_path / name, "wb") as f:
            f.write(struct.pack("<256i", 20240520, 1, len(toks), *([0] * 253)))
            f.write(toks.tobytes())
        assert np.array_equal(load_shard(tmp_path / name), toks)
    assert len(data.find_shards(tmp_path, "train")) == 2
    loader = DistributedLoader(tmp_path, B=2, T=64, seed=0)
    assert loader.n_seq == 2 * (699 // 64)


@pytest.mark.parametrize("damage, words", [
    ("truncate", ["truncated shard", "header says 100 tokens"]),
    ("magic", ["bad magic number 12345", "expected 20240520"]),
    ("version", ["unsupported shard version 7"]),
    ("tiny", ["truncated shard", "shorter than the 1024-byte header"]),
])
def test_bad_shard_names_file_problem_and_fix(tmp_path, damage, words):
    path = tmp_path / "x_train_000001.bin"
    write_shard(path, np.arange(100, dtype=np.uint16))
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[:-10]
    elif damage == "magic":
        raw[0:4] = struct.pack("<i", 12345)
    elif damage == "version":
        raw[4:8] = struct.pack("<i", 7)
    else:
        raw = raw[:100]
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardError) as e:
        load_shard(path)
    msg = str(e.value)
    assert str(path) in msg and "python data.py" in msg
    for w in words:
        assert w in msg


def test_empty_or_missing_folder(tmp_path):
    for folder in (tmp_path, tmp_path / "nope"):
        with pytest.raises(ShardError, match="python data.py") as e:
            DistributedLoader(folder, B=2, T=8)
        assert str(folder) in str(e.value)
    # A prefix containing "_train" must not make a val shard look like a train shard.
    write_shard(tmp_path / "my_train_val_000000.bin", np.arange(50, dtype=np.uint16))
    with pytest.raises(ShardError, match="no train shards"):
        data.find_shards(tmp_path, "train")


@pytest.fixture(scope="module")
def numbered_shards(tmp_path_factory):
    """Tokens 0..N-1 (mod 2^16) in two train shards and a val shard: positions are readable."""
    d = tmp_path_factory.mktemp("numbered")
    write_shard(d / "n_val_000000.bin", np.arange(40000, 40000 + 2000, dtype=np.uint16))
    write_shard(d / "n_train_000001.bin", np.arange(0, 1001, dtype=np.uint16))
    write_shard(d / "n_train_000002.bin", np.arange(2000, 2000 + 645, dtype=np.uint16))
    return d


def test_ddp_ranks_see_what_grad_accumulation_sees(numbered_shards):
    B, T = 3, 16
    single = DistributedLoader(numbered_shards, B, T, seed=5)
    ranks = [DistributedLoader(numbered_shards, B, T, rank=r, world_size=2, seed=5) for r in range(2)]
    seen = []
    for _ in range(20):  # crosses an epoch boundary (n_seq = 62 + 40 = 102 -> 17 steps of 6)
        micro = [single.next_batch() for _ in range(2)]  # accumulation 2 on one process
        per_rank = [r.next_batch() for r in ranks]  # accumulation 1 on two ranks
        for (x1, y1), (x2, y2) in zip(micro, per_rank):
            assert x1.dtype == torch.int64 and x1.shape == (B, T)
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
            assert torch.equal(x1[:, 1:], y1[:, :-1])  # y is x shifted by one
            assert torch.all(y1 - x1 == 1)  # consecutive tokens, never across a shard
        seen += [int(x[b, 0]) for x, _ in micro for b in range(B)]
    assert single.n_seq == 1000 // T + 644 // T
    first_epoch = seen[: (single.n_seq // (2 * B)) * 2 * B]
    assert len(set(first_epoch)) == len(first_epoch)  # no sequence twice in an epoch
    assert seen != sorted(seen)  # shuffled
    other = DistributedLoader(numbered_shards, B, T, seed=6).next_batch()[0]
    assert not torch.equal(other, DistributedLoader(numbered_shards, B, T, seed=5).next_batch()[0])


def test_loader_position_round_trips(numbered_shards):
    a = DistributedLoader(numbered_shards, 4, 16, seed=1)
    for _ in range(30):  # past an epoch boundary
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # plain data
    expected = [a.next_batch()[0] for _ in range(5)]
    b = DistributedLoader(numbered_shards, 4, 16, seed=1)
    b.load_state_dict(state)
    assert all(torch.equal(e, b.next_batch()[0]) for e in expected)
    with pytest.raises(ShardError, match="--seq_len"):
        DistributedLoader(numbered_shards, 4, 32, seed=1).load_state_dict(state)


def test_val_loader_is_fixed_and_split_across_ranks(numbered_shards):
    one = list(ValLoader(numbered_shards, B=2, T=10, n_tokens=400))
    assert len(one) == 20 and torch.equal(one[0][0][0], torch.arange(40000, 40010))
    two = [list(ValLoader(numbered_shards, B=1, T=10, n_tokens=400, rank=r, world_size=2)) for r in range(2)]
    for k, (x, y) in enumerate(one):
        assert torch.equal(x, torch.cat([two[0][k][0], two[1][k][0]]))
        assert torch.equal(y[:, :-1], x[:, 1:])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(one, ValLoader(numbered_shards, 2, 10, 400)))
    with pytest.raises(ShardError, match="fewer than one global val batch"):
        ValLoader(numbered_shards, B=100, T=100, n_tokens=10**6)


@requires_corpus
def test_cli_on_a_corpus_slice(tmp_path):
    """The command line on real FineWeb text (a slice: the first 40 documents)."""
    lines = (CORPUS / "fineweb_legalpilot_train.jsonl").read_text().splitlines()[:40]
    (tmp_path / "slice.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "shards"
    r = subprocess.run([sys.executable, str(ROOT / "data.py"), f"--source={tmp_path}/slice.jsonl",
                        f"--out_dir={out}", "--val_tokens=2000", "--shard_tokens=20000"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    texts = [json.loads(l)["text"] for l in lines]
    total = sum(1 + len(enc.encode_ordinary(t)) for t in texts)
    got = sum(map(len, shard_tokens_of(out, "val") + shard_tokens_of(out, "train")))
    first_cut = expected_stream(texts).index(EOT, 2000)  # the cut document's rest is dropped
    assert got == total - (first_cut - 2000)
    r = subprocess.run([sys.executable, str(ROOT / "data.py"), f"--source={tmp_path}/none*.jsonl",
                        f"--out_dir={out}"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no .jsonl/.txt/.parquet files match" in r.stderr
