"""Mosaic GPU quantize kernels, SwiGLU's backward and the jax-triton Adam step vs XLA's
references vs a device copy.

Prints one table: per kernel, GB/s (bytes the kernel must move / median time) of the kernel
(Mosaic GPU, pallas_kernels/quantize/quantize_mgpu.py; for "adam" the jax-triton kernel,
pallas_kernels/adam/adam_step_triton.py, when triton and jax-triton import) and of a baseline
(XLA's jitted jnp reference), each also as % of a copy's GB/s (a jitted
x + 1 over the same number of bytes read + written). With --check, the new kernels' outputs are
also compared with the jnp references on the device (FP8 codes / scales: count of differences).
With --sweep, the Mosaic GPU quantize kernels' tunables (rows per block, CTA cap, pipeline
stages; block_rows x block_cols for per tensor) are swept instead: one line per setting and the
best per kernel.

  python3 -m benchmarks.kernels.bench_kernels_mgpu                       # all, 8192 x 8192
  python3 -m benchmarks.kernels.bench_kernels_mgpu --only adam --adam-rows 4096 --check
  python3 -m benchmarks.kernels.bench_kernels_mgpu --sweep --only per_group,dequantize   # ~1 min
  python3 -m benchmarks.kernels.bench_kernels_mgpu --only swiglu_bwd --check   # SwiGLU's backward
  python3 -m benchmarks.kernels.bench_kernels_mgpu --only per_tensor_t --shape 16384x2048  # OLMo-1B
  python3 -m benchmarks.kernels.bench_kernels_mgpu --sweep --device-time --only per_tensor_t \
      --shape 16384x2048      # a small shape's tunables by the GPU's own time
"""
from __future__ import annotations

import argparse
import math
import sys

from benchmarks._common import device_ms_per_call, median_ms_back_to_back, parse_shapes

KERNELS = ("per_group", "tile_amax", "dequantize", "swiglu_bwd", "per_tensor", "per_tensor_t",
           "adam")


def timer(reps: int, device_time: bool):
  """seconds(fn): the time of one call of `fn()`: the back-to-back host median
  (benchmarks/_common.py), or with device_time the GPU's own time from a profiler trace
  (`device_ms_per_call`: no dispatch in it, which a call of a few tens of microseconds needs)."""
  if device_time:
    return lambda fn: device_ms_per_call(fn, iters=reps) / 1e3
  return lambda fn: median_ms_back_to_back(fn, iters=reps, repeats=5) / 1e3


def _moved_bytes(shape: tuple[int, int]) -> dict[str, int]:
  """Bytes each quantize kernel must move on a bf16 input of `shape`: 2 read per element, 1 per
  FP8 code, and per 1 x 16 group a scale of the dispatch's scale dtype (a float32 maximum for the
  tile maxima)."""
  from coat_jax import formats
  n2, sb = math.prod(shape), formats.ACTIVATION_SCALE_DTYPE.itemsize
  return {"per_group": n2 * (2 + 1) + n2 // 16 * sb, "tile_amax": n2 * 2 + n2 // 16 * 4,
          "dequantize": n2 * (1 + 2) + n2 // 16 * sb, "per_tensor": n2 * (2 + 1),
          "per_tensor_t": n2 * (2 + 2)}


