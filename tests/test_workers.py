"""pallas_kernels/compile_ahead/workers.py: the worker processes that export and compile kernels off the
step's critical path: replies, errors, deaths, time-outs, idle exits, and that a worker runs the
caller's own function or refuses."""
import os
import pickle
import sys
import time

import pytest

from pallas_kernels.compile_ahead import workers


def pid():
  return os.getpid()


def nap(seconds):
  time.sleep(seconds)
  return seconds


def echo(value):
  return value


def _fresh_process():
  old = getattr(workers._thread, "proc", None)
  if old is not None:
    old.kill()
    old.wait()


def test_a_request_runs_in_another_process_and_errors_come_back_by_name():
  first = workers.run({"call": (__name__, "pid"), "args": {}})
  assert first != os.getpid() and first == workers._thread.proc.pid
  assert workers.run({"call": (__name__, "pid"), "args": {}}) == first      # kept
  with pytest.raises(RuntimeError, match="No module named 'no_such_module'"):
    workers.run({"call": ("no_such_module", "f"), "args": {}})
  assert workers.run({"call": (__name__, "pid"), "args": {}}) == first      # still alive


def test_a_worker_that_dies_is_reported_and_replaced():
  proc = workers._worker_process()
  proc.kill()
  proc.wait()
  assert workers.run({"call": (__name__, "pid"), "args": {}}) != proc.pid


def test_a_request_that_cannot_be_pickled_sends_nothing():
  before = workers.run({"call": (__name__, "pid"), "args": {}})
  big = "x" * 200_000                  # over a pipe's buffer: a partial write would be visible
  with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
    workers.run({"call": (__name__, "echo"), "args": {"value": [big, lambda: 0]}})
  assert workers.run({"call": (__name__, "echo"), "args": {"value": "next"}}) == "next"
  assert workers._thread.proc.pid == before


def test_a_reply_later_than_the_time_limit_kills_the_worker(monkeypatch):
  """Deterministic on a loaded machine: the worker is started under the normal limit, the short
  limit times only a request that sleeps far longer (600 s), and the limit is back to normal
  before the next request starts a new worker (a start may take seconds)."""
  assert workers.run({"call": (__name__, "nap"), "args": {"seconds": 0}}) == 0
  monkeypatch.setattr(workers, "TIMEOUT_S", 2.0)
  with pytest.raises(RuntimeError, match="no reply in 2.0 s"):
    workers.run({"call": (__name__, "nap"), "args": {"seconds": 600}})
  assert workers._thread.proc.poll() is not None          # killed and reaped
  monkeypatch.undo()
  assert workers.TIMEOUT_S == 600
  assert workers.run({"call": (__name__, "nap"), "args": {"seconds": 0}}) == 0


def test_an_idle_worker_exits_and_the_next_request_starts_another(monkeypatch):
  """Deterministic: the request is in the worker's stdin before it starts waiting, so the idle
  limit only runs once it has replied; its exit is awaited with a generous 60 s."""
  monkeypatch.setattr(workers, "IDLE_S", 1.0)
  _fresh_process()
  first = workers.run({"call": (__name__, "pid"), "args": {}})
  proc = workers._thread.proc
  assert proc.wait(timeout=60) == 0            # exits by itself once idle
  assert workers.run({"call": (__name__, "pid"), "args": {}}) == workers._thread.proc.pid != first


def scaled(a, b, c):   # a generator expression: a nested code object
  return tuple(x * 2.5 for x in (a, b, c))


def test_code_hash_ignores_references_and_sees_changes():
  """The hash a worker compares does not change when something else holds a reference to one of
  the function's nested code objects (as JAX's tracebacks do once the function is traced; the
  marshal bytes do change), and does change with the code (a constant, a name, the bytecode)."""
  import marshal
  import types
  before, marshalled = workers._code_hash(scaled.__code__), marshal.dumps(scaled.__code__)
  held = [c for c in scaled.__code__.co_consts if isinstance(c, types.CodeType)]
  assert held and marshal.dumps(scaled.__code__) != marshalled
  assert workers._code_hash(scaled.__code__) == before
  for edited in ("tuple(x * 2.0 for x in (a, b, c))", "tuple(y * 2.5 for y in (a, b, c))",
                 "tuple(x / 2.5 for x in (a, b, c))", "list(x * 2.5 for x in (a, b, c))"):
    space = {}
    exec(f"def scaled(a, b, c):\n  return {edited}\n", space)
    assert workers._code_hash(space["scaled"].__code__) != before, edited


def test_the_worker_resolves_the_callers_function_or_refuses():
  recipe = workers.recipe(nap)
  assert recipe["module"] == __name__ and recipe["name"] == "nap"
  assert workers.resolve(recipe) is nap
  with pytest.raises(ValueError, match="imports .* from .*, the caller from /elsewhere.py"):
    workers.resolve(dict(recipe, file="/elsewhere.py"))
  with pytest.raises(ValueError, match="differs from the caller's"):
    workers.resolve(dict(recipe, code=workers.recipe(echo)["code"]))
  assert workers.recipe(lambda: 0) is None                       # not reachable by name
  patched = lambda seconds: seconds                              # a module attribute rebound:
  module = sys.modules[__name__]
  saved, module.nap = module.nap, patched
  try:
    assert workers.recipe(saved) is None                         # the old object is not it
  finally:
    module.nap = saved


def test_the_worker_search_path_puts_the_package_first_and_names_the_current_directory(monkeypatch):
  monkeypatch.setattr(sys, "path", ["", "/some/where"] + sys.path)
  path = workers.search_path()
  assert path[0] == workers._PACKAGE_ROOT
  assert os.getcwd() in path and "" not in path
  assert path.index(os.getcwd()) < path.index("/some/where")
