"""Write the results tables of docs/results.md (and the README's table) from the raw files.

Every number in a results table is read here, at generation time, from the file that recorded it
(`docs/gpu_results/`), or, where no raw file was kept, from the `values` of its source in
`docs/results/sources.json`, which says so. Each source names its GPU, date and command; each
table row shows them. A table sits in a markdown file between

    <!-- results:NAME:begin -->
    <!-- results:NAME:end -->

and is replaced there. `tests/test_results_tables.py` fails when a committed table differs from
what this script writes, so a number cannot change in one place and not the other.

Usage:
  python scripts/results_tables.py            # rewrite the tables in place
  python scripts/results_tables.py --check    # exit 1 and name each table that is out of date
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = REPO / "docs" / "results" / "sources.json"
RAW_DIR = REPO / "docs" / "gpu_results"
# Files whose tables are generated; a file missing or without markers is skipped.
TARGETS = ("docs/results.md", "docs/results_table.md", "README.md")
MARKER = re.compile(r"<!-- results:([a-z0-9_]+):begin -->\n.*?<!-- results:\1:end -->", re.S)


class Sources:
  """The sources of sources.json and their raw files, each read once."""

  def __init__(self, path: Path = SOURCES):
    self.meta = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    self._raw: dict[str, object] = {}

  def raw(self, sid: str):
    if sid not in self._raw:
      path = REPO / self.meta[sid]["raw"]
      text = path.read_text()
      self._raw[sid] = json.loads(text) if path.suffix == ".json" else text
    return self._raw[sid]

  def value(self, sid: str, sel: str):
    """`sel`: a name in the source's `fields` (a selector into its raw file, times an optional
    factor) or `values` (a number given where the raw file lacks it); "re:PATTERN" (group 1 of
    the raw text); or a dotted path into the raw JSON ("equal_batch.0.tokens_per_s")."""
    src = self.meta[sid]
    if sel in src.get("fields", {}):  # a named number of the raw file: selector [, factor]
      field = src["fields"][sel]
      sel, factor = (field, 1) if isinstance(field, str) else field
      return self.value(sid, sel) * factor
    if not src.get("raw") or sel in src.get("values", {}):
      return src["values"][sel]
    data = self.raw(sid)
    if sel.startswith("re:"):
      m = re.search(sel[3:], data)
      if m is None:
        raise ValueError(f"{sid}: pattern {sel[3:]!r} not found in {src['raw']}")
      return float(m.group(1).replace(",", ""))
    for key in sel.split("."):
      data = data[int(key)] if isinstance(data, list) else data[key]
    return data

  def where(self, sid: str, short: bool = False) -> tuple[str, str, str, str]:
    """GPU, date, command and raw file (or why there is none) of a source."""
    s = self.meta[sid]
    if s.get("raw"):
      raw = f"[{Path(s['raw']).name}](gpu_results/{Path(s['raw']).name})"
    else:
      raw = "raw log not kept" if short else s.get("raw_note", "raw log not kept")
    return s["gpu"], s["date"], s["command"], raw


def fmt(x, spec: str) -> str:
  if isinstance(x, str):
    return x
  if isinstance(x, float) and math.isnan(x):
    return "n/a"
  return format(x, spec)


def ratio(kind: str, bf16, coat) -> str:
  """coat against bf16: "faster" (a rate: coat / bf16), "time" (bf16 / coat), "less" (memory)."""
  if isinstance(bf16, str) or isinstance(coat, str):
    return ""
  if kind == "faster":
    r = coat / bf16
  elif kind in ("time", "less"):
    r = bf16 / coat
  elif kind == "pct":
    return f"{100 * (coat - bf16) / bf16:+.2f} %"
  else:
    raise ValueError(kind)
  if kind == "less":
    return f"{r:.2f}x less" if r >= 1 else f"{1 / r:.2f}x more"
  return f"{r:.2f}x" + ("" if r >= 1 else " (slower)")


def _optimizer_row(name: str, column: int) -> str:
  """A selector for column `column` (1 = wall ms) of bench_optimizer's table row `name`."""
  return r"re:\| " + re.escape(name) + r" \|" + r" [\d.x]+ \|" * (column - 1) + r" ([\d.]+)"


OPTIMIZER_ROWS = [  # (label, bench_optimizer's row name); the default second (the headline's)
  ("optax.adamw (XLA)", "optax.adamw"),
  ("coat_adamw_apply, default (`group_axis=\"last\"`, row kernel), per leaf",
   "coat_adamw_apply, per leaf"),
  ("same, `state_layout=\"packed\"`", "coat_adamw_apply, packed state"),
  ("coat_adamw_apply, `group_axis=\"coat\"` (COAT's layout, column kernel), per leaf",
   "coat_adamw_apply, per leaf, groups along axis -2 (column kernel), tile 32 cols x 8 warps"),
  ("same, `state_layout=\"packed\"`",
   "coat_adamw_apply, packed state, groups along axis -2 (column kernel), tile 32 cols x 8 warps"),
]


OPTIMIZER_STACKED_ROWS = [  # (label, bench_optimizer's row name)
  ("optax.adamw (XLA)", "optax.adamw"),
  ("coat_adamw_apply, per leaf, default tile (16 rows x 4 warps)",
   "coat_adamw_apply, per leaf, tile 16 rows x 4 warps"),
  ("same, tile 8 rows x 4 warps", "coat_adamw_apply, per leaf, tile 8 rows x 4 warps"),
  ("coat_adamw_apply, packed state, default tile", "coat_adamw_apply, packed state, tile 16 rows x 4 warps"),
  ("same, tile 8 rows x 4 warps", "coat_adamw_apply, packed state, tile 8 rows x 4 warps"),
]


def _summary_field(run: str, field: str) -> str:
  """A selector for `field` of the summary line run_gpu.sh prints for the run in `run`."""
  return rf"re:{re.escape(run)} {{[^}}]*'{field}': ([\d.e+-]+)"


def _step_field(run: str, field: str, step: int = 4) -> str:
  """A selector for `field` (tok/s, mfu, mem) of train.py's `[step N]` line in the log section of
  the run writing to `run` (a run stopped before its summary line still logged its steps)."""
  return (rf"re:--out-dir {re.escape(run)} --overwrite\n(?:.*\n)*?\[step {step}\] .*?"
          rf"{re.escape(field)} ([\d,.]+)")


def _run_field(run: str, pattern: str) -> str:
  """A selector for group 1 of `pattern`, its first match in the log section of the run in `run`."""
  return rf"re:--out-dir {re.escape(run)} --overwrite\n(?:.*\n)*?{pattern}"


SFT_RUNS = (("coat", "coat + coat_adamw", 64), ("bf16", "bf16 + optax.adamw", 64),
            ("coat_b4", "coat + coat_adamw", 4), ("bf16_b4", "bf16 + optax.adamw", 4))


# ---------------------------------------------------------------------------------------------
# The tables. A headline row: (claim, source, bf16 selector, coat selector, number format,
# ratio kind); a selector None means the cell's text is given in the source's values instead.

