"""Gradient accumulation summed in place (accumulate.py's loss_adds_into_sink, build's
sums_layer_grads_in_place): each microbatch's backward adds the stacked layers' gradient into the
running sum. Same loss and mean gradients as summing after the backward, the NaN of a bad step
kept, and one stacked-gradient tree less in XLA's compiled temporaries."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax.training import build as build_lib
from coat_jax.training import mesh as mesh_lib
from coat_jax.training import schema
from coat_jax.training.accumulate import accumulated_value_and_grad
from coat_jax.training.plan import memory_analysis

REPO = Path(__file__).resolve().parents[1]
SEED = 20261125
# One device: scan_impl "auto" would pick lax.scan under the tests' 8 simulated devices.
SMALL = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=3",
         "model.num_heads=4", "model.num_kv_heads=2", "model.max_seq_len=16",
         "model.vocab_size=64", "model.scan_impl=vjp_loop", "data.seq_len=8",
         "data.batch_size=4", "mesh.data=1"]


def _built(extra):
  cfg = schema.load(REPO / "configs" / "tiny.yaml", SMALL + extra)
  mesh = mesh_lib.make_mesh(schema.MeshConfig(data=1), jax.devices()[:1])
  return cfg, build_lib.build(cfg, mesh, vocab_size=64)


def _tokens(cfg):
  print(f"seed {SEED}")
  rng = np.random.default_rng(SEED)
  return jnp.asarray(rng.integers(0, 64, (cfg.data.batch_size, cfg.data.seq_len + 1)), jnp.int32)


def _value_and_grad(cfg, built, in_place):
  o = cfg.optimizer
  return jax.jit(accumulated_value_and_grad(build_lib.training_loss(built.parts), o.accumulate,
                                            o.accumulate_dtype, o.grad_dtype, in_place))


def _flat(tree):
  return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


@pytest.mark.parametrize("dtypes,rel_tol", [
    (["model.dtype=float32"], 1e-6),   # float32 params, gradients and sum
    (["model.dtype=bfloat16", "model.param_dtype=bfloat16", "optimizer.accumulate_dtype=bfloat16"],
     1e-2)])
def test_in_place_sum_equals_the_sum_after_the_backward(dtypes, rel_tol):
  cfg, built = _built(dtypes + ["optimizer.accumulate=2"])
  assert built.sums_layer_grads_in_place
  params, _, rest = built.init()
  tokens = _tokens(cfg)
  (loss_add, _), g_add = _value_and_grad(cfg, built, False)(params, rest, tokens)
  (loss_in, _), g_in = _value_and_grad(cfg, built, True)(params, rest, tokens)
  assert jax.tree.structure(g_in) == jax.tree.structure(g_add)
  assert jax.tree.map(lambda a: a.dtype, g_in) == jax.tree.map(lambda a: a.dtype, g_add)
  np.testing.assert_allclose(float(loss_in), float(loss_add), rtol=1e-6)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_in)[0], jax.tree.leaves(g_add)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)) and np.linalg.norm(b) > 0, jax.tree_util.keystr(path)
    rel = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert rel <= rel_tol, (jax.tree_util.keystr(path), rel)
  # Every stacked leaf is summed in place, the sink counted once (not twice the gradient).
  a, b = _flat(g_in["layers"]), _flat(g_add["layers"])
  assert np.linalg.norm(a - b) <= rel_tol * np.linalg.norm(b)


def test_a_nan_in_one_layer_reaches_the_summed_gradient():
  cfg, built = _built(["model.dtype=float32", "optimizer.accumulate=2"])
  params, _, rest = built.init()
  kernel = params["layers"]["mlp"]["down_proj"]["kernel"]
  params["layers"]["mlp"]["down_proj"]["kernel"] = kernel.at[1, 0, 0].set(jnp.nan)
  (loss, _), grads = _value_and_grad(cfg, built, True)(params, rest, _tokens(cfg))
  assert np.isnan(float(loss))
  assert np.isnan(_flat(grads["layers"])).any() and np.isnan(_flat(grads["embed"])).any()


def test_when_the_sum_is_made_in_place():
  def on(extra):
    return _built(extra)[1].sums_layer_grads_in_place
  assert on(["optimizer.accumulate=2"])                                   # float32 throughout
  assert not on(["optimizer.accumulate=1"])                               # nothing to sum
  assert not on(["optimizer.accumulate=2", "model.scan_impl=lax"])        # JAX's scan
  assert not on(["optimizer.accumulate=2", "model.scan_layers=false"])    # unrolled layers
  # bfloat16 gradients into a float32 sum: the sum's dtype differs, so it adds after the backward.
  assert not on(["optimizer.accumulate=2", "optimizer.grad_dtype=bfloat16"])
  assert on(["optimizer.accumulate=2", "optimizer.grad_dtype=bfloat16",
             "optimizer.accumulate_dtype=bfloat16"])


def test_budget_counts_the_stacked_sum_once():
  cfg, built = _built(["model.param_dtype=bfloat16", "optimizer.grad_dtype=bfloat16",
                       "optimizer.accumulate_dtype=bfloat16", "optimizer.accumulate=4"])
  params = built.parts.params_abstract
  n = sum(x.size for x in jax.tree.leaves(params))
  stacked = sum(x.size for x in jax.tree.leaves(params["layers"]))
  apart = build_lib.memory_budget(cfg.optimizer, params, built.opt_abstract)
  fused = build_lib.memory_budget(cfg.optimizer, params, built.opt_abstract, True)
  assert apart["accumulator"] == fused["grads"] == apart["grads"] == 2 * n
  assert fused["accumulator"] == 2 * (n - stacked)
  assert apart["total"] - fused["total"] == 2 * stacked


def test_compiled_temporaries_hold_one_stacked_gradient_less():
  """XLA's temporaries of the accumulated value-and-grad (bfloat16 weights, gradients and sum;
  the outputs cut to a few elements so that no output buffer stands in for the sum): summing in
  place holds no microbatch gradient of the stack beside the sum."""
  cfg, built = _built(["model.dtype=bfloat16", "model.param_dtype=bfloat16",
                       "optimizer.accumulate_dtype=bfloat16", "optimizer.accumulate=2",
                       "model.hidden_size=64", "model.intermediate_size=192",
                       "model.num_layers=6"])
  params, _, rest = built.abstract_state()
  tokens = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len + 1), jnp.int32)
  stacked = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params["layers"]))
  temps = {}
  for in_place in (False, True):
    fn = accumulated_value_and_grad(build_lib.training_loss(built.parts), 2, "bfloat16",
                                    "param", in_place)
    cut = lambda p, r, t: jax.tree.map(lambda x: x.ravel()[:2], fn(p, r, t))
    temps[in_place] = memory_analysis(jax.jit(cut).lower(params, rest, tokens).compile())[
        "temp_size_in_bytes"]
  assert temps[False] - temps[True] >= 0.7 * stacked, (temps, stacked)
