"""Shared test set-up: offline tokenizer files, the corpus location, small text fixtures."""
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
def english_text():
    return ENGLISH


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (still run by CI unless deselected with -m 'not slow')")
