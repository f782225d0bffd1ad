"""The run configuration schema: typed dataclasses, value checks, and `load` (file + `--set`).

A run config has eight sections:

  model:      preset name (`LlamaConfig.from_name`) plus optional shape overrides
  precision:  "bf16" | "fp8_linear" | "coat" (the model's precision mode; independent of the optimizer)
  optimizer:  "adamw" | "coat_adamw" with its hyper-parameters and schedule
  data:       where tokens come from, sequence length, batch size, eval split
  mesh:       device mesh sizes ("data", "fsdp", "tensor"; -1 = fill with the remaining devices)
  checkpoint: directory, period, how many to keep, async saving
  run:        steps, seed, logging/eval periods, output directory
  kernels:    which kernels run (`coat_jax.kernels.KernelConfig`: backend, partitioning)

Unknown keys and values of the wrong type are rejected with a ValueError that names the key
(and suggests close matches) and where it came from (the YAML file or the `--set` override);
config_io.py does the generic part (types, YAML, overrides), this file the values.
"""
from __future__ import annotations

import dataclasses
import math
import re
import typing
from pathlib import Path
from typing import Any

from coat_jax import optim
from coat_jax.formats import OPTIMIZER_GROUP_AXES, OPTIMIZER_GROUP_AXIS, OPTIMIZER_GROUP_SIZE
from coat_jax.kernels import KernelConfig
from coat_jax.models.llama import REMAT_POLICIES, LlamaConfig
from coat_jax.ops.attention import ATTENTION_RESIDUALS
from coat_jax.ops.linear_layer import LINEAR_RESIDUALS
from coat_jax.precision import AUTO_DTYPE, DTYPES, PRECISIONS
from coat_jax.training import config_io
from coat_jax.rounding import MASTER_ROUNDINGS
from coat_jax.training.accumulate import ACCUM_DTYPES, GRAD_DTYPES

OPTIMIZERS = ("adamw", "coat_adamw")
SCHEDULES = ("cosine", "constant", "linear")
DATA_KINDS = ("stdlib", "tokens", "text", "jsonl", "sft")
ON_NONFINITE = ("stop", "skip")
MAX_INT = 2**63 - 1        # every int setting fits int64 (a seed up to this is a valid JAX key)
MAX_BATCH_TOKENS = 2**31   # tokens of one batch (batch_size x (seq_len + 1)): int32 positions
TOKEN_DTYPES = ("uint16", "uint32")
FP8_STATE_FORMATS = ("e4m3", "e5m2", "int8")
AUTO = "auto"   # model.remat / optimizer.accumulate: chosen by coat_jax.training.plan
REMAT_CHOICES = (*REMAT_POLICIES, AUTO)


# LlamaConfig's fields a run config sets under `model:`, all but these two: `precision` is the
# run's top-level key, `rope_scaling` (a dict) comes with a preset only.
_NOT_MODEL_KEYS = ("precision", "rope_scaling")


def _model_overrides(self) -> dict[str, Any]:
  """The fields set away from the preset, as `LlamaConfig.from_name` keyword arguments."""
  return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
          if f.name not in ("preset", "init_from") and getattr(self, f.name) is not None}


ModelConfig = dataclasses.make_dataclass(
    "ModelConfig",
    [("preset", str, "tiny"), ("init_from", str, "")] + [
        (f.name, typing.get_type_hints(LlamaConfig)[f.name] | None, None)
        for f in dataclasses.fields(LlamaConfig) if f.name not in _NOT_MODEL_KEYS],
    namespace={"overrides": _model_overrides, "__module__": __name__,
               "__doc__": """Model shape: a `LlamaConfig` preset (`LlamaConfig.from_name`) plus
  overrides of its fields (None keeps the preset's value); each field means what it means in
  `coat_jax.models.LlamaConfig`, whose docstring documents them. Beyond that: `vocab_size=None`
  takes the data's tokenizer vocabulary when the data has one (stdlib, text, jsonl) and the
  preset's otherwise (pre-tokenized files); `dtype` "auto" is bfloat16 on accelerators and float32
  on CPU, where bfloat16 matmuls are slow; `remat` also takes a bool, or "auto": the fastest
  policy whose step fits the device, chosen before the first step by XLA's memory prediction
  (`coat_jax.training.plan`).
  `init_from`: a local Hugging Face Llama directory (config.json + safetensors, e.g. one that
  `python -m coat_jax.export` wrote) to start from: the shape comes from its config.json (the
  preset is not used; a shape key set here must agree with it) and the weights from its files,
  in any precision mode, with a fresh optimizer state; its tokenizer.json is the data's
  tokenizer unless `data.tokenizer` names another. A resumed run continues from its checkpoint.
  """})


