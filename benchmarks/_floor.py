"""The FLOPs and bytes of a train step and of one decoder layer, counted on the CPU from the traced
step, and their floors at a GPU's peaks (`_common.GPU_PEAKS`); benchmarks/step/step_floor.py
prints them.

The step is train.py's (`_hlo.step_config`: layers unrolled, bf16 compute, then the --set
overrides: remat, microbatches, ...), traced with `jax.make_jaxpr` on abstract arrays (nothing is
allocated or computed), the kernel dispatch binding the kernels as on one Hopper GPU
(`_signatures.as_if_on_hopper`), so that the jaxpr holds the GPU step's calls:

  FP8 GEMM   2 M N K of every Mosaic GPU GEMM call, its operands as padded to its tiles (the
             plain TN GEMM and the gate/up GEMM with SwiGLU in its epilogue; or of the FP8
             dot_general where a shape takes the reference), at the FP8 dense peak
  bf16 GEMM  2 M N K (x batch) of every dot_general outside the kernels and the attention (the
             bf16 step's linears, both steps' LM head), at the bf16 dense peak
  attention  causal flash attention, 2 B H S^2 Dh a forward (QK^T and PV, half the square), 2.5x
             that backward (S recomputed, dV, dP, dQ, dK), at the bf16 dense peak. Its bytes:
             q, k, v read and o written a forward; q, k, v, o, dO read and dq, dk, dv written
             backward (the softmax statistics, Dh/2 times smaller, left out)
  quantize   the bytes every quantize kernel call reads and writes (its operands and results),
             at the HBM bandwidth; the amax passes XLA fuses into the producers are not in it
  GEMM bytes every GEMM's operands and results as the jaxpr types them (FP8 codes and scales in,
             bf16 out for the kernels), at the HBM bandwidth
  optimizer  the bytes of the optimizer state, parameters and gradients read and written once
             (parameters, m, v and their scales read and written, gradients read)

Remat (`--set model.remat=full`, or any policy but none): the GEMMs are counted as the traced
step runs them, the recompute included, which JAX trims to what the backward needs (the MLP's
down projection and the LM head are not run again: 8 T N less 2 T x the down projection's
weights, not 8 T N); the attention, which every policy recomputes, counts one more forward. So
does `model.attention_residuals=fp8` (the backward recomputes it from the FP8 copies).
Microbatches (`optimizer.accumulate`): the scan over them is counted `accumulate` times (the
weights are quantized once per microbatch); the optimizer once.

Elementwise XLA fusions (norms, RoPE, residual adds, the loss, casts) are not counted: the byte
floor is what the kernels above must move at least. A row's floor is the larger of its compute
floor (FLOPs at the dense peaks) and its byte floor (bytes at the bandwidth).
The per-layer counts come from tracing 1 and 2 layers of the preset's width (the difference is one
layer; the rest is the embedding, final norm, LM head and loss), scaled to the preset's depth:
each trace takes about a second of CPU, whatever the width.
"""
from __future__ import annotations

import collections
import functools
import math

from benchmarks._common import OPTIMIZER_SHAPES
from benchmarks._hlo import step_config
from benchmarks._signatures import as_if_on_hopper, is_kernel, kernel_name, signature_backend

GEMM_KERNELS = ("coat_fp8_gemm",)           # prefix of the Mosaic GPU GEMM kernels' names
QUANTIZE_KERNELS = ("quantiz", "swiglu", "amax")
CATEGORIES = ("FP8 GEMM", "bf16 GEMM", "attention", "quantize", "optimizer")
# category -> (count key, peak key): the FLOPs at a dense peak, the bytes at the bandwidth
COMPUTE = {"FP8 GEMM": ("FP8 GEMM flops", "fp8_flops"),
           "bf16 GEMM": ("bf16 GEMM flops", "bf16_flops"),
           "attention": ("attention flops", "bf16_flops")}
BYTES = {"GEMM operands": "GEMM bytes", "attention": "attention bytes",
         "quantize": "quantize bytes", "optimizer": "optimizer bytes"}

# The optimizer step that benchmarks/step/bench_optimizer.py times.
OPTIMIZER_PARAMS = sum(math.prod(s) for s in OPTIMIZER_SHAPES)


