"""The jax-triton Adam step (pallas_kernels/adam_step_triton.py): GPU only (Triton cannot run on
CPU), checked against the float64 numpy reference of tests/test_kernels_adam_mgpu.py."""
import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels import adam_step_triton as at
from tests.test_kernels_adam_mgpu import EM, G, HYPER, _code_steps, _log2_range, _np_quantize, \
    _np_step, _state


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


def _interpreter_check():
  """Runs in a process started with TRITON_INTERPRET=1 (read when @triton.jit decorates, so it
  must be set before pallas_kernels.adam_step_triton is imported). libdevice calls are mapped to
  tl.math: the interpreter leaves libdevice's stubs unimplemented (they return None). e5m2
  moments: the interpreter's float32 -> e4m3 cast also rounds ties away from zero and flushes
  subnormals (seen with triton 3.6.0), so its e4m3 codes would differ more."""
  for name in ("exp2", "log2"):
    setattr(at.libdevice, name, lambda x, name=name: getattr(at.tl.math, name)(x))
  shape, block = (7, 256), 4                       # 14 groups: the last program is masked
  p, g, m0, v0 = _state(shape, seed=41)
  m_state, v_state = _np_quantize(m0, "e5m2", True)[:3], _np_quantize(v0, "e5m2", True)[:3]
  out, *_, (mq, ma, mk, my), (vq, va, vk, vy) = _np_step(
      p.astype(np.float64), g.astype(np.float64), m_state, v_state, 3, "e5m2", "e5m2", True,
      "param")
  ins = [np.asarray(at.step_scalars(count=3, **HYPER)), p, g, *map(np.asarray, m_state),
         *map(np.asarray, v_state)]
  outs = [np.zeros_like(p)] + [np.zeros_like(np.asarray(a)) for a in (*m_state, *v_state)]
  rows = p.size // G
  at._adam_kernel[(-(-rows // block),)](
      *map(_HostTensor, ins + outs), **at.kernel_constants(
          rows, G, block, has_param=True, output="param", m_fmax=57344.0, v_fmax=57344.0,
          m_log2_range=_log2_range(57344.0), v_log2_range=_log2_range(57344.0), expand=True,
          expand_min=EM, max_k_code=255, amax_floor=1e-30, grad_clamp=2.0**63))
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


@pytest.mark.skipif(at.triton is None, reason="triton is not installed")
def test_interpreter_matches_float64_reference():
  import os
  import subprocess
  import sys
  env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
  code = "from tests.test_kernels_adam_triton import _interpreter_check; _interpreter_check()"
  run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
  assert run.returncode == 0 and "passed" in run.stdout, run.stderr[-3000:]
