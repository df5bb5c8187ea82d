"""kernels/cuda/schedule.py: the instruction layout matches round_layer.cu's enums, the
signals merged per CTA keep every counter's total, and a schedule that can deadlock is
refused."""
from __future__ import annotations

import re

import pytest

from alphallama.kernels.cuda import nvrtc
from alphallama.kernels.cuda.schedule import FIELDS, NI, Instr, Schedule, simulate


def _enums(prefix: str) -> dict[str, int]:
    src = "\n".join(body.decode() for _, body in nvrtc.headers())
    out = {}
    for body in re.findall(r"enum\s*\{([^}]*)\}", src):
        for name, val in re.findall(r"\b(%s_\w+)\s*=\s*(\d+)" % prefix, body):
            out[name] = int(val)
    return out


def test_fields_match_the_kernel():
    cu = {**_enums("F"), **_enums("A")}
    # the kernel's names, lower-cased without the prefix, against the host's layout
    aliases = {"F_NORM_EPS": "eps"}
    for name, idx in cu.items():
        host = aliases.get(name, name.split("_", 1)[1].lower())
        table = FIELDS["attn"] if name.startswith("A_") else FIELDS["gemv"]
        assert table[host] == idx, (name, idx, table.get(host))
    assert max(max(t.values()) for t in FIELDS.values()) < NI


def _stage(s: Schedule, n: int, wait: tuple[str, int] | None, sig: str) -> list[Instr]:
    w = {"wait": s.counter(wait[0]), "target": wait[1]} if wait else {}
    return [Instr("gemv", dict(w, sig=s.counter(sig), sign=1, row0=i)) for i in range(n)]


def test_merged_signals_keep_the_totals():
    s = Schedule()
    s.stage(_stage(s, 10, None, "a"))
    s.stage(_stage(s, 7, ("a", 10), "b"))
    rows, starts, queues = s.build(3)
    assert starts == [0, 6, 12, 17] and all(len(r) == NI for r in rows)
    totals = {}
    for q in queues:
        for ins in q:
            totals[ins.f["sig"]] = totals.get(ins.f["sig"], 0) + ins.f["sign"]
    assert totals == {s.counters["a"]: 10, s.counters["b"]: 7}
    assert sum(1 for q in queues for ins in q if ins.f["sign"]) < 17     # fewer atomics than tiles


def test_a_schedule_that_waits_forever_is_refused():
    s = Schedule()
    s.stage(_stage(s, 4, None, "a"))
    s.stage(_stage(s, 2, ("a", 5), "b"))          # 4 tiles signal a; 5 awaited
    with pytest.raises(ValueError, match="deadlocks"):
        s.build(2)
    q = [[Instr("attn", dict(wait=0, target=1, arrive=1, nsplit=1, sig=2))]]
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(q, 3)
