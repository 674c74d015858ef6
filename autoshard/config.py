"""Every choice autoshard makes or is told, in one place: the enums of the search space, a
:class:`Candidate` (one FSDP configuration), the :class:`Hardware` to plan for and the
:class:`WorkloadSpec` of one training step. Immutable pydantic models, validated here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Frozen(BaseModel):
    # NaN and infinity (a diverged trial's losses) written as the strings "NaN", "Infinity":
    # JSON has no such numbers, and pydantic's default writes null, which reads back as no
    # number at all.
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="strings")


# --------------------------------------------------------------------------------------------
# The search space
# --------------------------------------------------------------------------------------------


class Engine(str, Enum):
    """Which FSDP implementation runs the model."""

    FSDP1 = "fsdp1"  # FullyShardedDataParallel, what Lightning's FSDPStrategy runs
    FSDP2 = "fsdp2"  # fully_shard, Lightning's ModelParallelStrategy, torchtitan


class Sharding(str, Enum):
    """FSDP sharding strategy, by the names of ``torch.distributed.fsdp.ShardingStrategy``; what
    each one does is its row of :data:`SHARDING_TRAITS`."""

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"


class ShardGroup(str, Enum):
    """Over which ranks a sharding strategy shards each parameter, and so its device mesh."""

    WORLD = "world"  # all ranks: a 1-D mesh (FSDP1: the default process group)
    HYBRID = "hybrid"  # within each shard group of the candidate's (replicate, shard) mesh
    NONE = "none"  # no rank: every rank holds the whole parameter (FSDP2: a (world, 1) mesh)


@dataclass(frozen=True)
class ShardingTraits:
    """Everything autoshard knows about one sharding strategy, in one row of
    :data:`SHARDING_TRAITS`: the estimators, the space, the trials' set-up and every emitter
    read it, so a new strategy is a new enum member and its row.

    >>> SHARDING_TRAITS[Sharding.SHARD_GRAD_OP].keeps_gathered
    True
    >>> SHARDING_TRAITS[Sharding.FULL_SHARD].hf_trainer_name
    'full_shard'
    """

    group: ShardGroup
    # Units are freed after forward and all-gathered from the shard group again in backward.
    # NO_SHARD has no shard group to gather from, so False; under FSDP2 its units still get a
    # local unsharded copy, which fully_shard frees after forward as the reshard policy says
    # (engine.reshard_after_forward: only a sharding that keeps_gathered pins it False).
    reshards: bool
    fsdp1_name: str  # torch's ShardingStrategy member; Lightning's FSDPStrategy takes it too
    # accelerate's fsdp_sharding_strategy (FSDP1); the HF Trainer takes it in lower case
    accelerate_name: str
    min_ranks: int = 1  # the space proposes it from this many ranks
    min_nodes: int = 1  # ... and this many nodes
    offloads: bool = False  # ... and with CPU offload (the last resort: once is enough)

    @property
    def shards_params(self) -> bool:
        """Parameters are sharded over a group (else replicated whole)."""
        return self.group is not ShardGroup.NONE

    @property
    def replicates(self) -> bool:
        """A replicate dimension: reduced gradients are all-reduced across it (a 2-D mesh)."""
        return self.group is not ShardGroup.WORLD

    @property
    def keeps_gathered(self) -> bool:
        """Sharded, but every unit stays gathered from forward into backward (ZeRO-2)."""
        return self.shards_params and not self.reshards

    @property
    def needs_mesh(self) -> bool:
        """A candidate with it carries ``hybrid_mesh=(replicate, shard)``."""
        return self.group is ShardGroup.HYBRID

    @property
    def hf_trainer_name(self) -> str:
        """The HF Trainer's ``fsdp_config["reshard_after_forward"]`` under FSDP1 (transformers
        hands it to accelerate's plugin, which upper-cases it)."""
        return self.accelerate_name.lower()

    def proposed_for(self, hardware: Hardware) -> bool:
        """Whether the space proposes it for ``hardware``."""
        return hardware.world_size >= self.min_ranks and hardware.nodes >= self.min_nodes

    def proposed_mesh(self, hardware: Hardware) -> tuple[int, int] | None:
        """The (replicate, shard) mesh the space proposes it with: a hybrid strategy shards
        within each node and replicates across nodes."""
        return (hardware.nodes, hardware.gpus_per_node) if self.needs_mesh else None


