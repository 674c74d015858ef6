"""What a training script uses: runtime objects (:mod:`autoshard.emit.runtime`) and text
(:mod:`autoshard.emit.formats`, one row per format) made from a
:class:`~autoshard.results.Decision`.

The runtime objects are loaded when first asked for: they import torch.distributed (1.5 s of
CPU), which the command line, reading the formats for its help, need not pay for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autoshard.emit.formats import FORMATS, ExportFormat, OutputFormat, render
from autoshard.emit.prose import Stack, StateDictType, choose_state_dict_type, describe_evidence
from autoshard.emit.text import (
    accelerate_config,
    accelerate_yaml,
    hf_trainer_config,
    hf_trainer_json,
    lightning_cli_config,
    lightning_cli_yaml,
    to_json,
    trainer_arguments,
)

if TYPE_CHECKING:
    from autoshard.emit.runtime import (
        EveryKthPolicy,
        apply,
        apply_checkpointing,
        autocast,
        fsdp2_plan,
        fsdp_kwargs,
        optimizer,
        strategy,
        strategy_kwargs,
        trainer_kwargs,
    )

_RUNTIME = frozenset(
    {
        "EveryKthPolicy",
        "apply",
        "apply_checkpointing",
        "autocast",
        "fsdp2_plan",
        "fsdp_kwargs",
        "optimizer",
        "strategy",
        "strategy_kwargs",
        "trainer_kwargs",
    }
)


def __getattr__(name: str) -> Any:
    if name in _RUNTIME:
        from autoshard.emit import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'autoshard.emit' has no attribute {name!r}")


__all__ = [
    "FORMATS",
    "EveryKthPolicy",
    "ExportFormat",
    "OutputFormat",
    "Stack",
    "StateDictType",
    "accelerate_config",
    "accelerate_yaml",
    "apply",
    "apply_checkpointing",
    "autocast",
    "choose_state_dict_type",
    "describe_evidence",
    "fsdp2_plan",
    "fsdp_kwargs",
    "hf_trainer_config",
    "hf_trainer_json",
    "lightning_cli_config",
    "lightning_cli_yaml",
    "optimizer",
    "render",
    "strategy",
    "strategy_kwargs",
    "to_json",
    "trainer_arguments",
    "trainer_kwargs",
]
