"""evaluate.py's lm-evaluation-harness adapter (HarnessLM) on a tiny checkpoint and on tasks
built from local files (a task YAML + a jsonl dataset, found through TaskManager's
include_path; no network). Every score is checked against the model's own cross-entropy
(Model.forward with targets, ignore_index=-1 on the tokens not scored), computed here on bytes
encoded here, so a wrong offset between logits and targets, a lost context token or a window
scored twice fails; every variant scores a row the same alone and padded in a batch; the
command line gives one clear line on bad input. Without lm_eval the tests that need it skip,
saying so, and evaluate.py is checked to work without it."""
import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

import evaluate
from conftest import ENGLISH, ROOT, requires_gpt2
from attention import VARIANTS
from model import CheckpointError, Model, ModelConfig, save_checkpoint

requires_lm_eval = pytest.mark.skipif(
    evaluate.model_registry is None,
    reason="lm_eval is not installed (pip install -r requirements-dev.txt; .ci/run installs it)")

TINY_BYTES = dict(n_layer=1, n_head=2, n_kv_head=2, head_dim=8, d_model=16, mlp_hidden=32, vocab_size=256)
L = 16  # the checkpoint's trained length: the harness's max_length, so contexts get cut and texts windowed

# Multiple choice (choices carry their own leading space: target_delimiter ""): a context cut to L
# (28 bytes), an empty context (the separator stands in), one that fits; the setup adds one
# whose first choice is the trained model's own greedy continuation.
CHOICE_DOCS = [
    {"question": "The baker opens the shop at", "choices": [" seven", " ten", " half past"], "label": 0},
    {"question": "", "choices": ["bread", "boats"], "label": 1},
    {"question": "Rain, then", "choices": [" sun", " snow", "fog"], "label": 2},
]
TEXT_DOCS = [{"text": "We counted twelve boats and lamp"}, {"text": "The ferry waits while the river rises."},
             {"text": "Quiet"}]
assert [len(d["text"]) for d in TEXT_DOCS] == [2 * L, 2 * L + 6, 5]


def write_task(folder, name, rows, body):
    """A harness task `name` over a local jsonl file of `rows`; `body` is the YAML after the dataset."""
    data_file = folder / f"{name}.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data_file}\n"
        f"  cache_dir: {folder / 'hf_cache'}\ntest_split: test\n" + body)


CHOICE_TASK = ('output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
               'target_delimiter: ""\n'
               'doc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n')
TEXT_TASK = ('output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
             'metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n')


def save_tiny(folder, tokenizer="byte", train_steps=0, **config):
    """A tiny model saved as train.py saves one (trained at L), after train_steps of Adam on
    ENGLISH's bytes (so that its greedy text is English-like bytes, not one byte repeated)."""
    torch.manual_seed(0)
    model = Model(ModelConfig(**{**TINY_BYTES, **config}))
    stream = torch.tensor(list(ENGLISH.encode()))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(train_steps):
        starts = torch.randint(0, len(stream) - L - 1, (16,))
        rows = torch.stack([stream[s: s + L + 1] for s in starts])  # (16, L + 1)
        loss = model(rows[:, :-1], rows[:, 1:])[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    folder.mkdir()
    save_checkpoint(str(folder / "ckpt.pt"), {"model": model.state_dict(), "model_config": asdict(model.cfg),
                                              "train_config": {"seq_len": L}, "step": 3, "tokenizer": tokenizer})
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("harness")
    model = save_tiny(tmp / "run", train_steps=150)
    tasks = tmp / "tasks"
    tasks.mkdir()
    question, new = "Each morning", []
    with torch.no_grad():  # 12 + 4 bytes: no context is cut
        for _ in range(4):
            new.append(int(model(torch.tensor([list(question.encode()) + new]))[0][0, -1].argmax()))
    assert all(32 <= b < 127 for b in new), f"greedy bytes {new}: a model trained on English writes ASCII"
    docs = CHOICE_DOCS + [{"question": question, "choices": [bytes(new).decode(), "zzzz"], "label": 0}]
    write_task(tasks, "tiny_choice", docs, CHOICE_TASK)
    write_task(tasks, "tiny_text", TEXT_DOCS, TEXT_TASK)
    return {"model": model, "run": tmp / "run", "tasks": tasks, "choice_docs": docs}


def task_manager(tasks):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tasks), include_defaults=False)


