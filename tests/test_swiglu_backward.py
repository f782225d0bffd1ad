"""SwiGLU's backward from gate's and up's per-group codes (pallas_kernels/quantize/swiglu_mgpu.py
`swiglu_backward`, `kernels.swiglu_backward`) against float64 math written from the spec, in GPU
interpret mode on CPU; through the dispatch against its reference, and `ops.swiglu_linears`'
gradients with the kernel against those with the reference."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from coat_jax import kernels, ops
from coat_jax.quantize import QuantizedArray
from pallas_kernels.quantize import swiglu_mgpu as sm
from tests.test_kernels_quantize_mgpu import E4M3, _np_per_group
from tests.test_swiglu_epilogue import _op_reference64, _rel_cos
from tests.test_swiglu_fused import INTERPRET, _gate_up


def _codes(shape, seed, scale_dtype=jnp.bfloat16):
  """Gate's and up's 1 x 16 E4M3 codes and scales (numpy's per-group quantize) and dh (bf16)."""
  g, u = _gate_up(shape, seed, jnp.float32)
  dh = jnp.asarray(np.random.default_rng(seed + 100).standard_normal(shape), jnp.bfloat16)
  out = []
  for x in (g, u):
    q, s = _np_per_group(np.asarray(x), 16, *E4M3, scale_dtype=scale_dtype)
    out += [jnp.asarray(q, E4M3[0]), jnp.asarray(s, scale_dtype)]
  return dh, *out


def _grads64(dh, gq, gs, uq, us):
  a = np.asarray(gq, np.float64) * np.repeat(np.asarray(gs, np.float64), 16, axis=-1)
  u = np.asarray(uq, np.float64) * np.repeat(np.asarray(us, np.float64), 16, axis=-1)
  d = np.asarray(dh, np.float64)
  sig = 1.0 / (1.0 + np.exp(-a))
  return d * u * sig * (1.0 + a * (1.0 - sig)), d * a * sig


def _check_against_float64(out, ins, rtol):
  dg, du, gmax, umax = out
  dh = ins[0]
  assert dg.dtype == du.dtype == gmax.dtype == dh.dtype and dg.shape == dh.shape
  assert gmax.shape == umax.shape == dh.shape[:-1] + (dh.shape[-1] // 16,)
  for got, ref, mx in zip((dg, du), _grads64(*ins), (gmax, umax)):
    got = np.asarray(got, np.float64)
    # float32 math rounded once to dh's dtype; the absolute term covers cancellation in
    # 1 + a (1 - s) near its zero (float32's own rounding there)
    err = np.abs(got - ref)
    assert np.all(err <= rtol * np.abs(ref) + 2.0 ** -20 * np.abs(ref).max()), err.max()
    np.testing.assert_array_equal(np.asarray(mx, np.float32),
                                  np.abs(got).reshape(*got.shape[:-1], -1, 16).max(-1))


@pytest.mark.parametrize("shape,seed,scale_dtype", [((4, 64, 64), 0, jnp.bfloat16),
                                                    ((2, 32, 256), 1, jnp.float32)])
def test_kernel_matches_float64(shape, seed, scale_dtype):
  ins = _codes(shape, seed, scale_dtype)
  out = sm.swiglu_backward(*ins, group_size=16, **INTERPRET)
  _check_against_float64(out, ins, rtol=2.0 ** -8)


def test_kernel_nan_and_errors():
  dh, gq, gs, uq, us = _codes((2, 64, 64), seed=2)
  dh = dh.at[1, 5, 20].set(jnp.nan)                        # group (1, 5, 1)
  # 128-row blocks: interpret mode's jnp.max drops NaN in larger ones (test_kernels_quantize_mgpu)
  dg, du, gmax, umax = sm.swiglu_backward(dh, gq, gs, uq, us, group_size=16,
                                          **{**INTERPRET, "block": 128})
  for g, m in ((dg, gmax), (du, umax)):
    g, m = np.asarray(g, np.float32), np.asarray(m, np.float32)
    assert np.isnan(g[1, 5, 20]) and np.isnan(m[1, 5, 1])
    finite = np.ones(m.shape, bool)
    finite[1, 5, 1] = False
    assert np.all(np.isfinite(m[finite])) and np.sum(~np.isfinite(g)) == 1
  with pytest.raises(ValueError, match="swiglu_backward: up codes .* do not match"):
    sm.swiglu_backward(dh, gq, gs, uq[:, :32], us, group_size=16, **INTERPRET)
  with pytest.raises(ValueError, match="swiglu_backward: .*multiple of 16"):
    sm.swiglu_backward(dh[..., :40], gq[..., :40], gs, uq[..., :40], us, group_size=16,
                       **INTERPRET)


def _quantized(dh, gq, gs, uq, us):
  return QuantizedArray(gq, gs, "e4m3", 16), QuantizedArray(uq, us, "e4m3", 16), dh


def test_dispatch_kernel_matches_its_reference():
  ins = _codes((2, 64, 128), seed=3)
  out = {}
  for backend in ("quantize=pallas", "reference"):
    with kernels.backend(backend):
      fn = jax.jit(kernels.swiglu_backward)
      text = str(jax.make_jaxpr(kernels.swiglu_backward)(*_quantized(*ins)))
      assert ("coat_swiglu_backward_mgpu" in text) == (backend != "reference")
      out[backend] = fn(*_quantized(*ins))
  for (dg, du, ag, au), name in ((out["quantize=pallas"], "kernel"), (out["reference"], "ref")):
    assert ag.dtype == au.dtype == jnp.float32 and ag.shape == au.shape == (), name
    assert float(ag) == float(jnp.max(jnp.abs(dg.astype(jnp.float32)))) > 0, name
    assert float(au) == float(jnp.max(jnp.abs(du.astype(jnp.float32)))) > 0, name
  for a, b in zip(out["quantize=pallas"][:2], out["reference"][:2]):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.all(np.isfinite(a))
    # each side rounds its float32 result to bf16 once: at most a bf16 step apart
    np.testing.assert_allclose(a, b, rtol=2.0 ** -7, atol=2.0 ** -20 * np.abs(b).max())


def test_op_gradients_with_the_kernel_against_float64_and_the_reference():
  """ops.swiglu_linears in coat mode (the GEMM-epilogue forward): gradients of x and both weights
  with the backward kernel and with the reference backward, each against float64 in size and
  direction, and against each other. In each of two weight pairs one of d_gate and d_up is ~20x
  the other, so handing either backward GEMM the other's amax saturates its E5M2 codes."""
  rng = np.random.default_rng(4)
  print("seed 4")
  x = jnp.asarray(rng.standard_normal((2, 128, 256)), jnp.bfloat16)
  w = [jnp.asarray(rng.standard_normal((256, 128)), jnp.float32) for _ in range(2)]
  dh = jnp.asarray(rng.standard_normal((2, 128, 128)), jnp.bfloat16)

  def grads(x, wg, wu):
    xq = ops.quantize_input(x)
    (h, hq), pull = jax.vjp(
        lambda x, wg, wu: ops.swiglu_linears(x, wg, wu, mode="coat", x_q=xq), x, wg, wu)
    return pull((dh, jax.tree.map(jnp.zeros_like, hq)))

  fns = {}
  for backend in ("gemm=pallas,quantize=pallas", "gemm=pallas"):
    with kernels.backend(backend):
      text = str(jax.make_jaxpr(grads)(x, *w))
      assert ("coat_swiglu_backward_mgpu" in text) == ("quantize" in backend)
      fns[backend] = jax.jit(grads).lower(x, *w).compile()   # one compile, both weight pairs
  for gate_size, up_size in ((0.06, 1.2), (1.2, 0.06)):
    wg, wu = w[0] * gate_size, w[1] * up_size
    _, grads64 = _op_reference64(x, wg, wu, dh)
    out = {backend: fn(x, wg, wu) for backend, fn in fns.items()}
    for backend, got_all in out.items():
      for got, ref in zip(got_all, grads64):
        rel, cos = _rel_cos(got, ref)   # FP8 operands (E4M3 forward, E5M2 gradients)
        # measured: rel <= 0.121, cos >= 0.9926; either amax swapped: rel >= 0.49, cos <= 0.874
        assert rel < 0.2 and cos > 0.98, (gate_size, backend, rel, cos)
    for a, b in zip(out["gemm=pallas,quantize=pallas"], out["gemm=pallas"]):
      rel, cos = _rel_cos(a, np.asarray(b, np.float64))
      assert rel < 0.02 and cos > 0.9998, (gate_size, rel, cos)


@pytest.mark.gpu
def test_gpu_kernel_matches_float64_and_the_reference():
  ins = _codes((8, 512, 1024), seed=7)
  _check_against_float64(sm.swiglu_backward(*ins, group_size=16), ins, rtol=2.0 ** -7)
  with kernels.backend("quantize=pallas"):
    kern = jax.jit(kernels.swiglu_backward)(*_quantized(*ins))
  with kernels.backend("reference"):
    ref = jax.jit(kernels.swiglu_backward)(*_quantized(*ins))
  for a, b in zip(kern, ref):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=2.0 ** -7, atol=2.0 ** -20 * float(np.abs(np.asarray(
                                   b, np.float32)).max()))
