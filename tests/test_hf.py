"""Pretrained Hugging Face Qwen3 checkpoints in and out (model.py's last section) and a
checkpoint's own tokenizer (data.py's tokenizer files): tiny random Qwen3s made with
transformers' Qwen3ForCausalLM and save_pretrained (sharded and not, tied and not, GQA), a
BPE tokenizer trained here on our own text, and one clear line for each kind of bad input."""
import hashlib
import json
import os
import struct

import numpy as np
import pytest
import torch

import data
import model as M
from attention import VARIANTS
from conftest import ENGLISH, requires_gpt2

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency "
                                   "(pip install transformers): it makes and reads the Qwen3 folders")
from safetensors.torch import load_file, save_file  # noqa: E402 (transformers depends on it)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

VOCAB = 300  # not a multiple of 64: a loaded model must keep it exactly
# Every variant's sizes shrunk to a 23-token sequence (windows, blocks and top-k smaller than it).
SMALL = dict(window=6, caa_window_max=12, nsa_cmp_block=4, nsa_cmp_stride=2, nsa_block=8, nsa_topk=4,
             nsa_window=5, moba_block=8, moba_topk=3, index_heads=2, index_head_dim=8, kernel="ref")
MULTILINGUAL = "naïve café, Ελληνικά, 日本語, emoji 🙂🚀, a tab\there and <|endoftext|> as plain text.\n"


def make_hf(folder, tied=True, sharded=False, n_kv_head=2, vocab=VOCAB, seed=0, tokenizer=None):
    """A random Qwen3ForCausalLM (4 query heads of 16, n_kv_head KV heads, 2 layers) saved with
    save_pretrained; weights N(0, 0.1) everywhere so that no tensor is left at a trivial value."""
    cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=n_kv_head, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        max_position_embeddings=512)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1e6}  # not the 1e4 default: it is read
    torch.manual_seed(seed)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    for p in hf.parameters():
        p.data.normal_(0, 0.1)
    hf.save_pretrained(folder, max_shard_size="20KB" if sharded else "5GB")
    if tokenizer:
        tokenizer.save(os.path.join(folder, "tokenizer.json"))
    return hf


def train_bpe(texts, vocab=VOCAB, extra=()):
    """A byte-level BPE (GPT-2's and Qwen's kind) trained on our own text, <|endoftext|> its
    document separator."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", *extra],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


DOCS = [s.strip() + "." for s in ENGLISH.split(". ") if s.strip()] + [MULTILINGUAL]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """(the tokenizers.Tokenizer, its tokenizer.json path)."""
    tok = train_bpe(DOCS * 4)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return tok, str(path)


def files_of(folder):
    return {name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(folder))}


def tokens(n=23, seed=1):
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- load

@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_loaded_full_model_gives_huggingface_logits(tmp_path, tied, sharded):
    hf = make_hf(tmp_path, tied=tied, sharded=sharded)
    assert os.path.exists(tmp_path / M.HF_INDEX) == sharded
    model, summary = M.load_hf(tmp_path)
    assert model.cfg.vocab_size == VOCAB and model.cfg.rope_theta == 1e6 and model.cfg.n_kv_head == 2
    assert model.cfg.tie_embeddings == tied and (model.lm_head.weight is model.embed_tokens.weight) == tied
    assert M.NEW not in summary["parameters"].values()  # full: every parameter is pretrained
    idx = tokens()
    with torch.no_grad():
        diff = (hf(idx).logits - model(idx)[0]).abs().max()
    assert diff < 1e-5, diff


def test_bfloat16_checkpoint_loads_into_float32(tmp_path):
    """Qwen3-0.6B's weights are bfloat16: they load into our float32 parameters exactly."""
    hf = make_hf(tmp_path / "fp32")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model, _ = M.load_hf(tmp_path / "bf16")
    assert model.embed_tokens.weight.dtype == torch.float32
    with torch.no_grad():
        diff = (hf.float()(tokens()).logits - model(tokens())[0]).abs().max()
    assert diff < 1e-5, diff


