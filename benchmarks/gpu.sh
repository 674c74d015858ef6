#!/usr/bin/env bash
# What only a GPU can measure, in ONE lease of the lent GPU machine (its python3 has CUDA torch,
# Lightning, rich, typer and pyyaml and no network; the rest comes as wheels made by
# scripts/device_wheels.sh and carried in .whl/, installed here with --target and put on
# PYTHONPATH, which every child process keeps: autoshard.child_env).
#
#   bash benchmarks/gpu.sh all OUT [--dry-run]    every part below, in order, each time-boxed
#   bash benchmarks/gpu.sh PART OUT [--dry-run]   one part
#
# Everything lands in one folder, packed after every part into OUT/autoshard-gpu.tar.gz (the
# command, the versions, the budget and what each part used, each part's log and results): a
# part cut by its time box, or the call cut by its limit, keeps what was measured before.
# --dry-run runs the same parts, the same code paths and the same archive on 2 gloo CPU
# processes with tiny shapes (CI runs it: tests/test_gpu_sh.py), and checks that the children
# of the launchers kept PYTHONPATH.
#
# The device call (the run tool: one command of at most 600 s, 2,000 characters):
#   command: bash benchmarks/gpu.sh all "$OUT"     carry: [".whl"]     timeout_s: 600
# after `bash scripts/device_wheels.sh` here. Then, here, unpack the archive into
# benchmarks/results/ and estimate its CUDA measurements without a GPU:
#   python benchmarks/estimate_accuracy.py --device cuda --reuse --world 1 \
#     --results-dir <archive>/accuracy --only ... --write benchmarks/results/estimate_accuracy_gpu.md
set -uo pipefail  # not -e: a part that fails or runs out of time must not stop the others
cd "$(dirname "$0")/.."
ROOT=$PWD

# The budget: seconds of each part's time box, the most valuable first. They add up to 540 s,
# so that the wheels (~20 s), the checks and the packing fit one 600-second device call
# (15 minutes of device time a session, the machine's start included).
BUDGET="
tune7b          160  autoshard tune on a 7B GPT (the first GPU run's README): >=4 candidates, 0 false OOMs
gpu-tests        35  pytest -m gpu but the handover: CUDA trial peaks, trial isolation
memory-grid      55  1B GPT grid, every trial in ONE worker group, as tune runs them: peaks
accuracy         50  estimate_accuracy --device cuda --measure-only, a subset of its grid
handover         95  tests/test_handover.py -m gpu: every consumer trains on the GPU
speed-grid       95  the same 1B grid, each trial in a FRESH worker group: step times, peaks
compile-float8   50  eager, +compile, +float8, both, each in a fresh worker group
"
# Parts `all` leaves out (they do not fit its lease), run by name, each in a call of its own.
EXTRA="
reserved         240  reserved_memory_measured.py: FSDP2's stream pools, torchtitan's shape
tune-overhead    400  tune_overhead.py: a trial's overhead, the chosen config vs Lightning's default
isolation        420  trial_isolation.py: 1B candidates in one group vs each in a fresh group, peaks within 1%
offload          170  offload_gpu_check.py all: the 1B offload trial, SDPA's kernel rule, saved bytes, host AdamW
"
DEADLINE_S=${AUTOSHARD_GPU_SECONDS:-560}  # the whole script's, from its start

part="" out="" dry=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    -*) echo "gpu.sh: unknown option $arg" >&2; exit 1 ;;
    *) if [ -z "$part" ]; then part=$arg; elif [ -z "$out" ]; then out=$arg; else
         echo "gpu.sh: one part and one folder" >&2; exit 1; fi ;;
  esac
done
parts=$(awk 'NF {print $1}' <<<"$BUDGET$EXTRA")
if [ -z "$part" ] || [ -z "$out" ]; then
  echo "usage: bash benchmarks/gpu.sh all|PART OUT [--dry-run]; PART: $(echo $parts)" >&2; exit 1
fi
if [ "$part" != all ] && ! grep -qx "$part" <<<"$parts"; then
  echo "gpu.sh: unknown part '$part' (all, or one of: $(echo $parts))" >&2; exit 1
fi
mkdir -p "$out" && out=$(cd "$out" && pwd)
start=$(date +%s)
work=$(mktemp -d /tmp/autoshard-gpu.XXXXXX)
R=$work/autoshard-gpu
mkdir -p "$R"
archive=$out/autoshard-gpu.tar.gz
exec > >(tee -a "$R/run.log") 2>&1
say() { echo "[gpu.sh +$(($(date +%s) - start))s] $*"; }
pack() {
  tar -czf "$archive.tmp" -C "$work" autoshard-gpu && mv "$archive.tmp" "$archive"
}

