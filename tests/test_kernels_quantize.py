"""Pallas quantize kernels vs the jnp references (bit-exact) and the dispatch vs a numpy float64
reference written from the spec (CPU interpret mode; @gpu tests compile them)."""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from coat_jax import formats, kernels, quantize
from pallas_kernels import quantize as pk

FLOOR = formats.ACTIVATION_SCALE_FLOOR
DTYPES = {"e4m3": jnp.dtype(jnp.float8_e4m3fn), "e5m2": jnp.dtype(jnp.float8_e5m2)}
FMAX = {"e4m3": 448.0, "e5m2": 57344.0}   # the formats' largest values (OCP FP8 spec)


def pk_group(x, g, fmt, **kw):
  """The kernel's plain arrays wrapped as the reference's QuantizedArray (for comparisons)."""
  data, scale = pk.quantize_per_group(x, g, dtype=DTYPES[fmt], floor=FLOOR, interpret=INTERPRET,
                                      **kw)
  return quantize.QuantizedArray(data, scale, fmt, g)


def pk_tensor(x, fmt, *, amax=None, with_transpose=False, **kw):
  if amax is None:
    amax = jnp.max(pk.tile_amax(x, interpret=INTERPRET))
  scale = jax.jit(quantize.scale_from_amax, static_argnums=(1, 2))(amax, fmt, FLOOR)
  data, data_t = pk.quantize_per_tensor(x, scale, dtype=DTYPES[fmt],
                                        with_transpose=with_transpose, interpret=INTERPRET, **kw)
  return quantize.QuantizedArray(data, scale, fmt, 0, data_t)


def np_quantize(x, fmt, group_size):
  """Spec, numpy float64: scale = max(amax / fmax, 1e-10) per group of G along the last axis
  (group_size 0: per tensor), q = round-to-nearest-even(clip(x / scale, +-fmax)). Returns
  (q as float64, scale float64)."""
  x = np.asarray(x, np.float64)
  if group_size == 0:
    amax = np.abs(x).max()
    scale = max(amax / FMAX[fmt], FLOOR)
    y = x / scale
  else:
    n = x.shape[-1]
    pad = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -n % group_size)])
    xg = pad.reshape(*x.shape[:-1], -1, group_size)
    scale = np.maximum(np.abs(xg).max(-1) / FMAX[fmt], FLOOR)
    y = (xg / scale[..., None]).reshape(pad.shape)[..., :n]
  q = np.clip(y, -FMAX[fmt], FMAX[fmt]).astype(getattr(ml_dtypes, DTYPES[fmt].name))
  return q.astype(np.float64), np.asarray(scale)


def _ordinal(q):
  """FP8 values -> integers in value order (sign-magnitude bits), for "codes differ by <= 1"."""
  b = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(q), jnp.uint8)).astype(np.int32)
  return np.where(b & 0x80, -(b & 0x7F), b & 0x7F)


def assert_matches_spec(got, x, fmt, group_size):
  """got (a QuantizedArray) vs the float64 spec: scales to 4 float32 ulps; codes equal except
  where the float32 quotient x / scale rounds onto a tie of the FP8 grid (float64 does not), so
  at most one code step apart and in at most 1% of elements."""
  want_q, want_s = np_quantize(x, fmt, group_size)
  np.testing.assert_allclose(np.asarray(got.scale, np.float64), want_s, rtol=4 * 2.0**-23)
  want_fp8 = want_q.astype(getattr(ml_dtypes, DTYPES[fmt].name))
  d = np.abs(_ordinal(got.data) - _ordinal(jnp.asarray(want_fp8)))
  assert d.max() <= 1, f"codes differ by {d.max()} steps"
  assert (d > 0).mean() <= 0.01, f"{(d > 0).mean():.2%} of codes differ"
  assert np.isfinite(np.asarray(got.data, np.float32)).all()

INTERPRET = jax.default_backend() != "gpu"

# The references as they run in training: under jit (XLA turns amax / fmt.max into a multiply by
# f32(1 / fmt.max); op-by-op eager evaluation divides instead, which can differ in the last bit).
ref_per_group = jax.jit(quantize.quantize_per_group, static_argnums=(1, 2))
ref_per_tensor = jax.jit(quantize.quantize_per_tensor, static_argnums=(1,),
                         static_argnames=("with_transpose",))
ref_dequantize = jax.jit(quantize.dequantize, static_argnums=(1,))


def _bits(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def _assert_same_q(got, want):
  assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
  np.testing.assert_array_equal(_bits(got.data), _bits(want.data))
  np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))
  assert got.fmt == want.fmt and got.group_size == want.group_size


