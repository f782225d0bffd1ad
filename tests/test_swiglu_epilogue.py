"""The gate/up GEMM with SwiGLU in its epilogue (pallas_kernels/gemm/fp8_gemm_swiglu.py,
`kernels.gemm_swiglu_quantize`, `ops.swiglu_linears` under
`linear_ablation.ablation(swiglu_quantize="gemm_epilogue")`).

CPU: the kernel in Mosaic GPU interpret mode against float64 (h) and numpy's per-group quantize
of the float32 products (codes, scales); the dispatch against its reference (two GEMMs, then
`swiglu_quantize`), both against float64; the op's values and gradients against float64, no
worse than the "fused" path's; the op's and the model's loss and gradients with the option (the
default) against the "fused" path (two linears, then `kernels.swiglu_quantize`) on the
reference backend, where the two paths compute the same numbers. GPU: the compiled kernel, and a
layer.
"""
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from coat_jax import kernels, memory, ops
from coat_jax.models import Llama, LlamaConfig
from coat_jax.ops import linear_ablation
from coat_jax.quantize import QuantizedArray
from flax import nnx
from pallas_kernels.gemm import fp8_gemm_swiglu as fs, fp8_matmul as fm
from tests.jaxpr_walk import equations
from tests.test_kernels_quantize_mgpu import E4M3, _code_steps, _np_per_group

# x's per-tensor scale and gate's and up's weight scales (distinct, so that a swap shows); the
# kernel scales gate's and up's products by their float32 products, SCALES
X_SCALE, W_SCALES = 0.37, (0.0297, 0.0114)
SCALES = tuple(float(np.float32(X_SCALE) * np.float32(w)) for w in W_SCALES)


def _operands(m, f, k, seed):
  print(f"seed {seed} (M, F, K) = {(m, f, k)}")
  rng = np.random.default_rng(seed)
  fp8 = lambda shape: jnp.asarray(np.clip(rng.standard_normal(shape) * 2, -440, 440),
                                  jnp.float32).astype(jnp.float8_e4m3fn)
  return fp8((m, k)), fp8((f, k)), fp8((f, k))


def _products64(x, wg, wu):
  x64 = np.asarray(x, np.float64)
  return (x64 @ np.asarray(wg, np.float64).T * SCALES[0],
          x64 @ np.asarray(wu, np.float64).T * SCALES[1])


def _run_kernel(x, wg, wu, interpret=True, **kw):
  return fs.fp8_gemm_swiglu(x, fs.interleave_gate_up(wg, wu), *map(jnp.float32, (X_SCALE,
                                                                              *W_SCALES)),
                            interpret=plgpu.InterpretGPUParams() if interpret else None, **kw)


