"""Worker processes for kernel compiles and lowerings that would otherwise hold this process' GIL.

`submit(call, pool=..., **args)` runs `module.function(**args)` (call = (module, function),
importable by name) in a worker: a Python process (`python -P -m
pallas_kernels.compile_ahead.workers`, JAX on its CPU platform: no GPU memory is taken; this
process' `sys.path`, in its order, as its path) that stays up for later requests, one per thread of
the named pool (default size MAX_WORKERS: half the cores, at most 8; `prestart` makes a pool and
starts its processes ahead of its first request). Requests and results travel pickled over the
process' stdin / stdout; a request that raises there, a worker that dies or a reply later than
TIMEOUT_S makes the Future raise RuntimeError naming the error (the caller then does the work
itself). Pool threads are daemons: exiting never waits for them. Workers end when this process does
(their stdin closes) or after IDLE_S seconds without a request (passed to the worker as its
argument, so a caller that changes IDLE_S changes it for the workers it starts next).

Used by compile_triton.py (Triton compiles) and lower_ahead.py (Mosaic GPU lowerings). Imports
the standard library only.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import importlib
import os
import pickle
import queue
import select
import subprocess
import sys
import tempfile
import threading
import types

MAX_WORKERS = max(1, min(8, (os.cpu_count() or 2) // 2))
TIMEOUT_S = 600          # the longest a request may take in a worker
IDLE_S = 300.0           # a worker with no request for this long exits (its memory back)
# the folder holding the pallas_kernels package (this file: pallas_kernels/compile_ahead/)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_lock = threading.Lock()
_pools: dict = {}              # pool name -> ThreadPool
_thread = threading.local()    # a pool thread's worker process (and its stderr file)


class ThreadPool:
  """`size` daemon threads running submitted callables in order (exit never waits for them,
  unlike concurrent.futures' pool, which finishes every queued job first)."""

  def __init__(self, name: str, size: int):
    self._queue = queue.SimpleQueue()
    for i in range(size):
      threading.Thread(target=self._loop, name=f"coat-{name}-{i}", daemon=True).start()

  def submit(self, fn, *args) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    self._queue.put((future, fn, args))
    return future

  def _loop(self):
    while True:
      future, fn, args = self._queue.get()
      if not future.set_running_or_notify_cancel():
        continue
      try:
        future.set_result(fn(*args))
      except BaseException as e:  # noqa: BLE001 - handed to the caller through the Future
        future.set_exception(e)


def thread_pool(name: str, size: int | None = None) -> ThreadPool:
  """The pool `name`, made on first use with `size` threads (default MAX_WORKERS)."""
  with _lock:
    if name not in _pools:
      _pools[name] = ThreadPool(name, size or MAX_WORKERS)
    return _pools[name]


def submit(call: tuple[str, str], *, pool: str = "kernels", size: int | None = None,
           **args) -> concurrent.futures.Future:
  """A Future of `getattr(import_module(call[0]), call[1])(**args)` run in a worker process of
  the pool `pool` (made on first use with `size` workers, default MAX_WORKERS)."""
  return thread_pool(pool, size).submit(run, {"call": tuple(call), "args": args})


def prestart(pool: str, size: int, preload: tuple[str, ...] = ()) -> None:
  """Make the pool `pool` of `size` workers now and start their processes, each importing the
  modules `preload`, so that later requests do not wait for Python's start-up and imports."""
  with _lock:
    fresh = pool not in _pools
  executor = thread_pool(pool, size)
  if fresh:
    for _ in range(size):
      executor.submit(run, {"call": (__name__, "preload"), "args": {"modules": tuple(preload)}})


def preload(modules) -> None:
  """In a worker: import `modules` (what its later requests will need)."""
  for name in modules:
    importlib.import_module(name)


def recipe(obj, inner=None) -> dict | None:
  """How a worker imports `obj` (a module-level function, or e.g. a Triton JITFunction whose
  Python function is `inner`) and checks it has the same one: module, qualified name, the
  module's file and a hash of the function's code. None when `obj` is not reachable by name."""
  inner = obj if inner is None else inner
  module, name = getattr(inner, "__module__", None), getattr(inner, "__qualname__", None)
  code = _code_of(inner)
  if not (module and name and code) or "<locals>" in name:
    return None
  target = sys.modules.get(module)
  for part in name.split("."):
    target = getattr(target, part, None)
  if target is not obj:
    return None       # patched, wrapped or rebound since: the worker would import another
  return dict(module=module, name=name, file=getattr(sys.modules[module], "__file__", None),
              code=_code_hash(code))


def _code_of(fn):
  """A function's code object (through jax.jit's or functools.wraps' __wrapped__), or None."""
  for _ in range(4):
    code = getattr(fn, "__code__", None)
    if code is not None or not hasattr(fn, "__wrapped__"):
      return code
    fn = fn.__wrapped__
  return None


def _code_hash(code) -> str:
  """sha256 of a code object's bytecode, names and constants, nested code objects included.
  Not of `marshal.dumps(code)`: marshal flags each object referenced more than once, so the same
  function marshals differently in a process that holds an extra reference to one of its nested
  code objects (as JAX's tracebacks do to a generator expression's, once the function has been
  traced), and the worker would refuse a function that did not change."""
  h = hashlib.sha256()

  def feed(obj):
    if isinstance(obj, types.CodeType):
      h.update(b"code:" + obj.co_code)
      for part in (obj.co_qualname, obj.co_names, obj.co_varnames, obj.co_freevars,
                   obj.co_cellvars, obj.co_argcount, obj.co_posonlyargcount,
                   obj.co_kwonlyargcount, obj.co_flags):
        h.update(repr(part).encode())
      feed(obj.co_consts)
    elif isinstance(obj, tuple):
      h.update(b"tuple:%d" % len(obj))
      for item in obj:
        feed(item)
    elif isinstance(obj, frozenset):   # its order follows the process' string hashing
      h.update(b"frozenset:" + repr(sorted(map(repr, obj))).encode())
    else:
      h.update(f"{type(obj).__name__}:{obj!r}".encode())

  feed(code)
  return h.hexdigest()


def resolve(recipe: dict, inner=lambda obj: obj):
  """In a worker: the object `recipe` names, ValueError when this process' module file or the
  function's code differ from the parent's (`inner(obj)`: the Python function to compare)."""
  module = importlib.import_module(recipe["module"])
  obj = module
  for part in recipe["name"].split("."):
    obj = getattr(obj, part)
  if getattr(module, "__file__", None) != recipe["file"]:
    raise ValueError(f"the worker imports {recipe['module']} from {module.__file__}, the caller "
                     f"from {recipe['file']}")
  code = _code_of(inner(obj))
  if code is None or _code_hash(code) != recipe["code"]:
    raise ValueError(f"{recipe['module']}.{recipe['name']} differs from the caller's (reloaded "
                     "or edited since it was imported)")
  return obj


def search_path() -> list[str]:
  """This process' module search path as a worker gets it: the package root first, then
  sys.path in order ('' as the current directory)."""
  path = [_PACKAGE_ROOT]
  for p in sys.path:
    p = os.path.abspath(p or os.getcwd())
    if p not in path:
      path.append(p)
  return path


def _worker_process() -> subprocess.Popen:
  """This pool thread's worker process, started on its first request and kept: later requests
  skip Python's and JAX's start-up. -P: no current directory before the path given."""
  proc = getattr(_thread, "proc", None)
  if proc is None or proc.poll() is not None:
    if proc is not None:
      proc.wait()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(search_path()))
    _thread.stderr = tempfile.TemporaryFile()    # read back when the process dies
    proc = subprocess.Popen([sys.executable, "-P", "-m", "pallas_kernels.compile_ahead.workers",
                             repr(float(IDLE_S))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=_thread.stderr, env=env)
    _thread.proc = proc
  return proc


def last_line(text: str) -> str:
  """The last line of `text` (an error message, a process' stderr): what names the failure."""
  lines = text.strip().splitlines()
  return lines[-1] if lines else ""


def _death(proc, error) -> RuntimeError:
  """Kill `proc`; a RuntimeError with its exit status and last stderr line."""
  proc.kill()
  status = proc.wait()
  tail = ""
  try:
    _thread.stderr.seek(0)
    tail = last_line(_thread.stderr.read().decode(errors="replace"))
    tail = f": {tail}" if tail else ""
  except (OSError, AttributeError):
    pass
  return RuntimeError(f"the worker process exited (status {status}; {error}){tail}")


def run(request: dict, *, _retry: bool = True):
  """Run `request` ({"call": (module, function), "args": {...}}) in this thread's worker
  process and return its result; RuntimeError naming the error when it raised there, the process
  died or gave no reply within TIMEOUT_S. A process that had just exited idle is replaced once."""
  data = pickle.dumps(request)     # whole before sending: a failed pickle sends nothing
  proc = _worker_process()
  try:
    proc.stdin.write(data)
    proc.stdin.flush()
    if not select.select([proc.stdout], [], [], TIMEOUT_S)[0]:
      raise TimeoutError(f"no reply in {TIMEOUT_S} s")
    reply = pickle.load(proc.stdout)
  except (BrokenPipeError, EOFError) as e:
    if _retry and proc.wait() == 0:      # it had exited idle just before this request
      return run(request, _retry=False)
    raise _death(proc, repr(e)) from None
  except (OSError, pickle.UnpicklingError, TimeoutError) as e:
    raise _death(proc, repr(e)) from None
  if "error" in reply:
    raise RuntimeError(reply["error"])
  return reply["result"]


def _main(idle_s: float) -> None:
  """The worker's loop: a pickled request from stdin, its pickled reply to stdout, until EOF or
  idle_s seconds without one."""
  out = os.fdopen(os.dup(1), "wb")   # replies go to the real stdout; prints to stderr
  os.dup2(2, 1)
  while True:
    if not select.select([sys.stdin.buffer], [], [], idle_s)[0]:
      return
    try:
      request = pickle.load(sys.stdin.buffer)
    except EOFError:
      return
    try:
      module, name = request["call"]
      reply = {"result": getattr(importlib.import_module(module), name)(**request["args"])}
    except Exception as e:  # noqa: BLE001 - reported to the caller, which does the work itself
      reply = {"error": f"{type(e).__name__}: {last_line(str(e))}"}
    pickle.dump(reply, out)
    out.flush()


if __name__ == "__main__":
  _main(float(sys.argv[1]) if len(sys.argv) > 1 else IDLE_S)
