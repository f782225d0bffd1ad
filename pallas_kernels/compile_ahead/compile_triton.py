"""Compile this project's Triton kernels in worker processes while JAX lowers the rest of the step.

jax-triton compiles a kernel inside its lowering rule (`get_or_create_triton_kernel`: Triton's
front end, then TTIR -> TTGIR -> LLVM IR -> PTX; seconds per Adam kernel), on the thread that
lowers the whole step, and a train step lowers its optimizer last, after every Mosaic GPU kernel
of the forward and backward. A thread cannot overlap the two (both hold the GIL); another process
can. What this saves: docs/kernels.md, "Compile time".

`start`, called as our code traces a Triton call (`call_triton.triton_call`), finds the compile
that call's lowering will ask for by a dry lowering of the call alone (jax-triton's own rule,
stopped where it asks `get_or_create_triton_kernel`: the exact arguments, nothing of jax-triton's
logic copied) and hands it to a worker process (workers.py: JAX on its CPU
platform, no GPU memory; kept for later requests) that runs that same jax-triton function and
sends back what it built jaxlib's TritonKernel from (name, PTX, TTIR, shared memory). When the
real lowering asks for the same compile, `get_or_create` (installed over jax-triton's by
`install`) waits for that result and builds the TritonKernel in this process. One compile per
distinct (kernel, operand types, launch options, constexprs), as jax-triton's own cache; a
compile that fails in the worker is done again here, with a warning naming the failure.

MODE: "process" (default) or "inline" (jax-triton's compile in the lowering, as without this file; a
module constant that benchmarks set before tracing). Kernels defined at a module's top level only
(the worker imports them by name); others compile inline. Imports jax, and jax-triton where
installed (GPU machines).
"""
from __future__ import annotations

import functools
import sys
import threading
import types
import warnings

import jax
import numpy as np

from pallas_kernels.compile_ahead import workers

try:  # GPU machines only
  from jax_triton import triton_lib
except ImportError:  # pragma: no cover - CPU machines
  triton_lib = None

MODES = ("process", "inline")
MODE = "process"
# What a worker runs: (module, function) taking a request's "args" (tests point it elsewhere).
WORKER_CALL = (__name__, "compile_in_worker")
# The compiles' own worker pool (not behind the Mosaic GPU lowerings' queue): the Adam step
# compiles 2 kernels (rows, columns); `prestart` starts it early (the dispatch does).
POOL, POOL_SIZE = "triton", 2
PRELOAD = ("pallas_kernels.compile_ahead.compile_triton", "jax_triton",
           "pallas_kernels.adam.adam_step_triton")
# triton_call keywords that do not reach the compile (the others: launch options, constexprs)
_CALL_ONLY = frozenset({"out_shape", "grid", "input_output_aliases", "zeroed_outputs", "name",
                        "custom_call_target_name", "serialized_metadata"})

_lock = threading.Lock()
_traced: set = set()    # trace keys already looked at
_jobs: dict = {}        # compile key -> Future of a worker's result
_built: dict = {}       # compile key -> (TritonKernel, attrs)
_dry = threading.local()
stats = {"started": 0, "from_worker": 0, "inline": 0, "worker_failed": 0}


class _Asked(Exception):
  """Raised by `get_or_create` in a dry lowering, with the compile that was asked for."""

  def __init__(self, key, request):
    super().__init__("compile_triton: dry lowering")
    self.key, self.request = key, request


def check_mode() -> str:
  if MODE not in MODES:
    raise ValueError(f"compile_triton.MODE must be one of {MODES}, got {MODE!r}")
  return MODE


def compile_key(fn, arg_dtypes, scalar_args, kw: dict) -> tuple:
  """What jax-triton's compile depends on (as its cache key): the kernel, the operand types,
  which scalars are None or 1, the launch options and the constexprs (`metaparams`)."""
  scalars = tuple((i, t, v is None, v is not None and v == 1) for i, t, v in scalar_args)
  rest = tuple(sorted((k, v) for k, v in kw.items() if k != "metaparams"))
  return (fn, tuple(arg_dtypes), scalars, tuple(sorted(kw["metaparams"].items())), rest)


def _scalar_type(v) -> tuple:
  """A scalar operand's part of the trace key: its Triton type class and whether it is 1."""
  if isinstance(v, bool):
    kind = "B"
  elif isinstance(v, int):
    kind = next(t for t, lim in (("i32", 2**31), ("u32", 2**32), ("i64", 2**63), ("u64", 2**64))
                if -lim <= v < lim)
  else:
    kind = type(v).__name__
  return (kind, v == 1)


def _is_scalar(a) -> bool:  # as jax-triton's triton_call splits its operands
  return isinstance(a, (bool, int, float, np.float32))


def trace_key(kernel, args, kwargs) -> tuple:
  """Calls with equal trace keys ask for the same compile (the leaf's shape is not in it)."""
  ops = tuple(_scalar_type(a) if _is_scalar(a) else str(a.dtype) for a in args)
  outs = tuple(str(s.dtype) for s in jax.tree.leaves(kwargs.get("out_shape")))
  rest = tuple(sorted((k, v) for k, v in kwargs.items() if k not in _CALL_ONLY))
  return (kernel, ops, outs, rest)


def _request(fn, platform, arg_dtypes, scalar_args, kw) -> dict | None:
  recipe = workers.recipe(fn, getattr(fn, "fn", None))   # a JITFunction: its Python function
  if recipe is None:
    return None
  kw = dict(kw)
  if kw.get("compute_capability") is None:   # as jax-triton: device 0's
    kw["compute_capability"] = triton_lib.triton_kernel_call_lib.get_compute_capability(0)
  return dict(kernel=recipe, platform=platform, arg_dtypes=list(arg_dtypes),
              scalar_args=tuple(scalar_args), kw=kw)


