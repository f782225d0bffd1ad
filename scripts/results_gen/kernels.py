"""The kernel tables: the 7B decoder layer, the optimizer step, the optimizer's column kernel,
the SwiGLU weights' codes."""
from __future__ import annotations

import re

from .common import Sources, compared_runs, optimizer_row, ratio, rows_table, source_line


OPTIMIZER_ROWS = [  # (label, bench_optimizer's row name): the default layout, both tiles
  ("optax.adamw (XLA)", "optax.adamw"),
  ("coat_adamw_apply, default (`group_axis=\"last\"`, row kernel, 8 rows x 4 warps), per leaf",
   "coat_adamw_apply, per leaf, tile 8 rows x 4 warps"),
  ("same, `state_layout=\"packed\"`", "coat_adamw_apply, packed state, tile 8 rows x 4 warps"),
  ("same, tile 16 rows x 4 warps, per leaf", "coat_adamw_apply, per leaf, tile 16 rows x 4 warps"),
  ("same, tile 16 rows x 4 warps, packed", "coat_adamw_apply, packed state, tile 16 rows x 4 warps"),
]
OPTIMIZER_COLUMN_ROWS = [  # COAT's layout, measured in a run of its own
  ("optax.adamw (XLA)", "optax.adamw"),
  ("coat_adamw_apply, `group_axis=\"coat\"` (COAT's layout, column kernel), per leaf",
   "coat_adamw_apply, per leaf, groups along axis -2 (column kernel), tile 32 cols x 8 warps"),
  ("same, `state_layout=\"packed\"`",
   "coat_adamw_apply, packed state, groups along axis -2 (column kernel), tile 32 cols x 8 warps"),
]


OPTIMIZER_STACKED_ROWS = [  # (label, bench_optimizer's row name); the default second (the headline's)
  ("optax.adamw (XLA)", "optax.adamw"),
  ("coat_adamw_apply, per leaf, default tile (8 rows x 4 warps)",
   "coat_adamw_apply, per leaf, tile 8 rows x 4 warps"),
  ("same, tile 16 rows x 4 warps", "coat_adamw_apply, per leaf, tile 16 rows x 4 warps"),
  ("coat_adamw_apply, packed state, default tile",
   "coat_adamw_apply, packed state, tile 8 rows x 4 warps"),
  ("same, tile 16 rows x 4 warps", "coat_adamw_apply, packed state, tile 16 rows x 4 warps"),
]


def two_pass(src: Sources) -> list[str]:
  sid = "adam_column_two_pass_h200"
  text = src.raw(sid)
  out = ["| column kernel, tile | GPU kernel ms | wall ms |", "|---|---|---|"]
  for line in text.splitlines():
    m = re.match(r"\| coat_adamw_apply, per leaf, groups along axis -2 \(column kernel\), "
                 r"([^|]+) \| ([\d.]+) \| [\d.]+ \| ([\d.]+) \|", line)
    if m:
      out.append(f"| {m.group(1).strip()} | {m.group(3)} | {m.group(2)} |")
  return out + ["", source_line(src, sid)]


def layer(src: Sources) -> list[str]:
  sid = "layer7b_h200"
  v = lambda k: src.value(sid, k)
  rows = [("bf16 (coat-jax)", [("bf16_ms", ".2f"), ("bf16_ms_back_to_back", ".2f"),
                               ("bf16_held_mb", ".1f")]),
          ("coat (coat-jax)", [("coat_ms", ".2f"), ("coat_ms_back_to_back", ".2f"),
                               ("coat_held_mb", ".1f")]),
          ("BF16 (COAT's PyTorch)", [("COAT_bf16_ms", ".2f"), "", ("COAT_bf16_held_mb", ".1f")]),
          ("COAT (PyTorch + Triton)", [("COAT_ms", ".2f"), "", ("COAT_held_mb", ".1f")]),
          ("coat vs bf16 (coat-jax)", [ratio("time", v("bf16_ms"), v("coat_ms")), "",
                                       ratio("less", v("bf16_held_mb"), v("coat_held_mb"))])]
  return rows_table(src, sid, ["", "fwd + bwd ms", "back to back ms", "held MB"], rows)


def layer_fp8_attention(src: Sources) -> list[str]:
  sid = "layer7b_fp8_attention_residuals_h100"
  r = src.value(sid, "results.0")
  out = ["| | fwd + bwd ms | held MB |", "|---|---|---|",
         f"| coat, `attention_residuals: fp8` | {r['fwd_bwd_ms']:.2f} "
         f"| {r['held_bytes'] / 1e6:.1f} |"]
  return out + ["", source_line(src, sid)]


