"""Starting from a pretrained Hugging Face Qwen3 (--init_from) through the command lines:
sample.py gives its greedy continuation, train.py converts it (the plan says what is new and
which parameters train in each stage), freezes the pretrained weights during the new
parameters' warm-up and resumes exactly across the switch, logs the tail loss, evaluate.py
scores it training-free (loss by position, the recall probe), and every kind of bad input is
one line that leaves the run folder as it was. Tiny random Qwen3s saved by transformers and
a BPE trained in the test (tests/test_hf.py makes both)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT
import data
import model as M
from attention import VARIANTS

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency "
                                   "(pip install transformers): it makes the Qwen3 folders")
from test_hf import DOCS, QWEN3_06B, edit_config, edit_weights, drop, files_of, make_hf, train_bpe, write_jsonl  # noqa: E402

import config  # noqa: E402
import evaluate  # noqa: E402
import sample  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# A 16-token sequence: every window, block and top-k below it (the cpu preset's are for 256).
RUN = ["--preset=cpu", "--device=cpu", "--seq_len=16", "--batch_size=4", "--total_batch_tokens=64",
       "--val_tokens=128", "--eval_every=2", "--eval_seqs=0", "--warmup_steps=1", "--lr=1e-2",
       "--window=4", "--dsa_threshold=8", "--caa_window_max=8", "--nsa_cmp_block=4", "--nsa_cmp_stride=2",
       "--nsa_block=4", "--nsa_topk=3", "--nsa_window=4", "--moba_block=4", "--moba_topk=2",
       "--index_heads=2", "--index_head_dim=8"]
SMALL = dict(window=4, dsa_threshold=8, caa_window_max=8, nsa_cmp_block=4, nsa_cmp_stride=2, nsa_block=4,
             nsa_topk=3, nsa_window=4, moba_block=4, moba_topk=2, index_heads=2, index_head_dim=8)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """(a tiny Qwen3 folder with its tokenizer.json, shards made with that tokenizer, the
    transformers model)."""
    tmp = tmp_path_factory.mktemp("pretrained")
    tok = train_bpe(DOCS * 4)
    folder = tmp / "qwen3"
    hf = make_hf(folder, tied=False, tokenizer=tok)
    rng = np.random.default_rng(0)
    write_jsonl(tmp / "docs.jsonl", [" ".join(rng.permutation(DOCS)[: rng.integers(2, 5)]) for _ in range(60)])
    assert data.main([f"--tokenizer={folder}", f"--source={tmp / 'docs.jsonl'}", f"--out_dir={tmp / 'shards'}",
                      "--val_tokens=600", "--workers=1"]) == 0
    return folder, tmp / "shards", hf


def train(*args, check=True):
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *RUN, *args], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def log_of(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- sample.py

def test_sample_continues_a_pretrained_folder_as_transformers_does(pretrained, capsys):
    """`python sample.py --init_from=FOLDER --prompt=...` just works: its tokenizer, its sizes,
    and at temperature 0 transformers' own greedy continuation."""
    folder, _, hf = pretrained
    prompt = "The baker opens the shop"
    sample.main([f"--init_from={folder}", f"--prompt={prompt}", "--temperature=0", "--max_new_tokens=12",
                 "--device=cpu"])
    out = capsys.readouterr().out.split("\n---\n")[0]
    tok = data.load_tokenizer(folder)
    ids = torch.tensor([tok.encode(prompt)])
    expected = hf.generate(ids, do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
    assert out == prompt + tok.decode(expected[0, ids.shape[1]:].tolist())


# ----------------------------------------------------------------------------- train.py

def test_plan_of_a_conversion_names_what_is_new_and_what_trains(pretrained, tmp_path):
    folder, shards, _ = pretrained
    r = train(f"--init_from={folder}", "--attn=dsa", f"--data_dir={shards}", f"--out_dir={tmp_path / 'run'}",
              "--max_steps=4", "--warmup_new_steps=2", "--dry_run=True")
    plan = r.stdout
    assert f"model       {folder} (" in plan and "vocab 300, from its config.json" in plan
    assert (f"init        25 tensors from {folder}; new (initialised by the variant's init_gates): "
            "layers.*.self_attn.head_gate.weight, layers.*.self_attn.head_gate.bias (4 tensors, 264 parameters)") in plan
    assert ("stages      steps 1-2: the new parameters alone (264; every pretrained one frozen); steps 3-4: all "
            in plan)
    assert not (tmp_path / "run").exists()


def test_indexer_follows_deepseek_v32_by_default(pretrained, capsys):
    """[DS32]: the indexer's dense warm-up is the stage in which it trains alone."""
    folder, shards, _ = pretrained
    base = [*RUN, f"--init_from={folder}", "--attn=indexer", f"--data_dir={shards}", "--max_steps=10"]
    tc, mc, _ = config.parse_args(base + ["--indexer_warmup=3"])
    assert (tc.warmup_new_steps, tc.indexer_warmup, mc.vocab_size) == (3, 3, 300)
    tc, _, _ = config.parse_args(base + ["--warmup_new_steps=4"])
    assert (tc.warmup_new_steps, tc.indexer_warmup) == (4, 4)
    tc, _, _ = config.parse_args(base + ["--warmup_new_steps=0"])
    assert (tc.warmup_new_steps, tc.indexer_warmup) == (0, 0)
    tc, _, _ = config.parse_args(base + ["--warmup_new_steps=0", "--indexer_warmup=5"])
    assert (tc.warmup_new_steps, tc.indexer_warmup) == (0, 5)  # a dense warm-up that trains everything: both typed
    for argv, words in [(base[:-1] + ["--attn=local", "--warmup_new_steps=2"], "attn=local has no new parameters"),
                        ([*RUN, "--warmup_new_steps=2", f"--data_dir={shards}"], "needs --init_from"),
                        (base + ["--n_layer=3"], "n_layer comes from"),
                        (base + ["--warmup_new_steps=11"], "must be in 0 .. max_steps=10")]:
        with pytest.raises(SystemExit):
            config.parse_args(argv)
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def pretrained_state(folder):
    model, summary = M.load_hf(folder)
    return {name: t for name, t in model.state_dict().items()}


# dsa converted from the folder, 4 steps of which the first 2 train the new parameters alone;
# batch 2 (accumulation 2 on one process), so that 2 processes split the 64-token step too
STAGES = ["--attn=dsa", "--max_steps=4", "--warmup_new_steps=2", "--batch_size=2"]


@pytest.fixture(scope="module")
def straight(pretrained, tmp_path_factory):
    """One process's run of STAGES that never stopped: the resumed run's and the torchrun
    run's reference (one train.py run for both tests)."""
    folder, shards, _ = pretrained
    out = tmp_path_factory.mktemp("straight")
    train(f"--init_from={folder}", *STAGES, f"--data_dir={shards}", f"--out_dir={out}")
    return out


def test_new_parameters_warm_up_alone_then_all_train_and_resume_is_exact(pretrained, straight, tmp_path):
    """--warmup_new_steps=2: after step 2 every pretrained weight is bit for bit the folder's and
    the new ones have moved; after step 4 all have moved; a run stopped in the warm-up and
    resumed across the switch ends with the weights of a run that never stopped. The loss and
    tail loss at step 0 are the converted model's, computed here from the folder's weights."""
    folder, shards, _ = pretrained
    flags = [f"--init_from={folder}", *STAGES, f"--data_dir={shards}"]
    cut = tmp_path / "cut"
    train(*flags, f"--out_dir={cut}", "--stop_step=1")
    train(*flags, f"--out_dir={cut}", "--stop_step=2", "--resume=True")
    loaded = pretrained_state(folder)
    ckpt = M.read_checkpoint(cut)
    assert ckpt["step"] == 2 and ckpt["model_config"]["vocab_size"] == 300
    for name, t in loaded.items():
        assert torch.equal(ckpt["model"][name], t), name
    gates = [name for name in ckpt["model"] if "head_gate" in name]
    assert len(gates) == 4 and all(ckpt["model"][n].abs().sum() > 0 for n in gates)  # init: zeros
    # the optimizer holds state for the parameters that stepped, and only for them
    assert sum(len(s) > 0 for s in ckpt["optimizer"]["state"].values()) == len(gates)
    train(*flags, f"--out_dir={cut}", "--resume=True")
    final = M.read_checkpoint(straight)["model"]
    assert all(not torch.equal(final[name], t) for name, t in loaded.items())
    end = [r for r in log_of(straight) if r.get("event") == "end"][0]
    assert [r for r in log_of(cut) if r.get("event") == "end"][-1]["param_sha256_per_rank"] == end["param_sha256_per_rank"]
    trained = {r["step"]: r["trained"] for r in log_of(straight) if "loss" in r}
    assert trained == {1: "new", 2: "new", 3: "all", 4: "all"}

    # step 0: the converted model's val loss and its tail (the last quarter of positions)
    model, _ = M.load_hf(folder, attn="dsa", **SMALL)
    losses = torch.cat([F.cross_entropy(model(x)[0].transpose(1, 2), y, reduction="none")
                        for x, y in data.ValLoader(shards, 4, 16, 128)])  # (sequences, 16)
    first = next(r for r in log_of(straight) if r.get("step") == 0 and "val" in r)
    assert first["val"] == pytest.approx(losses.mean().item(), rel=1e-5)
    assert first["val_tail"] == pytest.approx(losses[:, 12:].mean().item(), rel=1e-5)


def test_the_stages_under_torchrun_match_one_process(pretrained, straight, tmp_path):
    """Two processes (gloo): DDP is rebuilt at the switch for the parameters that then need
    gradients; the ranks end equal (train.py checks) and with one process's weights (the
    `straight` run's: the same flags on one process)."""
    folder, shards, _ = pretrained
    flags = [*RUN, f"--init_from={folder}", *STAGES, f"--data_dir={shards}"]
    one, two = straight, tmp_path / "two"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(ROOT / "train.py"), *flags, f"--out_dir={two}"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    a, b = M.read_checkpoint(one)["model"], M.read_checkpoint(two)["model"]
    for k in a:  # the same sums in another order: rounding apart
        assert (a[k] - b[k]).norm() <= 1e-5 * b[k].norm(), k
    assert any(not torch.equal(a[k], t) for k, t in pretrained_state(folder).items())


# ----------------------------------------------------------------------------- evaluate.py

def test_evaluate_scores_a_converted_model_training_free(pretrained, tmp_path, capsys):
    folder, shards, hf = pretrained
    out = tmp_path / "full.json"
    assert evaluate.main([f"--init_from={folder}", f"--data_dir={shards}", "--seq_len=16", "--n_seq=4",
                          "--recall=8", f"--out={out}", "--device=cpu"]) == 0
    record = json.loads(out.read_text())
    tokens = evaluate.read_val(str(shards), 4 * 16 + 1)
    rows = torch.from_numpy(np.stack([tokens[i * 16: i * 16 + 17] for i in range(4)]))
    with torch.no_grad():
        expected = F.cross_entropy(hf(rows[:, :-1]).logits.transpose(1, 2), rows[:, 1:]).item()
    assert record["positions"][0]["nats_per_token"] == pytest.approx(expected, rel=1e-5)
    assert record["bits_per_byte"] > 0 and record["recall"]["n_queries"] > 0
    assert record["init_from"]["start"] == VARIANTS["full"].FROM_PRETRAINED
    capsys.readouterr()
    assert evaluate.main([f"--init_from={folder}", "--attn=dsa", "--window=4", f"--data_dir={shards}", "--seq_len=16",
                          "--n_seq=2", f"--out={tmp_path / 'dsa.json'}", "--device=cpu"]) == 0
    printed = capsys.readouterr().out
    assert "training-free: attn=dsa: not neutral: its head gates start at sigmoid(0) = 0.5" in printed
    assert "layers.*.self_attn.head_gate.weight: new, initialised by the variant" in printed


def test_the_harness_adapter_takes_a_pretrained_folder(pretrained):
    """--model_args init_from=FOLDER: the folder's tokenizer and transformers' log-probabilities."""
    if evaluate.model_registry is None:
        pytest.skip("lm_eval is not installed (pip install -r requirements-dev.txt; .ci/run installs it)")
    folder, _, hf = pretrained
    lm = evaluate.HarnessLM(init_from=str(folder), max_length=32, device="cpu")
    tok = data.load_tokenizer(folder)
    context, continuation = lm.tok_encode("The baker opens"), lm.tok_encode(" the shop at seven")
    assert context == tok.encode("The baker opens") and lm.eot_token_id == tok.eot
    [(log_p, _)] = lm._loglikelihood_tokens([(None, context, continuation)])
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        log_probs = hf(ids[:, :-1]).logits.log_softmax(-1)[0, len(context) - 1:]  # (continuation, V)
    assert log_p == pytest.approx(log_probs.gather(1, ids[0, len(context):, None]).sum().item(), rel=1e-5)
    with pytest.raises(M.CheckpointError, match="unknown attention variant .sparse."):
        evaluate.HarnessLM(init_from=str(folder), attn="sparse", device="cpu")


@pytest.mark.parametrize("attn", list(VARIANTS))
def test_every_variant_says_how_its_conversion_starts(pretrained, attn):
    """evaluate.py's note for each variant agrees with what load_hf finds new."""
    folder, _, _ = pretrained
    _, summary = M.load_hf(folder, attn=attn, **SMALL)
    has_new = M.NEW in summary["parameters"].values()
    note = VARIANTS[attn].FROM_PRETRAINED
    assert note.startswith("not neutral") == has_new
    assert ("no new parameters" in note) == (not has_new and attn != "full")


class Recaller(torch.nn.Module):
    """Reads the ids: at a key seen before, all the logit on the value that followed it."""

    def __init__(self, vocab, keys, shift=0):
        super().__init__()
        self.cfg = M.ModelConfig(vocab_size=vocab, window=8)
        self.keys, self.shift = set(keys), shift

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, self.cfg.vocab_size)
        for b, row in enumerate(idx.tolist()):
            seen = {}
            for t, token in enumerate(row):
                if token in seen and t + self.shift < len(row):
                    logits[b, t + self.shift, seen[token]] = 1.0
                if token in self.keys and t + 1 < len(row):
                    seen[token] = row[t + 1]
        return logits, None


