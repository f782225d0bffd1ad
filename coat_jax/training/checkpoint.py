"""Orbax checkpoints of a training run: parameters, optimizer state (FP8 leaves included), metadata.

A checkpoint at step `s` holds:
  "state": every array leaf of the train state (parameters, optimizer state, other model state),
    keyed by its pytree path. Orbax stores float8_e4m3fn / float8_e5m2 / bfloat16 natively and
    restores them bit-exactly (tests/test_training_loop.py checks it).
  "meta" (JSON): step, the data position (batches are a pure function of (seed, step), so the
    step is the position), seed, the RNG key data, and the run config.

Orbax writes each checkpoint into a temporary directory and renames it when complete, so a save
interrupted by a crash or a kill never replaces the last good checkpoint; leftover temporary
directories are ignored and cleaned up by the next run. A state holding a NaN or an infinity is
never written (DivergedError instead: divergence.check_finite, one reduction on the device).

Large states and full disks (storage.py): a state larger than a quarter of the host memory still
available (a whole save adds about twice its size) is streamed (the save synchronous, in batches
of 1/32 of that memory or the largest array; `benchmarks/step/checkpoint_memory.py` measures a
save's host memory). A save whose
state does not fit the free disk space is refused, and one whose write fails on a full or
read-only disk removes its partial directory: both raise StorageError (exit 5, one line) with the
previous checkpoint untouched.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

from coat_jax.training import storage
from coat_jax.errors import StorageError
from coat_jax.training.metrics import format_bytes
from coat_jax.training.divergence import check_finite

_STATE, _META = "state", "meta"
# tensorstore's reads of a damaged checkpoint finish on orbax's event loop after it closed: each
# reports "Event loop is closed" through sys.unraisablehook, tens of tracebacks for one skip.
_CLOSED_LOOP = "Event loop is closed"


def _drop_closed_loop_reports(previous):
  def hook(report):
    if not (isinstance(report.exc_value, RuntimeError) and str(report.exc_value) == _CLOSED_LOOP):
      previous(report)
  hook.drops_closed_loop_reports = True
  return hook


class _DropUnretrievedReads(logging.Filter):
  """Drops asyncio's "Task exception was never retrieved" reports of tensorstore reads: when one
  array of a damaged checkpoint fails, orbax's gather raises that failure (reported in one line)
  and its sibling reads fail unawaited, each logged with a traceback when collected."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    unretrieved = str(record.msg).split("\n", 1)[0].endswith("exception was never retrieved")
    return not (unretrieved and "tensorstore_spec" in str(exc))


def _quiet_orbax() -> None:
  for name in ("orbax", "orbax.checkpoint"):
    logging.getLogger(name).setLevel(logging.WARNING)
  # Orbax logs a failed background write's traceback through absl from each thread it passes;
  # the failure reaches the run as an exception (one line, storage.py), so those stay quiet.
  logging.getLogger("absl").setLevel(logging.CRITICAL)
  asyncio_log = logging.getLogger("asyncio")
  if not any(isinstance(f, _DropUnretrievedReads) for f in asyncio_log.filters):
    asyncio_log.addFilter(_DropUnretrievedReads())
  if not getattr(sys.unraisablehook, "drops_closed_loop_reports", False):
    sys.unraisablehook = _drop_closed_loop_reports(sys.unraisablehook)


def unreadable_reason(e: BaseException) -> str:
  """One line on why a checkpoint did not read back: the cause's message, without tensorstore's
  spec dump, and never a bare object repr (the first message in the exception chain that is)."""
  chain, seen = [], set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    chain.append(e)
    e = e.__cause__ or e.__context__
  for err in chain:
    text = re.sub(r"\s*\[tensorstore_spec=.*$", "", str(err), flags=re.S)
    text = " ".join(text.split())
    if text and not re.fullmatch(r"<[^<>]* object at 0x[0-9a-fA-F]+>", text):
      text = f"{type(err).__name__}: {text}"
      # tensorstore nests "what: while doing: ...: cause": keep the head and the cause
      return text if len(text) <= 400 else f"{text[:120]} ... {text[-240:]}"
  return type(chain[0]).__name__


