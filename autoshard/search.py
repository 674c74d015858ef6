"""The tuning study: estimate every candidate, try the promising ones for real, pick the fastest.

One optuna trial per candidate, in any optuna RDB storage: a SQLite file in the output folder by
default, or ``--storage`` (PostgreSQL for a study shared by several drivers). The storage side
(the study's name, ``trials.jsonl``, the folder's lock, claims, resuming, what failures teach)
is :mod:`autoshard.study`; optuna is imported only when a study runs, not by ``import autoshard``.

The order is the estimator's: candidates predicted not to fit are never launched (recorded as
pruned with the estimate's reason); the rest are tried fastest-expected first, and a candidate is
skipped when a measured one dominates it:
- same configuration with less checkpointing / no offload already ran fine: more recompute or
  offload can only cost time, so it cannot be faster;
- same configuration at a smaller micro-batch already ran out of memory: a larger one will too.
Errors and timeouts rule out the candidates that share the failing setting
(:mod:`autoshard.study.lessons`).

Resuming: every finished trial is appended to ``trials.jsonl`` (fsync'd) and then stored in the
study. Running the same command again skips finished candidates; a trial left running by a
killed process is tried again. Changed settings (batch sizes, precisions, hardware, ...) name a
new study: nothing measured under other settings is reused.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import torch

from autoshard.analyze import analyze_target
from autoshard.config import Candidate, Checkpointing, Engine, Hardware, Precision, WorkloadSpec
from autoshard.errors import ConfigError, StorageError, StudyNotice
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
from autoshard.study.loop import run_trials
from autoshard.study.settings import StudySettings
from autoshard.target.resolve import TargetSpec
from autoshard.trials.group import WorkerGroup
from autoshard.ui.files import write_report

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
    wait: bool = False  # another run holds out_dir: wait for it instead of refusing
    on_event: Callable[[str, Scored], None] | None = field(default=None, repr=False)
    # One line for the user (a repaired journal, a rebuilt database, waiting for a lock);
    # default: a StudyNotice warning.
    on_notice: Callable[[str], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)  # a str from a script or notebook works too
        for flag, value, least in (
            ("--trials", self.n_trials, 1),
            ("--steps", self.steps, 1),
            ("--warmup", self.warmup, 0),
        ):
            if value < least:
                raise ConfigError(f"{flag} {value}: give {least} or more")
        if self.trial_timeout <= 0:
            raise ConfigError(f"--trial-timeout {self.trial_timeout:g}: give seconds, more than 0")


def _notice(line: str) -> None:
    warnings.warn(line, StudyNotice, stacklevel=3)


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
    # Storage first (fast): a locked, unwritable or unreachable one fails before the model is
    # analysed. optuna is imported here, where a study runs.
    from autoshard.study.storage import open_store

    notice = opts.on_notice or _notice
    with open_store(opts.out_dir, opts.storage, wait=opts.wait, notice=notice) as store:
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

        settings = StudySettings.of(
            target, hardware, workload, engine=opts.engine, precisions=opts.precisions,
            micro_batch_sizes=opts.micro_batch_sizes, memory_cap=opts.memory_cap,
        )  # fmt: skip
        store.open_study(settings, [c.label() for c in candidates])
        cap = opts.memory_cap if opts.memory_cap is not None else hardware.usable_gpu_memory

        def run(candidate: Candidate) -> TrialResult:
            return group.run(
                candidate, workload, warmup=opts.warmup, steps=opts.steps, memory_cap=cap
            )

        with _worker_files(opts.out_dir), group:
            results = run_trials(
                store,
                ranked,
                run,
                n_trials=opts.n_trials,
                dominated=dominated_by if opts.skip_dominated else None,
                emit=opts.on_event,
            )
        rec = recommend_from_trials(profile, hardware, workload, ranked, results)
        rec = rec.model_copy(update={"study": store.name})
        write_outputs(rec, opts.out_dir, results)
    return rec


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


def write_outputs(rec: Recommendation, out_dir: Path, results: Sequence[TrialResult]) -> None:
    """recommendation.json and the reports; a full disk or a lost folder is one line."""
    try:
        (out_dir / "recommendation.json").write_text(rec.model_dump_json(indent=2))
        write_report(rec, out_dir, list(results))
    except OSError as exc:
        raise StorageError(
            f"{out_dir}: cannot write the recommendation and reports ({exc.strerror or exc}); "
            "the trials are recorded: free space or fix the folder, then run the same command "
            "again to write them"
        ) from None


def _throughput(result: TrialResult) -> float:
    return float(result.tokens_per_s or result.samples_per_s or 0.0)


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
        raise AutoshardError(nothing_ran(results))

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


def nothing_ran(results: Sequence[TrialResult]) -> str:
    """One line when no trial ran fine: the commonest failures of the trials that ran first
    (a skipped or pruned candidate's reason repeats them)."""
    from collections import Counter

    from autoshard.study.lessons import signature

    ran = [r for r in results if r.status.launched]
    shown = {signature(r): r for r in ran}
    counts = Counter(signature(r) for r in ran).most_common(2)
    failures = "; ".join(
        f"{n} x {shown[sig].status.value}: {' '.join((shown[sig].error or '').split())[:160]}"
        for sig, n in counts
    )
    rest = len(results) - len(ran)
    if not ran:
        first = " ".join((results[0].error or "").split())[:160] if results else ""
        return f"no configuration could run: all {len(results)} candidates were ruled out" + (
            f" ({first})" if first else ""
        )
    return (
        f"no configuration ran successfully: {len(ran)} trials failed ({failures})"
        + (f", {rest} more candidates ruled out" if rest else "")
        + "; see the worker logs in the output folder, under workers/"
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
