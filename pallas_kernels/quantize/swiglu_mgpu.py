"""SwiGLU's forward with its inputs' 1 x G group quantize, and its backward from those codes, each
in one pass (Pallas Mosaic GPU, Hopper).

From gate and up (..., N), one read of each:

  h    = bf16(silu(g) * u),   silu(g) = g / (1 + exp(-g))   (float32 math, h in gate's dtype)
  hmax = max|h| per 1 x G group (float32; NaN where a group of h holds NaN)
  gq, gs = the per-group quantize of gate, uq, us of up, exactly as quantize_mgpu's per-group
           kernel (scale = max(amax * f32(1/fmax), floor) rounded to the scale dtype, NaN for a
           NaN/inf group; q = cast(clamp(x / scale, -fmax, fmax)))

which COAT's SwiGLU needs in its forward: h for the down projection (its per-tensor quantize takes
amax = max(hmax), a reduction over G times fewer values), gate's and up's 1 x G codes as the
backward's residuals. Unfused, XLA's fusion reads gate and up for h and its amax and the
per-group quantize reads each of them again: 2 of the 4 bytes read per element pair are saved.

Backward (`swiglu_backward`), from dh and the forward's codes, one read of each:

  a = gq * gs,  u = uq * us   (per group, float32),   s = 1 / (1 + exp(-a))
  dg = dh * u * s * (1 + a (1 - s)),   du = dh * a * s   (float32 math, stored in dh's dtype)
  gmax, umax = max|dg|, max|du| per 1 x G group (in dh's dtype: the maxima of the stored values)

the gradients the gate and up GEMMs' backward quantize per tensor, with the maxima from which
their amax is a reduction over G times fewer values. XLA's fusion of the same math with the two
amax reductions ran at ~1.8 TB/s in Llama-2-7B's step on an H200, under half of a copy's
bandwidth; this kernel at ~2.6 TB/s (docs/kernels.md).

Blocks are (r, G) row tiles of the (rows, G) view (one group per row) in the WGMMA register
layout, with the per-group quantize's own math (quantize_mgpu.quantize_groups). Imports jax and
numpy only: fmax, floor and dtypes are arguments.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.quantize.quantize_mgpu import (check_problem, load_dequantized, load_f32,
                                                   quantize_groups, row_blocks, rows_per_block,
                                                   rows_problem, shared_trace)
from pallas_kernels.quantize.rows_mgpu import MAX_CTAS, launch


def supported(shape, dtype, group_size: int) -> bool:
  """As the per-group quantize: a float (..., N), N % G == 0, G in 16..256 (a multiple of 16),
  size / G a positive multiple of 64."""
  return jnp.issubdtype(dtype, jnp.floating) and rows_problem(shape, dtype, group_size) is None


def _kernel(g_ref, u_ref, gq_ref, gs_ref, uq_ref, us_ref, h_ref, hmax_ref, *, fmax, floor,
            interpret):
  g = load_f32(g_ref)                                    # (r, G)
  u = load_f32(u_ref)
  h = (g / (1.0 + jnp.exp(-g)) * u).astype(h_ref.dtype)
  quantize_groups(g, gq_ref, gs_ref, fmax, floor, interpret)
  quantize_groups(u, uq_ref, us_ref, fmax, floor, interpret)
  hmax_ref[...] = jnp.max(jnp.abs(h.astype(jnp.float32)), axis=1)
  h_ref[...] = h


@functools.partial(jax.jit, static_argnames=("group_size", "out_dtype", "fmax", "floor",
                                             "interpret", "block", "max_ctas", "stages",
                                             "scale_dtype"))
def swiglu_quantize(gate: jax.Array, up: jax.Array, *, group_size: int, out_dtype, fmax: float,
                    floor: float, interpret: bool = False, block: int = 128,
                    max_ctas: int = MAX_CTAS, stages: int = 2, scale_dtype=jnp.float32):
  """h = silu(gate) * up with max|h| per group and gate's and up's per-group quantize.

  Args:
    gate, up: float (..., N), same shape and dtype (see `supported`).
    out_dtype: the FP8 storage dtype; fmax its largest finite value; floor the scale's floor;
    scale_dtype: float32 or bfloat16. block, max_ctas, stages: as quantize_mgpu's per-group kernel.
  Returns:
    (h: gate.dtype (..., N), hmax: float32 (..., N / G), gq, gs, uq, us: codes out_dtype
    (..., N) and scales scale_dtype (..., N / G)).
  """
  if gate.shape != up.shape or gate.dtype != up.dtype:
    raise ValueError(f"swiglu_quantize: gate {gate.shape} {gate.dtype} and up {up.shape} "
                     f"{up.dtype} differ")
  if not supported(gate.shape, gate.dtype, group_size):
    check_problem(rows_problem(gate.shape, gate.dtype, group_size) or
           f"dtype {gate.dtype} is not a float type", "swiglu_quantize")
  rows = gate.size // group_size
  outs = _launch(gate.reshape(rows, group_size), up.reshape(rows, group_size),
                 out_dtype=jnp.dtype(out_dtype), fmax=float(fmax), floor=float(floor),
                 interpret=interpret, block=block, max_ctas=max_ctas, stages=stages,
                 scale_dtype=jnp.dtype(scale_dtype))
  gq, gs, uq, us, h, hmax = outs
  meta = (*gate.shape[:-1], gate.shape[-1] // group_size)
  return (h.reshape(gate.shape), hmax.reshape(meta), gq.reshape(gate.shape), gs.reshape(meta),
          uq.reshape(gate.shape), us.reshape(meta))


@shared_trace
def _launch(g2, u2, *, out_dtype, fmax, floor, interpret, block, max_ctas, stages, scale_dtype):
  rows, group_size = g2.shape
  r = rows_per_block(rows, block)
  big, small = row_blocks(r, group_size)
  codes = jax.ShapeDtypeStruct((rows, group_size), out_dtype)
  scales = jax.ShapeDtypeStruct((rows,), scale_dtype)
  return launch(
      functools.partial(_kernel, fmax=fmax, floor=floor, interpret=interpret),
      inputs=[g2, u2], in_blocks=[big, big],
      out_shapes=[codes, scales, codes, scales, jax.ShapeDtypeStruct((rows, group_size), g2.dtype),
                  jax.ShapeDtypeStruct((rows,), jnp.float32)],
      out_blocks=[big, small, big, small, big, small],
      num_blocks=rows // r, interpret=interpret, max_ctas=max_ctas, stages=stages,
      name="coat_swiglu_quantize_mgpu")


def _backward_kernel(dh_ref, gq_ref, gs_ref, uq_ref, us_ref, dg_ref, du_ref, gmax_ref, umax_ref):
  d = load_f32(dh_ref)                                   # (r, G)
  a = load_dequantized(gq_ref, gs_ref)
  u = load_dequantized(uq_ref, us_ref)
  sig = 1.0 / (1.0 + jnp.exp(-a))
  dg = (d * u * sig * (1.0 + a * (1.0 - sig))).astype(dg_ref.dtype)
  du = (d * a * sig).astype(du_ref.dtype)
  gmax_ref[...] = jnp.max(jnp.abs(dg.astype(jnp.float32)), axis=1).astype(gmax_ref.dtype)
  umax_ref[...] = jnp.max(jnp.abs(du.astype(jnp.float32)), axis=1).astype(umax_ref.dtype)
  dg_ref[...] = dg
  du_ref[...] = du


@functools.partial(jax.jit, static_argnames=("group_size", "interpret", "block", "max_ctas",
                                             "stages"))
def swiglu_backward(dh: jax.Array, gq: jax.Array, gs: jax.Array, uq: jax.Array, us: jax.Array, *,
                    group_size: int, interpret: bool = False, block: int = 128,
                    max_ctas: int = MAX_CTAS, stages: int = 2):
  """SwiGLU's gradients from dh and gate's and up's per-group codes (module docstring).

  Args:
    dh: float (..., N) (see `supported`); gq, uq: FP8 codes of dh's shape; gs, us: their scales
      (..., N / G), float32 or bfloat16. block, max_ctas, stages: as `swiglu_quantize`.
  Returns:
    (dg, du: dh.dtype (..., N), gmax, umax: dh.dtype (..., N / G)).
  """
  if not supported(dh.shape, dh.dtype, group_size):
    check_problem(rows_problem(dh.shape, dh.dtype, group_size) or
                  f"dtype {dh.dtype} is not a float type", "swiglu_backward")
  rows = dh.size // group_size
  for name, q, sc in (("gate", gq, gs), ("up", uq, us)):
    if q.shape != dh.shape or sc.size != rows:
      raise ValueError(f"swiglu_backward: {name} codes {q.shape} / scales {sc.shape} do not match "
                       f"dh {dh.shape} in groups of {group_size}")
  dg, du, gmax, umax = _backward_launch(
      dh.reshape(rows, group_size), gq.reshape(rows, group_size), gs.reshape(rows),
      uq.reshape(rows, group_size), us.reshape(rows), interpret=interpret, block=block,
      max_ctas=max_ctas, stages=stages)
  meta = (*dh.shape[:-1], dh.shape[-1] // group_size)
  return dg.reshape(dh.shape), du.reshape(dh.shape), gmax.reshape(meta), umax.reshape(meta)


@shared_trace
def _backward_launch(dh2, gq2, gs1, uq2, us1, *, interpret, block, max_ctas, stages):
  rows, group_size = dh2.shape
  r = rows_per_block(rows, block)
  big, small = row_blocks(r, group_size)
  grads = jax.ShapeDtypeStruct((rows, group_size), dh2.dtype)
  maxima = jax.ShapeDtypeStruct((rows,), dh2.dtype)
  return launch(
      _backward_kernel, inputs=[dh2, gq2, gs1, uq2, us1], in_blocks=[big, big, small, big, small],
      out_shapes=[grads, grads, maxima, maxima], out_blocks=[big, big, small, small],
      num_blocks=rows // r, interpret=interpret, max_ctas=max_ctas, stages=stages,
      name="coat_swiglu_backward_mgpu")
