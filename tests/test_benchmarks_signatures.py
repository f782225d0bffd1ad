"""Which Mosaic GPU kernels (one module each, compiled with the step) the FP8 linears bind on
Hopper, listed without a GPU by benchmarks/step/compile_breakdown.py --signatures (the dispatch told it
is on Hopper, the traced jaxpr walked; nothing runs), and that every linear option keeps the
defaults' values and gradients bit for bit in interpret mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import kernels, ops
from coat_jax.ops import linear_ablation

from benchmarks.step import compile_breakdown as cb
M, K, N = 256, 256, 384   # every kernel takes these (multiples of 64, GEMM dims >= 128)


def _block(x, s, w1, w2):
  """RMSNorm -> linear (x_q from the norm) -> linear (x quantized inside), as in the model."""
  y, y_q = ops.rmsnorm(x, s, mode="coat")
  h = ops.linear(y, w1, mode="coat", x_q=y_q)
  return ops.linear(h, w2, mode="coat")


def _args(rng):
  return (jnp.asarray(rng.standard_normal((2, M // 2, K)), jnp.bfloat16),
          jnp.asarray(1 + 0.1 * rng.standard_normal(K), jnp.float32),
          jnp.asarray(0.1 * rng.standard_normal((K, N)), jnp.float32),
          jnp.asarray(0.1 * rng.standard_normal((N, K)), jnp.float32))


def _signatures(rng, **options):
  def loss(*a):
    return jnp.sum(_block(*a).astype(jnp.float32))
  with cb.as_if_on_hopper(), kernels.backend(cb.signature_backend(None)), \
      linear_ablation.ablation(**options):
    closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(*_args(rng))
  return cb.kernel_signatures(closed, site_dirs=("/tests/",))


def test_signatures_of_the_default_and_the_kernel_options(rng):
  default = _signatures(rng)
  xla = _signatures(rng, weight_quantize="xla", weight_transpose="cast")
  kernel = _signatures(rng, amax="kernel")
  # GEMMs: fwd, dX, dW of two linears (K x N and N x K): 6 shapes. Per-tensor quantize +
  # transposed copy: x and h (e4m3; h is (M, N)), dY of both (e5m2), and under the defaults
  # (weight_quantize="forward_kernel", weight_transpose="codes") each weight with its transposed
  # codes in the forward (W1 (K, N) shares h's signature; W2 (N, K)): 5; the backward's weight
  # quantize is XLA's. Per-group: the norm's x.
  assert cb.family_counts(default) == {"gemm": 6, "per_tensor": 5, "per_group": 1}
  # weights quantized by XLA's ops: the activations' and gradients' 4 only.
  assert cb.family_counts(xla) == {"gemm": 6, "per_tensor": 4, "per_group": 1}
  # + the tile maxima of (M, K) and (M, N) (x, h, dY's).
  assert cb.family_counts(kernel) == {"gemm": 6, "per_tensor": 5, "per_group": 1, "tile_amax": 2}
  # the backward's weight quantize by the kernel too, without the transposed copy (both weights'
  # K * N values as the same rows): 6.
  both_kernel = _signatures(rng, weight_quantize="kernel")
  assert cb.family_counts(both_kernel) == {"gemm": 6, "per_tensor": 6, "per_group": 1}
  by_what = {r["what"]: r for r in default}
  fwd = by_what[f"M x N x K = {M} x {N} x {K}, e4m3 . e4m3 -> bf16"]
  first_linear = _block.__code__.co_firstlineno + 3   # the line of `h = ops.linear(y, w1, ...)`
  assert fwd["calls"] == 1 and list(fwd["sites"]) == [f"fwd _block:{first_linear} linear"], fwd
  dw = by_what[f"M x N x K = {K} x {N} x {M}, e4m3 . e5m2 -> f32"]
  assert all(s.startswith("bwd") for s in dw["sites"]), dw
  assert all(r["traces"] == 1 for r in default + xla + kernel)   # one module per signature
  assert all(r["grid"] for r in default)


def test_signature_backend_keeps_the_optimizer_off_mosaic():
  assert cb.signature_backend(None) == "adam=reference"
  assert cb.signature_backend("gemm=reference") == "gemm=reference,adam=reference"
  assert cb.signature_backend("reference") == "reference"
  kernels.parse_backend(cb.signature_backend("gemm=reference"))   # a valid spec


def test_variant_linear_options_parse():
  v = cb.parse_variant("coat:coat_adamw/linear=amax=kernel/linear=weight_quantize=kernel")
  assert v["linear"] == dict(amax="kernel", weight_quantize="kernel")
  with pytest.raises(ValueError, match="KEY=VALUE"):
    cb.parse_variant("coat:coat_adamw/linear=amax")


OPTIONS_SEED = 20261124


def _block_values(options: dict):
  """_block's forward values and gradients on fixed inputs (seed OPTIONS_SEED) under `options`,
  the Mosaic GPU kernels in interpret mode."""
  rng = np.random.default_rng(OPTIONS_SEED)
  args = _args(rng)
  ct = jnp.asarray(rng.standard_normal((2, M // 2, K)), jnp.bfloat16)

  def f(*a):   # a fresh jit: the options are read while tracing (eager interpret-mode kernels
    y, pb = jax.vjp(_block, *a)   # can deadlock on their callbacks)
    return y, pb(ct)

  with linear_ablation.ablation(**options), kernels.backend("quantize=pallas,gemm=pallas"):
    return jax.jit(f)(*args)


@pytest.fixture(scope="module")
def default_values():
  """The defaults' run, once for every option below (each run compiles ~10 s in interpret mode)."""
  print(f"seed {OPTIONS_SEED}")
  return _block_values({})


