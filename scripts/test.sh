#!/usr/bin/env bash
# Runs the test suite: `scripts/test.sh` (default, < 15 min on 2 CPU cores) or `scripts/test.sh --slow` (all).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "${1:-}" = "--slow" ]; then shift; exec .venv/bin/python -m pytest -q -m "not gpu" "$@"; fi
exec .venv/bin/python -m pytest -q "$@"
