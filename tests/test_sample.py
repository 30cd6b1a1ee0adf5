"""sample.py: KV-cache decoding equals recomputation for every variant, the rolling cache
stays within the window, sampling options behave, and the command line loads train.py's
checkpoints (config travelling with them) and fails clearly on bad ones."""
from dataclasses import asdict

import pytest
import torch

import model as model_module
from conftest import requires_gpt2
import sample
from model import Model, ModelConfig

WINDOW, PROMPT, NEW = 8, 5, 44  # generation runs to position 49, far past every window
VARIANTS = {
    "full": dict(attn="full"),
    "local": dict(attn="local"),
    "dsa_adaptive": dict(attn="dsa", dsa_window="adaptive", dsa_threshold=16),
    "dsa_fixed": dict(attn="dsa", dsa_window="fixed"),
    "asga": dict(attn="asga"),
    "asga_fixed": dict(attn="asga", asga_gate="fixed"),
    "caa": dict(attn="caa", caa_window_max=16),
    "combiner": dict(attn="combiner"),
    "nsa": dict(attn="nsa", nsa_cmp_block=4, nsa_cmp_stride=2, nsa_block=4, nsa_topk=3, nsa_window=4),
    "moba": dict(attn="moba", moba_block=4, moba_topk=3),
    "indexer": dict(attn="indexer", index_topk=6, index_heads=2, index_head_dim=8),
}
# Variants whose cache must roll: query position from which it holds <= window (+1 in a step).
# combiner: the last token's block of `window` keys (+ its block summaries in cache.state).
ROLLING = {"local": 0, "dsa_fixed": 0, "dsa_adaptive": 16, "asga_fixed": 0, "combiner": 0}  # asga fixed: a window mask


def tiny_model(seed=0, vocab=128, **kw):
    """A 2-layer grouped-query model with weights large enough that the logits are far from
    uniform, so greedy tokens vary and a wrong cache changes them."""
    cfg = ModelConfig(vocab_size=vocab, n_layer=2, n_head=4, n_kv_head=2, head_dim=8, d_model=32,
                      mlp_hidden=64, window=WINDOW, **kw)
    torch.manual_seed(seed)
    m = Model(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5 if p.dim() == 2 else 0.3)
    return m


@pytest.mark.parametrize("name", VARIANTS)
def test_cached_greedy_equals_recomputed_greedy(name, monkeypatch):
    m = tiny_model(seed=3, **VARIANTS[name])  # a seed whose greedy tokens vary for all variants
    prompt = torch.randint(0, 128, (2, PROMPT), generator=torch.Generator().manual_seed(1))

    seen = []  # (query position, cached keys while attending) for every layer and step
    update = model_module.KVCache.update

    def spy(self, layer, q, k, v, x, start):  # start: the first new key's position, a Python int
        out = update(self, layer, q, k, v, x, start)
        seen.append((start + k.shape[2] - 1, len(self)))
        return out

    monkeypatch.setattr(model_module.KVCache, "update", spy)
    after = []  # cached keys per layer after every step
    cached = sample.generate(m, prompt, NEW, temperature=0, use_cache=True,
                             on_step=lambda cache: after.append([len(c) for c in cache]))
    monkeypatch.undo()
    recomputed = sample.generate(m, prompt, NEW, temperature=0, use_cache=False)

    assert cached.shape == (2, PROMPT + NEW)
    assert torch.equal(cached, recomputed), f"{name}: cached decoding diverged from recomputation"
    assert min(len(set(row[PROMPT:].tolist())) for row in cached) > 4, "degenerate test model"
    assert len(seen) == 2 * NEW and len(after) == NEW
    if name in ROLLING:
        start = ROLLING[name]
        during = [n for pos, n in seen if pos >= start]
        assert during and max(during) <= WINDOW + 1, f"{name}: rolling cache grew to {max(during)}"
        assert max(n for pos, n in seen if pos >= start + 1) == WINDOW + 1  # it is full, not empty
        assert all(max(layers) <= WINDOW for layers, (pos, _) in zip(after, seen[::2]) if pos >= start)
    else:  # the full cache keeps every key
        assert after[-1] == [PROMPT + NEW - 1] * 2


