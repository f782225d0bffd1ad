"""Compile time of the jitted train step vs depth, with the decoder layers scanned or looped.

The step is value_and_grad of the Llama loss plus an optax AdamW update, jitted on abstract
arguments (no parameters are allocated). "lower" is tracing + lowering to StableHLO, "compile" is
XLA's compile; a Python loop over layers makes XLA compile every layer's graph again, a scan
compiles one block once (`LlamaConfig.scan_layers`).

  python benchmarks/bench_compile.py                                   # coat and bf16, 2/4/8 layers
  python benchmarks/bench_compile.py --modes coat --depths 2,4,16 --preset olmo-1b --seq 2048
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from _common import parse_modes
from coat_jax.models import REMAT_POLICIES, Llama, LlamaConfig
from coat_jax.precision import PRECISIONS


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--modes", default="coat,bf16", help=f"comma-separated subset of {PRECISIONS}")
  p.add_argument("--depths", default="2,4,8", help="comma-separated numbers of layers")
  p.add_argument("--preset", default="tiny", help="LlamaConfig preset for the other shapes")
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--dtype", default="auto", help="compute dtype (auto: float32 on CPU)")
  p.add_argument("--remat", default="none", choices=tuple(REMAT_POLICIES))
  p.add_argument("--scan", default="on,off", help="on, off or on,off")
  p.add_argument("--json", default=None, help="also write the rows to this file")
  args = p.parse_args(argv)
  args.modes = parse_modes(p, args.modes, PRECISIONS)
  try:
    args.depths = [int(d) for d in args.depths.split(",") if d.strip()]
  except ValueError:
    p.error(f"--depths must be comma-separated integers, got {args.depths!r}")
  if not args.depths or min(args.depths) < 1:
    p.error(f"--depths must be positive, got {args.depths}")
  scans = [s.strip() for s in args.scan.split(",") if s.strip()]
  if not scans or any(s not in ("on", "off") for s in scans):
    p.error(f"--scan must be on, off or on,off, got {args.scan!r}")
  args.scan = [s == "on" for s in scans]
  return args


def compile_seconds(cfg: LlamaConfig, batch: int, seq: int) -> tuple[float, float]:
  """(lower seconds, compile seconds) of the jitted train step for `cfg`."""
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
  tx = optax.adamw(1e-3)
  opt_state = jax.eval_shape(tx.init, params)
  tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)

  def loss_fn(params, tokens):
    logits = nnx.merge(graphdef, params)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  t0 = time.perf_counter()
  lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, tokens)
  t1 = time.perf_counter()
  lowered.compile()
  return t1 - t0, time.perf_counter() - t1


def main(argv=None):
  args = parse_args(argv)
  jax.config.update("jax_enable_compilation_cache", False)  # measure compiles, not cache hits
  base = LlamaConfig.from_name(args.preset, dtype=args.dtype, remat=args.remat,
                               max_seq_len=max(args.seq, LlamaConfig.from_name(args.preset).max_seq_len))
  print(f"preset {args.preset} (D {base.hidden_size}, F {base.intermediate_size}, "
        f"heads {base.num_heads}), batch {args.batch} x seq {args.seq}, dtype {base.dtype}, "
        f"remat {args.remat}, backend {jax.default_backend()}")
  header = f"{'mode':>10} {'layers':>6} {'scan':>4} {'lower s':>8} {'compile s':>9} {'total s':>8}"
  print(header)
  print("-" * len(header))
  # One untimed compile first: the process's one-time costs (XLA and backend start-up) would
  # otherwise land on the first row.
  compile_seconds(dataclasses.replace(base, precision=args.modes[0], num_layers=1).validate(),
                  args.batch, args.seq)
  rows = []
  for mode in args.modes:
    for depth in args.depths:
      for scan in args.scan:
        cfg = dataclasses.replace(base, precision=mode, num_layers=depth, scan_layers=scan)
        lower, comp = compile_seconds(cfg.validate(), args.batch, args.seq)
        rows.append(dict(mode=mode, layers=depth, scan=scan, lower_s=lower, compile_s=comp))
        print(f"{mode:>10} {depth:>6} {'on' if scan else 'off':>4} {lower:8.2f} {comp:9.2f} "
              f"{lower + comp:8.2f}", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(args={k: v for k, v in vars(args).items() if k != "json"}, rows=rows), f,
                indent=1)
  return rows


if __name__ == "__main__":
  main()
