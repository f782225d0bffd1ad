"""Round-trip error of the quantizers against float64, edge cases, bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import formats, quantize as qz

# Relative RMS error of one round trip of N(0,1) data is set by the mantissa: ~2^-(m+1)/sqrt(3)
# per element for values in the normal range. Bounds leave ~2x headroom over what is measured.
RT_BOUND = {"e4m3": 0.04, "e5m2": 0.08, "int8": 0.03}


def _rel(a, ref):
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  return np.linalg.norm(a - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "int8"])
@pytest.mark.parametrize("granularity", [0, 16, 128])
def test_round_trip_error(rng, fmt, granularity):
  x64 = rng.standard_normal((33, 300)) * np.exp(rng.uniform(-3, 3))
  x = jnp.asarray(x64, jnp.float32)
  out = qz.fake_quantize(x, fmt, granularity)
  assert np.all(np.isfinite(out))
  err = _rel(out, x64)
  # per-tensor int8 is coarse for Gaussian tails: allow its known ~2.5x larger error
  bound = RT_BOUND[fmt] * (3 if (fmt == "int8" and granularity == 0) else 1)
  assert 0 < err < bound, (fmt, granularity, err)


def test_per_group_beats_per_tensor_on_outlier_rows(rng):
  x = rng.standard_normal((64, 256)).astype(np.float32)
  x[3] *= 1e5  # one outlier token: per-tensor scaling pushes the other rows under E4M3's range
  x = jnp.asarray(x)
  e_tensor = _rel(qz.fake_quantize(x, "e4m3", 0)[4:], np.asarray(x)[4:])
  e_group = _rel(qz.fake_quantize(x, "e4m3", 16)[4:], np.asarray(x)[4:])
  assert e_tensor > 0.2 and e_group < RT_BOUND["e4m3"]


def test_saturation_instead_of_nan():
  x = jnp.array([1000.0, -1e6, 448.0, 3.0], jnp.float32)
  out = formats.saturating_cast(x, "e4m3").astype(jnp.float32)
  np.testing.assert_array_equal(out, [448.0, -448.0, 448.0, 3.0])
  out = formats.saturating_cast(jnp.array([1e9]), "e5m2").astype(jnp.float32)
  assert float(out[0]) == 57344.0


def test_tail_zero_constant_and_subnormal_groups(rng):
  x = np.zeros((3, 37), np.float32)
  x[1] = 2.5  # constant row
  x[2] = rng.standard_normal(37).astype(np.float32) * 1e-40  # float32 subnormals
  q = qz.quantize_per_group(jnp.asarray(x), 16)
  assert q.scale.shape == (3, 3)
  out = np.asarray(q.dequantize())
  assert np.all(np.isfinite(out)) and np.all(np.isfinite(q.scale))
  np.testing.assert_array_equal(out[0], 0.0)
  # the constant row maps onto fmt.max with its scale as stored: exact with float32 scales,
  # within the bfloat16 scale's rounding (2^-9) with the default
  np.testing.assert_allclose(out[1], 2.5, rtol=2.0**-9)
  exact = qz.quantize_per_group(jnp.asarray(x), 16, scale_dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(exact.dequantize())[1], 2.5, rtol=1e-6)
  assert q.scale.dtype == formats.ACTIVATION_SCALE_DTYPE and exact.scale.dtype == jnp.float32
  assert np.all(np.abs(out[2]) <= 1e-38)


def test_non_finite_input_is_not_hidden(rng):
  x = jnp.asarray(rng.standard_normal((2, 32)).astype(np.float32)).at[0, 5].set(jnp.inf)
  q = qz.quantize_per_group(x, 16)
  assert np.isnan(q.scale[0, 0]) and np.all(np.isfinite(q.scale[1]))
  assert np.all(np.isnan(q.dequantize()[0, :16]))
  assert np.isnan(qz.quantize_per_tensor(x.at[1, 1].set(jnp.nan)).scale)


def test_two_stage_amax_equals_max(rng):
  x = jnp.asarray(rng.standard_normal((5, 70)).astype(np.float32))
  amax, partial = qz.amax_two_stage(x, 16)
  assert partial.shape == (5, 5)
  assert float(amax) == float(jnp.max(jnp.abs(x)))


def test_transpose_copy_and_jit(rng):
  x = jnp.asarray(rng.standard_normal((4, 8, 32)).astype(np.float32))
  q = jax.jit(lambda x: qz.quantize_per_tensor(x, with_transpose=True))(x)
  np.testing.assert_array_equal(np.asarray(q.data_t, np.float32),
                                np.swapaxes(np.asarray(q.data, np.float32), -1, -2))


@pytest.mark.parametrize("bad", [
    lambda: qz.quantize_per_group(jnp.ones((4, 4)), 0),
    lambda: qz.quantize_per_group(jnp.ones((4, 4)), 16, "e3m4"),
    lambda: qz.quantize_per_tensor(jnp.ones((4, 4), jnp.int32)),
])
def test_bad_arguments(bad):
  with pytest.raises(ValueError):
    bad()


CODE_DTYPE = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2, "int8": jnp.int8}
FMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0}


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "int8"])
@pytest.mark.parametrize("granularity", [0, 16])
def test_codes_dtype_and_scale_target(rng, fmt, granularity):
  """The codes are the format's dtype; the scale is amax / fmt.max (per group: as rounded to its
  bfloat16 storage), so each group's largest magnitude is stored as +-fmt.max; the round-trip
  error is that of an 8-bit format, not a finer one (above RT_BOUND / 10: bfloat16 is ~1e-3)."""
  x64 = rng.standard_normal((8, 64)) * np.exp(rng.uniform(-3, 3))
  x = jnp.asarray(x64, jnp.float32)
  q = qz.quantize_per_tensor(x, fmt) if granularity == 0 else qz.quantize_per_group(
      x, granularity, fmt, scale_dtype=jnp.float32)
  assert q.data.dtype == CODE_DTYPE[fmt] and q.fmt == fmt
  a = np.abs(np.asarray(x, np.float64))
  amax = a.max() if granularity == 0 else a.reshape(8, -1, granularity).max(-1)
  np.testing.assert_allclose(np.asarray(q.scale, np.float64), amax / FMAX[fmt], rtol=1e-6)
  codes = np.abs(np.asarray(q.data, np.float64))
  top = codes.max() if granularity == 0 else codes.reshape(8, -1, granularity).max(-1)
  np.testing.assert_array_equal(top, FMAX[fmt])
  if granularity:   # the default bfloat16 scales: amax / fmt.max rounded to bfloat16
    stored = qz.quantize_per_group(x, granularity, fmt).scale
    want = jnp.asarray(amax / FMAX[fmt], jnp.float32).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(stored, np.float32), np.asarray(want, np.float32))
  err = _rel(q.dequantize(), x64)
  assert RT_BOUND[fmt] / 10 < err < RT_BOUND[fmt] * (3 if fmt == "int8" and not granularity else 1)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "int8"])
def test_representable_values_round_trip_exactly(rng, fmt):
  """Values on the format's grid times a power-of-two scale (each group's largest one fmt.max
  times that scale) come back exactly, per tensor and per group."""
  codes = np.asarray(jnp.asarray(rng.uniform(-FMAX[fmt], FMAX[fmt], (4, 32)), jnp.float32)
                     .astype(CODE_DTYPE[fmt]), np.float64)
  codes[:, ::16] = FMAX[fmt]    # every group of 16 reaches fmt.max: scale = 2^e exactly
  x = jnp.asarray(codes * 2.0 ** -5, jnp.float32)
  for q in (qz.quantize_per_tensor(x, fmt), qz.quantize_per_group(x, 16, fmt)):
    assert q.data.dtype == CODE_DTYPE[fmt]
    np.testing.assert_array_equal(np.asarray(q.dequantize(), np.float64), codes * 2.0 ** -5)


@pytest.mark.parametrize("group_size,n", [(4, 26), (16, 112), (3, 20)])
def test_expand_groups_is_a_broadcast(group_size, n, rng):
  """Per-group values repeated along the last axis and trimmed: numpy's repeat, made of a
  broadcast and a reshape (no gather over the whole activation in the dequantize)."""
  x = jnp.asarray(rng.standard_normal((3, 5, -(-n // group_size))), jnp.float32)
  got = qz.expand_groups(x, group_size, n)
  np.testing.assert_array_equal(np.asarray(got),
                                np.repeat(np.asarray(x), group_size, axis=-1)[..., :n])
  prims = {e.primitive.name for e in jax.make_jaxpr(
      lambda a: qz.expand_groups(a, group_size, n))(x).jaxpr.eqns}
  assert prims <= {"broadcast_in_dim", "reshape", "slice"}, prims
