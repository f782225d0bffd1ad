"""Llama backward and compilation: scanned vs looped layers, remat policies, gradients against a
float32 reference, and the FP8 matrix products in the train step's jaxpr."""
import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax import formats, kernels, memory
from coat_jax.models import Llama, layer_params
from coat_jax.precision import PRECISIONS as MODES
from tests.jaxpr_walk import equations
from tests.test_llama import loss_fn, tiny, tokens_for

def named_arrays(state, scanned: bool) -> dict[str, np.ndarray]:
  """{"embed/embedding": ..., "layers/0/self_attn/q_proj/kernel": ...} in either layer layout."""
  out = {}
  for path, value in jax.tree.leaves_with_path(state):
    keys = [str(k.key) for k in path if hasattr(k, "key")]
    value = np.asarray(value, np.float64)
    if scanned and keys[0] == "layers":
      for i in range(value.shape[0]):
        out["/".join(["layers", str(i)] + keys[1:])] = value[i]
    else:
      out["/".join(keys)] = value
  return out


def grads_of(cfg, seed, tokens):
  """(loss, logits, {name: gradient}) of a fresh model `Llama(cfg, rngs=nnx.Rngs(seed))`."""
  model = Llama(cfg, rngs=nnx.Rngs(seed))
  loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, tokens)
  logits = nnx.jit(lambda m, t: m(t))(model, tokens)
  return float(loss), np.asarray(logits), named_arrays(nnx.state(grads, nnx.Param),
                                                         cfg.scan_layers)


def rel_l2(a, b) -> float:
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def cosine(a, b) -> float:
  a, b = a.ravel(), b.ravel()
  return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def compare_grads(got, ref, tol, cos_min, what):
  """Asserts every parameter's gradient within relative L2 `tol` and cosine `cos_min` of ref's."""
  assert sorted(got) == sorted(ref), (what, sorted(got), sorted(ref))
  errs = {n: (rel_l2(got[n], ref[n]), cosine(got[n], ref[n])) for n in ref}
  assert all(np.isfinite(got[n]).all() for n in got), what
  worst = max(errs, key=lambda n: errs[n][0])
  print(f"{what}: worst relative L2 {errs[worst][0]:.2e} ({worst}), "
        f"min cosine {min(c for _, c in errs.values()):.6f}")
  for n, (err, cos) in errs.items():
    assert err <= tol and cos >= cos_min, (what, n, err, cos)


@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) if m == "fp8_linear"
                                  else m for m in MODES])   # CI time: coat covers the FP8 path
def test_scan_matches_loop(mode, rng):
  """Scanned and looped layers: same initial weights from one seed, same logits and gradients."""
  seed = int(rng.integers(1 << 30))
  cfg = tiny(dtype="float32", precision=mode, num_layers=3)
  tokens = tokens_for(rng, cfg, seq=17)
  scanned, looped = (Llama(dataclasses.replace(cfg, scan_layers=s), rngs=nnx.Rngs(seed))
                     for s in (True, False))
  for i in range(3):
    for a, b in zip(jax.tree.leaves(layer_params(scanned, i)),
                    jax.tree.leaves(layer_params(looped, i))):
      np.testing.assert_array_equal(a, b)
  l0, y0, g0 = grads_of(cfg, seed, tokens)
  l1, y1, g1 = grads_of(dataclasses.replace(cfg, scan_layers=False), seed, tokens)
  # Same ops on the same numbers (measured worst 1.3e-7); XLA may fuse the two differently
  # (float32 rounding, which could flip an FP8 rounding now and then in the FP8 modes).
  tol = 1e-5 if mode == "bf16" else 1e-4
  assert rel_l2(y0, y1) <= tol and abs(l0 - l1) <= tol * abs(l1), (rel_l2(y0, y1), l0, l1)
  compare_grads(g0, g1, tol, 1 - tol, f"{mode} scan vs loop")


def _count_block_calls(monkeypatch) -> list:
  """A list that gets an entry for every DecoderBlock call (every trace of a block) from now."""
  from coat_jax.nn import layers as layers_lib
  calls = []
  block_call = layers_lib.DecoderBlock.__call__
  monkeypatch.setattr(layers_lib.DecoderBlock, "__call__",
                      lambda self, *a, **k: calls.append(1) or block_call(self, *a, **k))
  return calls


