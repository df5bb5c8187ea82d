"""Held-out evaluation of a distilled MTP head, in the drafter's terms.

Teacher-forced on a sequence, the depth-j entry at position n+j-1 is exactly draft j of
a round whose bonus token sits at position n, provided drafts 1..j-1 were right (they
then equal the sequence's tokens). On the model's own greedy output a draft is accepted
iff it equals the teacher's top-1, so per round starting at n:

    survive_k(n) = prod_{j=1..k} agree_j[n+j-1]

its mean is chain survival at depth k, survive_k / survive_{k-1} the conditional hit
rate, and 1 + sum_k survive_k the tokens per round of a depth-K drafter without a
gate. With the min-p gate, draft j is proposed only while every draft so far had
probability >= min_p.
"""
from __future__ import annotations

import torch

from .distill_loss import distill_kl
from .distill_teacher import Teacher

CALIB_BINS = 10


def _rounds(agree: torch.Tensor, ok: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """agree, ok: [K, B, T] bool (depth k entry at p right / allowed) -> survive, proposed
    [K, B, T'] over round starts n = 1..T-K (every draft of the round inside the row)."""
    T = agree.shape[2]
    surv, prop = [], []
    run_a = torch.ones_like(agree[0, :, 1:T - K + 1])
    run_p = run_a.clone()
    for k in range(K):
        a = agree[k, :, 1 + k:T - K + 1 + k]                                   # draft k+1 of rounds n=1..
        o = ok[k, :, 1 + k:T - K + 1 + k]
        run_p = run_p & o
        run_a = run_a & a
        surv.append(run_a)
        prop.append(run_p)
    return torch.stack(surv), torch.stack(prop)


@torch.no_grad()
def evaluate(head, teacher: Teacher, rows: torch.Tensor, depths: int, batch: int,
             counted: torch.Tensor | None = None, min_p: float = 0.5) -> dict:
    """Statistics of `head` on rows [N, T] (int64). counted [N, T] bool: positions whose
    entries count (e.g. the answer part of a chat row); default all."""
    K, dev = depths, teacher.device
    per = [dict(kl=0.0, agree=0.0, n=0.0) for _ in range(K)]
    calib = torch.zeros(K, CALIB_BINS, 2, dtype=torch.float64)                 # [K, bins, (n, hits)]
    surv_sum = torch.zeros(K, dtype=torch.float64)
    gated = torch.zeros(2, dtype=torch.float64)                                # proposed, accepted
    n_rounds, self_agree, self_n = 0, 0.0, 0.0
    for s in range(0, rows.shape[0], batch):
        toks, cnt = rows[s:s + batch], None if counted is None else counted[s:s + batch]
        if cnt is not None and cnt.any():   # cut the padding after the batch's last counted entry
            end = int(cnt.any(0).nonzero().max()) + 2
            toks, cnt = toks[:, :end], cnt[:, :end]
        toks = toks.to(dev)                                                    # [B, T]
        B, T = toks.shape
        cnt = (torch.ones(B, T, dtype=torch.bool) if cnt is None else cnt).to(dev)
        h = teacher.forward(toks)                                              # [B, T, D]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            states = head(h, toks, teacher.embedding, depths=K)
        student = torch.stack(states).reshape(K, B * T, -1)                    # [K, B*T, D]
        pos = torch.arange(T, device=dev)
        valid = torch.stack([(pos >= k)[None, :].expand(B, T) for k in range(1, K + 1)])  # [K, B, T]
        valid = valid & cnt[None]
        _, st = distill_kl(student, teacher.normed(h).reshape(B * T, -1), teacher.output,
                           valid.reshape(K, -1))
        kl, agree, sp = (x.view(K, B, T) for x in (st.kl, st.agree, st.student_p))
        # how often the sequence's next token is the teacher's top-1 (1.0 on its own greedy
        # output up to bf16 near-ties; for corpus text, the model's own accuracy)
        nxt = cnt[:, :-1]
        self_agree += float((st.teacher_top.view(B, T)[:, :-1] == toks[:, 1:])[nxt].double().sum())
        self_n += float(nxt.sum())
        for k in range(K):
            v = valid[k]
            per[k]["kl"] += float(kl[k][v].double().sum())
            per[k]["agree"] += float(agree[k][v].double().sum())
            per[k]["n"] += float(v.sum())
            bins = (sp[k][v] * CALIB_BINS).long().clamp(max=CALIB_BINS - 1).cpu()
            calib[k, :, 0] += torch.bincount(bins, minlength=CALIB_BINS).double()
            calib[k, :, 1] += torch.bincount(bins, weights=agree[k][v].double().cpu(), minlength=CALIB_BINS)
        surv, prop = _rounds(agree, sp >= min_p, K)                            # [K, B, T-K]
        start_ok = cnt[:, 1:T - K + 1]
        for j in range(1, K):   # every draft of a counted round is a counted position
            start_ok = start_ok & cnt[:, 1 + j:T - K + 1 + j]
        n_rounds += int(start_ok.sum())
        surv_sum += surv[:, start_ok].double().sum(-1).cpu()
        gated[0] += float(prop[:, start_ok].double().sum())
        gated[1] += float((prop & surv)[:, start_ok].double().sum())
    out = {"depths": []}
    prev = 1.0
    for k in range(K):
        n = max(per[k]["n"], 1.0)
        survive = float(surv_sum[k]) / max(n_rounds, 1)
        out["depths"].append({
            "depth": k + 1, "entries": int(per[k]["n"]), "kl": per[k]["kl"] / n,
            "top1_agree": per[k]["agree"] / n,
            "chain_survival": survive, "conditional_hit": survive / prev if prev > 0 else 0.0,
            "calibration": [{"p_lo": b / CALIB_BINS, "n": int(calib[k, b, 0]),
                             "hit": float(calib[k, b, 1] / calib[k, b, 0]) if calib[k, b, 0] else None}
                            for b in range(CALIB_BINS)],
        })
        prev = survive
    out["rounds"] = n_rounds
    out["teacher_top1_is_next_token"] = self_agree / max(self_n, 1.0)
    out["tokens_per_round_ungated"] = 1.0 + float(surv_sum.sum()) / max(n_rounds, 1)
    out["min_p"] = min_p
    out["gated_drafts_per_round"] = float(gated[0]) / max(n_rounds, 1)
    out["gated_tokens_per_round"] = 1.0 + float(gated[1]) / max(n_rounds, 1)
    return out


def pack_answers(chats: list[tuple[list[int], list[int]]], sep: int):
    """One conversation per row, from its start (so the teacher sees the context it
    answered in), padded with `sep` to the longest: rows [N, L] and a mask of the
    entries that draft the answer: p counts when x_p and x_{p+1} are both answer
    tokens (the first answer token comes from the main model, not from a draft)."""
    chats = sorted(chats, key=lambda c: len(c[0]) + len(c[1]))   # batches of similar length
    L = max(len(p) + len(a) for p, a in chats)
    rows = torch.full((len(chats), L), sep, dtype=torch.int64)
    mask = torch.zeros(len(chats), L, dtype=torch.bool)
    for i, (p, a) in enumerate(chats):
        rows[i, :len(p) + len(a)] = torch.tensor(p + a)
        mask[i, len(p):len(p) + len(a) - 1] = True
    return rows, mask


def summary(ev: dict) -> dict:
    """The headline of an evaluation: agreement and tokens per round."""
    return {name: {"top1_agree": [d["top1_agree"] for d in e["depths"]],
                   "tokens_per_round_ungated": e["tokens_per_round_ungated"],
                   "gated_tokens_per_round": e["gated_tokens_per_round"]} for name, e in ev.items()}
