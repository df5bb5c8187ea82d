"""One hand-built file per check of the GGUF header (reader._parse, validate_tensor_table).

The files are assembled here byte by byte from the GGUF spec, not by a GGUF writer, so
each can break exactly one rule; the valid ones must read back the bytes put in."""
from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf.constants import GGML_QUANT_SIZES

from alphallama.gguf.arch import config_from_metadata
from alphallama.gguf.reader import GGUFError, GGUFFile


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _value(vtype: V, v) -> bytes:
    if vtype == V.STRING:
        return _str(v)
    if vtype == V.UINT32:
        return struct.pack("<I", v)
    if vtype == V.BOOL:
        return struct.pack("<?", v)
    et, items = v   # (element type, items)
    return struct.pack("<IQ", et, len(items)) + b"".join(_value(et, x) for x in items)


def gguf_bytes(tensors, kv=(), alignment: int = 32, data_bytes: int | None = None, count_tensors=None) -> bytes:
    """tensors: (name, ggml-order dims, type, offset); kv: (key, value type, value).
    The data section is zero-filled up to the last tensor's end (or `data_bytes`),
    then each tensor's first byte is set to its index + 1 so views can be told apart."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if count_tensors is None else count_tensors, len(kv))
    for key, vtype, v in kv:
        head += _str(key) + struct.pack("<I", vtype) + _value(vtype, v)
    for name, dims, qt, offset in tensors:
        head += _str(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        head += struct.pack("<IQ", qt, offset)
    head += b"\0" * (-len(head) % alignment)
    sizes = [_size(dims, qt) for _, dims, qt, _ in tensors]
    n = data_bytes if data_bytes is not None else max((o + s for (*_, o), s in zip(tensors, sizes)), default=0)
    data = bytearray(n)
    for i, ((*_, off), size) in enumerate(zip(tensors, sizes)):
        if size and off < n:
            data[off] = i + 1
    return head + bytes(data)


def _size(dims, qt) -> int:
    """Bytes of a tensor per the gguf package's type table (0 for a type it does not know)."""
    if qt not in Q._value2member_map_:
        return 0
    block, type_size = GGML_QUANT_SIZES[Q(qt)]
    return int(np.prod(dims, dtype=object)) // block * type_size


def _open(tmp_path, data: bytes) -> GGUFFile:
    p = tmp_path / "case.gguf"
    p.write_bytes(data)
    return GGUFFile(p)


A = ("blk.0.attn_q.weight", [32, 4], Q.F32, 0)        # 512 bytes at 0
B = ("blk.0.attn_k.weight", [64, 2], Q.Q8_0, 512)     # 2 rows of 2 blocks: 136 bytes at 512


def test_valid_file_reads_back_its_bytes_at_its_offsets(tmp_path):
    f = _open(tmp_path, gguf_bytes([A, B, ("norm", [7], Q.F16, 672)], alignment=32))
    q, k, n = (f.tensors[x] for x in (A[0], B[0], "norm"))
    assert q.shape == (4, 32) and q.data.dtype == np.float32 and q.offset % 32 == 0
    assert q.data.view(np.uint8).ravel()[0] == 1 and k.data.shape == (2, 68) and k.data.ravel()[0] == 2
    assert n.shape == (7,) and n.data.view(np.uint8)[0] == 3 and n.offset == q.offset + 672


def test_custom_alignment_is_honoured(tmp_path):
    kv = [("general.alignment", V.UINT32, 64)]
    f = _open(tmp_path, gguf_bytes([A, (B[0], B[1], B[2], 512)], kv=kv, alignment=64))
    assert all(t.offset % 64 == 0 for t in f.tensors.values())
    with pytest.raises(GGUFError, match=r"offset 544 is not a multiple of the file's alignment 64"):
        _open(tmp_path, gguf_bytes([A, (B[0], B[1], B[2], 544)], kv=kv, alignment=64))


