"""Linear layer y = x @ w in three precision modes ("bf16", "fp8_linear", "coat").

FP8 modes: forward x per-tensor E4M3 and w per-tensor E4M3, one FP8 GEMM (float32 accumulation,
"TN": w is quantized as its transpose (N, K)). Backward: dY per-tensor E5M2 (current scaling),
dX = dY . W^T and dW = X^T . dY as FP8 GEMMs. W is re-quantized in the backward from the parameter
with the forward's amax, a saved scalar (no FP8 copy of W is saved, and W is not reduced again).
"coat" saves only the FP8 x (data + scale), w and that amax; "fp8_linear" the bf16 x, w and amax.
"coat" keeps x itself instead where another op keeps x anyway (`linear`'s keep_x: the attention
output that cuDNN's attention keeps), and x is kept as given, not reshaped (`in_axes`), so that
both ops hold one array.

w is kept as the parameter itself (its dtype, e.g. float32 master weights), not as its cast to the
compute dtype: the cast is redone where it is used (XLA merges the two casts in an unrolled graph).
Inside the scan over layers the parameter is a slice of the scanned input, which JAX forwards to
the backward loop; a cast would be a new per-layer residual, stacked (zero-filled, written and
copied back) for every layer. `linears` runs several linears of one input (Q/K/V, gate/up) and
keeps that input's FP8 copy once, not once per linear.

Every array a "coat" op keeps for its backward (FP8 data and scales, RMSNorm's rstd) is named
`FP8_RESIDUALS` with `jax.ad_checkpoint.checkpoint_name`, so that a remat policy
`save_only_these_names(FP8_RESIDUALS)` keeps exactly those and recomputes the rest.

LINEAR_RESIDUALS is what a "coat" linear fed by RMSNorm or SwiGLU keeps of its FP8 input for dW:
"kept" (default) its transposed codes x^T, 1 byte a value; "remade" nothing of its own: x_q
carries a `RemadeInput` in place of x^T, and the backward remakes x^T from the residuals its
producer keeps anyway (RMSNorm's 1 x 16 codes of its input and rstd; SwiGLU's 1 x 16 codes of
gate and up), quantized with the forward's amax (the forward's scale). The remade codes can
differ from the forward's by the 1 x 16 codes' rounding: a numerics change, in dW only.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from coat_jax import kernels
from coat_jax.formats import get_format
from coat_jax.ops.linear_ablation import option
from coat_jax.precision import check_precision
from coat_jax.quantize import QuantizedArray

FP8_RESIDUALS = "coat_fp8_residuals"
LINEAR_RESIDUALS = ("kept", "remade")


def name_residuals(tree):
  """Marks the arrays of `tree` as FP8 residuals (identity; see the module docstring)."""
  return checkpoint_name(tree, FP8_RESIDUALS)


def check_linear_residuals(value, where: str = "linear_residuals") -> str:
  """Returns `value` if it is one of LINEAR_RESIDUALS, else raises a ValueError naming it."""
  if value not in LINEAR_RESIDUALS:
    raise ValueError(f"{where} must be one of {LINEAR_RESIDUALS}, got {value!r}")
  return value


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class RemadeInput:
  """A linear input's transposed FP8 codes as its backward remakes them (in place of
  `QuantizedArray.data_t`; module docstring, "remade").

  x remade from `arrays`, the residuals of the op that made x (named there), as `kind` says
  ("rmsnorm": (x's 1 x 16 codes, rstd, the norm's scale); "swiglu": (gate's and up's 1 x 16
  codes)), rounded to `dtype`, quantized per tensor with `amax` (the forward's: the same scale)
  and transposed, (K, M): `kernels.remade_codes_t`, how `linear_ablation.ablation`'s
  remake_quantize says.
  """
  arrays: tuple
  amax: jax.Array
  kind: str
  dtype: jnp.dtype

  def tree_flatten(self):
    return (self.arrays, self.amax), (self.kind, self.dtype)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, *aux)

  def codes_t(self) -> jax.Array:
    return kernels.remade_codes_t(self.kind, self.arrays, self.amax, self.dtype, "e4m3",
                                  how=option("remake_quantize"))


def remade_input(x: jax.Array, amax, arrays: tuple, kind: str) -> QuantizedArray:
  """Per-tensor E4M3 of a linear's input x (..., K) for the forward GEMM, carrying a
  `RemadeInput(arrays, amax, kind)` instead of x^T's codes. amax: max|x| where the producer has
  it, else reduced here; named FP8_RESIDUALS (the backward quantizes with it)."""
  amax = name_residuals(jnp.max(jnp.abs(x)) if amax is None else amax)
  q = _quantize_x(x.reshape(-1, x.shape[-1]), amax=amax)
  return QuantizedArray(q.data.reshape(x.shape), q.scale, q.fmt, q.group_size,
                        data_t=RemadeInput(tuple(arrays), amax, kind, jnp.dtype(x.dtype)))


def input_residuals(x_q: QuantizedArray):
  """(x^T, scale): what a linear keeps of its FP8 input x_q for dW, named FP8_RESIDUALS; a
  `RemadeInput` x^T as it is (its arrays are already named by their producer: named again they
  would be new arrays, which the scan over layers stacks a second time)."""
  if isinstance(x_q.data_t, RemadeInput):
    return x_q.data_t, name_residuals(x_q.scale)
  return name_residuals((x_q.data_t, x_q.scale))


def input_codes_t(x_t) -> jax.Array:
  """The kept x^T codes, or those a `RemadeInput` remakes (an op of several linears of one input
  calls this once and gives each linear's `backward_gemms` the codes: each remake is a pass)."""
  return x_t.codes_t() if isinstance(x_t, RemadeInput) else x_t


def forward_operand(x_q: QuantizedArray) -> QuantizedArray:
  """x_q as the forward GEMM's operand: without a `RemadeInput` (the kernels know only arrays)."""
  return dataclasses.replace(x_q, data_t=None) if isinstance(x_q.data_t, RemadeInput) else x_q


def quantize_input(x: jax.Array, amax: jax.Array | None = None) -> QuantizedArray:
  """Per-tensor E4M3 of a linear layer's input x (..., K), with its K-major transpose.

  data is x's shape (the forward GEMM's operand); data_t is (K, M), M = prod(x.shape[:-1]), made
  in the same pass: the dW GEMM's operand, and the copy the backward keeps. amax: max|x| when
  the producer already has it (e.g. SwiGLU's fused kernel), else found as `_amax` says.
  """
  q = _quantize_x(x.reshape(-1, x.shape[-1]), with_transpose=True, amax=amax)
  return QuantizedArray(q.data.reshape(x.shape), q.scale, q.fmt, q.group_size, data_t=q.data_t)


def _quantize_x(x, *, with_transpose=False, amax=None) -> QuantizedArray:
  """Per-tensor E4M3 of a linear's input (amax given, or from `_amax`), by the kernel or XLA's
  ops as `linear_ablation.ablation(activation_quantize=...)` says."""
  amax = _amax(x) if amax is None else amax
  return kernels.quantize_per_tensor(x, "e4m3", with_transpose=with_transpose, amax=amax,
                                     producer_fusion=option("activation_quantize") == "xla")


def _amax(x):
  """max|x| for a per-tensor activation quantize: an XLA reduction that XLA can fuse into x's
  producer (`amax="fused"`, default), or None under `linear_ablation.ablation(amax="kernel")`: the
  quantize's own stage-1 pass."""
  return jnp.max(jnp.abs(x)) if option("amax") == "fused" else None


def weight_amax(w):
  """max|w| of a weight for its per-tensor quantize, as an XLA reduction (fusable into the cast
  that makes w): the quantize then skips its stage-1 kernel. The same value as the kernel's
  two-stage max (NaN propagates), and weights are small, so it costs no time; it saves a Mosaic
  GPU module per weight shape, each compiled with the step."""
  return jnp.max(jnp.abs(w))


def _quantize_weight(w, amax, *, with_transpose=False, backward=False,
                     cast_dtype=None) -> QuantizedArray:
  """Per-tensor E4M3 of a weight (its cast, or with cast_dtype the parameter, quantized as
  w.astype(cast_dtype): `kernels.quantize_per_tensor`) with the given amax (`weight_amax`): the
  dispatch's kernel (`weight_quantize="kernel"`; "forward_kernel", default, in the forward only),
  else XLA's ops, fused with the cast and any transpose of w (see `linear_ablation.ablation`)."""
  choice = option("weight_quantize")
  by_xla = choice == "xla" or (choice == "forward_kernel" and backward)
  return kernels.quantize_per_tensor(w, "e4m3", amax=amax, with_transpose=with_transpose,
                                     producer_fusion=by_xla, cast_dtype=cast_dtype)


def _fwd_gemm(xq, w, out_dtype):
  """(..., K) FP8 x times w (K, N) in the TN layout: w (cast to out_dtype) quantized as (N, K).

  Returns (y, kept): kept = (amax, codes, scale) for the backward's quantize of w: max|w cast| (a
  scalar in out_dtype: the backward reuses it instead of reducing w again) and None, None; or,
  under `linear_ablation.ablation(weight_quant="once")`, None and the FP8 (K, N) codes and their
  scale.
  """
  if option("weight_quant") == "once":   # the parameter, rounded to out_dtype as it is read
    amax = weight_amax(w)   # max|W|, rounded to out_dtype by the quantize: max|W cast|
    q = _quantize_weight(w, amax, with_transpose=True, cast_dtype=out_dtype)
    wq, codes, scale = QuantizedArray(q.data_t, q.scale, "e4m3"), q.data, q.scale
    amax = None   # the backward takes the codes: no amax kept
  else:
    wc = w.astype(out_dtype)
    amax = weight_amax(wc)
    if option("weight_transpose") == "codes":
      q = _quantize_weight(wc, amax, with_transpose=True)   # W read as it lies; codes transposed
      wq, codes, scale = QuantizedArray(q.data_t, q.scale, "e4m3"), None, None
    else:
      wq, codes, scale = _quantize_weight(jnp.swapaxes(wc, 0, 1), amax), None, None
  dn = (((xq.data.ndim - 1,), (1,)), ((), ()))
  return (kernels.fp8_dot_general(forward_operand(xq), wq, dn, out_dtype),
          name_residuals((amax, codes, scale)))


def backward_gemms(x_t, x_scale, w, g, kept, g_amax=None):
  """dX (..., K) and dW (K, N, w.dtype) from the saved FP8 x^T (K, M), param w, cotangent g (..., N)
  and the forward's `kept` (w's amax; its (K, N) codes and scale under weight_quant="once");
  g_amax: max|g| where g's producer made it (else reduced here).

  Both GEMMs are TN: dX = gq (M, N) . wq (K, N)^T, and dW = x^T (K, M) . (g^T (N, M))^T, whose
  M-major operands are the saved x^T and g's transposed copy from the fused quantize+transpose.
  """
  k, n = w.shape
  gq = kernels.quantize_per_tensor(g.reshape(-1, n), "e5m2", with_transpose=True,
                                  amax=_amax(g) if g_amax is None else g_amax,
                                  producer_fusion=option("gradient_quantize") == "xla")
  # (K, N): contracts N (TN); the forward's codes when it kept them, else W quantized again
  # with the forward's amax (the same scale).
  amax, codes, scale = kept
  if codes is not None:
    wq = QuantizedArray(codes, scale, "e4m3")
  else:
    wq = _quantize_weight(w.astype(g.dtype), amax, backward=True)
  tn = (((1,), (1,)), ((), ()))
  dx = kernels.fp8_dot_general(gq, wq, tn, g.dtype).reshape(g.shape[:-1] + (k,))
  x_tq = QuantizedArray(input_codes_t(x_t), x_scale, "e4m3")
  g_tq = QuantizedArray(gq.data_t, gq.scale, gq.fmt)
  # The GEMM writes dW in w's dtype when it can (bf16 or float32: the float32 accumulator
  # rounded once, as a cast after it would): no separate pass converting a float32 dW.
  dw_dtype = w.dtype if jnp.dtype(w.dtype) in kernels.GEMM_OUT_DTYPES else jnp.float32
  dw = kernels.fp8_dot_general(x_tq, g_tq, tn, dw_dtype)
  return dx, dw.astype(w.dtype)


def zero_input_cotangent(dx, x_t, x_scale) -> QuantizedArray:
  """The cotangent of an op's x_q argument: zero (x_q carries no gradient; it flows through x),
  built from shapes so that nothing but x^T (or its `RemadeInput`) is kept for the backward."""
  return QuantizedArray(jnp.zeros(dx.shape, get_format("e4m3").dtype), jnp.zeros_like(x_scale),
                        "e4m3", 0, data_t=jax.tree.map(jnp.zeros_like, x_t))


def _flat(x, in_shape):
  """x (..., *in_shape) -> (..., K): the trailing in_shape axes as one."""
  return x.reshape(x.shape[:x.ndim - len(in_shape)] + (-1,)) if len(in_shape) > 1 else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _linear_fp8(x, w, save_bf16, in_shape):
  return _fwd_gemm(_quantize_x(_flat(x, in_shape)), w, x.dtype)[0]


def _linear_fp8_fwd(x, w, save_bf16, in_shape):
  xf = _flat(x, in_shape)
  if save_bf16:  # x itself is kept (as given: not a reshaped copy) with its amax, and quantized
    # again in the backward: the forward's codes.
    amax = _amax(xf)
    y, kept = _fwd_gemm(_quantize_x(xf, amax=amax), w, x.dtype)
    return y, (x, amax, w, kept)
  xq = quantize_input(xf)
  y, kept = _fwd_gemm(xq, w, x.dtype)
  return y, (*name_residuals((xq.data_t, xq.scale)), w, kept)


def _linear_fp8_bwd(save_bf16, in_shape, res, g):
  saved, x_scale, w, kept = res  # x itself and its amax (save_bf16), or its FP8 x^T and scale
  if save_bf16:
    xq = quantize_input(_flat(saved, in_shape), amax=x_scale)
    dx, dw = backward_gemms(xq.data_t, xq.scale, w, g, kept)
  else:
    dx, dw = backward_gemms(saved, x_scale, w, g, kept)
  return dx.reshape(g.shape[:-1] + in_shape), dw


_linear_fp8.defvjp(_linear_fp8_fwd, _linear_fp8_bwd)


@jax.custom_vjp
def _linear_coat_q(x, w, x_q):
  return _fwd_gemm(x_q, w, x.dtype)[0]


def _linear_coat_q_fwd(x, w, x_q):
  y, kept = _fwd_gemm(x_q, w, x.dtype)
  return y, (*input_residuals(x_q), w, kept)


def _linear_coat_q_bwd(res, g):
  x_t, x_scale, w, kept = res
  dx, dw = backward_gemms(x_t, x_scale, w, g, kept)
  return dx, dw, zero_input_cotangent(dx, x_t, x_scale)


_linear_coat_q.defvjp(_linear_coat_q_fwd, _linear_coat_q_bwd)


@jax.custom_vjp
def _linears_coat_q(x, ws, x_q):
  return tuple(_fwd_gemm(x_q, w, x.dtype)[0] for w in ws)


def _linears_coat_q_fwd(x, ws, x_q):
  outs = [_fwd_gemm(x_q, w, x.dtype) for w in ws]
  return (tuple(y for y, _ in outs),
          (*input_residuals(x_q), ws, tuple(k for _, k in outs)))


def _linears_coat_q_bwd(res, gs):
  x_t, x_scale, ws, kepts = res
  codes_t = input_codes_t(x_t)   # a remade x^T made once for all the linears
  grads = [backward_gemms(codes_t, x_scale, w, g, k) for w, g, k in zip(ws, gs, kepts)]
  dx = functools.reduce(jnp.add, [dx for dx, _ in grads])
  return dx, tuple(dw for _, dw in grads), zero_input_cotangent(dx, x_t, x_scale)


_linears_coat_q.defvjp(_linears_coat_q_fwd, _linears_coat_q_bwd)


def check_weight(x, w, in_axes: int = 1):
  k = math.prod(x.shape[x.ndim - in_axes:]) if 0 < in_axes <= x.ndim else None
  if w.ndim != 2 or k != w.shape[0]:
    need = "x[..., K]" if in_axes == 1 else f"x's last {in_axes} axes of K values in all"
    raise ValueError(f"linear: x shape {x.shape} does not match w shape {w.shape} "
                     f"(need {need} and w[K, N])")


def check_input_q(x, x_q):
  if x_q.shape != x.shape or not x_q.per_tensor or x_q.data_t is None:
    raise ValueError(f"linear: x_q must be `quantize_input(x)` (per-tensor, with data_t) for x "
                     f"of shape {x.shape}, got shape {x_q.shape}")


@functools.partial(jax.checkpoint, prevent_cse=False, static_argnums=(2,))
def _matmul_keep_param(x, w, in_shape):
  """bf16 x (..., *in_shape) @ w: the backward keeps x as given and the parameter w (not its cast
  or a reshaped x; module docstring) and recasts w."""
  return jnp.matmul(_flat(x, in_shape), w.astype(x.dtype))


def linears(x: jax.Array, ws, *, mode: str, x_q=None) -> tuple[jax.Array, ...]:
  """(x @ w for w in ws): several linears of one input, e.g. Q/K/V or gate/up.

  Equal to `tuple(linear(x, w, mode=mode, x_q=x_q) for w in ws)`; in "coat" with x_q the FP8 x^T
  is kept once for all of them (with separate linears each keeps its own reference to it, and
  the scan over layers stacks each one separately).
  """
  check_precision(mode, "linears: mode")
  ws = tuple(ws)
  for w in ws:
    check_weight(x, w)
  if mode == "coat" and x_q is not None and len(ws) > 1:
    check_input_q(x, x_q)
    return _linears_coat_q(x, ws, x_q)
  return tuple(linear(x, w, mode=mode, x_q=x_q) for w in ws)


def linear(x: jax.Array, w: jax.Array, *, mode: str, x_q=None, in_axes: int = 1,
           keep_x: bool = False) -> jax.Array:
  """y = x @ w.

  Args:
    x: (..., K) bf16 or float32; with in_axes > 1, (..., *in) whose last in_axes axes hold the
      K inputs (the attention output (B, S, H, Dh) as the attention made it).
    w: (K, N) parameter (in, out), any float dtype; computed in x.dtype, its gradient in w.dtype.
    mode: "bf16" | "fp8_linear" | "coat".
    x_q: optional per-tensor E4M3 QuantizedArray of x made upstream (fp8 modes use it instead
      of re-quantizing x; its cotangent is zero, the gradient flows through x); in_axes 1 only.
    in_axes: how many trailing axes of x the product contracts. The backward keeps x as given,
      not a reshaped copy, so that where another op keeps x too the two are one array.
    keep_x: "coat": keep x itself (and its amax) for the backward and quantize it again there,
      the forward's codes, instead of keeping its FP8 transposed copy; for an x that another op
      keeps anyway (`attention_keeps_output`). bf16 and fp8_linear keep x itself always.
  Returns:
    (..., N) in x.dtype.
  """
  check_precision(mode, "linear: mode")
  check_weight(x, w, in_axes)
  if x_q is not None and (in_axes > 1 or keep_x):
    raise ValueError(f"linear: x_q is for in_axes=1 without keep_x, got in_axes={in_axes}, "
                     f"keep_x={keep_x}")
  in_shape = x.shape[x.ndim - in_axes:]
  if mode == "bf16":
    if in_axes == 1 and w.dtype == x.dtype:
      return jnp.matmul(x, w)
    return _matmul_keep_param(x, w, in_shape)
  if x_q is not None:
    check_input_q(x, x_q)
    if mode == "coat":
      return _linear_coat_q(x, w, x_q)
  return _linear_fp8(x, w, mode == "fp8_linear" or keep_x, in_shape)
