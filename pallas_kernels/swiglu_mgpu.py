"""SwiGLU's forward with its inputs' 1 x G group quantize, in one pass (Pallas Mosaic GPU, Hopper).

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

Blocks are (r, G) row tiles of the (rows, G) view (one group per row) in the WGMMA register
layout, with the per-group quantize's own math (quantize_mgpu._quantize_groups). Imports jax and
numpy only: fmax, floor and dtypes are arguments.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.quantize_mgpu import (_WGMMA, _block_rows, _check, _div, _load_f32,
                                          _quantize_groups, _row_blocks, _rows_problem,
                                          _saturate, _shared_trace)
from pallas_kernels.rows_mgpu import MAX_CTAS, launch, pad_scalars


def supported(shape, dtype, group_size: int) -> bool:
  """As the per-group quantize: a float (..., N), N % G == 0, G in 16..256 (a multiple of 16),
  size / G a positive multiple of 64."""
  return jnp.issubdtype(dtype, jnp.floating) and _rows_problem(shape, dtype, group_size) is None


def _kernel(g_ref, u_ref, gq_ref, gs_ref, uq_ref, us_ref, h_ref, hmax_ref, *, fmax, floor,
            interpret):
  g = _load_f32(g_ref)                                    # (r, G)
  u = _load_f32(u_ref)
  h = (g / (1.0 + jnp.exp(-g)) * u).astype(h_ref.dtype)
  _quantize_groups(g, gq_ref, gs_ref, fmax, floor, interpret)
  _quantize_groups(u, uq_ref, us_ref, fmax, floor, interpret)
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
    _check(_rows_problem(gate.shape, gate.dtype, group_size) or
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


@_shared_trace
def _launch(g2, u2, *, out_dtype, fmax, floor, interpret, block, max_ctas, stages, scale_dtype):
  rows, group_size = g2.shape
  r = _block_rows(rows, block)
  big, small = _row_blocks(r, group_size)
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


# ---------------------------------------------------------------------------------------------
# Backward: the gradients of gate and up, quantized per tensor with their transposed copies.
#
#   a = gq * gs, u = uq * us              (the forward's 1 x G codes and scales, float32)
#   s = 1 / (1 + exp(-a))
#   dgate = bf16(dh * u * s * (1 + a * (1 - s))),   dup = bf16(dh * a * s)
#   codes = cast(clamp(d / scale, -fmax, fmax)) of each, as (M, N) and as (N, M)
#
# with the two per-tensor scales given (their amax needs a pass over the whole tensor first).
# What the unfused path does (SwiGLU's backward writes dgate and dup in bf16, then a per-tensor
# quantize + transpose pass reads each), without writing or reading the bf16 gradients.

def supported_backward(shape, dtype, group_size: int) -> bool:
  """dh (..., N) of a 16-bit float dtype (the transposed copy is read back from a bf16 tile, as
  quantize_mgpu's transposing per-tensor kernel reads its input), N and M = prod(shape[:-1])
  multiples of 128 and 64, G in 16..128 dividing 128."""
  if len(shape) < 2 or not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize != 2:
    return False
  m = int(np.prod(shape[:-1]))
  return (shape[-1] % _BWD_COLS == 0 and m % _BWD_ROWS == 0 and group_size % 16 == 0
          and _BWD_COLS % group_size == 0)


_BWD_ROWS, _BWD_COLS = 64, 128   # a block: 64 tokens x 128 features (shared memory: 2 slots of
#                                  its 6 inputs and 4 outputs, and 2 bf16 tiles, ~170 KB)


def _backward_kernel(s_ref, dh_ref, gq_ref, gst_ref, uq_ref, ust_ref, dg_ref, dgt_ref, du_ref,
                     dut_ref, g_tile, u_tile, *, group, fmax, interpret):
  """One (bm, bn) block, a 1 x G group column at a time: (bm, G) views of the tiles (no reshape
  of a shared-memory ref: GPU interpret mode refuses it), the scales given transposed ((bn / G,
  bm) tiles: scale column j is then the contiguous row j), a group per row in the WGMMA layout as
  the per-group kernels have it. The bf16 gradients also go to two (bm, bn) tiles, read back
  transposed for the (bn, bm) codes (as quantize_mgpu's transposing per-tensor kernel)."""
  scales = [s_ref[0], s_ref[1]]
  for j in range(dh_ref.shape[1] // group):
    cols = (slice(None), pl.ds(j * group, group))
    col_scale = lambda ref: plgpu.load(ref.at[j], layout=_WGMMA.reduce(1),
                                       optimized=False).astype(jnp.float32)[:, None]
    load = lambda ref: plgpu.load(ref.at[cols], layout=_WGMMA,
                                  optimized=False).astype(jnp.float32)
    a = load(gq_ref) * col_scale(gst_ref)
    u = load(uq_ref) * col_scale(ust_ref)
    d = load(dh_ref)
    sig = jax.nn.sigmoid(a)
    grads = ((d * u * sig * (1.0 + a * (1.0 - sig))).astype(dh_ref.dtype),
             (d * (a * sig)).astype(dh_ref.dtype))
    for grad, scale, q_ref, tile in zip(grads, scales, (dg_ref, du_ref), (g_tile, u_tile)):
      y = grad.astype(jnp.float32)
      q_ref.at[cols][...] = _saturate(_div(y, jnp.broadcast_to(scale, y.shape), interpret),
                                      fmax).astype(q_ref.dtype)
      tile.at[cols][...] = grad
  plgpu.commit_smem()    # every thread's part of the tiles, before they are read transposed
  for scale, qt_ref, tile in zip(scales, (dgt_ref, dut_ref), (g_tile, u_tile)):
    yt = plgpu.load(tile.transpose((1, 0)), layout=_WGMMA, optimized=False).astype(jnp.float32)
    qt_ref[...] = _saturate(_div(yt, jnp.broadcast_to(scale, yt.shape), interpret),
                            fmax).astype(qt_ref.dtype)


@functools.partial(jax.jit, static_argnames=("group_size", "out_dtype", "fmax", "interpret",
                                             "max_ctas", "stages"))
def swiglu_backward_quantize(dh: jax.Array, gq: jax.Array, gs: jax.Array, uq: jax.Array,
                             us: jax.Array, scale_gate: jax.Array, scale_up: jax.Array, *,
                             group_size: int, out_dtype, fmax: float, interpret: bool = False,
                             max_ctas: int = MAX_CTAS, stages: int = 2):
  """SwiGLU's input gradients, per-tensor quantized with their transposed copies, in one pass.

  Args:
    dh: (..., N) 16-bit float, the gradient of h = silu(gate) * up (see `supported_backward`).
    gq, uq: gate's and up's 1 x G codes (..., N); gs, us: their scales (..., N / G).
    scale_gate, scale_up: float32 () per-tensor scales of dgate and dup.
    out_dtype: the FP8 dtype of the codes; fmax its largest finite value.
  Returns:
    (dgate codes (..., N), dgate^T codes (N, M), dup codes, dup^T codes), M = prod(dh.shape[:-1]).
  """
  if not supported_backward(dh.shape, dh.dtype, group_size):
    raise ValueError(f"swiglu_backward_quantize: dh {dh.shape} {dh.dtype} unsupported (needs a "
                     f"16-bit float (..., N), N % {_BWD_COLS} == 0, M % {_BWD_ROWS} == 0)")
  meta = (*dh.shape[:-1], dh.shape[-1] // group_size)
  for name, x, shape in (("gq", gq, dh.shape), ("uq", uq, dh.shape), ("gs", gs, meta),
                         ("us", us, meta)):
    if tuple(x.shape) != tuple(shape):
      raise ValueError(f"swiglu_backward_quantize: {name} shape {x.shape} != {tuple(shape)}")
  n = dh.shape[-1]
  m = dh.size // n
  # The scales go in transposed, (N / G, M): 1/8 of the codes' bytes for G = 16 (the kernel's
  # docstring says why).
  scales_t = lambda x: jnp.swapaxes(x.reshape(m, n // group_size), 0, 1)
  outs = _backward_launch(
      pad_scalars([scale_gate, scale_up]), dh.reshape(m, n), gq.reshape(m, n), scales_t(gs),
      uq.reshape(m, n), scales_t(us),
      out_dtype=jnp.dtype(out_dtype), fmax=float(fmax), interpret=interpret, max_ctas=max_ctas,
      stages=stages)
  dg, dgt, du, dut = outs
  return dg.reshape(dh.shape), dgt, du.reshape(dh.shape), dut


@_shared_trace
def _backward_launch(scalars, dh, gq, gst, uq, ust, *, out_dtype, fmax, interpret, max_ctas,
                     stages):
  m, n = dh.shape
  group = n // gst.shape[0]
  bm, bn = _BWD_ROWS, _BWD_COLS
  gj = n // bn
  data = ((bm, bn), lambda blk: (pl.ds(blk // gj * bm, bm), pl.ds(blk % gj * bn, bn)))
  meta = ((bn // group, bm),
          lambda blk: (pl.ds(blk % gj * (bn // group), bn // group), pl.ds(blk // gj * bm, bm)))
  data_t = ((bn, bm), lambda blk: (pl.ds(blk % gj * bn, bn), pl.ds(blk // gj * bm, bm)))
  codes, codes_t = (jax.ShapeDtypeStruct((m, n), out_dtype),
                    jax.ShapeDtypeStruct((n, m), out_dtype))
  return launch(
      functools.partial(_backward_kernel, group=group, fmax=fmax, interpret=interpret),
      scalars=[scalars], inputs=[dh, gq, gst, uq, ust], in_blocks=[data, data, meta, data, meta],
      out_shapes=[codes, codes_t, codes, codes_t], out_blocks=[data, data_t, data, data_t],
      num_blocks=(m // bm) * gj, interpret=interpret, max_ctas=max_ctas, stages=stages,
      body_scratch=[plgpu.SMEM((bm, bn), dh.dtype), plgpu.SMEM((bm, bn), dh.dtype)],
      name="coat_swiglu_backward_quantize_mgpu")
