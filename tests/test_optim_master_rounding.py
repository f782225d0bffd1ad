"""coat_adamw_apply(master_rounding="stochastic"): bfloat16 master weights keep small updates."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax.optim import ExpandedMoment, coat_adamw, coat_adamw_apply

SEED = 4242
LR = 1e-3  # below half a bfloat16 ulp of 1.0 (2^-8 = 0.0039): lost by nearest rounding


def _setup(dtype):
  rng = np.random.default_rng(SEED)
  print(f"seed {SEED}")
  params = {"w": jnp.asarray(1.0 + 0.01 * rng.random((64, 128)), dtype)}
  grads = {"w": jnp.asarray(rng.normal(size=(64, 128)), jnp.float32)}
  state = coat_adamw(LR, weight_decay=0.0).init(params)
  return params, grads, state


def _step(rounding, params, grads, state):
  apply = coat_adamw_apply(LR, weight_decay=0.0, master_rounding=rounding)
  return jax.jit(apply)(grads, state, params)


def test_stochastic_rounding_keeps_small_updates_in_expectation():
  params, grads, state = _setup(jnp.bfloat16)
  near, _ = _step("nearest", params, grads, state)
  sr, sr_state = _step("stochastic", params, grads, state)
  p0 = np.asarray(params["w"], np.float64)
  assert near["w"].dtype == jnp.bfloat16 and sr["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(near["w"], np.float64), p0)  # every update lost
  # The float32 step of the same params: Adam's first step moves each weight by lr * sign(g).
  ref32, _ = _step("nearest", {"w": params["w"].astype(jnp.float32)}, grads, state)
  want = np.asarray(ref32["w"], np.float64) - p0
  got = np.asarray(sr["w"], np.float64) - p0
  assert np.all(np.isfinite(got))
  moved = np.mean(got != 0)
  assert 0.05 < moved < 0.5, moved  # about lr / ulp of the weights
  # Unbiased: the mean signed change equals the float32 one within 5 standard errors.
  se = np.std(got - want) / np.sqrt(got.size)
  assert abs(np.mean(got - want)) < 5 * se + 1e-7, (np.mean(got), np.mean(want), se)
  assert abs(np.mean(got * np.sign(want)) / np.mean(np.abs(want)) - 1.0) < 0.1
  np.testing.assert_array_equal(np.asarray(sr_state.mu["w"].data, np.float32),
                                np.asarray(_step("nearest", params, grads, state)[1].mu["w"].data,
                                           np.float32))  # the moments do not depend on rounding


def test_float32_params_ignore_stochastic_rounding():
  params, grads, state = _setup(jnp.float32)
  near, _ = _step("nearest", params, grads, state)
  sr, _ = _step("stochastic", params, grads, state)
  np.testing.assert_array_equal(np.asarray(near["w"]), np.asarray(sr["w"]))


def test_bad_rounding_name():
  with pytest.raises(ValueError, match="master_rounding"):
    coat_adamw_apply(LR, master_rounding="up")


# ---------------------------------------------------------------------------------------------
# master_rounding="kahan": a bfloat16 compensation buffer per bfloat16 param.

KAHAN_LR = 1e-4  # ~1/40 of half a bfloat16 ulp at 1.0: every single update is lost to nearest


def _kahan_setup():
  rng = np.random.default_rng(SEED + 1)
  print(f"seed {SEED + 1}")
  params = {"w": jnp.asarray(1.0 + 0.01 * rng.random((32, 128)), jnp.bfloat16),
            "b": jnp.asarray(rng.normal(size=(128,)), jnp.float32)}  # float32: no compensation
  grads = {"w": jnp.asarray(rng.normal(size=(32, 128)), jnp.float32),
           "b": jnp.asarray(rng.normal(size=(128,)), jnp.float32)}
  return params, grads


def _run(rounding, params, grads, steps, **kw):
  state = coat_adamw(KAHAN_LR, weight_decay=0.0, master_rounding=rounding, **kw).init(params)
  apply = coat_adamw_apply(KAHAN_LR, weight_decay=0.0, master_rounding=rounding, **kw)

  def body(carry, _):
    p, s = carry
    return apply(grads, s, p), None

  (p, s), _ = jax.jit(lambda p, s: jax.lax.scan(body, (p, s), None, length=steps))(params, state)
  return p, s


def test_kahan_keeps_a_long_run_of_tiny_updates():
  params, grads = _kahan_setup()
  steps = 300
  # Constant gradients: m_hat = g, v_hat = g^2 exactly, so each step moves p by lr g/(|g| + eps);
  # the float64 sum of those is the reference.
  g = np.asarray(grads["w"], np.float64)
  want = np.asarray(params["w"], np.float64) - steps * KAHAN_LR * g / (np.abs(g) + 1e-8)
  near, _ = _run("nearest", params, grads, steps, quantize=False)
  kahan, state = _run("kahan", params, grads, steps, quantize=False)
  assert kahan["w"].dtype == jnp.bfloat16 and state.comp["w"].dtype == jnp.bfloat16
  assert state.comp["b"] is None and kahan["b"].dtype == jnp.float32
  moved = steps * KAHAN_LR  # 0.03, about 4 bfloat16 ulps at 1.0
  err_near = np.max(np.abs(np.asarray(near["w"], np.float64) - want))
  master = np.asarray(kahan["w"], np.float64) + np.asarray(state.comp["w"], np.float64)
  err_kahan = np.max(np.abs(master - want))
  err_stored = np.max(np.abs(np.asarray(kahan["w"], np.float64) - want))
  assert err_near > 0.9 * moved, err_near  # nearest rounding lost every update
  assert np.all(np.isfinite(master))
  # The master p + c holds 16 significant bits: each step's sum is off by at most half a bf16
  # ulp of c (<= 2^-17 |p|), so the error grows at most by that per step; bound it and check it is
  # a few % of the total move (nearest: 100 %).
  assert err_kahan <= steps * 2.0 ** -17 * 1.02, err_kahan
  assert err_kahan < 0.05 * moved, (err_kahan, moved)
  assert err_stored <= 2.0 ** -8 * 1.01, err_stored  # the stored bf16 p: within half an ulp
  # The float32 param follows the same steps as without compensation.
  np.testing.assert_allclose(np.asarray(kahan["b"]), np.asarray(near["b"]), rtol=0, atol=0)


def test_kahan_one_fused_step_matches_float32_and_adds_two_bytes_per_param():
  from coat_jax.optim import optimizer_state_bytes
  params, grads = _kahan_setup()
  kw = dict(min_quantized_size=1024, group_size=32)  # "w" gets FP8 moments
  kahan, ks = _run("kahan", params, grads, 1, **kw)
  f32 = {"w": params["w"].astype(jnp.float32), "b": params["b"]}
  ref, _ = _run("nearest", f32, grads, 1, **kw)
  master = np.asarray(kahan["w"], np.float64) + np.asarray(ks.comp["w"], np.float64)
  np.testing.assert_allclose(master, np.asarray(ref["w"], np.float64), rtol=2.0 ** -15, atol=0)
  near_state = coat_adamw(KAHAN_LR, **kw).init(params)
  extra = optimizer_state_bytes(ks) - optimizer_state_bytes(near_state)
  assert extra == 2 * params["w"].size, extra


def test_kahan_state_checkpoint_round_trip(tmp_path):
  from coat_jax.training.checkpoint import Checkpointer
  params, grads = _kahan_setup()
  _, state = _run("kahan", params, grads, 3, quantize=False)
  assert np.any(np.asarray(state.comp["w"], np.float32) != 0)
  ckpt = Checkpointer(tmp_path, every=1, keep=1, async_save=False)
  ckpt.save(3, state, {"note": "kahan"}, force=True)
  ckpt.wait()
  restored, meta, step = ckpt.restore(state)
  ckpt.close()
  assert step == 3 and meta["note"] == "kahan"
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_kahan_needs_the_apply_path_and_its_state():
  params, grads = _kahan_setup()
  tx = coat_adamw(KAHAN_LR, master_rounding="kahan")
  with pytest.raises(ValueError, match="coat_adamw_apply"):
    tx.update(grads, tx.init(params), params)
  apply = coat_adamw_apply(KAHAN_LR, master_rounding="kahan")
  with pytest.raises(ValueError, match="compensation"):
    apply(grads, coat_adamw(KAHAN_LR).init(params), params)


def test_kahan_state_shardings_follow_the_params():
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from coat_jax.optim import state_shardings
  params, _ = _kahan_setup()
  mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
  shard = {"w": NamedSharding(mesh, P("fsdp", None)), "b": NamedSharding(mesh, P())}
  state = coat_adamw(KAHAN_LR, master_rounding="kahan").init(params)
  sh = state_shardings(shard, state)
  assert sh.comp["w"] == shard["w"] and sh.comp["b"] is None
  placed = jax.device_put(state, sh)
  assert placed.comp["w"].sharding == shard["w"]


@pytest.mark.gpu
def test_fused_kernel_takes_bf16_grads_and_kahan_params():
  """The fused kernel's step (jax-triton) on bfloat16 gradients and on Kahan's float32 copy of
  bfloat16 params gives the reference step's result."""
  from coat_jax import kernels
  params, grads = _kahan_setup()
  stack = lambda t: dict(t, w=t["w"].reshape(2, 16, 128))  # a stacked leaf: the per-layer map
  params, grads = stack(params), stack(grads)
  grads16 = jax.tree.map(lambda g: g.astype(jnp.bfloat16), grads)
  kw = dict(min_quantized_size=1024, group_size=32)
  out = {}
  for name in ("reference", "adam=pallas"):
    with kernels.backend(name):
      out[name] = _run("kahan", params, grads16, 1, **kw)
  (a, sa), (b, sb) = out["reference"], out["adam=pallas"]
  assert isinstance(sb.mu["w"], ExpandedMoment) and sb.comp["w"].dtype == jnp.bfloat16
  for x, y in zip(jax.tree.leaves((a, sa)), jax.tree.leaves((b, sb))):
    _assert_close_in_steps(np.asarray(x), np.asarray(y))


