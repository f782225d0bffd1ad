"""The Adam dispatch (coat_jax.kernels.adam): its step against a float64 numpy step written here
from the spec (on the CPU the reference; on a GPU the jax-triton kernel), and coat_adamw on the
kernel against the reference backend (GPU)."""
import functools
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from coat_jax import adam_math, expansion, kernels, optim
from coat_jax.kernels import adam as kernels_adam
from tests import adam_standin
from tests.test_optim import _np_expand
from tests.jaxpr_walk import equations

# A kernel in a jaxpr: a pallas_call (Pallas, Mosaic GPU) or a jax-triton call.
KERNEL_PRIMITIVES = ("pallas_call", "triton_kernel_call")


def n_kernels(jaxpr) -> int:
  """Kernel calls in a (closed) jaxpr and its sub-jaxprs."""
  return sum(eqn.primitive.name in KERNEL_PRIMITIVES for eqn in equations(jaxpr))
HYPER = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
NP_DTYPE = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def np_dequantize(mom, fmt, g=128, expand_min=16):
  """Stored form -> float64: x = sign(q) * amax * (|q| / fmax)^(1 / k), k = k_code / expand_min."""
  q = np.asarray(mom.data, np.float64)
  rows = q.reshape(*q.shape[:-1], -1, g)
  k = (np.asarray(mom.k_code, np.float64) / expand_min)[..., None]
  mx = np.asarray(mom.amax, np.float64)[..., None]
  return (np.sign(rows) * mx * (np.abs(rows) / FMAX[fmt]) ** (1 / k)).reshape(q.shape)


def np_adam(p, g, m, v, *, lr, b1, b2, eps, weight_decay, count):
  """The spec's Adam step in float64: (new p, m, v)."""
  p, g = np.asarray(p, np.float64), np.asarray(g, np.float64)
  m = b1 * m + (1 - b1) * g
  v = b2 * v + (1 - b2) * g * g
  denom = (np.sqrt(v) / np.sqrt(1 - b2**count) + eps) * (1 - b1**count)
  return p - lr * (m / denom + weight_decay * p), m, v


def np_expand_codes(x, fmt, g=128, expand_min=16):
  """The spec's requantization in float64 (tests.test_optim._np_expand): (k per group, FP8
  ordinals of q = sign(x) fmax (|x| / mx)^k)."""
  k, _, y = _np_expand(x, fmt, g, expand_min)
  return k, _ordinal(np.clip(y, -FMAX[fmt], FMAX[fmt]).astype(NP_DTYPE[fmt]))


def _ordinal(q):
  b = np.asarray(q).view(np.uint8).astype(np.int32)
  return np.where(b & 0x80, -(b & 0x7F), b & 0x7F)


def assert_step_matches_spec(got, p, g, m, v, args):
  """got = (new p, new m, new v) vs the float64 spec step from the same stored moments: the param
  step to 1e-4 relative (float32 exp2/log2 of the dequantized moments, and m's cancellation where
  b1 m ~ -(1-b1) g: atol 1e-4 of the largest step); new moments: k equal in >= 95% of groups and
  at most one step apart (float32 log2 on a floor boundary), codes one step apart at most where
  k agrees (float32 vs float64 powers on a rounding tie), equal in >= 99%."""
  hyper = {k: args[k] for k in ("lr", "b1", "b2", "eps", "weight_decay")}
  want_p, want_m, want_v = np_adam(p, g, np_dequantize(m, args["m_format"]),
                                   np_dequantize(v, args["v_format"]), count=int(args["count"]),
                                   **hyper)
  p0 = np.asarray(p, np.float64)
  step, want_step = np.asarray(got[0], np.float64) - p0, want_p - p0
  np.testing.assert_allclose(step, want_step, rtol=1e-4, atol=1e-4 * np.abs(want_step).max())
  for mom, x, fmt in ((got[1], want_m, args["m_format"]), (got[2], want_v, args["v_format"])):
    k64, codes64 = np_expand_codes(x, fmt)
    k = np.asarray(mom.k_code, np.float64) / 16
    assert np.abs(k - k64).max() <= 1 / 16 + 1e-12 and (k == k64).mean() >= 0.95
    same = np.repeat(k == k64, 128, axis=-1)
    d = np.abs(_ordinal(np.asarray(mom.data)) - codes64)[same]
    assert d.max() <= 1 and (d == 0).mean() >= 0.99, (d.max(), (d == 0).mean())


