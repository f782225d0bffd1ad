"""Fused COAT AdamW step as a Triton kernel called through jax-triton (GPU only).

The step of coat_jax.adam_math's reference (`adam_step_reference`) on one parameter, in one pass
over memory: per element read the param, gradient and FP8 codes, write the param (or update)
and codes; per group of G read and write the metadata (amax, k code).

Written with the official Triton language and called with `jax_triton.triton_call`, so it does
not use the deprecated Pallas Triton backend. The per-element math and the per-tile body
(`adam_tile`) live in pallas_kernels/adam/adam_tile_triton.py; this file holds the kernels and their
launcher.

Two layouts of the groups (`group_axis`):
  -1 (`adam_rows`): G consecutive elements of the last axis; a program takes BLOCK rows of G, the
     metadata (..., N / G) one value per row.
  -2 (`adam_cols`, COAT's layout for a Flax (in, out) kernel): G consecutive rows of each column
     of a (..., in, out) leaf, viewed as (R * G, out) with R = size / (G * out) row groups (in % G
     == 0, so no group straddles a stacked leaf's layers); a program takes a whole G-row x
     BLOCK-column tile (contiguous along the columns, each column's G rows reduced in the tile)
     and the metadata (..., in / G, out) one value per column of a row group. No transposes:
     the moments stay in the param's layout.
The leaf size is a runtime int argument (SIZE_ARG "runtime": one Triton compile serves every leaf
size), with a constexpr EVEN (rows / columns a multiple of BLOCK: no masks at all; else the last
program's rows / columns are masked) and, for columns, the row stride's power-of-two factor as a
constexpr CDIV (aligned, vectorized loads); `launch_plan` picks them.
Needs triton >= 3.6 and jax-triton 0.3.1 (`pip install .[gpu]`); jax-triton cannot run on CPU,
so `available()` says whether `adam_step` can be called. With triton alone, Triton's interpreter
(TRITON_INTERPRET=1) runs the kernels on host buffers (tests/test_kernels_adam_triton.py).
Imports jax, numpy and (optionally) triton only.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.compile_ahead import call_triton
from pallas_kernels.adam.adam_operands import check_operands, check_packed_operands

try:  # the kernels need triton only (they compile without a GPU); calling them needs jax-triton
  import triton
  import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines
  triton = tl = None
if triton is not None:
  from pallas_kernels.adam.adam_tile_triton import adam_tile
try:  # GPU machines only
  import jax_triton as jt
except ImportError:  # pragma: no cover - CPU machines
  jt = None

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def available() -> bool:
  """True when triton and jax-triton import (GPU machines)."""
  return triton is not None and jt is not None


GROUP_AXES = (-1, -2)
# Default tiles (read when adam_step is traced; benchmarks/step/bench_optimizer.py --rows-tiles and
# --cols-tiles sweep them, calling jax.clear_caches() between settings). Rows: 8 x 4 measured as
# fast as 16 x 4 per leaf and faster with the packed state, stacked leaves and one per matrix
# (H200; docs/results.md, "The optimizer step as a scanned model holds its parameters").
ROWS_BLOCK, ROWS_WARPS = 8, 4    # group_axis -1: rows of G per program, warps
COLS_BLOCK, COLS_WARPS = 32, 8   # group_axis -2: columns per G-row tile, warps
COLS_VEC = 4                     # group_axis -2: contiguity the accesses are told (`adam_cols`)
# How the leaf size reaches the kernel (read when adam_step is traced; benchmarks A/B them):
#   "runtime": an int argument, one Triton compile for every leaf size; EVEN tiles (rows / cols
#     a multiple of BLOCK) build no masks;
#   "runtime_masked": an int argument, always masked (slower on the H100);
#   "constexpr": ROWS / COLS constexpr, always masked: one compile per leaf size.
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
                GCLAMP: tl.constexpr, EVEN: tl.constexpr = False, meta0=0):
    """The step on row block `blk` (BLOCK rows of G) of a leaf of `rows` rows, weight decay `wd`:
    the body of the row kernel. EVEN: rows % BLOCK == 0 (no masks; `rows` unused). meta0: the
    leaf's first metadata group in packed moments (0 otherwise), added to the metadata index."""
    rows_idx = blk * BLOCK + tl.arange(0, BLOCK)
    offs = rows_idx[:, None].to(tl.int64) * G + tl.arange(0, G)[None, :]
    if EVEN:
      mask = None
      meta_mask = None
    else:
      meta_mask = rows_idx < rows
      mask = meta_mask[:, None]
    adam_tile(offs, rows_idx + meta0, mask, meta_mask, wd, s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr,
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
                GCLAMP: tl.constexpr, EVEN: tl.constexpr = False, VEC: tl.constexpr = 4,
                meta0=0, data0=0):
    """The step on tile `blk` of a leaf viewed as (R * G, cols), grouped along its rows: row
    group blk // nc, columns (blk % nc) * BLOCK + [0, BLOCK) with nc = ceil(cols / BLOCK) (the
    column tiles of one row group are neighbouring programs: they share DRAM pages), the whole
    G x BLOCK tile in one pass (`adam_tile`, groups along tile axis 0: each column's G rows
    reduced in the tile). EVEN: cols % BLOCK == 0 (no masks). VEC: the contiguity the loads
    and stores are told (0: what Triton proves, 16 FP8 columns); 4 lays the tile out as 4
    columns x several rows per thread for every operand (16-byte float32 and 4-byte FP8
    accesses): each thread's per-column work (metadata, coefficients) serves several rows, and
    no layout conversion separates the float32 and FP8 operands. meta0, data0: the leaf's slot
    in packed moments (first metadata group, first code; 0 otherwise), added to the metadata
    index and to the row group's start rather than moving more pointers."""
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
    offs = tl.arange(0, G)[:, None] * cols + cols_idx[None, :]
    if VEC > 0:
      offs = tl.max_contiguous(offs, [1, VEC])
    adam_tile(offs, meta_idx, mask, cmask, wd, s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr,
              mk_ptr, vq_ptr, va_ptr, vk_ptr, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr,
              vao_ptr, vko_ptr, 0, HAS_PARAM, OUT_PARAM, M_FMAX, V_FMAX, M_LOG2R, V_LOG2R,
              EXPAND, EM, MAX_K, FLOOR, NOEXP_K, FAST, GCLAMP)

  @triton.jit
  def _slot_start(seg_arg, SEG: tl.constexpr, G: tl.constexpr):
    """The leaf's slot in packed buffers (coat_jax.packed_state): (first metadata group
    seg_arg * SEG, first code that * G), int64; the constexpr factors keep the alignment Triton
    vectorizes with. tl.cast: jax-triton passes a scalar equal to 1 as a constant (a Python
    int). Called with SEG > 0 only."""
    meta = tl.cast(seg_arg, tl.int64) * SEG
    return meta, meta * G

  @triton.jit
  def _segment(seg_arg, mq_ptr, vq_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr, vao_ptr, vko_ptr,
               ma_ptr, mk_ptr, va_ptr, vk_ptr, SEG: tl.constexpr, G: tl.constexpr):
    """The row kernel's slot in packed buffers (`_slot_start`; SEG 0: none): the two code
    pointers moved to the slot's first code, its first metadata group returned as an index
    offset (as the column kernel adds it). Packed moments are always written in place
    (adam_step aliases them), so the outputs take the (moved) input pointers. Returns (meta0,
    mq, vq, mqo, mao, mko, vqo, vao, vko)."""
    if SEG > 0:
      meta, data = _slot_start(seg_arg, SEG, G)
      mq_ptr, vq_ptr = mq_ptr + data, vq_ptr + data
      mqo_ptr, mao_ptr, mko_ptr, vqo_ptr, vao_ptr, vko_ptr = (mq_ptr, ma_ptr, mk_ptr, vq_ptr,
                                                              va_ptr, vk_ptr)
    else:
      meta = 0
    return meta, mq_ptr, vq_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr, vao_ptr, vko_ptr

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
    meta0, mq_ptr, vq_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr, vao_ptr, vko_ptr = _segment(
        seg_arg, mq_ptr, vq_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr, vao_ptr, vko_ptr, ma_ptr,
        mk_ptr, va_ptr, vk_ptr, SEG, G)
    adam_rows(tl.program_id(0), rows, tl.load(s_ptr + 6), s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr,
              mk_ptr, vq_ptr, va_ptr, vk_ptr, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr,
              vao_ptr, vko_ptr, G, BLOCK, HAS_PARAM, OUT_PARAM, M_FMAX, V_FMAX, M_LOG2R,
              V_LOG2R, EXPAND, EM, MAX_K, FLOOR, NOEXP_K, FAST, GCLAMP, EVEN, meta0)

  @triton.jit
  def _adam_cols_kernel(s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr, mk_ptr, vq_ptr, va_ptr, vk_ptr,
                        cols_arg, seg_arg, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr, vao_ptr,
                        vko_ptr,
                        COLS: tl.constexpr, CDIV: tl.constexpr, EVEN: tl.constexpr,
                        VEC: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
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
              V_LOG2R, EXPAND, EM, MAX_K, FLOOR, NOEXP_K, FAST, GCLAMP, EVEN, VEC, meta0, data0)

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


