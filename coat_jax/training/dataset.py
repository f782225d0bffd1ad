"""Windows, the train/eval split and deterministic batches over 1-D token arrays.

Token arrays (in memory or memory-mapped, one per source file; corpus.py and token_files.py make
them) are cut into non-overlapping windows of `seq_len + 1` tokens (stride `seq_len`; a window never
spans two files). The last `eval_fraction` of the windows (the last tokens) is held out for
evaluation.

Training batch `step` is a pure function of `(seed, step)`: example `k = step * batch_size + b`
lies in epoch `k // n_train` and takes window `permute(k % n_train)`, where `permute` is a keyed
Feistel permutation of `[0, n_train)` (constant memory, any size). Resuming at step `s` therefore
reproduces the uninterrupted run exactly, with no iterator state to save.

A batch is a (batch_size, seq_len + 1) int32 array, or with document masking (`eos_id` set) a
dict of three such arrays: "tokens", "segment_ids" (1 + the number of end-of-text ids before
each position in the window: a document ends with its end-of-text id) and "loss_mask" (all 1;
the step leaves out predictions across a segment boundary: `build.batch_loss`). Packed
supervised fine-tuning rows (sft.py) come as the same dict.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

FULL_SCAN_MAX_TOKENS = 1 << 28  # vocab check over all tokens up front below this size


# ----------------------------------------------------------------------------------------------
# A stateless permutation: batch i is a pure function of (seed, step).

def _mix64(x: np.ndarray) -> np.ndarray:
  """The splitmix64 finalizer on uint64 arrays (wrapping arithmetic)."""
  x = np.asarray(x, np.uint64)
  with np.errstate(over="ignore"):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def permute(index: np.ndarray, n: int, seed: int, epoch: np.ndarray, rounds: int = 4) -> np.ndarray:
  """A keyed pseudo-random bijection of `[0, n)` applied to `index` (int64 arrays; `epoch` per element).

  A balanced Feistel network over the smallest even-bit domain holding `n`, with cycle walking
  back into `[0, n)`. Different `(seed, epoch)` give different permutations.
  """
  index = np.asarray(index, np.int64)
  if np.any(index < 0) or np.any(index >= n):
    raise ValueError(f"permute: indices must lie in [0, {n})")
  if n <= 1:
    return np.zeros_like(index)
  half = max(1, math.ceil(math.log2(n) / 2))
  mask = np.uint64((1 << half) - 1)
  flat = index.reshape(-1).copy()
  epochs = np.broadcast_to(np.asarray(epoch, np.uint64), index.shape).reshape(-1)
  base = _mix64(_mix64(np.uint64(seed) + np.uint64(0x9E3779B97F4A7C15)) ^ _mix64(epochs + np.uint64(1)))
  with np.errstate(over="ignore"):
    keys = [_mix64(base ^ (np.uint64(r + 1) * np.uint64(0xD6E8FEB86659FD93))) for r in range(rounds)]
  todo = np.arange(flat.size)
  while todo.size:  # cycle walking: values that land in [n, 2^(2 half)) go round again
    x = flat[todo].astype(np.uint64)
    left, right = x >> np.uint64(half), x & mask
    for k in keys:
      left, right = right, left ^ (_mix64(right ^ k[todo]) & mask)
    flat[todo] = ((left << np.uint64(half)) | right).astype(np.int64)
    todo = todo[flat[todo] >= n]
  return flat.reshape(index.shape)


# ----------------------------------------------------------------------------------------------
# Windows, splits and batches.


def train_rows(step: int, batch_size: int, n_train: int, seed: int) -> np.ndarray:
  """The training rows of batch `step`: a pure function of (seed, step), each epoch a fresh
  permutation of the n_train rows."""
  if step < 0:
    raise ValueError(f"step must be >= 0, got {step}")
  k = step * batch_size + np.arange(batch_size, dtype=np.int64)
  return permute(k % n_train, n_train, seed, k // n_train)


def eval_rows(num_batches: int, batch_size: int, n_train: int, n_eval: int) -> np.ndarray:
  """The rows of `num_batches` fixed evaluation batches: the held-out rows after the n_train
  training rows, cycled if there are few."""
  return np.arange(num_batches * batch_size, dtype=np.int64) % n_eval + n_train


@dataclasses.dataclass
class TokenDataset:
  """Token arrays cut into `seq_len + 1` windows, with a train/eval split and deterministic batches.

  Attributes:
    arrays: 1-D integer token arrays (in memory or memory-mapped), one per source file.
    names: a name per array, used in error messages.
    seq_len, batch_size, seed: batching.
    eval_fraction: share of the windows (the last ones) held out for evaluation.
    vocab_size: the tokenizer's vocabulary size when the source has a tokenizer, else None.
    description: one line about the source.
  """
  arrays: list[np.ndarray]
  names: list[str]
  seq_len: int
  batch_size: int
  seed: int
  eval_fraction: float
  vocab_size: int | None = None
  description: str = ""
  tokenizer: object = None
  eos_id: int | None = None

  def __post_init__(self):
    if not self.arrays or sum(int(a.shape[0]) for a in self.arrays) == 0:
      raise ValueError(f"empty corpus: no tokens in {', '.join(self.names) or 'the data source'}")
    span = self.seq_len + 1
    counts = np.array([max(0, (int(a.shape[0]) - 1) // self.seq_len) for a in self.arrays], np.int64)
    total = int(counts.sum())
    if total == 0:
      longest = max(int(a.shape[0]) for a in self.arrays)
      raise ValueError(f"data.seq_len={self.seq_len} is longer than the data: a window needs {span} "
                       f"tokens within one file, the longest file has {longest}")
    self._starts = np.concatenate([[0], np.cumsum(counts)])
    n_eval = math.ceil(total * self.eval_fraction) if self.eval_fraction > 0 else 0
    if n_eval >= total:
      raise ValueError(f"data has only {total} windows of {span} tokens: too few to hold out "
                       f"data.eval_fraction={self.eval_fraction} for evaluation and still train")
    self.n_train, self.n_eval = total - n_eval, n_eval
    self._vocab_limit: int | None = None

  @property
  def num_tokens(self) -> int:
    return int(sum(int(a.shape[0]) for a in self.arrays))

  def check_vocab(self, vocab_size: int) -> None:
    """Raises ValueError naming the file and position of the first id `>= vocab_size`.

    Scans everything for data up to 2^28 tokens; larger data is checked batch by batch instead.
    """
    self._vocab_limit = vocab_size
    if self.num_tokens > FULL_SCAN_MAX_TOKENS:
      return
    chunk = 1 << 24
    for arr, name in zip(self.arrays, self.names):
      for i in range(0, arr.shape[0], chunk):
        part = np.asarray(arr[i:i + chunk])
        if part.size and (part.max() >= vocab_size or (part.dtype.kind == "i" and part.min() < 0)):
          bad = np.flatnonzero((part >= vocab_size) | (part < 0))[0]
          raise ValueError(f"token id {int(part[bad])} at position {i + int(bad)} of {name} is out of "
                           f"range for the model's vocab_size={vocab_size}")

  def _windows(self, window_ids: np.ndarray) -> np.ndarray:
    """Gathers windows by global id into a (len, seq_len + 1) int32 array."""
    span = self.seq_len + 1
    out = np.empty((window_ids.shape[0], span), np.int32)
    files = np.searchsorted(self._starts, window_ids, side="right") - 1
    for row, (w, f) in enumerate(zip(window_ids, files)):
      start = int(w - self._starts[f]) * self.seq_len
      window = np.asarray(self.arrays[f][start:start + span])
      if self._vocab_limit is not None and (window.max() >= self._vocab_limit or window.min() < 0):
        bad = int(np.flatnonzero((window >= self._vocab_limit) | (window < 0))[0])
        raise ValueError(f"token id {int(window[bad])} at position {start + bad} of {self.names[f]} "
                         f"is out of range for the model's vocab_size={self._vocab_limit}")
      out[row] = window
    return out

  def train_batch(self, step: int) -> np.ndarray:
    """Training batch `step`: (batch_size, seq_len + 1) int32 tokens, a pure function of (seed, step)."""
    return self._batch(self._windows(train_rows(step, self.batch_size, self.n_train, self.seed)))

  def eval_batches(self, num_batches: int) -> list[np.ndarray]:
    """`num_batches` fixed evaluation batches from the held-out windows (cycled if there are few)."""
    if self.n_eval == 0 or num_batches == 0:
      return []
    k = eval_rows(num_batches, self.batch_size, self.n_train, self.n_eval)
    windows = self._windows(k).reshape(num_batches, self.batch_size, self.seq_len + 1)
    return [self._batch(w) for w in windows]

  def _batch(self, windows: np.ndarray):
    """The windows as a batch: as they are, or with document masking a dict (module docstring)."""
    if self.eos_id is None:
      return windows
    return document_batch(windows, self.eos_id)

  def epoch_of(self, step: int) -> float:
    return step * self.batch_size / self.n_train


def document_batch(tokens: np.ndarray, eos: int) -> dict[str, np.ndarray]:
  """{"tokens", "segment_ids", "loss_mask"} of windows whose documents end with `eos`."""
  is_eos = (tokens == eos).astype(np.int32)
  segments = 1 + np.cumsum(is_eos, axis=1, dtype=np.int32) - is_eos
  return {"tokens": tokens, "segment_ids": segments, "loss_mask": np.ones_like(tokens)}
