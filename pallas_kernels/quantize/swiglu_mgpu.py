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
import math

import jax
import jax.numpy as jnp

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.quantize.quantize_mgpu import (check_problem, load_dequantized,
                                                   load_f32, quantize_groups, row_blocks,
                                                   rows_per_block, rows_problem, saturate,
                                                   scale_from_amax, shared_trace, true_div)
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


def _grads_of(d, a, u, dtype):
  """d_gate and d_up from float32 dh, gate and up (float32 math, rounded to dtype: what is
  stored)."""
  sig = 1.0 / (1.0 + jnp.exp(-a))
  dg = (d * u * sig * (1.0 + a * (1.0 - sig))).astype(dtype)
  du = (d * a * sig).astype(dtype)
  return dg, du


def _grads(dh_ref, gq_ref, gs_ref, uq_ref, us_ref):
  """d_gate and d_up of an (r, G) block."""
  return _grads_of(load_f32(dh_ref), load_dequantized(gq_ref, gs_ref),
                   load_dequantized(uq_ref, us_ref), dh_ref.dtype)


def _backward_kernel(dh_ref, gq_ref, gs_ref, uq_ref, us_ref, *out_refs):
  """(dg, du, gmax, umax) refs, or (gmax, umax) only (`maxima_only`)."""
  dg, du = _grads(dh_ref, gq_ref, gs_ref, uq_ref, us_ref)
  *grad_refs, gmax_ref, umax_ref = out_refs
  gmax_ref[...] = jnp.max(jnp.abs(dg.astype(jnp.float32)), axis=1).astype(gmax_ref.dtype)
  umax_ref[...] = jnp.max(jnp.abs(du.astype(jnp.float32)), axis=1).astype(umax_ref.dtype)
  if grad_refs:
    grad_refs[0][...] = dg
    grad_refs[1][...] = du


def _check_codes(dh, gq, gs, uq, us, group_size, what):
  if not supported(dh.shape, dh.dtype, group_size):
    check_problem(rows_problem(dh.shape, dh.dtype, group_size) or
                  f"dtype {dh.dtype} is not a float type", what)
  rows = dh.size // group_size
  for name, q, sc in (("gate", gq, gs), ("up", uq, us)):
    if q.shape != dh.shape or sc.size != rows:
      raise ValueError(f"{what}: {name} codes {q.shape} / scales {sc.shape} do not match "
                       f"dh {dh.shape} in groups of {group_size}")
  return rows


@functools.partial(jax.jit, static_argnames=("group_size", "maxima_only", "interpret", "block",
                                             "max_ctas", "stages"))