HEADLINE = [
  ("OLMo-1B shape, batch 8 x 2048, layers unrolled: tokens/s", "olmo1b_e2e_h200",
   "bf16_tokens_unrolled", "coat_tokens_unrolled", ",.0f", "faster"),
  ("same: peak memory (GB)", "olmo1b_e2e_h200", "bf16_peak_gb", "coat_peak_gb", ".2f", "less"),
  ("same, layers scanned (the default): tokens/s", "olmo1b_e2e_h200",
   "bf16_tokens_scanned", "coat_tokens_scanned", ",.0f", "faster"),
  ("OLMo-1B shape, each mode at its largest batch (bf16 22, coat 36): tokens/s",
   "olmo1b_largest_batch_h100",
   r"re:bf16\+adamw \(unrolled\) batch 22: ok in \d+ s, ([\d,]+) tokens/s",
   r"re:coat\+coat_adamw \(unrolled\) batch 36: ok in \d+ s, ([\d,]+) tokens/s", ",.0f", "faster"),
  ("Llama-2-7B decoder layer, batch 8 x 2048, forward + backward (ms)", "layer7b_h200",
   "bf16_ms", "coat_ms", ".2f", "time"),
  ("same: activations held for the backward (MB)", "layer7b_h200",
   "bf16_held_mb", "coat_held_mb", ".1f", "less"),
  ("optimizer step, 1.21e9 params stacked as a scanned model (the default) holds them: wall ms "
   "(optax.adamw vs coat_adamw_apply, defaults)", "optimizer_stacked_h200",
   _optimizer_row("optax.adamw", 1), _optimizer_row(OPTIMIZER_STACKED_ROWS[1][1], 1), ".2f", "time"),
  ("optimizer state, bytes per parameter", "optimizer_stacked_h200",
   _optimizer_row("optax.adamw", 6), _optimizer_row(OPTIMIZER_STACKED_ROWS[1][1], 6), ".2f", "less"),
  ("Llama-2-7B full fine-tuning, `configs/llama2-7b-sft.yaml`, batch 64 x 2048 on one 141 GB "
   "GPU: tokens/s", "sft_llama2_7b_pingpong_h200", _step_field("/tmp/sft_bf16", "tok/s"),
   _step_field("/tmp/sft_coat", "tok/s"), ",.0f", "faster"),
  ("Llama-2-7B through train.py (`configs/llama2-7b.yaml`), batch 8 x 4096, remat full for "
   "both, no microbatches: tokens/s", "equal_batch_7b_h200",
   _summary_field("/tmp/equal_bf16_8", "tokens_per_s"),
   _summary_field("/tmp/equal_coat_8", "tokens_per_s"), ",.0f", "faster"),
  ("same: device peak (GB)", "equal_batch_7b_h200", "bf16_peak_gb", "coat_peak_gb", ".2f", "less"),
  ("Llama-2-7B through train.py, each mode at its largest batch without microbatches (bf16 16, "
   "coat 56) x 4096, remat full: tokens/s", "largest_batch_7b_h200",
   _summary_field("/tmp/batch7b_bf16_16", "tokens_per_s"),
   _summary_field("/tmp/batch7b_coat_56", "tokens_per_s"), ",.0f", "faster"),
  ("llama-125m, 2000 steps on real text: final eval loss", "accuracy_llama125m_h100",
   "runs.bf16+adamw.final_eval_loss", "runs.coat+coat_adamw.final_eval_loss", ".4f", "pct"),
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
  # The largest Llama each mode trains on one GPU (plans; the coat H200 model ran too).
  best = _largest_fits(src)
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
      ("Llama-2-7B on one 80 GB GPU, batch 8 x 2048, remat full: tokens/s (peak)",
       "llama2_7b_b8_h100", "does not fit (107.8 GB of weights, gradients and Adam state)",
       "equal_batch.0.tokens_per_s", "equal_batch.0.peak_bytes"),
      ("Llama-2-13B on one 141 GB GPU, `configs/llama2-13b.yaml` through train.py, batch 32 x "
       "4096: tokens/s (peak)", "configs_llama2_13b_h200",
       "does not fit (208 GB of weights, gradients and Adam state)",
       _summary_field("/tmp/cfg_llama2-13b", "tokens_per_s"),
       _summary_field("/tmp/cfg_llama2-13b", "peak_memory_bytes"))]:
    gpu, date, cmd, raw = src.where(sid, short=True)
    coat = f"{src.value(sid, tok_sel):,.0f} ({src.value(sid, peak_sel) / 1e9:.2f} GB)"
    out.append(f"| {claim} | {bf16_text} | {coat} | | {gpu}, {date} | `{cmd}` | {raw} |")
  return out


def source_line(src: Sources, sid: str) -> str:
  gpu, date, cmd, raw = src.where(sid)
  setting = src.meta[sid].get("setting", "")
  return f"{gpu}, {date}; {setting}. Command: `{cmd}`. Raw: {raw}."


def rows_table(src: Sources, sid: str, header: list[str], rows: list[tuple]) -> list[str]:
  """rows: (label, [(selector, format) or literal text, ...])."""
  out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for label, cells in rows:
    text = [c if isinstance(c, str) else fmt(src.value(sid, c[0]), c[1]) for c in cells]
    out.append("| " + " | ".join([label] + text) + " |")
  return out + ["", source_line(src, sid)]


def e2e(src: Sources) -> list[str]:
  sid = "olmo1b_e2e_h200"
  v = lambda k: src.value(sid, k)
  rows = [("bf16 + optax.adamw", [("bf16_tokens_unrolled", ",.0f"), ("bf16_tokens_scanned", ",.0f"),
                                  ("bf16_peak_gb", ".2f"), ("bf16_compile_unrolled_s", ".1f"),
                                  ("bf16_compile_scanned_s", ".1f")]),
          ("coat + coat_adamw", [("coat_tokens_unrolled", ",.0f"), ("coat_tokens_scanned", ",.0f"),
                                 ("coat_peak_gb", ".2f"), ("coat_compile_unrolled_s", ".1f"),
                                 ("coat_compile_scanned_s", ".1f")]),
          ("coat vs bf16", [ratio("faster", v("bf16_tokens_unrolled"), v("coat_tokens_unrolled")),
                            ratio("faster", v("bf16_tokens_scanned"), v("coat_tokens_scanned")),
                            ratio("less", v("bf16_peak_gb"), v("coat_peak_gb")),
                            f"{v('coat_compile_unrolled_s') / v('bf16_compile_unrolled_s'):.2f}x",
                            f"{v('coat_compile_scanned_s') / v('bf16_compile_scanned_s'):.2f}x"])]
  return rows_table(src, sid, ["", "tokens/s, unrolled", "tokens/s, scanned", "peak GB",
                               "compile s, unrolled", "compile s, scanned"], rows)


SHIPPED_CONFIGS = (("tiny", "bf16 + adamw", "configs_train_py_h200"),
                   ("llama-125m", "bf16 + adamw", "configs_train_py_h200"),
                   ("olmo-1b", "coat + coat_adamw", "configs_train_py_h200"),
                   ("llama2-7b", "coat + coat_adamw", "configs_llama2_7b_h200"),
                   ("llama2-13b", "coat + coat_adamw", "configs_llama2_13b_h200"),
                   ("llama-20b", "coat + coat_adamw", "largest_20b_h200"))


