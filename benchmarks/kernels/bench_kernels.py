"""All kernel benchmarks in one run (GPU): quantize bandwidth, FP8 GEMM, fused Adam step.

Runs, one after another, each printing its table:
  memory  bench_kernels_mgpu.py --only per_group,...  Mosaic GPU quantize / dequantize kernels
                                                      vs XLA's references and a device copy
  gemm    bench_kernels_gemm.py --shapes all          Pallas FP8 GEMM vs XLA FP8 (cuBLASLt) and
                                                      XLA bf16, M=N=K in {4096, 8192} and the
                                                      7B layer's GEMM shapes
  adam    bench_kernels_mgpu.py --only adam           the jax-triton Adam step vs XLA's
                                                      reference step and a device copy

  python3 -m benchmarks.kernels.bench_kernels                 # all three
  python3 -m benchmarks.kernels.bench_kernels --only gemm,adam
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PARTS = {
    "memory": ["bench_kernels_mgpu.py", "--only",
               "per_group,tile_amax,dequantize,per_tensor,per_tensor_t"],
    "gemm": ["bench_kernels_gemm.py", "--shapes", "all"],
    "adam": ["bench_kernels_mgpu.py", "--only", "adam"],
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
    module = f"benchmarks.kernels.{Path(script).stem}"
    if subprocess.call([sys.executable, "-m", module, *rest], cwd=REPO) != 0:
      failed.append(name)
  if failed:
    print(f"failed: {', '.join(failed)}", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
