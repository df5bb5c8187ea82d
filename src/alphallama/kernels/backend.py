"""Where the Triton kernels run: on CUDA tensors, or anywhere under TRITON_INTERPRET=1
(the tests' CPU interpreter); elsewhere each wrapper takes its plain-torch path."""
from __future__ import annotations

import os

import torch


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
