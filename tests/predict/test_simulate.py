"""The simulated estimate: real FSDP on fake tensors with a fake process group, checked by hand,
against the analytic estimate, across world sizes and against its own depth extrapolation."""

from __future__ import annotations

import pytest
import torch

from autoshard.analyze import analyze_target
from autoshard.config import Candidate, Hardware, Precision, WorkloadSpec
from autoshard.errors import ConfigError
from autoshard.predict import simulate
from autoshard.predict.activations import precisions_of, profile_activations
from autoshard.predict.analytic import estimate_memory
from autoshard.predict.simulate import block_lists, simulate_memory, truncate_blocks
from autoshard.target.resolve import TargetSpec

from ..conftest import EXAMPLES, TARGETS

GIB = 1024**3
STACK = TargetSpec(spec=f"{TARGETS}/stack.py:build", kwargs={"width": 256, "depth": 8})
BLOCK = ("stack.Block",)


def test_simulated_sharded_terms_by_hand() -> None:
    """FSDP2, fp32, fused AdamW, 4 ranks: each rank holds a quarter of the parameters and two
    fp32 optimizer states of that quarter, exactly."""
    params = 8 * 256 * 256
    c = Candidate(engine="fsdp2", wrap_classes=BLOCK, precision="32-true", optimizer_impl="fused")
    e = simulate_memory(STACK, c, Hardware(gpus_per_node=4, gpu_memory=80 * GIB), WorkloadSpec())
    b = e.breakdown
    assert e.method == "simulated"
    assert b.sharded_params == params * 4 // 4
    # two states per parameter, plus AdamW's per-parameter ``step`` scalars
    assert 2 * params * 4 // 4 <= b.optimizer <= 2 * params * 4 // 4 + 8 * 8
    assert e.gpu_peak == b.total and b.allowance > 0


@pytest.mark.parametrize("engine", ["fsdp1", "fsdp2"])
def test_gathered_parameters_are_booked_as_unsharded(engine: str) -> None:
    """SHARD_GRAD_OP keeps the whole model gathered through forward and backward: at the peak
    each rank holds its quarter as shards and (nearly) every parameter gathered in the compute
    dtype (bf16 here), and the breakdown says which is which (FSDP1's generic tracker once booked the
    gathered copy as sharded: "sharded params 15.7 GiB, unsharded 0 B" on a 7B model)."""
    params = 8 * 256 * 256
    hw = Hardware(gpus_per_node=4, gpu_memory=80 * GIB)
    for sharding in ("FULL_SHARD", "SHARD_GRAD_OP"):
        c = Candidate(engine=engine, wrap_classes=BLOCK, sharding=sharding)
        b = simulate_memory(STACK, c, hw, WorkloadSpec()).breakdown
        assert b.sharded_params == params * 4 // 4, (sharding, b)
        gathered = params * 2  # all 8 blocks in bf16
        if sharding == "SHARD_GRAD_OP":  # all gathered (FSDP2 frees each block after backward)
            assert b.unsharded_params >= gathered * 7 // 8, b
        else:  # resharded: a block or two at a time
            assert b.unsharded_params <= gathered * 2 // 8, b


@pytest.mark.parametrize("engine", ["fsdp1", "fsdp2"])
def test_hybrid_shard_is_simulated_on_its_mesh(engine: str) -> None:
    """HYBRID_SHARD on 2 nodes of 2: parameters sharded over the 2 ranks of a node (the mesh's
    shard dimension, sharding.mesh_for), not over all 4."""
    params = 8 * 256 * 256
    hw = Hardware(gpus_per_node=2, nodes=2, gpu_memory=80 * GIB)
    c = Candidate(
        engine=engine, wrap_classes=BLOCK, precision="32-true", sharding="HYBRID_SHARD",
        hybrid_mesh=(2, 2),
    )  # fmt: skip
    b = simulate_memory(STACK, c, hw, WorkloadSpec()).breakdown
    assert b.sharded_params == params * 4 // 2, b


def test_more_ranks_never_raise_the_simulated_peak() -> None:
    c = Candidate(engine="fsdp2", wrap_classes=BLOCK, precision="32-true")
    previous = None
    for world in (1, 2, 4, 8):
        b = simulate_memory(
            STACK, c, Hardware(gpus_per_node=world, gpu_memory=80 * GIB), WorkloadSpec()
        ).breakdown
        terms = (b.sharded_params, b.optimizer, b.total - b.allowance)
        if previous is not None:
            assert all(now <= before for now, before in zip(terms, previous, strict=True))
        previous = terms


