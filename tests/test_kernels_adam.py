"""Fused COAT AdamW step kernel vs `coat_jax.optim.adam_step_reference` (CPU interpret mode)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import expansion, kernels, optim
from pallas_kernels import adam_step as pk

INTERPRET = jax.default_backend() != "gpu"
HYPER = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)


def _state(rng, shape, m_format, v_format, expand):
  p = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  g = jnp.asarray(rng.standard_normal(shape) * np.exp2(rng.integers(-8, 2, shape)), jnp.float32)
  m0 = rng.standard_normal(shape) * 1e-3 * np.exp2(rng.integers(-6, 3, shape))
  v0 = (rng.standard_normal(shape) * 1e-3) ** 2 * np.exp2(rng.integers(-4, 4, shape))
  m = expansion.quantize_expanded(jnp.asarray(m0, jnp.float32), m_format, 128, 16, expand)
  v = expansion.quantize_expanded(jnp.asarray(v0, jnp.float32), v_format, 128, 16, expand)
  return p, g, m, v


def _compare(got, want, min_equal=0.999):
  (gp, gm, gv), (wp, wm, wv) = got, want
  # Params: the old moments are dequantized with exp2/log2 that differ from XLA's by ulps, so
  # m / denom can differ by ~1e-6 relative; times lr (1e-3) that is far below 2e-6 absolute.
  np.testing.assert_allclose(np.asarray(gp), np.asarray(wp), rtol=5e-6, atol=2e-6)
  for a, b in ((gm, wm), (gv, wv)):
    # exp2/log2 differ from XLA's in the last ulps, so the dequantized old moments (and their new
    # group maxima) can differ by a few ulps; k (a floor of a log ratio) by one step, rarely.
    ka, kb = np.asarray(a.k_code, np.int32), np.asarray(b.k_code, np.int32)
    assert np.abs(ka - kb).max() <= 1 and (ka == kb).mean() >= 0.95
    np.testing.assert_allclose(np.asarray(a.amax), np.asarray(b.amax), rtol=5e-5)
    qa = np.asarray(jax.lax.bitcast_convert_type(a.data, jnp.uint8)).astype(np.int32)
    qb = np.asarray(jax.lax.bitcast_convert_type(b.data, jnp.uint8)).astype(np.int32)
    assert (qa == qb).mean() >= min_equal, (qa != qb).mean()
    assert np.abs(qa - qb).max() <= 1   # off by one code at most (same sign)


@pytest.mark.parametrize("shape,m_format,v_format,expand", [
    ((3, 256), "e4m3", "e4m3", True),
    ((37, 128), "e4m3", "e5m2", True),    # 37 groups: one group per program
    ((2, 5, 384), "e4m3", "e4m3", False),
])
def test_adam_step_matches_reference(rng, shape, m_format, v_format, expand):
  p, g, m, v = _state(rng, shape, m_format, v_format, expand)
  args = dict(HYPER, count=jnp.int32(7), m_format=m_format, v_format=v_format, group_size=128,
              expand=expand, expand_min=16)
  want = jax.jit(functools.partial(optim.adam_step_reference, **args))(p, g, m, v)
  got = pk.adam_step(p, g, m, v, interpret=INTERPRET, block=16, **args)
  _compare(got, want)
  assert not np.allclose(np.asarray(got[0]), np.asarray(p))   # the step moved the params


def test_adam_step_zero_group_and_dispatch(rng):
  p, g, m, v = _state(rng, (4, 128), "e4m3", "e4m3", True)
  g = g.at[1].set(0.0)
  m = m._replace(data=m.data.at[1].set(0.0))
  v = v._replace(data=v.data.at[1].set(0.0))    # all-zero group: k = 1, finite amax
  args = dict(HYPER, count=jnp.int32(1), m_format="e4m3", v_format="e4m3", group_size=128,
              expand=True, expand_min=16)
  want = jax.jit(functools.partial(optim.adam_step_reference, **args))(p, g, m, v)
  with kernels.backend("pallas"):
    got = jax.jit(functools.partial(kernels.coat_adam_step, **args))(p, g, m, v)
    jaxpr = str(jax.make_jaxpr(functools.partial(kernels.coat_adam_step, **args))(p, g, m, v))
  assert "pallas_call" in jaxpr
  _compare(got, want)
  assert int(got[1].k_code[1, 0]) == 16 and np.isfinite(np.asarray(got[1].amax)).all()


def test_unsupported_shape_falls_back(rng):
  p, g, m, v = _state(rng, (3, 200), "e4m3", "e4m3", True)   # 200 % 128 != 0
  args = dict(HYPER, count=jnp.int32(3), m_format="e4m3", v_format="e4m3", group_size=128,
              expand=True, expand_min=16)
  with pytest.raises(ValueError, match="divisible by 128"):
    pk.adam_step(p, g, m, v, interpret=True, **args)
  want = jax.jit(functools.partial(optim.adam_step_reference, **args))(p, g, m, v)
  with kernels.backend("pallas"):
    got = jax.jit(functools.partial(kernels.coat_adam_step, **args))(p, g, m, v)
  _compare(got, want, min_equal=1.0)


@pytest.mark.gpu
def test_gpu_adam_step_compiled(rng):
  for fmts in (("e4m3", "e4m3"), ("e4m3", "e5m2")):
    p, g, m, v = _state(rng, (512, 1024), *fmts, True)
    args = dict(HYPER, count=jnp.int32(11), m_format=fmts[0], v_format=fmts[1], group_size=128,
                expand=True, expand_min=16)
    want = jax.jit(functools.partial(optim.adam_step_reference, **args))(p, g, m, v)
    _compare(pk.adam_step(p, g, m, v, **args), want)
