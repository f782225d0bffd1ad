"""One Llama decoder layer per precision mode: time and activation memory held for backward.

Default shape: COAT's per-layer benchmark (OLMo/Llama-2-7B layer: d_model 4096, 32 heads, SwiGLU
11008, batch 8 x 2048 tokens, bf16 compute). Per mode it prints
  fwd ms       median of --iters jitted forward calls (after --warmup), block_until_ready
  fwd+bwd ms   median of one jitted jax.vjp + pullback (and, on the line below the table, the
               same call run back to back: 10 calls per block, no host round trip per call)
  saved MB     bytes of the residuals JAX keeps for backward (coat_jax.memory), params/input excluded
  held MB      device bytes_in_use added by a forward that returns its pullback, less the
               output and any weight copies among the pullback's leaves (GPU only)
  peak MB      device peak_bytes_in_use during forward + backward (GPU only)
with ratios against "bf16", next to COAT's PyTorch numbers measured on the same H100 model.

  python -m benchmarks.layer.bench_layer                       # GPU, full shape
  python -m benchmarks.layer.bench_layer --batch 1 --seq 64 --hidden 256 --heads 4 --ffn 688 --iters 3
  python -m benchmarks.layer.bench_layer --modes coat --weight-quant once   # ablation: W quantized once
  python -m benchmarks.layer.bench_layer --modes coat --amax kernel         # ablation: amax kernel pass
  python -m benchmarks.layer.bench_layer --modes coat --weight-quantize kernel  # ablation: W by Mosaic
  python -m benchmarks.layer.bench_layer --modes coat --attention-residuals fp8  # FP8 q, k, v kept
  python -m benchmarks.layer.bench_layer --modes coat --linear-residuals remade  # x^T, h^T remade
  python -m benchmarks.layer.bench_layer --modes coat --activation-quantize xla --gradient-quantize xla
  python -m benchmarks.layer.bench_layer --modes coat --swiglu-quantize separate  # SwiGLU unfused
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks._common import (REPO, median_ms, median_ms_back_to_back, module_command,
                                parse_modes)
from coat_jax import memory, ops
from coat_jax.ops import linear_ablation
from coat_jax.nn import DecoderBlock
from coat_jax.precision import PRECISIONS as MODES

# COAT's benchmark/benchmark_olmolayer.py on the lent H100 (shared/gpu_notes.md, 2026-11-22).
COAT_REFERENCE = {"bf16 (PyTorch)": (14.6, 42.4, 2914.0), "coat (PyTorch+Triton)": (10.3, 29.4, 1723.0)}
MB = 1e6


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--hidden", type=int, default=4096)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--kv-heads", type=int, default=None)
  p.add_argument("--ffn", type=int, default=11008)
  p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + str(MODES))
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--param-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                 help="layer weights (COAT's benchmark uses bf16 weights)")
  p.add_argument("--attention", default="auto",
                 help="attention implementation: auto (cudnn on GPU, xla elsewhere), cudnn, xla")
  p.add_argument("--attention-residuals", default="bf16", choices=ops.ATTENTION_RESIDUALS,
                 help="what the attention keeps of q, k, v for its backward: bf16 (default) or "
                      "fp8 (1 x 16 E4M3 copies, the attention recomputed in the backward)")
  p.add_argument("--linear-residuals", default="kept", choices=ops.LINEAR_RESIDUALS,
                 help="what Q/K/V, gate/up and down keep of their FP8 inputs for dW: kept "
                      "(default, their transposed codes) or remade (from the norms' and "
                      "SwiGLU's 1 x 16 codes in the backward)")
  # the FP8 linears' ablation switches (coat_jax.ops.linear_ablation.ablation), a flag each; the
  # default is the library's choice (the first)
  helps = {
      "weight_quant": "FP8 modes: quantize W in forward and backward (per_use) or once per step, "
                      "the backward reusing the forward's FP8 copy (once)",
      "amax": "FP8 modes: per-tensor amax of x and dY as an XLA reduction fusable into the "
              "producer (fused) or in the quantize's own pass (kernel)",
      "weight_quantize": "FP8 modes: W's per-tensor quantize by the dispatch's kernel in the "
                         "forward (forward_kernel), in both passes (kernel) or as XLA ops fused "
                         "with its cast (xla)",
      "activation_quantize": "FP8 modes: each linear's x quantized (E4M3 + transposed copy) by "
                             "the dispatch's kernel or as XLA ops fusable into x's producer (xla)",
      "gradient_quantize": "FP8 modes: the same for each linear's dY (E5M2) in the backward",
      "swiglu_quantize": "coat: SwiGLU's h and gate/up's 1 x 16 codes in the gate/up GEMM's "
                         "epilogue (gemm_epilogue), from one read of gate and up (fused), or h "
                         "by XLA and two per-group quantizes (separate)",
      "weight_transpose": "FP8 modes: W^T for the forward GEMM by transposing W's FP8 codes "
                          "(codes) or quantizing the transposed cast weight (cast)",
      "remake_quantize": "coat with --linear-residuals remade: the remade x^T codes by one "
                         "kernel from the 1 x 16 codes (fused), x written, then the quantize "
                         "kernel (kernel), or one XLA fusion (xla)"}
  for name, choices in linear_ablation.CHOICES.items():
    p.add_argument("--" + name.replace("_", "-"), default=choices[0], choices=choices,
                   help=helps[name])
  p.add_argument("--json", default=None, help="also write the results to this file")
  p.add_argument("--in-process", action="store_true",
                 help="run all modes in this process (default: one subprocess per mode, so that "
                      "each mode's peak_bytes_in_use is its own)")
  p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.modes = parse_modes(p, args.modes, MODES)
  return args


def device_bytes(key: str) -> int | None:
  stats = jax.devices()[0].memory_stats()
  return None if not stats or key not in stats else int(stats[key])


def param_copy_bytes(pullback, params) -> int:
  """Bytes of pullback leaves that equal a parameter in value but live in another buffer."""
  param_leaves = jax.tree_util.tree_leaves(params)
  ptrs = {p.unsafe_buffer_pointer() for p in param_leaves}
  total, seen = 0, set()
  for leaf in jax.tree_util.tree_leaves(pullback):
    if not hasattr(leaf, "unsafe_buffer_pointer"):
      continue
    ptr = leaf.unsafe_buffer_pointer()
    if ptr in ptrs or ptr in seen:
      continue
    if any(p.shape == leaf.shape and p.dtype == leaf.dtype and bool(jnp.array_equal(p, leaf))
           for p in param_leaves):
      seen.add(ptr)
      total += leaf.nbytes
  return total


def bench_mode(mode: str, args) -> dict:
  impl = args.attention
  if impl == "auto":
    impl = "cudnn" if jax.devices()[0].platform == "gpu" else None
  elif impl == "xla":
    impl = None
  head_dim = args.hidden // args.heads
  block = DecoderBlock(args.hidden, args.ffn, args.heads, args.kv_heads or args.heads, head_dim,
                       mode=mode, dtype=jnp.bfloat16, param_dtype=jnp.dtype(args.param_dtype),
                       attention_impl=impl, attention_residuals=args.attention_residuals,
                       linear_residuals=args.linear_residuals, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(block)
  del block
  cos, sin = ops.rope_frequencies(head_dim, args.seq)
  kx, kd = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (args.batch, args.seq, args.hidden), jnp.bfloat16)
  dy = jax.random.normal(kd, x.shape, jnp.bfloat16)

  def layer(params, x):
    return nnx.merge(graphdef, params)(x, cos, sin)

  fwd = jax.jit(layer)
  fwd_with_pullback = jax.jit(lambda p, x: jax.vjp(layer, p, x))

  @jax.jit
  def fwd_bwd(params, x, dy):
    y, pullback = jax.vjp(layer, params, x)
    return y, pullback(dy)

  result = {"mode": mode}
  result["saved_bytes"] = memory.saved_residual_bytes(layer, params, x)
  result["fwd_ms"] = median_ms(lambda: fwd(params, x), args.iters, args.warmup)
  result["fwd_bwd_ms"] = median_ms(lambda: fwd_bwd(params, x, dy), args.iters, args.warmup)

  # Memory held between forward and backward: bytes_in_use added by a forward that keeps its
  # residuals (the returned pullback), less the output itself.
  jax.block_until_ready(fwd_with_pullback(params, x))  # compile outside the measurement
  before = device_bytes("bytes_in_use")
  y, pullback = fwd_with_pullback(params, x)
  jax.block_until_ready((y, pullback))
  after = device_bytes("bytes_in_use")
  # A jit that returns its pullback may return copies of the (bf16) weights the pullback keeps,
  # where an in-step backward would read the parameters themselves: those copies are weights,
  # not activations, and are not counted.
  copies = param_copy_bytes(pullback, params)
  result["param_copy_bytes"] = copies
  result["held_bytes"] = None if before is None else after - before - y.nbytes - copies
  del y, pullback
  result["peak_bytes"] = device_bytes("peak_bytes_in_use")
  # The same call back to back (one block per 10 calls): without the per-call host round trip,
  # as the layers run inside a training step. Last: its 10 calls' outputs in flight together
  # would raise the peak above.
  result["fwd_bwd_b2b_ms"] = median_ms_back_to_back(fwd_bwd, params, x, dy, iters=10,
                                                    repeats=max(3, args.iters // 4))
  return result


def fmt(v, scale=1.0, digits=1):
  return "n/a" if v is None else f"{v / scale:.{digits}f}"


def ratio(v, ref):
  return "" if v is None or not ref else f" ({v / ref:.2f}x)"


def print_table(results: list[dict], args) -> None:
  dev = jax.devices()[0]
  print(f"\ndecoder layer: batch {args.batch} x seq {args.seq}, hidden {args.hidden}, heads "
        f"{args.heads}, ffn {args.ffn}, bf16 compute, {args.param_dtype} weights; device "
        f"{dev.device_kind} ({dev.platform}); median of {args.iters}; FP8 weights quantized "
        f"{args.weight_quant.replace('_', ' ')} by {args.weight_quantize}, activation amax "
        f"{args.amax}; x quantized by {args.activation_quantize}, dY by "
        f"{args.gradient_quantize}; attention residuals {args.attention_residuals}; linear "
        f"residuals {args.linear_residuals}"
        + (f" (by {args.remake_quantize})" if args.linear_residuals == "remade" else ""))
  ref = next((r for r in results if r["mode"] == "bf16"), None)
  head = f"{'mode':<24}{'fwd ms':>16}{'fwd+bwd ms':>18}{'saved MB':>18}{'held MB':>18}{'peak MB':>12}"
  print(head)
  print("-" * len(head))
  for r in results:
    print(f"{r['mode']:<24}"
          f"{fmt(r['fwd_ms'], digits=2) + ratio(r['fwd_ms'], ref and ref['fwd_ms']):>16}"
          f"{fmt(r['fwd_bwd_ms'], digits=2) + ratio(r['fwd_bwd_ms'], ref and ref['fwd_bwd_ms']):>18}"
          f"{fmt(r['saved_bytes'], MB) + ratio(r['saved_bytes'], ref and ref['saved_bytes']):>18}"
          f"{fmt(r['held_bytes'], MB) + ratio(r['held_bytes'], ref and ref['held_bytes']):>18}"
          f"{fmt(r['peak_bytes'], MB):>12}")
  print("fwd+bwd back to back (10 calls per block, as inside a training step): " + ", ".join(
      f"{r['mode']} {fmt(r.get('fwd_bwd_b2b_ms'), digits=2)} ms" for r in results))
  print("COAT's own benchmark (PyTorch, same H100 model, batch 8 x 2048, hidden 4096):")
  base = COAT_REFERENCE["bf16 (PyTorch)"]
  for name, (f, fb, mem) in COAT_REFERENCE.items():
    print(f"{name:<24}{f:>16.2f}{f'{fb:.2f} ({fb / base[1]:.2f}x)':>18}{'':>18}"
          f"{f'{mem:.1f} ({mem / base[2]:.2f}x)':>18}")


def bench_mode_subprocess(mode: str, argv: list[str]) -> dict:
  """Runs one mode in a fresh process (its own device peak counter) and returns its result."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "result.json")
    cmd = module_command(__file__) + [*argv, "--modes", mode, "--in-process", "--json", out,
                                      "--quiet"]
    subprocess.run(cmd, check=True, cwd=REPO)
    with open(out) as f:
      return json.load(f)["results"][0]


def strip_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
  """argv without `flags` and their values (both `--flag v` and `--flag=v` forms)."""
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
    elif a in flags:
      skip = True
    elif not any(a.startswith(f + "=") for f in flags):
      out.append(a)
  return out


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  results = []
  for mode in args.modes:
    print(f"benchmarking {mode} ...", flush=True)
    if args.in_process:
      # read while the layer traces
      with linear_ablation.ablation(**{k: getattr(args, k) for k in linear_ablation.CHOICES}):
        results.append(bench_mode(mode, args))
    else:
      results.append(bench_mode_subprocess(mode, strip_flags(argv, ("--modes", "--json"))))
  if args.quiet:
    with open(args.json, "w") as f:
      json.dump({"results": results}, f)
    return
  print_table(results, args)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
  main()
