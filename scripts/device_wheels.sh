#!/usr/bin/env bash
# Download, into .whl/, the wheels a GPU machine without network needs beside its own CUDA torch,
# Lightning, rich, typer and pyyaml: autoshard's other dependencies, at the versions in .venv
# (so the GPU runs use what CI tests). benchmarks/gpu.sh installs them from there.
# Usage: bash scripts/device_wheels.sh [PYTHON_VERSION]   (the GPU machine's Python; default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-3.12}"
# accelerate and transformers (with what they import): gpu.sh handover runs their Trainer.
# torchao: gpu.sh speed measures float8 with it (the float8 extra).
names=(optuna alembic colorlog Mako SQLAlchemy greenlet pydantic pydantic_core annotated-types
       typing-inspection jsonargparse docstring_parser accelerate transformers huggingface_hub
       tokenizers safetensors regex hf_xet fsspec filelock psutil tqdm packaging numpy click
       httpx2 httpcore2 anyio h11 idna truststore torchao)
pins=()
for name in "${names[@]}"; do
  version=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null) \
    || continue  # not installed here (greenlet is optional): not needed there either
  pins+=("$name==$version")
done
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
echo "device_wheels: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/ (carry it: carry=[\".whl\"])"
