"""How many distinct experts w consecutive rows route to, and how many of them miss the bank.

A verify round of W rows reads, per MoE layer, the experts its W x k picks name; a wider
round names more of them, and under offload each one without a bank slot is a miss its
tier pays for (spec/offload_costs.py prices it). The expected count is learned from the
rows the store routes, one row at a time in the order the rounds ran them:

    age[l, e]      rows since expert e of layer l was last picked (0: by this row)
    hist[l, r, a]  decayed count of (row, expert) pairs whose age at that row was a, split
                   by whether the expert had a bank slot then (r = 1) or not (r = 0)

The w rows ending at a row contain expert e exactly when its age there is below w, so

    distinct(w) = sum_{a < w} hist[l, 0, a] + hist[l, 1, a]   / rows     (rows: the decayed row count)
    missed(w)   = sum_{a < w} hist[l, 0, a]                    / rows

is the decay-weighted mean over the rows seen of what a window of w rows ending there
touched (distinct(1) = k). Ages from `cap` (the widest round) up fall in no window asked
about and are not kept. A row weighs decay^(rows routed by the rounds after its own); the
counts start from a prior of `prior_rows` rows of the plan's model (estimate.py): independent
rows picking k of E uniformly, a share `hit_rate` of experts in the bank (slots / experts),
so before any routing is seen missed(1) = k (1 - hit_rate), the plan's misses a token.
"""
from __future__ import annotations

import numpy as np


