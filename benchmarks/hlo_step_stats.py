"""Static cost of one compiled train step, from its optimized HLO: ops and bytes per step.

Builds the train step as bench_e2e does (`coat_jax.training.build`), compiles it on the local
backend and walks the optimized HLO module: the entry computation and, recursively, every while
loop's body (counted `known_trip_count` times: the scan over layers runs num_layers times).
Per step it counts the top-level instructions (each is a kernel or a copy on a GPU; bitcasts,
tuples, get-tuple-elements, parameters and constants are free) and the bytes they write, by
class: copies, dynamic-update-slices (stand-alone, or fusions whose root is one: in place),
dynamic-slices, transposes, converts, dots / custom calls, other fusions. It also lists what the
forward scan stacks for the backward (the scan's per-layer residuals, from the jaxpr).

  JAX_PLATFORMS=cpu python benchmarks/hlo_step_stats.py --preset tiny --seq-len 128 --batch 2 \
      --set model.num_layers=4 --set model.dtype=bfloat16
  (about 1 min on 2 CPU cores; `--variants coat:scan,coat:loop,...`; `--set model.scan_unroll=2`)
"""
from __future__ import annotations

import argparse

from _hlo import build_step, scan_residuals, step_stats


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--preset", default="tiny")
  p.add_argument("--seq-len", type=int, default=128)
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--variants", default="bf16:scan,bf16:loop,coat:scan,coat:loop",
                 help="comma-separated precision:layout (layout scan | loop)")
  p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--dump", default=None, help="write each optimized HLO module under this folder")
  a = p.parse_args(argv)
  import os
  import time

  results = {}
  for variant in a.variants.split(","):
    precision, layout = variant.split(":")
    t0 = time.perf_counter()
    compiled, step, args, _ = build_step(a.preset, precision, layout, a.seq_len, a.batch, a.sets)
    text = compiled.as_text()
    if a.dump:
      os.makedirs(a.dump, exist_ok=True)
      with open(os.path.join(a.dump, f"{precision}_{layout}.hlo.txt"), "w") as f:
        f.write(text)
    results[variant] = step_stats(text)
    res = scan_residuals(step, *args)
    print(f"\n== {variant}: compiled in {time.perf_counter() - t0:.1f} s")
    for length, nbytes, avals in res:
      print(f"  scan length {length}: {len(avals)} stacked outputs, {nbytes / 1e6:.2f} MB: "
            + ", ".join(f"{d}{list(s)}" for s, d in avals[:40]))
  classes = sorted({c for s in results.values() for c in s})
  head = f"{'class':32}" + "".join(f"{v:>24}" for v in results)
  print("\nper step: ops (MB written)\n" + head + "\n" + "-" * len(head))
  for c in classes:
    cells = [results[v].get(c, [0, 0]) for v in results]
    print(f"{c:32}" + "".join(f"{n:>11} ({b / 1e6:9.2f})" for n, b in cells))
  tot = {v: [sum(x[0] for k, x in s.items() if not k.startswith("while")),
             sum(x[1] for k, x in s.items() if not k.startswith("while"))]
         for v, s in results.items()}
  print(f"{'TOTAL (kernels)':32}" + "".join(f"{n:>11} ({b / 1e6:9.2f})" for n, b in tot.values()))
  return results


if __name__ == "__main__":
  main()
