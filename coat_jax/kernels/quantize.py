"""The quantize family's dispatch: per-tensor and per-group FP8 quantize, SwiGLU's h with gate's
and up's per-group quantize in one pass, and the per-group dequantize, each on a Mosaic GPU
kernel (pallas_kernels.quantize) or its jnp reference (coat_jax.quantize), with the reference's
signature and semantics.

Kernels (`implementation("quantize")` / `("dequantize")` is "mosaic"; FP8 storage only):
  per group    G a multiple of 16 up to 256, N % G == 0 and size / G a multiple of 64
               (quantize_mgpu.py); the dequantize takes the same shapes.
  per tensor   size / 64 a multiple of 64 and N % 64 == 0; with the transposed copy ndim >= 2,
               N and M multiples of 64 and a 16-bit input (or a 16-bit cast_dtype).
  swiglu       the per-group shapes (swiglu_mgpu.py), forward and backward.
  remake       a linear's transposed input codes remade from 1 x 16 codes (Triton through
               jax-triton, remake_triton.py): M % 64 and K % 64 == 0, bf16 compute.
Other shapes: the reference (XLA). On a mesh each shard runs the kernel on its local block
(`backends.rows`; a shard the kernel does not take runs the reference); in interpret mode (CPU)
the kernels are not wrapped (their ordered callbacks cannot pass custom_partitioning: XLA
partitions the interpreted ops like any others).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from coat_jax import activations, formats, quantize
from coat_jax.kernels import backends, sharded
from coat_jax.quantize import QuantizedArray

# The Mosaic GPU row kernels (quantize, tile maxima, dequantize) in interpret mode (CPU tests)
# take the largest blocks (rows_mgpu: 1024 rows) and at most 2 CTAs, as the GEMM's interpret
# default: the interpreter simulates every CTA and block step with host callbacks, so the GPU's
# tuning (128-row blocks, up to 528 CTAs) made a CPU call of a (128, 256) per-group quantize
# many times slower. The per-tensor quantize takes 128-row blocks there (its transposing blocks
# are sized for shared memory; its GPU default, 64 rows, doubled an interpreted call's time).
# The kernels' own tests cover their other settings.
INTERPRET_ROW_KERNEL = dict(block=1024, max_ctas=2)
INTERPRET_PER_TENSOR = dict(block_rows=128, max_ctas=2)


def _row_kernel_kw(per_tensor: bool = False) -> dict:
  """interpret, and in interpret mode INTERPRET_ROW_KERNEL (per_tensor: INTERPRET_PER_TENSOR),
  for the Mosaic GPU row kernels."""
  if not backends.interpret_mode():
    return dict(interpret=False)
  return dict(interpret=True, **(INTERPRET_PER_TENSOR if per_tensor else INTERPRET_ROW_KERNEL))


def _mosaic(kernel, args, kinds_in, kinds_out, group_size):
  """A Mosaic GPU kernel per shard (`backends.rows`); in interpret mode unwrapped (its ordered
  callbacks cannot pass custom_partitioning: XLA partitions the interpreted ops like any others)."""
  if backends.interpret_mode():
    return tuple(kernel(*args))
  return backends.rows(kernel, args, kinds_in, kinds_out, group_size)


def quantize_per_tensor(x, fmt="e4m3", *, amax=None, with_transpose=False,
                        floor=formats.ACTIVATION_SCALE_FLOOR, producer_fusion: bool = False,
                        cast_dtype=None) -> QuantizedArray:
  """See `coat_jax.quantize.quantize_per_tensor`.

  Kernel (mosaic, the shapes in the module docstring): stage-1 tile maxima, stage 2 and the scale
  here (`quantize.scale_from_amax`), then the quantize(+transpose) pass; else the reference.
  producer_fusion: always the reference (XLA's ops), which XLA fuses into the op producing x
  (a weight's cast and transpose: one pass, no kernel module to compile).
  cast_dtype: quantize x.astype(cast_dtype); amax max|x| or max|x.astype(cast_dtype)|, rounded to
  cast_dtype here (the same value: rounding is monotonic). On one device the kernel rounds x as
  it reads it (a float32 weight's bfloat16 cast is never written); elsewhere the cast is made
  first (an extension of the reference's semantics, which has no cast_dtype).
  """
  f = formats.get_format(fmt)
  if cast_dtype is not None and jnp.dtype(cast_dtype) == x.dtype:
    cast_dtype = None
  if cast_dtype is not None and amax is not None:
    amax = jnp.asarray(amax).astype(cast_dtype)
  if (not producer_fusion and backends.implementation("quantize") == "mosaic"
      and f.dtype in formats.fp8_dtypes()):
    from pallas_kernels.quantize import quantize_mgpu as qm  # local: no Pallas import
    # where only the references run
    fused_cast = (cast_dtype is not None and qm.supported_per_tensor(x.shape, x.dtype,
                                                                     with_transpose, cast_dtype)
                  and (not backends.per_shard() or backends.interpret_mode()))
    if cast_dtype is not None and not fused_cast:
      x, cast_dtype = x.astype(cast_dtype), None
    if qm.supported_per_tensor(x.shape, x.dtype, with_transpose, cast_dtype):
      tile, kw = qm.STAGE1_TILE, dict(out_dtype=f.dtype, fmax=f.max,
                                      **_row_kernel_kw(per_tensor=True))

      def stage1(a):   # per shard; a shard the kernel does not take: the reference's maxima
        if qm.supported_per_group(a.shape, a.dtype, tile):
          return (backends.launch(qm.tile_amax, a, **_row_kernel_kw()),)
        return (quantize.group_amax(a, tile),)

      if amax is None:   # stage 1 per shard; stage 2 (jnp.max, global, propagates NaN) by XLA
        (tiles,) = _mosaic(stage1, [x], ["data"], ["meta"], tile)
        amax = jnp.max(tiles) if cast_dtype is None else jnp.max(tiles).astype(cast_dtype)
      amax = jnp.asarray(amax, jnp.float32)
      scale = quantize.scale_from_amax(amax, f, floor)
      if not backends.per_shard() or backends.interpret_mode():
        data, _, data_t = backends.launch(qm.quantize_per_tensor, x, scale=scale, floor=floor,
                                          with_transpose=with_transpose, cast_dtype=cast_dtype,
                                          **kw)
      else:   # per shard (a shard the kernel does not take: the reference on that shard)
        def quant(a, am, s):
          if qm.supported_per_tensor(a.shape, a.dtype, False):
            return (qm.quantize_per_tensor(a, scale=s, floor=floor, **kw)[0],)
          return (quantize.quantize_per_tensor(a, f, amax=am, floor=floor).data,)

        def quant_t(a, am, s):   # each shard's codes and their local transpose (its block of
          if qm.supported_per_tensor(a.shape, a.dtype, True):   # data_t), fused when it can
            q, _, q_t = qm.quantize_per_tensor(a, scale=s, floor=floor, with_transpose=True, **kw)
            return q, q_t
          (q,) = quant(a, am, s)
          return q, jnp.swapaxes(q, -1, -2)

        if with_transpose:
          data, data_t = sharded.transposing(quant_t, x, [amax, scale])
        else:
          (data,) = backends.rows(quant, [x, amax, scale], ["data", "scalar", "scalar"],
                                  ["data"], tile)
          data_t = None
      return QuantizedArray(data, scale, f.name, 0, data_t)
  if cast_dtype is not None:
    x = x.astype(cast_dtype)
  return quantize.quantize_per_tensor(x, f, amax=amax, with_transpose=with_transpose, floor=floor)


def quantize_per_group(x, group_size=formats.ACTIVATION_GROUP_SIZE, fmt="e4m3", *,
                       floor=formats.ACTIVATION_SCALE_FLOOR) -> QuantizedArray:
  """See `coat_jax.quantize.quantize_per_group` (mosaic on the shapes in the module docstring)."""
  f = formats.get_format(fmt)
  if backends.implementation("quantize") == "mosaic" and f.dtype in formats.fp8_dtypes():
    from pallas_kernels.quantize import quantize_mgpu as qm
    if qm.supported_per_group(x.shape, x.dtype, group_size):
      def kernel(a):   # per shard; a shard the kernel does not take: the reference
        if qm.supported_per_group(a.shape, a.dtype, group_size):
          return backends.launch(qm.quantize_per_group, a, group_size=group_size,
                                 out_dtype=f.dtype, fmax=f.max, floor=floor,
                                 scale_dtype=formats.ACTIVATION_SCALE_DTYPE, **_row_kernel_kw())
        ref = quantize.quantize_per_group(a, group_size, f, floor=floor)
        return ref.data, ref.scale

      data, scale = _mosaic(kernel, [x], ["data"], ["data", "meta"], group_size)
      return QuantizedArray(data, scale, f.name, group_size)
  return quantize.quantize_per_group(x, group_size, f, floor=floor)


def swiglu_quantize(gate, up, group_size=formats.ACTIVATION_GROUP_SIZE, fmt="e4m3", *,
                    floor=formats.ACTIVATION_SCALE_FLOOR):
  """(h, amax, gate_q, up_q): h = silu(gate) * up (`activations.silu_product`), amax = max|h|
  (float32 ()), and gate's and up's per-group quantize (`quantize_per_group`).

  Kernel (the "quantize" family's mosaic: pallas_kernels/quantize/swiglu_mgpu.py, shapes as the
  per-group quantize's): one read of gate and up makes all of it, amax from the kernel's
  per-group maxima; else the references (XLA fuses h with its amax; each quantize reads its input
  again).
  """
  f = formats.get_format(fmt)
  if (backends.implementation("quantize") == "mosaic" and f.dtype in formats.fp8_dtypes()
      and gate.shape == up.shape and gate.dtype == up.dtype):
    from pallas_kernels.quantize import swiglu_mgpu as sm
    if sm.supported(gate.shape, gate.dtype, group_size):
      def kernel(g, u):   # per shard; a shard the kernel does not take: the references
        if sm.supported(g.shape, g.dtype, group_size):
          return backends.launch(sm.swiglu_quantize, g, u, group_size=group_size,
                                 out_dtype=f.dtype, fmax=f.max, floor=floor,
                                 scale_dtype=formats.ACTIVATION_SCALE_DTYPE, **_row_kernel_kw())
        h = activations.silu_product(g, u)
        gq, uq = (quantize.quantize_per_group(a, group_size, f, floor=floor) for a in (g, u))
        return (h, quantize.group_amax(h, group_size), gq.data, gq.scale, uq.data, uq.scale)

      h, hmax, gd, gs, ud, us = _mosaic(kernel, [gate, up], ["data", "data"],
                                        ["data", "meta", "data", "meta", "data", "meta"],
                                        group_size)
      return (h, jnp.max(hmax), QuantizedArray(gd, gs, f.name, group_size),
              QuantizedArray(ud, us, f.name, group_size))
  h = activations.silu_product(gate, up)
  return (h, jnp.max(jnp.abs(h)).astype(jnp.float32),
          quantize.quantize_per_group(gate, group_size, f, floor=floor),
          quantize.quantize_per_group(up, group_size, f, floor=floor))


REMAKE_KINDS = ("rmsnorm", "swiglu")
REMAKE_HOWS = ("fused", "kernel", "xla")   # the first is the default


def remade_codes_t(kind: str, arrays: tuple, amax, dtype, fmt="e4m3", *,
                   floor=formats.ACTIVATION_SCALE_FLOOR, how: str = "fused") -> jax.Array:
  """x^T's per-tensor codes (K, M) for a linear's dW, x (..., K) remade from 1 x G codes:

    kind "rmsnorm", arrays (xg, rstd, w):  x = dequantize(xg) * rstd * w     (RMSNorm's output)
    kind "swiglu",  arrays (gq, uq):       x = silu(dequantize(gq)) * dequantize(uq)   (SwiGLU's h)

  in float32, rounded to `dtype` (the value the forward quantized), then quantized per tensor
  with `amax` (the forward's, so the forward's scale) and transposed.
  how: "fused" (default; one pass: pallas_kernels/quantize/remake_triton.py, on a GPU with
  jax-triton and the quantize family's kernels, for the shapes it takes, per shard on a mesh;
  else as "kernel"); "kernel" (an XLA fusion writes x, then `quantize_per_tensor`'s kernel makes
  the codes and their transposed copy); "xla" (one XLA fusion from the codes to the transposed
  codes). Same values up to the float32 math's last bits (exp, division) moving a code by one
  step.
  """
  if kind not in REMAKE_KINDS:
    raise ValueError(f"remade_codes_t: kind must be one of {REMAKE_KINDS}, got {kind!r}")
  if how not in REMAKE_HOWS:
    raise ValueError(f"remade_codes_t: how must be one of {REMAKE_HOWS}, got {how!r}")
  f = formats.get_format(fmt)
  # the 1 x G codes, and what else the math takes (rstd and the norm's scale)
  codes, extra = (arrays[:1], arrays[1:]) if kind == "rmsnorm" else (arrays, ())
  if (how == "fused" and backends.implementation("quantize") == "mosaic"
      and not backends.interpret_mode()
      and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) and f.dtype in formats.fp8_dtypes()
      and all(q.group_size > 0 and q.group_size == codes[0].group_size
              and q.data.shape == codes[0].data.shape for q in codes)):
    from pallas_kernels.quantize import remake_triton as rt
    g = codes[0].group_size
    if rt.available() and rt.problem(codes[0].data.shape, g) is None:
      return _remade_by_kernel(rt, kind, codes, extra, amax, dtype, f, floor)
  values = [dequantize(q, jnp.float32, consumer_fusion=True) for q in codes]
  if kind == "rmsnorm":
    rstd, w = extra
    x = values[0] * rstd * w.astype(jnp.float32)
  else:
    x = activations.silu_product(*values)
  x = x.astype(dtype)
  return quantize_per_tensor(x.reshape(-1, x.shape[-1]), fmt, amax=amax, with_transpose=True,
                             floor=floor, producer_fusion=how == "xla").data_t


def _remade_by_kernel(rt, kind, codes, extra, amax, dtype, f, floor):
  """The remake kernel on one device; on a mesh per shard (`sharded.rows_to_columns`: the rows
  split as the codes' leading axes are, x^T's columns the same), a shard the kernel does not take
  remade as "xla" does, with the same (global) amax."""
  g, shape = codes[0].group_size, codes[0].data.shape
  k = shape[-1]
  m = codes[0].data.size // k
  amax = jnp.asarray(amax, jnp.float32).reshape(1)
  ops = [a for q in codes for a in (q.data.reshape(m, k), q.scale.reshape(m, k // g))]
  by_row = [True] * len(ops)   # which operands split by rows (the others whole)
  if kind == "rmsnorm":
    rstd, w = extra
    ops += [jnp.asarray(rstd, jnp.float32).reshape(m), w.reshape(k)]
    by_row += [True, False]

  def kernel(amax1, *local):
    scale = quantize.scale_from_amax(amax1[0], f, floor)
    qs = [QuantizedArray(local[2 * i], local[2 * i + 1], f.name, g) for i in range(len(codes))]
    rest = local[2 * len(codes):]
    if rt.problem(local[0].shape, g) is None:
      return rt.remake_transposed(kind, scale, tuple(q.data for q in qs),
                                  tuple(q.scale for q in qs), tuple(rest), group_size=g,
                                  out_dtype=f.dtype, fmax=f.max)
    if kind == "rmsnorm":   # rstd back to (rows, 1)
      rest = (rest[0][:, None], rest[1])
    return remade_codes_t(kind, (*qs, *rest), amax1[0], dtype, f.name, floor=floor, how="xla")

  if backends.per_shard():
    return sharded.rows_to_columns(kernel, [amax, *ops], [False, *by_row])
  return kernel(amax, *ops)


def swiglu_backward(gate_q: QuantizedArray, up_q: QuantizedArray, dh):
  """(d_gate, d_up, amax_gate, amax_up): `activations.silu_product_grads` of gate and up
  dequantized (float32) and dh, in dh's dtype, and max|d_gate|, max|d_up| (float32 ()).

  Kernel (the "quantize" family's mosaic: pallas_kernels/quantize/swiglu_mgpu.py, per-group FP8
  codes of dh's shape, the per-group shapes): one read of dh and the codes makes all of it, each
  amax from the kernel's per-group maxima; else the reference (XLA fuses the math with both
  maxima).
  """
  g = gate_q.group_size
  if (backends.implementation("quantize") == "mosaic" and g > 0 and up_q.group_size == g
      and gate_q.data.shape == up_q.data.shape == dh.shape
      and jnp.dtype(gate_q.data.dtype) in formats.fp8_dtypes()
      and jnp.dtype(up_q.data.dtype) in formats.fp8_dtypes()):
    from pallas_kernels.quantize import swiglu_mgpu as sm
    if sm.supported(dh.shape, dh.dtype, g):
      def kernel(d, gd, gs, ud, us):   # per shard; a shard the kernel does not take: the reference
        if sm.supported(d.shape, d.dtype, g):
          return backends.launch(sm.swiglu_backward, d, gd, gs, ud, us, group_size=g,
                                 **_row_kernel_kw())
        dg, du = _swiglu_backward_reference(QuantizedArray(gd, gs, gate_q.fmt, g),
                                            QuantizedArray(ud, us, up_q.fmt, g), d)
        return dg, du, quantize.group_amax(dg, g).astype(d.dtype), quantize.group_amax(
            du, g).astype(d.dtype)

      dg, du, gmax, umax = _mosaic(kernel, [dh, gate_q.data, gate_q.scale, up_q.data, up_q.scale],
                                   ["data", "data", "meta", "data", "meta"],
                                   ["data", "data", "meta", "meta"], g)
      return dg, du, jnp.max(gmax).astype(jnp.float32), jnp.max(umax).astype(jnp.float32)
  dg, du = _swiglu_backward_reference(gate_q, up_q, dh)
  return (dg, du, jnp.max(jnp.abs(dg)).astype(jnp.float32),
          jnp.max(jnp.abs(du)).astype(jnp.float32))


def _swiglu_backward_reference(gate_q, up_q, dh):
  return activations.silu_product_grads(quantize.dequantize(gate_q, jnp.float32),
                                        quantize.dequantize(up_q, jnp.float32), dh)


def dequantize(q: QuantizedArray, dtype, *, consumer_fusion: bool = False):
  """See `coat_jax.quantize.dequantize` (mosaic for per-group FP8 arrays of the per-group
  quantize's shapes; per-tensor is XLA's). consumer_fusion: XLA's ops always, which XLA fuses
  into the op that reads the values (no array of them written), for a consumer that is itself
  an XLA fusion."""
  out_dtype = jnp.dtype(dtype)
  if (not consumer_fusion and q.group_size > 0
      and backends.implementation("dequantize") == "mosaic"
      and jnp.issubdtype(out_dtype, jnp.floating)):
    from pallas_kernels.quantize import quantize_mgpu as qm
    if qm.supported_per_group(q.data.shape, q.data.dtype, q.group_size):
      g = q.group_size

      def kernel(d, sc):
        if qm.supported_per_group(d.shape, d.dtype, g):
          return (backends.launch(qm.dequantize_per_group, d, sc, group_size=g, dtype=out_dtype,
                                  **_row_kernel_kw()),)
        return (quantize.dequantize(QuantizedArray(d, sc, q.fmt, g), out_dtype),)

      (out,) = _mosaic(kernel, [q.data, q.scale], ["data", "meta"], ["data"], g)
      return out
  return quantize.dequantize(q, dtype)
