"""Precision-mode ops ("bf16", "fp8_linear", "coat") used by the models."""
from coat_jax.ops.attention import (ATTENTION_RESIDUALS, attention, attention_keeps_output,
                                   check_attention_residuals, segment_mask)
from coat_jax.ops.cross_entropy import masked_mean, softmax_cross_entropy
from coat_jax.ops.linear_layer import (FP8_RESIDUALS, LINEAR_RESIDUALS, check_linear_residuals,
                                      linear, linears, quantize_input)
from coat_jax.ops.lm_head import lm_head
from coat_jax.ops.lm_head_loss import lm_head_loss
from coat_jax.ops.norm import rmsnorm
from coat_jax.ops.residual import residual_add
from coat_jax.ops.rope import LLAMA3_ROPE_KEYS, apply_rope, rope_frequencies
from coat_jax.ops.swiglu import swiglu, swiglu_linears

__all__ = ["ATTENTION_RESIDUALS", "FP8_RESIDUALS", "LINEAR_RESIDUALS", "LLAMA3_ROPE_KEYS",
           "apply_rope", "attention", "attention_keeps_output", "check_attention_residuals",
           "check_linear_residuals", "linear", "linears", "lm_head",
           "lm_head_loss", "masked_mean", "quantize_input", "residual_add", "rmsnorm",
           "rope_frequencies", "segment_mask", "softmax_cross_entropy", "swiglu", "swiglu_linears"]
