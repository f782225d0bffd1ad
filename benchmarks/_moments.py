"""FP8 round trips of optimizer moments, as the device really rounds them (stability.py,
group_axis.py).
"""
from __future__ import annotations

import functools

# On GPU, XLA may drop a float conversion chain f32 -> f8 -> f32 inside ONE compiled program:
# with xla_allow_excess_precision (on by default) its simplify-fp-conversions pass replaces
# convert(convert(x)) by x, so jit(dequantize(quantize(x))) returns x nearly unrounded (relative
# MSE ~1e-13 instead of E4M3's ~1e-3; measured on an H100, 2026-11-23). Here the FP8 codes are
# the output of one jit and the input of another, so they exist in memory; and
# `check_moment_round_trip` compares a sample with a float64 numpy quantizer before a script
# reports any number.


@functools.cache
def _moment_jits():
  import jax
  from coat_jax import expansion

  q = jax.jit(expansion.quantize_expanded, static_argnums=(1, 2, 3, 4))
  d = jax.jit(expansion.dequantize_expanded, static_argnums=(1, 2, 3))
  return q, d


def moment_round_trip(x, fmt: str, group_size: int, expand_min: int, expand: bool, *,
                      axis: str = "last"):
  """dequantize_expanded(quantize_expanded(x)) as float64 numpy, the codes materialised between.

  Groups along x's last axis ("last") or, for a 2-D x, its first ("first": transposed in and out).
  """
  import jax.numpy as jnp
  import numpy as np

  if axis not in ("last", "first"):
    raise ValueError(f"moment_round_trip: axis must be 'last' or 'first', got {axis!r}")
  xt = jnp.asarray(x, jnp.float32)
  if axis == "first":
    xt = xt.T
  quant, dequant = _moment_jits()
  q = quant(xt, fmt, group_size, expand_min, expand)   # FP8 codes: this jit's output
  out = np.asarray(dequant(q, fmt, group_size, expand_min), np.float64)
  return out.T if axis == "first" else out


def numpy_moment_round_trip(x, k, fmt: str, group_size: int):
  """float64 numpy reference of coat_jax.expansion's round trip for a 2-D x (N % G == 0):
  per group mx = max|x| + 1e-30, q = round_fmt(sign(x) fmt.max (|x|/mx)^k) (clamped to
  +-fmt.max; nearest-even), x' = sign(q) mx (|q|/fmt.max)^(1/k). `k`: the groups' exponents
  (shape (rows, N/G); 1 = no expansion)."""
  import numpy as np
  from coat_jax.formats import get_format

  f = get_format(fmt)
  rows, n = x.shape
  g = np.asarray(x, np.float64).reshape(rows, n // group_size, group_size)
  mx = np.abs(g).max(-1, keepdims=True) + 1e-30
  k = np.asarray(k, np.float64)[..., None]
  y = np.clip(np.sign(g) * f.max * (np.abs(g) / mx) ** k, -f.max, f.max)
  q = y.astype(f.dtype).astype(np.float64) if f.is_float else np.rint(y)
  return (np.sign(q) * mx * (np.abs(q) / f.max) ** (1.0 / k)).reshape(x.shape)


def check_moment_round_trip(fmt: str, group_size: int, expand_min: int, *, seed: int = 0) -> dict:
  """Raises SystemExit (one line) unless `moment_round_trip` on this device matches the numpy
  quantizer on a moment-like sample (expansion off and on): relative MSEs within 20% of each
  other and >= 98% of the values equal to 1e-5. Returns {expand: (ours, numpy) relative MSE}."""
  import numpy as np

  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((8, 4 * group_size))
       * np.exp(rng.uniform(-6, 0, (8, 4 * group_size)))).astype(np.float32)
  x64 = x.astype(np.float64)
  found = {}
  for expand in (False, True):
    ours = moment_round_trip(x, fmt, group_size, expand_min, expand)
    codes = _moment_jits()[0](x, fmt, group_size, expand_min, expand).k_code
    k = np.asarray(codes, np.float64) / expand_min   # expand_min (k = 1) without expansion
    ref = numpy_moment_round_trip(x, k, fmt, group_size)
    e_ours = float(np.sum((ours - x64) ** 2) / np.sum(x64 ** 2))
    e_ref = float(np.sum((ref - x64) ** 2) / np.sum(x64 ** 2))
    same = float(np.mean(np.abs(ours - ref) <= 1e-5 * np.abs(ref) + 1e-30))
    found[expand] = (e_ours, e_ref)
    if not (0.8 * e_ref <= e_ours <= 1.25 * e_ref and same >= 0.98):
      raise SystemExit(
          f"FP8 round-trip check failed ({fmt}, expand={expand}): relative MSE {e_ours:.3e} on "
          f"this device vs {e_ref:.3e} from the float64 numpy quantizer, {100 * same:.1f}% of "
          f"values equal; the device did not round to {fmt} (see benchmarks/_moments.py)")
  return found
