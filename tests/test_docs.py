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
