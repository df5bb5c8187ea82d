"""The GPU runtime's kept experiments: each field is a choice made on H200 measurements
(the decision and its figures: docs/decisions/, named per field), with the product's value
as its default. No user sets these (config.py holds what a user may set); bench/ and the
tests pass a variant to GPUModel(overrides=...), never by patching a module."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Overrides:
    decode_gemv: str = "i8"         # dense GEMVs on int8 activations (dp4a) | "f32" qmatmul: int8-decode-gemv.md
    moe_gemv: str = "i8"            # routed experts likewise | "f32" (kernels/moe/moe_f32.py): int8-decode-gemv.md
    fuse_q8: bool = True            # producers emit the next GEMV's int8 activations: launch-cuts-kept.md
    pdl: bool = True                # programmatic dependent launch between the round's kernels: pdl.md
    combine_in_norm: bool = True    # the next norm sums the MoE ranks (no combine launch): launch-cuts-kept.md
    norm_router: bool = True        # o adds in its epilogue, the FFN norm makes the router's logits: launch-cuts-kept.md
    early_kv: bool = True           # attention loads old cache rows before its PDL wait: launch-cuts-kept.md
    gemv_split: bool = True         # short o / down GEMVs in 2 runs the next norm adds: split-runs.md
    split_limits: tuple[int, int] = (4096, 4096)   # ... rows of >= this K in matrices of <= this N (qgemv_i8.split_runs)
    gemv_mma: bool = False          # Q4_K dense weights on the tensor cores (qgemv_mma_k): exact-mode-kernel-family.md
    gemv_mma_narrow: int = 2        # ... rounds up to this many rows on qgemv_q8k (the same bits)
    fast_mma_narrow: int = 4        # fast mode: verify rounds wider than this on the mma (64: off): fast-mode-hybrid.md
    prefill_path: str = "dequant"   # > 64 rows: dequantize + cuBLAS | "gemv" (the decode graphs): prefill-tensor-cores.md
    prefill_scratch_mib: int = 512  # the prefill GEMMs' dequantized-weight buffer
    prefill_overlap: bool = False   # dequantize the next weight on a side stream (host-bound: off): prefill-tensor-cores.md
    prefill_graphs: bool = True     # prefill chunks replayed as CUDA graphs: prefill-tensor-cores.md
    moe_prefill_fused: bool = True  # resident experts' chunks as grouped GEMMs (moe_gemm.moe_prefill), not a loop
    deltanet_prefill: str = "fla"   # hybrids' prefill delta rule: fla-core's chunks where importable on CUDA | "ours":
                                    # deltanet-kernels.md
    attention_tiles: tuple[int, int] = (32, 64)   # decode attention's (BLOCK_N, MAX_SPLITS): attention/decode.py's
                                    # TILES (tests pass small ones: the interpreter runs every dead split)

    def __post_init__(self):
        if self.decode_gemv not in ("i8", "f32") or self.moe_gemv not in ("i8", "f32"):
            raise ValueError(f"decode_gemv and moe_gemv are 'i8' or 'f32', got {self.decode_gemv!r}, {self.moe_gemv!r}")
        if self.prefill_path not in ("dequant", "gemv"):
            raise ValueError(f"prefill_path must be 'dequant' or 'gemv', got {self.prefill_path!r}")
        if self.deltanet_prefill not in ("fla", "ours"):
            raise ValueError(f"deltanet_prefill must be 'fla' or 'ours', got {self.deltanet_prefill!r}")


PRODUCT = Overrides()
