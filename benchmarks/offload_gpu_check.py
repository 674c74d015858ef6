"""GPU checks of the offload estimators (issue 32): run on one CUDA GPU, every result appended
to ``$OUT/results.jsonl`` (``./offload_gpu_check.jsonl`` without ``OUT``) as it is made.

    python benchmarks/offload_gpu_check.py all       # every part, each time-boxed: ~2 minutes
    python benchmarks/offload_gpu_check.py all --dry-run   # the same code on CPU, tiny shapes
    python benchmarks/offload_gpu_check.py trial [LABEL]   # one autoshard trial, a fresh group
    python benchmarks/offload_gpu_check.py rule      # attention_kernels' rule vs torch's choice
    python benchmarks/offload_gpu_check.py saved     # a 1B block's saved bytes vs the profile
    python benchmarks/offload_gpu_check.py adam      # host AdamW bytes/s per thread count

Without CUDA every part refuses in one line unless ``--dry-run`` is given (then the numbers are
a CPU's and prove only that the code runs). ``all`` runs each part in its own process under its
time box (:data:`BOXES`, the most valuable first) and records a part that runs over as
``"status": "timeout"``, so one hang costs its box, not the lease.

- ``rule``: every row of tests/predict/test_attention_kernels.py's RULE built as CUDA tensors and
  given to ``torch._fused_sdp_choice`` (the backend torch's dispatch picks), beside
  :func:`autoshard.predict.attention_kernels.cuda_kernel`.
- ``saved``: what one examples/gpt.py 1B block (2,048 tokens) saves for backward on the GPU
  (the storages autograd saves, as the profile counts them; and the allocator's bytes held
  after the forward, less the output), fp32 and bf16 autocast, beside the activation profile
  taken for a CUDA GPU and for CPU workers.
- ``adam``: torch.optim.AdamW(foreach=True) stepping host tensors the size of five 1B-GPT FSDP
  units (304M fp32 parameters) at 1, 2, 4, 8 and 16 threads: seconds per step and the bytes/s
  of its 20 passes (optimizer_step.optimizer_bytes_per_param).
- ``trial``: the candidate of that label (examples/gpt.py size=1b, 2,048 tokens, micro-batch 1;
  by default the shared run's offload row, :data:`OFFLOAD_ROW`, measured 13.64 GiB allocated,
  19.50 reserved) run as autoshard's trials run it, in a fresh worker group (OMP_NUM_THREADS from
  the environment: the group's default is 4), beside estimate_memory (with and without its
  allowance) and predict_speed. What must hold: allocated within 10% of the estimate without the
  allowance, reserved at most the estimate with it (a plan that offloads to fit does not OOM),
  the step within 25% of the prediction. The dry run's trial is the same row without offload
  (FSDP1's offload pins host memory: no CPU-only torch runs it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
# a CPU dry run of the same code (CHECK_SIZE=tiny CHECK_SEQ=128): no numbers worth keeping
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZE = os.environ.get("CHECK_SIZE", "1b")
SEQ = int(os.environ.get("CHECK_SEQ", "2048"))
UNIT = int(os.environ.get("CHECK_UNIT", "60817408"))  # one 1B-GPT block's flat parameter
OFFLOAD_ROW = "fsdp1 FULL_SHARD 32-true ckpt/2 offload mbs1"
# (part, seconds): the part ``all`` runs, in this order, and its time box on one H100/H200
BOXES = (("trial", 75), ("rule", 10), ("saved", 25), ("adam", 25))
DRY_RUN_ENV = {"CHECK_SIZE": "tiny", "CHECK_SEQ": "128", "CHECK_UNIT": "100000"}
# a CPU dry run proves that the code runs, not how fast: a shared 2-core machine's imports alone
# take what a GPU node's whole part takes
DRY_RUN_BOX_SCALE = 8


def _record(part: str, **fields: Any) -> None:
    row = {"part": part, **fields}
    print(json.dumps(row), flush=True)
    out = os.environ.get("OUT")
    path = Path(out) / "results.jsonl" if out else Path("offload_gpu_check.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def rule() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "predict"))
    from test_attention_kernels import RULE

    from autoshard.predict.attention_kernels import cuda_kernel

    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
    _record("rule-env", torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
            device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
            cores=os.cpu_count())  # fmt: skip
    for call, _ in RULE:
        nq, nk, nv = call.heads
        dq, dk, dv = call.head_dims
        lq, lk = call.lengths
        opts = {"device": DEVICE, "dtype": call.dtype, "requires_grad": True}
        q = torch.randn(1, nq, lq, dq, **opts)
        k = torch.randn(1, nk, lk, dk, **opts)
        if call.unit_strides:
            v = torch.randn(1, nv, lk, dv, **opts)
        else:
            v = torch.randn(1, nv, dv, lk, **opts).transpose(-1, -2)
        mask = torch.ones(1, 1, lq, lk, device=DEVICE, dtype=torch.bool) if call.mask else None
        choice = torch._fused_sdp_choice(
            q, k, v, mask, 0.0, call.causal, scale=None, enable_gqa=call.gqa
        )
        got = names.get(int(choice), str(choice))
        want = cuda_kernel(call)
        _record("rule", call=repr(call), rule=want, torch=got, same_kernel=got == want,
                same_math=(got == "math") == (want == "math"))  # fmt: skip
        del q, k, v


def saved() -> None:
    from gpt import build

    from autoshard import TargetSpec, WorkloadSpec, analyze_target
    from autoshard.predict.activations import profile_activations

    profile, built = analyze_target(
        TargetSpec(spec=f"{ROOT}/examples/gpt.py:build", kwargs={"size": SIZE})
    )
    workload = WorkloadSpec(seq_len=SEQ)
    profiles = {
        on: profile_activations(built.model, profile, workload,
                                precisions=("32-true", "bf16-mixed"), attention_on=on)
        for on in ("cuda", "cpu")
    }  # fmt: skip
    torch.manual_seed(0)
    with torch.device(DEVICE):
        block = build(SIZE, n_layer=1).blocks[0]
    width = block.norm1.weight.numel()
    for precision, autocast in (("32-true", False), ("bf16-mixed", True)):
        hooks, held, big = _saved_by_block(block, width, autocast)
        _record("saved", precision=precision, hooks_mib=hooks / 2**20, allocator_mib=held / 2**20,
                big_saved=big,
                profile_cuda_mib=profiles["cuda"].at(precision).block_bytes[0] / 2**20,
                profile_cpu_mib=profiles["cpu"].at(precision).block_bytes[0] / 2**20)  # fmt: skip


def _saved_by_block(
    block: torch.nn.Module, width: int, autocast: bool
) -> tuple[int, int, list[tuple[int, ...]]]:
    """(bytes autograd saves in one forward of ``block``, counted per storage as the profile
    counts them; bytes the allocator holds after it, less the output; shapes of saves of 100
    MiB or more)."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    x = torch.randn(1, SEQ, width, device=DEVICE, requires_grad=True)
    params.add(x.untyped_storage().data_ptr())
    seen: dict[int, int] = {}
    big: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in seen:
            seen[key] = t.untyped_storage().nbytes()
            if seen[key] >= 100 * 2**20:
                big.append(tuple(t.shape))
        return t

    cuda = DEVICE == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast),
    ):
        out = block(x)
    held = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes() if cuda else 0
    return sum(seen.values()), held, big


