"""All kernel benchmarks in one run (GPU): quantize bandwidth, FP8 GEMM, fused Adam step.

Runs, one after another, each printing its table:
  1. benchmarks/bench_kernels_mgpu.py     Mosaic GPU quantize / dequantize kernels and the Adam
                                          steps vs baselines and a measured device copy
  2. benchmarks/bench_kernels_gemm.py     Pallas FP8 GEMM vs XLA FP8 (cuBLASLt) and XLA bf16,
                                          M=N=K in {4096, 8192} and the 7B layer's GEMM shapes
  3. benchmarks/sweep_adam_kernel.py      fused COAT Adam step vs optax.adamw on 1.21e9 params
                                          (--quick: the shipped setting and its ablations)

  python3 benchmarks/bench_kernels.py                 # all three
  python3 benchmarks/bench_kernels.py --only gemm,adam
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PARTS = {
    "memory": ["bench_kernels_mgpu.py"],
    "gemm": ["bench_kernels_gemm.py", "--shapes", "all"],
    "adam": ["sweep_adam_kernel.py", "--quick"],
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", default=",".join(PARTS),
                      help=f"comma-separated subset of {', '.join(PARTS)}")
  args = parser.parse_args(argv)
  names = [n for n in args.only.split(",") if n]
  unknown = sorted(set(names) - set(PARTS))
  if unknown:
    parser.error(f"--only: unknown part(s) {unknown}; choose from {list(PARTS)}")
  failed = []
  for name in names:
    script, *rest = PARTS[name]
    print(f"\n##### {name}: {script} {' '.join(rest)}", flush=True)
    if subprocess.call([sys.executable, str(HERE / script), *rest], cwd=HERE.parent) != 0:
      failed.append(name)
  if failed:
    print(f"failed: {', '.join(failed)}", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
