"""Generate text from a checkpoint written by train.py, decoding with a KV cache.

    python sample.py --ckpt=out/RUN [--prompt="Once upon a time" | --prompt_file=PATH]
                     [--max_new_tokens=200] [--temperature=0.8] [--top_k=200] [--seed=1337]
                     [--device=cpu|cuda|auto] [--kernel=ref|fused] [--png=PATH]

The model config travels with the checkpoint (`ckpt['model_config']`), so no flag repeats it.
Every variant decodes with a KV cache (model.py's KVCache): `full`, `asga` and `caa` keep every
key, `local` and windowed `dsa` keep a rolling cache of at most `window` keys between steps.
`generate(..., use_cache=False)` recomputes the whole sequence for every token instead; the
two give the same tokens (tests/test_sample.py).

A prompt longer than the model's training context (train_config's seq_len) keeps its last
seq_len tokens, with a note. Generation itself may run past seq_len: every variant is defined
at every length (SPEC.md), though a model has only been trained on contexts up to seq_len.
"""
import os
import shlex
import sys
import time
from dataclasses import fields
from pathlib import Path

# Before torch loads OpenMP: idle threads sleep instead of spinning, which matters on a
# CPU shared with other processes (train.py and the tests do the same).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from model import Model, ModelConfig

EOT = 50256  # GPT-2 <|endoftext|>: an empty prompt starts a new document, as in training


def _default_tiktoken_cache():
    """Use the checked-out GPT-2 BPE files when they sit beside the repo (offline machines);
    anywhere else tiktoken downloads them itself."""
    local = Path(__file__).resolve().parent.parent / "shared" / "tiktoken"
    if local.is_dir() and "TIKTOKEN_CACHE_DIR" not in os.environ:
        os.environ["TIKTOKEN_CACHE_DIR"] = str(local)


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the path and the problem."""


# ----------------------------------------------------------------------------- loading

def find_checkpoint(path):
    """A run directory (holding ckpt.pt) or a checkpoint file -> the file's Path."""
    path = Path(path)
    if path.is_dir():
        path = path / "ckpt.pt"
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint (give a run directory holding "
                              f"ckpt.pt, or the .pt file itself)")
    return path


def load_checkpoint(path, device="cpu", kernel=None):
    """Load a checkpoint written by train.py -> (model in eval mode, ckpt dict).

    Tolerant of what a run may add or wrap: state-dict keys prefixed by torch.compile
    (`_orig_mod.`) or DDP (`module.`), config keys this version of ModelConfig does not know
    (dropped, with a note), and a model_config missing from the checkpoint but present in
    the run's config.json."""
    path = find_checkpoint(path)
    try:
        ckpt = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # truncated file, not a torch file, ...
        raise CheckpointError(f"{path}: cannot read checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise CheckpointError(f"{path}: not a train.py checkpoint (expected a dict with 'model')")
    model_config = ckpt.get("model_config") or _config_json(path.parent).get("model")
    if not model_config:
        raise CheckpointError(f"{path}: no 'model_config' in the checkpoint and no config.json "
                              f"beside it")
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(model_config) - known)
    if unknown:
        print(f"note: {path}: ignoring model_config keys this ModelConfig lacks: {unknown}",
              file=sys.stderr)
    model_config = {k: v for k, v in model_config.items() if k in known}
    if kernel is not None:
        model_config["kernel"] = kernel
    try:
        model = Model(ModelConfig(**model_config))
        state = {_strip_prefixes(k): v for k, v in ckpt["model"].items()}
        model.load_state_dict(state)
    except (ValueError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"{path}: checkpoint does not fit the model ({e})") from None
    ckpt.setdefault("train_config", _config_json(path.parent).get("train", {}))
    return model.to(device).eval(), ckpt


def _strip_prefixes(key):
    for prefix in ("_orig_mod.", "module."):
        while key.startswith(prefix):
            key = key[len(prefix):]
    return key.replace("._orig_mod.", ".")


