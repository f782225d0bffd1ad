"""Lower this project's Mosaic GPU kernels in worker processes while the step is still traced.

JAX lowers a Pallas Mosaic GPU kernel in the lowering of the step that calls it (Python work per
kernel: the kernel's jaxpr to the Mosaic GPU dialect, layout inference, the dialect's lowering;
15 kernels in the olmo-1b coat step), one kernel after another on the thread that holds the GIL
(docs/kernels.md, "Compile time"). `call(fn, *args, **kwargs)` instead:
  1. hands `fn(*args, **kwargs)` (fn at a module's top level; array arguments by shape and dtype,
     the rest as given) to a worker process (workers.py), which checks it imports
     the same `fn` (module file, code hash), exports the call for CUDA with `jax.export` under
     this process' x64 and matmul-precision settings (the Mosaic GPU module travels inside the
     exported StableHLO) and sends back the `Exported`;
  2. binds a primitive carrying the call's key and result types (from `jax.eval_shape` of the
     call: the kernel is traced here once per distinct call, as before);
  3. whose CUDA lowering waits for that `Exported` and lowers its call (the exported module
     merged into the step's: milliseconds);
  4. and, as soon as the `Exported` is in, XLA-compiles it alone on a thread here (WARM, on
     WARM_THREADS threads), which leaves the kernel compiled in the Mosaic GPU runtime's cache
     (keyed by the module's hash, which the export fixes) for the step's own compile.
`prestart()` starts the workers and their imports before the first kernel is traced (the
training build calls it through `coat_jax.kernels.prestart_compiles` before it makes the model).
One export per distinct call (function and its code, operand shapes and dtypes, the other
arguments with their types, the settings above). A call whose export fails in the worker, or
whose export's result types differ from the call's, is lowered here (one warning). Other
platforms, `jax.disable_jit`, vmap and differentiation go to `fn` itself.

MODE: "process" (default) or "inline" (`call` is `fn(*args, **kwargs)`: benchmarks compare the two;
a module constant, set before tracing). The dispatch (coat_jax.kernels) uses `call` on one device
outside interpret mode; on meshes the kernels run per shard inside custom_partitioning, whose
callbacks lower them during XLA's partitioning, where nothing is left to overlap. Imports jax only.
"""
from __future__ import annotations

import dataclasses
import threading
import warnings

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from pallas_kernels.compile_ahead import workers

MODES = ("process", "inline")
MODE = "process"
WORKER_CALL = (__name__, "export_in_worker")   # what a worker runs (tests point it elsewhere)
PLATFORM = "cuda"      # what the workers export for, and the platform whose lowering waits for them
# WARM (default on): compile each exported kernel alone as soon as it is in (`_warm`), on
# WARM_THREADS threads of this process, while the step is still traced and lowered. A Mosaic GPU
# kernel takes 0.3-4 s to compile (the OLMo-1B coat step has 19, 7.8 s one after another on the
# H200); on two threads they were still compiling when XLA's compile of the step needed them.
WARM = True
WARM_THREADS = workers.MAX_WORKERS
POOL = "kernels"      # the worker pool that exports the kernels
# what every export imports: started with the workers by `prestart`
PRELOAD = (__name__, "jax.export", "pallas_kernels.gemm.fp8_matmul",
           "pallas_kernels.gemm.fp8_gemm_swiglu", "pallas_kernels.quantize.quantize_mgpu",
           "pallas_kernels.quantize.swiglu_mgpu")
# jax settings an export depends on beyond its arguments: sent to the worker, part of the key
SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision")

_lock = threading.RLock()
_calls: dict = {}   # key -> _Call
stats = {"started": 0, "from_worker": 0, "worker_failed": 0, "warmed": 0, "warm_failed": 0}


@dataclasses.dataclass
class _Call:
  flat_fn: object      # the call as a function of its operands, returning its flat outputs
  out_tree: object
  out_avals: tuple
  job: object          # Future of the worker's Exported
  exported: object = None


def check_mode() -> str:
  if MODE not in MODES:
    raise ValueError(f"lower_ahead.MODE must be one of {MODES}, got {MODE!r}")
  return MODE


