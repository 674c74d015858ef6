"""The user's training loop (Lightning's order, a plain loop, gradient accumulation), frozen
parameters and LoRA: the one step function, both estimators, and real trials."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from autoshard.analyze import analyze_model, analyze_target
from autoshard.config import Candidate, Hardware, Precision, WorkloadSpec
from autoshard.engine import gradient_params
from autoshard.loop import optimizer_step
from autoshard.options import TuneOptions
from autoshard.predict.activations import profile_activations
from autoshard.predict.analytic import estimate_memory, needs_simulation, peak_moments
from autoshard.target.resolve import TargetSpec

from .conftest import EXAMPLES

MIB = 2**20
GLOO2 = Hardware(gpus_per_node=2, gpu_memory=80 * 2**30, backend="gloo")


def gpt(**kwargs: object) -> TargetSpec:
    return TargetSpec(spec=f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny", **kwargs})


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore")


# ---------------------------------------------------------------------------------------------
# The step function: the order of the calls
# ---------------------------------------------------------------------------------------------


class Spy(nn.Module):
    """A linear model whose forward records whether gradients are allocated when it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.linear.weight.grad is not None)
        return self.linear(x).sum()


class CallLog(torch.optim.SGD):
    def __init__(self, params: object, log: list[str]) -> None:
        super().__init__(params, lr=0.1)  # type: ignore[arg-type]
        self.log = log

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.log.append("zero_grad")
        super().zero_grad(set_to_none)

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        self.log.append("step")
        super().step()


@pytest.mark.parametrize(
    ("loop", "accumulate", "calls", "grads_in_forward"),
    [
        # Lightning's closure: training_step, zero_grad, backward; step after the last batch
        ("lightning", 1, ["zero_grad", "step"], [False, True, True]),
        ("plain", 1, ["step", "zero_grad"], [False, False, False]),
        # accumulation: zero_grad before the first micro-batch's backward only
        ("lightning", 3, ["zero_grad", "step"], [False, True, True, True, True, True]),
        ("plain", 3, ["step", "zero_grad"], [False, True, True, False, True, True]),
    ],
)
def test_the_step_runs_the_loop_order(loop, accumulate, calls, grads_in_forward) -> None:
    model, log = Spy(), []
    optimizer = CallLog(model.parameters(), log)
    workload = WorkloadSpec(loop=loop, accumulate=accumulate)
    steps = 3 if accumulate == 1 else 2
    for _ in range(steps):
        off = torch.autocast("cpu", enabled=False)
        optimizer_step(model, optimizer, torch.ones(2, 4), workload, autocast=off)
    assert log == calls * steps
    # Lightning keeps the last step's gradients through the next forward; a plain loop does not
    assert model.seen == grads_in_forward


def test_accumulated_gradients_equal_one_large_batch() -> None:
    """Each micro-batch's loss is divided by the number accumulated, as the Trainer does."""
    torch.manual_seed(0)
    base = nn.Linear(4, 1)
    grads = {}
    for n in (1, 4):
        model = nn.Linear(4, 1)
        model.load_state_dict(base.state_dict())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        batch = torch.arange(8.0).reshape(2, 4)
        optimizer_step(
            model,
            optimizer,
            batch,
            WorkloadSpec(loop="lightning", accumulate=n),
            autocast=torch.autocast("cpu", enabled=False),
            loss_fn=lambda out, _batch: out.mean(),
        )
        grads[n] = model.weight.grad.clone()
    torch.testing.assert_close(grads[1], grads[4])


# ---------------------------------------------------------------------------------------------
# Frozen parameters and LoRA in the analyzer and the estimators
# ---------------------------------------------------------------------------------------------


def test_the_analyzer_counts_frozen_parameters_where_they_are() -> None:
    profile, built = analyze_target(gpt(freeze="tok_emb"))
    embedding = built.model.tok_emb.weight.numel()
    assert profile.frozen_params == profile.root_frozen_params == embedding
    assert profile.trainable_params == profile.total_params - embedding
    assert profile.block_frozen_params == profile.frozen_blocks == 0
    stats = {c.name: c for c in profile.classes}
    assert stats["Embedding"].frozen_total == embedding
    assert stats["Block"].frozen_total == 0


