"""The GGUF reader: agreement with gguf.GGUFReader, and one clear error per broken file."""
from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFReader

from alphallama.gguf.arch import load_config
from alphallama.gguf.reader import GGUFError, GGUFFile
from conftest import SPM_VOCAB, STORIES, VOCAB, require


@pytest.mark.parametrize("path", [STORIES, SPM_VOCAB, pytest.param(VOCAB / "ggml-vocab-qwen2.gguf", marks=pytest.mark.shared)],
                         ids=lambda p: p.name)
def test_agrees_with_gguf_package(path):
    require(path)
    ours, theirs = GGUFFile(path), GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert sorted(ours.metadata) == sorted(keys)
    for k in keys:
        assert ours.metadata[k] == theirs.fields[k].contents(), k
    assert len(ours.tensors) == len(theirs.tensors)
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.qtype == t.tensor_type
        assert mine.shape == tuple(reversed(t.shape.tolist()))
        assert np.array_equal(np.asarray(mine.data).view(np.uint8).ravel(), np.asarray(t.data).view(np.uint8).ravel())


@pytest.fixture
def stories_bytes():
    return require(STORIES).read_bytes()


def _write(tmp_path, data: bytes):
    p = tmp_path / "broken.gguf"
    p.write_bytes(data)
    return p


def _first_array_length_offset(data: bytes) -> int:
    """Byte offset of the element count of the first metadata array (tokenizer.ggml.tokens)."""
    pos = 24
    key_len = struct.unpack_from("<Q", data, pos)[0]
    key = data[pos + 8:pos + 8 + key_len]
    assert key == b"tokenizer.ggml.tokens"
    return pos + 8 + key_len + 4 + 4   # key, value type, element type


BROKEN = {
    "truncated": (lambda d: d[: len(d) // 2], "past the end of the file"),
    "header-only": (lambda d: d[:20], "too small"),
    "bad-magic": (lambda d: b"GGML" + d[4:], "not a GGUF file"),
    "bad-version": (lambda d: d[:4] + struct.pack("<I", 99) + d[8:], "version 99"),
    "absurd-array": (lambda d: d[:_first_array_length_offset(d)] + struct.pack("<Q", 2**61)
                     + d[_first_array_length_offset(d) + 8:], "claims 2305843009213693952 elements"),
    "absurd-counts": (lambda d: d[:8] + struct.pack("<QQ", 2**50, 2**50) + d[24:], "impossible"),
    "tensor-past-end": (lambda d: d[:-1000], "past the end of the file"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_file_gives_clear_error(tmp_path, stories_bytes, case):
    mutate, expected = BROKEN[case]
    p = _write(tmp_path, mutate(stories_bytes))
    with pytest.raises(GGUFError, match=expected):
        GGUFFile(p)


@pytest.mark.parametrize("case", ["truncated", "absurd-array", "bad-magic"])
def test_cli_broken_file_one_line_nonzero_exit(tmp_path, stories_bytes, case):
    p = _write(tmp_path, BROKEN[case][0](stories_bytes))
    for cmd in (["inspect", "-m", str(p)], ["run", "-m", str(p), "-p", "hi", "-n", "2"]):
        r = subprocess.run([sys.executable, "-m", "alphallama.cli", *cmd], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("alphallama: error:"), r.stderr
        assert "Traceback" not in r.stderr


def test_unknown_architecture_and_bad_tensors_are_named(tmp_path, stories_bytes):
    i = stories_bytes.index(b"general.architecture")
    arch = stories_bytes[:i] + stories_bytes[i:].replace(b"llama", b"gemmy", 1)
    with pytest.raises(GGUFError, match="architecture 'gemmy' is not supported"):
        load_config(GGUFFile(_write(tmp_path, arch)))
    # rename one tensor: the model then misses blk.3.ffn_up.weight
    missing = stories_bytes.replace(b"blk.3.ffn_up.weight", b"blk.3.ffn_XX.weight", 1)
    with pytest.raises(GGUFError, match=r"missing tensor 'blk.3.ffn_up.weight'"):
        load_config(GGUFFile(_write(tmp_path, missing)))
    # swap two shape entries of attn_k (64x32 -> 32x64): misshapen
    i = stories_bytes.index(b"blk.0.attn_k.weight") + len(b"blk.0.attn_k.weight") + 4
    dims = struct.unpack_from("<QQ", stories_bytes, i)
    bad = stories_bytes[:i] + struct.pack("<QQ", dims[1], dims[0]) + stories_bytes[i + 16:]
    with pytest.raises(GGUFError, match=r"'blk.0.attn_k.weight' has shape \[64, 32\], expected \[32, 64\]"):
        load_config(GGUFFile(_write(tmp_path, bad)))
