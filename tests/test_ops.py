"""Ops in three precision modes vs float32 references: values, and gradients by relative L2 error
(||g - g_ref|| / ||g_ref||, catches a wrong scale) and cosine (catches a wrong direction); saved
residual bytes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import formats, kernels, memory, ops
from coat_jax.ops import linear_ablation
from coat_jax.precision import PRECISIONS
from tests.jaxpr_walk import equations

# Relative L2 bounds. bf16 rounds to 8 mantissa bits (~0.4% per element). FP8 modes: E4M3 values
# (3 mantissa bits, ~2-3% RMS relative error per operand) and E5M2 gradients (2 bits, ~5% RMS)
# enter each GEMM: measured 0.035-0.04 (y) and 0.055-0.06 (dx, dw). A scale factor lost anywhere
# gives an error of order 1 or more.
TOL = {"bf16": 0.01, "fp8_linear": 0.08, "coat": 0.08}
COS_MIN = {"bf16": 0.9999, "fp8_linear": 0.99, "coat": 0.99}
SCALE_BYTES = formats.ACTIVATION_SCALE_DTYPE.itemsize   # per 1 x 16 group of a saved FP8 activation


def rel_l2(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def cosine(a, b) -> float:
  a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
  return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def check_close(name, got, ref, tol, cos_min=None, lo=0.0):
  """Asserts finite `got`, lo < relative L2 error <= tol and (if given) cosine >= cos_min. `lo`:
  the error an FP8 path must at least have (a path that skipped its quantization, or used a
  finer format than it should, is more accurate than that)."""
  got = np.asarray(got, np.float64)
  assert np.all(np.isfinite(got)), f"{name}: non-finite values"
  assert got.shape == np.shape(ref), (name, got.shape, np.shape(ref))
  err = rel_l2(got, ref)
  cos = cosine(got, ref)
  print(f"{name}: rel L2 {err:.4f}, cosine {cos:.6f}")
  assert err <= tol, f"{name}: relative L2 error {err:.4f} > {tol}"
  if lo:
    assert err > lo, f"{name}: relative L2 error {err:.4f} <= {lo}: not the expected FP8 rounding"
  if cos_min is not None:
    assert cos >= cos_min, f"{name}: cosine {cos:.6f} < {cos_min}"


def bf16(rng, shape, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


def f32(*xs):
  return [x.astype(jnp.float32) for x in xs]


def _nbytes(res):
  return sum(int(np.prod(s)) * d.itemsize for s, d in res)


@pytest.mark.parametrize("with_x_q", [False, True])
@pytest.mark.parametrize("mode", PRECISIONS)
def test_linear_values_and_grads(mode, with_x_q, rng):
  x, w, ct = bf16(rng, (2, 16, 64)), bf16(rng, (64, 32), 0.1), bf16(rng, (2, 16, 32))

  def f(x, w):
    x_q = ops.quantize_input(x) if with_x_q and mode != "bf16" else None
    return ops.linear(x, w, mode=mode, x_q=x_q)

  y, pb = jax.vjp(f, x, w)
  yr, pbr = jax.vjp(lambda x, w: x @ w, *f32(x, w))
  assert y.dtype == jnp.bfloat16 and y.shape == (2, 16, 32)
  # FP8 modes: E4M3 x and W (y measured 0.035-0.04; bf16 0.0017) and an E5M2 gradient (dx, dw
  # 0.054-0.059; an E4M3 gradient would give y's ~0.037)
  fp8 = mode != "bf16"
  check_close(f"linear {mode} y", y, yr, TOL[mode], lo=0.02 if fp8 else 0.0)
  for name, g, gr in zip(("dx", "dw"), pb(ct), pbr(ct.astype(jnp.float32))):
    check_close(f"linear {mode} {name}", g, gr, TOL[mode], COS_MIN[mode],
                lo=0.046 if fp8 else 0.0)


@pytest.mark.parametrize("mode", ["fp8_linear", "coat"])
def test_linear_fp8_formats(mode, rng):
  """The forward makes E4M3 codes only (x, W); the backward adds E5M2 (the output gradient)."""
  x, w, ct = bf16(rng, (2, 16, 64)), bf16(rng, (64, 32), 0.1), bf16(rng, (2, 16, 32))
  fwd = lambda x, w: ops.linear(x, w, mode=mode)
  both = lambda x, w: jax.vjp(fwd, x, w)[1](ct)
  fp8 = lambda f: {str(v.aval.dtype) for e in equations(jax.make_jaxpr(f)(x, w).jaxpr)
                   for v in e.outvars if "float8" in str(v.aval.dtype)}
  assert fp8(fwd) == {"float8_e4m3fn"}
  assert fp8(both) == {"float8_e4m3fn", "float8_e5m2"}


def test_quantize_input_and_rmsnorm_codes_scale_target(rng):
  """A linear's input codes (ops.quantize_input) and rmsnorm's FP8 output (coat) are E4M3 with
  scale = max|x| / 448: the largest magnitude is stored as the format's largest code."""
  x = bf16(rng, (4, 16, 64), 3.0)
  s = jnp.asarray(1 + 0.1 * rng.standard_normal(64), jnp.float32)
  y, y_q = ops.rmsnorm(x, s, mode="coat")
  for src, q in ((x, ops.quantize_input(x)), (y, y_q)):
    assert q.data.dtype == jnp.float8_e4m3fn and q.fmt == "e4m3"
    amax = float(jnp.max(jnp.abs(src.astype(jnp.float32))))
    np.testing.assert_allclose(float(q.scale), amax / 448.0, rtol=2.0 ** -8)
    assert float(jnp.max(jnp.abs(q.data.astype(jnp.float32)))) == 448.0
    np.testing.assert_allclose(np.asarray(q.dequantize(), np.float64),
                               np.asarray(src, np.float64), rtol=2.0 ** -4,
                               atol=2.0 ** -9 * float(q.scale))
  assert ops.quantize_input(x).data_t.dtype == jnp.float8_e4m3fn


