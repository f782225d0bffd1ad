"""Where the train step's compile time goes, per variant: tracing, lowering, custom kernels, XLA.

Each variant runs in its own child process (fresh in-process kernel caches, JAX's persistent
compilation cache off, 0.9 / --parallel of the GPU's memory preallocated, as a training run
would). The child
builds the real train step as bench_e2e does (`coat_jax.training.build.build`) and lowers and
compiles it on abstract arguments (no parameters are allocated). Measured per variant:

  trace s / lower s / compile s  jitted.trace(), .lower() (StableHLO: the Pallas kernels are
                                 lowered to Mosaic GPU MLIR, jax-triton kernels compiled by
                                 Triton, here or in worker processes) and XLA's .compile(),
                                 back to back as a training run's first step waits for them
                                 (the StableHLO and HLO statistics are read after the compile)
  pallas                         Pallas kernel lowerings (pallas_call / mpmd_map, or waits for
                                 pallas_kernels/compile_ahead/lower_ahead.py's workers), their distinct
                                 signatures and seconds
  mosaic                         Mosaic GPU kernel modules made by the lowering or a worker: the
                                 Mosaic GPU runtime compiles each distinct one (by hash) inside
                                 XLA's compile
  triton                         jax-triton kernel requests, Triton compiles (cache misses, or
                                 kernels from pallas_kernels/compile_ahead/compile_triton.py's workers) and the
                                 lowering's seconds in them: compiling, or waiting for a worker
                                 (jax_triton.triton_lib.get_or_create_triton_kernel)
  custom calls                   in the optimized HLO by target: mosaic_gpu, jax-triton, Pallas
                                 Triton (XLA-compiled), cuDNN, cuBLAS; XLA's own Triton fusions
  HLO                            instructions after optimization (all computations), kernels
                                 (top-level fusions and custom calls), fusions, while loops
  passes                         XLA's per-pass times from its own log (TF_CPP_VMODULE=
                                 hlo_pass_pipeline=1: "HLO pass: NAME time: ..."), of the step's
                                 module only, pipelines (containers) left out; autotuning
                                 sub-compiles count inside the pass that runs them.
                                 gpu_compiler / nvptx_compiler timers (RunHloPasses, ...) likewise
  prewarm (variant option)       every new Mosaic GPU kernel compiled alone first (seconds each),
                                 so the step's compile finds them in the Mosaic GPU cache: its
                                 compile s then leaves them out

Variants: PRECISION:OPTIMIZER[/option...], options `kernels=SPEC` (the run config's
kernels.backend, e.g. kernels=gemm=reference), `remat=POLICY`, `set=KEY=VALUE` (a config
override), `xla=FLAG` (added to XLA_FLAGS), `linear=KEY=VALUE` (a linear layer variant while
tracing, `coat_jax.ops.linear_ablation.ablation`, e.g. linear=amax=kernel), `prewarm`,
`triton_compile=MODE` (compile_triton.MODE: `process`, the default, compiles the Triton kernels
in worker processes while the rest lowers; `inline`, in the lowering), `kernel_lowering=MODE`
(lower_ahead.MODE: `process`, the default, lowers the Mosaic GPU kernels in worker processes while
the step is traced; `inline`, in the lowering), `warm_threads=N` (lower_ahead.WARM_THREADS: the
threads that compile each exported kernel alone; 0 compiles none ahead).

--signatures (no GPU needed): every distinct Mosaic GPU kernel the step would compile on one H100,
with its call sites, from the traced step alone (nothing is lowered or compiled): the kernel
dispatch is told it runs on Hopper (`kernels.backends.on_hopper`, `interpret_mode`), the jaxpr of
`train_step.trace` is walked for Pallas kernel equations (scan bodies, custom_vjp, jit included)
and each is keyed by (kernel, operand and result types, grid, body): one key is one Mosaic GPU
module. The optimizer's kernels (jax-triton, not Mosaic GPU) are left to the reference there.
Call sites: fwd/bwd (bwd: under a transpose) and the innermost model frame of the call. The jaxpr
walk is `_signatures.py`'s.
  JAX_PLATFORMS=cpu python -m benchmarks.step.compile_breakdown --signatures \
      --variants coat:coat_adamw coat:coat_adamw/linear=amax=kernel/linear=weight_quantize=kernel

GPU (one H100, <= 5.5 min; beside another job compile times are noisier: bf16 runs in the same
call as the yardstick; carry .whl for jax-triton):
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
  PYTHONPATH=/tmp/site python3 -m benchmarks.step.compile_breakdown --parallel 2 --seconds-budget 320 \
      --json $OUT/compile_breakdown.json --logs $OUT/compile_logs
CPU smoke (~1 min):
  JAX_PLATFORMS=cpu python -m benchmarks.step.compile_breakdown --preset tiny --seq-len 32 --batch 2 \
      --set model.num_layers=1 --variants bf16:adamw coat:coat_adamw
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import gzip
import json
import os
import re
import subprocess
import time
from pathlib import Path

from benchmarks._common import Budget, module_command
from benchmarks.step._compile_log import hlo_stats, parse_log, phase
from benchmarks._signatures import as_if_on_hopper, family_counts, kernel_signatures, signature_backend

REPO = Path(__file__).resolve().parents[2]
RESULT_TAG = "RESULT "
VMODULE = "hlo_pass_pipeline=1,gpu_compiler=1,nvptx_compiler=1"
# Most informative first: the budget cuts the tail.
DEFAULT_VARIANTS = (
    "bf16:adamw", "coat:coat_adamw", "coat:coat_adamw/prewarm",
    "coat:coat_adamw/kernels=reference", "coat:coat_adamw/kernels=gemm=reference",
    "coat:coat_adamw/kernels=quantize=reference", "coat:adamw",
    "coat:coat_adamw/set=model.num_layers=1", "coat:coat_adamw/remat=full",
    "coat:coat_adamw/kernels=adam=reference", "fp8_linear:adamw", "bf16:adamw/remat=full")
OPTIONS = ("kernels", "remat", "set", "xla", "linear", "prewarm", "triton_compile",
           "kernel_lowering", "warm_threads")


def parse_variant(text: str) -> dict:
  """'coat:coat_adamw/kernels=gemm=reference/prewarm' -> {precision, optimizer, kernels, ...}."""
  head, *opts = text.split("/")
  precision, _, optimizer = head.partition(":")
  if not precision or not optimizer:
    raise ValueError(f"variant {text!r}: expected PRECISION:OPTIMIZER[/option...]")
  v = dict(name=text, precision=precision, optimizer=optimizer, kernels=None, remat=None, sets=[],
           xla=[], linear={}, prewarm=False, triton_compile=None, kernel_lowering=None,
           warm_threads=None)
  for o in opts:
    key, eq, value = o.partition("=")
    if key not in OPTIONS or (key == "prewarm") == bool(eq):
      raise ValueError(f"variant {text!r}: unknown option {o!r}; options: kernels=SPEC, "
                       f"remat=POLICY, set=KEY=VALUE, xla=FLAG, linear=KEY=VALUE, prewarm, "
                       f"triton_compile=MODE, kernel_lowering=MODE, warm_threads=N")
    if key == "linear":
      name, eq2, val = value.partition("=")
      if not eq2:
        raise ValueError(f"variant {text!r}: linear option {value!r} is not KEY=VALUE")
      v["linear"][name] = val
    elif key in ("set", "xla"):
      v["sets" if key == "set" else "xla"].append(value)
    elif key == "prewarm":
      v["prewarm"] = True
    elif key == "warm_threads":
      if not value.isdigit():
        raise ValueError(f"variant {text!r}: warm_threads takes a whole number, got {value!r}")
      v["warm_threads"] = int(value)
    else:
      v[key] = value
  return v


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS))
  p.add_argument("--preset", default="olmo-1b")
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--remat", default="none", help="default remat policy (a variant may override)")
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                 help="config override for every variant")
  p.add_argument("--top", type=int, default=10, help="slowest passes listed per variant")
  p.add_argument("--vmodule", default=VMODULE, help="TF_CPP_VMODULE for the children ('' = off)")
  p.add_argument("--seconds-budget", type=float, default=None)
  p.add_argument("--json", default=None)
  p.add_argument("--logs", default=None, help="folder for the children's XLA logs (gzipped)")
  p.add_argument("--parallel", type=int, default=1,
                 help="children at a time (XLA's passes run on one core: 2 fit a 16-core host, "
                      "each compile somewhat slower)")
  p.add_argument("--signatures", action="store_true",
                 help="list the distinct Mosaic GPU kernels the step compiles on Hopper and their "
                      "call sites, from the traced step (CPU is enough; default variant "
                      "coat:coat_adamw); nothing is compiled")
  p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one variant
  args = p.parse_args(argv)
  if args.signatures and args.variants == list(DEFAULT_VARIANTS):
    args.variants = ["coat:coat_adamw"]
  try:
    args.parsed = [parse_variant(v) for v in ([args.one] if args.one else args.variants)]
  except ValueError as e:
    p.error(str(e))
  return args


def say(msg: str) -> None:
  print(msg, flush=True)


# ----------------------------------------------------------------------------------------------
# Child: instrumentation of the kernel lowerings, then trace / lower / compile one variant.


def _kernel_primitives() -> list:
  """The primitives Pallas kernels are bound as: pallas_call, mpmd_map (plgpu.kernel), and
  lower_ahead's (a kernel lowered in a worker process: its lowering here waits for it)."""
  from jax._src.pallas import pallas_call as pc

  from pallas_kernels.compile_ahead import lower_ahead
  prims = [pc.pallas_call_p, lower_ahead.lowered_ahead_p]
  try:
    from jax._src.pallas import mpmd
    prims.append(mpmd.mpmd_map_p)
  except ImportError:  # older jax: plgpu.kernel is a pallas_call
    pass
  return prims


