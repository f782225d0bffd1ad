"""The training loop: data -> jitted steps -> logs, evals, checkpoints; stops on signals or hooks.

`run(cfg)` builds through `build.build` and trains `cfg.run.steps` steps. Batches are a pure
function of (seed, step), so a checkpoint at step s plus `resume=True` continues the identical
run. Hooks: `on_step(step, stop)` after every step (`stop.request(reason)` ends the run with a
checkpoint, as SIGINT/SIGTERM do; a second signal stops at once); checkpoints every
`checkpoint.every` steps and at the end; metrics every `run.log_every` steps (step_log.py).
"""
from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from coat_jax.training import checkpoint as ckpt_lib
from coat_jax.training import mesh as mesh_lib
from coat_jax.training import metrics as metrics_lib
from coat_jax.training import plan as plan_lib
from coat_jax.training import run_dir
from coat_jax.training.compile_cache import use_compile_cache
from coat_jax.training.build import Built, dataset_from_config
from coat_jax.training.divergence import NonFiniteGuard
from coat_jax.errors import BadInputError, OutOfMemoryError, RunError
from coat_jax.training.run_model import write_run_files
from coat_jax.training.schema import RunConfig
from coat_jax.training.step_log import StepLogger, summary_line


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
      interrupt = KeyboardInterrupt(f"second {signal.Signals(signum).name}")
      interrupt.signum = signum  # train.py exits with 128 + signum
      raise interrupt
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


def config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
  out = []
  for k in sorted(set(old) | set(new)):
    a, b = old.get(k), new.get(k)
    if isinstance(a, dict) and isinstance(b, dict):
      out += config_diff(a, b, f"{prefix}{k}.")
    elif a != b:
      out.append(f"{prefix}{k}: {a!r} -> {b!r}")
  return out


def first_train_loss(records: list[dict], history: dict[int, float]) -> float | None:
  """The run's first logged one-batch loss: from the metrics records (which survive resumes),
  else the earliest step of `history`."""
  for r in records:
    if r.get("split") == "train" and "loss_last" in r:
      return r["loss_last"]
  return history[min(history)] if history else None


def exit_status(summary: dict) -> int:
  """The process exit status after a run: 128 + the signal number when a signal stopped it."""
  reason = summary.get("interrupted")
  if reason in signal.Signals.__members__:
    return 128 + int(signal.Signals[reason])
  return 0


def run(cfg: RunConfig, *, resume: bool = False, stop_after: int | None = None,
        devices: list[jax.Device] | None = None, log: Callable[[str], None] = print,
        on_step: Callable[[int, "StopRequest"], None] | None = None,
        stop: StopRequest | None = None, overwrite: bool = False,
        resume_from: int | None = None, allow_steps_change: bool = False) -> dict:
  """Trains per `cfg`; returns a summary dict (final losses, throughput, memory, per-step losses).

  Args:
    resume: continue from the newest intact checkpoint in the checkpoint directory (fresh start if
      there is no earlier run at all; unreadable ones are reported and set aside; with none left
      but an earlier run's metrics, BadInputError). resume_from: that step (implies resume).
    stop_after: stop once this many steps are done (checkpointing), keeping `run.steps`' schedule.
    devices: devices for the mesh (default: all).
    on_step: called as on_step(step, stop) after every step; `stop.request(reason)` ends the run
      with a checkpoint, as a signal does.
    stop: a StopRequest to use (its signal handlers are installed for the duration of the run).
    overwrite: a fresh run (no `resume`) replaces an earlier run's checkpoints and logs in its
      directories (run_dir.clear_earlier_run: only what a run wrote); without it such a run is
      refused (BadInputError), and nothing is deleted.
    allow_steps_change: resume a checkpoint written with another `run.steps` (the learning-rate
      schedule is recomputed for the new length); without it that is refused.

  The output directory is locked for the run (run_dir.DirLock): a second run on it stops with
  BadInputError. Errors carry their exit status (errors.py): a non-finite loss DivergedError,
  an output directory that is gone or full StorageError / OSError.
  """
  resume = resume or resume_from is not None
  out_dir = run_dir.expand(cfg.run.out_dir)
  ckpt_dir = run_dir.expand(cfg.checkpoint.dir) if cfg.checkpoint.dir else out_dir / "checkpoints"
  dirs = run_dir.RunDirs(out_dir, ckpt_dir, is_main=jax.process_index() == 0)
  try:
    dirs.lock()
    if not resume:
      run_dir.clear_earlier_run(out_dir, ckpt_dir, overwrite)
    return _run(cfg, dirs, resume=resume, stop_after=stop_after, devices=devices, log=log,
                on_step=on_step, stop=stop, resume_from=resume_from,
                allow_steps_change=allow_steps_change)
  finally:
    dirs.release()


