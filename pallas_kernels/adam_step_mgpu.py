"""Fused COAT AdamW step on Pallas Mosaic GPU: one pass over param, grad and both FP8 moments.

Per group of G elements (one row of a (P/G, G) view), as the reference (coat_jax.optim
adam_step_reference with coat_jax.expansion's compact form) and the Triton-backend kernel
(pallas_kernels/adam_step.py):

  load:   x = sign(q) * mx * (|q| / fmax)^(1/k)      (exactly q * mx / fmax where k = 1)
  Adam:   m = b1 m + (1-b1) g,  v = b2 v + (1-b2) g^2,  denom = (sqrt(v) / sqrt(bc2) + eps) * bc1
          out = p - lr (m / denom + wd p)   (output="param")   or   -lr (m / denom + wd p)
  store:  mx = max|x| + floor,  mn = min non-zero |x| + floor (mx if none),
          k = clip(floor(log2(R) / log2(mx / mn) * expand_min), 1, max_k) / expand_min,
          q = cast(clamp(sign(x) * fmax * 2^(k * (log2|x| - log2 mx)), +-fmax))

Differences from the reference (a few FP8 codes may move by one, as in the Triton kernel):
log2(|x| / mx) is computed as log2|x| - log2(mx), and 1/sqrt(bc2) multiplies instead of dividing.
floor(y) for y >= 0 is a truncating float->int conversion of min(y, 256) (Mosaic GPU has no
floor lowering); the clip to [1, max_k] then gives the reference's k exactly.

Blocks: `block` rows of G in the WGMMA register layout (row max/min within a warp); rows must be a
multiple of 64. A block is processed in column chunks (`_kernel`) to stay within registers. The
new param and moment codes are written into their inputs' shared-memory buffers
(`rows_mgpu.launch(out_in_place=...)`) and the new float32 m into a float32 grad's, which keeps two
pipeline slots of 64 x 128 float32 blocks plus the new v within the 227 KiB of shared memory. Imports jax and numpy only: format limits come as arguments.

Status (H100, 2026-11-23, benchmarks/bench_kernels_mgpu.py, 16384 x 4096 float32 param): correct
(GPU test vs float64 numpy passes; vs XLA's jnp reference the same codes differ as for the
jax-triton kernel) but SLOW: 325 GB/s, 11% of a copy, vs 1.6 TB/s for the Triton-backend kernel and
1.5-1.75 TB/s for pallas_kernels/adam_step_triton.py. Tried without effect: 128-byte-swizzled
shared memory (228 GB/s either way), one pipeline slot for 2 CTAs per SM (314 -> 326 GB/s);
column chunks (64 -> 16 registers per array) gave 228 -> 325. Not yet profiled: the Mosaic GPU
lowering of the per-element log2 / exp2 / sign / divisions is the next suspect. Use the jax-triton
kernel until this is fixed.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.adam_operands import OUTPUTS, check_operands
from pallas_kernels.rows_mgpu import ROW_QUANTUM, launch, pad_scalars

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_WGMMA = plgpu.Layout.WGMMA
_ROW = plgpu.Layout.WGMMA.reduce(1)


def problem(shape, dtype, m_dtype, v_dtype, group_size: int) -> str | None:
  """Why the kernel cannot take a param of `shape` / `dtype` with these moments, or None."""
  if not jnp.issubdtype(dtype, jnp.floating):
    return f"param dtype {dtype} is not floating"
  if jnp.dtype(m_dtype) not in FP8_DTYPES or jnp.dtype(v_dtype) not in FP8_DTYPES:
    return f"moment dtypes {m_dtype} / {v_dtype} are not FP8 (int8 moments are not supported)"
  if group_size % 16 or not 16 <= group_size <= 256:
    return f"group size {group_size} must be a multiple of 16 in 16..256"
  if len(shape) == 0 or shape[-1] % group_size:
    return f"last axis of shape {tuple(shape)} is not a multiple of {group_size}"
  rows = int(np.prod(shape)) // group_size
  if rows == 0 or rows % ROW_QUANTUM:
    return f"shape {tuple(shape)} holds {rows} groups; the kernel needs a multiple of {ROW_QUANTUM}"
  return None


def supported(shape, dtype, m_dtype, v_dtype, group_size: int) -> bool:
  return problem(shape, dtype, m_dtype, v_dtype, group_size) is None


def _rows(v, shape):
  return jnp.broadcast_to(v[:, None], shape)


def _dequant(q_ref, mx, code, fmax, expand_min):
  """Inverse expansion of one moment chunk: float32. mx, code: (r,) row vectors."""
  q = plgpu.load(q_ref, layout=_WGMMA).astype(jnp.float32)
  qa = jnp.abs(q)
  mx, code = _rows(mx, q.shape), _rows(code, q.shape)
  inv_fmax = float(np.float32(1.0) / np.float32(fmax))
  powered = mx * jnp.exp2((float(expand_min) / code) * jnp.log2(qa * inv_fmax))
  linear = qa * (mx * inv_fmax)
  return jnp.sign(q) * jnp.where(code == float(expand_min), linear, powered)


def _row_stats(x):
  """(max|x|, min over non-zero |x| or inf) per row of a chunk."""
  a = jnp.abs(x)
  return jnp.max(a, axis=1), jnp.min(jnp.where(a > 0, a, jnp.inf), axis=1)


def _k_steps(amax, amin_nz, *, fmax, log2_range, expand, expand_min, max_k, floor):
  """(mx, k steps as float32) per row from the row stats, as the reference's expansion."""
  mx = amax + floor
  if not expand:
    return mx, jnp.full(mx.shape, float(min(expand_min, max_k)), jnp.float32)
  mn = jnp.where(amin_nz == jnp.inf, mx, amin_nz + floor)
  lr = jnp.log2(mx / mn)
  ok = lr > 0
  y = jnp.minimum(log2_range / jnp.where(ok, lr, 1.0) * float(expand_min), 256.0)
  steps = jnp.where(ok, y.astype(jnp.int32).astype(jnp.float32), float(expand_min))
  return mx, jnp.minimum(jnp.maximum(steps, 1.0), float(max_k))


