"""The jax-triton Adam kernel's leaf size as a runtime argument vs a constexpr: step time and
Triton compiles (GPU).

For each SIZE_ARG setting of pallas_kernels/adam_step_triton.py ("constexpr": the old kernel, one
Triton compile per leaf size, masked; "runtime": the size an int argument, no masks where the
leaf fills whole tiles; "runtime_masked": an int argument, always masked) and each kernel variant
(the row kernel, group_axis -1; the column kernel, group_axis -2, per --cols-tiles tile), every
leaf of --leaves (default: OLMo-1B's scanned step, and 4096 x 11008) is stepped by a jitted
adam_step (param and moments donated, fast_math + alias as coat_adamw calls it, E4M3 moments with
expansion). Before each setting the jax caches and jax-triton's compiled-kernel cache are cleared,
so its compiles are counted (len(jax_triton.triton_lib._COMPILED_KERNEL_CACHE)) and timed
(lowering + XLA compile of the first call, summed over leaves: the Triton compile is in the
lowering). Times per leaf: "synced ms", the median of --calls calls each ended by
block_until_ready, best of --repeats; "pipelined ms", the mean per call of --calls back-to-back
calls (one block at the end: the GPU time once dispatch overlaps), best of --repeats;
--profile adds the GPU kernel time per call from a profiler trace.

  python3 benchmarks/bench_adam_triton.py                                 # ~2 min on an H100
  python3 benchmarks/bench_adam_triton.py --axes cols --cols-tiles 16x4,32x4,64x8 --profile
"""
from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp

from _common import kernel_times, time_calls
from coat_jax import formats, kernels_adam
from coat_jax.expansion import quantize_expanded
from pallas_kernels import adam_step_triton as at

LEAVES = [(16, 2048, 2048), (16, 2048, 8192), (16, 8192, 2048), (50304, 2048), (16, 2048),
          (4096, 11008)]
FORMAT = "e4m3"
GROUP = formats.OPTIMIZER_GROUP_SIZE   # 128
AXES = {"rows": -1, "cols": -2}


def step_fn(group_axis: int):
  """The jitted one-leaf step (p, g, m, v) -> (p, m, v), p / m / v donated, as
  coat_jax.kernels_adam calls the kernel (fast_math, alias, the format limits)."""
  limits = kernels_adam.adam_kernel_limits(FORMAT, FORMAT)
  fmax = formats.get_format(FORMAT).max
  static = dict(m_fmax=fmax, v_fmax=fmax, m_log2_range=limits["m_log2_range"],
                v_log2_range=limits["v_log2_range"], max_k_code=limits["max_code"],
                amax_floor=limits["floor"], grad_clamp=limits["grad_clamp"], group_size=GROUP,
                expand=True, expand_min=16, output="param", alias=True, fast_math=True,
                group_axis=group_axis, lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)

  def step(p, g, m, v):
    out = at.adam_step(p, g, *m, *v, count=jnp.int32(7), **static)
    return out[0], out[1:4], out[4:7]

  return jax.jit(step, donate_argnums=(0, 2, 3))


def leaf_state(shape, group_axis: int, seed: int):
  """(param, grad, m, v) of one leaf: float32 param ~ 0.02 N(0, 1), grad ~ 1e-3 N(0, 1), E4M3
  moments (m ~ 1e-3 N, v ~ 1e-6 U) quantized along group_axis."""
  kp, kg, km, kv = jax.random.split(jax.random.key(seed), 4)
  quant = jax.jit(lambda x: tuple(quantize_expanded(x, FORMAT, GROUP, axis=group_axis)))
  p = jax.random.normal(kp, shape, jnp.float32) * 0.02
  g = jax.random.normal(kg, shape, jnp.float32) * 1e-3
  m = quant(jax.random.normal(km, shape, jnp.float32) * 1e-3)
  v = quant(jax.random.uniform(kv, shape, jnp.float32) * 1e-6)
  return jax.block_until_ready((p, g, m, v))


def time_leaf(step, state, calls: int, repeats: int, profile: bool) -> dict:
  """Synced and pipelined ms per call (best of `repeats`), GPU kernel ms per call (profile)."""
  p, g, m, v = state
  synced, piped = [], []
  p, m, v = jax.block_until_ready(step(p, g, m, v))   # warm-up
  chained = [(p, g, m, v)]   # the donated state moves on with every call

  def next_args(out):
    if out is not None:
      chained[0] = (out[0], g, out[1], out[2])
    return chained[0]

  for _ in range(repeats):
    synced.append(time_calls(step, next_args, calls, warmup=0))
    p, _, m, v = chained[0]
    t0 = time.perf_counter()
    for _ in range(calls):
      p, m, v = step(p, g, m, v)
    jax.block_until_ready((p, m, v))
    piped.append((time.perf_counter() - t0) * 1e3 / calls)
    chained[0] = (p, g, m, v)
  out = dict(synced=min(synced), piped=min(piped), kernel=None)
  if profile:
    with tempfile.TemporaryDirectory() as trace_dir:
      with jax.profiler.trace(trace_dir):
        for _ in range(10):
          p, m, v = step(p, g, m, v)
        jax.block_until_ready((p, m, v))
      times = kernel_times(trace_dir)
    adam = {k: us for k, us in times.items() if "adam" in k.lower()}
    out["kernel"] = sum(adam.values()) / 10 / 1e3 if adam else None
  return out


