"""Master-weight and gradient memory options vs float32 master weights: final eval loss over a run.

Shows that each memory option of coat_adamw trains llama-125m (COAT: FP8 activations + FP8
moments) for --steps steps on the stdlib corpus like float32 master weights, final eval loss
within 0.3 %. Variants (config overrides on the same run; same init seed and data order):

  f32_master          model.param_dtype float32, float32 gradients (the reference)
  bf16_grads          optimizer.grad_dtype bfloat16 (backward at a bfloat16 weight copy)
  bf16_master         model.param_dtype bfloat16, round to nearest (the control: small updates lost)
  bf16_master_sr      ... + optimizer.master_rounding stochastic
  bf16_master_kahan   ... + optimizer.master_rounding kahan (bfloat16 compensation buffer)
  group_axis_coat     float32 masters, the moments grouped along COAT's axis (optimizer.group_axis
                      coat, input features: the default)
  group_axis_last     float32 masters, the moments grouped along each param's last axis

bfloat16 master weights give bfloat16 gradients by themselves (the backward runs at the bfloat16
params; grad_dtype bfloat16 is then a no-op), so "bf16 grads + bf16 master + SR" is the
bf16_master_sr run. Each variant is a child process (`--one NAME`); `--parallel N` runs N at once
on one GPU, each with XLA_PYTHON_CLIENT_MEM_FRACTION = 0.9 / N (only the numerics matter here,
not the speed). Every child evaluates (the mean loss over data.eval_batches held-out batches)
every --eval-every steps and at its last step, and stops early at the --seconds-budget deadline;
the table compares the variants at the last eval step all of them reached.

The data must not repeat: on the default 4 MB corpus 2000 steps of 16 x 256 tokens are ~7 epochs,
the float32 run overfits (eval loss rising after step ~1200) and a variant that learns less
(round-to-nearest masters) then "wins" on eval loss (H100, 2026-11-23). Defaults: 20 MB of stdlib
sources and 8 x 256 tokens per step, under one epoch.

Outputs in --out: master_weights.json, master_weights.md (table), master_weights.png (curves).

GPU (H100, 5 variants at once, ~7 min: compiles ~1.5 min, then the steps the budget allows):
  python -m benchmarks.accuracy.master_weights --out $OUT/master --parallel 5 --seconds-budget 450
CPU smoke (~1 min):
  JAX_PLATFORMS=cpu python -m benchmarks.accuracy.master_weights --out /tmp/mw --preset tiny --steps 4 \\
      --eval-every 2 --seq-len 32 --batch 4 --precision bf16 --parallel 2 \\
      --set model.num_layers=1 --set model.hidden_size=64 --set model.intermediate_size=128
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import threading
import time
from pathlib import Path

from benchmarks._common import Budget, module_command, pyplot, save_figure

REPO = Path(__file__).resolve().parents[2]
BF16_MASTER = ["model.param_dtype=bfloat16"]
VARIANTS = {
    "f32_master": [],
    "bf16_grads": ["optimizer.grad_dtype=bfloat16"],
    "bf16_master": BF16_MASTER,
    "bf16_master_sr": BF16_MASTER + ["optimizer.master_rounding=stochastic"],
    "bf16_master_kahan": BF16_MASTER + ["optimizer.master_rounding=kahan"],
}
DEFAULT_VARIANTS = tuple(VARIANTS)   # the master-weight options
# not master-weight options: the moments' group axis, explicit (the group-axis loss check)
VARIANTS.update({"group_axis_coat": ["optimizer.group_axis=coat"],
                 "group_axis_last": ["optimizer.group_axis=last"]})
REFERENCE = "f32_master"
TARGET_PCT = 0.3


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
  p.add_argument("--preset", default="llama-125m")
  p.add_argument("--precision", default="coat", choices=("bf16", "fp8_linear", "coat"))
  p.add_argument("--steps", type=int, default=2000)
  p.add_argument("--eval-every", type=int, default=100)
  p.add_argument("--seq-len", type=int, default=256)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--corpus-mb", type=float, default=20.0,
                 help="stdlib corpus size (MB): 2000 x 8 x 256 tokens stay under one epoch")
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--parallel", type=int, default=1, help="variants run at once (one GPU)")
  p.add_argument("--seconds-budget", type=float, default=None)
  p.add_argument("--out", default="runs/master_weights")
  p.add_argument("--one", default=None, help=argparse.SUPPRESS)
  p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
  bad = [v for v in args.variants + ([args.one] if args.one else []) if v not in VARIANTS]
  if bad:
    p.error(f"unknown variants {bad}; choose from {tuple(VARIANTS)}")
  for name in ("steps", "eval_every", "seq_len", "batch", "parallel"):
    if getattr(args, name) <= 0:
      p.error(f"--{name.replace('_', '-')} must be > 0")
  return args


def say(msg: str) -> None:
  print(msg, flush=True)


def config_overrides(args, variant: str) -> list[str]:
  return [f"model.preset={args.preset}", "model.dtype=auto", f"precision={args.precision}",
          "optimizer.name=coat_adamw", f"optimizer.lr={args.lr}", "optimizer.warmup=100",
          "data.kind=stdlib", f"data.corpus_max_bytes={int(args.corpus_mb * 1e6)}",
          f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch}",
          f"run.steps={args.steps}", "mesh.data=1"] + list(args.overrides) + VARIANTS[variant]


# ----------------------------------------------------------------------------------------------
# Child: one variant.


def train_one(args) -> dict:
  """Trains args.one; returns its record (train losses, eval curve, memory budget)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from coat_jax.training import build as build_lib, mesh as mesh_lib, schema

  t0 = time.time()
  cfg = schema.load(None, config_overrides(args, args.one))
  mesh = mesh_lib.make_mesh(cfg.mesh)
  ds = build_lib.dataset_from_config(cfg.data, cfg.run.seed, log=say)
  built = build_lib.build(cfg, mesh, vocab_size=ds.vocab_size)
  sh = built.batch_sharding
  evals = [mesh_lib.put_batch(b, sh) for b in ds.eval_batches(max(1, cfg.data.eval_batches))]
  params, opt_state, rest = built.init()
  if any(x.dtype != jnp.float32 for x in jax.tree.leaves(params)):
    # The reference's float32 init, rounded: drawing in bfloat16 would be another random init.
    ref = schema.load(None, config_overrides(args, REFERENCE))
    _, init32 = build_lib.model_parts(build_lib.model_config(ref, ds.vocab_size), ref.run.seed, mesh)
    params = jax.tree.map(lambda p, p32: p32.astype(p.dtype), params, init32()[0])
    opt_state = jax.jit(built.tx.init, out_shardings=built.opt_shardings)(params)
  rec = {"variant": args.one, "overrides": VARIANTS[args.one], "losses": [], "evals": [],
         "budget": built.memory_budget(),
         "num_params": int(sum(x.size for x in jax.tree.leaves(params)))}

  def evaluate(step):
    loss = float(np.mean(jax.device_get([built.eval_step(params, rest, b) for b in evals])))
    rec["evals"].append([step, loss])
    say(f"[{args.one}] step {step}: eval {loss:.4f} ({time.time() - t0:.0f} s)")

  # Deadline: after each eval (where the host has waited for the queued steps), the seconds per
  # step of the last window, eval included (the first window includes the compile: conservative).
  deadline, pending, step_s, t_mark = args.deadline or math.inf, [], None, t0
  for step in range(1, args.steps + 1):
    tokens = mesh_lib.put_batch(ds.train_batch(step - 1), sh)
    params, opt_state, rest, out = built.train_step(params, opt_state, rest, tokens)
    pending.append(out["loss"])
    last = step == args.steps
    if step % args.eval_every == 0 or last:
      rec["losses"] += [float(x) for x in jax.device_get(pending)]
      pending = []
      evaluate(step)
      if not math.isfinite(rec["losses"][-1]):
        break
      now = time.time()
      step_s, t_mark = (now - t_mark) / args.eval_every, now
      if not last and now + 1.2 * step_s * args.eval_every + 10 > deadline:
        say(f"[{args.one}] deadline: stopping after step {step} ({step_s * 1e3:.0f} ms/step)")
        break
  rec["wall_s"] = time.time() - t0
  return rec


