"""From a run config and a mesh to everything a training loop runs: `build(cfg, mesh)`.

  model config  preset + overrides + precision, vocabulary and sequence length fit to the data
  optimizer     clip_by_global_norm -> adamw | coat_adamw (clip in its step), warmup + schedule
  apply fn      (grads, opt_state, params) -> (params, opt_state); for coat_adamw the fused
                `coat_adamw_apply` kernel writes the new params in one pass
  model parts   the model split abstractly (graph, param/other-state templates, shardings)
  steps         jitted train_step (donating its state) and eval_step with explicit shardings

The pieces stay public for callers that need one of them (e.g. a benchmark's own optimizer chain
via `build(..., extra_tx=...)`); the builder is generic over the parameter tree (sharding rules
match paths and right-align, so a stacked leading layer axis is replicated).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from coat_jax import kernels, ops
from coat_jax.precision import resolve_dtype
from coat_jax.training import corpus, mesh as mesh_lib, pretrained, sft, token_files
from coat_jax.training.accumulate import (accumulated_value_and_grad, gradient_dtype,
                                          sums_in_place)
from coat_jax.training.dataset import TokenDataset
from coat_jax.training.schema import AUTO, DataConfig, OptimizerConfig, RunConfig


def dataset_from_config(data: DataConfig, seed: int, log=print, init_from: str = ""):
  """The dataset `data` names (tokenizing and caching as needed): a TokenDataset, or for
  kind "sft" an sft.PackedDataset. init_from: `model.init_from`, whose tokenizer.json is the
  tokenizer when data.tokenizer is unset (for every kind that tokenizes text, the stdlib
  corpus included: a pretrained model reads ids of its own tokenizer)."""
  common = dict(seq_len=data.seq_len, batch_size=data.batch_size, seed=seed,
                eval_fraction=data.eval_fraction)
  # pre-tokenized files need none: data.tokenizer (or init_from's, where it has one) only names
  # the tokenizer their ids come from, which the run keeps beside its checkpoints
  tokenizer = pretrained.tokenizer_path(data, init_from, required=data.kind != "tokens")
  if data.kind == "sft":
    return sft.sft_dataset(data.paths, tokenizer, eos_override=data.eos_id,
                           cache=data.cache_dir, log=log, **common)

  def eos(tok) -> dict:
    """TokenDataset's eos_id with document masking: data.eos_id or the tokenizer's."""
    if not data.document_mask:
      return {}
    found = data.eos_id if data.eos_id >= 0 else (corpus.eos_id(tok) if tok else None)
    if found is None:
      raise ValueError("data.document_mask: the tokenizer has no end-of-text token; set "
                       "data.eos_id")
    return {"eos_id": found}

  if data.kind == "stdlib":   # with a tokenizer (a pretrained model's): tokenized with it
    ids, tok, name = corpus.stdlib_tokens(data.vocab_size, data.corpus_max_bytes, data.cache_dir,
                                          log, tokenizer_path=tokenizer)
    how = f"tokenizer {tokenizer}" if tokenizer else "byte-level BPE"
    return TokenDataset([ids], [name], vocab_size=tok.get_vocab_size(), tokenizer=tok,
                        description=f"{name}, {how} vocab {tok.get_vocab_size()}",
                        **eos(tok), **common)
  if data.kind == "tokens":   # the vocabulary stays the model config's (padded) one
    files = token_files.expand_paths(data.paths)
    arrays = [token_files.load_token_file(f, data.dtype) for f in files]
    tok = corpus.load_tokenizer(tokenizer) if tokenizer else None
    return TokenDataset(arrays, [str(f) for f in files], tokenizer=tok,
                        description=f"{len(files)} token files"
                                    + (f", tokenizer {tokenizer}" if tok else ""),
                        **eos(None), **common)
  if data.kind in ("text", "jsonl"):
    arrays, names, tok = token_files.text_tokens(data.paths, tokenizer, data.kind,
                                                 data.text_field, data.cache_dir, log)
    return TokenDataset(arrays, names, vocab_size=tok.get_vocab_size(), tokenizer=tok,
                        description=f"{len(names)} {data.kind} files, tokenizer {tokenizer}",
                        **eos(tok), **common)
  raise ValueError(f"unknown data.kind {data.kind!r}")


def model_config(cfg: RunConfig, data_vocab: int | None):
  """The LlamaConfig for this run: preset + overrides + precision + vocab/sequence fit to the data."""
  from coat_jax.models.llama import LlamaConfig

  overrides = cfg.model.overrides()
  if "dtype" in overrides:
    overrides["dtype"] = resolve_dtype(overrides["dtype"], "model.dtype")
  if cfg.model.init_from:   # the shape from the directory's config.json
    return pretrained.model_config(cfg, data_vocab, overrides)
  preset = LlamaConfig.from_name(cfg.model.preset)
  if "vocab_size" not in overrides and data_vocab is not None:
    overrides["vocab_size"] = data_vocab
  vocab = overrides.get("vocab_size", preset.vocab_size)
  if data_vocab is not None and vocab < data_vocab:
    raise ValueError(f"model.vocab_size={vocab} is smaller than the tokenizer's vocabulary ({data_vocab})")
  max_len = overrides.get("max_seq_len", preset.max_seq_len)
  if max_len < cfg.data.seq_len:
    if "max_seq_len" in overrides:
      raise ValueError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={max_len}")
    overrides["max_seq_len"] = cfg.data.seq_len
  return LlamaConfig.from_name(cfg.model.preset, precision=cfg.precision, **overrides)


def lr_schedule(opt: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `lr` over `opt.warmup` steps, then cosine/linear decay to
  `lr * min_lr_ratio` (or constant) by `total_steps`. A run shorter than its warmup stays in the
  warmup (its last lr below `lr`): the warmup is never squeezed into a short run, whose last steps
  would then take the full `lr` after a few steps of warmup."""
  warmup = opt.warmup
  decay_steps = max(1, total_steps - warmup)
  if opt.schedule == "cosine":
    after = optax.cosine_decay_schedule(opt.lr, decay_steps, alpha=opt.min_lr_ratio)
  elif opt.schedule == "linear":
    after = optax.linear_schedule(opt.lr, opt.lr * opt.min_lr_ratio, decay_steps)
  else:
    after = optax.constant_schedule(opt.lr)
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, opt.lr, warmup), after], [warmup])


