"""Gradient accumulation: one optimizer step over a global batch split into microbatches.

For a global batch of B sequences and k microbatches, the step computes

  loss = (1/k) sum_i L(params, batch_i),   grads = (1/k) sum_i dL(params, batch_i)/dparams,

where batch_i holds rows {i, i + k, i + 2k, ...} of the batch and L is the mean loss over a
microbatch's tokens. With equal microbatches this is the loss and gradient of the whole batch: the
same math as one step of B sequences, at the activation memory of B/k. Gradients are summed in
`accum_dtype` (float32 by default; bfloat16 halves the accumulator's bytes) and the mean is cast
back to the parameters' dtype.

Strided microbatches (row i + j k) keep each device's share equal: a batch sharded over devices
in contiguous row blocks gives every microbatch B/(k n) rows on every one of the n devices, so no
data moves between devices. The microbatches run in a `lax.scan` (one compiled body, sequential).
With k = 1 the function is value_and_grad itself (bit-identical); with k > 1 the sums run in a
different order than one large batch's reductions, so results agree to float rounding only.

bfloat16 gradients (`grad_dtype="bfloat16"`): the loss is differentiated at a bfloat16 copy of the
(floating) params, made once per step, so every gradient (each microbatch's, and the mean) is a
bfloat16 tree: 2 instead of 4 bytes per param next to float32 master weights. A model that casts
its weights to a bfloat16 compute dtype computes the same forward from the copy (the cast of a
bfloat16 value to bfloat16 is exact); only the gradients are rounded. The copy itself is 2 bytes
per param while the backward runs; params already in bfloat16 are used as they are (no copy).
The optimizer upcasts (coat_adamw's step runs in float32). With k > 1 the running sum is still
kept in `accum_dtype`: float32 (4 bytes per param) unless accum_dtype is bfloat16 too.

Summing in place (`loss_adds_into_sink`): a loss function may take the running sum S as a 4th
argument, the sink, and be built so that its gradient comes out as S + dL/dparams for every leaf
(e.g. a layer loop whose backward adds each layer's gradient into S's buffers: `layer_loop`'s
grads_into). The body then takes that gradient as the new sum,

  S_i = grad(L(., batch_i) / k with sink S_{i-1}) = S_{i-1} + (1/k) dL(params, batch_i)/dparams,

so S_k is the mean gradient itself: the microbatch gradient g_i of the leaves summed in place
never exists beside S, and no mean tree is made from S after the loop (one gradient-sized tree
less at the peak, and one pass over it less). Dividing each g_i by k before the sum rather than
the sum after it is exact for k a power of two (an exponent shift) and otherwise one rounding
per term, in a sum that rounds each term anyway. It needs every gradient in the
accumulator's dtype (a custom VJP's cotangent has its primal's dtype; `sums_in_place`), else the
body adds as above.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

ACCUM_DTYPES = ("float32", "bfloat16")
GRAD_DTYPES = ("param", "bfloat16")  # "param": gradients in each param's own dtype


def grad_params(params: Any, grad_dtype: str = "param") -> Any:
  """The params the loss is differentiated at: `params`, or their bfloat16 copy (floating leaves
  only) for grad_dtype="bfloat16"; the gradients come out in these leaves' dtypes."""
  if grad_dtype not in GRAD_DTYPES:
    raise ValueError(f"gradients: grad_dtype must be one of {GRAD_DTYPES}, got {grad_dtype!r}")
  if grad_dtype == "param":
    return params
  return jax.tree.map(lambda p: p.astype(jnp.bfloat16) if jnp.issubdtype(p.dtype, jnp.floating)
                      else p, params)


def split_microbatches(batch: jax.Array, num_microbatches: int) -> jax.Array:
  """(B, ...) -> (k, B/k, ...) with microbatch i holding rows i, i + k, i + 2k, ...

  Raises ValueError when k does not divide B.
  """
  b = batch.shape[0]
  if num_microbatches <= 0 or b % num_microbatches:
    raise ValueError(f"gradient accumulation: {num_microbatches} microbatches do not divide the "
                     f"batch of {b} sequences")
  per = b // num_microbatches
  return jnp.swapaxes(batch.reshape(per, num_microbatches, *batch.shape[1:]), 0, 1)


