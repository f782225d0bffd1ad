"""The jax-triton Adam step (pallas_kernels/adam/adam_step_triton.py) on the GPU, checked against the
float64 step of tests/adam_float64.py in both group layouts: group_axis -1 (rows of G) and -2
(G rows of each column, COAT's layout); its launch plans and sm_90 registers on CPU. The same
kernels run in Triton's interpreter on CPU in tests/test_kernels_adam_interpreter.py. The column
layout's jnp reference (adam_math.adam_step_reference(group_axis=-2)) is checked on CPU against
the float64 step too."""
import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from coat_jax.adam_math import adam_step_reference
from coat_jax.expansion import ExpandedMoment
from pallas_kernels.adam import adam_step_triton as at
from tests import adam_float64 as ref
from tests.adam_float64 import EM, G, HYPER

needs_triton = pytest.mark.skipif(at.triton is None, reason="triton is not installed")


def test_cpu_without_triton_refuses_clearly():
  if at.available():
    pytest.skip("triton is installed here")
  f8 = jnp.float8_e4m3fn
  assert not at.supported((64, 128), jnp.float32, f8, f8, G)
  z = jnp.zeros((64, 128))
  with pytest.raises(ValueError, match="not installed"):
    at.adam_step(z, z, z.astype(f8), jnp.ones((64, 1)), jnp.ones((64, 1), jnp.uint8),
                 z.astype(f8), jnp.ones((64, 1)), jnp.ones((64, 1), jnp.uint8),
                 count=jnp.int32(1), m_fmax=448.0, v_fmax=448.0, m_log2_range=16.6,
                 v_log2_range=16.6, group_size=G, expand=True, expand_min=EM, **HYPER)


def test_problem_names_the_shape():
  f8 = jnp.float8_e4m3fn
  assert "multiple of 128" in at.problem((64, 100), jnp.float32, f8, f8, G)
  assert "not FP8" in at.problem((64, 128), jnp.float32, jnp.int8, f8, G)
  assert at.problem((3, 128), jnp.float32, f8, f8, G) is None   # any row count
  assert "second-to-last axis" in at.problem((100, 128), jnp.float32, f8, f8, G, -2)
  assert "second-to-last axis" in at.problem((128,), jnp.float32, f8, f8, G, -2)
  assert at.problem((2, 256, 40), jnp.float32, f8, f8, G, -2) is None   # any column count
  assert "group axis -3" in at.problem((128, 128, 128), jnp.float32, f8, f8, G, -3)
  assert "below 2^31" in at.problem((128, 2**24), jnp.float32, f8, f8, G, -2)
  assert at.problem((128, 2**24), jnp.float32, f8, f8, G) is None


def _case(shape, axis, seed, m_fmt="e4m3", v_fmt="e4m3", output="param", expand=True):
  """(p, g, m state, v state, float64 step) of a leaf grouped along `axis`."""
  p, g, m0, v0 = ref.state(shape, seed)
  m_state = ref.quantize(m0, m_fmt, expand, axis)[:3]
  v_state = ref.quantize(v0, v_fmt, expand, axis)[:3]
  want = ref.step(p, g, m_state, v_state, 3, m_fmt, v_fmt, expand, output, axis)
  return p, g, m_state, v_state, want


@pytest.mark.parametrize("shape,output", [((2, 256, 40), "param"), ((128, 96), "update")])
def test_reference_cols_matches_float64(shape, output):
  """The jnp reference step grouped along axis -2 (stacked and plain kernels, a column count
  that is no multiple of anything) against the float64 step."""
  p, g, m_state, v_state, want = _case(shape, -2, 37, output=output)
  step = jax.jit(lambda p, g, m, v: adam_step_reference(
      p, g, m, v, count=jnp.int32(3), m_format="e4m3", v_format="e4m3", group_size=G,
      expand=True, expand_min=EM, output=output, group_axis=-2, **HYPER))
  new_p, new_m, new_v = step(jnp.asarray(p), jnp.asarray(g),
                             ExpandedMoment(*map(jnp.asarray, m_state)),
                             ExpandedMoment(*map(jnp.asarray, v_state)))
  got = [np.asarray(a) for a in (new_p, *new_m, *new_v)]
  ref.check_step(got, want, p, -2, output, off_by_one=0.01, rel_tol=1e-4)


