"""coat_adamw: AdamW with FP8 moments and dynamic range expansion, as an optax transformation.

Per parameter p with gradient g at step t (t = 1, 2, ...), all arithmetic in float32 (COAT's;
the one definition is coat_jax.adam_math):

  m = b1 m + (1 - b1) g,          v = b2 v + (1 - b2) g^2,   (finite g clamped to +-2^63 first)
  denom = (sqrt(v) / sqrt(1 - b2^t) + eps) * (1 - b1^t),
  update = -lr * (m / denom + wd * p)            (decoupled decay; `mask` selects where)

m / denom = m_hat / (sqrt(v_hat) + eps) with m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t), which
is optax.adamw's update (eps outside the square root, eps_root = 0), so quantize=False reproduces
optax.adamw to float32 rounding. With `max_grad_norm` c, g is first scaled by
min(1, c / global norm of the gradients) inside the step (clip_by_global_norm fused; see
`coat_adamw`).

Huge gradients: a finite gradient element with |g| > ~1.8e19 overflows g^2 in float32; unguarded,
one such element made its v group's amax inf and every later param NaN, for good. Finite
gradients are clamped to +-2^63 before the moment update, so moments, amax and params stay finite
and the run continues: the element moves by about lr (Adam's step is scale-free), and the other
elements of its group of G are stored relative to the huge amax (coarser) until v decays.
optax.adamw instead keeps v = inf for that element (its update there is 0 from then on).
NaN/inf gradients still propagate (never hidden). See coat_jax.adam_math.

State: `CoatAdamWState(count, mu, nu, comp)` (comp: Kahan compensation buffers for bfloat16
master weights with master_rounding="kahan", else None; see `coat_adamw_apply`). A moment leaf is
  - an `ExpandedMoment` (FP8/INT8 data of the param's shape + float32 amax and uint8 k_code per
    group of G along the leaf's group axis; see coat_jax.expansion) for floating params with at
    least `min_quantized_size` elements, when quantize=True: 1 + 5/G bytes per element per moment;
  - a float32 array of the param's shape otherwise. Small params (norm scales, biases) stay float32
    because the per-group metadata would be a large share of their bytes and they are a negligible
    share of the model (bitsandbytes keeps tensors under 4096 elements in 32 bit for the same
    reason).
The group axis (`group_axes`): by default (group_axis="last") every leaf groups G consecutive
elements of its last axis (metadata (..., N / G)); with group_axis="coat" (COAT's layout) a Flax
(in, out) kernel groups G consecutive input features of each output column (axis -2; metadata
(..., in / G, out)), other leaves their last axis.
Moments stay in the param's layout either way, so a param's sharding is valid for its moments and
scales (see `state_shardings`).

A quantized leaf's step is: dequantize m and v (x = sign(q) mx (|q|/fmt.max)^(1/k) per group),
the Adam math above in float32, then requantize each with a fresh per-group mx and k (dynamic range
expansion: q = sign(x) fmt.max (|x|/mx)^k, k the largest multiple of 1/expand_min with
(max/min)^k <= R of the format). `adam_step_reference` (coat_jax.adam_math) is that step for
one param (returning the new param, or with output="update" optax's update): the jnp reference
for the fused kernel. All leaves go through `kernels_adam.coat_adam_tree_step` in one call:
ExpandedMoment leaves take `kernels_adam.coat_adam_step` (the fused kernel where
`kernels.use_pallas("adam")` and the group axis divides by G, the reference otherwise) and
float32 moments the reference; the choice is made at trace time.
`coat_adamw_apply` is the same step writing the new params directly (one pass over memory).
The code: coat_jax.optim_config (the settings), optim_state (the state, its init and shardings),
optim_step (the step's transforms), assembled here.

Where users put it: `flax.nnx.Optimizer(model, coat_adamw(...), wrt=nnx.Param)` (init sees
Variable-wrapped params, update plain arrays: both are read as the params' values, so the state
and the group axes agree); `optax.chain`, `MultiSteps`, `apply_if_finite`, `inject_hyperparams`
and optax.contrib's wrappers (`update` takes and ignores extra keyword arguments such as
`value=loss`: it is a GradientTransformationExtraArgs); meshes with Explicit axes (`init` gives
each moment the sharding the step returns it with). For the state's shardings or partition
specs from the params', use `state_shardings` (what `optax.tree_map_params` does for optax's
optimizers; it cannot map the three-array FP8 moments).

Hyperparameters are plain arguments, so `optax.inject_hyperparams(coat_adamw)` works for the
numeric ones (learning_rate, b1, b2, eps, weight_decay); pass the integer knobs (group_size,
expand_min, min_quantized_size) through `static_args` if given to inject_hyperparams at all.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from coat_jax import optim_step
from coat_jax.adam_math import adam_step_reference  # noqa: F401
from coat_jax.expansion import ExpandedMoment  # noqa: F401
from coat_jax.optim_config import (DEFAULT_EXPAND_MIN, DEFAULT_GROUP_AXIS,  # noqa: F401
                                   DEFAULT_GROUP_SIZE, DEFAULT_MIN_QUANTIZED_SIZE, GROUP_AXES,
                                   STATE_LAYOUTS, CoatAdamWConfig)
from coat_jax.optim_state import (CoatAdamWState, check_group_split, group_axes,  # noqa: F401
                                  state_shardings)
from coat_jax.rounding import MASTER_ROUNDINGS

__all__ = ["CoatAdamWConfig", "CoatAdamWState", "DEFAULT_GROUP_AXIS", "ExpandedMoment",
           "GROUP_AXES", "MASTER_ROUNDINGS", "STATE_LAYOUTS", "adam_step_reference",
           "coat_adamw", "coat_adamw_apply", "group_axes", "optimizer_state_bytes",
           "state_shardings"]


def _parts(learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4, mask=None, **settings):
  """(config, hyperparameters, mask) from `coat_adamw`'s arguments, checked."""
  return (CoatAdamWConfig.make(**settings),
          optim_step.AdamHyper(learning_rate, b1, b2, eps, weight_decay), mask)


