"""The packed layout of coat_adamw's moments: every leaf's moment in a few flat buffers.

`coat_adamw(..., state_layout="packed")` keeps each moment (m, v) of the whole tree as one
`PackedMoments`: four 1-D arrays (and a fingerprint of the layout) instead of three arrays per
quantized leaf and one per float32 leaf. Same bytes (plus alignment padding, at most SEGMENT - 1
groups per leaf), same values: a leaf's slice of the buffers is exactly its `ExpandedMoment` (or
float32 moment) in the per-leaf layout, flattened. What it buys is fewer buffers at the jit
boundary: a jitted step pays host time per buffer it passes (docs/results.md, "The optimizer
step", times both layouts), 930 buffers for a 62-leaf tree in the per-leaf layout against ~200
here.

Layout (`layout`), leaf after leaf in tree order, for a quantized leaf of shape S grouped along
`axis` with g = prod(metadata_shape(S, G, axis)) groups:
  amax, k_code: its metadata, flattened row-major, at [start, start + g), start a multiple of
    SEGMENT (16 groups: the fused kernel's metadata loads stay aligned);
  data: its codes, flattened row-major, at [start * G, start * G + size(S)) (so one integer,
    start / SEGMENT, places both in the kernel);
  the slots are [start, start + ceil(g / SEGMENT) * SEGMENT) groups (`Slot.span`); what the
  padding holds is never read as a leaf's.
A float32 (not quantized) leaf's moment: `plain`, flattened, at [start, start + size(S)).
The layout is a pure function of the params' shapes, the quantized flags, the group axes and G
(`layout`); the state carries only arrays, one of which (`PackedMoments.layout`) holds the
layout's fingerprint in its shape, so stepping or restoring a state with another tree or other
settings fails at trace time instead of reading scales against the wrong codes.
"""
from __future__ import annotations

import math
import zlib
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from coat_jax import expansion
from coat_jax.expansion import ExpandedMoment

__all__ = ["SEGMENT", "PackedMoments", "Slot", "fingerprint", "layout", "leaf", "pack", "sizes",
           "unpack", "with_leaf", "zeros"]

SEGMENT = 16  # groups: each quantized leaf's slot starts at a multiple of this
FINGERPRINTS = 1024  # PackedMoments.layout has 1 .. FINGERPRINTS elements (1 KB at most)
MAX_PLAIN = 2**31 - 1  # float32 moments (updated at int32 offsets)


class PackedMoments(NamedTuple):
  """One moment (m or v) of every leaf.

  data: (D,) the format's dtype: the quantized leaves' codes; amax: (D / G,) float32 and
  k_code: (D / G,) uint8: their per-group metadata; plain: (F,) float32: the moments of the
  leaves kept in float32 (empty when none); layout: uint8 zeros of shape (fingerprint(...),),
  the layout's fingerprint as a static shape. Where each leaf lies: `layout`.
  """
  data: jax.Array
  amax: jax.Array
  k_code: jax.Array
  plain: jax.Array
  layout: jax.Array


