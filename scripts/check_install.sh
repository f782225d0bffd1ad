#!/usr/bin/env bash
# Installs coat-jax as a user does, `pip install .` (not editable), into a fresh virtual
# environment outside the source tree, at the GPU image's versions (constraints.txt; pip's cache
# makes it quick), then, from a directory outside the source tree, runs the README's Python
# examples and finds a shipped config by name through the installed `coat-train`.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
.venv/bin/python -m venv "$WORK/venv"
# pip's output goes to a log, shown only if the install fails (some machines' pip configurations
# warn about every missing local index directory).
"$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt "$REPO" \
  >"$WORK/pip.log" 2>&1 || { cat "$WORK/pip.log" >&2; echo "error: pip install . failed" >&2; exit 1; }
.venv/bin/python scripts/readme_examples.py "$WORK/examples" >/dev/null
cd "$WORK"
for example in examples/*.py; do
  JAX_PLATFORMS=cpu "$WORK/venv/bin/python" "$example" >/dev/null || {
    echo "error: $example (README.md) failed in a fresh install" >&2; exit 1; }
done
"$WORK/venv/bin/coat-train" --config llama2-7b --print-config >/dev/null
echo "fresh install: pip install . and the README's examples ran outside the source tree"
