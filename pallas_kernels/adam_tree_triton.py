"""The fused COAT AdamW step over many parameters in a few launches (Triton through jax-triton).

The step per leaf is adam_step_triton's (`adam_rows`: one program = BLOCK rows of G); here one
launch runs it over up to `max_leaves` leaves. Program ids are laid out leaf after leaf by a
static prefix sum of the leaves' row-block counts (`plan`):

  leaf j owns program ids [start_j, start_j + ceil(rows_j / BLOCK)),  start_0 = 0,
  start_{j+1} = start_j + ceil(rows_j / BLOCK);   grid = start_n.

The generated kernel (`_kernel_source`) finds a program's leaf by a binary search of the program
id over these constants (ceil(log2 n) uniform branches), which set the leaf's pointers, row count
and decay flag, and runs `adam_rows` once, on that leaf's own buffers: leaves of any shapes share
a launch (one launch per set of dtypes) and no leaf is copied or packed. Every leaf passes 15
pointers (8 inputs, 7 outputs); a CUDA kernel's parameters had to fit in 4 KB before CUDA 12.1, so
a launch takes at most MAX_LEAVES leaves (`plan` splits longer trees into evenly sized launches:
62 leaves -> 2 launches of 31).

Why: leaf by leaf, a 62-leaf 1.21e9-parameter tree paid ~0.85 ms of kernel time more than one leaf
of the same size (62 launches, each with a partly idle last wave of blocks) and 62 custom calls on
the host. Needs triton >= 3.6 and jax-triton (GPU only); imports jax, numpy and triton only.
"""
from __future__ import annotations

import functools
import linecache
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import adam_step_triton as single
from pallas_kernels import call_triton
from pallas_kernels.adam_operands import check_operands

try:  # GPU machines only (the kernel itself needs only triton: it compiles without a GPU)
  import triton
  import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines
  triton = tl = None

POINTERS_PER_LEAF = 15          # in: p, g, m (data, amax, code), v (3); out: out, m (3), v (3)
PARAM_BYTES = 4096              # classic CUDA kernel-parameter limit
RESERVED_BYTES = 64             # scalars pointer + Triton's hidden scratch pointers, with margin
MAX_LEAVES = (PARAM_BYTES - RESERVED_BYTES) // (8 * POINTERS_PER_LEAF)   # 33


def available() -> bool:
  """True when the kernel can be called (triton and jax-triton import: GPU machines)."""
  return single.available()


supported = single.supported
problem = single.problem


class Launch(NamedTuple):
  """One launch: the leaves (indices into the caller's list), their row counts, and the prefix
  sum of their row-block counts (starts[j] = first program id of leaf j; starts[-1] = grid)."""
  leaves: tuple[int, ...]
  rows: tuple[int, ...]
  starts: tuple[int, ...]