# ----------------------------------------------------------------------------------------------
# Parent: children, table, plot.


def run_children(args, budget: Budget, out: Path) -> dict[str, dict]:
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / args.parallel:.3f}")
  env.setdefault("PYTHONUNBUFFERED", "1")
  env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  queue, running, results = list(args.variants), [], {}

  def pump(name, proc):
    with open(out / f"{name}.log", "w") as log:
      for line in proc.stdout:
        log.write(line)
        if line.startswith(f"[{name}]"):
          say(line.rstrip("\n"))

  while queue or running:
    while queue and len(running) < args.parallel and budget.left() > 30:
      name = queue.pop(0)
      cmd = module_command(__file__) + ["--one", name, "--out", str(out)]
      cmd += _child_args(args)
      if budget.deadline() is not None:
        cmd += ["--deadline", str(budget.deadline())]
      proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, cwd=str(REPO))
      thread = threading.Thread(target=pump, args=(name, proc), daemon=True)
      thread.start()
      running.append((name, proc, thread))
      say(f"[master] started {name} ({budget.left():.0f} s of budget left)")
    for item in list(running):
      name, proc, thread = item
      if budget.left() < -20 and proc.poll() is None:
        proc.kill()
      if proc.poll() is not None:
        thread.join()
        running.remove(item)
        path = out / f"{name}.json"
        results[name] = (json.loads(path.read_text()) if path.exists() else
                         {"variant": name, "error": f"rc {proc.returncode}, see {name}.log"})
        say(f"[master] {name} finished (rc {proc.returncode})")
    if queue and budget.left() <= 30:
      for name in queue:
        results[name] = {"variant": name, "error": "skipped (budget)"}
      queue = []
    time.sleep(0.5)
  return results


