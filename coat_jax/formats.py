"""The one table of low-precision formats and their limits, and saturating casts.

Every other module asks this one for a format's dtype and range; nothing else hard-codes 448.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Format(NamedTuple):
  """A storage format for quantized values.

  Attributes:
    name: short name used in configs ("e4m3", "e5m2", "int8").
    dtype: the JAX storage dtype.
    max: largest finite magnitude (the value a scale maps amax onto).
    min_normal: smallest positive normal magnitude (1 for int8).
    is_float: True for the FP8 formats, False for the integer comparison format.
  """
  name: str
  dtype: jnp.dtype
  max: float
  min_normal: float
  is_float: bool


E4M3 = Format("e4m3", jnp.dtype(jnp.float8_e4m3fn), 448.0, 2.0**-6, True)
E5M2 = Format("e5m2", jnp.dtype(jnp.float8_e5m2), 57344.0, 2.0**-14, True)
INT8 = Format("int8", jnp.dtype(jnp.int8), 127.0, 1.0, False)

FORMATS: dict[str, Format] = {f.name: f for f in (E4M3, E5M2, INT8)}

# Group sizes (COAT's): FP8 activations saved by non-linear ops are scaled per 1 x 16 group along
# the hidden axis; optimizer moments per group of 128 consecutive elements.
ACTIVATION_GROUP_SIZE = 16
OPTIMIZER_GROUP_SIZE = 128
# The axis of the optimizer's groups: each param's last axis, or COAT's layout (coat_jax.optim.group_axes).
OPTIMIZER_GROUP_AXES = ("last", "coat")
# The default (coat_adamw, coat_adamw_apply, config optimizer.group_axis): each param's last axis.
# Its row kernel streams at the byte floor; COAT's layout ("coat") has the lower moment error, the
# same llama-125m loss within run-to-run noise over three seeds, and a column kernel 1.5x slower
# (docs/results.md, "The optimizer step" and "The optimizer's group axis in training").
OPTIMIZER_GROUP_AXIS = "last"

# How per-group activation scales are stored: bfloat16, as COAT stores them (values are divided by
# the bfloat16-rounded scale itself, so data * scale is the dequantized value exactly): 1.125
# instead of 1.25 bytes per 1 x 16-grouped value (docs/differences.md, section 3). Per-tensor
# scales and the optimizer's metadata stay float32.
ACTIVATION_SCALE_DTYPE = jnp.dtype(jnp.bfloat16)

# Floors that keep scales finite and non-zero for all-zero tensors (COAT's values).
ACTIVATION_SCALE_FLOOR = 1e-10
OPTIMIZER_SCALE_FLOOR = 1e-30


def get_format(fmt: str | Format) -> Format:
  """Returns the `Format` for a name; raises ValueError naming the choices for an unknown one."""
  if isinstance(fmt, Format):
    return fmt
  try:
    return FORMATS[fmt]
  except (KeyError, TypeError):
    raise ValueError(
        f"unknown quantization format {fmt!r}; expected one of {sorted(FORMATS)}") from None


def saturating_cast(x: jnp.ndarray, fmt: str | Format) -> jnp.ndarray:
  """Casts `x` (already divided by its scale) to `fmt`, clamping to +-fmt.max first.

  A plain cast to float8_e4m3fn turns anything above 448 into NaN and float8_e5m2 overflows to
  inf; this clamps instead (round-to-nearest-even for the floats, round-half-even for int8).
  NaN inputs stay NaN for the float formats (they are never silently clamped into range).

  The FP8 result passes an optimization barrier: inside one jit, XLA GPU (with
  xla_allow_excess_precision, its default) replaces a chain convert(convert(x, f8), f32) by x
  (pass simplify-fp-conversions), so a value quantized and dequantized in the same program would
  silently skip the rounding (and keep the wider tensor alive instead of the FP8 one). The
  barrier ends such chains; the barrier is removed only after those passes, and it costs
  nothing where the codes are written to memory anyway (saved residuals, GEMM operands, state).
  """
  f = get_format(fmt)
  x = jnp.clip(x, -f.max, f.max)
  if not f.is_float:
    return jnp.round(x).astype(f.dtype)
  return jax.lax.optimization_barrier(x.astype(f.dtype))


def fp8_dtypes() -> tuple[np.dtype, ...]:
  """The FP8 storage dtypes (for dtype checks)."""
  return (E4M3.dtype, E5M2.dtype)
