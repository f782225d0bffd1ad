"""Dynamic range expansion (COAT) for FP8 optimizer states, in a compact stored form.

Per group of G elements along the LAST axis (a short final group when N % G != 0; a 0-d array is
one group of one), COAT maps a moment x onto a quantization format `fmt` as

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
    amax: float32, shape `shape[:-1] + (ceil(N / G),)` (`(1,)` for a 0-d param): max|x| + 1e-30.
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


def num_groups(shape: tuple[int, ...], group_size: int) -> int:
  """Groups along the last axis: ceil(N / G) (1 for a 0-d shape)."""
  n = shape[-1] if len(shape) else 1
  return -(-n // group_size)


def metadata_shape(shape: tuple[int, ...], group_size: int) -> tuple[int, ...]:
  """Shape of `amax` / `k_code` for a param of `shape`."""
  return tuple(shape[:-1]) + (num_groups(shape, group_size),)


def _to_groups(x: jax.Array, group_size: int) -> jax.Array:
  """float32 (..., ceil(N/G), G), zero-padded on the last group."""
  x = x.astype(jnp.float32)
  if x.ndim == 0:
    x = x.reshape(1)
  pad = (-x.shape[-1]) % group_size
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(*x.shape[:-1], -1, group_size)


def _from_groups(xg: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  n = shape[-1] if len(shape) else 1
  return xg.reshape(*xg.shape[:-2], -1)[..., :n].reshape(shape)


def _group_max_min(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(mx, mn) of |x| per group (last axis of `a` = |x| grouped): max + 1e-30, min non-zero + 1e-30.

  A group with no non-zero value gets mn = mx.
  """
  mx = jnp.max(a, axis=-1) + jnp.float32(AMAX_FLOOR)
  mn_nz = jnp.min(jnp.where(a > 0, a, jnp.inf), axis=-1)
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
                      expand_min: int = 16, expand: bool = True) -> ExpandedMoment:
  """Quantizes `x` per group with dynamic range expansion into the compact stored form.

  Args:
    x: floating array, any shape (groups along the last axis).
    fmt: "e4m3" | "e5m2" | "int8" (or a Format).
    group_size: G.
    expand_min: k is a multiple of 1/expand_min (k_code = k * expand_min, clipped to [1, 255]).
    expand: False gives plain per-group max scaling (q = x / (mx / fmt.max)), stored with k = 1.
  Returns:
    ExpandedMoment(data: fmt.dtype x.shape, amax: float32, k_code: uint8).
  """
  _check_args(x, group_size, expand_min)
  f = get_format(fmt)
  xg = _to_groups(x, group_size)
  a = jnp.abs(xg)
  if expand:
    mx, mn = _group_max_min(a)
    steps = jnp.clip(_k_steps(mx, mn, f, expand_min), 1, MAX_K_CODE)
    k = (steps / jnp.float32(expand_min))[..., None]
    # log2|x| - log2(mx), not log2(|x| / mx): the ratio underflows float32 for groups spanning
    # more than ~2^149 (after a huge gradient, coat_jax/adam_math.py), the difference does not.
    mag = jnp.float32(f.max) * jnp.exp2(k * (jnp.log2(a) - jnp.log2(mx)[..., None]))
    qg = formats.saturating_cast(jnp.sign(xg) * mag, f)
  else:
    mx = jnp.max(a, axis=-1) + jnp.float32(AMAX_FLOOR)
    steps = jnp.full(mx.shape, min(expand_min, MAX_K_CODE), jnp.float32)
    qg = formats.saturating_cast(xg / (mx / jnp.float32(f.max))[..., None], f)
  k_code = steps.astype(jnp.uint8)
  return ExpandedMoment(_from_groups(qg, x.shape), mx, k_code)


def dequantize_expanded(m: ExpandedMoment, fmt: str | Format = "e4m3", group_size: int = 128,
                        expand_min: int = 16) -> jax.Array:
  """x = sign(q) * mx * (|q| / fmt.max)^(1/k) per group (exactly q * mx / fmt.max where k = 1).

  Returns float32 of m.data's shape.
  """
  f = get_format(fmt)
  shape = m.data.shape
  qg = _to_groups(m.data, group_size)
  qa = jnp.abs(qg)
  mx = m.amax.astype(jnp.float32)[..., None]
  code = m.k_code.astype(jnp.float32)[..., None]
  inv_k = jnp.float32(expand_min) / code
  # exp2(log2(mx) + ...), not mx * exp2(...): the power alone underflows float32 where a group
  # spans more than ~2^149 (after a huge gradient, coat_jax/adam_math.py); the sum does not.
  powered = jnp.exp2(jnp.log2(mx) + inv_k * jnp.log2(qa / jnp.float32(f.max)))
  linear = qa * (mx / jnp.float32(f.max))
  mag = jnp.where(code == jnp.float32(expand_min), linear, powered)
  return _from_groups(jnp.sign(qg) * mag, shape)


def expanded_nbytes(shape: tuple[int, ...], fmt: str | Format = "e4m3",
                    group_size: int = 128) -> int:
  """Bytes of one ExpandedMoment for a param of `shape` (data + 5 bytes per group)."""
  f = get_format(fmt)
  return math.prod(shape) * f.dtype.itemsize + math.prod(metadata_shape(shape, group_size)) * 5


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
  xg = _to_groups(x, group_size)
  a = jnp.abs(xg)
  mx, mn = _group_max_min(a)
  c = jnp.sqrt(mx) * jnp.sqrt(mn)
  k = _k_steps(mx, mn, f, expand_min) / jnp.float32(expand_min)
  k = jnp.maximum(k, jnp.float32(1.0 / expand_min))
  y = jnp.sign(xg) * jnp.power(a / c[..., None], k[..., None])
  s = jnp.power(mx / c, k) / jnp.float32(f.max)
  qg = formats.saturating_cast(y / s[..., None], f)
  return SpecExpanded(_from_groups(qg, x.shape), s, k, c)


def dequantize_expanded_spec(m: SpecExpanded, group_size: int = 128) -> jax.Array:
  """x = sign(q s) |q s|^(1/k) c per group, float32."""
  qg = _to_groups(m.data, group_size)
  qs = qg * m.scale[..., None]
  out = jnp.sign(qs) * jnp.power(jnp.abs(qs), 1.0 / m.k[..., None]) * m.centre[..., None]
  return _from_groups(out, m.data.shape)
