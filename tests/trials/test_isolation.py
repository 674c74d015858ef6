"""Trial isolation: a finished trial leaves nothing of itself in its worker.

The worker's own code (:func:`autoshard.trials.worker.run_trial`) in the test process on a
single-rank gloo group first (seconds), then a real worker group (torchrun + gloo processes).
The target (tests/targets/isolation.py) keeps a weak reference to every module and parameter
it builds and refuses to build while one of an earlier trial's is alive."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from autoshard.config import Candidate, WorkloadSpec
from autoshard.options import TuneOptions
from autoshard.results import TrialResult, TrialStatus
from autoshard.target.resolve import TargetSpec
from autoshard.trials import accounting, worker
from autoshard.trials.group import WorkerGroup, _Trial
from autoshard.trials.isolation import LEFTOVER_FLOOR, freeze_process
from autoshard.trials.protocol import TrialReply, TrialRequest

CPU = torch.device("cpu")
LINEAR = "torch.nn.modules.linear.Linear"
KEEPER = "tests.targets.isolation:build"
FSDP1 = Candidate(wrap_classes=(LINEAR,), precision="32-true", sharding="NO_SHARD")
FSDP2 = Candidate(engine="fsdp2", wrap_classes=(LINEAR,), precision="32-true")
SHORT = {"options": TuneOptions(warmup=1, steps=1, max_steps=2)}  # nothing here is timed


def _target(trial: int, **kwargs: object) -> TargetSpec:
    return TargetSpec(spec=KEEPER, kwargs={"trial": trial, **kwargs})


def _request(n: int, candidate: Candidate, target: TargetSpec, **kw: object) -> TrialRequest:
    return TrialRequest(
        n=n, candidate=candidate, target=target, workload=WorkloadSpec(), warmup=1, steps=1,
        max_steps=1, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A single-rank gloo group in this process, whose objects are frozen out of the collector's
    sight as a worker's are before its first trial (isolation.freeze_process)."""
    import gc

    freeze_process(CPU)
    try:
        if dist.is_initialized():  # pragma: no cover - another test left one: use it
            yield
            return
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        try:
            yield
        finally:
            dist.destroy_process_group()
    finally:
        gc.unfreeze()


def test_a_finished_trial_leaves_nothing_of_itself(one_rank) -> None:
    """Trials one after another in one worker: before each builds, every module and parameter
    of the earlier trials' models is gone, an OOM's included, on both engines (FSDP1 at world
    size 1 runs NO_SHARD, as on the H200, where each FSDP1 trial left its flat parameters and
    their gradients: a cycle through C++ that Python's collector cannot see); and every trial
    starts from, and leaves, the live tensor bytes the first one started from."""
    plan = [
        (FSDP1, {}),
        (FSDP1, {"memory_cap": 1}),  # an OOM, after the warm-up step ran
        (FSDP2, {}),
        (FSDP1.model_copy(update={"checkpointing": "all", "checkpoint_classes": (LINEAR,)}), {}),
        (FSDP1, {}),
    ]
    reports = [
        worker.run_trial(_request(i, c, _target(i), **kw), CPU, quiet=True)
        for i, (c, kw) in enumerate(plan)
    ]
    assert [r.status for r in reports] == [TrialStatus.OK, TrialStatus.OOM] + [
        TrialStatus.OK
    ] * 3, [r.error for r in reports]
    first = reports[0].baseline
    for r in reports:
        assert abs(r.baseline - first) < LEFTOVER_FLOOR, (r.baseline, first)
        assert abs(r.leftover - first) < LEFTOVER_FLOOR, (r.leftover, first)


def test_a_model_kept_from_its_cpu_build_is_the_trials_own(one_rank, monkeypatch) -> None:
    """A factory that cannot build on meta is built on the CPU and, when the worker does not
    build it twice (a large one), kept for the next build: the kept model is the trial's, which
    the next trial must neither find alive nor be handed."""
    monkeypatch.setattr(worker, "REAL_BUILD_MAX_BYTES", 0)  # as if it were large
    first, second = (
        worker.run_trial(_request(i, FSDP2, _target(10 + i, meta_unsafe=True)), CPU, quiet=True)
        for i in range(2)
    )
    assert first.status is TrialStatus.OK, first.error
    assert second.status is TrialStatus.OK, second.error
    assert abs(second.baseline - first.baseline) < LEFTOVER_FLOOR


# ---------------------------------------------------------------------------------------------
# The driver: restarts, contamination, an OOM retried in a fresh group (no processes here)
# ---------------------------------------------------------------------------------------------

MIB = 2**20


