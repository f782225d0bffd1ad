"""The one dispatch point between Pallas kernels and their jnp references.

The optimizer step's dispatch (`coat_adam_step`, `coat_adam_tree_step`) is coat_jax/kernels_adam.py,
which takes its backend choice from here.

Layers (one way): coat_jax.optim / ops -> this module -> pallas_kernels/* (jax + numpy only,
plain arrays in and out) or the references (coat_jax.quantize, gemm, adam_math). A kernel module
never falls back: this module checks its `supported*` and otherwise calls the reference, and
wraps kernel results in QuantizedArray / ExpandedMoment. Every function here has the signature
and semantics of its reference.

Backend choice: `auto` (default) uses kernels on Hopper GPUs (compute capability 9.x), on one
device or a mesh of them, and the jnp references everywhere else. Force a choice with the
environment variable COAT_JAX_KERNELS (read at import), `set_backend(...)` (process default) or the
`backend(...)` context manager: `auto` | `pallas` | `reference`, or per kernel family, e.g.
`gemm=pallas,quantize=reference` (families: FAMILIES; the rest stay auto), where a family may also
name one of its IMPLEMENTATIONS (`adam=triton`, `quantize=mosaic`). The choice lives in a JAX user
context (`jax.make_user_context`), which is part of jit's cache key: the same jitted function
called under two backends is traced twice, once for each.

Which kernel (`implementation(family)`; `pallas`, and `auto` where AUTO_ON_HOPPER says so):
  gemm        mosaic: Mosaic GPU wgmma TN kernel (fp8_matmul.py) where `tn_operands` maps the
              product; `auto` on one device only. The gate/up GEMM with SwiGLU and the 1 x 16
              quantize in its epilogue (`gemm_swiglu_quantize`, fp8_gemm_swiglu.py): one
              device, bf16 out, M % 256, F % 64, K % 128 == 0
  quantize    mosaic: quantize_mgpu.py. Per group: G a multiple of 16 up to 256, N % G == 0 and
              size / G a multiple of 64. Per tensor: size / 64 a multiple of 64 and N % 64 == 0;
              with the transposed copy ndim >= 2, N and M multiples of 64 and a 16-bit input.
              SwiGLU's h with gate's and up's per-group quantize in one pass (`swiglu_quantize`,
              swiglu_mgpu.py): the per-group shapes. Other shapes: the reference (XLA). FP8
              storage only.
  dequantize  mosaic (per-group arrays, the per-group quantize's shapes); `auto` keeps XLA's
  adam        triton: the jax-triton kernel (adam_step_triton.py) when triton and jax-triton
              import (`pip install coat-jax[gpu]`) and not in interpret mode; otherwise
              pallas_triton (adam_step.py, the deprecated Pallas Triton backend; on a GPU with one
              warning naming what to install). Moments FP8 or INT8 (pallas_triton only), N % G == 0;
              groups along axis -2 (COAT's layout): triton only (pallas_triton: the reference).
Why these (measured speeds): docs/benchmarks.md, "New kernels off the Triton backend".

Meshes: with more than one device, every Pallas call is wrapped by `coat_jax.sharded`
(custom_partitioning): inside a sharded jax.jit each device runs the kernel on its local shard.
The mesh and the operands' shardings come from jit's sharding propagation at partitioning time;
the caller only has to jit with sharded inputs (in_shardings, or arrays placed with
NamedSharding on a mesh with Auto axes, as coat_jax.training.mesh builds). Semantics do not depend on
the mesh: a per-tensor scale is the amax of the whole logical tensor (the stage-1 tile maxima are
local, their max is XLA's global reduction), per-group scales are local and groups never straddle
a shard boundary (a last axis whose shards would split groups is gathered for the kernel), the
per-tensor quantize writes each shard's block of the transposed copy (`sharded.transposing`), and
the optimizer step runs per shard on the local moments. The FP8 GEMM (`sharded.matmul_tn`)
keeps M and N sharded (column-parallel outputs stay sharded) and all-gathers an FSDP weight's
rows as FP8 codes; a contracting axis split over other mesh axes (a row-parallel product, a
weight gradient over the batch shards) stays split: float32 partial products, summed (psum). A shard that a Mosaic GPU quantize kernel does not take goes to the reference
on that shard. In interpret mode (CPU) the Mosaic GPU kernels (GEMM, quantize) are not wrapped
(their ordered callbacks cannot pass custom_partitioning): XLA partitions their interpreted ops
like any others.

Partitioning switch: `auto` (default) wraps the kernels only when jax.device_count() > 1;
`always` takes the sharded path on one device too (the code path of a mesh run: every kernel
through custom_partitioning, the GEMM through `sharded.matmul_tn`), to measure its cost on one
GPU. On one device custom_partitioning lowers its function inline and each kernel gets the whole
array, so `always` runs the single-device kernels: the per-tensor quantize writes the transposed
copy in the same pass (`sharded.transposing`: on a mesh each shard writes its local block of
it). One difference is left: the tree kernel (`adam_tree`, off under `auto`) has no per-shard
wrapper, so a forced `adam_tree=triton` runs per leaf on the sharded path. Set the switch with
COAT_JAX_PARTITIONING (read at import), `set_partitioning(...)` or the `partitioning(...)` context
manager; like the backend it is a JAX user context, part of jit's cache key.
"""
from __future__ import annotations

