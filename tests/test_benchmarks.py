"""benchmarks/train_step.py --quick and benchmarks/gpu_check.py (tiny): the structure of its JSON and the meaning of its ratio
(no timing is asserted: speed lives in the benchmark's printed ratios).

Run as its own process, as a user runs it: the benchmark forks a child per configuration
before it runs any torch op, and a child forked from this test process (whose OpenMP
threads earlier tests started) deadlocked in the full suite."""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

import attention
import kernels as kernels_of_this_process

ROOT = Path(__file__).resolve().parent.parent


CUDA_BUILD = torch.backends.cuda.is_built()


@pytest.mark.skipif(CUDA_BUILD, reason="this torch is CUDA's build: gpu_launches.py runs here (the next test)")
def test_gpu_launches_refuses_a_cpu_build_naming_what_to_install():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_launches.py")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "is not built with CUDA (install torch's CUDA build; no GPU is needed)" in r.stderr, \
        r.stderr[-2000:]


@pytest.mark.skipif(not CUDA_BUILD, reason="counting a GPU step's launches on fake CUDA tensors needs torch's CUDA "
                    "build (no GPU): the CPU wheel cannot make a CUDA tensor, fake or not")
def test_gpu_launches_counts_one_fused_kernel_a_norm_and_nsas_selection_on_top_of_fulls_step():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_launches
    full, nsa = gpu_launches.count("full", 64), gpu_launches.count("nsa", 64)
    # 2 layers x (2 block norms + q_norm + k_norm) + the final norm: one kernel each, none of the formula's five
    assert full["_fused_rms_norm"] == 9 and "rsqrt" not in full and "mean" not in full, full
    assert full["mm"] >= 14  # the 2 layers' 7 products each, counted on the fake GPU as on a real one
    assert sum(nsa.values()) > sum(full.values()) and "topk" in nsa, nsa


def test_train_step_quick_json(tmp_path):
    out = tmp_path / "train_step.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--quick", f"--out={out}"],
                   cwd=tmp_path, check=True, timeout=600, capture_output=True)
    report = json.loads(out.read_text())
    for key in ("command", "torch", "threads", "rounds", "steps_per_sample", "load_average", "memory", "rows"):
        assert key in report, key
    rows = {r["config"]: r for r in report["rows"]}
    assert set(rows) == {"full", "local"} and all(r["shape"] == "quick" for r in rows.values())
    assert rows["full"]["ratio"] == 1.0
    local = rows["local"]
    # the ratio is full's time over local's, per interleaved round, then the median
    assert len(local["seconds"]) == len(local["full_seconds"]) == report["rounds"]
    expected = statistics.median(a / b for a, b in zip(local["full_seconds"], local["seconds"]))
    assert abs(local["ratio"] - expected) < 1e-2 * expected
    expected = statistics.median(a / b for a, b in zip(local["full_cpu_seconds"], local["cpu_seconds"]))
    assert abs(local["cpu_ratio"] - expected) < 1e-2 * expected
    tokens = local["T"] * local["B"] * report["steps_per_sample"]
    assert abs(local["tok_s"] - tokens / statistics.median(local["seconds"])) < 1e-2 * local["tok_s"]
    for r in rows.values():
        assert "error" not in r, r
        assert r["tok_s"] > 0 and r["peak_mb"] > 0 and r["step_mb"] >= 0
        assert r["peak_mb"] >= r["step_mb"]
    # what bounds it: the attention layers' own ratio, and the step ratio that ratio allows
    assert rows["full"]["attn_ratio"] == 1.0 and rows["full"]["allows"] == pytest.approx(1.0)
    share = rows["full"]["attn_ms"] / (1e3 * statistics.median(rows["full"]["seconds"]) / report["steps_per_sample"])
    assert 0 < local["attn_share"] == pytest.approx(min(1.0, share))
    assert local["allows"] == pytest.approx(1 / (1 - local["attn_share"] + local["attn_share"] / local["attn_ratio"]))


def test_gpu_check_runs_every_step_at_the_tiny_shape(tmp_path):
    """benchmarks/gpu_check.py, the command a GPU user runs first, runs on a CPU at its tiny
    shape: the CUDA-only tests (skipped here, each with its reason), every configuration's
    attention core against SDPA, and training steps of every configuration after the
    preflight, into one JSON and one Markdown table."""
    out = tmp_path / "check.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), f"--out={out}"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check
    names = [n for n, _ in gpu_check.CONFIGS]
    assert {n.split("-")[0] for n in names} == set(attention.VARIANTS)  # every variant is checked
    assert result["tests"]["skipped"] >= 2 and result["tests"]["failed"] == 0 and result["tests"]["passed"] == 0
    for section in ("attention", "training"):
        rows = result[section]
        assert not [r for r in rows if "error" in r], rows
        assert sorted({r["config"] for r in rows}) == sorted(names)
    for row in result["training"]:
        assert row["tok_s"] > 0 and row["kernel"] == "fused" and row["mfu"] is None
        assert row["flop_s"] == pytest.approx(row["flops_per_token"] * row["tok_s"])
    md = (tmp_path / "check.md").read_text()
    assert all(f"| {n} |" in md for n in names) and "tests (pytest -m cuda)" in md


