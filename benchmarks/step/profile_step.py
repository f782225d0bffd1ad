"""GPU time per kernel category of one compiled train step: scan vs loop, bf16 vs coat.

Each variant (`precision:layout[+extra...]`, precision bf16 | fp8_linear with adamw, coat with
coat_adamw; layout scan | loop; extras EXTRAS: `+dsf` XLA's dynamic-slice fusion, `+vjploop`
the layer loop with its own VJP (`model.scan_impl=vjp_loop`), `+lax` JAX's lax.scan
(`model.scan_impl=lax`; without either the model's default "auto" picks), `+unroll2` two layers
per scan iteration) runs in its own child process: it builds and compiles the train step as
bench_e2e does (`_hlo.build_step`), runs --warmup steps, times --steps steps (median), then
traces --iters steps (dispatched back to back, as train.py does) with jax.profiler and sums device
time per kernel (the GPU stream lines, as `_common.kernel_times`, keyed also by the `hlo_op` XLA
attaches to each kernel) and launches per category, the kernels under SMALL_KERNEL_US counted
apart (launch-bound: XLA's scalar fusions), and lists the --top largest kernels per instruction
and added up per kernel and shape (with `+nocb`, by GEMM shape: a custom call's shapes name its
operands'); the GPU's idle time between kernels and its --gaps largest gaps, with
the host events during each, come from the same trace (`_trace.gap_report`).
Every kernel is put in a category through the compiled HLO (XLA names a kernel after its HLO
instruction; the instruction's op_name says forward `jvp(...)`, backward `transpose(...)` or
neither, i.e. the optimizer and gradient norm): FP8 GEMM (the Pallas/Mosaic GPU TN kernel),
bf16 GEMM (cuBLAS, XLA GEMM fusions), quantize (Pallas amax/quantize kernels), attention
(cuDNN), optimizer (fused Adam kernel and the fusions outside forward and backward), copies /
transposes, scan DUS / DS / fill (the stacked residuals and gradients of the scan over layers:
zero fill, dynamic-update-slice writes, dynamic-slice reads), collectives, other fusions of the
forward / backward, unmapped.

GPU, olmo-1b width (batch 8 x 2048) at 4 layers, scan vs loop per layer (~4 min):
  python -m benchmarks.step.profile_step --set model.num_layers=4 --json $OUT/profile_step_l4.json \
      --variants bf16:scan,bf16:loop,coat:scan,coat:loop,coat:scan+vjploop,coat:scan+dsf
The full 16-layer model (~3 min):
  python -m benchmarks.step.profile_step --json $OUT/profile_step.json \
      --variants bf16:scan,bf16:loop,coat:scan,coat:loop
(H100, 2026-11-24, scan: bf16 spent 30.7 ms a step in copies of the loop's residuals, coat
6.1 ms; docs/results.md, "Training step, OLMo-1B shape, one GPU".)
Which fusion is which (`+nocb`: every kernel named after its instruction; the top list then
shows each one's output shape and op_name; --hlo-dir keeps the optimized HLO to read them in):
  python -m benchmarks.step.profile_step --set model.num_layers=2 --variants coat:scan+nocb \
      --top 60 --hlo-dir $OUT/hlo
Where remade linear inputs spend their time (coat's step kept against remade, one child each):
  python -m benchmarks.step.profile_step --variants coat:scan,coat:scan+remade --top 40
Where a variant's extra memory goes (XLA's memory-usage reports of the compiled steps, diffed
against the first variant; the dumps stay under DIR):
  python -m benchmarks.step.profile_step --variants coat:scan,coat:scan+vjploop --buffers /tmp/dumps \
      --iters 1 --steps 2 --top 20
CPU smoke (tiny shapes; no GPU kernels: the table stays empty, the HLO categories are listed):
  JAX_PLATFORMS=cpu python -m benchmarks.step.profile_step --preset tiny --seq-len 32 --batch 2 \
      --set model.num_layers=2 --variants coat:scan --iters 1 --steps 1 --warmup 1
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks._common import REPO, gpu_kernel_events, load_trace, module_command

RESULT_TAG = "RESULT "
# Variant suffixes `+NAME` (several allowed: coat:scan+dsf+unroll2): XLA flags and config overrides.
EXTRAS = {
    # XLA GPU's dynamic-slice fusion: cuBLAS / custom calls read and write slices of the stacked
    # scan buffers in place instead of through a copy.
    "dsf": {"xla_flags": "--xla_gpu_enable_dynamic_slice_fusion=true"},
    # llama.layer_loop: residual and gradient buffers uninitialized (AllocateBuffer), no zero fill
    # (what scan_impl="auto", the default, runs on one device).
    "vjploop": {"sets": ["model.scan_impl=vjp_loop"]},
    # JAX's lax.scan and its transpose (zero-filled stacks; what "auto" runs on a mesh).
    "lax": {"sets": ["model.scan_impl=lax"]},
    "unroll2": {"sets": ["model.scan_unroll=2"]},
    # The loss from all logits (`model.loss_impl=logits`) instead of the default fused, chunked
    # LM head + cross-entropy on one device (`ops.lm_head_loss`).
    "logits": {"sets": ["model.loss_impl=logits"]},
    "unroll4": {"sets": ["model.scan_unroll=4"]},
    # coat's linears keep nothing of their FP8 inputs; the backward remakes their transposed codes.
    "remade": {"sets": ["model.linear_residuals=remade"]},
    # No command buffers (CUDA graphs): each kernel then keeps its own instruction's name, so
    # the top list names every fusion and copy (inside a command buffer the trace names only
    # the buffer); the step's wall time then includes one launch per kernel.
    "nocb": {"xla_flags": "--xla_gpu_enable_command_buffer="},
    # Loops and conditionals inside the command buffers too (CUDA graph conditional nodes): the
    # layer loop's iterations run without returning to the host.
    "cbwhile": {"xla_flags": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,"
                             "CUDNN,CONDITIONAL,WHILE"},
}
CATEGORIES = ("FP8 GEMM", "bf16 GEMM", "quantize", "attention", "optimizer", "copy/transpose",
              "scan DUS/DS/fill", "collectives", "fusions fwd", "fusions bwd", "unmapped")
SCAN_CLASSES = ("DUS fusion (in place)", "dynamic-slice fusion", "dynamic-update-slice",
                "dynamic-slice", "broadcast fusion (fill)")
COPY_CLASSES = ("copy", "copy/transpose fusion", "transpose")
# A kernel whose mean time is below this (microseconds) is counted as small in the report.
SMALL_KERNEL_US = 5.0


def category(kernel: str, info) -> str:
  """The category of a GPU kernel named `kernel`; info: its instruction's (class, op_name,
  custom_call_target) from `_hlo.instruction_index`, or None if no instruction has its name."""
  n = kernel.lower()
  cls, op_name, target = info or ("", "", "")
  if any(k in n for k in ("fmha", "flash", "cudnn", "sdpa")) or "cudnn" in target:
    return "attention"
  if cls == "collective" or "nccl" in n:
    return "collectives"
  if "adam" in n:
    return "optimizer"
  if "amax" in n or "quantiz" in n or "remake" in n:  # the remake kernel writes per-tensor codes
    return "quantize"
  if "swiglu_backward" in n:
    return "fusions bwd"   # SwiGLU's backward kernel: the elementwise pass XLA fuses otherwise
  if "matmul" in n or "wgmma" in n or "fp8_gemm" in n or "mosaic" in target:
    return "FP8 GEMM"  # the Mosaic GPU GEMM (coat_fp8_gemm_mgpu...)
  gemm = (cls in ("dot", "dot fusion") or target.startswith("__cublas")
          or any(k in n for k in ("gemm", "nvjet", "xmma", "cutlass")))
  if gemm:
    return "FP8 GEMM" if any(k in n for k in ("e4m3", "e5m2", "f8")) else "bf16 GEMM"
  if cls in SCAN_CLASSES or "memset" in n or "dynamic_update_slice" in n:
    return "scan DUS/DS/fill"
  if cls in COPY_CLASSES or "memcpy" in n or n.startswith(("copy", "transpose")):
    return "copy/transpose"
  if not info:
    return "unmapped"
  if "transpose(" in op_name:
    return "fusions bwd"
  if "jvp(" in op_name:
    return "fusions fwd"
  return "optimizer"


def kernel_events(data) -> tuple[collections.Counter, collections.Counter]:
  """Microseconds and launches per (kernel name, HLO instruction or "") over the GPU kernels of a
  read trace (as `_common.kernel_times`, plus the `hlo_op` stat XLA attaches to a kernel)."""
  us, calls = collections.Counter(), collections.Counter()
  for _, ev in gpu_kernel_events(data):
    stats = dict((str(k), v) for k, v in ev.stats)
    key = (ev.name, str(stats.get("hlo_op", "")))
    us[key] += ev.duration_ns / 1e3
    calls[key] += 1
  return us, calls


def summarize_kernels(times_us, launches, index, shapes, iters: int, top: int) -> dict:
  """Per step (`iters` traced steps): ms and launches per category; the kernels shorter than
  SMALL_KERNEL_US on average (XLA's scalar and small fusions: launch-bound, each costs the GPU a
  few microseconds whatever it computes) per category; the `top` largest kernels per (kernel,
  HLO instruction); and the `top` largest per (category, kernel, instruction shape), which adds up
  the per-instruction kernels of a step without command buffers (`+nocb`) by shape.
  times_us, launches: `kernel_events`; index, shapes: `_hlo.instruction_index`, `instruction_shapes`
  of the compiled step."""
  per_cat, calls_cat = collections.Counter(), collections.Counter()
  small_ms, small_calls = collections.Counter(), collections.Counter()
  kernels, by_shape = [], collections.defaultdict(lambda: [0.0, 0.0])
  for (name, hlo_op), us in times_us.items():
    cat = category(name, index.get(hlo_op) or index.get(name))
    ms, n = us / iters / 1e3, launches[(name, hlo_op)] / iters
    shape = shapes.get(hlo_op) or shapes.get(name, "")
    per_cat[cat] += ms
    calls_cat[cat] += n
    if us / max(launches[(name, hlo_op)], 1) < SMALL_KERNEL_US:
      small_ms[cat] += ms
      small_calls[cat] += n
    kernels.append((ms, cat, f"{name} [{hlo_op}]" if hlo_op else name, shape, n))
    slot = by_shape[(cat, name, shape.split(" | ")[0])]
    slot[0] += ms
    slot[1] += n
  shaped = sorted(((ms, cat, name, shape, n) for (cat, name, shape), (ms, n) in by_shape.items()),
                  reverse=True)
  return {"category_ms": dict(per_cat), "kernel_ms": sum(per_cat.values()),
          "category_launches": dict(calls_cat), "small_ms": dict(small_ms),
          "small_launches": dict(small_calls), "top": sorted(kernels, reverse=True)[:top],
          "top_by_shape": shaped[:top]}


def measure_one(a) -> dict:
  import jax
  import numpy as np

  from benchmarks._hlo import build_step, instruction_index, instruction_shapes
  from benchmarks._trace import gap_report

  precision, layout, extras = parse_variant(a.one)
  sets = a.sets + [s for e in extras for s in EXTRAS[e].get("sets", [])]
  t0 = time.perf_counter()
  compiled, _, _, built = build_step(a.preset, precision, layout, a.seq_len, a.batch, sets)
  out = {"variant": a.one, "compile_s": time.perf_counter() - t0}
  text = compiled.as_text()
  if a.hlo_dir:
    import gzip
    Path(a.hlo_dir).mkdir(parents=True, exist_ok=True)
    with gzip.open(Path(a.hlo_dir) / f"{_stem(a.one)}.hlo.txt.gz", "wt") as f:
      f.write(text)
  index = instruction_index(text)
  shapes = instruction_shapes(text)
  if a.buffers:
    out["memory_report"] = _read_memory_report(a.buffers, a.one)
    out["peak_live"] = _read_peak_live(a.buffers, a.one, text, shapes)
  out["hlo_categories"] = dict(collections.Counter(category(k, v) for k, v in index.items()))
  params, opt_state, rest = built.init()
  vocab = built.llama_cfg.vocab_size
  tokens = jax.device_put(jax.random.randint(jax.random.key(1), (a.batch, a.seq_len + 1), 0,
                                             vocab, dtype=np.int32), built.batch_sharding)
  state = (params, opt_state, rest)
  times = []
  for i in range(a.warmup + a.steps):
    t1 = time.perf_counter()
    *state, metrics = compiled(*state, tokens)
    jax.block_until_ready(metrics["loss"])
    if i >= a.warmup:
      times.append(time.perf_counter() - t1)
  out["step_ms"] = 1e3 * sorted(times)[len(times) // 2]
  out["loss"] = float(metrics["loss"])
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):  # dispatched back to back, as the training loop does
      for _ in range(a.iters):
        *state, metrics = compiled(*state, tokens)
      jax.block_until_ready(metrics["loss"])
    trace = load_trace(tmp)   # read once for the kernel times and the gaps
    times_us, launches = kernel_events(trace)
    out["gaps"] = gap_report(trace, top=a.gaps)
  out.update(summarize_kernels(times_us, launches, index, shapes, a.iters, a.top))
  out["iters"] = a.iters
  return out


def _stem(variant: str) -> str:
  """A variant's name as a file or directory name ('coat:scan+nocb' -> 'coat_scan_nocb')."""
  return variant.replace(":", "_").replace("+", "_")


