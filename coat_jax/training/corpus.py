"""The offline default corpus and local tokenizers: the Python standard library's sources, a
byte-level BPE trained on them with `tokenizers`, tokenization of documents, and the cache.

The corpus is the stdlib's .py files, sorted, capped at a byte budget (`_SKIP_DIRS` left out); the
tokenizer and the token ids are cached under a key that hashes the corpus content, written
atomically (a temp file and a rename) so concurrent runs never read half a file.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

EOS_TOKEN = "<|endoftext|>"
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|eos|>", "<|im_end|>")
# Left out of the stdlib corpus: installed third-party packages (differ between machines), byte
# code, and the generated codec tables of `encodings` (megabytes of repetitive hex tables).
_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__", "encodings")


def cache_dir(path: str | os.PathLike) -> Path:
  """`path` with ~ expanded, created if missing."""
  path = Path(os.path.expanduser(str(path)))
  path.mkdir(parents=True, exist_ok=True)
  return path


def atomic_write_bytes(path: Path, payload: bytes) -> None:
  """Writes `payload` to `path` through a temp file and a rename (readers never see half a file)."""
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(payload)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def atomic_save_npy(path: Path, array: np.ndarray) -> None:
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


def tokenizer_file(path: str | Path) -> Path:
  """The tokenizer.json `path` names: the file itself, or the one in the directory `path`."""
  path = Path(os.path.expanduser(str(path)))
  return path / "tokenizer.json" if path.is_dir() else path


def load_tokenizer(path: str | Path):
  """Loads a tokenizer.json (`path` is the file or a directory holding one)."""
  from tokenizers import Tokenizer

  path = tokenizer_file(path)
  if not path.is_file():
    raise ValueError(f"tokenizer file not found: {path}")
  try:
    return Tokenizer.from_file(str(path))
  except Exception as e:  # tokenizers raises its own Exception type
    raise ValueError(f"cannot load tokenizer {path}: {e}") from e


def tokenizer_hash(path: str | Path) -> str:
  """A content hash of a tokenizer.json (`path` is the file or a directory holding one)."""
  return hashlib.sha256(tokenizer_file(path).read_bytes()).hexdigest()[:16]


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


def stdlib_tokens(vocab_size: int, max_bytes: int, cache: str | os.PathLike, log=print,
                  tokenizer_path: str | os.PathLike = ""):
  """The stdlib corpus tokenized with its locally trained BPE of `vocab_size`, or with the
  tokenizer at `tokenizer_path` (a tokenizer.json or its directory; then no BPE is trained and
  `vocab_size` is unused); the ids (and the BPE) cached in `cache`, keyed by the corpus's and
  the tokenizer's content.

  Returns (ids, tokenizer, name).
  """
  files = stdlib_files(max_bytes)
  texts = read_texts(files)
  directory = cache_dir(cache)
  if tokenizer_path:
    tokenizer = load_tokenizer(tokenizer_path)
    key = f"stdlib-t{tokenizer_hash(tokenizer_path)}-{corpus_hash(texts)}"
  else:
    key = f"stdlib-v{vocab_size}-{corpus_hash(texts)}"
    tok_path = directory / f"{key}.tokenizer.json"
    if tok_path.is_file():
      tokenizer = load_tokenizer(tok_path)
    else:
      nbytes = sum(len(t) for t in texts)
      log(f"[data] training a byte-level BPE (vocab {vocab_size}) on {len(files)} stdlib files "
          f"({nbytes / 1e6:.1f} MB); cached at {tok_path}")
      tokenizer = train_bpe(texts, vocab_size)
      atomic_write_bytes(tok_path, tokenizer.to_str().encode("utf-8"))
  ids_path = directory / f"{key}.ids.npy"
  if ids_path.is_file():
    ids = np.load(ids_path, mmap_mode="r")
  else:
    log(f"[data] tokenizing the stdlib corpus; cached at {ids_path}")
    ids = tokenize_documents(tokenizer, texts, eos_id(tokenizer), token_dtype(tokenizer.get_vocab_size()))
    atomic_save_npy(ids_path, ids)
  return ids, tokenizer, f"stdlib[{len(files)} files]"
