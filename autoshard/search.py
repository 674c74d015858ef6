"""The tuning study: estimate every candidate, try the promising ones for real, pick the fastest.

This is the only module that imports optuna. One optuna trial per candidate (its label is the
single categorical parameter), so any optuna storage holds the whole study: a SQLite file in the
output folder by default, or ``--storage`` (PostgreSQL for a study shared by several machines).

The order is the estimator's: candidates predicted not to fit are never launched (recorded as
PRUNED with the estimate's reason); the rest are tried fastest-predicted first (the step-time
model, :mod:`autoshard.predict.speed`), and after each successful trial the model is calibrated
on the measurements and the untried candidates re-ranked (:func:`reorder_remaining`; not when
CPU processes stand in for GPUs). A candidate is skipped when a measured one dominates it:
- same configuration with less checkpointing / no offload already ran fine: more recompute or
  offload can only cost time, so it cannot be faster;
- same configuration at a smaller micro-batch already ran out of memory: a larger one will too.

Resuming: every finished trial is in the storage with its full TrialResult, and is appended to
``trials.jsonl`` as soon as it ends. Running the same command again skips finished candidates;
a trial left RUNNING by a killed process is marked FAIL and tried again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from autoshard.config import Candidate, Checkpointing, ProgressEvent, TuneOptions
from autoshard.decide import decide_from_trials
from autoshard.measure import speed_basis, throughput
from autoshard.plan import Plan
from autoshard.predict.calibrate import Calibration, reorder_untried
from autoshard.predict.speed import SpeedFactors
from autoshard.results import MemoryEstimate, Recommendation, Scored, TrialResult, TrialStatus
from autoshard.space import rank_candidates
from autoshard.trials.group import WorkerGroup
from autoshard.ui.files import write_report

RESULT_ATTR = "autoshard_result"
# What a study leaves in its output folder (besides study.db and the workers' logs).
STUDY_FILES = (
    "trials.jsonl", "recommendation.json", "report.json", "report.html", "lightning.yaml",
    "accelerate.yaml",
)  # fmt: skip

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
    return _recompute_share(a) <= _recompute_share(b) and a.cpu_offload <= b.cpu_offload


def dominated_by(candidate: Candidate, done: Sequence[TrialResult]) -> TrialResult | None:
    """A finished trial that makes trying ``candidate`` pointless (see the module docstring).

    Each rule holds everything equal except what it reasons about: checkpointing and offload
    (and, for an OOM, the micro-batch size). A different wrap policy, engine, precision,
    sharding, reshard policy or optimizer implementation is never dominated.
    """
    for r in done:
        o = r.candidate
        if o == candidate:
            continue
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


def trial_order(plan: Plan, device: str) -> list[MemoryEstimate]:
    """The order in which the study tries the candidates of ``plan``: fitting ones first, the
    fastest predicted for the planned hardware first (on CPU workers standing in for GPUs too:
    they check that the most promising configurations build, train and fit)."""
    del device  # the order is the planned hardware's, wherever the trials run
    return rank_candidates(plan.estimates)


def study_name(plan: Plan) -> str:
    """The same inputs give the same study name, so that the study resumes."""
    request = plan.request
    key = json.dumps(
        [request.target.model_dump(mode="json"), request.hardware.model_dump(mode="json"),
         plan.workload.model_dump(mode="json"), request.options.model_dump(mode="json")],
        sort_keys=True,
    )  # fmt: skip
    return "autoshard-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def run_study(plan: Plan, options: TuneOptions | None = None) -> Recommendation:
    """Run (or resume) the study of ``plan`` and return the fastest configuration that fits
    (:func:`autoshard.decide.decide_from_trials`)."""
    opts = options or TuneOptions()
    out_dir = Path(opts.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hardware, workload = plan.hardware, plan.workload
    group = WorkerGroup(
        plan.request.target,
        log_dir=out_dir / "workers",
        nproc=opts.nproc or hardware.gpus_per_node,
        nnodes=hardware.nodes,
        rdzv_endpoint=opts.rdzv_endpoint,
        trial_timeout=opts.trial_timeout,
    )  # launched lazily, by the first trial
    ranked = trial_order(plan, group.device)
    by_label = {e.candidate.label(): e for e in ranked}
    # Sorted, so that the distribution is the same whatever the order of trials (resuming).
    distribution = CategoricalDistribution(sorted(by_label))

    optuna.logging.set_verbosity(logging.WARNING)
    storage = opts.storage or f"sqlite:///{(out_dir / 'study.db').resolve()}"
    study = optuna.create_study(
        study_name=study_name(plan),
        storage=storage,
        direction="maximize",
        load_if_exists=True,
    )
    _fail_stale_running(study)
    done = _finished_results(study)
    emit = opts.on_event or (lambda kind, scored: None)
    for result in done.values():
        emit(
            ProgressEvent.RESUMED,
            Scored(
                candidate=result.candidate,
                estimate=by_label.get(result.candidate.label()),
                trial=result,
            ),
        )

    log = out_dir / "trials.jsonl"
    cap = opts.memory_cap if opts.memory_cap is not None else hardware.usable_gpu_memory
    launched = sum(1 for r in done.values() if r.status is not TrialStatus.PRUNED)
    queue = [e for e in ranked if e.candidate.label() not in done]
    tried_with: dict[str, MemoryEstimate] = {}
    queue, _ = reorder_remaining(queue, list(done.values()), plan)  # resumed trials
    with group:
        while queue:
            estimate = queue.pop(0)
            label = estimate.candidate.label()
            if not estimate.fits:
                result = TrialResult(
                    candidate=estimate.candidate, status=TrialStatus.PRUNED, error=estimate.reason
                )
                _record_pruned(study, distribution, label, result, estimate)
            else:
                if launched >= opts.trials:
                    continue
                if opts.skip_dominated and dominated_by(estimate.candidate, list(done.values())):
                    continue
                emit(ProgressEvent.START, Scored(candidate=estimate.candidate, estimate=estimate))
                study.enqueue_trial({"candidate": label})
                trial = study.ask({"candidate": distribution})
                result = group.run(
                    estimate.candidate,
                    workload,
                    warmup=opts.warmup,
                    steps=opts.steps,
                    memory_cap=cap,
                    target_spread=opts.target_spread,
                    max_steps=opts.max_steps,
                    max_seconds=opts.max_seconds,
                )
                launched += 1
                trial.set_user_attr(RESULT_ATTR, result.model_dump_json())
                trial.set_user_attr("estimate", estimate.model_dump_json())
                if result.status is TrialStatus.OK:
                    study.tell(trial, throughput(result))
                else:
                    study.tell(trial, state=TrialState.FAIL)
            done[label] = result
            tried_with[label] = estimate  # with the prediction it was tried with
            with log.open("a") as fh:
                fh.write(result.model_dump_json() + "\n")
            emit(
                ProgressEvent.DONE,
                Scored(candidate=estimate.candidate, estimate=estimate, trial=result),
            )
            if result.status is TrialStatus.OK:
                queue, _ = reorder_remaining(queue, list(done.values()), plan)

    rec = decide_from_trials(plan, list(done.values()), tried_with)
    (out_dir / "recommendation.json").write_text(rec.model_dump_json(indent=2))
    write_report(rec, out_dir, list(done.values()))
    return rec


def reorder_remaining(
    queue: Sequence[MemoryEstimate],
    done: Sequence[TrialResult],
    plan: Plan,
) -> tuple[list[MemoryEstimate], Calibration[SpeedFactors] | None]:
    """The untried candidates in the order to try them after the trials ``done``: the step-time
    model calibrated on the measured ones, fastest predicted first
    (:func:`autoshard.predict.calibrate.reorder_untried`).

    Only when the trials ran on the kind of device planned for: CPU processes standing in for
    GPUs say nothing about the GPUs' speed, so their order stays the uncalibrated model's."""
    if speed_basis(plan.hardware, done) == "model" or not any(
        r.status is TrialStatus.OK for r in done
    ):
        return list(queue), None
    return reorder_untried(queue, done, plan.speed.predict, plan.speed.prior)


def _record_pruned(
    study: optuna.Study,
    distribution: CategoricalDistribution,
    label: str,
    result: TrialResult,
    estimate: MemoryEstimate,
) -> None:
    study.add_trial(
        optuna.trial.create_trial(
            state=TrialState.PRUNED,
            params={"candidate": label},
            distributions={"candidate": distribution},
            user_attrs={
                RESULT_ATTR: result.model_dump_json(),
                "estimate": estimate.model_dump_json(),
            },
        )
    )


def _fail_stale_running(study: optuna.Study) -> None:
    """A trial still RUNNING when the study opens was left by a killed process: its result was
    never recorded, so it is marked FAIL and its candidate is tried again."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)


def _finished_results(study: optuna.Study) -> dict[str, TrialResult]:
    out: dict[str, TrialResult] = {}
    for t in study.get_trials(deepcopy=False):
        raw = t.user_attrs.get(RESULT_ATTR)
        if raw and t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
            result = TrialResult.model_validate_json(raw)
            out[result.candidate.label()] = result
    return out
