"""Train the Flax Llama end to end: config -> mesh -> data -> model -> optimizer -> loop.

Usage:
  python train.py                                   # the embedded default: configs/tiny.yaml
  python train.py --config configs/llama-125m.yaml --set optimizer.name=coat_adamw --set precision=coat
  python train.py --config configs/tiny.yaml --resume        # continue the identical run
  python train.py --steps 1000 --out-dir runs/x               # shorthands for --set run.steps/run.out_dir
  python train.py --distributed ...                           # multi-host: jax.distributed.initialize()

Everything a run needs is in the config (coat_jax/config.py documents the schema); `--set
section.key=value` overrides any entry and is checked like the file. Outputs go to `run.out_dir`:
config.yaml, metrics.jsonl, tb/ (TensorBoard), loss.png, summary.json, checkpoints/.

SIGINT/SIGTERM: the current step finishes, a checkpoint is written, and the run exits cleanly
(`--resume` continues it); a second signal stops at once.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from coat_jax import checkpoint as ckpt_lib
from coat_jax import config as config_lib
from coat_jax import data as data_lib
from coat_jax import metrics as metrics_lib
from coat_jax import sharding as sharding_lib
from coat_jax.config import RunConfig

REPO = Path(__file__).resolve().parent
DEFAULT_CONFIG = REPO / "configs" / "tiny.yaml"


# ----------------------------------------------------------------------------------------------
# Command line.


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default=None,
                 help=f"YAML run config (default: the embedded {DEFAULT_CONFIG.relative_to(REPO)})")
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                 help="override a config entry, e.g. --set optimizer.lr=1e-3 (repeatable)")
  p.add_argument("--resume", action="store_true", help="restore the latest checkpoint and continue")
  p.add_argument("--steps", type=int, default=None, help="shorthand for --set run.steps=N")
  p.add_argument("--out-dir", default=None, help="shorthand for --set run.out_dir=DIR")
  p.add_argument("--stop-after", type=int, default=None,
                 help="stop (with a checkpoint) once this many steps are done, keeping the schedule "
                      "of run.steps: the second half comes with --resume")
  p.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
  p.add_argument("--distributed", action="store_true",
                 help="multi-host: call jax.distributed.initialize() first (coordinator from the "
                      "environment: SLURM/TPU/Open MPI, or JAX_COORDINATOR_ADDRESS etc.)")
  p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
  return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> RunConfig:
  overrides = list(args.overrides)
  if args.steps is not None:
    overrides.append(f"run.steps={args.steps}")
  if args.out_dir is not None:
    overrides.append(f"run.out_dir={args.out_dir}")
  if args.no_progress:
    overrides.append("run.progress=false")
  path = args.config if args.config is not None else (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
  return config_lib.load(path, overrides)


# ----------------------------------------------------------------------------------------------
# Model and optimizer.


def model_config(cfg: RunConfig, data_vocab: int | None):
  """The LlamaConfig for this run: preset + overrides + precision + vocab/sequence fit to the data."""
  from coat_jax.models.llama import LlamaConfig

  overrides = cfg.model.overrides()
  if overrides.get("dtype") == "auto":
    overrides["dtype"] = "float32" if jax.default_backend() == "cpu" else "bfloat16"
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


def lr_schedule(opt: config_lib.OptimizerConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `lr`, then cosine/linear decay to `lr * min_lr_ratio` (or constant)."""
  end = opt.lr * opt.min_lr_ratio
  warmup = min(opt.warmup, total_steps)
  decay_steps = max(1, total_steps - warmup)
  if opt.schedule == "cosine":
    after = optax.cosine_decay_schedule(opt.lr, decay_steps, alpha=opt.min_lr_ratio)
  elif opt.schedule == "linear":
    after = optax.linear_schedule(opt.lr, end, decay_steps)
  else:
    after = optax.constant_schedule(opt.lr)
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, opt.lr, warmup), after], [warmup])


