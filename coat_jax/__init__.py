"""coat-jax: memory-efficient FP8 training for JAX (COAT: FP8 optimizer states and activations)."""
__version__ = "0.1.0"   # the package's one version: pyproject.toml reads it; CHANGELOG.md lists it

from coat_jax.formats import E4M3, E5M2, INT8, FORMATS, Format, get_format, saturating_cast
from coat_jax.quantize import (QuantizedArray, amax_two_stage, dequantize, fake_quantize,
                               group_amax, quantize_per_group, quantize_per_tensor)

__all__ = [
    "E4M3", "E5M2", "INT8", "FORMATS", "Format", "get_format", "saturating_cast",
    "QuantizedArray", "amax_two_stage", "dequantize", "fake_quantize", "group_amax",
    "quantize_per_group", "quantize_per_tensor",
]

from coat_jax.optim import coat_adamw, coat_adamw_apply, optimizer_state_bytes, state_shardings  # noqa: E402
from coat_jax.models.llama import Llama, LlamaConfig  # noqa: E402
from coat_jax.models.decode import generate  # noqa: E402

__all__ += ["coat_adamw", "coat_adamw_apply", "optimizer_state_bytes", "state_shardings", "Llama",
            "LlamaConfig", "generate"]
