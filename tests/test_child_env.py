"""Every child process keeps the parent's PYTHONPATH (autoshard.child_env).

On the lent GPU machine the project's dependencies come from ``pip install --target`` and
PYTHONPATH alone (benchmarks/gpu.sh); ``estimate_accuracy.py`` and ``tests/test_handover.py``
started their children with a PYTHONPATH of their own, and both failed at ``import pydantic``
(../shared/gpu-runs/2026-11-28-h200/gpu_tests_first_try.log). Here: the helper, each launcher
seen giving its child a folder only the parent's PYTHONPATH had, and a check that no other code
sets PYTHONPATH (or hands a child an environment built from nothing)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from autoshard.child_env import child_env, extended_pythonpath

ROOT = Path(__file__).resolve().parents[1]
HELPER = ROOT / "autoshard" / "child_env.py"
# Python files that may name PYTHONPATH as a value: the helper, and this test (which builds
# the old, replacing environment on purpose, to see the child fail with it).
MAY_NAME_IT = {HELPER, Path(__file__).resolve()}
LAUNCH_CALLS = {"run", "Popen", "call", "check_call", "check_output"}


def _python_files() -> list[Path]:
    files = []
    for folder in ("autoshard", "benchmarks", "tests", "scripts", "examples"):
        files += (ROOT / folder).rglob("*.py")
    return sorted(p for p in files if p.name != "syntax_error.py")


def pythonpath_setters(source: str) -> list[int]:
    """Lines of ``source`` that name PYTHONPATH as a value (a dict key, ``environ[...]``, a
    ``PYTHONPATH=`` keyword) or hand a launched process an ``env`` dict built from nothing."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and node.value == "PYTHONPATH":
            lines.append(node.lineno)
        elif isinstance(node, ast.keyword) and node.arg == "PYTHONPATH":
            lines.append(node.value.lineno)
        elif isinstance(node, ast.Call) and _called(node) in LAUNCH_CALLS:
            for kw in node.keywords:
                if kw.arg == "env" and isinstance(kw.value, ast.Dict):
                    lines.append(kw.value.lineno)
    return sorted(lines)


def _called(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def test_the_setter_check_finds_each_way_of_replacing_the_path() -> None:
    assert pythonpath_setters('env = {**os.environ, "PYTHONPATH": "x"}') == [1]
    assert pythonpath_setters('env = dict(os.environ, PYTHONPATH="x")') == [1]
    assert pythonpath_setters('os.environ["PYTHONPATH"] = "x"') == [1]
    assert pythonpath_setters('subprocess.run(cmd, env={"A": "1"})') == [1]
    assert pythonpath_setters("subprocess.run(cmd, env=child_env(ROOT, A='1'))") == []
    assert pythonpath_setters('"""the PYTHONPATH of the parent"""') == []


def test_no_code_sets_pythonpath_but_the_helper() -> None:
    files = _python_files()
    assert len(files) > 100 and HELPER in files
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in files
        if path not in MAY_NAME_IT
        for line in pythonpath_setters(path.read_text())
    ]
    assert not found, "build a child's environment with autoshard.child_env.child_env:\n" + (
        "\n".join(found)
    )


def test_shell_scripts_extend_pythonpath() -> None:
    scripts = [*ROOT.glob("benchmarks/*.sh"), *ROOT.glob("scripts/*.sh"), ROOT / ".ci" / "run"]
    setters = [
        (path, line)
        for path in scripts
        if path.exists()
        for line in path.read_text().splitlines()
        if re.search(r"\bPYTHONPATH=", line) and not line.lstrip().startswith("#")
    ]
    assert setters, "gpu.sh sets PYTHONPATH: the check reads the scripts"
    for path, line in setters:
        assert "$PYTHONPATH" in line or "${PYTHONPATH" in line, f"{path.name}: {line.strip()}"


def test_front_folders_come_first_and_the_inherited_ones_stay() -> None:
    got = extended_pythonpath(("/a", Path("/b")), os.pathsep.join(["/site", "", "/a"]))
    assert got.split(os.pathsep) == ["/a", "/b", "/site"]
    env = child_env("/a", base={"PYTHONPATH": "/site", "X": "0"}, X="1", Y="2")
    assert env == {"PYTHONPATH": f"/a{os.pathsep}/site", "X": "1", "Y": "2"}
    assert child_env(base={})["PYTHONPATH"] == ""
    with pytest.raises(TypeError, match=r"^child_env: pass folders .* not PYTHONPATH=$"):
        child_env(PYTHONPATH="/x")


@pytest.fixture
def parents_only_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module in a folder that only this process's PYTHONPATH names (as the wheels' folder
    on the GPU machine); its name."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "only_the_parent_path_has_me.py").write_text("WHERE = 'site'\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    return "only_the_parent_path_has_me"


def _imports(module: str, env: dict[str, str]) -> bool:
    code = f"import {module}"
    return subprocess.run([sys.executable, "-c", code], env=env, cwd="/").returncode == 0


def test_a_child_sees_a_folder_only_the_parents_pythonpath_had(parents_only_module: str) -> None:
    assert _imports(parents_only_module, child_env(ROOT))
    # what the launchers did before: the same child fails
    replaced = {**os.environ, "PYTHONPATH": str(ROOT)}
    assert not _imports(parents_only_module, replaced)


def _site(env: dict[str, str]) -> bool:
    return any(p.endswith(f"{os.sep}site") for p in env["PYTHONPATH"].split(os.pathsep))


def test_the_worker_group_keeps_the_parents_pythonpath(
    parents_only_module: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from autoshard.target.resolve import TargetSpec
    from autoshard.trials import group as group_module

    seen: list[dict[str, str]] = []

    def popen(*args: Any, env: dict[str, str], **kwargs: Any) -> Any:
        seen.append(env)
        raise OSError("not started: the test reads the environment only")

    group = group_module.WorkerGroup(
        TargetSpec(spec="examples/gpt.py:build"), log_dir=tmp_path / "logs", env={"A": "1"}
    )
    with monkeypatch.context() as patched, pytest.raises(OSError, match="not started"):
        patched.setattr(group_module.subprocess, "Popen", popen)
        group.start()
    (env,) = seen
    assert env["PYTHONPATH"].split(os.pathsep)[0] == os.getcwd()  # the target's folder
    assert _site(env) and env["A"] == "1"
    assert _imports(parents_only_module, env)


def test_the_benchmarks_and_tests_launchers_keep_the_parents_pythonpath(
    parents_only_module: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """estimate_accuracy.py's measuring group and test_handover's ranks: the environment each
    hands torch.distributed.run (the run itself replaced, its result file written)."""
    seen: list[dict[str, str]] = []

    def run(command: list[str], env: dict[str, str], **kwargs: Any) -> Any:
        seen.append(env)
        out = Path(command[command.index("--worker") + 2]) if "--worker" in command else None
        (out or Path(command[-2])).write_text("[]" if out else "{}")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("acc", ROOT / "benchmarks/estimate_accuracy.py")
    assert spec and spec.loader
    accuracy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(accuracy)
    from tests import test_handover

    with monkeypatch.context() as patched:
        patched.setattr(subprocess, "run", run)  # the module both launchers call it from
        assert accuracy.measure([], "cpu", 2, tmp_path / "measured.json") == []
        assert test_handover.run_two_ranks(tmp_path, {}) == {}
    assert len(seen) == 2
    for env in seen:
        assert _site(env) and _imports(parents_only_module, env)
