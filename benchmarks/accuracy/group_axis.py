"""Group axis of FP8 Adam moments: groups along the kernel's last axis (ours) or its first (COAT's).

COAT flattens PyTorch's (out, in) weight and quantizes runs of 128 consecutive elements, i.e.
groups along the INPUT features. coat_jax's kernels are (in, out) and coat_adamw groups along the
last axis, i.e. along the OUTPUT features (the embedding table (V, D) is grouped along D in both).
This script measures which grouping loses less of the real moments:

1. trains a Llama (precision "bf16", float32 master weights) with optax.adamw (float32 m and v),
   clip 1.0, warmup + cosine, on the offline stdlib corpus (coat_jax.data);
2. at the checkpoint steps, takes every 2-D moment tensor that coat_adamw would quantize
   (>= --min-quantized-size elements) and round-trips it through coat_jax.expansion's
   quantize_expanded / dequantize_expanded (--format, G = --group-size, expansion on and off)
   grouped along
     "last":  the last axis, as stored (coat_adamw today);
     "first": the first axis (transpose, quantize, transpose back);
     "coat":  COAT's layout per tensor ("first" for Linear kernels, "last" for the embedding);
   (the FP8 codes are the output of one jit and the input of another: inside one jit XLA GPU
   drops an f32 -> f8 -> f32 conversion pair, see benchmarks/_moments.py; before training, the
   script checks a sample against a float64 numpy quantizer and aborts on a mismatch);
3. reports the relative MSE sum (x - deq)^2 / sum x^2 (float64) per tensor, its geometric mean
   over tensors and the pooled ratio (all tensors' errors over all tensors' energy).

The moments are those of one float32 adamw run; each axis variant quantizes the same m and v
(a measurement of the stored state's error, not a run with quantized moments).
Outputs in --out: group_axis.json (every tensor's numbers), group_axis.md (the tables), both
rewritten after every checkpoint.

CPU (the run in docs/differences.md; llama-125m's width with 4 layers, vocab 4096, seq 128,
batch 8; 29 min on 2 shared, busy cores):
  python -m benchmarks.accuracy.group_axis --num-layers 4 --steps 300 --checkpoints 10,50,150 --out runs/group_axis
GPU (llama-125m as in docs/accuracy.md, 32k vocab, seq 1024):
  python -m benchmarks.accuracy.group_axis --vocab 32000 --corpus-max-bytes 100000000 --seq-len 1024 \\
      --batch 8 --steps 2000 --warmup 200 --checkpoints 10,50,500 --out $OUT/group_axis
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from benchmarks._moments import check_moment_round_trip, moment_round_trip
from coat_jax.formats import OPTIMIZER_GROUP_SIZE
from coat_jax.models.llama import Llama, LlamaConfig
from coat_jax.training import dataset as data_lib
from coat_jax.training.build import dataset_from_config
from coat_jax.training.schema import DataConfig

AXES = ("last", "first", "coat")


def say(msg: str) -> None:
  print(msg, flush=True)


def coat_axis(name: str) -> str:
  """The axis COAT's layout groups along for a param path: "last" for the embedding table (V, D),
  "first" (the input features) for every (in, out) Linear kernel."""
  return "last" if "embed" in name else "first"


def tensor_error(x: np.ndarray, axis: str, *, fmt: str, group_size: int, expand_min: int,
                 expand: bool) -> tuple[float, float]:
  """(sum (x - deq)^2, sum x^2) in float64 for a 2-D moment grouped along `axis`."""
  if x.ndim != 2:
    raise ValueError(f"tensor_error: expected a 2-D moment, got shape {x.shape}")
  if axis not in ("last", "first"):
    raise ValueError(f"tensor_error: axis must be 'last' or 'first', got {axis!r}")
  # FP8 codes materialised between two jits: inside one jit XLA GPU drops the rounding (_moments).
  out = moment_round_trip(x, fmt, group_size, expand_min, expand, axis=axis)
  x64 = np.asarray(x, np.float64)
  if not np.all(np.isfinite(out)):
    raise ValueError(f"tensor_error: non-finite values after the round trip along {axis!r}")
  return float(np.sum((out - x64) ** 2)), float(np.sum(x64 ** 2))


def error_rows(moments: dict[str, dict[str, np.ndarray]], *, fmt: str = "e4m3",
               group_size: int = OPTIMIZER_GROUP_SIZE, expand_min: int = 16) -> list[dict]:
  """One row per (moment, expand, axis) over the tensors of `moments` ({"m": {name: x}, "v": ...}).

  Row: moment, expand, axis, rel_mse_geomean (geometric mean over tensors of each tensor's
  sum err^2 / sum x^2; tensors with sum x^2 = 0 left out), rel_mse_pooled (sum of all errors over
  sum of all x^2), per_tensor {name: rel MSE}.
  """
  rows = []
  for moment, tensors in moments.items():
    if not tensors:
      raise ValueError(f"error_rows: no tensors for moment {moment!r}")
    for expand in (False, True):
      cache = {}
      for name, x in tensors.items():
        for axis in ("last", "first"):
          cache[name, axis] = tensor_error(x, axis, fmt=fmt, group_size=group_size,
                                           expand_min=expand_min, expand=expand)
      for axis in AXES:
        parts = {n: cache[n, coat_axis(n) if axis == "coat" else axis] for n in tensors}
        per = {n: e / s for n, (e, s) in parts.items() if s > 0}
        rows.append(dict(
            moment=moment, expand=expand, axis=axis,
            rel_mse_geomean=float(np.exp(np.mean(np.log(np.maximum(list(per.values()), 1e-300))))),
            rel_mse_pooled=sum(e for e, _ in parts.values()) / sum(s for _, s in parts.values()),
            per_tensor=per))
  return rows


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def adam_moments(opt_state, min_size: int) -> dict[str, dict[str, np.ndarray]]:
  """{"m": {name: float32 2-D array}, "v": ...} of the 2-D leaves with >= min_size elements."""
  adam = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
          if isinstance(s, optax.ScaleByAdamState)][0]
  out = {}
  for moment, tree in (("m", adam.mu), ("v", adam.nu)):
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    out[moment] = {_path_name(p): np.asarray(jax.device_get(x)) for p, x in leaves
                   if x.ndim == 2 and x.size >= min_size}
  return out


def train_and_measure(cfg: LlamaConfig, ds: data_lib.TokenDataset, *, steps: int,
                      checkpoints: list[int], lr: float, warmup: int, seed: int, fmt: str,
                      group_size: int, expand_min: int, min_size: int, log=say,
                      on_checkpoint=lambda result: None) -> dict:
  """Trains `cfg` with optax.adamw for `steps` steps; error_rows of its moments at `checkpoints`.

  on_checkpoint(result) is called after each checkpoint (to save partial results).
  """
  model = Llama(cfg, rngs=nnx.Rngs(seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, warmup), max(steps, warmup + 1),
                                                end_value=0.1 * lr)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                               mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
  opt_state = tx.init(params)

  def loss_fn(params, tokens):
    logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  result = {"losses": [], "checkpoints": []}
  t0 = time.time()
  for step in range(1, steps + 1):
    params, opt_state, loss = train_step(params, opt_state, jnp.asarray(ds.train_batch(step - 1)))
    if step in checkpoints:
      result["losses"].append([step, float(loss)])
      if not np.isfinite(result["losses"][-1][1]):
        raise FloatingPointError(f"train loss is {float(loss)} at step {step}")
      t1 = time.time()
      moments = adam_moments(opt_state, min_size)
      rows = error_rows(moments, fmt=fmt, group_size=group_size, expand_min=expand_min)
      shapes = {n: list(x.shape) for n, x in moments["m"].items()}
      result["checkpoints"].append({"step": step, "loss": float(loss), "rows": rows,
                                    "shapes": shapes})
      log(f"[group_axis] step {step}: loss {float(loss):.4f}, {len(shapes)} tensors, "
          f"train {t1 - t0:.0f} s, measure {time.time() - t1:.0f} s")
      for r in rows:
        if r["axis"] != "coat":
          log(f"  {r['moment']} expand={r['expand']!s:5} {r['axis']:5}: rel MSE geomean "
              f"{r['rel_mse_geomean']:.3e} pooled {r['rel_mse_pooled']:.3e}")
      on_checkpoint(result)
  result["train_s"] = time.time() - t0
  return result


def markdown(meta: dict, result: dict) -> str:
  lines = [f"# Group axis of the FP8 moments ({meta['format']}, G = {meta['group_size']})", "",
           f"{meta['model']}; {meta['run']}; device {meta['device']}; command `{meta['command']}`.",
           "Round trip checked on this device against a float64 numpy quantizer (relative MSE of "
           "a sample, ours / numpy): " + ", ".join(
               f"{k} {a:.2e} / {b:.2e}" for k, (a, b) in meta.get("round_trip_check", {}).items()) + ".",
           "Relative MSE sum (x - deq)^2 / sum x^2 of optax.adamw's float32 m and v after a "
           "quantize/dequantize round trip: geometric mean over the tensors (pooled in brackets). "
           "**last** = groups along the kernel's last axis (output features; coat_adamw today), "
           "**first** = along its first axis (input features), **coat** = COAT's layout "
           "(first for Linear kernels, last for the embedding). ratio = first / last (geomean): "
           "< 1 means grouping along the input features loses less.", "",
           "| step | loss | moment | expansion | last | first | coat | ratio first/last |",
           "|---|---|---|---|---|---|---|---|"]
  for ck in result["checkpoints"]:
    by = {(r["moment"], r["expand"], r["axis"]): r for r in ck["rows"]}
    for moment in ("m", "v"):
      for expand in (True, False):
        cells = [by[moment, expand, a] for a in AXES]
        ratio = cells[1]["rel_mse_geomean"] / cells[0]["rel_mse_geomean"]
        lines.append(f"| {ck['step']} | {ck['loss']:.3f} | {moment} | {'on' if expand else 'off'} | "
                     + " | ".join(f"{c['rel_mse_geomean']:.2e} ({c['rel_mse_pooled']:.1e})"
                                  for c in cells) + f" | {ratio:.2f} |")
  last = result["checkpoints"][-1]
  by = {(r["moment"], r["expand"], r["axis"]): r["per_tensor"] for r in last["rows"]}
  kinds = sorted({tensor_kind(n) for n in last["shapes"]})
  lines += ["", f"By tensor kind at step {last['step']}, expansion on: geometric mean over the "
            "kind's tensors of the ratio first / last of each tensor's relative MSE "
            "(< 1: the first axis loses less).", "",
            "| tensor | shape | COAT's axis | m: first / last | v: first / last |", "|---|---|---|---|---|"]
  for kind in kinds:
    names = [n for n in last["shapes"] if tensor_kind(n) == kind]
    ratios = [float(np.exp(np.mean([np.log(by[mo, True, "first"][n] / by[mo, True, "last"][n])
                                    for n in names]))) for mo in ("m", "v")]
    lines.append(f"| {kind} (x{len(names)}) | {last['shapes'][names[0]]} | {coat_axis(names[0])} | "
                 f"{ratios[0]:.2f} | {ratios[1]:.2f} |")
  return "\n".join(lines) + "\n"


def tensor_kind(name: str) -> str:
  """The param path without layer indices, "kernel" and nnx's "value": "self_attn/q_proj"."""
  parts = [p for p in name.split("/") if not p.isdigit() and p not in ("layers", "kernel", "value")]
  return "/".join(parts)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="llama-125m")
  p.add_argument("--num-layers", type=int, default=None, help="default: the preset's")
  p.add_argument("--dtype", default="auto", help="compute dtype (auto: float32 on CPU)")
  p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary trained on the corpus")
  p.add_argument("--corpus-max-bytes", type=int, default=4_000_000)
  p.add_argument("--seq-len", type=int, default=128)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--checkpoints", default="10,50", help="steps to measure at (--steps is added)")
  p.add_argument("--lr", type=float, default=6e-4)
  p.add_argument("--warmup", type=int, default=20)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--format", default="e4m3", choices=("e4m3", "e5m2", "int8"))
  p.add_argument("--group-size", type=int, default=OPTIMIZER_GROUP_SIZE)
  p.add_argument("--expand-min", type=int, default=16)
  p.add_argument("--min-quantized-size", type=int, default=4096)
  p.add_argument("--out", default="runs/group_axis")
  args = p.parse_args(argv)
  for name in ("steps", "seq_len", "batch", "vocab", "group_size", "expand_min"):
    if getattr(args, name) <= 0:
      p.error(f"--{name.replace('_', '-')} must be > 0")
  try:
    cks = {int(s) for s in args.checkpoints.split(",") if s.strip()}
  except ValueError:
    p.error(f"--checkpoints must be comma-separated ints, got {args.checkpoints!r}")
  args.checkpoints = sorted({c for c in cks if 0 < c <= args.steps} | {args.steps})
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  check = check_moment_round_trip(args.format, args.group_size, args.expand_min)
  say(f"[group_axis] {args.format} round trip on this device vs float64 numpy (relative MSE, "
      f"expansion off / on): " + ", ".join(f"{a:.3e} / {b:.3e}" for a, b in check.values()))
  ds = dataset_from_config(DataConfig(kind="stdlib", vocab_size=args.vocab,
                                      corpus_max_bytes=args.corpus_max_bytes,
                                      seq_len=args.seq_len, batch_size=args.batch),
                           args.seed, log=say)
  # Unrolled layers: each layer's moments are their own (in, out) tensors, as in COAT.
  overrides = dict(vocab_size=ds.vocab_size, max_seq_len=args.seq_len, precision="bf16",
                   scan_layers=False,
                   dtype=args.dtype)
  if args.num_layers is not None:
    overrides["num_layers"] = args.num_layers
  cfg = LlamaConfig.from_name(args.preset, **overrides)
  dev = jax.devices()[0]
  meta = {"device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}", "format": args.format,
          "group_size": args.group_size,
          "model": (f"{args.preset} shape: hidden {cfg.hidden_size}, intermediate "
                    f"{cfg.intermediate_size}, {cfg.num_layers} layers, {cfg.num_heads} heads, vocab "
                    f"{cfg.vocab_size}, compute {cfg.dtype}"),
          "run": (f"optax.adamw (b1 0.9, b2 0.95, wd 0.1, clip 1.0), peak lr {args.lr:g}, warmup "
                  f"{args.warmup} + cosine, {args.steps} steps of {args.batch} x {args.seq_len} "
                  f"tokens of {ds.description}, seed {args.seed}"),
          "command": "python -m benchmarks.accuracy.group_axis " + " ".join(sys.argv[1:] if argv is None else argv)}
  meta["round_trip_check"] = {f"expand={e}": v for e, v in check.items()}
  say(f"[group_axis] {meta['model']}; {meta['run']}; checkpoints {args.checkpoints}")

  def save(result):
    result["meta"] = meta
    (out / "group_axis.json").write_text(json.dumps(result, indent=1))
    (out / "group_axis.md").write_text(markdown(meta, result))

  result = train_and_measure(cfg, ds, steps=args.steps, checkpoints=args.checkpoints, lr=args.lr,
                             warmup=args.warmup, seed=args.seed, fmt=args.format,
                             group_size=args.group_size, expand_min=args.expand_min,
                             min_size=args.min_quantized_size, on_checkpoint=save)
  save(result)
  say("\n" + (out / "group_axis.md").read_text())
  say(f"[group_axis] wrote {out}/group_axis.json, group_axis.md")
  return result


if __name__ == "__main__":
  main()
