"""SwiGLU product h = silu(gate) * up, and the MLP's first half h = silu(x W_g) * (x W_u).

"coat": a custom_vjp saving gate and up per 1x16 group (E4M3) only; silu is recomputed in the
backward (2 saved tensors instead of COAT's 3). Returns h_q, per-tensor E4M3 of h, for the down
projection's `x_q`. `swiglu_linears` (the MLP's gate, up and SwiGLU) makes h, max|h| and the
two residuals in the gate/up GEMM's epilogue (`kernels.gemm_swiglu_quantize`; the default of
the ablation switch `linear_ablation.ablation(swiglu_quantize=...)`, "gemm_epilogue"); `swiglu` of
gate and up already made, and `swiglu_linears` under "fused", make them from one read of gate and
up (`kernels.swiglu_quantize`); "separate" is the unfused ablation. With linear_residuals
"remade" (`ops.linear_layer`), h_q carries gate's and up's codes instead of h^T's: the down
projection's backward remakes h^T from them (`kernels.remade_codes_t`, kind "swiglu").

Backward (both ops), with a = gate, u = up, s = sigmoid(a) from the dequantized residuals:
  d_gate = dh * u * s * (1 + a (1 - s)),   d_up = dh * a * s
(`kernels.swiglu_backward`: one pass that also gives max|d_gate| and max|d_up|, which
`swiglu_linears` hands to its GEMMs' backward quantize).
"""
from __future__ import annotations

import functools

import jax

from coat_jax import kernels
from coat_jax.activations import silu_product as _plain
from coat_jax.formats import ACTIVATION_GROUP_SIZE
from coat_jax.ops.linear_ablation import option
from coat_jax.ops.linear_layer import (backward_gemms, check_input_q, check_linear_residuals,
                                       check_weight, forward_operand, input_codes_t,
                                       input_residuals, linears, name_residuals, quantize_input,
                                       remade_input, weight_amax, zero_input_cotangent)
from coat_jax.precision import check_precision
from coat_jax.quantize import QuantizedArray


def _h_q(h, h_amax, gq, uq, linear_residuals):
  """h's per-tensor E4M3 for the down projection: with h^T's codes, or with gate's and up's
  codes to remake them from ("remade")."""
  if linear_residuals == "remade":
    return remade_input(h, h_amax, (gq, uq), "swiglu")
  return quantize_input(h, amax=h_amax)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _swiglu_coat(gate, up, linear_residuals):
  if linear_residuals == "remade":
    return _coat_fwd(gate, up, linear_residuals)[0]
  h = _plain(gate, up)
  return h, quantize_input(h)


def _coat_fwd(gate, up, linear_residuals):
  if option("swiglu_quantize") != "separate":
    h, h_amax, gq, uq = kernels.swiglu_quantize(gate, up, ACTIVATION_GROUP_SIZE, "e4m3")
  else:
    h, h_amax = _plain(gate, up), None
    gq, uq = (kernels.quantize_per_group(a, ACTIVATION_GROUP_SIZE, "e4m3") for a in (gate, up))
  gq, uq = name_residuals((gq, uq))
  return (h, _h_q(h, h_amax, gq, uq, linear_residuals)), (gq, uq)


def _coat_bwd(linear_residuals, res, cts):
  gq, uq = res
  return kernels.swiglu_backward(gq, uq, cts[0])[:2]


_swiglu_coat.defvjp(_coat_fwd, _coat_bwd)


def swiglu(gate: jax.Array, up: jax.Array, *, mode: str, linear_residuals: str = "kept"):
  """Returns (h, h_q); gate, up and h share shape (..., F) and dtype; h_q None unless "coat".
  linear_residuals ("coat"): what the down projection fed by h_q keeps (module docstring)."""
  check_precision(mode, "swiglu: mode")
  check_linear_residuals(linear_residuals, "swiglu: linear_residuals")
  if gate.shape != up.shape:
    raise ValueError(f"swiglu: gate shape {gate.shape} != up shape {up.shape}")
  if mode == "coat":
    return _swiglu_coat(gate, up, linear_residuals)
  # Only gate and up are saved; the float32 silu and product are recomputed in the backward
  # (see ops/norm.py: inside the scan over layers JAX would save the float32 intermediates).
  return jax.checkpoint(_plain)(gate, up), None


