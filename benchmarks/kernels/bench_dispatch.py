"""Host cost of a jitted call per buffer: how much of an optimizer step's wall time is dispatch.

A step over a parameter tree passes every leaf's buffers (optax.adamw: param, grad, mu, nu in and
param, mu, nu out; coat_adamw: each moment is three arrays, codes, scales and k codes). This times
one jitted call `xs -> [x + 1 for x in xs]` over N float32 arrays of 16 elements (the GPU work:
a few tiny fused kernels), blocked, with and without donating the inputs, for several N, and fits
the time per buffer (in + out). Prints a table; the slope is what each extra buffer costs a
blocked call (host work per argument and result, with the tiny kernels' share).

  python -m benchmarks.kernels.bench_dispatch                  # GPU
  JAX_PLATFORMS=cpu python -m benchmarks.kernels.bench_dispatch --steps 5 --counts 8,64   # smoke check
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import time_calls


def time_call(n: int, donate: bool, steps: int) -> float:
  """Median ms of one blocked call over n arrays of 16 float32 (fresh inputs when donated)."""
  rng = np.random.default_rng(n)
  base = [jnp.asarray(rng.standard_normal(16), jnp.float32) for _ in range(n)]
  f = jax.jit(lambda xs: [x + 1 for x in xs], donate_argnums=(0,) if donate else ())
  fresh = (lambda _: ([x.copy() for x in base],)) if donate else (lambda _: (base,))
  return time_calls(f, fresh, steps)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--counts", default="62,248,434,930",
                      help="input array counts (62 leaves x 1 / 4 / 7 / 15 arrays)")
  parser.add_argument("--steps", type=int, default=50, help="timed calls per point")
  args = parser.parse_args()
  counts = [int(c) for c in args.counts.split(",")]
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind} ({dev.platform}); steps: {args.steps}", flush=True)
  print("| arrays in | buffers (in + out) | ms, not donated | ms, donated |")
  print("|---|---|---|---|")
  points = {False: [], True: []}
  for n in counts:
    row = [time_call(n, donate, args.steps) for donate in (False, True)]
    for donate, ms in zip((False, True), row):
      points[donate].append((2 * n, ms))
    print(f"| {n} | {2 * n} | {row[0]:.3f} | {row[1]:.3f} |", flush=True)
  for donate, pts in points.items():
    if len(pts) > 1:
      x, y = np.array(pts).T
      slope, icpt = np.polyfit(x, y, 1)
      print(f"{'donated' if donate else 'not donated'}: {slope * 1e3:.2f} us per buffer, "
            f"{icpt * 1e3:.0f} us per call")


if __name__ == "__main__":
  main()