def _config_json(run_dir):
    """The run's config.json as a dict ({} when absent or unreadable)."""
    import json

    try:
        return json.loads((Path(run_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def context_length(ckpt):
    """The sequence length the model was trained on, or None when the checkpoint lacks it."""
    train_config = ckpt.get("train_config") or {}
    for key in ("seq_len", "block_size", "sequence_length", "T"):
        if isinstance(train_config.get(key), int):
            return train_config[key]
    return None


# ----------------------------------------------------------------------------- text

def text_codec(tokenizer):
    """(encode, decode, document start id) for the tokenizer a checkpoint was trained with
    (train.py records data.tokenizer_of(data_dir)'s name; older checkpoints are GPT-2).
    An empty prompt is the document start id alone, as every training document begins."""
    from data import BYTE_EOT, decode_bytes, encode_bytes

    if tokenizer == "byte":
        # Sampled bytes need not form UTF-8 (a cut multibyte character): decode_bytes
        # replaces those with U+FFFD; the NUL that starts a document prints as a newline.
        return (lambda text: encode_bytes(text).tolist(),
                lambda tokens: decode_bytes(tokens).replace("\0", "\n"), BYTE_EOT)
    if tokenizer == "gpt2":
        _default_tiktoken_cache()
        import tiktoken

        enc = tiktoken.get_encoding("gpt2")
        return (lambda text: enc.encode(text, allowed_special={"<|endoftext|>"}), enc.decode, EOT)
    raise CheckpointError(f"this checkpoint was trained on {tokenizer!r} tokens, which have no "
                          f"text to decode; sample.py reads checkpoints of gpt2 or byte shards")


def tokenizer_of_checkpoint(ckpt, path):
    """The tokenizer recorded in the checkpoint, else in the run's config.json, else gpt2."""
    return ckpt.get("tokenizer") or _config_json(Path(path).parent).get("tokenizer") or "gpt2"


# ----------------------------------------------------------------------------- decoding

def sample_next(logits, temperature=1.0, top_k=None, generator=None):
    """logits (B, V) -> next tokens (B, 1). temperature 0 is greedy (argmax)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True,
             generator=None, on_step=None):
    """Continue idx (B, T) by max_new_tokens tokens -> (B, T + max_new_tokens).

    use_cache=True feeds the prompt once, then one token per step, reading earlier keys and
    values from the KV cache; use_cache=False recomputes the full forward pass over the whole
    sequence for every token (the reference the cache must match). `on_step(cache)`, when
    given, is called after every forward pass (cache is None without one): tests check the
    rolling cache's size there."""
    cache = model.new_cache() if use_cache else None
    inputs = idx
    for _ in range(max_new_tokens):
        logits, _ = model(inputs, cache=cache)
        if on_step is not None:
            on_step(cache)
        next_token = sample_next(logits[:, -1, :], temperature, top_k, generator)
        idx = torch.cat([idx, next_token], dim=1)
        inputs = next_token if use_cache else idx
    return idx


# ----------------------------------------------------------------------------- command line

DEFAULTS = dict(ckpt="", prompt="", prompt_file="", max_new_tokens=200, temperature=0.8,
                top_k=200, seed=1337, device="auto", kernel="ref", png="")


def parse_args(argv):
    """`--key=value` overrides of DEFAULTS, type-checked; unknown keys list the valid ones."""
    args = dict(DEFAULTS)
    for arg in argv:
        key, eq, value = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or not eq or key not in DEFAULTS:
            sys.exit(f"sample.py: bad argument {arg!r}; use --key=value with key one of: "
                     f"{', '.join(DEFAULTS)}")
        kind = type(DEFAULTS[key])
        try:
            args[key] = kind(value)
        except ValueError:
            sys.exit(f"sample.py: --{key} wants a {kind.__name__}, got {value!r}")
    if not args["ckpt"]:
        sys.exit("sample.py: --ckpt=RUN_DIR_OR_FILE is required")
    if args["prompt"] and args["prompt_file"]:
        sys.exit("sample.py: give --prompt or --prompt_file, not both")
    if args["temperature"] < 0 or args["max_new_tokens"] < 0:
        sys.exit("sample.py: --temperature and --max_new_tokens must be >= 0")
    return args


def render_png(path, prompt, completion, caption):
    """The prompt (grey), its completion (black) and a caption (the command) as a small PNG."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def wrap(text):
        return [line for para in text.strip("\n").split("\n") for line in (textwrap.wrap(para, 96) or [""])]

    lines = ([(line, "0.45") for line in wrap(prompt)] + [(line, "black") for line in wrap(completion)]
             + [("", "black")] + [(line, "tab:blue") for line in textwrap.wrap(caption, 96)])
    height = 0.17 * len(lines) + 0.3  # inches
    fig = plt.figure(figsize=(8, height), dpi=110)
    for i, (line, color) in enumerate(lines):
        fig.text(0.02, 1 - (0.12 + 0.17 * i) / height, line, family="monospace", fontsize=7.5,
                 color=color, va="top")
    fig.savefig(path)
    plt.close(fig)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = args["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model, ckpt = load_checkpoint(args["ckpt"], device, kernel=args["kernel"])
    except CheckpointError as e:
        sys.exit(f"sample.py: {e}")
    try:
        encode, decode, doc_start = text_codec(tokenizer_of_checkpoint(ckpt, find_checkpoint(args["ckpt"])))
    except CheckpointError as e:
        sys.exit(f"sample.py: {args['ckpt']}: {e}")
    if args["prompt_file"]:
        try:
            prompt = Path(args["prompt_file"]).read_text()
        except OSError as e:
            sys.exit(f"sample.py: cannot read --prompt_file {args['prompt_file']}: {e.strerror}")
    else:
        prompt = args["prompt"]
    tokens = encode(prompt) or [doc_start]
    seq_len = context_length(ckpt)
    if seq_len is not None and len(tokens) > seq_len:
        print(f"note: the prompt has {len(tokens)} tokens, more than the model's training "
              f"context of {seq_len}; keeping its last {seq_len}", file=sys.stderr)
        tokens = tokens[-seq_len:]
        prompt = decode(tokens)
    cfg = model.cfg
    print(f"{Path(args['ckpt'])}: attn={cfg.attn}, {model.num_params() / 1e6:.2f}M parameters, "
          f"step {ckpt.get('step', '?')}, prompt {len(tokens)} tokens", file=sys.stderr)

    torch.manual_seed(args["seed"])
    generator = torch.Generator(device=device).manual_seed(args["seed"])
    idx = torch.tensor([tokens], dtype=torch.long, device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    t0 = time.perf_counter()
    with autocast:
        out = generate(model, idx, args["max_new_tokens"], args["temperature"],
                       args["top_k"] or None, generator=generator)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    new_tokens = out[0, len(tokens):].tolist()
    completion = decode(new_tokens)
    print(prompt + completion)
    print(f"---\n{len(new_tokens)} tokens in {seconds:.2f} s: "
          f"{len(new_tokens) / max(seconds, 1e-9):.1f} tokens/s ({device}, KV cache)")
    if args["png"]:
        caption = (f"python sample.py {shlex.join(sys.argv[1:] if argv is None else argv)}  "
                   f"# {cfg.attn}, {model.num_params() / 1e6:.2f}M parameters, step "
                   f"{ckpt.get('step', '?')}, {len(new_tokens) / max(seconds, 1e-9):.0f} tokens/s on {device}")
        render_png(args["png"], prompt, completion, caption)
        print(f"wrote {args['png']}")


if __name__ == "__main__":
    main()
