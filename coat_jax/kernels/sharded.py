"""Row kernels on sharded arrays: each device runs the Pallas kernel on its local shard.

A `pallas_call` has no sharding rule: inside a sharded jax.jit, XLA would gather its operands onto
every device. `rowwise` wraps a row kernel in `jax.experimental.custom_partitioning`, so the SPMD
partitioner hands each device its local block and the kernel runs there, no collective added.

Row kernels (per-group quantize / dequantize, the stage-1 tile maxima, the fused Adam step) work
on groups of G consecutive elements along the last axis. Their operands are of three kinds:
  "data"   (..., N)      the tensor (x, q, param, grad, moment data);
  "meta"   (..., N / G)  one value per group (scales, amax, k_code);
  "scalar" any shape     replicated (step scalars, a per-tensor scale).
Every "data" and "meta" operand and result gets the first "data" operand's sharding on the
leading axes; the last axis keeps its sharding when each shard holds whole groups (N / shards
divisible by G: `whole_groups`). So per-group results never depend on the mesh: a group never
straddles a shard boundary. Known limit: an input whose last axis is split so that shards cut groups fails in XLA's
partitioner (Shardy splits the mesh axis across the group factor before `partition` can ask for
the axis whole); `coat_jax.optim_state.state_shardings` therefore names any parameter whose split
would do that, and activation splits (hidden / tensor) are multiples of 16 in practice.

`transposing` does the same for the per-tensor quantize with the transposed copy: each shard's
kernel writes its codes and their transpose, which is its block of the transposed array (sharded
like the codes with the last two axes swapped); `rows_to_columns` for a kernel reading rows and
writing them as columns (the remake of a linear's transposed input codes). `matmul_tn`
partitions the FP8 GEMM.

The mesh comes from the operands' shardings at partitioning time (after jit's sharding
propagation); nothing needs to be set at trace time for these kernels.
"""
from __future__ import annotations

import math
import string
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

KINDS = ("data", "meta", "scalar")


def axis_size(mesh, entry) -> int:
  """How many shards a PartitionSpec entry (None, a mesh axis name or a tuple of them) makes."""
  if entry is None or entry is PartitionSpec.UNCONSTRAINED:
    return 1
  names = entry if isinstance(entry, tuple) else (entry,)
  return math.prod(mesh.shape[n] for n in names)


def whole_groups(length: int, shards: int, group_size: int | None) -> bool:
  """Whether splitting an axis of `length` into `shards` equal blocks leaves whole groups of
  `group_size` in each: the one rule for "groups never straddle shards", used by the kernels
  here, the parameter shardings (coat_jax.training.mesh) and the optimizer state's
  (coat_jax.optim_state). No group size, or a length that is not a multiple of it (a short last
  group: no kernel runs on it, the reference takes any split): True."""
  if not group_size or length % group_size:
    return True
  return length % shards == 0 and (length // shards) % group_size == 0


def _padded(spec, rank: int) -> tuple:
  """`spec` padded with None to `rank` entries, UNCONSTRAINED entries as None."""
  spec = tuple(spec) + (None,) * (rank - len(spec))
  return tuple(None if e is PartitionSpec.UNCONSTRAINED else e for e in spec)


def local_spec(mesh, spec, shape, group_size: int, group_axis: int = -1) -> tuple:
  """`spec` padded to len(shape), with the group axis (default the last) replicated unless each
  shard of it holds whole groups of `group_size`."""
  spec = list(_padded(spec, len(shape)))
  if len(spec) >= -group_axis and spec[group_axis] is not None:
    if not whole_groups(shape[group_axis], axis_size(mesh, spec[group_axis]), group_size):
      spec[group_axis] = None
  return tuple(spec)


def _rule(kinds_in: Sequence[str], ranks_in, kinds_out: Sequence[str], ranks_out,
          group_size: int, n_last: int, group_axis: int = -1) -> tuple[str, tuple[str, ...], dict]:
  """Shardy rule: shared factors; data's group axis (default the last) = (g e) with e = G
  elements of a group (never sharded), meta's = g; scalars have their own replicated factors."""
  letters = iter(string.ascii_lowercase.replace("g", "").replace("e", ""))
  lead = {}
  repl = []

  def dims(kind, rank):
    if kind == "scalar":
      names = [f"s{len(repl) + i}" for i in range(rank)]
      repl.extend(names)
      return " ".join(names)
    names = []
    for i in range(rank):
      if i == rank + group_axis:
        names.append("(g e)" if kind == "data" else "g")
        continue
      if i not in lead:
        lead[i] = next(letters)
      names.append(lead[i])
    return " ".join(names)

  ins = ", ".join(dims(k, r) for k, r in zip(kinds_in, ranks_in))
  outs = ", ".join(dims(k, r) for k, r in zip(kinds_out, ranks_out))
  sizes = {"e": group_size}
  if "meta" not in tuple(kinds_in) + tuple(kinds_out):   # g appears only inside (g e)
    sizes["g"] = n_last // group_size
  return f"{ins} -> {outs}", tuple(repl) + ("e",), sizes


def rowwise(kernel: Callable, args: Sequence[jax.Array], kinds_in: Sequence[str],
            kinds_out: Sequence[str], group_size: int, group_axis: int = -1):
  """kernel(*args) -> tuple of results, run per shard (see the module docstring).

  group_axis: the axis groups run along (-1; -2 for the Adam step in COAT's layout, "data"
  (..., N, out) and "meta" (..., N / G, out)); the same for every data and meta operand.

  Args:
    kernel: a function of the arrays `args` only (close over static parameters), returning a
      tuple of arrays of kinds `kinds_out`; it must be correct on any block of whole groups.
    kinds_in, kinds_out: one of KINDS per operand / result; at least one "data" operand.
  """
  for k in tuple(kinds_in) + tuple(kinds_out):
    if k not in KINDS:
      raise ValueError(f"rowwise: operand kind must be one of {KINDS}, got {k!r}")
  if "data" not in kinds_in:
    raise ValueError("rowwise: needs a 'data' operand to take the sharding from")
  first = list(kinds_in).index("data")
  out_shapes = jax.eval_shape(kernel, *args)
  if len(out_shapes) != len(kinds_out):
    raise ValueError(f"rowwise: kernel returned {len(out_shapes)} results, expected "
                     f"{len(kinds_out)}")

  def specs(mesh, data_sharding, shapes, kinds):
    spec = local_spec(mesh, data_sharding.spec, args[first].shape, group_size, group_axis)
    out = []
    for s, kind in zip(shapes, kinds):
      if kind == "scalar":
        out.append(NamedSharding(mesh, PartitionSpec()))
      else:
        out.append(NamedSharding(mesh, PartitionSpec(*spec[:len(s.shape)])))
    return out

  def infer(mesh, arg_shapes, result_shape):
    return tuple(specs(mesh, arg_shapes[first].sharding, out_shapes, kinds_out))

  def partition(mesh, arg_shapes, result_shape):
    data_sharding = arg_shapes[first].sharding
    in_sh = specs(mesh, data_sharding, args, kinds_in)
    out_sh = specs(mesh, data_sharding, out_shapes, kinds_out)
    return mesh, lambda *a: tuple(kernel(*a)), tuple(out_sh), tuple(in_sh)

  rule, repl, sizes = _rule(kinds_in, [a.ndim for a in args], kinds_out,
                            [s.ndim for s in out_shapes], group_size,
                            args[first].shape[group_axis], group_axis)
  fn = custom_partitioning(lambda *a: tuple(kernel(*a)))
  fn.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule, need_replication_factors=repl, **sizes)
  return fn(*args)