def adam() -> None:
    torch.manual_seed(0)
    unit = UNIT
    params = [torch.nn.Parameter(torch.randn(unit)) for _ in range(5)]
    for p in params:
        p.grad = torch.randn(unit)
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    torch.set_num_threads(16)
    optimizer.step()  # makes the states
    n = 5 * unit
    for threads in (1, 2, 4, 8, 16):
        torch.set_num_threads(threads)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - start)
        best = min(times)
        _record("adam", threads=threads, params=n, step_s=times,
                gb_s_at_20_passes=n * 80 / best / 1e9, cores=os.cpu_count())  # fmt: skip


def trial(label: str) -> None:
    from autoshard.analyze import analyze_target
    from autoshard.config import Engine, Hardware, Precision, WorkloadSpec
    from autoshard.options import TuneOptions
    from autoshard.predict.activations import precisions_of, profile_activations
    from autoshard.predict.analytic import estimate_memory
    from autoshard.predict.attention_kernels import attention_device
    from autoshard.predict.flops import profile_flops
    from autoshard.predict.hardware import detected_gpu, speed_for
    from autoshard.predict.speed import predict_speed
    from autoshard.space import Knobs, enumerate_candidates
    from autoshard.target.resolve import TargetSpec
    from autoshard.trials.group import WorkerGroup

    target = TargetSpec(spec=f"{ROOT}/examples/gpt.py:build", kwargs={"size": SIZE})
    workload = WorkloadSpec(seq_len=SEQ)
    if DEVICE == "cuda":
        memory = torch.cuda.get_device_properties(0).total_memory
        hardware = Hardware(gpus_per_node=1, gpu_memory=memory, gpu=detected_gpu())
    else:
        hardware = Hardware(gpus_per_node=1, gpu_memory=8 * GIB, backend="gloo")
    profile, built = analyze_target(target)
    candidates = [
        c
        for engine in (Engine.FSDP1, Engine.FSDP2)
        for c in enumerate_candidates(
            profile,
            hardware,
            workload,
            Knobs(
                engine=engine, precisions=(Precision.FP32,), micro_batch_sizes=(1,), offload=None
            ),
        )
        if c.label() == label and not c.compile
    ]
    if not candidates:
        raise SystemExit(f"offload_gpu_check: no candidate labelled {label!r} for this GPU")
    candidate = candidates[0]
    acts = profile_activations(built.model, profile, workload, precisions=precisions_of(candidates),
                               attention_on=attention_device(hardware))  # fmt: skip
    est = estimate_memory(profile, candidate, hardware, workload, activations=acts)
    gpu, _ = speed_for(hardware)
    flops = profile_flops(built.model, profile, workload)
    speed = predict_speed(profile, flops, candidate, hardware, workload, gpu=gpu)
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp, WorkerGroup(target, log_dir=Path(tmp)) as group:
        result = group.run(
            candidate,
            workload,
            options=TuneOptions(warmup=1, steps=2, max_steps=2, max_seconds=1.0),
        )
    _record("trial", label=label, omp=os.environ.get("OMP_NUM_THREADS", "4 (group default)"),
            status=result.status.value, error=(result.error or "")[:300],
            step_s=result.step_time, step_times=result.step_times,
            allocated_gib=[a / GIB for a in result.peak_allocated],
            reserved_gib=[r / GIB for r in result.peak_reserved],
            estimate_gib=(est.gpu_peak - est.breakdown.allowance) / GIB, estimate_at=est.peak_at,
            gpu_peak_gib=est.gpu_peak / GIB,
            predicted_step_s=speed.step_time_s,
            offload_s=speed.breakdown.offload_s, wall_s=round(time.time() - start, 1))  # fmt: skip