def test_another_norm_eps_is_computed(tmp_path):
    """rms_norm_eps applies to every RMSNorm in Hugging Face's Qwen3, q_norm and k_norm too
    (AttentionConfig.norm_eps): a checkpoint with another eps gives Hugging Face's logits."""
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=0.5)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    for p in hf.parameters():  # large enough that the eps of q_norm and k_norm moves the logits
        p.data.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    model, _ = M.load_hf(tmp_path)
    assert model.layers[0].self_attn.q_norm.eps == 0.5
    with torch.no_grad():
        diff = (hf(tokens()).logits - model(tokens())[0]).abs().max()
    assert diff < 1e-5, diff


@pytest.fixture(scope="module")
def gqa_folder(tmp_path_factory):
    """An untied, sharded GQA checkpoint (4 query heads, 2 KV heads) and its state dict."""
    folder = tmp_path_factory.mktemp("gqa")
    hf = make_hf(folder, tied=False, sharded=True)
    return folder, {k: v for k, v in hf.state_dict().items() if "rotary" not in k}


@pytest.mark.parametrize("attn,flags", [(a, {}) for a in VARIANTS] + [
    ("nsa", dict(nsa_compress="mlp")), ("moba", dict(moba_full_last=1))])
def test_every_variant_converts_a_gqa_checkpoint(gqa_folder, attn, flags):
    """Every pretrained tensor lands in its place, the variant's own parameters keep the
    initialisation a fresh model of the same seed gives them (init_gates'), and it runs."""
    folder, hf_state = gqa_folder
    torch.manual_seed(3)
    model, summary = M.load_hf(folder, attn=attn, **SMALL, **flags)
    torch.manual_seed(3)
    fresh = M.Model(M.hf_model_config(folder, attn=attn, **SMALL, **flags))
    ours, fresh_state = model.state_dict(), fresh.state_dict()
    for hf_name, tensor in hf_state.items():
        assert torch.equal(ours[M.our_name(hf_name)], tensor), hf_name
    new = {name for name, source in summary["parameters"].items() if source == M.NEW}
    assert new == {name for name, _ in model.named_parameters()} - {M.our_name(n) for n in hf_state}
    for name in new:
        assert torch.equal(ours[name], fresh_state[name]), name
    assert bool(new) == (attn in ("dsa", "asga", "caa", "nsa", "indexer")), new
    assert any(M.NEW in line for line in M.describe_hf_load(summary)) == bool(new)
    with torch.no_grad():
        logits, loss = model(tokens(), tokens(seed=2))
    assert logits.shape == (2, 23, VOCAB) and torch.isfinite(logits).all() and torch.isfinite(loss)


# Qwen3-0.6B's config.json as published (transformers 4's spelling: rope_theta, rope_scaling).
QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
             "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
             "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
             "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
             "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
             "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
             "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
             "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


