"""Fused COAT AdamW step (Pallas, Triton backend): one pass over param, grad and both FP8 moments.

Per group of G (128) elements along the last axis, one row of a (P/G, G) view:
dequantize + inverse expansion of m and v, Adam moment update, the float32 step, then
expansion + requantization of both moments (new amax, k_code, FP8 data). Same signature and
arithmetic as `coat_jax.adam_math.adam_step_reference`. `output` picks what the step writes: the new
param (`"param"`) or optax's update u = -lr * (m/denom + wd*p) (`"update"`, as `coat_adamw` uses).

Not bit-exact with the reference: log2/exp2 may differ from XLA's in the last ulp, and two
per-element divisions of the reference are replaced (fewer MUFU ops per element):
  - requantization computes log2(|x| / mx) as log2|x| - log2(mx) (log2(mx) once per row);
  - the denominator uses sqrt(v) * (1 / sqrt(1 - b2^t)) instead of sqrt(v) / sqrt(1 - b2^t).
Both move values by ~1e-6 relative (the second touches only the param / update), so a few FP8
codes can differ by one (tests/test_kernels_adam.py bounds this).
Supported: last axis divisible by G; other shapes raise ValueError (`coat_jax.kernels` checks
`supported` and otherwise calls the reference). Imports only jax and numpy: a moment comes in and
goes out as three plain arrays (data, amax, k_code), the format's limits as arguments (fmax from
the storage dtype: jnp.finfo / jnp.iinfo), and the dispatch wraps them in ExpandedMoment.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.adam_operands import OUTPUTS


def _saturate(y: jax.Array, fmax: float) -> jax.Array:
  """Clamp to +-fmax keeping NaN (Triton's min/max would turn NaN into a bound)."""
  return jnp.where(y != y, y, jnp.minimum(jnp.maximum(y, -fmax), fmax))


def _pow2_divisor(n: int, cap: int) -> int:
  """Largest power of two <= cap dividing n."""
  b = 1
  while b < cap and n % (2 * b) == 0:
    b *= 2
  return b


STORAGE_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2), jnp.dtype(jnp.int8))


def supported(param: jax.Array, group_size: int) -> bool:
  """Shapes/types the kernel takes: float, ndim >= 1, last axis % G == 0.

  `param` may be any float array of the param's shape (e.g. the gradient when there is no param).
  """
  return (param.ndim >= 1 and param.size > 0 and group_size >= 1
          and param.shape[-1] % group_size == 0 and jnp.issubdtype(param.dtype, jnp.floating))


def storage_max(dtype) -> float:
  """Largest value of a moment storage dtype: 448 (e4m3fn), 57344 (e5m2), 127 (int8)."""
  dtype = jnp.dtype(dtype)
  if dtype not in STORAGE_DTYPES:
    raise ValueError(f"coat adam_step kernel: moment storage dtype must be one of "
                     f"{[str(d) for d in STORAGE_DTYPES]}, got {dtype}")
  return float(jnp.iinfo(dtype).max if dtype == jnp.int8 else jnp.finfo(dtype).max)


def _div(x, y, interpret):
  # The barrier keeps XLA:CPU's true division in interpret mode (XLA:CPU would rewrite
  # x / broadcast(s) into x * (1 / s) in a fused body); on the GPU Triton's `/` and XLA's are
  # both div.full.f32.
  return x / jax.lax.optimization_barrier(y) if interpret else x / y