def test_linear_saved_residuals(rng):
  x, w = bf16(rng, (4, 16, 64)), bf16(rng, (64, 32))
  coat = memory.saved_residuals(lambda x, w: ops.linear(x, w, mode="coat"), x, w)
  # x's E4M3 codes and float32 scale, and W's amax (in W's compute dtype, bf16: the backward
  # quantizes W again with it, reducing W only once a step).
  assert _nbytes(coat) == x.size + 4 + 2
  fp8l = memory.saved_residuals(lambda x, w: ops.linear(x, w, mode="fp8_linear"), x, w,
                                exclude_args=False)
  assert (x.shape, np.dtype(jnp.bfloat16)) in fp8l


@pytest.mark.parametrize("options", [{}, dict(weight_quantize="forward_kernel"),
                                     dict(weight_quantize="xla")])
def test_weight_is_reduced_once_a_step(options, rng):
  """The backward quantizes W with the forward's amax (a kept scalar): one max|W| per step, not
  one in each direction; the gradients are those of the forward's scale (checked against the
  other options bit for bit in test_benchmarks_signatures / test_scan_residuals)."""
  x, w = bf16(rng, (4, 16, 64)), jnp.asarray(0.1 * rng.standard_normal((64, 48)), jnp.float32)
  ct = bf16(rng, (4, 16, 48))

  def step(x, w):
    y, pb = jax.vjp(lambda x, w: ops.linear(x, w, mode="coat"), x, w)
    return y, pb(ct)

  with linear_ablation.ablation(**options):
    jaxpr = jax.make_jaxpr(step)(x, w).jaxpr
    _, (dx, dw) = step(x, w)
  reductions = [e for e in equations(jaxpr)
                if e.primitive.name == "reduce_max" and tuple(e.invars[0].aval.shape) == w.shape]
  assert len(reductions) == 1
  assert np.isfinite(np.asarray(dw)).all() and np.isfinite(np.asarray(dx, np.float32)).all()


@pytest.mark.parametrize("once", [False, True])
def test_weight_quant_once_reads_the_float32_weight_without_a_cast(once, rng):
  """weight_quant="once" with the kernels: the forward's quantize reads the float32 parameter
  and rounds it to bfloat16 as it loads it (no bfloat16 copy of W is made by an op of its own),
  and the backward quantizes no W (it takes the forward's codes); the default per_use casts W
  and quantizes it in each direction."""
  x, w = bf16(rng, (4, 64, 128)), jnp.asarray(0.1 * rng.standard_normal((128, 192)), jnp.float32)
  ct = bf16(rng, (4, 64, 192))   # M = 256: no activation or gradient has W's size

  def step(x, w):
    y, pb = jax.vjp(lambda x, w: ops.linear(x, w, mode="coat"), x, w)
    return y, pb(ct)

  kernel_call = ("mpmd_map", "pallas_call")
  with linear_ablation.ablation(weight_quant="once" if once else "per_use"), \
      kernels.backend("quantize=pallas,gemm=pallas"):
    jaxpr = jax.make_jaxpr(step)(x, w)
  eqns = list(equations(jaxpr, stop=lambda e: e.primitive.name in kernel_call))
  casts = [e for e in eqns if e.primitive.name == "convert_element_type"   # W's, in any view
           and e.invars[0].aval.size == w.size and e.invars[0].aval.dtype == jnp.float32
           and e.params["new_dtype"] == jnp.bfloat16]
  w_codes = [e for e in eqns if e.primitive.name == "convert_element_type"
             and e.params["new_dtype"] == jnp.float8_e4m3fn and e.invars[0].aval.size == w.size]
  quantizes = [e for e in eqns if e.primitive.name in kernel_call   # of W or of its cast
               and any(v.aval.size == w.size for v in e.invars)]
  if once:
    assert not casts and not w_codes and len(quantizes) == 1
  else:
    assert casts and w_codes and len(quantizes) == 1


