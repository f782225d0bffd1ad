"""coat_adamw: equals optax.adamw unquantized, trains like it quantized, composes with optax, jit,
sharding, orbax; state bytes; bad arguments."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from coat_jax import expansion as ex
from coat_jax import optim, optim_state
from coat_jax.optim import (CoatAdamWState, ExpandedMoment, coat_adamw,
                            optimizer_state_bytes, state_shardings)
from tests.test_expansion import char_batches, init_char_lm, stdlib_text, train


def _params(rng, shapes):
  return {name: jnp.asarray(rng.standard_normal(s).astype(np.float32) * 0.1)
          for name, s in shapes.items()}


SHAPES = {"w": (64, 512), "u": (32, 260), "bias": (7,)}


def _grads(rng, params):
  return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape).astype(np.float32)
                                            * np.exp(rng.uniform(-3, 1))), params)


def _run(opt, params, grads_list):
  state = opt.init(params)
  step = jax.jit(opt.update)
  for g in grads_list:
    updates, state = step(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def test_unquantized_equals_optax_adamw(rng):
  params = _params(rng, SHAPES)
  grads = [_grads(rng, params) for _ in range(20)]
  sched = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 5, 20)
  mask = {"w": True, "u": True, "bias": False}
  ours, _ = _run(coat_adamw(sched, weight_decay=0.1, mask=mask, quantize=False), params, grads)
  ref, _ = _run(optax.adamw(sched, weight_decay=0.1, mask=mask), params, grads)
  for name in params:
    np.testing.assert_allclose(ours[name], ref[name], rtol=2e-6, atol=1e-7)
  assert not np.allclose(ours["w"], params["w"])


FMAX = {"e4m3": 448.0, "e5m2": 57344.0}


def _np_dequantize(mom, fmt, g=128, expand_min=16):
  """An ExpandedMoment grouped along the last axis -> float64: x = sign(q) amax (|q| / fmax)^(1/k),
  k = k_code / expand_min (the spec, written here independently of coat_jax.expansion)."""
  q = np.asarray(mom.data, np.float64)
  rows = q.reshape(*q.shape[:-1], -1, g)
  k = (np.asarray(mom.k_code, np.float64) / expand_min)[..., None]
  mx = np.asarray(mom.amax, np.float64)[..., None]
  return (np.sign(rows) * mx * (np.abs(rows) / FMAX[fmt]) ** (1 / k)).reshape(q.shape)


def _np_expand(x, fmt, g=128, expand_min=16):
  """The spec's requantization in float64: (k per group, amax, q = sign(x) fmax (|x| / mx)^k as
  float64 values of the format), k = floor(log2(fmax^2 / 2) / log2(mx / mn) * expand_min) /
  expand_min (1 where mx == mn)."""
  a = np.abs(x).reshape(*x.shape[:-1], -1, g)
  mx = a.max(-1) + 1e-30
  mn = np.where(a > 0, a, np.inf).min(-1)
  mn = np.where(np.isinf(mn), mx, mn + 1e-30)
  with np.errstate(divide="ignore"):
    lr = np.log2(mx / mn)
    k = np.floor(np.log2(FMAX[fmt] ** 2 / 2) / lr * expand_min) / expand_min
  k = np.where(lr > 0, np.clip(k, 1 / expand_min, 255 / expand_min), 1.0)
  y = np.sign(x) * (FMAX[fmt] * (a / mx[..., None]) ** k[..., None]).reshape(x.shape)
  return k, mx, y


def test_update_equals_float64_adam_with_expansion(rng):
  """coat_adamw.update (jitted, 2 steps, the second from non-zero FP8 moments) against numpy
  float64: Adam from the state's dequantized moments (the update to 1e-4 relative: float32
  exp2/log2 of the moments), and the new moments' k, amax and codes against the spec's
  requantization of the float64 moments (k and codes equal in >= 95% / 99%, one step apart at
  most: float32 powers on a floor or rounding tie)."""
  lr, wd, b1, b2, eps = 1e-2, 0.05, 0.9, 0.999, 1e-8
  p = _params(rng, {"w": (16, 384)})["w"]
  opt = coat_adamw(lr, b1, b2, eps, weight_decay=wd, min_quantized_size=1)
  state = opt.init({"w": p})
  for t in (1, 2):
    g = _grads(rng, {"w": p})["w"]
    updates, new_state = jax.jit(opt.update)({"w": g}, state, {"w": p})
    p64, g64 = np.asarray(p, np.float64), np.asarray(g, np.float64)
    m = b1 * _np_dequantize(state.mu["w"], "e4m3") + (1 - b1) * g64
    v = b2 * _np_dequantize(state.nu["w"], "e4m3") + (1 - b2) * g64 ** 2
    denom = (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps) * (1 - b1 ** t)
    want = -lr * (m / denom + wd * p64)
    got = np.asarray(updates["w"], np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert int(new_state.count) == t
    for mom, x in ((new_state.mu["w"], m), (new_state.nu["w"], v)):
      assert mom.data.dtype == jnp.float8_e4m3fn
      k64, mx64, y64 = _np_expand(x, "e4m3")
      k = np.asarray(mom.k_code, np.float64) / 16
      assert np.abs(k - k64).max() <= 1 / 16 + 1e-12 and (k == k64).mean() >= 0.95
      np.testing.assert_allclose(np.asarray(mom.amax, np.float64), mx64, rtol=1e-6)
      same = np.repeat(k == k64, 128, axis=-1)
      codes = np.asarray(mom.data, np.float64)
      want_codes = np.asarray(jnp.asarray(y64, jnp.float32).astype(jnp.float8_e4m3fn), np.float64)
      # one code step of e4m3 is at most 2^-3 relative (2^-9 absolute below the normal range)
      d = np.abs(codes - want_codes)[same]
      assert np.all(d <= 2.0 ** -3 * np.abs(want_codes[same]) + 2.0 ** -9)
      assert (d == 0).mean() >= 0.99, (d == 0).mean()
    p, state = p + updates["w"], new_state


def test_quantized_trains_like_adamw(rng):
  text = stdlib_text(rng, n_files=4)
  xs, ys = char_batches(rng, text, steps=300, batch=64)
  params = init_char_lm(jax.random.key(int(rng.integers(2**31))))
  sched = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, 300)
  _, _, ref = train(optax.adamw(sched, weight_decay=1e-4), params, xs, ys)
  _, state, ours = train(coat_adamw(sched), params, xs, ys)
  assert isinstance(state.mu["w1"], ExpandedMoment) and state.mu["b1"].dtype == jnp.float32
  ref_loss, our_loss = float(ref[-30:].mean()), float(ours[-30:].mean())
  print(f"\nloss (mean of last 30 of 300 steps): coat_adamw {our_loss:.4f}, optax.adamw {ref_loss:.4f}")
  assert our_loss < 0.85 * float(ref[0])  # it learned
  assert abs(our_loss - ref_loss) < 0.01 * ref_loss, (our_loss, ref_loss)


def _assert_close_up_to_code_flips(a, b, lr=1e-3):
  """Same math compiled twice: float32 rounding, and rarely an FP8 code of m rounded the other way
  (moves that element by a few % of lr per step)."""
  a, b = np.asarray(a), np.asarray(b)
  close = np.isclose(a, b, rtol=1e-5, atol=1e-6)
  assert close.mean() > 0.998, close.mean()
  np.testing.assert_allclose(a, b, rtol=0, atol=0.2 * lr)


def test_composes_with_optax_wrappers(rng):
  params = _params(rng, SHAPES)
  grads = [_grads(rng, params) for _ in range(4)]
  kw = dict(min_quantized_size=1000)
  opts = {
      "chain": optax.chain(optax.clip_by_global_norm(1.0), coat_adamw(1e-3, **kw)),
      "inject": optax.inject_hyperparams(coat_adamw, static_args=("min_quantized_size",))(
          learning_rate=1e-3, **kw),
      "multisteps": optax.MultiSteps(coat_adamw(1e-3, **kw), every_k_schedule=2),
      "masked": optax.masked(coat_adamw(1e-3, **kw), {"w": True, "u": False, "bias": True}),
  }
  results = {name: _run(opt, params, grads)[0] for name, opt in opts.items()}
  plain, _ = _run(coat_adamw(1e-3, **kw), params, grads)
  _assert_close_up_to_code_flips(results["inject"]["w"], plain["w"])
  # defaults need no static_args; an int knob set without them is refused with a clear message
  assert optax.inject_hyperparams(coat_adamw)(learning_rate=1e-3).init(params).inner_state.count == 0
  with pytest.raises(ValueError, match="static_args"):
    opt = optax.inject_hyperparams(coat_adamw)(learning_rate=1e-3, group_size=64)
    jax.jit(opt.update)(grads[0], opt.init(params), params)
  assert not np.allclose(results["chain"]["w"], params["w"])
  assert not np.allclose(results["multisteps"]["w"], params["w"])
  # optax.masked passes masked-out updates (here raw gradients) through unchanged
  np.testing.assert_allclose(results["masked"]["u"], params["u"] + sum(g["u"] for g in grads),
                             rtol=1e-6, atol=1e-6)
  _assert_close_up_to_code_flips(results["masked"]["w"], plain["w"])
  for res in results.values():
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(res))


def test_apply_if_finite_keeps_fp8_state_bit_identical(rng):
  params = _params(rng, SHAPES)
  opt = optax.apply_if_finite(coat_adamw(1e-3, min_quantized_size=1000), max_consecutive_errors=3)
  state = opt.init(params)
  step = jax.jit(opt.update)
  _, state = step(_grads(rng, params), state, params)
  bad = _grads(rng, params)
  bad["w"] = bad["w"].at[3, 5].set(jnp.nan)
  updates, new_state = step(bad, state, params)
  assert int(new_state.notfinite_count) == 1
  for a, b in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(new_state.inner_state)):
    assert a.dtype == b.dtype
    a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))


def test_sharded_step_matches_unsharded(rng):
  auto = jax.sharding.AxisType.Auto  # as coat_jax.sharding's meshes
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(auto, auto))
  shapes = {"w": (64, 512), "u": (32, 256), "bias": (8,)}
  specs = {"w": P("data", "model"), "u": P(None, "model"), "bias": P("model")}
  shardings = {n: NamedSharding(mesh, s) for n, s in specs.items()}
  params = _params(rng, shapes)
  opt = coat_adamw(1e-3, min_quantized_size=1000)
  state = opt.init(params)
  g0, g1 = _grads(rng, params), _grads(rng, params)
  _, state = jax.jit(opt.update)(g0, state, params)  # non-zero moments
  st_sh = state_shardings(shardings, state)
  assert st_sh.mu["w"].amax.spec == P("data", "model")  # 4 groups over 4 devices
  assert st_sh.mu["u"].amax.spec == P(None, None)  # 2 groups: not divisible by 4
  assert st_sh.nu["bias"].spec == P("model") and st_sh.count.spec == P()
  ref_updates, ref_state = jax.jit(opt.update)(g1, state, params)
  sh_params = jax.device_put(params, shardings)
  sh_state = jax.device_put(state, st_sh)
  sh_grads = jax.device_put(g1, shardings)
  step = jax.jit(opt.update, out_shardings=(shardings, st_sh))
  updates, new_state = step(sh_grads, sh_state, sh_params)
  assert new_state.mu["w"].data.sharding.is_equivalent_to(shardings["w"], 2)
  for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(ref_updates)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-12)
  for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(ref_state)):
    assert a.dtype == b.dtype
    is_f32 = a.dtype == jnp.float32
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if is_f32 or a.size == 1:  # float32 moments, amax, count: float32 rounding
      np.testing.assert_allclose(a, b, rtol=1e-6)
    else:  # FP8 codes and k codes: equal up to a rare rounding-boundary flip by one code
      assert np.mean(a == b) > 0.99
      np.testing.assert_allclose(a, b, rtol=0.13, atol=1)


def test_orbax_round_trip_is_bit_exact(rng, tmp_path):
  import orbax.checkpoint as ocp
  params = _params(rng, SHAPES)
  opt = coat_adamw(1e-3, min_quantized_size=1000, v_format="e5m2")
  state = opt.init(params)
  _, state = jax.jit(opt.update)(_grads(rng, params), state, params)
  path = tmp_path / "opt_state"
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(path, state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(path, jax.eval_shape(lambda: state))
  assert isinstance(restored, CoatAdamWState) and isinstance(restored.mu["w"], ExpandedMoment)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  assert restored.nu["w"].data.dtype == jnp.float8_e5m2


def test_state_bytes_per_param():
  shape = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
  state = jax.eval_shape(coat_adamw(1e-3).init, {"w": shape})
  per_param = optimizer_state_bytes(state) / 4096**2
  print(f"\nstate bytes / param, 4096x4096 float32: {per_param:.4f}")
  assert per_param <= 2.10
  assert per_param == pytest.approx(2 * (1 + 5 / 128), abs=1e-6)
  adam = jax.eval_shape(optax.adamw(1e-3).init, {"w": shape})
  assert optimizer_state_bytes(adam) / 4096**2 == pytest.approx(8.0, abs=1e-6)
  small = jax.eval_shape(coat_adamw(1e-3).init, {"b": jax.ShapeDtypeStruct((4095,), jnp.float32)})
  assert small.mu["b"].dtype == jnp.float32  # under min_quantized_size


def test_bad_arguments():
  with pytest.raises(ValueError, match="format"):
    coat_adamw(1e-3, m_format="e2m5")
  with pytest.raises(ValueError, match="format"):
    coat_adamw(1e-3, v_format="fp4")
  with pytest.raises(ValueError, match="group_size"):
    coat_adamw(1e-3, group_size=0)
  with pytest.raises(ValueError, match="expand_min"):
    coat_adamw(1e-3, expand_min=0)
  with pytest.raises(ValueError, match=r"\['steps'\].*int32"):
    coat_adamw(1e-3).init({"w": jnp.ones((4, 4)), "steps": jnp.ones((3,), jnp.int32)})
  opt = coat_adamw(1e-3)
  params = {"w": jnp.ones((4, 4))}
  with pytest.raises(ValueError, match="params"):
    opt.update(params, opt.init(params))


@pytest.mark.parametrize("m_format,v_format,expand", [("int8", "e5m2", True),
                                                      ("e4m3", "int8", False)])
def test_other_formats_and_bf16_params(rng, m_format, v_format, expand):
  params = _params(rng, {"w": (32, 200), "b": (16,)})
  params["w"] = params["w"].astype(jnp.bfloat16)
  opt = coat_adamw(1e-2, m_format=m_format, v_format=v_format, expand=expand,
                   min_quantized_size=100)
  new, state = _run(opt, params, [_grads(rng, params) for _ in range(3)])
  assert state.mu["w"].data.dtype == ex.get_format(m_format).dtype
  assert state.nu["w"].data.dtype == ex.get_format(v_format).dtype
  assert new["w"].dtype == jnp.bfloat16 and state.mu["b"].dtype == jnp.float32
  if not expand:
    np.testing.assert_array_equal(np.asarray(state.mu["w"].k_code), 16)
  for x in jax.tree.leaves(new):
    assert np.all(np.isfinite(np.asarray(x, np.float32)))
  assert not np.allclose(np.asarray(new["w"], np.float32), np.asarray(params["w"], np.float32))


@pytest.mark.parametrize("fmt,expand", [("e4m3", True), ("e5m2", False), ("int8", True)])
def test_init_state_equals_quantized_zeros(fmt, expand):
  """The broadcast initial moments are exactly quantize_expanded(zeros), tail group included."""
  shape = (3, 300)
  want = ex.quantize_expanded(jnp.zeros(shape, jnp.float32), fmt, 128, 16, expand)
  cfg = optim.CoatAdamWConfig.make(group_size=128, expand_min=16, expand=expand)
  got = optim_state.zero_moment(cfg, jax.ShapeDtypeStruct(shape, jnp.float32), fmt, -1)
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    assert w.shape == g.shape and w.dtype == g.dtype
    np.testing.assert_array_equal(np.asarray(w).astype(np.float32), np.asarray(g).astype(np.float32))


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_one_huge_finite_gradient_does_not_poison_the_run(rng, backend):
  """One gradient element of 1e30 (its square overflows float32) at step 2 of 6: every later
  param, moment and amax stays finite (before the clamp, the hit group's v amax went inf and the
  params NaN for good), the hit element moves by about lr per step (Adam's scale-free step), and
  elements outside the hit group (row 0, columns 0..127) follow optax.adamw to FP8 moment
  rounding (relative L2 of the param change < 0.05). Both backends (the fused kernel in
  interpret mode on CPU)."""
  from coat_jax import kernels
  lr = 1e-2
  params = {"w": jnp.asarray(rng.standard_normal((4, 256)).astype(np.float32) * 0.1)}
  grads = [{"w": jnp.asarray(rng.standard_normal((4, 256)).astype(np.float32) * 1e-2)}
           for _ in range(6)]
  grads[1]["w"] = grads[1]["w"].at[0, 5].set(1e30)
  coat, ref = coat_adamw(lr, min_quantized_size=0), optax.adamw(lr, weight_decay=1e-4)
  with kernels.backend(backend):
    step = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(
        *coat.update(g, s, p)))
    p, s = params, coat.init(params)
    pr, sr = params, ref.init(params)
    for i, g in enumerate(grads):
      new_p, s = step(g, s, p)
      for mom, fmt in ((s.mu["w"], "e4m3"), (s.nu["w"], "e4m3")):
        assert np.isfinite(np.asarray(mom.amax)).all(), f"step {i}: amax not finite"
        assert np.isfinite(np.asarray(ex.dequantize_expanded(mom, fmt, 128, 16))).all()
      assert np.isfinite(np.asarray(new_p["w"])).all(), f"step {i}: params not finite"
      assert np.abs(np.asarray(new_p["w"]) - np.asarray(p["w"])).max() < 10 * lr
      p = new_p
      u, sr = ref.update(g, sr, pr)
      pr = optax.apply_updates(pr, u)
  outside = np.ones((4, 256), bool)
  outside[0, :128] = False
  d, dr = (np.asarray(x["w"] - params["w"], np.float64)[outside] for x in (p, pr))
  assert np.linalg.norm(d - dr) / np.linalg.norm(dr) < 0.05
  assert 0.1 * lr < abs(float(p["w"][0, 5] - params["w"][0, 5])) < 10 * lr
