"""A small coat Llama trained 2 steps with coat_adamw, the kernels in interpret mode (the Adam
kernel's jnp stand-in, tests/adam_standin.py: Triton cannot run on the CPU), on the
8-device meshes (data 8, fsdp 8, fsdp 4 x tensor 2, data 2 x fsdp 2 x tensor 2) through
coat_jax.training.build (the train.py path: parameter rules, state_shardings, the fused optimizer
apply) equals the one-device run, and each device holds 1/(fsdp * tensor) of the FP8 optimizer
state."""
import jax
import numpy as np
import pytest

from coat_jax import kernels, optim
from coat_jax.training import mesh as mesh_lib, schema
from coat_jax.training.build import build
from tests import adam_standin

# The smallest Llama on which the kernel families run (the shape rules in coat_jax.kernels):
# 128 tokens (batch 8 x seq 16) and hidden = intermediate = vocab = 128 give the FP8 GEMM (M, N,
# K >= 128: q, o, gate, up, down, lm_head; k / v, N = 64, take the reference), the per-group
# quantize and dequantize (whole 64-row quanta) and the fused Adam step (the 7 matrices of
# >= min_quantized_size elements keep FP8 moments, group 32); asserted in `_one_device`. The
# per-tensor quantize's kernel with the transposed copy needs a 16-bit input: bfloat16
# activations would run it, but their partial sums in another order moved the loss by 2.6e-5
# (step 1) and 7e-4 (step 2) on fsdp 4 x tensor 2, so float32 activations (the reference quantize
# there) keep this comparison tight; that kernel per shard: tests/test_mesh_partitioning.py.
CFG = ["model.preset=tiny", "model.hidden_size=128", "model.intermediate_size=128",
       "model.num_layers=1", "model.num_heads=4", "model.num_kv_heads=2", "model.max_seq_len=16",
       "model.scan_layers=false", "model.dtype=float32", "model.tie_embeddings=false",
       "model.vocab_size=128", "data.seq_len=16", "data.batch_size=8", "precision=coat",
       "optimizer.name=coat_adamw", "optimizer.group_size=32", "optimizer.min_quantized_size=4096",
       "optimizer.warmup=0", "optimizer.lr=1e-2", "run.steps=2"]
MESHES = [dict(data=8, fsdp=1, tensor=1), dict(data=1, fsdp=8, tensor=1),
          dict(data=1, fsdp=4, tensor=2), dict(data=2, fsdp=2, tensor=2)]
# Measured on the 2-core machine: the one-device run ~24 s, each mesh ~32 s wall, mostly XLA's
# compile of the partitioned program with interpreted kernels and the interpreter's host
# callbacks (157 s for the four; CI runs one, `IN_CI`). The reference-kernel variants are slow:
# the same build path and mesh rules; the reference ops on meshes run in every mesh step here
# (k / v GEMMs, the per-tensor quantize, small leaves' float32 moments) and in
# tests/test_training_mesh_resume.py (a coat run on an FSDP mesh, reference kernels).
KERNELS = {"gemm": ("pallas_kernels.gemm.fp8_matmul", "fp8_matmul_tn"),
           "quantize_per_group": ("pallas_kernels.quantize.quantize_mgpu", "quantize_per_group"),
           "dequantize": ("pallas_kernels.quantize.quantize_mgpu", "dequantize_per_group"),
           "adam": ("tests.adam_standin", "adam_step")}
# "pallas": every kernel family, the Adam step on its stand-in (installed in the test).
BACKENDS = {"pallas": "gemm=pallas,quantize=pallas,dequantize=pallas,adam=triton",
            "reference": "reference"}


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
  """Initial state, tokens and the one-device runs (computed once per backend, on first use)."""
  rng = np.random.default_rng(20261123)
  tokens = [rng.integers(0, 128, (8, 17)).astype(np.int32) for _ in range(2)]
  one = jax.devices()[:1]
  b = build(schema.load(None, CFG), mesh_lib.make_mesh(schema.MeshConfig(1, 1, 1), one))
  init = jax.device_get(b.init())
  return init, tokens, one, {}


def _one_device(setup, backend, monkeypatch):
  """The one-device run; with the kernels, also checks that every kernel family was traced."""
  init, tokens, one, want = setup
  if backend not in want:
    import importlib
    traced = {}
    for family, (module, name) in KERNELS.items():
      mod = importlib.import_module(module)
      real = getattr(mod, name)
      monkeypatch.setattr(mod, name, lambda *a, real=real, family=family, **k: (
          traced.setdefault(family, True), real(*a, **k))[1])
    want[backend] = _train(dict(data=1, fsdp=1, tensor=1), one, init, tokens)
    monkeypatch.undo()
    if backend == "pallas":
      assert sorted(traced) == sorted(KERNELS), traced
  return want[backend]


# CI time: data 2 x fsdp 2 x tensor 2 (every axis at once, ~23 s) runs in CI; data 8, fsdp 8 (the
# state in eighths, ~48 s) and fsdp 4 x tensor 2 with --slow.
IN_CI = (dict(data=2, fsdp=2, tensor=2),)
CASES = ([(m, "pallas") if m in IN_CI else pytest.param(m, "pallas", marks=pytest.mark.slow)
          for m in MESHES]
         + [pytest.param(m, "reference", marks=pytest.mark.slow) for m in MESHES])


@pytest.mark.parametrize("sizes,backend", CASES, ids=[
    "x".join(f"{k}{v}" for k, v in m.items() if v > 1) + f"-{b}" for m, b in
    [(c.values[0], c.values[1]) if hasattr(c, "values") else c for c in CASES]])
def test_llama_coat_training_on_mesh_equals_one_device(setup, sizes, backend, monkeypatch):
  init, tokens, one, _ = setup
  with pytest.MonkeyPatch.context() as patch, kernels.backend(BACKENDS[backend]):
    adam_standin.install(patch)
    want_losses, want_steps, _ = _one_device(setup, backend, monkeypatch)
    losses, steps, opt_state = _train(sizes, jax.devices(), init, tokens)
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
  assert rel2 < 0.05
  # 1/N of the FP8 moment codes per device (N = fsdp x tensor; data replicates)
  n = sizes["fsdp"] * sizes["tensor"]
  coat = opt_state if isinstance(opt_state, optim.CoatAdamWState) else opt_state[-1]
  moments = [m for tree in (coat.mu, coat.nu) for m in jax.tree.leaves(
      tree, is_leaf=lambda x: isinstance(x, optim.ExpandedMoment))
      if isinstance(m, optim.ExpandedMoment)]
  assert moments
  total = sum(m.data.nbytes for m in moments)
  for dev in jax.devices():
    held = sum(s.data.nbytes for m in moments for s in m.data.addressable_shards if s.device == dev)
    assert held * n == total, (dev, held, total, n)
