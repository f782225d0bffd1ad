"""The jax-triton Adam kernels (pallas_kernels/adam/adam_step_triton.py: the row kernel, group_axis -1,
and the column kernel, group_axis -2, which coat_adamw's default layout runs on the GPU) in
Triton's interpreter on CPU, the same @triton.jit source the GPU compiles (tests/
triton_interpreter.py), against the float64 step of tests/adam_float64.py: both layouts, masked
and whole (EVEN) tiles, E4M3 / E5M2 moments with and without expansion, float32 and bfloat16
params (rounded to nearest, as the kernel stores them), the param or the update (without a
param: no decay), the fused gradient scale, fast math (its MUFU instructions as float32 numpy)
and precise math, in place (aliased) and in packed moment buffers.

CI installs triton (the test extra) for these: where the environment variable CI is set, a
missing triton fails them instead of skipping."""

import ml_dtypes
import numpy as np
import pytest

from tests import adam_float64 as ref
from tests.adam_float64 import EM, G, HYPER

at = pytest.importorskip("pallas_kernels.adam.adam_step_triton")


def test_ci_has_triton():
  """CI must run the GPU's default kernels: triton (pip install -e .[test]) is required there."""
  from tests import triton_interpreter
  triton_interpreter.require_triton()


@pytest.fixture(scope="module")
def ik():
  """adam_step_triton, whose kernels `_run` launches in the interpreter."""
  from tests import triton_interpreter
  triton_interpreter.require_triton()
  return at


def _poisoned(like):
  """An output buffer of like's shape and dtype filled with NaN (never a valid result)."""
  return np.full(like.shape, np.nan, np.float32).astype(like.dtype)


def _run(ik, shape, axis, *, m_fmt="e4m3", v_fmt="e4m3", param_dtype=np.float32,
         output="param", has_param=True, expand=True, fast=True, grad_scale=None, block=None,
         size_arg="runtime", in_place=False, packed_at=None, hyper=HYPER, seed=0):
  """One kernel launch in the interpreter on a leaf of `shape` grouped along `axis`; returns
  (got: [out, m codes, m amax, m k, v codes, v amax, v k], float64 reference, p)."""
  from tests import triton_interpreter
  p, g, m0, v0 = ref.state(shape, seed)
  p = p.astype(param_dtype)
  m_state = ref.quantize(m0, m_fmt, expand, axis)[:3]
  v_state = ref.quantize(v0, v_fmt, expand, axis)[:3]
  scale = 1.0 if grad_scale is None else float(np.float32(grad_scale))
  want = ref.step(p if has_param else None, g, m_state, v_state, 3, m_fmt, v_fmt, expand, output,
                  axis, scale, hyper)
  kernel, grid, size, consts = ik.launch_plan(shape, G, axis, block, size_arg)
  if block is None:
    block = ik.ROWS_BLOCK if axis == -1 else ik.COLS_BLOCK
  print(f"{shape} axis {axis} {m_fmt}/{v_fmt} {np.dtype(param_dtype).name} {output} expand "
        f"{expand} fast {fast} scale {grad_scale} block {block} {size_arg}: grid {grid} {consts}")
  scalars = np.array(ik.step_scalars(count=3, grad_scale=grad_scale, **hyper), np.float32)
  moments = [np.ascontiguousarray(a) for a in (*m_state, *v_state)]
  groups = moments[1].size
  seg = seg_arg = 0
  if packed_at is not None:   # the leaf's slot in longer buffers of sentinels, stepped in place
    seg, seg_arg = 16, packed_at // 16
    total = packed_at + groups + 16
    bufs = []
    for a, unit in zip(moments, (G, 1, 1) * 2):
      b = np.full((total * unit,), 7, np.uint8).view(a.dtype) if a.dtype.itemsize == 1 else \
          np.full((total,), 3.25, a.dtype)
      b[packed_at * unit:(packed_at + groups) * unit] = a.reshape(-1)
      bufs.append(b)
    sentinels = [b.copy() for b in bufs]
    moments = outs_m = bufs
  elif in_place:
    outs_m = moments
  else:
    outs_m = [_poisoned(a) if a.dtype != np.uint8 else np.zeros_like(a) for a in moments]
  out_dtype = param_dtype if output == "param" else np.float32
  p_in = p.copy() if has_param else g
  out = p_in if in_place and output == "param" else _poisoned(np.zeros(shape, out_dtype))
  consts.update(ik.kernel_constants(
      G, block, has_param=has_param, output=output, m_fmax=ref.FORMATS[m_fmt][1],
      v_fmax=ref.FORMATS[v_fmt][1], m_log2_range=ref.log2_range(m_fmt),
      v_log2_range=ref.log2_range(v_fmt), expand=expand, expand_min=EM, max_k_code=255,
      amax_floor=1e-30, grad_clamp=2.0**63, fast_math=fast))
  triton_interpreter.launch(kernel, grid, scalars, p_in, g, *moments, size, seg_arg, out, *outs_m,
                            SEG=seg, **consts)
  if packed_at is not None:
    for b, old, unit in zip(outs_m, sentinels, (G, 1, 1) * 2):
      lo, hi = packed_at * unit, (packed_at + groups) * unit
      np.testing.assert_array_equal(b[:lo].view(np.uint8), old[:lo].view(np.uint8))
      np.testing.assert_array_equal(b[hi:].view(np.uint8), old[hi:].view(np.uint8))
    outs_m = [b[packed_at * u:(packed_at + groups) * u].reshape(a.shape)
              for b, u, a in zip(outs_m, (G, 1, 1) * 2, (*m_state, *v_state))]
  return [out, *outs_m], want, p


