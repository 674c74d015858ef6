#!/usr/bin/env bash
# The oldest torch pyproject allows (2.11, the lent GPU machines' torch), beside .venv's 2.13:
# scripts/check.sh installs it while the main suite runs and then runs the prediction and memory
# tests on it, and the cross check of both torches (tests/predict/test_torch_range.py).
#
#   bash scripts/torch_tier.sh install   .venv-torch211: torch 2.11.0 from PyPI, the rest from .venv
#   bash scripts/torch_tier.sh test      the tests on 2.11, then the cross check from .venv
#
# PyPI's torch 2.11.0 for Linux is a CUDA build (no CPU build is reachable here): it imports only
# with its CUDA libraries beside it, which it loads and never uses on a machine without a GPU.
# They are installed without their exact pins (--no-deps), at the versions this project's
# machines hold in their local package index (torch 2.14's: the same sonames), so that only the
# torch wheel comes over the network; triton and cuda-bindings, which nothing here imports, stay
# out. autoshard's other dependencies are .venv's (a .pth file adds its site-packages after the
# tier's own, so torch is 2.11's).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-torch211
TORCH=torch==2.11.0
CUDA_LIBS=(nvidia-cublas==13.1.1.3 nvidia-cuda-cupti==13.0.85 nvidia-cuda-nvrtc==13.0.88
  nvidia-cuda-runtime==13.0.96 nvidia-cudnn-cu13==9.24.0.43 nvidia-cufft==12.0.0.61
  nvidia-cufile==1.15.1.6 nvidia-curand==10.4.0.35 nvidia-cusolver==12.0.4.66
  nvidia-cusparse==12.6.3.3 nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.30.7
  nvidia-nvjitlink==13.4.92 nvidia-nvshmem-cu13==3.4.5 nvidia-nvtx==13.0.85)
# On 2.11: the step-time and FLOP profiles with compile and float8, the memory tracker and the
# simulation against the analytic estimate, the estimate's command line.
TESTS=(tests/predict/test_torch_range.py tests/predict/test_flop_counting.py
  tests/predict/test_analytic.py tests/predict/test_tracking.py tests/test_compile_float8.py
  tests/predict/test_recipe.py)

case "${1:-}" in
  install)
    started=$(date +%s)
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --no-deps --disable-pip-version-check "$TORCH" "${CUDA_LIBS[@]}"
    site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    main=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "import site; site.addsitedir('$main')" > "$site/zz_autoshard_main_venv.pth"
    "$VENV/bin/python" -c "import torch, autoshard; print('torch_tier:', torch.__version__)"
    echo "torch_tier: installed in $(($(date +%s) - started)) s, $(du -sh "$VENV" | cut -f1)"
    ;;
  test)
    export AUTOSHARD_OLD_TORCH_PYTHON=$PWD/$VENV/bin/python AUTOSHARD_REQUIRE_OLD_TORCH=1
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" "${TESTS[@]}"
    .venv/bin/python -m pytest -q -p no:cacheprovider tests/predict/test_torch_range.py -k oldest
    ;;
  *) echo "usage: bash scripts/torch_tier.sh install|test" >&2; exit 1 ;;
esac
