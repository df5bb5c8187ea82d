"""The synthetic layers of bench/gpu_round_probe.py: Q4_K weights on the GPU, the
persistent kernel's schedule for them (kernels/cuda/schedule.py), and float64 references
of every stage from the kernel's own inputs to it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from gguf.constants import GGMLQuantizationType as T

from alphallama.kernels.cuda.schedule import EPI, MODES, PRO, Instr, Schedule, f32_bits
from alphallama.kernels.formats.format import torch_fields
from alphallama.kernels.formats.qweight import QuantWeight

EPS = 1e-6
CH = 64          # keys a split (round_layer.cu)
HD = 128


@dataclass(frozen=True)
class Shape:
    name: str
    D: int
    H: int
    KV: int
    F: int                 # dense d_ff, or the expert's
    E: int = 0             # routed experts (0: dense)
    topk: int = 0
    qkv_rows: int = 16     # rows a tile (<= 40 KB of planes)
    o_rows: int = 16
    gu_rows: int = 8       # gate rows a tile (as many up rows beside them)
    down_rows: int = 4


SHAPES = {"qwen3-8b": Shape("qwen3-8b", 4096, 32, 8, 12288, qkv_rows=16, gu_rows=8, down_rows=4),
          "qwen3-30b-a3b": Shape("qwen3-30b-a3b", 2048, 32, 4, 768, E=128, topk=8, qkv_rows=32, gu_rows=16,
                                 down_rows=8)}


def q4k(N: int, K: int, g: torch.Generator, device: str = "cuda") -> QuantWeight:
    """Random Q4_K bits: random codes, scales and mins; fp16 d and dmin in +-2e-3."""
    nb = N * K // 256
    raw = torch.randint(0, 256, (nb, 144), dtype=torch.uint8, generator=g, device=device)   # [nb, 144]
    for off in (0, 2):
        d = (torch.rand(nb, generator=g, device=device) * 2 - 1) * 2e-3
        raw[:, off:off + 2] = d.to(torch.float16).reshape(nb, 1).view(torch.uint8)
    return QuantWeight.from_raw(raw.reshape(N, -1), T.Q4_K, (N, K), device)


@dataclass
class Layer:
    """One layer's weights, KV cache and the buffers its stages write."""
    s: Shape
    qkv: QuantWeight
    o: QuantWeight
    gate_up: QuantWeight       # dense [2F, D]; MoE [E * 2F, D] (expert e: gate rows, then up rows)
    down: QuantWeight          # dense [D, F]; MoE [E * D, F]
    router: torch.Tensor | None
    norms: dict[str, torch.Tensor]
    kc: torch.Tensor           # [KV, max_len, HD] fp16
    vc: torch.Tensor
    buf: dict[str, torch.Tensor] = field(default_factory=dict)


def make_layer(s: Shape, pos: int, g: torch.Generator) -> Layer:
    qrows = (s.H + 2 * s.KV) * HD
    dev = "cuda"
    nrm = {n: 1 + 0.1 * torch.randn(d, generator=g, device=dev) for n, d in
           (("attn", s.D), ("ffn", s.D), ("q", HD), ("k", HD))}
    moe = s.E > 0
    L = Layer(s, q4k(qrows, s.D, g), q4k(s.D, s.H * HD, g),
              q4k((s.E if moe else 1) * 2 * s.F, s.D, g), q4k((s.E if moe else 1) * s.D, s.F, g),
              0.05 * torch.randn(s.E, s.D, generator=g, device=dev) if moe else None, nrm,
              torch.randn(s.KV, pos + 1, HD, generator=g, device=dev).half(),
              torch.randn(s.KV, pos + 1, HD, generator=g, device=dev).half())
    hg = s.H // s.KV
    nsplit = math.ceil((pos + 1) / CH)
    f32 = lambda *shape: torch.empty(*shape, device=dev)   # noqa: E731
    L.buf = {"qkv": f32(qrows), "attn": f32(s.H * HD), "part": f32(s.KV, nsplit, hg, 4 + HD),
             "s": f32((s.topk if moe else 1) * s.F)}
    if moe:
        L.buf["logits"] = f32(s.E)
        L.buf["route"] = torch.zeros(16, dtype=torch.int32, device=dev)
    return L