CASES = {   # id: (shape, group axis, options)
    "rows_masked": ((7, 256), -1, dict(block=4)),
    "rows_even_e5m2_scaled": ((4, 1024), -1, dict(block=8, m_fmt="e5m2", v_fmt="e5m2",
                                                  grad_scale=0.3)),
    "rows_bf16": ((8, 256), -1, dict(block=4, param_dtype=ml_dtypes.bfloat16,
                                     hyper=dict(HYPER, lr=0.05))),
    "rows_update_no_param": ((5, 128), -1, dict(block=2, output="update", has_param=False)),
    "rows_no_expansion": ((6, 256), -1, dict(block=4, expand=False, v_fmt="e5m2")),
    "rows_precise": ((3, 384), -1, dict(block=4, fast=False)),
    "rows_constexpr_size": ((7, 256), -1, dict(block=4, size_arg="constexpr")),
    "rows_packed": ((7, 256), -1, dict(block=4, packed_at=48)),
    "cols_masked_stacked": ((2, 256, 72), -2, dict(block=32)),
    "cols_even_e5m2_scaled": ((256, 64), -2, dict(block=32, m_fmt="e5m2", v_fmt="e5m2",
                                                  grad_scale=0.3)),
    "cols_bf16": ((128, 64), -2, dict(block=32, param_dtype=ml_dtypes.bfloat16,
                                      hyper=dict(HYPER, lr=0.05))),
    "cols_update_no_param": ((128, 40), -2, dict(block=16, output="update", has_param=False)),
    "cols_no_expansion": ((256, 48), -2, dict(block=32, expand=False, m_fmt="e5m2")),
    "cols_precise": ((128, 96), -2, dict(block=32, fast=False)),
    "cols_in_place_default_tile": ((128, 64), -2, dict(in_place=True)),
    "cols_constexpr_size": ((256, 40), -2, dict(block=32, size_arg="constexpr")),
    "cols_packed": ((256, 72), -2, dict(block=32, packed_at=32)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_float64_step(ik, case):
  shape, axis, kw = CASES[case]
  got, want, p = _run(ik, shape, axis, seed=sorted(CASES).index(case) + 11, **kw)
  ref.check_step(got, want, p, axis, kw.get("output", "param"))


def test_grad_scale_changes_the_step(ik):
  """The fused gradient scale is applied: the kernel with scale 0.3 is not the unscaled step
  (so `rows_even_e5m2_scaled` / `cols_even_e5m2_scaled` could fail)."""
  for axis, shape in ((-1, (2, 256)), (-2, (128, 32))):
    got, want, p = _run(ik, shape, axis, grad_scale=0.3, block=2 if axis == -1 else 32, seed=5)
    unscaled = ref.step(p, *ref.state(shape, 5)[1:2], *[ref.quantize(x, "e4m3", True, axis)[:3]
                        for x in ref.state(shape, 5)[2:]], 3, "e4m3", "e4m3", True, "param",
                        axis)[0]
    change = got[0].astype(np.float64) - p
    assert np.linalg.norm(unscaled - p - change) / np.linalg.norm(change) > 1e-2
