"""Dynamic range expansion: compact form == COAT's form, edge cases, error on real Adam moments."""
import functools
import os
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from coat_jax import expansion as ex
from tests.conftest import RUNTIME_BOUND, base_seed

FORMATS = ("e4m3", "e5m2", "int8")

# ------------------------------------------------------------------------------------------------
# A tiny char-level MLP language model on text from the Python standard library (shared with
# tests/test_optim.py).

CONTEXT, EMBED, HIDDEN, VOCAB = 8, 32, 128, 128


def stdlib_text(rng, n_files: int = 6, max_chars: int = 200_000) -> np.ndarray:
  """Bytes (< 128) of a few randomly chosen stdlib .py files, as int32."""
  root = sysconfig.get_paths()["stdlib"]
  names = sorted(f for f in os.listdir(root) if f.endswith(".py"))
  chosen = rng.choice(names, size=min(n_files, len(names)), replace=False)
  data = b"".join(open(os.path.join(root, f), "rb").read() for f in chosen)[:max_chars]
  arr = np.frombuffer(data, np.uint8).astype(np.int32)
  return np.minimum(arr, VOCAB - 1)


def char_batches(rng, text: np.ndarray, steps: int, batch: int):
  """(steps, batch, CONTEXT) inputs and (steps, batch) next-char targets at random offsets."""
  starts = rng.integers(0, len(text) - CONTEXT - 1, size=(steps, batch))
  idx = starts[..., None] + np.arange(CONTEXT + 1)
  windows = text[idx]
  return jnp.asarray(windows[..., :CONTEXT]), jnp.asarray(windows[..., CONTEXT])


def init_char_lm(key):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
      "embed": jax.random.normal(k1, (VOCAB, EMBED)) * 0.5,
      "w1": jax.random.normal(k2, (CONTEXT * EMBED, HIDDEN)) / np.sqrt(CONTEXT * EMBED),
      "b1": jnp.zeros((HIDDEN,)),
      "w2": jax.random.normal(k3, (HIDDEN, VOCAB)) / np.sqrt(HIDDEN),
      "b2": jnp.zeros((VOCAB,)),
  }


def char_lm_loss(params, x, y):
  h = params["embed"][x].reshape(x.shape[0], -1)
  h = jnp.tanh(h @ params["w1"] + params["b1"])
  logits = h @ params["w2"] + params["b2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train(opt, params, xs, ys):
  """Runs len(xs) steps in one jitted scan; returns (params, opt_state, losses)."""

  def step(carry, batch):
    params, state = carry
    loss, grads = jax.value_and_grad(char_lm_loss)(params, *batch)
    updates, state = opt.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), loss

  @functools.partial(jax.jit, compiler_options=RUNTIME_BOUND)   # hundreds of steps in one call
  def run(params, xs, ys):
    (params, state), losses = jax.lax.scan(step, (params, opt.init(params)), (xs, ys))
    return params, state, losses

  return run(params, xs, ys)


@pytest.fixture(scope="module")
def adam_moments():
  """m and v of the three weight matrices after 40 steps of optax.adamw on stdlib text."""
  seed = base_seed() + 1   # fixed: an OS-entropy seed failed once (w1 v 2x; 7-18x at seeds 0-7)
  print(f"adam_moments seed {seed}")
  rng = np.random.default_rng(seed)
  text = stdlib_text(rng)
  xs, ys = char_batches(rng, text, steps=40, batch=128)
  params = init_char_lm(jax.random.key(int(rng.integers(2**31))))
  _, state, losses = train(optax.adamw(3e-3), params, xs, ys)
  assert float(losses[-1]) < float(losses[0])
  adam = state[0]
  names = ("embed", "w1", "w2")
  return [adam.mu[n] for n in names], [adam.nu[n] for n in names]


def _rel_mse(x, fmt, expand):
  """|x - deq(quant(x))|^2 / |x|^2 for one tensor, in float64."""
  out = ex.dequantize_expanded(ex.quantize_expanded(x, fmt, 128, 16, expand), fmt, 128, 16)
  x64, o64 = np.asarray(x, np.float64), np.asarray(out, np.float64)
  assert np.all(np.isfinite(o64))
  return np.sum((o64 - x64) ** 2) / np.sum(x64 ** 2)


