"""A small coat Llama trained 2 steps with coat_adamw on the 8-device meshes (data 8, fsdp 8,
fsdp 4 x tensor 2, data 2 x fsdp 2 x tensor 2) through coat_jax.training.build (the train.py
path: parameter rules, state_shardings, the fused optimizer apply) equals the one-device run, and
each device holds 1/(fsdp * tensor) of the FP8 optimizer state."""
import jax
import numpy as np
import pytest

from coat_jax import kernels, optim
from coat_jax.training import mesh as mesh_lib, schema
from coat_jax.training.build import build

CFG = ["model.preset=tiny", "model.hidden_size=128", "model.intermediate_size=256",
       "model.num_layers=1", "model.num_heads=4", "model.num_kv_heads=2", "model.max_seq_len=16", "model.scan_layers=false",
       "model.dtype=float32", "model.tie_embeddings=false", "model.vocab_size=256",
       "data.seq_len=16", "data.batch_size=8", "precision=coat", "optimizer.name=coat_adamw",
       "optimizer.group_size=32", "optimizer.min_quantized_size=4096", "optimizer.warmup=0",
       "optimizer.lr=1e-2", "run.steps=2"]
MESHES = [dict(data=8, fsdp=1, tensor=1), dict(data=1, fsdp=8, tensor=1),
          dict(data=1, fsdp=4, tensor=2), dict(data=2, fsdp=2, tensor=2)]
# CI runs the mesh with all three axes (data 2 x fsdp 2 x tensor 2) on the reference kernels:
# ~40 s with the one-device run on a loaded 2-core CPU (each mesh is a compile of ~25-50 s).
# The other meshes and the Pallas variant (interpret mode: 87 s for one mesh, 200 s for the
# one-device runs) are marked slow (`pytest -m slow tests/test_mesh_llama_train.py`). The
# per-shard Pallas kernels themselves are checked on all four meshes, fast, by
# tests/test_mesh_kernels.py.


def _train(mesh_sizes, devices, init, tokens):
  mesh = mesh_lib.make_mesh(schema.MeshConfig(**mesh_sizes), devices)
  b = build(schema.load(None, CFG), mesh)
  params, opt_state, rest = jax.device_put(init, (b.parts.params_shardings, b.opt_shardings,
                                                 b.parts.rest_shardings))
  losses, steps = [], []
  for t in tokens:
    params, opt_state, rest, m = b.train_step(params, opt_state, rest,
                                              jax.device_put(t, b.batch_sharding))
    losses.append(float(m["loss"]))
    steps.append(jax.tree.map(lambda a: np.asarray(a, np.float64), jax.tree.leaves(params)))
  return losses, steps, opt_state


@pytest.fixture(scope="module")
def setup():
  rng = np.random.default_rng(20261123)
  tokens = [rng.integers(0, 256, (8, 17)).astype(np.int32) for _ in range(2)]
  one = jax.devices()[:1]
  b = build(schema.load(None, CFG), mesh_lib.make_mesh(schema.MeshConfig(1, 1, 1), one))
  init = jax.device_get(b.init())
  return init, tokens, one, {}


CASES = [(MESHES[3], "reference")] + [pytest.param(m, "reference", marks=pytest.mark.slow)
                                      for m in MESHES[:3]] + [
    pytest.param(MESHES[2], "pallas", marks=pytest.mark.slow)]


@pytest.mark.parametrize("sizes,backend", CASES, ids=[
    "x".join(f"{k}{v}" for k, v in m.items() if v > 1) + f"-{b}" for m, b in
    [(c.values[0], c.values[1]) if hasattr(c, "values") else c for c in CASES]])
def test_llama_coat_training_on_mesh_equals_one_device(setup, sizes, backend):
  init, tokens, one, want = setup
  with kernels.backend(backend):
    if backend not in want:
      want[backend] = _train(dict(data=1, fsdp=1, tensor=1), one, init, tokens)
    losses, steps, opt_state = _train(sizes, jax.devices(), init, tokens)
  want_losses, want_steps, _ = want[backend]
  print(sizes, backend, "losses", losses, "one device", want_losses)
  assert np.all(np.isfinite(losses))
  # The math is the same; the mesh changes the order of float32 sums (the loss mean and the
  # gradients over the batch shards, a tensor-parallel row product's partial sums), ~1e-7
  # relative, so not bit-exact. Step 1 (same parameters): a few elements whose gradient is ~0
  # can move an FP8 moment code (or the sign) and Adam's first step moves each element by ~lr
  # whatever its gradient's size: those change by up to 2 lr, all others stay within 1e-6.
  # Step 2 starts from those slightly different parameters: a per-tensor activation scale moved
  # by them re-rounds whole FP8 tensors, so step 2 differs by FP8 rounding noise: its parameter
  # change agrees to a relative L2 of 5% (measured values printed, below).
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  init_leaves = [np.asarray(a, np.float64) for a in jax.tree.leaves(init[0])]
  d1 = np.concatenate([np.abs(a - b).ravel() for a, b in zip(steps[0], want_steps[0])])
  assert np.isfinite(d1).all()
  move = lambda st: np.concatenate([(a - p0).ravel() for a, p0 in zip(st, init_leaves)])
  rel2 = np.linalg.norm(move(steps[1]) - move(want_steps[1])) / np.linalg.norm(move(want_steps[1]))
  print("step 1 diffs: max", d1.max(), "fraction > 1e-6", np.mean(d1 > 1e-6),
        "; step 2 relative L2 of the change", rel2)
  assert d1.max() <= 2 * 1e-2 * (1 + 1e-3) and np.mean(d1 > 1e-6) < 1e-3
  assert rel2 < 0.05   # measured 4e-6 (fsdp 4 x tensor 2) to 2e-3 (fsdp 8)
  # 1/N of the FP8 moment codes per device (N = fsdp x tensor; data replicates)
  n = sizes["fsdp"] * sizes["tensor"]
  coat = opt_state[-1] if isinstance(opt_state, tuple) else opt_state
  moments = [m for tree in (coat.mu, coat.nu) for m in jax.tree.leaves(
      tree, is_leaf=lambda x: isinstance(x, optim.ExpandedMoment))
      if isinstance(m, optim.ExpandedMoment)]
  assert moments
  total = sum(m.data.nbytes for m in moments)
  for dev in jax.devices():
    held = sum(s.data.nbytes for m in moments for s in m.data.addressable_shards if s.device == dev)
    assert held * n == total, (dev, held, total, n)