@contextlib.contextmanager
def instrument():
  """Counts and times, while active: Pallas kernel lowerings (pallas_call / mpmd_map) and their
  distinct signatures, new Mosaic GPU kernel modules, jax-triton kernel requests and Triton
  compiles. Yields a dict; its "kernels" holds one record per distinct signature (what
  `prewarm` re-binds)."""
  from jax._src.interpreters import mlir

  from pallas_kernels.compile_ahead import lower_ahead
  stats = dict(pallas_lowerings=0, pallas_lower_s=0.0, kernels={}, mosaic_kernels=0,
               triton_requests=0, triton_compiles=0, triton_compile_s=0.0)
  try:
    from jax.experimental.mosaic.gpu import core as mgpu_core
    known = mgpu_core.KNOWN_KERNELS
  except Exception:  # no Mosaic GPU in this jaxlib
    known = {}
  restore = []

  def wrap(table, prim):
    entry = table[prim]

    def rule(ctx, *args, **params):
      before = len(known) + lower_ahead.stats["from_worker"]
      t0 = time.perf_counter()
      out = entry.rule(ctx, *args, **params)
      dt = time.perf_counter() - t0
      stats["pallas_lowerings"] += 1
      stats["pallas_lower_s"] += dt
      body = params.get("jaxpr", params.get("jaxprs", params.get("key")))
      name = params.get("name") or (params["key"][1] if "key" in params else None)
      sig = (name, tuple(str(a) for a in ctx.avals_in), hash(str(body)))
      new = len(known) + lower_ahead.stats["from_worker"] - before
      stats["mosaic_kernels"] += new
      rec = stats["kernels"].setdefault(sig, dict(
          name=name, prim=prim, params=params, avals=list(ctx.avals_in),
          lowerings=0, lower_s=0.0, mosaic=0))
      rec["lowerings"] += 1
      rec["lower_s"] += dt
      rec["mosaic"] += new
      return out

    table[prim] = type(entry)(rule, entry.inline)
    restore.append((table, prim, entry))

  for prim in _kernel_primitives():
    for table in [mlir._lowerings, *mlir._platform_specific_lowerings.values()]:
      if prim in table:
        wrap(table, prim)
  try:
    from jax_triton import triton_lib
  except Exception:  # CPU machines: no jax-triton
    triton_lib = None
  if triton_lib is not None:
    # compile_triton's stand-in first, so that this timer also sees the waits for its workers
    from pallas_kernels.compile_ahead import call_triton, compile_triton  # noqa: F401 - installs it
    original = triton_lib.get_or_create_triton_kernel
    made = lambda: len(triton_lib._COMPILED_KERNEL_CACHE) + compile_triton.stats["from_worker"]

    def get_or_create(*a, **k):
      n, t0 = made(), time.perf_counter()
      out = original(*a, **k)
      stats["triton_requests"] += 1
      if made() > n:
        stats["triton_compiles"] += 1
        stats["triton_compile_s"] += time.perf_counter() - t0
      return out

    triton_lib.get_or_create_triton_kernel = get_or_create
  try:
    yield stats
  finally:
    for table, prim, entry in restore:
      table[prim] = entry
    if triton_lib is not None:
      triton_lib.get_or_create_triton_kernel = original


