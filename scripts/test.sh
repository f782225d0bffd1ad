#!/usr/bin/env bash
# Runs the test suite: `scripts/test.sh` (default, < 15 min on 2 CPU cores) or `scripts/test.sh --slow` (all);
# `scripts/test.sh PYTEST_ARGS...` (e.g. -k PATTERN) runs a part of it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The Hugging Face import tests compare against transformers in a Python 3.11 side environment;
# where it cannot be built they skip, saying why.
scripts/setup_hf_env.sh || echo "warning: .venv-hf not built; the transformers comparison tests will skip" >&2
# The whole suite also installs the package as a user does, into a fresh virtual environment
# outside the tree, and runs the README's examples there (~40 s: pip's cache holds the wheels).
if [ $# -eq 0 ] || { [ $# -eq 1 ] && [ "$1" = "--slow" ]; }; then
  scripts/check_install.sh
fi
# Two workers (pytest-xdist), one test file each at a time (module fixtures built once): most of
# a test's time is XLA compiling on one core, so two files at once use both of CI's two cores.
WORKERS=(-n "${COAT_TEST_WORKERS:-2}" --dist loadfile)
if [ "${1:-}" = "--slow" ]; then shift; exec .venv/bin/python -m pytest -q "${WORKERS[@]}" -m "not gpu" "$@"; fi
exec .venv/bin/python -m pytest -q "${WORKERS[@]}" "$@"
