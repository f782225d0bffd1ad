"""FP8 matrix products on quantized operands: the jnp/XLA reference of `fp8_dot_general`."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from coat_jax.quantize import QuantizedArray


# The output dtypes of the FP8 GEMM: the reference's and the Mosaic GPU kernel's (its own
# constant, pallas_kernels/gemm/fp8_matmul.OUT_DTYPES, the same two).
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


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
  a_data, b_data, dimension_numbers = _prefer_transposed(a, b, dimension_numbers)
  acc = jax.lax.dot_general(a_data, b_data, dimension_numbers, preferred_element_type=jnp.float32)
  return (acc * (a.scale * b.scale)).astype(out_dtype)


def _prefer_transposed(a: QuantizedArray, b: QuantizedArray, dimension_numbers):
  """Uses a 2-D operand's `data_t` where it turns a contraction over axis 0 into one over axis 1.

  Same product; XLA then sees the "TN" layout cuBLASLt's FP8 GEMM wants, with no transpose.
  """
  (lc, rc), (lb, rb) = dimension_numbers
  a_data, b_data = a.data, b.data
  if not lb and not rb and len(lc) == 1 and len(rc) == 1:
    if a.data_t is not None and a.data.ndim == 2 and lc[0] % 2 == 0:
      a_data, lc = a.data_t, (1,)
    if b.data_t is not None and b.data.ndim == 2 and rc[0] % 2 == 0:
      b_data, rc = b.data_t, (1,)
  return a_data, b_data, ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
