"""Simulated per-rank memory: the real FSDP code on fake tensors, with a fake process group.

The analytic estimate (:mod:`autoshard.memory`) is arithmetic; this one runs what a trial runs
(the same :mod:`autoshard.sharding` calls, the same optimizer, the same loss) for two training
steps, with every tensor a ``FakeTensor`` (shapes, no data) and every collective answered by
torch's ``"fake"`` process group, so any world size can be simulated on one CPU with no GPU.
torch's own memory trackers count the bytes (``FSDPMemTracker`` for FSDP2, ``MemTracker`` for
FSDP1), the same trackers :func:`track_training_peak` runs on real tensors in real gloo processes
(``benchmarks/estimate_accuracy.py`` compares the three).

Deep models are not simulated whole: the peak is affine in the number of blocks of each stack
(design notes, "Memory"), so the model is simulated with :data:`EXTRAPOLATE_FROM` blocks in each
deep stack (an encoder-decoder's two alike), then once per stack with one block more, and each
line is extended to the stack's real depth. torch's memory tracker walks every tracked module at
every operation, so a whole 64-block model took longer than 15 minutes where three
simulations of 8 to 9 blocks take seconds.

What no CPU simulation sees (CUDA context, NCCL buffers, the caching allocator's slack) is added
as the same stated allowance as the analytic estimate. CPU offload cannot be simulated here:
with every fake tensor on the CPU, offloaded and resident bytes are indistinguishable (fake CUDA
tensors cannot run backward on a CPU-only build), so offload candidates are refused.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoshard.config import Candidate, Engine, Hardware, Precision, Sharding, WorkloadSpec
from autoshard.errors import ConfigError
from autoshard.loop import autocast_for, optimizer_step
from autoshard.predict.analytic import allowance, as_run
from autoshard.predict.fakes import experts_for_fake_tensors, fake_forward_support
from autoshard.results import MemoryBreakdown, MemoryEstimate
from autoshard.sharding import (
    apply_fsdp1,
    apply_fsdp2,
    fsdp2_mesh,
    hybrid_mesh,
    make_optimizer,
    wrap_classes_of,
)
from autoshard.target.resolve import TargetSpec, build_target, load_callable
from autoshard.target.step import find_loss_fn, make_batch, with_labels

# Stacks deeper than EXTRAPOLATE_ABOVE blocks are simulated with EXTRAPOLATE_FROM blocks and one
# more, and extrapolated (the peak is affine in depth from 4 blocks up).
EXTRAPOLATE_FROM = 4
EXTRAPOLATE_ABOVE = 8
# Where the shallow model peaks at another moment than one block deeper, it is simulated again
# one block deeper, at most this many times (each time costs as much as the first).
DEEPEN_AT_MOST = 2
# Steps tracked: the first creates the optimizer state, the second runs with it in memory.
TRACKED_STEPS = 2

# Tracker categories -> breakdown fields. FSDP2's tracker knows FSDP's own kinds; FSDP1's
# generic tracker does not: it books every flat parameter storage a module holds as
# "Parameter", the gathered copies with the shards (split by :func:`_split_fsdp1_params`), and
# unsharded gradients show up as temporaries.
_KINDS = {
    "Sharded Param": "sharded_params",
    "Unsharded Param": "unsharded_params",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "All Gather": "comm_buffers",
    "Reduce Scatter": "comm_buffers",
    "OptState": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    "Temp": "temporaries",
    "Buffer": "buffers",
    "Parameter": "sharded_params",
    "Gradient": "gradients",
    "Optstate": "optimizer",
    "Other": "temporaries",
}


# ---------------------------------------------------------------------------------------------
# Tracking a training step (fake or real tensors)
# ---------------------------------------------------------------------------------------------


def _fsdp1_tracker() -> Any:
    from torch.distributed._tools.mem_tracker import MemTracker

    class FSDP1MemTracker(MemTracker):
        """MemTracker for FSDP1 with ``use_orig_params=True``: the original parameters are views
        into flat parameters during forward, and a view cannot take a post-accumulate-grad hook.
        Gradients are still counted (every allocation is), only not labelled as gradients."""

        def _track_module_params_and_buffers(
            self, module: nn.Module, install_grad_hooks: bool = True
        ) -> tuple[int, int]:
            leaf = all(p.is_leaf for p in module.parameters())
            result: tuple[int, int] = super()._track_module_params_and_buffers(
                module, install_grad_hooks and leaf and _all_trainable(module)
            )
            if install_grad_hooks and leaf:
                _label_gradients(self, module)
            return result

    return FSDP1MemTracker()


def _all_trainable(module: nn.Module) -> bool:
    return all(p.requires_grad for p in module.parameters())


def _label_gradients(tracker: Any, module: nn.Module) -> None:
    """Label the gradients of the trainable parameters of a module that also holds frozen ones.

    torch's ``MemTracker`` hooks every parameter, and ``register_hook`` refuses a tensor that
    does not require grad ("cannot register a hook on a tensor that doesn't require gradient"):
    frozen parameters (fine-tuning, LoRA) get no hook, the trainable ones get the tracker's."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    if _all_trainable(module):
        return  # the tracker hooked them itself
    handles = tracker._param_to_grad_hook_handles
    for param in module.parameters():
        if not param.requires_grad or handles.get(param) is not None:
            continue

        def label(grad: torch.Tensor) -> None:
            tracker._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        handles[param] = (
            param.register_hook(label),
            param.register_post_accumulate_grad_hook(lambda p, label=label: label(p.grad)),
        )


