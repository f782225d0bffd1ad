"""Bandwidth of the Pallas quantize kernels vs a measured device copy and XLA's jnp references.

Run on the GPU: `python3 benchmarks/bench_kernels_memory.py` (prints a table). Bytes counted per
call are those the kernel must move: bf16 input read once per pass, FP8 outputs, scales.
The Pallas side is composed as `coat_jax.kernels` does it (the kernels take and return plain
arrays): per tensor = stage-1 `tile_amax`, jnp max, `scale_from_amax`, the quantize pass.

  JAX_PLATFORMS=cpu python benchmarks/bench_kernels_memory.py --interpret --shape 64x256 \
      --probe-kv --probe-pt                                    # smoke check of the calls
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from _common import median_ms_back_to_back as median_ms
from coat_jax import formats, quantize
from coat_jax.quantize import QuantizedArray
from pallas_kernels import quantize as pk

FLOOR = formats.ACTIVATION_SCALE_FLOOR
SHAPES = ((16384, 4096), (16384, 11008))


def pk_per_group(x, group_size=16, fmt="e4m3", **kw) -> QuantizedArray:
  """Pallas per-group quantization wrapped as `coat_jax.kernels.quantize_per_group` wraps it."""
  f = formats.get_format(fmt)
  data, scale = pk.quantize_per_group(x, group_size, dtype=f.dtype, floor=FLOOR, **kw)
  return QuantizedArray(data, scale, f.name, group_size)


def pk_per_tensor(x, fmt="e4m3", *, with_transpose=False, interpret=False,
                  **kw) -> QuantizedArray:
  """Pallas per-tensor quantization as `coat_jax.kernels.quantize_per_tensor` runs it on one
  device: stage-1 tile maxima (kernel), stage 2 (jnp.max), the scale, the quantize pass."""
  f = formats.get_format(fmt)
  amax = jnp.max(pk.tile_amax(x, interpret=interpret))
  scale = quantize.scale_from_amax(amax, f, FLOOR)
  data, data_t = pk.quantize_per_tensor(x, scale, dtype=f.dtype, with_transpose=with_transpose,
                                        interpret=interpret, **kw)
  return QuantizedArray(data, scale, f.name, 0, data_t)


def pk_dequant_per_group(q: QuantizedArray, dtype, **kw):
  return pk.dequantize_per_group(q.data, q.scale, q.group_size, dtype, **kw)


def probe_cast():
  """Does XLA:GPU round float32 -> FP8 once (correctly) or through float16 (twice)?"""
  import ml_dtypes
  ks = np.arange(1, 200, dtype=np.float64)
  y = ((ks + 0.5) * 2.0**-9 * (1 - 2.0**-20)).astype(np.float32)   # just below E4M3 ties
  for name, dt in [("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2)]:
    yy = y if name == "e4m3" else (y * 2.0**-7).astype(np.float32)
    xla = np.asarray(jax.jit(lambda a: a.astype(dt))(jnp.asarray(yy))).view(np.uint8)
    direct = yy.astype(dt).view(np.uint8)
    via16 = yy.astype(np.float16).astype(dt).view(np.uint8)
    print(f"cast probe {name}: XLA != direct in {(xla != direct).sum()}, "
          f"XLA != via-f16 in {(xla != via16).sum()} of {yy.size}", flush=True)


def probe_kernel_vs_ref(shape=(1000, 4096), interpret=False):
  """Relative error of kernel and XLA reference per-group quantization on the test's inputs."""
  rng = np.random.default_rng(0)
  xn = rng.standard_normal(shape) * np.exp2(rng.integers(-12, 12, shape))
  x = jnp.asarray(xn, jnp.bfloat16)
  ref = jax.jit(lambda a: quantize.quantize_per_group(a, 16, "e4m3"))(x)
  xf = np.asarray(x, np.float32)
  def err(q):
    d = np.asarray(quantize.dequantize(q), np.float32)
    big = np.abs(xf) > 0.1 * np.repeat(np.asarray(q.scale), 16, -1) * 448
    return float(np.median(np.abs(d - xf)[big] / np.abs(xf)[big]))
  bits = lambda q: np.asarray(jax.lax.bitcast_convert_type(q.data, jnp.uint8))
  print(f"kv probe ref err {err(ref):.3g}", flush=True)
  for mode, blk in (("full", 256), ("rn", 128)):
    # GPU_DIVISION is read at trace time (ignored in interpret mode): clear jit's caches so that
    # the kernel is traced again under the new mode.
    pk.GPU_DIVISION = mode
    jax.clear_caches()
    q = pk_per_group(x, 16, "e4m3", block=blk, interpret=interpret)
    print(f"kv probe {mode}: err {err(q):.3g}, data differ {(bits(q) != bits(ref)).mean():.4%}, "
          f"scale differ {(np.asarray(q.scale) != np.asarray(ref.scale)).mean():.4%}", flush=True)
  pk.GPU_DIVISION = "full"
  jax.clear_caches()


