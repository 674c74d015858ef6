"""The documents the GPU catalogue's entries cite (:mod:`autoshard.gpu_entries`), each once."""

from __future__ import annotations

A100_DATASHEET = (
    "NVIDIA A100 Tensor Core GPU datasheet: https://www.nvidia.com/content/dam/en-zz/Solutions/"
    "Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (FP32 19.5, TF32 "
    "156|312*, BF16/FP16 312|624* TFLOPS, *with sparsity; HBM 1,555 GB/s (40GB), 2,039 GB/s "
    "(80GB SXM), 1,935 GB/s (80GB PCIe); NVLink 600 GB/s; PCIe Gen4 64 GB/s); table quoted at "
    "https://glennklockwood.com/garden/processors/A100"
)
DGX_A100 = (
    "NVIDIA DGX A100 datasheet: https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
    "nvidia-dgx-a100-datasheet.pdf (8x single-port ConnectX-6 200 Gb/s HDR InfiniBand for the "
    "compute network)"
)
H100_DATASHEET = (
    "NVIDIA H100 Tensor Core GPU datasheet: https://resources.nvidia.com/en-us-tensor-core/"
    "nvidia-tensor-core-gpu-datasheet (SXM: FP32 67, TF32 989*, BF16/FP16 1,979* TFLOPS, "
    "3.35 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s; PCIe: FP32 51, TF32 756*, BF16/FP16 "
    "1,513* TFLOPS, 2 TB/s, NVLink bridge 600 GB/s; *with sparsity, dense is half); table "
    "reproduced at https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html"
)
DGX_H100 = (
    "NVIDIA DGX H100/H200 datasheets: https://resources.nvidia.com/en-us-dgx-systems/"
    "ai-enterprise-dgx (8x single-port ConnectX-7 400 Gb/s InfiniBand/Ethernet, one per GPU)"
)
NVIDIA_PRODUCT_BRIEF_H100_PCIE = (
    "NVIDIA H100 PCIe GPU Product Brief PB-11133-001_v02 (Nov 2022): PCIe Gen5 card, 350 W, "
    "memory bandwidth > 2,000 GB/s"
)
STEP_EFFICIENCY_SOURCE = (
    "Step efficiency per GPU generation: published hardware FLOPs utilisation of the fitting "
    "set of benchmarks/step_time_published.py (llm-foundry's benchmarking README: A100 40GB, "
    "A100 80GB, H100 SXM; 'Maximizing training throughput using PyTorch FSDP', IBM/PyTorch "
    "blog, 2024: A100 80GB, H100 SXM) over the catalogue's achievable matmul fraction"
)
HOPPER_FP32_SOURCE = (
    "fp32 step efficiency on Hopper: fitted on the fp32 rows of the fitting set of autoshard's "
    "H200 measurements (benchmarks/data/measured_gpu.json, benchmarks/step_time_gpu.py)"
)

# What the kernels reach, apart from the datasheet peaks (the step-time model divides matrix
# products and attention by these rates, then by its compute efficiency).
MAMF = (
    "Maximum Achievable Matmul FLOPS table (bf16, v2 measurements), S. Bekman, Machine Learning "
    "Engineering, compute/accelerator/README.md: https://github.com/stas00/ml-engineering/blob/"
    "master/compute/accelerator/README.md#maximum-achievable-matmul-flops-comparison-table "
    "(A100 SXM 271.2 of 312 TFLOPS = 86.9%; A100 PCIe 252.9 = 81.1%; H100 SXM 794.5 of 989 = "
    "80.3%; GH200 828.6 = 83.6%; MI300X 668.4 of 1300 = 51.4%)"
)

FA2 = (
    "FlashAttention-2 (T. Dao, arXiv:2307.08691): 'reaching 50-73% of the theoretical maximum "
    "FLOPs/s on A100' (forward up to 73%, backward lower; 0.6 taken for forward + backward)"
)

FA3 = (
    "FlashAttention-3 (J. Shah et al., arXiv:2407.08608): 'FlashAttention-2 achieving only 35% "
    "utilization on the H100 GPU'; Azure ND H100 v5 benchmark guide: FlashAttention-2 at head "
    "dim 128, batch 2, 8192 tokens, 327.9 TFLOPS (33% of 989): https://github.com/"
    "samuel-bohman/AI-benchmarking-guide/blob/main/Azure_Results/ND_H100_v5_results.md"
)

