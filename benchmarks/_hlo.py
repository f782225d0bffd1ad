"""Compiled train steps and their optimized HLO text: ops and bytes per step through while loops,
scanned residuals, kernel -> instruction index (hlo_step_stats.py, profile_step.py).
"""
from __future__ import annotations

import collections
import math
import re

FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
        "partition-id", "replica-id", "opt-barrier"}
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
               "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_SHAPE = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")


def shape_bytes(text: str) -> int:
  """Bytes of an HLO shape string (arrays or tuples of arrays)."""
  return sum(DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
             for dt, dims in _SHAPE.findall(text))


def _split_shape(rest: str) -> tuple[str, str]:
  """'(f32[2], s32[]) while(...)...' -> ('(f32[2], s32[])', 'while(...)...')."""
  if rest.startswith("("):
    depth = 0
    for i, c in enumerate(rest):
      depth += c == "("
      depth -= c == ")"
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
  shape, _, tail = rest.partition(" ")
  return shape, tail


def parse_hlo(text: str) -> tuple[dict, str]:
  """{computation: [(name, opcode, shape, line)]} and the entry computation's name."""
  comps, entry, cur = {}, None, None
  for line in text.splitlines():
    m = _HEADER.match(line)
    if m and not _INSTR.match(line):
      cur = m.group(2)
      comps[cur] = []
      if m.group(1):
        entry = cur
      continue
    if cur is None or line.strip() == "}":
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    shape, tail = _split_shape(line[m.end():])
    opcode = tail.split("(", 1)[0].strip()
    comps[cur].append((m.group(1), opcode, shape, line))
  return comps, entry


def _root(body):
  """(root opcode, root line) of a computation's instruction list."""
  for name, op, shape, line in body:
    if line.lstrip().startswith("ROOT"):
      return op, line
  return "", ""


def classify(opcode: str, shape: str, line: str, comps: dict) -> tuple[str, int]:
  """(class, bytes written) of one top-level instruction."""
  nbytes = shape_bytes(shape)
  if opcode == "fusion":
    called = re.search(r"calls=%?([\w.\-]+)", line)
    body = comps.get(called.group(1), []) if called else []
    root, root_line = _root(body)
    if root == "dynamic-update-slice":  # in place: writes only the update
      shapes = {n: s for n, _, s, _ in body}
      upd = re.findall(r"%([\w.\-]+)", root_line.split("dynamic-update-slice(", 1)[1])
      return "DUS fusion (in place)", shape_bytes(shapes.get(upd[1], "")) if len(upd) > 1 else 0
    if root == "broadcast":  # e.g. the zero fill of a scan's stacked outputs before the loop
      return "broadcast fusion (fill)", nbytes
    if root == "dynamic-slice":
      return "dynamic-slice fusion", nbytes
    if root in ("copy", "transpose"):
      return "copy/transpose fusion", nbytes
    if root == "convert":
      return "convert fusion", nbytes
    if any(op in ("dot", "convolution") for _, op, _, _ in body):
      return "dot fusion", nbytes
    return "other fusion", nbytes
  if opcode in ("copy", "copy-start", "copy-done"):
    return "copy", nbytes
  if opcode in ("dynamic-update-slice", "dynamic-slice", "transpose", "convert", "dot",
                "custom-call"):
    return opcode, nbytes
  if opcode in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute"):
    return "collective", nbytes
  return "other", nbytes


def step_stats(text: str) -> dict:
  """{class: [ops per step, bytes written per step]} plus 'while carry' (buffers, bytes)."""
  comps, entry = parse_hlo(text)
  stats = collections.defaultdict(lambda: [0, 0])

  def walk(comp: str, times: int):
    for name, opcode, shape, line in comps.get(comp, []):
      if opcode in FREE:
        continue
      if opcode == "while":
        body = re.search(r"body=%?([\w.\-]+)", line).group(1)
        trip = re.search(r'known_trip_count[^0-9]*(\d+)', line)
        n = int(trip.group(1)) if trip else 1
        stats["while loops"][0] += times
        stats["while carry (buffers, bytes)"][0] += times * len(_SHAPE.findall(shape))
        stats["while carry (buffers, bytes)"][1] += times * shape_bytes(shape)
        walk(body, times * n)
        continue
      cls, nbytes = classify(opcode, shape, line, comps)
      stats[cls][0] += times
      stats[cls][1] += times * nbytes
      for sub in re.findall(r"(?:to_apply|calls|branch_computations)=\{?%?([\w.\-]+)", line):
        if opcode in ("call", "conditional"):
          walk(sub, times)
  walk(entry, 1)
  return dict(stats)


