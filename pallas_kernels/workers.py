"""Worker processes for kernel compiles and lowerings that would otherwise hold this process' GIL.

`submit(call, pool=..., **args)` runs `module.function(**args)` (call = (module, function),
importable by name) in a worker: a Python process (`python -m pallas_kernels.workers`, JAX on
its CPU platform: no GPU memory is taken) that stays up for later requests, one per thread of
the named pool (default size MAX_WORKERS, $COAT_JAX_KERNEL_WORKERS: half the cores, at most 8;
`prestart` makes a pool and starts its processes ahead of its first request). Requests and results
travel pickled over the process' stdin / stdout; a request that raises there, or a worker that
dies, makes the Future raise RuntimeError naming the error (the caller then does the work
itself). Workers end when this process does (their stdin closes) or after IDLE_S seconds without
a request.

Used by pallas_kernels/compile_triton.py (Triton compiles) and pallas_kernels/lower_ahead.py
(Mosaic GPU lowerings). Imports the standard library only.
"""
from __future__ import annotations

import concurrent.futures
import importlib
import os
import pickle
import select
import subprocess
import sys
import threading

MAX_WORKERS = int(os.environ.get("COAT_JAX_KERNEL_WORKERS", 0)) or max(
    1, min(8, (os.cpu_count() or 2) // 2))
TIMEOUT_S = 600          # how long a caller waits for one result
# a worker with no request for this long exits (its memory back); read by the worker
IDLE_S = float(os.environ.get("COAT_JAX_WORKER_IDLE_S", 300))
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_lock = threading.Lock()
_pools: dict = {}              # pool name -> ThreadPoolExecutor
_thread = threading.local()    # a pool thread's worker process


def _pool(name: str, size: int | None):
  with _lock:
    if name not in _pools:
      _pools[name] = concurrent.futures.ThreadPoolExecutor(size or MAX_WORKERS,
                                                           f"coat-{name}-worker")
    return _pools[name]


def submit(call: tuple[str, str], *, pool: str = "kernels", size: int | None = None,
           **args) -> concurrent.futures.Future:
  """A Future of `getattr(import_module(call[0]), call[1])(**args)` run in a worker process of
  the pool `pool` (made on first use with `size` workers, default MAX_WORKERS)."""
  return _pool(pool, size).submit(run, {"call": tuple(call), "args": args})


def prestart(pool: str, size: int, preload: tuple[str, ...] = ()) -> None:
  """Make the pool `pool` of `size` workers now and start their processes, each importing the
  modules `preload`, so that later requests do not wait for Python's start-up and imports."""
  with _lock:
    fresh = pool not in _pools
  executor = _pool(pool, size)
  if fresh:
    for _ in range(size):
      executor.submit(run, {"call": (__name__, "preload"), "args": {"modules": tuple(preload)}})


def preload(modules) -> None:
  """In a worker: import `modules` (what its later requests will need)."""
  for name in modules:
    importlib.import_module(name)


def _worker_process() -> subprocess.Popen:
  """This pool thread's worker process, started on its first request and kept: later requests
  skip Python's and JAX's start-up."""
  proc = getattr(_thread, "proc", None)
  if proc is None or proc.poll() is not None:
    path = [_PACKAGE_ROOT] + [p for p in sys.path if p and p != _PACKAGE_ROOT]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(path))
    proc = subprocess.Popen([sys.executable, "-m", "pallas_kernels.workers"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env)
    _thread.proc = proc
  return proc


def run(request: dict):
  """Run `request` ({"call": (module, function), "args": {...}}) in this thread's worker
  process and return its result; RuntimeError naming the error when it raised there or the
  process died."""
  proc = _worker_process()
  try:
    pickle.dump(request, proc.stdin)
    proc.stdin.flush()
    reply = pickle.load(proc.stdout)
  except (OSError, EOFError, pickle.UnpicklingError) as e:
    proc.kill()
    raise RuntimeError(f"the worker process exited (status {proc.wait()}): {e!r}") from None
  if "error" in reply:
    raise RuntimeError(reply["error"])
  return reply["result"]


def _main() -> None:
  """The worker's loop: a pickled request from stdin, its pickled reply to stdout, until EOF."""
  out = os.fdopen(os.dup(1), "wb")   # replies go to the real stdout; prints to stderr
  os.dup2(2, 1)
  while True:
    if not select.select([sys.stdin.buffer], [], [], IDLE_S)[0]:
      return                            # idle: the parent's pool starts a new one if needed
    try:
      request = pickle.load(sys.stdin.buffer)
    except EOFError:
      return
    try:
      module, name = request["call"]
      reply = {"result": getattr(importlib.import_module(module), name)(**request["args"])}
    except Exception as e:  # noqa: BLE001 - reported to the caller, which does the work itself
      lines = str(e).strip().splitlines()
      reply = {"error": f"{type(e).__name__}: {lines[-1] if lines else ''}"}
    pickle.dump(reply, out)
    out.flush()


if __name__ == "__main__":
  _main()
