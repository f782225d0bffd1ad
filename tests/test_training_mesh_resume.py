"""A checkpoint written on a 2-device FSDP mesh resumes on 1 device and continues the same run."""
import jax
import numpy as np

from coat_jax.training.loop import run
from tests.test_training_loop import mini

# The minuscule run of tests/test_training_loop.py, in coat mode, logging every step.
COAT = ["run.log_every=1", "data.eval_batches=1", "run.steps=6", "precision=coat",
        "optimizer.name=coat_adamw", "optimizer.min_quantized_size=256", "optimizer.group_size=32"]
QUIET = lambda _: None


def test_two_device_fsdp_checkpoint_resumes_on_one_device(cache, tmp_path):
  def cfg(out, *mesh):
    return mini(cache, out, *COAT, *mesh)

  two = ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=1"]
  one = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]
  straight = run(cfg(tmp_path / "straight", *two), devices=jax.devices()[:2], log=QUIET)
  first = run(cfg(tmp_path / "moved", *two), devices=jax.devices()[:2], stop_after=3, log=QUIET)
  assert first["step"] == 3
  # The same checkpoint directory, now read by a one-device run (the mesh is not part of the
  # run's identity: config changes are reported, the FP8 state is re-laid out on restore).
  second = run(cfg(tmp_path / "moved", *one), devices=jax.devices()[:1], resume=True, log=QUIET)
  assert second["step"] == 6
  a = [straight["losses"][k] for k in range(4, 7)]
  b = [second["losses"][k] for k in range(4, 7)]
  assert np.all(np.isfinite(b))
  # Same data, same state: only the reduction order of the data-parallel sums differs (measured:
  # 2e-7 relative; the bound leaves room for an FP8 code moved by one).
  print("losses straight", a, "resumed on one device", b)
  np.testing.assert_allclose(b, a, rtol=1e-5)
