"""Pieces the benchmark scripts share: timing, time budgets, plotting and `--modes` parsing.
Two siblings hold the rest: `_moments.py` (FP8 round trips of optimizer moments as the device
rounds them) and `_hlo.py` (compiled train steps and their optimized HLO).

The scripts run as modules from the repository root, `python -m benchmarks.KIND.SCRIPT ...`
(benchmarks/README.md), so `from benchmarks._common import ...` needs no path manipulation; a
script starts a child of itself with `module_command(__file__)` (working directory: REPO). No
script imports another; the shared modules are the underscored ones.
"""
from __future__ import annotations

import argparse
import collections
import glob
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

# Dense peaks of the GPUs the floors are counted against (NVIDIA's SXM datasheets, no sparsity):
# FP8 and bf16 tensor-core FLOP/s, HBM bytes/s. The datasheet bandwidth is not reached: on an H200
# (2026-11-26, `python -m benchmarks.step.bench_optimizer`) the benchmark's best copy-like stream
# moved 3.878 TB/s and the row Adam kernel 3.92 TB/s; step_floor.py takes a measured value as
# `--hbm-tbps`.
# The optimizer benchmarks' parameter tree (bench_optimizer, adam_layout_floor, step_floor's
# optimizer row): a Llama-2-7B-width tree of float32 matrices, 1.21e9 parameters.
OPTIMIZER_SHAPES = [(4096, 4096)] * 56 + [(4096, 11008)] * 6

GPU_PEAKS = {
    "h100": {"name": "H100 SXM", "fp8_flops": 1979e12, "bf16_flops": 989e12,
             "hbm_bytes_per_s": 3.35e12},
    "h200": {"name": "H200 SXM", "fp8_flops": 1979e12, "bf16_flops": 989e12,
             "hbm_bytes_per_s": 4.8e12},
}


def gpu_peaks(device_kind: str) -> dict:
  """GPU_PEAKS of a device (its `device_kind`, e.g. "NVIDIA H200"): the H200's where the name says
  H200, else the H100's."""
  return GPU_PEAKS["h200" if "h200" in device_kind.lower() else "h100"]

# One color per (precision + optimizer) mode in every plot.
MODE_COLORS = {"bf16+adamw": "tab:blue", "fp8_linear+adamw": "tab:green", "coat+coat_adamw": "tab:red"}


def parse_modes(parser: argparse.ArgumentParser, text: str, choices: Sequence[str],
                extra: Sequence[str] = ()) -> list[str]:
  """The comma-separated `--modes` value as a list; exits through `parser.error` naming any mode
  (of the list or of `extra`) not in `choices`."""
  modes = [m.strip() for m in text.split(",") if m.strip()]
  bad = [m for m in [*modes, *extra] if m not in choices]
  if bad:
    parser.error(f"unknown modes {bad}; choose from {tuple(choices)}")
  return modes


def parse_shapes(parser: argparse.ArgumentParser, option: str, text: str, form: str,
                 named: dict[str, list[tuple[int, ...]]] | None = None) -> list[tuple[int, ...]]:
  """The comma-separated value of `option` as shapes: each item a key of `named` (its list of
  shapes) or positive integers joined by "x" as `form` spells them ("MxNxK": three); exits
  through `parser.error` naming the first item that is neither."""
  named = named or {}
  want = f"one of {sorted(named)} or {form}" if named else form
  shapes = []
  for item in text.split(","):
    if item in named:
      shapes += named[item]
      continue
    try:
      dims = tuple(int(v) for v in item.split("x"))
    except ValueError:
      dims = ()
    if len(dims) != len(form.split("x")) or min(dims) <= 0:
      parser.error(f"{option}: {item!r} is not {want}")
    shapes.append(dims)
  return shapes


# ----------------------------------------------------------------------------------------------
# Timing.


def median_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
  """Median milliseconds of one blocking `fn()` call over `iters` calls after `warmup` calls."""
  import jax

  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def median_ms_back_to_back(fn: Callable, *args, iters: int = 10, repeats: int = 7) -> float:
  """Median over `repeats` of the mean milliseconds per call of `iters` back-to-back `fn(*args)`
  calls (one block at the end: hides dispatch gaps of short kernels)."""
  import jax

  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(iters)]
    jax.block_until_ready(outs)
    times.append((time.perf_counter() - t0) / iters)
  return 1e3 * statistics.median(times)


def time_calls(fn: Callable, args_fn: Callable, steps: int, warmup: int = 2,
               returned: list | None = None) -> float:
  """Median milliseconds of fn(*args) over `steps` calls; args_fn(out) gives the next call's args
  (args_fn(None) the first), so donated or stateful calls can chain. `returned`, if given, gets
  each timed call's milliseconds until fn returned (before the block: the host's share)."""
  import jax

  args = args_fn(None)
  for _ in range(warmup):
    out = fn(*args)
    jax.block_until_ready(out)
    args = args_fn(out)
  times = []
  for _ in range(steps):
    jax.block_until_ready(args)
    t0 = time.perf_counter()
    out = fn(*args)
    if returned is not None:
      returned.append((time.perf_counter() - t0) * 1e3)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) * 1e3)
    args = args_fn(out)
  return statistics.median(times)


