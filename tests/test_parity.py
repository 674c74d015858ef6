"""One answer whatever the door: the command line, ``autoshard.estimate/recommend/tune`` and
``export`` go through one pipeline (autoshard.plan) and one decision."""

from __future__ import annotations

import json
import warnings
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import yaml

import autoshard
from autoshard.config import Sharding
from autoshard.errors import PlanWarning
from autoshard.options import PlanOptions
from autoshard.plan import make_plan, make_request
from autoshard.results import TrialStatus
from autoshard.search import trial_order

from .conftest import EXAMPLES

pytestmark = pytest.mark.filterwarnings("ignore::autoshard.PlanWarning")

# Every example target, small enough to plan in seconds (keyword arguments of its factory).
EXAMPLE_TARGETS = {
    "gpt": {"size": "tiny"},
    "hf_llama": {},
    "hf_gpt2": {},
    "hf_t5": {},
    "hf_vit": {},
    "lightning_module": {"vocab_size": 1000},
    "lightning_transformer": {"vocab_size": 1000},
}
# The same inputs at every door: 2 x 8 GPUs of a small memory, so that some candidates do
# not fit and the order matters, and two micro-batch sizes.
OPTIONS = {"gpus": "8", "nodes": "2", "gpu_memory": "2GiB", "batch_size": "1,4"}


def _needs(name: str) -> None:
    pytest.importorskip("transformers" if name.startswith("hf_") else "lightning")


def _cli_args(name: str, kwargs: dict[str, object]) -> list[str]:
    args = ["estimate", f"{EXAMPLES}/{name}.py:build"]
    for key, value in kwargs.items():
        args += ["--arg", f"{key}={value}"]
    for key, value in OPTIONS.items():
        args += [f"--{key.replace('_', '-')}", value]
    return args


@pytest.mark.parametrize("name", sorted(EXAMPLE_TARGETS))
def test_estimate_export_and_recommend_agree(name: str, cli, tmp_path: Path) -> None:
    _needs(name)
    kwargs = EXAMPLE_TARGETS[name]
    code, out, err = cli(*_cli_args(name, kwargs), "--json")
    assert code == 0, err
    data = json.loads(out)
    in_code = autoshard.estimate(f"{EXAMPLES}/{name}.py:build", kwargs=kwargs, **OPTIONS)
    # The same candidates with the same peaks, in the same order.
    assert [(e["candidate"], e["gpu_peak"]) for e in data["estimates"]] == [
        (e.candidate.model_dump(mode="json"), e.gpu_peak) for e in in_code
    ]
    rec = autoshard.recommend(f"{EXAMPLES}/{name}.py:build", kwargs=kwargs, **OPTIONS)
    assert in_code.recommendation is not None
    assert in_code.recommendation.chosen.candidate == rec.chosen.candidate

    path = tmp_path / "estimate.json"
    path.write_text(out)
    code, exported, err = cli("export", path, "--format", "json")
    assert code == 0, err
    assert json.loads(exported)["chosen"]["candidate"] == rec.chosen.candidate.model_dump(
        mode="json"
    )
    code, text, err = cli("export", path, "--format", "lightning")
    assert code == 0, err
    header = text.splitlines()[0]
    assert header.startswith(f"# autoshard {autoshard.__version__}:"), header
    assert "by estimate" in text  # how it chose


