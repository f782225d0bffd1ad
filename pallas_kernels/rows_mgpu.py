"""One launcher for the Mosaic GPU memory-bound kernels: a pipelined walk over row blocks.

`launch` runs `body` once per block of a list of blocks: `plgpu.kernel` starts `ctas` CTAs (one
warpgroup each, operands left in GMEM); each takes a contiguous run of num_blocks / ctas blocks and
streams them through two shared-memory slots with TMA copies (the next block's loads overlap this
block's math and the previous block's stores). `body(*scalar_refs, *in_smem,
*out_smem)` sees the scalar operands as GMEM refs (read with ref[i]) and the blocks as SMEM refs.

Pallas GPU interpret mode (`interpret=True` here: `plgpu.InterpretGPUParams()`) runs the same
kernel on CPU. It refuses what the usual routes emit: `pallas_call` BlockSpecs with non-trivial
windows (AssertionError in interpret_pallas_call: `bm.has_trivial_window()`) and
`plgpu.emit_pipeline`'s predicated stores (NotImplementedError: "predicate not supported" in
copy_smem_to_gmem); hence this hand-written two-slot pipeline.
Imports jax and numpy only.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

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
           max_ctas: int = MAX_CTAS) -> list[jax.Array]:
  """Runs `body` over `num_blocks` blocks; returns the outputs (a list, as out_shapes).

  Each CTA double-buffers: block s+1 is loaded while block s is computed, and block s's stores
  drain while block s+1 is computed (`wait_smem_to_gmem(1)` before a slot's buffers are reused).
  """
  ctas = num_ctas(num_blocks, max_ctas)
  steps = num_blocks // ctas
  n_scalars = len(scalars)

  n_in, n_out = len(inputs), len(out_shapes)

  def kernel(*refs):
    pl.run_scoped(lambda *scratch_refs: pipeline(*refs, *scratch_refs), *scratch)

  def pipeline(*refs):
    scalar_refs = refs[:n_scalars]
    in_gmem = refs[n_scalars:n_scalars + n_in]
    out_gmem = refs[n_scalars + n_in:n_scalars + n_in + n_out]
    in_smem = refs[n_scalars + n_in + n_out:n_scalars + 2 * n_in + n_out]
    out_smem = refs[n_scalars + 2 * n_in + n_out:-1]
    barriers = refs[-1]                                   # (2, n_in): slot x input
    first = lax.axis_index("cta") * steps

    def fetch(step, slot):
      blk = first + step
      for g, buf, (_, index), i in zip(in_gmem, in_smem, in_blocks, range(n_in)):
        plgpu.copy_gmem_to_smem(g.at[index(blk)], buf.at[slot], barriers.at[slot, i])

    fetch(0, 0)

    @pl.loop(0, steps)
    def _(step):
      slot = step % 2

      @pl.when(step + 1 < steps)
      def _():
        fetch(step + 1, 1 - slot)

      for i in range(n_in):
        plgpu.barrier_wait(barriers.at[slot, i])
      # The stores issued two steps ago read this slot's output buffers: let them finish.
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      body(*scalar_refs, *[b.at[slot] for b in in_smem], *[b.at[slot] for b in out_smem])
      plgpu.commit_smem()
      blk = first + step
      for j, (g, buf, (_, index)) in enumerate(zip(out_gmem, out_smem, out_blocks)):
        plgpu.copy_smem_to_gmem(buf.at[slot], g.at[index(blk)], commit_group=j == n_out - 1)

    plgpu.wait_smem_to_gmem(0)

  def squeeze(shape):
    return tuple(d for d in shape if d is not None)

  scratch = ([plgpu.SMEM((2, *squeeze(sh)), x.dtype) for (sh, _), x in zip(in_blocks, inputs)]
             + [plgpu.SMEM((2, *squeeze(sh)), o.dtype) for (sh, _), o in zip(out_blocks,
                                                                             out_shapes)]
             + [plgpu.Barrier(num_barriers=(2, max(n_in, 1)))])
  # plgpu.kernel (a mesh of CTAs, operands left in GMEM) rather than pallas_call with a grid:
  # GPU interpret mode wrote only the first CTA's outputs of a multi-CTA pallas_call.
  call = plgpu.kernel(
      kernel, out_type=tuple(out_shapes), grid=(ctas,), grid_names=("cta",),
      compiler_params=plgpu.CompilerParams(),
      interpret=plgpu.InterpretGPUParams() if interpret else None, kernel_name=name)
  return list(call(*scalars, *inputs))


def pad_scalars(values: Sequence, size: int = 16) -> jax.Array:
  """float32 (size,) vector of scalars (TMA and SMEM want >= 16-byte operands)."""
  vals = [jnp.asarray(v, jnp.float32).reshape(()) for v in values]
  vals += [jnp.float32(0.0)] * (size - len(vals))
  return jnp.stack(vals)