def scan_residuals(fn, *args) -> list[tuple[int, int, list]]:
  """Per scan in fn's jaxpr: (length, bytes of its stacked outputs, [(shape, dtype) ...])."""
  import jax
  import jax.extend
  import numpy as np

  out = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "scan":
        ys = eqn.outvars[len(list(eqn.params["ft_out"].unpack()[0].vals)):]
        out.append((eqn.params["length"],
                    sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in ys),
                    [(tuple(v.aval.shape), str(v.aval.dtype)) for v in ys]))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return out


def step_config(preset, precision, layout, seq_len, batch, sets):
  """The RunConfig of one variant's train step: precision "bf16" | "fp8_linear" (with adamw) or
  "coat" (coat_adamw), layout "scan" | "loop", then `sets` (KEY=VALUE, last wins)."""
  from coat_jax.training import schema

  opt = "coat_adamw" if precision == "coat" else "adamw"
  return schema.load(None, [f"model.preset={preset}", "model.dtype=auto", f"precision={precision}",
                            f"optimizer.name={opt}", f"data.seq_len={seq_len}",
                            f"data.batch_size={batch}", f"model.scan_layers={layout == 'scan'}",
                            "run.steps=10", *sets])


def build_step(preset, precision, layout, seq_len, batch, sets):
  """(compiled train step, jitted step, abstract args, `build`'s result) of one variant
  (`step_config`)."""
  import jax
  import numpy as np

  from coat_jax.training import mesh as mesh_lib
  from coat_jax.training.build import build

  cfg = step_config(preset, precision, layout, seq_len, batch, sets)
  built = build(cfg, mesh_lib.make_mesh(cfg.mesh), seed=0)
  tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), np.int32, sharding=built.batch_sharding)
  args = (*built.abstract_state(), tokens)
  return built.train_step.lower(*args).compile(), built.train_step, args, built


def top_level(text: str):
  """(comps, [(name, opcode, shape, line)]) of the top-level instructions of every non-fusion
  computation (those XLA launches), FREE opcodes left out."""
  comps, _ = parse_hlo(text)
  fused = {m for m in re.findall(r"calls=%?([\w.\-]+)", text)}
  return comps, [ins for comp, body in comps.items() if comp not in fused
                 for ins in body if ins[1] not in FREE]


def _by_kernel_name(pairs) -> dict:
  """{name: value} with each name also under its kernel spelling (XLA names a GPU kernel after
  its instruction, '.' and '-' turned into '_')."""
  out = {}
  for name, value in pairs:
    out[name] = out[re.sub(r"[.\-]", "_", name)] = value
  return out


def instruction_shapes(text: str) -> dict:
  """{instruction name: 'shape opcode [file:line] [<- (operand shapes)] | op_name tail'} of the
  launched instructions (operand shapes for custom calls), to tell kernels apart in a profile."""
  comps, instructions = top_level(text)
  shape_of = {name: re.sub(r"\{[^{}]*\}", "", shape)   # every instruction's shape, no layouts
              for body in comps.values() for name, _, shape, _ in body}

  def what(opcode, shape, line):
    op_name = re.search(r'op_name="([^"]*)"', line)
    src = re.search(r'source_file="[^"]*?([^/"]+)" source_line=(\d+)', line)
    out = f"{shape} {opcode}" + (f" {src.group(1)}:{src.group(2)}" if src else "")
    if opcode == "custom-call":   # a kernel's operands tell its shapes apart (a GEMM's K)
      args = re.search(r"custom-call\(([^()]*)\)", line)
      names = re.findall(r"%([\w.\-]+)", args.group(1)) if args else []
      operands = [shape_of.get(a, "?") for a in names]
      out += f" <- ({', '.join(operands)})" if operands else ""
    return out + (" | " + op_name.group(1)[-60:] if op_name else "")

  return _by_kernel_name((name, what(opcode, shape, line))
                         for name, opcode, shape, line in instructions)


