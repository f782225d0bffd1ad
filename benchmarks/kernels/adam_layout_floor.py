"""The FP8 Adam step's two group layouts against their memory patterns (GPU with jax-triton).

(1) The memory pattern alone: the step's bytes (read a float32 param and gradient and two 1-byte
codes, write the param and codes, in place) streamed with no math in the row kernel's blocks
(16 rows of 128 contiguous elements per program) and in the column kernel's tiles (128 rows x
BLOCK columns of a (rows, cols) leaf, column tiles of one row group in neighbouring programs);
(2) coat_adamw_apply with each group axis, with and without expansion (no per-element log2 /
exp2 in the moments). 62 leaves (56 x 4096^2 + 6 x 4096 x 11008, 1.21e9 params); GPU kernel ms
per step from the profiler, best of 3.

  python3 -m benchmarks.kernels.adam_layout_floor
"""
import tempfile

import jax
import jax.numpy as jnp
import jax_triton as jt
import triton
import triton.language as tl

from benchmarks._common import OPTIMIZER_SHAPES as SHAPES, kernel_times
from coat_jax import kernels
from coat_jax.optim import coat_adamw, coat_adamw_apply

STREAMS = [("rows", 16, 4, 0), ("cols", 32, 8, 4), ("cols", 32, 4, 4), ("cols", 64, 8, 4),
           ("cols", 128, 8, 4), ("cols", 32, 8, 0), ("cols", 128, 8, 0)]


@triton.jit
def rows_stream(p_ptr, g_ptr, m_ptr, v_ptr, po_ptr, mo_ptr, vo_ptr, BLOCK: tl.constexpr):
  offs = (tl.program_id(0).to(tl.int64) * (BLOCK * 128) + tl.arange(0, BLOCK)[:, None] * 128
          + tl.arange(0, 128)[None, :])
  tl.store(po_ptr + offs, tl.load(p_ptr + offs) + tl.load(g_ptr + offs))
  tl.store(mo_ptr + offs, tl.load(m_ptr + offs) ^ 1)
  tl.store(vo_ptr + offs, tl.load(v_ptr + offs) ^ 1)


@triton.jit
def cols_stream(p_ptr, g_ptr, m_ptr, v_ptr, cols, po_ptr, mo_ptr, vo_ptr, BLOCK: tl.constexpr,
                VEC: tl.constexpr):
  blk = tl.program_id(0)
  nc = tl.cdiv(cols, BLOCK)
  grp = blk // nc
  cols_idx = (blk % nc) * BLOCK + tl.arange(0, BLOCK)
  start = grp.to(tl.int64) * (128 * cols)
  offs = start + tl.arange(0, 128)[:, None] * cols + cols_idx[None, :]
  if VEC > 0:
    offs = tl.max_contiguous(offs, [1, VEC])
  tl.store(po_ptr + offs, tl.load(p_ptr + offs) + tl.load(g_ptr + offs))
  tl.store(mo_ptr + offs, tl.load(m_ptr + offs) ^ 1)
  tl.store(vo_ptr + offs, tl.load(v_ptr + offs) ^ 1)


def stream_step(kind, block, warps, vec=4):
  """jit(leaves p, g, m, v -> p + g, m ^ 1, v ^ 1), one launch per leaf, p / m / v in place."""
  def one(p, g, m, v):
    shp = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (p, m, v)]
    alias = {0: 0, 2: 1, 3: 2}
    if kind == "rows":
      return jt.triton_call(p, g, m, v, kernel=rows_stream, out_shape=shp,
                            grid=(p.size // (128 * block),), num_warps=warps, BLOCK=block,
                            input_output_aliases=alias)
    cols = p.shape[-1]
    return jt.triton_call(p, g, m, v, cols, kernel=cols_stream, out_shape=shp,
                          grid=(p.size // (128 * cols) * (cols // block),), num_warps=warps,
                          BLOCK=block, VEC=vec, input_output_aliases=alias)
  return jax.jit(lambda ps, gs, ms, vs: list(zip(*[one(*a) for a in zip(ps, gs, ms, vs)])),
                 donate_argnums=(0, 2, 3))


def profiled(step, args, nxt, reps=3):
  """Best GPU kernel ms of `reps` profiled calls after one warm-up; nxt(out) = next args."""
  out = jax.block_until_ready(step(*args))
  args = nxt(out)
  best = 1e9
  for _ in range(reps):
    with tempfile.TemporaryDirectory() as d:
      with jax.profiler.trace(d):
        out = jax.block_until_ready(step(*args))
      best = min(best, sum(kernel_times(d).values()) / 1e3)
    args = nxt(out)
  return best


def main():
  keys = jax.random.split(jax.random.key(0), len(SHAPES))
  n = sum(r * c for r, c in SHAPES)
  rows = []
  for kind, block, warps, vec in STREAMS:
    ps = [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, SHAPES)]
    gs = [p * 0.01 for p in ps]
    ms = [jnp.ones(s, jnp.uint8) for s in SHAPES]
    vs = [jnp.ones(s, jnp.uint8) for s in SHAPES]
    t = profiled(stream_step(kind, block, warps, vec), (ps, gs, ms, vs),
                 lambda o, gs=gs: (list(o[0]), gs, list(o[1]), list(o[2])))
    rows.append((f"stream {kind} block {block} warps {warps} vec {vec}", t))
    print(rows[-1], flush=True)
    del ps, gs, ms, vs
  params = {f"p{i:02d}": jax.random.normal(k, s, jnp.float32) * 0.02
            for i, (k, s) in enumerate(zip(keys, SHAPES))}
  grads = jax.tree.map(lambda p: p * 0.05, params)
  for axis, expand in [(-1, True), (-1, False), (-2, True), (-2, False)]:
    axes = jax.tree.map(lambda _: axis, params)
    group_axis = (lambda p: axes) if axis == -2 else "last"
    with kernels.backend("adam=pallas"):
      state = jax.jit(coat_adamw(1e-3, group_axis=group_axis, expand=expand).init)(params)
      step = jax.jit(coat_adamw_apply(1e-3, group_axis=group_axis, expand=expand),
                     donate_argnums=(1, 2))
      t = profiled(step, (grads, state, jax.tree.map(jnp.copy, params)),
                   lambda o: (grads, o[1], o[0]))
    rows.append((f"coat_adamw_apply group_axis {axis} expand {expand}", t))
    print(rows[-1], flush=True)
  print("\n| what | GPU kernel ms | TB/s at 16.16 B/param |\n|---|---|---|")
  for name, t in rows:
    print(f"| {name} | {t:.3f} | {16.16 * n / (t * 1e-3) / 1e12:.3f} |")


if __name__ == "__main__":
  main()
