"""Device mesh, parameter sharding rules, batch and optimizer-state shardings.

The mesh has three axes:
  "data":   pure data parallelism (parameters replicated),
  "fsdp":   data parallelism with parameters and optimizer states sharded (ZeRO-3 style),
  "tensor": Megatron-style tensor parallelism (heads / MLP columns split).

Batches are split over ("data", "fsdp"). Parameters follow `LLAMA_RULES`: a rule matches a
parameter's path (a regular expression over its "/"-joined path) and names a mesh axis per trailing
dimension. An axis that does not divide its dimension falls back to replication for that dimension,
so any shape works on any mesh.

Multi-host: call `jax.distributed.initialize()` (train.py's `--distributed`) before building the
mesh; `jax.devices()` then lists every host's devices and the same code runs on each host.
"""
from __future__ import annotations

import math
import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from coat_jax.kernels.sharded import whole_groups

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# (path regex, mesh axis per trailing dimension). First match wins; leading dims (e.g. a stacked
# layer axis) are replicated. Kernels are stored (in_features, out_features).
LLAMA_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"norm|(^|/)(scale|bias)$", ()),  # RMSNorm scales: replicated
    (r"(^|/)(embed|embed_tokens|wte)/", ("tensor", "fsdp")),  # (vocab, hidden)
    (r"(^|/)lm_head/", ("fsdp", "tensor")),  # (hidden, vocab)
    (r"(^|/)(q_proj|k_proj|v_proj)/", ("fsdp", "tensor")),  # (hidden, heads * head_dim)
    (r"(^|/)o_proj/", ("tensor", "fsdp")),  # (heads * head_dim, hidden)
    (r"(^|/)(gate_proj|up_proj)/", ("fsdp", "tensor")),  # (hidden, intermediate)
    (r"(^|/)down_proj/", ("tensor", "fsdp")),  # (intermediate, hidden)
)


def mesh_shape(mesh_cfg, num_devices: int) -> dict[str, int]:
  """Resolves the -1 (fill) entry of a mesh config (`.data`, `.fsdp`, `.tensor` sizes) for `num_devices`."""
  sizes = {"data": mesh_cfg.data, "fsdp": mesh_cfg.fsdp, "tensor": mesh_cfg.tensor}
  fixed = math.prod(v for v in sizes.values() if v != -1)
  fill = [k for k, v in sizes.items() if v == -1]
  if fill:
    if num_devices % fixed:
      raise ValueError(f"mesh {sizes}: the fixed axes (product {fixed}) do not divide the "
                       f"{num_devices} devices")
    sizes[fill[0]] = num_devices // fixed
  elif fixed > num_devices:
    raise ValueError(f"mesh {sizes} needs {fixed} devices, only {num_devices} are available")
  return sizes


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A Mesh over axes ("data", "fsdp", "tensor").

  With no -1 entry and fewer devices asked for than exist, the first ones are used (e.g. a
  one-device run on an 8-device host).
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape(mesh_cfg, len(devices))
  n = math.prod(sizes.values())
  grid = np.asarray(devices[:n], dtype=object).reshape(tuple(sizes[a] for a in AXES))
  return Mesh(grid, AXES)


