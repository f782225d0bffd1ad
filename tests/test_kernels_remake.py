"""The remake kernel (pallas_kernels/quantize/remake_triton.py: a linear input's transposed
per-tensor codes from RMSNorm's or SwiGLU's 1 x 16 codes) in Triton's interpreter on CPU, the same
@triton.jit source the GPU compiles (tests/triton_interpreter.py), and through jax-triton on the
GPU (marked gpu), against the dispatch's unfused path (`kernels.remade_codes_t(how="kernel")` on
the jnp references): the codes equal but where the float32 math's last bits (exp, division) move
one across a rounding boundary; NaN groups stay NaN; values past the forward's amax saturate.

CI installs triton (the test extra): where CI is set, a missing triton fails these."""
import os

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from coat_jax import formats, kernels, quantize

rt = pytest.importorskip("pallas_kernels.quantize.remake_triton")
G = 16


@pytest.fixture(scope="module")
def interp():
  from tests import triton_interpreter
  triton_interpreter.require_triton()
  return triton_interpreter


def _case(kind, shape, seed, nan=False):
  """remade_codes_t's arrays for `kind`: random codes of `shape` (..., K)."""
  rng = np.random.default_rng(seed)
  print(f"{kind} {shape} seed {seed} nan {nan}")

  def codes(scale):
    x = rng.standard_normal(shape).astype(np.float32) * scale
    if nan:
      x[(0,) * (len(shape) - 1) + (3,)] = np.nan   # one group of the first row
    return quantize.quantize_per_group(jnp.asarray(x), G, "e4m3")

  if kind == "rmsnorm":
    xg = codes(3.0)
    rstd = jnp.asarray(rng.uniform(0.5, 2.0, shape[:-1] + (1,)).astype(np.float32))
    w = jnp.asarray(1 + 0.2 * rng.standard_normal(shape[-1]), jnp.bfloat16)
    arrays = (xg, rstd, w)
  else:
    arrays = (codes(3.0), codes(1.0))
  return arrays


def _reference(kind, arrays, amax):
  with kernels.backend("reference"):
    return np.asarray(kernels.remade_codes_t(kind, arrays, amax, jnp.bfloat16, how="kernel"))


def _x_amax(kind, arrays):
  """max|x| of the remade x (the forward's amax), from the references' math."""
  if kind == "rmsnorm":
    xg, rstd, w = arrays
    x = quantize.dequantize(xg, jnp.float32) * rstd * w.astype(jnp.float32)
  else:
    from coat_jax import activations
    x = activations.silu_product(*(quantize.dequantize(q, jnp.float32) for q in arrays))
  return jnp.nanmax(jnp.abs(x.astype(jnp.bfloat16).astype(jnp.float32)))


def _interpreted(interp, kind, arrays, amax, block_rows, block_cols):
  codes = arrays[:1] if kind == "rmsnorm" else arrays
  shape = codes[0].data.shape
  scale = np.array(quantize.scale_from_amax(jnp.float32(amax), formats.get_format("e4m3"),
                                            formats.ACTIVATION_SCALE_FLOOR), np.float32).reshape(1)
  grid, m, consts = rt.launch_plan(shape, G, block_rows, block_cols)
  out = np.full((shape[-1], m), np.nan, np.float32).astype(ml_dtypes.float8_e4m3fn)
  ops = []
  for q in codes:
    ops += [np.array(q.data).reshape(m, -1), np.array(q.scale).reshape(m, -1)]
  if kind == "rmsnorm":
    ops += [np.array(arrays[1], np.float32).reshape(m), np.array(arrays[2])]
  interp.launch(rt.KERNELS[kind], grid, scale, *ops, m, out, FMAX=448.0, **consts)
  return out


def _assert_codes_close(got, want, what):
  g, w = got.astype(np.float32), want.astype(np.float32)
  assert g.shape == w.shape, (what, g.shape, w.shape)
  assert np.array_equal(np.isnan(g), np.isnan(w)), f"{what}: NaN where the reference has none"
  both = ~np.isnan(w)
  exact = np.mean(g[both] == w[both])
  # one code step at most: the neighbouring E4M3 value (relative step 2^-3 at most)
  step = np.abs(g[both] - w[both]) <= 0.125 * np.abs(w[both]) + 2.0**-9
  print(f"{what}: {exact:.5f} of the codes equal, {np.mean(step):.5f} within a step, "
        f"{np.isnan(w).sum()} NaN")
  assert exact >= 0.999 and step.all(), what
  assert np.abs(w[both]).max() > 0


@pytest.mark.parametrize("kind", rt.KINDS)
@pytest.mark.parametrize("shape,blocks", [((128, 192), (64, 64)),
                                          ((2, 64, 256), (128, 128)),
                                          ((64, 384), (rt.BLOCK_ROWS, None)),    # the default tile
                                          ((64, 320), (rt.BLOCK_ROWS, None))])   # its 64 columns
