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


# ---------------------------------------------------------------------------------------------
# One training step's batch and loss (autoshard.target.step), piece by piece
# ---------------------------------------------------------------------------------------------


def test_the_vocabulary_is_an_attribute_or_the_largest_embeddings_rows() -> None:
    import torch
    from torch import nn

    from autoshard.target.step import find_vocab_size

    class Holder(nn.Module):
        def __init__(self, **attrs: object) -> None:
            super().__init__()
            self.small = nn.Embedding(50, 4)  # 200 weights
            self.big = nn.Embedding(30, 100)  # 3,000 weights: the token embedding
            for key, value in attrs.items():
                setattr(self, key, value)

    assert find_vocab_size(Holder()) == 30
    assert find_vocab_size(Holder(vocab_size=1000)) == 1000
    assert find_vocab_size(Holder(vocab_size=0)) == 30  # not a size
    config = type("Config", (), {"vocab_size": 777})()
    assert find_vocab_size(Holder(config=config)) == 777
    assert find_vocab_size(nn.Linear(2, 2)) is None
    assert torch.is_tensor(Holder().big.weight)


def test_a_synthesised_token_batch_and_a_targets_batch_resized() -> None:
    import torch
    from torch import nn

    from autoshard.errors import ConfigError
    from autoshard.target.step import make_batch

    model = nn.Embedding(100, 4)
    cpu = torch.device("cpu")
    ids = make_batch(model, None, micro_batch_size=3, seq_len=16, device=cpu)
    assert ids.shape == (3, 16) and ids.dtype == torch.long
    assert int(ids.min()) >= 0 and int(ids.max()) < 100 and int(ids.max()) > 50
    again = make_batch(model, None, micro_batch_size=3, seq_len=16, device=cpu)
    other = make_batch(model, None, micro_batch_size=3, seq_len=16, device=cpu, seed=1)
    assert torch.equal(ids, again) and not torch.equal(ids, other)  # seeded
    built = (torch.ones(2, 5), torch.zeros(2, dtype=torch.long))
    x, y = make_batch(model, built, micro_batch_size=4, seq_len=None, device=cpu)
    assert x.shape == (4, 5) and y.shape == (4,)
    for seq_len, nothing in ((None, model), (16, nn.Linear(2, 2))):
        with pytest.raises(ConfigError, match=r"^no example batch: .*give --seq-len"):
            make_batch(nothing, None, micro_batch_size=1, seq_len=seq_len, device=cpu)


def test_resizing_and_moving_a_batch_keep_its_structure() -> None:
    import torch

    from autoshard.target.step import move_to, resize_batch

    rows = torch.arange(4).reshape(2, 2)
    batch = {"x": rows, "pair": (rows, [rows]), "scale": torch.tensor(3.0), "n": 7,
             "other": torch.zeros(5, 2)}  # fmt: skip
    assert resize_batch(batch, 2) is batch
    five = resize_batch(batch, 5)
    assert five["x"].tolist() == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]
    assert isinstance(five["pair"], tuple) and isinstance(five["pair"][1], list)
    assert five["pair"][1][0].shape == (5, 2)
    assert five["scale"] is batch["scale"] and five["n"] == 7
    assert five["other"] is batch["other"]  # not the batch's leading dimension
    assert resize_batch(batch, 1)["x"].tolist() == [[0, 1]]
    assert resize_batch(rows, 3).tolist() == [[0, 1], [2, 3], [0, 1]]
    moved = move_to(batch, torch.device("meta"))
    assert moved["x"].is_meta and moved["pair"][1][0].is_meta and moved["n"] == 7
    assert isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list)
    assert move_to("text", torch.device("meta")) == "text"


def test_a_batch_is_fed_as_keywords_arguments_or_one_value() -> None:
    import torch
    from torch import nn

    from autoshard.target.step import forward, with_labels

    class Echo(nn.Module):
        def forward(self, a: object = None, b: object = None, labels: object = None) -> object:
            return (a, b, labels)

    one = torch.ones(1)
    assert forward(Echo(), {"b": one}) == (None, one, None)
    assert forward(Echo(), (one, 2)) == (one, 2, None)
    assert forward(Echo(), [one, 2]) == (one, 2, None)
    assert forward(Echo(), one) == (one, None, None)
    # Hugging Face style: labels are the input ids, where forward takes them
    ids = torch.ones(2, 3, dtype=torch.long)
    assert with_labels(Echo(), {"input_ids": ids})["labels"] is ids
    assert "labels" not in with_labels(nn.Identity(), {"input_ids": ids})
    given = {"input_ids": ids, "labels": ids + 1}
    assert with_labels(Echo(), given) is given
    assert with_labels(Echo(), ids) is ids and with_labels(Echo(), {"a": ids}) == {"a": ids}


