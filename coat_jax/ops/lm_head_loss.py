"""The LM head and the mean cross-entropy as one op over token chunks, its gradient made in the forward.

For N tokens h_i (D,), labels y_i, and the head W (D, V) (or the tied embedding E = W^T):

  z_i   = h_i . W                                   (in h's dtype, as `ops.lm_head` writes it)
  loss  = (1/N) sum_i [logsumexp(z_i) - z_i[y_i]]   (float32 math, as `ops.softmax_cross_entropy`)
  dz_i  = (softmax(z_i) - onehot(y_i)) / N          (float32, written in h's dtype)
  dh_i  = dz_i . W^T        dW = sum_i h_i^T dz_i   (dW accumulated in float32 over the chunks)

With a loss mask m (one 0/1 weight per token: supervised fine-tuning counts the response tokens
only) the mean runs over the counted tokens, loss = sum_i m_i l_i / max(sum_i m_i, 1), and
dz_i = m_i (softmax(z_i) - onehot(y_i)) / max(sum_i m_i, 1); the GEMMs are the same.

The unfused path writes all N x V logits, keeps them for the backward and writes their N x V
gradient there: for OLMo-1B (V = 50,304) at batch 8 x 2048 two bf16 arrays of 1.65 GB, both
live when the backward starts, where the step's memory peaks. Here the forward runs over chunks
of `chunk_tokens` tokens and, per chunk, makes the logits, the loss, dz, dh's rows and adds
h_c^T dz_c into dW, so only one chunk's logits and dz exist at a time; the residuals are dh
(N x D, h's dtype) and dW (W's shape and dtype). The backward scales them by the loss's
cotangent g (exact for g = 1, the training step's). The GEMMs are the unfused path's three
(no logits recomputed); the extra work is dW's read-modify-write once per chunk.

Without differentiation (evaluation) the op runs the chunked loss alone: no gradient GEMMs.

On several devices with the tokens split across them, each chunk's h_c^T dz_c is a partial sum
that XLA reduces across the devices inside the loop (a while loop's carry cannot stay
unreduced): one weight-gradient reduction per chunk instead of one per step. And the fused path
holds buffers of its own (two chunks of logits, dW's float32 accumulator and each chunk's
product): with few tokens or a large D x V it holds more than the logits path. The model
weighs both (`models.resolve_loss_impl`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from coat_jax.ops.cross_entropy import logits_gradient, loss_and_lse
from coat_jax.ops.lm_head import head_gradients, head_logits


def _check(h, w, labels, mask, tied, chunk_tokens):
  d = w.shape[1] if tied else w.shape[0]
  if w.ndim != 2 or h.ndim < 2 or h.shape[-1] != d:
    raise ValueError(f"lm_head_loss: h shape {h.shape} does not match "
                     f"{'tied embedding' if tied else 'head'} shape {w.shape} "
                     f"(need h[..., D] and {'E[V, D]' if tied else 'W[D, V]'})")
  if labels.shape != h.shape[:-1]:
    raise ValueError(f"lm_head_loss: labels shape {labels.shape} must be h shape {h.shape} "
                     f"without its last (feature) axis")
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise ValueError(f"lm_head_loss: labels must be integers, got {labels.dtype}")
  if mask is not None and mask.shape != labels.shape:
    raise ValueError(f"lm_head_loss: mask shape {mask.shape} must equal labels shape "
                     f"{labels.shape}")
  for name, x in (("h", h), ("w", w)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"lm_head_loss: {name} must be floating, got {x.dtype}")
  if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
    raise ValueError(f"lm_head_loss: chunk_tokens must be a positive int, got {chunk_tokens!r}")


def _chunk_loss(h, wc, y, m, tied):
  """Summed (masked, m not None) loss of one chunk (float32) and what its gradient needs:
  z (T, V), lse (T,)."""
  z = head_logits(h, wc, tied)
  loss, lse = loss_and_lse(z, y)
  return jnp.sum(loss if m is None else loss * m), z, lse


def _chunk_grads(h, wc, y, m, tied, inv_n):
  """One chunk: (summed loss, dh (T, D) in h's dtype, dW float32 in W's layout)."""
  loss, z, lse = _chunk_loss(h, wc, y, m, tied)
  g = inv_n if m is None else m * inv_n
  dh, dw = head_gradients(h, wc, logits_gradient(z, y, lse, g), tied)
  return loss, dh, dw


def _chunks(n, chunk):
  """(first chunk's size, number of full chunks after it, tail size): n = first + k * chunk + tail."""
  first = min(chunk, n)
  k, tail = divmod(n - first, chunk)
  return first, k, tail


def _run(h, w, labels, mask, tied, chunk, with_grads):
  """The forward over chunks: loss (float32 scalar) and, with_grads, (dh, dW float32)."""
  d = h.shape[-1]
  hf, yf = h.reshape(-1, d), labels.reshape(-1).astype(jnp.int32)
  mf = None if mask is None else mask.reshape(-1).astype(jnp.float32)
  n = hf.shape[0]
  wc = w.astype(h.dtype)
  inv_n = 1.0 / n if mf is None else 1.0 / jnp.maximum(jnp.sum(mf), 1.0)
  first, k, tail = _chunks(n, chunk)

  def one(start, size):
    """(summed loss, dh rows, dW part) of the chunk at `start`; (loss, None, None) without grads."""
    hc = jax.lax.dynamic_slice_in_dim(hf, start, size)
    yc = jax.lax.dynamic_slice_in_dim(yf, start, size)
    mc = None if mf is None else jax.lax.dynamic_slice_in_dim(mf, start, size)
    if with_grads:
      return _chunk_grads(hc, wc, yc, mc, tied, inv_n)
    return _chunk_loss(hc, wc, yc, mc, tied)[0], None, None

  loss, dh, dw = one(0, first)   # the first chunk outside the loop: dW needs no zero fill
  dh_parts = [dh]
  if k:
    def body(carry, i):
      loss, dw = carry
      part_loss, part_dh, part_dw = one(first + i * chunk, chunk)
      return (loss + part_loss, None if dw is None else dw + part_dw), part_dh

    (loss, dw), dh_mid = jax.lax.scan(body, (loss, dw), jnp.arange(k))
    dh_parts.append(None if dh_mid is None else dh_mid.reshape(k * chunk, d))
  if tail:
    part_loss, part_dh, part_dw = one(n - tail, tail)
    loss = loss + part_loss
    dh_parts.append(part_dh)
    dw = None if dw is None else dw + part_dw
  loss = loss * inv_n
  if not with_grads:
    return loss
  dh = dh_parts[0] if len(dh_parts) == 1 else jnp.concatenate(dh_parts)
  return loss, (dh.reshape(h.shape), dw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _lm_head_loss(h, w, labels, mask, tied, chunk):
  return _run(h, w, labels, mask, tied, chunk, with_grads=False)


def _fwd(h, w, labels, mask, tied, chunk):
  loss, (dh, dw) = _run(h, w, labels, mask, tied, chunk, with_grads=True)
  return loss, (dh, dw.astype(w.dtype))


def _bwd(tied, chunk, res, g):
  del tied, chunk
  dh, dw = res
  return (g.astype(dh.dtype) * dh, g.astype(dw.dtype) * dw, None, None)


_lm_head_loss.defvjp(_fwd, _bwd)


def lm_head_loss(h: jax.Array, w: jax.Array, labels: jax.Array, *, tied: bool = False,
                 chunk_tokens: int = 4096, mask: jax.Array | None = None) -> jax.Array:
  """Mean cross-entropy (nats, float32 scalar) of the logits h @ W against `labels` (module docstring).

  The values of `softmax_cross_entropy(lm_head(h, w, tied=tied), labels).mean()` and its
  gradients, to float32 rounding (dW is summed over chunks in another order).

  Args:
    h: final hidden states (..., D), bf16 or float32; the logits are computed in its dtype.
    w: the head (D, V), or the token embedding (V, D) with `tied=True`; its gradient comes in
      its dtype.
    labels: (...) integers in [0, V) (like the unfused path, an index outside gives no error).
    chunk_tokens: tokens per chunk (the last chunk may be shorter); larger chunks hold more
      logits at once, smaller ones add dW read-modify-writes.
    mask: None, or labels' shape: 1 counts a token, 0 leaves it out (module docstring); the
      values of `masked_mean(softmax_cross_entropy(...), mask)`.
  """
  _check(h, w, labels, mask, tied, chunk_tokens)
  return _lm_head_loss(h, w, labels, mask, bool(tied), chunk_tokens)
