"""Every public name has an example in its docstring, and every example runs as written."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

import autoshard

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = sorted(name for name in autoshard.__all__ if name != "__version__")
SLOW = {"tune"}  # runs real trials in a worker group


def _examples(name: str) -> list[doctest.DocTest]:
    obj = getattr(autoshard, name)
    return [t for t in doctest.DocTestFinder().find(obj, name, globs={}) if t.examples]


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in PUBLIC]
)
def test_public_name_has_a_runnable_example(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(ROOT)  # the examples name examples/gpt.py as a user in the repo would
    tests = _examples(name)
    assert any(t.name == name for t in tests), f"{name}'s own docstring has no example"
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)


def test_the_doc_test_finds_a_broken_example() -> None:
    # The check above must be able to fail: a wrong expected output is reported.
    def broken() -> None:
        """>>> 1 + 1
        3
        """

    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(broken, "broken", globs={}):
        runner.run(test, out=lambda _: None)
    assert runner.failures == 1


# ---------------------------------------------------------------------------------------------
# The README's Python snippets, run as written
# ---------------------------------------------------------------------------------------------

# Snippets run elsewhere, by the first line that names them, with where and why.
README_ELSEWHERE = {
    # a fragment of one line per stack (model, batch, lightning, transformers are the user's):
    # each line's output is checked against its real consumer in tests/test_handover.py
    "rec = autoshard.recommend(model, batch=batch,": "tests/test_handover.py",
    # needs torchrun's two processes: test_handover runs it so, as the README says
    "# train.py, next to autoshard-out/": "tests/test_handover.py",
}


def readme_snippets() -> list[str]:
    import re

    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_every_readme_snippet_is_run_here_or_named_where() -> None:
    run_here = [s for s in readme_snippets() if not _elsewhere(s)]
    assert len(run_here) >= 3  # estimate, a DataLoader target, tune
    named = [s for s in readme_snippets() if _elsewhere(s)]
    assert len(named) == len(README_ELSEWHERE)  # every exception still names a snippet


def _elsewhere(snippet: str) -> bool:
    return any(snippet.startswith(first) for first in README_ELSEWHERE)


@pytest.mark.slow
def test_the_readme_snippets_run_as_written(tmp_path: Path) -> None:
    """Every snippet not run elsewhere, in one fresh Python process, from a folder that has the
    README's examples/ (the snippets name examples/gpt.py as a user in the repository would)."""
    import subprocess
    import sys

    (tmp_path / "examples").symlink_to(ROOT / "examples")
    scripts = [s for s in readme_snippets() if not _elsewhere(s)]
    for number, snippet in enumerate(scripts):
        (tmp_path / f"snippet_{number}.py").write_text(snippet)
        done = subprocess.run(
            [sys.executable, f"snippet_{number}.py"], cwd=tmp_path, capture_output=True,
            text=True, timeout=400,
        )  # fmt: skip
        assert done.returncode == 0, f"README snippet {number}:\n{snippet}\n{done.stderr[-3000:]}"
