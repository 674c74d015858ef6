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

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import ValidationError

from autoshard.config import Precision
from autoshard.decide import decide_from_trials
from autoshard.errors import StorageError, StudyNotice, TrialsFailedError
from autoshard.options import TuneOptions
from autoshard.plan import Plan
from autoshard.predict.speed import SpeedFactors
from autoshard.ranking import estimate_contender, objective_value, trial_contender
from autoshard.recommendation import Recommendation
from autoshard.results import MemoryEstimate, TrialResult
from autoshard.study.driver import StudyRun
from autoshard.study.loop import run_trials
from autoshard.study.order import study_order
from autoshard.study.outputs import write_failure, write_outputs
from autoshard.study.settings import StudySettings
from autoshard.trials.group import WorkerGroup

if TYPE_CHECKING:  # optuna is imported where a study runs
    from autoshard.study.storage import StudyStore


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
    hardware = plan.hardware
    with open_store(out_dir, opts.storage, wait=opts.wait, notice=notice) as store:
        # launched lazily, by the first trial
        trial_options = opts.model_copy(
            update={"nproc": opts.nproc or hardware.gpus_per_node, "on_notice": notice}
        )
        group = WorkerGroup(
            plan.request.target, trial_options, log_dir=out_dir / "workers", nnodes=hardware.nodes
        )
        ranked = trial_order(plan)  # the planned hardware's order, wherever trials run
        _open_study(store, plan, opts)
        study = StudyRun(plan, opts, group)
        with _worker_files(out_dir), group:
            results = run_trials(
                store, ranked, study.run, n_trials=opts.trials, hooks=study.hooks(),
                emit=opts.on_event,
            )  # fmt: skip
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
        for c in plan.candidates}), memory_cap=opts.memory_cap,
    ).with_model(
        plan.built.model, plan.built.batch,
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
    from autoshard.study.knobs import measured_per_rank  # optuna: only when a study runs

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
