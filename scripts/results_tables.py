"""Write the results tables of docs/results.md, the README and docs/accuracy.md from the raw files.

Every number in a results table is read at generation time (by the table's generator in
`scripts/results_gen/`, one module per topic) from the file that recorded it
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
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # the generators: scripts/results_gen

from results_gen import accuracy, headline, kernels, models, step_time, training  # noqa: E402
from results_gen.common import RAW_DIR, REPO, SOURCES, Sources  # noqa: E402,F401

# Files whose tables are generated; a file missing or without markers is skipped.
TARGETS = ("docs/results.md", "docs/results_table.md", "docs/accuracy.md", "README.md")
MARKER = re.compile(r"<!-- results:([a-z0-9_]+):begin -->\n.*?<!-- results:\1:end -->", re.S)


# Each marked table's name: the generator of that name in its topic's module.
TABLE_NAMES = (
  (headline, ("headline",)),
  (training, ("e2e", "e2e_linear_residuals", "train_py", "plan_candidates", "remat_sweep",
              "equal_batch_7b", "largest_batch_7b", "largest_batch", "sft_now", "sft_b4_now")),
  (kernels, ("layer", "layer_fp8_attention", "layer_linear_residuals", "remake_sweep",
             "remake_ways", "optimizer", "optimizer_stacked", "two_pass", "swiglu_weight_codes")),
  (accuracy, ("accuracy", "accuracy_fp8_attention", "accuracy_linear_remade", "stability",
              "formats", "master_weights", "group_axis")),
  (models, ("big_models", "largest_models", "largest_summary", "summed_in_place",
            "step_memory_sr", "checkpoint_memory")),
  (step_time, ("compile_7b", "compile_breakdown_7b", "compile_olmo", "compile_warm",
               "compile_traced_once", "step_floor", "step_floor_h200", "step_profile_7b",
               "step_profile_olmo", "step_profile_olmo_h100", "step_gemms_olmo")),
)
TABLES = {name: getattr(module, name) for module, names in TABLE_NAMES for name in names}


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
