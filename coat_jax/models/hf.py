"""Import a local Hugging Face Llama checkpoint (config.json + safetensors) into `Llama`.

Reads single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`) checkpoints,
old (`rope_theta` / `rope_scaling`) and new (`rope_parameters`) config layouts, and BF16 tensors.
Torch linears store weights as (out, in); ours are (in, out), so projections are transposed.
Per-layer tensors are stacked along the leading layer axis when the config scans its layers.

  model = coat_jax.models.load_llama("path/to/hf_dir", precision="coat")
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors import safe_open

from coat_jax.models.llama import Llama, LlamaConfig
from coat_jax.ops import LLAMA3_ROPE_KEYS

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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
    raise ValueError(f"config.json: rope scaling type {kind!r} is not supported (only 'llama3')")
  missing = [k for k in LLAMA3_ROPE_KEYS if k not in scaling]
  if missing:
    raise ValueError(f"config.json: llama3 rope scaling misses {missing}")
  return theta, {k: scaling[k] for k in LLAMA3_ROPE_KEYS}


def config_from_hf(hf: dict[str, Any], **overrides) -> LlamaConfig:
  """Maps a transformers LlamaConfig dict (config.json) to a validated LlamaConfig."""
  model_type = hf.get("model_type", "llama")
  if model_type != "llama":
    raise ValueError(f"config.json: model_type {model_type!r} is not 'llama'")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json: hidden_act {hf['hidden_act']!r} is not 'silu'")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key, False):
      raise ValueError(f"config.json: {key}=true is not supported (Llama without biases)")
  required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads")
  missing = [k for k in required if k not in hf]
  if missing:
    raise ValueError(f"config.json misses keys {missing}")
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
  return LlamaConfig.from_dict(d)


class _TensorFiles:
  """Tensor name -> file lookup over one or several safetensors files."""

  def __init__(self, directory: Path):
    index, single = directory / INDEX_FILE, directory / SINGLE_FILE
    if index.exists():
      weight_map = json.loads(index.read_text()).get("weight_map")
      if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: no 'weight_map' dict")
      self.file_of = {name: directory / f for name, f in weight_map.items()}
      for f in sorted(set(self.file_of.values())):
        if not f.exists():
          raise FileNotFoundError(f"{f} (listed in {index}) does not exist")
    elif single.exists():
      with safe_open(str(single), framework="flax") as f:
        self.file_of = {name: single for name in f.keys()}
    else:
      raise FileNotFoundError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    self._open: dict[Path, Any] = {}

  def __contains__(self, name: str) -> bool:
    return name in self.file_of

  def _handle(self, path: Path):
    if path not in self._open:
      self._open[path] = safe_open(str(path), framework="flax")
    return self._open[path]

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._handle(self.file_of[name]).get_slice(name).get_shape())

  def get(self, name: str) -> jax.Array:
    return self._handle(self.file_of[name]).get_tensor(name)


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
    raise ValueError(f"{directory}: tensor {name!r} is missing from the checkpoint")
  want = shape[::-1] if transpose else shape
  got = files.shape(name)
  if got != want:
    raise ValueError(f"{directory}: tensor {name!r} has shape {got}, expected {want}")
  value = files.get(name).astype(dtype)
  return value.T if transpose else value


def load_llama(path, *, precision: str = "bf16", dtype: str = "bfloat16",
               param_dtype: str = "float32", **overrides) -> Llama:
  """Builds a `Llama` from a local HF directory; parameters are cast to `param_dtype`.

  Raises:
    FileNotFoundError: the directory, config.json or the safetensors files are missing.
    ValueError: an unsupported config, a missing tensor (named) or a tensor of the wrong shape
      (named, with expected and found shapes, in torch's (out, in) layout).
  """
  directory = Path(path)
  if not directory.is_dir():
    raise FileNotFoundError(f"Hugging Face checkpoint directory {directory} does not exist")
  config_path = directory / CONFIG_FILE
  if not config_path.exists():
    raise FileNotFoundError(f"{config_path} does not exist")
  try:
    hf = json.loads(config_path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{config_path}: not valid JSON ({e})") from e
  cfg = config_from_hf(hf, precision=precision, dtype=dtype, param_dtype=param_dtype, **overrides)
  files = _TensorFiles(directory)

  model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))  # shapes only, no init cost
  dtype = cfg.jnp_param_dtype
  top = _MODEL_TENSORS + (() if cfg.tie_embeddings else (_HEAD_TENSOR,))
  for name, path, transpose in top:
    param = _param(model, path)
    param.set_value(_read(files, directory, name, tuple(param.shape), transpose, dtype))
  for suffix, path, transpose in _LAYER_TENSORS:
    if cfg.scan_layers:  # one Param (num_layers, ...): read every layer's tensor, stack them
      param = _param(model.layers, path)
      values = [_read(files, directory, f"model.layers.{i}.{suffix}", tuple(param.shape[1:]),
                      transpose, dtype) for i in range(cfg.num_layers)]
      param.set_value(jnp.stack(values))
    else:
      for i in range(cfg.num_layers):
        param = _param(model.layers[i], path)
        param.set_value(_read(files, directory, f"model.layers.{i}.{suffix}",
                              tuple(param.shape), transpose, dtype))
  return model


def hf_tensor_names(cfg: LlamaConfig) -> list[str]:
  """The HF tensor names a checkpoint of `cfg` must hold (for error messages and tests)."""
  top = _MODEL_TENSORS + (() if cfg.tie_embeddings else (_HEAD_TENSOR,))
  return [n for n, _, _ in top] + [f"model.layers.{i}.{suffix}" for i in range(cfg.num_layers)
                                   for suffix, _, _ in _LAYER_TENSORS]
