"""How this project's Triton kernels reach XLA: `triton_call` is `jax_triton.triton_call` (the
kernel lowered to jax-triton's custom call) with the kernel's compile started in a worker process
as the call is traced (compile_triton.py); `register` routes jax-triton's compile through
compile_triton's cache once, at import.

Imports jax, and jax-triton where installed (GPU machines).
"""
from __future__ import annotations

from pallas_kernels.compile_ahead import compile_triton

try:  # GPU machines only
  from jax_triton import triton_lib
except ImportError:  # pragma: no cover - CPU machines
  triton_lib = None


def available() -> bool:
  """True when jax-triton imports (GPU machines with the `gpu` extra)."""
  return triton_lib is not None


def triton_call(*args, kernel, **kwargs):
  """`jax_triton.triton_call`, its kernel's compile started in a worker process as it is traced
  (`compile_triton.start`, MODE "process")."""
  if triton_lib is None:
    raise ValueError("call_triton.triton_call: jax-triton is not installed (GPU machines only)")
  compile_triton.start(triton_lib.triton_call, kernel, args, kwargs)
  return triton_lib.triton_call(*args, kernel=kernel, **kwargs)


def register():
  """Route jax-triton's compile through `compile_triton.get_or_create` (idempotent; GPU
  machines)."""
  if triton_lib is None or getattr(register, "done", False):
    return
  compile_triton.install()
  register.done = True


register()