import functools
import os
import warnings

import jax
import jax.numpy as jnp

from coat_jax import activations, formats, gemm, quantize, sharded
from coat_jax.quantize import QuantizedArray

GEMM_OUT_DTYPES = gemm.OUT_DTYPES   # what `fp8_dot_general` writes directly
_CHOICES = ("auto", "pallas", "reference")
FAMILIES = ("gemm", "quantize", "dequantize", "adam", "adam_tree")
# The kernels a family can name, best first (`pallas` / `auto` take the first that can run here).
IMPLEMENTATIONS = {"gemm": ("mosaic",), "quantize": ("mosaic",), "dequantize": ("mosaic",),
                   "adam": ("triton", "pallas_triton"), "adam_tree": ("triton",)}
INSTALL_HINT = "pip install coat-jax[gpu]"
# What `auto` picks per kernel family on a Hopper GPU (measured: benchmarks/bench_ops.py).
# Dequantize feeds elementwise backward math, which XLA fuses it into: a standalone kernel that
# writes the float32 tensor costs more than it saves. adam_tree: the optimizer step over a whole
# tree in a few launches (jax-triton, `coat_adam_tree_step`); "reference" there keeps the
# per-leaf dispatch of the "adam" family, which `auto` keeps: on the H100 (62 leaves, 1.21e9
# params, benchmarks/bench_optimizer.py, 2026-11-23) the per-leaf jax-triton kernels took 6.81 ms
# of kernel time (7.14 ms pipelined) and the tree kernel 9.01 ms (9.21 ms): one launch saves
# less than its leaf lookup and lost overlap cost. Force it with `adam_tree=triton`.
AUTO_ON_HOPPER = {"gemm": "pallas", "quantize": "pallas", "dequantize": "reference",
                  "adam": "pallas", "adam_tree": "reference"}


def _parse(spec: str) -> tuple[tuple[str, str], ...]:
  """'auto' | 'pallas' | 'reference', or per family: 'gemm=pallas,adam=triton' (rest auto; a
  family takes _CHOICES or one of its IMPLEMENTATIONS) -> ((family, choice), ...) in FAMILIES
  order (hashable: it keys jit's cache)."""
  if not isinstance(spec, str):
    raise ValueError(f"kernel backend must be a string, got {spec!r}")
  spec = spec.strip()
  if spec in _CHOICES:
    return tuple((fam, spec) for fam in FAMILIES)
  out = dict.fromkeys(FAMILIES, "auto")
  for item in spec.split(","):
    fam, _, choice = item.partition("=")
    fam, choice = fam.strip(), choice.strip()
    if fam not in FAMILIES or choice not in _CHOICES + IMPLEMENTATIONS[fam]:
      raise ValueError(f"unknown kernel backend {spec!r}: expected one of {_CHOICES} or "
                       f"'family=choice,...' with families {FAMILIES} and choices {_CHOICES} "
                       f"or the family's kernel {IMPLEMENTATIONS}")
    out[fam] = choice
  return tuple((fam, out[fam]) for fam in FAMILIES)