@pytest.mark.slow
def test_depth_extrapolation_matches_the_whole_simulation() -> None:
    target = TargetSpec(
        spec=f"{EXAMPLES}/gpt.py:build",
        kwargs={"size": "tiny", "n_layer": 10},
    )
    c = Candidate(engine="fsdp2", wrap_classes=("gpt.Block",), precision="bf16-mixed")
    hw = Hardware(gpus_per_node=4, gpu_memory=80 * GIB)
    w = WorkloadSpec(seq_len=64)
    whole = simulate_memory(target, c, hw, w)  # no block classes: the whole depth simulated
    fast = simulate_memory(target, c, hw, w, block_classes=("gpt.Block",))
    assert "extrapolated" not in whole.reason
    peak = whole.gpu_peak - whole.breakdown.allowance
    assert abs((fast.gpu_peak - fast.breakdown.allowance) - peak) <= 0.02 * peak


ENCODER, DECODER = "transformer.encoder.layers", "transformer.decoder.layers"
SEQ2SEQ = TargetSpec(
    spec=f"{EXAMPLES}/lightning_transformer.py:build", kwargs={"nlayers": 10, "vocab_size": 512}
)


def test_every_stack_of_an_encoder_decoder_is_a_block_list() -> None:
    profile, built = analyze_target(SEQ2SEQ)
    assert block_lists(built.model, profile.block_classes) == {ENCODER: 10, DECODER: 10}
    truncate_blocks(built.model, {ENCODER: 4, DECODER: 5})
    assert block_lists(built.model, profile.block_classes) == {ENCODER: 4, DECODER: 5}
    # a Sequential of blocks (the model itself, here) stays a Sequential
    from torch import nn

    with torch.device("meta"):
        layers = nn.Sequential(*[nn.TransformerEncoderLayer(8, 2, 16) for _ in range(6)])
    classes = ("torch.nn.modules.transformer.TransformerEncoderLayer",)
    assert block_lists(layers, classes) == {}  # the model itself: not replaceable in place
    holder = nn.Module()
    holder.stack = layers
    assert block_lists(holder, classes) == {"stack": 6}
    truncate_blocks(holder, {"stack": 2})
    assert type(holder.stack) is nn.Sequential and len(holder.stack) == 2


def test_each_deep_stack_is_simulated_one_block_deeper_and_extrapolated(monkeypatch) -> None:
    """Every deep stack at EXTRAPOLATE_FROM blocks, then each alone one deeper; each phase
    extended along every stack's line (here peaks that are affine by construction)."""
    ran: list[tuple[int, int]] = []

    def affine(target, depths, *args, **kwargs):
        enc, dec = depths[ENCODER], depths[DECODER]
        ran.append((enc, dec))
        loop = {"Activation": 100 * enc + 30 * dec, "Temp": 1000}
        step = {"OptState": 7 * enc + 11 * dec + 1500}
        return {
            simulate.LOOP_PHASE: {**loop, "Total": sum(loop.values())},
            simulate.STEP_PHASE: {**step, "Total": sum(step.values())},
        }

    monkeypatch.setattr(simulate, "_simulate_once", affine)
    profile, _ = analyze_target(SEQ2SEQ)
    c = Candidate(engine="fsdp2", wrap_classes=profile.wrap_policy)
    hw = Hardware(gpus_per_node=2, gpu_memory=GIB)
    est = simulate_memory(SEQ2SEQ, c, hw, WorkloadSpec(), block_classes=profile.block_classes)
    assert ran == [(4, 4), (5, 4), (4, 5)]
    assert est.gpu_peak - est.breakdown.allowance == 1000 + 100 * 10 + 30 * 10
    assert est.breakdown.activations == 1300


def test_a_shallow_model_peaking_elsewhere_is_simulated_deeper(monkeypatch) -> None:
    """At 4 blocks per stack the peak is a moment that grows slowly (a large root unit's
    gradients, "Temp"); from 5 on, another (activations): the line through 4 and 5 would be
    too flat (2,320 against 3,200 here). The moments differ (a kind falls as a block is added),
    so every stack is simulated again from 5 blocks."""
    ran: list[tuple[int, int]] = []

    def two_moments(target, depths, *args, **kwargs):
        enc, dec = depths[ENCODER], depths[DECODER]
        ran.append((enc, dec))
        early = {"Temp": 2000 + 10 * (enc + dec)}
        late = {"Activation": 1200 + 100 * (enc + dec)}
        kinds = max(early, late, key=lambda k: sum(k.values()))
        return {simulate.LOOP_PHASE: {**kinds, "Total": sum(kinds.values())}}

    monkeypatch.setattr(simulate, "_simulate_once", two_moments)
    profile, _ = analyze_target(SEQ2SEQ)
    c = Candidate(engine="fsdp2", wrap_classes=profile.wrap_policy)
    hw = Hardware(gpus_per_node=2, gpu_memory=GIB)
    est = simulate_memory(SEQ2SEQ, c, hw, WorkloadSpec(), block_classes=profile.block_classes)
    assert ran == [(4, 4), (5, 4), (4, 5), (5, 5), (6, 5), (5, 6)]
    assert est.gpu_peak - est.breakdown.allowance == 1200 + 100 * 20


