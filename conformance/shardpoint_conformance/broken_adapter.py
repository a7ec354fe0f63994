"""A deliberately broken adapter: the reference adapter, plus one defect after ``write``.

    python -m shardpoint_conformance.broken_adapter MODE capabilities|write|read ...

MODE ``delete-chunk`` removes one stored chunk (the packed layout: a data object;
[SP-READ-2] for readers), ``flip-byte`` flips a byte inside one (a crc32c mismatch, [SP-READ-3]), ``truncate-manifest`` cuts the
manifest in half ([SP-MAN-1]). ``adapter-test`` must catch each with that requirement ID;
the conformance tests use it to prove the harness is not blind.
"""

from __future__ import annotations

import os
import sys

from shardpoint_conformance import reference_adapter
from shardpoint_conformance.harness import chunk_files, chunk_spots, flip_byte

MODES = ("delete-chunk", "flip-byte", "truncate-manifest")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in MODES:
        print(f"usage: broken_adapter {{{'|'.join(MODES)}}} ...", file=sys.stderr)
        return 2
    mode, rest = argv[0], argv[1:]
    rc = reference_adapter.main(rest)
    if rc != 0 or rest[:1] != ["write"]:
        return rc
    ckpt = rest[2]
    if mode == "truncate-manifest":
        m = os.path.join(ckpt, "manifest.msgpack")
        with open(m, "r+b") as f:
            f.truncate(os.path.getsize(m) // 2)
        return 0
    if mode == "delete-chunk":  # a chunk file, or a data object of the packed layout
        os.remove(chunk_files(ckpt)[0])
    else:
        flip_byte(*chunk_spots(ckpt)[0])  # inside a chunk's stored bytes
    return 0


if __name__ == "__main__":
    sys.exit(main())
