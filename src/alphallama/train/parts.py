"""Files in parts with checksums: what comes back from the device is at most 16 MiB a
file, so the training export (pipeline.py) and the MTP distillation (distill_mtp.py)
write a big file as NAME.part00, NAME.part01, ... and NAME.sha256: one `sha256  name`
line per part, then the whole file's line. Joining checks every part (naming the
damaged one) and then the whole:

    python -m alphallama.train join DIR/NAME.sha256 -o OUT_FILE
"""
from __future__ import annotations

import hashlib
from pathlib import Path

_BLOCK = 1 << 20   # read size: a file is never held whole in memory


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def split_file(path: str | Path, out_dir: str | Path, part_bytes: int) -> Path:
    """Write path's bytes as out_dir/NAME.partNN of at most part_bytes each (an empty
    file gives one empty part) and out_dir/NAME.sha256; the original is kept. Returns
    the .sha256 path."""
    if part_bytes <= 0:
        raise ValueError(f"part size must be positive, not {part_bytes}")
    path, out_dir = Path(path), Path(out_dir)
    whole, lines = hashlib.sha256(), []
    with open(path, "rb") as f:
        i = 0
        while (block := f.read(min(part_bytes, _BLOCK))) or not i:
            name, h, left = f"{path.name}.part{i:02d}", hashlib.sha256(), part_bytes
            with open(out_dir / name, "wb") as part:
                while block:
                    part.write(block)
                    h.update(block)
                    whole.update(block)
                    left -= len(block)
                    block = f.read(min(left, _BLOCK)) if left else b""
            lines.append(f"{h.hexdigest()}  {name}")
            i += 1
            if left:   # a short part: the file ended
                break
    lines.append(f"{whole.hexdigest()}  {path.name}")
    sums = out_dir / f"{path.name}.sha256"
    sums.write_text("\n".join(lines) + "\n")
    return sums


def _entries(sums: Path) -> list[tuple[str, str]]:
    entries = []
    for n, line in enumerate(sums.read_text().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split(None, 1)
        if len(fields) != 2 or len(fields[0]) != 64 or Path(fields[1].strip()).name != fields[1].strip():
            raise ValueError(f"{sums}:{n}: expected `<sha256>  <file name>`, got {line!r}")
        entries.append((fields[0].lower(), fields[1].strip()))
    if len(entries) < 2:
        raise ValueError(f"{sums}: expected part lines and a whole-file line")
    return entries


def join_parts(sums: str | Path, out: str | Path) -> str:
    """Check every part listed in the .sha256 file, concatenate them into `out`, check
    the whole; returns its sha256. ValueError names the first missing or damaged part;
    `out` appears only once the whole file checks."""
    sums, out = Path(sums), Path(out)
    entries = _entries(sums)
    tmp = out.with_name(out.name + ".partial")
    whole = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            for digest, name in entries[:-1]:
                part = sums.parent / name
                if not part.is_file():
                    raise ValueError(f"{part}: missing part")
                h = hashlib.sha256()
                with open(part, "rb") as p:
                    for block in iter(lambda: p.read(_BLOCK), b""):
                        h.update(block)
                        whole.update(block)
                        f.write(block)
                if h.hexdigest() != digest:
                    raise ValueError(f"{part}: sha256 mismatch (damaged transfer)")
        if whole.hexdigest() != entries[-1][0]:
            raise ValueError(f"{sums}: the joined file's sha256 {whole.hexdigest()} is not {entries[-1][0]}")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return whole.hexdigest()
