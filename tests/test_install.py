"""A newcomer's two commands: the README's install, then the README's test command, on a
fresh machine. These tests hold the first to be enough for the second: every pytest plugin
the test command's options need, and every third-party module the project and its tests
import, comes from what requirements.txt installs (with what those packages require).
Optional extras (requirements-dev.txt: lm-eval; triton, which torch's CUDA builds bring and
the CPU wheel does not) are imported only where a test skips without them. .ci/run runs the pair itself in a fresh virtual environment.

What requirements.txt installs is read from the installed packages' metadata: each listed
distribution and, recursively, what it requires (extras left out)."""
import ast
import importlib.metadata as metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

FOLDERS = ("", "experiments", "benchmarks", "tests")
OPTIONAL = {"lm_eval": "lm-eval", "triton": "triton"}  # module -> distribution, from requirements-dev.txt


def readme_block(heading):
    """The first ```bash block after `heading` in the README, as its command lines."""
    text = (ROOT / "README.md").read_text()
    start = text.index(heading)
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def install_command():
    (line,) = readme_block("## Install")
    return line


def readme_test_command():
    lines = [line for line in readme_block("Run the tests") if "pytest" in line]
    assert len(lines) == 1, lines
    return lines[0]


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(path):
    names = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.append(norm(re.match(r"[A-Za-z0-9._-]+", line).group(0)))
    return names


def installed_by(names):
    """The distributions `pip install` of `names` brings: them and, recursively, what they
    require without extras (markers evaluated here)."""
    from packaging.requirements import Requirement  # pip's and pytest's own dependency

    seen, todo = set(), list(names)
    while todo:
        name = norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed here: the import test below reports what it is missing
        for spec in requires:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def readme_installs():
    command = install_command()
    assert command == "pip install -r requirements.txt", command
    return installed_by(requirement_names(ROOT / "requirements.txt"))


def third_party_imports(root=ROOT):
    """{top-level module: [files importing it]} of every import, at any depth, in the
    project's .py files that is neither the standard library nor a project module."""
    local = {p.stem for folder in FOLDERS for p in (root / folder).glob("*.py")}
    found = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    tops = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    tops = [node.module.split(".")[0]]
                else:
                    continue
                for top in tops:
                    if top not in sys.stdlib_module_names and top not in local and top != "__future__":
                        found.setdefault(top, []).append(str(path.relative_to(root)))
    return found


def test_every_third_party_import_comes_with_the_readme_install():
    """Each module the project or its tests import is provided by a distribution that the
    README's install brings, or is an optional extra of requirements-dev.txt."""
    provided = readme_installs()
    dists_of = metadata.packages_distributions()
    imports = third_party_imports()
    assert {"torch", "numpy", "pytest"} <= set(imports), sorted(imports)  # the reading works
    missing = {}
    for module, files in sorted(imports.items()):
        if module in OPTIONAL:
            assert norm(OPTIONAL[module]) in requirement_names(ROOT / "requirements-dev.txt"), module
            continue
        dists = {norm(d) for d in dists_of.get(module, [])}
        if not dists & provided:
            missing[module] = (sorted(dists) or ["not installed"], files[:3])
    assert not missing, f"imported but not installed by `{install_command()}`: {missing}"


def imported_at_top(rel, module):
    """Does file `rel` import `module` at module level?"""
    tree = ast.parse((ROOT / rel).read_text())
    return any(isinstance(n, (ast.Import, ast.ImportFrom)) and module in ast.unparse(n).replace("import ", " ").split()
               for n in tree.body)


def test_optional_extras_are_imported_only_where_the_tests_skip_without_them():
    """lm_eval and triton may be absent after the README's install: the files importing them
    import them inside functions, so collection never fails; or at the top of a module that
    every other file imports only inside functions (kernels_triton.py: the kernels are the
    module)."""
    files = [str(p.relative_to(ROOT)) for folder in FOLDERS for p in sorted((ROOT / folder).glob("*.py"))]
    for module in OPTIONAL:
        for rel in third_party_imports().get(module, []):
            if imported_at_top(rel, module):
                name = Path(rel).stem
                importers = [f for f in files if f != rel and imported_at_top(f, name)]
                assert not importers, f"{rel} imports {module} at module level, and {importers} import {name} so"


def pytest_options(command):
    """The README's test command without its interpreter and its test path."""
    words = command.split()
    assert words[:3] == ["python", "-m", "pytest"] and words[-1] == "tests", command
    return words[3:-1]


def plugins_outside(provided):
    """pytest plugins installed here by a distribution the README's install does not bring."""
    return sorted({ep.name for dist in metadata.distributions() for ep in dist.entry_points
                   if ep.group == "pytest11" and norm(dist.metadata["Name"]) not in provided})


def run_with_readme_plugins(options, provided):
    disable = [arg for name in plugins_outside(provided) for arg in ("-p", f"no:{name}")]
    return subprocess.run([sys.executable, "-m", "pytest", *disable, *options, "--collect-only", "-q",
                           "tests/test_imports.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_readme_test_command_needs_only_what_the_readme_installs():
    """The README's test command, its options as typed, with every pytest plugin that the
    README's install would not bring switched off: pytest accepts the options (`-n` and
    `--dist` are pytest-xdist's: the newcomer's `unrecognized arguments: -n` came from it
    being in requirements-dev.txt only)."""
    options = pytest_options(readme_test_command())
    result = run_with_readme_plugins(options, readme_installs())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_the_check_sees_a_missing_plugin():
    """The check itself: without pytest-xdist among what the install brings, the same
    command fails on `-n`."""
    provided = readme_installs()
    if "pytest-xdist" not in provided or "-n" not in pytest_options(readme_test_command()):
        pytest.fail("the README's test command no longer uses pytest-xdist's -n: update this test")
    result = run_with_readme_plugins(pytest_options(readme_test_command()), provided - {"pytest-xdist"})
    assert result.returncode != 0 and "-n" in result.stderr, result.stderr[-2000:]
