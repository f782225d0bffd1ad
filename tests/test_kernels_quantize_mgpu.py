"""Mosaic GPU quantize kernels (pallas_kernels/quantize/quantize_mgpu.py) in GPU interpret mode on CPU,
against an independent numpy reference written from the spec (float32 arithmetic where the
kernels promise bit equality, float64 for the error bounds).

Interpret-mode quirk (jax 0.11.2, CPU): inside a kernel, jnp.max over a (256, 16) block dropped a
NaN that (64, 16) and (128, 16) blocks kept, so the NaN tests use the default 128-row blocks; on
the GPU the max is PTX max.NaN (the GPU test checks NaN with 256-row blocks)."""
import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.quantize import quantize_mgpu as qm
from tests.jaxpr_walk import equations

E4M3 = (jnp.float8_e4m3fn, 448.0)
E5M2 = (jnp.float8_e5m2, 57344.0)
FLOOR = 1e-10


def _inputs(shape, seed, dtype=np.float32):
  print(f"seed {seed} shape {shape} dtype {np.dtype(dtype).name}")
  rng = np.random.default_rng(seed)
  # Per-row magnitudes spread over 2^-8 .. 2^8 so that groups get different scales.
  x = rng.standard_normal(shape) * np.exp2(rng.uniform(-8, 8, shape[:-1] + (1,)))
  return x.astype(dtype)


def _np_scale(amax32, fmax):
  """scale = max(amax * f32(1/fmax), floor) in float32, NaN for non-finite amax."""
  with np.errstate(invalid="ignore"):
    s = np.maximum(amax32 * np.float32(np.float32(1.0) / np.float32(fmax)), np.float32(FLOOR))
  return np.where(np.isfinite(amax32), s, np.float32(np.nan)).astype(np.float32)


def _np_cast(y32, dtype, fmax):
  y = np.clip(y32, -fmax, fmax)
  return y.astype(ml_dtypes.float8_e4m3fn if dtype == jnp.float8_e4m3fn else ml_dtypes.float8_e5m2)


def _np_per_group(x, g, dtype, fmax, scale_dtype=np.float32):
  """Codes and scales; scale_dtype: how the scales are stored (rounded to nearest) and what x is
  divided by."""
  xg = x.astype(np.float32).reshape(*x.shape[:-1], -1, g)
  with np.errstate(invalid="ignore"):
    amax = np.max(np.abs(xg), axis=-1)
  scale = _np_scale(amax, fmax).astype(scale_dtype).astype(np.float32)
  with np.errstate(invalid="ignore", divide="ignore"):
    q = _np_cast(xg / scale[..., None], dtype, fmax)
  return q.reshape(x.shape), scale


def _codes(a):
  return np.asarray(jnp.asarray(a).astype(jnp.float32))


def _code_steps(a, b):
  """How many FP8 codes apart (sign-magnitude bits mapped to a monotonic integer)."""
  def mono(c):
    bits = np.asarray(c).view(np.uint8).astype(np.int32)
    return np.where(bits & 0x80, -(bits & 0x7F), bits & 0x7F)
  return np.abs(mono(a) - mono(b))


def _same_codes(a, b):
  a, b = _codes(a), _codes(b)
  return np.array_equal(a, b, equal_nan=True)


@pytest.mark.parametrize("shape,g,fmt", [((4, 256), 16, E4M3), ((8, 1024), 128, E4M3),
                                         ((2, 2, 512), 16, E5M2)])