SHARDING_TRAITS: dict[Sharding, ShardingTraits] = {
    Sharding.FULL_SHARD: ShardingTraits(
        ShardGroup.WORLD,
        reshards=True,
        fsdp1_name="FULL_SHARD",
        accelerate_name="FULL_SHARD",
        offloads=True,
    ),
    Sharding.SHARD_GRAD_OP: ShardingTraits(
        ShardGroup.WORLD,
        reshards=False,
        fsdp1_name="SHARD_GRAD_OP",
        accelerate_name="SHARD_GRAD_OP",
    ),
    Sharding.NO_SHARD: ShardingTraits(
        ShardGroup.NONE,
        reshards=False,
        fsdp1_name="NO_SHARD",
        accelerate_name="NO_SHARD",
        min_ranks=2,
    ),
    Sharding.HYBRID_SHARD: ShardingTraits(
        ShardGroup.HYBRID,
        reshards=True,
        fsdp1_name="HYBRID_SHARD",
        accelerate_name="HYBRID_SHARD",
        min_nodes=2,
    ),
}


class Precision(str, Enum):
    """Lightning's precision names (the Trainer's ``precision=`` argument)."""

    FP32 = "32-true"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "16-mixed"
    BF16_TRUE = "bf16-true"

    @property
    def mixed(self) -> bool:
        """Whether parameters are stored in fp32 and cast to a 16-bit dtype to compute."""
        return self in (Precision.BF16_MIXED, Precision.FP16_MIXED)


class Checkpointing(str, Enum):
    """Which wrapped blocks recompute their activations in backward."""

    NONE = "none"
    ALL = "all"  # every block of the checkpoint classes
    EVERY_K = "every_k"  # every k-th block (``Candidate.checkpoint_every``)
    # every block, op by op: its matrix products (every other one) and attention are saved,
    # the rest recomputed (torchtitan's "selective" "op" policy; autoshard.sharding)
    SELECTIVE = "selective"


class Optimizer(str, Enum):
    """The optimizer the training step runs; what it keeps, moves and is called is its row of
    :data:`OPTIMIZER_TRAITS`."""

    ADAMW = "adamw"
    ADAM = "adam"
    SGD = "sgd"
    ADAFACTOR = "adafactor"


class OptimizerImpl(str, Enum):
    """torch optimizer implementation: one kernel per operation over all tensors at once
    (foreach: a transient copy of the shard), one fused kernel, or a loop over the tensors."""

    FOREACH = "foreach"
    FUSED = "fused"
    FOR_LOOP = "for_loop"


@dataclass(frozen=True)
class OptimizerTraits:
    """Everything autoshard knows about one optimizer, in one row of :data:`OPTIMIZER_TRAITS`:
    the memory estimators read its states, the step-time model its passes over memory, the
    trials and ``rec.apply``'s users its class and arguments, the emitters what each stack calls
    it; so a new optimizer is a new enum member and its row.

    >>> OPTIMIZER_TRAITS[Optimizer.ADAMW].states, OPTIMIZER_TRAITS[Optimizer.SGD].states
    (2, 1)
    >>> OPTIMIZER_TRAITS[Optimizer.ADAFACTOR].impls
    (<OptimizerImpl.FOREACH: 'foreach'>, <OptimizerImpl.FOR_LOOP: 'for_loop'>)
    """

    class_path: str  # what the trials build, and what a LightningCLI ``optimizer:`` names
    # state tensors the size of each parameter it keeps (AdamW: exp_avg, exp_avg_sq; SGD with
    # momentum: its buffer); a factoring optimizer keeps one per tensor it does not factor
    states: int
    # passes over tensors of the parameter's dtype per element of one step: (one fused kernel,
    # a kernel per operation); optimizer_step.optimizer_bytes_per_param turns them into bytes
    passes: tuple[int, int]
    # the arguments the trials pass besides the parameters, lr and the implementation
    options: dict[str, object] = dataclasses.field(default_factory=dict)
    impls: tuple[OptimizerImpl, ...] = tuple(OptimizerImpl)  # the implementations it has
    # transient copies of the trainable shard one foreach step holds at once (AdamW: of a state)
    foreach_copies: int = 1
    state_bytes: int | None = None  # bytes of one state element (None: the parameter's dtype)
    # a tensor of two or more dimensions keeps its second moment as a row and a column vector
    # (Adafactor), a 1-D one whole; FSDP1's sharded flat parameters reach it as 1-D views
    factors_matrices: bool = False
    engines: tuple[Engine, ...] = tuple(Engine)  # the FSDP engines whose parameters it steps
    # its step runs on fake tensors (the simulation, autoshard.predict.simulate); one that reads
    # values (Adafactor's .item() per tensor) gets the analytic estimate only
    fake_steps: bool = True
    # TrainingArguments(optim=...) of each implementation the Hugging Face Trainer builds
    hf_trainer_names: dict[OptimizerImpl, str] = dataclasses.field(default_factory=dict)
    torchtitan_name: str | None = None  # [optimizer] name (None: torchtitan builds no such)

    def step_bytes_per_param(self, impl: OptimizerImpl, param_bytes: int) -> int:
        """Bytes of memory traffic per parameter of one step under ``impl``."""
        return param_bytes * self.passes[0 if impl is OptimizerImpl.FUSED else 1]

    def arguments(self, impl: OptimizerImpl) -> dict[str, object]:
        """Its arguments besides the parameters and lr under ``impl``."""
        chosen = {
            OptimizerImpl.FOREACH: {"foreach": True},
            OptimizerImpl.FUSED: {"fused": True},
            OptimizerImpl.FOR_LOOP: {"foreach": False},
        }[impl]
        return {**self.options, **chosen}


