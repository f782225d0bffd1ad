"""FP8 GEMMs on Mosaic GPU: fp8_matmul.py (the wgmma TN kernel) and fp8_gemm_swiglu.py (the
gate/up GEMM with SwiGLU and the 1 x 16 quantize in its epilogue)."""