def prewarm(kernels: list[dict]) -> list[dict]:
  """Compiles each kernel record of `instrument` alone (its primitive re-bound with the same
  parameters in a jit of its own): a Mosaic GPU kernel is then in the Mosaic GPU runtime's
  in-process cache when the step compiles. [{name, compile_s, same_module}]: same_module is True
  when the re-bound kernel's module is one already known (the step's own, by hash)."""
  import jax
  try:
    from jax.experimental.mosaic.gpu import core as mgpu_core
    known = mgpu_core.KNOWN_KERNELS
  except Exception:
    known = {}

  out = []
  for k in kernels:
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in k["avals"]]
    before = len(known)
    fn = jax.jit(lambda *xs, _k=k: _k["prim"].bind(*xs, **_k["params"]))
    t0 = time.perf_counter()
    fn.lower(*args).compile()
    out.append(dict(name=k["name"], compile_s=time.perf_counter() - t0,
                    same_module=len(known) == before))
  return out


def measure_one(args: argparse.Namespace) -> dict:
  v = args.parsed[0]
  out = dict(variant=v["name"], status="error")
  try:
    _measure(args, v, out)
    out["status"] = "ok"
  except Exception as e:  # reported: the parent tabulates it
    out["error"] = f"{type(e).__name__}: {str(e)[:800]}"
  return out