def _nbytes(avals) -> int:
  import numpy as np
  return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in avals)


def _io_bytes(eqn) -> int:
  return _nbytes(v.aval for v in eqn.invars) + _nbytes(v.aval for v in eqn.outvars)


def _dot_flops(eqn) -> int:
  (lc, _), _ = eqn.params["dimension_numbers"]
  a = eqn.invars[0].aval
  out = eqn.outvars[0].aval
  return 2 * math.prod(out.shape) * math.prod(a.shape[d] for d in lc)


def count(jaxpr, out=None, times=1) -> collections.Counter:
  """{"FP8 GEMM flops", "bf16 GEMM flops", "GEMM bytes", "quantize bytes", "kernels"} of a jaxpr
  run `times` times, recursively (a scan's body `length` times; a kernel's own body is not
  entered; dot_generals with batch dimensions, the attention's reference on the CPU, are left
  out: the attention is counted from the shapes). A while loop (trip count unknown) is an error."""
  from jax.extend.core import jaxprs_in_params

  out = collections.Counter() if out is None else out
  for eqn in jaxpr.eqns:
    if is_kernel(eqn):
      name = kernel_name(eqn.params)
      out["kernels"] += times
      if name.startswith(GEMM_KERNELS):
        a, b = (v.aval for v in eqn.invars[:2])      # (M, K) and (N, K) codes
        out["FP8 GEMM flops"] += times * 2 * a.shape[0] * b.shape[0] * a.shape[1]
        out["GEMM bytes"] += times * _io_bytes(eqn)
      elif any(k in name for k in QUANTIZE_KERNELS):
        out["quantize bytes"] += times * _io_bytes(eqn)
      continue
    if eqn.primitive.name == "dot_general":
      (_, _), (lb, _) = eqn.params["dimension_numbers"]
      fp8 = any("float8" in str(v.aval.dtype) for v in eqn.invars)   # the GEMM's reference
      if fp8 or not lb:
        out["FP8 GEMM flops" if fp8 else "bf16 GEMM flops"] += times * _dot_flops(eqn)
        out["GEMM bytes"] += times * _io_bytes(eqn)
      continue
    if eqn.primitive.name == "while":
      raise ValueError("step_floor: a while loop in the step (its trip count is unknown); trace "
                       "with the layers unrolled")
    inner = times * eqn.params["length"] if eqn.primitive.name == "scan" else times
    for sub in jaxprs_in_params(eqn.params):
      count(sub, out, inner)
  return out


def run_config(preset, precision, seq_len, batch, sets, layers=None):
  """The benchmarks' step config (`_hlo.step_config`), layers unrolled, bf16 compute (what
  `model.dtype=auto` picks on the GPU), cut to `layers` layers if given."""
  depth = [f"model.num_layers={layers}"] if layers else []
  return step_config(preset, precision, "loop", seq_len, batch,
                     ["model.dtype=bfloat16", *sets, *depth])


def llama_config(preset, seq_len, batch, sets, precision="bf16"):
  from coat_jax.training.build import model_config
  return model_config(run_config(preset, precision, seq_len, batch, sets), None)


@functools.lru_cache(maxsize=None)
def _trace_counts(preset, precision, layers, seq_len, batch, sets) -> collections.Counter:
  import jax
  import numpy as np

  from coat_jax import kernels
  from coat_jax.training import mesh as mesh_lib
  from coat_jax.training.build import build

  cfg = run_config(preset, precision, seq_len, batch, list(sets), layers)
  built = build(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()[:1]), seed=0)
  tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), np.int32)
  with as_if_on_hopper(), kernels.backend(signature_backend(None)):
    jaxpr = jax.make_jaxpr(built.train_step)(*built.abstract_state(), tokens)
  return count(jaxpr.jaxpr)


def trace_counts(preset, precision, layers, seq_len, batch, sets) -> collections.Counter:
  """count() of the train step of `preset` cut to `layers` unrolled layers (cached)."""
  return collections.Counter(_trace_counts(preset, precision, layers, seq_len, batch, tuple(sets)))


