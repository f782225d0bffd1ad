"""Pretraining accuracy: eval-loss curves of "bf16+adamw" vs "coat+coat_adamw" on the same data.

Each mode is one `coat_jax.training.loop.run()` (what train.py runs) on configs/llama-125m.yaml
(the offline stdlib corpus, its 32k BPE) with overrides: precision, optimizer, steps, sequence length, batch, eval cadence, an
out_dir per mode (`<out>/<mode>/`: metrics.jsonl, summary.json, loss.png, config.yaml) and a
temporary checkpoint directory that is deleted afterwards. The curves are read back from each
run's metrics.jsonl. Writes `<out>/accuracy.json` and `<out>/accuracy.png` (both eval curves on
one plot, train curves faint) and prints the eval losses side by side with the relative gap
(coat - bf16) / bf16; the "final gap" is taken at the last eval step both modes reached.

The corpus is the running Python's standard library, so its size depends on the installation: on
the GPU image it is 452 files, 2.14M tokens under the 32k BPE, and batch 8 x 1024 for 2000 steps
is 7.7 epochs (the held-out loss is lowest near step 1500 and turns up after it, in every mode).

--seconds-budget splits the remaining time evenly over the modes still to run; a mode that hits
its share stops (the loop's StopRequest: final eval, end-of-run checkpoint) and the later modes
then stop at the same step, so the curves stay comparable. Peak memory is process-wide here (the
modes share a process): use bench_e2e.py for memory.

GPU (H100, 2026-12-06: 2000 steps at batch 8 took bf16 91 s and coat 61 s with their compiles,
after ~1 min of BPE training on a fresh machine; ~4 min in all):
  python -m benchmarks.accuracy.accuracy --out $OUT/accuracy --seconds-budget 330
One mode per command (then merge without training):
  python -m benchmarks.accuracy.accuracy --out $OUT/accuracy --modes bf16+adamw --seconds-budget 460
  python -m benchmarks.accuracy.accuracy --out $OUT/accuracy --plot-only
CPU smoke (~40 s on 2 cores; the 4k BPE of configs/tiny.yaml is cached after the first run):
  JAX_PLATFORMS=cpu python -m benchmarks.accuracy.accuracy --config configs/tiny.yaml --steps 12 \\
      --seq-len 64 --batch 4 --eval-every 6 --eval-batches 1 --set model.num_layers=1 \\
      --out /tmp/acc_smoke
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
from benchmarks._common import MODE_COLORS, config_parser, parse_modes, pyplot, save_figure
from benchmarks._loss_curves import compare

MODES = ("bf16+adamw", "fp8_linear+adamw", "coat+coat_adamw")
DEFAULT_MODES = ("bf16+adamw", "coat+coat_adamw")


def parse_args(argv=None) -> argparse.Namespace:
  p = config_parser(__doc__, "llama-125m.yaml",
                    "extra train.py config override (repeatable), applied to every mode")
  p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated subset of {MODES}")
  p.add_argument("--steps", type=int, default=2000)
  p.add_argument("--seq-len", type=int, default=1024)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--eval-every", type=int, default=100)
  p.add_argument("--eval-batches", type=int, default=8)
  p.add_argument("--log-every", type=int, default=20)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs/accuracy", help="output directory")
  p.add_argument("--seconds-budget", type=float, default=None,
                 help="stop the runs (gracefully, at equal steps) so the script ends in time")
  p.add_argument("--reserve-seconds", type=float, default=30.0,
                 help="kept back from each mode's share for its final eval and checkpoint")
  p.add_argument("--plot-only", action="store_true",
                 help="no training: rebuild accuracy.json/png from the runs already in --out")
  args = p.parse_args(argv)
  args.modes = parse_modes(p, args.modes, MODES)
  return args


def say(msg: str) -> None:
  print(msg, flush=True)


def mode_dir(out: Path, mode: str) -> Path:
  return out / mode.replace("+", "_")


def run_mode(args: argparse.Namespace, mode: str, deadline: float | None,
             stop_after: int | None) -> dict:
  """One training run of `mode`; returns its summary (without per-step losses)."""
  from coat_jax.training import schema
  from coat_jax.training.loop import run

  precision, opt_name = mode.split("+")
  ckpt_dir = Path(tempfile.mkdtemp(prefix="coat_acc_ckpt_"))
  overrides = [
      f"precision={precision}", f"optimizer.name={opt_name}", f"run.steps={args.steps}",
      f"run.seed={args.seed}", f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch}",
      f"data.eval_batches={args.eval_batches}", f"run.eval_every={args.eval_every}",
      f"run.log_every={args.log_every}", f"run.out_dir={mode_dir(Path(args.out), mode)}",
      "run.progress=false", "run.tensorboard=false", "run.plot=true",
      f"checkpoint.dir={ckpt_dir}", "checkpoint.every=0", "checkpoint.async_save=false",
  ] + list(args.overrides)
  cfg = schema.load(args.config, overrides)

  def on_step(step, stop):
    if deadline is not None and time.time() > deadline and not stop:
      stop.request("seconds budget")

  say(f"[accuracy] {mode}: {cfg.model.preset}, {args.steps} steps of {args.batch} x {args.seq_len}"
      + (f", stopping at step {stop_after} (as the earlier mode)" if stop_after else "")
      + (f", {deadline - time.time():.0f} s for this mode" if deadline else ""))
  try:
    summary = run(cfg, stop_after=stop_after, log=say, on_step=on_step, overwrite=True)
  finally:
    shutil.rmtree(ckpt_dir, ignore_errors=True)  # the end-of-run checkpoint is not needed
  return {k: v for k, v in summary.items() if k not in ("losses", "eval_losses")}


def read_curves(run_dir: Path) -> dict:
  """Train (logged means) and eval curves from a run's metrics.jsonl; {} if there is none."""
  from coat_jax.training import metrics as metrics_lib

  path = run_dir / "metrics.jsonl"
  if not path.is_file():
    return {}
  records = metrics_lib.read_jsonl(path)
  as_float = lambda v: float(v) if isinstance(v, (int, float)) else float("nan")  # "nan" strings
  curves = {"eval": [[r["step"], as_float(r["loss"])] for r in records if r.get("split") == "eval"],
            "train": [[r["step"], as_float(metrics_lib.train_loss_mean(r))] for r in records
                      if r.get("split") == "train"],
            "epoch": max((r.get("epoch", 0.0) for r in records if r.get("split") == "train"), default=0.0)}
  summary_path = run_dir / "summary.json"
  if summary_path.is_file():
    curves["summary"] = json.loads(summary_path.read_text())
  return curves