def test_quantize_per_group_matches_numpy(shape, g, fmt):
  x = _inputs(shape, seed=11)
  q, s = qm.quantize_per_group(jnp.asarray(x), group_size=g, out_dtype=fmt[0], fmax=fmt[1],
                               floor=FLOOR, interpret=True)
  q_ref, s_ref = _np_per_group(x, g, *fmt)
  assert q.shape == x.shape and q.dtype == fmt[0] and s.shape == shape[:-1] + (shape[-1] // g,)
  np.testing.assert_array_equal(np.asarray(s), s_ref)
  assert _same_codes(q, q_ref)
  # float64 error bound: |x - q * s| <= half an FP8 step at the largest binade = s * fmax * 2^-m.
  mant = 3 if fmt[0] == jnp.float8_e4m3fn else 2
  deq = _codes(q).astype(np.float64).reshape(*shape[:-1], -1, g) * s_ref[..., None]
  err = np.abs(deq - x.astype(np.float64).reshape(deq.shape))
  assert np.all(err <= s_ref[..., None].astype(np.float64) * fmt[1] * 2.0**-(mant + 1) + 1e-30)


def test_quantize_per_group_bfloat16_scales_match_numpy():
  """scale_dtype=bfloat16 (the dispatch's, formats.ACTIVATION_SCALE_DTYPE): scales rounded to
  bfloat16, x divided by the rounded scale; the jnp reference does the same."""
  from coat_jax import quantize as Q
  x = _inputs((8, 1024), seed=19)
  q, s = qm.quantize_per_group(jnp.asarray(x), group_size=16, out_dtype=E4M3[0], fmax=E4M3[1],
                               floor=FLOOR, interpret=True, scale_dtype=jnp.bfloat16)
  q_ref, s_ref = _np_per_group(x, 16, *E4M3, scale_dtype=ml_dtypes.bfloat16)
  assert s.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(s, np.float32), s_ref)
  assert _same_codes(q, q_ref)
  assert not np.array_equal(s_ref, _np_per_group(x, 16, *E4M3)[1])   # the rounding happened
  ref = Q.quantize_per_group(jnp.asarray(x), 16, "e4m3", scale_dtype=jnp.bfloat16)
  assert _same_codes(q, ref.data)
  np.testing.assert_array_equal(np.asarray(ref.scale, np.float32), s_ref)
  with pytest.raises(ValueError, match="scale_dtype must be float32 or bfloat16"):
    qm.quantize_per_group(jnp.asarray(x), group_size=16, out_dtype=E4M3[0], fmax=E4M3[1],
                          floor=FLOOR, interpret=True, scale_dtype=jnp.float16)


def test_pipeline_tunables_keep_the_results(stages=3, max_ctas=1):
  """More shared-memory slots and fewer CTAs (several blocks per CTA, so slots are reused):
  the same codes and scales (the benchmark's --sweep varies these on the GPU)."""
  x = _inputs((4, 1024), seed=16)            # 256 groups of 16: 4 blocks of 64, one CTA
  q, s = qm.quantize_per_group(jnp.asarray(x), group_size=16, out_dtype=E4M3[0], fmax=E4M3[1],
                               floor=FLOOR, interpret=True, block=64, max_ctas=max_ctas,
                               stages=stages)
  q_ref, s_ref = _np_per_group(x, 16, *E4M3)
  np.testing.assert_array_equal(np.asarray(s), s_ref)
  assert _same_codes(q, q_ref)
  out = qm.dequantize_per_group(q, s, group_size=16, dtype=jnp.float32, interpret=True,
                                block=64, max_ctas=max_ctas, stages=stages)
  want = (_codes(q).reshape(4, 64, 16) * s_ref[..., None]).reshape(4, 1024)
  np.testing.assert_array_equal(np.asarray(out), want)


def test_quantize_per_group_bfloat16_input():
  x = _inputs((4, 256), seed=12).astype(ml_dtypes.bfloat16)
  q, s = qm.quantize_per_group(jnp.asarray(x), group_size=16, out_dtype=E4M3[0], fmax=E4M3[1],
                               floor=FLOOR, interpret=True)
  q_ref, s_ref = _np_per_group(x, 16, *E4M3)
  np.testing.assert_array_equal(np.asarray(s), s_ref)
  assert _same_codes(q, q_ref)


