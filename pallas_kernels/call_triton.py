"""How this project's Triton kernels reach XLA: a typed-FFI custom call, compiled ahead in threads.

Two changes to jax-triton 0.3.1's `triton_call` for this project's calls: the typed-FFI custom call
(an option, CUSTOM_CALL, for the calls that ask for it with `call_kwargs`: every other jax-triton
call in the process keeps jax-triton's own lowering) and the compile ahead (`precompile`, on).

1. The custom call. jax-triton 0.3.1 lowers every call to the legacy custom call
   `triton_kernel_call` (API version 2), which XLA cannot record into a command buffer (CUDA
   graph): each call is its own host launch, between the step's command buffers. JAX >= 0.10.1
   also registers `triton_kernel_call_ffi`, a typed-FFI handler for the same compressed
   TritonKernelCall proto (its `opaque` attribute) that loads the kernel in its initialize stage
   and is marked command-buffer compatible (jax-ml/jax#37094). The rule registered here runs
   jax-triton's lowering (which compiles the kernel and builds the proto), takes the proto out of
   the legacy op it emitted, erases that op and emits the typed-FFI call with the same operands,
   results and aliases (`legacy_to_ffi`).
2. The compile. jax-triton compiles a kernel when XLA's module is lowered, one at a time, after
   the whole model before it. `precompile`, called while the step is traced, starts the same
   compile on a worker thread (by lowering a one-call function of the same operand types), so it
   overlaps the lowering of everything else: Triton's passes, LLVM and ptxas mostly run without
   the GIL. The lowering rule waits for those workers before it compiles anything itself, so each
   kernel is compiled once (jax-triton's in-process cache, keyed by the kernel, the argument
   types and the constexprs). Nothing is written to disk.

Imports jax, and jax-triton where installed (GPU machines).
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading

import jax
from jax.interpreters import mlir
from jax._src.lib.mlir import ir

try:  # GPU machines only
  from jax_triton import triton_lib
except ImportError:  # pragma: no cover - CPU machines
  triton_lib = None

FFI_TARGET = "triton_kernel_call_ffi"      # JAX's typed-FFI Triton handler
LEGACY_TARGET = "triton_kernel_call"       # jax-triton 0.3.1's custom call (API version 2)
MARK = "coat_jax:" + FFI_TARGET            # the target name our calls pass: "lower me as FFI"
MIN_JAX_FOR_FFI = (0, 10, 1)

# Read when a call is traced (benchmarks A/B them; jax.clear_caches() between settings), default
# from $COAT_JAX_TRITON_CALL: "legacy", jax-triton's own custom call; "ffi", the typed-FFI one
# (CUDA-graph capturable). Legacy is the default: H100, 62-leaf 1.21e9-param coat_adamw_apply,
# same GPU kernel time (6.70 ms), blocked wall 8.73 ms legacy vs 9.37 ms ffi, pipelined 7.08 vs
# 7.22 (docs/benchmarks.md, seventh session): with 62 large kernels the host launching each one
# overlaps the GPU's work, while a command buffer is updated with all 62 calls' buffers first.
CUSTOM_CALLS = ("legacy", "ffi")
CUSTOM_CALL = os.environ.get("COAT_JAX_TRITON_CALL", "legacy")
PRECOMPILE = True                          # compile on worker threads while the step is traced
WORKERS = 4

_log = logging.getLogger(__name__)
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pending: dict[tuple, concurrent.futures.Future] = {}
_pending_lock = threading.Lock()
_in_worker = threading.local()


def ffi_supported() -> bool:
  """True when this JAX registers the typed-FFI Triton target (JAX >= 0.10.1)."""
  return jax.__version_info__ >= MIN_JAX_FOR_FFI


def call_kwargs() -> dict:
  """Extra keyword arguments for `jax_triton.triton_call`: the custom call CUSTOM_CALL names."""
  if CUSTOM_CALL not in CUSTOM_CALLS:
    raise ValueError(f"call_triton.CUSTOM_CALL must be one of {CUSTOM_CALLS}, got {CUSTOM_CALL!r}")
  if CUSTOM_CALL == "ffi" and ffi_supported():
    return {"custom_call_target_name": MARK}
  return {}


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


def _wait_for_workers():
  if getattr(_in_worker, "active", False):
    return
  with _pending_lock:
    futures = list(_pending.values())
  concurrent.futures.wait(futures)


def _lowering(original, ctx, *args, custom_call_target_name, **params):
  _wait_for_workers()
  if custom_call_target_name != MARK:
    return original(ctx, *args, custom_call_target_name=custom_call_target_name, **params)
  results = original(ctx, *args, custom_call_target_name=LEGACY_TARGET, **params)
  return legacy_to_ffi(ctx, results)


def register():
  """Route jax-triton's CUDA lowering through `_lowering` (idempotent; GPU machines)."""
  if triton_lib is None or getattr(register, "done", False):
    return
  import functools
  original = functools.partial(triton_lib.triton_kernel_call_lowering, triton_lib.get_cuda_backend)
  mlir.register_lowering(triton_lib.triton_kernel_call_p,
                         functools.partial(_lowering, original), platform="cuda")
  register.done = True