# Passes (torch/optim/adam.py, sgd.py, _adafactor.py): a fused AdamW reads the parameter, its
# gradient and two states and writes three (7); foreach and for-loop AdamW run one kernel per
# operation (weight decay, lerp, mul, addcmul, sqrt, div, add, addcdiv: 20; measured on one CPU
# thread: benchmarks/results/optimizer_memory_cpu.md). SGD with momentum: 5 fused, 8 separate.
# Adafactor (no fused kernel): two gradient norms, the row x column estimate written, divided,
# clamped and rsqrt'ed, times the gradient, its norm, scaled and added, and the parameter's norm
# (19, a 1-D tensor's 22 counted as a matrix's).
OPTIMIZER_TRAITS: dict[Optimizer, OptimizerTraits] = {
    Optimizer.ADAMW: OptimizerTraits(
        "torch.optim.AdamW", states=2, passes=(7, 20), torchtitan_name="AdamW",
        # the Trainer's "adamw_torch" passes no foreach: torch's default on CUDA, foreach
        hf_trainer_names={OptimizerImpl.FOREACH: "adamw_torch",
                          OptimizerImpl.FUSED: "adamw_torch_fused"},
    ),
    Optimizer.ADAM: OptimizerTraits(
        "torch.optim.Adam", states=2, passes=(7, 20), torchtitan_name="Adam"
    ),
    Optimizer.SGD: OptimizerTraits(
        "torch.optim.SGD", states=1, passes=(5, 8), options={"momentum": 0.9},
        foreach_copies=0, hf_trainer_names={OptimizerImpl.FOREACH: "sgd"},
    ),
    Optimizer.ADAFACTOR: OptimizerTraits(
        "torch.optim.Adafactor", states=1, passes=(19, 19),
        impls=(OptimizerImpl.FOREACH, OptimizerImpl.FOR_LOOP), factors_matrices=True,
        fake_steps=False,
        # torch 2.13's Adafactor takes a norm over the sharded dimension of FSDP2's DTensor
        # gradients and squares it in place, which DTensor refuses (a partial placement)
        engines=(Engine.FSDP1,),
    ),
}  # fmt: skip


class Reshard(str, Enum):
    """Which FSDP2 units free their gathered parameters after forward (``reshard_after_forward``).

    FSDP1 has no such per-unit choice: its sharding strategy decides (FULL_SHARD reshards,
    SHARD_GRAD_OP keeps everything), so FSDP1 candidates keep ``ALL``."""

    ALL = "all"  # every unit reshards after forward (reshard_after_forward=True everywhere)
    KEEP_ROOT = "keep_root"  # fully_shard's default (None): the root stays gathered
    KEEP_ROOT_AND_LAST = "keep_root_and_last"  # torchtitan: the root and the last block stay


class Loop(str, Enum):
    """The order of one training step in the user's loop, which decides what memory is alive
    together."""

    # Lightning's Trainer (automatic optimization): training_step, then zero_grad, then backward
    # (lightning/pytorch/loops/optimization/automatic.py): the previous step's gradients are
    # still allocated during the next forward.
    LIGHTNING = "lightning"
    # A plain loop: forward, backward, step, zero_grad(set_to_none=True).
    PLAIN = "plain"


class BackwardPrefetch(str, Enum):
    BACKWARD_PRE = "BACKWARD_PRE"
    BACKWARD_POST = "BACKWARD_POST"
    NONE = "NONE"


