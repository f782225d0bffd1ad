"""Lower this project's Mosaic GPU kernels in worker processes while the step is still traced.

JAX lowers a Pallas Mosaic GPU kernel in the lowering of the step that calls it (~0.3 s of
Python per kernel: the kernel's jaxpr to the Mosaic GPU dialect, layout inference, the dialect's
lowering; 15 kernels in the olmo-1b coat step, ~4.5 s on the GPU host), one kernel after
another on the thread that holds the GIL. `call(fn, *args, **kwargs)` instead:
  1. hands `fn(*args, **kwargs)` (fn at a module's top level; array arguments by shape and dtype,
     the rest as given) to a worker process (pallas_kernels/workers.py), which exports it for
     CUDA with `jax.export` (the Mosaic GPU module travels inside the exported StableHLO) and
     sends back the `Exported`;
  2. binds a primitive carrying the call's key and result types (from `jax.eval_shape` of the
     call: the kernel is traced here once per distinct call, as before);
  3. whose CUDA lowering waits for that `Exported` and lowers its call (the exported module
     merged into the step's: milliseconds);
  4. and, as soon as the `Exported` is in, XLA-compiles it alone on a thread here (WARM), which
     leaves the kernel compiled in the Mosaic GPU runtime's cache (keyed by the module's hash,
     which the export fixes) for the step's own compile.
One export per distinct call (function, operand shapes and dtypes, other arguments); a call
whose export fails in the worker is lowered here, with a warning naming the failure. Other
platforms lower `fn` itself.

MODE ($COAT_JAX_KERNEL_LOWERING): "process" (default) or "inline" (`call` is `fn(*args,
**kwargs)`). The dispatch (coat_jax/kernels.py) uses `call` on one device outside interpret
mode; on meshes the kernels run per shard inside custom_partitioning, whose callbacks lower them
during XLA's partitioning, where nothing is left to overlap. Imports jax only.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import os
import sys
import threading
import warnings

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from pallas_kernels import workers

MODES = ("process", "inline")
MODE = os.environ.get("COAT_JAX_KERNEL_LOWERING", "process")
WORKER_CALL = (__name__, "export_in_worker")   # what a worker runs (tests point it elsewhere)
PLATFORM = "cuda"      # what the workers export for, and the platform whose lowering waits for them

_lock = threading.Lock()
_calls: dict = {}   # key -> _Call
stats = {"started": 0, "from_worker": 0, "worker_failed": 0, "warmed": 0, "warm_failed": 0}
# WARM ($COAT_JAX_KERNEL_WARM, default on): compile each exported kernel alone as soon as it is in
# (`_warm`), on threads of this process, while the step is still traced and lowered.
WARM = os.environ.get("COAT_JAX_KERNEL_WARM", "1") != "0"
_warm_pool = None


@dataclasses.dataclass
class _Call:
  fn: object
  args: tuple          # static arguments as given; operands as None (filled from `operands`)
  kwargs: dict
  slots: tuple         # ("arg", i) / ("kwarg", name) per operand, in operand order
  out_tree: object
  out_avals: tuple
  job: object          # Future of the worker's Exported
  exported: object = None


def check_mode() -> str:
  if MODE not in MODES:
    raise ValueError(f"lower_ahead.MODE (from $COAT_JAX_KERNEL_LOWERING) must be one of "
                     f"{MODES}, got {MODE!r}")
  return MODE


def _is_operand(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray)) or isinstance(x, jax.core.Tracer)


def _split(args, kwargs):
  """(operands, slots, static args, static kwargs, key part) of a call's arguments."""
  operands, slots, key = [], [], []
  static_args = list(args)
  for i, a in enumerate(args):
    if _is_operand(a):
      operands.append(a)
      slots.append(("arg", i))
      static_args[i] = None
      key.append(("operand", np.shape(a), str(a.dtype)))
    else:
      key.append(("static", a))
  static_kwargs = {}
  for name in sorted(kwargs):
    v = kwargs[name]
    if _is_operand(v):
      operands.append(v)
      slots.append(("kwarg", name))
      key.append((name, "operand", np.shape(v), str(v.dtype)))
    else:
      static_kwargs[name] = v
      key.append((name, "static", v))
  return operands, tuple(slots), tuple(static_args), static_kwargs, tuple(key)


def _bind_operands(fn, static_args, static_kwargs, slots):
  """fn as a function of its operands only (in `slots` order)."""
  def of_operands(*operands):
    args, kwargs = list(static_args), dict(static_kwargs)
    for (kind, where), x in zip(slots, operands):
      if kind == "arg":
        args[where] = x
      else:
        kwargs[where] = x
    return fn(*args, **kwargs)
  return of_operands


def _importable(fn) -> bool:
  module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
  return bool(module and name) and getattr(sys.modules.get(module), name, None) is fn


