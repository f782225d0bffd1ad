"""Divergence: non-finite losses and gradient norms in a run, and non-finite checkpoint states.

`NonFiniteGuard` reads the per-step loss and gradient norm that the loop fetches anyway (at log
steps and before each checkpoint, so no extra device sync per step) and applies
`run.on_nonfinite`: "stop" raises DivergedError (exit status 3) at the first non-finite step;
"skip" counts the steps the train step left unapplied (build.make_steps' `skip_nonfinite`) and
raises once `max_in_row` come in a row. `check_finite` guards every checkpoint: one fused
reduction on the device over the state's floating leaves.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from coat_jax.errors import DivergedError


class NonFiniteGuard:
  """Applies `policy` ("stop" | "skip") to (step, {"loss", "grad_norm"}) records, in step order.

  Attributes: skipped (steps skipped in all), in_row (non-finite steps in a row up to the last
  checked one).
  """

  def __init__(self, policy: str, max_in_row: int, where: str, say: Callable[[str], None]):
    self.policy, self.max_in_row, self.where, self.say = policy, max_in_row, where, say
    self.skipped = 0
    self.in_row = 0

  def check(self, records: list[tuple[int, dict]]) -> None:
    for step, out in records:
      loss, grad_norm = float(out["loss"]), float(out["grad_norm"])
      if math.isfinite(loss) and math.isfinite(grad_norm):
        self.in_row = 0
        continue
      self.in_row += 1
      what = f"step {step}: loss {loss}, gradient norm {grad_norm}"
      if self.policy == "stop":
        raise DivergedError(f"{what}: the run diverged (run.on_nonfinite=stop); no checkpoint "
                            f"of it was written, the newest in {self.where} is the last good one")
      self.skipped += 1
      if self.in_row >= self.max_in_row:
        raise DivergedError(f"{what}: {self.in_row} non-finite steps in a row "
                            f"(run.max_nonfinite_steps={self.max_in_row}): the run diverged; the "
                            f"newest checkpoint in {self.where} is the last good one")
      self.say(f"[run] {what}: update skipped ({self.in_row} in a row, run.on_nonfinite=skip)")


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def nonfinite_leaves(flat: dict[str, Any]) -> list[str]:
  """The keys of the floating leaves of a flat {key: array} dict that hold a NaN or an infinity."""
  keys = [k for k, x in flat.items()
          if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)]
  if not keys:
    return []
  ok = np.asarray(_all_finite([flat[k] for k in keys]))
  return [k for k, good in zip(keys, ok) if not good]


def check_finite(flat: dict[str, Any], what: str) -> None:
  """Raises DivergedError naming `what` and the first non-finite leaf of `flat`."""
  bad = nonfinite_leaves(flat)
  if bad:
    raise DivergedError(f"{what}: {len(bad)} of the state's arrays hold NaN or infinite values "
                        f"(e.g. {bad[0]}); not written")
