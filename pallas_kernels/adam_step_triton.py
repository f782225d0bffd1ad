"""Fused COAT AdamW step as a Triton kernel called through jax-triton (GPU only).

The same step as pallas_kernels/adam_step_mgpu.py, whose docstring gives the math per group of G
elements (load, Adam, store), and as the reference, coat_jax.optim adam_step_reference.

Written with the official Triton language and called with `jax_triton.triton_call`, so it does
not use the deprecated Pallas Triton backend. Precise math: libdevice exp2 / log2 (as XLA), IEEE
sqrt (`sqrt_rn`), Triton's `/` (div.full.f32, what XLA:GPU emits).

Two layouts of the groups (`group_axis`), one per-tile body (`_adam_tile`):
  -1 (`adam_rows`): G consecutive elements of the last axis; a program takes BLOCK rows of G, the
     metadata (..., N / G) one value per row.
  -2 (`adam_cols`, COAT's layout for a Flax (in, out) kernel): G consecutive rows of each column
     of a (..., in, out) leaf, viewed as (R * G, out) with R = size / (G * out) row groups (in % G
     == 0, so no group straddles a stacked leaf's layers); a program takes a tile of G rows x
     BLOCK columns (coalesced along the rows, reduced over them) and the metadata (..., in / G,
     out) one value per column of a row group. No transposes: the moments stay in the param's
     layout.
The last program's rows / columns are masked (Triton's masked loads/stores).
Needs triton >= 3.6 and jax-triton 0.3.1 (`pip install .[gpu]`); jax-triton cannot run on CPU,
so `available()` says whether `adam_step` can be called. With triton alone, Triton's interpreter
(TRITON_INTERPRET=1) runs the kernel on host buffers (tests/test_kernels_adam_triton.py).
Imports jax, numpy and (optionally) triton only.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.adam_operands import OUTPUTS, check_operands

try:  # the kernels need triton only (they compile without a GPU); calling them needs jax-triton
  import triton
  import triton.language as tl
  from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - CPU machines
  triton = tl = libdevice = None
try:  # GPU machines only
  import jax_triton as jt
except ImportError:  # pragma: no cover - CPU machines
  jt = None

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def available() -> bool:
  """True when triton and jax-triton import (GPU machines)."""
  return triton is not None and jt is not None


GROUP_AXES = (-1, -2)
# Default tiles (read when adam_step is traced; benchmarks/bench_optimizer.py --cols-tiles sweeps
# the column ones, calling jax.clear_caches() between settings).
ROWS_BLOCK, ROWS_WARPS = 16, 4   # group_axis -1: rows of G per program, warps
COLS_BLOCK, COLS_WARPS = 32, 4   # group_axis -2: columns per G-row tile (32 FP8 bytes: one DRAM
                                 # sector per row), warps


def problem(shape, dtype, m_dtype, v_dtype, group_size: int, group_axis: int = -1) -> str | None:
  """Why the kernel cannot take a param of `shape` / `dtype` with these moments, or None."""
  if not jnp.issubdtype(dtype, jnp.floating):
    return f"param dtype {dtype} is not floating"
  if jnp.dtype(m_dtype) not in FP8_DTYPES or jnp.dtype(v_dtype) not in FP8_DTYPES:
    return f"moment dtypes {m_dtype} / {v_dtype} are not FP8 (int8 moments are not supported)"
  if group_size < 16 or group_size & (group_size - 1):
    return f"group size {group_size} must be a power of two >= 16"
  if group_axis not in GROUP_AXES:
    return f"group axis {group_axis} is not one of {GROUP_AXES}"
  name = "last" if group_axis == -1 else "second-to-last"
  if (len(shape) < -group_axis or shape[group_axis] % group_size
      or int(np.prod(shape)) == 0):
    return f"{name} axis of shape {tuple(shape)} is not a positive multiple of {group_size}"
  return None


def supported(shape, dtype, m_dtype, v_dtype, group_size: int, group_axis: int = -1) -> bool:
  return available() and problem(shape, dtype, m_dtype, v_dtype, group_size, group_axis) is None


if triton is not None:

  @triton.jit
  def _log2(x, FAST: tl.constexpr):
    """Per-element math: libdevice / IEEE (precise, as XLA) or FAST: one MUFU instruction
    (lg2 / ex2 / sqrt / rcp .approx.ftz, relative error ~2^-22, as the Pallas kernel's
    fast_math)."""
    if FAST:
      return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                       dtype=tl.float32, is_pure=True, pack=1)
    else:
      return libdevice.log2(x)

  @triton.jit
  def _exp2(x, FAST: tl.constexpr):
    if FAST:
      return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                       dtype=tl.float32, is_pure=True, pack=1)
    else:
      return libdevice.exp2(x)

  @triton.jit
  def _sqrt(x, FAST: tl.constexpr):
    if FAST:
      return tl.inline_asm_elementwise("sqrt.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                       dtype=tl.float32, is_pure=True, pack=1)
    else:
      return tl.sqrt_rn(x)

  @triton.jit
  def _div(x, y, FAST: tl.constexpr):
    if FAST:
      return x * tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [y],
                                           dtype=tl.float32, is_pure=True, pack=1)
    else:
      return x / y

  @triton.jit
  def _dequant(q_ptr, a_ptr, k_ptr, offs, meta_idx, mask, meta_mask, FMAX: tl.constexpr,
               EM: tl.constexpr, FAST: tl.constexpr = False, AXIS: tl.constexpr = 1):
    """A 2-D tile of a moment as float32; its groups run along tile axis AXIS (1: rows of G,
    0: columns of G), one metadata value per group at meta_idx (1-D, the other axis)."""
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    mx = tl.expand_dims(tl.load(a_ptr + meta_idx, mask=meta_mask, other=1.0), AXIS)
    code = tl.expand_dims(tl.load(k_ptr + meta_idx, mask=meta_mask, other=1).to(tl.float32), AXIS)
    qa = tl.abs(q)
    inv_fmax = 1.0 / FMAX
    powered = mx * _exp2((EM / code) * _log2(qa * inv_fmax, FAST), FAST)
    linear = qa * (mx * inv_fmax)
    mag = tl.where(code == EM, linear, powered)
    return tl.where(q < 0, -mag, mag)

  @triton.jit
  def _requant(x, q_ptr, a_ptr, k_ptr, offs, meta_idx, mask, meta_mask, FMAX: tl.constexpr,
               LOG2R: tl.constexpr, EXPAND: tl.constexpr, EM: tl.constexpr,
               MAX_K: tl.constexpr, FLOOR: tl.constexpr, NOEXP_K: tl.constexpr,
               FAST: tl.constexpr = False, AXIS: tl.constexpr = 1):
    """Stores tile x quantized per group along tile axis AXIS (as `_dequant`); a group lies
    wholly inside or outside the mask."""
    a = tl.abs(x)
    mx = tl.max(a, axis=AXIS) + FLOOR
    if EXPAND:
      mn_nz = tl.min(tl.where(a > 0, a, float("inf")), axis=AXIS)
      mn = tl.where(mn_nz == float("inf"), mx, mn_nz + FLOOR)
      lr = libdevice.log2(mx / mn)
      ok = lr > 0
      steps = tl.floor(LOG2R / tl.where(ok, lr, 1.0) * EM)
      steps = tl.where(ok, steps, EM)
      steps = tl.minimum(tl.maximum(steps, 1.0), MAX_K)
      k = tl.expand_dims(steps * (1.0 / EM), AXIS)
      mag = FMAX * _exp2(k * (_log2(a, FAST) - tl.expand_dims(libdevice.log2(mx), AXIS)), FAST)
      y = tl.where(x < 0, -mag, mag)
    else:
      steps = tl.zeros_like(mx) + NOEXP_K
      y = x / tl.expand_dims(mx * (1.0 / FMAX), AXIS)
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FMAX), FMAX))
    tl.store(q_ptr + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(a_ptr + meta_idx, mx, mask=meta_mask)
    tl.store(k_ptr + meta_idx, steps.to(tl.uint8), mask=meta_mask)

  @triton.jit
  def _adam_tile(offs, meta_idx, mask, meta_mask, wd, s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr,
                 mk_ptr, vq_ptr, va_ptr, vk_ptr, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr,
                 vao_ptr, vko_ptr, AXIS: tl.constexpr, HAS_PARAM: tl.constexpr,
                 OUT_PARAM: tl.constexpr, M_FMAX: tl.constexpr, V_FMAX: tl.constexpr,
                 M_LOG2R: tl.constexpr, V_LOG2R: tl.constexpr, EXPAND: tl.constexpr,
                 EM: tl.constexpr, MAX_K: tl.constexpr, FLOOR: tl.constexpr,
                 NOEXP_K: tl.constexpr, FAST: tl.constexpr, GCLAMP: tl.constexpr):
    """The step on one 2-D tile (element offsets `offs`, groups along tile axis AXIS with their
    metadata at `meta_idx`), weight decay `wd`. Gradients are multiplied by the gradient scale
    (scalar 9: fused global-norm clipping, 1 without) as they are loaded, then finite ones are
    clamped to +-GCLAMP (NaN and inf pass), as coat_jax.adam_math.adam_moments."""
    lr = tl.load(s_ptr + 0)
    b1 = tl.load(s_ptr + 1)
    omb1 = tl.load(s_ptr + 2)
    b2 = tl.load(s_ptr + 3)
    omb2 = tl.load(s_ptr + 4)
    eps = tl.load(s_ptr + 5)
    inv_sqrt_bc2 = tl.load(s_ptr + 7)
    bc1 = tl.load(s_ptr + 8)
    m = _dequant(mq_ptr, ma_ptr, mk_ptr, offs, meta_idx, mask, meta_mask, M_FMAX, EM, FAST, AXIS)
    v = _dequant(vq_ptr, va_ptr, vk_ptr, offs, meta_idx, mask, meta_mask, V_FMAX, EM, FAST, AXIS)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(s_ptr + 9)
    g = tl.where(tl.abs(g) < float("inf"), tl.minimum(tl.maximum(g, -GCLAMP), GCLAMP), g)
    m = b1 * m + omb1 * g
    v = b2 * v + omb2 * (g * g)
    direction = _div(m, (_sqrt(v, FAST) * inv_sqrt_bc2 + eps) * bc1, FAST)
    if HAS_PARAM:
      p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
      direction = direction + wd * p
      if OUT_PARAM:
        out = p - lr * direction
      else:
        out = -(lr * direction)
    else:
      out = -(lr * direction)
    tl.store(o_ptr + offs, out.to(o_ptr.dtype.element_ty), mask=mask)
    _requant(m, mqo_ptr, mao_ptr, mko_ptr, offs, meta_idx, mask, meta_mask, M_FMAX, M_LOG2R,
             EXPAND, EM, MAX_K, FLOOR, NOEXP_K, FAST, AXIS)
    _requant(v, vqo_ptr, vao_ptr, vko_ptr, offs, meta_idx, mask, meta_mask, V_FMAX, V_LOG2R,
             EXPAND, EM, MAX_K, FLOOR, NOEXP_K, FAST, AXIS)

  @triton.jit
  def adam_rows(blk, rows, wd, s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr, mk_ptr, vq_ptr, va_ptr,
                vk_ptr, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr, vao_ptr, vko_ptr,
                G: tl.constexpr, BLOCK: tl.constexpr,
                HAS_PARAM: tl.constexpr, OUT_PARAM: tl.constexpr, M_FMAX: tl.constexpr,
                V_FMAX: tl.constexpr, M_LOG2R: tl.constexpr, V_LOG2R: tl.constexpr,
                EXPAND: tl.constexpr, EM: tl.constexpr, MAX_K: tl.constexpr,
                FLOOR: tl.constexpr, NOEXP_K: tl.constexpr, FAST: tl.constexpr,
                GCLAMP: tl.constexpr):
    """The step on row block `blk` (BLOCK rows of G) of a leaf of `rows` rows, weight decay `wd`:
    the body of both the one-leaf kernel and adam_tree_triton's."""
    rows_idx = blk * BLOCK + tl.arange(0, BLOCK)
    rmask = rows_idx < rows
    offs = rows_idx[:, None].to(tl.int64) * G + tl.arange(0, G)[None, :]
    _adam_tile(offs, rows_idx, rmask[:, None], rmask, wd, s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr,
               mk_ptr, vq_ptr, va_ptr, vk_ptr, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr,
               vao_ptr, vko_ptr, 1, HAS_PARAM, OUT_PARAM, M_FMAX, V_FMAX, M_LOG2R, V_LOG2R,
               EXPAND, EM, MAX_K, FLOOR, NOEXP_K, FAST, GCLAMP)

  @triton.jit
  def adam_cols(blk, cols, wd, s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr, mk_ptr, vq_ptr, va_ptr,
                vk_ptr, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr, vao_ptr, vko_ptr,
                G: tl.constexpr, BLOCK: tl.constexpr,
                HAS_PARAM: tl.constexpr, OUT_PARAM: tl.constexpr, M_FMAX: tl.constexpr,
                V_FMAX: tl.constexpr, M_LOG2R: tl.constexpr, V_LOG2R: tl.constexpr,
                EXPAND: tl.constexpr, EM: tl.constexpr, MAX_K: tl.constexpr,
                FLOOR: tl.constexpr, NOEXP_K: tl.constexpr, FAST: tl.constexpr,
                GCLAMP: tl.constexpr):
    """The step on tile `blk` of a leaf viewed as (R * G, cols), grouped along its rows: row
    group blk // nc, columns (blk % nc) * BLOCK + [0, BLOCK) with nc = ceil(cols / BLOCK) (the
    column tiles of one row group are neighbouring programs: they share DRAM sectors)."""
    nc = tl.cdiv(cols, BLOCK)
    grp = blk // nc
    cols_idx = (blk % nc) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols_idx < cols
    row0 = grp.to(tl.int64) * G
    offs = (row0 + tl.arange(0, G))[:, None] * cols + cols_idx[None, :]
    meta_idx = grp.to(tl.int64) * cols + cols_idx
    _adam_tile(offs, meta_idx, cmask[None, :], cmask, wd, s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr,
               mk_ptr, vq_ptr, va_ptr, vk_ptr, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr,
               vao_ptr, vko_ptr, 0, HAS_PARAM, OUT_PARAM, M_FMAX, V_FMAX, M_LOG2R, V_LOG2R,
               EXPAND, EM, MAX_K, FLOOR, NOEXP_K, FAST, GCLAMP)

  @triton.jit
  def _adam_kernel(s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr, mk_ptr, vq_ptr, va_ptr, vk_ptr,
                   o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr, vao_ptr, vko_ptr,
                   ROWS: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
                   HAS_PARAM: tl.constexpr, OUT_PARAM: tl.constexpr,
                   M_FMAX: tl.constexpr, V_FMAX: tl.constexpr, M_LOG2R: tl.constexpr,
                   V_LOG2R: tl.constexpr, EXPAND: tl.constexpr, EM: tl.constexpr,
                   MAX_K: tl.constexpr, FLOOR: tl.constexpr, NOEXP_K: tl.constexpr,
                   FAST: tl.constexpr, GCLAMP: tl.constexpr):
    adam_rows(tl.program_id(0), ROWS, tl.load(s_ptr + 6), s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr,
              mk_ptr, vq_ptr, va_ptr, vk_ptr, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr,
              vao_ptr, vko_ptr, G, BLOCK, HAS_PARAM, OUT_PARAM, M_FMAX, V_FMAX, M_LOG2R,
              V_LOG2R, EXPAND, EM, MAX_K, FLOOR, NOEXP_K, FAST, GCLAMP)

  @triton.jit
  def _adam_cols_kernel(s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr, mk_ptr, vq_ptr, va_ptr, vk_ptr,
                        o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr, vao_ptr, vko_ptr,
                        COLS: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_PARAM: tl.constexpr, OUT_PARAM: tl.constexpr,
                        M_FMAX: tl.constexpr, V_FMAX: tl.constexpr, M_LOG2R: tl.constexpr,
                        V_LOG2R: tl.constexpr, EXPAND: tl.constexpr, EM: tl.constexpr,
                        MAX_K: tl.constexpr, FLOOR: tl.constexpr, NOEXP_K: tl.constexpr,
                        FAST: tl.constexpr, GCLAMP: tl.constexpr):
    adam_cols(tl.program_id(0), COLS, tl.load(s_ptr + 6), s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr,
              mk_ptr, vq_ptr, va_ptr, vk_ptr, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr,
              vao_ptr, vko_ptr, G, BLOCK, HAS_PARAM, OUT_PARAM, M_FMAX, V_FMAX, M_LOG2R,
              V_LOG2R, EXPAND, EM, MAX_K, FLOOR, NOEXP_K, FAST, GCLAMP)


