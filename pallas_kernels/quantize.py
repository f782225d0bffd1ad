"""Pallas (Triton backend) quantize / dequantize kernels on plain arrays (the math of `coat_jax.quantize`).

Bit-exact with the jnp references: same scale formula (scale = max(amax / fmt.max, floor), NaN
where the group or tensor holds a non-finite value; the division by the constant fmt.max is a
multiply by f32(1/fmt.max), as XLA compiles the reference), q = saturating cast of x / scale with
the division XLA uses on the platform (`div.full.f32` on the GPU, see `_div`), NaN kept NaN
(Triton's min/max ignore NaN, so clamping and reductions handle it explicitly).

Every grid covers the array with whole blocks (block sizes are the largest powers of two up to the
default that divide the extent): on the H100 the Triton backend's masked stores of partial blocks
wrote out of bounds (a neighbouring buffer, the scale, was overwritten), so no partial blocks are
ever used. Odd extents therefore get small blocks (correct, slower).

Layout: leading axes are folded by reshape; groups (1 x G) run along the last axis. Supported:
last axis divisible by G (per group) or by 16 (per tensor, the stage-1 tile), float8 storage.
Other shapes raise ValueError; `coat_jax.kernels` checks `supported_*` and otherwise calls the
reference. This module imports only jax and numpy: the storage format comes in as a dtype (its
largest value from jnp.finfo), the scale floor as an argument, and results are plain arrays
(the dispatch wraps them in QuantizedArray).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

STAGE1_TILE = 16
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
# "full": Triton's `/` (PTX div.full.f32, what XLA:GPU emits); "rn": IEEE div.rn.f32 (diagnostics).
GPU_DIVISION = "full"


def _div(x: jax.Array, y: jax.Array, interpret: bool) -> jax.Array:
  """float32 x / y exactly as XLA computes the reference's x / scale on the same platform.

  XLA:GPU compiles a float32 divide to PTX `div.full.f32` (measured: 0 of 1M quotients differ,
  while IEEE `div.rn.f32` differs in 29%); Triton's `/` is the same instruction. XLA:CPU divides
  IEEE-exactly, but rewrites x / broadcast(s) into x * (1 / s) inside a fused kernel body; the
  barrier keeps the true division so that interpret mode matches the reference on CPU.
  """
  if interpret:
    return x / jax.lax.optimization_barrier(y)
  if GPU_DIVISION == "rn":
    [out] = pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[x, y], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return out
  return x / y


def _saturate(y: jax.Array, fmax: float) -> jax.Array:
  """Clamp to +-fmax keeping NaN (Triton's min/max would turn NaN into a bound)."""
  return jnp.where(y != y, y, jnp.minimum(jnp.maximum(y, -fmax), fmax))


def _group_amax_and_bad(x: jax.Array) -> jax.Array:
  """max|x| over the last axis, NaN if the group holds NaN/inf (float32)."""
  amax = jnp.max(jnp.abs(x), axis=-1)
  bad = jnp.max(jnp.where(jnp.abs(x) < jnp.inf, 0.0, 1.0), axis=-1)
  return jnp.where(bad > 0.0, jnp.nan, amax)


def _scale(amax: jax.Array, fmax: float, floor: float) -> jax.Array:
  # XLA rewrites the reference's amax / fmt.max (a constant divisor) into amax * f32(1 / fmt.max);
  # doing the same keeps the scales bit-identical.
  inv = float(np.float32(1.0) / np.float32(fmax))
  s = jnp.maximum(amax * inv, floor)
  return jnp.where(amax != amax, jnp.nan, s)


def _to_fp8(y: jax.Array, dtype, interpret: bool) -> jax.Array:
  """Casts saturated float32 values to FP8 with one round-to-nearest-even (as XLA:CPU and XLA:GPU
  do; a float16 hop would round twice and differ just below ties)."""
  del interpret
  return y.astype(dtype)


def _params(num_warps: int):
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=1)