def rmsnorm_ref(x, s, eps=1e-6):
  return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * s


@pytest.mark.parametrize("mode", PRECISIONS)
def test_rmsnorm_values_and_grads(mode, rng):
  x = bf16(rng, (4, 16, 64), 3.0)
  s = jnp.asarray(1 + 0.1 * rng.standard_normal(64), jnp.float32)
  ct = bf16(rng, x.shape)
  yr, pbr = jax.vjp(rmsnorm_ref, x.astype(jnp.float32), s)
  y, pb = jax.vjp(lambda x, s: ops.rmsnorm(x, s, mode=mode)[0], x, s)
  # coat: the backward reads x from its E4M3 copy (per 1x16 group): measured dx 0.0044,
  # dscale 0.019 (a sum over tokens of errors that do not cancel); bf16 rounding elsewhere.
  tol = 0.03 if mode == "coat" else 0.01
  check_close(f"rmsnorm {mode} y", y, yr, 0.01)
  lo = {"dx": 0.002, "dscale": 0.008} if mode == "coat" else {}
  for name, g, gr in zip(("dx", "dscale"), pb(ct), pbr(ct.astype(jnp.float32))):
    check_close(f"rmsnorm {mode} {name}", g, gr, tol, 0.999, lo=lo.get(name, 0.0))
  assert (ops.rmsnorm(x, s, mode=mode)[1] is None) == (mode != "coat")


def test_rmsnorm_saved_residuals_and_shared_x_q(rng):
  x = bf16(rng, (4, 16, 64), 3.0)
  s = jnp.asarray(1 + 0.1 * rng.standard_normal(64), jnp.float32)
  w = bf16(rng, (3, 64, 32), 0.1)
  res = memory.saved_residuals(lambda x, s: ops.rmsnorm(x, s, mode="coat")[0], x, s)
  assert _nbytes(res) == x.size * (1 + SCALE_BYTES / 16) + 4 * x.size // 64

  def block(x, s, w):
    y, yq = ops.rmsnorm(x, s, mode="coat")
    return sum(ops.linear(y, w[i], mode="coat", x_q=yq) for i in range(3))

  res = memory.saved_residuals(block, x, s, w)
  fp8 = [r for r in res if r[1] == np.dtype(jnp.float8_e4m3fn)]
  assert len(fp8) == 2, res  # per-group x and the shared y_q, once.


@pytest.mark.parametrize("mode", PRECISIONS)
def test_swiglu_values_and_grads(mode, rng):
  g, u, ct = bf16(rng, (4, 16, 64)), bf16(rng, (4, 16, 64)), bf16(rng, (4, 16, 64))
  ref = lambda g, u: jax.nn.silu(g) * u
  h, pb = jax.vjp(lambda g, u: ops.swiglu(g, u, mode=mode)[0], g, u)
  hr, pbr = jax.vjp(ref, *f32(g, u))
  check_close(f"swiglu {mode} h", h, hr, 0.01)
  # coat: gate and up from E4M3 copies (per 1x16 group), measured 0.024-0.025.
  tol = 0.04 if mode == "coat" else 0.01
  for name, d, dr in zip(("dgate", "dup"), pb(ct), pbr(ct.astype(jnp.float32))):
    check_close(f"swiglu {mode} {name}", d, dr, tol, 0.999, lo=0.012 if mode == "coat" else 0.0)
  if mode == "coat":
    res = memory.saved_residuals(lambda g, u: ops.swiglu(g, u, mode=mode)[0], g, u)
    assert _nbytes(res) == 2 * g.size * (1 + SCALE_BYTES / 16)