def test_non_finite_groups_get_nan_scales_and_zeros_get_the_floor():
  x = _inputs((4, 256), seed=13)
  x[0, 3] = np.nan       # group 0 of row 0
  x[1, 40] = np.inf      # group 2 of row 1
  x[2, 16:32] = 0.0      # group 1 of row 2: all zero
  q, s = qm.quantize_per_group(jnp.asarray(x), group_size=16, out_dtype=E4M3[0], fmax=E4M3[1],
                               floor=FLOOR, interpret=True)
  s = np.asarray(s)
  assert np.isnan(s[0, 0]) and np.isnan(s[1, 2])
  assert s[2, 1] == np.float32(FLOOR) and np.all(_codes(q)[2, 16:32] == 0)
  assert np.isnan(_codes(q)[0, 3])
  finite = np.ones(s.shape, bool)
  finite[0, 0] = finite[1, 2] = False
  assert np.all(np.isfinite(s[finite]))


def test_dequantize_per_group_matches_numpy():
  x = _inputs((16, 512), seed=14)
  q_ref, s_ref = _np_per_group(x, 128, *E4M3)
  out = qm.dequantize_per_group(jnp.asarray(q_ref), jnp.asarray(s_ref), group_size=128,
                                dtype=jnp.float32, interpret=True)
  want = (q_ref.astype(np.float32).reshape(16, 4, 128) * s_ref[..., None]).reshape(16, 512)
  np.testing.assert_array_equal(np.asarray(out), want)


def test_tile_amax_matches_numpy_and_keeps_nan():
  x = _inputs((8, 128), seed=15)
  x[5, 70] = np.nan
  p = np.asarray(qm.tile_amax(jnp.asarray(x), interpret=True))
  want = np.max(np.abs(x.reshape(8, 8, 16)), axis=-1)
  assert np.isnan(p[5, 4]) and np.isnan(want[5, 4])
  np.testing.assert_array_equal(p, want)


@pytest.mark.parametrize("shape,transpose", [((64, 128), False), ((2, 64, 128), True),
                                             ((128, 64), True), ((192, 256), True)])
def test_quantize_per_tensor_matches_numpy(shape, transpose):
  x = _inputs(shape, seed=16)
  if transpose:   # the transposing kernel takes 16-bit inputs
    x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
  q, s, q_t = qm.quantize_per_tensor(jnp.asarray(x, jnp.bfloat16 if transpose else jnp.float32), out_dtype=E4M3[0], fmax=E4M3[1],
                                     floor=FLOOR, with_transpose=transpose, interpret=True)
  s_ref = _np_scale(np.max(np.abs(x)), E4M3[1])
  assert np.asarray(s) == s_ref
  q_ref = _np_cast(x / s_ref, *E4M3)
  assert _same_codes(q, q_ref)
  if transpose:
    assert q_t.shape == shape[:-2] + (shape[-1], shape[-2])
    assert _same_codes(q_t, np.swapaxes(q_ref, -1, -2))
  else:
    assert q_t is None


@pytest.mark.parametrize("transpose,amax_given", [(True, True), (True, False), (False, True)])
def test_float32_input_quantized_as_its_bfloat16_cast(transpose, amax_given):
  """cast_dtype: the codes of x.astype(bfloat16) from a float32 x (the cast never written; the
  transposed copy read back from the cast staged in shared memory, reused by each CTA's three
  blocks), equal to numpy's codes of the cast, over blocks in both directions; the amax, max|x|
  given or found by stage 1, rounded to the cast."""
  x = _inputs((192, 256), seed=22)
  xb = x.astype(ml_dtypes.bfloat16).astype(np.float32)
  assert not np.array_equal(x, xb)   # the rounding is there to be seen
  amax = jnp.float32(np.max(np.abs(x))) if amax_given else None
  q, s, q_t = qm.quantize_per_tensor(jnp.asarray(x), out_dtype=E4M3[0], fmax=E4M3[1],
                                     floor=FLOOR, amax=amax, with_transpose=transpose,
                                     cast_dtype=jnp.bfloat16, interpret=True, max_ctas=2)
  s_ref = _np_scale(np.max(np.abs(xb)), E4M3[1])
  assert np.asarray(s) == s_ref
  q_ref = _np_cast(xb / s_ref, *E4M3)
  assert _same_codes(q, q_ref)
  assert not _same_codes(q, _np_cast(x / s_ref, *E4M3))   # float32's own codes differ
  if transpose:
    assert _same_codes(q_t, q_ref.T)
  else:
    assert q_t is None


