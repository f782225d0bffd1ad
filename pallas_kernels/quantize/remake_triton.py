"""A linear input's transposed per-tensor FP8 codes, remade from the 1 x 16 codes its producer
keeps, in one pass (Triton, called through jax-triton; GPU only).

With `linear_residuals: remade` a linear keeps no codes of its input x for dW = dY^T x: its
backward remakes x^T's codes from what the op that made x keeps anyway:

  rmsnorm   x = ((xq * xs) * rstd) * w      xq (M, K): E4M3 codes of the norm's input, xs (M, K/G)
                                            their group scales, rstd (M,) float32, w (K,)
  swiglu    x = silu(a) * u                 a = gq * gs, u = uq * us (gate's and up's codes and
                                            group scales), silu(a) = a / (1 + exp(-a))

in float32, x rounded to bfloat16 (the value the forward quantized), then
q_t = cast(clamp(x / scale, -fmax, fmax)) (round to nearest even, NaN kept) with the forward's
per-tensor scale, written transposed: (K, M). Unfused, an XLA fusion writes x in bfloat16 and
the per-tensor quantize kernel reads it back (and writes an untransposed copy nobody reads):
per element 1.1 (rmsnorm) or 2.3 (swiglu) bytes read and 1 written here, against about 7 and 8.

A program takes a BM x BK tile (pid -> row block pid // (K / BK), column block pid % (K / BK)):
it loads the codes along K as [BM, BK / G, G] with the [BM, BK / G] group scales broadcast
over the last axis, and stores the tile transposed (`tl.trans`: Triton moves it through shared
memory), so that the stores run along M. No masks: `problem` says which shapes it takes (the
dispatch gives the others to the unfused path).

Imports jax, numpy and (optionally) triton only; fmax and dtypes come in as arguments.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.compile_ahead import call_triton

try:  # the kernels need triton only (they compile without a GPU); calling them needs jax-triton
  import triton
  import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines
  triton = tl = None

KINDS = ("rmsnorm", "swiglu")
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
# The tile (rows x columns of x; 64 columns where K is no multiple of 128) and warps per program:
# the fastest of benchmarks/kernels/bench_remake.py's --sweep over both kinds at the 7B layer's
# shapes on an H100 (docs/kernels.md, "The remake kernel").
BLOCK_ROWS, BLOCK_COLS, WARPS = 64, 128, 4


def block_cols_for(k: int) -> int:
  """The tile's columns for a last axis of k: BLOCK_COLS, or 64 where k is no multiple of it."""
  return BLOCK_COLS if k % BLOCK_COLS == 0 else 64


def available() -> bool:
  """True when triton and jax-triton import (GPU machines)."""
  return triton is not None and call_triton.available()


def problem(shape, group_size: int, block_rows: int = BLOCK_ROWS,
            block_cols: int | None = None) -> str | None:
  """Why codes of `shape` (..., K) cannot be remade here, or None (block_cols None:
  `block_cols_for(K)`)."""
  if len(shape) < 1:
    return "a scalar has no rows"
  k, m = shape[-1], int(np.prod(shape[:-1], dtype=np.int64))
  block_cols = block_cols or block_cols_for(k)
  if k % block_cols or k % group_size or block_cols % group_size:
    return (f"last axis {k} is not a multiple of the tile's {block_cols} columns and of the "
            f"group size {group_size}")
  if m == 0 or m % block_rows:
    return f"{m} rows are not a positive multiple of the tile's {block_rows}"
  if m * k >= 2**31:
    return f"{m} x {k} elements: offsets must stay below 2^31"
  return None