def track_training_peak(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    candidate: Candidate,
    *,
    loss_fn: Any = None,
    steps: int = TRACKED_STEPS,
    workload: WorkloadSpec | None = None,
) -> dict[str, int]:
    """Run ``steps`` optimizer steps, in the order of ``workload``'s loop and with its
    accumulation (:func:`autoshard.loop.optimizer_step`), under torch's memory tracker; the
    per-kind bytes at the peak (key ``"Total"`` is the peak itself). Works on fake and on real
    tensors alike."""
    phases = track_training_phases(
        model, optimizer, batch, candidate, loss_fn=loss_fn, steps=steps, workload=workload
    )
    return max(phases.values(), key=lambda kinds: kinds.get("Total", 0))


def track_training_phases(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    candidate: Candidate,
    *,
    loss_fn: Any = None,
    steps: int = TRACKED_STEPS,
    workload: WorkloadSpec | None = None,
) -> dict[str, dict[str, int]]:
    """:func:`track_training_peak`, phase by phase: the per-kind bytes at the peak of the
    optimizer steps and at the peak of the rest of the loop (forward and backward), each the
    larger over the steps. Phases grow at different rates with depth, so a simulation of a
    few blocks extrapolates each on its own (:func:`simulate_memory`)."""
    sharded = 0
    workload = workload or WorkloadSpec()
    if candidate.engine is Engine.FSDP2:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker: Any = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((batch,))
    else:
        sharded = _fsdp1_shard_bytes(model)
        tracker = _fsdp1_tracker()
        tracker.track_external(model, optimizer, batch)
    _global_peak_only(tracker)
    autocast = autocast_for(candidate, next(model.parameters()).device)
    phases: dict[str, dict[str, int]] = {}

    def close(phase: str) -> None:
        # the phase's peak, then a fresh peak from the current bytes for the next phase
        (snapshot,) = tracker.get_tracker_snapshot("peak").values()
        kinds = {str(getattr(k, "value", k)): int(v) for k, v in snapshot.items()}
        if kinds.get("Total", 0) > phases.get(phase, {}).get("Total", -1):
            phases[phase] = kinds
        _restart_peak(tracker)

    hooks = [
        optimizer.register_step_pre_hook(lambda *_: close(LOOP_PHASE)),
        optimizer.register_step_post_hook(lambda *_: close(STEP_PHASE)),
    ]
    try:
        with tracker, warnings_off():
            for _ in range(steps):
                # the user's loop order and accumulation (autoshard.loop); per-module stats are
                # reset before a module runs again, the global peak is kept
                optimizer_step(
                    model,
                    optimizer,
                    batch,
                    workload,
                    autocast=autocast,
                    loss_fn=loss_fn,
                    after_micro_batch=tracker.reset_mod_stats,
                )
                tracker.reset_mod_stats()
            close(LOOP_PHASE)
    finally:
        for hook in hooks:
            hook.remove()
    if candidate.engine is Engine.FSDP1:
        phases = {phase: _split_fsdp1_params(kinds, sharded) for phase, kinds in phases.items()}
    return phases


