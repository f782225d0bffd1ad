"""Attention (BF16 in all modes) through jax.nn.dot_product_attention, with GQA."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def attention(q, k, v, *, causal: bool = True, implementation=None):
  """q (B, S, Hq, Dh), k/v (B, S, Hkv, Dh), Hq % Hkv == 0. Returns (B, S, Hq, Dh) in q.dtype.

  implementation None -> "cudnn" on GPU; elsewhere "xla" under jax.checkpoint so only q, k, v
  are saved (flash-attention-like memory instead of the (S, S) probabilities).
  """
  if k.shape != v.shape or q.ndim != 4 or q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
    raise ValueError(f"attention: bad shapes q {q.shape}, k {k.shape}, v {v.shape}")
  if implementation is None:  # cuDNN's fused attention takes 16-bit (or FP8) inputs only.
    # Its partitioner also wants q, k and v sharded alike, which FSDP-sharded projections do
    # not guarantee: with several devices XLA's attention is used.
    cudnn_ok = (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
                and jax.device_count() == 1)
    implementation = "cudnn" if cudnn_ok else "xla"
  fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                     implementation=implementation)
  if implementation == "xla":
    fn = jax.checkpoint(fn)
  return fn(q, k, v)