def train_py(src: Sources) -> list[str]:
  """Each shipped config through train.py: its summary line in the raw log."""
  rows = []
  for name, recipe, sid in SHIPPED_CONFIGS:
    key = lambda field: _summary_field(f"/tmp/cfg_{name}", field)
    cells = [recipe] + [fmt(src.value(sid, key(f)), spec) for f, spec in (
        ("tokens_per_s", ",.0f"), ("mfu", ".1%"))] + [
        f"{src.value(sid, key('peak_memory_bytes')) / 2**30:.2f}",
        fmt(src.value(sid, key("compile_s")), ".1f"),
        fmt(src.value(sid, key("first_step_s")), ".2f")]
    rows.append((f"`configs/{name}.yaml`", cells))
  out = rows_table(src, "configs_train_py_h200", ["config", "precision + optimizer", "tokens/s",
                                                  "MFU", "device peak GiB", "compile s",
                                                  "first step s"], rows)
  return out + ["", "`configs/llama2-7b.yaml`: " + source_line(src, "configs_llama2_7b_h200"),
                "", "`configs/llama2-13b.yaml`: " + source_line(src, "configs_llama2_13b_h200"),
                "", "`configs/llama-20b.yaml`: " + source_line(src, "largest_20b_h200")]


# train.py's `[plan]` line: the remat and microbatches chosen, the predicted peak against the
# device, and (where `auto` timed candidates) each candidate's step.
PLAN_LINE = re.compile(r"\[plan\] chose remat (?P<remat>\S+), (?P<micro>\d+) microbatch\S*: "
                       r"predicted (?P<predicted>[\d.]+) GiB per device of (?P<limit>[\d.]+) GiB"
                       r"[^\n]*?(?:timed steps (?P<timed>[^\n]*))?$", re.M)


PLAN_RUNS = (("llama2-7b", "configs_llama2_7b_h200", 16 * 4096),
             ("llama2-13b", "configs_llama2_13b_h200", 32 * 4096))


def plan_candidates(src: Sources) -> list[str]:
  """The candidates `auto` timed before the first step (one step each) in the shipped configs'
  runs, from the `[plan]` line: each policy at the fewest microbatches that fit."""
  out = ["| config | remat / microbatches | step s (one timed step) | tokens/s | vs the fastest "
         "| chosen |", "|---|---|---|---|---|---|"]
  for name, sid, tokens in PLAN_RUNS:
    line = PLAN_LINE.search(src.raw(sid))
    timed = [(c, float(t)) for c, t in re.findall(r"(\S+/\d+): ([\d.]+) s", line["timed"])]
    fastest = min(t for _, t in timed)
    chosen = f"{line['remat']}/{line['micro']}"
    for cand, t in timed:
      out.append(f"| `{name}` | {cand.replace('/', ' / ')} | {t:.3f} | {tokens / t:,.0f} | "
                 f"{100 * (fastest / t - 1):+.1f} % | {'yes' if cand == chosen else ''} |")
  return out + ["", "Llama-2-7B: " + source_line(src, "configs_llama2_7b_h200"),
                "Llama-2-13B: " + source_line(src, "configs_llama2_13b_h200")]


def _compile_cell(src: Sources, sid: str, mode: str, layers: str, k: str) -> float:
  """bench_e2e --compile-only's table: the compile seconds or XLA's predicted GB of a row."""
  return src.value(sid, rf"re:\n{re.escape(mode)}\s+{layers}\s.*?([\d.]+)\s+[\d.]+\n"
                   if k == "compile" else rf"re:\n{re.escape(mode)}\s+{layers}\s.*?([\d.]+)\n")


def compile_7b(src: Sources) -> list[str]:
  """The 7B step's compile time, scanned and unrolled, from bench_e2e --compile-only's table."""
  sid = "compile_llama2_7b_h200"
  cell = lambda mode, layers, k: _compile_cell(src, sid, mode, layers, k)
  rows = []
  for label, mode in (("bf16 + optax.adamw", "bf16+adamw"), ("coat + coat_adamw", "coat+coat_adamw")):
    rows.append((label, [fmt(cell(mode, layers, k), ".1f" if k == "compile" else ".2f")
                         for layers in ("scanned", "unrolled") for k in ("compile", "pred")]))
  ratios = [f"{cell('coat+coat_adamw', layers, 'compile') / cell('bf16+adamw', layers, 'compile'):.2f}x"
            for layers in ("scanned", "unrolled")]
  rows.append(("coat vs bf16", [ratios[0], "", ratios[1], ""]))
  return rows_table(src, sid, ["", "compile s, scanned", "XLA predicted GB, scanned",
                               "compile s, unrolled", "XLA predicted GB, unrolled"], rows)


COMPILE_OLMO_RUNS = (
    ("olmo1b_compile_traced_once_h200", "layers and optimizer leaves traced once"),
    ("olmo1b_compile_traced_once_rerun_h200", "same, a later lease"),
    ("olmo1b_compile_third_lease_h200", "same, a third lease"),
    ("olmo1b_compile_prestart_h200", "before: each layer and leaf traced apart"),
    ("olmo1b_compile_prestart_rerun_h200", "same, a later lease"),
    ("olmo1b_compile_h200", "before that: workers started at the first kernel, 2 threads"))


def compile_olmo(src: Sources) -> list[str]:
  """OLMo-1B's step compile time in each bench_e2e --compile-only run, both modes and layouts."""
  out = ["| run | bf16 s, scanned | coat s, scanned | coat vs bf16 | bf16 s, unrolled | "
         "coat s, unrolled | coat vs bf16 |", "|---|---|---|---|---|---|---|"]
  for sid, label in COMPILE_OLMO_RUNS:
    cells = []
    for layers in ("scanned", "unrolled"):
      b, c = (_compile_cell(src, sid, mode, layers, "compile") for mode in ("bf16+adamw",
                                                                            "coat+coat_adamw"))
      cells += [fmt(b, ".1f"), fmt(c, ".1f"), f"{c / b:.2f}x"]
    out.append(f"| {label} | " + " | ".join(cells) + " |")
  for sid, _ in COMPILE_OLMO_RUNS:
    out += ["", source_line(src, sid)]
  return out


WARM_VARIANTS = (("bf16 + optax.adamw, unrolled", 0), ("coat, unrolled, 8 threads (default)", 1),
                 ("coat, unrolled, 2 threads", 2), ("coat, unrolled, none ahead", 3),
                 ("coat, scanned, 8 threads (default)", 6), ("coat, scanned, 2 threads", 4),
                 ("coat, scanned, none ahead", 5))


def _breakdown_rows(src: Sources, sid: str, variants, instructions: bool = False) -> list:
  """compile_breakdown's JSON rows as (label, [trace s, lower s, compile s, total s (, HLO
  instructions)]) for (label, row index) pairs."""
  rows = []
  for label, i in variants:
    r = lambda k: src.value(sid, f"rows.{i}.{k}")
    total = r("trace_s") + r("lower_s") + r("compile_s")
    cells = [fmt(r("trace_s"), ".1f"), fmt(r("lower_s"), ".1f"), fmt(r("compile_s"), ".1f"),
             fmt(total, ".1f")]
    rows.append((label, cells + ([f"{r('hlo.instructions'):,}"] if instructions else [])))
  return rows


def compile_warm(src: Sources) -> list[str]:
  """compile_breakdown's trace / lower / compile seconds with the kernels compiled ahead on 8,
  2 or no threads."""
  sid = "compile_warm_threads_olmo1b_h200"
  return rows_table(src, sid, ["step, kernels compiled ahead on", "trace s", "lower s",
                               "compile s", "total s"], _breakdown_rows(src, sid, WARM_VARIANTS))


TRACED_ONCE_VARIANTS = (("bf16 + optax.adamw, unrolled", 0), ("coat + coat_adamw, unrolled", 1),
                        ("coat + coat_adamw, scanned", 2))


