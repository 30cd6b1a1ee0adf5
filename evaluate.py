"""Evaluations of a train.py checkpoint or a pretrained Hugging Face Qwen3: loss by position,
bits per byte, recall, HellaSwag.

    python evaluate.py --ckpt=out/run                         # loss by position + bits per byte -> out/run/eval.json
    python evaluate.py --ckpt=out/run --hellaswag=True        # plus HellaSwag (downloaded once, 10,042 items)
    torchrun --nproc_per_node=8 evaluate.py --ckpt=out/run --hellaswag=True   # HellaSwag split over the ranks
    python evaluate.py --init_from=Qwen/Qwen3-0.6B --attn=moba --data_dir=data/qwen3 --recall=64 --out=moba.json

--init_from converts a pretrained Qwen3 to --attn (with the variant's settings as flags) and
scores it training-free at --seq_len, saying whether the variant's new parameters start
neutral (each variant's FROM_PRETRAINED, attention.py). --recall=N adds the recall probe (recall_probe) on N sequences.

train.py runs the same at the end of every run (`--eval_seqs`, `--hellaswag`) and writes
eval.json into the run folder; `analyze.py` draws loss by position from it.

Loss by position. The val stream is cut into sequences of L tokens (+1 target); the target
at index t is predicted from t + 1 tokens of context, its *position*. Positions are grouped
in powers of two (1, 2-3, 4-7, ..., the last bucket ending at L: 128-256 for L = 256); for each bucket, the mean
over sequences of each sequence's mean loss in that bucket, with a 95% Student-t interval
over the sequences. L is the trained length and 2x and 4x it: RoPE is defined at every
position, so this measures length generalisation (windowed and sparse variants see the same
number of keys at any length; full attention sees more than it was trained on). A length
the val data cannot fill with 2 sequences is skipped, and the JSON says why.

Bits per byte (nanochat's bpb): the summed token losses (nats) over the UTF-8 bytes of the
target text, / ln 2. The byte tokenizer: one byte per token. GPT-2 BPE: the byte length of
each target token's decoding (a token may hold part of a multi-byte character; the parts
sum to the text's bytes). The document separator (GPT-2's <|endoftext|>, the byte
tokenizer's NUL) is no text: it counts in neither sum, as in nanochat. The unigram baseline
(data.unigram_log_probs, a model without context) is scored on the same targets, in both
units. Tokens without text (the recall probe's ids) get nats per token only.

HellaSwag (Zellers et al., 2019; validation, 10,042 items of a context and 4 endings):
each ending is scored by the model's loss on its tokens given the context ("ctx" + " " +
ending, as build-nanogpt renders it): acc picks the ending of least summed loss, acc_norm
the least mean loss per token (build-nanogpt's definitions; with the byte tokenizer the
mean per token is the mean per byte, lm-evaluation-harness's acc_norm). Chance is 0.25;
GPT-2 124M scores about 0.29 acc_norm. A context too long for --hellaswag_len (default:
the trained length) loses its first tokens, never an ending's (eval.json counts the cut
items). Items are split across DDP ranks (item i on rank i mod world) and the counts
all-reduced.

Download and checksum: the file is fetched once from rowanz/hellaswag on GitHub into
--hellaswag_dir and checked: 10,042 lines, each with a context, 4 endings and a label in
0..3. This code was written without internet, so the file's true SHA-256 could not be
pinned here: the first download records its SHA-256 beside it (hellaswag_val.jsonl.sha256),
and every later use verifies the file against that record (trust on first use). The
download has not run yet for the same reason: tests serve the fixture through a fake server.
--hellaswag_file=PATH scores a local file of the same format instead (tests use a fixture).
"""
import hashlib
import json
import math
import os
import sys
import urllib.request
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import data
from attention import VARIANTS, attention_path

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_ITEMS = 10042
FACTORS = (1, 2, 4)  # lengths evaluated, as multiples of the trained length


class EvalError(Exception):
    """An evaluation that cannot run; the message names the cause and the fix."""


# ----------------------------------------------------------------------------- statistics

# Student t's 0.975 quantile for df = 1 .. 30; beyond, 1.96 + 2.5 / df (within 0.002 of it).
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042]


def mean_ci95(values):
    """(mean, half-width of the 95% interval of the mean) of values (n,), n >= 2."""
    values = np.asarray(values, dtype=np.float64)
    n = len(values)
    df = n - 1
    t = T975[df - 1] if df <= 30 else 1.96 + 2.5 / df
    return float(values.mean()), float(t * values.std(ddof=1) / math.sqrt(n))


def position_buckets(T):
    """[(first, last)] 1-based positions, both included: 1, 2-3, 4-7, ..., the last ending at T.
    Position T alone (T >= 4 a power of two) joins the bucket before it: T/2 .. T."""
    buckets, first = [], 1
    while first <= T:
        buckets.append((first, min(2 * first - 1, T)))
        first *= 2
    if len(buckets) > 2 and buckets[-1][0] == T:  # position 1 always stands alone
        buckets[-2:] = [(buckets[-2][0], T)]
    return buckets


# ----------------------------------------------------------------------------- tokens and bytes

def token_bytes(tokenizer, vocab_size):
    """(vocab_size,) int64: the UTF-8 bytes of each token id's text, 0 for the document
    separator and for ids the tokenizer does not use (the vocabulary's padding); None for
    tokens without text (the recall probe's). tokenizer: what data.load_tokenizer reads (a
    name, a checkpoint's spec, a tokenizer.json), or a data.TextTokenizer."""
    try:
        tok = tokenizer if isinstance(tokenizer, data.TextTokenizer) else data.load_tokenizer(tokenizer)
    except data.NoText:
        return None
    return tok.token_bytes(vocab_size)


