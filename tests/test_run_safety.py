"""Nothing is lost: --overwrite removes only a run's own files, a diverged run stops (status 3)
without checkpointing NaNs, a second run on one directory is locked out, resume never starts
afresh over an earlier run or changes its schedule silently, a vanished or read-only output
directory is status 5."""
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from coat_jax.training import build as build_lib
from coat_jax.training import mesh as mesh_lib
from coat_jax.training.checkpoint import Checkpointer
from coat_jax.errors import BadInputError, DivergedError, StorageError
from coat_jax.training.loop import run
from tests.test_training_reliability import MINI, mini

REPO = Path(__file__).resolve().parents[1]
QUIET = lambda _: None


def train_py(*args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(REPO))
  return subprocess.run([sys.executable, str(REPO / "train.py"), "--no-progress", *args], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=timeout)


def sets(cache, out, *extra):
  items = MINI + [f"data.cache_dir={cache}", *extra]
  return ["--out-dir", str(out)] + [a for i in items for a in ("--set", i)]


def test_overwrite_removes_only_what_a_run_wrote(cache, tmp_path):
  ckpts = tmp_path / "v"
  ckpts.mkdir()
  (ckpts / "notes.txt").write_text("mine")
  run(mini(cache, tmp_path / "r", "run.steps=1", f"checkpoint.dir={ckpts}"), log=QUIET)
  again = mini(cache, tmp_path / "r", "run.steps=1", f"checkpoint.dir={ckpts}")
  with pytest.raises(BadInputError, match=r"--overwrite: .*v holds 1 entries that no run wrote "
                                          r"\(e.g. notes.txt\); nothing was removed"):
    run(again, log=QUIET, overwrite=True)
  assert (ckpts / "notes.txt").read_text() == "mine" and (ckpts / "1").is_dir()
  assert (tmp_path / "r" / "metrics.jsonl").is_file()
  (ckpts / "notes.txt").unlink()
  (tmp_path / "r" / "mine.txt").write_text("kept")   # the out dir itself is never cleared
  assert run(again, log=QUIET, overwrite=True)["step"] == 1
  assert (tmp_path / "r" / "mine.txt").read_text() == "kept"


def test_divergence_stops_with_status_3_and_no_nonfinite_checkpoint(cache, tmp_path):
  out = tmp_path / "d"
  proc = train_py("--steps", "8", *sets(cache, out, "optimizer.lr=1e30", "checkpoint.every=1",
                                        "run.log_every=4"))
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 3, proc.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("error: step ") and "diverged" in lines[0]
  diverged = int(lines[0].split()[2].rstrip(":"))
  ck = Checkpointer(out / "checkpoints", 0, 8, False)
  steps = ck.all_steps()
  assert steps and max(steps) < diverged, (steps, lines)
  for s in steps:  # every checkpoint on disk is finite
    arrays = ck._manager.restore(s, args=ck._ocp.args.Composite(
        state=ck._ocp.args.StandardRestore()))["state"]
    assert all(np.isfinite(np.asarray(a, np.float32)).all() for a in jax.tree.leaves(arrays))
  ck.close()


def test_skip_keeps_the_state_and_stops_after_n_in_a_row(cache, tmp_path):
  cfg = mini(cache, tmp_path / "s", "run.on_nonfinite=skip", "run.max_nonfinite_steps=2",
             "optimizer.lr=1e30", "run.steps=12", "run.log_every=1")
  lines = []
  with pytest.raises(DivergedError, match=r"2 non-finite steps in a row") as e:
    run(cfg, log=lines.append)
  assert e.value.exit_code == 3 and "\n" not in str(e.value)
  assert sum("update skipped (1 in a row" in l for l in lines) == 1
  # The skipping step returns params and optimizer state bit for bit when the loss is NaN.
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:1])
  built = build_lib.build(cfg, mesh, vocab_size=512)
  params, opt_state, rest = built.init()
  params["norm"]["scale"] = params["norm"]["scale"].at[0].set(np.nan)
  before = jax.tree.map(np.asarray, (params, opt_state))
  tokens = np.random.default_rng(0).integers(0, 512, (8, 33)).astype(np.int32)
  new_params, new_opt, _, out = built.train_step(params, opt_state, rest, tokens)
  assert not np.isfinite(float(out["loss"]))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves((new_params, new_opt))):
    np.testing.assert_array_equal(np.asarray(b), a)


def test_checkpointer_never_writes_a_nonfinite_state(tmp_path):
  import jax.numpy as jnp
  ck = Checkpointer(tmp_path, 1, 3, False)
  state = {"a": jnp.ones(4), "m": jnp.asarray([1.0, np.inf]).astype(jnp.float8_e5m2)}
  with pytest.raises(DivergedError, match=r"checkpoint of step 1 .*\(e.g. m\); not written"):
    ck.save(1, state, {"step": 1})
  ck.close()
  assert not list(tmp_path.iterdir())


def test_a_second_run_on_one_directory_is_locked_out(cache, tmp_path):
  out = tmp_path / "l"
  holder = subprocess.Popen([sys.executable, "-c", (
      "import sys, time; from pathlib import Path; from coat_jax.training.run_dir import DirLock;"
      "DirLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(60)"),
      str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    proc = train_py("--steps", "1", "--resume", *sets(cache, out))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == (f"error: {out} is in use by another run (pid {holder.pid}); "
                                   f"wait for it to end or choose another --out-dir")
  finally:
    holder.kill()   # SIGKILL: the OS drops its lock
    holder.wait()
  assert run(mini(cache, out, "run.steps=1"), log=QUIET)["step"] == 1


def test_resume_never_starts_afresh_over_an_earlier_run_nor_changes_steps(cache, tmp_path):
  out = tmp_path / "q"
  run(mini(cache, out, "run.steps=2"), log=QUIET)
  with pytest.raises(BadInputError, match=r"run.steps=2; this run has run.steps=3"):
    run(mini(cache, out, "run.steps=3"), resume=True, log=QUIET)
  ckpt = out / "checkpoints" / "2"
  (ckpt / "meta" / "metadata").write_text("{garbled")
  with pytest.raises(ValueError, match="no intact checkpoint"):
    run(mini(cache, out, "run.steps=2"), resume=True, log=QUIET)
  metrics = (out / "metrics.jsonl").read_text()
  with pytest.raises(BadInputError, match=r"--resume: no intact checkpoint .*2.unreadable-"):
    run(mini(cache, out, "run.steps=2"), resume=True, log=QUIET)
  assert (out / "metrics.jsonl").read_text() == metrics


def test_out_dir_tilde_expands_and_a_deleted_out_dir_stops_the_run(cache, tmp_path, monkeypatch):
  import shutil
  monkeypatch.setenv("HOME", str(tmp_path))
  with pytest.raises(StorageError, match="was removed while the run wrote it"):
    run(mini(cache, "~/gone", "run.steps=6", "run.log_every=1"), log=QUIET,
        on_step=lambda step, stop: step == 2 and shutil.rmtree(tmp_path / "gone"))
  assert not (REPO / "~").exists()


def test_read_only_out_dir_is_status_5(cache, tmp_path):
  out = tmp_path / "ro"
  out.mkdir()
  out.chmod(0o500)
  try:
    if os.access(out, os.W_OK):
      pytest.skip("running as a user that writes read-only directories (root)")
    proc = train_py("--steps", "1", *sets(cache, out))
  finally:
    out.chmod(0o700)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 5 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
