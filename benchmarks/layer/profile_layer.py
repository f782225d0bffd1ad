"""GPU kernel-time breakdown of one decoder layer's forward + backward, per precision mode.

Traces --iters jitted fwd+bwd calls with jax.profiler, reads the XSpace back with
`jax.profiler.ProfileData` and sums device time per kernel name (GPU planes only), so one sees
which GEMMs, quantize kernels and fusions the time goes to, and where the GPU sits idle between
kernels (the largest gaps with the host events during them: benchmarks/_trace.py).

  python -m benchmarks.layer.profile_layer --modes coat,fp8_linear --top 25     # GPU
  python -m benchmarks.layer.profile_layer --modes coat --linear-residuals remade
"""
from __future__ import annotations

import argparse
import tempfile

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks._common import kernel_times, load_trace
from benchmarks._trace import gap_report, print_gap_report
from coat_jax import ops
from coat_jax.nn import DecoderBlock


def layer_fn(mode, a):
  head_dim = a.hidden // a.heads
  impl = "cudnn" if jax.default_backend() == "gpu" else None
  block = DecoderBlock(a.hidden, a.ffn, a.heads, a.heads, head_dim, mode=mode, dtype=jnp.bfloat16,
                       param_dtype=jnp.bfloat16, attention_impl=impl,
                       linear_residuals=a.linear_residuals, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(block)
  cos, sin = ops.rope_frequencies(head_dim, a.seq)
  kx, kd = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (a.batch, a.seq, a.hidden), jnp.bfloat16)
  dy = jax.random.normal(kd, x.shape, jnp.bfloat16)

  @jax.jit
  def fwd_bwd(params, x, dy):
    y, pullback = jax.vjp(lambda p, x: nnx.merge(graphdef, p)(x, cos, sin), params, x)
    return y, pullback(dy)
  return lambda: fwd_bwd(params, x, dy)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--hidden", type=int, default=4096)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--ffn", type=int, default=11008)
  p.add_argument("--modes", default="coat,fp8_linear")
  p.add_argument("--iters", type=int, default=3)
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--gaps", type=int, default=10, help="largest idle gaps listed, with host events")
  p.add_argument("--linear-residuals", default="kept", choices=ops.LINEAR_RESIDUALS,
                 help="coat: what the linears keep of their FP8 inputs (kept, or remade in the "
                      "backward)")
  a = p.parse_args(argv)
  for mode in a.modes.split(","):
    run = layer_fn(mode, a)
    jax.block_until_ready(run())
    with tempfile.TemporaryDirectory() as tmp:
      with jax.profiler.trace(tmp):  # back to back: the host dispatches ahead, as in training
        outs = [run() for _ in range(a.iters)]
        jax.block_until_ready(outs)
      trace = load_trace(tmp)   # read once for the kernel times and the gaps
      times = kernel_times(trace)
      gaps = gap_report(trace, top=a.gaps)
    total = sum(times.values()) / a.iters
    print(f"\n== {mode}: {total / 1e3:.2f} ms of kernel time per fwd+bwd ({len(times)} kernels)")
    for name, us in times.most_common(a.top):
      print(f"{us / a.iters / 1e3:8.3f} ms  {100 * us / a.iters / total:5.1f}%  {name[:110]}")
    print_gap_report(gaps, f"{mode}: GPU idle time", per=a.iters)


if __name__ == "__main__":
  main()
