"""A store-to-store copy of one committed checkpoint, through the save and load transactions.

:func:`copy_checkpoint` reads the source's manifest once (with the identity of its commit),
begins a save of the target (:class:`~.writer.CheckpointWriter`: the target checked, a
staging location made), copies the objects of every array the manifest names, byte for byte,
makes them durable, checks that the source was not replaced meanwhile, and only then commits
the manifest: the target is either absent or the whole checkpoint, never part of one. Any
failure aborts the save (what was staged is removed; an existing target is never touched).

A packed checkpoint (format 1.4) is copied as its data objects (``packed/<writer>-<n>.bin``,
each byte for byte; one larger than :data:`PIECE` is copied in pieces onto files); an
incremental one ([SP-PACK-9]) is copied flattened (:mod:`.copy_flat`): the chunks it takes
from bases land in objects of the copy's own, checked against their hashes, and the copy
names no base. The copy is committed through the Zarr backend's commit, with the source's
index (a packed backend's commit would gather its own writers' index parts).

With ``incremental=<a checkpoint beside the target>`` the copy builds on that checkpoint
(:mod:`.copy_onto`): the chunks it holds already (same length, crc32c and hash) are referred
to, not copied, and the copy is an incremental checkpoint naming it as its base. Where that
base is unusable or gone (before the copy, or before its commit), the copy is a full one.

The memory tier's durable copies use it (``shm://job/step_5`` to ``/ckpt/step_00000005``):
the bytes come from the copy in memory, not from the trainer's tensors, and every byte read
from the memory tier is checked against its crc32c there.

Example::

    copy_checkpoint("shm://run42/step_5", "/ckpt/step_00000005")
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from shardpoint_core.arrays.packed_base import base_name, manifest_identity
from shardpoint_core.commit.object_store import SAVE_PREFIX
from shardpoint_core.format.errors import CorruptCheckpointError, SaveFailedError
from shardpoint_core.format.manifest import Manifest
from shardpoint_core.stores.location import locate
from shardpoint_core.stores.registry import is_local
from shardpoint_core.transactions.copy_flat import FlatPiece, flat_bytes, flatten
from shardpoint_core.transactions.copy_onto import OntoPlan, build_on, storage_base
from shardpoint_core.transactions.packed import PackedBackend
from shardpoint_core.transactions.protocol import StorageBackend
from shardpoint_core.transactions.reader import CheckpointReader
from shardpoint_core.transactions.resolve import resolve
from shardpoint_core.transactions.writer import CheckpointWriter


@dataclass
class CopyResult:
    """What :func:`copy_checkpoint` copied: the target, the objects and their bytes."""

    path: str
    objects: int
    nbytes: int
    #: the base the copy builds on (its name beside ``path``), None: a whole checkpoint
    base: Optional[str] = None


def chunk_keys(base: str, shape: Sequence[int], chunks: Sequence[int]) -> List[str]:
    """Every object key of one saved array below ``base``: its zarr.json and every chunk of
    its grid (writers store every chunk, fill-value ones included)."""
    counts = [-(-s // c) if c else 0 for s, c in zip(shape, chunks)]
    keys = [f"{base}/zarr.json"]
    if any(n == 0 for n in counts):
        return keys
    return keys + [
        "/".join([base, "c", *map(str, idx)])
        for idx in itertools.product(*(range(n) for n in counts))
    ]


def _expected(entry: Any) -> List[str]:
    """The object keys an array of the manifest must have (relative to the checkpoint root)."""
    return chunk_keys(entry.array, entry.shape, entry.chunk_shape)


def save_prefix_of(m: Manifest) -> str:
    """The save prefix (``save-<token>``) that every array path of the committed manifest
    ``m`` lies below, as an object store's commit puts them ([SP-COMMIT-11]); "" where they
    share none (a checkpoint on files). A copy moves its objects from below it to below its
    own, so the copy is laid out as a save made there."""
    firsts = {e.array.partition("/")[0] for e in m.tensors.values() if "/" in e.array}
    if len(firsts) != 1 or any("/" not in e.array for e in m.tensors.values()):
        return ""
    first = firsts.pop()
    return first if first.startswith(SAVE_PREFIX) else ""


def _strip(path: str, prefix: str) -> str:
    return path[len(prefix) + 1 :] if prefix and path.startswith(prefix + "/") else path


def relative_manifest(m: Manifest, prefix: str) -> Manifest:
    """``m`` with ``prefix/`` taken off every array path (and, 1.4, every data object and
    packed array name): the manifest as its save wrote it, before the commit put the save
    prefix in front; the target's commit puts its own there (``encode_marker``)."""
    if not prefix:
        return m
    tensors = {
        k: dataclasses.replace(e, array=_strip(e.array, prefix)) for k, e in m.tensors.items()
    }
    packed = m.packed
    if packed is not None:  # a base's objects stay where its own commit put them
        packed = dataclasses.replace(
            packed,
            objects=[
                (p if packed.base_of(i) is not None else _strip(p, prefix), s)
                for i, (p, s) in enumerate(packed.objects)
            ],
            arrays=[(_strip(n, prefix), i) for n, i in packed.arrays],
        )
    return dataclasses.replace(m, tensors=tensors, packed=packed)


