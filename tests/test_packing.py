"""Loss masks and packed sequences: the masked loss against a hand-computed one (fused and logits
paths), and attention / the model on packed rows against each example run alone (values and
gradients, relative L2)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax import ops
from coat_jax.models import Llama, LlamaConfig
from coat_jax.models.llama import segment_positions


def rel_l2(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def hand_masked_loss(h, w, labels, mask):
  """(sum_i m_i (logsumexp(z_i) - z_i[y_i]) / sum_i m_i, dh, dw) in float64 numpy, z = h w."""
  h64, w64 = np.asarray(h, np.float64), np.asarray(w, np.float64)
  z = h64 @ w64
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  y = np.asarray(labels)[..., None]
  picked = np.take_along_axis(np.log(p), y, -1)[..., 0]
  m = np.asarray(mask, np.float64)
  dz = (p - (np.arange(z.shape[-1]) == y)) * (m / m.sum())[..., None]
  d = h64.shape[-1]
  return (float((-picked * m).sum() / m.sum()), dz @ w64.T,
          h64.reshape(-1, d).T @ dz.reshape(-1, z.shape[-1]))


@pytest.mark.parametrize("chunk", [5, 64])
def test_masked_loss_fused_and_plain_equal_hand_computed(chunk, rng):
  """Values and gradients (dh, dW) of both loss paths against float64 numpy."""
  b, s, d, v = 2, 12, 16, 37
  h = jnp.asarray(rng.standard_normal((b, s, d)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((d, v)) * 0.3, jnp.float32)
  labels = jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32)
  mask = jnp.asarray(rng.random((b, s)) < 0.4, jnp.int32).at[0, 0].set(1)
  want, dh, dw = hand_masked_loss(h, w, labels, mask)
  assert abs(hand_masked_loss(h, w, labels, np.ones((b, s)))[0] - want) > 1e-3   # mask matters
  fused = lambda h, w: ops.lm_head_loss(h, w, labels, chunk_tokens=chunk, mask=mask)
  plain = lambda h, w: ops.masked_mean(ops.softmax_cross_entropy(ops.lm_head(h, w), labels),
                                       mask)
  for f in (fused, plain):
    loss, (gh, gw) = jax.jit(jax.value_and_grad(f, (0, 1)))(h, w)
    assert abs(float(loss) - want) < 1e-5 * abs(want)
    assert rel_l2(gh, dh) < 1e-5 and rel_l2(gw, dw) < 1e-5
    assert np.all(np.asarray(gh)[np.asarray(mask) == 0] == 0)


def test_tied_masked_loss_and_empty_mask(rng):
  h = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)
  e = jnp.asarray(rng.standard_normal((11, 8)) * 0.3, jnp.float32)
  labels = jnp.asarray(rng.integers(0, 11, (3,)), jnp.int32)

  @jax.jit
  def loss_and_dh(h, mask):
    f = lambda h: ops.lm_head_loss(h, e, labels, tied=True, chunk_tokens=2, mask=mask)
    return jax.value_and_grad(f)(h)

  mask = jnp.asarray([1, 0, 1])
  got, gh = loss_and_dh(h, mask)
  want, dh, _ = hand_masked_loss(h, e.T, labels, mask)
  assert abs(float(got) - want) < 1e-5 and rel_l2(gh, dh) < 1e-5
  got, gh = loss_and_dh(h, jnp.zeros((3,), jnp.int32))   # nothing counted: 0, no gradient
  assert float(got) == 0.0 and float(jnp.abs(gh).max()) == 0.0


def qkv(rng, b, s, hq=4, hkv=2, dh=16):
  return [jnp.asarray(rng.standard_normal(sh), jnp.float32)
          for sh in ((b, s, hq, dh), (b, s, hkv, dh), (b, s, hkv, dh))]


@pytest.mark.parametrize("residuals", ["bf16", "fp8"])
def test_packed_attention_equals_each_example_alone(residuals, rng):
  """Row = [example A (6) | example B (6) | padding (4)]: outputs and gradients of each example
  equal the attention run on that example alone (no segment ids)."""
  seg = jnp.asarray([[1] * 6 + [2] * 6 + [0] * 4], jnp.int32)
  q, k, v = qkv(rng, 1, 16)
  ct = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

  @functools.partial(jax.jit, static_argnums=5)
  def value_and_grads(q, k, v, ct, seg, residuals=residuals):
    f = lambda q, k, v: ops.attention(q, k, v, segment_ids=seg, residuals=residuals)
    out, pullback = jax.vjp(f, q, k, v)
    return out, pullback(ct)

  out, grads = value_and_grads(q, k, v, ct, seg)
  if residuals == "fp8":   # its gradients near the exact ones (test_ops.py's FP8 bound)
    for g, g_exact in zip(grads, value_and_grads(q, k, v, ct, seg, "bf16")[1]):
      assert 0 < rel_l2(g, g_exact) < 0.05
  parts = (slice(0, 6), slice(6, 12))
  alone = value_and_grads(*(jnp.concatenate([t[:, p] for p in parts]) for t in (q, k, v, ct)),
                          None)   # the two examples as a batch of two rows
  for i, part in enumerate(parts):
    np.testing.assert_allclose(out[:, part], alone[0][i:i + 1], rtol=1e-5, atol=1e-5)
    for g, g1 in zip(grads, alone[1]):
      assert rel_l2(g[:, part], g1[i:i + 1]) < 1e-5
  plain = jax.jit(lambda q, k, v: ops.attention(q, k, v, residuals=residuals))(q, k, v)
  assert rel_l2(plain[:, 6:12], out[:, 6:12]) > 0.05   # without segments B would see A


def test_segment_positions_restart():
  seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(segment_positions(seg),
                                [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])


@pytest.mark.parametrize("scan_impl,loss_impl", [
    ("vjp_loop", "fused"), pytest.param("lax", "logits", marks=pytest.mark.slow)])
def test_packed_model_equals_examples_alone(scan_impl, loss_impl, rng):
  """A Llama on a row packing two examples gives each example's logits as run alone, and the
  packed masked loss's gradient equals the one from the examples' own batches."""
  cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, max_seq_len=32, dtype="float32",
                    scan_impl=scan_impl, loss_impl=loss_impl, loss_chunk_tokens=8)
  model = Llama(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  a = jnp.asarray(rng.integers(0, 64, (1, 9)), jnp.int32)
  b = jnp.asarray(rng.integers(0, 64, (1, 9)), jnp.int32)
  tokens = jnp.concatenate([a, b], 1)
  seg = jnp.asarray([[1] * 9 + [2] * 9], jnp.int32)
  ab = jnp.concatenate([a, b], 0)   # the two examples as a batch of two rows
  # Loss: inputs t[:-1], labels t[1:], the label crossing from a into b left out: the same 16
  # counted tokens as the two rows' own losses (8 each).
  mask = jnp.ones((1, 17), jnp.int32).at[0, 8].set(0)
  graphdef = nnx.graphdef(model)

  @jax.jit
  def everything(params):
    def packed_loss(p):
      return nnx.merge(graphdef, p).loss(tokens[:, :-1], tokens[:, 1:], mask=mask,
                                         segment_ids=seg[:, :-1])

    def separate_loss(p):
      return nnx.merge(graphdef, p).loss(ab[:, :-1], ab[:, 1:])

    m = nnx.merge(graphdef, params)
    return (m(tokens, seg), m(ab), jax.value_and_grad(packed_loss)(params),
            jax.value_and_grad(separate_loss)(params))

  packed, separate, (l1, g1), (l2, g2) = everything(nnx.state(model, nnx.Param))
  np.testing.assert_allclose(packed[0, :9], separate[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed[0, 9:], separate[1], rtol=1e-5, atol=1e-5)
  assert abs(float(l1) - float(l2)) < 1e-5 * abs(float(l2))
  for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    assert rel_l2(x, y) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("residuals", ["bf16", "fp8"])
def test_packed_attention_cudnn_equals_xla(residuals, rng):
  """GPU, bf16: the cuDNN attention with segment ids (JAX's mask -> bias path) against the XLA
  one, values and gradients (bf16 rounding only; not yet measured on a GPU)."""
  lengths = (100, 60, 96)
  seg = jnp.asarray(np.tile(np.repeat(np.arange(1, 4), lengths), (2, 1)), jnp.int32)
  q, k, v = (t.astype(jnp.bfloat16) for t in qkv(rng, 2, sum(lengths), dh=64))
  ct = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)

  def run(implementation):
    f = lambda q, k, v: ops.attention(q, k, v, segment_ids=seg, implementation=implementation,
                                      residuals=residuals)
    step = jax.jit(lambda q, k, v, ct: (f(q, k, v), jax.vjp(f, q, k, v)[1](ct)))
    if implementation == "cudnn":
      assert "cudnn" in step.lower(q, k, v, ct).as_text()
    return step(q, k, v, ct)

  (o_c, g_c), (o_x, g_x) = run("cudnn"), run("xla")
  assert rel_l2(o_c, o_x) < 0.01
  for a, b in zip(g_c, g_x):
    assert rel_l2(a, b) < 0.02
