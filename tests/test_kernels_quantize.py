"""Pallas quantize kernels vs the jnp references (CPU interpret mode; @gpu tests compile them)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import kernels, quantize
from pallas_kernels import quantize as pk

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
  got = pk.quantize_per_group(x, g, fmt, interpret=INTERPRET, block=16)
  want = ref_per_group(x, g, fmt)
  _assert_same_q(got, want)
  back = pk.dequantize_per_group(got, jnp.float32, interpret=INTERPRET, block=16)
  np.testing.assert_array_equal(np.asarray(back), np.asarray(ref_dequantize(want, jnp.float32)))


def test_per_group_nan_group_and_limits(rng):
  x = np.array(_inputs(rng, (8, 64), jnp.float32))
  x[1, 3] = np.nan                       # group (1, 0) gets a NaN scale
  x[2, 20] = np.inf                      # group (2, 1) too
  x[3, :16] = 0.0                        # all-zero group: floor scale
  x[4, 16:32] = 448.0 * np.array([1, -1] * 8)   # exactly at the format limit
  x = jnp.asarray(x)
  got = pk.quantize_per_group(x, 16, "e4m3", interpret=INTERPRET)
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
  got = pk.quantize_per_tensor(x, fmt, with_transpose=transpose, interpret=INTERPRET,
                               block_rows=16, block_cols=32)
  want = ref_per_tensor(x, fmt, with_transpose=transpose)
  _assert_same_q(got, want)
  if transpose:
    np.testing.assert_array_equal(_bits(got.data_t), _bits(want.data_t))
  else:
    assert got.data_t is None


def test_stage1_and_nan_tensor(rng):
  x = np.array(_inputs(rng, (12, 64), jnp.float32))
  p = pk.tile_amax(jnp.asarray(x), interpret=INTERPRET, block=8)
  np.testing.assert_array_equal(np.asarray(p), np.asarray(quantize.group_amax(jnp.asarray(x), 16)))
  x[5, 7] = np.nan
  got = pk.quantize_per_tensor(jnp.asarray(x), "e4m3", interpret=INTERPRET)
  assert np.isnan(float(got.scale))
  given = pk.quantize_per_tensor(jnp.asarray(x[:4]), "e4m3", amax=jnp.float32(3.0),
                                 interpret=INTERPRET)
  _assert_same_q(given, ref_per_tensor(jnp.asarray(x[:4]), "e4m3",
                                                     amax=jnp.float32(3.0)))


def test_unsupported_shapes_raise_and_dispatch_falls_back(rng):
  x = _inputs(rng, (4, 40), jnp.float32)       # 40 % 16 != 0
  with pytest.raises(ValueError, match="multiple of 16"):
    pk.quantize_per_group(x, 16, "e4m3", interpret=True)
  with pytest.raises(ValueError, match="multiple of 16"):
    pk.quantize_per_tensor(x, "e4m3", interpret=True)
  y = _inputs(rng, (40, 32), jnp.float32)      # transposing needs M % 16 == 0
  with pytest.raises(ValueError, match="second-last"):
    pk.quantize_per_tensor(y, "e4m3", with_transpose=True, interpret=True)
  assert not pk.supported_per_tensor(y, True) and pk.supported_per_tensor(y, False)
  assert not pk.supported_per_group(x, 16) and not pk.supported_per_tensor(x, False)
  with kernels.backend("pallas"):
    fallback_g = jax.jit(lambda a: kernels.quantize_per_group(a, 16, "e4m3"))(x)
    fallback_t = jax.jit(lambda a: kernels.quantize_per_tensor(a, "e4m3"))(x)
  _assert_same_q(fallback_g, ref_per_group(x, 16, "e4m3"))
  _assert_same_q(fallback_t, ref_per_tensor(x, "e4m3"))


def test_dispatch_uses_kernels(rng):
  x = _inputs(rng, (16, 32), jnp.bfloat16)
  with kernels.backend("pallas"):
    q = kernels.quantize_per_group(x, 16, "e4m3")
    t = kernels.quantize_per_tensor(x, "e5m2", with_transpose=True)
    d = kernels.dequantize(q, jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(lambda a: kernels.quantize_per_group(a, 16).data)(x))
  assert "pallas_call" in jaxpr
  _assert_same_q(q, ref_per_group(x, 16, "e4m3"))
  _assert_same_q(t, ref_per_tensor(x, "e5m2", with_transpose=True))
  np.testing.assert_array_equal(np.asarray(d, np.float32),
                                np.asarray(ref_dequantize(q, jnp.bfloat16), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1008, 4096), (4, 336, 1024), (1000, 512)])
def test_gpu_bit_exact_compiled(rng, shape):
  x = _inputs(rng, shape, jnp.bfloat16)
  if not pk.supported_per_tensor(x, True):   # (1000, 512): tails, no transpose
    _assert_same_q(pk.quantize_per_tensor(x, "e4m3"), ref_per_tensor(x, "e4m3"))
    _assert_same_q(pk.quantize_per_group(x, 16, "e4m3"), ref_per_group(x, 16, "e4m3"))
    return
  for fmt in ("e4m3", "e5m2"):
    _assert_same_q(pk.quantize_per_group(x, 16, fmt), jax.jit(quantize.quantize_per_group,
                                                              static_argnums=(1, 2))(x, 16, fmt))
    got = pk.quantize_per_tensor(x, fmt, with_transpose=True)
    want = jax.jit(quantize.quantize_per_tensor, static_argnums=(1,),
                   static_argnames=("with_transpose",))(x, fmt, with_transpose=True)
    _assert_same_q(got, want)
    np.testing.assert_array_equal(_bits(got.data_t), _bits(want.data_t))
  q = pk.quantize_per_group(x, 16)
  np.testing.assert_array_equal(np.asarray(pk.dequantize_per_group(q, jnp.float32)),
                                np.asarray(jax.jit(quantize.dequantize)(q)))

