"""Flax NNX modules over coat_jax.ops (one code path for the "bf16", "fp8_linear" and "coat" modes)."""
from coat_jax.nn.layers import (MODES, MLP, Attention, DecoderBlock, Embedding, Linear, RMSNorm,
                                check_mode)

__all__ = ["MODES", "MLP", "Attention", "DecoderBlock", "Embedding", "Linear", "RMSNorm", "check_mode"]