def parse_tiles(text: str) -> list[tuple[int, int]]:
  """Kernel tiles for benchmarks' sweeps: 'BLOCKxWARPS' (BLOCK columns of a G-row tile for the
  column kernel, BLOCK rows of G for the row kernel; WARPS warps), comma-separated ->
  [(BLOCK, WARPS), ...]."""
  tiles = []
  for t in filter(None, (s.strip() for s in text.split(","))):
    try:
      v = [int(x) for x in t.split("x")]
    except ValueError:
      v = []
    if len(v) != 2 or min(v) <= 0 or any(x & (x - 1) for x in v):
      raise ValueError(f"tile {t!r} is not BLOCKxWARPS (powers of two)")
    tiles.append(tuple(v))
  return tiles


def pow2_divisor(n: int, cap: int = 16) -> int:
  """The largest power of two <= cap dividing n."""
  d = 1
  while d < cap and n % (2 * d) == 0:
    d *= 2
  return d


def launch_plan(shape, group_size: int, group_axis: int = -1, block: int | None = None,
                size_arg: str | None = None, vec: int | None = None) -> tuple:
  """How `adam_step` launches on a leaf of `shape`: (kernel, grid size, size operand, size
  constexprs). The size operand (an int argument before the outputs) is the leaf's rows of G
  (`_adam_kernel`) or its column count / CDIV (`_adam_cols_kernel`); the constexprs are ROWS /
  COLS (0 unless size_arg is "constexpr"), EVEN, and for columns CDIV (pow2_divisor(cols)) and
  VEC. block, size_arg, vec: None reads ROWS_BLOCK / COLS_BLOCK, SIZE_ARG, COLS_VEC."""
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
  vec = COLS_VEC if vec is None else vec
  cols = shape[-1]
  cdiv = pow2_divisor(cols)
  consts = dict(COLS=cols if size_arg == "constexpr" else 0, CDIV=cdiv,
                EVEN=size_arg == "runtime" and cols % block == 0, VEC=vec)
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
    "grad_clamp", "group_axis", "packed_at", "segment"))