def _ptx_unary(instruction: str, x: jax.Array) -> jax.Array:
  [out] = pltriton.elementwise_inline_asm(
      f"{instruction} $0, $1;", args=[x], constraints="=f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
  return out


class _Math:
  """The per-element transcendental ops of the step.

  precise: jnp's (libdevice __nv_log2f / __nv_exp2f / sqrt.rn, Triton's div.full) as in the
  reference. fast (GPU only): single MUFU instructions lg2/ex2/sqrt/rcp .approx.ftz.f32, whose
  relative errors (~2^-22) are far below FP8 rounding (2^-4, 2^-3); inputs below 2^-126 count as 0.
  Per-row math (k, log2(amax)) always uses the precise ops.
  """

  def __init__(self, fast: bool, interpret: bool):
    self.fast = fast and not interpret
    self.interpret = interpret

  def log2(self, x):
    return _ptx_unary("lg2.approx.ftz.f32", x) if self.fast else jnp.log2(x)

  def exp2(self, x):
    return _ptx_unary("ex2.approx.ftz.f32", x) if self.fast else jnp.exp2(x)

  def sqrt(self, x):
    return _ptx_unary("sqrt.approx.ftz.f32", x) if self.fast else jnp.sqrt(x)

  def div(self, x, y):
    if self.fast:
      return x * _ptx_unary("rcp.approx.ftz.f32", y)
    return _div(x, y, self.interpret)


def _load(q_ref, amax_ref, code_ref, fmax, expand_min, interpret, fm: _Math):
  """Inverse of the expansion (as `coat_jax.expansion.dequantize_expanded`): float32 (r, G)."""
  q = q_ref[...].astype(jnp.float32)
  qa = jnp.abs(q)
  mx = amax_ref[...][:, None]
  code = code_ref[...].astype(jnp.float32)[:, None]
  inv_fmax = float(np.float32(1.0) / np.float32(fmax))
  inv_k = _div(jnp.full(code.shape, float(expand_min), jnp.float32), code, interpret)
  powered = fm.exp2(jnp.log2(mx) + inv_k * fm.log2(qa * inv_fmax))   # no float32 underflow
  linear = qa * (mx * inv_fmax)
  mag = jnp.where(code == float(expand_min), linear, powered)
  return jnp.sign(q) * mag


def _store(x, fmax, log2_range, expand, expand_min, floor, max_code, interpret, fm: _Math):
  """Expansion + requantization (as `coat_jax.expansion.quantize_expanded`): (q f32, amax (r,),
  code).

  The power (|x| / mx)^k is exp2(k * (log2|x| - log2(mx))): per element one log2 and one exp2,
  no division (the reference divides first). |x| = 0 gives -inf, hence 0, as before; a rounding
  that lands just above fmax is clamped below. k itself is computed as in the reference (per row,
  from log2(mx / mn)), since a k one step off would move every code of the group.
  """
  a = jnp.abs(x)
  mx = jnp.max(a, axis=-1) + floor
  if expand:
    mn_nz = jnp.min(jnp.where(a > 0, a, jnp.inf), axis=-1)
    mn = jnp.where(mn_nz == jnp.inf, mx, mn_nz + floor)
    lr = jnp.log2(_div(mx, mn, interpret))
    ok = lr > 0
    steps = jnp.floor(_div(jnp.full(lr.shape, log2_range, jnp.float32), jnp.where(ok, lr, 1.0),
                           interpret) * float(expand_min))
    steps = jnp.where(ok, steps, float(expand_min))
    steps = jnp.minimum(jnp.maximum(steps, 1.0), float(max_code))
    k = (steps * float(np.float32(1.0) / np.float32(expand_min)))[:, None]
    log2_ratio = fm.log2(a) - jnp.log2(mx)[:, None]
    mag = fmax * fm.exp2(k * log2_ratio)
    y = jnp.sign(x) * mag
  else:
    steps = jnp.full(mx.shape, float(min(expand_min, max_code)), jnp.float32)
    scale = mx * float(np.float32(1.0) / np.float32(fmax))
    y = _div(x, jnp.broadcast_to(scale[:, None], x.shape), interpret)
  y = jnp.where(y != y, y, jnp.minimum(jnp.maximum(y, -fmax), fmax))
  return y, mx, steps


def _kernel(*refs, has_param, output, m_fmax, v_fmax, m_log2r, v_log2r, expand, expand_min,
            floor, max_code, grad_clamp, interpret, fast_math):
  """refs: scalars, [param], grad, m (q, amax, code), v (q, amax, code); then the outputs:
  new param or update, m (q, amax, code), v (q, amax, code)."""
  s_ref, *refs = refs
  p_ref = refs.pop(0) if has_param else None
  (g_ref, mq_ref, ma_ref, mk_ref, vq_ref, va_ref, vk_ref,
   o_ref, mqo_ref, mao_ref, mko_ref, vqo_ref, vao_ref, vko_ref) = refs
  # (1, 16) float32 step scalars, 9 used.
  lr, b1, omb1, b2, omb2, eps, wd, inv_sqrt_bc2, bc1 = [s_ref[0, i] for i in range(9)]
  fm = _Math(fast_math, interpret)
  m = _load(mq_ref, ma_ref, mk_ref, m_fmax, expand_min, interpret, fm)
  v = _load(vq_ref, va_ref, vk_ref, v_fmax, expand_min, interpret, fm)
  g = g_ref[...].astype(jnp.float32)
  # g * g overflows float32 for |g| > ~1.8e19: finite g is clamped to +-2^63 (NaN/inf pass).
  g = jnp.where(jnp.abs(g) < jnp.inf, _saturate(g, grad_clamp), g)
  m = b1 * m + omb1 * g
  v = b2 * v + omb2 * (g * g)
  denom = (fm.sqrt(v) * inv_sqrt_bc2 + eps) * bc1
  direction = fm.div(m, denom)
  if p_ref is not None:
    p = p_ref[...].astype(jnp.float32)
    direction = direction + wd * p
  out = p - lr * direction if output == "param" else -(lr * direction)
  o_ref[...] = out.astype(o_ref.dtype)
  for x, fmax, log2r, q_ref, a_ref, k_ref in ((m, m_fmax, m_log2r, mqo_ref, mao_ref, mko_ref),
                                              (v, v_fmax, v_log2r, vqo_ref, vao_ref, vko_ref)):
    y, mx, steps = _store(x, fmax, log2r, expand, expand_min, floor, max_code, interpret, fm)
    if jnp.issubdtype(q_ref.dtype, jnp.integer):
      y = jnp.round(y)
    q_ref[...] = y.astype(q_ref.dtype)
    a_ref[...] = mx
    k_ref[...] = steps.astype(jnp.uint8)


def _step_scalars(lr, b1, b2, eps, weight_decay, count):
  """The step's scalars, computed as `coat_jax.adam_math.adam_moments` does (plus
  1 / sqrt(bc2)): float32 (1, 16), 9 used (Triton blocks need power-of-two sizes)."""
  t = jnp.asarray(count).astype(jnp.float32)
  bc1 = 1.0 - jnp.power(jnp.asarray(b1, jnp.float32), t)
  bc2 = 1.0 - jnp.power(jnp.asarray(b2, jnp.float32), t)
  vals = [lr, b1, 1.0 - b1, b2, 1.0 - b2, eps, weight_decay, 1.0 / jnp.sqrt(bc2), bc1]
  vals += [0.0] * (16 - len(vals))
  return jnp.stack([jnp.asarray(x, jnp.float32) for x in vals]).reshape(1, 16)


@functools.partial(jax.jit, static_argnames=("group_size", "expand", "expand_min", "m_log2_range",
                                             "v_log2_range", "floor", "max_code", "grad_clamp",
                                             "output",
                                             "interpret", "block", "num_warps", "fast_math",
                                             "alias"))
def adam_step(param, grad, m, v, *, lr, b1, b2, eps, weight_decay, count, group_size, expand,
              expand_min, m_log2_range, v_log2_range, floor, max_code, grad_clamp,
              output: str = "param",
              interpret: bool = False, block: int = 16, num_warps: int = 4,
              fast_math: bool = False, alias: bool = False):
  """Kernel form of `coat_jax.adam_math.adam_step_reference` on plain arrays.

  Args:
    param: float (..., N), N % group_size == 0; None only with output="update" (no decay term).
    grad: float, param's shape.
    m, v: (data, amax, k_code) each: data of param's shape in the storage dtype (float8_e4m3fn,
      float8_e5m2 or int8; fmax = its largest value), amax float32 and k_code uint8 (..., N/G).
    lr, b1, b2, eps, weight_decay: float scalars (may be traced); count: int32 step t >= 1.
    m_log2_range, v_log2_range: log2 of each format's expansion range R (static floats).
    floor: added to max and min of each group (1e-30); max_code: largest k_code (255).
    grad_clamp: finite gradients are clamped to +-grad_clamp (2^63, so that g^2 stays finite).
    output: "param" -> new param (param.dtype); "update" -> u = -lr * (m/denom + wd*p) in
      grad.dtype (the optax update).
    block: groups (rows of G) per program.
    fast_math: single-instruction approximate lg2/ex2/sqrt/rcp on the GPU (see `_Math`).
    alias: write the new param (output="param") and moments into the buffers of the old ones.
      Pays off when the caller donates them (a jitted step with donated params and state);
      otherwise XLA copies the inputs first.
  Returns:
    (new_param or update, (m data, amax, k_code), (v data, amax, k_code)).
  """
  if output not in OUTPUTS:
    raise ValueError(f"coat adam_step kernel: output must be one of {OUTPUTS}, got {output!r}")
  if param is None and output == "param":
    raise ValueError("coat adam_step kernel: output='param' needs param")
  like = grad if param is None else param
  m, v = tuple(m), tuple(v)
  if not supported(like, group_size):
    raise ValueError(f"coat adam_step kernel: param shape {like.shape} unsupported "
                     f"(need a float array, ndim >= 1, last axis divisible by {group_size})")
  if grad.shape != like.shape or m[0].shape != like.shape or v[0].shape != like.shape:
    raise ValueError(f"coat adam_step kernel: grad {grad.shape}, m {m[0].shape}, "
                     f"v {v[0].shape} must match param {like.shape}")
  m_fmax, v_fmax = storage_max(m[0].dtype), storage_max(v[0].dtype)
  rows = like.size // group_size
  # Whole blocks only: on the H100 the Triton backend's masked stores of partial blocks wrote out
  # of bounds (a neighbouring buffer was overwritten), so no partial blocks are ever used.
  r = _pow2_divisor(rows, block)
  scalars = _step_scalars(lr, b1, b2, eps, weight_decay, count)
  big = pl.BlockSpec((r, group_size), lambda i: (i, 0))
  small = pl.BlockSpec((r,), lambda i: (i,))
  kernel = functools.partial(
      _kernel, has_param=param is not None, output=output, m_fmax=m_fmax, v_fmax=v_fmax,
      m_log2r=float(np.float32(m_log2_range)), v_log2r=float(np.float32(v_log2_range)),
      expand=expand, expand_min=expand_min, floor=float(np.float32(floor)), max_code=max_code,
      grad_clamp=float(grad_clamp),
      interpret=interpret, fast_math=fast_math)
  flat = lambda a: a.reshape(rows, group_size)
  meta = lambda a: a.reshape(rows)
  p_in = [] if param is None else [flat(param)]
  out_dtype = grad.dtype if output == "update" else param.dtype
  aliases = {}
  if alias:
    # The grad is never aliased to the update: XLA then copied every donated grad first
    # (+3.5 ms per 1.21e9 params on the H100, bench_optimizer --profile).
    first = 1 + len(p_in)   # index of grad among the call's operands (0 is the scalars)
    if output == "param":
      aliases[1] = 0        # param -> new param
    aliases.update({first + 1 + i: 1 + i for i in range(6)})   # m, v fields -> new m, v
  outs = pl.pallas_call(
      kernel, grid=(pl.cdiv(rows, r),),
      in_specs=[pl.BlockSpec((1, 16), lambda i: (0, 0))] + [big] * len(p_in)
               + [big, big, small, small, big, small, small],
      out_specs=[big, big, small, small, big, small, small],
      out_shape=[jax.ShapeDtypeStruct((rows, group_size), out_dtype),
                 jax.ShapeDtypeStruct((rows, group_size), m[0].dtype),
                 jax.ShapeDtypeStruct((rows,), jnp.float32),
                 jax.ShapeDtypeStruct((rows,), jnp.uint8),
                 jax.ShapeDtypeStruct((rows, group_size), v[0].dtype),
                 jax.ShapeDtypeStruct((rows,), jnp.float32),
                 jax.ShapeDtypeStruct((rows,), jnp.uint8)],
      input_output_aliases=aliases,
      interpret=interpret, compiler_params=pltriton.CompilerParams(num_warps=num_warps,
                                                                   num_stages=1),
      name="coat_adam_step")(
          scalars, *p_in, flat(grad), flat(m[0]), meta(m[1]), meta(m[2]),
          flat(v[0]), meta(v[1]), meta(v[2]))
  out, mq, ma, mk, vq, va, vk = outs
  meta_shape = m[1].shape
  new_m = (mq.reshape(like.shape), ma.reshape(meta_shape), mk.reshape(meta_shape))
  new_v = (vq.reshape(like.shape), va.reshape(meta_shape), vk.reshape(meta_shape))
  return out.reshape(like.shape), new_m, new_v
