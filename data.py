"""Data: tokenize text into llm.c-style .bin shards, read them back, batch them for DDP.

Shard layout (llm.c / modded-nanogpt, so the public kjj0/fineweb10B-gpt2 shards load as
they are): a header of 256 int32 (header[0] = 20240520 magic, header[1] = 1 version,
header[2] = number of tokens), then the tokens as uint16. Files are named
`{prefix}_val_000000.bin`, `{prefix}_train_000001.bin`, ...: the first shard is validation.

Make shards:
    python data.py --source=fineweb --out_dir=data/fineweb --max_tokens=20_000_000
    python data.py --source=fineweb-gpt2 --out_dir=data/fineweb10B --shards=8
    python data.py --source='texts/*.jsonl' --out_dir=data/mine [--val_source=val.jsonl]
    python data.py --tokenizer=byte --source=texts.jsonl --out_dir=data/bytes   # CPU scale
    python data.py --tokenizer=path/to/Qwen3-0.6B --source=fineweb --out_dir=data/qwen3

Tokenizers: `gpt2` (tiktoken's GPT-2 BPE, the papers' setting),
`byte` (the 256 byte values of the UTF-8 text: no dependency, and a model small enough for
a CPU learns it in minutes), or a pretrained checkpoint's own tokenizer.json (read with the
`tokenizers` library; shards of more than 65,536 ids hold uint32 tokens). The folder's
tokenizer.json records which one made the shards (`tokenizer_of`; a tokenizer file is copied
beside it) and `load_tokenizer` reads any of them back; train.py takes the vocabulary size from
it and sample.py decodes with it.
At the end data.py prints the unigram baseline (`unigram_loss`): the val loss of a model
that ignores all context, the number a trained model must beat.

Read them (train.py does this):
    loader = DistributedLoader("data/mine", B=8, T=256, rank=0, world_size=1, seed=0)
    x, y = loader.next_batch()          # int64 (B, T) each; y is x shifted by one token
"""
import argparse
import functools
import glob
import hashlib
import itertools
import json
import os
import re
import sys
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256
# Vocabularies over 65,536 ids (Qwen3's 151,669) need uint32 tokens: llm.c's Llama-3 header.
MAGIC32, VERSION32 = 20240801, 7
SHARD_DTYPES = {(MAGIC, VERSION): np.uint16, (MAGIC32, VERSION32): np.uint32}  # (magic, version) -> tokens
HEADER_BYTES = HEADER_INTS * 4
EOT = 50256  # GPT-2 <|endoftext|>, written before every document (as llm.c does)
BYTE_EOT = 0  # the byte tokenizer's document separator: NUL, which text practically never holds
TOKENIZER_FILE = "tokenizer.json"
# name -> (number of token ids, the id written before every document)
TOKENIZERS = {"gpt2": (50257, EOT), "byte": (256, BYTE_EOT)}


class ShardError(ValueError):
    """A data folder or token shard that cannot be used; the message names the file, the
    problem and the fix."""


class NoShards(ShardError):
    """No data folder, or no shards of a split in it. `problem` is the message without the
    fix, for a caller that knows which tokenizer the run needs (train.py names its command)."""

    def __init__(self, problem, data_dir):
        super().__init__(f"{problem}; {_remake_hint(data_dir)}")
        self.problem = problem


def _remake_hint(data_dir):
    return (f"make shards for a byte model (train.py's CPU preset) with `python data.py --tokenizer=byte "
            f"--source=fineweb --out_dir={data_dir} --max_tokens=20000000`, for a GPT-2 BPE model "
            f"(the GPU presets) with `python data.py --source=fineweb-gpt2 --out_dir={data_dir} "
            f"--shards=27` (both need internet), or from local files with `python data.py "
            f"[--tokenizer=byte] --source='path/to/*.jsonl' --out_dir={data_dir}`")


# ----------------------------------------------------------------------------- tokenizers

def encode_bytes(text):
    """str -> its UTF-8 bytes as token ids (N,) uint16; every byte value is its own token."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def decode_bytes(tokens):
    """Token ids -> str. A model can emit byte sequences that are not UTF-8 (a lone
    continuation byte, a cut multibyte character): those become U+FFFD instead of an error."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def write_tokenizer(out_dir, name, vocab_size):
    """Record in out_dir which tokenizer made its shards and how many token ids it uses."""
    with open(os.path.join(out_dir, TOKENIZER_FILE), "w") as f:
        json.dump({"name": name, "vocab_size": vocab_size}, f)
        f.write("\n")