def test_float32_input_whose_cast_overflows_gets_a_nan_scale():
  """A float32 value beyond bfloat16's range is inf in the cast: the amax found from x (finite)
  is rounded to the cast's inf, so the scale is NaN, as the reference of the cast gives."""
  x = _inputs((64, 128), seed=24)
  x[5, 7] = 3.4e38
  _, s, _ = qm.quantize_per_tensor(jnp.asarray(x), out_dtype=E4M3[0], fmax=E4M3[1], floor=FLOOR,
                                   with_transpose=True, cast_dtype=jnp.bfloat16, interpret=True)
  assert np.isnan(np.asarray(s))


def test_float32_transposing_quantize_lowers_for_cuda_through_its_staged_cast():
  """The Mosaic GPU lowering (layout inference included; run here, no GPU needed) of the float32
  transposing quantize with a bfloat16 cast_dtype, at OLMo-1B's weight shapes."""
  from jax import export

  def f(x):
    return qm.quantize_per_tensor(x, out_dtype=E4M3[0], fmax=E4M3[1], floor=FLOOR,
                                  amax=jnp.float32(1.0), with_transpose=True,
                                  cast_dtype=jnp.bfloat16)

  for shape in ((2048, 2048), (2048, 8192)):
    exported = export.export(jax.jit(f), platforms=["cuda"])(
        jax.ShapeDtypeStruct(shape, jnp.float32))
    assert "mosaic_gpu" in exported.mlir_module()


def test_quantize_per_tensor_given_amax_and_nan():
  x = _inputs((64, 128), seed=17)
  q, s, _ = qm.quantize_per_tensor(jnp.asarray(x), out_dtype=E4M3[0], fmax=E4M3[1], floor=FLOOR,
                                   amax=jnp.float32(2.0), interpret=True)
  s_ref = _np_scale(np.float32(2.0), E4M3[1])
  assert np.asarray(s) == s_ref
  assert _same_codes(q, _np_cast(x / s_ref, *E4M3))   # values above 2 saturate at 448
  x[3, 3] = np.nan
  _, s_nan, _ = qm.quantize_per_tensor(jnp.asarray(x), out_dtype=E4M3[0], fmax=E4M3[1],
                                       floor=FLOOR, interpret=True)
  assert np.isnan(np.asarray(s_nan))


def _kernel_eqns(fn, *args) -> list:
  """The Pallas kernel equation reached by each kernel call in fn's jaxpr, in call order: calls
  that reuse one trace reach the same equation object."""
  is_kernel = lambda eqn: eqn.primitive.name in ("mpmd_map", "pallas_call")
  return [eqn for eqn in equations(jax.make_jaxpr(fn)(*args), stop=is_kernel) if is_kernel(eqn)]


def test_one_kernel_trace_per_kernel_view():
  """Inputs of different shapes with one kernel view ((128, 64) and (2, 64, 64) are both 512
  tiles of 16, or one (1, 64, 128) block row) share one kernel trace, so a step lowers (and the
  GPU compiles) one Mosaic GPU module for them, not one per caller; another view gets its own."""
  kw = dict(out_dtype=jnp.float8_e4m3fn, fmax=448.0, floor=1e-10, interpret=True)
  a, b, c = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((128, 64), (2, 64, 64), (256, 64)))
  for f in (lambda x: qm.tile_amax(x, interpret=True),
            lambda x: qm.quantize_per_tensor(x, scale=jnp.float32(0.5), **kw)[0]):
    eqns = _kernel_eqns(lambda a, b, c: (f(a), f(b), f(c)), a, b, c)
    assert len(eqns) == 3
    assert eqns[0] is eqns[1] and eqns[2] is not eqns[0]