def test_fsdp1_gives_a_unit_with_any_trainable_parameter_a_whole_gradient() -> None:
    profile, _ = analyze_target(gpt(freeze="tok_emb"))
    wrap = profile.wrap_policy
    fsdp1 = gradient_params(profile, Candidate(wrap_classes=wrap))
    fsdp2 = gradient_params(profile, Candidate(engine="fsdp2", wrap_classes=wrap))
    assert fsdp1[0] == profile.total_params  # the root's flat gradient covers the embedding
    assert fsdp2[0] == profile.trainable_params
    assert fsdp1[1] - fsdp2[1] == profile.root_frozen_params


@pytest.fixture(scope="module")
def lora() -> tuple:
    pytest.importorskip("peft")
    target = TargetSpec(
        spec=f"{EXAMPLES}/hf_llama_lora.py:build",
        kwargs={"size": "tiny", "hidden_size": 128, "intermediate_size": 256, "batch_size": 1},
    )
    profile, built = analyze_target(target)
    return target, profile, built


def test_the_analyzer_counts_trainable_lora_adapters(lora) -> None:
    _, profile, built = lora
    adapters = [(n, p) for n, p in built.model.named_parameters() if "lora_" in n]
    # rank-8 adapters on q_proj and v_proj of each layer: r x (in + out) each
    cfg = built.model.config
    kv = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    per_layer = 8 * (2 * cfg.hidden_size) + 8 * (cfg.hidden_size + kv)
    assert profile.trainable_params == sum(p.numel() for _, p in adapters)
    assert profile.trainable_params == cfg.num_hidden_layers * per_layer
    assert profile.frozen_params == profile.total_params - profile.trainable_params
    assert profile.root_frozen_params == profile.root_unit_params  # embedding, head: frozen
    assert profile.frozen_blocks == 0  # every decoder layer holds adapters


@pytest.mark.parametrize("engine", ["fsdp1", "fsdp2"])
def test_a_lora_models_optimizer_state_counts_only_the_adapters(lora, engine) -> None:
    from autoshard.predict.simulate import simulate_memory

    target, profile, built = lora
    candidate = Candidate(engine=engine, wrap_classes=profile.wrap_policy, precision="32-true")
    workload = WorkloadSpec(loop="plain")
    acts = profile_activations(built.model, profile, workload, batch=built.batch)
    analytic = estimate_memory(profile, candidate, GLOO2, workload, activations=acts)
    # AdamW: two fp32 states of the adapters, sharded over 2 ranks (FSDP1: a rank may hold up to
    # a unit's whole trainable part, when that is under its shard of the unit)
    adapters = profile.trainable_params
    if engine == "fsdp2":
        assert analytic.breakdown.optimizer == 2 * 4 * adapters // 2
    else:
        assert 2 * 4 * adapters // 2 <= analytic.breakdown.optimizer <= 2 * 4 * adapters
    assert analytic.breakdown.optimizer < 2 * 4 * profile.total_params // 2 // 10
    # the real optimizer on the real (fake-tensor) FSDP model: the simulation's peak holds it
    simulated = simulate_memory(target, candidate, GLOO2, workload)
    steps = 4 * sum(1 for n, _ in built.model.named_parameters() if "lora_" in n)  # AdamW's
    assert 0 < simulated.breakdown.optimizer <= 2 * 4 * adapters + steps
    fewer = simulate_memory(
        TargetSpec(spec=target.spec, kwargs={**target.kwargs, "targets": "q_proj"}),
        candidate,
        GLOO2,
        workload,
    )
    assert 0 < fewer.breakdown.optimizer < simulated.breakdown.optimizer


def test_simulate_on_the_command_line_runs_with_frozen_parameters(cli) -> None:
    """The FSDP1 tracker hooked every parameter and crashed on a frozen one ("cannot register a
    hook on a tensor that doesn't require gradient")."""
    import json

    code, out, err = cli(
        "estimate", f"{EXAMPLES}/gpt.py:build", "--arg", "size=tiny", "--arg", "freeze=tok_emb",
        "--gpus", "2", "--gpu-memory", "8GiB", "--seq-len", "64", "--simulate", "3", "--json",
    )  # fmt: skip
    assert code == 0, err
    simulated = [e for e in json.loads(out)["estimates"] if e["method"] == "simulated"]
    assert any(e["candidate"]["engine"] == "fsdp1" for e in simulated)


