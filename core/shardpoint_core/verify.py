"""Check a checkpoint written by anyone against the spec, collecting every problem.

Unlike ``load``, which stops at the first problem, :func:`verify_checkpoint` reports all of
them as ``(spec_id, message)`` pairs: manifest envelope and schema, key encoding, array paths,
each array's zarr.json against the manifest, every chunk read with its checksum verified, and
(``strict``) stray arrays and directories under ``tensors/``.

It never raises for a problem of the checkpoint (a missing path is a report line too, under
[SP-LAYOUT-1]); only a bug of its own would propagate.

Example::

    rep = verify_checkpoint("/ckpt/step_10", strict=True)
    if not rep.ok:
        for spec_id, message in rep:
            print(spec_id, message)
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from shardpoint_core.format import errors
from shardpoint_core.format.keys import MAX_KEY_BYTES, decode_key, encode_key
from shardpoint_core.format.manifest import TENSOR_DIR, TensorEntry, array_path_for, decode_manifest
from shardpoint_core.stores.registry import local_path
from shardpoint_core.format.spec import MANIFEST_NAME
from shardpoint_core.transactions.protocol import StorageBackend
from shardpoint_core.transactions.resolve import get_backend

# Problems found while opening an array: no chunk of it was read.
_OPEN_IDS = ("SP-ARRAY-1", "SP-ARRAY-2")


@dataclass
class VerifyReport:
    """Problems found (``(spec_id, message)``) and what was checked. Iterates over problems."""

    path: str
    found: bool = True  # False: no such path (nothing could be checked)
    problems: list[Any] = field(default_factory=list)
    format_version: Optional[tuple[Any, ...]] = None
    tensors: int = 0
    bytes: int = 0
    objects: int = 0
    chunks: int = 0  # chunks the manifest implies
    chunks_checked: int = 0  # chunks read with their checksums verified (or found damaged)
    strict: bool = False
    seconds: float = 0.0
    #: (1.4 incremental) chunks read from each base beside the checkpoint ([SP-PACK-9]),
    #: checked as its own; whether chunk hashes were compared too ([SP-PACK-10])
    shared: dict[str, int] = field(default_factory=dict)
    hashes: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def spec_ids(self) -> list[Any]:
        """The distinct requirement IDs violated, sorted."""
        return sorted({s for s, _ in self.problems})

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return iter(self.problems)

    def __len__(self) -> int:
        return len(self.problems)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "found": self.found,
            "strict": self.strict,
            "format_version": list(self.format_version) if self.format_version else None,
            "tensors": self.tensors,
            "bytes": self.bytes,
            "objects": self.objects,
            "chunks": self.chunks,
            "chunks_checked": self.chunks_checked,
            "shared": dict(self.shared),
            "hashes": self.hashes,
            "seconds": round(self.seconds, 3),
            "spec_ids": self.spec_ids,
            "problems": [{"spec_id": s, "message": m} for s, m in self.problems],
        }


def _chunk_count(shape: tuple[int, ...], chunk: tuple[int, ...]) -> int:
    return math.prod(-(-s // c) for s, c in zip(shape, chunk)) if shape else 1


def verify_checkpoint(
    path: str,
    *,
    strict: bool = False,
    backend: Optional[StorageBackend] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> VerifyReport:
    """Verify the checkpoint at ``path``; never raises for problems found in it.

    ``strict`` adds the writer rules a reader does not need: array paths are ``tensors/<key>``
    ([SP-LAYOUT-2]), keys are canonical and short enough ([SP-KEY-3], [SP-KEY-4]), nothing
    under ``tensors/`` that the manifest does not list ([SP-LAYOUT-3]). ``progress(nbytes)``
    is called after each tensor is checked, and once with the total first (``set_total``).
    """
    from shardpoint_core.stores.registry import is_local
    from shardpoint_core.transactions.resolve import resolve

    url = not is_local(path)
    if url:
        path, backend = resolve(path, backend, "verify")  # s3://...: the object backend
    if backend is None:
        # A backend of its own (a fresh TensorStore context): the shared default one may hold
        # metadata cached by earlier reads of this path, and a validator must read zarr.json.
        from shardpoint_core.transactions.backend import ZarrBackend

        backend = ZarrBackend()
    be = get_backend(backend)
    path = str(path) if url else str(local_path(path, "verify"))
    release = getattr(be, "release", None)  # optional: what a load of it kept (objects
    if release is not None:  # found sound, [SP-PACK-7]) is checked again, not trusted
        release(path)
    rep = VerifyReport(path, strict=strict)
    t0 = time.perf_counter()
    try:
        m = decode_manifest(be.read_manifest(path))
    except errors.CheckpointNotFoundError as e:
        rep.found = False
        rep.problems.append((e.spec_id or "SP-LAYOUT-1", str(e)))
    except errors.ShardpointError as e:
        rep.problems.append((e.spec_id or "SP-MAN-1", str(e)))
    except OSError as e:  # unreadable manifest (permissions, I/O error)
        rep.problems.append(("SP-MAN-1", f"cannot read {MANIFEST_NAME}: {e}"))
    except Exception as e:  # noqa: BLE001 - a decoder gap must still be a report line
        rep.problems.append(("SP-MAN-2", f"manifest does not decode: {type(e).__name__}: {e}"))
    else:
        rep.format_version = tuple(m.format_version)
        rep.tensors, rep.objects = len(m.tensors), len(m.objects)
        if m.packed is not None:
            sh = m.packed.sharing()
            rep.shared = {n: b["chunks"] for n, b in sh["bases"].items()}
            rep.hashes = bool(sh["hashes"])
        if progress is not None and hasattr(progress, "set_total"):
            progress.set_total(sum(e.nbytes for e in m.tensors.values()))
        for key, ent in sorted(m.tensors.items()):
            rep.bytes += ent.nbytes
            n = _chunk_count(ent.shape, ent.chunk_shape)
            rep.chunks += n
            if strict:
                rep.problems += _writer_rules(key, ent.array)
            found = _verify_array(be, path, ent, key)
            if not any(s in _OPEN_IDS for s, _ in found):
                rep.chunks_checked += n
            rep.problems += found
            if progress is not None:
                progress(ent.nbytes)
        if strict:
            rep.problems += _strays(path, {e.array for e in m.tensors.values()})
    rep.problems = [(sid, _without_id(sid, msg)) for sid, msg in rep.problems]
    rep.seconds = time.perf_counter() - t0
    return rep


def _without_id(sid: str, msg: str) -> str:
    """``msg`` without a leading ``[sid]`` (a ShardpointError's text carries it): the report
    pairs each message with its ID already, and printing both showed it twice."""
    return msg[len(sid) + 3 :] if msg.startswith(f"[{sid}] ") else msg


def _verify_array(be: StorageBackend, root: str, e: TensorEntry, key: str) -> list[Any]:
    try:
        return list(be.verify_array(root, e.array, e.spec, key))
    except errors.ShardpointError as err:
        return [(err.spec_id or "SP-READ-3", str(err))]
    except Exception as err:  # noqa: BLE001 - stored bytes a backend did not anticipate
        return [
            (
                "SP-READ-3",
                f"tensor {key!r}: reading array {e.array!r} failed: "
                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
            )
        ]


_SAVE_DIR = re.compile(r"save-[0-9a-f]{8,64}")


def _writer_rules(key: str, array: str) -> list[Any]:
    out = []
    if len(key.encode()) > MAX_KEY_BYTES:
        out.append(("SP-KEY-4", f"key {key[:80]!r}... is longer than {MAX_KEY_BYTES} bytes"))
    try:
        if encode_key(decode_key(key)) != key:
            out.append(("SP-KEY-3", f"key {key!r} is not in canonical form"))
    except errors.InvalidKeyError as err:
        out.append((err.spec_id or "SP-KEY-3", str(err)))
    save_dir, _, below = array.partition("/")
    if _SAVE_DIR.fullmatch(save_dir):  # object stores: below the save prefix [SP-COMMIT-11]
        array = below
    if array not in (array_path_for(key), f"{TENSOR_DIR}/{key}"):  # 1.1 path, or 1.0's
        out.append(
            ("SP-LAYOUT-2", f"tensor {key!r}: array path {array!r} is not {array_path_for(key)!r}")
        )
    return out


def _is_group(path: str) -> bool:
    """Whether ``path`` is the zarr.json of a Zarr v3 group ([SP-LAYOUT-5])."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(4096))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("zarr_format") == 3 and doc.get("node_type") == "group"


def _strays(root: str, known: set[Any]) -> list[Any]:
    """Arrays and other entries under tensors/ that no manifest array accounts for
    ([SP-LAYOUT-3]). An entry is accounted for when it is a listed array (with everything
    inside it) or a directory on the way to one (with its group zarr.json)."""
    base = os.path.join(root, TENSOR_DIR)
    if "://" in root or not os.path.isdir(base):  # object stores: recover finds leftovers
        return []
    parents: set[str] = set()
    for a in known:
        parts = a.split("/")
        parents.update("/".join(parts[:i]) for i in range(1, len(parts)))
    out = []
    for dirpath, dirs, files in os.walk(base):
        rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
        if rel in known:
            dirs[:] = []  # a listed array: its chunks are checked by verify_array
            continue
        on_the_way = rel in parents or rel == TENSOR_DIR
        if "zarr.json" in files and not on_the_way:
            out.append(("SP-LAYOUT-3", f"array {rel!r} is not listed in {MANIFEST_NAME}"))
            dirs[:] = []
            continue
        if not on_the_way:
            arrays = sorted(
                os.path.relpath(d, root).replace(os.sep, "/")
                for d, _s, fs in os.walk(dirpath)
                if "zarr.json" in fs
            )
            out += [
                ("SP-LAYOUT-3", f"array {a!r} is not listed in {MANIFEST_NAME}") for a in arrays
            ]
            if not arrays:
                out.append(
                    (
                        "SP-LAYOUT-3",
                        f"directory {rel!r} under {TENSOR_DIR}/ belongs to "
                        f"no array listed in {MANIFEST_NAME}",
                    )
                )
            dirs[:] = []
            continue
        for f in sorted(files):
            if f == "zarr.json" and _is_group(os.path.join(dirpath, f)):  # [SP-LAYOUT-5]
                continue
            out.append(
                (
                    "SP-LAYOUT-3",
                    f"file {rel}/{f} under {TENSOR_DIR}/ belongs to no "
                    f"array listed in {MANIFEST_NAME}",
                )
            )
        dirs.sort()
    return out
