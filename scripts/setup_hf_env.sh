#!/usr/bin/env bash
# Creates .venv-hf: a Python 3.11 environment with PyTorch (CPU) + transformers, used only to build
# Hugging Face reference checkpoints and logits (scripts/make_hf_reference.py) for
# tests/test_hf_import.py. jax needs Python >= 3.12; torch 2.13.0's CPU build is for 3.11.
# Idempotent: does nothing if .venv-hf already imports torch, transformers and safetensors.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-hf
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import torch, transformers, safetensors' 2>/dev/null; then
  exit 0
fi
find_python311() {
  for c in "${PYTHON_HF:-}" python3.11; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 \
      && PYENV_VERSION=3.11.7 "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null \
      && { echo "$c"; return; }
  done
  if command -v pyenv >/dev/null 2>&1; then
    local v p
    for v in 3.11.7 $(pyenv versions --bare 2>/dev/null | grep '^3\.11' || true); do
      p=$(PYENV_VERSION=$v pyenv which python 2>/dev/null || true)
      [ -n "$p" ] && { echo "$p"; return; }
    done
  fi
  echo "error: .venv-hf needs Python 3.11 (torch 2.13.0 CPU build); none found" >&2
  exit 1
}
PY=$(find_python311)
rm -rf "$VENV"
PYENV_VERSION=3.11.7 "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch pinned first so that transformers does not pull a CUDA build.
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q "transformers>=4.45" safetensors numpy
"$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
