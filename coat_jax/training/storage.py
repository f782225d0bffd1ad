"""Host memory and disk for checkpoints: when to stream a save, whether it fits, what failed.

A checkpoint save copies the state from the devices to host memory and writes it to disk. Saved
whole (orbax's default), every array is copied before any is written and the write buffers again:
on an H200 host (orbax-checkpoint 0.12.4) a 28 GiB state added 1.95x its size to the process's
resident memory, and a Llama-2-13B state of bfloat16 weights and FP8 moments is 49 GiB: twice
that and the process's own memory exhaust a 128 GB host. `stream_bytes` decides: a state larger
than a quarter of the host memory still available is saved in batches of at most `stream_bytes`
(orbax's device-to-host and write limits), synchronously (the training step donates the arrays a
background save would still be reading). On a GPU orbax stages each batch in pinned host memory,
which the process keeps after the save and reuses for the next; measured with the 13B state
(`benchmarks/step/checkpoint_memory.py`), a save adds about three to six batches: 61 GiB in
batches of 1/8 of the available memory, 32 GiB in batches of 1/32 (the largest array, 5.3 GiB),
30 s slower. Hence batches of 1/32, never smaller than the largest array (orbax writes an array
whole). Copies into ordinary host memory instead (orbax's `enable_pinned_host_transfer=False`)
are cached on the state's own arrays until the next step replaces them: 77 GiB.

Disk: `free_bytes` before a save (a save that cannot fit is refused with one line, the previous
checkpoint untouched), and `is_disk_error` for a write that fails on the way (disk full, file too
large, quota, read-only), after which only that save's partial directory is removed.
"""
from __future__ import annotations

import errno
import math
import os
import re
import resource
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

DISK_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS)
_DISK_TEXT = ("no space left", "file too large", "quota exceeded", "read-only file system",
              "enospc", "efbig", "edquot", "erofs")
STREAM_FRACTION = 0.25  # stream a state larger than this fraction of the available host memory
BATCH_FRACTION = 1 / 32  # each streamed batch: this fraction of it, or the largest array
STREAM_PINNED_HOST: bool | None = None  # a streamed batch's copies into pinned host memory: None is
# orbax's choice (pinned on a GPU; ordinary host memory holds more, above)


def state_bytes(tree: Any) -> int:
  """Bytes of a pytree's arrays (or ShapeDtypeStructs) as stored: every element once."""
  return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
                 if hasattr(x, "shape") and hasattr(x, "dtype")))


def largest_leaf_bytes(tree: Any) -> int:
  return max((math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
              if hasattr(x, "shape") and hasattr(x, "dtype")), default=0)


def _address_space_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def host_available_bytes() -> int | None:
  """Host memory a save may still use: MemAvailable (Linux), bounded by this process's address
  space limit (RLIMIT_AS) where one is set; None where neither is known."""
  found = []
  try:
    with open("/proc/meminfo") as f:
      info = dict(line.split(":", 1) for line in f)
    found.append(int(info["MemAvailable"].split()[0]) * 1024)
  except (OSError, KeyError, ValueError):
    pass
  soft, _ = resource.getrlimit(resource.RLIMIT_AS)
  if soft != resource.RLIM_INFINITY:
    try:
      found.append(max(0, soft - _address_space_bytes()))
    except OSError:
      pass
  return min(found) if found else None


def stream_bytes(total: int, largest: int, processes: int = 1) -> int | None:
  """The batch size of a streamed save of a state of `total` bytes (largest array `largest`), or
  None when the state is small enough to copy to host memory at once."""
  available = host_available_bytes()
  mine = total // max(1, processes)  # each host copies its own shards
  if available is None or mine <= STREAM_FRACTION * available:
    return None
  return max(int(available * BATCH_FRACTION), largest + 1)  # orbax writes an array whole


def free_bytes(directory: Path) -> int:
  """Free bytes on the file system of `directory` (or of its nearest existing parent)."""
  path = Path(directory)
  while not path.exists() and path != path.parent:
    path = path.parent
  return shutil.disk_usage(path).free


def needed_bytes(total: int) -> int:
  """Disk bytes a checkpoint of `total` state bytes takes, with room for its metadata."""
  return int(total * 1.01) + (16 << 20)


def is_disk_error(e: BaseException) -> bool:
  """Whether `e` (or an exception it was raised from) is a failed write to a full or read-only
  disk: OSError with a disk errno, or orbax's/TensorStore's wrapped message of one."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
      return True
    if any(t in str(e).lower() for t in _DISK_TEXT):
      return True
    e = e.__cause__ or e.__context__
  return False


_REASON = re.compile(r"no space left on device|file too large|disk quota exceeded|"
                     r"read-only file system", re.I)


def disk_error_reason(e: BaseException) -> str:
  """The operating system's words for a disk error (e.g. 'No space left on device')."""
  while e is not None:
    found = _REASON.search(str(e))
    if found:
      return found.group(0)
    if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
      return os.strerror(e.errno)
    e = e.__cause__
  return "disk error"


def remove_partial(directory: Path, step: int) -> list[str]:
  """Removes the temporary directories of step `step`'s unfinished save (orbax writes
  `<step>.orbax-checkpoint-tmp-*` and renames it when complete); returns their names."""
  removed = []
  for _ in range(50):  # a writer thread of the failed save may still be closing its files
    partial = list(Path(directory).glob(f"{step}.orbax-checkpoint-tmp*"))
    if not partial:
      break
    for p in partial:
      shutil.rmtree(p, ignore_errors=True)
      removed.append(p.name)
    time.sleep(0.02)
  return sorted(set(removed))