def rope_ref(x, positions, head_dim, theta):
  """HF's form: x * [cos, cos] + rotate_half(x) * [sin, sin], float64 numpy."""
  inv = theta ** (-np.arange(0, head_dim, 2) / head_dim)
  ang = np.asarray(positions, np.float64)[..., None] * inv  # (..., S, Dh/2)
  cos = np.concatenate([np.cos(ang)] * 2, -1)[..., None, :]
  sin = np.concatenate([np.sin(ang)] * 2, -1)[..., None, :]
  x = np.asarray(x, np.float64)
  half = head_dim // 2
  rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
  return x * cos + rot * sin


@pytest.mark.parametrize("per_batch_positions", [False, True])
def test_rope_values_and_grads(per_batch_positions, rng):
  b, s, h, dh, theta = 2, 12, 3, 16, 10000.0
  cos, sin = ops.rope_frequencies(dh, 32, theta=theta)
  x = jnp.asarray(rng.standard_normal((b, s, h, dh)), jnp.float32)
  ct = rng.standard_normal((b, s, h, dh))
  positions = rng.integers(0, 32, (b, s)) if per_batch_positions else np.arange(s)
  pos_arg = jnp.asarray(positions) if per_batch_positions else None
  y, pb = jax.vjp(lambda x: ops.apply_rope(x, cos, sin, pos_arg), x)
  check_close("rope y", y, rope_ref(x, positions, dh, theta), 1e-5)
  # The rotation is linear in x: its VJP is the inverse rotation, i.e. rope at -positions.
  check_close("rope dx", pb(jnp.asarray(ct, jnp.float32))[0],
              rope_ref(ct, -np.asarray(positions), dh, theta), 1e-5, 0.99999)


def test_rope_backward_is_the_inverse_rotation_bit_for_bit(rng):
  """The custom backward (rotation by -angle, one concatenate) gives the values JAX's transpose
  of the plain rotation gives (bf16 in and out), without that transpose's pads; the tables get
  no gradient."""
  from coat_jax.ops import rope as rope_module
  b, s, h, dh = 2, 16, 4, 32
  cos, sin = ops.rope_frequencies(dh, s)
  x = jnp.asarray(rng.standard_normal((b, s, h, dh)), jnp.bfloat16)
  ct = jnp.asarray(rng.standard_normal((b, s, h, dh)), jnp.bfloat16)
  c, sn = cos[None, :, None, :], sin[None, :, None, :]
  _, plain_pb = jax.vjp(lambda x: rope_module._rotation(x, c, sn), x)
  (dx,) = jax.vjp(lambda x: ops.apply_rope(x, cos, sin), x)[1](ct)
  (want,) = plain_pb(ct)
  assert dx.dtype == jnp.bfloat16 and np.isfinite(np.asarray(dx, np.float32)).all()
  np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(want, np.float32))
  prims = lambda f: {e.primitive.name for e in jax.make_jaxpr(f)(x, ct).jaxpr.eqns}
  assert "pad" in prims(lambda x, ct: plain_pb(ct))   # what the custom backward avoids
  assert "pad" not in prims(lambda x, ct: jax.vjp(lambda x: ops.apply_rope(x, cos, sin), x)[1](ct))
  dcos = jax.grad(lambda cs: jnp.sum(ops.apply_rope(x, cs, sin).astype(jnp.float32)))(cos)
  assert not np.asarray(dcos).any()


def test_rope_llama3_scaling_keeps_norms():
  cos, sin = ops.rope_frequencies(8, 32, scaling=dict(factor=8.0, low_freq_factor=1.0,
      high_freq_factor=4.0, original_max_position_embeddings=64))
  plain_cos, plain_sin = ops.rope_frequencies(8, 32)
  assert cos.shape == (32, 4) and np.allclose(cos**2 + sin**2, 1, atol=1e-5)
  np.testing.assert_allclose(cos[:, 0], plain_cos[:, 0], rtol=1e-6)  # highest frequency kept
  np.testing.assert_allclose(sin[:, -1], np.sin(np.arange(32) * 1e-3 / 8), rtol=1e-4)  # lowest / 8


def attention_ref(q, k, v):
  groups = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
  sc = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  s = q.shape[1]
  sc = jnp.where(np.tril(np.ones((s, s), bool)), sc, -jnp.inf)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(sc, -1), v)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 0.02)])
