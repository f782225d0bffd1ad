"""Generate text from a Hugging Face Llama directory (e.g. one `python -m coat_jax.export` wrote)
or from a train.py run directory.

  python -m coat_jax.sample MODEL_DIR --prompt TEXT [--max-new-tokens N] [--temperature T]
                            [--top-k K] [--top-p P] [--seed S] [--step N]

MODEL_DIR is a Hugging Face directory (config.json, the safetensors weights, tokenizer.json), or
a run directory (config.yaml): its newest intact checkpoint or the one of `--step`, read-only
(`coat_jax.training.load_run_model`), with the run's tokenizer.json. Prints the prompt followed
by up to N new tokens (`coat_jax.generate`: greedy at temperature 0, the default; sampling stops
at the tokenizer's end-of-text token). CPU or GPU; the compute dtype is bfloat16 on accelerators
and float32 on CPU. Exit status 2 with one line on stderr for bad input (no such directory, no
tokenizer.json, no checkpoint, a prompt too long for the model).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from coat_jax.errors import EXIT_BAD_INPUT


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m coat_jax.sample",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("model_dir", help="a Hugging Face Llama directory with tokenizer.json, or a "
                                    "train.py run directory")
  p.add_argument("--prompt", required=True, help="the text to continue")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
  p.add_argument("--top-k", type=int, default=None)
  p.add_argument("--top-p", type=float, default=None)
  p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
  p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                 help="compute dtype (auto: bfloat16 on GPU/TPU, float32 on CPU)")
  p.add_argument("--step", type=int, default=None,
                 help="a run directory's checkpoint step (default: the newest intact one)")
  return p.parse_args(argv)


def sample(model_dir, prompt: str, *, max_new_tokens=64, temperature=0.0, top_k=None, top_p=None,
           seed=0, dtype="auto", step=None) -> str:
  """The prompt and its continuation as text (module docstring); step: a run directory's
  checkpoint (None: the newest intact one)."""
  import jax
  import numpy as np

  from coat_jax.models import generate
  from coat_jax.precision import resolve_dtype
  from coat_jax.training.corpus import eos_id, load_tokenizer

  from coat_jax.training.run_model import TOKENIZER_FILE, load_model

  if Path(model_dir).is_dir() and not (Path(model_dir) / TOKENIZER_FILE).is_file():
    raise ValueError(f"{model_dir} has no tokenizer.json (a run writes one when its data has a "
                     f"tokenizer; python -m coat_jax.export copies it)")
  model, _ = load_model(model_dir, step, dtype=resolve_dtype(dtype, "--dtype"))
  tokenizer = load_tokenizer(model_dir)
  ids = tokenizer.encode(prompt, add_special_tokens=False).ids
  if not ids:
    raise ValueError("--prompt encodes to no tokens")
  new = generate(model, np.asarray([ids], np.int32), max_new_tokens, temperature=temperature,
                 top_k=top_k, top_p=top_p, rng=jax.random.key(seed))
  new = [int(t) for t in np.asarray(new[0])]
  eos = eos_id(tokenizer)
  if eos is not None and eos in new:
    new = new[:new.index(eos)]
  return tokenizer.decode(ids + new)


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    text = sample(args.model_dir, args.prompt, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  seed=args.seed, dtype=args.dtype, step=args.step)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
