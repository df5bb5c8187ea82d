"""Gated DeltaNet kernels (the recurrent layers of qwen3next / qwen35 / qwen35moe): the
decode / verify / commit step over a round of one sequence (step.py), the chunked prefill
(prefill.py), the conv ring and shared pieces (common.py), plain-torch references built on
model.deltanet (reference.py). docs/decisions/deltanet-kernels.md has the contracts."""
