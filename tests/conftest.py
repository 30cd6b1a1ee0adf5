"""Shared test set-up: offline tokenizer files, the corpus location, small text fixtures, and
a check that the suite leaves the checkout as it found it."""
import os
import sys
from pathlib import Path

import pytest

# Idle OpenMP threads sleep instead of spinning: tests start subprocesses (torchrun ranks)
# that share the 2 cores with this one, and spinning threads starve them (train.py does the same).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# asga's gate tile runs eager in the suite (and the processes it starts): compiling it costs
# every test process tens of seconds on 2 cores; tests/test_gate_tile.py checks the compiled one.
os.environ.setdefault("ASGA_COMPILED_GATE", "0")
# Likewise the dots with selected cache rows (kernels.GatheredDots): the suite counts and checks the
# eager ops; tests/test_decode.py checks the compiled loop against them.
os.environ.setdefault("DECODE_COMPILED_GATHER", "0")
# Decode-sized CPU products through one fixed form (model.DecodeLinear): the form measured
# fastest can change with the machine's load from run to run, and the forms round apart;
# tests/test_decode.py checks the measuring and every form.
os.environ.setdefault("DECODE_LINEAR", "F.linear")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# These machines have no internet: use the checked-out GPT-2 BPE files when they are there.
# On a user's machine tiktoken downloads them itself.
_TIKTOKEN = ROOT.parent / "shared" / "tiktoken"
if _TIKTOKEN.is_dir() and "TIKTOKEN_CACHE_DIR" not in os.environ:
    os.environ["TIKTOKEN_CACHE_DIR"] = str(_TIKTOKEN)



def _gpt2_available():
    try:
        import tiktoken

        tiktoken.get_encoding("gpt2")
        return True
    except Exception:  # no ../shared/tiktoken and no network to download the BPE files
        return False


HAVE_GPT2 = _gpt2_available()
requires_gpt2 = pytest.mark.skipif(
    not HAVE_GPT2,
    reason="needs GPT-2's BPE files: tiktoken downloads them (network) or finds them in "
           "../shared/tiktoken beside the checkout; neither is available here",
)

CORPUS = ROOT.parent / "shared" / "corpus"
requires_corpus = pytest.mark.skipif(
    not (CORPUS / "fineweb_legalpilot_train.jsonl").exists(),
    reason="needs ../shared/corpus (the FineWeb slice beside the checkout; CI always has it)",
)

# Our own sentences (not copied from anywhere), for tests that need English text offline.
ENGLISH = (
    "The small model reads a sentence and guesses the next word. "
    "Each morning the baker opens the shop at seven, and the bread is still warm. "
    "A student asked why the window of attention was only a few words wide. "
    "The answer was simple: it was cheaper, and most words depend on their neighbours. "
    "On rainy days the river rises, the ferry waits, and the town grows quiet. "
    "We counted 12 boats, 3 bridges and 41 lamps along the northern bank. "
)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test, restored after: the small tensors of the attention
    tests ran ~10x slower with 2 threads on the shared 2-core machines (OpenMP's barrier
    waits, measured). A module opts in with pytestmark = pytest.mark.usefixtures("one_thread")."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def english_text():
    return ENGLISH


# Folders whose changes are not the tests' doing: git's own, and Python's and pytest's caches.
NOT_CHECKED = {".git", "__pycache__", ".pytest_cache"}


def checkout_files():
    """{path relative to the checkout: (size, mtime)} of every file in it, the ignored out/ and
    data/ included (a user's runs and shards live there), less NOT_CHECKED."""
    files = {}
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in NOT_CHECKED]
        for name in names:
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except OSError:  # removed between the listing and the stat
                continue
            files[os.path.relpath(path, ROOT)] = (st.st_size, st.st_mtime_ns)
    return files


@pytest.fixture(scope="session", autouse=True)
def checkout_unchanged():
    """Every test writes only under its own temporary folders: after the suite, the checkout
    (committed files, the user's out/ runs and data/ shards) is as the suite found it. A test
    that planned into out/run or made shards in data/ fails here, naming the files."""
    before = checkout_files()
    yield
    after = checkout_files()
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    assert not changed, (f"the tests changed the checkout (created, modified or removed): {changed[:20]}; "
                         f"a test must write only under its tmp_path (or files were edited while the "
                         f"tests ran)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (still run by CI unless deselected with -m 'not slow')")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; `python benchmarks/gpu_check.py` runs these (`-m cuda`)")
