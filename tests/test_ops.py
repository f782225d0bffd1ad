"""Ops in three precision modes vs float32 references; saved residual bytes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import memory, ops

MODES = ("bf16", "fp8_linear", "coat")


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _cos(a, b):
  a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
  return a @ b / (np.linalg.norm(a) * np.linalg.norm(b))


def _nbytes(res):
  return sum(int(np.prod(s)) * d.itemsize for s, d in res)


@pytest.mark.parametrize("mode", MODES)
def test_linear_matches_f32(mode, rng):
  x = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64, 32)) * 0.1, jnp.bfloat16)
  ct = jnp.asarray(rng.standard_normal((2, 16, 32)), jnp.bfloat16)
  ref = lambda x, w: x.astype(jnp.float32) @ w.astype(jnp.float32)
  y, pb = jax.vjp(lambda x, w: ops.linear(x, w, mode=mode), x, w)
  yr, pbr = jax.vjp(ref, x, w)
  dx, dw = pb(ct)
  dxr, dwr = pbr(ct.astype(jnp.float32))
  assert y.dtype == jnp.bfloat16 and y.shape == (2, 16, 32)
  tol = 0.01 if mode == "bf16" else 0.08
  errs = (_rel(y, yr), _cos(dx, dxr), _cos(dw, dwr))
  print(mode, errs)
  assert errs[0] < tol and np.isfinite(errs).all()
  assert errs[1] > (0.9999 if mode == "bf16" else 0.99) and errs[2] > (0.9999 if mode == "bf16" else 0.99)


def test_linear_saved_residuals(rng):
  x = jnp.asarray(rng.standard_normal((4, 16, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
  coat = memory.saved_residuals(lambda x, w: ops.linear(x, w, mode="coat"), x, w)
  assert _nbytes(coat) == x.size + 4
  fp8l = memory.saved_residuals(lambda x, w: ops.linear(x, w, mode="fp8_linear"), x, w,
                                exclude_args=False)
  assert (x.shape, np.dtype(jnp.bfloat16)) in fp8l


def test_rmsnorm_and_shared_x_q(rng):
  x = jnp.asarray(rng.standard_normal((4, 16, 64)) * 3, jnp.bfloat16)
  s = jnp.asarray(1 + 0.1 * rng.standard_normal(64), jnp.float32)
  w = jnp.asarray(rng.standard_normal((3, 64, 32)) * 0.1, jnp.bfloat16)
  def ref(x, s):
    x = x.astype(jnp.float32)
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * s
  ct = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  yr, pbr = jax.vjp(ref, x, s)
  gr = pbr(ct)
  for mode in MODES:
    y, pb = jax.vjp(lambda x, s: ops.rmsnorm(x, s, mode=mode)[0], x, s)
    g = pb(ct.astype(jnp.bfloat16))
    errs = (_rel(y, yr), _cos(g[0], gr[0]), _cos(g[1], gr[1]))
    print("rmsnorm", mode, errs)
    assert errs[0] < 0.01 and errs[1] > 0.99 and errs[2] > 0.99
    assert (ops.rmsnorm(x, s, mode=mode)[1] is None) == (mode != "coat")
  res = memory.saved_residuals(lambda x, s: ops.rmsnorm(x, s, mode="coat")[0], x, s)
  assert _nbytes(res) == x.size * (1 + 4 / 16) + 4 * x.size // 64
  def block(x, s, w):
    y, yq = ops.rmsnorm(x, s, mode="coat")
    return sum(ops.linear(y, w[i], mode="coat", x_q=yq) for i in range(3))
  res = memory.saved_residuals(block, x, s, w)
  fp8 = [r for r in res if r[1] == np.dtype(jnp.float8_e4m3fn)]
  assert len(fp8) == 2, res  # per-group x and the shared y_q, once.


@pytest.mark.parametrize("mode", MODES)
def test_swiglu(mode, rng):
  g = jnp.asarray(rng.standard_normal((4, 16, 64)), jnp.bfloat16)
  u = jnp.asarray(rng.standard_normal((4, 16, 64)), jnp.bfloat16)
  ct = jnp.asarray(rng.standard_normal(g.shape), jnp.bfloat16)
  ref = lambda g, u: jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)
  h, pb = jax.vjp(lambda g, u: ops.swiglu(g, u, mode=mode)[0], g, u)
  hr, pbr = jax.vjp(ref, g, u)
  d, dr = pb(ct), pbr(ct.astype(jnp.float32))
  errs = (_rel(h, hr), _cos(d[0], dr[0]), _cos(d[1], dr[1]))
  print("swiglu", mode, errs)
  assert errs[0] < 0.01 and errs[1] > 0.99 and errs[2] > 0.99
  if mode == "coat":
    res = memory.saved_residuals(lambda g, u: ops.swiglu(g, u, mode=mode)[0], g, u)
    assert _nbytes(res) == 2 * g.size * (1 + 4 / 16)


def test_rope_and_attention(rng):
  cos, sin = ops.rope_frequencies(8, 32, scaling=dict(factor=8.0, low_freq_factor=1.0,
      high_freq_factor=4.0, original_max_position_embeddings=16))
  assert cos.shape == (32, 4) and np.allclose(cos**2 + sin**2, 1, atol=1e-5)
  x = jnp.asarray(rng.standard_normal((2, 8, 2, 8)), jnp.float32)
  y = ops.apply_rope(x, cos, sin)
  np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
  np.testing.assert_allclose(y[:, 0], x[:, 0], rtol=1e-6)
  q = jnp.asarray(rng.standard_normal((1, 8, 4, 8)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 8, 2, 8)), jnp.float32)
  o = ops.attention(q, k, k)
  kk = jnp.repeat(k, 2, axis=2)
  sc = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(8)
  sc = jnp.where(np.tril(np.ones((8, 8), bool)), sc, -jnp.inf)
  ref = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(sc, -1), kk)
  np.testing.assert_allclose(o, ref, atol=1e-5)
  assert ops.residual_add(x, x).shape == x.shape


def test_bad_inputs():
  x = jnp.ones((2, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match="mode"):
    ops.linear(x, jnp.ones((8, 4), jnp.bfloat16), mode="fp4")
  with pytest.raises(ValueError, match=r"\(2, 8\)"):
    ops.linear(x, jnp.ones((4, 4), jnp.bfloat16), mode="bf16")
  with pytest.raises(ValueError):
    ops.rmsnorm(x, jnp.ones(8), mode="nope")
