"""benchmarks/estimate_accuracy.py --device cuda, up to where CUDA is needed: a point's peak is
what it adds to what the allocator held before it (the first GPU run reported 2.52 GB allocated
against 91 MB tracked: the earlier points' leftovers were in every later peak), and the table
shows the tracker's count beside the allocator's. The CUDA allocator is a stand-in here."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def accuracy(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("acc", ROOT / "benchmarks/estimate_accuracy.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Allocator:
    """torch.cuda's counters: what is held now, the peaks since their reset."""

    def __init__(self, held: int) -> None:
        self.held, self.peak, self.calls = held, held, []  # type: ignore[var-annotated]

    def alloc(self, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "empty_cache", lambda: self.calls.append("empty_cache"))
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda d=None: self._reset())
        for name, value in (("memory_allocated", "held"), ("memory_reserved", "held"),
                            ("max_memory_allocated", "peak"), ("max_memory_reserved", "peak")):  # fmt: skip
            monkeypatch.setattr(cuda, name, lambda d=None, v=value: getattr(self, v))

    def _reset(self) -> None:
        self.calls.append("reset")
        self.peak = self.held


def test_a_points_peak_is_what_it_adds_to_its_baseline(
    accuracy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    left_over = 2_400_000_000  # what the points before left on the GPU
    allocator = Allocator(held=left_over)
    allocator.install(monkeypatch)
    device = torch.device("cuda", 0)
    baseline = accuracy.cuda_baseline(device)
    assert allocator.calls == ["empty_cache", "reset"]  # the peak counts from here
    allocator.alloc(91_000_000)
    allocator.alloc(-50_000_000)
    peaks = accuracy.cuda_peaks(device, baseline)
    assert peaks["allocated"] == 91_000_000 and peaks["reserved"] == 91_000_000
    assert peaks["baseline_allocated"] == left_over


def test_the_cuda_table_shows_the_trackers_count_beside_the_allocators(accuracy: Any) -> None:
    point = {"shape": "gpt-deep", "engine": "fsdp1", "sharding": "FULL_SHARD",
             "checkpointing": "none", "precision": "bf16-mixed", "micro_batch_size": 1,
             "optimizer": "sgd"}  # fmt: skip
    measured = {"point": point, "tracked": 91 * 2**20, "allocated": 95 * 2**20,
                "reserved": 128 * 2**20, "baseline_allocated": 2**30}  # fmt: skip
    table = accuracy.report([point], [measured], [(94 * 2**20, 92 * 2**20)], "cuda")
    assert "| 95.0 (tracked 91.0) | 94.0 | -1.1% |" in table
    cpu = accuracy.report([point], [{"point": point, "tracked": 91 * 2**20}], [(94 * 2**20,) * 2],
                          "cpu")  # fmt: skip
    assert "| 91.0 | 94.0 | +3.3% |" in cpu
