"""Knowing before running (coat_jax/training/plan.py): XLA's predicted peak before the first step,
`auto` remat and microbatches, `train.py --plan`, and one line with exit 4 for a step that does
not fit, predicted (before anything is allocated) or met during the run (the last checkpoint kept).

The device limit is `run.device_memory_limit` (a CPU reports none), set between the predicted peaks
of two settings, so each assertion would fail if the planner chose or listed the wrong one."""
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from coat_jax.training import mesh as mesh_lib
from coat_jax.training import metrics as metrics_lib
from coat_jax.training import plan as plan_lib
from coat_jax.training import schema
from coat_jax.training.build import build
from coat_jax.training.checkpoint import Checkpointer
from coat_jax.errors import EXIT_OUT_OF_MEMORY, OutOfMemoryError
from coat_jax.training.loop import run
from coat_jax.training.plan import Planner, Setting
from tests.test_training_cli import MINI

REPO = Path(__file__).resolve().parents[1]
QUIET = lambda _: None


def mini(cache, *extra):
  return schema.load(None, MINI + [f"data.cache_dir={cache}", "run.progress=false",
                                   "run.tensorboard=false", *extra])


@pytest.fixture(scope="module")
def planner(cache):
  """A planner of the mini run with `auto` remat and microbatches, no device limit yet."""
  cfg = mini(cache, "model.remat=auto", "optimizer.accumulate=auto")
  return Planner(cfg, mesh_lib.make_mesh(cfg.mesh), 512, log=QUIET)


def test_prediction_is_the_state_plus_the_step_workspace(planner):
  cfg = planner.cfg
  pred = planner.predict(Setting.of(cfg, "none", 1))
  params, opt_state, rest = pred.built.abstract_state()
  state = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
              for x in jax.tree.leaves((params, opt_state, rest)))
  tokens = cfg.data.batch_size * (cfg.data.seq_len + 1) * 4
  assert pred.memory["argument_size_in_bytes"] == state + tokens   # what persists, and the batch
  assert pred.memory["alias_size_in_bytes"] >= state - 64          # donated: new state in place
  assert pred.peak == (pred.memory["argument_size_in_bytes"] + pred.memory["output_size_in_bytes"]
                       - pred.memory["alias_size_in_bytes"] + pred.memory["temp_size_in_bytes"])
  assert pred.peak > pred.floor > pred.state > 0
  # More microbatches and more recompute each hold less at this size (what `auto` relies on).
  assert planner.predict(Setting.of(cfg, "none", 2)).peak < pred.peak


def test_auto_takes_the_fewest_microbatches_without_remat_that_fit(planner):
  none1 = planner.predict(Setting.of(planner.cfg, "none", 1))
  none2 = planner.predict(Setting.of(planner.cfg, "none", 2))
  planner.limit = (none1.peak + none2.peak) // 2
  compiles = planner.compiles
  chosen = planner.choose()
  assert chosen.setting == Setting.of(planner.cfg, "none", 2), chosen.setting
  assert chosen.compiled is not None and planner.compiles == compiles  # no second compile
  assert chosen.cfg.model.remat == "none" and chosen.cfg.optimizer.accumulate == 2
  # Timed: every policy with fewer microbatches than those before it is run; the fastest wins.
  timed = Planner(planner.cfg, planner.mesh, 512, log=QUIET)
  timed.predictions, timed.limit = planner.predictions, planner.limit
  timed.cfg = mini(Path(planner.cfg.data.cache_dir), "model.remat=auto",
                   "optimizer.accumulate=auto", "run.plan_timed_steps=1")
  found = timed.candidates(all_policies=True)
  assert [p.setting.accumulate for p in found] == sorted({p.setting.accumulate for p in found},
                                                          reverse=True)
  assert found[0].setting == chosen.setting and all(p.peak <= timed.limit for p in found)
  batch = np.random.default_rng(20261123).integers(0, 512, (8, 33), dtype=np.int32)
  winner = timed.choose(sample_batch=batch)
  assert all(p.step_s is not None and p.step_s > 0 for p in found)
  assert winner.step_s == min(p.step_s for p in found)
  planner.limit = None


