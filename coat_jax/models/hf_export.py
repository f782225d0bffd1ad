"""Export a `Llama` as a Hugging Face `LlamaForCausalLM` directory (config.json + safetensors).

The inverse of `load_llama`: projections are written in torch's (out, in) layout, a stacked
(scanned) layer axis is split into `model.layers.{i}.*` tensors, and the weights are cast to
`dtype`. Above `max_shard_bytes` the tensors go into several `model-0000k-of-0000n.safetensors`
files listed in `model.safetensors.index.json`, as transformers' `save_pretrained` writes them.

  coat_jax.models.save_llama(model, "out/hf", dtype="bfloat16")
  # transformers.AutoModelForCausalLM.from_pretrained("out/hf") loads it
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from coat_jax.models.hf import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, hf_tensor_map
from coat_jax.models.llama import Llama, LlamaConfig, layer_params

EXPORT_DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_SHARD_BYTES = 5 * 10 ** 9   # transformers' default max_shard_size ("5GB")
_MODEL_FILES = (CONFIG_FILE, SINGLE_FILE, INDEX_FILE)


def hf_config(cfg: LlamaConfig, dtype: str = "bfloat16") -> dict:
  """The transformers LlamaConfig dict (config.json) of `cfg`; `config_from_hf` maps it back."""
  hf = dict(
      architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=cfg.vocab_size,
      hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
      max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_eps,
      rope_theta=cfg.rope_theta, rope_scaling=None, tie_word_embeddings=cfg.tie_embeddings,
      hidden_act="silu", attention_bias=False, attention_dropout=0.0, mlp_bias=False,
      initializer_range=cfg.init_std, pretraining_tp=1, use_cache=True, torch_dtype=dtype)
  if cfg.rope_scaling is not None:
    hf["rope_scaling"] = dict(cfg.rope_scaling, rope_type="llama3")
  return hf


def hf_tensors(model: Llama, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
  """The model's parameters under their HF names, in torch's layout, as `dtype` numpy arrays
  (`hf.hf_tensor_map`: the names, paths and transposes load_llama reads)."""
  np_dtype = _np_dtype(dtype)
  layers = {}   # decoder layer index -> its parameter state, read once
  out = {}
  for name, path, layer, transpose in hf_tensor_map(model.cfg):
    if layer is None:
      value = functools.reduce(getattr, path, model)[...]
    else:
      if layer not in layers:
        layers[layer] = layer_params(model, layer)
      value = functools.reduce(lambda state, key: state[key], path, layers[layer])[...]
    out[name] = value.T if transpose else value
  return {k: np.ascontiguousarray(np.asarray(v, np.float32).astype(np_dtype))
          for k, v in out.items()}


def save_llama(model: Llama, directory, *, dtype: str = "bfloat16",
               max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False) -> Path:
  """Writes `model` to `directory` as a Hugging Face LlamaForCausalLM checkpoint; returns it.

  dtype: the weights' storage dtype ("bfloat16", "float16" or "float32"). max_shard_bytes: above
  this many bytes of tensors, several shards with an index (each shard at most this size, unless
  one tensor is larger). The directory is created if missing; one that already holds a model
  (config.json or safetensors) is refused unless `overwrite`, which replaces only those files:
  the new model is written whole into a staging folder inside the directory first, then renamed
  into place (config.json last) and the old files it does not replace are removed, so an error or
  a crash while writing (a full disk) leaves the old model as it was. Readers never see half a file.

  Raises:
    ValueError: an unknown dtype, a bad max_shard_bytes, or a directory holding a model.
  """
  if dtype not in EXPORT_DTYPES:
    raise ValueError(f"save_llama: dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
  if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
    raise ValueError(f"save_llama: max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
  directory = Path(directory)
  if directory.exists() and not directory.is_dir():
    raise ValueError(f"save_llama: {directory} exists and is not a directory")
  existing = _model_files(directory)
  if existing and not overwrite:
    raise ValueError(f"save_llama: {directory} already holds a model ({', '.join(existing)}); "
                     f"choose another directory or replace its model files (overwrite=True, "
                     f"python -m coat_jax.export --overwrite)")
  tensors = hf_tensors(model, dtype)
  directory.mkdir(parents=True, exist_ok=True)
  staging = Path(tempfile.mkdtemp(dir=directory, prefix=".save_llama-"))
  try:
    written = _write_model(staging, tensors, max_shard_bytes,
                           json.dumps(hf_config(model.cfg, dtype), indent=2))
    for name in written:   # the weights first, config.json last (`_write_model`'s order)
      os.replace(staging / name, directory / name)
    for name in existing:
      if name not in written:
        (directory / name).unlink()
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return directory


def _write_model(directory: Path, tensors, max_shard_bytes: int, config: str) -> list[str]:
  """Writes the safetensors (one file, or shards and their index) and config.json into
  `directory`; returns the file names, config.json last."""
  shards = _shards(tensors, max_shard_bytes)
  if len(shards) == 1:
    _atomic(directory / SINGLE_FILE, lambda f: save_file(shards[0], f, metadata={"format": "pt"}))
    names = [SINGLE_FILE]
  else:
    weight_map, names = {}, []
    for k, shard in enumerate(shards, 1):
      name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
      _atomic(directory / name, lambda f, s=shard: save_file(s, f, metadata={"format": "pt"}))
      weight_map.update({t: name for t in shard})
      names.append(name)
    total = sum(a.nbytes for a in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _atomic(directory / INDEX_FILE, lambda f: Path(f).write_text(json.dumps(index, indent=2)))
    names.append(INDEX_FILE)
  _atomic(directory / CONFIG_FILE, lambda f: Path(f).write_text(config))
  return names + [CONFIG_FILE]


def _np_dtype(dtype: str):
  import ml_dtypes
  return {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dtype]


def _model_files(directory: Path) -> list[str]:
  if not directory.is_dir():
    return []
  names = sorted(p.name for p in directory.iterdir()
                 if p.name in _MODEL_FILES or (p.name.startswith("model")
                                               and p.name.endswith(".safetensors")))
  return names


def _shards(tensors: dict[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
  """Tensors in name order, cut into consecutive groups of at most `max_bytes` each."""
  shards, current, size = [], {}, 0
  for name in tensors:   # embed, layers in order, norm, head: the order transformers keeps
    nbytes = tensors[name].nbytes
    if current and size + nbytes > max_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = tensors[name]
    size += nbytes
  shards.append(current)
  return shards


def _atomic(path: Path, write) -> None:
  """Calls write(temp file name), then renames the temp file to `path`."""
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
  os.close(fd)
  umask = os.umask(0)
  os.umask(umask)
  try:
    write(tmp)
    os.chmod(tmp, 0o666 & ~umask)   # as a plain open() would make it (mkstemp makes 0600)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