def _geomean(values):
  return float(np.exp(np.mean(np.log(values))))


# ------------------------------------------------------------------------------------------------


def test_expansion_cuts_error_of_real_adam_moments(adam_moments):
  """Relative MSE per tensor (geometric mean over embed, w1, w2), plain vs expanded groups of 128."""
  mus, nus = adam_moments
  per_tensor, table = {}, {}
  for fmt in FORMATS:
    for name, xs in (("m", mus), ("v", nus)):
      per_tensor[fmt, name] = [(_rel_mse(x, fmt, False), _rel_mse(x, fmt, True)) for x in xs]
      table[fmt, name] = tuple(_geomean(col) for col in zip(*per_tensor[fmt, name]))
  print("\nrelative MSE of Adam moments (char LM, 40 steps of adamw), groups of 128 along the last axis")
  print("E4M3 per tensor (plain / expanded / factor):")
  for name in ("m", "v"):
    for tname, (plain, expd) in zip(("embed 128x32", "w1 256x128", "w2 128x128"),
                                    per_tensor["e4m3", name]):
      print(f"  {name} {tname:13} {plain:10.3e} {expd:10.3e} {plain / expd:7.2f}")
  print("geometric mean over the three tensors:")
  print(f"{'format':6} {'moment':6} {'plain':>10} {'expanded':>10} {'factor':>7}")
  for (fmt, name), (plain, expd) in table.items():
    print(f"{fmt:6} {name:6} {plain:10.3e} {expd:10.3e} {plain / expd:7.2f}")
  m_plain, m_exp = table["e4m3", "m"]
  v_plain, v_exp = table["e4m3", "v"]
  # Measured over seeds: m ~3x, v ~5x (geometric means; w1's v ~10x, w2's v ~1.2x because its
  # groups run along the vocabulary axis, where v spans ~1e5). Asserted with margin.
  assert m_plain / m_exp > 2.0, (m_plain, m_exp)
  assert v_plain / v_exp > 2.5, (v_plain, v_exp)
  w1_v_plain, w1_v_exp = per_tensor["e4m3", "v"][1]
  assert w1_v_plain / w1_v_exp > 5.0, (w1_v_plain, w1_v_exp)
  # After expansion E4M3 is better than E5M2 for m, and close to it for v (COAT's observation).
  assert table["e4m3", "m"][1] < table["e5m2", "m"][1]
  assert table["e5m2", "v"][1] < 3 * table["e4m3", "v"][1]
  for fmt in FORMATS:  # expansion never makes the error worse overall
    assert table[fmt, "m"][1] < table[fmt, "m"][0] and table[fmt, "v"][1] < table[fmt, "v"][0]


FMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0}
# R, the range an expanded group may span: the spec's fmax^2 / 2 for the FP8 formats (448^2/2 for
# E4M3); INT8 uses 127/4, the project's documented choice (coat_jax/expansion.py).
RANGE = {"e4m3": 448.0**2 / 2, "e5m2": 57344.0**2 / 2, "int8": 127.0 / 4}


def np_spec_k(x64, fmt, group_size=128, expand_min=16):
  """The spec's k per group, in numpy float64: mx = max|x| + 1e-30, mn = min non-zero |x| + 1e-30,
  k = floor(log2(R) / log2(mx / mn) * expand_min) / expand_min; k = 1 where mx == mn (guard)."""
  a = np.abs(x64)   # short final group: zero padding (zeros count for neither max nor min)
  a = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, -a.shape[-1] % group_size)])
  a = a.reshape(*a.shape[:-1], -1, group_size)
  mx = a.max(-1) + 1e-30
  mn = np.where(a > 0, a, np.inf).min(-1)
  mn = np.where(np.isinf(mn), mx, mn + 1e-30)
  with np.errstate(divide="ignore"):
    lr = np.log2(mx / mn)
    k = np.floor(np.log2(RANGE[fmt]) / lr * expand_min) / expand_min
  return np.where(lr > 0, np.clip(k, 1 / expand_min, 255 / expand_min), 1.0), mx