def test_deepening_stops_after_a_bounded_number_of_tries(monkeypatch) -> None:
    """A model whose peak never settles costs at most DEEPEN_AT_MOST more rounds, not one per
    block of its depth."""
    ran: list[tuple[int, int]] = []

    def unsettled(target, depths, *args, **kwargs):
        ran.append((depths[ENCODER], depths[DECODER]))
        kind = "Temp" if len(ran) % 2 else "Activation"  # a kind that vanishes every other run
        return {simulate.LOOP_PHASE: {kind: 1000, "Total": 1000}}

    monkeypatch.setattr(simulate, "_simulate_once", unsettled)
    profile, _ = analyze_target(SEQ2SEQ)
    c = Candidate(engine="fsdp2", wrap_classes=profile.wrap_policy)
    hw = Hardware(gpus_per_node=2, gpu_memory=GIB)
    simulate_memory(SEQ2SEQ, c, hw, WorkloadSpec(), block_classes=profile.block_classes)
    assert len(ran) == 3 * (1 + simulate.DEEPEN_AT_MOST)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind",
    [
        dict(engine="fsdp1"),
        dict(engine="fsdp2", precision="bf16-mixed", checkpointing="all", micro_batch_size=2),
    ],
    ids=["fsdp1", "fsdp2-bf16-ckpt"],
)
def test_encoder_decoder_extrapolation_matches_the_whole_simulation(kind) -> None:
    """Two stacks of two block classes (nn.Transformer's 10 encoder and 10 decoder layers),
    each extrapolated from 5 and 6 blocks: within 1% of simulating all 20."""
    profile, _ = analyze_target(SEQ2SEQ)
    c = Candidate(
        wrap_classes=profile.wrap_policy, checkpoint_classes=profile.checkpoint_policy, **kind
    )
    hw = Hardware(gpus_per_node=2, gpu_memory=80 * GIB)
    w = WorkloadSpec(seq_len=32)
    classes = profile.block_classes
    whole = simulate_memory(SEQ2SEQ, c, hw, w)  # no block classes: the whole depth simulated
    fast = simulate_memory(SEQ2SEQ, c, hw, w, block_classes=classes)
    peak = whole.gpu_peak - whole.breakdown.allowance
    assert abs((fast.gpu_peak - fast.breakdown.allowance) - peak) <= 0.01 * peak


# Every engine, the three shardings, checkpointing on and off, both precisions; two
# micro-batches under FULL_SHARD (the micro-batch scales activations alike under every sharding).
GRID = [
    dict(engine=engine, sharding=sharding, checkpointing=ckpt, precision=precision, mbs=mbs)
    for engine in ("fsdp1", "fsdp2")
    for sharding in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    for ckpt in ("none", "all")
    for precision in ("32-true", "bf16-mixed")
    for mbs in ((1, 2) if sharding == "FULL_SHARD" else (1,))
]


