"""Fused COAT AdamW step as a Triton kernel called through jax-triton (GPU only).

Per group of G elements, the step of the reference (coat_jax.adam_math.adam_step_reference, with
coat_jax.expansion's compact form of the moments: codes q, group amax mx, k = k_code / expand_min):

  load:   x = sign(q) * mx * (|q| / fmax)^(1/k)      (exactly q * mx / fmax where k = 1)
  Adam:   g = clamp(g * grad_scale, +-grad_clamp) where finite (NaN and inf pass)
          m = b1 m + (1-b1) g,  v = b2 v + (1-b2) g^2,  denom = (sqrt(v) / sqrt(bc2) + eps) * bc1
          out = p - lr (m / denom + wd p)   (output="param")   or   -lr (m / denom + wd p)
  store:  mx = max|x| + floor,  mn = min non-zero |x| + floor (mx if none),
          k = clip(floor(log2(R) / log2(mx / mn) * expand_min), 1, max_k) / expand_min,
          q = cast(clamp(sign(x) * fmax * 2^(k * (log2|x| - log2 mx)), +-fmax))
with bc1 = 1 - b1^t, bc2 = 1 - b2^t and R the format's expansion range. Not bit-exact with the
reference: log2(|x| / mx) is log2|x| - log2(mx), 1/sqrt(bc2) multiplies instead of dividing and
fast_math uses the hardware's approximate log2 / exp2, so a few FP8 codes may move by one.

Written with the official Triton language and called with `jax_triton.triton_call`, so it does
not use the deprecated Pallas Triton backend. The per-element math and the per-tile body
(`adam_tile`, built from `new_moments`, `store_param`, `group_meta`, `quantize`) live in
pallas_kernels/adam/adam_tile_triton.py; this file holds the kernels and their launcher.

Two layouts of the groups (`group_axis`):
  -1 (`adam_rows`): G consecutive elements of the last axis; a program takes BLOCK rows of G, the
     metadata (..., N / G) one value per row.
  -2 (`adam_cols`, COAT's layout for a Flax (in, out) kernel): G consecutive rows of each column
     of a (..., in, out) leaf, viewed as (R * G, out) with R = size / (G * out) row groups (in % G
     == 0, so no group straddles a stacked leaf's layers); a program takes a tile of G rows x
     BLOCK columns (coalesced along the rows, reduced over them) and the metadata (..., in / G,
     out) one value per column of a row group. No transposes: the moments stay in the param's
     layout. COLS_CHUNK > 0: the tile is streamed in chunks of rows in two passes
     (`_adam_cols_chunked`: a [CHUNK, BLOCK] tile in registers, so wide tiles do not spill).
The leaf size is a runtime int argument (SIZE_ARG "runtime": one Triton compile serves every leaf
size), with a constexpr EVEN (rows / columns a multiple of BLOCK: no masks at all; else the last
program's rows / columns are masked) and, for columns, the row stride's power-of-two factor as a
constexpr CDIV (aligned, vectorized loads); `launch_plan` picks them.
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

from pallas_kernels.compile_ahead import call_triton
from pallas_kernels.adam.adam_operands import OUTPUTS, check_operands, check_packed_operands

try:  # the kernels need triton only (they compile without a GPU); calling them needs jax-triton
  import triton
  import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines
  triton = tl = None
if triton is not None:
  from pallas_kernels.adam.adam_tile_triton import (adam_tile, group_meta, load_meta, load_scalars,
                                               new_moments, nonzero_or_inf, quantize, store_meta,
                                               store_param)
try:  # GPU machines only
  import jax_triton as jt
except ImportError:  # pragma: no cover - CPU machines
  jt = None

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def available() -> bool:
  """True when triton and jax-triton import (GPU machines)."""
  return triton is not None and jt is not None


GROUP_AXES = (-1, -2)
# Default tiles (read when adam_step is traced; benchmarks/step/bench_optimizer.py --cols-tiles
# sweeps the column ones, calling jax.clear_caches() between settings).
ROWS_BLOCK, ROWS_WARPS = 16, 4   # group_axis -1: rows of G per program, warps
COLS_BLOCK, COLS_WARPS = 32, 8   # group_axis -2: columns per G-row tile (32 FP8 bytes: one DRAM
                                 # sector per row), warps
COLS_CHUNK = 16                  # group_axis -2: 0, the G x BLOCK tile at once; else rows per
                                 # chunk of the streamed two-pass tile (`_adam_cols_chunked`).
# H100, 1.21e9 params (docs/benchmarks.md, ninth session): 32 x 16 x 8 streamed 10.22-10.24 ms,
# 32 x 16 x 4 12.56-12.59 ms, every other tile tried 12.9-24.8 ms (sixth and ninth sessions);
# the row kernel 6.71 ms.
# How the leaf size reaches the kernel (read when adam_step is traced; benchmarks A/B them):
#   "runtime": an int argument, one Triton compile for every leaf size; EVEN tiles (rows / cols
#     a multiple of BLOCK) build no masks;
#   "runtime_masked": an int argument, always masked (the version 7% slower on the H100);
#   "constexpr": ROWS / COLS constexpr, always masked: one compile per leaf size (the old kernel).
SIZE_ARGS = ("runtime", "runtime_masked", "constexpr")
SIZE_ARG = "runtime"


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
  if group_axis == -2 and group_size * shape[-1] >= 2**31:   # int32 offsets in a row group
    return f"{shape[-1]} columns x group size {group_size} is not below 2^31"
  return None


def supported(shape, dtype, m_dtype, v_dtype, group_size: int, group_axis: int = -1) -> bool:
  return available() and problem(shape, dtype, m_dtype, v_dtype, group_size, group_axis) is None


if triton is not None:

  @triton.jit
  def adam_rows(blk, rows, wd, s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr, mk_ptr, vq_ptr, va_ptr,
                vk_ptr, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr, vao_ptr, vko_ptr,
                G: tl.constexpr, BLOCK: tl.constexpr,
                HAS_PARAM: tl.constexpr, OUT_PARAM: tl.constexpr, M_FMAX: tl.constexpr,
                V_FMAX: tl.constexpr, M_LOG2R: tl.constexpr, V_LOG2R: tl.constexpr,
                EXPAND: tl.constexpr, EM: tl.constexpr, MAX_K: tl.constexpr,
                FLOOR: tl.constexpr, NOEXP_K: tl.constexpr, FAST: tl.constexpr,
                GCLAMP: tl.constexpr, EVEN: tl.constexpr = False):
    """The step on row block `blk` (BLOCK rows of G) of a leaf of `rows` rows, weight decay `wd`:
    the body of the one-leaf kernels. EVEN: rows % BLOCK == 0 (no
    masks; `rows` unused)."""
    rows_idx = blk * BLOCK + tl.arange(0, BLOCK)
    offs = rows_idx[:, None].to(tl.int64) * G + tl.arange(0, G)[None, :]
    if EVEN:
      mask = None
      meta_mask = None
    else:
      meta_mask = rows_idx < rows
      mask = meta_mask[:, None]
    adam_tile(offs, rows_idx, mask, meta_mask, wd, s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr,
               mk_ptr, vq_ptr, va_ptr, vk_ptr, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr,
               vao_ptr, vko_ptr, 1, HAS_PARAM, OUT_PARAM, M_FMAX, V_FMAX, M_LOG2R, V_LOG2R,
               EXPAND, EM, MAX_K, FLOOR, NOEXP_K, FAST, GCLAMP)

  @triton.jit
  def _adam_cols_chunked(cols, cols_idx, meta_idx, cmask, wd, s_ptr, p_ptr, g_ptr,
                         mq_ptr, ma_ptr, mk_ptr, vq_ptr, va_ptr, vk_ptr, o_ptr, mqo_ptr,
                         mao_ptr, mko_ptr, vqo_ptr, vao_ptr, vko_ptr, G: tl.constexpr,
                         BLOCK: tl.constexpr, CHUNK: tl.constexpr, HAS_PARAM: tl.constexpr,
                         OUT_PARAM: tl.constexpr, M_FMAX: tl.constexpr, V_FMAX: tl.constexpr,
                         M_LOG2R: tl.constexpr, V_LOG2R: tl.constexpr, EXPAND: tl.constexpr,
                         EM: tl.constexpr, MAX_K: tl.constexpr, FLOOR: tl.constexpr,
                         NOEXP_K: tl.constexpr, FAST: tl.constexpr, GCLAMP: tl.constexpr):
    """The step on the G-row x BLOCK-column tile at columns cols_idx (column mask cmask, None:
    none) of the G x cols row group the element pointers start at, streamed in G / CHUNK chunks
    of CHUNK rows (a [CHUNK, BLOCK] tile in registers instead of [G, BLOCK]), in two passes:
      1. per chunk the new m, v (`new_moments`); elementwise running max |x| and min nonzero
         |x| in [CHUNK, BLOCK] accumulators (the first chunk starts them), reduced over the rows
         once after the loop: each column's max / min over its G rows, its new metadata
         (`group_meta`);
      2. per chunk the new m, v again (the same loads, mostly L2 hits), the param written
         (`store_param`) and the codes with the column's new metadata (`quantize`).
    Same per-element math as `adam_tile`; max / min are order-free, so the metadata equals
    the one-tile kernel's."""
    lr, b1, omb1, b2, omb2, eps, inv_sqrt_bc2, bc1, gscale = load_scalars(s_ptr)
    m_mx, m_code = load_meta(ma_ptr, mk_ptr, meta_idx, cmask, 0)
    v_mx, v_code = load_meta(va_ptr, vk_ptr, meta_idx, cmask, 0)
    if cmask is None:
      mask = None
    else:
      mask = cmask[None, :]
    chunk_rows = tl.arange(0, CHUNK)[:, None]
    offs = chunk_rows * cols + cols_idx[None, :]
    m, v = new_moments(offs, mask, g_ptr, mq_ptr, vq_ptr, m_mx, m_code, v_mx, v_code, gscale,
                        b1, omb1, b2, omb2, M_FMAX, V_FMAX, EM, FAST, GCLAMP)
    m_max = tl.abs(m)
    v_max = tl.abs(v)
    m_min = nonzero_or_inf(m_max)
    v_min = nonzero_or_inf(v_max)
    for c in range(1, G // CHUNK):
      offs = (chunk_rows + c * CHUNK) * cols + cols_idx[None, :]
      m, v = new_moments(offs, mask, g_ptr, mq_ptr, vq_ptr, m_mx, m_code, v_mx, v_code,
                          gscale, b1, omb1, b2, omb2, M_FMAX, V_FMAX, EM, FAST, GCLAMP)
      m_max = tl.maximum(m_max, tl.abs(m))
      v_max = tl.maximum(v_max, tl.abs(v))
      m_min = tl.minimum(m_min, nonzero_or_inf(tl.abs(m)))
      v_min = tl.minimum(v_min, nonzero_or_inf(tl.abs(v)))
    m_new_mx, m_steps = group_meta(tl.max(m_max, axis=0), tl.min(m_min, axis=0), M_LOG2R,
                                    EXPAND, EM, MAX_K, FLOOR, NOEXP_K)
    v_new_mx, v_steps = group_meta(tl.max(v_max, axis=0), tl.min(v_min, axis=0), V_LOG2R,
                                    EXPAND, EM, MAX_K, FLOOR, NOEXP_K)
    m_mx_t, m_steps_t = tl.expand_dims(m_new_mx, 0), tl.expand_dims(m_steps, 0)
    v_mx_t, v_steps_t = tl.expand_dims(v_new_mx, 0), tl.expand_dims(v_steps, 0)
    for c in range(0, G // CHUNK):
      offs = (chunk_rows + c * CHUNK) * cols + cols_idx[None, :]
      m, v = new_moments(offs, mask, g_ptr, mq_ptr, vq_ptr, m_mx, m_code, v_mx, v_code,
                          gscale, b1, omb1, b2, omb2, M_FMAX, V_FMAX, EM, FAST, GCLAMP)
      store_param(m, v, offs, mask, p_ptr, o_ptr, lr, wd, eps, inv_sqrt_bc2, bc1, HAS_PARAM,
                   OUT_PARAM, FAST)
      m_codes = quantize(m, m_mx_t, m_steps_t, M_FMAX, EXPAND, EM, FAST)
      v_codes = quantize(v, v_mx_t, v_steps_t, V_FMAX, EXPAND, EM, FAST)
      tl.store(mqo_ptr + offs, m_codes.to(mqo_ptr.dtype.element_ty), mask=mask)
      tl.store(vqo_ptr + offs, v_codes.to(vqo_ptr.dtype.element_ty), mask=mask)
    store_meta(m_new_mx, m_steps, mao_ptr, mko_ptr, meta_idx, cmask)
    store_meta(v_new_mx, v_steps, vao_ptr, vko_ptr, meta_idx, cmask)

  @triton.jit
  def adam_cols(blk, cols, wd, s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr, mk_ptr, vq_ptr, va_ptr,
                vk_ptr, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr, vao_ptr, vko_ptr,
                G: tl.constexpr, BLOCK: tl.constexpr,
                HAS_PARAM: tl.constexpr, OUT_PARAM: tl.constexpr, M_FMAX: tl.constexpr,
                V_FMAX: tl.constexpr, M_LOG2R: tl.constexpr, V_LOG2R: tl.constexpr,
                EXPAND: tl.constexpr, EM: tl.constexpr, MAX_K: tl.constexpr,
                FLOOR: tl.constexpr, NOEXP_K: tl.constexpr, FAST: tl.constexpr,
                GCLAMP: tl.constexpr, EVEN: tl.constexpr = False, CHUNK: tl.constexpr = 0,
                meta0=0, data0=0):
    """The step on tile `blk` of a leaf viewed as (R * G, cols), grouped along its rows: row
    group blk // nc, columns (blk % nc) * BLOCK + [0, BLOCK) with nc = ceil(cols / BLOCK) (the
    column tiles of one row group are neighbouring programs: they share DRAM sectors). EVEN:
    cols % BLOCK == 0 (no masks). CHUNK: 0, the whole G x BLOCK tile at once (`adam_tile`),
    else streamed in chunks of CHUNK rows (`_adam_cols_chunked`). meta0, data0: the leaf's
    slot in packed moments (first metadata group, first code; 0 otherwise), added to the
    metadata index and to the row group's start rather than moving more pointers (sm_90,
    default tile: 48 registers per thread either way; moving the 12 moment pointers took 56
    and ran 10 % slower on the H100)."""
    nc = tl.cdiv(cols, BLOCK)
    grp = blk // nc
    cols_idx = (blk % nc) * BLOCK + tl.arange(0, BLOCK)
    meta_idx = grp.to(tl.int64) * cols + cols_idx + meta0
    # the row group's G x cols elements: pointers moved to its first (int64), int32 offsets
    # inside it (G * cols < 2^31; fewer registers than int64 offsets per element)
    start = grp.to(tl.int64) * (G * cols)
    p_ptr, g_ptr, o_ptr = p_ptr + start, g_ptr + start, o_ptr + start
    mq_ptr, vq_ptr = mq_ptr + (start + data0), vq_ptr + (start + data0)
    mqo_ptr, vqo_ptr = mqo_ptr + (start + data0), vqo_ptr + (start + data0)
    if EVEN:
      cmask = None
      mask = None
    else:
      cmask = cols_idx < cols
      mask = cmask[None, :]
    if CHUNK == 0:
      offs = tl.arange(0, G)[:, None] * cols + cols_idx[None, :]
      adam_tile(offs, meta_idx, mask, cmask, wd, s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr,
                 mk_ptr, vq_ptr, va_ptr, vk_ptr, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr,
                 vao_ptr, vko_ptr, 0, HAS_PARAM, OUT_PARAM, M_FMAX, V_FMAX, M_LOG2R, V_LOG2R,
                 EXPAND, EM, MAX_K, FLOOR, NOEXP_K, FAST, GCLAMP)
    else:
      _adam_cols_chunked(cols, cols_idx, meta_idx, cmask, wd, s_ptr, p_ptr, g_ptr,
                         mq_ptr, ma_ptr, mk_ptr, vq_ptr, va_ptr, vk_ptr, o_ptr, mqo_ptr,
                         mao_ptr, mko_ptr, vqo_ptr, vao_ptr, vko_ptr, G, BLOCK, CHUNK,
                         HAS_PARAM, OUT_PARAM, M_FMAX, V_FMAX, M_LOG2R, V_LOG2R, EXPAND, EM,
                         MAX_K, FLOOR, NOEXP_K, FAST, GCLAMP)

  @triton.jit
  def _slot_start(seg_arg, SEG: tl.constexpr, G: tl.constexpr):
    """The leaf's slot in packed buffers (coat_jax.packed_state): (first metadata group
    seg_arg * SEG, first code that * G), int64; the constexpr factors keep the alignment Triton
    vectorizes with. tl.cast: jax-triton passes a scalar equal to 1 as a constant (a Python
    int). Called with SEG > 0 only."""
    meta = tl.cast(seg_arg, tl.int64) * SEG
    return meta, meta * G

  @triton.jit
  def _segment(seg_arg, mq_ptr, ma_ptr, mk_ptr, vq_ptr, va_ptr, vk_ptr, mqo_ptr, mao_ptr,
               mko_ptr, vqo_ptr, vao_ptr, vko_ptr, SEG: tl.constexpr, G: tl.constexpr):
    """The row kernel's moment pointers moved to the leaf's slot (`_slot_start`; the column
    kernel adds the slot to its indices instead, `adam_cols`). SEG 0: unmoved. Packed moments
    are always written in place (adam_step aliases them), so the outputs take the moved input
    pointers: 6 moved pointers, not 12 (sm_90 row kernel: 79 registers per thread, as 80
    unmoved; moving all 12 took 95 and ran 2.5 % slower on the H100)."""
    if SEG > 0:
      meta, data = _slot_start(seg_arg, SEG, G)
      mq_ptr, vq_ptr = mq_ptr + data, vq_ptr + data
      ma_ptr, mk_ptr, va_ptr, vk_ptr = ma_ptr + meta, mk_ptr + meta, va_ptr + meta, vk_ptr + meta
      mqo_ptr, mao_ptr, mko_ptr, vqo_ptr, vao_ptr, vko_ptr = (mq_ptr, ma_ptr, mk_ptr, vq_ptr,
                                                              va_ptr, vk_ptr)
    return (mq_ptr, ma_ptr, mk_ptr, vq_ptr, va_ptr, vk_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr,
            vao_ptr, vko_ptr)

  @triton.jit
  def _adam_kernel(s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr, mk_ptr, vq_ptr, va_ptr, vk_ptr,
                   rows_arg, seg_arg, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr, vao_ptr, vko_ptr,
                   ROWS: tl.constexpr, EVEN: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
                   HAS_PARAM: tl.constexpr, OUT_PARAM: tl.constexpr,
                   M_FMAX: tl.constexpr, V_FMAX: tl.constexpr, M_LOG2R: tl.constexpr,
                   V_LOG2R: tl.constexpr, EXPAND: tl.constexpr, EM: tl.constexpr,
                   MAX_K: tl.constexpr, FLOOR: tl.constexpr, NOEXP_K: tl.constexpr,
                   FAST: tl.constexpr, GCLAMP: tl.constexpr, SEG: tl.constexpr = 0):
    """Groups along the last axis: the leaf's rows of G are rows_arg (runtime: one compile for
    every leaf size), or ROWS where ROWS > 0 (constexpr: one compile per leaf size). SEG > 0:
    the moments are packed buffers, the leaf's slot at seg_arg (`_segment`)."""
    if ROWS > 0:
      rows = ROWS
    else:
      rows = rows_arg
    (mq_ptr, ma_ptr, mk_ptr, vq_ptr, va_ptr, vk_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr, vao_ptr,
     vko_ptr) = _segment(seg_arg, mq_ptr, ma_ptr, mk_ptr, vq_ptr, va_ptr, vk_ptr, mqo_ptr,
                         mao_ptr, mko_ptr, vqo_ptr, vao_ptr, vko_ptr, SEG, G)
    adam_rows(tl.program_id(0), rows, tl.load(s_ptr + 6), s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr,
              mk_ptr, vq_ptr, va_ptr, vk_ptr, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr,
              vao_ptr, vko_ptr, G, BLOCK, HAS_PARAM, OUT_PARAM, M_FMAX, V_FMAX, M_LOG2R,
              V_LOG2R, EXPAND, EM, MAX_K, FLOOR, NOEXP_K, FAST, GCLAMP, EVEN)

  @triton.jit
  def _adam_cols_kernel(s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr, mk_ptr, vq_ptr, va_ptr, vk_ptr,
                        cols_arg, seg_arg, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr, vao_ptr,
                        vko_ptr,
                        COLS: tl.constexpr, CDIV: tl.constexpr, EVEN: tl.constexpr,
                        CHUNK: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_PARAM: tl.constexpr, OUT_PARAM: tl.constexpr,
                        M_FMAX: tl.constexpr, V_FMAX: tl.constexpr, M_LOG2R: tl.constexpr,
                        V_LOG2R: tl.constexpr, EXPAND: tl.constexpr, EM: tl.constexpr,
                        MAX_K: tl.constexpr, FLOOR: tl.constexpr, NOEXP_K: tl.constexpr,
                        FAST: tl.constexpr, GCLAMP: tl.constexpr, SEG: tl.constexpr = 0):
    """Groups along axis -2: the leaf's column count is cols_arg * CDIV (runtime; CDIV, a
    constexpr power of two dividing it, tells Triton the row stride's alignment, which jax-triton
    does not specialize for scalars: vectorized loads), or COLS where COLS > 0 (constexpr). SEG
    > 0: packed moments, the leaf's slot at metadata group seg_arg * SEG (as `_adam_kernel`)."""
    if COLS > 0:
      cols = COLS
    else:
      cols = cols_arg * CDIV
    if SEG > 0:
      meta0, data0 = _slot_start(seg_arg, SEG, G)
    else:
      meta0 = 0
      data0 = 0
    adam_cols(tl.program_id(0), cols, tl.load(s_ptr + 6), s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr,
              mk_ptr, vq_ptr, va_ptr, vk_ptr, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr,
              vao_ptr, vko_ptr, G, BLOCK, HAS_PARAM, OUT_PARAM, M_FMAX, V_FMAX, M_LOG2R,
              V_LOG2R, EXPAND, EM, MAX_K, FLOOR, NOEXP_K, FAST, GCLAMP, EVEN, CHUNK, meta0, data0)

else:  # pragma: no cover - CPU machines: launch_plan still plans (tests)
  _adam_kernel = _adam_cols_kernel = None


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


def parse_cols_tiles(text: str) -> list[tuple[int, int, int]]:
  """Column tiles for benchmarks' sweeps: 'BLOCKxWARPS' (the G x BLOCK tile at once) or
  'BLOCKxCHUNKxWARPS' (streamed in chunks of CHUNK rows), comma-separated -> [(COLS_BLOCK,
  COLS_CHUNK, COLS_WARPS), ...]."""
  tiles = []
  for t in filter(None, (s.strip() for s in text.split(","))):
    try:
      v = [int(x) for x in t.split("x")]
    except ValueError:
      v = []
    if len(v) not in (2, 3) or min(v) <= 0 or any(x & (x - 1) for x in v):
      raise ValueError(f"column tile {t!r} is not BLOCKxWARPS or BLOCKxCHUNKxWARPS (powers of "
                       f"two)")
    tiles.append((v[0], 0, v[1]) if len(v) == 2 else tuple(v))
  return tiles


def pow2_divisor(n: int, cap: int = 16) -> int:
  """The largest power of two <= cap dividing n."""
  d = 1
  while d < cap and n % (2 * d) == 0:
    d *= 2
  return d


def launch_plan(shape, group_size: int, group_axis: int = -1, block: int | None = None,
                chunk: int | None = None, size_arg: str | None = None) -> tuple:
  """How `adam_step` launches on a leaf of `shape`: (kernel, grid size, size operand, size
  constexprs). The size operand (an int argument before the outputs) is the leaf's rows of G
  (`_adam_kernel`) or its column count / CDIV (`_adam_cols_kernel`); the constexprs are ROWS /
  COLS (0 unless size_arg is "constexpr"), EVEN, and for columns CDIV (pow2_divisor(cols)) and
  CHUNK. block, chunk, size_arg: None reads ROWS_BLOCK / COLS_BLOCK, COLS_CHUNK, SIZE_ARG."""
  size_arg = SIZE_ARG if size_arg is None else size_arg
  if size_arg not in SIZE_ARGS:
    raise ValueError(f"adam_step_triton: size_arg must be one of {SIZE_ARGS}, got {size_arg!r}")
  size = int(np.prod(shape))
  if group_axis == -1:
    block = ROWS_BLOCK if block is None else block
    rows = size // group_size
    consts = dict(ROWS=rows if size_arg == "constexpr" else 0,
                  EVEN=size_arg == "runtime" and rows % block == 0)
    return _adam_kernel, -(-rows // block), rows, consts
  block = COLS_BLOCK if block is None else block
  chunk = COLS_CHUNK if chunk is None else chunk
  if chunk < 0 or chunk & (chunk - 1) or chunk > group_size:
    raise ValueError(f"adam_step_triton: cols_chunk {chunk} must be 0 or a power of two <= the "
                     f"group size {group_size}")
  cols = shape[-1]
  cdiv = pow2_divisor(cols)
  consts = dict(COLS=cols if size_arg == "constexpr" else 0, CDIV=cdiv,
                EVEN=size_arg == "runtime" and cols % block == 0, CHUNK=chunk)
  return _adam_cols_kernel, (size // (group_size * cols)) * -(-cols // block), cols // cdiv, consts


def kernel_constants(group_size: int, block: int, *, has_param: bool, output: str,
                     m_fmax: float, v_fmax: float, m_log2_range: float, v_log2_range: float,
                     expand: bool, expand_min: int, max_k_code: int, amax_floor: float,
                     grad_clamp: float, fast_math: bool = False) -> dict:
  """The kernels' constexpr arguments but the size ones (`launch_plan`'s); also for running a
  kernel in Triton's interpreter (tests)."""
  return dict(
      G=group_size, BLOCK=block, HAS_PARAM=has_param, OUT_PARAM=output == "param",
      M_FMAX=float(m_fmax), V_FMAX=float(v_fmax), M_LOG2R=float(np.float32(m_log2_range)),
      V_LOG2R=float(np.float32(v_log2_range)), EXPAND=bool(expand), EM=float(expand_min),
      MAX_K=float(max_k_code), FLOOR=float(np.float32(amax_floor)),
      NOEXP_K=float(min(expand_min, max_k_code)), FAST=bool(fast_math), GCLAMP=float(grad_clamp))


@functools.partial(jax.jit, static_argnames=(
    "m_fmax", "v_fmax", "m_log2_range", "v_log2_range", "group_size", "expand", "expand_min",
    "max_k_code", "amax_floor", "output", "block", "num_warps", "alias", "fast_math",
    "grad_clamp", "group_axis", "cols_chunk", "packed_at", "segment"))
def adam_step(param, grad, m_q, m_amax, m_code, v_q, v_amax, v_code, *, lr, b1, b2, eps,
              weight_decay, count, m_fmax: float, v_fmax: float, m_log2_range: float,
              v_log2_range: float, group_size: int, expand: bool, expand_min: int,
              max_k_code: int = 255, amax_floor: float = 1e-30, output: str = "param",
              block: int | None = None, num_warps: int | None = None, alias: bool = False,
              fast_math: bool = False, grad_clamp: float = 2.0**63, group_axis: int = -1,
              grad_scale=None, cols_chunk: int | None = None, packed_at: int | None = None,
              segment: int = 16):
  """One fused step over one parameter (plain arrays in, plain arrays out; the math: the module
  docstring).

  param: float (..., N); None only with output="update" (no decay term). grad: param's shape.
  m_q, v_q: FP8 moment codes (param's shape); m_amax, v_amax float32 and m_code, v_code uint8 of
  the metadata shape: the compact expansion form. lr, b1, b2, eps, weight_decay: float scalars
  (may be traced); count: the step t >= 1. m_fmax, v_fmax: the formats' largest values;
  m_log2_range, v_log2_range: log2 of each format's expansion range R; max_k_code, amax_floor:
  the stored form's limits. Returns (new param or update, m_q, m_amax, m_code, v_q, v_amax,
  v_code).
  group_axis: -1 (groups of G along the last axis, metadata (..., N / G)) or -2 (G consecutive
  rows of each column of a (..., in, out) param, metadata (..., in / G, out): COAT's layout).
  block, num_warps: per program, rows of G (group_axis -1, default ROWS_BLOCK) or columns of a
  G-row tile (group_axis -2, default COLS_BLOCK), a power of two, and its warps (ROWS_WARPS /
  COLS_WARPS); cols_chunk (group_axis -2): 0, the G x BLOCK tile at once, or the rows per chunk
  of the streamed two-pass tile (default COLS_CHUNK; `launch_plan`; the leaf size reaches the
  kernel as SIZE_ARG says). alias: write the new param and moments into the old ones' buffers
  (pays off when the caller donates them); fast_math: MUFU approximations for the per-element
  log2 / exp2 / sqrt / division (adam_tile_triton's `_approx`); grad_clamp: finite gradients
  are clamped to +-grad_clamp first (default the reference's 2^63: g^2 stays finite; inf: none);
  grad_scale: None or a float32 scalar the kernel multiplies each gradient element by as it
  loads it (fused global-norm clipping: coat_jax.adam_math.clip_scale).
  packed_at: None, or the moments are packed buffers (coat_jax.packed_state: 1-D codes, amax and
  k codes of many leaves) and this leaf's slot starts at metadata group packed_at (a multiple of
  `segment`) and code packed_at * G; the kernel writes the slot only and returns the whole
  buffers (always aliased to the inputs: the rest of each buffer is kept).
  """
  if not available():
    raise ValueError("adam_step_triton: triton / jax-triton are not installed (GPU only)")
  if packed_at is None:
    like, _ = check_operands(
        "adam_step_triton", param, grad, m_q, m_amax, m_code, v_q, v_amax, v_code,
        group_size=group_size, output=output, problem=problem, group_axis=group_axis)
    seg_arg, seg = 0, 0
  else:
    like = check_packed_operands("adam_step_triton", param, grad, (m_q, m_amax, m_code),
                                 (v_q, v_amax, v_code), packed_at, segment, group_size, output,
                                 group_axis, problem)
    seg_arg, seg = packed_at // segment, segment
    alias = True
  if group_axis == -1:
    block = ROWS_BLOCK if block is None else block
    num_warps = ROWS_WARPS if num_warps is None else num_warps
  else:   # row groups of G x column tiles of BLOCK
    block = COLS_BLOCK if block is None else block
    num_warps = COLS_WARPS if num_warps is None else num_warps
  kernel, grid, size_operand, size_consts = launch_plan(like.shape, group_size, group_axis,
                                                        block, cols_chunk)
  out_dtype = grad.dtype if output == "update" else param.dtype
  p_arg = grad if param is None else param
  operands = [step_scalars(lr, b1, b2, eps, weight_decay, count, grad_scale), p_arg, grad, m_q,
              m_amax, m_code, v_q, v_amax, v_code, size_operand, seg_arg]
  aliases = {}
  if alias:
    if output == "param":
      aliases[1] = 0
    aliases.update({3 + i: 1 + i for i in range(6)})
  outs = call_triton.triton_call(
      *operands, kernel=kernel,
      out_shape=[jax.ShapeDtypeStruct(like.shape, out_dtype)] + [
          jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (m_q, m_amax, m_code, v_q, v_amax,
                                                           v_code)],
      grid=(grid,), input_output_aliases=aliases, num_warps=num_warps,
      num_stages=1, SEG=seg, **size_consts, **kernel_constants(
          group_size, block, has_param=param is not None, output=output, m_fmax=m_fmax,
          v_fmax=v_fmax, m_log2_range=m_log2_range, v_log2_range=v_log2_range, expand=expand,
          expand_min=expand_min, max_k_code=max_k_code, amax_floor=amax_floor,
          grad_clamp=grad_clamp, fast_math=fast_math))
  return tuple(outs)
