"""Writes a tiny random Hugging Face Llama checkpoint and its float32 logits, for import tests.

Runs under .venv-hf (Python 3.11 + torch + transformers; scripts/setup_hf_env.sh), never under
the jax venv. Nothing is downloaded: the model is built in code from a transformers LlamaConfig.

  .venv-hf/bin/python scripts/make_hf_reference.py --out DIR [--variant gqa|llama3_tied] [--seed N]

DIR receives config.json, the safetensors weights (sharded with an index for "llama3_tied"),
tokens.npy (int32, (batch, seq)) and logits.npy (float32, (batch, seq, vocab)).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

VARIANTS = {
    # Grouped-query attention, untied LM head, plain RoPE.
    "gqa": dict(vocab_size=211, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # Llama 3 RoPE scaling (short original context so the scaling changes frequencies), tied
    # embeddings, head_dim != hidden / heads, saved in several shards.
    "llama3_tied": dict(vocab_size=173, hidden_size=96, intermediate_size=160,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5,
                        tie_word_embeddings=True, rope_theta=500000.0,
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0,
                                          original_max_position_embeddings=16)),
}


def build(variant: str, seed: int) -> LlamaForCausalLM:
  torch.manual_seed(seed)
  cfg = LlamaConfig(initializer_range=0.08, attn_implementation="eager", **VARIANTS[variant])
  model = LlamaForCausalLM(cfg).to(torch.float32).eval()
  with torch.no_grad():  # norms away from 1 so that a mis-mapped norm weight shows
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
  return model


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, type=Path)
  parser.add_argument("--variant", default="gqa", choices=sorted(VARIANTS))
  parser.add_argument("--seed", default=0, type=int)
  parser.add_argument("--batch", default=2, type=int)
  parser.add_argument("--seq", default=40, type=int)
  parser.add_argument("--save-dtype", default=None, choices=["float32", "bfloat16"],
                      help="storage dtype of the weights (default: bfloat16 for llama3_tied)")
  args = parser.parse_args()
  save_dtype = args.save_dtype or ("bfloat16" if args.variant == "llama3_tied" else "float32")

  model = build(args.variant, args.seed)
  if save_dtype == "bfloat16":  # logits from the bf16-rounded weights, computed in float32
    with torch.no_grad():
      for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).to(torch.float32))
  rng = np.random.default_rng(args.seed)
  tokens = rng.integers(0, model.config.vocab_size, size=(args.batch, args.seq), dtype=np.int64)
  with torch.no_grad():
    logits = model(torch.from_numpy(tokens)).logits.to(torch.float32).numpy()
  args.out.mkdir(parents=True, exist_ok=True)
  shard = "100KB" if args.variant == "llama3_tied" else "1GB"
  model.to(getattr(torch, save_dtype)).save_pretrained(args.out, safe_serialization=True,
                                                        max_shard_size=shard)
  np.save(args.out / "tokens.npy", tokens.astype(np.int32))
  np.save(args.out / "logits.npy", logits)
  print(f"wrote {args.variant} to {args.out}: logits {logits.shape}, "
        f"files {sorted(p.name for p in args.out.iterdir())}")


if __name__ == "__main__":
  main()
