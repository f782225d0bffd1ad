"""ops.lm_head against a float64 reference (values, both gradients in size and direction, their
dtypes), the barrier that orders the weight gradient before the hidden-state gradient, NaN
propagation, bad shapes, and the Llama heads (tied and untied) that use it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax import ops
from coat_jax.models import Llama, LlamaConfig
from tests.jaxpr_walk import equations
from tests.test_ops import cosine as _cos, rel_l2 as _rel

SEED = 20261125


@pytest.fixture
def rng():
  print(f"seed {SEED}")
  return np.random.default_rng(SEED)


def _inputs(rng, tied, h_dtype, w_dtype=jnp.float32, shape=(2, 7, 48), vocab=96):
  h = jnp.asarray(rng.standard_normal(shape), h_dtype)
  w_shape = (vocab, shape[-1]) if tied else (shape[-1], vocab)
  w = jnp.asarray(0.2 * rng.standard_normal(w_shape), w_dtype)
  dz = jnp.asarray(rng.standard_normal(shape[:-1] + (vocab,)), h_dtype)
  return h, w, dz


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("h_dtype,w_dtype,tol", [(jnp.float32, jnp.float32, 1e-6),
                                                  (jnp.bfloat16, jnp.float32, 1.5e-2),
                                                  (jnp.bfloat16, jnp.bfloat16, 1.5e-2)])
def test_values_and_gradients_match_float64(rng, tied, h_dtype, w_dtype, tol):
  h, w, dz = _inputs(rng, tied, h_dtype, w_dtype)
  z, pullback = jax.vjp(lambda h, w: ops.lm_head(h, w, tied=tied), h, w)
  dh, dw = pullback(dz)
  assert z.dtype == h_dtype and dh.dtype == h_dtype and dw.dtype == w_dtype
  h64, dz64 = np.asarray(h, np.float64), np.asarray(dz, np.float64)
  # the reference uses the parameter as the op computes with it: cast to h's dtype
  w64 = np.asarray(w.astype(h_dtype), np.float64)
  wm = w64.T if tied else w64                                  # (D, V)
  ref_z = h64 @ wm
  ref_dh = dz64 @ wm.T
  ref_dwm = h64.reshape(-1, h64.shape[-1]).T @ dz64.reshape(-1, dz64.shape[-1])
  ref_dw = ref_dwm.T if tied else ref_dwm
  for got, ref in ((z, ref_z), (dh, ref_dh), (dw, ref_dw)):
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert _rel(got, ref) < tol
    assert _cos(got, ref) > 1 - tol


def test_float32_weight_gradient_is_not_rounded_to_bf16_first(rng):
  """dW comes from the GEMM's float32 accumulator: closer to float64 than a bf16 dW converted."""
  h, w, dz = _inputs(rng, True, jnp.bfloat16, shape=(4, 64, 32), vocab=64)
  _, pullback = jax.vjp(lambda h, w: ops.lm_head(h, w, tied=True), h, w)
  _, dw = pullback(dz)
  ref = (np.asarray(dz, np.float64).reshape(-1, 64).T @ np.asarray(h, np.float64).reshape(-1, 32))
  via_bf16 = np.asarray(jnp.asarray(ref, jnp.bfloat16), np.float64)
  assert _rel(dw, ref) < 1e-6 < _rel(via_bf16, ref)


@pytest.mark.parametrize("tied", [False, True])
def test_backward_releases_dh_only_with_dw(rng, tied):
  """Both gradients leave the backward through one optimization barrier (module docstring): the
  jaxpr of the VJP binds `optimization_barrier` on exactly (dh, dW) and returns its outputs."""
  h, w, dz = _inputs(rng, tied, jnp.bfloat16)
  jaxpr = jax.make_jaxpr(lambda h, w, dz: jax.vjp(lambda h, w: ops.lm_head(h, w, tied=tied),
                                                   h, w)[1](dz))(h, w, dz)
  barriers = [e for e in equations(jaxpr.jaxpr) if e.primitive.name == "optimization_barrier"]
  assert len(barriers) == 1
  shapes = [tuple(v.aval.shape) for v in barriers[0].outvars]
  assert shapes == [h.shape, w.shape]


def test_nan_propagates(rng):
  h, w, dz = _inputs(rng, False, jnp.float32)
  h = h.at[0, 3, 5].set(jnp.nan)
  z, pullback = jax.vjp(lambda h, w: ops.lm_head(h, w), h, w)
  _, dw = pullback(dz)
  assert np.isnan(np.asarray(z[0, 3])).all() and np.isfinite(np.asarray(z[1])).all()
  assert np.isnan(np.asarray(dw[5])).all()


@pytest.mark.parametrize("tied,w_shape", [(False, (47, 96)), (True, (96, 47)), (False, (48,))])
def test_bad_shapes_name_the_problem(rng, tied, w_shape):
  h = jnp.asarray(rng.standard_normal((2, 3, 48)), jnp.float32)
  with pytest.raises(ValueError, match="lm_head: h shape"):
    ops.lm_head(h, jnp.ones(w_shape, jnp.float32), tied=tied)


@pytest.mark.parametrize("tie", [False, True])
def test_llama_heads_are_the_op(rng, tie):
  """Llama's logits are h @ W (untied, `LMHead`) or h @ E^T (tied), and the head's parameter
  gets the op's float32 gradient."""
  cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=2, max_seq_len=16, tie_embeddings=tie, dtype="float32")
  model = Llama(cfg, rngs=nnx.Rngs(3))
  tokens = jnp.asarray(rng.integers(0, 128, (2, 16)), jnp.int32)
  h = model.hidden_states(tokens)
  w = model.embed.embedding[...] if tie else model.lm_head.kernel[...]
  np.testing.assert_allclose(model.logits(tokens), h @ (w.T if tie else w), rtol=1e-5, atol=1e-5)
  path = ("embed", "embedding") if tie else ("lm_head", "kernel")
  grads = nnx.grad(lambda m: jnp.sum(jnp.sin(m.logits(tokens))))(model)
  g = grads[path[0]][path[1]][...]
  assert g.dtype == jnp.float32 and g.shape == w.shape and np.isfinite(np.asarray(g)).all()
  assert float(jnp.linalg.norm(g)) > 0
