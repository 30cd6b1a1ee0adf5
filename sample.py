"""Generate text from a checkpoint written by train.py, or from a pretrained Hugging Face Qwen3,
decoding with a KV cache.

    python sample.py --ckpt=out/RUN [--prompt="Once upon a time" | --prompt_file=PATH]
                     [--max_new_tokens=200] [--temperature=0.8] [--top_k=200] [--seed=1337]
                     [--device=cpu|cuda|auto] [--kernel=fused|ref] [--compile=0|1] [--context=N] [--png=PATH]
    python sample.py --init_from=Qwen/Qwen3-0.6B [--attn=moba ...] --prompt="The capital of France is"

The model config travels with the checkpoint (`ckpt['model_config']`), so no flag repeats it.
With --init_from (a Hugging Face Qwen3 folder or Hub id: model.load_hf) the sizes come from
its config.json, the tokenizer is its tokenizer.json, and --attn with the variant's settings
converts it (training-free: a variant's new parameters are at their initialisation).
Every variant decodes with a KV cache (model.py's KVCache, written in place): `full`, `asga`
and `caa` keep every key, `local` and windowed `dsa` a rolling cache of at most `window` keys
between steps, nsa, moba, combiner and the indexer also the summaries their selection reads.
--kernel=fused (the default, as in training) runs kernels.py: the prompt through the device's
fast path, each decoding step through kernels.DECODE, which reads of the cache only what the
selection names; --kernel=ref runs attention.py as written. The path is printed. The prompt's
pass computes the logits of its last position only (`Model.forward(last_only=True)`).
--compile=1 runs the decoding steps through torch.compile (model.compile_decoding: a step's
few hundred small ops fused into a few kernels; the first steps compile, about a minute a
graph on a CPU, so it pays on long generations) with a cache of fixed capacity, the prompt
plus --max_new_tokens; caa's steps stay eager, said.
`generate(..., use_cache=False)` recomputes the whole sequence for every token instead; the
two give the same tokens (tests/test_sample.py).

A prompt longer than the model's training context (train_config's seq_len) runs whole, with a
note: every variant is defined at every length (RoPE has no limit), though the model has only
been trained on contexts up to seq_len. --context=N keeps the prompt's last N tokens instead.
"""
import shlex
import sys
import time
from pathlib import Path

import torch

from attention import attention_path
from model import CheckpointError, compile_decoding, describe_hf_load, load_checkpoint
from config import cuda_missing, fail, load_pretrained, parse_source_flags, tf32_matmuls

def context_length(ckpt):
    """The sequence length the model was trained on (train_config's seq_len), or None."""
    return (ckpt.get("train_config") or {}).get("seq_len")


# ----------------------------------------------------------------------------- text

def text_codec(tokenizer):
    """(encode, decode, document start id) for the tokenizer a checkpoint was trained with
    (train.py records data.tokenizer_spec of its data; older checkpoints name gpt2 or byte, or
    nothing: GPT-2), read by data.load_tokenizer. An empty prompt is the document start id
    alone, as every training document begins."""
    import data

    try:
        tok = data.load_tokenizer(tokenizer)
    except data.ShardError:  # NoText among them: ids without text
        name = tokenizer if isinstance(tokenizer, str) else tokenizer.get("name")
        raise CheckpointError(f"this checkpoint was trained on {name!r} tokens, which have no text to decode; "
                              f"sample.py reads checkpoints of text: gpt2, byte or a tokenizer file's shards") from None
    if tok.kind == "byte":
        # Sampled bytes need not form UTF-8 (a cut multibyte character): decode_bytes
        # replaces those with U+FFFD; the NUL that starts a document prints as a newline.
        return tok.encode, lambda tokens: tok.decode(tokens).replace("\0", "\n"), tok.eot
    if tok.kind == "gpt2":  # a prompt may start a new document with "<|endoftext|>"
        import tiktoken

        enc = tiktoken.get_encoding("gpt2")
        return (lambda text: enc.encode(text, allowed_special={"<|endoftext|>"}), enc.decode, tok.eot)
    return tok.encode, tok.decode, tok.eot


def tokenizer_of_checkpoint(ckpt):
    """The tokenizer train.py recorded in the checkpoint (GPT-2 when it recorded none)."""
    return ckpt.get("tokenizer", "gpt2")


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
             generator=None, on_step=None, step=None):
    """Continue idx (B, T) by max_new_tokens tokens -> (B, T + max_new_tokens).

    use_cache=True feeds the prompt once, then one token per step, reading earlier keys and
    values from the KV cache; use_cache=False recomputes the full forward pass over the whole
    sequence for every token (the reference the cache must match). `on_step(cache)`, when
    given, is called after every forward pass (cache is None without one): tests check the
    rolling cache's size there. `step`, when given (model.compile_decoding's), runs the
    one-token steps after the prompt. The cache is made for the prompt and the tokens to come:
    allocated once, at that size, it never grows (a growth is a graph of its own for `step`)
    and holds no more."""
    cache = model.new_cache(idx.shape[1] + max_new_tokens) if use_cache else None
    inputs = idx
    for i in range(max_new_tokens):
        if step is not None and use_cache and i:
            logits, _ = step(inputs, cache=cache)
        else:  # the prompt, or the whole sequence again: the head over its last position only
            logits, _ = model(inputs, cache=cache, last_only=True)
        if on_step is not None:
            on_step(cache)
        next_token = sample_next(logits[:, -1, :], temperature, top_k, generator)
        idx = torch.cat([idx, next_token], dim=1)
        inputs = next_token if use_cache else idx
    return idx


