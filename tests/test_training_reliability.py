"""Reliability of runs: earlier runs are never clobbered, signals give 128 + N, logs survive a
kill, and the numbers reported are named for what they are."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coat_jax.training import schema
from coat_jax.training.loop import run
from coat_jax.training.step_log import summary_line
from tests.test_training_cli import MINI as CLI_MINI

REPO = Path(__file__).resolve().parents[1]
# test_training_cli's minuscule run, without the progress bar and TensorBoard.
MINI = CLI_MINI + ["run.progress=false", "run.tensorboard=false"]
QUIET = lambda _: None


def mini(cache, out_dir, *extra):
  return schema.load(None, MINI + [f"data.cache_dir={cache}", f"run.out_dir={out_dir}", *extra])


def test_fresh_run_into_an_earlier_run_is_refused_until_overwrite(cache, tmp_path):
  first = run(mini(cache, tmp_path, "run.steps=2"), log=QUIET)
  before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
  assert (tmp_path / "metrics.jsonl") in before and first["step"] == 2
  with pytest.raises(ValueError) as e:
    run(mini(cache, tmp_path, "run.steps=3"), log=QUIET)
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith(f"{tmp_path} holds an earlier run")
  for choice in ("--resume", "--out-dir", "--overwrite", "metrics.jsonl", "checkpoints 2"):
    assert choice in msg, msg
  assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == before  # untouched
  second = run(mini(cache, tmp_path, "run.steps=3"), log=QUIET, overwrite=True)
  records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert second["step"] == 3 and [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3]
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3"]
  resumed = run(mini(cache, tmp_path, "run.steps=4"), log=QUIET, resume=True,  # --resume: allowed
                allow_steps_change=True)
  assert resumed["step"] == 4


def test_loss_names_and_the_true_first_loss_after_resume(cache, tmp_path):
  a = run(mini(cache, tmp_path, "run.steps=6", "run.log_every=3"), stop_after=3, log=QUIET)
  b = run(mini(cache, tmp_path, "run.steps=6", "run.log_every=3"), resume=True, log=QUIET)
  assert sorted(b["losses"]) == [4, 5, 6]
  assert b["train_loss_first"] == a["losses"][1] != b["losses"][4]  # the run's step 1, not step 4
  assert b["train_loss_last"] == b["losses"][6]
  train = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in train if r["split"] == "train"]
  assert [r["step"] for r in train] == [1, 3, 6]
  assert all("loss" not in r and {"loss_mean", "loss_last", "loss_mean_steps"} <= set(r) for r in train)
  assert [r["loss_mean_steps"] for r in train] == [1, 2, 3]
  assert train[2]["loss_mean"] == pytest.approx(sum(b["losses"].values()) / 3, rel=1e-6)
  assert train[2]["loss_last"] == b["losses"][6]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["train_loss_first"] == a["losses"][1] and "final_train_loss" not in summary
  assert "first" in summary_line(b) and "(one batch)" in summary_line(b)


def _start(out: Path, cache: Path, *extra: str) -> subprocess.Popen:
  args = [sys.executable, str(REPO / "train.py"), "--no-progress", "--steps", "100000"]
  for item in MINI + [f"data.cache_dir={cache}", f"run.out_dir={out}", "run.log_every=1", *extra]:
    args += ["--set", item]
  env = dict(os.environ, XLA_FLAGS="", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
  return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _wait_for_steps(proc, out: Path, n: int) -> None:
  deadline, metrics = time.time() + 180, out / "metrics.jsonl"
  while time.time() < deadline and proc.poll() is None:
    if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
      return
    time.sleep(0.2)
  proc.kill()
  raise AssertionError(f"no {n} logged steps: {proc.stdout.read()[-3000:]}")


def test_sigterm_exits_143_with_a_checkpoint(cache, tmp_path):
  run(mini(cache, tmp_path / "warm", "run.steps=1"), log=QUIET)  # the tokenizer is cached
  term = _start(tmp_path / "term", cache)
  try:
    _wait_for_steps(term, tmp_path / "term", 3)
    term.send_signal(signal.SIGTERM)
    output, _ = term.communicate(timeout=120)
  finally:
    if term.poll() is None:
      term.kill()
  assert term.returncode == 128 + signal.SIGTERM == 143, output[-3000:]
  assert "stopped by SIGTERM" in output
  done = json.loads((tmp_path / "term" / "summary.json").read_text())
  assert (tmp_path / "term" / "checkpoints" / str(done["step"])).is_dir()


def test_every_log_step_reaches_the_files_before_close(tmp_path, rng):
  """What a SIGKILL leaves: after one log step (fewer scalars than TensorBoard's write batch),
  metrics.jsonl and the events file already hold it, without close()."""
  import jax
  import jax.numpy as jnp
  from tqdm import tqdm

  from coat_jax.training import metrics as metrics_lib
  from coat_jax.training.step_log import StepLogger

  log = metrics_lib.MetricsLog(tmp_path, tensorboard=True, log=QUIET)
  bar = tqdm(total=1, disable=True)
  logger = StepLogger(log, bar, QUIET, lambda step: 1e-3, 100.0, 64, jax.devices()[:1],
                      lambda step: 0.0)
  loss = float(rng.uniform(1, 5))
  logger.step_done(1, {"loss": jnp.float32(loss), "grad_norm": jnp.float32(0.5)}, log_now=True)
  try:
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["loss_last"] == pytest.approx(loss)
    data = b"".join(p.read_bytes() for p in (tmp_path / "tb").glob("events.out.tfevents.*"))
    assert b"train/loss_mean" in data  # protobuf keeps tag strings verbatim
  finally:
    log.close()


def test_resume_skips_a_damaged_latest_checkpoint_and_resume_from_picks_one(cache, tmp_path):
  extra = ("run.steps=6", "checkpoint.every=2")
  straight = run(mini(cache, tmp_path / "a", *extra), log=QUIET)
  run(mini(cache, tmp_path / "b", *extra), stop_after=4, log=QUIET)
  (tmp_path / "b" / "checkpoints" / "4" / "meta" / "metadata").write_text("{garbled")
  lines = []
  resumed = run(mini(cache, tmp_path / "b", *extra), resume=True, log=lines.append)
  assert sorted(resumed["losses"]) == [3, 4, 5, 6]  # from step 2, the newest intact one
  assert resumed["losses"] == {k: straight["losses"][k] for k in (3, 4, 5, 6)}
  assert sum("step 4" in l and "unreadable" in l for l in lines) == 1
  again = run(mini(cache, tmp_path / "b", *extra), resume_from=2, log=QUIET)
  assert sorted(again["losses"]) == [3, 4, 5, 6] and again["losses"] == resumed["losses"]