class Footprint:
    def __init__(self, n_layers: int, n_experts: int, top_k: int, hit_rate: float, half_life: float,
                 prior_rows: float, cap: int = 64):
        """n_layers: the store's MoE layers (in its moe_layers order); half_life: rows;
        cap: the widest window asked for (MAX_WIDTH)."""
        if half_life <= 0 or prior_rows < 0 or not 0.0 <= hit_rate <= 1.0:
            raise ValueError(f"half_life > 0, prior_rows >= 0 and hit_rate in [0, 1], got "
                             f"{half_life}, {prior_rows}, {hit_rate}")
        self.L, self.E, self.k, self.cap = n_layers, n_experts, top_k, cap
        self.decay = 0.5 ** (1.0 / half_life)
        self.age = np.full((n_layers, n_experts), cap, dtype=np.int64)       # [L, E]
        q = min(top_k / n_experts, 1.0) if n_experts else 0.0
        p = q * (1.0 - q) ** np.arange(cap)                                  # [cap] P(age = a), independent rows
        self.hist = np.zeros((n_layers, 2, cap))                             # [L, resident?, age]
        self.hist[:, 0] = prior_rows * n_experts * (1.0 - hit_rate) * p
        self.hist[:, 1] = prior_rows * n_experts * hit_rate * p
        self.rows = float(prior_rows)
        self.seen = 0                                                        # rows observed (not decayed)
        self.version = 0                                                     # bumped per observed round

    def observe(self, ids: np.ndarray, resident: np.ndarray) -> None:
        """One round: ids [L, W, k] (its rows' picks, in row order), resident [L, E] bool
        (the bank the round ran with). Its rows weigh alike; the earlier rows decay by
        decay^W. An expert's ages over the round are runs of consecutive
        values (up from its age before the round until its first pick, then from 0 after
        each pick), added to the histogram as ranges: O(L (E + W k)) a round."""
        L, W, _ = ids.shape
        E, cap = self.E, self.cap
        res = resident.astype(np.int64).ravel()                                   # [L E]
        # every pick (layer, row, expert), ordered by (layer, expert, row)
        row = np.broadcast_to(np.arange(W)[None, :, None], ids.shape).ravel()
        key = (np.arange(L)[:, None, None] * E + ids.astype(np.int64)).ravel()   # flat layer * E + expert
        order = np.lexsort((row, key))
        key, row = key[order], row[order]
        same = np.append(key[1:] == key[:-1], False)                              # the expert's next pick follows
        nxt = np.where(same, np.append(row[1:], W), W)
        head = np.append(True, ~same[:-1])                                        # the expert's first pick
        first = np.full(L * E, W, dtype=np.int64)                                 # [L E] its row (W: none)
        first[key[head]] = row[head]
        last = np.full(L * E, -1, dtype=np.int64)
        last[key[~same]] = row[~same]
        age = self.age.ravel()
        run = first > 0                                                           # rows before the first pick
        flat = np.arange(L * E)[run]
        bucket = (key // E * 2 + res[key]) * (cap + 1)                            # [picks] its (layer, resident) block
        before = (flat // E * 2 + res[flat]) * (cap + 1)
        starts = np.concatenate([bucket, before + np.minimum(age[run] + 1, cap)])    # ranges [start, end) of ages
        ends = np.concatenate([bucket + np.minimum(nxt - row, cap), before + np.minimum(age[run] + first[run] + 1, cap)])
        n = L * 2 * (cap + 1)
        diff = np.bincount(starts, minlength=n) - np.bincount(ends, minlength=n)
        counts = np.cumsum(diff.reshape(L, 2, cap + 1), axis=2)[:, :, :cap]       # [L, 2, cap]
        self.age = np.minimum(np.where(last >= 0, W - 1 - last, age + W), cap).reshape(L, E)
        scale = self.decay ** W
        self.hist = scale * self.hist + counts
        self.rows = scale * self.rows + W
        self.seen += W
        self.version += 1

    def distinct(self) -> np.ndarray:
        """[L, cap]: expected distinct experts w = 1..cap consecutive rows pick, per layer."""
        return np.cumsum(self.hist.sum(axis=1), axis=1) / max(self.rows, 1e-12)

    def missed(self) -> np.ndarray:
        """[L, cap]: of those, the expected number without a bank slot."""
        return np.cumsum(self.hist[:, 0], axis=1) / max(self.rows, 1e-12)

    def to_dict(self) -> dict:
        d, m = self.distinct().sum(axis=0), self.missed().sum(axis=0)        # [cap]: over the layers
        widths = [w for w in (1, 2, 4, 8, 16, 32, 64) if w <= self.cap]
        return {"rows_seen": self.seen, "distinct": {w: round(float(d[w - 1]), 3) for w in widths},
                "missed": {w: round(float(m[w - 1]), 3) for w in widths}}


def missed_by_width(ids: np.ndarray, resident: np.ndarray) -> np.ndarray:
    """Exact counts for one round: ids [L, W, k], resident [L, E] bool -> [L, W]: distinct
    experts without a bank slot among its rows 0..w-1, w = 1..W."""
    L, W, _ = ids.shape
    E = resident.shape[1]
    first = np.full((L, E), W, dtype=np.int64)                                 # [L, E] first row picking e
    for m in range(W - 1, -1, -1):
        first[np.arange(L)[:, None], ids[:, m]] = m
    hit = (first < W) & ~resident
    new = np.zeros((L, W + 1), dtype=np.int64)
    np.add.at(new, (np.nonzero(hit)[0], first[hit]), 1)
    return np.cumsum(new[:, :W], axis=1)


def at_widths(counts: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """counts [L, cap] over windows of w = 1..cap rows -> [L, len(widths)] at fractional widths
    (a tier's share of a round's rows): linear between whole widths, none at 0 rows."""
    c = np.concatenate([np.zeros((counts.shape[0], 1)), counts], axis=1)   # [L, cap + 1]: w = 0..cap
    lo = np.floor(widths).astype(np.int64)
    hi, f = np.minimum(lo + 1, counts.shape[1]), widths - lo
    return c[:, lo] * (1 - f) + c[:, hi] * f


def missed_split(ids: np.ndarray, resident: np.ndarray, share: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact counts for one round split as the post kernel splits it: of the host pairs of
    rows 0..w-1 (no bank slot; (row, rank) order) the first (n share + 128) >> 8 are the CPU
    workers' (share in 0..256), the rest PCIe's. ids [L, W, k], resident [L, E] bool ->
    ([L, W], [L, W]): the distinct experts of the CPU's pairs, and of PCIe's, w = 1..W."""
    L, W, _ = ids.shape
    cpu, pcie = np.zeros((L, W), dtype=np.int64), np.zeros((L, W), dtype=np.int64)
    for i in range(L):
        for w in range(1, W + 1):
            picks = ids[i, :w].ravel()
            host = picks[~resident[i, picks]]
            limit = (len(host) * share + 128) >> 8
            cpu[i, w - 1], pcie[i, w - 1] = len(set(host[:limit].tolist())), len(set(host[limit:].tolist()))
    return cpu, pcie
