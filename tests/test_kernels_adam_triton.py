"""The jax-triton Adam step (pallas_kernels/adam/adam_step_triton.py): GPU only (Triton cannot run on
CPU), checked against the float64 numpy reference of tests/adam_numpy.py, in both
group layouts: group_axis -1 (rows of G) and -2 (G rows of each column, COAT's layout; the numpy
reference runs on the transposed arrays). The column layout's jnp reference
(adam_math.adam_step_reference(group_axis=-2)) is checked on CPU against the same float64 step."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from coat_jax.adam_math import adam_step_reference
from coat_jax.expansion import ExpandedMoment
from pallas_kernels.adam import adam_step_triton as at
from tests.adam_numpy import (EM, G, HYPER, code_steps as _code_steps, log2_range as _log2_range,
                              np_quantize as _np_quantize, np_step as _np_step, state as _state)


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


def _t(x):
  return np.swapaxes(x, -1, -2)


def _np_cols_case(shape, seed, fmt, output, expand=True):
  """A column-grouped case (groups of G along axis -2, with expansion or plain max scaling):
  the float64 step of the transposed arrays, transposed back. Returns (p, g, m_state, v_state, out, (mq, ma, mk), (vq, va, vk)),
  the states as (codes, amax (..., in / G, out), k_code) in the param's layout."""
  p, g, m0, v0 = _state(shape, seed)
  m_t, v_t = _np_quantize(_t(m0), fmt, expand)[:3], _np_quantize(_t(v0), fmt, expand)[:3]
  out, *_, m_new, v_new = _np_step(_t(p).astype(np.float64), _t(g).astype(np.float64), m_t,
                                   v_t, 3, fmt, fmt, expand, output)
  back = lambda s: tuple(_t(a) for a in s[:3])
  return p, g, back(m_t), back(v_t), _t(out), back(m_new), back(v_new)