@pytest.mark.parametrize("shift,expected", [(0, 1.0), (1, None)])
def test_recall_probe_scores_the_query_position(shift, expected):
    """A model that copies the earlier value at the query scores 1 in every lag bucket; the same
    one position late scores about chance, as a wrong index would."""
    keys = [ord(c) for c in evaluate.RECALL_KEYS]
    r = evaluate.recall_probe(Recaller(256, keys, shift), "byte", seq_len=128, window=8, n_seq=32)
    assert r["n_queries"] > 500 and sum(b["n"] for b in r["buckets"]) == r["n_queries"]
    assert all(b["n"] > 0 for b in r["buckets"]) and r["chance"] == 0.1
    if expected:
        assert r["accuracy"] == 1.0 and all(b["acc"] == 1.0 for b in r["buckets"])
    else:
        assert r["accuracy"] < 0.2


# ----------------------------------------------------------------------------- a byte model's export

def test_a_byte_model_exports_with_a_tokenizer_file_that_comes_back_as_byte(tmp_path):
    """model.save_hf with data.byte_tokenizer_json: transformers encodes text with it as our byte
    tokenizer does and gives the same logits; --init_from reads it back as `byte`, so the byte
    shards the model was trained on are its shards."""
    torch.manual_seed(0)
    ours = M.Model(M.ModelConfig(**M.PRESETS["bytes"])).eval()
    for p in ours.parameters():
        p.data.normal_(0, 0.1)
    out = M.save_hf(ours, tmp_path / "hf", tokenizer_json=data.byte_tokenizer_json(), eos_token_id=data.BYTE_EOT,
                    tokenizer_config=data.BYTE_TOKENIZER_CONFIG)
    text = "naïve café, 日本語 🙂 <|endoftext|> and a NUL \x00 byte"
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok(text)["input_ids"] == list(text.encode("utf-8")) and hf_tok.decode(list(text.encode())) == text
    hf = transformers.Qwen3ForCausalLM.from_pretrained(out).eval()
    idx = torch.tensor([list(text.encode("utf-8"))])
    with torch.no_grad():
        assert (hf(idx).logits - ours(idx)[0]).abs().max() < 1e-4
    mc = M.hf_model_config(out)
    tok = config.pretrained_tokenizer(str(out), mc)
    assert tok.kind == "byte" and tok.fingerprint == "byte" and mc.vocab_size == 256
    shards = tmp_path / "bytes"
    shards.mkdir()
    data.write_tokenizer(shards, "byte", 256)
    data.check_tokenizer(shards, tok)  # the byte shards are this model's
    parsed = json.loads(data.byte_tokenizer_json())
    assert data.is_byte_file(parsed)
    parsed["model"]["merges"] = [["a", "b"]]  # one merge: no longer one token per byte
    assert not data.is_byte_file(parsed)