@pytest.mark.parametrize("attn", list(VARIANTS))
def test_qwen3_06b_sizes_fit_every_variant(tmp_path, attn):
    """Qwen3-0.6B's config (16 query heads, 8 KV heads of 128) builds every variant at its
    default sizes (on the meta device: no memory, no weights)."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    cfg = M.hf_model_config(tmp_path, attn=attn)
    sizes = (cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_model, cfg.mlp_hidden)
    assert sizes == (28, 16, 8, 128, 1024, 3072)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.tie_embeddings, cfg.norm_eps) == (151936, 1e6, True, 1e-6)
    with torch.device("meta"):
        model = M.Model(cfg)
    shapes = M.hf_shapes(cfg)
    assert all(tuple(model.state_dict()[M.our_name(n)].shape) == s for n, s in shapes.items())
    assert 596e6 <= sum(p.numel() for n, p in model.named_parameters() if "model." + n in shapes) <= 597e6


# ----------------------------------------------------------------------------- out

@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_exported_full_model_loads_in_transformers_with_the_same_logits(tmp_path, bpe, tied):
    tok = data.load_tokenizer(bpe[1])
    torch.manual_seed(0)
    ours = M.Model(M.ModelConfig(**dict(M.PRESETS["tiny"], n_kv_head=2), vocab_size=VOCAB, rope_theta=5e5,
                                 tie_embeddings=tied)).eval()
    for p in ours.parameters():
        p.data.normal_(0, 0.1)
    out = M.save_hf(ours, tmp_path / "hf", tokenizer_json=tok.json_text, eos_token_id=tok.eot)
    hf, info = transformers.Qwen3ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    idx = tokens()
    with torch.no_grad():
        diff = (hf.eval()(idx).logits - ours(idx)[0]).abs().max()
    assert diff < 1e-5, diff
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = ENGLISH + "naïve café, 日本語 🙂"  # transformers reads "<|endoftext|>" as the special token
    assert hf_tok(text)["input_ids"] == tok.encode(text)
    back, _ = M.load_hf(out)  # and our loader reads it back exactly
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), back.state_dict().values()))


def test_export_refuses_a_sparse_variant(tmp_path):
    model = M.Model(M.ModelConfig(**M.PRESETS["tiny"], attn="dsa"))
    with pytest.raises(M.CheckpointError, match="attn=dsa: only a 'full' model is a Qwen3ForCausalLM"):
        M.save_hf(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- the Hub

def test_hub_id_is_downloaded_with_huggingface_hub(tmp_path, monkeypatch):
    import huggingface_hub

    make_hf(tmp_path)
    calls = []

    def snapshot_download(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model, summary = M.load_hf("someone/tiny-qwen3")
    assert summary["folder"] == str(tmp_path) and model.cfg.vocab_size == VOCAB
    assert calls[0][0] == "someone/tiny-qwen3" and "*.safetensors" in calls[0][1]
    M.hf_model_config("someone/tiny-qwen3")  # a plan needs config.json alone
    assert calls[-1][1] == ["config.json", "tokenizer.json"]


def test_hub_id_without_network_is_one_line(tmp_path, monkeypatch):
    """huggingface_hub offline, with an empty cache: its own error, as one line."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(M.CheckpointError) as e:
        M.load_hf("Qwen/Qwen3-0.6B")
    msg = str(e.value)
    assert "\n" not in msg and "Qwen/Qwen3-0.6B" in msg and "hf download Qwen/Qwen3-0.6B" in msg, msg
    assert "LocalEntryNotFoundError" in msg
    with pytest.raises(M.CheckpointError, match="no such folder"):
        M.load_hf(str(tmp_path / "nothing" / "here" / "at-all"))


# ----------------------------------------------------------------------------- bad checkpoints

def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def edit_weights(folder, change):
    path = folder / M.HF_WEIGHTS
    state = load_file(path)
    change(state)
    save_file(state, path, metadata={"format": "pt"})


def drop(name):
    return lambda state: state.pop(name)


def reshape(name):
    return lambda state: state.update({name: state[name][:, :8].contiguous()})


def add(name, shape):
    return lambda state: state.update({name: torch.zeros(shape)})


BAD_CHECKPOINTS = {
    "llama": (dict(architectures=["LlamaForCausalLM"], model_type="llama"), None,
              "LlamaForCausalLM (model_type 'llama') is not supported; model.py loads Qwen3ForCausalLM "
              "(model_type qwen3)"),
    "bias": (dict(attention_bias=True), None, "attention_bias is true"),
    "sliding": (dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, layer_types=None), None,
                "sliding-window attention (sliding_window 8) in layer(s) 1:"),
    "yarn": (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), None, "scaled RoPE"),
    "gelu": (dict(hidden_act="gelu"), None, "hidden_act 'gelu'"),
    "missing": ({}, drop("model.layers.1.self_attn.k_norm.weight"), "missing model.layers.1.self_attn.k_norm.weight,"),
    "shape": ({}, reshape("model.layers.0.self_attn.k_proj.weight"),
              "model.layers.0.self_attn.k_proj.weight has shape (32, 8) but config.json's sizes make it (32, 32)"),
    "unexpected": ({}, add("model.layers.0.self_attn.q_proj.bias", (64,)),
                   "unexpected tensor model.layers.0.self_attn.q_proj.bias"),
    "untied head": ({}, add("lm_head.weight", (VOCAB, 32)), "lm_head.weight differs from model.embed_tokens.weight"),
    "no weights": ({}, "delete", "no model.safetensors or model.safetensors.index.json"),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_bad_checkpoint_is_one_line_and_changes_nothing(tmp_path, case):
    config, weights, words = BAD_CHECKPOINTS[case]
    make_hf(tmp_path, tied=True)
    edit_config(tmp_path, **config)
    if weights == "delete":
        os.remove(tmp_path / M.HF_WEIGHTS)
    elif weights:
        edit_weights(tmp_path, weights)
    before = files_of(tmp_path)
    with pytest.raises(M.CheckpointError) as e:
        M.load_hf(tmp_path)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert files_of(tmp_path) == before


