"""What failed trials teach about the candidates not tried yet.

Running out of memory is the estimator's and dominance's business
(:func:`autoshard.study.dominance.dominated_by`: a larger micro-batch of a configuration that
ran out of memory would too). This module reads the other failures that count against a
configuration, errors and timeouts (:func:`autoshard.study.causes.counts_against`: a failure
from outside the model, retried, a trial that started with an earlier trial's memory, and a
diverged loss, the model's step, teach nothing):

1. A failure rules out the same configuration at a larger micro-batch (a model that raises or
   hangs at micro-batch 4 does so at 8).
2. Failures with the same error (the message with its numbers blanked out) on several
   configurations: the settings they all share are taken as the cause ("the failing property",
   e.g. precision=bf16-mixed, or micro-batch >= 4). The untried candidates that have all of
   them are skipped, unless a configuration that has all of them ran fine. When the failing
   configurations share no setting and none has run fine, no candidate can avoid the error: the
   study stops with it in one line (:class:`~autoshard.errors.TrialsFailedError`).
3. While nothing has run fine, the next trial is a probe: the untried candidate with the fewest
   of the settings suspected so far (those of the latest failure, or those its error's failures
   all share). If it fails the same way, rule 2 narrows the suspects, or finds none and stops
   the study: an error that every configuration raises stops it after two trials, not after
   every one allowed.

Only the settings that differ among the candidates count: settings every candidate shares
cannot be avoided by choosing another.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from autoshard.config import Candidate
from autoshard.errors import TrialsFailedError
from autoshard.results import TrialResult, TrialStatus
from autoshard.study.causes import CAUSES, Cause, cause_of, counts_against

_TEACHES = (TrialStatus.ERROR, TrialStatus.TIMEOUT)
MBS = "micro_batch_size"


@dataclass
class Lessons:
    """What the failures so far rule out, and whom the next trial should least resemble."""

    ruled_out: dict[str, str] = field(default_factory=dict)  # label -> why
    # The settings suspected (varying ones, and a least micro-batch): the next trial should
    # have as few of them as it can. None: no probe (something ran fine, or nothing failed).
    suspects: tuple[dict[str, str], int | None] | None = None


def properties(candidate: Candidate) -> dict[str, str]:
    """A candidate's settings as comparable, readable values (micro-batch included)."""
    c = candidate
    d = c.model_dump(mode="json")
    for name in ("sharding", "hybrid_mesh", "checkpointing", "checkpoint_every",
                 "checkpoint_classes", "wrap_classes", "min_num_params"):  # fmt: skip
        d.pop(name)
    props = {name: str(value) for name, value in d.items()}
    props["sharding"] = c.sharding.value + (
        f" {c.hybrid_mesh[0]}x{c.hybrid_mesh[1]}" if c.hybrid_mesh else ""
    )
    every_k = c.checkpointing.value == "every_k"
    props["checkpointing"] = f"every {c.checkpoint_every}" if every_k else c.checkpointing.value
    props["wrap"] = (
        ",".join(c.wrap_classes)
        if c.wrap_classes
        else (f">={c.min_num_params} params" if c.min_num_params else "none")
    )
    return props


def signature(result: TrialResult) -> str:
    """The failure with its numbers blanked out: the same error at another step, rank, address
    or size is the same error. Every hang is the same failure: its message's detail is whatever
    the workers' log said last (an earlier trial's error, a warning), not why it hung."""
    if result.status is TrialStatus.TIMEOUT:
        return TrialStatus.TIMEOUT.value
    return f"{result.status.value}: {cause(result.error or '')[:240]}"


def cause(error: str) -> str:
    """An error's cause, normalised: which rank reported it, the worker group's wording around
    it, paths (a control folder per launch), addresses and numbers are left out.

    >>> a = "rank 1: SystemExit: exit code 2 (error: unrecognized arguments: /x/group-1-ab12cd)"
    >>> cause(a) == cause(a.replace("rank 1", "rank 0").replace("1-ab12cd", "3-ff00aa"))
    True
    """
    text = error.lower()
    text = re.sub(r"^workers exited: (rank|a worker)[^:]*: ", "", text)
    text = re.sub(r"\brank \d+:\s*", "", text)
    text = re.sub(r"\S*/\S*", "<path>", text)
    # a hex word may be a decimal's whole part: "3.5 gib" is one number, "#", not "#.#"
    text = re.sub(r"0x[0-9a-f]+|\b[0-9a-f]*\d[0-9a-f]*\b(\.\d+)?|\d+(\.\d+)?", "#", text)
    return " ".join(text.split())


def teaches(result: TrialResult) -> bool:
    return result.status in _TEACHES and counts_against(result)


class _Space:
    """The candidates, and the settings in which they differ."""

    def __init__(self, candidates: Sequence[Candidate]) -> None:
        self.candidates = list(candidates)
        self.props = {c.label(): properties(c) for c in self.candidates}
        names: set[str] = set()
        for p in self.props.values():
            names |= p.keys()
        self.varying = sorted(
            n for n in names - {MBS} if len({p.get(n) for p in self.props.values()}) > 1
        )
        self.min_mbs = min((c.micro_batch_size for c in self.candidates), default=1)

    def of(self, c: Candidate) -> dict[str, str]:
        return self.props.get(c.label()) or properties(c)

    def shared(self, group: Iterable[Candidate]) -> tuple[dict[str, str], int | None]:
        """The settings every member of ``group`` has (among those that vary), and the least
        micro-batch of the group when it is a restriction (more than the smallest candidate's)."""
        members = list(group)
        first = self.of(members[0])
        same = {
            n: first[n] for n in self.varying if all(self.of(m).get(n) == first[n] for m in members)
        }
        least = min(m.micro_batch_size for m in members)
        return same, (least if least > self.min_mbs else None)

    def has(self, c: Candidate, same: dict[str, str], least: int | None) -> bool:
        props = self.of(c)
        return all(props.get(n) == v for n, v in same.items()) and (
            least is None or c.micro_batch_size >= least
        )

    def larger_batch_of(self, c: Candidate, failed: Candidate) -> bool:
        """``c`` is ``failed`` with a larger micro-batch."""
        if c.micro_batch_size <= failed.micro_batch_size:
            return False
        a, b = self.of(c), self.of(failed)
        return all(a.get(n) == b.get(n) for n in a.keys() | b.keys() if n != MBS)