def tokenizer_of(data_dir):
    """(name, vocab_size) of the tokenizer that made data_dir's shards, from its
    tokenizer.json. A folder without one holds GPT-2 tokens: the public kjj0/fineweb10B-gpt2
    shards and folders written before the file existed."""
    path = os.path.join(data_dir, TOKENIZER_FILE)
    if not os.path.exists(path):
        return "gpt2", TOKENIZERS["gpt2"][0]
    try:
        with open(path) as f:
            record = json.load(f)
        return str(record["name"]), int(record["vocab_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise ShardError(f"{path}: unreadable tokenizer record ({type(e).__name__}: {e}); expected "
                         f'JSON like {{"name": "byte", "vocab_size": 256}}; re-create the folder '
                         f"with `python data.py ...`") from None


def check_vocab(data_dir, vocab_size):
    """A clear error when a model of vocab_size ids cannot embed the token ids recorded for
    data_dir. Folders without a tokenizer.json are not checked: their ids are not recorded
    (older recall folders, for example, hold ids < 96 and train with --vocab_size=256)."""
    if not os.path.exists(os.path.join(data_dir, TOKENIZER_FILE)):
        return
    name, n_ids = tokenizer_of(data_dir)
    if vocab_size < n_ids:
        raise ShardError(f"--vocab_size={vocab_size} is smaller than the {n_ids} token ids of the "
                         f"{name} shards in {data_dir}; raise it, or leave it out and the data "
                         f"folder sets it")


def unigram_log_probs(data_dir):
    """(V,) float64 log p(v) of the train shards' add-one smoothed unigram distribution over
    the tokenizer's V ids (unigram_loss says why add-one); evaluate.py scores it per token."""
    vocab = tokenizer_of(data_dir)[1]
    counts = np.zeros(vocab, dtype=np.float64)
    for path in find_shards(data_dir, "train"):
        counts += np.bincount(load_shard(path), minlength=vocab)[:vocab]
    return np.log(counts + 1) - np.log(counts.sum() + vocab)


def unigram_loss(data_dir, val_tokens=None):
    """The loss to beat: mean cross-entropy (nats per token) on the val shards of the
    train shards' unigram distribution, i.e. of a model that ignores every token of context.

    p(v) = (count_train(v) + 1) / (N_train + V): add-one smoothing over the tokenizer's V
    ids, so a val token never seen in training costs log(N_train + V) instead of infinity.
    val_tokens: only the first val_tokens val tokens (train.py evaluates on such a prefix);
    None: all of them."""
    vocab = tokenizer_of(data_dir)[1]
    log_p = unigram_log_probs(data_dir)  # (V,)
    val = np.concatenate([np.asarray(load_shard(p)) for p in find_shards(data_dir, "val")])
    val = val[:val_tokens] if val_tokens else val
    if val.size and int(val.max()) >= vocab:
        raise ShardError(f"{data_dir}: val token {int(val.max())} is outside the recorded "
                         f"vocabulary of {vocab}; the tokenizer.json does not match the shards")
    return float(-log_p[val.astype(np.int64)].mean())


# ----------------------------------------------------------------------------- a tokenizer file
# The third kind beside gpt2 and byte: a Hugging Face `tokenizers` file (tokenizer.json), such
# as a pretrained Qwen3's. `python data.py --tokenizer=PATH` writes shards with it and keeps a
# copy in the shard folder beside the record, so the folder itself says which text every id
# stands for; load_tokenizer reads any of the three kinds back behind one interface.

TOKENIZER_COPY = "hf_tokenizer.json"  # the copy of a tokenizer file, beside the record
# A tokenizer file's document separator: the first of these it holds (GPT-2's and Qwen's,
# Llama 3's, SentencePiece's, Gemma's), written before every document as EOT is for GPT-2.
DOC_SEPARATORS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


class NoText(ShardError):
    """Token ids with no text behind them (the recall probe's): nothing to encode or decode."""


class TextTokenizer:
    """One interface over the three kinds of tokenizer; `load_tokenizer` makes them.

    name (for messages and records), kind ('gpt2' | 'byte' | 'file'), n_ids (the ids it can
    write: an embedding needs at least this many rows), eot (the id written before every
    document), dtype (of its shards: uint32 beyond 65,536 ids), encode(text) -> [ids]
    (special-token text in it is plain text, as GPT-2's encode_ordinary), decode(ids) -> str,
    token_bytes(vocab_size) (for bits per byte), fingerprint (equal for tokenizers that map
    text to the same ids), spec (what a checkpoint stores: load_tokenizer(spec) gives this
    tokenizer back) and, for a file, json_text (its content) and source (its path, if read
    from one)."""

    def __init__(self, kind, name, n_ids, eot, source=None, text=None, hf=None):
        self.kind, self.name, self.n_ids, self.eot, self.source = kind, name, n_ids, eot, source
        self.dtype = np.uint16 if n_ids <= 2 ** 16 else np.uint32  # of its shards
        self.json_text, self._hf = text, hf  # a tokenizer file's JSON and its tokenizers.Tokenizer
        if kind == "file":
            parsed = {k: v for k, v in json.loads(text).items() if k not in ("truncation", "padding")}
            canonical = json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            self.fingerprint = "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()
        else:
            self.fingerprint = kind

    @property
    def spec(self):
        return self.name if self.kind != "file" else {"name": self.name, "json": self.json_text}

    def encode(self, text):
        if self.kind == "byte":
            return encode_bytes(text).tolist()
        if self.kind == "gpt2":
            return _gpt2().encode_ordinary(text)
        return self._hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        ids = [int(i) for i in ids]
        if self.kind == "byte":
            return decode_bytes(ids)
        if self.kind == "gpt2":
            return _gpt2().decode(ids)
        return self._hf.decode(ids, skip_special_tokens=False)

    def check_fits(self, vocab_size, what="the model's embedding"):
        """A clear error when a model of vocab_size ids cannot embed every id this writes."""
        if self.n_ids > vocab_size:
            raise ShardError(f"the tokenizer {self.name} writes {self.n_ids} token ids but {what} has "
                             f"{vocab_size} rows, so ids {vocab_size}..{self.n_ids - 1} have none; use "
                             f"the model's own tokenizer (its checkpoint's tokenizer.json)")

    def token_bytes(self, vocab_size):
        """(vocab_size,) int64: the UTF-8 bytes of each id's text, 0 for the document separator,
        for special tokens and for ids the tokenizer does not write (the vocabulary's padding).
        A tokenizer file decoding bytes (GPT-2's byte-level BPE, kept by Qwen and Llama 3)
        gives exact counts; one of SentencePiece pieces counts '▁' as a space and '<0xNN>' as
        one byte (so a document's prefix space counts, though its text lacks it)."""
        self.check_fits(vocab_size)
        counts = np.zeros(vocab_size, dtype=np.int64)
        if self.kind == "byte":
            counts[:256] = 1
        elif self.kind == "gpt2":
            enc = _gpt2()
            counts[:enc.n_vocab] = [len(enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab)]
        else:
            parsed = json.loads(self.json_text)
            byte_of = {c: b for b, c in byte_level_alphabet().items()}
            byte_level = "ByteLevel" in json.dumps(parsed.get("decoder"))
            for piece, i in self._hf.get_vocab(with_added_tokens=False).items():
                if byte_level and all(c in byte_of for c in piece):
                    counts[i] = len(piece)  # one character per byte
                elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
                    counts[i] = 1  # SentencePiece's byte fallback
                else:
                    counts[i] = len(piece.replace("\u2581", " ").encode("utf-8"))
            for added in parsed.get("added_tokens", []):  # decoded as their text, unless special
                counts[added["id"]] = 0 if added["special"] else len(added["content"].encode("utf-8"))
        counts[self.eot] = 0
        return counts


def byte_level_alphabet():
    """{byte: character}: the printable stand-in of each byte in a byte-level BPE vocabulary
    (GPT-2's, kept by Qwen and Llama 3): printable Latin-1 bytes stand for themselves, the
    68 others (controls, space, ...) for U+0100 onward in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = iter(range(0x100, 0x200))
    return {b: chr(b) if b in printable else chr(next(shifted)) for b in range(256)}


def byte_tokenizer_json():
    """The byte tokenizer as a Hugging Face tokenizer file (what model.save_hf writes beside a
    byte model, so that transformers' AutoTokenizer encodes text for it): a byte-level BPE
    without merges, id b = byte b, which `tokenizers` encodes and decodes exactly as
    encode_bytes and decode_bytes do. load_tokenizer reads it back as `byte` (is_byte_file)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # lazy: only files need it

    alphabet = byte_level_alphabet()
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


# tokenizer_config.json beside it: without one, transformers gives a qwen3 folder Qwen2's
# tokenizer class, which adds "<|endoftext|>" as a special token of id 256, beyond the byte
# model's vocabulary; the generic class adds nothing (the separator NUL is a byte, id 0).
BYTE_TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast"}


def is_byte_file(parsed):
    """Whether a parsed tokenizer file is byte_tokenizer_json's (by content, not by its text,
    so a file re-saved by another version of `tokenizers` is still recognised): no merges, the
    256 byte characters as ids 0..255, byte-level pre-tokenizer and decoder, nothing added."""
    model = parsed.get("model") or {}
    alphabet = byte_level_alphabet()
    return (model.get("type") == "BPE" and not model.get("merges") and not parsed.get("added_tokens")
            and not parsed.get("normalizer") and model.get("vocab") == {alphabet[b]: b for b in range(256)}
            and (parsed.get("pre_tokenizer") or {}).get("type") == "ByteLevel"
            and (parsed.get("decoder") or {}).get("type") == "ByteLevel")


def _gpt2():
    import tiktoken  # lazy: GPT-2's BPE files are downloaded on first use (tiktoken keeps them)
    return tiktoken.get_encoding("gpt2")


def _tokenizer_file(text, name, source=None):
    """A TextTokenizer of the Hugging Face tokenizer file with JSON `text`."""
    from tokenizers import Tokenizer  # lazy: only tokenizer files need it
    where = source or name
    try:
        hf = Tokenizer.from_str(text)
    except Exception as e:  # the tokenizers library names the field it could not read
        raise ShardError(f"{where}: not a tokenizer file the `tokenizers` library can read "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    hf.encode_special_tokens = True  # "<|endoftext|>" inside a web page is text, as in encode_ordinary
    vocab = hf.get_vocab(with_added_tokens=True)
    separator = next((s for s in DOC_SEPARATORS if s in vocab), None)
    if separator is None:
        raise ShardError(f"{where}: the tokenizer has no document separator (none of "
                         f"{', '.join(DOC_SEPARATORS)} is a token); add one as a special token")
    return TextTokenizer("file", name, max(vocab.values()) + 1, vocab[separator], source, text, hf)


def _file_label(path):
    """'Qwen/Qwen3-0.6B/tokenizer.json' for a file in the Hub's cache, else its folder's name and
    its own: a name that never equals 'gpt2' or 'byte'."""
    parts = Path(os.path.abspath(path)).parts
    repo = next((p for p in parts if p.startswith("models--")), None)
    folder = repo[len("models--"):].replace("--", "/") if repo else parts[-2] if len(parts) > 1 else ""
    return f"{folder}/{parts[-1]}"


def load_tokenizer(spec):
    """spec -> TextTokenizer. spec: 'gpt2' | 'byte' | a Hugging Face tokenizer.json file | a
    folder holding one (a checkpoint's) | a shard folder (the tokenizer its record names; a
    folder of shards without a record holds GPT-2's, as tokenizer_of says) | a spec a
    TextTokenizer gave (a checkpoint stores it). NoText for ids without text (the recall
    probe's), ShardError naming the problem for anything else; OSError for gpt2 when tiktoken
    cannot load GPT-2's BPE files (offline, first use)."""
    if isinstance(spec, dict):
        return _tokenizer_file(spec["json"], spec["name"])
    spec = str(spec)
    if spec in TOKENIZERS:
        if spec == "gpt2":
            _gpt2()  # GPT-2's BPE files: an OSError now, not at the first encode, when they cannot load
        return TextTokenizer(spec, spec, *TOKENIZERS[spec])
    path = spec
    if os.path.isdir(path):
        path = os.path.join(spec, TOKENIZER_FILE)
        if not os.path.exists(path):
            if glob.glob(os.path.join(spec, "*.bin")):
                return load_tokenizer("gpt2")
            raise ShardError(f"{spec}: a folder without {TOKENIZER_FILE}; give gpt2, byte, a Hugging "
                             f"Face tokenizer.json or a folder holding one (a checkpoint's, or shards')")
    if not os.path.isfile(path):
        if not (os.sep in spec or spec.endswith(".json")):  # a name a record or checkpoint gave (recall)
            raise NoText(f"tokenizer {spec!r}: not gpt2 or byte, so no text (the recall probe's ids have "
                         f"none); give gpt2, byte, a tokenizer.json or a folder holding one")
        raise ShardError(f"tokenizer {spec!r}: no such file or folder; give gpt2, byte, a tokenizer.json "
                         f"or a folder holding one")
    text = Path(path).read_text(encoding="utf-8")
    try:
        parsed = json.loads(text)
    except ValueError as e:
        raise ShardError(f"{path}: not JSON ({e}); a tokenizer file is the tokenizer.json of a Hugging "
                         f"Face checkpoint") from None
    if isinstance(parsed, dict) and "model" in parsed:
        if is_byte_file(parsed):  # a byte model's export (model.save_hf): the built-in byte tokenizer
            return load_tokenizer("byte")
        return _tokenizer_file(text, _file_label(path), path)
    if not (isinstance(parsed, dict) and "name" in parsed):
        raise ShardError(f"{path}: neither a Hugging Face tokenizer file (no 'model') nor data.py's "
                         f"record of a shard folder (no 'name')")
    folder = os.path.dirname(path)  # a shard folder's record
    name, n_ids = tokenizer_of(folder)
    if parsed.get("file"):
        copy = os.path.join(folder, parsed["file"])
        if not os.path.isfile(copy):
            raise ShardError(f"{path}: its tokenizer file {copy} is missing; copy the shard folder whole, "
                             f"or re-create it with `python data.py --tokenizer=PATH ...`")
        tok = _tokenizer_file(Path(copy).read_text(encoding="utf-8"), name, copy)
        if tok.fingerprint != parsed.get("sha256"):
            raise ShardError(f"{copy} is not the tokenizer that made the shards in {folder} (its "
                             f"fingerprint differs from the record's); re-create the folder")
        return tok
    if name in TOKENIZERS:
        return load_tokenizer(name)
    raise NoText(f"{folder} holds {name} token ids, which have no text to encode or decode")


def tokenizer_spec(data_dir):
    """What a checkpoint records of data_dir's tokenizer: load_tokenizer(spec) gives it back (its
    name; for a tokenizer file, its name and JSON), or the name of ids without text."""
    if not os.path.exists(os.path.join(data_dir, TOKENIZER_FILE)):
        return "gpt2"  # as tokenizer_of says
    try:
        return load_tokenizer(data_dir).spec
    except NoText:
        return tokenizer_of(data_dir)[0]


def record_tokenizer(out_dir, tok):
    """Record in out_dir the tokenizer `tok` that made its shards: write_tokenizer's record, and
    for a tokenizer file a copy of it (TOKENIZER_COPY) with its fingerprint and separator."""
    if tok.kind != "file":
        return write_tokenizer(out_dir, tok.name, tok.n_ids)
    copy = os.path.join(out_dir, TOKENIZER_COPY)
    with open(f"{copy}.tmp", "w", encoding="utf-8") as f:
        f.write(tok.json_text)
    os.replace(f"{copy}.tmp", copy)
    with open(os.path.join(out_dir, TOKENIZER_FILE), "w") as f:
        json.dump({"name": tok.name, "vocab_size": tok.n_ids, "file": TOKENIZER_COPY,
                   "sha256": tok.fingerprint, "eot": tok.eot}, f)
        f.write("\n")


def check_tokenizer(data_dir, tok):
    """A clear error when data_dir's shards were not made with the tokenizer `tok` (a
    model's): the same id would stand for other text. Reads the folder's record alone."""
    name = tokenizer_of(data_dir)[0]
    path = os.path.join(data_dir, TOKENIZER_FILE)
    record = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
    made = record.get("sha256") or (name if name in TOKENIZERS else None)
    if made != tok.fingerprint:
        how = (tok.source or "PATH/tokenizer.json") if tok.kind == "file" else tok.name
        raise ShardError(f"{data_dir} holds tokens of {name}, but the model's tokenizer is {tok.name}; "
                         f"make shards with the model's: `python data.py --tokenizer={how} "
                         f"--source=... --out_dir=...`")


# ----------------------------------------------------------------------------- shards

def write_shard(path, tokens):
    """Write uint16 `tokens` (N,) with the llm.c header (uint32 tokens, for vocabularies over
    65,536 ids, with llm.c's Llama-3 header). Atomic (tmp file + rename), so an interrupted
    run never leaves a half-written shard under the final name."""
    tokens = np.asarray(tokens)
    assert tokens.dtype in (np.uint16, np.uint32), tokens.dtype
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (*((MAGIC, VERSION) if tokens.dtype == np.uint16 else (MAGIC32, VERSION32)), len(tokens))
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_shard(path):
    """Memory-map one shard after checking its header; returns a read-only uint16 (N,) array
    (uint32 for a shard with llm.c's Llama-3 header)."""
    path = str(path)
    fix = "delete it and re-create the folder with `python data.py ...` (or re-download it)"
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: truncated shard: {size} bytes is shorter than the "
                         f"{HEADER_BYTES}-byte header; {fix}")
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if header[0] not in (MAGIC, MAGIC32):
        raise ShardError(f"{path}: bad magic number {header[0]} (expected {MAGIC}, or {MAGIC32} for "
                         f"uint32 tokens): not an llm.c-style token shard, or corrupted; {fix}")
    dtype = SHARD_DTYPES.get((int(header[0]), int(header[1])))
    if dtype is None:
        expected_version = VERSION if header[0] == MAGIC else VERSION32
        raise ShardError(f"{path}: unsupported shard version {header[1]} (expected {expected_version}); {fix}")
    n = int(header[2])
    expected = HEADER_BYTES + np.dtype(dtype).itemsize * n
    if size != expected:
        what = "truncated shard" if size < expected else "shard longer than its header says"
        raise ShardError(f"{path}: {what}: header says {n} tokens ({expected} bytes) but the "
                         f"file has {size} bytes; {fix}")
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(n,))


def find_shards(data_dir, split):
    """Sorted paths of `*_{split}_*.bin` in data_dir; a clear error if there are none."""
    if not os.path.isdir(data_dir):
        raise NoShards(f"data folder {data_dir} does not exist", data_dir)
    # The split is the second-to-last `_` field, so a prefix may itself contain "_train".
    paths = sorted(p for p in glob.glob(os.path.join(data_dir, f"*_{split}_*.bin"))
                   if os.path.basename(p).rsplit("_", 2)[1] == split)
    if not paths:
        raise NoShards(f"no {split} shards (*_{split}_*.bin) in data folder {data_dir}", data_dir)
    return paths


# ----------------------------------------------------------------------------- loaders

class DistributedLoader:
    """Training batches, identical whatever the number of processes.

    All train tokens are viewed as one list of sequences of T+1 tokens with stride T (a
    sequence does not cross a shard boundary, so at most T tokens per shard go unused).
    Each epoch visits them in the order of a permutation drawn from torch.Generator seeded
    by seed + epoch. A call on rank r of W takes sequences [cursor + r*B, cursor + (r+1)*B)
    of that order and every rank advances cursor by W*B. So one process doing 2 micro-steps
    sees exactly the sequences that 2 ranks doing 1 micro-step see, which makes DDP runs
    equal to single-process runs with gradient accumulation. The tail of an epoch that
    cannot fill a whole W*B block is skipped (the next epoch reshuffles everything).
    """

    def __init__(self, data_dir, B, T, rank=0, world_size=1, seed=0, split="train"):
        self.B, self.T, self.rank, self.world_size, self.seed = B, T, rank, world_size, seed
        self.paths = find_shards(data_dir, split)
        self.shards = [load_shard(p) for p in self.paths]
        counts = np.array([max(len(s) - 1, 0) // T for s in self.shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])  # (n_shards + 1,) first seq id
        self.n_seq = int(self.starts[-1])
        if self.n_seq < B * world_size:
            raise ShardError(
                f"{data_dir}: {sum(len(s) for s in self.shards)} {split} tokens make only "
                f"{self.n_seq} sequences of {T + 1} tokens, fewer than one global micro-batch "
                f"({world_size} ranks x batch_size {B}); add data, or lower --batch_size / --seq_len")
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch):
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.n_seq, generator=g).numpy()

    def next_batch(self):
        """(x, y): int64 tensors (B, T) for this rank; y[b, t] = x[b, t + 1] in the stream."""
        B, T, W = self.B, self.T, self.world_size
        if self.cursor + W * B > self.n_seq:
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        seq = self._order[self.cursor + self.rank * B: self.cursor + (self.rank + 1) * B]  # (B,)
        self.cursor += W * B
        shard = np.searchsorted(self.starts, seq, side="right") - 1  # (B,) which shard
        buf = np.empty((B, T + 1), dtype=np.int64)
        for b, (s, i) in enumerate(zip(shard, seq)):
            off = int(i - self.starts[s]) * T
            buf[b] = self.shards[s][off: off + T + 1]
        buf = torch.from_numpy(buf)
        return buf[:, :-1], buf[:, 1:]

    def state_dict(self):
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed,
                "n_seq": self.n_seq, "T": self.T, "global_batch": self.B * self.world_size}

    def load_state_dict(self, state):
        mine = self.state_dict()
        for key in ("n_seq", "T", "seed"):
            if state[key] != mine[key]:
                raise ShardError(f"cannot resume the data position: {key} was {state[key]} "
                                 f"when the checkpoint was written and is {mine[key]} now "
                                 f"(different data folder, shards or settings); resume with "
                                 f"the same --data_dir, --seq_len and --seed")
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._permutation(self.epoch)