class TextTokenizer(NamedTuple):
    """A checkpoint's tokenizer as the text evaluations use it. `problem(text)` says why a text
    cannot be encoded (None when it can); `encode` refuses such text with an EvalError."""
    name: str
    encode: Callable[[str], list]  # text -> token ids
    decode: Callable[[list], str]  # token ids -> text
    separator: int  # the id written before every training document (data.py): the context of an empty prompt
    problem: Callable[[str], Optional[str]]
    n_ids: int  # the ids it writes: the model must embed as many


def text_tokenizer(tokenizer):
    """The TextTokenizer of a checkpoint's tokenizer (anything data.load_tokenizer reads: 'gpt2',
    'byte', a checkpoint's spec, a tokenizer.json).

    Refused text (`problem`): the document separator's own text (GPT-2's "<|endoftext|>", the
    byte tokenizer's NUL) would end the document inside the text, which training never shows
    a model; and text that is not valid Unicode (a lone surrogate) has no UTF-8 bytes."""
    try:
        tok = data.load_tokenizer(tokenizer)
    except data.NoText:
        name = tokenizer if isinstance(tokenizer, str) else tokenizer.get("name")
        raise EvalError(f"the checkpoint was trained on {name!r} tokens, which have no text to render a task in; "
                        f"text evaluations (HellaSwag, lm-evaluation-harness tasks) need a checkpoint trained on "
                        f"text (gpt2, byte or a tokenizer file's shards)") from None
    except data.ShardError as e:
        raise EvalError(str(e)) from None
    separator_text = tok.decode([tok.eot])

    def problem(text):
        if separator_text in text:
            return f"the text holds {separator_text!r}, the {tok.name} tokenizer's document separator"
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"the text is not valid Unicode ({e.reason}: {text[e.start:e.end]!r} at character {e.start})"
        return None

    def encode(text):
        why = problem(text)
        if why:
            raise EvalError(why)
        return tok.encode(text)

    return TextTokenizer(tok.name, encode, tok.decode, tok.eot, problem, tok.n_ids)


def encoder(tokenizer):
    """text -> token ids, for the tokenizers that have text (text_tokenizer)."""
    return text_tokenizer(tokenizer).encode


def read_val(data_dir, n_tokens):
    """The first n_tokens tokens of data_dir's val shards (fewer if they hold fewer), int64."""
    parts, have = [], 0
    for path in data.find_shards(data_dir, "val"):
        part = np.asarray(data.load_shard(path)[: n_tokens - have])
        parts.append(part)
        have += len(part)
        if have >= n_tokens:
            break
    return np.concatenate(parts).astype(np.int64)


# ----------------------------------------------------------------------------- loss by position

@torch.no_grad()
def token_losses(model, x, y, autocast=nullcontext()):
    """x, y (B, T) -> the cross-entropy (nats) of each target, (B, T) float32."""
    with autocast:
        logits = model(x)[0]  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view(y.shape)