class Candidate(Frozen):
    """One FSDP configuration: a point of the search space.

    >>> from autoshard import Candidate
    >>> candidate = Candidate(
    ...     wrap_classes=("gpt.Block",), sharding="SHARD_GRAD_OP", precision="bf16-mixed",
    ...     checkpointing="every_k", checkpoint_every=2, checkpoint_classes=("gpt.Block",),
    ...     micro_batch_size=4)
    >>> candidate.label()
    'fsdp1 SHARD_GRAD_OP bf16-mixed ckpt/2 mbs4'
    """

    engine: Engine = Field(Engine.FSDP1, description="FSDP implementation that runs it.")
    wrap_classes: tuple[str, ...] = Field(
        (),
        description="Fully qualified class paths wrapped as FSDP units (empty: whole model).",
    )
    min_num_params: int | None = Field(
        None, description="Size-based wrapping threshold, used when wrap_classes is empty."
    )
    checkpointing: Checkpointing = Field(Checkpointing.NONE, description="Which blocks recompute.")
    checkpoint_every: int = Field(
        1, ge=1, description="With checkpointing=every_k: checkpoint one block in k."
    )
    checkpoint_classes: tuple[str, ...] = Field(
        (), description="Class paths eligible for activation checkpointing (usually the blocks)."
    )
    sharding: Sharding = Field(Sharding.FULL_SHARD, description="Sharding strategy.")
    hybrid_mesh: tuple[int, int] | None = Field(
        None,
        description="(replicate, shard) device-mesh shape for HYBRID_SHARD; None otherwise.",
    )
    cpu_offload: bool = Field(False, description="Offload parameters (and grads) to host memory.")
    precision: Precision = Field(Precision.BF16_MIXED, description="Lightning precision name.")
    reduce_dtype_fp32: bool = Field(
        True,
        description="Reduce gradients in fp32 under mixed precision: FSDP2's MixedPrecisionPolicy "
        "(torchtitan's default). Always False for FSDP1, which reduces in the compute dtype as "
        "Lightning's FSDPStrategy maps its precision (every output reads it from here).",
    )
    limit_all_gathers: bool = Field(True, description="FSDP1 rate limiter on all-gathers.")
    forward_prefetch: bool = Field(False, description="Prefetch the next unit in forward.")
    backward_prefetch: BackwardPrefetch = Field(
        BackwardPrefetch.BACKWARD_PRE, description="FSDP1 backward prefetch policy."
    )
    optimizer: Optimizer = Field(Optimizer.ADAMW, description="Optimizer whose state is held.")
    optimizer_impl: OptimizerImpl = Field(
        OptimizerImpl.FOREACH, description="foreach / fused / for-loop implementation."
    )
    micro_batch_size: int = Field(1, ge=1, description="Samples per rank per step.")
    reshard: Reshard = Field(
        Reshard.ALL, description="FSDP2: which units reshard after forward (FSDP1: always ALL)."
    )
    compile: bool = Field(
        False,
        description="torch.compile each FSDP unit's block (FSDP2, as torchtitan) or the wrapped "
        "model (FSDP1, as Lightning and accelerate).",
    )
    float8: bool = Field(
        False,
        description="float8 matmuls and all-gathers (torchao Float8Linear, FSDP2 only, bf16 "
        "compute, GPUs with fp8 tensor cores).",
    )

    @model_validator(mode="before")
    @classmethod
    def _fsdp1_reduces_in_the_compute_dtype(cls, data: Any) -> Any:
        """FSDP1 reduces in the compute dtype (Lightning's mapping, which trials and hand-over
        apply): a candidate says so, records written before it said so included."""
        if isinstance(data, dict):
            try:
                fsdp1 = Engine(data.get("engine", Engine.FSDP1)) is Engine.FSDP1
            except ValueError:
                return data  # the field's own validation says what is wrong
            if fsdp1:
                return {**data, "reduce_dtype_fp32": False}
        return data

    @model_validator(mode="after")
    def _check(self) -> Candidate:
        needs_mesh = SHARDING_TRAITS[self.sharding].needs_mesh
        if needs_mesh and self.hybrid_mesh is None:
            raise ValueError(f"{self.sharding.value} needs hybrid_mesh=(replicate, shard)")
        if not needs_mesh and self.hybrid_mesh is not None:
            meshed = " or ".join(s.value for s, t in SHARDING_TRAITS.items() if t.needs_mesh)
            raise ValueError(f"hybrid_mesh is only meaningful with {meshed}")
        if self.checkpointing is not Checkpointing.NONE and not self.checkpoint_classes:
            raise ValueError("activation checkpointing needs checkpoint_classes")
        if self.reshard is not Reshard.ALL and self.engine is not Engine.FSDP2:
            raise ValueError(f"reshard={self.reshard.value} needs engine fsdp2 (FSDP1: all)")
        if self.float8 and self.engine is not Engine.FSDP2:
            # torchao's float8 all-gather is FSDP2's (fully_shard's pre/post all-gather hooks)
            raise ValueError("float8 needs engine fsdp2 (torchao's float8 all-gather is FSDP2's)")
        if self.float8 and self.precision not in (Precision.BF16_MIXED, Precision.BF16_TRUE):
            raise ValueError(
                f"float8 needs bf16 compute (bf16-mixed or bf16-true), not {self.precision.value}"
            )
        optimizer = OPTIMIZER_TRAITS[self.optimizer]
        if self.optimizer_impl not in optimizer.impls:
            impls = " or ".join(i.value for i in optimizer.impls)
            raise ValueError(
                f"{self.optimizer.value} has no {self.optimizer_impl.value} implementation "
                f"({impls})"
            )
        if self.engine not in optimizer.engines:
            engines = " or ".join(e.value for e in optimizer.engines)
            raise ValueError(f"{self.optimizer.value} runs with engine {engines} only")
        return self

    @property
    def one_unit(self) -> bool:
        """No wrap policy (Lightning's default ``FSDPStrategy()``): the whole model is one FSDP
        unit."""
        return not (self.wrap_classes or self.min_num_params)

    def checkpoints(self, block: int) -> bool:
        """Whether the ``block``-th block of ``checkpoint_classes`` (in forward order, from 0)
        recomputes its forward (all of it, or under ``selective`` the operations the policy does
        not save) in backward: every block, every ``checkpoint_every``-th from the first, or
        none. The one rule that trials apply
        (:func:`autoshard.sharding.apply_checkpointing`) and the estimators count.

        >>> from autoshard import Candidate
        >>> every2 = Candidate(checkpointing="every_k", checkpoint_every=2,
        ...                    checkpoint_classes=("gpt.Block",))
        >>> [every2.checkpoints(i) for i in range(4)], Candidate().checkpoints(0)
        ([True, False, True, False], False)
        """
        if self.checkpointing is Checkpointing.NONE:
            return False
        every = self.checkpoint_every if self.checkpointing is Checkpointing.EVERY_K else 1
        return block % every == 0

    def label(self) -> str:
        """A short human label, stable across runs (used in tables and as a trial key)."""
        parts = [self.engine.value, self.sharding.value]
        if self.hybrid_mesh:
            parts[-1] += f"{self.hybrid_mesh[0]}x{self.hybrid_mesh[1]}"
        parts.append(self.precision.value)
        if self.checkpointing is Checkpointing.ALL:
            parts.append("ckpt")
        elif self.checkpointing is Checkpointing.EVERY_K:
            parts.append(f"ckpt/{self.checkpoint_every}")
        elif self.checkpointing is Checkpointing.SELECTIVE:
            parts.append("ckpt-op")
        if self.cpu_offload:
            parts.append("offload")
        if self.reshard is not Reshard.ALL:
            parts.append(self.reshard.value.replace("_", "-"))
        if self.one_unit:
            parts.append("nowrap")
        elif not self.wrap_classes:
            parts.append(f"wrap>={self.min_num_params}")
        if self.optimizer_impl is not OptimizerImpl.FOREACH:
            parts.append(self.optimizer_impl.value)
        if self.compile:
            parts.append("+compile")
        if self.float8:
            parts.append("+fp8")
        parts.append(f"mbs{self.micro_batch_size}")
        return " ".join(parts)

    def key(self) -> str:
        """A canonical JSON key identifying this candidate (for resuming studies)."""
        return self.model_dump_json()


