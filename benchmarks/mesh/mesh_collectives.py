"""Collectives of a sharded linear layer and decoder block, forward + backward, from compiled HLO.

For each precision mode (bf16, fp8_linear, coat) and mesh (fsdp 8; fsdp 4 x tensor 2), compiles
  linear: y = linear(x, w) with x (tokens, hidden) over the batch axes and the weight (hidden,
          ffn) split as a column-parallel FSDP weight ("fsdp", "tensor"), loss-free vjp with dy;
  block:  one Llama DecoderBlock (coat_jax.nn), parameters split by coat_jax.training.mesh's rules,
and lists every all-gather / reduce-scatter / all-reduce / all-to-all / collective-permute of the
compiled program with its element type and result bytes (per device), then totals per op and
element type. Nothing is run: shapes only (jit(...).lower(ShapeDtypeStructs).compile()).

What to look for: an FSDP weight that the FP8 GEMM needs whole is gathered; in the fp8 modes it
is gathered as FP8 codes, quantized locally on each shard with the global per-tensor scale (an
all-reduce of the shards' amax), not as float32/bf16 weights. On CPU, which has no FP8 dot, XLA
widens the codes to f16 inside the quantize fusion, before the gather: those rows read
"f16(f8)" (the same codes, 2 bytes each); on a GPU they are gathered as f8e4m3fn (1 byte).
bf16 mode gathers the float32 master weight (the cast to bf16 happens after the gather). On CPU
the weight gradients are all-reduced whole (XLA's GPU pipeline turns an all-reduce followed by
the sharded slice into a reduce-scatter).

CPU (8 simulated devices, ~1 min):
  JAX_PLATFORMS=cpu python -m benchmarks.mesh.mesh_collectives
CPU, the Hopper GEMM path (sharded.matmul_tn) with an XLA stand-in for the kernel (~1 min):
  JAX_PLATFORMS=cpu python -m benchmarks.mesh.mesh_collectives --xla-gemm --modes fp8_linear,coat
GPU (8 H200s; --backend pallas: the per-shard Pallas kernels and the partitioned GEMM):
  python -m benchmarks.mesh.mesh_collectives --backend pallas --tokens 16384 --hidden 4096 --ffn 11008
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from coat_jax import kernels, ops  # noqa: E402
from coat_jax.nn import DecoderBlock  # noqa: E402
from coat_jax.training import mesh as mesh_lib  # noqa: E402
from coat_jax.training.schema import MeshConfig  # noqa: E402

MODES = ("bf16", "fp8_linear", "coat")
MESHES = {"fsdp8": MeshConfig(data=1, fsdp=8, tensor=1),
          "fsdp4xtensor2": MeshConfig(data=1, fsdp=4, tensor=2)}
OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_OP_RE = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (.*?) (" + "|".join(OPS) + r")(-start)?\(")
_SHAPE_RE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2,
          "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def _fp8_sources(hlo: str) -> set[str]:
  """Names of instructions that are (fusions computing) FP8 codes converted to a wider type: XLA
  on CPU has no FP8 dot, so it converts the codes (to f16) before a gather it moved after them."""
  comps, name, body = {}, None, []
  for line in hlo.splitlines():
    head = re.match(r"\s*(?:ENTRY )?(%[\w.\-]+) .*\{\s*$", line)
    if head:
      name, body = head.group(1), []
    elif line.strip() == "}" and name:
      comps[name] = "\n".join(body)
      name = None
    elif name:
      body.append(line)
  out = set()
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = .* fusion\(.*calls=(%[\w.\-]+)", line)
    if m and re.search(r"f8e[45]m[23]", comps.get(m.group(2), "")):
      out.add(m.group(1))
  return out


def collectives(hlo: str) -> list[tuple[str, str, int]]:
  """(op, element type, result bytes) per collective of a compiled HLO text (async *-start
  counted once; a tuple result counts each of its arrays). A gather of FP8 codes that XLA
  widened first (CPU) is marked "<type>(f8)"."""
  out = []
  fp8 = _fp8_sources(hlo)
  for line in hlo.splitlines():
    m = _OP_RE.search(line)
    if not m:
      continue
    operand = re.search(r"(?:" + "|".join(OPS) + r")(?:-start)?\((%[\w.\-]+)", line)
    widened = bool(operand) and operand.group(1) in fp8
    shapes = _SHAPE_RE.findall(m.group(1))
    if m.group(3):   # an async start's result tuple repeats the operands: keep the outputs' half
      shapes = shapes[len(shapes) // 2:] if len(shapes) > 1 else shapes
    for dtype, dims in shapes:
      if dtype not in _BYTES:
        continue
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      widen = widened and not dtype.startswith("f8")
      out.append((m.group(2), dtype + ("(f8)" if widen else ""), n * _BYTES[dtype]))
  return out


def summarize(items) -> dict[str, dict[str, list[int]]]:
  """{op: {dtype: [count, bytes]}}."""
  table: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0]))
  for op, dtype, nbytes in items:
    table[op][dtype][0] += 1
    table[op][dtype][1] += nbytes
  return {op: dict(v) for op, v in table.items()}


def _batch_axes(mesh):
  return tuple(a for a in mesh_lib.BATCH_AXES if mesh.shape[a] > 1) or None


def linear_hlo(mode: str, mesh, args) -> str:
  t = "tensor" if mesh.shape["tensor"] > 1 else None
  x_sh = NamedSharding(mesh, P(_batch_axes(mesh), None))
  w_sh = NamedSharding(mesh, P("fsdp", t))
  y_sh = NamedSharding(mesh, P(_batch_axes(mesh), t))

  def fwd_bwd(x, w, dy):
    y, pullback = jax.vjp(lambda x, w: ops.linear(x, w, mode=mode), x, w)
    return y, pullback(dy)

  f = jax.jit(fwd_bwd, in_shardings=(x_sh, w_sh, y_sh), out_shardings=(y_sh, (x_sh, w_sh)))
  sds = jax.ShapeDtypeStruct
  return f.lower(sds((args.tokens, args.hidden), jnp.bfloat16),
                 sds((args.hidden, args.ffn), jnp.float32),
                 sds((args.tokens, args.ffn), jnp.bfloat16)).compile().as_text()


def block_hlo(mode: str, mesh, args) -> str:
  head_dim = args.hidden // args.heads
  abstract = nnx.eval_shape(lambda: DecoderBlock(
      args.hidden, args.ffn, args.heads, args.heads, head_dim, mode=mode, dtype=jnp.bfloat16,
      rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(abstract)
  params = nnx.to_pure_dict(params)
  p_sh = mesh_lib.param_shardings(params, mesh, group_size=args.group_size)
  seq = args.tokens // args.batch
  cos, sin = ops.rope_frequencies(head_dim, seq)
  x_sh = NamedSharding(mesh, P(_batch_axes(mesh), None, None))

  def fwd_bwd(params, x, dy):
    def layer(params, x):
      state = nnx.State(params) if not isinstance(params, nnx.State) else params
      return nnx.merge(graphdef, state)(x, cos, sin)
    y, pullback = jax.vjp(layer, params, x)
    return y, pullback(dy)

  f = jax.jit(fwd_bwd, in_shardings=(p_sh, x_sh, x_sh), out_shardings=(x_sh, (p_sh, x_sh)))
  x = jax.ShapeDtypeStruct((args.batch, seq, args.hidden), jnp.bfloat16)
  return f.lower(params, x, x).compile().as_text()


def _use_xla_gemm_standin() -> None:
  """Routes kernels.fp8_dot_general to its compiled-kernel path (wrapped by sharded.matmul_tn)
  with the Mosaic kernel replaced by its contract in XLA:
  (s * b_scale * a @ b.T).astype(out_dtype)."""
  from pallas_kernels.gemm import fp8_matmul

  def tn(a, b, s, out_dtype=jnp.bfloat16, *, b_scale=None, **_):
    out = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (out * (s if b_scale is None else s * b_scale)).astype(out_dtype)

  fp8_matmul.fp8_matmul_tn = tn
  kernels.interpret_mode = lambda: False   # only the GEMM family is Pallas under this switch


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--modes", default=",".join(MODES))
  p.add_argument("--meshes", default=",".join(MESHES))
  p.add_argument("--what", default="linear,block", help="linear, block or both")
  p.add_argument("--backend", default="reference", help="kernels backend (coat_jax.kernels)")
  p.add_argument("--tokens", type=int, default=2048, help="batch x seq of the input")
  p.add_argument("--batch", type=int, default=8, help="sequences (block)")
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--ffn", type=int, default=1024)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--group-size", type=int, default=128, help="coat_adamw's (parameter rules)")
  p.add_argument("--xla-gemm", action="store_true",
                 help="CPU: the partitioned GEMM path (sharded.matmul_tn, as on Hopper) with an "
                      "XLA stand-in for the Mosaic kernel, which interpret mode cannot wrap")
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  for name, known in (("modes", MODES), ("meshes", tuple(MESHES)), ("what", ("linear", "block"))):
    items = [s.strip() for s in getattr(args, name).split(",") if s.strip()]
    bad = [s for s in items if s not in known]
    if bad or not items:
      p.error(f"--{name}: unknown {bad or 'empty list'}; choose from {known}")
    setattr(args, name, items)
  return args


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  if jax.device_count() < 8:
    raise SystemExit(f"needs 8 devices, found {jax.device_count()} (on CPU: XLA_FLAGS="
                     "--xla_force_host_platform_device_count=8 before jax is imported)")
  rows = []
  if args.xla_gemm:
    _use_xla_gemm_standin()
    args.backend = "gemm=pallas"   # the rest on the references (the stand-in is not interpreted)
  with kernels.backend(args.backend):
    for what in args.what:
      for mesh_name in args.meshes:
        mesh = mesh_lib.make_mesh(MESHES[mesh_name], jax.devices()[:8])
        for mode in args.modes:
          hlo = (linear_hlo if what == "linear" else block_hlo)(mode, mesh, args)
          rows.append({"what": what, "mesh": mesh_name, "mode": mode,
                       "collectives": summarize(collectives(hlo))})
  print(f"Collectives per device, forward + backward (backend {args.backend}; tokens "
        f"{args.tokens}, hidden {args.hidden}, ffn {args.ffn}); bytes are result sizes")
  print(f"{'what':7} {'mesh':14} {'mode':11} {'op':19} {'dtype':9} {'count':>5} {'MB':>9}")
  for r in rows:
    if not r["collectives"]:
      print(f"{r['what']:7} {r['mesh']:14} {r['mode']:11} (none)")
    for op, per in sorted(r["collectives"].items()):
      for dtype, (count, nbytes) in sorted(per.items()):
        print(f"{r['what']:7} {r['mesh']:14} {r['mode']:11} {op:19} {dtype:9} {count:5d} "
              f"{nbytes / 1e6:9.3f}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)
  return rows


if __name__ == "__main__":
  main()
