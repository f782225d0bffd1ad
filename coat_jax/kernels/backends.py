"""Which implementation a kernel family runs, and how a kernel call is launched.

The choice is a `KernelConfig` (frozen, hashable): `backend` is `auto` | `pallas` | `reference`,
or per kernel family, e.g. `gemm=pallas,quantize=reference` (families: FAMILIES; the others stay
`auto`), where a family may also name one of its IMPLEMENTATIONS (`adam=triton`,
`quantize=mosaic`); `partitioning` is `auto` (kernels wrapped per shard when
jax.device_count() > 1) or `always` (the sharded path on one device too: the code path of a mesh
run, to measure its cost on one GPU). A field left None keeps the surrounding choice (outside
any: `auto`). `use(config)` makes it current for the calls, and the traces, inside (a context
manager, or a decorator of the function to be jitted); `backend(spec)` and `partitioning(name)`
are its shorthands. The current choice lives in JAX user contexts (`jax.make_user_context`),
which are part of jit's cache key: the same jitted function called under two choices is traced
twice, once for each. The run config's `kernels:` section is a KernelConfig
(coat_jax.training.build traces its steps inside `use`).

`auto` uses the kernels on Hopper GPUs (compute capability 9.x), on one device or a mesh, where
AUTO_ON_HOPPER says so, and the jnp references everywhere else.

One environment variable, for debugging: COAT_JAX_KERNELS (a backend spec) overrides every
KernelConfig's backend in the process, e.g. COAT_JAX_KERNELS=reference python train.py ...;
a bad value is a ValueError of one line when the first kernel family is asked.

Imports no kernel family: the family modules (gemm.py, quantize.py, adam.py) ask `implementation`
and launch their kernels through `rows` (per shard, sharded.py) and `launch` (lowered ahead,
pallas_kernels.compile_ahead).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import warnings

import jax

from coat_jax.kernels import sharded

CHOICES = ("auto", "pallas", "reference")
FAMILIES = ("gemm", "quantize", "dequantize", "adam")
# The kernels a family can name, best first (`pallas` / `auto` take the first that can run here).
IMPLEMENTATIONS = {"gemm": ("mosaic",), "quantize": ("mosaic",), "dequantize": ("mosaic",),
                   "adam": ("triton",)}
INSTALL_HINT = "pip install coat-jax[gpu]"
# What `auto` picks per kernel family on a Hopper GPU (measured: benchmarks/layer/bench_ops.py).
# Dequantize feeds elementwise backward math, which XLA fuses it into: a standalone kernel that
# writes the float32 tensor costs more than it saves.
AUTO_ON_HOPPER = {"gemm": "pallas", "quantize": "pallas", "dequantize": "reference",
                  "adam": "pallas"}
PARTITIONINGS = ("auto", "always")
ENV = "COAT_JAX_KERNELS"


def parse_backend(spec: str) -> tuple[tuple[str, str], ...]:
  """'auto' | 'pallas' | 'reference', or per family: 'gemm=pallas,adam=triton' (rest auto; a
  family takes CHOICES or one of its IMPLEMENTATIONS) -> ((family, choice), ...) in FAMILIES
  order (hashable: it keys jit's cache). ValueError of one line otherwise."""
  if not isinstance(spec, str):
    raise ValueError(f"kernel backend must be a string, got {spec!r}")
  spec = spec.strip()
  if spec in CHOICES:
    return tuple((fam, spec) for fam in FAMILIES)
  out = dict.fromkeys(FAMILIES, "auto")
  for item in spec.split(","):
    fam, _, choice = item.partition("=")
    fam, choice = fam.strip(), choice.strip()
    if fam not in FAMILIES or choice not in CHOICES + IMPLEMENTATIONS[fam]:
      raise ValueError(f"unknown kernel backend {spec!r}: expected one of {CHOICES} or "
                       f"'family=choice,...' with families {FAMILIES} and choices {CHOICES} "
                       f"or the family's kernel {IMPLEMENTATIONS}")
    out[fam] = choice
  return tuple((fam, out[fam]) for fam in FAMILIES)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Which kernels run (see the module docstring): `backend` a spec for `parse_backend`,
  `partitioning` one of PARTITIONINGS; None keeps the surrounding choice. Checked when made
  (ValueError naming the field)."""
  backend: str | None = None
  partitioning: str | None = None

  def __post_init__(self):
    try:
      if self.backend is not None:
        parse_backend(self.backend)
    except ValueError as e:
      raise ValueError(f"kernels.backend: {e}") from None
    if self.partitioning is not None and self.partitioning not in PARTITIONINGS:
      raise ValueError(f"kernels.partitioning must be one of {PARTITIONINGS}, "
                       f"got {self.partitioning!r}")


# The current choice, part of jit's cache key (a change re-traces instead of reusing a trace).
_BACKEND = jax.make_user_context(default_value=parse_backend("auto"))
_PARTITIONING = jax.make_user_context(default_value="auto")


@contextlib.contextmanager
def use(config: KernelConfig):
  """Context manager (or decorator): calls and traces inside use `config`'s kernels."""
  if not isinstance(config, KernelConfig):
    raise TypeError(f"kernels.use takes a KernelConfig, got {type(config).__name__}")
  with contextlib.ExitStack() as stack:
    if config.backend is not None:
      stack.enter_context(_BACKEND(parse_backend(config.backend)))
    if config.partitioning is not None:
      stack.enter_context(_PARTITIONING(config.partitioning))
    yield


def backend(spec: str):
  """Context manager: calls (and traces) inside use this backend (`use` with only `backend`)."""
  return _BACKEND(parse_backend(spec))


def partitioning(name: str):
  """Context manager: calls (and traces) inside take the sharded path per `name`."""
  if name not in PARTITIONINGS:
    raise ValueError(f"unknown kernel partitioning {name!r}: expected one of {PARTITIONINGS}")
  return _PARTITIONING(name)


@functools.cache
def _env_backend(value: str) -> tuple[tuple[str, str], ...]:
  try:
    return parse_backend(value)
  except ValueError as e:
    raise ValueError(f"{ENV}: {e}") from None


def current_backend() -> dict[str, str]:
  """{family: choice} in effect now (COAT_JAX_KERNELS, where set, over the context's)."""
  env = os.environ.get(ENV)
  return dict(_env_backend(env) if env else _BACKEND.value)


def current_partitioning() -> str:
  return _PARTITIONING.value


def per_shard() -> bool:
  """True when kernel calls are wrapped for meshes (`rows`, sharded.py): several devices, or
  partitioning `always`."""
  return _PARTITIONING.value == "always" or jax.device_count() > 1


@functools.cache
def on_hopper() -> bool:
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  if dev.platform != "gpu":
    return False
  return str(getattr(dev, "compute_capability", "")).startswith("9")


@functools.cache
def triton_available() -> bool:
  """triton and jax-triton import (GPU machines with the `gpu` extra)."""
  from pallas_kernels.adam import adam_step_triton
  return adam_step_triton.available()


def interpret_mode() -> bool:
  """Pallas kernels run in interpret mode when forced on a machine without a GPU (CPU tests)."""
  return jax.default_backend() != "gpu"


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
  """One RuntimeWarning per key and process."""
  if key not in _warned:
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def implementation(family: str) -> str | None:
  """The kernel (one of IMPLEMENTATIONS[family]) this family's calls use now, or None: the
  reference. Shapes a kernel does not take still go to the reference (the family modules check).
  The Adam kernel needs jax-triton: without it, on a GPU, the optimizer takes the reference with
  one warning naming the install."""
  if family not in FAMILIES:
    raise ValueError(f"unknown kernel family {family!r}; expected one of {FAMILIES}")
  choice = current_backend()[family]
  if choice == "reference":
    return None
  if choice == "auto" and not (  # on meshes too: `rows` runs the kernels per shard
      on_hopper() and AUTO_ON_HOPPER[family] == "pallas"):
    return None
  if choice in IMPLEMENTATIONS[family]:
    return choice
  if family == "adam":
    if interpret_mode():   # jax-triton cannot run on the CPU
      return None
    if not triton_available():
      warn_once("adam", "coat_jax: jax-triton is not installed, so the optimizer step runs the "
                f"jnp reference instead of the fused Adam kernel; install it: {INSTALL_HINT}")
      return None
  return IMPLEMENTATIONS[family][0]


def use_pallas(family: str = "gemm") -> bool:
  """True when calls of this kernel family (one of FAMILIES) go to a kernel."""
  return implementation(family) is not None


def rows(kernel, args, kinds_in, kinds_out, group_size, group_axis=-1):
  """kernel(*args) on one device; per shard (sharded.rowwise) when `per_shard()`."""
  if not per_shard():
    return tuple(kernel(*args))
  return sharded.rowwise(kernel, args, kinds_in, kinds_out, group_size, group_axis)


def launch(fn, *args, **kwargs):
  """fn(*args, **kwargs), a Mosaic GPU kernel: on one device its lowering runs in a worker
  process while the step is still traced (pallas_kernels.compile_ahead.lower_ahead); per shard
  (lowered inside XLA's partitioning) and in interpret mode, here."""
  if interpret_mode():
    return fn(*args, **kwargs)
  _prestart_triton_compiles()
  if per_shard():
    return fn(*args, **kwargs)
  from pallas_kernels.compile_ahead import lower_ahead
  return lower_ahead.call(fn, *args, **kwargs)


def prestart_compiles(mosaic: bool = True, triton: bool = True) -> None:
  """Start now, under the current KernelConfig, the worker processes that the kernels of a step
  about to be built will use, so that their start-up and imports overlap the model's
  construction instead of the step's trace: the Mosaic GPU kernels' export workers on one device
  (`mosaic`: the model runs FP8 kernels; pallas_kernels.compile_ahead.lower_ahead) and the
  optimizer's Triton compile workers (`triton`: it runs the fused Adam kernel). Nothing in
  interpret mode or for a family that runs its reference here. The training build calls it."""
  if interpret_mode():
    return
  if mosaic and not per_shard() and any(
      implementation(f) == "mosaic" for f in ("gemm", "quantize")):
    from pallas_kernels.compile_ahead import lower_ahead
    lower_ahead.prestart()
  if triton:
    _prestart_triton_compiles()


@functools.cache
def _prestart_triton_compiles() -> None:
  """As the first kernel is traced: start the workers that will compile the optimizer's Triton
  kernels (traced last), so that their start-up overlaps the trace (compile_triton.prestart)."""
  if implementation("adam") == "triton" and triton_available():
    from pallas_kernels.compile_ahead import compile_triton
    compile_triton.prestart()
