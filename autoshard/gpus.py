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

GiB = 2**30
GB = 1e9  # vendors' bandwidths are decimal: 1 GB/s = 1e9 bytes/s
TFLOPS = 1e12
Gbit = 1e9 / 8  # network links are sold in Gb/s: 400 Gb/s = 50 GB/s

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
    notes: str = Field(..., description="Assumptions and caveats behind the numbers.")
    sources: tuple[str, ...] = Field(
        ..., min_length=1, description="Datasheets and documents the numbers come from."
    )

    @property
    def host_is_device(self) -> bool:
        """The CPU worker processes' entry (``cpu-gloo``): the host runs the kernels itself, so
        issuing an operation adds to its work instead of hiding under a GPU's."""
        return self.id == "cpu-gloo"


# --------------------------------------------------------------------------------------------
# Shared facts (one place each, cited where they are used)
# --------------------------------------------------------------------------------------------

_PCIE4 = 32 * GB  # PCIe Gen4 x16: "64 GB/s" bidirectional on every Ampere/Ada datasheet
_PCIE5 = 64 * GB  # PCIe Gen5 x16: "128 GB/s" bidirectional on the Hopper datasheets

_A100_DATASHEET = (
    "NVIDIA A100 Tensor Core GPU datasheet: https://www.nvidia.com/content/dam/en-zz/Solutions/"
    "Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (FP32 19.5, TF32 "
    "156|312*, BF16/FP16 312|624* TFLOPS, *with sparsity; HBM 1,555 GB/s (40GB), 2,039 GB/s "
    "(80GB SXM), 1,935 GB/s (80GB PCIe); NVLink 600 GB/s; PCIe Gen4 64 GB/s); table quoted at "
    "https://glennklockwood.com/garden/processors/A100"
)
_DGX_A100 = (
    "NVIDIA DGX A100 datasheet: https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
    "nvidia-dgx-a100-datasheet.pdf (8x single-port ConnectX-6 200 Gb/s HDR InfiniBand for the "
    "compute network)"
)
_H100_DATASHEET = (
    "NVIDIA H100 Tensor Core GPU datasheet: https://resources.nvidia.com/en-us-tensor-core/"
    "nvidia-tensor-core-gpu-datasheet (SXM: FP32 67, TF32 989*, BF16/FP16 1,979* TFLOPS, "
    "3.35 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s; PCIe: FP32 51, TF32 756*, BF16/FP16 "
    "1,513* TFLOPS, 2 TB/s, NVLink bridge 600 GB/s; *with sparsity, dense is half); table "
    "reproduced at https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html"
)
_DGX_H100 = (
    "NVIDIA DGX H100/H200 datasheets: https://resources.nvidia.com/en-us-dgx-systems/"
    "ai-enterprise-dgx (8x single-port ConnectX-7 400 Gb/s InfiniBand/Ethernet, one per GPU)"
)
_NVIDIA_PRODUCT_BRIEF_H100_PCIE = (
    "NVIDIA H100 PCIe GPU Product Brief PB-11133-001_v02 (Nov 2022): PCIe Gen5 card, 350 W, "
    "memory bandwidth > 2,000 GB/s"
)


def _spec(**fields: object) -> GPUSpec:
    return GPUSpec.model_validate(fields)


