"""What autoshard's stages produce, as immutable, JSON-serialisable data: ``analyze`` makes a
:class:`ModelProfile`; the estimator a :class:`MemoryEstimate` per candidate; a trial a
:class:`TrialResult`; the decision (:mod:`autoshard.decide`) a :class:`Decision`, which ``emit``
and ``ui`` turn into strategies, YAML and reports. Data only: no stage logic here, and no import
of ``emit`` or ``ui``: the user holds a decision as :class:`autoshard.Recommendation`
(:mod:`autoshard.recommendation`, a floor above them), which adds the doors to both.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Literal

from pydantic import Field

from autoshard.config import Candidate, Frozen, Hardware, WorkloadSpec
from autoshard.outcomes import OUTCOMES, TrialStatus, outcome_of
from autoshard.units import format_share

# --------------------------------------------------------------------------------------------
# Analysis
# --------------------------------------------------------------------------------------------


class ClassStat(Frozen):
    """Parameter statistics of one module class."""

    class_path: str = Field(..., description="module.QualName of the class.")
    name: str = Field(..., description="Short class name.")
    count: int = Field(..., description="Instances in the model.")
    params_each: int = Field(
        ..., description="Parameters of one instance, sub-modules included (largest instance)."
    )
    params_smallest: int | None = Field(
        None, description="Parameters of the smallest instance, when instances differ in size."
    )
    params_total: int = Field(
        ..., description="Unique parameters under all instances (nested instances counted once)."
    )
    frozen_total: int = Field(
        0, description="Of params_total, the frozen ones (requires_grad=False)."
    )
    share: float = Field(..., description="params_total / total parameters of the model.")


class ModuleStat(Frozen):
    """Parameter statistics of one named module (the top levels of the tree)."""

    name: str = Field(..., description="Dotted module name ('' is the root).")
    class_path: str
    depth: int
    params: int = Field(..., description="Unique parameters under this module.")
    own_params: int = Field(..., description="Parameters directly on this module.")


class TiedGroup(Frozen):
    """Parameters that are one tensor under several names; they must stay in one FSDP unit."""

    names: tuple[str, ...]
    numel: int


class ModelProfile(Frozen):
    """What the analyzer found in a model, and the policies it proposes.

    >>> from torch import nn
    >>> from autoshard import analyze_model
    >>> lm = nn.Sequential(
    ...     nn.Embedding(1000, 64),
    ...     *[nn.TransformerEncoderLayer(64, 4, 128, batch_first=True) for _ in range(4)],
    ...     nn.Linear(64, 1000))
    >>> profile = analyze_model(lm)
    >>> profile.total_params, profile.block_count, profile.root_unit_params
    (262888, 4, 129000)
    >>> profile.warnings[1][:60]  # the embedding and head stay in the root unit
    'the root unit keeps 129,000 parameters (49%) outside the wra'
    """

    target: str = Field(..., description="What was analysed (target string or class name).")
    model_class: str = Field(..., description="Class path of the root module.")
    total_params: int = Field(..., description="Unique parameters (tied ones once).")
    trainable_params: int
    frozen_params: int = Field(
        0, description="Parameters with requires_grad=False: no gradient, no optimizer state."
    )
    root_frozen_params: int = Field(
        0, description="Frozen parameters outside the repeated blocks (in the root unit)."
    )
    block_frozen_params: int = Field(
        0, description="Frozen parameters of the largest block that has trainable ones."
    )
    frozen_blocks: int = Field(
        0, description="Blocks with no trainable parameter (LoRA: usually none; they all adapt)."
    )
    vector_params: int = Field(
        0,
        description="Trainable parameters in tensors of fewer than two dimensions (biases, norm "
        "weights): what an optimizer that factors matrices keeps whole.",
    )
    matrix_factor_params: int = Field(
        0,
        description="Elements of a row and a column vector of each trainable tensor of two or "
        "more dimensions (an (m, n) one: m + n): Adafactor's second moment of them.",
    )
    param_bytes: int = Field(..., description="Bytes of the parameters in their built dtype.")
    buffer_bytes: int = Field(0, description="Bytes of registered buffers.")
    param_dtype: str = Field("float32", description="Most common parameter dtype.")
    built_on: Literal["meta", "cpu"] = Field(
        "meta", description="Device the model was built on for analysis."
    )
    classes: tuple[ClassStat, ...] = Field((), description="Per-class statistics, largest first.")
    modules: tuple[ModuleStat, ...] = Field((), description="The first levels of the module tree.")
    tied: tuple[TiedGroup, ...] = ()
    no_split_modules: tuple[str, ...] = Field(
        (), description="Hugging Face `_no_split_modules` of the model, when it has them."
    )
    block_classes: tuple[str, ...] = Field(
        (), description="Class paths of the repeated blocks (the usual wrap unit)."
    )
    block_count: int = Field(0, description="Number of repeated blocks.")
    block_params: int = Field(0, description="Parameters of the largest block.")
    wrap_policy: tuple[str, ...] = Field((), description="Proposed auto_wrap_policy classes.")
    wrap_min_params: int | None = Field(
        None, description="Size-based wrapping threshold, proposed when there is no block class."
    )
    wrap_reason: str = ""
    checkpoint_policy: tuple[str, ...] = Field(
        (), description="Proposed activation_checkpointing_policy classes."
    )
    checkpoint_reason: str = ""
    root_unit_params: int = Field(
        0, description="Parameters left in the root unit under the proposed wrap policy."
    )
    largest_unit_params: int = Field(0, description="Largest FSDP unit under the proposal.")
    vocab_size: int | None = Field(None, description="Embedding rows, when the model has one.")
    hidden_size: int | None = Field(None, description="Embedding width, when the model has one.")
    context_length: int | None = Field(
        None, description="The longest sequence the model takes (its positions), when it says."
    )
    context_source: str = Field("", description="What sets context_length.")
    warnings: tuple[str, ...] = Field((), description="What the guide warns against, found here.")
    seconds: float = Field(0.0, description="Time the analysis took.")


# --------------------------------------------------------------------------------------------
# Estimates, trials, recommendation
# --------------------------------------------------------------------------------------------


class MemoryBreakdown(Frozen):
    """Per-rank GPU bytes at the peak, by kind. The terms add up to the peak."""

    sharded_params: int = 0
    unsharded_params: int = 0
    gradients: int = 0
    optimizer: int = 0
    comm_buffers: int = 0
    activations: int = 0
    temporaries: int = 0
    buffers: int = 0
    allowance: int = Field(
        0, description="CUDA context, NCCL, allocator slack: what a CPU simulation cannot see."
    )

    @property
    def total(self) -> int:
        # the fields read directly: a dump per call was most of a peak's search over events
        return sum(int(getattr(self, name)) for name in type(self).model_fields)


class SpeedBreakdown(Frozen):
    """Seconds of one optimizer step of one rank, by cause (what is not hidden behind compute)."""

    compute_s: float = Field(0.0, description="Forward and backward FLOPs at the GPU's speed.")
    recompute_s: float = Field(0.0, description="Forwards re-run by activation checkpointing.")
    exposed_comm_s: float = Field(
        0.0, description="All-gathers, reduce-scatters, all-reduces not overlapped with compute."
    )
    contention_s: float = Field(
        0.0, description="Compute slowed by the collectives that overlap it (hiding's price)."
    )
    offload_s: float = Field(0.0, description="CPU offload: host<->GPU copies, host optimizer.")
    optimizer_s: float = Field(0.0, description="The optimizer step on the GPU.")
    distributed_s: float = Field(
        0.0,
        description="What running sharded costs the compute stream beyond the collectives: "
        "FSDP's copies out of each all-gather and into each reduce-scatter (0 on one GPU).",
    )
    host_bound_s: float = Field(
        0.0,
        description="What the step waits on its host beyond the GPU's work: the kernels' "
        "launches and FSDP's hooks per unit take longer than the GPU runs them (a small or "
        "short-sequence model; :mod:`autoshard.predict.host_bound`). 0 where the GPU is busier.",
    )
    pressure_s: float = Field(
        0.0,
        description="Allocator stalls of a candidate whose predicted peak is within "
        "``SpeedFactors.pressure_margin`` of the usable memory (0 with room to spare).",
    )
    float8_scale_sync_s: float = Field(
        0.0,
        description="float8: each step's amax of the float8 weights' shards and the scales' "
        "all-reduce.",
    )
    compile_saving_s: float = Field(
        0.0,
        description="torch.compile: compute and recompute seconds its fused kernels took off "
        "(already out of compute_s and recompute_s; not part of the step).",
    )
    float8_matmul_saving_s: float = Field(
        0.0,
        description="float8: seconds the blocks' linear layers saved at the fp8 rate (already "
        "out of compute_s and recompute_s; not part of the step).",
    )
    float8_cast_s: float = Field(
        0.0,
        description="float8: seconds of the amax and casts of the linear layers' inputs and "
        "gradients (already in compute_s and recompute_s). Its gathers, in 1 byte: in "
        "exposed_comm_s.",
    )
    mfu_cap_s: float = Field(
        0.0,
        description="Seconds added to a step predicted faster than any published run of its "
        "model size on its GPU generation reached: the step at the best published MFU "
        "(:mod:`autoshard.predict.ceilings`); 0 below it.",
    )


class SpeedEstimate(Frozen):
    """Predicted speed of one candidate on the planned GPUs (:mod:`autoshard.predict.speed`)."""

    step_time_s: float = Field(..., description="Seconds per optimizer step per rank.")
    samples_per_s: float = Field(..., description="Samples per second, all ranks together.")
    tokens_per_s_per_gpu: float | None = Field(None, description="Tokens/s of one GPU.")
    mfu: float | None = Field(None, description="Model FLOPs utilisation (0-1).")
    breakdown: SpeedBreakdown = Field(default_factory=SpeedBreakdown)
    gpu: str = Field("", description="Catalogue id of the GPU the prediction is for.")
    calibrated: bool = Field(
        False,
        description="Whether measured trials of this candidate's calibration class (its "
        "precision, torch.compile and float8) calibrated the prediction.",
    )
    interval_s: tuple[float, float] | None = Field(
        None,
        description="Where the measured step time is expected to fall: the step time times the "
        "range of measured / predicted that the model's class of this prediction (GPU "
        "generation, precision, model size) showed on the held-out benchmark rows, or, once "
        "calibrated, that the calibration's own trials showed (:mod:`autoshard.predict."
        "intervals`). Two candidates whose intervals overlap are a tie for the model.",
    )
    interval_class: str = Field(
        "", description="The class whose errors give ``interval_s``, and how many rows it had."
    )
    mfu_capped: bool = Field(
        False,
        description="Whether the prediction was capped at the best published MFU of its model "
        "size and GPU generation (``breakdown.mfu_cap_s``).",
    )

    def describe(self) -> str:
        """One line: the predicted step, its interval and class, tokens/s and MFU, and whether
        it is calibrated or capped.

        >>> line = SpeedEstimate(step_time_s=0.2, samples_per_s=5.0, mfu=0.43, mfu_capped=True,
        ...     interval_s=(0.18, 0.3), interval_class="hopper 16-bit (held-out, 9 rows)"
        ... ).describe()
        >>> for part in line.split("), "):
        ...     print(part)
        predicted 0.200 s/step (0.180-0.300 s: hopper 16-bit (held-out, 9 rows)
        MFU 43% (capped at the best published for this model size and GPU generation
        uncalibrated
        """
        text = f"predicted {self.step_time_s:.3f} s/step"
        if self.interval_s is not None:
            low, high = self.interval_s
            text += f" ({low:.3f}-{high:.3f} s: {self.interval_class})"
        if self.tokens_per_s_per_gpu:
            text += f", {self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU"
        if self.mfu is not None:
            text += f", MFU {format_share(self.mfu)}"
            if self.mfu_capped:
                text += " (capped at the best published for this model size and GPU generation)"
        return text + (", calibrated" if self.calibrated else ", uncalibrated")


class TimedEvent(Frozen):
    """A memory event of one training step placed on the step's time: the moment ``name`` in
    micro-batch ``micro_batch``'s ``stage``, during FSDP unit ``turn``'s compute (None: the
    optimizer step) from ``start_s`` to ``end_s`` seconds into the step, with ``live`` the bytes
    allocated then (no allowance)."""

    name: str
    stage: Literal["forward", "backward", "step"]
    micro_batch: int
    turn: str | None
    start_s: float
    end_s: float
    live: MemoryBreakdown


class StepTimeline(Frozen):
    """One candidate's step as memory over time (:mod:`autoshard.predict.step_profile`): its
    memory events in time order, which of them is the memory estimate's peak, and the seconds
    of the speed model's step that fall outside the events' span, by cause."""

    candidate: str = Field(..., description="The candidate's label.")
    events: tuple[TimedEvent, ...]
    peak: int = Field(..., description="Index in ``events`` of the estimate's peak.")
    step_time_s: float = Field(..., description="The speed model's seconds per step.")
    untimed: dict[str, float] = Field(
        default_factory=dict,
        description="Seconds of the step not on the events' span: FSDP's copies, float8's "
        "scale sync, the host-bound floor, memory pressure.",
    )
    calibrated: bool = Field(False, description="Whether the seconds are calibrated by trials.")

    @property
    def peak_event(self) -> TimedEvent:
        return self.events[self.peak]


class MemoryEstimate(Frozen):
    """Predicted per-rank memory of one candidate on one hardware target.

    >>> import warnings
    >>> import torch
    >>> from torch import nn
    >>> import autoshard
    >>> warnings.simplefilter("ignore", autoshard.NoGPUWarning)  # planning for GPUs not here
    >>> layers = [nn.TransformerEncoderLayer(64, 4, 128, batch_first=True) for _ in range(4)]
    >>> first = autoshard.estimate(nn.Sequential(*layers), batch=torch.randn(2, 32, 64),
    ...                            gpus=8, gpu_memory="80GiB")[0]
    >>> first.fits, first.gpu_peak == first.breakdown.total, first.headroom > 0
    (True, True, True)
    >>> repr(first).startswith("MemoryEstimate('fsdp1")  # a line (a table in a notebook)
    True
    """

    candidate: Candidate
    method: Literal["analytic", "simulated"]
    peak_at: str = Field("", description="The moment of the step that holds the peak.")
    gpu_peak: int = Field(..., description="Predicted peak GPU bytes per rank.")
    host_peak: int = Field(0, description="Predicted host bytes per node.")
    breakdown: MemoryBreakdown
    fits: bool
    headroom: int = Field(..., description="usable GPU memory minus gpu_peak (negative: OOM).")
    reason: str = Field("", description="Why it does not fit, when it does not.")
    speed: SpeedEstimate | None = Field(None, description="Predicted speed, when modelled.")

    # A notebook shows one line or one small table, not the 3,000 characters of every field.
    def __repr__(self) -> str:
        from autoshard.units import format_bytes

        fits = "fits" if self.fits else "does not fit"
        speed = ""
        if self.speed is not None and self.speed.tokens_per_s_per_gpu:
            speed = f", {self.speed.tokens_per_s_per_gpu:,.0f} tokens/s per GPU"
        return (
            f"MemoryEstimate({self.candidate.label()!r}: {format_bytes(self.gpu_peak)} per GPU, "
            f"{fits} ({format_bytes(self.headroom)} headroom){speed})"
        )

    def _repr_html_(self) -> str:
        """The configuration, whether it fits, and the breakdown of its peak (written here:
        the data's layer imports no ``ui``)."""
        from html import escape

        from autoshard.units import format_bytes

        fits = "fits" if self.fits else f"does not fit: {self.reason}"
        speed = ""
        if self.speed is not None and self.speed.tokens_per_s_per_gpu:
            speed = f"; predicted {self.speed.tokens_per_s_per_gpu:,.0f} tokens/s per GPU"
        terms = "".join(
            f"<tr><td>{escape(term.replace('_', ' '))}</td><td style='text-align:right'>"
            f"{escape(format_bytes(value))}</td></tr>"
            for term, value in self.breakdown.model_dump().items()
            if value
        )
        where = f", peak at {self.peak_at}" if self.peak_at else ""
        return (
            f"<div><b>{escape(self.candidate.label())}</b>: {escape(format_bytes(self.gpu_peak))}"
            f" per GPU ({escape(self.method + where)}), {escape(fits)}, "
            f"{escape(format_bytes(self.headroom))} headroom{escape(speed)}"
            f"<table>{terms}</table></div>"
        )


class TrialResult(Frozen):
    """What one short real FSDP run measured (one line of ``trials.jsonl`` in a tune's output).

    >>> from autoshard import Candidate, TrialResult
    >>> trial = TrialResult(candidate=Candidate(), status="ok", world_size=2, step_time=0.2,
    ...                     peak_allocated=(96 * 2**20, 98 * 2**20))
    >>> trial.max_allocated // 2**20  # the largest rank decides what fits
    98
    >>> TrialResult.model_validate_json(trial.model_dump_json()) == trial
    True
    """

    candidate: Candidate
    status: TrialStatus
    device: str = Field("cpu", description="'cuda' or 'cpu' (gloo).")
    world_size: int = 1
    step_time: float | None = Field(None, description="Median seconds per timed step.")
    step_times: tuple[float, ...] = ()
    step_time_spread: float | None = Field(
        None,
        description="Relative uncertainty of step_time (e.g. 0.03: the median is known to "
        "within 3%); two trials closer than their spreads are a tie.",
    )
    samples_per_s: float | None = Field(
        None, description="Samples per second, all ranks together (samples_per_s_per_gpu: one's)."
    )
    tokens_per_s: float | None = Field(
        None, description="Tokens per second, all ranks together (tokens_per_s_per_gpu: one's)."
    )
    peak_allocated: tuple[int, ...] = Field((), description="Per-rank peak allocated bytes.")
    peak_reserved: tuple[int, ...] = Field((), description="Per-rank peak reserved bytes.")
    losses: tuple[float, ...] = Field(
        (), description="Rank 0's loss at every step, in order (NaN or inf: diverged)."
    )
    error: str | None = None
    transient: bool = Field(
        False,
        description="The failure came from outside the trial (a rank killed by a signal, a "
        "worker group that did not start): the same candidate may well run when tried again.",
    )
    duration: float = Field(
        0.0, description="Wall seconds from the trial's request to its result (a launch excluded)."
    )
    launch_seconds: float = Field(
        0.0,
        description="Wall seconds this trial waited for a fresh worker group to start before its "
        "request (0 when the group was already up).",
    )
    baseline_bytes: tuple[int, ...] = Field(
        (),
        description="Per rank, bytes already allocated when the trial started (CUDA's "
        "allocator; on CPU the live tensors): its worker's own, the same for every trial of a "
        "clean group. Its peaks are counted above it.",
    )
    raised_on: int | None = Field(
        None,
        description="An error trial: how many of its ranks raised the error (None: not known, "
        "a record of an older autoshard). Only an error every rank raised is the model's own "
        "and counts against the configuration (autoshard.study.causes).",
    )
    contaminated: bool = Field(
        False,
        description="The trial started with an earlier trial's memory still allocated (its "
        "baseline above its group's first by more than the margin): an OOM of it says nothing "
        "about the candidate, and the search learns nothing from one.",
    )
    oom_retry: bool = Field(
        False,
        description="The candidate ran out of memory in a worker group that had run other "
        "trials first; this is its one retry in a fresh group.",
    )
    started_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))

    @property
    def max_allocated(self) -> int | None:
        return max(self.peak_allocated) if self.peak_allocated else None

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        """Tokens per second of one rank (one GPU's, or one CPU worker's): the unit every view
        shows a measured rate in, as the predictions' ``tokens_per_s_per_gpu``."""
        return self.tokens_per_s / max(self.world_size, 1) if self.tokens_per_s else None

    @property
    def samples_per_s_per_gpu(self) -> float | None:
        """Samples per second of one rank (:attr:`tokens_per_s_per_gpu`'s unit)."""
        return self.samples_per_s / max(self.world_size, 1) if self.samples_per_s else None

    @property
    def per_gpu(self) -> str:
        """How a measured rate of one rank is labelled: per GPU, or per rank on CPU workers."""
        return "per GPU" if self.device == "cuda" else "per rank"


class Scored(Frozen):
    """A candidate with what is known about it: its estimate and, when tried, its trial."""

    candidate: Candidate
    estimate: MemoryEstimate | None = None
    trial: TrialResult | None = None


class Decision(Frozen):
    """The pipeline's answer as data: the chosen configuration, its evidence, the alternatives.

    What ``emit`` and ``ui`` take. Users get it as its subclass
    :class:`autoshard.Recommendation`, whose methods lead to them.
    """

    profile: ModelProfile
    hardware: Hardware
    workload: WorkloadSpec
    chosen: Scored
    runners_up: tuple[Scored, ...] = ()
    ruled_out: tuple[Scored, ...] = ()
    basis: Literal["estimate", "trials"] = Field(
        "estimate", description="Whether the choice rests on estimates alone or on trials."
    )
    reasons: tuple[str, ...] = Field((), description="Why each chosen setting, one line each.")
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    versions: dict[str, str] = Field(default_factory=dict, description="autoshard, torch, ...")
    study: str | None = Field(
        None,
        description="Name of the study the trials came from (a fingerprint of the settings): "
        "the records of trials.jsonl that belong to this recommendation.",
    )
    timeline: StepTimeline | None = Field(
        None,
        description="The chosen configuration's step as memory over time (the analytic "
        "estimate's events on the speed model's seconds); None where not predicted.",
    )

    # Notebook- and terminal-friendly: a few lines, not the 150,000 characters of every field.
    def summary_lines(self) -> list[str]:
        """The choice, its peak and its basis, in a few lines (``str(rec)``)."""
        c, est, trial = self.chosen.candidate, self.chosen.estimate, self.chosen.trial
        hw = self.hardware
        lines = [
            f"autoshard recommends {c.label()}",
            f"  for {self.profile.target} ({self.profile.total_params:,} params) on "
            f"{hw.nodes} x {hw.gpus_per_node} GPUs of {hw.gpu_memory / 2**30:.0f} GiB",
        ]
        if est is not None:
            lines.append(
                f"  predicted peak {est.gpu_peak / 2**30:.2f} GiB per GPU ({est.method}, "
                f"{hw.usable_gpu_memory / 2**30:.1f} GiB usable)"
            )
            if est.speed is not None:
                lines.append("  " + est.speed.describe())
        if trial is not None and trial.step_time is not None:
            rate = trial.tokens_per_s_per_gpu or trial.samples_per_s_per_gpu
            unit = "tokens/s" if trial.tokens_per_s_per_gpu else "samples/s"
            lines.append(
                f"  measured {trial.step_time:.3f} s/step on {trial.world_size} {trial.device} "
                "ranks"
                + (f", {rate:,.0f} {unit} {trial.per_gpu}" if rate else "")
                + (f", peak {trial.max_allocated / 2**30:.2f} GiB" if trial.max_allocated else "")
            )
        basis = "estimates only" if self.basis == "estimate" else "measured trials"
        lines.append(
            f"  basis: {basis}; {self.outcome_words()}; rec.reasons says why each setting, "
            "rec.strategy() builds it"
        )
        return lines

    def outcome_counts(self) -> dict[str, int]:
        """How many of the candidates this decision lists ended each way (:data:`OUTCOMES`),
        the words report.json's ``summary.outcomes`` counts in; a candidate that fits and was
        never tried (an estimate's runner-up) counts as none."""
        counts = {o.word: 0 for o in OUTCOMES}
        for s in (self.chosen, *self.runners_up, *self.ruled_out):
            if s.trial is not None:
                counts[outcome_of(s.trial.status).word] += 1
            elif s.estimate is not None and not s.estimate.fits:
                counts["ruled out"] += 1
        return counts

    def outcome_words(self) -> str:
        """``"6 measured (the chosen and 5 runners-up), 32 skipped"``, or for an estimate
        ``"4 runners-up, 170 ruled out"``: :meth:`outcome_counts` in words."""
        counts = self.outcome_counts()
        parts = []
        if self.basis == "estimate" or not counts["measured"]:
            parts.append(f"{len(self.runners_up)} runners-up")
        else:
            parts.append(
                f"{counts['measured']} measured (the chosen and {len(self.runners_up)} runners-up)"
            )
        parts += [f"{n} {word}" for word, n in counts.items() if n and word != "measured"]
        return ", ".join(parts)

    def __str__(self) -> str:
        return "\n".join(self.summary_lines())

    def __repr__(self) -> str:
        c = self.chosen.candidate
        return f"{type(self).__name__}({c.label()!r}, basis={self.basis!r})"
