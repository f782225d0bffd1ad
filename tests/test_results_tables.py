"""The committed results tables are what scripts/results_tables.py writes from the raw files."""
import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("results_tables",
                                              REPO / "scripts" / "results_tables.py")
rt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rt)


def test_committed_tables_equal_the_generated_ones():
  src = rt.Sources()
  targets = rt.targets()
  names = {p.relative_to(REPO).as_posix() for p, _ in targets}
  assert {"docs/results.md", "docs/results_table.md", "README.md"} <= names
  for path, prefix in targets:
    text = path.read_text()
    assert rt.render(text, src, prefix) == text, (
        f"{path.relative_to(REPO)} is out of date: run python scripts/results_tables.py")


def test_every_table_of_the_script_is_in_results_md():
  text = (REPO / "docs" / "results.md").read_text()
  for name in rt.TABLES:
    assert f"<!-- results:{name}:begin -->" in text, name


def test_every_raw_file_backs_a_source_and_every_source_is_complete():
  src = rt.Sources()
  assert rt.unused_raw_files(src) == []
  for sid, s in src.meta.items():
    for key in ("gpu", "date", "command"):
      assert s.get(key), (sid, key)
    if s.get("raw"):
      assert (REPO / s["raw"]).is_file(), (sid, s["raw"])
    else:
      assert s.get("values") and s.get("raw_note"), sid


def test_a_changed_raw_number_changes_the_table(tmp_path):
  """The table reads the raw file: edit the number there and the committed table is stale."""
  meta = json.loads(rt.SOURCES.read_text())
  raw = REPO / meta["olmo1b_batch1b_h100"]["raw"]
  copy = tmp_path / raw.name
  copy.write_text(raw.read_text().replace("ok in 58 s, 99,152 tokens/s",
                                          "ok in 58 s, 99,999 tokens/s"))
  meta["olmo1b_batch1b_h100"]["raw"] = str(copy)
  sources = tmp_path / "sources.json"
  sources.write_text(json.dumps(meta))
  text = (REPO / "docs" / "results.md").read_text()
  new = rt.render(text, rt.Sources(sources), "")
  table = new.split("results:largest_batch:begin")[1].split("results:largest_batch:end")[0]
  assert new != text and "99,999" in table and "99,152" not in table


def test_unknown_table_and_missing_pattern_fail_loudly(tmp_path):
  src = rt.Sources()
  with pytest.raises(ValueError, match="unknown results table"):
    rt.render("<!-- results:nope:begin -->\n<!-- results:nope:end -->", src, "")
  with pytest.raises(ValueError, match="not found"):
    src.value("olmo1b_batch1b_h100", r"re:no such line ([\d,]+)")


def test_fp8_attention_table_reads_the_printed_eval_losses(tmp_path):
  """Seed 2's FP8-attention run is a printed log: its step-2000 eval loss is the table's, and a
  log whose table is not of that mode alone fails with one line."""
  meta = json.loads(rt.SOURCES.read_text())
  sid = "accuracy_llama125m_fp8_attention_seed2_h100"
  raw = (REPO / meta[sid]["raw"]).read_text()
  assert "\n  2000            3.7065\n" in raw
  copy = tmp_path / "seed2.log"
  copy.write_text(raw.replace("\n  2000            3.7065\n", "\n  2000            3.9999\n"))
  meta[sid]["raw"] = str(copy)
  sources = tmp_path / "sources.json"
  sources.write_text(json.dumps(meta))
  table = rt.TABLES["accuracy_fp8_attention"](rt.Sources(sources))
  assert "| 2 | 3.6512 | 3.6793 | +0.77 % | 3.9999 | +9.55 % |" in table
  copy.write_text(raw.replace("  step   coat+coat_adamw", "  step   bf16+adamw   coat+coat_adamw"))
  with pytest.raises(ValueError, match="no eval-loss table"):
    rt.TABLES["accuracy_fp8_attention"](rt.Sources(sources))
