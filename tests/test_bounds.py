"""Values that cannot work, refused at the door in one line each (issue 36): a timeout past
what the OS takes, an absurd accumulation, more simulations than candidates; results of another
schema; a storage URL whose driver is missing names the package to install."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from autoshard.errors import MissingDependencyError, ResultError
from autoshard.recommendation import load_result
from autoshard.study.database import check_storage

TINY = ["examples/gpt.py:build", "--arg", "size=tiny", "--gpu-memory", "1GiB", "--gpus", "2"]


def one_error_line(code: int, err: str) -> str:
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in err, err
    assert "[uncaught]" not in err, err
    return errors[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trial-timeout", "1e30"], "--trial-timeout 1e30: give 1000000 or less"),
        (["--accumulate", "99999999999"], "--accumulate 99999999999: give 4096 or less"),
        (["--accumulate", "1000000"], "--accumulate 1000000: give 4096 or less"),
    ],
)
def test_values_that_cannot_work_are_one_line_before_any_work(
    cli, tmp_path: Path, args: list[str], message: str
) -> None:
    started = time.monotonic()
    code, _, err = cli("tune", *TINY, *args, "--out", str(tmp_path / "out"))
    line = one_error_line(code, err)
    assert message in line, line
    assert time.monotonic() - started < 10  # refused before the model is analysed
    assert not (tmp_path / "out").exists()


def test_more_simulations_than_candidates_is_one_line(cli) -> None:
    """Every fitting candidate would be simulated, for seconds each: refused before the first
    simulation, naming how many there are."""
    started = time.monotonic()
    code, _, err = cli(
        "estimate", *TINY, "--gpu-memory", "8GiB", "--batch-size", "1", "--simulate", "99999"
    )
    line = one_error_line(code, err)
    assert "--simulate 99999: " in line and "fitting candidates" in line, line
    fitting = int(line.split("only ")[1].split()[0])
    assert 1 <= fitting < 99999
    assert time.monotonic() - started < 60  # the estimate's time, no simulation


@pytest.mark.parametrize("schema", [999, "autoshard.report/999", None, ["x"]])
def test_a_result_of_another_schema_is_one_line(tmp_path: Path, cli, schema) -> None:
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"schema": schema, "recommendation": {}, "trials": []}))
    with pytest.raises(ResultError, match="schema") as info:
        load_result(report)
    assert "\n" not in str(info.value)
    assert "autoshard.report/1" in str(info.value)  # what this autoshard reads
    code, _, err = cli("export", str(report))
    assert "schema" in one_error_line(code, err)


def test_mysql_without_a_driver_names_a_package_pip_has() -> None:
    """`pip install MySQLdb` finds nothing: the package is mysqlclient, or PyMySQL with its URL
    form (issue 36)."""
    with pytest.raises(MissingDependencyError) as info:
        check_storage("mysql://user:secret@127.0.0.1/study")
    text = str(info.value)
    assert "MySQLdb" not in text.split("run")[-1], text
    assert "pip install mysqlclient" in text and "mysql+pymysql://" in text, text
    assert "secret" not in text
