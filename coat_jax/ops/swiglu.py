"""SwiGLU product h = silu(gate) * up.

"coat": a custom_vjp saving gate and up per 1x16 group (E4M3) only; silu is recomputed in the
backward (2 saved tensors instead of COAT's 3). Returns h_q, per-tensor E4M3 of h, for the down
projection's `x_q`. The forward makes h, max|h| and the two residuals from one read of gate and
up (`kernels.swiglu_quantize`; `linear_options(swiglu_quantize="separate")` for the unfused
ablation).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from coat_jax import kernels
from coat_jax.activations import silu_product as _plain
from coat_jax.formats import ACTIVATION_GROUP_SIZE
from coat_jax.ops.linear_layer import name_residuals, option, quantize_input
from coat_jax.precision import check_precision


@jax.custom_vjp
def _swiglu_coat(gate, up):
  h = _plain(gate, up)
  return h, quantize_input(h)


def _coat_fwd(gate, up):
  if option("swiglu_quantize") == "fused":
    h, h_amax, gq, uq = kernels.swiglu_quantize(gate, up, ACTIVATION_GROUP_SIZE, "e4m3")
    return (h, quantize_input(h, amax=h_amax)), name_residuals((gq, uq))
  h = _plain(gate, up)
  res = name_residuals((kernels.quantize_per_group(gate, ACTIVATION_GROUP_SIZE, "e4m3"),
                        kernels.quantize_per_group(up, ACTIVATION_GROUP_SIZE, "e4m3")))
  return (h, quantize_input(h)), res


def _coat_bwd(res, cts):
  gq, uq = res
  dh, _ = cts
  a = kernels.dequantize(gq, jnp.float32)
  u = kernels.dequantize(uq, jnp.float32)
  d = dh.astype(jnp.float32)
  sig = jax.nn.sigmoid(a)
  silu = a * sig
  dgate = d * u * sig * (1.0 + a * (1.0 - sig))
  dup = d * silu
  return dgate.astype(dh.dtype), dup.astype(dh.dtype)


_swiglu_coat.defvjp(_coat_fwd, _coat_bwd)


def swiglu(gate: jax.Array, up: jax.Array, *, mode: str):
  """Returns (h, h_q); gate, up and h share shape (..., F) and dtype; h_q None unless "coat"."""
  check_precision(mode, "swiglu: mode")
  if gate.shape != up.shape:
    raise ValueError(f"swiglu: gate shape {gate.shape} != up shape {up.shape}")
  if mode == "coat":
    return _swiglu_coat(gate, up)
  # Only gate and up are saved; the float32 silu and product are recomputed in the backward
  # (see ops/norm.py: inside the scan over layers JAX would save the float32 intermediates).
  return jax.checkpoint(_plain)(gate, up), None
