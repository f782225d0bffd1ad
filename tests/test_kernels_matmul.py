"""FP8 TN GEMM kernel (pallas_kernels/gemm/fp8_matmul.py) vs the XLA reference and float64.

CPU: the Mosaic GPU kernel runs in interpret mode (plgpu.InterpretGPUParams) on small, odd shapes
with small tiles; the dispatch (TN planning, data_t, fallbacks) and argument checks.
GPU (@pytest.mark.gpu, run on the device machine with JAX_PLATFORMS=cuda): the compiled kernel
with its default tiles against the XLA/cuBLASLt reference.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from coat_jax import gemm, kernels
from coat_jax.quantize import (QuantizedArray, group_amax, quantize_per_group,
                               quantize_per_tensor)
from pallas_kernels.gemm import fp8_matmul as fm
from tests.jaxpr_walk import equations

SMALL = fm.GemmConfig(tile_m=64, tile_n=64, epi_m=64, epi_n=32, stages=2)
TN = (((1,), (1,)), ((), ()))


def _fp8(rng, shape, dtype=jnp.float8_e4m3fn, spread=3.0):
  x = rng.normal(size=shape) * spread
  x = np.clip(x, -440.0, 440.0)
  return jnp.asarray(x, jnp.float32).astype(dtype)


def _ref64(a, b, scale):
  return (np.asarray(a, np.float64) @ np.asarray(b, np.float64).T) * np.float64(scale)


def _rel(x, ref):
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  assert np.all(np.isfinite(x)), "non-finite output"
  return np.linalg.norm(x - ref) / np.linalg.norm(ref)


def _interp():
  return plgpu.InterpretGPUParams()


def _uses_kernel(fn, *args) -> bool:
  """The jaxpr holds the Mosaic GPU kernel (a pallas_call; in interpret mode its wgmma ops)."""
  text = str(jax.make_jaxpr(fn)(*args))
  return "pallas_call" in text or "wgmma" in text


def _tn(a, b, dn):
  return fm.tn_operands(a.data, a.data_t, b.data, b.data_t, dn)


def _dot64(a, b, dn):
  """The spec's product in float64: (a.scale * a.data) . (b.scale * b.data) per dimension_numbers
  (one batch axis at most, leading)."""
  x = np.asarray(a.data, np.float64) * float(a.scale)
  y = np.asarray(b.data, np.float64) * float(b.scale)
  (lc, rc), (lb, rb) = dn
  if lb:
    assert tuple(lb) == (0,) and tuple(rb) == (0,)
    return np.stack([np.tensordot(x[i], y[i], axes=([c - 1 for c in lc], [c - 1 for c in rc]))
                     for i in range(x.shape[0])])
  return np.tensordot(x, y, axes=(list(lc), list(rc)))


def _kernel_traces(fn, *args) -> list:
  """The traced kernel of each GEMM call in fn's jaxpr (the `jit` wrapping the Mosaic GPU kernel),
  in call order: one object per trace, shared when a trace is reused."""
  is_kernel = lambda eqn: "jaxpr" in eqn.params and "wgmma" in str(eqn.params["jaxpr"])
  return [eqn.params["jaxpr"] for eqn in equations(jax.make_jaxpr(fn)(*args), stop=is_kernel)
          if is_kernel(eqn)]


def test_kernel_traced_once_per_signature(rng):
  """Calls of one GEMM signature reuse one traced kernel (so JAX lowers it once per step: its
  lowering cache is keyed on the traced jaxpr); another shape gets its own."""
  a, b, c = _fp8(rng, (128, 256)), _fp8(rng, (64, 256)), _fp8(rng, (192, 256))
  s = jnp.float32(0.5)
  mm = lambda x, y: fm.fp8_matmul_tn(x, y, s, jnp.float32, config=SMALL, interpret=_interp())
  traces = _kernel_traces(lambda a, b, c: (mm(a, b), mm(a, b) * 2, mm(c, b)), a, b, c)
  assert len(traces) == 3
  assert traces[0] is traces[1] and traces[2] is not traces[0]


@pytest.mark.parametrize("m,n,k,out_dtype,dtypes", [
    (200, 136, 300, jnp.float32, (jnp.float8_e4m3fn, jnp.float8_e4m3fn)),   # no tile divides
    (128, 192, 256, jnp.bfloat16, (jnp.float8_e4m3fn, jnp.float8_e5m2)),    # aligned, mixed fp8
])
def test_kernel_interpret_matches_float64(rng, m, n, k, out_dtype, dtypes):
  a, b = _fp8(rng, (m, k), dtypes[0]), _fp8(rng, (n, k), dtypes[1])
  scale = jnp.float32(rng.uniform(0.1, 2.0))
  out = fm.fp8_matmul_tn(a, b, scale, out_dtype, config=SMALL, interpret=_interp())
  assert out.shape == (m, n) and out.dtype == jnp.dtype(out_dtype)
  tol = 1e-6 if out_dtype == jnp.float32 else 6e-3  # float32 accumulation / one bf16 rounding
  assert _rel(out, _ref64(a, b, scale)) < tol


def test_kernel_interpret_scales_near_limits(rng):
  """Tiny and huge per-tensor scale products stay exact relative to float64 (float32 output)."""
  m, n, k = 64, 128, 128
  a, b = _fp8(rng, (m, k), spread=200.0), _fp8(rng, (n, k), spread=200.0)
  for scale in (1e-20, 3e12):
    out = fm.fp8_matmul_tn(a, b, jnp.float32(scale), jnp.float32, config=SMALL,
                           interpret=_interp())
    assert _rel(out, _ref64(a, b, scale)) < 1e-6


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_interpret_takes_the_two_scales_apart(rng, out_dtype):
  """scale=a.scale, b_scale=b.scale: the kernel's product of the two is float32's, so the output
  is the one the product passed whole gives, bit for bit (and b_scale is applied)."""
  m, n, k = 64, 128, 256
  a, b = _fp8(rng, (m, k)), _fp8(rng, (n, k))
  sa, sb = jnp.float32(rng.uniform(0.1, 3.0)), jnp.float32(rng.uniform(1e-3, 0.1))
  print(f"scales {float(sa)!r} x {float(sb)!r}")
  run = lambda *s, **kw: np.asarray(fm.fp8_matmul_tn(a, b, *s, out_dtype, config=SMALL,
                                                     interpret=_interp(), **kw), np.float32)
  apart, whole = run(sa, b_scale=sb), run(sa * sb)
  np.testing.assert_array_equal(apart, whole)
  assert _rel(apart, _ref64(a, b, float(sa) * float(sb))) < (1e-6 if out_dtype == jnp.float32
                                                             else 6e-3)


def test_dispatch_multiplies_no_scales_outside_the_kernel(rng):
  """The dispatch hands the kernel a's and b's per-tensor scales apart: no multiply is left
  outside the kernel (on the GPU each would be an XLA kernel launch of its own per GEMM)."""
  a, b = _qa(rng, (128, 256)), _qa(rng, (192, 256))
  fn = lambda a, b: kernels.fp8_dot_general(a, b, TN, jnp.bfloat16)
  with kernels.backend("gemm=pallas"):
    jaxpr = jax.make_jaxpr(fn)(a, b)
  kernel_call = ("mpmd_map", "pallas_call")   # plgpu.kernel's primitive (and pallas_call's)
  names = [e.primitive.name for e in equations(jaxpr, stop=lambda e: e.primitive.name
                                               in kernel_call)]
  assert set(kernel_call) & set(names) and "mul" not in names, names


@pytest.mark.parametrize("wg_dim", ["m", "n"])
def test_kernel_interpret_epilogue_amax(rng, wg_dim):
  """The epilogue's per-(1 x tile_n) maxima equal group_amax of the float32 output."""
  m, n, k = 136, 200, 256
  a, b = _fp8(rng, (m, k)), _fp8(rng, (n, k))
  cfg = dataclasses.replace(SMALL, wg_dim=wg_dim)
  out, amax = fm.fp8_matmul_tn(a, b, jnp.float32(rng.uniform(0.01, 3.0)), jnp.float32,
                               config=cfg, interpret=_interp(), with_amax=True)
  assert amax.shape == (m, -(-n // cfg.tile_n)) and amax.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(amax), np.asarray(group_amax(out, cfg.tile_n)))


@pytest.mark.parametrize("cluster_dim,wg_dim", [("m", "m"), ("n", "n")])
def test_kernel_interpret_cluster_pairs(rng, cluster_dim, wg_dim):
  """Two-CTA clusters (the shared operand's tile multicast to both): float64's product, on a
  shape that is padded to the pair tile (200 rows / 136 columns are not multiples of it)."""
  m, n, k = 200, 136, 256
  a, b = _fp8(rng, (m, k)), _fp8(rng, (n, k))
  scale = jnp.float32(rng.uniform(0.1, 2.0))
  cfg = dataclasses.replace(SMALL, cluster_dim=cluster_dim, wg_dim=wg_dim)
  out = fm.fp8_matmul_tn(a, b, scale, jnp.float32, config=cfg, interpret=_interp(), num_ctas=4)
  assert out.shape == (m, n)
  assert _rel(out, _ref64(a, b, scale)) < 1e-6


@pytest.mark.parametrize("k,in_flight", [(128, 1), (640, 1), (640, 0)])
def test_kernel_interpret_mma_in_flight(rng, k, in_flight):
  """One wgmma group left in flight per K step (the default: the ring slot released a step
  later) and none (each step waits for its product): float64's product over several K steps
  and several tiles per CTA, and over one K step (none kept)."""
  m, n = 256, 192
  a, b = _fp8(rng, (m, k)), _fp8(rng, (n, k))
  scale = jnp.float32(rng.uniform(0.1, 2.0))
  cfg = dataclasses.replace(SMALL, stages=3, mma_in_flight=in_flight)
  out = fm.fp8_matmul_tn(a, b, scale, jnp.float32, config=cfg, interpret=_interp())
  assert _rel(out, _ref64(a, b, scale)) < 1e-6


@pytest.mark.parametrize("m,n,k,in_flight,out_dtype", [
    (200, 136, 640, 1, jnp.float32),     # padded; more K steps than ring slots
    (256, 192, 128, 0, jnp.bfloat16),    # one K step
    (320, 128, 384, 1, jnp.bfloat16),
])
def test_kernel_interpret_pingpong(rng, m, n, k, in_flight, out_dtype):
  """The ping-pong schedule (each consumer warpgroup takes whole tiles in turn): float64's
  product and the epilogue's maxima, over several tiles per warpgroup on 3 CTAs; the same
  output as the cooperative schedule."""
  a, b = _fp8(rng, (m, k)), _fp8(rng, (n, k))
  scale = jnp.float32(rng.uniform(0.1, 2.0))
  cfg = dataclasses.replace(SMALL, stages=3, schedule="pingpong", mma_in_flight=in_flight)
  out, amax = fm.fp8_matmul_tn(a, b, scale, out_dtype, config=cfg, interpret=_interp(),
                               num_ctas=3, with_amax=True)
  tol = 1e-6 if out_dtype == jnp.float32 else 6e-3
  assert out.shape == (m, n) and _rel(out, _ref64(a, b, scale)) < tol
  ref, ref_amax = fm.fp8_matmul_tn(a, b, scale, out_dtype, config=SMALL, interpret=_interp(),
                                   with_amax=True)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
  np.testing.assert_array_equal(np.asarray(amax), np.asarray(ref_amax))


def _qa(rng, shape, with_t=False, fmt="e4m3"):
  x = jnp.asarray(rng.normal(size=shape) * rng.uniform(0.5, 50.0), jnp.float32)
  return quantize_per_tensor(x, fmt, with_transpose=with_t)


@pytest.mark.parametrize("a_shape,b_shape,dn,a_t,b_t", [
    ((2, 72, 136), (144, 136), (((2,), (1,)), ((), ())), False, False),  # batch folded, TN
    ((136, 144), (144, 128), (((1,), (0,)), ((), ())), False, True),     # NN via b.data_t
    ((136, 144), (136, 128), (((0,), (0,)), ((), ())), True, True),      # dW: TT via both data_t
])
def test_dispatch_pallas_interpret_matches_reference(rng, a_shape, b_shape, dn, a_t, b_t):
  a, b = _qa(rng, a_shape, a_t), _qa(rng, b_shape, b_t)
  a2, _, out_shape, reason = _tn(a, b, dn)
  assert reason is None and a2 is not None
  ref = gemm.fp8_dot_general_reference(a, b, dn, jnp.float32)
  assert out_shape == ref.shape
  with kernels.backend("pallas"):
    out = kernels.fp8_dot_general(a, b, dn, jnp.float32)
    assert _uses_kernel(lambda a, b: kernels.fp8_dot_general(a, b, dn, jnp.float32), a, b)
  with kernels.backend("reference"):
    assert not _uses_kernel(lambda a, b: kernels.fp8_dot_general(a, b, dn, jnp.float32), a, b)
  assert out.shape == ref.shape and out.dtype == jnp.float32
  assert _rel(out, np.asarray(ref, np.float64)) < 1e-5
  assert _rel(out, _dot64(a, b, dn)) < 1e-6   # float32 accumulation of exact FP8 products


@pytest.mark.parametrize("a_shape,b_shape,dn,a_t,b_t,why", [
    ((136, 144), (144, 128), (((1,), (0,)), ((), ())), False, False, "no data_t"),
    ((136, 144), (136, 128), (((0,), (0,)), ((), ())), False, True, "no data_t"),
    ((4, 136, 144), (4, 144, 128), (((2,), (1,)), ((0,), (0,))), False, False, "batch"),
    ((16, 144), (136, 144), TN, False, False, "small"),
])
def test_dispatch_falls_back(rng, a_shape, b_shape, dn, a_t, b_t, why):
  """Cases the kernel cannot take: no pallas_call, and the float64 spec product to one bf16
  rounding (plus float32 accumulation)."""
  a, b = _qa(rng, a_shape, a_t), _qa(rng, b_shape, b_t)
  a2, _, _, reason = _tn(a, b, dn)
  assert a2 is None and why in reason
  fn = lambda a, b: kernels.fp8_dot_general(a, b, dn, jnp.bfloat16)
  with kernels.backend("pallas"):
    out = jax.jit(fn)(a, b)
    assert not _uses_kernel(fn, a, b)
  want = _dot64(a, b, dn)
  assert out.shape == want.shape and out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2.0**-8,
                             atol=1e-6 * np.abs(want).max())


def test_int8_falls_back_and_per_group_rejected(rng):
  x = jnp.asarray(rng.normal(size=(136, 144)), jnp.float32)
  qi = quantize_per_tensor(x, "int8")
  assert "non-float8" in _tn(qi, qi, TN)[3]
  qg = quantize_per_group(x, 16)
  with kernels.backend("pallas"), pytest.raises(ValueError, match="per-tensor"):
    kernels.fp8_dot_general(qg, qg, TN, jnp.bfloat16)


def test_bad_arguments(rng):
  a = _fp8(rng, (128, 128))
  with pytest.raises(ValueError, match="contracting sizes"):
    fm.fp8_matmul_tn(a, _fp8(rng, (128, 256)), 1.0)
  with pytest.raises(ValueError, match="float8"):
    fm.fp8_matmul_tn(a.astype(jnp.bfloat16), a, 1.0)
  with pytest.raises(ValueError, match="out_dtype"):
    fm.fp8_matmul_tn(a, a, 1.0, jnp.float16)
  with pytest.raises(ValueError, match="tile_m"):
    fm.validate_config(fm.GemmConfig(tile_m=96), jnp.bfloat16)
  with pytest.raises(ValueError, match="cluster_dim"):
    fm.validate_config(fm.GemmConfig(cluster_dim="k"), jnp.bfloat16)
  with pytest.raises(ValueError, match="exceed shared memory"):
    fm.validate_config(fm.GemmConfig(stages=8), jnp.bfloat16)
  with pytest.raises(ValueError, match="mma_in_flight"):
    fm.validate_config(fm.GemmConfig(mma_in_flight=2), jnp.bfloat16)
  with pytest.raises(ValueError, match="schedule"):
    fm.validate_config(fm.GemmConfig(schedule="round_robin"), jnp.bfloat16)
  with pytest.raises(ValueError, match="pingpong"):
    fm.validate_config(fm.GemmConfig(schedule="pingpong", cluster_dim="m"), jnp.bfloat16)
  qa = QuantizedArray(a, jnp.float32(1.0))
  qb = QuantizedArray(_fp8(rng, (128, 256)), jnp.float32(1.0))
  with pytest.raises(ValueError, match="contracting sizes"):
    _tn(qa, qb, TN)


def test_default_config_fits_shared_memory():
  for out_dtype in fm.OUT_DTYPES:
    cfg = fm.validate_config(fm.DEFAULT_CONFIG, out_dtype)
    used = cfg.stages * fm.smem_bytes_per_stage(cfg) + fm.epilogue_smem_bytes(cfg, out_dtype)
    assert cfg.stages >= 3 and used <= fm.SMEM_BYTES


# ---------------------------------------------------------------------------------------------
# GPU: the compiled kernel (default tiles) vs XLA's cuBLASLt FP8 reference.

@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(256, 256, 128), (1000, 1500, 700), (2048, 4096, 1024),
                                   (333, 4096, 4224)])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_kernel_matches_reference(rng, m, n, k, out_dtype):
  """Against float64: FP8 wgmma accumulates with a narrow-mantissa adder (XLA/cuBLASLt's fast
  accumulation does too), so the error of both is ~1e-4 relative, not float32's 1e-7."""
  a, b = _fp8(rng, (m, k)), _fp8(rng, (n, k))
  scale = jnp.float32(rng.uniform(1e-3, 1e-1))
  out = jax.jit(lambda a, b, s: fm.fp8_matmul_tn(a, b, s, out_dtype))(a, b, scale)
  ref = jax.jit(lambda a, b, s: (jax.lax.dot_general(
      a, b, TN, preferred_element_type=jnp.float32) * s).astype(out_dtype))(a, b, scale)
  exact = _ref64(a, b, scale)
  err, err_xla = _rel(out, exact), _rel(ref, exact)
  print(f"GPUERR {m}x{n}x{k} {jnp.dtype(out_dtype).name}: pallas {err:.2e} xla {err_xla:.2e} "
        f"pallas-vs-xla {_rel(out, np.asarray(jnp.asarray(ref, jnp.float32), np.float64)):.2e}")
  assert err < 2.0 * err_xla + 2e-4 and err < 4e-3, (err, err_xla)


