"""Host memory: CPU offload's need is shown, checked where known, and never assumed silently.

70B on 8 x 80 GiB fits only with CPU offload, which needs about 1.1 TiB of host memory per node.
"""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch

import autoshard
from autoshard import detect as detect_module
from autoshard.detect import detect_hardware, machine_memory
from autoshard.errors import ConfigError

from .conftest import EXAMPLES

GPT = f"{EXAMPLES}/gpt.py:build"
BIG = {"kwargs": {"size": "70b"}, "gpus": 8, "gpu_memory": "80GiB", "seq_len": 4096}
CLI_BIG = [GPT, "--arg", "size=70b", "--gpus", "8", "--gpu-memory", "80GiB", "--seq-len", "4096"]
TIB = 2**40


def _plan_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, autoshard.PlanWarning)]


@pytest.fixture(scope="module")
def big_estimates():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimates = autoshard.estimate(GPT, **BIG)
    return estimates, _plan_warnings(caught)


def test_offload_without_host_memory_warns_with_the_need(big_estimates):
    estimates, said = big_estimates
    first = estimates[0]
    assert first.fits and first.candidate.cpu_offload  # nothing else fits 8 x 80 GiB
    # AdamW's fp32 params, grads and two states of 70B, a node's eight shards: about 1 TiB, the
    # pinned shards and host gradients each rounded up to a power of two (CUDA's host allocator)
    assert 1.1 * TIB < first.host_peak < 1.2 * TIB
    host = [w for w in said if w.startswith("offload needs")]
    assert host == [
        f"offload needs 1.13 TiB of host memory per node ({first.candidate.label()}), assumed to be "
        "there (no host memory given); give --host-memory / host_memory= for yours"
    ]
    # every offload candidate carries its need; the others need none
    assert all((e.host_peak > 0) == e.candidate.cpu_offload for e in estimates)
    # the recommendation says what it needs of the host, and that nobody checked it
    rec = estimates.recommendation
    assert rec is not None and rec.chosen.candidate.cpu_offload
    assert any(
        r.startswith("CPU offload needs 1.13 TiB of host memory per node") and "not checked" in r
        for r in rec.reasons
    )


def test_recommend_says_the_host_need():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = autoshard.recommend(GPT, **BIG)
    assert any(w.startswith("offload needs 1.13 TiB") for w in _plan_warnings(caught))
    assert any(r.startswith("CPU offload needs 1.13 TiB") for r in rec.reasons)


def test_no_warning_when_the_answer_does_not_offload():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimates = autoshard.estimate(GPT, kwargs={"size": "tiny"}, gpus=8, gpu_memory="80GiB",
                                       seq_len=128)  # fmt: skip
    assert not estimates[0].candidate.cpu_offload
    assert not any("host memory" in w for w in _plan_warnings(caught))


def test_cli_estimate_shows_the_need(cli):
    code, out, err = cli("estimate", *CLI_BIG)
    assert code == 0
    assert "warning: offload needs 1.13 TiB of host memory per node" in err
    assert "host / node" in out and "1.13 TiB" in out
    code, out, err = cli("estimate", *CLI_BIG, "--json")
    data = json.loads(out)
    assert any(n.startswith("offload needs 1.13 TiB") for n in data["notes"])
    assert data["estimates"][0]["host_peak"] > 0.9 * TIB
    assert any(r.startswith("CPU offload needs") for r in data["recommendation"]["reasons"])
    assert data["nothing_fits"] is None


def test_host_memory_short_is_one_line_naming_what_would_fit(cli):
    with pytest.raises(ConfigError) as raised:
        autoshard.recommend(GPT, **BIG, host_memory="512GiB")
    line = str(raised.value)
    assert "\n" not in line
    assert line.startswith("no configuration fits 1 x 8 GPUs of 80 GiB with 512 GiB of host")
    # a node's share of the offloaded state halves with 2 nodes (still over 512 GiB) and
    # fits on 3; or 1.13 TiB of host memory on one node
    assert "it would fit on 3 nodes of 8 GPUs" in line
    assert "or with 1.13 TiB of host memory per node" in line
    code, out, _ = cli("estimate", *CLI_BIG, "--host-memory", "512GiB")
    assert code == 0 and line in out.replace("\n", "")  # the table, then the same line
    code, out, _ = cli("estimate", *CLI_BIG, "--host-memory", "512GiB", "--json")
    data = json.loads(out)
    assert data["recommendation"] is None and data["nothing_fits"] == line


def test_the_nodes_it_names_are_the_fewest_that_fit():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        two = autoshard.estimate(GPT, **{**BIG, "nodes": 2}, host_memory="512GiB")
        three = autoshard.estimate(GPT, **{**BIG, "nodes": 3}, host_memory="512GiB")
    assert two.recommendation is None and three.recommendation is not None
    assert three.recommendation.chosen.estimate.host_peak <= 512 * 2**30


def test_this_machines_ram_is_the_host_limit(monkeypatch):
    ram = machine_memory()
    assert ram is not None and ram > 2**30
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # planning for the CPU processes here: this machine
        assert detect_hardware(gpu="cpu-gloo", gpus=2).host_memory == ram
        # planning for GPUs that are not here: unknown, never this machine's
        assert detect_hardware(gpus=8, gpu_memory="80GiB").host_memory is None
        assert detect_hardware(gpus=8, host_memory="2TiB").host_memory == 2 * TIB
    # GPUs visible and none given: the plan is for this machine
    monkeypatch.setattr(detect_module, "_visible_gpus", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda *_: SimpleNamespace(total_memory=80 * 2**30)
    )
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *_: True)
    assert detect_hardware().host_memory == ram
    assert detect_hardware(gpus=4).host_memory == ram  # some of this machine's GPUs
    assert detect_hardware(gpus=16).host_memory is None  # more than it has: another machine
    assert detect_hardware(gpu="a100-80gb-sxm").host_memory is None  # another GPU: elsewhere