def _gpu_step(p, g, m_state, v_state, axis, m_fmt="e4m3", v_fmt="e4m3", output="param",
              expand=True, **kw):
  """at.adam_step as coat_adamw calls it (fast math), E4M3 / E5M2 limits, step 3."""
  fm, fv = ref.FORMATS[m_fmt][1], ref.FORMATS[v_fmt][1]
  got = at.adam_step(None if p is None else jnp.asarray(p), jnp.asarray(g),
                     *map(jnp.asarray, m_state), *map(jnp.asarray, v_state), count=jnp.int32(3),
                     m_fmax=fm, v_fmax=fv, m_log2_range=ref.log2_range(m_fmt),
                     v_log2_range=ref.log2_range(v_fmt), group_size=G, expand=expand,
                     expand_min=EM, output=output, group_axis=axis, fast_math=True,
                     **{**HYPER, **kw})
  return [np.asarray(a) for a in got]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,axis,fmts,output,param_dtype", [
    ((300, 1024), -1, ("e4m3", "e4m3"), "param", np.float32),
    ((7, 128), -1, ("e4m3", "e5m2"), "update", np.float32),
    ((64, 512), -1, ("e4m3", "e4m3"), "param", ml_dtypes.bfloat16),
    ((2, 256, 200), -2, ("e4m3", "e4m3"), "param", np.float32),   # last column tile masked
    ((384, 96), -2, ("e5m2", "e5m2"), "update", np.float32),
    ((256, 512), -2, ("e4m3", "e4m3"), "param", np.float32),      # EVEN
    ((128, 256), -2, ("e4m3", "e5m2"), "param", ml_dtypes.bfloat16),
])
def test_gpu_matches_float64_reference(shape, axis, fmts, output, param_dtype):
  p, g, m_state, v_state, _ = _case(shape, axis, 31, *fmts, output)
  p = p.astype(param_dtype)
  lr = 0.05 if param_dtype != np.float32 else HYPER["lr"]   # bfloat16: steps that cross ulps
  want = ref.step(p, g, m_state, v_state, 3, *fmts, True, output, axis,
                  hyper=dict(HYPER, lr=lr))
  got = _gpu_step(p, g, m_state, v_state, axis, *fmts, output, lr=lr)
  ref.check_step(got, want, p, axis, output, off_by_one=0.01, rel_tol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("group_axis", [-1, -2])
def test_gpu_grad_scale_equals_prescaled_gradient(group_axis):
  """grad_scale (fused clipping) gives the step on grad_scale * g (float32 rounding: the scaled
  gradient is rounded once either way), and differs from the unscaled step."""
  p, g, m_state, v_state, _ = _case((256, 384), group_axis, 53)
  scale = jnp.float32(0.3)
  fused = _gpu_step(p, g, m_state, v_state, group_axis, grad_scale=scale)
  pre = _gpu_step(p, np.asarray(jnp.asarray(g) * scale), m_state, v_state, group_axis)
  plain = _gpu_step(p, g, m_state, v_state, group_axis)
  np.testing.assert_allclose(fused[0], pre[0], rtol=1e-6, atol=0)
  for i in (1, 2, 3, 4, 5, 6):   # moments: amax to float32 rounding, codes and k (nearly) equal
    a, b = fused[i], pre[i]
    if a.dtype == np.float32:
      np.testing.assert_allclose(a, b, rtol=1e-6)
    else:
      assert np.mean(a.astype(np.float32) == b.astype(np.float32)) > 0.999
  step = pre[0] - p
  assert np.linalg.norm(plain[0] - pre[0]) / np.linalg.norm(step) > 1e-2


OLMO_1B_LEAVES = [(16, 2048, 2048), (16, 2048, 8192), (16, 8192, 2048), (50304, 2048),
                  (16, 2048), (4096, 11008)]


@pytest.mark.parametrize("group_axis,block", [(-1, 16), (-2, 32), (-2, 128)])
def test_runtime_size_needs_one_compile_for_every_leaf(group_axis, block):
  """size_arg "runtime": every OLMo-1B leaf (and 4096 x 11008) gets the same kernel and
  constexprs (jax-triton compiles once per kernel, signature and constexprs), EVEN (no masks),
  column stride alignment CDIV 16; "constexpr" one set per leaf size; the size operand is the
  rows of G or the columns / CDIV."""
  leaves = [s for s in OLMO_1B_LEAVES if at.problem(s, jnp.float32, jnp.float8_e4m3fn,
                                                    jnp.float8_e4m3fn, G, group_axis) is None]
  assert len(leaves) == (6 if group_axis == -1 else 5)
  plans = [at.launch_plan(s, G, group_axis, block, "runtime") for s in leaves]
  assert len({(k, tuple(sorted(c.items()))) for k, _, _, c in plans}) == 1
  assert plans[0][3]["EVEN"]
  for s, (_, grid, size, consts) in zip(leaves, plans):
    n = int(np.prod(s))
    if group_axis == -1:
      assert (size, grid) == (n // G, n // G // block)
    else:
      assert consts["CDIV"] == 16 and size * 16 == s[-1]
      assert grid == n // (G * s[-1]) * (s[-1] // block)
  old = {tuple(sorted(at.launch_plan(s, G, group_axis, block, "constexpr")[3].items()))
         for s in leaves}
  assert len(old) == len({s[-1] if group_axis == -2 else np.prod(s) for s in leaves})


def test_launch_plan_masks_and_refuses_clearly():
  rows = at.launch_plan((7, 256), G, -1, 4, size_arg="runtime")
  assert rows[1:] == (4, 14, dict(ROWS=0, EVEN=False))
  assert at.launch_plan((7, 256), G, -1, 2, size_arg="runtime")[3]["EVEN"]
  assert not at.launch_plan((8, 256), G, -1, 4, size_arg="runtime_masked")[3]["EVEN"]
  assert at.launch_plan((8, 256), G, -1, 4, size_arg="constexpr")[3] == dict(ROWS=16, EVEN=False)
  cols = at.launch_plan((2, 256, 72), G, -2, 32, "runtime", vec=4)
  assert cols[1:] == (2 * 2 * 3, 9, dict(COLS=0, CDIV=8, EVEN=False, VEC=4))
  assert at.launch_plan((256, 40), G, -2, 8, "runtime")[3]["EVEN"]
  assert at.pow2_divisor(11008) == 16 and at.pow2_divisor(40) == 8 and at.pow2_divisor(7) == 1
  with pytest.raises(ValueError, match="size_arg"):
    at.launch_plan((256, 64), G, -1, 16, size_arg="static")


def test_parse_tiles():
  assert at.parse_tiles("32x4, 128x8,") == [(32, 4), (128, 8)]
  assert at.parse_tiles("") == []
  for bad in ("32", "48x4", "32x4x4", "64xax4", "0x4"):
    with pytest.raises(ValueError, match="BLOCKxWARPS"):
      at.parse_tiles(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("group_axis", ["coat", "last"])
def test_gpu_fused_clip_matches_chain(group_axis):
  """coat_adamw(max_grad_norm) and coat_adamw_apply(max_grad_norm) through the jax-triton kernel
  (the scale in the step scalars) against chain(clip_by_global_norm, coat_adamw) + apply_updates,
  in relative L2 of the param change (see tests/test_optim_clip.py for the tolerance)."""
  import optax
  from coat_jax import kernels
  from coat_jax.optim import coat_adamw, coat_adamw_apply
  rng = np.random.default_rng(59)
  print("seed 59")
  params = {"w": jnp.asarray(rng.standard_normal((512, 256)), jnp.float32) * 0.1,
            "u": jnp.asarray(rng.standard_normal((256, 384)), jnp.float32) * 0.1}
  kw = dict(weight_decay=0.1, group_axis=group_axis)
  with kernels.backend("adam=pallas"):
    chain = optax.chain(optax.clip_by_global_norm(1.0), coat_adamw(1e-2, **kw))
    fused = coat_adamw(1e-2, max_grad_norm=1.0, **kw)
    apply = jax.jit(coat_adamw_apply(1e-2, max_grad_norm=1.0, **kw))
    kernel = "triton_kernel_call" if jax.default_backend() == "gpu" else "pallas_call"
    assert kernel in str(jax.make_jaxpr(apply)(params, fused.init(params), params))
    want, got_u, got_a = params, params, params
    sw, su, sa = chain.init(params), fused.init(params), fused.init(params)
    for norm in (40.0, 0.3, 7.0):
      g = {k: jnp.asarray(rng.standard_normal(p.shape), jnp.float32) for k, p in params.items()}
      g = jax.tree.map(lambda x: x * (norm / optax.tree.norm(g)), g)
      u, sw = jax.jit(chain.update)(g, sw, want)
      want = optax.apply_updates(want, u)
      u, su = jax.jit(fused.update)(g, su, got_u)
      got_u = optax.apply_updates(got_u, u)
      got_a, sa = apply(g, sa, got_a)
  for k in params:
    change = np.asarray(want[k]) - np.asarray(params[k])
    for got in (got_u, got_a):
      rel = np.linalg.norm(np.asarray(got[k]) - np.asarray(want[k])) / np.linalg.norm(change)
      assert rel < 5e-3, (k, rel)


def _one_leaf_case(group_axis: int, seed: int, **extra):
  """(args, kwargs) of one at.adam_step on a small E4M3 leaf grouped along `group_axis`."""
  p, g, m_state, v_state, _ = _case((96, 384) if group_axis == -1 else (256, 96), group_axis,
                                    seed)
  kw = dict(count=jnp.int32(3), m_fmax=448.0, v_fmax=448.0, m_log2_range=ref.log2_range("e4m3"),
            v_log2_range=ref.log2_range("e4m3"), group_size=G, expand=True, expand_min=EM,
            output="param", group_axis=group_axis, **HYPER, **extra)
  args = [jnp.asarray(p), jnp.asarray(g), *map(jnp.asarray, m_state), *map(jnp.asarray, v_state)]
  return args, kw


@pytest.mark.gpu
@pytest.mark.parametrize("group_axis", [-1, -2])
def test_gpu_kernel_compiled_in_a_worker_process_equals_the_one_compiled_in_the_lowering(
    group_axis, monkeypatch):
  """compile_triton's worker builds the kernel jax-triton builds in the lowering: bit-identical
  results, and the worker's kernel is the one the step ran."""
  from pallas_kernels.compile_ahead import compile_triton
  args, kw = _one_leaf_case(group_axis, seed=67, num_warps=2)   # a compile no other test makes
  results = {}
  for mode in ("inline", "process"):
    monkeypatch.setattr(compile_triton, "MODE", mode)
    jax.clear_caches()
    before = dict(compile_triton.stats)
    results[mode] = [np.asarray(a) for a in jax.jit(lambda *a: at.adam_step(*a, **kw))(*args)]
    if mode == "process":
      assert compile_triton.stats["from_worker"] == before["from_worker"] + 1
      assert compile_triton.stats["worker_failed"] == before["worker_failed"]
  assert np.isfinite(results["process"][0]).all()
  for a, b in zip(results["process"], results["inline"]):
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _sm90_registers(kernel, sizes: dict, block: int, num_warps: int, seg: int, tmp_path,
                    seg_arg_one: bool = False) -> int:
  """Registers per thread of `kernel` compiled for sm_90 (triton's bundled ptxas -v).
  seg_arg_one: seg_arg is the constant 1, as jax-triton passes a scalar argument equal to 1."""
  import os
  import re
  import subprocess
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource
  types = dict(p="*fp32", g="*fp32", mq="*fp8e4nv", ma="*fp32", mk="*u8", vq="*fp8e4nv",
               va="*fp32", vk="*u8", o="*fp32", mqo="*fp8e4nv", mao="*fp32", mko="*u8",
               vqo="*fp8e4nv", vao="*fp32", vko="*u8", s="*fp32")
  sig = {n: types[n[:-4]] if n.endswith("_ptr") else "i32" if n.endswith("_arg") else "constexpr"
         for n in kernel.arg_names}
  if seg_arg_one:
    sig["seg_arg"] = "constexpr"
  const = dict(**sizes, SEG=seg, **({"seg_arg": 1} if seg_arg_one else {}), **at.kernel_constants(
      G, block, has_param=True, output="param", m_fmax=448.0, v_fmax=448.0,
      m_log2_range=ref.log2_range("e4m3"), v_log2_range=ref.log2_range("e4m3"), expand=True,
      expand_min=EM, max_k_code=255, amax_floor=1e-30, grad_clamp=2.0**63, fast_math=True))
  attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
           if sig[n].startswith("*")}
  k = triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                     options=dict(num_warps=num_warps, num_stages=1))
  ptx = tmp_path / f"k{seg}.ptx"
  ptx.write_text(k.asm["ptx"])
  ptxas = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "ptxas")
  run = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(tmp_path / "k.cubin")],
                       capture_output=True, text=True, check=True)
  return int(re.search(r"Used (\d+) registers", run.stdout + run.stderr).group(1))