def test_sharded_checkpoint_missing_a_shard(tmp_path):
    make_hf(tmp_path, sharded=True)
    shard = json.loads((tmp_path / M.HF_INDEX).read_text())["weight_map"]["model.norm.weight"]
    os.remove(tmp_path / shard)
    with pytest.raises(M.CheckpointError, match=f"lists {shard}, which is not in"):
        M.load_hf(tmp_path)


def test_settings_that_config_json_owns_are_refused(tmp_path):
    make_hf(tmp_path)
    with pytest.raises(ValueError, match=r"vocab_size comes from .*config.json \(300\); drop it"):
        M.hf_model_config(tmp_path, vocab_size=50304)
    with pytest.raises(ValueError, match="unknown model setting 'windw'; valid: .*window"):
        M.hf_model_config(tmp_path, windw=4)
    with pytest.raises(M.CheckpointError, match="attn=indexer cannot use this checkpoint: index_head_dim=30"):
        M.hf_model_config(tmp_path, attn="indexer", index_head_dim=30)


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path, bpe):
    """The checkpoint's tokenizer.json writes ids its embedding has no row for (the check the
    --init_from wiring runs on the loaded model)."""
    make_hf(tmp_path, vocab=256, tokenizer=bpe[0])
    model, summary = M.load_hf(tmp_path)
    tok = data.load_tokenizer(summary["tokenizer"])
    with pytest.raises(data.ShardError) as e:
        tok.check_fits(model.cfg.vocab_size)
    assert "writes 300 token ids but the model's embedding has 256 rows" in str(e.value)
    assert "\n" not in str(e.value)
    data.load_tokenizer(bpe[1]).check_fits(VOCAB)  # fits exactly


# ----------------------------------------------------------------------------- tokenizer files

def write_jsonl(path, docs):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")


@pytest.fixture(scope="module")
def bpe_shards(tmp_path_factory, bpe):
    """`python data.py --tokenizer=FOLDER` (a checkpoint folder holding tokenizer.json)."""
    tmp = tmp_path_factory.mktemp("bpe_shards")
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.permutation(DOCS)[: rng.integers(2, 5)]) for _ in range(60)]
    write_jsonl(tmp / "docs.jsonl", docs)
    out = tmp / "shards"
    assert data.main([f"--tokenizer={os.path.dirname(bpe[1])}", f"--source={tmp / 'docs.jsonl'}",
                      f"--out_dir={out}", "--val_tokens=500", "--workers=1"]) == 0
    return out, docs


def test_shards_of_a_tokenizer_file(bpe, bpe_shards):
    out, docs = bpe_shards
    tok = data.load_tokenizer(bpe[1])
    record = json.loads((out / data.TOKENIZER_FILE).read_text())
    assert record == {"name": tok.name, "vocab_size": VOCAB, "file": data.TOKENIZER_COPY,
                      "sha256": tok.fingerprint, "eot": bpe[0].token_to_id("<|endoftext|>")}
    assert data.tokenizer_of(out) == (tok.name, VOCAB) and tok.name.endswith("/tokenizer.json")
    again = data.load_tokenizer(out)  # the folder's copy
    assert again.fingerprint == tok.fingerprint and again.eot == tok.eot
    stream = np.concatenate([np.asarray(data.load_shard(p)) for s in ("val", "train")
                             for p in data.find_shards(out, s)]).tolist()
    ordinary = Tokenizer.from_file(bpe[1])
    ordinary.encode_special_tokens = True  # "<|endoftext|>" inside a document is text, as GPT-2's encode_ordinary
    encoded = [[tok.eot] + ordinary.encode(d).ids for d in docs]
    ends = np.cumsum([len(e) for e in encoded])
    crossing = int(np.searchsorted(ends, 500, side="left"))  # the val shard cuts this document
    val = [t for e in encoded[: crossing + 1] for t in e][:500]
    assert stream == val + [t for e in encoded[crossing + 1:] for t in e]
    # decoding the stream gives the documents back, each after its separator
    assert again.decode(stream[500:]) == "".join("<|endoftext|>" + d for d in docs[crossing + 1:])