def coat_adamw(learning_rate: float | optax.Schedule, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 1e-4,
               mask: Any | Callable[[Any], Any] | None = None, *, m_format: str = "e4m3",
               v_format: str = "e4m3", group_size: int | None = None, expand: bool = True,
               expand_min: int | None = None, quantize: bool = True,
               min_quantized_size: int | None = None,
               master_rounding: str = "nearest",
               group_axis: str | Callable[[Any], Any] = DEFAULT_GROUP_AXIS,
               max_grad_norm: float | None = None,
               state_layout: str = "leaves") -> optax.GradientTransformationExtraArgs:
  """AdamW whose moments are stored in FP8 with per-group dynamic range expansion (COAT).

  Args:
    learning_rate: float or schedule (step count -> lr), evaluated at the count before the step.
    b1, b2, eps, weight_decay: as optax.adamw (eps added to sqrt of the bias-corrected v).
    mask: pytree of bools like params (or a callable params -> such a pytree): where True, apply
      weight decay (as optax.adamw's mask). None: everywhere.
    m_format, v_format: "e4m3" | "e5m2" | "int8" for the first / second moment.
    group_size: G, group length along each param's group axis (None: 128).
    expand: dynamic range expansion on (False: plain per-group max scaling).
    expand_min: k is a multiple of 1/expand_min (None: 16).
    quantize: False keeps all moments float32 (then this is optax.adamw).
    min_quantized_size: params with fewer elements keep float32 moments (None: 4096).
    master_rounding: "nearest" | "stochastic" | "kahan", how `coat_adamw_apply` stores bfloat16
      master weights (see there). "kahan" adds a bfloat16 compensation buffer per bfloat16
      param to the state (`CoatAdamWState.comp`, 2 bytes per param). This transformation's own
      update (optax's update/apply_updates, which rounds p + u to nearest outside it) supports
      only "nearest": it raises ValueError for the others, use `coat_adamw_apply`.
    group_axis: "last" (default: every leaf's last axis; the fused kernel at the byte floor) |
      "coat" (Flax kernels grouped along their input features, COAT's layout; lower moment
      error, the same loss, docs/differences.md section 4; a 1.5x slower fused kernel,
      docs/results.md, "The optimizer step") | callable params -> tree of
      axes: the axis each quantized moment groups along (`group_axes`; the callable is called
      with the updates when params are None).
      Same bytes of state either way; a state restores only into the group_axis it was made with.
    max_grad_norm: None, or clip the gradients to this global norm inside the step: the step
      computes the float32 global norm n of the incoming gradients (optax.tree.norm) and the
      fused kernel multiplies each gradient element by s = where(n < max_grad_norm, 1,
      max_grad_norm / n) (`adam_math.clip_scale`) as it loads it. The same as
      optax.chain(optax.clip_by_global_norm(max_grad_norm), coat_adamw(...)) up to float32
      rounding (optax scales each element as (g / n) * max_grad_norm), without writing the
      clipped gradients and reading them back (8 bytes per float32 param). Same state.
    state_layout: "leaves" (default): mu / nu are trees like params (an ExpandedMoment or a
      float32 array per leaf), each shardable like its param. "packed": mu / nu are each one
      `packed_state.PackedMoments` (four flat buffers for the whole tree and a fingerprint of
      the layout; same values and bytes but alignment padding), for one device: a jitted step
      passes ~3 buffers per leaf instead of ~15 (the host time per buffer is what a many-leaf
      step waits for; docs/results.md, "The optimizer step"), and `state_shardings` refuses it
      on a mesh of several devices. A state restores only into the layout it was made with.
    The three integer knobs default to None (meaning the values above) rather than to ints, so
    that optax.inject_hyperparams, which turns every int/float argument into a traced
    hyperparameter, leaves them static; if you set them under inject_hyperparams, list them in
    its `static_args`.
  Returns:
    optax.GradientTransformationExtraArgs with state CoatAdamWState (its update takes and
    ignores extra keyword arguments, e.g. optax.contrib's `value=loss`). Raises ValueError for an
    unknown format, group_size <= 0, expand_min <= 0, max_grad_norm <= 0, or (at init) a
    non-float parameter.
  """
  cfg, hyper, mask = _parts(
      learning_rate, b1, b2, eps, weight_decay, mask, m_format=m_format, v_format=v_format,
      group_size=group_size, expand=expand, expand_min=expand_min, quantize=quantize,
      min_quantized_size=min_quantized_size, master_rounding=master_rounding,
      group_axis=group_axis, max_grad_norm=max_grad_norm, state_layout=state_layout)

  def init(params):
    return optim_step.init(cfg, params)

  def update(updates, state, params=None, **extra_args):
    del extra_args  # optax's convention: transformations ignore arguments they do not use
    return optim_step.step(cfg, hyper, mask, updates, state, params, output="update")

  return optax.GradientTransformationExtraArgs(init, update)