@dataclasses.dataclass
class OptimizerConfig:
  """AdamW-family optimizer, warmup + decay schedule, global-norm clipping.

  `warmup` steps of linear warmup to `lr`, then `schedule` ("cosine", "linear" or "constant") down
  to `lr * min_lr_ratio` at `run.steps`; a run shorter than its warmup ends inside it
  (`build.lr_schedule`).

  `m_format`/`v_format`/`group_size`/`expand`/`expand_min`/`min_quantized_size`/`group_axis` are
  used by "coat_adamw" only (params with fewer elements than `min_quantized_size` keep float32
  moments; expansion exponents are multiples of 1/`expand_min`; `group_axis` "last" (default:
  every leaf's last axis; the faster kernel) or "coat" (COAT's layout, Linear kernels grouped along
  their input features), the axis of the moment groups: `coat_jax.optim.group_axes`; a checkpoint
  resumes only with the group_axis it was saved with).
  `decay_1d=False` leaves 1-D parameters (norm scales, biases) out of weight decay.
  `accumulate`: microbatches per optimizer step (gradient accumulation); `data.batch_size` is the
  global batch of one step and is split into `accumulate` microbatches, run one after another, with
  the gradient sum kept in `accumulate_dtype` ("float32" or "bfloat16"); "auto": the fewest
  microbatches whose step fits the device (`coat_jax.training.plan`).
  `master_rounding`: how coat_adamw's step stores bfloat16 master weights
  (`model.param_dtype: bfloat16`): "nearest", "stochastic" rounding (`coat_jax.rounding`), or
  "kahan" (nearest plus a bfloat16 compensation buffer in the optimizer state, 2 B/param;
  `coat_jax.optim.coat_adamw_apply`).
  `grad_dtype`: "param" (gradients in the params' dtype) or "bfloat16" (the backward runs at a
  bfloat16 copy of the weights, so gradients take 2 B/param; the optimizer upcasts;
  training/accumulate.py). Memory per param, as the options combine:
    master (param_dtype)   grad_dtype   gradients   extra while the backward runs
    float32                param        4 B         -
    float32                bfloat16     2 B         the bfloat16 weight copy, 2 B (no net saving)
    bfloat16               either       2 B         -  (the params are the bfloat16 weights)
  The copy is a net cost only under remat: without remat the backward keeps each layer's
  bfloat16 weights as residuals anyway, and from the copy those residuals are the copy itself
  (float32 master + bfloat16 grads then holds 2 B/param less; with `remat: full` it saves
  nothing). Less held is not a lower peak: OLMo-1B at batch 8, remat none, peaked the same with
  either grad dtype, scanned or unrolled (H100, 2026-11-24, `python3 -m benchmarks.step.bench_e2e
  --layers best --set optimizer.grad_dtype=bfloat16`).
  With `accumulate` > 1 the running sum is one more gradient-sized tree in `accumulate_dtype`
  (float32: 4 B, bfloat16: 2 B), so bfloat16 gradients halve the accumulation memory only with
  `accumulate_dtype: bfloat16` as well; each microbatch's gradient is in the grad dtype.
  Where every gradient is in `accumulate_dtype` (bfloat16 gradients into a bfloat16 sum, or
  float32 throughout) and the layers are scanned by `layer_loop` (`model.scan_impl` "vjp_loop",
  what "auto" runs on one device), the backward adds the stacked layers' gradient into the sum
  itself (`build.sums_layer_grads_in_place`): the sum then adds only the embedding's, final norm's
  and LM head's share of a gradient tree (the stacked layers hold ~98 % of a 13B Llama's params).
  `coat_jax.training.build.memory_budget` adds these up.
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
  group_size: int = OPTIMIZER_GROUP_SIZE
  expand: bool = True
  expand_min: int = optim.DEFAULT_EXPAND_MIN
  min_quantized_size: int = optim.DEFAULT_MIN_QUANTIZED_SIZE
  accumulate: int | str = 1
  accumulate_dtype: str = "float32"
  master_rounding: str = "nearest"
  grad_dtype: str = "param"
  group_axis: str = OPTIMIZER_GROUP_AXIS


@dataclasses.dataclass
class DataConfig:
  """Token source and batching.

  kind:
    "stdlib": the offline default; the Python standard library's .py sources (sorted, capped at
      `corpus_max_bytes`), a byte-level BPE of `vocab_size` trained locally and cached, or the
      tokenizer of `tokenizer` / `model.init_from` where one is set; it reads no files, so
      `paths` must be empty (a config naming files with this kind is an error).
    "tokens": pre-tokenized files in `paths` (.npy, or raw little-endian `dtype` memmaps);
      `tokenizer` (optional) names the tokenizer their ids come from, kept with the run.
    "text" / "jsonl": text files (or JSON lines with a `text_field`) tokenized with the
      tokenizer.json at `tokenizer` (a file or a directory holding one).
    "sft": supervised fine-tuning examples, JSON lines with "prompt" and "response" strings or
      "messages" (a chat; `coat_jax.training.sft` documents the template); the loss counts the
      response tokens only, and several examples are packed into each sequence, each seeing
      only itself (segment ids; positions restart per example).
  `tokenizer` defaults to `model.init_from`'s tokenizer.json when that is set.
  document_mask: pretraining data (stdlib, tokens, text, jsonl) as documents separated by an
    end-of-text id: attention stays within a document, positions restart at each, and the
    prediction across a boundary is not counted. `eos_id` is that id (-1: the tokenizer's
    end-of-text token; pre-tokenized files have no tokenizer and need it set).
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
  document_mask: bool = False
  eos_id: int = -1


