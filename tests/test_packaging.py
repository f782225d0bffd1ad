"""The package as installed: one version, dependency ranges around the tested pins, the
`coat-train` entry point, and the shipped configs found by name from any directory."""
import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import coat_jax
from coat_jax import errors
from coat_jax.training import cli

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PINNED = ("jax", "flax", "optax", "orbax-checkpoint")


def _pins() -> dict[str, str]:
  """constraints.txt as {name: version}."""
  out = {}
  for line in (REPO / "constraints.txt").read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
      name, version = line.split("==")
      out[name.strip()] = version.strip()
  return out


def test_one_version_in_the_code_the_metadata_and_the_changelog():
  assert PYPROJECT["project"]["dynamic"] == ["version"]
  assert "version" not in PYPROJECT["project"]
  assert importlib.metadata.version("coat-jax") == coat_jax.__version__
  assert f"## [{coat_jax.__version__}]" in (REPO / "CHANGELOG.md").read_text()


def test_license_field_and_file():
  assert PYPROJECT["project"]["license"] == "Apache-2.0"
  assert "Apache License" in (REPO / "LICENSE").read_text()
  assert importlib.metadata.metadata("coat-jax")["License-Expression"] == "Apache-2.0"


def test_ranges_hold_the_tested_pins_and_the_environment_has_the_pins():
  """pyproject allows ranges (the package installs beside other JAX libraries); constraints.txt
  pins the GPU image's versions inside them, and this environment (CI's) has exactly those."""
  reqs = {r.name: r for r in map(Requirement, PYPROJECT["project"]["dependencies"])}
  pins = _pins()
  for name in PINNED:
    spec = reqs[name].specifier
    assert not any(s.operator == "==" for s in spec), f"{name} is pinned exactly in pyproject"
    assert any(s.operator == "<" for s in spec), f"{name} has no upper bound"
    assert spec.contains(pins[name]), (name, str(spec), pins[name])
    assert importlib.metadata.version(name) == pins[name], name


def test_a_range_that_excludes_the_pin_is_caught():
  assert not Requirement("jax>=0.12,<0.13").specifier.contains(_pins()["jax"])


def test_configs_resolve_by_name_path_or_configs_path_from_any_directory(tmp_path, monkeypatch):
  shipped = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
  assert cli.shipped_configs() == shipped and "tiny" in shipped and "llama2-7b" in shipped
  monkeypatch.chdir(tmp_path)
  assert cli.load_config(cli.parse_args([])).model.preset == "tiny"   # the embedded default
  for name in ("llama2-7b", "llama2-7b.yaml", "configs/llama2-7b.yaml"):
    path = cli.config_path(name)
    assert path.read_text() == (REPO / "configs" / "llama2-7b.yaml").read_text(), name
  own = tmp_path / "tiny.yaml"   # a file of the user's own wins over the shipped name
  own.write_text("run:\n  steps: 3\n")
  assert cli.config_path("tiny.yaml") == Path("tiny.yaml")
  with pytest.raises(errors.BadInputError, match=r"config file not found: lama2-7b .*llama2-7b"):
    cli.config_path("lama2-7b")
  with pytest.raises(errors.BadInputError, match="config file not found"):
    cli.config_path("elsewhere/llama2-7b.yaml")   # a path to another directory is not a name


def test_coat_train_entry_point_runs_from_outside_the_repository(tmp_path):
  """The installed console script: a shipped config by name, and a one-line error (exit 2)."""
  (ep,) = [e for e in importlib.metadata.entry_points(group="console_scripts")
           if e.name == "coat-train"]
  assert ep.value == "coat_jax.training.cli:entry_point"
  exe = Path(sys.executable).parent / "coat-train"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([str(exe), "--config", "olmo-1b", "--print-config"], cwd=tmp_path,
                        env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "preset: olmo-1b" in proc.stdout
  proc = subprocess.run([str(exe), "--config", "nope"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and proc.stderr.startswith("error: config file not found: nope")