def compile_traced_once(src: Sources) -> list[str]:
  """compile_breakdown's trace / lower / compile seconds with the layers and optimizer leaves
  traced once."""
  sid = "compile_traced_once_olmo1b_h200"
  return rows_table(src, sid, ["step", "trace s", "lower s", "compile s", "total s",
                               "HLO instructions"],
                    _breakdown_rows(src, sid, TRACED_ONCE_VARIANTS, instructions=True))


def largest_batch_7b(src: Sources) -> list[str]:
  """configs/llama2-7b.yaml through train.py, each mode at its largest batch (run_gpu.sh batch7b)."""
  sid = "largest_batch_7b_h200"
  key = lambda run, field: _summary_field(f"/tmp/batch7b_{run}", field)
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
  """configs/llama2-7b-sft.yaml, coat and bf16 + optax.adamw at the recipe's batch, one lease,
  from each run's logged steps (steps 3-4)."""
  sid = "sft_llama2_7b_pingpong_h200"
  text = src.raw(sid)
  rows = []
  for run, recipe in (("coat", "coat + coat_adamw"), ("bf16", "bf16 + optax.adamw")):
    d = f"/tmp/sft_{run}"
    rows.append((recipe, [_plan_choice(text, d), (_step_field(d, "tok/s"), ",.0f"),
                          f"{src.value(sid, _step_field(d, 'mfu')):.1f}%",
                          (_step_field(d, "mem"), ".2f"),
                          (_run_field(d, r"\[plan\] chose .*?compile\(s\) in ([\d.]+) s"), ".1f"),
                          (_run_field(d, r"\[run\] first step in ([\d.]+) s"), ".1f")]))
  tok = lambda run: src.value(sid, _step_field(f"/tmp/sft_{run}", "tok/s"))
  rows.append(("coat vs bf16", ["", ratio("faster", tok("bf16"), tok("coat")), "", "", "", ""]))
  return rows_table(src, sid, ["", "remat / microbatches (plan)", "tokens/s, steps 3-4", "MFU",
                               "device peak GiB", "plan compile s", "first step s"], rows)


def _plan_choice(text: str, run: str) -> str:
  """The remat policy and microbatches the `[plan]` line of `run`'s section in a log chose."""
  section = text[text.index(f"--out-dir {run} ") if f"--out-dir {run} " in text
                 else text.index(f"run.out_dir={run} "):]
  m = PLAN_LINE.search(section)
  return f"{m['remat']} / {m['micro']}" if m else "as configured"


def sft(src: Sources) -> list[str]:
  """configs/llama2-7b-sft.yaml through train.py, coat and bf16 + optax.adamw."""
  sid = "sft_llama2_7b_h200"
  text = src.raw(sid)
  rows = []
  for run, recipe, batch in SFT_RUNS:
    key = lambda field: _summary_field(f"/tmp/sft_{run}", field)
    rows.append((recipe, [f"{batch} x 2048", _plan_choice(text, f"/tmp/sft_{run}"),
                          (key("tokens_per_s"), ",.0f"), (key("mfu"), ".1%"),
                          f"{src.value(sid, key('peak_memory_bytes')) / 2**30:.2f}",
                          (key("compile_s"), ".1f"), (key("first_step_s"), ".2f")]))
  tok = lambda run: src.value(sid, _summary_field(f"/tmp/sft_{run}", "tokens_per_s"))
  rows.append(("coat vs bf16", ["64 x 2048", "", ratio("faster", tok("bf16"), tok("coat")),
                                "", "", "", ""]))
  rows.append(("coat vs bf16", ["4 x 2048", "", ratio("faster", tok("bf16_b4"), tok("coat_b4")),
                                "", "", "", ""]))
  return rows_table(src, sid, ["", "global batch", "remat / microbatches (plan)", "tokens/s",
                               "MFU", "device peak GiB", "compile s", "first step s"], rows)


def remat_sweep(src: Sources) -> list[str]:
  """Each config at `remat: auto` and at each policy by hand (microbatches auto)."""
  out = ["| config | remat | microbatches | tokens/s | device peak GiB | vs the best by hand |",
         "|---|---|---|---|---|---|"]
  for name, sid in (("olmo-1b", "remat_sweep_olmo1b_h200"),
                    ("llama2-7b", "remat_sweep_llama2_7b_h200")):
    text = src.raw(sid)
    runs = {}
    for remat in ("auto", "none", "fp8_residuals", "dots", "full"):
      key = lambda field: _summary_field(f"/tmp/sweep_{remat}", field)
      try:
        tokens = src.value(sid, key("tokens_per_s"))
      except ValueError:   # the run left no summary (stopped before its end)
        continue
      runs[remat] = (tokens, src.value(sid, key("peak_memory_bytes")) / 2**30,
                     _plan_choice(text, f"/tmp/sweep_{remat}").split(" / ")[-1])
    best = max(v[0] for r, v in runs.items() if r != "auto")
    for remat, (tok, peak, micro) in runs.items():
      out.append(f"| `{name}` | {remat} | {micro} | {tok:,.0f} | {peak:.2f} | "
                 f"{100 * (tok / best - 1):+.1f} % |")
    if "auto" not in runs:
      out.append(f"| `{name}` | auto | | not measured in this run (stopped by its time limit "
                 f"while the data cache was built) | | |")
  return out + ["", source_line(src, "remat_sweep_olmo1b_h200"),
                "Llama-2-7B: " + source_line(src, "remat_sweep_llama2_7b_h200")]


def two_pass(src: Sources) -> list[str]:
  sid = "adam_column_two_pass_h200"
  text = src.raw(sid)
  out = ["| column kernel, tile | GPU kernel ms | wall ms |", "|---|---|---|"]
  for line in text.splitlines():
    m = re.match(r"\| coat_adamw_apply, per leaf, groups along axis -2 \(column kernel\), "
                 r"([^|]+) \| ([\d.]+) \| [\d.]+ \| ([\d.]+) \|", line)
    if m:
      out.append(f"| {m.group(1).strip()} | {m.group(3)} | {m.group(2)} |")
  return out + ["", source_line(src, sid)]


def step_floor_h200(src: Sources) -> list[str]:
  """The floor table of `step_floor --summary` (two runs; the second's rows that the first has
  are left out)."""
  text = src.raw("step_floor_h200")
  rows, seen = [], set()
  for line in text.splitlines():
    if line.startswith("| ") and not line.startswith("| row "):
      label = line.split("|")[1].strip()
      if label not in seen:
        seen.add(label)
        rows.append(line)
  header = next(line for line in text.splitlines() if line.startswith("| row "))
  return [header, "|" + "---|" * (header.count("|") - 1)] + rows + [
      "", source_line(src, "step_floor_h200")]


def largest_batch(src: Sources) -> list[str]:
  sid = "olmo1b_largest_batch_h100"
  pat = r"re:{} \(unrolled\) batch {}: ok in \d+ s, ([\d,]+) tokens/s, peak ([\d.]+) GB"
  rows = []
  for mode, batch in (("bf16+adamw", 22), ("coat+coat_adamw", 32), ("coat+coat_adamw", 36)):
    p = pat.format(re.escape(mode), batch)
    peak = p.replace(r"([\d,]+) tokens/s", r"[\d,]+ tokens/s")
    rows.append((f"{mode}, batch {batch}", [(p, ",.0f"), (peak, ".2f")]))
  b, c = (src.value(sid, r[1][0][0]) for r in (rows[0], rows[2]))
  rows.append(("coat (36) vs bf16 (22)", [ratio("faster", b, c), ""]))
  return rows_table(src, sid, ["", "tokens/s", "peak GB"], rows)