def weight_codes_t(w, dtype):
  """W (K, F) -> (its amax, W^T's per-tensor E4M3 codes (F, K)): the dispatch's quantize writes
  W^T's codes itself, reading the layer's slice of W as it lies. Letting XLA transpose W's codes
  instead made XLA relayout the whole stacked gate and up weights inside the microbatch loop
  (on an H200, 20.3e9 parameters: two bfloat16 (L, K, F) copies, 14.6 GiB more at the step's
  peak, `benchmarks/step/step_memory.py`), at the same layer time."""
  wc = w.astype(dtype)
  amax = weight_amax(wc)
  q = kernels.quantize_per_tensor(wc, "e4m3", amax=amax, with_transpose=True)
  return amax, QuantizedArray(q.data_t, q.scale, q.fmt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _swiglu_linears_coat(x, w_gate, w_up, x_q, linear_residuals):
  return _swiglu_linears_fwd(x, w_gate, w_up, x_q, linear_residuals)[0]


def _swiglu_linears_fwd(x, w_gate, w_up, x_q, linear_residuals):
  (ag, wgq), (au, wuq) = weight_codes_t(w_gate, x.dtype), weight_codes_t(w_up, x.dtype)
  h, h_amax, gq, uq = kernels.gemm_swiglu_quantize(forward_operand(x_q), wgq, wuq, x.dtype,
                                                   ACTIVATION_GROUP_SIZE, "e4m3")
  gq, uq, ag, au = name_residuals((gq, uq, ag, au))
  res = (*input_residuals(x_q), gq, uq, ag, au, w_gate, w_up)
  return (h, _h_q(h, h_amax, gq, uq, linear_residuals)), res


def _swiglu_linears_bwd(linear_residuals, res, cts):
  x_t, x_scale, gq, uq, ag, au, w_gate, w_up = res
  dgate, dup, dgate_amax, dup_amax = kernels.swiglu_backward(gq, uq, cts[0])
  codes_t = input_codes_t(x_t)   # a remade x^T made once for both linears
  dx_gate, dw_gate = backward_gemms(codes_t, x_scale, w_gate, dgate, (ag, None, None), dgate_amax)
  dx_up, dw_up = backward_gemms(codes_t, x_scale, w_up, dup, (au, None, None), dup_amax)
  dx = dx_gate + dx_up
  return dx, dw_gate, dw_up, zero_input_cotangent(dx, x_t, x_scale)


_swiglu_linears_coat.defvjp(_swiglu_linears_fwd, _swiglu_linears_bwd)


def swiglu_linears(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, *, mode: str, x_q=None,
                   linear_residuals: str = "kept"):
  """(h, h_q) of h = silu(x @ w_gate) * (x @ w_up): `swiglu(*linears(x, (w_gate, w_up)))`.

  x (..., K) in the compute dtype; w_gate, w_up (K, F) parameters; x_q as for `linears`. In
  "coat" with x_q and swiglu_quantize "gemm_epilogue" (the default, `linear_ablation.ablation`),
  one op whose forward is the gate/up GEMM with SwiGLU in its epilogue and whose backward runs
  SwiGLU's backward, then both linears' (the same GEMMs as `linears`' backward); otherwise
  exactly `swiglu(*linears(...))`.
  linear_residuals: as `swiglu`'s.
  """
  check_precision(mode, "swiglu_linears: mode")
  check_linear_residuals(linear_residuals, "swiglu_linears: linear_residuals")
  if w_gate.shape != w_up.shape:
    raise ValueError(f"swiglu_linears: gate weight {w_gate.shape} != up weight {w_up.shape}")
  if mode == "coat" and x_q is not None and option("swiglu_quantize") == "gemm_epilogue":
    check_weight(x, w_gate)
    check_input_q(x, x_q)
    return _swiglu_linears_coat(x, w_gate, w_up, x_q, linear_residuals)
  return swiglu(*linears(x, (w_gate, w_up), mode=mode, x_q=x_q), mode=mode,
                linear_residuals=linear_residuals)
