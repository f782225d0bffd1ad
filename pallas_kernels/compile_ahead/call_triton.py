"""How this project's Triton kernels reach XLA: jax-triton's custom call, or the typed-FFI one.

jax-triton 0.3.1 lowers every `triton_call` to the legacy custom call `triton_kernel_call` (API
version 2), which XLA cannot record into a command buffer (CUDA graph): each call is its own host
launch, between the step's command buffers. JAX >= 0.10.1 also registers `triton_kernel_call_ffi`,
a typed-FFI handler for the same compressed TritonKernelCall proto (its `opaque` attribute) that
loads the kernel in its initialize stage and is marked command-buffer compatible
(jax-ml/jax#37094). With CUSTOM_CALL = "ffi", our calls pass `call_kwargs()` and the lowering rule
registered here runs jax-triton's lowering (which compiles the kernel and builds the proto), takes
the proto out of the legacy op it emitted, erases that op and emits the typed-FFI call with the
same operands, results and aliases (`legacy_to_ffi`). Every other jax-triton call in the process
keeps jax-triton's own lowering. `triton_call` is how our kernels call jax-triton: the target
above, and the kernel's compile started in a worker process as the call is traced
(pallas_kernels/compile_triton.py).

Imports jax, and jax-triton where installed (GPU machines).
"""
from __future__ import annotations

import functools
import os

import jax
from jax.interpreters import mlir
from jax._src.lib.mlir import ir

from pallas_kernels import compile_triton

try:  # GPU machines only
  from jax_triton import triton_lib
except ImportError:  # pragma: no cover - CPU machines
  triton_lib = None

FFI_TARGET = "triton_kernel_call_ffi"      # JAX's typed-FFI Triton handler
LEGACY_TARGET = "triton_kernel_call"       # jax-triton 0.3.1's custom call (API version 2)
MARK = "coat_jax:" + FFI_TARGET            # the target name our calls pass: "lower me as FFI"

# Read when a call is traced (benchmarks A/B them; jax.clear_caches() between settings), default
# from $COAT_JAX_TRITON_CALL: "legacy", jax-triton's own custom call; "ffi", the typed-FFI one
# (CUDA-graph capturable). Legacy is the default: on the H100 (62-leaf 1.21e9-param
# coat_adamw_apply, docs/benchmarks.md, seventh session) both take the same GPU kernel time
# (6.70 ms) but the blocked step is 8.73 / 9.06 ms with legacy calls and 9.37 / 9.84 ms with ffi
# (two runs); pipelined 7.08 / 6.94 vs 7.22 / 7.01. The ffi step returns to Python sooner (4.2 vs
# 5.9 ms): its kernels wait for the command buffer, where legacy launches start them one by one.
CUSTOM_CALLS = ("legacy", "ffi")
CUSTOM_CALL = os.environ.get("COAT_JAX_TRITON_CALL", "legacy")


def call_kwargs() -> dict:
  """Extra keyword arguments for `jax_triton.triton_call`: the custom call CUSTOM_CALL names."""
  if CUSTOM_CALL not in CUSTOM_CALLS:
    raise ValueError(f"call_triton.CUSTOM_CALL must be one of {CUSTOM_CALLS}, got {CUSTOM_CALL!r}")
  if CUSTOM_CALL == "ffi":   # JAX >= 0.10.1 registers the target (pinned: 0.11.2)
    return {"custom_call_target_name": MARK}
  return {}


def triton_call(*args, kernel, **kwargs):
  """`jax_triton.triton_call` with CUSTOM_CALL's target (`call_kwargs`), its kernel's compile
  started in a worker process as it is traced (`compile_triton.start`, MODE "process")."""
  if triton_lib is None:
    raise ValueError("call_triton.triton_call: jax-triton is not installed (GPU machines only)")
  kwargs = {**kwargs, **call_kwargs()}
  compile_triton.start(triton_lib.triton_call, kernel, args, kwargs)
  return triton_lib.triton_call(*args, kernel=kernel, **kwargs)


def legacy_to_ffi(ctx, results):
  """Replace the legacy Triton custom call that produced `results` by the typed-FFI call.

  `results`: what a lowering rule emitting one `stablehlo.custom_call` with a compressed
  TritonKernelCall proto as its string backend_config returned (jax-triton's). The new op takes
  the same operands and result types, keeps the operand/output aliases, and carries the proto as
  its `opaque` attribute. Returns the new op's results.
  """
  old = results[0].owner if len(results) else None
  if old is None or "backend_config" not in old.attributes:
    raise ValueError("call_triton: expected the results of one Triton custom call")
  proto = ir.StringAttr(old.attributes["backend_config"]).value_bytes
  aliases = (old.attributes["output_operand_aliases"]
             if "output_operand_aliases" in old.attributes else None)
  operands = list(old.operands)
  old.erase()
  new = jax.ffi.ffi_lowering(FFI_TARGET, api_version=4)(ctx, *operands, opaque=proto)
  if aliases is not None:
    new[0].owner.attributes["output_operand_aliases"] = aliases
  return new


def _lowering(original, ctx, *args, custom_call_target_name, **params):
  if custom_call_target_name != MARK:
    return original(ctx, *args, custom_call_target_name=custom_call_target_name, **params)
  results = original(ctx, *args, custom_call_target_name=LEGACY_TARGET, **params)
  return legacy_to_ffi(ctx, results)


def register():
  """Route jax-triton's CUDA lowering through `_lowering` and its compile through
  `compile_triton.get_or_create` (idempotent; GPU machines)."""
  if triton_lib is None or getattr(register, "done", False):
    return
  compile_triton.install()
  original = functools.partial(triton_lib.triton_kernel_call_lowering, triton_lib.get_cuda_backend)
  mlir.register_lowering(triton_lib.triton_kernel_call_p,
                         functools.partial(_lowering, original), platform="cuda")
  register.done = True


register()