def test_a_tight_candidate_brings_its_policy_next_microbatch_count_to_the_timing(planner):
  """Timed auto: a candidate predicted within plan_lib.TIGHT of the limit (XLA may have added
  recompute to fit it) is timed against its policy's next microbatch count; a loose one is not."""
  none1 = planner.predict(Setting.of(planner.cfg, "none", 1))
  none2 = planner.predict(Setting.of(planner.cfg, "none", 2))
  timed = Planner(planner.cfg, planner.mesh, 512, log=QUIET)
  timed.predictions = planner.predictions
  timed.limit = int(none2.peak / (plan_lib.TIGHT + 0.01))   # none/2 tight
  assert none1.peak > timed.limit, (none1.peak, timed.limit)
  found = [p.setting for p in timed.candidates(all_policies=True)]
  assert found[:2] == [Setting.of(planner.cfg, "none", 2), Setting.of(planner.cfg, "none", 4)]
  assert len(found) == len(set(found))
  assert all(s.accumulate < 2 for s in found[2:])   # later policies still need fewer than 2
  assert [p.setting for p in timed.candidates(all_policies=False)] == found[:1]  # untimed: one
  timed.limit = int(none2.peak / 0.9)   # none/2 loose, none/1 still over
  assert none1.peak > timed.limit, (none1.peak, timed.limit)
  assert Setting.of(planner.cfg, "none", 4) not in [
      p.setting for p in timed.candidates(all_policies=True)]


def _limit_below_configured(planner) -> int:
  """A device limit that the mini run as configured (remat none, one microbatch) exceeds and a
  remat policy fits."""
  none1 = planner.predict(Setting.of(planner.cfg, "none", 1))
  full1 = planner.predict(Setting.of(planner.cfg, "full", 1))
  assert full1.peak < none1.peak
  return (none1.peak + full1.peak) // 2


def _train_py(*args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  return subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_a_step_that_does_not_fit_is_one_line_and_exit_4_and_plan_lists_what_fits(
    planner, cache, tmp_path, compile_cache):
  limit = _limit_below_configured(planner)
  out = tmp_path / "run"
  common = ["--no-progress", "--out-dir", str(out)]
  for item in MINI + [f"data.cache_dir={cache}", f"run.device_memory_limit={limit}",
                      f"run.compile_cache={compile_cache}"]:
    common += ["--set", item]
  proc = _train_py(*common)
  assert proc.returncode == EXIT_OUT_OF_MEMORY, proc.stderr[-3000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: the train step does not fit"), lines
  none1 = planner.predict(Setting.of(planner.cfg, "none", 1))
  line = lines[0]
  for text in (plan_lib._size(none1.peak), plan_lib._size(limit), "remat none",
               "--set model.remat=", "--set optimizer.accumulate=", "--set data.batch_size="):
    assert text in line, (text, line)
  assert not out.exists()  # nothing written: the check comes before the output directory

  proc = _train_py(*common, "--plan")
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [l.split() for l in proc.stdout.splitlines() if l.startswith("  ")]
  configured = next(r for r in rows if r[:2] == ["as", "configured"])
  assert configured[2:4] == ["none", "1"] and "no" in configured, rows
  fitting = [r for r in rows if r[0] == "fits"]
  assert fitting and all("yes" in r for r in fitting), rows
  assert "reports no memory limit" not in proc.stdout
  assert any("model.remat=" in " ".join(r) for r in fitting), rows
  assert not out.exists()


def test_out_of_memory_during_the_run_is_one_line_and_keeps_the_last_checkpoint(
    cache, tmp_path, monkeypatch):
  """A device OOM at step 3 (XLA's RESOURCE_EXHAUSTED, simulated): OutOfMemoryError naming the
  allocation, the predicted peak and what fits; the checkpoint of step 2 restores."""
  choose = Planner.choose

  def failing_at_step_3(self, *args, **kwargs):
    pred = choose(self, *args, **kwargs)
    step, calls = pred.compiled, []

    def run_step(*a):
      calls.append(1)
      if len(calls) == 3:
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.50GiB.")
      return step(*a)
    pred.compiled = run_step
    return pred

  monkeypatch.setattr(Planner, "choose", failing_at_step_3)
  cfg = mini(cache, f"run.out_dir={tmp_path}", "run.steps=4", "checkpoint.every=2")
  with pytest.raises(OutOfMemoryError) as e:
    run(cfg, log=QUIET)
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith("out of device memory during step 3"), msg
  for text in ("allocating 1.50GiB", "XLA predicted", "settings that fit: --set",
               "checkpoint of step 2", "is intact"):
    assert text in msg, (text, msg)
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]
  abstract = build(cfg, mesh_lib.make_mesh(cfg.mesh), vocab_size=512).abstract_state()
  template = dict(zip(("params", "opt_state", "rest"), abstract))
  ck = Checkpointer(tmp_path / "checkpoints", 0, 2, False)
  state, meta, step = ck.restore(template)
  ck.close()
  assert step == 2 and meta["step"] == 2
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state["params"]))


