"""Typed dataclasses from mappings, YAML files and `--set key=value` overrides (schema-agnostic).

`build(cls, raw)` makes dataclass `cls` from a nested mapping, checking every key against the
fields and every value against the field's annotation (bool, int, float, str, lists, optionals,
nested dataclasses); ints widen to floats. `load(cls, path, overrides, validate)` reads a YAML file,
applies overrides one by one and names the source of any error: the file, or the override.

YAML numbers: PyYAML follows YAML 1.1, where `1e-3` (no dot) is a string. `YamlLoader` adds a
YAML 1.2-style float resolver, so `lr: 1e-3` in a file and `--set optimizer.lr=1e-3` both give
0.001.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Callable, TypeVar

import yaml

T = TypeVar("T")

_FLOAT = re.compile(r"""^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?$
                        |^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$""", re.X)


class YamlLoader(yaml.SafeLoader):
  """SafeLoader that also reads `1e-3`, `5E+2`, `.5` as floats (YAML 1.2 numbers)."""


# Ints still resolve first (PyYAML tries resolvers in order and the int one was added earlier).
YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def parse_yaml(text: str) -> Any:
  return yaml.load(text, Loader=YamlLoader)  # noqa: S506 (a SafeLoader subclass)


def suggest(name: str, choices) -> str:
  """' (did you mean ...?)' for close matches of `name` among `choices`, or ''."""
  close = difflib.get_close_matches(name, [str(c) for c in choices], n=3, cutoff=0.5)
  return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


def _unknown_key(key: str, where: str, choices) -> ValueError:
  under = f"under {where.rstrip('.')!r}" if where else "at the top level"
  return ValueError(f"unknown config key {where + key!r}{suggest(key, choices)}; valid keys "
                    f"{under}: {', '.join(sorted(choices)) or 'none'}")


def check_value(value: Any, annotation: Any, key: str) -> Any:
  """Checks `value` against a field's type annotation and returns it (ints widen to floats)."""
  origin = typing.get_origin(annotation)
  if origin in (typing.Union, types.UnionType):
    options = [o for o in typing.get_args(annotation) if o is not type(None)]
    if value is None and len(options) < len(typing.get_args(annotation)):
      return None
    errors = []
    for option in options:
      try:
        return check_value(value, option, key)
      except ValueError as e:
        errors.append(str(e))
    raise ValueError(errors[0] if errors else f"config key {key!r}: bad value {value!r}")
  if origin is list:
    (item_type,) = typing.get_args(annotation)
    if isinstance(value, str):  # a single path given where a list is expected
      value = [value]
    if not isinstance(value, (list, tuple)):
      raise ValueError(f"config key {key!r} must be a list, got {type(value).__name__} {value!r}")
    return [check_value(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
  checks = {bool: (lambda v: isinstance(v, bool), "a bool (true/false)"),
            int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an int"),
            float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
            str: (lambda v: isinstance(v, str), "a string")}
  if annotation not in checks:
    raise TypeError(f"unsupported annotation {annotation!r} for {key!r}")
  ok, what = checks[annotation]
  if not ok(value):
    raise ValueError(f"config key {key!r} must be {what}, got {type(value).__name__} {value!r}")
  return float(value) if annotation is float else value


def build(cls: type[T], raw: Any, where: str = "") -> T:
  """Builds dataclass `cls` from a mapping, rejecting unknown keys and wrong types."""
  if raw is None:
    raw = {}
  if not isinstance(raw, dict):
    raise ValueError(f"config section {where.rstrip('.') or 'top level'!r} must be a mapping, "
                     f"got {type(raw).__name__} {raw!r}")
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls)]
  kwargs = {}
  for key, value in raw.items():
    if not isinstance(key, str) or key not in names:
      raise _unknown_key(str(key), where, names)
    if dataclasses.is_dataclass(hints[key]):
      kwargs[key] = build(hints[key], value, f"{where}{key}.")
    else:
      kwargs[key] = check_value(value, hints[key], where + key)
  return cls(**kwargs)


def parse_override_value(text: str) -> Any:
  """A `--set` value read as YAML (3e-4 -> float, true -> bool, [a, b] -> list); else the text."""
  try:
    return parse_yaml(text)
  except yaml.YAMLError:
    return text


def apply_override(cls: type, raw: dict[str, Any], item: str) -> dict[str, Any]:
  """A copy of mapping `raw` with one `section.key=value` applied; the key and the value's type are
  checked against the schema `cls` here (a typo fails even where the file has no such section)."""
  if not isinstance(item, str) or "=" not in item:
    raise ValueError(f"expected key=value, got {item!r}")
  dotted, text = item.split("=", 1)
  parts = dotted.strip().split(".")
  raw = copy.deepcopy(raw)
  node, where = raw, ""
  for i, part in enumerate(parts):
    hints = typing.get_type_hints(cls)
    if part not in hints or part not in {f.name for f in dataclasses.fields(cls)}:
      raise _unknown_key(part, where, [f.name for f in dataclasses.fields(cls)])
    annotation, last = hints[part], i == len(parts) - 1
    if dataclasses.is_dataclass(annotation):
      if last:
        raise ValueError(f"{dotted!r} names a section; set one of its keys, e.g. "
                         f"{dotted}.{dataclasses.fields(annotation)[0].name}=...")
      if not isinstance(node.get(part), dict):
        node[part] = {}
      node, cls, where = node[part], annotation, f"{where}{part}."
    elif not last:
      raise _unknown_key(".".join(parts[i + 1:]), f"{where}{part}.", [])
    else:
      node[part] = check_value(parse_override_value(text), annotation, where + part)
  return raw


def load_yaml(path: str | Path) -> dict[str, Any]:
  """Reads a YAML config file into a mapping; errors name the file."""
  path = Path(path)
  if not path.is_file():
    raise ValueError(f"config file not found: {path}")
  try:
    raw = parse_yaml(path.read_bytes().decode("utf-8"))
  except (yaml.YAMLError, UnicodeDecodeError) as e:
    first = " ".join(str(e).split())
    raise ValueError(f"config file {path} is not valid YAML: {first}") from e
  if raw is None:
    return {}
  if not isinstance(raw, dict):
    raise ValueError(f"config file {path} must hold a mapping at the top level, got {type(raw).__name__}")
  return raw


def load(cls: type[T], path: str | Path | None, overrides, validate: Callable[[T], T],
         raw: dict[str, Any] | None = None) -> T:
  """`cls` from a YAML file (defaults when None) plus `--set` overrides, checked by `validate`.

  A value error that appears when an override is applied (and not before) names that override;
  one already present in the file names the file (unless a later override fixes it). `raw`: the
  file's mapping when the caller has read it already (`load_yaml(path)`), so it is read once.
  """
  source = f"config file {path}" if path is not None else "the default config"
  if raw is None:
    raw = load_yaml(path) if path is not None else {}
  try:
    cfg = build(cls, raw)
  except ValueError as e:
    raise ValueError(f"{source}: {e}") from None

  def check(cfg) -> str | None:
    try:
      validate(cfg)
    except ValueError as e:
      return str(e)
    return None

  error, blame = check(cfg), source
  for item in overrides:
    shown = item if isinstance(item, str) and item.isprintable() else repr(item)
    try:
      raw = apply_override(cls, raw, item)
      cfg = build(cls, raw)
    except ValueError as e:
      raise ValueError(f"--set {shown}: {e}") from None
    now = check(cfg)
    if now is not None and error is None:
      blame = f"--set {shown}"
    error = now
  if error is not None:
    raise ValueError(f"{blame}: {error}")
  return cfg
