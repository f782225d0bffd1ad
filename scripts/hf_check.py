"""Runs exported checkpoints through transformers, for the export and generation tests.

Runs under .venv-hf (Python 3.11 + torch + transformers; scripts/setup_hf_env.sh), never under
the jax venv. For each DIR (a Hugging Face Llama directory, e.g. written by
`coat_jax.models.save_llama`):

  DIR/tokens.npy  (int, (batch, seq))     -> DIR/hf_logits.npy     float32 logits
  DIR/prompt.npy  (int, (batch, prompt))  -> DIR/hf_generated.npy  greedy new ids, (batch, N)

  .venv-hf/bin/python scripts/hf_check.py DIR [DIR ...] [--new-tokens N]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dirs", nargs="+", type=Path)
  parser.add_argument("--new-tokens", default=8, type=int)
  args = parser.parse_args()
  for directory in args.dirs:
    model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
      if (directory / "tokens.npy").exists():
        tokens = torch.from_numpy(np.load(directory / "tokens.npy").astype(np.int64))
        logits = model(tokens).logits.to(torch.float32).numpy()
        np.save(directory / "hf_logits.npy", logits)
      if (directory / "prompt.npy").exists():
        prompt = torch.from_numpy(np.load(directory / "prompt.npy").astype(np.int64))
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             pad_token_id=0)
        np.save(directory / "hf_generated.npy", out[:, prompt.shape[1]:].numpy().astype(np.int32))
    print(f"{directory}: {type(model).__name__}, "
          f"{sorted(p.name for p in directory.iterdir() if p.name.startswith('hf_'))}")


if __name__ == "__main__":
  main()
