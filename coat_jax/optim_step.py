"""coat_adamw's init and step, assembled from small transforms over the flattened tree.

One step, for the tree's leaves i (the math: coat_jax.adam_math; the public face: coat_jax.optim):

  `step_args`       StepArgs: t = count + 1, lr = schedule(count), and with max_grad_norm c the
                    clip scale s = min(1, c / ||g||) (float32 global norm; `adam_math.clip_scale`)
  `flatten_step`    StepLeaves: each leaf's gradient, param (None without params), weight-decay
                    flag (the mask), Kahan compensation and group axis
  a MomentLayout    how mu / nu are stored (`LAYOUTS`): per leaf ("leaves") or in flat buffers
                    ("packed"); each is a pair (init, step), optax style. Its step runs every
                    leaf kept to nearest in one dispatch call (kernels_adam: on a Hopper GPU the
                    fused kernel) and the others through `rounded_step`
  `rounded_step`    a bfloat16 master leaf under master_rounding "stochastic" | "kahan": the step
                    on its float32 value p (+ c), then p' = round(y) stochastically, or
                    p' = bf16(y), c' = bf16(y - p') (Kahan)

`output` picks the product: "update" (optax's u = -lr * (m / denom + wd * p)) or "param" (the
new params, written by the same kernel pass).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from coat_jax import expansion, packed_state
from coat_jax.kernels import adam as kernels_adam
from coat_jax.adam_math import clip_scale
from coat_jax.expansion import ExpandedMoment
from coat_jax.optim_config import CoatAdamWConfig, unwrap_variables
from coat_jax.optim_state import (CoatAdamWState, check_float_params, group_axes,
                                  init_compensation, init_leaf_moments, init_packed_moments,
                                  packed_slots)
from coat_jax.rounding import round_to, split_bf16

__all__ = ["AdamHyper", "LAYOUTS", "MomentLayout", "StepArgs", "StepLeaves", "flatten_step",
           "init", "rounded_step", "step", "step_args"]

_BF16 = jnp.dtype(jnp.bfloat16)


class AdamHyper(NamedTuple):
  """The numeric hyperparameters (Python numbers, or arrays under optax.inject_hyperparams);
  learning_rate may be a schedule count -> lr."""
  learning_rate: Any
  b1: Any
  b2: Any
  eps: Any
  weight_decay: Any


class StepArgs(NamedTuple):
  """What every leaf's step takes (the kernels' keyword arguments): lr at this step, b1, b2,
  eps, weight_decay, count = t (after the increment) and grad_scale (None: no clipping)."""
  lr: Any
  b1: Any
  b2: Any
  eps: Any
  weight_decay: Any
  count: jax.Array
  grad_scale: jax.Array | None


class StepLeaves(NamedTuple):
  """The tree a step walks, one entry per leaf (tree order): gradients, params (None entries
  without params), weight-decay flags, Kahan compensation (None entries without) and group axes."""
  grads: list
  params: list
  decay: list
  comp: list
  axes: list


def step_args(hyper: AdamHyper, max_grad_norm, count, grads) -> StepArgs:
  """lr = learning_rate(count) (a schedule sees the count before the step), t = count + 1,
  grad_scale = clip_scale(float32 global norm of grads, max_grad_norm) or None."""
  lr = hyper.learning_rate
  lr = lr(count) if callable(lr) else lr
  grad_scale = None if max_grad_norm is None else clip_scale(
      optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads)), max_grad_norm)
  return StepArgs(lr, hyper.b1, hyper.b2, hyper.eps, hyper.weight_decay,
                  optax.safe_increment(count), grad_scale)


def flatten_step(cfg: CoatAdamWConfig, mask, grads, state: CoatAdamWState,
                 params) -> tuple[StepLeaves, Any]:
  """(StepLeaves, treedef) of a step's inputs, Flax NNX Variables unwrapped; `mask` (a tree of
  bools or a callable params -> one; None: everywhere) picks the leaves with weight decay (none
  without params)."""
  pure = unwrap_variables(grads)
  g_leaves, treedef = jax.tree.flatten(pure)
  n = len(g_leaves)
  if params is None:
    p_leaves, decay = [None] * n, [False] * n
  else:
    p_leaves = treedef.flatten_up_to(unwrap_variables(params))
    decay = mask(params) if callable(mask) else mask
    decay = [True] * n if decay is None else treedef.flatten_up_to(unwrap_variables(decay))
  comp = treedef.flatten_up_to(state.comp) if cfg.kahan else [None] * n
  axes = treedef.flatten_up_to(group_axes(cfg.group_axis, pure if params is None
                                          else unwrap_variables(params)))
  return StepLeaves(g_leaves, p_leaves, decay, comp, axes), treedef


def rounded_step(cfg: CoatAdamWConfig, args: StepArgs, leaves: StepLeaves, i: int, m, v,
                 output: str):
  """Leaf i, a bfloat16 master weight under master_rounding "stochastic" or "kahan": the step
  on its float32 value x (p, or p + c with Kahan), y = x - lr * (m / denom + wd * x), stored as
  p' = round(y) stochastically (bits from (element, step, leaf i)), or as p' = bf16(y),
  c' = bf16(y - p') (Kahan). Returns (p', m', v', c'). A stacked (layers, ...) leaf goes one
  layer at a time in a loop that writes each layer's results over its inputs (the param, moment
  and compensation stacks are the loop's carry, updated in place), so the step holds one layer's
  float32 working copy and no second copy of the stacks (a loop mapping layers to new stacks
  held both: 2 more bytes per param at the peak); the rounding bits use the flat element index
  (offset), so the result is the whole leaf's."""
  g, p, use_decay, c, axis = (leaves.grads[i], leaves.params[i], leaves.decay[i],
                              leaves.comp[i], leaves.axes[i])

  def one(g, p, m, v, c, offset=0):
    p32 = p.astype(jnp.float32)
    if cfg.kahan:
      p32 = p32 + c.astype(jnp.float32)  # the master value p + c
    [(new_p, new_m, new_v)] = kernels_adam.coat_adam_tree_step(
        [p32], [g], [m], [v], [use_decay], output=output, group_axes=[axis], **args._asdict(),
        **cfg.moment_args)
    if cfg.kahan:
      hi, lo = split_bf16(new_p)
      return hi, new_m, new_v, lo
    new_p = round_to(new_p, p.dtype, "stochastic", step=args.count, seed=i, offset=offset)
    return new_p, new_m, new_v, c

  if p.ndim < 3 or p.ndim + axis == 0:
    return one(g, p, m, v, c)
  rows = p.size // p.shape[0]
  take = lambda tree, k: jax.tree.map(
      lambda x: jax.lax.dynamic_index_in_dim(x, k, keepdims=False), tree)

  def layer(k, stacks):
    new = one(take(g, k), *take(stacks, k), offset=k.astype(jnp.uint32) * rows)
    return jax.tree.map(lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, k, 0), stacks, new)

  return jax.lax.fori_loop(0, p.shape[0], layer, (p, m, v, c))


