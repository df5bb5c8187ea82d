"""Reading GGUF files: metadata and memory-mapped tensors, never copying tensor data.

The `gguf` package gives the format's constants (value types, quant block sizes); the
header is parsed here with bounds checks. Two reasons not to use `gguf.GGUFReader`:
it takes ~6 s on a 150k-token vocabulary (it builds a numpy view per string; this
parser takes 0.15 s), and a damaged file (absurd array lengths, a tensor table that
runs off the end) makes it misparse silently or fail deep inside. Tests check that
both parsers agree on every key and tensor.

Every file is treated as hostile: each count, length and offset is checked against the
file before it is used (`_parse`, `validate_tensor_table`), so a damaged or crafted file
gives one GGUFError line naming the problem, never another exception, a huge allocation,
or tensors that overlap or run off the end and compute garbage. tests/gguf fuzzes this.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES


class GGUFError(ValueError):
    """A file that is not a usable GGUF; the message names the file and the problem."""


GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4
# Fixed-size scalar value types: struct format per GGUFValueType.
_SCALAR = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


class _Cursor:
    """Bounds-checked little-endian reads over a byte buffer."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated or corrupt header: {what} at byte {self.pos} "
                            f"needs {n} bytes but the file has {len(self.buf)}")

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize("<" + fmt)
        self.need(n, what)
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str, limit: int | None = None) -> bytes:
        n = self.scalar("Q", what + " length")
        if limit is not None and n > limit:
            raise GGUFError(f"{self.path}: {what} at byte {self.pos - 8} is {n} bytes long (at most {limit})")
        self.need(n, what)
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s


_NP = {GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
       GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
       GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
       GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8"}


def _value_type(cur: _Cursor, vtype: int, key: str) -> GGUFValueType:
    """`key`: the label of the key being read (`_label`), for messages."""
    try:
        return GGUFValueType(vtype)
    except ValueError:
        raise GGUFError(f"{cur.path}: metadata key {key} has unknown value type {vtype}") from None


# An array's element that is itself an array takes at least its type and count (12 bytes).
_MIN_ARRAY_ITEM = 12
# llama.cpp reads no nested arrays; gguf-py writes them. Deeper nesting is corrupt (and
# would otherwise recurse until Python's stack gives out).
MAX_ARRAY_NESTING = 4
# The smallest possible metadata entry (key length, empty key, type, one byte) and
# tensor-table entry (name length, empty name, n_dims, one dim, type, offset): a count
# whose entries cannot fit in the rest of the file is corrupt, whatever it claims.
_MIN_KV, _MIN_TENSOR_INFO = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8
# ggml sizes tensors in int64: an element count at or above this overflows it.
_MAX_ELEMENTS = 2**63
# The spec's bound on key length, and ggml's on tensor names (GGML_MAX_NAME = 64 with
# its NUL): longer is a corrupt length field, whose "name" would fill the error message.
MAX_KEY_BYTES, MAX_NAME_BYTES = 65535, 63
# Arrays become Python lists (~8-24 bytes an element): in a 20 GB model a corrupt count
# could otherwise claim billions of elements that fit in the file. The largest real
# vocabularies have ~262k tokens; 16M leaves room for any tokenizer.
MAX_ARRAY_ELEMENTS = 1 << 24


def _label(key: str) -> str:
    """A key for an error message: quoted, and cut short so the message stays one line."""
    r = repr(key)
    return r if len(r) <= 80 else r[:76] + "...'"


def _read_value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> Any:
    vt = _value_type(cur, vtype, key)
    if vt == GGUFValueType.STRING:
        return cur.string(f"string value of {key}").decode("utf-8", "replace")
    if vt != GGUFValueType.ARRAY:
        return cur.scalar(_SCALAR[vt], f"value of {key}")
    if depth >= MAX_ARRAY_NESTING:
        raise GGUFError(f"{cur.path}: metadata key {key} nests arrays more than {MAX_ARRAY_NESTING} deep")
    et = _value_type(cur, cur.scalar("I", f"array type of {key}"), key)
    count = cur.scalar("Q", f"array length of {key}")
    if count > MAX_ARRAY_ELEMENTS:
        raise GGUFError(f"{cur.path}: array {key} claims {count} elements, more than the "
                        f"{MAX_ARRAY_ELEMENTS} a metadata array may hold")
    remaining = len(cur.buf) - cur.pos
    # Every element takes at least one byte (a string 8, an array 12): a count that
    # cannot fit in the rest of the file is corrupt, not merely large.
    min_size = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: _MIN_ARRAY_ITEM}.get(et) \
        or np.dtype(_NP[et]).itemsize
    if count * min_size > remaining:
        raise GGUFError(f"{cur.path}: array {key} claims {count} elements, "
                        f"more than the {remaining} bytes left in the file can hold")
    if et in _NP:
        arr = np.frombuffer(cur.buf, dtype=_NP[et], count=count, offset=cur.pos)
        cur.pos += arr.nbytes
        return arr.tolist()
    if et == GGUFValueType.STRING:
        out, buf, pos, n = [], cur.buf, cur.pos, len(cur.buf)
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):  # hot loop for 150k-token vocabularies: keep it lean
            if pos + 8 > n:
                cur.pos = pos
                cur.need(8, f"array {key}")
            (ln,) = unpack(buf, pos)
            pos += 8
            if pos + ln > n:
                cur.pos = pos
                cur.need(ln, f"array {key}")
            out.append(bytes(buf[pos:pos + ln]).decode("utf-8", "replace"))
            pos += ln
        cur.pos = pos
        return out
    return [_read_value(cur, et, key, depth + 1) for _ in range(count)]  # nested arrays