def test_the_loss_follows_its_documented_order() -> None:
    import torch
    import torch.nn.functional as F

    from autoshard.errors import ConfigError
    from autoshard.target.step import compute_loss, find_loss_fn

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    # the user's function first
    assert compute_loss(logits, ids, lambda out, batch: torch.tensor(42.0)).item() == 42.0
    # an output's .loss, a dict's "loss"
    hf = type("Out", (), {"loss": torch.tensor(3.0), "logits": logits})()
    assert compute_loss(hf, ids).item() == 3.0
    assert compute_loss({"loss": torch.tensor(4.0)}, ids).item() == 4.0
    # a scalar output is the loss
    assert compute_loss(torch.tensor(5.0), ids).item() == 5.0
    # next-token cross-entropy for [B, T, V] logits of a token batch (tuple output: the first)
    next_token = F.cross_entropy(logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1))
    assert torch.allclose(compute_loss((logits, None), ids), next_token)
    assert torch.allclose(compute_loss(logits, {"input_ids": ids}), next_token)
    assert torch.allclose(compute_loss([logits], ids), next_token)
    # [N, C] scores against the batch's integer targets (after the inputs)
    scores, y = torch.randn(4, 3), torch.tensor([0, 2, 1, 2])
    x = torch.randn(4, 8)
    assert torch.allclose(compute_loss(scores, (x, y)), F.cross_entropy(scores, y))
    assert torch.allclose(compute_loss(scores, {"x": x, "y": y}), F.cross_entropy(scores, y))
    # otherwise the mean of the output
    assert torch.allclose(compute_loss(scores, x), scores.mean())
    assert torch.allclose(compute_loss(scores, (y, x)), scores.mean())  # targets come after
    assert torch.allclose(compute_loss(logits, ids[:, :3]), logits.mean())  # shapes differ
    with pytest.raises(ConfigError, match=r"^cannot compute a loss from a str output"):
        compute_loss("text", ids)
    # the user's function is found in the target's module, when callable
    module = type("M", (), {"autoshard_loss": staticmethod(lambda o, b: o)})
    assert find_loss_fn(module) is module.autoshard_loss
    assert find_loss_fn(type("M", (), {"autoshard_loss": 3})) is None


def test_the_step_helpers_at_their_edges() -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from autoshard.errors import ConfigError
    from autoshard.target.step import (
        batch_samples,
        batch_tokens,
        compute_loss,
        find_loss_fn,
        find_vocab_size,
        make_batch,
    )

    rows = torch.arange(4).reshape(2, 2)
    assert batch_samples(torch.tensor(3.0)) == 1 and batch_samples({"n": 7}) == 1
    assert batch_samples({"n": 7, "x": rows}) == 2 and batch_samples([]) == 1
    ids = torch.ones(4, 128, dtype=torch.long)
    assert batch_tokens((ids, torch.ones(4, 7, dtype=torch.long))) == 512  # the first tensor's
    vocab_one = nn.Linear(2, 2)
    vocab_one.vocab_size = 1  # type: ignore[assignment]
    assert find_vocab_size(vocab_one) == 1
    assert find_loss_fn(type("M", (), {})) is None
    # token batches: on the device asked for, every id below the vocabulary, 0 included
    meta = make_batch(nn.Embedding(2, 4), None, micro_batch_size=4, seq_len=64,
                      device=torch.device("meta"))  # fmt: skip
    assert meta.is_meta and meta.shape == (4, 64)
    built = make_batch(nn.Embedding(2, 4), (rows,), micro_batch_size=2, seq_len=None,
                       device=torch.device("meta"))  # fmt: skip
    assert built[0].is_meta
    tokens = make_batch(nn.Embedding(2, 4), None, micro_batch_size=4, seq_len=64,
                        device=torch.device("cpu"))  # fmt: skip
    assert set(tokens.unique().tolist()) == {0, 1}
    with pytest.raises(ConfigError, match=r"or return a batch from the factory$"):
        make_batch(nn.Linear(2, 2), None, micro_batch_size=1, seq_len=8,
                   device=torch.device("cpu"))  # fmt: skip
    # the loss: the user's function gets the output and the batch
    out, batch = torch.tensor([1.0, 2.0]), torch.tensor([10.0])
    assert compute_loss(out, batch, lambda o, b: o.sum() + b.sum()).item() == 13.0
    # an output's .logits (no .loss): next-token cross-entropy
    torch.manual_seed(0)
    logits, tok = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    nt = F.cross_entropy(logits[:, :-1].reshape(-1, 11), tok[:, 1:].reshape(-1))
    holder = type("Out", (), {"logits": logits})()
    assert torch.allclose(compute_loss(holder, tok), nt)
    assert torch.allclose(compute_loss(logits, (tok,)), logits.mean())  # a tuple: no token ids
    with pytest.raises(
        ConfigError, match=r"define autoshard_loss\(output, batch\) in the target's module$"
    ):
        compute_loss(object(), tok)
    # [N, C] scores: targets wrap modulo the classes, found in a dict's values in any order,
    # never a float tensor
    scores, x = torch.randn(2, 5), torch.randn(2, 8)
    y = torch.tensor([3, 9])
    expected = F.cross_entropy(scores, y % 5)
    assert torch.allclose(compute_loss(scores, (x, y)), expected)
    assert torch.allclose(compute_loss(scores, {"y": y, "x": x}), expected)
    assert torch.allclose(compute_loss(scores, (x, torch.randn(2))), scores.mean())


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