def sums_in_place(params: Any, num_microbatches: int, accum_dtype: str,
                  grad_dtype: str = "param") -> bool:
  """Whether a loss that adds its gradient into the running sum (`loss_adds_into_sink`) is used
  for these params: with k > 1 microbatches and every gradient's dtype (`grad_params`) equal to
  the accumulator's. `params`: arrays or ShapeDtypeStructs."""
  if num_microbatches == 1:
    return False
  acc = jnp.dtype(accum_dtype)
  return all(gradient_dtype(p.dtype, grad_dtype) == acc for p in jax.tree.leaves(params))


def gradient_dtype(param_dtype, grad_dtype: str = "param") -> jnp.dtype:
  """The dtype of a param's gradient: bfloat16 for a floating param with grad_dtype="bfloat16"
  (`grad_params`), else the param's own."""
  floating = jnp.issubdtype(param_dtype, jnp.floating)
  return jnp.dtype(jnp.bfloat16 if grad_dtype == "bfloat16" and floating else param_dtype)


def accumulated_value_and_grad(loss_fn: Callable[..., tuple[jax.Array, Any]],
                               num_microbatches: int, accum_dtype: str = "float32",
                               grad_dtype: str = "param", loss_adds_into_sink: bool = False):
  """value_and_grad of `loss_fn(params, state, batch) -> (loss, new_state)` over microbatches.

  Returns f(params, state, batch) -> ((mean loss, final state), mean grads). `state` (e.g. the
  model's non-parameter state) is threaded through the microbatches in order. Grads have the
  params' dtypes, or bfloat16 with grad_dtype="bfloat16" (`grad_params`); the running sum is kept
  in `accum_dtype` ("float32" or "bfloat16").
  loss_adds_into_sink: `loss_fn(params, state, batch, sink=None)` takes the running sum (a tree of
  the params' structure in `accum_dtype`) as `sink`, and its gradient with respect to params
  is sink + the loss's gradient for every leaf; the sum is then made in place where
  `sums_in_place` holds (the module docstring), and loss_fn is called without a sink elsewhere.
  """
  if grad_dtype not in GRAD_DTYPES:
    raise ValueError(f"gradients: grad_dtype must be one of {GRAD_DTYPES}, got {grad_dtype!r}")
  inner = _accumulated(loss_fn, num_microbatches, accum_dtype, loss_adds_into_sink)
  if grad_dtype == "param":
    return inner
  return lambda params, state, batch: inner(grad_params(params, grad_dtype), state, batch)


def _accumulated(loss_fn, num_microbatches, accum_dtype, loss_adds_into_sink):
  if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool) \
      or num_microbatches < 1:
    raise ValueError(f"gradient accumulation: the number of microbatches must be an int >= 1, "
                     f"got {num_microbatches!r}")
  if accum_dtype not in ACCUM_DTYPES:
    raise ValueError(f"gradient accumulation: accum_dtype must be one of {ACCUM_DTYPES}, "
                     f"got {accum_dtype!r}")
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if num_microbatches == 1:
    return grad_fn
  acc_dtype = jnp.dtype(accum_dtype)

  inv = 1.0 / num_microbatches

  def scaled_loss(params, state, batch, sink):   # the summed-in-place body differentiates L / k
    loss, state = loss_fn(params, state, batch, sink)
    return loss * inv, (loss, state)

  grad_scaled = jax.value_and_grad(scaled_loss, has_aux=True)

  def fn(params, state, batch):
    micro = jax.tree.map(lambda b: split_microbatches(b, num_microbatches), batch)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, acc_dtype), params)

    in_place = loss_adds_into_sink and sums_in_place(params, num_microbatches, accum_dtype)

    def body(carry, mb):
      grads_sum, loss_sum, st = carry
      if in_place:   # grads_sum + this microbatch's gradient / k (the sink is not differentiated)
        (_, (loss, st)), grads_sum = grad_scaled(params, st, mb, grads_sum)
      else:
        (loss, st), grads = grad_fn(params, st, mb)
        grads_sum = jax.tree.map(lambda a, g: a + g.astype(acc_dtype), grads_sum, grads)
      return (grads_sum, loss_sum + loss.astype(jnp.float32), st), None

    (grads_sum, loss_sum, state), _ = jax.lax.scan(
        body, (zeros, jnp.zeros((), jnp.float32), state), micro)
    if in_place:   # already the mean, in the gradients' own dtype: no second tree is made
      return (loss_sum * inv, state), grads_sum
    grads = jax.tree.map(lambda s, p: (s * jnp.asarray(inv, acc_dtype)).astype(p.dtype),
                         grads_sum, params)
    return (loss_sum * inv, state), grads

  return fn