def transposing(kernel: Callable, x: jax.Array, scalars: Sequence[jax.Array]):
  """kernel(x, *scalars) -> (y (..., M, N), y_t (..., N, M)), run per shard, for an elementwise
  kernel that also writes its result with the last two axes swapped (the per-tensor quantize
  with the transposed copy).

  y keeps x's sharding, y_t the same with the last two entries swapped: a shard's block,
  transposed, is the transposed array's block, so each device's kernel writes its local y_t and
  no collective is added, whichever axes are split. `scalars` are replicated; the kernel must be
  correct on any block of x (a block shape it does not take: transpose locally).
  """
  if x.ndim < 2:
    raise ValueError(f"transposing: x needs at least 2 axes, got shape {x.shape}")

  def specs(mesh, x_sharding):
    s = _padded(x_sharding.spec, x.ndim)
    return (NamedSharding(mesh, PartitionSpec(*s)),
            NamedSharding(mesh, PartitionSpec(*s[:-2], s[-1], s[-2])))

  def infer(mesh, arg_shapes, result_shape):
    return specs(mesh, arg_shapes[0].sharding)

  def partition(mesh, arg_shapes, result_shape):
    out_sh = specs(mesh, arg_shapes[0].sharding)
    in_sh = (out_sh[0],) + tuple(NamedSharding(mesh, PartitionSpec()) for _ in scalars)
    return mesh, lambda *a: tuple(kernel(*a)), out_sh, in_sh

  lead = " ".join(string.ascii_lowercase[:x.ndim - 2])
  count = iter(range(sum(jnp.ndim(a) for a in scalars)))
  repl = [[f"s{next(count)}" for _ in range(jnp.ndim(a))] for a in scalars]
  ins = ", ".join([f"{lead} m n"] + [" ".join(r) for r in repl])
  rule = f"{ins} -> {lead} m n, {lead} n m"
  fn = custom_partitioning(lambda *a: tuple(kernel(*a)))
  fn.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                   need_replication_factors=tuple(f for r in repl for f in r))
  return fn(x, *scalars)