if [ "$dry" = 1 ]; then
  # The GPU's time boxes are for a GPU: on 2 loaded cores each part may take 300 s.
  DEADLINE_S=${AUTOSHARD_GPU_SECONDS:-3600} DRY_PART_S=300
  export CUDA_VISIBLE_DEVICES=""  # CPU processes, gloo, whatever the machine has
  # Every Python process that sees this folder on PYTHONPATH logs its command line: a child
  # of the launchers that lost the parent's PYTHONPATH is missing from children.log.
  mkdir -p "$work/probe"
  cat > "$work/probe/sitecustomize.py" <<EOF
with open("$R/children.log", "a") as log:
    log.write(open("/proc/self/cmdline", "rb").read().replace(b"\\0", b" ").decode() + "\\n")
EOF
  export PYTHONPATH="$work/probe${PYTHONPATH:+:$PYTHONPATH}"
elif compgen -G ".whl/*.whl" >/dev/null; then
  site=/tmp/autoshard-site
  if [ ! -f "$site/.installed" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" .whl/*.whl && touch "$site/.installed"
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT:$ROOT/examples${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
say "wheels in"

{
  echo "bash benchmarks/gpu.sh $*"
  echo "started $(date -u +%Y-%m-%dT%H:%M:%SZ); commit $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "dry run: $dry; deadline ${DEADLINE_S} s; PYTHONPATH=$PYTHONPATH"
} > "$R/command.txt"
python3 - > "$R/versions.txt" 2>&1 <<'EOF'
import importlib.metadata as m, os, platform, torch
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", gpu, "x", torch.cuda.device_count(), "cpus", os.cpu_count())
for name in ["lightning", "transformers", "accelerate", "optuna", "pydantic", "torchao", "peft",
             "jsonargparse", "typeshed_client", "numpy", "typer", "rich"]:
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "missing")
import autoshard
print("autoshard from", autoshard.__file__)
EOF
cat "$R/versions.txt"
if [ "$dry" = 0 ]; then
  nvidia-smi > "$R/nvidia-smi.txt" 2>&1
  python3 -c "import torch; assert torch.cuda.is_available(), 'gpu.sh: torch sees no GPU (--dry-run for CPU)'" \
    || { pack; exit 1; }
fi
# Every module the parts import, in one line each that fails (a missing wheel costs seconds
# here, not a part). The dry run checks it as on the machine: only its packages and the pins.
# (The dry run, on 2 cores, autoshard's alone: tests/test_device_wheels.py checks the others.)
wheels_check=(--check)
[ "$dry" = 1 ] && wheels_check=(--as-device --need autoshard)
python3 scripts/device_wheels.py "${wheels_check[@]}" > "$R/wheels.txt" 2> "$R/wheels.err"
say "wheels check: $(cat "$R/wheels.txt")"
echo "$BUDGET" > "$R/budget.txt"
echo "part seconds_allowed seconds_used exit" > "$R/parts.txt"
pack

# The commands of each part: GPU, then the dry run's tiny shapes on CPU.
if [ "$dry" = 1 ]; then
  TUNE=(--arg size=tiny --seq-len 64 --batch-size 1,2 --trials 2 --gpu-memory 2GiB
        --trial-timeout 120 --max-seconds 1)
  GPU_TESTS=(tests/trials/test_group.py)
  GRID=(--size tiny --seq-len 64 --max 1 --steps 2 --warmup 1 --max-seconds 1)
  ACC=(--device cpu --only "gpt-tiny fsdp2 FULL_SHARD 32-true mbs1 reshard=keep_root")
  CF8=(--size tiny --seq-len 64 --mbs 1 --variants eager --cpu --steps 2 --warmup 1
       --max-seconds 1)
  ISO=(--size tiny --seq-len 64 --mbs 1 --max 2)
  OFFLOAD=(--dry-run)
else
  TUNE=(--arg size=7b --seq-len 2048 --batch-size 1,2,4 --trials 5 --trial-timeout 90
        --max-seconds 8)
  GPU_TESTS=(tests/ --ignore=tests/test_handover.py)
  GRID=(--size 1b --seq-len 2048 --max 6 --steps 3 --warmup 2 --max-seconds 5)
  ACC=(--device cuda --only "gpt-deep FULL_SHARD" --only mixtral-tiny --only ckpt-op)
  CF8=(--size 1b --seq-len 2048 --mbs 2 --max-seconds 5)
  ISO=(--size 1b --seq-len 2048 --mbs 1,4 --max 4)
  OFFLOAD=()
fi
run_part() {
  local name=$1
  case "$name" in
    tune7b) (mkdir -p "$R/tune" && cd "$R/tune" && python3 -m autoshard tune \
              "$ROOT/examples/gpt.py:build" "${TUNE[@]}" --no-compile --no-float8 --out "$R/tune") ;;
    gpu-tests) python3 -m pytest -q -p no:cacheprovider -m gpu "${GPU_TESTS[@]}" ;;
    memory-grid) python3 benchmarks/step_time_measured.py "${GRID[@]}" \
                   --json "$R/grid_one_group.json" --write "$R/step_time_one_group.md" ;;
    accuracy) python3 benchmarks/estimate_accuracy.py "${ACC[@]}" --measure-only \
                --results-dir "$R/accuracy" ;;
    handover) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_handover.py ;;
    speed-grid) python3 benchmarks/step_time_measured.py "${GRID[@]}" --fresh-group \
                  --json "$R/grid_fresh_groups.json" --write "$R/step_time_fresh_groups.md" ;;
    compile-float8) python3 benchmarks/compile_float8_measured.py "${CF8[@]}" --fresh-group \
                      --json "$R/compile_float8.json" --write "$R/compile_float8.md" ;;
    reserved) python3 benchmarks/reserved_memory_measured.py --write "$R/reserved_memory_gpu.md" ;;
    tune-overhead) python3 benchmarks/tune_overhead.py --size small --seq-len 512 \
                     --write "$R/tune_gpu.md" ;;
    isolation) python3 benchmarks/trial_isolation.py "${ISO[@]}" --write "$R/trial_isolation.md" ;;
    offload) OUT="$R/offload" python3 benchmarks/offload_gpu_check.py all "${OFFLOAD[@]}" ;;
  esac
}

