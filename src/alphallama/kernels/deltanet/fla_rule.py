"""The prefill's delta rule by flash-linear-attention's chunk pipeline (fla-core, a GPU extra),
where it is importable and the rows are on CUDA; ours (prefill.chunk_delta_rule) elsewhere.

Why (docs/decisions/deltanet-kernels.md, H100): fla's `chunk_gated_delta_rule` takes 1.04 ms a
layer at 512 rows and 0.97 ms at 4096, ours 7.58 and 55.7 (ours solves each 64-row chunk row by
row on CUDA cores). Its solve runs in TF32: 1.6e-3 of the output's largest value against
float64, inside the prefill's float32 tolerance and outside every bit contract, as every
prefill path is (a prompt's rows are never compared bit for bit with a round's).

The same inputs as ours: the conv output xc [T, C] = [q | k | v] with q, k L2-normalised per key
head; alpha, beta [T, Hv] the raw projections (gates() makes the log-decay and the write
strength); state [Hv, dk, dv] updated in place. q and k are expanded to the value heads by the
layer's own key-head map (tiled for qwen35, grouped for qwen3next) before fla sees them, so
fla's grouped value attention is never relied on for the map.
"""
from __future__ import annotations

import importlib
import sys
from functools import cache

import torch

from ...model.deltanet import gates
from .common import DeltaNetShape
from .step import DeltaNetWeights


@cache
def _fla():
    """fla.ops.gated_delta_rule, or the reason it cannot be imported (str)."""
    try:
        return importlib.import_module("fla.ops.gated_delta_rule")
    except Exception as e:          # not installed, or its import failed (a triton or torch it does not know)
        return f"fla-core is not importable ({type(e).__name__}: {e})"


def fla_unavailable(device: torch.device) -> str | None:
    """Why fla's chunk pipeline cannot run the prefill on device (None: it can)."""
    if torch.device(device).type != "cuda":
        return "fla's kernels run on CUDA only"
    mod = _fla()
    return mod if isinstance(mod, str) else None


def fla_delta_rule(xc: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, w: DeltaNetWeights,
                   state: torch.Tensor, shape: DeltaNetShape, block_v: int | None = None) -> torch.Tensor:
    """prefill.chunk_delta_rule's contract through fla: xc [T, C], alpha, beta [T, Hv], state
    [Hv, dk, dv] (in place) -> out [T, Hv, dv] float32. block_v: ours only (ignored)."""
    mod = _fla()
    if isinstance(mod, str):
        raise RuntimeError(mod)
    T, K = xc.shape[0], shape.hk * shape.dk
    kh = shape.key_head().to(xc.device)                                          # [Hv]
    q = xc[:, :K].view(T, shape.hk, shape.dk)[:, kh]                             # [T, Hv, dk]
    k = xc[:, K:2 * K].view(T, shape.hk, shape.dk)[:, kh]                        # [T, Hv, dk]
    v = xc[:, 2 * K:].view(T, shape.hv, shape.dv)                                # [T, Hv, dv]
    g, b = gates(alpha.float(), beta.float(), w.dt_bias, w.ssm_a)                # [T, Hv] each
    o, final = mod.chunk_gated_delta_rule(q[None].float(), k[None].float(), v[None].float().contiguous(),
                                          g[None].contiguous(), b[None].contiguous(), scale=shape.dk ** -0.5,
                                          initial_state=state[None].float(), output_final_state=True)
    state.copy_(final[0])
    return o[0].float()                                                          # [T, Hv, dv]


class _FlaOrOurs:
    """fla_delta_rule until it raises once (a triton or driver fla was not built for: its kernels
    compile at the first call), then ours from then on, with one warning. fla leaves the state
    untouched until it returns, so the failed chunk is redone by ours from the same inputs."""
    name = "fla"

    def __init__(self):
        self.failed: str | None = None

    def __call__(self, xc, alpha, beta, w, state, shape, block_v=None):
        if self.failed is None:
            try:
                return fla_delta_rule(xc, alpha, beta, w, state, shape)
            except Exception as e:      # any failure of fla's kernels: ours is always there
                self.failed = f"{type(e).__name__}: {e}"[:300]
                print(f"alphallama: warning: fla's delta rule failed ({self.failed}); the prefill runs "
                      f"AlphaLlama's own from now on", file=sys.stderr)
        from .prefill import BLOCK_V, chunk_delta_rule
        return chunk_delta_rule(xc, alpha, beta, w, state, shape, block_v or BLOCK_V)


def prefill_rule(choice: str, device: torch.device) -> tuple[str, object | None]:
    """The delta rule of a hybrid's prefill chunks: ("fla", fla's rule falling back to ours should it
    fail) where choice is "fla" and fla imports on device, else ("ours", None) (deltanet_prefill's own)."""
    if choice == "fla" and fla_unavailable(device) is None:
        return "fla", _FlaOrOurs()
    return "ours", None
