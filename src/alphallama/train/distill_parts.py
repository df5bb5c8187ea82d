"""Splitting a file into parts of at most N MiB with a sha256 list, and joining them
back with the checksums checked (files come back from the device at most 16 MiB each).

    python -m alphallama.train.distill_parts join DIR/NAME.sha256 OUT_FILE
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def split_file(path: str | Path, out_dir: str | Path, part_bytes: int) -> Path:
    """Write path's bytes as out_dir/NAME.partNN and out_dir/NAME.sha256 (one
    `sha256  name` line per part, then the whole file's); returns the .sha256 path."""
    path, out_dir = Path(path), Path(out_dir)
    data = path.read_bytes()
    lines = []
    for i in range(0, max(1, -(-len(data) // part_bytes))):
        chunk = data[i * part_bytes:(i + 1) * part_bytes]
        name = f"{path.name}.part{i:02d}"
        (out_dir / name).write_bytes(chunk)
        lines.append(f"{_sha(chunk)}  {name}")
    lines.append(f"{_sha(data)}  {path.name}")
    sums = out_dir / f"{path.name}.sha256"
    sums.write_text("\n".join(lines) + "\n")
    return sums


def join_parts(sums: str | Path, out: str | Path) -> str:
    """Check every part against the .sha256 list, concatenate them, check the whole,
    write `out`; returns its sha256. ValueError naming the first bad or missing part."""
    sums = Path(sums)
    entries = [line.split(None, 1) for line in sums.read_text().splitlines() if line.strip()]
    if len(entries) < 2:
        raise ValueError(f"{sums}: expected part lines and a whole-file line")
    data = bytearray()
    for digest, name in entries[:-1]:
        part = sums.parent / name.strip()
        if not part.is_file():
            raise ValueError(f"{part}: missing part")
        chunk = part.read_bytes()
        if _sha(chunk) != digest:
            raise ValueError(f"{part}: sha256 mismatch (damaged transfer)")
        data += chunk
    whole = _sha(bytes(data))
    if whole != entries[-1][0]:
        raise ValueError(f"{sums}: the joined file's sha256 {whole} is not {entries[-1][0]}")
    Path(out).write_bytes(bytes(data))
    return whole


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "join":
        print("usage: python -m alphallama.train.distill_parts join NAME.sha256 OUT_FILE", file=sys.stderr)
        return 2
    try:
        digest = join_parts(args[1], args[2])
    except (OSError, ValueError) as e:
        print(f"distill_parts: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args[2]} (sha256 {digest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
