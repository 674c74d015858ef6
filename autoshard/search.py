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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import optuna
import torch
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from autoshard.analyze import analyze_target
from autoshard.config import Candidate, Checkpointing, Engine, Hardware, Precision, WorkloadSpec
from autoshard.measure import (
    DEFAULT_MAX_SECONDS,
    DEFAULT_MAX_STEPS,
    DEFAULT_TARGET_SPREAD,
    compare,
    is_tie,
    rank_trials,
    speed_basis,
    spread_of,
    trials_checked_line,
)
from autoshard.predict.activations import precisions_of, profile_activations
from autoshard.predict.analytic import estimate_all
from autoshard.predict.calibrate import Calibration, SpeedModel, order_by_speed, reorder_untried
from autoshard.predict.speed import SpeedFactors
from autoshard.results import (
    MemoryEstimate,
    ModelProfile,
    Recommendation,
    Scored,
    TrialResult,
    TrialStatus,
)
from autoshard.space import enumerate_candidates, rank_candidates, wrap_reason
from autoshard.target.resolve import TargetSpec
from autoshard.trials.group import WorkerGroup
from autoshard.ui.files import write_report
from autoshard.units import format_bytes

RESULT_ATTR = "autoshard_result"
# What a study leaves in its output folder (besides study.db and the workers' logs).
STUDY_FILES = (
    "trials.jsonl", "recommendation.json", "report.json", "report.html", "lightning.yaml",
    "accelerate.yaml",
)  # fmt: skip
DEFAULT_TRIALS = 12

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


@dataclass
class TuneOptions:
    """How to run the study (what to plan for is Hardware and WorkloadSpec).

    >>> from autoshard import TuneOptions
    >>> options = TuneOptions(out_dir="runs/gpt-1b", n_trials=8, trial_timeout=120)
    >>> options.out_dir, options.storage is None  # the study goes to runs/gpt-1b/study.db
    (PosixPath('runs/gpt-1b'), True)
    """

    out_dir: Path = Path("autoshard-out")
    storage: str | None = None
    n_trials: int = DEFAULT_TRIALS
    engine: Engine = Engine.FSDP1
    precisions: tuple[Precision, ...] | None = None
    micro_batch_sizes: tuple[int, ...] | None = None
    nproc: int | None = None
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    trial_timeout: float = 300.0
    warmup: int = 2
    steps: int = 3  # the minimum timed steps; more until the spread is met
    target_spread: float = DEFAULT_TARGET_SPREAD
    max_steps: int = DEFAULT_MAX_STEPS
    max_seconds: float = DEFAULT_MAX_SECONDS
    memory_cap: int | None = None
    skip_dominated: bool = True  # False runs every fitting candidate (the full grid)
    on_event: Callable[[str, Scored], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)  # a str from a script or notebook works too


