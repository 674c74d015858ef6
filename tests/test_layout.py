"""Modules and functions stay small enough to read (issue 23): no module in ``autoshard/predict/``
over 500 lines, and no function in the package (methods and nested functions too) over 80,
docstrings counted."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "autoshard"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
# "path relative to autoshard/ [: function]" -> why it cannot be split; empty: nothing is exempt.
EXEMPT: dict[str, str] = {}


def oversized(source: str, where: str, *, module_limit: bool = True) -> list[str]:
    """What in ``source`` (the file ``where``) is over the limits, one line each (the module's
    length only with ``module_limit``)."""
    found = []
    lines = len(source.splitlines())
    if module_limit and lines > MAX_MODULE_LINES and where not in EXEMPT:
        found.append(f"{where}: {lines} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            name = f"{where}:{node.name}"
            if length > MAX_FUNCTION_LINES and name not in EXEMPT:
                found.append(f"{name}: {length} lines (at most {MAX_FUNCTION_LINES})")
    return found


def test_the_size_check_finds_a_long_function_and_a_long_module() -> None:
    # The check below must be able to fail: one line over each limit is reported, none at it.
    def method(lines: int) -> str:  # a method of ``lines`` lines, def included
        return "class C:\n    def f(self):\n" + "        x = 1\n" * (lines - 1)

    assert oversized(method(MAX_FUNCTION_LINES), "m.py") == []
    assert oversized(method(MAX_FUNCTION_LINES + 1), "m.py") == ["m.py:f: 81 lines (at most 80)"]
    assert oversized("x = 1\n" * MAX_MODULE_LINES, "m.py") == []
    assert oversized("x = 1\n" * (MAX_MODULE_LINES + 1), "m.py") == [
        "m.py: 501 lines (at most 500)"
    ]


def _found(root: Path, *, module_limit: bool) -> list[str]:
    files = sorted(root.rglob("*.py"))
    assert len(files) > 20  # the directory is read at all
    return [
        line
        for path in files
        for line in oversized(
            path.read_text(), str(path.relative_to(PACKAGE)), module_limit=module_limit
        )
    ]


def test_no_module_in_predict_over_500_lines_and_no_function_over_80() -> None:
    found = _found(PACKAGE / "predict", module_limit=True)
    assert not found, "split along what the code does:\n" + "\n".join(found)


def test_no_function_in_the_package_over_80_lines() -> None:
    found = _found(PACKAGE, module_limit=False)
    assert not found, "split along what the code does:\n" + "\n".join(found)


def test_every_exemption_names_a_file_that_is_there() -> None:
    stale = [k for k in EXEMPT if not (PACKAGE / k.partition(":")[0]).exists()]
    assert not stale, f"exemptions of files that are gone: {stale}"