def test_seventy_b_on_eight_nodes_never_offloads(cli, tmp_path: Path) -> None:
    """A 70B model on 8 nodes x 8 x 80 GiB: configurations without CPU offload fit, so no
    door picks offload (the slowest option there is)."""
    target, kwargs = f"{EXAMPLES}/gpt.py:build", {"size": "70b"}
    options = {"gpus": 8, "nodes": 8, "gpu_memory": "80GiB", "seq_len": 4096, "batch_size": 1}
    rec = autoshard.recommend(target, kwargs=kwargs, **options)
    assert not rec.chosen.candidate.cpu_offload
    assert rec.chosen.candidate.sharding is not Sharding.NO_SHARD  # 70B does not fit unsharded

    code, out, err = cli(
        "estimate", target, "--arg", "size=70b", "--gpus", "8", "--nodes", "8",
        "--gpu-memory", "80GiB", "--seq-len", "4096", "--batch-size", "1", "--json",
    )  # fmt: skip
    assert code == 0, err
    path = tmp_path / "e.json"
    path.write_text(out)
    code, exported, err = cli("export", path, "--format", "json")
    assert code == 0, err
    assert json.loads(exported)["chosen"]["candidate"]["cpu_offload"] is False

    plan = make_plan(
        make_request(target, PlanOptions(**options), kwargs=kwargs)  # type: ignore[arg-type]
    )
    first = trial_order(plan)[0]
    assert first.fits and not first.candidate.cpu_offload
    offloads = [e for e in plan.ranked() if e.fits and e.candidate.cpu_offload]
    fitting = [e for e in plan.ranked() if e.fits]
    assert offloads and fitting.index(offloads[0]) > 0  # offload fits, yet it comes later


def _llama_8b_rec() -> autoshard.Recommendation:
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return autoshard.recommend(model, gpus=8, gpu_memory="80GiB", seq_len=4096)