def step_scalars(lr, b1, b2, eps, weight_decay, count, grad_scale=None) -> jax.Array:
  """The step's scalars as the reference computes them (plus 1 / sqrt(bc2)): float32 (16,).
  Slots: lr, b1, 1 - b1, b2, 1 - b2, eps, weight_decay, 1 / sqrt(bc2), bc1, grad_scale (1.0
  when None), then zeros."""
  t = jnp.asarray(count).astype(jnp.float32)
  bc1 = 1.0 - jnp.power(jnp.asarray(b1, jnp.float32), t)
  bc2 = 1.0 - jnp.power(jnp.asarray(b2, jnp.float32), t)
  scale = 1.0 if grad_scale is None else grad_scale
  vals = [lr, b1, 1.0 - b1, b2, 1.0 - b2, eps, weight_decay, 1.0 / jnp.sqrt(bc2), bc1, scale]
  vals = [jnp.asarray(x, jnp.float32).reshape(()) for x in vals]
  return jnp.stack(vals + [jnp.float32(0.0)] * (16 - len(vals)))


def kernel_constants(rows: int, group_size: int, block: int, *, has_param: bool, output: str,
                     m_fmax: float, v_fmax: float, m_log2_range: float, v_log2_range: float,
                     expand: bool, expand_min: int, max_k_code: int, amax_floor: float,
                     grad_clamp: float, fast_math: bool = False, cols: int | None = None) -> dict:
  """The kernel's constexpr arguments (also for running it in Triton's interpreter, tests):
  `_adam_kernel`'s (ROWS=rows of G), or with `cols` `_adam_cols_kernel`'s (COLS=cols)."""
  size = dict(ROWS=rows) if cols is None else dict(COLS=cols)
  return dict(
      **size, G=group_size, BLOCK=block, HAS_PARAM=has_param, OUT_PARAM=output == "param",
      M_FMAX=float(m_fmax), V_FMAX=float(v_fmax), M_LOG2R=float(np.float32(m_log2_range)),
      V_LOG2R=float(np.float32(v_log2_range)), EXPAND=bool(expand), EM=float(expand_min),
      MAX_K=float(max_k_code), FLOOR=float(np.float32(amax_floor)),
      NOEXP_K=float(min(expand_min, max_k_code)), FAST=bool(fast_math), GCLAMP=float(grad_clamp))