@dataclasses.dataclass
class MeshConfig:
  """Device mesh sizes over axes ("data", "fsdp", "tensor"); one of them may be -1 (fill)."""
  data: int = -1
  fsdp: int = 1
  tensor: int = 1


@dataclasses.dataclass
class CheckpointConfig:
  """Orbax checkpointing. `dir=""` means `<run.out_dir>/checkpoints`; `every=0` saves only at the end.
  `enabled: false` writes no checkpoint at all, not even at the end or on a signal (benchmarks and
  smoke runs whose state is not worth the disk: a 7B state is tens of GB)."""
  enabled: bool = True
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
  `on_nonfinite`: what a non-finite loss or gradient norm does: "stop" (default: the run ends
  with exit status 3, writing no checkpoint of the diverged state) or "skip" (the step leaves
  params and optimizer state as they were; `max_nonfinite_steps` such steps in a row stop the run
  as "stop" does). `out_dir` and `checkpoint.dir` may start with `~`.
  `device_memory_limit`: the bytes a device may hold, for the check before the first step
  (`coat_jax.training.plan`): 0 = the device's own (`bytes_limit` of its memory stats on a GPU;
  none on a CPU, where the check is off), else a size such as 80e9 or "75GiB" (a smaller budget,
  or a stand-in device on a CPU). `plan_timed_steps`: with `model.remat` or `optimizer.accumulate`
  "auto", time this many steps of each candidate that fits and take the fastest (null: 2 on
  accelerators, 0 on a CPU: the first in the order fastest-first by rule).
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
  on_nonfinite: str = "stop"
  max_nonfinite_steps: int = 10
  device_memory_limit: int | float | str = 0
  plan_timed_steps: int | None = None


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
  kernels: KernelConfig = dataclasses.field(default_factory=KernelConfig)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def to_yaml(self) -> str:
    return config_io.dump_yaml(self.to_dict())


# ----------------------------------------------------------------------------------------------
# Value checks.


def _one_of(value: str, choices, key: str) -> None:
  if value not in choices:
    raise ValueError(f"config key {key!r} must be one of {', '.join(map(repr, choices))}, "
                     f"got {value!r}{config_io.suggest(value, choices)}")


