"""Operand checks shared by the fused Adam step kernels (Mosaic GPU and jax-triton versions)."""
from __future__ import annotations

import math
from typing import Callable

OUTPUTS = ("param", "update")


def check_operands(kernel: str, param, grad, m_q, m_amax, m_code, v_q, v_amax, v_code, *,
                   group_size: int, output: str, problem: Callable[..., str | None],
                   group_axis: int = -1) -> tuple:
  """Raises ValueError naming `kernel` and the problem; returns (like, meta_shape).

  like: the array that fixes the shapes (param, or grad when there is no param);
  meta_shape: the per-group metadata shape, the group axis' N replaced by N / group_size:
  (..., N / G) for group_axis -1, (..., in / G, out) for -2. `problem` takes group_axis when it
  is not -1.
  """
  like = _like(kernel, param, grad, output)
  axis_arg = () if group_axis == -1 else (group_axis,)
  why = problem(like.shape, like.dtype, m_q.dtype, v_q.dtype, group_size, *axis_arg)
  if why is not None:
    raise ValueError(f"{kernel}: {why}")
  a = len(like.shape) + group_axis
  meta_shape = like.shape[:a] + (like.shape[a] // group_size,) + like.shape[a + 1:]
  for name, a, shape in (("grad", grad, like.shape), ("m_q", m_q, like.shape),
                         ("v_q", v_q, like.shape), ("m_amax", m_amax, meta_shape),
                         ("m_code", m_code, meta_shape), ("v_amax", v_amax, meta_shape),
                         ("v_code", v_code, meta_shape)):
    if a.shape != shape:
      raise ValueError(f"{kernel}: {name} has shape {a.shape}, expected {shape}")
  return like, meta_shape


def check_packed_operands(kernel: str, param, grad, m3, v3, packed_at: int, segment: int,
                          group_size: int, output: str, group_axis: int,
                          problem: Callable[..., str | None]):
  """As `check_operands` for moments in packed buffers (coat_jax.packed_state): m3 / v3 are
  (codes, amax, k codes), 1-D, holding this leaf's slot from metadata group `packed_at` (a
  multiple of `segment`) and code packed_at * group_size. Returns `like`."""
  like = _like(kernel, param, grad, output)
  if grad.shape != like.shape:
    raise ValueError(f"{kernel}: grad has shape {grad.shape}, expected {like.shape}")
  if packed_at < 0 or packed_at % segment:
    raise ValueError(f"{kernel}: packed_at {packed_at} is not a multiple of the segment "
                     f"{segment}")
  why = problem(like.shape, like.dtype, m3[0].dtype, v3[0].dtype, group_size, group_axis)
  if why is not None:
    raise ValueError(f"{kernel}: {why}")
  groups = math.prod(like.shape) // group_size
  for name, (q, amax, code) in (("m", m3), ("v", v3)):
    for part, arr, need in (("codes", q, (packed_at + groups) * group_size),
                            ("amax", amax, packed_at + groups), ("k codes", code, packed_at + groups)):
      if arr.ndim != 1 or arr.shape[0] < need:
        raise ValueError(f"{kernel}: packed {name} {part} of shape {arr.shape} do not hold "
                         f"a slot of {groups} groups from group {packed_at}")
  return like


def _like(kernel: str, param, grad, output: str):
  """The array that fixes the shapes (param, or grad without one); ValueError naming `kernel`
  for an unknown output or output="param" without a param."""
  if output not in OUTPUTS:
    raise ValueError(f"{kernel}: output must be one of {OUTPUTS}, got {output!r}")
  if param is None and output == "param":
    raise ValueError(f"{kernel}: output='param' needs param")
  return grad if param is None else param
