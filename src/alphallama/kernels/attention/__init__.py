"""Attention: the decode round's split-KV attention and its input (bias, q/k norm, RoPE, KV write)."""
