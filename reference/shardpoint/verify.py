"""Check a checkpoint written by anyone against the spec, collecting every problem.

Unlike ``load``, which stops at the first problem, :func:`verify_checkpoint` reports all of
them as ``(spec_id, message)`` pairs: manifest envelope and schema, key encoding, array paths,
each array's zarr.json against the manifest, every chunk read with its checksum verified, and
(``strict``) stray files under ``tensors/``.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

from . import errors
from .keys import decode_key, encode_key
from .metadata import array_path_for, decode_manifest
from .storage import MANIFEST_NAME, StorageBackend, get_backend


@dataclass
class VerifyReport:
    """Problems found (``(spec_id, message)``) and what was checked. Iterates over problems."""

    path: str
    problems: list = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    objects: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def __iter__(self) -> Iterator[tuple]:
        return iter(self.problems)

    def to_dict(self) -> dict:
        return {"path": self.path, "ok": self.ok, "tensors": self.tensors, "bytes": self.bytes,
                "objects": self.objects, "seconds": round(self.seconds, 3),
                "problems": [{"spec_id": s, "message": m} for s, m in self.problems]}


def verify_checkpoint(path: str, *, strict: bool = False,
                      backend: Optional[StorageBackend] = None) -> VerifyReport:
    """Verify the checkpoint at ``path``; never raises for problems found in it."""
    be = get_backend(backend)
    rep = VerifyReport(str(path))
    t0 = time.perf_counter()
    try:
        m = decode_manifest(be.read_manifest(str(path)))
    except (errors.CheckpointNotFoundError, errors.IncompleteCheckpointError,
            errors.CorruptCheckpointError, errors.UnsupportedFormatError) as e:
        rep.problems.append((e.spec_id or type(e).__name__, str(e)))
        rep.seconds = time.perf_counter() - t0
        return rep
    rep.tensors, rep.objects = len(m.tensors), len(m.objects)
    for key, e in sorted(m.tensors.items()):
        rep.bytes += e.nbytes
        if strict:
            try:
                if encode_key(decode_key(key)) != key:
                    rep.problems.append(("SP-KEY-3", f"key {key!r} is not in canonical form"))
            except errors.InvalidKeyError as err:
                rep.problems.append(("SP-KEY-3", str(err)))
            if e.array != array_path_for(key):
                rep.problems.append(("SP-LAYOUT-2", f"tensor {key!r}: array path {e.array!r} "
                                     f"is not {array_path_for(key)!r}"))
        rep.problems += be.verify_array(str(path), e.array, e.spec, key)
    if strict:
        rep.problems += _stray_arrays(str(path), {e.array for e in m.tensors.values()})
    rep.seconds = time.perf_counter() - t0
    return rep


def _stray_arrays(root: str, known: set) -> list:
    """zarr.json files under tensors/ that the manifest does not list ([SP-LAYOUT-3])."""
    out = []
    base = os.path.join(root, "tensors")
    for dirpath, _dirs, files in os.walk(base):
        if "zarr.json" in files:
            rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
            if rel not in known:
                out.append(("SP-LAYOUT-3", f"array {rel!r} is not listed in {MANIFEST_NAME}"))
    return out