def _gpu_bitwise_equal(rng, cfg, ref_cfg, shapes, with_amax=False):
  """The compiled kernel under cfg against ref_cfg on each (M, N, K): finite, and the same bf16
  output (and epilogue maxima, with_amax) bit for bit."""
  for m, n, k in shapes:
    a, b = _fp8(rng, (m, k)), _fp8(rng, (n, k))
    scale = jnp.float32(rng.uniform(1e-3, 1e-1))
    run = lambda c: jax.jit(lambda a, b, s: fm.fp8_matmul_tn(a, b, s, jnp.bfloat16, config=c,
                                                             with_amax=with_amax))(a, b, scale)
    out, ref = run(cfg), run(ref_cfg)
    (out, amax), (ref, ref_amax) = (out, ref) if with_amax else ((out, None), (ref, None))
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    if with_amax:
      np.testing.assert_array_equal(np.asarray(amax), np.asarray(ref_amax))


@pytest.mark.gpu
@pytest.mark.parametrize("cluster_dim", ["m", "n"])
def test_gpu_cluster_pairs_equal_single_ctas(rng, cluster_dim):
  """Two-CTA clusters with the shared tile multicast compute every output tile as one CTA
  does (same K order): bit for bit the default's output, on a padded and an aligned shape."""
  _gpu_bitwise_equal(rng, dataclasses.replace(fm.DEFAULT_CONFIG, cluster_dim=cluster_dim),
                     fm.DEFAULT_CONFIG, [(1000, 1500, 700), (2048, 4096, 1024)])


