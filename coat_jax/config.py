"""Run configuration: typed dataclasses, YAML loading and `--set key=value` overrides.

A run config has seven sections:

  model:      preset name (`LlamaConfig.from_name`) plus optional shape overrides
  precision:  "bf16" | "fp8_linear" | "coat" (the model's precision mode; independent of the optimizer)
  optimizer:  "adamw" | "coat_adamw" with its hyper-parameters and schedule
  data:       where tokens come from, sequence length, batch size, eval split
  mesh:       device mesh sizes ("data", "fsdp", "tensor"; -1 = fill with the remaining devices)
  checkpoint: directory, period, how many to keep, async saving
  run:        steps, seed, logging/eval periods, output directory

Unknown keys and values of the wrong type are rejected with a ValueError that names the key
(and suggests close matches), both in YAML files and in `--set` overrides.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

PRECISIONS = ("bf16", "fp8_linear", "coat")
OPTIMIZERS = ("adamw", "coat_adamw")
SCHEDULES = ("cosine", "constant", "linear")
DATA_KINDS = ("stdlib", "tokens", "text", "jsonl")
TOKEN_DTYPES = ("uint16", "uint32")
FP8_STATE_FORMATS = ("e4m3", "e5m2", "int8")


@dataclasses.dataclass
class ModelConfig:
  """Model shape: a `LlamaConfig` preset plus overrides (None keeps the preset's value).

  `vocab_size=None` takes the data's tokenizer vocabulary when the data has one (stdlib, text,
  jsonl) and the preset's otherwise (pre-tokenized files). `dtype` is the compute dtype
  ("bfloat16" | "float32" | "auto": bfloat16 on accelerators, float32 on CPU, where bfloat16
  matmuls are slow); parameters are kept in `param_dtype` (float32 by default). `remat` is a
  policy name ("none", "full", "dots", "dots_saveable") or a bool.
  """
  preset: str = "tiny"
  vocab_size: int | None = None
  hidden_size: int | None = None
  intermediate_size: int | None = None
  num_layers: int | None = None
  num_heads: int | None = None
  num_kv_heads: int | None = None
  head_dim: int | None = None
  max_seq_len: int | None = None
  rope_theta: float | None = None
  rms_eps: float | None = None
  tie_embeddings: bool | None = None
  dtype: str | None = None
  param_dtype: str | None = None
  remat: bool | str | None = None
  attention_impl: str | None = None
  init_std: float | None = None

  def overrides(self) -> dict[str, Any]:
    """The fields set away from the preset, as `LlamaConfig.from_name` keyword arguments."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name != "preset" and getattr(self, f.name) is not None}


@dataclasses.dataclass
class OptimizerConfig:
  """AdamW-family optimizer, warmup + decay schedule, global-norm clipping.

  `m_format`/`v_format`/`group_size`/`expand`/`expand_min`/`min_quantized_size` are used by
  "coat_adamw" only (params with fewer elements than `min_quantized_size` keep float32 moments;
  expansion exponents are multiples of 1/`expand_min`).
  `decay_1d=False` leaves 1-D parameters (norm scales, biases) out of weight decay.
  """
  name: str = "adamw"
  lr: float = 3e-3
  warmup: int = 20
  schedule: str = "cosine"
  min_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  decay_1d: bool = False
  clip: float = 1.0
  m_format: str = "e4m3"
  v_format: str = "e4m3"
  group_size: int = 128
  expand: bool = True
  expand_min: int = 16
  min_quantized_size: int = 4096