def _check_numbers(node: Any, where: str = "") -> None:
  """Every float setting finite, every int one within int64 (`MAX_INT`)."""
  for f in dataclasses.fields(node):
    value, key = getattr(node, f.name), where + f.name
    if dataclasses.is_dataclass(value):
      _check_numbers(value, key + ".")
    elif isinstance(value, float) and not math.isfinite(value):
      raise ValueError(f"config key {key!r} must be a finite number, got {value!r}")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
      raise ValueError(f"config key {key!r} is out of range (at most 2**63 - 1), got {value}")


def validate(cfg: RunConfig) -> RunConfig:
  """Checks values (choices and ranges) that types alone do not catch; returns `cfg`."""
  _check_numbers(cfg)
  _one_of(cfg.precision, PRECISIONS, "precision")
  o = cfg.optimizer
  _one_of(o.name, OPTIMIZERS, "optimizer.name")
  _one_of(o.schedule, SCHEDULES, "optimizer.schedule")
  _one_of(o.m_format, FP8_STATE_FORMATS, "optimizer.m_format")
  _one_of(o.v_format, FP8_STATE_FORMATS, "optimizer.v_format")
  _one_of(o.accumulate_dtype, ACCUM_DTYPES, "optimizer.accumulate_dtype")
  _one_of(o.master_rounding, MASTER_ROUNDINGS, "optimizer.master_rounding")
  _one_of(o.group_axis, OPTIMIZER_GROUP_AXES, "optimizer.group_axis")
  _one_of(o.grad_dtype, GRAD_DTYPES, "optimizer.grad_dtype")
  if o.master_rounding != "nearest" and o.name != "coat_adamw":
    raise ValueError(f"optimizer.master_rounding={o.master_rounding!r} needs "
                     f"optimizer.name='coat_adamw' (got {o.name!r})")
  if o.accumulate != AUTO and not (isinstance(o.accumulate, int) and o.accumulate > 0):
    raise ValueError(f"config key 'optimizer.accumulate' must be an int > 0 or 'auto', "
                     f"got {o.accumulate!r}")
  positive = {"optimizer.lr": o.lr, "optimizer.group_size": o.group_size,
              "optimizer.expand_min": o.expand_min,
              "data.seq_len": cfg.data.seq_len, "data.batch_size": cfg.data.batch_size,
              "data.vocab_size": cfg.data.vocab_size, "data.corpus_max_bytes": cfg.data.corpus_max_bytes,
              "run.steps": cfg.run.steps, "run.log_every": cfg.run.log_every,
              "checkpoint.keep": cfg.checkpoint.keep,
              "run.max_nonfinite_steps": cfg.run.max_nonfinite_steps}
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
  _one_of(cfg.run.on_nonfinite, ON_NONFINITE, "run.on_nonfinite")
  d = cfg.data
  if d.batch_size * (d.seq_len + 1) > MAX_BATCH_TOKENS:
    raise ValueError(f"data.batch_size={d.batch_size} x (data.seq_len + 1 = {d.seq_len + 1}) "
                     f"tokens per batch is more than 2**31")
  _one_of(d.kind, DATA_KINDS, "data.kind")
  _one_of(d.dtype, TOKEN_DTYPES, "data.dtype")
  if not 0.0 <= d.eval_fraction < 1.0:
    raise ValueError(f"config key 'data.eval_fraction' must be in [0, 1), got {d.eval_fraction!r}")
  if d.kind in ("tokens", "text", "jsonl", "sft") and not d.paths:
    raise ValueError(f"data.kind={d.kind!r} needs 'data.paths' (a list of files or glob patterns)")
  if d.kind == "stdlib" and d.paths:
    raise ValueError(f"data.paths={d.paths} names files, but data.kind='stdlib' trains on the "
                     f"Python standard library's sources and reads none: set data.kind to "
                     f"'tokens', 'text', 'jsonl' or 'sft' for the files, or data.paths=[] for the "
                     f"stdlib")
  if d.kind in ("text", "jsonl", "sft") and not (d.tokenizer or cfg.model.init_from):
    raise ValueError(f"data.kind={d.kind!r} needs 'data.tokenizer' (a tokenizer.json file or "
                     f"its directory) or 'model.init_from' (a directory with a tokenizer.json)")
  if d.eos_id < -1:
    raise ValueError(f"config key 'data.eos_id' must be >= 0 or -1 (the tokenizer's), "
                     f"got {d.eos_id}")
  if d.document_mask and d.kind == "tokens" and d.eos_id < 0:
    raise ValueError("data.document_mask with data.kind='tokens' needs 'data.eos_id' (the id "
                     "that ends each document; pre-tokenized files have no tokenizer to ask)")
  sizes = {"mesh.data": cfg.mesh.data, "mesh.fsdp": cfg.mesh.fsdp, "mesh.tensor": cfg.mesh.tensor}
  for key, value in sizes.items():
    if value == 0 or value < -1:
      raise ValueError(f"config key {key!r} must be a positive size or -1 (fill), got {value}")
  if sum(v == -1 for v in sizes.values()) > 1:
    raise ValueError(f"at most one mesh axis may be -1 (fill), got {sizes}")
  parse_bytes(cfg.run.device_memory_limit, "run.device_memory_limit")
  if cfg.run.plan_timed_steps is not None and cfg.run.plan_timed_steps < 0:
    raise ValueError(f"config key 'run.plan_timed_steps' must be >= 0 or null, "
                     f"got {cfg.run.plan_timed_steps}")
  m = cfg.model
  if isinstance(m.remat, str):
    _one_of(m.remat, REMAT_CHOICES, "model.remat")
  if m.dtype is not None:
    _one_of(m.dtype, DTYPES + (AUTO_DTYPE,), "model.dtype")
  if m.attention_residuals is not None:
    _one_of(m.attention_residuals, ATTENTION_RESIDUALS, "model.attention_residuals")
  if m.linear_residuals is not None:
    _one_of(m.linear_residuals, LINEAR_RESIDUALS, "model.linear_residuals")
  for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim", "max_seq_len"):
    value = getattr(m, f)
    if value is not None and value <= 0:
      raise ValueError(f"config key 'model.{f}' must be > 0, got {value}")
  return cfg


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str, key: str) -> int:
  """A byte count from 80e9, 80000000000, "75GiB", "80 GB" (ValueError naming `key` otherwise)."""
  number, unit = value, ""
  if isinstance(value, str):
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
    if not m or m.group(2).lower() not in _BYTE_UNITS:
      raise ValueError(f"config key {key!r} must be a byte count such as 80e9 or '75GiB', "
                       f"got {value!r}")
    number, unit = float(m.group(1)), m.group(2).lower()
  if not number >= 0:
    raise ValueError(f"config key {key!r} must be >= 0, got {value!r}")
  return int(number * _BYTE_UNITS[unit])


