"""The one dispatch between the kernels in pallas_kernels/ and their jnp references.

A module per kernel family over one small backend module that imports no family:
  backends.py   which implementation a family runs (`KernelConfig`, `use`, `implementation`) and
                how a kernel call is launched (per shard, lowered ahead)
  sharded.py    kernels per shard inside a sharded jax.jit (custom_partitioning)
  quantize.py   FP8 quantize / dequantize (Mosaic GPU kernels), a linear input's transposed codes
                remade from 1 x 16 codes (a Triton kernel)
  gemm.py       the FP8 GEMM and the gate/up GEMM with SwiGLU in its epilogue (Mosaic GPU)
  adam.py       the fused optimizer step (the jax-triton kernel)
Every function here has the signature and semantics of its reference (coat_jax.quantize, gemm,
adam_math); a kernel module never falls back: the family module checks what its kernel takes and
calls the reference otherwise, and wraps kernel results in QuantizedArray / ExpandedMoment.
Which kernel takes which shapes: each family module's docstring; what each kernel does and
what was tried instead: docs/kernels.md.
"""
from coat_jax.kernels.backends import (AUTO_ON_HOPPER, CHOICES, ENV, FAMILIES, IMPLEMENTATIONS,
                                       INSTALL_HINT, PARTITIONINGS, KernelConfig, backend,
                                       current_backend, current_partitioning, implementation,
                                       interpret_mode, parse_backend, partitioning, per_shard,
                                       prestart_compiles, use, use_pallas)
from coat_jax.kernels.quantize import (REMAKE_HOWS, REMAKE_KINDS, dequantize,
                                       quantize_per_group, quantize_per_tensor, remade_codes_t,
                                       swiglu_backward, swiglu_quantize)
from coat_jax.kernels.gemm import GEMM_OUT_DTYPES, fp8_dot_general, gemm_swiglu_quantize
from coat_jax.kernels.adam import (adam_kernel_limits, coat_adam_packed_step, coat_adam_step,
                                   coat_adam_tree_step)

__all__ = ["AUTO_ON_HOPPER", "CHOICES", "ENV", "FAMILIES", "GEMM_OUT_DTYPES", "IMPLEMENTATIONS",
           "INSTALL_HINT", "PARTITIONINGS", "adam_kernel_limits", "backend",
           "coat_adam_packed_step", "coat_adam_step", "coat_adam_tree_step", "current_backend",
           "current_partitioning", "dequantize", "fp8_dot_general", "gemm_swiglu_quantize",
           "implementation", "interpret_mode", "KernelConfig", "parse_backend", "partitioning",
           "per_shard", "prestart_compiles", "quantize_per_group", "quantize_per_tensor",
           "REMAKE_HOWS", "REMAKE_KINDS", "remade_codes_t",
           "swiglu_backward", "swiglu_quantize", "use", "use_pallas"]
