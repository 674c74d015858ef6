#!/usr/bin/env bash
# Set up .venv with autoshard and everything its tests and examples need.
#
# torch: an unpinned `pip install torch` pulls a multi-GB CUDA build, so this script uses the
# torch that is already installed when there is one (a venv with --system-site-packages sees
# it), and otherwise installs ${AUTOSHARD_TORCH:-torch==2.13.0} first (on this project's machines
# that is the CPU build lying on disk). autoshard's own requirement is then already
# met (pyproject: torch>=2.11,<2.14, the range CI tests) and pip installs no other torch.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  if "$python" -c "import torch" >/dev/null 2>&1; then
    echo "setup: reusing the installed torch $("$python" -c 'import torch; print(torch.__version__)')"
    "$python" -m venv --system-site-packages .venv
  else
    "$python" -m venv .venv
  fi
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  # Unquoted on purpose: AUTOSHARD_TORCH may carry pip options (an --index-url).
  # shellcheck disable=SC2086
  .venv/bin/python -m pip install --quiet ${AUTOSHARD_TORCH:-torch==2.13.0}
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[lightning,hf,postgres,peft,float8,dev]"
echo "setup: $(.venv/bin/python -c 'import torch, autoshard; print("autoshard", autoshard.__version__, "torch", torch.__version__)')"