def _reply(n: int, baseline: tuple[int, ...], leftover: tuple[int, ...], **kw) -> TrialReply:
    return TrialReply(
        n=n, status=kw.pop("status", "ok"), world_size=2, baseline_bytes=baseline,
        leftover_bytes=leftover, **kw,
    )  # fmt: skip


def test_the_group_is_restarted_when_a_trial_left_memory(tmp_path) -> None:
    """The clean level is what the launch's first trial started from, per rank; a trial that
    leaves more than the margin above it (4 MiB, or 1% of its peak) restarts the group before
    the next trial, with a line naming the trial, the rank and the bytes; one that starts
    above it is contaminated."""
    group = WorkerGroup(_target(0), TuneOptions(nproc=2), log_dir=tmp_path)
    c = FSDP1
    assert group._check_levels(c, 0, _reply(0, (1 * MIB, 2 * MIB), (1 * MIB, 5 * MIB))) is False
    assert group._restart_why is None  # 3 MiB above: within the floor
    peak = {"peak_allocated": (1000 * MIB, 1000 * MIB)}  # 1%: 10 MiB
    assert group._check_levels(c, 1, _reply(1, (1 * MIB, 13 * MIB), (9 * MIB, 2 * MIB), **peak))
    assert group._restart_why is None  # started 11 MiB above: contaminated; left 8 < 10 MiB
    assert not group._check_levels(c, 1, _reply(1, (1 * MIB, 11 * MIB), (1 * MIB, 2 * MIB), **peak))
    assert not group._check_levels(c, 2, _reply(2, (1 * MIB, 2 * MIB), (1 * MIB, 14 * MIB)))
    assert group._restart_why is not None
    assert "left 12 MiB allocated on rank 1" in group._restart_why
    assert c.label() in group._restart_why and "restarted" in group._restart_why
    # an older worker's reply without levels: nothing to compare, nothing concluded
    assert not group._check_levels(c, 3, _reply(3, (), ()))


@pytest.mark.parametrize(("nnodes", "ended_by"), [(1, "close"), (2, "kill")])
def test_a_restart_stops_one_node_and_kills_several(tmp_path, nnodes, ended_by) -> None:
    """On one node the group is stopped (its workers exit and free their memory before the
    next launch); across nodes it is killed: the other nodes take a clean stop for the end of
    the study, and relaunch to join the next group only after a kill."""
    group = WorkerGroup(_target(0), TuneOptions(nproc=1, node_rank=0, rdzv_endpoint="127.0.0.1:29500", on_notice=lambda line: None), log_dir=tmp_path, nnodes=nnodes)  # fmt: skip
    ended: list[str] = []
    group.close = lambda: ended.append("close")  # type: ignore[method-assign]
    group.kill = lambda: ended.append("kill")  # type: ignore[method-assign]
    group.alive = lambda: True  # type: ignore[method-assign]
    group._restart_why = "left 64 MiB"
    group._restart_if_left()
    assert ended == [ended_by] and group._restart_why is None


class _FakeLaunches:
    """WorkerGroup._run, close and kill without processes: each end makes a fresh launch; the
    ``oom_at`` places (in their launch) run out of memory."""

    def __init__(self, group: WorkerGroup, oom_at: set[int]) -> None:
        self.group, self.oom_at, self.place, self.launches = group, oom_at, 0, 1
        group._run = self.run  # type: ignore[method-assign]
        group.close = group.kill = self.end  # type: ignore[method-assign]

    def run(self, trial: _Trial) -> TrialResult:
        self.group.last_index, self.place = self.place, self.place + 1
        status = "oom" if self.group.last_index in self.oom_at else "ok"
        return TrialResult(candidate=trial.candidate, status=status)

    def end(self) -> None:
        self.place, self.launches = 0, self.launches + 1


@pytest.mark.parametrize(
    ("oom_at", "retry", "runs", "status", "retried", "launches"),
    [
        ({1}, True, 2, "ok", True, 2),  # a shared group's OOM, fine in a fresh group
        ({0, 1}, True, 2, "oom", True, 2),  # out of memory in the fresh group too: a real OOM
        ({1}, False, 2, "oom", False, 1),  # not predicted to fit: recorded as it came
        ({0}, True, 1, "oom", False, 1),  # already a fresh group's first trial: no retry
    ],
)
def test_an_oom_predicted_to_fit_is_retried_once_in_a_fresh_group(
    tmp_path, oom_at, retry, runs, status, retried, launches
) -> None:
    lines: list[str] = []
    group = WorkerGroup(_target(0), TuneOptions(nproc=2, on_notice=lines.append), log_dir=tmp_path)
    fake = _FakeLaunches(group, oom_at)
    last = [group.run(FSDP1, WorkloadSpec(), retry_oom=retry) for _ in range(runs)][-1]
    assert (last.status.value, last.oom_retry, fake.launches) == (status, retried, launches)
    assert len(lines) == int(retried)
    if retried:
        assert "ran out of memory in a worker group that had run 1 trials before it" in lines[0]


