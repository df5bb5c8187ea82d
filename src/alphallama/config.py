"""Every default in one place. Modules take explicit arguments; the CLI and server fill
them from here, so a default is changed once, not hunted down."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 0.0      # greedy unless asked
    top_k: int = 0                # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    # llama.cpp's penalties sampler (penalties.py): off by default, as in llama.cpp
    repeat_penalty: float = 1.0   # 1 = off
    repeat_last_n: int = 64       # the window: the last N tokens of prompt + output (0 = off, -1 = the context)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


@dataclass(frozen=True)
class EngineDefaults:
    """What a user sets about the engine. The GPU runtime's kept experiments (GEMV forms,
    launch cuts, the tensor cores' widths, the prefill path) are runtime/overrides.py."""
    ctx_size: int = 4096          # capped by the model's own context length
    prefill_chunk: int = 512      # rows per prefill forward pass
    device: str = "auto"          # cpu | cuda | auto
    default_model: str = "alphallama-embedded.gguf"   # embedded in alphallama/data (+ its .mtp.gguf head), used when no -m is given


@dataclass(frozen=True)
class SpecDefaults:
    spec_type: str = "none"       # the library's SpecConfig(): plain decoding unless asked
    cli_spec_type: str = "auto"   # run / serve: "auto" is auto_cuda on a GPU and none on the CPU
    auto_cuda: str = "ngram"      # exact mode keeps the text, so the copy drafter's speed-up costs nothing
                                  # in output (docs/decisions/spec-default-auto.md). The CPU verifies a
                                  # draft's rows one by one (exact), so drafts save it nothing
    draft_max: int = 16
    ngram_min: int = 2
    fast: bool = False
    mtp_depth: int = 3            # MTP drafts per round (1..5)
    mtp_min_p: float = 0.5        # MTP stops before a draft whose probability is under this
    mtp_switch: bool = True       # MTP drafts only while its tokens pay for the head's measured ms (spec/policy.py)
    p_min: float | None = None    # fixed confidence floor for verified drafts; None: priced by the cost table
    gate: bool = True             # confidence-gated verify width (spec/gate.py)
    gate_free: float = 0.10       # gate off when the widest round costs at most this much more than W = 1
    long_match: int = 6           # copy matches this long win on agreement alone (shorter ones are priced)
    copy_margin: float = 0.03     # a short match's copy must beat MTP's tokens/ms by this share
    policy_min_obs: int = 4       # rounds each side needs at a match length before pricing may pick the copy
    cost_budget_s: float = 2.0    # time spent timing widths (then extrapolated linearly)
    cost_cache_dir: str = "~/.cache/alphallama"   # where measured round costs are kept


@dataclass(frozen=True)
class ServerDefaults:
    host: str = "127.0.0.1"
    port: int = 8080
    queue_size: int = 16          # requests waiting behind the one generating; more get 429
    n_predict: int = -1           # max tokens when a request gives none; -1: until EOS or the context is full
    retry_after_s: int = 1        # Retry-After sent with a 429
    max_body_bytes: int = 32 << 20   # larger request bodies get 413
    max_stop_strings: int = 16
    max_stop_chars: int = 1024    # per stop string (each generated token is checked against it)
    max_embedding_inputs: int = 256   # inputs per /v1/embeddings request (each is one queued forward pass)
    pooling: str = "mean"         # /v1/embeddings: mean | cls | last over the final hidden states
    reasoning_format: str = "auto"   # a thinking model's <think> text: reasoning_content (auto, deepseek) | content (none)


