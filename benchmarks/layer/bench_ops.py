"""Per-op time breakdown of the 7B decoder layer's pieces (forward + backward), per precision mode.

Each row is one jitted `jax.vjp` + pullback of one op at the layer's shapes (M = batch x seq
tokens), median of --iters. `--backends` also times the FP8 modes with the jnp/XLA references
instead of the Pallas kernels (coat_jax.kernels dispatch), so the kernels' share shows.

  python -m benchmarks.layer.bench_ops                                   # GPU, 7B layer shapes
  JAX_PLATFORMS=cpu python -m benchmarks.layer.bench_ops --tokens 256 --hidden 128 --ffn 344 --heads 2 --iters 2
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks._common import median_ms
from coat_jax import kernels, ops

MODES = ("bf16", "fp8_linear", "coat")


def fwd_bwd_ms(f, args, iters: int) -> float:
  """Median ms of one jitted forward + pullback of f at args, with a random cotangent (a constant
  one would let XLA simplify the backward GEMMs into reductions)."""
  out = jax.eval_shape(f, *args)
  ct = jax.random.normal(jax.random.key(7), out.shape, out.dtype)

  @jax.jit
  def run(ct, *args):
    out, pullback = jax.vjp(f, *args)
    return pullback(ct)
  return median_ms(lambda: run(ct, *args), iters, warmup=1)


def cases(a):
  m, d, f, h = a.tokens, a.hidden, a.ffn, a.heads
  key = iter(jax.random.split(jax.random.key(0), 16))
  rnd = lambda *s: jax.random.normal(next(key), s, jnp.bfloat16)
  x, xf, w_dd, w_df, w_fd = rnd(m, d), rnd(m, f), rnd(d, d) * 0.02, rnd(d, f) * 0.02, rnd(f, d) * 0.02
  scale = jnp.ones((d,), jnp.bfloat16)
  for mode in MODES:
    yield f"linear {d}->{d}", mode, lambda x, w: ops.linear(x, w, mode=mode), (x, w_dd)
    yield f"linear {d}->{f}", mode, lambda x, w: ops.linear(x, w, mode=mode), (x, w_df)
    yield f"linear {f}->{d}", mode, lambda x, w: ops.linear(x, w, mode=mode), (xf, w_fd)
    yield "rmsnorm", mode, lambda x, s: ops.rmsnorm(x, s, mode=mode)[0], (x, scale)
    yield f"swiglu {f}", mode, lambda g, u: ops.swiglu(g, u, mode=mode)[0], (xf, rnd(m, f))
  dh = d // h
  b = max(1, m // a.seq)
  q, k, v = (rnd(b, m // b, h, dh) for _ in range(3))
  impl = "cudnn" if jax.default_backend() == "gpu" else None
  yield "attention", "bf16", lambda q, k, v: ops.attention(q, k, v, causal=True, implementation=impl), (q, k, v)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, default=8 * 2048)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--hidden", type=int, default=4096)
  p.add_argument("--ffn", type=int, default=11008)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--backends", default="auto,reference,quantize=reference,gemm=reference,dequantize=pallas",
                 help="kernel backends for FP8 modes (coat_jax.kernels.backend forms)")
  a = p.parse_args(argv)
  backends = [b for b in a.backends.split(",") if b]
  print(f"device {jax.devices()[0].device_kind}; tokens {a.tokens}, hidden {a.hidden}, ffn {a.ffn}")
  print(f"{'op':<22}{'mode':<12}" + "".join(f"{b[:22] + ' ms':>26}" for b in backends))
  totals = {}
  for name, mode, f, args in cases(a):
    row = []
    for b in (backends if mode != "bf16" else backends[:1]):
      with kernels.backend(b):
        ms = fwd_bwd_ms(f, args, a.iters)
      totals[(mode, b)] = totals.get((mode, b), 0.0) + ms
      row.append(f"{ms:>26.3f}")
    print(f"{name:<22}{mode:<12}" + "".join(row), flush=True)
  print("sums per mode/backend (linear x3 + rmsnorm + swiglu):",
        {f"{m}/{b}": round(t, 2) for (m, b), t in totals.items()})


if __name__ == "__main__":
  main()
