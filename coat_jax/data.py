"""Token data: the offline stdlib corpus, pre-tokenized shards, text/jsonl files; deterministic batches.

Every source ends as a list of 1-D integer token arrays (in memory or memory-mapped). They are cut
into non-overlapping windows of `seq_len + 1` tokens (stride `seq_len`; a window never spans two
files). The last `eval_fraction` of the windows (the last tokens) is held out for evaluation.

Training batch `step` is a pure function of `(seed, step)`: example `k = step * batch_size + b`
lies in epoch `k // n_train` and takes window `permute(k % n_train)`, where `permute` is a keyed
Feistel permutation of `[0, n_train)` (constant memory, any size). Resuming at step `s` therefore
reproduces the uninterrupted run exactly, with no iterator state to save.

Sources (`DataConfig.kind`):
  "stdlib": the Python standard library's .py files (sorted, capped at `corpus_max_bytes`), a
    byte-level BPE trained locally with `tokenizers` and cached, ids cached as .npy.
  "tokens": `.npy` files, or raw little-endian `uint16`/`uint32` files (OLMo/Dolma-style shards,
    which are raw even when named `.npy`).
  "text"/"jsonl": text files or JSON lines (`text_field`) with a local tokenizer.json.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import math
import os
import sysconfig
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from coat_jax.config import DataConfig

EOS_TOKEN = "<|endoftext|>"
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|eos|>", "<|im_end|>")
_FULL_SCAN_MAX_TOKENS = 1 << 28  # vocab check over all tokens up front below this size
# Left out of the stdlib corpus: installed third-party packages (differ between machines), byte
# code, and the generated codec tables of `encodings` (megabytes of repetitive hex tables).
_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__", "encodings")


# ----------------------------------------------------------------------------------------------
# Small helpers.


def cache_dir(data_cfg: DataConfig) -> Path:
  path = Path(os.path.expanduser(data_cfg.cache_dir))
  path.mkdir(parents=True, exist_ok=True)
  return path


def _atomic_write_bytes(path: Path, payload: bytes) -> None:
  """Writes `payload` to `path` through a temp file and a rename (readers never see half a file)."""
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(payload)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def _atomic_save_npy(path: Path, array: np.ndarray) -> None:
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp", suffix=".npy")
  try:
    with os.fdopen(fd, "wb") as f:
      np.save(f, array)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def token_dtype(vocab_size: int) -> np.dtype:
  """The smallest unsigned dtype that holds ids `< vocab_size`."""
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def expand_paths(patterns: Sequence[str]) -> list[Path]:
  """Expands files and glob patterns (sorted, deduplicated, in the order given); errors name the pattern."""
  out: list[Path] = []
  for pattern in patterns:
    pattern = os.path.expanduser(pattern)
    if glob.has_magic(pattern):
      matches = sorted(glob.glob(pattern, recursive=True))
      if not matches:
        raise ValueError(f"data file pattern {pattern!r} matches no files")
    else:
      matches = [pattern]
    for m in matches:
      p = Path(m)
      if not p.exists():
        raise ValueError(f"data file not found: {p}")
      if not p.is_file():
        raise ValueError(f"data path is not a file: {p}")
      if p not in out:
        out.append(p)
  return out


# ----------------------------------------------------------------------------------------------
# The offline default corpus: the Python standard library's sources.


def stdlib_files(max_bytes: int) -> list[Path]:
  """The stdlib's .py files (sorted by relative path; `_SKIP_DIRS` left out), up to `max_bytes` in all.

  Files are taken in order until their total size reaches `max_bytes` (the file that crosses it is
  included), so a smaller cap gives a prefix of a larger one.
  """
  root = Path(sysconfig.get_paths()["stdlib"])
  if not root.is_dir():
    raise ValueError(f"the Python standard library directory {root} does not exist")
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
    files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
  files.sort(key=lambda p: p.relative_to(root).as_posix())
  chosen, total = [], 0
  for f in files:
    if total >= max_bytes:
      break
    chosen.append(f)
    total += f.stat().st_size
  if not chosen:
    raise ValueError(f"no .py files found under the standard library directory {root}")
  return chosen


def read_texts(files: Iterable[Path]) -> list[str]:
  return [Path(f).read_bytes().decode("utf-8", errors="replace") for f in files]


def corpus_hash(texts: Sequence[str]) -> str:
  """A content hash of a list of documents (order and boundaries included)."""
  h = hashlib.sha256()
  for t in texts:
    b = t.encode("utf-8")
    h.update(len(b).to_bytes(8, "little"))
    h.update(b)
  return h.hexdigest()[:16]


def train_bpe(texts: Sequence[str], vocab_size: int):
  """Trains a byte-level BPE tokenizer with `vocab_size` entries (id 0 is `<|endoftext|>`)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  alphabet = pre_tokenizers.ByteLevel.alphabet()
  if vocab_size < len(alphabet) + 1:
    raise ValueError(f"data.vocab_size={vocab_size} is too small for a byte-level BPE "
                     f"(needs at least {len(alphabet) + 1}: 256 bytes and <|endoftext|>)")
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                initial_alphabet=alphabet, show_progress=False)
  tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
  return tokenizer