def _state(rng, shape, m_format, v_format, expand):
  p = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  g = jnp.asarray(rng.standard_normal(shape) * np.exp2(rng.integers(-8, 2, shape)), jnp.float32)
  m0 = rng.standard_normal(shape) * 1e-3 * np.exp2(rng.integers(-6, 3, shape))
  v0 = (rng.standard_normal(shape) * 1e-3) ** 2 * np.exp2(rng.integers(-4, 4, shape))
  m = expansion.quantize_expanded(jnp.asarray(m0, jnp.float32), m_format, 128, 16, expand)
  v = expansion.quantize_expanded(jnp.asarray(v0, jnp.float32), v_format, 128, 16, expand)
  return p, g, m, v


def _codes_where_k_agrees(a, b):
  """FP8 codes (as int32 bytes) of two ExpandedMoments in the groups whose k codes agree, and that
  element mask. A k one step (1/16) apart rescales a group's small values by up to
  2^(log2(R)/16), i.e. a binade (8 E4M3 codes), so only such groups compare code by code."""
  same_k = np.repeat(np.asarray(a.k_code) == np.asarray(b.k_code), 128,
                     axis=-1)[..., :a.data.shape[-1]]
  codes = lambda m: np.asarray(jax.lax.bitcast_convert_type(m.data, jnp.uint8)).astype(np.int32)
  return codes(a)[same_k], codes(b)[same_k], same_k


def _compare(got, want, p0, min_equal=0.999):
  (gp, gm, gv), (wp, wm, wv) = got, want
  # Params: the old moments are dequantized with exp2/log2 that differ from XLA's (by ulps, or
  # by ~3e-6 relative with fast_math), so m / denom can differ by that, and by far more relative
  # where b1*m and (1-b1)*g nearly cancel: the step p1 - p0 is compared to the leaf's largest
  # step (1e-4 of it; FP8 storage of m moves it by ~6%).
  p0 = np.asarray(p0, np.float32)
  dg, dw = np.asarray(gp, np.float32) - p0, np.asarray(wp, np.float32) - p0
  np.testing.assert_allclose(dg, dw, rtol=1e-4, atol=1e-4 * np.abs(dw).max())
  for a, b in ((gm, wm), (gv, wv)):
    # exp2/log2 differ from XLA's in the last ulps, so the dequantized old moments (and their new
    # group maxima) can differ by a few ulps; k (a floor of a log ratio) by one step, rarely.
    ka, kb = np.asarray(a.k_code, np.int32), np.asarray(b.k_code, np.int32)
    assert np.abs(ka - kb).max() <= 1 and (ka == kb).mean() >= 0.95
    np.testing.assert_allclose(np.asarray(a.amax), np.asarray(b.amax), rtol=5e-5)
    qa, qb, _ = _codes_where_k_agrees(a, b)
    assert (qa == qb).mean() >= min_equal, (qa != qb).mean()
    assert np.abs(qa - qb).max() <= 1   # off by one code at most (same sign)