def weight_decay_mask(opt: OptimizerConfig):
  """None (decay everything) or a mask that leaves 1-D parameters out (`decay_1d=False`)."""
  if opt.decay_1d:
    return None
  return lambda params: jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def _coat_arguments(opt: OptimizerConfig) -> tuple[tuple, dict]:
  """coat_adamw's / coat_adamw_apply's arguments after the learning rate (the clip fused into
  the step: `max_grad_norm`)."""
  return ((opt.b1, opt.b2, opt.eps, opt.weight_decay, weight_decay_mask(opt)),
          dict(m_format=opt.m_format, v_format=opt.v_format, group_size=opt.group_size,
               expand=opt.expand, expand_min=opt.expand_min,
               min_quantized_size=opt.min_quantized_size, master_rounding=opt.master_rounding,
               group_axis=opt.group_axis, max_grad_norm=opt.clip if opt.clip > 0 else None))


def build_optimizer(opt: OptimizerConfig, total_steps: int):
  """(optax transformation, schedule): clip_by_global_norm -> adamw, or coat_adamw (which clips
  inside its step, `max_grad_norm`; its state is a CoatAdamWState)."""
  schedule = lr_schedule(opt, total_steps)
  if opt.name != "adamw":
    from coat_jax.optim import coat_adamw
    args, kwargs = _coat_arguments(opt)
    return coat_adamw(schedule, *args, **kwargs), schedule
  core = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay,
                     mask=weight_decay_mask(opt))
  parts = ([optax.clip_by_global_norm(opt.clip)] if opt.clip > 0 else []) + [core]
  return optax.chain(*parts), schedule


