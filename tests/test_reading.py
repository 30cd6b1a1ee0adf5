"""What a reader of attention.py must read to learn what a selecting variant computes, counted
one reproducible way (`reading_lines`), and held under a budget of what a first reading costs: nsa <= 150,
indexer <= 150, moba <= 80. `python tests/test_reading.py [PATH]` prints the counts for any
version of attention.py (e.g. one from `git show main:attention.py > /tmp/a.py`).

The rule: the non-blank lines from the variant's `# ----` section header up to the next
header, less each block that starts at the marker comment `BOOKKEEPING` (what only the plan,
the FLOP count, the budget check, conversion and analysis read) and runs to the end of its
class, plus the non-blank lines of every top-level function or class the counted lines
call (`name(` or `.name(`) that another variant's section or a shared section (`# ---- shared
...`) defines. Not counted: the conventions (masks, RoPE, `expand_kv`), the `full` section
(the baseline `attention`, which every reader reads first) and the helpers outside the methods.
"""
import re
import sys
from pathlib import Path

BOOKKEEPING = "# -- not the method"
HEADER = re.compile(r"^# -{20,} (\S+)")
NOT_A_METHOD = {"settings", "conventions", "full", "outside", "which", "see"}


def sections(lines):
    """{name: (first, end)} line ranges of the `# ----` sections (name: the header's first word)."""
    starts = [(i, m.group(1)) for i, line in enumerate(lines) if (m := HEADER.match(line))]
    return {name: (i, end) for (i, name), (end, _) in zip(starts, starts[1:] + [(len(lines), None)])}


def method_lines(lines, first, end):
    """The non-blank lines of lines[first:end], less the bookkeeping blocks."""
    out, skipping = [], False
    for line in lines[first:end]:
        if line.strip().startswith(BOOKKEEPING):
            skipping = True
        elif skipping and line and not line[0].isspace():
            skipping = False  # the class ended
        if not skipping and line.strip():
            out.append(line)
    return out


def definitions(lines, first, end):
    """{name: its non-blank lines} of the top-level defs and classes in lines[first:end]."""
    defs, name = {}, None
    for line in lines[first:end]:
        m = re.match(r"^(?:def|class) (\w+)", line)
        if m:
            name = m.group(1)
            defs[name] = []
        elif line and not line[0].isspace() and not line.startswith("@"):
            name = None
        if name and line.strip():
            defs[name].append(line)
    return defs


def reading_lines(variant, path=Path(__file__).resolve().parent.parent / "attention.py"):
    """(total, section, {helper: lines}) for `variant`, by the rule in the module docstring."""
    lines = Path(path).read_text().splitlines()
    secs = sections(lines)
    own = method_lines(lines, *secs[variant])
    helpers = {}
    for name, (first, end) in secs.items():
        if name != variant and (name == "shared" or name not in NOT_A_METHOD):
            for fn, body in definitions(lines, first, end).items():
                if any(re.search(rf"(?<![\w])\.?{fn}\(", line) for line in own):
                    helpers[fn] = len(body)
    return len(own) + sum(helpers.values()), len(own), helpers


BUDGET = {"nsa": 150, "indexer": 150, "moba": 80}
# What may not appear in a method's lines (attention.py's header: the engineering sits under the
# marker): the KV cache, recording, the checks of what the cache keeps.
NOT_THE_METHOD = ("cache", "note(", "need_every_key", "state[")
TRACKER = re.compile(r"\b(issues?|tasks?|tickets?|PR|pull request)\s*#?\d+|#\d{2,}\b", re.IGNORECASE)


def test_selecting_variants_read_within_budget():
    for variant, budget in BUDGET.items():
        total, section, helpers = reading_lines(variant)
        assert total <= budget, (variant, total, section, helpers)


def engineering_in_methods(path=Path(__file__).resolve().parent.parent / "attention.py"):
    """[(section, line)]: the lines of a variant's section (or the section its helpers share)
    before its marker that name what NOT_THE_METHOD lists."""
    lines = Path(path).read_text().splitlines()
    found = []
    for name, (first, end) in sections(lines).items():
        if name in NOT_A_METHOD - {"full"}:
            continue
        found += [(name, line.strip()) for line in method_lines(lines, first, end)
                  if any(word in line for word in NOT_THE_METHOD)]
    return found


def test_no_method_line_is_about_caching_or_recording():
    assert engineering_in_methods() == []


def test_the_engineering_check_sees_a_cache_put_back(tmp_path):
    """The check on attention.py with one of the old lines put back into nsa's method (its
    compressed keys from the cache's state) and a note call into moba's: both are named."""
    lines = (Path(__file__).resolve().parent.parent / "attention.py").read_text().splitlines()
    for variant, line in (("nsa", '        k_cmp = cache.state["k_cmp"]'), ("moba", '        self.note("selection", 0)')):
        attend = next(i for i, text in enumerate(lines) if text.startswith("    def attend(")
                      and i > sections(lines)[variant][0])
        lines.insert(attend + 1, line)
    path = tmp_path / "attention.py"
    path.write_text("\n".join(lines))
    assert sorted(name for name, _ in engineering_in_methods(path)) == ["moba", "nsa"]


def tracker_numbers(root=Path(__file__).resolve().parent.parent):
    """[(file, line)]: lines of the project's .py files that cite an issue or tracker number."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if any(part.startswith(".") or part in ("__pycache__", "out", "data") for part in path.relative_to(root).parts):
            continue
        found += [(str(path.relative_to(root)), line.strip()) for line in path.read_text().splitlines()
                  if TRACKER.search(line)]
    return found


def test_no_py_file_cites_a_tracker_number():
    assert tracker_numbers() == []


def test_the_tracker_check_sees_one(tmp_path):
    cited = [f"x = 1  # see issue {42}", f"y = 2  # fixed in #{123}"]  # (formatted: this file cites none)
    (tmp_path / "a.py").write_text("\n".join(cited + ["z = 3  # 4 x 64 keys, 12 heads"]) + "\n")
    assert [line for _, line in tracker_numbers(tmp_path)] == cited


def test_the_count_sees_bookkeeping_and_helpers(tmp_path):
    """The rule on a toy file: the marked block is skipped, a shared helper is added."""
    toy = ["# " + "-" * 30 + " shared by a and b", "def helper(x):", "    return x", "",
           "# " + "-" * 30 + " a", "class A:", "    def attend(self):", "        return helper(1)",
           "    " + BOOKKEEPING + " plan", "    def describe(self):", "        return 1", "",
           "# " + "-" * 30 + " b", "x = 1"]
    path = tmp_path / "toy.py"
    path.write_text("\n".join(toy))
    assert reading_lines("a", path) == (4 + 2, 4, {"helper": 2})


if __name__ == "__main__":
    where = sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "attention.py"
    for variant in ("caa", "nsa", "moba", "indexer"):
        total, section, helpers = reading_lines(variant, where)
        print(f"{variant:8s} {total:4d} = section {section} + helpers {helpers}")