def test_a_run_after_timed_candidates_says_its_device_peak_includes_them(
    planner, cache, tmp_path, monkeypatch):
  """The device's peak counter has no reset: after the planner timed several candidates, the
  run's summary says its device peak covers them and records the trained step's prediction."""
  none1 = planner.predict(Setting.of(planner.cfg, "none", 1))
  none2 = planner.predict(Setting.of(planner.cfg, "none", 2))
  limit = (none1.peak + none2.peak) // 2
  monkeypatch.setattr(metrics_lib, "peak_memory_bytes", lambda devices: (limit, "device peak"))
  cfg = mini(cache, "model.remat=auto", "optimizer.accumulate=auto", "run.plan_timed_steps=1",
             f"run.device_memory_limit={limit}", f"run.out_dir={tmp_path}", "run.steps=1",
             "checkpoint.enabled=false")
  summary = run(cfg, log=QUIET)
  assert summary["peak_memory_kind"].startswith("device peak over the planner's timed candidates")
  assert 0 < summary["predicted_peak_bytes"] <= limit
  assert metrics_lib.format_bytes(summary["predicted_peak_bytes"]) in summary["peak_memory_kind"]


def test_schema_takes_auto_and_byte_sizes():
  cfg = schema.load(None, ["model.remat=auto", "optimizer.accumulate=auto",
                           "run.device_memory_limit=75GiB"])
  assert schema.parse_bytes(cfg.run.device_memory_limit, "k") == 75 * 2**30
  assert schema.parse_bytes(80e9, "k") == 80 * 10**9
  for bad, key in (("optimizer.accumulate=0", "optimizer.accumulate"),
                   ("model.remat=dot", "model.remat"),
                   ("run.device_memory_limit=5XB", "run.device_memory_limit")):
    with pytest.raises(ValueError, match=key):
      schema.load(None, [bad])


def test_plan_of_pretokenized_data_needs_no_files(cache, tmp_path):
  """`--plan` of a `data.kind: tokens` run whose files are not there yet: planned from the
  config's shapes, the same table as the same shapes from a dataset; the run still refuses."""
  from_data, lines = plan_lib.show(mini(cache), log=QUIET), []
  data = ["data.kind=tokens", f"data.paths=[{tmp_path}/tok/*.bin]", "data.dtype=uint16",
          "model.vocab_size=512"]   # the stdlib run's BPE vocabulary, which tokens do not bring
  tokens = mini(cache, *data)
  no_files = plan_lib.show(tokens, log=lines.append)
  rows = lambda table: [l for l in table.splitlines() if l.startswith("  ")]
  assert rows(no_files) and rows(no_files) == rows(from_data), (no_files, from_data)
  assert any("matches no files: planning from the config's shapes" in l for l in lines), lines
  assert "reports no memory limit" in no_files   # a CPU: the table says to plan on the GPU
  with pytest.raises(ValueError, match="matches no files"):
    run(mini(cache, *data, f"run.out_dir={tmp_path / 'run'}"), log=QUIET)


def test_coat_plans_offer_the_linears_remade_inputs(cache):
  """coat: `model.linear_residuals=remade` is one of the settings offered when a step does not
  fit (never chosen by `auto`: it changes the weight gradients' numerics)."""
  cfg = mini(cache, "precision=coat", "model.remat=none", "optimizer.accumulate=1")
  planner = Planner(cfg, mesh_lib.make_mesh(cfg.mesh), 512, log=QUIET)
  base = Setting.of(cfg)
  assert base.linear_residuals == "kept"
  kept = planner.predict(base)
  remade = planner.predict(base.replace(linear_residuals="remade"))
  print("predicted peaks, kept / remade:", kept.peak, remade.peak)
  assert remade.peak < kept.peak
  assert remade.setting.overrides(base) == ["model.linear_residuals=remade"]
  assert remade.cfg.model.linear_residuals == "remade"
  assert "linear inputs remade" in remade.setting.describe()
  offered = [p.setting for p in planner.alternatives(base, remade.peak)]
  assert base.replace(linear_residuals="remade") in offered, offered