def optax_apply(tx: optax.GradientTransformation):
  """apply(grads, opt_state, params) -> (new params, new opt_state): tx.update + apply_updates."""
  def apply(grads, opt_state, params):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return apply


def build_apply(opt: OptimizerConfig, tx, schedule):
  """apply(grads, opt_state, params) -> (new params, new opt_state) for `build_optimizer`'s tx.

  Equal to tx.update + optax.apply_updates up to float32 rounding, on tx's state (so
  checkpoints are shared). For coat_adamw the step is `coat_adamw_apply` with tx's arguments:
  its fused kernel writes the new params in one pass instead of writing an update that
  apply_updates reads back, and with opt.clip > 0 both clip inside the step
  (`max_grad_norm=opt.clip`: the gradients' global norm, then a scale the kernel applies as it
  loads them) instead of writing clipped gradients.
  """
  if opt.name != "coat_adamw":
    return optax_apply(tx)
  from coat_jax.optim import coat_adamw_apply
  args, kwargs = _coat_arguments(opt)
  return coat_adamw_apply(schedule, *args, **kwargs)


def sums_layer_grads_in_place(llama_cfg, opt: OptimizerConfig, params_abstract: Any) -> bool:
  """Whether the train step adds each microbatch's gradient of the stacked decoder layers
  (params["layers"]) into the accumulator inside the backward, instead of making the gradient and
  then adding it: with k > 1 microbatches, every gradient in `accumulate_dtype`
  (`accumulate.sums_in_place`, e.g. bfloat16 gradients into a bfloat16 sum) and the layers run by
  `layer_loop` (`llama.uses_layer_loop`: scanned, "vjp_loop"). The stacked gradient then never
  exists beside the sum: one stacked-gradient tree less at the peak (`memory_budget`)."""
  from coat_jax.models.llama import uses_layer_loop
  return (isinstance(opt.accumulate, int) and uses_layer_loop(llama_cfg)
          and sums_in_place(params_abstract, opt.accumulate, opt.accumulate_dtype, opt.grad_dtype))


def memory_budget(opt: OptimizerConfig, params_abstract: Any, opt_abstract: Any,
                  layer_grads_in_place: bool = False) -> dict[str, int]:
  """Bytes of the training state one step holds, from dtypes and shapes (no activations).

  params: the master weights; grads: the gradient tree the optimizer reads (bfloat16 for
  `grad_dtype: bfloat16` or bfloat16 params); weight_copy: the bfloat16 copy the backward runs at
  (grad_dtype bfloat16 over non-bfloat16 params), alive during forward and backward (without
  remat it stands in for the bfloat16 weights the backward would save as residuals anyway);
  accumulator: the running gradient sum in `accumulate_dtype` (accumulate > 1) beside the
  gradients. With `layer_grads_in_place` (`sums_layer_grads_in_place`, the build's
  `Built.sums_layer_grads_in_place`) the backward writes the stacked layers' gradient into the
  sum's own buffers, and each leaf's sum dies as the mean the optimizer reads is made from it,
  so the accumulator counts only the other leaves' (embedding, final norm, LM head): a stacked
  leaf's microbatch gradient and its sum are one buffer, counted in grads; optimizer_state:
  every optimizer-state leaf (moments, their scales, Kahan compensation); step_workspace: the
  float32 working copy (in and out, 8 B/element) that the stochastic/Kahan step makes of the
  largest bfloat16 param, or of one layer of a stacked (layers, ...) param (that rounding is not
  inside the fused kernel yet; coat_jax.optim), alive only in the optimizer step. total: params + grads + accumulator + optimizer state + the larger of
  weight_copy and step_workspace (never alive together), an upper bound on the state part of
  the peak. The schema's OptimizerConfig docstring has the per-param table.
  """
  def size(x):
    n = 1
    for d in x.shape:
      n *= d
    return n

  leaves = [x for x in jax.tree.leaves(params_abstract) if hasattr(x, "shape")]
  bf16 = jnp.dtype(jnp.bfloat16)
  grad_of = lambda x: gradient_dtype(x.dtype, opt.grad_dtype)   # the backward's dtype for x
  out = {"params": sum(size(x) * jnp.dtype(x.dtype).itemsize for x in leaves)}
  out["weight_copy"] = sum(size(x) * grad_of(x).itemsize for x in leaves if grad_of(x) != x.dtype)
  out["grads"] = sum(size(x) * grad_of(x).itemsize for x in leaves)
  acc = jnp.dtype(opt.accumulate_dtype).itemsize
  summed = ([x for x in jax.tree.leaves(params_abstract.get("layers", {})) if hasattr(x, "shape")]
            if layer_grads_in_place else [])
  in_place = {id(x) for x in summed}
  out["accumulator"] = (sum(size(x) * acc for x in leaves if id(x) not in in_place)
                        if opt.accumulate > 1 else 0)
  out["optimizer_state"] = sum(size(x) * jnp.dtype(x.dtype).itemsize
                               for x in jax.tree.leaves(opt_abstract) if hasattr(x, "shape"))
  rounded = ([size(x) // (x.shape[0] if len(x.shape) >= 3 else 1) for x in leaves
              if x.dtype == bf16] if opt.master_rounding != "nearest" else [])
  out["step_workspace"] = 8 * max(rounded, default=0)
  out["total"] = (out["params"] + out["grads"] + out["accumulator"] + out["optimizer_state"]
                  + max(out["weight_copy"], out["step_workspace"]))
  return out