@dataclasses.dataclass
class DataConfig:
  """Token source and batching.

  kind:
    "stdlib": the offline default; the Python standard library's .py sources (sorted, capped at
      `corpus_max_bytes`), a byte-level BPE of `vocab_size` trained locally and cached.
    "tokens": pre-tokenized files in `paths` (.npy, or raw little-endian `dtype` memmaps).
    "text" / "jsonl": text files (or JSON lines with a `text_field`) tokenized with the
      tokenizer.json at `tokenizer` (a file or a directory holding one).
  eval_fraction: the last fraction of the tokens is held out for evaluation.
  eval_batches: how many batches one evaluation averages over.
  """
  kind: str = "stdlib"
  paths: list[str] = dataclasses.field(default_factory=list)
  dtype: str = "uint16"
  tokenizer: str = ""
  text_field: str = "text"
  vocab_size: int = 4096
  corpus_max_bytes: int = 4_000_000
  cache_dir: str = "~/.cache/coat_jax"
  seq_len: int = 128
  batch_size: int = 16
  eval_fraction: float = 0.02
  eval_batches: int = 4


@dataclasses.dataclass
class MeshConfig:
  """Device mesh sizes over axes ("data", "fsdp", "tensor"); one of them may be -1 (fill)."""
  data: int = -1
  fsdp: int = 1
  tensor: int = 1


@dataclasses.dataclass
class CheckpointConfig:
  """Orbax checkpointing. `dir=""` means `<run.out_dir>/checkpoints`; `every=0` saves only at the end."""
  dir: str = ""
  every: int = 0
  keep: int = 3
  async_save: bool = True


@dataclasses.dataclass
class RunSettings:
  """Length, seed and bookkeeping of a run.

  `compile_cache`: JAX's persistent compilation cache directory ("" = off). A restarted or
  resumed run then skips the compile (minutes for coat mode on the GPU: every FP8 GEMM call site
  is a Pallas kernel of its own).
  """
  steps: int = 300
  seed: int = 0
  log_every: int = 10
  eval_every: int = 100
  out_dir: str = "runs/tiny"
  progress: bool = True
  tensorboard: bool = True
  plot: bool = True
  compile_cache: str = "~/.cache/coat_jax/xla"


@dataclasses.dataclass
class RunConfig:
  """A whole run."""
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  precision: str = "bf16"
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  run: RunSettings = dataclasses.field(default_factory=RunSettings)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def to_yaml(self) -> str:
    return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ----------------------------------------------------------------------------------------------
# Building from dicts, with key and type checks.


def _suggest(name: str, choices) -> str:
  close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.5)
  return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


def _unknown_key_error(key: str, where: str, choices) -> ValueError:
  return ValueError(f"unknown config key {where + key!r}{_suggest(key, choices)}; "
                    f"valid keys {'under ' + repr(where.rstrip('.')) if where else 'at the top level'}: "
                    f"{', '.join(sorted(choices))}")