# ----------------------------------------------------------------------------- bad input

def bad_folder(tmp_path, case, tok):
    folder = tmp_path / "bad"
    if case == "tokenizer too big":
        make_hf(folder, vocab=256, tokenizer=tok)  # a 300-id tokenizer, a 256-row embedding
        return str(folder), "writes 300 token ids but"
    make_hf(folder, tokenizer=tok)
    if case == "llama":
        edit_config(folder, architectures=["LlamaForCausalLM"], model_type="llama")
        return str(folder), "LlamaForCausalLM (model_type 'llama') is not supported; model.py loads Qwen3ForCausalLM"
    if case == "missing tensor":
        edit_weights(folder, drop("model.layers.1.mlp.up_proj.weight"))
        return str(folder), "missing model.layers.1.mlp.up_proj.weight"
    return "Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B: no such folder here, and the Hugging Face Hub cannot give it"


@pytest.mark.parametrize("script", ["train", "sample", "evaluate"])
@pytest.mark.parametrize("case", ["llama", "missing tensor", "tokenizer too big", "hub offline"])
def test_bad_pretrained_input_is_one_line_and_loses_nothing(pretrained, tmp_path, monkeypatch, capsys, script, case):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    folder, shards, _ = pretrained
    path, words = bad_folder(tmp_path, case, train_bpe(DOCS * 4))
    before = files_of(path) if os.path.isdir(path) else None
    out = tmp_path / "out"
    argv = {"train": [*RUN, f"--init_from={path}", f"--data_dir={shards}", f"--out_dir={out}", "--max_steps=2"],
            "sample": [f"--init_from={path}", "--prompt=The", "--max_new_tokens=2", "--device=cpu"],
            "evaluate": [f"--init_from={path}", f"--data_dir={shards}", f"--out={out / 'eval.json'}", "--device=cpu"]}
    main = {"train": lambda a: __import__("train").main(a), "sample": sample.main, "evaluate": evaluate.main}[script]
    capsys.readouterr()  # transformers' progress bars of making the folder
    with pytest.raises(SystemExit) as e:
        main(argv[script])
    err = capsys.readouterr().err
    assert e.value.code == 1 and words in err and err.count("\n") == 1, err
    assert not out.exists()
    assert before is None or files_of(path) == before