# ---------------------------------------------------------------------------------------------
# The analytic moments of the loop
# ---------------------------------------------------------------------------------------------


def test_fsdp1_shard_grad_op_with_frozen_parameters_is_simulated() -> None:
    """FSDP1 SHARD_GRAD_OP with a frozen parameter was refused on fake tensors: use_orig_params
    =False cannot mix frozen and trainable parameters in a flat parameter, and True asserted in
    its write-back check (a fake tensor's storage has no data pointer). It runs as trials do."""
    from autoshard.predict.simulate import simulate_memory

    target = gpt(freeze="tok_emb")
    profile, built = analyze_target(target)
    acts = profile_activations(built.model, profile, WorkloadSpec(seq_len=64), built.batch)
    c = Candidate(wrap_classes=profile.wrap_policy, sharding="SHARD_GRAD_OP", precision="32-true")
    peaks = {}
    for loop in ("plain", "lightning"):
        workload = WorkloadSpec(seq_len=64, loop=loop)
        simulated = simulate_memory(target, c, GLOO2, workload)
        analytic = estimate_memory(profile, c, GLOO2, workload, activations=acts)
        assert analytic.gpu_peak == pytest.approx(simulated.gpu_peak, rel=0.03), loop
        peaks[loop] = simulated.gpu_peak - simulated.breakdown.allowance
    # Lightning's order keeps the last step's flat gradients through the next forward and loss
    assert peaks["lightning"] > peaks["plain"]


# ---------------------------------------------------------------------------------------------
# What cannot be modelled says so
# ---------------------------------------------------------------------------------------------