def weight_decay_mask(opt: config_lib.OptimizerConfig):
  if opt.decay_1d:
    return None
  return lambda params: jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def build_optimizer(opt: config_lib.OptimizerConfig, total_steps: int):
  """(optax transformation, schedule): clip_by_global_norm -> adamw | coat_adamw."""
  schedule = lr_schedule(opt, total_steps)
  if opt.name == "adamw":
    core = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay,
                       mask=weight_decay_mask(opt))
  else:
    from coat_jax.optim import coat_adamw
    core = coat_adamw(schedule, *_coat_args(opt), **_coat_kwargs(opt))
  parts = ([optax.clip_by_global_norm(opt.clip)] if opt.clip > 0 else []) + [core]
  return optax.chain(*parts), schedule


def _coat_args(opt: config_lib.OptimizerConfig) -> tuple:
  """coat_adamw's / coat_adamw_apply's positional arguments after the learning rate."""
  return opt.b1, opt.b2, opt.eps, opt.weight_decay, weight_decay_mask(opt)


def _coat_kwargs(opt: config_lib.OptimizerConfig) -> dict:
  return dict(m_format=opt.m_format, v_format=opt.v_format, group_size=opt.group_size,
              expand=opt.expand, expand_min=opt.expand_min,
              min_quantized_size=opt.min_quantized_size)


def optax_apply(tx: optax.GradientTransformation):
  """apply(grads, opt_state, params) -> (new params, new opt_state): tx.update + apply_updates."""
  def apply(grads, opt_state, params):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return apply


def build_apply(opt: config_lib.OptimizerConfig, tx, schedule):
  """apply(grads, opt_state, params) -> (new params, new opt_state) for `build_optimizer`'s tx.

  Equal to tx.update + optax.apply_updates (same state structure, so checkpoints are shared). For
  coat_adamw the last link is `coat_adamw_apply`: its fused kernel writes the new params in one
  pass instead of writing an update that apply_updates reads back (on the H100 7.9 vs 12.0 ms of
  kernel time per step for 1.21e9 params, docs/benchmarks.md).
  """
  if opt.name != "coat_adamw":
    return optax_apply(tx)

  from coat_jax.optim import coat_adamw_apply
  core = coat_adamw_apply(schedule, *_coat_args(opt), **_coat_kwargs(opt))
  clip = optax.clip_by_global_norm(opt.clip) if opt.clip > 0 else None

  def apply(grads, opt_state, params):
    *pre, core_state = opt_state   # optax.chain's state: one entry per link
    if clip is not None:
      grads, clip_state = clip.update(grads, pre[0], params)
      pre = [clip_state]
    params, core_state = core(grads, core_state, params)
    return params, tuple(pre) + (core_state,)
  return apply


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy (nats) in float32; logits (B, S, V), labels (B, S) int32."""
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


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


def model_parts(llama_cfg, seed: int, mesh) -> tuple[ModelParts, Callable[[], tuple[Any, Any]]]:
  """Takes the model apart abstractly (nothing allocated) and returns it with an init function."""
  from coat_jax.models.llama import Llama

  def build():
    return Llama(llama_cfg, rngs=nnx.Rngs(seed))

  abstract = nnx.eval_shape(build)
  graphdef, params_state, rest_state = nnx.split(abstract, nnx.Param, ...)
  params_abstract, rest_abstract = nnx.to_pure_dict(params_state), nnx.to_pure_dict(rest_state)
  params_sh = sharding_lib.param_shardings(params_abstract, mesh)
  rest_sh = jax.tree.map(lambda _: sharding_lib.replicated(mesh), rest_abstract)
  parts = ModelParts(graphdef, params_state, rest_state, params_abstract, rest_abstract,
                     params_sh, rest_sh)

  def init(key):  # the key is an argument: a constant one lets XLA constant-fold the RNG (minutes)
    _, p, r = nnx.split(Llama(llama_cfg, rngs=nnx.Rngs(key)), nnx.Param, ...)
    return nnx.to_pure_dict(p), nnx.to_pure_dict(r)

  init_jit = jax.jit(init, out_shardings=(params_sh, rest_sh))
  return parts, lambda: init_jit(jax.random.key(seed))


def make_steps(parts: ModelParts, tx, opt_shardings, mesh, apply_fn=None):
  """Jitted (train_step, eval_step) with explicit in/out shardings; train_step donates its state.

  apply_fn: (grads, opt_state, params) -> (params, opt_state), e.g. `build_apply`'s; default
  `optax_apply(tx)` (tx.update followed by optax.apply_updates).
  """
  apply_fn = apply_fn or optax_apply(tx)
  batch_sh = sharding_lib.batch_sharding(mesh)
  rep = sharding_lib.replicated(mesh)

  def loss_fn(params, rest, tokens):
    model = parts.merge(params, rest)
    logits = model(tokens[:, :-1])
    loss = cross_entropy(logits, tokens[:, 1:])
    _, _, new_rest = nnx.split(model, nnx.Param, ...)
    return loss, nnx.to_pure_dict(new_rest)

  def train_step(params, opt_state, rest, tokens):
    (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, tokens)
    params, opt_state = apply_fn(grads, opt_state, params)
    return params, opt_state, rest, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

  def eval_step(params, rest, tokens):
    return loss_fn(params, rest, tokens)[0]

  train = jax.jit(train_step,
                  in_shardings=(parts.params_shardings, opt_shardings, parts.rest_shardings, batch_sh),
                  out_shardings=(parts.params_shardings, opt_shardings, parts.rest_shardings, rep),
                  donate_argnums=(0, 1, 2))
  evaluate = jax.jit(eval_step, in_shardings=(parts.params_shardings, parts.rest_shardings, batch_sh),
                     out_shardings=rep)
  return train, evaluate


def _with_shardings(abstract: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


# ----------------------------------------------------------------------------------------------
# Stopping on signals.


class StopRequest:
  """Set by SIGINT/SIGTERM (or by `request`); the loop checkpoints and returns at the next step."""

  def __init__(self):
    self.reason: str | None = None
    self._previous: dict[int, Any] = {}

  def request(self, reason: str) -> None:
    self.reason = reason

  def __bool__(self) -> bool:
    return self.reason is not None

  def _handler(self, signum, frame):
    if self.reason is not None:  # second signal: stop now
      self.uninstall()
      raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
    self.request(signal.Signals(signum).name)

  def install(self) -> None:
    if threading.current_thread() is not threading.main_thread():
      return
    for sig in (signal.SIGINT, signal.SIGTERM):
      self._previous[sig] = signal.signal(sig, self._handler)

  def uninstall(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()


# ----------------------------------------------------------------------------------------------
# The run.


def _config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
  out = []
  for k in sorted(set(old) | set(new)):
    a, b = old.get(k), new.get(k)
    if isinstance(a, dict) and isinstance(b, dict):
      out += _config_diff(a, b, f"{prefix}{k}.")
    elif a != b:
      out.append(f"{prefix}{k}: {a!r} -> {b!r}")
  return out


def _use_compile_cache(directory: str, say: Callable[[str], None]) -> None:
  """Points JAX's persistent compilation cache at `directory` (unless "" or one is already set)."""
  if not directory or jax.config.jax_compilation_cache_dir:
    return
  path = Path(os.path.expanduser(directory))
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:  # a read-only home must not stop training
    say(f"[run] compilation cache off: cannot create {path} ({e})")
    return
  jax.config.update("jax_compilation_cache_dir", str(path))