@pytest.mark.gpu
def test_gpu_mma_in_flight_equals_waiting_each_step(rng):
  """Leaving one wgmma group in flight per K step changes when ring slots are released, not the
  products or their order: bit for bit the output of a kernel waiting at every step, over many
  tiles per CTA (a slot refilled too early for the next tile would show here)."""
  cfg = lambda i: dataclasses.replace(fm.DEFAULT_CONFIG, mma_in_flight=i)
  _gpu_bitwise_equal(rng, cfg(1), cfg(0), [(4096, 4096, 2048), (1000, 1500, 700),
                                           (2048, 2048, 128)])


@pytest.mark.gpu
@pytest.mark.parametrize("in_flight", [0, 1])
def test_gpu_pingpong_equals_cooperative(rng, in_flight):
  """The ping-pong schedule computes each output tile as the cooperative one does (same K
  order): bit for bit its output and epilogue maxima, on padded and aligned shapes."""
  cfg = dataclasses.replace(fm.DEFAULT_CONFIG, schedule="pingpong", mma_in_flight=in_flight)
  _gpu_bitwise_equal(rng, cfg, fm.DEFAULT_CONFIG,
                     [(4096, 4096, 2048), (1000, 1500, 700), (2048, 2048, 128)], with_amax=True)


@pytest.mark.gpu
def test_gpu_dispatch_backward_shapes(rng):
  """dX (NN via data_t) and dW (TT via both data_t) through kernels.fp8_dot_general."""
  t, d, f = 512, 256, 384
  dy = _qa(rng, (t, f), with_t=True)
  w = _qa(rng, (d, f), with_t=True)    # y = x @ w.T style weight (out f, in d) stored (d, f)
  x = _qa(rng, (t, d), with_t=True)
  with kernels.backend("pallas"):
    for lhs, rhs, dn in [(dy, w, (((1,), (1,)), ((), ()))),     # dX = dY @ W.T   (TN)
                         (x, dy, (((0,), (0,)), ((), ()))),      # dW = X.T @ dY  (via data_t)
                         (dy, _qa(rng, (f, d), True), (((1,), (0,)), ((), ())))]:  # NN
      assert _tn(lhs, rhs, dn)[3] is None
      out = jax.jit(lambda a, b, dn=dn: kernels.fp8_dot_general(a, b, dn, jnp.float32))(lhs, rhs)
      ref = gemm.fp8_dot_general_reference(lhs, rhs, dn, jnp.float32)
      assert _rel(out, np.asarray(ref, np.float64)) < 1e-3