try:
  _ENV_BACKEND = _parse(os.environ.get("COAT_JAX_KERNELS", "auto"))
except ValueError as e:
  raise ValueError(f"COAT_JAX_KERNELS: {e}") from None

# The current choice, part of jit's cache key (a change re-traces instead of reusing a trace).
_BACKEND = jax.make_user_context(default_value=_ENV_BACKEND)

PARTITIONINGS = ("auto", "always")


def _parse_partitioning(name: str) -> str:
  if name not in PARTITIONINGS:
    raise ValueError(f"unknown kernel partitioning {name!r}: expected one of {PARTITIONINGS}")
  return name


try:
  _ENV_PARTITIONING = _parse_partitioning(os.environ.get("COAT_JAX_PARTITIONING", "auto").strip())
except ValueError as e:
  raise ValueError(f"COAT_JAX_PARTITIONING: {e}") from None

# `auto` | `always` (see the module docstring), also part of jit's cache key.
_PARTITIONING = jax.make_user_context(default_value=_ENV_PARTITIONING)


def set_backend(name: str) -> None:
  """Sets the process-wide backend (see the module docstring for the forms)."""
  _BACKEND.set_global(_parse(name))


def backend(name: str):
  """Context manager: calls (and traces) inside use this backend; jit re-traces for it."""
  return _BACKEND(_parse(name))


def current_backend() -> dict[str, str]:
  """{family: choice} in effect now."""
  return dict(_BACKEND.value)


def set_partitioning(name: str) -> None:
  """Sets the process-wide partitioning: `auto` (wrap on several devices) or `always`."""
  _PARTITIONING.set_global(_parse_partitioning(name))


def partitioning(name: str):
  """Context manager: calls (and traces) inside take the sharded path per `name`."""
  return _PARTITIONING(_parse_partitioning(name))


def current_partitioning() -> str:
  return _PARTITIONING.value


def per_shard() -> bool:
  """True when Pallas calls are wrapped for meshes (coat_jax.sharded): several devices, or
  partitioning `always`."""
  return _PARTITIONING.value == "always" or jax.device_count() > 1


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


@functools.cache
def _triton_available() -> bool:
  """triton and jax-triton import (GPU machines with the `gpu` extra)."""
  from pallas_kernels import adam_step_triton
  return adam_step_triton.available()


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
  if key not in _warned:
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def implementation(family: str) -> str | None:
  """The kernel (one of IMPLEMENTATIONS[family]) this family's calls use now, or None: the
  reference. Shapes a kernel does not take still go to the reference (see the functions)."""
  if family not in FAMILIES:
    raise ValueError(f"unknown kernel family {family!r}; expected one of {FAMILIES}")
  choice = dict(_BACKEND.value)[family]
  if choice == "reference":
    return None
  if choice == "auto" and not (  # on meshes too: `sharded` runs the kernels per shard
      _on_hopper() and AUTO_ON_HOPPER[family] == "pallas"):
    return None
  if choice in IMPLEMENTATIONS[family]:
    return choice
  if family == "adam":
    if _triton_available() and not interpret_mode():
      return "triton"
    if not interpret_mode():
      _warn_once("adam", "coat_jax: jax-triton is not installed, so the fused Adam step uses the "
                 f"deprecated Pallas Triton backend; install it: {INSTALL_HINT}")
    return "pallas_triton"
  return IMPLEMENTATIONS[family][0]


def use_pallas(family: str = "gemm") -> bool:
  """True when calls of this kernel family (one of FAMILIES) go to a kernel."""
  return implementation(family) is not None


def interpret_mode() -> bool:
  """Pallas kernels run in interpret mode when forced on a machine without a GPU (CPU tests)."""
  return jax.default_backend() != "gpu"


