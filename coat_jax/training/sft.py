"""Supervised fine-tuning data (`data.kind: sft`): examples tokenized, masked and packed into rows.

Records, one JSON object per line of each file:

  {"prompt": "...", "response": "..."}
      tokens: prompt, response, <eos>; the loss counts the response and <eos>.
  {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
      each turn rendered as text, in order:
        system, user:  "<|ROLE|>\\n" + content + "\\n"      (not counted)
        assistant:     "<|assistant|>\\n" (not counted), content, <eos> (counted)

<eos> is the tokenizer's end-of-text token (`data.eos_id` when set). The role markers are plain
text to the tokenizer (no special tokens needed); generation from a model tuned on chats is
prompted with the same text, ending in "<|assistant|>\\n".

Packing: examples, in file order, fill rows of seq_len + 1 tokens; one that does not fit the
room left in a row starts the next row (the rest is padding), one longer than a row is cut to
it (counted in the log line). Each row has
  tokens       (seq_len + 1,) int32
  segment_ids  (seq_len + 1,) int32: 1, 2, ... per example in the row, 0 for padding
  loss_mask    (seq_len + 1,) int32: 1 where the token is a target the loss counts
and the training step predicts tokens[1:] from tokens[:-1] where loss_mask[1:] is 1 and both
tokens are in one example (`coat_jax.training.build.batch_loss`). Batches of rows follow
dataset.py's rule (a pure function of (seed, step)); the last `eval_fraction` rows are held out.
The packed rows are cached per file set (keyed by the files' paths, sizes and times, the
tokenizer and seq_len).
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from coat_jax.training.corpus import atomic_write_bytes, cache_dir, eos_id, load_tokenizer
from coat_jax.training.dataset import eval_rows, train_rows
from coat_jax.training.token_files import expand_paths

CHAT_ROLES = ("system", "user", "assistant")
FIELDS = ("tokens", "segment_ids", "loss_mask")


def _pieces(record, where: str) -> list[tuple[str, int, bool]]:
  """[(text, counted, then eos)] of one record (module docstring)."""
  if not isinstance(record, dict):
    raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
  if "messages" in record:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
      raise ValueError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
      if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(
          m.get("content"), str):
        raise ValueError(f"{where}: messages[{i}] must be {{'role': one of {CHAT_ROLES}, "
                         f"'content': a string}}, got {m!r}"[:300])
      if m["role"] == "assistant":
        out += [("<|assistant|>\n", 0, False), (m["content"], 1, True)]
      else:
        out.append((f"<|{m['role']}|>\n{m['content']}\n", 0, False))
    if not any(counted for _, counted, _ in out):
      raise ValueError(f"{where}: the chat has no assistant message (nothing to learn)")
    return out
  for key in ("prompt", "response"):
    if not isinstance(record.get(key), str):
      raise ValueError(f"{where}: a record needs string fields 'prompt' and 'response' (or "
                       f"'messages'); {key!r} is {type(record.get(key)).__name__}")
  return [(record["prompt"], 0, False), (record["response"], 1, True)]


def read_examples(path: Path, tokenizer, eos: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """(token ids, loss mask) of every record of a JSON-lines file; errors name file and line."""
  records = []
  with open(path, "rb") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        records.append((f"{path}:{lineno}", json.loads(line)))
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
  pieces = [_pieces(r, where) for where, r in records]
  texts = [text for p in pieces for text, _, _ in p]
  encoded = iter(tokenizer.encode_batch(texts, add_special_tokens=False)) if texts else iter(())
  out = []
  for p in pieces:
    ids, mask = [], []
    for _, counted, then_eos in p:
      piece = next(encoded).ids
      ids += piece + ([eos] if then_eos else [])
      mask += [counted] * (len(piece) + then_eos)
    out.append((np.asarray(ids, np.int64), np.asarray(mask, np.int32)))
  return out


def pack(examples: Sequence[tuple[np.ndarray, np.ndarray]], span: int
         ) -> tuple[dict[str, np.ndarray], int]:
  """Rows of `span` tokens (module docstring) and the number of examples cut to fit."""
  rows, row, cut = [], [], 0
  used = 0
  for ids, mask in examples:
    if len(ids) > span:
      ids, mask, cut = ids[:span], mask[:span], cut + 1
    if used + len(ids) > span:
      rows.append(row)
      row, used = [], 0
    row.append((ids, mask))
    used += len(ids)
  if row:
    rows.append(row)
  out = {k: np.zeros((len(rows), span), np.int32) for k in FIELDS}
  for r, row in enumerate(rows):
    start = 0
    for seg, (ids, mask) in enumerate(row, 1):
      end = start + len(ids)
      out["tokens"][r, start:end] = ids
      out["segment_ids"][r, start:end] = seg
      out["loss_mask"][r, start:end] = mask
      start = end
  return out, cut


def sft_rows(patterns: Sequence[str], tokenizer_path: str, seq_len: int, eos_override: int,
             cache: str | os.PathLike, log=print):
  """(rows, files, tokenizer): the packed rows of every file (cached), the files, the tokenizer."""
  files = expand_paths(patterns)
  tokenizer = load_tokenizer(tokenizer_path)
  eos = eos_override if eos_override >= 0 else eos_id(tokenizer)
  if eos is None:
    raise ValueError(f"the tokenizer {tokenizer_path} has no end-of-text token: set "
                     f"data.eos_id to the id that ends a response")
  h = hashlib.sha256(f"sft-v1|{seq_len}|{eos}|{tokenizer.to_str()}".encode())
  for f in files:
    st = f.stat()
    h.update(f"|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
  path = cache_dir(cache) / f"sft-{h.hexdigest()[:20]}.npz"
  if path.is_file():
    with np.load(path) as z:
      return {k: z[k] for k in FIELDS}, files, tokenizer
  examples = [e for f in files for e in read_examples(f, tokenizer, eos)]
  if not examples:
    raise ValueError(f"no examples in {', '.join(map(str, files))}")
  rows, cut = pack(examples, seq_len + 1)
  counted = int(rows["loss_mask"].sum())
  log(f"[data] {len(examples)} sft examples packed into {len(rows['tokens'])} rows of "
      f"{seq_len + 1} tokens ({counted:,} target tokens"
      f"{f'; {cut} examples longer than a row were cut' if cut else ''}); cached at {path}")
  buffer = io.BytesIO()
  np.savez(buffer, **rows)
  atomic_write_bytes(path, buffer.getvalue())
  return rows, files, tokenizer


@dataclasses.dataclass
class PackedDataset:
  """Packed rows (`FIELDS`, each (rows, seq_len + 1)) with TokenDataset's batching interface;
  a batch is a dict of the three (batch_size, seq_len + 1) int32 arrays."""
  rows: dict[str, np.ndarray]
  names: list[str]
  seq_len: int
  batch_size: int
  seed: int
  eval_fraction: float
  vocab_size: int | None = None
  description: str = ""
  tokenizer: object = None

  def __post_init__(self):
    total = int(self.rows["tokens"].shape[0])
    n_eval = math.ceil(total * self.eval_fraction) if self.eval_fraction > 0 else 0
    if n_eval >= total:
      raise ValueError(f"the sft data packs into only {total} rows of {self.seq_len + 1} tokens: "
                       f"too few to hold out data.eval_fraction={self.eval_fraction} and train")
    self.n_train, self.n_eval = total - n_eval, n_eval

  @property
  def num_tokens(self) -> int:
    return int((self.rows["segment_ids"] > 0).sum())

  def check_vocab(self, vocab_size: int) -> None:
    top = int(self.rows["tokens"].max())
    if top >= vocab_size:
      raise ValueError(f"token id {top} in {', '.join(self.names)} is out of range for the "
                       f"model's vocab_size={vocab_size}")

  def _take(self, index: np.ndarray) -> dict[str, np.ndarray]:
    return {k: self.rows[k][index] for k in FIELDS}

  def train_batch(self, step: int) -> dict[str, np.ndarray]:
    return self._take(train_rows(step, self.batch_size, self.n_train, self.seed))

  def eval_batches(self, num_batches: int) -> list[dict[str, np.ndarray]]:
    if self.n_eval == 0 or num_batches == 0:
      return []
    rows = self._take(eval_rows(num_batches, self.batch_size, self.n_train, self.n_eval))
    return [{f: rows[f][i * self.batch_size:(i + 1) * self.batch_size] for f in FIELDS}
            for i in range(num_batches)]

  def epoch_of(self, step: int) -> float:
    return step * self.batch_size / self.n_train


def sft_dataset(patterns, tokenizer_path, *, seq_len, batch_size, seed, eval_fraction,
                eos_override=-1, cache="~/.cache/coat_jax", log=print) -> PackedDataset:
  rows, files, tokenizer = sft_rows(patterns, tokenizer_path, seq_len, eos_override, cache, log)
  return PackedDataset(rows, [str(f) for f in files], seq_len, batch_size, seed, eval_fraction,
                       vocab_size=tokenizer.get_vocab_size(), tokenizer=tokenizer,
                       description=f"{len(files)} sft files, tokenizer {tokenizer_path}")