def instruction_index(text: str) -> dict:
  """{instruction name: (class, op_name metadata, custom_call_target)} of the launched
  instructions (top level of every non-fusion computation), also under each kernel spelling."""
  comps, instructions = top_level(text)

  def info(opcode, shape, line):
    op_name = re.search(r'op_name="([^"]*)"', line)
    target = re.search(r'custom_call_target="([^"]*)"', line)
    return (classify(opcode, shape, line, comps)[0], op_name.group(1) if op_name else "",
            target.group(1) if target else "")

  return _by_kernel_name((name, info(opcode, shape, line))
                         for name, opcode, shape, line in instructions)


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def memory_report(text: str) -> dict:
  """XLA's `*-memory-usage-report.txt` (written under --xla_dump_to) -> {"total_bytes": the
  first memory space's total, "rows": [(bytes, shapes list)] of every buffer slice listed}."""
  total = re.search(r"Total bytes: (\d+)", text)
  rows = []
  for line in text.splitlines():
    parts = [p.strip() for p in line.split(";")]
    if len(parts) != 5:
      continue
    m = re.fullmatch(r"([\d.]+)(B|KiB|MiB|GiB|TiB)", parts[1])
    if m:
      rows.append((int(float(m.group(1)) * _UNITS[m.group(2)]), parts[4]))
  return {"total_bytes": int(total.group(1)) if total else None, "rows": rows}


def memory_report_diff(a: dict, b: dict, top: int = 15) -> list[tuple[int, str]]:
  """Buffers (bytes, shapes) that report `b` holds beyond report `a`, largest first (a row of
  `a` cancels one equal row of `b`); negative bytes: rows `a` holds beyond `b`."""
  ca = collections.Counter(a["rows"])
  cb = collections.Counter(b["rows"])
  extra = [(size, shapes) for (size, shapes), n in (cb - ca).items() for _ in range(n)]
  fewer = [(-size, shapes) for (size, shapes), n in (ca - cb).items() for _ in range(n)]
  return (sorted(extra, reverse=True)[:top] + sorted(fewer)[:top])


def live_range_peak(text: str, top: int | None = 40) -> dict:
  """XLA's `*-live-range.txt` (written under --xla_dump_to) -> the buffers live at the module's
  peak: {"time": its position in the schedule, "bytes": their sum, "buffers": [(instruction{index},
  bytes)] largest first (at most `top`; None: all), "by_op": [(op_name, bytes)] of the first level of XLA's
  "stack trace breakdown for peak usage" (what the peak holds, by the JAX op that made it)}."""
  head = re.search(r"Live ranges at (\d+) \(peak\):\n((?:    .*\n)*)", text)
  if not head:
    return {}
  buffers = [(m.group(1), int(m.group(2))) for m in
             re.finditer(r"^    (\S+): (\d+) bytes", head.group(2), re.M)]
  by_op = []
  breakdown = text.split("Stack trace breakdown for peak usage", 1)
  if len(breakdown) == 2:   # first-level children of the entry: 6 spaces + the tree glyph
    for m in re.finditer(r"^      [├└]── (.+?) \([\d.]+%, total: ([\d ]+) bytes", breakdown[1], re.M):
      by_op.append((m.group(1), int(m.group(2).replace(" ", ""))))
  return {"time": int(head.group(1)), "bytes": sum(b for _, b in buffers),
          "buffers": sorted(buffers, key=lambda b: -b[1])[:top],
          "by_op": sorted(by_op, key=lambda b: -b[1])}


