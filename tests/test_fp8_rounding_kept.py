"""FP8 rounding that a compiler could drop: quantize and dequantize inside one jit.

On GPU, XLA (xla_allow_excess_precision, on by default; pass simplify-fp-conversions) replaces
convert(convert(x, f8), f32) by x inside one program. On an H100 (2026-11-23) this made the
benchmarks' jitted round trips report an E4M3 relative MSE of ~1e-13 instead of ~1e-3.
Two defences, tested here:
- coat_jax.formats.saturating_cast (every jnp FP8 producer) passes the codes through an
  optimization barrier, which ends such convert chains;
- benchmarks/_moments.py materialises the codes between two jits and checks a sample against a
  float64 numpy quantizer (`check_moment_round_trip`), aborting in one line on a mismatch.
CPU XLA keeps the conversions, so the CPU tests check the structure (the barrier is in the
program) and the guard; the @pytest.mark.gpu tests check the numbers on the device.
"""
import re

import jax
import jax.numpy as jnp
import ml_dtypes

import numpy as np
import pytest

from coat_jax import expansion, formats, gemm, kernels, quantize

from benchmarks import _moments as common


def _fake_quantize_numpy(x, group_size, scale_dtype=formats.ACTIVATION_SCALE_DTYPE):
  """float64 reference of quantize.fake_quantize(x, "e4m3", group_size) for N % G == 0, with
  the scales stored as `scale_dtype` (per group: formats.ACTIVATION_SCALE_DTYPE; a per-tensor
  scale is float32)."""
  g = np.asarray(x, np.float64).reshape(*x.shape[:-1], -1, group_size)
  scale = np.maximum(np.abs(g).max(-1, keepdims=True) / 448.0, formats.ACTIVATION_SCALE_FLOOR)
  scale = scale.astype(np.float32).astype(scale_dtype).astype(np.float64)
  q = np.clip(g / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
  return (q * scale).reshape(x.shape)


def _same(a, ref):
  """Share of values equal to float32 precision (codes equal, scales in float32)."""
  a = np.asarray(a, np.float64)
  return float(np.mean(np.abs(a - ref) <= 1e-6 * np.abs(ref)))


def _rel_mse(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.sum((a - b) ** 2) / np.sum(b ** 2))


def test_fp8_codes_pass_a_barrier_in_the_program(rng):
  x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
  for fn in (lambda x: quantize.fake_quantize(x, "e4m3", 16),
             lambda x: expansion.dequantize_expanded(expansion.quantize_expanded(x, "e5m2", 32), "e5m2", 32)):
    text = jax.jit(fn).lower(x).as_text()
    assert "optimization_barrier" in text and ("f8E4M3FN" in text or "f8E5M2" in text), text[-800:]
  # per group, the bfloat16 scales' rounding passes one too (x is divided by the stored scale)
  text = jax.jit(lambda x: quantize.fake_quantize(x, "e4m3", 16)).lower(x).as_text()
  assert any("optimization_barrier" in ln and "bf16" in ln for ln in text.splitlines()), text[-800:]
  # INT8 is rounded by an explicit round (no float conversion chain): no barrier needed.
  text = jax.jit(lambda x: formats.saturating_cast(x, "int8")).lower(x).as_text()
  assert "optimization_barrier" not in text and "round_nearest_even" in text


def test_one_jit_round_trip_matches_numpy_on_this_backend(rng):
  x = (rng.standard_normal((8, 128)) * np.exp(rng.uniform(-5, 0, (8, 128)))).astype(np.float32)
  out = jax.jit(lambda x: quantize.fake_quantize(x, "e4m3", 16))(jnp.asarray(x))
  ref = _fake_quantize_numpy(x, 16)
  assert _same(out, ref) > 0.99    # the same codes (float32 vs float64 scales: ~1e-7 apart)
  assert 1e-5 < _rel_mse(out, x) < 5e-3   # rounding happened: E4M3's half-ulp is 2^-4


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "int8"])
def test_benchmark_round_trip_check_passes(fmt):
  found = common.check_moment_round_trip(fmt, 32, 16)
  for ours, ref in found.values():
    assert ours == pytest.approx(ref, rel=1e-3) and 1e-6 < ref < 1e-2


def test_benchmark_round_trip_check_catches_a_dropped_rounding(monkeypatch):
  # What the GPU did: the "round trip" returns x up to float32 noise.
  monkeypatch.setattr(common, "moment_round_trip",
                      lambda x, *a, **k: np.asarray(x, np.float64) * (1 + 1e-7))
  with pytest.raises(SystemExit, match="did not round to e4m3"):
    common.check_moment_round_trip("e4m3", 32, 16)


def test_moment_round_trip_axis(rng):
  x = (rng.standard_normal((64, 96)) * np.exp(rng.uniform(-4, 0, (64, 1)))).astype(np.float32)
  first = common.moment_round_trip(x, "e4m3", 32, 16, True, axis="first")
  assert np.array_equal(first, common.moment_round_trip(x.T.copy(), "e4m3", 32, 16, True, axis="last").T)
  with pytest.raises(ValueError, match="axis"):
    common.moment_round_trip(x, "e4m3", 32, 16, True, axis="middle")


# ---------------------------------------------------------------------------------------------
# GPU (run on the device machine with JAX_PLATFORMS=cuda): the numbers, where XLA could drop them.

