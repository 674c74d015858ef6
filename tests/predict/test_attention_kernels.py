"""The SDPA kernel a CUDA GPU runs (autoshard.predict.attention_kernels) and the activation profile
taken for a CUDA GPU: fp32 attention with grouped-query heads runs the math kernel there and
saves its probabilities, which the CPU's fused kernel does not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autoshard import TargetSpec, WorkloadSpec, analyze_target
from autoshard.config import Hardware, Precision
from autoshard.predict.activations import profile_activations
from autoshard.predict.attention_kernels import AttentionCall, attention_device, cuda_kernel

FP32, BF16 = torch.float32, torch.bfloat16
GQA = dict(heads=(32, 8, 8), head_dims=(64, 64, 64), lengths=(2048, 2048), causal=True, gqa=True)
MHA = dict(heads=(32, 32, 32), head_dims=(64, 64, 64), lengths=(2048, 2048), causal=True)


# One row per branch of the rule: which check sends the call on (sdp_utils.cpp, torch 2.11-2.13).
RULE = [
    (AttentionCall(BF16, **GQA), "flash"),  # flash takes 16-bit dtypes and grouped heads
    (AttentionCall(torch.float16, **GQA), "flash"),
    (AttentionCall(FP32, **GQA), "math"),  # flash: no fp32; efficient: no grouped heads
    (AttentionCall(FP32, **MHA), "efficient"),  # efficient takes fp32 with equal heads
    (AttentionCall(BF16, **{**MHA, "causal": False}, mask=True), "efficient"),  # flash: no mask
    (AttentionCall(BF16, **{**GQA, "causal": False}, mask=True), "math"),  # mask and grouped
    (AttentionCall(BF16, **{**GQA, "head_dims": (320, 320, 320)}), "math"),  # flash: <= 256
    (AttentionCall(BF16, **{**MHA, "head_dims": (320, 320, 320)}), "efficient"),
    (AttentionCall(BF16, **{**MHA, "head_dims": (64, 64, 32)}), "efficient"),  # flash: same dims
    (AttentionCall(FP32, **{**MHA, "head_dims": (66, 66, 66)}), "math"),  # efficient: 4-aligned
    (AttentionCall(BF16, **{**MHA, "head_dims": (36, 36, 36)}), "flash"),
    (AttentionCall(FP32, **{**MHA, "head_dims": (36, 36, 36)}), "efficient"),
    (AttentionCall(BF16, **{**GQA, "lengths": (1, 2048)}), "math"),  # flash: causal, square
    (AttentionCall(BF16, **{**MHA, "lengths": (1, 2048)}), "efficient"),
    (AttentionCall(BF16, **{**GQA, "gqa": False}), "math"),  # grouped heads need enable_gqa
    (AttentionCall(BF16, **{**GQA, "heads": (32, 8, 4)}), "math"),  # key and value alike
    (AttentionCall(BF16, **{**GQA, "heads": (30, 8, 8)}), "math"),  # dividing the query's
    (AttentionCall(BF16, **GQA, unit_strides=False), "math"),  # last dimension's stride 1
    (AttentionCall(torch.float64, **MHA), "math"),
]


@pytest.mark.parametrize(("call", "kernel"), RULE)
def test_the_cuda_kernel_rule_per_branch(call: AttentionCall, kernel: str) -> None:
    assert cuda_kernel(call) == kernel


def test_a_call_is_read_as_the_kernel_choice_reads_it() -> None:
    q = torch.empty(2, 8, 16, 32)
    kv = torch.empty(2, 2, 16, 32)
    call = AttentionCall.of((q, kv, kv), {"is_causal": True, "enable_gqa": True})
    assert call == AttentionCall(FP32, (8, 2, 2), (32, 32, 32), (16, 16), causal=True, gqa=True)
    # positional mask; a transposed value has no unit stride in its last dimension
    call = AttentionCall.of((q, kv, kv.transpose(-1, -2).contiguous().transpose(-1, -2), q), {})
    assert call.mask and not call.unit_strides and not call.gqa
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts the call: its dtype counts
        assert AttentionCall.of((q, kv, kv), {"enable_gqa": True}).dtype is BF16


def test_the_attention_device_follows_the_backend() -> None:
    assert attention_device(Hardware(gpu_memory=2**30)) == "cuda"
    assert attention_device(Hardware(gpu_memory=2**30, backend="gloo")) == "cpu"
    assert attention_device(Hardware(gpu_memory=2**30, gpu="cpu-gloo")) == "cpu"


@pytest.fixture(scope="module")
def gqa_gpt() -> tuple:
    """A GQA GPT (4 query heads, 2 key/value heads) at 128 tokens, profiled for both devices."""
    spec = TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny", "n_kv_head": 2})
    profile, built = analyze_target(spec)
    workload = WorkloadSpec(seq_len=128)
    precisions = (Precision.FP32, Precision.BF16_MIXED)
    return tuple(
        profile_activations(built.model, profile, workload, precisions=precisions, attention_on=on)
        for on in ("cpu", "cuda")
    )


def test_fp32_gqa_on_cuda_counts_the_probabilities(gqa_gpt: tuple) -> None:
    cpu, cuda = gqa_gpt
    probabilities = 4 * 128 * 128 * 4  # heads x queries x keys, fp32, per sample
    assert cuda.math_attention and not cpu.math_attention
    for on_cpu, on_cuda in zip(cpu.block_bytes, cuda.block_bytes, strict=True):
        assert on_cuda - on_cpu >= probabilities
    # the measured checkpointed backward recomputes them (its recompute runs inside
    # backward, which the forward's mode does not reach)
    assert cuda.checkpointed_backward[1] - cpu.checkpointed_backward[1] >= probabilities


def test_what_cuda_runs_fused_is_profiled_as_on_the_cpu(gqa_gpt: tuple) -> None:
    cpu, cuda = gqa_gpt
    # bf16 takes flash: the same saves as the CPU's fused kernel
    assert cuda.at("bf16-mixed") == cpu.at("bf16-mixed")
    # the fp32 twin with fused attention sizes the activation gradients of other precisions
    twin = cuda.fused_at(Precision.FP32)
    assert not twin.math_attention and twin.block_bytes == cpu.block_bytes
    assert cuda.at(Precision.FP32).math_attention  # an fp32 candidate's own profile


def test_a_model_without_grouped_heads_profiles_alike_on_both() -> None:
    spec = TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"})
    profile, built = analyze_target(spec)
    cpu, cuda = (
        profile_activations(built.model, profile, WorkloadSpec(seq_len=64), attention_on=on)
        for on in ("cpu", "cuda")
    )
    assert cuda == cpu  # fp32 with equal heads: the efficient kernel, no twin


def test_the_math_kernel_saves_the_probabilities_on_the_cpu_too() -> None:
    """What the profile relies on: the CPU's math kernel (forced) saves what CUDA's does, the
    (B, H, T, T) probabilities, and its fused kernel does not."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 4, 64, 16, requires_grad=True)
    kv = torch.randn(1, 2, 64, 16, requires_grad=True)
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        fused, saved = saved, []
        with sdpa_kernel(SDPBackend.MATH):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    assert (1, 4, 64, 64) in saved and (1, 4, 64, 64) not in fused


@pytest.mark.parametrize(("gpu", "math"), [("h100-sxm", True), ("cpu-gloo", False)])
def test_a_plan_profiles_attention_as_its_device_runs_it(gpu: str, math: bool) -> None:
    """make_plan takes the profile for the planned device: a GPU's plan counts fp32 GQA's math
    kernel, a plan for CPU worker processes (whose trials measure the CPU's kernel) does not."""
    import warnings

    from autoshard.options import PlanOptions
    from autoshard.plan import make_plan, make_request

    options = PlanOptions(gpus=1, gpu=gpu, gpu_memory="4GiB", batch_size="1",
                          precision="32-true", seq_len=64, engine="fsdp2")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(make_request("examples/gpt.py:build", options,
                                      kwargs={"size": "tiny", "n_kv_head": 2, "n_layer": 2}))  # fmt: skip
    assert plan.activations.math_attention is math
