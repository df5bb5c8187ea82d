"""Models larger than the GPU: the automatic plan (plan.py), the expert store with its
VRAM slot bank and host tier (store.py), and the admission policy (policy.py)."""