@pytest.mark.gpu
def test_gpu_one_jit_round_trips_round(rng):
  """fake_quantize and the expanded moment round trip inside ONE jit equal the float64 numpy
  quantizer; before the barrier, XLA GPU returned x (relative MSE ~1e-13)."""
  x = (rng.standard_normal((16, 256)) * np.exp(rng.uniform(-5, 0, (16, 256)))).astype(np.float32)
  out = jax.jit(lambda x: quantize.fake_quantize(x, "e4m3", 16))(jnp.asarray(x))
  ref = _fake_quantize_numpy(x, 16)
  assert _same(out, ref) > 0.99, _rel_mse(out, x)
  for fmt in ("e4m3", "e5m2"):
    one_jit = jax.jit(lambda x: expansion.dequantize_expanded(
        expansion.quantize_expanded(x, fmt, 128, 16, False), fmt, 128, 16))(jnp.asarray(x))
    ref = common.numpy_moment_round_trip(x, np.ones((16, 2)), fmt, 128)
    assert _rel_mse(one_jit, x) == pytest.approx(_rel_mse(ref, x), rel=0.05), fmt
  for fmt in ("e4m3", "e5m2", "int8"):
    common.check_moment_round_trip(fmt, 128, 16)   # raises SystemExit on a mismatch


@pytest.mark.gpu
def test_gpu_reference_fp8_gemm_still_uses_cublas_fp8(rng):
  """With the barrier on the codes, XLA still lowers the reference FP8 dot to an FP8 GEMM: cuBLASLt's
  (a custom call with f8 operands) or its own Triton GEMM fusion over the f8 codes (what the H100
  run of 2026-11-23 compiled for these shapes); its result matches float64 of the dequantized
  operands."""
  x = jnp.asarray(rng.standard_normal((256, 512)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((384, 512)) * 0.05, jnp.float32)
  dn = (((1,), (1,)), ((), ()))

  def f(x, w):
    a, b = quantize.quantize_per_tensor(x), quantize.quantize_per_tensor(w)
    return gemm.fp8_dot_general_reference(a, b, dn, jnp.float32)

  with kernels.backend("reference"):
    compiled = jax.jit(f).lower(x, w).compile().as_text()
    out = np.asarray(jax.jit(f)(x, w), np.float64)
  f8_names = set(re.findall(r"(%[\w.]+) = f8e4m3fn", compiled))
  gemm_fusions = [re.findall(r"%[\w.]+", line.split("fusion(", 1)[1].split(")", 1)[0])
                  for line in compiled.splitlines() if "gemm_fusion_dot =" in line]
  fp8_gemm = ("__cublas$lt$matmul$f8" in compiled
              or any(ops and set(ops) <= f8_names for ops in gemm_fusions))
  assert fp8_gemm, compiled[-2000:]
  per_tensor = lambda a: _fake_quantize_numpy(np.asarray(a).reshape(1, -1), a.size,
                                             np.float32).reshape(a.shape)
  xq, wq = per_tensor(x), per_tensor(w)
  assert _rel_mse(out, xq @ wq.T) < 1e-6


def _kahan_run(rng, steps=40):
  """bfloat16 params near 1 under coat_adamw_apply (lr 1e-4: each update below half a bfloat16
  ulp of 1.0) with a float32 master, a bfloat16 master rounded to nearest and one with Kahan;
  returns each master value (p, or p + c with Kahan) in float64. Same bfloat16 gradients."""
  from coat_jax.optim import coat_adamw, coat_adamw_apply
  p0 = jnp.asarray(1.0 + 0.01 * rng.standard_normal(8192), jnp.float32)
  g = jnp.asarray(rng.standard_normal(8192), jnp.bfloat16)
  out = {}
  for name, dtype, mr in (("f32", jnp.float32, "nearest"), ("nearest", jnp.bfloat16, "nearest"),
                          ("kahan", jnp.bfloat16, "kahan")):
    kw = dict(weight_decay=0.0, master_rounding=mr)
    p = p0.astype(jnp.bfloat16).astype(dtype)
    state, step = coat_adamw(1e-4, **kw).init(p), jax.jit(coat_adamw_apply(1e-4, **kw))
    for _ in range(steps):
      p, state = step(g.astype(dtype), state, p)
    comp = state.comp if state.comp is not None else jnp.zeros_like(p)
    out[name] = np.asarray(p, np.float64) + np.asarray(comp, np.float64)
  return out


def test_kahan_split_passes_a_barrier_in_the_program(rng):
  from coat_jax.rounding import split_bf16
  y = jnp.asarray(rng.standard_normal(64), jnp.float32)
  text = jax.jit(split_bf16).lower(y).as_text()
  assert "optimization_barrier" in text and "bf16" in text
  hi, lo = jax.jit(split_bf16)(y)
  err = np.abs(np.asarray(hi, np.float64) + np.asarray(lo, np.float64) - np.asarray(y, np.float64))
  assert float(np.max(err / np.abs(np.asarray(y, np.float64)))) <= 2.0 ** -16


def test_kahan_master_keeps_small_updates_on_this_backend(rng):
  """Round-to-nearest loses all 40 updates (each below half an ulp); Kahan keeps them up to its
  bfloat16 compensation's precision (2^-17 |p| per step: ~8 % of a 1e-4 update at |p| ~ 1).
  On the H100, before split_bf16's barrier, XLA folded f32 -> bf16 -> f32, the compensation
  stayed zero and Kahan equalled nearest (llama-125m, benchmarks/accuracy/master_weights.py)."""
  out = _kahan_run(rng)
  moved = float(np.mean(np.abs(out["f32"] - out["nearest"])))
  assert moved > 0.002                            # the float32 master moved ~40 x 1e-4
  kahan_err = float(np.mean(np.abs(out["kahan"] - out["f32"])))
  assert np.all(np.isfinite(out["kahan"])) and kahan_err < 0.2 * moved, (kahan_err, moved)
