#!/usr/bin/env bash
# Creates .venv with Python >= 3.12 and installs coat-jax (editable) with its test dependencies, at
# the versions of the GPU image (constraints.txt), which CI tests.
set -euo pipefail
cd "$(dirname "$0")/.."
find_python() {
  for c in "${PYTHON:-}" python3.13 python3.12; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo "$c"; return; }
  done
  # pyenv: the repo's .python-version names 3.12.1
  if command -v pyenv >/dev/null 2>&1; then
    local p; p=$(PYENV_VERSION=$(cat .python-version) pyenv which python 2>/dev/null || true)
    [ -n "$p" ] && { echo "$p"; return; }
  fi
  c=python3; "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo "$c"; return; }
  echo "error: coat-jax needs Python >= 3.12 (jax 0.11); none found (tried python3.12, pyenv $(cat .python-version))" >&2
  exit 1
}
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  rm -rf .venv
  "$(find_python)" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
