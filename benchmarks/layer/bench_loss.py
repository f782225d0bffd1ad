"""The training loss's last op, timed and sized: the LM head + cross-entropy, logits path vs fused.

Each row is one jitted value_and_grad of the mean loss with respect to the final hidden states h
(N x D, the compute dtype) and the head (the tied embedding V x D by default, float32 as the
master weights), at --tokens N. "logits": `ops.lm_head` then `ops.softmax_cross_entropy` (all
N x V logits and their gradient held); "fused C": `ops.lm_head_loss` over chunks of C tokens.
Columns: median ms of the step (blocked calls), XLA's temp allocation for it (what the op adds to
a step's peak when it sits at the peak), the floor (the three GEMMs' 6 N D V FLOPs at the
device's dense BF16 peak), and whether the chunks' float32 dW accumulation runs inside the
weight-gradient GEMMs (cuBLAS with beta = 1, read off the optimized HLO) or as separate adds.

  python -m benchmarks.layer.bench_loss                       # GPU, OLMo-1B's head: N 16384, D 2048, V 50304
  python -m benchmarks.layer.bench_loss --tokens 8192 --hidden 4096 --vocab 128256 --untied   # Llama-3-8B, batch 4
  JAX_PLATFORMS=cpu python -m benchmarks.layer.bench_loss --tokens 512 --hidden 64 --vocab 1000 --chunks 128,256 --iters 2
"""
from __future__ import annotations

import argparse
import json
import re

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import median_ms
from coat_jax import ops
from coat_jax.training import metrics as metrics_lib


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tokens", type=int, default=16384, help="N = batch x sequence length")
  p.add_argument("--hidden", type=int, default=2048, help="D")
  p.add_argument("--vocab", type=int, default=50304, help="V")
  p.add_argument("--untied", action="store_true", help="a (D, V) head instead of the tied embedding")
  p.add_argument("--chunks", default="2048,4096,8192", help="fused rows: comma-separated chunk sizes")
  p.add_argument("--dtype", default="auto", help="compute dtype (auto: bfloat16 on GPU, float32 on CPU)")
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--json", default=None)
  a = p.parse_args(argv)
  for name in ("tokens", "hidden", "vocab", "iters"):
    if getattr(a, name) <= 0:
      p.error(f"--{name} must be > 0")
  try:
    a.chunks = [int(c) for c in a.chunks.split(",") if c.strip()]
  except ValueError:
    p.error(f"--chunks must be comma-separated ints, got {a.chunks!r}")
  if any(c <= 0 for c in a.chunks):
    p.error("--chunks must be positive")
  return a


def accumulation(hlo: str, v: int, d: int) -> str:
  """How the chunks' float32 dW sums run, read off the optimized HLO: "separate adds" when an add
  (or a fusion XLA named after its root add) writes an f32 (V, D) or (D, V) array, else "in GEMM"
  (the GEMM custom call accumulates into its output, cuBLAS's beta = 1)."""
  pattern = re.compile(rf"%(\S+) = f32\[({v},{d}|{d},{v})\]\{{[^}}]*\}} (\w+)\(")
  for name, _, op in pattern.findall(hlo):
    if op == "add" or (op == "fusion" and "add" in name):
      return "separate adds"
  return "in GEMM"


def measure(fn, args, iters):
  """(median ms, XLA temp bytes or None, optimized HLO text, fn's output) of one compile of fn."""
  compiled = jax.jit(fn).lower(*args).compile()
  ma = compiled.memory_analysis()
  temp = int(ma.temp_size_in_bytes) if ma is not None else None
  ms = median_ms(lambda: compiled(*args), iters, warmup=2)
  return ms, temp, compiled.as_text(), compiled(*args)


def main(argv=None):
  a = parse_args(argv)
  dtype = jnp.dtype(("bfloat16" if jax.default_backend() != "cpu" else "float32")
                    if a.dtype == "auto" else a.dtype)
  n, d, v, tied = a.tokens, a.hidden, a.vocab, not a.untied
  key = jax.random.split(jax.random.key(0), 3)
  print(f"seed 0; N {n}, D {d}, V {v}, {'tied (V, D)' if tied else 'untied (D, V)'} head, "
        f"{dtype.name} compute, float32 head, {jax.devices()[0].device_kind}")
  h = jax.random.normal(key[0], (n, d), dtype)
  w = 0.02 * jax.random.normal(key[1], (v, d) if tied else (d, v), jnp.float32)
  labels = jax.random.randint(key[2], (n,), 0, v, jnp.int32)
  peak = metrics_lib.peak_flops(jax.devices()[0])
  floor = 6 * n * d * v / peak * 1e3 if peak else None

  def logits_loss(h, w):
    return ops.softmax_cross_entropy(ops.lm_head(h, w, tied=tied), labels).mean()

  rows = [("logits", jax.value_and_grad(logits_loss, (0, 1)))]
  for c in a.chunks:
    rows.append((f"fused {c}", jax.value_and_grad(
        lambda h, w, c=c: ops.lm_head_loss(h, w, labels, tied=tied, chunk_tokens=c), (0, 1))))
  results, ref = [], None
  head = f"{'loss':12} {'ms':>8} {'floor ms':>8} {'temp GB':>8} {'logits GB':>9} {'dW sums':>14} {'loss value':>11}"
  print(head)
  print("-" * len(head))
  for name, fn in rows:
    ms, temp, hlo, (loss, _) = measure(fn, (h, w), a.iters)
    loss = float(loss)
    ref = loss if ref is None else ref
    if not np.isfinite(loss) or abs(loss - ref) > 1e-3 * abs(ref):
      raise SystemExit(f"bench_loss: {name} loss {loss} differs from the logits path's {ref}")
    acc = "-" if name == "logits" else accumulation(hlo, v, d)
    results.append(dict(loss=name, ms=ms, floor_ms=floor, temp_bytes=temp, value=loss,
                        dw_accumulation=acc))
    print(f"{name:12} {ms:8.2f} {('%8.2f' % floor) if floor else '     n/a'} "
          f"{('%8.2f' % (temp / 1e9)) if temp is not None else '     n/a'} "
          f"{2 * n * v * dtype.itemsize / 1e9:9.2f} {acc:>14} {loss:11.5f}")
  print("  temp GB: XLA's temp allocation of the op alone; logits GB: all logits and their "
        "gradient at the compute dtype (what the fused loss never holds)")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(args=vars(a), dtype=dtype.name, results=results), f, indent=1)
  return results


if __name__ == "__main__":
  main()
