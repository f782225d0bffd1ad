"""The layout of coat_adamw's state: the state tuple, which axis each leaf's moments group
along (`group_axes`), and the state's shardings on a mesh (`state_shardings`, `check_group_split`).

Split out of coat_jax/optim.py (the transformation and its step), which re-exports these names.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from coat_jax import formats, kernels
from coat_jax.expansion import ExpandedMoment
from coat_jax.kernels.sharded import axis_size, whole_groups
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


GROUP_AXES = formats.OPTIMIZER_GROUP_AXES
DEFAULT_GROUP_AXIS = formats.OPTIMIZER_GROUP_AXIS
# how mu / nu are stored: a tree like params ("leaves") or flat buffers (coat_jax.packed_state)
STATE_LAYOUTS = ("leaves", "packed")


def group_axes(group_axis: str | Callable[[Any], Any], params) -> Any:
  """The axis each leaf of `params` groups its quantized moments along: a tree like params of
  negative ints (-1: the last axis).

  group_axis:
    "coat" (the default, DEFAULT_GROUP_AXIS = formats.OPTIMIZER_GROUP_AXIS): COAT's layout. A
      leaf whose last path key is "kernel" with 2+ dims (Flax's Linear kernel, (in, out) or
      stacked (layers, in, out)) groups along axis -2, the input features; every other leaf (the
      embedding table (vocab, hidden), norm scales) along its last axis.
    "last": every leaf's last axis (for a Flax (in, out) kernel, the output features).
    a callable params -> tree like params of ints (as optax's `mask`): any axis per leaf.
  Moments stay in the param's own layout: ExpandedMoment data of the param's shape, amax /
  k_code of `expansion.metadata_shape(p.shape, G, axis)` ((..., in / G, out) for axis -2), so
  no step transposes anything. The fused jax-triton kernel takes axes -1 and -2 (a G-row x
  BLOCK-column tile for -2); other axes, and -2 without jax-triton, take the jnp reference step.
  Raises ValueError for another value or an axis out of a leaf's range.
  """
  if callable(group_axis):
    axes = group_axis(params)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    axes = treedef.flatten_up_to(axes)
  elif group_axis in GROUP_AXES:
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    treedef = jax.tree.structure(params)
    kernel = lambda path, p: (group_axis == "coat" and jnp.ndim(p) >= 2 and path
                              and getattr(path[-1], "key", None) == "kernel")
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


def _metadata_sharding(sharding: NamedSharding, shape) -> NamedSharding:
  """The param's spec on the metadata shape; an axis whose size the mesh axes don't divide -> None."""
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


def state_shardings(param_shardings, state: CoatAdamWState, group_axes=None) -> CoatAdamWState:
  """NamedShardings for a CoatAdamWState from the params' NamedShardings.

  ExpandedMoment data and float32 moments: the param's sharding. amax / k_code: the param's spec
  on the metadata shape (the group axis' N -> N / G; (..., in / G, out) in COAT's layout), with
  any axis whose size is not divisible by its mesh axes' size replicated (e.g. a group axis
  sharded 4 ways with 2 groups is replicated): per-group scales stay with their groups. count:
  replicated on the first param sharding's mesh. Meant for meshes with Auto axis types (as
  coat_jax.training.mesh builds); under Explicit axes the group reshape would need explicit shardings.
  When the fused kernel is in use (`kernels.use_pallas("adam")`; it runs per shard), a split of
  the group axis that cuts a parameter's groups raises ValueError naming the parameter and the
  split (`check_group_split`).
  group_axes: the tree `group_axes(group_axis, params)` of the state's coat_adamw, the axis the
  group check runs on; None: read from each moment (the one axis where its scales' shape differs
  from its data's; -1 where none does).
  A packed state (state_layout "packed"): its buffers replicated on a one-device mesh;
  ValueError on a mesh of several devices.
  """
  is_sharding = lambda x: isinstance(x, NamedSharding)
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(param_shardings, is_leaf=is_sharding)
  paths = [jax.tree_util.keystr(p) for p, _ in with_paths]
  shard_leaves = [s for _, s in with_paths]
  if not shard_leaves:
    raise ValueError("state_shardings: param_shardings has no NamedSharding leaves")
  for s in shard_leaves:
    if not isinstance(s, NamedSharding):
      raise ValueError(f"state_shardings: expected NamedSharding leaves, got {type(s).__name__}")

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
  axes = [None] * len(paths) if group_axes is None else treedef.flatten_up_to(group_axes)

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