@torch.no_grad()
def summed_loss(model, tokens, scored):
    """The model's own summed cross-entropy over the last `scored` of `tokens` (at most L + 1
    of them: the input is all but the last token), the others ignored (-1)."""
    x = torch.tensor(tokens[:-1])[None]
    y = torch.tensor(tokens[1:])
    y[: len(y) - scored] = -1
    return float(model(x, y[None])[1]) * scored


def greedy(model, tokens, scored):
    with torch.no_grad():
        logits = model(torch.tensor(tokens[:-1])[None])[0][0]
    return bool((logits[-scored:].argmax(-1) == torch.tensor(tokens[-scored:])).all())


@requires_lm_eval
def test_a_local_task_scores_with_the_models_own_log_probabilities(setup):
    from lm_eval import simple_evaluate

    model = setup["model"]
    results = simple_evaluate(model=evaluate.HARNESS_MODEL, model_args=f"ckpt={setup['run']}",
                              tasks=["tiny_choice", "tiny_text"], task_manager=task_manager(setup["tasks"]),
                              batch_size=2, device="cpu", log_samples=True)
    # Multiple choice: context + choice, as bytes; the last L + 1 when longer (the model's context).
    docs = setup["choice_docs"]
    samples = sorted(results["samples"]["tiny_choice"], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(len(docs)))
    correct = correct_norm = greedy_choices = 0
    for doc, sample in zip(docs, samples):
        context = list(doc["question"].encode()) or [0]  # an empty context: the document separator
        expected = []
        for choice, (log_p, is_greedy) in zip(doc["choices"], [r[0] for r in sample["resps"]]):
            continuation = list(choice.encode())
            tokens = (context + continuation)[-(L + 1):]
            expected.append(-summed_loss(model, tokens, len(continuation)))
            assert log_p == pytest.approx(expected[-1], abs=1e-4), (doc, choice)
            assert is_greedy == greedy(model, tokens, len(continuation))
            greedy_choices += is_greedy
        correct += max(range(len(expected)), key=expected.__getitem__) == doc["label"]
        per_char = [e / len(c) for e, c in zip(expected, doc["choices"])]  # the harness's acc_norm: per character
        correct_norm += max(range(len(per_char)), key=per_char.__getitem__) == doc["label"]
    assert greedy_choices == 1, "the setup's last document's first choice is the model's greedy continuation"
    scores = results["results"]["tiny_choice"]
    assert scores["acc,none"] == pytest.approx(correct / len(docs))
    assert scores["acc_norm,none"] == pytest.approx(correct_norm / len(docs))
    # Rolling: every byte scored once, after the separator; windows of L targets from the byte
    # before them, the last (partial) one from a full window of L bytes.
    total_bytes = total_nats = 0
    samples = sorted(results["samples"]["tiny_text"], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(len(TEXT_DOCS)))
    for doc, sample in zip(TEXT_DOCS, samples):
        stream = [0] + list(doc["text"].encode())  # (N + 1,)
        n = len(stream) - 1
        expected = sum(summed_loss(model, stream[i: i + L + 1], L) for i in range(0, n - n % L, L))
        if n % L:
            expected += summed_loss(model, stream[-(L + 1):], n % L)
        assert -sample["resps"][0][0] == pytest.approx(expected, rel=1e-5)
        total_bytes += n
        total_nats += expected
    assert results["results"]["tiny_text"]["bits_per_byte,none"] == pytest.approx(
        total_nats / total_bytes / torch.log(torch.tensor(2.0)).item(), rel=1e-5)


