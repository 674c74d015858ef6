"""The GPU hardware catalogue: the facts a user would otherwise look up on a datasheet (memory,
dense FLOP/s per precision, memory bandwidth, the links inside and between nodes), each entry
with its sources.

Conventions, the same for every entry:

- FLOP/s are **dense** peaks. NVIDIA's datasheets print tensor-core rates "with sparsity" (marked
  with an asterisk, 2:4 structured sparsity, which FSDP training never uses); those are halved
  here. ``fp32_flops`` is the non-tensor (CUDA-core / vector) rate, ``tf32_flops`` the dense
  tensor-core TF32 rate that ``torch.backends.cuda.matmul.allow_tf32`` uses.
- Bandwidths are bytes/s in **one direction** (vendors print NVLink and PCIe as the sum of both
  directions: "900 GB/s NVLink" is 450 GB/s each way). They are the links' peak rates; what NCCL
  achieves is lower, which the speed model's efficiency factors (fitted by trials) account for.
- ``memory`` is the datasheet capacity read as GiB ("80 GB" HBM is 5 stacks of 16 GiB), the
  convention of ``--gpu-memory 80GiB``. The driver reports 1-7% less (ECC and reserved memory);
  when a GPU is visible, autoshard uses ``torch.cuda.get_device_properties().total_memory``.
- ``inter_node_bandwidth`` is an assumption about the cluster, not a property of the GPU: the
  network usually sold with this GPU (each entry's ``notes`` says which). Override it with
  ``Hardware(inter_node_bandwidth=...)`` / ``--inter-node-bandwidth``.

>>> from autoshard.gpus import gpu_spec, match_gpu_name
>>> spec = gpu_spec("h100-sxm")
>>> spec.bf16_flops / 1e12, spec.intra_node_bandwidth / 1e9
(989.5, 450.0)
>>> match_gpu_name("NVIDIA A100-SXM4-40GB")
'a100-40gb-sxm'
"""

from __future__ import annotations

import re

from pydantic import Field

from autoshard.config import Frozen
from autoshard.errors import ConfigError
from autoshard.gpu_entries import ENTRIES

DEFAULT_GPU = "h100-sxm"
"""Assumed when no GPU is given and none is visible (callers warn that they assumed it)."""


class GPUSpec(Frozen):
    """One GPU model as a training cluster sees it: its memory, its dense peak FLOP/s per
    precision, and the links to the other GPUs, to the network and to the host.

    >>> from autoshard.gpus import gpu_spec
    >>> a100 = gpu_spec("a100-80gb-sxm")
    >>> a100.memory // 2**30, a100.bf16_flops / 1e12, a100.hbm_bandwidth / 1e9
    (80, 312.0, 2039.0)
    """

    id: str = Field(..., description="Catalogue id, e.g. 'h100-sxm' (what --gpu takes).")
    name: str = Field(..., description="Full product name, e.g. 'NVIDIA H100 SXM5 80GB'.")
    memory: int = Field(
        ..., gt=0, description="Datasheet memory capacity in bytes (GB read as GiB)."
    )
    bf16_flops: float = Field(
        ..., gt=0, description="Dense (no sparsity) bf16 peak, FLOP/s (tensor cores)."
    )
    fp16_flops: float = Field(
        ..., gt=0, description="Dense fp16 peak with fp32 accumulation, FLOP/s (tensor cores)."
    )
    tf32_flops: float = Field(..., gt=0, description="Dense tensor-core TF32 peak, FLOP/s.")
    fp32_flops: float = Field(
        ..., gt=0, description="Non-tensor (CUDA-core / vector) fp32 peak, FLOP/s."
    )
    hbm_bandwidth: float = Field(
        ..., gt=0, description="Peak device-memory (HBM or GDDR) bandwidth, bytes/s."
    )
    intra_node_bandwidth: float = Field(
        ...,
        gt=0,
        description="Peak bytes/s one GPU sends in one direction over the node's GPU "
        "interconnect (NVLink/NVSwitch, Infinity Fabric, or PCIe where there is none).",
    )
    intra_node_link: str = Field(
        ..., description="What that link is, e.g. 'NVLink 4 via NVSwitch (450 GB/s per direction)'."
    )
    inter_node_bandwidth: float = Field(
        ...,
        gt=0,
        description="Bytes/s one node sends in one direction over the network of a typical "
        "cluster of this GPU (an assumption, stated in notes).",
    )
    host_link_bandwidth: float = Field(
        ...,
        gt=0,
        description="Peak bytes/s in one direction between the GPU and host memory (the card's "
        "PCIe generation), what CPU offload moves parameters and gradients over.",
    )
    fresh_page_bandwidth: float | None = Field(
        None,
        gt=0,
        description="Bytes/s at which a process writes memory it has just mapped (each page "
        "faults in and is zeroed first): what every new tensor costs where memory is not reused. "
        "None on GPUs (the caching allocator reuses its blocks). CPU trial workers fix glibc's "
        "mmap threshold so that their resident set measures live tensors "
        "(autoshard.trials.group), and so map every tensor above it afresh.",
    )
    matmul_fraction: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Achievable / dense peak of large 16-bit matrix products on this GPU (the "
        "'maximum achievable matmul FLOPS' of a brute-force shape search): what a perfectly "
        "shaped product reaches, before a training step's own losses. Default 0.8 where no "
        "measurement is catalogued (NVIDIA's measured parts: 0.80-0.87).",
    )
    attention_fraction: float = Field(
        0.35,
        gt=0,
        le=1,
        description="Achievable / dense peak of fused attention (FlashAttention-2 class kernels, "
        "as torch's scaled_dot_product_attention runs them), forward and backward. Default 0.35 "
        "where no figure is catalogued (FlashAttention-2 on Hopper).",
    )
    step_efficiency: float = Field(
        0.7,
        gt=0,
        le=1,
        description="Achieved / achievable FLOP/s of a training step's counted FLOPs on this GPU "
        "(recomputed forwards counted): the uncalibrated ``SpeedFactors.compute_efficiency`` for "
        "it. Hopper reaches a smaller share of its achievable rate than Ampere (its 3.2x the "
        "FLOP/s meet 1.6x the bandwidth and the same launch and synchronisation gaps). Default "
        "0.7 where no published runs say otherwise.",
    )
    fp8_flops: float | None = Field(
        None,
        gt=0,
        description="Dense (no sparsity) fp8 peak, FLOP/s (e4m3 tensor cores); None: the GPU has "
        "no fp8 tensor cores, so float8 training is never planned on it.",
    )
    fp32_step_efficiency: float | None = Field(
        None,
        gt=0,
        le=1,
        description="The same share for fp32 steps on the CUDA cores (``32-true`` without "
        "TF32), where the launch gaps and memory-bound work that hold tensor-core steps back "
        "are a far smaller share of the step; None: ``step_efficiency``.",
    )
    generation: str = Field(
        "",
        description="The GPU's architecture generation (ampere, ada, hopper, blackwell, cdna3, "
        "cpu): whose published MFU ceilings cap its predictions "
        "(:mod:`autoshard.predict.ceilings`).",
    )
    matches: tuple[tuple[str, ...], ...] = Field(
        (),
        description="Device names that are this GPU, as ``torch.cuda.get_device_name()`` reads: "
        "each a set of tokens (upper case, split at spaces, '-', '_', '/', ',' and brackets) "
        "that must all be in the name; the most specific match wins.",
    )
    unless: tuple[str, ...] = Field(
        (), description="Tokens that make a matching device name another part (e.g. 'NVL')."
    )
    notes: str = Field(..., description="Assumptions and caveats behind the numbers.")
    sources: tuple[str, ...] = Field(
        ..., min_length=1, description="Datasheets and documents the numbers come from."
    )

    @property
    def host_is_device(self) -> bool:
        """The CPU worker processes' entry (``cpu-gloo``): the host runs the kernels itself, so
        issuing an operation adds to its work instead of hiding under a GPU's."""
        return self.id == "cpu-gloo"


