"""Gradient accumulation (coat_jax/training/accumulate.py): the accumulated value and gradient equal
one step over the whole batch, and through optimizer.accumulate k microbatches per optimizer step
train like one batch of k times the size."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax.training import build as build_lib
from coat_jax.training import mesh as mesh_lib
from coat_jax.training import schema
from coat_jax.training.accumulate import accumulated_value_and_grad, split_microbatches

SEED = 20261123


def _loss(params, state, batch):
  """A small two-layer MLP regression, mean over the batch rows; state counts the calls."""
  x, y = batch[:, :-1], batch[:, -1]
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  pred = h @ params["w2"]
  return jnp.mean((pred[:, 0] - y) ** 2), state + 1


def _setup(b=24, d=8, h=16):
  rng = np.random.default_rng(SEED)
  print(f"seed {SEED}")
  params = {"w1": jnp.asarray(rng.normal(size=(d, h)), jnp.float32),
            "b1": jnp.asarray(rng.normal(size=(h,)), jnp.float32),
            "w2": jnp.asarray(rng.normal(size=(h, 1)), jnp.float32)}
  batch = jnp.asarray(rng.normal(size=(b, d + 1)), jnp.float32)
  return params, batch


@pytest.mark.parametrize("k", [2, 3, 8])
def test_accumulated_equals_full_batch(k):
  params, batch = _setup()
  (loss_ref, _), g_ref = jax.jit(jax.value_and_grad(_loss, has_aux=True))(params, 0, batch)
  (loss, calls), g = jax.jit(accumulated_value_and_grad(_loss, k))(params, 0, batch)
  assert int(calls) == k
  np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6)
  for name in params:
    a, r = np.asarray(g[name], np.float64), np.asarray(g_ref[name], np.float64)
    assert np.all(np.isfinite(a))
    rel = np.linalg.norm(a - r) / np.linalg.norm(r)
    assert rel < 1e-6, (name, rel)


def test_one_microbatch_is_bit_identical():
  params, batch = _setup()
  ref = jax.jit(jax.value_and_grad(_loss, has_aux=True))(params, 0, batch)
  out = jax.jit(accumulated_value_and_grad(_loss, 1))(params, 0, batch)
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_accumulator_close_and_param_dtype_kept():
  params, batch = _setup()
  (_, _), g_ref = jax.value_and_grad(_loss, has_aux=True)(params, 0, batch)
  (_, _), g = accumulated_value_and_grad(_loss, 4, "bfloat16")(params, 0, batch)
  for name in params:
    assert g[name].dtype == jnp.float32
    r = np.asarray(g_ref[name], np.float64)
    rel = np.linalg.norm(np.asarray(g[name], np.float64) - r) / np.linalg.norm(r)
    assert 0 < rel < 2e-2, (name, rel)  # bf16 sums: ~2^-8 per add, never exact here


def test_microbatches_are_strided_rows():
  batch = jnp.arange(12 * 3).reshape(12, 3)
  micro = np.asarray(split_microbatches(batch, 4))
  assert micro.shape == (4, 3, 3)
  for i in range(4):
    np.testing.assert_array_equal(micro[i], np.asarray(batch)[i::4])


@pytest.mark.parametrize("bad", [0, -1, 5, 2.0, True])
def test_bad_microbatch_counts_are_rejected(bad):
  params, batch = _setup(b=24)
  with pytest.raises(ValueError, match="microbatch"):
    accumulated_value_and_grad(_loss, bad)(params, 0, batch)


def test_bad_accum_dtype():
  with pytest.raises(ValueError, match="accum_dtype"):
    accumulated_value_and_grad(_loss, 2, "float16")


# ----------------------------------------------------------------------------------------------
# optimizer.accumulate through the training library.

REPO = Path(__file__).resolve().parents[1]
SMALL = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2",
         "model.num_heads=4", "model.num_kv_heads=2", "model.max_seq_len=16",
         "model.dtype=float32", "model.vocab_size=256", "data.seq_len=16", "data.batch_size=8",
         "optimizer.warmup=0", "optimizer.lr=1e-2", "mesh.data=1", "run.steps=3"]


def _run(extra, mesh, steps=3):
  cfg = schema.load(REPO / "configs" / "tiny.yaml", SMALL + extra)
  built = build_lib.build(cfg, mesh, vocab_size=256)
  params, opt_state, rest = built.init()
  rng = np.random.default_rng(SEED)
  print(f"seed {SEED}")
  losses, norms = [], []
  for _ in range(steps):
    tokens = mesh_lib.put_batch(rng.integers(0, 256, (8, 17), dtype=np.int32), built.batch_sharding)
    params, opt_state, rest, out = built.train_step(params, opt_state, rest, tokens)
    losses.append(float(out["loss"]))
    norms.append(float(out["grad_norm"]))
  return losses, norms, jax.device_get(params)


@pytest.mark.parametrize("precision,optimizer", [  # CI time: bf16 runs with --slow
    pytest.param("bf16", "adamw", marks=pytest.mark.slow), ("coat", "coat_adamw")])
def test_accumulated_steps_match_one_batch(precision, optimizer):
  mesh = mesh_lib.make_mesh(schema.MeshConfig(data=1), jax.devices()[:1])
  base = [f"precision={precision}", f"optimizer.name={optimizer}",
          "optimizer.min_quantized_size=256", "optimizer.group_size=32"]
  ref_losses, ref_norms, ref_params = _run(base, mesh)
  for k, dtype in ((2, "float32"), (4, "bfloat16")):
    losses, norms, params = _run(base + [f"optimizer.accumulate={k}",
                                  f"optimizer.accumulate_dtype={dtype}"], mesh)
    # The first loss is the same model on the same batch; later ones differ by the rounding of
    # the summed gradients (and, in coat, by FP8 moment codes that rounding moves by one).
    # In coat mode even the first loss differs slightly: per-tensor FP8 scales are taken over each
    # microbatch instead of the whole batch.
    exact = dtype == "float32" and precision == "bf16"
    np.testing.assert_allclose(losses[0], ref_losses[0], rtol=1e-6 if precision == "bf16" else 3e-4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5 if exact else 3e-3)
    # The first step's gradient: same weights, same tokens.
    np.testing.assert_allclose(norms[0], ref_norms[0], rtol=1e-5 if exact else 2e-2)
    if precision == "coat":
      # Not the params: at lr 1e-2 three Adam steps move the 0.02-scale weights by about their
      # own size, in sign-like steps that the FP8 noise of different activation scales flips.
      continue
    worst = max(float(np.linalg.norm(a - b) / np.linalg.norm(b))
                for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)))
    # float32 sums differ from one batch's in rounding only; bf16 sums round each microbatch's
    # gradient to 8 bits.
    assert worst < (5e-2 if dtype == "bfloat16" else 1e-4), (k, worst)


def test_accumulate_must_divide_the_batch_per_shard():
  mesh = mesh_lib.make_mesh(schema.MeshConfig(data=4), jax.devices()[:4])
  cfg = schema.load(REPO / "configs" / "tiny.yaml", SMALL + ["mesh.data=4", "optimizer.accumulate=4"])
  with pytest.raises(ValueError, match="optimizer.accumulate=4"):
    build_lib.build(cfg, mesh, vocab_size=256)
  with pytest.raises(ValueError, match="optimizer.accumulate"):
    schema.load(None, ["optimizer.accumulate=0"])
  with pytest.raises(ValueError, match="accumulate_dtype"):
    schema.load(None, ["optimizer.accumulate_dtype=float16"])


def test_bf16_master_weights_with_stochastic_rounding_train():
  """model.param_dtype=bfloat16 + optimizer.master_rounding=stochastic: a coat run's loss falls."""
  mesh = mesh_lib.make_mesh(schema.MeshConfig(data=1), jax.devices()[:1])
  base = ["precision=coat", "optimizer.name=coat_adamw", "optimizer.min_quantized_size=256",
          "optimizer.group_size=32", "model.param_dtype=bfloat16",
          "optimizer.master_rounding=stochastic"]
  cfg = schema.load(REPO / "configs" / "tiny.yaml", SMALL + base)
  built = build_lib.build(cfg, mesh, vocab_size=256)
  params, opt_state, rest = built.init()
  assert all(p.dtype == jax.numpy.bfloat16 for p in jax.tree.leaves(params))
  tokens = mesh_lib.put_batch(np.random.default_rng(SEED).integers(0, 256, (8, 17), dtype=np.int32),
                              built.batch_sharding)
  losses = []
  for _ in range(6):  # the same batch: the loss must fall
    params, opt_state, rest, out = built.train_step(params, opt_state, rest, tokens)
    losses.append(float(out["loss"]))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05, losses
  with pytest.raises(ValueError, match="master_rounding"):
    schema.load(None, ["optimizer.master_rounding=stochastic"])  # adamw: not supported
