"""What a training script uses: runtime objects (:mod:`autoshard.emit.runtime`) and text
(:mod:`autoshard.emit.text`) made from a :class:`~autoshard.results.Recommendation`."""

from autoshard.emit.runtime import (
    EveryKthPolicy,
    StateDictType,
    apply_checkpointing,
    choose_state_dict_type,
    fsdp2_plan,
    fsdp_kwargs,
    strategy,
    strategy_kwargs,
    trainer_kwargs,
)
from autoshard.emit.text import (
    ExportFormat,
    accelerate_config,
    accelerate_yaml,
    describe_evidence,
    lightning_cli_config,
    lightning_cli_yaml,
    render,
    to_json,
)

__all__ = [
    "EveryKthPolicy",
    "ExportFormat",
    "StateDictType",
    "accelerate_config",
    "accelerate_yaml",
    "apply_checkpointing",
    "choose_state_dict_type",
    "describe_evidence",
    "fsdp2_plan",
    "fsdp_kwargs",
    "lightning_cli_config",
    "lightning_cli_yaml",
    "render",
    "strategy",
    "strategy_kwargs",
    "to_json",
    "trainer_kwargs",
]
