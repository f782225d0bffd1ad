"""The benchmark scripts as the modules `python -m benchmarks.KIND.NAME` runs (benchmarks/README.md),
imported by name: `load("bench_e2e")` is benchmarks/step/bench_e2e.py."""
import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def path(name: str) -> Path:
  """benchmarks/**/NAME.py (one file of that name)."""
  (found,) = (REPO / "benchmarks").rglob(f"{name}.py")
  return found


def load(name: str):
  return importlib.import_module(".".join(path(name).relative_to(REPO).with_suffix("").parts))
