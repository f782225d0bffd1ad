"""Ablation switches of the FP8 linears (coat_jax/ops/linear_layer.py, swiglu.py): other ways
to make the same values, for the benchmarks and tests that time or check them against the
library's choice.

Not configuration: no run config or environment variable reaches them. Under no `ablation`
context every switch has its first choice (`CHOICES`), the library's.
"""
from __future__ import annotations

import jax

from coat_jax import kernels

# Each switch's choices, the first the library's (what always runs outside the benchmarks and
# tests that compare them; `ablation` documents each).
CHOICES = {"weight_quant": ("per_use", "once"), "amax": ("fused", "kernel"),
           "weight_quantize": ("forward_kernel", "kernel", "xla"),
           "activation_quantize": ("kernel", "xla"), "gradient_quantize": ("kernel", "xla"),
           "swiglu_quantize": ("gemm_epilogue", "fused", "separate"),
           "weight_transpose": ("codes", "cast"), "remake_quantize": kernels.REMAKE_HOWS}
# The switches set away from the first choice, ((name, value), ...): a JAX user context, part of
# jit's cache key (a trace made under other switches is never reused).
_SWITCHES = jax.make_user_context(default_value=())


def option(name: str) -> str:
  """The value of a linear ablation switch in effect now (read at trace time; `ablation`)."""
  return dict(_SWITCHES.value).get(name, CHOICES[name][0])


def ablation(**switches: str):
  """Context manager: the FP8 linears' ablation switches (`CHOICES`) for the calls and traces
  inside, for the benchmarks and tests that compare them (benchmarks/layer/bench_layer.py). The
  first choice of each is the library's; where two were timed against each other on the H100
  (OLMo-1B's step, the Llama-2-7B layer), it was the faster one, at the same memory peak or lower.

  weight_quant: "per_use" (default) quantizes W in the forward (as W^T, (N, K)) and again in the
  backward ((K, N)); "once" makes both layouts in the forward's one quantize+transpose pass and
  keeps the (K, N) copy for the backward (1 byte per weight, named FP8_RESIDUALS): one amax and
  one quantize pass per step instead of two of each. Under "once", on one device, the kernel
  reads the parameter as it lies and rounds it to the compute dtype as it loads it (a float32 W:
  4 bytes read and 2 written per weight, no bfloat16 cast written and read again; on a mesh the
  cast is made first); its amax is max|W| rounded to the compute dtype (the same value: rounding
  is monotonic). Same values either way (one scale).
  amax: "fused" (default) computes the per-tensor amax of each activation or gradient (x, and dY
  in the backward) as an XLA reduction handed to the quantize, which XLA can fuse into the op
  producing the tensor (RMSNorm, SwiGLU, their backward); "kernel" lets each quantize find it in
  its own stage-1 pass (a Mosaic GPU tile-maxima kernel per tensor shape, each compiled with the
  step). Same values either way; "fused" compiles 2 Mosaic GPU modules fewer in OLMo-1B's step.
  weight_quantize: "forward_kernel" (default): the forward's per-tensor quantize of W by the
  dispatch's kernel (the Mosaic GPU kernel on Hopper, one module per weight shape; with
  weight_transpose="codes" it writes W^T's codes in the same pass), the backward's (W as it lies,
  no transpose) by XLA's ops fused with W's cast, with the forward's amax: for a float32 W one
  pass reading 4 bytes and writing 1 per weight, where a kernel would read the bf16 cast XLA
  writes first. "kernel": both by the kernel. "xla": both by XLA's ops (q = sat(W / s), an
  elementwise map given s), fused with the cast and any transpose. Same values either way (XLA
  and Mosaic GPU both divide with div.full.f32).
  activation_quantize: the per-tensor E4M3 quantize (+ transposed copy) of each linear's input x
  (RMSNorm's y, SwiGLU's h, the attention output) by the dispatch's kernel ("kernel", default)
  or as XLA ops ("xla"), which XLA can fuse into the op producing x, so that a bf16 x read only
  by the quantize is never written. gradient_quantize: the same for the E5M2 quantize of each
  linear's dY in the backward. Same values either way.
  swiglu_quantize: "gemm_epilogue" (default): `ops.swiglu_linears` makes gate and up with one
  FP8 GEMM whose epilogue writes SwiGLU's h, its maxima and gate's and up's 1 x 16 codes
  (`kernels.gemm_swiglu_quantize`; gate and up are never written in bf16; their codes are
  quantized from the float32 products, so they may differ from the others' by one code step,
  no less accurate); the gate/up weights' transposed codes come from the quantize kernel
  (`ops.swiglu.weight_codes_t`; weight_quant="per_use" always for these two). "fused" makes h,
  its amax and the codes from one read of gate and up written by two GEMMs
  (`kernels.swiglu_quantize`; one kernel on Hopper); "separate": h and its amax by XLA, then a
  per-group quantize of each of gate and up (two more reads); these two give the same values.
  weight_transpose: how the forward gets W^T (N, K) for the TN GEMM under weight_quant=
  "per_use". "codes" (default) quantizes W as it lies and transposes its FP8 codes (the kernel's
  transposed copy under weight_quantize="kernel", XLA's swapaxes of the codes under "xla");
  "cast" quantizes the transposed cast weight. Same values either way. Inside the scan over
  layers "cast" makes XLA relayout every stacked weight once per step (f32 (L, K, N) ->
  (N, L, K), 4.3 GB for OLMo-1B); "codes" with the kernel reads the parameter as it lies: no
  relayout (0 instead of 21 in OLMo-1B's step), at one more kernel module per weight shape to
  compile.
  remake_quantize (linear_residuals "remade" only): how the backward remakes a linear's
  transposed input codes (`kernels.remade_codes_t`): one Triton kernel reading the producer's
  1 x 16 codes and writing the transposed per-tensor codes ("fused", default; on GPUs with
  jax-triton, per shard on a mesh, else as "kernel"; remade then costs 1-2 % of a
  Llama-2-7B layer back to back against kept residuals on an H100), an XLA fusion writing x in
  the compute dtype, then the dispatch's quantize kernel making the transposed copy ("kernel";
  about 3 %), or one XLA fusion from the codes to the transposed codes ("xla": XLA's
  transposing fusions write FP8 codes at 0.4-1.4 TB/s; slower than "kernel"). Same values up to
  the float32 math's last bits.
  Switches not named keep their values. Read while a function is traced: trace (jit) it inside
  the `with`; the switches are part of jit's cache key.
  """
  for name, value in switches.items():
    if name not in CHOICES:
      raise ValueError(f"linear ablation: unknown switch {name!r}; switches: "
                       f"{sorted(CHOICES)}")
    if value not in CHOICES[name]:
      raise ValueError(f"linear ablation: {name} must be one of {CHOICES[name]}, "
                       f"got {value!r}")
  new = {**dict(_SWITCHES.value), **switches}
  return _SWITCHES(tuple(sorted((k, v) for k, v in new.items() if v != CHOICES[k][0])))
