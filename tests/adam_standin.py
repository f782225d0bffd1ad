"""A stand-in for the jax-triton Adam kernel module (pallas_kernels.adam.adam_step_triton) on the
CPU, where Triton cannot run: its entry points (`supported`, `adam_step`) computed by the jnp
reference, so that tests exercise the dispatch around the kernel (per-shard wrapping, operand
kinds, step scalars) without a GPU. `install(monkeypatch)` puts it in place of the kernel module
for the dispatch; run the step under `kernels.backend("adam=triton")`. `shapes` records the param
or gradient shape of every traced call (per shard on a mesh)."""
import sys

import jax.numpy as jnp

from coat_jax import adam_math
from coat_jax.expansion import ExpandedMoment

FORMATS = {448.0: "e4m3", 57344.0: "e5m2"}
FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
shapes: list = []


def supported(shape, dtype, m_dtype, v_dtype, group_size, group_axis=-1) -> bool:
  return (len(shape) >= -group_axis and shape[group_axis] % group_size == 0
          and jnp.dtype(m_dtype) in FP8 and jnp.dtype(v_dtype) in FP8)


def adam_step(param, grad, m_q, m_amax, m_code, v_q, v_amax, v_code, *, lr, b1, b2, eps,
              weight_decay, count, m_fmax, v_fmax, group_size, expand, expand_min,
              output="param", group_axis=-1, grad_scale=None, **_):
  shapes.append(tuple(grad.shape))
  out, m, v = adam_math.adam_step_reference(
      param, grad, ExpandedMoment(m_q, m_amax, m_code), ExpandedMoment(v_q, v_amax, v_code),
      lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, count=count,
      m_format=FORMATS[float(m_fmax)], v_format=FORMATS[float(v_fmax)], group_size=group_size,
      expand=expand, expand_min=expand_min, output=output, group_axis=group_axis,
      grad_scale=grad_scale)
  return (out, *m, *v)


def install(monkeypatch) -> list:
  """This module as the dispatch's Adam kernel; returns `shapes` (emptied)."""
  from coat_jax.kernels import adam
  monkeypatch.setattr(adam, "_triton_kernels", lambda: sys.modules[__name__])
  shapes.clear()
  return shapes
