"""GGUF files: the header reader, the architectures, dequantizers and the synthetic writers.

arch is imported first: it completes its table with the hybrids' (arch_qwen35, which builds on
arch's names), so importing arch_qwen35 (or a module that does) before arch would find arch
half made."""
from . import arch  # noqa: F401
