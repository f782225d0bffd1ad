"""Elementwise activation math shared by the ops and the dispatch's references (one definition)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def silu_product(gate: jax.Array, up: jax.Array) -> jax.Array:
  """SwiGLU's h = silu(gate) * up, computed in float32, returned in gate's dtype."""
  return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)
