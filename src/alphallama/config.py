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


@dataclass(frozen=True)
class EngineDefaults:
    ctx_size: int = 4096          # capped by the model's own context length
    prefill_chunk: int = 512      # rows per prefill forward pass
    decode_gemv: str = "i8"       # GPU decode GEMVs: "i8" (int8 activations, dp4a: kernels/gemv/qgemv_i8.py; 1.3-1.75x
                                  # qmatmul on the H200) | "f32" (kernels/gemv/qmatmul.py: fp32 dequantize + FMA)
    moe_gemv: str = "i8"          # routed experts (resident or bank/host tiers, not the CPU workers): "i8" runs them
                                  # on int8 activations (kernels/moe/moe_i8.py; H200 30B-A3B shape: 2.82 -> 2.39 ms a
                                  # round at W=1, 8.89 -> 5.89 at W=8) | "f32" (kernels/moe/moe_f32.py)
    pdl: bool = True              # GPU decode kernels with programmatic dependent launch (kernels/pdl.py): each may
                                  # start during the previous one's tail (H200, W=1: 8B shape 2.37 -> 2.11 ms a
                                  # round, 30B-A3B 2.39 -> 2.15; same bits as without)
    combine_in_norm: bool = True   # "i8" experts: the next norm sums the MoE ranks itself
                                   # (moe's combine code, the same bits), no combine launch. H200 30B-A3B W=1
                                   # 1.952 -> 1.935 ms, W=8 5.507 -> 5.470 (gpu_decode_arms-*-20261130-142422)
    norm_router: bool = True      # "i8" experts, a float router: the attention's o GEMV adds into the residual in
                                  # its epilogue and the FFN norm computes the router's logits (fused.
                                  # rmsnorm_router_q8): one launch fewer a MoE layer; a new float order for the
                                  # logits, the same at every W. H200 30B-A3B W=1 1.834 -> 1.713 ms, W=8 4.339 ->
                                  # 4.322 (gpu_decode_arms-qwen3-30b-a3b-20261130-173344.json)
    early_kv: bool = True         # the decode round's attention loads the cache rows below pos before its PDL wait
                                  # (kernels/attention/decode.py: valid in a decode round; the same bits). H200 W=1:
                                  # 8B 2.136 -> 2.093 ms, 30B-A3B 1.834 -> 1.793 (gpu_decode_arms-*-20261130-17*)
    gemv_split: bool = True       # "i8": the o and dense down GEMVs of <= 4096 rows of >= 4096 values cut their
                                  # slots into 2 runs (twice the programs), the next norm adds the partials
                                  # (qgemv_i8.split_runs). A new float order, the same at every W. H200, ms at
                                  # W = 1 / 8: 8B 2.099 / 4.743 -> 1.983 / 4.850, 30B-A3B 1.670 / 4.285 -> 1.625 /
                                  # 4.183 (gpu_decode_arms-*-20261201-132*.json)
    gemv_mma: bool = False        # "i8": Q4_K dense weights through kernels/qgemv_mma.qgemv_mma_k (the isums on the
                                  # tensor cores, activations with one scale a 256-value super-block, prepared in a
                                  # launch of their own; the weights also held in fragment order). Another float
                                  # order and activation rounding, the same at every W. H200 8B, all dense weights
                                  # and the head on the mma (narrow 0, Q6_K too): W=1 / 8 1.933 / 4.772 -> 3.068 / 3.984
                                  # ms (gpu_decode_arms-qwen3-8b-20261201-184043.json); Q4_K only, narrow 4: W=1 / 5 / 8
                                  # / 64 1.930 / 4.580 / 4.805 / 30.561 -> 2.256 / 3.562 / 3.918 / 23.666
                                  # (gpu_decode_arms-qwen3-8b-20261201-214103.json); with qgemv_q8k's W-aware tile
                                  # W=1 / 2 / 4 / 5 / 8 1.938 / 2.465 / 3.024 / 4.553 / 4.783 -> 2.138 / 2.686 / 3.528 /
                                  # 3.540 / 3.904 (gpu_decode_arms-qwen3-8b-20261202-040314.json). Off: plain decode
                                  # loses 10%; priced on the public suite's n-gram rounds (Qwen 0.5B's widths, the 8B's
                                  # costs) set A -9%, V +6%, R +23% (price_widths-20261202.json). Where the W = 1 time goes
                                  # (gpu_decode_profile-20261202-040129.json, 6 layers, no PDL): q8k GEMVs +3.2 us a
                                  # layer over dp4a, the combine's q8_K emission +1.8 (two heads a program), the norm +1
    fast_mma_narrow: int = 4      # fast mode (--fast), without gemv_mma: verify rounds of more than this many rows
                                  # run the Q4_K dense weights on the tensor cores (qgemv_mma_k), narrower ones (plain
                                  # decode among them) on dp4a exactly as without it (kernels/gemv/registry.MmaChoice "dp4a").
                                  # Not plain decode's bits (fast mode only); the Q4_K codes held twice (~+3.5 GB on an
                                  # 8B Q4_K_M). 4: dp4a's W = 4 costs what the mma's does, W = 5 jumps (8B ms, dp4a /
                                  # mma: W=4 3.024 / 3.007, W=5 4.553 / 3.540; gpu_decode_arms-qwen3-8b-20261202-040314).
                                  # 64: off
    gemv_mma_narrow: int = 2      # with gemv_mma: rounds of up to this many rows take qgemv_q8k (dp4a on the same
                                  # activations, the mma's bits: exact mode holds) for Q4_K; 0: the mma at every W.
                                  # 2: the mma wins from W = 3 (W=3 / 4 2.875 / 3.007 against q8k's 3.439 / 3.5,
                                  # gpu_decode_arms-qwen3-8b-20261201-214103 / -20261202-040314)
    # removed, slower on the H200 (gpu_qgemv_mma-20261201-213840.json, gpu_decode_arms-qwen3-8b-20261201-214103):
    # gemv_mma's Q6_K option (Q6_K weights and head on the tensor cores, a dp4a partner up to narrow rows): us at
    # W = 1 on the 8B down / head 31.2 / 234 (mma) and 41 / 309 (dp4a partner) against dp4a's 16.4 / 138; rounds
    # at W = 1 3.135 ms against the default's 1.930
    # removed, measured slower on the H200 (30B-A3B, ms W=1 / W=8, gpu_decode_arms-qwen3-30b-a3b-20261201-154856):
    # moe_emit_q8 (experts' gate_up emitting the down's int8 input): 1.625 / 4.178 -> 1.672 / 4.329
    # route_in_norm (the FFN norm's last-arriving program routing, same bits): 1.625 / 4.178 -> 1.664 / 4.290
    # rope_in_attention (the attention's split launch doing qkv_rope's work from the projection, writing the
    # round's K/V rows itself: one launch a layer fewer, a new float order on the GPU): ms W=1 / W=8, 8B
    # 1.935 / 4.843 -> 1.908 / 4.898, 30B-A3B 1.625 / 4.205 -> 1.621 / 4.260 (gpu_decode_arms-*-20261202-005*)
    # l2_warm_mb (a side-stream kernel reading the next dense weights into L2 while the small kernels
    # run, same bits; 8B W=1 ms 1.938 -> 2.888 / 4.302 / 4.968 at 8 / 16 / 32 MB): gpu_decode_arms-*-20261202-00*
    # routing in the experts' gate_up launch (no route launch, same bits): removed, 30B-A3B W1/4/8 ms
    # 1.624/3.100/5.085 vs 1.628/2.721/4.182 (gpu_decode_arms-qwen3-30b-a3b-20261202-035229.json)
    # L2 prefetch in the dense / expert / mma GEMVs (prefetch.global.L2 before the PDL wait): removed, slower
    # (8B W1 1.937 -> 2.231, 30B W1 1.628 -> 1.730, mma-wide-t W1 2.166 -> 2.240 ms; gpu_decode_arms-*-20261202-
    # 034823, -035229, -035630)
    fuse_q8: bool = True          # "i8": the norms, the SiLU and the attention combine emit the next GEMV's int8
                                  # activations in their own launch (kernels/norm, activations); off: a prepare launch each
    prefill_path: str = "dequant"  # GPU chunks > 64 rows: "dequant" (Triton dequantize + cuBLAS; resident MoE
                                   # experts as grouped GEMMs, kernels/moe/moe_gemm.py) | "gemv" (decode graphs).
                                   # H200 30B-A3B shape, 512 rows: 36 ms against 278 ms through the graphs
    prefill_scratch_mib: int = 512   # GPU scratch for dequantized weight row blocks (prefill_path "dequant")
    prefill_overlap: bool = False    # dequantize the next weight on a side stream during each GEMM (scratch: 2 halves);
                                     # off: the H200 prefill is host-bound and the events cost more than they hide
    prefill_graphs: bool = True      # prefill chunks replayed as CUDA graphs between attentions (dense and
                                     # resident-expert MoE models); a shorter chunk padded to 128, 256, .. rows
                                     # (gpu_prefill.graph_rows; the padded shapes not yet timed on a GPU)
                                     # (H200, 8B shape: 26.3k tok/s at 512 against 15.1k eager, same bits)
    device: str = "auto"          # cpu | cuda | auto
    default_model: str = "alphallama-embedded.gguf"   # embedded in alphallama/data (+ its .mtp.gguf head), used when no -m is given