def attention_counts(m, seq_len, batch) -> dict:
  """{"attention flops", "attention bytes"} of one layer's causal attention, forward + backward,
  with one more forward under remat and with FP8 residuals (module docstring)."""
  forwards = 1 + (m.remat != "none") + (m.attention_residuals == "fp8")
  q = batch * seq_len * m.num_heads * m.head_dim
  kv = batch * seq_len * m.num_kv_heads * m.head_dim
  one = 2 * batch * m.num_heads * seq_len ** 2 * m.head_dim
  return {"attention flops": int((forwards + 2.5) * one),
          "attention bytes": 2 * (forwards * (2 * q + 2 * kv) + 4 * q + 4 * kv)}


def optimizer_bytes_per_param(precision, param_bytes=4, grad_bytes=4) -> float:
  """Parameters (`param_bytes`), gradients (`grad_bytes`) and moments (float32 for adamw; for
  coat_adamw one byte each plus, per group of 128, a float32 scale and a one-byte expansion
  exponent: 2.078 bytes) moved once: all read and written but the gradient, only read. float32
  parameters and gradients with coat_adamw: 16.16 bytes."""
  moments = 8 if precision == "bf16" else 2 + 2 * 5 / 128
  return 2 * (param_bytes + moments) + grad_bytes


def step_counts(preset, precision, seq_len, batch, sets) -> dict:
  """{"layers", "counts" (the full-depth step), "per_layer"}: the traced counts, the attention
  and (the step only) the optimizer's bytes."""
  import numpy as np

  from coat_jax.models.llama import num_params
  from coat_jax.training.build import model_config

  cfg = run_config(preset, precision, seq_len, batch, sets)
  m = model_config(cfg, None)
  one, two = (trace_counts(preset, precision, n, seq_len, batch, sets) for n in (1, 2))
  layer = collections.Counter({k: two[k] - one[k] for k in two})
  attn = attention_counts(m, seq_len, batch)
  full = collections.Counter({k: one[k] + (m.num_layers - 1) * layer[k] for k in two})
  for k, v in attn.items():
    layer[k] += v
    full[k] += m.num_layers * v
  param_bytes = np.dtype(m.param_dtype).itemsize
  grad_bytes = 2 if cfg.optimizer.grad_dtype == "bfloat16" else param_bytes
  full["optimizer bytes"] = num_params(m) * optimizer_bytes_per_param(
      precision, param_bytes, grad_bytes)
  return {"layers": m.num_layers, "remat": m.remat, "counts": full, "per_layer": layer}


def category_ms(counts, peaks) -> dict:
  """{category: floor ms} of CATEGORIES: the FLOPs at their dense peaks, the bytes at the
  bandwidth."""
  ms = {cat: counts.get(key, 0) / peaks[peak] * 1e3 for cat, (key, peak) in COMPUTE.items()}
  for cat in ("quantize", "optimizer"):
    ms[cat] = counts.get(BYTES[cat], 0) / peaks["hbm_bytes_per_s"] * 1e3
  return ms


def roofline(counts, peaks) -> dict:
  """{"flops", "bytes", "compute ms", "bytes ms", "floor ms", "bound"} of counts: the floor is the
  larger of the compute floor (every FLOP at its dense peak) and the byte floor (every byte at
  the bandwidth); "bound" names that side and its largest share."""
  compute = {cat: counts.get(key, 0) / peaks[peak] * 1e3 for cat, (key, peak) in COMPUTE.items()}
  moved = {cat: counts.get(key, 0) / peaks["hbm_bytes_per_s"] * 1e3 for cat, key in BYTES.items()}
  c_ms, b_ms = sum(compute.values()), sum(moved.values())
  side, parts, total = (("FLOPs", compute, c_ms) if c_ms >= b_ms else ("bytes", moved, b_ms))
  top = max(parts, key=parts.get)
  bound = f"{side}: {top} {parts[top] / total:.0%}" if total else "nothing counted"
  return {"flops": sum(counts.get(key, 0) for key, _ in COMPUTE.values()),
          "bytes": sum(counts.get(key, 0) for key in BYTES.values()),
          "compute ms": c_ms, "bytes ms": b_ms, "floor ms": max(c_ms, b_ms), "bound": bound}