def adam_step(param, grad, m_q, m_amax, m_code, v_q, v_amax, v_code, *, lr, b1, b2, eps,
              weight_decay, count, m_fmax: float, v_fmax: float, m_log2_range: float,
              v_log2_range: float, group_size: int, expand: bool, expand_min: int,
              max_k_code: int = 255, amax_floor: float = 1e-30, output: str = "param",
              block: int | None = None, num_warps: int | None = None, alias: bool = False,
              fast_math: bool = False, grad_clamp: float = 2.0**63, group_axis: int = -1,
              grad_scale=None, packed_at: int | None = None, segment: int = 16):
  """One fused step over one parameter: (new param or update, m codes, m amax, m k codes, v codes,
  v amax, v k codes), as coat_jax.adam_math.adam_step_reference.

  param, grad: the leaf (param None only with output="update": no decay term); m_q / v_q: FP8
  codes of the leaf's shape, m_amax / m_code, v_amax / v_code: float32 / uint8 metadata
  (coat_jax.expansion.ExpandedMoment); lr, b1, b2, eps, weight_decay: Python numbers or float32
  scalars, count: the step number t >= 1; m_fmax / v_fmax, m_log2_range / v_log2_range,
  expand, expand_min, max_k_code, amax_floor: the formats' limits (coat_jax.kernels.adam
  .adam_kernel_limits); output: "param" (param.dtype) or "update" (grad.dtype).

  group_axis: -1 (groups of G along the last axis, metadata (..., N / G)) or -2 (G consecutive
  rows of each column of a (..., in, out) param, metadata (..., in / G, out): COAT's layout).
  block, num_warps: per program, rows of G (group_axis -1, default ROWS_BLOCK) or columns of a
  G-row tile (group_axis -2, default COLS_BLOCK), a power of two, and its warps (ROWS_WARPS /
  COLS_WARPS; `launch_plan`; the leaf size reaches the kernel as SIZE_ARG says). alias: write
  the new param and moments into the old ones' buffers
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
                                                        block)
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
