"""The tuning study: estimate every candidate, try the promising ones for real, pick the fastest.

One optuna trial per candidate, in any optuna RDB storage: a SQLite file in the output folder by
default, or ``--storage`` (PostgreSQL for a study shared by several drivers). The storage side
(the study's name, ``trials.jsonl``, the folder's lock, claims, resuming, what failures teach)
is :mod:`autoshard.study`; optuna is imported only when a study runs, not by ``import autoshard``.

The order is the estimator's: candidates predicted not to fit are never launched (recorded as
pruned with the estimate's reason); the rest are tried fastest-predicted first (the step-time
model, re-ranked after each successful trial by the model calibrated on the measurements, unless
CPU processes stand in for GPUs), and a candidate is skipped when a measured one dominates it:
- same configuration with less checkpointing / no offload already ran fine: more recompute or
  offload can only cost time, so it cannot be faster;
- same configuration at a smaller micro-batch already ran out of memory: a larger one will too
  (an OOM counts when its trial ran clean: one that started with an earlier trial's memory,
  ``TrialResult.contaminated``, rules nothing out; one predicted to fit is tried once more in a
  fresh worker group before it is recorded).
Errors and timeouts rule out the candidates that share the failing setting
(:mod:`autoshard.study.lessons`).

Resuming: every finished trial is appended to ``trials.jsonl`` (fsync'd) and then stored in the
study. Running the same command again skips finished candidates; a trial left running by a killed
process is tried again. Each trial is judged against the prediction it was tried with, recorded with
it in the study, whichever run or driver tried it. Changed settings (batch sizes, precisions,
hardware, ...), or a changed model (its structure:
:func:`autoshard.study.settings.model_fingerprint`; what its forward computes:
:mod:`autoshard.predict.forward_digest`), name a new study, with one line saying what changed:
nothing measured under other settings is reused.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import ValidationError

from autoshard.config import Candidate, Checkpointing, Precision
from autoshard.decide import decide_from_trials
from autoshard.errors import StorageError, StudyNotice, TrialsFailedError
from autoshard.measure import speed_basis
from autoshard.options import TuneOptions
from autoshard.plan import Plan
from autoshard.predict.calibrate import Calibration, reorder_untried
from autoshard.predict.speed import SpeedFactors
from autoshard.ranking import estimate_contender, objective_value, trial_contender
from autoshard.recommendation import Recommendation
from autoshard.results import Decision, MemoryEstimate, TrialResult, TrialStatus
from autoshard.sharding import cpu_workers_cannot_run
from autoshard.study.causes import classified, counts_against
from autoshard.study.loop import run_trials
from autoshard.study.order import study_order
from autoshard.study.settings import StudySettings
from autoshard.trials.group import WorkerGroup
from autoshard.ui.files import (
    RECOMMENDATION_FILE,
    write_failure_report,
    write_report,
    write_text_atomically,
)

if TYPE_CHECKING:  # optuna is imported where a study runs
    from autoshard.study.storage import StudyStore

# The fields the dominance rules reason about; every other field must be equal.
_CHECKPOINT_FIELDS = frozenset({"checkpointing", "checkpoint_every", "checkpoint_classes"})
_SAVING_FIELDS = _CHECKPOINT_FIELDS | {"cpu_offload"}


def _recompute_share(c: Candidate) -> float:
    """Share of the checkpoint classes' blocks recomputed in backward."""
    match c.checkpointing:
        case Checkpointing.NONE:
            return 0.0
        case Checkpointing.EVERY_K:
            return 1.0 / c.checkpoint_every
        case Checkpointing.ALL:
            return 1.0
        case Checkpointing.SELECTIVE:
            # every block, part of each: more than none, less than all (its memory too)
            return 0.5
    raise AssertionError(c.checkpointing)


def _same_except(a: Candidate, b: Candidate, fields: frozenset[str]) -> bool:
    return a.model_dump(exclude=set(fields)) == b.model_dump(exclude=set(fields))


def _saves_less_or_equal(a: Candidate, b: Candidate) -> bool | None:
    """Whether ``a`` recomputes and offloads no more than ``b`` (None: not comparable, e.g.
    checkpointing of different classes)."""
    both_checkpoint = a.checkpointing is not Checkpointing.NONE and (
        b.checkpointing is not Checkpointing.NONE
    )
    if both_checkpoint and a.checkpoint_classes != b.checkpoint_classes:
        return None
    # op-level against one block in k: neither recomputes (nor keeps) less than the other
    if {a.checkpointing, b.checkpointing} == {Checkpointing.SELECTIVE, Checkpointing.EVERY_K}:
        return None
    return _recompute_share(a) <= _recompute_share(b) and a.cpu_offload <= b.cpu_offload