def _check_last(x: jax.Array, multiple: int, what: str):  # used by the per-tensor path
  if x.ndim == 0 or x.shape[-1] % multiple:
    raise ValueError(f"{what}: last axis of shape {x.shape} must be a multiple of {multiple}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{what}: expected a floating-point array, got dtype {x.dtype}")


def _fmax(dtype) -> float:
  """Largest finite value of a float8 storage dtype (448 for e4m3fn, 57344 for e5m2)."""
  dtype = jnp.dtype(dtype)
  if dtype not in FP8_DTYPES:
    raise ValueError(f"quantize kernels store float8 only, got dtype {dtype}")
  return float(jnp.finfo(dtype).max)


def supported_per_group(x: jax.Array, group_size: int, dtype=jnp.float8_e4m3fn) -> bool:
  """Shapes the per-group kernels take: ndim >= 1, N % G == 0, G a power of two >= 2, float8
  storage `dtype`."""
  return (jnp.dtype(dtype) in FP8_DTYPES and x.ndim >= 1 and x.size > 0 and group_size >= 2 and group_size & (group_size - 1) == 0
          and x.shape[-1] % group_size == 0 and jnp.issubdtype(x.dtype, jnp.floating))


def supported_per_tensor(x: jax.Array, with_transpose: bool, dtype=jnp.float8_e4m3fn) -> bool:
  """Shapes the per-tensor kernels take: N % 16 == 0, float8 storage `dtype`; transposing also
  needs ndim >= 2 and M % 16 == 0."""
  if jnp.dtype(dtype) not in FP8_DTYPES:
    return False
  if with_transpose and (x.ndim < 2 or x.shape[-2] % STAGE1_TILE):
    return False
  return (x.ndim >= 1 and x.size > 0 and x.shape[-1] % STAGE1_TILE == 0
          and jnp.issubdtype(x.dtype, jnp.floating))


def _pow2_divisor(n: int, cap: int) -> int:
  """Largest power of two <= cap dividing n."""
  b = 1
  while b < cap and n % (2 * b) == 0:
    b *= 2
  return b


# ---------------------------------------------------------------------------------------------
# Per-group quantize / dequantize and stage-1 tile maxima. Groups are rows of a (M*N/G, G) view:
# one contiguous group per row. (A (bm, bg, G) 3-D block reached only 40-60% of a copy on the
# H100; rows of 256 groups, 4 warps, reach a copy's bandwidth: docs/kernel_notes_memory.md.)

def _group_rows(x: jax.Array, group_size: int, what: str) -> tuple[jax.Array, int]:
  if x.ndim == 0 or x.shape[-1] % group_size:
    raise ValueError(f"{what}: last axis of shape {x.shape} must be a multiple of {group_size}")
  rows = x.size // group_size
  return x.reshape(rows, group_size), rows


def _per_group_kernel(x_ref, q_ref, s_ref, *, fmax, floor, interpret):
  x = x_ref[...].astype(jnp.float32)                     # (r, G): one group per row
  scale = _scale(_group_amax_and_bad(x), fmax, floor)    # (r,)
  y = _div(x, jnp.broadcast_to(scale[:, None], x.shape), interpret)
  q_ref[...] = _to_fp8(_saturate(y, fmax), q_ref.dtype, interpret)
  s_ref[...] = scale


@functools.partial(jax.jit, static_argnames=("group_size", "dtype", "floor", "interpret",
                                             "block", "num_warps"))