def _check_cols(got, p, out, m_new, v_new, output, carry_ok=False):
  """The new param / update to relative L2 1e-4; amax to 1e-5; k codes 99% equal; where k is
  equal, every code within one FP8 step of the float64 reference (G rows per scale)."""
  base = out - (p if output == "param" else 0)
  rel = np.linalg.norm(got[0] - (p if output == "param" else 0) - base) / np.linalg.norm(base)
  assert rel < 1e-4, rel
  for (q, a, k), (gq, ga, gk) in ((m_new, got[1:4]), (v_new, got[4:7])):
    assert ga.shape == a.shape == q.shape[:-2] + (q.shape[-2] // G, q.shape[-1])
    np.testing.assert_allclose(ga, a, rtol=1e-5)
    assert np.mean(gk == k) > 0.99
    same_k = np.repeat(gk == k, G, axis=-2)
    steps = _code_steps(gq, q)
    if carry_ok:   # see _interpreter_check: the interpreter's FP8 cast drops the mantissa carry
      qf, gf = q.astype(np.float32), gq.astype(np.float32)
      carry = (gf * 2 == qf) & (np.abs(np.frexp(qf)[0]) == 0.5)
      same_k &= ~carry
      assert carry.mean() < 0.1
    assert steps[same_k].max() <= 1


@pytest.mark.parametrize("shape,output", [((2, 256, 40), "param"), ((128, 96), "update")])
def test_reference_cols_matches_float64(shape, output):
  """The jnp reference step grouped along axis -2 (stacked and plain kernels, a column count
  that is no multiple of anything) against the float64 step."""
  p, g, m_state, v_state, out, m_new, v_new = _np_cols_case(shape, 37, "e4m3", output)
  step = jax.jit(lambda p, g, m, v: adam_step_reference(
      p, g, m, v, count=jnp.int32(3), m_format="e4m3", v_format="e4m3", group_size=G,
      expand=True, expand_min=EM, output=output, group_axis=-2, **HYPER))
  new_p, new_m, new_v = step(jnp.asarray(p), jnp.asarray(g),
                             ExpandedMoment(*map(jnp.asarray, m_state)),
                             ExpandedMoment(*map(jnp.asarray, v_state)))
  got = [np.asarray(a) for a in (new_p, *new_m, *new_v)]
  assert np.all(np.isfinite(got[0]))
  _check_cols(got, p, out, m_new, v_new, output)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,output", [((300, 1024), "param"), ((7, 128), "update")])
def test_gpu_matches_float64_reference(shape, output):
  p, g, m0, v0 = _state(shape, seed=31)
  m_state, v_state = _np_quantize(m0, "e4m3", True)[:3], _np_quantize(v0, "e4m3", True)[:3]
  out, *_, (mq, ma, mk, my), (vq, va, vk, vy) = _np_step(
      p.astype(np.float64), g.astype(np.float64), m_state, v_state, 3, "e4m3", "e4m3", True,
      output)
  got = at.adam_step(jnp.asarray(p), jnp.asarray(g), *map(jnp.asarray, m_state),
                     *map(jnp.asarray, v_state), count=jnp.int32(3), m_fmax=448.0, v_fmax=448.0,
                     m_log2_range=_log2_range(448.0), v_log2_range=_log2_range(448.0),
                     group_size=G, expand=True, expand_min=EM, output=output, **HYPER)
  got = [np.asarray(a) for a in got]
  base = out - (p if output == "param" else 0)
  rel = np.linalg.norm(got[0] - (p if output == "param" else 0) - base) / np.linalg.norm(base)
  assert rel < 1e-4
  for q, a, k, gq, ga, gk in ((mq, ma, mk, *got[1:4]), (vq, va, vk, *got[4:7])):
    np.testing.assert_allclose(ga, a, rtol=1e-5)
    assert np.mean(gk == k) > 0.99
    same_k = np.repeat(gk == k, G, axis=-1).reshape(q.shape)
    assert _code_steps(gq, q)[same_k].max() <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("group_axis", [-1, -2])
def test_gpu_grad_scale_equals_prescaled_gradient(group_axis):
  """grad_scale (fused clipping) gives the step on grad_scale * g (float32 rounding: the scaled
  gradient is rounded once either way), and differs from the unscaled step."""
  if group_axis == -1:
    p, g, m0, v0 = _state((256, 384), seed=53)
    m_state, v_state = _np_quantize(m0, "e4m3", True)[:3], _np_quantize(v0, "e4m3", True)[:3]
  else:   # moments in the column layout: scales (in / G, out)
    p, g, m_state, v_state = _np_cols_case((256, 384), 53, "e4m3", "param")[:4]
    m_state, v_state = ([np.ascontiguousarray(a) for a in s] for s in (m_state, v_state))
  kw = dict(count=jnp.int32(3), m_fmax=448.0, v_fmax=448.0, m_log2_range=_log2_range(448.0),
            v_log2_range=_log2_range(448.0), group_size=G, expand=True, expand_min=EM,
            output="param", group_axis=group_axis, fast_math=True, **HYPER)
  ms, vs = [jnp.asarray(a) for a in m_state], [jnp.asarray(a) for a in v_state]
  scale = jnp.float32(0.3)
  fused = at.adam_step(jnp.asarray(p), jnp.asarray(g), *ms, *vs, grad_scale=scale, **kw)
  pre = at.adam_step(jnp.asarray(p), jnp.asarray(g) * scale, *ms, *vs, **kw)
  plain = at.adam_step(jnp.asarray(p), jnp.asarray(g), *ms, *vs, **kw)
  np.testing.assert_allclose(np.asarray(fused[0]), np.asarray(pre[0]), rtol=1e-6, atol=0)
  for i in (1, 2, 3, 4, 5, 6):   # moments: amax to float32 rounding, codes and k (nearly) equal
    a, b = np.asarray(fused[i]), np.asarray(pre[i])
    if a.dtype == np.float32:
      np.testing.assert_allclose(a, b, rtol=1e-6)
    else:
      assert np.mean(a.astype(np.float32) == b.astype(np.float32)) > 0.999
  step = np.asarray(pre[0]) - p
  assert np.linalg.norm(np.asarray(plain[0]) - np.asarray(pre[0])) / np.linalg.norm(step) > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [0, 8, 32])
