"""coat_adamw's state: the state tuple, which axis each leaf's moments group along
(`group_axes`), its initial values per layout (`init_leaf_moments`, `init_packed_moments`,
`init_compensation`), and its shardings or partition specs from the params' (`state_shardings`,
`check_group_split`).

coat_jax/optim.py (the transformation) re-exports the public names.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from coat_jax import expansion, kernels, packed_state
from coat_jax.expansion import ExpandedMoment
from coat_jax.kernels.sharded import axis_size, whole_groups
from coat_jax.optim_config import (DEFAULT_GROUP_AXIS, GROUP_AXES, STATE_LAYOUTS,  # noqa: F401
                                   CoatAdamWConfig, unwrap_variables)
from coat_jax.packed_state import PackedMoments

__all__ = ["CoatAdamWState", "DEFAULT_GROUP_AXIS", "GROUP_AXES", "STATE_LAYOUTS",
           "check_group_split", "group_axes", "state_shardings"]


class CoatAdamWState(NamedTuple):
  """count: int32 () steps taken; mu, nu: pytrees like params of ExpandedMoment or float32 leaves
  (state_layout "leaves"), or each one PackedMoments (state_layout "packed"); comp: None, or
  with master_rounding="kahan" a pytree like params of bfloat16 compensation
  buffers (the low-order part of each bfloat16 master weight; None for other params)."""
  count: jax.Array
  mu: Any
  nu: Any
  comp: Any = None


# Attribute keys by which Flax NNX wrappers (Variable, and VariableState in older Flax) hold
# their array: the last key of `('layer', 'kernel', .value)` that names the parameter is 'kernel'.
_WRAPPER_KEYS = ("value", "raw_value")


def param_name(path) -> str | None:
  """The name a parameter's tree path ends in (a dict key or attribute name), wrappers' keys
  (`_WRAPPER_KEYS`, e.g. nnx.Param's `.value`) skipped; None for an empty path."""
  keys = [k for k in path
          if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name in _WRAPPER_KEYS)]
  if not keys:
    return None
  last = keys[-1]
  return getattr(last, "key", getattr(last, "name", None))


def group_axes(group_axis: str | Callable[[Any], Any], params) -> Any:
  """The axis each leaf of `params` groups its quantized moments along: a tree like params of
  negative ints (-1: the last axis).

  group_axis:
    "coat" (the default, DEFAULT_GROUP_AXIS): COAT's layout. A leaf whose name (`param_name`:
      the last key of its path, Flax NNX's `.value` skipped) is "kernel", with 2+ dims (Flax's
      Linear kernel, (in, out) or stacked (layers, in, out)), groups along axis -2, the input
      features; every other leaf (the embedding table (vocab, hidden), norm scales) along its
      last axis.
    "last": every leaf's last axis (for a Flax (in, out) kernel, the output features).
    a callable params -> tree like params of ints (as optax's `mask`): any axis per leaf. It is
      called with the params' values (Flax NNX Variables unwrapped, `unwrap_variables`).
  The same params wrapped in nnx.Variables or not get the same axes, so `flax.nnx.Optimizer`
  (init on Variables, update on arrays) sees one layout.
  Moments stay in the param's own layout: ExpandedMoment data of the param's shape, amax /
  k_code of `expansion.metadata_shape(p.shape, G, axis)` ((..., in / G, out) for axis -2), so
  no step transposes anything. The fused jax-triton kernel takes axes -1 and -2 (a G-row x
  BLOCK-column tile for -2); other axes, and -2 without jax-triton, take the jnp reference step.
  Raises ValueError for another value or an axis out of a leaf's range.
  """
  if callable(group_axis):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    axes = jax.tree.structure(unwrap_variables(params)).flatten_up_to(
        unwrap_variables(group_axis(unwrap_variables(params))))
  elif group_axis in GROUP_AXES:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    kernel = lambda path, p: (group_axis == "coat" and jnp.ndim(p) >= 2
                              and param_name(path) == "kernel")
    axes = [-2 if kernel(path, p) else -1 for path, p in leaves]
  else:
    raise ValueError(f"coat_adamw: group_axis must be one of {GROUP_AXES} or a callable "
                     f"params -> tree of axes, got {group_axis!r}")
  out = []
  for (path, p), axis in zip(leaves, axes):
    ndim = jnp.ndim(p)
    if isinstance(axis, bool) or not isinstance(axis, int) or not (
        -max(ndim, 1) <= axis < max(ndim, 1)):
      raise ValueError(f"coat_adamw: group_axis for parameter {jax.tree_util.keystr(path)} of "
                       f"shape {tuple(jnp.shape(p))} must be an int axis, got {axis!r}")
    out.append(axis - ndim if axis >= 0 and ndim else axis if ndim else -1)
  return treedef.unflatten(out)