def dominated_by(candidate: Candidate, done: Sequence[TrialResult]) -> TrialResult | None:
    """A finished trial that makes trying ``candidate`` pointless (see the module docstring).

    Each rule holds everything equal except what it reasons about: checkpointing and offload
    (and, for an OOM, the micro-batch size). A different wrap policy, engine, precision,
    sharding, reshard policy or optimizer implementation is never dominated.
    """
    for r in done:
        o = r.candidate
        if o == candidate or (r.status is not TrialStatus.OK and not counts_against(r)):
            continue  # a failure from outside the model says nothing about the configuration
        # The same configuration with less recompute / no offload ran fine: more recompute or
        # offload can only cost time.
        if (
            r.status is TrialStatus.OK
            and _same_except(o, candidate, _SAVING_FIELDS)
            and _saves_less_or_equal(o, candidate)
        ):
            return r
        if r.status is TrialStatus.OOM and _same_except(
            o, candidate, _SAVING_FIELDS | {"micro_batch_size"}
        ):
            # It ran out of memory while saving at least as much at no larger a micro-batch.
            no_larger = o.micro_batch_size <= candidate.micro_batch_size
            if _saves_less_or_equal(candidate, o) and no_larger:
                return r
    return None


def trial_order(plan: Plan) -> list[MemoryEstimate]:
    """The order in which the study tries the candidates of ``plan``: fitting ones first, the
    fastest predicted for the planned hardware first (on CPU workers standing in for GPUs too:
    they check that the most promising configurations build, train and fit), those the model
    cannot tell from the fastest before the rest, each torch.compile or float8 candidate with
    its twin without the switch (:func:`autoshard.study.order.study_order`)."""
    return study_order(plan.ranked())


def _notice(line: str) -> None:
    warnings.warn(line, StudyNotice, stacklevel=3)


def run_study(plan: Plan, options: TuneOptions | None = None) -> Recommendation:
    """Run (or resume) the study of ``plan`` and return the best configuration that ran
    (:func:`autoshard.decide.decide_from_trials`)."""
    opts = options or TuneOptions()
    out_dir = Path(opts.out_dir)
    # Storage first (fast): a locked, unwritable or unreachable one fails in one line before a
    # worker starts. optuna is imported here, where a study runs.
    from autoshard.study.storage import open_store

    notice = opts.on_notice or _notice
    hardware, workload = plan.hardware, plan.workload
    with open_store(out_dir, opts.storage, wait=opts.wait, notice=notice) as store:
        # launched lazily, by the first trial
        group = WorkerGroup(
            plan.request.target, log_dir=out_dir / "workers",
            nproc=opts.nproc or hardware.gpus_per_node, nnodes=hardware.nodes,
            rdzv_endpoint=opts.rdzv_endpoint, trial_timeout=opts.trial_timeout,
            log_cap=opts.worker_log_cap, on_notice=notice,
        )  # fmt: skip
        ranked = trial_order(plan)  # the planned hardware's order, wherever trials run
        _open_study(store, plan, opts)
        cap = opts.memory_cap if opts.memory_cap is not None else hardware.usable_gpu_memory

        # The factors of each candidate's latest (calibrated) prediction: the one a trial is
        # tried with, recorded with it (the report puts it against its measurement; its
        # factors time the chosen one's timeline: one step time, resumed or not).
        predicted: dict[str, SpeedFactors | None] = {}

        def factors_of(candidate: Candidate) -> dict[str, float] | None:
            made_with = predicted.get(candidate.label())
            return None if made_with is None else made_with.model_dump()

        fits = {e.candidate.label(): e.fits for e in plan.estimates}  # its OOM: tried again

        def run(candidate: Candidate) -> TrialResult:
            return classified(group.run(
                candidate, workload, warmup=opts.warmup, steps=opts.steps, memory_cap=cap,
                target_spread=opts.target_spread, max_steps=opts.max_steps,
                max_seconds=opts.max_seconds, retry_oom=fits.get(candidate.label(), False),
            ))  # fmt: skip

        fitted: dict[
            tuple[object, ...], tuple[list[MemoryEstimate], Calibration[SpeedFactors] | None]
        ] = {}

        def reorder(
            untried: Sequence[MemoryEstimate], done: Sequence[TrialResult]
        ) -> list[MemoryEstimate]:
            # The loop asks every round; a fit takes a second or two, so it is redone only when
            # a new measurement came in.
            key = (
                tuple(e.candidate.label() for e in untried),
                *sorted((r.candidate.label(), r.step_time) for r in done if r.step_time),
            )
            if key not in fitted:
                fitted[key] = reorder_remaining(untried, done, plan)
            order, calibration = fitted[key]
            for e in order:
                made_with = None if calibration is None else calibration.factors_for(e.candidate)
                predicted[e.candidate.label()] = made_with
            return order

        with _worker_files(out_dir), group:
            results = run_trials(
                store,
                ranked,
                run,
                n_trials=opts.trials,
                dominated=dominated_by if opts.skip_dominated else None,
                emit=opts.on_event,
                reorder=reorder,
                cannot_run=None if torch.cuda.is_available() else cpu_workers_cannot_run,
                factors_of=factors_of,
            )
        rec = _decide(plan, out_dir, results, *_tried_with(store, results, notice))
        rec = rec.model_copy(update={"study": store.name})
        store.mark_recommended(rec)  # what optuna-dashboard shows beside its best trial
        write_outputs(rec, out_dir, results)
    return rec