def test_recommendation_prints_in_a_few_lines_and_renders_as_html() -> None:
    rec = _llama_8b_rec()
    text = str(rec)
    assert len(text.splitlines()) < 40 and rec.chosen.candidate.label() in text
    assert len(repr(rec)) < 200

    class Collect(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.tags: list[str] = []
            self.text: list[str] = []

        def handle_starttag(self, tag: str, attrs: object) -> None:
            self.tags.append(tag)

        def handle_data(self, data: str) -> None:
            self.text.append(data)

    page = Collect()
    page.feed(rec._repr_html_())
    assert "table" in page.tags and rec.chosen.candidate.label() in " ".join(page.text)
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(rec)
    assert rec.chosen.candidate.label() in console.export_text()


def test_warnings_reach_every_door(cli) -> None:
    """A fallback that changes a number is said at every door: here the assumed sequence
    length of a token model given without one."""
    target = f"{EXAMPLES}/gpt.py:build"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autoshard.estimate(target, kwargs={"size": "tiny"}, gpus=2, gpu_memory="8GiB")
    assert any("seq_len" in str(w.message) for w in caught if w.category is PlanWarning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autoshard.recommend(target, kwargs={"size": "tiny"}, gpus=2, gpu_memory="8GiB")
    assert any("seq_len" in str(w.message) for w in caught if w.category is PlanWarning)
    code, _, err = cli(
        "estimate", target, "--arg", "size=tiny", "--gpus", "2", "--gpu-memory", "8GiB"
    )
    assert code == 0 and "warning: seq_len" in err


def test_the_fastest_checkpointing_that_fits_is_chosen() -> None:
    """Between no checkpointing (too big) and checkpointing every block (most recompute): where
    selective fits and every 2nd block does not, the choice is the faster predicted of selective
    and all (on this tiny model selective's Python per kernel may outweigh what it does not
    recompute: the speed model's call), the others named as not fitting; all where only all
    fits."""
    target, kwargs = f"{EXAMPLES}/gpt.py:build", {"size": "tiny", "n_layer": 8, "max_seq_len": 2048}
    common = {"gpus": 2, "seq_len": 2048, "batch_size": 8, "precision": "32-true"}
    estimates = autoshard.estimate(target, kwargs=kwargs, gpu_memory="80GiB", **common)
    peaks = {
        (e.candidate.checkpointing.value, e.candidate.sharding, e.candidate.one_unit): e.gpu_peak
        for e in estimates
        if not e.candidate.cpu_offload
    }
    key = (Sharding.FULL_SHARD, False)
    none, every2, selective, every = (
        peaks[(name, *key)] for name in ("none", "every_k", "selective", "all")
    )
    assert every < selective < every2 < none
    # A GPU between every-2nd and none (for every sharding): selective is the answer.
    memory = int((every2 + (none - every2) // 4) / 0.95)
    rec = autoshard.recommend(target, kwargs=kwargs, gpu_memory=memory, **common)
    chosen = rec.chosen.candidate.checkpointing.value
    assert chosen in ("selective", "all")
    line = next(r for r in rec.reasons if r.startswith("checkpointing"))
    assert "does not fit with" in line and "none (" in line
    if chosen == "all":  # selective fits but was predicted slower
        assert "fits but predicted slower with" in line and "selective" in line
    # A GPU between all and selective: only checkpointing every block fits.
    memory = int((every + (selective - every) // 2) / 0.95)
    rec = autoshard.recommend(target, kwargs=kwargs, gpu_memory=memory, **common)
    assert rec.chosen.candidate.checkpointing.value == "all"


def test_accelerate_yaml_counts_every_process_of_every_node() -> None:
    rec = autoshard.recommend(
        f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny"}, gpus=8, nodes=4,
        gpu_memory="80GiB", seq_len=128,
    )  # fmt: skip
    config = yaml.safe_load(rec.to_yaml("accelerate"))
    # accelerate's num_processes is the total over all machines, not the GPUs of one node.
    assert config["num_machines"] == 4 and config["num_processes"] == 32


@pytest.mark.slow
def test_lightning_module_trains_through_training_step_at_both_doors(cli, tmp_path) -> None:
    """The LightningModule example has no forward: a trial that runs proves the step was its
    training_step, at the command line and in code."""
    pytest.importorskip("lightning")
    target = f"{EXAMPLES}/lightning_module.py:build"
    code, out, err = cli(
        "tune", target, "--arg", "vocab_size=1000", "--gpu-memory", "2GiB", "--trials", "1",
        "--batch-size", "2", "--steps", "1", "--warmup", "1", "--out", tmp_path / "cli",
        # fp32: this model's LayerNorm does not run under CPU bf16 autocast (a CPU limit only)
        "--precision", "32-true",
    )  # fmt: skip
    assert code == 0, err + out
    trials = [json.loads(x) for x in (tmp_path / "cli" / "trials.jsonl").read_text().splitlines()]
    assert [t["status"] for t in trials if TrialStatus(t["status"]).launched] == ["ok"]
    rec = autoshard.tune(
        target, kwargs={"vocab_size": 1000}, gpu_memory="2GiB", trials=1, batch_size=2,
        steps=1, warmup=1, out_dir=tmp_path / "code", precision="32-true",
    )  # fmt: skip
    assert rec.chosen.trial is not None and rec.chosen.trial.status.value == "ok"


class _LongContextLM(torch.nn.Module):
    """A token model whose config promises a long context (a 32k-context Llama's, say)."""

    def __init__(self, context: int | None = 32768) -> None:
        super().__init__()
        self.max_position_embeddings = context
        self.embed = torch.nn.Embedding(256, 32)
        self.head = torch.nn.Linear(32, 256, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_the_default_seq_len_is_the_models_context_capped_at_4096() -> None:
    # planned at 32k tokens a sample, a 32k-context model's activations would rule out nearly
    # every candidate nobody asked for: without seq_len, plans cap the context at 4,096 and say so
    options = PlanOptions(gpus=2, gpu_memory="8GiB", batch_size="1")
    with pytest.warns(PlanWarning, match=r"seq_len 4096: the model's context \(32768\) capped"):
        plan = make_plan(make_request(_LongContextLM(), options))
    assert plan.workload.seq_len == 4096 and plan.activations.seq_len == 4096
    # a shorter context is taken as it is, none at all assumes the cap; a given one is kept
    from autoshard.target.resolve import BuiltModel
    from autoshard.workload import DEFAULT_SEQ_LEN_CAP, resolve_workload

    assert DEFAULT_SEQ_LEN_CAP == 4096
    for context, seq_len, note in ((1024, 1024, "context (1024);"), (None, 4096, "assumed")):
        workload, notes = resolve_workload(BuiltModel(_LongContextLM(context)), PlanOptions())
        assert workload.seq_len == seq_len and note in notes[0]
    workload, notes = resolve_workload(BuiltModel(_LongContextLM()), PlanOptions(seq_len=8192))
    assert workload.seq_len == 8192 and not notes
