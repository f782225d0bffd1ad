"""coat_adamw_apply(master_rounding="stochastic"): bfloat16 master weights keep small updates."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax.optim import coat_adamw, coat_adamw_apply

SEED = 4242
LR = 1e-3  # below half a bfloat16 ulp of 1.0 (2^-8 = 0.0039): lost by nearest rounding


def _setup(dtype):
  rng = np.random.default_rng(SEED)
  print(f"seed {SEED}")
  params = {"w": jnp.asarray(1.0 + 0.01 * rng.random((64, 128)), dtype)}
  grads = {"w": jnp.asarray(rng.normal(size=(64, 128)), jnp.float32)}
  state = coat_adamw(LR, weight_decay=0.0).init(params)
  return params, grads, state


def _step(rounding, params, grads, state):
  apply = coat_adamw_apply(LR, weight_decay=0.0, master_rounding=rounding)
  return jax.jit(apply)(grads, state, params)


def test_stochastic_rounding_keeps_small_updates_in_expectation():
  params, grads, state = _setup(jnp.bfloat16)
  near, _ = _step("nearest", params, grads, state)
  sr, sr_state = _step("stochastic", params, grads, state)
  p0 = np.asarray(params["w"], np.float64)
  assert near["w"].dtype == jnp.bfloat16 and sr["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(near["w"], np.float64), p0)  # every update lost
  # The float32 step of the same params: Adam's first step moves each weight by lr * sign(g).
  ref32, _ = _step("nearest", {"w": params["w"].astype(jnp.float32)}, grads, state)
  want = np.asarray(ref32["w"], np.float64) - p0
  got = np.asarray(sr["w"], np.float64) - p0
  assert np.all(np.isfinite(got))
  moved = np.mean(got != 0)
  assert 0.05 < moved < 0.5, moved  # about lr / ulp of the weights
  # Unbiased: the mean signed change equals the float32 one within 5 standard errors.
  se = np.std(got - want) / np.sqrt(got.size)
  assert abs(np.mean(got - want)) < 5 * se + 1e-7, (np.mean(got), np.mean(want), se)
  assert abs(np.mean(got * np.sign(want)) / np.mean(np.abs(want)) - 1.0) < 0.1
  np.testing.assert_array_equal(np.asarray(sr_state.mu["w"].data, np.float32),
                                np.asarray(_step("nearest", params, grads, state)[1].mu["w"].data,
                                           np.float32))  # the moments do not depend on rounding


def test_float32_params_ignore_stochastic_rounding():
  params, grads, state = _setup(jnp.float32)
  near, _ = _step("nearest", params, grads, state)
  sr, _ = _step("stochastic", params, grads, state)
  np.testing.assert_array_equal(np.asarray(near["w"]), np.asarray(sr["w"]))


def test_bad_rounding_name():
  with pytest.raises(ValueError, match="master_rounding"):
    coat_adamw_apply(LR, master_rounding="up")