# What the kernels reach, apart from the datasheet peaks (the step-time model divides matrix
# products and attention by these rates, then by its compute efficiency).
_MAMF = (
    "Maximum Achievable Matmul FLOPS table (bf16, v2 measurements), S. Bekman, Machine Learning "
    "Engineering, compute/accelerator/README.md: https://github.com/stas00/ml-engineering/blob/"
    "master/compute/accelerator/README.md#maximum-achievable-matmul-flops-comparison-table "
    "(A100 SXM 271.2 of 312 TFLOPS = 86.9%; A100 PCIe 252.9 = 81.1%; H100 SXM 794.5 of 989 = "
    "80.3%; GH200 828.6 = 83.6%; MI300X 668.4 of 1300 = 51.4%)"
)
_FA2 = (
    "FlashAttention-2 (T. Dao, arXiv:2307.08691): 'reaching 50-73% of the theoretical maximum "
    "FLOPs/s on A100' (forward up to 73%, backward lower; 0.6 taken for forward + backward)"
)
_FA3 = (
    "FlashAttention-3 (J. Shah et al., arXiv:2407.08608): 'FlashAttention-2 achieving only 35% "
    "utilization on the H100 GPU'; Azure ND H100 v5 benchmark guide: FlashAttention-2 at head "
    "dim 128, batch 2, 8192 tokens, 327.9 TFLOPS (33% of 989): https://github.com/"
    "samuel-bohman/AI-benchmarking-guide/blob/main/Azure_Results/ND_H100_v5_results.md"
)
# A training step's share of the achievable rate, per GPU generation: the published hardware
# FLOPs utilisation (recompute counted) of the fitting set's runs over the achievable fraction:
# A100 median 0.69 (80GB, 15 runs: llm-foundry, IBM/PyTorch FSDP blog) and 0.79 (40GB, 14:
# llm-foundry); H100 SXM 0.54 (24 runs at <= 4,096 tokens, where attention is a small share:
# llm-foundry, IBM) with attention at its own rate, about 0.6 of the matrix rate. H200: the
# H100's die (no run published with its HFU). Held-out check: benchmarks/results/
# step_time_published.md ("Terms", first).
_STEP_EFFICIENCY = {"ampere": 0.75, "hopper": 0.6}
_STEP_EFFICIENCY_SOURCE = (
    "Step efficiency per GPU generation: published hardware FLOPs utilisation of the fitting "
    "set of benchmarks/step_time_published.py (llm-foundry's benchmarking README: A100 40GB, "
    "A100 80GB, H100 SXM; 'Maximizing training throughput using PyTorch FSDP', IBM/PyTorch "
    "blog, 2024: A100 80GB, H100 SXM) over the catalogue's achievable matmul fraction"
)
_GENERATION = {
    "a100-40gb-sxm": "ampere",
    "a100-80gb-sxm": "ampere",
    "a100-40gb-pcie": "ampere",
    "a100-80gb-pcie": "ampere",
    "h100-sxm": "hopper",
    "h100-pcie": "hopper",
    "h200": "hopper",
}
_ACHIEVABLE: dict[str, tuple[float, float, tuple[str, ...]]] = {
    # id: (matmul_fraction, attention_fraction, sources)
    "a100-40gb-sxm": (271.2 / 312, 0.6, (_MAMF, _FA2)),
    "a100-80gb-sxm": (271.2 / 312, 0.6, (_MAMF, _FA2)),
    "a100-40gb-pcie": (252.9 / 312, 0.6, (_MAMF, _FA2)),
    "a100-80gb-pcie": (252.9 / 312, 0.6, (_MAMF, _FA2)),
    "h100-sxm": (794.5 / 989, 0.35, (_MAMF, _FA3)),
    # The H200 is the H100 SXM's GH100 die at the same 700 W: the H100 SXM's fractions (the
    # 900 W GH200 reaches 83.6%).
    "h200": (794.5 / 989, 0.35, (_MAMF, _FA3)),
    "h100-pcie": (0.8, 0.35, (_FA3,)),
    "mi300x": (668.4 / 1300, 0.35, (_MAMF,)),
    # Ampere/Ada cards run the same sm80 FlashAttention-2 kernels as the A100; no matmul figure
    # catalogued (the 0.8 default).
    "l4": (0.8, 0.6, (_FA2,)),
    "l40s": (0.8, 0.6, (_FA2,)),
    "a10": (0.8, 0.6, (_FA2,)),
    "a40": (0.8, 0.6, (_FA2,)),
    "a10g": (0.8, 0.6, (_FA2,)),
    # CPU processes: the rates are measured on this machine (autoshard.predict.speed).
    "cpu-gloo": (1.0, 1.0, ()),
}