def coat_adamw_apply(learning_rate: float | optax.Schedule, *args,
                     **kwargs) -> Callable[[Any, CoatAdamWState, Any], tuple[Any, CoatAdamWState]]:
  """`coat_adamw`'s step writing the new params directly: `apply(grads, state, params)`.

  Takes the same arguments as `coat_adamw` and returns apply(grads, state, params) ->
  (new_params, new_state), equal to `coat_adamw(...).update` followed by optax.apply_updates up
  to one float32 rounding of the params (p - lr*d rather than p + (-lr*d)). The state comes from
  `coat_adamw(<same arguments>).init(params)`. With the Pallas kernel each quantized leaf is one
  pass (read p, g, m, v; write p, m, v) instead of writing the update and reading it back with p
  in apply_updates (12 fewer bytes per float32 param). Being no GradientTransformation, it does
  not compose with optax wrappers (chain, apply_if_finite, MultiSteps, ...): check the gradients
  before calling it, and clip them with `max_grad_norm` (as `coat_adamw`'s: inside the step,
  equal to clip_by_global_norm first up to float32 rounding). Params are required.

  For bfloat16 master weights (2 instead of 4 bytes per parameter), `master_rounding`:
    "nearest" (default): the new param is rounded to nearest; an update below half a bfloat16
      ulp of the weight (2^-9 relative) is lost.
    "stochastic": a bfloat16 param's new value is computed in float32 and rounded to bfloat16
      stochastically (`coat_jax.rounding`: rounds up with probability equal to the dropped
      fraction, bits from a hash of (element, step, leaf)), so E[new param] is the float32
      result and small updates are kept in expectation.
    "kahan": the state carries a bfloat16 compensation c per bfloat16 param (from `coat_adamw(...,
      master_rounding="kahan").init`), the low-order part the bfloat16 p could not hold; the
      master value is p + c. A step computes, in float32,
        x = p + c,   y = x - lr * (m/denom + wd * x)   (the Adam step above, on x),
        p' = bf16(y),   c' = bf16(y - p')               (bf16(): round to nearest),
      i.e. Kahan-compensated summation of the updates (the error of the sum is carried to the
      next step instead of dropped). p' + c' equals y to within half a bfloat16 ulp of c', at
      most 2^-17 |y| (16 significant bits instead of bfloat16's 8), so a long run of updates
      each below half an ulp of p accumulates (deterministically) with an error of at most
      2^-17 |y| per step, where round-to-nearest drops them all.
      Costs 2 bytes per param of state (4 bytes of master in all, as float32, but the
      forward/backward reads the 2-byte p only).
    Other param dtypes round to nearest and have no compensation. With "stochastic" or "kahan"
    the leaf's step runs on a float32 copy of the param (not yet inside the fused kernel).
  """
  if kwargs.get("master_rounding", "nearest") not in MASTER_ROUNDINGS:
    raise ValueError(f"coat_adamw_apply: master_rounding must be one of {MASTER_ROUNDINGS}, "
                     f"got {kwargs['master_rounding']!r}")
  cfg, hyper, mask = _parts(learning_rate, *args, **kwargs)

  def apply(grads, state, params=None):
    return optim_step.step(cfg, hyper, mask, grads, state, params, output="param")

  return apply


def optimizer_state_bytes(state) -> int:
  """Sum of the bytes of all array leaves of `state` (arrays or ShapeDtypeStructs)."""
  total = 0
  for leaf in jax.tree.leaves(state):
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      n = 1
      for d in leaf.shape:
        n *= d
      total += n * jnp.dtype(leaf.dtype).itemsize
  return total
