"""The Triton building blocks of the fused COAT AdamW step: per-element math, the moments'
dequantize / requantize with dynamic range expansion, the step on one 2-D tile (`adam_tile`).

adam_step_triton.py's row and column kernels are built from these; the math per group of G
elements is adam_step_triton.py's docstring and coat_jax.adam_math's reference. Precise math: libdevice exp2 / log2 (as XLA), IEEE sqrt
(`sqrt_rn`), Triton's `/` (div.full.f32, what XLA:GPU emits); FAST: one MUFU instruction each.
A tile's groups run along its axis AXIS (1: rows of G, 0: columns of G) with one metadata value
per group at `meta_idx`; masks None build no mask at all (EVEN tiles).
Imports triton only (absent on CPU machines without it: then nothing here is defined).
"""
from __future__ import annotations

try:  # the kernels need triton only (they compile without a GPU); calling them needs jax-triton
  import triton
  import triton.language as tl
  from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - CPU machines
  triton = tl = libdevice = None

if triton is not None:

  @triton.jit
  def _approx(x, PTX: tl.constexpr):
    """One MUFU instruction per element (lg2 / ex2 / sqrt / rcp .approx.ftz: relative error
    ~2^-22, as the Pallas kernel's fast_math): PTX is its inline-asm line."""
    return tl.inline_asm_elementwise(PTX, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)

  @triton.jit
  def _log2(x, FAST: tl.constexpr):
    """Per-element math: libdevice / IEEE (precise, as XLA) or FAST: `_approx`."""
    if FAST:
      return _approx(x, "lg2.approx.ftz.f32 $0, $1;")
    else:
      return libdevice.log2(x)

  @triton.jit
  def _exp2(x, FAST: tl.constexpr):
    if FAST:
      return _approx(x, "ex2.approx.ftz.f32 $0, $1;")
    else:
      return libdevice.exp2(x)

  @triton.jit
  def _sqrt(x, FAST: tl.constexpr):
    if FAST:
      return _approx(x, "sqrt.approx.ftz.f32 $0, $1;")
    else:
      return tl.sqrt_rn(x)

  @triton.jit
  def _div(x, y, FAST: tl.constexpr):
    if FAST:
      return x * _approx(y, "rcp.approx.ftz.f32 $0, $1;")
    else:
      return x / y

  @triton.jit
  def _load(ptr, mask, other):
    """tl.load masked (`other` where the mask is off), or unmasked where mask is None (EVEN
    tiles build no mask at all)."""
    if mask is None:
      x = tl.load(ptr)
    else:
      x = tl.load(ptr, mask=mask, other=other)
    return x

  @triton.jit
  def load_scalars(s_ptr):
    """The step scalars (slots of `step_scalars`): lr, b1, 1 - b1, b2, 1 - b2, eps,
    1 / sqrt(bc2), bc1, grad scale (weight decay, slot 6, is read by the caller)."""
    return (tl.load(s_ptr + 0), tl.load(s_ptr + 1), tl.load(s_ptr + 2), tl.load(s_ptr + 3),
            tl.load(s_ptr + 4), tl.load(s_ptr + 5), tl.load(s_ptr + 7), tl.load(s_ptr + 8),
            tl.load(s_ptr + 9))

  @triton.jit
  def load_meta(a_ptr, k_ptr, meta_idx, meta_mask, AXIS: tl.constexpr):
    """A moment's per-group metadata (amax, k code as float32) at meta_idx (1-D), expanded
    along tile axis AXIS (the groups' axis) to broadcast over the tile."""
    mx = tl.expand_dims(_load(a_ptr + meta_idx, meta_mask, 1.0), AXIS)
    code = tl.expand_dims(_load(k_ptr + meta_idx, meta_mask, 1).to(tl.float32), AXIS)
    return mx, code

  @triton.jit
  def _dequant(q, mx, code, FMAX: tl.constexpr, EM: tl.constexpr, FAST: tl.constexpr):
    """Codes q (float32) of groups with amax mx and k code `code` (broadcast) as values:
    |x| = mx (|q| / FMAX)^(EM / code), or |q| mx / FMAX where code == EM (k = 1)."""
    qa = tl.abs(q)
    inv_fmax = 1.0 / FMAX
    powered = mx * _exp2((EM / code) * _log2(qa * inv_fmax, FAST), FAST)
    linear = qa * (mx * inv_fmax)
    mag = tl.where(code == EM, linear, powered)
    return tl.where(q < 0, -mag, mag)

  @triton.jit
  def nonzero_or_inf(a):
    """|x| where nonzero, else inf: its minimum is the smallest nonzero |x| (inf: none)."""
    return tl.where(a > 0, a, float("inf"))

  @triton.jit
  def group_meta(amax, amin_nz, LOG2R: tl.constexpr, EXPAND: tl.constexpr, EM: tl.constexpr,
                  MAX_K: tl.constexpr, FLOOR: tl.constexpr, NOEXP_K: tl.constexpr):
    """New metadata of groups with max |x| amax and smallest nonzero |x| amin_nz (inf: none):
    mx = amax + FLOOR and the k code steps = clamp(floor(EM LOG2R / log2(mx / mn)), 1, MAX_K),
    mn = amin_nz + FLOOR (steps = EM where mx == mn or no nonzero: k = 1); NOEXP_K without
    expansion."""
    mx = amax + FLOOR
    if EXPAND:
      mn = tl.where(amin_nz == float("inf"), mx, amin_nz + FLOOR)
      lr = libdevice.log2(mx / mn)
      ok = lr > 0
      steps = tl.floor(LOG2R / tl.where(ok, lr, 1.0) * EM)
      steps = tl.where(ok, steps, EM)
      steps = tl.minimum(tl.maximum(steps, 1.0), MAX_K)
    else:
      steps = tl.zeros_like(mx) + NOEXP_K
    return mx, steps

  @triton.jit
  def quantize(x, mx, steps, FMAX: tl.constexpr, EXPAND: tl.constexpr, EM: tl.constexpr,
                FAST: tl.constexpr):
    """x's codes (float32, clamped to +-FMAX, NaN kept) in groups with metadata mx, steps
    (broadcast): sign(x) FMAX (|x| / mx)^(steps / EM), or x FMAX / mx without expansion."""
    if EXPAND:
      k = steps * (1.0 / EM)
      mag = FMAX * _exp2(k * (_log2(tl.abs(x), FAST) - libdevice.log2(mx)), FAST)
      y = tl.where(x < 0, -mag, mag)
    else:
      y = x / (mx * (1.0 / FMAX))
    return tl.where(y != y, y, tl.minimum(tl.maximum(y, -FMAX), FMAX))

  @triton.jit
  def store_meta(mx, steps, a_ptr, k_ptr, meta_idx, meta_mask):
    tl.store(a_ptr + meta_idx, mx, mask=meta_mask)
    tl.store(k_ptr + meta_idx, steps.to(tl.uint8), mask=meta_mask)

  @triton.jit
  def _requant(x, q_ptr, a_ptr, k_ptr, offs, meta_idx, mask, meta_mask, FMAX: tl.constexpr,
               LOG2R: tl.constexpr, EXPAND: tl.constexpr, EM: tl.constexpr,
               MAX_K: tl.constexpr, FLOOR: tl.constexpr, NOEXP_K: tl.constexpr,
               FAST: tl.constexpr = False, AXIS: tl.constexpr = 1):
    """Stores tile x quantized per group along tile axis AXIS (as `load_meta`); a group lies
    wholly inside or outside the mask."""
    a = tl.abs(x)
    mx, steps = group_meta(tl.max(a, axis=AXIS), tl.min(nonzero_or_inf(a), axis=AXIS), LOG2R,
                            EXPAND, EM, MAX_K, FLOOR, NOEXP_K)
    y = quantize(x, tl.expand_dims(mx, AXIS), tl.expand_dims(steps, AXIS), FMAX, EXPAND, EM,
                  FAST)
    tl.store(q_ptr + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
    store_meta(mx, steps, a_ptr, k_ptr, meta_idx, meta_mask)

  @triton.jit
  def new_moments(offs, mask, g_ptr, mq_ptr, vq_ptr, m_mx, m_code, v_mx, v_code, gscale, b1,
                   omb1, b2, omb2, M_FMAX: tl.constexpr, V_FMAX: tl.constexpr,
                   EM: tl.constexpr, FAST: tl.constexpr, GCLAMP: tl.constexpr):
    """m' = b1 m + (1 - b1) g and v' = b2 v + (1 - b2) g^2 on a tile, the old moments' codes
    dequantized with their (broadcast) metadata. g: the gradient times gscale (fused global-norm
    clipping: 1 without), finite values clamped to +-GCLAMP (NaN and inf pass), as
    coat_jax.adam_math.adam_moments."""
    m = _dequant(_load(mq_ptr + offs, mask, 0.0).to(tl.float32), m_mx, m_code, M_FMAX, EM, FAST)
    v = _dequant(_load(vq_ptr + offs, mask, 0.0).to(tl.float32), v_mx, v_code, V_FMAX, EM, FAST)
    g = _load(g_ptr + offs, mask, 0.0).to(tl.float32) * gscale
    g = tl.where(tl.abs(g) < float("inf"), tl.minimum(tl.maximum(g, -GCLAMP), GCLAMP), g)
    return b1 * m + omb1 * g, b2 * v + omb2 * (g * g)

  @triton.jit
  def store_param(m, v, offs, mask, p_ptr, o_ptr, lr, wd, eps, inv_sqrt_bc2, bc1,
                   HAS_PARAM: tl.constexpr, OUT_PARAM: tl.constexpr, FAST: tl.constexpr):
    """Stores the new param p - lr (d + wd p) (OUT_PARAM) or the update -lr (d + wd p), with
    d = m / ((sqrt(v) / sqrt(bc2) + eps) bc1) (no wd p without a param)."""
    direction = _div(m, (_sqrt(v, FAST) * inv_sqrt_bc2 + eps) * bc1, FAST)
    if HAS_PARAM:
      p = _load(p_ptr + offs, mask, 0.0).to(tl.float32)
      direction = direction + wd * p
      if OUT_PARAM:
        out = p - lr * direction
      else:
        out = -(lr * direction)
    else:
      out = -(lr * direction)
    tl.store(o_ptr + offs, out.to(o_ptr.dtype.element_ty), mask=mask)

  @triton.jit
  def adam_tile(offs, meta_idx, mask, meta_mask, wd, s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr,
                 mk_ptr, vq_ptr, va_ptr, vk_ptr, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr,
                 vao_ptr, vko_ptr, AXIS: tl.constexpr, HAS_PARAM: tl.constexpr,
                 OUT_PARAM: tl.constexpr, M_FMAX: tl.constexpr, V_FMAX: tl.constexpr,
                 M_LOG2R: tl.constexpr, V_LOG2R: tl.constexpr, EXPAND: tl.constexpr,
                 EM: tl.constexpr, MAX_K: tl.constexpr, FLOOR: tl.constexpr,
                 NOEXP_K: tl.constexpr, FAST: tl.constexpr, GCLAMP: tl.constexpr):
    """The step on one 2-D tile (element offsets `offs`, groups along tile axis AXIS with their
    metadata at `meta_idx`; masks None: none), weight decay `wd`: `new_moments`,
    `store_param`, then each moment requantized per group (`_requant`)."""
    lr, b1, omb1, b2, omb2, eps, inv_sqrt_bc2, bc1, gscale = load_scalars(s_ptr)
    m_mx, m_code = load_meta(ma_ptr, mk_ptr, meta_idx, meta_mask, AXIS)
    v_mx, v_code = load_meta(va_ptr, vk_ptr, meta_idx, meta_mask, AXIS)
    m, v = new_moments(offs, mask, g_ptr, mq_ptr, vq_ptr, m_mx, m_code, v_mx, v_code, gscale,
                        b1, omb1, b2, omb2, M_FMAX, V_FMAX, EM, FAST, GCLAMP)
    store_param(m, v, offs, mask, p_ptr, o_ptr, lr, wd, eps, inv_sqrt_bc2, bc1, HAS_PARAM,
                 OUT_PARAM, FAST)
    _requant(m, mqo_ptr, mao_ptr, mko_ptr, offs, meta_idx, mask, meta_mask, M_FMAX, M_LOG2R,
             EXPAND, EM, MAX_K, FLOOR, NOEXP_K, FAST, AXIS)
    _requant(v, vqo_ptr, vao_ptr, vko_ptr, offs, meta_idx, mask, meta_mask, V_FMAX, V_LOG2R,
             EXPAND, EM, MAX_K, FLOOR, NOEXP_K, FAST, AXIS)
