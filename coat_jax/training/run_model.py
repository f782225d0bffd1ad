"""A train.py run's model outside train.py: `load_run_model(run_dir)` and the files it reads.

A run directory holds (loop.py writes them when the run starts):
  config.yaml     the run config
  model.json      the resolved LlamaConfig (the preset, overrides, vocabulary and sequence length
                  fitted to the data, or a pretrained directory's config)
  tokenizer.json  the data's tokenizer, when the data has one
  checkpoints/    orbax checkpoints (`checkpoint.dir` when the config names another directory)

  model, step = coat_jax.training.load_run_model("runs/tiny")            # newest intact
  model, step = coat_jax.training.load_run_model("runs/tiny", step=200, precision="bf16")

`load_model(directory)` takes a run directory or a Hugging Face one (the command-line tools'
loader).
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
from flax import nnx

from coat_jax.errors import BadInputError

MODEL_FILE = "model.json"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "config.yaml"


def write_run_files(out_dir: Path, llama_cfg, tokenizer) -> None:
  """Writes model.json and (when the data has a tokenizer) tokenizer.json into `out_dir`."""
  from coat_jax.training.corpus import atomic_write_bytes

  out_dir = Path(out_dir)
  atomic_write_bytes(out_dir / MODEL_FILE, json.dumps(llama_cfg.to_dict(), indent=2).encode())
  if tokenizer is not None:
    atomic_write_bytes(out_dir / TOKENIZER_FILE, tokenizer.to_str().encode("utf-8"))


def run_model_config(run_dir: Path, cfg, **overrides):
  """The run's LlamaConfig: model.json (with `overrides`), else rebuilt from config.yaml (the
  data's vocabulary from the run's tokenizer.json when there is one)."""
  from coat_jax.models import LlamaConfig
  from coat_jax.training.build import model_config

  path = run_dir / MODEL_FILE
  if path.is_file():
    try:
      d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
      raise BadInputError(f"{path}: not valid JSON ({e})") from None
    d.update(overrides)
    return LlamaConfig.from_dict(d)
  vocab = None   # pre-tokenized data keeps the model config's vocabulary (build.model_config)
  if cfg.data.kind != "tokens" and (run_dir / TOKENIZER_FILE).is_file():
    from coat_jax.training.corpus import load_tokenizer
    vocab = load_tokenizer(run_dir / TOKENIZER_FILE).get_vocab_size()
  llama_cfg = model_config(cfg, vocab)
  return LlamaConfig.from_dict({**llama_cfg.to_dict(), **overrides})


def load_run_model(run_dir, step: int | None = None, **overrides):
  """(Llama, step) from a train.py run directory: its newest intact checkpoint, or `step`.

  Reads config.yaml and model.json, and only the parameters of the checkpoint (not the optimizer
  state), onto the default device. overrides: LlamaConfig fields to change (e.g.
  precision="bf16", dtype="float32", scan_layers=False); the parameter shapes must stay.
  Read-only: nothing in the run directory changes.

  Raises:
    BadInputError (a ValueError): not a run directory, a bad config, no (intact) checkpoint, no
      checkpoint at `step`, or parameters that do not fit the config.
  """
  from coat_jax.models import Llama, LlamaConfig
  from coat_jax.training import checkpoint, schema

  run_dir = Path(run_dir)
  if not (run_dir / CONFIG_FILE).is_file():
    raise BadInputError(f"{run_dir} is not a train.py run directory (no {CONFIG_FILE})")
  try:
    cfg = schema.load(run_dir / CONFIG_FILE)
    saved_cfg = run_model_config(run_dir, cfg)   # the layout the checkpoint holds
    llama_cfg = LlamaConfig.from_dict({**saved_cfg.to_dict(), **overrides})
  except ValueError as e:
    raise BadInputError(f"{run_dir}: {e}") from None
  ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
  template = nnx.eval_shape(lambda: Llama(saved_cfg, rngs=nnx.Rngs(0)))
  try:
    params, _, step = checkpoint.read_params(ckpt_dir, nnx.to_pure_dict(nnx.state(
        template, nnx.Param)), step)
  except ValueError as e:
    raise BadInputError(str(e)) from None
  if saved_cfg.scan_layers != llama_cfg.scan_layers:
    params = dict(params, layers=_relayout(params["layers"], saved_cfg.num_layers,
                                           llama_cfg.scan_layers))
  graphdef, params_state, rest_state = nnx.split(
      nnx.eval_shape(lambda: Llama(llama_cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
  if jax.tree.leaves(rest_state):
    raise BadInputError(f"{run_dir}: the model holds state other than parameters, which "
                        f"load_run_model does not restore")
  nnx.replace_by_pure_dict(params_state, params)
  return nnx.merge(graphdef, params_state, rest_state), step


def load_model(directory, step: int | None = None, progress: bool = False, **overrides):
  """(Llama, step) from a train.py run directory (`load_run_model`: its newest intact checkpoint,
  or `step`) or a Hugging Face directory (`coat_jax.models.load_llama`, with a progress bar over
  its tensors if `progress`; step None, and a `step` given is an error: such a directory holds
  one model). overrides: LlamaConfig fields (e.g. precision, dtype). The one loader of the
  command-line tools that take either kind.

  Raises BadInputError (a ValueError), one line: no such directory, a step for a Hugging Face
  directory, or what the loader raises.
  """
  from coat_jax.models import load_llama

  directory = Path(directory)
  if not directory.is_dir():
    raise BadInputError(f"model directory {directory} does not exist")
  if (directory / CONFIG_FILE).is_file():
    return load_run_model(directory, step, **overrides)
  if step is not None:
    raise BadInputError(f"--step {step}: {directory} is not a train.py run directory (no "
                        f"{CONFIG_FILE}); a Hugging Face directory holds one model")
  try:
    return load_llama(directory, progress=progress, **overrides), None
  except FileNotFoundError as e:
    raise BadInputError(str(e)) from None


def _relayout(layers, num_layers: int, scan: bool):
  """Decoder-layer params between the scanned (stacked) and the looped ({i: ...}) layouts."""
  if scan:
    return jax.tree.map(lambda *a: jax.numpy.stack(a), *[layers[i] for i in range(num_layers)])
  return {i: jax.tree.map(lambda a: a[i], layers) for i in range(num_layers)}

