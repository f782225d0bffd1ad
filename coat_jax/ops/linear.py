"""Linear layer y = x @ w in three precision modes ("bf16", "fp8_linear", "coat").

FP8 modes: forward x per-tensor E4M3 and w per-tensor E4M3, one FP8 GEMM (float32 accumulation,
"TN": w is quantized as its transpose (N, K)). Backward: dY per-tensor E5M2 (current scaling),
dX = dY . W^T and dW = X^T . dY as FP8 GEMMs. W is re-quantized in the backward from the parameter
(no FP8 copy of W is saved). "coat" saves only the FP8 x (data + scale) and w; "fp8_linear" saves
the bf16 x and w.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from coat_jax import kernels

MODES = ("bf16", "fp8_linear", "coat")


def check_mode(mode: str) -> None:
  if mode not in MODES:
    raise ValueError(f"unknown precision mode {mode!r}; expected one of {MODES}")


def _fwd_gemm(xq, w, out_dtype):
  """(..., K) FP8 x times w (K, N) in the TN layout: w quantized as (N, K)."""
  wq = kernels.quantize_per_tensor(jnp.swapaxes(w, 0, 1), "e4m3")
  dn = (((xq.data.ndim - 1,), (1,)), ((), ()))
  return kernels.fp8_dot_general(xq, wq, dn, out_dtype)


def _bwd_gemms(xq, w, g):
  """dX (..., K) and dW (K, N) from FP8 x, param w and cotangent g (..., N)."""
  gq = kernels.quantize_per_tensor(g, "e5m2")
  wq = kernels.quantize_per_tensor(w, "e4m3")  # (K, N): contracts N, its last axis (TN).
  nd = g.ndim
  dx = kernels.fp8_dot_general(gq, wq, (((nd - 1,), (1,)), ((), ())), g.dtype)
  k, n = w.shape
  x2 = type(xq)(xq.data.reshape(-1, k), xq.scale, xq.fmt, xq.group_size)
  g2 = type(gq)(gq.data.reshape(-1, n), gq.scale, gq.fmt, gq.group_size)
  dw = kernels.fp8_dot_general(x2, g2, (((0,), (0,)), ((), ())), jnp.float32)
  return dx, dw.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _linear_fp8(x, w, save_bf16):
  xq = kernels.quantize_per_tensor(x, "e4m3")
  return _fwd_gemm(xq, w, x.dtype)


def _linear_fp8_fwd(x, w, save_bf16):
  xq = kernels.quantize_per_tensor(x, "e4m3")
  y = _fwd_gemm(xq, w, x.dtype)
  return y, ((x if save_bf16 else xq), w)


def _linear_fp8_bwd(save_bf16, res, g):
  x_or_q, w = res
  xq = kernels.quantize_per_tensor(x_or_q, "e4m3") if save_bf16 else x_or_q
  dx, dw = _bwd_gemms(xq, w, g)
  return dx, dw


_linear_fp8.defvjp(_linear_fp8_fwd, _linear_fp8_bwd)


@jax.custom_vjp
def _linear_coat_q(x, w, x_q):
  return _fwd_gemm(x_q, w, x.dtype)


def _linear_coat_q_fwd(x, w, x_q):
  return _fwd_gemm(x_q, w, x.dtype), (x_q, w)


def _linear_coat_q_bwd(res, g):
  x_q, w = res
  dx, dw = _bwd_gemms(x_q, w, g)
  return dx, dw, jax.tree_util.tree_map(jnp.zeros_like, x_q)


_linear_coat_q.defvjp(_linear_coat_q_fwd, _linear_coat_q_bwd)


def linear(x: jax.Array, w: jax.Array, *, mode: str, x_q=None) -> jax.Array:
  """y = x @ w.

  Args:
    x: (..., K) bf16 or float32.
    w: (K, N) parameter (in, out); computed in x.dtype.
    mode: "bf16" | "fp8_linear" | "coat".
    x_q: optional per-tensor E4M3 QuantizedArray of x made upstream (fp8 modes use it instead
      of re-quantizing x; its cotangent is zero, the gradient flows through x).
  Returns:
    (..., N) in x.dtype.
  """
  check_mode(mode)
  if w.ndim != 2 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"linear: x shape {x.shape} does not match w shape {w.shape} "
                     "(need x[..., K] and w[K, N])")
  w = w.astype(x.dtype)
  if mode == "bf16":
    return jnp.matmul(x, w)
  if x_q is not None:
    if x_q.shape != x.shape or not x_q.per_tensor:
      raise ValueError(f"linear: x_q must be per-tensor with shape {x.shape}, got {x_q.shape}")
    if mode == "coat":
      return _linear_coat_q(x, w, x_q)
  return _linear_fp8(x, w, mode == "fp8_linear")