def _rows(kernel, args, kinds_in, kinds_out, group_size, group_axis=-1):
  """kernel(*args) on one device; per shard (coat_jax.sharded.rowwise) with several."""
  if not per_shard():
    return tuple(kernel(*args))
  return sharded.rowwise(kernel, args, kinds_in, kinds_out, group_size, group_axis)


def _launch(fn, *args, **kwargs):
  """fn(*args, **kwargs), a Mosaic GPU kernel: on one device its lowering runs in a worker
  process while the step is still traced (pallas_kernels/lower_ahead.py); per shard (lowered
  inside XLA's partitioning) and in interpret mode, here."""
  if interpret_mode():
    return fn(*args, **kwargs)
  _prestart_triton_compiles()
  if per_shard():
    return fn(*args, **kwargs)
  from pallas_kernels import lower_ahead
  return lower_ahead.call(fn, *args, **kwargs)


@functools.cache
def _prestart_triton_compiles() -> None:
  """As the first kernel is traced: start the workers that will compile the optimizer's Triton
  kernels (traced last), so that their start-up overlaps the trace (compile_triton.prestart)."""
  if _triton_available() and implementation("adam") == "triton":
    from pallas_kernels import compile_triton
    compile_triton.prestart()


def _mosaic(kernel, args, kinds_in, kinds_out, group_size):
  """A Mosaic GPU kernel per shard (`_rows`); in interpret mode unwrapped (its ordered callbacks
  cannot pass custom_partitioning: XLA partitions the interpreted ops like any others)."""
  if interpret_mode():
    return tuple(kernel(*args))
  return _rows(kernel, args, kinds_in, kinds_out, group_size)


# The Mosaic GPU row kernels (quantize, tile maxima, dequantize) in interpret mode (CPU tests)
# take the largest blocks (rows_mgpu: 1024 rows; the per-tensor quantize keeps its own, its
# transposing blocks are sized for shared memory) and at most 2 CTAs, as the GEMM's interpret
# default: the interpreter simulates every CTA and block step with host callbacks, so the GPU's
# tuning (128-row blocks, up to 528 CTAs) made a CPU call of a (128, 256) per-group quantize
# ~25x slower (0.64 s vs 0.024 s CPU time). The kernels' own tests cover their other settings.
INTERPRET_ROW_KERNEL = dict(block=1024, max_ctas=2)


def _row_kernel_kw(block: bool = True) -> dict:
  """interpret (and in interpret mode INTERPRET_ROW_KERNEL) for the Mosaic GPU row kernels;
  block=False: max_ctas only (the per-tensor quantize keeps its blocks)."""
  if not interpret_mode():
    return dict(interpret=False)
  return dict(interpret=True, **{k: v for k, v in INTERPRET_ROW_KERNEL.items()
                                 if block or k != "block"})


