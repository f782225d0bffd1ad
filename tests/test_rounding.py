"""Stochastic rounding to bfloat16 (coat_jax/rounding.py) against float64 expectations."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from coat_jax.rounding import hash_bits, round_to, stochastic_round_bf16

SEED = 1123


def _neighbours(x):
  """(lo, hi) bfloat16 neighbours of float32 x (as float64), lo <= x < hi, by truncation."""
  u = np.asarray(x, np.float32).view(np.uint32)
  lo = (u & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
  hi = ((u & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32).astype(np.float64)
  return np.where(x >= 0, lo, hi), np.where(x >= 0, hi, lo)


def test_results_are_neighbours_and_unbiased():
  rng = np.random.default_rng(SEED)
  print(f"seed {SEED}")
  x = rng.normal(size=64).astype(np.float32) * np.float32(3.0)
  n = 4000
  xj = jnp.asarray(x)
  draw = jax.jit(jax.vmap(lambda s: round_to(xj, jnp.bfloat16, "stochastic", step=s, seed=7)))
  draws = np.asarray(draw(jnp.arange(n, dtype=jnp.uint32)), np.float64)   # steps 0 .. n-1
  lo, hi = _neighbours(x)
  assert np.all((draws == lo) | (draws == hi))
  p_up = (x.astype(np.float64) - lo) / (hi - lo)
  frac_up = np.mean(draws == hi, axis=0)
  # Binomial standard error of a mean of n draws: sqrt(p(1-p)/n) <= 0.008; 5 sigma.
  assert np.max(np.abs(frac_up - p_up)) < 0.04
  bias = np.mean(draws, axis=0) - x.astype(np.float64)
  assert np.max(np.abs(bias) / (hi - lo)) < 0.04


def test_exact_values_stay_exact_and_specials():
  vals = np.array([0.0, -0.0, 1.0, -2.5, 65280.0, np.inf, -np.inf, np.nan], np.float32)
  bits = jnp.full(vals.shape, 0xFFFF, jnp.uint32)  # the largest possible push upwards
  out = np.asarray(stochastic_round_bf16(jnp.asarray(vals), bits), np.float64)
  np.testing.assert_array_equal(out[:5], vals[:5].astype(np.float64))
  assert np.signbit(out[1])
  assert out[5] == np.inf and out[6] == -np.inf and np.isnan(out[7])


def test_saturates_instead_of_overflowing():
  big = np.float32(ml_dtypes.finfo(ml_dtypes.bfloat16).max) * np.float32(1.001)
  out = np.asarray(stochastic_round_bf16(jnp.asarray([big, -big]), jnp.full((2,), 0xFFFF,
                                                                            jnp.uint32)),
                   np.float64)
  bmax = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
  np.testing.assert_array_equal(out, [bmax, -bmax])


def test_small_updates_survive_in_expectation():
  """w + 1e-4 with w = 1 is lost by nearest rounding (ulp 2^-7) but kept on average by SR."""
  w = jnp.ones((20000,), jnp.float32) + jnp.float32(1e-4)
  nearest = np.asarray(round_to(w, jnp.bfloat16), np.float64)
  sr = np.asarray(round_to(w, jnp.bfloat16, "stochastic", step=3, seed=1), np.float64)
  assert np.all(nearest == 1.0)
  assert abs(np.mean(sr) - 1.0001) < 2e-5


def test_hash_bits_range_and_dependence():
  idx = jnp.arange(4096, dtype=jnp.uint32)
  a = np.asarray(hash_bits(idx, 5, 0))
  assert a.max() < 2**16 and len(np.unique(a)) > 3000
  for other in (hash_bits(idx, 6, 0), hash_bits(idx, 5, 1)):
    assert np.mean(np.asarray(other) == a) < 0.01


def test_bad_rounding_name():
  with pytest.raises(ValueError, match="rounding"):
    round_to(jnp.ones(3), jnp.bfloat16, "up")
