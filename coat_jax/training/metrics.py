"""Training metrics: throughput, MFU, peak memory, JSON-lines + TensorBoard logs, loss-curve plot.

MFU = model FLOPs per token x tokens/s / (devices x peak FLOP/s per device). The peak is the
device's dense BF16 peak for every precision mode (FP8 GEMMs can run at twice that on Hopper, but
comparing all modes against one denominator keeps their MFUs comparable). CPUs have no meaningful
peak: MFU is reported as n/a there.
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Iterable

import jax

from coat_jax.errors import StorageError

# Dense BF16 peak FLOP/s per device, matched on `device.device_kind` (first match wins).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("TPU v5p", 459e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v4", 275e12),
    ("TPU v6", 918e12),
)


def peak_flops(device: jax.Device) -> float | None:
  """Dense BF16 peak FLOP/s of `device`, or None when unknown (e.g. CPU)."""
  if device.platform == "cpu":
    return None
  kind = getattr(device, "device_kind", "")
  for name, flops in PEAK_BF16_FLOPS:
    if name.lower() in kind.lower():
      return flops
  return None


def mfu(flops_per_token: float, tokens_per_s: float, devices: Iterable[jax.Device]) -> float | None:
  """Model FLOPs utilization in [0, 1], or None when a device's peak is unknown."""
  devices = list(devices)
  peaks = [peak_flops(d) for d in devices]
  if not devices or any(p is None for p in peaks):
    return None
  return flops_per_token * tokens_per_s / sum(peaks)


def peak_memory_bytes(devices: Iterable[jax.Device]) -> tuple[int, str]:
  """(bytes, what): the largest accelerator `peak_bytes_in_use`, or this process's max RSS on CPU."""
  best = None
  for d in devices:
    try:
      stats = d.memory_stats()
    except Exception:  # CPU devices may raise or return None
      stats = None
    if stats and "peak_bytes_in_use" in stats:
      best = max(best or 0, int(stats["peak_bytes_in_use"]))
  if best is not None:
    return best, "device peak"
  return host_max_rss_bytes(), "host max RSS"


def host_max_rss_bytes() -> int:
  """The most host memory this process has held so far (its max resident set size), in bytes."""
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return int(rss if sys.platform == "darwin" else rss * 1024)


def format_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return f"{n:.2f} TiB"


class Throughput:
  """Tokens/s over the steps since the last `reset` (call `update` after a step has finished)."""

  def __init__(self):
    self.reset()

  def reset(self) -> None:
    self._t0 = time.perf_counter()
    self._tokens = 0

  def update(self, tokens: int) -> None:
    self._tokens += tokens

  def tokens_per_s(self) -> float:
    dt = time.perf_counter() - self._t0
    return self._tokens / dt if dt > 0 else 0.0


# ----------------------------------------------------------------------------------------------
# Writers.


class _ScalarEventWriter:
  """Scalar summaries in a TensorBoard event file, written synchronously: `flush()` means on disk.

  `event_writer` is tensorboardX's EventsWriter (its SummaryWriter puts events on a queue that a
  thread drains, and its flush does not wait for the queue: a killed run lost its last scalars)
  or the `tensorboard` package's EventFileWriter (whose flush drains its queue first).
  """

  def __init__(self, event_writer, event_pb2, summary_pb2):
    self._writer, self._event, self._summary = event_writer, event_pb2.Event, summary_pb2.Summary
    self._write = getattr(event_writer, "write_event", None) or event_writer.add_event

  def add_scalar(self, tag: str, value: float, step: int) -> None:
    summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))])
    self._write(self._event(wall_time=time.time(), step=int(step), summary=summary))

  def flush(self) -> None:
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()


def tensorboard_writer(logdir: str | os.PathLike, log=print):
  """A writer with add_scalar/flush/close over tensorboardX, else the `tensorboard` package, else None."""
  Path(logdir).mkdir(parents=True, exist_ok=True)
  try:
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto import event_pb2, summary_pb2
    return _ScalarEventWriter(EventsWriter(os.path.join(str(logdir), "events")), event_pb2, summary_pb2)
  except ImportError:
    pass
  try:
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    return _ScalarEventWriter(EventFileWriter(str(logdir)), event_pb2, summary_pb2)
  except ImportError:
    log("[metrics] neither tensorboardX nor tensorboard is installed: TensorBoard logging skipped")
    return None


class MetricsLog:
  """Appends metric records to `out_dir/metrics.jsonl` and TensorBoard.

  On resume from step `s`, records after `s` (from a run that went further before stopping) are
  dropped first, so the log describes the resumed run exactly once. `flush` raises StorageError
  when metrics.jsonl is no longer the file being written (the output directory was deleted or
  the file replaced): writing on would lose every record from then on without a word.
  """

  def __init__(self, out_dir: str | os.PathLike, tensorboard: bool = True, resume_step: int | None = None,
               log=print):
    self.out_dir = Path(out_dir)
    self.out_dir.mkdir(parents=True, exist_ok=True)
    self.path = self.out_dir / "metrics.jsonl"
    self.records: list[dict[str, Any]] = []
    if resume_step is not None and self.path.exists():
      self.records = [r for r in read_jsonl(self.path) if r.get("step", 0) <= resume_step]
    with open(self.path, "w") as f:
      for r in self.records:
        f.write(json.dumps(r) + "\n")
    self._file = open(self.path, "a")
    self._tb = tensorboard_writer(self.out_dir / "tb", log=log) if tensorboard else None

  def write(self, step: int, split: str, values: dict[str, Any]) -> None:
    record = {"step": int(step), "split": split, "time": time.time()}
    record.update({k: _jsonable(v) for k, v in values.items()})
    self.records.append(record)
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in values.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
          self._tb.add_scalar(f"{split}/{k}", v, step)

  def flush(self) -> None:
    self._file.flush()
    if self._tb is not None:
      self._tb.flush()
    try:
      same = os.stat(self.path).st_ino == os.fstat(self._file.fileno()).st_ino
    except FileNotFoundError:
      same = False
    if not same:
      raise StorageError(f"{self.path} was removed while the run wrote it (was {self.out_dir} "
                         f"deleted?): stopping, the logs from here on would be lost")

  def close(self) -> None:
    """Closes the files (safe to call twice)."""
    self._file.close()
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def _jsonable(v: Any) -> Any:
  if hasattr(v, "item"):
    v = v.item()
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)
  return v


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
  out = []
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line:
        try:
          out.append(json.loads(line))
        except json.JSONDecodeError:
          break  # a line cut short by a kill: everything before it is good
  return out


def train_loss_mean(record: dict[str, Any]) -> Any:
  """A train record's windowed mean loss ("loss" in logs written before it was named "loss_mean")."""
  return record.get("loss_mean", record.get("loss"))


def plot_losses(records: list[dict[str, Any]], path: str | os.PathLike, title: str = "") -> bool:
  """Writes a train/eval loss-vs-step PNG; returns False when there is nothing to plot."""
  train = [(r["step"], train_loss_mean(r)) for r in records
           if r.get("split") == "train" and _finite(train_loss_mean(r))]
  evals = [(r["step"], r["loss"]) for r in records if r.get("split") == "eval" and _finite(r.get("loss"))]
  if not train and not evals:
    return False
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
  if train:
    ax.plot(*zip(*train), label="train (mean since the previous log step)", lw=1.2)
  if evals:
    ax.plot(*zip(*evals), "o-", label="eval", lw=1.5, ms=4)
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy loss (nats/token)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return True


def _finite(v: Any) -> bool:
  return isinstance(v, (int, float)) and math.isfinite(v)
