"""The headline table (docs/results.md "At a glance" and the README's table)."""
from __future__ import annotations

from .accuracy import ACCURACY_SEEDS, accuracy_mean, accuracy_source_ids
from .common import Sources, fmt, optimizer_row, ratio, step_field, summary_field
from .kernels import OPTIMIZER_STACKED_ROWS
from .models import LARGEST_SOURCES, largest_fits

# A headline row: (claim, source, bf16 selector, coat selector, number format, ratio kind).
HEADLINE = [
  ("OLMo-1B shape, batch 8 x 2048, layers scanned (the default): tokens/s", "olmo1b_e2e_h200",
   "bf16_tokens_scanned", "coat_tokens_scanned", ",.0f", "faster"),
  ("same: peak memory (GB)", "olmo1b_e2e_h200", "bf16_peak_gb_scanned", "coat_peak_gb_scanned",
   ".2f", "less"),
  ("same, layers unrolled (each mode's fastest setting): tokens/s", "olmo1b_e2e_h200",
   "bf16_tokens_unrolled", "coat_tokens_unrolled", ",.0f", "faster"),
  ("OLMo-1B shape on one 80 GB GPU, each mode at its fastest batch of those that fit (bf16 24, "
   "coat 38): tokens/s", "olmo1b_batch1b_h100",
   r"re:bf16\+adamw \(unrolled\) batch 24: ok in \d+ s, ([\d,]+) tokens/s",
   r"re:coat\+coat_adamw \(unrolled\) batch 38: ok in \d+ s, ([\d,]+) tokens/s", ",.0f", "faster"),
  ("Llama-2-7B decoder layer, batch 8 x 2048, forward + backward (ms)", "layer7b_h200",
   "bf16_ms", "coat_ms", ".2f", "time"),
  ("same: activations held for the backward (MB)", "layer7b_h200",
   "bf16_held_mb", "coat_held_mb", ".1f", "less"),
  ("optimizer step, 1.21e9 params stacked as a scanned model (the default) holds them: wall ms "
   "(optax.adamw vs coat_adamw_apply, defaults)", "optimizer_stacked_h200",
   optimizer_row("optax.adamw", 1), optimizer_row(OPTIMIZER_STACKED_ROWS[1][1], 1), ".2f", "time"),
  ("optimizer state, bytes per parameter", "optimizer_stacked_h200",
   optimizer_row("optax.adamw", 6), optimizer_row(OPTIMIZER_STACKED_ROWS[1][1], 6), ".2f", "less"),
  ("Llama-2-7B full fine-tuning, `configs/llama2-7b-sft.yaml`, batch 64 x 2048 on one 141 GB "
   "GPU: tokens/s", "sft_llama2_7b_pingpong_h200", step_field("/tmp/sft_bf16", "tok/s"),
   step_field("/tmp/sft_coat", "tok/s"), ",.0f", "faster"),
  ("Llama-2-7B through train.py (`configs/llama2-7b.yaml`), batch 8 x 4096, remat full for "
   "both, no microbatches: tokens/s", "equal_batch_7b_h200",
   summary_field("/tmp/equal_bf16_8", "tokens_per_s"),
   summary_field("/tmp/equal_coat_8", "tokens_per_s"), ",.0f", "faster"),
  ("same: device peak (GB)", "equal_batch_7b_h200", "bf16_peak_gb", "coat_peak_gb", ".2f", "less"),
  ("Llama-2-7B through train.py, each mode at its largest batch without microbatches (bf16 16, "
   "coat 56) x 4096, remat full: tokens/s", "largest_batch_7b_h200",
   summary_field("/tmp/batch7b_bf16_16", "tokens_per_s"),
   summary_field("/tmp/batch7b_coat_56", "tokens_per_s"), ",.0f", "faster"),
]


def headline(src: Sources) -> list[str]:
  out = ["| claim | bf16 + optax.adamw | coat + coat_adamw | coat vs bf16 | GPU, date | command "
         "| raw |",
         "|---|---|---|---|---|---|---|"]
  for claim, sid, sel_b, sel_c, spec, kind in HEADLINE:
    b, c = src.value(sid, sel_b), src.value(sid, sel_c)
    gpu, date, cmd, raw = src.where(sid, short=True)
    out.append(f"| {claim} | {fmt(b, spec)} | {fmt(c, spec)} | {ratio(kind, b, c)} | {gpu}, {date} "
               f"| `{cmd}` | {raw} |")
  # The loss of both modes, mean over the seeds of the accuracy runs.
  b, c = accuracy_mean(src)
  where = [src.where(sid, short=True) for sid in accuracy_source_ids()]
  seeds = [seed for seed, _ in ACCURACY_SEEDS]
  apart = next(seed for seed, runs in ACCURACY_SEEDS if isinstance(runs, dict))  # one mode a run
  out.append(f"| llama-125m, 2000 steps on real text: final eval loss, mean of {len(seeds)} seeds "
             f"| {b:.4f} | {c:.4f} | {ratio('pct', b, c)} | {where[0][0]}, "
             + ", ".join(dict.fromkeys(w[1] for w in where)) + f" | `{where[0][2]}`; seeds "
             f"{seeds[1]}-{seeds[-1]} the same with `--seed N` (from seed {apart} one mode a "
             "run) | " + ", ".join(w[3] for w in where) + " |")
  # The largest Llama each mode trains on one GPU (plans; the coat H200 model ran too).
  best = largest_fits(src)
  for gpu in dict.fromkeys(g for _, g in LARGEST_SOURCES):
    (b, sid_b), (c, sid) = best[(gpu, "bf16 + adamw")], best[(gpu, "coat + coat_adamw")]
    g, date, cmd, raw = src.where(sid, short=True)
    if sid_b != sid:   # each mode's plan in its own log
      cmd = f"{src.where(sid_b)[2]}; {cmd}"
      raw = f"{src.where(sid_b, short=True)[3]}, {raw}"
    out.append(f"| Largest Llama on {gpu}, seq 2048, global batch 64 through microbatches: "
               f"parameters (`train.py --plan`) | {b['params'] / 1e9:.2f}e9 | "
               f"{c['params'] / 1e9:.2f}e9 | {c['params'] / b['params']:.2f}x larger | {g}, "
               f"{date} | `{cmd}` | {raw} |")
  # The models that only coat fits on one GPU.
  for claim, sid, bf16_text, tok_sel, peak_sel in [
      ("Llama-2-7B on one 80 GB GPU, `configs/llama2-7b.yaml` through train.py, batch 16 x "
       "4096: tokens/s (peak)", "train_py_llama2_7b_h100_2026_12_07",
       "does not fit (107.8 GB of weights, gradients and Adam state)",
       summary_field("/tmp/cfg_llama2-7b", "tokens_per_s"),
       summary_field("/tmp/cfg_llama2-7b", "peak_memory_bytes")),
      ("Llama-2-13B on one 141 GB GPU, `configs/llama2-13b.yaml` through train.py, batch 32 x "
       "4096: tokens/s (peak)", "configs_llama2_13b_h200",
       "does not fit (208 GB of weights, gradients and Adam state)",
       summary_field("/tmp/cfg_llama2-13b", "tokens_per_s"),
       summary_field("/tmp/cfg_llama2-13b", "peak_memory_bytes"))]:
    gpu, date, cmd, raw = src.where(sid, short=True)
    coat = f"{src.value(sid, tok_sel):,.0f} ({src.value(sid, peak_sel) / 1e9:.2f} GB)"
    out.append(f"| {claim} | {bf16_text} | {coat} | | {gpu}, {date} | `{cmd}` | {raw} |")
  return out