def study_name(
    target: TargetSpec, hardware: Hardware, workload: WorkloadSpec, engine: Engine
) -> str:
    """The same command gives the same study name, so that it resumes."""
    key = json.dumps(
        [target.model_dump(mode="json"), hardware.model_dump(mode="json"),
         workload.model_dump(mode="json"), engine.value],
        sort_keys=True,
    )  # fmt: skip
    return "autoshard-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def tune(
    target: TargetSpec,
    hardware: Hardware,
    workload: WorkloadSpec,
    options: TuneOptions | None = None,
) -> Recommendation:
    """Run (or resume) the study and return the fastest configuration that fits.

    Real FSDP trials in a worker group (2 gloo CPU processes here; about 20 s):

    >>> import tempfile
    >>> from autoshard import Hardware, TargetSpec, TuneOptions, WorkloadSpec, tune
    >>> rec = tune(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}),
    ...     Hardware(gpus_per_node=2, gpu_memory=2 * 2**30, backend="gloo"),
    ...     WorkloadSpec(seq_len=64),
    ...     TuneOptions(out_dir=tempfile.mkdtemp(), n_trials=2, warmup=1, steps=2),
    ... )
    >>> rec.basis, rec.chosen.trial.status.value, rec.chosen.trial.world_size
    ('trials', 'ok', 2)
    """
    opts = options or TuneOptions()
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    profile, built = analyze_target(target)
    candidates = enumerate_candidates(
        profile,
        hardware,
        workload,
        engine=opts.engine,
        precisions=opts.precisions,
        micro_batch_sizes=opts.micro_batch_sizes,
    )
    activations = profile_activations(
        built.model, profile, workload, batch=built.batch, precisions=precisions_of(candidates)
    )
    group = WorkerGroup(
        target,
        log_dir=opts.out_dir / "workers",
        nproc=opts.nproc,
        nnodes=opts.nnodes,
        rdzv_endpoint=opts.rdzv_endpoint,
        trial_timeout=opts.trial_timeout,
    )  # launched lazily, by the first trial
    speed = SpeedModel.build(profile, built.model, hardware, workload, batch=built.batch)
    estimates = speed.attach(
        estimate_all(profile, candidates, hardware, workload, activations=activations)
    )
    ranked = order_by_speed(rank_candidates(estimates, device=group.device))
    by_label = {e.candidate.label(): e for e in ranked}
    # Sorted, so that the distribution is the same whatever the order of trials (resuming).
    distribution = CategoricalDistribution(sorted(by_label))

    optuna.logging.set_verbosity(logging.WARNING)
    storage = opts.storage or f"sqlite:///{(opts.out_dir / 'study.db').resolve()}"
    study = optuna.create_study(
        study_name=study_name(target, hardware, workload, opts.engine),
        storage=storage,
        direction="maximize",
        load_if_exists=True,
    )
    _fail_stale_running(study)
    done = _finished_results(study)
    emit = opts.on_event or (lambda kind, scored: None)
    for result in done.values():
        emit(
            "resumed",
            Scored(
                candidate=result.candidate,
                estimate=by_label.get(result.candidate.label()),
                trial=result,
            ),
        )

    log = opts.out_dir / "trials.jsonl"
    cap = opts.memory_cap if opts.memory_cap is not None else hardware.usable_gpu_memory
    launched = sum(1 for r in done.values() if r.status is not TrialStatus.PRUNED)
    queue = [e for e in ranked if e.candidate.label() not in done]
    queue, _ = reorder_remaining(queue, list(done.values()), speed, hardware)  # resumed trials
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
                if launched >= opts.n_trials:
                    continue
                if opts.skip_dominated and dominated_by(estimate.candidate, list(done.values())):
                    continue
                emit("start", Scored(candidate=estimate.candidate, estimate=estimate))
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
                    study.tell(trial, _throughput(result))
                else:
                    study.tell(trial, state=TrialState.FAIL)
            done[label] = result
            by_label[label] = estimate  # with the prediction it was tried with
            with log.open("a") as fh:
                fh.write(result.model_dump_json() + "\n")
            emit("done", Scored(candidate=estimate.candidate, estimate=estimate, trial=result))
            if result.status is TrialStatus.OK:
                queue, _ = reorder_remaining(queue, list(done.values()), speed, hardware)

    rec = recommend_from_trials(
        profile, hardware, workload, list(by_label.values()), list(done.values())
    )
    (opts.out_dir / "recommendation.json").write_text(rec.model_dump_json(indent=2))
    write_report(rec, opts.out_dir, list(done.values()))
    return rec


def reorder_remaining(
    queue: Sequence[MemoryEstimate],
    done: Sequence[TrialResult],
    speed: SpeedModel,
    hardware: Hardware,
) -> tuple[list[MemoryEstimate], Calibration[SpeedFactors] | None]:
    """The untried candidates in the order to try them after the trials ``done``: the step-time
    model calibrated on the measured ones, fastest predicted first
    (:func:`autoshard.predict.calibrate.reorder_untried`).

    Only when the trials ran on the kind of device planned for: CPU processes standing in for
    GPUs say nothing about the GPUs' speed, so their order stays the uncalibrated model's."""
    if speed_basis(hardware, done) == "model" or not any(r.status is TrialStatus.OK for r in done):
        return list(queue), None
    return reorder_untried(queue, done, speed.predict, speed.prior)


def _throughput(result: TrialResult) -> float:
    return float(result.tokens_per_s or result.samples_per_s or 0.0)


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


def recommend_from_trials(
    profile: ModelProfile,
    hardware: Hardware,
    workload: WorkloadSpec,
    estimates: Sequence[MemoryEstimate],
    results: Sequence[TrialResult],
) -> Recommendation:
    """The best configuration that ran; every other trial as a runner-up or ruled out.

    Which is best depends on where the trials ran (:func:`autoshard.measure.speed_basis`): on the
    planned hardware, the fastest measured, a tie within noise going to more headroom
    (:func:`autoshard.measure.rank_trials`); on CPU processes while planning for GPUs, the
    trials only show that a configuration builds, trains and fits, and the fastest of those
    predicted by the speed model for the planned GPUs wins.
    """
    from autoshard.errors import AutoshardError

    by_label = {e.candidate.label(): e for e in estimates}
    if not any(r.status is TrialStatus.OK for r in results):
        reasons = "; ".join(sorted({f"{r.status.value}: {r.error}" for r in results})[:3])
        raise AutoshardError(
            f"no configuration ran successfully ({len(results)} tried or ruled out: {reasons}); "
            "see the worker logs in the output folder"
        )

    def scored(r: TrialResult) -> Scored:
        return Scored(candidate=r.candidate, estimate=by_label.get(r.candidate.label()), trial=r)

    predicted = any(_predicted_rate(r, by_label) for r in results if r.status is TrialStatus.OK)
    if speed_basis(hardware, results) == "model" and predicted:
        ok = rank_by_prediction(results, by_label)
        why = explain_by_prediction(ok, by_label, hardware, profile)
    else:
        ok = rank_trials(results)
        why = explain(ok[0], ok, profile)
    failed = [r for r in results if r.status is not TrialStatus.OK]
    return Recommendation(
        profile=profile,
        hardware=hardware,
        workload=workload,
        chosen=scored(ok[0]),
        runners_up=tuple(scored(r) for r in ok[1:]),  # all of them: the report lists every trial
        ruled_out=tuple(scored(r) for r in failed),
        basis="trials",
        reasons=tuple(why),
        versions={"autoshard": version("autoshard"), "torch": torch.__version__},
    )


