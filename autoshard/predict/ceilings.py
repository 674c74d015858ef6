"""No prediction beyond what GPUs reach: the best model FLOPs utilisation (MFU) that published
FSDP runs reached, by GPU generation and model size. A step predicted faster than that is set
to the step at that MFU and flagged (``SpeedEstimate.mfu_capped``, ``breakdown.mfu_cap_s``).

The ceilings are the fitting set's published MFUs (``benchmarks/data/published_fsdp.json``,
the documents ``benchmarks/step_time_published.py`` fits on; no held-out row), the largest in
each size class, bf16 runs without float8. A float8 step may go beyond by the largest float8
gain published at that size. Where no run of a generation is published (Ada, Blackwell, CDNA,
CPU processes) or the precision has no published runs (fp32), nothing is capped.

>>> from autoshard.predict.ceilings import mfu_ceiling
>>> mfu_ceiling("hopper", 1.1e9, float8=False).mfu
0.4321
>>> mfu_ceiling("blackwell", 1.1e9, float8=False) is None
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoshard.config import Candidate, Precision
from autoshard.gpus import GPUSpec


@dataclass(frozen=True)
class Ceiling:
    """The best published MFU of a class, and the run that reached it."""

    mfu: float
    source: str


_FOUNDRY = "llm-foundry scripts/train/benchmarking/README.md"
_TITAN_A100 = "torchtitan docs/performance.md (2024), Llama 2 13B on 64 A100 80GB, no checkpointing"

# (largest model size in parameters, the ceiling) per GPU generation, smallest size first
CEILINGS: dict[str, tuple[tuple[float, Ceiling], ...]] = {
    "hopper": (
        (2e9, Ceiling(0.4321, f"{_FOUNDRY}: MPT-1b, 512 tokens, 8 H100 SXM, MFU 0.4321")),
        (1e10, Ceiling(0.4644, f"{_FOUNDRY}: MPT-7b, 2,048 tokens, 8 H100 SXM, MFU 0.4644")),
        (math.inf, Ceiling(0.4427, f"{_FOUNDRY}: MPT-13b, 1,024 tokens, 8 H100 SXM, MFU 0.4427")),
    ),
    "ampere": (
        (2e9, Ceiling(0.5986, f"{_FOUNDRY}: MPT-1b, 2,048 tokens, 8 A100 80GB, MFU 0.5986")),
        (1e10, Ceiling(0.6423, f"{_FOUNDRY}: MPT-7b, 2,048 tokens, 8 A100 80GB, MFU 0.6423")),
        (math.inf, Ceiling(0.611, f"{_TITAN_A100}, MFU 0.611")),
    ),
}

# The largest published float8 gain (torchao float8, compiled in both columns) by model size:
# OLMo-core's H100 table (benchmarks/data/published_compile_float8.json, olmo-core-h100-float8):
# +18% at 1B, +32% at Llama 8B, +20% at 13B.
FLOAT8_GAIN: tuple[tuple[float, float], ...] = ((2e9, 1.18), (1e10, 1.32), (math.inf, 1.20))


def _by_size(table: tuple[tuple[float, object], ...], params: float) -> object:
    return next(value for largest, value in table if params <= largest)


def mfu_ceiling(generation: str, params: float, *, float8: bool) -> Ceiling | None:
    """The best published MFU for a model of ``params`` parameters on a GPU of ``generation``
    (float8: times the largest float8 gain published at that size); None where none is
    published."""
    table = CEILINGS.get(generation)
    if table is None:
        return None
    ceiling = _by_size(table, params)
    assert isinstance(ceiling, Ceiling)
    if not float8:
        return ceiling
    gain = _by_size(FLOAT8_GAIN, params)
    assert isinstance(gain, float)
    return Ceiling(ceiling.mfu * gain, f"{ceiling.source}, times float8's {gain:.2f}")


def mfu_cap_seconds(
    step_s: float, peak_s: float, gpu: GPUSpec, candidate: Candidate, params: float
) -> float:
    """Seconds to add to a ``step_s`` whose work takes ``peak_s`` at the GPU's dense peak, so
    that its MFU is no more than the best published for its model size and GPU generation
    (:func:`~autoshard.predict.ceilings.mfu_ceiling`); 0 at or below it, for fp32 (no published
    ceiling) and where none is published for the generation."""
    if candidate.precision is Precision.FP32:
        return 0.0
    ceiling = mfu_ceiling(gpu.generation, params, float8=candidate.float8)
    if ceiling is None or peak_s <= ceiling.mfu * step_s:
        return 0.0
    return peak_s / ceiling.mfu - step_s
