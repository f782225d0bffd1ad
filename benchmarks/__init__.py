"""Benchmarks and studies, one script per claim (benchmarks/README.md): run each from the
repository root as `python -m benchmarks.KIND.SCRIPT`."""