@pytest.mark.parametrize("fmt", FORMATS)
def test_k_and_codes_match_float64_spec(rng, fmt):
  """k from the spec's formula in float64 (written here, not the implementation's helpers), and
  codes q = sign(x) fmax (|x| / mx)^k rounded to the format: k equal except where float32's
  log2(mx / mn) lands on the other side of a floor boundary (k then one step, 1/16, apart); in
  groups with equal k, codes at most one step apart (float32 vs float64 powers on a rounding
  tie) and equal in >= 99.5% of elements."""
  import ml_dtypes
  scale = np.exp(rng.uniform(-8, 8, size=(64, 1)))
  spread = np.exp(rng.uniform(-6, 0, size=(64, 256)) * rng.uniform(0, 3, size=(64, 1)))
  x64 = rng.choice([-1.0, 1.0], size=(64, 256)) * spread * scale
  x64[rng.random(x64.shape) < 0.03] = 0.0
  x32 = x64.astype(np.float32)
  m = ex.quantize_expanded(jnp.asarray(x32), fmt, 128, 16)
  k64, mx64 = np_spec_k(x32.astype(np.float64), fmt)
  k = np.asarray(m.k_code, np.float64) / 16
  assert np.all(np.abs(k - k64) <= 1 / 16 + 1e-12) and (k == k64).mean() >= 0.95, (k, k64)
  np.testing.assert_allclose(np.asarray(m.amax, np.float64), mx64, rtol=2.0**-23)
  ratio = np.abs(x32.astype(np.float64)).reshape(64, 2, 128) / mx64[..., None]
  y = np.sign(x32) * FMAX[fmt] * (ratio ** k64[..., None]).reshape(64, 256)
  y = np.clip(y, -FMAX[fmt], FMAX[fmt])
  dtype = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "int8": np.int8}[fmt]
  want = (np.round(y) if fmt == "int8" else y).astype(dtype)
  same_k = np.repeat(k == k64, 128, axis=-1)
  def ordinal(q):
    q = np.asarray(q)
    if fmt == "int8":
      return q.astype(np.int32)
    b = q.view(np.uint8).astype(np.int32)
    return np.where(b & 0x80, -(b & 0x7F), b & 0x7F)
  d = np.abs(ordinal(np.asarray(m.data)) - ordinal(want))[same_k]
  assert d.max() <= 1 and (d == 0).mean() >= 0.995, (d.max(), (d == 0).mean())


@pytest.mark.parametrize("fmt", FORMATS)
def test_compact_form_equals_spec_form(rng, fmt):
  scale = np.exp(rng.uniform(-6, 6, size=(48, 1)))
  x64 = rng.standard_normal((48, 300)) * scale
  x64[rng.random(x64.shape) < 0.05] = 0.0
  x = jnp.asarray(x64, jnp.float32)
  compact = ex.quantize_expanded(x, fmt, 128, 16)
  spec = ex.quantize_expanded_spec(x, fmt, 128, 16)
  k64, _ = np_spec_k(np.asarray(x, np.float64), fmt)   # spec formula, float64, in this file
  k = np.asarray(compact.k_code, np.float64) / 16
  assert np.all(np.abs(k - k64) <= 1 / 16 + 1e-12) and (k == k64).mean() >= 0.95
  np.testing.assert_array_equal(compact.k_code.astype(np.float32) / 16, spec.k)
  qc = np.asarray(compact.data.astype(jnp.float32))
  qs = np.asarray(spec.data.astype(jnp.float32))
  same = qc == qs
  # Codes differ only where float32 rounding sits on an FP8 rounding boundary.
  assert same.mean() > 0.999, same.mean()
  dc = np.asarray(ex.dequantize_expanded(compact, fmt, 128, 16), np.float64)
  ds = np.asarray(ex.dequantize_expanded_spec(spec, 128), np.float64)
  rel = np.abs(dc - ds)[same] / np.maximum(np.abs(ds)[same], 1e-37)
  assert rel.max() < 1e-5, rel.max()
  err_c = np.sum((dc - x64) ** 2)
  err_s = np.sum((ds - x64) ** 2)
  assert abs(err_c - err_s) <= 1e-3 * err_s, (err_c, err_s)


