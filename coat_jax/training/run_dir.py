"""A run's directories: what a run writes there, the lock that keeps a second run out, and what
`--overwrite` may remove.

A run writes into its output directory config.yaml, metrics.jsonl, summary.json, loss.png, tb/
(TensorBoard event files), the lock file `.coat_jax.lock`, and (unless `checkpoint.dir` names
another place) checkpoints/. A checkpoint directory holds orbax step directories `<step>/`
(`_CHECKPOINT_METADATA`, `commit_success.txt`, `meta/`, `state/`), orbax's temporary
`<step>.orbax-checkpoint-tmp-*` ones, and `<step>.unreadable-<pid>` / `<step>.superseded-<pid>`
set aside on resume. `--overwrite` removes exactly these and refuses (BadInputError, one line)
when a directory it would clear holds anything else.

The lock is an OS file lock (`fcntl.flock`) on `.coat_jax.lock` in each directory: the operating
system releases it when the process ends, however it ends, so a crashed run never leaves it held.
The file keeps the holder's pid for the message a second run gets.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
from pathlib import Path

from coat_jax.errors import BadInputError, StorageError

LOCK_NAME = ".coat_jax.lock"
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "loss.png")
TB_DIR, CHECKPOINTS_DIR = "tb", "checkpoints"
_STEP_FILES = {"_CHECKPOINT_METADATA", "commit_success.txt", "meta", "state"}
_SET_ASIDE = re.compile(r"^\d+\.(unreadable|superseded)-\d+$")
_ORBAX_TMP = re.compile(r"^\d+\.orbax-checkpoint-tmp-\d+$")
_TB_EVENTS = re.compile(r"^events(\.out\.tfevents\..*)?$")


def expand(path: str) -> Path:
  """A run path from the config: `~` expanded, otherwise as written."""
  return Path(os.path.expanduser(path))


def earlier_run(out_dir: Path, ckpt_dir: Path) -> list[str]:
  """What of an earlier run lies in these directories: metrics.jsonl and checkpoint steps."""
  found = [str(out_dir / "metrics.jsonl")] if (out_dir / "metrics.jsonl").is_file() else []
  if ckpt_dir.is_dir():
    steps = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.is_dir() and p.name.isdigit())
    if steps:
      found.append(f"checkpoints {', '.join(map(str, steps))} in {ckpt_dir}")
  return found


def set_aside(ckpt_dir: Path) -> list[str]:
  """Names of the checkpoints a resume set aside (`<step>.unreadable-<pid>`, `.superseded-`)."""
  if not ckpt_dir.is_dir():
    return []
  return sorted(p.name for p in ckpt_dir.iterdir() if _SET_ASIDE.match(p.name))


def _is_ours_in_checkpoints(p: Path) -> bool:
  if p.name == LOCK_NAME or _SET_ASIDE.match(p.name) or _ORBAX_TMP.match(p.name):
    return True
  return (p.is_dir() and not p.is_symlink() and p.name.isdigit()
          and {c.name for c in p.iterdir()} <= _STEP_FILES)


def _foreign(ckpt_dir: Path, out_dir: Path) -> list[Path]:
  """Entries of the directories `--overwrite` would clear that no run of this project wrote."""
  out = []
  if ckpt_dir.is_dir():
    out += [p for p in ckpt_dir.iterdir() if not _is_ours_in_checkpoints(p)]
  tb = out_dir / TB_DIR
  if tb.is_dir():
    out += [p for p in tb.iterdir() if not (p.is_file() and _TB_EVENTS.match(p.name))]
  return sorted(out)


def clear_earlier_run(out_dir: Path, ckpt_dir: Path, overwrite: bool) -> None:
  """Refuses (BadInputError) a fresh run into an earlier run's directories, or with `overwrite`
  removes what that run wrote, and only that: a checkpoint or TensorBoard directory holding other
  files is refused, naming one, and nothing is removed."""
  found = earlier_run(out_dir, ckpt_dir)
  if not found:
    return
  if not overwrite:
    raise BadInputError(f"{out_dir} holds an earlier run ({'; '.join(found)}): continue it with "
                        f"--resume, choose a new --out-dir, or replace it with --overwrite")
  foreign = _foreign(ckpt_dir, out_dir)
  if foreign:
    raise BadInputError(f"--overwrite: {foreign[0].parent} holds {len(foreign)} entries that no "
                        f"run wrote (e.g. {foreign[0].name}); nothing was removed: move them, or "
                        f"choose another --out-dir / checkpoint.dir")
  if ckpt_dir.is_dir():
    for p in ckpt_dir.iterdir():
      if p.name != LOCK_NAME:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
  shutil.rmtree(out_dir / TB_DIR, ignore_errors=True)
  for name in RUN_FILES:
    (out_dir / name).unlink(missing_ok=True)


class DirLock:
  """An exclusive `flock` on `<directory>/.coat_jax.lock`, held until `release` (or the process
  ends). `acquire` raises BadInputError naming the holder's pid when another process holds it."""

  def __init__(self, directory: Path):
    self.directory = directory
    self._fd: int | None = None

  def acquire(self) -> None:
    if self._fd is not None:
      return
    path = self.directory / LOCK_NAME
    try:
      self.directory.mkdir(parents=True, exist_ok=True)
      fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
      raise StorageError(f"cannot create the lock file {path}: {e.strerror}") from e
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = os.read(fd, 32).decode("ascii", "replace").strip() or "unknown"
      os.close(fd)
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise StorageError(f"cannot lock {path}: {e.strerror}") from e
      raise BadInputError(f"{self.directory} is in use by another run (pid {holder}); wait for "
                          f"it to end or choose another --out-dir") from None
    pid = f"{os.getpid()}\n".encode()
    if os.pread(fd, 64, 0) != pid:
      os.ftruncate(fd, 0)
      os.pwrite(fd, pid, 0)
    self._fd = fd

  def release(self) -> None:
    if self._fd is not None:
      os.close(self._fd)  # closing the descriptor releases the flock
      self._fd = None


class RunDirs:
  """The output and checkpoint directories of a run and their locks (main process only).

  `lock(create=False)` locks the directories that exist (all of them, creating them, with
  create=True); `release()` unlocks.
  """

  def __init__(self, out_dir: Path, ckpt_dir: Path, is_main: bool = True):
    self.out_dir, self.ckpt_dir, self.is_main = out_dir, ckpt_dir, is_main
    inside = ckpt_dir.absolute().parent == out_dir.absolute()
    self._locks = [DirLock(out_dir)] + ([] if inside else [DirLock(ckpt_dir)])

  def lock(self, create: bool = False) -> None:
    if not self.is_main:
      return
    for lock in self._locks:
      if create or lock.directory.is_dir():
        lock.acquire()

  def release(self) -> None:
    for lock in self._locks:
      lock.release()
