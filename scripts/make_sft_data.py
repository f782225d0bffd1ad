"""Writes supervised fine-tuning examples made offline from the Python standard library's sources.

Each example asks for a function's body given its signature and docstring:

  {"prompt": "def name(args):\n    \"\"\"docstring\"\"\"\n", "response": "    body ...\n"}

and every fourth is written in the chat form ({"messages": [user, assistant]}) so both record
kinds of `data.kind: sft` are exercised. Deterministic (files and functions in sorted order).

  python scripts/make_sft_data.py --out runs/sft.jsonl [--examples 2000] [--max-chars 350]
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sysconfig
from pathlib import Path


def stdlib_sources():
  root = Path(sysconfig.get_paths()["stdlib"])
  skip = ("site-packages", "dist-packages", "__pycache__", "encodings", "test", "tests")
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in skip)
    for name in sorted(filenames):
      if name.endswith(".py"):
        yield Path(dirpath) / name


def examples(max_chars: int):
  """(prompt, response) pairs: a function's header and docstring, and its body."""
  for path in stdlib_sources():
    try:
      source = path.read_text(encoding="utf-8")
      tree = ast.parse(source)
    except (UnicodeDecodeError, SyntaxError, ValueError):
      continue
    lines = source.splitlines(keepends=True)
    for node in ast.walk(tree):
      if not isinstance(node, ast.FunctionDef) or ast.get_docstring(node) is None:
        continue
      doc = node.body[0]
      if len(node.body) < 2 or node.decorator_list:
        continue
      indent = node.col_offset   # methods: dedented to the left margin
      cut = lambda part: "".join("\n" if not l.strip() else l[indent:] if l[:indent].isspace()
                                 else l.lstrip() for l in part)
      prompt = cut(lines[node.lineno - 1:doc.end_lineno])
      response = cut(lines[doc.end_lineno:node.end_lineno])
      if response.strip() and len(prompt) + len(response) <= max_chars:
        yield prompt, response


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, type=Path)
  parser.add_argument("--examples", type=int, default=2000)
  parser.add_argument("--max-chars", type=int, default=350,
                      help="longest example (prompt + response) in characters")
  args = parser.parse_args()
  args.out.parent.mkdir(parents=True, exist_ok=True)
  n = 0
  with open(args.out, "w", encoding="utf-8") as f:
    for prompt, response in examples(args.max_chars):
      if n % 4 == 3:
        record = {"messages": [{"role": "user", "content": prompt},
                               {"role": "assistant", "content": response}]}
      else:
        record = {"prompt": prompt, "response": response}
      f.write(json.dumps(record) + "\n")
      n += 1
      if n == args.examples:
        break
  print(f"wrote {n} examples to {args.out}")


if __name__ == "__main__":
  main()
