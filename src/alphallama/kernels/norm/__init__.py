"""Norms of the decode round (residual add + RMSNorm, with the next GEMV's activations)."""
