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
