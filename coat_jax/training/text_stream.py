"""Text and JSON-lines files tokenized in bounded pieces: memory independent of file and line size.

A file is read `READ_BYTES` at a time and decoded as strict UTF-8; documents (a text file, a
jsonl record's field) go to the tokenizer in pieces of at most `PIECE_CHARS` characters, about
`BATCH_CHARS` per `encode_batch` call, and the ids go straight to a file. A long document is cut
after a newline that a non-space follows (else after a space, else anywhere): at a cut the ids may
differ from tokenizing the whole document at once (a tokenizer that marks the start of its input,
e.g. with a prepended space, marks each piece).

JSON lines up to `LONG_LINE_BYTES` are parsed with `json`; a longer line is scanned in pieces
(`_LongRecord`): the field's string is decoded as it streams, the other values are skipped with
their structure checked. Every error names the file and line: invalid UTF-8, invalid JSON, a
missing or non-string field, a lone surrogate escape (`"\\ud800"`, which is not text).
"""
from __future__ import annotations

import codecs
import json
import re
from pathlib import Path
from typing import BinaryIO, Callable

import numpy as np

from coat_jax.errors import BadInputError

READ_BYTES = 1 << 20
PIECE_CHARS = 1 << 16
BATCH_CHARS = 1 << 18
LONG_LINE_BYTES = 1 << 22
MAX_DEPTH = 200


class StreamTokenizer:
  """Tokenizes documents given piece by piece; `sink(ids)` gets int64 id arrays in order, `eos`
  (when not None) after each document."""

  def __init__(self, tokenizer, eos: int | None, sink: Callable[[np.ndarray], None]):
    self.tokenizer, self.eos, self.sink = tokenizer, eos, sink
    self._queue: list[tuple[str, bool]] = []   # (text, ends a document)
    self._queued = 0
    self._current = ""

  def add(self, text: str) -> None:
    self._current += text
    while len(self._current) > PIECE_CHARS:
      cut = _cut(self._current, PIECE_CHARS)
      self._enqueue(self._current[:cut], False)
      self._current = self._current[cut:]

  def end_document(self) -> None:
    self._enqueue(self._current, True)
    self._current = ""

  def finish(self) -> None:
    if self._current:
      self.end_document()
    self._flush()

  def _enqueue(self, text: str, ends: bool) -> None:
    self._queue.append((text, ends))
    self._queued += len(text) + 1
    if self._queued >= BATCH_CHARS:
      self._flush()

  def _flush(self) -> None:
    if not self._queue:
      return
    encodings = self.tokenizer.encode_batch([t for t, _ in self._queue], add_special_tokens=False)
    for enc, (_, ends) in zip(encodings, self._queue):
      ids = np.asarray(enc.ids, np.int64)
      if ends and self.eos is not None:
        ids = np.append(ids, self.eos)
      self.sink(ids)
    self._queue, self._queued = [], 0


def _cut(text: str, limit: int) -> int:
  """Where to cut `text` near `limit`: after a newline a non-space follows, else after a space
  a non-space follows (tokenizers split words there anyway), else at `limit`."""
  for sep in ("\n", " "):
    i = text.rfind(sep, limit // 2, limit)
    while i != -1:
      if not text[i + 1].isspace():
        return i + 1
      i = text.rfind(sep, limit // 2, i)
  return limit


def text_file(path: Path, stream: StreamTokenizer) -> None:
  """A text file as one document (strict UTF-8; an error names the line and byte offset)."""
  decoder = codecs.getincrementaldecoder("utf-8")("strict")
  line, offset = 1, 0
  with open(path, "rb") as f:
    while True:
      chunk = f.read(READ_BYTES)
      pending = decoder.getstate()[0]
      try:
        text = decoder.decode(chunk, final=not chunk)
      except UnicodeDecodeError as e:
        where = offset - len(pending) + e.start
        line += e.object[:e.start].count(b"\n")
        raise BadInputError(f"{path}:{line}: invalid UTF-8 (byte 0x{e.object[e.start]:02x} at "
                            f"offset {where}); data.kind=text reads UTF-8 text") from None
      if not chunk:
        break
      stream.add(text)
      line += chunk.count(b"\n")
      offset += len(chunk)
  stream.end_document()


def _field_text(record, path: Path, lineno: int, field: str) -> str:
  if not isinstance(record, dict) or field not in record:
    raise BadInputError(f"{path}:{lineno}: record has no {field!r} field")
  text = record[field]
  if not isinstance(text, str):
    raise BadInputError(f"{path}:{lineno}: field {field!r} is {type(text).__name__}, not a string")
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise BadInputError(f"{path}:{lineno}: field {field!r} holds a lone surrogate escape "
                        f"(\\u{ord(text[e.start]):04x}), which is not text") from None
  return text


def jsonl_file(path: Path, field: str, stream: StreamTokenizer) -> int:
  """The `field` strings of a JSON-lines file as documents; returns how many."""
  count = 0
  with open(path, "rb") as f:
    lineno = 0
    while True:
      line = f.readline(LONG_LINE_BYTES)
      if not line:
        return count
      lineno += 1
      if len(line) == LONG_LINE_BYTES and not line.endswith(b"\n"):
        _LongRecord(f, line, path, lineno).read(field, stream)
      elif line.strip():
        try:
          record = json.loads(line)
        except UnicodeDecodeError as e:
          raise BadInputError(f"{path}:{lineno}: invalid UTF-8 (byte 0x{e.object[e.start]:02x} "
                              f"at byte {e.start} of the line)") from None
        except json.JSONDecodeError as e:
          raise BadInputError(f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno})"
                              ) from None
        except RecursionError:
          raise BadInputError(f"{path}:{lineno}: not valid JSON (nested too deeply)") from None
        stream.add(_field_text(record, path, lineno, field))
        stream.end_document()
      else:
        continue
      count += 1