def layer_linear_residuals(src: Sources) -> list[str]:
  """The coat layer keeping its linears' FP8 inputs (default) and remaking them, each machine's
  runs one after the other, on five H100s; on the third also the remake by the quantize kernel
  (`remake_quantize=kernel`), on the fourth the remake by the Triton kernel (`fused`, its tile
  then 128 x 64) and by the quantize kernel, on the fifth the Triton kernel at its tile since."""
  labels = {"kept": ("coat, `linear_residuals: kept`", ""),
            "remade": ("coat, `linear_residuals: remade`", "remade vs kept"),
            "remade_kernel": ("coat, `linear_residuals: remade`, remake by the quantize kernel",
                              "remade by the kernel vs kept"),
            "remade_fused": ("coat, `linear_residuals: remade`, remake by the Triton kernel",
                             "remade by the Triton kernel vs kept")}
  columns = (("fwd_bwd_ms", 1, ".2f", "pct"), ("fwd_bwd_b2b_ms", 1, ".2f", "pct"),
             ("held_bytes", 1e-6, ".1f", "less"), ("peak_bytes", 1e-6, ".1f", "less"))
  machines = (("", "", ("kept", "remade")),
              ("_other", ", another H100", ("kept", "remade")),
              ("_third", ", a third H100", ("kept", "remade", "remade_kernel")),
              ("_fourth", ", a fourth H100", ("kept", "remade_fused", "remade_kernel")),
              ("_fifth", ", a fifth H100", ("kept", "remade_fused")))
  groups = [(where, labels, {n: f"layer7b_linear_residuals_{n}{machine}_h100" for n in names})
            for machine, where, names in machines]
  return compared_runs(src, ["| | fwd + bwd ms | back to back ms | held MB | device peak MB |",
                             "|---|---|---|---|---|"], groups, "results.0", columns)


REMAKE_WAYS = {"fused": "the Triton kernel through the dispatch (with the scale's own XLA op)",
               "kernel": "XLA writes x in bf16, then the quantize kernel",
               "xla": "one XLA fusion"}


def remake_rows(text: str):
  """(kind, way, ms, GB/s, x floor, equal) of each timed row of bench_remake's output, as written."""
  for line in text.splitlines():
    m = re.match(r"\s+(rmsnorm|swiglu) (.+?)\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", line)
    if m:
      yield m.groups()


def remake_sweep(src: Sources) -> list[str]:
  """bench_remake's rows at the 7B layer's shapes: each way of `kernels.remade_codes_t`, then the
  Triton kernel's tiles (rows x columns x warps; "gather": each element loading its group's
  scale, a variant removed after this run)."""
  sid = "remake_sweep_7b_h100"
  out = ["| remade codes of | way | ms | GB/s | x floor | codes equal to the kernel path's |",
         "|---|---|---|---|---|---|"]
  ways = {**REMAKE_WAYS,
          "fused": "Triton through the dispatch (128x64 w4; with the scale's own XLA op)"}
  for kind, way, *cells in remake_rows(src.raw(sid)):
    what = {"rmsnorm": "a norm's output (K 4096)", "swiglu": "h (K 11008)"}[kind]
    way = ways.get(way, way.replace("fused ", "Triton "))
    out.append(f"| {what} | {way} | " + " | ".join(cells) + " |")
  floors = re.findall(r"(rmsnorm|swiglu) floor ([\d.]+) ms \(([\d.]+) GB\)", src.raw(sid))
  out += ["", "Floor (the Triton kernel's bytes at the datasheet HBM bandwidth): "
          + "; ".join(f"{'a norm output' if k == 'rmsnorm' else 'h'} {ms} ms ({gb} GB)"
                      for k, ms, gb in floors) + "."]
  return out + ["", source_line(src, sid)]


def remake_ways(src: Sources) -> list[str]:
  """bench_remake's rows at the 7B layer's and OLMo-1B's shapes: each way of
  `kernels.remade_codes_t`, the Triton kernel at its default tile, with each shape's floor."""
  sid = "remake_7b_olmo_h100"
  out = ["| model | remade codes of | way | ms | GB/s | x floor | codes equal to the kernel path's |",
         "|---|---|---|---|---|---|---|"]
  model, ks = None, {}
  for line in src.raw(sid).splitlines():
    head = re.match(r"(7b|olmo): M = \d+, rmsnorm K = (\d+), swiglu K = (\d+)", line)
    if head:
      model = {"7b": "Llama-2-7B", "olmo": "OLMo-1B"}[head.group(1)]
      ks = {"rmsnorm": f"a norm's output (K {head.group(2)})", "swiglu": f"h (K {head.group(3)})"}
    floor = re.match(r"\s+(rmsnorm|swiglu) floor ([\d.]+) ms", line)
    if floor:
      out.append(f"| {model} | {ks[floor.group(1)]} | the floor (bytes at the datasheet HBM "
                 f"bandwidth) | {floor.group(2)} | | 1.00 | |")
    for kind, way, *cells in remake_rows(line):
      if way in REMAKE_WAYS:   # the default run's ways (a --sweep's tiles are remake_sweep's)
        out.append(f"| {model} | {ks[kind]} | {REMAKE_WAYS[way]} | " + " | ".join(cells)
                   + " |")
  return out + ["", source_line(src, sid)]