def probe_per_tensor(shape=(1008, 4096), interpret=False):
  """Kernel vs XLA reference per-tensor quantization (scale, codes) on the test's inputs."""
  rng = np.random.default_rng(0)
  xn = rng.standard_normal(shape) * np.exp2(rng.integers(-12, 12, shape))
  x = jnp.asarray(xn, jnp.bfloat16)
  bits = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))
  for fmt in ("e4m3", "e5m2"):
    for tr in (False, True):
      ref = jax.jit(lambda a, fmt=fmt, tr=tr: quantize.quantize_per_tensor(
          a, fmt, with_transpose=tr))(x)
      jax.block_until_ready(ref)
      print(f"   ref scale before kernel {float(ref.scale):.6g}", flush=True)
      q = pk_per_tensor(x, fmt, with_transpose=tr, interpret=interpret)
      jax.block_until_ready(q)
      print(f"pt probe {fmt} T={tr}: scale ref {float(ref.scale):.6g} kern {float(q.scale):.6g};"
            f" data differ {(bits(q.data) != bits(ref.data)).mean():.4%}"
            + (f"; data_t differ {(bits(q.data_t) != bits(ref.data_t)).mean():.4%}" if tr else ""),
            flush=True)
      print(f"   x/s {np.asarray(x[0, :6], np.float32) / float(ref.scale)} ref "
            f"{bits(ref.data)[0, :6]} kern {bits(q.data)[0, :6]}", flush=True)