@pytest.mark.parametrize("shape,output", [((2, 256, 200), "param"), ((384, 96), "update"),
                                          ((256, 512), "param")])
def test_gpu_cols_matches_float64_reference(shape, output, chunk):
  """The column kernel (group_axis=-2): stacked and plain kernels, column counts that leave the
  last column tile masked and one that does not (EVEN); the G x BLOCK tile at once (chunk 0)
  and streamed in chunks of 8 / 32 rows."""
  p, g, m_state, v_state, out, m_new, v_new = _np_cols_case(shape, 43, "e4m3", output)
  got = at.adam_step(jnp.asarray(p), jnp.asarray(g), *map(jnp.asarray, m_state),
                     *map(jnp.asarray, v_state), count=jnp.int32(3), m_fmax=448.0, v_fmax=448.0,
                     m_log2_range=_log2_range(448.0), v_log2_range=_log2_range(448.0),
                     group_size=G, expand=True, expand_min=EM, output=output, group_axis=-2,
                     fast_math=True, cols_chunk=chunk, **HYPER)
  _check_cols([np.asarray(a) for a in got], p, out, m_new, v_new, output)


# ------------------------------------------------------------------------------------------------
# CPU: the kernel in Triton's interpreter (TRITON_INTERPRET=1) on numpy buffers, where triton is
# installed (not in the CPU CI image: the triton 3.6.0 wheel is 188 MB, 641 MB installed).


