"""optimizer.grad_dtype=bfloat16 (gradients of a bfloat16 weight copy) and master_rounding=kahan
wired through training.build: dtypes, bytes, and gradients vs float32 on a tiny Llama."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax.training import build as build_lib
from coat_jax.training import mesh as mesh_lib
from coat_jax.training import schema
from coat_jax.training.accumulate import accumulated_value_and_grad

REPO = Path(__file__).resolve().parents[1]
SMALL = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
         "model.num_heads=4", "model.num_kv_heads=2", "model.max_seq_len=16",
         "model.vocab_size=256", "data.seq_len=16", "data.batch_size=8",
         "optimizer.warmup=0", "optimizer.lr=1e-2", "mesh.data=1", "run.steps=3",
         "optimizer.min_quantized_size=256", "optimizer.group_size=32"]
SEED = 20261124


def _mesh():
  return mesh_lib.make_mesh(schema.MeshConfig(data=1), jax.devices()[:1])


def _tokens(shape=(8, 17)):
  print(f"seed {SEED}")
  return np.random.default_rng(SEED).integers(0, 256, shape, dtype=np.int32)


def _loss_fn(parts):
  def loss_fn(params, rest, tokens):
    model = parts.merge(params, rest)
    return build_lib.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]), rest
  return loss_fn


def _bytes(tree):
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def test_bf16_gradients_match_float32_at_half_the_bytes():
  # Compute dtype bfloat16: the model casts its weights to bfloat16 anyway, so the forward from
  # the bfloat16 copy is the same and only the gradients' rounding differs.
  cfg = schema.load(REPO / "configs" / "tiny.yaml", SMALL + ["model.dtype=bfloat16"])
  built = build_lib.build(cfg, _mesh(), vocab_size=256)
  params, _, rest = built.init()
  tokens = jnp.asarray(_tokens())
  runs = {}
  for key in (("param", 1, "float32"), ("bfloat16", 1, "float32"), ("bfloat16", 2, "bfloat16")):
    fn = accumulated_value_and_grad(_loss_fn(built.parts), key[1], key[2], key[0])
    shapes = jax.eval_shape(fn, params, rest, tokens)[1]
    (loss, _), g = jax.jit(fn)(params, rest, tokens)
    assert jax.tree.map(lambda a: a.dtype, shapes) == jax.tree.map(lambda a: a.dtype, g)
    runs[key] = (float(loss), g, _bytes(shapes))
  loss32, g32, bytes32 = runs[("param", 1, "float32")]
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g32)) and bytes32 == _bytes(params)
  b = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(g32)])
  assert np.linalg.norm(b) > 0
  for key in (("bfloat16", 1, "float32"), ("bfloat16", 2, "bfloat16")):
    loss16, g16, bytes16 = runs[key]
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(g16))
    assert bytes16 * 2 == bytes32
    # One batch: the same forward; two microbatches: a mean of two losses (float rounding).
    assert (loss16 == loss32) if key[1] == 1 else abs(loss16 - loss32) < 1e-3 * abs(loss32)
    a = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(g16)])
    assert np.all(np.isfinite(a))
    rel = np.linalg.norm(a - b) / np.linalg.norm(b)
    cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
    # bfloat16 rounding: 2^-9 per element (more with the bfloat16 sum of two microbatches).
    assert 0 < rel < 1.5e-2 and cos > 0.9999, (key, rel, cos)


def test_bf16_master_kahan_bf16_grads_train_and_budget():
  """param_dtype bfloat16 + master_rounding kahan + grad_dtype bfloat16 + bf16 accumulation."""
  opts = ["precision=bf16", "optimizer.name=coat_adamw", "model.param_dtype=bfloat16",
          "optimizer.master_rounding=kahan", "optimizer.grad_dtype=bfloat16",
          "optimizer.accumulate=2", "optimizer.accumulate_dtype=bfloat16"]
  cfg = schema.load(REPO / "configs" / "tiny.yaml", SMALL + opts)
  built = build_lib.build(cfg, _mesh(), vocab_size=256)
  params, opt_state, rest = built.init()
  core = opt_state   # coat_adamw's CoatAdamWState (clipping is inside its step)
  assert all(jax.tree.leaves(jax.tree.map(lambda c, p: c.dtype == p.dtype == jnp.bfloat16,
                                          core.comp, params)))
  budget = build_lib.memory_budget(cfg.optimizer, built.parts.params_abstract, built.opt_abstract)
  n = sum(x.size for x in jax.tree.leaves(params))
  assert budget["params"] == budget["grads"] == budget["accumulator"] == 2 * n
  assert budget["weight_copy"] == 0  # the params are the bfloat16 weights
  layer = lambda x: x.size // (x.shape[0] if x.ndim >= 3 else 1)  # stacked leaves: one layer
  assert budget["step_workspace"] == 8 * max(layer(x) for x in jax.tree.leaves(params))
  assert budget["optimizer_state"] == _bytes(opt_state) and _bytes(core.comp) == 2 * n
  tokens = mesh_lib.put_batch(_tokens(), built.batch_sharding)
  losses = []
  for _ in range(5):  # the same batch: the loss must fall
    params, opt_state, rest, out = built.train_step(params, opt_state, rest, tokens)
    losses.append(float(out["loss"]))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05, losses
  assert any(np.any(np.asarray(c, np.float32) != 0) for c in jax.tree.leaves(opt_state.comp))


def test_budget_of_float32_master_with_bf16_grads():
  cfg = schema.load(REPO / "configs" / "tiny.yaml",
                    SMALL + ["optimizer.grad_dtype=bfloat16", "optimizer.accumulate=4"])
  p = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32), "s": jax.ShapeDtypeStruct((32,), jnp.float32)}
  b = build_lib.memory_budget(cfg.optimizer, p, {})
  n = 64 * 32 + 32
  assert (b["params"], b["grads"], b["weight_copy"], b["accumulator"]) == (4 * n, 2 * n, 2 * n, 4 * n)
  assert b["total"] == 12 * n


def test_config_checks():
  with pytest.raises(ValueError, match="grad_dtype"):
    schema.load(None, ["optimizer.grad_dtype=float16"])
  with pytest.raises(ValueError, match="master_rounding"):
    schema.load(None, ["optimizer.master_rounding=kahan"])  # adamw
  assert schema.load(None, ["optimizer.name=coat_adamw",
                            "optimizer.master_rounding=kahan"]).optimizer.master_rounding == "kahan"


def test_bf16_copy_adds_no_residuals_and_costs_what_the_gradients_save():
  """The linears keep the parameter itself (not a bfloat16 cast of it) for the backward, so
  neither float32 params nor their bfloat16 copy add weight-sized residuals; with float32 masters
  bfloat16 gradients therefore save 2 B/param of gradients and the copy costs 2 B/param: no net
  peak saving (training.build.memory_budget counts both). The saving comes from bfloat16
  masters."""
  from coat_jax.memory import saved_residual_bytes
  from coat_jax.training.accumulate import grad_params
  cfg = schema.load(None, ["model.hidden_size=64", "model.intermediate_size=128",
                           "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=4",
                           "model.vocab_size=256", "model.dtype=bfloat16", "model.remat=none",
                           "data.seq_len=8", "data.batch_size=2"])
  parts, init = build_lib.model_parts(build_lib.model_config(cfg, 256), 0, _mesh())
  params, rest = init()
  tokens = jnp.asarray(_tokens((2, 9)))

  def loss(p):
    return build_lib.cross_entropy(parts.merge(p, rest)(tokens[:, :-1]), tokens[:, 1:])

  n = sum(x.size for x in jax.tree.leaves(params))
  copy = grad_params(params, "bfloat16")
  f32 = 4 * n + saved_residual_bytes(loss, params)  # float32 grads + residuals
  bf16 = 2 * n + 2 * n + saved_residual_bytes(loss, copy)  # bf16 grads + the copy + residuals
  res32, res16 = saved_residual_bytes(loss, params), saved_residual_bytes(loss, copy)
  assert res16 <= res32 + 0.05 * n, (res32 / n, res16 / n)   # no bfloat16 weight residuals
  assert res32 < 2 * n, res32 / n                            # nor float32 ones
  assert abs(bf16 - f32) <= 0.05 * n, (f32 / n, bf16 / n)
