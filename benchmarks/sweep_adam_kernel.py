"""Tuning sweep for the fused COAT Adam kernel on one large leaf (GPU).

Times `pallas_kernels.adam_step.adam_step` alone (output="param", m/v E4M3 with expansion, as
coat_adamw's defaults) over block size, warps, fast math and buffer aliasing, next to two bounds
measured in the same run on the same leaf:
  - "io floor": a Pallas kernel with the same blocks, inputs and outputs and no math (what the
    memory system gives this access pattern);
  - optax.adamw + apply_updates (XLA, float32 state), the time the fused step should beat.
Each variant is a jitted call with param and moments donated, run --steps times (median).

  python benchmarks/sweep_adam_kernel.py                       # GPU: 1.21e9 params
  JAX_PLATFORMS=cpu python benchmarks/sweep_adam_kernel.py --rows 64 --cols 256 --steps 2 \
      --interpret                                              # smoke check
"""
from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp
import optax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from _common import time_calls
from coat_jax import formats, kernels, kernels_adam
from coat_jax.expansion import quantize_expanded
from pallas_kernels import adam_step as pk
from pallas_kernels.adam_step_triton import pow2_divisor

M_FORMAT = V_FORMAT = "e4m3"
GROUP = formats.OPTIMIZER_GROUP_SIZE   # 128


HYPER = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4, count=7, group_size=GROUP,
             expand=True, expand_min=16, **kernels_adam.adam_kernel_limits(M_FORMAT, V_FORMAT))


def _io_kernel(p_ref, g_ref, mq_ref, ma_ref, mk_ref, vq_ref, va_ref, vk_ref,
               o_ref, mqo_ref, mao_ref, mko_ref, vqo_ref, vao_ref, vko_ref):
  o_ref[...] = p_ref[...] - 1e-3 * g_ref[...]
  mqo_ref[...] = mq_ref[...]
  mao_ref[...] = ma_ref[...] * 0.5
  mko_ref[...] = mk_ref[...]
  vqo_ref[...] = vq_ref[...]
  vao_ref[...] = va_ref[...] * 0.5
  vko_ref[...] = vk_ref[...]