_STRING_STOP = re.compile(rb'["\\\x00-\x1f]')
_SCALAR = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|true|false|null")
_ESCAPES = {ord('"'): '"', ord("\\"): "\\", ord("/"): "/", ord("b"): "\b", ord("f"): "\f",
            ord("n"): "\n", ord("r"): "\r", ord("t"): "\t"}


class _LongRecord:
  """One JSON line longer than LONG_LINE_BYTES, read in pieces of READ_BYTES."""

  def __init__(self, f: BinaryIO, first: bytes, path: Path, lineno: int):
    self.f, self.buf, self.pos, self.before = f, first, 0, 0
    self.done = first.endswith(b"\n")
    self.where = f"{path}:{lineno}"

  def error(self, what: str) -> BadInputError:
    return BadInputError(f"{self.where}: not valid JSON ({what} at byte {self.before + self.pos} "
                         f"of the line)")

  def _more(self) -> bool:
    if self.done:
      return False
    piece = self.f.readline(READ_BYTES)
    self.done = not piece or piece.endswith(b"\n")
    self.before += self.pos
    self.buf, self.pos = self.buf[self.pos:] + piece, 0
    return bool(piece)

  def _ensure(self, n: int) -> None:
    while len(self.buf) - self.pos < n and self._more():
      pass

  def _peek(self) -> int | None:
    self._ensure(1)
    return self.buf[self.pos] if self.pos < len(self.buf) else None

  def _skip_space(self) -> int | None:
    while (c := self._peek()) is not None and c in b" \t\r\n":
      self.pos += 1
    return c

  def _take(self, char: bytes) -> None:
    if self._skip_space() != char[0]:
      raise self.error(f"expected {char.decode()!r}")
    self.pos += 1

  def _string(self, out: Callable[[str], None] | None) -> None:
    """The rest of a string (after its opening quote), decoded text passed to `out`."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")

    def emit(raw: bytes, final: bool = False) -> None:
      if out is None:
        return
      try:
        text = decoder.decode(raw, final=final)
      except UnicodeDecodeError:
        raise BadInputError(f"{self.where}: invalid UTF-8 in a string near byte "
                            f"{self.before + self.pos} of the line") from None
      if text:
        out(text)

    while True:
      m = _STRING_STOP.search(self.buf, self.pos)
      if m is None:
        emit(self.buf[self.pos:])
        self.pos = len(self.buf)
        if not self._more():
          raise self.error("unterminated string")
        continue
      emit(self.buf[self.pos:m.start()], final=True)
      self.pos = m.start()
      c = self.buf[self.pos]
      if c == ord('"'):
        self.pos += 1
        return
      if c < 0x20:
        raise self.error("control character in a string")
      self._ensure(12)
      kind = self.buf[self.pos + 1] if self.pos + 1 < len(self.buf) else None
      if kind in _ESCAPES:
        self.pos += 2
        if out is not None:
          out(_ESCAPES[kind])
        continue
      if kind != ord("u"):
        raise self.error("invalid escape")
      code = self._hex(self.pos + 2)
      self.pos += 6
      if 0xD800 <= code < 0xDC00 and self.buf[self.pos:self.pos + 2] == b"\\u":
        low = self._hex(self.pos + 2)
        if 0xDC00 <= low < 0xE000:
          code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
          self.pos += 6
      if 0xD800 <= code < 0xE000:
        raise BadInputError(f"{self.where}: a lone surrogate escape (\\u{code:04x}), which is "
                            f"not text")
      if out is not None:
        out(chr(code))

  def _hex(self, at: int) -> int:
    digits = self.buf[at:at + 4]
    if len(digits) < 4 or not re.fullmatch(rb"[0-9a-fA-F]{4}", digits):
      raise self.error("invalid \\u escape")
    return int(digits, 16)

  def _skip_value(self, depth: int) -> None:
    c = self._skip_space()
    if c == ord('"'):
      self.pos += 1
      return self._string(None)
    if c in (ord("{"), ord("[")):
      if depth > MAX_DEPTH:
        raise self.error("nested too deeply")
      close = ord("}") if c == ord("{") else ord("]")
      self.pos += 1
      if self._skip_space() == close:
        self.pos += 1
        return None
      while True:
        if close == ord("}"):
          self._take(b'"')
          self._string(None)
          self._take(b":")
        self._skip_value(depth + 1)
        after = self._skip_space()
        self.pos += 1
        if after == close:
          return None
        if after != ord(","):
          raise self.error("expected ',' or a closing bracket")
    self._ensure(4096)
    m = _SCALAR.match(self.buf, self.pos)
    if m is None:
      raise self.error("expected a value")
    self.pos = m.end()
    return None

  def read(self, field: str, stream: StreamTokenizer) -> None:
    self._take(b"{")
    found = False
    if self._skip_space() == ord("}"):
      self.pos += 1
    else:
      while True:
        self._take(b'"')
        key: list[str] = []
        self._string(key.append)
        self._take(b":")
        if "".join(key) == field:
          if found:
            raise BadInputError(f"{self.where}: field {field!r} appears twice")
          if self._skip_space() != ord('"'):
            raise BadInputError(f"{self.where}: field {field!r} is not a string")
          self.pos += 1
          self._string(stream.add)
          found = True
        else:
          self._skip_value(1)
        after = self._skip_space()
        self.pos += 1
        if after == ord("}"):
          break
        if after != ord(","):
          raise self.error("expected ',' or '}'")
    if self._skip_space() is not None:
      raise self.error("extra data after the record")
    if not found:
      raise BadInputError(f"{self.where}: record has no {field!r} field")
    stream.end_document()
