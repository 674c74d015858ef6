#!/usr/bin/env bash
# Download, into .whl/ (or DEST), the wheels a GPU machine without network needs beside its own
# CUDA torch, Lightning, rich, typer and pyyaml: what scripts/device_wheels.py --pins derives
# from the installed metadata (autoshard with its lightning, hf, float8 and peft extras, every
# requirement followed, at the versions in .venv: what CI tests). benchmarks/gpu.sh installs
# them from .whl/ and checks that every need imports (device_wheels.py --check).
# Usage: bash scripts/device_wheels.sh [PYTHON_VERSION [DEST]]   (the GPU machine's Python; 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-3.12}"
dest="${2:-.whl}"
mapfile -t pins < <(.venv/bin/python scripts/device_wheels.py --pins --python "$py")
rm -rf "$dest" && mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$dest" "${pins[@]}"
echo "device_wheels: ${#pins[@]} wheels, $(du -sh "$dest" | cut -f1) in $dest/ (carry it: carry=[\"$dest\"])"