def _check_kernel(out, g64, u64, h_rtol, max_steps):
  """out against gate's and up's products g64, u64 (float64 arrays)."""
  h, hmax, gq, gs, uq, us = out
  h64 = g64 / (1 + np.exp(-g64)) * u64
  m, f = g64.shape
  assert h.shape == (m, f) and h.dtype == jnp.bfloat16 and hmax.shape == (m, f // 64)
  err = np.abs(np.asarray(h, np.float64) - h64)
  assert np.all(err <= h_rtol * np.abs(h64) + 1e-6 * np.abs(h64).max()), err.max()
  np.testing.assert_array_equal(np.asarray(hmax),
                                np.abs(np.asarray(h, np.float32)).reshape(m, -1, 64).max(-1))
  for p64, q, s in ((g64, gq, gs), (u64, uq, us)):
    q_ref, s_ref = _np_per_group(p64.astype(np.float32), 16, *E4M3, scale_dtype=jnp.bfloat16)
    s = np.asarray(s, np.float32)
    assert s.shape == (m, f // 16) and gs.dtype == jnp.bfloat16
    # float32 accumulation vs float64: a group's amax may round to the neighbouring bf16 scale
    np.testing.assert_allclose(s, s_ref, rtol=2.0 ** -7)
    assert np.mean(s == s_ref) > 0.99
    steps = _code_steps(q, q_ref)
    assert steps.max() <= max_steps and np.mean(steps == 0) > 0.99


@pytest.mark.parametrize("m,f,k,seed,ctas", [(256, 128, 256, 0, None), (512, 192, 128, 1, None),
                                             (384, 192, 640, 5, 3)])
def test_kernel_interpret_matches_float64(m, f, k, seed, ctas):
  """Each consumer warpgroup's tiles (a CTA's tiles alternate between the two), over one K step
  and over more K steps than ring slots (slots reused across tiles and warpgroups)."""
  x, wg, wu = _operands(m, f, k, seed)
  out = jax.jit(functools.partial(_run_kernel, num_ctas=ctas))(x, wg, wu)
  _check_kernel(out, *_products64(x, wg, wu), h_rtol=2.0 ** -8 + 2.0 ** -20, max_steps=1)


def _check_nan_row(interpret):
  """A NaN in row 5 of x: row 5 of every output is NaN (hmax: not finite), the rest finite."""
  x, wg, wu = _operands(256, 128, 128, seed=2)
  x = x.at[5, 7].set(jnp.nan)
  outs = jax.jit(lambda a, b, c: _run_kernel(a, b, c, interpret=interpret))(x, wg, wu)
  for name, a in zip(("h", "hmax", "gq", "gs", "uq", "us"), outs):
    a = np.asarray(a, np.float32)
    assert np.all(np.isfinite(np.delete(a, 5, axis=0))), name
    # interpret mode's jnp.max over 64 columns drops NaN (-inf; test_swiglu_fused says the same
    # of the row kernels' larger blocks); the GPU's max.NaN keeps it
    nan_ok = np.isnan(a[5]) | (name == "hmax" and interpret and np.isneginf(a[5]))
    assert np.all(nan_ok), (name, a[5])


def test_kernel_nan_input_row():
  _check_nan_row(interpret=True)


def test_interleave_and_errors():
  wg = jnp.arange(128 * 4, dtype=jnp.float32).reshape(128, 4)
  wi = fs.interleave_gate_up(wg, -wg)
  np.testing.assert_array_equal(wi[:64], wg[:64])
  np.testing.assert_array_equal(wi[64:128], -wg[:64])
  np.testing.assert_array_equal(wi[128:192], wg[64:])
  # FP8 codes move as 32-bit words: every code lands where the row interleave puts it
  _, g8, u8 = _operands(256, 192, 256, seed=6)
  wi8 = fs.interleave_gate_up(g8, u8)
  assert wi8.dtype == g8.dtype and wi8.shape == (384, 256)
  want = np.stack([np.asarray(g8, np.float32).reshape(3, 64, 256),
                   np.asarray(u8, np.float32).reshape(3, 64, 256)], axis=1).reshape(384, 256)
  np.testing.assert_array_equal(np.asarray(wi8, np.float32), want)
  x, g, u = _operands(256, 128, 128, seed=3)
  with pytest.raises(ValueError, match=r"M % 128"):
    _run_kernel(x[:192], g, u)
  with pytest.raises(ValueError, match="stages"):
    _run_kernel(x, g, u, stages=6)
  with pytest.raises(ValueError, match="must be equal"):
    fs.interleave_gate_up(g, u[:64])
  with pytest.raises(ValueError, match="must be float8"):
    fs.fp8_gemm_swiglu(x.astype(jnp.bfloat16), fs.interleave_gate_up(g, u), 1.0, 1.0, 1.0)
  assert fs.problem(256, 128, 128, jnp.float32) is not None
  assert fs.problem(256, 128, 128, jnp.bfloat16) is None


def _uses_epilogue_kernel(jaxpr_text: str) -> bool:
  """The kernel's name (interpret mode: the kernel's own; on the GPU the call lowered ahead,
  pallas_kernels/compile_ahead/lower_ahead.py, is keyed by its module and function) is in the jaxpr."""
  return fs.KERNEL_NAME in jaxpr_text or "fp8_gemm_swiglu" in jaxpr_text


def _dispatch_inputs(seed, lead=(2, 128), f=128, k=256):
  x, wg, wu = _operands(int(np.prod(lead)), f, k, seed)
  xs, ws = jnp.float32(0.05), (jnp.float32(SCALES[0] / 0.05), jnp.float32(SCALES[1] / 0.05))
  qa = lambda d, s: QuantizedArray(d, s, "e4m3", 0)
  return qa(x.reshape(*lead, k), xs), qa(wg, ws[0]), qa(wu, ws[1])


def test_dispatch_multiplies_no_scales_outside_the_kernel():
  """x's, gate's and up's scales reach the kernel apart: no product or stack of them outside it
  (on the GPU each would be an XLA kernel launch of its own per layer)."""
  xq, wgq, wuq = _dispatch_inputs(seed=5)
  with kernels.backend("gemm=pallas"):
    jaxpr = jax.make_jaxpr(lambda a, b, c: kernels.gemm_swiglu_quantize(a, b, c, jnp.bfloat16))(
        xq, wgq, wuq)
  is_kernel = lambda e: e.primitive.name in ("mpmd_map", "pallas_call")
  eqns = list(equations(jaxpr, stop=is_kernel))
  assert any(map(is_kernel, eqns))
  scalar_ops = [e.primitive.name for e in eqns if not is_kernel(e)
                and all(getattr(v.aval, "shape", None) in ((), (1,), (2,)) for v in e.outvars)]
  assert not {"mul", "stack", "concatenate"} & set(scalar_ops), scalar_ops


def test_dispatch_kernel_matches_its_reference():
  xq, wgq, wuq = _dispatch_inputs(seed=4)
  fn = lambda a, b, c: kernels.gemm_swiglu_quantize(a, b, c, jnp.bfloat16)
  out = {}
  for backend in ("gemm=pallas", "reference"):
    with kernels.backend(backend):
      text = str(jax.make_jaxpr(fn)(xq, wgq, wuq))
      assert _uses_epilogue_kernel(text) == (backend != "reference")
      out[backend] = jax.jit(fn)(xq, wgq, wuq)
  (h, amax, gq, uq), (h_r, amax_r, gq_r, uq_r) = out["gemm=pallas"], out["reference"]
  assert h.shape == h_r.shape == (2, 128, 128) and gq.scale.shape == gq_r.scale.shape
  # the reference rounds gate and up to bf16 before SwiGLU and the quantize: h within a few
  # bf16 steps, codes within one step
  np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(h_r, np.float32),
                             rtol=2.0 ** -6, atol=2.0 ** -8 * float(amax_r))
  assert abs(float(amax) - float(amax_r)) <= 2.0 ** -6 * float(amax_r)
  assert float(amax) == float(jnp.max(jnp.abs(h.astype(jnp.float32))))
  # both against float64 SwiGLU of the products (gate and up rounded to bf16 first: 2^-8 each)
  g64, u64 = _products64(xq.data.reshape(-1, 256), wgq.data, wuq.data)
  h64 = (g64 / (1 + np.exp(-g64)) * u64).reshape(h.shape)
  for got in (h, h_r):
    err = np.abs(np.asarray(got, np.float64) - h64)
    assert np.all(err <= 2.0 ** -6 * np.abs(h64) + 2.0 ** -12 * np.abs(h64).max()), err.max()
  for a, b in ((gq, gq_r), (uq, uq_r)):
    assert _code_steps(a.data, b.data).max() <= 1
    np.testing.assert_allclose(np.asarray(a.scale, np.float32), np.asarray(b.scale, np.float32),
                               rtol=2.0 ** -7)


def _layer_inputs(seed):
  print(f"seed {seed}")
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((2, 128, 256)), jnp.bfloat16)
  wg, wu = (jnp.asarray(rng.standard_normal((256, 128)) * 0.06, jnp.float32) for _ in range(2))
  dh = jnp.asarray(rng.standard_normal((2, 128, 128)), jnp.bfloat16)
  return x, wg, wu, dh