def _dump_dir(root: str, variant: str) -> Path:
  return Path(root) / _stem(variant)


def _read_memory_report(root: str, variant: str) -> dict:
  """The train step's XLA memory-usage report from the variant's dump directory."""
  from benchmarks._hlo import memory_report

  paths = sorted(_dump_dir(root, variant).glob("*train_step*after_optimizations-memory-usage-report.txt"))
  if not paths:
    return {"error": f"no memory-usage report under {_dump_dir(root, variant)}"}
  return memory_report(paths[-1].read_text())


def _read_peak_live(root: str, variant: str, hlo_text: str, launched: dict) -> dict:
  """The buffers live at the step's memory peak (XLA's live-range dump), each with its
  instruction's shape and op_name (`launched`: `_hlo.instruction_shapes` of hlo_text, else the
  shape of any instruction of that name), and the peak by JAX op (`_hlo.live_range_peak`)."""
  import re

  from benchmarks._hlo import buffer_slots, live_range_peak, physical_bytes, physical_peak

  dump = _dump_dir(root, variant)
  paths = sorted(dump.glob("*train_step*after_optimizations-live-range.txt"))
  if not paths:
    return {"error": f"no live-range dump under {dump}"}
  live_ranges = paths[-1].read_text()
  peak = live_range_peak(live_ranges, top=None)
  assignment = sorted(dump.glob("*train_step*after_optimizations-buffer-assignment.txt"))
  if assignment:   # the same bytes counted once per (allocation, offset): aliases share a slot
    slots = buffer_slots(assignment[-1].read_text())
    peak["physical_bytes"], peak["unplaced"] = physical_bytes(peak["buffers"], slots)
    peak["physical"] = physical_peak(live_ranges, slots)
  peak["buffers"] = peak["buffers"][:40]
  shapes = {}   # every instruction's shape, the nested ones too (a buffer may be made in a loop)
  for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ", hlo_text, re.M):
    shapes.setdefault(m.group(1), m.group(2))
  peak["buffers"] = [(name, size, launched.get(name.split("{")[0]) or shapes.get(name.split("{")[0], ""))
                     for name, size in peak.get("buffers", [])]
  return peak