def _objects(store: Any, root: str, arrays: List[str]) -> Dict[str, int]:
    """The object keys (relative to ``root``) of every array below ``root``, with their
    sizes."""
    out: Dict[str, int] = {}
    for a in arrays:
        prefix = f"{root}/{a}/" if root else f"{a}/"
        for info in store.list(prefix):
            out[info.key[len(root) + 1 if root else 0 :]] = int(info.size)
    return out


def _listed(store: Any, root: str, paths: List[str]) -> Dict[str, int]:
    """The objects (relative to ``root``) below the parent directories of ``paths``, with
    their sizes: one listing per directory, not a HEAD per object."""
    out: Dict[str, int] = {}
    for d in sorted({p.rpartition("/")[0] for p in paths}):
        prefix = "/".join(x for x in (root, d) if x)
        for info in store.list(prefix + "/" if prefix else ""):
            out[info.key[len(root) + 1 if root else 0 :]] = int(info.size)
    return out


def _join(root: str, key: str) -> str:
    return f"{root}/{key}" if root else key


def writing_backend(dst: str, backend: Optional[StorageBackend]) -> StorageBackend:
    """The backend that writes a copy to ``dst``: ``backend`` (the default one of ``dst``'s
    kind when None), or for a packed backend the Zarr backend it commits through: a copy
    writes its manifest as the source's says (its own index), not the one a save's
    writers would gather."""
    _p, be = resolve(dst, backend, "copy")
    return be.zarr if isinstance(be, PackedBackend) else be


PIECE = 64 << 20  # bytes read and written at once of a larger object (memory stays flat)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _read_whole(s_store: Any, s_root: str, key: str, src: str, dst: str) -> bytes:
    try:
        return bytes(s_store.get(_join(s_root, key)))
    except FileNotFoundError as e:  # gone, or no copy passed its crc32c
        raise CorruptCheckpointError(
            f"copy of {src!r}: object {key!r} could not be read intact ({e}); "
            f"nothing was committed at {dst!r}"
        ) from e


def _stream(
    s_store: Any, s_root: str, key: str, size: int, d_store: Any, target: str, src: str, dst: str
) -> None:
    """Copy object ``key`` of ``size`` bytes to the file of ``target`` (a local store) in
    pieces of :data:`PIECE` bytes: a data object of the packed layout may be a writer's
    whole state."""
    path = str(d_store.path(target))  # a local store: the key's file
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o644)
    try:
        for at in range(0, size, PIECE):
            n = min(PIECE, size - at)
            try:
                data = s_store.get_range(_join(s_root, key), at, n)
            except FileNotFoundError as e:
                raise CorruptCheckpointError(
                    f"copy of {src!r}: object {key!r} could not be read intact ({e}); "
                    f"nothing was committed at {dst!r}"
                ) from e
            if len(data) != n:
                raise CorruptCheckpointError(
                    f"copy of {src!r}: object {key!r} ends at {at + len(data)} bytes, its "
                    f"manifest says {size}; nothing was committed at {dst!r}",
                    spec_id="SP-READ-3",
                )
            view = memoryview(data)
            while view:
                view = view[os.pwrite(fd, view, at + n - len(view)) :]
    finally:
        os.close(fd)


