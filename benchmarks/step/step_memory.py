"""What a compiled train step holds, per parameter: XLA's prediction against the state's count.

For each variant (a name and `--set` overrides on top of the base config) the train step is
built as train.py builds it and compiled on abstract shapes (nothing is allocated, as the plan
before a run does); the table gives, in bytes per parameter and per device:
  state: XLA's argument bytes (params, optimizer state, other model state, the batch);
  temporaries: the step's workspace (gradients, accumulator, activations, the optimizer's scratch);
  predicted: state + temporaries, the peak train.py checks against the device;
  counted: `build.memory_budget`'s total (params + gradients + accumulator + optimizer state +
    the larger of the bfloat16 weight copy and the rounding step's workspace): what the state
    needs at any batch.
predicted - counted is the activations plus whatever the step holds that the count does not
name; with one sequence per microbatch the activations are a few hundredths of a byte per
parameter at 7B and beyond, so a larger gap is memory to look for.

GPU, a 15.5B Llama at one sequence per microbatch, stochastic against nearest rounding of the
bfloat16 master weights (docs/results.md, "The largest model one GPU trains"):
  python -m benchmarks.step.step_memory --config configs/llama2-13b.yaml --set data.seq_len=2048 \
      --set data.batch_size=64 --set optimizer.accumulate=64 --set model.remat=full \
      --set model.num_layers=48 --variant stochastic= \
      --variant nearest=optimizer.master_rounding=nearest
A variant may also set one of the FP8 linears' switches (`linear.NAME=VALUE`,
coat_jax.ops.linear_ablation.ablation), e.g. W^T for the forward GEMM from W's transposed codes
against a quantize of the transposed cast weight (GPU, 20.3e9 params, one sequence per microbatch):
  python -m benchmarks.step.step_memory --config configs/llama2-13b.yaml --set model.hidden_size=6144 \
      --set model.num_layers=44 --set model.intermediate_size=16384 --set model.num_heads=48 \
      --set model.num_kv_heads=48 --set data.seq_len=2048 --set data.batch_size=64 \
      --set optimizer.accumulate=64 --set model.remat=full --vocab-size 32000 \
      --variant codes= --variant cast=linear.weight_transpose=cast
CPU smoke (XLA's CPU buffers differ from the GPU's; the jnp reference kernels run there):
  JAX_PLATFORMS=cpu python -m benchmarks.step.step_memory --config configs/tiny.yaml \
      --variant one=optimizer.accumulate=1 --variant four=optimizer.accumulate=4
"""
from __future__ import annotations

import argparse
import math
import time

from benchmarks._common import split_linear_switches


def parse_variant(text: str) -> tuple[str, list[str]]:
  """'NAME=KEY=VALUE,KEY=VALUE' (or 'NAME=' for the base) -> (NAME, [KEY=VALUE, ...])."""
  name, sep, rest = text.partition("=")
  if not sep or not name:
    raise ValueError(f"--variant {text!r} is not NAME=[KEY=VALUE,...]")
  return name, [item for item in rest.split(",") if item]


def measure(config: str | None, overrides: list[str], vocab_size: int | None) -> dict:
  """One variant's byte counts per device and its parameter count. An override
  `linear.NAME=VALUE` sets the FP8 linears' switch NAME (`coat_jax.ops.linear_ablation.ablation`)
  while the step is traced, instead of a config key."""
  import jax
  import numpy as np
  from coat_jax.ops import linear_ablation
  from coat_jax.training import mesh as mesh_lib, schema
  from coat_jax.training.build import build, shard_shapes
  from coat_jax.training.plan import memory_analysis

  switches, overrides = split_linear_switches(overrides)
  cfg = schema.load(config, overrides)
  built = build(cfg, mesh_lib.make_mesh(cfg.mesh), vocab_size=vocab_size)
  params, opt_state, rest = built.abstract_state()
  budget = built.memory_budget()
  tokens = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len + 1), np.int32,
                                sharding=built.batch_sharding)
  t0 = time.perf_counter()
  with linear_ablation.ablation(**switches):
    compiled = built.train_step.lower(params, opt_state, rest, tokens).compile()
  mem = memory_analysis(compiled) or {}
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(shard_shapes(params)))
  return dict(params=n, compile_s=time.perf_counter() - t0, budget=budget, **mem)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default=None, help="a run config (default: the schema's defaults)")
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                 help="an override of every variant's base, as train.py's --set")
  p.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...",
                 help="a variant: its name and overrides (comma-separated) on the base")
  p.add_argument("--vocab-size", type=int, default=None,
                 help="the data's vocabulary (default: the config's model)")
  args = p.parse_args(argv)
  try:
    variants = [parse_variant(v) for v in args.variant] or [("base", [])]
  except ValueError as e:
    p.error(str(e))
  rows = []
  for name, extra in variants:
    r = measure(args.config, args.overrides + extra, args.vocab_size)
    per = lambda b: "n/a" if b is None else f"{b / r['params']:.3f}"
    rows.append([name, f"{r['params'] / 1e9:.3f}", per(r.get("argument_size_in_bytes")),
                 per(r.get("temp_size_in_bytes")), per(r.get("predicted_bytes")),
                 per(r["budget"]["total"]), f"{r['compile_s']:.1f}"])
    print(f"  {name}: {rows[-1]}", flush=True)
  print("\n| variant | params (1e9) | state B/param | temporaries B/param | predicted B/param | "
        "counted B/param | compile s |")
  print("|---|---|---|---|---|---|---|")
  for row in rows:
    print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
  main()