def test_interpreted_kernel_matches_the_unfused_path(interp, kind, shape, blocks):
  arrays = _case(kind, shape, seed=11)
  amax = _x_amax(kind, arrays)
  got = _interpreted(interp, kind, arrays, amax, *blocks)
  want = _reference(kind, arrays, amax)
  _assert_codes_close(got, want, f"{kind} {shape}")
  assert np.mean(np.abs(want.astype(np.float32)) >= 224) > 0   # the top binade is reached


@pytest.mark.parametrize("kind", rt.KINDS)
def test_interpreted_kernel_keeps_nan_and_saturates(interp, kind):
  """A NaN stays NaN; with half the amax, values past it saturate at 448."""
  arrays = _case(kind, (128, 128), seed=12, nan=True)
  amax = 0.5 * _x_amax(kind, arrays)
  got = _interpreted(interp, kind, arrays, amax, 64, 64)
  want = _reference(kind, arrays, amax)
  _assert_codes_close(got, want, f"{kind} NaN / saturated")
  g = got.astype(np.float32)
  assert np.isnan(g[3, 0]) and np.isfinite(g[:, 1:]).all()   # x[0, 3] was NaN
  assert np.nanmax(np.abs(g)) == 448.0 and np.sum(np.abs(g) == 448.0) >= 10


def test_problem_names_the_shape():
  assert "multiple of the tile's 64 columns" in rt.problem((128, 96), G, 128, 64)
  assert "rows are not a positive multiple" in rt.problem((100, 128), G, 128, 64)
  assert "below 2^31" in rt.problem((2**17, 2**14), G, 128, 64)
  assert rt.problem((2, 64, 128), G, 128, 64) is None
  # the default tile: 128 columns, 64 where the last axis is no multiple of 128
  assert rt.launch_plan((64, 384), G)[2]["BK"] == 128
  assert rt.launch_plan((64, 320), G)[2]["BK"] == 64
  assert rt.problem((64, 320), G) is None and "columns" in rt.problem((64, 96), G)


def test_fused_falls_back_where_no_kernel_runs():
  """On CPU (no jax-triton) "fused" is the unfused path; the kernel entry refuses clearly."""
  arrays = _case("swiglu", (64, 128), seed=13)
  amax = _x_amax("swiglu", arrays)
  with kernels.backend("reference"):
    fused = kernels.remade_codes_t("swiglu", arrays, amax, jnp.bfloat16, how="fused")
  np.testing.assert_array_equal(np.asarray(fused, np.float32),
                                _reference("swiglu", arrays, amax).astype(np.float32))
  if not rt.available():
    with pytest.raises(ValueError, match="not installed"):
      rt.remake_transposed("swiglu", jnp.float32(1), (arrays[0].data, arrays[1].data),
                           (arrays[0].scale, arrays[1].scale), group_size=G,
                           out_dtype=jnp.float8_e4m3fn, fmax=448.0)
  with pytest.raises(ValueError, match="kind must be one of"):
    kernels.remade_codes_t("gelu", arrays, amax, jnp.bfloat16)