def _build(result) -> tuple:
  """jaxlib's TritonKernel from a worker's result, and the specialization attrs."""
  return triton_lib.triton_kernel_call_lib.TritonKernel(*result["kernel_args"]), result["attrs"]


def get_or_create(original, backend_init_func, platform, fn, arg_dtypes, scalar_args, **kw):
  """Stands in for jax-triton's `get_or_create_triton_kernel` (`original`): in a dry lowering,
  raise the compile asked for; else the worker's kernel when one was started, else `original`."""
  key = compile_key(fn, arg_dtypes, scalar_args, kw)
  if getattr(_dry, "active", False):
    raise _Asked(key, _request(fn, platform, arg_dtypes, scalar_args, kw))
  with _lock:
    built = _built.get(key)
    job = None if built is not None else _jobs.pop(key, None)
  if built is not None:
    return built
  if job is not None:
    try:
      built = _build(job.result(timeout=workers.TIMEOUT_S))
    except Exception as e:  # noqa: BLE001 - any failure there: compile here instead
      stats["worker_failed"] += 1
      why = workers.last_line(str(e)) or type(e).__name__
      warnings.warn(f"compile_triton: the worker process failed ({why}); compiling "
                    f"{getattr(fn, '__name__', fn)} in this process", RuntimeWarning, stacklevel=2)
    else:
      with _lock:
        _built[key] = built
      stats["from_worker"] += 1
      return built
  stats["inline"] += 1
  return original(backend_init_func, platform, fn, arg_dtypes, scalar_args, **kw)


def dry_lower(call, args, kwargs) -> _Asked | None:
  """Lower `call(*args, **kwargs)` alone for CUDA with `get_or_create` installed, up to the
  compile it asks for; None when it asks for none."""
  arrays = [i for i, a in enumerate(args) if not _is_scalar(a)]
  structs = [jax.ShapeDtypeStruct(np.shape(args[i]), args[i].dtype) for i in arrays]

  def one_call(*xs):
    full = list(args)
    for i, x in zip(arrays, xs):
      full[i] = x
    return call(*full, **kwargs)

  _dry.active = True
  try:
    jax.jit(one_call).trace(*structs).lower(lowering_platforms=("cuda",))
  except _Asked as asked:
    return asked
  finally:
    _dry.active = False
  return None


def start(call, kernel, args, kwargs) -> bool:
  """As `call(*args, kernel=kernel, **kwargs)` (jax-triton's triton_call) is traced: start its
  compile in a worker process unless it is started or done. True when one was started."""
  if check_mode() != "process":
    return False
  try:
    tkey = trace_key(kernel, args, kwargs)
    hash(tkey)
  except (TypeError, AttributeError, StopIteration):
    return False          # an operand this key cannot describe: the lowering compiles it
  with _lock:
    if tkey in _traced:
      return False
    _traced.add(tkey)
  asked = dry_lower(functools.partial(call, kernel=kernel), args, kwargs)
  if asked is None or asked.request is None:
    return False
  with _lock:
    if asked.key in _jobs or asked.key in _built:
      return False
    _jobs[asked.key] = workers.submit(WORKER_CALL, pool=POOL, size=POOL_SIZE, **asked.request)
  stats["started"] += 1
  return True


def _block_torch() -> None:
  """In a worker only: make `import torch` fail at once. Triton's native argument specializer
  (called by jax-triton's compile) tries `import torch` to recognize torch tensors; where torch is
  installed (the GPU image) that import adds seconds to the first compile in every process. A
  worker never sees torch tensors; the user's process is left alone."""
  sys.modules["torch"] = None


def prestart() -> None:
  """Start the compile workers (and their imports of jax-triton and the kernels) now, before
  the first Triton call is traced (MODE "process" on a machine with jax-triton)."""
  if triton_lib is not None and check_mode() == "process":
    workers.prestart(POOL, POOL_SIZE, PRELOAD)


def compile_in_worker(kernel, platform, arg_dtypes, scalar_args, kw) -> dict:
  """In the worker: jax-triton's get_or_create_triton_kernel for the kernel `workers.resolve`
  imports by its recipe (the caller's, checked), with jaxlib's TritonKernel replaced by a
  recorder of its arguments."""
  if "torch" not in sys.modules:   # see _block_torch
    _block_torch()
  from jax_triton import triton_lib as tl

  class Recorded:  # what get_or_create builds the kernel from
    def __init__(self, *args):
      self.args = args

  tl.triton_kernel_call_lib = types.SimpleNamespace(TritonKernel=Recorded)
  fn = workers.resolve(kernel, lambda jit_function: jit_function.fn)
  backend = {"cuda": tl.get_cuda_backend, "rocm": tl.get_hip_backend}[platform]
  original = getattr(tl.get_or_create_triton_kernel, "original", tl.get_or_create_triton_kernel)
  recorded, attrs = original(backend, platform, fn, arg_dtypes, scalar_args, **kw)
  return {"kernel_args": recorded.args, "attrs": attrs}


def install() -> None:
  """Put `get_or_create` in place of jax-triton's (idempotent; GPU machines). Calls that did not
  pass `start` go to jax-triton's own compile."""
  if triton_lib is None or hasattr(triton_lib.get_or_create_triton_kernel, "original"):
    return
  original = triton_lib.get_or_create_triton_kernel
  wrapped = functools.partial(get_or_create, original)
  wrapped.original = original
  triton_lib.get_or_create_triton_kernel = wrapped
