"""What a study writes when it ends (autoshard.study.outputs): a folder that cannot take the
recommendation is one line saying the trials are recorded."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from autoshard.errors import StorageError
from autoshard.study.outputs import write_outputs


def test_an_unwritable_folder_is_one_line_that_keeps_the_trials(tmp_path: Path) -> None:
    in_the_way = tmp_path / "out"
    in_the_way.write_text("a file where the output folder should be")
    rec: Any = SimpleNamespace(model_dump_json=lambda indent: "{}")
    with pytest.raises(StorageError) as raised:
        write_outputs(rec, in_the_way, [])
    line = str(raised.value)
    assert "\n" not in line and line.startswith(f"{in_the_way}: cannot write")
    assert "the trials are recorded" in line
