"""Will the step fit the device, and what would: XLA's memory prediction before the first step.

Before the first step the run compiles its train step ahead of time, on abstract shapes (nothing
is allocated: `jit(step).lower(abstract state, abstract batch).compile()`), and reads XLA's memory
analysis of the executable, per device:

  predicted peak = arguments + outputs - aliased (the donated state) + temporaries

The arguments are what persists between steps (params, optimizer state, other model state) and
the batch; the temporaries are the step's one workspace (activations, gradients, the accumulator,
the optimizer's scratch), which the GPU allocates whole, so the prediction is the step's measured
peak (benchmarks/step/bench_e2e.py --compile-only). The executable compiled for the run's
settings is the one the run calls: planning adds no compile for them.

The device holds `run.device_memory_limit` bytes when set, else its `bytes_limit` (GPU memory
stats; none on a CPU, where nothing is checked). A prediction above it stops the run before
anything is allocated: `OutOfMemoryError` (exit 4), one line with the predicted and available
bytes and the settings that fit, each with its predicted peak (`alternatives`: for remat,
microbatches, master weight dtype, the coat linears' remade inputs and batch, the first value
that fits, fastest first; one compile each). `train.py --plan` prints them all as a table and
trains nothing. `auto` never picks the two that change the numerics (master weight dtype,
remade inputs); they are offered.

`model.remat: auto` / `optimizer.accumulate: auto` take the first setting that fits in the order
fastest first: remat none, fp8_residuals (coat only: elsewhere it saves nothing, as full), dots,
full; for each policy the fewest microbatches. A policy is a candidate only with fewer
microbatches than every policy before it (more recompute at no fewer microbatches is never
faster). With `run.plan_timed_steps` > 0 (default on accelerators; one process only, so that
every process chooses alike) every candidate runs that many steps on a fresh state (made again
for the run) and the fastest wins; a candidate predicted within 5 % of the limit (`TIGHT`) brings
its policy's next microbatch count along, since near the limit more microbatches can be faster.
Each policy's microbatch search compiles the fewest first and skips counts whose activations,
scaled as 1/microbatches from the last compile, cannot fit (an optimistic estimate: it never
skips one that fits).

A setting whose params + gradients + optimizer state (`build.memory_budget`, all alive at the
update) exceed the device alone is ruled out without compiling.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any, Callable

import jax
import numpy as np

from coat_jax.training import mesh as mesh_lib
from coat_jax.training.build import build
from coat_jax.errors import OutOfMemoryError
from coat_jax.training.metrics import format_bytes
from coat_jax.training.schema import AUTO, RunConfig, parse_bytes

REMAT_ORDER = ("none", "fp8_residuals", "dots", "full")  # fastest first (olmo-1b, coat, H100)
# A prediction above this fraction of the device's limit is "tight": XLA's rematerialization
# aims a few percent under the limit (its warnings on an H200 of 132.81 GiB: 127.45 to 130.38
# GiB), so the step may carry recompute XLA added. Llama-2-7B, seq 4096, 16 sequences, coat, H200
# (2026-11-28, train.py configs/llama2-7b.yaml): remat none with 2 microbatches, 130.68 GiB
# predicted, 3.706 s per step; with 4 (a run earlier that day), 3.53 s.
TIGHT = 0.95


def _size(n: float | None) -> str:
  return "n/a" if n is None else format_bytes(n)


@dataclasses.dataclass(frozen=True)
class Setting:
  """The memory knobs of a run: remat policy, microbatches, master weight dtype, global batch,
  what the coat linears keep of their inputs."""
  remat: str
  accumulate: int
  param_dtype: str
  batch_size: int
  master_rounding: str
  linear_residuals: str = "kept"

  @classmethod
  def of(cls, cfg: RunConfig, remat: str | None = None, accumulate: int | None = None) -> "Setting":
    from coat_jax.models.llama import LlamaConfig
    r = cfg.model.remat if remat is None else remat
    r = {True: "full", False: "none", None: LlamaConfig.remat}.get(r, r)
    dtype = cfg.model.param_dtype or LlamaConfig.param_dtype
    return cls(r, cfg.optimizer.accumulate if accumulate is None else accumulate, dtype,
               cfg.data.batch_size, cfg.optimizer.master_rounding,
               cfg.model.linear_residuals or LlamaConfig.linear_residuals)

  def replace(self, **changes) -> "Setting":
    return dataclasses.replace(self, **changes)

  def apply(self, cfg: RunConfig) -> RunConfig:
    """`cfg` with this setting's values (entries it already has left as written, None kept)."""
    now, r = Setting.of(cfg), dataclasses.replace
    new = {f: v for f, v in dataclasses.asdict(self).items() if getattr(now, f) != v}
    sections = {"model": ("remat", "param_dtype", "linear_residuals"),
                "optimizer": ("accumulate", "master_rounding"),
                "data": ("batch_size",)}
    return r(cfg, **{name: r(getattr(cfg, name), **{f: new[f] for f in fields if f in new})
                     for name, fields in sections.items()})

  def overrides(self, base: "Setting") -> list[str]:
    """The `--set` items that turn `base` into this setting."""
    keys = {"remat": "model.remat", "accumulate": "optimizer.accumulate",
            "param_dtype": "model.param_dtype", "batch_size": "data.batch_size",
            "master_rounding": "optimizer.master_rounding",
            "linear_residuals": "model.linear_residuals"}
    return [f"{key}={getattr(self, f)}" for f, key in keys.items()
            if getattr(self, f) != getattr(base, f)]

  def describe(self) -> str:
    return (f"remat {self.remat}, {self.accumulate} microbatch{'es' * (self.accumulate > 1)}, "
            f"{self.param_dtype} master weights, batch {self.batch_size}"
            + (", linear inputs remade" if self.linear_residuals == "remade" else ""))


