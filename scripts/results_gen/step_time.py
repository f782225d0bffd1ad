"""The step-time tables: compile times, the step against its floors, the step by kernel."""
from __future__ import annotations

import re

from .common import Sources, fmt, rows_table, source_line


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
    ("olmo1b_compile_quantize_blocks_h200", "2026-12-04"),
    ("olmo1b_compile_traced_once_h200", "2026-11-29, machine A"),
    ("olmo1b_compile_traced_once_rerun_h200", "2026-11-29, machine B"),
    ("olmo1b_compile_third_machine_h200", "2026-11-29, machine C"))


def compile_olmo(src: Sources) -> list[str]:
  """OLMo-1B's step compile time in each bench_e2e --compile-only run, both modes and layouts,
  one row per run (each on a machine of its own) and one footnote naming every run's raw."""
  out = ["| run | bf16 s, scanned | coat s, scanned | coat vs bf16 | bf16 s, unrolled | "
         "coat s, unrolled | coat vs bf16 |", "|---|---|---|---|---|---|---|"]
  for sid, label in COMPILE_OLMO_RUNS:
    cells = []
    for layers in ("scanned", "unrolled"):
      b, c = (_compile_cell(src, sid, mode, layers, "compile") for mode in ("bf16+adamw",
                                                                            "coat+coat_adamw"))
      cells += [fmt(b, ".1f"), fmt(c, ".1f"), f"{c / b:.2f}x"]
    out.append(f"| {label} | " + " | ".join(cells) + " |")
  first = COMPILE_OLMO_RUNS[0][0]
  gpu, _, cmd, _ = src.where(first)
  raws = ", ".join(f"{label}: {src.where(sid)[3]}" for sid, label in COMPILE_OLMO_RUNS)
  out += ["", f"{gpu}, each run on a machine of its own; {src.meta[first]['setting']}. "
          f"Command: `{cmd}`. Raws: {raws}."]
  return out


WARM_VARIANTS = (("bf16 + optax.adamw, unrolled", 0), ("coat, unrolled, 8 threads (default)", 1),
                 ("coat, unrolled, 2 threads", 2), ("coat, unrolled, none ahead", 3),
                 ("coat, scanned, 8 threads (default)", 6), ("coat, scanned, 2 threads", 4),
                 ("coat, scanned, none ahead", 5))


def _step_s(row: dict) -> float:
  """A compile_breakdown JSON row's wait for the step: trace + lower + compile seconds."""
  return row["trace_s"] + row["lower_s"] + row["compile_s"]


def _breakdown_rows(src: Sources, sid: str, variants, instructions: bool = False) -> list:
  """compile_breakdown's JSON rows as (label, [trace s, lower s, compile s, total s (, HLO
  instructions)]) for (label, row index) pairs."""
  rows = []
  for label, i in variants:
    r = src.value(sid, f"rows.{i}")
    cells = [fmt(r[k], ".1f") for k in ("trace_s", "lower_s", "compile_s")]
    cells.append(fmt(_step_s(r), ".1f"))
    rows.append((label, cells + ([f"{r['hlo']['instructions']:,}"] if instructions else [])))
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


BREAKDOWN_7B_RUNS = (("compile_breakdown_7b_unrolled_h200", "H200, bf16 first"),
                     ("compile_breakdown_7b_unrolled_rerun_h200", "H200, coat first"),
                     ("compile_breakdown_7b_unrolled_h100", "H100, phases back to back"),
                     ("compile_breakdown_7b_unrolled_passes_h100", "H100, pass logging on"))


def compile_breakdown_7b(src: Sources) -> list[str]:
  """The unrolled Llama-2-7B step's trace + lower + compile in compile_breakdown's fresh
  processes, both modes, per run; and each child process's wall, start to exit."""
  out = ["| run | bf16 s (XLA compile) | coat s (XLA compile) | coat vs bf16 | process wall s, "
         "bf16 / coat | HLO instructions, bf16 / coat |", "|---|---|---|---|---|---|"]
  for sid, label in BREAKDOWN_7B_RUNS:
    rows = {r["variant"].split(":")[0]: r for r in src.value(sid, "rows")}
    total = {m: _step_s(rows[m]) for m in rows}
    cell = lambda m: f"{total[m]:.1f} ({rows[m]['compile_s']:.1f})"
    wall = {m: rows[m]["wall_s"] for m in rows}
    out.append(f"| {label} | {cell('bf16')} | {cell('coat')} | "
               f"{total['coat'] / total['bf16']:.2f}x | {wall['bf16']:.1f} / {wall['coat']:.1f} "
               f"({wall['coat'] / wall['bf16']:.2f}x) | {rows['bf16']['hlo']['instructions']:,} / "
               f"{rows['coat']['hlo']['instructions']:,} |")
  return out + [""] + [f"{label}: " + source_line(src, sid) for sid, label in BREAKDOWN_7B_RUNS]


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
  """OLMo-1B's unrolled step without command buffers on the H200: `_step_profile_table`."""
  return _step_profile_table(src, "step_profile_olmo1b_nocb_h200")


def step_profile_olmo_h100(src: Sources) -> list[str]:
  """The same profile on the H100 with the current kernels: `_step_profile_table`."""
  return _step_profile_table(src, "step_profile_olmo1b_nocb_h100")


def _step_profile_table(src: Sources, sid: str) -> list[str]:
  """OLMo-1B's unrolled step without command buffers: ms and launches per kernel category, and the
  kernels shorter than profile_step's SMALL_KERNEL_US (launch-bound), bf16 and coat."""
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
