"""Routed experts: routing, the experts' GEMVs (fp32, int8, the CPU-tier contract), the prefill grouped GEMM."""