@dataclasses.dataclass
class Prediction:
  """One setting's predicted peak (bytes per device; None: ruled out by its state, not compiled)."""
  setting: Setting
  cfg: RunConfig
  peak: int | None
  state: int  # params + optimizer state per device: what persists between steps
  floor: int  # params + gradients + optimizer state per device: what any batch needs
  memory: dict[str, int] = dataclasses.field(default_factory=dict)
  built: Any = None
  compiled: Any = None
  step_s: float | None = None

  def fits(self, limit: int | None) -> bool:
    if limit is None or (self.peak is None and self.compiled is not None):
      return True  # no limit, or a backend without a memory analysis: nothing to check
    return self.peak is not None and self.peak <= limit

  @property
  def activations(self) -> int:
    """The part of the peak that scales with the microbatch: everything but the floor."""
    return max(0, (self.peak or 0) - self.floor)


def memory_analysis(compiled) -> dict[str, int] | None:
  """XLA's per-device byte counts of a compiled executable, with `predicted_bytes`; None when the
  backend reports none."""
  try:
    ma = compiled.memory_analysis()
    mem = {k: int(getattr(ma, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                             "alias_size_in_bytes", "temp_size_in_bytes")}
  except Exception:  # not every backend reports it
    return None
  mem["predicted_bytes"] = (mem["argument_size_in_bytes"] + mem["output_size_in_bytes"]
                            - mem["alias_size_in_bytes"] + mem["temp_size_in_bytes"])
  return mem


def device_limit(cfg: RunConfig, devices) -> tuple[int | None, str]:
  """(bytes one device may hold, where that number comes from): `run.device_memory_limit`, else
  the smallest `bytes_limit` of the devices; (None, ...) when neither is known (CPU)."""
  configured = parse_bytes(cfg.run.device_memory_limit, "run.device_memory_limit")
  if configured:
    return configured, "run.device_memory_limit"
  limits = []
  for d in (d for d in devices if d.process_index == jax.process_index()):
    try:
      limits.append(int((d.memory_stats() or {})["bytes_limit"]))
    except Exception:  # CPU devices report no limit (or raise)
      return None, "none reported"
  return (min(limits), "bytes_limit") if limits else (None, "none reported")


def _divisors(n: int) -> list[int]:
  return [k for k in range(1, n + 1) if n % k == 0]


class Planner:
  """Predicts settings of one run (each compiled once), chooses `auto` ones, lists what fits."""

  def __init__(self, cfg: RunConfig, mesh, vocab_size: int | None, log: Callable = print,
               batch_like=None):
    """`batch_like`: a batch of the run's data (an array, or a dict of arrays with document
    masking or sft data), whose structure and dtypes the compiled step takes."""
    self.cfg, self.mesh, self.vocab_size, self.log = cfg, mesh, vocab_size, log
    self.batch_like = batch_like
    self.devices = list(mesh.devices.flat)
    self.limit, self.limit_source = device_limit(cfg, self.devices)
    self.shards = mesh_lib.batch_shards(mesh)
    self.predictions: dict[Setting, Prediction] = {}
    self.compiles = 0
    self.compile_s = 0.0  # seconds spent compiling (the chosen step's compile included)

  # -- one setting ----------------------------------------------------------------------------

  def predict(self, setting: Setting, limit: int | None = None) -> Prediction:
    """The setting's prediction (compiled once; not compiled when its state alone exceeds
    `limit`)."""
    pred = self.predictions.get(setting)
    if pred is None:
      cfg = setting.apply(self.cfg)
      built = build(cfg, self.mesh, vocab_size=self.vocab_size)
      budget = built.memory_budget()
      state = budget["params"] + budget["optimizer_state"]
      floor = state + budget["grads"] + budget["accumulator"]
      pred = self.predictions[setting] = Prediction(setting, cfg, None, state, floor, built=built)
    if pred.compiled is not None or pred.peak is not None or self._over(pred.floor, limit):
      return pred
    cfg, built = pred.cfg, pred.built
    params, opt_state, rest = built.abstract_state()
    shape = (setting.batch_size, cfg.data.seq_len + 1)
    tokens = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(shape, a.dtype, sharding=built.batch_sharding),
        self.batch_like if self.batch_like is not None else np.zeros((), np.int32))
    t0 = time.perf_counter()
    pred.compiled = built.train_step.lower(params, opt_state, rest, tokens).compile()
    self.compiles += 1
    self.compile_s += time.perf_counter() - t0
    pred.memory = memory_analysis(pred.compiled) or {}
    pred.peak = pred.memory.get("predicted_bytes")
    return pred

  @staticmethod
  def _over(n: int, limit: int | None) -> bool:
    return limit is not None and n > limit

  def _fewest_microbatches(self, base: Setting, limit: int | None, below: int | None = None,
                           above: int = 0) -> Prediction | None:
    """The fitting prediction with the fewest microbatches in (above, below) for `base`'s other
    knobs; None if none fits."""
    per_shard = base.batch_size // self.shards
    ks = [k for k in _divisors(per_shard) if above < k and (below is None or k < below)]
    last = None
    for k in ks:
      if last is not None and last.peak is not None and limit is not None:
        estimate = last.floor + last.activations * last.setting.accumulate / k
        if estimate > limit:
          continue
      pred = self.predict(base.replace(accumulate=k), limit)
      if pred.fits(limit):
        return pred
      if pred.peak is None:  # the state alone does not fit: no microbatch count helps
        return None
      last = pred
    return None

  def _remats(self, after: str | None = None) -> list[str]:
    order = [r for r in REMAT_ORDER if r != "fp8_residuals" or self.cfg.precision == "coat"]
    return order[order.index(after) + 1:] if after in order else order

  # -- auto and the check ---------------------------------------------------------------------

  def configured(self) -> Setting:
    """The run's setting with `auto` knobs at their most frugal (full remat, most microbatches)."""
    auto_r, auto_k = self.cfg.model.remat == AUTO, self.cfg.optimizer.accumulate == AUTO
    return Setting.of(self.cfg, remat="full" if auto_r else None,
                      accumulate=self.cfg.data.batch_size // self.shards if auto_k else None)

  def candidates(self, all_policies: bool) -> list[Prediction]:
    """Fitting predictions for the `auto` knobs, fastest first by rule (each policy with fewer
    microbatches than the ones before it; with `all_policies` and auto microbatches, a tight one
    followed by its policy's next count); only the first unless `all_policies`."""
    auto_r, auto_k = self.cfg.model.remat == AUTO, self.cfg.optimizer.accumulate == AUTO
    base = Setting.of(self.cfg, remat="none" if auto_r else None, accumulate=1 if auto_k else None)
    out: list[Prediction] = []
    for remat in self._remats() if auto_r else [base.remat]:
      below = min(p.setting.accumulate for p in out) if out else None
      if auto_k:
        pred = self._fewest_microbatches(base.replace(remat=remat), self.limit, below)
      else:  # the same microbatches: the first policy that fits is the fastest
        pred = self.predict(base.replace(remat=remat), self.limit)
        pred = pred if pred.fits(self.limit) else None
      if pred is not None:
        out.append(pred)
        if all_policies and auto_k and self._tight(pred):  # XLA may recompute to fit: time more
          more = self._fewest_microbatches(base.replace(remat=remat), self.limit,
                                           above=pred.setting.accumulate)
          out += [more] if more is not None else []
        if not (all_policies and auto_k) or pred.setting.accumulate == 1:
          break
    return out

  def _tight(self, pred: Prediction) -> bool:
    """Predicted within TIGHT of the device's limit: XLA's own rematerialization (its target
    lies a few percent under the limit) may have added recompute to make it fit."""
    return self.limit is not None and pred.peak is not None and pred.peak > TIGHT * self.limit

  def choose(self, sample_batch: np.ndarray | None = None) -> Prediction:
    """The prediction the run trains with (its executable compiled): the configured setting, or
    for `auto` knobs the fastest that fits. Raises OutOfMemoryError (one line) when none fits."""
    auto = self.cfg.model.remat == AUTO or self.cfg.optimizer.accumulate == AUTO
    if not auto:
      pred = self.predict(Setting.of(self.cfg), self.limit)
      if not pred.fits(self.limit):
        raise OutOfMemoryError(self.too_big_message(pred))
      self.log(f"[plan] step compiled in {self.compile_s:.1f} s: predicted {_size(pred.peak)} "
               f"per device of {_size(self.limit)} ({self.limit_source})")
      return pred
    steps = self.cfg.run.plan_timed_steps
    if steps is None:
      steps = 0 if self.devices[0].platform == "cpu" else 2
    # --plan: no state, no timing; several processes: timings could differ, so could choices.
    steps = steps if sample_batch is not None and jax.process_count() == 1 else 0
    self.log("[plan] compiling candidate settings (XLA's 'Can't reduce memory use' warnings are "
             "the candidates that do not fit)")
    found = self.candidates(all_policies=steps > 0)
    if not found:
      raise OutOfMemoryError(self.too_big_message(self.predict(self.configured(), self.limit)))
    chosen = found[0]
    if steps > 0 and len(found) > 1:
      self.time_steps(found, sample_batch, steps)
      chosen = min(found, key=lambda p: p.step_s if p.step_s is not None else math.inf)
    timed = ", ".join(f"{p.setting.remat}/{p.setting.accumulate}: {p.step_s:.3f} s"
                      for p in found if p.step_s is not None)
    self.log(f"[plan] chose remat {chosen.setting.remat}, {chosen.setting.accumulate} "
             f"microbatch(es): predicted {_size(chosen.peak)} per device of {_size(self.limit)} "
             f"({self.limit_source}); {self.compiles} compile(s) in {self.compile_s:.1f} s"
             + (f"; timed steps {timed}" if timed else ""))
    return chosen

  def time_steps(self, found: list[Prediction], sample_batch: np.ndarray, steps: int) -> None:
    """Sets each prediction's `step_s`: the mean of `steps` steps after a warm one, from a fresh
    state (donated from step to step; made again after a failure)."""
    tokens = mesh_lib.put_batch(sample_batch, found[0].built.batch_sharding)
    state = None
    for p in found:
      try:
        state = state or found[0].built.init()
        state = p.compiled(*state, tokens)[:3]
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for _ in range(steps):
          state = p.compiled(*state, tokens)[:3]
        jax.block_until_ready(state)
        p.step_s = (time.perf_counter() - t0) / steps
      except Exception as e:  # a candidate that fails to run is not chosen
        if not is_out_of_memory(e):
          raise
        state = None
    del state

  def timed_candidates(self) -> list[Prediction]:
    """The predictions whose steps `time_steps` ran (their peaks count in the device's)."""
    return [p for p in self.predictions.values() if p.step_s is not None]

  # -- what fits ------------------------------------------------------------------------------

  def alternatives(self, base: Setting, limit: int | None) -> list[Prediction]:
    """Settings near `base` that fit `limit`, one per knob (the first that fits, fastest first):
    a stronger remat policy, more microbatches, bfloat16 master weights (coat_adamw, with
    stochastic rounding), the linears' inputs remade (coat: `model.linear_residuals`), a smaller
    batch; if no single knob is enough, their combinations."""
    out = []
    for remat in self._remats(base.remat):
      pred = self.predict(base.replace(remat=remat), limit)
      if pred.fits(limit):
        out.append(pred)
        break
    out.append(self._fewest_microbatches(base, limit, above=base.accumulate))
    lean = base
    if base.param_dtype != "bfloat16" and self.cfg.optimizer.name == "coat_adamw":
      rounding = "stochastic" if base.master_rounding == "nearest" else base.master_rounding
      lean = base.replace(param_dtype="bfloat16", master_rounding=rounding)
      out.append(self.predict(lean, limit))
    if self.cfg.precision == "coat" and base.linear_residuals == "kept":
      out.append(self.predict(base.replace(linear_residuals="remade"), limit))
    out.append(self._largest_batch(base, limit))
    out = [p for p in out if p is not None and p.fits(limit)]
    if not out:  # every knob at once: the most frugal policy and microbatch count, then the batch
      lean = lean.replace(remat="full")
      pred = self._fewest_microbatches(lean, limit)
      out = [pred] if pred is not None else [p for p in [self._largest_batch(lean, limit)] if p]
    return out

  def _largest_batch(self, base: Setting, limit: int | None) -> Prediction | None:
    batch = base.batch_size // 2
    while batch >= self.shards and batch % self.shards == 0:
      k = math.gcd(base.accumulate, batch // self.shards)
      pred = self.predict(base.replace(batch_size=batch, accumulate=k), limit)
      if pred.fits(limit):
        return pred
      if pred.peak is None:
        return None
      batch //= 2
    return None

  # -- messages -------------------------------------------------------------------------------

  def fitting_summary(self, base: Setting, limit: int | None) -> str:
    fits = self.alternatives(base, limit)
    if not fits:
      state = self.predict(base, limit)
      return (f"no setting tried fits (params + gradients + optimizer state alone: "
              f"{_size(state.floor)}): shard the state over more devices (mesh.fsdp) or train a "
              f"smaller model")
    return "settings that fit: " + "; ".join(
        f"--set {' --set '.join(p.setting.overrides(base))} ({_size(p.peak)})" for p in fits)

  def too_big_message(self, pred: Prediction) -> str:
    what = (f"XLA predicts {_size(pred.peak)}" if pred.peak is not None else
            f"params + gradients + optimizer state alone take {_size(pred.floor)}")
    return (f"the train step does not fit the device: {what} per device ({pred.setting.describe()})"
            f", the device has {_size(self.limit)} ({self.limit_source}); "
            f"{self.fitting_summary(pred.setting, self.limit)} (train.py --plan lists them)")

  def table(self) -> str:
    """What `train.py --plan` prints: the device, the configured (or chosen) setting and the
    settings that fit, each with its predicted peak."""
    lines = [f"device: {len(self.devices)} x {self.devices[0].device_kind}, "
             f"{_size(self.limit)} each ({self.limit_source}); batch shards {self.shards}"]
    try:
      chosen = self.choose()
      base = chosen.setting
      head = "chosen" if chosen.setting != Setting.of(self.cfg) else "as configured"
    except OutOfMemoryError:
      chosen, base, head = None, self.configured(), "as configured"
    rows = [(head, self.predict(base, self.limit))]
    limit = self.limit
    if chosen is None:
      rows += [("fits", p) for p in self.alternatives(base, limit) if p.setting != base]
    rows += [("tried", p) for s, p in self.predictions.items() if p not in [r[1] for r in rows]]
    lines.append(f"  {'':13} {'remat':14} {'micro':>5} {'master':9} {'batch':>5} "
                 f"{'predicted':>12} {'state':>11} {'fits':4}  change")
    for what, p in rows:
      s = p.setting
      peak = _size(p.peak) if p.peak is not None else f">{_size(p.floor)}"
      fit = "yes" if p.fits(limit) else "no"
      change = " ".join(f"--set {o}" for o in s.overrides(Setting.of(self.cfg, base.remat,
                                                                        base.accumulate)))
      lines.append(f"  {what:13} {s.remat:14} {s.accumulate:>5} {s.param_dtype:9} "
                   f"{s.batch_size:>5} {peak:>12} {_size(p.state):>11} {fit:4}  {change}")
    lines.append(f"{self.compiles} compile(s) on abstract shapes; predicted = XLA's arguments + "
                 f"outputs - aliased + temporaries per device; state = params + optimizer state")
    if self.limit is None:
      lines.append("this device reports no memory limit, so every setting fits here; the "
                   "predictions are this device's compiled step (a CPU's differs from a GPU's): "
                   "plan on the GPU you will train on")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# A device out of memory during the run.


def is_out_of_memory(e: BaseException) -> bool:
  text = f"{type(e).__name__}: {e}"
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


_ALLOCATION = re.compile(r"allocat\w*(?: request for)?:? ([0-9.]+ ?[KMGTP]?i?B)\b", re.I)


def runtime_oom_message(planner: Planner, pred: Prediction, error: BaseException, during: str,
                        checkpoint: str) -> str:
  """One line for a device out of memory met `during` ("step 3"): which allocation (when XLA
  says), the predicted peak, and settings predicted to need 10 % less than the one that failed."""
  found = _ALLOCATION.search(str(error))
  which = f"allocating {found.group(1)}" if found else "an allocation"
  bound = int(0.9 * min(x for x in (pred.peak, planner.limit) if x is not None)) \
      if pred.peak is not None or planner.limit is not None else None
  return (f"out of device memory during {during} ({which}; XLA predicted "
          f"{_size(pred.peak)} per device of {_size(planner.limit)}); "
          f"{planner.fitting_summary(pred.setting, bound)} (predicted within {_size(bound)}); "
          f"{checkpoint}")


def show(cfg: RunConfig, log: Callable = print) -> str:
  """`train.py --plan`: the table for `cfg` on this machine's devices (no state allocated)."""
  from coat_jax.training.compile_cache import use_compile_cache

  use_compile_cache(cfg.run.compile_cache, log)
  mesh = mesh_lib.make_mesh(cfg.mesh)
  vocab, batch_like = _plan_data(cfg, log)
  return Planner(cfg, mesh, vocab, log, batch_like=batch_like).table()


def _plan_data(cfg: RunConfig, log: Callable) -> tuple[int | None, Any]:
  """The vocabulary (None: the config's) and a batch of the run's data for the plan's shapes.

  Pre-tokenized data (`data.kind: tokens`) brings no vocabulary of its own, so the plan needs
  none of its files: where they are not there yet it plans with zeros of the batch's structure
  (the run itself still needs them)."""
  from coat_jax.training.build import dataset_from_config
  from coat_jax.training.dataset import document_batch
  from coat_jax.training.token_files import expand_paths

  if cfg.data.kind == "tokens":
    try:
      found = expand_paths(cfg.data.paths)
    except ValueError as e:
      found, missing = [], str(e)
    else:
      missing = "data.paths names no files"
    if not found:
      log(f"[plan] {missing}: planning from the config's shapes (training needs the files)")
      tokens = np.zeros((cfg.data.batch_size, cfg.data.seq_len + 1), np.int32)
      return None, document_batch(tokens, 0) if cfg.data.document_mask else tokens
  dataset = dataset_from_config(cfg.data, cfg.run.seed, log, init_from=cfg.model.init_from)
  return (None if cfg.data.kind == "tokens" else dataset.vocab_size), dataset.train_batch(0)
