"""Optimizer step time and state bytes: optax.adamw vs coat_adamw (jnp reference; Pallas if present).

Parameters as in /work/shared/gpu_notes.md: 56 x (4096, 4096) + 6 x (4096, 11008) float32 =
1.21e9 (scaled by --scale on the row count), random gradients, on the default device. Each step is
one jitted call `(params, state, grads) -> (params, state)` with params, state and grads donated
(inside a train step the gradients are temporaries, so a kernel may write over them; each call gets
a fresh copy, made before its timer starts); the median over --steps timed calls (after warm-up,
each ended by block_until_ready) is reported. --profile also prints each optimizer's top GPU
kernels (device time per step) and counts the copies in its compiled HLO.

The byte floor is the bytes a step must move per param (read param, grad and state; write param
and state) divided by the copy bandwidth measured here (a jitted x + 1 over a large array, read +
write counted).

  python benchmarks/bench_optimizer.py                       # GPU, full size
  JAX_PLATFORMS=cpu python benchmarks/bench_optimizer.py --scale 0.001 --steps 3   # smoke check
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

from _common import kernel_times, time_calls
from coat_jax import kernels
from coat_jax.optim import coat_adamw, coat_adamw_apply, optimizer_state_bytes

SHAPES = [(4096, 4096)] * 56 + [(4096, 11008)] * 6


def make_tree(shapes, key, scale_value):
  keys = jax.random.split(key, len(shapes))
  return {f"p{i:02d}": jax.random.normal(k, s, jnp.float32) * scale_value
          for i, (k, s) in enumerate(zip(keys, shapes))}


def copy_bandwidth(n_bytes: int, steps: int) -> float:
  """Bytes/s of a jitted x + 1 (float32, read + write counted) over an array of n_bytes."""
  x = jnp.zeros((n_bytes // 4,), jnp.float32)
  add = jax.jit(lambda x: x + 1.0, donate_argnums=0)
  ms = time_calls(add, lambda out: (x,) if out is None else (out,), steps)
  return 2 * (n_bytes // 4) * 4 / (ms * 1e-3)


def bench_optimizer(name, opt, params_fn, grads, steps, profile=False):
  """Returns (ms per step, state bytes per param) for one optimizer; frees its buffers."""
  params = params_fn()
  n = sum(p.size for p in jax.tree.leaves(params))
  state = jax.jit(opt.init if hasattr(opt, "init") else coat_adamw(1e-3).init)(params)
  state_bytes = optimizer_state_bytes(state)

  def _step(params, state, grads):
    if callable(opt) and not hasattr(opt, "update"):  # coat_adamw_apply: one pass to new params
      return opt(grads, state, params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(_step, donate_argnums=(0, 1, 2))
  fresh_grads = lambda: jax.tree.map(jnp.copy, grads)
  carry = {"args": (params, state, fresh_grads())}

  def next_args(out):
    if out is not None:
      carry["args"] = (out[0], out[1], fresh_grads())
    return carry["args"]

  if profile:
    hlo = step.lower(*carry["args"]).compile().as_text()
    print(f"  {name}: compiled HLO has {hlo.count(' copy(')} copy ops, "
          f"{hlo.count('custom-call(')} custom calls", flush=True)
    for line in [ln for ln in hlo.splitlines() if " copy(" in ln][:2]:
      print(f"    {line.strip()[:160]}")
  ms = time_calls(step, next_args, steps)
  device_ms = None
  if profile:  # one traced step, its inputs (fresh grads) made before the trace starts
    import tempfile
    args = jax.block_until_ready(next_args(None))
    with tempfile.TemporaryDirectory() as trace_dir:
      with jax.profiler.trace(trace_dir):
        out = jax.block_until_ready(step(*args))
      times = kernel_times(trace_dir)
    next_args(out)
    device_ms = sum(times.values()) / 1e3
    print(f"  {name}: GPU kernel time {device_ms:.2f} ms/step; top kernels (ms):")
    for kname, us in sorted(times.items(), key=lambda kv: -kv[1])[:5]:
      print(f"    {us / 1e3:8.3f}  {kname[:90]}")
  del carry, params, state
  print(f"  {name}: {ms:.2f} ms/step", flush=True)
  return ms, state_bytes / n, device_ms


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--scale", type=float, default=1.0,
                      help="fraction of the 1.21e9 params (scales each matrix's row count)")
  parser.add_argument("--steps", type=int, default=10, help="timed steps per optimizer")
  parser.add_argument("--profile", action="store_true",
                      help="also print top GPU kernels per step and HLO copy counts")
  args = parser.parse_args()

  rows = lambda r: max(1, round(r * args.scale))
  shapes = [(rows(r), c) for r, c in SHAPES]
  n = sum(r * c for r, c in shapes)
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind} ({dev.platform}); params: {n:.4g} float32 "
        f"({len(shapes)} matrices); steps: {args.steps}", flush=True)
  key_p, key_g = jax.random.split(jax.random.key(0))
  params_fn = lambda: make_tree(shapes, key_p, 0.02)
  grads = make_tree(shapes, key_g, 1e-3)

  bw = copy_bandwidth(min(1 << 30, n * 4), args.steps)
  print(f"copy bandwidth (x + 1, read + write): {bw / 1e12:.3f} TB/s", flush=True)

  configs = [("optax.adamw", lambda: optax.adamw(1e-3, weight_decay=1e-4), "reference"),
             ("coat_adamw (jnp)", lambda: coat_adamw(1e-3), "reference")]
  if kernels.use_pallas("adam") or jax.default_backend() != "gpu":
    configs += [("coat_adamw (pallas)", lambda: coat_adamw(1e-3), "pallas"),
                ("coat_adamw_apply (pallas, one pass)", lambda: coat_adamw_apply(1e-3), "pallas")]
  rows_out = []
  for name, make, backend in configs:
    with kernels.backend(backend):
      ms, bpp, device_ms = bench_optimizer(name, make(), params_fn, grads, args.steps,
                                           args.profile)
    # read param + grad + state, write param + state (float32 params and grads)
    moved = 4 + 4 + 4 + 2 * bpp
    if name.startswith("coat_adamw (pallas"):  # the kernel writes the update; apply_updates reads it
      moved += 4 + 4 + 4
    floor_ms = moved * n / bw * 1e3
    rows_out.append((name, ms, bpp, moved, floor_ms, device_ms))

  base, base_dev = rows_out[0][1], rows_out[0][5]
  print()
  dev_cols = " | GPU kernel ms | kernel ms vs optax.adamw" if args.profile else ""
  print(f"| optimizer | ms / step | state bytes / param | bytes moved / param | byte floor ms "
        f"| x floor | speed vs optax.adamw{dev_cols} |")
  print("|---|---|---|---|---|---|---|" + ("---|---|" if args.profile else ""))
  for name, ms, bpp, moved, floor_ms, device_ms in rows_out:
    dev = (f" {device_ms:.2f} | {device_ms / base_dev:.2f}x |" if args.profile and device_ms
           and base_dev else (" - | - |" if args.profile else ""))
    print(f"| {name} | {ms:.2f} | {bpp:.3f} | {moved:.2f} | {floor_ms:.2f} | "
          f"{ms / floor_ms:.2f} | {base / ms:.2f}x |{dev}")

if __name__ == "__main__":
  main()
