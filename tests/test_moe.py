"""Mixture-of-experts models (Hugging Face Mixtral from a config): the block class is found, the
forward runs on fake tensors at every precision (fp32 too, where torch's fake grouped_mm wants
bf16), routed experts' activations are planned for balanced routing, and a fake forward that
fails does not spill torch's tracebacks into the user's terminal."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from autoshard.analyze import analyze_model, analyze_target
from autoshard.config import Candidate, Hardware, Precision, WorkloadSpec
from autoshard.predict.activations import profile_activations
from autoshard.predict.analytic import estimate_memory
from autoshard.predict.fakes import quiet_fake_kernel_errors
from autoshard.predict.simulate import simulate_memory
from autoshard.target.resolve import TargetSpec

from .conftest import EXAMPLES

pytest.importorskip("transformers")

MIXTRAL = f"{EXAMPLES}/hf_mixtral.py:build"
LAYER = "transformers.models.mixtral.modeling_mixtral.MixtralDecoderLayer"
BOTH = (Precision.FP32, Precision.BF16_MIXED)


def _profile(seq: int = 64, **kwargs):
    """The tiny Mixtral with a batch of one sequence of ``seq`` tokens (the example's own batch,
    which the simulation and trials run too)."""
    target = TargetSpec(spec=MIXTRAL, kwargs={"size": "tiny", "batch_size": 1, "seq_len": seq,
                                              **kwargs})  # fmt: skip
    profile, built = analyze_target(target)
    workload = WorkloadSpec(seq_len=seq)
    acts = profile_activations(built.model, profile, workload, built.batch, precisions=BOTH)
    return target, profile, acts


def test_the_block_class_is_found_with_its_experts() -> None:
    _, profile, _ = _profile()
    assert profile.block_classes == (LAYER,)
    assert profile.wrap_policy == (LAYER,) and profile.checkpoint_policy == (LAYER,)
    assert "MixtralDecoderLayer" in profile.no_split_modules
    # every expert's weights belong to the block: 4 experts x (gate, up, down) of 64 x 128
    assert profile.block_params > 4 * 3 * 64 * 128


def test_fp32_forward_runs_on_fake_tensors() -> None:
    """transformers' grouped_mm experts kernel runs fp32 on the CPU, but torch's fake kernel
    refuses anything but bf16: without autoshard's fake kernel the fp32 profile failed and
    was scaled from bf16 (or guessed)."""
    _, _, acts = _profile()
    assert acts.measured and acts.note == ""
    assert acts.precision is Precision.FP32
    assert [p.precision for p in acts.others] == [Precision.BF16_MIXED]
    fp32, bf16 = acts.block_bytes[0], acts.at("bf16-mixed").block_bytes[0]
    assert 0.4 * fp32 < bf16 < 0.75 * fp32  # bf16 saves about half, plus the fp32 router


def test_routed_experts_are_planned_for_balanced_routing() -> None:
    """Each token's hidden state goes to top_k experts: the experts save tokens x top_k rows in
    all, whatever the routing. Routing every token to 2 experts instead of 1 adds, per token,
    one more expert's rows: its input (hidden), gate and up (2 x intermediate), the activation
    and the product (2 x intermediate) and its output (hidden), in fp32 (and a few bytes of
    routing indices and weights)."""
    seq, hidden, inter = 64, 64, 128
    one = _profile(seq, num_experts_per_tok=1)[2].block_bytes[0]
    two = _profile(seq, num_experts_per_tok=2)[2].block_bytes[0]
    per_row = 4 * (hidden + 2 * inter + 2 * inter + hidden)
    assert abs((two - one) - seq * per_row) <= 0.05 * seq * per_row, (two - one, seq * per_row)


def test_the_eager_experts_loop_is_profiled_as_grouped_mm_and_says_so() -> None:
    """The eager loop's shapes depend on the routing (fake tensors cannot run it): the profile
    runs the same token-expert rows with grouped_mm, and says so once."""
    _, _, grouped = _profile()
    _, _, eager = _profile(experts_implementation="eager")
    assert eager.measured and eager.block_bytes == grouped.block_bytes
    assert eager.note.count("balanced routing") == 1


def test_analytic_and_simulated_agree_on_the_tiny_mixtral() -> None:
    target, profile, acts = _profile(seq=128)
    hw = Hardware(gpus_per_node=2, gpu_memory=8 * 2**30, backend="gloo")
    workload = WorkloadSpec(seq_len=128)
    for precision in ("32-true", "bf16-mixed"):
        c = Candidate(engine="fsdp2", wrap_classes=profile.wrap_policy, precision=precision)
        sim = simulate_memory(target, c, hw, workload, block_classes=profile.block_classes)
        ana = estimate_memory(profile, c, hw, workload, activations=acts)
        assert abs(ana.gpu_peak - sim.gpu_peak) <= 0.10 * sim.gpu_peak, (precision, ana, sim)


class _FailsOnFake(nn.Module):
    """A forward whose fake kernel fails (a shape mismatch torch's meta kernel catches)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.w = nn.Parameter(torch.ones(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x @ self.w


def test_a_failing_fake_forward_is_one_line_not_torchs_traceback(capfd, caplog) -> None:
    with torch.device("meta"):
        model = _FailsOnFake()
    with caplog.at_level(logging.DEBUG):
        acts = profile_activations(
            model, analyze_model(model), WorkloadSpec(), batch=torch.randn(2, 8), precisions=BOTH
        )
    err = capfd.readouterr().err
    assert not acts.measured
    assert "\n" not in acts.note and acts.note.count("did not run on fake tensors") == 1
    assert "Traceback" not in err and "failed while attempting" not in err, err
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]


def test_quiet_fake_kernel_errors_is_undone(caplog) -> None:
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    with caplog.at_level(logging.ERROR, logger=logger.name):
        with quiet_fake_kernel_errors():
            logger.error("dropped")
        logger.error("kept")
    assert [r.getMessage() for r in caplog.records] == ["kept"]