def _build_variant(args, v, dtype: str = "auto", backend: str | None = None):
  """(built, abstract state, abstract tokens) of a variant's train step (nothing allocated);
  backend: the run config's kernels.backend (default the variant's `kernels=`)."""
  import jax
  import numpy as np

  from coat_jax.training import mesh as mesh_lib, schema
  from coat_jax.training.build import build

  overrides = [f"model.preset={args.preset}", f"model.dtype={dtype}",
               f"model.remat={v['remat'] or args.remat}", f"precision={v['precision']}",
               f"optimizer.name={v['optimizer']}", f"data.seq_len={args.seq_len}",
               f"data.batch_size={args.batch}", "run.steps=1000", *args.overrides, *v["sets"]]
  backend = backend or v["kernels"]
  if backend:
    overrides.append(f"kernels.backend={backend}")
  cfg = schema.load(None, overrides)
  built = build(cfg, mesh_lib.make_mesh(cfg.mesh), seed=0)
  tokens = jax.ShapeDtypeStruct((args.batch, args.seq_len + 1), np.int32,
                                sharding=built.batch_sharding)
  return built, built.abstract_state(), tokens


def _measure(args, v, out) -> None:
  import jax

  from coat_jax.ops import linear_ablation
  from pallas_kernels.compile_ahead import compile_triton, lower_ahead

  jax.config.update("jax_enable_compilation_cache", False)
  compile_triton.MODE = v["triton_compile"] or compile_triton.MODE
  lower_ahead.MODE = v["kernel_lowering"] or lower_ahead.MODE
  if v["warm_threads"] is not None:
    lower_ahead.WARM = v["warm_threads"] > 0
    lower_ahead.WARM_THREADS = max(1, v["warm_threads"])
  t0 = time.perf_counter()
  built, state, tokens = _build_variant(args, v)
  dev = jax.devices()[0]
  out.update(device=f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
             backend=v["kernels"] or "auto", build_s=time.perf_counter() - t0,
             layers=built.llama_cfg.num_layers, scan=built.llama_cfg.scan_layers,
             linear_options=v["linear"])
  with instrument() as st, linear_ablation.ablation(**v["linear"]):
    phase("trace")
    t0 = time.perf_counter()
    traced = built.train_step.trace(*state, tokens)
    t1 = time.perf_counter()
    phase("lower")
    lowered = traced.lower()
    t2 = time.perf_counter()
  recs = list(st["kernels"].values())
  out.update(trace_s=t1 - t0, lower_s=t2 - t1, pallas_lowerings=st["pallas_lowerings"],
             pallas_distinct=len(recs), pallas_lower_s=st["pallas_lower_s"],
             mosaic_kernels=st["mosaic_kernels"], triton_requests=st["triton_requests"],
             triton_compiles=st["triton_compiles"], triton_compile_s=st["triton_compile_s"],
             pallas_by_name=dict(collections.Counter(str(k["name"]) for k in recs)))
  if v["prewarm"] and any(k["mosaic"] for k in recs):
    phase("prewarm")
    warm = prewarm([k for k in recs if k["mosaic"]])
    out.update(prewarm=warm, prewarm_s=sum(w["compile_s"] for w in warm),
               prewarm_same=sum(w["same_module"] for w in warm))
  phase("compile")
  t0 = time.perf_counter()
  compiled = lowered.compile()
  out["compile_s"] = time.perf_counter() - t0
  phase("done")
  # Read only now: the kernels compiled ahead on threads run on while the text is printed, so
  # printing it between lower and compile would hide some of their time from compile s.
  text = lowered.as_text()
  out["stablehlo"] = dict(
      chars=len(text), opt_barriers=text.count("stablehlo.optimization_barrier"),
      custom_calls=dict(collections.Counter(re.findall(r'call_target_name = "([^"]+)"', text))))
  del text
  out["hlo"] = hlo_stats(compiled.as_text())