def _rounded(cfg: CoatAdamWConfig, leaves: StepLeaves) -> list[bool]:
  """Which leaves take `rounded_step`: bfloat16 params under a rounding other than nearest."""
  return [cfg.master_rounding != "nearest" and p is not None and jnp.dtype(p.dtype) == _BF16
          for p in leaves.params]


def _pick(xs, idx):
  return [xs[i] for i in idx]


def _leaf_moments(cfg: CoatAdamWConfig, state, treedef, leaves: StepLeaves):
  """(m leaves, v leaves, group axes: -1 for float32 moments) of a per-leaf state; ValueError
  for a packed state or moments whose shapes do not fit the params and group_axis."""
  if isinstance(state.mu, packed_state.PackedMoments):
    raise ValueError("coat_adamw: the state is in the packed layout; this coat_adamw was made "
                     "with state_layout='leaves' (init and step with the same state_layout)")
  m_leaves, v_leaves = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
  axes = [a if isinstance(m, ExpandedMoment) else -1 for a, m in zip(leaves.axes, m_leaves)]
  for g, m, a in zip(leaves.grads, m_leaves, axes):
    if isinstance(m, ExpandedMoment) and (m.data.shape != jnp.shape(g) or m.amax.shape !=
                                          expansion.metadata_shape(jnp.shape(g),
                                                                   cfg.group_size, a)):
      raise ValueError(f"coat_adamw: a moment of shape {m.data.shape} with scales of shape "
                       f"{m.amax.shape} for a parameter of shape {jnp.shape(g)} grouped along "
                       f"axis {a} (group_axis={cfg.group_axis!r}): init the state with the same "
                       f"group_axis")
  return m_leaves, v_leaves, axes


def step_leaf_moments(cfg: CoatAdamWConfig, args: StepArgs, leaves: StepLeaves, state,
                      treedef, output: str):
  """The per-leaf layout's step: (outputs, compensation, mu, nu) as lists and trees."""
  m, v, axes = _leaf_moments(cfg, state, treedef, leaves)
  leaves = leaves._replace(axes=axes)
  outs, comps = [None] * len(m), list(leaves.comp)
  rounded = _rounded(cfg, leaves)
  plain = [i for i, r in enumerate(rounded) if not r]
  if plain:
    res = kernels_adam.coat_adam_tree_step(
        _pick(leaves.params, plain), _pick(leaves.grads, plain), _pick(m, plain),
        _pick(v, plain), _pick(leaves.decay, plain), group_axes=_pick(axes, plain),
        output=output, **args._asdict(), **cfg.moment_args)
    for i, (o, m_i, v_i) in zip(plain, res):
      outs[i], m[i], v[i] = o, m_i, v_i
  for i in [i for i, r in enumerate(rounded) if r]:
    outs[i], m[i], v[i], comps[i] = rounded_step(cfg, args, leaves, i, m[i], v[i], output)
  return outs, comps, treedef.unflatten(m), treedef.unflatten(v)


