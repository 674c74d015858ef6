"""No prediction beyond what GPUs reach (autoshard.predict.ceilings): a predicted MFU above the
best published one of its model size and GPU generation is capped there and flagged; nothing
changes below it, for fp32, or where nothing is published."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoshard.config import Candidate
from autoshard.gpus import CATALOGUE
from autoshard.predict.ceilings import CEILINGS, FLOAT8_GAIN, mfu_cap_seconds, mfu_ceiling

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "published_fsdp.json"
H200 = CATALOGUE["h200"]
BF16 = Candidate()


def test_the_cap_applies_only_above_the_ceiling() -> None:
    ceiling = mfu_ceiling("hopper", 1.1e9, float8=False)
    assert ceiling is not None
    peak_s = 0.1  # the step's work at the dense peak
    at_ceiling = peak_s / ceiling.mfu
    # below or at the ceiling: nothing added
    assert mfu_cap_seconds(2 * at_ceiling, peak_s, H200, BF16, 1.1e9) == 0.0
    assert mfu_cap_seconds(at_ceiling, peak_s, H200, BF16, 1.1e9) == 0.0
    # above it: the step at the ceiling's MFU
    fast = 0.5 * at_ceiling
    assert fast + mfu_cap_seconds(fast, peak_s, H200, BF16, 1.1e9) == pytest.approx(at_ceiling)


def test_no_cap_for_fp32_nor_where_no_run_is_published() -> None:
    fp32 = Candidate(precision="32-true")
    assert mfu_cap_seconds(1e-3, 1.0, H200, fp32, 1.1e9) == 0.0
    assert mfu_cap_seconds(1e-3, 1.0, CATALOGUE["b200"], BF16, 1.1e9) == 0.0
    assert mfu_ceiling("blackwell", 1e9, float8=False) is None


def test_float8_may_go_as_far_beyond_as_the_published_float8_gain() -> None:
    plain = mfu_ceiling("hopper", 8e9, float8=False)
    float8 = mfu_ceiling("hopper", 8e9, float8=True)
    assert plain is not None and float8 is not None
    assert float8.mfu == pytest.approx(plain.mfu * dict(FLOAT8_GAIN)[1e10])


def test_each_ceiling_is_a_published_fitting_set_mfu_and_the_largest_of_its_class() -> None:
    import importlib.util
    import sys

    benchmarks = DATA.parents[1]
    sys.path.insert(0, str(benchmarks))
    try:
        spec = importlib.util.spec_from_file_location("stp", benchmarks / "step_time_published.py")
        assert spec and spec.loader
        stp = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(stp)
    finally:
        sys.path.remove(str(benchmarks))
    generation = {gpu_id: spec.generation for gpu_id, spec in CATALOGUE.items()}
    best: dict[tuple[str, float], float] = {}
    for group in json.loads(DATA.read_text())["groups"]:
        if stp.split(group["source"]) != "fitting":
            continue
        for record in group["records"]:
            mfu = record["throughput"].get("mfu")
            if not mfu or record["float8"]:
                continue
            table = CEILINGS.get(generation[record["gpu"]], ())
            size = next((s for s, _ in table if record["model"]["params"] <= s), None)
            if size is not None:
                key = (generation[record["gpu"]], size)
                best[key] = max(best.get(key, 0.0), mfu)
    for gen, table in CEILINGS.items():
        for size, ceiling in table:
            assert ceiling.mfu == pytest.approx(best[(gen, size)], abs=1e-4), (gen, size)