# ----------------------------------------------------------------------------------------------
# --signatures: the distinct Mosaic GPU kernels of the traced step, without a GPU.

def step_signatures(args, v) -> list[dict]:
  """`kernel_signatures` of a variant's traced train step as on one Hopper GPU (bf16 compute,
  as `model.dtype=auto` picks there)."""
  from coat_jax.ops import linear_ablation
  with as_if_on_hopper(), linear_ablation.ablation(**v["linear"]):
    built, state, tokens = _build_variant(args, v, dtype="bfloat16",
                                          backend=signature_backend(v["kernels"]))
    traced = built.train_step.trace(*state, tokens)
    return kernel_signatures(traced.jaxpr)


def print_signatures(name: str, sigs: list[dict]) -> None:
  say(f"\n{name}: {len(sigs)} distinct Mosaic GPU kernels {family_counts(sigs)}")
  head = f"  {'family':10} {'operands -> results':76} {'grid':>5} {'calls':>5}  call sites"
  say(head)
  say("  " + "-" * (len(head) - 2))
  for r in sigs:
    sites = "; ".join(f"{n}x {s}" for s, n in r["sites"].items())
    twice = f" [{r['traces']} traces]" if r["traces"] > 1 else ""
    say(f"  {r['family']:10} {r['what'][:76]:76} {r['grid']:>5} {r['calls']:>5}  {sites}{twice}")
  say("  calls: kernel equations in the step's program (a scan body counts once); call sites: "
      "fwd/bwd and the model frame JAX attributes the\n  equation to (a backward equation gets a "
      "forward equation's traceback, not always its own linear's)")


def signatures_main(args) -> dict:
  report = {}
  for v in args.parsed:
    report[v["name"]] = step_signatures(args, v)
    print_signatures(v["name"], report[v["name"]])
  if len(report) > 1:
    fams = sorted({f for sigs in report.values() for f in family_counts(sigs)})
    say(f"\n{'variant':60} " + " ".join(f"{f:>10}" for f in fams) + f" {'total':>6}")
    for name, sigs in report.items():
      c = family_counts(sigs)
      say(f"{name[:60]:60} " + " ".join(f"{c.get(f, 0):>10}" for f in fams)
          + f" {len(sigs):>6}")
  if args.json:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(dict(
        args={k: v for k, v in vars(args).items() if k not in ("one", "parsed")},
        signatures=report), indent=1, default=str))
  return report


# ----------------------------------------------------------------------------------------------
# Parent: XLA's log -> pass times; one child per variant; the table.

