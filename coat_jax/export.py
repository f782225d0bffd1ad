"""Export a train.py run's checkpoint as a Hugging Face Llama directory.

  python -m coat_jax.export RUN_DIR HF_DIR [--step N] [--dtype bfloat16] [--overwrite]

Writes HF_DIR/config.json and the safetensors weights (`coat_jax.models.save_llama`) of the
run's newest intact checkpoint (or step N), and HF_DIR/tokenizer.json when the run has a
tokenizer. transformers' `AutoModelForCausalLM.from_pretrained(HF_DIR)` loads it; so do
`coat_jax.models.load_llama`, `python -m coat_jax.sample` and train.py's `model.init_from`.
Exit status 0 when written, 2 for bad input (one line on stderr: no run, no such step, a
directory that already holds a model), 5 when HF_DIR cannot be written.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from coat_jax.errors import EXIT_BAD_INPUT, EXIT_STORAGE


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m coat_jax.export",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("run_dir", help="a train.py run directory (run.out_dir)")
  p.add_argument("hf_dir", help="the Hugging Face directory to write")
  p.add_argument("--step", type=int, default=None,
                 help="checkpoint step (default: the newest intact)")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                 help="storage dtype of the weights (default bfloat16)")
  p.add_argument("--max-shard-gb", type=float, default=5.0,
                 help="shard the weights above this many GB (default 5, as transformers)")
  p.add_argument("--overwrite", action="store_true",
                 help="replace the model files of a directory that already holds a model")
  return p.parse_args(argv)


def export(run_dir, hf_dir, *, step=None, dtype="bfloat16", max_shard_gb=5.0, overwrite=False,
           log=print) -> int:
  """Exports and returns the checkpoint step written (module docstring)."""
  from coat_jax.models import save_llama
  from coat_jax.training.run_model import TOKENIZER_FILE, load_run_model

  if not max_shard_gb > 0:
    raise ValueError(f"--max-shard-gb must be > 0, got {max_shard_gb}")
  model, step = load_run_model(run_dir, step)
  out = save_llama(model, hf_dir, dtype=dtype, max_shard_bytes=int(max_shard_gb * 1e9),
                   overwrite=overwrite)
  tokenizer = Path(run_dir) / TOKENIZER_FILE
  if tokenizer.is_file():
    shutil.copyfile(tokenizer, out / TOKENIZER_FILE)
  log(f"[export] step {step} of {run_dir} -> {out} ({dtype}"
      f"{', with tokenizer.json' if tokenizer.is_file() else ', no tokenizer in the run'})")
  return step


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    export(args.run_dir, args.hf_dir, step=args.step, dtype=args.dtype,
           max_shard_gb=args.max_shard_gb, overwrite=args.overwrite)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT
  except OSError as e:
    print(f"error: cannot write {args.hf_dir}: {e}", file=sys.stderr)
    return EXIT_STORAGE
  return 0


if __name__ == "__main__":
  sys.exit(main())