def print_buffer_diff(results: list[dict], top: int) -> None:
  """Each variant's temp buffers beyond (and short of) the first variant's, by XLA's reports;
  then what each variant holds at its memory peak."""
  from benchmarks._hlo import memory_report_diff

  ok = [r for r in results if "rows" in (r.get("memory_report") or {})]
  if not ok:
    return
  base = ok[0]
  for r in ok[1:]:
    ta, tb = base["memory_report"]["total_bytes"] or 0, r["memory_report"]["total_bytes"] or 0
    print(f"\n{r['variant']} vs {base['variant']}: XLA temp allocation {tb / 1e9:.3f} vs "
          f"{ta / 1e9:.3f} GB ({(tb - ta) / 1e9:+.3f} GB); buffers it has beyond (+) and short "
          f"of (-) {base['variant']}:")
    rows = [tuple(x) for x in r["memory_report"]["rows"]]
    base_rows = [tuple(x) for x in base["memory_report"]["rows"]]
    for size, shapes in memory_report_diff({"rows": base_rows}, {"rows": rows}, top):
      print(f"  {size / 1e6:+10.1f} MB  {shapes[:140]}")
  for r in ok:
    peak = r.get("peak_live") or {}
    if not peak.get("buffers"):
      continue
    slots = ("" if "physical_bytes" not in peak else
             f", {peak['physical_bytes'] / 1e9:.3f} GB in distinct slots")
    print(f"\n{r['variant']}: {peak['bytes'] / 1e9:.3f} GB live at the peak{slots} (schedule "
          f"position {peak['time']}); largest buffers:")
    for name, size, what in peak["buffers"][:top]:
      print(f"  {size / 1e6:10.1f} MB  {name[:40]:40}  {what[:110]}")
    phys = peak.get("physical")
    if phys:
      print(f"  counting each memory slot once, the peak is {phys['bytes'] / 1e9:.3f} GB at "
            f"position {phys['time']}; its largest slots:")
      for names, size in phys["buffers"][:top]:
        print(f"  {size / 1e6:10.1f} MB  {names[:150]}")
    print("  by the JAX op that made them (XLA's peak):")
    base_ops = dict(base.get("peak_live", {}).get("by_op", []))
    for op, size in peak["by_op"][:top]:
      delta = "" if r is base else f"  ({(size - base_ops.get(op, 0)) / 1e6:+.1f} MB vs {base['variant']})"
      print(f"  {size / 1e6:10.1f} MB  {op[:100]}{delta}")