def load_tokenizer(path: str | Path):
  """Loads a tokenizer.json (`path` is the file or a directory holding one)."""
  from tokenizers import Tokenizer

  path = Path(os.path.expanduser(str(path)))
  if path.is_dir():
    path = path / "tokenizer.json"
  if not path.is_file():
    raise ValueError(f"tokenizer file not found: {path}")
  try:
    return Tokenizer.from_file(str(path))
  except Exception as e:  # tokenizers raises its own Exception type
    raise ValueError(f"cannot load tokenizer {path}: {e}") from e


def eos_id(tokenizer) -> int | None:
  for name in _EOS_CANDIDATES:
    i = tokenizer.token_to_id(name)
    if i is not None:
      return i
  return None


def tokenize_documents(tokenizer, texts: Sequence[str], eos: int | None, dtype: np.dtype) -> np.ndarray:
  """Tokenizes documents and joins them with `eos` (when given) after each one; returns 1-D `dtype`."""
  parts = []
  chunk = 256
  for i in range(0, len(texts), chunk):
    for enc in tokenizer.encode_batch(list(texts[i:i + chunk]), add_special_tokens=False):
      parts.append(np.asarray(enc.ids, dtype=np.int64))
      if eos is not None:
        parts.append(np.asarray([eos], dtype=np.int64))
  if not parts:
    return np.zeros((0,), dtype)
  ids = np.concatenate(parts)
  if ids.size and ids.max() >= np.iinfo(dtype).max:
    raise ValueError(f"token id {int(ids.max())} does not fit {dtype}")
  return ids.astype(dtype)


def stdlib_tokens(data_cfg: DataConfig, log=print):
  """The stdlib corpus tokenized with its locally trained BPE; both cached. Returns (ids, tokenizer, name)."""
  files = stdlib_files(data_cfg.corpus_max_bytes)
  texts = read_texts(files)
  key = f"stdlib-v{data_cfg.vocab_size}-{corpus_hash(texts)}"
  directory = cache_dir(data_cfg)
  tok_path, ids_path = directory / f"{key}.tokenizer.json", directory / f"{key}.ids.npy"
  if tok_path.is_file():
    tokenizer = load_tokenizer(tok_path)
  else:
    nbytes = sum(len(t) for t in texts)
    log(f"[data] training a byte-level BPE (vocab {data_cfg.vocab_size}) on {len(files)} stdlib files "
        f"({nbytes / 1e6:.1f} MB); cached at {tok_path}")
    tokenizer = train_bpe(texts, data_cfg.vocab_size)
    _atomic_write_bytes(tok_path, tokenizer.to_str().encode("utf-8"))
  if ids_path.is_file():
    ids = np.load(ids_path, mmap_mode="r")
  else:
    log(f"[data] tokenizing the stdlib corpus; cached at {ids_path}")
    ids = tokenize_documents(tokenizer, texts, eos_id(tokenizer), token_dtype(tokenizer.get_vocab_size()))
    _atomic_save_npy(ids_path, ids)
  return ids, tokenizer, f"stdlib[{len(files)} files]"


# ----------------------------------------------------------------------------------------------
# Real formats.


