"""What a training script uses: runtime objects (:mod:`autoshard.emit.runtime`) and text
(:mod:`autoshard.emit.text`) made from a :class:`~autoshard.results.Decision`."""

from autoshard.emit.runtime import (
    EveryKthPolicy,
    StateDictType,
    apply,
    apply_checkpointing,
    autocast,
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
    hf_trainer_config,
    hf_trainer_json,
    lightning_cli_config,
    lightning_cli_yaml,
    render,
    to_json,
    trainer_arguments,
)

__all__ = [
    "EveryKthPolicy",
    "ExportFormat",
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
    "render",
    "strategy",
    "strategy_kwargs",
    "to_json",
    "trainer_arguments",
    "trainer_kwargs",
]