def test_train_step_ab_runs_each_checkouts_own_code(tmp_path):
    """benchmarks/train_step_ab.py imports each checkout's model, attention and kernels apart:
    a second checkout's attention calls its own kernels (marked here), not the first's; and a
    tiny run writes one sample of full and of the configuration per checkout and round."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import train_step_ab
    finally:
        sys.path.pop(0)
    other = tmp_path / "other"
    other.mkdir()
    for name in ("model.py", "attention.py", "kernels.py"):
        text = (ROOT / name).read_text()
        (other / name).write_text(text + "\nMARK = 'other'\n" if name == "kernels.py" else text)
    train_step_ab.load("ab_here", ROOT)
    train_step_ab.load("ab_other", other)
    here_kernels, other_kernels = sys.modules["ab_here_kernels"], sys.modules["ab_other_kernels"]
    assert getattr(other_kernels, "MARK", None) == "other" and not hasattr(here_kernels, "MARK")
    assert sys.modules["ab_other_attention"].kernels is other_kernels
    assert sys.modules["ab_here_attention"].kernels is here_kernels
    assert sys.modules["ab_other_model"].RMSNorm is sys.modules["ab_other_attention"].RMSNorm
    assert sys.modules["kernels"] is kernels_of_this_process  # the test process's own stay in place

    out = tmp_path / "ab.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_step_ab.py"), f"a={ROOT}", f"b={other}",
                    "--shape=quick", "--only=local", "--rounds=2", f"--out={out}"],
                   cwd=tmp_path, check=True, timeout=600, capture_output=True)
    samples = json.loads(out.read_text())["samples"]
    assert set(samples) == {f"{c}/local/{o}" for c in "ab" for o in ("full", "local")}
    assert all(len(s) == 2 and all(wall > 0 and cpu > 0 for wall, cpu in s) for s in samples.values())


def test_gpu_check_profile_dry_run(tmp_path):
    """benchmarks/gpu_check.py --profile (where the GPU time goes, ~8 minutes on an H100) runs end to end
    at the tiny shape with --dry_run: per variant, the first step's seconds, the top kernels
    (ops on a CPU) of one forward + backward at the first length, the time over SDPA's at both
    lengths, then training steps; a budget that leaves no time skips rows and says so. (asga
    is left out here: its CPU gate tile compiles for most of a minute.)"""
    names = ["full", "local", "dsa", "caa", "combiner", "nsa", "moba", "indexer"]
    out = tmp_path / "profile.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--profile", "--dry_run",
                        f"--only={','.join(names)}", f"--out={out}"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check
    assert result["mode"] == "profile" and "attention" not in result and "tests" not in result
    assert {n for n, _ in gpu_check.PROFILE_CONFIGS} == set(attention.VARIANTS)  # every variant, at its defaults
    rows = result["profile"]
    lengths = gpu_check.PROFILE_TINY["lengths"]
    names = [n for n in gpu_check.PROFILE_ORDER if n in names]  # the selecting variants first, asga last
    assert names[:4] == ["full", "nsa", "moba", "indexer"]
    assert [(r["config"], r["T"]) for r in rows] == [(n, T) for T in lengths for n in names]
    for row in rows:
        assert row["ms"] > 0 and row["compile_s"] > 0 and row["x_sdpa"] == pytest.approx(row["ms"] / row["sdpa_ms"])
        if row["T"] == lengths[0]:
            assert 0 < len(row["top"]) <= gpu_check.TOP_KERNELS and row["kernels"] >= len(row["top"])
            assert all(t["ms"] >= 0 and t["calls"] >= 1 and t["name"] for t in row["top"])
            assert [t["ms"] for t in row["top"]] == sorted((t["ms"] for t in row["top"]), reverse=True)
        else:
            assert "top" not in row
    assert [row["config"] for row in result["training"]] == names
    assert all(row["tok_s"] > 0 and row["first_step_s"] > 0 for row in result["training"])
    md = (tmp_path / "profile.md").read_text()
    assert all(f"| {n} |" in md for n in names) and "first step s" in md and "the top" in md

    out = tmp_path / "none.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry_run", "--budget_s=0",
                        "--only=full,nsa", f"--out={out}"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert all(row["skipped"].startswith("skipped") and "ms" not in row for row in result["profile"])
    assert all(row["error"].startswith("skipped") for row in result["training"])
    assert "skipped" in (tmp_path / "none.md").read_text()


def gpu_check_training_row(folder, *flags):
    """benchmarks/gpu_check.py --dry_run of full's training row alone, with `flags` ->
    (that row, the Markdown table)."""
    out = folder / "row.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry_run", "--skip=attention",
                        "--only=full", *flags, f"--out={out}"], cwd=folder, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    row, = json.loads(out.read_text())["training"]
    return row, out.with_suffix(".md").read_text()


@pytest.fixture(scope="module")
def short_row(tmp_path_factory):
    """One run for the two tests below (each gpu_check.py process pays its start-up): full's
    training row at --train_T=32, in a 100 s budget of which it needs --row_s=1."""
    return gpu_check_training_row(tmp_path_factory.mktemp("row"), "--budget_s=100", "--row_s=1", "--train_T=32")


def test_gpu_check_row_s_sets_what_a_training_row_needs_left(tmp_path, short_row):
    """--profile's training rows start only with --row_s seconds of the budget left: at 200 of a
    100 s budget the row is skipped and says it needs ~200 s; at 1 it runs."""
    skipped, _ = gpu_check_training_row(tmp_path, "--budget_s=100", "--row_s=200")
    assert skipped["error"].startswith("skipped") and "needs ~200" in skipped["error"], skipped
    row, _ = short_row
    assert row["tok_s"] > 0, row


def test_gpu_check_train_T_keeps_the_tokens_of_a_step(short_row):
    """--train_T sets the training rows' sequence length (the long-context throughput rows) and
    shrinks the batch so a step keeps its tokens: the tiny shape's 4 x 64 becomes 8 x 32, and
    the table says which."""
    row, md = short_row
    assert (row["T"], row["batch"]) == (32, 8) and row["tok_s"] > 0, row
    assert "| full | 32 x 8 |" in md


def test_gpu_check_stacks_every_prints_where_a_step_is(tmp_path):
    """--stacks_every=S prints every thread's Python stack to stderr each S seconds (a step
    that ran past its timeout on a GPU printed nothing but its header): the stacks name the
    project's frames."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry_run", "--skip=training",
                        "--only=nsa", "--stacks_every=0.2", f"--out={tmp_path / 's.json'}"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "the main thread:" in r.stderr and "gpu_check.py" in r.stderr, r.stderr[-2000:]
    assert re.search(r"gpu_check at \d+ s, (\d+|None) kernels compiled so far", r.stderr), r.stderr[-2000:]