def copy_part(
    src: str,
    dst: str,
    staging: str,
    keys: List[str],
    *,
    backend: Optional[StorageBackend] = None,
    threads: int = 8,
    source_prefix: str = "",
    sizes: Optional[Dict[str, int]] = None,
    flat: Optional[Dict[str, List[Any]]] = None,
) -> List[Tuple[str, int]]:
    """Any process: copy the objects ``keys`` (relative to the checkpoint root) of the
    committed checkpoint at ``src`` into the ``staging`` location of the copy to ``dst``
    that a coordinator began (:meth:`CopyTransaction.begin`), and make them durable; each
    lands at its key relative to ``source_prefix`` (the source's save prefix,
    :attr:`CopyTransaction.source_prefix`), as the copy's manifest names it. ``sizes``: the
    objects' sizes where known (a large one is copied in pieces onto files); ``flat``: the
    keys that are flat objects of a flattened incremental source (:attr:`CopyTransaction.flat`),
    with the chunks each takes from the bases. Returns (target key, bytes) of each.
    :class:`CorruptCheckpointError` where an object cannot be read intact,
    :class:`SaveFailedError` where it cannot be written."""
    s_store, s_root = locate(src, "copy").pair()
    w = CheckpointWriter.join(dst, staging, backend=writing_backend(dst, backend), call="copy")
    d_store, d_root = locate(w.staging, "copy").pair()
    local = bool(d_store.capabilities.local_path)
    sizes, flat = sizes or {}, flat or {}

    def one(key: str) -> Tuple[str, int]:
        rel = _strip(key, source_prefix)
        target = _join(d_root, rel)
        size = sizes.get(key, 0)
        try:
            if key in flat:
                pieces = [tuple(p) for p in flat[key]]
                if local:  # one flat object per copy on files, written in place
                    path = str(d_store.path(target))  # type: ignore[attr-defined]
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o644)
                    try:
                        n = 0
                        for p, data in flat_bytes(pieces, src, dst):
                            view = memoryview(data)
                            while view:
                                view = view[os.pwrite(fd, view, p[6] + len(data) - len(view)) :]
                            n += len(data)
                    finally:
                        os.close(fd)
                    return target, n
                bufs = [data for _p, data in flat_bytes(pieces, src, dst)]
                d_store.put(target, bufs)
                return target, sum(len(b) for b in bufs)
            if local and size > PIECE:
                _stream(s_store, s_root, key, size, d_store, target, src, dst)
                return target, size
            data = _read_whole(s_store, s_root, key, src, dst)
            d_store.put(target, data)
            return target, len(data)
        except OSError as e:
            raise SaveFailedError(
                f"copy of {src!r} to {dst!r}: cannot write {key!r} ({e}); nothing was committed"
            ) from e

    with ThreadPoolExecutor(max(1, threads)) as pool:
        done = list(pool.map(one, keys))
    d_store.make_durable([t for t, _n in done])
    return done