class Slot(NamedTuple):
  """Where one leaf's moment lies: quantized (in data / amax / k_code from group `start`, which
  is a multiple of SEGMENT; `groups` metadata values) or float32 (in plain from element
  `start`); shape: the leaf's; axis: its group axis (negative)."""
  shape: tuple[int, ...]
  axis: int
  quantized: bool
  start: int
  groups: int

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def span(self) -> int:
    """Groups a quantized slot takes in the buffers: its groups rounded up to SEGMENT."""
    return -(-self.groups // SEGMENT) * SEGMENT


def sizes(slots: Sequence[Slot]) -> tuple[int, int]:
  """(groups, plain): the metadata values (data holds groups * G codes) and float32 values that
  buffers holding these slots have."""
  return (sum(s.span for s in slots if s.quantized),
          sum(s.size for s in slots if not s.quantized))


def layout(shapes: Sequence[tuple[int, ...]], quantized: Sequence[bool], axes: Sequence[int],
           group_size: int) -> tuple[tuple[Slot, ...], int, int]:
  """(slots, groups, plain): each leaf's Slot, and the buffers' sizes: `groups` metadata values
  (data holds groups * group_size codes) and `plain` float32 values."""
  slots, groups, plain = [], 0, 0
  for shape, q, axis in zip(shapes, quantized, axes, strict=True):
    shape = tuple(int(d) for d in shape)
    if q:
      slot = Slot(shape, axis, True, groups,
                  math.prod(expansion.metadata_shape(shape, group_size, axis)))
      groups += slot.span
    else:
      slot = Slot(shape, axis, False, plain, math.prod(shape))
      plain += slot.size
    slots.append(slot)
  if plain > MAX_PLAIN:
    raise ValueError(f"packed optimizer state: {plain} float32 moment values (leaves kept in "
                     f"float32) exceed {MAX_PLAIN}; use state_layout='leaves'")
  return tuple(slots), groups, plain


def fingerprint(slots: Sequence[Slot], group_size: int) -> int:
  """1 .. FINGERPRINTS: a hash (crc32, the same in every process) of the slots and G; the
  length of `PackedMoments.layout`."""
  key = repr((group_size, SEGMENT, [tuple(s) for s in slots])).encode()
  return 1 + zlib.crc32(key) % FINGERPRINTS


def leaf(packed: PackedMoments, slot: Slot, group_size: int):
  """The leaf's moment in the per-leaf layout: an ExpandedMoment (quantized) or a float32 array."""
  if not slot.quantized:
    return jax.lax.slice(packed.plain, (slot.start,), (slot.start + slot.size,)).reshape(
        slot.shape)
  meta_shape = expansion.metadata_shape(slot.shape, group_size, slot.axis)
  d0, m0 = slot.start * group_size, slot.start
  return ExpandedMoment(
      jax.lax.slice(packed.data, (d0,), (d0 + slot.size,)).reshape(slot.shape),
      jax.lax.slice(packed.amax, (m0,), (m0 + slot.groups,)).reshape(meta_shape),
      jax.lax.slice(packed.k_code, (m0,), (m0 + slot.groups,)).reshape(meta_shape))


def with_leaf(packed: PackedMoments, slot: Slot, moment, group_size: int) -> PackedMoments:
  """`packed` with the leaf's slice replaced by `moment` (as `leaf` returns it). The codes are
  written through the (groups, G) view of `data` at row slot.start, padded with zeros to whole
  rows inside the slot: update offsets are int32, and a model's codes pass 2^31 (Llama-2-7B)
  where its groups do not."""
  put = lambda buf, x, at: jax.lax.dynamic_update_slice(buf, x.reshape(-1).astype(buf.dtype), (at,))
  if not slot.quantized:
    return packed._replace(plain=put(packed.plain, moment, slot.start))
  rows = -(-slot.size // group_size)
  codes = jnp.pad(moment.data.reshape(-1), (0, rows * group_size - slot.size))
  data = jax.lax.dynamic_update_slice(packed.data.reshape(-1, group_size),
                                      codes.reshape(rows, group_size), (slot.start, 0))
  return packed._replace(data=data.reshape(-1), amax=put(packed.amax, moment.amax, slot.start),
                         k_code=put(packed.k_code, moment.k_code, slot.start))


def unpack(packed: PackedMoments, slots: Sequence[Slot], group_size: int) -> list:
  """Every leaf's moment (`leaf`), in the slots' order."""
  return [leaf(packed, s, group_size) for s in slots]


def pack(moments: Sequence, slots: Sequence[Slot], group_size: int, data_dtype) -> PackedMoments:
  """The PackedMoments of per-leaf moments (ExpandedMoment for quantized slots, float32 arrays
  otherwise); `data_dtype`: the codes' dtype (used when no leaf is quantized). Padding: zero
  codes, amax 1, k code 1."""
  data, amax, k_code, plain = [], [], [], []
  for m, s in zip(moments, slots, strict=True):
    if not s.quantized:
      plain.append(jnp.asarray(m, jnp.float32).reshape(-1))
      continue
    pad = s.span - s.groups
    data += [m.data.reshape(-1), jnp.zeros((s.span * group_size - s.size,), m.data.dtype)]
    amax += [m.amax.reshape(-1).astype(jnp.float32), jnp.ones((pad,), jnp.float32)]
    k_code += [m.k_code.reshape(-1).astype(jnp.uint8), jnp.ones((pad,), jnp.uint8)]
  cat = lambda xs, dtype: jnp.concatenate(xs) if xs else jnp.zeros((0,), dtype)
  return PackedMoments(cat(data, data_dtype), cat(amax, jnp.float32), cat(k_code, jnp.uint8),
                       cat(plain, jnp.float32), _layout_array(slots, group_size))


def _layout_array(slots, group_size: int) -> jax.Array:
  return jnp.zeros((fingerprint(slots, group_size),), jnp.uint8)


def zeros(zero_group: ExpandedMoment, slots: Sequence[Slot], group_size: int) -> PackedMoments:
  """The packed moment of all zeros for these slots (`layout`'s): every group (padding too)
  holds `zero_group`'s fields (the quantized zero group: an ExpandedMoment of one group), plain
  zeros. Built by broadcasting, so jit does not constant-fold per-group reductions over the
  whole model."""
  groups, plain = sizes(slots)
  one = lambda x, n: jnp.broadcast_to(x.reshape(-1)[0], (n,))
  return PackedMoments(one(zero_group.data, groups * group_size), one(zero_group.amax, groups),
                       one(zero_group.k_code, groups), jnp.zeros((plain,), jnp.float32),
                       _layout_array(slots, group_size))
