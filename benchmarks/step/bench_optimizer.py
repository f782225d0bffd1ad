"""Optimizer step time and state bytes: optax.adamw vs coat_adamw (optax chain) vs coat_adamw_apply.

Parameters of a Llama-2-7B-width tree: 56 x (4096, 4096) + 6 x (4096, 11008) float32 =
1.21e9 (scaled by --scale on the row count), random gradients, on the default device; --stacked
holds the same matrices as a scanned model (`model.scan_layers`, the default) does, stacked in 7
leaves (4 x (14, 4096, 4096) + 3 x (2, 4096, 11008)): one kernel launch per stacked leaf. Each step is
one jitted call `(params, state, grads) -> (params, state)` with params, state and grads donated
(inside a train step the gradients are temporaries, so a kernel may write over them; each call gets
a fresh copy, made before its timer starts); "wall ms" is the median over --steps timed calls
(after warm-up, each ended by block_until_ready), so it includes the host's dispatch of the call
(~4 us per buffer: 62 leaves x 8 buffers for coat). "pipelined ms" is the mean per call of --steps
back-to-back calls of the same step without donated gradients (the gradients are reused, so no
copies; one block at the end), as a training loop that does not wait for each step sees it: the
host's dispatch of a call overlaps the previous call's GPU work. --profile also prints each
optimizer's top GPU kernels (device time per step) and counts the copies in its compiled HLO.
Each row also prints the ms until a blocked-timed call returns to Python (the host's share).

Rows (--rows picks some; the default leaves out the per-leaf chains and the jnp reference):
optax.adamw; coat_adamw (writes the update, optax.apply_updates adds it); optax.adamw and
coat_adamw after clip_by_global_norm in an optax chain (the chain form of the README's first
example); coat_clip / apply_clip: coat_adamw / coat_adamw_apply with max_grad_norm=1.0, the same
clipping fused into the step (the README's first example: the global norm reads the gradient,
the kernel scales it as it loads it, no clipped gradient is written); coat_adamw_apply (one pass
writing the params). "per leaf": one kernel launch per parameter;
"packed state": coat_adamw(state_layout="packed"), the moments of all leaves in flat buffers (5
per moment, coat_jax/packed_state.py) instead of 6 arrays per leaf, one launch per leaf at its slot.
Group axis: the coat rows group along each matrix's last axis (group_axis="last"), except
coat_cols / apply_cols: every matrix grouped along axis -2 (COAT's layout for an (in, out)
kernel, coat_adamw's default for Flax kernels), stepped by the column kernel of
pallas_kernels/adam/adam_step_triton.py (G-row x BLOCK-column tiles, no transposes); compare
coat_cols with coat_leaf and apply_cols with apply_leaf. --cols-tiles repeats the column rows once
per tile of the column kernel: BLOCKxWARPS (G rows x BLOCK columns, WARPS warps); default
adam_step_triton's COLS_BLOCK / COLS_WARPS; --rows-tiles likewise for the row kernel's rows
(BLOCK rows of G per program; default ROWS_BLOCK / ROWS_WARPS). --scale keeps whole groups along axis
-2 only where the scaled row counts stay multiples of 128 (e.g. 0.25; 4096 x 0.001 = 4 rows pads
each group).

The byte floor is the bytes a step must move per param (read param, grad and state; write param
and state; a chain also reads the gradient for its norm and writes and reads the clipped gradient,
a fused clip (max_grad_norm) only reads it for its norm, and coat_adamw's update is written, then
read with the param by apply_updates) divided by the stream bandwidth measured here over as many
elements as params, read + write counted: the fastest of XLA's copy, a jitted x + 1 (which the
Adam kernels beat: neither is a floor on its own) and a Triton kernel streaming the FP8 step's
own bytes and mix (10 B read, 6 B written per element; `stream_bandwidths`). "wall / floor" and
"kernel / floor" say how far each row is from it.

  python -m benchmarks.step.bench_optimizer --profile              # GPU, full size
  python -m benchmarks.step.bench_optimizer --rows coat_leaf,coat_cols,apply_leaf,apply_cols --profile
  python -m benchmarks.step.bench_optimizer --rows coat_leaf,coat_cols --cols-tiles 16x4,32x4,32x8,64x8
  python -m benchmarks.step.bench_optimizer --rows optax_chain,chain_leaf,coat_clip,apply_clip --profile
  python -m benchmarks.step.bench_optimizer --rows optax,coat_leaf,coat_packed,apply_leaf,apply_packed
  JAX_PLATFORMS=cpu python -m benchmarks.step.bench_optimizer --scale 0.001 --steps 3   # smoke check
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import jax
import jax.numpy as jnp
import optax

from benchmarks._common import OPTIMIZER_SHAPES as SHAPES, kernel_times, time_calls
from coat_jax import kernels
from coat_jax.optim import coat_adamw, coat_adamw_apply, optimizer_state_bytes


def make_tree(shapes, key, scale_value):
  keys = jax.random.split(key, len(shapes))
  return {f"p{i:02d}": jax.random.normal(k, s, jnp.float32) * scale_value
          for i, (k, s) in enumerate(zip(keys, shapes))}


def stream_bandwidths(n: int, steps: int) -> dict[str, float]:
  """Bytes/s (read + write counted) of streams over n elements on the default device: "copy",
  XLA's copy of a float32 array (jnp.copy under jit: a new buffer); "x + 1", a jitted x + 1
  (donated: in place); "adam-shaped", a jax-triton kernel moving the FP8 Adam step's bytes (read
  a float32 param and gradient and two 1-byte codes, write the param and codes in place: 10 B
  read + 6 B written per element, 4096 elements per program in 16-byte vectors; GPU with
  jax-triton only). The byte floor uses the fastest: the streams of the step's own mix."""
  x = jax.random.normal(jax.random.key(1), (n,), jnp.float32)
  out = {}
  copy = jax.jit(jnp.copy)
  out["copy"] = 8 * n / (time_calls(copy, lambda _: (x,), steps) * 1e-3)
  add = jax.jit(lambda x: x + 1.0, donate_argnums=0)
  y = jnp.copy(x)
  out["x + 1"] = 8 * n / (time_calls(add, lambda r: (y,) if r is None else (r,), steps) * 1e-3)
  stream = _adam_shaped_stream()
  if stream is not None:
    args = (jnp.copy(x), x, jnp.ones((n,), jnp.uint8), jnp.ones((n,), jnp.uint8))
    ms = time_calls(stream, lambda r: args if r is None else (r[0], x, r[1], r[2]), steps)
    out["adam-shaped"] = 16 * n / (ms * 1e-3)
  return out


