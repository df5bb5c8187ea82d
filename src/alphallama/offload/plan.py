"""The automatic plan: model sizes x device memory -> the layout, before loading anything.

Only the GGUF header is read (metadata and the tensor table; tensor data stays on disk),
and the free device memory comes from torch.cuda.mem_get_info, or from --gpu-mem where
given (which also caps it: emulating a smaller card). Sizes are the bytes the GPU
runtime will hold: weight planes (kernels/formats/format.py) re-laid from the file's blocks,
norms as fp32, the embedding's raw rows, the f16 KV cache at the chosen context.

Layouts: `resident` (everything on the device), `offload` (the dense part, the KV cache
and a bank of expert slots on the device; every expert in host RAM, or past the host's
RAM budget (--host-mem) in the mapped GGUF file, the hottest also in the bank;
offload/store.py, offload/mapped.py), `cpu` (no GPU, or a file the GPU runtime would
refuse: the reference runtime). With the host's measured bandwidths (host_probe.py) the
plan also prices a decode round (estimate.py). Each tensor type's verdict comes from the runtimes' own
registries (offload/support.py), so nothing is planned that a runtime then refuses.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

import torch
from gguf.constants import GGML_QUANT_SIZES

from ..config import DEFAULTS
from ..gguf.arch import ModelConfig, load_config
from ..gguf.reader import GGUFFile, TensorInfo
from ..kernels.gemv.mma_layout import mma_shape_ok
from ..kernels.formats.qweight import embedding_planes
from .estimate import Estimate, HostLayout, MissRates, estimate, human
from .host_probe import Bandwidths
from .numa import gpu_placement
from .support import EXPERT_SUFFIXES as _EXPERT_SUFFIXES, TypeUse, cpu_problems, cpu_workers_refusal, gpu_problems, \
    type_uses

GiB = 1 << 30
KV_PAD_ROWS = 64          # the GPU cache keeps a full padded bucket past the context (gpu_model.MAX_W)


class PlanError(ValueError):
    """No layout fits; the message gives the sizes and what to change."""


@lru_cache(maxsize=None)
def row_bytes(qtype: int, K: int) -> int:
    """Device bytes of one weight row of K values: its planes (formats.py), or the
    file's bytes for a type the GPU kernels do not take."""
    from ..kernels.formats.qweight import FORMATS
    block, type_size = GGML_QUANT_SIZES[qtype]
    fmt = FORMATS.get(qtype)
    if fmt is None or K % block or K % fmt.slot:
        return K // block * type_size
    planes = fmt.pack(torch.zeros((1, K // block, type_size), dtype=torch.uint8))  # name -> [1, per_row]
    return sum(p.numel() * p.element_size() for p in planes.values())


def device_bytes(t: TensorInfo) -> int:
    """What the GPU runtime holds for a tensor: vectors as fp32, matrices as planes."""
    shape = tuple(t.shape)
    if len(shape) == 1:
        return shape[0] * 4
    return math.prod(shape[:-1]) * row_bytes(int(t.qtype), shape[-1])


@dataclass(frozen=True)
class Sizes:
    dense: int            # device bytes of everything but the routed experts
    experts: int          # device bytes of all routed experts
    expert_slot: int      # one expert (gate + up + down), the largest of any layer
    n_experts: int        # routed experts in the model (layers x experts per layer)
    kv: int               # KV cache at the plan's context
    workspace: int        # logits, activations, graphs, margin
    fast_extra: int = 0   # fast mode's second copy of the dense Q4_K codes (the tensor cores' order)
    layer_experts: tuple[tuple[int, int], ...] = ()   # (MoE layer, device bytes of all its experts)

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.kv + self.workspace

    def fits_fast(self, budget: int | None) -> bool:
        """Does a resident model also hold fast mode's tensor-core copy within budget?"""
        return self.fast_extra > 0 and budget is not None and self.total + self.fast_extra <= budget


def model_sizes(f: GGUFFile, cfg: ModelConfig, ctx: int) -> Sizes:
    dense = experts = slot = fast = 0
    per_layer: dict[str, int] = {}
    tied = "output.weight" not in f.tensors      # the embedding is then the head, a Linear too
    into_tables = set(getattr(getattr(cfg, "variant", None), "rope_factors", ()))   # read into RoPE tables, not held
    for name, t in f.tensors.items():
        if name in into_tables:
            continue
        head_or_layer = name != "token_embd.weight" or tied
        if (len(t.shape) == 2 and head_or_layer and not name.endswith(_EXPERT_SUFFIXES)
                and mma_shape_ok(t.qtype, *t.shape)):
            fast += math.prod(t.shape) // 2          # the qs plane again (kernels/gemv/registry.MmaChoice "dp4a")
        # an embedding without planes is held as its raw rows (gpu_model.GPUModel.embed)
        n = t.nbytes if name == "token_embd.weight" and not embedding_planes(t.qtype) else device_bytes(t)
        # an in-file MTP block's experts (blk.n_layers) stay resident: dense bytes here
        if name.endswith(_EXPERT_SUFFIXES) and int(name.split(".")[1]) < cfg.n_layers:
            experts += n
            layer = int(name.split(".")[1])
            per_layer[layer] = per_layer.get(layer, 0) + n // t.shape[0]
        else:
            dense += n
    emb = f.tensors["token_embd.weight"]
    if "output.weight" not in f.tensors and not embedding_planes(emb.qtype):   # tied: the head's planes
        dense += device_bytes(emb)                                               # beside the raw rows
    slot = max(per_layer.values(), default=0)
    kv = _state_bytes(cfg, ctx)
    workspace = DEFAULTS.offload.reserve_bytes + 2 * KV_PAD_ROWS * cfg.vocab_size * 4
    layer_experts = tuple((i, b * cfg.n_experts) for i, b in sorted(per_layer.items()))
    return Sizes(dense, experts, slot, cfg.n_layers * cfg.n_experts, kv, workspace, fast, layer_experts)


def _state_bytes(cfg: ModelConfig, ctx: int) -> int:
    """The cache's bytes: K and V (fp16) of the attention layers; a Gated DeltaNet hybrid's
    recurrent layers hold their conv ring, delta-rule state and gates instead (fp32,
    runtime/hybrid_cache.py)."""
    attn = getattr(cfg, "attn_layers", None)
    n_kv = len(attn) if attn is not None else cfg.n_layers
    kv = 2 * n_kv * cfg.n_kv_heads * (ctx + KV_PAD_ROWS) * cfg.head_dim * 2
    if attn is None:
        return kv
    from ..kernels.deltanet.layout import RING_ROWS, W_MAX
    hv, dk = cfg.ssm_v_heads, cfg.ssm_head_dim
    per_layer = RING_ROWS * cfg.conv_dim + hv * dk * dk + W_MAX * 2 * hv
    return kv + 4 * len(cfg.recurrent_layers) * per_layer


def host_threads() -> tuple[list[int], str]:
    """(the CPU expert workers' cpus, why that many): the fewest threads that reach the host's
    memory bandwidth (offload/native/probe.py, measured once per host and cached; or
    config offload.cpu_threads), on cpus other than the launch thread's (on a host of several
    memory nodes, the GPU's node's); none where the workers cannot be built (no C
    compiler): the host tier is then read over PCIe only."""
    if not DEFAULTS.offload.cpu_tier:
        return [], "CPU tier off (config offload.cpu_tier)"
    try:
        from .native.build import NativeBuildError
        from .native.probe import worker_cpus
    except ImportError as e:
        return [], f"no CPU expert workers ({e})"
    try:
        cpus = worker_cpus()
    except (NativeBuildError, OSError) as e:
        return [], f"no CPU expert workers ({e})"
    how = "config offload.cpu_threads" if DEFAULTS.offload.cpu_threads else "the host's memory bandwidth (probe)"
    return cpus, f"sized by {how}, launch thread kept apart"


def numa_line(workers: list[int]) -> str:
    """Where the CPU workers (their cpus; none: no workers) and the host tier go on a host of
    several memory nodes (numa.py); "" on one node, where placement changes nothing."""
    placed = gpu_placement(None)
    return "" if placed is None else placed.describe(workers)


def host_available() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), None where there is none."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def device_budget(gpu_mem: int | None) -> tuple[int | None, str]:
    """(bytes the plan may use on the device, where that figure comes from)."""
    free = None
    if torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0] - DEFAULTS.offload.headroom_bytes
    if gpu_mem is not None and free is not None:
        return min(gpu_mem, free), ("--gpu-mem" if gpu_mem <= free else "free device memory (below --gpu-mem)")
    if gpu_mem is not None:
        return gpu_mem, "--gpu-mem (no GPU here)"
    return free, "free device memory"


@dataclass(frozen=True)
class Plan:
    path: str
    arch: str
    ctx: int
    sizes: Sizes
    budget: int | None    # device bytes; None: no GPU and no --gpu-mem
    budget_source: str
    layout: str           # resident | offload | cpu
    slots: int            # expert bank slots (offload); all experts when resident
    cpu_threads: int      # CPU expert workers (offload; 0: none)
    cpu_threads_why: str
    mtp_depth: int        # in-file MTP layers (0: none)
    types: dict[str, TypeUse]      # per tensor type: counts, bytes, each runtime's verdict
    gpu_refused: tuple[str, ...] = ()   # why the GPU runtime would refuse the file (layout cpu)
    mode: str = "exact"
    host: HostLayout | None = None      # offload: the host tier's RAM budget and the mapped layers
    numa: str = ""                      # offload on a host of several memory nodes: where workers and host tier go
    bandwidths: Bandwidths | None = None
    estimate: Estimate | None = None    # plain decode's expected round at these bandwidths

    @property
    def device(self) -> str:
        return "cpu" if self.layout == "cpu" else "cuda"

    @property
    def resident_fraction(self) -> float:
        return self.slots / self.sizes.n_experts if self.sizes.n_experts else 1.0

    @property
    def host_bytes(self) -> int | None:
        """The engine's host_bytes: the host tier's budget where layers are mapped, else None."""
        return self.host.budget if self.host is not None and self.host.mapped_layers else None

    def to_dict(self) -> dict:
        return {**asdict(self), "types": {q: u.to_dict() for q, u in self.types.items()},
                "host": self.host.to_dict() if self.host is not None else None,
                "device": self.device, "resident_fraction": self.resident_fraction}

    def describe(self) -> str:
        s, g = self.sizes, human
        lines = [f"model      {self.path} ({self.arch})",
                 f"dense      {g(s.dense)}",
                 f"experts    {g(s.experts)}" + (f" ({s.n_experts} experts, {g(s.expert_slot)} each)"
                                                   if s.n_experts else " (dense model)"),
                 f"kv cache   {g(s.kv)} at context {self.ctx}",
                 f"workspace  {g(s.workspace)}",
                 "device     " + (f"{g(self.budget)} usable ({self.budget_source})" if self.budget is not None
                                   else "no GPU (cpu runtime)")]
        if self.layout == "resident":
            lines.append(f"layout     all resident ({g(s.total)} on the device)")
            if s.fast_extra:
                fits = "fits" if s.fits_fast(self.budget) else "does not fit: --fast verifies on dp4a"
                lines.append(f"fast       --fast adds a tensor-core copy of the Q4_K codes ({g(s.fast_extra)}; {fits})")
        elif self.layout == "offload":
            bank, h = self.slots * s.expert_slot, self.host
            lines.append(f"layout     offload: {self.slots} of {s.n_experts} expert slots in VRAM "
                         f"({100 * self.resident_fraction:.0f}%, {g(bank)}); {h.ram_experts} experts in pinned RAM "
                         f"({g(h.ram_bytes)}), {h.mapped_experts} mapped from the file")
            lines.append("host RAM   " + (f"{g(h.budget)} for the host tier ({h.source})" if h.budget is not None
                                         else h.source))
            if h.mapped_layers:
                room = "fits" if h.page_room is not None and h.mapped_bytes <= h.page_room else "does not fit"
                lines.append(f"mapped     {len(h.mapped_layers)} of {h.moe_layers} MoE layers' experts "
                             f"({g(h.mapped_bytes)}) stay in the GGUF file (page cache; {room} the RAM left), "
                             f"computed by the CPU workers from its blocks, read ahead between rounds")
            if self.cpu_threads:
                share = (self.estimate.miss if self.estimate and self.estimate.miss else
                         MissRates.assumed(self.cpu_threads)).share
                lines.append(f"host tier  experts without a slot: {100 * share:.0f}% of each layer's computed by "
                             f"CPU workers where they sit (at first: the rounds tune it), the rest read in place "
                             f"over PCIe by the GPU")
            else:
                lines.append("host tier  experts without a slot: read in place over PCIe by the GPU")
            lines.append(f"threads    1 launch thread + {self.cpu_threads} CPU expert workers "
                         f"({self.cpu_threads_why}) + 1 copy stream for admissions")
            if self.numa:
                lines.append(f"numa       {self.numa}")
        elif self.gpu_refused:
            lines.append(f"layout     cpu (reference runtime): the GPU runtime cannot run this file: "
                         f"{self.gpu_refused[0]}" + (f" (and {len(self.gpu_refused) - 1} more)"
                                                     if len(self.gpu_refused) > 1 else ""))
        else:
            lines.append("layout     cpu (reference runtime)")
        for i, u in enumerate(self.types.values()):
            why = u.gpu if u.cpu is None else u.cpu
            lines.append(f"{'types' if i == 0 else '':10} {u.qtype:8} {u.count:>5} tensors {g(u.nbytes):>11}  "
                         f"{u.runs_on}" + (f": {why}" if why else ""))
        lines.append("mtp        " + (f"depth {self.mtp_depth} (in-file head)" if self.mtp_depth else "none"))
        if self.bandwidths is not None:
            lines.append(f"bandwidth  {self.bandwidths.describe()}")
        if self.estimate is not None:
            lines.append(f"expected   {self.estimate.describe()}")
        lines.append(f"mode       {self.mode}")
        return "\n".join(lines)


def make_plan(path: str, ctx: int | None = None, gpu_mem: int | None = None, device: str = "auto",
              host_mem: int | None = None, bandwidths: Bandwidths | None = None) -> Plan:
    """The layout for a model file; PlanError when even the dense part does not fit.
    host_mem: the host tier's RAM budget (--host-mem; default the available RAM less a
    headroom): the MoE layers past it stay in the mapped file. bandwidths: the host's
    (host_probe.measure), to price a round; None: no estimate."""
    plan = _layout(path, ctx, gpu_mem, device, host_mem)
    return plan if bandwidths is None else priced(plan, bandwidths)


def priced(plan: Plan, bandwidths: Bandwidths) -> Plan:
    """The plan with plain decode's expected round at these bandwidths (a cpu layout: as it is)."""
    if plan.layout == "cpu":
        return plan
    cfg = load_config(GGUFFile(plan.path))
    s = plan.sizes
    est = estimate(s.dense, s.experts / max(s.n_experts, 1), cfg.n_layers, len(s.layer_experts),
                   cfg.n_experts_used if cfg.is_moe else 0, plan.slots, s.n_experts,
                   plan.host if plan.layout == "offload" else None, bandwidths, plan.cpu_threads)
    return replace(plan, bandwidths=bandwidths, estimate=est)


def _layout(path: str, ctx: int | None, gpu_mem: int | None, device: str, host_mem: int | None) -> Plan:
    f = GGUFFile(path)
    cfg = load_config(f)
    ctx = min(ctx or DEFAULTS.engine.ctx_size, cfg.ctx_len)
    s = model_sizes(f, cfg, ctx)
    budget, source = device_budget(gpu_mem) if device != "cpu" else (None, "--device cpu")
    mtp = int(f.metadata.get(f"{cfg.arch}.nextn_predict_layers", 0) or 0)
    common = dict(path=path, arch=cfg.arch, ctx=ctx, sizes=s, budget=budget, budget_source=source,
                  mtp_depth=mtp, types=type_uses(f.tensors))
    threads = dict(cpu_threads=0, cpu_threads_why="")
    refused = tuple(gpu_problems(f.tensors)) if budget is not None else ()
    if budget is None or refused:
        if refused and device == "cuda":
            raise PlanError(f"{path}: --device cuda, but the GPU runtime cannot run this file: "
                            + "; ".join(refused))
        problems = cpu_problems(f.tensors)
        if problems:   # the loader's own words: "PATH: tensor 'NAME': quant type X is not supported ..."
            more = f" (and {len(problems) - 1} more types)" if len(problems) > 1 else ""
            raise PlanError(f"{path}: {problems[0]}{more}"
                            + ("" if budget is None else "; the GPU runtime cannot run it either"))
        return Plan(layout="cpu", slots=s.n_experts, **common, **threads, gpu_refused=refused)
    if s.total <= budget:
        return Plan(layout="resident", slots=s.n_experts, **common, **threads)
    fixed = s.dense + s.kv + s.workspace
    if not cfg.is_moe or budget < fixed:
        g = human
        what = "the dense part" if cfg.is_moe else "the model (a dense model has no experts to keep in RAM)"
        raise PlanError(
            f"{path}: the device budget of {g(budget)} ({source}) is too small for {what}: dense "
            f"{g(s.dense)}" + ("" if cfg.is_moe else f" + weights {g(s.experts)}")
            + f" + KV cache {g(s.kv)} at context {ctx} + workspace {g(s.workspace)} = "
            f"{g(fixed + (0 if cfg.is_moe else s.experts))}; use a GPU with more free memory, a smaller "
            f"context (-c) or a smaller quantization")
    # a bank of any size works (even none: every expert is then read from RAM)
    slots = (budget - fixed) // max(s.expert_slot, 1)
    host = HostLayout.of(dict(s.layer_experts), cfg.n_experts, host_mem, host_available())
    cpus, why = host_threads()
    refusal = cpu_workers_refusal(f.tensors, cfg.variant.ffn_act) if cpus else None
    if refusal is not None:   # the runtime would not start them (cpu_tier.start_cpu_tier)
        cpus, why = [], f"CPU expert workers off: {refusal}"
    n = len(cpus)
    if host.mapped_layers and n == 0:
        raise PlanError(f"{path}: the experts ({human(s.experts)}) do not fit the host tier's RAM "
                        f"({human(host.budget)}, {host.source}), and the experts past it can only be computed "
                        f"from the mapped file by the CPU expert workers, which are off here ({why})")
    return Plan(layout="offload", slots=int(min(slots, s.n_experts - 1)), **common, cpu_threads=n, cpu_threads_why=why,
                host=host, numa=numa_line(cpus))