def prestart() -> None:
  """Start the export workers (MODE "process") and their imports of PRELOAD now, so that the
  first kernels traced do not wait for Python's start-up and JAX's import in each worker."""
  if check_mode() == "process":
    workers.prestart(POOL, workers.MAX_WORKERS, PRELOAD)


def _count(name: str) -> int:
  with _lock:
    stats[name] += 1
    return stats[name]


def _is_operand(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, jax.core.Tracer))


def _static_key(v):
  """A static argument's part of the key: its type with its value, through tuples and lists
  (2 and 2.0, or 1.5 and np.float32(1.5), are different calls)."""
  if isinstance(v, (tuple, list)):
    return (type(v), tuple(_static_key(x) for x in v))
  if isinstance(v, dict):
    return (dict, tuple((k, _static_key(x)) for k, x in sorted(v.items())))
  return (type(v), v)


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
      key.append(("static", _static_key(a)))
  static_kwargs = {}
  for name in sorted(kwargs):
    v = kwargs[name]
    if _is_operand(v):
      operands.append(v)
      slots.append(("kwarg", name))
      key.append((name, "operand", np.shape(v), str(v.dtype)))
    else:
      static_kwargs[name] = v
      key.append((name, "static", _static_key(v)))
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


def _settings() -> tuple:
  return tuple((name, getattr(jax.config, name)) for name in SETTINGS)


def call(fn, *args, **kwargs):
  """fn(*args, **kwargs), its lowering done in a worker process (MODE "process"; see above)."""
  if check_mode() != "process" or jax.config.jax_disable_jit:
    return fn(*args, **kwargs)
  recipe = workers.recipe(fn)
  if recipe is None:
    return fn(*args, **kwargs)
  operands, slots, static_args, static_kwargs, key_part = _split(args, kwargs)
  settings = _settings()
  key = (recipe["module"], recipe["name"], recipe["code"], key_part, settings)
  try:
    hash(key)
  except TypeError:    # an argument this key cannot hold: lowered here
    return fn(*args, **kwargs)
  with _lock:
    entry = _calls.get(key)
  if entry is None:
    specs = [(np.shape(x), str(x.dtype)) for x in operands]
    job = workers.submit(WORKER_CALL, pool=POOL, fn=recipe, operands=specs, slots=slots,
                         static_args=static_args, static_kwargs=static_kwargs,
                         platform=PLATFORM, settings=settings)
    _count("started")
    of_operands = _bind_operands(fn, static_args, static_kwargs, slots)
    out = jax.eval_shape(of_operands, *[jax.ShapeDtypeStruct(s, d) for s, d in specs])
    flat, out_tree = jax.tree.flatten(out)
    entry = _Call(lambda *xs: jax.tree.leaves(of_operands(*xs)), out_tree,
                  tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in flat), job)
    with _lock:
      entry = _calls.setdefault(key, entry)
    if WARM and _backend_platform() == PLATFORM:
      job.add_done_callback(lambda _: _warm_later(job, specs, dict(settings)))
  outs = lowered_ahead_p.bind(*operands, key=key, out_avals=entry.out_avals)
  return jax.tree.unflatten(entry.out_tree, outs)


def _backend_platform() -> str:
  platform = jax.default_backend()
  return "cuda" if platform == "gpu" else platform


def _warm_later(job, specs, settings) -> None:
  """Once a worker's export is in: compile it alone on a thread (`_warm`)."""
  workers.thread_pool("warm", WARM_THREADS).submit(_warm, job, specs, settings)


def _warm(job, specs, settings) -> None:
  """XLA-compile the exported kernel alone (nothing runs). The Mosaic GPU runtime compiles a
  kernel module when XLA compiles a step that calls it and keeps it by the module's hash, which
  an Exported carries fixed: the step's own compile then finds the kernel compiled. Failures here
  only lose the head start."""
  try:
    exported = job.result()
    with jax.enable_x64(settings["jax_enable_x64"]), \
        jax.default_matmul_precision(settings["jax_default_matmul_precision"]):
      structs = [jax.ShapeDtypeStruct(s, d) for s, d in specs]
      jax.jit(exported.call).trace(*structs).lower().compile()
    _count("warmed")
  except Exception:  # noqa: BLE001 - the step's compile compiles the kernel itself
    _count("warm_failed")