def _op_vjp(x, wg, wu, dh):
  xq = ops.quantize_input(x)
  (h, hq), pull = jax.vjp(
      lambda x, wg, wu: ops.swiglu_linears(x, wg, wu, mode="coat", x_q=xq), x, wg, wu)
  return h, pull((dh, jax.tree.map(jnp.zeros_like, hq)))


def _op_reference64(x, wg, wu, dh):
  """h and (dx, dw_gate, dw_up) in float64 from the unquantized inputs."""
  x, wg, wu, d = (np.asarray(a, np.float64) for a in (x, wg, wu, dh))
  a, u = x @ wg, x @ wu
  sig = 1 / (1 + np.exp(-a))
  da, du = d * u * sig * (1 + a * (1 - sig)), d * a * sig
  x2, da2, du2 = x.reshape(-1, x.shape[-1]), da.reshape(-1, a.shape[-1]), du.reshape(-1, a.shape[-1])
  return a * sig * u, (da @ wg.T + du @ wu.T, x2.T @ da2, x2.T @ du2)


def _rel_cos(got, ref):
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  assert np.all(np.isfinite(got))
  rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
  return rel, np.sum(got * ref) / (np.linalg.norm(got) * np.linalg.norm(ref))


def test_op_against_float64_no_worse_than_the_default_path():
  x, wg, wu, dh = _layer_inputs(seed=5)
  h64, grads64 = _op_reference64(x, wg, wu, dh)
  errs = {}
  for choice in ("fused", "gemm_epilogue"):
    with kernels.backend("gemm=pallas"), linear_ablation.ablation(swiglu_quantize=choice):
      h, grads = jax.jit(_op_vjp)(x, wg, wu, dh)
      xq = ops.quantize_input(x)   # outside: the quantize kernel has no derivative rule
      saved = memory.saved_residual_bytes(
          lambda x, wg, wu: ops.swiglu_linears(x, wg, wu, mode="coat", x_q=xq)[0], x, wg, wu)
      text = str(jax.make_jaxpr(_op_vjp)(x, wg, wu, dh))
    assert _uses_epilogue_kernel(text) == (choice == "gemm_epilogue")
    errs[choice] = [_rel_cos(a, r) for a, r in zip((h, *grads), (h64, *grads64))]
    errs[choice + " saved"] = saved
    print(choice, errs[choice])
  # the same residuals (FP8 x^T and its scale, gate's and up's codes and scales, two amaxes)
  assert errs["fused saved"] == errs["gemm_epilogue saved"] > 0
  for (rel, cos), (rel_d, _) in zip(errs["gemm_epilogue"], errs["fused"]):
    assert rel < 0.08 and cos > 0.995, (rel, cos)       # E4M3 x, W and 1 x 16 gate/up
    assert rel < 1.1 * rel_d + 1e-3, (rel, rel_d)


