"""The COAT AdamW step for one parameter, in jnp: the reference the fused kernel is checked against.

Per parameter p with gradient g at step t (t = 1, 2, ...), all arithmetic in float32 (COAT's):

  m = sat(b1 m + (1 - b1) g),     v = sat(b2 v + (1 - b2) g^2),
  denom = (sqrt(v) / sqrt(1 - b2^t) + eps) * (1 - b1^t),
  direction = m / denom + wd * p,
  new p = p - lr * direction,     optax's update u = -lr * direction,

where sat(x) clamps to +-float32 max (NaN stays NaN). m / denom = m_hat / (sqrt(v_hat) + eps)
with m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t): optax.adamw's update (eps outside the root).

Saturation: a finite gradient with |g| > ~1.8e19 has g^2 = inf in float32. Unsaturated, v = inf,
and once v is stored in FP8 its group's amax is inf, which dequantizes to NaN: the params go NaN
on the next step and every step after. Saturated, v = float32 max for that element: the moments
and scales stay finite, the element takes one step of lr * m_hat / sqrt(v_hat) (bounded) and the
run goes on; the other elements of the group (128 share one amax) are represented relative to
that huge amax until v decays (b2^t), coarser but finite. optax.adamw keeps v = inf per element
(its update there is 0 from then on); both continue with finite params.

Moments are `ExpandedMoment`s (FP8 data + per-group amax and k_code, coat_jax.expansion) or
float32 arrays of the param's shape; a quantized moment is dequantized before and requantized
(fresh amax and k) after the update.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from coat_jax import expansion
from coat_jax.expansion import ExpandedMoment

OUTPUTS = ("param", "update")
FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)


def saturate_float32(x: jax.Array) -> jax.Array:
  """Clamps to +-float32 max; NaN stays NaN (so a NaN gradient is never hidden)."""
  return jnp.clip(x, -FLOAT32_MAX, FLOAT32_MAX)


def adam_moments(g, m, v, *, b1, b2, eps, count):
  """Adam's moment update (saturated) and direction m / denom: float32 (direction, m, v)."""
  g = g.astype(jnp.float32)
  m = saturate_float32(b1 * m + (1.0 - b1) * g)
  v = saturate_float32(b2 * v + (1.0 - b2) * (g * g))
  t = count.astype(jnp.float32)
  bc1 = 1.0 - jnp.power(jnp.asarray(b1, jnp.float32), t)
  bc2 = 1.0 - jnp.power(jnp.asarray(b2, jnp.float32), t)
  denom = (jnp.sqrt(v) / jnp.sqrt(bc2) + eps) * bc1
  return m / denom, m, v


def load_moment(moment, fmt, group_size, expand_min) -> jax.Array:
  """A moment as float32 (dequantized when it is an ExpandedMoment)."""
  if isinstance(moment, ExpandedMoment):
    return expansion.dequantize_expanded(moment, fmt, group_size, expand_min)
  return moment.astype(jnp.float32)


def store_moment(x, like, fmt, group_size, expand, expand_min):
  """x stored as `like` is: requantized ExpandedMoment, or cast to like's dtype."""
  if isinstance(like, ExpandedMoment):
    return expansion.quantize_expanded(x, fmt, group_size, expand_min, expand)
  return x.astype(like.dtype)


def adam_step_reference(param, grad, m, v, *, lr, b1, b2, eps, weight_decay, count, m_format,
                        v_format, group_size, expand, expand_min, output: str = "param"):
  """One parameter's full COAT step (the module docstring's math).

  Args:
    param: float array (master weight), shape S; None only with output="update" (no decay).
    grad: same shape (any float dtype).
    m, v: ExpandedMoment for S (formats m_format / v_format) or float32 arrays of shape S.
    lr, b1, b2, eps, weight_decay: scalars (float or float32 arrays).
    count: the step number t >= 1 (int32 array) used for bias correction.
    output: "param" or "update" (what the first result is).
  Returns:
    (new_param = param - lr * (m/denom + wd * param) in param.dtype, or with output="update" the
    optax update -lr * (m/denom + wd * param) in grad.dtype; new_m, new_v).
  """
  if output not in OUTPUTS:
    raise ValueError(f"adam_step_reference: output must be 'param' or 'update', got {output!r}")
  if param is None and output == "param":
    raise ValueError("adam_step_reference: output='param' needs param")
  m_f = load_moment(m, m_format, group_size, expand_min)
  v_f = load_moment(v, v_format, group_size, expand_min)
  direction, m_f, v_f = adam_moments(grad, m_f, v_f, b1=b1, b2=b2, eps=eps, count=count)
  if param is not None:
    direction = direction + weight_decay * param.astype(jnp.float32)
  new_m = store_moment(m_f, m, m_format, group_size, expand, expand_min)
  new_v = store_moment(v_f, v, v_format, group_size, expand, expand_min)
  if output == "update":
    return (-lr * direction).astype(grad.dtype), new_m, new_v
  new_param = param.astype(jnp.float32) - lr * direction
  return new_param.astype(param.dtype), new_m, new_v