def optimizer(src: Sources) -> list[str]:
  """The optimizer step of 62 leaves: the default layout at both row tiles (one run), COAT's layout
  (column kernel, a run of its own, with that run's optax.adamw), the PyTorch optimizers."""
  # bench_optimizer's columns: wall 1, pipelined 2, kernel 3, ..., state B/param 6, wall/floor 9,
  # kernel/floor 10
  cells = [(1, ".2f"), (3, ".2f"), (6, ".2f"), (9, ".2f"), (10, ".2f")]
  header = ["optimizer", "wall ms", "GPU kernel ms", "state B/param", "wall / floor",
            "kernel / floor"]
  out = []
  for sid, names in (("optimizer_step_tiles_h200", OPTIMIZER_ROWS),
                     ("optimizer_step_h200", OPTIMIZER_COLUMN_ROWS)):
    rows = [(label, [(optimizer_row(name, c), f) for c, f in cells]) for label, name in names]
    floor = src.value(sid, r"re:floor at ([\d.]+) TB/s")
    out += rows_table(src, sid, header, rows)
    out += ["", f"Floor: {floor:.3f} TB/s read + write, measured in the same run.", ""]
  anchors = [("torch.optim.AdamW, fused", "torch_fused_ms", "torch_bytes"),
             ("torchao AdamW8bit", "torchao_8bit_ms", "torchao_8bit_bytes"),
             ("torchao AdamWFp8", "torchao_fp8_ms", "torchao_fp8_bytes"),
             ("bitsandbytes AdamW8bit", "bnb_8bit_ms", "bnb_8bit_bytes"),
             ("COAT's FP8 AdamW (its CUDA kernel)", "COAT_ms", "COAT_bytes")]
  out += rows_table(src, "optimizer_anchors_h200", ["PyTorch optimizer", "ms", "state B/param"],
                    [(label, [(t, ".2f"), (b, ".2f")]) for label, t, b in anchors])
  return out


def swiglu_weight_codes(src: Sources) -> list[str]:
  """The gate/up weights' transposed codes by XLA or by the quantize kernel: the 20.3e9 step's
  prediction, the 7B layer and OLMo-1B's step, each way."""
  sid = "swiglu_weight_codes_h200"
  text = src.raw(sid)
  out = ["| gate/up W^T codes | 20.3e9 step: temporaries B/param | predicted B/param | "
         "predicted GiB | 7B layer fwd+bwd ms | held MB | OLMo-1B step ms (tokens/s) |",
         "|---|---|---|---|---|---|---|"]
  for name, label in (("xla", "XLA's transpose of W's codes"),
                      ("kernel", "the quantize kernel writes them (default)")):
    mem = re.search(rf"^\| {name} \| ([\d.]+) \| [\d.]+ \| ([\d.]+) \| ([\d.]+) \|", text, re.M)
    layer = re.search(rf"=== layer {name}:.*?^coat +[\d.]+ +([\d.]+) +[\d.]+ +([\d.]+)", text,
                      re.M | re.S)
    e2e = re.search(rf"=== e2e {name}:.*?^coat\+coat_adamw +scanned(?: +\S+){{9}} +([\d.]+) +[\d.]+ "
                    rf"+([\d,]+)", text, re.M | re.S)
    params = float(mem.group(1)) * 1e9
    out.append(f"| {label} | {float(mem.group(2)):.3f} | {float(mem.group(3)):.3f} | "
               f"{float(mem.group(3)) * params / 2**30:.2f} | {layer.group(1)} | {layer.group(2)} | "
               f"{float(e2e.group(1)):.1f} ({e2e.group(2)}) |")
  return out + ["", source_line(src, sid)]


def optimizer_stacked(src: Sources) -> list[str]:
  sid = "optimizer_stacked_h200"
  base = [src.value(sid, optimizer_row("optax.adamw", c)) for c in (1, 2, 3)]
  rows = []
  for label, name in OPTIMIZER_STACKED_ROWS:
    wall, piped, kernel = (src.value(sid, optimizer_row(name, c)) for c in (1, 2, 3))
    rows.append((label, [f"{wall:.2f}", f"{piped:.2f}", f"{kernel:.2f}",
                         f"{wall / base[0]:.2f}x", f"{piped / base[1]:.2f}x",
                         f"{kernel / base[2]:.2f}x", (optimizer_row(name, 10), ".2f")]))
  return rows_table(src, sid, ["optimizer", "wall ms", "pipelined ms", "GPU kernel ms",
                               "wall vs optax", "pipelined vs optax", "kernel vs optax",
                               "kernel / floor"], rows)
