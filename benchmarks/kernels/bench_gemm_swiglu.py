"""The gate/up GEMM with SwiGLU in its epilogue against the path it replaces, per MLP shape.

Run on the GPU:  PYTHONUNBUFFERED=1 python3 -m benchmarks.kernels.bench_gemm_swiglu [--shapes olmo,7b]
Rows (one layer's forward MLP input half, batch 8 x 2048 tokens; ms, median of back-to-back calls):
  fused sN   pallas_kernels/fp8_gemm_swiglu with a ring of N stages (4, the default, and 5): h,
             its 1 x 64 maxima and gate's and up's 1 x 16 codes from one GEMM over the
             interleaved weight codes
  unfused    the default path: two FP8 GEMMs writing gate and up in bf16, then
             `kernels.swiglu_quantize` (one kernel reading both)
  GEMMs      the two FP8 GEMMs alone (what the unfused path spends before its SwiGLU pass)
  weights    the weights' codes for the forward: the "fused" path's Mosaic GPU quantize with
             the transposed copy, twice, vs the epilogue path's (ops/swiglu.py `weight_codes_t`,
             XLA: each weight quantized as it lies, then its codes transposed and interleaved)
Floors: the GEMM's FLOPs at the FP8 dense peak (1979 TFLOP/s); the SwiGLU pass's bytes (gate and
up read in bf16, h written in bf16, codes in FP8 and bf16 scales written) at the datasheet HBM
bandwidth of the GPU it runs on (`_common.gpu_peaks`: H200 4.8, else H100 3.35 TB/s).
On the CPU: a small shape in interpret mode, to check that the script runs.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import gpu_peaks, median_ms_back_to_back
from coat_jax import kernels
from coat_jax.ops.swiglu import weight_codes_t
from pallas_kernels.gemm import fp8_gemm_swiglu as fs, fp8_matmul as fm

T = 16384
SHAPES = {"olmo": (T, 8192, 2048), "7b": (T, 11008, 4096)}   # (M, F, K)


def _operands(m, f, k, seed=0):
  rng = np.random.default_rng(seed)
  fp8 = lambda shape: jnp.asarray(rng.standard_normal(shape) * 2, jnp.float32).astype(
      jnp.float8_e4m3fn)
  return fp8((m, k)), fp8((f, k)), fp8((f, k))


def run_shape(name, m, f, k, iters, interpret):
  x, wg, wu = _operands(m, f, k)
  print(f"{name}: (M, F, K) = {(m, f, k)}, seed 0", flush=True)
  scales = jnp.asarray([0.5, 0.02, 0.008], jnp.float32)   # x's, gate's and up's scales
  interp = fm.interpret_params(interpret)
  wi = jax.jit(fs.interleave_gate_up)(wg, wu)
  rows = []
  for stages in (4, 5):
    fn = jax.jit(lambda x, w, s, n=stages: fs.fp8_gemm_swiglu(x, w, s[0], s[1], s[2], stages=n,
                                                              interpret=interp))
    rows.append((f"fused s{stages}", median_ms_back_to_back(fn, x, wi, scales, iters=iters)))

  def gemms(x, wg, wu, s):
    return (fm.fp8_matmul_tn(x, wg, s[0], jnp.bfloat16, b_scale=s[1], interpret=interp),
            fm.fp8_matmul_tn(x, wu, s[0], jnp.bfloat16, b_scale=s[2], interpret=interp))

  unfused = jax.jit(lambda x, wg, wu, s: kernels.swiglu_quantize(*gemms(x, wg, wu, s), 16))
  rows.append(("unfused", median_ms_back_to_back(unfused, x, wg, wu, scales, iters=iters)))
  rows.append(("GEMMs", median_ms_back_to_back(jax.jit(gemms), x, wg, wu, scales, iters=iters)))
  rng = np.random.default_rng(1)
  w32 = [jnp.asarray(rng.standard_normal((k, f)) * 0.02, jnp.float32) for _ in range(2)]

  def default_codes(a, b):
    out = []
    for w in (a, b):
      wc = w.astype(jnp.bfloat16)
      out.append(kernels.quantize_per_tensor(wc, "e4m3", amax=jnp.max(jnp.abs(wc)),
                                             with_transpose=True).data_t)
    return out

  def epilogue_codes(a, b):
    (_, qa), (_, qb) = weight_codes_t(a, jnp.bfloat16), weight_codes_t(b, jnp.bfloat16)
    return fs.interleave_gate_up(qa.data, qb.data)

  rows.append(("weights: default", median_ms_back_to_back(jax.jit(default_codes), *w32,
                                                          iters=iters)))
  rows.append(("weights: interleaved", median_ms_back_to_back(jax.jit(epilogue_codes), *w32,
                                                              iters=iters)))
  flops = 2 * m * 2 * f * k
  peaks = gpu_peaks(jax.devices()[0].device_kind)
  peak_fp8, hbm = peaks["fp8_flops"], peaks["hbm_bytes_per_s"]
  swiglu_bytes = m * f * (2 * 2 + 2 + 2 * 1) + 2 * (m * f // 16) * 2
  print(f"  floors: GEMM {flops / peak_fp8 * 1e3:.3f} ms, SwiGLU pass {swiglu_bytes / hbm * 1e3:.3f} ms")
  print(f"  {'path':<22}{'ms':>9}{'TFLOP/s':>10}")
  for label, ms in rows:
    tf = f"{flops / ms / 1e9:>10.0f}" if not label.startswith("weights") else f"{'':>10}"
    print(f"  {label:<22}{ms:>9.3f}{tf}")
  best = min(ms for label, ms in rows if label.startswith("fused"))
  unf = dict(rows)["unfused"]
  print(f"  saved by the fused kernel: {unf - best:.3f} ms per layer ({(unf - best) / unf:.1%})")
  return rows


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shapes", default="olmo,7b", help=f"comma-separated of {sorted(SHAPES)}")
  p.add_argument("--iters", type=int, default=20)
  args = p.parse_args()
  names = [s for s in args.shapes.split(",") if s]
  for s in names:
    if s not in SHAPES:
      raise SystemExit(f"bench_gemm_swiglu: unknown shape {s!r}; shapes: {sorted(SHAPES)}")
  interpret = jax.default_backend() != "gpu"
  print(f"device {jax.devices()[0].device_kind}")
  for s in names:
    m, f, k = (512, 128, 256) if interpret else SHAPES[s]
    run_shape(s, m, f, k, 2 if interpret else args.iters, interpret)


if __name__ == "__main__":
  main()
