"""Held-out loss of a model: a train.py run directory's checkpoint, or a Hugging Face directory.

  python -m coat_jax.evaluate MODEL_DIR [--config C] [--set data.KEY=VALUE ...] [--step N]
                              [--batches N] [--precision P] [--dtype D]

The data: a run directory's own config (its held-out windows, the ones its evaluations
averaged), else `--config` (a YAML file or a shipped config's name; default the embedded tiny's:
the offline stdlib corpus); `--set` changes it (only its `data` and `run.seed` keys matter here:
the model is MODEL_DIR's). Text is tokenized with MODEL_DIR's tokenizer.json (a run's own, or
the exported one) unless `data.tokenizer` names another. The loss is the training's
(`build.batch_loss`: next-token cross-entropy, for sft data over the responses only), averaged
over `--batches` held-out batches of data.batch_size windows (default data.eval_batches), with a
progress bar. The model runs in `--precision` (default: a run's own, bf16 for a Hugging Face
directory) and `--dtype` (auto: bfloat16 on GPU/TPU, float32 on CPU). Prints one line: loss,
perplexity, tokens. Read-only. Exit status 0, or 2 with one line on stderr for bad input (no
model, a bad config, data the model cannot read: ids beyond its vocabulary, windows longer than
its context).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from coat_jax.errors import EXIT_BAD_INPUT


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m coat_jax.evaluate",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("model_dir", help="a train.py run directory, or a Hugging Face Llama directory")
  p.add_argument("--config", default=None,
                 help="the run config whose data to evaluate on (default: a run's own, else tiny)")
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                 help="override a config entry, e.g. --set 'data.paths=[held_out.jsonl]'")
  p.add_argument("--step", type=int, default=None,
                 help="a run directory's checkpoint step (default: the newest intact one)")
  p.add_argument("--batches", type=int, default=None,
                 help="held-out batches to average (default: data.eval_batches)")
  p.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp8_linear", "coat"),
                 help="the model's precision mode (auto: a run's own, bf16 for a Hugging Face "
                      "directory)")
  p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                 help="compute dtype (auto: bfloat16 on GPU/TPU, float32 on CPU)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  return p.parse_args(argv)


def evaluate(model_dir, *, config=None, overrides=(), step=None, batches=None, precision="auto",
             dtype="auto", progress=True, log=print) -> dict:
  """{"loss", "perplexity", "tokens", "batches", "step"} (module docstring); step None for a
  Hugging Face directory."""
  import jax
  import numpy as np
  from flax import nnx
  from tqdm import tqdm

  from coat_jax.precision import resolve_dtype
  from coat_jax.training import build, schema
  from coat_jax.training.cli import config_path
  from coat_jax.training.run_model import CONFIG_FILE, load_model

  model_dir = Path(model_dir)
  if not model_dir.is_dir():
    raise ValueError(f"model directory {model_dir} does not exist")
  is_run = (model_dir / CONFIG_FILE).is_file()
  source = config_path(config) if config else (model_dir / CONFIG_FILE if is_run else
                                               config_path("tiny"))
  cfg = schema.load(source, list(overrides))   # the config and the data before the weights
  n = batches if batches is not None else cfg.data.eval_batches
  if n < 1:
    raise ValueError(f"--batches (default data.eval_batches) must be >= 1, got {n}")
  # The model's own tokenizer for every kind of data that is text, required there
  # (build.dataset_from_config, as for a run's model.init_from).
  dataset = build.dataset_from_config(cfg.data, cfg.run.seed, log=log, init_from=str(model_dir))
  settings = {"dtype": resolve_dtype(dtype, "--dtype")}
  if precision != "auto":   # else a run's own; load_llama's bf16 for a Hugging Face directory
    settings["precision"] = precision
  model, step = load_model(model_dir, step, progress=progress, **settings)
  if cfg.data.seq_len > model.cfg.max_seq_len:
    raise ValueError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_seq_len="
                     f"{model.cfg.max_seq_len}")
  dataset.check_vocab(model.cfg.vocab_size)
  held_out = dataset.eval_batches(n)
  if not held_out:
    raise ValueError(f"the data holds no held-out windows (data.eval_fraction="
                     f"{cfg.data.eval_fraction}, {dataset.n_eval} windows); raise "
                     f"data.eval_fraction or evaluate on other data")
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss_of = jax.jit(lambda p, r, b: build.batch_loss(nnx.merge(graphdef, p, r), b))
  losses = [float(loss_of(params, rest, b))
            for b in tqdm(held_out, desc="evaluate", disable=not progress, leave=False)]
  loss = float(np.mean(losses))
  tokens = len(held_out) * cfg.data.batch_size * cfg.data.seq_len
  return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens,
          "batches": len(held_out), "step": step}


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    out = evaluate(args.model_dir, config=args.config, overrides=args.overrides, step=args.step,
                   batches=args.batches, precision=args.precision, dtype=args.dtype,
                   progress=not args.no_progress, log=lambda msg: print(msg, file=sys.stderr))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT
  at = f" (step {out['step']})" if out["step"] is not None else ""
  print(f"{args.model_dir}{at}: held-out loss {out['loss']:.4f}, perplexity "
        f"{out['perplexity']:.2f}, over {out['batches']} batches ({out['tokens']:,} tokens)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
