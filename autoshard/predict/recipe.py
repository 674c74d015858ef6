"""What torch.compile and float8 change in a step, for the step-time and memory models: the
FLOP profile a compiled or float8 candidate runs (:meth:`RecipeStep.flops`), its all-gather
bytes, the float8 scales' sync, and the activations compile no longer saves
(:func:`recipe_activations`).

- **torch.compile** (inductor) fuses chains of element-wise and normalisation operations into
  one kernel that reads its inputs once and writes its outputs once: the memory-bound traffic
  and the kernels launched shrink (:data:`COMPILE_TRAFFIC_KEPT`), and so does the eager
  memory-bound time the traffic term does not show, which the eager step's compute efficiency
  carries (:data:`EAGER_MEMORY_BOUND_OVER_TRAFFIC`, taken off the matrix products' seconds,
  on GPUs); its partitioner recomputes
  cheap element-wise results in backward instead of saving them (:data:`COMPILE_SAVED_KEPT`).
- **float8** (torchao ``Float8Linear``, tensorwise dynamic scaling, FSDP2 float8 all-gather):
  the blocks' linear-layer FLOPs at the fp8 tensor-core rate, plus the casts (an amax and a cast
  of each linear's input in forward and again in backward, and of each output gradient), the
  converted weights gathered in 1 byte instead of 2, and after every optimizer step one amax
  over each weight shard and one all-reduce of the scales.

Every constant says where it comes from; ``benchmarks/data/published_compile_float8.json`` holds
the published effects they are checked against.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from autoshard.config import Candidate, Engine
from autoshard.engine import element_bytes
from autoshard.gpus import GPUSpec
from autoshard.predict.activations import ActivationProfile
from autoshard.predict.factors import DEFAULT_FACTORS
from autoshard.predict.flops import FlopProfile
from autoshard.predict.hardware import dense_flops
from autoshard.results import ModelProfile

# Share of the eager memory-bound traffic (and kernel launches) left after inductor's fusion.
# Counted on a Llama block: an RMSNorm is ~6 eager kernels (upcast, pow, mean, add, rsqrt, mul,
# downcast, mul) that each read and write the activation, one fused kernel reads and writes it
# once (~1/6); SwiGLU's silu and mul move 5 tensor passes eager, 3 fused (3/5); RoPE's ~10
# eager view/mul/add/cat passes become one (~1/5); a residual add fuses into the next norm.
# Weighted by bytes, ~0.35-0.45 of the traffic is left: 0.4. Not fitted; the published compile
# gains (1.10-1.27x) also need the eager memory-bound time the traffic term does not show:
# EAGER_MEMORY_BOUND_OVER_TRAFFIC.
COMPILE_TRAFFIC_KEPT = 0.4
# Eager memory-bound seconds per second of the model's traffic term (its counted bytes at
# ``memory_efficiency`` of HBM, at the compute dtype). compile fuses all of it (to
# COMPILE_TRAFFIC_KEPT), but the model's eager step carries the rest inside
# ``compute_efficiency`` (set on eager runs' MFU: bf16-mixed norms, RoPE and the loss run in
# fp32, small reductions miss the HBM rate). Set on published compile gains:
# benchmarks/results/measured_constants.md, "torch.compile and float8".
# GPUs only: CPU trials' memory-bound work has its own rates (and compile there is only checked).
EAGER_MEMORY_BOUND_OVER_TRAFFIC = 3.0
# Share of a non-checkpointed block's saved activations (beyond its input) kept under compile:
# AOTAutograd's min-cut partitioner saves the inputs of fused element-wise chains and recomputes
# their outputs in backward. Published savings: measured_constants.md, "torch.compile and float8".
COMPILE_SAVED_KEPT = 0.7
# Compute-dtype passes of one float8 cast of a tensor: an amax reads it (1), the cast reads it
# again (1) and writes 1-byte elements (0.5): torchao's float8 README, "fp8_overhead_time" (the
# amax and casts, bound by memory bandwidth).
CAST_PASSES = 2.5
# Share of the bf16 achievable matmul rate that fp8 GEMMs reach, per FLOP at twice the peak
# (torchao's measured linear: measured_constants.md, "torch.compile and float8").
FP8_MATMUL_EFFICIENCY = 0.93
# float8 linear layers' fallback cast elements per token, per sqrt(linear parameters) of a
# block, when the layers themselves are not known: Llama's (6d + f) inputs and (2.5d + 2f)
# output gradients with f = 3.5d over sqrt(13 d^2) parameters.
_ELEMENTS_PER_SQRT_PARAM = 5.5


@dataclass(frozen=True)
class LinearShapes:
    """The linear layers float8 converts, per block on average (:func:`linear_shapes`):
    elements per token of their inputs and of their outputs, their weights, and how many
    there are (a Llama block's seven where the layers are not known)."""

    inputs: float
    outputs: float
    params: float
    count: float = 7.0


def linear_shapes(model: nn.Module, profile: ModelProfile) -> LinearShapes | None:
    """What :func:`autoshard.sharding.float8_linears` converts in ``model`` (meta is fine), per
    block; None when the model has no block the analysis found."""
    from autoshard.sharding import float8_linears

    if not profile.block_count or not profile.wrap_policy:
        return None
    converted = float8_linears(model, Candidate(wrap_classes=profile.wrap_policy))
    linears = [m for m in converted if isinstance(m, nn.Linear)]
    n = profile.block_count
    return LinearShapes(
        inputs=sum(m.in_features for m in linears) / n,
        outputs=sum(m.out_features for m in linears) / n,
        params=sum(m.in_features * m.out_features for m in linears) / n,
        count=len(linears) / n,
    )


def _block_traffic(flops: FlopProfile, part: str) -> tuple[int, ...]:
    """Each block's counted traffic, zeros where the profile counted none: a profile whose
    fake forward failed (6 x parameters x tokens) has FLOPs per block and no traffic, and the
    casts are added block by block (on torch 2.11 every float8 prediction raised here: its
    FLOP formulas refused grouped-query attention, see flop_counting._query_heads)."""
    return flops.block_parts(part, "traffic")


def _scaled(values: tuple[int, ...], factor: float) -> tuple[int, ...]:
    return tuple(int(v * factor) for v in values)


def _flops_per_traffic_byte(candidate: Candidate, gpu: GPUSpec) -> float:
    """Profile FLOPs the matrix products run in the time the traffic term moves one profile
    byte (fp32 bytes, moved at the compute dtype), at the GPU's uncalibrated rates (its
    catalogue ``step_efficiency``, the default ``memory_efficiency``); 0 for CPU processes."""
    if gpu.host_is_device:
        return 0.0
    _, cb = element_bytes(candidate.precision)
    flop_s = dense_flops(gpu, candidate.precision) * gpu.matmul_fraction * gpu.step_efficiency
    return flop_s / (gpu.hbm_bandwidth * DEFAULT_FACTORS.memory_efficiency * 4 / cb)


# RecipeStep.flops's results by what they depend on, shared by the candidates of one estimate
_RUNS: dict[tuple[object, ...], FlopProfile] = {}
_RUNS_KEPT = 256


@dataclass(frozen=True)
class RecipeStep:
    """One candidate's compile and float8 changes to the step-time model's inputs."""

    candidate: Candidate
    eager: FlopProfile
    bf16_over_fp8: float  # seconds of an fp8 FLOP in bf16 FLOPs (the profile's unit)
    linears: LinearShapes
    block_params: float
    # profile FLOPs run in the time of one profile traffic byte (0: no hidden eager time)
    flops_per_byte: float = 0.0
    # share of the matrix products' modelled seconds that is not matrix products (1 - the
    # GPU's step_efficiency): the most of them the hidden eager memory-bound time can be
    slack: float = 0.0

    @classmethod
    def of(
        cls,
        candidate: Candidate,
        flops: FlopProfile,
        gpu: GPUSpec,
        profile: ModelProfile,
        linears: LinearShapes | None = None,
    ) -> RecipeStep:
        block_params = float(profile.block_params)
        if linears is None:  # Llama-shaped, from the block's size
            side = math.sqrt(block_params) * _ELEMENTS_PER_SQRT_PARAM
            linears = LinearShapes(inputs=side / 2, outputs=side / 2, params=block_params)
        fp8 = gpu.fp8_flops * FP8_MATMUL_EFFICIENCY if gpu.fp8_flops else gpu.bf16_flops
        return cls(
            candidate, flops, gpu.bf16_flops / fp8, linears, block_params,
            _flops_per_traffic_byte(candidate, gpu), 1.0 - gpu.step_efficiency,
        )  # fmt: skip

    @property
    def active(self) -> bool:
        return self.candidate.compile or self.candidate.float8

    def _compiled_everywhere(self) -> bool:
        # FSDP2 compiles each wrapped block (torchtitan); FSDP1, or no wrap unit: the whole model
        c = self.candidate
        return c.engine is Engine.FSDP1 or not c.wrap_classes

    def flops(
        self, *, compile: bool = True, float8: bool = True, casts: bool = True
    ) -> FlopProfile:
        """The FLOP profile the candidate runs, in the eager profile's units (bf16-rate FLOPs,
        fp32 traffic bytes); ``compile``/``float8``/``casts`` False leave that change out (what
        the breakdown attributes)."""
        c = self.candidate
        compiled, fp8 = compile and c.compile, float8 and c.float8
        if not (compiled or fp8):
            return self.eager
        # what the result depends on, the same for many candidates (batch sizes, shardings),
        # the module's constants included (read when called, as the computation reads them)
        key = (
            self.eager, compiled, fp8, casts and fp8, self._compiled_everywhere(),
            self.bf16_over_fp8, self.linears, self.flops_per_byte, self.slack,
            COMPILE_TRAFFIC_KEPT, EAGER_MEMORY_BOUND_OVER_TRAFFIC, CAST_PASSES,
        )  # fmt: skip
        run = _RUNS.get(key)
        if run is None:
            if len(_RUNS) >= _RUNS_KEPT:
                _RUNS.clear()
            run = _RUNS[key] = self._run_flops(compile=compile, float8=float8, casts=casts)
        return run

    def _run_flops(self, *, compile: bool, float8: bool, casts: bool) -> FlopProfile:
        f, c = self.eager, self.candidate
        update: dict[str, object] = {}
        if compile and c.compile:
            k = COMPILE_TRAFFIC_KEPT
            for part in ("forward", "backward"):
                for what in ("traffic", "ops"):
                    update[f"block_{part}_{what}"] = _scaled(getattr(f, f"block_{part}_{what}"), k)
                    if self._compiled_everywhere():
                        update[f"other_{part}_{what}"] = int(getattr(f, f"other_{part}_{what}") * k)
        compiled = compile and c.compile
        if compiled or (float8 and c.float8):
            for part in ("forward", "backward"):
                total = getattr(f, f"block_{part}")
                attention = f.block_parts(part, "attention")
                traffic = f.block_parts(part, "traffic")
                update[f"block_{part}"] = tuple(
                    int(a + self._matmul(t - a, b, float8=float8, compile=compiled))
                    for t, a, b in zip(total, attention, traffic, strict=True)
                )
                if compiled and self._compiled_everywhere():
                    other = getattr(f, f"other_{part}") - getattr(f, f"other_{part}_attention")
                    hidden = self._hidden_flops(getattr(f, f"other_{part}_traffic"), other)
                    update[f"other_{part}"] = int(getattr(f, f"other_{part}") - hidden)
            if casts and float8 and c.float8:
                fwd, bwd = self.cast_traffic()
                for part, extra in (("forward", fwd), ("backward", bwd)):
                    key = f"block_{part}_traffic"
                    base = update.get(key) or _block_traffic(f, part)
                    update[key] = tuple(int(t + e) for t, e in zip(base, extra, strict=True))  # type: ignore[call-overload]
        return f.model_copy(update=update) if update else f

    def _hidden_flops(self, traffic: int, most: float) -> float:
        """The eager memory-bound time beyond the traffic term that compile's fusion takes
        off (:data:`EAGER_MEMORY_BOUND_OVER_TRAFFIC`), in the matrix products' FLOPs (whose
        ``compute_efficiency`` carries it), no more than the share of ``most`` that
        efficiency leaves to other work (a model small enough to be mostly memory-bound)."""
        extra = (EAGER_MEMORY_BOUND_OVER_TRAFFIC - 1) * (1 - COMPILE_TRAFFIC_KEPT)
        return min(self.slack * most, extra * traffic * self.flops_per_byte)

    def _matmul(self, matmul: int, traffic: int, *, float8: bool, compile: bool) -> float:
        """A block's matrix-product FLOPs as run: at the fp8 rate (its linear layers) under
        float8, less the hidden eager memory-bound time under compile (the same seconds
        with or without float8: fp8 speeds up the products, not the element-wise work)."""
        run = matmul * self.bf16_over_fp8 if float8 and self.candidate.float8 else float(matmul)
        return run - self._hidden_flops(traffic, run) if compile else run

    def cast_traffic(self) -> tuple[list[float], list[float]]:
        """Per block, the float8 casts' traffic of one sample (fp32 profile bytes, as the
        profile's traffic): the inputs cast in forward, then in backward the inputs again (for
        the weight gradient) and the output gradients. Tokens per sample from the block's
        matrix-product FLOPs: 2 FLOPs per weight and token in forward."""
        f, lin = self.eager, self.linears
        fwd_attn = f.block_forward_attention
        fwd, bwd = [], []
        for i, total in enumerate(f.block_forward):
            matmul = total - (fwd_attn[i] if i < len(fwd_attn) else 0)
            tokens = matmul / (2 * lin.params) if lin.params else 0.0
            per_element = CAST_PASSES * 4  # compute-dtype passes, in the profile's fp32 bytes
            fwd.append(per_element * lin.inputs * tokens)
            bwd.append(per_element * (lin.inputs + lin.outputs) * tokens)
        return fwd, bwd

    @property
    def gather_scale(self) -> float:
        """Bytes of a float8 candidate's all-gather over its eager bytes: the converted weights
        travel in 1 byte (torchao's float8 all-gather casts each shard before the gather).
        Spread over every unit's gather (the embedding and head stay bf16)."""
        if not self.candidate.float8 or not self.block_params:
            return 1.0
        _, cb = element_bytes(self.candidate.precision)
        converted = min(1.0, self.linears.params / self.block_params)
        return 1.0 - converted * (1.0 - 1.0 / cb)

    def scale_sync_s(self, blocks: int, shard: int, latency_s: float, byte_s: float) -> float:
        """After each optimizer step, the amax of every converted weight's fp32 shard and one
        all-reduce of the scales (torchao's ``precompute_float8_dynamic_scale_for_fsdp``)."""
        if not self.candidate.float8:
            return 0.0
        shard_bytes = 4 * self.linears.params * blocks / max(shard, 1)
        return latency_s + shard_bytes / byte_s

    def breakdown(self, busy: Callable[[FlopProfile], float]) -> dict[str, float]:
        """The breakdown's compile and float8 terms, from ``busy`` (compute and recompute
        seconds of a FLOP profile): what compile took off, what the fp8 rate took off, and
        what the casts put back."""
        if not self.active:
            return {}
        eager = busy(self.eager)
        compiled = busy(self.flops(float8=False))
        no_casts = busy(self.flops(casts=False))
        full = busy(self.flops())
        return {
            "compile_saving_s": eager - compiled,
            "float8_matmul_saving_s": compiled - no_casts,
            "float8_cast_s": full - no_casts,
        }


def recipe_activations(candidate: Candidate, acts: ActivationProfile) -> ActivationProfile:
    """The activation profile a compiled candidate saves: of each block's saved bytes beyond
    its input, :data:`COMPILE_SAVED_KEPT` (checkpointed blocks keep their input only, which
    compile does not change). float8 saves what bf16 does: torchao's ``Float8Linear`` keeps the
    high-precision input for backward; published peaks moved -0.5% to +0.3% (torchtitan's Llama
    3.1 8B table, torchao's H100 and MI300X runs, published_compile_float8.json)."""
    if not candidate.compile:
        return acts

    def kept(profile: ActivationProfile) -> ActivationProfile:
        inputs = profile.block_input_bytes
        blocks = tuple(
            int(i + COMPILE_SAVED_KEPT * (b - i))
            if (i := (inputs[n] if n < len(inputs) else 0)) < b
            else b
            for n, b in enumerate(profile.block_bytes)
        )
        return profile.model_copy(update={"block_bytes": blocks, "others": ()})

    return kept(acts).model_copy(update={"others": tuple(kept(o) for o in acts.others)})