def test_token_bytes_of_a_tokenizer_file_count_the_text(bpe):
    """Bits per byte divide by the text's bytes: the ids of a text must count exactly them."""
    tok = data.load_tokenizer(bpe[1])
    counts = tok.token_bytes(320)
    assert counts.shape == (320,) and counts[tok.eot] == 0 and not counts[VOCAB:].any()
    for text in [ENGLISH, MULTILINGUAL, "\x00\x01 control bytes \x7f and \u00ad soft hyphen"]:
        ids = tok.encode(text)
        assert int(counts[ids].sum()) == len(text.encode("utf-8")), text
        assert tok.decode(ids) == text
    # Added tokens (Qwen's "<think>" is one, not special) decode as their text; special ones
    # (Qwen's "<|im_end|>") have none.
    extended = Tokenizer.from_file(bpe[1])
    extended.add_tokens(["<think>"])
    extended.add_special_tokens(["<|im_end|>"])
    tok = data.load_tokenizer({"name": "extended", "json": extended.to_str()})
    counts = tok.token_bytes(tok.n_ids)
    think, im_end = extended.token_to_id("<think>"), extended.token_to_id("<|im_end|>")
    assert counts[think] == 7 and counts[im_end] == 0
    ids = tok.encode("<think> café <|im_end|>")
    assert think in ids and im_end not in ids
    assert int(counts[ids].sum()) == len("<think> café <|im_end|>".encode("utf-8"))


