"""Dynamic range expansion (COAT) for FP8 optimizer states, in a compact stored form.

Per group of G consecutive elements along one axis, the group axis (default the last; a short
final group when that axis' length N % G != 0; a 0-d array is one group of one), COAT maps a
moment x onto a quantization format `fmt` as

  mx = max|x| + 1e-30,  mn = min over the NON-ZERO |x| + 1e-30,  c = sqrt(mx) * sqrt(mn),
  k  = floor(log2(R) / log2(mx / mn) * expand_min) / expand_min,
  y  = sign(x) |x / c|^k,  s = (mx / c)^k / fmt.max,  q = cast(y / s),

with R the range the expanded group may span (`expansion_range`). Since (|x|/c)^k / (mx/c)^k =
(|x|/mx)^k, the centre cancels:

  q = sign(x) * fmt.max * (|x| / mx)^k,     x = sign(q) * mx * (|q| / fmt.max)^(1/k).

So the stored form keeps per group only `amax` = mx (float32) and `k_code` = k * expand_min
(uint8, clipped to [1, 255]): 5 bytes per group instead of COAT's 12 (scale, k, c as float32).
Capping k lower is always safe: it only shrinks the expanded range. Powers are computed as
exp2 of a sum of log2s in float32 (exp2(k (log2|x| - log2 mx)), exp2(log2 mx + log2(|q|/fmax)/k)),
so no intermediate ratio or power underflows even for groups spanning more than float32's range;
their relative error is ~1e-6 (~5e-6 for amax near float32's limits), far below the format's
rounding.

Group axis: `axis` (negative, -ndim..-1) of the functions below. Groups run along that axis in
the array's own layout: x of shape S = (..., N, rest) groups as the free reshape
(..., ceil(N/G), G, rest), the per-group reductions run over the G axis, and the metadata has
shape (..., ceil(N/G), rest) (`metadata_shape`). axis=-2 on a Flax (in, out) kernel is COAT's
layout (G consecutive input features of each output column); axis=-1 groups along the last axis.

Guards: an all-zero group or a constant group (mx == mn) gets k = 1 (any k is exact there);
zeros stay exactly zero; NaN/inf in a group give a NaN `amax` (dequantizes to NaN, never hidden)
and k = 1. Subnormal inputs are fine (they fall under the 1e-30 floor and quantize to zero).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from coat_jax import formats
from coat_jax.formats import Format, get_format

AMAX_FLOOR = formats.OPTIMIZER_SCALE_FLOOR  # 1e-30, added to max and min (COAT's value)
MAX_K_CODE = 255


class ExpandedMoment(NamedTuple):
  """One optimizer moment in FP8 (or INT8) with compact per-group expansion metadata.

  Attributes:
    data: quantized values, dtype fmt.dtype (float8_e4m3fn / float8_e5m2 / int8), the param's shape.
    amax: float32, `metadata_shape(shape, G, axis)`: the param's shape with the group axis' N
      replaced by ceil(N / G) (`(1,)` for a 0-d param): max|x| + 1e-30.
    k_code: uint8, same shape as amax: the exponent k = k_code / expand_min.
  """
  data: jax.Array
  amax: jax.Array
  k_code: jax.Array


def expansion_range(fmt: str | Format) -> float:
  """R, the largest max/min ratio an expanded group may span in `fmt`.

  Float formats: fmt.max^2 / 2 (COAT's rule for E4M3, 448^2/2; the same rule for E5M2). The
  group's smallest non-zero value then lands at fmt.max / R = 2 / fmt.max (0.0045 in E4M3,
  3.5e-5 in E5M2), above each format's smallest subnormal (2^-9, 2^-16).
  INT8: codes are uniform (step 1), so the float rule would flush small values to 0. R = 127 / 4
  keeps the smallest value at >= 4 codes (rounding error <= 12.5% there). On Adam moments of a
  small char LM (tests/test_expansion.py) R = 127/4 gave lower error than 127/2 for v (~1.5x) and
  about the same for m; R = 16 or 127 were no better overall, R >= 254 much worse.
  """
  f = get_format(fmt)
  return f.max * f.max / 2.0 if f.is_float else f.max / 4.0


def _check_args(x, group_size, expand_min):
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"expansion: expected a floating-point array, got dtype {x.dtype}")
  if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
    raise ValueError(f"group_size must be a positive int, got {group_size!r}")
  if not isinstance(expand_min, int) or isinstance(expand_min, bool) or expand_min <= 0:
    raise ValueError(f"expand_min must be a positive int, got {expand_min!r}")


def _axis(shape, axis: int) -> int:
  """The group axis as a positive index into `shape` (0 for a 0-d shape, seen as (1,))."""
  ndim = max(len(shape), 1)
  if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
    raise ValueError(f"expansion: group axis {axis!r} is out of range for shape {tuple(shape)}")
  return axis % ndim


def num_groups(shape: tuple[int, ...], group_size: int, axis: int = -1) -> int:
  """Groups along the group axis: ceil(N / G) (1 for a 0-d shape)."""
  n = shape[_axis(shape, axis)] if len(shape) else 1
  return -(-n // group_size)


def metadata_shape(shape: tuple[int, ...], group_size: int, axis: int = -1) -> tuple[int, ...]:
  """Shape of `amax` / `k_code` for a param of `shape`: N on the group axis -> ceil(N / G)."""
  if not len(shape):
    return (1,)
  a = _axis(shape, axis)
  return tuple(shape[:a]) + (num_groups(shape, group_size, axis),) + tuple(shape[a + 1:])


def _to_groups(x: jax.Array, group_size: int, axis: int = -1) -> tuple[jax.Array, int]:
  """(float32 (..., ceil(N/G), G, rest) zero-padded on the last group, the G axis' index)."""
  x = x.astype(jnp.float32)
  if x.ndim == 0:
    x = x.reshape(1)
  a = _axis(x.shape, axis)
  pad = (-x.shape[a]) % group_size
  if pad:
    x = jnp.pad(x, [(0, pad) if i == a else (0, 0) for i in range(x.ndim)])
  return x.reshape(*x.shape[:a], -1, group_size, *x.shape[a + 1:]), a + 1


def _from_groups(xg: jax.Array, shape: tuple[int, ...], gax: int) -> jax.Array:
  """The inverse of `_to_groups` (gax: the G axis' index there)."""
  a = gax - 1
  n = shape[a] if len(shape) else 1
  x = xg.reshape(*xg.shape[:a], -1, *xg.shape[gax + 1:])
  return jax.lax.slice_in_dim(x, 0, n, axis=a).reshape(shape)


def _group_max_min(a: jax.Array, gax: int = -1) -> tuple[jax.Array, jax.Array]:
  """(mx, mn) of |x| per group (axis `gax` of `a` = |x| grouped): max + 1e-30, min non-zero + 1e-30.

  A group with no non-zero value gets mn = mx.
  """
  mx = jnp.max(a, axis=gax) + jnp.float32(AMAX_FLOOR)
  mn_nz = jnp.min(jnp.where(a > 0, a, jnp.inf), axis=gax)
  mn = jnp.where(mn_nz == jnp.inf, mx, mn_nz + jnp.float32(AMAX_FLOOR))
  return mx, mn


def _k_steps(mx: jax.Array, mn: jax.Array, fmt: Format, expand_min: int) -> jax.Array:
  """floor(log2(R) / log2(mx/mn) * expand_min) as float32; expand_min (k = 1) where mx/mn <= 1."""
  lr = jnp.log2(mx / mn)
  ok = lr > 0  # False for constant / all-zero groups and for NaN
  steps = jnp.floor(jnp.float32(math.log2(expansion_range(fmt))) / jnp.where(ok, lr, 1.0)
                    * jnp.float32(expand_min))
  return jnp.where(ok, steps, jnp.float32(expand_min))


def quantize_expanded(x: jax.Array, fmt: str | Format = "e4m3", group_size: int = 128,
                      expand_min: int = 16, expand: bool = True,
                      axis: int = -1) -> ExpandedMoment:
  """Quantizes `x` per group with dynamic range expansion into the compact stored form.

  Args:
    x: floating array, any shape (groups along `axis`).
    fmt: "e4m3" | "e5m2" | "int8" (or a Format).
    group_size: G.
    expand_min: k is a multiple of 1/expand_min (k_code = k * expand_min, clipped to [1, 255]).
    expand: False gives plain per-group max scaling (q = x / (mx / fmt.max)), stored with k = 1.
    axis: the group axis (negative; see the module docstring).
  Returns:
    ExpandedMoment(data: fmt.dtype x.shape, amax: float32, k_code: uint8; metadata_shape).
  """
  _check_args(x, group_size, expand_min)
  f = get_format(fmt)
  xg, gax = _to_groups(x, group_size, axis)
  per_group = lambda t: jnp.expand_dims(t, gax)   # metadata broadcast over its group
  a = jnp.abs(xg)
  if expand:
    mx, mn = _group_max_min(a, gax)
    steps = jnp.clip(_k_steps(mx, mn, f, expand_min), 1, MAX_K_CODE)
    k = per_group(steps / jnp.float32(expand_min))
    # log2|x| - log2(mx), not log2(|x| / mx): the ratio underflows float32 for groups spanning
    # more than ~2^149 (after a huge gradient, coat_jax/adam_math.py), the difference does not.
    mag = jnp.float32(f.max) * jnp.exp2(k * (jnp.log2(a) - per_group(jnp.log2(mx))))
    qg = formats.saturating_cast(jnp.sign(xg) * mag, f)
  else:
    mx = jnp.max(a, axis=gax) + jnp.float32(AMAX_FLOOR)
    steps = jnp.full(mx.shape, min(expand_min, MAX_K_CODE), jnp.float32)
    qg = formats.saturating_cast(xg / per_group(mx / jnp.float32(f.max)), f)
  k_code = steps.astype(jnp.uint8)
  return ExpandedMoment(_from_groups(qg, x.shape, gax), mx, k_code)


def dequantize_expanded(m: ExpandedMoment, fmt: str | Format = "e4m3", group_size: int = 128,
                        expand_min: int = 16, axis: int = -1) -> jax.Array:
  """x = sign(q) * mx * (|q| / fmt.max)^(1/k) per group (exactly q * mx / fmt.max where k = 1).

  axis: the group axis m was quantized along. Returns float32 of m.data's shape.
  """
  f = get_format(fmt)
  shape = m.data.shape
  if m.amax.shape != metadata_shape(shape, group_size, axis):
    raise ValueError(f"dequantize_expanded: amax of shape {m.amax.shape} does not group data of "
                     f"shape {shape} in groups of {group_size} along axis {axis} (expected "
                     f"{metadata_shape(shape, group_size, axis)}): a state of another group axis?")
  qg, gax = _to_groups(m.data, group_size, axis)
  qa = jnp.abs(qg)
  mx = jnp.expand_dims(m.amax.astype(jnp.float32), gax)
  code = jnp.expand_dims(m.k_code.astype(jnp.float32), gax)
  inv_k = jnp.float32(expand_min) / code
  # exp2(log2(mx) + ...), not mx * exp2(...): the power alone underflows float32 where a group
  # spans more than ~2^149 (after a huge gradient, coat_jax/adam_math.py); the sum does not.
  powered = jnp.exp2(jnp.log2(mx) + inv_k * jnp.log2(qa / jnp.float32(f.max)))
  linear = qa * (mx / jnp.float32(f.max))
  mag = jnp.where(code == jnp.float32(expand_min), linear, powered)
  return _from_groups(jnp.sign(qg) * mag, shape, gax)


def expanded_nbytes(shape: tuple[int, ...], fmt: str | Format = "e4m3", group_size: int = 128,
                    axis: int = -1) -> int:
  """Bytes of one ExpandedMoment for a param of `shape` (data + 5 bytes per group)."""
  f = get_format(fmt)
  return (math.prod(shape) * f.dtype.itemsize
          + math.prod(metadata_shape(shape, group_size, axis)) * 5)


# ----------------------------------------------------------------------------------------------
# COAT's stored form (q, s, k, c as float32 per group), kept as the reference the compact form is
# checked against. Not used by the optimizer. k here is not capped at 255/expand_min.


class SpecExpanded(NamedTuple):
  """COAT's form: data (fmt.dtype, x.shape); scale, k, centre (float32, metadata shape)."""
  data: jax.Array
  scale: jax.Array
  k: jax.Array
  centre: jax.Array


def quantize_expanded_spec(x: jax.Array, fmt: str | Format = "e4m3", group_size: int = 128,
                           expand_min: int = 16) -> SpecExpanded:
  """COAT's expansion exactly as specified: y = sign(x)|x/c|^k, s = (mx/c)^k/fmax, q = cast(y/s)."""
  _check_args(x, group_size, expand_min)
  f = get_format(fmt)
  xg, gax = _to_groups(x, group_size)
  a = jnp.abs(xg)
  mx, mn = _group_max_min(a, gax)
  c = jnp.sqrt(mx) * jnp.sqrt(mn)
  k = _k_steps(mx, mn, f, expand_min) / jnp.float32(expand_min)
  k = jnp.maximum(k, jnp.float32(1.0 / expand_min))
  y = jnp.sign(xg) * jnp.power(a / c[..., None], k[..., None])
  s = jnp.power(mx / c, k) / jnp.float32(f.max)
  qg = formats.saturating_cast(y / s[..., None], f)
  return SpecExpanded(_from_groups(qg, x.shape, gax), s, k, c)


def dequantize_expanded_spec(m: SpecExpanded, group_size: int = 128) -> jax.Array:
  """x = sign(q s) |q s|^(1/k) c per group, float32."""
  qg, gax = _to_groups(m.data, group_size)
  qs = qg * m.scale[..., None]
  out = jnp.sign(qs) * jnp.power(jnp.abs(qs), 1.0 / m.k[..., None]) * m.centre[..., None]
  return _from_groups(out, m.data.shape, gax)
