"""o_proj and the attention output: where the attention keeps its output for its backward (cuDNN's
fused attention does), o_proj keeps that same array, not a reshaped copy nor (coat) an FP8 copy;
the values and gradients are those of the linear on the reshaped output.

cuDNN's attention does not run on the CPU; `keeping_attention` stands in for it (an attention
whose custom VJP keeps q, k, v and its output, as cuDNN's does)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax import ops
from coat_jax.nn import layers
from coat_jax.precision import PRECISIONS

B, S, HIDDEN, HEADS, HEAD_DIM = 2, 64, 192, 4, 32   # o_proj's K = 128, not the hidden size


def _attend(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True)


@jax.custom_vjp
def keeping_attention(q, k, v):
  return _attend(q, k, v)


def _keeping_fwd(q, k, v):
  o = _attend(q, k, v)
  return o, (q, k, v, o)


def _keeping_bwd(res, g):
  q, k, v, _ = res
  return jax.vjp(_attend, q, k, v)[1](g)


keeping_attention.defvjp(_keeping_fwd, _keeping_bwd)


def kept_arrays(f, *args):
  """[(shape, dtype)] of the distinct arrays f's traced pullback keeps, its arguments left out
  (as `models.layer_loop` keeps them for each layer)."""
  kept = []

  def traced(*args):
    y, pullback = jax.vjp(f, *args)
    arg_leaves = jax.tree.leaves(args)
    for leaf in jax.tree.leaves(pullback):
      if (isinstance(leaf, jax.core.Tracer) and not any(leaf is a for a in arg_leaves)
              and not any(leaf is a for a in kept)):
        kept.append(leaf)
    return y

  jax.make_jaxpr(traced)(*args)
  return [(tuple(a.shape), jnp.dtype(a.dtype)) for a in kept]


def attention_kept(mode):
  """What an `Attention` module of `mode` keeps for its backward (`kept_arrays`)."""
  module = layers.Attention(HIDDEN, HEADS, HEADS, HEAD_DIM, mode=mode, dtype=jnp.bfloat16,
                            param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(module)
  cos, sin = ops.rope_frequencies(HEAD_DIM, S)
  x = jax.random.normal(jax.random.key(1), (B, S, HIDDEN), jnp.bfloat16)
  return kept_arrays(lambda p, x: nnx.merge(graphdef, p)(x, None, cos, sin), params, x)


def assert_output_kept_once(kept):
  heads = [s for s, d in kept if s == (B, S, HEADS, HEAD_DIM) and d == jnp.bfloat16]
  assert len(heads) == 4, kept       # q, k, v and the output, each once
  assert (B, S, HEADS * HEAD_DIM) not in [s for s, _ in kept], kept   # no reshaped copy
  # no FP8 copy of the attention output (o_proj's x^T would be (K, M) = (128, B * S))
  assert (HEADS * HEAD_DIM, B * S) not in [s for s, _ in kept], kept


@pytest.mark.parametrize("mode", PRECISIONS)
def test_o_proj_keeps_the_attention_output_itself(mode, monkeypatch):
  monkeypatch.setattr(layers.ops, "attention", lambda q, k, v, **kw: keeping_attention(q, k, v))
  monkeypatch.setattr(layers.ops, "attention_keeps_output", lambda q, **kw: True)
  assert_output_kept_once(attention_kept(mode))


def test_o_proj_keeps_an_fp8_copy_where_the_attention_does_not(monkeypatch):
  """The XLA attention recomputes its output in the backward: coat's o_proj keeps its FP8 x^T."""
  monkeypatch.setattr(layers.ops, "attention_keeps_output", lambda q, **kw: False)
  kept = attention_kept("coat")
  assert ((HEADS * HEAD_DIM, B * S), jnp.dtype(jnp.float8_e4m3fn)) in kept, kept


@pytest.mark.parametrize("mode,keep_x", [("bf16", False), ("fp8_linear", False),
                                         ("coat", False), ("coat", True)])
def test_linear_of_the_unreshaped_output_is_the_linear_of_the_reshaped(mode, keep_x):
  """Same values and gradients, bit for bit: keep_x quantizes the kept x again in the backward
  with the forward's amax, so its codes are the forward's."""
  seed = 3
  print(f"seed {seed}")
  ko, kw, kg = jax.random.split(jax.random.key(seed), 3)
  o = jax.random.normal(ko, (B, S, HEADS, HEAD_DIM), jnp.bfloat16)
  w = 0.05 * jax.random.normal(kw, (HEADS * HEAD_DIM, HIDDEN), jnp.float32)
  g = jax.random.normal(kg, (B, S, HIDDEN), jnp.bfloat16)
  flat = lambda o, w: ops.linear(o.reshape(B, S, -1), w, mode=mode)
  whole = lambda o, w: ops.linear(o, w, mode=mode, in_axes=2, keep_x=keep_x)
  (y0, pb0), (y1, pb1) = jax.vjp(flat, o, w), jax.vjp(whole, o, w)
  (do0, dw0), (do1, dw1) = pb0(g), pb1(g)
  assert do1.shape == o.shape and dw1.dtype == w.dtype
  for a, b in ((y0, y1), (do0, do1), (dw0, dw1)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all() and np.abs(a).max() > 0
    np.testing.assert_array_equal(a, b)


def test_linear_keep_x_and_in_axes_errors():
  o = jnp.ones((B, S, HEADS, HEAD_DIM), jnp.bfloat16)
  w = jnp.ones((HEADS * HEAD_DIM, HIDDEN), jnp.float32)
  with pytest.raises(ValueError, match="last 2 axes"):
    ops.linear(o, w.T, mode="coat", in_axes=2)
  x = o.reshape(B, S, -1)
  with pytest.raises(ValueError, match="x_q is for in_axes=1 without keep_x"):
    ops.linear(x, w, mode="coat", x_q=ops.quantize_input(x), keep_x=True)
  module = layers.Linear(HEADS * HEAD_DIM + 1, HIDDEN, mode="coat", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=f"hold {HEADS * HEAD_DIM} values"):
    module(o, in_axes=2)


def test_attention_keeps_output_says_which_attention_keeps_it():
  q = jnp.ones((B, S, HEADS, HEAD_DIM), jnp.bfloat16)
  assert ops.attention_keeps_output(q, implementation="cudnn")
  assert not ops.attention_keeps_output(q, implementation="cudnn", residuals="fp8")
  assert not ops.attention_keeps_output(q, implementation="xla")
  # on the CPU (and on several devices) the default is XLA's attention
  assert ops.attention_keeps_output(q) == (jax.default_backend() == "gpu"
                                           and jax.device_count() == 1)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16", "coat"])
def test_o_proj_keeps_cudnn_attention_output(mode):
  """On the GPU, cuDNN's own attention: its output kept once, no copy of it (the stand-in's
  claim, for the attention the GPU runs)."""
  assert ops.attention_keeps_output(jnp.zeros((B, S, HEADS, HEAD_DIM), jnp.bfloat16))
  assert_output_kept_once(attention_kept(mode))
