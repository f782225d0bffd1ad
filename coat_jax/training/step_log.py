"""Step logging of a run: losses, grad norm, lr, tokens/s, MFU and memory, without blocking the
device between log steps; and the one-line run summary."""
from __future__ import annotations

import time

import jax
import numpy as np

from coat_jax.training import metrics as metrics_lib


class StepLogger:
  """Collects per-step outputs without blocking, and every `log_now` step fetches them and logs
  `loss_mean` (over the steps since the last log, `loss_mean_steps` of them; the progress bar's
  `loss_meanN`), `loss_last` (the last batch's), grad norm, lr, tokens/s, MFU and peak memory.
  `check(records)`, if given, sees every step's fetched (step, {"loss", "grad_norm"}) once, in
  order: after a log step's record is written, and at `sync()` (before a checkpoint)."""

  def __init__(self, metrics, bar, say, schedule, flops_per_token, tokens_per_step, devices, epoch_of,
               check=None):
    self.metrics, self.bar, self.say, self.schedule = metrics, bar, say, schedule
    self.flops_per_token, self.tokens_per_step = flops_per_token, tokens_per_step
    self.devices, self.epoch_of = devices, epoch_of
    self.history: dict[int, float] = {}
    self.window_tokens_per_s: list[float] = []
    self._pending: list[tuple[int, dict]] = []
    self._fetched = 0   # _pending[:_fetched] hold host values already checked
    self.check = check
    self._throughput = metrics_lib.Throughput()
    self._compiled = False
    self._started = time.perf_counter()
    self.first_step_s: float | None = None   # this process' first step (compiled by plan.py)

  def step_done(self, step: int, out: dict, log_now: bool) -> None:
    self._pending.append((step, out))
    self.bar.update(1)
    if not self._compiled:  # the first step compiles: leave it out of the throughput
      jax.block_until_ready(out["loss"])
      self.first_step_s = time.perf_counter() - self._started
      (self.say if self.bar.disable else self.bar.write)(
          f"[run] first step in {self.first_step_s:.1f} s (compiled before it: [plan]); host "
          f"max RSS so far {metrics_lib.format_bytes(metrics_lib.host_max_rss_bytes())}")
      self._throughput.reset()
      self._compiled = True
      log_now = log_now or step == 1  # log the starting loss
    else:
      self._throughput.update(self.tokens_per_step)
    if log_now:
      self._log(step)

  def sync(self, check: bool = True) -> None:
    """Fetches the outputs not fetched yet (one transfer) and passes them to `check`."""
    new = self._pending[self._fetched:]
    if not new:
      return
    fetched = [(s, o) for (s, _), o in zip(new, jax.device_get([o for _, o in new]))]
    self._pending[self._fetched:] = fetched
    for s, o in fetched:
      self.history[s] = float(o["loss"])
    if check:
      self._check_new()

  def _check_new(self) -> None:
    new, self._fetched = self._pending[self._fetched:], len(self._pending)
    if self.check is not None and new:
      self.check(new)

  def flush(self) -> None:
    self.sync()
    self._pending.clear()
    self._fetched = 0

  def median_tokens_per_s(self) -> float:
    return float(np.median(self.window_tokens_per_s)) if self.window_tokens_per_s else 0.0

  def _log(self, step: int) -> None:
    self.sync(check=False)  # the record is written first: a diverged step shows in the logs
    fetched = [o for _, o in self._pending]
    tps = self._throughput.tokens_per_s()
    if tps > 0:
      self.window_tokens_per_s.append(tps)
    mfu = metrics_lib.mfu(self.flops_per_token, tps, self.devices) if tps > 0 else None
    mem, _ = metrics_lib.peak_memory_bytes(self.devices)
    loss = float(np.mean([o["loss"] for o in fetched]))
    if self.metrics:
      self.metrics.write(step, "train", {
          "loss_mean": loss, "loss_mean_steps": len(fetched), "loss_last": float(fetched[-1]["loss"]),
          "grad_norm": float(fetched[-1]["grad_norm"]), "lr": float(self.schedule(step - 1)),
          "tokens_per_s": tps, "mfu": mfu,
          "peak_memory_bytes": mem, "tokens_seen": step * self.tokens_per_step,
          "epoch": self.epoch_of(step)})
      self.metrics.flush()  # a killed run keeps its logs up to here (TensorBoard included)
    postfix = {f"loss_mean{len(fetched)}": f"{loss:.4f}",
               "tok/s": f"{tps:,.0f}" if tps > 0 else "n/a",   # none timed yet: the first step
               "mfu": f"{100 * mfu:.1f}%" if mfu is not None else "n/a",
               "mem": metrics_lib.format_bytes(mem)}
    self.bar.set_postfix(postfix, refresh=False)
    if self.bar.disable:
      self.say(f"[step {step}] " + " ".join(f"{k} {v}" for k, v in postfix.items()))
    self._throughput.reset()
    try:
      self._check_new()
    finally:
      self._pending.clear()
      self._fetched = 0


def summary_line(s: dict) -> str:
  fmt = lambda v: "n/a" if v is None else f"{v:.4f}"
  mfu = "n/a" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"
  head = f"[done] step {s['step']}/{s['total_steps']}"
  if s["interrupted"]:   # --resume only where there is something left to run and a checkpoint
    resumable = s["step"] < s["total_steps"] and s.get("checkpoint_dir") is not None
    head += f" (stopped by {s['interrupted']}{'; continue with --resume' if resumable else ''})"
  return (f"{head}: train loss (one batch) first {fmt(s['train_loss_first'])} -> last "
          f"{fmt(s['train_loss_last'])}, "
          f"eval loss {fmt(s['final_eval_loss'])}, {s['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, "
          f"peak memory {metrics_lib.format_bytes(s['peak_memory_bytes'])} ({s['peak_memory_kind']}), "
          f"{s['wall_s']:.0f} s"
          + ("" if s.get("first_step_s") is None else f" (first step {s['first_step_s']:.1f} s)"))