def loss_by_position(model, tokens, seq_len, n_seq, batch_size=4, device="cpu", autocast=nullcontext(),
                     bytes_per_token=None, unigram_log_p=None):
    """Loss by position of `model` on sequences of seq_len from the token stream `tokens` (N,):
    n_seq of them (fewer if the stream holds fewer), sequence i = tokens[i*L : i*L + L + 1].

    Returns {"seq_len", "n_seq", "tokens", "nats_per_token" (+ "_ci95" over sequences),
    "buckets": [{"first", "last", "mean", "ci95"}], and with bytes_per_token (token_bytes)
    "bits_per_byte", with unigram_log_p (V,) the unigram baseline on the same targets},
    or {"seq_len", "skipped": why} when the stream cannot fill 2 sequences."""
    L = seq_len
    n = min(n_seq, (len(tokens) - 1) // L)
    if n < 2:
        return {"seq_len": L, "skipped": f"the val data holds {len(tokens)} tokens, fewer than 2 sequences "
                                          f"of {L} + 1 (a 95% interval needs 2); add val data or lower the length"}
    rows = np.stack([tokens[i * L: i * L + L + 1] for i in range(n)])  # (n, L + 1)
    rows = torch.from_numpy(rows)
    losses = torch.cat([token_losses(model, rows[b: b + batch_size, :-1].to(device),
                                     rows[b: b + batch_size, 1:].to(device), autocast).cpu()
                        for b in range(0, n, batch_size)]).double().numpy()  # (n, L)
    targets = rows[:, 1:].numpy()  # (n, L)
    mean, ci = mean_ci95(losses.mean(axis=1))
    out = {"seq_len": L, "n_seq": n, "tokens": n * L, "nats_per_token": mean, "nats_per_token_ci95": ci,
           "buckets": []}
    for first, last in position_buckets(L):  # position p is index p - 1
        m, c = mean_ci95(losses[:, first - 1: last].mean(axis=1))
        out["buckets"].append({"first": first, "last": last, "mean": m, "ci95": c})
    if bytes_per_token is not None:
        nbytes = bytes_per_token[targets]  # (n, L)
        text = nbytes > 0
        total = int(nbytes.sum())
        out["bytes"] = total
        out["bits_per_byte"] = float(losses[text].sum() / total / math.log(2)) if total else None
    if unigram_log_p is not None:
        uni = -unigram_log_p[targets]  # (n, L) nats
        out["unigram_nats_per_token"] = float(uni.mean())
        if bytes_per_token is not None and out["bytes"]:
            out["unigram_bits_per_byte"] = float(uni[text].sum() / out["bytes"] / math.log(2))
    return out


def evaluate_lengths(model, data_dir, tokenizer, trained_len, n_seq, batch_size=4, device="cpu",
                     autocast=nullcontext(), factors=FACTORS, log=print):
    """loss_by_position at each factor x trained_len on data_dir's val shards -> a list of
    its results (skipped lengths included, with why), after printing one line per length."""
    vocab = model.cfg.vocab_size if hasattr(model, "cfg") else None

    def check_ids(name, n_ids):  # e.g. byte shards in a folder without tokenizer.json
        if vocab and vocab < n_ids:
            raise EvalError(f"the model embeds {vocab} token ids, fewer than the {n_ids} of the {name} tokens "
                            f"that {data_dir} is taken to hold (no tokenizer.json there?); record the folder's "
                            f"tokenizer with data.write_tokenizer (`python data.py` writes it)")
    try:
        if isinstance(tokenizer, str) and tokenizer in data.TOKENIZERS:  # its id count needs no files (offline)
            check_ids(tokenizer, data.TOKENIZERS[tokenizer][0])
        tok = data.load_tokenizer(tokenizer)
        check_ids(tok.name, tok.n_ids)
        bytes_per_token = token_bytes(tok, vocab) if vocab else None
    except data.NoText:  # ids without text (the recall probe's): no bytes to count
        bytes_per_token = None
    except (EvalError, data.ShardError) as e:
        bytes_per_token = None
        log(f"bits per byte: skipped: {e}")
    except OSError as e:  # tiktoken downloads GPT-2's BPE files on first use: offline, it cannot
        bytes_per_token = None
        log(f"bits per byte: skipped: GPT-2's BPE files could not be loaded ({type(e).__name__}); connect "
            f"once, or set TIKTOKEN_CACHE_DIR to a folder that holds them, then run `python evaluate.py` "
            f"on the checkpoint")
    try:
        unigram_log_p = data.unigram_log_probs(data_dir)
    except data.ShardError as e:
        unigram_log_p = None
        log(f"note: no unigram baseline: {e}")
    tokens = read_val(data_dir, n_seq * trained_len * max(factors) + 1)
    results = []
    for factor in factors:
        L = trained_len * factor
        rows = max(1, batch_size // factor)  # batch_size counts sequences of the trained length
        try:
            r = loss_by_position(model, tokens, L, n_seq, rows, device, autocast, bytes_per_token,
                                 unigram_log_p)
        except torch.OutOfMemoryError:
            r = {"seq_len": L, "skipped": f"out of memory at {rows} x {L} tokens a forward pass; lower --batch_size"}
        r["factor"] = factor
        results.append(r)
        if "skipped" in r:
            log(f"length {L} ({factor}x): skipped: {r['skipped']}")
            continue
        bpb = f", {r['bits_per_byte']:.4f} bits/byte" if r.get("bits_per_byte") is not None else ""
        uni = (f" (unigram {r['unigram_nats_per_token']:.4f}" + (f", {r['unigram_bits_per_byte']:.4f}"
               if r.get("unigram_bits_per_byte") is not None else "") + ")") if "unigram_nats_per_token" in r else ""
        log(f"length {L} ({factor}x, {r['n_seq']} seqs): {r['nats_per_token']:.4f} nats/token{bpb}{uni}")
        log("  by position: " + " | ".join(f"{b['first']}{'' if b['first'] == b['last'] else '-' + str(b['last'])} "
                                          f"{b['mean']:.3f}±{b['ci95']:.3f}" for b in r["buckets"]))
    return results


# ----------------------------------------------------------------------------- recall in text

RECALL_KEYS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"  # 52 keys: half the lags exceed 64
RECALL_VALUES = "0123456789"  # chance 1/10


@torch.no_grad()
def recall_probe(model, tokenizer, seq_len, window, n_seq=64, seed=0, batch_size=8, device="cpu",
                 autocast=nullcontext()):
    """Associative recall in a text model's own tokens, training-free: can the model copy a
    value it saw far back? The sequences are MQAR's (data.recall_sequences, the generator of
    experiments/recall.py): each draws a fresh map key -> value and is a stream of `key value`
    pairs, keys at random, so a key recurs at many distances; at a recurring key the model
    should predict the value seen after its previous occurrence, which nothing but that
    occurrence tells (an induction-head copy, as the needle tasks of The Sparse Frontier,
    Nawrot et al. 2025, ask of a pretrained model). Keys are letters and values digits, each
    one token of the tokenizer (a byte for the byte tokenizer), written without spaces
    ("a3k7a3..."), after the document separator. A prediction is the most likely of the 10
    digits at the query (chance 0.1), so a model that has not learnt to expect a digit there
    still shows what it retrieves.

    lag: query position minus the position of the answer's earlier token; a window W sees it
    iff lag <= W. Returns {"seq_len", "n_seq", "n_queries", "chance", "accuracy", "window",
    "buckets": [{"lo", "hi", "n", "acc"}] for lags lo < lag <= hi}."""
    tok = data.load_tokenizer(tokenizer)  # NoText: ids without text have no letters to write
    ids = []
    for ch in RECALL_KEYS + RECALL_VALUES:
        piece = tok.encode(ch)
        if len(piece) != 1:
            raise EvalError(f"the {tok.name} tokenizer writes {ch!r} as {len(piece)} tokens; the recall probe "
                            f"needs a token per letter and digit")
        ids += piece
    vocab = model.cfg.vocab_size if hasattr(model, "cfg") else None
    if vocab is not None and max(ids + [tok.eot]) >= vocab:
        raise EvalError(f"the {tok.name} tokenizer's letters and digits are beyond the model's {vocab} ids")
    n_keys, n_values = len(RECALL_KEYS), len(RECALL_VALUES)
    raw, q = data.recall_sequences(n_seq, seq_len + seq_len % 2, n_keys, n_values, seed)  # ids: keys, then values
    table = np.array(ids, dtype=np.int64)
    x = np.concatenate([np.full((n_seq, 1), tok.eot), table[raw.astype(np.int64)][:, : seq_len - 1]], axis=1)
    keep = q["pos"] + 1 < seq_len  # the logits at input index pos + 1 (the key) predict the answer
    q = {k: v[keep] for k, v in q.items()}
    x = torch.from_numpy(x)  # (N, seq_len)
    value_ids = torch.tensor(ids[n_keys:], device=device)
    chosen = []
    for b in range(0, n_seq, batch_size):
        with autocast:
            logits = model(x[b: b + batch_size].to(device))[0]  # (B, T, V)
        chosen.append(logits[..., value_ids].argmax(-1).cpu())  # (B, T): the most likely digit
    chosen = torch.cat(chosen).numpy()
    correct = chosen[q["seq"], q["pos"] + 1] == q["answer"] - n_keys
    lag = q["distance"] - 1
    buckets = []
    for lo, hi in ((0, window), (window, 2 * window), (2 * window, None)):
        sel = (lag > lo) & (lag <= hi if hi is not None else True)
        buckets.append({"lo": lo, "hi": hi, "n": int(sel.sum()),
                        "acc": float(correct[sel].mean()) if sel.any() else None})
    return {"seq_len": seq_len, "n_seq": n_seq, "n_queries": int(len(correct)), "chance": 1 / n_values,
            "accuracy": float(correct.mean()), "window": window, "buckets": buckets}


def describe_recall(r):
    """One line of a recall_probe result."""
    cells = [f"lag {b['lo']}-{b['hi'] if b['hi'] is not None else ''}: "
             + (f"{b['acc']:.3f} (n={b['n']})" if b["acc"] is not None else "none") for b in r["buckets"]]
    return (f"recall at {r['seq_len']} tokens: {r['accuracy']:.3f} of {r['n_queries']} queries (chance "
            f"{r['chance']:.2f}); " + " | ".join(cells))


# ----------------------------------------------------------------------------- HellaSwag

def read_items(path, expected=None):
    """A HellaSwag jsonl file -> [{"ctx": str, "endings": [4 str], "label": int}], checked.
    expected: the number of items the file must hold (None: any)."""
    items = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ctx, endings, label = row["ctx"], row["endings"], int(row["label"])
                ok = (isinstance(ctx, str) and isinstance(endings, list) and len(endings) == 4
                      and all(isinstance(e, str) for e in endings) and 0 <= label < 4)
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                raise EvalError(f"{path}:{n}: not a HellaSwag item (needs \"ctx\": str, \"endings\": 4 str, "
                                f"\"label\": 0..3); delete the file to download it again, or fix --hellaswag_file")
            items.append({"ctx": ctx, "endings": endings, "label": label})
    if expected is not None and len(items) != expected:
        raise EvalError(f"{path}: {len(items)} items, expected {expected} (HellaSwag validation); a cut-short "
                        f"download? delete it to download it again")
    return items


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def hellaswag_items(cache_dir):
    """HellaSwag validation from cache_dir, downloaded there on first use (module docstring:
    the SHA-256 is recorded at the first download and verified at every later use)."""
    path = Path(cache_dir) / "hellaswag_val.jsonl"
    record = Path(f"{path}.sha256")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.tmp")
        try:
            with urllib.request.urlopen(HELLASWAG_URL, timeout=60) as r, open(tmp, "wb") as f:
                while block := r.read(1 << 20):
                    f.write(block)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise EvalError(f"cannot download HellaSwag from {HELLASWAG_URL} ({e}); on a machine without "
                            f"internet, copy hellaswag_val.jsonl into {path.parent} (or pass --hellaswag_file)") from None
        read_items(tmp, HELLASWAG_ITEMS)  # a cut or wrong file is refused before it is kept
        record.write_text(sha256_of(tmp) + "\n")
        os.replace(tmp, path)
    digest = sha256_of(path)
    if not record.exists():  # placed by hand: record it now, as a download would
        record.write_text(digest + "\n")
    elif record.read_text().strip() != digest:
        raise EvalError(f"{path}: SHA-256 {digest} differs from the {record.read_text().strip()} recorded when it "
                        f"was downloaded (changed or damaged); delete {path} and {record.name} to download it again")
    return read_items(path, HELLASWAG_ITEMS)


def render(item, encode, max_len):
    """An item -> 4 rows of token ids (context + ending i) and 4 masks (1 on the ending's
    tokens), and whether the context was cut: a row longer than max_len keeps its last
    context tokens (at least one), never fewer ending tokens."""
    ctx = encode(item["ctx"])
    rows, masks, cut = [], [], False
    for ending in item["endings"]:
        end = encode(" " + ending)  # GPT-2 BPE puts the space in the ending's first token
        keep = max(1, max_len - len(end))
        cut |= len(ctx) > keep
        rows.append(ctx[-keep:] + end)
        masks.append([0] * len(ctx[-keep:]) + [1] * len(end))
    return rows, masks, cut


@torch.no_grad()
def ending_losses(model, rows, masks, device="cpu", autocast=nullcontext()):
    """Rows of token ids (ragged) and their masks -> (summed, mean) loss over each row's
    masked targets, float64 (R,) each. Rows are right-padded: a causal model's loss at a
    position never depends on the padding after it."""
    R, T = len(rows), max(map(len, rows))
    idx = torch.zeros(R, T, dtype=torch.long)
    mask = torch.zeros(R, T)
    for r, (row, m) in enumerate(zip(rows, masks)):
        idx[r, :len(row)] = torch.tensor(row)
        mask[r, :len(m)] = torch.tensor(m, dtype=torch.float)
    losses = token_losses(model, idx[:, :-1].to(device), idx[:, 1:].to(device), autocast).double().cpu()  # (R, T-1)
    mask = mask[:, 1:].double()  # token t + 1 is predicted at position t
    summed = (losses * mask).sum(1)
    return summed, summed / mask.sum(1)


def hellaswag(model, items, tokenizer, device="cpu", autocast=nullcontext(), max_len=1024, batch_items=8,
              rank=0, world=1):
    """acc and acc_norm of `model` on `items` (read_items); this rank scores items rank,
    rank + world, ...; the counts are summed over ranks (all ranks must call it).
    Returns {"items", "acc", "acc_norm", "contexts_cut", "chance"}."""
    text = text_tokenizer(tokenizer)
    encode = text.encode
    vocab = model.cfg.vocab_size if hasattr(model, "cfg") else None
    top = text.n_ids - 1  # the largest id the tokenizer can write
    if vocab is not None and top >= vocab:  # checked before any rank starts, so all stop alike
        raise EvalError(f"the {text.name} tokenizer writes ids up to {top}, beyond the model's vocabulary of "
                        f"{vocab}: the checkpoint cannot read the task's text")
    counts = torch.zeros(4, dtype=torch.float64)  # items, correct by sum, correct by mean, contexts cut
    mine = items[rank::world]
    for start in range(0, len(mine), batch_items):
        batch = mine[start: start + batch_items]
        rows, masks = [], []
        for item in batch:
            r, m, cut = render(item, encode, max_len)
            rows += r
            masks += m
            counts[3] += cut
        summed, mean = ending_losses(model, rows, masks, device, autocast)
        summed, mean = summed.view(-1, 4), mean.view(-1, 4)  # (items, 4 endings)
        labels = torch.tensor([item["label"] for item in batch])
        counts[0] += len(batch)
        counts[1] += (summed.argmin(1) == labels).sum()
        counts[2] += (mean.argmin(1) == labels).sum()
    if world > 1:
        counts = counts.to(device)
        dist.all_reduce(counts)  # the counts of every rank's share
        counts = counts.cpu()
    n = int(counts[0])
    return {"items": n, "acc": float(counts[1] / n), "acc_norm": float(counts[2] / n),
            "contexts_cut": int(counts[3]), "chance": 0.25}


def hellaswag_on_ranks(model, tokenizer, cache_dir, file="", device="cpu", autocast=nullcontext(),
                       max_len=1024, batch_items=8, max_items=0, rank=0, world=1):
    """hellaswag() on the cached (or --hellaswag_file) items: rank 0 reads them (downloading
    them on first use) and sends them, or why it could not, to every rank (nodes need not
    share a filesystem). Raises EvalError on every rank when it cannot run."""
    items, problem = None, None
    if rank == 0:
        try:
            encoder(tokenizer)
            items = read_items(file) if file else hellaswag_items(cache_dir)
        except (EvalError, OSError) as e:
            problem = str(e)
    if world > 1:
        payload = [items, problem]
        dist.broadcast_object_list(payload, src=0)
        items, problem = payload
    if problem:
        raise EvalError(problem)
    items = items[:max_items] if max_items else items
    return hellaswag(model, items, tokenizer, device, autocast, max_len, batch_items, rank, world)


# ----------------------------------------------------------------------------- lm-evaluation-harness

@torch.no_grad()
def continuation_log_probs(model, pairs, max_len, batch_size=8, device="cpu", autocast=nullcontext()):
    """[(context ids, continuation ids)] -> [(log p(continuation | context), greedy)], in order:
    the summed log-probability (nats) of the continuation's tokens, and whether each of them is
    the model's most likely next token.

    A row is the last max_len + 1 tokens of context + continuation, less the last token (the
    rule of the harness's Hugging Face model): a context too long for the model loses its first
    tokens; a continuation longer than max_len is refused (EvalError), since its first tokens
    could not be scored. Rows run longest first, batch_size at a time, right-padded: a causal
    model's outputs at a position never depend on the padding after it."""
    for context, continuation in pairs:
        if len(continuation) > max_len:
            raise EvalError(f"a continuation of {len(continuation)} tokens is longer than the model's context of "
                            f"{max_len}; raise max_length in --model_args")
    order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    out = [None] * len(pairs)
    for start in range(0, len(order), batch_size):
        batch = order[start: start + batch_size]
        rows = [(pairs[i][0] + pairs[i][1])[-(max_len + 1):][:-1] for i in batch]
        idx = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)  # (B, T)
        for r, row in enumerate(rows):
            idx[r, :len(row)] = torch.tensor(row)
        with autocast:
            logits = model(idx.to(device))[0]  # (B, T, V)
        for r, i in enumerate(batch):
            continuation = torch.tensor(pairs[i][1], device=logits.device)  # (n,)
            end = len(rows[r])  # position t predicts token t + 1: the continuation's n tokens
            log_p = logits[r, end - len(continuation): end].float().log_softmax(-1)  # (n, V)
            out[i] = (float(log_p.gather(1, continuation[:, None]).sum()),
                      bool((log_p.argmax(-1) == continuation).all()))
    return out


try:  # optional: pip install -r requirements-dev.txt (the pinned lm-eval)
    import lm_eval.models  # noqa: F401  lm_eval adds its own only to an empty registry: first, so ours hides none
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import model_registry
except ImportError:
    TemplateLM, model_registry = object, None

HARNESS_MODEL = "attention-gym-lm"  # the name lm_eval's --model knows this adapter by


class HarnessLM(TemplateLM):
    """A checkpoint of ours (any variant) as an lm-evaluation-harness model: loglikelihood,
    rolling loglikelihood (perplexity tasks) and greedy generation.

    --model_args: ckpt (a run folder or checkpoint file) or init_from (a Hugging Face Qwen3
    folder or Hub id, with attn: the variant it is converted to, default full), max_length
    (default: the trained seq_len; with init_from 2048), kernel (fused | ref; default fused,
    as in training: its generation decodes through kernels.DECODE; the path is printed). The harness's
    --batch_size and --device reach it too (device: CUDA when there is one, else CPU; the
    harness's default cuda:0 falls back to CPU with a note when there is none). On CUDA the
    forward runs in bf16 autocast, log-probabilities in float32.

    Text is encoded with the checkpoint's tokenizer (text_tokenizer); an empty context is the
    document separator every training document starts with. A context longer than max_length
    loses its first tokens (continuation_log_probs); rolling loglikelihood scores a text in
    the harness's windows of max_length (get_rolling_token_windows: every token scored once,
    the first window after the separator, each later one from the token before it, the last
    from a full window). A request whose text the tokenizer refuses is one EvalError naming its
    task and document, before any is scored."""

    def __init__(self, ckpt="", init_from="", attn="full", max_length=0, kernel="fused", batch_size=8, device="",
                 max_batch_size=None, **unknown):
        if model_registry is None:
            raise EvalError("the lm-evaluation-harness adapter needs lm_eval: pip install -r requirements-dev.txt")
        super().__init__()
        from model import CheckpointError, hf_model_config, load_checkpoint, load_hf

        if unknown:
            raise EvalError(f"{HARNESS_MODEL}: unknown --model_args {sorted(unknown)}; "
                            f"it takes ckpt or init_from (with attn), max_length, kernel")
        if bool(ckpt) == bool(init_from):
            raise EvalError(f"{HARNESS_MODEL}: --model_args needs ckpt=RUN_DIR_OR_FILE or init_from=HF_FOLDER_OR_HUB_ID")
        if batch_size == "auto" or str(batch_size).startswith("auto"):
            print(f"note: {HARNESS_MODEL} has no automatic batch size; using 8 (set --batch_size N)", file=sys.stderr)
            batch_size = 8
        device = str(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.startswith("cuda") and not torch.cuda.is_available():
            print(f"note: {HARNESS_MODEL}: no CUDA device here, running on cpu", file=sys.stderr)
            device = "cpu"
        if init_from:  # CheckpointError: one line
            from config import pretrained_tokenizer

            settings = dict(attn=attn, kernel=kernel)
            try:
                tok = pretrained_tokenizer(str(init_from), hf_model_config(str(init_from), **settings))
                self.model, _ = load_hf(str(init_from), device, **settings)
            except ValueError as e:  # e.g. an unknown attn
                raise EvalError(f"{HARNESS_MODEL}: init_from={init_from}: {e}") from None
            checkpoint = {"tokenizer": tok.spec, "train_config": {"seq_len": 2048}}
        else:
            self.model, checkpoint = load_checkpoint(str(ckpt), device, kernel=kernel)  # CheckpointError: one line
        print(f"{HARNESS_MODEL}: attention: {attention_path(self.model.cfg, device)}", file=sys.stderr)
        self.tokenizer = text_tokenizer(checkpoint.get("tokenizer", "gpt2"))
        top = self.tokenizer.n_ids - 1
        if top >= self.model.cfg.vocab_size:
            raise CheckpointError(f"{ckpt}: the model embeds {self.model.cfg.vocab_size} token ids, fewer than "
                                  f"the {top + 1} of its recorded {self.tokenizer.name} tokenizer")
        self.max_length = int(max_length) or (checkpoint.get("train_config") or {}).get("seq_len") or 1024
        self.batch_size = int(batch_size)
        self._device = torch.device(device)
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else nullcontext()

    # what TemplateLM asks of a model: its separator, its encoder, and a scorer of token pairs

    @property
    def eot_token_id(self):
        return self.tokenizer.separator

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens, **kwargs):
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """[(cache key: (context, continuation) text, context ids, continuation ids)] -> [(log p, greedy)]."""
        for key, _, continuation in requests:
            if len(continuation) > self.max_length:  # the harness's HF model refuses these too (an assert)
                raise EvalError(f"the continuation {key[1]!r} is {len(continuation)} tokens, more than the model's "
                                f"context of {self.max_length}; raise max_length in --model_args or drop the task")
        scores = continuation_log_probs(self.model, [(c, x) for _, c, x in requests], self.max_length,
                                        self.batch_size, self.device, self.autocast)
        for (key, _, _), score in zip(requests, scores):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, score)
        return scores

    def check_text(self, requests):
        """One EvalError naming the first request whose text the tokenizer cannot encode."""
        for r in requests:
            for text in r.args:
                why = self.tokenizer.problem(text) if isinstance(text, str) else None
                if why:
                    raise EvalError(f"task {r.task_name!r}, document {r.doc_id}: {why}, which this checkpoint's "
                                    f"tokenizer cannot encode; drop the task or fix its documents")

    def loglikelihood(self, requests, disable_tqdm=False):
        self.check_text(requests)
        return super().loglikelihood(requests, disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        self.check_text(requests)
        windows, owner = [], []  # (context, continuation) ids; the request each came from
        for i, r in enumerate(requests):
            for window in get_rolling_token_windows(self.tok_encode(r.args[0]), self.prefix_token_id,
                                                    self.max_length, context_len=1):
                windows.append(make_disjoint_window(window))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (log_p, _) in zip(owner, continuation_log_probs(self.model, windows, self.max_length, self.batch_size,
                                                               self.device, self.autocast)):
            totals[i] += log_p
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm=False):
        """Greedy decoding with the KV cache, one request at a time, until a stop string
        (`until`, default: the separator's text), the separator itself, or max_gen_toks
        (default 256). The context keeps its last max_length - max_gen_toks tokens (at least
        one), as the harness's Hugging Face model does."""
        self.check_text(requests)
        outputs = []
        for r in requests:
            context, kwargs = r.args
            kwargs = dict(kwargs or {})
            if kwargs.get("do_sample") or kwargs.get("temperature", 0) > 0:
                raise EvalError(f"task {r.task_name!r} asks for sampling ({kwargs}); {HARNESS_MODEL} generates "
                                f"greedily only (do_sample=False)")
            until = kwargs.get("until") or [self.tokenizer.decode([self.tokenizer.separator])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", 256))
            ids = self.tok_encode(context)[-max(1, self.max_length - max_new):] or [self.tokenizer.separator]
            cache, inputs, new = self.model.new_cache(len(ids) + max_new), torch.tensor([ids], device=self.device), []
            text = ""
            for _ in range(max_new):
                with self.autocast:
                    token = int(self.model(inputs, cache=cache, last_only=True)[0][0, -1].argmax())
                if token == self.tokenizer.separator:
                    break
                new.append(token)
                text = self.tokenizer.decode(new)
                if any(stop in text for stop in until):
                    break
                inputs = torch.tensor([[token]], device=self.device)
            for stop in until:
                text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", r.args, text)
            outputs.append(text)
        return outputs


if model_registry is not None and HARNESS_MODEL not in model_registry:  # once, however often this file is imported
    model_registry.register(HARNESS_MODEL)(HarnessLM)


# ----------------------------------------------------------------------------- one checkpoint or run

def evaluate_model(model, *, data_dir, tokenizer, trained_len, step=None, n_seq=8, batch_size=4,
                   device="cpu", autocast=nullcontext(), hellaswag_on=False, hellaswag_dir="data/hellaswag",
                   hellaswag_file="", hellaswag_len=0, hellaswag_max=0, recall_seqs=0, rank=0, world=1, log=print):
    """Every evaluation of one model -> the eval.json record (complete on rank 0). Loss by
    position and the recall probe (recall_seqs sequences at the trained length; 0: off) run on
    rank 0 (a few sequences); HellaSwag on every rank. What cannot run is recorded with its
    reason (one printed line) and the rest still runs. All ranks must call it."""
    was_training = model.training
    model.eval()
    out = {"step": step, "tokenizer": tokenizer if isinstance(tokenizer, str) else tokenizer["name"],
           "data_dir": data_dir, "trained_len": trained_len,
           "attn": getattr(getattr(model, "cfg", None), "attn", None)}
    if rank == 0 and n_seq > 0:
        try:
            out["positions"] = evaluate_lengths(model, data_dir, tokenizer, trained_len, n_seq, batch_size,
                                                device, autocast, log=log)
            first = out["positions"][0]
            for key in ("nats_per_token", "bits_per_byte"):
                out[key] = first.get(key)
            out["unigram"] = {"nats_per_token": first.get("unigram_nats_per_token"),
                              "bits_per_byte": first.get("unigram_bits_per_byte")}
        except data.ShardError as e:
            out["positions_skipped"] = str(e)
            log(f"loss by position: skipped: {e}")
    if rank == 0 and recall_seqs > 0:
        try:
            window = getattr(getattr(model, "cfg", None), "window", trained_len // 4)
            out["recall"] = recall_probe(model, tokenizer, trained_len, window, recall_seqs, batch_size=batch_size,
                                         device=device, autocast=autocast)
            log(describe_recall(out["recall"]))
        except (EvalError, data.ShardError) as e:
            out["recall"] = {"skipped": str(e)}
            log(f"recall: skipped: {e}")
    if hellaswag_on:
        try:
            out["hellaswag"] = hellaswag_on_ranks(model, tokenizer, hellaswag_dir, hellaswag_file, device, autocast,
                                                  hellaswag_len or trained_len, 8, hellaswag_max, rank, world)
            h = out["hellaswag"]
            log(f"hellaswag: acc {h['acc']:.4f} | acc_norm {h['acc_norm']:.4f} on {h['items']} items (chance 0.25)"
                + (f"; {h['contexts_cut']} contexts cut to {hellaswag_len or trained_len} tokens" if h["contexts_cut"] else ""))
        except EvalError as e:
            out["hellaswag"] = {"skipped": str(e)}
            log(f"hellaswag: skipped: {e}")
    model.train(was_training)
    return out


DEFAULTS = dict(ckpt="", init_from="", data_dir="", out="", seq_len=0, n_seq=64, recall=0, batch_size=4,
                hellaswag=False, hellaswag_dir="data/hellaswag", hellaswag_file="", hellaswag_len=0, hellaswag_max=0,
                device="auto", kernel="fused")

def harness_main(args):
    """`python evaluate.py harness ARGS`: lm_eval's own command line (ARGS as they would follow
    `lm_eval`) in a process where HarnessLM is registered as HARNESS_MODEL. lm_eval 0.4.13
    finds models only in its registry, filled at import (no plugin entry points), so its own
    `lm_eval` command cannot see this one. A checkpoint or a task this adapter cannot use is
    one line on stderr and exit status 1."""
    from model import CheckpointError

    if model_registry is None:
        print("evaluate.py harness: needs lm_eval: pip install -r requirements-dev.txt", file=sys.stderr)
        return 1
    from lm_eval.__main__ import cli_evaluate

    saved, sys.argv = sys.argv, ["lm_eval", *args]
    try:
        cli_evaluate()
    except (EvalError, CheckpointError) as e:
        print(f"evaluate.py harness: {e}", file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return 0


def main(argv=None):
    """The command line (module docstring); flags: DEFAULTS, as --key=value, and with
    --init_from the variant's (config.VARIANT_DEFAULTS)."""
    from model import CheckpointError, describe_hf_load, load_checkpoint
    from config import cuda_missing, fail, init_process_group, load_pretrained, parse_source_flags, resolve_device

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["harness"]:
        return harness_main(argv[1:])
    args, settings = parse_source_flags(argv, DEFAULTS, "evaluate.py", doc=__doc__)
    if args["init_from"] and not (args["data_dir"] and args["out"]):
        fail("evaluate.py: --init_from needs --data_dir=SHARDS (of the checkpoint's tokenizer) and --out=FILE.json")
    ddp = "RANK" in os.environ
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = resolve_device(args["device"])
    if device.startswith("cuda"):
        if cuda_missing():
            fail(f"evaluate.py: {cuda_missing()}")
        torch.cuda.set_device(device)
    if ddp:
        init_process_group("nccl" if device.startswith("cuda") else "gloo", rank, world)
    log = print if rank == 0 else (lambda *a, **k: None)
    if args["init_from"]:  # training-free: a pretrained checkpoint, converted to --attn
        settings["kernel"] = args["kernel"]
        model, tok, summary = load_pretrained(args["init_from"], device, settings, "evaluate.py")
        try:
            data.check_tokenizer(args["data_dir"], tok)
        except data.ShardError as e:
            fail(f"evaluate.py: {e}", code=1)
        ckpt = {"step": 0, "tokenizer": tok.spec, "train_config": {"seq_len": args["seq_len"] or 1024}}
        for line in describe_hf_load(summary):
            log(line)
        log(f"training-free: attn={model.cfg.attn}: {VARIANTS[model.cfg.attn].FROM_PRETRAINED}")
    else:
        try:
            model, ckpt = load_checkpoint(args["ckpt"], device, kernel=args["kernel"])
        except CheckpointError as e:
            fail(f"evaluate.py: {e}", code=1)
    train_config = ckpt.get("train_config") or {}
    trained_len = args["seq_len"] or train_config.get("seq_len") or 1024
    data_dir = args["data_dir"] or train_config.get("data_dir", "")
    source = args["ckpt"] or args["init_from"]
    tokenizer = ckpt.get("tokenizer", "gpt2")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else nullcontext()
    log(f"{source}: attn={model.cfg.attn}, step {ckpt.get('step', '?')}, "
        f"{'evaluated' if args['init_from'] else 'trained'} at {trained_len} tokens, "
        f"tokenizer {tokenizer if isinstance(tokenizer, str) else tokenizer['name']}, val data {data_dir}")
    log(f"attention: {attention_path(model.cfg, device)}")
    record = evaluate_model(model, data_dir=data_dir, tokenizer=tokenizer, trained_len=trained_len,
                            step=ckpt.get("step"), n_seq=args["n_seq"], batch_size=args["batch_size"], device=device,
                            autocast=autocast, hellaswag_on=args["hellaswag"], hellaswag_dir=args["hellaswag_dir"],
                            hellaswag_file=args["hellaswag_file"], hellaswag_len=args["hellaswag_len"],
                            hellaswag_max=args["hellaswag_max"], recall_seqs=args["recall"], rank=rank, world=world,
                            log=log)
    record["checkpoint"] = str(source)
    if args["init_from"]:
        record["init_from"] = {"path": args["init_from"], "settings": settings, "start": VARIANTS[model.cfg.attn].FROM_PRETRAINED,
                               "new": [line.strip() for line in describe_hf_load(summary)[1:]]}
    if ddp:
        dist.destroy_process_group()
    if rank == 0:
        run_dir = args["ckpt"] if os.path.isdir(args["ckpt"]) else os.path.dirname(args["ckpt"]) or "."
        out = args["out"] or os.path.join(run_dir, "eval.json")
        Path(out).write_text(json.dumps(record, indent=1) + "\n")
        log(f"wrote {out}")
    failed = "skipped" in record.get("hellaswag", {}) or "positions_skipped" in record
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
