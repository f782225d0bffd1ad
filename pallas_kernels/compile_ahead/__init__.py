"""Preparing kernels off the step's critical path: workers.py (worker processes),
lower_ahead.py (Mosaic GPU lowerings exported in a worker while the step is traced),
compile_triton.py (Triton compiles in a worker), call_triton.py (how a Triton kernel is called)."""
