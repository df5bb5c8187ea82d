"""Mutate a real GGUF file in place, case after case, and read each result the way
`inspect` and `run` do; report every outcome that is not "a self-consistent file" or
"our own one-line GGUFError" as JSON on stdout.

Warnings the tokenizer prints for damaged vocabularies go to stderr, which the test
ignores unless the worker fails. Run as a script (tests/gguf/test_reader_fuzz.py does) so an absurd allocation hits the
address-space limit set here and shows as MemoryError instead of swapping the machine,
and a hang hits the caller's timeout instead of stalling the test process.
    python fuzz_worker.py SOURCE.gguf WORK.gguf SEED N_CASES [MODEL.gguf: SOURCE is its MTP sidecar]
"""
from __future__ import annotations

import json
import math
import os
import random
import resource
import shutil
import struct
import sys
import time
from pathlib import Path

from gguf.constants import GGML_QUANT_SIZES

from alphallama.chat import ChatTemplate
from alphallama.cli_inspect import describe
from alphallama.gguf.arch import SIDECAR_SUFFIX, ModelConfig, find_mtp_head, load_config, sidecar_path
from alphallama.gguf.reader import GGUFError, GGUFFile
from alphallama.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from header_fields import Field, header_fields  # noqa: E402

SLOW_S = 2.0           # one read of a 32 MB file takes ~30 ms; this is a hang in the making
HEADROOM = 2 << 30     # address space beyond what the worker maps at start
MAX_MESSAGE = 1000     # an error names the file, the field and a tensor or key: never a page of garbage

_EDGE = (0, 1, 2, 3, 31, 32, 33, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1)


def _limit_memory() -> None:
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + HEADROOM, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _field_patch(rng: random.Random, fields: list[Field]) -> tuple[str, int, bytes]:
    tensor_fields = [f for f in fields if f.tensor]
    f = rng.choice(tensor_fields if tensor_fields and rng.random() < 0.6 else fields)
    same_role = [g for g in fields if g.tensor == f.tensor and g.index == f.index and g.last == f.last]
    v = rng.choice([*_EDGE, f.value - 1, f.value + 1, f.value * 2, f.value // 2, f.value + 32, f.value - 32,
                    f.value + 4096, rng.choice(same_role).value, rng.getrandbits(64)])
    size = struct.calcsize(f.fmt)
    v &= (1 << 8 * size) - 1
    return f"{f.owner}[{f.index}] {f.value} -> {v}", f.pos, struct.pack(f.fmt.upper(), v)


def _byte_patch(rng: random.Random, original: bytes, header_end: int) -> tuple[str, int, bytes]:
    pos = rng.randrange(0, header_end)
    n = min(rng.choice((1, 1, 2, 4, 8)), len(original) - pos)
    new = bytes(b ^ (1 << rng.randrange(8)) if rng.random() < 0.5 else rng.randrange(256)
                for b in original[pos:pos + n])
    return f"bytes at {pos}: {original[pos:pos + n].hex()} -> {new.hex()}", pos, new


def _consistent(path: Path, f: GGUFFile) -> str | None:
    """Why an accepted file is not self-consistent (None if it is), checked against the
    file's bytes and gguf's own type sizes, not the reader's arithmetic."""
    size = path.stat().st_size
    align = f.metadata.get("general.alignment", 32)
    spans = []
    with open(path, "rb") as fh:
        for t in f.tensors.values():
            block, type_size = GGML_QUANT_SIZES[t.qtype]
            n = math.prod(t.shape) // block * type_size
            if min(t.shape) < 1 or t.nbytes != n:
                return f"{t.name}: shape {t.shape} {t.qtype.name} is {n} bytes, view has {t.nbytes}"
            if t.offset % align or t.offset < 24 or t.offset + n > size:
                return f"{t.name}: data [{t.offset}, {t.offset + n}) misaligned or outside {size} bytes"
            raw = t.data.reshape(-1).view("u1")
            for at in (0, max(n - 16, 0)):
                if bytes(raw[at:at + 16]) != os.pread(fh.fileno(), min(16, n - at), t.offset + at):
                    return f"{t.name}: view at {at} differs from the file's bytes"
            spans.append((t.offset, t.offset + n, t.name))
    spans.sort()
    for a, b in zip(spans, spans[1:]):
        if b[0] < a[1]:
            return f"{b[2]} overlaps {a[2]}"
    return None


