"""The hardware to plan for: the options given, the visible GPUs for the rest, and this machine's
memory (its RAM, or its container's cgroup limit where that is lower) for CPU offload."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from autoshard.config import Hardware
from autoshard.errors import ConfigError, NoGPUWarning, PlanWarning
from autoshard.options import PlanOptions, options_from
from autoshard.units import format_bytes

# The catalogue's entry for CPU worker processes (gloo): planning for them, not for GPUs.
CPU_GLOO_ID = "cpu-gloo"
# CPU worker processes when trials run without a GPU (gloo).
DEFAULT_CPU_WORKERS = 2


def _visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def detect_hardware(
    options: PlanOptions | None = None, *, trials: bool = False, **values: Any
) -> Hardware:
    """The GPUs to plan for: the options given, the visible GPUs for the rest.

    Without a visible GPU, ``gpus`` must be given for planning (trials run on 2 CPU processes
    unless told otherwise), and the GPU model is the catalogue's default, said in a warning.

    >>> import warnings
    >>> from autoshard import detect_hardware
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     cluster = detect_hardware(gpus=8, gpu_memory="80GiB")
    >>> cluster.world_size, cluster.gpu_memory // 2**30
    (8, 80)
    """
    from autoshard.gpus import DEFAULT_GPU, gpu_spec, match_gpu_name

    opts = options or options_from(PlanOptions, values)
    visible = _visible_gpus()
    gpu_id = opts.gpu
    if gpu_id is None and visible:
        gpu_id = match_gpu_name(torch.cuda.get_device_name(0))
    if gpu_id is None and not visible and opts.gpu_memory is None:
        gpu_id = DEFAULT_GPU
        warnings.warn(
            f"no GPU visible and no gpu/gpu_memory given: planning for {gpu_spec(gpu_id).name}"
            f" ({gpu_id}); give --gpu or --gpu-memory for yours",
            PlanWarning,
            stacklevel=3,
        )
    if opts.gpu_memory is not None:
        memory = opts.gpu_memory
    elif visible and opts.gpu is None:
        memory = torch.cuda.get_device_properties(0).total_memory
    else:
        assert gpu_id is not None
        memory = gpu_spec(gpu_id).memory
    gpus = opts.gpus
    if gpus is None:
        if visible:
            gpus = visible
        elif trials:
            gpus = DEFAULT_CPU_WORKERS
        else:
            raise ConfigError(
                "no GPU visible here: give gpus (--gpus N, GPUs per node) for the GPUs to plan for"
            )
    host_memory = opts.host_memory
    if host_memory is None and plans_this_machine(opts, visible, gpu_id):
        host_memory = machine_memory()  # what CPU offload can use here
    host_cores = opts.host_cores
    if host_cores is None and plans_this_machine(opts, visible, gpu_id):
        host_cores = os.cpu_count()  # the cores a launcher divides over this node's ranks
    if not visible:
        warnings.warn(
            f"no GPU visible: planning for {opts.nodes} x {gpus} GPUs of {format_bytes(memory)}"
            + ("; trials run on CPU processes with gloo" if trials else ""),
            NoGPUWarning,
            stacklevel=3,
        )
    return Hardware(
        # The catalogue's CPU entry plans for the CPU processes themselves (gloo, no CUDA
        # allowance): trials then measure what is planned, and their speed decides.
        backend="gloo" if gpu_id == CPU_GLOO_ID else "nccl",
        gpus_per_node=gpus,
        nodes=opts.nodes,
        gpu_memory=memory,
        host_memory=host_memory,
        host_cores=host_cores,
        bf16_supported=torch.cuda.is_bf16_supported() if visible else True,
        gpu=gpu_id,
        intra_node_bandwidth=opts.intra_node_bandwidth,
        inter_node_bandwidth=opts.inter_node_bandwidth,
    )


def plans_this_machine(options: PlanOptions, visible: int, gpu_id: str | None) -> bool:
    """Whether the plan is for this machine: its own GPUs, detected rather than given (or its
    CPU processes, ``--gpu cpu-gloo`` on one node), so that its RAM is the host memory."""
    if gpu_id == CPU_GLOO_ID:
        return options.nodes == 1
    return bool(visible) and options.gpu is None and (options.gpus or visible) <= visible


def machine_memory() -> int | None:
    """This machine's RAM, or its container's memory limit where that is lower; None where
    neither can be read."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return total if total > 0 else None
