"""What a user says becomes options (autoshard.options): a mistake is one line naming the flag
(or keyword) and how to fix it, sizes, rates and lists are read as a user writes them, and a door's
options are split once between PlanOptions and TuneOptions. Quick: nothing is built."""

from __future__ import annotations

import pytest

from autoshard.config import Engine, Hardware, Optimizer, Precision
from autoshard.errors import ConfigError
from autoshard.options import PlanOptions, TuneOptions, options_from, split_options

GIB = 2**30


def _message(model: type, values: dict, *, cli: bool = True) -> str:
    with pytest.raises(ConfigError) as caught:
        options_from(model, values, cli=cli)
    return str(caught.value)


# --------------------------------------------------------------------------------------------
# A mistake is one line naming the flag (or keyword) and how to fix it
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "values", "cli", "line"),
    [
        (PlanOptions, {"gpuz": 2}, True,
         "unknown option gpuz=; see help(autoshard.PlanOptions) for the options"),
        (PlanOptions, {"gpus": 0}, True, "--gpus 0: give 1 or more"),
        (PlanOptions, {"gpus": 0}, False, "gpus= 0: give 1 or more"),
        (PlanOptions, {"gpu_memory": 0}, True, "--gpu-memory 0: give more than 0"),
        (TuneOptions, {"trial_timeout": 0}, False, "trial_timeout= 0: give more than 0.0"),
        (TuneOptions, {"warmup": -1}, True, "--warmup -1: give 0 or more"),
        (PlanOptions, {"intra_node_bandwidth": float("nan")}, False,
         "intra_node_bandwidth= nan: give a finite number (inf and nan are not a time or a size)"),
        (PlanOptions, {"engine": "fsdp3"}, True, "--engine fsdp3: choose one of fsdp1, fsdp2"),
        (PlanOptions, {"precision": "bf17"}, True,
         "--precision bf17: choose one of 32-true, bf16-mixed, 16-mixed, bf16-true"),
        (PlanOptions, {"batch_size": "0,1"}, True,
         "--batch-size 0,1: give positive integers, e.g. 1 or 1,2,4"),
        (PlanOptions, {"batch_size": ""}, True,
         "--batch-size : give positive integers, e.g. 1 or 1,2,4"),
        (TuneOptions, {"target_spread": 1}, True, "--target-spread 1: give less than 1.0"),
        (PlanOptions, {"gpu_memory": "12 potatoes"}, True,
         "--gpu-memory 12 potatoes: cannot read '12 potatoes' as a size; write it like 80GiB, "
         "40GB or 24000MiB"),
        (PlanOptions, {"host_memory": "0GiB"}, False,
         "host_memory= 0GiB: size must be positive, got '0GiB'"),
        (PlanOptions, {"optimizer": "lion"}, True,
         "--optimizer lion: choose one of " + ", ".join(o.value for o in Optimizer)),
        (PlanOptions, {"engine": "fsdp2", "optimizer": "adafactor"}, True,
         "--optimizer adafactor: adafactor steps the parameters of engine fsdp1 only: give "
         "--engine fsdp1 (engine= in code)"),
    ],
)  # fmt: skip
def test_a_bad_option_is_one_line_naming_the_flag_or_keyword(model, values, cli, line) -> None:
    assert _message(model, values, cli=cli) == line


def test_an_unknown_gpu_lists_the_catalogue() -> None:
    message = _message(PlanOptions, {"gpu": "h900"})
    assert message.startswith("unknown GPU 'h900': use one of ") and "h100-sxm" in message


def test_sizes_rates_and_lists_are_read_as_a_user_writes_them() -> None:
    options = PlanOptions(
        gpu_memory="40GB",
        host_memory="1TiB",
        intra_node_bandwidth="450GB/s",
        inter_node_bandwidth="400GBps",
        batch_size="1, 2,,4",
        precision="bf16-mixed,32-true",
    )
    assert options.gpu_memory == 40 * 10**9 and options.host_memory == 2**40
    assert options.intra_node_bandwidth == 450e9 and options.inter_node_bandwidth == 400e9
    assert PlanOptions(intra_node_bandwidth="1GiB").intra_node_bandwidth == float(GIB)
    assert options.batch_size == (1, 2, 4)
    assert options.precision == (Precision.BF16_MIXED, Precision.FP32)
    # one value is a list of one; numbers already numbers stay as they are
    assert PlanOptions(batch_size=4).batch_size == (4,)
    assert PlanOptions(precision=Precision.FP32).precision == (Precision.FP32,)
    assert PlanOptions(gpu_memory=GIB, intra_node_bandwidth=1e9).gpu_memory == GIB
    # the defaults a user gets by saying nothing
    default = PlanOptions()
    assert (default.nodes, default.accumulate, default.engine) == (1, 1, Engine.FSDP1)
    assert default.batch_size is None and default.precision is None and default.simulate == 0


def test_a_doors_options_are_split_once_between_plan_and_tune_options() -> None:
    values = {"gpus": 8, "trials": 3, "out_dir": "runs/x", "seq_len": 64, "storage": None}
    plan_values, tune_values = split_options(values)
    assert plan_values == {"gpus": 8, "seq_len": 64}
    assert tune_values == {"trials": 3, "out_dir": "runs/x", "storage": None}
    # every option lands in exactly one model, each of which takes it
    assert PlanOptions(**plan_values).gpus == 8 and TuneOptions(**tune_values).trials == 3
    assert not set(PlanOptions.model_fields) & set(TuneOptions.model_fields)


def test_the_bandwidths_are_declared_once_for_the_options_and_the_hardware() -> None:
    for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
        given, held = PlanOptions.model_fields[name], Hardware.model_fields[name]
        assert given.description == held.description and given.metadata == held.metadata
    # the hardware holds what the options read from a user's "450GB/s"
    rate = PlanOptions(intra_node_bandwidth="450GB/s").intra_node_bandwidth
    assert Hardware(gpu_memory=GIB, intra_node_bandwidth=rate).intra_node_bandwidth == 450e9
    with pytest.raises(ValueError, match="greater than 0"):
        Hardware(gpu_memory=GIB, inter_node_bandwidth=0)