def _inputs(rng, shape, dtype):
  """Random values spanning many binades, with a few near/over the format limits."""
  x = rng.standard_normal(shape) * np.exp2(rng.integers(-12, 12, shape))
  return jnp.asarray(x, dtype)


@pytest.mark.parametrize("shape,g,fmt,dtype", [
    ((40, 96), 16, "e4m3", jnp.bfloat16),      # 240 groups: block shrinks to 16
    ((3, 5, 48), 16, "e5m2", jnp.float32),     # leading dims, odd row count
    ((33, 256), 32, "e4m3", jnp.float32),
])
def test_per_group_bit_exact(rng, shape, g, fmt, dtype):
  x = _inputs(rng, shape, dtype)
  got = pk_group(x, g, fmt, block=16)
  want = ref_per_group(x, g, fmt)
  _assert_same_q(got, want)
  assert_matches_spec(got, x, fmt, g)
  back = pk.dequantize_per_group(got.data, got.scale, g, jnp.float32, interpret=INTERPRET,
                                 block=16)
  spec_back = np.asarray(got.data, np.float64) * np.repeat(np.asarray(got.scale, np.float64), g, -1)
  np.testing.assert_allclose(np.asarray(back, np.float64), spec_back, rtol=2.0**-23)
  np.testing.assert_array_equal(np.asarray(back), np.asarray(ref_dequantize(want, jnp.float32)))


def test_per_group_nan_group_and_limits(rng):
  x = np.array(_inputs(rng, (8, 64), jnp.float32))
  x[1, 3] = np.nan                       # group (1, 0) gets a NaN scale
  x[2, 20] = np.inf                      # group (2, 1) too
  x[3, :16] = 0.0                        # all-zero group: floor scale
  x[4, 16:32] = 448.0 * np.array([1, -1] * 8)   # exactly at the format limit
  x = jnp.asarray(x)
  got = pk_group(x, 16, "e4m3")
  want = ref_per_group(x, 16, "e4m3")
  _assert_same_q(got, want)
  assert np.isnan(np.asarray(got.scale)[1, 0]) and np.isnan(np.asarray(got.scale)[2, 1])
  assert np.isfinite(np.asarray(got.scale)[0]).all()


@pytest.mark.parametrize("shape,fmt,dtype,transpose", [
    ((48, 80), "e4m3", jnp.bfloat16, True),   # blocks shrink to divide 48 and 80
    ((40, 80), "e4m3", jnp.bfloat16, False),  # 40 rows: blocks shrink to divide (8 x 16)
    ((2, 32, 48), "e5m2", jnp.float32, True), # batched transpose
    ((7, 48), "e4m3", jnp.float32, False),
])
def test_per_tensor_bit_exact(rng, shape, fmt, dtype, transpose):
  x = _inputs(rng, shape, dtype)
  got = pk_tensor(x, fmt, with_transpose=transpose, block_rows=16, block_cols=32)
  want = ref_per_tensor(x, fmt, with_transpose=transpose)
  _assert_same_q(got, want)
  assert_matches_spec(got, x, fmt, 0)
  if transpose:
    np.testing.assert_array_equal(_bits(got.data_t), _bits(want.data_t))
  else:
    assert got.data_t is None


def test_stage1_and_nan_tensor(rng):
  x = np.array(_inputs(rng, (12, 64), jnp.float32))
  p = pk.tile_amax(jnp.asarray(x), interpret=INTERPRET, block=8)
  np.testing.assert_array_equal(np.asarray(p), np.abs(x).reshape(12, 4, 16).max(-1))
  x[5, 7] = np.nan
  got = pk_tensor(jnp.asarray(x), "e4m3")
  assert np.isnan(float(got.scale))
  given = pk_tensor(jnp.asarray(x[:4]), "e4m3", amax=jnp.float32(3.0))
  _assert_same_q(given, ref_per_tensor(jnp.asarray(x[:4]), "e4m3",
                                                     amax=jnp.float32(3.0)))