def _tried_with(
    store: StudyStore, results: Sequence[TrialResult], notice: Callable[[str], None]
) -> tuple[dict[str, MemoryEstimate], dict[str, SpeedFactors]]:
    """By label, the estimate each launched trial of ``results`` was tried with and the
    calibrated factors it was predicted with, as the study recorded them: this run's trials,
    earlier runs' (resumed) and other drivers' alike. Trials recorded without them (an older
    autoshard; restored from the journal) keep the plan's estimate, said in one line."""
    estimates: dict[str, MemoryEstimate] = {}
    factors: dict[str, SpeedFactors] = {}
    unknown = 0
    for label, tried in store.tried_with(results).items():
        if tried is None:
            unknown += 1
            continue
        try:
            estimate = MemoryEstimate.model_validate_json(tried[0])
            made_with = None if tried[1] is None else SpeedFactors(**tried[1])
        except ValidationError:  # written by another version of autoshard
            unknown += 1
            continue
        estimates[label] = estimate
        if made_with is not None:
            factors[label] = made_with
    if unknown:
        notice(
            f"{unknown} trials of study {store.name} were recorded without the prediction they "
            "were tried with (an older autoshard, or restored from trials.jsonl): they are put "
            "against the uncalibrated model's prediction, which may differ from the one they "
            "were tried with"
        )
    return estimates, factors


def study_settings(plan: Plan, opts: TuneOptions) -> StudySettings:
    """What ``plan``'s trials depend on: the settings a resumed study must match."""
    request = plan.request.options
    return StudySettings.of(
        plan.request.target, plan.hardware, plan.workload, engine=request.engine,
        precisions=request.precision, micro_batch_sizes=sorted({c.micro_batch_size
        for c in plan.candidates}), memory_cap=opts.memory_cap, model=plan.built.model,
        batch=plan.built.batch,
        computation=plan.activations.at(Precision.FP32).forward_digest,
    )  # fmt: skip


def _open_study(store: StudyStore, plan: Plan, opts: TuneOptions) -> None:
    """Open (or resume) ``plan``'s study in ``store``: its settings, which a resumed study must
    match, its candidates, and the objective its trials record."""
    settings = study_settings(plan, opts)
    metric, objective, why = study_objective(plan)
    store.open_study(
        settings, [c.label() for c in plan.candidates], candidates=plan.candidates,
        objective=objective, metric=metric, objective_note=why,
    )  # fmt: skip