def layer(src: Sources) -> list[str]:
  sid = "layer7b_h200"
  v = lambda k: src.value(sid, k)
  rows = [("bf16 (coat-jax)", [("bf16_ms", ".2f"), ("bf16_ms_back_to_back", ".2f"),
                               ("bf16_held_mb", ".1f")]),
          ("coat (coat-jax)", [("coat_ms", ".2f"), ("coat_ms_back_to_back", ".2f"),
                               ("coat_held_mb", ".1f")]),
          ("BF16 (COAT's PyTorch)", [("COAT_bf16_ms", ".2f"), "", ("COAT_bf16_held_mb", ".1f")]),
          ("COAT (PyTorch + Triton)", [("COAT_ms", ".2f"), "", ("COAT_held_mb", ".1f")]),
          ("coat vs bf16 (coat-jax)", [ratio("time", v("bf16_ms"), v("coat_ms")), "",
                                       ratio("less", v("bf16_held_mb"), v("coat_held_mb"))])]
  return rows_table(src, sid, ["", "fwd + bwd ms", "back to back ms", "held MB"], rows)


def layer_fp8_attention(src: Sources) -> list[str]:
  sid = "layer7b_fp8_attention_residuals_h100"
  r = src.value(sid, "results.0")
  out = ["| | fwd + bwd ms | held MB |", "|---|---|---|",
         f"| coat, `attention_residuals: fp8` | {r['fwd_bwd_ms']:.2f} "
         f"| {r['held_bytes'] / 1e6:.1f} |"]
  return out + ["", source_line(src, sid)]


def optimizer(src: Sources) -> list[str]:
  sid = "optimizer_step_h200"
  # bench_optimizer's columns: wall 1, pipelined 2, kernel 3, ..., state B/param 6, wall/floor 9,
  # kernel/floor 10
  cells = [(1, ".2f"), (3, ".2f"), (6, ".2f"), (9, ".2f"), (10, ".2f")]
  rows = [(label, [(_optimizer_row(name, c), f) for c, f in cells])
          for label, name in OPTIMIZER_ROWS]
  out = rows_table(src, sid, ["optimizer", "wall ms", "GPU kernel ms", "state B/param",
                              "wall / floor", "kernel / floor"], rows)
  floor = src.value(sid, r"re:floor at ([\d.]+) TB/s")
  out += ["", f"Floor: {floor:.3f} TB/s read + write, measured in the same run."]
  anchors = [("torch.optim.AdamW, fused", "torch_fused_ms", "torch_bytes"),
             ("torchao AdamW8bit", "torchao_8bit_ms", "torchao_8bit_bytes"),
             ("torchao AdamWFp8", "torchao_fp8_ms", "torchao_fp8_bytes"),
             ("bitsandbytes AdamW8bit", "bnb_8bit_ms", "bnb_8bit_bytes"),
             ("COAT's FP8 AdamW (its CUDA kernel)", "COAT_ms", "COAT_bytes")]
  out += [""] + rows_table(src, "optimizer_anchors_h200", ["PyTorch optimizer", "ms",
                                                           "state B/param"],
                           [(label, [(t, ".2f"), (b, ".2f")]) for label, t, b in anchors])
  return out


def big_models(src: Sources) -> list[str]:
  out = ["| model | GPU | recipe | batch | peak GB | tokens/s | MFU | date | raw |",
         "|---|---|---|---|---|---|---|---|---|"]
  def row(model, sid, recipe, base):
    gpu, date, _, raw = src.where(sid, short=True)
    v = lambda k: src.value(sid, f"{base}.{k}")
    out.append(f"| {model} | {gpu} | {recipe} | {v('batch')} | {v('peak_bytes') / 1e9:.2f} | "
               f"{v('tokens_per_s'):,.0f} | {100 * v('mfu'):.1f} % | {date} | {raw} |")
  sr = "coat, bf16 master weights + stochastic rounding, remat full"
  row("Llama-2-7B", "llama2_7b_b8_h100", sr, "equal_batch.0")
  row("Llama-2-7B", "llama2_7b_b16_h100", sr, "equal_batch.0")
  row("Llama-2-7B", "llama2_7b_b8_unrolled_h100", sr + ", layers unrolled", "equal_batch.0")
  gpu, date, _, raw = src.where("llama2_7b_bf16_h200", short=True)
  v = lambda k: src.value("llama2_7b_bf16_h200", k)
  for b in (4, 8):
    mfu = v("b8_mfu") if b == 8 else ""
    out.append(f"| Llama-2-7B | {gpu} | bf16 + optax.adamw, float32 master weights, remat full "
               f"| {b} | {v(f'b{b}_peak_gb'):.2f} | {v(f'b{b}_tokens'):,.0f} | {mfu} | {date} "
               f"| {raw} |")
  for i in (0, 1):
    row("Llama-2-13B", "llama2_13b_h200", sr, f"max_batch.coat+coat_adamw.{i}")
  out += ["", "Commands:", ""]
  for sid in ("llama2_7b_b8_h100", "llama2_7b_b16_h100", "llama2_7b_b8_unrolled_h100",
              "llama2_7b_bf16_h200", "llama2_13b_h200"):
    out.append(f"- `{src.where(sid)[2]}`")
  return out


def accuracy(src: Sources) -> list[str]:
  sid = "accuracy_llama125m_h100"
  runs = src.value(sid, "runs")
  b, c = runs["bf16+adamw"]["final_eval_loss"], runs["coat+coat_adamw"]["final_eval_loss"]
  fp8 = src.value("accuracy_llama125m_fp8_attention_residuals_h100", r"re:\n\s+2000\s+([\d.]+)\n")
  out = ["| run | final eval loss (step 2000) | vs bf16 |", "|---|---|---|",
         f"| bf16 + adamw | {b:.4f} | |",
         f"| coat + coat_adamw | {c:.4f} | {ratio('pct', b, c)} |",
         f"| coat + coat_adamw, `attention_residuals: fp8` | {fp8:.4f} | {ratio('pct', b, fp8)} |",
         "", source_line(src, sid),
         "The FP8 attention residuals run: " + source_line(
             src, "accuracy_llama125m_fp8_attention_residuals_h100")]
  return out


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


def step_floor(src: Sources) -> list[str]:
  sid = "step_floor_h100"
  text = src.raw(sid)
  table = text[text.index("ms per step            bf16 floor"):]
  lines = table.splitlines()
  out = ["| ms per step | bf16 floor | bf16 measured | coat floor | coat measured |",
         "|---|---|---|---|---|"]
  for line in lines[2:11]:
    name, nums = line[:23].strip(), line[23:]
    cells = [nums[i:i + 11].strip() for i in range(0, 44, 11)]
    out.append("| " + " | ".join([name] + cells) + " |")
  notes = [line for line in lines[11:] if line.strip()]
  notes = notes[:notes.index(next(n for n in notes if n.startswith("===")))]
  for note in notes:
    out += ["", note]
  out += ["", source_line(src, sid)]
  return out


# ---------------------------------------------------------------------------------------------
# The largest model per GPU: `train.py --plan` sections of run_gpu.sh's `largest` logs.

LLAMA_VOCAB = 32000   # the offline corpus's vocabulary in the largest-model runs


def llama_params(hidden: int, layers: int, ffn: int, vocab: int = LLAMA_VOCAB) -> int:
  """Parameters of a Llama (untied embedding and head, heads of 128 with as many KV heads)."""
  return 2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden) + hidden


