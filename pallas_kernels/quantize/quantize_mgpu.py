"""Quantize / group-scaling / dequantize kernels on Pallas Mosaic GPU (Hopper).

The quantize kernels `coat_jax.kernels` dispatches to (the semantics of coat_jax.quantize), written
against the Mosaic GPU backend (which replaces the deprecated Pallas Triton backend, whose kernels
these replaced):

  per group (1 x G along the last axis):   amax = max|x|,  scale = max(amax * (1/fmax), floor),
                                           NaN where the group holds NaN/inf, rounded to the
                                           scale dtype (float32 or bfloat16, nearest),
                                           q = cast(clamp(x / scale, -fmax, fmax))   (RNE cast)
  stage-1 tile maxima:                     max|x| per 1 x 16 tile (NaN/inf tiles: NaN or inf)
  per tensor:                              q = cast(clamp(x / scale, -fmax, fmax)) with one given
                                           scale; optionally also q of x's last two axes swapped
  per-group dequantize:                    x = q * scale

1/fmax is rounded to float32 first, as XLA compiles the reference's division by the constant fmax.
Blocks are (r, G) row tiles of a (rows, G) view: one group per row. Loaded into registers in the
WGMMA layout (rows split over the warpgroup's 4 warps, 4 lanes share a row), so the per-group max
is a within-warp lane shuffle (Mosaic GPU's TiledLayout reduction), the scale a WGMMA_ROW vector
stored to shared memory and written by TMA. Max here is NaN-propagating (PTX max.NaN), so a NaN
group gives a NaN amax without a second reduction; inf fails the `amax < inf` test.

Codes and scales are bit-identical to the jnp references on the GPU (XLA and Mosaic GPU both
divide with div.full.f32; numpy's IEEE division can differ by one code). Their bandwidth against
a device copy's (benchmarks/kernels/bench_kernels_mgpu.py): docs/kernels.md, "The kernels".

Imports jax and numpy only: format limits (fmax), the scale floor and dtypes come in as arguments;
inputs and outputs are plain arrays. `supported_*` say which shapes each kernel takes; the entry
points raise ValueError on others (no fallbacks here: the dispatch chooses).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.extend.core import jaxpr_as_fun
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.quantize.rows_mgpu import MAX_CTAS, ROW_QUANTUM, launch

STAGE1_TILE = 16
BLOCK_ROWS = (1024, 512, 256, 128, 64)
_WGMMA = plgpu.Layout.WGMMA


def rows_per_block(rows: int, cap: int) -> int:
  """Largest of BLOCK_ROWS <= cap dividing rows (rows % 64 == 0 is checked by the caller)."""
  for r in BLOCK_ROWS:
    if r <= cap and rows % r == 0:
      return r
  return ROW_QUANTUM


def rows_problem(x_shape, dtype, group: int) -> str | None:
  """Why a (..., N) array cannot be viewed as (rows, group) blocks for these kernels, or None."""
  if not jnp.issubdtype(dtype, jnp.floating) and not jnp.issubdtype(dtype, jnp.integer):
    return f"dtype {dtype} is not a float or integer type"
  if len(x_shape) == 0 or x_shape[-1] % group:
    return f"last axis of shape {tuple(x_shape)} is not a multiple of {group}"
  if group % 16 or group > 256:
    return f"group size {group} must be a multiple of 16 and at most 256"
  rows = int(np.prod(x_shape)) // group
  if rows == 0 or rows % ROW_QUANTUM:
    return (f"shape {tuple(x_shape)} holds {rows} groups of {group}; the kernel needs a "
            f"positive multiple of {ROW_QUANTUM}")
  return None


def supported_per_group(shape, dtype, group_size: int) -> bool:
  """Per-group quantize / dequantize / tile maxima: N % G == 0, G in 16..256 (multiple of 16),
  size / G a positive multiple of 64."""
  return jnp.issubdtype(dtype, jnp.floating) and rows_problem(shape, dtype, group_size) is None


def supported_per_tensor(shape, dtype, with_transpose: bool, cast_dtype=None) -> bool:
  """Per-tensor quantize: N % 64 == 0 and size / 64 a positive multiple of 64; with the transposed
  copy instead ndim >= 2, both N and M (the second-last axis) multiples of 64 and a 16-bit dtype
  of the values quantized (cast_dtype where given, else dtype): the transposed copy loads them
  through a transposed view of shared memory, which for float32 fails Mosaic GPU's layout
  inference ("Failed to infer a possible set of layouts"); a float32 input rounded to a 16-bit
  cast_dtype is staged there as that cast."""
  if not jnp.issubdtype(dtype, jnp.floating) or len(shape) == 0:
    return False
  if cast_dtype is not None and not jnp.issubdtype(cast_dtype, jnp.floating):
    return False
  if with_transpose:
    return (len(shape) >= 2 and shape[-1] % 64 == 0 and shape[-2] % 64 == 0
            and jnp.dtype(dtype if cast_dtype is None else cast_dtype).itemsize == 2)
  return rows_problem(shape, dtype, 64) is None


def check_problem(problem: str | None, what: str):
  if problem is not None:
    raise ValueError(f"{what}: {problem}")


def _check_float(dtype, what: str):
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{what}: expected a floating-point array, got dtype {dtype}")


def shared_trace(launcher):
  """`launcher(*arrays, **static)` run from one trace per (static, array shapes and dtypes).

  Callers with different views of one kernel input (e.g. x of (16384, 2048) and of
  (8, 2048, 2048), or an operand carrying a sharding annotation) would otherwise each trace the
  kernel anew, and every trace is lowered to its own Mosaic GPU module (each trace's source
  locations differ), which the GPU compile then compiles once per module. Here the kernel is
  traced once on plain abstract inputs and every call binds that trace (a `jit` of it: JAX lowers
  it once per step)."""
  @functools.lru_cache(maxsize=None)
  def traced(static, types):
    fn = jax.jit(functools.partial(launcher, **dict(static)))
    return jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(s, d) for s, d in types])

  @functools.wraps(launcher)
  def run(*arrays, **static):
    closed = traced(tuple(sorted(static.items())),
                    tuple((tuple(a.shape), jnp.dtype(a.dtype)) for a in arrays))
    return jaxpr_as_fun(closed)(*arrays)

  return run


def row_blocks(r: int, group: int):
  """(r, G) data blocks and (r,) per-group blocks of the (rows, G) view, by block id."""
  return ((r, group), lambda blk: (pl.ds(blk * r, r),)), ((r,), lambda blk: (pl.ds(blk * r, r),))


def load_f32(ref):
  """(r, G) block -> float32 registers in the WGMMA layout (row reductions stay in the warp)."""
  return plgpu.load(ref, layout=_WGMMA).astype(jnp.float32)


def group_scale(amax, fmax: float, floor: float):
  """max(amax * f32(1/fmax), floor), NaN where amax is NaN or inf."""
  inv = float(np.float32(1.0) / np.float32(fmax))
  s = jnp.maximum(amax * inv, floor)
  return jnp.where(amax < jnp.inf, s, jnp.nan)


def true_div(x, y, interpret: bool):
  """x / y as a true float32 division (XLA:CPU would turn x / broadcast(s) into x * (1/s) inside
  a fused body; the barrier keeps the division so interpret mode matches the CPU reference)."""
  return x / jax.lax.optimization_barrier(y) if interpret else x / y


def saturate(y, fmax: float):
  # max / min are NaN-propagating in Mosaic GPU (max.NaN) and in jnp: NaN stays NaN.
  return jnp.minimum(jnp.maximum(y, -fmax), fmax)


# ---------------------------------------------------------------------------------------------
# Per group.

def quantize_groups(x, q_ref, s_ref, fmax, floor, interpret):
  """The per-group quantize of float32 registers x (r, G), one group a row: codes to q_ref,
  scales (as stored) to s_ref. Also the SwiGLU kernel's (swiglu_mgpu.py) for gate and up."""
  stored = group_scale(jnp.max(jnp.abs(x), axis=1), fmax, floor).astype(s_ref.dtype)  # (r,)
  scale = stored.astype(jnp.float32)                     # divide by the scale as stored
  y = true_div(x, jnp.broadcast_to(scale[:, None], x.shape), interpret)
  q_ref[...] = saturate(y, fmax).astype(q_ref.dtype)
  s_ref[...] = stored