LOOP_PHASE, STEP_PHASE = "forward and backward", "optimizer step"


def _global_peak_only(tracker: Any) -> None:
    """Keep only the tracker's global peak up to date at each operation.

    torch's trackers also keep each module's peak: at every operation they walk every module
    tracked so far (``MemTracker._update_peak_stats``, torch 2.13), which made simulating a
    64-block model take longer than 15 minutes (about half of a 9-block simulation's time,
    profiled). Nothing here reads the per-module peaks."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    def update(_peak_state: Any) -> None:
        for dev, snap in tracker._curr_mem_snap.items():
            if tracker._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                tracker._peak_mem[dev] = snap[_TOTAL_KEY]
                tracker._peak_mem_snap[dev] = dict(snap)  # a flat dict of byte counts

    tracker._update_peak_stats = update


def _restart_peak(tracker: Any) -> None:
    # torch's trackers keep one peak for their whole run and have no reset (torch 2.13): start
    # it again from the current bytes, as their __enter__ does.
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    tracker._peak_mem_snap = tracker.get_tracker_snapshot()
    tracker._peak_mem = {dev: snap[_TOTAL_KEY] for dev, snap in tracker._peak_mem_snap.items()}


def _fsdp1_shard_bytes(model: nn.Module) -> int:
    """Bytes of this rank's FSDP1 flat-parameter shards, taken before the first forward, while
    every flat parameter still holds its shard (NO_SHARD: the whole parameter)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    total = 0
    for module in FullyShardedDataParallel.fsdp_modules(model):
        handle = getattr(module, "_handle", None)
        if handle is not None:
            flat = handle.flat_param
            total += flat.numel() * flat.element_size()
    return total


def _split_fsdp1_params(kinds: dict[str, int], sharded: int) -> dict[str, int]:
    """FSDP1's tracker books the gathered flat parameters (SHARD_GRAD_OP keeps the whole model
    gathered through forward and backward; FULL_SHARD the root and a unit or two; mixed
    precision's low-precision copies) as "Parameter", with the shards: at the peak the shards
    are all alive, so whatever is above their bytes is gathered."""
    params = kinds.pop("Parameter", 0)
    kinds["Sharded Param"] = kinds.get("Sharded Param", 0) + min(params, sharded)
    kinds["Unsharded Param"] = kinds.get("Unsharded Param", 0) + max(0, params - sharded)
    return kinds


def measure_training_peak(
    target: TargetSpec, candidate: Candidate, workload: WorkloadSpec, device: torch.device
) -> dict[str, int]:
    """What :func:`simulate_memory` predicts, measured: build and shard ``candidate`` for real on
    this rank of an initialised process group, as a trial does, and track two training steps.
    Every rank must call it; each gets its own peak."""
    from autoshard.trials.worker import (
        build_for_training,  # the worker's module, not loaded on import
    )

    with warnings_off():
        model, optimizer, batch, loss_fn = build_for_training(
            target, candidate, device, workload.seq_len
        )
        return track_training_peak(
            model, optimizer, batch, candidate, loss_fn=loss_fn, workload=workload
        )