@needs_triton
@pytest.mark.parametrize("group_axis", [-1, -2])
def test_packed_slot_costs_no_registers_on_sm90(group_axis, tmp_path, monkeypatch):
  """Stepping a packed slot (SEG > 0) compiles to at most one register allocation unit (8 per
  thread) more than the per-leaf kernel: registers cost occupancy (H100: moving all 12 moment
  pointers took the row kernel from 80 to 95 registers and ran 2.5 % slower; sm_90 today: rows
  72 per leaf, 80 packed; columns equal)."""
  monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
  if group_axis == -1:
    kernel, sizes = at._adam_kernel, dict(ROWS=0, EVEN=True)
    block, warps = at.ROWS_BLOCK, at.ROWS_WARPS
  else:
    kernel, sizes = at._adam_cols_kernel, dict(COLS=0, CDIV=16, EVEN=True, VEC=at.COLS_VEC)
    block, warps = at.COLS_BLOCK, at.COLS_WARPS
  leaf = _sm90_registers(kernel, sizes, block, warps, 0, tmp_path)
  packed = _sm90_registers(kernel, sizes, block, warps, 16, tmp_path)
  print(f"group_axis {group_axis}: {leaf} registers per leaf, {packed} packed")
  assert packed <= leaf + 8, (leaf, packed)
  # a slot at group 16 (seg_arg 1): jax-triton makes that argument a constant; it must compile
  assert _sm90_registers(kernel, sizes, block, warps, 16, tmp_path, seg_arg_one=True) > 0
