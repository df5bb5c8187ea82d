"""Activation functions of the FFN (SiLU(gate) * up)."""
