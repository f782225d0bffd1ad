"""The remade linear input's transposed codes (`linear_residuals: remade`'s backward), each way the
dispatch can make them, per shape: `kernels.remade_codes_t(kind, ..., how=...)`.

Run on the GPU:  PYTHONUNBUFFERED=1 python3 -m benchmarks.kernels.bench_remake [--shapes 7b,olmo] [--sweep]
Rows (one layer's remake, batch 8 x 2048 tokens; ms, median of back-to-back calls):
  fused      pallas_kernels/quantize/remake_triton.py: one pass from the 1 x 16 codes to the
             transposed per-tensor codes (the default)
  kernel     an XLA fusion writes x in bf16, then the Mosaic GPU per-tensor quantize (with its
             transposed copy)
  xla        one XLA fusion from the codes to the transposed codes
--sweep adds the fused kernel at other tiles (rows x columns of x, warps).
Floor: the fused pass's bytes (codes and bf16 group scales read, rstd and the norm's scale for
rmsnorm, the transposed codes written) at the GPU's datasheet HBM bandwidth (`_common.gpu_peaks`).
"equal": the fraction of codes equal to the "kernel" row's (the rest one step apart: the float32
math's last bits). On the CPU: a small shape, every path the unfused one, to check the script.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import gpu_peaks, median_ms_back_to_back
from coat_jax import formats, kernels, quantize

T = 16384
SHAPES = {"7b": (T, 4096, 11008), "olmo": (T, 2048, 8192)}   # (M, hidden, ffn)
G = 16
SWEEP = [(64, 64, 4), (128, 64, 4), (128, 128, 4), (128, 128, 8), (256, 64, 8), (64, 128, 4),
         (64, 128, 8), (64, 256, 4), (32, 128, 4)]


def _arrays(kind, m, k, seed):
  rng = np.random.default_rng(seed)
  codes = lambda s: quantize.quantize_per_group(
      jnp.asarray(rng.standard_normal((m, k)) * s, jnp.bfloat16), G, "e4m3")
  if kind == "rmsnorm":
    return (codes(2.0), jnp.asarray(rng.uniform(0.5, 2, (m, 1)), jnp.float32),
            jnp.asarray(1 + 0.1 * rng.standard_normal(k), jnp.bfloat16))
  return codes(2.0), codes(1.0)


def fused_bytes(kind, m, k):
  per_codes = m * k + (m * k // G) * 2
  extra = m * 4 + k * 2 if kind == "rmsnorm" else 0
  return (1 if kind == "rmsnorm" else 2) * per_codes + extra + m * k


def run_shape(name, m, hidden, ffn, iters, sweep):
  peaks = gpu_peaks(jax.devices()[0].device_kind)
  print(f"{name}: M = {m}, rmsnorm K = {hidden}, swiglu K = {ffn}; seeds 0 and 1", flush=True)
  print(f"  {'remake':<32}{'ms':>9}{'GB/s':>9}{'x floor':>10}{'equal':>9}")
  for kind, k, seed in (("rmsnorm", hidden, 0), ("swiglu", ffn, 1)):
    arrays = _arrays(kind, m, k, seed)
    amax = jnp.float32(3.0)
    nbytes = fused_bytes(kind, m, k)
    floor = nbytes / peaks["hbm_bytes_per_s"] * 1e3
    print(f"  {kind} floor {floor:.4f} ms ({nbytes / 1e9:.4f} GB)")
    rows = []
    with kernels.backend("pallas"):
      for how in kernels.REMAKE_HOWS:
        fn = jax.jit(functools.partial(kernels.remade_codes_t, kind, dtype=jnp.bfloat16,
                                       how=how))
        rows.append((how, fn, (arrays, amax)))
      if sweep and jax.default_backend() == "gpu":
        from pallas_kernels.quantize import remake_triton as rt
        scale = quantize.scale_from_amax(amax, "e4m3", formats.ACTIVATION_SCALE_FLOOR)
        codes = arrays[:1] if kind == "rmsnorm" else arrays
        extra = arrays[1:] if kind == "rmsnorm" else ()
        for bm, bk, w in SWEEP:
          fn = jax.jit(functools.partial(rt.remake_transposed, kind, group_size=G,
                                         out_dtype=jnp.float8_e4m3fn, fmax=448.0, block_rows=bm,
                                         block_cols=bk, num_warps=w))
          rows.append((f"fused {bm}x{bk} w{w}", fn,
                       (scale, tuple(q.data for q in codes), tuple(q.scale for q in codes),
                        extra)))
      _, fn, args = next(r for r in rows if r[0] == "kernel")
      want = np.asarray(fn(*args), np.float32)
      for label, fn, args in rows:
        ms = median_ms_back_to_back(fn, *args, iters=iters)
        got = np.asarray(fn(*args), np.float32)
        same = np.mean((got == want) | (np.isnan(got) & np.isnan(want)))
        print(f"  {kind + ' ' + label:<32}{ms:>9.3f}{nbytes / ms / 1e6:>9.0f}"
              f"{ms / floor:>10.2f}{same:>9.4f}", flush=True)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shapes", default="7b,olmo", help=f"comma-separated of {sorted(SHAPES)}")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--sweep", action="store_true", help="the fused kernel at other tiles too")
  args = p.parse_args()
  names = [s for s in args.shapes.split(",") if s]
  for s in names:
    if s not in SHAPES:
      raise SystemExit(f"bench_remake: unknown shape {s!r}; shapes: {sorted(SHAPES)}")
  on_gpu = jax.default_backend() == "gpu"
  print(f"device {jax.devices()[0].device_kind}")
  for s in names:
    m, hidden, ffn = SHAPES[s] if on_gpu else (256, 128, 256)
    run_shape(s, m, hidden, ffn, args.iters if on_gpu else 2, args.sweep)


if __name__ == "__main__":
  main()
