"""Gated DeltaNet, the recurrent layer of the qwen3next / qwen35 hybrids (float32 reference).

Per value head, with a state S [dk, dv] and, for each token t, q_t, k_t (L2-normalised),
v_t, a log-decay g_t < 0 and a write strength beta_t in (0, 1):

    S   <- exp(g_t) * S
    u_t  = beta_t * (v_t - S^T k_t)          # the delta rule: correct what S predicts for k_t
    S   <- S + k_t u_t^T
    o_t  = S^T q_t / sqrt(dk)

q, k and v come out of a causal depthwise conv1d (window d_conv, then SiLU) over the
projected mix; its state is the last d_conv - 1 mix rows. Both are what a recurrent
layer carries from token to token. The order of operations is llama.cpp's
(ggml_gated_delta_net, the CPU op), one token after another.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def causal_conv(mix: torch.Tensor, state: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d + SiLU over T new rows.

    mix: [T, C] new inputs; state: [d_conv-1, C] the previous inputs; w: [C, d_conv]
    -> (out [T, C], new state [d_conv-1, C])."""
    d = w.shape[1]
    x = torch.cat([state, mix])                                      # [d-1+T, C]
    win = x.unfold(0, d, 1)                                          # [T, C, d]: rows t..t+d-1
    out = (win * w).sum(-1)                                          # [T, C]
    return F.silu(out), x[x.shape[0] - (d - 1):].clone()


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (llama.cpp's build_gdn_l2_norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gates(alpha: torch.Tensor, beta_logit: torch.Tensor, dt_bias: torch.Tensor,
          ssm_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) [T, Hv]: the log-decay softplus(alpha + dt_bias) * ssm_a (ssm_a < 0) and the
    write strength sigmoid(beta_logit), from the layer's alpha and beta projections."""
    return F.softplus(alpha + dt_bias) * ssm_a, torch.sigmoid(beta_logit)


def key_heads(n_v_heads: int, n_k_heads: int, tiled: bool) -> torch.Tensor:
    """[Hv] the key head each value head reads: j % Hk (tiled, qwen35) or j // (Hv / Hk)
    (grouped, qwen3next)."""
    j = torch.arange(n_v_heads)
    return j % n_k_heads if tiled else j // (n_v_heads // n_k_heads)


def split_qkv(xc: torch.Tensor, n_k_heads: int, dk: int, k_head: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv output [T, C] = [q | k | v] -> q, k [T, Hv, dk] (L2-normalised per key head,
    then expanded to the value heads by k_head [Hv]) and v [T, Hv, dv]."""
    T, K = xc.shape[0], n_k_heads * dk
    q = l2_normalize(xc[:, :K].view(T, n_k_heads, dk), eps)[:, k_head]      # [T, Hv, dk]
    k = l2_normalize(xc[:, K:2 * K].view(T, n_k_heads, dk), eps)[:, k_head]  # [T, Hv, dk]
    return q, k, xc[:, 2 * K:].view(T, k_head.shape[0], -1)                 # v: [T, Hv, dv]


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, states_out: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens, in order.

    q, k: [T, H, dk] (already expanded to the value heads); v: [T, H, dv]; g, beta: [T, H];
    state: [H, dk, dv] -> (o [T, H, dv], state after the last token). states_out, if
    given, receives a copy of the state after every token."""
    T, _, dk = q.shape
    scale = dk ** -0.5
    S = state.clone()
    out = torch.empty_like(v)                                        # [T, H, dv]
    for t in range(T):
        S = S * torch.exp(g[t])[:, None, None]                       # [H, dk, dv]
        pred = torch.einsum("hkv,hk->hv", S, k[t])                   # [H, dv]: S^T k
        u = beta[t][:, None] * (v[t] - pred)                         # [H, dv]
        S = S + k[t][:, :, None] * u[:, None, :]                     # [H, dk, dv]
        out[t] = torch.einsum("hkv,hk->hv", S, q[t]) * scale
        if states_out is not None:
            states_out.append(S.clone())
    return out, S


@dataclass(frozen=True)
class RecurrentInputs:
    """What one recurrent layer's recurrence consumed for T rows: enough to recompute
    its state for any prefix of them without the layer's projections."""
    mix: torch.Tensor     # [T, C] conv inputs
    q: torch.Tensor       # [T, H, dk]
    k: torch.Tensor       # [T, H, dk]
    v: torch.Tensor       # [T, H, dv]
    g: torch.Tensor       # [T, H]
    beta: torch.Tensor    # [T, H]


def replay(inputs: RecurrentInputs, n: int, conv_state: torch.Tensor,
           ssm_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (conv, ssm) state after the first n rows of `inputs`, from the state before them."""
    d1 = conv_state.shape[0]
    x = torch.cat([conv_state, inputs.mix[:n]])                      # [d-1+n, C]
    _, S = delta_rule(inputs.q[:n], inputs.k[:n], inputs.v[:n], inputs.g[:n], inputs.beta[:n], ssm_state)
    return x[x.shape[0] - d1:].clone(), S