def parse_variant(v: str) -> tuple[str, str, list[str]]:
  """'coat:scan+dsf' -> ('coat', 'scan', ['dsf']); ValueError naming a bad one."""
  head, *extras = v.split("+")
  parts = head.split(":")
  if (len(parts) != 2 or parts[0] not in ("bf16", "fp8_linear", "coat")
      or parts[1] not in ("scan", "loop") or any(e not in EXTRAS for e in extras)):
    raise ValueError(f"bad variant {v!r}: want precision:layout[+extra...], precision "
                     f"bf16|fp8_linear|coat, layout scan|loop, extras {sorted(EXTRAS)}")
  return parts[0], parts[1], extras


def run_child(a, variant: str) -> dict:
  cmd = module_command(__file__) + ["--one", variant, "--preset", a.preset,
         "--seq-len", str(a.seq_len), "--batch", str(a.batch), "--iters", str(a.iters),
         "--steps", str(a.steps), "--warmup", str(a.warmup), "--top", str(a.top),
         "--gaps", str(a.gaps)]
  if a.hlo_dir:
    cmd += ["--hlo-dir", a.hlo_dir]
  for item in a.sets:
    cmd += ["--set", item]
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  flags = [EXTRAS[e]["xla_flags"] for e in parse_variant(variant)[2] if "xla_flags" in EXTRAS[e]]
  if a.buffers:
    cmd += ["--buffers", a.buffers]
    flags.append(f"--xla_dump_to={_dump_dir(a.buffers, variant)} "
                 "--xla_dump_hlo_module_re=.*train_step.*")
  if flags:
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *flags]).strip()
  env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  print(f"[profile_step] {variant}: starting", flush=True)
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.child_timeout,
                        cwd=REPO)
  for line in proc.stdout.splitlines():
    if line.startswith(RESULT_TAG):
      return json.loads(line[len(RESULT_TAG):])
  tail = (proc.stdout + proc.stderr)[-1500:]
  print(f"[profile_step] {variant}: failed (rc {proc.returncode}):\n{tail}", flush=True)
  return {"variant": variant, "error": tail}


