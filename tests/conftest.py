"""Test set-up: 8 simulated CPU devices (for mesh tests) and float64 references available.

XLA_FLAGS must be set before jax is imported, so it happens here, at collection time.
"""
import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng():
  """A fresh numpy Generator per test (seeded from the OS: inputs differ between runs)."""
  seed = np.random.SeedSequence().entropy % (2**32)
  print(f"numpy seed {seed}")
  return np.random.default_rng(seed)


@pytest.fixture
def key(rng):
  return jax.random.key(int(rng.integers(0, 2**31 - 1)))