def test_gpu_check_stacks_thread_is_stopped_before_the_interpreter_exits(capsys):
    """The stack printer is joined at exit (gpu_check registers its stop with atexit): a daemon
    thread left alive while the interpreter shut down aborted a run that had written
    everything (rc -6, "terminate called without an active exception")."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    stop = gpu_check.print_stacks_every(0.01)
    time.sleep(0.1)
    assert any(t.name == "gpu_check stacks" for t in threading.enumerate())
    stop()
    assert not any(t.name == "gpu_check stacks" for t in threading.enumerate())
    assert "the main thread:" in capsys.readouterr().err


def test_gpu_check_frees_a_failed_configuration_before_the_next(monkeypatch):
    """A training row that fails in its step (on an H100: the indexer out of memory) must not
    keep its model and optimizer alive into the next configuration, whose preflight then ran
    out of memory too: the next one starts with the failed model collected."""
    import weakref

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    models, alive_at_next = [], []

    def preflight(model, tokens, mc, run, typed):
        models.append(weakref.ref(model))
        if len(models) > 1:
            alive_at_next.append(models[0]() is not None)
        return "fused"

    class Failing:  # the first configuration's optimizer: its step fails, as an allocation would
        def __init__(self, model):
            self.params = list(model.parameters())

        def step(self):
            raise RuntimeError("CUDA out of memory (simulated)")

    made = []  # counts only: a reference here would keep the model alive

    def make_optimizer(model, tc):
        made.append(len(made))
        return Failing(model) if len(made) == 1 else torch.optim.SGD(model.parameters(), lr=0.0)

    monkeypatch.setattr(gpu_check, "preflight", preflight)
    monkeypatch.setattr(gpu_check.train, "make_optimizer", make_optimizer)
    shape = dict(gpu_check.TINY, steps=1)
    rows = gpu_check.training_rows(shape, "cpu", torch.float32, compile_model=False,
                                   configs=[("local", {}), ("local", {})])
    assert "simulated" in rows[0]["error"] and "tok_s" in rows[1], rows
    assert alive_at_next == [False], "the failed configuration's model was still alive at the next preflight"


def test_compile_time_compares_whole_and_blocks(tmp_path):
    """benchmarks/compile_time.py: per variant, the first training step compiled whole and
    block by block (train.py's model.compile_blocks), side by side; whole traces one graph,
    blocks one for the block and one for the tail (norm, head, loss). Two layers: whole then
    traces two (its count of graphs is still one), in a third of the 12 layers' time."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_time.py"), "--only=local", "--T=32",
                        "--layers=2"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    row = next(line for line in r.stdout.splitlines() if line.startswith("| local |"))
    cells = [c.strip() for c in row.strip("|").split("|")]  # config, then (first, step, compile s, graphs) x 2, ratio
    assert cells[4] == "1" and cells[8] == "2", row  # graphs traced: whole; blocks (a block, the tail)
    assert float(cells[3]) > 0 and float(cells[7]) > 0 and float(cells[9]) > 0, row


def test_gpu_check_profile_times_the_compiled_core(monkeypatch):
    """--profile on CUDA times each attention core compiled (torch.compile of `attend`, as the
    blocks of train.py's compiled model run it). The same code here, on the GPU path
    (kernel=flex) with CPU tensors and the aot_eager backend: dynamo and AOTAutograd trace each
    selecting variant's forward and backward, and the compiled step runs (FlexAttention's CPU
    guard against a backward lifted: its eager reference computes one, except for the
    gradients of captured tensors, so asga and caa are not here). A compile that fails
    leaves the row eager, and the row says why. local and combiner, whose cores are their
    FlexAttention calls (and combiner's merge by log-sum-exp), are left out: tests/test_lowering.py
    traces those calls' forward and backward through AOTAutograd, and
    tests/test_kernels.py::test_flex_training_step_traces_as_one_graph their training forward."""
    import torch.nn.attention.flex_attention as nn_fa
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check
    monkeypatch.setattr(nn_fa, "_validate_device", lambda *args, **kwargs: None)
    names = ["nsa", "moba", "indexer"]  # in gpu_check.PROFILE_ORDER
    monkeypatch.setattr(gpu_check, "PROFILE_CONFIGS", [c for c in gpu_check.PROFILE_CONFIGS if c[0] in names])
    shape = dict(gpu_check.PROFILE_TINY, kernel="flex", lengths=(64,))

    def profile(backend):
        result = {}
        gpu_check.profile_rows(shape, "cpu", torch.float32, time.time() + 600, result, lambda: None, backend=backend)
        return result["profile"]

    rows = profile("aot_eager")
    assert [(r["config"], r["path"]) for r in rows] == [(n, "compiled") for n in names], rows
    assert all(r["ms"] > 0 and r["compile_s"] > 0 for r in rows)

    def broken(gm, example_inputs):
        raise RuntimeError("no kernel for this")
    monkeypatch.setattr(gpu_check, "PROFILE_CONFIGS", gpu_check.PROFILE_CONFIGS[:1])
    row, = profile(broken)
    assert row["path"].startswith("eager: the compile failed") and "no kernel for this" in row["path"], row
    assert row["ms"] > 0


def test_decode_benchmark_rows_ratios_and_resume(tmp_path):
    """benchmarks/decode.py at two short lengths: one row per variant and T with the prefill
    and the decoding steps at both batches, full's ratio 1 and each ratio its median over
    full's, and an eager step's ops; the cache's bytes are what KVCache.nbytes says (local's window, full's every key),
    its buffers' the prompt's and the steps' rows;
    a rerun keeps the saved rows, and a length whose extrapolated prefill exceeds --budget is
    skipped with the reason printed."""
    out = tmp_path / "decode.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--lengths=64,128", "--variants=full,local,nsa",
           "--steps=2", "--layers=1", f"--out={out}"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {(row["T"], row["variant"]): row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(T, v) for T in (64, 128) for v in ("full", "local", "nsa")}
    settings = json.loads(out.read_text())["settings"]
    host = settings["host"]  # the machine, with the CPU kernels torch ran
    assert settings["malloc"] in ("kept", "system")  # kept where the C allocator is glibc's (keep_freed_memory)
    assert host.endswith(f"torch CPU kernels {torch.backends.cpu.get_cpu_capability()}") and " cores" in host, host
    D, H = 64, 12  # qwen-134m's heads
    assert rows[128, "full"]["cache_bytes_per_layer"] == 2 * H * D * 4 * 128  # every key and value, float32 (after the prefill)
    assert rows[128, "local"]["cache_bytes_per_layer"] == 2 * H * D * 4 * 128  # the window (256) holds them all
    # the buffers, made for the prompt and the steps as sample.generate makes them: not twice the prompt
    held, allocated = rows[128, "full"]["cache_bytes_per_layer"], rows[128, "full"]["cache_allocated_bytes_per_layer"]
    assert held < allocated < 1.5 * held
    assert all(len(row["decode_ms"]) == len(row["decode_batch_ms"]) == 2 for row in rows.values())
    line = next(x for x in r.stdout.splitlines() if x.startswith("| nsa | 128 |"))
    cells = [c.strip() for c in line.split("|")[1:-1]]
    full, nsa = rows[128, "full"], rows[128, "nsa"]
    assert float(cells[3]) == pytest.approx(nsa["prefill_s"] / full["prefill_s"], abs=0.006)
    # decoding ratios: over full's steps taken in turns with the row's own, kept in the row
    assert len(nsa["full_decode_ms"]) == len(nsa["full_decode_batch_ms"]) == 2 and "full_decode_ms" not in full
    assert float(cells[5]) == pytest.approx(statistics.median(nsa["decode_ms"])
                                            / statistics.median(nsa["full_decode_ms"]), abs=0.006)
    assert float(cells[7]) == pytest.approx(statistics.median(nsa["decode_batch_ms"])
                                            / statistics.median(nsa["full_decode_batch_ms"]), abs=0.006)
    # an eager step's aten ops (views left out): nsa's selection and its three branches are more than full's one softmax
    assert nsa["ops_per_step"] > full["ops_per_step"] > 0 and int(cells[-1]) == nsa["ops_per_step"]
    assert "| full | 64 | " in r.stdout and "| 1.00 |" in r.stdout.split("| full | 64 |")[1].split("\n")[0]
    floor = re.search(r"the weights' products alone .*: ([\d.]+) ms at batch 1 = ([\d.]+)x .*; ([\d.]+) ms at batch 8",
                      r.stdout)
    assert floor and 0 < float(floor[1]) and 0 < float(floor[3]) and float(floor[2]) > 0, r.stdout[-2000:]
    # the same products over full's step at each T and batch: the floor under every ratio to full
    shares = re.search(r"over full's step, a floor .*T = 128: ([\d.]+) at batch 1, ([\d.]+) at batch 8", r.stdout)
    assert shares, r.stdout[-2000:]
    assert float(shares[1]) == pytest.approx(float(floor[1]) / statistics.median(full["decode_ms"]), rel=0.05, abs=0.01)
    assert float(shares[2]) == pytest.approx(float(floor[3]) / statistics.median(full["decode_batch_ms"]), rel=0.05, abs=0.01)
    again = subprocess.run(cmd + ["--lengths=64,128,256", "--budget=0"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    kept = {(row["T"], row["variant"]): row for row in json.loads(out.read_text())["rows"]}
    assert all(kept[key] == rows[key] for key in rows)  # measured once
    assert "skipped" in kept[256, "nsa"] and "extrapolated as T^2" in again.stdout
    saved = json.loads(out.read_text())  # a row missing beside full's kept row: full prefilled again to take turns
    saved["rows"] = [row for row in saved["rows"] if (row["T"], row["variant"]) != (64, "local")]
    out.write_text(json.dumps(saved))
    third = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stderr[-3000:]
    local = next(row for row in json.loads(out.read_text())["rows"] if (row["T"], row["variant"]) == (64, "local"))
    assert len(local["full_decode_ms"]) == 2 and "T=64 local" in third.stdout and "T=64 nsa" not in third.stdout


FREED_MEMORY = """
import resource, sys
import torch
import decode
kept = decode.keep_freed_memory() if sys.argv[1] == "kept" else None
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
x = torch.ones(100 << 20, dtype=torch.uint8)  # 100 MB, touched
held = resident()
del x
freed = resident()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
y = torch.ones(50 << 20, dtype=torch.uint8)  # half as much, touched: fits the freed block past any small
# allocation carved from its start meanwhile (one of 100 MB may then go past it, to fresh memory)
print(kept, held - freed, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


def test_decode_benchmark_keeps_the_memory_a_process_frees_for_its_next_allocation():
    """decode.keep_freed_memory (decode.py and decode_ab.py call it on a CPU): a freed 100 MB
    block stays in the process, resident, and the next one of that size reuses it without
    faulting its pages in again; without it, glibc hands the block back to the system. What
    makes the untimed prefill's touch of its temporaries carry over to the timed one (a reuse,
    not a promise: a block freed in the heap serves the next request it fits)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/statm: Linux only")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)]))
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    runs = {}
    for how in ("kept", "system"):
        r = subprocess.run([sys.executable, "-c", FREED_MEMORY, how], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[how] = r.stdout.split()
    if runs["kept"][0] != "True":
        pytest.skip("the C allocator here is not glibc's (no mallopt): keep_freed_memory leaves it as it is")
    assert int(runs["system"][1]) > 90 << 20  # handed back when freed: the test can tell the two apart
    assert int(runs["kept"][1]) < 10 << 20  # kept: still resident after the free
    assert int(runs["kept"][2]) < 1000  # reused: not faulted in again (12800 pages of 4 KB if it were)


def run_decode(decode, argv):
    """benchmarks/decode.py's main in this process, torch's thread count restored after (it sets one);
    --malloc=system: the test process's C allocator left as it is."""
    threads = torch.get_num_threads()
    try:
        decode.main(argv + ["--malloc=system"])
    finally:
        torch.set_num_threads(threads)


def test_decode_benchmark_keeps_going_past_a_failed_row(tmp_path, monkeypatch):
    """A row that fails (on an H100: nsa's prefill out of memory at T = 32768) is kept with its
    error, and the rows after it are still measured."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode
    real = decode.measure

    def measure(attn, T, args, autocast, **kw):
        if attn == "local":
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(attn, T, args, autocast, **kw)

    monkeypatch.setattr(decode, "measure", measure)
    out = tmp_path / "decode.json"
    run_decode(decode, ["--lengths=32", "--variants=full,local,nsa", "--steps=1", "--layers=1", f"--out={out}"])
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["local"]["skipped"].startswith("failed: RuntimeError: CUDA out of memory")
    assert "decode_ms" in rows["nsa"] and "decode_ms" in rows["full"]


def test_decode_benchmark_builds_every_model_with_the_attention_settings_asked_for(tmp_path):
    """--attention=key=value,... builds every model with those AttentionConfig fields (here nsa
    at other sizes: what its step's definition reads follows them, not its defaults), records
    them in the settings, and refuses an unknown key, or sizes a variant rejects, before any
    row runs: with the valid keys, or the variant's own error naming it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode
    out = tmp_path / "decode.json"
    sizes = dict(nsa_cmp_block=8, nsa_cmp_stride=4, nsa_block=16, nsa_topk=3, nsa_window=8)
    flag = "--attention=" + ",".join(f"{k}={v}" for k, v in sizes.items())
    run_decode(decode, ["--lengths=64", "--variants=nsa", "--steps=1", "--rounds=1", "--layers=1", f"--out={out}", flag])
    saved = json.loads(out.read_text())
    assert saved["settings"]["attention"] == sizes
    row, = saved["rows"]
    # the step at position 64 (after 1 step): C = (65 - 8) // 4 + 1 = 15 compressed keys, 3 blocks
    # of 16 keys, a window of 9; each a key and a value of 12 heads of 64 in float32 (the
    # defaults would read 7 compressed keys and all 65 keys twice)
    assert row["reads_per_layer"] == 4 * 2 * 12 * 64 * (15 + 3 * 16 + 9)
    for bad, said in (("nsa_cmp_stride=5", "--attention=nsa_cmp_stride=5: nsa: nsa_cmp_stride=5 must divide"),
                      ("attn=nsa", "is not key=value of an attention setting; valid keys: n_head")):
        with pytest.raises(SystemExit) as e:
            run_decode(decode, ["--lengths=64", "--variants=full,nsa", f"--out={tmp_path / 'bad.json'}", "--attention=" + bad])
        assert said in str(e.value), e.value
        assert not (tmp_path / "bad.json").exists()


def test_decode_benchmark_times_its_eager_steps_after_an_untimed_one(tmp_path, monkeypatch):
    """An eager row takes one untimed step at each batch before its timed steps (a compiled
    helper, kernels.GatheredDots, compiles in its first call: a row's spread showed that, or
    not, by which variants ran before it), and the row keeps only the timed ones."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode
    calls, real = [], decode.decode_steps

    def decode_steps(step, cache, batch, steps, device, start_token=0):
        calls.append((batch, steps))
        return real(step, cache, batch, steps, device, start_token)

    monkeypatch.setattr(decode, "decode_steps", decode_steps)
    out = tmp_path / "decode.json"
    run_decode(decode, ["--lengths=32", "--variants=nsa", "--steps=3", "--batch=2", "--layers=1", f"--out={out}"])
    row, = json.loads(out.read_text())["rows"]
    assert calls == [(1, 1), (1, 3), (2, 1), (2, 3)], calls
    assert len(row["decode_ms"]) == len(row["decode_batch_ms"]) == 3


def test_decode_benchmark_holds_only_fulls_batch_one_cache_beside_a_rows_prefill(tmp_path, monkeypatch):
    """Between rows `full` keeps its batch-1 cache only: a later row's prefill runs beside that
    one cache (with both held, 3.6 GB at T = 32768, nsa's prefill took ~8% longer than beside
    none, where `full`'s own ran beside nothing), and `full`'s batch turns run on a cache at
    --batch repeated from it for that row."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode
    held, batches = [], []
    real_measure, real_turns = decode.measure, decode.turns

    def batch_of(cache):
        return cache[0].k.view().shape[0]

    def measure(attn, T, args, autocast, beside=None, keep=False):
        if beside:  # what `full` holds while this row prefills
            held.append([batch_of(obj) for obj in beside if isinstance(obj, list)])
        return real_measure(attn, T, args, autocast, beside=beside, keep=keep)

    def turns(step, cache, beside, batch, args):
        if beside:
            batches.append((batch, batch_of(beside[1])))
        return real_turns(step, cache, beside, batch, args)

    monkeypatch.setattr(decode, "measure", measure)
    monkeypatch.setattr(decode, "turns", turns)
    run_decode(decode, ["--lengths=32", "--variants=full,local,nsa", "--steps=2", "--batch=3", "--layers=1",
               f"--out={tmp_path / 'decode.json'}"])
    assert held == [[1], [1]], held  # local's and nsa's prefills: full's batch-1 cache alone
    assert batches == [(1, 1), (3, 3)] * 2, batches  # each side's turns at the row's batch


def test_decode_benchmark_times_a_prefill_after_an_untimed_one_of_the_same_prompt(tmp_path, monkeypatch):
    """Each row's timed prefill follows an untimed one of the whole prompt, on a CPU too: a
    first prefill pays for touching its memory (on a VM that hands freed memory to its host,
    up to ~3 ms a MB: nsa's first prefill of 16384 tokens 8.1 s, 6.0 after), by the memory
    a variant touches, not the work it does; the prefill timed is the second."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode
    prompts, real_build, real_clock = [], decode.build, decode.clock
    clocked = []

    def build(*a, **kw):
        model = real_build(*a, **kw)
        forward = model.forward

        def recorded(idx, *args, **kwargs):
            if idx.shape[1] > 1:
                prompts.append((idx.shape[1], len(clocked)))  # the prompt's length, the clock reads before it
            return forward(idx, *args, **kwargs)

        model.forward = recorded
        return model

    def clock(device):
        clocked.append(1)
        return real_clock(device)

    monkeypatch.setattr(decode, "build", build)
    monkeypatch.setattr(decode, "clock", clock)
    run_decode(decode, ["--lengths=4160", "--variants=full,nsa", "--steps=1", "--batch=2", "--layers=1",
               f"--out={tmp_path / 'd.json'}"])
    lengths = [T for T, _ in prompts]
    assert lengths == [4160] * 4, prompts  # full's two prefills, then nsa's (more tokens than the 4096 once warmed)
    # the timed one is the second of each row: a clock read right before it, none between the first and it
    assert prompts[0][1] == prompts[1][1] - 1 and prompts[2][1] == prompts[3][1] - 1, prompts


def test_decode_benchmark_turns_start_with_an_untimed_step(monkeypatch):
    """Steps taken in turns with full's: each side's turn starts with one untimed step (the
    first step after the other model's runs on data its reads evicted from the caches, which
    no decoding loop's step does); only the steps after it are kept, --steps of each side."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode
    calls = []

    def decode_steps(step, cache, batch, steps, device, start_token=0):
        calls.append((step, steps))
        return [float(len(calls))] * steps

    monkeypatch.setattr(decode, "decode_steps", decode_steps)
    args = argparse.Namespace(steps=5, rounds=2, device="cpu")
    mine, theirs = decode.turns("row", None, ("full", None), 1, args)
    assert calls == [("row", 1), ("row", 3), ("full", 1), ("full", 3), ("row", 1), ("row", 2), ("full", 1), ("full", 2)]
    assert mine == [2.0] * 3 + [6.0] * 2 and theirs == [4.0] * 3 + [8.0] * 2
    calls.clear()  # no full beside (full's own row): its steps one after another, none untimed
    assert decode.turns("full", None, None, 1, args) == ([1.0] * 5, []) and calls == [("full", 5)]


def test_decode_ab_compiles_each_checkouts_steps(tmp_path):
    """decode_ab.py --compile: every checkout's steps through its own model.compile_decoding
    (said per row), timed after warm-up steps, in the same table. `full` alone at batch 1:
    each variant and batch is a graph of its own, compiled by inductor (~15-30 s each here
    from a cold cache); a second batch's steps take the same path (`interleaved`),
    tests/test_sample.py compiles steps at batch 2 and tests/test_decode.py every variant's."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_ab.py"), f"a={ROOT}",
                        "--lengths=64", "--variants=full", "--steps=2", "--compile"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    said = [line for line in r.stdout.splitlines() if "steps" in line and line.strip().startswith("T=64")]
    assert len(said) == 1 and "steps compiled (torch.compile" in said[0], said
    rows = [line for line in r.stdout.splitlines() if line.startswith("| full | 64 | a |")]
    assert len(rows) == 1 and float(rows[0].split("|")[7]) > 0


def test_decode_ab_times_a_prefill_after_an_untimed_one_of_the_same_prompt(monkeypatch):
    """decode_ab.py's prefill, as decode.py's: an untimed prefill of the same prompt by the same
    model, then the timed one on a fresh cache (a first prefill pays for touching its memory
    and compiles helpers: the checkout that ran first paid more)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode_ab
    import model as models
    events, real_clock = [], decode_ab.clock

    class Recorded(models.Model):
        def forward(self, idx, *a, cache=None, **kw):
            events.append(("prefill", idx.shape[1], cache))  # the cache kept: ids are not reused
            return super().forward(idx, *a, cache=cache, **kw)

    def clock(device):
        events.append(("clock",))
        return real_clock(device)

    monkeypatch.setattr(decode_ab, "clock", clock)
    checkout = types.SimpleNamespace(ModelConfig=models.ModelConfig, PRESETS=models.PRESETS, Model=Recorded)
    model, cache, seconds = decode_ab.prefill(checkout, "local", 40)
    assert [e[:2] for e in events] == [("prefill", 40), ("clock",), ("prefill", 40), ("clock",)], events
    assert events[2][2] is cache and events[0][2] is not cache and seconds > 0  # the timed one fills the cache returned


def test_decode_ab_runs_each_checkout_and_divides_by_its_full(tmp_path):
    """benchmarks/decode_ab.py with two labels for this checkout: a row per T, variant and
    checkout; full's ratios are 1; a variant's 'x full' is its decode time over the same
    checkout's full, at batch 1 and at --batch; --prefills=3: each checkout's prefill three
    times in turns, the order reversed every other round, the median in the table."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_ab.py"), f"a={ROOT}", f"b={ROOT}",
                        "--lengths=64", "--variants=local", "--steps=2", "--batch=3", "--prefills=3"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): [c.strip() for c in line.split("|")[4:-1]]
            for line in r.stdout.splitlines() if line.startswith("| ") and "---" not in line and "variant" not in line}
    assert set(rows) == {(v, "64", c) for v in ("full", "local") for c in "ab"}
    assert rows["full", "64", "a"][1] == rows["full", "64", "a"][4] == rows["local", "64", "a"][2] == "1.00"
    for c in "ab":
        local, full = rows["local", "64", c], rows["full", "64", c]
        assert float(local[4]) == pytest.approx(float(local[3]) / float(full[3]), rel=0.03, abs=0.01)  # printed rounded
        assert float(local[7]) == pytest.approx(float(local[6]) / float(full[6]), rel=0.03, abs=0.01)  # at batch 3
        assert full[7] == "1.00" and float(local[8]) > 0
    said = [line.split() for line in r.stdout.splitlines() if line.strip().startswith("T=64 local") and "prefill" in line]
    assert [words[2].rstrip(":") for words in said] == ["a", "b", "b", "a", "a", "b"]
    for c in "ab":
        mine = [float(words[4]) for words in said if words[2] == f"{c}:"]
        assert rows["local", "64", c][0] == f"{statistics.median(mine):.2f}"


def test_keys_product_prints_each_shapes_forms_after_checking_they_agree():
    """benchmarks/keys_product.py --quick: one row per shape, each form's time beside the sum's,
    after it has checked that the pieces, keys_times and the rows one by one equal the whole
    product (it exits non-zero where they do not)."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "keys_product.py"), "--quick"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if re.match(r"\| \d", line)]
    assert [row.split(" | ")[:4] for row in rows] == [["| 1", "4", "64", "2048"], ["| 2", "24", "64", "2048"]]
    assert all(float(cell) > 0 for row in rows for cell in row.strip("| ").split(" | ")[5:])


# what the device tool gives a session (/work/.library/device/README.md): one command of at most
# 2,000 characters running at most 600 s, 15 minutes of device time in all
DEVICE_COMMAND_CHARS, DEVICE_CALL_S, DEVICE_SESSION_S = 2000, 600, 900


def prepared_gpu_calls():
    """(record, [command, ...]): the indented commands under "## The next run" of the newest GPU
    run record in benchmarks/gpu_runs (newest by the date in its name, then its letter)."""
    records = sorted(ROOT.glob("benchmarks/gpu_runs/*_20*.md"), key=lambda p: p.stem.split("_", 1)[1])
    record = next(p for p in reversed(records) if "\n## The next run" in p.read_text())
    section = record.read_text().split("\n## The next run", 1)[1].split("\n## ", 1)[0]
    return record, ["\n".join(line[4:] for line in block.splitlines())
                    for block in re.findall(r"(?:^    .*\n?)+", section, re.M) if "python3" in block]


def test_the_prepared_gpu_call_parses_and_fits_the_device_limits(monkeypatch, tmp_path):
    """The call a GPU sitting runs first, as its record prints it: every script and test file
    it names exists, every benchmark accepts its flags (main(argv) parsed, nothing run), every
    command has its own timeout, and each call fits one device command (characters, seconds)
    and all of them the session's device time. A renamed flag found here costs nothing; found
    on the GPU, it costs the sitting's one call."""
    import argparse
    import shlex

    record, calls = prepared_gpu_calls()
    assert calls, f"{record.name} lists no command under '## The next run'"

    class Parsed(Exception):
        pass

    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))  # a bad flag exits (SystemExit) inside parse

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    seconds = []
    for call in calls:
        assert len(call) <= DEVICE_COMMAND_CHARS, (record.name, len(call))
        commands = [c.strip() for c in call.replace("(", ";").replace(")", ";").replace("\n", ";").split(";")]
        commands = [c for c in commands if "python3" in c]
        limits = [int(m) for c in commands for m in re.findall(r"^(?:\w+=\S+ )*timeout (\d+) ", c)]
        assert len(limits) == len(commands), f"{record.name}: a command without its own timeout: {commands}"
        seconds.append(sum(limits))
        assert seconds[-1] <= DEVICE_CALL_S, (record.name, seconds[-1])
        for command in commands:
            words = shlex.split(command.replace("$OUT", str(tmp_path)))
            words = words[words.index("python3") + 1:]
            if words[:2] == ["-m", "pytest"]:
                files = [w for w in words if w.endswith(".py")]
                assert files and all((ROOT / f).is_file() for f in files), command
                continue
            script = ROOT / words[0]
            assert script.is_file(), command
            module = __import__(script.stem)
            try:
                module.main(words[1:])
            except Parsed:
                continue
            except SystemExit:  # argparse's error, printed above
                pytest.fail(f"{record.name}: {script.name} refuses the flags of `{command}`")
            pytest.fail(f"{script.name}'s main ran without parsing its flags through argparse")
    assert sum(seconds) <= DEVICE_SESSION_S, (record.name, seconds)


def test_decode_graph_static_step_follows_the_models_own_steps():
    """benchmarks/decode_graph.py on a CPU: its static-shape decoding steps (`StaticStep`, what a
    CUDA graph replays) give the model's own steps' logits for `full`, local, moba, nsa and the
    indexer, 20 tokens after a prompt, with grouped heads, to float32's rounding (a moba block
    ranked, forced or masked wrongly, a block mean or compressed key left unwritten, nsa's window
    one key short, its branches mixed by one gate or its heads' block scores not summed, local's
    window one key short, the indexer's step key unwritten, its ReLU dropped, its mask one slot
    off, its k one short or its weights' signs lost moves them by 3e-2 or more)."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_graph.py")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = re.findall(r"^(\w+): the static step's logits .* max \|diff\| (\S+), argmax (.*) at every step$", r.stdout, re.M)
    assert [name for name, _, _ in rows] == ["full", "local", "moba", "nsa", "indexer"], r.stdout
    for name, diff, argmax in rows:
        assert float(diff) < 1e-5 and argmax == "the same", (name, diff, argmax)


def test_decode_linear_times_whole_steps_with_each_form_fixed():
    """benchmarks/decode_linear.py --steps=T: a row per variant and batch, a median step time per
    form of DecodeLinear.FORMS (each fixed in turns), and each relative to oneDNN's (its own 1.00)."""
    from model import DecodeLinear

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_linear.py"), "--steps=80",
                        "--variants=local,moba", "--batch=1,2", "--rounds=1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| variant"))
    assert header.split(" | ")[2:2 + len(DecodeLinear.FORMS)] == [f"{f} ms" for f in DecodeLinear.FORMS]
    rows = [line.strip("| ").split(" | ") for line in lines if line.startswith(("| local", "| moba"))]
    assert [(v, b) for v, b, *_ in rows] == [("local", "1"), ("local", "2"), ("moba", "1"), ("moba", "2")]
    n = len(DecodeLinear.FORMS)
    for _, _, *cells in rows:
        ms, ratios = [float(c) for c in cells[:n]], [float(c) for c in cells[n:]]
        assert len(ratios) == n and all(t > 0 for t in ms) and ratios[0] == 1.0
        for t, ratio in zip(ms, ratios):  # (ms printed to 0.01, ratios to 0.01)
            assert abs(ratio - t / ms[0]) <= 0.006 + ratio * (0.006 / t + 0.006 / ms[0])


def test_decode_linear_times_every_form_in_and_out_of_cache():
    """benchmarks/decode_linear.py: for each (rows, weight shape) of decode.py's model, a row per
    form of DecodeLinear.FORMS, fastest out of cache first, each time relative to F.linear's
    out of cache (F.linear's own 1.00), the bandwidth its out-of-cache time reads the weight at."""
    from model import DecodeLinear

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_linear.py"), "--batch=2", "--cold_mb=4"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [line.strip("| ").split(" | ") for line in r.stdout.splitlines() if line.startswith("| 2 x")]
    refused = [(row[0], row[1]) for row in rows if row[2].startswith("refused")]
    # inductor's form takes one row only (model.FormRefused)
    assert sorted(refused) == sorted((size, "inductor") for size in {row[0] for row in rows})
    rows = [row for row in rows if not row[2].startswith("refused")]
    sizes = {}
    for size, form, hot, cold, gbs, ratio in rows:
        sizes.setdefault(size, []).append((form, float(cold), float(ratio)))
        assert float(hot) > 0 and float(gbs) > 0
    assert set(sizes) == {"2 x 768 -> 768", "2 x 768 -> 2432", "2 x 2432 -> 768", "2 x 768 -> 256"}
    for forms in sizes.values():
        assert sorted(f for f, _, _ in forms) == sorted(set(DecodeLinear.FORMS) - {"inductor"})
        assert [c for _, c, _ in forms] == sorted(c for _, c, _ in forms)  # fastest first
        cold = dict((f, c) for f, c, _ in forms)
        for form, c, ratio in forms:
            # (the times printed to 0.001 ms, the ratio to 0.01)
            assert abs(ratio - c / cold["F.linear"]) <= 0.006 + ratio * (0.0006 / c + 0.0006 / cold["F.linear"])
