"""Flax NNX modules over coat_jax.ops (one code path for the "bf16", "fp8_linear" and "coat" modes)."""
from coat_jax.nn.layers import MLP, Attention, DecoderBlock, Embedding, Linear, RMSNorm

__all__ = ["MLP", "Attention", "DecoderBlock", "Embedding", "Linear", "RMSNorm"]
