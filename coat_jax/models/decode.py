"""Text generation with a KV cache: `generate(model, prompt_ids, max_new_tokens, ...)`.

The model runs in plain inference math whatever its precision mode: the same parameters in a
"bf16"-mode Llama (its compute dtype: bfloat16 on GPU, float32 on CPU by default), so no FP8 is
needed. Each decoder layer's keys and values live in a cache of shape
(layers, batch, prompt + new tokens, kv heads, head dim):

  prefill   one jitted call over the prompt: fills the cache's first P entries, samples token 1
  step      one jitted call per further token: writes that token's k, v at its position, attends
            over the cache (keys after the position masked), samples the next token

The step's position is an argument, not a constant, so it compiles once per (batch, prompt
length, max_new_tokens, sampling settings), not once per token. Sampling: greedy (argmax) at
temperature 0, else softmax(logits / temperature) restricted to the top_k largest logits and/or
the smallest set of tokens whose probabilities reach top_p (nucleus), drawn with `rng`.
"""
from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from coat_jax import ops
from coat_jax.models.llama import Llama, LlamaConfig

# Times each jitted function was traced (a trace precedes each compile): tests read it.
TRACES: collections.Counter = collections.Counter()


def inference_config(cfg: LlamaConfig, dtype: str | None = None) -> LlamaConfig:
  """`cfg` as generation runs it: "bf16" mode, scanned layers, compute dtype `dtype` (default:
  cfg's)."""
  return dataclasses.replace(cfg, precision="bf16", dtype=dtype or cfg.dtype, remat="none",
                             attention_residuals="bf16", scan_layers=True)


def inference_model(model: Llama, dtype: str | None = None) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, state) of `model`'s parameters in a Llama of `inference_config`."""
  cfg = inference_config(model.cfg, dtype)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
  values = nnx.to_pure_dict(nnx.state(model))
  if not model.cfg.scan_layers:
    layers = [values["layers"][i] for i in range(model.cfg.num_layers)]
    values["layers"] = jax.tree.map(lambda *a: jnp.stack(a), *layers)
  nnx.replace_by_pure_dict(state, values)
  return graphdef, state


def _check(model, prompt, max_new_tokens, temperature, top_k, top_p):
  cfg = model.cfg
  if prompt.ndim != 2 or prompt.shape[1] < 1 or not jnp.issubdtype(prompt.dtype, jnp.integer):
    raise ValueError(f"generate: prompt_ids must be integers of shape (batch, prompt_len >= 1), "
                     f"got {prompt.dtype} {prompt.shape}")
  if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
    raise ValueError(f"generate: max_new_tokens must be a positive int, got {max_new_tokens!r}")
  total = prompt.shape[1] + max_new_tokens
  if total > cfg.max_seq_len:
    raise ValueError(f"generate: prompt ({prompt.shape[1]}) + max_new_tokens ({max_new_tokens}) "
                     f"= {total} tokens exceeds the model's max_seq_len {cfg.max_seq_len}")
  if int(prompt.min()) < 0 or int(prompt.max()) >= cfg.vocab_size:
    raise ValueError(f"generate: prompt ids must lie in [0, {cfg.vocab_size}), got "
                     f"[{int(prompt.min())}, {int(prompt.max())}]")
  if not temperature >= 0:
    raise ValueError(f"generate: temperature must be >= 0, got {temperature!r}")
  if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= cfg.vocab_size):
    raise ValueError(f"generate: top_k must be None or an int in [1, {cfg.vocab_size}], "
                     f"got {top_k!r}")
  if top_p is not None and not 0 < top_p <= 1:
    raise ValueError(f"generate: top_p must be None or in (0, 1], got {top_p!r}")


