"""The GPU runtime's golden record: the kernel plan and the logits' bits of fixed models.

Issue 30 moves the GPU engine's code into one house; before anything moves, this dumps
what the runtime does today so that the refactor can be held to it byte for byte:

  plan  for every weight (by its GGUF tensor names) and every W = 1..64: the kernel that
        runs it and the tile and params that decide its float order and its launch
        (Linear's form, orders, adds, runs, split; qgemv_i8 / qgemv_q8k / qgemv_mma_k /
        qmatmul tiles; the MoE layers' forms and expert tiles; the round's fused
        producers; attention splits; the prefill path's GEMM units and graph shapes).
        Tiles are the ones of record (the GPU's): under the interpreter qgemv_i8 and
        qgemv_q8k raise their row tiles, which no bit depends on there.
  bits  SHA-256 of the raw float32 bytes of: a prefill of PROMPT - 1 rows (the
        tensor-core path, > 64 rows), the last prompt row through W = 1 (as the engine
        sends it), and a verify round of W draft rows after the prompt for each W of the
        run's widths (logits, hidden, and each logits row); for a preset whose Q4_K
        weights qualify for fast mode's hybrid, the same for the fast-mode model (its
        verify with exact=False: the tensor cores' bits beyond the narrow rounds); and
        where any runs on the tensor cores with engine.gemv_mma on, that model's plan
        (its bits on the GPU run only: the interpreter's mma emulation is slow).
  values (CPU records) a few logits and hidden values of some rows, to 7 digits: what a
        host whose numerics differ can still compare, within float reordering's reach.
  host  (CPU records) the numerics the record was made under (gpu_golden_host: the
        pinned libraries, their versions, the probes' fingerprint). A CPU record is
        always made in a child process under those pins (--device cpu re-runs itself).

Widths: the plan is cheap and covers W = 1..64 everywhere. The interpreter costs seconds
per row and per layer, so on the CPU the bits cover CPU_WIDTHS (1: plain decode; 2: the
q8k / dp4a column tiles' second shape; 5: the first width past fast mode's narrow rounds
and the first of two mma row groups) on one-layer presets; on the GPU every W = 1..64,
plus the qwen3-8b and qwen3-30b-a3b shapes cut to two layers (GPU_ONLY).

    python -m alphallama.runtime.gpu_golden --device cpu --write     # tests/data/golden/cpu-*.json (pinned)
    python -m alphallama.runtime.gpu_golden --device cuda --out DIR  # gpu-*.json, all widths
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType as T

from ..gguf.reader import GGUFFile
from ..gguf.synth_spec import PRESETS, SyntheticSpec
from ..gguf.writer import write_synthetic
from ..kernels.attention.decode import BLOCK_N, MAX_SPLITS, live_splits, split_size
from ..kernels.moe.moe_i8 import EXPERT_BN, GATE_UP_PAIRED, expert_consts
from ..kernels.prefill.qgemm import units_of
from ..kernels.gemv.qmatmul import tile as qmatmul_tile
from ..kernels.gemv.registry import ROWS_PER_THREAD
from .gpu_model import GPUModel
from .linear import Linear
from .moe import MoE
from .widths import BUCKETS, MAX_W, bucket_of
from .overrides import PRODUCT, Overrides
from .gpu_prefill import GRAPH_MIN_ROWS, capturable, moe_fused, graph_rows
from . import gpu_golden_host as golden_host

WIDTHS = tuple(range(1, MAX_W + 1))
CPU_WIDTHS = (1, 2, 5)
PROMPT = 72              # prompt rows: PROMPT - 1 > 64 take the prefill path, the last one W = 1
SEED = 3
GOLDEN_DIR = Path(__file__).resolve().parents[3] / "tests" / "data" / "golden"


@dataclass(frozen=True)
class Case:
    """A preset as the golden record builds it: layers and a quant mix that puts every
    kernel family of the plan somewhere (fused weights of two types, F16 on qmatmul,
    legacy and k-quants on dp4a, Q4_K on the mma path, expert formats)."""
    preset: str
    n_layers: int
    quant: Mapping[str, T] | str = field(default_factory=dict)

    def spec(self) -> SyntheticSpec:
        return PRESETS[self.preset](n_layers=self.n_layers, quant=self.quant, seed=SEED)


CASES: dict[str, Case] = {
    "tiny-llama": Case("tiny-llama", 1, {
        "embd": T.Q8_0, "output": T.F16, "attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K,
        "attn_output": T.Q8_0, "ffn_gate": T.Q4_K, "ffn_up": T.Q5_K, "ffn_down": T.Q6_K}),
    "tiny-qwen2": Case("tiny-qwen2", 1, {
        "embd": T.Q8_0, "attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q8_0, "attn_output": T.Q5_0,
        "ffn_gate": T.Q4_0, "ffn_up": T.Q4_0, "ffn_down": T.Q8_0}),
    "tiny-qwen3": Case("tiny-qwen3", 1, "Q4_K_M"),
    "tiny-qwen3moe": Case("tiny-qwen3moe", 1, "Q4_K_M"),
    "qwen3-8b": Case("qwen3-8b", 2, "Q4_K_M"),
    "qwen3-30b-a3b": Case("qwen3-30b-a3b", 2, "Q4_K_M"),
}
GPU_ONLY = ("qwen3-8b", "qwen3-30b-a3b")


# -- the plan ---------------------------------------------------------------------------
def _ranges(per_w: dict[int, Any]) -> dict[str, Any]:
    """{W: value} -> {"a-b": value} over runs of consecutive widths with one value."""
    out, ws = {}, sorted(per_w)
    start = ws[0]
    for i, w in enumerate(ws):
        last = i + 1 == len(ws) or per_w[ws[i + 1]] != per_w[w] or ws[i + 1] != w + 1
        if last:
            out[f"{start}-{w}" if w > start else str(start)] = per_w[w]
            if i + 1 < len(ws):
                start = ws[i + 1]
    return out


def _json(v: Any) -> Any:
    """Tuples as lists, so a record compares equal to its own JSON."""
    return json.loads(json.dumps(v))


def _weight_names(f: GGUFFile, names: list[str], lin: Linear) -> list[str]:
    """Linear's weights by the GGUF tensors fused into each (consecutive tensors of one type)."""
    groups: list[list[str]] = []
    for n in names:
        if groups and f.tensors[groups[-1][0]].qtype == f.tensors[n].qtype:
            groups[-1].append(n)
        else:
            groups.append([n])
    if len(groups) != len(lin.weights):
        raise RuntimeError(f"{names}: {len(groups)} type groups but {len(lin.weights)} weights")
    return ["+".join(g) for g in groups]