@pytest.mark.gpu
def test_adam_step_zero_group_and_dispatch(rng):
  p, g, m, v = _state(rng, (4, 128), "e4m3", "e4m3", True)
  g = g.at[1].set(0.0)
  m = m._replace(data=m.data.at[1].set(0.0))
  v = v._replace(data=v.data.at[1].set(0.0))    # all-zero group: k = 1, finite amax
  args = dict(HYPER, count=jnp.int32(1), m_format="e4m3", v_format="e4m3", group_size=128,
              expand=True, expand_min=16)
  want = jax.jit(functools.partial(adam_math.adam_step_reference, **args))(p, g, m, v)
  with kernels.backend("pallas"):
    got = jax.jit(functools.partial(kernels_adam.coat_adam_step, **args))(p, g, m, v)
    jaxpr = jax.make_jaxpr(functools.partial(kernels_adam.coat_adam_step, **args))(p, g, m, v)
  assert n_kernels(jaxpr) == 1
  _compare(got, want, p)
  assert_step_matches_spec(got, p, g, m, v, args)
  assert int(got[1].k_code[1, 0]) == 16 and np.isfinite(np.asarray(got[1].amax)).all()


def test_dispatch_matches_the_float64_spec_and_odd_shapes_take_the_reference(rng):
  p, g, m, v = _state(rng, (3, 200), "e4m3", "e4m3", True)   # 200 % 128 != 0
  args = dict(HYPER, count=jnp.int32(3), m_format="e4m3", v_format="e4m3", group_size=128,
              expand=True, expand_min=16)
  p2, g2, m2, v2 = _state(rng, (3, 256), "e4m3", "e4m3", True)
  for backend in ("pallas", "reference"):
    with kernels.backend(backend):
      got = jax.jit(functools.partial(kernels_adam.coat_adam_step, **args))(p2, g2, m2, v2)
    assert_step_matches_spec(got, p2, g2, m2, v2, args)
  with kernels.backend("pallas"):   # the odd shape: the reference, same spec
    got = jax.jit(functools.partial(kernels_adam.coat_adam_step, **args))(p, g, m, v)
  assert got[0].shape == (3, 200) and np.isfinite(np.asarray(got[0])).all()
  # (3, 200): groups of 128 + a short one of 72; compare the first group of each row.
  cut = lambda mom: expansion.ExpandedMoment(mom.data[:, :128], mom.amax[:, :1],
                                             mom.k_code[:, :1])
  assert_step_matches_spec((got[0][:, :128], cut(got[1]), cut(got[2])), p[:, :128], g[:, :128],
                           cut(m), cut(v), args)


def _tree_step_args() -> dict:
  """coat_adam_tree_step's settings but weight_decay (its argument beside the decay flags)."""
  return dict({k: v for k, v in HYPER.items() if k != "weight_decay"}, count=jnp.int32(3),
              m_format="e4m3", v_format="e4m3", group_size=128, expand=True, expand_min=16)


def test_tree_step_traces_each_leaf_setting_once(monkeypatch, rng):
  """coat_adam_tree_step traces `coat_adam_step` once per distinct (shape, setting): four
  (4, 256) leaves and one (2, 128), with and without decay, are three traces, and every leaf's
  result is its own step's."""
  leaves = [_state(rng, s, "e4m3", "e4m3", True) for s in [(4, 256)] * 4 + [(2, 128)]]
  decay = [True, True, False, True, True]
  args = _tree_step_args()
  traced = []
  step = kernels_adam.coat_adam_step
  monkeypatch.setattr(kernels_adam, "coat_adam_step",
                      lambda *a, **k: traced.append(a[0].shape) or step(*a, **k))
  got = jax.jit(lambda ls: kernels_adam.coat_adam_tree_step(
      *[list(x) for x in zip(*ls)], decay, weight_decay=0.1, **args))(leaves)
  assert len(traced) == 3, traced
  for (p, g, m, v), d, out in zip(leaves, decay, got):
    want = jax.jit(functools.partial(adam_math.adam_step_reference,
                                     weight_decay=0.1 if d else 0.0, **args))(p, g, m, v)
    _assert_updates_close(out[0], want[0])
    _assert_moments_close(out[1], want[1], "e4m3")
    _assert_moments_close(out[2], want[2], "e4m3")


