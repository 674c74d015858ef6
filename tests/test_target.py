"""Resolving model targets: every bad target is one line and exit 1, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from autoshard.errors import ModelError, TargetError
from autoshard.target.resolve import BuildFallbackWarning, TargetSpec, build_target, parse_kwargs

from .conftest import EXAMPLES, TARGETS

BAD = TARGETS / "bad_targets.py"


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (f"{TARGETS}/does_not_exist.py:build", "model file not found"),
        (f"{TARGETS}/syntax_error.py:build", "syntax error in"),
        (f"{BAD}:missing", "has no callable named 'missing'"),
        (f"{BAD}:NOT_CALLABLE", "is a int, not a callable"),
        (f"{BAD}:raises", "raises raised ValueError: boom: n_layer must be positive"),
        (f"{BAD}:returns_int", "returned int; it must return a torch.nn.Module"),
        (f"{BAD}:no_params", "no parameters"),
        (f"{BAD}", "must be path/to/file.py:callable"),
        ("no_such_package.models:build", "module 'no_such_package.models' not found"),
    ],
)
def test_bad_target_is_one_line_and_exit_1(cli, target: str, message: str) -> None:
    code, out, err = cli("analyze", target)
    assert code == 1
    assert message in err
    assert "Traceback" not in err + out
    # one line (rich may soft-wrap long lines; the message itself has no newline)
    assert err.strip().startswith("error:")
    assert err.strip().count("error:") == 1


def test_syntax_error_names_the_line(cli) -> None:
    code, _, err = cli("analyze", f"{TARGETS}/syntax_error.py:build")
    assert code == 1 and "line 3" in err


def test_missing_callable_lists_the_ones_there(cli) -> None:
    _, _, err = cli("analyze", f"{BAD}:missing")
    assert "raises" in err and "returns_int" in err


def test_unknown_keyword_is_reported_not_retried_on_cpu(cli) -> None:
    code, _, err = cli("analyze", f"{EXAMPLES}/gpt.py:build", "--arg", "n_layers=2")
    assert code == 1
    assert "n_layers" in err


def test_a_required_argument_names_the_flag_that_gives_it(cli) -> None:
    code, _, err = cli("analyze", f"{TARGETS}/bad_targets.py:needs_width")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "missing 1 required positional argument: 'width'" in err and "--arg width=" in err


def test_a_seq_len_that_contradicts_the_targets_batch_is_one_line(cli) -> None:
    """The target's batch is what is measured: counted at its length and reported at another,
    tokens/s and memory would describe different steps (the README's Llama command once
    reported 68,000 tokens/s per GPU at 2% MFU for Llama-8B this way)."""
    from autoshard.plan import PlanOptions, resolve_workload

    target = f"{EXAMPLES}/lightning_transformer.py:build"  # its batch: 32 tokens per sample
    code, out, err = cli("estimate", target, "--gpus", "2", "--gpu-memory", "8GiB",
                         "--seq-len", "64")  # fmt: skip
    assert code == 1 and "Traceback" not in err + out, err
    assert err.strip().count("error:") == 1
    assert "seq_len 64 but the batch" in err and "has 32 tokens" in err
    assert "--arg seq_len=64" in err
    # the batch's own length, or none given: it plans at that length
    built = build_target(TargetSpec(spec=target))
    assert resolve_workload(built, PlanOptions(seq_len=32))[0].seq_len == 32
    assert resolve_workload(built, PlanOptions())[0].seq_len == 32
    built = build_target(TargetSpec(spec=target, kwargs={"seq_len": 64}))
    assert resolve_workload(built, PlanOptions(seq_len=64))[0].seq_len == 64


def test_bad_arg_syntax(cli) -> None:
    code, _, err = cli("analyze", f"{EXAMPLES}/gpt.py:build", "--arg", "size")
    assert code == 1 and "key=value" in err


def test_debug_shows_the_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "autoshard", "analyze", f"{BAD}:raises", "--debug"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "boom" in proc.stderr


def test_real_process_prints_one_line_without_debug() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "autoshard", "analyze", f"{BAD}:raises"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error:")


def test_parse_kwargs_reads_literals_and_strings() -> None:
    assert parse_kwargs(["n_layer=48", "size=70b", "tie=True", "shape=(3, 4)", "x=None"]) == {
        "n_layer": 48,
        "size": "70b",
        "tie": True,
        "shape": (3, 4),
        "x": None,
    }


def test_build_on_meta_uses_no_memory() -> None:
    built = build_target(TargetSpec(spec=f"{EXAMPLES}/gpt.py:build", kwargs={"size": "7b"}))
    assert built.built_on == "meta"
    assert all(p.is_meta for p in built.model.parameters())


def test_factory_that_reads_values_falls_back_to_cpu_with_a_warning() -> None:
    with pytest.warns(BuildFallbackWarning, match="could not be built on the meta device"):
        built = build_target(TargetSpec(spec=f"{BAD}:needs_values"))
    assert built.built_on == "cpu"
    assert not any(p.is_meta for p in built.model.parameters())


def test_factory_may_return_model_and_batch() -> None:
    built = build_target(TargetSpec(spec=f"{BAD}:with_batch", kwargs={"n": 3}))
    assert isinstance(built.model, nn.Linear)
    assert isinstance(built.batch, torch.Tensor) and built.batch.shape == (2, 3)


def test_a_targets_batch_is_cut_or_repeated_to_the_micro_batch() -> None:
    """Trials and the simulation run the candidate's micro-batch, not the target's own batch
    size (the estimators count per sample): every tensor led by the samples is resized, the
    rest kept."""
    from autoshard.target.step import batch_samples, make_batch

    ids = torch.arange(8).reshape(2, 4)
    pair = (ids, ids + 100)
    mask = torch.ones(3, 3)  # not led by the 2 samples: kept
    for mbs in (1, 2, 3, 5):
        inputs, targets = make_batch(nn.Linear(1, 1), pair, micro_batch_size=mbs, seq_len=None,
                                     device=torch.device("cpu"))  # fmt: skip
        assert inputs.shape == targets.shape == (mbs, 4)
        assert torch.equal(targets - inputs, torch.full((mbs, 4), 100))  # rows stay paired
        assert inputs[:, 0].tolist() == [0, 4, 0, 4, 0][:mbs]
        batch = make_batch(nn.Linear(1, 1), {"x": ids, "mask": mask}, micro_batch_size=mbs,
                           seq_len=None, device=torch.device("cpu"))  # fmt: skip
        assert batch_samples(batch) == mbs and batch["mask"] is mask


def test_package_module_target() -> None:
    # "package.module:callable" form, on a module of torch itself that builds a module.
    built = build_target(
        TargetSpec(spec="torch.nn:Linear", kwargs={"in_features": 4, "out_features": 2})
    )
    assert isinstance(built.model, nn.Linear)


def test_errors_are_autoshard_errors() -> None:
    with pytest.raises(TargetError):
        build_target(TargetSpec(spec=f"{BAD}:raises"))
    with pytest.raises(ModelError):
        build_target(TargetSpec(spec=f"{BAD}:no_params"))


def test_a_batchs_tokens_are_every_samples_tokens() -> None:
    # tokens per batch, not per sample: per sample, a trial's tokens/s falls as its
    # micro-batch grows
    import torch

    from autoshard.target.step import batch_samples, batch_tokens

    ids = torch.ones(4, 128, dtype=torch.long)
    assert batch_tokens(ids) == 512 and batch_samples(ids) == 4
    assert batch_tokens({"input_ids": ids, "attention_mask": ids}) == 512
    assert batch_tokens((ids, ids)) == 512 and batch_samples((ids, ids)) == 4
    assert batch_samples({"pixel_values": torch.randn(3, 3, 8, 8)}) == 3
    # not token ids: no tokens
    assert batch_tokens(torch.randn(4, 128)) is None
    assert batch_tokens(torch.ones(4, dtype=torch.long)) is None
    assert batch_tokens({"pixel_values": torch.randn(3, 3, 8, 8)}) is None
