"""training.build.lr_schedule: warmup as configured, decay to the end of the run."""
import numpy as np
import pytest

from coat_jax.training import build, schema


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_warmup_then_decay_to_the_floor(kind):
  opt = schema.OptimizerConfig(lr=3e-4, warmup=10, schedule=kind, min_lr_ratio=0.1)
  f = build.lr_schedule(opt, 100)
  np.testing.assert_allclose([float(f(0)), float(f(5)), float(f(10))], [0.0, 1.5e-4, 3e-4],
                             rtol=1e-6)
  end = {"cosine": 3e-5, "linear": 3e-5, "constant": 3e-4}[kind]
  np.testing.assert_allclose(float(f(100)), end, rtol=1e-6)
  lrs = [float(f(s)) for s in range(10, 101)]
  assert all(a >= b for a, b in zip(lrs, lrs[1:]))   # never rises after the warmup


def test_a_run_shorter_than_its_warmup_stays_in_the_warmup():
  """A 3-step run of a recipe with 2000 warmup steps takes lr * step / 2000, not the full lr by
  its third step (which made short runs' losses jump)."""
  opt = schema.OptimizerConfig(lr=3e-4, warmup=2000, schedule="cosine", min_lr_ratio=0.1)
  f = build.lr_schedule(opt, 3)
  np.testing.assert_allclose([float(f(s)) for s in range(4)],
                             [0.0, 1.5e-7, 3e-7, 4.5e-7], rtol=1e-5)
