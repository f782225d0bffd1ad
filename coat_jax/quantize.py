"""Per-tensor and per-group quantization, the two-stage "group scaling" amax, QuantizedArray.

Pure jnp, jit-able; the Pallas kernels in `pallas_kernels/` are drop-ins for these functions.
Conventions (COAT's): scale = max(amax / fmt.max, floor); quantize q = cast(x / scale) with
round-to-nearest-even after clamping to +-fmt.max; dequantize x ~= q * scale.
Groups run along the LAST axis (1 x G tiles), so a tensor's sharding on its leading axes carries
over to its scales; a last axis not divisible by G gets a short final group.
Non-finite input is never hidden: a group (or tensor) holding NaN/inf gets a NaN scale, so its
dequantized values are NaN.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from coat_jax import formats
from coat_jax.formats import Format, get_format


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
  """A quantized tensor passed between ops.

  Attributes:
    data: storage-dtype array (float8_e4m3fn / float8_e5m2 / int8), shape `shape`.
    scale: float32 () per tensor; per group `shape[:-1] + (ceil(shape[-1]/G),)`, bfloat16 by
      default (formats.ACTIVATION_SCALE_DTYPE; `quantize_per_group`).
    fmt: format name (static).
    group_size: G for per-group (1 x G along the last axis), 0 for per-tensor (static).
    data_t: optional transposed copy of `data` (last two axes swapped), made by the fused
      quantize+transpose for backward GEMMs that want K-major operands; None if absent. (Between
      the ops, a linear's input may carry what its backward remakes the copy from instead:
      `coat_jax.ops.linear_layer.RemadeInput`; the kernels never see one.)
  """
  data: jax.Array
  scale: jax.Array
  fmt: str = "e4m3"
  group_size: int = 0
  data_t: jax.Array | None = None

  def tree_flatten(self):
    return (self.data, self.scale, self.data_t), (self.fmt, self.group_size)

  @classmethod
  def tree_unflatten(cls, aux, children):
    data, scale, data_t = children
    return cls(data, scale, aux[0], aux[1], data_t)

  @property
  def shape(self):
    return self.data.shape

  @property
  def per_tensor(self) -> bool:
    return self.group_size == 0

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    return dequantize(self, dtype)

  def nbytes(self) -> int:
    """Bytes held by data, scale and (if present) the transposed copy."""
    leaves = [self.data, self.scale] + ([self.data_t] if hasattr(self.data_t, "shape") else [])
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in leaves)


def _check_float(x, what: str):
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{what}: expected a floating-point array, got dtype {x.dtype}")


def _check_group_size(group_size: int):
  if not isinstance(group_size, int) or group_size <= 0:
    raise ValueError(f"group_size must be a positive int, got {group_size!r}")


def _pad_last(x: jax.Array, group_size: int, value=0.0) -> jax.Array:
  """Pads the last axis up to a multiple of group_size."""
  pad = (-x.shape[-1]) % group_size
  if pad == 0:
    return x
  widths = [(0, 0)] * (x.ndim - 1) + [(0, pad)]
  return jnp.pad(x, widths, constant_values=value)


def group_amax(x: jax.Array, group_size: int) -> jax.Array:
  """max|x| per 1 x G group along the last axis: float32, shape `x.shape[:-1] + (ceil(N/G),)`.

  NaN anywhere in a group makes that group's amax NaN (jnp.max propagates NaN).
  """
  _check_group_size(group_size)
  if x.ndim == 0:
    x = x.reshape(1)
  a = jnp.abs(_pad_last(x.astype(jnp.float32), group_size))
  return jnp.max(a.reshape(*a.shape[:-1], -1, group_size), axis=-1)


def amax_two_stage(x: jax.Array, tile: int = 16) -> tuple[jax.Array, jax.Array]:
  """COAT's group scaling: stage 1 max|x| per 1 x tile, stage 2 max over those partial maxima.

  Returns (tensor_amax: float32 (), partial: float32 (..., ceil(N/tile))). The kernel version
  fuses stage 1 into the op producing x; numerically both equal max|x|.
  """
  partial = group_amax(x, tile)
  return jnp.max(partial), partial


def scale_from_amax(amax: jax.Array, fmt: str | Format, floor: float) -> jax.Array:
  """scale = max(amax / fmt.max, floor) in float32; NaN where amax is not finite."""
  f = get_format(fmt)
  amax = amax.astype(jnp.float32)
  scale = jnp.maximum(amax / f.max, jnp.float32(floor))
  return jnp.where(jnp.isfinite(amax), scale, jnp.float32(jnp.nan))


def quantize_per_tensor(x: jax.Array, fmt: str | Format = "e4m3", *, amax: jax.Array | None = None,
                        floor: float = formats.ACTIVATION_SCALE_FLOOR,
                        with_transpose: bool = False) -> QuantizedArray:
  """One float32 scale for the whole tensor (just-in-time, two-stage amax unless `amax` is given).

  Args:
    x: floating array, any shape.
    fmt: storage format name.
    amax: precomputed max|x| (e.g. stage-1 maxima written by the op that produced x, reduced).
    floor: lower bound of the scale.
    with_transpose: also store `data_t`, the quantized x with its last two axes swapped.
  Returns:
    QuantizedArray with group_size 0 and scale shape ().
  """
  _check_float(x, "quantize_per_tensor")
  f = get_format(fmt)
  if amax is None:
    amax, _ = amax_two_stage(x)
  scale = scale_from_amax(amax, f, floor)
  data = formats.saturating_cast(x.astype(jnp.float32) / scale, f)
  data_t = jnp.swapaxes(data, -1, -2) if with_transpose else None
  return QuantizedArray(data, scale, f.name, 0, data_t)


def quantize_per_group(x: jax.Array, group_size: int = 16, fmt: str | Format = "e4m3", *,
                       floor: float = formats.ACTIVATION_SCALE_FLOOR,
                       scale_dtype=formats.ACTIVATION_SCALE_DTYPE) -> QuantizedArray:
  """One scale per 1 x G group along the last axis (short final group if N % G != 0).

  scale = max(amax / fmt.max, floor) in float32, rounded to `scale_dtype` (nearest; default
  bfloat16, formats.ACTIVATION_SCALE_DTYPE), and x is divided by that rounded scale, so
  `dequantize` (data * scale) inverts the cast exactly up to the format's rounding. A scale
  rounded down by at most 2^-9 can put a group's largest value that far above fmt.max: the cast
  clamps it (below the format's own step there).
  Args:
    x: floating array with ndim >= 1, last axis N.
  Returns:
    QuantizedArray with data shape x.shape and scale (scale_dtype) shape
    x.shape[:-1] + (ceil(N/G),).
  """
  _check_float(x, "quantize_per_group")
  _check_group_size(group_size)
  if x.ndim == 0:
    raise ValueError("quantize_per_group needs an array with at least one axis, got a scalar")
  f = get_format(fmt)
  scale = scale_from_amax(group_amax(x, group_size), f, floor).astype(scale_dtype)
  if jnp.dtype(scale_dtype) != jnp.float32:
    # XLA:GPU folds convert(convert(s, bf16), f32) back to s inside one program (as it does the
    # FP8 codes' round trip, formats.saturating_cast): the barrier keeps the rounding, so x is
    # divided by the scale as stored (tests/test_fp8_rounding_kept.py).
    scale = jax.lax.optimization_barrier(scale)
  n = x.shape[-1]
  divisor = expand_groups(scale.astype(jnp.float32), group_size, n)
  data = formats.saturating_cast(x.astype(jnp.float32) / divisor, f)
  return QuantizedArray(data, scale, f.name, group_size)


def expand_groups(per_group: jax.Array, group_size: int, n: int) -> jax.Array:
  """Repeats per-group values G times along the last axis and trims to length n (a broadcast:
  jnp.repeat given `total_repeat_length` computes gather indices instead, a gather over the whole
  activation in XLA's fusion)."""
  return jnp.repeat(per_group, group_size, axis=-1)[..., :n]


def dequantize(q: QuantizedArray, dtype=jnp.float32) -> jax.Array:
  """q.data * scale (broadcast per tensor or per group), cast to `dtype`."""
  vals = q.data.astype(jnp.float32)
  if q.group_size == 0:
    out = vals * q.scale
  else:
    out = vals * expand_groups(q.scale, q.group_size, q.data.shape[-1])
  return out.astype(dtype)


def fake_quantize(x: jax.Array, fmt: str | Format = "e4m3", group_size: int = 0) -> jax.Array:
  """Quantize-dequantize round trip in x's dtype (per-tensor if group_size == 0)."""
  q = quantize_per_tensor(x, fmt) if group_size == 0 else quantize_per_group(x, group_size, fmt)
  return dequantize(q, x.dtype)