def load_token_file(path: Path, dtype: str) -> np.ndarray:
  """Memory-maps one pre-tokenized file: a real `.npy` (its own dtype) or raw little-endian `dtype`.

  OLMo/Dolma shards are raw memmaps even when named `*.npy`: a file without the NumPy header is
  read as raw `dtype` whatever its name.
  """
  if dtype not in ("uint16", "uint32"):
    raise ValueError(f"data.dtype must be 'uint16' or 'uint32', got {dtype!r}")
  with open(path, "rb") as f:
    has_header = f.read(6) == b"\x93NUMPY"
  if has_header:
    try:
      arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as e:
      raise ValueError(f"malformed .npy token file {path}: {e}") from e
    if arr.ndim != 1:
      raise ValueError(f"token file {path} must hold a 1-D array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"token file {path} must hold integers, got dtype {arr.dtype}")
    return arr
  size = path.stat().st_size
  itemsize = np.dtype(dtype).itemsize
  if size % itemsize:
    raise ValueError(f"raw token file {path} has {size} bytes, not a multiple of {itemsize} "
                     f"(data.dtype={dtype!r}); wrong dtype or truncated file?")
  if size == 0:
    return np.zeros((0,), np.dtype(dtype))
  return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")


def read_jsonl(path: Path, field: str) -> list[str]:
  """The `field` strings of a JSON-lines file; errors name the file and line."""
  texts = []
  with open(path, "rb") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
      if not isinstance(record, dict) or field not in record:
        raise ValueError(f"{path}:{lineno}: record has no {field!r} field")
      if not isinstance(record[field], str):
        raise ValueError(f"{path}:{lineno}: field {field!r} is {type(record[field]).__name__}, not a string")
      texts.append(record[field])
  return texts


def text_tokens(data_cfg: DataConfig, log=print):
  """Text or JSON-lines files tokenized with a local tokenizer, one cached id file per input file."""
  files = expand_paths(data_cfg.paths)
  tok_path = Path(os.path.expanduser(data_cfg.tokenizer))
  tokenizer = load_tokenizer(tok_path)
  tok_file = tok_path / "tokenizer.json" if tok_path.is_dir() else tok_path
  tok_hash = hashlib.sha256(tok_file.read_bytes()).hexdigest()[:16]
  eos = eos_id(tokenizer)
  dtype = token_dtype(tokenizer.get_vocab_size())
  directory = cache_dir(data_cfg)
  arrays, names = [], []
  for f in files:
    st = f.stat()
    key = hashlib.sha256(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|{data_cfg.kind}|"
                         f"{data_cfg.text_field}|{tok_hash}".encode()).hexdigest()[:20]
    ids_path = directory / f"text-{key}.ids.npy"
    if ids_path.is_file():
      ids = np.load(ids_path, mmap_mode="r")
    else:
      if data_cfg.kind == "jsonl":
        texts = read_jsonl(f, data_cfg.text_field)
      else:
        texts = [f.read_bytes().decode("utf-8", errors="replace")]
      log(f"[data] tokenizing {f} ({len(texts)} documents)")
      ids = tokenize_documents(tokenizer, texts, eos, dtype)
      _atomic_save_npy(ids_path, ids)
    arrays.append(ids)
    names.append(str(f))
  return arrays, names, tokenizer


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
    if self.num_tokens > _FULL_SCAN_MAX_TOKENS:
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
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    k = step * self.batch_size + np.arange(self.batch_size, dtype=np.int64)
    epoch, pos = k // self.n_train, k % self.n_train
    return self._windows(permute(pos, self.n_train, self.seed, epoch))

  def eval_batches(self, num_batches: int) -> list[np.ndarray]:
    """`num_batches` fixed evaluation batches from the held-out windows (cycled if there are few)."""
    if self.n_eval == 0 or num_batches == 0:
      return []
    k = np.arange(num_batches * self.batch_size, dtype=np.int64) % self.n_eval + self.n_train
    return list(self._windows(k).reshape(num_batches, self.batch_size, self.seq_len + 1))

  def epoch_of(self, step: int) -> float:
    return step * self.batch_size / self.n_train


def build_dataset(data_cfg: DataConfig, seed: int, log=print) -> TokenDataset:
  """Builds the dataset a config names (tokenizing and caching as needed)."""
  common = dict(seq_len=data_cfg.seq_len, batch_size=data_cfg.batch_size, seed=seed,
                eval_fraction=data_cfg.eval_fraction)
  if data_cfg.kind == "stdlib":
    ids, tokenizer, name = stdlib_tokens(data_cfg, log=log)
    return TokenDataset([ids], [name], vocab_size=tokenizer.get_vocab_size(), tokenizer=tokenizer,
                        description=f"{name}, byte-level BPE vocab {tokenizer.get_vocab_size()}", **common)
  if data_cfg.kind == "tokens":
    files = expand_paths(data_cfg.paths)
    arrays = [load_token_file(f, data_cfg.dtype) for f in files]
    return TokenDataset(arrays, [str(f) for f in files], description=f"{len(files)} token files", **common)
  if data_cfg.kind in ("text", "jsonl"):
    arrays, names, tokenizer = text_tokens(data_cfg, log=log)
    return TokenDataset(arrays, names, vocab_size=tokenizer.get_vocab_size(), tokenizer=tokenizer,
                        description=f"{len(names)} {data_cfg.kind} files, tokenizer {data_cfg.tokenizer}",
                        **common)
  raise ValueError(f"unknown data.kind {data_cfg.kind!r}")