def quantize_per_tensor(x, fmt="e4m3", *, amax=None, with_transpose=False,
                        floor=formats.ACTIVATION_SCALE_FLOOR,
                        producer_fusion: bool = False) -> QuantizedArray:
  """See `coat_jax.quantize.quantize_per_tensor`.

  Kernel (mosaic, the shapes in the module docstring): stage-1 tile maxima, stage 2 and the scale
  here (`quantize.scale_from_amax`), then the quantize(+transpose) pass; else the reference.
  producer_fusion: always the reference (XLA's ops), which XLA fuses into the op producing x
  (a weight's cast and transpose: one pass, no kernel module to compile; ops.linear_options).
  """
  f = formats.get_format(fmt)
  if (not producer_fusion and implementation("quantize") == "mosaic"
      and f.dtype in formats.fp8_dtypes()):
    from pallas_kernels import quantize_mgpu as qm  # local: keeps Pallas out of reference-only imports.
    if qm.supported_per_tensor(x.shape, x.dtype, with_transpose):
      tile, kw = qm.STAGE1_TILE, dict(out_dtype=f.dtype, fmax=f.max,
                                      **_row_kernel_kw(block=False))

      def stage1(a):   # per shard; a shard the kernel does not take: the reference's maxima
        if qm.supported_per_group(a.shape, a.dtype, tile):
          return (_launch(qm.tile_amax, a, **_row_kernel_kw()),)
        return (quantize.group_amax(a, tile),)

      if amax is None:   # stage 1 per shard; stage 2 (jnp.max, global, propagates NaN) by XLA
        (tiles,) = _mosaic(stage1, [x], ["data"], ["meta"], tile)
        amax = jnp.max(tiles)
      amax = jnp.asarray(amax, jnp.float32)
      scale = quantize.scale_from_amax(amax, f, floor)
      if not per_shard() or interpret_mode():
        data, _, data_t = _launch(qm.quantize_per_tensor, x, scale=scale, floor=floor,
                                  with_transpose=with_transpose, **kw)
      else:   # per shard (a shard the kernel does not take: the reference on that shard)
        def quant(a, am, s):
          if qm.supported_per_tensor(a.shape, a.dtype, False):
            return (qm.quantize_per_tensor(a, scale=s, floor=floor, **kw)[0],)
          return (quantize.quantize_per_tensor(a, f, amax=am, floor=floor).data,)

        def quant_t(a, am, s):   # each shard's codes and their local transpose (its block of
          if qm.supported_per_tensor(a.shape, a.dtype, True):   # data_t), fused when it can
            q, _, q_t = qm.quantize_per_tensor(a, scale=s, floor=floor, with_transpose=True, **kw)
            return q, q_t
          (q,) = quant(a, am, s)
          return q, jnp.swapaxes(q, -1, -2)

        if with_transpose:
          data, data_t = sharded.transposing(quant_t, x, [amax, scale])
        else:
          (data,) = _rows(quant, [x, amax, scale], ["data", "scalar", "scalar"], ["data"], tile)
          data_t = None
      return QuantizedArray(data, scale, f.name, 0, data_t)
  return quantize.quantize_per_tensor(x, f, amax=amax, with_transpose=with_transpose, floor=floor)


def quantize_per_group(x, group_size=formats.ACTIVATION_GROUP_SIZE, fmt="e4m3", *,
                       floor=formats.ACTIVATION_SCALE_FLOOR) -> QuantizedArray:
  """See `coat_jax.quantize.quantize_per_group` (mosaic on the shapes in the module docstring)."""
  f = formats.get_format(fmt)
  if implementation("quantize") == "mosaic" and f.dtype in formats.fp8_dtypes():
    from pallas_kernels import quantize_mgpu as qm
    if qm.supported_per_group(x.shape, x.dtype, group_size):
      def kernel(a):   # per shard; a shard the kernel does not take: the reference
        if qm.supported_per_group(a.shape, a.dtype, group_size):
          return _launch(qm.quantize_per_group, a, group_size=group_size, out_dtype=f.dtype,
                         fmax=f.max, floor=floor, scale_dtype=formats.ACTIVATION_SCALE_DTYPE,
                         **_row_kernel_kw())
        ref = quantize.quantize_per_group(a, group_size, f, floor=floor)
        return ref.data, ref.scale

      data, scale = _mosaic(kernel, [x], ["data"], ["data", "meta"], group_size)
      return QuantizedArray(data, scale, f.name, group_size)
  return quantize.quantize_per_group(x, group_size, f, floor=floor)


