"""The README's Python examples run as a reader copies them (CPU, a directory of their own), and
the training-loop example trains: finite losses that fall. scripts/check_install.sh runs the same
files against a fresh `pip install .`."""
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("readme_examples",
                                              REPO / "scripts" / "readme_examples.py")
readme_examples = importlib.util.module_from_spec(spec)
spec.loader.exec_module(readme_examples)

BLOCKS = readme_examples.python_blocks((REPO / "README.md").read_text())


def test_blocks_are_found_by_fence_and_no_run_ones_skipped():
  text = ("# t\n```bash\necho hi\n```\n\n```python\nx = 1\n```\n"
          "```python no-run\nraise SystemExit(1)\n```\n```py\ny = 2\n```\n```python\nz = 3\n```\n")
  assert readme_examples.python_blocks(text) == [(6, "x = 1\n"), (15, "z = 3\n")]


def test_the_readme_has_the_training_loop_example():
  """The example a user copies: coat_adamw inside nnx.Optimizer, a jitted step."""
  loops = [code for _, code in BLOCKS if "nnx.Optimizer(" in code]
  assert len(loops) == 1
  for needle in ("coat_jax.coat_adamw(", "@nnx.jit", "nnx.value_and_grad", "optimizer.update("):
    assert needle in loops[0], needle


def _losses(stdout: str) -> list[float]:
  """The `step loss` lines the training-loop example prints."""
  return [float(line.split()[1]) for line in stdout.splitlines()
          if len(line.split()) == 2 and line.split()[0].isdigit()]


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_readme_python_block_runs(line, code, tmp_path):
  script = tmp_path / "example.py"
  script.write_text(code)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  env.pop("PYTHONPATH", None)   # the installed package, as a reader has it
  proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, f"README.md line {line}:\n{proc.stderr[-3000:]}"
  assert not re.search(r"\bnan\b", proc.stdout, re.I), proc.stdout
  if "nnx.Optimizer(" in code:
    losses = _losses(proc.stdout)
    assert len(losses) >= 3 and all(map(math.isfinite, losses)), proc.stdout
    assert losses[-1] < losses[0], losses
