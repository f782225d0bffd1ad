"""What the scan over layers stacks for the backward, and `ops.linears` against separate linears.

Every residual the scanned block keeps is stacked per layer (zero-filled before the loop, written
with a dynamic-update-slice, read back in the backward loop): a cast copy of a weight or a second
reference to one FP8 input must not be among them (docs/benchmarks.md, CPU HLO analysis)."""
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax import ops
from coat_jax.models import Llama
from coat_jax.precision import PRECISIONS
from tests.test_llama import loss_fn, tiny, tokens_for


def stacked_residuals(cfg, tokens):
  """[(shape, dtype)] of the forward scan's stacked outputs in value_and_grad of the loss."""
  model = Llama(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(jax.value_and_grad(
      lambda s: loss_fn(nnx.merge(graphdef, s), tokens)))(state).jaxpr
  found = []

  def visit(j):
    for eqn in j.eqns:
      if eqn.primitive.name == "scan":
        n_carry = len(list(eqn.params["ft_out"].unpack()[0].vals))
        found.append([(tuple(v.aval.shape), v.aval.dtype) for v in eqn.outvars[n_carry:]])
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jaxpr)
  return found[0], model  # the first scan is the forward (the second one writes the gradients)


@pytest.mark.parametrize("mode", PRECISIONS)
def test_scan_stacks_no_weight_copies(mode, rng):
  cfg = tiny(precision=mode, dtype="bfloat16", num_layers=2)
  tokens = tokens_for(rng, cfg, seq=16)
  stacked, model = stacked_residuals(cfg, tokens)
  kernels = {tuple(x.shape) for x in jax.tree.leaves(nnx.state(model.layers, nnx.Param))
             if x.ndim == 3}
  assert kernels and not kernels & {s for s, _ in stacked}, (kernels, stacked)
  if mode == "coat":  # the per-tensor FP8 x^T of the linears' inputs: attention's, o_proj's,
    # the MLP's and down_proj's, each once (Q/K/V and gate/up share theirs).
    fp8_t = [s for s, d in stacked if d == jnp.float8_e4m3fn and s[1] != tokens.shape[0]]
    assert len(fp8_t) == 4, stacked


@pytest.mark.parametrize("with_x_q", [True, False])
def test_linears_match_separate_linears(with_x_q, rng):
  x = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.bfloat16)
  ws = tuple(jnp.asarray(0.1 * rng.standard_normal((64, n)), jnp.float32) for n in (32, 48, 32))
  cts = tuple(jnp.asarray(rng.standard_normal((2, 16, n)), jnp.bfloat16) for n in (32, 48, 32))

  def joint(x, ws):
    return ops.linears(x, ws, mode="coat", x_q=ops.quantize_input(x) if with_x_q else None)

  def separate(x, ws):
    x_q = ops.quantize_input(x) if with_x_q else None
    return tuple(ops.linear(x, w, mode="coat", x_q=x_q) for w in ws)

  (y0, pb0), (y1, pb1) = jax.vjp(joint, x, ws), jax.vjp(separate, x, ws)
  for a, b in zip(y0, y1):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  (dx0, dw0), (dx1, dw1) = pb0(cts), pb1(cts)
  assert all(d.dtype == jnp.float32 for d in dw0)  # gradients in the parameters' dtype
  assert np.isfinite(np.asarray(dx0, np.float32)).all()
  # dX sums three bf16 products: the same sum, in an order XLA may pick differently.
  np.testing.assert_allclose(np.asarray(dx0, np.float32), np.asarray(dx1, np.float32),
                             rtol=0.02, atol=0.02)
  for a, b in zip(dw0, dw1):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="does not match w shape"):
    ops.linears(x, (ws[0], ws[0].T), mode="coat")