def _filled(value, like) -> jax.Array:
  """An array of like's shape and dtype holding `value` (a scalar) everywhere, with like's
  sharding where it has one (under a mesh with Explicit axes: the type `update` gives it)."""
  x = jnp.broadcast_to(value, like.shape).astype(like.dtype)
  sharding = getattr(like, "sharding", None)
  return x if sharding is None else jax.sharding.reshard(x, sharding)


def zero_group(cfg: CoatAdamWConfig, fmt: str) -> ExpandedMoment:
  """One group of G zeros, quantized (`expansion.quantize_expanded`): what every group of a
  fresh moment holds."""
  return expansion.quantize_expanded(jnp.zeros((cfg.group_size,), jnp.float32), fmt,
                                     cfg.group_size, cfg.expand_min, cfg.expand)


def zero_moment(cfg: CoatAdamWConfig, param, fmt: str, axis: int) -> ExpandedMoment:
  """`quantize_expanded` of zeros like `param` grouped along `axis`: the types (shapes, dtypes,
  and under Explicit mesh axes shardings) of quantizing a float32 moment sharded like the
  param, each field filled from `zero_group` by broadcasting. (Quantizing a large all-zero
  constant under jit makes XLA constant-fold the per-group reductions: seconds per parameter
  for a 4096 x 11008 leaf.)"""
  like = jax.eval_shape(lambda p: expansion.quantize_expanded(
      jnp.zeros_like(p, jnp.float32), fmt, cfg.group_size, cfg.expand_min, cfg.expand, axis),
      param)
  return jax.tree.map(lambda v, s: _filled(v.reshape(-1)[0], s), zero_group(cfg, fmt), like)


