"""Rotary position embedding, HF convention (rotate_half: first half / second half of head_dim)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# The keys of a Llama-3 ("llama3" rope_type) scaling dict: the one list models and HF import use.
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")


def _llama3_inv_freq(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
  """Llama-3 frequency scaling (HF rope_type "llama3")."""
  missing = [k for k in LLAMA3_ROPE_KEYS if k not in scaling]
  if missing:
    raise ValueError(f"rope scaling dict lacks keys {missing}")
  factor = float(scaling["factor"])
  low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
  old_len = float(scaling["original_max_position_embeddings"])
  low_wavelen, high_wavelen = old_len / low, old_len / high
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled)


def rope_frequencies(head_dim: int, max_len: int, theta: float = 10000.0, scaling=None):
  """Returns (cos, sin), float32 (max_len, head_dim // 2)."""
  if head_dim % 2:
    raise ValueError(f"rope: head_dim {head_dim} must be even")
  inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  if scaling is not None:
    inv_freq = _llama3_inv_freq(inv_freq, dict(scaling))
  inv_freq = inv_freq.astype(np.float32)  # HF computes inv_freq in float32.
  ang = np.arange(max_len, dtype=np.float32)[:, None] * inv_freq[None, :]
  return jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, positions=None) -> jax.Array:
  """x (B, S, H, Dh); positions None (0..S-1), (S,) or (B, S) ints. Returns x.dtype."""
  if x.ndim != 4 or cos.shape[-1] * 2 != x.shape[-1]:
    raise ValueError(f"apply_rope: x shape {x.shape} vs cos shape {cos.shape}")
  s = x.shape[1]
  if positions is None:
    c, sn = cos[:s], sin[:s]  # (S, D/2)
    c, sn = c[None, :, None, :], sn[None, :, None, :]
  else:
    positions = jnp.asarray(positions)
    c, sn = cos[positions], sin[positions]
    if positions.ndim == 1:
      c, sn = c[None], sn[None]
    c, sn = c[:, :, None, :], sn[:, :, None, :]
  # The tables are not differentiated (their cotangents would need x kept for the backward).
  return _rotate(x, jax.lax.stop_gradient(c), jax.lax.stop_gradient(sn))


def _rotation(x, c, sn):
  """(x1, x2) -> (x1 c - x2 sn, x2 c + x1 sn) over the halves of x's last axis, in float32;
  returns x.dtype."""
  half = x.shape[-1] // 2
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., :half], x32[..., half:]
  return jnp.concatenate([x1 * c - x2 * sn, x2 * c + x1 * sn], axis=-1).astype(x.dtype)


@jax.custom_vjp
def _rotate(x, c, sn):
  return _rotation(x, c, sn)


def _rotate_fwd(x, c, sn):
  return _rotation(x, c, sn), (c, sn)


def _rotate_bwd(res, g):
  """The rotation's transpose is the rotation by the opposite angle: dx = rotate(g, c, -sn), the
  values JAX's own transpose gives (the same products and sums), as one concatenate instead of
  the transposed slices' pads and adds (XLA's fusion of those ran slower on the H100)."""
  c, sn = res
  return _rotation(g, c, -sn), jnp.zeros_like(c), jnp.zeros_like(sn)


_rotate.defvjp(_rotate_fwd, _rotate_bwd)