@pytest.mark.parametrize("script", ["train", "evaluate"])
def test_shards_of_another_tokenizer_are_refused(pretrained, tmp_path, capsys, script):
    folder, _, _ = pretrained
    byte_dir = tmp_path / "bytes"
    byte_dir.mkdir()
    data.write_shard(byte_dir / "t_val_000000.bin", np.arange(200, dtype=np.uint16))
    data.write_shard(byte_dir / "t_train_000001.bin", np.arange(200, dtype=np.uint16))
    data.write_tokenizer(byte_dir, "byte", 256)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        if script == "train":
            __import__("train").main([*RUN, f"--init_from={folder}", f"--data_dir={byte_dir}", f"--out_dir={out}"])
        else:
            evaluate.main([f"--init_from={folder}", f"--data_dir={byte_dir}", f"--out={out / 'e.json'}", "--device=cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1, err
    assert f"{byte_dir} holds tokens of byte, but the model's tokenizer is qwen3/tokenizer.json" in err
    assert not out.exists()


# ----------------------------------------------------------------------------- Qwen3-0.6B, without network

def test_qwen3_06b_dry_run_needs_its_config_json_alone(tmp_path):
    """The README's plan: a Hub id whose cache holds config.json only (Qwen3-0.6B's as
    published), no network: the plan prints, warns that the tokenizer is missing, and the
    indexer follows [DS32]."""
    snapshot = tmp_path / "models--Qwen--Qwen3-0.6B" / "snapshots" / "0"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(QWEN3_06B))
    (tmp_path / "models--Qwen--Qwen3-0.6B" / "refs").mkdir()
    (tmp_path / "models--Qwen--Qwen3-0.6B" / "refs" / "main").write_text("0")
    env = {**ENV, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, "train.py", "--init_from=Qwen/Qwen3-0.6B", "--attn=indexer", "--device=cuda",
                        "--dry_run=True", f"--data_dir={tmp_path / 'none'}"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "28 layers, 16 query heads, 8 KV heads of 128, d_model 1024, vocab 151936" in r.stdout
    assert "init        310 tensors from Qwen/Qwen3-0.6B; new" in r.stdout
    assert "dense attention ([DS32] warm-up), the indexer by its KL loss alone" in r.stdout
    assert "no tokenizer.json" in r.stdout and "(a real run stops here)" in r.stdout
