"""An independent float64 numpy reference of COAT's Adam step on FP8 moments, written from
/work/shared/coat_spec.md (the compact expansion form of coat_jax/expansion.py's docstring): the
kernel tests check the jax-triton kernel against it."""
import math

import ml_dtypes
import numpy as np

import jax.numpy as jnp

FMT = {"e4m3": (jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0),
       "e5m2": (jnp.float8_e5m2, ml_dtypes.float8_e5m2, 57344.0)}
EM, G, FLOOR = 16, 128, 1e-30
HYPER = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def log2_range(fmax):
  return math.log2(fmax * fmax / 2.0)


def np_quantize(x, fmt, expand):
  """float64 expansion + quantization per group of G: (codes fp8, mx float32, k_code, k_real)."""
  _, np_dtype, fmax = FMT[fmt]
  xg = x.reshape(*x.shape[:-1], -1, G)
  a = np.abs(xg)
  mx = a.max(-1) + FLOOR
  if expand:
    nz = np.where(a > 0, a, np.inf).min(-1)
    mn = np.where(np.isinf(nz), mx, nz + FLOOR)
    ratio = np.log2(mx / mn)
    with np.errstate(divide="ignore"):
      y = np.where(ratio > 0, log2_range(fmax) / np.where(ratio > 0, ratio, 1) * EM, EM)
    code = np.clip(np.floor(y), 1, 255)
    mag = fmax * (a / mx[..., None]) ** (code / EM)[..., None]
  else:
    y = code = np.full(mx.shape, float(EM))
    mag = a / (mx / fmax)[..., None]
  q = (np.sign(xg) * np.minimum(mag, fmax)).astype(np.float32).astype(np_dtype)
  return q.reshape(x.shape), mx.astype(np.float32), code.astype(np.uint8), y


def np_dequantize(q, mx, code, fmt):
  fmax = FMT[fmt][2]
  qg = q.astype(np.float64).reshape(*q.shape[:-1], -1, G)
  k = code.astype(np.float64)[..., None] / EM
  mag = mx.astype(np.float64)[..., None] * (np.abs(qg) / fmax) ** (1.0 / k)
  return (np.sign(qg) * mag).reshape(q.shape)


def np_step(p, g, m_state, v_state, t, m_fmt, v_fmt, expand, output):
  m = np_dequantize(*m_state, m_fmt)
  v = np_dequantize(*v_state, v_fmt)
  b1, b2 = HYPER["b1"], HYPER["b2"]
  m = b1 * m + (1 - b1) * g
  v = b2 * v + (1 - b2) * g * g
  direction = m / ((np.sqrt(v) / math.sqrt(1 - b2**t) + HYPER["eps"]) * (1 - b1**t))
  if p is not None:
    direction = direction + HYPER["weight_decay"] * p
  out = p - HYPER["lr"] * direction if output == "param" else -HYPER["lr"] * direction
  return out, m, v, np_quantize(m, m_fmt, expand), np_quantize(v, v_fmt, expand)


def state(shape, seed):
  print(f"seed {seed} shape {shape}")
  rng = np.random.default_rng(seed)
  p = rng.standard_normal(shape)
  g = rng.standard_normal(shape) * np.exp2(rng.uniform(-12, -4, shape[:-1] + (1,)))
  m = rng.standard_normal(shape) * 1e-3
  v = np.abs(rng.standard_normal(shape)) ** 2 * 1e-6
  m[..., :5] = 0.0          # exact zeros stay representable
  return p.astype(np.float32), g.astype(np.float32), m, v


def code_steps(a, b):
  """How many FP8 codes apart (sign-magnitude bits mapped to a monotonic integer)."""
  def mono(c):
    bits = np.asarray(c).view(np.uint8).astype(np.int32)
    return np.where(bits & 0x80, -(bits & 0x7F), bits & 0x7F)
  return np.abs(mono(a) - mono(b))