def _child_args(args) -> list[str]:
  cmd = ["--preset", args.preset, "--precision", args.precision, "--steps", str(args.steps),
         "--eval-every", str(args.eval_every), "--seq-len", str(args.seq_len),
         "--batch", str(args.batch), "--lr", str(args.lr), "--corpus-mb", str(args.corpus_mb)]
  for item in args.overrides:
    cmd += ["--set", item]
  return cmd


def compare(results: dict[str, dict]) -> tuple[int | None, list[dict]]:
  """(the last eval step every finished variant reached, one row per variant)."""
  done = {k: r for k, r in results.items() if r.get("evals")}
  common = min((max(s for s, _ in r["evals"]) for r in done.values()), default=None)
  at = {k: dict(map(tuple, r["evals"])).get(common) for k, r in done.items()}
  ref = at.get(REFERENCE)
  rows = []
  for name, r in results.items():
    loss = at.get(name)
    pct = 100 * (loss - ref) / ref if loss is not None and ref else None
    b = r.get("budget") or {}
    n = r.get("num_params") or 0
    rows.append({"variant": name, "eval_loss": loss, "diff_pct": pct,
                 "within": None if pct is None else abs(pct) <= TARGET_PCT,
                 "bytes_per_param": {k: v / n for k, v in b.items()} if n else {},
                 "error": r.get("error")})
  return common, rows


