"""cuDNN's FP8 flash attention (forward and backward) against its bf16 one: error and time.

Can cuDNN's FP8 attention be reached from JAX, and is it correct? JAX reaches it through
`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(use_fp8=True)` (a private
module: no public API takes FP8 attention). Its FP8 tensors are q, k, v, the output
o, the output's gradient do, and the gradients dq, dk, dv; inside, the probabilities P and their
gradient dP are quantized too. Every one of them takes a per-tensor scale the caller passes in
(`fp8_params`: `descale_X` multiplies stored codes back to values, `scale_X` multiplies values
into codes), and it returns the amaxes of P, o, dP, dq, dk, dv for the caller to use next time:
delayed scaling, which COAT does not use (it computes every scale just in time).

So this benchmark gives cuDNN its best case, scales no running system could know beforehand:
q, k, v and do at their own amaxes (just in time), o at max|v| (a convex combination of v's rows
cannot exceed it), P at 1, and dP, dq, dk, dv at the amaxes of a float32 reference pass. If the
gradients are not close to bf16's even then, delayed scaling can only be worse.

Error: relative L2 (||x - ref|| / ||ref||) and cosine of o, dq, dk, dv against float32 attention
on the same bf16 inputs (einsums at HIGHEST precision), for cuDNN bf16 and cuDNN FP8 alike.
Time: fwd+bwd of each, jitted, back to back (median of 7 x 10 calls).

    python3 -m benchmarks.kernels.bench_attention_fp8                     # OLMo-1B's and Llama-2-7B's shape
    python3 -m benchmarks.kernels.bench_attention_fp8 --shapes 8x2048x16x128 --seed 3 --do-scale 1
"""
from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import median_ms_back_to_back, parse_shapes
from coat_jax.quantize import quantize_per_tensor

