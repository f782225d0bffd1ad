"""Gradient accumulation equals one step over the whole batch (coat_jax/training/accumulate.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax.training.accumulate import accumulated_value_and_grad, split_microbatches

SEED = 20261123


def _loss(params, state, batch):
  """A small two-layer MLP regression, mean over the batch rows; state counts the calls."""
  x, y = batch[:, :-1], batch[:, -1]
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  pred = h @ params["w2"]
  return jnp.mean((pred[:, 0] - y) ** 2), state + 1


def _setup(b=24, d=8, h=16):
  rng = np.random.default_rng(SEED)
  print(f"seed {SEED}")
  params = {"w1": jnp.asarray(rng.normal(size=(d, h)), jnp.float32),
            "b1": jnp.asarray(rng.normal(size=(h,)), jnp.float32),
            "w2": jnp.asarray(rng.normal(size=(h, 1)), jnp.float32)}
  batch = jnp.asarray(rng.normal(size=(b, d + 1)), jnp.float32)
  return params, batch


@pytest.mark.parametrize("k", [2, 3, 8])
def test_accumulated_equals_full_batch(k):
  params, batch = _setup()
  (loss_ref, _), g_ref = jax.jit(jax.value_and_grad(_loss, has_aux=True))(params, 0, batch)
  (loss, calls), g = jax.jit(accumulated_value_and_grad(_loss, k))(params, 0, batch)
  assert int(calls) == k
  np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6)
  for name in params:
    a, r = np.asarray(g[name], np.float64), np.asarray(g_ref[name], np.float64)
    assert np.all(np.isfinite(a))
    rel = np.linalg.norm(a - r) / np.linalg.norm(r)
    assert rel < 1e-6, (name, rel)


def test_one_microbatch_is_bit_identical():
  params, batch = _setup()
  ref = jax.jit(jax.value_and_grad(_loss, has_aux=True))(params, 0, batch)
  out = jax.jit(accumulated_value_and_grad(_loss, 1))(params, 0, batch)
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_accumulator_close_and_param_dtype_kept():
  params, batch = _setup()
  (_, _), g_ref = jax.value_and_grad(_loss, has_aux=True)(params, 0, batch)
  (_, _), g = accumulated_value_and_grad(_loss, 4, "bfloat16")(params, 0, batch)
  for name in params:
    assert g[name].dtype == jnp.float32
    r = np.asarray(g_ref[name], np.float64)
    rel = np.linalg.norm(np.asarray(g[name], np.float64) - r) / np.linalg.norm(r)
    assert 0 < rel < 2e-2, (name, rel)  # bf16 sums: ~2^-8 per add, never exact here


def test_microbatches_are_strided_rows():
  batch = jnp.arange(12 * 3).reshape(12, 3)
  micro = np.asarray(split_microbatches(batch, 4))
  assert micro.shape == (4, 3, 3)
  for i in range(4):
    np.testing.assert_array_equal(micro[i], np.asarray(batch)[i::4])


@pytest.mark.parametrize("bad", [0, -1, 5, 2.0, True])
def test_bad_microbatch_counts_are_rejected(bad):
  params, batch = _setup(b=24)
  with pytest.raises(ValueError, match="microbatch"):
    accumulated_value_and_grad(_loss, bad)(params, 0, batch)


def test_bad_accum_dtype():
  with pytest.raises(ValueError, match="accum_dtype"):
    accumulated_value_and_grad(_loss, 2, "float16")
