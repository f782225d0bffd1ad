"""The sources behind the results tables and what every table is built from: `Sources` (sources.json
and the raw files), number formats, ratios, a table's source line, and the selectors that read
run_gpu.sh's and train.py's log lines."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
SOURCES = REPO / "docs" / "results" / "sources.json"
RAW_DIR = REPO / "docs" / "gpu_results"


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


def compared_runs(src: Sources, header: list[str], groups, field: str, columns) -> list[str]:
  """A table of runs from separate sources compared within each group, then the sources' lines.
  groups: (where, labels, {name: source id}), the first name the group's base: each run's row
  (its source's `field`), then each other run's row of changes against the base; labels: {name:
  (row label, change row label)}; columns: (field, scale, format, ratio kind or None: no change
  shown); `where` ends every label of its group."""
  cell = lambda r, field, scale, spec: format(r[field] * scale, spec)
  out, sids = list(header), []
  for where, labels, named in groups:
    runs = {n: src.value(sid, field) for n, sid in named.items()}
    sids += named.values()
    out += [f"| {labels[n][0]}{where} | "
            + " | ".join(cell(r, f, s, spec) for f, s, spec, _ in columns) + " |"
            for n, r in runs.items()]
    base, *others = runs
    for n in others:
      out.append(f"| {labels[n][1]}{where} | " + " | ".join(
          ratio(kind, runs[base][f] * s, runs[n][f] * s) if kind else ""
          for f, s, _, kind in columns) + " |")
  return out + [""] + [source_line(src, sid) for sid in sids]


def optimizer_row(name: str, column: int) -> str:
  """A selector for column `column` (1 = wall ms) of bench_optimizer's table row `name`."""
  return r"re:\| " + re.escape(name) + r" \|" + r" [\d.x]+ \|" * (column - 1) + r" ([\d.]+)"


def summary_field(run: str, field: str) -> str:
  """A selector for `field` of the summary line run_gpu.sh prints for the run in `run`."""
  return rf"re:{re.escape(run)} {{[^}}]*'{field}': ([\d.e+-]+)"


def step_field(run: str, field: str, step: int = 4) -> str:
  """A selector for `field` (tok/s, mfu, mem) of train.py's `[step N]` line in the log section of
  the run writing to `run` (a run stopped before its summary line still logged its steps)."""
  return (rf"re:--out-dir {re.escape(run)} --overwrite\n(?:.*\n)*?\[step {step}\] .*?"
          rf"{re.escape(field)} ([\d,.]+)")


def run_field(run: str, pattern: str) -> str:
  """A selector for group 1 of `pattern`, its first match in the log section of the run in `run`."""
  return rf"re:--out-dir {re.escape(run)} --overwrite\n(?:.*\n)*?{pattern}"


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


# train.py's `[plan]` line: the remat and microbatches chosen, the predicted peak against the
# device, and (where `auto` timed candidates) each candidate's step.
PLAN_LINE = re.compile(r"\[plan\] chose remat (?P<remat>\S+), (?P<micro>\d+) microbatch\S*: "
                       r"predicted (?P<predicted>[\d.]+) GiB per device of (?P<limit>[\d.]+) GiB"
                       r"[^\n]*?(?:timed steps (?P<timed>[^\n]*))?$", re.M)


def plan_choice(text: str, run: str) -> str:
  """The remat policy and microbatches the `[plan]` line of `run`'s section in a log chose."""
  section = text[text.index(f"--out-dir {run} ") if f"--out-dir {run} " in text
                 else text.index(f"run.out_dir={run} "):]
  m = PLAN_LINE.search(section)
  return f"{m['remat']} / {m['micro']}" if m else "as configured"
