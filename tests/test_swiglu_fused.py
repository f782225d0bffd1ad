"""SwiGLU's fused forward (pallas_kernels/quantize/swiglu_mgpu.py, `kernels.swiglu_quantize`) against a
numpy reference written from the spec (float64 for h, float32 for the per-group codes, as the
per-group quantize kernel promises), in GPU interpret mode on CPU; through the dispatch and
`ops.swiglu` against the unfused path (`linear_ablation.ablation(swiglu_quantize="separate")`)."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from coat_jax import kernels, ops
from coat_jax.ops import linear_ablation
from pallas_kernels.quantize import swiglu_mgpu as sm
from tests.test_kernels_quantize_mgpu import E4M3, FLOOR, _code_steps, _np_per_group, _same_codes

INTERPRET = dict(interpret=True, block=1024, max_ctas=2)


def _gate_up(shape, seed, dtype=jnp.bfloat16):
  print(f"seed {seed} shape {shape}")
  rng = np.random.default_rng(seed)
  g = rng.standard_normal(shape) * 3.0 * np.exp2(rng.uniform(-4, 4, shape[:-1] + (1,)))
  u = rng.standard_normal(shape) * np.exp2(rng.uniform(-4, 4, shape[:-1] + (1,)))
  return jnp.asarray(g, dtype), jnp.asarray(u, dtype)


def _h64(g, u):
  g64, u64 = np.asarray(g, np.float64), np.asarray(u, np.float64)
  return g64 / (1.0 + np.exp(-g64)) * u64


def _run(g, u, **kw):
  return sm.swiglu_quantize(g, u, group_size=16, out_dtype=E4M3[0], fmax=E4M3[1], floor=FLOOR,
                            **{**INTERPRET, **kw})


@pytest.mark.parametrize("shape,seed", [((4, 64, 64), 0), ((2, 32, 256), 1)])
def test_kernel_matches_numpy(shape, seed):
  g, u = _gate_up(shape, seed)
  h, hmax, gq, gs, uq, us = _run(g, u)
  ref = _h64(g, u)
  assert h.dtype == g.dtype and h.shape == shape and hmax.shape == shape[:-1] + (shape[-1] // 16,)
  # h: float32 math rounded once to bfloat16 (2^-8 relative) plus float32's own error
  err = np.abs(np.asarray(h, np.float64) - ref)
  assert np.all(err <= 2.0 ** -8 * np.abs(ref) + 1e-30), err.max()
  h32 = np.asarray(h, np.float32)
  np.testing.assert_array_equal(np.asarray(hmax),
                                np.abs(h32).reshape(*shape[:-1], -1, 16).max(-1))
  for x, q, s in ((g, gq, gs), (u, uq, us)):
    q_ref, s_ref = _np_per_group(np.asarray(x, np.float32), 16, *E4M3)
    np.testing.assert_array_equal(np.asarray(s), s_ref)
    assert _code_steps(q, q_ref).max() == 0


def test_kernel_bfloat16_scales_and_nan():
  g, u = _gate_up((2, 64, 64), seed=2)
  g = g.at[1, 5, 20].set(jnp.nan)                # group (1, 5, 1) of gate
  u = u.at[0, 3, 40].set(jnp.inf)                # group (0, 3, 2) of up: scale NaN, h inf or NaN
  # 128-row blocks: interpret mode's jnp.max drops NaN in larger ones (test_kernels_quantize_mgpu)
  h, hmax, gq, gs, uq, us = _run(g, u, scale_dtype=jnp.bfloat16, block=128)
  assert gs.dtype == us.dtype == jnp.bfloat16
  gs, us, hmax = (np.asarray(a, np.float32) for a in (gs, us, hmax))
  assert np.isnan(gs[1, 5, 1]) and np.isnan(us[0, 3, 2])
  assert np.isnan(hmax[1, 5, 1]) and not np.isfinite(hmax[0, 3, 2])
  finite = np.ones_like(gs, bool)
  finite[1, 5, 1] = finite[0, 3, 2] = False
  assert np.all(np.isfinite(gs[finite])) and np.all(np.isfinite(hmax[finite]))
  q_ref, s_ref = _np_per_group(np.asarray(g, np.float32), 16, *E4M3, scale_dtype=jnp.bfloat16)
  np.testing.assert_array_equal(gs[finite], s_ref[finite])


def test_kernel_errors():
  g, u = _gate_up((2, 64, 64), seed=3)
  with pytest.raises(ValueError, match="swiglu_quantize: gate .* and up .* differ"):
    _run(g, u[:, :32])
  with pytest.raises(ValueError, match="swiglu_quantize: .*multiple of 16"):
    _run(g[..., :40], u[..., :40])
  assert not sm.supported((2, 64, 64), jnp.int32, 16)


@pytest.mark.parametrize("backend", ["quantize=pallas", "reference"])
def test_dispatch_matches_the_separate_references(backend):
  g, u = _gate_up((2, 64, 128), seed=4)
  with kernels.backend(backend):
    h, amax, gq, uq = jax.jit(kernels.swiglu_quantize)(g, u)
  from coat_jax import activations, quantize
  h_ref = activations.silu_product(g, u)
  # (atol: XLA flushes silu's subnormal sigmoid to zero where the kernel's division does not)
  np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(h_ref, np.float32),
                             rtol=2.0 ** -7, atol=1e-30)
  assert amax.dtype == jnp.float32 and amax.shape == ()
  assert float(amax) == float(jnp.max(jnp.abs(h.astype(jnp.float32))))
  for q, x in ((gq, g), (uq, u)):
    ref = quantize.quantize_per_group(x, 16, "e4m3")
    assert q.group_size == 16 and q.scale.dtype == ref.scale.dtype == jnp.bfloat16
    assert _same_codes(q.data, ref.data)
    np.testing.assert_array_equal(np.asarray(q.scale, np.float32), np.asarray(ref.scale, np.float32))


def test_swiglu_op_fused_equals_separate_values_grads_and_residuals():
  from coat_jax import memory
  g, u = _gate_up((2, 64, 128), seed=5)
  dh = jnp.asarray(np.random.default_rng(6).standard_normal(g.shape), jnp.bfloat16)
  print("seed 6 (dh)")

  def run(g, u):
    (h, hq), pull = jax.vjp(lambda g, u: ops.swiglu(g, u, mode="coat"), g, u)
    return h, hq.data, hq.scale, hq.data_t, pull((dh, jax.tree.map(jnp.zeros_like, hq)))

  out = {}
  for choice in ("fused", "separate"):
    with kernels.backend("quantize=pallas"), linear_ablation.ablation(swiglu_quantize=choice):
      out[choice] = jax.jit(run)(g, u)
      saved = memory.saved_residual_bytes(lambda g, u: ops.swiglu(g, u, mode="coat")[0], g, u)
      out[choice + " saved"] = saved
  assert out["fused saved"] == out["separate saved"] > 0
  for a, b in zip(jax.tree.leaves(out["fused"]), jax.tree.leaves(out["separate"])):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=2.0 ** -7, atol=1e-30)
  # the gradient against float64 in size and direction (gate/up from 1 x 16 E4M3 copies)
  dgate, _ = out["fused"][4]
  g64, u64, d64 = (np.asarray(a, np.float64) for a in (g, u, dh))
  sig = 1 / (1 + np.exp(-g64))
  ref = d64 * u64 * sig * (1 + g64 * (1 - sig))
  got = np.asarray(dgate, np.float64)
  rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
  cos = np.sum(got * ref) / (np.linalg.norm(got) * np.linalg.norm(ref))
  assert rel < 0.05 and cos > 0.999, (rel, cos)


@pytest.mark.gpu
def test_gpu_kernel_matches_numpy_and_the_unfused_path():
  g, u = _gate_up((8, 512, 1024), seed=7)
  h, hmax, gq, gs, uq, us = sm.swiglu_quantize(g, u, group_size=16, out_dtype=E4M3[0],
                                               fmax=E4M3[1], floor=FLOOR)
  ref = _h64(g, u)
  err = np.abs(np.asarray(h, np.float64) - ref)
  assert np.all(err <= 2.0 ** -7 * np.abs(ref) + 1e-30), err.max()   # exp's ulps on the GPU
  np.testing.assert_array_equal(np.asarray(hmax),
                                np.abs(np.asarray(h, np.float32)).reshape(8, 512, -1, 16).max(-1))
  for x, q, s in ((g, gq, gs), (u, uq, us)):
    q_ref, s_ref = _np_per_group(np.asarray(x, np.float32), 16, *E4M3)
    np.testing.assert_array_equal(np.asarray(s), s_ref)
    assert _code_steps(q, q_ref).max() <= 1   # div.full.f32 vs IEEE division
  with kernels.backend("quantize=pallas"):
    fused = jax.jit(kernels.swiglu_quantize)(g, u)
  with kernels.backend("reference"):
    sep = jax.jit(kernels.swiglu_quantize)(g, u)
  np.testing.assert_allclose(np.asarray(fused[0], np.float32), np.asarray(sep[0], np.float32),
                             rtol=2.0 ** -7, atol=1e-30)
  assert _same_codes(fused[2].data, sep[2].data) and _same_codes(fused[3].data, sep[3].data)