def test_a_contaminated_oom_or_error_teaches_nothing() -> None:
    """Dominance skips the larger micro-batches of a configuration that ran out of memory,
    and lessons those of one that raised: never on the word of a trial that started with an
    earlier trial's memory."""
    from autoshard.study.dominance import dominated_by
    from autoshard.study.lessons import learn

    small, large = (FSDP1.model_copy(update={"micro_batch_size": m}) for m in (1, 2))
    for status in ("oom", "error"):
        clean = TrialResult(candidate=small, status=status, error="RuntimeError: x")
        dirty = clean.model_copy(update={"contaminated": True})
        if status == "oom":
            assert dominated_by(large, [clean]) is clean
            assert dominated_by(large, [dirty]) is None
        else:
            cands = [small, large]
            assert large.label() in learn(cands, [clean], {large.label()}).ruled_out
            assert learn(cands, [dirty], {large.label()}).ruled_out == {}
    # an OOM that was retried in a fresh group ran clean: it rules out as any clean one
    retried = TrialResult(candidate=small, status="oom", oom_retry=True)
    assert dominated_by(large, [retried]) is retried


def test_the_baseline_and_the_isolation_flags_are_in_trials_jsonl(tmp_path) -> None:
    """Every line of trials.jsonl carries what its trial started from, per rank, and whether
    it was contaminated or an OOM's retry: a study read back (or resumed) keeps them."""
    from autoshard.study.journal import read_records, record_line

    path = tmp_path / "trials.jsonl"
    done = TrialResult(
        candidate=FSDP1, status="oom", baseline_bytes=(3 * MIB, 5 * MIB), contaminated=True,
        oom_retry=True,
    )  # fmt: skip
    path.write_bytes(record_line("autoshard-a", done))
    line = path.read_text()
    assert '"baseline_bytes":[3145728,5242880]' in line
    assert '"contaminated":true' in line and '"oom_retry":true' in line
    (back,) = read_records(path, "autoshard-a")
    assert (back.baseline_bytes, back.contaminated, back.oom_retry) == (
        (3 * MIB, 5 * MIB),
        True,
        True,
    )


def test_what_a_worker_counts_as_allocated(monkeypatch) -> None:
    """On CPU, the storages of the tensors Python reaches, each once (views share one), a
    leaf's gradient with them, nothing for meta tensors; on CUDA the allocator's count. The
    worst rank is the one furthest above its own clean level; unknown levels say nothing."""
    from autoshard.trials.isolation import leftover_margin, live_bytes, worst_excess

    before = live_bytes(CPU)
    weight = torch.nn.Parameter(torch.zeros(1000))  # 4,000 bytes
    weight.grad = torch.zeros(1000)  # 4,000 more
    views = [weight[:10], weight.detach()[5:]]  # noqa: F841 - the same storage
    meta = torch.empty(10**9, device="meta")  # noqa: F841 - no memory
    assert live_bytes(CPU) - before == 8000
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 12345)
    assert live_bytes(torch.device("cuda", 0)) == 12345

    assert worst_excess((5, 9, 2), (4, 1, 1)) == (1, 8)
    assert worst_excess((9, 5), (1, 1)) == (0, 8)
    assert worst_excess((1, 1), (3, 2)) == (1, -1)  # none above
    assert worst_excess((7,), ()) == (0, 0) and worst_excess((), (7,)) == (0, 0)
    assert leftover_margin(None) == leftover_margin(10 * MIB) == 4 * MIB
    assert leftover_margin(1000 * MIB) == 10 * MIB


