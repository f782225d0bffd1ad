"""The training-run tables: the OLMo-1B step end to end, the shipped configs through train.py,
remat and microbatch plans, equal and largest batches, the fine-tuning recipe."""
from __future__ import annotations

import re

from .common import (PLAN_LINE, Sources, compared_runs, fmt, plan_choice, ratio, rows_table,
                     run_field, source_line, step_field, summary_field)


SFT_RUNS = (("coat", "coat + coat_adamw", 64), ("bf16", "bf16 + optax.adamw", 64),
            ("coat_b4", "coat + coat_adamw", 4), ("bf16_b4", "bf16 + optax.adamw", 4))


# The e2e table's columns: (field after the mode's prefix, header, number format, ratio kind;
# None: coat's compile time over bf16's).
E2E_COLUMNS = (("tokens_unrolled", "tokens/s, unrolled", ",.0f", "faster"),
               ("tokens_scanned", "tokens/s, scanned", ",.0f", "faster"),
               ("peak_gb_unrolled", "peak GB, unrolled", ".2f", "less"),
               ("peak_gb_scanned", "peak GB, scanned", ".2f", "less"),
               ("compile_unrolled_s", "compile s, unrolled", ".1f", None),
               ("compile_scanned_s", "compile s, scanned", ".1f", None))


def e2e(src: Sources) -> list[str]:
  sid = "olmo1b_e2e_h200"
  v = lambda k: src.value(sid, k)
  rows = [(label, [(f"{mode}_{field}", spec) for field, _, spec, _ in E2E_COLUMNS])
          for label, mode in (("bf16 + optax.adamw", "bf16"), ("coat + coat_adamw", "coat"))]
  rows.append(("coat vs bf16",
               [ratio(kind, v(f"bf16_{field}"), v(f"coat_{field}")) if kind
                else f"{v(f'coat_{field}') / v(f'bf16_{field}'):.2f}x"
                for field, _, _, kind in E2E_COLUMNS]))
  return rows_table(src, sid, [""] + [header for _, header, _, _ in E2E_COLUMNS], rows)


E2E_LINEAR_RESIDUALS = (
    # (source prefix, model, machine suffix, where, runs: the names after "linear_residuals_")
    ("e2e_olmo1b", "OLMo-1B, remat none", "", "", ("kept", "remade")),
    ("e2e_olmo1b", "OLMo-1B, remat none", "_fifth", ", a fifth H100", ("kept", "remade_fused")),
    ("e2e_7b_remat_full", "Llama-2-7B, remat full", "_fifth", ", a fifth H100",
     ("kept", "kept_rerun", "remade_fused")))


def e2e_linear_residuals(src: Sources) -> list[str]:
  """The coat step with the linears keeping their FP8 inputs (default) and remaking them: OLMo-1B
  on two machines (the remake by the quantize kernel on the first, by the Triton kernel on the
  second), Llama-2-7B at remat full on the second; each machine's runs one after the other."""
  labels = {"kept": ("`linear_residuals: kept`", ""),
            "kept_rerun": ("`linear_residuals: kept`, again", "kept again vs kept"),
            "remade": ("`linear_residuals: remade`, remake by the quantize kernel",
                       "remade vs kept"),
            "remade_fused": ("`linear_residuals: remade`, remake by the Triton kernel",
                             "remade vs kept")}
  columns = (("tokens_per_s", 1, ",.0f", "pct"), ("step_s", 1e3, ".1f", "pct"),
             ("peak_bytes", 1e-9, ".2f", "less"), ("compile_s", 1, ".1f", None))
  groups = [(where, {n: tuple(f"{model}, {text}" for text in labels[n]) for n in names},
             {n: f"{prefix}_linear_residuals_{n}{machine}_h100" for n in names})
            for prefix, model, machine, where, names in E2E_LINEAR_RESIDUALS]
  return compared_runs(src, ["| | tokens/s | step ms | device peak GB | compile s |",
                             "|---|---|---|---|---|"], groups, "equal_batch.0", columns)


SHIPPED_CONFIGS = (("tiny", "bf16 + adamw", "configs_train_py_h200"),
                   ("llama-125m", "bf16 + adamw", "configs_train_py_h200"),
                   ("olmo-1b", "coat + coat_adamw", "configs_train_py_h200"),
                   ("llama2-7b", "coat + coat_adamw", "configs_llama2_7b_h200"),
                   ("llama2-13b", "coat + coat_adamw", "configs_llama2_13b_h200"),
                   ("llama-20b", "coat + coat_adamw", "configs_llama_20b_h200"))


def summary_cells(src: Sources, sid: str, run: str) -> list[str]:
  """tokens/s, MFU, device peak GiB, compile s and first step s of the summary line run_gpu.sh
  prints for the train.py run writing to `run`."""
  value = lambda field: src.value(sid, summary_field(run, field))
  return [fmt(value("tokens_per_s"), ",.0f"), fmt(value("mfu"), ".1%"),
          f"{value('peak_memory_bytes') / 2**30:.2f}", fmt(value("compile_s"), ".1f"),
          fmt(value("first_step_s"), ".2f")]


