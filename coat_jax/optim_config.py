"""coat_adamw's static settings, checked once: `CoatAdamWConfig.make(...)`.

The settings that fix the state's shapes and the step's program (formats, group size and axis,
expansion, which params are quantized, master-weight rounding, fused clipping, state layout) are
Python values, checked here with one-line ValueErrors. The numeric hyperparameters (learning
rate, b1, b2, eps, weight decay) stay plain arguments of the step, so that
`optax.inject_hyperparams` may trace them.

Also here: `unwrap_variables`, which turns a tree of Flax NNX Variables (what
`flax.nnx.Optimizer` passes to `init`) into the tree of their values (what it passes to
`update`), so that both see one tree.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp

from coat_jax import expansion, formats
from coat_jax.formats import get_format
from coat_jax.rounding import MASTER_ROUNDINGS

__all__ = ["CoatAdamWConfig", "DEFAULT_EXPAND_MIN", "DEFAULT_GROUP_AXIS", "DEFAULT_GROUP_SIZE",
           "DEFAULT_MIN_QUANTIZED_SIZE", "GROUP_AXES", "STATE_LAYOUTS", "unwrap_variables"]

DEFAULT_GROUP_SIZE = formats.OPTIMIZER_GROUP_SIZE
DEFAULT_EXPAND_MIN = 16
DEFAULT_MIN_QUANTIZED_SIZE = 4096
GROUP_AXES = formats.OPTIMIZER_GROUP_AXES
DEFAULT_GROUP_AXIS = formats.OPTIMIZER_GROUP_AXIS
# how mu / nu are stored: a tree like params ("leaves") or flat buffers (coat_jax.packed_state)
STATE_LAYOUTS = ("leaves", "packed")


def unwrap_variables(tree: Any) -> Any:
  """`tree` with every Flax NNX `Variable` (nnx.Param, ...) replaced by its value.

  `flax.nnx.Optimizer` calls `init` with Variable-wrapped params (a leaf's path ends in
  `.value`) and `update` with plain arrays (`nnx.as_pure`); the optimizer works on the plain
  tree in both, so the state and each leaf's group axis are the same at init and update. A
  no-op when Flax NNX is not loaded (no Variable can exist then; numerics do not import Flax).
  """
  nnx = sys.modules.get("flax.nnx")
  variable = getattr(nnx, "Variable", None)
  if variable is None:
    return tree
  is_variable = lambda x: isinstance(x, variable)
  return jax.tree.map(lambda x: x.get_value() if is_variable(x) else x, tree,
                      is_leaf=is_variable)


def _static_int(value, name: str, default: int, minimum: int) -> int:
  """A Python int from an int or a concrete integer array; ValueError otherwise or if < minimum."""
  if value is None:
    return default
  if isinstance(value, jax.core.Tracer):
    raise ValueError(f"coat_adamw: {name} must be static (it sets array shapes); under "
                     f"optax.inject_hyperparams pass static_args=({name!r},)")
  if isinstance(value, bool) or not (isinstance(value, int) or (
      hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.integer) and value.ndim == 0)):
    raise ValueError(f"coat_adamw: {name} must be an int, got {value!r}")
  value = int(value)
  if value < minimum:
    raise ValueError(f"coat_adamw: {name} must be >= {minimum}, got {value}")
  return value


def _check_max_grad_norm(max_grad_norm):
  """ValueError unless max_grad_norm is None or > 0 (traced values, inject_hyperparams', pass)."""
  if max_grad_norm is None or isinstance(max_grad_norm, jax.core.Tracer):
    return
  ok = not isinstance(max_grad_norm, bool) and (isinstance(max_grad_norm, (int, float)) or
                                                hasattr(max_grad_norm, "dtype"))
  try:
    ok = ok and jnp.ndim(max_grad_norm) == 0 and float(max_grad_norm) > 0
  except (TypeError, ValueError):
    ok = False
  if not ok:
    raise ValueError(f"coat_adamw: max_grad_norm must be None or a number > 0, got "
                     f"{max_grad_norm!r}")


@dataclasses.dataclass(frozen=True)
class CoatAdamWConfig:
  """coat_adamw's static settings (see `coat_jax.optim.coat_adamw` for each), checked.

  m_format, v_format: format names ("e4m3", "e5m2", "int8"); group_size: G; expand,
  expand_min: dynamic range expansion; quantize, min_quantized_size: which params get FP8
  moments (`quantized`); master_rounding: "nearest" | "stochastic" | "kahan"; group_axis:
  "coat" | "last" | a callable (`optim_state.group_axes`); max_grad_norm: None or the fused
  clipping norm; state_layout: "leaves" | "packed".
  """
  m_format: str = "e4m3"
  v_format: str = "e4m3"
  group_size: int = DEFAULT_GROUP_SIZE
  expand: bool = True
  expand_min: int = DEFAULT_EXPAND_MIN
  quantize: bool = True
  min_quantized_size: int = DEFAULT_MIN_QUANTIZED_SIZE
  master_rounding: str = "nearest"
  group_axis: str | Callable[[Any], Any] = DEFAULT_GROUP_AXIS
  max_grad_norm: Any = None
  state_layout: str = "leaves"

  @classmethod
  def make(cls, *, m_format: str = "e4m3", v_format: str = "e4m3", group_size=None,
           expand: bool = True, expand_min=None, quantize: bool = True,
           min_quantized_size=None, master_rounding: str = "nearest",
           group_axis=DEFAULT_GROUP_AXIS, max_grad_norm=None,
           state_layout: str = "leaves") -> "CoatAdamWConfig":
    """The checked settings; the integer knobs' None means their default. ValueError (one
    line, naming the argument) for an unknown format, layout, rounding or group_axis, an int
    knob that is not a static int >= its minimum, or max_grad_norm <= 0."""
    _check_max_grad_norm(max_grad_norm)
    if state_layout not in STATE_LAYOUTS:
      raise ValueError(f"coat_adamw: state_layout must be one of {STATE_LAYOUTS}, got "
                       f"{state_layout!r}")
    if not callable(group_axis) and group_axis not in GROUP_AXES:
      raise ValueError(f"coat_adamw: group_axis must be one of {GROUP_AXES} or a callable "
                       f"params -> tree of axes, got {group_axis!r}")
    if master_rounding not in MASTER_ROUNDINGS:
      raise ValueError(f"coat_adamw: master_rounding must be one of {MASTER_ROUNDINGS}, "
                       f"got {master_rounding!r}")
    m_fmt, v_fmt = get_format(m_format).name, get_format(v_format).name
    group_size = _static_int(group_size, "group_size", DEFAULT_GROUP_SIZE, minimum=1)
    expand_min = _static_int(expand_min, "expand_min", DEFAULT_EXPAND_MIN, minimum=1)
    if expand_min > expansion.MAX_K_CODE:
      raise ValueError(f"coat_adamw: expand_min must be <= {expansion.MAX_K_CODE} (k=1 must "
                       f"fit the uint8 k_code), got {expand_min}")
    min_quantized_size = _static_int(min_quantized_size, "min_quantized_size",
                                     DEFAULT_MIN_QUANTIZED_SIZE, minimum=0)
    return cls(m_fmt, v_fmt, group_size, expand, expand_min, quantize, min_quantized_size,
               master_rounding, group_axis, max_grad_norm, state_layout)

  def quantized(self, param) -> bool:
    """Whether `param`'s moments are FP8 (ExpandedMoment): quantize on and at least
    min_quantized_size (and 1) elements; float32 otherwise."""
    return self.quantize and jnp.size(param) >= max(self.min_quantized_size, 1)

  @property
  def kahan(self) -> bool:
    return self.master_rounding == "kahan"

  @property
  def packed(self) -> bool:
    return self.state_layout == "packed"

  @property
  def moment_args(self) -> dict:
    """The moments' quantization arguments every step call takes: formats, G, expansion."""
    return dict(m_format=self.m_format, v_format=self.v_format, group_size=self.group_size,
                expand=self.expand, expand_min=self.expand_min)