# fp8 tensor cores: Hopper (sm_90), Ada (sm_89) and CDNA3. torchao's float8 training runs its
# matmuls with torch._scaled_mm, which needs sm_89 or later, or an MI300 (torchao 0.18,
# torchao/float8/inference.py: is_sm_at_least_89() or is_MI300()). Ampere (A100, A10, A10G)
# has none: its datasheets list TF32, BF16, FP16, INT8 and INT4 tensor rates only.
_TORCHAO_FP8 = (
    "torchao 0.18 float8 training: torch._scaled_mm needs CUDA compute capability 8.9+ (Ada, "
    "Hopper) or an AMD MI300 (torchao/float8/inference.py, is_sm_at_least_89 / is_MI300): "
    "https://github.com/pytorch/ao/tree/main/torchao/float8"
)
_FP8: dict[str, tuple[float, str]] = {
    # id: (dense fp8 FLOP/s, the datasheet's figure)
    "h100-sxm": (1979 * TFLOPS, "H100 SXM datasheet: FP8 3,958* TFLOPS (*sparse; dense half)"),
    "h100-pcie": (1513 * TFLOPS, "H100 PCIe datasheet: FP8 3,026* TFLOPS (*sparse; dense half)"),
    "h200": (1979 * TFLOPS, "H200 SXM datasheet: FP8 3,958* TFLOPS (*sparse; dense half)"),
    "l4": (242.5 * TFLOPS, "L4 datasheet: FP8 485* TFLOPS (*sparse; dense half); Ada, sm_89"),
    "l40s": (733 * TFLOPS, "L40S datasheet: FP8 733|1,466* TFLOPS (dense|sparse); Ada, sm_89"),
    "mi300x": (2614.9 * TFLOPS, "MI300X data sheet: FP8 2,614.9 TFLOPS dense (5,229.8 sparse)"),
}


def _with_achievable(spec: GPUSpec) -> GPUSpec:
    matmul, attention, sources = _ACHIEVABLE[spec.id]
    fp8 = _FP8.get(spec.id)
    if fp8 is not None:
        sources = (*sources, fp8[1], _TORCHAO_FP8)
    generation = _GENERATION.get(spec.id)
    if generation is not None:
        sources = (*sources, _STEP_EFFICIENCY_SOURCE)
    return spec.model_copy(
        update={
            "matmul_fraction": matmul,
            "attention_fraction": attention,
            "step_efficiency": _STEP_EFFICIENCY[generation] if generation else 0.7,
            "fp8_flops": fp8[0] if fp8 else None,
            "sources": spec.sources + tuple(s for s in sources if s not in spec.sources),
        }
    )


