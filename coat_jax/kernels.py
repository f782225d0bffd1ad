"""The one dispatch point between Pallas kernels and their jnp references.

`auto` (default) uses the Pallas kernels on a single Hopper GPU (compute capability 9.x; a
`pallas_call` has no sharding rule, so with several devices XLA's ops are used) and the jnp
references everywhere else. Force a choice with the environment variable COAT_JAX_KERNELS,
`set_backend(...)` or the `backend(...)` context manager: `auto` | `pallas` | `reference`, or per
kernel family, e.g. `gemm=pallas,quantize=reference` (families: FAMILIES; the rest stay auto).
Every function here has the signature and semantics of its reference.
"""
from __future__ import annotations

import contextlib
import functools
import os

import jax

from coat_jax import gemm, quantize

_CHOICES = ("auto", "pallas", "reference")
FAMILIES = ("gemm", "quantize", "dequantize", "adam")
# What `auto` picks per kernel family on a Hopper GPU (measured: benchmarks/bench_ops.py).
# Dequantize feeds elementwise backward math, which XLA fuses it into: a standalone kernel that
# writes the float32 tensor costs more than it saves.
AUTO_ON_HOPPER = {"gemm": "pallas", "quantize": "pallas", "dequantize": "reference",
                  "adam": "pallas"}


def _parse(spec: str) -> dict[str, str]:
  """'auto' | 'pallas' | 'reference', or per family: 'gemm=pallas,quantize=reference' (rest auto)."""
  spec = spec.strip()
  if spec in _CHOICES:
    return dict.fromkeys(FAMILIES, spec)
  out = dict.fromkeys(FAMILIES, "auto")
  for item in spec.split(","):
    fam, _, choice = item.partition("=")
    fam, choice = fam.strip(), choice.strip()
    if fam not in FAMILIES or choice not in _CHOICES:
      raise ValueError(f"unknown kernel backend {spec!r}: expected one of {_CHOICES} or "
                       f"'family=choice,...' with families {FAMILIES} and choices {_CHOICES}")
    out[fam] = choice
  return out


try:
  _backend = _parse(os.environ.get("COAT_JAX_KERNELS", "auto"))
except ValueError as e:
  raise ValueError(f"COAT_JAX_KERNELS: {e}") from None


def set_backend(name: str) -> None:
  """Selects the backend for all later calls (at trace time): see `_parse` for the forms."""
  global _backend
  _backend = _parse(name)


@contextlib.contextmanager
def backend(name: str):
  """Context manager form of `set_backend`."""
  global _backend
  old = _backend
  set_backend(name)
  try:
    yield
  finally:
    _backend = old


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


def use_pallas(family: str = "gemm") -> bool:
  """True when calls of this kernel family (one of FAMILIES) go to Pallas."""
  choice = _backend[family]
  if choice == "auto":  # Pallas calls carry no sharding rule: multi-device runs use XLA's ops.
    return _on_hopper() and jax.device_count() == 1 and AUTO_ON_HOPPER[family] == "pallas"
  return choice == "pallas"


def interpret_mode() -> bool:
  """Pallas kernels run in interpret mode when forced on a machine without a GPU (CPU tests)."""
  return jax.default_backend() != "gpu"


def quantize_per_tensor(x, fmt="e4m3", *, amax=None, with_transpose=False):
  """See `coat_jax.quantize.quantize_per_tensor`.

  Pallas: stage-1 tile maxima + quantize(+transpose) pass (pallas_kernels/quantize.py) when the
  last axis is a multiple of 16; other shapes use the reference.
  """
  if use_pallas("quantize"):
    from pallas_kernels import quantize as pk  # local: keeps Pallas out of reference-only imports.
    if pk.supported_per_tensor(x, with_transpose):
      return pk.quantize_per_tensor(x, quantize.get_format(fmt).name, amax=amax,
                                    with_transpose=with_transpose, interpret=interpret_mode())
  return quantize.quantize_per_tensor(x, fmt, amax=amax, with_transpose=with_transpose)


def quantize_per_group(x, group_size=16, fmt="e4m3"):
  """See `coat_jax.quantize.quantize_per_group` (Pallas when the last axis divides by G)."""
  if use_pallas("quantize"):
    from pallas_kernels import quantize as pk
    if pk.supported_per_group(x, group_size):
      return pk.quantize_per_group(x, group_size, quantize.get_format(fmt).name,
                                   interpret=interpret_mode())
  return quantize.quantize_per_group(x, group_size, fmt)


def dequantize(q, dtype):
  """See `coat_jax.quantize.dequantize` (Pallas for per-group arrays; per-tensor is XLA's)."""
  if use_pallas("dequantize") and q.group_size > 0:
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
                   v_format, group_size, expand, expand_min, output="param"):
  """See `coat_jax.optim.adam_step_reference`: (new_param or update, new_m, new_v) for one leaf.

  output: "param" (new param, param.dtype) or "update" (optax's u = -lr * (m/denom + wd*p), in
  grad.dtype; param may then be None: no decay term).
  Pallas: the fused one-pass step (pallas_kernels/adam_step.py) when the last axis is divisible by
  group_size and both moments are ExpandedMoment; otherwise the reference.
  """
  from coat_jax import optim  # local: optim imports optax; kernels stays light.
  kwargs = dict(lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, count=count,
                m_format=m_format, v_format=v_format, group_size=group_size, expand=expand,
                expand_min=expand_min, output=output)
  if use_pallas("adam"):
    from pallas_kernels import adam_step as pk
    if pk.supported(grad if param is None else param, m, v, group_size):
      # fast_math: MUFU approximations (errors ~2^-22, far below FP8 rounding); alias: new param
      # and moments written over the old ones, in place when the caller donates them (a jitted
      # train step with donated state does). On the H100 (one 1.21e9 leaf) the pair took the
      # step from 17.4 to 7.1 ms (benchmarks/sweep_adam_kernel.py).
      return pk.adam_step(param, grad, m, v, interpret=interpret_mode(), fast_math=True,
                          alias=True, **kwargs)
  return optim.adam_step_reference(param, grad, m, v, **kwargs)