@contextlib.contextmanager
def warnings_off() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ---------------------------------------------------------------------------------------------
# The fake world
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_world(world_size: int, backend: str = "nccl", rank: int = 0) -> Iterator[None]:
    """A ``"fake"`` default process group of ``world_size`` ranks (this process is ``rank``),
    whose collectives allocate what ``backend``'s do (NCCL's and the fake group's: nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError(
            "simulate_memory needs a process without a process group; call it before "
            "init_process_group (or from a separate process)"
        )
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        with (
            _sharding_propagation_outside_fake_mode(),
            _collective_buffers(backend),
            _gloo_holds_the_waited_all_gather(backend),
        ):
            yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _fsdp1_allocation_check_on_fakes() -> Iterator[None]:
    # FSDP1's write-back of the original parameters (SHARD_GRAD_OP with use_orig_params=True)
    # asserts that the unsharded flat parameter is allocated by its storage's data pointer,
    # which a fake tensor's storage does not have (0): "If skipped using sharded views, the
    # unsharded flat parameter should be allocated" (torch 2.13). A freed flat parameter's
    # storage is resized to 0 bytes, so its size says the same on fake and real tensors.
    import torch.distributed.fsdp._flat_param as flat_param

    original = flat_param._data_ptr_allocated
    flat_param._data_ptr_allocated = lambda tensor: tensor.untyped_storage().nbytes() > 0
    try:
        yield
    finally:
        flat_param._data_ptr_allocated = original


@contextlib.contextmanager
def _no_op_moves_skipped() -> Iterator[None]:
    # On fake tensors Module._apply swaps every parameter (torch.utils.swap_tensors), also for a
    # Module.to() that changes nothing, and the swap fails ("Cannot swap t2 because it has
    # weakref associated with it"). peft moves each new LoRA adapter to its base layer's device
    # and dtype that way, where it already is: such a move is skipped during the build.
    original = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if memory_format is None and all(
            (device is None or t.device == torch.device(device))
            and (dtype is None or not t.is_floating_point() or t.dtype == dtype)
            for t in tensors
        ):
            return self
        return original(self, *args, **kwargs)

    nn.Module.to = to  # type: ignore[assignment]
    try:
        yield
    finally:
        nn.Module.to = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _collective_buffers(backend: str) -> Iterator[None]:
    # gloo's reduce-scatter works on a copy of its input (ProcessGroupGloo; +1x the input under
    # torch's tracker around a bare 2-process collective; all-gather and all-reduce add nothing).
    # Both engines call ``dist.reduce_scatter_single`` (``reduce_scatter_tensor`` before torch
    # 2.13), looked up at call time.
    if backend != "gloo":
        yield
        return
    name = next(n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n))
    original = getattr(dist, name)

    def reduce_scatter_on_a_copy(output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        return original(output, input.clone(), *args, **kwargs)  # the copy dies on return

    setattr(dist, name, reduce_scatter_on_a_copy)
    try:
        yield
    finally:
        setattr(dist, name, original)


@contextlib.contextmanager
def _gloo_holds_the_waited_all_gather(backend: str) -> Iterator[None]:
    # gloo's worker thread drops its reference to a collective's tensors only after it has
    # woken the thread waiting on it (ProcessGroupGloo's run loop). FSDP2's pre-backward hook of
    # a unit that was not prefetched (the root, re-gathered when backward starts) waits on its
    # all-gather as soon as it is issued, copies it out, frees the output and at once allocates
    # the next unit's all-gather (its prefetch): the output can still be alive then (a race,
    # measured on 2 gloo processes: 4 ranks of 4 and 5 ranks of 6 on a LoRA Llama; a 20 ms pause
    # before the prefetch removes it). The fake process group never holds it: its worst case is
    # planned here, the output kept until the hook returns. An all-gather prefetched earlier
    # completed long before it is copied out, and forward keeps its outputs on purpose.
    if backend != "gloo":
        yield
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    original = FSDPParamGroup.pre_backward

    def pre_backward(self: Any, default_prefetch: bool, *unused: Any) -> Any:
        if self._training_state == TrainingState.PRE_BACKWARD or self._all_gather_result:
            return original(self, default_prefetch, *unused)  # a no-op, or prefetched
        held = []
        unshard = self.unshard

        def unshard_and_hold(*args: Any, **kwargs: Any) -> Any:
            out = unshard(*args, **kwargs)
            held.append(self._all_gather_result)
            return out

        self.unshard = unshard_and_hold
        try:
            return original(self, default_prefetch, *unused)
        finally:
            del self.unshard  # the class's method again
            held.clear()

    FSDPParamGroup.pre_backward = pre_backward  # type: ignore[method-assign]
    try:
        yield
    finally:
        FSDPParamGroup.pre_backward = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _sharding_propagation_outside_fake_mode() -> Iterator[None]:
    # DTensor's sharding propagation runs each op on fake tensors of the *global* shape, in the
    # caller's FakeTensorMode when there is one: under the tracker those unsharded temporaries
    # are counted (a 3x false optimizer-state spike, measured). A private fake mode keeps them
    # out of the count, as on real tensors.
    import torch.distributed.tensor._sharding_prop as sharding_prop

    original = sharding_prop.detect_fake_mode
    sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        sharding_prop.detect_fake_mode = original


# ---------------------------------------------------------------------------------------------
# Depth: simulate a few blocks, extrapolate
# ---------------------------------------------------------------------------------------------


def block_lists(model: nn.Module, block_classes: tuple[str, ...]) -> dict[str, int]:
    """The ModuleLists (and Sequentials) that hold the model's repeated blocks, by name, with
    their lengths: an encoder-decoder's two stacks, a decoder's one (not the model itself: it
    cannot be replaced in place). A list inside another's blocks (a stage's layers) is not
    counted apart: truncating the outer list truncates it."""
    classes = tuple(wrap_classes_of(model, block_classes)) if block_classes else ()
    if not classes:
        return {}
    found: dict[str, int] = {}
    for name, child in model.named_modules():
        if (
            not name
            or not isinstance(child, nn.ModuleList | nn.Sequential)
            or any(name.startswith(f"{outer}.") for outer in found)
        ):
            continue
        if any(isinstance(m, classes) for m in child):
            found[name] = len(child)
    return found


def truncate_blocks(model: nn.Module, depths: dict[str, int]) -> None:
    """Keep only the first ``depths[name]`` entries of each block list ``name``, in place."""
    for name, depth in depths.items():
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        kept = list(getattr(parent, attribute))[:depth]
        sequential = type(getattr(parent, attribute)) is nn.Sequential
        setattr(parent, attribute, nn.Sequential(*kept) if sequential else nn.ModuleList(kept))


# ---------------------------------------------------------------------------------------------
# The simulated estimate
# ---------------------------------------------------------------------------------------------


def _simulate_once(
    target: TargetSpec,
    depths: dict[str, int],
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    loss_fn: Any,
    rank: int = 0,
) -> dict[str, dict[str, int]]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    cpu = torch.device("cpu")
    world_size = hardware.world_size
    with fake_world(world_size, hardware.backend, rank), _fsdp1_allocation_check_on_fakes():
        # Meshes are made outside the fake mode: a mesh holds real rank tensors.
        if candidate.engine is Engine.FSDP2:
            mesh = fsdp2_mesh(candidate, cpu, world_size)
        elif candidate.sharding is Sharding.HYBRID_SHARD:
            mesh = hybrid_mesh(candidate, cpu)
        else:
            mesh = None
        # Built inside the fake mode, not copied from meta: ``to_empty`` cannot swap tied
        # parameters into fake tensors, and FSDP1 needs a model that is not on meta.
        with fake_forward_support(), FakeTensorMode(allow_non_fake_inputs=True), warnings_off():
            with _no_op_moves_skipped():
                built = build_target(target, device=cpu)
            model = built.model
            experts_for_fake_tensors(model)  # the profile's note says so
            truncate_blocks(model, depths)
            if candidate.precision is Precision.BF16_TRUE:
                model = model.to(torch.bfloat16)
            if candidate.engine is Engine.FSDP1:
                # use_orig_params=True, as trials and Lightning run it: the original parameters'
                # gradients are views of the flat gradient, which zero_grad() then leaves
                # allocated until the next backward (use_orig_params=False frees it at once:
                # 6% low under Lightning's order, measured)
                model = apply_fsdp1(model, candidate, cpu, mesh=mesh)
            else:
                model = apply_fsdp2(model, candidate, mesh)
            optimizer = make_optimizer(model.parameters(), candidate)
            batch = make_batch(
                model,
                built.batch,
                micro_batch_size=candidate.micro_batch_size,
                seq_len=workload.seq_len,
                device=cpu,
                data=built.data,
            )
            batch = with_labels(model, batch)
            return track_training_phases(
                model, optimizer, batch, candidate, loss_fn=loss_fn, workload=workload
            )


def simulate_memory(
    target: TargetSpec,
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    *,
    block_classes: tuple[str, ...] = (),
    extrapolate: bool = True,
) -> MemoryEstimate:
    """Predict the per-rank GPU peak of ``candidate`` by running it on fake tensors.

    ``block_classes`` (the analyzer's ``profile.block_classes``) enables depth extrapolation for
    models deeper than :data:`EXTRAPOLATE_ABOVE` blocks. Seconds per candidate for small
    models, tens of seconds for a 70B one.

    >>> from autoshard import Candidate, Hardware, TargetSpec, WorkloadSpec, simulate_memory
    >>> est = simulate_memory(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}),
    ...     Candidate(engine="fsdp2", wrap_classes=("gpt.Block",)),
    ...     Hardware(gpus_per_node=8, gpu_memory=80 * 2**30),
    ...     WorkloadSpec(seq_len=128),
    ... )
    >>> est.method, est.fits, est.gpu_peak == est.breakdown.total
    ('simulated', True, True)
    """
    if candidate.cpu_offload:
        raise ConfigError(
            "CPU offload cannot be simulated on the CPU (offloaded and resident bytes are on the "
            "same device); use the analytic estimate for offload candidates"
        )
    built = build_target(target, device="meta")
    module = sys.modules.get(load_callable(target.spec).__module__)
    loss_fn = find_loss_fn(module)
    lists = block_lists(built.model, block_classes) if extrapolate else {}
    deep = {name: n for name, n in lists.items() if n > EXTRAPOLATE_ABOVE}
    ranks = ranks_to_simulate(built.model, candidate, hardware)

    def run(depths: dict[str, int]) -> dict[str, dict[str, int]]:
        by_rank = [
            _simulate_once(target, depths, candidate, hardware, workload, loss_fn, rank)
            for rank in ranks
        ]
        # each phase's peak on the rank that holds the most in it
        return {
            phase: max((p[phase] for p in by_rank if phase in p), key=lambda k: k.get("Total", 0))
            for phase in by_rank[0]
        }

    if deep:
        # Every deep list at k blocks, then each alone at k + 1: the peak is affine in the depth
        # of each (an encoder's blocks add their activations whatever the decoder's depth).
        k = EXTRAPOLATE_FROM
        while True:
            base = dict.fromkeys(deep, k)
            low = run(base)
            steps = {name: run({**base, name: k + 1}) for name in deep}
            last = k >= EXTRAPOLATE_FROM + DEEPEN_AT_MOST or k + 2 >= min(deep.values())
            if last or _same_moments(low, steps.values()):
                break
            # The shallow model peaked at another moment than the deeper ones (a large root
            # unit's gradients outweighing a few blocks' activations): its line would be too
            # flat. Start again one block deeper.
            k += 1
        # Each phase's peak is affine in depth, but at different rates: the optimizer step
        # grows by a block's parameters, gradients and states, forward and backward by less
        # on many ranks. Extrapolated on its own, each phase can overtake the other (a 7B
        # shape at 8 ranks with checkpointing peaks in backward at 4 and 5 blocks, in the
        # optimizer step at 32: one extrapolated peak was 5% low).
        phases = {
            phase: _extrapolate(low[phase], [(steps[name][phase], deep[name] - k) for name in deep])
            for phase in low.keys() & set.intersection(*(set(s) for s in steps.values()))
        }
        stacks = ", ".join(f"{k} and {k + 1} of {n} {name}" for name, n in deep.items())
        how = f"simulated {stacks}, extrapolated"
    else:
        phases = run({})
        how = "simulated"
    kinds = max(phases.values(), key=lambda kinds: kinds.get("Total", 0))
    return _estimate(candidate, hardware, kinds, how)


def _same_moments(
    low: dict[str, dict[str, int]], deeper: Iterable[dict[str, dict[str, int]]]
) -> bool:
    """Whether each phase peaked at the same moment with one block more: a block adds bytes
    and takes none away, so no kind falls by more than 1% of the phase's peak."""
    for phases in deeper:
        for phase, kinds in low.items():
            high = phases.get(phase, {})
            total = max(kinds.get("Total", 0), 1)
            if any(high.get(key, 0) < v - total // 100 for key, v in kinds.items()):
                return False
    return True


def _extrapolate(low: dict[str, int], steps: list[tuple[dict[str, int], int]]) -> dict[str, int]:
    """The per-kind bytes of a phase from ``low`` (every block list at its simulated depth) and,
    per list, ``(high, more)``: the phase with that list one block deeper, and how many blocks
    deeper the real list is."""
    keys = set(low).union(*(high for high, _ in steps))
    kinds = {
        key: max(
            0,
            low.get(key, 0)
            + sum(more * (high.get(key, 0) - low.get(key, 0)) for high, more in steps),
        )
        for key in keys
    }
    # The two depths may peak at different moments of the phase: the total extrapolates
    # exactly, the split by kind only roughly, so the kinds are scaled to add up to the total.
    parts = sum(v for key, v in kinds.items() if key != "Total")
    if parts:
        kinds = {
            key: v if key == "Total" else v * kinds["Total"] // parts for key, v in kinds.items()
        }
    return kinds


def ranks_to_simulate(model: nn.Module, candidate: Candidate, hardware: Hardware) -> list[int]:
    """The ranks whose peaks the simulation takes the largest of.

    Every rank holds the same bytes, except with frozen parameters under FSDP1: a flat parameter
    is cut into equal contiguous shards, and the optimizer keeps state only for the trainable
    parameters in a rank's shard, so a rank whose shard holds a frozen embedding keeps less
    than one holding the head (measured: 3.1 against 5.1 MiB of AdamW state on the tiny GPT
    with a frozen embedding). The first and the last rank are simulated (exact at 2 ranks; at
    more, ranks in between may hold more)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    if not frozen or as_run(candidate, hardware).engine is not Engine.FSDP1:
        return [0]
    return sorted({0, hardware.world_size - 1})


def _estimate(
    candidate: Candidate, hardware: Hardware, kinds: dict[str, int], how: str
) -> MemoryEstimate:
    fields: dict[str, int] = {}
    for kind, nbytes in kinds.items():
        if kind != "Total" and nbytes:
            name = _KINDS.get(kind, "temporaries")
            fields[name] = fields.get(name, 0) + nbytes
    breakdown = MemoryBreakdown(**fields)
    # The tracker's total is the true peak; kinds are the split at that moment. Rounding of the
    # extrapolation can leave them a few bytes apart: the total wins, the difference is temporary.
    peak = kinds.get("Total", breakdown.total)
    breakdown = breakdown.model_copy(
        update={"temporaries": breakdown.temporaries + peak - breakdown.total}
    )
    breakdown = breakdown.model_copy(update={"allowance": allowance(peak, hardware)})
    gpu_peak = breakdown.total
    usable = hardware.usable_gpu_memory
    fits = gpu_peak <= usable
    return MemoryEstimate(
        candidate=candidate,
        method="simulated",
        gpu_peak=gpu_peak,
        host_peak=0,
        breakdown=breakdown,
        fits=fits,
        headroom=usable - gpu_peak,
        reason="" if fits else (
            f"needs {gpu_peak / 2**30:.1f} GiB per GPU, {usable / 2**30:.1f} GiB usable ({how})"
        ),
    )  # fmt: skip


def refine_with_simulation(
    target: TargetSpec,
    ranked: Sequence[MemoryEstimate],
    hardware: Hardware,
    workload: WorkloadSpec,
    *,
    block_classes: tuple[str, ...] = (),
    count: int = 3,
) -> list[MemoryEstimate]:
    """Replace the analytic estimates of the ``count`` best fitting candidates of ``ranked``
    (offload excepted) with simulated ones; the order is kept, so a candidate the simulation
    finds not to fit stays where it was, marked as such."""
    out = list(ranked)
    chosen = [i for i, e in enumerate(out) if e.fits and not e.candidate.cpu_offload][:count]
    for i in chosen:
        simulated = simulate_memory(
            target, out[i].candidate, hardware, workload, block_classes=block_classes
        )
        out[i] = simulated.model_copy(update={"host_peak": out[i].host_peak})
    return out
