"""Walking a jaxpr for the tests that count or find equations in a traced program."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import jax


def equations(jaxpr, stop: Callable | None = None) -> Iterator:
  """Every equation of `jaxpr` (closed or not) and of its sub-jaxprs (custom_vjp, jit, loops,
  kernels), depth first in program order. An equation for which `stop(eqn)` is true is yielded
  but not entered (e.g. a kernel call, whose body is not part of the program's own ops)."""
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    yield eqn
    if stop is not None and stop(eqn):
      continue
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from equations(sub, stop)