def plot(curves: dict[str, dict], cmp: dict, path: Path, title: str) -> bool:
  """Eval curves of all modes on one axis (train curves faint); the relative gap below."""
  plt = pyplot()
  fig, (ax, gx) = plt.subplots(2, 1, figsize=(8, 6.5), dpi=110, sharex=True,
                               gridspec_kw={"height_ratios": [3, 1]})
  colors = MODE_COLORS
  drawn = False
  for mode, c in curves.items():
    color, ls = colors.get(mode), "-" if mode == "bf16+adamw" else "--"
    train = [(s, v) for s, v in c.get("train", []) if math.isfinite(v)]
    ev = [(s, v) for s, v in c.get("eval", []) if math.isfinite(v)]
    if train:
      ax.plot(*zip(*train), color=color, alpha=0.25, lw=1, label=f"{mode} train")
    if ev:
      ax.plot(*zip(*ev), "o" + ls, color=color, lw=1.8, ms=3.5, label=f"{mode} eval")
      drawn = True
  if not drawn:
    plt.close(fig)
    return False
  for mode, gaps in cmp.get("rel_gap", {}).items():
    pts = [(s, 100 * g) for s, g in zip(cmp["steps"], gaps) if g is not None]
    if pts:
      gx.plot(*zip(*pts), "o--", color=colors.get(mode), ms=3, label=f"{mode} vs bf16+adamw")
  gx.axhline(0.0, color="k", lw=0.8)
  gx.set_ylabel("eval gap (%)")
  gx.set_xlabel("step")
  gx.grid(alpha=0.3)
  if cmp.get("rel_gap"):
    gx.legend(fontsize=8)
  ax.set_ylabel("cross-entropy (nats/token)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  return save_figure(fig, path)


def report(args: argparse.Namespace, runs: dict[str, dict]) -> dict:
  """Reads every mode's curves from --out, writes accuracy.json + accuracy.png, prints the table."""
  out = Path(args.out)
  curves = {m: c for m in MODES if (c := read_curves(mode_dir(out, m)))}
  cmp = compare(curves)
  result = {"args": vars(args), "runs": runs, "curves": curves, "comparison": cmp}
  out.mkdir(parents=True, exist_ok=True)
  (out / "accuracy.json").write_text(json.dumps(result, indent=2))
  title = f"{Path(args.config).stem}: seq {args.seq_len}, batch {args.batch}, {args.steps} steps"
  plotted = plot(curves, cmp, out / "accuracy.png", title)
  modes = cmp["modes"]
  if not modes:
    say("[accuracy] no eval losses found")
    return result
  say("\nEval loss (nats/token) at the steps all modes reached")
  head = f"{'step':>6} " + " ".join(f"{m:>17}" for m in modes) + "".join(
      f" {'gap ' + m.split('+')[0]:>14}" for m in cmp["rel_gap"])
  say(head)
  say("-" * len(head))
  for i, s in enumerate(cmp["steps"]):
    say(f"{s:>6} " + " ".join(f"{cmp['eval'][m][i]:17.4f}" for m in modes) + "".join(
        f" {100 * g[i]:+13.2f}%" if g[i] is not None else f" {'n/a':>14}" for g in cmp["rel_gap"].values()))
  for m in modes:
    s = curves[m].get("summary", {})
    tps, mfu = s.get("tokens_per_s"), s.get("mfu")
    first = s.get("train_loss_first", s.get("first_train_loss"))  # older summaries: first_/final_
    last = s.get("train_loss_last", s.get("final_train_loss"))
    say(f"  {m}: {s.get('step', '?')} steps, {curves[m].get('epoch', 0):.2f} epochs, "
        f"{tps or 0:,.0f} tokens/s, MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}, "
        f"train loss (one batch) {first or float('nan'):.3f} -> {last or float('nan'):.3f}, "
        f"wall {s.get('wall_s') or 0:.0f} s")
  for m, g in cmp["final_gap"].items():
    say(f"[accuracy] final relative eval-loss gap at step {cmp['final_step']}: "
        f"{m} vs bf16+adamw = {100 * g:+.2f}%")
  say(f"[accuracy] wrote {out / 'accuracy.json'}" + (f" and {out / 'accuracy.png'}" if plotted else ""))
  return result


def main(argv=None) -> dict:
  args = parse_args(argv)
  t0 = time.time()
  runs: dict[str, dict] = {}
  if not args.plot_only:
    stop_after = None
    for i, mode in enumerate(args.modes):
      deadline = None
      if args.seconds_budget is not None:
        left = t0 + args.seconds_budget - time.time()
        deadline = time.time() + left / (len(args.modes) - i) - args.reserve_seconds
      summary = run_mode(args, mode, deadline, stop_after)
      runs[mode] = summary
      if summary.get("interrupted") and summary["step"] < args.steps:
        stop_after = summary["step"] if stop_after is None else min(stop_after, summary["step"])
      gc.collect()
      import jax
      jax.clear_caches()
  result = report(args, runs)
  say(f"[accuracy] done in {time.time() - t0:.0f} s")
  return result


if __name__ == "__main__":
  main()
