"""Training stability, bf16 vs COAT: seeds x learning rates, divergences, sharpness; state formats.

Follows the protocol of "To FP8 and Back Again" (Lee et al., arXiv 2405.18710; see
shared/anchors.md): a recipe is only economical if it is as robust as BF16 across random seeds and
learning rates. On a small Llama (configs/tiny.yaml's corpus and schedule, the "tiny" preset's
shape: hidden 256, 4 layers, 4 heads / 2 KV heads) this script

1. Sweep: trains every (mode, seed, lr) for --steps steps, modes "bf16+adamw" and
   "coat+coat_adamw" (FP8 activations + FP8 optimizer states). The seed sets the init and the data
   order; bf16 and coat with the same seed start from the same weights and see the same batches.
   A run counts as diverged by either criterion, reported separately:
     "nonfinite":     a train loss is NaN/inf (the run stops there);
     "final>initial": the mean train loss of the last 10 steps exceeds the step-1 loss.
   Sharpness, measured on a fixed held-out batch at step 0 and every --sharpness-every steps:
     logit sharpness (the paper's metric, as anchors.md describes it: Keskar et al.'s
       epsilon-sharpness with the perturbation on the logits instead of the weights):
         S = 100 * (max_{|d_i| <= eps (|z_i| + 1)} L(z + d) - L(z)) / (1 + L(z)),
       z the model's logits (in its own precision mode), L the mean next-token cross-entropy.
       dL/dz = softmax(z) - onehot(y) has a fixed sign inside the box (negative on the label,
       positive elsewhere), so L is monotone per coordinate there and the maximum is exactly at
       d = eps (|z| + 1) * (+1 off-label, -1 on the label): computed in closed form, no search.
     Hessian lambda_max (extra): the largest-magnitude eigenvalue of the loss Hessian in the
       parameters at the final weights (negative: a saddle direction dominates), by
       --hessian-iters power iterations of exact Hessian-vector products
       (jvp of grad) through the float32 "bf16"-mode model (the FP8 ops' custom VJPs have no
       second derivatives), on the same batch.
   The learning rate is a runtime multiplier on one compiled train step per mode
   (coat_jax.training.build.build with lr=1 and extra_tx=optax.inject_hyperparams(scale)):
   AdamW's update is linear in lr, so this is the same run as lr in the schedule, without a
   compile per lr.
2. Optimizer-state formats: m/v format (the same for both) in {E4M3, E5M2, INT8} x expansion
   on/off: (a) quantization error (relative MSE, float64) of REAL Adam moments, the float32 m and v
   of an optax.adamw run of this model (seed 0, --format-lr), per tensor over the tensors
   coat_adamw quantizes, with coat_jax.expansion's quantize/dequantize (codes materialised
   between two jits, and checked first against a float64 numpy quantizer: _moments.py says why);
   geometric mean over tensors
   and pooled; (b) the final loss of a --format-steps run with coat_adamw in that format (model
   in --format-precision, bf16 by default, so only the optimizer state differs from the adamw run).

Outputs in --out: stability.json (every run's loss curve and metrics), stability.md (tables),
stability.png (loss curves per lr, bf16 vs coat, and logit sharpness over training).

GPU (H100, 2026-11-23: the sweep of 3 modes x 3 seeds x 3 lrs took 218 s, mostly compiles, and
left no time for the format runs within --seconds-budget 270), so as two commands with different
--out directories (each writes its own stability.json/md):
  python -m benchmarks.accuracy.stability --modes bf16+adamw,fp8_linear+adamw,coat+coat_adamw \
      --parts sweep --out $OUT/stab --seconds-budget 270
  python -m benchmarks.accuracy.stability --parts formats --out $OUT/stabf --seconds-budget 330
CPU smoke (~55 s on 2 busy cores):
  JAX_PLATFORMS=cpu python -m benchmarks.accuracy.stability --out /tmp/stab_smoke --steps 8 \\
      --seq-len 32 --batch 4 --seeds 0 --lrs 3e-3,3e-1 --sharpness-every 4 \\
      --hessian-iters 2 --format-lr 3e-3 --formats e4m3 \\
      --set model.num_layers=1 --set model.hidden_size=64 --set model.intermediate_size=128
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks._common import MODE_COLORS, Budget, config_parser, pyplot, save_figure
from benchmarks._moments import check_moment_round_trip, moment_round_trip
from coat_jax.training import build as build_lib, mesh as mesh_lib, schema
from coat_jax.training.dataset import TokenDataset

REPO = Path(__file__).resolve().parents[2]

MODES = ("bf16+adamw", "fp8_linear+adamw", "coat+coat_adamw")
# The "tiny" preset's shape on configs/tiny.yaml (which shrinks it further for CPU runs).
SMALL_MODEL = ["model.hidden_size=256", "model.intermediate_size=688", "model.num_layers=4",
               "model.num_heads=4", "model.num_kv_heads=2"]
LAST_K = 10  # steps averaged for the "final" train loss


def parse_args(argv=None) -> argparse.Namespace:
  p = config_parser(__doc__, "tiny.yaml",
                    "run config override (repeatable), after the small-model defaults")
  p.add_argument("--modes", default="bf16+adamw,coat+coat_adamw")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--lrs", default="3e-3,3e-2,3e-1",
                 help="peak learning rates: tiny.yaml's 3e-3, x10, x100 (to reach the edge of stability)")
  p.add_argument("--steps", type=int, default=400)
  p.add_argument("--seq-len", type=int, default=256)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--check-every", type=int, default=25, help="fetch losses (and stop on NaN) this often")
  p.add_argument("--sharpness-every", type=int, default=50)
  p.add_argument("--sharpness-eps", type=float, default=5e-4, help="Keskar et al.'s epsilon")
  p.add_argument("--hessian-iters", type=int, default=10, help="0: no Hessian lambda_max")
  p.add_argument("--parts", default="sweep,formats", help="sweep, formats or both")
  p.add_argument("--formats", default="e4m3,e5m2,int8")
  p.add_argument("--format-steps", type=int, default=None,
                 help="default: --steps; 0: quantization errors only, no coat_adamw runs")
  p.add_argument("--format-lr", type=float, default=None, help="default: the middle of --lrs")
  p.add_argument("--format-precision", default="bf16", choices=("bf16", "fp8_linear", "coat"))
  p.add_argument("--out", default="runs/stability")
  p.add_argument("--seconds-budget", type=float, default=None)
  args = p.parse_args(argv)
  args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
  bad = [m for m in args.modes if m not in MODES]
  if bad:
    p.error(f"unknown modes {bad}; choose from {MODES}")
  args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
  args.lrs = [float(s) for s in args.lrs.split(",") if s.strip()]
  args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
  args.parts = {s.strip() for s in args.parts.split(",") if s.strip()}
  if args.parts - {"sweep", "formats"}:
    p.error(f"--parts: unknown {sorted(args.parts - {'sweep', 'formats'})}")
  for name in ("steps", "seq_len", "batch", "check_every"):
    if getattr(args, name) <= 0:
      p.error(f"--{name.replace('_', '-')} must be > 0")
  if not args.seeds or not args.lrs or not args.modes:
    p.error("--seeds, --lrs and --modes must not be empty")
  if args.format_steps is None:
    args.format_steps = args.steps
  if args.format_lr is None:
    args.format_lr = sorted(args.lrs)[len(args.lrs) // 2]
  return args


def say(msg: str) -> None:
  print(msg, flush=True)


# ----------------------------------------------------------------------------------------------
# Metrics.


def logit_sharpness(logits: jax.Array, labels: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
  """(sharpness %, loss): Keskar's epsilon-sharpness in logit space, exact (see the module doc).

  logits (B, S, V) float, labels (B, S) int. The box is |d_i| <= eps (|z_i| + 1).
  """
  z = logits.astype(jnp.float32)
  onehot = jax.nn.one_hot(labels, z.shape[-1], dtype=jnp.float32)
  sign = 1.0 - 2.0 * onehot  # +1 off the label, -1 on it: the sign of dL/dz everywhere in the box
  loss = build_lib.cross_entropy(z, labels)
  worst = build_lib.cross_entropy(z + eps * (jnp.abs(z) + 1.0) * sign, labels)
  return 100.0 * (worst - loss) / (1.0 + loss), loss


def _tree_vdot(a, b):
  return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def make_hessian_lmax(parts: build_lib.ModelParts, iters: int):
  """jit fn(params, rest, tokens, key) -> Rayleigh quotient after `iters` power iterations."""

  def loss(params, rest, tokens):
    logits = parts.merge(params, rest)(tokens[:, :-1])
    return build_lib.cross_entropy(logits, tokens[:, 1:])

  @jax.jit
  def lmax(params, rest, tokens, key):
    params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    v = treedef.unflatten([jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves)])
    grad = lambda p: jax.grad(loss)(p, rest, tokens)

    def body(_, carry):
      v, _ = carry
      v = jax.tree.map(lambda x: x / jnp.sqrt(_tree_vdot(v, v)), v)
      hv = jax.jvp(grad, (params,), (v,))[1]
      return hv, _tree_vdot(v, hv)

    _, lam = jax.lax.fori_loop(0, iters, body, (v, jnp.float32(0.0)))
    return lam

  return lmax


def quant_error(x: np.ndarray, fmt: str, group_size: int, expand_min: int,
                expand: bool) -> tuple[float, float, int, int]:
  """(sum (x - deq(q(x)))^2, sum x^2, #non-zero x flushed to 0, #non-zero x), float64 sums.

  Uses coat_jax.expansion's compact form, as coat_adamw stores its moments, with the FP8 codes
  materialised between two jits (_moments.moment_round_trip: inside one jit XLA GPU drops the
  rounding).
  """
  out = moment_round_trip(x, fmt, group_size, expand_min, expand)
  x64 = np.asarray(x, np.float64)
  nz = x64 != 0
  return (float(np.sum((out - x64) ** 2)), float(np.sum(x64 ** 2)), int(np.sum(nz & (out == 0))),
          int(np.sum(nz)))


# ----------------------------------------------------------------------------------------------
# Runs.


@dataclasses.dataclass
class Mode:
  """One compiled (precision, optimizer) setup, shared by all seeds and learning rates."""
  name: str
  cfg: schema.RunConfig
  built: build_lib.Built
  sharpness: object


class Study:
  """The small model's data, mesh and compiled modes."""

  def __init__(self, args: argparse.Namespace):
    self.args = args
    overrides = SMALL_MODEL + [
        f"model.max_seq_len={args.seq_len}", f"data.seq_len={args.seq_len}",
        f"data.batch_size={args.batch}", f"run.steps={args.steps}", "mesh.data=1",
        "run.progress=false", "run.tensorboard=false"] + list(args.overrides)
    self.base = schema.load(args.config, overrides)
    self.mesh = mesh_lib.make_mesh(self.base.mesh)
    self.rep = mesh_lib.replicated(self.mesh)
    self.batch_sh = mesh_lib.batch_sharding(self.mesh)
    self.datasets: dict[int, TokenDataset] = {}
    ds = self.dataset(0)
    self.vocab = ds.vocab_size
    self.eval_batches = [mesh_lib.put_batch(b, self.batch_sh)
                         for b in ds.eval_batches(max(1, self.base.data.eval_batches))]
    self.probe = self.eval_batches[0]  # the fixed held-out batch for sharpness
    self.modes: dict[str, Mode] = {}
    self._hessian = None

  def dataset(self, seed: int) -> TokenDataset:
    if seed not in self.datasets:
      self.datasets[seed] = build_lib.dataset_from_config(self.base.data, seed, log=say)
    return self.datasets[seed]

  def mode(self, name: str, steps: int, **opt_overrides) -> Mode:
    """Builds (once per distinct setup) the model, optimizer and jitted steps for `name`."""
    key = (name, steps, tuple(sorted(opt_overrides.items())))
    if key in self.modes:
      return self.modes[key]
    precision, opt_name = name.split("+")
    opt = dataclasses.replace(self.base.optimizer, name=opt_name, lr=1.0, **opt_overrides)
    cfg = dataclasses.replace(self.base, precision=precision, optimizer=opt)
    built = build_lib.build(cfg, self.mesh, vocab_size=self.vocab, total_steps=steps, seed=0,
                            extra_tx=optax.inject_hyperparams(optax.scale)(step_size=1.0))
    parts, eps = built.parts, self.args.sharpness_eps

    @jax.jit
    def sharpness(params, rest, tokens):
      logits = parts.merge(params, rest)(tokens[:, :-1])
      return logit_sharpness(logits, tokens[:, 1:], eps)

    m = Mode(name, cfg, built, sharpness)
    self.modes[key] = m
    return m

  def hessian(self, iters: int):
    """The float32 "bf16"-mode model's Hessian lambda_max function (built once)."""
    if self._hessian is None:
      cfg = dataclasses.replace(self.base, precision="bf16",
                                model=dataclasses.replace(self.base.model, dtype="float32"))
      parts, _ = build_lib.model_parts(build_lib.model_config(cfg, self.vocab), 0, self.mesh)
      self._hessian = make_hessian_lmax(parts, iters)
    return self._hessian

  def train(self, mode: Mode, seed: int, lr: float, steps: int, *, sharpness_every: int = 0,
            hessian_iters: int = 0, keep_state: bool = False) -> dict:
    """One run; returns its record (losses per step, divergence flags, eval loss, sharpness)."""
    t0 = time.time()
    params, opt_state, rest = mode.built.init(seed)
    scale_state = opt_state[1]
    hyper = dict(scale_state.hyperparams)
    hyper["step_size"] = jax.device_put(jnp.asarray(lr, hyper["step_size"].dtype), self.rep)
    opt_state = (opt_state[0], scale_state._replace(hyperparams=hyper))
    ds = self.dataset(seed)
    rec = {"mode": mode.name, "seed": seed, "lr": lr, "steps": steps, "losses": [],
           "sharpness": [], "nonfinite_step": None}

    def probe(step):
      s, l = jax.device_get(mode.sharpness(params, rest, self.probe))
      rec["sharpness"].append([step, float(s), float(l)])

    if sharpness_every:
      probe(0)
    pending = []
    for step in range(1, steps + 1):
      tokens = mesh_lib.put_batch(ds.train_batch(step - 1), self.batch_sh)
      params, opt_state, rest, out = mode.built.train_step(params, opt_state, rest, tokens)
      pending.append(out["loss"])
      if step % self.args.check_every == 0 or step == steps:
        rec["losses"] += [float(x) for x in jax.device_get(pending)]
        pending = []
        bad = [i for i, x in enumerate(rec["losses"]) if not math.isfinite(x)]
        if bad:
          rec["nonfinite_step"] = bad[0] + 1
          break
      if sharpness_every and step % sharpness_every == 0:
        probe(step)
    losses = rec["losses"]
    rec["initial_loss"] = losses[0]
    rec["final_loss"] = float(np.mean(losses[-LAST_K:]))
    rec["div_nonfinite"] = rec["nonfinite_step"] is not None
    rec["div_final_gt_initial"] = (not rec["div_nonfinite"]) and rec["final_loss"] > rec["initial_loss"]
    rec["diverged"] = rec["div_nonfinite"] or rec["div_final_gt_initial"]
    if not rec["div_nonfinite"]:
      rec["eval_loss"] = float(np.mean(jax.device_get([mode.built.eval_step(params, rest, b)
                                                       for b in self.eval_batches])))
      if sharpness_every and (not rec["sharpness"] or rec["sharpness"][-1][0] != len(losses)):
        probe(len(losses))
      if hessian_iters:
        rec["hessian_lmax"] = float(self.hessian(hessian_iters)(params, rest, self.probe,
                                                                jax.random.key(seed)))
    else:
      rec["eval_loss"] = None
    rec["wall_s"] = time.time() - t0
    if keep_state:
      rec["_opt_state"] = opt_state
    return rec


def describe(rec: dict) -> str:
  flag = ("NaN at step %d" % rec["nonfinite_step"] if rec["div_nonfinite"] else
          "final>initial" if rec["div_final_gt_initial"] else "ok")
  sharp = rec["sharpness"][-1][1] if rec.get("sharpness") else None
  return (f"{rec['mode']:16} seed {rec['seed']} lr {rec['lr']:.1e}: loss {rec['initial_loss']:.3f} -> "
          f"{rec['final_loss']:.3f}, eval {_f(rec.get('eval_loss'), '.3f')}, sharpness "
          f"{_f(sharp, '.3f')}, lambda_max {_f(rec.get('hessian_lmax'), '.1f')} [{flag}] "
          f"{rec['wall_s']:.1f} s")


def _f(v, spec):
  return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


# ----------------------------------------------------------------------------------------------
# Parts of the study.


def run_sweep(study: Study, args, budget: Budget, runs: list[dict], on_run=lambda: None) -> list[dict]:
  """Appends every (mode, seed, lr) run to `runs` (calling on_run after each); returns `runs`."""
  est = {}
  for lr in args.lrs:  # interleaved, so that a cut-short sweep still pairs the modes
    for seed in args.seeds:
      for name in args.modes:
        if budget.left() < est.get(name, 20.0):
          say(f"[sweep] {name} seed {seed} lr {lr:.1e}: skipped ({budget.left():.0f} s left)")
          runs.append({"mode": name, "seed": seed, "lr": lr, "skipped": True})
          continue
        mode = study.mode(name, args.steps)
        rec = study.train(mode, seed, lr, args.steps, sharpness_every=args.sharpness_every,
                          hessian_iters=args.hessian_iters)
        est[name] = 1.2 * rec["wall_s"] if name in est else 0.6 * rec["wall_s"]
        say("[sweep] " + describe(rec))
        runs.append(rec)
        on_run()
  return runs


def run_formats(study: Study, args, budget: Budget) -> dict:
  """Quantization error of real Adam moments and short-run losses per state format."""
  opt = study.base.optimizer
  out = {"lr": args.format_lr, "steps": args.format_steps or args.steps, "precision": args.format_precision,
         "group_size": opt.group_size, "expand_min": opt.expand_min, "rows": []}
  ref_name = f"{args.format_precision}+adamw"
  for fmt in args.formats:  # aborts (one line) if this device does not really round to fmt
    out.setdefault("round_trip_check", {})[fmt] = {
        f"expand={e}": v for e, v in check_moment_round_trip(fmt, opt.group_size, opt.expand_min).items()}
  if budget.left() < 30:
    say("[formats] skipped: no time left")
    return out
  ref_steps = args.format_steps or args.steps  # the moments come from a run of this length
  ref = study.train(study.mode(ref_name, ref_steps), 0, args.format_lr, ref_steps, keep_state=True)
  say("[formats] reference " + describe(ref))
  adam = [s for s in jax.tree.leaves(ref.pop("_opt_state"),
                                     is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
          if isinstance(s, optax.ScaleByAdamState)][0]
  names = [mesh_lib.path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(adam.mu)]
  mus, nus = jax.device_get(jax.tree.leaves(adam.mu)), jax.device_get(jax.tree.leaves(adam.nu))
  chosen = [i for i, m in enumerate(mus) if m.ndim >= 2 and m.size >= opt.min_quantized_size]
  out["reference"] = {k: ref.get(k) for k in ("initial_loss", "final_loss", "eval_loss", "diverged")}
  out["tensors"] = [names[i] for i in chosen]
  say(f"[formats] real moments: {len(chosen)} tensors of the {ref_name} run after {len(ref['losses'])} steps")
  est = 30.0  # seconds a format run needs (a compile each); updated from the runs
  for fmt in args.formats:
    for expand in (False, True):
      row = {"format": fmt, "expand": expand}
      for moment, xs in (("m", mus), ("v", nus)):
        parts = [quant_error(xs[i], fmt, opt.group_size, opt.expand_min, expand) for i in chosen]
        per = [e / s for e, s, _, _ in parts if s > 0]
        row[f"{moment}_rel_mse_geomean"] = float(np.exp(np.mean(np.log(np.maximum(per, 1e-300)))))
        row[f"{moment}_rel_mse_pooled"] = float(sum(p[0] for p in parts) / sum(p[1] for p in parts))
        row[f"{moment}_flushed_frac"] = sum(p[2] for p in parts) / max(1, sum(p[3] for p in parts))
      if args.format_steps and budget.left() > est:
        mode = study.mode(f"{args.format_precision}+coat_adamw", args.format_steps, m_format=fmt,
                          v_format=fmt, expand=expand)
        rec = study.train(mode, 0, args.format_lr, args.format_steps)
        row.update(final_loss=rec["final_loss"], eval_loss=rec["eval_loss"], diverged=rec["diverged"],
                   nonfinite_step=rec["nonfinite_step"], wall_s=rec["wall_s"])
        est = max(est, 1.2 * rec["wall_s"])
      else:
        row["skipped_run"] = bool(args.format_steps)
      say(f"[formats] {fmt} expand={expand}: m rel MSE {row['m_rel_mse_geomean']:.3e} (flushed "
          f"{100 * row['m_flushed_frac']:.2f}%), v rel MSE {row['v_rel_mse_geomean']:.3e} (flushed "
          f"{100 * row['v_flushed_frac']:.2f}%), final loss {_f(row.get('final_loss'), '.4f')}")
      out["rows"].append(row)
  return out


# ----------------------------------------------------------------------------------------------
# Report.


def _mean_std(xs):
  xs = [x for x in xs if x is not None and math.isfinite(x)]
  if not xs:
    return "n/a"
  return f"{statistics.mean(xs):.4f}" + (f" ± {statistics.stdev(xs):.4f}" if len(xs) > 1 else "")


def markdown(args, runs: list[dict], formats: dict | None, meta: dict) -> str:
  lines = [f"# Stability: {meta['model']}", "",
           f"{args.steps} steps of {args.batch} x {args.seq_len} tokens, seeds {args.seeds}, "
           f"device {meta['device']}. Divergence: **nonfinite** = a NaN/inf train loss; "
           f"**final>initial** = mean train loss of the last {LAST_K} steps above the step-1 loss. "
           f"Sharpness: logit epsilon-sharpness (eps {args.sharpness_eps:g}) on a held-out batch "
           f"at the end; lambda_max: the Hessian's largest-magnitude eigenvalue ({args.hessian_iters} "
           f"power iterations, float32 bf16-mode model). "
           f"Means over the non-diverged seeds.", ""]
  done = [r for r in runs if not r.get("skipped")]
  if done:
    lines += ["| mode | lr | runs | nonfinite | final>initial | final train loss | eval loss | "
              "logit sharpness | lambda_max |", "|---|---|---|---|---|---|---|---|---|"]
    for name in args.modes:
      for lr in args.lrs:
        rs = [r for r in done if r["mode"] == name and r["lr"] == lr]
        if not rs:
          continue
        ok = [r for r in rs if not r["diverged"]]
        lines.append(
            f"| {name} | {lr:.1e} | {len(rs)} | {sum(r['div_nonfinite'] for r in rs)} | "
            f"{sum(r['div_final_gt_initial'] for r in rs)} | {_mean_std([r['final_loss'] for r in ok])} | "
            f"{_mean_std([r['eval_loss'] for r in ok])} | "
            f"{_mean_std([r['sharpness'][-1][1] for r in ok if r['sharpness']])} | "
            f"{_mean_std([r.get('hessian_lmax') for r in ok])} |")
    lines += ["", "| mode | runs | diverged (either) | nonfinite | final>initial |", "|---|---|---|---|---|"]
    for name in args.modes:
      rs = [r for r in done if r["mode"] == name]
      lines.append(f"| {name} | {len(rs)} | {sum(r['diverged'] for r in rs)} | "
                   f"{sum(r['div_nonfinite'] for r in rs)} | {sum(r['div_final_gt_initial'] for r in rs)} |")
    skipped = [r for r in runs if r.get("skipped")]
    if skipped:
      lines += ["", f"{len(skipped)} runs skipped for the time budget."]
  if formats and formats.get("rows"):
    ref = formats.get("reference", {})
    lines += ["", f"## Optimizer-state formats (m and v in the same format, groups of "
              f"{formats['group_size']})", "",
              f"Relative MSE of real Adam moments ({len(formats.get('tensors', []))} tensors of a "
              f"{formats['precision']}+adamw run, seed 0, lr {formats['lr']:.1e}, "
              f"{formats['steps']} steps): geometric mean over tensors (pooled in brackets). "
              f"Flushed: share of the non-zero moment entries that dequantize to exactly 0 (a v "
              f"flushed to 0 under a non-zero m gives an update of m / eps). Final "
              f"loss: mean train loss of the last {LAST_K} steps of a {formats['steps']}-step "
              f"{formats['precision']}+coat_adamw run; float32 moments (optax.adamw): "
              f"{_f(ref.get('final_loss'), '.4f')} (eval {_f(ref.get('eval_loss'), '.4f')}). "
              f"Round trips checked on this device against a float64 numpy quantizer (relative "
              f"MSE of a sample, ours / numpy): " + "; ".join(
                  f"{fmt} " + ", ".join(f"{k} {a:.2e} / {b:.2e}" for k, (a, b) in v.items())
                  for fmt, v in formats.get("round_trip_check", {}).items()) + ".", "",
              "| format | expand | m rel MSE | v rel MSE | m flushed | v flushed | final train loss | "
              "Δ vs fp32 moments | eval loss |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in formats["rows"]:
      have = r.get("final_loss") is not None and ref.get("final_loss") is not None
      d = r["final_loss"] - ref["final_loss"] if have else None
      lines.append(f"| {r['format']} | {'on' if r['expand'] else 'off'} | "
                   f"{r['m_rel_mse_geomean']:.2e} ({r['m_rel_mse_pooled']:.1e}) | "
                   f"{r['v_rel_mse_geomean']:.2e} ({r['v_rel_mse_pooled']:.1e}) | "
                   f"{100 * r['m_flushed_frac']:.2f}% | {100 * r['v_flushed_frac']:.2f}% | "
                   + ("skipped (time budget) | | |" if r.get("skipped_run") else
                      f"{_f(r.get('final_loss'), '.4f')} | {_f(d, '+.4f')} | {_f(r.get('eval_loss'), '.4f')} |"))
  return "\n".join(lines) + "\n"


def plot(args, runs: list[dict], path: Path) -> bool:
  done = [r for r in runs if not r.get("skipped") and r.get("losses")]
  if not done:
    return False
  plt = pyplot()
  lrs = [lr for lr in args.lrs if any(r["lr"] == lr for r in done)]
  fig, axes = plt.subplots(2, len(lrs), figsize=(5 * len(lrs), 7.5), dpi=100, squeeze=False)
  colors = MODE_COLORS
  for j, lr in enumerate(lrs):
    ax, bx = axes[0, j], axes[1, j]
    for r in [r for r in done if r["lr"] == lr]:
      y = np.asarray(r["losses"], np.float64)
      k = max(1, min(10, len(y) // 20))
      smooth = np.convolve(np.where(np.isfinite(y), y, np.nan), np.ones(k) / k, mode="valid")
      label = r["mode"] if r["seed"] == args.seeds[0] else None
      ls = ["-", "--", ":"][args.seeds.index(r["seed"]) % 3] if r["seed"] in args.seeds else "-"
      ax.plot(np.arange(k, k + len(smooth)), smooth, ls, color=colors.get(r["mode"]), lw=1.2,
              label=label)
      if r["div_nonfinite"]:
        ax.axvline(r["nonfinite_step"], color=colors.get(r["mode"]), alpha=0.4, lw=0.8)
      if r["sharpness"]:
        s = np.asarray(r["sharpness"])
        bx.plot(s[:, 0], s[:, 1], ls + "o", color=colors.get(r["mode"]), lw=1, ms=2.5, label=label)
    firsts = [r["losses"][0] for r in done if r["lr"] == lr and math.isfinite(r["losses"][0])]
    if firsts:  # keep the scale readable when a run blows up
      ax.set_ylim(top=1.5 * max(firsts))
    ax.set_title(f"lr {lr:.1e} (line style = seed)")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (moving mean)")
    ax.grid(alpha=0.3)
    ax.legend()
    bx.set_xlabel("step")
    bx.set_ylabel(f"logit sharpness (eps {args.sharpness_eps:g}), %")
    bx.grid(alpha=0.3)
    bx.legend()
  return save_figure(fig, path)


def main(argv=None) -> dict:
  args = parse_args(argv)
  budget = Budget(args.seconds_budget, reserve=15.0)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  study = Study(args)
  dev = jax.devices()[0]
  meta = {"device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
          "model": f"{study.base.model.preset} preset, hidden {study.base.model.hidden_size}, "
                   f"{study.base.model.num_layers} layers, vocab {study.vocab}"}
  say(f"[stability] {meta['model']}; {len(args.modes)} modes x {len(args.seeds)} seeds x "
      f"{len(args.lrs)} lrs, {args.steps} steps; parts {sorted(args.parts)}; device {meta['device']}")
  result = {"args": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()},
            "meta": meta, "runs": [], "formats": None}

  def save():
    (out / "stability.json").write_text(json.dumps(result, indent=1))
    (out / "stability.md").write_text(markdown(args, result["runs"], result["formats"], meta))

  if "sweep" in args.parts:
    run_sweep(study, args, budget, result["runs"], on_run=save)  # saved after every run
    plot(args, result["runs"], out / "stability.png")
  if "formats" in args.parts:
    result["formats"] = run_formats(study, args, budget)
  save()
  say("\n" + (out / "stability.md").read_text())
  say(f"[stability] wrote {out}/stability.json, stability.md"
      + (", stability.png" if (out / "stability.png").exists() else "")
      + f" in {time.time() - budget.t0:.0f} s")
  return result


if __name__ == "__main__":
  main()
