"""Writes a randomly initialised Hugging Face Llama directory of a preset's shape, with a tokenizer
and supervised fine-tuning data, all made locally: the offline stand-in for a downloaded
checkpoint when a fine-tuning recipe is measured for speed and memory (the loss means nothing).

  python scripts/make_random_hf.py --preset llama2-7b --out /tmp/llama2-7b-random \
      [--sft /tmp/sft.jsonl --sft-examples 20000] [--dtype bfloat16] [--seed 0]

OUT receives config.json, the safetensors weights (`coat_jax.models.save_llama`; the model's own
initialisation, std 0.02, made on the CPU in bfloat16: about 2 bytes per parameter of host
memory, twice that while writing) and tokenizer.json (a byte-level BPE trained on the Python
standard library's sources, at most the preset's vocabulary). --sft writes prompt/response and
chat examples made from the standard library (scripts/make_sft_data.py).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the weights are made on the host

from flax import nnx  # noqa: E402

from coat_jax.models import PRESETS, Llama, LlamaConfig, num_params, save_llama  # noqa: E402
from coat_jax.training import corpus  # noqa: E402


def write_sft(path: Path, examples: int, max_chars: int) -> int:
  spec = importlib.util.spec_from_file_location(
      "make_sft_data", Path(__file__).resolve().parent / "make_sft_data.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  path.parent.mkdir(parents=True, exist_ok=True)
  n = 0
  with open(path, "w", encoding="utf-8") as f:
    while n < examples:   # the stdlib has a few thousand examples: cycle for more
      before = n
      for prompt, response in module.examples(max_chars):
        f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
        n += 1
        if n == examples:
          break
      if n == before:
        raise ValueError(f"no examples of at most {max_chars} characters in the stdlib")
  return n


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
  parser.add_argument("--out", required=True, type=Path)
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--max-shard-gb", type=float, default=5.0)
  parser.add_argument("--corpus-bytes", type=int, default=20_000_000,
                      help="stdlib bytes the tokenizer is trained on")
  parser.add_argument("--sft", type=Path, default=None, help="also write sft examples here")
  parser.add_argument("--sft-examples", type=int, default=20000)
  parser.add_argument("--sft-max-chars", type=int, default=6000,
                      help="longest example in characters (about 2000 tokens)")
  args = parser.parse_args()

  t0 = time.time()
  cfg = LlamaConfig.from_name(args.preset, param_dtype=args.dtype, dtype=args.dtype,
                              scan_layers=False)   # no stacked copy of the layers
  model = Llama(cfg, rngs=nnx.Rngs(args.seed))
  print(f"[random] {args.preset}: {num_params(cfg) / 1e6:,.1f}M parameters made in "
        f"{time.time() - t0:.0f} s", flush=True)
  save_llama(model, args.out, dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * 1e9))
  del model
  print(f"[random] weights written to {args.out} ({time.time() - t0:.0f} s)", flush=True)
  texts = corpus.read_texts(corpus.stdlib_files(args.corpus_bytes))
  tokenizer = corpus.train_bpe(texts, cfg.vocab_size)
  corpus.atomic_write_bytes(args.out / "tokenizer.json", tokenizer.to_str().encode("utf-8"))
  print(f"[random] tokenizer.json: byte-level BPE of {tokenizer.get_vocab_size()} ids "
        f"(model vocabulary {cfg.vocab_size})", flush=True)
  if args.sft is not None:
    n = write_sft(args.sft, args.sft_examples, args.sft_max_chars)
    print(f"[random] {n} sft examples written to {args.sft}", flush=True)
  print(f"[random] done in {time.time() - t0:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
