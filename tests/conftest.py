from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

# pytest-xdist's workers are started with COLUMNS=80 and LINES=24 (execnet sets them), which the
# command line reads as the width of a pipe: a test would then see other wrapping than in a
# serial run. Gone before autoshard.cli makes its consoles, below.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)

import pytest
from typer.testing import CliRunner

from autoshard.cli import app

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TARGETS = Path(__file__).resolve().parent / "targets"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the slow (multi-process) tests first: the workers take tests in this
    order, and a 2-minute test begun last would leave the other worker idle at the end."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable


@pytest.fixture(scope="session", autouse=True)
def _ctrl_c_reaches_the_tests():
    # A shell without job control starts `cmd &` with SIGINT ignored, and an ignored signal is
    # inherited: the Ctrl-C tests (tests/test_faults.py, tests/test_group_logic.py) would then
    # wait for an interrupt that never comes. Python's own handler again, for this process and,
    # as SIG_DFL after exec, for the drivers it starts.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def cli():
    """Invoke the autoshard CLI in-process; returns (exit_code, stdout, stderr)."""
    runner = CliRunner()

    def invoke(*args: str):
        result = runner.invoke(app, [str(a) for a in args])
        err = result.stderr
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            # An exception the command did not turn into one line: show it in the assertion.
            err += f"\n[uncaught] {type(result.exception).__name__}: {result.exception}"
        return result.exit_code, result.stdout, err

    return invoke


@pytest.fixture(autouse=True)
def _forget_target_modules():
    """Target files are imported under their stem; forget them so tests do not leak modules."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None) or ""
        if path.startswith(str(TARGETS)) or path.startswith(str(EXAMPLES)):
            del sys.modules[name]


@pytest.fixture
def examples_gpt_tiny():
    from autoshard.target.resolve import TargetSpec

    return TargetSpec(spec=f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny"})
