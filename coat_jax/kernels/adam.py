"""The Adam family's dispatch: the fused optimizer step of one leaf (`coat_adam_step`), of a
list of leaves (`coat_adam_tree_step`), or of leaves whose moments are in the packed layout
(`coat_adam_packed_step`, coat_jax.packed_state), on the jax-triton kernel
(pallas_kernels.adam.adam_step_triton) or `coat_jax.adam_math`'s reference.

The kernel runs where `implementation("adam")` is "triton" (a Hopper GPU with jax-triton:
`pip install coat-jax[gpu]`; without it the reference, with one warning), for FP8 moments, G a
power of two >= 16 and the group axis' length a multiple of G; on a mesh each shard runs it on
its local moments (`backends.rows`).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from coat_jax import adam_math, expansion, formats, packed_state
from coat_jax.expansion import ExpandedMoment
from coat_jax.kernels import backends

__all__ = ["adam_kernel_limits", "coat_adam_packed_step", "coat_adam_step", "coat_adam_tree_step"]


def adam_kernel_limits(m_format, v_format) -> dict:
  """The format limits the fused Adam kernel takes as arguments (pallas_kernels import no
  coat_jax): log2 of each moment format's expansion range, the amax floor, the largest k code
  and the gradient clamp."""
  mf, vf = formats.get_format(m_format), formats.get_format(v_format)
  return dict(m_log2_range=math.log2(expansion.expansion_range(mf)),
              v_log2_range=math.log2(expansion.expansion_range(vf)),
              floor=float(expansion.AMAX_FLOOR), max_code=expansion.MAX_K_CODE,
              grad_clamp=adam_math.GRAD_CLAMP)


def _triton_static(m_format, v_format, *, group_size, expand, expand_min, output, group_axis):
  """The jax-triton kernel's static arguments (`adam_step_triton.adam_step`) for these
  settings: format limits, fast math, in-place outputs."""
  limits = adam_kernel_limits(m_format, v_format)
  return dict(m_fmax=formats.get_format(m_format).max, v_fmax=formats.get_format(v_format).max,
              m_log2_range=limits["m_log2_range"], v_log2_range=limits["v_log2_range"],
              max_k_code=limits["max_code"], amax_floor=limits["floor"],
              grad_clamp=limits["grad_clamp"], group_size=group_size, expand=expand,
              expand_min=expand_min, output=output, alias=True, fast_math=True,
              group_axis=group_axis)


def _triton_kernels():
  """pallas_kernels.adam.adam_step_triton, or ValueError naming the install when jax-triton is
  missing (only asked for where `implementation("adam")` is "triton")."""
  from pallas_kernels.adam import adam_step_triton
  if not adam_step_triton.available():
    raise ValueError(f"adam=triton needs triton and jax-triton on a GPU ({backends.INSTALL_HINT})")
  return adam_step_triton


def _hyper(lr, b1, b2, eps, weight_decay, count, grad_scale) -> dict:
  """The step's hyperparameters as kernel arguments: Python numbers stay Python numbers, arrays
  (schedules, inject_hyperparams, count) are float32 / int scalars."""
  hyper = dict(lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, count=count)
  if grad_scale is not None:
    hyper["grad_scale"] = jnp.asarray(grad_scale, jnp.float32)
  return hyper


def coat_adam_step(param, grad, m, v, *, lr, b1, b2, eps, weight_decay, count, m_format,
                   v_format, group_size, expand, expand_min, output="param", group_axis=-1,
                   grad_scale=None):
  """See `coat_jax.adam_math.adam_step_reference`: (new_param or update, new_m, new_v), one leaf.

  output: "param" (new param, param.dtype) or "update" (optax's u = -lr * (m/denom + wd*p), in
  grad.dtype; param may then be None: no decay term). group_axis: the moments' group axis
  (-1, or -2: COAT's layout, metadata (..., in / G, out)). grad_scale: None or a float32 scalar
  the step multiplies the gradient by (fused global-norm clipping, `adam_math.clip_scale`).
  Kernel (`implementation("adam")` "triton", both moments ExpandedMoment: FP8 moments, G a power
  of two >= 16; group_axis -1 or -2, that axis' length % G == 0; applies grad_scale as it loads
  the gradient). Shapes the kernel does not take: the reference.
  """
  kwargs = dict(lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, count=count,
                group_size=group_size, expand=expand, expand_min=expand_min, output=output,
                group_axis=group_axis, grad_scale=grad_scale)
  like = grad if param is None else param
  if (isinstance(m, ExpandedMoment) and isinstance(v, ExpandedMoment)
      and backends.implementation("adam") == "triton"):
    pk = _triton_kernels()
    if pk.supported(like.shape, like.dtype, m.data.dtype, v.data.dtype, group_size, group_axis):
      return _kernel_step(pk, param, grad, m, v, m_format, v_format, kwargs)
  return adam_math.adam_step_reference(param, grad, m, v, m_format=m_format, v_format=v_format,
                                       **kwargs)


def _kernel_step(pk, param, grad, m, v, m_format, v_format, kwargs):
  """The kernel's step of one leaf (per shard on a mesh): new param and moments written over the
  old ones (alias), in place when the caller donates them (a jitted train step with donated
  state does)."""
  static = _triton_static(m_format, v_format, group_size=kwargs["group_size"],
                          expand=kwargs["expand"], expand_min=kwargs["expand_min"],
                          output=kwargs["output"], group_axis=kwargs["group_axis"])
  # arrays (schedules, inject_hyperparams, count) are replicated scalar operands on a mesh
  hyper = _hyper(*(kwargs[k] for k in ("lr", "b1", "b2", "eps", "weight_decay", "count",
                                       "grad_scale")))
  traced = [k for k, x in hyper.items() if not isinstance(x, (int, float))]
  fixed = {k: x for k, x in hyper.items() if k not in traced}
  p_in = [] if param is None else [param]

  def kernel(*a):
    p = a[0] if param is not None else None
    g, md, ma, mk, vd, va, vk, *hv = a[len(p_in):]
    return tuple(pk.adam_step(p, g, md, ma, mk, vd, va, vk, **static, **fixed,
                              **dict(zip(traced, hv))))

  args = p_in + [grad, *m, *v] + [jnp.asarray(hyper[k]) for k in traced]
  kinds = ["data"] * (len(p_in) + 1) + ["data", "meta", "meta"] * 2 + ["scalar"] * len(traced)
  out, *mv = backends.rows(kernel, args, kinds, ["data"] + ["data", "meta", "meta"] * 2,
                           kwargs["group_size"], kwargs["group_axis"])
  return out, ExpandedMoment(*mv[:3]), ExpandedMoment(*mv[3:])


def coat_adam_tree_step(params, grads, ms, vs, decay, *, lr, b1, b2, eps, weight_decay, count,
                        m_format, v_format, group_size, expand, expand_min, output="param",
                        group_axes=None, grad_scale=None):
  """Every leaf's step: [(new_param or update, new_m, new_v)] as `coat_adam_step` per leaf with
  weight decay `weight_decay` where decay[i] (0 elsewhere); float32 moments (not ExpandedMoment)
  take `adam_math.adam_step_reference`.

  params, grads, ms, vs: equal-length lists (params entries None only with output="update").
  group_axes: each leaf's moment group axis (None: all -1). grad_scale: None or a float32 scalar
  every leaf's gradient is multiplied by (as `coat_adam_step`).
  """
  n = len(grads)
  group_axes = [-1] * n if group_axes is None else list(group_axes)
  if not (len(params) == len(ms) == len(vs) == len(decay) == len(group_axes) == n):
    raise ValueError(f"coat_adam_tree_step: {len(params)} params, {n} grads, {len(ms)} / "
                     f"{len(vs)} moments and {len(decay)} decay flags: lengths must agree")
  common = dict(lr=lr, b1=b1, b2=b2, eps=eps, count=count, m_format=m_format,
                v_format=v_format, group_size=group_size, expand=expand, expand_min=expand_min,
                output=output, grad_scale=grad_scale)
  results, jits = [], {}
  for p, g, m, v, d, axis in zip(params, grads, ms, vs, decay, group_axes):
    wd = weight_decay if d else 0.0
    if isinstance(m, ExpandedMoment) and isinstance(v, ExpandedMoment):
      results.append(_leaf_step_traced_once(jits, p, g, m, v, weight_decay=wd, group_axis=axis,
                                            **common))
    else:
      results.append(adam_math.adam_step_reference(p, g, m, v, weight_decay=wd, **common))
  return results


def _leaf_step_traced_once(jits: dict, param, grad, m, v, **kwargs):
  """`coat_adam_step` through a jit made once per distinct setting (the keyword arguments that
  are not arrays, by type and value) and kept in `jits`: leaves of one shape and setting share
  one trace and one lowering, which the step calls once per leaf. An unrolled model has every
  layer's leaves apart (7 per Llama block): traced per leaf, each jax-triton call's lowering
  packed and compressed the kernel anew. `jits` lives for one tree step, so a trace never
  outlives the kernel choices of its context (`kernels.backend`, the mesh). A setting that
  cannot be a key runs `coat_adam_step` itself."""
  arrays = {k: x for k, x in kwargs.items() if isinstance(x, (jax.Array, np.ndarray))}
  static = tuple(sorted((k, type(x), x) for k, x in kwargs.items() if k not in arrays))
  try:
    fn = jits.get(static)
  except TypeError:    # an unhashable setting
    return coat_adam_step(param, grad, m, v, **kwargs)
  if fn is None:
    settings = {k: x for k, _, x in static}
    fn = jits[static] = jax.jit(lambda p, g, m, v, arrays: coat_adam_step(p, g, m, v, **settings,
                                                                          **arrays))
  return fn(param, grad, m, v, arrays)


def coat_adam_packed_step(params, grads, m: packed_state.PackedMoments,
                          v: packed_state.PackedMoments, slots, decay, *, lr, b1, b2, eps,
                          weight_decay, count, m_format, v_format, group_size, expand,
                          expand_min, output="param", grad_scale=None):
  """`coat_adam_tree_step` on moments in the packed layout (coat_jax.packed_state): returns
  ([new param or update per leaf], new m, new v). slots: each leaf's `packed_state.Slot`.

  On one device with the jax-triton kernel (`implementation("adam") == "triton"`), a
  quantized leaf the kernel takes is one launch on the packed buffers (`adam_step(...,
  packed_at=slot.start)`: it writes the leaf's slot in place, the launches chained through the
  buffers). Every other leaf (float32 moments, shapes the kernel does not take, CPU, meshes)
  steps on its slice (`packed_state.leaf`) as `coat_adam_tree_step` does, written back with
  `packed_state.with_leaf`; those go first, so that no slice is read
  after a kernel has written over its buffer.
  """
  n = len(grads)
  if not (len(params) == len(slots) == len(decay) == n):
    raise ValueError(f"coat_adam_packed_step: {len(params)} params, {n} grads, {len(slots)} slots "
                     f"and {len(decay)} decay flags: lengths must agree")
  common = dict(lr=lr, b1=b1, b2=b2, eps=eps, count=count, m_format=m_format,
                v_format=v_format, group_size=group_size, expand=expand, expand_min=expand_min,
                output=output, grad_scale=grad_scale)
  pk = None
  if (backends.implementation("adam") == "triton" and not backends.per_shard()
      and not backends.interpret_mode()):
    pk = _triton_kernels()

  def on_kernel(p, g, slot) -> bool:
    like = g if p is None else p
    return pk is not None and slot.quantized and pk.supported(
        like.shape, like.dtype, m.data.dtype, v.data.dtype, group_size, slot.axis)

  kernel = [on_kernel(p, g, s) for p, g, s in zip(params, grads, slots)]
  results = [None] * n
  for i in [i for i in range(n) if not kernel[i]]:
    slot = slots[i]
    (out, mi, vi), = coat_adam_tree_step(
        [params[i]], [grads[i]], [packed_state.leaf(m, slot, group_size)],
        [packed_state.leaf(v, slot, group_size)], [decay[i]], weight_decay=weight_decay,
        group_axes=[slot.axis], **common)
    m = packed_state.with_leaf(m, slot, mi, group_size)
    v = packed_state.with_leaf(v, slot, vi, group_size)
    results[i] = out
  hyper = _hyper(lr, b1, b2, eps, weight_decay, count, grad_scale)
  for i in [i for i in range(n) if kernel[i]]:
    slot = slots[i]
    static = _triton_static(m_format, v_format, group_size=group_size, expand=expand,
                            expand_min=expand_min, output=output, group_axis=slot.axis)
    h = dict(hyper, weight_decay=weight_decay if decay[i] else 0.0)
    results[i], *mv = pk.adam_step(params[i], grads[i], *m[:3], *v[:3], **static, **h,
                                   packed_at=slot.start, segment=packed_state.SEGMENT)
    m = m._replace(data=mv[0], amax=mv[1], k_code=mv[2])
    v = v._replace(data=mv[3], amax=mv[4], k_code=mv[5])
  return results, m, v