@dataclass(frozen=True)
class TrainDefaults:
    """`python -m alphallama.train`: the embedded model's corpus, shape and schedule."""
    exclude_packages: tuple[str, ...] = ("docker", "jedi", "jmespath", "itsdangerous", "moto", "boto3")
    held_out_fraction: float = 0.02   # of corpus files, chosen by content hash, never trained on
    corpus_mb: int = 160              # Python source taken (the stdlib whole, then site-packages)
    tokenizer_sample_mb: int = 24     # text the BPE is trained on
    instruct_examples: int = 72000    # generated ChatML examples (edits + code-writing requests)
    write_function_weight: int = 6    # code-writing requests per one of each edit kind (the shipped
                                      # model's mix; 56k at 10, fewer edits, lost: lost-experiments.md)
    vocab_size: int = 12288
    ctx_len: int = 1024
    d_model: int = 512
    n_layers: int = 6
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 64
    n_experts: int = 8
    n_experts_used: int = 2
    d_ff_expert: int = 256
    mtp_d_ff: int = 1024              # the MTP block's dense FFN
    mtp_depths: int = 3
    mtp_weight: float = 0.3           # loss = main + mtp_weight * mean(depth losses) + aux
    aux_weight: float = 0.01          # MoE load balancing
    ce_chunk: int = 8192              # rows a chunk of the cross-entropies (train/ce.py; 0: the plain
                                      # form with [B, T, V] float32 logits)
    mtp_frac: float = 0.25            # share of positions each MTP depth's loss scores a step (an
                                      # unbiased estimate: a quarter of its logits)
    batch_size: int = 64              # sequences of ctx_len tokens per step (64: more tokens a second
                                      # than 32; docs/decisions/embedded-model.md)
    lr: float = 2e-3
    warmup_steps: int = 150
    time_budget_s: float = 330.0      # training seconds (total over resumed calls)
    checkpoint_every_s: float = 60.0
    log_every: int = 20               # steps between log lines
    val_every_s: float = 45.0         # training seconds between held-out losses
    val_windows: int = 16             # held-out windows per evaluation
    weight_decay: float = 0.1
    seed: int = 0
    work_dir: str = "~/.cache/alphallama/train"      # private: created 0700, never a shared /tmp path


@dataclass(frozen=True)
class DistillDefaults:
    """`python -m alphallama.train.distill_mtp`: an MTP sidecar distilled from a frozen model."""
    time_budget_s: float = 240.0      # training seconds
    gen_budget_s: float = 60.0        # the teacher answering chat requests (its own outputs: the data)
    depths: int = 3
    seq_len: int = 1024
    batch_size: int = 16              # rows of seq_len tokens per step
    lr: float = 5e-4
    min_lr_frac: float = 0.1          # cosine over the time budget down to lr * this
    warmup_steps: int = 50
    max_steps: int = 0                # 0: until the time budget
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    corpus_mb: int = 120              # Python source read (the stdlib whole, then site-packages)
    code_tokens: int = 24_000_000     # corpus tokens tokenized for training (epochs cycle over them)
    held_out_frac: float = 0.02       # corpus files held out by content hash (evaluation only)
    requests: int = 6000              # chat requests for the teacher to answer
    eval_requests: int = 128          # ... from held-out files
    max_new: int = 384                # tokens per answer
    max_prompt: int = 2048            # longer request prompts are dropped
    chat_share: float = 0.4           # of training rows
    eval_code_rows: int = 64
    eval_batch: int = 16
    loss_chunk: int = 2048            # rows per output-head chunk in the loss ([rows, vocab] float32)
    min_p: float = 0.5                # the drafter's stop rule, for the gated evaluation
    log_every: int = 10
    eval_every_s: float = 60.0        # held-out evaluation during training (its time is not counted)
    deadline_s: float = 540.0         # the whole run ends within this (a device call is cut at 600 s)
    reserve_s: float = 45.0           # ... keeping this for the final evaluation and the export
    init: str = "last-layer"          # the block starts as a copy of the model's last layer (or "random")
    qtype: str = "Q8_0"               # the sidecar's matrices
    part_mib: int = 15                # the sidecar comes back in parts of at most this size
    work_dir: str = "~/.cache/alphallama/distill"    # private: created 0700, never a shared /tmp path
    seed: int = 0


