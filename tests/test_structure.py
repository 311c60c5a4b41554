"""The shape of the package, read from its source: no import cycle, no private name imported from
another module, and the three stages (profiler, planner, runtime) meeting only through regen.formats."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "regen"
STAGES = ("regen.profiler", "regen.planner", "regen.runtime")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _runtime_imports(tree: ast.Module):
    """The `from regen... import` statements of a module, those under `if TYPE_CHECKING:` left out."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    for node in ast.walk(tree):
        if id(node) not in skipped and isinstance(node, ast.ImportFrom) and (node.module or "").startswith("regen"):
            yield node


def _imports() -> tuple[nx.DiGraph, list[tuple[str, str, str]]]:
    """The import graph of regen's modules (an edge to the submodule a `from package import name` names,
    else to the module) and the private names imported across modules."""
    graph, private = nx.DiGraph(), []
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        graph.add_node(module)
        for node in _runtime_imports(ast.parse(path.read_text())):
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                graph.add_edge(module, target if _is_module(target) else node.module)
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    private.append((module, node.module, alias.name))
    return graph, private


def test_no_import_cycle():
    graph, _ = _imports()
    cycles = sorted(" -> ".join(c) for c in nx.simple_cycles(graph))
    assert cycles == []


def test_no_private_name_is_imported_from_another_module():
    _, private = _imports()
    assert private == []


def test_the_stages_meet_only_through_formats():
    graph, _ = _imports()
    crossings = []
    for a, b in graph.edges:
        stage_a = next((s for s in STAGES if a == s or a.startswith(s + ".")), None)
        stage_b = next((s for s in STAGES if b == s or b.startswith(s + ".")), None)
        if stage_a and stage_b and stage_a != stage_b:
            crossings.append((a, b))
    assert crossings == []


def test_no_file_name_repeats_across_packages_for_another_job():
    """A file's name says its job once in the package; `regen show`'s files are named for the format they
    show (show/plan.py shows a formats/plan.py file)."""
    shown = {"plan.py", "profile.py"}
    by_name: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    repeated = {name: sorted(paths) for name, paths in by_name.items() if len(paths) > 1 and name not in shown}
    assert repeated == {}


def test_solving_a_profile_imports_no_torch(tmp_path):
    """`regen solve` reads a profile and plans without torch (a second of start-up): the planner asks op
    names (regen.opnames), never torch's schemas (regen.opinfo)."""
    import subprocess
    import sys

    from regen.graphs.synthetic import transformer_profile
    from regen.formats import save_profile

    save_profile(transformer_profile(n_layers=2), tmp_path / "t.profile.yaml")
    script = ("import sys; from regen.cli import main; "
              f"code = main(['solve', {str(tmp_path / 't.profile.yaml')!r}, '--memory-cap', '80%', '-q', "
              f"'--strategy', 'recompute', '-o', {str(tmp_path / 't.plan.yaml')!r}]); "
              "assert code == 0, code; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"
