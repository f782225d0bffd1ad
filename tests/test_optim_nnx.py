"""coat_adamw where users put it: `flax.nnx.Optimizer` (init on Variable-wrapped params, update on
arrays), optax's extra-argument convention (`value=loss`, optax.contrib wrappers), meshes with
Explicit axes (a `lax.scan` over steps carries one state type), and the state's partition specs
from the params' (`state_shardings`, the job `optax.tree_map_params` does for optax's states).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import coat_jax
from coat_jax.expansion import ExpandedMoment
from coat_jax.models import Llama
from coat_jax.optim import CoatAdamWState, coat_adamw, group_axes, state_shardings
from tests.test_llama import tiny

SEED = 20261126
LR = 3e-3
STEPS = 5


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(128, 256, rngs=rngs)
    self.l2 = nnx.Linear(256, 64, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x)))


def _model_and_loss(name):
  """(make(seed) -> model, loss(model, batch), batch) for the MLP or the tiny Llama in `name`."""
  rng = np.random.default_rng(SEED)
  if name == "mlp":
    x = jnp.asarray(rng.standard_normal((16, 128)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    return (lambda s: MLP(nnx.Rngs(s))), (lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)), (x, y)
  cfg = tiny(precision=name, num_layers=1)
  tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (4, 17)), jnp.int32)
  return ((lambda s: Llama(cfg, rngs=nnx.Rngs(s))),
          (lambda m, b: m.loss(b[:, :-1], b[:, 1:])), tokens)


def _nnx_losses(make, loss_fn, batch, tx):
  """Losses of STEPS jitted nnx.Optimizer steps on one batch (update gets value=loss)."""
  model = make(SEED)
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    opt.update(model, grads, value=loss)
    return loss

  return np.array([float(step(model, opt, batch)) for _ in range(STEPS)]), opt


@pytest.mark.parametrize("name,group_axis", [
    ("mlp", "coat"), ("mlp", "last"), ("coat", "coat"),
    # CI time (~10 s each): the same optimizer path as "coat", other model numerics
    pytest.param("bf16", "coat", marks=pytest.mark.slow),
    pytest.param("fp8_linear", "coat", marks=pytest.mark.slow)])
def test_nnx_optimizer_trains_like_optax_adamw(name, group_axis):
  """Default settings (FP8 moments for params of >= 4096 elements) in nnx.Optimizer: the loss
  over 5 steps on one batch follows optax.adamw's within 1% per step (FP8 moments: seen
  <= 0.06% on 2026-11-26) and falls; the tiny Llama (one layer) in each precision mode."""
  print(f"seed {SEED}")
  make, loss_fn, batch = _model_and_loss(name)
  ours, opt = _nnx_losses(make, loss_fn, batch,
                          coat_adamw(LR, weight_decay=0.1, group_axis=group_axis))
  ref, _ = _nnx_losses(make, loss_fn, batch, optax.adamw(LR, weight_decay=0.1))
  print(f"{name}: coat_adamw {np.round(ours, 4)}, optax.adamw {np.round(ref, 4)}")
  state = nnx.as_pure(opt.opt_state)
  moments = [m for m in jax.tree.leaves(state.mu, is_leaf=lambda x: isinstance(x, ExpandedMoment))
             if isinstance(m, ExpandedMoment)]
  assert moments and int(state.count) == STEPS   # FP8 moments, all steps taken
  assert np.all(np.isfinite(ours)) and ours[-1] < 0.97 * ours[0]
  np.testing.assert_allclose(ours, ref, rtol=0.01)


def test_group_axes_ignore_nnx_variable_wrappers():
  """A Variable-wrapped tree (paths end in .value) gets the axes of the plain tree; the state
  init makes from either is the same."""
  model = MLP(nnx.Rngs(SEED))
  wrapped, plain = nnx.state(model, nnx.Param), nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert jax.tree.leaves(group_axes("coat", wrapped)) == jax.tree.leaves(group_axes("coat", plain))
  assert group_axes("coat", plain)["l1"] == {"bias": -1, "kernel": -2}
  tx = coat_adamw(LR, group_axis="coat")
  a, b = tx.init(wrapped), tx.init(nnx.as_pure(wrapped))
  assert jax.tree.structure(a) == jax.tree.structure(b)
  assert a.mu["l1"]["kernel"].amax.shape == (1, 256)   # (128 / G, 256): grouped along axis -2
  assert coat_adamw(LR).init(wrapped).mu["l1"]["kernel"].amax.shape == (128, 2)  # default: last


def test_update_takes_extra_args_and_contrib_wrappers(rng):
  """update(..., value=loss) is accepted and ignored (GradientTransformationExtraArgs), so
  optax.contrib.reduce_on_plateau chains after it."""
  params = {"w": jnp.asarray(rng.standard_normal((64, 128)), jnp.float32)}
  grads = {"w": jnp.asarray(rng.standard_normal((64, 128)), jnp.float32)}
  tx = coat_adamw(LR)
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  state = tx.init(params)
  u1, _ = tx.update(grads, state, params, value=jnp.float32(1.0))
  u0, _ = tx.update(grads, state, params)
  np.testing.assert_array_equal(u1["w"], u0["w"])
  plateau = optax.chain(coat_adamw(LR), optax.contrib.reduce_on_plateau(patience=1))
  state = plateau.init(params)
  step = jax.jit(plateau.update)
  for loss in (1.0, 1.0, 1.0, 1.0):
    updates, state = step(grads, state, params, value=jnp.float32(loss))
  assert float(state[1].scale) < 1.0 and np.all(np.isfinite(updates["w"]))


# Explicit-sharding mesh over the 8 simulated devices: each split keeps G = 128 groups whole.
SHAPES = {"kernel": (1024, 32), "w": (32, 1024), "bias": (16,), "norm": (32,)}
SPECS = {"kernel": P("x", None), "w": P(None, "x"), "bias": P("x"), "norm": P()}


def _sharded_problem(rng, mesh):
  params = {k: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32) for k, s in SHAPES.items()}
  target = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}
  put = lambda t: {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in t.items()}
  return put(params), put(target)


def _scan_steps(tx, params, target, steps=3):
  loss = lambda p: sum(jnp.sum((p[k] - target[k]) ** 2) for k in p)

  def body(carry, _):
    p, s = carry
    g = jax.grad(loss)(p)
    u, s = tx.update(g, s, p)
    return (optax.apply_updates(p, u), s), loss(p)

  return jax.jit(lambda p, s: jax.lax.scan(body, (p, s), length=steps))(params, tx.init(params))


def _norm(spec) -> tuple:
  """A PartitionSpec as a tuple without trailing Nones (P('x', None) == P('x'))."""
  spec = tuple(spec)
  while spec and spec[-1] is None:
    spec = spec[:-1]
  return spec


def test_explicit_mesh_init_types_scan_and_specs(rng):
  """Under jax.set_mesh with Explicit axes: init's moments have the shardings update gives
  them (a lax.scan over 3 steps compiles, carry types equal), those are `state_shardings`'
  specs from the params' (where optax.tree_map_params cannot map the FP8 moments), the
  moments are sharded (not replicated), and the values equal the same steps on one device."""
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
  tx = coat_adamw(LR, min_quantized_size=1024)
  with jax.set_mesh(mesh):
    params, target = _sharded_problem(rng, mesh)
    state = tx.init(params)
    (new_p, new_s), losses = _scan_steps(tx, params, target)
    types = lambda t: jax.tree.map(lambda x: jax.typeof(x), t)
    assert types(state) == types(new_s)
    specs = state_shardings(SPECS, state)
    have = jax.tree.map(lambda x: _norm(jax.typeof(x).sharding.spec), new_s)
    assert have == jax.tree.map(_norm, specs, is_leaf=lambda x: isinstance(x, P))
  assert specs.mu["kernel"] == ExpandedMoment(P("x", None), P("x", None), P("x", None))
  assert specs.nu["w"].amax == P(None, "x") and specs.mu["bias"] == P("x")
  with pytest.raises(ValueError):   # what the helper is for: optax's mapping fails here
    optax.tree_map_params(tx, lambda _, s: s, state, SPECS, transform_non_params=lambda _: P())
  plain = jax.tree.map(np.asarray, (params, target))
  (ref_p, ref_s), ref_losses = _scan_steps(tx, *jax.tree.map(jnp.asarray, plain))
  np.testing.assert_allclose(np.asarray(losses), np.asarray(ref_losses), rtol=1e-6)
  for a, b in zip(jax.tree.leaves((new_p, new_s)), jax.tree.leaves((ref_p, ref_s))):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=1e-5, atol=1e-6)


def test_state_shardings_take_specs_and_nnx_partition_specs():
  """PartitionSpecs (with mesh=) give the specs of the NamedSharding result; an nnx.State of
  Params holding specs gives the same."""
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
  params = {k: jnp.ones(s, jnp.float32) for k, s in SHAPES.items()}
  state = coat_adamw(LR, min_quantized_size=1024).init(params)
  named = state_shardings({k: NamedSharding(mesh, s) for k, s in SPECS.items()}, state)
  specs = state_shardings(SPECS, state, mesh=mesh)
  assert jax.tree.map(lambda s: s.spec, named) == specs
  nnx_state = coat_adamw(LR, min_quantized_size=1024).init(
      nnx.State({k: nnx.Param(v) for k, v in params.items()}))
  wrapped = nnx.State({k: nnx.Param(s) for k, s in SPECS.items()})
  is_spec = lambda x: isinstance(x, P)
  assert (jax.tree.leaves(state_shardings(wrapped, nnx_state, mesh=mesh), is_leaf=is_spec)
          == jax.tree.leaves(specs, is_leaf=is_spec))
  with pytest.raises(ValueError, match="need a mesh"):
    state_shardings(SPECS, state)
  # 2 groups of 128 along u's last axis, split 8 ways: its scales are replicated, its codes not
  cut = coat_adamw(LR, min_quantized_size=1024).init({"u": jnp.ones((32, 256))})
  cut_specs = state_shardings({"u": P(None, "x")}, cut, mesh=mesh)
  assert cut_specs.mu["u"] == ExpandedMoment(P(None, "x"), P(None, None), P(None, None))
  assert isinstance(state, CoatAdamWState) and coat_jax.state_shardings is state_shardings