def test_tree_step_traced_anew_for_each_step(monkeypatch, rng):
  """The per-setting jits live for one tree step: the same step traced again after the Adam
  kernel appeared (its stand-in installed) calls it, not the first trace's reference."""
  leaves = [_state(rng, (4, 256), "e4m3", "e4m3", True) for _ in range(2)]
  args = _tree_step_args()
  step = lambda ls: kernels_adam.coat_adam_tree_step(*[list(x) for x in zip(*ls)], [True] * 2,
                                                     weight_decay=0.1, **args)
  takes_nothing = types.SimpleNamespace(supported=lambda *a, **k: False)
  monkeypatch.setattr(kernels_adam, "_triton_kernels", lambda: takes_nothing)   # the reference
  with kernels.backend("adam=triton"):   # a new function each time, as a new train step
    jax.make_jaxpr(lambda ls: step(ls))(leaves)
    shapes = adam_standin.install(monkeypatch)
    jax.make_jaxpr(lambda ls: step(ls))(leaves)
  assert shapes and set(shapes) == {(4, 256)}, shapes


# ------------------------------------------------------------------------------------------------
# coat_adamw through the dispatch: the Pallas backend must give the reference backend's step.


def _compiled(backend, fn, *args):
  """(fn jitted and compiled under `backend`, its number of kernels); the kernel choice is
  made at trace time, so the compiled function keeps it."""
  with kernels.backend(backend):
    traced = jax.jit(fn).trace(*args)
    return traced.lower().compile(), n_kernels(traced.jaxpr)


_dequantize = jax.jit(expansion.dequantize_expanded, static_argnums=(1, 2, 3))


def _assert_updates_close(got, want):
  """Same step on both paths: float32 rounding plus ulp-level log2/exp2 differences in the
  dequantized moments (relative ~1e-5 at worst where m nearly cancels, so the bound is scaled by
  the leaf's largest update there); one ulp of a narrower update dtype (bf16)."""
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype and a.shape == b.shape
    rtol = max(2e-5, float(jnp.finfo(a.dtype).eps))
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=2e-5 * np.abs(b).max())


