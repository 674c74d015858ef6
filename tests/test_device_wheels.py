"""The wheels a GPU machine without network needs (scripts/device_wheels.py): derived from the
installed metadata, every need of benchmarks/gpu.sh's parts imports with them and the machine's
own packages, and one left out is caught (the list by hand left out typeshed_client: LightningCLI
failed on the first GPU run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import device_wheels  # noqa: E402

LIGHTNING_CLI = "LightningCLI (jsonargparse[signatures])"


def test_the_pins_are_what_the_gpu_parts_need_and_the_machine_lacks() -> None:
    pins = {line.split("==")[0].lower().replace("_", "-") for line in device_wheels.pins()}
    # LightningCLI's signatures extra, the handover's accelerate and HF Trainer, float8, LoRA
    assert {"typeshed-client", "docstring-parser", "jsonargparse", "accelerate",
            "transformers", "torchao", "peft", "pydantic", "optuna", "sqlalchemy"} <= pins  # fmt: skip
    assert not pins & {"torch", "lightning", "rich", "typer", "pyyaml", "autoshard"}
    assert all("==" in line for line in device_wheels.pins())
    assert "device_wheels.py --pins" in (ROOT / "scripts" / "device_wheels.sh").read_text()


def test_an_extras_requirements_are_followed_only_for_that_extra() -> None:
    found = device_wheels.closure(["jsonargparse"], "3.12")
    assert "typeshed-client" not in found
    found = device_wheels.closure(["jsonargparse[signatures]"], "3.12")
    assert {"typeshed-client", "docstring-parser"} <= set(found)


@pytest.mark.slow
def test_a_wheel_left_out_fails_the_check_as_on_the_machine() -> None:
    done = device_wheels.as_device(only=[LIGHTNING_CLI])
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    done = device_wheels.as_device(leave_out=["typeshed_client"], only=[LIGHTNING_CLI])
    assert done.returncode == 1
    assert "jsonargparse[signatures]" in done.stdout, done.stdout
