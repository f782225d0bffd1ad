"""Pieces the benchmark scripts share: timing, time budgets, plotting, `--modes` parsing, and
compiled train steps with their optimized HLO (ops and bytes per step, kernel -> instruction).

The scripts run as `python benchmarks/X.py`: their folder is on the import path by itself and
coat_jax is installed, so `from _common import ...` needs no path manipulation. No script imports
another.
"""
from __future__ import annotations

import argparse
import collections
import functools
import glob
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Sequence

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


def time_calls(fn: Callable, args_fn: Callable, steps: int, warmup: int = 2) -> float:
  """Median milliseconds of fn(*args) over `steps` calls; args_fn(out) gives the next call's args
  (args_fn(None) the first), so donated or stateful calls can chain."""
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
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) * 1e3)
    args = args_fn(out)
  return statistics.median(times)


def kernel_times(trace_dir: str) -> collections.Counter:
  """Microseconds per kernel name summed over the GPU planes of the newest profiler trace."""
  import jax

  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  if not paths:
    raise ValueError(f"no profiler trace (*.xplane.pb) under {trace_dir}")
  data = jax.profiler.ProfileData.from_file(paths[-1])
  out = collections.Counter()
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if "stream" not in line.name.lower():  # kernel lines are per CUDA stream
        continue
      for ev in line.events:
        out[ev.name] += ev.duration_ns / 1e3
  if not out:
    print("no GPU kernel events; planes/lines:",
          [(pl.name, [ln.name for ln in pl.lines][:6]) for pl in data.planes][:8])
  return out


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
# FP8 round trips of optimizer moments, as the device really rounds them.
#
# On GPU, XLA may drop a float conversion chain f32 -> f8 -> f32 inside ONE compiled program:
# with xla_allow_excess_precision (on by default) its simplify-fp-conversions pass replaces
# convert(convert(x)) by x, so jit(dequantize(quantize(x))) returns x nearly unrounded (relative
# MSE ~1e-13 instead of E4M3's ~1e-3; measured on an H100, 2026-11-23). Here the FP8 codes are
# the output of one jit and the input of another, so they exist in memory; and
# `check_moment_round_trip` compares a sample with a float64 numpy quantizer before a script
# reports any number.


@functools.cache
def _moment_jits():
  import jax
  from coat_jax import expansion

  q = jax.jit(expansion.quantize_expanded, static_argnums=(1, 2, 3, 4))
  d = jax.jit(expansion.dequantize_expanded, static_argnums=(1, 2, 3))
  return q, d


def moment_round_trip(x, fmt: str, group_size: int, expand_min: int, expand: bool, *,
                      axis: str = "last"):
  """dequantize_expanded(quantize_expanded(x)) as float64 numpy, the codes materialised between.

  Groups along x's last axis ("last") or, for a 2-D x, its first ("first": transposed in and out).
  """
  import jax.numpy as jnp
  import numpy as np

  if axis not in ("last", "first"):
    raise ValueError(f"moment_round_trip: axis must be 'last' or 'first', got {axis!r}")
  xt = jnp.asarray(x, jnp.float32)
  if axis == "first":
    xt = xt.T
  quant, dequant = _moment_jits()
  q = quant(xt, fmt, group_size, expand_min, expand)   # FP8 codes: this jit's output
  out = np.asarray(dequant(q, fmt, group_size, expand_min), np.float64)
  return out.T if axis == "first" else out