def rope(pos: int, base: float = 1e6) -> tuple[torch.Tensor, torch.Tensor]:
    inv = base ** (-torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    ang = pos * inv
    return ang.cos().float().cuda(), ang.sin().float().cuda()


def _planes(sch: Schedule, w: QuantWeight) -> int:
    p = w.planes
    return sch.ptr(p["qs"].data_ptr(), p["sc"].data_ptr(), p["sd"].data_ptr())


def build(layers: list[Layer], xs: list[torch.Tensor], pos: int, cs: tuple, dumps: dict | None) -> Schedule:
    """The schedule of len(layers) layers; layer l reads xs[2l], writes xs[2l+1] (after
    attention) and xs[2l+2]. dumps: stage name -> buffer, the first tile of layer 0's
    stage writes its activations there."""
    sch = Schedule()
    P = lambda t: sch.ptr(t.data_ptr())          # noqa: E731
    eps = f32_bits(EPS)
    cos_p, sin_p = P(cs[0]), P(cs[1])
    prev, prev_target = None, 0
    for li, L in enumerate(layers):
        s = L.s
        hg, nsplit = s.H // s.KV, L.buf["part"].shape[1]
        d = (lambda n: P(dumps[n]) if dumps is not None and li == 0 and n in dumps else -1)
        wait = {"wait": sch.counter(f"ffn{prev}"), "target": prev_target} if prev is not None else {}
        # qkv: tiles signal their KV group's counter
        act, w = sch.act_id(), _planes(sch, L.qkv)
        tiles = []
        for r0 in range(0, L.qkv.N, s.qkv_rows):
            head = r0 // HD
            grp = head // hg if head < s.H else (head - s.H) % s.KV
            tiles.append(Instr("gemv", dict(wait, act=act, eps=eps, w=w, nslots=L.qkv.n_slots, row0=r0,
                                            nrows=s.qkv_rows, ngroups=1, pro=PRO["norm"], src=P(xs[2 * li]),
                                            normw=P(L.norms["attn"]), epi=EPI["store"], dst=P(L.buf["qkv"]),
                                            sig=sch.counter(f"qkv{li}.{grp}"), sign=1)))
        tiles[0].f["dump"] = d("qkv")
        sch.stage(tiles)
        per_group = (hg + 2) * HD // s.qkv_rows
        tiles = []
        for gi in range(s.KV):
            for j in range(nsplit):
                tiles.append(Instr("attn", dict(
                    wait=sch.counter(f"qkv{li}.{gi}"), target=per_group, eps=eps, qkv=P(L.buf["qkv"]),
                    kc=P(L.kc[gi]), vc=P(L.vc[gi]), qoff=gi * hg * HD, koff=(s.H + gi) * HD,
                    voff=(s.H + s.KV + gi) * HD, pos=pos, k0=j * CH, k1=min((j + 1) * CH, pos + 1),
                    qn=P(L.norms["q"]), kn=P(L.norms["k"]), cos=cos_p, sin=sin_p, part=P(L.buf["part"][gi]),
                    split=j, nsplit=nsplit, arrive=sch.counter(f"arr{li}.{gi}"), out=P(L.buf["attn"]),
                    ooff=gi * hg * HD, hg=hg, sig=sch.counter(f"attn{li}"))))
        sch.stage(tiles)
        act, w = sch.act_id(), _planes(sch, L.o)
        n_o = L.o.N // s.o_rows
        tiles = [Instr("gemv", dict(wait=sch.counter(f"attn{li}"), target=s.KV, act=act, eps=eps, w=w,
                                    nslots=L.o.n_slots, row0=r0, nrows=s.o_rows, ngroups=1, pro=PRO["plain"],
                                    src=P(L.buf["attn"]), epi=EPI["res"], res=P(xs[2 * li]), dst=P(xs[2 * li + 1]),
                                    sig=sch.counter(f"o{li}"), sign=1)) for r0 in range(0, L.o.N, s.o_rows)]
        tiles[0].f["dump"] = d("o")
        sch.stage(tiles)
        x1 = P(xs[2 * li + 1])
        ffn_wait = dict(wait=sch.counter(f"o{li}"), target=n_o)
        if s.E == 0:
            act, w = sch.act_id(), _planes(sch, L.gate_up)
            tiles = [Instr("gemv", dict(ffn_wait, act=act, eps=eps, w=w, nslots=L.gate_up.n_slots, row0=r0,
                                        nrows=s.gu_rows, ngroups=2, gstride=s.F, pro=PRO["norm"], src=x1,
                                        normw=P(L.norms["ffn"]), epi=EPI["silu"], dst=P(L.buf["s"]),
                                        sig=sch.counter(f"gu{li}"), sign=1)) for r0 in range(0, s.F, s.gu_rows)]
            tiles[0].f["dump"] = d("gate_up")
            sch.stage(tiles)
            n_gu = len(tiles)
            act, w = sch.act_id(), _planes(sch, L.down)
            tiles = [Instr("gemv", dict(wait=sch.counter(f"gu{li}"), target=n_gu, act=act, eps=eps, w=w,
                                        nslots=L.down.n_slots, row0=r0, nrows=s.down_rows, ngroups=1,
                                        pro=PRO["plain"], src=P(L.buf["s"]), epi=EPI["res"], res=x1,
                                        dst=P(xs[2 * li + 2]), sig=sch.counter(f"ffn{li}"), sign=1))
                     for r0 in range(0, s.D, s.down_rows)]
        else:
            route, rctr = P(L.buf["route"]), sch.counter(f"route{li}")
            rows = 4
            act = sch.act_id()
            sch.stage([Instr("router", dict(ffn_wait, act=act, eps=eps, w=P(L.router), nslots=s.D, row0=r0,
                                            nrows=rows, pro=PRO["normf"], src=x1, normw=P(L.norms["ffn"]),
                                            dst=P(L.buf["logits"]), arrive=sch.counter(f"rarr{li}"),
                                            ntiles=s.E // rows, topk=s.topk, nexp=s.E, route=route, sig=rctr))
                       for r0 in range(0, s.E, rows)])
            act, w = sch.act_id(), _planes(sch, L.gate_up)
            tiles = [Instr("gemv", dict(ffn_wait, act=act, eps=eps, w=w, nslots=L.gate_up.n_slots, row0=r0,
                                        nrows=s.gu_rows, ngroups=2, gstride=s.F, mode=MODES["expert"],
                                        rpe=2 * s.F, rank=k, route=route, rctr=rctr, rtarget=1,
                                        pro=PRO["norm"], src=x1, normw=P(L.norms["ffn"]), epi=EPI["silu"],
                                        dst=P(L.buf["s"]), doff=k * s.F, sig=sch.counter(f"gu{li}"), sign=1))
                     for k in range(s.topk) for r0 in range(0, s.F, s.gu_rows)]
            tiles[0].f["dump"] = d("gate_up")
            sch.stage(tiles)
            n_gu = len(tiles)
            act, w = sch.act_id(), _planes(sch, L.down)
            tiles = [Instr("gemv", dict(wait=sch.counter(f"gu{li}"), target=n_gu, act=act, eps=eps, w=w,
                                        nslots=L.down.n_slots, row0=r0, nrows=s.down_rows, ngroups=s.topk,
                                        mode=MODES["ranks"], rpe=s.D, route=route, rctr=rctr, rtarget=1,
                                        pro=PRO["multi"], src=P(L.buf["s"]), sstride=s.F, epi=EPI["moe"],
                                        res=x1, dst=P(xs[2 * li + 2]), sig=sch.counter(f"ffn{li}"), sign=1))
                     for r0 in range(0, s.D, s.down_rows)]
        tiles[0].f["dump"] = d("down")
        sch.stage(tiles)
        prev, prev_target = li, len(tiles)
    return sch


def dump_size(w: QuantWeight, ranks: int = 1) -> int:
    """int32 words of a stage's activation dump: the codes, then (sum, dx) a slot."""
    return (ranks * w.K + ranks * w.n_slots * 8) // 4


# -- float64 references ---------------------------------------------------------------------
def deq64(w: QuantWeight, r0: int = 0, r1: int | None = None) -> torch.Tensor:
    """Rows r0:r1 of a Q4_K weight, exactly, in float64: [R, K]."""
    p = {n: t[r0:r1] for n, t in w.planes.items()}
    R = p["qs"].shape[0]
    q = torch_fields(p["qs"], 4, 4).double()                               # [R, ns, 32]
    s = p["sc"].to(torch.int32)
    sd = p["sd"].double().reshape(R, -1, 2).repeat_interleave(8, dim=1)     # [R, ns, 2]
    ds = (sd[..., 0] * (s & 0xFF).double())[..., None]
    dm = (sd[..., 1] * ((s >> 8) & 0xFF).double())[..., None]
    return (ds * q - dm).reshape(R, -1)


def undump(buf: torch.Tensor, K: int, ranks: int = 1) -> torch.Tensor:
    """A dump -> the activations it encodes, in k order, float64: [ranks, K]."""
    raw = buf.view(torch.int8)[:ranks * K].reshape(ranks, K // 32, 32).to(torch.float64)
    k = torch.arange(32, device=buf.device)
    r, jh = k % 8, k // 8
    lane = ((r % 2) * 4 + r // 2) * 4 + jh                                  # k -> byte position in its slot
    rec = buf[ranks * K // 4:].reshape(ranks, K // 32, 2)
    dx = rec[..., 1].view(torch.float32).double()
    return (raw[:, :, lane] * dx[..., None]).reshape(ranks, K)


def gemv_err(out: torch.Tensor, x: torch.Tensor, W: torch.Tensor, base: torch.Tensor | None = None) -> float:
    """max |out - (base + W x)| / (|W| |x|), float64."""
    ref = W @ x + (0 if base is None else base.double())
    return ((out.double() - ref).abs() / ((W.abs() @ x.abs()).clamp_min(1e-30))).max().item()


def quant_err(x: torch.Tensor, ref: torch.Tensor, K: int) -> float:
    """max |x - ref| over the block's step dx: <= 0.5 (+ rounding) if the q8 is right."""
    dx = ref.reshape(-1, 32).abs().amax(1, keepdim=True) / 127
    return ((x.reshape(-1, 32) - ref.reshape(-1, 32)).abs() / dx.clamp_min(1e-30)).max().item()


def rms64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS) * w.double()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def attention_ref(L: Layer, qkv: torch.Tensor, pos: int, cs: tuple, kc_before: torch.Tensor,
                  vc_before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(attention output [H*HD], new k [KV, HD] as fp16, new v) from the kernel's qkv."""
    s = L.s
    qkv = qkv.double()
    q = qkv[:s.H * HD].reshape(s.H, HD)
    k = qkv[s.H * HD:(s.H + s.KV) * HD].reshape(s.KV, HD)
    v = qkv[(s.H + s.KV) * HD:].reshape(s.KV, HD)
    c, sn = cs[0].double(), cs[1].double()

    def nr(x, w):
        x = rms64(x, w)
        a, b = x[:, :HD // 2], x[:, HD // 2:]
        return torch.cat([a * c - b * sn, b * c + a * sn], -1)
    q, k = nr(q, L.norms["q"]), nr(k, L.norms["k"])
    kh, vh = k.half(), v.half()
    K = kc_before.double().clone()
    V = vc_before.double().clone()
    K[:, pos], V[:, pos] = kh.double(), vh.double()
    hg = s.H // s.KV
    out = []
    for h in range(s.H):
        gi = h // hg
        sc = (K[gi, :pos + 1] @ q[h]) / math.sqrt(HD)
        out.append(torch.softmax(sc, 0) @ V[gi, :pos + 1])
    return torch.cat(out), kh, vh
