"""Which scaled-dot-product-attention kernel a CUDA GPU runs for a call, and the activation
profile's attention run as that kernel saves for backward.

What autograd keeps of an attention depends on the kernel torch's SDPA dispatch picks: a fused
kernel (flash, memory-efficient, cuDNN) saves its inputs, its output and one fp32 statistic per
query row; the math kernel is made of ordinary operations and saves the softmax's
probabilities, heads x queries x keys per sample (512 MiB per block of the 1B GPT at 2,048
tokens in fp32), and its backward makes two more of that size. The activation profile runs on
the CPU, whose fused kernel takes every float dtype and grouped-query heads; on a CUDA GPU no
fused kernel takes fp32 with grouped-query heads (flash takes 16-bit dtypes only, the
memory-efficient kernel equal head counts only), so the call runs the math kernel there.
:class:`AttentionAsOnCuda` makes the profile run each call as the GPU would.

The rule is torch's ``sdp::select_sdp_backend`` (``aten/src/ATen/native/transformers/cuda/
sdp_utils.cpp``) for one NVIDIA GPU of sm80 or later (every NVIDIA GPU of the catalogue), torch
2.11 and 2.13, the backends all enabled (torch's default): its order, ``Context.h``'s
``sdp_priority_order`` (flash, efficient, math, cuDNN; l. 481 in 2.13, l. 467 in 2.11), and of
each fused kernel the checks that decide between it and math. Left out, each answered "math"
where it applies or not modelled: cuDNN, tried after math unless ``check_prefer_cudnn_attention``
puts it first (sm90/sm100 with cuDNN after 9.15): it only answers 16-bit calls that also carry
a mask and grouped heads; flash's training head-dim limit on sm86/sm89; nested tensors; dropout
(every kernel here takes it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from autoshard.config import Hardware

_HALF = frozenset({torch.float16, torch.bfloat16})


def attention_device(hardware: Hardware) -> Literal["cpu", "cuda"]:
    """Whose attention kernels a plan for ``hardware`` counts: CPU worker processes (gloo, the
    ``cpu-gloo`` entry) run the CPU's; GPUs a CUDA GPU's (ROCm's take neither fp32 with grouped
    heads in a fused kernel: the same answer where it matters)."""
    return "cpu" if hardware.backend == "gloo" or hardware.gpu == "cpu-gloo" else "cuda"


@dataclass(frozen=True)
class AttentionCall:
    """What the kernel choice reads of one ``scaled_dot_product_attention`` call
    (``sdp::sdp_params``): the dtype the kernel computes in (autocast's, where it casts the
    call: ``KERNEL_CUDA(scaled_dot_product_attention, lower_precision_fp)``, aten/src/ATen/
    autocast_mode.cpp), the head counts, head sizes and sequence lengths of query, key and
    value, and the flags."""

    dtype: torch.dtype
    heads: tuple[int, int, int]  # query, key, value
    head_dims: tuple[int, int, int]
    lengths: tuple[int, int]  # query, key
    mask: bool = False
    causal: bool = False
    gqa: bool = False  # enable_gqa
    unit_strides: bool = True  # every input's last dimension has stride 1

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> AttentionCall:
        """The call ``F.scaled_dot_product_attention(*args, **kwargs)``, as the kernel choice
        reads it under the autocast in force (the profile's CPU autocast stands for CUDA's)."""
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        given = dict(zip(names, args, strict=False)) | kwargs
        q, k, v = given["query"], given["key"], given["value"]
        dtype = q.dtype
        if torch.is_autocast_enabled("cpu") and dtype.is_floating_point:
            dtype = torch.get_autocast_dtype("cpu")
        return cls(
            dtype=dtype,
            heads=(q.size(-3), k.size(-3), v.size(-3)),
            head_dims=(q.size(-1), k.size(-1), v.size(-1)),
            lengths=(q.size(-2), k.size(-2)),
            mask=given.get("attn_mask") is not None,
            causal=bool(given.get("is_causal", False)),
            gqa=bool(given.get("enable_gqa", False)),
            unit_strides=all(t.stride(-1) == 1 for t in (q, k, v)),
        )


def _flash_shapes(call: AttentionCall) -> bool:
    # check_head_dim_size_flash: q, k, v of one head size, at most 256;
    # check_flash_causal_non_square_seqlens: is_causal only with as many queries as keys
    q, k, v = call.head_dims
    return q == k == v <= 256 and not (call.causal and call.lengths[0] != call.lengths[1])


def _efficient_shapes(call: AttentionCall) -> bool:
    # check_head_dim_size_mem_efficient: q and k of one head size, q's and v's a multiple of
    # minimum_gemm_alignment (sm80+: 8 elements in 16 bits, 4 in fp32)
    q, k, v = call.head_dims
    align = 8 if call.dtype in _HALF else 4
    return q == k and q % align == 0 and v % align == 0 and q > 0 and v > 0


@dataclass(frozen=True)
class FusedKernel:
    """One fused CUDA kernel's checks that decide between it and the math kernel."""

    name: str
    dtypes: frozenset[torch.dtype]  # check_dtypes_* / check_tensor_dtype, sm80+
    grouped_heads: bool  # check_batch_size_and_num_heads_dense<supports_gqa>
    mask: bool  # takes an attn_mask (flash: check_for_attn_mask rejects any)
    shapes: Callable[[AttentionCall], bool]
    source: str

    def takes(self, call: AttentionCall) -> bool:
        nq, nk, nv = call.heads
        if nq == nk == nv:
            heads = True
        else:  # check_grouped_query_attention: enable_gqa, key and value alike, dividing query
            heads = self.grouped_heads and call.gqa and nk == nv and nk > 0 and nq % nk == 0
        return (
            call.dtype in self.dtypes
            and heads
            and (self.mask or not call.mask)
            and call.unit_strides  # check_last_dim_stride_equals_1_dense
            and self.shapes(call)
        )


