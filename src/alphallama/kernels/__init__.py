"""Triton kernels, each beside a plain-torch reference of the same function.

QuantWeight holds a GGUF tensor's bits on the device; qmatmul multiplies by it
without a dequantized copy, position-invariant per row (exact mode)."""
from .qmatmul import qmatmul, qmatmul_ref, qmatmul_torch, tile
from .qweight import FORMATS, QuantWeight, format_of

__all__ = ["FORMATS", "QuantWeight", "format_of", "qmatmul", "qmatmul_ref", "qmatmul_torch", "tile"]