def test_on_cpu_a_release_hands_freed_heap_pages_back(monkeypatch) -> None:
    """A CPU trial's peak is read from the resident set: the release before it hands glibc's
    free pages back (``malloc_trim(0)``), and goes on where there is no glibc (macOS, musl)."""
    import ctypes

    from autoshard.trials.isolation import release

    trims: list[tuple[str, object]] = []

    class Libc:
        def __init__(self, name: str) -> None:
            self.name = name

        def malloc_trim(self, pad: object) -> int:
            trims.append((self.name, pad))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", Libc)
    level = release(CPU)
    assert trims == [("libc.so.6", 0)]

    def missing(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert abs(release(CPU) - level) < LEFTOVER_FLOOR


def test_on_cuda_a_trial_is_measured_from_its_own_baseline(monkeypatch) -> None:
    """What a CPU can check of the CUDA path (its calls, faked): the release before a trial
    collects, waits for the streams (frees pending on their events), drops cuBLAS's workspaces
    and the allocator's cache, in that order, then reads what is allocated; the peak a trial
    reports is the allocator's above that baseline."""
    import gc

    from autoshard.trials.isolation import release

    calls: list[str] = []
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("synchronize"))
    monkeypatch.setattr(
        torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("cublas"), raising=False
    )
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    allocated = lambda *a: calls.append("allocated") or 5 * MIB  # noqa: E731
    monkeypatch.setattr(torch.cuda, "memory_allocated", allocated)
    assert release(cuda) == 5 * MIB
    assert calls == ["collect", "synchronize", "cublas", "empty_cache", "allocated"]
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 105 * MIB)
    assert accounting.peak_allocated(cuda, 5 * MIB, 0) == 100 * MIB

    def busy() -> None:  # a torch built without cuBLAS's workspaces, or one that refuses
        raise RuntimeError("no workspaces")

    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", busy, raising=False)
    assert release(cuda) == 5 * MIB


@pytest.mark.slow
def test_a_worker_group_runs_each_trial_from_its_first_level(tmp_path) -> None:
    """In a worker group on two ranks: each trial's record has the baseline it started from,
    the first trial's again on the next. Then an injected leak (the target keeps its model alive, as a
    user's module-level cache would): the next trial restarts the group, said in one line, and
    starts from the first level again. Under a cap that counts what the group holds, as a GPU's
    memory does, it would have run out of memory without the restart (seen: it did)."""
    lines: list[str] = []
    workload = WorkloadSpec()
    group = WorkerGroup(
        _target(0),
        TuneOptions(nproc=2, trial_timeout=120, on_notice=lines.append),
        log_dir=tmp_path,
    )
    with group:
        clean = group.run(FSDP1, workload, target=_target(1), **SHORT)
        kept = group.run(FSDP1, workload, target=_target(2, leak=True, width=2048), **SHORT)
        assert lines == [] and group.launches == 1
        cap = (clean.max_allocated or 0) + 16 * 2**20  # the leak: 64 MiB of parameters
        after = group.run(FSDP1, workload, target=_target(3), memory_cap=cap, **SHORT)
    for r in (clean, kept):
        assert r.status is TrialStatus.OK, r.error
        assert len(r.baseline_bytes) == 2 and not r.contaminated
        for level, first in zip(r.baseline_bytes, clean.baseline_bytes, strict=True):
            assert abs(level - first) < LEFTOVER_FLOOR
    assert after.status is TrialStatus.OK and not after.contaminated, after.error
    assert group.launches == 2
    assert len(lines) == 1 and "restarted before the next trial" in lines[0], lines
    assert after.launch_seconds > 0  # it waited for the fresh group
    for level, first in zip(after.baseline_bytes, clean.baseline_bytes, strict=True):
        assert abs(level - first) < LEFTOVER_FLOOR


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_trials_in_one_group_read_a_fresh_groups_peaks(tmp_path, examples_gpt_tiny) -> None:
    """On the GPU (world size 1: FSDP1 runs NO_SHARD, the H200 run's case): FSDP1 trials one
    after another in one group start from the first's baseline, leave nothing that restarts
    the group, and read the peak each reads alone, within 1%."""
    c = Candidate(wrap_classes=("gpt.Block",), precision="bf16-mixed")
    checkpointed = Candidate(
        wrap_classes=("gpt.Block",), precision="bf16-mixed", checkpointing="all",
        checkpoint_classes=("gpt.Block",),
    )  # fmt: skip
    workload = WorkloadSpec(seq_len=128)
    lines: list[str] = []
    one = WorkerGroup(
        examples_gpt_tiny,
        TuneOptions(trial_timeout=300, on_notice=lines.append),
        log_dir=tmp_path / "one",
    )
    with one as group:
        shared = [group.run(x, workload, **SHORT) for x in (c, checkpointed, c)]
    # isolation itself, not the defence: no trial left memory, so no restart was needed
    assert lines == [] and one.launches == 1, lines
    with WorkerGroup(
        examples_gpt_tiny, TuneOptions(trial_timeout=300), log_dir=tmp_path / "fresh"
    ) as group:
        alone = group.run(checkpointed, workload, **SHORT)
    for r in (*shared, alone):
        assert r.status is TrialStatus.OK and r.device == "cuda", r.error
        assert not r.contaminated
        for level, first in zip(r.baseline_bytes, shared[0].baseline_bytes, strict=True):
            assert abs(level - first) < LEFTOVER_FLOOR
    assert shared[2].max_allocated == pytest.approx(shared[0].max_allocated, rel=0.01)
    assert shared[1].max_allocated == pytest.approx(alone.max_allocated, rel=0.01)