class ValLoader:
    """A fixed prefix of the validation shards, the same at every evaluation.

    The first n_tokens val tokens are cut into contiguous sequences of T (+1 target);
    iterating yields this rank's (x, y) int64 (B, T) batches: global batch k holds sequences
    [k*W*B, (k+1)*W*B) and rank r takes its B of them. n_tokens is rounded down to a whole
    number of global batches so every rank runs the same number of forward passes (needed
    for the all-reduce of the mean loss).
    """

    def __init__(self, data_dir, B, T, n_tokens, rank=0, world_size=1):
        self.B, self.T, self.rank, self.world_size = B, T, rank, world_size
        shards = [load_shard(p) for p in find_shards(data_dir, "val")]
        available = sum(len(s) for s in shards)
        self.n_batches = min(n_tokens, available - 1) // (B * T * world_size)
        if self.n_batches < 1:
            raise ShardError(f"{data_dir}: {available} val tokens are fewer than one global "
                             f"val batch ({world_size} x {B} x {T} + 1 tokens); lower "
                             f"--batch_size / --seq_len or make a bigger val shard (--val_tokens)")
        need = self.n_batches * B * T * world_size + 1
        # A small prefix (val_tokens), so a plain in-memory copy is fine; may span shards.
        self.tokens = np.concatenate([np.asarray(s[:need]) for s in shards])[:need].astype(np.int64)

    def __len__(self):
        return self.n_batches

    def __iter__(self):
        B, T, W = self.B, self.T, self.world_size
        for k in range(self.n_batches):
            first = (k * W + self.rank) * B  # first sequence of this rank in global batch k
            buf = np.stack([self.tokens[(first + b) * T: (first + b) * T + T + 1] for b in range(B)])
            buf = torch.from_numpy(buf)  # (B, T + 1)
            yield buf[:, :-1], buf[:, 1:]