def _requant(x, mx, steps, *, fmax, expand, expand_min, **_):
  """FP8-ready float32 codes of one chunk: clamp(sign(x) fmax (|x|/mx)^k)."""
  if expand:
    k = _rows(steps * float(np.float32(1.0) / np.float32(expand_min)), x.shape)
    y = jnp.sign(x) * (fmax * jnp.exp2(k * (jnp.log2(jnp.abs(x)) - _rows(jnp.log2(mx),
                                                                          x.shape))))
  else:
    y = x / _rows(mx * float(np.float32(1.0) / np.float32(fmax)), x.shape)
  return jnp.minimum(jnp.maximum(y, -fmax), fmax)


def _kernel(s_ref, *refs, has_param, output, m_cfg, v_cfg, common, chunk, m_in_grad):
  """refs: [param], grad, m (q, amax, code), v (q, amax, code) blocks; the outputs; then the
  scratch for the new m (unless `m_in_grad`: a float32 grad's consumed chunks hold it) and v.

  Two passes over column chunks of `chunk` (a whole 64 x 128 float32 block per warpgroup would
  be 64 registers per array per thread, spilling): pass 1 updates the moments chunk by chunk,
  writes the param / update and keeps the new m, v in shared memory with running row maxima and
  minima; pass 2 requantizes them with each row's k.
  """
  refs = list(refs)
  p_ref = refs.pop(0) if has_param else None
  (g_ref, mq_ref, ma_ref, mk_ref, vq_ref, va_ref, vk_ref,
   o_ref, mqo_ref, mao_ref, mko_ref, vqo_ref, vao_ref, vko_ref, *scratch) = refs
  m_new, v_new = (g_ref, *scratch) if m_in_grad else scratch
  lr, b1, omb1, b2, omb2, eps, wd, inv_sqrt_bc2, bc1 = [s_ref[i] for i in range(9)]
  em = common["expand_min"]
  m_mx, v_mx = plgpu.load(ma_ref, layout=_ROW), plgpu.load(va_ref, layout=_ROW)
  m_code = plgpu.load(mk_ref, layout=_ROW).astype(jnp.float32)
  v_code = plgpu.load(vk_ref, layout=_ROW).astype(jnp.float32)
  stats = None
  n = g_ref.shape[-1]
  for c in range(0, n, chunk):
    cols = (slice(None), pl.ds(c, chunk))
    m = _dequant(mq_ref.at[cols], m_mx, m_code, m_cfg["fmax"], em)
    v = _dequant(vq_ref.at[cols], v_mx, v_code, v_cfg["fmax"], em)
    g = plgpu.load(g_ref.at[cols], layout=_WGMMA).astype(jnp.float32)
    m = b1 * m + omb1 * g
    v = b2 * v + omb2 * (g * g)
    direction = m / ((jnp.sqrt(v) * inv_sqrt_bc2 + eps) * bc1)
    if p_ref is not None:
      p = plgpu.load(p_ref.at[cols], layout=_WGMMA).astype(jnp.float32)
      direction = direction + wd * p
    out = p - lr * direction if output == "param" else -(lr * direction)
    o_ref.at[cols][...] = out.astype(o_ref.dtype)
    m_new.at[cols][...] = m
    v_new.at[cols][...] = v
    new = _row_stats(m) + _row_stats(v)
    stats = new if stats is None else (
        jnp.maximum(stats[0], new[0]), jnp.minimum(stats[1], new[1]),
        jnp.maximum(stats[2], new[2]), jnp.minimum(stats[3], new[3]))
  m_mx, m_steps = _k_steps(stats[0], stats[1], **m_cfg, **common)
  v_mx, v_steps = _k_steps(stats[2], stats[3], **v_cfg, **common)
  for c in range(0, n, chunk):
    cols = (slice(None), pl.ds(c, chunk))
    m = plgpu.load(m_new.at[cols], layout=_WGMMA)
    mqo_ref.at[cols][...] = _requant(m, m_mx, m_steps, **m_cfg, **common).astype(mqo_ref.dtype)
    v = plgpu.load(v_new.at[cols], layout=_WGMMA)
    vqo_ref.at[cols][...] = _requant(v, v_mx, v_steps, **v_cfg, **common).astype(vqo_ref.dtype)
  mao_ref[...], vao_ref[...] = m_mx, v_mx
  mko_ref[...] = m_steps.astype(jnp.int32).astype(jnp.uint8)
  vko_ref[...] = v_steps.astype(jnp.int32).astype(jnp.uint8)


