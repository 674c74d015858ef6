"""The GPU catalogue's entries: one per GPU model, each carrying every fact the planner uses
about it, with its sources: memory, dense peaks per precision, bandwidths and links (the
datasheet), the share of its peak its kernels reach (``matmul_fraction``,
``attention_fraction``, ``step_efficiency``, ``fp32_step_efficiency``: published
measurements), its fp8 rate, its generation (which published MFU ceilings apply:
:mod:`autoshard.predict.ceilings`) and the device-name tokens that identify it
(``matches``, ``unless``). A new GPU is one entry here; :mod:`autoshard.gpus` validates them
into :class:`~autoshard.gpus.GPUSpec` and reads them (conventions: its docstring).
"""

from __future__ import annotations

from autoshard import gpu_sources as src

GiB = 2**30
GB = 1e9  # vendors' bandwidths are decimal: 1 GB/s = 1e9 bytes/s
TFLOPS = 1e12
Gbit = 1e9 / 8  # network links are sold in Gb/s: 400 Gb/s = 50 GB/s


def _spec(**fields: object) -> dict[str, object]:
    return fields


def _sources(*groups: tuple[str, ...]) -> tuple[str, ...]:
    """The sources of an entry, each once: the datasheet's, then what its kernels reach."""
    return tuple(dict.fromkeys(source for group in groups for source in group))


# Shared facts (one place each, cited where they are used)

_PCIE4 = 32 * GB  # PCIe Gen4 x16: "64 GB/s" bidirectional on every Ampere/Ada datasheet
_PCIE5 = 64 * GB  # PCIe Gen5 x16: "128 GB/s" bidirectional on the Hopper datasheets

# A training step's share of the achievable rate, per GPU generation: the published hardware
# FLOPs utilisation of the fitting set's runs over the achievable fraction (the runs:
# benchmarks/results/measured_constants.md, "Step efficiency per GPU generation").
_STEP_EFFICIENCY = {"ampere": 0.75, "hopper": 0.6}

# fp32 steps on Hopper (CUDA cores: torch multiplies fp32 at "highest" precision unless told
# otherwise, and Lightning's 32-true does not tell it) reach more of their achievable rate than
# tensor-core steps: the same launch gaps and memory-bound work are a far smaller share of a
# step many times slower per FLOP, as on the A100. Fitted on autoshard's own H200 rows:
# measured_constants.md, "Step efficiency per GPU generation".
_HOPPER_FP32_STEP_EFFICIENCY = 0.77