def probe_division():
  """Which float32 division does XLA:GPU compile x / s to? Compared with IEEE (numpy) and PTX."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as pltriton
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((4096, 256)) * 100).astype(np.float32)
  s = np.exp(rng.standard_normal((4096, 1))).astype(np.float32)
  xla = np.asarray(jax.jit(lambda a, b: a / b)(jnp.asarray(x), jnp.asarray(s)))
  ieee = x / s
  recip = x * (np.float32(1) / s)
  print(f"div probe: XLA vs IEEE differ {(xla != ieee).sum()}, XLA vs x*(1/s) {(xla != recip).sum()}"
        f" of {x.size}", flush=True)
  for asm in ("div.rn.f32", "div.full.f32", "div.approx.f32"):
    def kern(a_ref, b_ref, o_ref, asm=asm):
      a = a_ref[...]
      b = jnp.broadcast_to(b_ref[...], a.shape)
      [o_ref[...]] = pltriton.elementwise_inline_asm(
          f"{asm} $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
          result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    out = pl.pallas_call(kern, grid=(4096 // 64,),
                         in_specs=[pl.BlockSpec((64, 256), lambda i: (i, 0)),
                                   pl.BlockSpec((64, 1), lambda i: (i, 0))],
                         out_specs=pl.BlockSpec((64, 256), lambda i: (i, 0)),
                         out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32))(x, s)
    out = np.asarray(out)
    print(f"div probe {asm}: vs XLA differ {(out != xla).sum()}, vs IEEE {(out != ieee).sum()}",
          flush=True)
  div_rn_plain = pl.pallas_call(lambda a_ref, b_ref, o_ref: o_ref.__setitem__(
      Ellipsis, a_ref[...] / b_ref[...]), grid=(4096 // 64,),
      in_specs=[pl.BlockSpec((64, 256), lambda i: (i, 0)), pl.BlockSpec((64, 1), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((64, 256), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32))(x, s)
  print(f"div probe Triton '/': vs XLA differ {(np.asarray(div_rn_plain) != xla).sum()}, vs IEEE "
        f"{(np.asarray(div_rn_plain) != ieee).sum()}", flush=True)


def _shape(text: str) -> tuple[int, int]:
  m, _, n = text.lower().partition("x")
  try:
    return int(m), int(n)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected MxN, e.g. 16384x4096, got {text!r}") from None


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--probe-cast", action="store_true",
                      help="does XLA round float32 -> FP8 once or through float16?")
  parser.add_argument("--probe-kv", action="store_true",
                      help="per-group kernel vs XLA reference (error, differing codes/scales)")
  parser.add_argument("--probe-pt", action="store_true",
                      help="per-tensor kernel vs XLA reference (scale, codes)")
  parser.add_argument("--probe-div", action="store_true",
                      help="which float32 division XLA:GPU compiles x / s to (GPU only)")
  parser.add_argument("--sweep", action="store_true",
                      help="also sweep block sizes and warps of the per-group / per-tensor kernels")
  parser.add_argument("--shape", type=_shape, action="append", metavar="MxN",
                      help="table shapes (repeatable; default "
                           + " ".join(f"{m}x{n}" for m, n in SHAPES)
                           + "); with --interpret the probes use the first one too")
  parser.add_argument("--interpret", action="store_true",
                      help="Pallas interpret mode (CPU smoke check: use a tiny --shape)")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  shapes = args.shape or SHAPES
  interp = args.interpret
  probe = {"interpret": True, "shape": shapes[0]} if interp else {}
  if args.probe_cast:
    probe_cast()
  if args.probe_kv:
    probe_kernel_vs_ref(**probe)
  if args.probe_pt:
    probe_per_tensor(**probe)
  if args.probe_div:
    try:
      probe_division()
    except Exception as err:  # a probe must not stop the benchmark
      print(f"div probe failed: {type(err).__name__}: {err}"[:2000], flush=True)
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  rows = []
  for m, n in shapes:
    x = jax.random.normal(jax.random.key(0), (m, n), jnp.bfloat16) * 3.0
    e = m * n
    copy = jax.jit(lambda a: a * 2)
    t_copy = median_ms(copy, x)
    bw_copy = 4 * e / t_copy / 1e6
    rows.append((f"{m}x{n}", "copy bf16 (x*2)", 4 * e, t_copy, t_copy, bw_copy))
    g16 = e // 16
    cases = [
        ("per-group g16 e4m3", 2 * e + e + 4 * g16,
         jax.jit(lambda a: pk_per_group(a, 16, "e4m3", interpret=interp)),
         jax.jit(lambda a: quantize.quantize_per_group(a, 16, "e4m3"))),
        ("stage1 tile amax", 2 * e + 4 * g16,
         jax.jit(lambda a: pk.tile_amax(a, interpret=interp)),
         jax.jit(lambda a: quantize.group_amax(a, 16))),
        ("per-tensor e4m3 (2 passes)", 2 * e + 4 * g16 + 2 * e + e,
         jax.jit(lambda a: pk_per_tensor(a, "e4m3", interpret=interp)),
         jax.jit(lambda a: quantize.quantize_per_tensor(a, "e4m3"))),
        ("per-tensor e5m2 +transpose", 2 * e + 4 * g16 + 2 * e + 2 * e,
         jax.jit(lambda a: pk_per_tensor(a, "e5m2", with_transpose=True, interpret=interp)),
         jax.jit(lambda a: quantize.quantize_per_tensor(a, "e5m2", with_transpose=True))),
    ]
    for name, nbytes, kern, ref in cases:
      tk, tr = median_ms(kern, x), median_ms(ref, x)
      rows.append((f"{m}x{n}", name, nbytes, tk, tr, nbytes / tk / 1e6))
    if args.sweep:
      for r, w in [(128, 4), (256, 4), (256, 8), (512, 4), (512, 8), (128, 2)]:
        fn = jax.jit(lambda a, r=r, w=w: pk_per_group(a, 16, "e4m3", block=r, num_warps=w,
                                                      interpret=interp))
        tk = median_ms(fn, x)
        print(f"sweep per-group {m}x{n} rows={r} warps={w}: {tk:.3f} ms "
              f"{100 * (3 * e + 4 * g16) / tk / 1e6 / bw_copy:.1f}% of copy", flush=True)
      for bm, bn, w in [(64, 128, 4), (128, 64, 4), (128, 128, 8), (32, 128, 4)]:
        fn = jax.jit(lambda a, bm=bm, bn=bn, w=w: pk_per_tensor(
            a, "e5m2", with_transpose=True, block_rows=bm, block_cols=bn, num_warps=w,
            interpret=interp))
        tk = median_ms(fn, x)
        print(f"sweep per-tensor+T {m}x{n} bm={bm} bn={bn} warps={w}: {tk:.3f} ms", flush=True)
    q = pk_per_group(x, 16, "e4m3", interpret=interp)
    tk = median_ms(jax.jit(lambda q: pk_dequant_per_group(q, jnp.bfloat16, interpret=interp)), q)
    tr = median_ms(jax.jit(lambda q: quantize.dequantize(q, jnp.bfloat16)), q)
    rows.append((f"{m}x{n}", "dequant per-group ->bf16", e + 4 * g16 + 2 * e, tk, tr,
                 (3 * e + 4 * g16) / tk / 1e6))
    rows.append((f"{m}x{n}", "(copy GB/s)", 0, 0, 0, bw_copy))
  print(f"{'shape':12s} {'op':28s} {'MB':>8s} {'pallas ms':>10s} {'xla ms':>8s} {'GB/s':>7s} "
        f"{'%copy':>6s} {'xla/pallas':>10s}")
  copy_bw = {}
  for shape, name, nb, tk, tr, bw in rows:
    if name == "copy bf16 (x*2)":
      copy_bw[shape] = bw
    if name == "(copy GB/s)":
      continue
    print(f"{shape:12s} {name:28s} {nb / 1e6:8.1f} {tk:10.3f} {tr:8.3f} {bw:7.0f} "
          f"{100 * bw / copy_bw[shape]:6.1f} {tr / tk:10.2f}")


if __name__ == "__main__":
  main()