register()


def _scalar_key(value):
  """What jax-triton specializes a Python scalar on: its Triton type and whether it equals 1."""
  if isinstance(value, bool):
    return ("bool", value)
  if isinstance(value, int):
    return ("i32" if -2**31 <= value < 2**31 else "i64", value == 1)
  return (type(value).__name__,)


def compile_key(operands, kwargs) -> tuple:
  """What a jax-triton compile depends on (not the shapes: every pointer is 16-aligned and the
  sizes our kernels take are runtime ints): the kernel, operand and result dtypes, scalar
  specializations, and the constexprs / launch options."""
  ops = tuple(str(o.dtype) if hasattr(o, "dtype") and hasattr(o, "shape") else _scalar_key(o)
              for o in operands)
  outs = tuple(str(o.dtype) for o in jax.tree_util.tree_leaves(kwargs["out_shape"]))
  rest = tuple(sorted((k, v) for k, v in kwargs.items()
                      if k not in ("out_shape", "grid", "input_output_aliases", "kernel")))
  return (kwargs["kernel"], ops, outs, rest)


def precompile(triton_call, operands, **kwargs) -> bool:
  """Start compiling the kernel `triton_call(*operands, **kwargs)` will need, on a worker thread.

  Only while tracing (some operand is a tracer) and once per `compile_key`; the worker lowers a
  function of ShapeDtypeStructs making the same call, which compiles the kernel into jax-triton's
  cache. Returns True when it started one. A worker's failure is logged and left to the real
  lowering, which then compiles the kernel itself.
  """
  global _pool
  if not PRECOMPILE or not any(isinstance(o, jax.core.Tracer) for o in operands):
    return False
  key = compile_key(operands, kwargs)
  with _pending_lock:
    if key in _pending:
      return False
    arrays = [i for i, o in enumerate(operands) if hasattr(o, "shape") and hasattr(o, "dtype")]
    specs = [jax.ShapeDtypeStruct(operands[i].shape, operands[i].dtype) for i in arrays]
    fixed = list(operands)

    def one_call(*xs):
      ops = list(fixed)
      for i, x in zip(arrays, xs):
        ops[i] = x
      return triton_call(*ops, **kwargs)

    def work():
      _in_worker.active = True
      try:
        jax.jit(one_call).trace(*specs).lower()
      except Exception as e:  # noqa: BLE001 - the main lowering compiles it instead
        _log.warning("call_triton: precompile of %s failed (%s); compiling in the lowering",
                     getattr(kwargs["kernel"], "__name__", kwargs["kernel"]), e)

    if _pool is None:
      _pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="triton-compile")
    _pending[key] = _pool.submit(work)
  return True


def pending() -> int:
  """How many precompiles were started in this process (done or not)."""
  with _pending_lock:
    return len(_pending)