ENTRIES: tuple[dict[str, object], ...] = (
    _spec(
        id="a100-40gb-sxm",
        name="NVIDIA A100 SXM4 40GB",
        generation="ampere",
        matmul_fraction=271.2 / 312,
        attention_fraction=0.6,
        step_efficiency=_STEP_EFFICIENCY["ampere"],
        matches=(("A100",),),
        unless=("80GB", "PCIE"),
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
        sources=_sources(
            (
                src.A100_DATASHEET,
                src.DGX_A100,
                "deviceQuery on an A100 SXM4 40GB: 'Total amount of global memory: 40441 MBytes "
                "(42405855232 bytes)', https://upb-pc2.atlassian.net/wiki/spaces/PC2DOK/pages/"
                "1900609/NVIDIA+A100+40GB+with+NVLINK",
            ),
            (src.MAMF, src.FA2, src.STEP_EFFICIENCY_SOURCE),
        ),
    ),
    _spec(
        id="a100-80gb-sxm",
        name="NVIDIA A100 SXM4 80GB",
        generation="ampere",
        matmul_fraction=271.2 / 312,
        attention_fraction=0.6,
        step_efficiency=_STEP_EFFICIENCY["ampere"],
        matches=(("A100", "80GB"),),
        unless=("PCIE",),
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
        sources=_sources(
            (src.A100_DATASHEET, src.DGX_A100),
            (src.MAMF, src.FA2, src.STEP_EFFICIENCY_SOURCE),
        ),
    ),
    _spec(
        id="a100-40gb-pcie",
        name="NVIDIA A100 PCIe 40GB",
        generation="ampere",
        matmul_fraction=252.9 / 312,
        attention_fraction=0.6,
        step_efficiency=_STEP_EFFICIENCY["ampere"],
        matches=(("A100", "PCIE"),),
        unless=("80GB",),
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
        sources=_sources(
            (src.A100_DATASHEET,),
            (src.MAMF, src.FA2, src.STEP_EFFICIENCY_SOURCE),
        ),
    ),
    _spec(
        id="a100-80gb-pcie",
        name="NVIDIA A100 PCIe 80GB",
        generation="ampere",
        matmul_fraction=252.9 / 312,
        attention_fraction=0.6,
        step_efficiency=_STEP_EFFICIENCY["ampere"],
        matches=(("A100", "80GB", "PCIE"),),
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
        sources=_sources(
            (src.A100_DATASHEET,),
            (src.MAMF, src.FA2, src.STEP_EFFICIENCY_SOURCE),
        ),
    ),
    _spec(
        id="h100-sxm",
        name="NVIDIA H100 SXM5 80GB",
        generation="hopper",
        matmul_fraction=794.5 / 989,
        attention_fraction=0.35,
        step_efficiency=_STEP_EFFICIENCY["hopper"],
        fp32_step_efficiency=_HOPPER_FP32_STEP_EFFICIENCY,
        fp8_flops=1979 * TFLOPS,
        matches=(("H100",),),
        unless=("PCIE", "NVL"),
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
        sources=_sources(
            (
                src.H100_DATASHEET,
                src.DGX_H100,
                "H100 SXM5 theoretical TFLOPS table (BF16 matrix 989.4 dense, 1978.9 sparse; FP32 "
                "66.9): https://glennklockwood.com/garden/processors/h100",
            ),
            (
                src.MAMF,
                src.FA3,
                "H100 SXM datasheet: FP8 3,958* TFLOPS (*sparse; dense half)",
                src.TORCHAO_FP8,
                src.STEP_EFFICIENCY_SOURCE,
                src.HOPPER_FP32_SOURCE,
            ),
        ),
    ),
    _spec(
        id="h100-pcie",
        name="NVIDIA H100 PCIe 80GB",
        generation="hopper",
        matmul_fraction=0.8,
        attention_fraction=0.35,
        step_efficiency=_STEP_EFFICIENCY["hopper"],
        fp32_step_efficiency=_HOPPER_FP32_STEP_EFFICIENCY,
        fp8_flops=1513 * TFLOPS,
        matches=(("H100", "PCIE"),),
        unless=("NVL",),
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
        sources=_sources(
            (src.H100_DATASHEET, src.NVIDIA_PRODUCT_BRIEF_H100_PCIE),
            (
                src.FA3,
                "H100 PCIe datasheet: FP8 3,026* TFLOPS (*sparse; dense half)",
                src.TORCHAO_FP8,
                src.STEP_EFFICIENCY_SOURCE,
                src.HOPPER_FP32_SOURCE,
            ),
        ),
    ),
    _spec(
        id="h200",
        name="NVIDIA H200 SXM 141GB",
        generation="hopper",
        # the H100 SXM's GH100 die at the same 700 W: its fractions (the 900 W GH200 reaches 83.6%)
        matmul_fraction=794.5 / 989,
        attention_fraction=0.35,
        step_efficiency=_STEP_EFFICIENCY["hopper"],
        fp32_step_efficiency=_HOPPER_FP32_STEP_EFFICIENCY,
        fp8_flops=1979 * TFLOPS,
        matches=(("H200",),),
        unless=("NVL",),
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
        sources=_sources(
            (
                src.H200_DATASHEET,
                src.DGX_H100,
            ),
            (
                src.MAMF,
                src.FA3,
                "H200 SXM datasheet: FP8 3,958* TFLOPS (*sparse; dense half)",
                src.TORCHAO_FP8,
                src.STEP_EFFICIENCY_SOURCE,
                src.HOPPER_FP32_SOURCE,
            ),
        ),
    ),
    _spec(
        id="h200-nvl",
        name="NVIDIA H200 NVL 141GB",
        generation="hopper",
        # the GH100 die at up to 600 W: no achievable-matmul measurement catalogued (the 0.8
        # of NVIDIA's measured parts), attention at Hopper's FlashAttention-2 share
        matmul_fraction=0.8,
        attention_fraction=0.35,
        step_efficiency=_STEP_EFFICIENCY["hopper"],
        fp32_step_efficiency=_HOPPER_FP32_STEP_EFFICIENCY,
        fp8_flops=1670.5 * TFLOPS,
        matches=(("H200", "NVL"),),
        memory=141 * GiB,
        bf16_flops=835.5 * TFLOPS,
        fp16_flops=835.5 * TFLOPS,
        tf32_flops=417.5 * TFLOPS,
        fp32_flops=60 * TFLOPS,
        hbm_bandwidth=4800 * GB,
        intra_node_bandwidth=_PCIE5,
        intra_node_link="PCIe Gen5 x16 (128 GB/s total, 64 GB/s per direction); 2- or 4-way "
        "NVLink bridges (900 GB/s) join pairs or quads only, not modelled",
        inter_node_bandwidth=200 * Gbit,
        host_link_bandwidth=_PCIE5,
        notes="PCIe card (up to 600 W), the H200's memory at lower clocks than the SXM part. "
        "Dense = datasheet sparse / 2 (BF16 1,671* -> 835.5, TF32 835* -> 417.5, FP8 3,341* -> "
        "1,670.5). GPUs of a server talk over PCIe beyond their NVLink bridge. Network assumed: "
        "200 Gb/s per node (25 GB/s), as for the other PCIe parts; override it.",
        sources=(
            "NVIDIA H200 Tensor Core GPU datasheet: https://www.nvidia.com/en-us/data-center/h200/ "
            "(H200 NVL: 141 GB HBM3e, 4.8 TB/s, FP32 60, TF32 835*, BF16/FP16 1,671*, FP8 3,341* "
            "TFLOPS, *with sparsity; max TDP up to 600 W; 2- or 4-way NVIDIA NVLink bridge 900 "
            "GB/s per GPU, PCIe Gen5 128 GB/s)",
            src.FA3,
            src.TORCHAO_FP8,
            src.STEP_EFFICIENCY_SOURCE,
            src.HOPPER_FP32_SOURCE,
        ),
    ),
    _spec(
        id="b200",
        name="NVIDIA B200 180GB (HGX)",
        generation="blackwell",
        # no achievable-matmul, attention or training-step measurement catalogued for
        # Blackwell: the 0.8 of NVIDIA's measured parts, Hopper's attention share and step
        # efficiency (a faster GPU reaches a smaller share of its peak); trials calibrate them
        matmul_fraction=0.8,
        attention_fraction=0.35,
        step_efficiency=_STEP_EFFICIENCY["hopper"],
        fp32_step_efficiency=_HOPPER_FP32_STEP_EFFICIENCY,
        fp8_flops=4500 * TFLOPS,
        matches=(("B200",),),
        memory=180 * GiB,
        bf16_flops=2250 * TFLOPS,
        fp16_flops=2250 * TFLOPS,
        tf32_flops=1100 * TFLOPS,
        fp32_flops=75 * TFLOPS,
        hbm_bandwidth=7700 * GB,
        intra_node_bandwidth=900 * GB,
        intra_node_link="NVLink 5 via NVSwitch (1.8 TB/s total, 900 GB/s per direction)",
        inter_node_bandwidth=8 * 400 * Gbit,
        host_link_bandwidth=_PCIE5,
        notes="HGX B200 board part at up to 1,000 W. Dense = datasheet sparse / 2 (FP16/BF16 "
        "4.5* -> 2.25 PFLOPS, TF32 2.2* -> 1.1, FP8 9* -> 4.5). The host link as HGX B200 "
        "systems wire it (PCIe Gen5 128 GB/s). Network assumed as in a DGX B200: 8x 400 Gb/s "
        "ConnectX-7 (400 GB/s per node per direction). torchao's float8 runs on sm_100.",
        sources=(
            "NVIDIA HGX B200 specifications, https://www.nvidia.com/en-us/data-center/hgx/ "
            "(per GPU: FP8/FP6 9*, FP16/BF16 4.5*, TF32 2.2* PFLOPS, FP32 75 TFLOPS, *with "
            "sparsity; 180 GB HBM3E, 7.7 TB/s; 5th generation NVLink 1.8 TB/s; PCIe Gen5 128 "
            "GB/s; up to 1,000 W)",
            "NVIDIA DGX B200 datasheet: https://resources.nvidia.com/en-us-dgx-systems/"
            "dgxb200-datasheet (8x ConnectX-7 400 Gb/s for the compute fabric)",
            src.TORCHAO_FP8,
            src.STEP_EFFICIENCY_SOURCE,
        ),
    ),
    _spec(
        id="l4",
        name="NVIDIA L4 24GB",
        generation="ada",
        # sm89 runs the same FlashAttention-2 kernels as the A100; no matmul figure catalogued
        matmul_fraction=0.8,
        attention_fraction=0.6,
        fp8_flops=242.5 * TFLOPS,
        matches=(("L4",),),
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
        sources=_sources(
            (
                src.L4_DATASHEET,
                "Google Cloud, GPU machine types (G2: up to 8 L4, 100 Gbps): "
                "https://cloud.google.com/compute/docs/gpus",
            ),
            (
                src.FA2,
                "L4 datasheet: FP8 485* TFLOPS (*sparse; dense half); Ada, sm_89",
                src.TORCHAO_FP8,
            ),
        ),
    ),
    _spec(
        id="l40s",
        name="NVIDIA L40S 48GB",
        generation="ada",
        matmul_fraction=0.8,
        attention_fraction=0.6,
        fp8_flops=733 * TFLOPS,
        matches=(("L40S",),),
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
        sources=_sources(
            (
                src.L40S_DATASHEET,
                "AWS EC2 G6e instances (g6e.48xlarge: 8x L40S, 400 Gbps): "
                "https://aws.amazon.com/ec2/instance-types/g6e/",
            ),
            (
                src.FA2,
                "L40S datasheet: FP8 733|1,466* TFLOPS (dense|sparse); Ada, sm_89",
                src.TORCHAO_FP8,
            ),
        ),
    ),
    _spec(
        id="a40",
        name="NVIDIA A40 48GB",
        generation="ampere",
        matmul_fraction=0.8,
        attention_fraction=0.6,
        matches=(("A40",),),
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
        sources=_sources(
            (src.A40_DATASHEET,),
            (src.FA2,),
        ),
    ),
    _spec(
        id="a10",
        name="NVIDIA A10 24GB",
        generation="ampere",
        matmul_fraction=0.8,
        attention_fraction=0.6,
        matches=(("A10",),),
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
        sources=_sources(
            (src.A10_DATASHEET,),
            (src.FA2,),
        ),
    ),
    _spec(
        id="a10g",
        name="NVIDIA A10G 24GB (AWS)",
        generation="ampere",
        matmul_fraction=0.8,
        attention_fraction=0.6,
        matches=(("A10G",),),
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
        sources=_sources(
            (
                "Baseten, 'NVIDIA A10 vs A10G for ML model inference': "
                "https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/",
                "AWS EC2 G5 instances (NVIDIA A10G, 24 GB; g5.48xlarge: 8 GPUs, 100 Gbps): "
                "https://aws.amazon.com/ec2/instance-types/g5/",
            ),
            (src.FA2,),
        ),
    ),
    _spec(
        id="mi300x",
        name="AMD Instinct MI300X 192GB",
        generation="cdna3",
        matmul_fraction=668.4 / 1300,
        attention_fraction=0.35,
        fp8_flops=2614.9 * TFLOPS,
        # "AMD Instinct MI300X", "AMD Instinct MI300X VF" (virtualised)
        matches=(("MI300X",),),
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
        sources=_sources(
            (
                src.MI300X_DATASHEET,
                src.MI300X_ROCM,
                src.AZURE_MI300X,
            ),
            (
                src.MAMF,
                "MI300X data sheet: FP8 2,614.9 TFLOPS dense (5,229.8 sparse)",
                src.TORCHAO_FP8,
            ),
        ),
    ),
    _spec(
        id="cpu-gloo",
        name="CPU worker processes (gloo), placeholder speeds",
        generation="cpu",
        # CPU processes: the rates are measured on this machine (autoshard.predict.hardware)
        matmul_fraction=1.0,
        attention_fraction=1.0,
        memory=24 * GiB,
        bf16_flops=0.7 * TFLOPS,
        fp16_flops=0.7 * TFLOPS,
        tf32_flops=0.15 * TFLOPS,
        fp32_flops=0.15 * TFLOPS,
        hbm_bandwidth=15 * GB,
        # measured: benchmarks/results/measured_constants.md, "The cpu-gloo entry's links"
        intra_node_bandwidth=1.0 * GB,
        intra_node_link="gloo over loopback TCP between processes on one host",
        inter_node_bandwidth=10 * Gbit,
        host_link_bandwidth=15 * GB,
        # measured again at run time (autoshard.predict.hardware.measure_cpu)
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