def test_per_tensor_scale_reaches_the_kernel_as_it_is():
  """The scale goes to the kernel as a (1,) view of itself: no padding or stacking outside the
  kernel (on the GPU a kernel launch of its own per quantize)."""
  kw = dict(out_dtype=jnp.float8_e4m3fn, fmax=448.0, floor=1e-10, interpret=True)
  fn = lambda x, s: qm.quantize_per_tensor(x, scale=s, with_transpose=True, **kw)
  jaxpr = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((128, 64), jnp.bfloat16),
                             jax.ShapeDtypeStruct((), jnp.float32))
  is_kernel = lambda eqn: eqn.primitive.name in ("mpmd_map", "pallas_call")
  names = {e.primitive.name for e in equations(jaxpr, stop=is_kernel)}
  assert names & {"mpmd_map", "pallas_call"}, names
  assert not names & {"stack", "concatenate", "pad", "broadcast_in_dim"}, names


def test_supported_and_clear_errors():
  assert qm.supported_per_group((4, 256), jnp.float32, 16)
  assert not qm.supported_per_group((4, 250), jnp.float32, 16)      # N % G
  assert not qm.supported_per_group((2, 256), jnp.float32, 16)      # 32 groups, not 64k
  assert not qm.supported_per_group((4, 256), jnp.int32, 16)
  assert qm.supported_per_tensor((2, 64, 128), jnp.bfloat16, True)
  assert not qm.supported_per_tensor((2, 64, 128), jnp.float32, True)   # layout inference
  assert qm.supported_per_tensor((2, 64, 128), jnp.float32, True, jnp.bfloat16)   # staged cast
  assert not qm.supported_per_tensor((2, 64, 128), jnp.bfloat16, True, jnp.float32)
  assert not qm.supported_per_tensor((2, 32, 128), jnp.bfloat16, True)
  with pytest.raises(ValueError, match="multiple of 16"):
    qm.quantize_per_group(jnp.ones((4, 250)), group_size=16, out_dtype=E4M3[0], fmax=448.0,
                          floor=FLOOR, interpret=True)
  with pytest.raises(ValueError, match="floating-point"):
    qm.quantize_per_group(jnp.ones((4, 256), jnp.int32), group_size=16, out_dtype=E4M3[0],
                          fmax=448.0, floor=FLOOR, interpret=True)
  with pytest.raises(ValueError, match="unsupported"):
    qm.quantize_per_tensor(jnp.ones((32, 128)), out_dtype=E4M3[0], fmax=448.0, floor=FLOOR,
                           with_transpose=True, interpret=True)
  with pytest.raises(ValueError, match="one value per group"):
    qm.dequantize_per_group(jnp.ones((4, 256), jnp.float8_e4m3fn), jnp.ones((4, 8)),
                            group_size=16, interpret=True)


def test_benchmark_script_parses_its_arguments(monkeypatch):
  from benchmarks.kernels import bench_kernels_mgpu as bench
  with pytest.raises(SystemExit) as exit_help:
    bench.main(["--help"])
  assert exit_help.value.code == 0
  with pytest.raises(SystemExit) as exit_bad:
    bench.main(["--only", "nope"])
  assert exit_bad.value.code == 2
  for shape in ("16384", "16384x0", "axb", "16384x2048,8x8"):
    with pytest.raises(SystemExit) as exit_shape:
      bench.main(["--shape", shape])
    assert exit_shape.value.code == 2
  with pytest.raises(SystemExit) as exit_flag:   # the device-time flag is known (a bad kernel
    bench.main(["--device-time", "--only", "nope"])   # name is what fails)
  assert exit_flag.value.code == 2
  # the bytes each kernel must move, one table for the plain run and the sweep: 8192 bf16
  # values (2 B), FP8 codes (1 B), 512 groups of 16 with bf16 scales or float32 maxima
  assert bench._moved_bytes((64, 128)) == {
      "per_group": 8192 * 3 + 512 * 2, "tile_amax": 8192 * 2 + 512 * 4,
      "dequantize": 8192 * 3 + 512 * 2, "per_tensor": 8192 * 3, "per_tensor_t": 8192 * 4}


