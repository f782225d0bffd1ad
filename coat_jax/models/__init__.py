"""Models: Llama (Flax NNX) with precision modes, presets and Hugging Face import."""
from coat_jax.models.llama import (PRESETS, Llama, LlamaConfig, flops_per_token, num_params)

__all__ = ["PRESETS", "Llama", "LlamaConfig", "flops_per_token", "num_params"]