def swiglu_quantize(gate, up, group_size=formats.ACTIVATION_GROUP_SIZE, fmt="e4m3", *,
                    floor=formats.ACTIVATION_SCALE_FLOOR):
  """(h, amax, gate_q, up_q): h = silu(gate) * up (`activations.silu_product`), amax = max|h|
  (float32 ()), and gate's and up's per-group quantize (`quantize_per_group`).

  Kernel (the "quantize" family's mosaic: pallas_kernels/swiglu_mgpu.py, shapes as the per-group
  quantize's): one read of gate and up makes all of it, amax from the kernel's per-group maxima;
  else the references (XLA fuses h with its amax; each quantize reads its input again).
  """
  f = formats.get_format(fmt)
  if (implementation("quantize") == "mosaic" and f.dtype in formats.fp8_dtypes()
      and gate.shape == up.shape and gate.dtype == up.dtype):
    from pallas_kernels import swiglu_mgpu as sm
    if sm.supported(gate.shape, gate.dtype, group_size):
      def kernel(g, u):   # per shard; a shard the kernel does not take: the references
        if sm.supported(g.shape, g.dtype, group_size):
          return _launch(sm.swiglu_quantize, g, u, group_size=group_size, out_dtype=f.dtype,
                         fmax=f.max, floor=floor, scale_dtype=formats.ACTIVATION_SCALE_DTYPE,
                         **_row_kernel_kw())
        h = activations.silu_product(g, u)
        gq, uq = (quantize.quantize_per_group(a, group_size, f, floor=floor) for a in (g, u))
        return (h, quantize.group_amax(h, group_size), gq.data, gq.scale, uq.data, uq.scale)

      h, hmax, gd, gs, ud, us = _mosaic(kernel, [gate, up], ["data", "data"],
                                        ["data", "meta", "data", "meta", "data", "meta"],
                                        group_size)
      return (h, jnp.max(hmax), QuantizedArray(gd, gs, f.name, group_size),
              QuantizedArray(ud, us, f.name, group_size))
  h = activations.silu_product(gate, up)
  return (h, jnp.max(jnp.abs(h)).astype(jnp.float32),
          quantize.quantize_per_group(gate, group_size, f, floor=floor),
          quantize.quantize_per_group(up, group_size, f, floor=floor))


