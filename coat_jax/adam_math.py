"""The COAT AdamW step for one parameter, in jnp: the reference the fused kernel is checked against.

Per parameter p with gradient g at step t (t = 1, 2, ...), all arithmetic in float32 (COAT's):

  g' = clamp(s g, +-2^63) where s g is finite (NaN and inf pass unchanged), s the optional
       gradient scale (`grad_scale`, 1 when None: global-norm clipping fused into the step,
       see `clip_scale`),
  m = b1 m + (1 - b1) g',         v = b2 v + (1 - b2) g'^2,
  denom = (sqrt(v) / sqrt(1 - b2^t) + eps) * (1 - b1^t),
  direction = m / denom + wd * p,
  new p = p - lr * direction,     optax's update u = -lr * direction.

m / denom = m_hat / (sqrt(v_hat) + eps) with m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t): optax.adamw's
update (eps outside the root).

Huge gradients: a finite g with |g| > ~1.8e19 has g^2 = inf in float32. Unclamped, v = inf; once
v is stored in FP8 its group's amax is inf, which dequantizes to NaN, so the params go NaN on the
next step and every step after. Clamped, g'^2 <= 2^126 < float32 max, so m, v and the scales stay
finite from finite gradients (v <= max(v, 2^126) by induction). Adam's step is scale-free
(m_hat / sqrt(v_hat) ~ 1 for a gradient that dominates its history), so the element moves by
about lr, as for any large gradient, and its later steps shrink as m decays faster than v. optax
keeps v = inf there (update 0 from then on); both runs continue with finite params. The other
elements of the hit group share one amax (groups of 128) and are stored relative to it, coarser
until v decays (b2^t). Non-finite gradients still propagate (NaN is never hidden).

Moments are `ExpandedMoment`s (FP8 data + per-group amax and k_code, coat_jax.expansion) or
float32 arrays of the param's shape; a quantized moment is dequantized before and requantized
(fresh amax and k) after the update, its groups along `group_axis` of the param's own layout.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from coat_jax import expansion
from coat_jax.expansion import ExpandedMoment

OUTPUTS = ("param", "update")
GRAD_CLAMP = 2.0**63   # g^2 <= 2^126 < float32 max (2^128)


def clamp_gradient(g: jax.Array) -> jax.Array:
  """Finite float32 values clamped to +-GRAD_CLAMP; NaN and inf unchanged (never hidden)."""
  return jnp.where(jnp.abs(g) < jnp.inf, jnp.clip(g, -GRAD_CLAMP, GRAD_CLAMP), g)


def clip_scale(grad_norm, max_norm) -> jax.Array:
  """The gradient scale of clipping to global norm `max_norm`: float32
  where(grad_norm < max_norm, 1, max_norm / grad_norm).

  optax.clip_by_global_norm computes where(grad_norm < max_norm, g, (g / grad_norm) * max_norm)
  per element; g * clip_scale(...) differs from that by float32 rounding only (one rounding of
  max_norm / grad_norm instead of the per-element division). A NaN norm gives scale NaN and an
  inf norm scale 0, so the scaled gradient is NaN / 0 (NaN at an inf element), as optax's is.
  """
  grad_norm = jnp.asarray(grad_norm, jnp.float32)
  max_norm = jnp.asarray(max_norm, jnp.float32)
  return jnp.where(grad_norm < max_norm, jnp.float32(1.0), max_norm / grad_norm)


def adam_moments(g, m, v, *, b1, b2, eps, count, grad_scale=None):
  """Adam's moment update (g scaled by grad_scale unless None, then clamped) and direction
  m / denom: float32 (direction, m, v)."""
  g = g.astype(jnp.float32)
  if grad_scale is not None:
    g = g * jnp.asarray(grad_scale, jnp.float32)
  g = clamp_gradient(g)
  m = b1 * m + (1.0 - b1) * g
  v = b2 * v + (1.0 - b2) * (g * g)
  t = count.astype(jnp.float32)
  bc1 = 1.0 - jnp.power(jnp.asarray(b1, jnp.float32), t)
  bc2 = 1.0 - jnp.power(jnp.asarray(b2, jnp.float32), t)
  denom = (jnp.sqrt(v) / jnp.sqrt(bc2) + eps) * bc1
  return m / denom, m, v


def load_moment(moment, fmt, group_size, expand_min, group_axis=-1) -> jax.Array:
  """A moment as float32 (dequantized when it is an ExpandedMoment)."""
  if isinstance(moment, ExpandedMoment):
    return expansion.dequantize_expanded(moment, fmt, group_size, expand_min, group_axis)
  return moment.astype(jnp.float32)


def store_moment(x, like, fmt, group_size, expand, expand_min, group_axis=-1):
  """x stored as `like` is: requantized ExpandedMoment, or cast to like's dtype."""
  if isinstance(like, ExpandedMoment):
    return expansion.quantize_expanded(x, fmt, group_size, expand_min, expand, group_axis)
  return x.astype(like.dtype)


def adam_step_reference(param, grad, m, v, *, lr, b1, b2, eps, weight_decay, count, m_format,
                        v_format, group_size, expand, expand_min, output: str = "param",
                        group_axis: int = -1, grad_scale=None):
  """One parameter's full COAT step (the module docstring's math).

  Args:
    param: float array (master weight), shape S; None only with output="update" (no decay).
    grad: same shape (any float dtype).
    m, v: ExpandedMoment for S (formats m_format / v_format) or float32 arrays of shape S.
    lr, b1, b2, eps, weight_decay: scalars (float or float32 arrays).
    count: the step number t >= 1 (int32 array) used for bias correction.
    output: "param" or "update" (what the first result is).
    group_axis: the axis (negative) the quantized moments group along (-2: COAT's layout for a
      Flax (in, out) kernel; metadata (..., in/G, out)).
    grad_scale: None or a float32 scalar s: the step uses s * grad (in float32), e.g.
      `clip_scale(global norm, max_norm)` for clipping fused into the step.
  Returns:
    (new_param = param - lr * (m/denom + wd * param) in param.dtype, or with output="update" the
    optax update -lr * (m/denom + wd * param) in grad.dtype; new_m, new_v).
  """
  if output not in OUTPUTS:
    raise ValueError(f"adam_step_reference: output must be 'param' or 'update', got {output!r}")
  if param is None and output == "param":
    raise ValueError("adam_step_reference: output='param' needs param")
  m_f = load_moment(m, m_format, group_size, expand_min, group_axis)
  v_f = load_moment(v, v_format, group_size, expand_min, group_axis)
  direction, m_f, v_f = adam_moments(grad, m_f, v_f, b1=b1, b2=b2, eps=eps, count=count,
                                     grad_scale=grad_scale)
  if param is not None:
    direction = direction + weight_decay * param.astype(jnp.float32)
  new_m = store_moment(m_f, m, m_format, group_size, expand, expand_min, group_axis)
  new_v = store_moment(v_f, v, v_format, group_size, expand, expand_min, group_axis)
  if output == "update":
    return (-lr * direction).astype(grad.dtype), new_m, new_v
  new_param = param.astype(jnp.float32) - lr * direction
  return new_param.astype(param.dtype), new_m, new_v
