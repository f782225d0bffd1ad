"""FP8 quantize kernels on Mosaic GPU: quantize_mgpu.py (per tensor, per group, tile maxima,
dequantize), swiglu_mgpu.py (SwiGLU with its inputs' per-group quantize) over rows_mgpu.py (the
pipelined row launcher)."""