@pytest.fixture(scope="module")
def gpt_tiny():
    target = TargetSpec(spec=f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny"})
    profile, built = analyze_target(target)
    workload = WorkloadSpec(seq_len=128)
    acts = profile_activations(built.model, profile, workload, precisions=tuple(Precision))
    return target, profile, workload, acts


@pytest.mark.slow
@pytest.mark.parametrize("point", GRID, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_analytic_agrees_with_simulated_on_the_example(gpt_tiny, point) -> None:
    """The issue's target: the analytic estimate within 10% of the simulated peak (both without
    the GPU allowance, which is the same stated number in both)."""
    target, profile, workload, acts = gpt_tiny
    c = Candidate(
        engine=point["engine"],
        sharding=point["sharding"],
        wrap_classes=profile.wrap_policy,
        checkpoint_classes=profile.checkpoint_policy,
        checkpointing=point["checkpointing"],
        precision=point["precision"],
        micro_batch_size=point["mbs"],
    )
    assert_analytic_within_10_percent_of_simulated(
        target, profile, c, Hardware(gpus_per_node=2, gpu_memory=80 * GIB), workload, acts
    )


@pytest.mark.slow
def test_one_gpu_fsdp1_runs_every_sharding_as_no_shard(gpt_tiny) -> None:
    """FullyShardedDataParallel on a world of one switches to NO_SHARD (the simulation runs that
    code); the analytic estimate must do the same, not plan SHARD_GRAD_OP's gathered copies."""
    target, profile, workload, acts = gpt_tiny
    one = Hardware(gpus_per_node=1, gpu_memory=80 * GIB)
    peaks = {}
    for sharding in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        c = Candidate(sharding=sharding, wrap_classes=profile.wrap_policy, precision="32-true")
        peaks[sharding] = estimate_memory(profile, c, one, workload, activations=acts).gpu_peak
        if sharding == "SHARD_GRAD_OP":
            sim = simulate_memory(target, c, one, workload, block_classes=profile.block_classes)
            assert abs(peaks[sharding] - sim.gpu_peak) <= 0.01 * sim.gpu_peak
    assert len(set(peaks.values())) == 1, peaks


def assert_analytic_within_10_percent_of_simulated(target, profile, c, hw, workload, acts) -> None:
    """Both without the GPU allowance, which is the same stated number in both."""
    sim = simulate_memory(target, c, hw, workload, block_classes=profile.block_classes)
    ana = estimate_memory(profile, c, hw, workload, activations=acts)
    measured = sim.gpu_peak - sim.breakdown.allowance
    predicted = ana.gpu_peak - ana.breakdown.allowance
    assert abs(predicted - measured) <= 0.10 * measured, (c.label(), predicted, measured)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("checkpointing", ["none", "all"])
def test_analytic_agrees_with_simulated_on_a_7b_shape(engine, checkpointing) -> None:
    """Llama-7B layers (RMSNorm upcasts, SwiGLU) at sequence 4096 in bf16 on 8 GPUs, where the
    activations dominate and a fp32 profile halved was 9-11% low."""
    target = TargetSpec(spec=f"{EXAMPLES}/gpt.py:build", kwargs={"size": "7b", "n_layer": 8})
    profile, built = analyze_target(target)
    workload = WorkloadSpec(seq_len=4096)
    c = Candidate(
        engine=engine,
        wrap_classes=profile.wrap_policy,
        checkpoint_classes=profile.checkpoint_policy,
        checkpointing=checkpointing,
        precision="bf16-mixed",
    )
    acts = profile_activations(built.model, profile, workload, precisions=precisions_of([c]))
    assert_analytic_within_10_percent_of_simulated(
        target, profile, c, Hardware(gpus_per_node=8, gpu_memory=80 * GIB), workload, acts
    )


def test_offload_and_an_existing_process_group_are_refused(tmp_path) -> None:
    import torch.distributed as dist

    hw = Hardware(gpus_per_node=2, gpu_memory=80 * GIB)
    offload = Candidate(engine="fsdp2", wrap_classes=BLOCK, cpu_offload=True)
    with pytest.raises(ConfigError, match="offload"):
        simulate_memory(STACK, offload, hw, WorkloadSpec())
    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}"
    )
    try:
        with pytest.raises(ConfigError, match="process group"):
            simulate_memory(
                STACK, Candidate(engine="fsdp2", wrap_classes=BLOCK), hw, WorkloadSpec()
            )
    finally:
        dist.destroy_process_group()