@pytest.mark.parametrize("name", ["local"])
def test_compiled_decoding_steps_give_the_eager_tokens(name):
    """sample.generate with model.compile_decoding's step (aot_eager here: dynamo's graphs
    without inductor's compile time) gives the eager cached tokens, on a cache of fixed
    capacity, at batch 2: local, whose window rolls past the 8 keys it keeps. (The selecting
    variants compile a graph for each of their first steps after this 5-token prompt, while a
    cache holds fewer blocks than their top-n: tests/test_decode.py compiles them after a
    longer prompt. full's compiled step, ~25 s of tracing, is tests/test_decode.py's
    test_a_compiled_decoding_step_equals_eager_and_keeps_its_graphs[full]; sample.py's
    --compile=1 through generate, test_command_line_generates_from_a_run_dir.)"""
    m = tiny_model(seed=3, **VARIANTS[name])
    prompt = torch.randint(0, 128, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    step, how = model_module.compile_decoding(m, backend="aot_eager")
    try:
        compiled = sample.generate(m, prompt, NEW, temperature=0, step=step)
    finally:
        torch._dynamo.reset()
    assert how.startswith("compiled")
    assert torch.equal(compiled, sample.generate(m, prompt, NEW, temperature=0))


def test_generation_allocates_its_cache_once_for_the_prompt_and_the_new_tokens():
    """sample.generate makes the cache for the prompt and the tokens to come: every layer's
    keys take PROMPT + NEW + 1 rows (a spare) from the prompt on and never move, where a cache
    grown from a longer prompt held twice it."""
    m = tiny_model(seed=3, attn="full")
    prompt = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    buffers = []
    sample.generate(m, prompt, 5, temperature=0, on_step=lambda cache: buffers.append(cache[0].k.data))
    assert [b.shape[-2] for b in buffers] == [40 + 5 + 1] * 5 and all(b is buffers[0] for b in buffers)


def test_sampling_respects_seed_top_k_and_temperature():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0, 2.9]]).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    draws = sample.sample_next(logits, temperature=1.0, top_k=3, generator=g)
    assert set(draws.flatten().tolist()) == {1, 3, 5}  # the three largest logits only
    assert torch.equal(sample.sample_next(logits[:1], temperature=0), torch.tensor([[1]]))
    cold = sample.sample_next(logits, temperature=0.05, generator=g)
    assert (cold == 1).float().mean() > 0.8  # low temperature concentrates on the argmax
    m = tiny_model(attn="caa", caa_window_max=16)
    prompt = torch.zeros(1, 3, dtype=torch.long)
    a, b, c = (sample.generate(m, prompt, 20, temperature=1.0, top_k=50,
                               generator=torch.Generator().manual_seed(s)) for s in (7, 7, 8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = sample.generate(m, prompt, 20, temperature=0)
    assert torch.equal(sample.generate(m, prompt, 20, temperature=1.0, top_k=1), greedy)


def save_run(tmp_path, seq_len=16, **kw):
    """A checkpoint in train.py's format (model state, model_config, train_config, step)."""
    m = tiny_model(vocab=50304, **kw)
    torch.save({"model": m.state_dict(), "model_config": asdict(m.cfg), "train_config": {"seq_len": seq_len},
                "step": 3}, tmp_path / "ckpt.pt")
    return m


@requires_gpt2
def test_command_line_generates_from_a_run_dir(tmp_path, capsys, english_text):
    m = save_run(tmp_path, attn="dsa", dsa_window="fixed")
    prompt = "The baker opens the shop"
    sample.main([f"--ckpt={tmp_path}", f"--prompt={prompt}", "--max_new_tokens=6", "--temperature=0"])
    out = capsys.readouterr()
    text, stats = out.out.split("---\n")
    assert text.startswith(prompt) and len(text) > len(prompt)
    assert "6 tokens in" in stats and "tokens/s" in stats
    # the same tokens as generate() on the model itself: the config travelled with the file
    import tiktoken

    enc = tiktoken.get_encoding("gpt2")
    idx = torch.tensor([enc.encode(prompt)])
    assert text.rstrip("\n") == enc.decode(sample.generate(m, idx, 6, temperature=0)[0].tolist())

    assert "attention: kernel=fused: blockwise" in out.err and "decoding" in out.err  # the path that ran
    assert "kernel=fused" in stats

    # a prompt longer than the training context (16 tokens) runs whole, with a note that says
    # so and names the flag that keeps its last tokens; --context=16 keeps them
    (tmp_path / "long.txt").write_text(english_text)
    assert len(enc.encode(english_text)) > 16
    sample.main([f"--ckpt={tmp_path / 'ckpt.pt'}", f"--prompt_file={tmp_path / 'long.txt'}",
                 "--max_new_tokens=3", "--top_k=5", "--seed=3"])
    out = capsys.readouterr()
    assert "more than the model's training context of 16: it runs whole" in out.err and "--context=16" in out.err
    assert out.out.startswith(english_text.rstrip("\n")[:200]) and "3 tokens in" in out.out
    sample.main([f"--ckpt={tmp_path / 'ckpt.pt'}", f"--prompt_file={tmp_path / 'long.txt'}",
                 "--max_new_tokens=3", "--top_k=5", "--seed=3", "--context=16"])
    out = capsys.readouterr()
    assert "keeping the prompt's last 16" in out.err and "training context" not in out.err
    tail = enc.decode(enc.encode(english_text)[-16:])
    assert out.out.startswith(tail) and "3 tokens in" in out.out

    # --compile=1 runs the steps through model.compile_decoding, says so, and gives the same tokens
    import functools

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sample, "compile_decoding", functools.partial(model_module.compile_decoding, backend="aot_eager"))
        sample.main([f"--ckpt={tmp_path}", f"--prompt={prompt}", "--max_new_tokens=6", "--temperature=0", "--compile=1"])
    torch._dynamo.reset()
    compiled = capsys.readouterr()
    assert "decoding steps: compiled (torch.compile" in compiled.err and "compiled steps" in compiled.out
    assert compiled.out.split("---\n")[0] == text

    # --kernel=ref runs attention.py as written, and says so
    sample.main([f"--ckpt={tmp_path}", f"--prompt={prompt}", "--max_new_tokens=2", "--temperature=0", "--kernel=ref"])
    out = capsys.readouterr()
    assert "attention: kernel=ref: reference (attention.py" in out.err


def test_loader_drops_config_keys_this_version_lacks(tmp_path, capsys):
    m = save_run(tmp_path, attn="asga")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    ckpt["model_config"]["from_the_future"] = 1
    torch.save(ckpt, tmp_path / "ckpt.pt")
    loaded, _ = sample.load_checkpoint(tmp_path)
    assert loaded.cfg.attn == "asga" and "from_the_future" in capsys.readouterr().err
    for k, v in m.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


@pytest.mark.parametrize("damage", ["missing", "garbage", "not_a_checkpoint", "wrong_shape"])
def test_bad_checkpoints_exit_with_a_message_naming_the_path(tmp_path, damage):
    path = tmp_path / "ckpt.pt"
    if damage == "garbage":
        path.write_bytes(b"this is not a torch file")
    elif damage == "not_a_checkpoint":
        torch.save([1, 2, 3], path)
    elif damage == "wrong_shape":
        save_run(tmp_path)
        ckpt = torch.load(path, weights_only=True)
        ckpt["model_config"]["d_model"] = 48
        torch.save(ckpt, path)
    with pytest.raises(SystemExit) as e:
        sample.main([f"--ckpt={tmp_path}", "--max_new_tokens=2"])
    assert str(path) in str(e.value) and "Traceback" not in str(e.value)


def test_bad_arguments_list_the_valid_ones(capsys):
    for args, words in ((["--ckpt=x", "--max_tokens=3"], ["unknown config key --max_tokens", "max_new_tokens"]),
                        (["--ckpt=x", "--temperature=hot"], ["--temperature=hot: expected float"]),
                        (["--prompt=hi"], ["give --ckpt=RUN_DIR_OR_FILE", "or --init_from=PATH"]),
                        (["--ckpt=x", "--init_from=y"], ["one of them"]),
                        (["--ckpt=x", "--attn=local"], ["--attn applies to --init_from"])):
        with pytest.raises(SystemExit) as e:
            sample.main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and all(w in err for w in words), err


def test_generation_runs_the_head_over_the_last_position_only():
    """Model.forward(last_only=True) gives the last row of the whole logits (to rounding: the
    head's product of one row), the head handed that one position; generate's prompt and its
    recomputed sequences go through it (so a long prompt's head is one row, not T), its
    one-token steps have one row anyway; a loss with it is refused."""
    m = tiny_model(seed=3)
    idx = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(2))
    rows = []
    m.lm_head.register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[1]))
    with torch.no_grad():
        whole, last = m(idx)[0], m(idx, last_only=True)[0]
    assert last.shape == (2, 1, 128)
    assert (last - whole[:, -1:]).abs().max() <= 1e-5 * whole.abs().max()  # one row's product, the same to rounding
    rows.clear()
    for use_cache in (True, False):
        sample.generate(m, idx, 3, temperature=0, use_cache=use_cache)
    assert rows == [1] * 6
    with pytest.raises(ValueError, match="last_only=True gives no loss"):
        m(idx, targets=idx, last_only=True)