@pytest.mark.parametrize("remat", ["none", "full"])
def test_unrolled_blocks_traced_once(remat, monkeypatch, rng):
  """Unrolled layers share one traced block: the train step's forward and backward trace the
  decoder block once for three layers, and the jaxpr calls that block's jaxpr (and its backward's)
  per layer."""
  calls = _count_block_calls(monkeypatch)
  cfg = tiny(precision="coat", num_layers=3, scan_layers=False, remat=remat)
  model = Llama(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  tokens = tokens_for(rng, cfg, seq=17)
  graphdef, state = nnx.split(model)
  grad_fn = jax.value_and_grad(lambda st, t: loss_fn(nnx.merge(graphdef, st), t))
  jaxpr = jax.make_jaxpr(grad_fn)(state, tokens)
  assert len(calls) == 1, f"the block was traced {len(calls)} times for 3 layers"
  block_jaxprs = [e.params["jaxpr"] for e in jaxpr.jaxpr.eqns
                  if e.primitive.name in ("pjit", "jit") and e.params["name"] == "run_block"]
  # three forward calls of one jaxpr, three backward calls of one (the block's transpose)
  assert len(block_jaxprs) == 6 and len({id(j) for j in block_jaxprs}) == 2, block_jaxprs
  loss, grads = jax.jit(grad_fn)(state, tokens)
  assert np.isfinite(float(loss)) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("mode,remat,scan", [
    ("bf16", "full", True), ("coat", "full", True),
    # CI time: these run with --slow (full, fp8_residuals, scanned and not, keep coat covered)
    pytest.param("bf16", "full", False, marks=pytest.mark.slow),
    pytest.param("coat", "dots", True, marks=pytest.mark.slow),
    pytest.param("coat", "dots_saveable", True, marks=pytest.mark.slow),
    pytest.param("fp8_linear", "fp8_residuals", True, marks=pytest.mark.slow),
    ("coat", "fp8_residuals", True), ("coat", "fp8_residuals", False)])
def test_remat_same_gradients(mode, remat, scan, rng):
  seed = int(rng.integers(1 << 30))
  cfg = tiny(dtype="float32", precision=mode, scan_layers=scan)
  tokens = tokens_for(rng, cfg, seq=17)
  l0, _, g0 = grads_of(cfg, seed, tokens)
  l1, _, g1 = grads_of(dataclasses.replace(cfg, remat=remat), seed, tokens)
  tol = 1e-5  # recomputed FP8 quantizations: same inputs, same codes (measured worst 1.5e-7)
  assert abs(l0 - l1) <= tol * abs(l0), (l0, l1)
  compare_grads(g1, g0, tol, 1 - tol, f"{mode} remat {remat} vs none")


def model_saved_bytes(cfg, tokens) -> int:
  """Bytes the loss's pullback keeps (all layers), parameters and tokens excluded."""
  graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
  return memory.saved_residual_bytes(lambda p, t: loss_fn(nnx.merge(graphdef, p), t), params,
                                     tokens)


def test_fp8_residuals_policy_keeps_less_than_none_more_than_full(rng):
  cfg = tiny(dtype="bfloat16", precision="coat", hidden_size=128, intermediate_size=352)
  tokens = tokens_for(rng, cfg, batch=2, seq=33)
  saved = {r: model_saved_bytes(dataclasses.replace(cfg, remat=r), tokens)
           for r in ("none", "fp8_residuals", "full")}
  print("coat model, saved bytes by remat policy:", saved)
  assert saved["full"] < saved["fp8_residuals"] < saved["none"], saved


# (relative L2, cosine) bounds against the float32 reference, per parameter. bf16: bfloat16
# rounding of activations, measured worst 0.023 (lm_head); FP8 modes: E4M3 forward and E5M2
# backward GEMMs through 2 layers, measured worst 0.132 (fp8_linear) and 0.147 (coat), cosines
# >= 0.989. A gradient that lost a scale factor is off by 100% or more.
MODEL_GRAD_TOL = {"bf16": (0.03, 0.9995), "fp8_linear": (0.16, 0.985), "coat": (0.16, 0.985)}


@pytest.mark.parametrize("mode", MODES)
def test_gradients_vs_float32_reference(mode, rng):
  """Whole-model gradients (bf16 compute) of every mode vs the float32 "bf16"-mode model."""
  seed = int(rng.integers(1 << 30))
  cfg = tiny(vocab_size=256, hidden_size=128, intermediate_size=352, num_heads=4)
  tokens = tokens_for(rng, cfg, batch=4, seq=33)
  l_ref, _, ref = grads_of(dataclasses.replace(cfg, dtype="float32"), seed, tokens)
  loss, _, got = grads_of(dataclasses.replace(cfg, precision=mode), seed, tokens)
  assert abs(loss - l_ref) <= 0.01 * l_ref, (loss, l_ref)
  compare_grads(got, ref, *MODEL_GRAD_TOL[mode], f"{mode} vs float32")


# A Pallas FP8 GEMM shows as a pallas_call (GPU), or, in Mosaic GPU interpret mode (CPU), as its
# inlined body, in which one `wgmma` (the tensor-core product) stands for one kernel.
PALLAS_GEMM_PRIMITIVES = ("pallas_call", "wgmma_ref")


def fp8_dots_and_pallas_calls(jaxpr) -> tuple[int, int]:
  """(dot_generals with a float8 operand, Pallas GEMMs) in a jaxpr and all its sub-jaxprs."""
  fp8 = {jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)}
  is_gemm = lambda eqn: eqn.primitive.name in PALLAS_GEMM_PRIMITIVES
  dots = calls = 0
  for eqn in equations(jaxpr, stop=is_gemm):
    dots += eqn.primitive.name == "dot_general" and any(v.aval.dtype in fp8 for v in eqn.invars)
    calls += is_gemm(eqn)
  return dots, calls