@requires_lm_eval
def test_generation_is_greedy_decoding_with_the_kv_cache_up_to_a_stop_string(setup):
    from lm_eval.api.instance import Instance

    model = setup["model"]
    lm = evaluate.HarnessLM(ckpt=str(setup["run"]), device="cpu")
    prompt = "The bread is still"
    tokens = list(prompt.encode())[-(L - 8):]  # 8 new tokens: the context keeps its last max_length - 8
    new = []
    with torch.no_grad():  # greedy, recomputing the whole sequence for every token (no cache)
        for _ in range(8):
            new.append(int(model(torch.tensor([tokens + new]))[0][0, -1].argmax()))
    assert 0 not in new, "the fixture's greedy bytes must not hold the separator"
    full = bytes(new).decode("utf-8", errors="replace")
    ascii_at = [i for i, b in enumerate(new) if 0 < i and 32 <= b < 127]
    assert ascii_at, f"the fixture's greedy bytes {new} need a printable ASCII byte after the first to stop at"
    stop = chr(new[ascii_at[0]])

    def request(kwargs):
        return Instance("generate_until", {}, (prompt, kwargs), 0, ("tiny_gen", 0, 1))

    out = lm.generate_until([request({"until": ["never"], "max_gen_toks": 8}),
                             request({"until": [stop], "max_gen_toks": 8})])
    assert out == [full, full.split(stop)[0]]
    with pytest.raises(evaluate.EvalError, match="greedily only"):
        lm.generate_until([request({"do_sample": True, "temperature": 0.7})])


def test_a_context_cut_to_max_length_is_stated_and_a_continuation_longer_is_refused(setup):
    model = setup["model"]
    context, continuation = list(range(1, 40)), [7, 8, 9]
    [(log_p, _)] = evaluate.continuation_log_probs(model, [(context, continuation)], max_len=L)
    assert log_p == pytest.approx(-summed_loss(model, (context + continuation)[-(L + 1):], 3), abs=1e-4)
    with pytest.raises(evaluate.EvalError, match="continuation of 17 tokens is longer than the model's context of 16"):
        evaluate.continuation_log_probs(model, [([1], list(range(1, 18)))], max_len=L)


# ----------------------------------------------------------------------------- bad input: one line

def harness_command(args, monkeypatch):
    """evaluate.py's `harness` command; the harness indexes its thousands of built-in task files
    (10-20 s here) unless told not to: these tasks come from --include_path alone. Its command
    line adds a log handler on the stderr of the moment (this test's capture): removed after."""
    import logging

    import lm_eval.utils
    from lm_eval import tasks as harness_tasks

    logger = logging.getLogger("lm_eval")
    monkeypatch.setattr(logger, "handlers", list(logger.handlers))
    monkeypatch.setattr(logger, "propagate", logger.propagate)
    monkeypatch.setattr(lm_eval.utils, "_LOGGING_CONFIGURED", lm_eval.utils._LOGGING_CONFIGURED)
    original = harness_tasks.TaskManager
    monkeypatch.setattr(harness_tasks, "TaskManager",
                        lambda *a, **k: original(*a, **{**k, "include_defaults": False}))
    return evaluate.main(["harness", "--model", evaluate.HARNESS_MODEL, "--device", "cpu", *args])


@requires_lm_eval
def test_a_folder_that_is_no_checkpoint_is_one_line(setup, tmp_path, monkeypatch, capsys):
    not_a_checkpoint = tmp_path / "notes"
    not_a_checkpoint.mkdir()
    (not_a_checkpoint / "ckpt.pt").write_text("some notes, not weights\n")
    code = harness_command(["--model_args", f"ckpt={not_a_checkpoint}", "--tasks", "tiny_choice",
                            "--include_path", str(setup["tasks"])], monkeypatch)
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        f"evaluate.py harness: {not_a_checkpoint / 'ckpt.pt'}: not a checkpoint: torch.save writes a zip archive, "
        f"and this file starts with b'some'; give a run folder holding ckpt.pt (e.g. out/run) or the ckpt.pt file "
        f"train.py wrote")
    assert "Traceback" not in err
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        evaluate.HarnessLM(ckpt=str(tmp_path / "missing"))