@pytest.mark.gpu
def test_gpu_float32_input_quantized_as_its_bfloat16_cast():
  """cast_dtype on the GPU (a float32 weight's shape in OLMo-1B): both layouts' codes equal the
  device reference's codes of the bfloat16 cast."""
  from coat_jax import quantize as Q
  x = jnp.asarray(_inputs((2048, 8192), seed=23))
  xb = x.astype(jnp.bfloat16)
  amax = jnp.max(jnp.abs(xb))
  q, s, q_t = qm.quantize_per_tensor(x, out_dtype=E4M3[0], fmax=E4M3[1], floor=FLOOR, amax=amax,
                                     with_transpose=True, cast_dtype=jnp.bfloat16)
  ref = Q.quantize_per_tensor(xb, "e4m3", amax=amax, with_transpose=True)
  assert np.asarray(s) == np.asarray(ref.scale)
  assert _same_codes(q, ref.data) and _same_codes(q_t, ref.data_t)


@pytest.mark.gpu
def test_gpu_kernels_match_numpy_and_the_device_reference():
  """On the GPU x / scale is XLA's and Mosaic GPU's div.full.f32 (not IEEE): codes equal the jnp
  reference on the same device exactly, and the IEEE numpy reference within one code."""
  from coat_jax import quantize as Q
  x = _inputs((512, 1024), seed=18)
  q, s = qm.quantize_per_group(jnp.asarray(x), group_size=16, out_dtype=E4M3[0], fmax=E4M3[1],
                               floor=FLOOR, block=256)
  q_ref, s_ref = _np_per_group(x, 16, *E4M3)
  np.testing.assert_array_equal(np.asarray(s), s_ref)
  assert _code_steps(q, q_ref).max() <= 1
  assert _same_codes(q, Q.quantize_per_group(jnp.asarray(x), 16, "e4m3",
                                             scale_dtype=jnp.float32).data)
  # bfloat16 scales (the dispatch's): codes and scales equal the device reference's
  q, s = qm.quantize_per_group(jnp.asarray(x), group_size=16, out_dtype=E4M3[0], fmax=E4M3[1],
                               floor=FLOOR, block=256, scale_dtype=jnp.bfloat16)
  ref = Q.quantize_per_group(jnp.asarray(x), 16, "e4m3", scale_dtype=jnp.bfloat16)
  assert s.dtype == jnp.bfloat16 and _same_codes(q, ref.data)
  np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(ref.scale, np.float32))
  xb = jnp.asarray(x, jnp.bfloat16)
  x = np.array(xb.astype(jnp.float32))
  q, s, q_t = qm.quantize_per_tensor(xb, out_dtype=E4M3[0], fmax=E4M3[1], floor=FLOOR,
                                     with_transpose=True)
  ref = Q.quantize_per_tensor(xb, "e4m3", with_transpose=True)
  assert _same_codes(q, ref.data) and _same_codes(q_t, ref.data_t)
  q_np = _np_cast(x / _np_scale(np.max(np.abs(x)), E4M3[1]), *E4M3)
  assert _code_steps(q, q_np).max() <= 1
  x[7, 33] = np.nan
  x[9, 100] = np.inf
  q, s = qm.quantize_per_group(jnp.asarray(x), group_size=16, out_dtype=E4M3[0], fmax=E4M3[1],
                               floor=FLOOR, block=256)
  s = np.asarray(s)
  assert np.isnan(s[7, 2]) and np.isnan(s[9, 6]) and np.sum(np.isnan(s)) == 2