def _print_kernels(rows) -> None:
  for ms, cat, name, *what in rows:
    shape = what[0] if what else ""
    calls = f"{what[1]:6.0f}" if len(what) > 1 else ""   # absent from reports written before
    print(f"  {ms:8.3f}  {calls:>6}  {cat:16}  {name[:70]:70}  {shape[:120]}")


def print_table(results: list[dict]) -> None:
  from benchmarks._trace import print_gap_report

  ok = [r for r in results if "category_ms" in r]
  if not ok:
    return
  head = f"{'ms per step':20}" + "".join(f"{r['variant']:>18}" for r in ok)
  print("\n" + head + "\n" + "-" * len(head))
  for cat in CATEGORIES:
    print(f"{cat:20}" + "".join(f"{r['category_ms'].get(cat, 0.0):18.2f}" for r in ok))
  for key, label in (("kernel_ms", "kernel total"), ("step_ms", "step (wall)"),
                     ("compile_s", "compile s")):
    print(f"{label:20}" + "".join(f"{r[key]:18.2f}" for r in ok))
  counted = [r for r in ok if "category_launches" in r]   # absent from reports written before
  if counted:
    head = (f"{'launches per step':20}" + "".join(f"{r['variant']:>18}" for r in counted)
            + f"   (in kernels < {SMALL_KERNEL_US:g} us: launches, ms)")
    print("\n" + head + "\n" + "-" * len(head))
    for cat in CATEGORIES:
      print(f"{cat:20}" + "".join(
          f"{r['category_launches'].get(cat, 0):7.0f} {r['small_launches'].get(cat, 0):4.0f} "
          f"{r['small_ms'].get(cat, 0.0):5.2f}" for r in counted))
    print(f"{'all':20}" + "".join(
        f"{sum(r['category_launches'].values()):7.0f} {sum(r['small_launches'].values()):4.0f} "
        f"{sum(r['small_ms'].values()):5.2f}" for r in counted))
  for r in ok:
    print(f"\n{r['variant']}: largest kernels (ms per step, launches per step, category, name)")
    _print_kernels(r["top"])
    if r.get("top_by_shape"):
      print(f"\n{r['variant']}: largest kernels by kernel and instruction shape (ms per step, "
            f"launches per step, category, name)")
      _print_kernels(r["top_by_shape"])
    print(f"  HLO instructions per category: {r['hlo_categories']}")
    print_gap_report(r.get("gaps") or {}, f"{r['variant']}: GPU idle time", per=r.get("iters", 1))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="olmo-1b")
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--variants", default="bf16:scan,bf16:loop,coat:scan,coat:loop")
  p.add_argument("--iters", type=int, default=3, help="traced steps")
  p.add_argument("--steps", type=int, default=5, help="timed steps (median) before the trace")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--top", type=int, default=12, help="largest kernels listed per variant")
  p.add_argument("--gaps", type=int, default=8,
                 help="largest idle gaps between kernels listed per variant, with the host "
                      "events during each (benchmarks/_trace.py)")
  p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                 help="config override for every variant, e.g. model.scan_unroll=2")
  p.add_argument("--child-timeout", type=float, default=240)
  p.add_argument("--json", default=None)
  p.add_argument("--hlo-dir", default=None,
                 help="write each variant's optimized HLO here (VARIANT.hlo.txt.gz)")
  p.add_argument("--buffers", default=None, metavar="DIR",
                 help="dump each variant's compiled step under DIR (XLA's --xla_dump_to) and list "
                      "the temp buffers each variant holds beyond the first (XLA's "
                      "memory-usage report): where a variant's extra memory goes")
  p.add_argument("--one", default=None, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  for v in ([a.one] if a.one else a.variants.split(",")):
    try:
      parse_variant(v)
    except ValueError as e:
      p.error(str(e))
  if a.one:
    print(RESULT_TAG + json.dumps(measure_one(a)), flush=True)
    return None
  results = []
  for v in a.variants.split(","):
    try:
      results.append(run_child(a, v))
    except subprocess.TimeoutExpired:
      results.append({"variant": v, "error": f"timeout after {a.child_timeout} s"})
      print(f"[profile_step] {v}: timeout", flush=True)
  print_table(results)
  if a.buffers:
    print_buffer_diff(results, a.top)
  if a.json:
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(results, indent=1))
  return results


if __name__ == "__main__":
  main()
