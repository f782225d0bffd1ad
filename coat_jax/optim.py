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
    share of the model (bitsandbytes keeps tensors under 4096 elements in 32 bit for the same reason).
The group axis (`group_axes`): by default (group_axis="coat", COAT's layout) a Flax (in, out)
kernel groups G consecutive input features of each output column (axis -2; metadata
(..., in / G, out)), other leaves their last axis; group_axis="last" groups every leaf's last axis.
Moments stay in the param's layout either way, so a param's sharding is valid for its moments and
scales (see `state_shardings`).

A quantized leaf's step is: dequantize m and v (x = sign(q) mx (|q|/fmt.max)^(1/k) per group),
the Adam math above in float32, then requantize each with a fresh per-group mx and k (dynamic range
expansion: q = sign(x) fmt.max (|x|/mx)^k, k the largest multiple of 1/expand_min with
(max/min)^k <= R of the format). `adam_step_reference` (coat_jax.adam_math) is that step for one param (returning
the new param, or with output="update" optax's update): the jnp reference for the fused kernel.
All leaves go through `kernels_adam.coat_adam_tree_step` in one call: ExpandedMoment leaves take
`kernels_adam.coat_adam_step` (the fused kernel where `kernels.use_pallas("adam")` and the group axis
divides by G, the reference otherwise) and float32 moments the reference; the choice is made at
trace time.
`coat_adamw_apply` is the same step writing the new params directly (one pass over memory).

Hyperparameters are plain arguments, so `optax.inject_hyperparams(coat_adamw)` works for the
numeric ones (learning_rate, b1, b2, eps, weight_decay); pass the integer knobs (group_size,
expand_min, min_quantized_size) through `static_args` if given to inject_hyperparams at all.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from coat_jax import expansion, formats, kernels, packed_state
from coat_jax.kernels import adam as kernels_adam
from coat_jax.adam_math import adam_step_reference, clip_scale
from coat_jax.expansion import ExpandedMoment
from coat_jax.formats import get_format
from coat_jax.optim_state import (DEFAULT_GROUP_AXIS, GROUP_AXES, STATE_LAYOUTS,  # noqa: F401
                                  CoatAdamWState, check_group_split, group_axes, state_shardings)
from coat_jax.rounding import MASTER_ROUNDINGS, round_to, split_bf16

__all__ = ["CoatAdamWState", "DEFAULT_GROUP_AXIS", "ExpandedMoment", "GROUP_AXES",
           "MASTER_ROUNDINGS", "STATE_LAYOUTS", "adam_step_reference",
           "coat_adamw", "coat_adamw_apply", "group_axes", "optimizer_state_bytes", "state_shardings"]


def _is_moment_leaf(x) -> bool:
  return isinstance(x, ExpandedMoment)


def _zero_moment(shape, fmt, *, group_size, expand_min, expand, axis=-1) -> ExpandedMoment:
  """`quantize_expanded` of zeros of `shape`, built by broadcasting one zero group's fields.

  Quantizing a large all-zero constant under jit makes XLA constant-fold the per-group reductions
  (seconds per parameter for a 4096 x 11008 leaf); every group of zeros stores the same fields.
  """
  one = expansion.quantize_expanded(jnp.zeros((group_size,), jnp.float32), fmt, group_size,
                                    expand_min, expand)
  like = jax.eval_shape(lambda: expansion.quantize_expanded(
      jnp.zeros(shape, jnp.float32), fmt, group_size, expand_min, expand, axis))
  return jax.tree.map(lambda v, s: jnp.broadcast_to(v.reshape(-1)[0], s.shape).astype(s.dtype),
                      one, like)


def _check_float_leaves(params):
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(f"coat_adamw: parameter {jax.tree_util.keystr(path)} has non-float dtype "
                       f"{dtype}; only floating parameters can be optimized")


_BF16 = jnp.dtype(jnp.bfloat16)


def _is_bf16(p) -> bool:
  return p is not None and jnp.dtype(p.dtype) == _BF16


DEFAULT_GROUP_SIZE = formats.OPTIMIZER_GROUP_SIZE
DEFAULT_EXPAND_MIN = 16
DEFAULT_MIN_QUANTIZED_SIZE = 4096


def _static_int(value, name: str, default: int, minimum: int) -> int:
  """A Python int from an int or a concrete integer array; ValueError otherwise or if < minimum."""
  if value is None:
    return default
  if isinstance(value, jax.core.Tracer):
    raise ValueError(f"coat_adamw: {name} must be static (it sets array shapes); under "
                     f"optax.inject_hyperparams pass static_args=({name!r},)")
  if isinstance(value, bool) or not (isinstance(value, int) or (
      hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.integer) and value.ndim == 0)):
    raise ValueError(f"coat_adamw: {name} must be an int, got {value!r}")
  value = int(value)
  if value < minimum:
    raise ValueError(f"coat_adamw: {name} must be >= {minimum}, got {value}")
  return value


def coat_adamw(learning_rate: float | optax.Schedule, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 1e-4,
               mask: Any | Callable[[Any], Any] | None = None, *, m_format: str = "e4m3",
               v_format: str = "e4m3", group_size: int | None = None, expand: bool = True,
               expand_min: int | None = None, quantize: bool = True,
               min_quantized_size: int | None = None,
               master_rounding: str = "nearest",
               group_axis: str | Callable[[Any], Any] = DEFAULT_GROUP_AXIS,
               max_grad_norm: float | None = None,
               state_layout: str = "leaves") -> optax.GradientTransformation:
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
    group_axis: "coat" (default: Flax kernels grouped along their input features, COAT's layout;
      lower moment error, a 1.5x slower fused kernel, docs/differences.md section 4) | "last"
      (every leaf's last axis) | callable params -> tree of axes: the axis each quantized moment groups along
      (`group_axes`; the callable is called with the updates when params are None). Same bytes
      of state either way; a state restores only into the group_axis it was made with.
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
      step waits for; docs/benchmarks.md), and `state_shardings` refuses it on a mesh of several
      devices. A state restores only into the layout it was made with.
    The three integer knobs default to None (meaning the values above) rather than to ints, so
    that optax.inject_hyperparams, which turns every int/float argument into a traced
    hyperparameter, leaves them static; if you set them under inject_hyperparams, list them in
    its `static_args`.
  Returns:
    optax.GradientTransformation with state CoatAdamWState. Raises ValueError for an unknown
    format, group_size <= 0, expand_min <= 0, max_grad_norm <= 0, or (at init) a non-float
    parameter.
  """
  init_fn, step_fn = _coat_adamw_fns(
      learning_rate, b1, b2, eps, weight_decay, mask, m_format=m_format, v_format=v_format,
      group_size=group_size, expand=expand, expand_min=expand_min, quantize=quantize,
      min_quantized_size=min_quantized_size, master_rounding=master_rounding,
      group_axis=group_axis, max_grad_norm=max_grad_norm, state_layout=state_layout)
  return optax.GradientTransformation(init_fn, functools.partial(step_fn, output="update"))


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
  _, step_fn = _coat_adamw_fns(learning_rate, *args, **kwargs)
  return functools.partial(step_fn, output="param")


def _coat_adamw_fns(learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4, mask=None, *,
                    m_format="e4m3", v_format="e4m3", group_size=None, expand=True,
                    expand_min=None, quantize=True, min_quantized_size=None,
                    master_rounding="nearest", group_axis=DEFAULT_GROUP_AXIS,
                    max_grad_norm=None, state_layout="leaves"):
  """(init_fn, step_fn(updates, state, params=None, *, output)) of `coat_adamw` (same args)."""
  _check_max_grad_norm(max_grad_norm)
  if state_layout not in STATE_LAYOUTS:
    raise ValueError(f"coat_adamw: state_layout must be one of {STATE_LAYOUTS}, got "
                     f"{state_layout!r}")
  packed = state_layout == "packed"
  if not callable(group_axis) and group_axis not in GROUP_AXES:
    group_axes(group_axis, {})  # raises the ValueError
  if master_rounding not in MASTER_ROUNDINGS:
    raise ValueError(f"coat_adamw: master_rounding must be one of {MASTER_ROUNDINGS}, "
                     f"got {master_rounding!r}")
  kahan = master_rounding == "kahan"
  m_fmt, v_fmt = get_format(m_format).name, get_format(v_format).name
  group_size = _static_int(group_size, "group_size", DEFAULT_GROUP_SIZE, minimum=1)
  expand_min = _static_int(expand_min, "expand_min", DEFAULT_EXPAND_MIN, minimum=1)
  if expand_min > expansion.MAX_K_CODE:
    raise ValueError(f"coat_adamw: expand_min must be <= {expansion.MAX_K_CODE} (k=1 must fit "
                     f"the uint8 k_code), got {expand_min}")
  min_quantized_size = _static_int(min_quantized_size, "min_quantized_size",
                                   DEFAULT_MIN_QUANTIZED_SIZE, minimum=0)
  qargs = dict(group_size=group_size, expand_min=expand_min)

  def quantized(p) -> bool:
    return quantize and p.size >= max(min_quantized_size, 1)

  def init_moment(p, fmt, axis):
    if quantized(p):
      return _zero_moment(p.shape, fmt, expand=expand, axis=axis, **qargs)
    return jnp.zeros(p.shape, jnp.float32)

  def slots_of(leaves, axes):
    """The packed layout of these leaves (`packed_state.layout`): slots, groups, plain size."""
    q = [quantized(x) for x in leaves]
    return packed_state.layout([jnp.shape(x) for x in leaves], q,
                               [a if qi else -1 for a, qi in zip(axes, q)], group_size)

  def init_packed(params, axes):
    slots = slots_of(jax.tree.leaves(params), jax.tree.leaves(axes))[0]
    zero = lambda fmt: packed_state.zeros(
        _zero_moment((group_size,), fmt, expand=expand, **qargs), slots, group_size)
    return zero(m_fmt), zero(v_fmt)

  def init_fn(params):
    _check_float_leaves(params)
    axes = group_axes(group_axis, params)
    if packed:
      mu, nu = init_packed(params, axes)
    else:
      mu = jax.tree.map(lambda p, a: init_moment(p, m_fmt, a), params, axes)
      nu = jax.tree.map(lambda p, a: init_moment(p, v_fmt, a), params, axes)
    comp = jax.tree.map(lambda p: jnp.zeros(p.shape, _BF16) if _is_bf16(p) else None,
                        params) if kahan else None
    return CoatAdamWState(jnp.zeros([], jnp.int32), mu, nu, comp)

  def step_fn(updates, state, params=None, *, output):
    """output="update": (updates, state), optax's update_fn. "param": (new params, state)."""
    if params is None and output == "param":
      raise ValueError("coat_adamw_apply: params are required")
    if output == "update" and master_rounding != "nearest":
      raise ValueError(f"coat_adamw: master_rounding={master_rounding!r} needs coat_adamw_apply "
                       f"(the rounding happens where the params are written); optax's update "
                       f"path rounds to nearest")
    if kahan and state.comp is None:
      raise ValueError("coat_adamw_apply: master_rounding='kahan' needs the compensation "
                       "buffers: init the state with coat_adamw(..., master_rounding='kahan')")
    if params is None and not (isinstance(weight_decay, (int, float)) and weight_decay == 0):
      raise ValueError("coat_adamw: params are required for weight decay (pass params to update)")
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    count = optax.safe_increment(state.count)
    # Fused global-norm clipping: one scale for every leaf, applied as the kernel loads g.
    grad_scale = None if max_grad_norm is None else clip_scale(
        optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), updates)), max_grad_norm)
    if params is None:
      params_or_none = jax.tree.map(lambda _: None, updates)
      decay = jax.tree.map(lambda _: False, updates)
    else:
      params_or_none = params
      decay = mask(params) if callable(mask) else mask
      if decay is None:
        decay = jax.tree.map(lambda _: True, params)

    def rounded_step(g, p, m, v, use_decay, c, index, axis, offset=0):
      """A bfloat16 master leaf: the step on its float32 value (p, or p + c with Kahan), rounded
      back to bfloat16 stochastically, or to nearest with the remainder kept in c (Kahan)."""
      p32 = p.astype(jnp.float32)
      if kahan:
        p32 = p32 + c.astype(jnp.float32)  # the master value p + c
      [(new_p, new_m, new_v)] = kernels_adam.coat_adam_tree_step(
          [p32], [g], [m], [v], [use_decay], output=output, lr=lr, b1=b1, b2=b2, eps=eps,
          weight_decay=weight_decay, count=count, m_format=m_fmt, v_format=v_fmt,
          expand=expand, group_axes=[axis], grad_scale=grad_scale, **qargs)
      if kahan:
        hi, lo = split_bf16(new_p)
        return hi, new_m, new_v, lo
      new_p = round_to(new_p, p.dtype, "stochastic", step=count, seed=index, offset=offset)
      return new_p, new_m, new_v, c

    def rounded_leaf(g, p, m, v, use_decay, c, index, axis):
      if p.ndim < 3 or p.ndim + axis == 0:
        return rounded_step(g, p, m, v, use_decay, c, index, axis)
      # A stacked (layers, ...) leaf: one layer at a time (lax.map), so that the float32 working
      # copy is one layer's, not the whole stack's (22.6 GB for Llama-2-13B's MLP stack). The
      # rounding bits use the flat element index (offset), so the result is the whole leaf's.
      rows = p.size // p.shape[0]
      return jax.lax.map(
          lambda a: rounded_step(a[1], a[2], a[3], a[4], use_decay, a[5], index, axis,
                                 offset=a[0] * rows),
          (jnp.arange(p.shape[0], dtype=jnp.uint32), g, p, m, v, c))

    g_leaves, treedef = jax.tree.flatten(updates)
    p_leaves = treedef.flatten_up_to(params_or_none)
    d_leaves = treedef.flatten_up_to(decay)
    c_leaves = treedef.flatten_up_to(state.comp) if kahan else [None] * len(g_leaves)
    axes = treedef.flatten_up_to(group_axes(group_axis, updates if params is None else params))
    # Leaves rounded to bfloat16 master weights (stochastic / kahan) go one by one
    # (`rounded_leaf`); all the others in one dispatch call (on a Hopper GPU the fused kernel).
    rounded = [master_rounding != "nearest" and _is_bf16(p) for p in p_leaves]
    plain = [i for i, r in enumerate(rounded) if not r]
    common = dict(output=output, lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                  count=count, m_format=m_fmt, v_format=v_fmt, expand=expand,
                  grad_scale=grad_scale, **qargs)
    pick = lambda xs, idx: [xs[i] for i in idx]
    out = [None] * len(g_leaves)
    if packed:
      mu, nu, slots = check_packed_state(state, g_leaves, axes)
      if plain:
        res, mu, nu = kernels_adam.coat_adam_packed_step(
            pick(p_leaves, plain), pick(g_leaves, plain), mu, nu, pick(slots, plain),
            pick(d_leaves, plain), **common)
        for i, o in zip(plain, res):
          out[i] = (o, c_leaves[i])
      for i in [i for i, r in enumerate(rounded) if r]:
        s = slots[i]
        new_p, m_i, v_i, c_i = rounded_leaf(
            g_leaves[i], p_leaves[i], packed_state.leaf(mu, s, group_size),
            packed_state.leaf(nu, s, group_size), d_leaves[i], c_leaves[i], i, s.axis)
        mu = packed_state.with_leaf(mu, s, m_i, group_size)
        nu = packed_state.with_leaf(nu, s, v_i, group_size)
        out[i] = (new_p, c_i)
    else:
      m_leaves, v_leaves, axes = check_leaves_state(state, treedef, g_leaves, axes)
      if plain:
        res = kernels_adam.coat_adam_tree_step(
            pick(p_leaves, plain), pick(g_leaves, plain), pick(m_leaves, plain),
            pick(v_leaves, plain), pick(d_leaves, plain), group_axes=pick(axes, plain),
            **common)
        for i, o in zip(plain, res):
          out[i] = (*o, c_leaves[i])
      for i in [i for i, r in enumerate(rounded) if r]:
        out[i] = rounded_leaf(g_leaves[i], p_leaves[i], m_leaves[i], v_leaves[i], d_leaves[i],
                              c_leaves[i], i, axes[i])
      mu = treedef.unflatten([o[1] for o in out])
      nu = treedef.unflatten([o[2] for o in out])
    new_updates = treedef.unflatten([o[0] for o in out])
    comp = treedef.unflatten([o[-1] for o in out]) if kahan else state.comp
    return new_updates, CoatAdamWState(count, mu, nu, comp)

  def check_leaves_state(state, treedef, g_leaves, axes):
    """(m leaves, v leaves, group axes: -1 for float32 moments) of a per-leaf state; ValueError
    for a packed state or moments whose shapes do not fit the params and group_axis."""
    if isinstance(state.mu, packed_state.PackedMoments):
      raise ValueError("coat_adamw: the state is in the packed layout; this coat_adamw was made "
                       "with state_layout='leaves' (init and step with the same state_layout)")
    m_leaves = treedef.flatten_up_to(state.mu)
    v_leaves = treedef.flatten_up_to(state.nu)
    # Each quantized leaf's group axis (`group_axes`); its moments are in the param's layout.
    axes = [a if _is_moment_leaf(m) else -1 for a, m in zip(axes, m_leaves)]
    for g, m, a in zip(g_leaves, m_leaves, axes):
      if _is_moment_leaf(m) and (m.data.shape != jnp.shape(g) or m.amax.shape !=
                                 expansion.metadata_shape(jnp.shape(g), group_size, a)):
        raise ValueError(f"coat_adamw: a moment of shape {m.data.shape} with scales of shape "
                         f"{m.amax.shape} for a parameter of shape {jnp.shape(g)} grouped along "
                         f"axis {a} (group_axis={group_axis!r}): init the state with the same "
                         f"group_axis")
    return m_leaves, v_leaves, axes

  def check_packed_state(state, g_leaves, axes):
    """(mu, nu, slots) of a packed state; ValueError for a per-leaf state or buffers whose sizes
    are not this tree's layout."""
    if not isinstance(state.mu, packed_state.PackedMoments):
      raise ValueError("coat_adamw: the state is in the per-leaf layout; this coat_adamw was "
                       "made with state_layout='packed' (init and step with the same "
                       "state_layout)")
    slots, groups, plain_size = slots_of(g_leaves, axes)
    want = ((groups * group_size,), (groups,), (groups,), (plain_size,),
            (packed_state.fingerprint(slots, group_size),))
    for name, moment in (("mu", state.mu), ("nu", state.nu)):
      have = tuple(x.shape for x in moment)
      if have != want:
        raise ValueError(f"coat_adamw: packed {name} was made for another layout (buffers of "
                         f"shapes {have}, this tree and these settings need {want}): init the "
                         f"state from these params with the same group_size, group_axis and "
                         f"min_quantized_size")
    return state.mu, state.nu, slots

  return init_fn, step_fn


def _check_max_grad_norm(max_grad_norm):
  """ValueError unless max_grad_norm is None or > 0 (traced values, inject_hyperparams', pass)."""
  if max_grad_norm is None or isinstance(max_grad_norm, jax.core.Tracer):
    return
  ok = not isinstance(max_grad_norm, bool) and (isinstance(max_grad_norm, (int, float)) or
                                                hasattr(max_grad_norm, "dtype"))
  try:
    ok = ok and jnp.ndim(max_grad_norm) == 0 and float(max_grad_norm) > 0
  except (TypeError, ValueError):
    ok = False
  if not ok:
    raise ValueError(f"coat_adamw: max_grad_norm must be None or a number > 0, got "
                     f"{max_grad_norm!r}")


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
