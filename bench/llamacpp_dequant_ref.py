"""llama.cpp's own dequantizers (dequantize_row_* of its CPU build's libggml-base) on a few
blocks of every block type: the second, independent reference beside gguf.quants.

    PYTHONPATH=src python bench/llamacpp_dequant_ref.py --lib /work/lcpenv/lib/python3.11/site-packages/llama_cpp/lib \
        [--out tests/data/reference/dequant-llamacpp.json]

The library is loaded with ctypes by this interpreter (which has torch, to make the
blocks); llama-cpp-python itself is not imported. The stored JSON holds each type's block bytes (hex) and the sha256 of llama.cpp's float32
output, which tests/gguf/test_dequant_llamacpp.py compares with ours.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import hashlib
import json
import os

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T

from alphallama.gguf.quants import QUANTS, random_blocks

N_BLOCKS = 4
FLOATS = (T.F32, T.F16, T.BF16)


def finite_random_bytes(qtype: T, n: int, g: torch.Generator) -> torch.Tensor:
    """Random bytes whose fp16 scale fields are finite (exponent bit 14 cleared)."""
    q = QUANTS[qtype]
    b = torch.randint(0, 256, (n, q.type_size), dtype=torch.uint8, generator=g)
    for off in q.f16_fields:
        b[:, off + 1] &= 0xBF
    if qtype == T.IQ1_M:
        b[:, 55] &= 0xBF
    return b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True, help="the folder of a llama.cpp CPU build's libggml-base.so")
    ap.add_argument("--out", default="tests/data/reference/dequant-llamacpp.json")
    args = ap.parse_args()
    lib = ctypes.CDLL(glob.glob(os.path.join(args.lib, "libggml-base.so*"))[0])
    out = {"source": "llama.cpp dequantize_row_* (llama-cpp-python 0.3.36, CPU build)", "types": {}}
    for qtype, q in QUANTS.items():
        if qtype in FLOATS:
            continue
        g = torch.Generator().manual_seed(int(qtype))
        blocks = torch.cat([random_blocks(qtype, N_BLOCKS, g), finite_random_bytes(qtype, N_BLOCKS, g)])
        raw = np.ascontiguousarray(blocks.numpy())
        y = np.empty(raw.shape[0] * q.block_size, dtype=np.float32)
        fn = getattr(lib, "dequantize_row_" + qtype.name.lower().replace("_k", "_K"))   # q4_K, iq2_xs
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn(raw.ctypes.data, y.ctypes.data, y.size)
        out["types"][qtype.name] = {"blocks": raw.tobytes().hex(), "sha256": hashlib.sha256(y.tobytes()).hexdigest(),
                                    "first": [float(v) for v in y[:4]]}
        print(qtype.name, out["types"][qtype.name]["sha256"][:16])
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(args.out)


if __name__ == "__main__":
    main()
