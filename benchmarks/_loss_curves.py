"""Eval-loss curves of several modes side by side (accuracy.py, accuracy/seeds.py)."""
from __future__ import annotations

BASE = "bf16+adamw"


def compare(curves: dict[str, dict]) -> dict:
  """Eval losses at the steps all modes share, and the relative gap of each mode vs bf16+adamw."""
  modes = [m for m in curves if curves[m].get("eval")]
  if not modes:
    return {"steps": [], "modes": [], "final_step": None, "final_gap": {}}
  evals = {m: dict((int(s), v) for s, v in curves[m]["eval"]) for m in modes}
  steps = sorted(set.intersection(*(set(e) for e in evals.values())))
  table = {m: [evals[m][s] for s in steps] for m in modes}
  base = BASE if BASE in modes else None
  gaps = {}
  if base:
    for m in modes:
      if m != base:
        gaps[m] = [(a - b) / b if b else None for a, b in zip(table[m], table[base])]
  final = steps[-1] if steps else None
  return {"steps": steps, "modes": modes, "eval": table, "rel_gap": gaps, "final_step": final,
          "final_gap": {m: g[-1] for m, g in gaps.items() if g}}
