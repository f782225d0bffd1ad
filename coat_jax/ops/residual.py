"""Residual add. Saves nothing: RMSNorm quantizes its own input per 1x16 group, so no FP8 copy of
the residual stream is kept here (a kernel may later fuse that quantize into this add)."""
import jax


def residual_add(x: jax.Array, y: jax.Array) -> jax.Array:
  """x + y, same shape and dtype."""
  if x.shape != y.shape:
    raise ValueError(f"residual_add: shapes {x.shape} and {y.shape} differ")
  return x + y.astype(x.dtype)