failed=0 slack=0
while read -r name seconds _; do
  [ -z "$name" ] && continue
  [ "$part" != all ] && [ "$part" != "$name" ] && continue
  [ "$part" = all ] && grep -q "^$name " <<<"$EXTRA" && continue
  [ "$dry" = 1 ] && seconds=$DRY_PART_S
  left=$((DEADLINE_S - ($(date +%s) - start) - 10))  # 10 s kept for the packing
  allowed=$((seconds + slack < left ? seconds + slack : left))
  if [ "$allowed" -le 5 ]; then
    say "$name: no time left"; echo "$name 0 0 skipped" >> "$R/parts.txt"; failed=1; continue
  fi
  say "$name: up to ${allowed} s"
  t0=$(date +%s)
  timeout -k 10 "$allowed" bash -c "$(declare -p ROOT R TUNE GPU_TESTS GRID ACC CF8 ISO OFFLOAD); $(declare -f run_part); run_part $name" \
    > "$R/$name.log" 2>&1
  rc=$?
  used=$(($(date +%s) - t0))
  slack=$((allowed - used > 0 ? allowed - used : 0))  # an early finish gives the next part time
  echo "$name $allowed $used $rc" >> "$R/parts.txt"
  [ "$rc" = 0 ] || failed=1
  say "$name: exit $rc after ${used} s$([ "$rc" = 124 ] && echo ' (its time box)')"
  tail -5 "$R/$name.log"
  # what a part left on the GPU would be the next part's baseline: said, not hidden
  [ "$dry" = 0 ] && nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader \
    >> "$R/gpu_leftovers.txt" 2>&1
  pack
done <<<"$BUDGET$EXTRA"

if [ -f "$R/grid_one_group.json" ] && [ -f "$R/grid_fresh_groups.json" ]; then
  python3 benchmarks/step_time_measured.py --compare "$R/grid_one_group.json" \
    "$R/grid_fresh_groups.json" --write "$R/groups_compare.md" || failed=1
fi
if [ "$dry" = 1 ] && [ "$part" = all ]; then
  # the launchers' children (the trial workers, estimate_accuracy's measuring ranks) saw the
  # probe on PYTHONPATH, so they kept the parent's
  for child in "-m autoshard.trials.worker" "estimate_accuracy.py --worker"; do
    grep -qF -- "$child" "$R/children.log" 2>/dev/null \
      || { say "a child lost PYTHONPATH: no '$child' in children.log"; failed=1; }
  done
fi
say "done: $(awk 'NR > 1 {printf "%s %s/%s s exit %s; ", $1, $3, $2, $4}' "$R/parts.txt")"
pack
say "archive: $archive ($(du -h "$archive" | cut -f1))"
rm -rf "$work"
exit "$failed"
