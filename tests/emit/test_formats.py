"""emit/formats: one row per output format feeds every door that lists or writes formats: the
export command (and its help), Recommendation.to_yaml and the files a study writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from autoshard import emit
from autoshard.config import Engine
from autoshard.emit.formats import FORMATS, ExportFormat, OutputFormat, render
from autoshard.errors import ConfigError
from autoshard.ui.files import REPORT_FILES, write_report
from tests.test_emit import candidate, make_rec


def test_every_format_has_its_row_and_every_door_reads_them(cli: Any) -> None:
    assert set(FORMATS) == set(ExportFormat)
    rec = make_rec(candidate(engine=Engine.FSDP2))
    for fmt, row in FORMATS.items():
        assert render(rec, fmt.value) == row.render(rec) == rec.to_yaml(fmt.value)
    code, out, _ = cli("export", "--help")
    assert code == 0
    help_text = " ".join(out.replace("│", " ").split())  # rich wraps the help in a box
    for fmt, row in FORMATS.items():
        assert f"{fmt.value}: {row.help}" in help_text
    named = [row.file_name for row in FORMATS.values() if row.file_name]
    assert ("report.json", "report.html", *named) == REPORT_FILES
    assert "torchtitan.toml" in named


def test_a_study_writes_each_format_that_can_express_its_decision(tmp_path: Path) -> None:
    fsdp2 = write_report(make_rec(candidate(engine=Engine.FSDP2)), tmp_path / "fsdp2")
    assert set(fsdp2) == set(REPORT_FILES)
    assert (tmp_path / "fsdp2" / "torchtitan.toml").read_text() == render(
        make_rec(candidate(engine=Engine.FSDP2)), "torchtitan"
    )
    # torchtitan has no FSDP1: its file is left out, the rest written
    fsdp1 = write_report(make_rec(candidate()), tmp_path / "fsdp1")
    assert set(fsdp1) == set(REPORT_FILES) - {"torchtitan.toml"}


def test_a_new_row_reaches_render_the_help_and_the_study_files(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # what "a new format touches its row and its renderer" means: nothing else lists formats
    import autoshard.emit.formats as formats

    row = OutputFormat(lambda rec: "made\n", None, "made.txt", "a made-up format")
    monkeypatch.setitem(formats.FORMATS, ExportFormat.JSON, row)
    assert emit.render(make_rec(), "json") == "made\n"
    assert "made.txt" in formats.report_files()
    assert "json: a made-up format" in formats.format_help()


def test_an_unknown_format_is_one_line_naming_them_all(cli: Any, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        render(make_rec(), "deepspeed")
    assert str(caught.value) == (
        "--format deepspeed: choose one of lightning, accelerate, hf-trainer, torchtitan, json"
    )
    (tmp_path / "recommendation.json").write_text(make_rec().to_yaml("json"))
    code, _, err = cli("export", tmp_path, "--format", "deepspeed")
    assert code == 1 and "choose one of lightning" in err and "Traceback" not in err


def test_export_writes_the_torchtitan_toml(cli: Any, tmp_path: Path) -> None:
    rec = make_rec(candidate(engine=Engine.FSDP2))
    (tmp_path / "recommendation.json").write_text(rec.to_yaml("json"))
    code, out, err = cli("export", tmp_path, "-f", "torchtitan")
    assert code == 0, err
    assert "[parallelism]\ndata_parallel_shard_degree = 2\n" in out
    # an FSDP1 decision: one line saying why, exit 1
    (tmp_path / "recommendation.json").write_text(make_rec().to_yaml("json"))
    code, _, err = cli("export", tmp_path, "-f", "torchtitan")
    assert code == 1 and "torchtitan runs FSDP2 (fully_shard) only" in err


def test_the_readme_names_every_format_and_every_file_a_study_writes() -> None:
    # the README is the one list the registry cannot write: a new row that it does not name fails
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    heading = "### `autoshard export RESULT --format "
    listed = readme.split(heading, 1)[1].split(" ", 1)[0].split("|")
    assert listed == [f.value for f in ExportFormat]
    for name in REPORT_FILES:
        assert f"| `{name}` |" in readme, f"README.md's table of output files lacks {name}"