def _unclear(e: GGUFError) -> str | None:
    """Why an error is not one clear line (None if it is)."""
    msg = str(e)
    if "\n" in msg or len(msg) > MAX_MESSAGE:
        return f"error of {len(msg)} chars over {msg.count(chr(10)) + 1} lines: {msg[:200]!r}"
    return None


def _use_model(f: GGUFFile) -> None:
    """What `run` reads before the weights, then what `inspect` prints."""
    load_config(f)
    Tokenizer.from_metadata(f.metadata).encode("hi there", add_special=True, parse_special=False)
    ChatTemplate.from_gguf_metadata(f.metadata, fallback=None)
    describe(f.path)


def _read(path: Path, model: tuple[GGUFFile, ModelConfig] | None) -> tuple[str, str | None]:
    """(outcome, problem): reading must give a consistent file or one GGUFError line."""
    try:
        f = GGUFFile(path)
        problem = _consistent(path, f)
        if problem:
            return "accepted", "inconsistent: " + problem
        try:
            if model is None:
                _use_model(f)
            else:   # the mutated file is the MTP sidecar beside `model`: what `run` and `inspect` look up
                find_mtp_head(*model)
        except GGUFError as e:
            return "config-rejected", _unclear(e)
        return "accepted", None
    except GGUFError as e:
        return "rejected", _unclear(e)
    except BaseException as e:  # noqa: BLE001 - the point is to catch anything that escapes
        return "crashed", f"{type(e).__name__}: {e}"[:300]


def main(source: str, work: str, seed: int, n_cases: int, model: str | None = None) -> dict:
    """model: SOURCE is that model's MTP sidecar; WORK must then be named <stem>.mtp.gguf
    (the model is linked in as <stem>.gguf, where find_mtp_head looks for it)."""
    original = Path(source).read_bytes()
    fields = header_fields(Path(source))
    header_end = max(f.pos for f in fields) + 8
    work_path = Path(work)
    shutil.copyfile(source, work_path)
    opened = None
    if model is not None:
        model_path = work_path.with_name(work_path.name.removesuffix(SIDECAR_SUFFIX) + ".gguf")
        assert work_path.name.endswith(SIDECAR_SUFFIX) and sidecar_path(str(model_path)) == str(work_path)
        model_path.symlink_to(Path(model).resolve())
        m = GGUFFile(model_path)
        opened = (m, load_config(m))
    # the intact file once, untimed: the first accepted case would otherwise pay the modules
    # `inspect` imports on first use (~1 s, 3.4 s on a loaded 2-core box) against SLOW_S
    outcome, problem = _read(work_path, opened)
    assert (outcome, problem) == ("accepted", None), (outcome, problem)
    _limit_memory()
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    failures = []
    for case in range(n_cases):
        kind = rng.choices(("field", "bytes", "truncate"), weights=(6, 3, 1))[0]
        if kind == "truncate":
            cut = rng.randrange(0, header_end) if rng.random() < 0.7 else rng.randrange(header_end, len(original))
            what = f"truncated to {cut} bytes"
            os.truncate(work_path, cut)
        else:
            what, pos, patch = (_field_patch(rng, fields) if kind == "field"
                                else _byte_patch(rng, original, header_end))
            with open(work_path, "r+b") as fh:
                fh.seek(pos)
                fh.write(patch)
        t0 = time.perf_counter()
        outcome, problem = _read(work_path, opened)   # every view of the file is released on return
        took = time.perf_counter() - t0
        if problem is None and took > SLOW_S:
            problem = f"took {took:.1f} s"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if problem is not None:
            failures.append(f"case {case} ({what}): {problem}")
        with open(work_path, "r+b") as fh:   # restore the original
            if kind == "truncate":
                fh.seek(cut)
                fh.write(original[cut:])
            else:
                fh.seek(pos)
                fh.write(original[pos:pos + len(patch)])
    return {"outcomes": outcomes, "failures": failures}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:6])))
