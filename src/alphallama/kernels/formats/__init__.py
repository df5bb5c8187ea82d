"""Weight formats: GGUF blocks re-laid as planes (QuantWeight), their decoders, dequantization."""