def test_unsupported_shapes_raise_and_dispatch_matches_spec(rng):
  x = _inputs(rng, (4, 40), jnp.float32)       # 40 % 16 != 0
  with pytest.raises(ValueError, match="multiple of 16"):
    pk.quantize_per_group(x, 16, dtype=DTYPES["e4m3"], floor=FLOOR, interpret=True)
  with pytest.raises(ValueError, match="multiple of 16"):
    pk.quantize_per_tensor(x, jnp.float32(1.0), dtype=DTYPES["e4m3"], interpret=True)
  with pytest.raises(ValueError, match="float8"):
    pk.quantize_per_tensor(x[:, :32], jnp.float32(1.0), dtype=jnp.int8, interpret=True)
  y = _inputs(rng, (40, 32), jnp.float32)      # transposing needs M % 16 == 0
  with pytest.raises(ValueError, match="second-last"):
    pk.quantize_per_tensor(y, jnp.float32(1.0), dtype=DTYPES["e4m3"], with_transpose=True,
                           interpret=True)
  assert not pk.supported_per_tensor(y, True) and pk.supported_per_tensor(y, False)
  assert not pk.supported_per_group(x, 16) and not pk.supported_per_tensor(x, False)
  assert not pk.supported_per_group(y, 16, jnp.int8)
  x48 = _inputs(rng, (4, 48), jnp.float32)
  for backend in ("pallas", "reference"):       # unsupported (x) and supported (x48) shapes
    with kernels.backend(backend):
      for a in (x, x48):
        g = 16                                   # x: a short final group (reference)
        assert_matches_spec(jax.jit(lambda a: kernels.quantize_per_group(a, g, "e4m3"))(a),
                            a, "e4m3", g)
        assert_matches_spec(jax.jit(lambda a: kernels.quantize_per_tensor(a, "e5m2"))(a),
                            a, "e5m2", 0)


def test_dispatch_uses_kernels(rng):
  x = _inputs(rng, (16, 32), jnp.bfloat16)
  with kernels.backend("pallas"):
    q = kernels.quantize_per_group(x, 16, "e4m3")
    t = kernels.quantize_per_tensor(x, "e5m2", with_transpose=True)
    d = kernels.dequantize(q, jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda a: kernels.quantize_per_group(a, 16).data)(x))
  assert "pallas_call" in jaxpr
  assert_matches_spec(q, x, "e4m3", 16)
  assert_matches_spec(t, x, "e5m2", 0)
  np.testing.assert_array_equal(_ordinal(t.data_t), _ordinal(t.data).T)
  spec_d = np.asarray(q.data, np.float64) * np.repeat(np.asarray(q.scale, np.float64), 16, -1)
  np.testing.assert_allclose(np.asarray(d, np.float64), spec_d, rtol=2.0**-23)


def test_backend_context_keys_jit_cache(rng):
  """The same jitted function traces once per backend: Pallas under "pallas", none under
  "reference", in one process."""
  x = _inputs(rng, (16, 32), jnp.float32)
  traces = []

  @jax.jit
  def f(a):
    traces.append(kernels.current_backend()["quantize"])
    return kernels.quantize_per_group(a, 16).data

  with kernels.backend("pallas"):
    f(x)
    assert "pallas_call" in str(jax.make_jaxpr(f)(x))
  with kernels.backend("reference"):
    f(x)
    assert "pallas_call" not in str(jax.make_jaxpr(f)(x))
  with kernels.backend("quantize=pallas"):
    f(x)
  assert traces[:1] == ["pallas"] and "reference" in traces
  assert traces.count("pallas") >= 2   # the per-family form traced again
  before = kernels.current_backend()
  try:   # the process-wide form keys the cache too
    g_traces = []

    @jax.jit
    def g(a):
      g_traces.append(kernels.current_backend()["quantize"])
      return kernels.quantize_per_group(a, 16).data

    kernels.set_backend("reference")
    g(x)
    kernels.set_backend("pallas")
    g(x)
    g(x)
    assert g_traces == ["reference", "pallas"]
  finally:
    kernels.set_backend(",".join(f"{k}={v}" for k, v in before.items()))
  assert kernels.current_backend() == before
  with pytest.raises(ValueError, match="unknown kernel backend"):
    kernels.backend("quantize=fast")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1008, 4096), (4, 336, 1024), (1000, 512)])
def test_gpu_bit_exact_compiled(rng, shape):
  x = _inputs(rng, shape, jnp.bfloat16)
  if not pk.supported_per_tensor(x, True):   # (1000, 512): tails, no transpose
    _assert_same_q(pk_tensor(x, "e4m3"), ref_per_tensor(x, "e4m3"))
    _assert_same_q(pk_group(x, 16, "e4m3"), ref_per_group(x, 16, "e4m3"))
    return
  for fmt in ("e4m3", "e5m2"):
    _assert_same_q(pk_group(x, 16, fmt), jax.jit(quantize.quantize_per_group,
                                                 static_argnums=(1, 2))(x, 16, fmt))
    got = pk_tensor(x, fmt, with_transpose=True)
    want = jax.jit(quantize.quantize_per_tensor, static_argnums=(1,),
                   static_argnames=("with_transpose",))(x, fmt, with_transpose=True)
    _assert_same_q(got, want)
    np.testing.assert_array_equal(_bits(got.data_t), _bits(want.data_t))
  q = pk_group(x, 16, "e4m3")
  np.testing.assert_array_equal(np.asarray(pk.dequantize_per_group(q.data, q.scale, 16)),
                                np.asarray(jax.jit(quantize.dequantize)(q)))

