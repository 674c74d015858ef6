"""The package's imports run one way: no module imports, through any chain, one that imports it.

Every import statement counts, wherever it stands: at the top, inside a function (the lazy
imports that keep ``import autoshard`` light), under ``if TYPE_CHECKING:``. A lazy import is
still a dependency of the design, and a cycle through one is how ``results.Recommendation`` once
led to ``emit`` and ``ui``, which led back to it.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "autoshard"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, modules: set[str], is_package: bool = False) -> set[str]:
    """The ``modules`` that the import statements of ``source`` (the module ``module``) import:
    ``from X import Y`` imports the module ``X.Y`` when there is one, else ``X``; ``import X.Y``
    the longest of ``X.Y``, ``X`` that is a module. Relative imports are made absolute."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def longest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(m for a in node.names if (m := longest(a.name)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.update(m for m in [sub if sub in modules else longest(base)] if m)
    found.discard(module)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    return {
        name: imports_of(path.read_text(), name, set(files), path.name == "__init__.py")
        for name, path in files.items()
    }


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def reaches(graph: Mapping[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


# ---------------------------------------------------------------------------------------------


def test_the_collector_sees_lazy_type_checking_and_relative_imports() -> None:
    source = """
from typing import TYPE_CHECKING
import autoshard.units
if TYPE_CHECKING:
    from autoshard.results import Decision
def door():
    from . import emit
    from .ui.html import render_html
"""
    modules = {"autoshard", "autoshard.units", "autoshard.results", "autoshard.emit",
               "autoshard.ui", "autoshard.ui.html", "autoshard.recommendation"}  # fmt: skip
    assert imports_of(source, "autoshard.recommendation", modules) == {
        "autoshard.units",
        "autoshard.results",
        "autoshard.emit",
        "autoshard.ui.html",
    }  # not the faces autoshard and autoshard.ui that the names pass through
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({**graph, "c": set()}) is None


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "autoshard.recommendation" in graph["autoshard.decide"]  # the graph is read at all
    assert "autoshard.emit" in graph["autoshard.recommendation"]  # lazy imports count
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_results_emit_and_ui_never_reach_the_user_facing_recommendation() -> None:
    """``results.Decision`` is the data that emit/ and ui/ take; ``recommendation.Recommendation``
    adds the doors to them and so stands above them: nothing under it may lead back up."""
    graph = import_graph()
    below = [
        m
        for m in graph
        if m == "autoshard.results" or m.startswith(("autoshard.emit", "autoshard.ui"))
    ]
    assert len(below) > 5
    wrong = sorted(m for m in below if "autoshard.recommendation" in reaches(graph, m))
    assert not wrong, f"{wrong} import autoshard.recommendation; take results.Decision instead"
