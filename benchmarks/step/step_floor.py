"""The floor of one train step, per kernel category, against a measured profile.

Counted on the CPU from the traced train step (`jax.make_jaxpr` of train.py's step on abstract
arrays, bf16 compute; no GPU, nothing computed), with the kernel dispatch binding the kernels as
on one Hopper GPU (`_signatures.as_if_on_hopper`), so that the jaxpr holds the GPU step's calls:

  FP8 GEMM   2 M N K of every Mosaic GPU GEMM call, its operands as padded to its tiles (the
             plain TN GEMM and the gate/up GEMM with SwiGLU in its epilogue; or of the FP8
             dot_general where a shape takes the reference), at the FP8 dense peak
  bf16 GEMM  2 M N K (x batch) of every dot_general outside the kernels and the attention (the
             bf16 step's linears, both steps' LM head), at the bf16 dense peak
  attention  causal flash attention, 2 B H S^2 Dh forward (QK^T and PV, half the square) and 2.5x
             that backward (S recomputed, dV, dP, dQ, dK), at the bf16 dense peak
  quantize   the bytes every quantize kernel call reads and writes (its operands and results),
             at the HBM bandwidth; the amax passes XLA fuses into the producers are not in it
  optimizer  the bytes of the optimizer state, parameters and gradients read and written once
             (parameters, m, v and their scales read and written, gradients read), at the HBM
             bandwidth

The per-layer counts come from tracing 1 and 2 layers of the preset's width (the difference is one
layer; the rest is the embedding, final norm, LM head and loss), scaled to the preset's depth.
H100 SXM peaks: `_common.H100`. With --profile (profile_step.py's --json of a bf16 and a coat
variant), every category's measured GPU time is printed beside its floor, and what 1.43x of the
bf16 step would ask of the coat-only categories (FP8 GEMM and quantize) with the rest as measured.

  python -m benchmarks.step.step_floor                        # floors only (CPU, ~10 s)
  python -m benchmarks.step.profile_step --variants bf16:loop,coat:loop --json $OUT/p.json   # GPU
  python -m benchmarks.step.step_floor --profile $OUT/p.json
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
from pathlib import Path

from benchmarks._common import H100
from benchmarks._hlo import step_config
from benchmarks._signatures import as_if_on_hopper, is_kernel, kernel_name, signature_backend

GEMM_KERNELS = ("coat_fp8_gemm",)           # prefix of the Mosaic GPU GEMM kernels' names
QUANTIZE_KERNELS = ("quantiz", "swiglu", "amax")
CATEGORIES = ("FP8 GEMM", "bf16 GEMM", "attention", "quantize", "optimizer")


def _nbytes(avals) -> int:
  import numpy as np
  return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in avals)


def _dot_flops(eqn) -> int:
  (lc, _), _ = eqn.params["dimension_numbers"]
  a = eqn.invars[0].aval
  out = eqn.outvars[0].aval
  return 2 * math.prod(out.shape) * math.prod(a.shape[d] for d in lc)


def count(jaxpr, out=None, times=1) -> collections.Counter:
  """{"FP8 GEMM flops", "bf16 GEMM flops", "quantize bytes", "kernels"} of a jaxpr run `times`
  times, recursively (a scan's body `length` times; a kernel's own body is not entered;
  dot_generals with batch dimensions, the attention's reference on the CPU, are left out: the
  attention is counted from the shapes). A while loop (trip count unknown) is an error."""
  from jax.extend.core import jaxprs_in_params

  out = collections.Counter() if out is None else out
  for eqn in jaxpr.eqns:
    if is_kernel(eqn):
      name = kernel_name(eqn.params)
      out["kernels"] += times
      if name.startswith(GEMM_KERNELS):
        a, b = (v.aval for v in eqn.invars[:2])      # (M, K) and (N, K) codes
        out["FP8 GEMM flops"] += times * 2 * a.shape[0] * b.shape[0] * a.shape[1]
      elif any(k in name for k in QUANTIZE_KERNELS):
        out["quantize bytes"] += times * (_nbytes(v.aval for v in eqn.invars) + _nbytes(
            v.aval for v in eqn.outvars))
      continue
    if eqn.primitive.name == "dot_general":
      (_, _), (lb, _) = eqn.params["dimension_numbers"]
      fp8 = any("float8" in str(v.aval.dtype) for v in eqn.invars)   # the GEMM's reference
      if fp8 or not lb:
        out["FP8 GEMM flops" if fp8 else "bf16 GEMM flops"] += times * _dot_flops(eqn)
      continue
    if eqn.primitive.name == "while":
      raise ValueError("step_floor: a while loop in the step (its trip count is unknown); trace "
                       "with the layers unrolled")
    inner = times * eqn.params["length"] if eqn.primitive.name == "scan" else times
    for sub in jaxprs_in_params(eqn.params):
      count(sub, out, inner)
  return out


def _config(preset, precision, seq_len, batch, sets, layers=None):
  """The benchmarks' step config (`_hlo.step_config`), layers unrolled, bf16 compute (what
  `model.dtype=auto` picks on the GPU), cut to `layers` layers if given."""
  depth = [f"model.num_layers={layers}"] if layers else []
  return step_config(preset, precision, "loop", seq_len, batch,
                     ["model.dtype=bfloat16", *sets, *depth])


def trace_counts(preset, precision, layers, seq_len, batch, sets) -> collections.Counter:
  """count() of the train step of `preset` cut to `layers` unrolled layers."""
  import jax
  import numpy as np

  from coat_jax import kernels
  from coat_jax.training import mesh as mesh_lib
  from coat_jax.training.build import build

  cfg = _config(preset, precision, seq_len, batch, sets, layers)
  built = build(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()[:1]), seed=0)
  tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), np.int32)
  with as_if_on_hopper(), kernels.backend(signature_backend(None)):
    jaxpr = jax.make_jaxpr(built.train_step)(*built.abstract_state(), tokens)
  return count(jaxpr.jaxpr)


def llama_config(preset, seq_len, batch, sets):
  from coat_jax.training.build import model_config
  return model_config(_config(preset, "bf16", seq_len, batch, sets), None)


def floors(preset, seq_len, batch, sets) -> dict:
  """{precision: {category: floor ms}} of the full-depth step, with the counts behind them."""
  m = llama_config(preset, seq_len, batch, sets)
  shape = dict(layers=m.num_layers, heads=m.num_heads, head_dim=m.head_dim)
  out = {"layers": m.num_layers}
  for precision in ("bf16", "coat"):
    one, two = (trace_counts(preset, precision, n, seq_len, batch, sets) for n in (1, 2))
    layer = {k: two[k] - one[k] for k in two}
    full = {k: one[k] + (shape["layers"] - 1) * layer[k] for k in two}
    attn = 3.5 * 2 * batch * shape["heads"] * seq_len ** 2 * shape["head_dim"] * shape["layers"]
    ms = {"FP8 GEMM": full.get("FP8 GEMM flops", 0) / H100["fp8_flops"] * 1e3,
          "bf16 GEMM": full.get("bf16 GEMM flops", 0) / H100["bf16_flops"] * 1e3,
          "attention": attn / H100["bf16_flops"] * 1e3,
          "quantize": full.get("quantize bytes", 0) / H100["hbm_bytes_per_s"] * 1e3}
    out[precision] = dict(ms=ms, counts=full, per_layer=layer)
  return out


def optimizer_floor_ms(llama_cfg, precision) -> float:
  """Parameters (float32), gradients (float32) and moments (float32 for adamw; for coat_adamw one
  byte each plus, per group of 128, a float32 scale and a one-byte expansion exponent: 2.078
  bytes) moved once: all read and written but the gradient, which is only read."""
  from coat_jax.models.llama import num_params
  moments = 8 if precision == "bf16" else 2 + 2 * 5 / 128
  return num_params(llama_cfg) * (2 * (4 + moments) + 4) / H100["hbm_bytes_per_s"] * 1e3


def measured(profile_path) -> dict:
  """{precision: its first variant's row} of a profile_step.py --json file."""
  out = {}
  for row in json.loads(Path(profile_path).read_text()):
    out.setdefault(row["variant"].split(":")[0], row)
  return out


def back_to_back_ms(row) -> float:
  """A profiled variant's step as train.py runs it: the traced steps' GPU span per step (they
  are dispatched back to back), or its blocked wall time where the trace has no span."""
  span = (row.get("gaps") or {}).get("span_ms")
  return span / row.get("iters", 1) if span else row["step_ms"]


def report(fl, a, profile) -> str:
  lines = [f"{a.preset}, batch {a.batch} x {a.seq_len}, {fl['layers']} layers; floors at "
           f"H100 SXM peaks (FP8 {H100['fp8_flops'] / 1e12:.0f}, bf16 "
           f"{H100['bf16_flops'] / 1e12:.0f} TFLOP/s, "
           f"HBM {H100['hbm_bytes_per_s'] / 1e12:.2f} TB/s)"]
  rows = measured(profile) if profile else {}
  meas = {p: rows.get(p) for p in ("bf16", "coat")}
  head = f"{'ms per step':<22}{'bf16 floor':>11}{'measured':>10}{'coat floor':>12}{'measured':>10}"
  lines += ["", head, "-" * len(head)]
  totals = collections.Counter()
  for cat in CATEGORIES:
    row = f"{cat:<22}"
    for p in ("bf16", "coat"):
      f = fl[p]["ms"].get(cat, 0.0)
      m = meas[p]["category_ms"].get(cat) if meas[p] else None
      totals[p, "floor"] += f
      totals[p, "meas"] += m or 0.0
      row += f"{f:>{11 if p == 'bf16' else 12}.2f}"
      row += f"{m:>10.2f}" if m is not None else f"{'':>10}"
    lines.append(row)
  if all(meas.values()):
    rest = {p: meas[p]["kernel_ms"] - totals[p, "meas"] for p in ("bf16", "coat")}
    lines.append(f"{'everything else':<22}{'':>11}{rest['bf16']:>10.2f}{'':>12}"
                 f"{rest['coat']:>10.2f}")
    lines.append(f"{'kernel total':<22}{totals['bf16', 'floor']:>11.2f}"
                 f"{meas['bf16']['kernel_ms']:>10.2f}{totals['coat', 'floor']:>12.2f}"
                 f"{meas['coat']['kernel_ms']:>10.2f}")
    lines.append(f"{'step, blocked (wall)':<22}{'':>11}{meas['bf16']['step_ms']:>10.2f}{'':>12}"
                 f"{meas['coat']['step_ms']:>10.2f}")
    step = {p: back_to_back_ms(meas[p]) for p in ("bf16", "coat")}
    lines.append(f"{'step, back to back':<22}{'':>11}{step['bf16']:>10.2f}{'':>12}"
                 f"{step['coat']:>10.2f}")
    bf16, coat = step["bf16"], step["coat"]
    own = ("FP8 GEMM", "quantize")
    own_ms = sum(meas["coat"]["category_ms"].get(c, 0.0) for c in own)
    own_floor = sum(fl["coat"]["ms"][c] for c in own)
    target = bf16 / a.ratio
    budget = target - (coat - own_ms)
    at_floor = {p: totals[p, "floor"] + rest[p] for p in ("bf16", "coat")}
    lines += ["", f"coat vs bf16, steps back to back: {bf16 / coat:.2f}x ({coat:.1f} vs {bf16:.1f} "
              f"ms). Both steps with every category above at its floor and the rest as measured: "
              f"{at_floor['bf16']:.1f} vs {at_floor['coat']:.1f} ms, "
              f"{at_floor['bf16'] / at_floor['coat']:.2f}x.",
              f"{a.ratio}x needs coat <= {target:.1f} ms. With everything but the FP8 GEMMs and "
              f"the quantize kernels as measured ({coat - own_ms:.1f} ms), those two get "
              f"{budget:.1f} ms; they take {own_ms:.1f} ms now, and their floor is "
              f"{own_floor:.1f} ms: they would have to run at {own_floor / budget:.0%} of the "
              f"peaks "
              f"(now {own_floor / own_ms:.0%})." if budget > 0 else
              f"{a.ratio}x needs coat <= {target:.1f} ms: less than the categories bf16 shares."]
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="olmo-1b")
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                 help="model.* overrides (as train.py's --set)")
  p.add_argument("--profile", default=None, help="profile_step.py --json output to compare with")
  p.add_argument("--ratio", type=float, default=1.43, help="the speed-up asked of coat over bf16")
  p.add_argument("--json", default=None, help="write the floors and counts here")
  a = p.parse_args(argv)
  if a.profile and not Path(a.profile).is_file():
    p.error(f"--profile {a.profile}: no such file")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  try:
    fl = floors(a.preset, a.seq_len, a.batch, a.sets)
    llama_cfg = llama_config(a.preset, a.seq_len, a.batch, a.sets)
  except ValueError as e:   # an unknown preset or a bad --set: one line
    p.error(str(e).splitlines()[0])
  for precision in ("bf16", "coat"):
    fl[precision]["ms"]["optimizer"] = optimizer_floor_ms(llama_cfg, precision)
  print(report(fl, a, a.profile))
  if a.json:
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(fl, indent=1, default=float))
  return 0


if __name__ == "__main__":
  sys.exit(main())