def test_bytes_per_element_of_compact_form():
  b = ex.expanded_nbytes((4096, 4096), "e4m3", 128)
  assert 2 * b / 4096**2 == pytest.approx(2 * (1 + 5 / 128))
  m = ex.quantize_expanded(jnp.ones((4, 300)), "e4m3", 128)
  assert m.data.dtype == jnp.float8_e4m3fn and m.amax.dtype == jnp.float32
  assert m.k_code.dtype == jnp.uint8 and m.amax.shape == (4, 3) == m.k_code.shape


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_constant_tiny_and_short_groups(rng, fmt):
  x = np.zeros((4, 130), np.float32)  # groups of 128 + a short group of 2
  x[1] = -3.25  # constant row
  x[2] = rng.standard_normal(130).astype(np.float32) * 1e-40  # subnormals
  x[3] = rng.standard_normal(130).astype(np.float32) * np.exp(rng.uniform(-5, 5))
  x[3, 7] = 0.0
  m = jax.jit(lambda x: ex.quantize_expanded(x, fmt, 128, 16))(jnp.asarray(x))
  out = np.asarray(ex.dequantize_expanded(m, fmt, 128, 16))
  assert np.all(np.isfinite(out)) and np.all(np.isfinite(m.amax))
  np.testing.assert_array_equal(out[0], 0.0)
  np.testing.assert_array_equal(np.asarray(m.k_code[:2]), 16)  # all-zero and constant: k = 1
  np.testing.assert_allclose(out[1], -3.25, rtol=1e-6)
  assert np.all(np.abs(out[2]) <= 1e-30)
  assert out[3, 7] == 0.0
  rel = np.linalg.norm(out[3] - x[3]) / np.linalg.norm(x[3])
  assert 0 < rel < 0.05, rel


@pytest.mark.parametrize("shape", [(), (5,), (3, 2, 200)])
def test_shapes_and_plain_scaling(rng, shape):
  x = jnp.asarray(rng.standard_normal(shape).astype(np.float32) + 0.1)
  for expand in (True, False):
    m = ex.quantize_expanded(x, "e4m3", 128, 16, expand)
    assert m.data.shape == x.shape and m.amax.shape == ex.metadata_shape(x.shape, 128)
    out = ex.dequantize_expanded(m, "e4m3", 128, 16)
    assert out.shape == x.shape
    # expansion moves a group's small values into subnormals: absolute error ~1% of the group max
    np.testing.assert_allclose(out, x, rtol=0.07, atol=0.01 * float(jnp.max(jnp.abs(x))))
  if len(shape) > 1:  # expand=False is the per-group quantizer of coat_jax.quantize (float32 scales)
    from coat_jax import quantize as qz
    plain = ex.quantize_expanded(x, "e4m3", 128, 16, expand=False)
    ref = qz.quantize_per_group(x, 128, "e4m3", floor=1e-30, scale_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(plain.data, np.float32), np.asarray(ref.data, np.float32))
    np.testing.assert_allclose(ex.dequantize_expanded(plain, "e4m3", 128, 16), ref.dequantize(),
                               rtol=1e-6)


def test_non_finite_is_not_hidden(rng):
  x = jnp.asarray(rng.standard_normal((2, 256)).astype(np.float32)).at[0, 3].set(jnp.nan)
  m = ex.quantize_expanded(x, "e4m3", 128, 16)
  out = np.asarray(ex.dequantize_expanded(m, "e4m3", 128, 16))
  assert np.isnan(m.amax[0, 0]) and np.all(np.isnan(out[0, :128]))
  assert np.all(np.isfinite(out[0, 128:])) and np.all(np.isfinite(out[1]))


def test_bad_arguments():
  x = jnp.ones((4, 8))
  with pytest.raises(ValueError, match="format"):
    ex.quantize_expanded(x, "e3m4")
  with pytest.raises(ValueError, match="group_size"):
    ex.quantize_expanded(x, "e4m3", 0)
  with pytest.raises(ValueError, match="expand_min"):
    ex.quantize_expanded(x, "e4m3", 128, 0)
  with pytest.raises(ValueError, match="floating"):
    ex.quantize_expanded(jnp.ones((4, 8), jnp.int32))