def train_py(src: Sources) -> list[str]:
  """Each shipped config through train.py: its summary line in the raw log."""
  rows = []
  for name, recipe, sid in SHIPPED_CONFIGS:
    rows.append((f"`configs/{name}.yaml`", [recipe] + summary_cells(src, sid, f"/tmp/cfg_{name}")))
  out = rows_table(src, "configs_train_py_h200", ["config", "precision + optimizer", "tokens/s",
                                                  "MFU", "device peak GiB", "compile s",
                                                  "first step s"], rows)
  return out + ["", "`configs/llama2-7b.yaml`: " + source_line(src, "configs_llama2_7b_h200"),
                "", "`configs/llama2-13b.yaml`: " + source_line(src, "configs_llama2_13b_h200"),
                "", "`configs/llama-20b.yaml`: " + source_line(src, "configs_llama_20b_h200")]


PLAN_RUNS = (("llama2-7b", "configs_llama2_7b_h200", 16 * 4096),
             ("llama2-13b", "configs_llama2_13b_h200", 32 * 4096))


def plan_candidates(src: Sources) -> list[str]:
  """The candidates `auto` timed before the first step (one step each) in the shipped configs'
  runs, from the `[plan]` line that timed them (a `--plan` run before the training run logs one
  without timings): each policy at the fewest microbatches that fit."""
  out = ["| config | remat / microbatches | step s (as the plan timed it) | tokens/s "
         "| vs the fastest | chosen |", "|---|---|---|---|---|---|"]
  for name, sid, tokens in PLAN_RUNS:
    line = next(m for m in PLAN_LINE.finditer(src.raw(sid)) if m["timed"])
    timed = [(c, float(t)) for c, t in re.findall(r"(\S+/\d+): ([\d.]+) s", line["timed"])]
    fastest = min(t for _, t in timed)
    chosen = f"{line['remat']}/{line['micro']}"
    for cand, t in timed:
      out.append(f"| `{name}` | {cand.replace('/', ' / ')} | {t:.3f} | {tokens / t:,.0f} | "
                 f"{100 * (fastest / t - 1):+.1f} % | {'yes' if cand == chosen else ''} |")
  return out + ["", "Llama-2-7B: " + source_line(src, "configs_llama2_7b_h200"),
                "Llama-2-13B: " + source_line(src, "configs_llama2_13b_h200")]


def largest_batch_7b(src: Sources) -> list[str]:
  """configs/llama2-7b.yaml through train.py, each mode at its largest batch (run_gpu.sh batch7b)."""
  sid = "largest_batch_7b_h200"
  key = lambda run, field: summary_field(f"/tmp/batch7b_{run}", field)
  rows = []
  for run, label in (("bf16_16", "bf16 + optax.adamw, batch 16 x 4096"),
                     ("coat_56", "coat + coat_adamw, batch 56 x 4096")):
    rows.append((label, [(key(run, "tokens_per_s"), ",.0f"), (key(run, "mfu"), ".1%"),
                         f"{src.value(sid, key(run, 'peak_memory_bytes')) / 2**30:.2f}",
                         (key(run, "compile_s"), ".1f")]))
  v = lambda run, field: src.value(sid, key(run, field))
  rows.append(("coat (56) vs bf16 (16)", [ratio("faster", v("bf16_16", "tokens_per_s"),
                                                 v("coat_56", "tokens_per_s")), "", "", ""]))
  return rows_table(src, sid, ["", "tokens/s", "MFU", "device peak GiB", "compile s"], rows)


def sft_now(src: Sources) -> list[str]:
  """configs/llama2-7b-sft.yaml, coat and bf16 + optax.adamw at the recipe's batch, one machine,
  from each run's logged steps (steps 3-4)."""
  sid = "sft_llama2_7b_pingpong_h200"
  text = src.raw(sid)
  rows = []
  for run, recipe in (("coat", "coat + coat_adamw"), ("bf16", "bf16 + optax.adamw")):
    d = f"/tmp/sft_{run}"
    rows.append((recipe, [plan_choice(text, d), (step_field(d, "tok/s"), ",.0f"),
                          f"{src.value(sid, step_field(d, 'mfu')):.1f}%",
                          (step_field(d, "mem"), ".2f"),
                          (run_field(d, r"\[plan\] chose .*?compile\(s\) in ([\d.]+) s"), ".1f"),
                          (run_field(d, r"\[run\] first step in ([\d.]+) s"), ".1f")]))
  tok = lambda run: src.value(sid, step_field(f"/tmp/sft_{run}", "tok/s"))
  rows.append(("coat vs bf16", ["", ratio("faster", tok("bf16"), tok("coat")), "", "", "", ""]))
  return rows_table(src, sid, ["", "remat / microbatches (plan)", "tokens/s, steps 3-4", "MFU",
                               "device peak GiB", "plan compile s", "first step s"], rows)