def train_step_jaxpr(cfg, tokens):
  model = Llama(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  step = jax.value_and_grad(lambda p, t: loss_fn(nnx.merge(graphdef, p), t))
  return jax.make_jaxpr(step)(params, tokens).jaxpr


@pytest.mark.parametrize("scan", [True, False])
def test_train_step_contains_fp8_matmuls(scan, rng):
  """value_and_grad of the loss: 7 linears x 3 FP8 GEMMs (y, dX, dW) per block in the FP8 modes
  (once for the scanned block, once per layer in the loop), none in "bf16"."""
  cfg = tiny(num_layers=2, scan_layers=scan)
  tokens = tokens_for(rng, cfg)
  per_block = 7 * 3
  want = {"bf16": 0, "fp8_linear": per_block, "coat": per_block}
  for mode in MODES:
    with kernels.backend("reference"):
      dots, calls = fp8_dots_and_pallas_calls(
          train_step_jaxpr(dataclasses.replace(cfg, precision=mode), tokens))
    print(f"{mode} scan={scan}: {dots} FP8 dot_generals")
    assert calls == 0 and dots == want[mode] * (1 if scan else cfg.num_layers), (mode, dots)


def test_train_step_contains_pallas_fp8_gemm_when_forced(rng):
  # Every GEMM dimension >= 128 (the Pallas wrapper sends smaller problems to XLA): D 128,
  # F 256, K/V 4 x 32, 2 x 64 tokens. The forward's gate and up products are one GEMM with the
  # SwiGLU epilogue (fp8_gemm_swiglu takes the 128 tokens): 7 x 3 - 1 GEMM calls.
  cfg = tiny(num_layers=2, hidden_size=128, intermediate_size=256, num_kv_heads=4,
             max_seq_len=128, precision="coat")
  tokens = tokens_for(rng, cfg, batch=2, seq=65)
  for linear_residuals in ("kept", "remade"):
    with kernels.backend("gemm=pallas"):
      dots, calls = fp8_dots_and_pallas_calls(train_step_jaxpr(
          dataclasses.replace(cfg, linear_residuals=linear_residuals), tokens))
    print(f"coat ({linear_residuals}), Pallas GEMM forced: {calls} Pallas GEMMs, {dots} XLA FP8 "
          f"dot_generals")
    assert calls == 7 * 3 - 1 and dots == 0, (linear_residuals, calls, dots)
  with kernels.backend("gemm=pallas"):
    dots, calls = fp8_dots_and_pallas_calls(
        train_step_jaxpr(dataclasses.replace(cfg, precision="bf16"), tokens))
  assert (dots, calls) == (0, 0)


def test_unrolled_block_traced_anew_for_each_forward(monkeypatch, rng):
  """The shared block's jit lives for one forward: a second trace of the same model runs the
  block's Python again, so that what the trace reads outside JAX's own context (a kernel switch,
  a patched op) is read anew, never replayed from an earlier trace."""
  cfg = tiny(precision="coat", num_layers=2, scan_layers=False)
  model = Llama(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  tokens = tokens_for(rng, cfg, seq=17)
  jax.make_jaxpr(lambda m, t: loss_fn(m, t))(model, tokens)
  calls = _count_block_calls(monkeypatch)
  jax.make_jaxpr(lambda m, t: loss_fn(m, t))(model, tokens)
  assert len(calls) == 1, calls


# Attention with FP8-saved q, k, v vs the same "coat" model saving them in bf16 (same weights,
# bf16 compute): only the attention's backward inputs change. Measured over 4 seeds: worst
# relative L2 0.088-0.096, always q_proj/k_proj of layer 0 (dq and dk go through the softmax
# derivative, which E4M3 rounding of k and q perturbs most); min cosine 0.9954-0.9961.
ATTN_FP8_MODEL_TOL, ATTN_FP8_MODEL_COS = 0.11, 0.994


@pytest.mark.parametrize("remat", ["none", "fp8_residuals"])
def test_fp8_attention_residuals_model_gradients(remat, rng):
  seed = int(rng.integers(1 << 30))
  cfg = tiny(vocab_size=256, hidden_size=128, intermediate_size=352, precision="coat")
  tokens = tokens_for(rng, cfg, batch=4, seq=33)
  l_ref, _, ref = grads_of(cfg, seed, tokens)
  fp8_cfg = dataclasses.replace(cfg, attention_residuals="fp8", remat=remat)
  loss, _, got = grads_of(fp8_cfg, seed, tokens)
  assert np.isfinite(loss) and abs(loss - l_ref) <= 1e-3 * l_ref, (loss, l_ref)
  compare_grads(got, ref, ATTN_FP8_MODEL_TOL, ATTN_FP8_MODEL_COS, f"fp8 attention, remat {remat}")
  assert max(rel_l2(got[n], ref[n]) for n in ref) > 1e-4  # the FP8 residuals were used
  if remat == "none":  # (with "fp8_residuals", bf16 q, k, v are recomputed, FP8 ones saved)
    saved = {r: model_saved_bytes(dataclasses.replace(cfg, attention_residuals=r), tokens)
             for r in ("bf16", "fp8")}
    # Per layer q, k, v: B (S - 1) (H + 2 K) Dh values, 2 bytes in bf16, 1 in FP8 + a 1 x 16
    # group's share of a scale (formats.ACTIVATION_SCALE_DTYPE).
    values = cfg.num_layers * 4 * 32 * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    print(f"coat model saved bytes by attention residuals: {saved}")
    grouped = 1 + formats.ACTIVATION_SCALE_DTYPE.itemsize / 16
    assert saved["bf16"] - saved["fp8"] == values * (2 - grouped), (saved, values)


# linear_residuals="remade" vs "kept" (same weights, bf16 compute): the forward and every dX are
# the same computation, so the loss, the norms', o_proj's, the embedding's and the LM head's
# gradients match bit for bit; Q/K/V, gate/up and down's dW take remade input codes. Measured
# over seeds (2026-12-07, CPU): dW against the float32 model worst 0.12-0.13 relative L2 either
# way (the remade codes add ~0.003-0.006 to kept's), remade vs kept 0.03-0.05.
REMADE_LINEARS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")


def assert_only_remade_weight_grads_differ(got, kept):
  """The six remade linears' dW within 0.1-8 % of kept's; every other gradient bit for bit."""
  assert sorted(got) == sorted(kept)
  for name in kept:
    remade = any(f"/{lin}/" in name for lin in REMADE_LINEARS)
    err = rel_l2(got[name], kept[name])
    assert (1e-3 < err < 0.08) if remade else err == 0, (name, err)


@pytest.mark.parametrize("scan_layers,scan_impl,remat", [(False, "auto", "none"),
                                                         (True, "vjp_loop", "none"),
                                                         (True, "lax", "fp8_residuals")])
def test_remade_linear_residuals_model(scan_layers, scan_impl, remat, rng):
  seed = int(rng.integers(1 << 30))
  cfg = tiny(vocab_size=256, hidden_size=128, intermediate_size=352, precision="coat",
             scan_layers=scan_layers, scan_impl=scan_impl, remat=remat)
  tokens = tokens_for(rng, cfg, batch=4, seq=33)
  _, _, ref = grads_of(dataclasses.replace(cfg, precision="bf16", dtype="float32"), seed, tokens)
  loss_kept, _, kept = grads_of(cfg, seed, tokens)
  remade_cfg = dataclasses.replace(cfg, linear_residuals="remade")
  loss, _, got = grads_of(remade_cfg, seed, tokens)
  assert loss == loss_kept, (loss, loss_kept)
  compare_grads(got, ref, *MODEL_GRAD_TOL["coat"], f"remade linear inputs, remat {remat}")
  assert_only_remade_weight_grads_differ(got, kept)
  saved = {r: model_saved_bytes(dataclasses.replace(cfg, linear_residuals=r), tokens)
           for r in ("kept", "remade")}
  # Per layer: 1 byte for each value of the two norms' outputs (B (S - 1) D) and of h
  # (B (S - 1) F) less, and the three amaxes the remakes quantize with (8 bytes) more.
  tokens_n = 4 * 32
  want = cfg.num_layers * (tokens_n * (2 * cfg.hidden_size + cfg.intermediate_size) - 8)
  print(f"saved bytes by linear residuals: {saved}")
  assert saved["kept"] - saved["remade"] == want, (saved, want)


def test_remade_inputs_are_remade_once_per_layer(monkeypatch, rng):
  """The backward remakes each remade input once, however many linears read it: Q/K/V's and
  gate/up's norm outputs and h, 3 remakes a layer (each is a pass over the input's codes)."""
  made = []
  remake = kernels.remade_codes_t
  monkeypatch.setattr(kernels, "remade_codes_t",
                      lambda kind, arrays, *a, **k: made.append(kind) or remake(kind, arrays, *a, **k))
  cfg = tiny(num_layers=1, precision="coat", linear_residuals="remade", scan_layers=False)
  tokens = tokens_for(rng, cfg, batch=2, seq=33)
  graphdef, params, rest = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
  jax.make_jaxpr(jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), tokens)))(params)
  assert sorted(made) == ["rmsnorm", "rmsnorm", "swiglu"], made


