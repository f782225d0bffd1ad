"""The floor of one train step per kernel category, against a measured profile; or (--summary) one
table of what is left between each measured number and its floor.

Counted on the CPU from the traced train step (benchmarks/_floor.py: what each category counts,
how remat's recompute and microbatches are counted; no GPU, nothing allocated, ~1 s of CPU per
trace), at a GPU's datasheet dense peaks: `--gpu h200` (default) or `h100` (`_common.GPU_PEAKS`:
FP8 1979, bf16 989 TFLOP/s both; HBM 4.8 and 3.35 TB/s). `--hbm-tbps` puts a measured bandwidth
in the datasheet's place (on the H200, 2026-11-26, `python -m benchmarks.step.bench_optimizer`:
3.878 TB/s for its best copy-like stream, 3.92 TB/s for the row Adam kernel itself).

Default: the step's floor per category (FP8 GEMM, bf16 GEMM, attention, quantize, optimizer), bf16
and coat. With --profile (profile_step.py's --json of a bf16 and a coat variant), every category's
measured GPU time is printed beside its floor, and what 1.43x of the bf16 step would ask of the
coat-only categories (FP8 GEMM and quantize) with the rest as measured.

--summary: one markdown table, a row per number:
  optimizer  the step bench_optimizer times: 1.21e9 float32 parameters with coat_adamw, 16.16
             bytes each moved; measured: --optimizer-ms [LABEL=]MS (its kernel time; repeatable)
  layer      the Llama-2-7B decoder layer forward + backward that bench_layer times (batch 8 x
             2048, bf16 weights), bf16 and coat; measured: --layer-ms PRECISION=MS
  step       train.py's step of --preset at --batch x --seq-len (and --set), bf16 and coat (or
             only the precisions --tokens-per-s names, where it names any); measured:
             --tokens-per-s PRECISION=TOKENS_PER_S, or --summary-json [PRECISION=]PATH (train.py's
             summary.json; its step counted at the preset, shape, precision, remat and
             microbatches of the config.yaml beside it where there is one)
with the FLOPs and bytes counted, the compute floor (FLOPs at the dense peaks), the byte floor
(bytes at the bandwidth), the floor (the larger), what bounds it, the measured ms and measured /
floor. With no measured numbers it prints the floors only.

  python -m benchmarks.step.step_floor                        # floors only (CPU, ~5 s)
  python -m benchmarks.step.profile_step --variants bf16:loop,coat:loop --json $OUT/p.json   # GPU
  python -m benchmarks.step.step_floor --profile $OUT/p.json --gpu h200
  python -m benchmarks.step.step_floor --summary --preset llama2-7b --seq-len 4096 --batch 16 \\
      --set optimizer.accumulate=4 --hbm-tbps 3.878 --optimizer-ms rows=4.99 \\
      --optimizer-ms cols=7.60 --layer-ms coat=22.70 --layer-ms bf16=33.37 \\
      --tokens-per-s coat=18415
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
from pathlib import Path

from benchmarks._floor import (CATEGORIES, OPTIMIZER_PARAMS, category_ms,
                               optimizer_bytes_per_param, roofline, step_counts)
from benchmarks._common import GPU_PEAKS

PRECISIONS = ("bf16", "coat")
# bench_layer's default layer: Llama-2-7B width, batch 8 x 2048, bf16 weights.
LAYER = dict(preset="llama2-7b", seq_len=2048, batch=8, sets=("model.param_dtype=bfloat16",))
# The model and optimizer keys of a train.py run's config.yaml that change the counted step.
RUN_KEYS = ("model.remat", "model.attention_residuals", "model.param_dtype", "model.vocab_size",
            "model.num_layers", "model.hidden_size", "model.intermediate_size",
            "model.num_heads", "model.num_kv_heads", "model.head_dim", "optimizer.accumulate",
            "optimizer.grad_dtype")


def peaks_of(gpu, hbm_tbps=None) -> dict:
  """GPU_PEAKS[gpu], its bandwidth replaced by `hbm_tbps` TB/s when given."""
  peaks = dict(GPU_PEAKS[gpu])
  if hbm_tbps:
    peaks.update(hbm_bytes_per_s=hbm_tbps * 1e12, hbm_measured=True)
  return peaks


def peaks_line(peaks) -> str:
  hbm = peaks["hbm_bytes_per_s"] / 1e12
  return (f"{peaks['name']} datasheet peaks (FP8 {peaks['fp8_flops'] / 1e12:.0f}, bf16 "
          f"{peaks['bf16_flops'] / 1e12:.0f} TFLOP/s, HBM " +
          (f"{hbm:.3f} TB/s measured)" if peaks.get("hbm_measured") else f"{hbm:.2f} TB/s)"))


def floors(preset, seq_len, batch, sets, peaks) -> dict:
  """{"layers", precision: {"ms" (category: floor ms), "counts", "per_layer"}} of the full step."""
  out = {}
  for precision in PRECISIONS:
    got = step_counts(preset, precision, seq_len, batch, sets)
    out["layers"] = got["layers"]
    out[precision] = dict(ms=category_ms(got["counts"], peaks), counts=got["counts"],
                          per_layer=got["per_layer"])
  return out


def measured(profile_path) -> dict:
  """{precision: its first variant's row} of a profile_step.py --json file."""
  out = {}
  for row in json.loads(Path(profile_path).read_text()):
    out.setdefault(row["variant"].split(":")[0], row)
  return out


def back_to_back_ms(row) -> float:
  """A profiled variant's step as train.py runs it: the traced steps' GPU span per step (they
  are dispatched back to back), or its blocked wall time where the trace has no span."""
  span = (row.get("gaps") or {}).get("span_ms")
  return span / row.get("iters", 1) if span else row["step_ms"]


def report(fl, a, profile, peaks) -> str:
  lines = [f"{a.preset}, batch {a.batch} x {a.seq_len}, {fl['layers']} layers; floors at "
           f"{peaks_line(peaks)}"]
  rows = measured(profile) if profile else {}
  meas = {p: rows.get(p) for p in PRECISIONS}
  head = f"{'ms per step':<22}{'bf16 floor':>11}{'measured':>10}{'coat floor':>12}{'measured':>10}"
  lines += ["", head, "-" * len(head)]
  totals = collections.Counter()
  for cat in CATEGORIES:
    row = f"{cat:<22}"
    for p in PRECISIONS:
      f = fl[p]["ms"].get(cat, 0.0)
      m = meas[p]["category_ms"].get(cat) if meas[p] else None
      totals[p, "floor"] += f
      totals[p, "meas"] += m or 0.0
      row += f"{f:>{11 if p == 'bf16' else 12}.2f}"
      row += f"{m:>10.2f}" if m is not None else f"{'':>10}"
    lines.append(row)
  if all(meas.values()):
    rest = {p: meas[p]["kernel_ms"] - totals[p, "meas"] for p in PRECISIONS}
    lines.append(f"{'everything else':<22}{'':>11}{rest['bf16']:>10.2f}{'':>12}"
                 f"{rest['coat']:>10.2f}")
    lines.append(f"{'kernel total':<22}{totals['bf16', 'floor']:>11.2f}"
                 f"{meas['bf16']['kernel_ms']:>10.2f}{totals['coat', 'floor']:>12.2f}"
                 f"{meas['coat']['kernel_ms']:>10.2f}")
    lines.append(f"{'step, blocked (wall)':<22}{'':>11}{meas['bf16']['step_ms']:>10.2f}{'':>12}"
                 f"{meas['coat']['step_ms']:>10.2f}")
    step = {p: back_to_back_ms(meas[p]) for p in PRECISIONS}
    lines.append(f"{'step, back to back':<22}{'':>11}{step['bf16']:>10.2f}{'':>12}"
                 f"{step['coat']:>10.2f}")
    bf16, coat = step["bf16"], step["coat"]
    own = ("FP8 GEMM", "quantize")
    own_ms = sum(meas["coat"]["category_ms"].get(c, 0.0) for c in own)
    own_floor = sum(fl["coat"]["ms"][c] for c in own)
    target = bf16 / a.ratio
    budget = target - (coat - own_ms)
    at_floor = {p: totals[p, "floor"] + rest[p] for p in PRECISIONS}
    lines += ["", f"coat vs bf16, steps back to back: {bf16 / coat:.2f}x ({coat:.1f} vs {bf16:.1f} "
              f"ms). Both steps with every category above at its floor and the rest as measured: "
              f"{at_floor['bf16']:.1f} vs {at_floor['coat']:.1f} ms, "
              f"{at_floor['bf16'] / at_floor['coat']:.2f}x.",
              f"{a.ratio}x needs coat <= {target:.1f} ms. With everything but the FP8 GEMMs and "
              f"the quantize kernels as measured ({coat - own_ms:.1f} ms), those two get "
              f"{budget:.1f} ms; they take {own_ms:.1f} ms now, and their floor is "
              f"{own_floor:.1f} ms: they would have to run at {own_floor / budget:.0%} of the "
              f"peaks "
              f"(now {own_floor / own_ms:.0%})." if budget > 0 else
              f"{a.ratio}x needs coat <= {target:.1f} ms: less than the categories bf16 shares."]
  return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# --summary: one table, a row per measured number.


def _pairs(p, flag, values, labels=None) -> list[tuple[str, float]]:
  """[(label, value > 0)] of repeated `LABEL=VALUE` (or a bare VALUE: label "") options; a bad one
  exits through p.error naming it."""
  out = []
  for text in values:
    label, _, num = text.rpartition("=")
    try:
      value = float(num)
    except ValueError:
      value = float("nan")
    if not value > 0 or (labels is not None and label not in labels):
      want = f"{'|'.join(labels)}=" if labels else "[LABEL=]"
      p.error(f"{flag} {text!r}: expected {want}NUMBER with the number > 0")
    out.append((label, value))
  return out


def run_of_summary(p, spec, a) -> dict:
  """A step row's spec from --summary-json [PRECISION=]PATH: train.py's summary.json (tokens_per_s,
  mfu, flops_per_token) and, where it lies beside it, the run's config.yaml (preset, shape,
  precision and RUN_KEYS); the rest from the command line."""
  head, _, tail = spec.partition("=")
  precision, path = (head, tail) if head in PRECISIONS else ("", spec)
  try:
    summary = json.loads(Path(path).read_text())
    tps = float(summary["tokens_per_s"])
  except (OSError, ValueError, KeyError, TypeError) as e:
    p.error(f"--summary-json {path}: not a train.py summary.json with tokens_per_s ({e})")
  run = dict(preset=a.preset, seq_len=a.seq_len, batch=a.batch, sets=tuple(a.sets),
             precision=precision, tokens_per_s=tps, summary=summary, source=path)
  config = Path(path).with_name("config.yaml")
  if config.is_file():
    from coat_jax.training import schema
    try:
      cfg = schema.load(config)
    except ValueError as e:
      p.error(f"--summary-json: {config}: {str(e).splitlines()[0]}")
    sets = []
    for key in RUN_KEYS:
      section, name = key.split(".")
      value = getattr(getattr(cfg, section), name)
      if value is not None:
        sets.append(f"{key}={value}")
    run.update(preset=cfg.model.preset, seq_len=cfg.data.seq_len, batch=cfg.data.batch_size,
               sets=tuple(sets) + tuple(a.sets), precision=precision or cfg.precision)
  if run["precision"] not in PRECISIONS:
    p.error(f"--summary-json {spec}: name the precision (bf16=PATH or coat=PATH); "
            f"found {run['precision'] or 'no config.yaml beside it'}")
  return run


def _ms(x) -> str:
  """Four significant digits, no exponent: 2876, 21.09, 0.04512."""
  return "0" if not x else f"{x:.{max(0, 3 - math.floor(math.log10(abs(x))))}f}"


def _tflop(x) -> str:
  return f"{x / 1e12:,.1f} TFLOP" if x else "0"


def summary_rows(a, peaks, runs) -> list[dict]:
  """The --summary table's rows: {"row", "flops", "bytes", "compute ms", "bytes ms", "floor ms",
  "bound", "measured ms"} (measured ms None where no number was given)."""
  rows = []
  opt_bytes = OPTIMIZER_PARAMS * optimizer_bytes_per_param("coat")
  opt = roofline({"optimizer bytes": opt_bytes}, peaks)
  for label, ms in a.optimizer_ms or [("", None)]:
    name = f"optimizer step, {OPTIMIZER_PARAMS / 1e9:.2f}e9 float32 params, coat_adamw"
    rows.append(dict(opt, row=name + (f" ({label})" if label else ""), **{"measured ms": ms}))
  layer_ms = dict(a.layer_ms)
  for precision in PRECISIONS:
    got = step_counts(LAYER["preset"], precision, LAYER["seq_len"], LAYER["batch"],
                             LAYER["sets"])
    rows.append(dict(roofline(got["per_layer"], peaks),
                     row=f"{LAYER['preset']} decoder layer fwd+bwd, batch {LAYER['batch']} x "
                     f"{LAYER['seq_len']}, {precision}",
                     **{"measured ms": layer_ms.get(precision)}))
  for run in runs:
    got = step_counts(run["preset"], run["precision"], run["seq_len"], run["batch"],
                             run["sets"])
    tokens = run["batch"] * run["seq_len"]
    tps = run.get("tokens_per_s")
    micro = next((s.split("=")[1] for s in run["sets"] if s.startswith("optimizer.accumulate=")),
                 "1")
    rows.append(dict(roofline(got["counts"], peaks),
                     row=f"{run['preset']} train step, batch {run['batch']} x {run['seq_len']}, "
                     f"{run['precision']}, remat {got['remat']}"
                     + (f", {micro} microbatches" if micro != "1" else "")
                     + (f" ({run['label']})" if run.get("label") else ""),
                     tokens=tokens, **{"measured ms": tokens / tps * 1e3 if tps else None}))
  return rows


def summary_table(rows) -> str:
  head = ("| row | FLOPs | bytes | compute floor ms | byte floor ms | floor ms | bound by "
          "| measured ms | measured / floor |")
  lines = [head, "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    m = r["measured ms"]
    ratio = f"{m / r['floor ms']:.2f}x" if m is not None else ""
    lines.append(f"| {r['row']} | {_tflop(r['flops'])} | {r['bytes'] / 1e9:,.2f} GB | "
                 f"{_ms(r['compute ms'])} | {_ms(r['bytes ms'])} | {_ms(r['floor ms'])} | "
                 f"{r['bound']} | {'' if m is None else _ms(m)} | {ratio} |")
  return "\n".join(lines)


def summary(p, a, peaks) -> str:
  runs = []
  tps = dict(a.tokens_per_s)
  for precision in PRECISIONS:
    if precision in tps or not (a.summary_json or tps):
      runs.append(dict(preset=a.preset, seq_len=a.seq_len, batch=a.batch, sets=tuple(a.sets),
                       precision=precision, tokens_per_s=tps.get(precision)))
  from_files = [run_of_summary(p, spec, a) for spec in a.summary_json]
  for run in from_files:
    run["label"] = "summary.json"
  rows = summary_rows(a, peaks, runs + from_files)
  lines = [f"Floors at {peaks_line(peaks)}; the floor is the larger of the compute and byte "
           f"floors (benchmarks/_floor.py).", "", summary_table(rows)]
  for run, row in zip(from_files, rows[-len(from_files):] if from_files else []):
    s = run["summary"]
    counted = row["flops"] / row["tokens"]
    mfu = f"{s['mfu']:.1%}" if isinstance(s.get("mfu"), (int, float)) else "n/a"
    fpt = s.get("flops_per_token")
    lines += ["", f"{run['source']}: {run['tokens_per_s']:,.0f} tokens/s, MFU {mfu} (its "
              f"flops_per_token " + (f"{fpt:.4g}" if fpt else "n/a") + ", 6 N + 12 L S H Dh, "
              f"against the bf16 peak); FLOPs per token counted here: {counted:.4g}."]
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="olmo-1b")
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                 help="config overrides of the counted step (as train.py's --set): "
                      "model.remat=full, optimizer.accumulate=4, ...")
  p.add_argument("--gpu", default="h200", choices=sorted(GPU_PEAKS),
                 help="whose datasheet peaks the floors are at")
  p.add_argument("--hbm-tbps", type=float, default=None,
                 help="a measured HBM bandwidth (TB/s) in place of the datasheet's")
  p.add_argument("--profile", default=None, help="profile_step.py --json output to compare with")
  p.add_argument("--ratio", type=float, default=1.43, help="the speed-up asked of coat over bf16")
  p.add_argument("--json", default=None, help="write the floors and counts here")
  p.add_argument("--summary", action="store_true",
                 help="one markdown table: each measured number against its floor")
  p.add_argument("--optimizer-ms", action="append", default=[], metavar="[LABEL=]MS")
  p.add_argument("--layer-ms", action="append", default=[], metavar="PRECISION=MS")
  p.add_argument("--tokens-per-s", action="append", default=[], metavar="PRECISION=TOKENS_PER_S")
  p.add_argument("--summary-json", action="append", default=[], metavar="[PRECISION=]PATH")
  a = p.parse_args(argv)
  if a.profile and not Path(a.profile).is_file():
    p.error(f"--profile {a.profile}: no such file")
  if a.hbm_tbps is not None and not a.hbm_tbps > 0:
    p.error(f"--hbm-tbps {a.hbm_tbps}: must be > 0")
  given = a.optimizer_ms or a.layer_ms or a.tokens_per_s or a.summary_json
  if given and not a.summary:
    p.error("--optimizer-ms, --layer-ms, --tokens-per-s and --summary-json go with --summary")
  a.optimizer_ms = _pairs(p, "--optimizer-ms", a.optimizer_ms)
  a.layer_ms = _pairs(p, "--layer-ms", a.layer_ms, PRECISIONS)
  a.tokens_per_s = _pairs(p, "--tokens-per-s", a.tokens_per_s, PRECISIONS)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  peaks = peaks_of(a.gpu, a.hbm_tbps)
  try:
    if a.summary:
      print(summary(p, a, peaks))
      return 0
    fl = floors(a.preset, a.seq_len, a.batch, a.sets, peaks)
  except ValueError as e:   # an unknown preset or a bad --set: one line
    p.error(str(e).splitlines()[0])
  print(report(fl, a, a.profile, peaks))
  if a.json:
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(fl, indent=1, default=float))
  return 0


if __name__ == "__main__":
  sys.exit(main())
