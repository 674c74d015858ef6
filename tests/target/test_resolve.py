"""Resolving model targets: every bad target is one line and exit 1, never a traceback."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from autoshard.errors import ModelError, TargetError
from autoshard.target.resolve import BuildFallbackWarning, TargetSpec, build_target, parse_kwargs

from ..conftest import EXAMPLES, TARGETS

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
    from autoshard.options import PlanOptions
    from autoshard.workload import resolve_workload

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


# --------------------------------------------------------------------------------------------
# A factory that cannot build on meta, in a memory-limited setting (issue 25, case 2)
# --------------------------------------------------------------------------------------------

UNSAFE = f"{TARGETS}/meta_unsafe.py:build"


@pytest.fixture
def meta_unsafe(monkeypatch):
    """The factory's module, its call records cleared; the free memory set to 64 MiB."""
    import importlib

    from autoshard.target.resolve import AVAILABLE_MEMORY_ENV, load_callable

    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "64MiB")
    module = importlib.import_module(load_callable(UNSAFE).__module__)
    module.CALLS.clear()
    return module


def test_a_cpu_build_that_would_not_fit_is_stopped_in_one_line(meta_unsafe) -> None:
    """30 x 4 MiB layers, a weight read after each: the meta attempt stops at the first; the CPU
    build is stopped once its parameters pass 80% of the 64 MiB free, not OOM-killed."""
    with pytest.raises(TargetError) as error:
        build_target(TargetSpec(spec=UNSAFE))
    text = str(error.value)
    assert text.startswith("building build on the CPU needs more than 5")  # 52 MiB
    assert "this machine has 64 MiB free: make the factory meta-safe" in text
    meta, cpu = meta_unsafe.CALLS
    assert (meta["device"], cpu["device"]) == ("meta", "cpu")
    assert cpu["layers"] == 12  # stopped in the 13th (52 MiB > 51.2): 18 layers never built


def test_a_model_the_meta_attempt_saw_too_large_is_never_built(meta_unsafe) -> None:
    """The weight is read after every layer is built: the meta attempt counts 120 MiB, more than
    the free memory, so nothing is built on the CPU."""
    with pytest.raises(TargetError, match=r"needs ~120 MiB of parameters; this machine has 64"):
        build_target(TargetSpec(spec=UNSAFE, kwargs={"read_at": "end"}))
    assert [c["device"] for c in meta_unsafe.CALLS] == ["meta"]


def test_a_cpu_fallback_warns_before_it_builds_and_builds_once(meta_unsafe) -> None:
    """A small model that fits: the warning comes before the CPU build, and the check of the
    target then its analysis (two builds asked for) build it once on the CPU."""
    from autoshard.analyze import analyze_target
    from autoshard.target.adapters import to_target

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        meta_unsafe.SEEN[:] = []
        meta_unsafe.SEEN = seen
        profile, _ = analyze_target(to_target(UNSAFE, kwargs={"layers": 2, "width": 64}))
    assert profile.built_on == "cpu" and profile.total_params == 2 * (64 * 64 + 64)
    assert [c["device"] for c in meta_unsafe.CALLS] == ["meta", "cpu"]
    fallback = [w for w in seen if issubclass(w.category, BuildFallbackWarning)]
    assert fallback and meta_unsafe.CALLS[1]["warnings"] >= 1  # said before the CPU build


def test_the_cli_refuses_a_cpu_build_that_does_not_fit(cli, monkeypatch) -> None:
    from autoshard.target.resolve import AVAILABLE_MEMORY_ENV

    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "64MiB")
    code, _, err = cli("analyze", UNSAFE)
    assert code == 1 and "Traceback" not in err
    assert err.startswith("warning: build could not be built on the meta device"), err
    said = err.split("error: ")
    assert len(said) == 2 and said[1].startswith("building build on the CPU needs more than")


def test_an_estimate_builds_its_model_once(meta_unsafe) -> None:
    """The check of the target (to_target) hands its meta build to the plan: one build per
    estimate, not two (0.4 s of a 70B model's 3 s); the next estimate builds anew."""
    import autoshard

    kwargs = {"layers": 2, "width": 64, "read_at": "never"}  # meta-safe
    autoshard.estimate(UNSAFE, kwargs=kwargs, gpus=2, gpu_memory="8GiB", seq_len=8)
    assert [c["device"] for c in meta_unsafe.CALLS] == ["meta"]
    autoshard.estimate(UNSAFE, kwargs={**kwargs, "layers": 3}, gpus=2, gpu_memory="8GiB", seq_len=8)
    assert [c["layers"] for c in meta_unsafe.CALLS] == [2, 3]


def test_a_kept_build_is_taken_once_and_only_by_its_target() -> None:
    from autoshard.target.resolve import keep_for_next_build

    tiny = TargetSpec(spec=f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny"})
    built = build_target(tiny)
    keep_for_next_build(tiny, built)
    other = TargetSpec(spec=f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny", "n_layer": 1})
    assert build_target(other).model is not built.model  # another target: its own build
    keep_for_next_build(tiny, built)
    assert build_target(tiny, device="cpu").model is not built.model  # a meta model is no CPU one
    keep_for_next_build(tiny, built)
    assert build_target(tiny).model is built.model
    assert build_target(tiny).model is not built.model  # taken: the next build is a new one


def test_a_meta_build_skips_the_initialisers_and_never_loads_dynamo() -> None:
    """On meta the initialisers write no values; running them cost a 70B build 0.8 s and the
    import of torch._dynamo (1.3 s) that the meta kernel of normal_ starts."""
    code = (
        "import sys, time; from autoshard.target.resolve import TargetSpec, build_target\n"
        f"t = time.process_time(); built = build_target(TargetSpec(spec='{EXAMPLES}/gpt.py:build',"
        " kwargs={'size': '70b'}))\n"
        "n = sum(p.numel() for p in built.model.parameters())\n"
        "print(n, 'torch._dynamo' in sys.modules, time.process_time() - t)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert int(out[0]) > 68e9 and out[1] == "False", out