@pytest.mark.parametrize("kind", rt.KINDS)
def test_kernel_compiles_for_sm90_as_the_gpu_runs_it(interp, kind, tmp_path):
  """The default tile compiled for sm_90 on CPU (triton and its bundled ptxas): the GPU's
  instructions where the interpreter runs numpy: XLA's division (div.full.f32), NaN-propagating
  clamps, the saturating FP8 convert, and 16-byte loads and stores (the transposed tile's
  stores run along M)."""
  import re
  import subprocess
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource
  kernel = rt.KERNELS[kind]
  types = dict(scale="*fp32", q="*fp8e4nv", s="*bf16", rstd="*fp32", w="*bf16", gq="*fp8e4nv",
               gs="*bf16", uq="*fp8e4nv", us="*bf16", out="*fp8e4nv")
  sig = {n: types[n[:-4]] if n.endswith("_ptr") else "i32" if n == "M" else "constexpr"
         for n in kernel.arg_names}
  _, _, const = rt.launch_plan((16384, 4096 if kind == "rmsnorm" else 11008), G)
  attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
           if sig[n] != "constexpr"}
  k = triton.compile(ASTSource(kernel, sig, dict(const, FMAX=448.0), attrs),
                     target=GPUTarget("cuda", 90, 32),
                     options=dict(num_warps=rt.WARPS, num_stages=1))
  ptx = k.asm["ptx"]
  counts = {op: len(re.findall(re.escape(op), ptx)) for op in (
      "div.full.f32", "div.rn.f32", "min.NaN.f32", "max.NaN.f32", "cvt.rn.satfinite.e4m3x2.f32",
      "ld.global.v4", "st.global.v4", "st.global.b8", "st.global.b16")}
  print(kind, counts)
  assert counts["div.full.f32"] > 0 and counts["div.rn.f32"] == 0
  assert counts["min.NaN.f32"] > 0 and counts["max.NaN.f32"] > 0
  assert counts["cvt.rn.satfinite.e4m3x2.f32"] > 0
  assert counts["ld.global.v4"] > 0 and counts["st.global.v4"] > 0
  assert counts["st.global.b8"] == counts["st.global.b16"] == 0
  (tmp_path / "k.ptx").write_text(ptx)
  ptxas = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "ptxas")
  subprocess.run([ptxas, "-arch=sm_90a", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                 capture_output=True, text=True, check=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", rt.KINDS)
@pytest.mark.parametrize("shape", [(2, 256, 4096), (512, 11008)])
@pytest.mark.parametrize("partitioning", ["auto", "always"])
def test_gpu_kernel_matches_the_unfused_path(kind, shape, partitioning):
  """jax-triton on the GPU against the unfused path on the same GPU (XLA's math, the quantize
  kernel); `always`: the kernel inside the mesh wrapper (sharded.rows_to_columns)."""
  if not rt.available():
    pytest.fail("jax-triton is not installed on the GPU machine (carry .whl)")
  arrays = _case(kind, shape, seed=14, nan=True)
  amax = _x_amax(kind, arrays)
  with kernels.backend("pallas"), kernels.partitioning(partitioning):
    fused = jax.jit(lambda a, m: kernels.remade_codes_t(kind, a, m, jnp.bfloat16, how="fused"))
    got, txt = fused(arrays, amax), fused.lower(arrays, amax).as_text()
    want = jax.jit(lambda a, m: kernels.remade_codes_t(kind, a, m, jnp.bfloat16,
                                                       how="kernel"))(arrays, amax)
  assert "triton" in txt.lower()   # the kernel ran, not the fallback
  _assert_codes_close(np.asarray(got), np.asarray(want), f"GPU {kind} {shape}")


def _standin_remake(calls, kind, scale, codes, scales, extra=(), *, group_size, out_dtype, fmax,
                    **_):
  """remake_transposed's contract in XLA's ops (the kernel needs jax-triton and a GPU): the
  remade x, rounded to bf16, divided by the scale, saturated and transposed; the call's local
  shape recorded."""
  calls.append(codes[0].shape)
  vals = [quantize.dequantize(quantize.QuantizedArray(q, s, "e4m3", group_size), jnp.float32)
          for q, s in zip(codes, scales)]
  if kind == "rmsnorm":
    x = vals[0] * extra[0][:, None] * extra[1].astype(jnp.float32)
  else:
    from coat_jax import activations
    x = activations.silu_product(*vals)
  x = x.astype(jnp.bfloat16).astype(jnp.float32)
  return formats.saturating_cast(x / scale, formats.get_format("e4m3")).T


@pytest.mark.parametrize("kind", rt.KINDS)
@pytest.mark.parametrize("shape,spec,local", [
    ((8, 64, 256), ("data",), (128, 256)),             # rows split 4 ways: the kernel per shard
    ((512, 256), ("data", "tensor"), (128, 256)),      # K split too: gathered, rows kept split
    ((4, 48, 256), ("data",), None)],                  # 48-row shards: the reference per shard
    ids=["rows", "rows-and-k", "reference-shards"])
def test_fused_remake_runs_per_shard_on_a_mesh(monkeypatch, kind, shape, spec, local):
  """On a mesh "fused" runs the kernel on each device's rows (sharded.rows_to_columns; the kernel
  replaced by its XLA contract, as on a GPU): x^T's columns split like the rows, no collective
  where only the rows are split, and the codes those of the unfused path on one device."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  from coat_jax.kernels import backends
  calls = []
  monkeypatch.setattr(rt, "available", lambda: True)
  monkeypatch.setattr(rt, "remake_transposed", lambda *a, **k: _standin_remake(calls, *a, **k))
  monkeypatch.setattr(backends, "interpret_mode", lambda: False)
  arrays = _case(kind, shape, seed=15)
  amax = _x_amax(kind, arrays)
  want = _reference(kind, arrays, amax)
  mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)

  def put(a):   # each array split like the codes on the axes it shares with them
    s = tuple(spec[:a.ndim - 1]) + (None,) * (a.ndim - 1 - len(spec[:a.ndim - 1]))
    s += (spec[len(shape) - 1] if len(spec) == len(shape) and a.shape[-1] == shape[-1]
          else None,) if a.ndim else ()
    return jax.device_put(a, NamedSharding(mesh, P(*s[:a.ndim])))

  sharded_arrays = jax.tree.map(put, arrays)
  f = jax.jit(lambda a, m: kernels.remade_codes_t(kind, a, m, jnp.bfloat16))
  with kernels.backend("pallas"):
    assert backends.per_shard()
    got = f(sharded_arrays, amax)
    hlo = f.lower(sharded_arrays, amax).compile().as_text()
  m = int(np.prod(shape[:-1]))
  # traced at the global shape for the result's shape, then per shard
  assert set(calls) == ({(m, shape[-1]), local} if local else {(m, shape[-1])}), calls
  _assert_codes_close(np.asarray(got), want, f"{kind} {shape} on a 4 x 2 mesh")
  assert got.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "data")), 2)
  if spec == ("data",):
    for op in ("all-gather", "all-to-all", "collective-permute"):
      assert op not in hlo, op