_ENTRIES: tuple[GPUSpec, ...] = (
    _spec(
        id="a100-40gb-sxm",
        name="NVIDIA A100 SXM4 40GB",
        memory=40 * GiB,
        bf16_flops=312 * TFLOPS,
        fp16_flops=312 * TFLOPS,
        tf32_flops=156 * TFLOPS,
        fp32_flops=19.5 * TFLOPS,
        hbm_bandwidth=1555 * GB,
        intra_node_bandwidth=300 * GB,
        intra_node_link="NVLink 3 via NVSwitch (600 GB/s total, 300 GB/s per direction)",
        inter_node_bandwidth=8 * 200 * Gbit,
        host_link_bandwidth=_PCIE4,
        notes="Network assumed as in a DGX/HGX A100 node: 8x 200 Gb/s HDR InfiniBand (200 GB/s "
        "per node per direction). The CUDA driver reports 42,405,855,232 bytes (39.5 GiB).",
        sources=(
            _A100_DATASHEET,
            _DGX_A100,
            "deviceQuery on an A100 SXM4 40GB: 'Total amount of global memory: 40441 MBytes "
            "(42405855232 bytes)', https://upb-pc2.atlassian.net/wiki/spaces/PC2DOK/pages/"
            "1900609/NVIDIA+A100+40GB+with+NVLINK",
        ),
    ),
    _spec(
        id="a100-80gb-sxm",
        name="NVIDIA A100 SXM4 80GB",
        memory=80 * GiB,
        bf16_flops=312 * TFLOPS,
        fp16_flops=312 * TFLOPS,
        tf32_flops=156 * TFLOPS,
        fp32_flops=19.5 * TFLOPS,
        hbm_bandwidth=2039 * GB,
        intra_node_bandwidth=300 * GB,
        intra_node_link="NVLink 3 via NVSwitch (600 GB/s total, 300 GB/s per direction)",
        inter_node_bandwidth=8 * 200 * Gbit,
        host_link_bandwidth=_PCIE4,
        notes="Same compute as the 40GB part; HBM2e. Network assumed as in a DGX/HGX A100 node: "
        "8x 200 Gb/s HDR InfiniBand (200 GB/s per node per direction).",
        sources=(_A100_DATASHEET, _DGX_A100),
    ),
    _spec(
        id="a100-40gb-pcie",
        name="NVIDIA A100 PCIe 40GB",
        memory=40 * GiB,
        bf16_flops=312 * TFLOPS,
        fp16_flops=312 * TFLOPS,
        tf32_flops=156 * TFLOPS,
        fp32_flops=19.5 * TFLOPS,
        hbm_bandwidth=1555 * GB,
        intra_node_bandwidth=_PCIE4,
        intra_node_link="PCIe Gen4 x16 (64 GB/s total, 32 GB/s per direction)",
        inter_node_bandwidth=100 * Gbit,
        host_link_bandwidth=_PCIE4,
        notes="The datasheet's peaks are the SXM part's; the 250 W PCIe card sustains lower "
        "clocks under load (expect the efficiency factor to absorb ~10%). GPUs talk over PCIe "
        "(an optional NVLink bridge joins pairs only, not modelled). Network assumed: one 100 "
        "Gb/s NIC per node (12.5 GB/s), typical of PCIe servers; an assumption, override it.",
        sources=(_A100_DATASHEET,),
    ),
    _spec(
        id="a100-80gb-pcie",
        name="NVIDIA A100 PCIe 80GB",
        memory=80 * GiB,
        bf16_flops=312 * TFLOPS,
        fp16_flops=312 * TFLOPS,
        tf32_flops=156 * TFLOPS,
        fp32_flops=19.5 * TFLOPS,
        hbm_bandwidth=1935 * GB,
        intra_node_bandwidth=_PCIE4,
        intra_node_link="PCIe Gen4 x16 (64 GB/s total, 32 GB/s per direction)",
        inter_node_bandwidth=100 * Gbit,
        host_link_bandwidth=_PCIE4,
        notes="300 W PCIe card; peaks as printed on the datasheet. GPUs talk over PCIe (an "
        "optional NVLink bridge joins pairs only, not modelled). Network assumed: one 100 Gb/s "
        "NIC per node (12.5 GB/s); an assumption, override it.",
        sources=(_A100_DATASHEET,),
    ),
    _spec(
        id="h100-sxm",
        name="NVIDIA H100 SXM5 80GB",
        memory=80 * GiB,
        bf16_flops=989.5 * TFLOPS,
        fp16_flops=989.5 * TFLOPS,
        tf32_flops=494.5 * TFLOPS,
        fp32_flops=67 * TFLOPS,
        hbm_bandwidth=3350 * GB,
        intra_node_bandwidth=450 * GB,
        intra_node_link="NVLink 4 via NVSwitch (900 GB/s total, 450 GB/s per direction)",
        inter_node_bandwidth=8 * 400 * Gbit,
        host_link_bandwidth=_PCIE5,
        notes="Dense = datasheet sparse / 2 (1,979* -> 989.5 bf16, 989* -> 494.5 TF32). Network "
        "assumed as in a DGX/HGX H100 node: 8x 400 Gb/s NDR InfiniBand (400 GB/s per node per "
        "direction).",
        sources=(
            _H100_DATASHEET,
            _DGX_H100,
            "H100 SXM5 theoretical TFLOPS table (BF16 matrix 989.4 dense, 1978.9 sparse; FP32 "
            "66.9): https://glennklockwood.com/garden/processors/h100",
        ),
    ),
    _spec(
        id="h100-pcie",
        name="NVIDIA H100 PCIe 80GB",
        memory=80 * GiB,
        bf16_flops=756.5 * TFLOPS,
        fp16_flops=756.5 * TFLOPS,
        tf32_flops=378 * TFLOPS,
        fp32_flops=51 * TFLOPS,
        hbm_bandwidth=2000 * GB,
        intra_node_bandwidth=_PCIE5,
        intra_node_link="PCIe Gen5 x16 (128 GB/s total, 64 GB/s per direction)",
        inter_node_bandwidth=200 * Gbit,
        host_link_bandwidth=_PCIE5,
        notes="Dense = datasheet sparse / 2 (1,513* -> 756.5 bf16, 756* -> 378 TF32); HBM2e. "
        "GPUs talk over PCIe (an NVLink bridge joins pairs only, not modelled). Network assumed: "
        "200 Gb/s per node (25 GB/s); an assumption about PCIe servers, override it.",
        sources=(_H100_DATASHEET, _NVIDIA_PRODUCT_BRIEF_H100_PCIE),
    ),
    _spec(
        id="h200",
        name="NVIDIA H200 SXM 141GB",
        memory=141 * GiB,
        bf16_flops=989.5 * TFLOPS,
        fp16_flops=989.5 * TFLOPS,
        tf32_flops=494.5 * TFLOPS,
        fp32_flops=67 * TFLOPS,
        hbm_bandwidth=4800 * GB,
        intra_node_bandwidth=450 * GB,
        intra_node_link="NVLink 4 via NVSwitch (900 GB/s total, 450 GB/s per direction)",
        inter_node_bandwidth=8 * 400 * Gbit,
        host_link_bandwidth=_PCIE5,
        notes="Same GH100 compute as the H100 SXM (dense = datasheet sparse / 2), HBM3e 141 GB at "
        "4.8 TB/s. The driver reports about 140 GiB. Network assumed as in a DGX/HGX H200 node: "
        "8x 400 Gb/s (400 GB/s per node per direction). The H200 NVL (PCIe) is a different part.",
        sources=(
            "NVIDIA H200 Tensor Core GPU datasheet: https://www.nvidia.com/en-us/data-center/h200/ "
            "(SXM: 141 GB HBM3e, 4.8 TB/s, BF16/FP16 1,979* TFLOPS, TF32 989*, FP32 67, NVLink "
            "900 GB/s, PCIe Gen5 128 GB/s; *with sparsity)",
            _DGX_H100,
        ),
    ),
    _spec(
        id="l4",
        name="NVIDIA L4 24GB",
        memory=24 * GiB,
        bf16_flops=121 * TFLOPS,
        fp16_flops=121 * TFLOPS,
        tf32_flops=60 * TFLOPS,
        fp32_flops=30.3 * TFLOPS,
        hbm_bandwidth=300 * GB,
        intra_node_bandwidth=_PCIE4,
        intra_node_link="PCIe Gen4 x16 (64 GB/s total, 32 GB/s per direction); no NVLink",
        inter_node_bandwidth=100 * Gbit,
        host_link_bandwidth=_PCIE4,
        notes="72 W card, GDDR6 (not HBM). Dense = datasheet sparse / 2 (242* -> 121 bf16/fp16, "
        "120* -> 60 TF32). The driver reports about 22.5 GiB: more than Hardware's 5% margin "
        "below the nominal 24 GiB. Network assumed as on Google Cloud g2-standard-96 (8x L4): "
        "100 Gb/s per node (12.5 GB/s).",
        sources=(
            "NVIDIA L4 Tensor Core GPU datasheet: https://resources.nvidia.com/en-us-data-center-"
            "overview/l4-gpu-datasheet (FP32 30.3, TF32 120*, BF16/FP16 242* TFLOPS, *with "
            "sparsity; 24 GB GDDR6, 300 GB/s; PCIe Gen4 x16 64 GB/s)",
            "Google Cloud, GPU machine types (G2: up to 8 L4, 100 Gbps): "
            "https://cloud.google.com/compute/docs/gpus",
        ),
    ),
    _spec(
        id="l40s",
        name="NVIDIA L40S 48GB",
        memory=48 * GiB,
        bf16_flops=362.05 * TFLOPS,
        fp16_flops=362.05 * TFLOPS,
        tf32_flops=183 * TFLOPS,
        fp32_flops=91.6 * TFLOPS,
        hbm_bandwidth=864 * GB,
        intra_node_bandwidth=_PCIE4,
        intra_node_link="PCIe Gen4 x16 (64 GB/s total, 32 GB/s per direction); no NVLink",
        inter_node_bandwidth=400 * Gbit,
        host_link_bandwidth=_PCIE4,
        notes="GDDR6 with ECC. The datasheet prints dense|sparse pairs (BF16 362.05|733*, TF32 "
        "183|366*); dense taken. The driver reports about 45 GiB. Network assumed as on AWS "
        "g6e.48xlarge (8x L40S): 400 Gb/s per node (50 GB/s).",
        sources=(
            "NVIDIA L40S datasheet: https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413 "
            "(FP32 91.6, TF32 183|366*, BF16/FP16 362.05|733* TFLOPS; 48 GB GDDR6, 864 GB/s; "
            "PCIe Gen4 x16 64 GB/s bidirectional); table reproduced at "
            "https://www.mullet.se/product.html?product_id=355414",
            "AWS EC2 G6e instances (g6e.48xlarge: 8x L40S, 400 Gbps): "
            "https://aws.amazon.com/ec2/instance-types/g6e/",
        ),
    ),
    _spec(
        id="a40",
        name="NVIDIA A40 48GB",
        memory=48 * GiB,
        bf16_flops=149.7 * TFLOPS,
        fp16_flops=149.7 * TFLOPS,
        tf32_flops=74.8 * TFLOPS,
        fp32_flops=37.4 * TFLOPS,
        hbm_bandwidth=696 * GB,
        intra_node_bandwidth=_PCIE4,
        intra_node_link="PCIe Gen4 x16 (64 GB/s total, 32 GB/s per direction); an NVLink "
        "bridge joins two cards at most",
        inter_node_bandwidth=100 * Gbit,
        host_link_bandwidth=_PCIE4,
        notes="300 W card, GDDR6. Dense figures as printed before the '|' on the datasheet. In "
        "a 4- or 8-card server the cards talk over PCIe (the NVLink bridge pairs two). Network "
        "assumed: 100 Gb/s per node (12.5 GB/s); an assumption, override it.",
        sources=(
            "NVIDIA A40 datasheet: https://images.nvidia.com/content/Solutions/data-center/"
            "a40/nvidia-a40-datasheet.pdf (FP32 37.4, TF32 74.8|149.6*, BF16/FP16 149.7|299.4* "
            "TFLOPS; 48 GB GDDR6, 696 GB/s; NVLink 112.5 GB/s bidirectional between 2 GPUs; "
            "PCIe Gen4 64 GB/s)",
        ),
    ),
    _spec(
        id="a10",
        name="NVIDIA A10 24GB",
        memory=24 * GiB,
        bf16_flops=125 * TFLOPS,
        fp16_flops=125 * TFLOPS,
        tf32_flops=62.5 * TFLOPS,
        fp32_flops=31.2 * TFLOPS,
        hbm_bandwidth=600 * GB,
        intra_node_bandwidth=_PCIE4,
        intra_node_link="PCIe Gen4 x16 (64 GB/s total, 32 GB/s per direction); no NVLink",
        inter_node_bandwidth=100 * Gbit,
        host_link_bandwidth=_PCIE4,
        notes="150 W card, GDDR6. Dense figures as printed before the '|' on the datasheet. "
        "Network assumed: 100 Gb/s per node (12.5 GB/s); an assumption, override it.",
        sources=(
            "NVIDIA A10 Tensor Core GPU datasheet: https://www.nvidia.com/content/dam/en-zz/"
            "Solutions/Data-Center/a10/pdf/a10-datasheet.pdf (FP32 31.2, TF32 62.5|125*, "
            "BF16/FP16 125|250* TFLOPS; 24 GB GDDR6, 600 GB/s; PCIe Gen4 64 GB/s)",
        ),
    ),
    _spec(
        id="a10g",
        name="NVIDIA A10G 24GB (AWS)",
        memory=24 * GiB,
        bf16_flops=70 * TFLOPS,
        fp16_flops=70 * TFLOPS,
        tf32_flops=35 * TFLOPS,
        fp32_flops=35 * TFLOPS,
        hbm_bandwidth=600 * GB,
        intra_node_bandwidth=_PCIE4,
        intra_node_link="PCIe Gen4 x16 (64 GB/s total, 32 GB/s per direction); no NVLink",
        inter_node_bandwidth=100 * Gbit,
        host_link_bandwidth=_PCIE4,
        notes="AWS-only variant of the A10; NVIDIA publishes no datasheet for it. Tensor rates "
        "(70 TFLOPS fp16/bf16 dense, about half the A10's) and FP32 35 TFLOPS are from the "
        "Baseten comparison of the two cards, less authoritative than a vendor datasheet: "
        "calibrate with trials. Memory and bandwidth (24 GB GDDR6, 600 GB/s) match the A10. "
        "Network assumed as on AWS g5.48xlarge (8x A10G): 100 Gb/s per node (12.5 GB/s).",
        sources=(
            "Baseten, 'NVIDIA A10 vs A10G for ML model inference': "
            "https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/",
            "AWS EC2 G5 instances (NVIDIA A10G, 24 GB; g5.48xlarge: 8 GPUs, 100 Gbps): "
            "https://aws.amazon.com/ec2/instance-types/g5/",
        ),
    ),
    _spec(
        id="mi300x",
        name="AMD Instinct MI300X 192GB",
        memory=192 * GiB,
        bf16_flops=1307.4 * TFLOPS,
        fp16_flops=1307.4 * TFLOPS,
        tf32_flops=653.7 * TFLOPS,
        fp32_flops=163.4 * TFLOPS,
        hbm_bandwidth=5300 * GB,
        intra_node_bandwidth=7 * 64 * GB,
        intra_node_link="Infinity Fabric, fully connected 8-GPU platform: 7 links x 64 GB/s per "
        "direction (128 GB/s bidirectional each), 448 GB/s per direction in all",
        inter_node_bandwidth=8 * 400 * Gbit,
        host_link_bandwidth=_PCIE5,
        notes="Dense peaks from AMD's datasheet (sparse 2,614.9 bf16 is twice). Each peer is "
        "reached over one 64 GB/s-per-direction link, so one GPU's 448 GB/s is reached only when "
        "it talks to all 7 peers at once (ring and all-gather collectives over 8 GPUs do). "
        "Network assumed as on Azure ND MI300X v5: 8x 400 Gb/s InfiniBand (400 GB/s per node).",
        sources=(
            "AMD Instinct MI300X accelerator data sheet: https://www.amd.com/content/dam/amd/en/"
            "documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf (192 GB "
            "HBM3, 5.3 TB/s; FP32 vector 163.4, TF32 653.7, FP16/BF16 1,307.4 TFLOPS dense; 7 "
            "Infinity Fabric links, 128 GB/s peak each; PCIe Gen5 x16 128 GB/s)",
            "AMD ROCm docs, MI300 microarchitecture: https://rocm.docs.amd.com/en/latest/"
            "conceptual/gpu-arch/mi300.html",
            "Microsoft Azure ND MI300X v5 size series (8x MI300X, 8x 400 Gb/s InfiniBand): "
            "https://learn.microsoft.com/en-us/azure/virtual-machines/sizes/gpu-accelerated/"
            "ndmi300xv5-series",
        ),
    ),
    _spec(
        id="cpu-gloo",
        name="CPU worker processes (gloo), placeholder speeds",
        memory=24 * GiB,
        bf16_flops=0.7 * TFLOPS,
        fp16_flops=0.7 * TFLOPS,
        tf32_flops=0.15 * TFLOPS,
        fp32_flops=0.15 * TFLOPS,
        hbm_bandwidth=15 * GB,
        # In CPU seconds, as CPU trials time their steps (autoshard.trials.worker.time_steps),
        # in processes started as the workers are (glibc's mmap threshold fixed): a 2-8 MiB
        # all-gather between 2 processes into a reused output, 0.95-1.01 GB/s received
        # (benchmarks/cpu_gloo_probe.py). FSDP gathers into a new tensor each time, whose
        # pages fault in as gloo writes them (0.65-0.69 GB/s measured), which the step-time
        # model adds at fresh_page_bandwidth. (Reused outputs at glibc's defaults: 1-1.7 GB/s.)
        intra_node_bandwidth=1.0 * GB,
        intra_node_link="gloo over loopback TCP between processes on one host",
        inter_node_bandwidth=10 * Gbit,
        host_link_bandwidth=15 * GB,
        # mmap'ed and written pages, one thread: 3.6-3.8 GB/s here (a resident fill: 25-27);
        # measured at run time (autoshard.predict.hardware.measured_cpu)
        fresh_page_bandwidth=3.6 * GB,
        notes="Not a GPU: autoshard's CPU trials (one process per rank, one thread each, gloo). "
        "Every speed here is a PLACEHOLDER, measured at run time / calibrated by trials. The "
        "numbers are rounded from a few runs of benchmarks/cpu_gloo_probe.py on the project's "
        "2-core development VM (Intel Xeon with AMX, torch 2.13, one thread per process, cores "
        "shared with other jobs, so runs spread 2x): fp32 matmul 90-180 GFLOP/s, bf16/fp16 "
        "0.5-1.4 TFLOP/s (AMX; a CPU without AMX runs bf16 SLOWER than fp32), memcpy 9-19 GB/s, "
        "gloo all-gather 0.2-1.0 GB/s received per rank with 2 ranks. TF32 does not exist on "
        "CPUs (= fp32). memory is that VM's RAM, shared by all ranks and the host. 'Offload' "
        "copies host to host (host_link = memcpy rate). Network: 10 Gb/s Ethernet assumed. "
        "Other CPUs differ by 10x either way.",
        sources=(
            "Measured: benchmarks/cpu_gloo_probe.py, output in "
            "benchmarks/results/cpu_gloo_probe.txt",
        ),
    ),
)