def run(cfg: RunConfig, *, resume: bool = False, stop_after: int | None = None,
        devices: list[jax.Device] | None = None, log: Callable[[str], None] = print,
        on_step: Callable[[int, "StopRequest"], None] | None = None,
        stop: StopRequest | None = None) -> dict:
  """Trains per `cfg`; returns a summary dict (final losses, throughput, memory, per-step losses).

  Args:
    resume: continue from the latest checkpoint in the checkpoint directory (fresh start if none).
    stop_after: stop once this many steps are done (checkpointing), keeping `run.steps`' schedule.
    devices: devices for the mesh (default: all).
    on_step: called as on_step(step, stop) after every step; `stop.request(reason)` ends the run
      with a checkpoint, as a signal does.
    stop: a StopRequest to use (its signal handlers are installed for the duration of the run).
  """
  t_start = time.time()
  is_main = jax.process_index() == 0
  out_dir = Path(cfg.run.out_dir)
  say = log if is_main else (lambda _: None)
  total_steps = cfg.run.steps
  end_step = total_steps if stop_after is None else min(total_steps, stop_after)

  _use_compile_cache(cfg.run.compile_cache, say)
  # Mesh, data, model.
  mesh = sharding_lib.make_mesh(cfg.mesh, devices)
  shards = sharding_lib.batch_shards(mesh)
  if cfg.data.batch_size % shards:
    raise ValueError(f"data.batch_size={cfg.data.batch_size} is not divisible by the mesh's "
                     f"data x fsdp = {shards} batch shards")
  dataset = data_lib.build_dataset(cfg.data, cfg.run.seed, log=say)
  llama_cfg = model_config(cfg, dataset.vocab_size)
  dataset.check_vocab(llama_cfg.vocab_size)
  out_dir.mkdir(parents=True, exist_ok=True)  # only once the data and model config are good
  from coat_jax.models import llama as llama_lib

  n_params = llama_lib.num_params(llama_cfg)
  flops_per_token = float(llama_lib.flops_per_token(llama_cfg, cfg.data.seq_len))
  tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
  say(f"[run] {dataset.description}: {dataset.num_tokens:,} tokens, {dataset.n_train:,} train / "
      f"{dataset.n_eval:,} eval windows of {cfg.data.seq_len}")
  say(f"[run] model {cfg.model.preset} ({n_params / 1e6:.2f}M params, precision {cfg.precision}), "
      f"optimizer {cfg.optimizer.name}, mesh {dict(mesh.shape)} on {mesh.devices.size} "
      f"{mesh.devices.flat[0].platform} device(s)")

  parts, init_fn = model_parts(llama_cfg, cfg.run.seed, mesh)
  tx, schedule = build_optimizer(cfg.optimizer, total_steps)
  opt_abstract = jax.eval_shape(tx.init, parts.params_abstract)
  opt_sh = sharding_lib.optimizer_state_shardings(tx, opt_abstract, parts.params_shardings, mesh,
                                                  cfg.optimizer.name)
  train_step, eval_step = make_steps(parts, tx, opt_sh, mesh,
                                     build_apply(cfg.optimizer, tx, schedule))

  ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out_dir / "checkpoints"
  # Resources opened from here on are closed on errors too (close() is idempotent).
  with contextlib.ExitStack() as cleanup:
    checkpointer = ckpt_lib.Checkpointer(ckpt_dir, cfg.checkpoint.every, cfg.checkpoint.keep,
                                         cfg.checkpoint.async_save)
    cleanup.callback(checkpointer.close)
    params, opt_state, rest, start_step, run_key = restore_or_init(
        cfg, checkpointer, parts, init_fn, tx, opt_abstract, opt_sh, resume, say)
    (out_dir / "config.yaml").write_text(cfg.to_yaml())
    metrics = None
    if is_main:
      metrics = metrics_lib.MetricsLog(out_dir, cfg.run.tensorboard,
                                       resume_step=start_step if start_step else None, log=say)
      cleanup.callback(metrics.close)
    batch_sh = sharding_lib.batch_sharding(mesh)
    eval_batches = [sharding_lib.put_batch(b, batch_sh)
                    for b in dataset.eval_batches(cfg.data.eval_batches)]
    devices_used = list(mesh.devices.flat)

    def evaluate(step: int) -> float | None:
      if not eval_batches:
        return None
      value = float(np.mean(jax.device_get([eval_step(params, rest, b) for b in eval_batches])))
      if metrics:
        metrics.write(step, "eval", {"loss": value, "perplexity": math.exp(min(value, 50.0))})
      return value

    def save(step: int, force: bool) -> bool:
      meta = {"step": step, "data_position": step, "seed": cfg.run.seed,
              "epoch": dataset.epoch_of(step),
              "rng": np.asarray(jax.random.key_data(run_key)).tolist(), "config": cfg.to_dict()}
      return checkpointer.save(step, {"params": params, "opt_state": opt_state, "rest": rest}, meta,
                               force=force)

    from tqdm import tqdm

    bar = tqdm(total=end_step, initial=start_step, disable=not (cfg.run.progress and is_main),
               dynamic_ncols=True, desc="train", file=sys.stderr)
    logger = StepLogger(metrics, bar, say, schedule, flops_per_token, tokens_per_step, devices_used,
                        dataset.epoch_of)
    eval_history: dict[int, float] = {}
    step, interrupted = start_step, None
    stop = stop or StopRequest()
    stop.install()
    try:
      while step < end_step:
        tokens = sharding_lib.put_batch(dataset.train_batch(step), batch_sh)
        params, opt_state, rest, out = train_step(params, opt_state, rest, tokens)
        step += 1
        logger.step_done(step, out, log_now=step % cfg.run.log_every == 0 or step == end_step)
        if cfg.run.eval_every and step % cfg.run.eval_every == 0 and step < end_step:
          eval_history[step] = evaluate(step)
          if eval_history[step] is not None:  # None: no held-out batches configured
            (say if bar.disable else bar.write)(f"[eval] step {step}: loss {eval_history[step]:.4f}")
        save(step, force=False)
        if on_step is not None:
          on_step(step, stop)
        if stop:
          interrupted = stop.reason
          break
    finally:
      bar.close()
      stop.uninstall()

    # The end (normal, early stop or signal): final eval, checkpoint, logs, plot.
    logger.flush()
    final_eval = evaluate(step)
    if final_eval is not None:
      eval_history[step] = final_eval
    if save(step, force=True):
      say(f"[run] checkpoint at step {step} in {ckpt_dir}")
    checkpointer.close()
    mem, mem_kind = metrics_lib.peak_memory_bytes(devices_used)
    tokens_per_s = logger.median_tokens_per_s()
    history = logger.history
    summary = {
        "step": step, "total_steps": total_steps, "interrupted": interrupted,
        "final_train_loss": history.get(step), "first_train_loss": history[min(history)] if history else None,
        "final_eval_loss": final_eval, "tokens_per_s": tokens_per_s,
        "mfu": metrics_lib.mfu(flops_per_token, tokens_per_s, devices_used) if tokens_per_s else None,
        "peak_memory_bytes": mem, "peak_memory_kind": mem_kind, "num_params": n_params,
        "flops_per_token": flops_per_token, "wall_s": time.time() - t_start,
        "losses": history, "eval_losses": eval_history, "out_dir": str(out_dir),
        "checkpoint_dir": str(ckpt_dir),
    }
    if metrics:
      metrics.close()
      if cfg.run.plot:
        metrics_lib.plot_losses(metrics.records, out_dir / "loss.png",
                                title=f"{cfg.model.preset} / {cfg.precision} / {cfg.optimizer.name}")
      (out_dir / "summary.json").write_text(json.dumps(
          {k: v for k, v in summary.items() if k not in ("losses", "eval_losses")}, indent=2))
    say(summary_line(summary))
    return summary


