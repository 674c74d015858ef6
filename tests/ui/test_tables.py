"""The terminal's tables (autoshard/ui/tables.py): `autoshard analyze`'s profile (the classes,
the module tree with runs of equal siblings folded, the proposed policies) and `autoshard
estimate`'s per-GPU memory table and breakdowns, read back from a recording console."""

from __future__ import annotations

from rich.console import Console
from torch import nn

from autoshard.analyze import analyze_model
from autoshard.config import Candidate, Hardware
from autoshard.results import MemoryBreakdown, MemoryEstimate, SpeedEstimate
from autoshard.ui.tables import (
    BREAKDOWNS,
    CLASS_ROWS,
    _collapse_runs,
    estimates_table,
    print_estimates,
    print_profile,
)

GIB = 2**30


class Block(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.ff = nn.Linear(4, 4, bias=bias)

    def forward(self, x):
        return self.ff(x)


class Net(nn.Module):
    """An embedding (40 parameters), four blocks of 20 (the last of 16 where ``odd``), a head of
    40."""

    def __init__(self, odd: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(Block(bias=not (odd and i == 3)) for i in range(4))
        self.head = nn.Linear(4, 10, bias=False)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def recorded(width: int = 150) -> Console:
    return Console(record=True, width=width)


def test_runs_of_equal_siblings_are_one_row_and_a_different_one_stands_alone() -> None:
    assert _collapse_runs(analyze_model(Net())) == [
        ("<root>", "Net", "160"),
        ("  embed", "Embedding", "40"),
        ("  blocks", "ModuleList", "80"),
        ("    blocks.0 .. 3", "Block x4", "20 each"),
        ("  head", "Linear", "40"),
    ]
    odd = _collapse_runs(analyze_model(Net(odd=True)))
    assert odd[3:5] == [
        ("    blocks.0 .. 2", "Block x3", "20 each"),
        ("    blocks.3", "Block", "16"),
    ]


def test_the_profile_marks_the_blocks_gives_ranges_and_proposes_the_policies() -> None:
    console = recorded()
    print_profile(analyze_model(Net()), console)
    text = console.export_text()
    assert "Net: 160 parameters (160; 640 B in float32)" in text
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if line.count("│") > 4}
    assert "Block (block)" in rows and "(block)" not in rows["Linear"]
    assert "20-40" in rows["Linear"] and "75.0%" in rows["Linear"]  # sizes differ: a range
    assert "blocks.0 .. 3" in text and "Block x4" in text
    assert "{" + f"{__name__}.Block" + "}" in text  # the wrap and checkpoint policies
    assert "root unit" in text and "80 params (50.0%); largest unit 80" in text
    assert "warning: wrapped units hold only 20 parameters each" in text


def test_the_classes_past_the_first_twelve_are_counted_not_listed() -> None:
    kinds = [type(f"Kind{i}", (nn.Linear,), {}) for i in range(CLASS_ROWS + 2)]
    many = nn.ModuleDict({f"k{i}": kind(4, 4 + i) for i, kind in enumerate(kinds)})
    profile = analyze_model(many)
    assert len(profile.classes) > CLASS_ROWS
    console = recorded()
    print_profile(profile, console)
    text = console.export_text()
    assert f"{len(profile.classes) - CLASS_ROWS} smaller classes not shown" in text
    table = text.split("Module tree")[0]
    listed = {k.__name__ for k in kinds if f" {k.__name__} " in table}
    # the model's own class and the 11 largest kinds; the 3 smallest are left out
    assert listed == {f"Kind{i}" for i in range(3, len(kinds))}


def estimate(mbs: int, fits: bool, *, speed: float | None = None) -> MemoryEstimate:
    peak = mbs * GIB
    return MemoryEstimate(
        candidate=Candidate(micro_batch_size=mbs),
        method="analytic",
        gpu_peak=peak,
        breakdown=MemoryBreakdown(activations=peak),
        fits=fits,
        headroom=4 * GIB - peak,
        speed=None
        if speed is None
        else SpeedEstimate(
            step_time_s=1.0, samples_per_s=1.0, tokens_per_s_per_gpu=speed, mfu=0.25
        ),
    )


def test_the_memory_table_marks_the_choice_and_says_how_many_it_left_out() -> None:
    estimates = [estimate(1, True), estimate(2, True), estimate(8, False)]
    hardware = Hardware(gpus_per_node=2, gpu_memory=8 * GIB)
    chosen = estimates[1].candidate
    console = recorded()
    console.print(estimates_table(estimates, hardware, limit=2, chosen=chosen))
    text = console.export_text()
    assert "Per-GPU memory on 1 x 2 GPUs of 8 GiB (usable 7.6 GiB)" in text
    assert "1 more not shown (--all shows them)" in text
    assert estimates[2].candidate.label() not in text
    lines = text.splitlines()
    (at,) = [i for i, line in enumerate(lines) if "← recommended" in line]
    assert chosen.label() in lines[at - 1] or chosen.label() in lines[at]
    assert "tokens/s per GPU" not in text  # no speed predicted: no speed columns
    fast = [estimate(1, True, speed=12345.0)]
    console = recorded()
    console.print(estimates_table(fast, None))
    text = console.export_text()
    assert "tokens/s per GPU" in text and "12,345" in text and "25%" in text
    assert "more not shown" not in text
    assert text.splitlines()[0].strip() == "Per-GPU memory"  # no hardware: no GPUs to name


def test_breakdowns_for_the_first_fitting_ones_and_nothing_fits_in_one_line() -> None:
    fitting = [estimate(m, True) for m in range(1, BREAKDOWNS + 2)]
    console = recorded(200)
    print_estimates(fitting, Hardware(gpus_per_node=2, gpu_memory=8 * GIB), console,
                    nothing_fits="needs 2 nodes")  # fmt: skip
    text = console.export_text()
    assert text.count("Breakdown: ") == BREAKDOWNS
    assert "allowance = " in text  # a GPU's: the context and slack no CPU estimate sees
    assert "Nothing fits: needs 2 nodes" in text
    console = recorded(200)
    gloo = Hardware(gpus_per_node=2, gpu_memory=8 * GIB, backend="gloo")
    print_estimates([estimate(8, False)], gloo, console)
    text = console.export_text()
    assert "Breakdown: " not in text and "allowance = " not in text
    assert "Nothing fits: see the table for by how much" in text