def test_attention_values_and_grads(dtype, tol, rng):
  q = jnp.asarray(rng.standard_normal((2, 8, 4, 8)), dtype)
  k = jnp.asarray(rng.standard_normal((2, 8, 2, 8)), dtype)
  v = jnp.asarray(rng.standard_normal((2, 8, 2, 8)), dtype)
  ct = jnp.asarray(rng.standard_normal(q.shape), dtype)
  o, pb = jax.vjp(ops.attention, q, k, v)
  orf, pbr = jax.vjp(attention_ref, *f32(q, k, v))
  assert o.dtype == dtype
  check_close("attention o", o, orf, tol)
  for name, g, gr in zip(("dq", "dk", "dv"), pb(ct), pbr(ct.astype(jnp.float32))):
    check_close(f"attention {name}", g, gr, tol, 0.999)



def qkv_f32(rng, b=2, s=32, hq=4, hkv=2, dh=32):
  shapes = ((b, s, hq, dh), (b, s, hkv, dh), (b, s, hkv, dh))
  return [jnp.asarray(rng.standard_normal(sh), jnp.float32) for sh in shapes]


# FP8 residuals vs the plain attention on the same float32 inputs: the forward is the same
# computation; the gradients come from q, k, v rounded to E4M3 per 1 x 16 group. Measured over
# 5 seeds: relative L2 0.038-0.043 (dq, dk), 0.021-0.024 (dv); cosines >= 0.9991.
ATTN_FP8_TOL, ATTN_FP8_COS = 0.05, 0.998


@pytest.mark.parametrize("backend", ["reference", "quantize=pallas,dequantize=pallas"])
def test_attention_fp8_residuals_grads(backend, rng):
  q, k, v = qkv_f32(rng)
  ct = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  with kernels.backend(backend):
    o, pb = jax.vjp(lambda q, k, v: ops.attention(q, k, v, residuals="fp8"), q, k, v)
    grads = pb(ct)
  o_ref, pb_ref = jax.vjp(ops.attention, q, k, v)
  np.testing.assert_allclose(o, o_ref, rtol=1e-6, atol=1e-6)
  for name, g, g_ref in zip(("dq", "dk", "dv"), grads, pb_ref(ct)):
    assert g.dtype == jnp.float32
    check_close(f"attention fp8 residuals {name}", g, g_ref, ATTN_FP8_TOL, ATTN_FP8_COS)
    assert rel_l2(g, g_ref) > 1e-4, f"{name}: no FP8 rounding seen, residuals not FP8?"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_fp8_residuals_saved_bytes(dtype, rng):
  """Plain keeps q, k, v in `dtype`; fp8 keeps 1 byte a value + a scale per 16 values (bfloat16:
  formats.ACTIVATION_SCALE_DTYPE)."""
  q, k, v = (t.astype(dtype) for t in qkv_f32(rng))
  fns = {r: (lambda r: lambda q, k, v: ops.attention(q, k, v, residuals=r))(r)
         for r in ops.ATTENTION_RESIDUALS}
  saved = {r: memory.saved_residual_bytes(f, q, k, v, exclude_args=False) for r, f in fns.items()}
  values = q.size + k.size + v.size
  assert saved["bf16"] == values * jnp.dtype(dtype).itemsize, saved
  assert saved["fp8"] == values * (1 + SCALE_BYTES / 16), saved
  fp8_dtypes = {np.dtype(a) for _, a in memory.saved_residuals(fns["fp8"], q, k, v)}
  assert fp8_dtypes == {np.dtype(jnp.float8_e4m3fn), formats.ACTIVATION_SCALE_DTYPE}, fp8_dtypes
  print(f"{jnp.dtype(dtype).name}: saved bytes fp8 / plain = {saved['fp8'] / saved['bf16']:.4f}")



@pytest.mark.gpu
def test_attention_fp8_residuals_cudnn(rng):
  """GPU, bf16: the cuDNN attention with FP8-saved q, k, v (forward and recomputation in the
  backward both cuDNN) vs the plain cuDNN attention. Bounds as on CPU plus bf16 rounding
  (not yet measured on a GPU)."""
  q, k, v = (t.astype(jnp.bfloat16) for t in qkv_f32(rng, s=256, dh=64))
  ct = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)

  def grads(residuals):
    f = lambda q, k, v: ops.attention(q, k, v, implementation="cudnn", residuals=residuals)
    step = jax.jit(lambda q, k, v, ct: jax.vjp(f, q, k, v)[1](ct))
    assert "cudnn" in step.lower(q, k, v, ct).as_text()
    return step(q, k, v, ct)

  for name, g, g_ref in zip(("dq", "dk", "dv"), grads("fp8"), grads("bf16")):
    check_close(f"cuDNN attention fp8 residuals {name}", g, g_ref, ATTN_FP8_TOL + 0.01,
                ATTN_FP8_COS)


