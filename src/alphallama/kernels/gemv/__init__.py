"""Decode GEMVs: one weight against W activation rows (qmatmul fp32, the int8 / q8_K dp4a and mma kernels)."""
