"""Import a local Hugging Face Llama checkpoint (config.json + safetensors) into `Llama`.

Reads single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`) checkpoints,
old (`rope_theta` / `rope_scaling`) and new (`rope_parameters`) config layouts, and BF16 tensors.
Torch linears store weights as (out, in); ours are (in, out), so projections are transposed.
Per-layer tensors are stacked along the leading layer axis when the config scans its layers.

  model = coat_jax.models.load_llama("path/to/hf_dir", precision="coat")

A directory is checked before anything is built: its config's sizes (positive ints, heads that
divide), every file the index names (inside the directory), every safetensors header (read by
the library; a file it rejects is named), and the layer count and embedding shape against the
tensors the headers list. Every problem is one line (BadInputError, exit status 2 in train.py).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors import safe_open

from coat_jax.models.llama import Llama, LlamaConfig
from coat_jax.ops import LLAMA3_ROPE_KEYS
from coat_jax.errors import BadInputError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class MissingFileError(BadInputError, FileNotFoundError):
  """A file or directory of the checkpoint does not exist (bad input, not a storage failure)."""


def _rope_settings(hf: dict[str, Any]) -> tuple[float, dict | None]:
  """(rope_theta, llama3 scaling dict or None) from either config layout."""
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or (params if params.get("rope_type") not in (None, "default")
                                       else None)
  theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
  if not scaling:
    return theta, None
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return theta, None
  if kind != "llama3":
    raise BadInputError(f"config.json: rope scaling type {kind!r} is not supported (only 'llama3')")
  missing = [k for k in LLAMA3_ROPE_KEYS if k not in scaling]
  if missing:
    raise BadInputError(f"config.json: llama3 rope scaling misses {missing}")
  return theta, {k: scaling[k] for k in LLAMA3_ROPE_KEYS}


def config_from_hf(hf: dict[str, Any], **overrides) -> LlamaConfig:
  """Maps a transformers LlamaConfig dict (config.json) to a validated LlamaConfig."""
  model_type = hf.get("model_type", "llama")
  if model_type != "llama":
    raise BadInputError(f"config.json: model_type {model_type!r} is not 'llama'")
  if hf.get("hidden_act", "silu") != "silu":
    raise BadInputError(f"config.json: hidden_act {hf['hidden_act']!r} is not 'silu'")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key, False):
      raise BadInputError(f"config.json: {key}=true is not supported (Llama without biases)")
  required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads")
  missing = [k for k in required if k not in hf]
  if missing:
    raise BadInputError(f"config.json misses keys {missing}")
  for key in _SIZE_KEYS:
    value = hf.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
      raise BadInputError(f"config.json: {key} must be a positive integer, got {value!r}")
  theta, scaling = _rope_settings(hf)
  d = dict(
      vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
      intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
      num_heads=hf["num_attention_heads"],
      num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
      head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
      max_seq_len=hf.get("max_position_embeddings", 2048), rope_theta=theta,
      rope_scaling=scaling, rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
  d.update(overrides)
  try:
    return LlamaConfig.from_dict(d)
  except ValueError as e:
    raise BadInputError(f"config.json: {e}") from None


def _safe_open(path: Path):
  """safe_open, with any error of the library (a lying or truncated header) as one line."""
  try:
    return safe_open(str(path), framework="flax")
  except Exception as e:  # safetensors raises its own SafetensorError, and OSError
    raise BadInputError(f"{path}: not a readable safetensors file ({' '.join(str(e).split())})"
                        ) from None


class _TensorFiles:
  """Tensor name -> file lookup over one or several safetensors files."""

  def __init__(self, directory: Path):
    index, single = directory / INDEX_FILE, directory / SINGLE_FILE
    self._open: dict[Path, Any] = {}
    if index.exists():
      try:
        weight_map = json.loads(index.read_text()).get("weight_map")
      except (ValueError, AttributeError) as e:
        raise BadInputError(f"{index}: not a JSON object ({' '.join(str(e).split())})") from None
      if not isinstance(weight_map, dict):
        raise BadInputError(f"{index}: no 'weight_map' dict")
      root = directory.resolve()
      self.file_of = {}
      for name, f in weight_map.items():
        path = (directory / f).resolve() if isinstance(f, str) else None
        if path is None or Path(f).is_absolute() or root not in path.parents:
          raise BadInputError(f"{index}: tensor {name!r} points outside {directory} ({f!r})")
        self.file_of[name] = path
      for f in sorted(set(self.file_of.values())):
        if not f.is_file():
          raise MissingFileError(f"{f} (listed in {index}) does not exist")
      for f in sorted(set(self.file_of.values())):  # each header read (and checked) once
        self._handle(f)
    elif single.exists():
      self.file_of = {name: single for name in self._handle(single).keys()}
    else:
      raise MissingFileError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found")

  def __contains__(self, name: str) -> bool:
    return name in self.file_of

  def _handle(self, path: Path):
    if path not in self._open:
      self._open[path] = _safe_open(path)
    return self._open[path]

  def shape(self, name: str) -> tuple[int, ...]:
    try:
      return tuple(self._handle(self.file_of[name]).get_slice(name).get_shape())
    except BadInputError:
      raise
    except Exception as e:  # a name the index lists but the file lacks, a bad header entry
      raise BadInputError(f"{self.file_of[name]}: tensor {name!r}: {' '.join(str(e).split())}"
                          ) from None

  def get(self, name: str) -> jax.Array:
    try:
      return self._handle(self.file_of[name]).get_tensor(name)
    except Exception as e:
      raise BadInputError(f"{self.file_of[name]}: tensor {name!r} does not read back "
                          f"({' '.join(str(e).split())})") from None

  def check_against(self, cfg: LlamaConfig, directory: Path) -> None:
    """The layer count and embedding shape of `cfg` against the tensors the headers list."""
    layers = {int(m.group(1)) for m in map(_LAYER.match, self.file_of) if m}
    if len(layers) != cfg.num_layers or layers != set(range(len(layers))):
      found = f"layers 0-{max(layers)}" if layers else "no layers"
      raise BadInputError(f"{directory}: config.json has num_hidden_layers={cfg.num_layers}, "
                          f"the tensors hold {found} ({len(layers)} distinct)")
    name = _MODEL_TENSORS[0][0]
    if name in self:
      want = (cfg.vocab_size, cfg.hidden_size)
      if self.shape(name) != want:
        raise BadInputError(f"{directory}: tensor {name!r} has shape {self.shape(name)}, "
                            f"config.json says (vocab_size, hidden_size) = {want}")


# (HF name, attribute path of our Param, transpose?): model-level, then per decoder layer.
_MODEL_TENSORS = (("model.embed_tokens.weight", ("embed", "embedding"), False),
                  ("model.norm.weight", ("norm", "scale"), False))
_HEAD_TENSOR = ("lm_head.weight", ("lm_head", "kernel"), True)
_LAYER_TENSORS = tuple(
    [(f"self_attn.{p}.weight", ("self_attn", p, "kernel"), True)
     for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    + [(f"mlp.{p}.weight", ("mlp", p, "kernel"), True) for p in ("gate_proj", "up_proj", "down_proj")]
    + [(f"{n}.weight", (n, "scale"), False) for n in ("input_layernorm", "post_attention_layernorm")])


def _param(module, path: tuple[str, ...]):
  for name in path:
    module = getattr(module, name)
  return module


def _read(files: _TensorFiles, directory: Path, name: str, shape: tuple[int, ...],
          transpose: bool, dtype) -> jax.Array:
  """Tensor `name` in our layout (transposed if asked), checked against our `shape`."""
  if name not in files:
    raise BadInputError(f"{directory}: tensor {name!r} is missing from the checkpoint")
  want = shape[::-1] if transpose else shape
  got = files.shape(name)
  if got != want:
    raise BadInputError(f"{directory}: tensor {name!r} has shape {got}, expected {want}")
  value = files.get(name).astype(dtype)
  return value.T if transpose else value


def load_llama(path, *, precision: str = "bf16", dtype: str = "bfloat16",
               param_dtype: str = "float32", progress: bool = False, **overrides) -> Llama:
  """Builds a `Llama` from a local HF directory; parameters are cast to `param_dtype`.
  progress: a progress bar over the tensors read (stderr).

  Raises (both one line, BadInputError: a ValueError):
    MissingFileError (also a FileNotFoundError): the directory, config.json or a safetensors
      file is missing.
    BadInputError: an unsupported or inconsistent config, a weight_map path outside the
      directory, an unreadable safetensors file, a missing tensor (named) or a tensor of the
      wrong shape (named, with expected and found shapes, in torch's (out, in) layout).
  """
  directory = Path(path)
  if not directory.is_dir():
    raise MissingFileError(f"Hugging Face checkpoint directory {directory} does not exist")
  config_path = directory / CONFIG_FILE
  if not config_path.exists():
    raise MissingFileError(f"{config_path} does not exist")
  try:
    hf = json.loads(config_path.read_text())
  except (ValueError, UnicodeDecodeError) as e:
    raise BadInputError(f"{config_path}: not valid JSON ({' '.join(str(e).split())})") from None
  if not isinstance(hf, dict):
    raise BadInputError(f"{config_path}: not a JSON object")
  cfg = config_from_hf(hf, precision=precision, dtype=dtype, param_dtype=param_dtype, **overrides)
  files = _TensorFiles(directory)
  files.check_against(cfg, directory)

  from tqdm import tqdm

  model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))  # shapes only, no init cost
  dtype = cfg.jnp_param_dtype
  top = _MODEL_TENSORS + (() if cfg.tie_embeddings else (_HEAD_TENSOR,))
  bar = tqdm(total=len(top) + len(_LAYER_TENSORS) * cfg.num_layers, unit="tensor",
             desc=f"load {directory.name}", disable=not progress, leave=False)

  def read(name, shape, transpose):
    value = _read(files, directory, name, shape, transpose, dtype)
    bar.update(1)
    return value

  with bar:
    for name, path, transpose in top:
      param = _param(model, path)
      param.set_value(read(name, tuple(param.shape), transpose))
    for suffix, path, transpose in _LAYER_TENSORS:
      if cfg.scan_layers:  # one Param (num_layers, ...): read every layer's tensor, stack them
        param = _param(model.layers, path)
        param.set_value(jnp.stack([read(f"model.layers.{i}.{suffix}", tuple(param.shape[1:]),
                                        transpose) for i in range(cfg.num_layers)]))
      else:
        for i in range(cfg.num_layers):
          param = _param(model.layers[i], path)
          param.set_value(read(f"model.layers.{i}.{suffix}", tuple(param.shape), transpose))
  return model


def hf_tensor_map(cfg: LlamaConfig) -> list[tuple[str, tuple[str, ...], int | None, bool]]:
  """(HF name, our Param's attribute path, decoder layer index or None for a model-level tensor,
  transposed?) of every tensor a checkpoint of `cfg` holds: the one table import and export
  read."""
  top = _MODEL_TENSORS + (() if cfg.tie_embeddings else (_HEAD_TENSOR,))
  return ([(name, path, None, transpose) for name, path, transpose in top]
          + [(f"model.layers.{i}.{suffix}", path, i, transpose) for i in range(cfg.num_layers)
             for suffix, path, transpose in _LAYER_TENSORS])


def hf_tensor_names(cfg: LlamaConfig) -> list[str]:
  """The HF tensor names a checkpoint of `cfg` must hold (for error messages and tests)."""
  return [name for name, _, _, _ in hf_tensor_map(cfg)]