def restore_or_init(cfg: RunConfig, checkpointer, parts: ModelParts, init_fn, tx, opt_abstract,
                    opt_sh, resume: bool, say):
  """(params, opt_state, rest, start_step, run_key): from the latest checkpoint or freshly made."""
  if not (resume and checkpointer.latest_step() is not None):
    if resume:
      say(f"[run] --resume: no checkpoint in {checkpointer.directory}, starting from scratch")
    params, rest = init_fn()
    opt_state = jax.jit(tx.init, in_shardings=(parts.params_shardings,), out_shardings=opt_sh)(params)
    return params, opt_state, rest, 0, jax.random.key(cfg.run.seed)
  template = {"params": _with_shardings(parts.params_abstract, parts.params_shardings),
              "opt_state": _with_shardings(opt_abstract, opt_sh),
              "rest": _with_shardings(parts.rest_abstract, parts.rest_shardings)}
  state, meta, step = checkpointer.restore(template)
  if meta.get("data_position") != step or meta.get("seed") != cfg.run.seed:
    raise ValueError(f"checkpoint {checkpointer.directory}/{step} was written with seed "
                     f"{meta.get('seed')} at data position {meta.get('data_position')}; this run "
                     f"has seed {cfg.run.seed}: resuming would not continue the same run")
  ignore = ("run", "checkpoint")
  diff = _config_diff({k: v for k, v in meta.get("config", {}).items() if k not in ignore},
                      {k: v for k, v in cfg.to_dict().items() if k not in ignore})
  say(f"[run] resumed from {checkpointer.directory} at step {step}"
      + (f"; config changed since: {'; '.join(diff)}" if diff else ""))
  run_key = jax.random.wrap_key_data(jnp.asarray(meta["rng"], jnp.uint32))
  return state["params"], state["opt_state"], state["rest"], step, run_key


