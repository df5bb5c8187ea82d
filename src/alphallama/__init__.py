"""AlphaLlama: single-user LLM inference for GGUF models."""
__version__ = "0.1.0"