def check_float_params(params) -> None:
  """ValueError naming the first parameter whose dtype is not floating."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(f"coat_adamw: parameter {jax.tree_util.keystr(path)} has non-float dtype "
                       f"{dtype}; only floating parameters can be optimized")


def init_leaf_moments(cfg: CoatAdamWConfig, params, axes) -> tuple[Any, Any]:
  """(mu, nu) of zeros in the per-leaf layout: trees like params holding an ExpandedMoment
  (`zero_moment`) where `cfg.quantized(p)`, float32 zeros like p (zeros_like: p's sharding)
  elsewhere. axes: `group_axes(cfg.group_axis, params)`."""
  moment = lambda fmt: jax.tree.map(
      lambda p, a: (zero_moment(cfg, p, fmt, a) if cfg.quantized(p)
                    else jnp.zeros_like(p, jnp.float32)), params, axes)
  return moment(cfg.m_format), moment(cfg.v_format)


def packed_slots(cfg: CoatAdamWConfig, leaves, axes) -> tuple[tuple, int, int]:
  """`packed_state.layout` of these param (or gradient) leaves and their group axes: (slots,
  groups, plain size)."""
  quantized = [cfg.quantized(x) for x in leaves]
  return packed_state.layout([jnp.shape(x) for x in leaves], quantized,
                             [a if q else -1 for a, q in zip(axes, quantized)], cfg.group_size)


def init_packed_moments(cfg: CoatAdamWConfig, params, axes) -> tuple[PackedMoments, PackedMoments]:
  """(mu, nu) of zeros in the packed layout (`packed_state.zeros` of `packed_slots`)."""
  slots = packed_slots(cfg, jax.tree.leaves(params), jax.tree.leaves(axes))[0]
  return tuple(packed_state.zeros(zero_group(cfg, fmt), slots, cfg.group_size)
               for fmt in (cfg.m_format, cfg.v_format))


def init_compensation(cfg: CoatAdamWConfig, params) -> Any:
  """master_rounding "kahan": a tree like params of bfloat16 zeros like each bfloat16 param
  (None for other params); None for other roundings."""
  if not cfg.kahan:
    return None
  return jax.tree.map(lambda p: jnp.zeros_like(p, jnp.bfloat16)
                      if jnp.dtype(p.dtype) == jnp.bfloat16 else None, params)


def _metadata_sharding(sharding: NamedSharding, shape) -> NamedSharding:
  """The param's spec on the metadata shape; an axis whose size its mesh axes don't divide: None."""
  spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
  out = []
  for size, entry in zip(shape, spec):
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
      out.append(None)
    else:
      out.append(entry if size % axis_size(sharding.mesh, entry) == 0 else None)
  return NamedSharding(sharding.mesh, PartitionSpec(*out))


def check_group_split(path: str, shape, num_groups: int, sharding: NamedSharding,
                      axis: int = -1) -> None:
  """ValueError naming the parameter and split when its split along the group axis `axis`
  (negative) cuts quantization groups.

  The fused Adam kernel runs per shard (coat_jax.kernels.sharded) and needs each shard to hold whole
  groups of G = N / num_groups along the group axis. Shapes the kernel does not take (N not a
  multiple of G: a short final group) use the reference step, which takes any split.
  """
  if len(shape) < -axis:
    return
  n = shape[axis]
  if n % num_groups:
    return
  group = n // num_groups
  spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
  entry = spec[axis]
  shards = axis_size(sharding.mesh, entry)
  if not whole_groups(n, shards, group):
    which = "last axis" if axis == -1 else f"axis {len(shape) + axis} (its group axis)"
    raise ValueError(
        f"state_shardings: parameter {path} of shape {tuple(shape)} has its {which} split "
        f"{shards} ways over mesh axes {entry!r} ({n} / {shards} = {n / shards:g} per shard), "
        f"which cuts its optimizer groups of {group}; shard that axis so that each shard holds a "
        f"multiple of {group} elements (or not at all), or use the reference optimizer step")


def state_shardings(param_shardings, state: CoatAdamWState, group_axes=None, *,
                    mesh=None) -> CoatAdamWState:
  """Shardings (or partition specs) for a CoatAdamWState from the params' shardings (or specs):
  what `optax.tree_map_params(tx, lambda _, s: s, state, param_shardings, ...)` gives for
  optax's optimizers, whose moments are trees like the params. (tree_map_params cannot map
  coat_adamw's state: a quantized moment is three arrays per param, `ExpandedMoment`.)

  param_shardings: a tree like the params of NamedShardings, or of PartitionSpecs (then the
    result holds PartitionSpecs, and the mesh whose axis sizes decide divisibility is `mesh` or
    the current one, `jax.sharding.get_abstract_mesh()`: under `jax.set_mesh`, the specs
    `jax.typeof(x).sharding.spec` of the state's arrays). Flax NNX Variables around the leaves
    (e.g. `nnx.get_partition_spec(nnx.state(model, nnx.Param))`) are unwrapped.
  ExpandedMoment data and float32 moments: the param's sharding. amax / k_code: the param's spec
  on the metadata shape (the group axis' N -> N / G; (..., in / G, out) in COAT's layout), with
  any axis whose size is not divisible by its mesh axes' size replicated (e.g. a group axis
  sharded 4 ways with 2 groups is replicated): per-group scales stay with their groups. count:
  replicated. Under a mesh with Explicit axes, `init` builds the state with these shardings
  where the step's own sharding propagation agrees (a group axis split into whole groups).
  When the fused kernel is in use (`kernels.use_pallas("adam")`; it runs per shard), a split of
  the group axis that cuts a parameter's groups raises ValueError naming the parameter and the
  split (`check_group_split`).
  group_axes: the tree `group_axes(group_axis, params)` of the state's coat_adamw, the axis the
  group check runs on; None: read from each moment (the one axis where its scales' shape differs
  from its data's; -1 where none does).
  A packed state (state_layout "packed"): its buffers replicated on a one-device mesh;
  ValueError on a mesh of several devices.
  """
  is_spec = lambda x: isinstance(x, (NamedSharding, PartitionSpec))
  param_shardings = unwrap_variables(param_shardings)
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(param_shardings, is_leaf=is_spec)
  paths = [jax.tree_util.keystr(p) for p, _ in with_paths]
  shard_leaves = [s for _, s in with_paths]
  if not shard_leaves:
    raise ValueError("state_shardings: param_shardings has no NamedSharding or PartitionSpec "
                     "leaves")
  as_specs = all(isinstance(s, PartitionSpec) for s in shard_leaves)
  if as_specs:
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh.empty:
      raise ValueError("state_shardings: PartitionSpecs need a mesh: pass mesh=... or call it "
                       "under jax.set_mesh")
    shard_leaves = [NamedSharding(mesh, s) for s in shard_leaves]
  for s in shard_leaves:
    if not isinstance(s, NamedSharding):
      raise ValueError(f"state_shardings: expected NamedSharding (or only PartitionSpec) "
                       f"leaves, got {type(s).__name__}")
  shardings = _state_shardings(paths, shard_leaves, treedef, state, group_axes)
  if as_specs:
    return jax.tree.map(lambda s: s.spec, shardings, is_leaf=is_spec)
  return shardings


def _state_shardings(paths, shard_leaves, treedef, state, group_axes) -> CoatAdamWState:
  """`state_shardings` on NamedSharding leaves (their paths, the params' treedef)."""
  count = NamedSharding(shard_leaves[0].mesh, PartitionSpec())
  comp = None
  if state.comp is not None:  # compensation buffers: the param's sharding (None stays None)
    comp = treedef.unflatten([None if c is None else s for s, c in
                              zip(shard_leaves, treedef.flatten_up_to(state.comp))])
  if isinstance(state.mu, PackedMoments):
    if count.mesh.size > 1:
      raise ValueError(f"state_shardings: the packed optimizer state (state_layout='packed') is "
                       f"one device's layout and this mesh has {count.mesh.size} devices; use "
                       f"state_layout='leaves', which shards each moment like its param")
    packed = PackedMoments(count, count, count, count, count)
    return CoatAdamWState(count, packed, packed, comp)
  per_shard_kernel = kernels.use_pallas("adam")
  axes = ([None] * len(paths) if group_axes is None
          else treedef.flatten_up_to(unwrap_variables(group_axes)))

  def moment(path, sharding, leaf, axis):
    if isinstance(leaf, ExpandedMoment):
      if axis is None:
        differ = [i - leaf.data.ndim for i, (a, b) in
                  enumerate(zip(leaf.data.shape, leaf.amax.shape)) if a != b]
        axis = differ[0] if len(differ) == 1 else -1
      if per_shard_kernel and leaf.data.ndim:
        check_group_split(path, leaf.data.shape, leaf.amax.shape[axis], sharding, axis)
      meta = _metadata_sharding(sharding, leaf.amax.shape)
      return ExpandedMoment(sharding, meta, meta)
    return sharding

  def moments(tree):
    leaves = treedef.flatten_up_to(tree)
    return treedef.unflatten([moment(*a) for a in zip(paths, shard_leaves, leaves, axes)])

  return CoatAdamWState(count, moments(state.mu), moments(state.nu), comp)
