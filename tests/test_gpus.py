"""The GPU catalogue: complete, sourced, self-consistent entries; real device names map to them."""

from __future__ import annotations

import doctest

import pytest
from pydantic import ValidationError

from autoshard import gpus
from autoshard.errors import ConfigError
from autoshard.gpus import CATALOGUE, DEFAULT_GPU, GPUSpec, gpu_spec, match_gpu_name

REQUIRED = {
    "a100-40gb-sxm",
    "a100-80gb-sxm",
    "a100-40gb-pcie",
    "a100-80gb-pcie",
    "h100-sxm",
    "h100-pcie",
    "h200",
    "l4",
    "l40s",
    "a10g",
    "mi300x",
    "cpu-gloo",
}
NUMBERS = (
    "memory",
    "bf16_flops",
    "fp16_flops",
    "tf32_flops",
    "fp32_flops",
    "hbm_bandwidth",
    "intra_node_bandwidth",
    "inter_node_bandwidth",
    "host_link_bandwidth",
)
GPU_IDS = sorted(set(CATALOGUE) - {"cpu-gloo"})


def test_the_catalogue_has_every_gpu_the_issue_asks_for_and_the_default() -> None:
    assert set(CATALOGUE) >= REQUIRED
    assert DEFAULT_GPU in CATALOGUE
    assert all(spec.id == key for key, spec in CATALOGUE.items())


@pytest.mark.parametrize("gpu_id", sorted(CATALOGUE))
def test_every_entry_is_sourced_and_positive(gpu_id: str) -> None:
    spec = CATALOGUE[gpu_id]
    assert spec.sources and all(len(source) > 20 for source in spec.sources)
    assert spec.notes and spec.intra_node_link and spec.name
    for field in NUMBERS:
        assert getattr(spec, field) > 0, field


@pytest.mark.parametrize("gpu_id", GPU_IDS)
def test_gpu_numbers_are_in_the_right_order_and_units(gpu_id: str) -> None:
    spec = CATALOGUE[gpu_id]
    # Tensor cores: bf16 >= TF32 >= plain fp32 on every GPU of the catalogue.
    assert spec.bf16_flops >= spec.tf32_flops >= spec.fp32_flops
    assert spec.fp16_flops == spec.bf16_flops
    # Units: FLOP/s in 1e13..1e16 (tens of TFLOPS to PFLOPS), bytes in 16..256 GiB, memory
    # bandwidth 0.1..10 TB/s: catches a TFLOPS/GB typed without its multiplier.
    assert 1e13 < spec.bf16_flops < 1e16
    assert 16 * 2**30 <= spec.memory <= 256 * 2**30
    assert 1e11 < spec.hbm_bandwidth < 1e13
    # A GPU's own memory is faster than any link out of it; the host link is PCIe.
    assert spec.hbm_bandwidth > spec.intra_node_bandwidth >= spec.host_link_bandwidth
    assert spec.host_link_bandwidth in (32e9, 64e9)


def test_datasheet_values_are_dense_not_sparse() -> None:
    # NVIDIA prints H100 SXM bf16 as 1,979 TFLOPS "with sparsity": dense is half.
    assert gpu_spec("h100-sxm").bf16_flops == pytest.approx(989.5e12)
    assert gpu_spec("h100-pcie").bf16_flops == pytest.approx(756.5e12)
    assert gpu_spec("a100-80gb-sxm").tf32_flops == pytest.approx(156e12)
    # NVLink 900 GB/s is both directions: 450 GB/s one way.
    assert gpu_spec("h100-sxm").intra_node_bandwidth == pytest.approx(450e9)
    assert gpu_spec("h200").memory == 141 * 2**30


def test_cpu_entry_says_its_speeds_are_placeholders() -> None:
    notes = gpu_spec("cpu-gloo").notes
    assert "PLACEHOLDER" in notes and "calibrated by trials" in notes


@pytest.mark.parametrize(
    ("device_name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H200 NVL", "h200-nvl"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA GB200", None),
        ("NVIDIA GH200 480GB", None),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb-sxm"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb-sxm"),
        ("NVIDIA A100-PCIE-40GB", "a100-40gb-pcie"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA A10", "a10"),
        ("NVIDIA A40", "a40"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L40", None),
        ("AMD Instinct MI300X", "mi300x"),
        ("AMD Instinct MI300X VF", "mi300x"),
        ("Tesla V100-SXM2-16GB", None),
        ("", None),
    ],
)
def test_real_device_names_map_to_their_entry(device_name: str, expected: str | None) -> None:
    assert match_gpu_name(device_name) == expected


def test_unknown_id_is_one_line_listing_the_valid_ids() -> None:
    with pytest.raises(ConfigError) as error:
        gpu_spec("v100")
    message = str(error.value)
    assert "\n" not in message and "'v100'" in message
    assert all(gpu_id in message for gpu_id in CATALOGUE)
    assert gpu_spec(" H100-SXM ") is CATALOGUE["h100-sxm"]  # case and spaces forgiven


def test_entries_are_immutable_and_reject_unknown_fields() -> None:
    spec = gpu_spec("l4")
    with pytest.raises(ValidationError):
        spec.memory = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        GPUSpec.model_validate({**spec.model_dump(), "tflops": 1.0})


def test_module_examples_run() -> None:
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report: list[str] = []
    for test in finder.find(gpus, "autoshard.gpus"):
        runner.run(test, out=report.append)
    assert runner.tries > 0
    assert runner.failures == 0, "".join(report)


def test_a_gpu_is_one_entry_carrying_its_own_facts() -> None:
    # every fact the planner reads of a GPU is a field of its entry: no table keyed by GPU id
    # beside the entries (issue 35: a new GPU was one entry plus four tables and a branch)
    from autoshard import gpu_entries

    assert not any(
        isinstance(value, dict) and set(value) & set(CATALOGUE)
        for module in (gpus, gpu_entries)
        for name, value in vars(module).items()
        if name not in {"CATALOGUE", "__builtins__"}
    )
    assert len(gpu_entries.ENTRIES) == len(CATALOGUE)
    for spec in CATALOGUE.values():
        if spec.id == "cpu-gloo":
            assert spec.matches == ()  # never a device name
            continue
        assert spec.generation and spec.matches, spec.id
        # each entry is found by its own name tokens
        for match in spec.matches:
            assert match_gpu_name(" ".join(("NVIDIA", *match))) == spec.id, spec.id


def test_an_unknown_device_name_says_which_entries_exist() -> None:
    line = gpus.unknown_gpu("NVIDIA GH200 480GB")
    assert "\n" not in line and "'NVIDIA GH200 480GB'" in line
    assert all(gpu_id in line for gpu_id in CATALOGUE if gpu_id != "cpu-gloo")
    assert "--gpu" in line


def test_of_the_entries_a_name_fits_the_most_specific_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    base = CATALOGUE["a100-40gb-sxm"]
    plain = base.model_copy(update={"id": "x", "matches": (("X100",),), "unless": ()})
    large = base.model_copy(update={"id": "x-80", "matches": (("X100", "80GB"),), "unless": ()})
    monkeypatch.setattr(gpus, "CATALOGUE", {"x": plain, "x-80": large})
    assert match_gpu_name("NVIDIA X100 80GB") == "x-80"
    assert match_gpu_name("NVIDIA X100") == "x"
