"""The GEMM family's dispatch: the FP8 GEMM (`fp8_dot_general`) and the gate/up GEMM with SwiGLU
and the 1 x 16 quantize in its epilogue (`gemm_swiglu_quantize`), on Mosaic GPU kernels
(pallas_kernels.gemm) or the jnp references (coat_jax.gemm; quantize.swiglu_quantize), with the
references' signatures and semantics.

Kernels (`implementation("gemm")` is "mosaic"):
  fp8_dot_general       the wgmma TN kernel (fp8_matmul.py) where `tn_operands` maps the product
                        to the TN layout and the output is bf16 / float32; on a mesh it keeps M
                        and N sharded and all-gathers an FSDP weight's rows as FP8 codes; a
                        contracting axis split over other mesh axes stays split: float32 partial
                        products, summed (psum) (`sharded.matmul_tn`).
  gemm_swiglu_quantize  one device, bf16 out, M % 128, F % 64, K % 128 == 0
                        (fp8_gemm_swiglu.py).
"""
from __future__ import annotations

import jax.numpy as jnp

from coat_jax import formats, gemm
from coat_jax.kernels import backends, sharded
from coat_jax.kernels.quantize import swiglu_quantize
from coat_jax.quantize import QuantizedArray

GEMM_OUT_DTYPES = gemm.OUT_DTYPES   # what `fp8_dot_general` writes directly


def _gemm_kernel_kw() -> dict:
  """interpret and num_ctas for the Mosaic GPU GEMM kernels: interpret mode's parameters on the
  CPU, else None and this device's SM count (passed, so that a worker lowering the kernel
  without a GPU uses it too)."""
  from pallas_kernels.gemm import fp8_matmul as pk
  interp = pk.interpret_params(backends.interpret_mode())
  return dict(interpret=interp, num_ctas=None if interp is not None else pk.num_sms())


def fp8_dot_general(a: QuantizedArray, b: QuantizedArray, dimension_numbers, out_dtype):
  """See `coat_jax.gemm.fp8_dot_general_reference`.

  Pallas: the Mosaic GPU wgmma TN kernel (pallas_kernels/gemm/fp8_matmul.py) where `tn_operands`
  maps the product to the TN layout (directly or through `data_t`) and the output is bf16/f32;
  every other case uses the reference.
  """
  if not (a.per_tensor and b.per_tensor):
    raise ValueError("fp8_dot_general needs per-tensor quantized operands "
                     f"(got group sizes {a.group_size} and {b.group_size})")
  # Mosaic GPU's interpret mode uses ordered callbacks, which custom_partitioning cannot carry:
  # there (CPU tests) the kernel's interpreted ops are partitioned by XLA like any other ops.
  wrap = backends.per_shard() and not backends.interpret_mode()
  if backends.use_pallas("gemm"):
    from pallas_kernels.gemm import fp8_matmul as pk  # local: no Pallas import where only
    # the references run
    a2, b2, out_shape, _ = pk.tn_operands(a.data, a.data_t, b.data, b.data_t, dimension_numbers)
    if a2 is not None and jnp.dtype(out_dtype) in pk.OUT_DTYPES:
      a_scale, b_scale = a.scale.astype(jnp.float32), b.scale.astype(jnp.float32)
      kw = _gemm_kernel_kw()
      if not wrap:   # the kernel multiplies the two scales (no XLA op of its own for that)
        out = backends.launch(pk.fp8_matmul_tn, a2, b2, a_scale, out_dtype, b_scale=b_scale, **kw)
      else:
        kernel = lambda x, y, s: backends.launch(pk.fp8_matmul_tn, x, y, s, out_dtype, **kw)
        partial = lambda x, y, s: pk.fp8_matmul_tn(x, y, s, jnp.float32, interpret=kw["interpret"])
        out = sharded.matmul_tn(kernel, a2, b2, a_scale * b_scale, partial_kernel=partial)
      return out.reshape(out_shape)
  return gemm.fp8_dot_general_reference(a, b, dimension_numbers, out_dtype)


def gemm_swiglu_quantize(x: QuantizedArray, w_gate_t: QuantizedArray, w_up_t: QuantizedArray,
                         out_dtype, group_size=formats.ACTIVATION_GROUP_SIZE, fmt="e4m3", *,
                         floor=formats.ACTIVATION_SCALE_FLOOR):
  """`swiglu_quantize(gate, up, group_size, fmt)` of gate = x . W_g and up = x . W_u, each
  `fp8_dot_general(x, w_t, TN, out_dtype)`: (h, amax, gate_q, up_q).

  x: per-tensor FP8 (..., K); w_gate_t, w_up_t: per-tensor FP8 (F, K), the weights' transposed
  codes (the TN layout's right operand). Kernel (the "gemm" family's mosaic, on one device:
  pallas_kernels/gemm/fp8_gemm_swiglu.py, bf16 out, G = 16, the shapes its `problem` takes): one
  GEMM over the interleaved weight codes writes h, its 1 x 64 maxima and gate's and up's codes
  from the float32 accumulators; the codes then differ from the reference's, which quantizes
  gate and up rounded to out_dtype first, by at most one code step where that rounding moves a
  value across a rounding boundary. Else the reference: the two GEMMs, then `swiglu_quantize`.
  """
  f = formats.get_format(fmt)
  tn = (((x.data.ndim - 1,), (1,)), ((), ()))
  lead, k, n = x.data.shape[:-1], x.data.shape[-1], w_gate_t.data.shape[0]
  # One device (no per-shard wrapper yet); in interpret mode (CPU tests) XLA partitions the
  # interpreted ops like any others, as for fp8_dot_general.
  if backends.use_pallas("gemm") and (backends.interpret_mode() or not backends.per_shard()):
    from pallas_kernels.gemm import fp8_gemm_swiglu as pg
    m = x.data.size // k
    if (pg.problem(m, n, k, out_dtype) is None and group_size == pg.GROUP
        and f.dtype in formats.fp8_dtypes() and x.per_tensor
        and w_up_t.data.shape == (n, k) and w_gate_t.per_tensor and w_up_t.per_tensor):
      h, hmax, gd, gs, ud, us = backends.launch(
          pg.fp8_gemm_swiglu, x.data.reshape(m, k), pg.interleave_gate_up(w_gate_t.data,
                                                                          w_up_t.data),
          *(s.astype(jnp.float32) for s in (x.scale, w_gate_t.scale, w_up_t.scale)),
          code_dtype=f.dtype, fmax=f.max, floor=floor,
          scale_dtype=formats.ACTIVATION_SCALE_DTYPE, **_gemm_kernel_kw())
      meta = (*lead, n // group_size)
      return (h.reshape(*lead, n), jnp.max(hmax),
              QuantizedArray(gd.reshape(*lead, n), gs.reshape(meta), f.name, group_size),
              QuantizedArray(ud.reshape(*lead, n), us.reshape(meta), f.name, group_size))
  gate = fp8_dot_general(x, w_gate_t, tn, out_dtype)
  up = fp8_dot_general(x, w_up_t, tn, out_dtype)
  return swiglu_quantize(gate, up, group_size, fmt, floor=floor)