@dataclass(frozen=True)
class MTPDefaults:
    """The MTP head at run time (model/mtp.py, runtime/gpu_mtp.py, spec/mtp.py, spec/draft_vocab.py)."""
    max_depth: int = 5            # the most drafts one MTP chain may make
    draft_vocab: int = 32768      # output rows the MTP head scores (the whole vocabulary when smaller)
    script_min_chars: int = 2     # letters of a script a prompt needs to put it in the draft vocabulary


@dataclass(frozen=True)
class OffloadDefaults:
    """The expert store and the automatic plan (offload/)."""
    reserve_bytes: int = 1 << 30          # device memory kept for graphs, workspace, the CUDA context's growth
    headroom_bytes: int = 256 << 20       # taken off the free memory a GPU reports before planning
    admit_bytes_per_round: int = 8 << 20  # admission copies queued per round and stream in it (paced, after its launch)
    admit_chunk_bytes: int = 1 << 20      # one queued host->VRAM copy
    score_half_life: float = 32.0         # rounds: usage counts decay so the bank follows the context
    admit_margin: float = 0.25            # a candidate must beat the weakest resident by this fraction
    cpu_threads: int | None = None        # CPU expert workers; None: the bandwidth probe's count (offload/native)
    probe_bytes: int = 256 << 20          # buffer the bandwidth probe streams through
    probe_within: float = 0.9             # the probe takes the fewest threads within this fraction of the best
    cpu_tier: bool = True                 # host-tier experts computed by the CPU workers (else read over PCIe)
    # the CPU workers' share of a layer's host (row, rank) pairs, PCIe the rest: at first where the plan's rates
    # have both finish together (estimate.MissRates.of), then the rounds' periods tune it (offload/share_tuner.py)
    cpu_share_tune: bool = True
    host_mem: int | None = None           # pinned RAM the host tier may hold (--host-mem); None: what the host has
                                          # available; the layers past it stay in the mapped GGUF file
    host_headroom: float = 0.2            # of MemAvailable, kept for everything else (and the mapped tier's page cache)
    readahead_experts: int = 16           # likely experts per mapped layer read ahead between rounds (madvise)
    # the plan's cost model (offload/estimate.py), from measured rounds (docs/decisions/offload-v2.md)
    layer_fixed_s: float = 23.5e-6        # a decode layer's fixed kernel cost over its bytes (decode-cost-model.md)
    store_layer_extra_s: float = 57e-6    # an MoE layer on the store's contract kernels over the resident ones
    worker_efficiency: float = 0.57       # the CPU workers' compute rate over the RAM probe's (59 of 103 GB/s)
    assumed_gpu_bw: float = 3.0e12        # bytes/s priced where no GPU is here to measure (plan --gpu-mem)
    assumed_pcie_bw: float = 25e9
    assumed_ram_bw: float = 103e9         # the workers' RAM rate priced without a plan's probe (the H200 host's)
    assumed_disk_bw: float = 1.3e9        # a cold read where the disk could not be measured (the H100 host's 1.27)
    # the gate's price of a verify round's misses (offload/footprint.py, spec/offload_costs.py)
    footprint_half_life: float = 64.0     # rows: the routing's distinct-expert counts follow the context
    footprint_prior_rows: float = 16.0    # the plan's uniform-routing model counts as this many rows at first
    auto_env: str = "ALPHA_AUTO"          # ALPHA_AUTO=0 turns the automatic plan off


@dataclass(frozen=True)
class Defaults:
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    engine: EngineDefaults = field(default_factory=EngineDefaults)
    spec: SpecDefaults = field(default_factory=SpecDefaults)
    server: ServerDefaults = field(default_factory=ServerDefaults)
    offload: OffloadDefaults = field(default_factory=OffloadDefaults)
    mtp: MTPDefaults = field(default_factory=MTPDefaults)
    train: TrainDefaults = field(default_factory=TrainDefaults)
    distill: DistillDefaults = field(default_factory=DistillDefaults)


DEFAULTS = Defaults()