def _packed_moments(cfg: CoatAdamWConfig, state, leaves: StepLeaves):
  """(mu, nu, slots) of a packed state; ValueError for a per-leaf state or buffers whose sizes
  are not this tree's layout."""
  if not isinstance(state.mu, packed_state.PackedMoments):
    raise ValueError("coat_adamw: the state is in the per-leaf layout; this coat_adamw was "
                     "made with state_layout='packed' (init and step with the same "
                     "state_layout)")
  slots, groups, plain_size = packed_slots(cfg, leaves.grads, leaves.axes)
  g = cfg.group_size
  want = ((groups * g,), (groups,), (groups,), (plain_size,),
          (packed_state.fingerprint(slots, g),))
  for name, moment in (("mu", state.mu), ("nu", state.nu)):
    have = tuple(x.shape for x in moment)
    if have != want:
      raise ValueError(f"coat_adamw: packed {name} was made for another layout (buffers of "
                       f"shapes {have}, this tree and these settings need {want}): init the "
                       f"state from these params with the same group_size, group_axis and "
                       f"min_quantized_size")
  return state.mu, state.nu, slots


def step_packed_moments(cfg: CoatAdamWConfig, args: StepArgs, leaves: StepLeaves, state,
                        treedef, output: str):
  """The packed layout's step: (outputs, compensation, mu, nu); a rounded leaf steps on its
  slice of the buffers (`packed_state.leaf`), written back with `packed_state.with_leaf`."""
  del treedef  # the buffers hold the whole tree
  mu, nu, slots = _packed_moments(cfg, state, leaves)
  outs, comps = [None] * len(slots), list(leaves.comp)
  rounded = _rounded(cfg, leaves)
  plain = [i for i, r in enumerate(rounded) if not r]
  if plain:
    res, mu, nu = kernels_adam.coat_adam_packed_step(
        _pick(leaves.params, plain), _pick(leaves.grads, plain), mu, nu, _pick(slots, plain),
        _pick(leaves.decay, plain), output=output, **args._asdict(), **cfg.moment_args)
    for i, o in zip(plain, res):
      outs[i] = o
  g = cfg.group_size
  for i in [i for i, r in enumerate(rounded) if r]:
    s = slots[i]
    outs[i], m_i, v_i, comps[i] = rounded_step(
        cfg, args, leaves._replace(axes=[x.axis for x in slots]), i,
        packed_state.leaf(mu, s, g), packed_state.leaf(nu, s, g), output)
    mu = packed_state.with_leaf(mu, s, m_i, g)
    nu = packed_state.with_leaf(nu, s, v_i, g)
  return outs, comps, mu, nu


class MomentLayout(NamedTuple):
  """How mu / nu are stored, as a pair of pure functions (optax style):
  init(cfg, params, axes) -> (mu, nu);
  step(cfg, args, leaves, state, treedef, output) -> (outputs, compensation leaves, mu, nu)."""
  init: Callable
  step: Callable


LAYOUTS = {"leaves": MomentLayout(init_leaf_moments, step_leaf_moments),
           "packed": MomentLayout(init_packed_moments, step_packed_moments)}


def init(cfg: CoatAdamWConfig, params) -> CoatAdamWState:
  """The state before the first step: count 0, zero moments in cfg's layout, zero Kahan
  compensation. The state is a tree like the params' values (Flax NNX Variables unwrapped), so
  that `flax.nnx.Optimizer` (init on Variables, update on arrays) keeps one structure; under a
  mesh with Explicit axes each moment has the sharding the step returns it with."""
  params = unwrap_variables(params)
  check_float_params(params)
  mu, nu = LAYOUTS[cfg.state_layout].init(cfg, params, group_axes(cfg.group_axis, params))
  return CoatAdamWState(jnp.zeros([], jnp.int32), mu, nu, init_compensation(cfg, params))


def step(cfg: CoatAdamWConfig, hyper: AdamHyper, mask, grads, state: CoatAdamWState, params,
         *, output: str):
  """One step: (updates, state) with output="update" (optax's update_fn), (new params, state)
  with "param". The result has the structure of grads (updates) or params (new params)."""
  if params is None and output == "param":
    raise ValueError("coat_adamw_apply: params are required")
  if output == "update" and cfg.master_rounding != "nearest":
    raise ValueError(f"coat_adamw: master_rounding={cfg.master_rounding!r} needs "
                     f"coat_adamw_apply (the rounding happens where the params are written); "
                     f"optax's update path rounds to nearest")
  if cfg.kahan and state.comp is None:
    raise ValueError("coat_adamw_apply: master_rounding='kahan' needs the compensation "
                     "buffers: init the state with coat_adamw(..., master_rounding='kahan')")
  wd = hyper.weight_decay
  if params is None and not (isinstance(wd, (int, float)) and wd == 0):
    raise ValueError("coat_adamw: params are required for weight decay (pass params to update)")
  args = step_args(hyper, cfg.max_grad_norm, state.count, unwrap_variables(grads))
  leaves, treedef = flatten_step(cfg, mask, grads, state, params)
  outs, comps, mu, nu = LAYOUTS[cfg.state_layout].step(cfg, args, leaves, state, treedef, output)
  like = grads if output == "update" else params
  comp = treedef.unflatten(comps) if cfg.kahan else state.comp
  return jax.tree.structure(like).unflatten(outs), CoatAdamWState(args.count, mu, nu, comp)
