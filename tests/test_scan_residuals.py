"""What the scan over layers stacks for the backward, and `ops.linears` against separate linears.

Every residual the scanned block keeps is stacked per layer (zero-filled before the loop, written
with a dynamic-update-slice, read back in the backward loop): a cast copy of a weight or a second
reference to one FP8 input must not be among them."""
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax import ops
from coat_jax.ops import linear_ablation
from coat_jax.models import Llama
from coat_jax.models.llama import layer_loop
from coat_jax.precision import PRECISIONS
from tests.jaxpr_walk import equations
from tests.test_llama import loss_fn, tiny, tokens_for


def stacked_residuals(cfg, tokens):
  """[(shape, dtype)] of the forward scan's stacked outputs in value_and_grad of the loss."""
  model = Llama(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(jax.value_and_grad(
      lambda s: loss_fn(nnx.merge(graphdef, s), tokens)))(state).jaxpr
  # The first scan is the forward (the second one writes the gradients).
  forward = next(eqn for eqn in equations(jaxpr) if eqn.primitive.name == "scan")
  n_carry = len(list(forward.params["ft_out"].unpack()[0].vals))
  return [(tuple(v.aval.shape), v.aval.dtype) for v in forward.outvars[n_carry:]], model


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


@pytest.mark.parametrize("remat,unroll", [(False, 1), (True, 2)])
def test_layer_loop_matches_lax_scan(remat, unroll, rng):
  """llama.layer_loop: lax.scan's values and gradients for a layer whose residuals include its
  own parameter (re-sliced, not kept), a constant and one array used twice."""
  table = jnp.asarray(rng.standard_normal(8), jnp.float32)  # a constant residual

  def fn(x, p):
    h = jnp.tanh(x @ p["w"] + table)
    return x + (h * h) @ p["v"] * p["s"]

  if remat:
    fn = jax.checkpoint(fn)
  n = 4
  params = {"w": jnp.asarray(0.3 * rng.standard_normal((n, 8, 8)), jnp.float32),
            "v": jnp.asarray(0.3 * rng.standard_normal((n, 8, 8)), jnp.float32),
            "s": jnp.asarray(1 + 0.1 * rng.standard_normal((n, 8)), jnp.float32)}
  x = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)
  loss_scan = lambda x, p: jnp.sum(jax.lax.scan(lambda c, q: (fn(c, q), None), x, p)[0] ** 2)
  loss_loop = lambda x, p: jnp.sum(layer_loop(fn, x, p, unroll) ** 2)
  (l0, g0), (l1, g1) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, params)
                        for f in (loss_scan, loss_loop))
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("unroll", [1, 2])
def test_layer_loop_adds_its_gradient_into_grads_into(unroll, rng):
  """layer_loop(..., grads_into=G): the cotangent of the stacked params is G + the gradient of
  lax.scan (float64), G's own is zero; a G of another dtype or structure is refused."""
  def fn(x, p):
    return x + jnp.tanh(x @ p["w"]) * p["s"]

  n = 4
  f64 = lambda shape, scale=0.3: jnp.asarray(scale * rng.standard_normal(shape), jnp.float64)
  with jax.enable_x64():
    params = {"w": f64((n, 8, 8)), "s": f64((n, 8), 1.0)}
    into = {"w": f64((n, 8, 8), 5.0), "s": f64((n, 8), 5.0)}
    x = f64((3, 8), 1.0)
    loss_scan = lambda p: jnp.sum(jax.lax.scan(lambda c, q: (fn(c, q), None), x, p)[0] ** 2)
    loss_loop = lambda p, g: jnp.sum(layer_loop(fn, x, p, unroll, g) ** 2)
    l0, g0 = jax.value_and_grad(loss_scan)(params)
    l1, (g1, g_into) = jax.jit(jax.value_and_grad(loss_loop, argnums=(0, 1)))(params, into)
    np.testing.assert_allclose(l1, l0, rtol=1e-12)
    for k in params:
      assert np.linalg.norm(np.asarray(g0[k])) > 0
      np.testing.assert_allclose(g1[k], into[k] + g0[k], rtol=1e-12, atol=1e-12)
      np.testing.assert_array_equal(g_into[k], 0)
    with pytest.raises(ValueError, match="dtypes must be equal"):
      layer_loop(fn, x, params, unroll, jax.tree.map(lambda a: a.astype(jnp.float32), into))
    with pytest.raises(ValueError, match="structure"):
      layer_loop(fn, x, params, unroll, {"w": into["w"]})


def test_layer_grads_into_needs_the_layer_loop(rng):
  cfg = tiny(dtype="float32", num_layers=2, scan_impl="lax")
  model = Llama(cfg, rngs=nnx.Rngs(0))
  tokens = tokens_for(rng, cfg, seq=8)
  into = jax.tree.map(jnp.zeros_like, nnx.to_pure_dict(nnx.state(model.layers, nnx.Param)))
  with pytest.raises(ValueError, match="layer_grads_into needs scan_layers=True"):
    model.loss(tokens, tokens, layer_grads_into=into)