def _is_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def keys_to_data(tree: Any) -> Any:
  """Replaces typed PRNG key arrays by their raw uint32 data (what can be stored)."""
  return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def data_to_keys(template: Any, tree: Any) -> Any:
  """Inverse of `keys_to_data`: wraps raw key data back where `template` has typed keys."""
  return jax.tree.map(
      lambda t, x: jax.random.wrap_key_data(x, impl=jax.random.key_impl(t)) if _is_key(t) else x,
      template, tree)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
  """The storable abstract value of a leaf (typed keys become their uint32 data)."""
  if _is_key(x):
    data = jax.eval_shape(jax.random.key_data, x)
    sharding = getattr(x, "sharding", None)
    if sharding is not None and hasattr(sharding, "spec"):
      from jax.sharding import NamedSharding, PartitionSpec
      spec = tuple(sharding.spec) + (None,) * (len(data.shape) - len(sharding.spec))
      sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec))
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def flatten_state(tree: Any) -> dict[str, Any]:
  """A flat {path: leaf} dict of a pytree (paths sanitized for storage, order kept)."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    key = re.sub(r"[^A-Za-z0-9_.-]+", ".", jax.tree_util.keystr(path)).strip(".") or "leaf"
    if key in out:
      raise ValueError(f"two state leaves map to the checkpoint key {key!r}")
    out[key] = leaf
  return out


def unflatten_state(template: Any, flat: dict[str, Any]) -> Any:
  """Rebuilds `template`'s structure from a dict produced by `flatten_state`."""
  keys = list(flatten_state(template))
  missing = [k for k in keys if k not in flat]
  if missing:
    raise ValueError(f"checkpoint lacks {len(missing)} state entries, e.g. {missing[:3]}; "
                     f"was it written by a different model or optimizer config?")
  treedef = jax.tree_util.tree_structure(template)
  return jax.tree_util.tree_unflatten(treedef, [flat[k] for k in keys])