def generate(model: Llama, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, rng: jax.Array | None = None,
             dtype: str | None = None) -> jax.Array:
  """The next `max_new_tokens` token ids after each prompt: (batch, max_new_tokens) int32.

  prompt_ids: (batch, prompt_len) ints, all prompts of one length. temperature 0 (default) is
  greedy decoding; above 0 tokens are sampled (module docstring) with `rng` (a jax.random key;
  default key 0). dtype: the compute dtype (default the model's `cfg.dtype`). Generation runs
  on to max_new_tokens: cut the ids at the tokenizer's end-of-text id where wanted.
  """
  prompt = jnp.asarray(prompt_ids)
  _check(model, prompt, max_new_tokens, temperature, top_k, top_p)
  prompt = prompt.astype(jnp.int32)
  graphdef, state = inference_model(model, dtype)
  cfg = model.cfg
  b, p = prompt.shape
  shape = (cfg.num_layers, b, p + max_new_tokens, cfg.num_kv_heads, cfg.head_dim)
  dt = jnp.dtype(dtype or cfg.dtype)
  cache = (jnp.zeros(shape, dt), jnp.zeros(shape, dt))
  greedy = temperature == 0
  sampling = (greedy, top_k, top_p is not None)
  settings = (jnp.float32(temperature if not greedy else 1.0), jnp.float32(top_p or 1.0))
  keys = jax.random.split(jax.random.key(0) if rng is None else rng, max_new_tokens)
  prefill, step = _jitted(graphdef, inference_config(cfg, dtype))
  token, cache = prefill(sampling, state, prompt, cache, settings, keys[0])
  out = [token]
  for i in range(1, max_new_tokens):
    token, cache = step(sampling, state, token, jnp.int32(p + i - 1), cache, settings, keys[i])
    out.append(token)
  return jnp.stack(out, axis=1)


def _forward(model: Llama, tokens, start, cache):
  """Logits (B, V) float32 at the last of `tokens` (B, S), which sit at positions start..start+S-1,
  and the cache with their keys and values written in."""
  cfg = model.cfg
  b, s = tokens.shape
  k_all, v_all = cache
  total = k_all.shape[2]
  positions = start + jnp.arange(s, dtype=jnp.int32)
  visible = jnp.arange(total)[None, :] <= positions[:, None]   # (S, T): causal over the cache
  cos, sin = model.rope(total)
  layer_def, stacked = nnx.split(model.layers)

  def layer(x, inputs):
    params, k_cache, v_cache = inputs
    block = nnx.merge(layer_def, params)
    attn = block.self_attn
    h, _ = block.input_layernorm(x)
    q = attn.q_proj(h).reshape(b, s, cfg.num_heads, cfg.head_dim)
    k = attn.k_proj(h).reshape(b, s, cfg.num_kv_heads, cfg.head_dim)
    v = attn.v_proj(h).reshape(b, s, cfg.num_kv_heads, cfg.head_dim)
    q = ops.apply_rope(q, cos, sin, positions)
    k = ops.apply_rope(k, cos, sin, positions)
    k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, 1)
    v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, 1)
    o = jax.nn.dot_product_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype),
                                     mask=visible[None, None], implementation="xla")
    x = ops.residual_add(x, attn.o_proj(o.reshape(b, s, cfg.num_heads * cfg.head_dim)))
    h, _ = block.post_attention_layernorm(x)
    return ops.residual_add(x, block.mlp(h)), (k_cache, v_cache)

  x = model.embed(tokens)
  x, cache = jax.lax.scan(layer, x, (stacked, k_all, v_all))
  h, _ = model.norm(x[:, -1:])
  head = model.embed.attend(h) if model.lm_head is None else model.lm_head(h)
  return head[:, 0].astype(jnp.float32), cache


def _sample(logits, key, sampling, settings):
  """One token id per row of logits (B, V) float32 (module docstring)."""
  greedy, top_k, use_top_p = sampling
  if greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  temperature, top_p = settings
  logits = logits / temperature
  if top_k is not None:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if use_top_p:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs    # mass of the more likely tokens
    keep_sorted = before < top_p                   # the most likely token is always kept
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(
        keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


_COMPILED: dict[str, tuple] = {}


def _jitted(graphdef: nnx.GraphDef, cfg) -> tuple:
  """(prefill, step) jitted for the inference model `graphdef` of config `cfg`, made once per
  config (a GraphDef holding a LlamaConfig does not hash, so it is closed over, keyed by cfg)."""
  key = repr(sorted(cfg.to_dict().items()))
  if key in _COMPILED:
    return _COMPILED[key]

  @functools.partial(jax.jit, static_argnums=(0,))
  def prefill(sampling, state, prompt, cache, settings, key):
    TRACES["prefill"] += 1
    logits, cache = _forward(nnx.merge(graphdef, state), prompt, 0, cache)
    return _sample(logits, key, sampling, settings), cache

  @functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(4,))
  def step(sampling, state, token, position, cache, settings, key):
    TRACES["step"] += 1
    logits, cache = _forward(nnx.merge(graphdef, state), token[:, None], position, cache)
    return _sample(logits, key, sampling, settings), cache

  _COMPILED[key] = (prefill, step)
  return prefill, step