def run_setting(size_arg: str, axis: str, tile, leaves, args) -> list[dict]:
  """Every leaf (that the variant takes) stepped under one SIZE_ARG and tile, caches cleared
  first; returns one row per leaf with its compile count delta and compile seconds."""
  import jax_triton
  cache = jax_triton.triton_lib._COMPILED_KERNEL_CACHE
  at.SIZE_ARG = size_arg
  if tile is not None:
    at.COLS_BLOCK, at.COLS_WARPS = tile
  jax.clear_caches()
  cache.clear()
  group_axis = AXES[axis]
  step = step_fn(group_axis)
  rows = []
  for i, shape in enumerate(leaves):
    if at.problem(shape, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e4m3fn, GROUP,
                  group_axis) is not None:
      continue
    state = leaf_state(shape, group_axis, seed=i)
    before = len(cache)
    t0 = time.perf_counter()
    step.lower(*state).compile()
    compile_s = time.perf_counter() - t0
    row = dict(size_arg=size_arg, axis=axis, tile=tile, shape=shape,
               compiles=len(cache) - before, compile_s=compile_s)
    row.update(time_leaf(step, state, args.calls, args.repeats, args.profile))
    del state
    rows.append(row)
    print(f"  {size_arg} {axis} {tile_name(tile)} {shape}: {row['compiles']} Triton compiles, "
          f"{compile_s:.2f} s compile, {row['synced']:.3f} ms synced, {row['piped']:.3f} ms "
          f"pipelined" + ("" if row["kernel"] is None else f", {row['kernel']:.3f} ms kernel"),
          flush=True)
  return rows


def tile_name(tile) -> str:
  return "-" if tile is None else f"{tile[0]}x{tile[1]}w"


def summarize(rows: list[dict]) -> None:
  """Per setting: Triton compiles and compile seconds in all, summed step ms; per leaf: ms."""
  key = lambda r: (r["axis"], tile_name(r["tile"]), r["size_arg"])
  settings = list(dict.fromkeys(key(r) for r in rows))
  print("\n| kernel | tile | SIZE_ARG | Triton compiles | compile s | synced ms (sum) | "
        "pipelined ms (sum) | kernel ms (sum) |")
  print("|---|---|---|---|---|---|---|---|")
  for s in settings:
    rs = [r for r in rows if key(r) == s]
    kern = [r["kernel"] for r in rs]
    kern_s = "-" if None in kern else f"{sum(kern):.3f}"
    print(f"| {s[0]} | {s[1]} | {s[2]} | {sum(r['compiles'] for r in rs)} | "
          f"{sum(r['compile_s'] for r in rs):.2f} | {sum(r['synced'] for r in rs):.3f} | "
          f"{sum(r['piped'] for r in rs):.3f} | {kern_s} |")
  size_args = list(dict.fromkeys(r["size_arg"] for r in rows))
  print("\n| kernel | tile | leaf | " + " | ".join(f"{a} pipelined ms" for a in size_args) + " |")
  print("|---|---|---|" + "---|" * len(size_args))
  for axis, tile in dict.fromkeys((r["axis"], tile_name(r["tile"])) for r in rows):
    for shape in dict.fromkeys(r["shape"] for r in rows if r["axis"] == axis):
      cells = []
      for a in size_args:
        r = [r for r in rows if (r["axis"], tile_name(r["tile"]), r["shape"], r["size_arg"])
             == (axis, tile, shape, a)]
        cells.append(f"{r[0]['piped']:.4f}" if r else "-")
      print(f"| {axis} | {tile} | {shape} | " + " | ".join(cells) + " |")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size-args", default="constexpr,runtime",
                      help=f"comma-separated SIZE_ARG settings of {at.SIZE_ARGS}")
  parser.add_argument("--axes", default="rows,cols", help="kernels: rows (group_axis -1), cols")
  parser.add_argument("--cols-tiles", default="",
                      help="column tiles BLOCKxWARPS,... (default the kernel's COLS_BLOCK / "
                           "COLS_WARPS)")
  parser.add_argument("--leaves", default=";".join(",".join(map(str, s)) for s in LEAVES),
                      help="leaf shapes, ';'-separated, e.g. '4096,11008;16,2048'")
  parser.add_argument("--calls", type=int, default=30)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--profile", action="store_true", help="GPU kernel time per call too")
  args = parser.parse_args(argv)
  if not at.available():
    parser.error("needs triton and jax-triton on a GPU")
  size_args = [s.strip() for s in args.size_args.split(",") if s.strip()]
  axes = [a.strip() for a in args.axes.split(",") if a.strip()]
  if not set(size_args) <= set(at.SIZE_ARGS) or not set(axes) <= set(AXES):
    parser.error(f"--size-args from {at.SIZE_ARGS}, --axes from {list(AXES)}")
  try:
    tiles = (at.parse_cols_tiles(args.cols_tiles)
             or [(at.COLS_BLOCK, at.COLS_WARPS)])
  except ValueError as e:
    parser.error(str(e))
  leaves = [tuple(int(x) for x in s.split(",")) for s in args.leaves.split(";") if s.strip()]
  print(f"device: {jax.devices()[0].device_kind}; leaves {leaves}", flush=True)
  rows = []
  for axis in axes:
    for tile in (tiles if axis == "cols" else [None]):
      for size_arg in size_args:
        rows += run_setting(size_arg, axis, tile, leaves, args)
  summarize(rows)
  return rows


if __name__ == "__main__":
  main()
