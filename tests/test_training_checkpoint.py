"""Damaged checkpoints: the newest intact one is restored, each unreadable one is named in one
line, --resume-from picks a step, and no intact checkpoint is a one-line error."""
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax.training.checkpoint import Checkpointer


def truncate_data(step_dir: Path) -> None:
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  assert files
  for p in files:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def garble_meta(step_dir: Path) -> None:
  (step_dir / "meta" / "metadata").write_text('{"step": 4, "rng": [1, 2')


def empty_dir(step_dir: Path) -> None:
  step_dir.mkdir()


def saved(tmp_path, rng):
  states = {s: {"w": jnp.asarray(rng.standard_normal((64, 32)), jnp.float32),
                "m": jnp.asarray(rng.standard_normal(100) * 10, jnp.float32).astype(jnp.float8_e4m3fn)}
            for s in (2, 4)}
  ck = Checkpointer(tmp_path, every=2, keep=5, async_save=False)
  for s, st in states.items():
    assert ck.save(s, st, {"step": s})
  ck.close()
  return states


def same(a, b) -> bool:
  return all(np.array_equal(np.asarray(a[k]).view(np.uint8), np.asarray(b[k]).view(np.uint8)) for k in a)


@pytest.mark.parametrize("damage,newest", [(truncate_data, 4), (garble_meta, 4), (empty_dir, 6)])
def test_newest_intact_checkpoint_is_restored(tmp_path, rng, damage, newest):
  states = saved(tmp_path, rng)
  damage(tmp_path / str(newest))
  ck = Checkpointer(tmp_path, every=2, keep=5, async_save=False)
  lines = []
  template = {k: jnp.zeros_like(v) for k, v in states[2].items()}
  want = 4 if newest == 6 else 2  # an empty newer directory leaves both real ones intact
  state, meta, step = ck.restore_intact(template, log=lines.append)
  assert step == want and meta == {"step": want} and same(state, states[want])
  assert len(lines) == 1 and "\n" not in lines[0]
  assert lines[0].startswith(f"[checkpoint] step {newest} in {tmp_path} is unreadable: ")
  assert not (tmp_path / str(newest)).exists()  # set aside, not deleted:
  assert [p.name.split("-")[0] for p in tmp_path.glob(f"{newest}.unreadable-*")] == [f"{newest}.unreadable"]
  assert ck.save(want + 2, state, {"step": want + 2})  # the step can be written again
  ck.close()


def test_resume_from_a_step_sets_newer_ones_aside(tmp_path, rng):
  states = saved(tmp_path, rng)
  template = {k: jnp.zeros_like(v) for k, v in states[2].items()}
  ck = Checkpointer(tmp_path, every=2, keep=5, async_save=False)
  with pytest.raises(ValueError, match=r"^no checkpoint at step 3 in .*; steps there: 2, 4$"):
    ck.restore_intact(template, 3)
  lines = []
  state, _, step = ck.restore_intact(template, 2, log=lines.append)  # --resume-from 2
  assert step == 2 and same(state, states[2])
  assert lines == ["[checkpoint] resuming from step 2: step 4 set aside as 4.superseded"]
  assert ck.all_steps() == [2] and len(list(tmp_path.glob("4.superseded-*"))) == 1
  assert ck.save(4, state, {"step": 4})  # the run writes step 4 again
  ck.close()


def test_no_intact_checkpoint_is_a_one_line_error(tmp_path, rng):
  states = saved(tmp_path, rng)
  template = {k: jnp.zeros_like(v) for k, v in states[2].items()}
  truncate_data(tmp_path / "4")
  garble_meta(tmp_path / "2")
  ck = Checkpointer(tmp_path, every=2, keep=5, async_save=False)
  with pytest.raises(ValueError) as e:
    ck.restore_intact(template, log=lambda _: None)
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith(f"no intact checkpoint in {tmp_path}; tried step 4 (")
  assert "; step 2 (" in msg
  ck.close()


def test_another_layout_is_a_one_line_error_and_stays_in_place(tmp_path, rng):
  # E.g. coat_adamw moments written with group_axis "last" ((in, out/G) scales) read by a run
  # with "coat" ((in/G, out) scales): readable, so not set aside as unreadable.
  ck = Checkpointer(tmp_path, every=2, keep=5, async_save=False)
  amax = jnp.asarray(rng.uniform(0.1, 1.0, (64, 2)), jnp.float32)
  assert ck.save(2, {"opt": {"mu": {"w": amax}}}, {"step": 2})
  ck.close()
  ck = Checkpointer(tmp_path, every=2, keep=5, async_save=False)
  with pytest.raises(ValueError) as e:
    ck.restore_intact({"opt": {"mu": {"w": jnp.zeros((1, 128), jnp.float32)}}}, log=lambda _: None)
  msg = str(e.value)
  assert "\n" not in msg and "has shape (64, 2), this run expects (1, 128)" in msg
  assert "optimizer.group_axis" in msg
  assert ck.all_steps() == [2] and not list(tmp_path.glob("2.*"))  # left in place
  state, _, step = ck.restore_intact({"opt": {"mu": {"w": jnp.zeros((64, 2), jnp.float32)}}})
  assert step == 2 and np.array_equal(np.asarray(state["opt"]["mu"]["w"]), np.asarray(amax))
  ck.close()


def test_a_coat_adamw_checkpoint_of_the_chained_layout_resumes(tmp_path, rng):
  """coat_adamw's state was once saved inside an optax chain, one tuple level deeper
  (`opt.1.mu`); such a checkpoint restores into today's unchained state bit for bit."""
  w = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
  mu = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32).astype(jnp.float8_e4m3fn)
  count = jnp.asarray(7, jnp.int32)
  ck = Checkpointer(tmp_path, every=1, keep=2, async_save=False)
  assert ck.save(3, {"params": w, "opt": ((), {"count": count, "mu": mu})}, {"step": 3})
  state, meta, step = ck.restore({"params": w * 0, "opt": {"count": count * 0, "mu": mu}})
  ck.close()
  assert step == 3 and meta["step"] == 3
  assert same({"w": state["params"], "mu": state["opt"]["mu"]}, {"w": w, "mu": mu})
  assert int(state["opt"]["count"]) == 7