@functools.partial(jax.jit, static_argnames=(
    "m_fmax", "v_fmax", "m_log2_range", "v_log2_range", "group_size", "expand", "expand_min",
    "max_k_code", "amax_floor", "output", "block", "num_warps", "alias", "fast_math",
    "grad_clamp", "group_axis"))
def adam_step(param, grad, m_q, m_amax, m_code, v_q, v_amax, v_code, *, lr, b1, b2, eps,
              weight_decay, count, m_fmax: float, v_fmax: float, m_log2_range: float,
              v_log2_range: float, group_size: int, expand: bool, expand_min: int,
              max_k_code: int = 255, amax_floor: float = 1e-30, output: str = "param",
              block: int | None = None, num_warps: int | None = None, alias: bool = False,
              fast_math: bool = False, grad_clamp: float = 2.0**63, group_axis: int = -1,
              grad_scale=None):
  """One fused step over one parameter; arguments and results as adam_step_mgpu.adam_step.

  group_axis: -1 (groups of G along the last axis, metadata (..., N / G)) or -2 (G consecutive
  rows of each column of a (..., in, out) param, metadata (..., in / G, out): COAT's layout).
  block, num_warps: per program, rows of G (group_axis -1, default ROWS_BLOCK) or columns of a
  G-row tile (group_axis -2, default COLS_BLOCK), a power of two, and its warps (ROWS_WARPS /
  COLS_WARPS). alias: write the new param and moments
  into the old ones' buffers (pays off when the caller donates them); fast_math: MUFU
  approximations for the per-element log2 / exp2 / sqrt / division (see `_log2`); grad_clamp:
  finite gradients are clamped to +-grad_clamp first (default the reference's 2^63: g^2 stays
  finite; inf: none); grad_scale: None or a float32 scalar the kernel multiplies each gradient
  element by as it loads it (fused global-norm clipping: coat_jax.adam_math.clip_scale).
  """
  if not available():
    raise ValueError("adam_step_triton: triton / jax-triton are not installed (GPU only)")
  like, meta_shape = check_operands(
      "adam_step_triton", param, grad, m_q, m_amax, m_code, v_q, v_amax, v_code,
      group_size=group_size, output=output, problem=problem, group_axis=group_axis)
  if group_axis == -1:
    block = ROWS_BLOCK if block is None else block
    num_warps = ROWS_WARPS if num_warps is None else num_warps
    kernel, rows, cols = _adam_kernel, like.size // group_size, None
    grid = -(-rows // block)
  else:   # row groups of G x column tiles of BLOCK
    block = COLS_BLOCK if block is None else block
    num_warps = COLS_WARPS if num_warps is None else num_warps
    kernel, rows, cols = _adam_cols_kernel, like.size // group_size, like.shape[-1]
    grid = (like.size // (group_size * cols)) * -(-cols // block)
  out_dtype = grad.dtype if output == "update" else param.dtype
  p_arg = grad if param is None else param
  operands = [step_scalars(lr, b1, b2, eps, weight_decay, count, grad_scale), p_arg, grad, m_q,
              m_amax, m_code, v_q, v_amax, v_code]
  aliases = {}
  if alias:
    if output == "param":
      aliases[1] = 0
    aliases.update({3 + i: 1 + i for i in range(6)})
  outs = jt.triton_call(
      *operands, kernel=kernel,
      out_shape=[jax.ShapeDtypeStruct(like.shape, out_dtype),
                 jax.ShapeDtypeStruct(like.shape, m_q.dtype),
                 jax.ShapeDtypeStruct(meta_shape, jnp.float32),
                 jax.ShapeDtypeStruct(meta_shape, jnp.uint8),
                 jax.ShapeDtypeStruct(like.shape, v_q.dtype),
                 jax.ShapeDtypeStruct(meta_shape, jnp.float32),
                 jax.ShapeDtypeStruct(meta_shape, jnp.uint8)],
      grid=(grid,), input_output_aliases=aliases, num_warps=num_warps,
      num_stages=1, **kernel_constants(
          rows, group_size, block, has_param=param is not None, output=output, m_fmax=m_fmax,
          v_fmax=v_fmax, m_log2_range=m_log2_range, v_log2_range=v_log2_range, expand=expand,
          expand_min=expand_min, max_k_code=max_k_code, amax_floor=amax_floor,
          grad_clamp=grad_clamp, fast_math=fast_math, cols=cols))
  return tuple(outs)