def sft_b4_now(src: Sources) -> list[str]:
  """configs/llama2-7b-sft.yaml at batch 4 without microbatches, coat and bf16 + optax.adamw,
  one machine, from each run's summary line."""
  sid = "sft_b4_llama2_7b_pingpong_h200"
  text = src.raw(sid)
  rows = []
  for run, recipe, _ in SFT_RUNS[2:]:
    d = f"/tmp/sft_{run}"
    rows.append((recipe, [plan_choice(text, d)] + summary_cells(src, sid, d)))
  tok = lambda run: src.value(sid, summary_field(f"/tmp/sft_{run}", "tokens_per_s"))
  rows.append(("coat vs bf16", ["", ratio("faster", tok("bf16_b4"), tok("coat_b4")),
                                "", "", "", ""]))
  return rows_table(src, sid, ["", "remat / microbatches (plan)", "tokens/s", "MFU",
                               "device peak GiB", "compile s", "first step s"], rows)


def remat_sweep(src: Sources) -> list[str]:
  """Each config at `remat: auto` and at each policy by hand (microbatches auto)."""
  out = ["| config | remat | microbatches | tokens/s | device peak GiB | vs the best by hand |",
         "|---|---|---|---|---|---|"]
  for name, sid in (("olmo-1b", "remat_sweep_olmo1b_h200"),
                    ("llama2-7b", "remat_sweep_llama2_7b_h200")):
    text = src.raw(sid)
    runs = {}
    for remat in ("auto", "none", "fp8_residuals", "dots", "full"):
      key = lambda field: summary_field(f"/tmp/sweep_{remat}", field)
      try:
        tokens = src.value(sid, key("tokens_per_s"))
      except ValueError:   # the run left no summary (stopped before its end)
        continue
      runs[remat] = (tokens, src.value(sid, key("peak_memory_bytes")) / 2**30,
                     plan_choice(text, f"/tmp/sweep_{remat}").split(" / ")[-1])
    best = max(v[0] for r, v in runs.items() if r != "auto")
    for remat, (tok, peak, micro) in runs.items():
      out.append(f"| `{name}` | {remat} | {micro} | {tok:,.0f} | {peak:.2f} | "
                 f"{100 * (tok / best - 1):+.1f} % |")
  return out + ["", source_line(src, "remat_sweep_olmo1b_h200"),
                "Llama-2-7B: " + source_line(src, "remat_sweep_llama2_7b_h200")]


def largest_batch(src: Sources) -> list[str]:
  """OLMo-1B on an 80 GB H100, each mode's batches largest first (run_gpu.sh batch1b), in the
  raw's order: a run's row has its tokens/s and peak, or "out of memory" where the raw says so."""
  sid = "olmo1b_batch1b_h100"
  run = r"{} \(unrolled\) batch {}: "
  tokens = "re:" + run + r"ok in \d+ s, ([\d,]+) tokens/s"
  peak = "re:" + run + r"ok in \d+ s, [\d,]+ tokens/s, peak ([\d.]+) GB"
  rows = []
  for mode, batch in (("bf16+adamw", 24), ("bf16+adamw", 26), ("bf16+adamw", 32),
                      ("coat+coat_adamw", 40), ("coat+coat_adamw", 38)):
    m = re.escape(mode)
    if re.search(run.format(m, batch) + "oom in", src.raw(sid)):
      rows.append((f"{mode}, batch {batch}", ["out of memory", ""]))
    else:
      rows.append((f"{mode}, batch {batch}", [(tokens.format(m, batch), ",.0f"),
                                              (peak.format(m, batch), ".2f")]))
  b = src.value(sid, tokens.format(re.escape("bf16+adamw"), 24))
  c = src.value(sid, tokens.format(re.escape("coat+coat_adamw"), 38))
  rows.append(("coat (38) vs bf16's fastest (24)", [ratio("faster", b, c), ""]))
  return rows_table(src, sid, ["", "tokens/s", "peak GB"], rows)


def equal_batch_7b(src: Sources) -> list[str]:
  """configs/llama2-7b.yaml through train.py at one batch and remat for both modes."""
  sid = "equal_batch_7b_h200"
  key = lambda run, field: summary_field(f"/tmp/equal_{run}_8", field)
  rows = []
  for run, label in (("bf16", "bf16 + optax.adamw"), ("coat", "coat + coat_adamw")):
    rows.append((label, [(key(run, "tokens_per_s"), ",.0f"), (key(run, "mfu"), ".1%"),
                         f"{src.value(sid, key(run, 'peak_memory_bytes')) / 2**30:.2f}",
                         (key(run, "compile_s"), ".1f"), (key(run, "first_step_s"), ".2f")]))
  v = lambda run, field: src.value(sid, key(run, field))
  rows.append(("coat vs bf16", [ratio("faster", v("bf16", "tokens_per_s"), v("coat", "tokens_per_s")),
                                "", ratio("less", v("bf16", "peak_memory_bytes"),
                                          v("coat", "peak_memory_bytes")),
                                f"{v('coat', 'compile_s') / v('bf16', 'compile_s'):.2f}x", ""]))
  return rows_table(src, sid, ["", "tokens/s", "MFU", "device peak GiB", "compile s",
                               "first step s"], rows)
