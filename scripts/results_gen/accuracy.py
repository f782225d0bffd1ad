"""The accuracy tables: loss curves against bf16, stability across seeds and learning rates, the
optimizer-state formats, bfloat16 master weights, the optimizer's group axis."""
from __future__ import annotations

import re

from .common import Sources, fmt, ratio, source_line


# The accuracy runs at the current defaults: (seed, source of both modes, or {mode: source}), the
# same command but --seed (seeds 3-5: one mode a run).
ACCURACY_SEEDS = ((0, "accuracy_llama125m_h100"), (1, "accuracy_llama125m_seed1_h100"),
                  (2, "accuracy_llama125m_seed2_h100"),
                  *((s, {"bf16+adamw": f"accuracy_llama125m_seed{s}_bf16_h100",
                         "coat+coat_adamw": f"accuracy_llama125m_seed{s}_coat_h100"})
                    for s in (3, 4, 5)))
MODES = ("bf16+adamw", "coat+coat_adamw")


def seed_sources(runs) -> dict[str, str]:
  """{mode: source} of an ACCURACY_SEEDS entry's runs."""
  return runs if isinstance(runs, dict) else dict.fromkeys(MODES, runs)


def accuracy_source_ids() -> list[str]:
  """Every source of the accuracy runs, seed by seed."""
  return list(dict.fromkeys(sid for _, runs in ACCURACY_SEEDS
                            for sid in seed_sources(runs).values()))


def accuracy_losses(src: Sources) -> dict[int, dict[str, tuple[float, float]]]:
  """Per seed and mode: (final eval loss, lowest eval loss along the run)."""
  out = {}
  for seed, runs in ACCURACY_SEEDS:
    out[seed] = {}
    for m, sid in seed_sources(runs).items():
      curve = eval_curve(src, sid, m)
      out[seed][m] = (src.value(sid, "runs")[m]["final_eval_loss"], min(curve))
  return out


def mean_losses(losses: dict[int, dict]) -> dict[str, tuple[float, float]]:
  """Per run kind (the keys of each seed's entry, as `accuracy_losses`): (final, lowest) eval
  loss, each the mean over the seeds."""
  kinds = next(iter(losses.values()))
  return {m: tuple(sum(losses[s][m][i] for s in losses) / len(losses) for i in (0, 1))
          for m in kinds}


def accuracy_mean(src: Sources) -> tuple[float, float]:
  """The final eval loss of each mode, mean over the seeds (bf16, coat)."""
  means = mean_losses(accuracy_losses(src))
  return tuple(means[m][0] for m in MODES)


def seed_source_lines(src: Sources, seeds) -> list[str]:
  """The source lines of (seed, runs) pairs: the first as it is, the others named by seed (and
  mode, where each mode ran on its own)."""
  named = []
  for seed, runs in seeds:
    if isinstance(runs, str):
      named.append((f"Seed {seed}", runs))
    else:
      named += [(f"Seed {seed}, {m.replace('+', ' + ')}", sid) for m, sid in runs.items()]
  return [source_line(src, sid) if i == 0 else f"{label}: " + source_line(src, sid)
          for i, (label, sid) in enumerate(named)]


def accuracy(src: Sources) -> list[str]:
  losses = accuracy_losses(src)
  out = ["| seed | final eval loss, bf16 + adamw | final, coat + coat_adamw | coat vs bf16 "
         "| lowest eval loss, bf16 | lowest, coat | coat vs bf16 |", "|---|---|---|---|---|---|---|"]
  rows = [(str(s), losses[s]) for s in losses] + [("mean", mean_losses(losses))]
  for name, l in rows:
    (bf, bl), (cf, cl) = l[MODES[0]], l[MODES[1]]
    out.append(f"| {name} | {bf:.4f} | {cf:.4f} | {ratio('pct', bf, cf)} | {bl:.4f} | {cl:.4f} "
               f"| {ratio('pct', bl, cl)} |")
  return out + [""] + seed_source_lines(src, ACCURACY_SEEDS)


# coat with one option set, at some of the defaults' seeds: (option as the table names it,
# ((seed, source), ...)).
# FP8 attention residuals' seed 2: the run's printed log (its accuracy.json did not come back
# from the GPU machine).
FP8_ATTENTION = ("`attention_residuals: fp8`",
                 ((0, "accuracy_llama125m_fp8_attention_h100"),
                  (1, "accuracy_llama125m_fp8_attention_seed1_h100"),
                  (2, "accuracy_llama125m_fp8_attention_seed2_h100")))


def eval_curve(src: Sources, sid: str, mode: str) -> list[float]:
  """A run's eval losses along the run: from its accuracy.json, or from the table of eval losses
  that accuracy.py prints (one column: a run of `mode` alone)."""
  raw = src.raw(sid)
  if isinstance(raw, dict):
    return raw["comparison"]["eval"][mode]
  table = raw.partition("Eval loss (nats/token)")[2]
  if not table or table.splitlines()[1].split() != ["step", mode]:
    raise ValueError(f"{sid}: no eval-loss table of {mode} alone in {src.meta[sid]['raw']}")
  return [float(v) for v in re.findall(r"\n\s+\d+\s+([\d.]+)(?=\n)", table)]