# ----------------------------------------------------------------------------- command line

DEFAULTS = dict(ckpt="", init_from="", prompt="", prompt_file="", max_new_tokens=200, temperature=0.8,
                top_k=200, seed=1337, device="auto", kernel="fused", compile=0, context=0, png="")


def parse_args(argv):
    """config.parse_source_flags (--ckpt or --init_from with the variant's settings), then
    sample.py's own checks -> (args, variant settings)."""
    args, settings = parse_source_flags(argv, DEFAULTS, "sample.py", doc=__doc__)
    if args["prompt"] and args["prompt_file"]:
        fail("sample.py: give --prompt or --prompt_file, not both")
    if args["temperature"] < 0 or args["max_new_tokens"] < 0 or args["context"] < 0:
        fail("sample.py: --temperature, --max_new_tokens and --context must be >= 0")
    return args, settings


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
    args, settings = parse_args(sys.argv[1:] if argv is None else argv)
    device = args["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and cuda_missing():
        fail(f"sample.py: {cuda_missing()}")
    if device.startswith("cuda"):
        tf32_matmuls()
    source = args["ckpt"] or args["init_from"]
    if args["init_from"]:
        model, tok, summary = load_pretrained(args["init_from"], device, {**settings, "kernel": args["kernel"]},
                                              "sample.py")
        ckpt = {"step": 0, "tokenizer": tok.spec}  # no training context to keep the prompt within
        for line in describe_hf_load(summary):
            print(line, file=sys.stderr)
    else:
        try:
            model, ckpt = load_checkpoint(args["ckpt"], device, kernel=args["kernel"])
        except CheckpointError as e:
            sys.exit(f"sample.py: {e}")
    try:
        encode, decode, doc_start = text_codec(tokenizer_of_checkpoint(ckpt))
    except CheckpointError as e:
        sys.exit(f"sample.py: {source}: {e}")
    if args["prompt_file"]:
        try:
            prompt = Path(args["prompt_file"]).read_text()
        except OSError as e:
            sys.exit(f"sample.py: cannot read --prompt_file {args['prompt_file']}: {e.strerror}")
    else:
        prompt = args["prompt"]
    tokens = encode(prompt) or [doc_start]
    if args["context"] and len(tokens) > args["context"]:
        print(f"note: keeping the prompt's last {args['context']} of {len(tokens)} tokens (--context)", file=sys.stderr)
        tokens = tokens[-args["context"]:]
        prompt = decode(tokens)
    seq_len = context_length(ckpt)
    if seq_len is not None and len(tokens) > seq_len:
        print(f"note: the prompt has {len(tokens)} tokens, more than the model's training context of {seq_len}: "
              f"it runs whole (every variant is defined at any length), though the model was trained on "
              f"{seq_len}; --context={seq_len} keeps its last {seq_len}", file=sys.stderr)
    cfg = model.cfg
    print(f"{source}: attn={cfg.attn}, {model.num_params() / 1e6:.2f}M parameters, "
          f"step {ckpt.get('step', '?')}, prompt {len(tokens)} tokens", file=sys.stderr)
    print(f"attention: {attention_path(cfg, device)}", file=sys.stderr)
    step = None
    if args["compile"]:
        step, how = compile_decoding(model)
        print(f"decoding steps: {how}", file=sys.stderr)

    torch.manual_seed(args["seed"])
    generator = torch.Generator(device=device).manual_seed(args["seed"])
    idx = torch.tensor([tokens], dtype=torch.long, device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    t0 = time.perf_counter()
    with autocast:
        out = generate(model, idx, args["max_new_tokens"], args["temperature"],
                       args["top_k"] or None, generator=generator, step=step)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    new_tokens = out[0, len(tokens):].tolist()
    completion = decode(new_tokens)
    print(prompt + completion)
    print(f"---\n{len(new_tokens)} tokens in {seconds:.2f} s: "
          f"{len(new_tokens) / max(seconds, 1e-9):.1f} tokens/s ({device}, KV cache, kernel={cfg.kernel}"
          f"{', compiled steps, their compiles included' if args['compile'] else ''})")
    if args["png"]:
        caption = (f"python sample.py {shlex.join(sys.argv[1:] if argv is None else argv)}  "
                   f"# {cfg.attn}, {model.num_params() / 1e6:.2f}M parameters, step "
                   f"{ckpt.get('step', '?')}, {len(new_tokens) / max(seconds, 1e-9):.0f} tokens/s on {device}")
        render_png(args["png"], prompt, completion, caption)
        print(f"wrote {args['png']}")


if __name__ == "__main__":
    main()
