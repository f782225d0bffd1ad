"""optimizer.accumulate: k microbatches per optimizer step train like one batch of k times the size."""
from pathlib import Path

import jax
import numpy as np
import pytest

from coat_jax.training import build as build_lib
from coat_jax.training import mesh as mesh_lib
from coat_jax.training import schema

REPO = Path(__file__).resolve().parents[1]
SMALL = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2",
         "model.num_heads=4", "model.num_kv_heads=2", "model.max_seq_len=16",
         "model.dtype=float32", "model.vocab_size=256", "data.seq_len=16", "data.batch_size=8",
         "optimizer.warmup=0", "optimizer.lr=1e-2", "mesh.data=1", "run.steps=3"]
SEED = 20261123


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