def quantize_per_group(x: jax.Array, group_size: int, *, dtype, floor: float,
                       interpret: bool = False, block: int = 256,
                       num_warps: int = 4) -> tuple[jax.Array, jax.Array]:
  """Per 1 x G group: scale = max(amax / fmax, floor), data = saturate(x / scale) in `dtype`.

  Args:
    x: floating array (..., N), N % group_size == 0.
    dtype: float8 storage dtype; fmax = jnp.finfo(dtype).max.
    floor: smallest scale.
    block: groups per program (power of two).
  Returns:
    (data: dtype, x.shape; scale: float32 (..., N/G)).
  """
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"quantize_per_group: expected a floating-point array, got {x.dtype}")
  dtype = jnp.dtype(dtype)
  fmax = _fmax(dtype)
  x2, rows = _group_rows(x, group_size, "quantize_per_group")
  r = _pow2_divisor(rows, block)
  q, s = pl.pallas_call(
      functools.partial(_per_group_kernel, fmax=fmax, floor=floor, interpret=interpret),
      grid=(pl.cdiv(rows, r),),
      in_specs=[pl.BlockSpec((r, group_size), lambda i: (i, 0))],
      out_specs=[pl.BlockSpec((r, group_size), lambda i: (i, 0)),
                 pl.BlockSpec((r,), lambda i: (i,))],
      out_shape=[jax.ShapeDtypeStruct((rows, group_size), dtype),
                 jax.ShapeDtypeStruct((rows,), jnp.float32)],
      interpret=interpret, compiler_params=_params(num_warps),
      name="coat_quantize_per_group")(x2)
  return q.reshape(x.shape), s.reshape(*x.shape[:-1], x.shape[-1] // group_size)


def _dequant_group_kernel(q_ref, s_ref, o_ref):
  o_ref[...] = (q_ref[...].astype(jnp.float32) * s_ref[...][:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("group_size", "out_dtype", "interpret", "block",
                                             "num_warps"))
def dequantize_per_group(data: jax.Array, scale: jax.Array, group_size: int,
                         out_dtype=jnp.float32, *, interpret: bool = False, block: int = 256,
                         num_warps: int = 4) -> jax.Array:
  """data * scale per 1 x G group (N divisible by G), cast to out_dtype.

  Args:
    data: quantized values (..., N); scale: float32 (..., N/G).
  """
  if group_size <= 0:
    raise ValueError(f"dequantize_per_group: group_size must be positive, got {group_size}")
  d2, rows = _group_rows(data, group_size, "dequantize_per_group")
  if scale.size != rows:
    raise ValueError(f"dequantize_per_group: scale shape {scale.shape} does not match data "
                     f"{data.shape} with groups of {group_size}")
  r = _pow2_divisor(rows, block)
  out = pl.pallas_call(
      _dequant_group_kernel,
      grid=(pl.cdiv(rows, r),),
      in_specs=[pl.BlockSpec((r, group_size), lambda i: (i, 0)),
                pl.BlockSpec((r,), lambda i: (i,))],
      out_specs=pl.BlockSpec((r, group_size), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((rows, group_size), jnp.dtype(out_dtype)),
      interpret=interpret, compiler_params=_params(num_warps),
      name="coat_dequantize_per_group")(d2, scale.reshape(rows))
  return out.reshape(data.shape)


def _stage1_kernel(x_ref, p_ref):
  p_ref[...] = _group_amax_and_bad(x_ref[...].astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("interpret", "block", "num_warps"))
def tile_amax(x: jax.Array, *, interpret: bool = False, block: int = 256,
              num_warps: int = 4) -> jax.Array:
  """Stage 1: max|x| per 1 x 16 tile, float32 (..., N/16); NaN for tiles holding NaN/inf."""
  x2, rows = _group_rows(x, STAGE1_TILE, "tile_amax")
  r = _pow2_divisor(rows, block)
  p = pl.pallas_call(
      _stage1_kernel,
      grid=(pl.cdiv(rows, r),),
      in_specs=[pl.BlockSpec((r, STAGE1_TILE), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((r,), lambda i: (i,)),
      out_shape=jax.ShapeDtypeStruct((rows,), jnp.float32),
      interpret=interpret, compiler_params=_params(num_warps),
      name="coat_tile_amax")(x2)
  return p.reshape(*x.shape[:-1], x.shape[-1] // STAGE1_TILE)


# ---------------------------------------------------------------------------------------------
# Per-tensor: stage 1 (`tile_amax`); stage 2 (max of those) and the scale are the dispatch's
# (coat_jax.kernels, where a sharded tensor's amax is reduced over the mesh); then this pass.

def _tensor_quant_kernel(s_ref, x_ref, *out_refs, fmax, interpret, transpose):
  x = x_ref[...].astype(jnp.float32)                     # (bm, bn)
  scale = jnp.broadcast_to(s_ref[...], x.shape)          # s_ref block (1, 1)
  y = _saturate(_div(x, scale, interpret), fmax)
  out_refs[0][...] = _to_fp8(y, out_refs[0].dtype, interpret)
  if transpose:
    out_refs[1][...] = _to_fp8(y.T, out_refs[1].dtype, interpret)


@functools.partial(jax.jit, static_argnames=("dtype", "with_transpose", "interpret",
                                             "block_rows", "block_cols", "num_warps"))
def quantize_per_tensor(x: jax.Array, scale: jax.Array, *, dtype, with_transpose: bool = False,
                        interpret: bool = False, block_rows: int = 64, block_cols: int = 64,
                        num_warps: int = 4) -> tuple[jax.Array, jax.Array | None]:
  """data = saturate(x / scale) in `dtype` (fmax = jnp.finfo(dtype).max), one pass.

  Args:
    x: floating array (..., N), N % 16 == 0 (and M % 16 == 0 with `with_transpose`).
    scale: float32 scalar (from the tensor's amax, see `tile_amax`).
    with_transpose: also write data_t, data with its last two axes swapped, in the same pass.
  Returns:
    (data, data_t or None).
  """
  _check_last(x, STAGE1_TILE, "quantize_per_tensor")
  if with_transpose and (x.ndim < 2 or x.shape[-2] % STAGE1_TILE):
    raise ValueError(f"quantize_per_tensor: with_transpose needs ndim >= 2 and the second-last "
                     f"axis a multiple of {STAGE1_TILE}, got shape {x.shape}")
  dtype = jnp.dtype(dtype)
  fmax = _fmax(dtype)
  scale = jnp.asarray(scale, jnp.float32)
  x3 = x.reshape(-1, *x.shape[-2:]) if x.ndim >= 2 else x.reshape(1, 1, -1)
  b, m, n = x3.shape
  bm, bn = _pow2_divisor(m, block_rows), _pow2_divisor(n, block_cols)   # whole tiles only
  grid = (b, pl.cdiv(m, bm), pl.cdiv(n, bn))
  out_specs = [pl.BlockSpec((None, bm, bn), lambda k, i, j: (k, i, j))]
  out_shape = [jax.ShapeDtypeStruct((b, m, n), dtype)]
  if with_transpose:
    out_specs.append(pl.BlockSpec((None, bn, bm), lambda k, i, j: (k, j, i)))
    out_shape.append(jax.ShapeDtypeStruct((b, n, m), dtype))
  outs = pl.pallas_call(
      functools.partial(_tensor_quant_kernel, fmax=fmax, interpret=interpret,
                        transpose=with_transpose),
      grid=grid,
      in_specs=[pl.BlockSpec((1, 1), lambda k, i, j: (0, 0)),
                pl.BlockSpec((None, bm, bn), lambda k, i, j: (k, i, j))],
      out_specs=out_specs, out_shape=out_shape,
      interpret=interpret, compiler_params=_params(num_warps),
      name="coat_quantize_per_tensor")(scale.reshape(1, 1), x3)
  data = outs[0].reshape(x.shape)
  data_t = (outs[1].reshape(*x.shape[:-2], x.shape[-1], x.shape[-2]) if with_transpose
            else None)
  return data, data_t
