"""Programmatic dependent launch (PDL) for the decode round's kernels.

A kernel launched with `launch_pdl` may start while the kernel before it in the stream
still runs. It lets its own dependents launch early (griddepcontrol.launch_dependents:
they start once every program of this grid has said so or exited, i.e. during its last
wave) and waits (griddepcontrol.wait) for the previous grid to complete and flush before
it reads anything that grid wrote, and before it writes anything an earlier kernel may
still read. Work that reads no earlier output (a GEMV's first weights) may come before
the wait: its latency then overlaps the previous kernel's tail. A grid completes only
after its own wait, so the chain stays ordered transitively; kernels launched without
the attribute (torch's) keep plain stream order.

A wrapper launches with PDL only when asked (`pdl=True`, config engine.pdl) and on CUDA
(the interpreter has no griddepcontrol). On by default, for the dense and the MoE kernels:
the same bits, and each launch boundary's gap mostly hidden (docs/decisions/pdl.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    if PDL:
        gdc_wait()


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Both, at a kernel's top: for kernels whose first access depends on the last one."""
    pdl_trigger(PDL)
    pdl_wait(PDL)


def pdl_kwargs(pdl: bool, device: torch.device) -> dict:
    """Launch arguments: the kernel's PDL constexpr and the launch attribute, or nothing."""
    return {"PDL": True, "launch_pdl": True} if pdl and torch.device(device).type == "cuda" else {}