def numpy_moment_round_trip(x, k, fmt: str, group_size: int):
  """float64 numpy reference of coat_jax.expansion's round trip for a 2-D x (N % G == 0):
  per group mx = max|x| + 1e-30, q = round_fmt(sign(x) fmt.max (|x|/mx)^k) (clamped to
  +-fmt.max; nearest-even), x' = sign(q) mx (|q|/fmt.max)^(1/k). `k`: the groups' exponents
  (shape (rows, N/G); 1 = no expansion)."""
  import numpy as np
  from coat_jax.formats import get_format

  f = get_format(fmt)
  rows, n = x.shape
  g = np.asarray(x, np.float64).reshape(rows, n // group_size, group_size)
  mx = np.abs(g).max(-1, keepdims=True) + 1e-30
  k = np.asarray(k, np.float64)[..., None]
  y = np.clip(np.sign(g) * f.max * (np.abs(g) / mx) ** k, -f.max, f.max)
  q = y.astype(f.dtype).astype(np.float64) if f.is_float else np.rint(y)
  return (np.sign(q) * mx * (np.abs(q) / f.max) ** (1.0 / k)).reshape(x.shape)


def check_moment_round_trip(fmt: str, group_size: int, expand_min: int, *, seed: int = 0) -> dict:
  """Raises SystemExit (one line) unless `moment_round_trip` on this device matches the numpy
  quantizer on a moment-like sample (expansion off and on): relative MSEs within 20% of each
  other and >= 98% of the values equal to 1e-5. Returns {expand: (ours, numpy) relative MSE}."""
  import numpy as np

  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((8, 4 * group_size))
       * np.exp(rng.uniform(-6, 0, (8, 4 * group_size)))).astype(np.float32)
  x64 = x.astype(np.float64)
  found = {}
  for expand in (False, True):
    ours = moment_round_trip(x, fmt, group_size, expand_min, expand)
    codes = _moment_jits()[0](x, fmt, group_size, expand_min, expand).k_code
    k = np.asarray(codes, np.float64) / expand_min   # expand_min (k = 1) without expansion
    ref = numpy_moment_round_trip(x, k, fmt, group_size)
    e_ours = float(np.sum((ours - x64) ** 2) / np.sum(x64 ** 2))
    e_ref = float(np.sum((ref - x64) ** 2) / np.sum(x64 ** 2))
    same = float(np.mean(np.abs(ours - ref) <= 1e-5 * np.abs(ref) + 1e-30))
    found[expand] = (e_ours, e_ref)
    if not (0.8 * e_ref <= e_ours <= 1.25 * e_ref and same >= 0.98):
      raise SystemExit(
          f"FP8 round-trip check failed ({fmt}, expand={expand}): relative MSE {e_ours:.3e} on "
          f"this device vs {e_ref:.3e} from the float64 numpy quantizer, {100 * same:.1f}% of "
          f"values equal; the device did not round to {fmt} (see benchmarks/_common.py)")
  return found


# Compiled train steps and their optimized HLO text (hlo_step_stats.py, profile_step.py).

FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
        "partition-id", "replica-id", "opt-barrier"}
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
               "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_SHAPE = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")


def shape_bytes(text: str) -> int:
  """Bytes of an HLO shape string (arrays or tuples of arrays)."""
  return sum(DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
             for dt, dims in _SHAPE.findall(text))


def _split_shape(rest: str) -> tuple[str, str]:
  """'(f32[2], s32[]) while(...)...' -> ('(f32[2], s32[])', 'while(...)...')."""
  if rest.startswith("("):
    depth = 0
    for i, c in enumerate(rest):
      depth += c == "("
      depth -= c == ")"
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
  shape, _, tail = rest.partition(" ")
  return shape, tail


def parse_hlo(text: str) -> tuple[dict, str]:
  """{computation: [(name, opcode, shape, line)]} and the entry computation's name."""
  comps, entry, cur = {}, None, None
  for line in text.splitlines():
    m = _HEADER.match(line)
    if m and not _INSTR.match(line):
      cur = m.group(2)
      comps[cur] = []
      if m.group(1):
        entry = cur
      continue
    if cur is None or line.strip() == "}":
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    shape, tail = _split_shape(line[m.end():])
    opcode = tail.split("(", 1)[0].strip()
    comps[cur].append((m.group(1), opcode, shape, line))
  return comps, entry


def _root(body):
  """(root opcode, root line) of a computation's instruction list."""
  for name, op, shape, line in body:
    if line.lstrip().startswith("ROOT"):
      return op, line
  return "", ""


def classify(opcode: str, shape: str, line: str, comps: dict) -> tuple[str, int]:
  """(class, bytes written) of one top-level instruction."""
  nbytes = shape_bytes(shape)
  if opcode == "fusion":
    called = re.search(r"calls=%?([\w.\-]+)", line)
    body = comps.get(called.group(1), []) if called else []
    root, root_line = _root(body)
    if root == "dynamic-update-slice":  # in place: writes only the update
      shapes = {n: s for n, _, s, _ in body}
      upd = re.findall(r"%([\w.\-]+)", root_line.split("dynamic-update-slice(", 1)[1])
      return "DUS fusion (in place)", shape_bytes(shapes.get(upd[1], "")) if len(upd) > 1 else 0
    if root == "broadcast":  # e.g. the zero fill of a scan's stacked outputs before the loop
      return "broadcast fusion (fill)", nbytes
    if root == "dynamic-slice":
      return "dynamic-slice fusion", nbytes
    if root in ("copy", "transpose"):
      return "copy/transpose fusion", nbytes
    if root == "convert":
      return "convert fusion", nbytes
    if any(op in ("dot", "convolution") for _, op, _, _ in body):
      return "dot fusion", nbytes
    return "other fusion", nbytes
  if opcode in ("copy", "copy-start", "copy-done"):
    return "copy", nbytes
  if opcode in ("dynamic-update-slice", "dynamic-slice", "transpose", "convert", "dot",
                "custom-call"):
    return opcode, nbytes
  if opcode in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute"):
    return "collective", nbytes
  return "other", nbytes


