"""Llama model: config presets and validation, forward in every precision mode, GQA, tied head,
RoPE scaling, saved-activation bytes of "coat" vs "bf16", and a short training run on real text
(Python stdlib sources, byte-level). Backward and compilation tests: test_llama_compile.py."""
import dataclasses
import functools
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import coat_jax
from coat_jax import formats, memory, ops
from coat_jax.models import PRESETS, Llama, LlamaConfig, flops_per_token, num_params
from coat_jax.nn import DecoderBlock
from coat_jax.precision import PRECISIONS as MODES

from tests.conftest import RUNTIME_BOUND


def tiny(**overrides) -> LlamaConfig:
  d = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4,
           num_kv_heads=2, max_seq_len=64)
  d.update(overrides)
  return LlamaConfig(**d).validate()


def tokens_for(rng, cfg, batch=2, seq=16):
  return jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, seq)), jnp.int32)


def count_params(model) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# ---------------------------------------------------------------------------------------------
# Config


def test_top_level_exports():
  assert coat_jax.Llama is Llama and coat_jax.LlamaConfig is LlamaConfig


@pytest.mark.parametrize("name,expected", [
    ("llama2-7b", 6.74e9), ("llama3-8b", 8.03e9), ("olmo-1b", 1.18e9), ("llama-125m", 0.134e9)])
def test_preset_parameter_counts(name, expected):
  cfg = LlamaConfig.from_name(name)
  assert abs(num_params(cfg) - expected) / expected < 0.01, (name, num_params(cfg))


def test_num_params_matches_model_and_flops_formula(rng):
  for tie in (False, True):
    cfg = tiny(tie_embeddings=tie)
    model = Llama(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    assert count_params(model) == num_params(cfg)
  cfg = LlamaConfig.from_name("llama2-7b")
  n_matmul = num_params(cfg) - cfg.vocab_size * cfg.hidden_size
  assert flops_per_token(cfg, 4096) == 6 * n_matmul + 12 * 32 * 4096 * 4096


def test_from_name_overrides_and_dict_round_trip():
  cfg = LlamaConfig.from_name("llama3-8b", num_layers=2, precision="coat")
  assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.precision) == (2, 8, 128, "coat")
  assert cfg.rope_scaling["factor"] == 8.0 and cfg.rope_theta == 500000.0
  assert LlamaConfig.from_dict(cfg.to_dict()) == cfg
  assert LlamaConfig.from_name("tiny", remat=True).remat == "full"


def test_unknown_preset_lists_names():
  with pytest.raises(ValueError, match="llama2-7b") as e:
    LlamaConfig.from_name("gpt5")
  assert all(n in str(e.value) for n in PRESETS)


@pytest.mark.parametrize("overrides,key", [
    (dict(num_heads=5), "num_heads"),
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(precision="fp4"), "precision"),
    (dict(dtype="float16"), "dtype"),
    (dict(remat="sometimes"), "remat"),
    (dict(attention_residuals="fp16"), "attention_residuals"),
    (dict(linear_residuals="recomputed"), "linear_residuals"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(head_dim=15), "head_dim"),
    (dict(rope_scaling=dict(factor=8.0)), "rope_scaling"),
    (dict(hidden_sise=64), "hidden_sise"),
])
def test_config_validation_names_bad_key(overrides, key):
  with pytest.raises(ValueError, match=key):
    d = tiny().to_dict()
    d.update(overrides)
    LlamaConfig.from_dict(d)


# ---------------------------------------------------------------------------------------------
# Forward


@pytest.mark.parametrize("mode", MODES)
def test_forward_shapes_dtypes_all_modes(rng, mode):
  cfg = tiny(precision=mode)
  model = Llama(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  tokens = tokens_for(rng, cfg, batch=3, seq=12)
  logits = nnx.jit(lambda m, t: m(t))(model, tokens)
  assert logits.shape == (3, 12, cfg.vocab_size) and logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))
  kernel = model.layers.self_attn.q_proj.kernel  # scanned: one stacked Param for all layers
  assert kernel.dtype == jnp.float32 and kernel.shape == (2, 64, 64)


@pytest.mark.parametrize("mode", ("fp8_linear", "coat"))
def test_fp8_modes_close_to_bf16(rng, mode):
  """Same weights, FP8 mode vs bf16 mode: logits agree to FP8 accuracy."""
  seed = int(rng.integers(1 << 30))
  tokens = tokens_for(rng, tiny(), batch=2, seq=16)
  ref = Llama(tiny(), rngs=nnx.Rngs(seed))(tokens)
  out = Llama(tiny(precision=mode), rngs=nnx.Rngs(seed))(tokens)
  rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
  assert 0 < rel < 0.1, rel