class _HostTensor:
  """A numpy array seen as the torch-like tensor Triton's interpreter expects (same memory)."""

  class _Storage:
    def __init__(self, arr):
      self.arr = arr

    def data_ptr(self):
      return self.arr.ctypes.data

    def cpu(self):
      return self

    def copy_(self, other):   # the interpreter's "device" and host copies share this memory
      pass

  class _Dtype:
    def __init__(self, name):
      self.name = name

    def __str__(self):   # Triton reads pointer types from torch's dtype names
      return "torch." + self.name

  def __init__(self, arr):
    self.arr, self.dtype = arr, self._Dtype(str(arr.dtype))

  def data_ptr(self):
    return self.arr.ctypes.data

  def untyped_storage(self):
    return self._Storage(self.arr)

  def new_empty(self, *args, **kwargs):
    return _HostTensor(self.arr)

  def set_(self, *args):
    return self

  def storage_offset(self):
    return 0

  def size(self):
    return self.arr.shape

  def stride(self):
    return tuple(s // self.arr.itemsize for s in self.arr.strides)


def _launch_interpreted(ins, outs, shape, group_axis, block, chunk=0, size_arg="runtime",
                        expand=True, packed_at=None):
  """Runs the kernel `launch_plan` picks for a param of `shape` in Triton's interpreter on host
  buffers (e5m2 moments, output="param"), as adam_step launches it: the size and segment
  operands after the inputs, the size constexprs and SEG with the others. packed_at: None, or
  the moments are packed buffers holding the leaf's slot from that group (a multiple of 16)."""
  kernel, grid, size, consts = at.launch_plan(shape, G, group_axis, block, chunk, size_arg)
  seg, seg_arg = (0, 0) if packed_at is None else (16, packed_at // 16)
  print(f"shape {shape} group_axis {group_axis} block {block} chunk {chunk} {size_arg}: "
        f"grid {grid}, size operand {size}, {consts}, segment {seg_arg} x {seg}")
  kernel[(grid,)](
      *map(_HostTensor, ins), size, seg_arg, *map(_HostTensor, outs), SEG=seg, **consts,
      **at.kernel_constants(
          G, block, has_param=True, output="param", m_fmax=57344.0, v_fmax=57344.0,
          m_log2_range=_log2_range(57344.0), v_log2_range=_log2_range(57344.0), expand=expand,
          expand_min=EM, max_k_code=255, amax_floor=1e-30, grad_clamp=2.0**63))


def _use_tl_math():
  """The interpreter leaves libdevice's stubs unimplemented (they return None): tl.math's."""
  from pallas_kernels.adam import adam_tile_triton as tile
  for name in ("exp2", "log2"):
    setattr(tile.libdevice, name, lambda x, name=name: getattr(tile.tl.math, name)(x))


def _interpreter_check(grad_scale=None, size_arg="runtime", shape=(7, 256), block=4):
  """Runs in a process started with TRITON_INTERPRET=1 (read when @triton.jit decorates, so it
  must be set before pallas_kernels.adam.adam_step_triton is imported). libdevice calls are mapped to
  tl.math (`_use_tl_math`). e5m2
  moments: the interpreter's float32 -> e4m3 cast also rounds ties away from zero and flushes
  subnormals (seen with triton 3.6.0), so its e4m3 codes would differ more. grad_scale: the
  step scalars' gradient scale (slot 9, fused clipping); the float64 reference steps with
  grad_scale * g, and must differ from the unscaled step (the check could fail without it).
  size_arg: `launch_plan`'s (the default (7, 256) with block 4: 14 rows of G, the last program
  masked; rows a multiple of block: EVEN, no masks)."""
  _use_tl_math()
  p, g, m0, v0 = _state(shape, seed=41)
  m_state, v_state = _np_quantize(m0, "e5m2", True)[:3], _np_quantize(v0, "e5m2", True)[:3]
  scale = 1.0 if grad_scale is None else float(np.float32(grad_scale))
  out, *_, (mq, ma, mk, my), (vq, va, vk, vy) = _np_step(
      p.astype(np.float64), g.astype(np.float64) * scale, m_state, v_state, 3, "e5m2", "e5m2",
      True, "param")
  if grad_scale is not None:
    unscaled = _np_step(p.astype(np.float64), g.astype(np.float64), m_state, v_state, 3, "e5m2",
                        "e5m2", True, "param")[0]
    assert np.linalg.norm(unscaled - out) / np.linalg.norm(out - p) > 1e-2
  ins = [np.asarray(at.step_scalars(count=3, grad_scale=grad_scale, **HYPER)), p, g,
         *map(np.asarray, m_state), *map(np.asarray, v_state)]
  outs = [np.zeros_like(p)] + [np.zeros_like(np.asarray(a)) for a in (*m_state, *v_state)]
  _launch_interpreted(ins, outs, shape, -1, block, size_arg=size_arg)
  rel = np.linalg.norm((outs[0] - p) - (out - p)) / np.linalg.norm(out - p)
  assert rel < 1e-4, rel
  for q, a, k, gq, ga, gk in ((mq, ma, mk, *outs[1:4]), (vq, va, vk, *outs[4:7])):
    np.testing.assert_allclose(ga, a, rtol=1e-5)
    assert np.mean(gk == k) > 0.99
    same_k = np.repeat(gk == k, G, axis=-1).reshape(q.shape)
    # The interpreter's FP8 cast drops the mantissa carry: a value rounding up onto a power of
    # two comes out one binade low (128 -> 64; triton 3.6.0, the GPU's cvt does not). Those
    # codes are half the reference's exactly; every other code is within one step.
    qf, gf = q.astype(np.float32), gq.astype(np.float32)
    carry = (gf * 2 == qf) & (np.abs(np.frexp(qf)[0]) == 0.5)
    assert _code_steps(gq, q)[same_k & ~carry].max() <= 1
    assert carry.mean() < 0.1
  print("interpreter check passed")


def _interpreter_check_cols(shape=(2, 256, 72), block=32, chunk=0, size_arg="runtime", seed=47,
                            expand=True, in_place=False):
  """The column kernel (`_adam_cols_kernel`) in Triton's interpreter, as `_interpreter_check`:
  a leaf of `shape` (default stacked (2, 256, 72): the last column tile of BLOCK 32 masked),
  e5m2 moments (with expansion or plain max scaling), tile BLOCK columns, chunk: 0 (the G x
  BLOCK tile at once) or the rows per chunk of the streamed two-pass tile. in_place: outputs
  are the inputs' buffers (as jax-triton's aliases make them)."""
  _use_tl_math()
  p, g, m_state, v_state, out, m_new, v_new = _np_cols_case(shape, seed, "e5m2", "param",
                                                            expand)
  m_state, v_state = ([np.ascontiguousarray(a) for a in s] for s in (m_state, v_state))
  p_in = p.copy()
  ins = [np.asarray(at.step_scalars(count=3, **HYPER)), p_in, g, *m_state, *v_state]
  if in_place:
    outs = [p_in, *m_state, *v_state]
  else:
    outs = [np.zeros_like(p)] + [np.zeros_like(a) for a in (*m_state, *v_state)]
  _launch_interpreted(ins, outs, shape, -2, block, chunk, size_arg, expand)
  _check_cols(outs, p, out, m_new, v_new, "param", carry_ok=True)
  print("interpreter check passed")


def _interpreter_check_packed(group_axis=-1, packed_at=48, seed=53):
  """The kernel on moments in packed buffers (coat_jax.packed_state's layout): the leaf's codes,
  amax and k codes placed at group `packed_at` of longer buffers whose other entries are
  sentinels; the kernel (aliased in place, as adam_step launches it) must step the slot as the
  float64 reference does and leave every sentinel as it was."""
  _use_tl_math()
  shape = (7, 256) if group_axis == -1 else (256, 72)
  if group_axis == -1:
    p, g, m0, v0 = _state(shape, seed=seed)
    m_state, v_state = _np_quantize(m0, "e5m2", True)[:3], _np_quantize(v0, "e5m2", True)[:3]
    _, *_, m_new, v_new = _np_step(p.astype(np.float64), g.astype(np.float64), m_state, v_state,
                                   3, "e5m2", "e5m2", True, "param")
    m_new, v_new = m_new[:3], v_new[:3]
  else:
    p, g, m_state, v_state, _, m_new, v_new = _np_cols_case(shape, seed, "e5m2", "param")
  groups = m_state[1].size
  total = packed_at + groups + 16   # a sentinel tail after the slot as well

  def packed(state, fill):
    q, a, k = (np.ascontiguousarray(x).reshape(-1) for x in state)
    qb = np.full((total * G,), fill[0], q.dtype)
    ab, kb = np.full((total,), fill[1], np.float32), np.full((total,), fill[2], np.uint8)
    qb[packed_at * G:packed_at * G + q.size], ab[packed_at:packed_at + groups] = q, a
    kb[packed_at:packed_at + groups] = k
    return [qb, ab, kb]

  m_buf = packed(m_state, (np.asarray(-3.0, m_state[0].dtype), 7.5, 9))
  v_buf = packed(v_state, (np.asarray(5.0, v_state[0].dtype), 3.25, 11))
  before = [b.copy() for b in (*m_buf, *v_buf)]
  out = np.zeros_like(p)
  ins = [np.asarray(at.step_scalars(count=3, **HYPER)), p, g, *m_buf, *v_buf]
  _launch_interpreted(ins, [out, *m_buf, *v_buf], shape, group_axis, 4 if group_axis == -1 else 32,
                      packed_at=packed_at)   # outputs = inputs, as aliased
  for buf, old, unit in zip((*m_buf, *v_buf), before, (G, 1, 1) * 2):
    lo, hi = packed_at * unit, (packed_at + groups) * unit
    np.testing.assert_array_equal(buf[:lo].view(np.uint8), old[:lo].view(np.uint8))
    np.testing.assert_array_equal(buf[hi:].view(np.uint8), old[hi:].view(np.uint8))
  for buf, want in ((m_buf, m_new), (v_buf, v_new)):
    q = buf[0][packed_at * G:(packed_at + groups) * G].reshape(shape)
    a = buf[1][packed_at:packed_at + groups].reshape(want[1].shape)
    np.testing.assert_allclose(a, want[1], rtol=1e-5)
    assert not np.array_equal(a, np.asarray(want[1]) * 0 + 7.5)
    qf, wf = q.astype(np.float32), np.asarray(want[0]).astype(np.float32)
    carry = (qf * 2 == wf) & (np.abs(np.frexp(wf)[0]) == 0.5)   # the interpreter's FP8 carry
    assert _code_steps(q, want[0])[~carry].max() <= 1
  assert np.isfinite(out).all() and np.linalg.norm(out - p) > 0
  print("interpreter check passed")


def _run_interpreted(check: str, args: str = ""):
  import os
  import subprocess
  import sys
  env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
  code = f"from tests.test_kernels_adam_triton import {check}; {check}({args})"
  run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
  assert run.returncode == 0 and "passed" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]


needs_triton = pytest.mark.skipif(at.triton is None, reason="triton is not installed")


@needs_triton
@pytest.mark.parametrize("args", [
    "",                                               # (2, 256, 72), BLOCK 32: masked, runtime
    "size_arg='constexpr'",                           # the old kernel: COLS constexpr
    "shape=(256, 96), block=32, seed=61",             # EVEN: no masks
    "block=64, chunk=16",                             # streamed: stacked, last tile masked
    "shape=(384, 128), block=64, chunk=32, seed=67",  # streamed, EVEN, 3 row groups
    "shape=(256, 40), block=64, chunk=128, seed=71",  # one chunk of G rows, one masked tile
    "block=32, chunk=8, size_arg='constexpr'",
    "expand=False",                                   # plain max scaling (k code EM)
    "block=64, chunk=16, expand=False",
    "block=32, chunk=16, in_place=True",              # the default tile, written in place
])
def test_interpreter_cols_matches_float64_reference(args):
  _run_interpreted("_interpreter_check_cols", args)


@needs_triton
@pytest.mark.parametrize("args", ["", "size_arg='constexpr'", "size_arg='runtime_masked'",
                                  "shape=(4, 1024), block=8"])   # 32 rows / 8: EVEN
def test_interpreter_matches_float64_reference(args):
  _run_interpreted("_interpreter_check", args)


@needs_triton
@pytest.mark.parametrize("args", ["group_axis=-1", "group_axis=-2", "group_axis=-1, packed_at=0"])
def test_interpreter_steps_a_packed_slot_and_leaves_the_rest(args):
  _run_interpreted("_interpreter_check_packed", args)


@needs_triton
def test_interpreter_applies_the_grad_scale_slot():
  """Fused clipping: the kernel multiplies each gradient by the step scalars' slot 9."""
  _run_interpreted("_interpreter_check", "grad_scale=0.3")


OLMO_1B_LEAVES = [(16, 2048, 2048), (16, 2048, 8192), (16, 8192, 2048), (50304, 2048),
                  (16, 2048), (4096, 11008)]


@pytest.mark.parametrize("group_axis,block,chunk", [(-1, 16, None), (-2, 32, 0), (-2, 128, 8)])
def test_runtime_size_needs_one_compile_for_every_leaf(group_axis, block, chunk):
  """size_arg "runtime": every OLMo-1B leaf (and 4096 x 11008) gets the same kernel and
  constexprs (jax-triton compiles once per kernel, signature and constexprs), EVEN (no masks),
  column stride alignment CDIV 16; "constexpr" one set per leaf size; the size operand is the
  rows of G or the columns / CDIV."""
  leaves = [s for s in OLMO_1B_LEAVES if at.problem(s, jnp.float32, jnp.float8_e4m3fn,
                                                    jnp.float8_e4m3fn, G, group_axis) is None]
  assert len(leaves) == (6 if group_axis == -1 else 5)
  plans = [at.launch_plan(s, G, group_axis, block, chunk, "runtime") for s in leaves]
  assert len({(k, tuple(sorted(c.items()))) for k, _, _, c in plans}) == 1
  assert plans[0][3]["EVEN"]
  for s, (_, grid, size, consts) in zip(leaves, plans):
    n = int(np.prod(s))
    if group_axis == -1:
      assert (size, grid) == (n // G, n // G // block)
    else:
      assert consts["CDIV"] == 16 and size * 16 == s[-1]
      assert grid == n // (G * s[-1]) * (s[-1] // block)
  old = {tuple(sorted(at.launch_plan(s, G, group_axis, block, chunk, "constexpr")[3].items()))
         for s in leaves}
  assert len(old) == len({s[-1] if group_axis == -2 else np.prod(s) for s in leaves})


def test_launch_plan_masks_and_refuses_clearly():
  rows = at.launch_plan((7, 256), G, -1, 4, size_arg="runtime")
  assert rows[1:] == (4, 14, dict(ROWS=0, EVEN=False))
  assert at.launch_plan((7, 256), G, -1, 2, size_arg="runtime")[3]["EVEN"]
  assert not at.launch_plan((8, 256), G, -1, 4, size_arg="runtime_masked")[3]["EVEN"]
  assert at.launch_plan((8, 256), G, -1, 4, size_arg="constexpr")[3] == dict(ROWS=16, EVEN=False)
  cols = at.launch_plan((2, 256, 72), G, -2, 32, 16, "runtime")
  assert cols[1:] == (2 * 2 * 3, 9, dict(COLS=0, CDIV=8, EVEN=False, CHUNK=16))
  assert at.launch_plan((256, 40), G, -2, 8, 0, "runtime")[3]["EVEN"]
  assert at.pow2_divisor(11008) == 16 and at.pow2_divisor(40) == 8 and at.pow2_divisor(7) == 1
  for chunk in (3, 256, -8):
    with pytest.raises(ValueError, match="cols_chunk"):
      at.launch_plan((256, 64), G, -2, 32, chunk)
  with pytest.raises(ValueError, match="size_arg"):
    at.launch_plan((256, 64), G, -1, 16, size_arg="static")


def test_parse_cols_tiles():
  assert at.parse_cols_tiles("32x4, 128x8x8,") == [(32, 0, 4), (128, 8, 8)]
  assert at.parse_cols_tiles("") == []
  for bad in ("32", "48x4", "32x4x4x4", "64xax4", "0x4"):
    with pytest.raises(ValueError, match="BLOCKxCHUNKxWARPS"):
      at.parse_cols_tiles(bad)


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
  if group_axis == -1:
    p, g, m0, v0 = _state((96, 384), seed=seed)
    m_state, v_state = _np_quantize(m0, "e4m3", True)[:3], _np_quantize(v0, "e4m3", True)[:3]
  else:
    p, g, m_state, v_state = _np_cols_case((256, 96), seed, "e4m3", "param")[:4]
    m_state, v_state = ([np.ascontiguousarray(a) for a in s] for s in (m_state, v_state))
  kw = dict(count=jnp.int32(3), m_fmax=448.0, v_fmax=448.0, m_log2_range=_log2_range(448.0),
            v_log2_range=_log2_range(448.0), group_size=G, expand=True, expand_min=EM,
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
      m_log2_range=_log2_range(448.0), v_log2_range=_log2_range(448.0), expand=True,
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
  """Stepping a packed slot (SEG > 0) compiles to no more registers per thread than the per-leaf
  kernel: each register more cost occupancy and time on the H100 (12 moved pointers: rows 80 ->
  95 registers, 2.5 % slower; columns 48 -> 56, 10 % slower; docs/benchmarks.md)."""
  monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
  if group_axis == -1:
    kernel, sizes = at._adam_kernel, dict(ROWS=0, EVEN=True)
    block, warps = at.ROWS_BLOCK, at.ROWS_WARPS
  else:
    kernel, sizes = at._adam_cols_kernel, dict(COLS=0, CDIV=16, EVEN=True, CHUNK=at.COLS_CHUNK)
    block, warps = at.COLS_BLOCK, at.COLS_WARPS
  leaf = _sm90_registers(kernel, sizes, block, warps, 0, tmp_path)
  packed = _sm90_registers(kernel, sizes, block, warps, 16, tmp_path)
  print(f"group_axis {group_axis}: {leaf} registers per leaf, {packed} packed")
  assert packed <= leaf, (leaf, packed)
  # a slot at group 16 (seg_arg 1): jax-triton makes that argument a constant; it must compile
  assert _sm90_registers(kernel, sizes, block, warps, 16, tmp_path, seg_arg_one=True) > 0