# ----------------------------------------------------------------------------- sources

def iter_local_documents(pattern, text_field="text"):
    """Documents (str) from a path, folder or glob of .jsonl / .txt / .parquet files, in
    sorted file order. A .jsonl line or a .parquet row is one document (its `text_field`);
    a whole .txt file is one document (split big plain-text files yourself if you want
    end-of-text tokens inside them)."""
    if os.path.isdir(pattern):
        paths = sorted(p for ext in ("jsonl", "txt", "parquet")
                       for p in glob.glob(os.path.join(pattern, f"*.{ext}")))
    else:
        paths = sorted(glob.glob(pattern))
    if not paths:
        raise ShardError(f"--source={pattern}: no such file, and no .jsonl/.txt/.parquet files "
                         f"match it; give a path, a folder or a quoted glob like 'texts/*.jsonl', "
                         f"or use --source=fineweb / --source=fineweb-gpt2")
    for path in paths:
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        row = json.loads(line)
                        if text_field not in row:
                            raise ShardError(f"{path}:{n}: no '{text_field}' field (keys: "
                                             f"{sorted(row)}); pass --text_field=NAME")
                        yield row[text_field]
        elif path.endswith(".txt"):
            yield Path(path).read_text(encoding="utf-8")
        elif path.endswith(".parquet"):
            import pyarrow.parquet as pq  # lazy: only needed for parquet sources
            pf = pq.ParquetFile(path)
            if text_field not in pf.schema_arrow.names:
                raise ShardError(f"{path}: no '{text_field}' column (columns: "
                                 f"{pf.schema_arrow.names}); pass --text_field=NAME")
            for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
                yield from batch.column(0).to_pylist()
        else:
            raise ShardError(f"{path}: unsupported file type; use .jsonl, .txt or .parquet")


