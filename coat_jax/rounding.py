"""Rounding float32 master values to bfloat16 storage: nearest-even or stochastic.

Keeping master weights in bfloat16 halves their bytes (2 instead of 4 per parameter), but an
update smaller than half a bfloat16 ulp of the weight (2^-9 relative) is lost under
round-to-nearest: late in training most updates are that small. Stochastic rounding keeps them
in expectation:

  bits(x) = the float32 bit pattern of x,  r = 16 uniform random bits,
  sr(x)   = bfloat16 whose bits are the top 16 of (bits(x) + r)   (truncation after adding r),

so sr(x) rounds up with probability (x - lo) / (hi - lo) for the two bfloat16 neighbours lo <= x
< hi, and E[sr(x)] = x. Non-finite x are rounded to nearest (inf stays inf, NaN stays NaN), and a
finite x whose rounding would overflow saturates to the largest finite bfloat16.

The random bits come from a counter-based hash of (element index, step, seed): no RNG state, the
same bits for the same step in any implementation (a kernel can compute them in registers), and
a resumed run draws exactly what the uninterrupted run would have.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

ROUNDINGS = ("nearest", "stochastic")
# How an optimizer may store bfloat16 master weights: a rounding, or "kahan" (nearest rounding
# plus a bfloat16 compensation buffer in the optimizer state; coat_jax.optim.coat_adamw_apply).
MASTER_ROUNDINGS = ROUNDINGS + ("kahan",)
_BF16_MAX_BITS = 0x7F7F  # largest finite bfloat16


def hash_bits(index: jax.Array, step: jax.Array, seed: int | jax.Array) -> jax.Array:
  """16 pseudo-random bits (uint32 in [0, 2^16)) per element from (index, step, seed).

  A 32-bit integer mixer (multiply-xorshift, as in splitmix/murmur finalizers) over
  index ^ mix(step ^ mix(seed)): changing any input changes every output bit with ~1/2 odds.
  """
  def mix(x):
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)

  key = mix(jnp.asarray(step, jnp.uint32) * jnp.uint32(0x9E3779B9)
            ^ mix(jnp.asarray(seed, jnp.uint32) + jnp.uint32(0x632BE5AB)))
  return mix(index.astype(jnp.uint32) * jnp.uint32(0x9E3779B1) ^ key) >> 16


def stochastic_round_bf16(x: jax.Array, bits: jax.Array) -> jax.Array:
  """bfloat16 of float32 `x`, rounded up with probability equal to the dropped fraction.

  `bits`: uint32 in [0, 2^16), x's shape (e.g. `hash_bits`). See the module docstring.
  """
  x = x.astype(jnp.float32)
  u = jax.lax.bitcast_convert_type(x, jnp.uint32)
  sign = u & jnp.uint32(0x80000000)
  mag = u & jnp.uint32(0x7FFFFFFF)
  top = (mag + bits.astype(jnp.uint32)) >> 16
  top = jnp.minimum(top, jnp.uint32(_BF16_MAX_BITS))  # never round a finite value up to inf
  sr = jax.lax.bitcast_convert_type(((sign >> 16) | top).astype(jnp.uint16), jnp.bfloat16)
  return jnp.where(jnp.isfinite(x), sr, x.astype(jnp.bfloat16))


def round_to(x: jax.Array, dtype, rounding: str = "nearest", *, step=0, seed=0,
             offset: int | jax.Array = 0) -> jax.Array:
  """x cast to `dtype`: nearest-even, or for bfloat16 `rounding="stochastic"` with bits from
  hash_bits(offset + flat element index, step, seed)."""
  if rounding not in ROUNDINGS:
    raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
  if rounding == "nearest" or jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
    return x.astype(dtype)
  index = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape) + jnp.asarray(offset, jnp.uint32)
  return stochastic_round_bf16(x, hash_bits(index, step, seed))


def split_bf16(y: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(hi, lo) = (bfloat16(y), bfloat16(y - hi)), both rounded to nearest: y's leading 8
  significant bits and the next 8 (Kahan storage of a float32 master value: hi + lo equals y to
  within 2^-17 |y|).

  hi passes through an optimization barrier before it is widened again: with
  xla_allow_excess_precision (the default) XLA's GPU compiler folds float32 -> bfloat16 ->
  float32 into the identity, which would make lo zero and Kahan summation round to nearest.
  """
  hi = jax.lax.optimization_barrier(y.astype(jnp.bfloat16))
  return hi, (y - hi.astype(jnp.float32)).astype(jnp.bfloat16)
