"""The gate/up FP8 GEMM with SwiGLU and gate's and up's 1 x G quantize in its epilogue (Pallas
Mosaic GPU, Hopper), so that gate and up are never written in bf16.

From x (M, K) FP8 codes and the gate and up weights' codes W_g^T, W_u^T (F, K), interleaved in
blocks of 64 rows (`interleave_gate_up`: 64 gate rows, the same 64 up rows, the next 64, ...):

  g = s_g * (x . W_g^T),  u = s_u * (x . W_u^T)        (float32 accumulators, s_* per tensor)
  h    = h_dtype(silu(g) * u),   silu(g) = g / (1 + exp(-g))
  hmax = max|h| per 1 x 64 block of columns (float32; the per-tensor amax of h is their max)
  gq, gs = g's per-group quantize, uq, us = u's (G = 16): quantize_mgpu's per-group scale
           (scale = max(amax * f32(1/fmax), floor) rounded to the scale dtype, NaN for a NaN/inf
           group), codes q = cast(clamp(g * (1 / scale), -fmax, fmax))

which COAT's MLP needs in its forward: h for the down projection, gate's and up's 1 x 16 codes as
SwiGLU's residuals. Unfused: two GEMMs write g and u in bf16, and `swiglu_mgpu` reads them again.
Here the codes are quantized from the float32 accumulators (no bf16 rounding of g and u first).

Most of the epilogue's instructions run on the special-function unit (16 results per clock per
SM on Hopper, against 128 FMAs) or reduce across lanes: an exp and every float32 division
(div.full.f32: a reciprocal there), and each group's maximum. Per gate/up pair the epilogue takes
one exp (`approx_math`: ex2.approx of x * log2(e), instead of libdevice's expf) and one division
(silu), and per 16 pairs one division for each group's 1 / scale, where dividing every element by
its scale took two more per pair. g * (1 / scale) and g / scale differ by about a float32 ulp, so
a code differs from quantize_mgpu's only where g / scale lies that close to an FP8 rounding
boundary, by one step (3 of 16.8 million E4M3 codes of normal values in groups of 16, against
IEEE division in numpy).

Kernel layout: fp8_matmul's ping-pong schedule (`fp8_matmul.pingpong`; one CTA per SM,
persistent over output tiles): warpgroup 2 streams (128, 128) tiles of x and of the interleaved
weights through a ring of `stages` shared-memory slots; warpgroups 0 and 1 each own whole
128 x 128 output tiles, alternating (a CTA's j-th tile goes to warpgroup j % 2), so that one
warpgroup's epilogue runs while the other's `wgmma` streams (the epilogue is as long as a tile's
products at K = 2048); each keeps one `wgmma` group in flight. Interleaving puts 64 columns of
gate and the same 64 of up in one accumulator, so SwiGLU is elementwise within it. The epilogue
takes the accumulator 16 columns at a time for the group maxima (one group = one row of 16),
stores h and the codes through swizzled shared memory with TMA and each group's scale straight to
global memory (scales laid out (F / G, M): one row per group column, contiguous across rows).
Imports jax only.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gemm.fp8_matmul import (FP8_DTYPES, SMEM_BYTES, SMEM_RESERVE, GemmConfig,
                                            num_sms, pingpong, pingpong_ring,
                                            smem_bytes_per_stage, swizzled)
from pallas_kernels.quantize.quantize_mgpu import group_scale, saturate, true_div

KERNEL_NAME = "coat_fp8_gemm_swiglu_mgpu"
HALF = 64                 # gate (and up) columns per warpgroup tile; the interleave block
GROUP = 16                # the 1 x G quantize group
TILE_M, TILE_K = 128, 128  # one warpgroup's output tile rows; K per ring slot
# The ring's tiling in fp8_matmul's terms (its shared memory per slot: `smem_bytes_per_stage`)
RING = GemmConfig(tile_m=TILE_M, tile_n=2 * HALF, tile_k=TILE_K, schedule="pingpong")
H_DTYPES = (jnp.dtype(jnp.bfloat16),)
SCALE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def problem(m: int, f: int, k: int, h_dtype) -> str | None:
  """Why the kernel does not take x (m, k) and gate/up (f, k) with h in h_dtype, or None."""
  if jnp.dtype(h_dtype) not in H_DTYPES:
    return f"h dtype {jnp.dtype(h_dtype)} (bfloat16 only)"
  if m % TILE_M or f % HALF or k % TILE_K:
    return f"(M, F, K) = {(m, f, k)}: M % {TILE_M}, F % {HALF} and K % {TILE_K} must be 0"
  return None


def interleave_gate_up(w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
  """(F, K) gate rows and (F, K) up rows -> (2F, K): 64 gate rows, the same 64 up rows, ..."""
  f, k = w_gate.shape
  if w_up.shape != (f, k) or f % HALF:
    raise ValueError(f"interleave_gate_up: gate {w_gate.shape} and up {w_up.shape} must be equal "
                     f"(F, K) with F % {HALF} == 0")
  dtype = w_gate.dtype
  per_word = 4 // dtype.itemsize
  if per_word > 1 and k % per_word == 0:
    # moved as 32-bit words (XLA's byte-wide copy of the FP8 codes ran at ~0.8 TB/s on the H200)
    w_gate, w_up = (lax.bitcast_convert_type(w.reshape(f, k // per_word, per_word), jnp.uint32)
                    for w in (w_gate, w_up))
  words = w_gate.shape[1]
  out = jnp.stack([w_gate.reshape(f // HALF, HALF, words), w_up.reshape(f // HALF, HALF, words)],
                  axis=1).reshape(2 * f, words)
  if out.dtype != dtype:
    out = lax.bitcast_convert_type(out, dtype).reshape(2 * f, k)
  return out


def _smem_bytes(stages: int, code_dtype) -> int:
  """Shared memory of the ring (x's and the weights' (128, 128) FP8 tiles per slot) and of both
  warpgroups' epilogue buffers (h, gate's and up's codes)."""
  epilogue = 2 * TILE_M * HALF * (2 + 2 * jnp.dtype(code_dtype).itemsize)
  return stages * smem_bytes_per_stage(RING) + epilogue + SMEM_RESERVE


