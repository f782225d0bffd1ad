"""The fused COAT AdamW step on FP8 moments in Triton: adam_step_triton.py (kernels and launcher),
adam_tile_triton.py (the per-tile math), adam_operands.py (operand checks)."""
