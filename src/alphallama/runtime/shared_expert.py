"""The shared expert: a dense SwiGLU FFN beside a layer's routed experts, its output
scaled per row by sigmoid(h . gate_inp) and added to theirs (qwen2moe; the Qwen3.5 /
qwen3next hybrids' MoE layers have the same one):

    ffn(h) = routed(h) + sigmoid(h . g) * down(silu(gate h) * up h)

Every piece is per row: the Linears' GEMVs (their plans keep a row's bits at any width),
the gate's one-row qmatmul (as the router's), SiLU and the elementwise scale, so a
round's rows keep the bits they have alone (exact mode)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..gguf.reader import TensorInfo
from ..kernels.activations.silu import silu_mul
from ..kernels.formats.qweight import QuantWeight
from ..kernels.gemv.qmatmul import qmatmul
from ..kernels.gemv.registry import ROWS_PER_THREAD
from .linear import Linear


class SharedExpert:
    def __init__(self, gate_up: Linear, down: Linear, gate_inp: TensorInfo, device):
        self.gate_up, self.down = gate_up, down                          # [2S, D], [D, S]
        D = gate_inp.shape[-1]
        self.gate = QuantWeight.from_raw(gate_inp.data, gate_inp.qtype, (1, D), device)   # [1, D]
        self.nbytes = gate_up.nbytes + down.nbytes + self.gate.nbytes

    def scale(self, h: torch.Tensor) -> torch.Tensor:
        """sigmoid(h . g): [W, D] -> [W, 1]."""
        return torch.sigmoid(qmatmul(h, self.gate, rows_per_thread=ROWS_PER_THREAD))

    def __call__(self, h: torch.Tensor, act_dtype: torch.dtype, q8: dict | None = None,
                 pdl: bool = False, gemm: Callable[[Linear, torch.Tensor], torch.Tensor] | None = None
                 ) -> torch.Tensor:
        """h [W, D] (q8: its int8 activations by layout, where the norm made them) -> [W, D] fp32.
        gemm: a prefill chunk's (Linear, x) -> x @ w^T through its scratch (gpu_prefill.gemm_linear);
        None: the Linears' own GEMVs."""
        gu = self.gate_up(h, q8, pdl) if gemm is None else gemm(self.gate_up, h)      # [W, 2S]
        sm = silu_mul(gu, act_dtype, pdl)                                          # [W, S]
        y = self.down(sm, None, pdl) if gemm is None else gemm(self.down, sm)       # [W, D]
        return self.scale(h) * y