# --------------------------------------------------------------------------------------------
# Hardware and workload
# --------------------------------------------------------------------------------------------


# The two links, declared once: Hardware holds them, PlanOptions takes them from the user (its
# --intra-node-bandwidth and --inter-node-bandwidth also read "450GB/s").
IntraNodeBandwidth = Annotated[float | None, Field(gt=0, allow_inf_nan=False, description=(
    "Bytes/s of one GPU's link inside a node, e.g. 450GB (per s) (default: the GPU model's)."
))]  # fmt: skip
InterNodeBandwidth = Annotated[float | None, Field(gt=0, allow_inf_nan=False, description=(
    "Bytes/s of one node's network between nodes, e.g. 400GB (per s) (default: the GPU model's)."
))]  # fmt: skip


class Hardware(Frozen):
    """The machines to plan for (not necessarily the ones at hand).

    >>> from autoshard import Hardware
    >>> cluster = Hardware(gpus_per_node=8, nodes=2, gpu_memory=80 * 2**30)
    >>> cluster.world_size, cluster.usable_gpu_memory / 2**30  # 5% margin by default
    (16, 76.0)
    """

    gpus_per_node: int = Field(1, ge=1, description="GPUs per node.")
    nodes: int = Field(1, ge=1, description="Number of nodes.")
    gpu_memory: int = Field(..., gt=0, description="Memory of one GPU in bytes.")
    host_memory: int | None = Field(
        None, description="Host memory per node in bytes (None: not checked)."
    )
    host_cores: int | None = Field(
        None,
        ge=1,
        description="CPU cores per node, shared by its ranks' host work (CPU offload's optimizer "
        "step runs on cores / ranks threads each); None: not known, the threads torchrun gives "
        "(autoshard.predict.optimizer_step.host_optimizer_threads).",
    )
    margin: float = Field(
        0.05,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="Fraction of GPU memory kept free as a safety margin.",
    )
    bf16_supported: bool = Field(True, description="Whether the GPUs compute in bf16.")
    gpu: str | None = Field(
        None,
        description="GPU catalogue id (autoshard.gpus), e.g. 'h100-sxm': sets speed facts; None: "
        "the detected GPU's entry, or an assumed one (said in a warning).",
    )
    intra_node_bandwidth: IntraNodeBandwidth = None
    inter_node_bandwidth: InterNodeBandwidth = None
    backend: Literal["nccl", "gloo"] = Field(
        "nccl",
        description=(
            "Collective backend. 'gloo' plans for CPU processes (autoshard's CPU trials): its "
            "reduce-scatter works on a copy of its input, and there is no CUDA allowance."
        ),
    )

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def usable_gpu_memory(self) -> int:
        return int(self.gpu_memory * (1 - self.margin))