def buffer_slots(text: str) -> dict:
  """XLA's `*-buffer-assignment.txt` -> {value name as the live-range dump spells it
  ("instr{}" / "instr{2}"): (allocation, offset, size)}: where each logical buffer lies."""
  slots, alloc = {}, None
  for line in text.splitlines():
    m = re.match(r"allocation (\d+): size", line)
    if m:
      alloc = int(m.group(1))
      continue
    m = re.match(r"\s*value: <\d+ (\S+?)(\{[\d,]*\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)",
                 line)
    if m and alloc is not None:
      slots[m.group(1) + (m.group(2) or "{}")] = (alloc, int(m.group(4)), int(m.group(3)))
  return slots


def physical_bytes(buffers, slots: dict) -> tuple[int, int]:
  """(bytes, buffers not found in `slots`) of live buffers [(name, bytes, ...)] counting each
  (allocation, offset) once: loop-carried values and their aliases share one slot, which the
  live-range dump lists once per name."""
  seen, total, missing = {}, 0, 0   # slot -> the largest size counted for it
  for name, size, *_ in buffers:
    where = slots.get(name)
    if where is None:
      missing += 1
      total += size
    elif size > seen.get(where[:2], 0):
      total += size - seen.get(where[:2], 0)
      seen[where[:2]] = size
  return total, missing


def physical_peak(live_range_text: str, slots: dict, top: int = 40) -> dict:
  """The schedule position where the most bytes are live counting each (allocation, offset) slot
  once (aliases of a loop's carried buffers share a slot; XLA's own "peak" counts them once per
  name): {"time", "bytes", "buffers": [(names in the slot, bytes)] largest first}. `slots` from
  `buffer_slots`; live ranges from the dump's BufferLiveRange section."""
  section = live_range_text.split("BufferLiveRange:", 1)[-1].split("Live ranges at", 1)[0]
  by_slot = collections.defaultdict(list)   # slot -> [(start, end, name, size)]
  end_time = 0
  for m in re.finditer(r"^\s+(\S+):(\d+)-(\d+)\s*$", section, re.M):
    name, start, end = m.group(1), int(m.group(2)), int(m.group(3))
    where = slots.get(name)
    if where is None:
      continue
    by_slot[where[:2]].append((start, end, name, where[2]))
    end_time = max(end_time, end)
  delta = [0] * (end_time + 2)
  for values in by_slot.values():   # a slot holds max(size) over its values live at a time
    spans = sorted((t0, t1, size) for t0, t1, _, size in values)
    cur0, cur1, cur = spans[0]
    for t0, t1, size in spans[1:] + [(end_time + 1, end_time + 1, 0)]:
      if t0 > cur1:
        delta[cur0] += cur
        delta[cur1 + 1] -= cur
        cur0, cur1, cur = t0, t1, size
      else:
        cur1, cur = max(cur1, t1), max(cur, size)
  live, best, best_t = 0, -1, 0
  for t in range(end_time + 1):
    live += delta[t]
    if live > best:
      best, best_t = live, t
  at_peak = []
  for values in by_slot.values():
    here = [(name, size) for t0, t1, name, size in values if t0 <= best_t <= t1]
    if here:
      at_peak.append((" = ".join(sorted({n for n, _ in here}))[:200], max(s for _, s in here)))
  return {"time": best_t, "bytes": best, "buffers": sorted(at_peak, key=lambda b: -b[1])[:top]}


def hlo_ops(text: str) -> dict:
  """Kernels and collectives in a compiled module's text: custom calls by target (the Pallas
  kernels: Mosaic GPU `mosaic_gpu*`, jax-triton `triton_kernel_call`; cuDNN, cuBLAS) and each
  collective's count (how a mesh run shows its kernels ran per shard and what it communicates)."""
  ops = collections.Counter(f"custom-call {t}" for t in
                            re.findall(r'custom_call_target="([^"]+)"', text))
  for op in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"):
    n = len(re.findall(rf"= [^=]*? {op}(?:-start)?\(", text))
    if n:
      ops[op] = n
  return dict(ops)
