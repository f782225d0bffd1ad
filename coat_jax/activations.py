"""Elementwise activation math shared by the ops and the dispatch's references (one definition)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def silu_product(gate: jax.Array, up: jax.Array) -> jax.Array:
  """SwiGLU's h = silu(gate) * up, computed in float32, returned in gate's dtype."""
  return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)


def silu_product_grads(gate: jax.Array, up: jax.Array, dh: jax.Array):
  """(d_gate, d_up) of h = silu(gate) * up, computed in float32, returned in dh's dtype: with
  a = gate, u = up, s = sigmoid(a), d_gate = dh * u * s * (1 + a (1 - s)), d_up = dh * a * s."""
  a, u, d = (x.astype(jnp.float32) for x in (gate, up, dh))
  sig = jax.nn.sigmoid(a)
  return ((d * u * sig * (1.0 + a * (1.0 - sig))).astype(dh.dtype),
          (d * a * sig).astype(dh.dtype))
