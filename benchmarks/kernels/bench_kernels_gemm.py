"""FP8 GEMM on Hopper (H100, H200): XLA bf16 vs XLA fp8 (cuBLASLt) vs the Pallas Mosaic GPU TN kernel.

Run on the GPU:  PYTHONUNBUFFERED=1 python3 -m benchmarks.kernels.bench_kernels_gemm [--tune] [--shapes all]
                 python3 -m benchmarks.kernels.bench_kernels_gemm --shapes olmo,layer --configs m128x128,m128x128_f1
Prints one row per (M, N, K): TFLOP/s of each, ratios, relative error of Pallas vs XLA fp8, and
the FLOP floor 2MNK / peak (H100 and H200 SXM dense: fp8 1979, bf16 989 TFLOP/s).
All three take the same operands: A (M, K), B as (N, K) (TN); bf16 runs A @ B.T the same way.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks._common import median_ms_back_to_back, parse_shapes
from coat_jax.training.metrics import PEAK_BF16_FLOPS
from pallas_kernels.gemm import fp8_matmul as fm

PEAK_BF16 = dict(PEAK_BF16_FLOPS)["H100"]
PEAK_FP8 = 2 * PEAK_BF16  # Hopper's dense FP8 tensor-core rate is twice its BF16 rate
TN = (((1,), (1,)), ((), ()))
T = 16384  # 8 x 2048 tokens
SQUARE = [(4096, 4096, 4096), (8192, 8192, 8192)]
LAYER_7B = [  # (M, N, K)
    (T, 4096, 4096),      # fwd q/k/v/o; dX of q/k/v/o
    (T, 11008, 4096),     # fwd gate/up; dX of down
    (T, 4096, 11008),     # fwd down; dX of gate/up
    (4096, 4096, T),      # dW q/k/v/o (contract over tokens)
    (4096, 11008, T),     # dW gate/up
    (11008, 4096, T),     # dW down
]
LAYER_OLMO_1B = [  # (M, N, K): OLMo-1B, d 2048, SwiGLU 8192 (its q/k/v/o GEMMs are the smallest)
    (T, 2048, 2048),      # fwd q/k/v/o; dX of q/k/v/o
    (T, 8192, 2048),      # fwd gate/up; dX of down
    (T, 2048, 8192),      # fwd down; dX of gate/up
    (2048, 2048, T),      # dW q/k/v/o
    (2048, 8192, T),      # dW gate/up
    (8192, 2048, T),      # dW down
]
# Names without "_f1" wait for each K step's product before releasing its ring slot (the
# configurations as first measured); "_f1" leaves one wgmma group in flight, as the default does.
waiting = functools.partial(fm.GemmConfig, mma_in_flight=0)
TUNE = {
    "m128x128": waiting(),  # the default until one wgmma group was left in flight
    "n128x128": waiting(wg_dim="n"),
    "n128x128_s3": waiting(wg_dim="n", stages=3),
    "n128x128_gm_m": waiting(wg_dim="n", grid_minor="m"),
    "n128x128_w16": waiting(wg_dim="n", grid_tile_width=16),
    "n64x256": waiting(tile_m=64, tile_n=256, epi_n=128, wg_dim="n"),
    "m64x256": waiting(tile_m=64, tile_n=256, epi_n=128, wg_dim="m"),
    "n128x96": waiting(tile_m=128, tile_n=96, epi_n=32, wg_dim="n"),
    "m128x128_w4": waiting(wg_dim="m", grid_tile_width=4),
    "m128x128_gm_m": waiting(wg_dim="m", grid_minor="m"),
    # Two-CTA clusters, the shared operand's tile multicast (B's for "m", A's for "n")
    "m128x128_cm": waiting(cluster_dim="m"),
    "m128x128_cn": waiting(cluster_dim="n"),
    "n128x128_cm": waiting(wg_dim="n", cluster_dim="m"),
    "n128x128_cn": waiting(wg_dim="n", cluster_dim="n"),
    "m128x128_cm_gm_m": waiting(cluster_dim="m", grid_minor="m"),
    # Epilogue store pieces (fewer, larger TMA stores; 3 stages fit beside them)
    "m128x128_s3": waiting(stages=3),
    "m128x128_e64x128": waiting(epi_n=128),
    "m128x128_e128x128": waiting(epi_m=128, epi_n=128),
    # One wgmma group left in flight per K step (ring slots released a step later): the default
    "m128x128_f1": fm.GemmConfig(),
    "n128x128_f1": fm.GemmConfig(wg_dim="n"),
    "m128x128_cn_f1": fm.GemmConfig(cluster_dim="n"),
    "m128x128_cm_f1": fm.GemmConfig(cluster_dim="m"),
    "n128x128_cm_f1": fm.GemmConfig(wg_dim="n", cluster_dim="m"),
    "n128x128_cn_f1": fm.GemmConfig(wg_dim="n", cluster_dim="n"),
    "n64x256_f1": fm.GemmConfig(tile_m=64, tile_n=256, epi_n=128, wg_dim="n"),
    "m64x256_f1": fm.GemmConfig(tile_m=64, tile_n=256, epi_n=128, wg_dim="m"),
    "m128x192_f1": fm.GemmConfig(tile_n=192),
    "m128x128_w4_f1": fm.GemmConfig(grid_tile_width=4),
    "m128x128_w16_f1": fm.GemmConfig(grid_tile_width=16),
    "n128x128_w16_f1": fm.GemmConfig(wg_dim="n", grid_tile_width=16),
    "m128x128_gm_m_f1": fm.GemmConfig(grid_minor="m"),
    "n128x128_gm_m_f1": fm.GemmConfig(wg_dim="n", grid_minor="m"),
    "m128x128_e64x128_f1": fm.GemmConfig(epi_n=128),
    # Ping-pong: each consumer warpgroup owns whole tiles, the two in turn (epilogue overlapped)
    "pp128x128": waiting(schedule="pingpong"),
    "pp128x128_f1": fm.GemmConfig(schedule="pingpong"),
}


def operands(m, n, k, key):
  ka, kb = jax.random.split(key)
  a = jax.random.normal(ka, (m, k), jnp.float32) * 2.0
  b = jax.random.normal(kb, (n, k), jnp.float32) * 2.0
  return (a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn),
          a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))


def xla_fp8(a, b, s):
  acc = jax.lax.dot_general(a, b, TN, preferred_element_type=jnp.float32)
  return (acc * s).astype(jnp.bfloat16)


def xla_bf16(a, b):
  return jax.lax.dot_general(a, b, TN, preferred_element_type=jnp.bfloat16)


def rel_err(x, ref):
  x, ref = jnp.asarray(x, jnp.float32), jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def run_shape(m, n, k, configs, key, iters):
  a8, b8, a16, b16 = operands(m, n, k, key)
  s = jnp.float32(0.75)
  flops = 2.0 * m * n * k
  f_bf16 = jax.jit(xla_bf16)
  f_fp8 = jax.jit(xla_fp8)
  t_bf16 = 1e-3 * median_ms_back_to_back(f_bf16, a16, b16, iters=iters, repeats=5)
  t_fp8 = 1e-3 * median_ms_back_to_back(f_fp8, a8, b8, s, iters=iters, repeats=5)
  ref = f_fp8(a8, b8, s)
  rows = []
  for name, cfg in configs.items():
    amax = name.endswith("+amax")
    f_pl = jax.jit(lambda a, b, s, cfg=cfg, amax=amax: fm.fp8_matmul_tn(
        a, b, s, jnp.bfloat16, config=cfg, with_amax=amax))
    try:
      out = f_pl(a8, b8, s)
      if amax:
        out, gmax = out
        want = jnp.max(jnp.abs(ref.astype(jnp.float32)).reshape(m, -1, cfg.tile_n), axis=-1)
        if not bool(jnp.all(gmax.astype(jnp.bfloat16).astype(jnp.float32) == want)):
          print(f"  {m}x{n}x{k} {name}: epilogue amax differs from max|out|")
      err = rel_err(out, ref)
      t_pl = 1e-3 * median_ms_back_to_back(f_pl, a8, b8, s, iters=iters, repeats=5)
    except Exception as e:  # noqa: BLE001  (report and go on to the next variant)
      print(f"  {m}x{n}x{k} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
      continue
    rows.append((name, t_pl, err))
  return flops, t_bf16, t_fp8, rows


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--tune", action="store_true", help="all TUNE variants (else the default only)")
  p.add_argument("--shapes", default="all",
                 help="comma-separated of all, square, layer (7B), olmo (OLMo-1B's layer), MxNxK")
  p.add_argument("--configs", default="", help="comma-separated TUNE names (overrides --tune)")
  p.add_argument("--amax", action="store_true", help="also the default with the amax epilogue")
  p.add_argument("--iters", type=int, default=20)
  args = p.parse_args(argv)
  shapes = parse_shapes(p, "--shapes", args.shapes, "MxNxK",
                        {"all": SQUARE + LAYER_7B, "square": SQUARE, "layer": LAYER_7B,
                         "olmo": LAYER_OLMO_1B})
  bad = sorted(set(args.configs.split(",")) - set(TUNE) - {""})
  if bad:
    p.error(f"--configs: unknown {bad}; choose from {sorted(TUNE)}")
  configs = TUNE if args.tune else {"default": fm.DEFAULT_CONFIG}
  if args.configs:
    configs = {name: TUNE[name] for name in args.configs.split(",")}
  if args.amax:
    configs["default+amax"] = fm.DEFAULT_CONFIG
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  key = jax.random.key(0)
  table = []
  for m, n, k in shapes:
    key, sub = jax.random.split(key)
    flops, t_bf16, t_fp8, rows = run_shape(m, n, k, configs, sub, args.iters)
    for name, t_pl, err in rows:
      print(f"  {m}x{n}x{k} {name:16s} {flops / t_pl / 1e12:7.1f} TFLOP/s  err {err:.2e}")
    for name, t_pl, err in rows:
      table.append((m, n, k, flops, t_bf16, t_fp8, name, t_pl, err))
  print()
  print(f"{'M x N x K':>22} | {'bf16':>6} {'xla8':>6} {'pallas8':>7} | {'pl/xla8':>7} "
        f"{'pl/bf16':>7} | {'floor8 us':>9} {'pl us':>8} | {'rel err':>8} config")
  for m, n, k, flops, t_bf16, t_fp8, name, t_pl, err in table:
    tf = lambda t: flops / t / 1e12  # noqa: E731
    print(f"{m:>6}x{n:>6}x{k:>6}   | {tf(t_bf16):6.0f} {tf(t_fp8):6.0f} {tf(t_pl):7.0f} | "
          f"{t_fp8 / t_pl:7.2f} {t_bf16 / t_pl:7.2f} | {flops / PEAK_FP8 * 1e6:9.0f} "
          f"{t_pl * 1e6:8.0f} | {err:8.1e} {name}")


if __name__ == "__main__":
  main()