def markdown(args, common, rows) -> str:
  lines = [f"# Master weights and gradients: {args.preset}, {args.precision}, "
           f"seq {args.seq_len} x batch {args.batch}, lr {args.lr:g}",
           "", f"Eval loss at step {common} (the last eval every variant reached; target "
           f"|diff| <= {TARGET_PCT} % vs {REFERENCE}). Bytes per param from "
           "training.build.memory_budget (master, grads, bf16 weight copy, optimizer state).", "",
           "| variant | eval loss | diff vs f32 master | within 0.3 % | master B | grads B | "
           "copy B | opt state B | total B |", "|---|---|---|---|---|---|---|---|---|"]
  f = lambda v, s: "n/a" if v is None else format(v, s)
  for r in rows:
    b = r["bytes_per_param"]
    lines.append(f"| {r['variant']} | {f(r['eval_loss'], '.4f')} | {f(r['diff_pct'], '+.3f')} % | "
                 f"{'' if r['within'] is None else ('yes' if r['within'] else 'NO')} | "
                 f"{f(b.get('params'), '.2f')} | {f(b.get('grads'), '.2f')} | "
                 f"{f(b.get('weight_copy'), '.2f')} | {f(b.get('optimizer_state'), '.2f')} | "
                 f"{f(b.get('total'), '.2f')} |" + (f" {r['error']}" if r["error"] else ""))
  lines += ["", "bf16 grads + bf16 master + SR is the bf16_master_sr run (bfloat16 params give "
            "bfloat16 gradients)."]
  return "\n".join(lines) + "\n"


def plot(results: dict[str, dict], path: Path) -> bool:
  import numpy as np
  done = {k: r for k, r in results.items() if r.get("losses")}
  if not done:
    return False
  plt = pyplot()
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
  ref = dict(map(tuple, done.get(REFERENCE, {}).get("evals", [])))
  for name, r in done.items():
    y = np.asarray(r["losses"], np.float64)
    k = max(1, min(50, len(y) // 20))
    ax.plot(np.arange(k, len(y) + 1), np.convolve(y, np.ones(k) / k, mode="valid"), lw=1, label=name)
    pts = [(s, 100 * (v - ref[s]) / ref[s]) for s, v in r["evals"] if s in ref]
    if pts:
      bx.plot(*zip(*pts), "o-", ms=3, lw=1, label=name)
  ax.set(xlabel="step", ylabel="train loss (moving mean)", title="training loss")
  bx.axhspan(-TARGET_PCT, TARGET_PCT, color="0.9")
  bx.set(xlabel="step", ylabel=f"eval loss vs {REFERENCE}, %", title="eval loss difference")
  for a in (ax, bx):
    a.grid(alpha=0.3)
    a.legend()
  return save_figure(fig, path)


def main(argv=None) -> dict:
  args = parse_args(argv)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  if args.one:
    rec = train_one(args)
    (out / f"{args.one}.json").write_text(json.dumps(rec))
    return rec
  budget = Budget(args.seconds_budget, reserve=15.0)
  say(f"[master] {len(args.variants)} variants of {args.preset} ({args.precision}), {args.steps} "
      f"steps, {args.parallel} at once" + (f", budget {args.seconds_budget:.0f} s"
                                            if args.seconds_budget else ""))
  # Tokenize (and cache) the corpus once here, not in every child at once (no device touched).
  from coat_jax.training import corpus, schema
  data = schema.load(None, config_overrides(args, REFERENCE)).data
  if data.kind == "stdlib":
    corpus.stdlib_tokens(data.vocab_size, data.corpus_max_bytes, data.cache_dir, say)
  results = run_children(args, budget, out)
  common, rows = compare(results)
  report = {"args": vars(args), "common_step": common, "rows": rows, "runs": results}
  (out / "master_weights.json").write_text(json.dumps(report, indent=1))
  (out / "master_weights.md").write_text(markdown(args, common, rows))
  plotted = plot(results, out / "master_weights.png")
  say("\n" + markdown(args, common, rows))
  say(f"[master] wrote {out}/master_weights.json, .md" + (", .png" if plotted else "")
      + f" in {budget.elapsed():.0f} s")
  return report


if __name__ == "__main__":
  main()