_EXPLAINED = ("sharding", "checkpointing", "cpu_offload", "precision", "micro_batch_size")


def _show(value: object) -> str:
    return str(getattr(value, "value", value))


def _differences(chosen: Candidate, other: Candidate) -> list[str]:
    """The explained settings in which ``other`` differs from ``chosen``, as name=value."""
    diff = [
        f"{name}={_show(getattr(other, name))}"
        for name in _EXPLAINED
        if getattr(other, name) != getattr(chosen, name)
    ]
    if (other.wrap_classes, other.min_num_params) != (chosen.wrap_classes, chosen.min_num_params):
        diff.append(
            "auto_wrap_policy="
            + (
                "none (one unit)"
                if other.one_unit
                else ",".join(c.rsplit(".", 1)[-1] for c in other.wrap_classes)
                or f"size>={other.min_num_params:,}"
            )
        )
    return diff


def explain(best: TrialResult, ok: Sequence[TrialResult], profile: ModelProfile) -> list[str]:
    """One line per chosen setting, with the measurement behind it. A difference within the
    two trials' noise is called a tie, never a win (:func:`autoshard.measure.compare`)."""
    c = best.candidate
    unit = "tokens" if best.tokens_per_s else "samples"
    measured = (
        f"{best.step_time or 0:.3f} s/step (±{spread_of(best):.0%}), {_throughput(best):,.0f} "
        f"{unit}/s on {best.world_size} {best.device} ranks"
    )
    fastest = max(ok, key=_throughput)
    tied = [r for r in ok if r is not fastest and is_tie(fastest, r)]
    if fastest is best and not tied:
        first = f"fastest of {len(ok)} measured configurations: {measured}"
    else:
        noise = spread_of(fastest) + max(spread_of(r) for r in [best, *tied])
        first = (
            f"tie within noise (±{noise:.0%}) between {len(tied) + 1} of {len(ok)} measured "
            f"configurations, chosen by headroom (peak {format_bytes(best.max_allocated or 0)}): "
            f"{measured}"
        )
    lines = [first, wrap_reason(c, profile)]
    for r in ok:
        if r is best:
            continue
        diff = _differences(c, r.candidate)
        if len(diff) != 1:
            continue
        outcome = compare(best, r)
        if outcome.tie:
            lines.append(f"{diff[0]}: tie within noise (±{outcome.noise:.0%})")
        elif outcome.winner is best:
            lines.append(f"{diff[0]} measured {outcome.ratio:.2f}x slower")
    return lines


# ---------------------------------------------------------------------------------------------
# CPU trials for GPUs: the trials check, the model ranks
# ---------------------------------------------------------------------------------------------


def _predicted_rate(r: TrialResult, by_label: dict[str, MemoryEstimate]) -> float | None:
    e = by_label.get(r.candidate.label())
    return e.speed.samples_per_s if e is not None and e.speed is not None else None


def rank_by_prediction(
    results: Sequence[TrialResult], by_label: dict[str, MemoryEstimate]
) -> list[TrialResult]:
    """Successful trials, the fastest predicted first (equal predictions: more measured
    headroom first); trials without a prediction last, by measured throughput."""
    ok = [r for r in results if r.status is TrialStatus.OK]
    return sorted(
        ok,
        key=lambda r: (
            _predicted_rate(r, by_label) is not None,
            _predicted_rate(r, by_label) or _throughput(r),
            -(r.max_allocated or 0),
        ),
        reverse=True,
    )


def explain_by_prediction(
    ok: Sequence[TrialResult],
    by_label: dict[str, MemoryEstimate],
    hardware: Hardware,
    profile: ModelProfile,
) -> list[str]:
    """Why the chosen one, when CPU trials checked the configurations and the model ranked."""
    best = ok[0]
    rate = _predicted_rate(best, by_label)
    speed = by_label[best.candidate.label()].speed if rate is not None else None
    lines = [trials_checked_line(hardware, speed.gpu if speed else None)]
    if speed is not None:
        per_gpu = (
            f", {speed.tokens_per_s_per_gpu:,.0f} tokens/s per GPU"
            if speed.tokens_per_s_per_gpu
            else ""
        )
        mfu = f", MFU {speed.mfu:.0%}" if speed.mfu else ""
        lines.append(
            f"fastest predicted of {len(ok)} configurations that ran: "
            f"{speed.step_time_s:.3f} s/step{per_gpu}{mfu}"
        )
    lines.append(wrap_reason(best.candidate, profile))
    for r in ok[1:]:
        diff = _differences(best.candidate, r.candidate)
        other = _predicted_rate(r, by_label)
        if len(diff) == 1 and rate and other:
            lines.append(f"{diff[0]} predicted {rate / other:.2f}x slower")
    return lines
