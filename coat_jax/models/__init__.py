"""Models: Llama (Flax NNX) with precision modes, presets, Hugging Face import (`load_llama`) and
export (`save_llama`), and generation with a KV cache (`generate`)."""
from coat_jax.models.decode import generate
from coat_jax.models.hf import config_from_hf, load_llama
from coat_jax.models.hf_export import hf_config, save_llama
from coat_jax.models.llama import (PRESETS, REMAT_POLICIES, Llama, LlamaConfig, flops_per_token,
                                   layer_params, num_params, resolve_loss_impl, resolve_scan_impl,
                                   stack_blocks)

__all__ = ["PRESETS", "REMAT_POLICIES", "Llama", "LlamaConfig", "config_from_hf", "flops_per_token",
           "generate", "hf_config", "layer_params", "load_llama", "num_params", "resolve_loss_impl",
           "resolve_scan_impl", "save_llama", "stack_blocks"]
