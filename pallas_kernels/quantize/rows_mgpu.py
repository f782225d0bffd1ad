"""One launcher for the Mosaic GPU memory-bound kernels: a pipelined walk over row blocks.

`launch` runs `body` once per block of a list of blocks: `plgpu.kernel` starts `ctas` CTAs (one
warpgroup each, operands left in GMEM); each takes a contiguous run of num_blocks / ctas blocks and
streams them through two shared-memory slots with TMA copies (the next block's loads overlap this
block's math and the previous block's stores; `stages` slots, 2 by default). `body(*scalar_refs, *in_smem, *out_smem,
*scratch)` sees the scalar operands as GMEM refs (read with ref[i]) and the blocks as SMEM refs.

Pallas GPU interpret mode (`interpret=True` here: `plgpu.InterpretGPUParams()`) runs the same
kernel on CPU. It refuses what the usual routes emit: `pallas_call` BlockSpecs with non-trivial
windows (AssertionError in interpret_pallas_call: `bm.has_trivial_window()`) and
`plgpu.emit_pipeline`'s predicated stores (NotImplementedError: "predicate not supported" in
copy_smem_to_gmem); hence this hand-written two-slot pipeline.
Imports jax and numpy only.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROW_QUANTUM = 64     # the WGMMA register layout tiles rows by 64 (one warpgroup)
MAX_CTAS = 132 * 4   # H100: 132 SMs; several small-block CTAs per SM hide latency
# (block shape, block id -> the GMEM ref's index: a tuple of ints / pl.ds; None dims are squeezed)
Block = tuple[tuple, Callable[[jax.Array], tuple]]


def num_ctas(num_blocks: int, max_ctas: int = MAX_CTAS) -> int:
  """The largest divisor of num_blocks that is <= max_ctas (every CTA gets as many blocks)."""
  for c in range(min(num_blocks, max_ctas), 0, -1):
    if num_blocks % c == 0:
      return c
  return 1


def launch(body, *, scalars: Sequence[jax.Array] = (), inputs: Sequence[jax.Array],
           in_blocks: Sequence[Block], out_shapes: Sequence[jax.ShapeDtypeStruct],
           out_blocks: Sequence[Block], num_blocks: int, name: str, interpret: bool = False,
           max_ctas: int = MAX_CTAS, stages: int = 2,
           out_in_place: dict[int, int] | None = None, body_scratch: Sequence = ()) -> list[jax.Array]:
  """Runs `body` over `num_blocks` blocks; returns the outputs (a list, as out_shapes).

  out_in_place: {output index: input index}: that output's block is written into the input's
    shared-memory buffer (same block shape and dtype) and stored from there, saving its buffer.
    Those stores must then finish reading before the next block's loads reuse the slot.
  body_scratch: extra shared-memory buffers (plgpu.SMEM(...)) passed to `body` after the
    outputs, allocated once per CTA. Each block's `body` is followed by `plgpu.commit_smem()` (a
    fence and a barrier of the CTA's warpgroup), so a body may overwrite a scratch buffer that
    the previous block's body read.

  Each CTA cycles through `stages` shared-memory slots (2: double buffering): blocks s+1 ..
  s+stages-1 are loaded while block s is computed, and up to stages-1 steps' stores drain while
  later blocks are computed (`wait_smem_to_gmem(stages - 1)` before a slot's buffers are reused).
  max_ctas caps the CTAs (the grid); both are tunables
  (benchmarks/kernels/bench_kernels_mgpu.py --sweep).
  """
  if stages < 2:
    raise ValueError(f"launch: stages must be >= 2, got {stages}")
  ctas = num_ctas(num_blocks, max_ctas)
  steps = num_blocks // ctas
  n_scalars = len(scalars)

  n_in, n_out = len(inputs), len(out_shapes)
  in_place = dict(out_in_place or {})
  for j, i in in_place.items():
    if (tuple(out_blocks[j][0]) != tuple(in_blocks[i][0])
        or jnp.dtype(out_shapes[j].dtype) != jnp.dtype(inputs[i].dtype)):
      raise ValueError(f"launch: output {j} cannot be written in place of input {i} (block "
                       f"shape or dtype differ)")

  def kernel(*refs):
    pl.run_scoped(lambda *scratch_refs: pipeline(*refs, *scratch_refs), *scratch)

  def pipeline(*refs):
    scalar_refs = refs[:n_scalars]
    in_gmem = refs[n_scalars:n_scalars + n_in]
    out_gmem = refs[n_scalars + n_in:n_scalars + n_in + n_out]
    in_smem = refs[n_scalars + n_in + n_out:n_scalars + 2 * n_in + n_out]
    n_own = n_out - len(in_place)
    own_out = iter(refs[n_scalars + 2 * n_in + n_out:n_scalars + 2 * n_in + n_out + n_own])
    out_smem = [in_smem[in_place[j]] if j in in_place else next(own_out) for j in range(n_out)]
    extra = refs[n_scalars + 2 * n_in + n_out + n_own:-1]
    barriers = refs[-1]                                   # (stages, n_in): slot x input
    first = lax.axis_index("cta") * steps

    def fetch(step, slot):
      blk = first + step
      for g, buf, (_, index), i in zip(in_gmem, in_smem, in_blocks, range(n_in)):
        plgpu.copy_gmem_to_smem(g.at[index(blk)], in_views[i](buf, slot), barriers.at[slot, i])

    for ahead in range(min(stages - 1, steps)):
      fetch(ahead, ahead)

    @pl.loop(0, steps)
    def _(step):
      slot = step % stages
      if in_place:   # the previous block's in-place stores read the slot about to be refilled
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      @pl.when(step + stages - 1 < steps)
      def _():
        fetch(step + stages - 1, (step + stages - 1) % stages)

      for i in range(n_in):
        plgpu.barrier_wait(barriers.at[slot, i])
      # The stores issued `stages` steps ago read this slot's output buffers: let them finish.
      plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)
      body(*scalar_refs, *[v(b, slot) for v, b in zip(in_views, in_smem)],
           *[v(b, slot) for v, b in zip(out_views, out_smem)], *extra)
      plgpu.commit_smem()
      blk = first + step
      for j, (g, buf, (_, index)) in enumerate(zip(out_gmem, out_smem, out_blocks)):
        plgpu.copy_smem_to_gmem(out_views[j](buf, slot), g.at[index(blk)],
                                commit_group=j == n_out - 1)

    plgpu.wait_smem_to_gmem(0)

  def squeeze(shape):
    return tuple(d for d in shape if d is not None)

  def slot_buffer(shape, dtype):
    """SMEM (stages, *block) buffer whose slots start 128-byte aligned (TMA wants aligned shared
    memory: 64-byte uint8 slots gave CUDA_ERROR_MISALIGNED_ADDRESS on the H100), and a view of
    one slot's block."""
    shape = squeeze(shape)
    nbytes = math.prod(shape) * jnp.dtype(dtype).itemsize
    if len(shape) == 1 and nbytes % 128:
      padded = shape[0] * (128 // math.gcd(nbytes, 128))
      return (plgpu.SMEM((stages, padded), dtype),
              lambda buf, slot: buf.at[slot, pl.ds(0, shape[0])])
    return plgpu.SMEM((stages, *shape), dtype), lambda buf, slot: buf.at[slot]

  in_bufs = [slot_buffer(sh, x.dtype) for (sh, _), x in zip(in_blocks, inputs)]
  out_bufs = [slot_buffer(sh, o.dtype) for j, ((sh, _), o) in enumerate(zip(out_blocks, out_shapes))
              if j not in in_place]
  scratch = [b for b, _ in in_bufs] + [b for b, _ in out_bufs] + list(body_scratch) + [
      plgpu.Barrier(num_barriers=(stages, max(n_in, 1)))]
  in_views = [v for _, v in in_bufs]
  own_views = iter([v for _, v in out_bufs])
  out_views = [in_views[in_place[j]] if j in in_place else next(own_views) for j in range(n_out)]
  # plgpu.kernel (a mesh of CTAs, operands left in GMEM) rather than pallas_call with a grid:
  # GPU interpret mode wrote only the first CTA's outputs of a multi-CTA pallas_call.
  call = plgpu.kernel(
      kernel, out_type=tuple(out_shapes), grid=(ctas,), grid_names=("cta",),
      compiler_params=plgpu.CompilerParams(),
      interpret=plgpu.InterpretGPUParams() if interpret else None, kernel_name=name)
  return list(call(*scalars, *inputs))