def export_in_worker(fn, operands, slots, static_args, static_kwargs, platform="cuda",
                     settings=()):
  """In the worker: `jax.export` of the call for `platform` under the caller's `settings`, fn
  resolved and checked by `workers.resolve` (its vjp dropped: not picklable, unused)."""
  from jax import export
  for name, value in settings:
    jax.config.update(name, value)
  target = workers.resolve(fn)
  of_operands = _bind_operands(target, static_args, static_kwargs, slots)
  structs = [jax.ShapeDtypeStruct(s, d) for s, d in operands]
  exported = export.export(jax.jit(of_operands), platforms=[platform])(*structs)
  return dataclasses.replace(exported, _get_vjp=None)


def _warn_once(key, why: str) -> None:
  if _count("worker_failed") == 1:    # once per process: the rest fail alike
    warnings.warn(f"lower_ahead: {why}; lowering {key[1]} (and any other kernel whose export "
                  "fails) in this process", RuntimeWarning, stacklevel=3)


def _exported(key):
  """The worker's Exported for `key`, or None when its export failed or does not match the
  call's result types (warned once)."""
  with _lock:
    entry = _calls[key]
    job, entry.job = entry.job, None
  if job is not None:
    try:
      exported = job.result(timeout=workers.TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - any failure there: lower here instead
      why = workers.last_line(str(e)) or type(e).__name__
      _warn_once(key, f"the worker process failed ({why})")
    else:
      got = [(tuple(a.shape), a.dtype) for a in exported.out_avals]
      if got != [(tuple(a.shape), a.dtype) for a in entry.out_avals]:
        _warn_once(key, f"the worker's export returns {got}, the call "
                        f"{[(a.shape, a.dtype) for a in entry.out_avals]}")
      else:
        _count("from_worker")
        with _lock:
          entry.exported = exported
  return entry.exported


def _inline_rule(ctx, *operands, key, out_avals):
  del out_avals
  return mlir.lower_fun(_calls[key].flat_fn, multiple_results=True)(ctx, *operands)


def ahead_rule(ctx, *operands, key, out_avals):
  """PLATFORM's lowering: the worker's Exported called (or, if that failed, `fn`)."""
  exported = _exported(key)
  if exported is None:
    return _inline_rule(ctx, *operands, key=key, out_avals=out_avals)
  flat = lambda *xs: jax.tree.leaves(exported.call(*xs))
  return mlir.lower_fun(flat, multiple_results=True)(ctx, *operands)


@jax.jit(static_argnames=("key", "out_avals"))
def _eager(*operands, key, out_avals):
  """Outside jit: the call jitted alone (its lowering as above), compiled once per call."""
  return lowered_ahead_p.bind(*operands, key=key, out_avals=out_avals)


def _batch(args, dims, *, key, out_avals):
  """vmap: `fn`'s own batching (the kernel's), as if `call` had not been used."""
  del out_avals
  out = jax.vmap(_calls[key].flat_fn, in_axes=dims)(*args)
  return out, [0] * len(out)


def _jvp(primals, tangents, *, key, out_avals):
  del out_avals
  tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
  return jax.jvp(_calls[key].flat_fn, tuple(primals), tangents)


lowered_ahead_p = Primitive("coat_lowered_ahead")
lowered_ahead_p.multiple_results = True
lowered_ahead_p.def_abstract_eval(lambda *avals, key, out_avals: out_avals)
lowered_ahead_p.def_impl(lambda *operands, key, out_avals: _eager(*operands, key=key,
                                                                  out_avals=out_avals))
batching.primitive_batchers[lowered_ahead_p] = _batch
ad.primitive_jvps[lowered_ahead_p] = _jvp
mlir.register_lowering(lowered_ahead_p, _inline_rule)
mlir.register_lowering(lowered_ahead_p, ahead_rule, platform=PLATFORM)