# CI time (~12 s an option): CI checks the one option a run config reaches (linear.weight_quant);
# the benchmarks' private ablations and pairs of options run with --slow.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("options", [
    dict(weight_quant="once"),
    pytest.param(dict(amax="kernel"), marks=_SLOW),
    pytest.param(dict(weight_quantize="xla"), marks=_SLOW),
    pytest.param(dict(weight_quantize="kernel"), marks=_SLOW),
    pytest.param(dict(weight_transpose="cast"), marks=_SLOW),
    pytest.param(dict(activation_quantize="xla", gradient_quantize="xla"), marks=_SLOW),
    pytest.param(dict(weight_transpose="cast", weight_quantize="xla"), marks=_SLOW),
    pytest.param(dict(amax="kernel", weight_quantize="xla"), marks=_SLOW),
    pytest.param(dict(weight_quant="once", weight_quantize="xla"), marks=_SLOW)])
def test_kernel_options_give_the_defaults_values_in_interpret_mode(default_values, options):
  """Every option against the defaults (the Mosaic GPU kernels in interpret mode, XLA's amax,
  the weight's codes transposed): the same forward values and gradients, bit for bit."""
  y0, g0 = default_values
  y1, g1 = _block_values(options)
  np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y0, np.float32))
  for a, b in zip(g1, g0):
    assert np.isfinite(np.asarray(a, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_linear_ablation_rejects_unknown_values_and_defaults_to_the_library_choice():
  with pytest.raises(ValueError, match="weight_quantize must be one of"):
    with linear_ablation.ablation(weight_quantize="triton"):
      pass
  with pytest.raises(ValueError, match="unknown switch 'amx'"):
    with linear_ablation.ablation(amx="kernel"):
      pass
  assert {k: linear_ablation.option(k) for k in linear_ablation.CHOICES} == dict(
      weight_quant="per_use", amax="fused", weight_quantize="forward_kernel",
      activation_quantize="kernel", gradient_quantize="kernel", swiglu_quantize="gemm_epilogue",
      weight_transpose="codes", remake_quantize="fused")
  with linear_ablation.ablation(amax="kernel"):
    with linear_ablation.ablation(weight_quant="once"):   # nested: both
      assert (linear_ablation.option("amax"), linear_ablation.option("weight_quant")) == (
          "kernel", "once")
    assert linear_ablation.option("weight_quant") == "per_use"