@pytest.mark.gpu
def test_gpu_epilogue_amax(rng):
  m, n, k = 1000, 1300, 512
  a, b = _fp8(rng, (m, k)), _fp8(rng, (n, k))
  out, amax = jax.jit(lambda a, b: fm.fp8_matmul_tn(a, b, 0.05, jnp.float32, with_amax=True))(a, b)
  tile_n = fm.DEFAULT_CONFIG.tile_n
  assert amax.shape == (m, -(-n // tile_n))
  np.testing.assert_array_equal(np.asarray(amax), np.asarray(group_amax(out, tile_n)))


@pytest.mark.gpu
def test_gpu_bf16_output_is_the_float32_output_rounded(rng):
  """The kernel writing bf16 equals its float32 output cast to bf16, bit for bit: ops.linear
  takes a bf16 weight's dW from the GEMM in bf16 instead of casting a float32 dW after it."""
  m, n, k = 1024, 1536, 2048
  a, b = _fp8(rng, (m, k)), _fp8(rng, (n, k))
  scale = jnp.float32(rng.uniform(1e-3, 1e-1))
  out16 = jax.jit(lambda a, b, s: fm.fp8_matmul_tn(a, b, s, jnp.bfloat16))(a, b, scale)
  out32 = jax.jit(lambda a, b, s: fm.fp8_matmul_tn(a, b, s, jnp.float32))(a, b, scale)
  assert np.isfinite(np.asarray(out32)).all()
  np.testing.assert_array_equal(np.asarray(out16.astype(jnp.float32)),
                                np.asarray(out32.astype(jnp.bfloat16).astype(jnp.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
def test_gpu_two_scales_equal_their_product(rng, schedule):
  """a's and b's scales passed apart (multiplied in the kernel) give the output of their float32
  product passed whole, bit for bit, on both schedules."""
  m, n, k = 1024, 1536, 2048
  a, b = _fp8(rng, (m, k)), _fp8(rng, (n, k))
  sa, sb = jnp.float32(rng.uniform(0.1, 3.0)), jnp.float32(rng.uniform(1e-3, 1e-1))
  cfg = fm.GemmConfig(schedule=schedule)
  apart = jax.jit(lambda a, b, x, y: fm.fp8_matmul_tn(a, b, x, jnp.bfloat16, b_scale=y,
                                                      config=cfg))(a, b, sa, sb)
  whole = jax.jit(lambda a, b, s: fm.fp8_matmul_tn(a, b, s, jnp.bfloat16, config=cfg))(
      a, b, sa * sb)
  assert np.isfinite(np.asarray(whole, np.float32)).all()
  np.testing.assert_array_equal(np.asarray(apart, np.float32), np.asarray(whole, np.float32))


def test_gemm_benchmark_configs_and_arguments():
  """The benchmark's configuration names keep the meaning their recorded numbers had ("_f1": one
  wgmma group in flight, the default; no suffix: waiting each step), and bad arguments are usage
  errors (exit 2), not tracebacks."""
  from benchmarks.kernels import bench_kernels_gemm as bench
  assert bench.TUNE["m128x128_f1"] == fm.DEFAULT_CONFIG
  assert all((cfg.mma_in_flight == 1) == name.endswith("_f1") for name, cfg in bench.TUNE.items())
  for argv in (["--shapes", "olmo,xyz"], ["--shapes", "16x16"], ["--configs", "m128x128,nope"]):
    with pytest.raises(SystemExit) as exit_bad:
      bench.main(argv)
    assert exit_bad.value.code == 2


def test_benchmark_shapes_argument_names_sets_and_shapes():
  """benchmarks/_common.parse_shapes: named sets expand in order, MxNxK items are read as
  integers, and an item of the wrong length, a non-positive size or text is a usage error."""
  import argparse
  from benchmarks._common import parse_shapes
  p = argparse.ArgumentParser()
  named = {"pair": [(1, 2, 3), (4, 5, 6)]}
  assert parse_shapes(p, "--shapes", "pair,7x8x9", "MxNxK", named) == [(1, 2, 3), (4, 5, 6),
                                                                         (7, 8, 9)]
  assert parse_shapes(p, "--shape", "16384x2048", "ROWSxCOLS") == [(16384, 2048)]
  for text in ("7x8", "7x8x9x1", "7x0x9", "7x-1x9", "pairs", "7xax9", ""):
    with pytest.raises(SystemExit) as exit_bad:
      parse_shapes(p, "--shapes", text, "MxNxK", named)
    assert exit_bad.value.code == 2
