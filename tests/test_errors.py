"""The user-facing errors (autoshard/errors.py): one family the command line turns into one line,
and the install line a missing dependency names."""

from __future__ import annotations

import inspect

import pytest

from autoshard import errors
from autoshard.errors import AutoshardError, MissingDependencyError, StorageError, StudyLockedError


def test_every_error_of_the_module_is_an_autoshard_error() -> None:
    classes = [
        c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__
    ]
    raised = [c for c in classes if not issubclass(c, Warning)]
    assert len(raised) >= 8
    assert all(issubclass(c, AutoshardError) for c in raised), raised
    notices = [c for c in classes if issubclass(c, Warning)]
    assert notices and not any(issubclass(c, AutoshardError) for c in notices)


@pytest.mark.parametrize(
    ("kwargs", "line"),
    [
        ({}, "the report needs plotly, which is not installed: run `pip install plotly`"),
        ({"extra": "ui"}, "the report needs plotly, which is not installed: run "
                          "`pip install 'autoshard[ui]'`"),
        ({"install": "conda install plotly"}, "the report needs plotly, which is not installed: "
                                              "run conda install plotly"),
    ],
)  # fmt: skip
def test_a_missing_dependency_names_what_to_install(kwargs: dict[str, str], line: str) -> None:
    error = MissingDependencyError("plotly", "the report", **kwargs)
    assert str(error) == line and error.package == "plotly"


def test_a_locked_study_is_a_storage_error_that_keeps_the_holders_pid() -> None:
    error = StudyLockedError("another tune runs in out/", pid=4242)
    assert isinstance(error, StorageError) and error.pid == 4242
    assert str(error) == "another tune runs in out/"
    assert StudyLockedError("x").pid is None
