"""Where a real GGUF file's header fields sit, found by `gguf.GGUFReader` (not by our
reader), so tests can overwrite one count, offset, dim or type in place."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES

# a string array's parts beyond these are (length, bytes) pairs of more of the same
_PARTS_PER_FIELD = 12


@dataclass(frozen=True)
class Field:
    """One integer in the header: `fmt` is its struct format, `owner` the key or tensor."""
    pos: int
    fmt: str      # "<Q", "<I", ...
    owner: str
    index: int    # which integer of the owner (tensor: 0 name length, 1 n_dims, 2.. dims, type, offset)
    tensor: bool  # part of the tensor table (else the metadata)
    value: int
    last: bool    # the owner's last integer (a tensor's data offset)


def header_fields(path: Path) -> list[Field]:
    """Every integer of the file's header, in file order (long string arrays sampled)."""
    r = GGUFReader(path)
    out: list[Field] = []
    owners = [(k, f, False) for k, f in r.fields.items()] + [(t.name, t.field, True) for t in r.tensors]
    for owner, field, is_tensor in owners:
        pos, idx = field.offset, 0
        parts = field.parts if len(field.parts) <= _PARTS_PER_FIELD else field.parts[:_PARTS_PER_FIELD]
        for part in parts:
            if part.dtype.kind in "ui" and part.dtype.itemsize in (4, 8):
                code = {4: "I", 8: "Q"}[part.dtype.itemsize]
                fmt = "<" + (code.lower() if part.dtype.kind == "i" else code)
                for j, v in enumerate(np.asarray(part).ravel().tolist()):
                    out.append(Field(pos + j * part.dtype.itemsize, fmt, owner, idx, is_tensor, int(v), False))
                    idx += 1
            pos += part.nbytes
        if is_tensor:
            out[-1] = replace(out[-1], last=True)
    return out


@dataclass(frozen=True)
class Span:
    name: str
    start: int
    end: int


def tensor_spans(path: Path) -> dict[str, Span]:
    """Each tensor's [start, end) in the file, as gguf.GGUFReader computes it."""
    r = GGUFReader(path)
    out = {}
    for t in r.tensors:
        block, size = GGML_QUANT_SIZES[t.tensor_type]
        n = math.prod(int(d) for d in t.shape) // block * size
        out[t.name] = Span(t.name, int(t.data_offset), int(t.data_offset) + n)
    return out