def iter_fineweb(name="sample-10BT"):
    """Documents streamed from HuggingFaceFW/fineweb (nothing is downloaded up front)."""
    from datasets import load_dataset  # lazy: heavy import, only needed for this source
    ds = load_dataset("HuggingFaceFW/fineweb", name=name, split="train", streaming=True)
    for row in ds:
        yield row["text"]


def download_fineweb_gpt2(out_dir, shards):
    """Fetch the val shard and the first `shards` train shards (100M tokens each) of the
    public pre-tokenized kjj0/fineweb10B-gpt2 (modded-nanogpt's cached_fineweb10B.py), then
    check every header. Files already present are not fetched again."""
    from huggingface_hub import hf_hub_download  # lazy: only needed for this source
    names = ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, shards + 1)]
    for name in names:
        if not os.path.exists(os.path.join(out_dir, name)):
            hf_hub_download(repo_id="kjj0/fineweb10B-gpt2", filename=name,
                            repo_type="dataset", local_dir=out_dir)
        n = len(load_shard(os.path.join(out_dir, name)))
        print(f"{name}: {n:,} tokens")
    write_tokenizer(out_dir, "gpt2", TOKENIZERS["gpt2"][0])


def recall_sequences(n_seq, seq_len=256, n_keys=32, n_values=64, seed=0):
    """Synthetic multi-query associative recall with dense supervision (in the spirit of
    Zoology's MQAR, Arora et al. 2023): the long-range probe of experiments/recall.py.

    Each sequence draws a fresh random mapping key -> value (each key's value uniform over
    n_values, independently) and is a stream of seq_len / 2 pairs `k v`: even positions hold
    keys, drawn uniformly at random (so a key recurs at many distances), the next position
    its value. Token ids: keys 0 .. n_keys-1, values n_keys .. n_keys+n_values-1 (train
    with --vocab_size >= n_keys + n_values, e.g. 256). A key that occurred before in the
    same sequence is a query: at its position the model must predict its value, seen right
    after the previous occurrence. Values of first occurrences and every next key are
    unpredictable, so they only add a constant to the loss.

    Returns (tokens uint16 (n_seq, seq_len), queries) where queries is a dict of int64
    arrays, one entry per query: `seq` (row), `pos` (position of the key token: the logits
    there predict the answer), `answer` (the value token) and `distance` (pos minus the
    position of that key's previous occurrence; the answer token sits at distance - 1).
    Deterministic in seed.
    """
    assert seq_len % 2 == 0 and n_keys + n_values <= 2 ** 16, (seq_len, n_keys, n_values)
    rng = np.random.default_rng(seed)
    n_pairs = seq_len // 2
    keys = rng.integers(0, n_keys, size=(n_seq, n_pairs))  # (N, P)
    mapping = rng.integers(0, n_values, size=(n_seq, n_keys))  # (N, n_keys)
    values = np.take_along_axis(mapping, keys, axis=1) + n_keys  # (N, P)
    tokens = np.stack([keys, values], axis=2).reshape(n_seq, seq_len).astype(np.uint16)
    # Previous occurrence of each pair's key: scan pairs once, remembering the last pair index.
    last = np.full((n_seq, n_keys), -1, dtype=np.int64)
    rows = np.arange(n_seq)
    prev = np.empty((n_seq, n_pairs), dtype=np.int64)  # (N, P) pair index, -1 if first
    for p in range(n_pairs):
        prev[:, p] = last[rows, keys[:, p]]
        last[rows, keys[:, p]] = p
    seq, pair = np.nonzero(prev >= 0)
    queries = {"seq": seq, "pos": 2 * pair, "answer": values[seq, pair].astype(np.int64),
               "distance": 2 * (pair - prev[seq, pair])}
    return tokens, queries


