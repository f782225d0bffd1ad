"""Global-norm clipping fused into the coat_adamw step (`max_grad_norm`): equals
optax.chain(optax.clip_by_global_norm(c), coat_adamw(...)) up to float32 rounding, for the
optax transformation, coat_adamw_apply, the Pallas (interpret) dispatch and train.py's build.

Tolerances: the fused step scales g by one float32 scale c / |g| where optax computes
(g / |g|) * c per element, so the scaled gradients differ by an ulp; an ulp can move a moment
across an FP8 rounding boundary (one code, up to 2^-3 relative for e4m3) and that element's later steps
with it: one flip moves the relative L2 of a ~10^4-element leaf's change by ~1e-3. So params and
moments are compared in relative L2 (5e-3, a few flips; seen here: ~1e-7, none), never
elementwise. With every norm below c the scale is exactly 1 (see the test for what is bitwise).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from coat_jax import kernels
from coat_jax.kernels import adam as kernels_adam
from coat_jax.adam_math import adam_moments, adam_step_reference, clip_scale, load_moment
from coat_jax.expansion import ExpandedMoment
from coat_jax.optim import (DEFAULT_GROUP_AXIS, CoatAdamWState, coat_adamw, coat_adamw_apply,
                            group_axes)
from coat_jax.training import build as build_lib
from coat_jax.training import schema as config_lib
from tests.test_optim import _run   # init, then jitted update + apply_updates per gradient

SHAPES = {"w": (256, 64), "u": (128, 96), "bias": (7,)}   # two quantized leaves, one float32
KW = dict(weight_decay=0.1, min_quantized_size=4096)
MAX_NORM = 1.0


def _params(rng):
  return {k: jnp.asarray(rng.standard_normal(s).astype(np.float32) * 0.1)
          for k, s in SHAPES.items()}


def _grads(rng, params, norm):
  """Random gradients rescaled to global norm `norm`."""
  g = {k: rng.standard_normal(p.shape).astype(np.float32) for k, p in params.items()}
  total = np.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g.values()))
  return {k: jnp.asarray(x * np.float32(norm / total)) for k, x in g.items()}


# Norms far above and below c: clipped steps then weigh the history differently than unclipped
# ones (a constant scale would cancel in Adam's m / sqrt(v)).
NORMS = (40.0, 0.3, 7.0)


def _moments(state):
  """Every moment of a CoatAdamWState for SHAPES' params as float32 (dequantized), a flat list."""
  axes = jax.tree.leaves(group_axes(DEFAULT_GROUP_AXIS, {k: jnp.zeros(s) for k, s in
                                                          SHAPES.items()}))
  out = []
  for tree in (state.mu, state.nu):
    for m, a in zip(jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, ExpandedMoment)), axes):
      out.append(np.asarray(load_moment(m, "e4m3", 128, 16, a)))
  return out


def _rel(a, b, base):
  return np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(base))


def _check_close(params0, got, want, got_state, want_state, tol=5e-3):
  for k in params0:
    change = np.asarray(want[k]) - np.asarray(params0[k])
    assert np.abs(change).max() > 1e-4, k        # the params moved
    rel = _rel(got[k], want[k], change)
    print(f"{k}: relative L2 of the param change {rel:.2e}")
    assert rel < tol, (k, rel)
  for a, b in zip(_moments(got_state), _moments(want_state)):
    assert _rel(a, b, b) < tol


def test_max_grad_norm_equals_chain_with_clip(rng):
  params = _params(rng)
  grads = [_grads(rng, params, n) for n in NORMS]
  chain = optax.chain(optax.clip_by_global_norm(MAX_NORM), coat_adamw(1e-2, **KW))
  want, want_state = _run(chain, params, grads)
  got, got_state = _run(coat_adamw(1e-2, max_grad_norm=MAX_NORM, **KW), params, grads)
  _check_close(params, got, want, got_state, want_state[1])
  # Without clipping the result is far off: the comparison above sees the scale.
  plain, plain_state = _run(coat_adamw(1e-2, **KW), params, grads)
  assert _rel(plain["w"], want["w"], want["w"] - params["w"]) > 0.05
  assert _rel(_moments(plain_state)[0], _moments(want_state[1])[0], _moments(want_state[1])[0]) > 1


