"""The Triton building blocks of the fused COAT AdamW step: per-element math, the moments'
dequantize / requantize with dynamic range expansion, the step on one 2-D tile (`adam_tile`).

adam_step_triton.py's row and column kernels are built from these; the math per group of G
elements is coat_jax.adam_math's and coat_jax.expansion's. A tile's groups run along its axis AXIS (1: rows of G, 0: columns of
G) with one metadata value per group at `meta_idx`; masks None build no mask at all (EVEN tiles).

Written for few instructions per element (the step is as much issue-bound as memory-bound on
Hopper: ~10 MUFU operations per element): everything that is per group (the dequantize and
quantize coefficients, the new metadata) is computed once per group value a thread holds, and
per element
  decayed old moment  b x = sign(q) exp2(a log2(|q| / FMAX) + log2(b mx))   (a = 1 / k)
  new moment          m' = b1 m + (1 - b1) g  (one FFMA),  v' = b2 v + ((1 - b2) g) g
  param               p - lr (m' / (sqrt(v') A + B) + wd p),  A = bc1 / sqrt(bc2), B = eps bc1
  code                sign(x) min(exp2(k log2|x| + log2 FMAX - k log2 mx), FMAX)
with the sign copied bitwise. Equal to the reference up to float32 rounding (the power form is
the reference's `exp2(log2 mx + log2(|q| / FMAX) / k)`; it also takes k = 1 groups, which the
reference scales linearly). Precise math: libdevice exp2 / log2 (as XLA), IEEE sqrt
(`sqrt_rn`), Triton's `/` (div.full.f32, what XLA:GPU emits); FAST: one MUFU instruction each,
also for the per-group log2 of the new metadata (log2(mx / mn) as log2 mx - log2 mn: a group
whose max / min is within ~2^-20 of 1 may get k = 1 where the reference gets the largest k; both
store the same codes).
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
    ~2^-22): PTX is its inline-asm line."""
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
  def _copysign(mag, like):
    """mag (>= 0, or NaN) with the sign bit of like (float32): one bitwise instruction."""
    bits = mag.to(tl.uint32, bitcast=True) | (like.to(tl.uint32, bitcast=True) & 0x80000000)
    return bits.to(tl.float32, bitcast=True)

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
  def load_meta(a_ptr, k_ptr, meta_idx, meta_mask, log2_decay, EM: tl.constexpr,
                AXIS: tl.constexpr, FAST: tl.constexpr):
    """A moment's per-group dequantize coefficients from its metadata (amax mx, k code) at
    meta_idx (1-D), expanded along tile axis AXIS (the groups' axis) to broadcast over the tile:
    (a, c) = (EM / code = 1 / k, log2(decay mx)), log2_decay = log2 of the moment's beta."""
    mx = _load(a_ptr + meta_idx, meta_mask, 1.0)
    code = _load(k_ptr + meta_idx, meta_mask, 1).to(tl.float32)
    a = _div(EM, code, FAST)
    c = _log2(mx, FAST) + log2_decay
    return tl.expand_dims(a, AXIS), tl.expand_dims(c, AXIS)

  @triton.jit
  def _decayed(q, a, c, FMAX: tl.constexpr, FAST: tl.constexpr):
    """decay x for codes q (float32) of groups with coefficients a, c (`load_meta`):
    sign(q) exp2(a log2(|q| / FMAX) + c)."""
    mag = _exp2(a * _log2(tl.abs(q) * (1.0 / FMAX), FAST) + c, FAST)
    return _copysign(mag, q)

  @triton.jit
  def nonzero_or_inf(a):
    """|x| where nonzero, else inf: its minimum is the smallest nonzero |x| (inf: none)."""
    return tl.where(a > 0, a, float("inf"))

  @triton.jit
  def group_ranges(m, v, AXIS: tl.constexpr):
    """Per group along tile axis AXIS: max |m|, smallest nonzero |m| (inf: none), the same of
    v."""
    ma = tl.abs(m)
    va = tl.abs(v)
    return (tl.max(ma, axis=AXIS), tl.min(nonzero_or_inf(ma), axis=AXIS), tl.max(va, axis=AXIS),
            tl.min(nonzero_or_inf(va), axis=AXIS))

  @triton.jit
  def group_meta(amax, amin_nz, log2_fmax, FMAX: tl.constexpr, LOG2R: tl.constexpr,
                 EXPAND: tl.constexpr, EM: tl.constexpr, MAX_K: tl.constexpr,
                 FLOOR: tl.constexpr, NOEXP_K: tl.constexpr, FAST: tl.constexpr):
    """New metadata of groups with max |x| amax and smallest nonzero |x| amin_nz (inf: none):
    mx = amax + FLOOR and the k code steps = clamp(floor(EM LOG2R / log2(mx / mn)), 1, MAX_K),
    mn = amin_nz + FLOOR (steps = EM where mx == mn or no nonzero: k = 1); NOEXP_K without
    expansion. Also the quantize coefficients (k, c) = (steps / EM, log2_fmax - k log2 mx), or
    without expansion (1, FMAX / mx) (`quantize`). Returns (mx, steps, k, c)."""
    mx = amax + FLOOR
    if EXPAND:
      mn = tl.where(amin_nz == float("inf"), mx, amin_nz + FLOOR)
      if FAST:
        log2_mx = _log2(mx, FAST)
        lr = log2_mx - _log2(mn, FAST)
      else:
        log2_mx = libdevice.log2(mx)
        lr = libdevice.log2(mx / mn)
      ok = lr > 0
      steps = tl.floor(_div(LOG2R, tl.where(ok, lr, 1.0), FAST) * EM)
      steps = tl.where(ok, steps, EM)
      steps = tl.minimum(tl.maximum(steps, 1.0), MAX_K)
      k = steps * (1.0 / EM)
      c = log2_fmax - k * log2_mx
    else:
      steps = tl.zeros_like(mx) + NOEXP_K
      k = tl.zeros_like(mx) + 1.0
      c = FMAX / mx
    return mx, steps, k, c

  @triton.jit
  def quantize(x, k, c, FMAX: tl.constexpr, EXPAND: tl.constexpr, FAST: tl.constexpr):
    """x's codes (float32, at most FMAX in magnitude, NaN kept) in groups with quantize
    coefficients k, c (`group_meta`, broadcast): sign(x) exp2(k log2|x| + c) = sign(x) FMAX
    (|x| / mx)^k, or x FMAX / mx without expansion."""
    if EXPAND:
      mag = _exp2(k * _log2(tl.abs(x), FAST) + c, FAST)
    else:
      mag = tl.abs(x) * c
    mag = tl.minimum(mag, FMAX, propagate_nan=tl.PropagateNan.ALL)
    return _copysign(mag, x)

  @triton.jit
  def store_meta(mx, steps, a_ptr, k_ptr, meta_idx, meta_mask):
    tl.store(a_ptr + meta_idx, mx, mask=meta_mask)
    tl.store(k_ptr + meta_idx, steps.to(tl.uint8), mask=meta_mask)

  @triton.jit
  def new_moments(offs, mask, g_ptr, mq_ptr, vq_ptr, m_a, m_c, v_a, v_c, gscale, omb1, omb2,
                  M_FMAX: tl.constexpr, V_FMAX: tl.constexpr, FAST: tl.constexpr,
                  GCLAMP: tl.constexpr):
    """m' = b1 m + (1 - b1) g and v' = b2 v + (1 - b2) g^2 on a tile, b1 m and b2 v the old
    codes dequantized with their decayed coefficients (`load_meta`). g: the gradient times gscale
    (fused global-norm clipping: 1 without), finite values clamped to +-GCLAMP (NaN and inf
    pass), as coat_jax.adam_math.adam_moments."""
    m = _decayed(_load(mq_ptr + offs, mask, 0.0).to(tl.float32), m_a, m_c, M_FMAX, FAST)
    v = _decayed(_load(vq_ptr + offs, mask, 0.0).to(tl.float32), v_a, v_c, V_FMAX, FAST)
    g = _load(g_ptr + offs, mask, 0.0).to(tl.float32) * gscale
    g = tl.where(tl.abs(g) < float("inf"), tl.minimum(tl.maximum(g, -GCLAMP), GCLAMP), g)
    return omb1 * g + m, (omb2 * g) * g + v

  @triton.jit
  def store_param(m, v, offs, mask, p_ptr, o_ptr, lr, wd, den_a, den_b,
                  HAS_PARAM: tl.constexpr, OUT_PARAM: tl.constexpr, FAST: tl.constexpr):
    """Stores the new param p - lr (d + wd p) (OUT_PARAM) or the update -lr (d + wd p), with
    d = m / (sqrt(v) den_a + den_b) (den_a = bc1 / sqrt(bc2), den_b = eps bc1; no wd p without
    a param)."""
    direction = _div(m, _sqrt(v, FAST) * den_a + den_b, FAST)
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
  def _store_codes(x, q_ptr, offs, mask, k, c, FMAX: tl.constexpr, EXPAND: tl.constexpr,
                   AXIS: tl.constexpr, FAST: tl.constexpr):
    y = quantize(x, tl.expand_dims(k, AXIS), tl.expand_dims(c, AXIS), FMAX, EXPAND, FAST)
    tl.store(q_ptr + offs, y.to(q_ptr.dtype.element_ty), mask=mask)

  @triton.jit
  def adam_tile(offs, meta_idx, mask, meta_mask, wd, s_ptr, p_ptr, g_ptr, mq_ptr, ma_ptr,
                mk_ptr, vq_ptr, va_ptr, vk_ptr, o_ptr, mqo_ptr, mao_ptr, mko_ptr, vqo_ptr,
                vao_ptr, vko_ptr, AXIS: tl.constexpr, HAS_PARAM: tl.constexpr,
                OUT_PARAM: tl.constexpr, M_FMAX: tl.constexpr, V_FMAX: tl.constexpr,
                M_LOG2R: tl.constexpr, V_LOG2R: tl.constexpr, EXPAND: tl.constexpr,
                EM: tl.constexpr, MAX_K: tl.constexpr, FLOOR: tl.constexpr,
                NOEXP_K: tl.constexpr, FAST: tl.constexpr, GCLAMP: tl.constexpr):
    """The step on one 2-D tile (element offsets `offs`, groups along tile axis AXIS with their
    metadata at `meta_idx`; masks None: none), weight decay `wd`, in one pass: `new_moments`,
    `store_param`, each moment's group ranges (`group_ranges`) and new metadata
    (`group_meta`), the codes (`quantize`). A group lies wholly inside or outside the mask."""
    lr, b1, omb1, b2, omb2, eps, inv_sqrt_bc2, bc1, gscale = load_scalars(s_ptr)
    m_a, m_c = load_meta(ma_ptr, mk_ptr, meta_idx, meta_mask, _log2(b1, FAST), EM, AXIS, FAST)
    v_a, v_c = load_meta(va_ptr, vk_ptr, meta_idx, meta_mask, _log2(b2, FAST), EM, AXIS, FAST)
    m, v = new_moments(offs, mask, g_ptr, mq_ptr, vq_ptr, m_a, m_c, v_a, v_c, gscale, omb1,
                       omb2, M_FMAX, V_FMAX, FAST, GCLAMP)
    store_param(m, v, offs, mask, p_ptr, o_ptr, lr, wd, inv_sqrt_bc2 * bc1, eps * bc1,
                HAS_PARAM, OUT_PARAM, FAST)
    m_hi, m_lo, v_hi, v_lo = group_ranges(m, v, AXIS)
    one = tl.zeros_like(b1) + 1.0
    m_mx, m_steps, m_k, m_c = group_meta(m_hi, m_lo, _log2(one * M_FMAX, FAST), M_FMAX, M_LOG2R,
                                         EXPAND, EM, MAX_K, FLOOR, NOEXP_K, FAST)
    v_mx, v_steps, v_k, v_c = group_meta(v_hi, v_lo, _log2(one * V_FMAX, FAST), V_FMAX, V_LOG2R,
                                         EXPAND, EM, MAX_K, FLOOR, NOEXP_K, FAST)
    _store_codes(m, mqo_ptr, offs, mask, m_k, m_c, M_FMAX, EXPAND, AXIS, FAST)
    _store_codes(v, vqo_ptr, offs, mask, v_k, v_c, V_FMAX, EXPAND, AXIS, FAST)
    store_meta(m_mx, m_steps, mao_ptr, mko_ptr, meta_idx, meta_mask)
    store_meta(v_mx, v_steps, vao_ptr, vko_ptr, meta_idx, meta_mask)