def run_child(args, variant: dict, budget: Budget) -> dict:
  cmd = module_command(__file__) + ["--one", variant["name"],
         "--preset", args.preset, "--seq-len", str(args.seq_len), "--batch", str(args.batch),
         "--remat", args.remat]
  for item in args.overrides:
    cmd += ["--set", item]
  env = dict(os.environ)
  # GPU memory preallocated as in a training run (an equal share per child), so that XLA's GEMM
  # autotuning allocates as it would there.
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / max(1, args.parallel):.3f}")
  env.update(JAX_ENABLE_COMPILATION_CACHE="false", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="0")
  if args.vmodule:
    env["TF_CPP_VMODULE"] = args.vmodule
  if variant["xla"]:
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *variant["xla"]]).strip()
  env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  logs = Path(args.logs) if args.logs else Path(os.environ.get("TMPDIR", "/tmp")) / "compile_logs"
  logs.mkdir(parents=True, exist_ok=True)
  log_path = logs / (re.sub(r"[^\w.=-]+", "_", variant["name"]) + ".log")
  say(f"[breakdown] {variant['name']}: starting ({budget.left():.0f} s of budget left)")
  t0 = time.time()
  with open(log_path, "w") as err:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                            cwd=str(REPO))
    try:
      left = budget.left()
      stdout, _ = proc.communicate(timeout=None if left == float("inf") else max(left, 1.0))
    except subprocess.TimeoutExpired:
      proc.kill()
      stdout, _ = proc.communicate()
  result = next((json.loads(l[len(RESULT_TAG):]) for l in stdout.splitlines()
                 if l.startswith(RESULT_TAG)), None)
  text = log_path.read_text(errors="replace")
  if result is None:
    status = "timeout (budget)" if budget.left() <= 0 else f"crash (rc {proc.returncode})"
    result = dict(variant=variant["name"], status=status, error=text[-600:])
  result["wall_s"] = time.time() - t0
  result["log"] = parse_log(text.splitlines())
  with gzip.open(str(log_path) + ".gz", "wt") as f:
    f.write(text)
  log_path.unlink()
  return result


def _f(v, spec="7.1f"):
  return "n/a" if v is None else format(v, spec)


