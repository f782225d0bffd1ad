"""Loss masks and packed sequences: the masked loss against a hand-computed one (fused and logits
paths), and attention / the model on packed rows against each example run alone (values and
gradients, relative L2)."""
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
  """sum_i m_i (logsumexp(z_i) - z_i[y_i]) / sum_i m_i in float64 numpy."""
  z = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
  zmax = z.max(-1, keepdims=True)
  lse = np.log(np.exp(z - zmax).sum(-1)) + zmax[..., 0]
  picked = np.take_along_axis(z, np.asarray(labels)[..., None], -1)[..., 0]
  m = np.asarray(mask, np.float64)
  return float(((lse - picked) * m).sum() / m.sum())


@pytest.mark.parametrize("chunk", [5, 64])
def test_masked_loss_fused_and_plain_equal_hand_computed(chunk, rng):
  b, s, d, v = 2, 12, 16, 37
  h = jnp.asarray(rng.standard_normal((b, s, d)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((d, v)) * 0.3, jnp.float32)
  labels = jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32)
  mask = jnp.asarray(rng.random((b, s)) < 0.4, jnp.int32).at[0, 0].set(1)
  want = hand_masked_loss(h, w, labels, mask)
  fused = jax.jit(lambda h, w: ops.lm_head_loss(h, w, labels, chunk_tokens=chunk, mask=mask))
  plain = jax.jit(lambda h, w: ops.masked_mean(ops.softmax_cross_entropy(ops.lm_head(h, w),
                                                                         labels), mask))
  assert abs(float(fused(h, w)) - want) < 1e-5 * abs(want)
  assert abs(float(plain(h, w)) - want) < 1e-5 * abs(want)
  unmasked = ops.lm_head_loss(h, w, labels, chunk_tokens=chunk)
  assert abs(float(unmasked) - want) > 1e-3   # the mask changes the value
  # Gradients: fused vs plain, and vs the unmasked loss restricted by hand to the counted tokens.
  gf, gp = jax.jit(jax.grad(fused, (0, 1)))(h, w), jax.jit(jax.grad(plain, (0, 1)))(h, w)
  for a, b_ in zip(gf, gp):
    assert rel_l2(a, b_) < 1e-5
  dh = np.asarray(gf[0])
  assert np.all(dh[np.asarray(mask) == 0] == 0) and np.abs(dh[np.asarray(mask) == 1]).min() > 0


def test_tied_masked_loss_and_empty_mask(rng):
  h = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)
  e = jnp.asarray(rng.standard_normal((11, 8)) * 0.3, jnp.float32)
  labels = jnp.asarray(rng.integers(0, 11, (3,)), jnp.int32)
  mask = jnp.asarray([1, 0, 1])
  got = ops.lm_head_loss(h, e, labels, tied=True, chunk_tokens=2, mask=mask)
  assert abs(float(got) - hand_masked_loss(h, e.T, labels, mask)) < 1e-5
  none = jnp.zeros((3,), jnp.int32)
  assert float(ops.lm_head_loss(h, e, labels, tied=True, mask=none)) == 0.0
  assert float(jnp.abs(jax.grad(lambda h: ops.lm_head_loss(h, e, labels, tied=True,
                                                           mask=none))(h)).max()) == 0.0


def qkv(rng, b, s, hq=4, hkv=2, dh=16):
  return [jnp.asarray(rng.standard_normal(sh), jnp.float32)
          for sh in ((b, s, hq, dh), (b, s, hkv, dh), (b, s, hkv, dh))]


@pytest.mark.parametrize("residuals", ["bf16", "fp8"])
def test_packed_attention_equals_each_example_alone(residuals, rng):
  """Row = [example A (5) | example B (7) | padding (4)]: outputs and gradients of each part equal
  the attention run on that example alone."""
  lengths = (5, 7, 4)
  seg = jnp.asarray(np.repeat(np.arange(1, 4), lengths)[None], jnp.int32)
  q, k, v = qkv(rng, 1, sum(lengths))
  ct = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

  @jax.jit
  def value_and_grads(q, k, v, ct, seg):
    f = lambda q, k, v: ops.attention(q, k, v, segment_ids=seg, residuals=residuals)
    out, pullback = jax.vjp(f, q, k, v)
    return out, pullback(ct)

  out, grads = value_and_grads(q, k, v, ct, seg)
  start = 0
  for n in lengths:
    part = slice(start, start + n)
    o1, g1 = value_and_grads(q[:, part], k[:, part], v[:, part], ct[:, part], None)
    np.testing.assert_allclose(out[:, part], o1, rtol=1e-5, atol=1e-5)
    for g, g1_ in zip(grads, g1):
      assert rel_l2(g[:, part], g1_) < 1e-5
    start += n
  plain = value_and_grads(q, k, v, ct, None)[0]
  assert rel_l2(plain[:, 5:], out[:, 5:]) > 0.05   # without segments the examples would mix


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
  logits = nnx.jit(lambda m, t, s: m(t, s))
  packed = logits(model, tokens, seg)
  np.testing.assert_allclose(packed[:, :9], logits(model, a, None), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed[:, 9:], logits(model, b, None), rtol=1e-5, atol=1e-5)
  # Loss: inputs t[:-1], labels t[1:], the label crossing from a into b left out.
  mask = jnp.ones((1, 17), jnp.int32).at[0, 8].set(0)
  params = nnx.state(model, nnx.Param)
  graphdef = nnx.graphdef(model)

  def packed_loss(p):
    m = nnx.merge(graphdef, p)
    return m.loss(tokens[:, :-1], tokens[:, 1:], mask=mask, segment_ids=seg[:, :-1])

  def separate_loss(p):  # the same 16 counted tokens: 8 of a and 8 of b
    m = nnx.merge(graphdef, p)
    ab = jnp.concatenate([a, b], 0)
    return m.loss(ab[:, :-1], ab[:, 1:])

  l1, g1 = jax.jit(jax.value_and_grad(packed_loss))(params)
  l2, g2 = jax.jit(jax.value_and_grad(separate_loss))(params)
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