def plan(rows, block: int, max_leaves: int = MAX_LEAVES, keys=None) -> list[Launch]:
  """Launches for leaves of `rows[i]` rows (each > 0): leaves with equal `keys[i]` (e.g. their
  dtypes) in order, cut into ceil(n / max_leaves) launches of near-equal leaf counts."""
  if block < 1 or max_leaves < 1:
    raise ValueError(f"adam_tree_triton.plan: block ({block}) and max_leaves ({max_leaves}) "
                     "must be >= 1")
  if any(int(r) < 1 for r in rows):
    raise ValueError(f"adam_tree_triton.plan: every leaf needs >= 1 row, got {list(rows)}")
  keys = [None] * len(rows) if keys is None else list(keys)
  groups: dict = {}
  for i, k in enumerate(keys):
    groups.setdefault(k, []).append(i)
  out = []
  for members in groups.values():
    n_launch = math.ceil(len(members) / max_leaves)
    size = math.ceil(len(members) / n_launch)
    for c in range(0, len(members), size):
      chunk = tuple(members[c:c + size])
      r = tuple(int(rows[i]) for i in chunk)
      starts = tuple(int(x) for x in np.concatenate([[0], np.cumsum([-(-x // block) for x in r])]))
      out.append(Launch(chunk, r, starts))
  return out


_IN = ("p", "g", "mq", "ma", "mk", "vq", "va", "vk")
_OUT = ("o", "mqo", "mao", "mko", "vqo", "vao", "vko")
_STATIC = ("G", "BLOCK", "HAS_PARAM", "OUT_PARAM", "M_FMAX", "V_FMAX", "M_LOG2R", "V_LOG2R",
           "EXPAND", "EM", "MAX_K", "FLOOR", "NOEXP_K", "FAST", "GCLAMP")


def _kernel_source(rows: tuple[int, ...], starts: tuple[int, ...],
                   decay: tuple[bool, ...]) -> str:
  """Python source of the launch's Triton kernel: program id -> (leaf, row block) by a binary
  search over the constants of `plan` (nested ifs: ceil(log2 n) uniform branches per program),
  which sets the leaf's pointers, row count, first program id and decay flag; then one
  `adam_rows` on them."""
  n = len(rows)
  names = _IN + _OUT
  args = ["s_ptr"] + [f"{a}{j}" for j in range(n) for a in _IN] + \
         [f"{a}{j}" for j in range(n) for a in _OUT] + [f"{c}: tl.constexpr" for c in _STATIC]
  lines = [f"def adam_tree_kernel({', '.join(args)}):", "  pid = tl.program_id(0)",
           "  zero = pid * 0"]

  def select(j, pad):
    lines.extend([f"{pad}start = zero + {starts[j]}", f"{pad}rows = zero + {rows[j]}",
                  f"{pad}decay = zero + {int(decay[j])}",
                  pad + "; ".join(f"{a} = {a}{j}" for a in names)])

  def search(lo, hi, pad):   # leaves lo .. hi - 1
    if hi - lo == 1:
      select(lo, pad)
      return
    mid = (lo + hi) // 2
    lines.append(f"{pad}if pid < {starts[mid]}:")
    search(lo, mid, pad + "  ")
    lines.append(f"{pad}else:")
    search(mid, hi, pad + "  ")

  select(0, "  ")   # every name defined before the branches (Triton yields reassigned names)
  if n > 1:
    search(0, n, "  ")
  lines.append(f"  adam_rows(pid - start, rows, tl.load(s_ptr + 6) * decay.to(tl.float32), "
               f"s_ptr, {', '.join(names)}, {', '.join(_STATIC)})")
  return "\n".join(lines) + "\n"


@functools.cache
def _kernel(rows: tuple[int, ...], starts: tuple[int, ...], decay: tuple[bool, ...]):
  """The launch's @triton.jit kernel, built once per table (Triton reads a kernel's source:
  it is registered with linecache under a name unique to the table)."""
  if triton is None:
    raise ValueError("adam_tree_triton: triton is not installed (GPU only)")
  src = _kernel_source(rows, starts, decay)
  name = f"<adam_tree_triton {abs(hash((rows, starts, decay))):x}>"
  linecache.cache[name] = (len(src), None, src.splitlines(True), name)
  scope = {"tl": tl, "adam_rows": single.adam_rows}
  exec(compile(src, name, "exec"), scope)
  return triton.jit(scope["adam_tree_kernel"])


def tree_step(params, grads, m_states, v_states, decay, *, lr, b1, b2, eps, weight_decay, count,
              m_fmax: float, v_fmax: float, m_log2_range: float, v_log2_range: float,
              group_size: int, expand: bool, expand_min: int, max_k_code: int = 255,
              amax_floor: float = 1e-30, output: str = "param", block: int = 16,
              num_warps: int = 4, alias: bool = True, fast_math: bool = True,
              grad_clamp: float = float("inf"), max_leaves: int = MAX_LEAVES, grad_scale=None):
  """adam_step_triton.adam_step on every leaf, in ceil(n / max_leaves) launches (per dtype set).

  params, grads: lists of arrays (params entries None only with output="update": no decay);
  m_states, v_states: lists of (data, amax, code) triples; decay: list of bools (weight decay on
  that leaf). Other arguments as adam_step_triton.adam_step (one set for all leaves, grad_scale
  included: one scale for the whole tree, in the step scalars `adam_rows` reads). Returns a
  list of (out, (m data, amax, code), (v data, amax, code)) per leaf.
  """
  if not available():
    raise ValueError("adam_tree_triton: triton / jax-triton are not installed (GPU only)")
  n = len(grads)
  if not (len(params) == len(m_states) == len(v_states) == len(decay) == n):
    raise ValueError(f"adam_tree_triton: {len(params)} params, {n} grads, {len(m_states)} / "
                     f"{len(v_states)} moments and {len(decay)} decay flags: lengths must agree")
  metas = []
  for p, g, m, v in zip(params, grads, m_states, v_states):
    like, meta_shape = check_operands("adam_tree_triton", p, g, *m, *v, group_size=group_size,
                                      output=output, problem=single.problem)
    metas.append((like, meta_shape))
  keys = [(p is None, jnp.dtype(l.dtype), jnp.dtype(g.dtype), jnp.dtype(m[0].dtype),
           jnp.dtype(v[0].dtype)) for p, g, m, v, (l, _) in zip(params, grads, m_states, v_states,
                                                                metas)]
  rows = [like.size // group_size for like, _ in metas]
  scalars = single.step_scalars(lr, b1, b2, eps, weight_decay, count, grad_scale)
  static = dict(G=group_size, BLOCK=block, OUT_PARAM=output == "param", M_FMAX=float(m_fmax),
                V_FMAX=float(v_fmax), M_LOG2R=float(np.float32(m_log2_range)),
                V_LOG2R=float(np.float32(v_log2_range)), EXPAND=bool(expand),
                EM=float(expand_min), MAX_K=float(max_k_code),
                FLOOR=float(np.float32(amax_floor)),
                NOEXP_K=float(min(expand_min, max_k_code)), FAST=bool(fast_math),
                GCLAMP=float(grad_clamp))
  results = [None] * n
  for launch in plan(rows, block, max_leaves, keys):
    has_param = params[launch.leaves[0]] is not None
    operands, out_shapes, aliases = [scalars], [], {}
    for j, i in enumerate(launch.leaves):
      like, meta_shape = metas[i]
      g, m, v = grads[i], m_states[i], v_states[i]
      base = len(operands)
      operands += [g if params[i] is None else params[i], g, *m, *v]
      out_dtype = g.dtype if output == "update" else params[i].dtype
      out_shapes += [jax.ShapeDtypeStruct(like.shape, out_dtype),
                     jax.ShapeDtypeStruct(like.shape, m[0].dtype),
                     jax.ShapeDtypeStruct(meta_shape, jnp.float32),
                     jax.ShapeDtypeStruct(meta_shape, jnp.uint8),
                     jax.ShapeDtypeStruct(like.shape, v[0].dtype),
                     jax.ShapeDtypeStruct(meta_shape, jnp.float32),
                     jax.ShapeDtypeStruct(meta_shape, jnp.uint8)]
      if alias:
        if output == "param":
          aliases[base] = 7 * j
        aliases.update({base + 2 + k: 7 * j + 1 + k for k in range(6)})
    kernel = _kernel(launch.rows, launch.starts,
                     tuple(bool(decay[i]) and has_param for i in launch.leaves))
    outs = call_triton.triton_call(
        *operands, kernel=kernel, out_shape=out_shapes, grid=(launch.starts[-1],),
        input_output_aliases=aliases, num_warps=num_warps, num_stages=1,
        HAS_PARAM=has_param, **static)
    for j, i in enumerate(launch.leaves):
      o = outs[7 * j:7 * j + 7]
      results[i] = (o[0], tuple(o[1:4]), tuple(o[4:7]))
  return results