# torch's default order (Context.h sdp_priority_order), math after these two. The checks:
# sdp_utils.cpp can_use_flash_attention / can_use_mem_efficient_attention; the templates in
# sdp_utils_cpp.h (2.13: check_for_attn_mask l. 260, check_grouped_query_attention l. 358,
# check_batch_size_and_num_heads_dense l. 397, check_last_dim_stride_equals_1_dense l. 512;
# 2.11: l. 260, 339, 378, 493). The memory-efficient kernel instantiates the heads check with
# supports_gqa=false up to 2.13 (pytorch PR #191085 adds grouped heads after it; the 2.13
# header's template has no supports_mqa parameter, which that change adds).
CUDA_FUSED_KERNELS: tuple[FusedKernel, ...] = (
    FusedKernel(
        "flash", _HALF, grouped_heads=True, mask=False, shapes=_flash_shapes,
        source="can_use_flash_attention: check_for_attn_mask, check_head_dim_size_flash, "
        "check_flash_causal_non_square_seqlens, check_dtypes_flash_attention (fp16, bf16), "
        "check_batch_size_and_num_heads_dense<true>",
    ),
    FusedKernel(
        "efficient", _HALF | {torch.float32}, grouped_heads=False, mask=True,
        shapes=_efficient_shapes,
        source="can_use_mem_efficient_attention: check_head_dim_size_mem_efficient, "
        "check_batch_size_and_num_heads_dense<false>, dtypes fp16, fp32, bf16 (sm80+)",
    ),
)  # fmt: skip


def cuda_kernel(call: AttentionCall) -> str:
    """The kernel a CUDA GPU (sm80+, torch 2.11-2.13) runs ``call`` with: the first fused
    kernel of :data:`CUDA_FUSED_KERNELS` that takes it, else ``"math"``.

    >>> import torch
    >>> gqa = dict(heads=(32, 8, 8), head_dims=(64, 64, 64), lengths=(2048, 2048), gqa=True)
    >>> [cuda_kernel(AttentionCall(dtype, **gqa)) for dtype in (torch.bfloat16, torch.float32)]
    ['flash', 'math']
    """
    return next((k.name for k in CUDA_FUSED_KERNELS if k.takes(call)), "math")


class AttentionAsOnCuda(TorchFunctionMode):
    """Every ``scaled_dot_product_attention`` call run as a CUDA GPU would for what it saves:
    where the GPU runs the math kernel (:func:`cuda_kernel`), the CPU runs its own math kernel
    (``sdpa_kernel(SDPBackend.MATH)``), which saves what the GPU's does; where the GPU runs a
    fused kernel, the CPU's fused kernel, which saves what the GPU's fused kernels save (inputs,
    output, a per-row statistic). ``math_calls``: how many calls ran as math.

    A torch-function mode is off while torch runs a function it was given, so a block re-run
    inside ``backward`` (a checkpointed block's recompute) does not meet it: re-runs go through
    :meth:`replayed`."""

    def __init__(self) -> None:
        super().__init__()
        self.math_calls = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if (
            func is F.scaled_dot_product_attention
            and cuda_kernel(AttentionCall.of(args, kwargs)) == "math"
        ):
            self.math_calls += 1
            with sdpa_kernel(SDPBackend.MATH):
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def replayed(self) -> contextlib.AbstractContextManager[Any]:
        """The attention of re-run blocks (the measured block backwards, whose checkpointed
        recompute runs inside ``backward``): every call as math where the forward ran any as
        math (one kind of attention per model: fp32 with grouped heads), else as it comes."""
        return sdpa_kernel(SDPBackend.MATH) if self.math_calls else contextlib.nullcontext()
