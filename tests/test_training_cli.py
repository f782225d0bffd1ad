"""train.py as a script: a tiny run end to end, --print-config, one-line errors with exit code 2;
and nothing under tests/ or benchmarks/ imports train.py."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from coat_jax.training import config_io, schema

REPO = Path(__file__).resolve().parents[1]
MINI = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", "model.num_heads=4",
    "model.num_kv_heads=2", "model.max_seq_len=32", "model.dtype=float32", "data.vocab_size=512",
    "data.corpus_max_bytes=150000", "data.seq_len=32", "data.batch_size=8", "data.eval_batches=1",
    "optimizer.warmup=1", "run.log_every=2", "run.eval_every=0", "run.plot=false",
    "mesh.data=1", "checkpoint.async_save=false", 'run.compile_cache=""',
]


def train_py(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(REPO))
  return subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


def sets(items):
  return [a for item in items for a in ("--set", item)]


def test_main_runs_a_tiny_config_end_to_end(tmp_path):
  out = tmp_path / "run"
  proc = train_py("--no-progress", "--steps", "4", "--out-dir", str(out),
                  *sets(MINI + [f"data.cache_dir={tmp_path / 'cache'}"]))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "[done] step 4/4" in proc.stdout
  summary = json.loads((out / "summary.json").read_text())
  assert summary["step"] == 4 and summary["train_loss_last"] > 0
  steps = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()]
  assert steps[0] == 1 and steps[-1] == 4
  assert schema.load(out / "config.yaml").run.steps == 4


@pytest.mark.parametrize("name", ["tiny", "llama-125m"])
def test_print_config(name):
  proc = train_py("--config", str(REPO / "configs" / f"{name}.yaml"), "--set", "run.steps=7",
                  "--set", "optimizer.lr=1e-3", "--print-config")
  assert proc.returncode == 0, proc.stderr
  cfg = schema.from_dict(config_io.parse_yaml(proc.stdout))
  assert cfg.run.steps == 7 and cfg.optimizer.lr == 0.001 and cfg.model.preset == name


def test_bad_input_is_one_line_and_exit_code_2(tmp_path):
  bad_yaml = tmp_path / "bad.yaml"
  bad_yaml.write_text("optimizer:\n  lrr: 0.1\n")
  cases = [
      (["--config", str(bad_yaml)], rf"config file {re.escape(str(bad_yaml))}: .*'optimizer.lrr'.*did you mean 'lr'"),
      (["--set", "run.steps=ten"], r"--set run.steps=ten: config key 'run.steps' must be an int"),
      (["--config", str(bad_yaml), "--set", "optimizer.b3=1"], rf"config file {re.escape(str(bad_yaml))}"),
      (["--set", "modle.num_layers=2"], r"--set modle.num_layers=2: unknown config key 'modle'.*'model'"),
      (["--config", str(tmp_path / "nope.yaml")], "config file not found"),
      (["--set", "data.kind=tokens"], r"--set data.kind=tokens: .*needs 'data.paths'"),
      (["--set", "data.paths=[a.npy]"], r"--set data.paths=\[a.npy\]: .*data.kind='stdlib' .*reads none"),
  ]
  for args, pattern in cases:
    proc = train_py(*args, "--print-config")
    assert proc.returncode == 2, (args, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, proc.stderr[-2000:])
    assert re.search(pattern, lines[0]), (args, lines[0])


def test_a_bad_kernel_override_is_one_line_and_exit_code_2(tmp_path, monkeypatch):
  """COAT_JAX_KERNELS, the debugging override of the kernel backend: a bad value stops the run
  before anything is written, with one line naming the variable."""
  monkeypatch.setenv("COAT_JAX_KERNELS", "quantize=turbo")
  out = tmp_path / "run"
  proc = train_py("--no-progress", "--steps", "1", "--out-dir", str(out),
                  *sets(MINI + [f"data.cache_dir={tmp_path / 'cache'}"]))
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      "error: COAT_JAX_KERNELS: unknown kernel backend 'quantize=turbo'"), proc.stderr[-2000:]
  assert not out.exists()


def test_nothing_imports_train_py():
  """train.py is the command line only: the library is coat_jax.training."""
  pattern = re.compile(r"^\s*(import\s+train\b|from\s+train\s+import\b)|importlib.*[\"']train[\"']",
                       re.M)
  offenders = [str(p.relative_to(REPO)) for folder in ("tests", "benchmarks", "coat_jax", "scripts")
               for p in sorted((REPO / folder).rglob("*.py")) if pattern.search(p.read_text())]
  assert not offenders, f"these files import train.py: {offenders}"
  # The pattern itself catches both spellings (so the check above can fail).
  assert pattern.search("import train\n") and pattern.search("  from train import run\n")
  assert not pattern.search("import training\nfrom coat_jax.training import loop\n")
