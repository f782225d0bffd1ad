"""Pieces the benchmark scripts share (benchmarks/ is on sys.path when they run as scripts)."""
from __future__ import annotations

import argparse
from collections.abc import Sequence


def parse_modes(parser: argparse.ArgumentParser, text: str, choices: Sequence[str],
                extra: Sequence[str] = ()) -> list[str]:
  """The comma-separated `--modes` value as a list; exits through `parser.error` naming any mode
  (of the list or of `extra`) not in `choices`."""
  modes = [m.strip() for m in text.split(",") if m.strip()]
  bad = [m for m in [*modes, *extra] if m not in choices]
  if bad:
    parser.error(f"unknown modes {bad}; choose from {tuple(choices)}")
  return modes