class Checkpointer:
  """Periodic, optionally asynchronous, saving and restoring of a run's state.

  Args:
    directory: where step directories go (created if missing).
    every: save when `step % every == 0` (0: only when forced, e.g. at the end or on a signal).
    keep: how many checkpoints to keep (oldest deleted first).
    async_save: write in a background thread while training continues.
    state_template: the state's arrays or ShapeDtypeStructs, when known: a state larger than a
      quarter of the available host memory is then streamed, synchronously (`storage.stream_bytes`).
    enabled: False: nothing is ever saved (not even when forced); restoring still works.
  """

  def __init__(self, directory: str | os.PathLike, every: int, keep: int, async_save: bool,
               state_template: Any = None, enabled: bool = True):
    import orbax.checkpoint as ocp

    _quiet_orbax()
    self._ocp = ocp
    self.directory = Path(directory).absolute()
    self.every = every
    self.enabled = enabled
    self.stream_bytes = None
    if state_template is not None:
      stored = jax.tree.map(_abstract, state_template)  # typed keys as their uint32 data
      self.stream_bytes = storage.stream_bytes(storage.state_bytes(stored),
                                               storage.largest_leaf_bytes(stored),
                                               jax.process_count())
    self._pending: int | None = None
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=async_save and self.stream_bytes is None,
        cleanup_tmp_directories=True, save_interval_steps=1, create=True)
    handlers = {_STATE: _state_handler(ocp, self.stream_bytes), _META: ocp.JsonCheckpointHandler()}
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
    self._last_saved = self._manager.latest_step()

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def should_save(self, step: int) -> bool:
    return self.enabled and self.every > 0 and step % self.every == 0

  def save(self, step: int, state: Any, meta: dict[str, Any], force: bool = False) -> bool:
    """Saves `state` (a pytree of arrays) and JSON `meta` at `step` if due (or `force`); True if saved."""
    if not self.enabled or not (force or self.should_save(step)) or self._last_saved == step:
      return False
    self.wait()  # the previous save done (orbax would wait too), so the disk's free space is true
    flat = flatten_state(keys_to_data(state))
    need, free = storage.needed_bytes(storage.state_bytes(flat)), storage.free_bytes(self.directory)
    if free < need:
      raise StorageError(f"checkpoint of step {step} not written: it needs {format_bytes(need)} "
                         f"and {self.directory} has {format_bytes(free)} free; {self._kept()}; "
                         f"free space or set checkpoint.dir to a larger disk")
    check_finite(flat, f"checkpoint of step {step} in {self.directory}")
    args = self._ocp.args.Composite(**{
        _STATE: self._ocp.args.StandardSave(flat),
        _META: self._ocp.args.JsonSave(meta),
    })
    self._pending = step  # until written: a failure removes this step's partial directory
    self._write_guard(lambda: self._manager.save(step, args=args, force=True))
    self._last_saved = step
    return True

  def _kept(self) -> str:
    steps = sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit()) \
        if self.directory.is_dir() else []
    return (f"the checkpoint of step {steps[-1]} is intact" if steps
            else "no earlier checkpoint exists")

  def _write_guard(self, fn) -> Any:
    """Runs `fn`; a write that fails on a full or read-only disk removes the pending save's
    partial directory and raises StorageError (one line)."""
    try:
      return fn()
    except Exception as e:
      if not storage.is_disk_error(e):
        raise
      step, self._pending = self._pending, None
      try:  # the save's other writers finish (or fail) before its directory goes
        self._manager.wait_until_finished()
      except Exception:
        pass
      removed = storage.remove_partial(self.directory, step) if step is not None else []
      raise StorageError(f"writing the checkpoint of step {step} to {self.directory} failed: "
                         f"{storage.disk_error_reason(e)}; its partial directory was removed "
                         f"({', '.join(removed) or 'none left'}); {self._kept()}") from e

  def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict[str, Any], int]:
    """Restores `step` (default: the latest) into `template`'s structure, dtypes and shardings.

    `template` is a pytree of arrays or ShapeDtypeStructs (with `.sharding`). Returns
    (state, meta, step).
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise ValueError(f"no checkpoint to resume from in {self.directory}")
    target = flatten_state(jax.tree.map(_abstract, template))
    stored = self._manager.item_metadata(step)[_STATE]
    own_keys, renamed = list(target), {}
    if stored is not None:
      renamed = legacy_key_names(target, stored)
      target = {renamed.get(k, k): v for k, v in target.items()}
      _check_compatible(target, stored, self.directory / str(step))
    restored = self._manager.restore(step, args=self._ocp.args.Composite(**{
        _STATE: self._ocp.args.StandardRestore(target),
        _META: self._ocp.args.JsonRestore(),
    }))
    flat = {k: restored[_STATE][renamed.get(k, k)] for k in own_keys}
    state = unflatten_state(jax.tree.map(_abstract, template), flat)
    return data_to_keys(template, state), dict(restored[_META]), step

  def restore_intact(self, template: Any, step: int | None = None, log=print
                     ) -> tuple[Any, dict[str, Any], int]:
    """Restores `step`, or (None) the newest checkpoint that reads back; returns (state, meta, step).

    An unreadable checkpoint (truncated array file, garbled metadata, empty directory) is reported
    in one line through `log` and renamed `<step>.unreadable` (kept for inspection, out of the
    manager's way so the step can be saved again); the next older one is tried. ValueError (one
    line, listing every step tried and why) when none is intact, or `step` does not exist.
    A readable checkpoint whose arrays do not fit `template` (another model or optimizer layout)
    raises CheckpointMismatch (a ValueError, one line) and is left in place.
    With `step`, newer checkpoints are renamed `<step>.superseded` (the run continues from `step`
    and will write those steps again).
    """
    steps = sorted(self.all_steps(), reverse=True)
    if step is not None:
      if step not in steps:
        raise ValueError(f"no checkpoint at step {step} in {self.directory}; steps there: "
                         f"{', '.join(map(str, sorted(steps))) or 'none'}")
      for newer in (s for s in steps if s > step):
        log(f"[checkpoint] resuming from step {step}: step {newer} set aside as {newer}.superseded")
        self._set_aside(newer, "superseded")
      steps = [step]
    if not steps:
      raise ValueError(f"no checkpoint to resume from in {self.directory}")
    tried = []
    for s in steps:
      try:
        return self.restore(template, s)
      except CheckpointMismatch:
        raise  # readable, but another run's layout: stop, rename nothing
      except Exception as e:  # orbax/tensorstore/json raise many types; all mean "unreadable" here
        reason = unreadable_reason(e)
        tried.append(f"step {s} ({reason})")
        log(f"[checkpoint] step {s} in {self.directory} is unreadable: {reason}")
        if step is None:
          self._set_aside(s, "unreadable")
    raise ValueError(f"no intact checkpoint in {self.directory}; tried {'; '.join(tried)}")

  def _set_aside(self, step: int, why: str) -> None:
    path = self.directory / str(step)
    if path.is_dir():
      path.rename(path.with_name(f"{step}.{why}-{os.getpid()}"))
    self._manager.reload()
    self._last_saved = self._manager.latest_step()

  def wait(self) -> None:
    """Waits for a pending save (StorageError when its write failed on the disk)."""
    if self._manager is not None:
      self._write_guard(self._manager.wait_until_finished)
    self._pending = None

  def close(self) -> None:
    """Waits for pending saves and releases the manager (safe to call twice)."""
    if self._manager is None:
      return
    manager = self._manager
    try:
      self.wait()
    finally:
      self._manager = None
      try:
        manager.close()
      except Exception:  # the failed save was reported by wait(); closing must not hide it
        pass


def _state_handler(ocp, batch_bytes: int | None):
  """Orbax's handler of the state: as is, or with saves and restores in batches of at most
  `batch_bytes` (the device-to-host copy and the write, so the host holds a few arrays at a
  time)."""
  if batch_bytes is None:
    return ocp.StandardCheckpointHandler()
  gb = batch_bytes / 1e9
  handler = ocp.StandardCheckpointHandler(save_concurrent_gb=gb, restore_concurrent_gb=gb)
  # The standard handler takes no device-to-host limit; the PyTree handler under it does.
  handler._impl = ocp.PyTreeCheckpointHandler(
      save_concurrent_gb=gb, restore_concurrent_gb=gb, save_device_host_concurrent_gb=gb,
      type_handler_registry=_batched_registry(ocp),
      enable_pinned_host_transfer=storage.STREAM_PINNED_HOST)
  return handler


def _batched_registry(ocp):
  """Orbax's type handlers with the jax.Array one copying arrays to the host in the limited
  batches: its default callback marks every array "synchronous", copied to the host all at once
  before any is written, whatever the device-to-host limit."""
  from orbax.checkpoint._src.serialization import types as serialization_types  # no public name

  class Batched(serialization_types.DefaultSerializationStatusCallback):
    def key_priority(self, _):
      return serialization_types.TransferPriority.ASYNCHRONOUS_DEPRIORITIZED

  default = ocp.type_handlers.get_type_handler(jax.Array)
  arrays = ocp.type_handlers.ArrayHandler(
      array_metadata_store=getattr(default, "_array_metadata_store", None), callback=Batched())
  others = [(t, ocp.type_handlers.get_type_handler(t))
            for t in (np.ndarray, np.number, int, float, bytes, str)]
  return ocp.type_handlers.create_type_handler_registry((jax.Array, arrays), *others)


class CheckpointMismatch(ValueError):
  """A readable checkpoint of another model or optimizer layout than this run's (keys, shapes or
  dtypes differ): never set aside as unreadable, the run stops instead."""


def _mismatch_hint(key: str) -> str:
  if re.search(r"(^|\.)(mu|nu)(\.|$)", key):
    return (" (optimizer state: was it written with another optimizer.group_axis, group_size or "
            "m/v format? runs of coat-jax 0.1, whose default group_axis was 'coat', resume with "
            "--set optimizer.group_axis=coat)")
  return ""


def legacy_key_names(target: dict[str, Any], stored: Any) -> dict[str, str]:
  """{this run's key: the stored key} for entries stored under an older name.

  Checkpoints of coat_adamw runs written before its state was built on its own (not inside an
  optax chain) hold the optimizer state one tuple level deeper: `....1.mu...` where this run has
  `....mu...`. A key is renamed only when it is missing, exactly one stored key equals it with one
  integer path component added, and that stored key is not one of this run's own.
  """
  try:
    stored_keys = set(dict(stored))
  except (TypeError, ValueError):
    return {}
  missing = [k for k in target if k not in stored_keys]
  if not missing:
    return {}
  unexpected = stored_keys - set(target)
  by_shorter: dict[str, list[str]] = {}
  for key in unexpected:
    parts = key.split(".")
    for i, part in enumerate(parts):
      if part.isdigit():
        by_shorter.setdefault(".".join(parts[:i] + parts[i + 1:]), []).append(key)
  renamed = {}
  for key in missing:
    found = by_shorter.get(key, [])
    if len(found) == 1:
      renamed[key] = found[0]
  return renamed


def _check_compatible(target: dict[str, Any], stored: Any, where: Path) -> None:
  """Raises CheckpointMismatch when the stored arrays' keys, shapes or dtypes differ from the
  run's."""
  try:
    stored = dict(stored)
  except (TypeError, ValueError):
    return
  extra = sorted(set(stored) - set(target))
  missing = sorted(set(target) - set(stored))
  if extra or missing:
    raise CheckpointMismatch(f"checkpoint {where} does not match this run's model/optimizer: "
                     f"{len(missing)} entries missing (e.g. {missing[:3]}), "
                     f"{len(extra)} unexpected (e.g. {extra[:3]})")
  for key, want in target.items():
    got = stored[key]
    shape = getattr(got, "shape", None)
    dtype = getattr(got, "dtype", None)
    if shape is not None and tuple(shape) != tuple(want.shape):
      raise CheckpointMismatch(f"checkpoint {where}: {key} has shape {tuple(shape)}, this run "
                               f"expects {tuple(want.shape)}{_mismatch_hint(key)}")
    if dtype is not None and np.dtype(dtype) != np.dtype(want.dtype):
      raise CheckpointMismatch(f"checkpoint {where}: {key} has dtype {np.dtype(dtype)}, this run "
                               f"expects {np.dtype(want.dtype)}{_mismatch_hint(key)}")


def read_params(directory: str | os.PathLike, template: Any, step: int | None = None
                ) -> tuple[Any, dict[str, Any], int]:
  """Reads only the parameters of a run's checkpoint: (params, meta, step), read-only.

  `template`: the params pytree as arrays or ShapeDtypeStructs (with `.sharding`, else the
  default device), as the run saved them under "params". step None: the newest checkpoint that
  reads back (unreadable ones are skipped, and left as they are). The optimizer state is not
  read. ValueError (one line) when the directory has no checkpoints, `step` is not among them,
  none is intact, or the stored parameters' names, shapes or dtypes differ from `template`'s.
  """
  import orbax.checkpoint as ocp

  _quiet_orbax()
  directory = Path(directory).absolute()
  steps = sorted((int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()),
                 reverse=True) if directory.is_dir() else []
  if not steps:
    raise ValueError(f"no checkpoints in {directory}")
  if step is not None:
    if step not in steps:
      raise ValueError(f"no checkpoint at step {step} in {directory}; steps there: "
                       f"{', '.join(map(str, sorted(steps)))}")
    steps = [step]
  target = flatten_state({"params": jax.tree.map(_abstract, template)})
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  restore_args = jax.tree.map(
      lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding or default, dtype=a.dtype), target)
  absl = logging.getLogger("absl")
  level = absl.level
  absl.setLevel(logging.ERROR)   # read-only managers warn that they are read-only
  try:
    manager = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(read_only=True, create=False),
        item_handlers={_STATE: ocp.PyTreeCheckpointHandler(), _META: ocp.JsonCheckpointHandler()})
  finally:
    absl.setLevel(level)
  tried = []
  try:
    for s in steps:
      try:
        stored = dict(manager.item_metadata(s)[_STATE].tree)
      except Exception as e:  # orbax raises many types for a damaged checkpoint
        tried.append(f"step {s} ({type(e).__name__}: {' '.join(str(e).split())[:200]})")
        continue
      _check_subset(target, stored, directory / str(s))
      try:
        restored = manager.restore(s, args=ocp.args.Composite(**{
            _STATE: ocp.args.PyTreeRestore(target, restore_args=restore_args,
                                           partial_restore=True),
            _META: ocp.args.JsonRestore()}))
      except Exception as e:
        tried.append(f"step {s} ({type(e).__name__}: {' '.join(str(e).split())[:200]})")
        continue
      params = unflatten_state({"params": template}, dict(restored[_STATE]))["params"]
      return params, dict(restored[_META] or {}), s
  finally:
    manager.close()
  raise ValueError(f"no intact checkpoint in {directory}; tried {'; '.join(tried)}")


def _check_subset(target: dict[str, Any], stored: dict[str, Any], where: Path) -> None:
  """CheckpointMismatch unless every target entry is stored with its shape and dtype."""
  missing = sorted(set(target) - set(stored))
  if missing:
    raise CheckpointMismatch(f"checkpoint {where} does not hold this model's parameters: "
                             f"{len(missing)} missing (e.g. {missing[:3]})")
  for key, want in target.items():
    got = stored[key]
    if tuple(getattr(got, "shape", want.shape)) != tuple(want.shape):
      raise CheckpointMismatch(f"checkpoint {where}: {key} has shape {tuple(got.shape)}, the "
                               f"model expects {tuple(want.shape)}")
    if np.dtype(getattr(got, "dtype", want.dtype)) != np.dtype(want.dtype):
      raise CheckpointMismatch(f"checkpoint {where}: {key} has dtype {np.dtype(got.dtype)}, the "
                               f"model expects {np.dtype(want.dtype)}")