E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)   # 448
FP8_PARAM_KEYS = ("amax_dQ", "amax_dK", "amax_dV", "amax_dP", "descale_q", "descale_k",
                  "descale_v", "descale_s", "scale_s", "scale_o", "descale_o", "descale_dO",
                  "descale_dP", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
SHAPES = {"olmo-1b": (8, 2048, 16, 128), "llama2-7b": (8, 2048, 32, 128)}  # (B, T, N, H)


def reference(q, k, v, do, scale):
  """float32 causal attention: o, (dq, dk, dv), and dP = do v^T (the probabilities' gradient)."""
  hi = jax.lax.Precision.HIGHEST
  t = q.shape[1]
  causal = jnp.tril(jnp.ones((t, t), bool))

  def attend(q, k, v):
    s = jnp.einsum("bqnh,bknh->bnqk", q, k, precision=hi) * scale
    p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    return jnp.einsum("bnqk,bknh->bqnh", p, v, precision=hi)

  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  o, pullback = jax.vjp(attend, *f32[:3])
  dp = jnp.einsum("bqnh,bknh->bnqk", f32[3], f32[2], precision=hi)
  dp_amax = jnp.max(jnp.abs(jnp.where(causal, dp, 0.0)))
  return o, pullback(f32[3]), dp_amax


def cudnn_bf16(q, k, v, do):
  o, pullback = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn"), q, k, v)
  return o, pullback(do)


def fp8_operands(q, k, v, do, ref_amax, swap_o_do=False):
  """The FP8 codes of q, k, v, do and cuDNN's `fp8_params` at the best-case scales (module
  docstring). swap_o_do: pass o's descale as `descale_dO` and do's as `descale_o` (a probe:
  does the backward read them in that order?)."""
  q8, k8, v8, do8 = (quantize_per_tensor(x, "e4m3") for x in (q, k, v, do))  # x = data * scale
  one = lambda x: jnp.reshape(jnp.asarray(x, jnp.float32), (1, 1, 1, 1))
  desc_o = v8.scale              # |o| <= max|v|: o at v's scale never overflows
  p = {key: one(1.0) for key in FP8_PARAM_KEYS}
  p.update(descale_q=one(q8.scale), descale_k=one(k8.scale), descale_v=one(v8.scale),
           descale_dO=one(do8.scale),
           descale_s=one(1.0 / E4M3_MAX), scale_s=one(E4M3_MAX),
           scale_o=one(1.0 / desc_o), descale_o=one(desc_o))
  for name, a in zip(("dP", "dQ", "dK", "dV"), ref_amax):
    p[f"scale_{name}"] = one(E4M3_MAX / a)
  p["descale_dP"] = one(ref_amax[0] / E4M3_MAX)
  if swap_o_do:
    p["descale_o"], p["descale_dO"] = p["descale_dO"], p["descale_o"]
  return q8.data, k8.data, v8.data, do8.data, p


def fp8_attention(q8, k8, v8, do8, p, scale):
  """cuDNN's FP8 attention forward and backward on codes: (o8, dq8, dk8, dv8, its amaxes)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa

  def attend(q8, k8, v8, p):
    return fa.dot_product_attention(q8, k8, v8, fp8_params=p, scale=scale,
                                    mask_type=fa.MaskType.CAUSAL, use_fp8=True)

  (o8, amax_s, amax_o), pullback = jax.vjp(attend, q8, k8, v8, p)
  dq8, dk8, dv8, p_grads = pullback((do8, jnp.ones_like(amax_s), jnp.ones_like(amax_o)))
  reported = dict(amax_s=amax_s, amax_o=amax_o,
                  **{k: p_grads[k] for k in ("amax_dP", "amax_dQ", "amax_dK", "amax_dV")})
  return o8, dq8, dk8, dv8, reported


def cudnn_fp8(q, k, v, do, ref_amax, scale, swap_o_do=False):
  """From bf16 q, k, v, do: quantize, FP8 attention, o, dq, dk, dv dequantized to float32 (at
  the scales passed in), and the amaxes cuDNN reports."""
  q8, k8, v8, do8, p = fp8_operands(q, k, v, do, ref_amax, swap_o_do)
  o8, dq8, dk8, dv8, reported = fp8_attention(q8, k8, v8, do8, p, scale)
  deq = lambda c, s: c.astype(jnp.float32) * jnp.reshape(s, ())
  grads = (deq(dq8, 1.0 / p["scale_dQ"]), deq(dk8, 1.0 / p["scale_dK"]),
           deq(dv8, 1.0 / p["scale_dV"]))
  return deq(o8, 1.0 / p["scale_o"]), grads, reported


def rel_l2(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  if not np.all(np.isfinite(x)):
    return float("nan")
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def cosine(x, ref):
  x, ref = np.asarray(x, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
  return float(x @ ref / (np.linalg.norm(x) * np.linalg.norm(ref)))


def run(shape, seed, iters, do_scale):
  b, t, n, h = shape
  scale = 1.0 / math.sqrt(h)
  print(f"shape B {b} T {t} heads {n} head_dim {h}, causal, seed {seed}, do ~ N(0, {do_scale:g}^2)")
  keys = jax.random.split(jax.random.key(seed), 4)
  q, k, v, do = (jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16) for kk in keys)
  do = (do * do_scale).astype(jnp.bfloat16)    # default 1e-3: a loss gradient's size, far from 1
  o_ref, g_ref, dp_amax = jax.jit(reference, static_argnums=4)(q, k, v, do, scale)
  amax = lambda x: float(jnp.max(jnp.abs(x)))
  ref_amax = (float(dp_amax), *(amax(g) for g in g_ref))
  fns = {"cudnn bf16": jax.jit(cudnn_bf16)}
  for name, swap in (("cudnn fp8", False), ("cudnn fp8, o/dO descales swapped", True)):
    fns[name] = jax.jit(lambda q, k, v, do, swap=swap: cudnn_fp8(q, k, v, do, ref_amax, scale,
                                                                  swap))
  print(f"  reference amaxes: o {amax(o_ref):.4g} dP {ref_amax[0]:.4g} dq {ref_amax[1]:.4g} "
        f"dk {ref_amax[2]:.4g} dv {ref_amax[3]:.4g}")
  rows, ms = {}, {}
  for name, fn in fns.items():
    try:
      out = fn(q, k, v, do)
    except Exception as e:  # noqa: BLE001 - report why FP8 attention is out of reach here
      print(f"  {name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}")
      continue
    rows[name] = out[:2]
    if len(out) > 2:
      print(f"  {name}: cuDNN's amaxes", {k: f"{float(jnp.reshape(x, ())):.4g}"
                                          for k, x in out[2].items()})
    ms[name] = median_ms_back_to_back(fn, q, k, v, do, iters=iters)
  operands = jax.jit(lambda q, k, v, do: fp8_operands(q, k, v, do, ref_amax))(q, k, v, do)
  codes_only = jax.jit(lambda *a: fp8_attention(*a, scale))
  ms_codes = median_ms_back_to_back(codes_only, *operands, iters=iters)
  print(f"  cudnn fp8 on codes alone (no quantize of q, k, v, do, no dequantize of the outputs): "
        f"{ms_codes:.3f} ms fwd+bwd")
  names = ("o", "dq", "dk", "dv")
  print(f"  {'':34s} " + " ".join(f"{nm + ' relL2':>10s} {nm + ' cos':>9s}" for nm in names)
        + f" {'fwd+bwd ms':>10s}")
  for name, (o, grads) in rows.items():
    cells = []
    for x, ref in zip((o, *grads), (o_ref, *g_ref)):
      x = np.asarray(jnp.asarray(x, jnp.float32))
      cells.append(f"{rel_l2(x, ref):10.2e} {cosine(x, ref):9.5f}")
    print(f"  {name:34s} " + " ".join(cells) + f" {ms[name]:10.3f}")
  flops = 4 * b * n * t * t * h / 2 * 3.5          # causal: half the (T, T) products; bwd 2.5x fwd
  print(f"  fwd+bwd at ~{flops / 1e12:.2f} TFLOP: bf16 floor {flops / 989e12 * 1e3:.3f} ms, "
        f"fp8 floor {flops / 1979e12 * 1e3:.3f} ms (dense peaks)")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default="olmo-1b,llama2-7b",
                 help=f"comma-separated names {tuple(SHAPES)} or BxTxNxH")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--do-scale", type=float, default=1e-3,
                 help="standard deviation of the output's gradient (q, k, v: 1)")
  args = p.parse_args(argv)
  shapes = parse_shapes(p, "--shapes", args.shapes, "BxTxNxH",
                        {name: [shape] for name, shape in SHAPES.items()})
  if jax.default_backend() != "gpu":
    p.error("cuDNN attention needs a GPU (this process sees "
            f"{jax.default_backend()})")
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  for shape in shapes:
    run(shape, args.seed, args.iters, args.do_scale)


if __name__ == "__main__":
  main()