def test_residual_add_values_and_grads(rng):
  x, y = bf16(rng, (2, 8, 16)), jnp.asarray(rng.standard_normal((2, 8, 16)), jnp.float32)
  ct = bf16(rng, (2, 8, 16))
  out, pb = jax.vjp(ops.residual_add, x, y)
  outr, pbr = jax.vjp(lambda x, y: x + y, *f32(x, y))
  assert out.dtype == jnp.bfloat16
  check_close("residual out", out, outr, 0.01)
  for name, g, gr in zip(("dx", "dy"), pb(ct), pbr(ct.astype(jnp.float32))):
    check_close(f"residual {name}", g, gr, 1e-6, 0.99999)


def test_bad_inputs():
  x = jnp.ones((2, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match="mode"):
    ops.linear(x, jnp.ones((8, 4), jnp.bfloat16), mode="fp4")
  with pytest.raises(ValueError, match=r"\(2, 8\)"):
    ops.linear(x, jnp.ones((4, 4), jnp.bfloat16), mode="bf16")
  with pytest.raises(ValueError, match="rmsnorm: mode"):
    ops.rmsnorm(x, jnp.ones(8), mode="nope")
  with pytest.raises(ValueError, match="swiglu: mode"):
    ops.swiglu(x, x, mode="nope")
  with pytest.raises(ValueError, match="shapes"):
    ops.residual_add(x, jnp.ones((2, 4)))
  q = jnp.ones((1, 4, 2, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="attention: residuals"):
    ops.attention(q, q, q, residuals="fp4")
  with pytest.raises(ValueError, match="one dtype"):
    ops.attention(q, q.astype(jnp.float32), q, residuals="fp8")


def test_weight_amax_by_xla_not_the_stage1_kernel(rng):
  """With the quantize kernels on (interpreted here) and linear_ablation.ablation(amax="kernel",
  weight_quantize="kernel"), a coat linear's forward and backward run the stage-1 tile-maxima
  kernel for x and dY only: a weight's amax is an XLA reduction (one Mosaic GPU module less per
  weight shape in a compiled step); values and gradients as the reference's. The defaults
  (amax="fused", weight_quantize="forward_kernel") run no stage-1 kernel and the quantize kernels
  of x, dY and W's forward one (with W^T's codes; the backward's is XLA's); weight_quantize=
  "kernel" also W's backward one; "xla" those of x and dY only."""
  x = jnp.asarray(rng.standard_normal((64, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64, 64)) * 0.1, jnp.float32)
  loss = lambda x, w: jnp.sum(ops.linear(x, w, mode="coat").astype(jnp.float32) ** 2)
  step = jax.value_and_grad(loss, argnums=(0, 1))

  def kernel_names(jaxpr):
    return [e.params.get("name") for e in equations(jaxpr)
            if e.primitive.name in ("mpmd_map", "pallas_call")]

  with kernels.backend("quantize=mosaic"), linear_ablation.ablation(amax="kernel",
                                                               weight_quantize="kernel"):
    names = kernel_names(jax.make_jaxpr(step)(x, w).jaxpr)
    got = step(x, w)
  assert names.count("coat_tile_amax_mgpu") == 2
  assert names.count("coat_quantize_per_tensor_mgpu") == 4
  with kernels.backend("quantize=mosaic"):   # the defaults: every amax by XLA
    names = kernel_names(jax.make_jaxpr(step)(x, w).jaxpr)
  assert names.count("coat_tile_amax_mgpu") == 0
  assert names.count("coat_quantize_per_tensor_mgpu") == 3   # x, dY, W in the forward
  with kernels.backend("quantize=mosaic"), linear_ablation.ablation(weight_quantize="kernel"):
    names = kernel_names(jax.make_jaxpr(step)(x, w).jaxpr)
  assert names.count("coat_quantize_per_tensor_mgpu") == 4   # x, dY, W twice
  with kernels.backend("quantize=mosaic"), linear_ablation.ablation(weight_quantize="xla"):
    names = kernel_names(jax.make_jaxpr(step)(x, w).jaxpr)
  assert names.count("coat_tile_amax_mgpu") == 0
  assert names.count("coat_quantize_per_tensor_mgpu") == 2   # x and dY, with transposed copies
  with kernels.backend("reference"):
    ref = step(x, w)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