# fp8 tensor cores: Hopper (sm_90), Ada (sm_89) and CDNA3. torchao's float8 training runs its
# matmuls with torch._scaled_mm, which needs sm_89 or later, or an MI300 (torchao 0.18,
# torchao/float8/inference.py: is_sm_at_least_89() or is_MI300()). Ampere (A100, A10, A10G)
# has none: its datasheets list TF32, BF16, FP16, INT8 and INT4 tensor rates only.
TORCHAO_FP8 = (
    "torchao 0.18 float8 training: torch._scaled_mm needs CUDA compute capability 8.9+ (Ada, "
    "Hopper) or an AMD MI300 (torchao/float8/inference.py, is_sm_at_least_89 / is_MI300): "
    "https://github.com/pytorch/ao/tree/main/torchao/float8"
)
H200_DATASHEET = (
    "NVIDIA H200 Tensor Core GPU datasheet: https://www.nvidia.com/en-us/data-center/h200/ "
    "(SXM: 141 GB HBM3e, 4.8 TB/s, BF16/FP16 1,979* TFLOPS, TF32 989*, FP32 67, NVLink "
    "900 GB/s, PCIe Gen5 128 GB/s; *with sparsity)"
)
L40S_DATASHEET = (
    "NVIDIA L40S datasheet: https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413 "
    "(FP32 91.6, TF32 183|366*, BF16/FP16 362.05|733* TFLOPS; 48 GB GDDR6, 864 GB/s; "
    "PCIe Gen4 x16 64 GB/s bidirectional); table reproduced at "
    "https://www.mullet.se/product.html?product_id=355414"
)
MI300X_DATASHEET = (
    "AMD Instinct MI300X accelerator data sheet: https://www.amd.com/content/dam/amd/en/"
    "documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf (192 GB "
    "HBM3, 5.3 TB/s; FP32 vector 163.4, TF32 653.7, FP16/BF16 1,307.4 TFLOPS dense; 7 "
    "Infinity Fabric links, 128 GB/s peak each; PCIe Gen5 x16 128 GB/s)"
)
MI300X_ROCM = (
    "AMD ROCm docs, MI300 microarchitecture: https://rocm.docs.amd.com/en/latest/"
    "conceptual/gpu-arch/mi300.html"
)
AZURE_MI300X = (
    "Microsoft Azure ND MI300X v5 size series (8x MI300X, 8x 400 Gb/s InfiniBand): "
    "https://learn.microsoft.com/en-us/azure/virtual-machines/sizes/gpu-accelerated/"
    "ndmi300xv5-series"
)
L4_DATASHEET = (
    "NVIDIA L4 Tensor Core GPU datasheet: https://resources.nvidia.com/en-us-data-center-"
    "overview/l4-gpu-datasheet (FP32 30.3, TF32 120*, BF16/FP16 242* TFLOPS, *with "
    "sparsity; 24 GB GDDR6, 300 GB/s; PCIe Gen4 x16 64 GB/s)"
)
A40_DATASHEET = (
    "NVIDIA A40 datasheet: https://images.nvidia.com/content/Solutions/data-center/"
    "a40/nvidia-a40-datasheet.pdf (FP32 37.4, TF32 74.8|149.6*, BF16/FP16 149.7|299.4* "
    "TFLOPS; 48 GB GDDR6, 696 GB/s; NVLink 112.5 GB/s bidirectional between 2 GPUs; "
    "PCIe Gen4 64 GB/s)"
)
A10_DATASHEET = (
    "NVIDIA A10 Tensor Core GPU datasheet: https://www.nvidia.com/content/dam/en-zz/"
    "Solutions/Data-Center/a10/pdf/a10-datasheet.pdf (FP32 31.2, TF32 62.5|125*, "
    "BF16/FP16 125|250* TFLOPS; 24 GB GDDR6, 600 GB/s; PCIe Gen4 64 GB/s)"
)
