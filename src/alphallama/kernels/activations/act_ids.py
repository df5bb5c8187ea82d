"""The gated activations' ids and gpt-oss's constants, without torch or triton: the kernels'
ACT constexpr (silu.gated), the expert contract's activations (moe/expert_q8.CONTRACT_ACTS)
and the CPU workers' `act` (offload/native) all take them from here."""
from __future__ import annotations

# Variant.ffn_act -> its id
ACT_IDS = {"silu": 0, "gelu": 1, "swiglu_oai": 2}
OAI_ALPHA = 1.702   # gpt-oss's swiglu_oai (llama.cpp's constants; model/layers.swiglu_oai)
OAI_LIMIT = 7.0