@requires_lm_eval
def test_text_the_byte_tokenizer_cannot_encode_is_one_line_naming_task_and_document(setup, tmp_path, monkeypatch,
                                                                                     capsys):
    write_task(tmp_path, "tiny_nul", [CHOICE_DOCS[0], {"question": "a\0b", "choices": ["c", "d"], "label": 0}],
               CHOICE_TASK)
    code = harness_command(["--model_args", f"ckpt={setup['run']}", "--tasks", "tiny_nul",
                            "--include_path", str(tmp_path)], monkeypatch)
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "evaluate.py harness: task 'tiny_nul', document 1: the text holds '\\x00', the byte tokenizer's document "
        "separator, which this checkpoint's tokenizer cannot encode; drop the task or fix its documents")


@requires_lm_eval
@requires_gpt2
def test_gpt2_text_holding_the_separator_is_refused_naming_task_and_document(tmp_path):
    from lm_eval import simple_evaluate

    save_tiny(tmp_path / "gpt2run", tokenizer="gpt2", vocab_size=50304)
    write_task(tmp_path, "tiny_eot", [{"text": "A plain line."}, {"text": "two<|endoftext|>documents"}], TEXT_TASK)
    with pytest.raises(evaluate.EvalError, match=r"task 'tiny_eot', document 1: the text holds '<\|endoftext\|>', "
                                                 r"the gpt2 tokenizer's document separator"):
        simple_evaluate(model=evaluate.HARNESS_MODEL, model_args=f"ckpt={tmp_path / 'gpt2run'}", tasks=["tiny_eot"],
                        task_manager=task_manager(tmp_path), device="cpu")


def test_evaluate_imports_and_runs_without_lm_eval(tmp_path):
    """lm_eval is optional: with it hidden, evaluate.py imports, registers nothing, and the
    adapter and the command say how to install it."""
    code = ("import sys; sys.modules['lm_eval'] = None\n"  # import lm_eval now raises ImportError
            "import evaluate\n"
            "assert evaluate.model_registry is None\n"
            "try:\n    evaluate.HarnessLM(ckpt='x')\nexcept evaluate.EvalError as e:\n    print(e)\n"
            "sys.exit(evaluate.main(['harness', '--tasks', 'hellaswag']))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 1, r.stderr
    assert "needs lm_eval: pip install -r requirements-dev.txt" in r.stdout
    assert r.stderr.strip() == "evaluate.py harness: needs lm_eval: pip install -r requirements-dev.txt"


@pytest.mark.parametrize("attn", list(VARIANTS))
def test_every_variant_scores_a_row_the_same_alone_and_padded_in_a_batch(attn):
    """Rows of several lengths, right-padded into one batch, score as each does alone: every
    variant's outputs at a position ignore the padding after it (on the path a checkpoint
    loads with, kernel=fused). The pairs also cut contexts to max_len."""
    torch.manual_seed(0)
    model = Model(ModelConfig(**{**TINY_BYTES, "n_head": 4, "n_kv_head": 2}, attn=attn, window=4,
                              caa_window_max=8)).eval()
    rng = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(1, 256, (n,), generator=rng).tolist(), torch.randint(1, 256, (m,), generator=rng).tolist())
             for n, m in [(3, 2), (20, 5), (9, 1), (40, 4)]]
    batched = evaluate.continuation_log_probs(model, pairs, max_len=32, batch_size=4)
    for pair, (log_p, is_greedy) in zip(pairs, batched):
        [(alone, alone_greedy)] = evaluate.continuation_log_probs(model, [pair], max_len=32)
        assert log_p == pytest.approx(alone, abs=1e-4) and is_greedy == alone_greedy
