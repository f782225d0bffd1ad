"""Kernel micro-benchmarks: quantize, FP8 GEMM, the Adam step, attention, dispatch cost."""