def rows_to_columns(kernel: Callable, args: Sequence[jax.Array], row_operands: Sequence[bool]):
  """kernel(*args) -> y_t (K, M), run per shard, for a kernel whose column j of y_t depends on
  row j of its row operands only (args[i] with row_operands[i], each (M, ...)) and on the other
  operands whole (the remake: codes, scales and rstd by rows; the norm's scale and the
  per-tensor scale whole).

  The row operands keep the first one's split of M (their other axes, and the other operands,
  are gathered: replicated); y_t is (K, M) with M split the same way, so each device's kernel
  writes its block of columns and no collective is added where only M is split. The kernel must
  be correct on any block of rows (a block it does not take: its reference).
  """
  if not any(row_operands) or len(row_operands) != len(args):
    raise ValueError("rows_to_columns: one row-operand flag per operand, at least one True")
  first = list(row_operands).index(True)
  m = args[first].shape[0]
  for a, by_row in zip(args, row_operands):
    if by_row and (a.ndim < 1 or a.shape[0] != m):
      raise ValueError(f"rows_to_columns: row operands must share their first axis ({m}), "
                       f"got shape {a.shape}")
  out = jax.eval_shape(kernel, *args)
  if out.ndim != 2 or out.shape[1] != m:
    raise ValueError(f"rows_to_columns: the kernel must return (K, {m}), got {out.shape}")

  def row_entry(arg_shapes):   # the first row operand's split of M
    return _padded(arg_shapes[first].sharding.spec, 1)[0]

  def infer(mesh, arg_shapes, result_shape):
    return NamedSharding(mesh, PartitionSpec(None, row_entry(arg_shapes)))

  def partition(mesh, arg_shapes, result_shape):
    entry = row_entry(arg_shapes)
    in_sh = tuple(NamedSharding(mesh, PartitionSpec(entry) if by_row else PartitionSpec())
                  for by_row in row_operands)
    return mesh, kernel, NamedSharding(mesh, PartitionSpec(None, entry)), in_sh

  names = iter(f"r{i}" for i in range(sum(a.ndim for a in args) + 1))
  dims = [" ".join(["m"] * by_row + [next(names) for _ in range(a.ndim - by_row)])
          for a, by_row in zip(args, row_operands)]
  k = next(names)
  repl = tuple(n for d in dims for n in d.split() if n != "m") + (k,)
  fn = custom_partitioning(kernel)
  fn.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=f"{', '.join(dims)} -> {k} m", need_replication_factors=repl)
  return fn(*args)


def _drop_axes(entry, used):
  """A spec entry without the mesh axes in `used` (None if nothing is left)."""
  if entry is None:
    return None
  names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n not in used)
  return None if not names else names[0] if len(names) == 1 else names


def _names(entry) -> tuple:
  return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def matmul_tn(kernel: Callable, a: jax.Array, b: jax.Array, scale: jax.Array, *,
              partial_kernel: Callable | None = None):
  """kernel(a (M, K), b (N, K), scale ()) -> (M, N), run per shard.

  M keeps a's sharding and N b's (minus mesh axes M already uses). K: without `partial_kernel`
  it is gathered (the kernel contracts whole rows; an FSDP-sharded weight is all-gathered for
  the product, as FP8 codes). With `partial_kernel` (the same product in float32), a K split
  over mesh axes that M and N leave free stays split: each device multiplies its K block and
  the float32 partial products are summed over those axes (psum: a row-parallel product's
  all-reduce, an FSDP weight gradient's reduction over the batch shards) and cast to the
  kernel's output dtype. That sum's order differs from one device's (float32 rounding).
  The scale is replicated.
  """
  out_dtype = jax.eval_shape(kernel, a, b, scale).dtype

  def specs(mesh, a_sharding, b_sharding):
    sa = tuple(a_sharding.spec) + (None,) * (2 - len(a_sharding.spec))
    sb = tuple(b_sharding.spec) + (None,) * (2 - len(b_sharding.spec))
    sa = tuple(None if e is PartitionSpec.UNCONSTRAINED else e for e in sa)
    sb = tuple(None if e is PartitionSpec.UNCONSTRAINED else e for e in sb)
    m = sa[0]
    n = _drop_axes(sb[0], _names(m))
    if m is not None and a.shape[0] % axis_size(mesh, m):
      m = None
    if n is not None and b.shape[0] % axis_size(mesh, n):
      n = None
    k = None
    if partial_kernel is not None:
      k = _drop_axes(sa[1] if sa[1] is not None else sb[1], _names(m) + _names(n))
      if k is not None and a.shape[1] % axis_size(mesh, k):
        k = None
    return (NamedSharding(mesh, PartitionSpec(m, k)), NamedSharding(mesh, PartitionSpec(n, k)),
            NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec(m, n)), k)

  def infer(mesh, arg_shapes, result_shape):
    return specs(mesh, arg_shapes[0].sharding, arg_shapes[1].sharding)[3]

  def partition(mesh, arg_shapes, result_shape):
    sa, sb, ss, so, k = specs(mesh, arg_shapes[0].sharding, arg_shapes[1].sharding)
    if k is None:
      return mesh, kernel, so, (sa, sb, ss)

    def summed(x, y, s):
      return jax.lax.psum(partial_kernel(x, y, s), _names(k)).astype(out_dtype)
    return mesh, summed, so, (sa, sb, ss)

  fn = custom_partitioning(kernel)
  if partial_kernel is None:
    fn.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule="m k, n k, -> m n", need_replication_factors=("k",))
  else:
    fn.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule="m k, n k, -> m n", reduction_factors=("k",))
  return fn(a, b, scale)
