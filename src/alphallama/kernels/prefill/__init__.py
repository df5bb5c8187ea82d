"""Prefill: weights dequantized into scratch row blocks and multiplied by cuBLAS."""