def test_causal(rng):
  """Changing a later token never changes earlier logits."""
  cfg = tiny(dtype="float32")
  model = Llama(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  tokens = tokens_for(rng, cfg, batch=1, seq=10)
  other = tokens.at[0, 6].set((tokens[0, 6] + 1) % cfg.vocab_size)
  a, b = model(tokens), model(other)
  np.testing.assert_allclose(a[:, :6], b[:, :6], rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(a[:, 6:] - b[:, 6:]).max()) > 1e-4


def test_gqa_equals_mha_with_repeated_kv_heads(rng):
  """A GQA model equals the MHA model whose K/V weights repeat each K/V head per query group."""
  gqa_cfg = tiny(dtype="float32", num_kv_heads=2)
  mha_cfg = dataclasses.replace(gqa_cfg, num_kv_heads=4)
  gqa = Llama(gqa_cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  mha = Llama(mha_cfg, rngs=nnx.Rngs(0))
  g_attn, m_attn = gqa.layers.self_attn, mha.layers.self_attn  # stacked (layers, ...) kernels
  for name in ("k_proj", "v_proj"):
    w = getattr(g_attn, name).kernel[...]  # (L, D, Hkv * Dh)
    w = jnp.repeat(w.reshape(2, 64, 2, 16), 2, axis=2).reshape(2, 64, 64)
    getattr(m_attn, name).kernel[...] = w
  for name in ("q_proj", "o_proj"):
    getattr(m_attn, name).kernel[...] = getattr(g_attn, name).kernel[...]
  for name in ("gate_proj", "up_proj", "down_proj"):
    getattr(mha.layers.mlp, name).kernel[...] = getattr(gqa.layers.mlp, name).kernel[...]
  mha.embed.embedding[...] = gqa.embed.embedding[...]
  mha.lm_head.kernel[...] = gqa.lm_head.kernel[...]
  tokens = tokens_for(rng, gqa_cfg)
  np.testing.assert_allclose(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)
  assert gqa.layers.self_attn.k_proj.kernel.shape == (2, 64, 32)


def test_tied_head_uses_embedding(rng):
  cfg = tiny(dtype="float32", tie_embeddings=True)
  model = Llama(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  assert model.lm_head is None
  tokens = tokens_for(rng, cfg)
  h = model.hidden_states(tokens)
  np.testing.assert_allclose(model(tokens), h @ model.embed.embedding[...].T, rtol=1e-5, atol=1e-6)
  untied = Llama(tiny(dtype="float32"), rngs=nnx.Rngs(0))
  h = untied.hidden_states(tokens)
  np.testing.assert_allclose(untied(tokens), h @ untied.lm_head.kernel[...], rtol=1e-5, atol=1e-6)


def test_rope_scaling_changes_long_range_only(rng):
  """llama3 scaling leaves high frequencies alone: same first position, different later ones."""
  seed = int(rng.integers(1 << 30))
  scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=16)
  plain = Llama(tiny(dtype="float32", rope_theta=500000.0), rngs=nnx.Rngs(seed))
  scaled = Llama(tiny(dtype="float32", rope_theta=500000.0, rope_scaling=scaling),
                 rngs=nnx.Rngs(seed))
  tokens = tokens_for(rng, plain.cfg, seq=32)
  a, b = plain(tokens), scaled(tokens)
  np.testing.assert_allclose(a[:, 0], b[:, 0], rtol=1e-5, atol=1e-6)  # position 0: no rotation
  assert float(jnp.abs(a[:, 8:] - b[:, 8:]).max()) > 1e-4
  assert bool(jnp.all(jnp.isfinite(b)))


def test_bad_tokens_rejected(rng):
  model = Llama(tiny(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="max_seq_len"):
    model(jnp.zeros((1, 65), jnp.int32))
  with pytest.raises(ValueError, match=r"\(batch, seq\)"):
    model(jnp.zeros((65,), jnp.int32))


# ---------------------------------------------------------------------------------------------
# Saved activations


def loss_fn(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def block_saved_bytes(mode, batch=2, seq=128, hidden=256, ffn=688, heads=4,
                      attention_residuals="bf16"):
  block = DecoderBlock(hidden, ffn, heads, heads, hidden // heads, mode=mode,
                       dtype=jnp.bfloat16, attention_residuals=attention_residuals,
                       rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(block)
  cos, sin = ops.rope_frequencies(hidden // heads, seq)
  x = jax.random.normal(jax.random.key(1), (batch, seq, hidden), jnp.bfloat16)

  def f(params, x):
    return nnx.merge(graphdef, params)(x, cos, sin)

  return memory.saved_residual_bytes(f, params, x)


def test_saved_activation_bytes_per_layer():
  """Bytes a decoder layer keeps for backward (JAX's residuals), relative to "bf16"."""
  saved = {mode: block_saved_bytes(mode) for mode in MODES}
  ratio = {m: b / saved["bf16"] for m, b in saved.items()}
  print("saved residual bytes per layer (B=2, S=128, D=256, F=688): " +
        ", ".join(f"{m} {b} ({ratio[m]:.3f}x)" for m, b in saved.items()))
  # Measured in this setting (CPU, XLA attention under jax.checkpoint, bf16 compute): coat
  # 0.752x (3019792 of 4015104 bytes); the bound sits ~5% above. (Before the bf16 RMSNorm and
  # SwiGLU recomputed their float32 intermediates, bf16 kept 7755776 bytes and coat was 0.389x
  # of that.) fp8_linear keeps the same bf16 inputs as bf16 (it only changes the GEMMs) and, per
  # linear, its weight's amax and its input's amax (two bf16 scalars, reused by the backward's
  # quantizes of W and x): never more.
  assert ratio["coat"] <= 0.79, saved
  assert saved["fp8_linear"] - saved["bf16"] <= 7 * 2 * 2, saved
  # FP8-saved q, k, v (attention_residuals="fp8"): 1 byte + a 1 x 16 group's share of a scale
  # (formats.ACTIVATION_SCALE_DTYPE: 1.125) instead of 2 bytes for each of their 3 x B S D values.
  coat_fp8_attn = block_saved_bytes("coat", attention_residuals="fp8")
  print(f"coat + fp8 attention residuals: {coat_fp8_attn} ({coat_fp8_attn / saved['bf16']:.3f}x)")
  grouped = 1 + formats.ACTIVATION_SCALE_DTYPE.itemsize / 16
  assert saved["coat"] - coat_fp8_attn == 3 * 2 * 128 * 256 * (2 - grouped), (saved, coat_fp8_attn)


# ---------------------------------------------------------------------------------------------
# Training on real text


def stdlib_bytes(max_bytes=400_000) -> np.ndarray:
  root = Path(sysconfig.get_paths()["stdlib"])
  data = b""
  for f in sorted(root.glob("*.py")):
    data += f.read_bytes()
    if len(data) >= max_bytes:
      break
  return np.frombuffer(data[:max_bytes], np.uint8).astype(np.int32)


def train_losses(mode, data, steps, batch, seq, seed=0, attention_residuals="bf16"):
  cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_layers=2,
                    num_heads=4, num_kv_heads=2, max_seq_len=seq, precision=mode,
                    attention_residuals=attention_residuals)
  model = Llama(cfg, rngs=nnx.Rngs(seed))
  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 10, steps, 3e-4)
  opt = nnx.Optimizer(model, optax.adamw(schedule, b2=0.95, weight_decay=0.1), wrt=nnx.Param)

  graphdef, state = nnx.split((model, opt))

  @functools.partial(jax.jit, donate_argnums=0, compiler_options=RUNTIME_BOUND)
  def step(state, tokens):
    model, opt = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    opt.update(model, grads)
    return nnx.state((model, opt)), loss

  starts = np.random.default_rng(seed).integers(0, len(data) - seq - 1, (steps, batch))
  losses = []
  for i in range(steps):
    tokens = jnp.asarray(np.stack([data[s:s + seq + 1] for s in starts[i]]))
    state, loss = step(state, tokens)
    losses.append(float(loss))
  return np.array(losses)


def test_training_coat_matches_bf16_on_stdlib_text():
  data = stdlib_bytes()
  steps = 160  # at 80 steps the loss still falls fast and run-to-run trajectories differ by ~2%
  losses = {mode: train_losses(mode, data, steps, batch=16, seq=64) for mode in ("bf16", "coat")}
  final = {m: float(l[-10:].mean()) for m, l in losses.items()}
  gap = (final["coat"] - final["bf16"]) / final["bf16"]
  print(f"final loss (mean of last 10 of {steps} steps): bf16 {final['bf16']:.4f}, "
        f"coat {final['coat']:.4f}, coat vs bf16 {100 * gap:+.2f}%")
  assert np.all(np.isfinite(losses["coat"]))
  assert final["bf16"] < 0.75 * losses["bf16"][0]  # it learned something (ln 256 = 5.55 at start)
  # coat ends below bf16 here, by 1.4-2.1 % over compilations of the same step that differ only in
  # float summation order (2026-12-07); seed to seed the gap moves as much (seeds 1, 2, 3:
  # -1.73 %, +0.69 %, -1.84 %), so it is noise, not a bias. Worse by 2 % fails, and so does a loss
  # far below bf16's (a causal mask that leaks the next token would take it there).
  assert -0.04 < gap < 0.02, final


@pytest.mark.slow   # CI time; the FP8-residual attention's gradients: tests/test_llama_compile.py
def test_training_coat_with_fp8_attention_residuals_on_stdlib_text():
  """"coat" with FP8-saved attention q, k, v trains like "coat" (same data, seed and schedule)."""
  data = stdlib_bytes()
  steps = 160
  losses = {r: train_losses("coat", data, steps, batch=16, seq=64, attention_residuals=r)
            for r in ("bf16", "fp8")}
  final = {r: float(l[-10:].mean()) for r, l in losses.items()}
  gap = abs(final["fp8"] - final["bf16"]) / final["bf16"]
  print(f"coat final loss, attention residuals bf16 {final['bf16']:.4f}, fp8 {final['fp8']:.4f}, "
        f"gap {100 * gap:.2f}%")
  assert np.all(np.isfinite(losses["fp8"]))
  assert final["fp8"] < 0.75 * losses["fp8"][0]
  assert gap < 0.02, final