def test_estimate_in_code_and_on_the_command_line_with_simulation(cli, tmp_path) -> None:
    import json

    import yaml

    import autoshard

    target = f"{EXAMPLES}/gpt.py:build"
    estimates = autoshard.estimate(
        target,
        kwargs={"size": "tiny"},
        gpus=2,
        gpu_memory="8GiB",
        seq_len=64,
        simulate=1,
        sort="speed",
    )
    analytic = autoshard.estimate(
        target, kwargs={"size": "tiny"}, gpus=2, gpu_memory="8GiB", seq_len=64, sort="speed"
    )
    # the best analytic candidate is simulated; its simulated peak may move it within a
    # predicted speed tie (ties go to headroom), the rest keep their analytic estimates
    assert sorted(e.candidate.label() for e in estimates) == sorted(
        e.candidate.label() for e in analytic
    )
    simulated = [e for e in estimates if e.method == "simulated"]
    assert len(simulated) == 1 and simulated[0].fits
    sim, ana = simulated[0], analytic[0]
    assert sim.candidate == ana.candidate
    assert abs(sim.gpu_peak - ana.gpu_peak) <= 0.10 * (ana.gpu_peak - ana.breakdown.allowance)

    code, out, err = cli(
        "estimate", target, "--arg", "size=tiny", "--gpus", "2", "--gpu-memory", "8GiB",
        "--seq-len", "64", "--simulate", "1", "--json",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    assert data["profile"]["block_classes"] == ["gpt.Block"]
    assert [e["method"] for e in data["estimates"]].count("simulated") == 1
    path = tmp_path / "estimate.json"
    path.write_text(out)
    code, out, err = cli("export", path, "--format", "lightning")
    assert code == 0, err
    strategy = yaml.safe_load(out)["trainer"]["strategy"]
    chosen = data["recommendation"]["chosen"]["candidate"]  # export writes the decision
    assert strategy["init_args"].get("auto_wrap_policy", []) == chosen["wrap_classes"]

    code, _, err = cli("estimate", target, "--arg", "size=tiny", "--simulate", "-1")
    assert code == 1 and "--simulate -1" in err


def test_an_optimizer_whose_step_reads_values_keeps_its_analytic_estimate(monkeypatch) -> None:
    # Adafactor's step calls .item() on every tensor, which fake tensors cannot answer
    adafactor = Candidate(wrap_classes=BLOCK, optimizer="adafactor")
    hardware = Hardware(gpus_per_node=2, gpu_memory=80 * GIB)
    with pytest.raises(ConfigError, match="adafactor's step cannot be simulated"):
        simulate_memory(STACK, adafactor, hardware, WorkloadSpec())
    profile, built = analyze_target(STACK)
    acts = profile_activations(built.model, profile, WorkloadSpec())
    analytic = estimate_memory(profile, adafactor, hardware, WorkloadSpec(), activations=acts)
    ran: list[Candidate] = []
    monkeypatch.setattr(simulate, "simulate_memory", lambda _t, c, *a, **k: ran.append(c))
    kept = simulate.refine_with_simulation(STACK, [analytic], hardware, WorkloadSpec())
    assert kept == [analytic] and ran == []


@pytest.mark.slow
def test_compiled_candidates_simulate_what_compile_saves_where_activations_hold_the_peak() -> None:
    """The simulation runs eager FSDP code on fake tensors (inductor's kernels cannot run on
    them): a compiled candidate was simulated at its eager peak, 28% above the analytic
    estimate on the README's 7B (74.4 against 58.1 GiB), and --simulate changed the answer.
    It now takes off what compile does not save (the analytic's own model of AOTAutograd's
    partitioner): on a shape where activations hold the peak, both agree within 5%, and the
    plan's simulated estimate is the compiled one, not the eager one."""
    import warnings

    from autoshard.options import PlanOptions
    from autoshard.plan import make_plan, make_request
    from autoshard.predict.analytic import compile_saving

    target = TargetSpec(
        spec=f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny", "n_layer": 8, "vocab_size": 512}
    )
    workload = WorkloadSpec(seq_len=256)
    hw = Hardware(gpus_per_node=2, gpu_memory=80 * GIB)
    # as `estimate --simulate 1 --compile` runs it: the first candidate simulated
    options = PlanOptions(gpus=2, gpu_memory="80GiB", seq_len=256, batch_size="8",
                          compile=True, precision="bf16-mixed", simulate=1)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(make_request(target.spec, options, kwargs=target.kwargs))
    sim = next(e for e in plan.estimates if e.method == "simulated")
    profile, compiled = plan.profile, sim.candidate
    eager = compiled.model_copy(update={"compile": False})
    acts = plan.activations
    analytic = estimate_memory(profile, compiled, hw, workload, activations=acts)
    b = analytic.breakdown
    assert compiled.compile and compiled.checkpointing.value == "none"
    assert b.activations > max(b.sharded_params, b.gradients, b.optimizer, b.temporaries)
    saving = compile_saving(profile, compiled, hw, workload, activations=acts)
    assert saving > 0.1 * (analytic.gpu_peak - b.allowance)
    assert compile_saving(profile, eager, hw, workload, activations=acts) == 0
    assert abs(analytic.gpu_peak - sim.gpu_peak) <= 0.05 * analytic.gpu_peak
    # the eager simulation less the saving: the same FSDP code, what compile keeps
    sim_eager = simulate_memory(target, eager, hw, workload, block_classes=profile.block_classes)
    assert sim.gpu_peak - sim.breakdown.allowance == (
        sim_eager.gpu_peak - sim_eager.breakdown.allowance - saving
    )
