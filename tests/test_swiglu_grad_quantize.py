"""SwiGLU's backward straight to the gate/up GEMMs' E5M2 gradients
(pallas_kernels/quantize/swiglu_grad_quantize_triton.py, `kernels.swiglu_backward_quantize`):
both Triton passes in Triton's interpreter on CPU (the same @triton.jit source the GPU compiles)
against the unfused jnp references (SwiGLU's gradients from the dequantized codes in dh's dtype,
their amax, the per-tensor quantize with its transposed copy), NaN propagation; the dispatch's
fallback and `ops.swiglu_linears` under both settings of the ablation switch on CPU; on the GPU
(marked gpu) the kernel against the unfused kernels, code for code, and the op's gradients."""
import os

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from coat_jax import activations, formats, kernels, ops, quantize
from coat_jax.ops import linear_layer
from pallas_kernels.quantize import swiglu_grad_quantize_triton as sq

IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")

G = 16
E5M2 = formats.get_format("e5m2")


def _inputs(m, n, seed, scale_dh=1e-3):
  rng = np.random.default_rng(seed)
  print(f"seed {seed}: dh ({m}, {n}) bf16 x {scale_dh}, gate/up N(0, 2) as 1 x {G} E4M3 codes")
  gate = jnp.asarray(rng.normal(0, 2, (m, n)), jnp.bfloat16)
  up = jnp.asarray(rng.normal(0, 2, (m, n)), jnp.bfloat16)
  dh = jnp.asarray(rng.normal(0, scale_dh, (m, n)), jnp.bfloat16)
  gq = quantize.quantize_per_group(gate, G, "e4m3")
  uq = quantize.quantize_per_group(up, G, "e4m3")
  return dh, gq, uq


def _reference(dh, gq, uq):
  dg, du = activations.silu_product_grads(quantize.dequantize(gq, jnp.float32),
                                          quantize.dequantize(uq, jnp.float32), dh)
  out = []
  for d in (dg, du):
    amax = jnp.max(jnp.abs(d)).astype(jnp.float32)
    q = quantize.quantize_per_tensor(d, E5M2, amax=amax, with_transpose=True)
    out.append((np.asarray(q.data), np.asarray(q.data_t), float(q.scale), float(amax)))
  return out


