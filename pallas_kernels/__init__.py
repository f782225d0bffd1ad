"""The kernels: a leaf that imports only jax, numpy and the standard library (and triton /
jax-triton in `*_triton.py`), never coat_jax. Plain arrays in and out; a kernel never falls back
(the dispatch, coat_jax.kernels, checks what a kernel takes and otherwise calls the reference).

  gemm/           FP8 GEMMs on Mosaic GPU (wgmma): the TN GEMM, the gate/up GEMM with SwiGLU and
                  the 1 x 16 quantize in its epilogue
  quantize/       FP8 quantize / dequantize on Mosaic GPU: per tensor (with its transposed copy),
                  per group, SwiGLU's h with gate's and up's quantize; the shared row pipeline
  adam/           the fused COAT AdamW step on FP8 moments, in Triton, called through jax-triton
  compile_ahead/  how the kernels are prepared off the step's critical path: worker processes,
                  Mosaic GPU lowerings exported ahead, Triton compiles ahead, the Triton call
"""