def step_stats(text: str) -> dict:
  """{class: [ops per step, bytes written per step]} plus 'while carry' (buffers, bytes)."""
  comps, entry = parse_hlo(text)
  stats = collections.defaultdict(lambda: [0, 0])

  def walk(comp: str, times: int):
    for name, opcode, shape, line in comps.get(comp, []):
      if opcode in FREE:
        continue
      if opcode == "while":
        body = re.search(r"body=%?([\w.\-]+)", line).group(1)
        trip = re.search(r'known_trip_count[^0-9]*(\d+)', line)
        n = int(trip.group(1)) if trip else 1
        stats["while loops"][0] += times
        stats["while carry (buffers, bytes)"][0] += times * len(_SHAPE.findall(shape))
        stats["while carry (buffers, bytes)"][1] += times * shape_bytes(shape)
        walk(body, times * n)
        continue
      cls, nbytes = classify(opcode, shape, line, comps)
      stats[cls][0] += times
      stats[cls][1] += times * nbytes
      for sub in re.findall(r"(?:to_apply|calls|branch_computations)=\{?%?([\w.\-]+)", line):
        if opcode in ("call", "conditional"):
          walk(sub, times)
  walk(entry, 1)
  return dict(stats)


def scan_residuals(fn, *args) -> list[tuple[int, int, list]]:
  """Per scan in fn's jaxpr: (length, bytes of its stacked outputs, [(shape, dtype) ...])."""
  import jax
  import jax.extend
  import numpy as np

  out = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "scan":
        ys = eqn.outvars[len(list(eqn.params["ft_out"].unpack()[0].vals)):]
        out.append((eqn.params["length"],
                    sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in ys),
                    [(tuple(v.aval.shape), str(v.aval.dtype)) for v in ys]))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return out


def build_step(preset, precision, layout, seq_len, batch, sets):
  """(compiled train step, jitted step, abstract args, `build`'s result) of one variant:
  precision "bf16" | "fp8_linear" (with adamw) or "coat" (coat_adamw), layout "scan" | "loop"."""
  import jax
  import numpy as np

  from coat_jax.training import mesh as mesh_lib, schema
  from coat_jax.training.build import build

  opt = "coat_adamw" if precision == "coat" else "adamw"
  overrides = [f"model.preset={preset}", "model.dtype=auto", f"precision={precision}",
               f"optimizer.name={opt}", f"data.seq_len={seq_len}", f"data.batch_size={batch}",
               f"model.scan_layers={layout == 'scan'}", "run.steps=10", *sets]
  cfg = schema.load(None, overrides)
  built = build(cfg, mesh_lib.make_mesh(cfg.mesh), seed=0)
  tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), np.int32, sharding=built.batch_sharding)
  args = (*built.abstract_state(), tokens)
  return built.train_step.lower(*args).compile(), built.train_step, args, built


def instruction_index(text: str) -> dict:
  """{instruction name: (class, op_name metadata, custom_call_target)} of the top-level
  instructions of every non-fusion computation; each name also under its kernel spelling
  (XLA names a GPU kernel after its instruction, '.' and '-' turned into '_')."""
  comps, entry = parse_hlo(text)
  fused = {m for m in re.findall(r"calls=%?([\w.\-]+)", text)}
  index = {}
  for comp, body in comps.items():
    if comp in fused:
      continue
    for name, opcode, shape, line in body:
      if opcode in FREE:
        continue
      cls, _ = classify(opcode, shape, line, comps)
      op_name = re.search(r'op_name="([^"]*)"', line)
      target = re.search(r'custom_call_target="([^"]*)"', line)
      info = (cls, op_name.group(1) if op_name else "", target.group(1) if target else "")
      index[name] = info
      index[re.sub(r"[.\-]", "_", name)] = info
  return index