def test_op_falls_back_and_checks_shapes():
  x, wg, wu, dh = _layer_inputs(seed=6)
  with kernels.backend("reference"), linear_ablation.ablation(swiglu_quantize="gemm_epilogue"):
    got = jax.jit(_op_vjp)(x, wg, wu, dh)
  with kernels.backend("reference"), linear_ablation.ablation(swiglu_quantize="fused"):
    want = jax.jit(_op_vjp)(x, wg, wu, dh)   # two linears, then kernels.swiglu_quantize
  # the reference backend computes the same numbers on both paths
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  with linear_ablation.ablation(swiglu_quantize="gemm_epilogue"):
    with pytest.raises(ValueError, match="gate weight .* != up weight"):
      ops.swiglu_linears(x, wg, wu[:, :64], mode="coat", x_q=ops.quantize_input(x))
    with pytest.raises(ValueError, match="does not match w shape"):
      ops.swiglu_linears(x[..., :128], wg, wu, mode="coat", x_q=ops.quantize_input(x[..., :128]))
    h, h_q = ops.swiglu_linears(x, wg, wu, mode="bf16")   # other modes: swiglu(*linears(...))
    assert h_q is None and h.shape == (2, 128, 128)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_model_loss_and_grads_equal_the_default_on_the_reference_backend(scan_layers):
  cfg = LlamaConfig.from_name("tiny", vocab_size=512, hidden_size=128, intermediate_size=256,
                              num_layers=2, precision="coat", scan_layers=scan_layers)
  graphdef, params, rest = nnx.split(Llama(cfg, rngs=nnx.Rngs(7)), nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(8), (2, 65), 0, cfg.vocab_size)
  print("seeds 7 (params), 8 (tokens)")
  loss_fn = lambda p: nnx.merge(graphdef, p, rest).loss(tokens[:, :-1], tokens[:, 1:])

  with kernels.backend("reference"):
    # two linears, then kernels.swiglu_quantize
    with linear_ablation.ablation(swiglu_quantize="fused"):
      loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    with linear_ablation.ablation(swiglu_quantize="gemm_epilogue"):   # the default
      loss_e, grads_e = jax.jit(jax.value_and_grad(loss_fn))(params)
  assert np.isfinite(float(loss)) and float(loss_e) == float(loss)
  for a, b in zip(jax.tree.leaves(grads_e), jax.tree.leaves(grads)):
    assert np.all(np.isfinite(np.asarray(a))) and float(jnp.max(jnp.abs(b))) > 0
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
def test_gpu_kernel_matches_float64():
  x, wg, wu = _operands(2048, 1024, 512, seed=9)
  out = jax.jit(lambda a, b, c: _run_kernel(a, b, c, interpret=False))(x, wg, wu)
  # FP8 wgmma accumulates with a narrow adder (~1e-4 relative to the products' size, see
  # test_kernels_matmul), so h and the codes are checked against the GEMM kernel's own float32
  # products, which are checked against float64; exp's and the division's ulps: h to 2^-7
  gemm = jax.jit(lambda a, b, s: fm.fp8_matmul_tn(a, b, s, jnp.float32))
  g32, u32 = (np.asarray(gemm(x, w, jnp.float32(s)), np.float64) for w, s in zip((wg, wu), SCALES))
  for p32, p64 in zip((g32, u32), _products64(x, wg, wu)):
    assert np.linalg.norm(p32 - p64) / np.linalg.norm(p64) < 1e-3
  _check_kernel(out, g32, u32, h_rtol=2.0 ** -7, max_steps=1)
  _check_nan_row(interpret=False)


