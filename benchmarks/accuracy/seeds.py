"""Several seeds of the accuracy benchmark at once: a table and one plot of the eval-loss gap.

Reads the `accuracy.json` of each seed's run of `benchmarks/accuracy/accuracy.py` (the same
command with `--seed S`), prints each seed's final and lowest eval loss per mode with coat's
relative gap (coat - bf16) / bf16, their mean over the seeds and bf16's own seed-to-seed spread
(one standard deviation of its final loss, relative), and plots every seed's gap along the run
with the mean gap (`--plot`):

  python -m benchmarks.accuracy.seeds docs/gpu_results/accuracy_llama125m_h100_2026-12-06.json \\
      docs/gpu_results/accuracy_llama125m_seed{1,2}_h100_2026-12-06.json --plot seeds.png

Runs of one mode alone (`accuracy.py --modes coat+coat_adamw --set ...`, e.g. an option tried at
the defaults' seeds) take bf16's curve from `--baseline` runs: each seed's from the baseline run of
the same seed, which must match it in config, steps, sequence length, batch and eval cadence:

  python -m benchmarks.accuracy.seeds fp8_s0/accuracy.json fp8_s1/accuracy.json \\
      --baseline docs/gpu_results/accuracy_llama125m_h100_2026-12-06.json \\
      docs/gpu_results/accuracy_llama125m_seed{1,2}_h100_2026-12-06.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks._common import pyplot, save_figure
from benchmarks._loss_curves import BASE, compare

# What a baseline run must share with the run it stands beside (accuracy.py's arguments).
SAME_RUN = ("steps", "seq_len", "batch", "eval_every", "eval_batches")


def with_baseline(result: dict, baselines: list[dict], where: str) -> dict:
  """`result` with bf16's eval curve from the baseline run of its seed and its comparison made
  again; unchanged where it ran bf16 itself. ValueError (one line) where no baseline ran bf16 at
  that seed, or that run differs from it in config or one of SAME_RUN."""
  if not baselines or BASE in result["comparison"].get("eval", {}):
    return result
  seed = result["args"]["seed"]
  match = [b for b in baselines if b["args"]["seed"] == seed and BASE in b.get("curves", {})]
  if not match:
    raise ValueError(f"{where}: no {BASE} run of seed {seed} among the baselines")
  base_args, args = match[0]["args"], result["args"]
  differ = [k for k in SAME_RUN if base_args.get(k) != args.get(k)]
  if Path(base_args.get("config", "")).name != Path(args.get("config", "")).name:
    differ.insert(0, "config")
  if differ:
    raise ValueError(f"{where}: its seed {seed} baseline ran with another {', '.join(differ)}")
  curves = {BASE: match[0]["curves"][BASE], **result["curves"]}
  return dict(result, curves=curves, comparison=compare(curves))


def seed_losses(result: dict, mode: str) -> tuple[float, float]:
  """(final, lowest) eval loss of `mode` at the steps every mode of the run reached."""
  curve = result["comparison"]["eval"][mode]
  return curve[-1], min(curve)


def summarize(results: list[dict], mode: str) -> dict:
  """Per seed and mean: final and lowest eval loss of bf16 and `mode`, and the relative gaps."""
  rows = []
  for r in results:
    (bf, bl), (cf, cl) = seed_losses(r, BASE), seed_losses(r, mode)
    rows.append({"seed": r["args"]["seed"], "bf16_final": bf, "final": cf, "bf16_lowest": bl,
                 "lowest": cl, "final_gap": (cf - bf) / bf, "lowest_gap": (cl - bl) / bl})
  mean = {k: statistics.fmean(row[k] for row in rows) for k in rows[0] if k != "seed"}
  mean["final_gap"] = (mean["final"] - mean["bf16_final"]) / mean["bf16_final"]
  mean["lowest_gap"] = (mean["lowest"] - mean["bf16_lowest"]) / mean["bf16_lowest"]
  finals = [row["bf16_final"] for row in rows]
  spread = statistics.stdev(finals) / statistics.fmean(finals) if len(finals) > 1 else float("nan")
  gaps = [g for r in results for g in r["comparison"]["rel_gap"][mode] if g is not None]
  return {"mode": mode, "seeds": rows, "mean": mean, "bf16_seed_spread": spread,
          "evals": len(gaps), "evals_above": sum(g > 0 for g in gaps),
          "gap_range": (min(gaps), max(gaps)), "mean_eval_gap": statistics.fmean(gaps)}


def table(s: dict) -> list[str]:
  out = [f"{'seed':>5} {'bf16 final':>11} {s['mode'] + ' final':>22} {'gap':>8} "
         f"{'bf16 lowest':>12} {'lowest':>8} {'gap':>8}"]
  for row in s["seeds"] + [dict(s["mean"], seed="mean")]:
    out.append(f"{row['seed']:>5} {row['bf16_final']:11.4f} {row['final']:22.4f} "
               f"{100 * row['final_gap']:+7.2f}% {row['bf16_lowest']:12.4f} {row['lowest']:8.4f} "
               f"{100 * row['lowest_gap']:+7.2f}%")
  lo, hi = s["gap_range"]
  out.append(f"bf16's seed-to-seed spread of the final loss: {100 * s['bf16_seed_spread']:.2f}% "
             f"(one standard deviation); over the {s['evals']} evaluations the gap lies in "
             f"[{100 * lo:+.2f}%, {100 * hi:+.2f}%], above zero at {s['evals_above']}, "
             f"{100 * s['mean_eval_gap']:+.2f}% on average")
  return out


def plot(results: list[dict], mode: str, path: Path) -> bool:
  """Each seed's gap along the run (thin) and the mean over the seeds (thick)."""
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(8, 3.6), dpi=110)
  steps = results[0]["comparison"]["steps"]
  for r in results:
    pts = [(s, 100 * g) for s, g in zip(r["comparison"]["steps"], r["comparison"]["rel_gap"][mode])
           if g is not None]
    ax.plot(*zip(*pts), "o-", lw=1, ms=2.5, alpha=0.6, label=f"seed {r['args']['seed']}")
  shared = [s for s in steps if all(s in r["comparison"]["steps"] for r in results)]
  mean = [statistics.fmean(100 * r["comparison"]["rel_gap"][mode][r["comparison"]["steps"].index(s)]
                           for r in results) for s in shared]
  ax.plot(shared, mean, "k-", lw=2.2, label=f"mean of {len(results)} seeds")
  ax.axhline(0.0, color="k", lw=0.8)
  ax.set_xlabel("step")
  ax.set_ylabel("eval loss gap (%)")
  ax.set_title(f"{mode} vs {BASE}: (coat - bf16) / bf16 of the eval loss")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return save_figure(fig, path)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("results", nargs="+", help="accuracy.json of each seed's run")
  p.add_argument("--mode", default="coat+coat_adamw", help="the mode compared with bf16+adamw")
  p.add_argument("--plot", default=None, help="write the gap plot to this PNG")
  p.add_argument("--baseline", nargs="+", default=[],
                 help="accuracy.json of runs with bf16+adamw, for results that ran without it")
  args = p.parse_args(argv)
  results = [json.loads(Path(f).read_text()) for f in args.results]
  baselines = [json.loads(Path(f).read_text()) for f in args.baseline]
  try:
    results = [with_baseline(r, baselines, f) for f, r in zip(args.results, results)]
  except ValueError as e:
    p.error(str(e))
  for f, r in zip(args.results, results):
    if args.mode not in r["comparison"].get("rel_gap", {}):
      p.error(f"{f}: no {args.mode} against {BASE} in this run")
  s = summarize(results, args.mode)
  print("\n".join(table(s)))
  if args.plot and plot(results, args.mode, Path(args.plot)):
    print(f"[seeds] wrote {args.plot}")
  return s


if __name__ == "__main__":
  main()
