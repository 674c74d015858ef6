"""The tuning study: estimate every candidate, try the promising ones for real, pick the fastest.

This is the only module that imports optuna. One optuna trial per candidate (its label is the
single categorical parameter), so any optuna storage holds the whole study: a SQLite file in the
output folder by default, or ``--storage`` (PostgreSQL for a study shared by several machines).

The order is the estimator's: candidates predicted not to fit are never launched (recorded as
PRUNED with the estimate's reason); the rest are tried fastest-expected first, and a candidate is
skipped when a measured one dominates it:
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
from autoshard.plan import Plan, decide_from_trials, throughput
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

_CKPT_LEVEL = {Checkpointing.NONE: 0, Checkpointing.EVERY_K: 1, Checkpointing.ALL: 2}


def dominated_by(candidate: Candidate, done: Sequence[TrialResult]) -> TrialResult | None:
    """A finished trial that makes trying ``candidate`` pointless (see the module docstring)."""
    for r in done:
        o = r.candidate
        same = (
            o.engine == candidate.engine
            and o.precision == candidate.precision
            and o.sharding == candidate.sharding
            and o.hybrid_mesh == candidate.hybrid_mesh
        )
        if not same:
            continue
        saves_less = (
            _CKPT_LEVEL[o.checkpointing] <= _CKPT_LEVEL[candidate.checkpointing]
            and o.cpu_offload <= candidate.cpu_offload
        )
        same_batch = o.micro_batch_size == candidate.micro_batch_size
        if r.status is TrialStatus.OK and saves_less and same_batch and o != candidate:
            return r
        saves_more = (
            _CKPT_LEVEL[o.checkpointing] >= _CKPT_LEVEL[candidate.checkpointing]
            and o.cpu_offload >= candidate.cpu_offload
        )
        if (
            r.status is TrialStatus.OOM
            and saves_more
            and o.micro_batch_size <= candidate.micro_batch_size
        ):
            return r
    return None


def study_name(plan: Plan) -> str:
    """The same inputs give the same study name, so that the study resumes."""
    request = plan.request
    key = json.dumps(
        [request.target.model_dump(mode="json"), request.hardware.model_dump(mode="json"),
         plan.workload.model_dump(mode="json"), request.options.model_dump(mode="json")],
        sort_keys=True,
    )  # fmt: skip
    return "autoshard-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def trial_order(plan: Plan, device: str) -> list[MemoryEstimate]:
    """The order in which the study tries the candidates of ``plan`` on workers of ``device``:
    fitting ones first, the most promising first."""
    return rank_candidates(plan.estimates, device=device)


def run_study(plan: Plan, options: TuneOptions | None = None) -> Recommendation:
    """Run (or resume) the study of ``plan`` and return the fastest configuration that fits
    (:func:`autoshard.plan.decide_from_trials`)."""
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
    with group:
        for estimate in ranked:
            label = estimate.candidate.label()
            if label in done:
                continue
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
                )
                launched += 1
                trial.set_user_attr(RESULT_ATTR, result.model_dump_json())
                trial.set_user_attr("estimate", estimate.model_dump_json())
                if result.status is TrialStatus.OK:
                    study.tell(trial, throughput(result))
                else:
                    study.tell(trial, state=TrialState.FAIL)
            done[label] = result
            with log.open("a") as fh:
                fh.write(result.model_dump_json() + "\n")
            emit(
                ProgressEvent.DONE,
                Scored(candidate=estimate.candidate, estimate=estimate, trial=result),
            )

    rec = decide_from_trials(plan, list(done.values()))
    (out_dir / "recommendation.json").write_text(rec.model_dump_json(indent=2))
    write_report(rec, out_dir, list(done.values()))
    return rec


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
