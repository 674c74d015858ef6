"""The planning pipeline's own rules (autoshard.plan): which switches (torch.compile, float8) are
planned, the defaults a plan assumes, its notes, and the fewest nodes on which something fits.
Options are tests/test_options.py's, hardware tests/test_detect.py's, the workload
tests/test_workload.py's. Quick: no trial runs."""

from __future__ import annotations

import warnings

import pytest
import torch

import autoshard.detect as detect_module
import autoshard.plan as plan_module
from autoshard.config import Hardware, Precision
from autoshard.errors import ConfigError, PlanWarning
from autoshard.options import PlanOptions
from autoshard.plan import make_plan, make_request, planned_switches
from autoshard.target.resolve import BuiltModel, TargetSpec
from autoshard.workload import resolve_workload

GIB = 2**30


@pytest.fixture
def no_gpu(monkeypatch) -> None:
    monkeypatch.setattr(detect_module, "_visible_gpus", lambda: 0)


# --------------------------------------------------------------------------------------------
# torch.compile and float8: planned where they go, a pin taken or refused
# --------------------------------------------------------------------------------------------

H100 = Hardware(gpus_per_node=8, gpu_memory=80 * GIB, gpu="h100-sxm")


@pytest.fixture
def compiles(monkeypatch) -> None:
    monkeypatch.setattr(plan_module, "compile_supported", lambda: None)


def test_unpinned_switches_are_planned_where_they_go(compiles, monkeypatch):
    fsdp2 = PlanOptions(engine="fsdp2")
    assert planned_switches(fsdp2, H100) == ((False, True), (False, True), None)
    # float8 needs FSDP2 and fp8 tensor cores; compile needs a torch that compiles here
    assert planned_switches(PlanOptions(), H100)[1] == (False,)
    a100 = H100.model_copy(update={"gpu": "a100-80gb-sxm"})
    assert planned_switches(fsdp2, a100)[1] == (False,)
    monkeypatch.setattr(plan_module, "compile_supported", lambda: "no dynamo here")
    assert planned_switches(fsdp2, H100)[0] == (False,)


def test_pinned_switches_are_taken_or_refused_in_one_line(compiles, monkeypatch) -> None:
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


def test_a_request_for_trials_without_a_gpu_plans_two_processes_and_the_vocabulary(no_gpu):
    model = torch.nn.Sequential(torch.nn.Embedding(100, 4), torch.nn.Linear(4, 100))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        request = make_request(model, PlanOptions(gpu_memory="8GiB"), trials=True)
    assert request.hardware.gpus_per_node == 2
    workload, _ = resolve_workload(BuiltModel(model), PlanOptions())
    assert workload.vocab_size == 100 and workload.seq_len == 4096