def print_table(rows: list[dict], top: int) -> None:
  base = next((r for r in rows if r["variant"] == "bf16:adamw" and r.get("status") == "ok"), None)
  head = (f"{'variant':44} {'status':>8} {'trace s':>7} {'lower s':>7} {'compile':>7} "
          f"{'total':>7} {'/bf16':>5} {'pallas n/dist/s':>16} {'mosaic':>6} {'triton n/s':>10} "
          f"{'passes s':>8} {'after s':>9} {'HLO ins':>8} {'kernels':>7}  custom calls")
  say("\n" + head)
  say("-" * len(head))
  for r in rows:
    ok = r.get("status") == "ok"
    total = (r["trace_s"] + r["lower_s"] + r["compile_s"]) if ok else None
    btot = base and base["trace_s"] + base["lower_s"] + base["compile_s"]
    log = r.get("log") or {}
    tm = log.get("timers", {})
    hlo = r.get("hlo") or {}
    passes = tm.get("GpuCompiler::RunHloPasses")
    after = r["compile_s"] - passes if ok and passes is not None else None
    if passes is None and log.get("passes"):
      passes = sum(log["passes"].values())
    calls = ", ".join(f"{k} {n}" for k, n in sorted((hlo.get("custom_calls") or {}).items()) if n)
    say(f"{r['variant'][:44]:44} {r.get('status', '?')[:8]:>8} {_f(r.get('trace_s'))} "
        f"{_f(r.get('lower_s'))} {_f(r.get('compile_s'))} {_f(total)} "
        f"{_f(total / btot if ok and btot else None, '5.2f')} "
        f"{r.get('pallas_lowerings', 0):>4}/{r.get('pallas_distinct', 0):>3}/"
        f"{r.get('pallas_lower_s', 0.0):>6.1f} {r.get('mosaic_kernels', 0):>6} "
        f"{r.get('triton_compiles', 0):>3}/{r.get('triton_compile_s', 0.0):>6.1f} "
        f"{_f(passes, '8.1f')} {_f(after, '9.1f')} {hlo.get('instructions', 0):>8} "
        f"{hlo.get('kernels', 0):>7}  {calls}")
  say("  trace/lower/compile: jit .trace() / .lower() / .compile() seconds; total = their sum; "
      "/bf16 = total over bf16:adamw's\n  pallas n/dist/s: pallas_call lowerings / distinct "
      "signatures / seconds lowering them (inside lower); mosaic: distinct Mosaic GPU modules\n"
      "  (compiled inside compile); triton n/s: Triton compiles by jax-triton / seconds (inside "
      "lower);\n  passes: XLA's RunHloPasses timer (autotuning included; where it is absent, e.g. "
      "on CPU, the parsed passes' sum);\n  after: compile s - RunHloPasses (buffer assignment, IR "
      "emission with the Mosaic GPU compiles, LLVM, ptxas)")
  for r in rows:
    log = r.get("log") or {}
    if r.get("prewarm"):
      ws = sorted(r["prewarm"], key=lambda w: -w["compile_s"])
      say(f"\n{r['variant']}: {len(ws)} Mosaic GPU kernels compiled alone in "
          f"{r['prewarm_s']:.1f} s ({r['prewarm_same']} produced the step's own module); slowest: "
          + ", ".join(f"{w['name']} {w['compile_s']:.2f} s" for w in ws[:5]))
    if r.get("hlo"):
      h = r["hlo"]
      say(f"\n{r['variant']}: optimized HLO: {h.get('instructions')} instructions in "
          f"{h.get('computations')} computations, {h.get('fusions')} fusions, "
          f"{h.get('while_loops')} while loops, XLA's Triton fusions by kind "
          f"{h.get('xla_triton_kinds')}; before optimization (StableHLO): "
          f"{(r.get('stablehlo') or {}).get('opt_barriers')} optimization barriers, custom calls "
          f"{(r.get('stablehlo') or {}).get('custom_calls')}")
    if r.get("pallas_by_name"):
      say(f"\n{r['variant']}: distinct pallas_call signatures by kernel: {r['pallas_by_name']}")
    if log.get("passes"):
      say(f"\n{r['variant']}: slowest XLA passes of the step's module (seconds, summed over runs):")
      for name, s in sorted(log["passes"].items(), key=lambda kv: -kv[1])[:top]:
        say(f"    {s:8.2f}  {name}")
      say(f"    {sum(log['passes'].values()):8.2f}  (all {len(log['passes'])} passes)")
      timers = sorted(log["timers"].items(), key=lambda kv: -kv[1])[:6]
      if timers:
        say("  timers: " + ", ".join(f"{k} {s:.2f} s" for k, s in timers))
      if log.get("other_modules"):
        sub = log["other_modules"]
        say(f"  passes of {len(sub)} other modules compiled meanwhile (autotuning, ...): "
            f"{sum(sub.values()):.2f} s")
    for line in log.get("slow", [])[:3]:
      say(f"  slow-compile alarm: {line}")
    if r.get("status") != "ok" and r.get("error"):
      say(f"\n{r['variant']}: {r['status']}: {r['error'][-400:]}")


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.signatures:
    return signatures_main(args)
  if args.one:
    result = measure_one(args)
    print(RESULT_TAG + json.dumps(result, default=str), flush=True)
    return result
  budget = Budget(args.seconds_budget)
  say(f"[breakdown] preset {args.preset}, seq {args.seq_len}, batch {args.batch}, remat "
      f"{args.remat}, {len(args.parsed)} variants"
      + (f", budget {args.seconds_budget:.0f} s" if args.seconds_budget else ""))
  report = dict(args={k: v for k, v in vars(args).items() if k not in ("one", "parsed")}, rows=[])
  rows = [None] * len(args.parsed)

  def one(i: int) -> None:
    variant = args.parsed[i]
    if budget.left() < 15:
      rows[i] = dict(variant=variant["name"], status="skipped (budget)")
      return
    r = run_child(args, variant, budget)
    say(f"[breakdown] {variant['name']}: {r['status']} in {r['wall_s']:.0f} s"
        + (f" (lower {r['lower_s']:.1f} s, compile {r['compile_s']:.1f} s)"
           if r["status"] == "ok" else ""))
    rows[i] = r
    report["rows"] = [r for r in rows if r is not None]
    if args.json:
      Path(args.json).parent.mkdir(parents=True, exist_ok=True)
      Path(args.json).write_text(json.dumps(report, indent=1, default=str))

  with concurrent.futures.ThreadPoolExecutor(max(args.parallel, 1)) as pool:
    list(pool.map(one, range(len(args.parsed))))
  report["rows"] = rows
  if args.json:
    Path(args.json).write_text(json.dumps(report, indent=1, default=str))
  print_table(report["rows"], args.top)
  return report


if __name__ == "__main__":
  main()
