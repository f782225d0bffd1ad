"""A checkpoint written on one mesh resumes on another and continues the run: loss curves.

Three train.py runs of one config, each in its own process on the first N devices
(`_common.device_env`), FSDP over them (`mesh.data=1, mesh.fsdp=-1`), every step logged:
  straight  --devices-a devices, --steps steps;
  first     --devices-a devices, the same run stopped with a checkpoint after --split steps;
  resumed   --devices-b devices, `--resume` of `first`'s directory (its checkpoint, data position
            and schedule) to --steps;
and, with --reference, `straight` on --devices-b devices (how far two meshes differ anyway:
float32 sums in another order). Prints per-step losses after the split, the largest relative
difference, the final eval losses, and writes a PNG of the curves. Each run writes under a new
directory inside --out-dir; nothing is deleted.

GPU (2x H200; ~2 min with the tiny config):
  python -m benchmarks.mesh.resume_across_meshes --devices-a 2 --devices-b 1 --reference \\
      --set precision=coat --set optimizer.name=coat_adamw --json $OUT/resume.json --plot $OUT/resume.png
CPU smoke (simulated devices, ~2 min on 2 cores):
  JAX_PLATFORMS=cpu python -m benchmarks.mesh.resume_across_meshes --steps 8 --split 4 \\
      --set model.num_layers=1 --set data.batch_size=4 --set data.seq_len=32
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import config_parser, device_env, pyplot, save_figure

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv=None) -> argparse.Namespace:
  p = config_parser(__doc__, "tiny.yaml", "config override for every run (repeatable)")
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--split", type=int, default=20, help="the first run stops after this step")
  p.add_argument("--devices-a", type=int, default=2, help="devices of the straight and first runs")
  p.add_argument("--devices-b", type=int, default=1, help="devices of the resumed run")
  p.add_argument("--reference", action="store_true",
                 help="also run `straight` on --devices-b devices (the two meshes' own spread)")
  p.add_argument("--out-dir", default="runs/resume_across_meshes")
  p.add_argument("--timeout", type=float, default=600, help="seconds per train.py run")
  p.add_argument("--json", default=None)
  p.add_argument("--plot", default=None, help="PNG of the loss curves (default: in the run directory)")
  a = p.parse_args(argv)
  if not 0 < a.split < a.steps:
    p.error(f"--split must be in 1..--steps - 1, got {a.split} (--steps {a.steps})")
  if a.devices_a <= 0 or a.devices_b <= 0:
    p.error("--devices-a and --devices-b must be > 0")
  return a


def train(a, out: Path, devices: int, extra: list[str]) -> None:
  """One train.py process on `devices` devices; raises with its output's tail if it fails."""
  sets = ["mesh.data=1", "mesh.fsdp=-1", "run.log_every=1", f"run.steps={a.steps}",
          f"checkpoint.every={a.steps}", "run.eval_every=0", *a.overrides]
  cmd = [sys.executable, str(REPO / "train.py"), "--config", a.config, "--no-progress",
         "--out-dir", str(out), *extra]
  for s in sets:
    cmd += ["--set", s]
  env = {**os.environ, **device_env(devices), "PYTHONUNBUFFERED": "1"}
  env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  print(f"[resume] {out.name}: {devices} device(s) {' '.join(extra)}", flush=True)
  t0 = time.time()
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
  if proc.returncode:
    raise SystemExit(f"[resume] {out.name} failed (rc {proc.returncode}):\n"
                     f"{(proc.stdout + proc.stderr)[-2000:]}")
  done = [l for l in proc.stdout.splitlines() + proc.stderr.splitlines() if l.startswith("[done]")]
  print(f"[resume] {out.name}: {time.time() - t0:.0f} s; {done[-1] if done else ''}", flush=True)


def losses(out: Path) -> tuple[dict[int, float], float | None]:
  """({step: that step's one-batch train loss}, final eval loss) from a run's metrics.jsonl."""
  train_loss, evals = {}, {}
  for line in (out / "metrics.jsonl").read_text().splitlines():
    r = json.loads(line)
    if r.get("split") == "train" and r.get("loss_mean_steps") == 1:
      train_loss[r["step"]] = r["loss_last"]
    elif r.get("split") == "eval":
      evals[r["step"]] = r["loss"]
  return train_loss, evals[max(evals)] if evals else None


def main(argv=None) -> dict:
  a = parse_args(argv)
  root = Path(a.out_dir) / time.strftime("%Y%m%d-%H%M%S")
  root.mkdir(parents=True, exist_ok=False)
  train(a, root / "straight", a.devices_a, [])
  train(a, root / "resumed", a.devices_a, ["--stop-after", str(a.split)])
  train(a, root / "resumed", a.devices_b, ["--resume"])
  runs = {"straight": losses(root / "straight"), "resumed": losses(root / "resumed")}
  if a.reference:
    train(a, root / "reference", a.devices_b, [])
    runs["reference"] = losses(root / "reference")

  after = range(a.split + 1, a.steps + 1)
  s, r = runs["straight"][0], runs["resumed"][0]
  missing = [k for k in after if k not in s or k not in r]
  if missing:
    raise SystemExit(f"[resume] steps without a logged loss: {missing[:10]}")
  rel = {k: abs(r[k] - s[k]) / abs(s[k]) for k in after}
  head = f"{'step':>5} {'straight':>10} {'resumed':>10} {'rel diff':>9}"
  if a.reference:
    head += f" {'reference':>10} {'ref diff':>9}"
  print(f"\nAfter the split ({a.devices_a} -> {a.devices_b} devices at step {a.split}):\n{head}")
  ref = runs.get("reference", ({}, None))[0]
  for k in after:
    line = f"{k:5d} {s[k]:10.5f} {r[k]:10.5f} {rel[k]:9.2e}"
    if a.reference:
      line += f" {ref[k]:10.5f} {abs(ref[k] - s[k]) / abs(s[k]):9.2e}"
    print(line)
  summary = {"devices_a": a.devices_a, "devices_b": a.devices_b, "split": a.split,
             "steps": a.steps, "max_rel_diff_after_split": max(rel.values()),
             "final_eval": {n: v[1] for n, v in runs.items()},
             "loss": {n: v[0] for n, v in runs.items()}, "dir": str(root)}
  if a.reference:
    summary["max_rel_diff_reference"] = max(abs(ref[k] - s[k]) / abs(s[k]) for k in after)
  print(f"\nlargest relative difference after the split: resumed {summary['max_rel_diff_after_split']:.2e}"
        + (f", {a.devices_b}-device straight run {summary['max_rel_diff_reference']:.2e}"
           if a.reference else "")
        + "; final eval loss " + ", ".join(f"{n} {v}" for n, v in summary["final_eval"].items()))
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(7, 4))
  for name, (curve, _) in runs.items():
    steps = sorted(curve)
    ax.plot(steps, [curve[k] for k in steps], label=name, lw=1.2,
            ls="--" if name == "resumed" else "-")
  ax.axvline(a.split, color="gray", lw=0.8, ls=":")
  ax.set_xlabel("step")
  ax.set_ylabel("train loss (one batch)")
  ax.set_title(f"checkpoint on {a.devices_a} device(s), resumed on {a.devices_b} at step {a.split}")
  ax.legend()
  plot = Path(a.plot) if a.plot else root / "resume.png"
  save_figure(fig, plot)
  print(f"[resume] plot {plot}; runs under {root}")
  if a.json:
    Path(a.json).write_text(json.dumps(summary, indent=1))
  return summary


if __name__ == "__main__":
  main()