def test_vjp_loop_matches_lax_scan_coat(rng):
  """`scan_impl="vjp_loop"` in the coat model: lax.scan's loss and gradients."""
  import dataclasses

  from tests.test_llama_compile import compare_grads, named_arrays

  cfg = tiny(dtype="float32", precision="coat", num_layers=2)
  tokens = tokens_for(rng, cfg, seq=16)

  def loss_and_grads(cfg):
    model = Llama(cfg, rngs=nnx.Rngs(3))
    loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, tokens)
    return float(loss), named_arrays(nnx.state(grads, nnx.Param), True)

  l0, g0 = loss_and_grads(cfg)
  l1, g1 = loss_and_grads(dataclasses.replace(cfg, scan_impl="vjp_loop"))
  assert np.isfinite(l1) and abs(l1 - l0) <= 1e-5 * abs(l0), (l0, l1)
  compare_grads(g1, g0, 1e-5, 1 - 1e-5, "coat vjp_loop vs lax.scan")


def test_auto_scan_impl_is_vjp_loop_on_one_device_only(monkeypatch):
  """"auto" runs layer_loop on one device and lax.scan on several (llama.resolve_scan_impl), and
  the model takes the loop it names: with one device the traced step carries AllocateBuffer-style
  `empty` buffers, with several JAX's scan."""
  from coat_jax.models import resolve_scan_impl
  from coat_jax.models import llama as llama_module

  assert tiny().scan_impl == "auto"
  assert resolve_scan_impl("lax") == "lax" and resolve_scan_impl("vjp_loop") == "vjp_loop"
  assert jax.device_count() > 1 and resolve_scan_impl("auto") == "lax"
  cfg = tiny(dtype="float32", num_layers=2)
  model = Llama(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.zeros((1, 8), jnp.int32) + 5
  loops = {}
  for count in (8, 1):
    monkeypatch.setattr(llama_module.jax, "device_count", lambda count=count: count)
    text = str(jax.make_jaxpr(nnx.grad(lambda m: jnp.sum(m(tokens))))(model))
    loops[count] = (" empty[" in text, "scan[" in text)
  assert resolve_scan_impl("auto") == "vjp_loop"
  assert loops[8] == (False, True) and loops[1][0], loops


def test_vjp_loop_named_on_a_gpu_mesh_warns(monkeypatch):
  """Named "vjp_loop" on several accelerators warns that each device would hold the unsharded
  buffers; on one device, or on the CPU (where `lax.empty` is zeros), it does not."""
  import warnings

  from coat_jax.models import llama as llama_module
  from coat_jax.models import resolve_scan_impl

  monkeypatch.setattr(llama_module.jax, "default_backend", lambda: "gpu")
  with pytest.warns(UserWarning, match="does not shard"):
    assert resolve_scan_impl("vjp_loop") == "vjp_loop"
  for count, backend in ((1, "gpu"), (8, "cpu")):
    monkeypatch.setattr(llama_module.jax, "device_count", lambda count=count: count)
    monkeypatch.setattr(llama_module.jax, "default_backend", lambda backend=backend: backend)
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      assert resolve_scan_impl("vjp_loop") == "vjp_loop"
      assert resolve_scan_impl("auto") == ("vjp_loop" if count == 1 else "lax")


def test_scan_options_are_checked():
  with pytest.raises(ValueError, match="scan_unroll"):
    tiny(num_layers=3, scan_unroll=2)
  with pytest.raises(ValueError, match="scan_impl"):
    tiny(scan_impl="while")


# weight_quant="once" keeps W's (K, N) codes and their float32 scale instead of its bf16 amax
ONCE = 64 * 48 + 4 - 2


@pytest.mark.parametrize("mode,options,extra", [
    ("coat", dict(weight_quant="once"), ONCE), ("fp8_linear", dict(weight_quant="once"), ONCE),
    ("coat", dict(amax="kernel"), 0), ("coat", dict(weight_quant="once", amax="kernel"), ONCE),
    ("coat", dict(weight_quantize="xla", weight_transpose="cast"), 0)])
def test_linear_ablations_keep_values(mode, options, extra, rng):
  """linear_ablation.ablation: W quantized once per step (the backward reusing the forward's
  (K, N) FP8 copy, `extra` bytes kept), the activation amax from the quantize's own pass, W
  quantized by the dispatch: same scales, so the same values and gradients as the defaults,
  through RMSNorm -> linear as in the model."""
  from coat_jax import memory

  x = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.bfloat16)
  s = jnp.asarray(1 + 0.1 * rng.standard_normal(64), jnp.float32)
  w = jnp.asarray(0.1 * rng.standard_normal((64, 48)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((2, 16, 48)), jnp.bfloat16)

  def f(x, s, w):
    y, y_q = ops.rmsnorm(x, s, mode=mode)
    return ops.linear(y, w, mode=mode, x_q=y_q)

  def run():  # traced afresh: the options are read while tracing
    g = lambda x, s, w: f(x, s, w)
    y, pb = jax.vjp(g, x, s, w)
    return y, pb(ct), memory.saved_residual_bytes(g, x, s, w)

  y0, grads0, saved0 = run()
  with linear_ablation.ablation(**options):
    y1, grads1, saved1 = run()
  np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y0, np.float32))
  for a, b in zip(grads1, grads0):
    assert np.isfinite(np.asarray(a, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert saved1 - saved0 == extra, (saved0, saved1)
  for bad in (dict(weight_quant="twice"), dict(amax="tiles")):
    with pytest.raises(ValueError, match=next(iter(bad))):
      with linear_ablation.ablation(**bad):
        pass
