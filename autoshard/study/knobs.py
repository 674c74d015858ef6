"""What optuna-dashboard shows of a study: the candidate as one categorical parameter per knob,
the default objective, the candidates never launched by reason, and the study's note."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution

from autoshard.config import Candidate
from autoshard.results import Decision, TrialResult
from autoshard.study.view import StudyView

KNOBS = ("engine", "sharding", "wrap", "checkpointing", "offload", "precision", "micro_batch",
         "reshard", "compile", "float8")  # fmt: skip


def knobs_of(candidate: Candidate) -> dict[str, Any]:
    """The candidate as optuna parameters, one per knob (see the module docstring).

    >>> from autoshard import Candidate
    >>> knobs_of(Candidate(wrap_classes=("gpt.Block",), checkpointing="every_k",
    ...                    checkpoint_every=2, checkpoint_classes=("gpt.Block",)))["checkpointing"]
    'every_2'
    """
    c = candidate
    mesh = f" {c.hybrid_mesh[0]}x{c.hybrid_mesh[1]}" if c.hybrid_mesh else ""
    wrap = ", ".join(c.wrap_classes) or (
        f"size>={c.min_num_params}" if c.min_num_params else "none"
    )
    checkpointing = c.checkpointing.value
    if checkpointing == "every_k":
        checkpointing = f"every_{c.checkpoint_every}"
    return {
        "engine": c.engine.value, "sharding": c.sharding.value + mesh, "wrap": wrap,
        "checkpointing": checkpointing, "offload": c.cpu_offload,
        "precision": c.precision.value, "micro_batch": c.micro_batch_size,
        "reshard": c.reshard.value, "compile": c.compile, "float8": c.float8,
    }  # fmt: skip


def knob_distributions(candidates: Sequence[Candidate]) -> dict[str, CategoricalDistribution]:
    """One categorical distribution per knob over the values the study's candidates take (the
    same candidates give the same choices: a resumed study's parameters stay compatible)."""
    values: dict[str, set[Any]] = {k: set() for k in KNOBS}
    for c in candidates:
        for k, v in knobs_of(c).items():
            values[k].add(v)
    return {
        k: CategoricalDistribution(sorted(v, key=lambda x: (str(type(x)), x)))
        for k, v in values.items()
    }


def measured_per_rank(result: TrialResult) -> float:
    """The default objective: the trial's measured tokens/s (else samples/s) of one rank."""
    return _throughput(result) / max(result.world_size, 1)


def dashboard_note(study: optuna.Study, number: int | None, label: str, rec: Decision) -> None:
    """The study's note in optuna-dashboard (when it is installed): the recommended trial and
    why, at the top of the study's page."""
    try:
        from optuna_dashboard import save_note
    except ImportError:
        return
    reasons = "\n".join(f"- {r}" for r in rec.reasons[:6])
    save_note(
        study,
        f"## autoshard recommends trial {number}: {label}\n\n(by {rec.basis}; the study's "
        f"user attribute `recommended` has it)\n\n{reasons}\n",
    )


def not_launched_summary(view: StudyView) -> dict[str, Any]:
    """How many candidates were never launched, by what kept them out and why (one line per
    reason): what the dashboard shows instead of a pruned trial for each."""
    from autoshard.ui.report import NEVER_LAUNCHED, grouped_reasons

    out: dict[str, Any] = {}
    kept_out = [r for r in view.settled().values() if not r.status.launched]
    for status, word in NEVER_LAUNCHED.items():
        mine = [r for r in kept_out if r.status is status]
        if mine:
            out[word] = {
                "count": len(mine),
                "reasons": grouped_reasons(r.error or "" for r in mine),
            }
    return out


def _throughput(result: TrialResult) -> float:
    return float(result.tokens_per_s or result.samples_per_s or 0.0)


def recommended(rec: Decision, number: int | None) -> dict[str, Any]:
    """The study's user attribute naming the recommended trial (``number``): its candidate,
    basis and first reasons, and why it is optuna's best trial."""
    return {
        "trial": number,
        "candidate": rec.chosen.candidate.label(),
        "basis": rec.basis,
        "reasons": list(rec.reasons[:3]),
        "best_trial": "the objective is the decision's: the recommended trial is optuna's best "
        "(a rate within the noise of a faster one near the memory limit, or offloading to host "
        "memory not checked, scores that one's rate less its noise)",
    }
