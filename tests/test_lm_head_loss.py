"""ops.lm_head_loss (the LM head and the mean cross-entropy over token chunks, gradient made in the
forward) against float64, against the unfused path (ops.lm_head + ops.softmax_cross_entropy), its
memory claim (no tokens x vocab array anywhere in the differentiated program), the cotangent's
scaling, the gradient-free evaluation, NaN, bad input, Llama.loss and the rule that picks it
(the train step with it on a mesh: tests/test_training_loop.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax import ops
from coat_jax.models import Llama, LlamaConfig, resolve_loss_impl
from tests.test_cross_entropy import _reference64 as cross_entropy_reference64
from tests.jaxpr_walk import equations
from tests.test_ops import cosine as _cos, rel_l2 as _rel

SEED = 20261124   # the Llama tests' token draw; the op tests take conftest's per-test rng


def _inputs(rng, tied, dtype, shape=(2, 13, 32), vocab=80, w_dtype=jnp.float32):
  h = jnp.asarray(rng.standard_normal(shape), dtype)
  w = jnp.asarray(0.3 * rng.standard_normal((vocab, shape[-1]) if tied else (shape[-1], vocab)),
                  w_dtype)
  labels = jnp.asarray(rng.integers(0, vocab, shape[:-1]), jnp.int32)
  return h, w, labels


def _reference64(h, w, labels, tied):
  """Loss, dh, dW in float64 from the operands as the op computes with them (W cast to h's dtype);
  the cross-entropy's own float64 reference (test_cross_entropy) on the float64 logits."""
  h64 = np.asarray(h, np.float64).reshape(-1, h.shape[-1])
  w64 = np.asarray(w.astype(h.dtype), np.float64)
  wm = w64.T if tied else w64                                    # (D, V)
  y = np.asarray(labels).ravel()
  losses, dz = cross_entropy_reference64(h64 @ wm, y, np.full(len(y), 1.0 / len(y)))
  dwm = h64.T @ dz
  return losses.mean(), (dz @ wm.T).reshape(h.shape), (dwm.T if tied else dwm)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [26, 5, 100])   # N = 26 tokens: one chunk exactly, 5 with a tail, larger than N
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_values_and_gradients_match_float64(rng, tied, chunk, dtype, tol):
  h, w, labels = _inputs(rng, tied, dtype)
  loss, (dh, dw) = jax.jit(jax.value_and_grad(
      lambda h, w: ops.lm_head_loss(h, w, labels, tied=tied, chunk_tokens=chunk), (0, 1)))(h, w)
  ref_loss, ref_dh, ref_dw = _reference64(h, w, labels, tied)
  assert loss.dtype == jnp.float32 and dh.dtype == dtype and dw.dtype == w.dtype
  assert dh.shape == h.shape and dw.shape == w.shape
  assert np.isfinite(float(loss)) and abs(float(loss) - ref_loss) < tol * abs(ref_loss)
  for got, ref in ((dh, ref_dh), (dw, ref_dw)):
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert _rel(got, ref) < tol and _cos(got, ref) > 1 - tol


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [7, 26])
def test_matches_the_unfused_path(rng, tied, chunk):
  """float32: the same loss and gradients as writing all logits and then the cross-entropy."""
  h, w, labels = _inputs(rng, tied, jnp.float32)
  unfused = jax.value_and_grad(
      lambda h, w: ops.softmax_cross_entropy(ops.lm_head(h, w, tied=tied), labels).mean(), (0, 1))
  fused = jax.value_and_grad(
      lambda h, w: ops.lm_head_loss(h, w, labels, tied=tied, chunk_tokens=chunk), (0, 1))
  (l0, (dh0, dw0)), (l1, (dh1, dw1)) = jax.jit(unfused)(h, w), jax.jit(fused)(h, w)
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  np.testing.assert_allclose(dh1, dh0, rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(dw1, dw0, rtol=1e-5, atol=1e-7)


def _largest_array(fn, *args):
  """Elements of the largest array any equation of fn's jaxpr (sub-jaxprs included) makes."""
  return max(int(np.prod(v.aval.shape)) for e in equations(jax.make_jaxpr(fn)(*args).jaxpr)
             for v in e.outvars if hasattr(v.aval, "shape"))


def test_no_tokens_by_vocab_array_is_made(rng):
  """No array of the differentiated program holds more than a quarter of the N x V logits (here
  the largest is W's gradient, V x D); the unfused path's, measured the same way, is N x V."""
  h, w, labels = _inputs(rng, True, jnp.float32, shape=(4, 16, 32), vocab=96)
  n, v, chunk = 64, 96, 16
  fused = jax.grad(lambda h, w: ops.lm_head_loss(h, w, labels, tied=True, chunk_tokens=chunk), (0, 1))
  unfused = jax.grad(
      lambda h, w: ops.softmax_cross_entropy(ops.lm_head(h, w, tied=True), labels).mean(), (0, 1))
  assert _largest_array(unfused, h, w) >= n * v
  assert max(chunk * v, w.size) == _largest_array(fused, h, w) <= n * v // 2


def test_cotangent_scales_both_gradients(rng):
  h, w, labels = _inputs(rng, False, jnp.float32)
  grad = lambda c: jax.grad(lambda h, w: c * ops.lm_head_loss(h, w, labels, chunk_tokens=8),
                            (0, 1))(h, w)
  (dh1, dw1), (dh3, dw3) = grad(1.0), grad(-2.5)
  np.testing.assert_allclose(dh3, -2.5 * dh1, rtol=1e-6)
  np.testing.assert_allclose(dw3, -2.5 * dw1, rtol=1e-6)
  assert float(jnp.abs(dw1).max()) > 0


def _dots(fn, *args):
  return sum(e.primitive.name == "dot_general" for e in equations(jax.make_jaxpr(fn)(*args).jaxpr))


def test_evaluation_runs_only_the_logits_gemms(rng):
  """Undifferentiated: one GEMM per chunk body (first, loop, tail); differentiated: three each."""
  h, w, labels = _inputs(rng, False, jnp.float32)          # 26 tokens, chunks 8: 8 + 2 x 8 + 2
  loss = lambda h, w: ops.lm_head_loss(h, w, labels, chunk_tokens=8)
  assert _dots(loss, h, w) == 3
  assert _dots(jax.value_and_grad(loss, (0, 1)), h, w) == 9
  np.testing.assert_allclose(jax.jit(loss)(h, w), jax.jit(jax.value_and_grad(loss))(h, w)[0],
                             rtol=1e-7)


def test_nan_propagates(rng):
  h, w, labels = _inputs(rng, True, jnp.float32)
  h = h.at[1, 3, 5].set(jnp.nan)
  loss, (dh, dw) = jax.value_and_grad(
      lambda h, w: ops.lm_head_loss(h, w, labels, tied=True, chunk_tokens=8), (0, 1))(h, w)
  assert np.isnan(float(loss)) and np.isnan(np.asarray(dw)).any() and np.isnan(np.asarray(dh)).any()


@pytest.mark.parametrize("change,match", [
    (dict(labels_shape=(2, 12)), "labels shape"),
    (dict(h_shape=(2, 13, 31)), "does not match"),
    (dict(labels_dtype=jnp.float32), "labels must be integers"),
    (dict(chunk=0), "chunk_tokens must be a positive int"),
    (dict(chunk=True), "chunk_tokens must be a positive int"),
])
def test_bad_input_gives_one_line_errors(rng, change, match):
  h, w, labels = _inputs(rng, False, jnp.float32)
  if "labels_shape" in change:
    labels = labels[:, :12]
  if "h_shape" in change:
    h = h[..., :31]
  if "labels_dtype" in change:
    labels = labels.astype(jnp.float32)
  with pytest.raises(ValueError, match=match) as err:
    ops.lm_head_loss(h, w, labels, chunk_tokens=change.get("chunk", 8))
  assert "\n" not in str(err.value)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("precision", ["bf16", "coat"])
def test_llama_loss_fused_equals_logits(tie, precision):
  """Llama.loss with the fused loss against the logits path: float32 compute, same init."""
  tokens = jnp.asarray(np.random.default_rng(SEED).integers(0, 512, (2, 25)), jnp.int32)
  out = {}
  for impl in ("fused", "logits"):
    cfg = LlamaConfig.from_name("tiny", vocab_size=512, hidden_size=64, intermediate_size=128,
                                num_layers=2, precision=precision, tie_embeddings=tie,
                                dtype="float32", loss_impl=impl, loss_chunk_tokens=10)
    graphdef, params, rest = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    loss = lambda p: nnx.merge(graphdef, p, rest).loss(tokens[:, :-1], tokens[:, 1:])
    out[impl] = jax.jit(jax.value_and_grad(loss))(params)
  (l0, g0), (l1, g1) = out["logits"], out["fused"]
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    assert _rel(a, b) < 1e-5


def test_loss_impl_auto_picks_the_smaller(monkeypatch):
  """auto: fused only with remat none, one device and N > C + 4 D / s tokens; names pass through."""
  cfg = lambda **kw: LlamaConfig(**{**dict(hidden_size=2048, num_heads=16, dtype="bfloat16",
                                            loss_chunk_tokens=4096), **kw}).validate()
  monkeypatch.setattr(jax, "device_count", lambda: 1)
  assert resolve_loss_impl(cfg(), 16384) == "fused"               # OLMo-1B, batch 8 x 2048
  assert resolve_loss_impl(cfg(), 4096 + 4096) == "logits"        # N = C + 2 D: not more
  assert resolve_loss_impl(cfg(), 4096 + 4096 + 1) == "fused"
  assert resolve_loss_impl(cfg(dtype="float32"), 4096 + 2048 + 1) == "fused"   # s = 4
  assert resolve_loss_impl(cfg(remat="full"), 16384) == "logits"
  assert resolve_loss_impl(cfg(loss_impl="fused", remat="full"), 10) == "fused"
  monkeypatch.setattr(jax, "device_count", lambda: 2)
  assert resolve_loss_impl(cfg(), 16384) == "logits"
  assert resolve_loss_impl(cfg(loss_impl="fused"), 16384) == "fused"


def test_loss_impl_config():
  assert LlamaConfig().loss_impl == "auto"
  with pytest.raises(ValueError, match="loss_impl must be one of"):
    LlamaConfig(loss_impl="chunked").validate()
  with pytest.raises(ValueError, match="loss_chunk_tokens must be a positive int"):
    LlamaConfig(loss_chunk_tokens=0).validate()
  model = Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                            num_heads=2, dtype="float32"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="labels shape"):
    model.loss(jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 7), jnp.int32))