CASES = {
    "misaligned offset": ([A, (*B[:3], 520)], {}, r"'blk.0.attn_k.weight' data offset 520 is not a multiple of "
                                                  r"the file's alignment 32"),
    "outside the file": ([A, B], {"data_bytes": 600}, r"'blk.0.attn_k.weight' \(Q8_0, shape \[64, 2\]\) data "
                                                      r"\[\d+, \d+\) ends past the end of the file"),
    "offset beyond 2**63": ([A, (*B[:3], 2**64 - 32)], {"data_bytes": 1024}, "past the end of the file"),
    "overlap": ([A, (*B[:3], 480)], {"data_bytes": 1024},
                r"tensor 'blk.0.attn_k.weight': data \[\d+, \d+\) overlaps 'blk.0.attn_q.weight' \[\d+, \d+\)"),
    "same offset": ([A, ("other", [32, 4], Q.F32, 0)], {}, "overlaps"),
    "duplicate name": ([A, (A[0], [8], Q.F32, 512)], {}, r"'blk.0.attn_q.weight' appears twice"),
    "zero dim": ([A, ("empty", [32, 0], Q.F32, 512)], {}, r"'empty' has shape \[32, 0\]: every dimension"),
    "element count overflows int64": ([("huge", [2**32, 2**32, 2**32], Q.F32, 0)], {"data_bytes": 64},
                                      "element count below 2\\*\\*63"),
    "partial quant block": ([("q", [33, 2], Q.Q8_0, 0)], {"data_bytes": 128}, "row of 33 is not a multiple of "
                                                                             "the Q8_0 block size 32"),
    "unknown type": ([("q", [32], 99, 0)], {"data_bytes": 128}, "unknown type 99"),
    "five dims": ([("q", [1, 1, 1, 1, 1], Q.F32, 0)], {"data_bytes": 32}, r"5 dimensions \(1 to 4 allowed\)"),
    "huge tensor count": ([A], {"count_tensors": 2**40}, "header claims 1099511627776 tensors"),
    "name too long": ([("n" * 64, [8], Q.F32, 0)], {}, "tensor name at byte .* is 64 bytes long \\(at most 63\\)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_tensor_table_check(tmp_path, case):
    tensors, kw, message = CASES[case]
    with pytest.raises(GGUFError, match=message):
        _open(tmp_path, gguf_bytes(tensors, **kw))


@pytest.mark.parametrize("kv,message", [
    ([("general.alignment", V.UINT32, 48)], "general.alignment 48 is not a power of two"),
    ([("general.alignment", V.UINT32, 0)], "general.alignment 0 is not a power of two"),
    ([("general.alignment", V.BOOL, True)], "general.alignment True is not a power of two"),
    ([("k", V.UINT32, 1), ("k", V.UINT32, 2)], "metadata key 'k' appears twice"),
    ([("k" * 200, V.UINT32, 1), ("k" * 200, V.UINT32, 2)], "metadata key 'k{75}\\.\\.\\.' appears twice$"),
    ([("k" * 65536, V.UINT32, 1)], "metadata key at byte 24 is 65536 bytes long"),
    ([("deep", V.ARRAY, (V.ARRAY, [(V.ARRAY, [(V.ARRAY, [(V.ARRAY, [(V.UINT32, [1])])])])]))],
     "'deep' nests arrays more than 4 deep"),
], ids=["not-power-of-two", "zero-alignment", "bool-alignment", "duplicate-key", "long-key-cut-short",
        "key-too-long", "deep-nesting"])
def test_each_metadata_check(tmp_path, kv, message):
    with pytest.raises(GGUFError, match=message):
        _open(tmp_path, gguf_bytes([A], kv=kv))


def test_big_endian_and_non_files_are_named(tmp_path):
    data = gguf_bytes([A])
    swapped = data[:4] + struct.pack(">IQQ", *struct.unpack_from("<IQQ", data, 4)) + data[24:]
    with pytest.raises(GGUFError, match="a big-endian GGUF file; only little-endian ones are supported"):
        _open(tmp_path, swapped)
    with pytest.raises(GGUFError, match="not a regular file"):
        GGUFFile(tmp_path)
    with pytest.raises(GGUFError, match="no such file"):
        GGUFFile(tmp_path / "absent.gguf")


def test_nested_arrays_within_the_limit_read(tmp_path):
    kv = [("nested", V.ARRAY, (V.ARRAY, [(V.UINT32, [1, 2]), (V.STRING, ["a"])]))]
    assert _open(tmp_path, gguf_bytes([A], kv=kv)).metadata["nested"] == [[1, 2], ["a"]]


def test_array_longer_than_any_vocabulary_is_refused(tmp_path):
    """A count that a big file could hold (its tensor data) but no real array has."""
    data = bytearray(gguf_bytes([A], kv=[("a", V.ARRAY, (V.UINT32, []))]))
    at = data.index(b"a") + 1 + 4 + 4
    data[at:at + 8] = struct.pack("<Q", 2**24 + 1)
    with pytest.raises(GGUFError, match="array 'a' claims 16777217 elements, more than the 16777216"):
        _open(tmp_path, bytes(data))


def test_array_of_arrays_claiming_more_than_the_file_holds(tmp_path):
    data = bytearray(gguf_bytes([A], kv=[("a", V.ARRAY, (V.ARRAY, []))]))
    at = data.index(b"a") + 1 + 4 + 4   # key, value type ARRAY, element type ARRAY: the count
    data[at:at + 8] = struct.pack("<Q", len(data) // 12)   # 12 bytes each cannot fit
    with pytest.raises(GGUFError, match="claims .* elements, more than the"):
        _open(tmp_path, bytes(data))


@pytest.mark.parametrize("md,message", [
    ({"llama.block_count": "6"}, "llama.block_count = '6' is not an integer >= 1"),
    ({"llama.block_count": 2**40}, "block_count = 1099511627776 but the file has only 20 tensors"),
    ({"llama.attention.head_count": 0}, "head_count = 0 is not an integer >= 1"),
    ({"llama.embedding_length": [64]}, r"embedding_length = \[64\] is not an integer"),
    ({"llama.context_length": True}, "context_length = True is not an integer"),
    ({"llama.rope.freq_base": "x"}, "rope.freq_base = 'x' is not a positive number"),
    ({"llama.attention.layer_norm_rms_epsilon": float("nan")}, "is not a positive number"),
], ids=["string", "huge-block-count", "zero-heads", "array", "bool", "string-float", "nan"])
def test_hyperparameters_of_the_wrong_type_or_range_are_named(md, message):
    base = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
            "llama.attention.head_count": 4, "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.raises(GGUFError, match=message):
        config_from_metadata(base | md, {f"t{i}": None for i in range(20)}, "m.gguf")


def test_cli_names_the_overlap_in_one_line(tmp_path):
    p = tmp_path / "overlap.gguf"
    p.write_bytes(gguf_bytes([A, (*B[:3], 480)], data_bytes=1024))
    for cmd in (["inspect", "-m", str(p)], ["run", "-m", str(p), "-p", "hi", "-n", "1"]):
        r = subprocess.run([sys.executable, "-m", "alphallama.cli", *cmd], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip().splitlines() == [
            f"alphallama: error: {p}: tensor 'blk.0.attn_k.weight': data [{480 + _header_len(p)}, "
            f"{616 + _header_len(p)}) overlaps 'blk.0.attn_q.weight' [{_header_len(p)}, {512 + _header_len(p)})"]


def _header_len(p) -> int:
    return p.stat().st_size - 1024


def test_run_names_a_tensor_in_a_type_it_cannot_compute(tmp_path):
    """I32 has F32's geometry (4 bytes an element; a valid GGUF type that holds no weights
    we can compute with): the header stays valid (inspect describes it), and `run` refuses
    it in one line naming the tensor instead of a traceback."""
    from alphallama.gguf.writer import PRESETS, write_synthetic
    p = tmp_path / "i32.gguf"
    write_synthetic(PRESETS["tiny-llama"](quant="Q4_0"), p)
    data = bytearray(p.read_bytes())
    name = b"blk.0.attn_norm.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    at += 4 + 8 * n_dims
    assert struct.unpack_from("<I", data, at)[0] == Q.F32
    data[at:at + 4] = struct.pack("<I", Q.I32)
    p.write_bytes(bytes(data))
    r = subprocess.run([sys.executable, "-m", "alphallama.cli", "inspect", "-m", str(p)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "I32" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "alphallama.cli", "run", "-m", str(p), "-p", "hi", "-n", "1",
                        "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    # the load's progress lines may come first (stderr is where `run` shows its stages);
    # the refusal is one line, the last, and nothing else says error or shows a traceback
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and [i for i, line in enumerate(lines) if "error" in line] == [len(lines) - 1]
    assert lines[-1].startswith(
        f"alphallama: error: {p}: tensor 'blk.0.attn_norm.weight': quant type I32 "), r.stderr