@functools.partial(jax.jit, static_argnames=("block", "interpret"), donate_argnums=(0, 2, 3))
def io_floor(p, g, m, v, *, block, interpret=False):
  rows = p.size // GROUP
  block = pow2_divisor(rows, block)   # whole blocks, as the COAT kernel picks them
  big = pl.BlockSpec((block, GROUP), lambda i: (i, 0))
  small = pl.BlockSpec((block,), lambda i: (i,))
  outs = pl.pallas_call(
      _io_kernel, grid=(rows // block,),
      in_specs=[big, big, big, small, small, big, small, small],
      out_specs=[big, big, small, small, big, small, small],
      out_shape=[jax.ShapeDtypeStruct((rows, GROUP), p.dtype),
                 jax.ShapeDtypeStruct((rows, GROUP), m.data.dtype),
                 jax.ShapeDtypeStruct((rows,), jnp.float32),
                 jax.ShapeDtypeStruct((rows,), jnp.uint8),
                 jax.ShapeDtypeStruct((rows, GROUP), v.data.dtype),
                 jax.ShapeDtypeStruct((rows,), jnp.float32),
                 jax.ShapeDtypeStruct((rows,), jnp.uint8)],
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))(
          p.reshape(rows, GROUP), g.reshape(rows, GROUP), m.data.reshape(rows, GROUP),
          m.amax.reshape(rows), m.k_code.reshape(rows), v.data.reshape(rows, GROUP),
          v.amax.reshape(rows), v.k_code.reshape(rows))
  o, mq, ma, mk, vq, va, vk = outs
  shape, meta = p.shape, m.amax.shape
  return (o.reshape(shape), type(m)(mq.reshape(shape), ma.reshape(meta), mk.reshape(meta)),
          type(v)(vq.reshape(shape), va.reshape(meta), vk.reshape(meta)))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=294912, help="leaf rows (x cols params)")
  parser.add_argument("--cols", type=int, default=4096)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
  parser.add_argument("--quick", action="store_true", help="a few variants only")
  args = parser.parse_args(argv)
  shape = (args.rows, args.cols)
  n = args.rows * args.cols
  kp, kg, km, kv = jax.random.split(jax.random.key(0), 4)
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind}; leaf {shape} = {n:.4g} float32 params", flush=True)
  grad = jax.random.normal(kg, shape, jnp.float32) * 1e-3

  def fresh():
    """(param, m, v) of the COAT step: float32 param, E4M3 expanded moments."""
    p = jax.random.normal(kp, shape, jnp.float32) * 0.02
    m = jax.jit(lambda k: quantize_expanded(jax.random.normal(k, shape) * 1e-3, M_FORMAT,
                                            GROUP))(km)
    v = jax.jit(lambda k: quantize_expanded(jax.random.uniform(k, shape) * 1e-6, V_FORMAT,
                                            GROUP))(kv)
    return p, m, v

  results = []

  def run(name, fn, bytes_per_param, state=fresh):
    """Times fn(p, grad, a, b) -> (p, a, b), each call fed the previous call's outputs."""
    p, a, b = state()
    carry = {"args": (p, grad, a, b)}

    def next_args(out):
      if out is not None:
        carry["args"] = (out[0], grad, out[1], out[2])
      return carry["args"]

    ms = time_calls(fn, next_args, args.steps)
    del carry
    results.append((name, ms, bytes_per_param * n / (ms * 1e-3) / 1e12))
    print(f"  {name}: {ms:.3f} ms", flush=True)

  coat_bytes = 4 + 4 + 1 + 1 + 10 / GROUP + 4 + 1 + 1 + 10 / GROUP   # read p,g,m,v; write p,m,v
  for block in ((16, 64) if args.quick else (16, 32, 64, 128)):
    run(f"io floor (block {block})",
        functools.partial(io_floor, block=block, interpret=args.interpret), coat_bytes)

  adamw = optax.adamw(1e-3, weight_decay=1e-4)

  @functools.partial(jax.jit, donate_argnums=(0, 2))
  def adamw_step(p, g, state, unused):
    u, state = adamw.update(g, state, p)
    return optax.apply_updates(p, u), state, unused

  def adamw_state():
    p = jax.random.normal(kp, shape, jnp.float32) * 0.02
    return p, adamw.init(p), None

  run("optax.adamw + apply_updates (XLA)", adamw_step, 28, adamw_state)

  if args.quick:
    variants = [(16, 4, False, False), (16, 4, True, False), (16, 4, False, True),
                (16, 4, True, True), (8, 4, True, True)]
  else:
    variants = [(b, w, f, a) for f, a in ((False, False), (True, False), (True, True))
                for b, w in itertools.product((8, 16, 32, 64), (2, 4, 8))]
  for block, warps, fast, alias in variants:
    # Moments go in and come out as plain (data, amax, k_code) tuples (an ExpandedMoment is one).
    fn = jax.jit(functools.partial(pk.adam_step, output="param", block=block, num_warps=warps,
                                   fast_math=fast, alias=alias, interpret=args.interpret,
                                   **HYPER), donate_argnums=(0, 2, 3))
    name = f"coat kernel block {block} warps {warps}{' fast' if fast else ''}" \
           f"{' alias' if alias else ''}"
    try:
      run(name, fn, coat_bytes)
    except Exception as e:  # a config Triton rejects (e.g. too many registers): report, go on
      print(f"  {name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)

  base = next(ms for name, ms, _ in results if name.startswith("optax"))
  for name, ms, _ in results:
    if not ms > 0:
      raise RuntimeError(f"{name}: no valid time ({ms})")
  print(f"\n| variant | ms | TB/s moved | vs optax.adamw time |")
  print("|---|---|---|---|")
  for name, ms, tbs in results:
    print(f"| {name} | {ms:.3f} | {tbs:.2f} | {ms / base:.2f}x |")
  return results


if __name__ == "__main__":
  main()