def run_all(dry_run: bool) -> int:
    """Every part in its own process group under its time box (the whole group, the trial's
    workers too, killed when it runs over); 0 when each finished in time."""
    sys.path[:0] = [str(ROOT)]  # run as a script on a machine where autoshard is not installed
    from autoshard.child_env import child_env

    env = child_env(ROOT, ROOT / "examples", **(DRY_RUN_ENV if dry_run else {}))
    failed = 0
    for part, seconds in BOXES:
        box = seconds * (DRY_RUN_BOX_SCALE if dry_run else 1)
        args = [sys.executable, __file__, part, *(["--dry-run"] if dry_run else [])]
        start = time.time()
        child = subprocess.Popen(args, env=env, start_new_session=True)
        try:
            rc: int | None = child.wait(timeout=box)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            rc = None
        if rc != 0:
            failed += 1
            _record(part, status="timeout" if rc is None else f"exit {rc}", box_s=box,
                    wall_s=round(time.time() - start, 1))  # fmt: skip
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    global SIZE, SEQ, UNIT
    if {"-h", "--help"} & set(argv):
        print(f"usage: python benchmarks/offload_gpu_check.py PART [--dry-run]\n{__doc__}")
        return 0
    dry_run = "--dry-run" in argv
    if dry_run:  # tiny shapes unless the caller chose others
        SIZE = os.environ.get("CHECK_SIZE", DRY_RUN_ENV["CHECK_SIZE"])
        SEQ = int(os.environ.get("CHECK_SEQ", DRY_RUN_ENV["CHECK_SEQ"]))
        UNIT = int(os.environ.get("CHECK_UNIT", DRY_RUN_ENV["CHECK_UNIT"]))
    args = [a for a in argv if a != "--dry-run"]
    parts = {"rule": rule, "saved": saved, "adam": adam}
    if not args or args[0] not in {*parts, "trial", "all"}:
        print(f"offload_gpu_check: give a part: all, trial [LABEL], {', '.join(parts)} "
              "(and --dry-run without a GPU)", file=sys.stderr)  # fmt: skip
        return 1
    if DEVICE != "cuda" and not dry_run:
        why = "no CUDA GPU here (torch.cuda.is_available() is False)"
        print(f"offload_gpu_check: {why}; add --dry-run to run the same code on CPU with tiny "
              "shapes", file=sys.stderr)  # fmt: skip
        return 1
    if args[0] == "all":
        return run_all(dry_run)
    sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
    if args[0] == "trial":
        default = OFFLOAD_ROW.replace(" offload", "") if dry_run else OFFLOAD_ROW
        trial(args[1] if len(args) > 1 else default)
    else:
        parts[args[0]]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
