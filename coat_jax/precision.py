"""The precision modes and compute dtypes: the one definition every layer uses.

Modes (what runs in FP8 inside the decoder blocks; embedding, final norm and LM head stay in the
compute dtype in every mode, as in COAT):
  "bf16":       plain compute-dtype matmuls and saved activations (the baseline);
  "fp8_linear": FP8 GEMMs, activations saved in the compute dtype (TransformerEngine-style);
  "coat":       FP8 GEMMs and FP8 activations saved for the backward, mixed granularity.
"""
from __future__ import annotations

import typing
from typing import Literal

import jax

Precision = Literal["bf16", "fp8_linear", "coat"]
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)
FP8_PRECISIONS: tuple[str, ...] = ("fp8_linear", "coat")

ComputeDtype = Literal["bfloat16", "float32"]
DTYPES: tuple[str, ...] = typing.get_args(ComputeDtype)
AUTO_DTYPE = "auto"


def check_precision(value: str, where: str = "precision") -> str:
  """Returns `value` if it is a precision mode; ValueError naming `where` and the choices if not."""
  if value not in PRECISIONS:
    raise ValueError(f"{where} must be one of {PRECISIONS}, got {value!r}")
  return value


def resolve_dtype(name: str, where: str = "dtype") -> str:
  """A compute dtype name; "auto" is bfloat16 on accelerators and float32 on CPU (slow bf16 there)."""
  if name == AUTO_DTYPE:
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"
  if name not in DTYPES:
    raise ValueError(f"{where} must be one of {DTYPES + (AUTO_DTYPE,)}, got {name!r}")
  return name