def load_trace(trace_dir: str):
  """The newest jax.profiler trace (*.xplane.pb) under trace_dir, read (jax.profiler.ProfileData);
  ValueError if there is none."""
  import jax

  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  if not paths:
    raise ValueError(f"no profiler trace (*.xplane.pb) under {trace_dir}")
  return jax.profiler.ProfileData.from_file(paths[-1])


def gpu_kernel_events(data):
  """(GPU plane name, event) of every kernel in a read trace: the events of the GPU planes'
  stream lines (kernel lines are per CUDA stream)."""
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if "stream" in line.name.lower():
        for ev in line.events:
          yield plane.name, ev


def kernel_times(trace) -> collections.Counter:
  """Microseconds per kernel name summed over the GPU planes of a trace: a trace directory (its
  newest trace) or a trace already read by `load_trace`."""
  data = load_trace(trace) if isinstance(trace, (str, os.PathLike)) else trace
  out = collections.Counter()
  for _, ev in gpu_kernel_events(data):
    out[ev.name] += ev.duration_ns / 1e3
  if not out:
    print("no GPU kernel events; planes/lines:",
          [(pl.name, [ln.name for ln in pl.lines][:6]) for pl in data.planes][:8])
  return out


def device_ms_per_call(fn: Callable, *args, iters: int = 20) -> float:
  """GPU milliseconds per call of `fn(*args)`: the device time of every kernel in a profiler trace
  of `iters` back-to-back calls (after one untraced call), summed and divided by `iters`. No host
  dispatch or launch gap counts, so a call of a few tens of microseconds is measured as the GPU
  runs it. ValueError where the trace has no GPU kernel (a CPU run)."""
  import jax

  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    try:
      jax.block_until_ready([fn(*args) for _ in range(iters)])
    finally:
      jax.profiler.stop_trace()
    total_us = sum(kernel_times(trace_dir).values())
  if not total_us:
    raise ValueError("device time: the profiler trace has no GPU kernel (it needs a GPU)")
  return total_us / iters / 1e3


class Budget:
  """Wall-clock budget of a whole script: `seconds` (None: unlimited) less a `reserve` for the
  final report."""

  def __init__(self, seconds: float | None, reserve: float = 10.0):
    self.t0, self.seconds, self.reserve = time.time(), seconds, reserve

  def deadline(self) -> float | None:
    """The time.time() by which the work must end, or None."""
    return None if self.seconds is None else self.t0 + self.seconds - self.reserve

  def left(self) -> float:
    d = self.deadline()
    return math.inf if d is None else d - time.time()

  def elapsed(self) -> float:
    return time.time() - self.t0


# ----------------------------------------------------------------------------------------------
# Plotting.


def pyplot():
  """matplotlib.pyplot on the file-only Agg backend."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def save_figure(fig, path) -> bool:
  """Lays out, writes and closes `fig`; True (the scripts' "plot written" result)."""
  import matplotlib.pyplot as plt

  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return True


# ----------------------------------------------------------------------------------------------
# Child processes.

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_command(script: str) -> list[str]:
  """[python, -m, the script's module]: the command that runs the benchmark script at path
  `script` (a child of itself), from the working directory REPO."""
  rel = os.path.relpath(os.path.splitext(os.path.abspath(script))[0], REPO)
  return [sys.executable, "-m", ".".join(rel.split(os.sep))]



def device_env(n: int, env: dict | None = None) -> dict:
  """Environment entries that give a child process the first `n` devices: CUDA_VISIBLE_DEVICES
  0..n-1 (a GPU machine) and, for a CPU run, n simulated host devices (XLA_FLAGS)."""
  env = dict(os.environ if env is None else env)
  flags = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                   if not f.startswith("--xla_force_host_platform_device_count"))
  return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(n)),
          "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={n}".strip()}


LINEAR_SWITCH = "linear."   # `--set linear.NAME=VALUE`: one of the FP8 linears' switches


def split_linear_switches(overrides: Sequence[str]) -> tuple[dict[str, str], list[str]]:
  """(the FP8 linears' switches, the other overrides) of `--set` items: `linear.NAME=VALUE` names
  a switch of `coat_jax.ops.linear_ablation.ablation` (not configuration: the benchmark sets it
  while the step is traced), every other item is a config key."""
  switches = dict(o[len(LINEAR_SWITCH):].split("=", 1) for o in overrides
                  if o.startswith(LINEAR_SWITCH))
  return switches, [o for o in overrides if not o.startswith(LINEAR_SWITCH)]


def config_parser(doc: str, default_config: str, set_help: str) -> argparse.ArgumentParser:
  """An argument parser (description: the script's docstring's first line) with the train.py
  config options every training-run script takes: --config (default configs/<default_config>)
  and repeatable --set KEY=VALUE overrides (args.overrides)."""
  p = argparse.ArgumentParser(description=doc.splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default=os.path.join(REPO, "configs", default_config))
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                 help=set_help)
  return p
