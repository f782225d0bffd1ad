"""Typed dataclasses from mappings, YAML files and `--set key=value` overrides (schema-agnostic).

`build(cls, raw)` makes dataclass `cls` from a nested mapping, checking every key against the
fields and every value against the field's annotation (bool, int, float, str, lists, optionals,
nested dataclasses); ints widen to floats. `load(cls, path, overrides, validate)` reads a YAML file,
applies overrides one by one and names the source of any error: the file, or the override.

YAML files are read by the YAML 1.2 core schema (PyYAML alone follows YAML 1.1): `1e-3` is a
float, `010` is ten (not octal eight), `1:30` and `yes` are strings, `0o10`/`0x10` are octal/hex.
A key given twice in one mapping and aliases (`*name`, which can expand without bound) are errors.

`--set` values are read by the type of their key (`parse_typed`): a string key takes the text as
given (`#` included; surrounding quotes removed), numbers and bools the YAML 1.2 core forms.
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

_NULL = re.compile(r"^(?:~|null|Null|NULL|)$")
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT = re.compile(r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
                        |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X)


def _to_int(text: str) -> int:
  if text.startswith(("0o", "0x")):
    return int(text[2:], 8 if text[1] == "o" else 16)
  return int(text, 10)   # leading zeros are decimal: 010 is 10


def _to_float(text: str) -> float:
  lowered = text.lower()
  if lowered.endswith(".inf"):
    return float("-inf") if lowered.startswith("-") else float("inf")
  if lowered == ".nan":
    return float("nan")
  return float(text)


class YamlLoader(yaml.SafeLoader):
  """SafeLoader with the YAML 1.2 core schema's scalars (null, true/false, ints, floats; all else a
  string), no duplicate keys and no aliases."""

  yaml_implicit_resolvers: dict = {}

  def compose_node(self, parent, index):
    if self.check_event(yaml.AliasEvent):
      raise yaml.composer.ComposerError(
          None, None, "YAML aliases (*name) are not allowed in a run config",
          self.peek_event().start_mark)
    return super().compose_node(parent, index)

  def construct_mapping(self, node, deep=False):
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
      key = self.construct_object(key_node, deep=True)
      if isinstance(key, typing.Hashable) and key in seen:
        raise yaml.constructor.ConstructorError(
            None, None, f"key {key!r} appears twice (lines {seen[key] + 1} and "
            f"{key_node.start_mark.line + 1})", key_node.start_mark)
      if isinstance(key, typing.Hashable):
        seen[key] = key_node.start_mark.line
    return super().construct_mapping(node, deep)


class YamlDumper(yaml.SafeDumper):
  """SafeDumper that quotes every string `YamlLoader` would read as something else."""

  yaml_implicit_resolvers: dict = {}


for _cls in (YamlLoader, YamlDumper):
  _cls.add_implicit_resolver("tag:yaml.org,2002:null", _NULL, ["~", "n", "N", ""])
  _cls.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL, list("tTfF"))
  _cls.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))
  _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
YamlLoader.add_constructor("tag:yaml.org,2002:int",
                           lambda loader, node: _to_int(loader.construct_scalar(node)))
YamlLoader.add_constructor("tag:yaml.org,2002:float",
                           lambda loader, node: _to_float(loader.construct_scalar(node)))


def parse_yaml(text: str) -> Any:
  return yaml.load(text, Loader=YamlLoader)  # noqa: S506 (a SafeLoader subclass)


def dump_yaml(data: Any) -> str:
  """`data` as YAML that `parse_yaml` reads back to the same values."""
  return yaml.dump(data, Dumper=YamlDumper, sort_keys=False)


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


def _unquote(text: str) -> str:
  if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
    return text[1:-1]
  return text


def parse_typed(text: str, annotation: Any, key: str) -> Any:
  """A `--set` value read by its key's type annotation (YAML 1.2 core forms, nothing else):

  str: the text as given (`#`, `:` and digits included), a pair of surrounding quotes removed;
  int: decimal digits (`010` is ten), `0o17` octal, `0x1f` hex; float: `3e-4`, `.5`, `.inf`;
  bool: true/false; an optional key: also `null` or `~`; a list: `[a, b]` (items read by the
  item type) or one item. Raises ValueError naming the key.
  """
  origin = typing.get_origin(annotation)
  if origin in (typing.Union, types.UnionType):
    args = typing.get_args(annotation)
    if type(None) in args and _NULL.match(text.strip()):
      return None
    options = sorted((o for o in args if o is not type(None)), key=lambda o: o is str)
    errors = []
    for option in options:
      try:
        return parse_typed(text, option, key)
      except ValueError as e:
        errors.append(e)
    raise errors[0]
  if origin is list:
    (item_type,) = typing.get_args(annotation)
    if not text.strip().startswith("["):
      return [parse_typed(text, item_type, f"{key}[0]")]
    try:
      items = yaml.load(text, Loader=yaml.BaseLoader)  # noqa: S506 (structure only, all strings)
    except yaml.YAMLError as e:
      raise ValueError(f"config key {key!r}: not a list ({' '.join(str(e).split())})") from None
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
      raise ValueError(f"config key {key!r} must be a list like [a, b], got {text!r}")
    return [parse_typed(i, item_type, f"{key}[{n}]") for n, i in enumerate(items)]
  value = text.strip()
  if annotation is str:
    return _unquote(text)
  if annotation is bool and _BOOL.match(value):
    return value.lower() == "true"
  if annotation is int and _INT.match(value):
    return _to_int(value)
  if annotation is float and (_INT.match(value) or _FLOAT.match(value)):
    return float(_to_int(value)) if _INT.match(value) else _to_float(value)
  what = {bool: "a bool (true/false)", int: "an int", float: "a number"}.get(annotation)
  if what is None:
    raise TypeError(f"unsupported annotation {annotation!r} for {key!r}")
  raise ValueError(f"config key {key!r} must be {what}, got {text!r}")


def apply_override(cls: type, raw: dict[str, Any], item: str | tuple[str, Any]) -> dict[str, Any]:
  """A copy of mapping `raw` with one `section.key=value` applied; the key and the value's type are
  checked against the schema `cls` here (a typo fails even where the file has no such section).
  `item` is a `--set` string (its value read by `parse_typed`) or a (dotted key, value) pair
  whose value is taken as it is (e.g. a path from `--out-dir`)."""
  if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
    dotted, literal = item
  elif isinstance(item, str) and "=" in item:
    dotted, text = item.split("=", 1)
    literal = None
  else:
    raise ValueError(f"expected key=value, got {item!r}")
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
      value = literal if literal is not None else parse_typed(text, annotation, where + part)
      node[part] = check_value(value, annotation, where + part)
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
    if isinstance(item, tuple) and len(item) == 2:
      item_text = f"{item[0]}={item[1]}"
    else:
      item_text = item
    shown = item_text if isinstance(item_text, str) and item_text.isprintable() else repr(item_text)
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