def _assert_close_in_steps(x: np.ndarray, y: np.ndarray, share: float = 0.005):
  """float32 leaves to 1e-5; FP8 and bfloat16 leaves (codes, rounded params) equal but for at
  most one representable step in at most `share` of the elements: the kernel's float32 order of
  operations differs from the reference's, so a value on a rounding boundary may go either way."""
  if x.dtype.itemsize > 2:
    np.testing.assert_allclose(x.astype(np.float32), y.astype(np.float32), rtol=1e-5, atol=1e-7)
    return
  bits = np.uint8 if x.dtype.itemsize == 1 else np.uint16
  steps = np.abs(x.view(bits).astype(np.int64) - y.view(bits).astype(np.int64))
  assert steps.max() <= 1, f"{x.dtype}: {steps.max()} representable steps apart"
  assert np.mean(steps != 0) <= share, f"{x.dtype}: {np.mean(steps != 0):.2%} of elements differ"


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_stacked_leaves_step_one_layer_at_a_time_with_the_same_result(rounding):
  """A (layers, ...) bfloat16 leaf runs the SR/Kahan step per layer (a loop): bit-identical to
  the same values as one 2-D leaf (the rounding bits follow the flat element index)."""
  rng = np.random.default_rng(SEED + 2)
  print(f"seed {SEED + 2}")
  w = jnp.asarray(1.0 + 0.01 * rng.random((4, 16, 64)), jnp.bfloat16)
  g = jnp.asarray(rng.normal(size=(4, 16, 64)), jnp.float32)
  kw = dict(min_quantized_size=256, group_size=32)
  stacked, s3 = _run(rounding, {"w": w}, {"w": g}, 2, **kw)
  flat, s2 = _run(rounding, {"w": w.reshape(64, 64)}, {"w": g.reshape(64, 64)}, 2, **kw)
  np.testing.assert_array_equal(np.asarray(stacked["w"], np.float32).reshape(64, 64),
                                np.asarray(flat["w"], np.float32))
  np.testing.assert_array_equal(np.asarray(s3.mu["w"].data, np.float32).reshape(64, 64),
                                np.asarray(s2.mu["w"].data, np.float32))
  if rounding == "kahan":
    np.testing.assert_array_equal(np.asarray(s3.comp["w"], np.float32).reshape(64, 64),
                                  np.asarray(s2.comp["w"], np.float32))


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_stacked_leaf_step_updates_the_stack_in_place(rounding):
  """The per-layer SR/Kahan loop writes each layer over its input: the compiled step (state and
  params donated) holds no second copy of the bfloat16 stack, its moments or compensation. A
  loop mapping layers to new stacks needed ~4x the stack's bytes of temporaries here."""
  layers, rows, cols = 32, 256, 512
  w = jnp.full((layers, rows, cols), 1.0, jnp.bfloat16)
  g = jnp.full((layers, rows, cols), 1e-3, jnp.bfloat16)
  kw = dict(master_rounding=rounding, min_quantized_size=256)
  state = coat_adamw(1e-3, **kw).init({"w": w})
  step = jax.jit(lambda p, s, g: coat_adamw_apply(1e-3, **kw)(g, s, p), donate_argnums=(0, 1))
  temp = step.lower({"w": w}, state, {"w": g}).compile().memory_analysis().temp_size_in_bytes
  stack = w.size * w.dtype.itemsize
  print(f"{rounding}: temporaries {temp / 2**20:.2f} MiB, the bfloat16 stack {stack / 2**20:.2f} MiB")
  assert temp < 2 * stack