@dataclass(frozen=True)
class SpecDefaults:
    spec_type: str = "none"       # the library's SpecConfig(): plain decoding unless asked
    cli_spec_type: str = "auto"   # run / serve: "auto" is auto_cuda on a GPU and none on the CPU
    auto_cuda: str = "ngram"      # exact mode keeps the text; H200, Qwen2.5-Coder-0.5B suite: 2.06x plain
                                  # (3,074 against 1,493 tok/s; spec_suite-qwen-cuda-h200-20261130-075138.json).
                                  # The CPU verifies a draft's rows one by one (exact), so drafts save it nothing
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


@dataclass(frozen=True)
class TrainDefaults:
    """`python -m alphallama.train`: the embedded model's corpus, shape and schedule."""
    exclude_packages: tuple[str, ...] = ("docker", "jedi", "jmespath", "itsdangerous", "moto", "boto3")
    held_out_fraction: float = 0.02   # of corpus files, chosen by content hash, never trained on
    corpus_mb: int = 160              # Python source taken (the stdlib whole, then site-packages)
    tokenizer_sample_mb: int = 24     # text the BPE is trained on
    instruct_examples: int = 72000    # generated ChatML examples (edits + code-writing requests)
    write_function_weight: int = 6    # code-writing requests per one of each edit kind: chat
                                      # requests are what a user asks first
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
    batch_size: int = 64              # sequences of ctx_len tokens per step (H200: ~285k tok/s,
                                      # against ~255k at 32)
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
    admit_bytes_per_round: int = 8 << 20  # admission copies queued per round (paced, after its launch)
    admit_chunk_bytes: int = 1 << 20      # one queued host->VRAM copy
    score_half_life: float = 32.0         # rounds: usage counts decay so the bank follows the context
    admit_margin: float = 0.25            # a candidate must beat the weakest resident by this fraction
    cpu_threads: int | None = None        # CPU expert workers; None: the bandwidth probe's count (offload/native)
    probe_bytes: int = 256 << 20          # buffer the bandwidth probe streams through
    probe_within: float = 0.9             # the probe takes the fewest threads within this fraction of the best
    cpu_tier: bool = True                 # host-tier experts computed by the CPU workers (else read over PCIe)
    cpu_share: float = 0.6                # of a layer's host (row, rank) pairs, the CPU takes this share, PCIe the rest
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
