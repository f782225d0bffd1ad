"""Attention in the compute dtype through jax.nn.dot_product_attention, with GQA.

What the backward keeps (`residuals`):
  "bf16": q, k and v in their own dtype (the XLA path runs under jax.checkpoint, so the (S, S)
    probabilities are recomputed, not kept; cuDNN keeps its own softmax statistics).
  "fp8":  per 1 x 16 group (along head_dim) E4M3 copies of q, k and v (1 byte per value plus one
    bfloat16 scale per 16 values, formats.ACTIVATION_SCALE_DTYPE: 1.125 bytes instead of bf16's
    2). The backward dequantizes them
    to the compute dtype and takes the VJP of the attention recomputed on the dequantized q, k, v
    (one extra attention forward). The forward output is exact; only the gradients see FP8.

Packed sequences (`segment_ids`, (B, S) ints): a query attends only to keys of its own segment
(and, causal, not after itself), so several examples packed into one row never see each other.
The mask is `jax.nn.dot_product_attention`'s boolean `mask`, (B, 1, S, S), built from the ids
where the attention runs (and again in a recomputation); on the cuDNN path JAX turns it into an
additive (B, 1, S, S) bias in q's dtype (S = 2048, B = 8: 64 MB while one attention runs).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from coat_jax import kernels
from coat_jax.formats import ACTIVATION_GROUP_SIZE
from coat_jax.ops.linear_layer import name_residuals

ATTENTION_RESIDUALS = ("bf16", "fp8")


def segment_mask(segment_ids: jax.Array) -> jax.Array:
  """(B, S) segment ids -> (B, 1, S, S) bool: query i may see key j when their ids are equal."""
  return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def _attend(q, k, v, segment_ids, causal, implementation):
  mask = None if segment_ids is None else segment_mask(segment_ids)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                      implementation=implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention_fp8_saved(q, k, v, segment_ids, causal, implementation):
  return _attend(q, k, v, segment_ids, causal, implementation)


def _fp8_saved_fwd(q, k, v, segment_ids, causal, implementation):
  saved = tuple(kernels.quantize_per_group(t, ACTIVATION_GROUP_SIZE, "e4m3") for t in (q, k, v))
  out = _attend(q, k, v, segment_ids, causal, implementation)
  return out, (name_residuals(saved), segment_ids)


def _fp8_saved_bwd(causal, implementation, res, do):
  saved, segment_ids = res
  q, k, v = (kernels.dequantize(t, do.dtype) for t in saved)
  attend = lambda q, k, v: _attend(q, k, v, segment_ids, causal, implementation)
  _, pullback = jax.vjp(attend, q, k, v)
  return (*pullback(do), None)


_attention_fp8_saved.defvjp(_fp8_saved_fwd, _fp8_saved_bwd)


def _implementation(q, implementation):
  """The implementation `attention` runs for q: the one asked for, else "cudnn" or "xla"."""
  if implementation is not None:
    return implementation
  # cuDNN's fused attention takes 16-bit (or FP8) inputs only. Its partitioner also wants q, k
  # and v sharded alike, which FSDP-sharded projections do not guarantee: with several devices
  # XLA's attention is used.
  cudnn_ok = (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
              and jax.device_count() == 1)
  return "cudnn" if cudnn_ok else "xla"


def attention_keeps_output(q, *, implementation=None, residuals: str = "bf16") -> bool:
  """True when `attention(q, ..., implementation=, residuals=)` keeps its output for its backward:
  cuDNN's fused attention with "bf16" residuals does (its backward reads the output); XLA's
  recomputes it and "fp8" residuals keep q, k and v only. The next linear (o_proj) can then keep
  that same array for its own backward instead of a copy (`ops.linear`'s keep_x)."""
  return residuals == "bf16" and _implementation(q, implementation) == "cudnn"


def check_attention_residuals(value, where: str = "attention_residuals") -> str:
  """Returns `value` if it is one of ATTENTION_RESIDUALS, else raises a ValueError naming it."""
  if value not in ATTENTION_RESIDUALS:
    raise ValueError(f"{where} must be one of {ATTENTION_RESIDUALS}, got {value!r}")
  return value


def attention(q, k, v, *, causal: bool = True, implementation=None, residuals: str = "bf16",
              segment_ids=None):
  """q (B, S, Hq, Dh), k/v (B, S, Hkv, Dh), Hq % Hkv == 0. Returns (B, S, Hq, Dh) in q.dtype.

  implementation None -> "cudnn" on GPU; elsewhere "xla" (under jax.checkpoint with "bf16"
  residuals, so only q, k, v are saved: flash-attention-like memory instead of the (S, S)
  probabilities). residuals: "bf16" | "fp8", what the backward keeps (module docstring).
  segment_ids: None or (B, S) ints; attention stays within equal ids (module docstring).
  """
  if k.shape != v.shape or q.ndim != 4 or q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
    raise ValueError(f"attention: bad shapes q {q.shape}, k {k.shape}, v {v.shape}")
  if segment_ids is not None and (segment_ids.shape != q.shape[:2] or q.shape[1] != k.shape[1]
                                  or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
    raise ValueError(f"attention: segment_ids must be integers of shape (batch, seq) = "
                     f"{q.shape[:2]} with as many keys as queries, got {segment_ids.shape} "
                     f"{segment_ids.dtype} for k {k.shape}")
  check_attention_residuals(residuals, "attention: residuals")
  if residuals == "fp8" and not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"attention: fp8 residuals need one dtype for q, k, v, got "
                     f"{q.dtype}, {k.dtype}, {v.dtype}")
  implementation = _implementation(q, implementation)
  if residuals == "fp8":
    return _attention_fp8_saved(q, k, v, segment_ids, causal, implementation)
  fn = functools.partial(_attend, causal=causal, implementation=implementation)
  if implementation == "xla":
    fn = jax.checkpoint(fn)
  return fn(q, k, v, segment_ids)