class CopyTransaction:
    """A copy of one committed checkpoint that several processes write (the coordinator
    begins and ends it; see the module): ``keys``, the objects to copy (relative to the
    checkpoint root), ``sizes`` their bytes, ``flat`` the flat objects of a flattened
    incremental source (:func:`copy_part` takes both), ``staging`` where every process
    writes them (:func:`copy_part`, passing :attr:`source_prefix`); then :meth:`commit` (the
    manifest last) or :meth:`abort`. The copy is laid out as a save made at the target: what
    lay below the source's save prefix lies below the target's own (on an object store) or
    at its root (on files)."""

    def __init__(self, src: str, reader: CheckpointReader, writer: CheckpointWriter) -> None:
        self.src, self.reader, self.writer = src, reader, writer
        self.keys: List[str] = []
        self.sizes: Dict[str, int] = {}
        #: (a flattened incremental source) flat object key -> the chunks it takes from bases
        self.flat: Dict[str, List[FlatPiece]] = {}
        #: the source's save prefix, taken off every key and array path of the copy
        self.source_prefix = save_prefix_of(reader.manifest)
        #: (a flat object built on a base) the source object its chunks come from
        self.origin: Dict[str, str] = {}
        #: the base the copy builds on (location, identity), None: a whole checkpoint
        self.built_on: Optional[Tuple[str, bytes]] = None
        self._manifest: Manifest = reader.manifest
        self._bases: Dict[str, bytes] = {}  # base location -> identity, checked at commit

    @classmethod
    def begin(
        cls,
        src: str,
        dst: str,
        *,
        backend: Optional[StorageBackend] = None,
        overwrite: Any = False,
        incremental: Optional[str] = None,
    ) -> "CopyTransaction":
        """Coordinator: read the source's manifest (with the identity of its commit), check
        that every object it names is there (:class:`CorruptCheckpointError` before anything
        is written where one is missing or short), check the target and make the staging
        location. A packed source's objects are its data objects; an incremental one's
        chunks in bases are flattened into objects of the copy's own (:func:`flatten`).
        ``incremental``: a checkpoint beside ``dst`` to build on (:mod:`.copy_onto`; a full
        copy where it is unusable)."""
        reader = CheckpointReader.open(src, call="copy")
        try:
            m = reader.manifest
            s_store, s_root = locate(reader.path, "copy").pair()
            flat: Dict[str, List[FlatPiece]] = {}
            index = None
            onto: Optional[OntoPlan] = None
            if m.packed is None:
                arrays = sorted({e.array for e in m.tensors.values()})
                infos = _objects(s_store, s_root, arrays)
                lacking = [k for e in m.tensors.values() for k in _expected(e) if k not in infos]
            else:
                p = m.packed
                own = {
                    path: size for i, (path, size) in enumerate(p.objects) if p.base_of(i) is None
                }
                there = _listed(s_store, s_root, sorted(own))
                lacking = [k for k in sorted(own) if k not in there]
                short = [k for k in sorted(own) if k in there and there[k] < own[k]]
                if short:
                    raise CorruptCheckpointError(
                        f"copy of {src!r}: data object {short[0]!r} holds {there[short[0]]} "
                        f"bytes, its manifest says {own[short[0]]}; nothing was copied to "
                        f"{dst!r}",
                        spec_id="SP-READ-3",
                    )
                infos = own
                if incremental is not None and p.hashes is not None:
                    base = storage_base(dst, incremental, writing_backend(dst, backend))
                    if base is not None:
                        onto = build_on(str(reader.path), dst, m, base, is_local(dst))
                if onto is not None:
                    index, flat, bases = onto.index, onto.flat, onto.checks
                    infos = {k: own[k] for k in onto.whole}
                elif p.bases:
                    index, flat, bases = flatten(str(reader.path), m, is_local(dst))
            if lacking:
                raise CorruptCheckpointError(
                    f"copy of {src!r}: object {lacking[0]!r} of its manifest is missing "
                    f"({len(lacking)} missing); nothing was copied to {dst!r}"
                )
            w = CheckpointWriter.begin(
                dst, backend=writing_backend(dst, backend), overwrite=overwrite, call="copy"
            )
        except BaseException:
            reader.close()
            raise
        t = cls(src, reader, w)
        t.keys, t.sizes = sorted(infos) + sorted(flat), dict(infos)
        if index is not None:
            t.flat, t._bases = flat, dict(bases)
            t._manifest = dataclasses.replace(m, packed=index)
        if onto is not None:
            t.origin, t.built_on = onto.origin, onto.base
            t._bases[onto.base[0]] = onto.base[1]
            t.sizes.update({k: sum(p[3] for p in v) for k, v in flat.items()})
        return t

    @property
    def staging(self) -> str:
        return str(self.writer.staging)

    @property
    def source(self) -> str:
        """The source checkpoint's location, as :func:`copy_part` takes it."""
        return str(self.reader.path)

    @property
    def source_root(self) -> str:
        """The key of the source checkpoint's root in its store (what ``keys`` are below)."""
        return str(locate(self.reader.path, "copy").pair()[1])

    @property
    def path(self) -> str:
        return str(self.writer.path)

    def base_intact(self) -> bool:
        """Whether the base the copy builds on (if any) is still there, the same checkpoint."""
        return self.built_on is None or manifest_identity(self.built_on[0]) == self.built_on[1]

    def commit(self) -> None:
        """Every part is durable: check that the source (and each base a flattened copy
        read) was not replaced meanwhile, then commit the manifest (the target becomes
        visible at once). Any failure aborts."""
        try:
            try:
                self.reader.check_unchanged()
                for where, ident in self._bases.items():
                    if manifest_identity(where) != ident:
                        raise CorruptCheckpointError(
                            f"copy of {self.src!r}: its base {where!r} was removed or replaced "
                            "while it ran; nothing was committed",
                            spec_id="SP-PACK-9",
                        )
            except BaseException:
                self.writer.abort()
                raise
            # decoded and given back as a Manifest: the target's backend encodes it once,
            # with its own save prefix in front on an object store (encode_marker)
            self.writer.commit(relative_manifest(self._manifest, self.source_prefix))
        finally:
            self.reader.close()

    def abort(self) -> None:
        """Remove what the copy staged (never the target); idempotent."""
        try:
            self.writer.abort()
        finally:
            self.reader.close()


