"""The COAT AdamW step with dynamic range expansion in float64 numpy, written from the method
(docs/design.md; the compact stored form of coat_jax/expansion.py's docstring): the
oracle the fused kernels are checked against. Groups of G along axis -1 or -2 of the array's own
layout (no transposes)."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

G, EM, FLOOR, MAX_CODE = 128, 16, 1e-30, 255
FORMATS = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
HYPER = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def log2_range(fmt: str) -> float:
  """log2 of the expansion range R = fmax^2 / 2."""
  fmax = FORMATS[fmt][1]
  return math.log2(fmax * fmax / 2.0)


def _grouped(x, axis):
  """x (..., N, rest) as (..., N / G, G, rest) with the G axis moved last: (..., N / G, rest, G)."""
  a = x.ndim + axis
  xg = x.reshape(*x.shape[:a], x.shape[a] // G, G, *x.shape[a + 1:])
  return np.moveaxis(xg, a + 1, -1)


def _ungrouped(xg, shape, axis):
  a = len(shape) + axis
  return np.moveaxis(xg, -1, a + 1).reshape(shape)


def quantize(x, fmt: str, expand: bool, axis: int = -1):
  """Per group: mx = max|x| + 1e-30, mn = min nonzero |x| + 1e-30 (mx if none), k code =
  clip(floor(EM log2 R / log2(mx / mn)), 1, 255) (EM where mx == mn), codes sign(x) fmax
  (|x| / mx)^(code / EM) rounded to nearest in FP8; without expansion code EM and x fmax / mx.
  Returns (codes, mx float32, k code uint8, y = the unfloored k code), metadata (..., N/G, rest)."""
  dtype, fmax = FORMATS[fmt]
  a = np.abs(_grouped(np.asarray(x, np.float64), axis))
  mx = a.max(-1) + FLOOR
  if expand:
    nz = np.where(a > 0, a, np.inf).min(-1)
    mn = np.where(np.isinf(nz), mx, nz + FLOOR)
    ratio = np.log2(mx / mn)
    y = np.where(ratio > 0, log2_range(fmt) / np.where(ratio > 0, ratio, 1.0) * EM, EM)
    code = np.clip(np.floor(y), 1, MAX_CODE)
    mag = fmax * (a / mx[..., None]) ** (code / EM)[..., None]
  else:
    y = code = np.full(mx.shape, float(EM))
    mag = a / (mx / fmax)[..., None]
  signed = np.sign(_grouped(np.asarray(x, np.float64), axis)) * np.minimum(mag, fmax)
  q = _ungrouped(signed, np.shape(x), axis).astype(dtype)
  return q, mx.astype(np.float32), code.astype(np.uint8), y


def dequantize(q, mx, code, fmt: str, axis: int = -1):
  """x = sign(q) mx (|q| / fmax)^(EM / code) per group, float64."""
  fmax = FORMATS[fmt][1]
  qg = _grouped(q.astype(np.float64), axis)
  k = code.astype(np.float64)[..., None] / EM
  return _ungrouped(np.sign(qg) * mx.astype(np.float64)[..., None] * (np.abs(qg) / fmax) ** (1 / k),
                    q.shape, axis)


def step(p, g, m_state, v_state, t: int, m_fmt: str, v_fmt: str, expand: bool, output: str,
         axis: int = -1, grad_scale: float = 1.0, hyper: dict = HYPER):
  """One COAT AdamW step in float64: (new param or update, (m codes, amax, k code, y), (v ...)).
  p None: no decay term (output "update" only)."""
  m = dequantize(*m_state[:3], m_fmt, axis)
  v = dequantize(*v_state[:3], v_fmt, axis)
  g = np.asarray(g, np.float64) * grad_scale
  g = np.where(np.abs(g) < np.inf, np.clip(g, -2.0**63, 2.0**63), g)
  b1, b2 = hyper["b1"], hyper["b2"]
  m = b1 * m + (1 - b1) * g
  v = b2 * v + (1 - b2) * g * g
  direction = m / ((np.sqrt(v) / math.sqrt(1 - b2**t) + hyper["eps"]) * (1 - b1**t))
  if p is not None:
    direction = direction + hyper["weight_decay"] * np.asarray(p, np.float64)
  out = (np.asarray(p, np.float64) - hyper["lr"] * direction if output == "param"
         else -hyper["lr"] * direction)
  return out, quantize(m, m_fmt, expand, axis), quantize(v, v_fmt, expand, axis)


def state(shape, seed: int):
  """Random (p, g, m, v): float32 p and g with a spread of gradient scales, float64 moments;
  every 37th element has m = g = 0 (its new m is exactly 0 and must stay so)."""
  print(f"seed {seed} shape {shape}")
  rng = np.random.default_rng(seed)
  p = rng.standard_normal(shape).astype(np.float32)
  g = rng.standard_normal(shape) * np.exp2(rng.uniform(-12, -4, shape))
  m = rng.standard_normal(shape) * 1e-3
  v = np.abs(rng.standard_normal(shape)) ** 2 * 1e-6
  g.reshape(-1)[::37] = 0.0
  m.reshape(-1)[::37] = 0.0
  return p, g.astype(np.float32), m, v


def code_steps(a, b):
  """How many FP8 codes apart (sign-magnitude bits mapped to a monotonic integer)."""
  def mono(c):
    bits = np.asarray(c).view(np.uint8).astype(np.int32)
    return np.where(bits & 0x80, -(bits & 0x7F), bits & 0x7F)
  return np.abs(mono(a) - mono(b))


def check_step(got, want, p, axis: int, output="param", off_by_one=0.005, rel_tol=3e-5):
  """A kernel's step `got` ([out, m codes, m amax, m k, v codes, v amax, v k]) against the
  float64 `want` (`step`) from param p, groups along `axis`: the new param / update to relative
  L2 `rel_tol` (bfloat16 params: equal to the float64 result rounded to nearest, but where it is
  within float32 rounding of a tie); amax to 1e-5; k codes
  equal but where the unfloored k is within 1e-3 of an integer; where k is equal, every code
  within one FP8 step of the float64 one and at most `off_by_one` of them one step off; zeros
  exactly zero."""
  out, m_new, v_new = want
  got_out = got[0].astype(np.float64)
  assert np.isfinite(got_out).all()
  if got[0].dtype == ml_dtypes.bfloat16:
    rounded = out.astype(ml_dtypes.bfloat16).astype(np.float64)
    ulp = 2.0 ** (np.floor(np.log2(np.abs(rounded))) - 7)
    scale = np.maximum(np.abs(p.astype(np.float64)), np.abs(out - p.astype(np.float64)))
    near_tie = np.abs(np.abs(out - rounded) - ulp / 2) < 1e-6 * scale   # float32 rounding
    assert np.all((got_out == rounded) | near_tie), np.mean(got_out != rounded)
    assert np.mean(got_out != p.astype(np.float64)) > 0.05   # the params moved
  else:
    base = out - (p if output == "param" else 0)
    rel = np.linalg.norm(got_out - (p if output == "param" else 0) - base) / np.linalg.norm(base)
    print(f"update rel L2 {rel:.2e}")
    assert rel < rel_tol, rel
  for name, (q, a, k, y), (gq, ga, gk) in (("m", m_new, got[1:4]), ("v", v_new, got[4:7])):
    assert gk.dtype == np.uint8 and ga.shape == a.shape
    np.testing.assert_allclose(ga, a, rtol=1e-5, err_msg=name)
    near_tie = np.abs(y - np.round(y)) < 1e-3 * np.maximum(1.0, np.abs(y))
    assert np.all((gk == k) | near_tie), f"{name}: k codes differ away from ties"
    same_k = np.repeat(gk == k, G, axis=axis)
    steps = code_steps(gq, q)
    print(f"{name}: {np.mean(steps[same_k] == 1):.4f} of the codes one step off")
    assert steps[same_k].max() <= 1, f"{name}: a code is more than one step off"
    assert np.mean(steps[same_k] == 1) <= off_by_one
    assert np.all(gq.astype(np.float32)[q.astype(np.float32) == 0] == 0)
