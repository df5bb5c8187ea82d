"""Plain-torch references of the DeltaNet kernels, built from the CPU model's own helpers
(model.deltanet), in any dtype (the tests run them in float64)."""
from __future__ import annotations

import torch

from ...model.deltanet import causal_conv, delta_rule, gates, split_qkv
from .common import DeltaNetShape


def conv_qkv_ref(mix: torch.Tensor, conv_state: torch.Tensor, conv_w: torch.Tensor, shape: DeltaNetShape,
                 dtype: torch.dtype = torch.float64):
    """mix [T, C] after the conv state [d-1, C] -> q, k [T, Hv, dk] (normalised, expanded to
    the value heads), v [T, Hv, dv], the new conv state [d-1, C]."""
    xc, conv_new = causal_conv(mix.to(dtype), conv_state.to(dtype), conv_w.to(dtype))    # [T, C]
    q, k, v = split_qkv(xc, shape.hk, shape.dk, shape.key_head(), shape.eps)
    return q, k, v, conv_new


def layer_ref(mix, alpha, beta, w, conv_state, state, shape: DeltaNetShape, dtype: torch.dtype = torch.float64):
    """The recurrent layer over T rows, token by token (the CPU model's path).
    -> (out [T, Hv, dv], new conv state [d-1, C], new state [Hv, dk, dv], [state after each row])."""
    q, k, v, conv_new = conv_qkv_ref(mix, conv_state, w.conv_w, shape, dtype)
    g, b = gates(alpha.to(dtype), beta.to(dtype), w.dt_bias.to(dtype), w.ssm_a.to(dtype))   # [T, Hv]
    states: list[torch.Tensor] = []
    o, S = delta_rule(q, k, v, g, b, state.to(dtype), states)
    return o, conv_new, S, states