def _model_name(cfg, llama_cfg) -> str:
  """The model as the run log names it: the checkpoint it starts from, else its preset, with the
  shape where the config resized the preset (e.g. "llama2-13b resized to 6144 x 48 layers, ...")."""
  if cfg.model.init_from:
    return cfg.model.init_from
  from coat_jax.models.llama import LlamaConfig
  preset = LlamaConfig.from_name(cfg.model.preset)
  shape = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
  if all(getattr(preset, k) == getattr(llama_cfg, k) for k in shape):
    return cfg.model.preset
  return (f"{cfg.model.preset} resized to {llama_cfg.hidden_size} x {llama_cfg.num_layers} layers, "
          f"MLP {llama_cfg.intermediate_size}, {llama_cfg.num_heads} heads")


def _run(cfg: RunConfig, dirs: run_dir.RunDirs, *, resume: bool, stop_after: int | None,
         devices: list[jax.Device] | None, log: Callable[[str], None],
         on_step: Callable[[int, "StopRequest"], None] | None, stop: StopRequest | None,
         resume_from: int | None, allow_steps_change: bool) -> dict:
  t_start = time.time()
  is_main = jax.process_index() == 0
  out_dir, ckpt_dir = dirs.out_dir, dirs.ckpt_dir
  say = log if is_main else (lambda _: None)
  total_steps = cfg.run.steps
  end_step = total_steps if stop_after is None else min(total_steps, stop_after)

  use_compile_cache(cfg.run.compile_cache, say)
  mesh = mesh_lib.make_mesh(cfg.mesh, devices)
  dataset = dataset_from_config(cfg.data, cfg.run.seed, log=say, init_from=cfg.model.init_from)
  # The step compiled on abstract shapes and checked against the device before anything is
  # allocated; `auto` settings resolved (plan.py). The run calls that executable.
  planner = plan_lib.Planner(cfg, mesh, dataset.vocab_size, log=say,
                             batch_like=dataset.train_batch(0))
  chosen = planner.choose(sample_batch=planner.batch_like)
  cfg, built = chosen.cfg, chosen.built
  llama_cfg = built.llama_cfg
  dataset.check_vocab(llama_cfg.vocab_size)
  out_dir.mkdir(parents=True, exist_ok=True)  # only once the data and model config are good
  dirs.lock(create=True)
  if not resume:  # another run may have written here since the check (then released its lock)
    run_dir.clear_earlier_run(out_dir, ckpt_dir, overwrite=False)
  from coat_jax.models import llama as llama_lib

  n_params = llama_lib.num_params(llama_cfg)
  flops_per_token = float(llama_lib.flops_per_token(llama_cfg, cfg.data.seq_len))
  tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
  say(f"[run] {dataset.description}: {dataset.num_tokens:,} tokens, {dataset.n_train:,} train / "
      f"{dataset.n_eval:,} eval windows of {cfg.data.seq_len}")
  say(f"[run] model {_model_name(cfg, llama_cfg)} ({n_params / 1e6:.2f}M params, "
      f"precision {cfg.precision}), "
      f"optimizer {cfg.optimizer.name}, mesh {dict(mesh.shape)} on {mesh.devices.size} "
      f"{mesh.devices.flat[0].platform} device(s)")
  train_step, eval_step = chosen.compiled, built.eval_step
  if not cfg.checkpoint.enabled:
    say("[run] checkpoint.enabled is false: this run writes no checkpoint, not even at the end")

  # Resources opened from here on are closed on errors too (close() is idempotent).
  with contextlib.ExitStack() as cleanup:
    checkpointer = ckpt_lib.Checkpointer(ckpt_dir, cfg.checkpoint.every, cfg.checkpoint.keep,
                                         cfg.checkpoint.async_save,
                                         state_template=built.abstract_state(),
                                         enabled=cfg.checkpoint.enabled)
    cleanup.callback(checkpointer.close)
    params, opt_state, rest, start_step, run_key = restore_or_init(
        cfg, checkpointer, built, resume, say, resume_from, allow_steps_change,
        earlier=run_dir.earlier_run(out_dir, ckpt_dir) + run_dir.set_aside(ckpt_dir))
    (out_dir / "config.yaml").write_text(cfg.to_yaml())
    write_run_files(out_dir, llama_cfg, dataset.tokenizer)   # model.json, tokenizer.json
    metrics = None
    if is_main:
      metrics = metrics_lib.MetricsLog(out_dir, cfg.run.tensorboard,
                                       resume_step=start_step if start_step else None, log=say)
      cleanup.callback(metrics.close)
    batch_sh = built.batch_sharding
    eval_batches = [mesh_lib.put_batch(b, batch_sh)
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

    def out_of_memory(e: Exception, during: str) -> OutOfMemoryError:
      """The one-line error for a device out of memory met `during` a step or an evaluation."""
      checkpointer.wait()
      last = checkpointer.latest_step()
      kept = (f"the checkpoint of step {last} in {ckpt_dir} is intact" if last is not None
              else "no checkpoint was written")
      return OutOfMemoryError(plan_lib.runtime_oom_message(planner, chosen, e, during, kept))

    from tqdm import tqdm

    bar = tqdm(total=end_step, initial=start_step, disable=not (cfg.run.progress and is_main),
               dynamic_ncols=True, desc="train", file=sys.stderr)
    guard = NonFiniteGuard(cfg.run.on_nonfinite, cfg.run.max_nonfinite_steps, str(ckpt_dir),
                           lambda line: (say if bar.disable else bar.write)(line))
    logger = StepLogger(metrics, bar, say, built.schedule, flops_per_token, tokens_per_step, devices_used,
                        dataset.epoch_of, check=guard.check)
    eval_history: dict[int, float] = {}
    step, interrupted = start_step, None
    stop = stop or StopRequest()
    stop.install()
    try:
      while step < end_step:
        tokens = mesh_lib.put_batch(dataset.train_batch(step), batch_sh)
        params, opt_state, rest, out = train_step(params, opt_state, rest, tokens)
        step += 1
        logger.step_done(step, out, log_now=step % cfg.run.log_every == 0 or step == end_step)
        if cfg.run.eval_every and step % cfg.run.eval_every == 0 and step < end_step:
          eval_history[step] = evaluate(step)
          if eval_history[step] is not None:  # None: no held-out batches configured
            (say if bar.disable else bar.write)(f"[eval] step {step}: loss {eval_history[step]:.4f}")
        if checkpointer.should_save(step):
          logger.sync()  # the losses up to here are finite (or skipped) before a checkpoint
        save(step, force=False)
        if on_step is not None:
          on_step(step, stop)
        if stop:
          interrupted = stop.reason
          break
    except Exception as e:
      if isinstance(e, RunError) or not plan_lib.is_out_of_memory(e):
        raise
      params = opt_state = rest = tokens = None  # donated to the failed step; free the rest
      raise out_of_memory(e, f"step {step + 1}") from e
    finally:
      bar.close()
      stop.uninstall()

    # The end (normal, early stop or signal): checkpoint, final eval, logs, plot.
    logger.flush()
    if save(step, force=True):
      say(f"[run] checkpoint at step {step} in {ckpt_dir} (host max RSS so far "
          f"{metrics_lib.format_bytes(metrics_lib.host_max_rss_bytes())})")
    try:
      final_eval = evaluate(step)
    except Exception as e:
      if not plan_lib.is_out_of_memory(e):
        raise
      raise out_of_memory(e, "the final evaluation") from e
    if final_eval is not None:
      eval_history[step] = final_eval
    checkpointer.close()
    mem, mem_kind = metrics_lib.peak_memory_bytes(devices_used)
    if mem_kind == "device peak" and planner.timed_candidates():
      # The device's peak has no reset: the candidates the planner timed count in it.
      mem_kind += (f" over the planner's timed candidates; the trained step predicted "
                   f"{metrics_lib.format_bytes(chosen.peak)}")
    tokens_per_s = logger.median_tokens_per_s()
    history = logger.history
    summary = {
        "step": step, "total_steps": total_steps, "interrupted": interrupted,
        # One batch's loss each: the run's first step (from metrics.jsonl after a resume), the last.
        "train_loss_first": first_train_loss(metrics.records if metrics else [], history),
        "train_loss_last": history.get(step),
        "final_eval_loss": final_eval, "tokens_per_s": tokens_per_s,
        "mfu": metrics_lib.mfu(flops_per_token, tokens_per_s, devices_used) if tokens_per_s else None,
        "peak_memory_bytes": mem, "peak_memory_kind": mem_kind, "num_params": n_params,
        "predicted_peak_bytes": chosen.peak,
        "host_max_rss_bytes": metrics_lib.host_max_rss_bytes(),
        "flops_per_token": flops_per_token, "wall_s": time.time() - t_start,
        "first_step_s": logger.first_step_s, "compile_s": planner.compile_s,
        "nonfinite_steps_skipped": guard.skipped,
        "losses": history, "eval_losses": eval_history, "out_dir": str(out_dir),
        "checkpoint_dir": str(ckpt_dir) if cfg.checkpoint.enabled else None,
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


def restore_or_init(cfg: RunConfig, checkpointer, built: Built, resume: bool, say,
                    resume_from: int | None = None, allow_steps_change: bool = False,
                    earlier: list[str] = ()):
  """(params, opt_state, rest, start_step, run_key): from the latest checkpoint or freshly made.

  `earlier`: what of an earlier run the directories hold (run_dir.earlier_run, set-aside
  checkpoints); a resume that finds no checkpoint refuses to start afresh over it.
  """
  if not (resume and (checkpointer.latest_step() is not None or resume_from is not None)):
    if resume and earlier:
      raise BadInputError(f"--resume: no intact checkpoint in {checkpointer.directory}, but an "
                          f"earlier run is there ({'; '.join(earlier)}); starting afresh would "
                          f"replace its logs: use --overwrite for that, or a new --out-dir")
    if resume:
      say(f"[run] --resume: no checkpoint in {checkpointer.directory}, starting from scratch")
    params, opt_state, rest = built.init()
    return params, opt_state, rest, 0, jax.random.key(cfg.run.seed)
  template = dict(zip(("params", "opt_state", "rest"), built.abstract_state()))
  state, meta, step = checkpointer.restore_intact(template, resume_from, log=say)
  if meta.get("data_position") != step or meta.get("seed") != cfg.run.seed:
    raise ValueError(f"checkpoint {checkpointer.directory}/{step} was written with seed "
                     f"{meta.get('seed')} at data position {meta.get('data_position')}; this run "
                     f"has seed {cfg.run.seed}: resuming would not continue the same run")
  steps_then = meta.get("config", {}).get("run", {}).get("steps", cfg.run.steps)
  if steps_then != cfg.run.steps and not allow_steps_change:
    raise BadInputError(f"checkpoint {checkpointer.directory}/{step} is of a run of run.steps="
                        f"{steps_then}; this run has run.steps={cfg.run.steps}, which changes the "
                        f"learning-rate schedule: resume with run.steps={steps_then}, or pass "
                        f"--allow-steps-change to continue on the new schedule")
  ignore = ("run", "checkpoint")
  diff = config_diff({k: v for k, v in meta.get("config", {}).items() if k not in ignore},
                      {k: v for k, v in cfg.to_dict().items() if k not in ignore})
  say(f"[run] resumed from {checkpointer.directory} at step {step}"
      + (f"; config changed since: {'; '.join(diff)}" if diff else ""))
  run_key = jax.random.wrap_key_data(jnp.asarray(meta["rng"], jnp.uint32))
  return state["params"], state["opt_state"], state["rest"], step, run_key


