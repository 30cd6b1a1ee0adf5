"""Byte-level text shards for the study's LM runs (vocabulary: the 256 byte values of UTF-8).

    python experiments/text_data.py --source=train.jsonl --val_source=val.jsonl --out_dir=experiments/data/text

This writes them itself with data.py's shard writer (data.ShardWriter, data.write_shard: the
llm.c layout, uint16 tokens): the study's shards were made so before data.py had
`--tokenizer=byte`, and the committed runs were trained on them. Each document starts with
byte 0 (NUL, data.BYTE_EOT, as data.py's byte tokenizer does) as its end-of-text marker, and
the folder's tokenizer.json says "byte". To switch to data.py, set WRITER = "data.py" (make()
then runs `data.py --tokenizer=byte`) - and re-run every text run, since the shards (val
split, shard sizes) may differ: runs made from two shard sets must not share a table.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from data import BYTE_EOT, TOKENIZER_FILE, ShardWriter, iter_local_documents, write_tokenizer  # noqa: E402

SHARD_TOKENS = 10_000_000
WRITER = "experiments"  # "experiments": write_byte_shards below | "data.py": data.py --tokenizer=byte
MARKER = "text_shards.json"


def data_py_has_byte_tokenizer():
    out = subprocess.run([sys.executable, str(ROOT / "data.py"), "--help"], capture_output=True, text=True)
    return "--tokenizer" in out.stdout


def encode(text):
    """One document -> uint16 bytes, NUL first (the document boundary: data.BYTE_EOT)."""
    return np.frombuffer(bytes([BYTE_EOT]) + text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def write_byte_shards(source, val_source, out_dir, val_tokens, max_tokens):
    """data.py's layout: the val shard (whole documents of val_source up to val_tokens, the
    last one cut) first, then train shards of source up to max_tokens. Returns token counts."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(str(out_dir), "text", max(SHARD_TOKENS, val_tokens))
    for doc in iter_local_documents(val_source):
        tokens = encode(doc)[: val_tokens - writer.fill]
        writer.buf[writer.fill: writer.fill + len(tokens)] = tokens
        writer.fill += len(tokens)
        if writer.fill == val_tokens:
            break
    n_val = writer.fill
    writer.flush("val")
    budget = max_tokens
    for doc in iter_local_documents(source):
        tokens = encode(doc)[:budget]
        writer.add(tokens)
        budget -= len(tokens)
        if budget <= 0:
            break
    writer.flush("train")
    return {"val": n_val, "train": max_tokens - max(budget, 0)}


def make(source, val_source, out_dir, val_tokens=262_144, max_tokens=12_000_000):
    """The byte shards in out_dir, made once (a marker records how), with the tokenizer.json
    that tells train.py and evaluate.py they hold bytes (a folder made before this wrote one
    gets it here: without it data.tokenizer_of reads the folder as GPT-2 tokens, and bits per
    byte is lost)."""
    marker = Path(out_dir) / MARKER
    want = {"tokenizer": "byte", "source": Path(source).name, "val_source": Path(val_source).name,
            "val_tokens": val_tokens, "max_tokens": max_tokens, "writer": WRITER}
    if marker.exists() and json.loads(marker.read_text()).get("request") == want:
        if not (Path(out_dir) / TOKENIZER_FILE).exists():
            write_tokenizer(out_dir, "byte", 256)
        return
    if WRITER == "data.py":
        if not data_py_has_byte_tokenizer():
            sys.exit("text_data.WRITER is 'data.py' but `python data.py --help` lists no --tokenizer")
        subprocess.run([sys.executable, str(ROOT / "data.py"), "--tokenizer=byte", f"--source={source}",
                        f"--val_source={val_source}", f"--out_dir={out_dir}", f"--val_tokens={val_tokens}",
                        f"--max_tokens={max_tokens + val_tokens}"], check=True, cwd=ROOT)
        made_by = "data.py --tokenizer=byte"
    else:
        counts = write_byte_shards(source, val_source, out_dir, val_tokens, max_tokens)
        made_by = f"experiments/text_data.py ({counts['train']:,} train + {counts['val']:,} val bytes)"
    write_tokenizer(out_dir, "byte", 256)
    marker.write_text(json.dumps({"request": want, "made_by": made_by}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="train documents: .jsonl / .txt / .parquet (data.py's --source)")
    p.add_argument("--val_source", required=True)
    p.add_argument("--out_dir", required=True)
    p.add_argument("--val_tokens", type=int, default=262_144)
    p.add_argument("--max_tokens", type=int, default=12_000_000)
    args = p.parse_args(argv)
    make(args.source, args.val_source, args.out_dir, args.val_tokens, args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