class StepLogger:
  """Collects per-step outputs without blocking, and every `log_now` step fetches them and logs
  loss (mean over the window), grad norm, lr, tokens/s, MFU and peak memory."""

  def __init__(self, metrics, bar, say, schedule, flops_per_token, tokens_per_step, devices, epoch_of):
    self.metrics, self.bar, self.say, self.schedule = metrics, bar, say, schedule
    self.flops_per_token, self.tokens_per_step = flops_per_token, tokens_per_step
    self.devices, self.epoch_of = devices, epoch_of
    self.history: dict[int, float] = {}
    self.window_tokens_per_s: list[float] = []
    self._pending: list[tuple[int, dict]] = []
    self._throughput = metrics_lib.Throughput()
    self._compiled = False

  def step_done(self, step: int, out: dict, log_now: bool) -> None:
    self._pending.append((step, out))
    self.bar.update(1)
    if not self._compiled:  # the first step compiles: leave it out of the throughput
      jax.block_until_ready(out["loss"])
      self._throughput.reset()
      self._compiled = True
      log_now = log_now or step == 1  # log the starting loss
    else:
      self._throughput.update(self.tokens_per_step)
    if log_now:
      self._log(step)

  def flush(self) -> None:
    if self._pending:
      for (s, _), o in zip(self._pending, jax.device_get([o for _, o in self._pending])):
        self.history[s] = float(o["loss"])
      self._pending.clear()

  def median_tokens_per_s(self) -> float:
    return float(np.median(self.window_tokens_per_s)) if self.window_tokens_per_s else 0.0

  def _log(self, step: int) -> None:
    fetched = jax.device_get([o for _, o in self._pending])
    tps = self._throughput.tokens_per_s()
    if tps > 0:
      self.window_tokens_per_s.append(tps)
    mfu = metrics_lib.mfu(self.flops_per_token, tps, self.devices) if tps > 0 else None
    mem, _ = metrics_lib.peak_memory_bytes(self.devices)
    for (s, _), o in zip(self._pending, fetched):
      self.history[s] = float(o["loss"])
    loss = float(np.mean([o["loss"] for o in fetched]))
    if self.metrics:
      self.metrics.write(step, "train", {
          "loss": loss, "loss_last": float(fetched[-1]["loss"]),
          "grad_norm": float(fetched[-1]["grad_norm"]), "lr": float(self.schedule(step - 1)),
          "tokens_per_s": tps, "mfu": mfu,
          "peak_memory_bytes": mem, "tokens_seen": step * self.tokens_per_step,
          "epoch": self.epoch_of(step)})
    postfix = {"loss": f"{loss:.4f}", "tok/s": f"{tps:,.0f}",
               "mfu": f"{100 * mfu:.1f}%" if mfu is not None else "n/a",
               "mem": metrics_lib.format_bytes(mem)}
    self.bar.set_postfix(postfix, refresh=False)
    if self.bar.disable:
      self.say(f"[step {step}] " + " ".join(f"{k} {v}" for k, v in postfix.items()))
    self._pending.clear()
    self._throughput.reset()


def summary_line(s: dict) -> str:
  fmt = lambda v: "n/a" if v is None else f"{v:.4f}"
  mfu = "n/a" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"
  head = f"[done] step {s['step']}/{s['total_steps']}"
  if s["interrupted"]:
    head += f" (stopped by {s['interrupted']}; continue with --resume)"
  return (f"{head}: train loss {fmt(s['first_train_loss'])} -> {fmt(s['final_train_loss'])}, "
          f"eval loss {fmt(s['final_eval_loss'])}, {s['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, "
          f"peak memory {metrics_lib.format_bytes(s['peak_memory_bytes'])} ({s['peak_memory_kind']}), "
          f"{s['wall_s']:.0f} s")


def main(argv: list[str] | None = None) -> dict:
  args = parse_args(argv)
  if args.distributed:
    jax.distributed.initialize()
  cfg = load_config(args)
  if args.print_config:
    print(cfg.to_yaml(), end="")
    return {}
  return run(cfg, resume=args.resume, stop_after=args.stop_after)


if __name__ == "__main__":
  try:
    main()
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