def step_scalars(lr, b1, b2, eps, weight_decay, count) -> jax.Array:
  """The step's scalars as the reference computes them (plus 1 / sqrt(bc2)): float32 (16,)."""
  t = jnp.asarray(count).astype(jnp.float32)
  bc1 = 1.0 - jnp.power(jnp.asarray(b1, jnp.float32), t)
  bc2 = 1.0 - jnp.power(jnp.asarray(b2, jnp.float32), t)
  # 1 - b1 as the reference writes it: in double precision for Python floats.
  return pad_scalars([lr, b1, 1.0 - b1, b2, 1.0 - b2, eps, weight_decay, 1.0 / jnp.sqrt(bc2),
                      bc1])


@functools.partial(jax.jit, static_argnames=(
    "m_fmax", "v_fmax", "m_log2_range", "v_log2_range", "group_size", "expand", "expand_min",
    "max_k_code", "amax_floor", "output", "interpret", "block", "chunk"))
def adam_step(param, grad, m_q, m_amax, m_code, v_q, v_amax, v_code, *, lr, b1, b2, eps,
              weight_decay, count, m_fmax: float, v_fmax: float, m_log2_range: float,
              v_log2_range: float, group_size: int, expand: bool, expand_min: int,
              max_k_code: int = 255, amax_floor: float = 1e-30, output: str = "param",
              interpret: bool = False, block: int = 64, chunk: int = 32):
  """One fused step over one parameter (plain arrays in, plain arrays out).

  Args:
    param: float (..., N), N % G == 0 (see `supported`); None only with output="update".
    grad: float, param's shape.
    m_q, v_q: FP8 moment codes (param's shape); m_amax, v_amax float32 and m_code, v_code uint8
      of shape (..., N / G): the compact expansion metadata.
    lr, b1, b2, eps, weight_decay: float scalars (may be traced); count: the step t >= 1.
    m_fmax, v_fmax: the formats' largest values; m_log2_range, v_log2_range: log2 of the
      expansion range R of each format; max_k_code, amax_floor: the stored form's limits.
    block: rows of G per pipeline step (multiple of 64; 64 keeps float32 blocks in shared memory).
    chunk: columns per register chunk (divides G, multiple of 8; see `_kernel`).
  Returns:
    (new param or update, m_q, m_amax, m_code, v_q, v_amax, v_code).
  """
  like, meta_shape = check_operands(
      "adam_step_mgpu", param, grad, m_q, m_amax, m_code, v_q, v_amax, v_code,
      group_size=group_size, output=output, problem=problem)
  if group_size % chunk or chunk % 8:
    raise ValueError(f"adam_step_mgpu: chunk {chunk} must divide G = {group_size} and be a "
                     f"multiple of 8")
  if block % ROW_QUANTUM:
    raise ValueError(f"adam_step_mgpu: block {block} is not a multiple of {ROW_QUANTUM}")
  rows = like.size // group_size
  r = max(d for d in range(ROW_QUANTUM, block + 1, ROW_QUANTUM) if rows % d == 0)
  big = ((r, group_size), lambda blk: (pl.ds(blk * r, r),))
  small = ((r,), lambda blk: (pl.ds(blk * r, r),))
  flat = lambda a: a.reshape(rows, group_size)
  meta = lambda a: a.reshape(rows)
  p_in = [] if param is None else [flat(param)]
  out_dtype = grad.dtype if output == "update" else param.dtype
  n_p = len(p_in)
  # Outputs written into input buffers: the new param into param's, the moment codes into theirs.
  in_place = {1: n_p + 1, 4: n_p + 4}
  if output == "param" and param.dtype == out_dtype:
    in_place[0] = 0
  kernel = functools.partial(
      _kernel, has_param=param is not None, output=output,
      m_cfg=dict(fmax=float(m_fmax), log2_range=float(np.float32(m_log2_range))),
      v_cfg=dict(fmax=float(v_fmax), log2_range=float(np.float32(v_log2_range))),
      common=dict(expand=expand, expand_min=expand_min, max_k=max_k_code,
                  floor=float(np.float32(amax_floor))),
      chunk=chunk, m_in_grad=grad.dtype == jnp.float32)
  outs = launch(
      kernel, scalars=[step_scalars(lr, b1, b2, eps, weight_decay, count)],
      inputs=p_in + [flat(grad), flat(m_q), meta(m_amax), meta(m_code), flat(v_q),
                     meta(v_amax), meta(v_code)],
      in_blocks=[big] * n_p + [big, big, small, small, big, small, small],
      out_shapes=[jax.ShapeDtypeStruct((rows, group_size), out_dtype),
                  jax.ShapeDtypeStruct((rows, group_size), m_q.dtype),
                  jax.ShapeDtypeStruct((rows,), jnp.float32),
                  jax.ShapeDtypeStruct((rows,), jnp.uint8),
                  jax.ShapeDtypeStruct((rows, group_size), v_q.dtype),
                  jax.ShapeDtypeStruct((rows,), jnp.float32),
                  jax.ShapeDtypeStruct((rows,), jnp.uint8)],
      out_blocks=[big, big, small, small, big, small, small], num_blocks=rows // r,
      interpret=interpret, out_in_place=in_place, name="coat_adam_step_mgpu",
      body_scratch=[plgpu.SMEM((r, group_size), jnp.float32)] * (
          1 if grad.dtype == jnp.float32 else 2))
  out, mq, ma, mk, vq, va, vk = outs
  return (out.reshape(like.shape), mq.reshape(like.shape), ma.reshape(meta_shape),
          mk.reshape(meta_shape), vq.reshape(like.shape), va.reshape(meta_shape),
          vk.reshape(meta_shape))