def from_dict(raw: dict[str, Any]) -> RunConfig:
  """Builds and validates a RunConfig from a nested mapping (e.g. parsed YAML)."""
  return validate(config_io.build(RunConfig, raw))


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
  """A RunConfig from a YAML file (schema defaults when `path` is None) and `--set` overrides.

  Errors name their source: the file for a bad key, value or YAML syntax in it, the override
  (`--set optimizer.lrr=1: unknown config key ...`) for a bad override. `--set mesh.AXIS=-1`
  moves the fill to AXIS: a mesh axis that the file (or the defaults: `data`) fills becomes 1
  unless an override names it too.
  """
  raw = config_io.load_yaml(path) if path is not None else {}
  return config_io.load(RunConfig, path, _move_mesh_fill(raw, list(overrides)), validate, raw)


_MESH_FILL = re.compile(r"\s*mesh\.(data|fsdp|tensor)\s*=\s*-1\s*")


def _move_mesh_fill(raw: dict[str, Any], overrides: list[str]) -> list[str]:
  """Overrides with `mesh.X=1` put first for each other axis the file (its mapping `raw`) fills
  (-1), when an override fills another axis (`mesh.fsdp=-1` over the default data=-1)."""
  items = [o for o in overrides if isinstance(o, str)]   # others: config_io.load names them
  filled = [m.group(1) for m in map(_MESH_FILL.fullmatch, items) if m]
  if not filled:
    return overrides
  named = {o.split("=", 1)[0].strip() for o in items if "=" in o}
  mesh = raw.get("mesh") if isinstance(raw.get("mesh"), dict) else {}
  base = {**dataclasses.asdict(MeshConfig()), **mesh}
  axes = [f.name for f in dataclasses.fields(MeshConfig)]
  return [f"mesh.{axis}=1" for axis in axes
          if axis != filled[-1] and f"mesh.{axis}" not in named and base.get(axis) == -1] + overrides