def copy_checkpoint(
    src: str,
    dst: str,
    *,
    backend: Optional[StorageBackend] = None,
    overwrite: Any = False,
    threads: int = 8,
    incremental: Optional[str] = None,
) -> CopyResult:
    """Copy the committed checkpoint at ``src`` to ``dst`` (any two stores, either layout);
    the manifest is committed last, so ``dst`` never shows a partial checkpoint. ``backend``
    writes ``dst`` (the default one of its kind when None); ``overwrite`` as in a save. An
    incremental packed source ([SP-PACK-9]) is copied flattened: the target holds every
    chunk itself and names no base. ``incremental``: a committed packed checkpoint beside
    ``dst`` (its name or path) that the copy builds on, referring to the chunks it holds
    already instead of copying them (:mod:`.copy_onto`); where it is unusable, or removed or
    replaced before the commit, the copy is a full one. Raises the error of the step that
    failed (the documented classes of :mod:`shardpoint_core.format.errors`);
    :class:`CorruptCheckpointError` where an object of the manifest is missing (checked
    before anything is written)."""
    t = CopyTransaction.begin(
        src, dst, backend=backend, overwrite=overwrite, incremental=incremental
    )
    try:
        done = copy_part(
            t.reader.path,
            t.path,
            t.staging,
            t.keys,
            backend=t.writer.backend,
            threads=threads,
            source_prefix=t.source_prefix,
            sizes=t.sizes,
            flat={k: list(v) for k, v in t.flat.items()},
        )
    except BaseException:
        t.abort()
        raise
    if t.base_intact():
        try:
            t.commit()  # the group metadata, the manifest, then visible
        except CorruptCheckpointError:
            if t.base_intact():
                raise
        else:
            base = None if t.built_on is None else base_name(t.built_on[0])
            return CopyResult(t.path, len(done), sum(n for _t, n in done), base)
    else:
        t.abort()
    # the base was removed or replaced while the copy ran: a full copy instead
    return copy_checkpoint(src, dst, backend=backend, overwrite=overwrite, threads=threads)