def coat_option_accuracy(src: Sources, option: tuple) -> list[str]:
  """The default runs' table with a column of coat + coat_adamw runs with `option` set."""
  name, seeds = option
  losses = accuracy_losses(src)
  assert {s for s, _ in seeds} <= set(losses), "the option's seeds have default runs"
  losses = {s: losses[s] for s, _ in seeds}
  for seed, sid in seeds:
    curve = eval_curve(src, sid, MODES[1])
    losses[seed]["option"] = (curve[-1], min(curve))
  out = ["| seed | final eval loss, bf16 + adamw | coat + coat_adamw | vs bf16 "
         f"| coat, {name} | vs bf16 |", "|---|---|---|---|---|---|"]
  means = mean_losses(losses)
  rows = [(str(s), losses[s], 0) for s in losses] + [("mean", means, 0),
                                                     ("mean, lowest eval loss", means, 1)]
  for row, l, i in rows:   # i: 0 the final eval loss, 1 the lowest along the run
    b, c, f = l[MODES[0]][i], l[MODES[1]][i], l["option"][i]
    out.append(f"| {row} | {b:.4f} | {c:.4f} | {ratio('pct', b, c)} | {f:.4f} "
               f"| {ratio('pct', b, f)} |")
  return out + [""] + seed_source_lines(src, seeds)


LINEAR_REMADE = ("`linear_residuals: remade`",
                 ((0, "accuracy_llama125m_linear_remade_h100"),
                  (1, "accuracy_llama125m_linear_remade_seed1_h100"),
                  (2, "accuracy_llama125m_linear_remade_seed2_h100"),
                  *((s, f"accuracy_llama125m_linear_remade_seed{s}_h100") for s in (3, 4, 5))))


def accuracy_fp8_attention(src: Sources) -> list[str]:
  return coat_option_accuracy(src, FP8_ATTENTION)


def accuracy_linear_remade(src: Sources) -> list[str]:
  return coat_option_accuracy(src, LINEAR_REMADE)


def stability(src: Sources) -> list[str]:
  sid = "stability_h100"
  runs = src.value(sid, "runs")
  out = ["| mode | peak lr | diverged (of 3 seeds) | final train loss, mean over seeds |",
         "|---|---|---|---|"]
  for mode in ("bf16+adamw", "fp8_linear+adamw", "coat+coat_adamw"):
    for lr in (0.003, 0.03, 0.3):
      rs = [r for r in runs if r["mode"] == mode and r["lr"] == lr]
      div = sum(bool(r["diverged"]) for r in rs)
      mean = sum(r["final_loss"] for r in rs) / len(rs)
      out.append(f"| {mode} | {lr:g} | {div} of {len(rs)} | {mean:.4f} |")
  return out + ["", source_line(src, sid)]


def formats(src: Sources) -> list[str]:
  sid = "state_formats_h100"
  f = src.value(sid, "formats")
  out = ["| format | expansion | m rel. MSE | v rel. MSE | v flushed to 0 | final train loss |",
         "|---|---|---|---|---|---|"]
  for r in f["rows"]:
    out.append(f"| {r['format']} | {'on' if r['expand'] else 'off'} | {r['m_rel_mse_geomean']:.2e} "
               f"| {r['v_rel_mse_geomean']:.2e} | {100 * r['v_flushed_frac']:.2f} % "
               f"| {fmt(r['final_loss'], '.4f')} |")
  return out + ["", source_line(src, sid)]


def master_weights(src: Sources) -> list[str]:
  sid = "master_weights_h100"
  out = ["| variant | eval loss, step 2000 | vs float32 master | bytes per parameter |",
         "|---|---|---|---|"]
  for r in src.value(sid, "rows"):
    out.append(f"| {r['variant']} | {r['eval_loss']:.4f} | {r['diff_pct']:+.3f} % "
               f"| {r['bytes_per_param']['total']:.2f} |")
  return out + ["", source_line(src, sid)]


def group_axis(src: Sources) -> list[str]:
  out = ["| seed | eval loss, `group_axis: last` | eval loss, `group_axis: coat` | coat vs last |",
         "|---|---|---|---|"]
  for seed, sid, last, coat in ((0, "group_axis_loss_seed0_h100", "f32_master", "coat_group_axis"),
                                (1, "group_axis_loss_seed1_h100", "group_axis_last", "f32_master"),
                                (2, "group_axis_loss_seed2_h200", "group_axis_last",
                                 "group_axis_coat")):
    loss = {r["variant"]: r["eval_loss"] for r in src.value(sid, "rows")}
    out.append(f"| {seed} | {loss[last]:.4f} | {loss[coat]:.4f} | "
               f"{ratio('pct', loss[last], loss[coat])} |")
  return out + ["", source_line(src, "group_axis_loss_seed0_h100"),
                "Seed 1: " + source_line(src, "group_axis_loss_seed1_h100"),
                "Seed 2: " + source_line(src, "group_axis_loss_seed2_h200")]