class WorkloadSpec(Frozen):
    """The shape of one training step, as far as memory and throughput are concerned.

    >>> from autoshard import WorkloadSpec
    >>> WorkloadSpec(micro_batch_size=4, seq_len=2048).tokens_per_sample
    2048
    >>> WorkloadSpec(micro_batch_size=32, input_shape=(3, 224, 224)).tokens_per_sample is None
    True
    """

    micro_batch_size: int = Field(1, ge=1, description="Samples per rank per step.")
    loop: Loop = Field(
        Loop.LIGHTNING,
        description="The training loop's order: 'lightning' (the Trainer: zero_grad before "
        "backward, gradients alive through the next forward) or 'plain' (zero_grad after step).",
    )
    accumulate: int = Field(
        1, ge=1, description="Micro-batches whose gradients accumulate before each optimizer step."
    )
    seq_len: int | None = Field(None, description="Tokens per sample for token models.")
    vocab_size: int | None = Field(None, description="Vocabulary size, when the model has one.")
    input_shape: tuple[int, ...] | None = Field(
        None, description="Shape of one sample of a non-token input (e.g. (3, 224, 224))."
    )

    @property
    def tokens_per_sample(self) -> int | None:
        return self.seq_len


# --------------------------------------------------------------------------------------------
# How a study runs (what to plan for is Hardware and WorkloadSpec)
# --------------------------------------------------------------------------------------------


# How long a trial times its steps (autoshard.measure explains the spread).
DEFAULT_TARGET_SPREAD = 0.05
DEFAULT_MAX_STEPS = 40
DEFAULT_MAX_SECONDS = 30.0
# Bytes of worker output a trial's log keeps (its first and last halves; autoshard.trials.logcap).
DEFAULT_WORKER_LOG_CAP = 16 * 2**20


class RankOrder(str, Enum):
    """How a list of estimates is shown: the fitting ones first in either order, then the rest by
    how far they overshoot. The decision is always the fastest predicted that fits."""

    SPEED = "speed"  # fastest predicted first
    HEADROOM = "headroom"  # most memory left first


class ProgressEvent(str, Enum):
    """What a study tells its progress display (``TuneOptions.on_event``)."""

    RESUMED = "resumed"  # a finished trial found in the storage
    START = "start"  # a trial is launched
    DONE = "done"  # a trial finished, or a candidate was ruled out by its estimate
