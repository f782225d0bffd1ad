"""ops.softmax_cross_entropy against optax's float32 form and a float64 reference: values,
gradients (relative L2 and direction), the gradient's dtype, NaN propagation, bad input, and
the float32 gradient buffer it avoids (compiled temp memory)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from coat_jax import ops

SEED = 20261124


@pytest.fixture
def rng():
  print(f"seed {SEED}")
  return np.random.default_rng(SEED)


def _inputs(rng, shape=(3, 5, 257), dtype=jnp.bfloat16, spread=4.0):
  logits = jnp.asarray(spread * rng.standard_normal(shape), dtype)
  labels = jnp.asarray(rng.integers(0, shape[-1], shape[:-1]), jnp.int32)
  return logits, labels


def _reference64(logits, labels, g):
  """Loss and gradient in float64 (numpy)."""
  z = np.asarray(logits, np.float64)
  m = z.max(-1, keepdims=True)
  lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
  y = np.asarray(labels)
  picked = np.take_along_axis(z, y[..., None], -1)[..., 0]
  p = np.exp(z - lse[..., None])
  onehot = np.arange(z.shape[-1]) == y[..., None]
  return lse - picked, np.asarray(g, np.float64)[..., None] * (p - onehot)


def _rel(a, b):
  a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_values_and_gradients_match_float64_and_optax(rng, dtype):
  logits, labels = _inputs(rng, dtype=dtype)
  g = jnp.asarray(rng.uniform(0.5, 1.5, labels.shape), jnp.float32)
  loss, pullback = jax.vjp(lambda z: ops.softmax_cross_entropy(z, labels), logits)
  (dz,) = pullback(g)
  ref_loss, ref_dz = _reference64(logits, labels, g)
  assert loss.dtype == jnp.float32 and dz.dtype == logits.dtype
  assert np.isfinite(np.asarray(loss)).all() and np.isfinite(np.asarray(dz, np.float32)).all()
  np.testing.assert_allclose(np.asarray(loss), ref_loss, rtol=1e-5, atol=1e-5)
  # the gradient: float32 math, rounded once to the logits' dtype
  tol = 1e-6 if dtype == jnp.float32 else 4e-3
  assert _rel(dz, ref_dz) < tol
  cos = np.dot(np.asarray(dz, np.float64).ravel(), ref_dz.ravel()) / (
      np.linalg.norm(np.asarray(dz, np.float64)) * np.linalg.norm(ref_dz))
  assert cos > 1 - 1e-5
  # optax's float32 form (what train.py used before): same loss, same gradient once rounded
  opt_loss, opt_pb = jax.vjp(lambda z: optax.softmax_cross_entropy_with_integer_labels(
      z.astype(jnp.float32), labels), logits)
  np.testing.assert_allclose(np.asarray(loss), np.asarray(opt_loss), rtol=1e-5, atol=1e-5)
  assert _rel(dz, opt_pb(g)[0]) < tol


def test_mean_loss_gradient_through_jit(rng):
  logits, labels = _inputs(rng, shape=(4, 1000))
  f = jax.jit(jax.value_and_grad(lambda z: ops.softmax_cross_entropy(z, labels).mean()))
  loss, dz = f(logits)
  ref_loss, ref_dz = _reference64(logits, labels, np.full(labels.shape, 1 / labels.size))
  np.testing.assert_allclose(float(loss), ref_loss.mean(), rtol=1e-5)
  assert _rel(dz, ref_dz) < 4e-3
  # each row's gradient sums to zero (softmax minus one-hot), up to bf16 rounding
  assert np.abs(np.asarray(dz, np.float64).sum(-1)).max() < 0.1 / labels.size


def test_nan_logit_gives_nan_loss_and_gradient(rng):
  logits, labels = _inputs(rng, shape=(2, 64))
  logits = logits.at[1, 7].set(jnp.nan)
  loss, pullback = jax.vjp(lambda z: ops.softmax_cross_entropy(z, labels), logits)
  (dz,) = pullback(jnp.ones_like(loss))
  assert np.isfinite(float(loss[0])) and np.isnan(float(loss[1]))
  assert np.isnan(np.asarray(dz[1], np.float32)).all() and np.isfinite(np.asarray(dz[0], np.float32)).all()


def test_bad_input_is_one_line_error(rng):
  logits, labels = _inputs(rng, shape=(2, 3, 16))
  with pytest.raises(ValueError, match="labels shape"):
    ops.softmax_cross_entropy(logits, labels[:, :2])
  with pytest.raises(ValueError, match="integers"):
    ops.softmax_cross_entropy(logits, labels.astype(jnp.float32))
  with pytest.raises(ValueError, match="floating"):
    ops.softmax_cross_entropy(labels[..., None].repeat(16, -1), labels)


def test_backward_needs_no_float32_gradient_buffer(rng):
  """Compiled (CPU) temp memory of the loss gradient: the optax form holds a float32 (N, V)
  gradient (4 bytes a logit) that this op never writes."""
  n, v = 256, 4096
  logits, labels = _inputs(rng, shape=(n, v))

  def temp_bytes(loss):
    f = jax.jit(jax.grad(lambda z: loss(z).mean()))
    return f.lower(logits).compile().memory_analysis().temp_size_in_bytes

  ours = temp_bytes(lambda z: ops.softmax_cross_entropy(z, labels))
  theirs = temp_bytes(lambda z: optax.softmax_cross_entropy_with_integer_labels(
      z.astype(jnp.float32), labels))
  print(f"temp bytes: ours {ours}, optax {theirs}, float32 (N, V) {4 * n * v}")
  assert theirs - ours >= 4 * n * v * 0.9, (ours, theirs)


def test_training_loss_reads_compute_dtype_logits(rng):
  """The train step's loss takes `Llama.logits` (bf16 here) instead of `Llama.__call__`'s float32
  copy: the same loss and gradients (the float32 copy adds no information and its gradient was
  rounded to bf16 anyway)."""
  from flax import nnx

  from coat_jax.models.llama import Llama, LlamaConfig
  cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1,
                    num_heads=4, num_kv_heads=4, max_seq_len=32, dtype="bfloat16").validate()
  graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 33)), jnp.int32)

  def loss(params, logits_of):
    model = nnx.merge(graphdef, params)
    return ops.softmax_cross_entropy(logits_of(model)(tokens[:, :-1]), tokens[:, 1:]).mean()

  def grad(logits_of):
    return jax.jit(jax.value_and_grad(lambda p: loss(p, logits_of)))

  compute = grad(lambda m: m.logits)
  float32 = grad(lambda m: m)          # Llama.__call__: float32 logits
  (l_bf, g_bf), (l_32, g_32) = compute(params), float32(params)
  assert jnp.dtype(nnx.merge(graphdef, params).logits(tokens[:, :-1]).dtype) == jnp.bfloat16
  assert np.isfinite(float(l_bf)) and float(l_bf) == float(l_32)
  for a, b in zip(jax.tree.leaves(g_bf), jax.tree.leaves(g_32)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
