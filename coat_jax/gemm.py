"""FP8 matrix products on quantized operands: the jnp/XLA reference of `fp8_dot_general`."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from coat_jax.quantize import QuantizedArray


def fp8_dot_general_reference(a: QuantizedArray, b: QuantizedArray, dimension_numbers,
                              out_dtype=jnp.bfloat16) -> jax.Array:
  """`lax.dot_general` of two per-tensor-quantized operands, float32 accumulation, scales applied after.

  On GPU, XLA lowers a dot_general of float8 inputs to cuBLASLt's FP8 GEMM (fastest when both
  operands contract on their last axis, "TN"). Output: (a.scale * b.scale) * (a.data . b.data).

  Args:
    a, b: per-tensor QuantizedArrays (group_size 0).
    dimension_numbers: as for `jax.lax.dot_general`.
    out_dtype: dtype of the result (bfloat16 or float32).
  """
  if not (a.per_tensor and b.per_tensor):
    raise ValueError("fp8_dot_general needs per-tensor quantized operands "
                     f"(got group sizes {a.group_size} and {b.group_size})")
  acc = jax.lax.dot_general(a.data, b.data, dimension_numbers, preferred_element_type=jnp.float32)
  return (acc * (a.scale * b.scale)).astype(out_dtype)