def batch_loss(model, batch, layer_grads_into: Any = None) -> jax.Array:
  """The training loss of a batch (dataset.py's formats): next-token cross-entropy of tokens
  (B, S + 1); for a dict batch over the labels whose loss_mask is 1 and that lie in their
  input's segment, with attention and positions per segment (`Llama.loss`). With gradient
  accumulation each microbatch's mean counts equally, whatever its number of counted tokens.
  layer_grads_into: `Llama.loss`'s (the stacked layers' gradient comes out added to it)."""
  if not isinstance(batch, dict):
    return model.loss(batch[:, :-1], batch[:, 1:], layer_grads_into=layer_grads_into)
  tokens, segments = batch["tokens"], batch["segment_ids"]
  same = segments[:, 1:] == segments[:, :-1]
  mask = jnp.where(same, batch["loss_mask"][:, 1:], 0)
  return model.loss(tokens[:, :-1], tokens[:, 1:], mask=mask, segment_ids=segments[:, :-1],
                    layer_grads_into=layer_grads_into)


@jax.custom_vjp
def add_into_gradient(p: jax.Array, sink: jax.Array) -> jax.Array:
  """p, unchanged; its gradient comes out as ct + sink (and sink's as zero): a leaf whose gradient
  the backward does not sum in place still returns sink + dL/dp, as `accumulate`'s
  loss_adds_into_sink asks of every leaf."""
  return p