@pytest.mark.gpu
def test_gpu_op_against_float64_no_worse_than_the_default_path():
  test_op_against_float64_no_worse_than_the_default_path()


def test_weight_codes_t_are_the_transposed_codes_of_the_weight_from_the_kernel():
  """`ops.swiglu.weight_codes_t` (the quantize kernel in Mosaic GPU interpret mode writing W^T's
  codes): W's amax, the reference's per-tensor E4M3 scale, and codes equal to the reference's
  quantize of the bf16 W, transposed, bit for bit; the kernel runs (its refs in the trace)."""
  from coat_jax import quantize
  from coat_jax.ops.swiglu import weight_codes_t
  seed = 20261128
  print(f"seed {seed}")
  rng = np.random.default_rng(seed)
  w = jnp.asarray(0.05 * rng.standard_normal((256, 384)), jnp.float32)
  codes_t = lambda w: weight_codes_t(w, jnp.bfloat16)
  with kernels.backend("quantize=mosaic"):
    amax, q = jax.jit(codes_t)(w)
    assert "Ref<gmem>" in str(jax.make_jaxpr(codes_t)(w))   # the kernel's global-memory refs
  with kernels.backend("quantize=reference"):
    assert "Ref<gmem>" not in str(jax.make_jaxpr(codes_t)(w))
  wb = w.astype(jnp.bfloat16)
  assert float(amax) == float(jnp.max(jnp.abs(wb.astype(jnp.float32)))) > 0
  ref = jax.jit(lambda wb, a: quantize.quantize_per_tensor(wb, "e4m3", amax=a))(wb, amax)
  assert q.data.shape == (384, 256) and q.data.dtype == jnp.float8_e4m3fn
  assert float(q.scale) == float(ref.scale)
  codes, ref_t = np.asarray(q.data, np.float32), np.asarray(ref.data, np.float32).T
  assert np.abs(codes).max() > 0
  np.testing.assert_array_equal(codes, ref_t)
