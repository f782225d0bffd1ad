"""SwiGLU's backward straight to the FP8 gradients the gate and up GEMMs' backward read: two
Triton passes over dh and the forward's 1 x G codes, no bfloat16 d_gate / d_up in memory.

The unfused path (swiglu_mgpu.swiglu_backward, then a per-tensor E5M2 quantize with its transposed
copy for each gradient) writes d_gate and d_up in dh's dtype and reads them again. Here, with
a = gq * gs, u = uq * us (per group, float32), s = 1 / (1 + exp(-a)):

  dg = round(dh * u * s * (1 + a (1 - s))),   du = round(dh * a * s)   (round: to dh's dtype)

  pass 1 (`_maxima_kernel`): per program, max|dg| and max|du| (NaN where its tile holds a NaN),
          reading dh and the codes and writing nothing else;
  then    amax = max over the programs, scale = max(amax * f32(1 / fmax), floor) (NaN for a NaN
          or inf amax), as quantize_mgpu's per-tensor scale;
  pass 2 (`_quantize_kernel`): the same dg and du again, q = cast(clamp(dg / scale, -fmax, fmax))
          and its transpose, for both gradients.

Per element of dh the two passes read dh and the two codes twice (8 bytes) and write four codes
(4 bytes): 12 bytes; unfused, SwiGLU's backward reads 4 bytes and writes 4, and the quantizes
read those 4 and write 4: 16 bytes. 1.68 against 2.18 GB at
OLMo-1B's gate/up shape (16384 x 8192), plus the scales. The codes and scales equal the unfused
kernels' bit for bit (tests/test_swiglu_grad_quantize.py on the GPU).

Tiles are BM x BN of the (M, N) view (M = the leading axes' product); M % BM == N % BN == 0
and BN % G == 0 (no masks). Offsets are int64 (M * N may pass 2^31); M and N are constexprs.
Imports jax, numpy and (optionally) triton only.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.compile_ahead import call_triton

try:  # the kernels need triton only; calling them needs jax-triton (GPU machines)
  import triton
  import triton.language as tl
  from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - CPU machines
  triton = tl = libdevice = None

def available() -> bool:
  """True when triton and jax-triton import (GPU machines with the `gpu` extra)."""
  return triton is not None and call_triton.available()


# 64 x 64 tiles on 4 warps (32 elements a thread, ~127 registers for sm_90): with 32 x 128 the
# fastest of seven tiles on an H100 at OLMo-1B's and Llama-2-7B's gate/up shapes
# (benchmarks/kernels/bench_swiglu_grad_quantize.py --tiles ...; 64 x 128 x 4 warps and larger
# tiles spill or run slower, 16 elements a thread run slower)
BLOCK_M, BLOCK_N, NUM_WARPS = 64, 64, 4


def problem(shape, dtype, code_dtype, group_size: int, block_m: int = BLOCK_M,
            block_n: int = BLOCK_N) -> str | None:
  """Why the kernels cannot take dh of `shape` / `dtype` with codes of `code_dtype`, or None."""
  if not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize != 2:
    return f"dh dtype {jnp.dtype(dtype)} is not a 16-bit float"
  if jnp.dtype(code_dtype) not in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)):
    return f"codes dtype {jnp.dtype(code_dtype)} is not FP8"
  if len(shape) < 2:
    return f"shape {tuple(shape)} has fewer than 2 axes"
  n, m = shape[-1], int(np.prod(shape[:-1]))
  if n % block_n or m % block_m or block_n % group_size:
    return (f"shape {tuple(shape)}: rows {m} and columns {n} must be multiples of {block_m} and "
            f"{block_n}, and {block_n} of the group size {group_size}")
  return None


if triton is not None:

  @triton.jit
  def _grads(dh_ptr, gq_ptr, gs_ptr, uq_ptr, us_ptr, N: tl.constexpr, G: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, pid_m, pid_n):
    """(rm, rn, dg, du) of tile (pid_m, pid_n), as (BM, BN / G, G) blocks (a group a row of the
    last axis, its scale broadcast along it): rm (BM,) rows, rn (BN / G, G) columns (int64),
    dg, du float32 values rounded to dh's dtype."""
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    cn = pid_n * (BN // G) + tl.arange(0, BN // G)
    rn = (cn[:, None] * G + tl.arange(0, G)[None, :]).to(tl.int64)
    offs = rm[:, None, None] * N + rn[None, :, :]
    soffs = rm[:, None] * (N // G) + cn[None, :]
    d = tl.load(dh_ptr + offs).to(tl.float32)
    a = tl.load(gq_ptr + offs).to(tl.float32) * tl.load(gs_ptr + soffs).to(tl.float32)[:, :, None]
    u = tl.load(uq_ptr + offs).to(tl.float32) * tl.load(us_ptr + soffs).to(tl.float32)[:, :, None]
    # libdevice's expf (XLA's and the Mosaic GPU kernel's exp: the same codes); tl.exp's one
    # ex2.approx was 3-8 % faster but moved 6 to 22 codes in 1.3e8 by one step (H100)
    s = 1.0 / (1.0 + libdevice.exp(-a))
    out = dh_ptr.dtype.element_ty
    dg = (d * u * s * (1.0 + a * (1.0 - s))).to(out).to(tl.float32)
    du = (d * a * s).to(out).to(tl.float32)
    return rm, rn, dg, du

  @triton.jit
  def _abs_max(x):
    """max|x| of a tile, NaN where it holds a NaN (tl.max's max.f32 drops NaN operands)."""
    m = tl.max(tl.max(tl.max(tl.abs(x), axis=2), axis=1), axis=0)
    has_nan = tl.max(tl.max(tl.max((x != x).to(tl.int32), axis=2), axis=1), axis=0)
    return tl.where(has_nan > 0, float("nan"), m)

  @triton.jit
  def _maxima_kernel(dh_ptr, gq_ptr, gs_ptr, uq_ptr, us_ptr, out_ptr, N: tl.constexpr,
                     G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0)
    grid_n = N // BN
    _, _, dg, du = _grads(dh_ptr, gq_ptr, gs_ptr, uq_ptr, us_ptr, N, G, BM, BN, pid // grid_n,
                          pid % grid_n)
    tl.store(out_ptr + 2 * pid, _abs_max(dg))
    tl.store(out_ptr + 2 * pid + 1, _abs_max(du))

  @triton.jit
  def _quantize_kernel(dh_ptr, gq_ptr, gs_ptr, uq_ptr, us_ptr, scale_ptr, qg_ptr, qgt_ptr,
                       qu_ptr, qut_ptr, N: tl.constexpr, M: tl.constexpr, FMAX: tl.constexpr,
                       G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0)
    grid_n = N // BN
    rm, rn, dg, du = _grads(dh_ptr, gq_ptr, gs_ptr, uq_ptr, us_ptr, N, G, BM, BN, pid // grid_n,
                            pid % grid_n)
    offs = rm[:, None, None] * N + rn[None, :, :]
    offs_t = rn[:, :, None] * M + rm[None, None, :]
    code = qg_ptr.dtype.element_ty
    qg = tl.minimum(tl.maximum(dg / tl.load(scale_ptr), -FMAX), FMAX).to(code)
    tl.store(qg_ptr + offs, qg)
    tl.store(qgt_ptr + offs_t, tl.permute(qg, (1, 2, 0)))
    qu = tl.minimum(tl.maximum(du / tl.load(scale_ptr + 1), -FMAX), FMAX).to(code)
    tl.store(qu_ptr + offs, qu)
    tl.store(qut_ptr + offs_t, tl.permute(qu, (1, 2, 0)))


def scales_from_maxima(maxima, fmax: float, floor: float):
  """(amax (2,), scale (2,)) of pass 1's per-program maxima (programs, 2): NaN stays NaN."""
  amax = jnp.max(maxima, axis=0)
  inv = float(np.float32(1.0) / np.float32(fmax))
  scale = jnp.where(amax < jnp.inf, jnp.maximum(amax * inv, floor), jnp.nan)
  return amax, scale.astype(jnp.float32)


def _operands(dh, gq, gs, uq, us, group_size, block_m, block_n):
  n = dh.shape[-1]
  m = dh.size // n
  args = (dh.reshape(m, n), gq.reshape(m, n), gs.reshape(m, n // group_size),
          uq.reshape(m, n), us.reshape(m, n // group_size))
  # N and M constexpr: jax-triton gives scalar operands no divisibility, and without it the
  # loads and stores are not vectorized (one kernel per gate/up shape: one per model)
  return args, dict(N=n, G=group_size, BM=block_m, BN=block_n), (m // block_m) * (n // block_n)


def _maxima(args, consts, programs, num_warps):
  [out] = call_triton.triton_call(
      *args, kernel=_maxima_kernel, out_shape=[jax.ShapeDtypeStruct((programs, 2), jnp.float32)],
      grid=(programs,), num_warps=num_warps, num_stages=1, **consts)
  return out


@functools.partial(jax.jit, static_argnames=("group_size", "block_m", "block_n", "num_warps"))
def maxima(dh, gq, gs, uq, us, *, group_size: int, block_m: int = BLOCK_M,
           block_n: int = BLOCK_N, num_warps: int = NUM_WARPS):
  """Pass 1 alone (its own time in the benchmark): the per-program maxima (programs, 2) of |dg|
  and |du|."""
  return _maxima(*_operands(dh, gq, gs, uq, us, group_size, block_m, block_n), num_warps)


@functools.partial(jax.jit, static_argnames=("group_size", "out_dtype", "fmax", "floor",
                                             "block_m", "block_n", "num_warps"))
def swiglu_grad_quantize(dh, gq, gs, uq, us, *, group_size: int, out_dtype, fmax: float,
                         floor: float, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
                         num_warps: int = NUM_WARPS):
  """Both passes (module docstring) through jax-triton: dh (..., N), gq, uq FP8 codes of its
  shape, gs, us their scales (..., N / G). Returns ((qg, qg_t, scale_g), (qu, qu_t, scale_u),
  amax (2,)): codes out_dtype (M, N), transposed (N, M), scales float32 ()."""
  if not available():
    raise ValueError("swiglu_grad_quantize: triton and jax-triton are not installed (GPU "
                     "machines: pip install coat-jax[gpu])")
  why = problem(dh.shape, dh.dtype, gq.dtype, group_size, block_m, block_n)
  if why is not None:
    raise ValueError(f"swiglu_grad_quantize: {why}")
  args, consts, programs = _operands(dh, gq, gs, uq, us, group_size, block_m, block_n)
  m, n = args[0].shape
  amax, scale = scales_from_maxima(_maxima(args, consts, programs, num_warps), fmax, floor)
  codes = jax.ShapeDtypeStruct((m, n), out_dtype)
  codes_t = jax.ShapeDtypeStruct((n, m), out_dtype)
  qg, qgt, qu, qut = call_triton.triton_call(
      *args, scale, kernel=_quantize_kernel, out_shape=[codes, codes_t, codes, codes_t],
      grid=(programs,), num_warps=num_warps, num_stages=1, M=m, FMAX=float(fmax), **consts)
  return (qg, qgt, scale[0]), (qu, qut, scale[1]), amax
