"""Imports run one way: no cycle among the project's modules (the top level, experiments/,
benchmarks/ and tests/), and the scripts a user runs beside train.py do not import it.

Imports are read with ast at any depth (an import inside a function is still a dependency)
and resolved as the scripts' sys.path resolves them: the repository root first (every script
and conftest.py insert it), then the file's own folder, then experiments/ and benchmarks/
(which the tests insert)."""
import ast
from pathlib import Path

from conftest import ROOT

FOLDERS = ("", "experiments", "benchmarks", "tests")


def import_graph(root):
    """{file: {project files it imports}} for every .py file in FOLDERS under root."""
    root = Path(root)
    files = sorted(p for folder in FOLDERS for p in (root / folder).glob("*.py"))
    graph = {}
    for path in files:
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {(a.name, 0) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names |= {(node.module or a.name, node.level) for a in node.names}
        graph[path] = set()
        for name, level in names:
            top = name.split(".")[0]
            places = [path.parent] if level else [root, path.parent, root / "experiments", root / "benchmarks"]
            found = next((d / f"{top}.py" for d in places if (d / f"{top}.py").exists()), None)
            if found is not None and found != path:
                graph[path].add(found)
    return graph


def find_cycle(graph):
    """One import cycle as [a, b, ..., a], or None."""
    state, stack = {}, []  # state: 1 while on the stack, 2 when done

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def names(graph, root=ROOT):
    return {str(a.relative_to(root)): {str(b.relative_to(root)) for b in bs} for a, bs in graph.items()}


def test_the_project_has_no_import_cycle():
    graph = import_graph(ROOT)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(str(p.relative_to(ROOT)) for p in cycle)
    edges = names(graph)
    # the graph is read, not empty: edges the design names (docs/design.md) are found
    assert "config.py" in edges["train.py"] and "evaluate.py" in edges["train.py"]
    assert "model.py" in edges["config.py"] and "sweep.py" not in str(edges["experiments/recall_grid.py"])
    assert "experiments/recall_grid.py" in edges["experiments/sweep.py"]


def test_no_script_but_train_and_its_wrappers_imports_train():
    """sample.py, evaluate.py and analyze.py take their command line from config.py; train.py
    is imported only by what drives or measures its loop (tests, experiments/paired.py,
    benchmarks/gpu_check.py)."""
    edges = names(import_graph(ROOT))
    users = {f for f, deps in edges.items() if "train.py" in deps}
    assert not users & {"config.py", "sample.py", "evaluate.py", "analyze.py", "data.py", "model.py",
                        "attention.py", "kernels.py", "flops.py"}, users
    assert {"sample.py", "evaluate.py", "analyze.py"} <= {f for f, deps in edges.items() if "config.py" in deps}


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    """The checker itself: a -> b at the top, b -> a inside a function, across the root and
    experiments/ (b reaches a through the root, as the scripts do)."""
    (tmp_path / "experiments").mkdir()
    (tmp_path / "a.py").write_text("import os\nfrom experiments_free import x\nimport b\n")
    (tmp_path / "experiments" / "b.py").write_text("def f():\n    from a import thing\n    return thing\n")
    (tmp_path / "c.py").write_text("import a\n")
    graph = import_graph(tmp_path)
    cycle = find_cycle(graph)
    assert [p.name for p in cycle] in (["a.py", "b.py", "a.py"], ["b.py", "a.py", "b.py"]), cycle
    (tmp_path / "experiments" / "b.py").write_text("def f():\n    import os\n")
    assert find_cycle(import_graph(tmp_path)) is None
