#!/usr/bin/env bash
# Run the whole test suite (slow multi-process tests included), then ruff and mypy.
# Pass pytest arguments through, e.g. `scripts/check.sh -m "not slow"` for a quick local run.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
python -m pytest --durations=15 "$@"
ruff check .
ruff format --check .
mypy
# mutation testing is not part of CI (too slow); its script is, as a smoke test
bash scripts/mutation.sh --help > /dev/null
