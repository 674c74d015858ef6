#!/usr/bin/env bash
# What only a GPU can measure, for a GPU machine that has CUDA torch but no network (this
# project's lent machine: its python3 holds torch, Lightning, rich, typer, pyyaml; the rest comes
# as wheels from scripts/device_wheels.sh, carried in .whl/).
#
#   bash benchmarks/gpu.sh accuracy [OUT]   estimators vs torch.cuda.max_memory_allocated/reserved
#   bash benchmarks/gpu.sh tune [OUT]       CUDA tests, tune overhead, chosen vs Lightning default
#   bash benchmarks/gpu.sh speed [OUT]      the step-time model (uncalibrated) vs measured trials,
#                                           torch.compile and float8 included
#   bash benchmarks/gpu.sh handover [OUT]   each consumer of what autoshard hands over, for real
#
# Results go to OUT (default benchmarks/results), named as the CPU ones with _gpu / cuda in
# place of _cpu. Each part fits in one 10-minute device call.
set -euo pipefail
cd "$(dirname "$0")/.."
part="${1:?usage: bash benchmarks/gpu.sh accuracy|tune|speed|handover [OUT]}"
out="${2:-benchmarks/results}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/autoshard-site .whl/*.whl
  export PYTHONPATH="/tmp/autoshard-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:$PWD/examples${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'gpu.sh: torch sees no GPU'; \
print('gpu.sh:', torch.__version__, torch.cuda.get_device_name(), torch.cuda.device_count(), 'GPU(s)')"
case "$part" in
  accuracy)
    # Measurements are saved in OUT before the estimates run (kept if those run past the limit;
    # --reuse with them there skips measuring again).
    python3 benchmarks/estimate_accuracy.py --device cuda --results-dir "$out" \
      --write "$out/estimate_accuracy_gpu.md" ${AUTOSHARD_REUSE:+--reuse}
    # The reserved peak (torchtitan's published memory) against estimate_reserved: FSDP2's
    # stream pools and the loss's hole, default allocator and expandable segments.
    python3 benchmarks/reserved_memory_measured.py --write "$out/reserved_memory_gpu.md"
    ;;
  tune)
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$out/gpu_tests.txt" \
      || echo "gpu.sh: a CUDA test failed (see gpu_tests.txt); measuring the tuner anyway"
    python3 benchmarks/tune_overhead.py --size small --seq-len 512 --write "$out/tune_gpu.md"
    ;;
  speed)
    # A 1B GPT at 2,048 tokens: large enough that the GPU, not the launches, sets the pace;
    # 12 configurations of the grid (checkpointing, precision, micro-batch, offload, one unit).
    python3 benchmarks/step_time_measured.py --size 1b --seq-len 2048 --max 12 \
      --write "$out/step_time_measured_gpu.md"
    # torch.compile and float8 (float8 where the GPU has fp8 and torchao is there): one FSDP2
    # configuration eager, + compile, + float8, + both, against the model and torchtitan's table.
    python3 benchmarks/compile_float8_measured.py --size 1b --seq-len 2048 --mbs 2 \
      --write "$out/compile_float8_measured_gpu.md"
    ;;
  handover)
    # What CPU processes cannot run (FSDP1 offload; Lightning's and Fabric's FSDPStrategy,
    # accelerate and the Hugging Face Trainer refuse FSDP on CPU): rec.apply, Lightning Trainer,
    # Fabric, LightningCLI's YAML, accelerate's YAML and TrainingArguments each train 3 steps on
    # the GPUs here (NCCL, one process per GPU), checked against the recommendation.
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_handover.py 2>&1 \
      | tee "$out/handover_gpu.txt"
    ;;
  *) echo "gpu.sh: unknown part '$part' (accuracy, tune, speed or handover)" >&2; exit 1 ;;
esac