def largest_plans(text: str) -> list[dict]:
  """Each `--plan` section of a log: mode, shape, device limit, fits, predicted GiB, microbatches."""
  plans = []
  for section in text.split("=== largest (")[1:]:
    head = section.split("\n", 1)[0]
    if " --plan" not in head:
      continue
    get = lambda key: re.search(rf"--set {re.escape(key)}=(\S+)", head).group(1)
    # ">" before the peak: a lower bound, the state alone over the device (no compile)
    row = re.search(r"^  (chosen|as configured) +\S+ +(\d+) \S+ +\d+ +(>?)([\d.]+) GiB", section,
                    re.M)
    device = re.search(r"^device: 1 x (.+?), ([\d.]+) GiB each", section, re.M)
    shape = tuple(int(get(k)) for k in ("model.hidden_size", "model.num_layers",
                                        "model.intermediate_size"))
    plans.append(dict(mode=f"{get('precision')} + {get('optimizer.name')}", shape=shape,
                      params=llama_params(*shape), fits=row.group(1) == "chosen",
                      micro=int(row.group(2)), predicted=float(row.group(4)),
                      at_least=row.group(3),
                      device_gib=float(device.group(2))))
  return plans


LARGEST_SOURCES = (("largest_plans_h200", "one H200 (141 GB)"), ("largest_coat_h200", "one H200 (141 GB)"),
                   ("largest_20b_h200", "one H200 (141 GB)"), ("largest_80gb_h200", "one 80 GB GPU"),
                   ("largest_80gb_summed_h200", "one 80 GB GPU"))
LARGEST_RUN = ("largest_20b_h200", "/tmp/cfg_llama-20b")   # train.py on the largest coat model


def run_params(src: Sources, sid: str) -> float:
  """The parameter count train.py's `[run] model` line gives in `sid`'s raw log."""
  return src.value(sid, r"re:\[run\] model \S+ \(([\d.]+)M params") * 1e6


def config_run_plan(src: Sources, sid: str) -> dict:
  """The shipped config's train.py run in `sid` as a plan row: its shape (the source's values,
  checked against the run's parameter count) and the `[plan]` line it trained with."""
  text = src.raw(sid)
  m = PLAN_LINE.search(text)
  shape = tuple(int(src.value(sid, k)) for k in ("hidden", "layers", "ffn"))
  params = run_params(src, sid)
  if abs(llama_params(*shape) - params) > 1e5:
    raise ValueError(f"{sid}: the shape {shape} has {llama_params(*shape)} params, the run {params}")
  prec, opt = re.search(r"precision (\S+)\), optimizer (\S+),", text).groups()
  return dict(mode=f"{prec} + {opt}", shape=shape, params=llama_params(*shape), fits=True,
              micro=int(m["micro"]), predicted=float(m["predicted"]),
              device_gib=float(m["limit"]), ran=True)


def _largest_rows(src: Sources):
  """(GPU label, plan) for every plan; the coat rows of the first H200 log (before the in-place
  rounding step) are left out where the second measured coat again."""
  rows = []
  for sid, gpu in LARGEST_SOURCES:
    for plan in largest_plans(src.raw(sid)):
      if sid == "largest_plans_h200" and plan["mode"].startswith("coat"):
        continue
      rows.append((gpu, plan, sid))
    if sid == LARGEST_RUN[0]:
      rows.append((gpu, config_run_plan(src, sid), sid))
  return rows


def _largest_fits(src: Sources) -> dict[tuple[str, str], tuple[dict, str]]:
  """(GPU label, mode) -> (the largest plan that fits, its source)."""
  best = {}
  for gpu, p, sid in _largest_rows(src):
    if p["fits"] and p["params"] > best.get((gpu, p["mode"]), ({"params": 0}, ""))[0]["params"]:
      best[(gpu, p["mode"])] = (p, sid)
  return best


def _largest_run(src: Sources) -> tuple[float, float, float]:
  """tokens/s, MFU and device peak GiB of the train.py run on the largest coat model."""
  key = lambda field: src.value(LARGEST_RUN[0], _summary_field(LARGEST_RUN[1], field))
  return key("tokens_per_s"), key("mfu"), key("peak_memory_bytes") / 2**30


def largest_models(src: Sources) -> list[str]:
  """Every shape planned, per GPU and mode: fits or not, the plan's microbatches and peak."""
  out = ["| GPU | precision + optimizer | hidden x layers | params | fits at 64 x 2048 | "
         "microbatches | predicted peak GiB | train.py tokens/s |", "|---|---|---|---|---|---|---|---|"]
  tokens, mfu, peak = _largest_run(src)
  for gpu, p, sid in _largest_rows(src):
    h, layers, _ = p["shape"]
    ran = f"{tokens:,.0f} ({mfu:.1%} MFU, {peak:.2f} GiB measured)" if p.get("ran") else ""
    out.append(f"| {gpu} | {p['mode']} | {h} x {layers} | {p['params'] / 1e9:.2f}e9 | "
               f"{'yes' if p['fits'] else 'no'} | {p['micro'] if p['fits'] else ''} | "
               f"{p.get('at_least', '')}{p['predicted']:.2f} of {p['device_gib']:.2f} | {ran} |")
  return out + ["", "Before the in-place rounding step (bf16 and fp8_linear rows): " +
                source_line(src, "largest_plans_h200"),
                "coat on the H200, before the layers' gradients were summed in place: " +
                source_line(src, "largest_coat_h200"),
                "coat on the H200, now: " + source_line(src, "largest_20b_h200"),
                "80 GB: " + source_line(src, "largest_80gb_h200"),
                "80 GB, coat now: " + source_line(src, "largest_80gb_summed_h200")]


def summed_in_place(src: Sources) -> list[str]:
  """coat's largest shapes with the layers' gradient summed in place: the plans, the buffer
  report's total for the 20.3e9 step, and the train.py run."""
  sid, run = "largest_summed_in_place_h200", "/tmp/largest"
  text = src.raw(sid)
  out = ["| hidden x layers | params | microbatches | predicted peak GiB | fits | train.py |",
         "|---|---|---|---|---|---|"]
  for p in largest_plans(text):
    h, layers, _ = p["shape"]
    out.append(f"| {h} x {layers} | {p['params'] / 1e9:.2f}e9 | {p['micro']} | "
               f"{p['predicted']:.2f} of {p['device_gib']:.2f} | {'yes' if p['fits'] else 'no'} | |")
    if p["shape"] == (6144, 44, 16384):
      total = src.value("step_buffers_20b_h200", r"re:Total bytes: \d+ \(([\d.]+)GiB\)")
      out.append(f"| {h} x {layers}, no mean tree after the loop | {p['params'] / 1e9:.2f}e9 | "
                 f"{p['micro']} | {total:.2f} of {p['device_gib']:.2f} | no | |")
  m = PLAN_LINE.search(text)
  key = lambda field: src.value(sid, _summary_field(run, field))
  params = run_params(src, sid)
  head = text[:m.start()].rsplit("=== largest (", 1)[1]   # the run's command line
  h, layers = (re.search(rf"--set model\.{k}=(\d+)", head).group(1)
               for k in ("hidden_size", "num_layers"))
  out.append(f"| {h} x {layers} | {params / 1e9:.2f}e9 | {m['micro']} | {float(m['predicted']):.2f} "
             f"of {float(m['limit']):.2f} | yes | {key('tokens_per_s'):,.0f} tokens/s, "
             f"{key('mfu'):.1%} MFU, {key('peak_memory_bytes') / 2**30:.2f} GiB measured |")
  return out + ["", source_line(src, sid),
                "Buffers of the 20.3e9 step: " + source_line(src, "step_buffers_20b_h200")]