def _run(dh, gq, uq, bm, bn):
  """Both passes in Triton's interpreter: (amax (2,), scale (2,), [qg, qg_t, qu, qu_t])."""
  if sq.triton is None:
    if IN_CI:
      pytest.fail("triton is not installed: CI must run the Triton kernels (pip install -e "
                  ".[test])")
    pytest.skip("triton is not installed")
  from tests import triton_interpreter as ti
  m, n = dh.shape
  host = lambda a: np.array(a)   # a writable host copy
  args = [host(dh), host(gq.data), host(gq.scale), host(uq.data), host(uq.scale)]
  programs = (m // bm) * (n // bn)
  maxima = np.full((programs, 2), np.nan, np.float32)
  ti.launch(sq._maxima_kernel, programs, *args, maxima, N=n, G=G, BM=bm, BN=bn)
  amax, scale = sq.scales_from_maxima(jnp.asarray(maxima), E5M2.max,
                                      formats.ACTIVATION_SCALE_FLOOR)
  outs = [np.full(shape, np.nan, ml_dtypes.float8_e5m2) for shape in ((m, n), (n, m)) * 2]
  ti.launch(sq._quantize_kernel, programs, *args, np.array(scale), *outs, N=n, M=m,
            FMAX=float(E5M2.max), G=G, BM=bm, BN=bn)
  return np.asarray(amax), np.asarray(scale), outs


@pytest.mark.parametrize("m,n,bm,bn", [(64, 256, 32, 128), (128, 128, 64, 64)])
def test_codes_and_transposes_match_the_unfused_references(m, n, bm, bn):
  dh, gq, uq = _inputs(m, n, seed=0)
  amax, scale, (qg, qgt, qu, qut) = _run(dh, gq, uq, bm, bn)
  ref = _reference(dh, gq, uq)
  for got_q, got_t, a, s, (rq, rt, rs, ra) in ((qg, qgt, amax[0], scale[0], ref[0]),
                                               (qu, qut, amax[1], scale[1], ref[1])):
    assert a == ra and a > 0
    np.testing.assert_allclose(s, rs, rtol=2e-7)
    same = np.mean(got_q.view(np.uint8) == rq.view(np.uint8))
    print(f"codes equal: {same:.6f}")
    assert same > 0.999   # float32 exp / division rounding may move a rare code by one
    np.testing.assert_allclose(got_q.astype(np.float32), rq.astype(np.float32), rtol=0.26)
    np.testing.assert_array_equal(got_t.view(np.uint8), got_q.T.view(np.uint8))
    np.testing.assert_array_equal(rt.view(np.uint8), rq.T.view(np.uint8))
    assert np.count_nonzero(got_q.astype(np.float32)) > 0.9 * got_q.size


def test_a_nan_gives_nan_scales_and_codes():
  dh, gq, uq = _inputs(64, 128, seed=1)
  dh = dh.at[5, 7].set(jnp.nan)
  amax, scale, (qg, _, qu, _) = _run(dh, gq, uq, 32, 64)
  assert np.isnan(amax).all() and np.isnan(scale).all()
  assert np.isnan(qg.astype(np.float32)).all() and np.isnan(qu.astype(np.float32)).all()


def test_problem_names_the_shape():
  assert sq.problem((64, 256), jnp.bfloat16, jnp.float8_e4m3fn, G) is None
  assert "multiples" in sq.problem((64, 100), jnp.bfloat16, jnp.float8_e4m3fn, G)
  assert "16-bit" in sq.problem((64, 256), jnp.float32, jnp.float8_e4m3fn, G)
  assert "FP8" in sq.problem((64, 256), jnp.bfloat16, jnp.int8, G)
  assert "fewer than 2" in sq.problem((256,), jnp.bfloat16, jnp.float8_e4m3fn, G)
  assert sq.problem((2, 32, 128), jnp.bfloat16, jnp.float8_e4m3fn, G) is None   # M = 64


def _op_vjp(x, wg, wu, dh):
  xq = ops.quantize_input(x)
  (h, hq), pull = jax.vjp(
      lambda x, wg, wu: ops.swiglu_linears(x, wg, wu, mode="coat", x_q=xq), x, wg, wu)
  return h, pull((dh, jax.tree.map(jnp.zeros_like, hq)))


def _op_inputs(seed):
  rng = np.random.default_rng(seed)
  print(f"seed {seed}: x (2, 64, 128), w (128, 256), dh x 1e-2")
  x = jnp.asarray(rng.standard_normal((2, 64, 128)), jnp.bfloat16)
  wg, wu = (jnp.asarray(rng.standard_normal((128, 256)) / 12, jnp.bfloat16) for _ in range(2))
  dh = jnp.asarray(rng.standard_normal((2, 64, 256)) * 1e-2, jnp.bfloat16)
  return x, wg, wu, dh


def _op_both_ways(backend):
  args = _op_inputs(seed=3)
  out = {}
  for choice in ("fused", "separate"):
    with kernels.backend(backend), linear_layer._ablation(swiglu_grad_quantize=choice):
      out[choice] = jax.jit(_op_vjp)(*args)
  return out


def test_dispatch_falls_back_to_the_unfused_calls_on_cpu():
  """Without the kernel (CPU, interpret mode), the dispatch is `swiglu_backward` then the
  per-tensor quantize of each gradient, as QuantizedArrays (M, N) with (N, M) transposes; the
  op's gradients are the same under both settings of the switch, and finite."""
  dh, gq, uq = _inputs(64, 256, seed=2)
  dh = dh.reshape(2, 32, 256)
  gq, uq = (quantize.QuantizedArray(q.data.reshape(dh.shape), q.scale.reshape(2, 32, 16), q.fmt,
                                    G) for q in (gq, uq))
  got = jax.jit(kernels.swiglu_backward_quantize)(gq, uq, dh)
  dg, du, ag, au = kernels.swiglu_backward(gq, uq, dh)
  for q, d, a in zip(got, (dg, du), (ag, au)):
    want = quantize.quantize_per_tensor(d.reshape(64, 256), E5M2, amax=a, with_transpose=True)
    assert q.data.shape == (64, 256) and q.data_t.shape == (256, 64) and q.fmt == "e5m2"
    for x, y in ((q.data, want.data), (q.data_t, want.data_t), (q.scale, want.scale)):
      np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
  out = _op_both_ways("quantize=pallas,gemm=pallas")   # the Mosaic GPU kernels interpreted
  for a, b in zip(jax.tree.leaves(out["fused"]), jax.tree.leaves(out["separate"])):
    assert np.isfinite(np.asarray(a, np.float32)).all() and np.any(np.asarray(a, np.float32))
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _codes_close(got, want, max_fraction=1e-5):
  """FP8 codes equal but for at most max_fraction of them, each of those one code step away
  (same sign: the float32 exp and division may round one bfloat16 gradient the other way)."""
  a, b = (np.asarray(x).view(np.uint8).astype(np.int16) for x in (got, want))
  differ = a != b
  print(f"{int(differ.sum())} of {a.size} codes differ")
  assert differ.mean() <= max_fraction
  assert np.all(np.abs(a[differ] - b[differ]) == 1)


@pytest.mark.gpu
def test_kernel_on_the_gpu_matches_the_unfused_kernels():
  """On a Hopper GPU with jax-triton: the dispatch's kernel against `swiglu_backward` and the
  per-tensor quantize kernels at OLMo-1B's gate/up width: the same scales, the codes and
  transposes equal but for a few in a million one code step away; the op's gradients under
  both settings of the switch within 1e-4 (relative L2)."""
  assert sq.available(), "the GPU test needs jax-triton (carry .whl)"
  rng = np.random.default_rng(4)
  print("seed 4: gate, up N(0, 2), dh N(0, 1e-3), (2, 1024, 8192)")
  shape = (2, 1024, 8192)
  gate, up = (jnp.asarray(rng.normal(0, 2, shape), jnp.bfloat16) for _ in range(2))
  dh = jnp.asarray(rng.normal(0, 1e-3, shape), jnp.bfloat16)
  gq, uq = (kernels.quantize_per_group(a, G, "e4m3") for a in (gate, up))
  got = jax.jit(kernels.swiglu_backward_quantize)(gq, uq, dh)
  text = str(jax.jit(kernels.swiglu_backward_quantize).lower(gq, uq, dh).as_text())
  assert "triton_kernel_call" in text
  dg, du, ag, au = jax.jit(kernels.swiglu_backward)(gq, uq, dh)
  for q, d, a in zip(got, (dg, du), (ag, au)):
    want = jax.jit(lambda d, a: kernels.quantize_per_tensor(d.reshape(-1, 8192), "e5m2", amax=a,
                                                            with_transpose=True))(d, a)
    np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(want.scale))
    _codes_close(q.data, want.data)
    np.testing.assert_array_equal(np.asarray(q.data_t).view(np.uint8),
                                  np.asarray(q.data).T.view(np.uint8))
  out = _op_both_ways("auto")
  for a, b in zip(jax.tree.leaves(out["fused"]), jax.tree.leaves(out["separate"])):
    a, b = (np.asarray(x, np.float64) for x in (a, b))
    assert np.isfinite(a).all() and np.linalg.norm(b) > 0
    assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b)