add_into_gradient.defvjp(lambda p, sink: (p, sink),
                         lambda sink, ct: (ct + sink.astype(ct.dtype), None))


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy (nats) in float32; logits (B, S, V) in the compute dtype
  (`Llama.logits`), labels (B, S) int32 (`ops.softmax_cross_entropy`: float32 math, its gradient
  written in the logits' dtype in one pass)."""
  return ops.softmax_cross_entropy(logits, labels).mean()


@dataclasses.dataclass
class ModelParts:
  """A model taken apart for pure functions: graph, abstract states (templates), shardings."""
  graphdef: Any
  params_template: Any  # nnx.State of Params, abstract
  rest_template: Any  # nnx.State of everything else (e.g. RNG state), abstract
  params_abstract: Any  # pure dict of ShapeDtypeStruct
  rest_abstract: Any
  params_shardings: Any
  rest_shardings: Any

  def merge(self, params: Any, rest: Any):
    p = jax.tree.map(lambda x: x, self.params_template)
    nnx.replace_by_pure_dict(p, params)
    r = jax.tree.map(lambda x: x, self.rest_template)
    if rest:
      nnx.replace_by_pure_dict(r, rest)
    return nnx.merge(self.graphdef, p, r)


def model_parts(llama_cfg, seed: int, mesh, group_size: int | None = None,
                group_axis: str = "last") -> tuple[ModelParts, Callable[..., tuple[Any, Any]]]:
  """Takes the model apart abstractly (nothing allocated) and returns it with an init function
  init(seed=seed) -> (params, rest) (compiled once for every seed). group_size, group_axis:
  coat_adamw's (parameter splits keep its groups whole per shard), None for other optimizers."""
  from coat_jax.models.llama import Llama

  abstract = nnx.eval_shape(lambda: Llama(llama_cfg, rngs=nnx.Rngs(seed)))
  graphdef, params_state, rest_state = nnx.split(abstract, nnx.Param, ...)
  params_abstract, rest_abstract = nnx.to_pure_dict(params_state), nnx.to_pure_dict(rest_state)
  axes = None
  if group_size:
    from coat_jax.optim import group_axes
    axes = group_axes(group_axis, params_abstract)
  params_sh = mesh_lib.param_shardings(params_abstract, mesh, group_size=group_size, group_axes=axes)
  rest_sh = jax.tree.map(lambda _: mesh_lib.replicated(mesh), rest_abstract)
  parts = ModelParts(graphdef, params_state, rest_state, params_abstract, rest_abstract,
                     params_sh, rest_sh)

  def init(key):  # the key is an argument: a constant one lets XLA constant-fold the RNG (minutes)
    _, p, r = nnx.split(Llama(llama_cfg, rngs=nnx.Rngs(key)), nnx.Param, ...)
    return nnx.to_pure_dict(p), nnx.to_pure_dict(r)

  init_jit = jax.jit(init, out_shardings=(params_sh, rest_sh))
  return parts, lambda s=seed: init_jit(jax.random.key(s))


def training_loss(parts: ModelParts) -> Callable[..., tuple[jax.Array, Any]]:
  """loss_fn(params, rest, tokens, sink=None) -> (loss, the model's new other state), `batch_loss`
  of the model `parts` merges from params and rest. With a sink (the running gradient sum: the
  params' tree, each leaf in its gradient's dtype) the gradient with respect to params is
  sink + dL/dparams for every leaf (accumulate.py's loss_adds_into_sink): the stacked layers'
  added in their backward loop (`Llama.loss`'s layer_grads_into), every other leaf's by
  `add_into_gradient`. The sink needs a model whose layers run by `layer_loop`."""
  def loss_fn(params, rest, tokens, sink=None):
    layer_grads_into = None
    if sink is not None:
      layer_grads_into = sink["layers"]
      params = {k: v if k == "layers" else jax.tree.map(add_into_gradient, v, sink[k])
                for k, v in params.items()}
    model = parts.merge(params, rest)
    loss = batch_loss(model, tokens, layer_grads_into)
    _, _, new_rest = nnx.split(model, nnx.Param, ...)
    return loss, nnx.to_pure_dict(new_rest)

  return loss_fn


def make_steps(parts: ModelParts, tx, opt_shardings, mesh, apply_fn=None, *, accumulate: int = 1,
               accumulate_dtype: str = "float32", grad_dtype: str = "param",
               skip_nonfinite: bool = False, layer_grads_in_place: bool = False,
               kernel_config: kernels.KernelConfig = kernels.KernelConfig()):
  """Jitted (train_step, eval_step) with explicit in/out shardings; train_step donates its state.

  train_step(params, opt_state, rest, tokens) -> (params, opt_state, rest, {"loss", "grad_norm"});
  eval_step(params, rest, tokens) -> loss. tokens: (batch, seq_len + 1) int32, or a dict of such
  arrays (document masking, packed sft rows: dataset.py; `batch_loss`).
  apply_fn: (grads, opt_state, params) -> (params, opt_state); default `optax_apply(tx)`.
  accumulate: microbatches per step (training/accumulate.py); the loss is their mean.
  grad_dtype: "param" or "bfloat16" (gradients of a bfloat16 copy of the weights; accumulate.py).
  skip_nonfinite: a step whose loss or gradient norm is not finite returns params and optimizer
    state unchanged (`lax.cond`: the update is not computed; `run.on_nonfinite: skip`).
  layer_grads_in_place: each microbatch's backward adds the stacked layers' gradient into the
    accumulator (`sums_layer_grads_in_place` says when the model and dtypes allow it).
  kernel_config: the kernels both steps trace with (`coat_jax.kernels.use`; the run config's
  `kernels:` section).
  """
  apply_fn = apply_fn or optax_apply(tx)
  batch_sh, rep = mesh_lib.batch_sharding(mesh), mesh_lib.replicated(mesh)

  loss_fn = training_loss(parts)
  grad_fn = accumulated_value_and_grad(loss_fn, accumulate, accumulate_dtype, grad_dtype,
                                       loss_adds_into_sink=layer_grads_in_place)

  def keep(grads, opt_state, params):
    return params, opt_state

  def train_step(params, opt_state, rest, tokens):
    (loss, rest), grads = grad_fn(params, rest, tokens)
    grad_norm = optax.tree.norm(grads)
    if skip_nonfinite:
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      params, opt_state = jax.lax.cond(finite, apply_fn, keep, grads, opt_state, params)
    else:
      params, opt_state = apply_fn(grads, opt_state, params)
    return params, opt_state, rest, {"loss": loss, "grad_norm": grad_norm}

  def eval_step(params, rest, tokens):
    return loss_fn(params, rest, tokens)[0]

  train_step = kernels.use(kernel_config)(train_step)
  eval_step = kernels.use(kernel_config)(eval_step)
  state_sh = (parts.params_shardings, opt_shardings, parts.rest_shardings)
  train = jax.jit(train_step, in_shardings=(*state_sh, batch_sh), out_shardings=(*state_sh, rep),
                  donate_argnums=(0, 1, 2))
  evaluate = jax.jit(eval_step, in_shardings=(parts.params_shardings, parts.rest_shardings, batch_sh),
                     out_shardings=rep)
  return train, evaluate


def with_shardings(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs of `abstract` carrying `shardings` (lowering and checkpoint templates)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)


class Built(NamedTuple):
  """Everything `build` makes; `init(seed=None)` -> fresh (params, opt_state, rest) (default: the
  build's seed)."""
  llama_cfg: Any
  parts: ModelParts
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  opt_abstract: Any
  opt_shardings: Any
  train_step: Callable
  eval_step: Callable
  batch_sharding: Any
  init: Callable[..., tuple[Any, Any, Any]]
  optimizer: OptimizerConfig
  sums_layer_grads_in_place: bool = False   # `sums_layer_grads_in_place`; memory_budget's flag

  def abstract_state(self) -> tuple[Any, Any, Any]:
    """(params, opt_state, rest) as sharded ShapeDtypeStructs."""
    p = self.parts
    return (with_shardings(p.params_abstract, p.params_shardings),
            with_shardings(self.opt_abstract, self.opt_shardings),
            with_shardings(p.rest_abstract, p.rest_shardings))

  def memory_budget(self) -> dict[str, int]:
    """`memory_budget` of this build's state per device: each leaf at its shard's shape."""
    params, opt_state, _ = self.abstract_state()
    return memory_budget(self.optimizer, shard_shapes(params), shard_shapes(opt_state),
                         self.sums_layer_grads_in_place)


def shard_shapes(tree: Any) -> Any:
  """ShapeDtypeStructs of each leaf's per-device shard (the leaf itself without a sharding)."""
  def one(a):
    sh = getattr(a, "sharding", None)
    return jax.ShapeDtypeStruct(sh.shard_shape(a.shape) if sh is not None else a.shape, a.dtype)
  return jax.tree.map(one, tree)


def build(cfg: RunConfig, mesh, *, vocab_size: int | None = None, total_steps: int | None = None,
          seed: int | None = None, extra_tx: optax.GradientTransformation | None = None) -> Built:
  """Model, optimizer, shardings, jitted steps and init for `cfg` on `mesh`.

  vocab_size: the data's tokenizer vocabulary (None: the config's/preset's).
  total_steps: the schedule's length (default `cfg.run.steps`); seed: init seed (`cfg.run.seed`).
  extra_tx: chained after the config's optimizer (its state replicated); the step then uses
    tx.update + apply_updates instead of the fused coat_adamw_apply.
  """
  kernels.current_backend()   # a bad COAT_JAX_KERNELS: its one-line ValueError now, not in a trace
  if AUTO in (cfg.model.remat, cfg.optimizer.accumulate):
    raise ValueError("model.remat / optimizer.accumulate 'auto' are chosen before the first step "
                     "by coat_jax.training.plan.Planner (as train.py does); build takes the "
                     "chosen values")
  shards = mesh_lib.batch_shards(mesh)
  if cfg.data.batch_size % shards:
    raise ValueError(f"data.batch_size={cfg.data.batch_size} is not divisible by the mesh's "
                     f"data x fsdp = {shards} batch shards")
  micro = cfg.optimizer.accumulate
  if cfg.data.batch_size % (micro * shards):
    raise ValueError(f"data.batch_size={cfg.data.batch_size} is not divisible by "
                     f"optimizer.accumulate={micro} microbatches x {shards} batch shards")
  with kernels.use(cfg.kernels):   # the kernels' compile workers start while the model is made
    kernels.prestart_compiles(mosaic=cfg.precision != "bf16",
                              triton=cfg.optimizer.name == "coat_adamw")
  seed = cfg.run.seed if seed is None else seed
  llama_cfg = model_config(cfg, vocab_size)
  group = cfg.optimizer.group_size if cfg.optimizer.name == "coat_adamw" else None
  parts, init_params = model_parts(llama_cfg, seed, mesh, group, cfg.optimizer.group_axis)
  if cfg.model.init_from:   # the directory's weights instead of a random init
    init_params = pretrained.init_params(cfg.model.init_from, llama_cfg, parts.params_shardings,
                                         parts.rest_shardings,
                                         progress=cfg.run.progress and jax.process_index() == 0)
  base_tx, schedule = build_optimizer(cfg.optimizer, total_steps or cfg.run.steps)
  base_abstract = jax.eval_shape(base_tx.init, parts.params_abstract)
  axes = None
  if cfg.optimizer.name == "coat_adamw":
    from coat_jax.optim import group_axes
    axes = group_axes(cfg.optimizer.group_axis, parts.params_abstract)
  opt_sh = mesh_lib.optimizer_state_shardings(base_tx, base_abstract, parts.params_shardings, mesh,
                                              cfg.optimizer.name, axes)
  if extra_tx is None:
    tx, opt_abstract, apply_fn = base_tx, base_abstract, build_apply(cfg.optimizer, base_tx, schedule)
  else:
    tx = optax.chain(base_tx, extra_tx)
    opt_abstract = jax.eval_shape(tx.init, parts.params_abstract)
    rep = mesh_lib.replicated(mesh)
    opt_sh = (opt_sh, jax.tree.map(lambda _: rep, opt_abstract[1]))
    apply_fn = optax_apply(tx)
  in_place = sums_layer_grads_in_place(llama_cfg, cfg.optimizer, parts.params_abstract)
  train_step, eval_step = make_steps(parts, tx, opt_sh, mesh, apply_fn, accumulate=micro,
                                     accumulate_dtype=cfg.optimizer.accumulate_dtype,
                                     grad_dtype=cfg.optimizer.grad_dtype,
                                     skip_nonfinite=cfg.run.on_nonfinite == "skip",
                                     layer_grads_in_place=in_place, kernel_config=cfg.kernels)
  opt_init = jax.jit(tx.init, in_shardings=(parts.params_shardings,), out_shardings=opt_sh)

  def init(seed: int | None = None):
    params, rest = init_params() if seed is None else init_params(seed)
    return params, opt_init(params), rest

  return Built(llama_cfg, parts, tx, schedule, opt_abstract, opt_sh, train_step, eval_step,
               mesh_lib.batch_sharding(mesh), init, cfg.optimizer, in_place)
