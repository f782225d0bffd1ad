"""Thin Flax NNX modules over `coat_jax.ops`: the precision mode picks the ops, not the module.

Parameters are stored in `param_dtype` (float32 master weights by default) and cast to the compute
`dtype` (bfloat16 by default) where they are used. Modes: "bf16" (plain), "fp8_linear" (FP8 GEMMs,
activations saved as usual), "coat" (FP8 GEMMs and FP8 activations saved for backward, with the
quantized output of one op handed to the next: RMSNorm -> Q/K/V and gate/up, SwiGLU -> down).

Shapes: B batch, S sequence, D hidden, F intermediate, H query heads, K key/value heads, Dh head dim.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from coat_jax import ops
from coat_jax.precision import check_precision

DEFAULT_INIT = nnx.initializers.normal(stddev=0.02)


class Linear(nnx.Module):
  """y = x @ kernel, no bias; `kernel` is (in_features, out_features)."""

  def __init__(self, in_features: int, out_features: int, *, mode: str = "bf16",
               dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32,
               kernel_init: Callable = DEFAULT_INIT, rngs: nnx.Rngs):
    self.in_features, self.out_features = in_features, out_features
    self.mode = check_precision(mode, "mode")
    self.dtype = jnp.dtype(dtype)
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features),
                                        jnp.dtype(param_dtype)))

  def __call__(self, x: jax.Array, x_q=None, *, in_axes: int = 1,
               keep_x: bool = False) -> jax.Array:
    """x: (..., in) -> (..., out) in `dtype`; x_q: optional per-tensor FP8 copy of x ("coat").
    in_axes > 1: x's last in_axes axes hold the in_features; keep_x: `ops.linear`'s."""
    in_shape = x.shape[x.ndim - in_axes:]
    if math.prod(in_shape) != self.in_features:
      raise ValueError(f"Linear: input's last {in_axes} axes {in_shape} hold "
                       f"{math.prod(in_shape)} values, in_features is {self.in_features}")
    # The parameter goes in as it is stored: the op casts it where it is used and keeps the
    # parameter, not a cast copy, for its backward (ops/linear_layer.py).
    return ops.linear(x.astype(self.dtype), self.kernel[...], mode=self.mode, x_q=x_q,
                      in_axes=in_axes, keep_x=keep_x)


def _check_input(x: jax.Array, projs) -> "Linear":
  """Raises unless x's last axis is every projection's in_features; returns the first."""
  for p in projs:
    if x.shape[-1] != p.in_features:
      raise ValueError(f"Linear: input last axis {x.shape[-1]} != in_features {p.in_features}")
  return projs[0]


def _linears(x: jax.Array, x_q, projs) -> tuple[jax.Array, ...]:
  """The outputs of `Linear`s of one mode sharing the input x (and its FP8 copy x_q):
  `ops.linears`, which keeps x_q once for all of them."""
  first = _check_input(x, projs)
  return ops.linears(x.astype(first.dtype), [p.kernel[...] for p in projs], mode=first.mode,
                     x_q=x_q)


class RMSNorm(nnx.Module):
  """y = x / rms(x) * scale; returns (y, y_q) with y_q the FP8 copy of y in "coat" mode, else None.
  `linear_residuals` ("kept" | "remade"): what the linears fed by y_q keep (`ops.rmsnorm`)."""

  def __init__(self, features: int, *, eps: float = 1e-6, mode: str = "bf16",
               dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32,
               linear_residuals: str = "kept", rngs: nnx.Rngs | None = None):
    del rngs  # scale starts at ones
    self.features, self.eps = features, eps
    self.mode = check_precision(mode, "mode")
    self.linear_residuals = ops.check_linear_residuals(linear_residuals,
                                                       "RMSNorm: linear_residuals")
    self.dtype = jnp.dtype(dtype)
    self.scale = nnx.Param(jnp.ones((features,), jnp.dtype(param_dtype)))

  def __call__(self, x: jax.Array):
    """x: (..., D) -> (y (..., D) in `dtype`, y_q or None)."""
    if x.shape[-1] != self.features:
      raise ValueError(f"RMSNorm: input last axis {x.shape[-1]} != features {self.features}")
    return ops.rmsnorm(x.astype(self.dtype), self.scale[...].astype(self.dtype), eps=self.eps,
                       mode=self.mode, linear_residuals=self.linear_residuals)


class Embedding(nnx.Module):
  """Token embedding table `embedding` (V, D); also the tied LM head (`attend`)."""

  def __init__(self, num_embeddings: int, features: int, *, dtype: Any = jnp.bfloat16,
               param_dtype: Any = jnp.float32, embedding_init: Callable = DEFAULT_INIT,
               rngs: nnx.Rngs):
    self.num_embeddings, self.features = num_embeddings, features
    self.dtype = jnp.dtype(dtype)
    self.embedding = nnx.Param(embedding_init(rngs.params(), (num_embeddings, features),
                                              jnp.dtype(param_dtype)))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """tokens: (B, S) integer -> (B, S, D) in `dtype` (out-of-range ids give NaN rows)."""
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"Embedding: tokens must be integers, got dtype {tokens.dtype}")
    return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)

  def attend(self, h: jax.Array) -> jax.Array:
    """h: (..., D) -> logits (..., V) = h @ embedding^T, in `dtype` (`ops.lm_head`, tied)."""
    return ops.lm_head(h.astype(self.dtype), self.embedding[...], tied=True)

  def attend_loss(self, h: jax.Array, labels: jax.Array, chunk_tokens: int,
                  mask: jax.Array | None = None) -> jax.Array:
    """Mean cross-entropy of `attend(h)` against labels (over the tokens `mask` counts), never
    holding all logits (`ops.lm_head_loss`, tied)."""
    return ops.lm_head_loss(h.astype(self.dtype), self.embedding[...], labels, tied=True,
                            chunk_tokens=chunk_tokens, mask=mask)


class LMHead(nnx.Module):
  """The untied LM head: logits = h @ kernel, `kernel` (features, vocab) (`ops.lm_head`)."""

  def __init__(self, features: int, vocab_size: int, *, dtype: Any = jnp.bfloat16,
               param_dtype: Any = jnp.float32, kernel_init: Callable = DEFAULT_INIT,
               rngs: nnx.Rngs):
    self.features, self.vocab_size = features, vocab_size
    self.dtype = jnp.dtype(dtype)
    self.kernel = nnx.Param(kernel_init(rngs.params(), (features, vocab_size),
                                        jnp.dtype(param_dtype)))

  def __call__(self, h: jax.Array) -> jax.Array:
    """h: (..., features) -> logits (..., vocab) in `dtype`."""
    return ops.lm_head(h.astype(self.dtype), self.kernel[...])

  def loss(self, h: jax.Array, labels: jax.Array, chunk_tokens: int,
           mask: jax.Array | None = None) -> jax.Array:
    """Mean cross-entropy of `self(h)` against labels (over the tokens `mask` counts), never
    holding all logits (`ops.lm_head_loss`)."""
    return ops.lm_head_loss(h.astype(self.dtype), self.kernel[...], labels,
                            chunk_tokens=chunk_tokens, mask=mask)


class Attention(nnx.Module):
  """Multi-head self-attention with grouped K/V heads (GQA), RoPE and a causal mask.

  In "coat" mode the per-tensor FP8 copy of the normalized input feeds Q, K and V; the attention
  output reaches o_proj in `dtype` (o_proj quantizes it itself; where the attention keeps its
  output, as cuDNN's does, o_proj keeps that array for its backward instead of an FP8 copy).
  `attention_residuals` ("bf16" | "fp8", any mode) is what the attention keeps of q, k, v for
  its backward (`ops.attention`).
  """

  def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
               mode: str = "bf16", dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32,
               attention_impl: str | None = None, attention_residuals: str = "bf16",
               rngs: nnx.Rngs):
    if num_heads % num_kv_heads:
      raise ValueError(f"Attention: num_kv_heads {num_kv_heads} must divide num_heads {num_heads}")
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.attention_impl = attention_impl
    self.attention_residuals = ops.check_attention_residuals(attention_residuals,
                                                             "Attention: attention_residuals")
    kw = dict(mode=mode, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.q_proj = Linear(hidden_size, num_heads * head_dim, **kw)
    self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, **kw)
    self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, **kw)
    self.o_proj = Linear(num_heads * head_dim, hidden_size, **kw)

  def __call__(self, x: jax.Array, x_q, cos: jax.Array, sin: jax.Array,
               positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """x: (B, S, D) normalized input, x_q its FP8 copy or None; cos/sin: (max_len, Dh // 2);
    positions (B, S) for RoPE (None: 0..S-1); segment_ids (B, S): packed examples, attention
    stays within each (`ops.attention`)."""
    b, s, _ = x.shape
    q, k, v = _linears(x, x_q, (self.q_proj, self.k_proj, self.v_proj))
    q = q.reshape(b, s, self.num_heads, self.head_dim)
    k = k.reshape(b, s, self.num_kv_heads, self.head_dim)
    v = v.reshape(b, s, self.num_kv_heads, self.head_dim)
    q = ops.apply_rope(q, cos, sin, positions)
    k = ops.apply_rope(k, cos, sin, positions)
    o = ops.attention(q, k, v, causal=True, implementation=self.attention_impl,
                      residuals=self.attention_residuals, segment_ids=segment_ids)
    # o as the attention made it (B, S, H, Dh): where the attention keeps it for its backward,
    # o_proj's backward keeps that same array (no reshaped copy, no FP8 copy in "coat").
    keep = ops.attention_keeps_output(q, implementation=self.attention_impl,
                                      residuals=self.attention_residuals)
    return self.o_proj(o, in_axes=2, keep_x=keep)


class MLP(nnx.Module):
  """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). `linear_residuals` ("kept" | "remade"):
  what the down projection keeps of h (`ops.swiglu_linears`)."""

  def __init__(self, hidden_size: int, intermediate_size: int, *, mode: str = "bf16",
               dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32,
               linear_residuals: str = "kept", rngs: nnx.Rngs):
    kw = dict(mode=mode, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.mode = check_precision(mode, "mode")
    self.linear_residuals = ops.check_linear_residuals(linear_residuals, "MLP: linear_residuals")
    self.gate_proj = Linear(hidden_size, intermediate_size, **kw)
    self.up_proj = Linear(hidden_size, intermediate_size, **kw)
    self.down_proj = Linear(intermediate_size, hidden_size, **kw)

  def __call__(self, x: jax.Array, x_q=None) -> jax.Array:
    """x: (B, S, D) normalized input, x_q its FP8 copy or None -> (B, S, D). Gate, up and
    SwiGLU are one op (`ops.swiglu_linears`: in "coat" one GEMM with SwiGLU in its epilogue)."""
    _check_input(x, (self.gate_proj, self.up_proj))
    h, h_q = ops.swiglu_linears(x.astype(self.gate_proj.dtype), self.gate_proj.kernel[...],
                                self.up_proj.kernel[...], mode=self.mode, x_q=x_q,
                                linear_residuals=self.linear_residuals)
    return self.down_proj(h, x_q=h_q)


class DecoderBlock(nnx.Module):
  """Pre-norm Llama block: x + attn(norm(x)), then x + mlp(norm(x)). `linear_residuals`: what
  Q/K/V, gate/up ("coat": fed by the norms) and down (fed by SwiGLU) keep of their FP8 inputs
  (`ops.LINEAR_RESIDUALS`)."""

  def __init__(self, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int,
               head_dim: int, *, eps: float = 1e-6, mode: str = "bf16", dtype: Any = jnp.bfloat16,
               param_dtype: Any = jnp.float32, attention_impl: str | None = None,
               attention_residuals: str = "bf16", linear_residuals: str = "kept",
               rngs: nnx.Rngs):
    kw = dict(mode=mode, dtype=dtype, param_dtype=param_dtype)
    self.dtype = jnp.dtype(dtype)
    self.input_layernorm = RMSNorm(hidden_size, eps=eps, linear_residuals=linear_residuals, **kw)
    self.self_attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim,
                               attention_impl=attention_impl,
                               attention_residuals=attention_residuals, rngs=rngs, **kw)
    self.post_attention_layernorm = RMSNorm(hidden_size, eps=eps,
                                            linear_residuals=linear_residuals, **kw)
    self.mlp = MLP(hidden_size, intermediate_size, linear_residuals=linear_residuals, rngs=rngs,
                   **kw)

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
               positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """x: (B, S, D) residual stream in `dtype` -> (B, S, D); positions, segment_ids: as
    `Attention`."""
    x = x.astype(self.dtype)
    h, h_q = self.input_layernorm(x)
    x = ops.residual_add(x, self.self_attn(h, h_q, cos, sin, positions, segment_ids))
    h, h_q = self.post_attention_layernorm(x)
    return ops.residual_add(x, self.mlp(h, h_q))
