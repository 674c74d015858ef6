"""The optuna storage of a study: where it is, who may write it, and how several drivers share it.

A study is an optuna study named by its settings (:mod:`autoshard.study.settings`), one optuna trial
per candidate: one categorical parameter per knob (engine, sharding, wrap, checkpointing, offload,
precision, micro_batch, reshard, compile, float8), so that optuna-dashboard's importance and slice
plots speak of them; the candidate's label and its full :class:`~autoshard.results.TrialResult` as
user attributes, with what it was tried with: the estimate (``estimate``) and the calibrated speed
factors that predicted it (``autoshard_factors``), which a resumed study judges it against. The
objective is named (``set_metric_names``) and is the one the decision ranks by; the recommended
trial is named in the study's user attribute ``recommended``. The storage is SQLite in the output
folder by default, or any ``--storage`` URL: an RDB server (PostgreSQL, MySQL) lets several drivers
on several machines run the trials of one study at once.

Several drivers, one study (optuna's own distributed optimisation, on its RDB storage):
- a driver *claims* its next candidate by creating a RUNNING trial for it; the look at the
  study that decides which candidate is free and the creation of that trial happen under one
  lock of the database (:mod:`autoshard.study.claims`: PostgreSQL's advisory lock, which a
  stopped holder cannot keep; MySQL's ``GET_LOCK``; for SQLite an ``flock`` next to the file),
  so two drivers never claim the same candidate, and ``--trials`` counts every driver's trials
  exactly;
- a running trial carries its driver (host, PID, output folder) and optuna's heartbeat
  (``RDBStorage(heartbeat_interval=...)``, recorded by a thread while the trial runs): a trial
  whose driver is gone (killed, its machine lost) is failed by the next claim
  (``optuna.storages.fail_stale_trials``), immediately when that driver ran on this machine,
  after the grace period otherwise, and its candidate is free again;
- every decision reads every driver's trials from the storage, so every driver that ends
  recommends the same configuration.

A database server that restarts or fails over is reconnected to with back-off, up to a limit
(:class:`~autoshard.study.claims.Reconnecting`). Every failure of the storage or of the output
folder is a one-line
:class:`~autoshard.errors.StorageError` saying what to do; a missing, emptied or corrupt SQLite
file is rebuilt from ``trials.jsonl`` (a corrupt one is moved aside first), never silently
reset.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from optuna.distributions import CategoricalDistribution
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState
from pydantic import ValidationError
from sqlalchemy.engine import make_url

from autoshard.config import Candidate
from autoshard.errors import StorageError
from autoshard.results import Decision, TrialResult, TrialStatus
from autoshard.study.claims import OWNER_ATTR, ClaimLock, Heartbeat, Reconnecting, fail_stale
from autoshard.study.database import (
    DB_NAME,
    check_storage,
    corrupt,
    db_errors,
    default_storage,
    first_line,
    move_aside,
    prepare_out,
)
from autoshard.study.journal import JOURNAL_NAME, Journal
from autoshard.study.knobs import (
    dashboard_note,
    knob_distributions,
    knobs_of,
    measured_per_rank,
    not_launched_summary,
    recommended,
)
from autoshard.study.lock import OutLock
from autoshard.study.settings import StudySettings
from autoshard.study.view import StudyView, Ticket, identity

try:
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

PARAM = "candidate"  # the one parameter of studies written before the knobs (still read)
LABEL_ATTR = "candidate"  # the candidate's label, a user attribute of each trial
OBJECTIVE_ATTR = "objective"
RECOMMENDED_ATTR = "recommended"
RESULT_ATTR = "autoshard_result"
ESTIMATE_ATTR = "estimate"
# The calibrated speed factors the estimate was predicted with (null: the uncalibrated model's);
# absent on trials of an older autoshard and on trials restored from the journal.
FACTORS_ATTR = "autoshard_factors"
# A candidate never launched (predicted not to fit, skipped) is no optuna trial: optuna-dashboard
# would show it as a pruned one. Its result is a system attribute of the study, one per label
# (not shown, read with the trials); the user attribute NOT_LAUNCHED_ATTR counts them by reason.
NOT_LAUNCHED_PREFIX = "autoshard_not_launched:"
NOT_LAUNCHED_ATTR = "not_launched"
SETTINGS_ATTR = "autoshard_settings"
HEARTBEAT_S = 5
GRACE_S = 30  # a driver silent this long is taken for gone


# ---------------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------------


def open_store(
    out_dir: Path | str,
    storage: str | None = None,
    *,
    wait: bool = False,
    notice: Callable[[str], None] = print,
) -> StudyStore:
    """Check and lock the output folder, repair its journal, open the storage (rebuilding a
    corrupt SQLite file). Fast: call it before the model is analysed. Use the store as a
    context manager (it holds the folder's lock)."""
    given = check_storage(storage) if storage else None  # bad input: no folder made
    out = prepare_out(out_dir).resolve()
    url = given or default_storage(out)
    shown = (
        f"--storage {make_url(url).render_as_string(hide_password=True)}"
        if given
        else str(out / DB_NAME)
    )
    lock = OutLock(out, wait=wait, notice=notice)
    lock.acquire()
    claims: ClaimLock | None = None
    try:
        journal = Journal(out / JOURNAL_NAME, notice)
        journal.repair()
        journal.keep_reserve()
        claims = ClaimLock(url, notice)
        # Not tried again: a server that cannot be reached at the start is a wrong URL or a
        # server that is down, said at once; reconnecting is for a study under way.
        with db_errors(shown), claims:
            rdb = _open_rdb(url, shown, notice)
        return StudyStore(out, Database(url, shown, rdb), lock, journal, claims, notice)
    except BaseException:
        if claims is not None:
            claims.close()
        lock.release()
        raise


def _open_rdb(url: str, shown: str, notice: Callable[[str], None]) -> RDBStorage:
    u = make_url(url)
    sqlite = u.get_backend_name() == "sqlite"
    db = Path(u.database) if sqlite and u.database else None
    if db is not None and db.exists() and not os.access(db, os.W_OK):
        raise StorageError(
            f"{shown}: the study database is read-only; make it writable (chmod u+w {db}) or "
            "choose another --out"
        )
    # A server's pooled connections are checked before use: after a restart they are stale.
    kwargs: dict[str, Any] = (
        {"connect_args": {"timeout": 60}} if sqlite else {"pool_pre_ping": True}
    )
    for attempt in (1, 2):
        try:
            with warnings.catch_warnings():
                # optuna marks the heartbeat experimental; its API is the documented one.
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return RDBStorage(
                    url,
                    engine_kwargs=kwargs,
                    heartbeat_interval=HEARTBEAT_S,
                    grace_period=GRACE_S,
                )
        except sqlalchemy.exc.DatabaseError as exc:
            if db is None or attempt == 2 or not corrupt(exc):
                raise
            aside = move_aside(db)
            notice(
                f"{db} is not a readable study database ({first_line(exc)}): moved it to "
                f"{aside.name}; the study is rebuilt from {JOURNAL_NAME}"
            )
        except RuntimeError as exc:  # optuna: the schema needs `optuna storage upgrade`
            raise StorageError(f"{shown}: {first_line(exc)}") from None
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Database:
    """An opened optuna storage: its URL, the URL as messages show it, the storage."""

    url: str
    shown: str
    storage: RDBStorage


class StudyStore:
    """One driver's access to a study's storage and journal (see the module docstring).

    Made by :func:`open_store`; then :meth:`open_study` once the candidates are known; then
    turns of the driver's loop (:mod:`autoshard.study.loop`): ``with store.turn() as view``
    (the claim lock held, stale trials failed, a fresh view of every driver's trials), in which
    :meth:`record` and :meth:`start`; then :meth:`finish` once the trial has run.
    """

    def __init__(
        self,
        out: Path,
        database: Database,
        lock: OutLock,
        journal: Journal,
        claims: ClaimLock,
        notice: Callable[[str], None],
    ) -> None:
        self.out, self.url, self.shown = out, database.url, database.shown
        self.lock, self.journal, self.claims = lock, journal, claims
        self.storage = database.storage
        self.notice = notice
        self.again = Reconnecting(self.shown, claims.backend, notice)
        self.name = ""
        self.study: optuna.Study | None = None
        self.study_id = -1
        self.distribution: CategoricalDistribution | None = None  # studies without knobs
        self.knobs: dict[str, CategoricalDistribution] = {}
        self.candidates: dict[str, Candidate] = {}
        self.objective: Callable[[TrialResult], float] = measured_per_rank
        self.host = socket.gethostname()
        self.token = uuid.uuid4().hex
        self._beat: Heartbeat | None = None
        self._running: Ticket | None = None
        # this run's start: the transient failures of earlier runs are tried again (StudyView)
        self.opened_at = datetime.now(timezone.utc)

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> StudyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._running is not None:
            self.abandon(self._running)
        self.claims.close()
        with contextlib.suppress(Exception):
            self.storage.engine.dispose()
        self.lock.release()

    def open_study(
        self,
        settings: StudySettings,
        labels: Sequence[str],
        *,
        candidates: Sequence[Candidate] = (),
        objective: Callable[[TrialResult], float] | None = None,
        metric: str = "measured tokens/s per rank",
        objective_note: str = "",
    ) -> None:
        """Create or load the study of ``settings`` (whose candidates are ``labels``) and bring
        it in line with the journal: records the storage lacks (lost, emptied or corrupt
        database; a crash between the two writes) are added to it, with one line saying so.

        ``candidates`` (those of ``labels``) give each trial one parameter per knob;
        ``objective`` is the value a successful trial records, named ``metric``, and
        ``objective_note`` tells a reader of the study (optuna-dashboard) what it is."""
        self.name = settings.name(labels)
        self.distribution = CategoricalDistribution(sorted(set(labels)))
        self.candidates = {c.label(): c for c in candidates}
        self.knobs = knob_distributions(candidates) if candidates else {}
        if objective is not None:
            self.objective = objective
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        with db_errors(self.shown):
            existed, changed, missing = self.again(
                lambda: self._open_study(settings, metric, objective_note)
            )
        if changed:
            self.notice(changed)
        if missing:
            where = "had no such study" if not existed else "lacked them"
            self.notice(
                f"restored {len(missing)} trial records of study {self.name} from "
                f"{self.journal.path.name} ({self.shown} {where}); none is run again"
            )
        unjournaled = self._journal_what_is_stored()
        if unjournaled:
            self.notice(
                f"{self.journal.path.name} lacked {unjournaled} trial records of study "
                f"{self.name} (deleted or cut?): written back from {self.shown}"
            )

    def _open_study(
        self, settings: StudySettings, metric: str, objective_note: str
    ) -> tuple[bool, str | None, list[TrialResult]]:
        changed: str | None = None
        with self.claims:
            try:
                self.storage.get_study_id_from_name(self.name)
                existed = True
            except KeyError:
                existed = False
            self.study = optuna.create_study(
                storage=self.storage,
                study_name=self.name,
                direction="maximize",
                load_if_exists=True,
            )
            self.study_id = self.storage.get_study_id_from_name(self.name)
            if not existed:
                self.study.set_user_attr(SETTINGS_ATTR, settings.model_dump(mode="json"))
                changed = self._changed_since(settings)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                self.study.set_metric_names([metric])
            self.study.set_user_attr(OBJECTIVE_ATTR, objective_note or metric)
            known = self._read().identities()
            missing = [r for r in self.journal.read(self.name) if identity(r) not in known]
            for result in missing:
                self._add_finished(result)
        return existed, changed, missing

    def _journal_what_is_stored(self) -> int:
        """Append to the journal the records of this study that the storage holds and the
        journal lacks (a deleted ``trials.jsonl`` would otherwise never hold them again, and the
        journal is what rebuilds a lost database); the number written. Only for the output
        folder's own SQLite database: a server's study is shared by drivers whose journals each
        hold their own trials."""
        if self.url != default_storage(self.out):
            return 0
        journaled = {identity(r) for r in self.journal.read(self.name)}
        stored = []
        for t in self.storage.get_all_trials(self.study_id, deepcopy=False):
            raw = t.user_attrs.get(RESULT_ATTR)
            if raw and t.state.is_finished():
                with contextlib.suppress(ValidationError):
                    stored.append(TrialResult.model_validate_json(raw))
        lost = [r for r in stored if identity(r) not in journaled]
        for result in sorted(lost, key=lambda r: r.started_at):
            self.journal.append(self.name, result)
        return len(lost)

    def _changed_since(self, settings: StudySettings) -> str | None:
        """One line when this output folder's latest study is another one (a changed model,
        another target, other settings): which, and what differs; None when there is none."""
        latest = next((n for n in reversed(self.journal.studies()) if n != self.name), None)
        if latest is None:
            return None
        kept = sum(1 for r in self.journal.read(latest) if r.status.launched)
        try:
            attrs = self.storage.get_study_user_attrs(self.storage.get_study_id_from_name(latest))
            before = StudySettings.model_validate(attrs.get(SETTINGS_ATTR))
        except (KeyError, ValidationError):
            before = None  # its settings are not in this storage (lost, or older autoshard)
        what = settings.differences(before) if before is not None else []
        if before is not None and before.target != settings.target:
            return (
                f"--out {self.out} holds study {latest} of another target ({before.target}): "
                f"starting study {self.name} for {settings.target} beside it; its {kept} trials "
                "are kept and not reused (give another --out to keep them apart)"
            )
        because = f" ({', '.join(what)} changed)" if what else ""
        return (
            f"starting a new study {self.name}{because}: the {kept} trials of study {latest} "
            f"in {self.journal.path.name} are kept and not reused"
        )

    # -- a turn of the loop ----------------------------------------------------------------------

    @contextlib.contextmanager
    def turn(self) -> Iterator[StudyView]:
        """The claim lock held: stale trials failed, then every driver's trials as they are."""
        with db_errors(self.shown):
            view = self.again(self._enter_turn)
        try:
            yield view
        finally:
            self.claims.__exit__()

    def _enter_turn(self) -> StudyView:
        self.claims.__enter__()
        try:
            self._fail_stale()
            return self._read()
        except BaseException:
            self.claims.__exit__()
            raise

    def view(self) -> StudyView:
        with db_errors(self.shown):
            return self.again(self._read)

    def record(self, result: TrialResult, estimate: str | None = None) -> None:
        """A result that ran no trial (pruned, skipped): to the journal, then the storage."""
        self.journal.append(self.name, result)
        with db_errors(self.shown):
            self.again(lambda: self._add_finished(result, estimate))

    def start(
        self, label: str, estimate: str | None = None, factors: dict[str, float] | None = None
    ) -> Ticket:
        """Claim ``label``: a RUNNING trial naming this driver, its heartbeat started.
        ``estimate`` (JSON) and ``factors`` (the calibrated speed factors it was predicted with;
        None: uncalibrated) are recorded with its result: what it was tried with."""
        assert self.distribution is not None
        template = FrozenTrial(
            number=-1,
            state=TrialState.RUNNING,
            value=None,
            datetime_start=datetime.now(),
            datetime_complete=None,
            **self._params(label),
            user_attrs={OWNER_ATTR: self._owner(), LABEL_ATTR: label},
            system_attrs={},
            intermediate_values={},
            trial_id=-1,
        )
        self.claims.check()  # ClaimLost: taken for dead while stopped; the turn starts again

        def create() -> int:
            trial_id = self.storage.create_new_trial(self.study_id, template_trial=template)
            self.storage.record_heartbeat(trial_id)
            return trial_id

        with db_errors(self.shown):
            trial_id = self.again(create)
        self._beat = Heartbeat(self.storage, trial_id, every=HEARTBEAT_S)
        self._running = Ticket(trial_id, label, estimate, factors)
        return self._running

    def finish(self, ticket: Ticket, result: TrialResult) -> None:
        """The trial's result: to the journal (fsync'd) first, then the storage."""
        self._stop_beat()
        self._running = None
        self.journal.append(self.name, result)
        with db_errors(self.shown):
            self.again(lambda: self._store_finished(ticket, result))

    def _store_finished(self, ticket: Ticket, result: TrialResult) -> None:
        try:
            for key, value in self._attrs(result, ticket.estimate, ticket).items():
                self.storage.set_trial_user_attr(ticket.trial_id, key, value)
            ok = result.status is TrialStatus.OK
            self.storage.set_trial_state_values(
                ticket.trial_id,
                TrialState.COMPLETE if ok else TrialState.FAIL,
                values=[self.objective(result)] if ok else None,
            )
        except optuna.exceptions.UpdateFinishedTrialError:
            # Another driver took this one for stale (no heartbeat within the grace period)
            # and failed it: the result is kept all the same, as a trial of its own.
            self._add_finished(result, ticket.estimate, ticket)

    def abandon(self, ticket: Ticket) -> None:
        """The trial will not finish (Ctrl-C, an error): failed without a result, so that its
        candidate is free again."""
        self._stop_beat()
        self._running = None
        with contextlib.suppress(Exception):
            self.storage.set_trial_state_values(ticket.trial_id, TrialState.FAIL)

    # -- internals -------------------------------------------------------------------------------

    def _owner(self) -> dict[str, Any]:
        return {"host": self.host, "pid": os.getpid(), "out": str(self.out), "token": self.token}

    def _stop_beat(self) -> None:
        if self._beat is not None:
            self._beat.end()
            self._beat = None

    def _read(self) -> StudyView:
        view = StudyView(since=self.opened_at)
        # never launched first: each turn records them before it claims anything
        for key, raw in self.storage.get_study_system_attrs(self.study_id).items():
            if key.startswith(NOT_LAUNCHED_PREFIX) and isinstance(raw, str):
                with contextlib.suppress(ValidationError):
                    view.add(TrialResult.model_validate_json(raw))
        for t in self.storage.get_all_trials(self.study_id, deepcopy=False):
            if t.state is TrialState.RUNNING:
                label = t.user_attrs.get(LABEL_ATTR, t.params.get(PARAM))
                if isinstance(label, str):
                    view.running.add(label)
                continue
            raw = t.user_attrs.get(RESULT_ATTR)
            if raw and t.state.is_finished():
                try:
                    view.add(TrialResult.model_validate_json(raw))
                except ValidationError:
                    continue  # written by another version of autoshard; not this study's kind
        return view

    def _fail_stale(self) -> None:
        assert self.study is not None
        fail_stale(self.storage, self.study, self.study_id, self._owner())

    def _attrs(
        self, result: TrialResult, estimate: str | None, tried: Ticket | None = None
    ) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            LABEL_ATTR: result.candidate.label(),
            RESULT_ATTR: result.model_dump_json(),
        }
        if estimate is not None:
            attrs[ESTIMATE_ATTR] = estimate
        if tried is not None and tried.estimate is not None:
            attrs[FACTORS_ATTR] = tried.factors  # None too: tried with the uncalibrated model
        return attrs

    def _add_finished(
        self, result: TrialResult, estimate: str | None = None, tried: Ticket | None = None
    ) -> None:
        assert self.study is not None and self.distribution is not None
        label = result.candidate.label()
        if label not in self.distribution.choices:
            return  # not a candidate of this study (cannot happen for its own records)
        if not result.status.launched:
            self.storage.set_study_system_attr(
                self.study_id, NOT_LAUNCHED_PREFIX + label, result.model_dump_json()
            )
            return
        if result.status is TrialStatus.OK:
            state, value = TrialState.COMPLETE, self.objective(result)
        else:
            state, value = TrialState.FAIL, None
        self.study.add_trial(
            optuna.trial.create_trial(
                state=state,
                value=value,
                **self._params(label),
                user_attrs=self._attrs(result, estimate, tried),
            )
        )

    def tried_with(
        self, results: Sequence[TrialResult]
    ) -> dict[str, tuple[str, dict[str, float] | None] | None]:
        """By label, what each launched trial of ``results`` was tried with, as recorded beside
        its result: (its estimate's JSON, the calibrated factors it was predicted with or None
        for the uncalibrated model); None where its record has neither (a trial of an older
        autoshard, or one restored from the journal)."""
        wanted = {identity(r) for r in results if r.status.launched}
        with db_errors(self.shown):
            trials = self.again(lambda: self.storage.get_all_trials(self.study_id, deepcopy=False))
        out: dict[str, tuple[str, dict[str, float] | None] | None] = {}
        for t in trials:
            raw = t.user_attrs.get(RESULT_ATTR)
            if not raw or not t.state.is_finished():
                continue
            try:
                result = TrialResult.model_validate_json(raw)
            except ValidationError:
                continue
            if identity(result) not in wanted:
                continue
            estimate = t.user_attrs.get(ESTIMATE_ATTR)
            recorded = isinstance(estimate, str) and FACTORS_ATTR in t.user_attrs
            label = result.candidate.label()
            out[label] = (str(estimate), t.user_attrs[FACTORS_ATTR]) if recorded else None
        return out

    def _params(self, label: str) -> dict[str, Any]:
        """A trial's parameters: one per knob, or (no candidates given) the label."""
        c = self.candidates.get(label)
        if c is None or not self.knobs:
            assert self.distribution is not None
            return {"params": {PARAM: label}, "distributions": {PARAM: self.distribution}}
        return {"params": knobs_of(c), "distributions": dict(self.knobs)}

    def mark_recommended(self, rec: Decision) -> None:
        """Name the recommended trial in the study's user attributes (``recommended``), which
        optuna-dashboard shows beside the study: its number, candidate, basis and the first
        reasons, and why it may differ from optuna's best trial."""
        assert self.study is not None
        label = rec.chosen.candidate.label()
        with db_errors(self.shown):
            number = next(
                (
                    t.number
                    for t in self.storage.get_all_trials(self.study_id, deepcopy=False)
                    if t.state is TrialState.COMPLETE
                    and t.user_attrs.get(LABEL_ATTR, t.params.get(PARAM)) == label
                ),
                None,
            )
            self.study.set_user_attr(RECOMMENDED_ATTR, recommended(rec, number))
            self.study.set_user_attr(NOT_LAUNCHED_ATTR, not_launched_summary(self._read()))
            dashboard_note(self.study, number, label, rec)