def test_remade_linear_residuals_with_the_kernels(rng):
  """The same on the GPU's kernels (interpret mode): the Pallas GEMMs (the gate/up one with the
  SwiGLU epilogue), the Mosaic quantizes, the per-group dequantize. Every dimension >= 128."""
  seed = int(rng.integers(1 << 30))
  cfg = tiny(num_layers=1, hidden_size=128, intermediate_size=256, num_kv_heads=4,
             max_seq_len=128, precision="coat", dtype="bfloat16")
  tokens = tokens_for(rng, cfg, batch=2, seq=65)
  with kernels.backend("pallas"):
    loss_kept, _, kept = grads_of(cfg, seed, tokens)
    loss, _, got = grads_of(dataclasses.replace(cfg, linear_residuals="remade"), seed, tokens)
  assert loss == loss_kept and np.isfinite(loss), (loss, loss_kept)
  assert_only_remade_weight_grads_differ(got, kept)


def test_remake_quantize_by_kernel_or_xla_is_the_same(rng):
  """`linear_ablation.ablation(remake_quantize=...)`: the remade x^T codes from the quantize kernel
  (the default; interpret mode: one more kernel in the backward) or one XLA fusion are the same
  codes: the same gradients, bit for bit."""
  from coat_jax import ops
  from coat_jax.ops import linear_ablation

  x = jnp.asarray(rng.standard_normal((2, 64, 128)), jnp.bfloat16)
  s = jnp.asarray(1 + 0.1 * rng.standard_normal(128), jnp.bfloat16)
  w = jnp.asarray(0.1 * rng.standard_normal((128, 128)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((2, 64, 128)), jnp.bfloat16)

  def f(x, s, w):
    y, y_q = ops.rmsnorm(x, s, mode="coat", linear_residuals="remade")
    return ops.linear(y, w, mode="coat", x_q=y_q)

  def grads(choice):   # traced afresh: the switch is read while tracing
    with linear_ablation.ablation(remake_quantize=choice):
      backward = lambda x, s, w: jax.vjp(f, x, s, w)[1](ct)
      kernels_in = str(jax.make_jaxpr(backward)(x, s, w)).count("coat_quantize_per_tensor")
      return [np.asarray(a, np.float32) for a in backward(x, s, w)], kernels_in

  with kernels.backend("quantize=pallas"):
    (by_xla, n_xla), (by_kernel, n_kernel) = grads("xla"), grads("kernel")
  print("quantize kernels in the backward, kernel vs xla:", n_kernel, n_xla)
  assert n_kernel > n_xla, (n_kernel, n_xla)
  for a, b in zip(by_kernel, by_xla):
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)