def swiglu_weight_codes(src: Sources) -> list[str]:
  """The gate/up weights' transposed codes by XLA or by the quantize kernel: the 20.3e9 step's
  prediction, the 7B layer and OLMo-1B's step, each way."""
  sid = "swiglu_weight_codes_h200"
  text = src.raw(sid)
  out = ["| gate/up W^T codes | 20.3e9 step: temporaries B/param | predicted B/param | "
         "predicted GiB | 7B layer fwd+bwd ms | held MB | OLMo-1B step ms (tokens/s) |",
         "|---|---|---|---|---|---|---|"]
  for name, label in (("xla", "XLA's transpose of W's codes"),
                      ("kernel", "the quantize kernel writes them (default)")):
    mem = re.search(rf"^\| {name} \| ([\d.]+) \| [\d.]+ \| ([\d.]+) \| ([\d.]+) \|", text, re.M)
    layer = re.search(rf"=== layer {name}:.*?^coat +[\d.]+ +([\d.]+) +[\d.]+ +([\d.]+)", text,
                      re.M | re.S)
    e2e = re.search(rf"=== e2e {name}:.*?^coat\+coat_adamw +scanned(?: +\S+){{9}} +([\d.]+) +[\d.]+ "
                    rf"+([\d,]+)", text, re.M | re.S)
    params = float(mem.group(1)) * 1e9
    out.append(f"| {label} | {float(mem.group(2)):.3f} | {float(mem.group(3)):.3f} | "
               f"{float(mem.group(3)) * params / 2**30:.2f} | {layer.group(1)} | {layer.group(2)} | "
               f"{float(e2e.group(1)):.1f} ({e2e.group(2)}) |")
  return out + ["", source_line(src, sid)]


def largest_summary(src: Sources) -> list[str]:
  """The README's table: per GPU and mode, the largest shape that fits."""
  best = _largest_fits(src)
  out = ["| GPU | bf16 + optax.adamw | fp8_linear + optax.adamw | coat + coat_adamw |",
         "|---|---|---|---|"]
  for gpu in dict.fromkeys(g for _, g in LARGEST_SOURCES):
    cells = []
    for mode in ("bf16 + adamw", "fp8_linear + adamw", "coat + coat_adamw"):
      p = best.get((gpu, mode), (None, ""))[0]
      cells.append("" if p is None else f"{p['params'] / 1e9:.1f}e9 ({p['shape'][0]} x "
                                        f"{p['shape'][1]} layers)")
    out.append(f"| {gpu} | " + " | ".join(cells) + " |")
  tokens, mfu, peak = _largest_run(src)
  run = best[("one H200 (141 GB)", "coat + coat_adamw")][0]
  meta = src.meta[LARGEST_RUN[0]]
  return out + ["", f"Llama shapes (heads of 128, vocabulary 32000), seq 2048, global batch 64 "
                f"through microbatches, remat full, planned by `train.py --plan` "
                f"({meta['gpu']}, {meta['date']}; the 80 GB GPU is the H200 held to an H100's "
                f"75.22 GiB by `run.device_memory_limit`); the {run['params'] / 1e9:.1f}e9 coat "
                f"model (`configs/llama-20b.yaml`) ran through train.py at {tokens:,.0f} tokens/s "
                f"({mfu:.1%} MFU, {peak:.2f} GiB). Each plan with its command "
                f"and raw log is in docs/results.md, \"The largest model one GPU trains\"."]


def equal_batch_7b(src: Sources) -> list[str]:
  """configs/llama2-7b.yaml through train.py at one batch and remat for both modes."""
  sid = "equal_batch_7b_h200"
  key = lambda run, field: _summary_field(f"/tmp/equal_{run}_8", field)
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


def optimizer_stacked(src: Sources) -> list[str]:
  sid = "optimizer_stacked_h200"
  base = [src.value(sid, _optimizer_row("optax.adamw", c)) for c in (1, 2, 3)]
  rows = []
  for label, name in OPTIMIZER_STACKED_ROWS:
    wall, piped, kernel = (src.value(sid, _optimizer_row(name, c)) for c in (1, 2, 3))
    rows.append((label, [f"{wall:.2f}", f"{piped:.2f}", f"{kernel:.2f}",
                         f"{wall / base[0]:.2f}x", f"{piped / base[1]:.2f}x",
                         f"{kernel / base[2]:.2f}x", (_optimizer_row(name, 10), ".2f")]))
  return rows_table(src, sid, ["optimizer", "wall ms", "pipelined ms", "GPU kernel ms",
                               "wall vs optax", "pipelined vs optax", "kernel vs optax",
                               "kernel / floor"], rows)


def step_memory_sr(src: Sources) -> list[str]:
  sid = "step_memory_sr_h200"
  text = src.raw(sid)
  before, after = text.split("## after")
  pat = r"RESULT {}: .*?temp ([\d.]+), predicted_bytes ([\d.]+)"
  rows = []
  for label, part, name in (("stochastic, a loop mapping layers to new stacks", before, "big_sr"),
                            ("round to nearest (no rounding loop)", before, "big_nearest"),
                            ("stochastic, the loop updating the stacks in place", after, "big_sr")):
    m = re.search(pat.format(name), part)
    rows.append(f"| {label} | {float(m.group(1)):.3f} | {float(m.group(2)):.3f} | "
                f"{float(m.group(2)) * 15.5535e9 / 2**30:.2f} |")
  return (["| bfloat16 master weights, rounding step | temporaries B/param | predicted B/param | "
           "predicted GiB |", "|---|---|---|---|"] + rows + ["", source_line(src, sid)])


CHECKPOINT_MEMORY = (("checkpoint_memory_whole_h200", "28 GiB in 64 arrays", ("whole",)),
                     ("checkpoint_memory_batches_h200", "41 GiB in 16 arrays", None),
                     ("checkpoint_memory_13b_h200", "Llama-2-13B's, 49 GiB", None))


def _save_label(mode: str) -> str | None:
  """checkpoint_memory's mode in words ('streamed' in these logs: batches of 1/8, the rule then);
  None for a cell that is no mode."""
  head, _, host = mode.partition(":")
  kind, _, n = head.partition("/")
  if kind != "streamed":
    return "whole" if kind == "whole" else None
  text = f"streamed, batches of 1/{n or 8}" + (" (the rule then)" if not n else "")
  return text + (", into ordinary host memory" if host == "unpinned" else "")


def checkpoint_memory(src: Sources) -> list[str]:
  """Each save of benchmarks/step/checkpoint_memory.py's logs: the rows of its table by column."""
  out = ["| state | save | batch GiB | added GiB | added / state | kept after GiB | seconds |",
         "|---|---|---|---|---|---|---|"]
  for sid, state, modes in CHECKPOINT_MEMORY:
    header = None
    for line in src.raw(sid).splitlines():
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      if cells[0] == "save":
        header = cells
      elif (header and len(cells) == len(header) and _save_label(cells[0])
            and (modes is None or cells[0] in modes)):
        row = dict(zip(header, cells))
        out.append(f"| {state} | {_save_label(row['save'])} | {row['batch GiB']} | {row['added GiB']} | "
                   f"{row['added / state']} | {row.get('kept after GiB', '-')} | "
                   f"{row['seconds']} |")
  return out + [""] + [source_line(src, sid) for sid, _, _ in CHECKPOINT_MEMORY]


