"""The persistent layer kernel's instruction queues (round_layer.cu), built on the host.

An instruction is NI int32 fields (the F_* / A_* enums of round_layer.cu, mirrored in
FIELDS). The builder takes instructions stage by stage in dependency order, deals each
stage's tiles round-robin over the CTAs (a cursor carried across stages, so a small stage
starts where the last one ended), and then, in each CTA's queue, moves the signal of a
GEMV tile onto the next tile when both signal the same counter (one atomic per run of
tiles instead of one a tile; the target counts tiles either way). `simulate` runs the
queues' waits and signals as the kernel would and refuses a schedule that can deadlock.
Plain Python: tested on the CPU."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

NI = 32
OPS = {"gemv": 1, "router": 2, "attn": 3}
PRO = {"plain": 0, "norm": 1, "multi": 2, "normf": 3}
EPI = {"store": 0, "res": 1, "silu": 2, "moe": 3}
MODES = {"rows": 0, "expert": 1, "ranks": 2}
COMMON = ("op", "wait", "target", "sig", "sign", "act", "dump", "eps")
GEMV = ("w", "nslots", "row0", "nrows", "ngroups", "gstride", "mode", "rpe", "rank", "route", "rctr",
        "rtarget", "pro", "src", "normw", "sstride", "epi", "dst", "res", "doff", "arrive", "ntiles", "topk",
        "nexp")
ATTN = ("qkv", "kc", "vc", "qoff", "koff", "voff", "pos", "k0", "k1", "qn", "kn", "cos", "sin", "part",
        "split", "nsplit", "arrive", "out", "ooff", "hg")
FIELDS = {"gemv": {n: i for i, n in enumerate(COMMON + GEMV)},
          "attn": {n: i for i, n in enumerate(COMMON + ATTN)}}
FIELDS["router"] = FIELDS["gemv"]


def f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


@dataclass
class Instr:
    kind: str                      # gemv | router | attn
    f: dict[str, int]
    stage: int = 0

    def row(self) -> list[int]:
        names = COMMON + (ATTN if self.kind == "attn" else GEMV)
        idx = FIELDS[self.kind]
        out = [-1 if n in ("wait", "sig", "dump", "rctr") else 0 for n in names] + [0] * (NI - len(names))
        out[idx["op"]] = OPS[self.kind]
        for k, v in self.f.items():
            out[idx[k]] = int(v)
        return out


@dataclass
class Schedule:
    """Counters by name, pointers by value (a table the kernel indexes), instructions by stage."""
    counters: dict[str, int] = field(default_factory=dict)
    ptrs: list[int] = field(default_factory=list)
    stages: list[list[Instr]] = field(default_factory=list)
    _ptr_index: dict[int, int] = field(default_factory=dict)
    _acts: int = 0

    def counter(self, name: str) -> int:
        return self.counters.setdefault(name, len(self.counters))

    def ptr(self, *addresses: int) -> int:
        """Index of consecutive table entries holding `addresses` (reused when already there)."""
        key = addresses[0] if len(addresses) == 1 else None
        if key is not None and key in self._ptr_index:
            return self._ptr_index[key]
        i = len(self.ptrs)
        self.ptrs.extend(addresses)
        if key is not None:
            self._ptr_index[key] = i
        return i

    def act_id(self) -> int:
        """A fresh id for one stage's activations (the consumers' prologue runs once a stage)."""
        self._acts += 1
        return self._acts

    def stage(self, instrs: list[Instr]) -> None:
        for ins in instrs:
            ins.stage = len(self.stages)
        self.stages.append(instrs)

    def queues(self, n_cta: int) -> list[list[Instr]]:
        qs: list[list[Instr]] = [[] for _ in range(n_cta)]
        cursor = 0
        for st in self.stages:
            for ins in st:
                qs[cursor % n_cta].append(ins)
                cursor += 1
        for q in qs:                                  # one signal a run of same-counter GEMV tiles
            for a, b in zip(q, q[1:]):
                if (a.kind == b.kind == "gemv" and a.stage == b.stage and a.f.get("sig", -1) >= 0
                        and a.f.get("sig") == b.f.get("sig")):
                    b.f["sign"] = b.f.get("sign", 0) + a.f.get("sign", 0)
                    a.f["sign"] = 0
        return qs

    def build(self, n_cta: int) -> tuple[list[list[int]], list[int], list[list[Instr]]]:
        """(instruction rows [n, NI], queue starts [n_cta + 1], the queues)."""
        qs = self.queues(n_cta)
        simulate(qs, len(self.counters))
        rows, starts = [], [0]
        for q in qs:
            rows.extend(ins.row() for ins in q)
            starts.append(len(rows))
        return rows, starts, qs


def simulate(queues: list[list[Instr]], n_counters: int) -> None:
    """Run the queues' waits and signals in the kernel's order (each CTA in its queue's
    order; arrival counters for the tiles that merge: the router's top-k, attention's
    splits); raise if some CTA can never proceed."""
    ctr = [0] * n_counters
    arrived: dict[int, int] = {}
    pos = [0] * len(queues)
    left = sum(map(len, queues))
    while left:
        moved = False
        for c, q in enumerate(queues):
            while pos[c] < len(q):
                ins = q[pos[c]]
                f = ins.f
                if f.get("wait", -1) >= 0 and ctr[f["wait"]] < f["target"]:
                    break
                if ins.kind == "gemv" and f.get("mode", 0) != 0 and ctr[f["rctr"]] < f["rtarget"]:
                    break
                if ins.kind == "gemv":
                    if f.get("sig", -1) >= 0:
                        ctr[f["sig"]] += f.get("sign", 0)
                else:
                    n = f["ntiles"] if ins.kind == "router" else f["nsplit"]
                    arrived[f["arrive"]] = arrived.get(f["arrive"], 0) + 1
                    if arrived[f["arrive"]] == n:
                        ctr[f["sig"]] += 1
                pos[c] += 1
                left -= 1
                moved = True
        if not moved:
            stuck = [(c, q[pos[c]].kind, q[pos[c]].stage) for c, q in enumerate(queues) if pos[c] < len(q)][:4]
            raise ValueError(f"the schedule deadlocks: CTAs (cta, op, stage) {stuck} wait forever")