def _adam_shaped_stream():
  """A jitted (p, g, m, v) -> (p + g, m ^ 1, v ^ 1) through one streaming Triton kernel (p, m, v
  donated and written in place), or None without jax-triton."""
  from pallas_kernels.adam import adam_step_triton
  if not adam_step_triton.available():
    return None
  import jax_triton as jt
  import triton
  import triton.language as tl

  @triton.jit
  def stream_kernel(p_ptr, g_ptr, m_ptr, v_ptr, po_ptr, mo_ptr, vo_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(po_ptr + offs, tl.load(p_ptr + offs) + tl.load(g_ptr + offs))
    tl.store(mo_ptr + offs, tl.load(m_ptr + offs) ^ 1)
    tl.store(vo_ptr + offs, tl.load(v_ptr + offs) ^ 1)

  def stream(p, g, m, v):
    block = 4096
    return jt.triton_call(p, g, m, v, kernel=stream_kernel,
                          out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (p, m, v)],
                          grid=(-(-p.size // block),), num_warps=4, BLOCK=block,
                          input_output_aliases={0: 0, 2: 1, 3: 2})

  return jax.jit(stream, donate_argnums=(0, 2, 3))


def pipelined_ms(step, args, steps: int) -> tuple[float, tuple]:
  """Mean ms per call of `steps` back-to-back step(params, state, grads) calls (params and state
  chained, grads reused), one block at the end; returns it and the last (params, state)."""
  params, state, grads = args
  params, state = jax.block_until_ready(step(params, state, grads))   # warm-up (and compile)
  t0 = time.perf_counter()
  for _ in range(steps):
    params, state = step(params, state, grads)
  jax.block_until_ready((params, state))
  return (time.perf_counter() - t0) * 1e3 / steps, (params, state)


def bench_optimizer(name, opt, params_fn, grads, steps, profile=False, group_axis="last",
                    state_layout="leaves"):
  """Returns (wall ms, pipelined ms, state bytes per param, GPU kernel ms or None) for one
  optimizer; frees its buffers. group_axis, state_layout: the state's, for coat_adamw_apply (no
  init)."""
  params = params_fn()
  n = sum(p.size for p in jax.tree.leaves(params))
  init = opt.init if hasattr(opt, "init") else coat_adamw(
      1e-3, group_axis=group_axis, state_layout=state_layout).init
  state = jax.jit(init)(params)
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
  returned = []   # ms until each timed call returns (the host's work before the GPU has it all)
  ms = time_calls(step, next_args, steps, returned=returned)
  dispatch_ms = statistics.median(returned)
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
    print(f"  {name}: GPU kernel time {device_ms:.2f} ms/step, {len(times)} kernels; "
          f"top kernels (ms):")
    for kname, us in sorted(times.items(), key=lambda kv: -kv[1])[:5]:
      print(f"    {us / 1e3:8.3f}  {kname[:90]}")
  params, state, _ = next_args(None)
  carry.clear()
  piped, _ = pipelined_ms(jax.jit(_step, donate_argnums=(0, 1)), (params, state, grads), steps)
  del params, state
  print(f"  {name}: {ms:.2f} ms/step wall ({dispatch_ms:.2f} ms to return from the call), "
        f"{piped:.2f} ms pipelined", flush=True)
  return ms, piped, state_bytes / n, device_ms


def _chain(tx):
  return optax.chain(optax.clip_by_global_norm(1.0), tx)


def _columns(params):
  """group_axis callable: every leaf grouped along its first axis (COAT's layout for (in, out))."""
  return jax.tree.map(lambda _: -2, params)


# --rows key -> (label, make optimizer, kernel backend, bytes per param beyond the one-pass step's)
LAST = dict(group_axis="last")
PACKED = dict(state_layout="packed")
CONFIGS = {
    "optax": ("optax.adamw", lambda: optax.adamw(1e-3, weight_decay=1e-4), "reference", 0),
    "optax_chain": ("chain(clip, optax.adamw)",
                    lambda: _chain(optax.adamw(1e-3, weight_decay=1e-4)), "reference", 4),
    "coat_leaf": ("coat_adamw + apply_updates, per leaf", lambda: coat_adamw(1e-3, **LAST),
                  "adam=pallas", 12),
    "coat_cols": ("coat_adamw + apply_updates, per leaf, groups along axis -2 (column kernel)",
                  lambda: coat_adamw(1e-3, group_axis=_columns),
                  "adam=pallas", 12),
    "chain_leaf": ("chain(clip, coat_adamw), per leaf", lambda: _chain(coat_adamw(1e-3, **LAST)),
                   "adam=pallas", 4 + 8 + 12),
    "coat_clip": ("coat_adamw(max_grad_norm=1) + apply_updates, per leaf",
                  lambda: coat_adamw(1e-3, max_grad_norm=1.0, **LAST),
                  "adam=pallas", 4 + 12),
    "apply_leaf": ("coat_adamw_apply, per leaf", lambda: coat_adamw_apply(1e-3, **LAST),
                   "adam=pallas", 0),
    "apply_clip": ("coat_adamw_apply(max_grad_norm=1), per leaf",
                   lambda: coat_adamw_apply(1e-3, max_grad_norm=1.0, **LAST),
                   "adam=pallas", 4),
    "apply_cols": ("coat_adamw_apply, per leaf, groups along axis -2 (column kernel)",
                   lambda: coat_adamw_apply(1e-3, group_axis=_columns),
                   "adam=pallas", 0),
    "coat_packed": ("coat_adamw + apply_updates, packed state",
                    lambda: coat_adamw(1e-3, **LAST, **PACKED), "adam=pallas",
                    12),
    "apply_packed": ("coat_adamw_apply, packed state",
                     lambda: coat_adamw_apply(1e-3, **LAST, **PACKED),
                     "adam=pallas", 0),
    "apply_cols_packed": ("coat_adamw_apply, packed state, groups along axis -2 (column kernel)",
                          lambda: coat_adamw_apply(1e-3, group_axis=_columns, **PACKED),
                          "adam=pallas", 0),
    "apply_jnp": ("coat_adamw_apply, jnp reference", lambda: coat_adamw_apply(1e-3, **LAST),
                  "reference", 0),
}
COLUMN_ROWS = ("coat_cols", "apply_cols", "apply_cols_packed")
ROW_KERNEL_ROWS = ("coat_leaf", "chain_leaf", "coat_clip", "apply_leaf", "apply_clip",
                   "coat_packed", "apply_packed")
# --stacked: OPTIMIZER_SHAPES' 56 square and 6 wide matrices as a scanned model's stacked leaves
STACKED_SHAPES = [(14, 4096, 4096)] * 4 + [(2, 4096, 11008)] * 3
PACKED_ROWS = ("coat_packed", "apply_packed", "apply_cols_packed")
DEFAULT_ROWS = ["optax", "optax_chain", "coat_leaf", "chain_leaf", "apply_leaf"]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--scale", type=float, default=1.0,
                      help="fraction of the 1.21e9 params (scales each matrix's row count)")
  parser.add_argument("--steps", type=int, default=10, help="timed steps per optimizer")
  parser.add_argument("--profile", action="store_true",
                      help="also print top GPU kernels per step and HLO copy counts")
  parser.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                      help=f"comma-separated optimizers, of {list(CONFIGS)}")
  parser.add_argument("--stacked", action="store_true",
                      help="the same matrices stacked as a scanned model holds them: "
                           f"{STACKED_SHAPES} (7 leaves instead of 62)")
  parser.add_argument("--rows-tiles", default="",
                      help="row kernel tiles BLOCKxWARPS,... for the rows grouped along the last "
                           "axis (BLOCK rows of G; default: the kernel's ROWS_BLOCK / ROWS_WARPS)")
  parser.add_argument("--cols-tiles", default="",
                      help="column kernel tiles BLOCKxWARPS,... for the column rows (default: "
                           "the kernel's COLS_BLOCK / COLS_WARPS)")
  args = parser.parse_args()
  names = [r.strip() for r in args.rows.split(",") if r.strip()]
  bad = [r for r in names if r not in CONFIGS]
  if bad:
    parser.error(f"unknown --rows {bad}; choose from {list(CONFIGS)}")
  from pallas_kernels.adam import adam_step_triton
  try:
    tiles = adam_step_triton.parse_tiles(args.cols_tiles)
    row_tiles = adam_step_triton.parse_tiles(args.rows_tiles)
  except ValueError as e:
    parser.error(f"--cols-tiles / --rows-tiles: {e}")
  default_tile = (adam_step_triton.COLS_BLOCK, adam_step_triton.COLS_WARPS)
  default_row_tile = (adam_step_triton.ROWS_BLOCK, adam_step_triton.ROWS_WARPS)
  runs = []   # (row key, tile or None)
  for key in names:
    sweep = tiles if key in COLUMN_ROWS else row_tiles if key in ROW_KERNEL_ROWS else []
    runs += [(key, t) for t in sweep] if sweep else [(key, None)]

  rows = lambda r: max(1, round(r * args.scale))
  shapes = [(s[0], rows(s[1]), s[2]) for s in STACKED_SHAPES] if args.stacked else [
      (rows(r), c) for r, c in SHAPES]
  n = sum(math.prod(s) for s in shapes)
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind} ({dev.platform}); params: {n:.4g} float32 "
        f"({len(shapes)} leaves{', stacked' if args.stacked else ''}); steps: {args.steps}",
        flush=True)
  print(f"jax-triton kernel available: {adam_step_triton.available()}", flush=True)
  key_p, key_g = jax.random.split(jax.random.key(0))
  params_fn = lambda: make_tree(shapes, key_p, 0.02)
  grads = make_tree(shapes, key_g, 1e-3)

  bws = stream_bandwidths(n // 4096 * 4096, args.steps)
  bw = max(bws.values())
  print("stream bandwidth, read + write: " + ", ".join(
      f"{k} {v / 1e12:.3f} TB/s" for k, v in bws.items()) + f"; floor at {bw / 1e12:.3f} TB/s",
      flush=True)

  rows_out = []
  for key, tile in runs:
    name, make, backend, extra = CONFIGS[key]
    if key in COLUMN_ROWS:
      tile = tile or default_tile
      # the tile is read when the kernel is traced: clear the traces of the previous one
      adam_step_triton.COLS_BLOCK, adam_step_triton.COLS_WARPS = tile
      jax.clear_caches()
      name = f"{name}, tile {tile[0]} cols x {tile[1]} warps"
    elif key in ROW_KERNEL_ROWS and row_tiles:
      adam_step_triton.ROWS_BLOCK, adam_step_triton.ROWS_WARPS = tile
      jax.clear_caches()
      name = f"{name}, tile {tile[0]} rows x {tile[1]} warps"
    with kernels.backend(backend):
      ms, piped, bpp, device_ms = bench_optimizer(
          name, make(), params_fn, grads, args.steps, args.profile,
          group_axis=_columns if key in COLUMN_ROWS else "last",
          state_layout="packed" if key in PACKED_ROWS else "leaves")
    if tile is not None:  # later rows run at the kernels' default tiles
      adam_step_triton.COLS_BLOCK, adam_step_triton.COLS_WARPS = default_tile
      adam_step_triton.ROWS_BLOCK, adam_step_triton.ROWS_WARPS = default_row_tile
      jax.clear_caches()
    moved = 4 + 4 + 4 + 2 * bpp + extra  # read param + grad + state, write param + state
    floor_ms = moved * n / bw * 1e3
    rows_out.append((name, ms, piped, bpp, moved, floor_ms, device_ms))

  base = next((r for r in rows_out if r[0] == "optax.adamw"), rows_out[0])
  print()
  print(f"| optimizer | wall ms | pipelined ms | GPU kernel ms | wall vs {base[0]} | "
        f"kernel vs {base[0]} | state B / param | bytes moved / param | byte floor ms | "
        f"wall / floor | kernel / floor |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  fmt = lambda x, spec: "-" if x is None else format(x, spec)
  for name, ms, piped, bpp, moved, floor_ms, device_ms in rows_out:
    kernel_ratio = device_ms / base[6] if device_ms and base[6] else None
    print(f"| {name} | {ms:.2f} | {piped:.2f} | {fmt(device_ms, '.2f')} | {ms / base[1]:.2f}x | "
          f"{fmt(kernel_ratio, '.2f')}{'' if kernel_ratio is None else 'x'} | {bpp:.3f} | "
          f"{moved:.2f} | {floor_ms:.2f} | {ms / floor_ms:.2f}x | "
          f"{fmt(device_ms and device_ms / floor_ms, '.2f')}{'' if device_ms is None else 'x'} |")


if __name__ == "__main__":
  main()