def gemm_swiglu_quantize(x: QuantizedArray, w_gate_t: QuantizedArray, w_up_t: QuantizedArray,
                         out_dtype, group_size=formats.ACTIVATION_GROUP_SIZE, fmt="e4m3", *,
                         floor=formats.ACTIVATION_SCALE_FLOOR):
  """`swiglu_quantize(gate, up, group_size, fmt)` of gate = x . W_g and up = x . W_u, each
  `fp8_dot_general(x, w_t, TN, out_dtype)`: (h, amax, gate_q, up_q).

  x: per-tensor FP8 (..., K); w_gate_t, w_up_t: per-tensor FP8 (F, K), the weights' transposed
  codes (the TN layout's right operand). Kernel (the "gemm" family's mosaic, on one device:
  pallas_kernels/fp8_gemm_swiglu.py, bf16 out, G = 16, the shapes its `problem` takes): one
  GEMM over the interleaved weight codes writes h, its 1 x 64 maxima and gate's and up's codes
  from the float32 accumulators; the codes then differ from the reference's, which quantizes
  gate and up rounded to out_dtype first, by at most one code step where that rounding moves a
  value across a rounding boundary. Else the reference: the two GEMMs, then `swiglu_quantize`.
  """
  f = formats.get_format(fmt)
  tn = (((x.data.ndim - 1,), (1,)), ((), ()))
  lead, k, n = x.data.shape[:-1], x.data.shape[-1], w_gate_t.data.shape[0]
  # One device (no per-shard wrapper yet); in interpret mode (CPU tests) XLA partitions the
  # interpreted ops like any others, as for fp8_dot_general.
  if use_pallas("gemm") and (interpret_mode() or not per_shard()):
    from pallas_kernels import fp8_gemm_swiglu as pg
    m = x.data.size // k
    if (pg.problem(m, n, k, out_dtype) is None and group_size == pg.GROUP
        and f.dtype in formats.fp8_dtypes() and x.per_tensor
        and w_up_t.data.shape == (n, k) and w_gate_t.per_tensor and w_up_t.per_tensor):
      scales = jnp.stack([x.scale * w_gate_t.scale, x.scale * w_up_t.scale]).astype(jnp.float32)
      h, hmax, gd, gs, ud, us = _launch(
          pg.fp8_gemm_swiglu, x.data.reshape(m, k), pg.interleave_gate_up(w_gate_t.data,
                                                                          w_up_t.data),
          scales, code_dtype=f.dtype, fmax=f.max, floor=floor,
          scale_dtype=formats.ACTIVATION_SCALE_DTYPE, **_gemm_kernel_kw())
      meta = (*lead, n // group_size)
      return (h.reshape(*lead, n), jnp.max(hmax),
              QuantizedArray(gd.reshape(*lead, n), gs.reshape(meta), f.name, group_size),
              QuantizedArray(ud.reshape(*lead, n), us.reshape(meta), f.name, group_size))
  gate = fp8_dot_general(x, w_gate_t, tn, out_dtype)
  up = fp8_dot_general(x, w_up_t, tn, out_dtype)
  return swiglu_quantize(gate, up, group_size, fmt, floor=floor)


def dequantize(q: QuantizedArray, dtype):
  """See `coat_jax.quantize.dequantize` (mosaic for per-group FP8 arrays of the per-group
  quantize's shapes; per-tensor is XLA's)."""
  out_dtype = jnp.dtype(dtype)
  if (q.group_size > 0 and implementation("dequantize") == "mosaic"
      and jnp.issubdtype(out_dtype, jnp.floating)):
    from pallas_kernels import quantize_mgpu as qm
    if qm.supported_per_group(q.data.shape, q.data.dtype, q.group_size):
      g = q.group_size

      def kernel(d, sc):
        if qm.supported_per_group(d.shape, d.dtype, g):
          return (_launch(qm.dequantize_per_group, d, sc, group_size=g, dtype=out_dtype,
                          **_row_kernel_kw()),)
        return (quantize.dequantize(QuantizedArray(d, sc, q.fmt, g), out_dtype),)

      (out,) = _mosaic(kernel, [q.data, q.scale], ["data", "meta"], ["data"], g)
      return out
  return quantize.dequantize(q, dtype)


def _gemm_kernel_kw() -> dict:
  """interpret and num_ctas for the Mosaic GPU GEMM kernels: interpret mode's parameters on the
  CPU, else None and this device's SM count (passed, so that a worker lowering the kernel
  without a GPU uses it too)."""
  from pallas_kernels import fp8_matmul as pk
  interp = pk.interpret_params(interpret_mode())
  return dict(interpret=interp, num_ctas=None if interp is not None else pk.num_sms())


def fp8_dot_general(a: QuantizedArray, b: QuantizedArray, dimension_numbers, out_dtype):
  """See `coat_jax.gemm.fp8_dot_general_reference`.

  Pallas: the Mosaic GPU wgmma TN kernel (pallas_kernels/fp8_matmul.py) where `tn_operands`
  maps the product to the TN layout (directly or through `data_t`) and the output is bf16/f32;
  every other case uses the reference.
  """
  if not (a.per_tensor and b.per_tensor):
    raise ValueError("fp8_dot_general needs per-tensor quantized operands "
                     f"(got group sizes {a.group_size} and {b.group_size})")
  # Mosaic GPU's interpret mode uses ordered callbacks, which custom_partitioning cannot carry:
  # there (CPU tests) the kernel's interpreted ops are partitioned by XLA like any other ops.
  wrap = per_shard() and not interpret_mode()
  if use_pallas("gemm"):
    from pallas_kernels import fp8_matmul as pk  # local: keeps Pallas out of reference-only imports.
    a2, b2, out_shape, _ = pk.tn_operands(a.data, a.data_t, b.data, b.data_t, dimension_numbers)
    if a2 is not None and jnp.dtype(out_dtype) in pk.OUT_DTYPES:
      scale = a.scale.astype(jnp.float32) * b.scale.astype(jnp.float32)
      kw = _gemm_kernel_kw()
      kernel = lambda x, y, s: _launch(pk.fp8_matmul_tn, x, y, s, out_dtype, **kw)
      if not wrap:
        out = kernel(a2, b2, scale)
      else:
        partial = lambda x, y, s: pk.fp8_matmul_tn(x, y, s, jnp.float32, interpret=kw["interpret"])
        out = sharded.matmul_tn(kernel, a2, b2, scale, partial_kernel=partial)
      return out.reshape(out_shape)
  return gemm.fp8_dot_general_reference(a, b, dimension_numbers, out_dtype)