if triton is not None:
  @triton.jit
  def _group_values(q_ptr, s_ptr, rows, col0, K: tl.constexpr, G: tl.constexpr,
                    BK: tl.constexpr):
    """codes times their group scales, float32 [BM, BK]: the codes load as [BM, BK / G, G] and
    the [BM, BK / G] scales broadcast over the last axis (loading each element's scale from its
    group's address instead was slower at most tiles on an H100)."""
    groups = col0 // G + tl.arange(0, BK // G)
    within = tl.arange(0, G)
    q = tl.load(q_ptr + rows[:, None, None] * K + groups[None, :, None] * G
                + within[None, None, :]).to(tl.float32)
    s = tl.load(s_ptr + rows[:, None] * (K // G) + groups[None, :]).to(tl.float32)
    return tl.reshape(q * s[:, :, None], (rows.shape[0], BK))

  @triton.jit
  def _store_transposed(out_ptr, x, scale, rows, cols, M, FMAX: tl.constexpr):
    """x rounded to bfloat16, divided by the scale, saturated, cast and stored at (cols, rows)."""
    x = x.to(tl.bfloat16).to(tl.float32)
    y = x / scale
    y = tl.minimum(tl.maximum(y, -FMAX, propagate_nan=tl.PropagateNan.ALL), FMAX,
                   propagate_nan=tl.PropagateNan.ALL)
    q = tl.trans(y.to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + cols[:, None] * M + rows[None, :], q)

  @triton.jit
  def _tile(K: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """The program's rows and its first column."""
    pid = tl.program_id(0)
    return (pid // (K // BK)) * BM + tl.arange(0, BM), (pid % (K // BK)) * BK

  @triton.jit
  def coat_remake_rmsnorm(scale_ptr, q_ptr, s_ptr, rstd_ptr, w_ptr, M, out_ptr,
                          K: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                          FMAX: tl.constexpr):
    rows, col0 = _tile(K, BM, BK)
    cols = col0 + tl.arange(0, BK)
    x = _group_values(q_ptr, s_ptr, rows, col0, K, G, BK)
    x = x * tl.load(rstd_ptr + rows)[:, None]
    x = x * tl.load(w_ptr + cols).to(tl.float32)[None, :]
    _store_transposed(out_ptr, x, tl.load(scale_ptr), rows, cols, M, FMAX)

  @triton.jit
  def coat_remake_swiglu(scale_ptr, gq_ptr, gs_ptr, uq_ptr, us_ptr, M, out_ptr,
                         K: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                         FMAX: tl.constexpr):
    rows, col0 = _tile(K, BM, BK)
    cols = col0 + tl.arange(0, BK)
    a = _group_values(gq_ptr, gs_ptr, rows, col0, K, G, BK)
    u = _group_values(uq_ptr, us_ptr, rows, col0, K, G, BK)
    _store_transposed(out_ptr, a / (1.0 + tl.exp(-a)) * u, tl.load(scale_ptr), rows, cols, M,
                      FMAX)

  KERNELS = {"rmsnorm": coat_remake_rmsnorm, "swiglu": coat_remake_swiglu}


def launch_plan(shape, group_size: int, block_rows: int = BLOCK_ROWS,
                block_cols: int | None = None) -> tuple[int, int, dict]:
  """(grid size, M, constexprs) of a remake of codes of `shape`; also for running a kernel in
  Triton's interpreter (tests)."""
  k, m = shape[-1], int(np.prod(shape[:-1]))
  block_cols = block_cols or block_cols_for(k)
  return ((m // block_rows) * (k // block_cols), m,
          dict(K=k, G=group_size, BM=block_rows, BK=block_cols))


def _check(kind, codes, scales, group_size, block_rows, block_cols):
  if not available():
    raise ValueError("remake_triton: triton / jax-triton are not installed (GPU only)")
  if kind not in KINDS:
    raise ValueError(f"remake_triton: kind must be one of {KINDS}, got {kind!r}")
  why = problem(codes[0].shape, group_size, block_rows, block_cols)
  if why is not None:
    raise ValueError(f"remake_triton: {why}")
  groups = codes[0].shape[:-1] + (codes[0].shape[-1] // group_size,)
  for q, s in zip(codes, scales):
    if q.shape != codes[0].shape or jnp.dtype(q.dtype) not in FP8_DTYPES:
      raise ValueError(f"remake_triton: codes must be FP8 of one shape, got {q.dtype} "
                       f"{q.shape} and {codes[0].dtype} {codes[0].shape}")
    if s.shape != groups:
      raise ValueError(f"remake_triton: scales of shape {s.shape} do not hold one value per "
                       f"group of {group_size} of codes {q.shape}")


@functools.partial(jax.jit, static_argnames=("kind", "group_size", "out_dtype", "fmax",
                                             "block_rows", "block_cols", "num_warps"))
def remake_transposed(kind: str, scale: jax.Array, codes: tuple, scales: tuple,
                      extra: tuple = (), *, group_size: int, out_dtype, fmax: float,
                      block_rows: int = BLOCK_ROWS, block_cols: int | None = None,
                      num_warps: int = WARPS) -> jax.Array:
  """The transposed per-tensor codes (K, M) of x remade from 1 x G codes (module docstring).

  kind "rmsnorm": codes (xq,), scales (xs,), extra (rstd (..., 1) or (...,) float32, w (K,));
  kind "swiglu": codes (gq, uq), scales (gs, us), no extra. scale: the per-tensor scale, float32
  (); out_dtype: the FP8 dtype of q_t, fmax its largest finite value. block_rows, block_cols
  (None: `block_cols_for(K)`), num_warps: the tile and its warps.
  """
  _check(kind, codes, scales, group_size, block_rows, block_cols)
  grid, m, consts = launch_plan(codes[0].shape, group_size, block_rows, block_cols)
  k = codes[0].shape[-1]
  flat = [a.reshape(m, k) for a in codes]
  groups = [s.reshape(m, k // group_size) for s in scales]
  if kind == "rmsnorm":
    rstd, w = extra
    operands = [flat[0], groups[0], rstd.reshape(m).astype(jnp.float32), w.reshape(k)]
  else:
    operands = [flat[0], groups[0], flat[1], groups[1]]
  return call_triton.triton_call(
      jnp.asarray(scale, jnp.float32).reshape(1), *operands, m, kernel=KERNELS[kind],
      out_shape=jax.ShapeDtypeStruct((k, m), jnp.dtype(out_dtype)), grid=(grid,),
      num_warps=num_warps, num_stages=1, FMAX=float(fmax), **consts)