def _per_group_kernel(x_ref, q_ref, s_ref, *, fmax, floor, interpret):
  quantize_groups(load_f32(x_ref), q_ref, s_ref, fmax, floor, interpret)   # x: (r, G)


@functools.partial(jax.jit, static_argnames=("group_size", "out_dtype", "fmax", "floor",
                                             "interpret", "block", "max_ctas", "stages",
                                             "scale_dtype"))
def quantize_per_group(x: jax.Array, *, group_size: int, out_dtype, fmax: float, floor: float,
                       interpret: bool = False, block: int = 128, max_ctas: int = MAX_CTAS,
                       stages: int = 2, scale_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  """Per-group (1 x G) quantize.

  Args:
    x: float (..., N), N % G == 0 (see `supported_per_group`).
    out_dtype: the FP8 storage dtype; fmax its largest finite value; floor the scale's floor;
      scale_dtype: float32 or bfloat16, how the scales are stored (and what x is divided by).
    block: at most this many groups (rows) per pipeline step (64..1024; 128 measured best on the
      H100 for 8192^2 bf16 with G = 16).
    max_ctas, stages: the pipeline's CTA cap and shared-memory slots (rows_mgpu.launch); tunables
      swept by benchmarks/kernels/bench_kernels_mgpu.py --sweep (block, max_ctas, stages likewise
      for the other kernels here).
  Returns:
    (q: out_dtype x.shape, scale: scale_dtype (..., N / G)).
  """
  _check_float(x.dtype, "quantize_per_group")
  if jnp.dtype(scale_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"quantize_per_group: scale_dtype must be float32 or bfloat16, got "
                     f"{jnp.dtype(scale_dtype)}")
  check_problem(rows_problem(x.shape, x.dtype, group_size), "quantize_per_group")
  rows = x.size // group_size
  q, s = _per_group_launch(x.reshape(rows, group_size), out_dtype=jnp.dtype(out_dtype),
                           fmax=float(fmax), floor=float(floor), interpret=interpret, block=block,
                           max_ctas=max_ctas, stages=stages, scale_dtype=jnp.dtype(scale_dtype))
  return q.reshape(x.shape), s.reshape(*x.shape[:-1], x.shape[-1] // group_size)


@shared_trace
def _per_group_launch(x2, *, out_dtype, fmax, floor, interpret, block, max_ctas, stages,
                      scale_dtype):
  rows, group_size = x2.shape
  r = rows_per_block(rows, block)
  big, small = row_blocks(r, group_size)
  return launch(
      functools.partial(_per_group_kernel, fmax=fmax, floor=floor, interpret=interpret),
      inputs=[x2], in_blocks=[big],
      out_shapes=[jax.ShapeDtypeStruct((rows, group_size), out_dtype),
                  jax.ShapeDtypeStruct((rows,), scale_dtype)],
      out_blocks=[big, small], num_blocks=rows // r, interpret=interpret, max_ctas=max_ctas,
      stages=stages, name="coat_quantize_per_group_mgpu")


def load_dequantized(q_ref, s_ref):
  """(r, G) codes times their (r,) group scales: float32 registers in the WGMMA layout."""
  q = load_f32(q_ref)
  s = plgpu.load(s_ref, layout=_WGMMA.reduce(1)).astype(jnp.float32)
  return q * jnp.broadcast_to(s[:, None], q.shape)


def _dequant_kernel(q_ref, s_ref, o_ref):
  o_ref[...] = load_dequantized(q_ref, s_ref).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("group_size", "dtype", "interpret", "block",
                                             "max_ctas", "stages"))
def dequantize_per_group(q: jax.Array, scale: jax.Array, *, group_size: int, dtype=jnp.float32,
                         interpret: bool = False, block: int = 128, max_ctas: int = MAX_CTAS,
                         stages: int = 2) -> jax.Array:
  """x = q * scale per group: q (..., N) FP8, scale float32 or bfloat16 (..., N / G); returns
  `dtype`."""
  check_problem(rows_problem(q.shape, q.dtype, group_size), "dequantize_per_group")
  rows = q.size // group_size
  if scale.size != rows:
    raise ValueError(f"dequantize_per_group: scale of shape {scale.shape} does not hold one value "
                     f"per group of {group_size} of data shape {q.shape}")
  if jnp.dtype(scale.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    scale = scale.astype(jnp.float32)
  [out] = _dequant_launch(q.reshape(rows, group_size), scale.reshape(rows),
                          dtype=jnp.dtype(dtype), interpret=interpret, block=block,
                          max_ctas=max_ctas, stages=stages)
  return out.reshape(q.shape)


@shared_trace
def _dequant_launch(q2, s1, *, dtype, interpret, block, max_ctas, stages):
  rows, group_size = q2.shape
  r = rows_per_block(rows, block)
  big, small = row_blocks(r, group_size)
  return launch(
      _dequant_kernel, inputs=[q2, s1], in_blocks=[big, small],
      out_shapes=[jax.ShapeDtypeStruct((rows, group_size), dtype)],
      out_blocks=[big], num_blocks=rows // r, interpret=interpret, max_ctas=max_ctas,
      stages=stages, name="coat_dequantize_per_group_mgpu")


def _tile_amax_kernel(x_ref, p_ref):
  p_ref[...] = jnp.max(jnp.abs(load_f32(x_ref)), axis=1)


@functools.partial(jax.jit, static_argnames=("interpret", "block", "max_ctas", "stages"))
def tile_amax(x: jax.Array, *, interpret: bool = False, block: int = 128,
              max_ctas: int = MAX_CTAS, stages: int = 2) -> jax.Array:
  """Stage 1 of the two-stage amax: max|x| per 1 x 16 tile, float32 (..., N / 16).

  A tile holding NaN gives NaN, one holding inf (and no NaN) gives inf: the stage-2 max then
  carries them into the tensor's amax (whose scale is NaN, see `group_scale`).
  """
  _check_float(x.dtype, "tile_amax")
  check_problem(rows_problem(x.shape, x.dtype, STAGE1_TILE), "tile_amax")
  rows = x.size // STAGE1_TILE
  [p] = _tile_amax_launch(x.reshape(rows, STAGE1_TILE), interpret=interpret, block=block,
                          max_ctas=max_ctas, stages=stages)
  return p.reshape(*x.shape[:-1], x.shape[-1] // STAGE1_TILE)


@shared_trace
def _tile_amax_launch(x2, *, interpret, block, max_ctas, stages):
  rows = x2.shape[0]
  r = rows_per_block(rows, block)
  big, small = row_blocks(r, STAGE1_TILE)
  return launch(
      _tile_amax_kernel, inputs=[x2], in_blocks=[big],
      out_shapes=[jax.ShapeDtypeStruct((rows,), jnp.float32)], out_blocks=[small],
      num_blocks=rows // r, interpret=interpret, max_ctas=max_ctas, stages=stages,
      name="coat_tile_amax_mgpu")


# ---------------------------------------------------------------------------------------------
# Per tensor: stage 1 (`tile_amax`), stage 2 (a max over N/16 times fewer values, here in jnp),
# then one pass writing q (and with `with_transpose` q of the last two axes swapped).

def scale_from_amax(amax: jax.Array, *, fmax: float, floor: float) -> jax.Array:
  """The per-tensor scale (float32 ()), as the kernels compute per group."""
  return group_scale(amax.astype(jnp.float32), fmax, floor)


def _tensor_kernel(s_ref, x_ref, *refs, fmax, interpret, transpose, cast_dtype, staged):
  """q = sat(x / s) of a (bm, bn) block; with `transpose` also of the block read transposed.
  With cast_dtype, x is first rounded to it (the codes of x.astype(cast_dtype)).

  No reduction here, so the block is loaded in the default (strided, vectorized) layout. The
  transposed copy reads a shared-memory tile through a transposed view (Mosaic GPU has no
  register transpose; storing WGMMA-layout values through a transposed view of the output tile
  failed layout inference on the H100: "Failed to infer a possible set of layouts"): the input
  block itself, or with `staged` (with a cast_dtype: a float32 block's own transposed view fails
  the same way) the block's cast, stored to the last ref (shared-memory scratch) first. The
  pipeline's barrier after each block (`rows_mgpu.launch`) keeps the next block's store from
  overtaking this block's reads.
  """
  out_refs, staging = (refs[:-1], refs[-1]) if staged else (refs, None)
  scale = s_ref[0]
  x = x_ref[...]
  if cast_dtype is not None:
    x = x.astype(cast_dtype)
  x32 = x.astype(jnp.float32)
  q = saturate(true_div(x32, jnp.broadcast_to(scale, x32.shape), interpret), fmax)
  out_refs[0][...] = q.astype(out_refs[0].dtype)
  if transpose:
    src = x_ref
    if staging is not None:
      staging[...] = x
      plgpu.commit_smem()   # every thread's part of the tile stored before any reads across
      src = staging
    # A strided-layout load of the transposed view fails verification ("'vector.load' op most
    # minor memref dim must have unit stride"); the WGMMA layout, unoptimized, loads it.
    xt_ref = src.transpose((1, 0))
    xt = plgpu.load(xt_ref, layout=_WGMMA, optimized=False).astype(jnp.float32)
    qt = saturate(true_div(xt, jnp.broadcast_to(scale, xt.shape), interpret), fmax)
    out_refs[1][...] = qt.astype(out_refs[1].dtype)


# The per-tensor quantize's CTA cap (two per SM of an H100 or H200), with its 64 x 128 blocks: the
# fastest setting at OLMo-1B's activation and weight shapes in sweeps timed by the GPU's own clock
# (docs/kernels.md, "The quantize kernels").
PER_TENSOR_MAX_CTAS = 132 * 2


@functools.partial(jax.jit, static_argnames=("out_dtype", "fmax", "floor", "with_transpose",
                                             "cast_dtype", "interpret", "block_rows",
                                             "block_cols", "max_ctas", "stages"))
def quantize_per_tensor(x: jax.Array, *, out_dtype, fmax: float, floor: float,
                        amax: jax.Array | None = None, scale: jax.Array | None = None,
                        with_transpose: bool = False, cast_dtype=None,
                        interpret: bool = False, block_rows: int | None = None,
                        block_cols: int | None = None, max_ctas: int | None = None,
                        stages: int = 2) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Per-tensor quantize with the two-stage amax (stage 1 skipped when `amax` is given; with
  `scale` given, float32 (), that scale is used as it is and `amax` is ignored).

  cast_dtype: quantize x.astype(cast_dtype) (e.g. a float32 weight's bfloat16 compute copy)
  without writing that cast: the kernel reads x and rounds it as it loads. The amax (given, or
  found) is rounded to cast_dtype here: max|x| rounded is max|x.astype(cast_dtype)| (rounding is
  monotonic), and either may be given.

  Blocks (block_rows x block_cols) default to 64 x 128, max_ctas (the CTA cap) to
  PER_TENSOR_MAX_CTAS.
  Returns:
    (q: out_dtype x.shape, scale: float32 (), q_t: out_dtype with the last two axes swapped, or
    None without `with_transpose`).
  """
  _check_float(x.dtype, "quantize_per_tensor")
  cast_dtype = None if cast_dtype is None or jnp.dtype(cast_dtype) == x.dtype else jnp.dtype(
      cast_dtype)
  if not supported_per_tensor(x.shape, x.dtype, with_transpose, cast_dtype):
    need = ("ndim >= 2, the last two axes multiples of 64 and a 16-bit dtype (or cast_dtype)"
            if with_transpose else
            "the last axis a multiple of 64 and size / 64 a positive multiple of 64")
    raise ValueError(f"quantize_per_tensor: shape {x.shape} of {x.dtype} unsupported (needs "
                     f"{need})")
  if scale is None:
    if amax is None:
      amax = jnp.max(tile_amax(x, interpret=interpret, max_ctas=max_ctas or MAX_CTAS,  # + stage 2
                               stages=stages))                            # (jnp.max: NaN stays)
    if cast_dtype is not None:
      amax = jnp.asarray(amax).astype(cast_dtype)
    scale = scale_from_amax(amax, fmax=fmax, floor=floor)
  scale = jnp.asarray(scale, jnp.float32).reshape(())
  if with_transpose:
    x3 = x.reshape(-1, *x.shape[-2:])
  else:
    width = 128 if x.shape[-1] % 128 == 0 and (x.size // 128) % ROW_QUANTUM == 0 else 64
    x3 = x.reshape(1, -1, width)              # any row view will do without the transpose
  outs = _per_tensor_launch(
      scale.reshape(1), x3, out_dtype=jnp.dtype(out_dtype), fmax=float(fmax),
      with_transpose=with_transpose, cast_dtype=cast_dtype, interpret=interpret,
      block_rows=block_rows or 64, block_cols=block_cols or 128,
      max_ctas=max_ctas or PER_TENSOR_MAX_CTAS, stages=stages)
  q = outs[0].reshape(x.shape)
  q_t = (outs[1].reshape(*x.shape[:-2], x.shape[-1], x.shape[-2]) if with_transpose else None)
  return q, scale, q_t


@shared_trace
def _per_tensor_launch(scale, x3, *, out_dtype, fmax, with_transpose, cast_dtype, interpret,
                       block_rows, block_cols, max_ctas, stages):
  b, m, n = x3.shape
  bm = rows_per_block(m, block_rows)
  bn = max(d for d in (256, 128, 64) if d <= max(block_cols, 64) and n % d == 0)
  gi, gj = m // bm, n // bn
  kij = lambda blk: (blk // (gi * gj), (blk // gj) % gi, blk % gj)    # block id -> (k, i, j)
  where = lambda blk: (lambda k, i, j: (k, pl.ds(i * bm, bm), pl.ds(j * bn, bn)))(*kij(blk))
  out_blocks = [((None, bm, bn), where)]
  out_shapes = [jax.ShapeDtypeStruct((b, m, n), out_dtype)]
  if with_transpose:
    out_blocks.append(((None, bn, bm), lambda blk: (
        lambda k, i, j: (k, pl.ds(j * bn, bn), pl.ds(i * bm, bm)))(*kij(blk))))
    out_shapes.append(jax.ShapeDtypeStruct((b, n, m), out_dtype))
  # With a cast, the transposed copy is read from the block's 16-bit cast, staged in shared
  # memory (a float32 block's own transposed view fails Mosaic GPU's layout inference).
  staged = with_transpose and cast_dtype is not None
  return launch(
      functools.partial(_tensor_kernel, fmax=fmax, interpret=interpret,
                        transpose=with_transpose, cast_dtype=cast_dtype, staged=staged),
      scalars=[scale], inputs=[x3], in_blocks=[((None, bm, bn), where)],
      out_shapes=out_shapes, out_blocks=out_blocks, num_blocks=b * gi * gj,
      interpret=interpret, max_ctas=max_ctas, stages=stages,
      body_scratch=[plgpu.SMEM((bm, bn), cast_dtype)] if staged else (),
      name="coat_quantize_per_tensor_mgpu")
