"""Token sources on disk: pre-tokenized files (.npy or raw memmaps), text and JSON-lines files.

"tokens": `.npy` files, or raw little-endian `uint16`/`uint32` files (OLMo/Dolma-style shards, which
are raw even when named `.npy`). "text"/"jsonl": text files or JSON lines (a `text_field`)
tokenized with a local tokenizer.json in bounded pieces (text_stream.py: memory independent of
file and line size); the ids are cached per file as raw little-endian ids (keyed by path, size,
mtime and the tokenizer's hash). Every error names the file (and line, for text and JSON lines).
"""
from __future__ import annotations

import glob
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from coat_jax.training import text_stream
from coat_jax.training.corpus import cache_dir, eos_id, load_tokenizer, token_dtype, tokenizer_hash


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


def tokenize_file(path: Path, kind: str, text_field: str, tokenizer, eos: int | None,
                  dtype: np.dtype, out: Path) -> int:
  """Tokenizes text or JSON-lines file `path` into raw little-endian `dtype` ids at `out`
  (written through a temp file and a rename); returns the number of ids."""
  dtype = np.dtype(dtype).newbyteorder("<")
  limit = np.iinfo(dtype).max
  count = 0
  fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      def sink(ids: np.ndarray) -> None:
        nonlocal count
        if ids.size and ids.max() >= limit:
          raise ValueError(f"token id {int(ids.max())} does not fit {dtype.name}")
        f.write(ids.astype(dtype).tobytes())
        count += ids.size
      stream = text_stream.StreamTokenizer(tokenizer, eos, sink)
      if kind == "jsonl":
        text_stream.jsonl_file(path, text_field, stream)
      else:
        text_stream.text_file(path, stream)
      stream.finish()
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return count


def load_ids(path: Path, dtype: np.dtype) -> np.ndarray:
  """Memory-maps raw little-endian ids written by `tokenize_file`."""
  dtype = np.dtype(dtype).newbyteorder("<")
  if path.stat().st_size == 0:
    return np.zeros((0,), dtype)
  return np.memmap(path, dtype=dtype, mode="r")


def text_tokens(patterns: Sequence[str], tokenizer_path: str, kind: str, text_field: str,
                cache: str | os.PathLike, log=print):
  """Text (`kind="text"`) or JSON-lines (`kind="jsonl"`, strings under `text_field`) files tokenized
  with a local tokenizer, one cached id file per input file. Returns (arrays, names, tokenizer)."""
  files = expand_paths(patterns)
  tokenizer = load_tokenizer(tokenizer_path)
  tok_hash = tokenizer_hash(tokenizer_path)
  eos = eos_id(tokenizer)
  dtype = token_dtype(tokenizer.get_vocab_size())
  directory = cache_dir(cache)
  arrays, names = [], []
  for f in files:
    st = f.stat()
    key = hashlib.sha256(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|{kind}|{text_field}|{tok_hash}".encode()).hexdigest()[:20]
    ids_path = directory / f"text-{key}.ids.{np.dtype(dtype).name}"
    if not ids_path.is_file():
      log(f"[data] tokenizing {f}")
      tokenize_file(f, kind, text_field, tokenizer, eos, dtype, ids_path)
    arrays.append(load_ids(ids_path, dtype))
    names.append(str(f))
  return arrays, names, tokenizer
