"""coat-jax: memory-efficient FP8 training for JAX (COAT: FP8 optimizer states and activations)."""
from coat_jax.formats import E4M3, E5M2, INT8, FORMATS, Format, get_format, saturating_cast
from coat_jax.quantize import (QuantizedArray, amax_two_stage, dequantize, fake_quantize,
                               group_amax, quantize_per_group, quantize_per_tensor)

__all__ = [
    "E4M3", "E5M2", "INT8", "FORMATS", "Format", "get_format", "saturating_cast",
    "QuantizedArray", "amax_two_stage", "dequantize", "fake_quantize", "group_amax",
    "quantize_per_group", "quantize_per_tensor",
]

# Optional parts are imported as they land (optimizer, modules, model).
try:
  from coat_jax.optim import coat_adamw, optimizer_state_bytes, state_shardings  # noqa: F401
  __all__ += ["coat_adamw", "optimizer_state_bytes", "state_shardings"]
except ImportError:  # pragma: no cover - during bring-up only
  pass
try:
  from coat_jax.models.llama import Llama, LlamaConfig  # noqa: F401
  __all__ += ["Llama", "LlamaConfig"]
except ImportError:  # pragma: no cover
  pass