def path_str(path) -> str:
  """A pytree key path as "a/b/0/c"."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def _fit(spec: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
         group_size: int | None = None, group_axis: int = -1) -> P:
  """Right-aligns `spec` to `shape`, dropping axes that are absent, size 1 or do not divide the dim.

  With `group_size`, a mesh axis on the grouped dim (`group_axis`, negative: the last unless
  coat_adamw's group_axis says otherwise) that would cut the optimizer's groups moves to the
  nearest other dim of the rule (not a stacked layer axis) that it divides (added to that dim's
  axes, minor), else it is dropped.
  """
  spec = list(spec)[-len(shape):] if shape else []
  full = [None] * (len(shape) - len(spec)) + spec
  used = set()
  out = []
  for dim, axis in zip(shape, full):
    if axis is None or axis not in mesh.shape or mesh.shape[axis] == 1 or axis in used \
        or dim % mesh.shape[axis]:
      out.append(None)
    else:
      out.append(axis)
      used.add(axis)
  gi = len(out) + group_axis
  if out and 0 <= gi and out[gi] is not None and not whole_groups(
      shape[gi], mesh.shape[out[gi]], group_size):
    axis, out[gi] = out[gi], None
    for i in [i for i in range(len(out) - 1, len(out) - len(spec) - 1, -1) if i != gi]:
      names = () if out[i] is None else out[i] if isinstance(out[i], tuple) else (out[i],)
      if shape[i] % (math.prod(mesh.shape[n] for n in names) * mesh.shape[axis]) == 0:
        out[i] = axis if not names else names + (axis,)
        break
  while out and out[-1] is None:  # P("fsdp", None) == P("fsdp"); P(None) == P()
    out.pop()
  return P(*out)


def spec_for(path: str, shape: Sequence[int], mesh: Mesh,
             rules: Sequence[tuple[str, tuple]] = LLAMA_RULES, group_size: int | None = None,
             group_axis: int = -1) -> P:
  """The PartitionSpec of one parameter: first matching rule; unmatched matrices get (fsdp, tensor).
  group_size: the optimizer's group along `group_axis` (coat_adamw), kept whole per shard."""
  for pattern, spec in rules:
    if re.search(pattern, path):
      return _fit(spec, shape, mesh, group_size, group_axis)
  if len(shape) >= 2:
    return _fit(("fsdp", "tensor"), shape, mesh, group_size, group_axis)
  return P()


def param_shardings(params: Any, mesh: Mesh, rules: Sequence[tuple[str, tuple]] = LLAMA_RULES,
                    group_size: int | None = None, group_axes: Any = None) -> Any:
  """A NamedSharding per leaf of `params` (arrays or ShapeDtypeStructs), same tree structure.
  group_size: coat_adamw's group size (splits of the grouped axis keep whole groups per shard),
  or None. group_axes: `coat_jax.optim.group_axes(group_axis, params)` (None: the last axes)."""
  if group_axes is None:
    group_axes = jax.tree.map(lambda _: -1, params)
  return jax.tree_util.tree_map_with_path(
      lambda path, x, a: NamedSharding(
          mesh, spec_for(path_str(path), np.shape(x), mesh, rules, group_size, a)),
      params, group_axes)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """(batch, seq) arrays split over ("data", "fsdp") on the batch axis."""
  return NamedSharding(mesh, P(BATCH_AXES, None))


def batch_shards(mesh: Mesh) -> int:
  return mesh.shape["data"] * mesh.shape["fsdp"]


def put_batch(batch, sharding: NamedSharding):
  """Places a global host batch (identical on every host; an array or a dict of arrays) onto the
  mesh; each device takes its slice."""
  def put(array):
    array = np.asarray(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
  return jax.tree.map(put, batch)


def optimizer_state_shardings(tx, opt_state: Any, params_shardings: Any, mesh: Mesh,
                              name: str, group_axes: Any = None) -> Any:
  """Shardings for an optimizer state: param-shaped leaves follow their parameter, the rest replicate.

  "coat_adamw" states (quantized moments with per-group scales) come from
  `coat_jax.optim.state_shardings` (group_axes: as there); optax states are mapped with
  `optax.tree_map_params`.
  """
  rep = replicated(mesh)
  if name == "coat_adamw":
    from coat_jax.optim import CoatAdamWState, state_shardings

    def one(state):
      if isinstance(state, CoatAdamWState):
        return state_shardings(params_shardings, state, group_axes)
      return jax.tree.map(lambda _: rep, state)

    # optax.chain states are tuples: the COAT state gets its own mapping, the rest (clipping) replicate.
    if isinstance(opt_state, tuple) and not isinstance(opt_state, CoatAdamWState):
      return type(opt_state)(one(s) for s in opt_state)
    return one(opt_state)
  import optax
  return optax.tree_map_params(tx, lambda _, s: s, opt_state, params_shardings,
                               transform_non_params=lambda _: rep,
                               is_leaf=lambda x: isinstance(x, NamedSharding))

def describe(params_shardings: Any, params: Any) -> list[str]:
  """Lines "path shape spec" for logging."""
  lines = []
  flat_s = jax.tree_util.tree_leaves_with_path(params_shardings,
                                               is_leaf=lambda x: isinstance(x, NamedSharding))
  flat_p = jax.tree_util.tree_leaves(params)
  for (path, s), p in zip(flat_s, flat_p):
    lines.append(f"{path_str(path)} {tuple(np.shape(p))} {tuple(s.spec)}")
  return lines
