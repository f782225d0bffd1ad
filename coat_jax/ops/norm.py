"""RMSNorm: y = x * rsqrt(mean(x^2) + eps) * scale, float32 internal math.

"coat": a custom_vjp saving only x per 1x16 group (E4M3) and rstd (float32, (..., 1)); it also
returns y_q, the per-tensor E4M3 copy of y that the following linears consume through `x_q`.
With linear_residuals "remade" (`ops.linear_layer`), y_q carries those two residuals and the
scale instead of y^T's codes: the linears' backward remakes y^T from them
(`kernels.remade_codes_t`, kind "rmsnorm").
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from coat_jax import kernels
from coat_jax.formats import ACTIVATION_GROUP_SIZE
from coat_jax.ops.linear_layer import (check_linear_residuals, name_residuals, quantize_input,
                                       remade_input)
from coat_jax.precision import check_precision


def _rstd(x32, eps):
  return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def _plain(x, scale, eps):
  x32 = x.astype(jnp.float32)
  return (x32 * _rstd(x32, eps) * scale.astype(jnp.float32)).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rmsnorm_coat(x, scale, eps, linear_residuals):
  if linear_residuals == "remade":
    return _coat_fwd(x, scale, eps, linear_residuals)[0]
  y = _plain(x, scale, eps)
  return y, quantize_input(y)


def _coat_fwd(x, scale, eps, linear_residuals):
  x32 = x.astype(jnp.float32)
  rstd = _rstd(x32, eps)
  y = (x32 * rstd * scale.astype(jnp.float32)).astype(x.dtype)
  xg, rstd = name_residuals((kernels.quantize_per_group(x, ACTIVATION_GROUP_SIZE, "e4m3"), rstd))
  if linear_residuals == "remade":
    y_q = remade_input(y, None, (xg, rstd, scale), "rmsnorm")
  else:
    y_q = quantize_input(y)
  return (y, y_q), (xg, rstd, scale)


def _coat_bwd(eps, linear_residuals, res, cts):
  xg, rstd, scale = res
  g, _ = cts  # y_q carries no gradient.
  x = kernels.dequantize(xg, jnp.float32)
  g32 = g.astype(jnp.float32)
  s32 = scale.astype(jnp.float32)
  xhat = x * rstd
  dscale = jnp.sum((g32 * xhat).reshape(-1, x.shape[-1]), axis=0)
  gs = g32 * s32
  dx = rstd * (gs - xhat * jnp.mean(gs * xhat, axis=-1, keepdims=True))
  return dx.astype(g.dtype), dscale.astype(scale.dtype)


_rmsnorm_coat.defvjp(_coat_fwd, _coat_bwd)


def rmsnorm(x: jax.Array, scale: jax.Array, *, eps: float = 1e-6, mode: str,
            linear_residuals: str = "kept"):
  """Returns (y, y_q): y (..., D) in x.dtype; y_q per-tensor E4M3 of y in "coat", else None.
  linear_residuals ("coat"): what the linears fed by y_q keep for dW (module docstring)."""
  check_precision(mode, "rmsnorm: mode")
  check_linear_residuals(linear_residuals, "rmsnorm: linear_residuals")
  if scale.shape != (x.shape[-1],):
    raise ValueError(f"rmsnorm: scale shape {scale.shape} does not match x shape {x.shape}")
  if mode == "coat":
    return _rmsnorm_coat(x, scale, eps, linear_residuals)
  # The float32 intermediates are recomputed in the backward (elementwise, cheap) so only x and
  # scale are saved. Unrolled, XLA does this by itself; inside the scan over layers JAX would
  # otherwise save the float32 upcasts of every layer (2x a bf16 model's activation memory).
  return jax.checkpoint(_plain, static_argnums=(2,))(x, scale, eps), None
