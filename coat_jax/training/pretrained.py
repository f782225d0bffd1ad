"""Starting a run from a Hugging Face Llama directory (`model.init_from`).

The directory's config.json gives the model's shape; the run config's model section adds what
is not shape (dtype, remat, scan and attention settings, loss implementation, max_seq_len) and
the precision mode. A shape key the model section sets must agree with config.json, and the
data's tokenizer may not have more ids than the model's vocabulary: either is a one-line
BadInputError naming both values. The weights are read with `models.load_llama` and placed with
the run's parameter shardings; the optimizer state starts fresh.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import jax
from flax import nnx

from coat_jax.errors import BadInputError

# Model-section keys that are the model's shape: they must agree with config.json.
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "rope_theta", "rms_eps", "tie_embeddings")


def read_hf_config(directory: str) -> dict[str, Any]:
  path = Path(directory).expanduser() / "config.json"
  if not Path(directory).expanduser().is_dir():
    raise BadInputError(f"model.init_from: {directory} is not a directory")
  if not path.is_file():
    raise BadInputError(f"model.init_from: {path} does not exist (a Hugging Face Llama "
                        f"directory has config.json and safetensors weights)")
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise BadInputError(f"model.init_from: {path} is not valid JSON ({e})") from None


def model_config(cfg, data_vocab: int | None, dtype_overrides: dict[str, Any]):
  """The run's LlamaConfig from `cfg.model.init_from`'s config.json plus the model section's
  non-shape keys (`dtype_overrides`: those keys, dtype resolved) and `cfg.precision`."""
  from coat_jax.models import config_from_hf

  directory = cfg.model.init_from
  hf = read_hf_config(directory)
  try:
    base = config_from_hf(hf)
  except ValueError as e:
    raise BadInputError(f"model.init_from: {e}") from None
  for key in SHAPE_KEYS:
    if key in dtype_overrides and dtype_overrides[key] != getattr(base, key):
      raise BadInputError(f"model.{key}={dtype_overrides[key]!r} contradicts {directory}/"
                          f"config.json, whose model has {key}={getattr(base, key)!r}; drop "
                          f"model.{key} (init_from takes the shape from config.json)")
  if data_vocab is not None and data_vocab > base.vocab_size:
    raise BadInputError(f"the data's tokenizer has {data_vocab} ids, more than the vocab_size="
                        f"{base.vocab_size} of model.init_from {directory}: use the directory's "
                        f"tokenizer (data.tokenizer unset) or one of at most that many ids")
  extra = {k: v for k, v in dtype_overrides.items() if k not in SHAPE_KEYS}
  if "max_seq_len" not in extra and base.max_seq_len < cfg.data.seq_len:
    extra["max_seq_len"] = cfg.data.seq_len
  if extra.get("max_seq_len", base.max_seq_len) < cfg.data.seq_len:
    raise BadInputError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len="
                        f"{extra['max_seq_len']}")
  try:
    return config_from_hf(hf, precision=cfg.precision, **extra)
  except ValueError as e:
    raise BadInputError(f"model.init_from {directory}: {e}") from None


def init_params(directory: str, llama_cfg, params_shardings, rest_shardings,
                progress: bool = False) -> Callable[..., tuple[Any, Any]]:
  """init(seed=None) -> (params, rest): the directory's weights with the run's shardings (the
  seed is not used: nothing is random); progress: a progress bar over the tensors read."""
  from coat_jax.models import load_llama

  def init(seed=None):
    del seed
    settings = {k: v for k, v in llama_cfg.to_dict().items()
                if k not in SHAPE_KEYS + ("rope_scaling",)}
    try:
      model = load_llama(Path(directory).expanduser(), progress=progress, **settings)
    except FileNotFoundError as e:
      raise BadInputError(f"model.init_from: {e}") from None
    except ValueError as e:
      raise BadInputError(f"model.init_from: {e}") from None
    if model.cfg != llama_cfg:
      raise BadInputError(f"model.init_from: {directory} loads as {model.cfg}, the run "
                          f"expects {llama_cfg}")
    _, params, rest = nnx.split(model, nnx.Param, ...)
    return (jax.device_put(nnx.to_pure_dict(params), params_shardings),
            jax.device_put(nnx.to_pure_dict(rest), rest_shardings))

  return init


def tokenizer_path(data, init_from: str, required: bool = True) -> str:
  """data.tokenizer, else init_from's tokenizer.json (BadInputError when it has none and
  `required`, else "")."""
  if data.tokenizer or not init_from:
    return data.tokenizer
  if not Path(init_from).expanduser().is_dir():
    raise BadInputError(f"model.init_from: {init_from} is not a directory")
  path = Path(init_from).expanduser() / "tokenizer.json"
  if not path.is_file():
    if not required:
      return ""
    raise BadInputError(f"data.tokenizer is not set and model.init_from {init_from} has no "
                        f"tokenizer.json: set data.tokenizer")
  return str(path)