CATALOGUE: dict[str, GPUSpec] = {spec.id: _with_achievable(spec) for spec in _ENTRIES}
"""Every catalogue entry by id."""


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


def _has(tokens: list[str], *words: str) -> bool:
    return any(word in tokens for word in words)


def match_gpu_name(device_name: str) -> str | None:
    """The catalogue id of a device named as ``torch.cuda.get_device_name()`` names it, or None
    when the catalogue has no entry for it (H100 NVL, H200 NVL, GH200, L40, V100, ...).

    >>> from autoshard.gpus import match_gpu_name
    >>> match_gpu_name("NVIDIA H100 80GB HBM3"), match_gpu_name("NVIDIA H100 PCIe")
    ('h100-sxm', 'h100-pcie')
    >>> match_gpu_name("NVIDIA A100 80GB PCIe"), match_gpu_name("Tesla V100-SXM2-16GB")
    ('a100-80gb-pcie', None)
    """
    # Tokens, not substrings: "L4" is a substring of "L40S", "H200" of "GH200", "A10" of "A100".
    tokens = [t for t in re.split(r"[\s\-_/,()]+", device_name.upper()) if t]
    if _has(tokens, "MI300X"):  # "AMD Instinct MI300X", "AMD Instinct MI300X VF" (virtualised)
        return "mi300x"
    if _has(tokens, "NVL"):  # H100 NVL (94 GB) and H200 NVL (PCIe, lower clocks): other parts
        return None
    if _has(tokens, "H200"):
        return "h200"
    if _has(tokens, "H100"):
        # The SXM part reports "NVIDIA H100 80GB HBM3"; the PCIe card "NVIDIA H100 PCIe".
        return "h100-pcie" if _has(tokens, "PCIE") else "h100-sxm"
    if _has(tokens, "A100"):
        # "NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB",
        # "NVIDIA A100 80GB PCIe"; a name without a size is read as the smaller (40GB) part.
        size = "80gb" if _has(tokens, "80GB") else "40gb"
        form = "pcie" if _has(tokens, "PCIE") else "sxm"
        return f"a100-{size}-{form}"
    if _has(tokens, "A10G"):
        return "a10g"
    if _has(tokens, "A10"):
        return "a10"
    if _has(tokens, "A40"):  # "NVIDIA A40"
        return "a40"
    if _has(tokens, "L40S"):
        return "l40s"
    if _has(tokens, "L4"):
        return "l4"
    return None
