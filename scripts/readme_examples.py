"""The README's Python examples as files, so tests and CI run exactly what a reader copies.

Every ```python block of README.md is an example that runs on its own on a CPU in seconds; a block
whose fence says ```python no-run (a fragment, or one that needs a GPU or files) is skipped.

  python scripts/readme_examples.py OUT_DIR     # writes OUT_DIR/readme_example_<line>.py
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.S | re.M)


def python_blocks(text: str) -> list[tuple[int, str]]:
  """(line of the opening fence, code) of each runnable ```python block, in order."""
  out = []
  for m in FENCE.finditer(text):
    words = m.group(1).split()
    if words[:1] == ["python"] and "no-run" not in words[1:]:
      out.append((text.count("\n", 0, m.start()) + 1, m.group(2)))
  return out


def write(out_dir: Path, readme: Path = README) -> list[Path]:
  """Writes each runnable block to out_dir/readme_example_<line>.py; returns the files."""
  out_dir.mkdir(parents=True, exist_ok=True)
  files = []
  for line, code in python_blocks(readme.read_text()):
    path = out_dir / f"readme_example_{line}.py"
    path.write_text(f"# {readme.name}, the block at line {line}\n{code}")
    files.append(path)
  return files


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("out_dir", type=Path)
  p.add_argument("--readme", type=Path, default=README)
  a = p.parse_args(argv)
  files = write(a.out_dir, a.readme)
  if not files:
    raise SystemExit(f"error: {a.readme} has no runnable python block")
  print("\n".join(map(str, files)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