def write_recall_shards(out_dir, max_tokens=None, val_tokens=None, seq_len=256, n_keys=32,
                        n_values=64, seed=0):
    """Recall shards: a val shard (seed + 1) then one train shard (seed), whole sequences of
    seq_len back to back, so train.py with --seq_len=seq_len reads one sequence per row."""
    max_tokens = max_tokens or 4_000_000
    val_tokens = val_tokens or max(seq_len, max_tokens // 10)
    os.makedirs(out_dir, exist_ok=True)
    for split, n_tok, s in (("val", val_tokens, seed + 1), ("train", max_tokens - val_tokens, seed)):
        tokens, _ = recall_sequences(max(1, n_tok // seq_len), seq_len, n_keys, n_values, s)
        write_shard(os.path.join(out_dir, f"recall_{split}_{0 if split == 'val' else 1:06d}.bin"),
                    tokens.reshape(-1))
    write_tokenizer(out_dir, "recall", n_keys + n_values)  # synthetic ids, no text behind them
    print(f"wrote recall shards to {out_dir}: seq_len {seq_len}, {n_keys} keys, {n_values} values, "
          f"vocab {n_keys + n_values}")


# ----------------------------------------------------------------------------- tokenizing

_enc = None
_files = {}  # path -> TextTokenizer, loaded once per worker process


def _encode(text, tokenizer="gpt2"):
    """One document -> uint16 tokens (uint32 for a tokenizer file of more ids), the
    tokenizer's document separator first. tokenizer: gpt2, byte or a tokenizer file's path.
    Runs in the worker processes."""
    global _enc
    if tokenizer == "byte":
        return np.concatenate([np.array([BYTE_EOT], dtype=np.uint16), encode_bytes(text)])
    if tokenizer != "gpt2":
        tok = _files.get(tokenizer) or _files.setdefault(tokenizer, load_tokenizer(tokenizer))
        return np.array([tok.eot] + tok.encode(text), dtype=tok.dtype)
    if _enc is None:
        import tiktoken
        _enc = tiktoken.get_encoding("gpt2")
    tokens = np.array([EOT] + _enc.encode_ordinary(text), dtype=np.int64)
    assert tokens.max() < 2 ** 16, "GPT-2 token ids fit in uint16"
    return tokens.astype(np.uint16)


def _encoded(pool, docs, tokenizer="gpt2", block=4096):
    """Token arrays for docs, in order. pool.imap alone would pull the whole (possibly
    endless, streamed) document iterator into memory in its feeder thread, so documents go
    to the pool in bounded blocks."""
    docs = iter(docs)
    encode = functools.partial(_encode, tokenizer=tokenizer)
    while block_docs := list(itertools.islice(docs, block)):
        yield from pool.imap(encode, block_docs, chunksize=16)


class ShardWriter:
    """Packs a token stream into shards of shard_tokens; the first shard is validation."""

    def __init__(self, out_dir, prefix, shard_tokens, dtype=np.uint16):
        self.out_dir, self.prefix, self.shard_tokens = out_dir, prefix, shard_tokens
        self.index, self.buf, self.fill, self.written = 0, np.empty(shard_tokens, dtype), 0, 0

    def add(self, tokens):
        """Train tokens: documents may continue into the next shard (the loader reads one
        stream of sequences anyway, like modded-nanogpt's fineweb.py)."""
        while len(tokens):
            take = min(len(tokens), self.shard_tokens - self.fill)
            self.buf[self.fill: self.fill + take] = tokens[:take]
            self.fill, tokens = self.fill + take, tokens[take:]
            if self.fill == self.shard_tokens:
                self.flush()

    def flush(self, split="train"):
        if self.fill == 0 and split == "train":
            return
        path = os.path.join(self.out_dir, f"{self.prefix}_{split}_{self.index:06d}.bin")
        write_shard(path, self.buf[: self.fill])
        self.written += self.fill
        self.index, self.fill = self.index + 1, 0


def tokenize_to_shards(docs, out_dir, prefix, shard_tokens, val_tokens, max_tokens=None,
                       val_docs=None, workers=None, tokenizer="gpt2"):
    """Tokenize documents in parallel into out_dir with `tokenizer` (a TOKENIZERS name, or a
    tokenizer file or a folder holding one: load_tokenizer), recorded in out_dir/tokenizer.json
    (record_tokenizer). The val shard takes val_tokens tokens of
    whole documents from val_docs if given, else from the start of docs; the document that
    crosses the val limit is cut there and its rest dropped, so no text is in both splits.
    max_tokens bounds everything written (val included). Returns the number of tokens."""
    from tqdm import tqdm  # lazy: only the writer shows a progress bar
    os.makedirs(out_dir, exist_ok=True)
    if max_tokens is not None:
        val_tokens = min(val_tokens, max_tokens)
    tok = load_tokenizer(tokenizer)
    tokenizer = tok.source if tok.kind == "file" else tok.name  # what the workers load
    writer = ShardWriter(out_dir, prefix, max(shard_tokens, val_tokens), tok.dtype)
    budget = max_tokens if max_tokens is not None else float("inf")
    bar = tqdm(total=max_tokens, unit="tok", unit_scale=True, desc=f"tokenizing into {out_dir}")
    with Pool(workers or os.cpu_count()) as pool:
        try:
            stream = _encoded(pool, docs, tokenizer)
            # Validation first: whole documents until the limit.
            for tokens in _encoded(pool, val_docs, tokenizer) if val_docs is not None else stream:
                take = min(len(tokens), val_tokens - writer.fill)
                writer.buf[writer.fill: writer.fill + take] = tokens[:take]
                writer.fill += take
                bar.update(take)
                if writer.fill == val_tokens:
                    break
            if writer.fill == 0:
                raise ShardError("no documents to tokenize; check --source (and --val_source)")
            val_written = writer.fill
            writer.flush("val")
            writer.buf = np.empty(shard_tokens, tok.dtype)
            writer.shard_tokens, budget = shard_tokens, budget - val_written
            for tokens in stream:
                tokens = tokens[: int(min(len(tokens), budget))]
                writer.add(tokens)
                budget -= len(tokens)
                bar.update(len(tokens))
                if budget <= 0:
                    break
            writer.flush("train")
        finally:
            # Leaving the loops early leaves documents in flight; Pool.__exit__'s terminate()
            # with tasks still queued can hang for ever joining the pool's task-handler thread
            # (seen once in the test suite). close() and join() let them finish (at most two
            # blocks of _encoded's documents) and the workers exit on their own.
            pool.close()
            pool.join()
    bar.close()
    if writer.written == val_written:
        raise ShardError(
            f"all {val_written} tokens went to the val shard and none are left for training; "
            f"pass a smaller --val_tokens (or --val_source=FILE for a separate val split)")
    record_tokenizer(out_dir, tok)
    print(f"wrote {writer.index} shards to {out_dir}: {val_written:,} val tokens, "
          f"{writer.written - val_written:,} train tokens ({tok.name} tokenizer)")
    return writer.written


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True,
                   help="fineweb | fineweb-gpt2 | recall | a path, folder or glob of .jsonl/.txt/.parquet")
    p.add_argument("--out_dir", required=True, help="folder for the .bin shards")
    p.add_argument("--tokenizer", default="gpt2",
                   help="gpt2: GPT-2 BPE (the papers'); byte: the 256 UTF-8 byte values (CPU scale); "
                        "PATH: a Hugging Face tokenizer.json, or a checkpoint folder holding one")
    p.add_argument("--max_tokens", type=int, default=None, help="stop after this many tokens (val included)")
    p.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per train shard")
    p.add_argument("--shards", type=int, default=1, help="fineweb-gpt2: train shards to fetch (100M tokens each)")
    p.add_argument("--val_tokens", type=int, default=None,
                   help="tokens in the val shard (default: min(10M, max_tokens/10), or 1M without --max_tokens)")
    p.add_argument("--val_source", default=None, help="take the val shard from these files instead of the head of --source")
    p.add_argument("--prefix", default=None, help="shard name prefix (default: fineweb, or text for local files)")
    p.add_argument("--text_field", default="text", help="jsonl/parquet field holding the text")
    p.add_argument("--fineweb_name", default="sample-10BT", help="fineweb config to stream")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all cores)")
    p.add_argument("--recall", default="256,32,64,0", help="recall: seq_len,n_keys,n_values,seed")
    args = p.parse_args(argv)
    try:
        if args.tokenizer != "gpt2" and args.source in ("fineweb-gpt2", "recall"):
            raise ShardError(f"--source={args.source} makes its own tokens; drop --tokenizer="
                             f"{args.tokenizer} (it applies to text sources)")
        if args.source == "fineweb-gpt2":
            os.makedirs(args.out_dir, exist_ok=True)
            download_fineweb_gpt2(args.out_dir, args.shards)
            return 0
        if args.source == "recall":  # synthetic, no tokenizer (recall_sequences)
            seq_len, n_keys, n_values, seed = (int(v) for v in args.recall.split(","))
            write_recall_shards(args.out_dir, args.max_tokens, args.val_tokens, seq_len, n_keys, n_values, seed)
            return 0
        tok = load_tokenizer(args.tokenizer)  # a bad --tokenizer fails before any work
        if args.val_tokens is None:
            args.val_tokens = 1_000_000 if args.max_tokens is None else min(10_000_000, max(args.max_tokens // 10, 1))
        if args.source == "fineweb":
            docs, prefix = iter_fineweb(args.fineweb_name), "fineweb"
        else:
            docs = iter_local_documents(args.source, args.text_field)
            prefix = "text"
        val_docs = iter_local_documents(args.val_source, args.text_field) if args.val_source else None
        tokenize_to_shards(docs, args.out_dir, args.prefix or prefix, args.shard_tokens,
                           args.val_tokens, args.max_tokens, val_docs, args.workers, args.tokenizer)
        unit = "byte" if tok.kind == "byte" else "token"
        print(f"unigram baseline (no context): val loss {unigram_loss(args.out_dir):.4f} nats per "
              f"{unit}; a trained model's val loss should end well below it")
    except ShardError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