def _copy_gbs(nbytes: int, seconds) -> float:
  """GB/s of x + 1 over a float32 array moving nbytes (read + write)."""
  import jax
  import jax.numpy as jnp
  x = jnp.ones((nbytes // 8,), jnp.float32)
  f = jax.jit(lambda a: a + 1)
  return nbytes / seconds(lambda: f(x)) / 1e9


def _swiglu_backward_call(x, gate_q):
  """SwiGLU's backward kernel (swiglu_mgpu.swiglu_backward) from gate's codes (gate_q) and up's
  (of -x / 2), with dh = x: (bytes moved, kernel thunk taking tunables, XLA reference thunk: the
  dispatch's reference, gradients and both amaxes)."""
  import jax
  from coat_jax import kernels, quantize as Q
  from pallas_kernels.quantize import swiglu_mgpu as sm

  up_q = Q.quantize_per_group(-x / 2, 16, "e4m3")
  n = x.size
  nbytes = n * (2 + 1 + 1 + 2 + 2) + n // 16 * 2 * (gate_q.scale.dtype.itemsize + x.dtype.itemsize)

  @jax.jit
  def reference(gq, uq, dh):
    with kernels.backend("reference"):   # traced under it: the dispatch's reference
      return kernels.swiglu_backward(gq, uq, dh)

  return (nbytes,
          lambda **t: sm.swiglu_backward(x, gate_q.data, gate_q.scale, up_q.data, up_q.scale,
                                         group_size=16, **t),
          lambda: reference(gate_q, up_q, x))


def _cases(shape: tuple[int, int], adam_rows: int, check: bool):
  """(name, bytes moved, new kernel thunk, baseline thunk or None, check thunk or None)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from coat_jax import adam_math, expansion, formats, quantize as Q
  from pallas_kernels.adam import adam_step_triton
  from pallas_kernels.quantize import quantize_mgpu as q_mgpu

  e4 = jnp.float8_e4m3fn
  x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
  n2 = math.prod(shape)
  codes = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32))
  ndiff = lambda a, b: int(np.sum(~((codes(a) == codes(b)) | (np.isnan(codes(a))
                                                             & np.isnan(codes(b))))))
  qk = dict(out_dtype=e4, fmax=448.0, floor=1e-10)
  sd = formats.ACTIVATION_SCALE_DTYPE   # the dispatch's per-group scales
  moved = _moved_bytes(shape)
  ref_g = Q.quantize_per_group(x, 16, "e4m3")
  xla_g = jax.jit(lambda a: Q.quantize_per_group(a, 16, "e4m3"))
  yield ("per_group", moved["per_group"],
         lambda: q_mgpu.quantize_per_group(x, group_size=16, scale_dtype=sd, **qk),
         lambda: xla_g(x),
         (lambda: (lambda q, s: f"code diffs {ndiff(q, ref_g.data)}, scale diffs "
                   f"{ndiff(s, ref_g.scale)}")(*q_mgpu.quantize_per_group(
                       x, group_size=16, scale_dtype=sd, **qk)))
         if check else None)
  xla_amax = jax.jit(lambda a: Q.group_amax(a, 16))
  yield ("tile_amax", moved["tile_amax"], lambda: q_mgpu.tile_amax(x),
         lambda: xla_amax(x),
         (lambda: f"diffs {ndiff(q_mgpu.tile_amax(x), Q.group_amax(x, 16))}") if check else None)
  xla_deq = jax.jit(lambda q: Q.dequantize(q, jnp.bfloat16))
  yield ("dequantize", moved["dequantize"],
         lambda: q_mgpu.dequantize_per_group(ref_g.data, ref_g.scale, group_size=16,
                                             dtype=jnp.bfloat16),
         lambda: xla_deq(ref_g),
         (lambda: f"diffs {ndiff(q_mgpu.dequantize_per_group(ref_g.data, ref_g.scale, group_size=16, dtype=jnp.bfloat16), Q.dequantize(ref_g, jnp.bfloat16))}")
         if check else None)
  swiglu_bytes, swiglu_bwd, swiglu_ref = _swiglu_backward_call(x, ref_g)
  yield ("swiglu_bwd", swiglu_bytes, swiglu_bwd, swiglu_ref,
         (lambda: (lambda a, b: f"dgate diffs {ndiff(a[0], b[0])}, dup diffs {ndiff(a[1], b[1])} "
                   f"of {n2}")(swiglu_bwd(), swiglu_ref())) if check else None)
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  for name, tr in (("per_tensor", False), ("per_tensor_t", True)):
    ref_t = Q.quantize_per_tensor(x, "e4m3", amax=amax, with_transpose=tr)
    run = lambda tr=tr: q_mgpu.quantize_per_tensor(x, amax=amax, with_transpose=tr, **qk)
    yield (name, moved[name], run,
           lambda tr=tr, f=jax.jit(lambda a, m, tr=tr: Q.quantize_per_tensor(
               a, "e4m3", amax=m, with_transpose=tr)): f(x, amax),
           (lambda tr=tr, ref_t=ref_t, run=run: (lambda q, s, qt: f"code diffs "
             f"{ndiff(q, ref_t.data)}" + (f", transposed {ndiff(qt, ref_t.data_t)}" if tr else ""))
            (*run())) if check else None)

  g = 128
  shape = (adam_rows, 4096)
  keys = jax.random.split(jax.random.key(1), 4)
  p = jax.random.normal(keys[0], shape, jnp.float32)
  gr = jax.random.normal(keys[1], shape, jnp.float32) * 1e-2
  m = expansion.quantize_expanded(jax.random.normal(keys[2], shape) * 1e-3, "e4m3", g, 16)
  v = expansion.quantize_expanded(jnp.abs(jax.random.normal(keys[3], shape)) * 1e-6, "e4m3",
                                  g, 16)
  hyper = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, count=jnp.int32(3))
  log2r = math.log2(expansion.expansion_range("e4m3"))
  mk = dict(m_fmax=448.0, v_fmax=448.0, m_log2_range=log2r, v_log2_range=log2r, group_size=g,
            expand=True, expand_min=16, **hyper)
  fmt = dict(m_format="e4m3", v_format="e4m3", group_size=g, expand=True, expand_min=16, **hyper)
  size = math.prod(shape)
  moved = size * (4 + 4 + 4 + 2 * 2) + 2 * 2 * (size // g) * 5   # p, g, new p, 2 moments r+w

  def code_steps(a, b):
    """FP8 codes apart (sign-magnitude bits to a monotonic integer), per element."""
    def mono(c):
      bits = np.asarray(jax.lax.bitcast_convert_type(c, jnp.uint8)).astype(np.int32)
      return np.where(bits & 0x80, -(bits & 0x7F), bits & 0x7F)
    return np.abs(mono(a) - mono(b))

  reference = jax.jit(lambda p, gr, m, v: adam_math.adam_step_reference(p, gr, m, v, **fmt))

  def adam_check():
    out = adam_step_triton.adam_step(p, gr, *m, *v, **mk)
    ref = reference(p, gr, m, v)
    dp = float(jnp.linalg.norm(out[0] - ref[0]) / jnp.linalg.norm(ref[0] - p))
    dm, dv = code_steps(out[1], ref[1].data), code_steps(out[4], ref[2].data)
    dk = int(np.sum(codes(out[3]) != codes(ref[1].k_code)))
    return (f"param rel L2 {dp:.2e}; m codes off {int(np.sum(dm > 0))} (max {dm.max()}), "
            f"v codes off {int(np.sum(dv > 0))} (max {dv.max()}), m k diffs {dk}")
  if adam_step_triton.available():
    yield ("adam", moved, lambda: adam_step_triton.adam_step(p, gr, *m, *v, **mk),
           lambda: reference(p, gr, m, v), adam_check if check else None)


# The sweep's grid per kernel: (tunable name, values), all combinations; the defaults are in it.
SWEEP = {
    "per_group": (("block", (64, 128, 256, 512)), ("max_ctas", (132, 264, 528)),
                  ("stages", (2, 3, 4))),
    "tile_amax": (("block", (128, 256, 512)), ("max_ctas", (264, 528)), ("stages", (2, 3))),
    "dequantize": (("block", (64, 128, 256, 512)), ("max_ctas", (132, 264, 528)),
                   ("stages", (2, 3, 4))),
    "swiglu_bwd": (("block", (64, 128, 256)), ("max_ctas", (132, 264, 528)), ("stages", (2, 3))),
    "per_tensor": (("block_rows", (64, 128)), ("block_cols", (128, 256)),
                   ("max_ctas", (132, 264, 528, 1056)), ("stages", (2, 3))),
    "per_tensor_t": (("block_rows", (64, 128)), ("block_cols", (64, 128)),
                     ("max_ctas", (132, 264, 528, 1056)), ("stages", (2, 3))),
}


def _sweep(shape: tuple[int, int], names, seconds) -> None:
  """GB/s of each Mosaic GPU quantize kernel per setting of SWEEP on a bf16 input of `shape`."""
  import itertools
  import jax
  import jax.numpy as jnp
  from coat_jax import formats, quantize as Q
  from pallas_kernels.quantize import quantize_mgpu as q_mgpu

  x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
  moved = _moved_bytes(shape)
  ref_g = Q.quantize_per_group(x, 16, "e4m3")
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  qk = dict(out_dtype=jnp.float8_e4m3fn, fmax=448.0, floor=1e-10)
  sd = formats.ACTIVATION_SCALE_DTYPE
  calls = {
      "per_group": (moved["per_group"],
                    lambda **t: q_mgpu.quantize_per_group(x, group_size=16, scale_dtype=sd, **qk,
                                                          **t)),
      "tile_amax": (moved["tile_amax"], lambda **t: q_mgpu.tile_amax(x, **t)),
      "dequantize": (moved["dequantize"], lambda **t: q_mgpu.dequantize_per_group(
          ref_g.data, ref_g.scale, group_size=16, dtype=jnp.bfloat16, **t)),
      "swiglu_bwd": _swiglu_backward_call(x, ref_g)[:2],
      "per_tensor": (moved["per_tensor"], lambda **t: q_mgpu.quantize_per_tensor(
          x, amax=amax, **qk, **t)),
      "per_tensor_t": (moved["per_tensor_t"], lambda **t: q_mgpu.quantize_per_tensor(
          x, amax=amax, with_transpose=True, **qk, **t)),
  }
  for name in names:
    if name not in SWEEP:
      continue
    nbytes, call = calls[name]
    copy = _copy_gbs(nbytes, seconds)
    best = (0.0, None)
    keys = [k for k, _ in SWEEP[name]]
    for values in itertools.product(*(v for _, v in SWEEP[name])):
      tun = dict(zip(keys, values))
      try:
        gbs = nbytes / seconds(lambda: call(**tun)) / 1e9
      except Exception as e:   # e.g. shared memory exceeded: report and go on
        print(f"sweep {name:<13} {tun}  FAIL {type(e).__name__}: {str(e)[:160]}", flush=True)
        continue
      best = max(best, (gbs, tun), key=lambda b: b[0])
      print(f"sweep {name:<13} {tun}  {gbs:6.0f} GB/s {100 * gbs / copy:5.1f}% of copy "
            f"({copy:.0f})", flush=True)
    print(f"best  {name:<13} {best[1]}  {best[0]:6.0f} GB/s {100 * best[0] / copy:5.1f}%",
          flush=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", default=",".join(KERNELS),
                      help=f"comma-separated subset of {', '.join(KERNELS)}")
  parser.add_argument("--n", type=int, default=8192, help="quantize inputs are n x n bf16")
  parser.add_argument("--shape", default=None,
                      help="ROWSxCOLS: quantize inputs of that shape instead (e.g. 16384x2048)")
  parser.add_argument("--adam-rows", type=int, default=16384,
                      help="the Adam step's param is (rows, 4096) float32")
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--check", action="store_true",
                      help="also compare the new kernels with the jnp references")
  parser.add_argument("--no-baseline", action="store_true", help="skip the baselines")
  parser.add_argument("--sweep", action="store_true",
                      help="sweep the Mosaic GPU quantize kernels' tunables (see SWEEP)")
  parser.add_argument("--device-time", action="store_true",
                      help="time each call by its kernels' GPU time in a profiler trace instead "
                           "of back-to-back host time (whose dispatch dominates calls of a few "
                           "tens of microseconds, e.g. 16384 x 2048)")
  args = parser.parse_args(argv)
  names = [s for s in args.only.split(",") if s]
  bad = sorted(set(names) - set(KERNELS))
  if bad:
    parser.error(f"--only: unknown kernel(s) {bad}; choose from {list(KERNELS)}")

  shapes = parse_shapes(parser, "--shape", args.shape or f"{args.n}x{args.n}", "ROWSxCOLS")
  if len(shapes) != 1:
    parser.error(f"--shape: one ROWSxCOLS, got {args.shape!r}")
  (shape,) = shapes

  import jax
  seconds = timer(args.reps, args.device_time)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; quantize inputs "
        f"{shape[0]} x {shape[1]} bf16; "
        f"{'GPU kernel time (profiler)' if args.device_time else 'back-to-back host time'}")
  if args.sweep:
    _sweep(shape, names, seconds)
    return 0
  header = f"{'kernel':<14}{'MB moved':>10}{'copy GB/s':>11}{'new GB/s':>11}{'% copy':>8}" \
           f"{'base GB/s':>13}{'% copy':>8}  check   (base: XLA's jnp reference)"
  print(header)
  for name, nbytes, new, old, check in _cases(shape, args.adam_rows, args.check):
    if name not in names:
      continue
    copy = _copy_gbs(nbytes, seconds)
    row = f"{name:<14}{nbytes / 1e6:>10.1f}{copy:>11.0f}"
    try:
      gbs = nbytes / seconds(new) / 1e9
      row += f"{gbs:>11.0f}{100 * gbs / copy:>7.0f}%"
    except Exception as e:   # report and go on: one table for the lead
      row += f"{'FAIL':>11}{'':>8}"
      print(f"  {name} new kernel failed: {type(e).__name__}: {str(e)[:400]}")
    if old is not None and not args.no_baseline:
      try:
        gbs = nbytes / seconds(old) / 1e9
        row += f"{gbs:>13.0f}{100 * gbs / copy:>7.0f}%"
      except Exception as e:
        row += f"{'FAIL':>13}{'':>8}"
        print(f"  {name} baseline failed: {type(e).__name__}: {str(e)[:400]}")
    else:
      row += f"{'-':>13}{'':>8}"
    if check is not None:
      try:
        row += "  " + check()
      except Exception as e:
        row += f"  check failed: {type(e).__name__}: {str(e)[:200]}"
    print(row, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