def describe(same: dict[str, str], least: int | None) -> str:
    parts = [f"{n}={v}" for n, v in same.items()]
    if least is not None:
        parts.append(f"micro-batch >= {least}")
    return ", ".join(parts)


def learn(
    candidates: Sequence[Candidate],
    settled: Sequence[TrialResult],
    untried: Iterable[str],
) -> Lessons:
    """What ``settled`` results teach about the ``untried`` candidate labels; raises
    TrialsFailedError when no candidate can avoid an error (rule 2 of the module docstring).

    >>> from autoshard import Candidate, TrialResult
    >>> cands = [Candidate(precision=p, micro_batch_size=m)
    ...          for p in ("bf16-mixed", "32-true") for m in (1, 2, 4)]
    >>> failed = TrialResult(candidate=cands[1], status="error", error="RuntimeError: bad shape")
    >>> sorted(learn(cands, [failed], [c.label() for c in cands[2:]]).ruled_out)
    ['fsdp1 FULL_SHARD bf16-mixed nowrap mbs4']
    """
    space = _Space(candidates)
    todo = set(untried)
    lessons = Lessons()
    failures = [r for r in settled if teaches(r)]
    fine = [r for r in settled if r.status is TrialStatus.OK]

    # 1. the same configuration at a larger micro-batch
    for f in failures:
        for c in space.candidates:
            label = c.label()
            if label in todo and space.larger_batch_of(c, f.candidate):
                lessons.ruled_out.setdefault(
                    label,
                    f"{f.candidate.label()} failed ({_short(f)}): the same configuration with a "
                    "larger micro-batch would too",
                )

    # 2. the same error on several configurations
    groups: dict[str, list[TrialResult]] = {}
    for f in failures:
        groups.setdefault(signature(f), []).append(f)
    for group in groups.values():
        if len(group) < 2:
            continue
        same, least = space.shared(f.candidate for f in group)
        if any(space.has(r.candidate, same, least) for r in fine):
            continue  # a configuration with all of those settings ran: they are not the cause
        if not same and least is None:
            if fine:
                continue
            a, b = group[0].candidate, group[1].candidate
            raise TrialsFailedError(
                f"every configuration fails the same way: {a.label()} and {b.label()} share no "
                f"setting and both failed with {_short(group[0], 300)}; {advice(group)}"
            )
        why = (
            f"{len(group)} configurations with {describe(same, least)} failed with "
            f"{_short(group[0])}"
        )
        for c in space.candidates:
            if c.label() in todo and space.has(c, same, least):
                lessons.ruled_out.setdefault(c.label(), why)

    # 3. while nothing has run fine, probe away from the latest error's suspects
    if failures and not fine:
        launched = [r for r in settled if r.status.launched]
        latest = max(launched, key=lambda r: r.started_at)
        if teaches(latest):
            lessons.suspects = space.shared(f.candidate for f in groups[signature(latest)])
    return lessons


def advice(failures: Sequence[TrialResult]) -> str:
    """What to do about failures that no configuration avoids, by their cause
    (:data:`autoshard.study.causes.CAUSES`): a timeout may be too short for the model (a large
    one builds and warms up for minutes), running out of memory asks for more memory per
    sample, an error is the model's, a diverged loss its training step, and a failure from
    outside the model (a full disk, a signal) is tried again by the next run."""
    logs = "the workers' logs are in the output folder, under workers/"
    causes = {cause_of(f) for f in failures}
    if len(causes) != 1 or None in causes:
        return f"fix the model or its arguments ({logs})"
    (cause,) = causes
    assert cause is not None
    if cause is Cause.HANG:
        limit = re.search(r"trial timeout ([\d.]+) s", failures[0].error or "")
        given = f" ({limit.group(1)} s)" if limit else ""
        return (
            f"raise --trial-timeout{given} if a trial needs longer (building the model and its "
            f"first steps count); if it does not, the model hangs: {logs}"
        )
    if cause is Cause.OOM:
        return f"each ran out of memory: {CAUSES[cause].advice} ({logs})"
    return CAUSES[cause].advice


def probe_order(
    candidates: Sequence[Candidate],
    eligible: Sequence[Candidate],
    suspects: tuple[dict[str, str], int | None],
) -> list[Candidate]:
    """``eligible`` (in their order of preference), those with the fewest ``suspects`` first."""
    space = _Space(candidates)
    same, least = suspects

    def overlap(c: Candidate) -> int:
        props = space.of(c)
        return sum(props.get(n) == v for n, v in same.items()) + (
            least is not None and c.micro_batch_size >= least
        )

    return sorted(eligible, key=overlap)  # stable: ties keep the order of preference


def _short(result: TrialResult, limit: int = 120) -> str:
    text = " ".join((result.error or "").split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{result.status.value}: {text}" if text else result.status.value