def _assert_moments_close(got, want, fmt):
  """k codes equal but for a rare group one step off (a floor of a log ratio); in the groups whose
  k agrees, FP8 codes equal but for rare one-code flips, and where codes agree the dequantized
  moments agree to ~amax rounding. float32 moments: float32 rounding."""
  if not isinstance(want, optim.ExpandedMoment):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=1e-12)
    return
  ka, kb = np.asarray(got.k_code, np.int32), np.asarray(want.k_code, np.int32)
  assert (ka != kb).sum() <= 1 and np.abs(ka - kb).max() <= 1
  np.testing.assert_allclose(np.asarray(got.amax), np.asarray(want.amax), rtol=5e-5)
  qa, qb, same_k = _codes_where_k_agrees(got, want)
  assert (qa != qb).sum() <= max(2, qa.size // 200) and np.abs(qa - qb).max() <= 1
  da, db = (np.asarray(_dequantize(x, fmt, 128, 16))[same_k] for x in (got, want))
  np.testing.assert_allclose(da[qa == qb], db[qa == qb], rtol=1e-4, atol=0)


@pytest.mark.gpu
def test_coat_adamw_pallas_matches_reference_backend(rng):
  """3 steps with a schedule, masked decay, E4M3/E5M2 moments; small odd shapes: two leaves take
  the kernel, one falls back (200 % 128 != 0), one keeps float32 moments. Each step starts both
  paths from the same (reference) state; coat_adamw_apply (kernel writing params) rides along."""
  shapes = {"w": (3, 256), "u": (2, 3, 128), "odd": (5, 200), "bias": (7,)}
  params = {n: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32) for n, s in shapes.items()}
  kw = dict(b1=0.9, b2=0.99, weight_decay=0.1, v_format="e5m2", min_quantized_size=100,
            mask={"w": True, "u": False, "odd": True, "bias": False})
  sched = optax.linear_schedule(1e-2, 2e-3, 3)          # lr moves every step: a traced scalar
  opt = optim.coat_adamw(sched, **kw)
  state = jax.jit(opt.init)(params)
  assert isinstance(state.mu["odd"], optim.ExpandedMoment) and state.mu["bias"].ndim == 1
  grads = lambda: {n: jnp.asarray(rng.standard_normal(s) * np.exp2(rng.integers(-8, 2, s)),
                                  jnp.float32) for n, s in shapes.items()}
  g = grads()
  ref, n_ref = _compiled("reference", opt.update, g, state, params)
  pal, n_pal = _compiled("pallas", optim.coat_adamw(sched, **kw).update, g, state, params)
  apply, n_apply = _compiled("pallas", optim.coat_adamw_apply(sched, **kw), g, state, params)
  # The kernel for "w" and "u": one launch each.
  assert (n_ref, n_pal, n_apply) == (0, 2, 2)
  with pytest.raises(ValueError, match="params are required"):
    optim.coat_adamw_apply(sched, **kw)(g, state)
  for step in range(3):
    want_u, want_s = ref(g, state, params)
    got_u, got_s = pal(g, state, params)
    new_params, apply_s = apply(g, state, params)
    _assert_updates_close(got_u, want_u)
    assert int(got_s.count) == int(want_s.count) == step + 1
    for got_state in (got_s, apply_s):
      for name in shapes:
        _assert_moments_close(got_state.mu[name], want_s.mu[name], "e4m3")
        _assert_moments_close(got_state.nu[name], want_s.nu[name], "e5m2")
    want_p = jax.jit(optax.apply_updates)(params, want_u)
    for name in shapes:   # p - lr*d vs p + (-lr*d): one more float32 rounding at the params' scale
      ulp = float(np.spacing(np.float32(np.abs(np.asarray(params[name])).max())))
      np.testing.assert_allclose(new_params[name], want_p[name], rtol=0,
                                 atol=ulp + 2e-5 * np.abs(np.asarray(want_u[name])).max())
    params, state, g = want_p, want_s, grads()


@pytest.mark.gpu
def test_coat_adamw_pallas_under_apply_if_finite_without_params(rng):
  """weight_decay=0 and no params passed (the kernel's param-free form) inside apply_if_finite:
  same step as the reference backend; a non-finite gradient keeps the FP8 state bit-identical
  and gives zero updates."""
  shapes = {"w": (4, 256), "b": (7,)}
  grads = lambda: {n: jnp.asarray(rng.standard_normal(s), jnp.float32) for n, s in shapes.items()}
  make = lambda: optax.apply_if_finite(
      optim.coat_adamw(1e-3, weight_decay=0.0, min_quantized_size=100), max_consecutive_errors=3)
  opt = make()
  state = jax.jit(opt.init)({n: jnp.zeros(s) for n, s in shapes.items()})
  g = grads()
  ref, _ = _compiled("reference", make().update, g, state)
  pal, n_pal = _compiled("pallas", opt.update, g, state)
  assert n_pal == 1
  state = ref(g, state)[1]   # non-zero moments
  g = grads()
  (want_u, want_s), (got_u, got_s) = ref(g, state), pal(g, state)
  _assert_updates_close(got_u, want_u)
  for name in shapes:
    _assert_moments_close(got_s.inner_state.mu[name], want_s.inner_state.mu[name], "e4m3")
    _assert_moments_close(got_s.inner_state.nu[name], want_s.inner_state.nu[name], "e4m3")
  g["w"] = g["w"].at[2, 5].set(jnp.inf)
  bad_u, bad_s = pal(g, state)
  assert int(bad_s.notfinite_count) == 1
  for a, b in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(bad_s.inner_state)):
    a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(bad_u))