CATALOGUE: dict[str, GPUSpec] = {
    spec.id: spec for spec in (GPUSpec.model_validate(entry) for entry in ENTRIES)
}
"""Every catalogue entry by id (:mod:`autoshard.gpu_entries`, one entry per GPU)."""


def gpu_spec(gpu_id: str) -> GPUSpec:
    """The catalogue entry ``gpu_id`` (case and surrounding spaces ignored).

    >>> from autoshard.gpus import gpu_spec
    >>> gpu_spec("L40S").memory // 2**30
    48
    >>> gpu_spec("v100")
    Traceback (most recent call last):
    ...
    autoshard.errors.ConfigError: unknown GPU 'v100': use one of a10, a100-40gb-pcie, ...
    """
    key = gpu_id.strip().lower()
    if key not in CATALOGUE:
        raise ConfigError(f"unknown GPU {gpu_id!r}: use one of {', '.join(sorted(CATALOGUE))}")
    return CATALOGUE[key]


def _tokens(device_name: str) -> set[str]:
    # Tokens, not substrings: "L4" is a substring of "L40S", "H200" of "GH200", "A10" of "A100".
    return {t for t in re.split(r"[\s\-_/,()]+", device_name.upper()) if t}


def match_gpu_name(device_name: str) -> str | None:
    """The catalogue id of a device named as ``torch.cuda.get_device_name()`` names it, or None
    when no entry's ``matches`` fit it (H100 NVL, GH200, L40, V100, ...: :func:`unknown_gpu`
    says so). Of the entries that fit, the one whose match names the most tokens.

    >>> from autoshard.gpus import match_gpu_name
    >>> match_gpu_name("NVIDIA H100 80GB HBM3"), match_gpu_name("NVIDIA H100 PCIe")
    ('h100-sxm', 'h100-pcie')
    >>> match_gpu_name("NVIDIA A100 80GB PCIe"), match_gpu_name("Tesla V100-SXM2-16GB")
    ('a100-80gb-pcie', None)
    """
    tokens = _tokens(device_name)
    fits = [
        (len(match), spec.id)
        for spec in CATALOGUE.values()
        if not tokens & set(spec.unless)
        for match in spec.matches
        if set(match) <= tokens
    ]
    return max(fits)[1] if fits else None


def unknown_gpu(device_name: str) -> str:
    """One line for a visible GPU that no catalogue entry matches: which entries exist, and
    how to plan for one of them.

    >>> from autoshard.gpus import unknown_gpu
    >>> unknown_gpu("Tesla V100-SXM2-16GB")[:69]
    "GPU 'Tesla V100-SXM2-16GB' is not in autoshard's catalogue (entries: "
    """
    known = ", ".join(sorted(i for i in CATALOGUE if i != "cpu-gloo"))
    return (
        f"GPU {device_name!r} is not in autoshard's catalogue (entries: {known}): its speeds "
        "are not known; give --gpu with the nearest entry (gpu= in code), or add an entry to "
        "autoshard/gpu_entries.py"
    )
