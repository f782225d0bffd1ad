"""SwiGLU's backward to the gate/up GEMMs' FP8 gradients: the unfused path (the Mosaic GPU
SwiGLU backward writing d_gate, d_up in bf16, then two per-tensor E5M2 quantizes with their
transposed copies) against the two Triton passes of
pallas_kernels/quantize/swiglu_grad_quantize_triton.py, by the GPU's own time, with the byte floor
at --bandwidth, and the codes compared.

  python3 -m benchmarks.kernels.bench_swiglu_grad_quantize --shapes 16384x8192,16384x11008
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import device_ms_per_call, parse_shapes
from coat_jax import formats, kernels
from pallas_kernels.quantize import swiglu_grad_quantize_triton as sq

G = 16


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default="16384x8192,16384x11008")
  p.add_argument("--tiles", default="64x64x4", help="BMxBNxWARPS,... (default: the kernel's)")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s for the floor")
  args = p.parse_args(argv)
  e5 = formats.get_format("e5m2")
  print(f"{jax.devices()[0].device_kind}; seed 0; floor at {args.bandwidth / 1e12:.2f} TB/s")
  for m, n in parse_shapes(p, "--shapes", args.shapes, "MxN"):
    rng = np.random.default_rng(0)
    gate = jnp.asarray(rng.normal(0, 2, (m, n)), jnp.bfloat16)
    up = jnp.asarray(rng.normal(0, 2, (m, n)), jnp.bfloat16)
    dh = jnp.asarray(rng.normal(0, 1e-3, (m, n)), jnp.bfloat16)
    gq, uq = (kernels.quantize_per_group(a, G, "e4m3") for a in (gate, up))
    del gate, up

    @jax.jit
    def unfused(dh, gq, uq):
      dg, du, ag, au = kernels.swiglu_backward(gq, uq, dh)
      qg = kernels.quantize_per_tensor(dg, "e5m2", amax=ag, with_transpose=True)
      qu = kernels.quantize_per_tensor(du, "e5m2", amax=au, with_transpose=True)
      return qg.data, qg.data_t, qg.scale, qu.data, qu.data_t, qu.scale

    ref = jax.block_until_ready(unfused(dh, gq, uq))
    base = device_ms_per_call(unfused, dh, gq, uq, iters=args.iters)
    scale_bytes = 2 * gq.scale.size * gq.scale.dtype.itemsize
    fused_bytes = 2 * (m * n * 4 + scale_bytes) + 4 * m * n
    unfused_bytes = (m * n * 4 + scale_bytes) + 4 * m * n + 2 * (2 * m * n + 2 * m * n)
    floor = lambda b: b / args.bandwidth * 1e3
    print(f"\n({m}, {n}): unfused {base:.3f} ms ({unfused_bytes / 1e9:.2f} GB, floor "
          f"{floor(unfused_bytes):.3f} ms); fused floor {floor(fused_bytes):.3f} ms "
          f"({fused_bytes / 1e9:.2f} GB)")
    print(f"{'tile BMxBNxwarps':>18} {'ms':>8} {'vs unfused':>11} {'/ floor':>8} "
          f"{'codes differing g, u':>18} {'scales equal':>13}")
    for tile in args.tiles.split(","):
      bm, bn, w = (int(t) for t in tile.split("x"))
      fn = jax.jit(lambda dh, gq, uq, bm=bm, bn=bn, w=w: sq.swiglu_grad_quantize(
          dh, gq.data, gq.scale, uq.data, uq.scale, group_size=G, out_dtype=e5.dtype,
          fmax=e5.max, floor=formats.ACTIVATION_SCALE_FLOOR, block_m=bm, block_n=bn,
          num_warps=w))
      try:
        (qg, qgt, sg), (qu, qut, su), _ = jax.block_until_ready(fn(dh, gq, uq))
        ms = device_ms_per_call(fn, dh, gq, uq, iters=args.iters)
      except Exception as e:  # noqa: BLE001 - a tile that does not compile is a table row
        print(f"{tile:>18} failed: {str(e).splitlines()[0][:100]}")
        continue
      eq = [int(jnp.sum(a.view(jnp.uint8) != b.view(jnp.uint8)))
            for a, b in ((qg, ref[0]), (qu, ref[3]))]
      teq = (f"{qgt.shape} vs ref {ref[1].shape}: "
             f"{float(jnp.mean((qgt.view(jnp.uint8) == qg.T.view(jnp.uint8)).astype(jnp.float32))):.6f}"
             f" of q^T, ref {float(jnp.mean((ref[1].view(jnp.uint8) == ref[0].T.view(jnp.uint8)).astype(jnp.float32))):.6f}"
             if qgt.shape == ref[1].shape else f"shapes {qgt.shape} {ref[1].shape}")
      pass1 = jax.jit(lambda dh, gq, uq, bm=bm, bn=bn, w=w: sq.maxima(
          dh, gq.data, gq.scale, uq.data, uq.scale, group_size=G, block_m=bm, block_n=bn,
          num_warps=w))
      ms1 = device_ms_per_call(pass1, dh, gq, uq, iters=args.iters)
      print(f"{tile:>22} {ms:8.3f} (pass 1 {ms1:.3f}) {base / ms:10.2f}x {ms / floor(fused_bytes):7.2f}x "
            f"{eq[0]:9d} {eq[1]:8d} {str(bool(sg == ref[2]) and bool(su == ref[5])):>13}"
            f"  transposes equal: {teq}")


if __name__ == "__main__":
  main()
