"""Llama in Flax NNX with one code path for the "bf16", "fp8_linear" and "coat" precision modes.

The mode picks the ops inside each decoder block (FP8 GEMMs, FP8 saved activations); the token
embedding, the final RMSNorm and the LM head always run in the compute dtype, as in COAT.

Layers: with `scan_layers=True` (default) the decoder blocks are one `DecoderBlock` whose
parameters carry a leading layer axis (paths `layers/self_attn/q_proj/kernel`, shape
(num_layers, D, H * Dh)); the forward is a `jax.lax.scan` over that axis, so XLA compiles one
block, not num_layers copies. With `scan_layers=False` they are a Python list of blocks (paths
`layers/0/self_attn/q_proj/kernel`), each run through one traced block (`unrolled_block_fn`: JAX
traces and lowers the block once, XLA compiles every layer). Both initialize the same weights from
the same seed.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from coat_jax import ops
from coat_jax.models.layer_loop import layer_loop
from coat_jax.nn import layers
from coat_jax.precision import DTYPES, check_precision, resolve_dtype

SCAN_IMPLS = ("auto", "lax", "vjp_loop")
LOSS_IMPLS = ("auto", "fused", "logits")
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    # Keeps only what the "coat" ops save for their backward (FP8 data, scales, rstd) and
    # recomputes the rest; in "bf16" and "fp8_linear" it saves nothing (same as "full").
    "fp8_residuals": jax.checkpoint_policies.save_only_these_names(ops.FP8_RESIDUALS),
}


@dataclasses.dataclass
class LlamaConfig:
  """Shape and precision of a Llama model.

  `head_dim=None` means hidden_size // num_heads; `num_kv_heads=None` means num_heads (no GQA).
  `dtype="auto"` resolves to bfloat16 on accelerators and float32 on CPU.
  `rope_scaling` is None or a Llama 3 dict with keys `ops.LLAMA3_ROPE_KEYS`. `remat` names a
  jax.checkpoint policy applied per decoder block (REMAT_POLICIES; True/False mean "full"/"none").
  `scan_layers` runs the blocks as one scanned, stacked block (see the module docstring);
  `scan_unroll` layers run per iteration of the scan's loop (`jax.lax.scan(unroll=...)`; 1: one
  layer per iteration, the fastest compile; must divide num_layers). `scan_impl` (SCAN_IMPLS) is
  how the scanned blocks are differentiated: "lax" lets JAX transpose the `lax.scan` (its stacked
  residual buffers are zero-filled before the loop); "vjp_loop" is `layer_loop`, whose buffers
  start uninitialized and stack neither parameters nor one array twice; "auto" (default) is
  `resolve_scan_impl`: "vjp_loop" on one device, "lax" on several.
  `attention_residuals` ("bf16" | "fp8", ops.ATTENTION_RESIDUALS) is what each attention keeps of
  q, k, v for its backward, in any precision mode: "fp8" keeps per-1x16-group E4M3 copies
  (1.125 instead of 2 bytes a value) and recomputes the attention from them in the backward.
  `linear_residuals` ("kept" | "remade", ops.LINEAR_RESIDUALS; "coat" only) is what Q/K/V,
  gate/up and down keep of their FP8 inputs for dW: "kept" their transposed codes; "remade"
  nothing: the backward remakes them from the norms' and SwiGLU's 1 x 16 codes (1 byte a value
  of the norms' outputs and of h less, `ops.linear_layer`).
  `loss_impl` (LOSS_IMPLS) is how `Llama.loss` computes the training loss: "fused" is
  `ops.lm_head_loss` (the LM head and cross-entropy over chunks of `loss_chunk_tokens` tokens,
  no full logits held); "logits" writes all logits, then `ops.softmax_cross_entropy`; "auto"
  (default) is `resolve_loss_impl`: "fused" where it holds less (no remat, many tokens, one
  device), else "logits".
  """
  vocab_size: int = 4096
  hidden_size: int = 256
  intermediate_size: int = 688
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int | None = None
  head_dim: int | None = None
  max_seq_len: int = 512
  rope_theta: float = 10000.0
  rope_scaling: dict | None = None
  rms_eps: float = 1e-6
  tie_embeddings: bool = False
  precision: str = "bf16"
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  remat: str | bool = "none"
  attention_impl: str | None = None
  attention_residuals: str = "bf16"
  linear_residuals: str = "kept"
  init_std: float = 0.02
  scan_layers: bool = True
  scan_unroll: int = 1
  scan_impl: str = "auto"
  loss_impl: str = "auto"
  loss_chunk_tokens: int = 4096

  def __post_init__(self):
    if self.num_kv_heads is None:
      self.num_kv_heads = self.num_heads
    if self.head_dim is None and isinstance(self.num_heads, int) and self.num_heads > 0:
      self.head_dim = self.hidden_size // self.num_heads
    if isinstance(self.remat, bool):
      self.remat = "full" if self.remat else "none"
    self.dtype = resolve_dtype(self.dtype, "LlamaConfig.dtype")

  def validate(self) -> "LlamaConfig":
    """Raises ValueError naming the first bad key and value; returns self."""
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "max_seq_len"):
      value = getattr(self, key)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"LlamaConfig.{key} must be a positive int, got {value!r}")
    if self.hidden_size % self.num_heads:
      raise ValueError(f"LlamaConfig.num_heads={self.num_heads} must divide "
                       f"hidden_size={self.hidden_size}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"LlamaConfig.num_kv_heads={self.num_kv_heads} must divide "
                       f"num_heads={self.num_heads}")
    if self.head_dim % 2:
      raise ValueError(f"LlamaConfig.head_dim={self.head_dim} must be even (RoPE rotates pairs)")
    check_precision(self.precision, "LlamaConfig.precision")
    for key in ("dtype", "param_dtype"):
      if getattr(self, key) not in DTYPES:
        raise ValueError(f"LlamaConfig.{key} must be one of {DTYPES}, got {getattr(self, key)!r}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"LlamaConfig.remat must be one of {tuple(REMAT_POLICIES)} or a bool, "
                       f"got {self.remat!r}")
    ops.check_attention_residuals(self.attention_residuals, "LlamaConfig.attention_residuals")
    ops.check_linear_residuals(self.linear_residuals, "LlamaConfig.linear_residuals")
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"LlamaConfig.scan_layers must be a bool, got {self.scan_layers!r}")
    if self.scan_impl not in SCAN_IMPLS:
      raise ValueError(f"LlamaConfig.scan_impl must be one of {SCAN_IMPLS}, got {self.scan_impl!r}")
    if self.loss_impl not in LOSS_IMPLS:
      raise ValueError(f"LlamaConfig.loss_impl must be one of {LOSS_IMPLS}, got {self.loss_impl!r}")
    if (not isinstance(self.loss_chunk_tokens, int) or isinstance(self.loss_chunk_tokens, bool)
        or self.loss_chunk_tokens < 1):
      raise ValueError(f"LlamaConfig.loss_chunk_tokens must be a positive int, "
                       f"got {self.loss_chunk_tokens!r}")
    if (not isinstance(self.scan_unroll, int) or isinstance(self.scan_unroll, bool)
        or self.scan_unroll < 1 or self.num_layers % self.scan_unroll):
      raise ValueError(f"LlamaConfig.scan_unroll must be a positive int dividing num_layers="
                       f"{self.num_layers}, got {self.scan_unroll!r}")
    if not (self.rope_theta > 0):
      raise ValueError(f"LlamaConfig.rope_theta must be > 0, got {self.rope_theta!r}")
    if not (0 < self.rms_eps < 1):
      raise ValueError(f"LlamaConfig.rms_eps must be in (0, 1), got {self.rms_eps!r}")
    if self.rope_scaling is not None:
      if not isinstance(self.rope_scaling, dict):
        raise ValueError(f"LlamaConfig.rope_scaling must be None or a dict, got {self.rope_scaling!r}")
      missing = [k for k in ops.LLAMA3_ROPE_KEYS if k not in self.rope_scaling]
      if missing:
        raise ValueError(f"LlamaConfig.rope_scaling (llama3) misses keys {missing}: "
                         f"got {self.rope_scaling!r}")
    return self

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    if d["rope_scaling"] is not None:
      d["rope_scaling"] = dict(d["rope_scaling"])
    return d

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f"LlamaConfig: unknown keys {unknown}; known keys are {sorted(names)}")
    return cls(**d).validate()

  @classmethod
  def from_name(cls, name: str, **overrides) -> "LlamaConfig":
    """A preset (PRESETS) with keyword overrides, validated."""
    if name not in PRESETS:
      raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
    d = dict(PRESETS[name])
    d.update(overrides)
    return cls.from_dict(d)


PRESETS: dict[str, dict[str, Any]] = {
    # CPU-trainable in minutes; GQA on so the small model exercises grouped heads.
    "tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_layers=4,
                 num_heads=4, num_kv_heads=2, max_seq_len=512),
    # GPT-2-small-shaped Llama (~125M parameters with a 32k vocabulary).
    "llama-125m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
                       num_heads=12, num_kv_heads=12, max_seq_len=2048),
    "olmo-1b": dict(vocab_size=50304, hidden_size=2048, intermediate_size=8192, num_layers=16,
                    num_heads=16, num_kv_heads=16, max_seq_len=2048, tie_embeddings=True,
                    rms_eps=1e-5),
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_layers=32, num_heads=32, num_kv_heads=32, max_seq_len=4096,
                      rms_eps=1e-5),
    "llama2-13b": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                       num_layers=40, num_heads=40, num_kv_heads=40, max_seq_len=4096,
                       rms_eps=1e-5),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, max_seq_len=8192,
                      rope_theta=500000.0, rms_eps=1e-5,
                      rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=8192)),
}


def resolve_scan_impl(scan_impl: str) -> str:
  """The layer loop a `scan_impl` runs now: "auto" is "vjp_loop" when JAX sees one device, else "lax".

  `layer_loop` is faster (a shorter OLMo-1B step on the H100 in both precision modes, at the
  same memory peak), but its uninitialized buffers are XLA `AllocateBuffer` custom calls, which
  the SPMD partitioner does not shard: on a mesh every device would allocate the full,
  unsharded residual stacks and slice its shard out of them (seen in XLA's partitioned HLO on an
  8-device mesh). With one device nothing is partitioned. A named implementation is returned as
  it is; "vjp_loop" named for several GPUs or TPUs gets a warning saying so (on the CPU
  `lax.empty` is zeros, which XLA shards).
  """
  devices = jax.device_count()
  if scan_impl == "vjp_loop" and devices > 1 and jax.default_backend() != "cpu":
    warnings.warn(f"scan_impl='vjp_loop' with {devices} devices: XLA does not shard its "
                  "uninitialized buffers, so on a mesh each device allocates the full residual "
                  "stacks; scan_impl='auto' runs lax.scan there", stacklevel=2)
  if scan_impl != "auto":
    return scan_impl
  return "vjp_loop" if devices == 1 else "lax"


def uses_layer_loop(cfg: LlamaConfig) -> bool:
  """Whether the model runs its decoder blocks through `layer_loop` (scanned layers, "vjp_loop"
  resolved): only then can the backward add the stacked gradient into a given tree
  (`Llama.hidden_states`' layer_grads_into)."""
  return cfg.scan_layers and resolve_scan_impl(cfg.scan_impl) == "vjp_loop"


def resolve_loss_impl(cfg: LlamaConfig, num_tokens: int) -> str:
  """The loss `cfg.loss_impl` runs for a batch of `num_tokens` tokens; "auto" picks the smaller.

  The logits path holds all logits and their gradient at once, 2 N V s bytes (s: the compute
  dtype's size); the fused one holds two chunks of them, 2 C V s, plus the weight gradient's float32
  accumulator and each chunk's float32 product, 2 x 4 V D. "auto" is "fused" when the first is
  the larger, N > C + 4 D / s, and also:
    - `remat` is "none": only then does the loss sit at the step's memory peak (the turnaround
      from forward to backward, with every residual live). With remat the peak is elsewhere, and
      the fused loss's buffers can still cost: Llama-2-7B batch 8, remat full: 52.24 against
      51.22 GB (same live peak; XLA's allocation packs worse); Llama-3-8B (V = 128,256) batch 4:
      64.61 against 61.46 GB, where N < C + 2 D as well (H100, 2026-11-24,
      `python3 -m benchmarks.step.bench_e2e --modes coat+coat_adamw --remat full`);
    - JAX sees one device: with the tokens split across devices, each chunk's weight gradient is
      a partial sum reduced across them inside the loop (`ops.lm_head_loss`).
  OLMo-1B, batch 8 x 2048 (N = 16384 > 4096 + 2 x 2048), remat none, layers unrolled, H100:
  bf16 39.42 against 41.40 GB, coat 24.00 against 25.98, the same step time. A named
  implementation is returned as it is.
  """
  if cfg.loss_impl != "auto":
    return cfg.loss_impl
  size = jnp.dtype(cfg.dtype).itemsize
  big_enough = num_tokens > cfg.loss_chunk_tokens + 4 * cfg.hidden_size // size
  fused = big_enough and cfg.remat == "none" and jax.device_count() == 1
  return "fused" if fused else "logits"


def num_params(cfg: LlamaConfig) -> int:
  """Parameter count (embedding counted once when tied)."""
  d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  attn = d * cfg.num_heads * dh * 2 + d * cfg.num_kv_heads * dh * 2
  per_layer = attn + 3 * d * f + 2 * d
  head = 0 if cfg.tie_embeddings else d * cfg.vocab_size
  return cfg.vocab_size * d + cfg.num_layers * per_layer + d + head


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
  """Training FLOPs per token (forward + backward): 6 N + 12 L S H Dh (PaLM's convention).

  N counts the matmul parameters (blocks and LM head; the embedding lookup is not a matmul unless
  it is tied to the head). The attention term counts the full S x S score matrix (no causal
  halving), as PaLM and nanoGPT do.
  """
  n = num_params(cfg)
  if not cfg.tie_embeddings:
    n -= cfg.vocab_size * cfg.hidden_size
  attn = 12 * cfg.num_layers * seq_len * cfg.num_heads * cfg.head_dim
  return float(6 * n + attn)


class Llama(nnx.Module):
  """Decoder-only Llama: embed -> blocks -> RMSNorm -> LM head; logits in float32."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs | None = None):
    cfg.validate()
    rngs = nnx.Rngs(0) if rngs is None else rngs
    self.cfg = cfg
    dtype, param_dtype = cfg.jnp_dtype, cfg.jnp_param_dtype
    init = nnx.initializers.normal(stddev=cfg.init_std)
    self.embed = layers.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                  param_dtype=param_dtype, embedding_init=init, rngs=rngs)
    blocks = [layers.DecoderBlock(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                                  cfg.num_kv_heads, cfg.head_dim, eps=cfg.rms_eps,
                                  mode=cfg.precision, dtype=dtype, param_dtype=param_dtype,
                                  attention_impl=cfg.attention_impl,
                                  attention_residuals=cfg.attention_residuals,
                                  linear_residuals=cfg.linear_residuals, rngs=rngs)
              for _ in range(cfg.num_layers)]
    self.layers = stack_blocks(blocks) if cfg.scan_layers else nnx.List(blocks)
    # Final norm and LM head stay in the compute dtype ("bf16" ops) in every mode.
    self.norm = layers.RMSNorm(cfg.hidden_size, eps=cfg.rms_eps, mode="bf16", dtype=dtype,
                               param_dtype=param_dtype)
    self.lm_head = None if cfg.tie_embeddings else layers.LMHead(
        cfg.hidden_size, cfg.vocab_size, dtype=dtype, param_dtype=param_dtype, kernel_init=init,
        rngs=rngs)

  def rope(self, seq_len: int) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) tables for positions 0..seq_len-1."""
    return ops.rope_frequencies(self.cfg.head_dim, seq_len, theta=self.cfg.rope_theta,
                                scaling=self.cfg.rope_scaling)

  def hidden_states(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                    layer_grads_into: Any = None) -> jax.Array:
    """tokens (B, S) int -> final normalized hidden states (B, S, D) in the compute dtype.

    segment_ids (B, S) ints: several examples packed into each row; attention stays within an
    example and positions restart at each (`segment_positions`).
    layer_grads_into: None, or a pure dict of the stacked decoder parameters' structure, shapes
    and dtypes (the `layers` entry of the params), G: the gradient taken for the stacked
    parameters is then G + dL/dlayers, added layer by layer into G's buffers (`layer_loop`'s
    grads_into; gradient accumulation's running sum). Needs `scan_layers` and the "vjp_loop"
    implementation (`uses_layer_loop`); ValueError otherwise."""
    if tokens.ndim != 2:
      raise ValueError(f"Llama: tokens must be (batch, seq), got shape {tokens.shape}")
    if tokens.shape[1] > self.cfg.max_seq_len:
      raise ValueError(f"Llama: sequence length {tokens.shape[1]} exceeds max_seq_len "
                       f"{self.cfg.max_seq_len}")
    if segment_ids is not None and segment_ids.shape != tokens.shape:
      raise ValueError(f"Llama: segment_ids shape {segment_ids.shape} must equal tokens shape "
                       f"{tokens.shape}")
    positions = None if segment_ids is None else segment_positions(segment_ids)
    cos, sin = self.rope(tokens.shape[1])
    x = self.embed(tokens)
    in_layer_loop = uses_layer_loop(self.cfg)
    if layer_grads_into is not None and not in_layer_loop:
      raise ValueError("Llama: layer_grads_into needs scan_layers=True and the 'vjp_loop' layer "
                       f"loop; this model has scan_layers={self.cfg.scan_layers}, "
                       f"scan_impl={self.cfg.scan_impl!r} (runs "
                       f"{resolve_scan_impl(self.cfg.scan_impl)!r})")
    if self.cfg.scan_layers:
      graphdef, stacked = nnx.split(self.layers)
      grads_into = None
      if layer_grads_into is not None:   # stacked's own tree (State of Params) over G's arrays
        grads_into = jax.tree.map(lambda a: a, stacked)
        nnx.replace_by_pure_dict(grads_into, layer_grads_into)

      def block(x, layer_params):
        return nnx.merge(graphdef, layer_params)(x, cos, sin, positions, segment_ids)

      if self.cfg.remat != "none":
        block = jax.checkpoint(block, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=False)
      if in_layer_loop:
        x = layer_loop(block, x, stacked, self.cfg.scan_unroll, grads_into)
      else:
        x, _ = jax.lax.scan(lambda x, p: (block(x, p), None), x, stacked,
                            unroll=self.cfg.scan_unroll)
    else:
      run_block = unrolled_block_fn(self.cfg.remat)
      for block in self.layers:
        graphdef, params = nnx.split(block)
        x = run_block(graphdef, params, x, cos, sin, positions, segment_ids)
    h, _ = self.norm(x)
    return h

  def logits(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
             layer_grads_into: Any = None) -> jax.Array:
    """tokens (B, S) int32 -> logits (B, S, vocab_size) in the compute dtype, as the LM head
    writes them: what the training loss reads (ops.softmax_cross_entropy computes in float32
    and writes its gradient in this dtype). Same values and gradients as the float32 logits of
    `__call__`; on the H100 XLA fuses that cast away anyway (same peak and step time, measured
    on OLMo-1B), so this only keeps the loss from depending on it. segment_ids,
    layer_grads_into: as `hidden_states`."""
    h = self.hidden_states(tokens, segment_ids, layer_grads_into)
    return self.embed.attend(h) if self.lm_head is None else self.lm_head(h)

  def loss(self, tokens: jax.Array, labels: jax.Array, *, mask: jax.Array | None = None,
           segment_ids: jax.Array | None = None, layer_grads_into: Any = None) -> jax.Array:
    """Mean next-token cross-entropy (nats, float32 scalar) of tokens (B, S) against labels (B, S).

    `cfg.loss_impl` (resolve_loss_impl) picks how: "fused" never holds all logits
    (`ops.lm_head_loss`, chunks of `cfg.loss_chunk_tokens`); "logits" is `logits` and then
    `ops.softmax_cross_entropy`. Same values and gradients to float32 rounding.
    mask (B, S), 0/1: the mean runs over the labels it counts (`ops.masked_mean`; supervised
    fine-tuning counts response tokens only). segment_ids, layer_grads_into: as
    `hidden_states` (the gradient of the stacked layers comes out added to layer_grads_into)."""
    if labels.shape != tokens.shape:
      raise ValueError(f"Llama.loss: labels shape {labels.shape} must equal tokens shape "
                       f"{tokens.shape}")
    if mask is not None and mask.shape != labels.shape:
      raise ValueError(f"Llama.loss: mask shape {mask.shape} must equal labels shape "
                       f"{labels.shape}")
    if resolve_loss_impl(self.cfg, labels.size) == "logits":
      logits = self.logits(tokens, segment_ids, layer_grads_into)
      return ops.masked_mean(ops.softmax_cross_entropy(logits, labels), mask)
    h = self.hidden_states(tokens, segment_ids, layer_grads_into)
    chunk = self.cfg.loss_chunk_tokens
    if self.lm_head is None:
      return self.embed.attend_loss(h, labels, chunk, mask)
    return self.lm_head.loss(h, labels, chunk, mask)

  def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """tokens (B, S) int32 -> logits (B, S, vocab_size) float32."""
    return self.logits(tokens, segment_ids).astype(jnp.float32)


def unrolled_block_fn(remat: str):
  """One unrolled decoder block as a jitted pure function (graphdef static; params, x, cos, sin,
  positions, segment_ids traced), under the remat policy `remat` (REMAT_POLICIES).

  The blocks of an unrolled model share a graphdef and their parameters' shapes, so JAX traces,
  differentiates and lowers the block once and calls it once per layer (the StableHLO holds one
  function; XLA inlines its calls and compiles every layer as before). A coat block is ~6x the
  equations of a bf16 one (each FP8 GEMM's scale arithmetic, the kernels' calls): traced per
  layer, its tracing and lowering grew with the layer count. A new function for each forward:
  its trace holds the kernel choices of that forward's context (`coat_jax.kernels.backend`, the
  mesh), which a jit kept across forwards would reuse where they differ."""
  def run_block(graphdef, params, x, cos, sin, positions, segment_ids):
    return nnx.merge(graphdef, params)(x, cos, sin, positions, segment_ids)

  if remat != "none":
    run_block = jax.checkpoint(run_block, policy=REMAT_POLICIES[remat], static_argnums=(0,))
  return jax.jit(run_block, static_argnums=(0,))


def segment_positions(segment_ids: jax.Array) -> jax.Array:
  """(B, S) segment ids -> (B, S) int32 positions that restart at 0 where the id changes."""
  s = segment_ids.shape[1]
  index = jnp.arange(s, dtype=jnp.int32)
  changed = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                             segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  start = jax.lax.cummax(jnp.where(changed, index, 0), axis=1)
  return index - start


def stack_blocks(blocks: list[layers.DecoderBlock]) -> layers.DecoderBlock:
  """One DecoderBlock whose every parameter stacks the blocks' along a new leading axis."""
  graphdef, first = nnx.split(blocks[0])
  states = [first] + [nnx.split(b)[1] for b in blocks[1:]]
  return nnx.merge(graphdef, jax.tree.map(lambda *a: jnp.stack(a), *states))


def layer_params(model: Llama, i: int):
  """The parameter state of decoder layer `i` (per-layer shapes) in either layer layout."""
  if not 0 <= i < model.cfg.num_layers:
    raise ValueError(f"layer index {i} out of range for {model.cfg.num_layers} layers")
  if model.cfg.scan_layers:
    return jax.tree.map(lambda a: a[i], nnx.state(model.layers, nnx.Param))
  return nnx.state(model.layers[i], nnx.Param)
