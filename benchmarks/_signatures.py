"""The distinct Pallas kernels of a traced program, without a GPU (compile_breakdown --signatures).

One Mosaic GPU kernel signature (kernel name, operand and result types, grid, body) is one module
that XLA compiles with the step; `kernel_signatures` walks a jaxpr (scan, custom_vjp and jit
bodies included) and lists each signature with its call sites. `as_if_on_hopper` makes the
dispatch bind the kernels as one Hopper GPU would, for tracing only.
"""
from __future__ import annotations

import collections
import contextlib

# Kernel name (the Mosaic GPU kernel_name) -> family.
FAMILY_BY_KERNEL = {"coat_fp8_gemm_mgpu": "gemm", "coat_quantize_per_tensor_mgpu": "per_tensor",
                    "coat_quantize_per_group_mgpu": "per_group", "coat_tile_amax_mgpu": "tile_amax",
                    "coat_dequantize_per_group_mgpu": "dequantize"}
# Frames that name a call site: the model's modules, then the op.
_SITE_DIRS = ("/coat_jax/nn/", "/coat_jax/models/")
_OP_DIR = "/coat_jax/ops/"


@contextlib.contextmanager
def as_if_on_hopper():
  """While active, the kernel dispatch behaves as on one Hopper GPU (`auto` picks the kernels,
  not in interpret mode, no per-shard wrapping), so tracing binds the kernels as one GPU would
  (the GEMM's grid: the H100's 132 SMs where the device reports none). Only tracing works so:
  nothing may be lowered."""
  from coat_jax.kernels import backends
  from pallas_kernels.compile_ahead import lower_ahead
  saved = backends.on_hopper, backends.interpret_mode, backends.per_shard, lower_ahead.MODE
  backends.on_hopper, backends.interpret_mode, backends.per_shard = (
      (lambda: True), (lambda: False), (lambda: False))
  lower_ahead.MODE = "inline"    # the kernels' own equations in the jaxpr, no worker processes
  try:
    yield
  finally:
    (backends.on_hopper, backends.interpret_mode, backends.per_shard,
     lower_ahead.MODE) = saved


def signature_backend(spec: str | None) -> str:
  """The backend spec for --signatures: the variant's, with the optimizer families on the
  reference (on the GPU they are jax-triton kernels, not Mosaic GPU; on CPU they cannot be
  bound as on the GPU)."""
  if spec in ("reference", "pallas"):
    return spec
  fams = [] if spec in (None, "", "auto") else [spec]
  return ",".join(fams + ["adam=reference"])


def kernel_name(params) -> str:
  """The kernel name of a kernel equation's params (a Pallas call's or a Mosaic GPU kernel's)."""
  named = params.get("name_and_src_info")
  return str(getattr(named, "name", None) or params.get("name"))


def is_kernel(eqn) -> bool:
  """Whether a jaxpr equation launches a Pallas kernel (Triton's pallas_call, Mosaic GPU's)."""
  return eqn.primitive.name in ("pallas_call", "mpmd_map")


def _call_site(chain, site_dirs=_SITE_DIRS) -> tuple[str, str]:
  """(fwd|bwd, 'Module.__call__:line op') of a kernel equation from its enclosing equations
  (innermost last): bwd when any is under a transpose; the site is the innermost model frame of
  the innermost traceback that has one (a backward equation keeps its forward's traceback)."""
  direction = ("bwd" if any("transpose" in str(e.source_info.name_stack) for e in chain)
               else "fwd")
  for e in reversed(chain):
    tb = e.source_info.traceback
    frames = list(tb.frames) if tb is not None else []
    at = next((i for i, f in enumerate(frames) if any(d in f.file_name for d in site_dirs)), None)
    if at is not None:   # frames run innermost first: the op is the outermost ops frame below
      site = frames[at]
      op = next((f.function_name for f in reversed(frames[:at]) if _OP_DIR in f.file_name), "")
      return direction, f"{site.function_name}:{site.line_num} {op}".strip()
  return direction, "?"


def _describe(name: str, avals_in, avals_out) -> str:
  """Operands -> results; the GEMM as M x N x K, operand and output dtypes."""
  short = lambda a: (str(a).replace("float8_e4m3fn", "e4m3").replace("float8_e5m2", "e5m2")
                     .replace("bfloat16", "bf16").replace("float32", "f32"))
  if FAMILY_BY_KERNEL.get(name) == "gemm" and len(avals_in) >= 2:
    (m, k), n = avals_in[0].shape, avals_in[1].shape[0]
    dt = lambda a: short(a).split("[")[0]
    return (f"M x N x K = {m} x {n} x {k}, {dt(avals_in[0])} . {dt(avals_in[1])} -> "
            f"{dt(avals_out[0])}" + (" + amax" if len(avals_out) > 1 else ""))
  return " ".join(map(short, avals_in)) + " -> " + " ".join(map(short, avals_out))


def kernel_signatures(closed_jaxpr, site_dirs=_SITE_DIRS) -> list[dict]:
  """The distinct Pallas kernels bound in a jaxpr (sub-jaxprs included: scan, custom_vjp, jit).

  A signature is (kernel name, operand and result types, grid, the kernel body's text): one
  signature is one Mosaic GPU module. Returns one dict per signature: name, family, what, grid,
  calls (equations), traces (distinct body objects: more than one means one kernel traced
  twice, i.e. two modules of the same text), sites ({'fwd|bwd site': equations}; a site is the
  innermost frame in a file under one of `site_dirs`).
  """
  import hashlib

  from jax._src import core

  found: dict = {}

  def walk(jaxpr, chain):
    for eqn in jaxpr.eqns:
      if is_kernel(eqn):
        p = eqn.params
        bodies = p.get("jaxprs", (p.get("jaxpr"),))
        bodies = bodies if isinstance(bodies, (tuple, list)) else (bodies,)
        grid = tuple(tuple(getattr(m, "grid", ())) for m in p.get("meshes", ())) or \
            tuple(getattr(p.get("grid_mapping"), "grid", ()))
        name = kernel_name(p)
        avals_in = [v.aval for v in eqn.invars]
        avals_out = [v.aval for v in eqn.outvars]
        text = "".join(str(b) for b in bodies)
        key = (name, tuple(map(str, avals_in)), tuple(map(str, avals_out)), str(grid),
               hashlib.sha1(text.encode()).hexdigest())
        rec = found.setdefault(key, dict(
            name=name, family=FAMILY_BY_KERNEL.get(name, "other"),
            what=_describe(name, avals_in, avals_out),
            grid=" ".join("x".join(map(str, g)) if isinstance(g, tuple) else str(g) for g in grid),
            calls=0, traces=set(),
            sites=collections.Counter()))
        rec["calls"] += 1
        rec["traces"].add(tuple(id(b) for b in bodies))
        rec["sites"][" ".join(_call_site(chain + [eqn], site_dirs))] += 1
      for sub in core.jaxprs_in_params(eqn.params):
        walk(sub, chain + [eqn])

  walk(closed_jaxpr.jaxpr, [])
  out = []
  for rec in found.values():
    rec["traces"] = len(rec["traces"])
    rec["sites"] = dict(sorted(rec["sites"].items()))
    out.append(rec)
  order = list(FAMILY_BY_KERNEL.values())
  return sorted(out, key=lambda r: (order.index(r["family"]) if r["family"] in order else 99,
                                    r["what"]))


def family_counts(sigs: list[dict]) -> dict[str, int]:
  return dict(collections.Counter(r["family"] for r in sigs))
