"""Modules and functions stay small enough to read (issue 23): no module in ``autoshard/predict/``
over 500 lines, and no function in the package (methods and nested functions too) over 80,
docstrings counted. Issue 35: no module over 600 lines, no function over 7 parameters, and tests
that mirror the package (``autoshard/x/y.py`` -> ``tests/x/test_y.py``), so a module's own tests
are found by its name."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "autoshard"
TESTS = Path(__file__).resolve().parent
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


# --- issue 35: the package's limits -------------------------------------------------------------

MAX_PACKAGE_MODULE_LINES = 600
MAX_PARAMETERS = 7  # self/cls not counted; *args and **kwargs count


def too_many_parameters(source: str, where: str, models: set[str]) -> list[str]:
    """The functions of ``source`` (the file ``where``) with more than ``MAX_PARAMETERS``
    parameters, one line each, leaving out typer commands (a parameter is a command-line option)
    and the methods of pydantic models (classes named in ``models``: a field is a parameter)."""
    found: list[str] = []

    def visit(node: ast.AST, in_model: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, in_model or child.name in models)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                a = child.args
                named = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                count = len([n for n in named if n not in ("self", "cls")])
                count += (a.vararg is not None) + (a.kwarg is not None)
                command = any(
                    isinstance(d, ast.Call)
                    and isinstance(d.func, ast.Attribute)
                    and d.func.attr == "command"
                    for d in child.decorator_list
                )
                if count > MAX_PARAMETERS and not in_model and not command:
                    found.append(f"{where}:{child.lineno} {child.name}: {count} parameters")
                visit(child, in_model)
            else:
                visit(child, in_model)

    visit(ast.parse(source), False)
    return found


def pydantic_models(sources: list[str]) -> set[str]:
    """The names of the classes in ``sources`` that derive from ``BaseModel``, through any chain
    of the package's own classes."""
    bases: dict[str, set[str]] = {}
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
    models = {"BaseModel"}
    while grown := {n for n, b in bases.items() if b & models} - models:
        models |= grown
    return models


def test_the_parameter_check_counts_what_a_caller_passes() -> None:
    # It must be able to fail: 8 parameters (a *rest and a **more among them) is one too many,
    # self does not count, and a typer command or a pydantic model's method is left out.
    eight = "def f(self, a, b, c, d, e, /, *rest, g, **more): ..."
    assert too_many_parameters(eight, "m.py", set()) == ["m.py:1 f: 8 parameters"]
    assert too_many_parameters("def f(self, a, b, c, d, e, f, g): ...", "m.py", set()) == []
    command = "@app.command()\ndef run(a, b, c, d, e, f, g, h): ..."
    assert too_many_parameters(command, "m.py", set()) == []
    model = "class Options(Plan):\n    def check(cls, a, b, c, d, e, f, g, h): ..."
    assert pydantic_models(["class Plan(pydantic.BaseModel): ...", model]) >= {"Options"}
    assert too_many_parameters(model, "m.py", pydantic_models([model])) != []
    assert too_many_parameters(model, "m.py", {"Options"}) == []


def test_no_module_in_the_package_over_600_lines() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    long = [
        f"{path.relative_to(PACKAGE)}: {lines} lines (at most {MAX_PACKAGE_MODULE_LINES})"
        for path in files
        if (lines := len(path.read_text().splitlines())) > MAX_PACKAGE_MODULE_LINES
    ]
    assert not long, "split along what the code does:\n" + "\n".join(long)


def test_no_function_over_7_parameters_outside_pydantic_models_and_typer_commands() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    sources = [path.read_text() for path in files]
    models = pydantic_models(sources)
    found = [
        line
        for path, source in zip(files, sources, strict=True)
        for line in too_many_parameters(source, str(path.relative_to(PACKAGE)), models)
    ]
    assert not found, "group what travels together (an options object):\n" + "\n".join(found)


# --- issue 35: tests mirror the package ---------------------------------------------------------

MIRROR_SHARE = 0.9
# "path relative to autoshard/" -> why it has no tests/<mirrored path> (where its tests are).
# A package's __init__.py is not a module of its own here: it re-exports (tests/test_imports.py
# and tests/test_docs.py import its names).
# Where the reason is "wave 2": the module's tests are in a theme file another restructure edits
# at the same time; they move to the mirrored path after the merge, and the entry goes.
_WAVE2 = "split out after the wave 2 merge"
MIRROR_EXCEPTIONS: dict[str, str] = {
    "__main__.py": "two lines that call cli.main: tests/test_imports.py runs `python -m autoshard`",
    "cli.py": "the command line is tested end to end, per command and behaviour: test_plan.py, "
    "test_estimate.py, test_bounds.py, test_terminal.py, test_handover.py, test_faults.py",
    "predict/depth.py": "tests in predict/test_simulate.py (block_lists, truncate_blocks, the "
    "extrapolated depth against a full simulation)",
    "predict/fake_world.py": "the simulation's fake process group: predict/test_simulate.py",
    "study/claims.py": f"tests in test_study_slow.py ({_WAVE2})",
}


def mirrored(module: str) -> str:
    """The test file of ``module`` (relative to autoshard/), relative to tests/."""
    folder, _, name = module.rpartition("/")
    return f"{folder}/test_{name}" if folder else f"test_{name}"


def package_modules() -> list[str]:
    return sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py"
    )


def test_the_mirrored_path_keeps_the_folder() -> None:
    assert mirrored("plan.py") == "test_plan.py"
    assert mirrored("predict/speed.py") == "predict/test_speed.py"
    assert mirrored("study/order.py") == "study/test_order.py"


def test_every_module_has_a_mirrored_test_file_or_says_why_not() -> None:
    modules = package_modules()
    assert len(modules) > 50  # the package is read at all
    missing = [
        f"{m}: no tests/{mirrored(m)}"
        for m in modules
        if not (TESTS / mirrored(m)).is_file() and m not in MIRROR_EXCEPTIONS
    ]
    assert not missing, (
        "write the module's tests at the mirrored path, or say in MIRROR_EXCEPTIONS why not:\n"
        + "\n".join(missing)
    )


def test_every_mirror_exception_names_a_module_without_its_own_file() -> None:
    modules = set(package_modules())
    stale = [m for m in MIRROR_EXCEPTIONS if m not in modules]
    assert not stale, f"exceptions of modules that are gone: {stale}"
    needless = [m for m in MIRROR_EXCEPTIONS if (TESTS / mirrored(m)).is_file()]
    assert not needless, f"exceptions of modules that have their test file now: {needless}"


def test_most_modules_have_a_test_file_of_their_own() -> None:
    modules = package_modules()
    have = [m for m in modules if (TESTS / mirrored(m)).is_file()]
    share = len(have) / len(modules)
    assert share >= MIRROR_SHARE, (
        f"{len(have)} of {len(modules)} modules ({share:.0%}) have a mirrored test file "
        f"(at least {MIRROR_SHARE:.0%}): {sorted(MIRROR_EXCEPTIONS)}"
    )