@dataclass(frozen=True)
class TableEntry:
    """One row of the tensor table as the header states it (ggml order dims, offset
    relative to the data section)."""
    name: str
    dims: list[int]
    qtype: GGMLQuantizationType
    offset: int


def _parse(path: str, buf) -> tuple[dict[str, Any], list[TableEntry], int]:
    """Parse and validate the header: (metadata, tensor table, data start).

    Raises GGUFError naming the first problem: bad magic, unknown version, a count or
    length the file cannot hold, a duplicate key, or any of `validate_tensor_table`'s."""
    cur = _Cursor(buf, path)
    cur.need(4, "magic")
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
    cur.pos = 4
    version = cur.scalar("I", "version")
    if version not in SUPPORTED_VERSIONS and int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
        raise GGUFError(f"{path}: a big-endian GGUF file; only little-endian ones are supported")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(f"{path}: GGUF version {version} is not supported (only {SUPPORTED_VERSIONS})")
    n_tensors = cur.scalar("Q", "tensor count")
    n_kv = cur.scalar("Q", "metadata count")
    if n_tensors * _MIN_TENSOR_INFO + n_kv * _MIN_KV > len(buf) - cur.pos:
        raise GGUFError(f"{path}: header claims {n_tensors} tensors and {n_kv} metadata keys, "
                        f"impossible in a file of {len(buf)} bytes")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key", MAX_KEY_BYTES).decode("utf-8", "replace")
        label = _label(key)
        if key in metadata:
            raise GGUFError(f"{path}: metadata key {label} appears twice")
        metadata[key] = _read_value(cur, cur.scalar("I", f"type of {label}"), label)
    alignment = metadata.get("general.alignment", 32)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: general.alignment {alignment!r} is not a power of two")
    table = []
    for _ in range(n_tensors):
        name = cur.string("tensor name", MAX_NAME_BYTES).decode("utf-8", "replace")
        n_dims = cur.scalar("I", f"dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{path}: tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = [cur.scalar("Q", f"shape of tensor {name!r}") for _ in range(n_dims)]
        qtype = cur.scalar("I", f"type of tensor {name!r}")
        offset = cur.scalar("Q", f"offset of tensor {name!r}")
        try:
            qt = GGMLQuantizationType(qtype)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name!r} has unknown type {qtype}") from None
        table.append(TableEntry(name, dims, qt, offset))
    data_start = -(-cur.pos // alignment) * alignment
    validate_tensor_table(path, table, data_start, len(buf), alignment)
    return metadata, table, data_start


def validate_tensor_table(path: str, table: list[TableEntry], data_start: int, file_size: int,
                          alignment: int) -> None:
    """The checks that make every tensor view safe: unique names, sane dims, whole
    quant blocks, aligned offsets, data inside the file, no two tensors sharing bytes.

    A file failing any of them would load and compute garbage (or fault on a page past
    the end), so it is refused with the first problem named. `GGUFFile` is the only
    caller: `inspect`, `run`, `serve` and training all open models through it, so they
    agree on what is valid."""
    seen: set[str] = set()
    spans = []
    for t in table:
        what = f"{path}: tensor {t.name!r}"
        if t.name in seen:
            raise GGUFError(f"{what} appears twice")
        seen.add(t.name)
        if min(t.dims) < 1 or math.prod(t.dims) >= _MAX_ELEMENTS:
            raise GGUFError(f"{what} has shape {t.dims}: every dimension must be at least 1 "
                            f"and the element count below 2**63")
        block, _ = GGML_QUANT_SIZES[t.qtype]
        if t.dims[0] % block:
            raise GGUFError(f"{what} row of {t.dims[0]} is not a multiple of "
                            f"the {t.qtype.name} block size {block}")
        if t.offset % alignment:
            raise GGUFError(f"{what} data offset {t.offset} is not a multiple of "
                            f"the file's alignment {alignment}")
        start = data_start + t.offset
        end = start + _nbytes(t.dims, t.qtype)
        if end > file_size:
            raise GGUFError(f"{what} ({t.qtype.name}, shape {t.dims}) data [{start}, {end}) ends "
                            f"past the end of the file ({file_size} bytes): the file is truncated or corrupt")
        spans.append((start, end, t.name))
    spans.sort()
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise GGUFError(f"{path}: tensor {n1!r}: data [{s1}, {e1}) overlaps {n0!r} [{s0}, {e0})")


def _nbytes(dims: list[int], qt: GGMLQuantizationType) -> int:
    block, type_size = GGML_QUANT_SIZES[qt]
    n = 1
    for d in dims:
        n *= int(d)
    return n // block * type_size


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]   # torch order: outermost first, e.g. [out_features, in_features]
    data: np.ndarray         # memory-mapped raw view; uint8 rows for block formats
    offset: int              # where `data` starts in the file (absolute, aligned)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class GGUFFile:
    """A GGUF file opened for reading: `.metadata` (plain values) and `.tensors` (mmap views).

    Parsing reads only the header; tensor data stays in the page cache until a
    consumer touches it."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        if not os.path.exists(self.path):
            raise GGUFError(f"{self.path}: no such file")
        if not os.path.isfile(self.path):
            raise GGUFError(f"{self.path}: not a regular file")
        size = os.path.getsize(self.path)
        if size < 24:
            raise GGUFError(f"{self.path}: too small to be a GGUF file ({size} bytes)")
        try:
            self._mm = np.memmap(self.path, mode="r")
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot be read: {e.strerror or e}") from None
        self.metadata, table, data_start = _parse(self.path, memoryview(self._mm))
        self.tensors: dict[str, TensorInfo] = {}
        for t in table:   # validated by _parse: every view below lies inside the file, alone
            shape = tuple(int(d) for d in reversed(t.dims))   # torch order
            block, type_size = GGML_QUANT_SIZES[t.qtype]
            start = data_start + t.offset
            raw = self._mm[start:start + _nbytes(t.dims, t.qtype)]
            if block == 1:   # plain float types: a typed view in the tensor's shape
                raw = raw.view(_FLOAT_DTYPES[t.qtype]).reshape(shape)
            else:            # block formats: rows of raw bytes
                raw = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
            self.tensors[t.name] = TensorInfo(t.name, t.qtype, shape, raw, start)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: metadata has no general.architecture")
        return arch

    @property
    def file_size(self) -> int:
        return os.path.getsize(self.path)


_FLOAT_DTYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.BF16: np.uint16, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}
