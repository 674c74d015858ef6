"""Every text format autoshard writes a decision in, one row each (:data:`FORMATS`): its render
function, the file a study writes it to, the stack that reads it and one phrase for help texts.
``autoshard export --format``, ``Recommendation.to_yaml``, the study's output files
(:data:`autoshard.ui.files.REPORT_FILES`) and the command line's help read the rows, so a new
format is its row here and its renderer.

>>> FORMATS[ExportFormat.ACCELERATE].file_name
'accelerate.yaml'
>>> [f.value for f, row in FORMATS.items() if row.file_name]
['lightning', 'accelerate', 'torchtitan']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from autoshard.emit.prose import Stack
from autoshard.emit.text import accelerate_yaml, hf_trainer_json, lightning_cli_yaml, to_json
from autoshard.emit.torchtitan import torchtitan_toml
from autoshard.errors import ConfigError
from autoshard.results import Decision


class ExportFormat(str, Enum):
    """What ``autoshard export --format`` and ``Recommendation.to_yaml`` write (a row of
    :data:`FORMATS` each)."""

    LIGHTNING = "lightning"
    ACCELERATE = "accelerate"
    HF_TRAINER = "hf-trainer"
    TORCHTITAN = "torchtitan"
    JSON = "json"


@dataclass(frozen=True)
class OutputFormat:
    """One text format: how a decision becomes it, and who reads it."""

    render: Callable[[Decision], str]  # raises ConfigError where it cannot express the decision
    stack: Stack | None  # the stack that reads it (None: autoshard itself)
    file_name: str | None  # what a study writes it to in its output folder (None: not written)
    help: str  # what it is, in a few words (the command line's help)


FORMATS: dict[ExportFormat, OutputFormat] = {
    ExportFormat.LIGHTNING: OutputFormat(
        lightning_cli_yaml, Stack.LIGHTNING, "lightning.yaml", "Lightning CLI YAML"
    ),
    ExportFormat.ACCELERATE: OutputFormat(
        accelerate_yaml, Stack.ACCELERATE, "accelerate.yaml", "accelerate config YAML"
    ),
    ExportFormat.HF_TRAINER: OutputFormat(
        hf_trainer_json, Stack.HF_TRAINER, None, "TrainingArguments keyword arguments, JSON"
    ),
    ExportFormat.TORCHTITAN: OutputFormat(
        torchtitan_toml, Stack.TORCHTITAN, "torchtitan.toml", "torchtitan job config TOML"
    ),
    ExportFormat.JSON: OutputFormat(
        to_json, None, None, "the decision, as autoshard.load reads it"
    ),
}


def format_help() -> str:
    """The formats with what each is, for ``--format``'s help."""
    return "; ".join(f"{f.value}: {row.help}" for f, row in FORMATS.items()) + "."


def export_format(fmt: ExportFormat | str) -> ExportFormat:
    """``fmt`` as a format, or one line naming the formats there are."""
    try:
        return ExportFormat(fmt)
    except ValueError:
        choices = ", ".join(f.value for f in ExportFormat)
        raise ConfigError(f"--format {fmt}: choose one of {choices}") from None


def render(rec: Decision, fmt: ExportFormat | str) -> str:
    """The recommendation in ``fmt`` (a row of :data:`FORMATS`)."""
    return FORMATS[export_format(fmt)].render(rec)


def report_files() -> tuple[str, ...]:
    """The files a study writes a decision to, one per format that has one."""
    return tuple(row.file_name for row in FORMATS.values() if row.file_name)