def _check_value(value: Any, annotation: Any, key: str) -> Any:
  """Checks `value` against a field's type annotation and returns it (ints widen to floats)."""
  origin = typing.get_origin(annotation)
  if origin in (typing.Union, types.UnionType):
    options = typing.get_args(annotation)
    if value is None and type(None) in options:
      return None
    errors = []
    for option in options:
      if option is type(None):
        continue
      try:
        return _check_value(value, option, key)
      except ValueError as e:
        errors.append(str(e))
    raise ValueError(errors[0] if errors else f"config key {key!r}: bad value {value!r}")
  if origin is list:
    (item_type,) = typing.get_args(annotation)
    if isinstance(value, str):  # a single path given where a list is expected
      value = [value]
    if not isinstance(value, (list, tuple)):
      raise ValueError(f"config key {key!r} must be a list, got {type(value).__name__} {value!r}")
    return [_check_value(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
  if annotation is bool:
    if not isinstance(value, bool):
      raise ValueError(f"config key {key!r} must be a bool (true/false), got {value!r}")
    return value
  if annotation is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ValueError(f"config key {key!r} must be an int, got {type(value).__name__} {value!r}")
    return value
  if annotation is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ValueError(f"config key {key!r} must be a number, got {type(value).__name__} {value!r}")
    return float(value)
  if annotation is str:
    if not isinstance(value, str):
      raise ValueError(f"config key {key!r} must be a string, got {type(value).__name__} {value!r}")
    return value
  raise TypeError(f"unsupported annotation {annotation!r} for {key!r}")


def _build(cls, raw: Any, where: str):
  """Builds dataclass `cls` from a mapping, rejecting unknown keys and wrong types."""
  if raw is None:
    raw = {}
  if not isinstance(raw, dict):
    raise ValueError(f"config section {where.rstrip('.') or 'top level'!r} must be a mapping, "
                     f"got {type(raw).__name__} {raw!r}")
  hints = typing.get_type_hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  kwargs = {}
  for key, value in raw.items():
    if not isinstance(key, str) or key not in fields:
      raise _unknown_key_error(str(key), where, fields)
    annotation = hints[key]
    if dataclasses.is_dataclass(annotation):
      kwargs[key] = _build(annotation, value, f"{where}{key}.")
    else:
      kwargs[key] = _check_value(value, annotation, where + key)
  return cls(**kwargs)


def _one_of(value: str, choices, key: str) -> None:
  if value not in choices:
    raise ValueError(f"config key {key!r} must be one of {', '.join(map(repr, choices))}, "
                     f"got {value!r}{_suggest(value, choices)}")


def validate(cfg: RunConfig) -> RunConfig:
  """Checks values (choices and ranges) that types alone do not catch; returns `cfg`."""
  _one_of(cfg.precision, PRECISIONS, "precision")
  o = cfg.optimizer
  _one_of(o.name, OPTIMIZERS, "optimizer.name")
  _one_of(o.schedule, SCHEDULES, "optimizer.schedule")
  _one_of(o.m_format, FP8_STATE_FORMATS, "optimizer.m_format")
  _one_of(o.v_format, FP8_STATE_FORMATS, "optimizer.v_format")
  positive = {"optimizer.lr": o.lr, "optimizer.group_size": o.group_size,
              "optimizer.expand_min": o.expand_min,
              "data.seq_len": cfg.data.seq_len, "data.batch_size": cfg.data.batch_size,
              "data.vocab_size": cfg.data.vocab_size, "data.corpus_max_bytes": cfg.data.corpus_max_bytes,
              "run.steps": cfg.run.steps, "run.log_every": cfg.run.log_every,
              "checkpoint.keep": cfg.checkpoint.keep}
  non_negative = {"optimizer.warmup": o.warmup, "optimizer.weight_decay": o.weight_decay,
                  "optimizer.clip": o.clip, "optimizer.eps": o.eps,
                  "optimizer.min_lr_ratio": o.min_lr_ratio, "data.eval_batches": cfg.data.eval_batches,
                  "run.eval_every": cfg.run.eval_every, "checkpoint.every": cfg.checkpoint.every,
                  "run.seed": cfg.run.seed, "optimizer.min_quantized_size": o.min_quantized_size}
  for key, value in positive.items():
    if not value > 0:
      raise ValueError(f"config key {key!r} must be > 0, got {value!r}")
  for key, value in non_negative.items():
    if not value >= 0:
      raise ValueError(f"config key {key!r} must be >= 0, got {value!r}")
  for key, value in (("optimizer.b1", o.b1), ("optimizer.b2", o.b2)):
    if not 0.0 <= value < 1.0:
      raise ValueError(f"config key {key!r} must be in [0, 1), got {value!r}")
  d = cfg.data
  _one_of(d.kind, DATA_KINDS, "data.kind")
  _one_of(d.dtype, TOKEN_DTYPES, "data.dtype")
  if not 0.0 <= d.eval_fraction < 1.0:
    raise ValueError(f"config key 'data.eval_fraction' must be in [0, 1), got {d.eval_fraction!r}")
  if d.kind in ("tokens", "text", "jsonl") and not d.paths:
    raise ValueError(f"data.kind={d.kind!r} needs 'data.paths' (a list of files or glob patterns)")
  if d.kind in ("text", "jsonl") and not d.tokenizer:
    raise ValueError(f"data.kind={d.kind!r} needs 'data.tokenizer' (a tokenizer.json file or its directory)")
  sizes = {"mesh.data": cfg.mesh.data, "mesh.fsdp": cfg.mesh.fsdp, "mesh.tensor": cfg.mesh.tensor}
  for key, value in sizes.items():
    if value == 0 or value < -1:
      raise ValueError(f"config key {key!r} must be a positive size or -1 (fill), got {value}")
  if sum(v == -1 for v in sizes.values()) > 1:
    raise ValueError(f"at most one mesh axis may be -1 (fill), got {sizes}")
  m = cfg.model
  if m.dtype is not None:
    _one_of(m.dtype, ("bfloat16", "float32", "auto"), "model.dtype")
  for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim", "max_seq_len"):
    value = getattr(m, f)
    if value is not None and value <= 0:
      raise ValueError(f"config key 'model.{f}' must be > 0, got {value}")
  return cfg


def from_dict(raw: dict[str, Any]) -> RunConfig:
  """Builds and validates a RunConfig from a nested mapping (e.g. parsed YAML)."""
  return validate(_build(RunConfig, raw, ""))


# ----------------------------------------------------------------------------------------------
# Overrides and files.


def _parse_scalar(text: str) -> Any:
  """Parses a `--set` value with YAML rules (3e-4 -> float, true -> bool, [a, b] -> list)."""
  try:
    value = yaml.safe_load(text)
  except yaml.YAMLError:
    return text
  if isinstance(value, str) and _looks_like_float(value):
    return float(value)  # YAML 1.1 reads "3e-4" as a string
  return value


def _looks_like_float(text: str) -> bool:
  try:
    float(text)
  except ValueError:
    return False
  return text.strip().lower() not in ("nan", "inf", "-inf", "infinity", "-infinity")


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
  """Applies `section.key=value` strings to a nested mapping (a new one is returned).

  Keys are checked against the schema here, so a typo fails with the key's name even when the
  YAML file does not mention that section.
  """
  raw = _deep_copy(raw)
  for item in overrides:
    if "=" not in item:
      raise ValueError(f"--set expects key=value, got {item!r}")
    dotted, text = item.split("=", 1)
    parts = dotted.strip().split(".")
    cls, where, node = RunConfig, "", raw
    for i, part in enumerate(parts):
      fields = {f.name: f for f in dataclasses.fields(cls)}
      if part not in fields:
        raise _unknown_key_error(part, where, fields)
      annotation = typing.get_type_hints(cls)[part]
      last = i == len(parts) - 1
      if dataclasses.is_dataclass(annotation):
        if last:
          raise ValueError(f"--set {dotted!r} names a section; set one of its keys, e.g. "
                           f"{dotted}.{dataclasses.fields(annotation)[0].name}=...")
        if not isinstance(node.get(part), dict):
          node[part] = {}
        node, cls, where = node[part], annotation, f"{where}{part}."
      else:
        if not last:
          raise _unknown_key_error(".".join(parts[i + 1:]), f"{where}{part}.", [])
        node[part] = _parse_scalar(text)
  return raw


def _deep_copy(raw):
  if isinstance(raw, dict):
    return {k: _deep_copy(v) for k, v in raw.items()}
  if isinstance(raw, list):
    return [_deep_copy(v) for v in raw]
  return raw


def load_yaml(path: str | Path) -> dict[str, Any]:
  """Reads a YAML config file into a mapping; errors name the file."""
  path = Path(path)
  if not path.is_file():
    raise ValueError(f"config file not found: {path}")
  try:
    raw = yaml.safe_load(path.read_text())
  except yaml.YAMLError as e:
    raise ValueError(f"config file {path} is not valid YAML: {e}") from e
  if raw is None:
    return {}
  if not isinstance(raw, dict):
    raise ValueError(f"config file {path} must hold a mapping at the top level, got {type(raw).__name__}")
  return raw


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
  """Loads a config file (or the schema defaults when `path` is None) and applies `--set` overrides."""
  raw = load_yaml(path) if path is not None else {}
  try:
    return from_dict(apply_overrides(raw, list(overrides)))
  except ValueError as e:
    if path is not None and str(path) not in str(e):
      raise ValueError(f"{path}: {e}") from e
    raise