def _kernel_at(lin: Linear, j: int, W: int) -> dict:
    """The launch of weight j of `lin` in a round of W rows: its plan's kernel and that
    kernel's tile of record (kernels/gemv/registry.py)."""
    s = lin.plan.at(W)
    return s.kernels[j].tile(lin.weights[j], W, s.runs, s.adds)


def _linear(f: GGUFFile, names: list[str], lin: Linear, m: GPUModel) -> dict:
    wn = _weight_names(f, names, lin)
    s = m.scratch
    units = units_of(lin.weights, s.buffer_elements // lin.weights[0].K)
    return {
        "weights": [{"name": n, "qtype": w.qtype.name, "N": w.N, "K": w.K, "i8": i8, "mma": mma}
                    for n, w, i8, mma in zip(wn, lin.weights, lin.i8, lin.mma)],
        "per_W": _ranges({W: _json({"orders": lin.orders(W), "adds": lin.adds(W), "runs": lin.runs(W),
                                    "kernels": [_kernel_at(lin, j, W) for j in range(len(lin.weights))]})
                          for W in WIDTHS}),
        # the prefill path's GEMMs: row blocks (weight, r0, r1) a scratch buffer holds
        "prefill_units": [[[wn[lin.weights.index(w)], r0, r1] for w, r0, r1, _ in u.pieces] for u in units],
    }


def _consts_of(w, n: int) -> dict:
    """moe_i8's constexprs for a weight on the GPU (DP4A), its format's loader by name."""
    return {k: getattr(v, "__name__", v) for k, v in expert_consts(w, n, True).items()}


def _moe(m: GPUModel, L, moe: MoE) -> dict:
    gu, dn = (moe.gate_up, moe.down) if moe.store is None else (None, None)
    rec = {"i8": moe.i8, "top_k": moe.top_k, "norm": moe.norm, "store": moe.store is not None,
           "link": moe.link is not None, "router": moe.router.qtype.name,
           "router_rows": moe.router_rows is not None, "router_tile": qmatmul_tile(moe.router, ROWS_PER_THREAD),
           "orders": moe.orders(1), "prefill_fused": moe_fused(moe)}
    if moe.i8 and gu is not None:   # the tiles of record (the GPU's, DP4A)
        rec |= {"EXPERT_BN": EXPERT_BN, "GATE_UP_PAIRED": GATE_UP_PAIRED,
                "gate_up": {"qtype": gu.qtype.name, "shape": list(gu.shape), **_consts_of(gu, gu.N // 2)},
                "down": {"qtype": dn.qtype.name, "shape": list(dn.shape), **_consts_of(dn, dn.N)}}
    rec["norm_router"] = _ranges({W: m._norm_router(L, W) for W in WIDTHS})
    return _json(rec)


def _round(m: GPUModel, i: int) -> dict:
    """Layer i's producers at each W (the model's round plans, runtime/round.py): which
    attention, SiLU and norms emit int8 / q8_K activations, in which layouts."""
    def at(W: int) -> dict:
        s = m.round_plans[W - 1].layers[i]
        r = {"attention": ["decode_attention_q8", s.attention] if s.attention else ["decode_attention"],
             "ffn_norm": s.ffn_norm, "next_norm": s.next_norm}
        if m.layers[i].moe is None:
            r["silu"] = ["silu_mul_q8", s.silu] if s.silu else ["silu_mul"]
        return _json(r)
    return _ranges({W: at(W) for W in WIDTHS})


def plan(m: GPUModel, f: GGUFFile) -> dict:
    """The kernel plan of model `m` (built from `f`), as deterministic JSON data."""
    c = m.cfg
    layers = []
    for i, L in enumerate(m.layers):
        p = f"blk.{i}."
        rec = {"qkv": _linear(f, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], L.qkv, m),
               "o": _linear(f, [p + "attn_output.weight"], L.o, m),
               "round": _round(m, i)}
        if L.moe is None:
            rec["gate_up"] = _linear(f, [p + "ffn_gate.weight", p + "ffn_up.weight"], L.gate_up, m)
            rec["down"] = _linear(f, [p + "ffn_down.weight"], L.down, m)
        else:
            rec["moe"] = _moe(m, L, L.moe)
        layers.append(rec)
    head = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"
    lengths = (1, PROMPT, PROMPT + MAX_W, 512, 2048, 4096, 40960)
    return _json({
        "model": {"decode_gemv": m.decode_gemv, "fuse_q8": m._fuse_q8, "pdl": m.pdl, "act_dtype": str(m.act_dtype),
                  "combine_in_norm": m.combine_in_norm, "norm_router": m.norm_router, "early_kv": m.early_kv,
                  "hybrid": m.hybrid, "use_graphs": m.use_graphs, "rows_per_thread": ROWS_PER_THREAD,
                  "embd": [m.embd_qtype.name, type(m.embd).__name__]},
        "buckets": _ranges({W: bucket_of(W) for W in WIDTHS}),
        "layers": layers,
        "output": _linear(f, [head], m.output, m),
        "attention": {"BLOCK_N": BLOCK_N, "MAX_SPLITS": MAX_SPLITS, "head_dim": c.head_dim,
                      "split_size": {str(n): [split_size(n), live_splits(n)] for n in lengths}},
        "prefill": {"path": m.prefill_path, "chunk": m.prefill_chunk, "scratch_elements": m.scratch.elements,
                    "scratch_dtype": str(m.scratch.dtype), "overlap": m.scratch.overlap, "graphs": m.scratch.graphs,
                    "capturable": all(map(capturable, m.layers)), "GRAPH_MIN_ROWS": GRAPH_MIN_ROWS,
                    "graph_rows": {str(t): graph_rows(t, m.prefill_chunk)
                                   for t in (65, PROMPT - 1, 128, 129, 300, 512, 1000)}},
        "graph_buckets": list(BUCKETS),
    })


# -- the bits ---------------------------------------------------------------------------
def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()).hexdigest()


VALUE_IDS = 16   # logits kept per row in `values`, at ids spread over the vocabulary
VALUE_HIDDEN = 8


def _values_of(lg: torch.Tensor, hd: torch.Tensor, rows: list[int]) -> list[dict]:
    """Rows of logits [T, V] and hidden [T, D] as a few numbers each (7 digits). The RMS is
    summed exactly (fsum of float64 squares, which are exact): a library's reduction sums
    in an order of its own choosing (the same bits gave another last digit at another
    address), and a summary of the bits must depend on the bits alone."""
    r7 = lambda t: [float(f"{x:.7g}") for x in t.double().flatten().tolist()]   # noqa: E731
    rms = lambda t: r7(torch.tensor(math.sqrt(math.fsum(v * v for v in t.double().tolist()) / t.numel())))[0]  # noqa: E731
    ids = torch.linspace(0, lg.shape[1] - 1, VALUE_IDS).round().long()
    out = []
    for i in rows:
        x, h = lg[i].float().cpu(), hd[i].float().cpu()
        out.append({"row": i, "logits": r7(x[ids]), "max": r7(x.max())[0], "rms": rms(x),
                    "hidden": r7(h[:VALUE_HIDDEN]), "hidden_rms": rms(h)})
    return out


def bits(m: GPUModel, widths: tuple[int, ...], exact: bool = True, values: dict | None = None) -> dict:
    """SHA-256s of the prefill, the last prompt row at W = 1 and the verify rounds; with
    `values` (a dict to fill), a few values of the prefill's first, middle and last rows,
    the last prompt row and the widest round's rows."""
    g = torch.Generator().manual_seed(SEED)
    V = m.cfg.vocab_size
    prompt = torch.randint(0, V, (PROMPT,), generator=g)
    draft = torch.randint(0, V, (MAX_W,), generator=g)
    cache = m.new_cache(PROMPT + MAX_W)
    lg, hd = m.forward(prompt[:-1], 0, cache)                   # [PROMPT-1, V]: the prefill path
    rec = {"prefill": {"logits": _sha(lg), "hidden": _sha(hd)}}
    if values is not None:
        values["prefill"] = _values_of(lg, hd, [0, (PROMPT - 1) // 2, PROMPT - 2])
    lg, hd = m.forward(prompt[-1:], PROMPT - 1, cache)          # the engine's last prompt row, W = 1
    rec["last_row"] = {"logits": _sha(lg), "hidden": _sha(hd)}
    if values is not None:
        values["last_row"] = _values_of(lg, hd, [0])
    verify = {}
    for W in widths:
        cache.truncate(PROMPT)
        lg, hd = m.verify(draft[:W], PROMPT, cache, exact=exact)   # [W, V], [W, D]
        verify[str(W)] = {"logits": _sha(lg), "hidden": _sha(hd), "rows": [_sha(r)[:16] for r in lg]}
        if values is not None and W == max(widths):
            values["verify"] = {str(W): _values_of(lg, hd, list(range(W)))}
    rec["verify"] = verify
    return rec


def record(name: str, device: str, widths: tuple[int, ...], workdir: Path, mma_bits: bool = False,
           values: bool = False) -> dict:
    """The golden record of preset `name` on `device`: plan and bits, the fast-mode
    model's where the preset qualifies for its hybrid, and where any weight runs on the
    tensor cores with engine.gemv_mma on (qgemv_mma_k, qgemv_q8k up to its narrow rounds),
    that model's plan (and with mma_bits its bits: the GPU run). With `values`, the
    synthetic file's SHA-256 and each model's values beside its bits (the CPU record)."""
    case = CASES[name]
    path = workdir / f"{name}.gguf"
    if not path.exists():
        write_synthetic(case.spec(), path)
    f = GGUFFile(path)
    max_len = PROMPT + MAX_W
    m = GPUModel(f, max_len, device=device)
    rec = {"preset": name, "n_layers": case.n_layers, "widths": list(widths), "plan": plan(m, f)}
    kept: dict | None = {} if values else None
    rec["bits"] = bits(m, widths, values=kept)
    if values:
        rec["values"] = kept
        rec["model_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    del m
    fast = GPUModel(f, max_len, device=device, fast=True)
    if fast.hybrid:
        kept = {} if values else None
        rec["fast"] = {"narrow": PRODUCT.fast_mma_narrow, "plan": plan(fast, f),
                       "bits": bits(fast, widths, exact=False, values=kept)}
        if values:
            rec["fast"]["values"] = kept
    del fast
    mma = GPUModel(f, max_len, device=device, overrides=Overrides(gemv_mma=True))
    if any(any(lin.mma) for L in mma.layers for lin in (L.qkv, L.o, L.gate_up, L.down) if lin is not None):
        rec["gemv_mma"] = {"narrow": PRODUCT.gemv_mma_narrow, "plan": plan(mma, f)}
        if mma_bits:
            rec["gemv_mma"]["bits"] = bits(mma, widths)
    return rec


# -- comparing --------------------------------------------------------------------------
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand(d: dict) -> dict:
    """A dict of width ranges ("1-4") -> one key a width; any other dict as it is."""
    if not d or not all(isinstance(k, str) and _RANGE.match(k) for k in d):
        return d
    out = {}
    for k, v in d.items():
        a, b = _RANGE.match(k).groups()
        for w in range(int(a), int(b or a) + 1):
            out[f"W={w}"] = v
    return out


def first_difference(want: Any, got: Any, path: str = "") -> str | None:
    """The first place where two records differ, as 'path: want != got' (None: equal).
    Width ranges are compared width by width, so the path names the weight and the W."""
    if isinstance(want, dict) and isinstance(got, dict):
        want, got = _expand(want), _expand(got)
        for k in list(want) + [k for k in got if k not in want]:
            if k not in want or k not in got:
                return f"{path}/{k}: {'missing' if k not in got else 'extra'} in the new record"
            d = first_difference(want[k], got[k], f"{path}/{k}")
            if d is not None:
                return d
        return None
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        for i, (a, b) in enumerate(zip(want, got)):
            d = first_difference(a, b, f"{path}[{i}]")
            if d is not None:
                return d
        return None
    return None if want == got else f"{path}: golden {want!r} != now {got!r}"


def dumps(rec: dict) -> str:
    return json.dumps(rec, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Dump (or --write) the GPU runtime's golden records.")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--presets", nargs="*", help="default: the tiny presets on cpu, all on cuda")
    ap.add_argument("--out", type=Path, help="where <device>-<preset>.json go (default with --write: tests/data/golden)")
    ap.add_argument("--write", action="store_true", help="write into tests/data/golden")
    a = ap.parse_args(argv)
    dev = "cpu" if a.device == "cpu" else "gpu"
    if dev == "cpu" and not golden_host.pinned():    # the CPU record's numerics: made under the pins only
        sys.exit(golden_host.run_pinned(sys.argv[1:] if argv is None else argv).returncode)
    names = a.presets or [n for n in CASES if dev == "gpu" or n not in GPU_ONLY]
    out = a.out or (GOLDEN_DIR if a.write else None)
    widths = CPU_WIDTHS if dev == "cpu" else WIDTHS
    with tempfile.TemporaryDirectory() as tmp:
        for n in names:
            t0 = time.perf_counter()
            rec = record(n, a.device, widths, Path(tmp), mma_bits=dev == "gpu", values=dev == "cpu")
            if dev == "cpu":
                rec["host"] = golden_host.host()
            text = dumps(rec)
            if out is None:
                print(text, end="")
                continue
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"{dev}-{n}.json"
            part = path.with_name(path.name + ".partial")   # a run cut short leaves no half file
            part.write_text(text)
            part.replace(path)
            print(f"wrote {path} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