def test_needs_simulation_names_what_the_analytic_estimate_cannot_model() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[0].requires_grad_(False)
    frozen = analyze_model(model)
    trained = analyze_model(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    assert needs_simulation(trained, Candidate(min_num_params=10), WorkloadSpec()) is None
    assert needs_simulation(frozen, Candidate(), WorkloadSpec()) is None
    size_wrap = needs_simulation(frozen, Candidate(min_num_params=10), WorkloadSpec())
    assert size_wrap and "size-based" in size_wrap
    offload = needs_simulation(trained, Candidate(cpu_offload=True), WorkloadSpec(accumulate=2))
    assert offload and "offload" in offload
    assert needs_simulation(trained, Candidate(cpu_offload=True), WorkloadSpec()) is None
    assert all(
        "\n" not in (needs_simulation(p, c, w) or "")
        for p in (frozen, trained)
        for c in (Candidate(min_num_params=10), Candidate(cpu_offload=True))
        for w in (WorkloadSpec(), WorkloadSpec(accumulate=2))
    )


# ---------------------------------------------------------------------------------------------
# Real trials: 2 gloo processes
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_lightning_order_trial_measures_the_gradients_kept_through_forward(tmp_path) -> None:
    """NO_SHARD keeps the whole fp32 gradient on every rank; with a micro-batch of 2 the peak
    is at the end of forward, where Lightning's order still holds the last step's gradients
    and a plain loop has freed them. The trials measure the difference."""
    from autoshard.results import TrialStatus
    from autoshard.trials.group import WorkerGroup

    target = gpt()
    profile, _ = analyze_target(target)
    c = Candidate(
        wrap_classes=profile.wrap_policy, sharding="NO_SHARD", precision="32-true",
        micro_batch_size=2,
    )  # fmt: skip
    peaks = {}
    # glibc serves large blocks from its heap once its dynamic mmap threshold has grown, and a
    # freed heap block stays resident: the CPU trial's resident-set peak then lags the tensors.
    # A fixed threshold maps every tensor of 64 KiB and more on its own and unmaps it when freed.
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    with WorkerGroup(
        target, TuneOptions(nproc=2, trial_timeout=300), log_dir=tmp_path, env=env
    ) as group:
        for loop in ("plain", "lightning", "plain", "lightning"):
            r = group.run(
                c, WorkloadSpec(seq_len=128, loop=loop), options=TuneOptions(warmup=2, steps=3)
            )
            assert r.status is TrialStatus.OK, r.error
            peaks.setdefault(loop, []).append(r.max_allocated)
    gradients = 4 * profile.total_params  # unsharded fp32 gradients
    difference = min(peaks["lightning"]) - min(peaks["plain"])
    assert difference == pytest.approx(gradients, rel=0.25), (peaks, gradients)


@pytest.mark.slow
def test_a_lora_model_trains_in_a_real_two_process_trial(tmp_path, lora) -> None:
    """peft's LoRA Llama under both engines: only the adapters change, and the loss goes down."""
    from autoshard.results import TrialStatus
    from autoshard.trials.group import WorkerGroup

    target, profile, _ = lora
    with WorkerGroup(target, TuneOptions(nproc=2, trial_timeout=300), log_dir=tmp_path) as group:
        for engine in ("fsdp1", "fsdp2"):
            c = Candidate(engine=engine, wrap_classes=profile.wrap_policy, precision="32-true")
            r = group.run(
                c,
                WorkloadSpec(loop="lightning", accumulate=2),
                options=TuneOptions(warmup=2, steps=3),
            )
            assert r.status is TrialStatus.OK, (engine, r.error)
            assert r.losses[-1] < r.losses[0], (engine, r.losses)


@pytest.mark.parametrize(
    ("engine", "sharding", "loop", "accumulate"),
    [
        # FSDP1's last micro-batch after no_sync: stored gradients above, kept ones below
        ("fsdp1", "NO_SHARD", "plain", 4),
        # a loss computed in the root's forward runs beside FSDP1's low-precision root copy
        ("fsdp1", "NO_SHARD", "lightning", 1),
        # gloo may still hold the root's all-gather output when the last block is prefetched
        ("fsdp2", "FULL_SHARD", "lightning", 1),
        ("fsdp2", "FULL_SHARD", "plain", 4),
    ],
)
def test_analytic_lora_moments_agree_with_the_simulation(
    lora, engine, sharding, loop, accumulate
) -> None:
    from autoshard.predict.simulate import simulate_memory

    target, profile, built = lora
    c = Candidate(
        engine=engine, sharding=sharding, wrap_classes=profile.wrap_policy, precision="bf16-mixed"
    )
    workload = WorkloadSpec(loop=loop, accumulate=accumulate)
    acts = profile_activations(
        built.model, profile, workload, built.batch, precisions=(Precision.BF16_MIXED,)
    )
    analytic = estimate_memory(profile, c, GLOO2, workload, activations=acts)
    simulated = simulate_memory(target, c, GLOO2, workload)
    assert analytic.gpu_peak == pytest.approx(simulated.gpu_peak, rel=0.03)


def test_gloo_may_hold_the_roots_all_gather_at_the_backward_prefetch() -> None:
    """A race in ProcessGroupGloo, planned for in both estimators on gloo only: the root's
    all-gather output beside its copy and the last block's all-gather buffer (the peak of the
    tiny GPT in fp32 at sequence 128, as measured in benchmarks/estimate_accuracy.py)."""
    from autoshard.predict.simulate import simulate_memory

    profile, built = analyze_target(gpt())
    workload = WorkloadSpec(seq_len=128, loop="plain")
    acts = profile_activations(built.model, profile, workload, precisions=(Precision.FP32,))
    c = Candidate(engine="fsdp2", wrap_classes=profile.wrap_policy, precision="32-true")
    nccl = GLOO2.model_copy(update={"backend": "nccl"})
    moments, _ = peak_moments(profile, c, GLOO2, workload, acts)
    start = moments["backward start"]
    held = moments["backward start, last block prefetched"]
    assert held.comm_buffers == start.comm_buffers + profile.block_params * 4
    assert (
        "backward start, last block prefetched"
        not in peak_moments(profile, c, nccl, workload, acts)[0]
    )
    peaks, at = {}, {}
    for hardware in (GLOO2, nccl):
        analytic = estimate_memory(profile, c, hardware, workload, activations=acts)
        simulated = simulate_memory(gpt(), c, hardware, workload)
        assert analytic.gpu_peak == pytest.approx(simulated.gpu_peak, rel=0.01), hardware.backend
        peaks[hardware.backend] = simulated.gpu_peak - simulated.breakdown.allowance
        at[hardware.backend] = analytic.peak_at
    assert at["gloo"] == "backward start, last block prefetched"
    assert peaks["gloo"] == pytest.approx(held.total, rel=0.01)  # the simulation holds it too
    assert peaks["gloo"] > peaks["nccl"]


@pytest.mark.slow
@pytest.mark.parametrize(("loop", "accumulate"), [("plain", 4), ("lightning", 1)])
def test_fsdp1_no_shard_lora_moments_of_the_benchmark_shape(loop, accumulate) -> None:
    """benchmarks/estimate_accuracy.py's LoRA Llama under FSDP1 NO_SHARD bf16-mixed, where the
    analytic estimate was 5.6% (accumulation: the last micro-batch's stored gradients above the
    block, kept ones below) and 5.0% low (the root's low-precision copy beside the loss the
    model computes in its forward)."""
    pytest.importorskip("peft")
    from autoshard.predict.simulate import simulate_memory

    target = TargetSpec(
        spec=f"{EXAMPLES}/hf_llama_lora.py:build",
        kwargs={"size": "tiny", "hidden_size": 256, "intermediate_size": 512,
                "num_hidden_layers": 4, "vocab_size": 2048, "batch_size": 1, "seq_len": 64},
    )  # fmt: skip
    profile, built = analyze_target(target)
    c = Candidate(sharding="NO_SHARD", wrap_classes=profile.wrap_policy, precision="bf16-mixed")
    workload = WorkloadSpec(seq_len=64, loop=loop, accumulate=accumulate)
    acts = profile_activations(
        built.model, profile, workload, built.batch, precisions=(Precision.BF16_MIXED,)
    )
    analytic = estimate_memory(profile, c, GLOO2, workload, activations=acts)
    simulated = simulate_memory(target, c, GLOO2, workload)
    assert analytic.gpu_peak == pytest.approx(simulated.gpu_peak, rel=0.02)


def test_fsdp2_second_block_holds_the_heads_gradient_and_the_reduce_scatter_above() -> None:
    """benchmarks/estimate_accuracy.py's deep GPT, FSDP2 FULL_SHARD fp32 at micro-batch 2, where
    the analytic estimate was 4.0% below the simulation (5.7% below the measured run): the peak
    is the second block's backward, with the head's unsharded gradient waiting in the root
    (reduced only in the root's post-backward, after every block) and the top block's
    reduce-scatter input and reduced shard (FSDP2 holds the input until the next unit's
    post-backward). The top block's own backward holds only the next block's all-gather."""
    from autoshard.predict.simulate import simulate_memory

    target = gpt(n_layer=8, d_model=256, n_head=4, vocab_size=2048)
    profile, built = analyze_target(target)
    workload = WorkloadSpec(seq_len=64, loop="plain")
    acts = profile_activations(built.model, profile, workload, precisions=(Precision.FP32,))
    c = Candidate(
        engine="fsdp2", wrap_classes=profile.wrap_policy, precision="32-true", micro_batch_size=2
    )
    moments, _ = peak_moments(profile, c, GLOO2, workload, acts)
    head_grad = profile.vocab_size * profile.hidden_size * 4
    block = profile.block_params * 4
    second, top = moments["second block backward"], moments["top block backward"]
    assert top.gradients == head_grad
    assert top.comm_buffers == block  # the next block's all-gather buffer only
    assert second.gradients == head_grad + block // 2  # and the top block's shard
    assert second.comm_buffers == 2 * block  # and the top block's reduce-scatter input
    analytic = estimate_memory(profile, c, GLOO2, workload, activations=acts)
    simulated = simulate_memory(target, c, GLOO2, workload)
    assert analytic.peak_at == "second block backward"
    assert analytic.gpu_peak == pytest.approx(simulated.gpu_peak, rel=0.03)
