"""The planning pipeline's own rules (autoshard.plan): how what a user says becomes options (and a
mistake one line naming the flag or keyword), which hardware is planned for, which switches
(torch.compile, float8) are planned, and the defaults a plan assumes. Quick: no trial runs."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import autoshard.plan as plan_module
from autoshard.config import Engine, Hardware, Optimizer, Precision, TuneOptions
from autoshard.errors import ConfigError
from autoshard.plan import (
    DEFAULT_MICRO_BATCH_SIZES,
    NoGPUWarning,
    PlanOptions,
    PlanWarning,
    detect_hardware,
    make_plan,
    make_request,
    micro_batch_sizes,
    options_from,
    planned_switches,
    plans_this_machine,
    unmodelled_notes,
)
from autoshard.target.resolve import BuiltModel, TargetSpec

GIB = 2**30


def _message(model: type, values: dict, *, cli: bool = True) -> str:
    with pytest.raises(ConfigError) as caught:
        options_from(model, values, cli=cli)
    return str(caught.value)


# --------------------------------------------------------------------------------------------
# A mistake is one line naming the flag (or keyword) and how to fix it
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "values", "cli", "line"),
    [
        (PlanOptions, {"gpuz": 2}, True,
         "unknown option gpuz=; see help(autoshard.PlanOptions) for the options"),
        (PlanOptions, {"gpus": 0}, True, "--gpus 0: give 1 or more"),
        (PlanOptions, {"gpus": 0}, False, "gpus= 0: give 1 or more"),
        (PlanOptions, {"gpu_memory": 0}, True, "--gpu-memory 0: give more than 0"),
        (TuneOptions, {"trial_timeout": 0}, False, "trial_timeout= 0: give more than 0.0"),
        (TuneOptions, {"warmup": -1}, True, "--warmup -1: give 0 or more"),
        (PlanOptions, {"intra_node_bandwidth": float("nan")}, False,
         "intra_node_bandwidth= nan: give a finite number (inf and nan are not a time or a size)"),
        (PlanOptions, {"engine": "fsdp3"}, True, "--engine fsdp3: choose one of fsdp1, fsdp2"),
        (PlanOptions, {"precision": "bf17"}, True,
         "--precision bf17: choose one of 32-true, bf16-mixed, 16-mixed, bf16-true"),
        (PlanOptions, {"batch_size": "0,1"}, True,
         "--batch-size 0,1: give positive integers, e.g. 1 or 1,2,4"),
        (PlanOptions, {"batch_size": ""}, True,
         "--batch-size : give positive integers, e.g. 1 or 1,2,4"),
        (TuneOptions, {"target_spread": 1}, True, "--target-spread 1: give less than 1.0"),
        (PlanOptions, {"gpu_memory": "12 potatoes"}, True,
         "--gpu-memory 12 potatoes: cannot read '12 potatoes' as a size; write it like 80GiB, "
         "40GB or 24000MiB"),
        (PlanOptions, {"host_memory": "0GiB"}, False,
         "host_memory= 0GiB: size must be positive, got '0GiB'"),
        (PlanOptions, {"optimizer": "lion"}, True,
         "--optimizer lion: choose one of " + ", ".join(o.value for o in Optimizer)),
        (PlanOptions, {"engine": "fsdp2", "optimizer": "adafactor"}, True,
         "--optimizer adafactor: adafactor steps the parameters of engine fsdp1 only: give "
         "--engine fsdp1 (engine= in code)"),
    ],
)  # fmt: skip
def test_a_bad_option_is_one_line_naming_the_flag_or_keyword(model, values, cli, line) -> None:
    assert _message(model, values, cli=cli) == line


def test_an_unknown_gpu_lists_the_catalogue() -> None:
    message = _message(PlanOptions, {"gpu": "h900"})
    assert message.startswith("unknown GPU 'h900': use one of ") and "h100-sxm" in message


def test_sizes_rates_and_lists_are_read_as_a_user_writes_them() -> None:
    options = PlanOptions(
        gpu_memory="40GB",
        host_memory="1TiB",
        intra_node_bandwidth="450GB/s",
        inter_node_bandwidth="400GBps",
        batch_size="1, 2,,4",
        precision="bf16-mixed,32-true",
    )
    assert options.gpu_memory == 40 * 10**9 and options.host_memory == 2**40
    assert options.intra_node_bandwidth == 450e9 and options.inter_node_bandwidth == 400e9
    assert PlanOptions(intra_node_bandwidth="1GiB").intra_node_bandwidth == float(GIB)
    assert options.batch_size == (1, 2, 4)
    assert options.precision == (Precision.BF16_MIXED, Precision.FP32)
    # one value is a list of one; numbers already numbers stay as they are
    assert PlanOptions(batch_size=4).batch_size == (4,)
    assert PlanOptions(precision=Precision.FP32).precision == (Precision.FP32,)
    assert PlanOptions(gpu_memory=GIB, intra_node_bandwidth=1e9).gpu_memory == GIB
    # the defaults a user gets by saying nothing
    default = PlanOptions()
    assert (default.nodes, default.accumulate, default.engine) == (1, 1, Engine.FSDP1)
    assert default.batch_size is None and default.precision is None and default.simulate == 0


# --------------------------------------------------------------------------------------------
# The hardware planned for
# --------------------------------------------------------------------------------------------


def _hardware(trials: bool = False, **values) -> tuple[Hardware, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hardware = detect_hardware(trials=trials, **values)
    return hardware, [f"{w.category.__name__}: {w.message}" for w in caught]


@pytest.fixture
def no_gpu(monkeypatch) -> None:
    monkeypatch.setattr(plan_module, "_visible_gpus", lambda: 0)


def test_without_a_gpu_the_gpus_given_are_planned_and_the_assumed_model_said(no_gpu) -> None:
    hardware, said = _hardware(gpus=4)
    assert (hardware.gpus_per_node, hardware.nodes, hardware.gpu) == (4, 1, "h100-sxm")
    assert hardware.gpu_memory == 80 * GIB and hardware.backend == "nccl"
    assert hardware.host_memory is None and hardware.bf16_supported
    assert said == [
        "PlanWarning: no GPU visible and no gpu/gpu_memory given: planning for NVIDIA H100 "
        "SXM5 80GB (h100-sxm); give --gpu or --gpu-memory for yours",
        "NoGPUWarning: no GPU visible: planning for 1 x 4 GPUs of 80 GiB",
    ]
    # a GPU model named: its memory, no assumption to warn about
    hardware, said = _hardware(gpus=2, nodes=3, gpu="a100-40gb-sxm")
    assert (hardware.gpu_memory, hardware.nodes, hardware.gpu) == (40 * GIB, 3, "a100-40gb-sxm")
    assert said == ["NoGPUWarning: no GPU visible: planning for 3 x 2 GPUs of 40 GiB"]
    # a memory given: that memory, no model assumed; trials run on CPU processes
    hardware, said = _hardware(trials=True, gpus=4, gpu_memory="40GB", host_memory="1TiB",
                               intra_node_bandwidth="100GB", inter_node_bandwidth="25GB")  # fmt: skip
    assert hardware.gpu is None and hardware.gpu_memory == 40 * 10**9
    assert hardware.host_memory == 2**40
    assert (hardware.intra_node_bandwidth, hardware.inter_node_bandwidth) == (100e9, 25e9)
    assert said == [
        "NoGPUWarning: no GPU visible: planning for 1 x 4 GPUs of 37.3 GiB; trials run on CPU "
        "processes with gloo"
    ]


def test_without_a_gpu_planning_needs_gpus_and_trials_default_to_two_processes(no_gpu) -> None:
    with pytest.raises(ConfigError, match=r"^no GPU visible here: give gpus \(--gpus N"):
        detect_hardware(nodes=2)
    hardware, _ = _hardware(trials=True)
    assert hardware.gpus_per_node == 2 == plan_module.DEFAULT_CPU_WORKERS


def test_the_cpu_gloo_entry_plans_this_machines_processes(no_gpu) -> None:
    hardware, said = _hardware(trials=True, gpu="cpu-gloo")
    assert hardware.backend == "gloo" and hardware.gpus_per_node == 2
    # offload there goes to this machine's memory, the one the processes share
    assert hardware.host_memory == plan_module.machine_memory() is not None
    assert not any(s.startswith("PlanWarning") for s in said)
    # on several nodes it is not this machine: the host memory is unknown
    assert _hardware(trials=True, gpu="cpu-gloo", nodes=2)[0].host_memory is None


def test_visible_gpus_are_planned_as_they_are(monkeypatch) -> None:
    class Properties:
        total_memory = 79 * GIB

    monkeypatch.setattr(plan_module, "_visible_gpus", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=0: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _=0: Properties())
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    hardware, said = _hardware()
    assert said == []
    assert (hardware.gpus_per_node, hardware.gpu, hardware.gpu_memory) == (
        8, "a100-80gb-sxm", 79 * GIB)  # fmt: skip
    assert not hardware.bf16_supported
    assert hardware.host_memory == plan_module.machine_memory()  # these GPUs' own host
    # fewer GPUs than are here: still this machine; a named model or more GPUs: not
    assert _hardware(gpus=4)[0].host_memory == plan_module.machine_memory()
    assert _hardware(gpus=16)[0].host_memory is None
    named, _ = _hardware(gpu="h100-sxm")
    assert named.host_memory is None and named.gpu_memory == 80 * GIB
    assert _hardware(gpu_memory="40GiB")[0].gpu_memory == 40 * GIB


def test_which_plans_are_for_this_machine() -> None:
    assert plans_this_machine(PlanOptions(), 8, "h100-sxm")
    assert plans_this_machine(PlanOptions(gpus=8), 8, "h100-sxm")
    assert not plans_this_machine(PlanOptions(gpus=9), 8, "h100-sxm")
    assert not plans_this_machine(PlanOptions(gpu="h100-sxm"), 8, "h100-sxm")
    assert not plans_this_machine(PlanOptions(), 0, "h100-sxm")
    assert plans_this_machine(PlanOptions(gpus=4), 0, "cpu-gloo")
    assert not plans_this_machine(PlanOptions(nodes=2), 0, "cpu-gloo")


def test_the_machines_memory_is_its_containers_limit_where_lower(monkeypatch) -> None:
    monkeypatch.setattr(plan_module.os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096,
                        "SC_PHYS_PAGES": 4 * GIB // 4096}[name])  # fmt: skip
    limits: dict[str, str] = {}

    def read_text(self: Path, *args, **kwargs) -> str:
        if str(self) not in limits:
            raise OSError(str(self))
        return limits[str(self)]

    monkeypatch.setattr(Path, "read_text", read_text)
    assert plan_module.machine_memory() == 4 * GIB  # no cgroup limit readable
    limits["/sys/fs/cgroup/memory.max"] = "max\n"
    limits["/sys/fs/cgroup/memory/memory.limit_in_bytes"] = f"{GIB}\n"
    assert plan_module.machine_memory() == GIB  # cgroup v1's limit, v2's "max"
    limits["/sys/fs/cgroup/memory.max"] = f"{2 * GIB}\n"
    assert plan_module.machine_memory() == GIB  # the lowest of all
    limits["/sys/fs/cgroup/memory/memory.limit_in_bytes"] = f"{8 * GIB}"
    assert plan_module.machine_memory() == 2 * GIB  # a limit above the RAM is no limit
    monkeypatch.setattr(plan_module.os, "sysconf", lambda name: (_ for _ in ()).throw(
        ValueError(name)))  # fmt: skip
    assert plan_module.machine_memory() is None


# --------------------------------------------------------------------------------------------
# torch.compile and float8: planned where they go and are modelled, a pin taken or refused
# --------------------------------------------------------------------------------------------

H100 = Hardware(gpus_per_node=8, gpu_memory=80 * GIB, gpu="h100-sxm")


@pytest.fixture
def modelled(monkeypatch) -> set[str]:
    dims: set[str] = set()
    monkeypatch.setattr(plan_module, "modelled_dimensions", lambda: frozenset(dims))
    monkeypatch.setattr(plan_module, "compile_supported", lambda: None)
    return dims


def test_unpinned_switches_are_planned_only_where_modelled_and_possible(modelled, monkeypatch):
    fsdp2 = PlanOptions(engine="fsdp2")
    assert planned_switches(fsdp2, H100) == ((False,), (False,), None)
    modelled.update({"compile", "float8"})
    assert planned_switches(fsdp2, H100) == ((False, True), (False, True), None)
    # float8 needs FSDP2 and fp8 tensor cores; compile needs a torch that compiles here
    assert planned_switches(PlanOptions(), H100)[1] == (False,)
    a100 = H100.model_copy(update={"gpu": "a100-80gb-sxm"})
    assert planned_switches(fsdp2, a100)[1] == (False,)
    monkeypatch.setattr(plan_module, "compile_supported", lambda: "no dynamo here")
    assert planned_switches(fsdp2, H100)[0] == (False,)


def test_pinned_switches_are_taken_or_refused_in_one_line(modelled, monkeypatch) -> None:
    off = PlanOptions(engine="fsdp2", compile=False, float8=False)
    assert planned_switches(off, H100) == ((False,), (False,), None)
    # float8 pinned on keeps only the bf16-compute precisions of the defaults
    on = PlanOptions(engine="fsdp2", compile=True, float8=True)
    assert planned_switches(on, H100) == ((True,), (True,), (Precision.BF16_MIXED,))
    pinned = PlanOptions(engine="fsdp2", float8=True, precision="bf16-true")
    assert planned_switches(pinned, H100)[2] == (Precision.BF16_TRUE,)
    with pytest.raises(ConfigError) as caught:
        planned_switches(PlanOptions(engine="fsdp2", float8=True, precision="bf16-mixed,32-true,"
                                     "16-mixed"), H100)  # fmt: skip
    assert str(caught.value) == (
        "float8 (--float8) is pinned on, but it trains with bf16 compute, not 32-true, 16-mixed: "
        "give --precision bf16-mixed (or bf16-true)"
    )
    with pytest.raises(ConfigError, match=r"^float8 \(--float8\) is pinned on, but FSDP1 has no"):
        planned_switches(PlanOptions(float8=True), H100)
    monkeypatch.setattr(plan_module, "compile_supported", lambda: "no dynamo here")
    with pytest.raises(ConfigError) as caught:
        planned_switches(PlanOptions(compile=True), H100)
    assert str(caught.value) == (
        "compile (--compile) is pinned on, but no dynamo here: leave it unpinned"
    )
    assert planned_switches(PlanOptions(compile=False), H100)[0] == (False,)


def test_a_planned_switch_the_predictors_do_not_model_is_said(modelled) -> None:
    from autoshard.config import Candidate

    plain = Candidate(engine="fsdp2", precision="bf16-mixed")
    both = [plain, plain.model_copy(update={"compile": True, "float8": True})]
    notes = unmodelled_notes(both)
    assert notes == [
        f"{what}: its effect on speed and memory is not modelled yet, so its candidates are "
        "estimated as without it; trials on GPUs measure it"
        for what in ("torch.compile", "float8")
    ]
    assert unmodelled_notes([plain]) == []
    modelled.add("float8")
    assert [n.split(":")[0] for n in unmodelled_notes(both)] == ["torch.compile"]


# --------------------------------------------------------------------------------------------
# Defaults of a plan
# --------------------------------------------------------------------------------------------


def test_the_optimizer_given_is_planned_in_every_candidate(no_gpu) -> None:
    import autoshard

    def plan(optimizer: str) -> dict[str, int]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            estimates = autoshard.estimate(
                "examples/gpt.py:build", kwargs={"size": "tiny"}, gpus=2, gpu_memory="80GiB",
                seq_len=32, batch_size=1, precision="32-true", optimizer=optimizer,
            )  # fmt: skip
        assert {e.candidate.optimizer.value for e in estimates} == {optimizer}
        return {e.candidate.label(): e.breakdown.optimizer for e in estimates}

    adamw, adafactor = plan("adamw"), plan("adafactor")
    assert adamw.keys() == adafactor.keys()
    for label, states in adamw.items():
        if "offload" in label:
            assert states == adafactor[label] == 0  # on the host
        elif "NO_SHARD" in label:
            # whole tensors: Adafactor factors their second moment (1.2% of the parameter bytes)
            assert 0 < adafactor[label] < 0.01 * states
        else:  # FSDP1's sharded flat views: one state where AdamW keeps two
            assert 2 * adafactor[label] == states


def test_micro_batch_sizes_come_from_the_options_the_batch_or_the_default() -> None:
    model = torch.nn.Linear(4, 4)
    assert micro_batch_sizes(BuiltModel(model), PlanOptions()) == DEFAULT_MICRO_BATCH_SIZES
    assert DEFAULT_MICRO_BATCH_SIZES == (1, 2, 4, 8)
    batch = torch.zeros(3, 4)
    assert micro_batch_sizes(BuiltModel(model, batch=batch), PlanOptions()) == (3,)
    asked = PlanOptions(batch_size="2,6")
    assert micro_batch_sizes(BuiltModel(model, batch=batch), asked) == (2, 6)

    class Fixed:  # a loader that makes its batches itself
        fixed, samples = True, 5

    assert micro_batch_sizes(BuiltModel(model, batch=batch, data=Fixed()), asked) == (5,)


def test_a_plan_is_labelled_as_the_user_named_the_model() -> None:
    options = PlanOptions(gpus=2, gpu_memory="8GiB", batch_size="1")
    target = "examples/gpt.py:build"
    request = make_request(target, options, kwargs={"size": "tiny"})
    assert request.label == "examples/gpt.py:build size='tiny'"
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    request = make_request(module, options)
    assert request.label == "torch.nn.modules.container.Sequential"
    assert make_request(TargetSpec(spec=target), options).label == target


def test_an_offloading_answer_without_host_memory_says_what_it_assumes() -> None:
    # 1 GPU of 2000 MiB: only CPU offload fits this 8-layer model (FSDP1 at one rank keeps a
    # copy of the parameters and their gradients on the GPU, not AdamW's states), first
    options = PlanOptions(gpus=1, gpu_memory="2000MiB", batch_size="1", precision="32-true")
    kwargs = {"size": "tiny", "n_layer": 8, "d_model": 768, "vocab_size": 8192}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = make_plan(make_request("examples/gpt.py:build", options, kwargs=kwargs))
    first = plan.estimates[0]
    assert first.fits and first.candidate.cpu_offload
    said = [str(w.message) for w in caught if w.category is PlanWarning]
    assert (
        f"offload needs {plan_module.format_bytes(first.host_peak)} of host memory per node "
        f"({first.candidate.label()}), assumed to be there (no host memory given); give "
        "--host-memory / host_memory= for yours"
    ) in said
    assert plan_module.host_memory_note(list(plan.estimates), H100.model_copy(
        update={"host_memory": 2**40})) is None  # fmt: skip
    assert plan_module.host_memory_note([], H100) is None
    no_offload = [e for e in plan.estimates if not e.candidate.cpu_offload]
    assert plan_module.host_memory_note(no_offload, H100) is None  # none of them fits
    fitting = [first.model_copy(update={"candidate": first.candidate.model_copy(
        update={"cpu_offload": False})})]  # fmt: skip
    assert plan_module.host_memory_note(fitting, H100) is None


def test_no_gpu_warning_is_a_plan_warning() -> None:
    assert issubclass(NoGPUWarning, PlanWarning)


def test_the_fewest_nodes_on_which_something_fits(monkeypatch) -> None:
    # an 8-layer model on 2 GPUs of 1350 MiB with 520 MiB of host memory per node: only CPU
    # offload fits the GPUs from 3 nodes on, and its 1.14 GiB of host memory per node (pinned
    # blocks rounded to powers of two) needs 3 nodes to spread it
    kwargs = {"size": "tiny", "n_layer": 8, "d_model": 768, "vocab_size": 8192}

    def planned(nodes: int) -> plan_module.Plan:
        options = PlanOptions(gpus=2, nodes=nodes, gpu_memory="1350MiB", host_memory="520MiB",
                              batch_size="1", precision="32-true")  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return make_plan(make_request("examples/gpt.py:build", options, kwargs=kwargs))

    one, two, three = planned(1), planned(2), planned(3)
    assert not any(e.fits for e in (*one.estimates, *two.estimates))
    roomiest = three.ranked("headroom")[0]
    assert roomiest.fits
    for plan in (one, two):  # found by doubling then halving, from wherever the plan starts
        nodes, there = plan_module.fits_elsewhere(plan)
        assert nodes == 3 and there.candidate == roomiest.candidate
        assert there.headroom == roomiest.headroom and there.candidate.cpu_offload
    assert plan_module.fits_elsewhere(one, max_nodes=2) is None
    assert plan_module.fits_elsewhere(one, max_nodes=4)[0] == 3  # the most nodes, included
    assert plan_module.fits_elsewhere(one, max_nodes=3)[0] == 3  # not skipped by doubling


def test_simulate_refines_the_best_candidates_by_simulation() -> None:
    # --simulate 1: the best ranked candidate's peak is the simulation's (real FSDP on fake
    # tensors, exact to the allocator), every other one stays analytic
    options = PlanOptions(gpus=2, gpu_memory="8GiB", batch_size="1", precision="32-true",
                          simulate=1)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(make_request("examples/gpt.py:build", options, kwargs={"size": "tiny"}))
    methods = [e.method for e in plan.estimates]
    assert methods.count("simulated") == 1 and methods.count("analytic") == len(methods) - 1


def test_a_seq_len_that_contradicts_the_batch_is_refused_word_for_word() -> None:
    from autoshard.plan import resolve_workload

    built = BuiltModel(torch.nn.Embedding(100, 4), batch=torch.zeros(2, 32, dtype=torch.long))
    with pytest.raises(ConfigError) as refused:
        resolve_workload(built, PlanOptions(seq_len=64), "the target")
    assert str(refused.value) == (
        "seq_len 64 but the batch the target returns has 32 tokens per sample, and that batch is "
        "what is measured: build it with 64 (e.g. --arg seq_len=64, or kwargs={'seq_len': 64} in "
        "code) or leave out --seq-len / seq_len="
    )


def test_a_loader_that_makes_its_batches_says_which_size_is_planned() -> None:
    from autoshard.plan import resolve_workload

    class Fixed:  # a DataLoader with its own batch_sampler
        fixed, samples, origin = True, 5, "the DataLoader"

    built = BuiltModel(torch.nn.Linear(4, 4), batch=torch.zeros(5, 4), data=Fixed())
    workload, notes = resolve_workload(built, PlanOptions(batch_size="2,6"))
    assert workload.micro_batch_size == 5
    assert notes == [
        "micro-batch 5, not --batch-size 2,6: the DataLoader makes its batches itself (its own "
        "batch_sampler, batch_size=None or made batches), so trials and estimates use its size; "
        "give a DataLoader with batch_size= to compare sizes"
    ]
    _, notes = resolve_workload(built, PlanOptions(batch_size="5"))
    assert notes[0].startswith("micro-batch 5: the DataLoader makes its batches itself")


def test_a_request_for_trials_without_a_gpu_plans_two_processes_and_the_vocabulary(no_gpu):
    from autoshard.plan import resolve_workload

    model = torch.nn.Sequential(torch.nn.Embedding(100, 4), torch.nn.Linear(4, 100))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        request = make_request(model, PlanOptions(gpu_memory="8GiB"), trials=True)
    assert request.hardware.gpus_per_node == 2
    workload, _ = resolve_workload(BuiltModel(model), PlanOptions())
    assert workload.vocab_size == 100 and workload.seq_len == 4096