def test_below_max_norm_is_the_chain_step(rng):
  """Every global norm < c: the scale is exactly 1 and the step is the chain's: bit for bit per
  step (`adam_moments` with scale 1 is bitwise the unscaled one), and to an ulp over the jitted
  update, where XLA:CPU fuses the extra multiply differently (an FMA contraction moves an ulp of v
  here: 1.2e-7 relative)."""
  params = _params(rng)
  grads = [_grads(rng, params, n) for n in (0.9, 0.05)]
  chain = optax.chain(optax.clip_by_global_norm(MAX_NORM), coat_adamw(1e-2, **KW))
  want, want_state = _run(chain, params, grads)
  got, got_state = _run(coat_adamw(1e-2, max_grad_norm=MAX_NORM, **KW), params, grads)
  for a, b in zip(jax.tree.leaves((got, got_state)), jax.tree.leaves((want, want_state[1]))):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.itemsize == 1:   # FP8 codes / k codes
      assert np.mean(a.astype(np.float32) == b.astype(np.float32)) > 0.999
    else:
      np.testing.assert_allclose(a, b, rtol=3e-7, atol=0)
  g = grads[0]["w"]
  m, v = jnp.zeros_like(g), jnp.abs(g) * 1e-3
  step = jax.jit(lambda g, m, v, s: adam_moments(g, m, v, b1=0.9, b2=0.999, eps=1e-8,
                                                 count=jnp.int32(2), grad_scale=s))
  for a, b in zip(step(g, m, v, clip_scale(optax.tree.norm(grads[0]), MAX_NORM)),
                  step(g, m, v, None)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_apply_max_grad_norm_equals_chain_with_clip(rng):
  params = _params(rng)
  grads = [_grads(rng, params, n) for n in NORMS]
  chain = optax.chain(optax.clip_by_global_norm(MAX_NORM), coat_adamw(1e-2, **KW))
  want, want_state = _run(chain, params, grads)
  apply = jax.jit(coat_adamw_apply(1e-2, max_grad_norm=MAX_NORM, **KW))
  got, state = params, coat_adamw(1e-2, **KW).init(params)
  for g in grads:
    got, state = apply(g, state, got)
  assert jax.tree.structure(state) == jax.tree.structure(want_state[1])
  _check_close(params, got, want, state, want_state[1])


@pytest.mark.gpu
def test_pallas_dispatch_matches_reference_with_grad_scale(rng):
  """kernels_adam.coat_adam_step(grad_scale=s) on the jax-triton kernel (which scales the
  gradient as it loads it) against the jnp reference."""
  p = jnp.asarray(rng.standard_normal((8, 256)).astype(np.float32))
  g = jnp.asarray(rng.standard_normal((8, 256)).astype(np.float32))
  m0 = coat_adamw(1e-2, min_quantized_size=1, group_axis="last").init({"w": p}).mu["w"]
  warm = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1, m_format="e4m3",
              v_format="e4m3", group_size=128, expand=True, expand_min=16)
  _, m, v = adam_step_reference(p, g * 3.0, m0, m0, count=jnp.int32(1), **warm)  # nonzero moments
  scale = clip_scale(jnp.float32(7.0), 1.0)
  args = (p, g, m, v)
  kw = dict(count=jnp.int32(2), grad_scale=scale, **warm)
  with kernels.backend("pallas"):
    got = jax.jit(lambda *a: kernels_adam.coat_adam_step(*a, **kw))(*args)
  want = jax.jit(lambda *a: adam_step_reference(*a, **kw))(*args)
  plain = adam_step_reference(*args, **dict(kw, grad_scale=None))
  change = np.asarray(want[0]) - np.asarray(p)
  assert _rel(got[0], want[0], change) < 1e-3
  assert _rel(plain[0], want[0], change) > 1e-2   # the scale matters here
  for a, b in zip(got[1:], want[1:]):
    a32, b32 = (load_moment(x, "e4m3", 128, 16) for x in (a, b))
    assert _rel(a32, b32, b32) < 1e-2


def test_clip_scale_matches_optax_clip(rng):
  """g * clip_scale(|g|, c) is optax.clip_by_global_norm(c)'s result to float32 rounding."""
  g = {"a": jnp.asarray(rng.standard_normal((300,)).astype(np.float32)),
       "b": jnp.asarray(rng.standard_normal((40, 3)).astype(np.float32))}
  for c in (0.5, 1e3):
    want, _ = optax.clip_by_global_norm(c).update(g, optax.EmptyState())
    s = clip_scale(optax.tree.norm(g), c)
    for k in g:
      np.testing.assert_allclose(g[k] * s, want[k], rtol=2e-7, atol=0)
  assert float(clip_scale(jnp.float32(jnp.inf), 1.0)) == 0.0
  assert np.isnan(float(clip_scale(jnp.float32(jnp.nan), 1.0)))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), True, "1", jnp.ones(2)])
def test_bad_max_grad_norm_is_refused(bad):
  with pytest.raises(ValueError, match="max_grad_norm"):
    coat_adamw(1e-3, max_grad_norm=bad)
  with pytest.raises(ValueError, match="max_grad_norm"):
    coat_adamw_apply(1e-3, max_grad_norm=bad)


def test_train_build_apply_clips_in_the_step(rng):
  """train.py's build (build_optimizer + build_apply) with clip > 0: one CoatAdamWState, made by
  build_optimizer's coat_adamw and stepped by build_apply's coat_adamw_apply (clipping fused),
  against optax.chain(clip_by_global_norm, coat_adamw) (clipping first): params to FP8
  tolerance."""
  opt = config_lib.OptimizerConfig(name="coat_adamw", lr=1e-2, warmup=1, clip=0.5,
                                   min_quantized_size=4096)
  tx, schedule = build_lib.build_optimizer(opt, total_steps=10)
  apply = jax.jit(build_lib.build_apply(opt, tx, schedule))
  args, kwargs = build_lib._coat_arguments(opt)
  assert kwargs.pop("max_grad_norm") == 0.5
  chain = optax.chain(optax.clip_by_global_norm(0.5), coat_adamw(schedule, *args, **kwargs))
  reference = jax.jit(build_lib.optax_apply(chain))
  params = _params(rng)
  state = tx.init(params)
  assert isinstance(state, CoatAdamWState)
  want_p, want_s, got_p, got_s = params, chain.init(params), params, state
  for n in NORMS:   # the warmup schedule's lr is 0 at the first step
    g = _grads(rng, params, n)
    want_p, want_s = reference(g, want_s, want_p)
    got_p, got_s = apply(g, got_s, got_p)
    assert jax.tree.structure(got_s) == jax.tree.structure(state)
  _check_close(params, got_p, want_p, got_s, want_s[1])
