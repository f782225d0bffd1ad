"""Attention in the compute dtype through jax.nn.dot_product_attention, with GQA.

What the backward keeps (`residuals`):
  "bf16": q, k and v in their own dtype (the XLA path runs under jax.checkpoint, so the (S, S)
    probabilities are recomputed, not kept; cuDNN keeps its own softmax statistics).
  "fp8":  per 1 x 16 group (along head_dim) E4M3 copies of q, k and v (1 byte per value plus one
    bfloat16 scale per 16 values, formats.ACTIVATION_SCALE_DTYPE: 1.125 bytes instead of bf16's
    2). The backward dequantizes them
    to the compute dtype and takes the VJP of the attention recomputed on the dequantized q, k, v
    (one extra attention forward). The forward output is exact; only the gradients see FP8.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from coat_jax import kernels
from coat_jax.formats import ACTIVATION_GROUP_SIZE
from coat_jax.ops.linear_layer import name_residuals

ATTENTION_RESIDUALS = ("bf16", "fp8")


def _attend(q, k, v, causal, implementation):
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention_fp8_saved(q, k, v, causal, implementation):
  return _attend(q, k, v, causal, implementation)


def _fp8_saved_fwd(q, k, v, causal, implementation):
  saved = tuple(kernels.quantize_per_group(t, ACTIVATION_GROUP_SIZE, "e4m3") for t in (q, k, v))
  return _attend(q, k, v, causal, implementation), name_residuals(saved)


def _fp8_saved_bwd(causal, implementation, saved, do):
  q, k, v = (kernels.dequantize(t, do.dtype) for t in saved)
  _, pullback = jax.vjp(lambda q, k, v: _attend(q, k, v, causal, implementation), q, k, v)
  return pullback(do)


_attention_fp8_saved.defvjp(_fp8_saved_fwd, _fp8_saved_bwd)


def check_attention_residuals(value, where: str = "attention_residuals") -> str:
  """Returns `value` if it is one of ATTENTION_RESIDUALS, else raises a ValueError naming it."""
  if value not in ATTENTION_RESIDUALS:
    raise ValueError(f"{where} must be one of {ATTENTION_RESIDUALS}, got {value!r}")
  return value


def attention(q, k, v, *, causal: bool = True, implementation=None, residuals: str = "bf16"):
  """q (B, S, Hq, Dh), k/v (B, S, Hkv, Dh), Hq % Hkv == 0. Returns (B, S, Hq, Dh) in q.dtype.

  implementation None -> "cudnn" on GPU; elsewhere "xla" (under jax.checkpoint with "bf16"
  residuals, so only q, k, v are saved: flash-attention-like memory instead of the (S, S)
  probabilities). residuals: "bf16" | "fp8", what the backward keeps (module docstring).
  """
  if k.shape != v.shape or q.ndim != 4 or q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
    raise ValueError(f"attention: bad shapes q {q.shape}, k {k.shape}, v {v.shape}")
  check_attention_residuals(residuals, "attention: residuals")
  if residuals == "fp8" and not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"attention: fp8 residuals need one dtype for q, k, v, got "
                     f"{q.dtype}, {k.dtype}, {v.dtype}")
  if implementation is None:  # cuDNN's fused attention takes 16-bit (or FP8) inputs only.
    # Its partitioner also wants q, k and v sharded alike, which FSDP-sharded projections do
    # not guarantee: with several devices XLA's attention is used.
    cudnn_ok = (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
                and jax.device_count() == 1)
    implementation = "cudnn" if cudnn_ok else "xla"
  if residuals == "fp8":
    return _attention_fp8_saved(q, k, v, causal, implementation)
  fn = functools.partial(_attend, causal=causal, implementation=implementation)
  if implementation == "xla":
    fn = jax.checkpoint(fn)
  return fn(q, k, v)
