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
from autoshard.predict.activations import precisions_of, profile_activations
from autoshard.predict.analytic import estimate_all
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

RESULT_ATTR = "autoshard_result"
# What a study leaves in its output folder (besides study.db and the workers' logs).
STUDY_FILES = (
    "trials.jsonl", "recommendation.json", "report.json", "report.html", "lightning.yaml",
    "accelerate.yaml",
)  # fmt: skip
DEFAULT_TRIALS = 12

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
    steps: int = 3
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
    estimates = estimate_all(profile, candidates, hardware, workload, activations=activations)
    ranked = rank_candidates(estimates, device=group.device)
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
                )
                launched += 1
                trial.set_user_attr(RESULT_ATTR, result.model_dump_json())
                trial.set_user_attr("estimate", estimate.model_dump_json())
                if result.status is TrialStatus.OK:
                    study.tell(trial, _throughput(result))
                else:
                    study.tell(trial, state=TrialState.FAIL)
            done[label] = result
            with log.open("a") as fh:
                fh.write(result.model_dump_json() + "\n")
            emit("done", Scored(candidate=estimate.candidate, estimate=estimate, trial=result))

    rec = recommend_from_trials(profile, hardware, workload, ranked, list(done.values()))
    (opts.out_dir / "recommendation.json").write_text(rec.model_dump_json(indent=2))
    write_report(rec, opts.out_dir, list(done.values()))
    return rec


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
    """The fastest measured configuration; runners-up; what was ruled out and why."""
    from autoshard.errors import AutoshardError

    by_label = {e.candidate.label(): e for e in estimates}
    ok = sorted((r for r in results if r.status is TrialStatus.OK), key=_throughput, reverse=True)
    if not ok:
        reasons = "; ".join(sorted({f"{r.status.value}: {r.error}" for r in results})[:3])
        raise AutoshardError(
            f"no configuration ran successfully ({len(results)} tried or ruled out: {reasons}); "
            "see the worker logs in the output folder"
        )

    def scored(r: TrialResult) -> Scored:
        return Scored(candidate=r.candidate, estimate=by_label.get(r.candidate.label()), trial=r)

    best = ok[0]
    failed = [r for r in results if r.status is not TrialStatus.OK]
    return Recommendation(
        profile=profile,
        hardware=hardware,
        workload=workload,
        chosen=scored(best),
        runners_up=tuple(scored(r) for r in ok[1:5]),
        ruled_out=tuple(scored(r) for r in failed),
        basis="trials",
        reasons=tuple(explain(best, ok, profile)),
        versions={"autoshard": version("autoshard"), "torch": torch.__version__},
    )


_EXPLAINED = ("sharding", "checkpointing", "cpu_offload", "precision", "micro_batch_size")


def _show(value: object) -> str:
    return str(getattr(value, "value", value))


def explain(best: TrialResult, ok: Sequence[TrialResult], profile: ModelProfile) -> list[str]:
    """One line per chosen setting, with the measurement behind it."""
    c = best.candidate
    lines = [
        f"fastest of {len(ok)} measured configurations: {best.step_time or 0:.3f} s/step, "
        f"{_throughput(best):,.0f} {'tokens' if best.tokens_per_s else 'samples'}/s on "
        f"{best.world_size} {best.device} ranks",
        wrap_reason(c, profile),
    ]
    for r in ok[1:]:
        o = r.candidate
        diff = [
            f"{name}={_show(getattr(o, name))}"
            for name in _EXPLAINED
            if getattr(o, name) != getattr(c, name)
        ]
        if len(diff) == 1:
            lines.append(
                f"{diff[0]} measured {_throughput(best) / max(_throughput(r), 1e-9):.2f}x slower"
            )
    return lines