@functools.lru_cache(maxsize=None)
def _kernel_fn(m, f, k, num_ctas, stages, interpret, code_dtype, scale_dtype, fmax, floor):
  tile_n = 2 * HALF
  m_iters, n_iters, k_iters = m // TILE_M, (2 * f) // tile_n, k // TILE_K
  h_t = swizzled(HALF, jnp.bfloat16)
  q_t = swizzled(HALF, code_dtype)
  groups = HALF // GROUP
  exact_div = interpret is not None

  def body(a_gmem, b_gmem, xs_gmem, gs_scale_gmem, us_scale_gmem, h_gmem, hmax_gmem, gq_gmem,
           gs_gmem, uq_gmem, us_gmem, ring, h_smem, gq_smem, uq_smem):
    # the products of x's scale and each weight's, as XLA's float32 multiply rounds them
    scale_g, scale_u = xs_gmem[0] * gs_scale_gmem[0], xs_gmem[0] * us_scale_gmem[0]

    def tile(wg, mi, ni, acc_ref):
      rows = pl.ds(mi * TILE_M, TILE_M)
      cols = pl.ds(ni * HALF, HALF)

      def quantize(x, s_gmem):
        """(TILE_M, HALF) float32 -> codes; each 1 x GROUP group's scale to s_gmem."""
        codes = []
        for q in range(groups):
          part = x[:, q * GROUP:(q + 1) * GROUP]
          stored = group_scale(jnp.max(jnp.abs(part), axis=1), fmax, floor).astype(scale_dtype)
          # one division per group row, then a product per element (module docstring)
          inv = true_div(jnp.float32(1.0), stored.astype(jnp.float32), exact_div)
          y = part * jnp.broadcast_to(inv[:, None], part.shape)
          codes.append(saturate(y, fmax).astype(code_dtype))
          s_gmem[ni * groups + q, rows] = stored
        return jnp.concatenate(codes, axis=1)

      acc = acc_ref[...]
      g, u = acc[:, :HALF] * scale_g, acc[:, HALF:] * scale_u
      h = (g / (1.0 + jnp.exp(-g)) * u).astype(jnp.bfloat16)
      hmax_gmem[ni, rows] = jnp.max(jnp.abs(h.astype(jnp.float32)), axis=1)
      gq, uq = quantize(g, gs_gmem), quantize(u, us_gmem)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last tile's stores read out
      h_smem[wg] = h
      gq_smem[wg] = gq
      uq_smem[wg] = uq
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(h_smem.at[wg], h_gmem.at[rows, cols])
      plgpu.copy_smem_to_gmem(gq_smem.at[wg], gq_gmem.at[rows, cols])
      plgpu.copy_smem_to_gmem(uq_smem.at[wg], uq_gmem.at[rows, cols])

    pingpong(a_gmem, b_gmem, ring, tile, grid=(m_iters, n_iters, k_iters),
             tile=(TILE_M, tile_n, TILE_K), num_ctas=num_ctas, in_flight=1, snake=(1, 8))

  codes = jax.ShapeDtypeStruct((m, f), code_dtype)
  scales = jax.ShapeDtypeStruct((f // GROUP, m), scale_dtype)
  return jax.jit(plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((m, f), jnp.bfloat16),
                jax.ShapeDtypeStruct((f // HALF, m), jnp.float32), codes, scales, codes, scales),
      scratch_types=dict(
          ring=pingpong_ring(stages, TILE_M, tile_n, TILE_K),
          h_smem=plgpu.SMEM((2, TILE_M, HALF), jnp.bfloat16, transforms=h_t),
          gq_smem=plgpu.SMEM((2, TILE_M, HALF), code_dtype, transforms=q_t),
          uq_smem=plgpu.SMEM((2, TILE_M, HALF), code_dtype, transforms=q_t)),
      grid=(num_ctas,), grid_names=("sm",), num_threads=3, thread_name="wg",
      kernel_name=KERNEL_NAME,
      # approx_math: exp as ex2.approx of x * log2(e) (relative error ~2^-21) instead of
      # libdevice's expf; divisions are unchanged (the kernel's only transcendental is silu's exp)
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                           approx_math=True),
      interpret=interpret))


def fp8_gemm_swiglu(x: jax.Array, w_interleaved: jax.Array, x_scale: jax.Array,
                    gate_scale: jax.Array, up_scale: jax.Array, *,
                    code_dtype=jnp.float8_e4m3fn, fmax: float = 448.0, floor: float = 1e-10,
                    scale_dtype=jnp.bfloat16, stages: int = 4, num_ctas: int | None = None,
                    interpret=None):
  """SwiGLU of the gate/up product with gate's and up's 1 x 16 quantize (module docstring).

  Args:
    x: float8 (M, K). w_interleaved: float8 (2F, K), `interleave_gate_up(W_g^T, W_u^T)` codes.
    x_scale, gate_scale, up_scale: float32 scalars, the per-tensor scales of x, W_g and W_u: the
      kernel scales gate's products by x_scale * gate_scale and up's by x_scale * up_scale (the
      products taken in the kernel, so that no XLA operation, a kernel launch of its own, makes
      them).
    code_dtype, fmax: the codes' FP8 dtype and its largest finite value; floor: the scales'
      floor; scale_dtype: bfloat16 or float32.
    stages: ring depth (4: 128 KiB of operand tiles beside 64 KiB of epilogue buffers; 2 to 5).
    num_ctas: persistent CTAs (default: the SM count). interpret: None on the GPU,
      `plgpu.InterpretGPUParams()` on the CPU.
  Returns:
    (h bf16 (M, F), hmax float32 (M, F / 64), gq code_dtype (M, F), gs scale_dtype (M, F / 16),
    uq, us likewise).
  """
  (m, k), f = x.shape, w_interleaved.shape[0] // 2
  if w_interleaved.shape != (2 * f, k) or jnp.dtype(x.dtype) not in FP8_DTYPES or (
      jnp.dtype(w_interleaved.dtype) not in FP8_DTYPES):
    raise ValueError(f"fp8_gemm_swiglu: x {x.shape} {x.dtype} and w {w_interleaved.shape} "
                     f"{w_interleaved.dtype} must be float8 (M, K) and (2F, K)")
  if (why := problem(m, f, k, jnp.bfloat16)) is not None:
    raise ValueError(f"fp8_gemm_swiglu: {why}")
  if jnp.dtype(scale_dtype) not in SCALE_DTYPES or jnp.dtype(code_dtype) not in FP8_DTYPES:
    raise ValueError(f"fp8_gemm_swiglu: scale dtype {scale_dtype} / code dtype {code_dtype}")
  if stages < 2 or _smem_bytes(stages, code_dtype) > SMEM_BYTES:
    raise ValueError(f"fp8_gemm_swiglu: {stages} stages (at least 2; "
                     f"{_smem_bytes(stages, code_dtype)} B of shared memory, at most {SMEM_BYTES})")
  tiles = (m // TILE_M) * (f // HALF)
  if num_ctas is None:
    num_ctas = 2 if interpret is not None else num_sms()
  fn = _kernel_fn(m, f, k, min(num_ctas, tiles), stages, interpret, jnp.dtype(code_dtype),
                  jnp.dtype(scale_dtype), float(fmax), float(floor))
  h, hmax, gq, gs, uq, us = fn(x, w_interleaved, *(jnp.asarray(s, jnp.float32).reshape(1)
                                                    for s in (x_scale, gate_scale, up_scale)))
  return h, hmax.T, gq, gs.T, uq, us.T
