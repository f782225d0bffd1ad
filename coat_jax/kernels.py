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
  """See `coat_jax.quantize.quantize_per_tensor`.

  Pallas: stage-1 tile maxima + quantize(+transpose) pass (pallas_kernels/quantize.py) when the
  last axis is a multiple of 16; other shapes use the reference.
  """
  if use_pallas():
    from pallas_kernels import quantize as pk  # local: keeps Pallas out of reference-only imports.
    if pk.supported_per_tensor(x, with_transpose):
      return pk.quantize_per_tensor(x, quantize.get_format(fmt).name, amax=amax,
                                    with_transpose=with_transpose, interpret=interpret_mode())
  return quantize.quantize_per_tensor(x, fmt, amax=amax, with_transpose=with_transpose)


def quantize_per_group(x, group_size=16, fmt="e4m3"):
  """See `coat_jax.quantize.quantize_per_group` (Pallas when the last axis divides by G)."""
  if use_pallas():
    from pallas_kernels import quantize as pk
    if pk.supported_per_group(x, group_size):
      return pk.quantize_per_group(x, group_size, quantize.get_format(fmt).name,
                                   interpret=interpret_mode())
  return quantize.quantize_per_group(x, group_size, fmt)


def dequantize(q, dtype):
  """See `coat_jax.quantize.dequantize` (Pallas for per-group arrays; per-tensor is XLA's)."""
  if use_pallas() and q.group_size > 0:
    from pallas_kernels import quantize as pk
    if pk.supported_per_group(q.data, q.group_size):
      return pk.dequantize_per_group(q, dtype, interpret=interpret_mode())
  return quantize.dequantize(q, dtype)


def fp8_dot_general(a, b, dimension_numbers, out_dtype):
  """See `coat_jax.gemm.fp8_dot_general_reference`.

  Pallas: the Mosaic GPU wgmma TN kernel (pallas_kernels/fp8_matmul.py) where the operands reach
  the TN layout (directly or through `data_t`); other cases fall back to the reference inside.
  """
  if use_pallas():
    from pallas_kernels import fp8_matmul  # local: keeps Pallas out of reference-only imports.
    return fp8_matmul.fp8_dot_general(a, b, dimension_numbers, out_dtype,
                                      interpret=interpret_mode())
  return gemm.fp8_dot_general_reference(a, b, dimension_numbers, out_dtype)


def coat_adam_step(param, grad, m, v, *, lr, b1, b2, eps, weight_decay, count, m_format,
                   v_format, group_size, expand, expand_min):
  """See `coat_jax.optim.adam_step_reference`: (new_param, new_m, new_v) for one leaf.

  Pallas: the fused one-pass step (pallas_kernels/adam_step.py) when the last axis is divisible by
  group_size and both moments are ExpandedMoment; otherwise the reference.
  """
  from coat_jax import optim  # local: optim imports optax; kernels stays light.
  kwargs = dict(lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, count=count,
                m_format=m_format, v_format=v_format, group_size=group_size, expand=expand,
                expand_min=expand_min)
  if use_pallas():
    from pallas_kernels import adam_step as pk
    if pk.supported(param, m, v, group_size):
      return pk.adam_step(param, grad, m, v, interpret=interpret_mode(), **kwargs)
  return optim.adam_step_reference(param, grad, m, v, **kwargs)