def swiglu_backward(dh: jax.Array, gq: jax.Array, gs: jax.Array, uq: jax.Array, us: jax.Array, *,
                    group_size: int, maxima_only: bool = False, interpret: bool = False,
                    block: int = 128, max_ctas: int = MAX_CTAS, stages: int = 2):
  """SwiGLU's gradients from dh and gate's and up's per-group codes (module docstring).

  Args:
    dh: float (..., N) (see `supported`); gq, uq: FP8 codes of dh's shape; gs, us: their scales
      (..., N / G), float32 or bfloat16. block, max_ctas, stages: as `swiglu_quantize`.
    maxima_only: write gmax and umax only (the first pass of `swiglu_backward_quantize`).
  Returns:
    (dg, du: dh.dtype (..., N), gmax, umax: dh.dtype (..., N / G)), or (gmax, umax).
  """
  rows = _check_codes(dh, gq, gs, uq, us, group_size, "swiglu_backward")
  outs = _backward_launch(
      dh.reshape(rows, group_size), gq.reshape(rows, group_size), gs.reshape(rows),
      uq.reshape(rows, group_size), us.reshape(rows), maxima_only=maxima_only,
      interpret=interpret, block=block, max_ctas=max_ctas, stages=stages)
  meta = (*dh.shape[:-1], dh.shape[-1] // group_size)
  maxima = tuple(m.reshape(meta) for m in outs[-2:])
  return maxima if maxima_only else (outs[0].reshape(dh.shape), outs[1].reshape(dh.shape),
                                     *maxima)


@shared_trace
def _backward_launch(dh2, gq2, gs1, uq2, us1, *, maxima_only, interpret, block, max_ctas,
                     stages):
  rows, group_size = dh2.shape
  r = rows_per_block(rows, block)
  big, small = row_blocks(r, group_size)
  grads = jax.ShapeDtypeStruct((rows, group_size), dh2.dtype)
  maxima = jax.ShapeDtypeStruct((rows,), dh2.dtype)
  out_shapes, out_blocks = [maxima, maxima], [small, small]
  if not maxima_only:
    out_shapes, out_blocks = [grads, grads] + out_shapes, [big, big] + out_blocks
  return launch(
      _backward_kernel, inputs=[dh2, gq2, gs1, uq2, us1], in_blocks=[big, big, small, big, small],
      out_shapes=out_shapes, out_blocks=out_blocks, num_blocks=rows // r, interpret=interpret,
      max_ctas=max_ctas, stages=stages,
      name="coat_swiglu_backward_maxima_mgpu" if maxima_only else "coat_swiglu_backward_mgpu")


# ---------------------------------------------------------------------------------------------
# SwiGLU's backward straight to the gradients' per-tensor codes and their transposed copies.

def supported_quantize(shape, dtype, group_size: int) -> bool:
  """`swiglu_backward_quantize`: as `supported`, with a 16-bit dh (..., N) whose (M, N) view (M
  the product of the leading axes) is 64 x 128 blocks, and G dividing 128."""
  return (supported(shape, dtype, group_size) and len(shape) >= 2
          and jnp.dtype(dtype).itemsize == 2 and shape[-1] % 128 == 0
          and math.prod(shape[:-1]) % 64 == 0 and 128 % group_size == 0)


def _backward_quantize_kernel(s_ref, dh_ref, gq_ref, gst_ref, uq_ref, ust_ref, dgq_ref, dgt_ref,
                              duq_ref, dut_ref, g_stage, u_stage, *, fmax, interpret):
  """One (bm, bn) block of the (M, N) view: dh and the codes loaded whole in the WGMMA register
  layout, each 1 x G column slice dequantized with its bm scales (a contiguous row of the
  transposed scales' (bn / G, bm) block) and the slices' gradients put together again; quantized
  with the scales s_ref[0] (d_gate) and s_ref[1] (d_up) into the codes' blocks, their dh-dtype
  values staged in shared memory and read back through a transposed view for the transposed
  codes (as the per-tensor quantize's transposed copy)."""
  group = dh_ref.shape[1] // gst_ref.shape[0]
  scales = (s_ref[0], s_ref[1])
  d, gq, uq = (plgpu.load(r, layout=plgpu.Layout.WGMMA) for r in (dh_ref, gq_ref, uq_ref))
  row = plgpu.Layout.WGMMA.reduce(1)
  parts = []
  for c in range(gst_ref.shape[0]):
    cols = slice(c * group, (c + 1) * group)
    scaled = lambda q, s_ref: q[:, cols].astype(jnp.float32) * jnp.broadcast_to(
        plgpu.load(s_ref.at[c], layout=row).astype(jnp.float32)[:, None],
        (q.shape[0], group))
    parts.append(_grads_of(d[:, cols].astype(jnp.float32), scaled(gq, gst_ref),
                           scaled(uq, ust_ref), dh_ref.dtype))
  grads = [jnp.concatenate(p, axis=1) for p in zip(*parts)]

  def quantize(x, scale):
    return saturate(true_div(x.astype(jnp.float32), jnp.broadcast_to(scale, x.shape), interpret),
                    fmax)

  for x, scale, q_ref, stage in zip(grads, scales, (dgq_ref, duq_ref), (g_stage, u_stage)):
    q_ref[...] = quantize(x, scale).astype(q_ref.dtype)
    stage[...] = x
  plgpu.commit_smem()   # every thread's part of the staged tiles stored before reads across
  for scale, t_ref, stage in zip(scales, (dgt_ref, dut_ref), (g_stage, u_stage)):
    xt = plgpu.load(stage.transpose((1, 0)), layout=plgpu.Layout.WGMMA, optimized=False)
    t_ref[...] = quantize(xt, scale).astype(t_ref.dtype)


# One CTA per SM of an H100 or H200: a block's buffers, two slots and the staging tiles take
# ~164 KiB of shared memory.
QUANTIZE_MAX_CTAS = 132


@functools.partial(jax.jit, static_argnames=("group_size", "out_dtype", "fmax", "floor",
                                             "interpret", "block", "max_ctas", "stages"))
def swiglu_backward_quantize(dh: jax.Array, gq: jax.Array, gs: jax.Array, uq: jax.Array,
                             us: jax.Array, *, group_size: int, out_dtype, fmax: float,
                             floor: float, interpret: bool = False, block: int = 128,
                             max_ctas: int = QUANTIZE_MAX_CTAS, stages: int = 2):
  """SwiGLU's gradients as per-tensor FP8 codes with their transposed copies, in two passes:

    1. `swiglu_backward(maxima_only=True)`: per-group maxima of d_gate and d_up (as stored in
       dh's dtype), from which amax_gate, amax_up (their max) and the per-tensor scales
       max(amax * f32(1/fmax), floor) (NaN for a NaN/inf amax) follow;
    2. per 64 x 128 block: d_gate, d_up recomputed (bit-identical: the same math), quantized
       q = cast(clamp(d / scale, -fmax, fmax)) and written with the transposed copy.

  The same codes as `swiglu_backward` followed by the per-tensor quantize with the transposed
  copy of each gradient (quantize_mgpu.quantize_per_tensor), without writing d_gate and d_up:
  per element pair ~12.75 bytes moved instead of ~16.75.

  Args:
    dh: float16 / bfloat16 (..., N) (see `supported_quantize`); gq, uq, gs, us as
      `swiglu_backward`. out_dtype: the FP8 dtype of the codes (fmax its largest value, floor
      the scale's floor). block, stages: pass 1's (as `swiglu_backward`); max_ctas pass 2's CTA
      cap.
  Returns:
    (dgq, dg_scale, dgq_t, duq, du_scale, duq_t): codes out_dtype of dh's shape, scales float32
    (), the codes of the (M, N) view transposed (N, M), M the product of dh's leading axes.
  """
  if not supported_quantize(dh.shape, dh.dtype, group_size):
    check_problem(rows_problem(dh.shape, dh.dtype, group_size) or
                  f"shape {dh.shape} of {dh.dtype} unsupported (needs a 16-bit float dtype, "
                  f"ndim >= 2, N % 128 == 0, M % 64 == 0 for M the leading axes' size, "
                  f"128 % G == 0)",
                  "swiglu_backward_quantize")
  _check_codes(dh, gq, gs, uq, us, group_size, "swiglu_backward_quantize")
  gmax, umax = swiglu_backward(dh, gq, gs, uq, us, group_size=group_size, maxima_only=True,
                               interpret=interpret, block=block, stages=stages)
  amax = jnp.stack([jnp.max(gmax), jnp.max(umax)]).astype(jnp.float32)   # NaN stays NaN
  scale = scale_from_amax(amax, fmax=fmax, floor=floor)
  n = dh.shape[-1]
  m = dh.size // n
  dgq, dgt, duq, dut = _backward_quantize_launch(
      scale, dh.reshape(m, n), gq.reshape(m, n), gs.reshape(m, n // group_size).T,
      uq.reshape(m, n), us.reshape(m, n // group_size).T, out_dtype=jnp.dtype(out_dtype),
      fmax=float(fmax), interpret=interpret, max_ctas=max_ctas, stages=stages)
  return dgq.reshape(dh.shape), scale[0], dgt, duq.reshape(dh.shape), scale[1], dut


@shared_trace
def _backward_quantize_launch(scale, dh2, gq2, gst, uq2, ust, *, out_dtype, fmax, interpret,
                              max_ctas, stages):
  m, n = dh2.shape
  bm, bn = 64, 128
  bg = bn * gst.shape[0] // n                           # groups per block row
  gj = n // bn
  at = lambda rows, cols, swap=False: (lambda blk: (lambda i, j: (
      (pl.ds(j * rows, rows), pl.ds(i * cols, cols)) if swap else
      (pl.ds(i * rows, rows), pl.ds(j * cols, cols))))(blk // gj, blk % gj))
  data, meta, tdata = ((bm, bn), at(bm, bn)), ((bg, bm), at(bg, bm, True)), ((bn, bm),
                                                                             at(bn, bm, True))
  codes, codes_t = (jax.ShapeDtypeStruct(s, out_dtype) for s in ((m, n), (n, m)))
  return launch(
      functools.partial(_backward_quantize_kernel, fmax=fmax, interpret=interpret),
      scalars=[scale], inputs=[dh2, gq2, gst, uq2, ust], in_blocks=[data, data, meta, data, meta],
      out_shapes=[codes, codes_t, codes, codes_t], out_blocks=[data, tdata, data, tdata],
      num_blocks=(m // bm) * gj, interpret=interpret, max_ctas=max_ctas, stages=stages,
      body_scratch=[plgpu.SMEM((bm, bn), dh2.dtype), plgpu.SMEM((bm, bn), dh2.dtype)],
      name="coat_swiglu_backward_quantize_mgpu")