def call(fn, *args, **kwargs):
  """fn(*args, **kwargs), its lowering done in a worker process (MODE "process"; see above)."""
  if check_mode() != "process" or not _importable(fn):
    return fn(*args, **kwargs)
  operands, slots, static_args, static_kwargs, key_part = _split(args, kwargs)
  key = (fn.__module__, fn.__qualname__, key_part)
  try:
    hash(key)
  except TypeError:    # an argument this key cannot hold: lowered here
    return fn(*args, **kwargs)
  with _lock:
    entry = _calls.get(key)
  if entry is None:
    specs = [(np.shape(x), str(x.dtype)) for x in operands]
    job = workers.submit(WORKER_CALL, fn=(fn.__module__, fn.__qualname__), operands=specs,
                         slots=slots, static_args=static_args, static_kwargs=static_kwargs,
                         platform=PLATFORM)
    stats["started"] += 1
    of_operands = _bind_operands(fn, static_args, static_kwargs, slots)
    out = jax.eval_shape(of_operands, *[jax.ShapeDtypeStruct(s, d) for s, d in specs])
    flat, out_tree = jax.tree.flatten(out)
    entry = _Call(fn, static_args, static_kwargs, slots, out_tree,
                  tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in flat), job)
    with _lock:
      entry = _calls.setdefault(key, entry)
    if WARM and _backend_platform() == PLATFORM:
      job.add_done_callback(lambda _, specs=specs: _warm_later(job, specs))
  outs = lowered_ahead_p.bind(*operands, key=key, out_avals=entry.out_avals)
  return jax.tree.unflatten(entry.out_tree, outs)


def _backend_platform() -> str:
  platform = jax.default_backend()
  return "cuda" if platform == "gpu" else platform


def _warm_later(job, specs) -> None:
  """Once a worker's export is in: compile it alone on a thread (`_warm`)."""
  global _warm_pool
  with _lock:
    if _warm_pool is None:
      _warm_pool = concurrent.futures.ThreadPoolExecutor(2, "coat-kernel-warm")
  try:
    _warm_pool.submit(_warm, job, specs)
  except RuntimeError:   # the interpreter is shutting down: nothing left to warm for
    pass


def _warm(job, specs) -> None:
  """XLA-compile the exported kernel alone (nothing runs). The Mosaic GPU runtime compiles a
  kernel module when XLA compiles a step that calls it and keeps it by the module's hash, which
  an Exported carries fixed: the step's own compile then finds the kernel compiled (measured on
  the H100: 0.47 s for a GEMM alone, 0.06 s for a step calling it afterwards). Failures here only
  lose the head start."""
  try:
    exported = job.result()
    structs = [jax.ShapeDtypeStruct(s, d) for s, d in specs]
    jax.jit(exported.call).trace(*structs).lower().compile()
    stats["warmed"] += 1
  except Exception:  # noqa: BLE001 - the step's compile compiles the kernel itself
    stats["warm_failed"] += 1


def export_in_worker(fn, operands, slots, static_args, static_kwargs, platform="cuda"):
  """In the worker: `jax.export` of the call for `platform` (its vjp dropped: not picklable,
  unused)."""
  from jax import export
  module, name = fn
  target = importlib.import_module(module)
  for part in name.split("."):
    target = getattr(target, part)
  of_operands = _bind_operands(target, static_args, static_kwargs, slots)
  structs = [jax.ShapeDtypeStruct(s, d) for s, d in operands]
  exported = export.export(jax.jit(of_operands), platforms=[platform])(*structs)
  return dataclasses.replace(exported, _get_vjp=None)


def _exported(key):
  """The worker's Exported for `key`, or None when its export failed (warned once)."""
  entry = _calls[key]
  if entry.exported is None and entry.job is not None:
    try:
      entry.exported = entry.job.result(timeout=workers.TIMEOUT_S)
      stats["from_worker"] += 1
    except Exception as e:  # noqa: BLE001 - any failure there: lower here instead
      stats["worker_failed"] += 1
      if stats["worker_failed"] == 1:    # once per process: the rest fail alike
        lines = str(e).strip().splitlines() or [type(e).__name__]
        warnings.warn(f"lower_ahead: the worker process failed ({lines[-1]}); lowering "
                      f"{key[1]} (and any other kernel whose export fails) in this process",
                      RuntimeWarning, stacklevel=2)
    entry.job = None
  return entry.exported


def _inline_rule(ctx, *operands, key, out_avals):
  del out_avals
  entry = _calls[key]
  fn = _bind_operands(entry.fn, entry.args, entry.kwargs, entry.slots)
  flat = lambda *xs: jax.tree.leaves(fn(*xs))
  return mlir.lower_fun(flat, multiple_results=True)(ctx, *operands)


def ahead_rule(ctx, *operands, key, out_avals):
  """PLATFORM's lowering: the worker's Exported called (or, if its export failed, `fn`)."""
  exported = _exported(key)
  if exported is None:
    return _inline_rule(ctx, *operands, key=key, out_avals=out_avals)
  flat = lambda *xs: jax.tree.leaves(exported.call(*xs))
  return mlir.lower_fun(flat, multiple_results=True)(ctx, *operands)


def _eager(*operands, key, out_avals):
  """Outside jit: the call jitted alone (its lowering as above)."""
  bind = lambda *xs: lowered_ahead_p.bind(*xs, key=key, out_avals=out_avals)
  return jax.jit(bind)(*operands)


lowered_ahead_p = Primitive("coat_lowered_ahead")
lowered_ahead_p.multiple_results = True
lowered_ahead_p.def_abstract_eval(lambda *avals, key, out_avals: out_avals)
lowered_ahead_p.def_impl(_eager)
mlir.register_lowering(lowered_ahead_p, _inline_rule)
mlir.register_lowering(lowered_ahead_p, ahead_rule, platform=PLATFORM)
