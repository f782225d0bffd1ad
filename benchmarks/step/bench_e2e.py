"""End-to-end training step: peak memory, tokens/s and MFU per mode, each mode in its own process.

Modes: "bf16+adamw", "fp8_linear+adamw", "coat+coat_adamw" (precision + optimizer). Each
measurement is a child process of this script (`--one MODE --batch B`), so every mode's
`peak_bytes_in_use` is its own. A child builds the model, optimizer and jitted step with
`coat_jax.training.build.build` (as train.py does), compiles the train step ahead
of time (XLA's `memory_analysis` is recorded), runs --warmup steps (at least 2) and then --steps
timed steps on synthetic random tokens (the timed ones dispatched back to back with one block at
the end, as train.py runs them: step_s is their mean; step_s_blocking is the median of the warmup
steps after the first, each blocked on, the host's round trip included), and prints one
`RESULT {json}` line. The memory budget (`coat_jax.training.build.memory_budget`: master weights,
gradients, the bfloat16 weight copy of `optimizer.grad_dtype=bfloat16`, the gradient accumulator,
optimizer state) is printed and tabulated next to the measured peak. Before compiling the child
checks params + grads + optimizer state (all alive at the update) against the device's
`bytes_limit`: a mode that cannot fit even that is reported "oom (state)" without compiling
(under `--compile-only` it is compiled all the same, since compiling allocates nothing).
An XLA RESOURCE_EXHAUSTED error (compile or run) is reported "oom". Memory options go through
`--set` (e.g. `--set model.param_dtype=bfloat16 --set optimizer.master_rounding=stochastic
--set optimizer.grad_dtype=bfloat16`; master_rounding needs `--modes coat+coat_adamw`).

Layers: `--layers scanned` (default: `model.scan_layers: true`, as train.py), `unrolled`
(`model.scan_layers: false`) or `best`: each mode both ways, and every ratio against bf16's best
row (its fastest for tokens/s, its smallest peak for memory). On one H100 the scanned loop costs
bf16 ~12 % of its OLMo-1B step in residual copies that coat mostly avoids (docs/results.md,
"Training step, OLMo-1B shape, one GPU"), so a fair speed ratio takes each mode at its best:
`--layers best`.

MFU = coat_jax.models.llama.flops_per_token x tokens/s / the devices' dense BF16 peak (the same
denominator for every mode; coat_jax.training.metrics.mfu, n/a on CPU and unknown devices).

GPU (H100; children get XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 unless it is set):
  python -m benchmarks.step.bench_e2e --modes bf16+adamw,coat+coat_adamw --layers best --json $OUT/e2e.json
      # olmo-1b, batch 8: each mode scanned and unrolled, ratios against bf16's best (~5 min)
  python -m benchmarks.step.bench_e2e --json $OUT/e2e_olmo1b.json --seconds-budget 450
      # olmo-1b, seq 2048, batch 8, remat none: 3 modes, ~1.5 min each (compile ~1 min), ~5 min
  python -m benchmarks.step.bench_e2e --modes coat+coat_adamw --find-max-batch --batch 8 \
      --steps 5 --json $OUT/e2e_maxbatch_coat.json --seconds-budget 450
      # doubling 8, 16, 32, ... until the first OOM; one mode per command (a compile per batch)
  python -m benchmarks.step.bench_e2e --preset llama2-7b --remat full --batch 2 --steps 5 \
      --json $OUT/e2e_7b.json --seconds-budget 450
      # which modes fit on one 80 GB H100 (bf16/fp8_linear fail the static check in ~20 s each)
  python -m benchmarks.step.bench_e2e --modes coat+coat_adamw --partitioning always --seconds-budget 200
      # the mesh (custom_partitioning) code path on one GPU: compare with the same without the flag
  python -m benchmarks.step.bench_e2e --preset llama2-7b --modes coat+coat_adamw --remat full \
      --batch 8 --steps 3 --warmup 1 --set model.param_dtype=bfloat16 \
      --set optimizer.master_rounding=stochastic --json $OUT/e2e_7b_bf16m.json --seconds-budget 450
      # 7B, bfloat16 master weights + SR (bfloat16 grads by construction): budget 42.0 GB
  python -m benchmarks.step.bench_e2e --preset llama2-13b --modes coat+coat_adamw --remat full \
      --seq-len 4096 --batch 1 --steps 3 --warmup 1 --set model.param_dtype=bfloat16 \
      --set optimizer.master_rounding=stochastic --json $OUT/e2e_13b.json --seconds-budget 450
      # 13B on one H200: budget 80.4 GB (26.0 master + 26.0 grads + 27.0 FP8 moments + 1.3
      # SR step workspace)
  python -m benchmarks.step.bench_e2e --preset llama2-7b --modes coat+coat_adamw --remat full \
      --batch 8 --compile-only --set model.loss_impl=logits
      # what a configuration will hold (XLA's prediction: arguments + its temp allocation, which
      # the GPU allocates whole, so it is the measured peak), in a compile (~20 s), no step run
CPU smoke (~45 s on 2 cores):
  JAX_PLATFORMS=cpu python -m benchmarks.step.bench_e2e --preset tiny --set model.num_layers=1 \
      --seq-len 32 --batch 2 --steps 2 --warmup 1 --find-max-batch --max-batch 4 \
      --modes bf16+adamw,coat+coat_adamw --json /tmp/e2e_smoke.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path

from benchmarks._common import (Budget, device_env, module_command, parse_modes,
                                split_linear_switches)
from benchmarks._hlo import hlo_ops
from coat_jax.models.llama import REMAT_POLICIES  # no device is touched by this import

REPO = Path(__file__).resolve().parents[2]
MODES = ("bf16+adamw", "fp8_linear+adamw", "coat+coat_adamw")
REMATS = tuple(REMAT_POLICIES)
LAYERS = {"scanned": ("scanned",), "unrolled": ("unrolled",), "best": ("scanned", "unrolled")}
RESULT_TAG = "RESULT "
GB = 1e9


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="olmo-1b",
                 help="LlamaConfig preset (tiny, llama-125m, olmo-1b, llama2-7b, ...)")
  p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--batch", type=int, default=8, help="the equal batch for all modes (sequences)")
  p.add_argument("--steps", type=int, default=10, help="timed steps (back to back, mean reported)")
  p.add_argument("--warmup", type=int, default=3,
                 help="untimed steps after compilation, each blocked on (at least 2 run)")
  p.add_argument("--remat", default="none", choices=REMATS, help="per-block rematerialization policy")
  p.add_argument("--attention-impl", default=None, help="None: cudnn on GPU, xla elsewhere")
  p.add_argument("--layers", default="scanned", choices=tuple(LAYERS),
                 help="decoder blocks scanned (model.scan_layers: true, the default), unrolled, "
                      "or best: each mode both ways, ratios against bf16's best row")
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                 help="extra train.py config override for the children, e.g. model.num_layers=2; "
                      "linear.NAME=VALUE sets an FP8 linear switch (linear_ablation.ablation)")
  p.add_argument("--compile-only", action="store_true",
                 help="compile each step and report XLA's predicted peak (arguments + its temp "
                      "allocation, which the device allocates whole), run no step")
  p.add_argument("--find-max-batch", action="store_true",
                 help="also double the batch from --batch until the first OOM, per mode")
  p.add_argument("--max-batch", type=int, default=1024, help="stop the doubling here")
  p.add_argument("--seconds-budget", type=float, default=None,
                 help="stop launching (and kill a running child) so the whole script ends in time")
  p.add_argument("--json", default=None, help="write the results here")
  p.add_argument("--devices", type=int, default=None,
                 help="run each child on the first N devices only (CUDA_VISIBLE_DEVICES on a GPU "
                      "machine, N simulated host devices on CPU); the mesh comes from --set "
                      "mesh.* (default: data-parallel over all of them), e.g. --set mesh.data=1 "
                      "--set mesh.fsdp=-1 for FSDP")
  p.add_argument("--partitioning", default=None, choices=("auto", "always"),
                 help="kernel partitioning (short for --set kernels.partitioning=...): 'always' "
                      "takes the mesh (custom_partitioning) path on one device too")
  p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: measure one mode
  p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.partitioning:
    args.overrides.append(f"kernels.partitioning={args.partitioning}")
  args.modes = parse_modes(p, args.modes, MODES, [args.one] if args.one else [])
  if args.devices is not None and args.devices <= 0:
    p.error("--devices must be > 0")
  for name in ("seq_len", "batch", "steps", "max_batch"):
    if getattr(args, name) <= 0:
      p.error(f"--{name.replace('_', '-')} must be > 0")
  if args.warmup < 0:
    p.error("--warmup must be >= 0")
  if args.compile_only and args.find_max_batch:
    p.error("--compile-only and --find-max-batch: the search needs steps that run")
  if args.layers != "scanned" and _sets_layers(args.overrides):
    p.error("--layers and --set model.scan_layers both choose the layers: give one")
  return args


def say(msg: str) -> None:
  print(msg, flush=True)


# ----------------------------------------------------------------------------------------------
# Child: one mode at one batch.


def _is_oom(e: BaseException) -> bool:
  text = f"{type(e).__name__} {e}"
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _tree_bytes(tree) -> int:
  import jax
  import numpy as np
  return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
                 if hasattr(x, "shape")))


def measure_one(args: argparse.Namespace) -> dict:
  """Builds, compiles and times one mode at args.batch; returns a JSON-able dict (never raises)."""
  out: dict = {"mode": args.one, "batch": args.batch, "seq_len": args.seq_len, "preset": args.preset,
               "remat": args.remat, "status": "error"}
  try:
    _measure(args, out)
  except Exception as e:  # reported, not raised: the parent tabulates it
    out["status"] = "oom" if _is_oom(e) else "error"
    out["error"] = f"{type(e).__name__}: {str(e)[:600]}"
  return out


def _measure(args: argparse.Namespace, out: dict) -> None:
  import jax
  import numpy as np

  from coat_jax.models import llama as llama_lib
  from coat_jax.ops import linear_ablation
  from coat_jax.training import mesh as mesh_lib, metrics as metrics_lib, schema
  from coat_jax.training.build import build
  from coat_jax.training.plan import memory_analysis

  precision, opt_name = args.one.split("+")
  overrides = [f"model.preset={args.preset}", "model.dtype=auto", f"model.remat={args.remat}",
               f"precision={precision}", f"optimizer.name={opt_name}",
               f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch}", "run.steps=1000"]
  if args.attention_impl:
    overrides.append(f"model.attention_impl={args.attention_impl}")
  switches, config_overrides = split_linear_switches(args.overrides)
  cfg = schema.load(None, overrides + config_overrides)
  mesh = mesh_lib.make_mesh(cfg.mesh)
  built = build(cfg, mesh, seed=0)
  llama_cfg = built.llama_cfg
  dev = jax.devices()[0]
  out.update(device=f"{dev.platform}:{getattr(dev, 'device_kind', '')}", num_devices=mesh.devices.size,
             dtype=llama_cfg.dtype, num_params=llama_lib.num_params(llama_cfg),
             layers="scanned" if llama_cfg.scan_layers else "unrolled",
             flops_per_token=float(llama_lib.flops_per_token(llama_cfg, args.seq_len)))

  # Per device: each leaf counted at its shard's shape (the whole array where replicated), so a
  # mesh that shards the state (FSDP) divides it; on one device the shards are the arrays.
  budget = built.memory_budget()
  params_bytes, opt_bytes = budget["params"], budget["optimizer_state"]
  limit = device_bytes_limit(dev)
  bound = params_bytes + budget["grads"] + opt_bytes  # all alive at the optimizer step
  out.update(params_bytes=params_bytes, opt_state_bytes=opt_bytes, bytes_limit=limit,
             state_lower_bound_bytes=bound, memory_budget=budget,
             mesh={k: int(v) for k, v in mesh.shape.items()})
  say(f"[child {args.one} b={args.batch}] {out['num_params'] / 1e6:.0f}M params; budget: params "
      f"{params_bytes / GB:.2f} GB, grads {budget['grads'] / GB:.2f} GB, bf16 weight copy "
      f"{budget['weight_copy'] / GB:.2f} GB, accumulator {budget['accumulator'] / GB:.2f} GB, "
      f"optimizer state {opt_bytes / GB:.2f} GB, SR/Kahan step workspace "
      f"{budget['step_workspace'] / GB:.2f} GB, total {budget['total'] / GB:.2f} GB; device "
      f"limit {'n/a' if limit is None else f'{limit / GB:.2f} GB'}")
  if limit is not None and bound > limit:  # the state of one device, at its shards' sizes
    error = (f"params + grads + optimizer state = {bound / GB:.2f} GB > device limit "
             f"{limit / GB:.2f} GB: cannot fit at any batch")
    if not args.compile_only:   # compiling allocates nothing: its time is still measured
      out["status"] = "oom (state)"
      out["error"] = error
      return
    say(f"[child {args.one} b={args.batch}] compiled only: {error}")

  batch_sh = built.batch_sharding
  tokens_abs = jax.ShapeDtypeStruct((args.batch, args.seq_len + 1), np.int32, sharding=batch_sh)
  t0 = time.perf_counter()
  with linear_ablation.ablation(**switches):   # read while the step is traced
    compiled = built.train_step.lower(*built.abstract_state(), tokens_abs).compile()
  out["linear_switches"] = switches
  out["compile_s"] = time.perf_counter() - t0
  mem = memory_analysis(compiled)   # None where the backend reports none
  if mem is not None:
    out["memory_analysis"] = mem
  out["hlo_ops"] = hlo_ops(compiled.as_text())
  say(f"[child {args.one} b={args.batch}] compiled step: " + ", ".join(
      f"{k} {v}" for k, v in sorted(out["hlo_ops"].items())))
  say(f"[child {args.one} b={args.batch}] compiled in {out['compile_s']:.1f} s"
      + (f", XLA predicts {mem['predicted_bytes'] / GB:.2f} GB" if mem else ""))
  if args.compile_only:
    out["status"] = "compiled"
    return

  params, opt_state, rest = built.init()
  tokens = jax.device_put(
      jax.random.randint(jax.random.key(1), (args.batch, args.seq_len + 1), 0, llama_cfg.vocab_size,
                         dtype=np.int32), batch_sh)
  deadline = args.deadline or float("inf")
  losses, blocking = [], []
  # Each warmup step blocked on (the host's round trip included); at least two, so that the
  # blocked time (their median after the first) never is the first step's alone.
  for i in range(max(args.warmup, 2)):
    t0 = time.perf_counter()
    params, opt_state, rest, metrics = compiled(params, opt_state, rest, tokens)
    jax.block_until_ready(metrics["loss"])
    blocking.append(time.perf_counter() - t0)
    losses.append(float(metrics["loss"]))
  # Timed: the steps dispatched back to back with one block at the end, as train.py runs them
  # (it fetches metrics only at log steps), so the host's dispatch overlaps the device's work.
  steps = args.steps
  if time.time() + (steps + 1) * blocking[-1] > deadline:
    steps = max(1, int((deadline - time.time()) / blocking[-1]) - 1)
    say(f"[child {args.one} b={args.batch}] deadline: timing {steps} steps")
  t0 = time.perf_counter()
  window = []
  for _ in range(steps):
    params, opt_state, rest, metrics = compiled(params, opt_state, rest, tokens)
    window.append(metrics["loss"])
  jax.block_until_ready(window)
  step_s = (time.perf_counter() - t0) / steps
  losses += [float(x) for x in window]
  peak, kind = metrics_lib.peak_memory_bytes(list(mesh.devices.flat))
  tokens_per_s = args.batch * args.seq_len / step_s
  out["tokens_per_s_per_device"] = tokens_per_s / mesh.devices.size
  out.update(status="ok", peak_bytes=peak, peak_kind=kind, step_s=step_s, timed_steps=steps,
             step_s_blocking=statistics.median(blocking[1:] or blocking), tokens_per_s=tokens_per_s,
             mfu=metrics_lib.mfu(out["flops_per_token"], tokens_per_s, list(mesh.devices.flat)),
             loss_first=losses[0], loss_last=losses[-1],
             loss_finite=all(math.isfinite(x) for x in losses))


# ----------------------------------------------------------------------------------------------
# Parent: one child per measurement.


_RUNNING: dict = {"proc": None, "signal": None}


def _on_signal(signum, frame):
  """SIGTERM/SIGINT (e.g. from `timeout`): kill the running child, launch no more, report."""
  del frame
  _RUNNING["signal"] = signal.Signals(signum).name
  proc = _RUNNING["proc"]
  if proc is not None and proc.poll() is None:
    proc.kill()


def _sets_layers(overrides) -> bool:
  """Whether a --set names model.scan_layers (then the child's layers are what it says)."""
  return any(o.split("=")[0].strip() == "model.scan_layers" for o in overrides)


def device_bytes_limit(dev):
  """The device's allocatable bytes (memory_stats' bytes_limit), or None where it reports none."""
  return (dev.memory_stats() or {}).get("bytes_limit")


def run_child(args: argparse.Namespace, mode: str, batch: int, budget: Budget,
              layers: str = "scanned") -> dict:
  """Runs `--one mode --batch batch` in a subprocess (its decoder blocks `layers`: "scanned" as
  configured, "unrolled" with model.scan_layers=false), streaming its output; returns its
  result, with `layers` recorded."""
  cmd = module_command(__file__) + ["--one", mode, "--batch", str(batch),
         "--preset", args.preset, "--seq-len", str(args.seq_len), "--steps", str(args.steps),
         "--warmup", str(args.warmup), "--remat", args.remat]
  if args.attention_impl:
    cmd += ["--attention-impl", args.attention_impl]
  if args.compile_only:
    cmd.append("--compile-only")
  for item in args.overrides + (["model.scan_layers=false"] if layers == "unrolled" else []):
    cmd += ["--set", item]
  deadline = budget.deadline()
  if deadline is not None:
    cmd += ["--deadline", str(deadline)]
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  env.setdefault("PYTHONUNBUFFERED", "1")
  if args.devices:
    env.update(device_env(args.devices, env))
  env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  label = "layers as --set" if layers == "scanned" and _sets_layers(args.overrides) else layers
  say(f"[e2e] {mode} ({label}) batch {batch}: starting child ({budget.left():.0f} s of budget left)")
  t0 = time.time()
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=str(REPO))
  _RUNNING["proc"] = proc
  result, tail = None, []

  def watchdog():
    while proc.poll() is None:
      if budget.left() < 0:
        proc.kill()
        return
      time.sleep(0.5)

  threading.Thread(target=watchdog, daemon=True).start()
  for line in proc.stdout:
    line = line.rstrip("\n")
    if line.startswith(RESULT_TAG):
      result = json.loads(line[len(RESULT_TAG):])
    elif line.strip():
      tail = (tail + [line])[-40:]
      say("    " + line)
  rc = proc.wait()
  _RUNNING["proc"] = None
  wall = time.time() - t0
  if result is None:
    text = "\n".join(tail)
    status = (f"killed ({_RUNNING['signal']})" if _RUNNING["signal"] else
              "timeout (budget)" if budget.left() < 0 else
              "oom" if ("RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()) else "crash")
    result = {"mode": mode, "batch": batch, "status": status, "error": f"rc {rc}: {text[-600:]}"}
  result["wall_s"] = wall
  result.setdefault("layers", layers)   # the child's own (from its config) when it ran
  say(f"[e2e] {mode} ({layers}) batch {batch}: {result['status']} in {wall:.0f} s"
      + (f", {result['tokens_per_s']:,.0f} tokens/s, peak {result['peak_bytes'] / GB:.2f} GB"
         if result.get("status") == "ok" else f" ({result.get('error', '')[:200]})"))
  return result


def _fmt(v, spec: str, none: str = "n/a") -> str:
  return none if v is None else format(v, spec)


def ratio_rows(results: list[dict]) -> list[dict]:
  """Per row: memory and tokens/s ratios vs bf16+adamw's best row (when one ran): its smallest
  peak and its most tokens/s (one row unless `--layers best` ran it both ways)."""
  bf16 = [r for r in results if r["mode"] == "bf16+adamw" and r.get("status") == "ok"]
  peak = min((r["peak_bytes"] for r in bf16), default=None)
  tps = max((r["tokens_per_s"] for r in bf16), default=None)
  rows = []
  for r in results:
    ok = r.get("status") == "ok"
    row = dict(r)
    row["mem_ratio"] = (r["peak_bytes"] / peak) if ok and peak else None
    row["tps_ratio"] = (r["tokens_per_s"] / tps) if ok and tps else None
    rows.append(row)
  return rows


def print_table(title: str, rows: list[dict]) -> None:
  say(f"\n{title}")
  head = (f"{'mode':18} {'layers':>8} {'batch':>5} {'devs':>4} {'status':>16} {'params':>6} "
          f"{'grads':>6} {'opt st':>6} "
          f"{'budget':>6} {'peak GB':>8} {'mem/bf16':>8} {'step ms':>8} {'blocked':>8} "
          f"{'tokens/s':>10} {'per device':>10} {'tok/s vs bf16':>13} {'MFU':>6} {'compile s':>9} "
          f"{'XLA pred GB':>11}")
  say(head)
  say("-" * len(head))
  for r in rows:
    ok = r.get("status") == "ok"
    mfu_ok = ok and r.get("mfu") is not None
    pred = (r.get("memory_analysis") or {}).get("predicted_bytes")
    b = r.get("memory_budget") or {}
    gb = lambda k: _fmt(b.get(k) and b[k] / GB, '6.1f')
    say(f"{r['mode']:18} {r.get('layers', 'scanned'):>8} {r['batch']:>5} "
        f"{r.get('num_devices', '?'):>4} {r.get('status', '?')[:16]:>16} "
        f"{gb('params'):>6} {gb('grads'):>6} {gb('optimizer_state'):>6} {gb('total'):>6} "
        f"{_fmt(r.get('peak_bytes') and r['peak_bytes'] / GB if ok else None, '8.2f'):>8} "
        f"{_fmt(r.get('mem_ratio'), '7.2f') + ('x' if r.get('mem_ratio') else ''):>8} "
        f"{_fmt(r.get('step_s') and 1e3 * r['step_s'] if ok else None, '8.1f'):>8} "
        f"{_fmt(r.get('step_s_blocking') and 1e3 * r['step_s_blocking'] if ok else None, '8.1f'):>8} "
        f"{_fmt(r.get('tokens_per_s') if ok else None, '10,.0f'):>10} "
        f"{_fmt(r.get('tokens_per_s_per_device') if ok else None, '10,.0f'):>10} "
        f"{_fmt(r.get('tps_ratio'), '12.2f') + ('x' if r.get('tps_ratio') else ''):>13} "
        f"{_fmt(r.get('mfu') and 100 * r['mfu'] if ok else None, '5.1f') + ('%' if mfu_ok else ''):>6} "
        f"{_fmt(r.get('compile_s'), '9.1f'):>9} {_fmt(pred and pred / GB, '11.2f'):>11}")
  say("  params / grads / opt st / budget: GB of master weights, gradients, optimizer state and "
      "their sum\n  with the accumulator and the larger of the bf16 weight copy and the SR/Kahan "
      "step workspace\n  (training.build.memory_budget); "
      "peak: measured; step ms: back to back (as train.py); blocked: one step blocked on\n"
      "  mem/bf16, tok/s vs bf16: against bf16's best row (smallest peak, most tokens/s)\n"
      "  on a mesh: batch is global; params .. peak GB are per device (the largest peak); "
      "tokens/s is global and per device")
  kinds = {r.get("peak_kind") for r in rows if r.get("status") == "ok"}
  if kinds - {"device peak"}:
    say(f"  (peak memory here is {', '.join(sorted(k for k in kinds if k))}, not a device peak)")
  for r in rows:
    if r.get("status") not in ("ok", None) and r.get("error"):
      say(f"  {r['mode']} b={r['batch']}: {r['status']}: {r['error'][:300]}")


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.one:  # child
    result = measure_one(args)
    print(RESULT_TAG + json.dumps(result), flush=True)
    return result

  budget = Budget(args.seconds_budget)
  if threading.current_thread() is threading.main_thread():
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, _on_signal)
  say(f"[e2e] preset {args.preset}, seq {args.seq_len}, batch {args.batch}, remat {args.remat}, "
      f"modes {args.modes}, {args.warmup} warm-up + {args.steps} timed steps"
      + (f", budget {args.seconds_budget:.0f} s" if args.seconds_budget else ""))
  report = {"args": {k: v for k, v in vars(args).items() if k not in ("one", "deadline")},
            "equal_batch": [], "max_batch": {}}

  def save() -> None:
    if args.json:
      Path(args.json).parent.mkdir(parents=True, exist_ok=True)
      Path(args.json).write_text(json.dumps(report, indent=2))

  def launch(mode: str, batch: int, estimate: float, layers: str) -> dict:
    if _RUNNING["signal"]:
      return {"mode": mode, "layers": layers, "batch": batch,
              "status": f"skipped ({_RUNNING['signal']})"}
    if budget.left() < estimate:
      say(f"[e2e] {mode} ({layers}) batch {batch}: skipped, {budget.left():.0f} s left < "
          f"~{estimate:.0f} s needed")
      return {"mode": mode, "layers": layers, "batch": batch, "status": "skipped (budget)"}
    return run_child(args, mode, batch, budget, layers)

  estimate = 20.0  # seconds a child needs at least; updated from the children that ran
  for mode in args.modes:
    for layers in LAYERS[args.layers]:
      r = launch(mode, args.batch, estimate, layers)
      if r.get("status") == "ok":
        estimate = max(estimate, 0.8 * r["wall_s"])
      report["equal_batch"].append(r)
      save()
  report["equal_batch"] = ratio_rows(report["equal_batch"])
  save()
  print_table(f"Equal batch {args.batch} x {args.seq_len} tokens, {args.preset}, remat {args.remat}",
              report["equal_batch"])

  if args.find_max_batch:
    for r0 in report["equal_batch"]:
      mode, layers, tried = r0["mode"], r0.get("layers", "scanned"), [r0]
      key = mode if args.layers != "best" else f"{mode} ({layers})"
      batch = args.batch
      while tried[-1].get("status") == "ok" and batch * 2 <= args.max_batch:
        batch *= 2
        r = launch(mode, batch, estimate, layers)
        if r.get("status") == "ok":
          estimate = max(estimate, 0.8 * r["wall_s"])
        tried.append(r)
        report["max_batch"][key] = tried
        save()
        if r.get("status", "").startswith(("skipped", "timeout", "killed")):
          break
      report["max_batch"][key] = tried
    best = []
    for key, tried in report["max_batch"].items():
      fits = [r for r in tried if r.get("status") == "ok"]
      last = tried[-1].get("status")
      if fits:
        b = dict(max(fits, key=lambda r: r["batch"]))
        b["stopped_by"] = last if last != "ok" else f"--max-batch {args.max_batch}"
        best.append(b)
      else:
        best.append({"mode": tried[0]["mode"], "layers": tried[0].get("layers", "scanned"),
                     "batch": args.batch, "status": last or "n/a",
                     "error": tried[-1].get("error", "")})
    best = ratio_rows(best)
    report["max_batch_summary"] = best
    save()
    print_table("Largest batch that fits per mode (doubling from --batch; stopped by the first "
                "failure)", best)
    for r in best:
      if r.get("stopped_by"):
        say(f"  {r['mode']} ({r.get('layers', 'scanned')}): largest fitting batch {r['batch']}, "
            f"next doubling: {r['stopped_by']}")
  say(f"[e2e] done in {time.time() - budget.t0:.0f} s" + (f"; results in {args.json}" if args.json else ""))
  return report


if __name__ == "__main__":
  main()