def study_objective(plan: Plan) -> tuple[str, Callable[[TrialResult], float], str]:
    """The value a successful trial records in the optuna study, its name, and a line saying
    what it is: the decision's own (:func:`autoshard.decide.objective_value`), so that optuna's
    best trial is the recommended one. Trials on the device planned for: the measured tokens/s
    (else samples/s) per GPU. CPU processes standing in for GPUs: the step-time model's
    prediction for the planned GPU, as :func:`autoshard.decide.decide_from_trials` ranks them
    (a CPU's timing says nothing about a GPU's). Either less its noise where the candidate is
    at risk (near the memory limit, offloading to host memory not checked)."""
    from autoshard.study.storage import measured_per_rank  # optuna: only when a study runs

    tokens = plan.workload.seq_len is not None
    unit = "tokens/s" if tokens else "samples/s"
    hardware = plan.hardware
    checked = hardware.host_memory is not None
    risk = (
        "less its noise where the measured peak leaves under 5% of the usable memory or the "
        "candidate offloads to host memory not checked: the decision passes over those for a "
        "tied one without the risk, and optuna's best trial is the recommended one"
    )
    if hardware.backend == "gloo" or torch.cuda.is_available():

        def measured(result: TrialResult) -> float:
            usable = hardware.usable_gpu_memory
            return objective_value(trial_contender(result, usable, host_memory_checked=checked))

        return (
            f"measured {unit} per GPU",
            measured,
            f"measured {unit} of one rank (the decision's order: the fastest measured that "
            f"fits), {risk}",
        )
    by_label = {e.candidate.label(): e for e in plan.estimates}
    gpu = hardware.gpu or next(
        (e.speed.gpu for e in plan.estimates if e.speed is not None and e.speed.gpu), "GPU"
    )

    def predicted(result: TrialResult) -> float:
        e = by_label.get(result.candidate.label())
        if e is None or e.speed is None:
            return measured_per_rank(result)
        value = objective_value(estimate_contender(e, host_memory_checked=checked))
        # the contender's samples/s are all ranks' (its tokens/s, one GPU's)
        return value if e.speed.tokens_per_s_per_gpu else value / hardware.world_size

    return (
        f"predicted {unit} per GPU ({gpu})",
        predicted,
        f"predicted {unit} per GPU on {hardware.nodes} x {hardware.gpus_per_node} {gpu}: the "
        "trials ran on CPU processes, which checked that each configuration builds, trains and "
        "fits; their timings (user attribute autoshard_result) say nothing about the GPUs, so "
        f"the decision ranks by this prediction, as the study does; {risk}",
    )


def reorder_remaining(
    queue: Sequence[MemoryEstimate],
    done: Sequence[TrialResult],
    plan: Plan,
) -> tuple[list[MemoryEstimate], Calibration[SpeedFactors] | None]:
    """The untried candidates in the order to try them after the trials ``done``: the step-time
    model calibrated on the measured ones, fastest predicted first
    (:func:`autoshard.predict.calibrate.reorder_untried`), predicted ties first and each recipe
    switch with its twin (:func:`autoshard.study.order.study_order`).

    Only when the trials run on the kind of device planned for: CPU processes standing in for
    GPUs say nothing about the GPUs' speed (nor about a switch's), so their order stays the
    uncalibrated model's."""
    on_planned = plan.hardware.backend == "gloo" or torch.cuda.is_available()
    if not on_planned or speed_basis(plan.hardware, done) == "model":
        return list(queue), None
    if not any(r.status is TrialStatus.OK for r in done):
        return study_order(queue, done), None
    order, calibration = reorder_untried(queue, done, plan.speed.predict, plan.speed.prior)
    return study_order(order, done), calibration


@contextmanager
def _worker_files(out_dir: Path) -> Iterator[None]:
    """The worker group's requests, results and logs live in out_dir/workers: a disk that fills
    or a folder that goes away mid-study is one line (the trial that was running had not
    finished: the next run tries it again)."""
    try:
        yield
    except OSError as exc:
        raise StorageError(
            f"{out_dir / 'workers'}: {exc.strerror or exc} while running a trial; free space or "
            "fix the folder, then run the same command again to resume"
        ) from None


def _decide(
    plan: Plan,
    out_dir: Path,
    results: Sequence[TrialResult],
    tried_with: dict[str, MemoryEstimate],
    factors: dict[str, SpeedFactors],
) -> Recommendation:
    """The decision on ``results``; where nothing ran, its report all the same (what ran and
    why it failed), then the one line that says so."""
    try:
        return decide_from_trials(plan, results, tried_with, factors)
    except TrialsFailedError as exc:
        write_failure(plan, out_dir, results, tried_with, str(exc))
        raise


def write_failure(
    plan: Plan,
    out_dir: Path,
    results: Sequence[TrialResult],
    tried_with: dict[str, MemoryEstimate],
    error: str,
) -> None:
    """report.json and report.html of a study in which no configuration ran; a full disk or a
    lost folder leaves the study's own error to be said."""
    estimates = [tried_with.get(e.candidate.label(), e) for e in plan.estimates]
    with contextlib.suppress(OSError):
        write_failure_report(
            out_dir, target=plan.profile.target, params=plan.profile.total_params,
            hardware=plan.hardware, estimates=estimates, trials=results, error=error,
        )  # fmt: skip


def write_outputs(rec: Decision, out_dir: Path, results: Sequence[TrialResult]) -> None:
    """recommendation.json and the reports; a full disk or a lost folder is one line."""
    try:
        write_text_atomically(out_dir / RECOMMENDATION_FILE, rec.model_dump_json(indent=2))
        write_report(rec, out_dir, list(results))
    except OSError as exc:
        raise StorageError(
            f"{out_dir}: cannot write the recommendation and reports ({exc.strerror or exc}); "
            "the trials are recorded: free space or fix the folder, then run the same command "
            "again to write them"
        ) from None