def test_token_bytes_of_sentencepiece_pieces():
    """A SentencePiece-style BPE (Metaspace '▁', byte-fallback pieces '<0xNN>' in its
    vocabulary, as Llama 2's): each piece's bytes, '▁' a space; the prefix space before the
    first word is the one byte the text lacks."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    tok.train_from_iterator([ENGLISH] * 4, trainers.BpeTrainer(vocab_size=200, special_tokens=["</s>"]))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    byte_ids = {f"<0x{b:02X}>": len(vocab) + b for b in range(256)}
    vocab.update(byte_ids)
    spec["model"].update(byte_fallback=True, unk_token=None)
    loaded = data.load_tokenizer({"name": "sp", "json": json.dumps(spec)})
    text = "The baker opens the shop. 🙂"  # the emoji is not in the vocabulary: four byte pieces
    ids = loaded.encode(text)
    assert sum(i in byte_ids.values() for i in ids) == 4 and loaded.decode(ids) == text
    assert int(loaded.token_bytes(loaded.n_ids)[ids].sum()) == len(text.encode("utf-8")) + 1


def test_builtin_tokenizers_give_evaluate_s_counts(english_text):
    import evaluate

    byte = data.load_tokenizer("byte")
    assert np.array_equal(byte.token_bytes(256), evaluate.token_bytes("byte", 256))
    assert byte.decode(byte.encode(MULTILINGUAL)) == MULTILINGUAL and byte.eot == data.BYTE_EOT


@requires_gpt2
def test_gpt2_tokenizer_gives_evaluate_s_counts(english_text):
    import evaluate

    gpt2 = data.load_tokenizer("gpt2")
    assert np.array_equal(gpt2.token_bytes(50304), evaluate.token_bytes("gpt2", 50304))
    ids = gpt2.encode(english_text)
    assert gpt2.decode(ids) == english_text and int(gpt2.token_bytes(50304)[ids].sum()) == len(english_text)


def test_more_than_65536_ids_make_uint32_shards(tmp_path):
    """Qwen3's tokenizer has 151,669 ids: its shards hold uint32 tokens (llm.c's Llama-3 header)."""
    vocab = {f"w{i}": i for i in range(70000)}
    vocab["<|endoftext|>"] = 70000
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    write_jsonl(tmp_path / "docs.jsonl", ["w69999 w5 w65536"] * 5 + ["w1 w70"] * 20)
    out = tmp_path / "shards"
    assert data.main([f"--tokenizer={tmp_path / 'tokenizer.json'}", f"--source={tmp_path / 'docs.jsonl'}",
                      f"--out_dir={out}", "--val_tokens=8", "--workers=1"]) == 0
    val = data.load_shard(data.find_shards(out, "val")[0])
    assert val.dtype == np.uint32 and np.asarray(val).tolist() == [70000, 69999, 5, 65536, 70000, 69999, 5, 65536]
    header = (out / os.path.basename(data.find_shards(out, "val")[0])).read_bytes()[:8]
    assert struct.unpack("<ii", header) == (20240801, 7)
    assert data.tokenizer_of(out)[1] == 70001


def test_a_shard_folder_of_another_tokenizer_is_refused(tmp_path, bpe, bpe_shards):
    out, _ = bpe_shards
    tok = data.load_tokenizer(bpe[1])
    data.check_tokenizer(out, tok)  # the same tokenizer: fine
    data.check_tokenizer(out, data.load_tokenizer({"name": "re-saved", "json": bpe[0].to_str(pretty=False)}))
    other = train_bpe(DOCS * 4, extra=["<pad>"])  # one more special token: ids shift
    other_tok = data.load_tokenizer({"name": "other/tokenizer.json", "json": other.to_str()})
    added = Tokenizer.from_file(bpe[1])
    added.add_tokens(["<think>"])  # the same BPE with one added token: "<think>" gets another id
    added_tok = data.load_tokenizer({"name": "added/tokenizer.json", "json": added.to_str()})
    byte_dir, gpt2_dir = tmp_path / "bytes", tmp_path / "public_gpt2"  # the latter without a record
    for folder in (byte_dir, gpt2_dir):
        folder.mkdir()
        data.write_shard(folder / "x_val_000000.bin", np.arange(10, dtype=np.uint16))
    data.write_tokenizer(byte_dir, "byte", 256)
    for folder, model_tok, made in [(out, other_tok, tok.name), (out, added_tok, tok.name),
                                    (out, data.load_tokenizer("byte"), tok.name),
                                    (byte_dir, tok, "byte"), (gpt2_dir, tok, "gpt2")]:
        with pytest.raises(data.ShardError) as e:
            data.check_tokenizer(folder, model_tok)
        msg = str(e.value)
        assert f"holds tokens of {made}, but the model's tokenizer is {model_tok.name}" in msg, msg
        assert "python data.py --tokenizer=" in msg and "\n" not in msg


def test_a_checkpoint_records_the_tokenizer_and_gets_it_back(tmp_path, bpe, bpe_shards):
    """tokenizer_spec(data_dir) is what train.py stores; load_tokenizer(spec) gives the same
    tokenizer back without the shard folder, or NoText for ids without text."""
    spec = data.tokenizer_spec(bpe_shards[0])
    back = data.load_tokenizer(json.loads(json.dumps(spec)))  # plain JSON: a weights-only checkpoint holds it
    original = data.load_tokenizer(bpe[1])
    assert back.fingerprint == original.fingerprint and back.encode(ENGLISH) == original.encode(ENGLISH)
    assert data.tokenizer_spec(tmp_path) == "gpt2"  # no record: GPT-2's (public shards)
    data.write_tokenizer(tmp_path, "recall", 96)
    assert data.tokenizer_spec(tmp_path) == "recall"
    for spec in ("recall", "mqar"):
        with pytest.raises(data.NoText, match="no text"):
            data.load_tokenizer(spec)


@pytest.mark.parametrize("spec,words", [
    ("nowhere/tokenizer.json", "no such file or folder"),
    ("notjson", "not JSON"),
    ("noseparator", "no document separator"),
    ("recall", "recall token ids, which have no text"),
])
def test_bad_tokenizer_is_one_line(tmp_path, capsys, spec, words):
    if spec == "notjson":
        (tmp_path / "tokenizer.json").write_text("{not json")
    elif spec == "noseparator":
        Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    elif spec == "recall":
        data.write_tokenizer(tmp_path, "recall", 96)
    where = tmp_path if spec != "nowhere/tokenizer.json" else tmp_path / spec
    write_jsonl(tmp_path / "docs.jsonl", ["a b"])
    assert data.main([f"--tokenizer={where}", f"--source={tmp_path / 'docs.jsonl'}",
                      f"--out_dir={tmp_path / 'out'}"]) == 1
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
