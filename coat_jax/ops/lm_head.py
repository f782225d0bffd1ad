"""The LM head: logits = h @ W, or h @ E^T when the head is the (tied) token embedding E.

  logits = h . cast(W)            W (D, V), or E (V, D) with `tied=True`; in h's dtype
  dh     = dz . cast(W)^T         in h's dtype
  dW     = h^T . dz               accumulated and written in float32, then cast to W's dtype

Its backward releases dh only together with dW (`lax.optimization_barrier` over the pair), so
the weight-gradient GEMM runs before the decoder blocks' backward, which waits for dh; the
(tokens x vocab) output gradient dz is then dead during that backward. Without the barrier XLA
is free to place the dW GEMM after the blocks' backward loop, and did for OLMo-1B with
`scan_impl="vjp_loop"`: dz (16384 x 50304 bf16, 1.65 GB) then stayed live across the whole loop
and set the step's memory peak (+1.3 GB; H100, 2026-11-24, `python3 -m benchmarks.step.bench_e2e
--modes bf16+adamw,coat+coat_adamw --set model.scan_impl=vjp_loop`).
The backward recasts the parameter instead of keeping the forward's cast (for OLMo-1B's tied
embedding a 206 MB bf16 copy held through the backward), and the float32 dW comes straight from
the GEMM's accumulator (no bf16 dW converted after).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def head_logits(h, w, tied):
  """logits = h . cast(W) (or h . cast(E)^T, tied), in h's dtype."""
  wc = w.astype(h.dtype)
  return jnp.einsum("...d,vd->...v", h, wc) if tied else jnp.einsum("...d,dv->...v", h, wc)


def head_gradients(h, wc, dz, tied):
  """(dh in h's dtype, dW float32 in W's layout) of the logits h . wc given their gradient dz;
  wc is the parameter already cast to h's dtype."""
  if tied:
    return (jnp.einsum("...v,vd->...d", dz, wc),
            jnp.einsum("...v,...d->vd", dz, h, preferred_element_type=jnp.float32))
  return (jnp.einsum("...v,dv->...d", dz, wc),
          jnp.einsum("...d,...v->dv", h, dz, preferred_element_type=jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lm_head(h, w, tied):
  return head_logits(h, w, tied)


def _lm_head_fwd(h, w, tied):
  return head_logits(h, w, tied), (h, w)


def _lm_head_bwd(tied, res, dz):
  h, w = res
  dh, dw = head_gradients(h, w.astype(h.dtype), dz, tied)
  dh, dw = jax.lax.optimization_barrier((dh, dw.astype(w.dtype)))
  return dh, dw


_lm_head.defvjp(_lm_head_fwd, _lm_head_bwd)


def lm_head(h: jax.Array, w: jax.Array, *, tied: bool = False) -> jax.Array:
  """h (..., D) -> logits (..., V) in h's dtype (module docstring).

  Args:
    h: final hidden states, bf16 or float32.
    w: the head's parameter, (D, V), or the token embedding (V, D) with `tied=True`; any float
      dtype (computed in h's dtype, its gradient in w's dtype).
  """
  d = w.shape[1] if tied else w.shape[0]
  if w.ndim != 2 or h.shape[-1] != d:
    raise ValueError(f"lm_head: h shape {h.shape} does not match {'tied embedding' if tied else 'head'} "
                     f"shape {w.shape} (need h[..., D] and {'E[V, D]' if tied else 'W[D, V]'})")
  return _lm_head(h, w, bool(tied))
