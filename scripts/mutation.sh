#!/usr/bin/env bash
# Mutation testing (mutmut) of core modules, one at a time, in a time budget per module:
#   scripts/mutation.sh units plan                 every mutant of each, 30 min budget each
#   scripts/mutation.sh --sample 150 predict/speed  a random sample (seed 26; --seed to change)
# A change to a core module runs this on that module before it lands (README, Development).
# Shared machines: it runs at the lowest priority with one worker. --help lists the options.
set -euo pipefail
cd "$(dirname "$0")/.."
exec nice -n 19 .venv/bin/python scripts/mutation.py "$@"