def step_profile_7b(src: Sources) -> list[str]:
  """The Llama-2-7B train step's GPU time per kernel category, bf16 and coat (profile_step)."""
  sid = "step_profile_llama2_7b_h200"
  runs = {r["variant"].split(":")[0]: r for r in src.raw(sid)}
  bf16, coat = runs["bf16"], runs["coat"]
  out = ["| ms per step | bf16 + optax.adamw | coat + coat_adamw |", "|---|---|---|"]
  ms = {cat: (bf16["category_ms"].get(cat, 0.0), coat["category_ms"].get(cat, 0.0))
        for cat in {**bf16["category_ms"], **coat["category_ms"]}}
  for cat, (a, b) in sorted(ms.items(), key=lambda kv: -max(kv[1])):   # the largest first
    out.append(f"| {cat} | {a:.1f} | {b:.1f} |")
  out += [f"| kernel total | {bf16['kernel_ms']:.1f} | {coat['kernel_ms']:.1f} |",
          f"| step (wall) | {bf16['step_ms']:.1f} | {coat['step_ms']:.1f} |",
          f"| coat vs bf16, step | | {bf16['step_ms'] / coat['step_ms']:.2f}x |"]
  return out + ["", source_line(src, sid)]


def step_profile_olmo(src: Sources) -> list[str]:
  """OLMo-1B's unrolled step without command buffers: ms and launches per kernel category, and the
  kernels shorter than profile_step's SMALL_KERNEL_US (launch-bound), bf16 and coat."""
  sid = "step_profile_olmo1b_nocb_h200"
  runs = {r["variant"].split(":")[0]: r for r in src.raw(sid)}
  bf16, coat = runs["bf16"], runs["coat"]
  out = ["| per step | bf16 ms | bf16 launches | bf16 small kernels: launches, ms | coat ms | "
         "coat launches | coat small kernels: launches, ms |", "|---|---|---|---|---|---|---|"]
  cats = {**bf16["category_ms"], **coat["category_ms"]}
  cell = lambda r, cat: (f"{r['category_ms'].get(cat, 0.0):.2f} | "
                         f"{r['category_launches'].get(cat, 0):.0f} | "
                         f"{r['small_launches'].get(cat, 0):.0f}, {r['small_ms'].get(cat, 0.0):.2f}")
  for cat in sorted(cats, key=lambda c: -max(bf16["category_ms"].get(c, 0.0),
                                              coat["category_ms"].get(c, 0.0))):
    out.append(f"| {cat} | {cell(bf16, cat)} | {cell(coat, cat)} |")
  total = lambda r: (f"{r['kernel_ms']:.2f} | {sum(r['category_launches'].values()):.0f} | "
                     f"{sum(r['small_launches'].values()):.0f}, {sum(r['small_ms'].values()):.2f}")
  out.append(f"| kernel total | {total(bf16)} | {total(coat)} |")
  return out + ["", source_line(src, sid)]


GEMM_SHAPES = re.compile(r"^\S*?\[(\d+),(\d+)\]\S* custom-call <- "
                         r"\((\w+)\[(\d+),(\d+)\], (\w+)\[")


def step_gemms_olmo(src: Sources) -> list[str]:
  """coat's plain FP8 GEMMs in OLMo-1B's step by shape (M x N x K from the output's and the
  left operand's shapes): launches, time and TFLOP/s in the step."""
  sid = "step_profile_olmo1b_nocb_h200"
  coat = next(r for r in src.raw(sid) if r["variant"].startswith("coat"))
  out = ["| M x N x K | A, B -> out | launches per step | ms per step | us each | TFLOP/s |",
         "|---|---|---|---|---|---|"]
  for ms, cat, name, shape, calls in coat["top_by_shape"]:
    m = GEMM_SHAPES.match(shape)
    if cat != "FP8 GEMM" or "swiglu" in name or not m:
      continue
    rows, cols, a, _, k, b = m.groups()
    rows, cols, k = int(rows), int(cols), int(k)
    us = 1e3 * ms / calls
    types = f"{a.removeprefix('f8')}, {b.removeprefix('f8')} -> {shape.split('[')[0]}"
    out.append(f"| {rows} x {cols} x {k} | {types} | {calls:.0f} | {ms:.2f} | "
               f"{us:.0f} | {2 * rows * cols * k / us / 1e6:,.0f} |")
  return out + ["", source_line(src, sid)]


TABLES = {
  "headline": headline, "e2e": e2e, "train_py": train_py, "largest_batch": largest_batch,
  "layer": layer, "layer_fp8_attention": layer_fp8_attention, "optimizer": optimizer,
  "big_models": big_models, "accuracy": accuracy, "stability": stability, "formats": formats,
  "master_weights": master_weights, "group_axis": group_axis, "step_floor": step_floor,
  "sft": sft, "sft_now": sft_now, "remat_sweep": remat_sweep,
  "plan_candidates": plan_candidates, "compile_7b": compile_7b,
  "summed_in_place": summed_in_place, "two_pass": two_pass, "step_floor_h200": step_floor_h200,
  "largest_models": largest_models, "largest_summary": largest_summary,
  "equal_batch_7b": equal_batch_7b, "optimizer_stacked": optimizer_stacked,
  "compile_olmo": compile_olmo, "compile_warm": compile_warm,
  "compile_traced_once": compile_traced_once, "largest_batch_7b": largest_batch_7b,
  "step_memory_sr": step_memory_sr, "swiglu_weight_codes": swiglu_weight_codes,
  "step_profile_7b": step_profile_7b, "step_profile_olmo": step_profile_olmo,
  "step_gemms_olmo": step_gemms_olmo,
  "checkpoint_memory": checkpoint_memory,
}


def render(text: str, src: Sources, rel_prefix: str) -> str:
  """The markdown text with every marked table regenerated; links to raw files are made relative
  to the file's directory (`rel_prefix` + "gpu_results/...")."""
  def table(m):
    name = m.group(1)
    if name not in TABLES:
      raise ValueError(f"unknown results table {name!r}; known: {', '.join(TABLES)}")
    body = "\n".join(TABLES[name](src)).replace("](gpu_results/", f"]({rel_prefix}gpu_results/")
    return f"<!-- results:{name}:begin -->\n{body}\n<!-- results:{name}:end -->"
  return MARKER.sub(table, text)


def targets() -> list[tuple[Path, str]]:
  out = []
  for rel in TARGETS:
    path = REPO / rel
    prefix = "" if path.parent == REPO / "docs" else "docs/"
    if path.is_file() and MARKER.search(path.read_text()):
      out.append((path, prefix))
  return out


def unused_raw_files(src: Sources) -> list[str]:
  """Files in docs/gpu_results that no source names: a claim's raw file or a leftover."""
  named = {Path(s["raw"]).name for s in src.meta.values() if s.get("raw")}
  return sorted(p.name for p in RAW_DIR.iterdir() if p.name not in named)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--check", action="store_true", help="report out-of-date tables, change nothing")
  args = p.parse_args(argv)
  src = Sources()
  stale = []
  for path, prefix in targets():
    old = path.read_text()
    new = render(old, src, prefix)
    if new != old:
      stale.append(str(path.relative_to(REPO)))
      if not args.check:
        path.write_text(new)
  if args.check and stale:
    print("out of date (run python scripts/results_tables.py): " + ", ".join(stale))
    return 1
  if not args.check and stale:
    print("rewrote: " + ", ".join(stale))
  return 0


if __name__ == "__main__":
  sys.exit(main())
