"""The candidates table marks an MFU held at the best published one (issue 33: a capped
prediction is flagged, not shown as a peer of the others)."""

from __future__ import annotations

from rich.console import Console

from autoshard.config import Candidate, Hardware
from autoshard.results import MemoryBreakdown, MemoryEstimate, SpeedEstimate
from autoshard.ui.tables import CAP_MARK, CAP_WORDS, estimates_table, mfu_cell


def _estimate(mbs: int, mfu: float, capped: bool) -> MemoryEstimate:
    speed = SpeedEstimate(step_time_s=1.0, samples_per_s=1.0, mfu=mfu, mfu_capped=capped)
    return MemoryEstimate(
        candidate=Candidate(micro_batch_size=mbs), method="analytic", gpu_peak=1,
        breakdown=MemoryBreakdown(), fits=True, headroom=1, speed=speed,
    )  # fmt: skip


def _text(estimates: list[MemoryEstimate]) -> str:
    console = Console(width=200, record=True)
    hardware = Hardware(gpu_memory=80 * 2**30)
    console.print(estimates_table(estimates, hardware, width=200))
    return " ".join(console.export_text().split())


def test_a_capped_mfu_is_marked_and_said() -> None:
    capped, free = _estimate(8, 0.43, True), _estimate(4, 0.30, False)
    assert mfu_cell(capped.speed) == "43%" + CAP_MARK  # type: ignore[arg-type]
    assert mfu_cell(free.speed) == "30%"  # type: ignore[arg-type]
    text = _text([capped, free])
    assert "43% cap" in text and " ".join(CAP_WORDS.split()) in text
    # nothing capped: no mark, no caption
    assert "cap" not in _text([free]).replace("capacity", "")
