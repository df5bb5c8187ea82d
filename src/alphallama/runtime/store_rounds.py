"""An MoE model's expert store on the GPU runtimes (GPUModel, GPUHybridModel: one code for both):
the store over the main layers' routed experts, the CPU workers beside it, and what a round
does around its launch. The MoE layers themselves read the store (runtime/moe.py: each
expert from its bank slot, the host tier or the CPU workers), in decode rounds, verify
passes of several streams and prefill chunks alike (gpu_prefill.moe_loop)."""
from __future__ import annotations

from ..config import DEFAULTS
from ..gguf.arch import ModelConfig
from ..gguf.reader import GGUFFile
from ..offload.cpu_tier import CpuLink, start_cpu_tier
from ..offload.estimate import MissRates
from ..offload.share_tuner import ShareTuner
from ..offload.store import ExpertStore
from .weights import BlockNames
from .widths import MAX_W


def expert_store(f: GGUFFile, cfg: ModelConfig, slots: int | None, device, progress=None,
                 host_bytes: int | None = None) -> ExpertStore | None:
    """The routed experts of layers 0..n_layers-1 in a store with `slots` VRAM slots (None, or a
    dense model: no store). An in-file MTP block (blk.n_layers) keeps its experts resident."""
    if not cfg.is_moe or slots is None:
        return None
    t = f.tensors
    return ExpertStore({i: tuple(t[x] for x in BlockNames(f"blk.{i}.").experts) for i in range(cfg.n_layers)},
                       cfg.n_layers, cfg.n_experts, cfg.n_experts_used, slots, device, MAX_W, progress,
                       host_bytes=host_bytes)


class StoreRounds:
    """A model's store and CPU workers (all None without a store) and the hooks of its rounds.
    The model sets `store` (expert_store) before building its layers (their MoE read it)."""

    store: ExpertStore | None = None
    cpu_tier = None                      # offload/cpu_tier.CpuTier
    cpu_link: CpuLink | None = None
    cpu_experts = None                   # offload/native/workers.CpuExperts
    miss_rates: MissRates | None = None
    share_tuner: ShareTuner | None = None   # the CPU workers' share of the misses, tuned on the rounds (CUDA)

    def _start_workers(self, moes: list, d_model: int, top_k: int, cpu_tier: bool | None, threads: int | None,
                       host_bytes: int | None, miss_rates: MissRates | None, progress=None) -> None:
        """With a store: the CPU workers for its host tier (config's offload.cpu_tier where
        cpu_tier is None), linked to the MoE layers `moes`, and the misses' prices."""
        if self.store is None:
            return
        share = (miss_rates or MissRates.assumed(1)).share   # the plan's: both pipes finish together
        if DEFAULTS.offload.cpu_tier if cpu_tier is None else cpu_tier:
            # each MoE layer's activation and biases (gpt-oss's: swiglu_oai, biased experts) go to the workers
            ops = {m.layer: m.ops for m in moes}
            self.cpu_tier = start_cpu_tier(self.store, d_model, top_k, MAX_W, self.device, threads,
                                           share, progress, ops)
        if self.store.mapped and self.cpu_tier is None:
            raise RuntimeError(f"{len(self.store.mapped)} MoE layers' experts are past the host tier's budget "
                               f"(host_bytes {host_bytes}) and only the CPU expert workers read the mapped file, "
                               f"but they are off or could not start: allow more RAM or enable the CPU tier")
        if self.cpu_tier is not None:
            self.cpu_link, self.cpu_experts = self.cpu_tier.link, self.cpu_tier.experts
            if DEFAULTS.offload.cpu_share_tune and self.device.type == "cuda":   # (interpreted rounds: no timing)
                self.share_tuner = ShareTuner(self.cpu_link.set_share, share)
        self.miss_rates = miss_rates or MissRates.assumed(self.cpu_experts.threads if self.cpu_experts else 0)
        for m in moes:
            m.link = self.cpu_link

    def store_figures(self) -> dict | None:
        """The expert store's counters and layout for /metrics (None without a store):
        picks routed and bank hits, admissions, the tiers' bytes, the CPU workers' share
        of the host misses (None without workers). Read from another thread (the server's
        /metrics): plain ints and floats as the rounds leave them, nothing from the device (a
        sync from another thread would break a graph being captured)."""
        if self.store is None:
            return None
        s = self.store.stats
        share = self.cpu_link.share_now if self.cpu_link is not None else None
        clock = self.cpu_experts.clock() if self.cpu_experts is not None else None   # atomics: no sync
        return {"lookups": s.lookups, "hits": s.hits, "admissions": s.admissions, "admitted_bytes": s.admitted_bytes,
                "bank_bytes": self.store.bank_bytes, "host_bytes": self.store.host_bytes,
                "mapped_bytes": self.store.mapped_bytes, "cpu_share": share, "cpu_clock": clock}

    def _keep_launch_thread_apart(self) -> None:
        """The round-launching thread off the CPU workers' cpus (offload/cpu_tier.CpuTier)."""
        if self.cpu_tier is not None:
            self.cpu_tier.keep_launch_thread_apart()

    def _before_store_round(self, W: int) -> None:
        """Before a round of W rows launches, with an expert store: the last round's routing
        learned, finished admissions published (store.before_round), the CPU workers' health
        checked and their share of the misses set (the tuner's, timing the rounds)."""
        if self.store is None:
            return
        self.store.before_round()
        if self.cpu_link is not None:
            self.cpu_link.check()
            if self.share_tuner is not None:   # (the cost table's timing rounds are not the share's)
                self.share_tuner.skip() if self.store.is_frozen else self.share_tuner.before_round(W)
            if self.device.type == "cuda":   # (CPU tests: the runner's thread stays as it is)
                self._keep_launch_thread_apart()

    def _after_store_round(self, W: int, streams: int) -> None:
        """After a round of W rows of `streams` streams was launched: the store's routing
        record and admissions (store.after_launch: each stream brings its admission budget)."""
        if self.store is not None:
            self.store.after_launch(W, streams)
