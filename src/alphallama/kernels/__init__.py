"""Triton kernels, each beside a plain-torch reference of the same function.

QuantWeight holds a GGUF tensor's bits on the device; qmatmul (kernels/gemv/qmatmul.py)
multiplies by it without a dequantized copy, position-invariant per row (exact mode).
The package itself and the weight formats are torch only: the Triton kernels are
imported from their modules, by the GPU runtime, so the CPU path runs without triton."""
from .formats.qweight import FORMATS, QuantWeight, format_of

__all__ = ["FORMATS", "QuantWeight", "format_of"]
