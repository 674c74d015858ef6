"""The hardware planned for (autoshard.detect): the GPUs given, the visible ones for the rest, the
assumed GPU model said in a warning, and this machine's memory (its container's limit where lower)
for CPU offload. Quick: no model is built."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import autoshard.detect as detect_module
from autoshard.config import Hardware
from autoshard.detect import detect_hardware, plans_this_machine
from autoshard.errors import ConfigError, NoGPUWarning, PlanWarning
from autoshard.options import PlanOptions

GIB = 2**30

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
    monkeypatch.setattr(detect_module, "_visible_gpus", lambda: 0)


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
    assert hardware.gpus_per_node == 2 == detect_module.DEFAULT_CPU_WORKERS


def test_the_cpu_gloo_entry_plans_this_machines_processes(no_gpu) -> None:
    hardware, said = _hardware(trials=True, gpu="cpu-gloo")
    assert hardware.backend == "gloo" and hardware.gpus_per_node == 2
    # offload there goes to this machine's memory, the one the processes share
    assert hardware.host_memory == detect_module.machine_memory() is not None
    assert not any(s.startswith("PlanWarning") for s in said)
    # on several nodes it is not this machine: the host memory is unknown
    assert _hardware(trials=True, gpu="cpu-gloo", nodes=2)[0].host_memory is None


def test_visible_gpus_are_planned_as_they_are(monkeypatch) -> None:
    class Properties:
        total_memory = 79 * GIB

    monkeypatch.setattr(detect_module, "_visible_gpus", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=0: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _=0: Properties())
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    hardware, said = _hardware()
    assert said == []
    assert (hardware.gpus_per_node, hardware.gpu, hardware.gpu_memory) == (
        8, "a100-80gb-sxm", 79 * GIB)  # fmt: skip
    assert not hardware.bf16_supported
    assert hardware.host_memory == detect_module.machine_memory()  # these GPUs' own host
    # fewer GPUs than are here: still this machine; a named model or more GPUs: not
    assert _hardware(gpus=4)[0].host_memory == detect_module.machine_memory()
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
    monkeypatch.setattr(detect_module.os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096,
                        "SC_PHYS_PAGES": 4 * GIB // 4096}[name])  # fmt: skip
    limits: dict[str, str] = {}

    def read_text(self: Path, *args, **kwargs) -> str:
        if str(self) not in limits:
            raise OSError(str(self))
        return limits[str(self)]

    monkeypatch.setattr(Path, "read_text", read_text)
    assert detect_module.machine_memory() == 4 * GIB  # no cgroup limit readable
    limits["/sys/fs/cgroup/memory.max"] = "max\n"
    limits["/sys/fs/cgroup/memory/memory.limit_in_bytes"] = f"{GIB}\n"
    assert detect_module.machine_memory() == GIB  # cgroup v1's limit, v2's "max"
    limits["/sys/fs/cgroup/memory.max"] = f"{2 * GIB}\n"
    assert detect_module.machine_memory() == GIB  # the lowest of all
    limits["/sys/fs/cgroup/memory/memory.limit_in_bytes"] = f"{8 * GIB}"
    assert detect_module.machine_memory() == 2 * GIB  # a limit above the RAM is no limit
    monkeypatch.setattr(detect_module.os, "sysconf", lambda name: (_ for _ in ()).throw(
        ValueError(name)))  # fmt: skip
    assert detect_module.machine_memory() is None


def test_no_gpu_warning_is_a_plan_warning() -> None:
    assert issubclass(NoGPUWarning, PlanWarning)
