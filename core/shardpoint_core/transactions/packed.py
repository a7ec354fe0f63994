"""The packed backend (format 1.4, spec/format.md section 13): a save writes a few data
objects per writer instead of a directory and a file per chunk.

:class:`PackedBackend` implements the :class:`~.protocol.StorageBackend` protocol by
delegation to a :class:`~.backend.ZarrBackend`: targets, staging, commit, recovery and
every read are the Zarr backend's (which reads both layouts, telling them apart by the
manifest: a tensor entry with a packed index part is read through it). What differs is
writing: each process appends the encoded chunks it writes to its own data objects
(:class:`~shardpoint_core.arrays.packed.PackedWriter`), ``flush`` makes them durable and
writes the process's index part, and the coordinator's ``write_manifest`` gathers the parts
into the manifest's ``packed`` field (``format_version`` ``[1, 4]``), deletes them, and
writes the manifest as the Zarr backend would (on files durably before the rename; on
object stores as the marker, whose commit puts the save prefix in front of every object
path, [SP-COMMIT-11]).

Compressed arrays (format 1.5, [SP-PACK-12]): an array spec with ``compression`` is
encoded by the Zarr layer's compressed chain (one zstd frame and its crc32c per chunk, the
bytes of a per-array chunk file) and named ``[name, nil, codec]`` in the index; the
manifest then says ``[1, 5]``. Incremental saves compare those stored bytes.

Incremental saves ([SP-PACK-9] to [SP-PACK-11]): ``PackedBackend(incremental=...)`` names a
*base*, a committed packed checkpoint beside the target (``True``: the newest one there, on
files), and records every chunk's hash; a chunk whose bytes the base holds already (same
length, crc32c and BLAKE3/128 hash) is not written, its record points at the base's bytes.

Example::

    sp.save(state, "/ckpt/step_10", backend=PackedBackend())
    sp.load("/ckpt/step_10")                # any backend reads it
    sp.save(state, "/ckpt/step_20", backend=PackedBackend(incremental="step_10"))
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple, Union

import numpy as np

from shardpoint_core.arrays.array import ArrayLayout, write_region
from shardpoint_core.arrays.direct_write import WritePool
from shardpoint_core.arrays.identity import CrcSink, chunk_number, units_per_chunk
from shardpoint_core.arrays.packed import ChunkWriteView, PackedWriter, build_index, gather_parts
from shardpoint_core.arrays.packed_base import Base, manifest_identity, sibling_path
from shardpoint_core.transactions.incremental import resolve_base
from shardpoint_core.commit.base import Overwrite
from shardpoint_core.format.errors import InvalidOptionError, SaveFailedError
from shardpoint_core.format.manifest import Manifest, decode_manifest
from shardpoint_core.format.compression import FORMAT_VERSION_1_5
from shardpoint_core.format.packed import FORMAT_VERSION_1_4, chunk_count
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.transactions.backend import ZarrBackend


class _Handle:
    """An array being written: its chunk view, layout and chunk-table sink; ``partial``
    serializes writes of parts of a chunk (each reads, changes and rewrites the chunk)."""

    __slots__ = ("view", "name", "layout", "sink", "partial")

    def __init__(self, view: ChunkWriteView, name: str, layout: ArrayLayout, sink: Any) -> None:
        self.view, self.name, self.layout, self.sink = view, name, layout, sink
        self.partial = threading.Lock()

    def write(self, offset: Tuple[int, ...], data: np.ndarray) -> None:
        whole = all(
            o % c == 0 and (s % c == 0 or o + s == n)
            for o, s, c, n in zip(offset, data.shape, self.layout.chunk, self.layout.shape)
        )
        if whole:
            write_region(self.view, self.name, self.layout, offset, data, self.name, self.sink)
            return
        with self.partial:
            write_region(self.view, self.name, self.layout, offset, data, self.name, self.sink)


class PackedBackend:
    """Saves in the packed layout; reads and commits as ``zarr`` (a :class:`ZarrBackend`,
    by default one with the same ``fsync``). ``cap``: bytes after which a writer starts a
    new data object (default: 1 TiB on files, 16 MiB on object stores, each
    object one PUT, up to 256 MiB of them in flight);
    ``write_threads``: chunks encoded and written at once per process. ``writer_id``: the
    name of this process's objects (``packed/<writer_id>-<n>.bin``; default random), fixed
    only for reproducible one-process saves (the golden vectors): two processes of one save
    must not share it. ``incremental``: build on a base ([SP-PACK-9]): a sibling's name or
    path, or ``True`` (the newest committed checkpoint beside the target on files; none: a
    full save that records hashes for the next); ``hashes``: record each chunk's hash
    ([SP-PACK-10]; default: with ``incremental``), so a later save can build on this one."""

    name = "packed"
    #: (1.5) writes compressed arrays ([SP-ARRAY-7] in the packed layout, [SP-PACK-12])
    supports_compression = True

    def __init__(
        self,
        zarr: Optional[ZarrBackend] = None,
        *,
        cap: Optional[int] = None,
        fsync: bool = True,
        write_threads: int = 16,
        writer_id: Optional[str] = None,
        incremental: Union[None, bool, str] = None,
        hashes: Optional[bool] = None,
    ) -> None:
        if incremental is False:
            incremental = None
        if incremental is not None and not isinstance(incremental, (str, bool)):
            incremental = str(incremental)  # a PathLike
        if hashes is False and incremental is not None:
            raise InvalidOptionError(
                "hashes=False with incremental: an incremental save compares chunk hashes "
                "([SP-PACK-10]); leave hashes at its default"
            )
        self.incremental = incremental
        self.hashes = bool(hashes) or incremental is not None
        self._bases: Dict[str, Tuple[str, Optional[Base]]] = {}  # staging -> target, base
        self.zarr = zarr if zarr is not None else ZarrBackend(fsync=fsync)
        self.cap, self.fsync = cap, fsync if zarr is None else zarr.fsync
        self.writer_id = writer_id
        self._lock = threading.Lock()
        self._writers: Dict[str, PackedWriter] = {}
        self._crcs: Dict[str, CrcSink] = {}
        self._own: Dict[str, Optional[bytes]] = {}  # coordinated saves -> own index part
        self._pool = WritePool(write_threads, "sp-packed")
        self._puts = WritePool(4, "sp-packed-put")

    def __repr__(self) -> str:
        extra = f", incremental={self.incremental!r}" if self.incremental is not None else ""
        return f"PackedBackend(zarr={self.zarr!r}{extra})"

    def with_incremental(self, incremental: Union[None, bool, str]) -> "PackedBackend":
        """A backend like this one (its threads shared) whose saves build on
        ``incremental`` (see the class) and record hashes (False or None: hashes only)."""
        other = PackedBackend(
            self.zarr,
            cap=self.cap,
            writer_id=self.writer_id,
            incremental=incremental,
            hashes=True,
            write_threads=0,
        )
        other._pool, other._puts = self._pool, self._puts  # one set of threads per process
        return other

    def save_target(self, staging: str, path: str) -> None:
        """Which checkpoint the save staged at ``staging`` makes: an incremental save loads
        its base beside it now, before anything is written (every rank does, the same)."""
        base = None
        if self.incremental is not None:
            base = resolve_base(path, self.incremental, self.zarr)
        with self._lock:
            self._bases[staging] = (path, base)

    def base_of(self, staging: str) -> Optional[Base]:
        """The base of the save staged at ``staging`` (None: a full save)."""
        with self._lock:
            got = self._bases.get(staging)
        return None if got is None else got[1]

    def supports_concurrent_writers(self) -> bool:
        return True  # each process writes objects of its own

    def locate(self, path: str) -> Tuple[Any, str]:
        """(the byte store holding ``path``, its key there): the Zarr backend's."""
        return self.zarr.locate(path)

    # -- targets and staging: the Zarr backend's ----------------------------------------
    def checkpoint_state(self, path: str) -> str:
        return self.zarr.checkpoint_state(path)

    def check_target(self, path: str, overwrite: Overwrite) -> None:
        self.zarr.check_target(path, overwrite)

    def staging_path(self, path: str, token: str) -> str:
        return self.zarr.staging_path(path, token)

    def begin_save(self, staging: str) -> None:
        """The staging location (the Zarr backend's); this process coordinates the save, so
        its own index part stays in memory for :meth:`write_manifest`."""
        self.zarr.begin_save(staging)
        with self._lock:
            self._own[staging] = None

    # -- writing --------------------------------------------------------------------------
    def _writer(self, root: str) -> PackedWriter:
        with self._lock:
            w = self._writers.get(root)
            if w is None:
                store, prefix = self.zarr.locate(root)
                target = self._bases.get(root, (None, None))[0]

                def base_read(owner: str, path: str, at: int, n: int) -> bytes:
                    bstore, bprefix = self.zarr.locate(sibling_path(str(target), owner))
                    got: bytes = bstore.get_range(f"{bprefix}/{path}" if bprefix else path, at, n)
                    return got

                w = self._writers[root] = PackedWriter(
                    store,
                    prefix,
                    cap=self.cap,
                    fsync=self.fsync,
                    submit=self._puts.submit,
                    writer_id=self.writer_id,
                    hashes=self.hashes,
                    base_read=base_read if target is not None else None,
                )
            return w

    def open_array_for_write(self, root: str, array_path: str, spec: ArraySpec) -> Any:
        """A handle whose writes append whole encoded chunks to this process's objects."""
        lay = ArrayLayout.create(
            spec.shape,
            spec.dtype,
            spec.chunk_shape,
            shard_above_bytes=self.zarr.shard_above_bytes,
            inner_chunk_bytes=self.zarr.inner_chunk_bytes,
            compression=spec.compression,  # (1.5) the compressed chain, [SP-PACK-12]
        )
        base = self.base_of(root)
        part = None
        if base is not None:
            part = base.candidates(array_path, spec.shape, spec.dtype, lay.chunk, lay.inner)
        view = ChunkWriteView(
            self._writer(root), array_path, lay, part, base.owners if base is not None else ()
        )
        with self._lock:
            sink = self._crcs.setdefault(root, CrcSink())
        units = units_per_chunk(lay.chunk, lay.inner)

        def slots(cidx: Sequence[int]) -> bytearray:
            return sink.chunk(array_path, chunk_number(cidx, lay.shape, lay.chunk), units)

        return _Handle(view, array_path, lay, slots)

    def write(self, handle: Any, offset: Sequence[int], data: np.ndarray) -> Any:
        return self._pool.submit(handle.write, tuple(int(o) for o in offset), data)

    def take_chunk_crc32c(self, root: str) -> dict[str, Any]:
        """The crc32c of the units this process wrote (the manifest's chunk tables)."""
        with self._lock:
            sink = self._crcs.pop(root, None)
        return sink.take() if sink is not None else {}

    def wait(self, ops: Sequence[Any]) -> None:
        self.zarr.wait(ops)

    def flush(self, root: str) -> None:
        """This process's objects whole and durable, then its index part ([SP-PACK-8])."""
        with self._lock:
            w = self._writers.pop(root, None)
            # the coordinator's first part stays in memory; a later one (a second writer of
            # the save in this process) is published, and write_manifest lists the parts
            coordinating = root in self._own and self._own[root] is None
        if w is None:
            return
        try:
            part = w.finish(publish=not coordinating)
            if coordinating:
                with self._lock:
                    self._own[root] = part
        except OSError as e:
            raise SaveFailedError(f"cannot make the data objects under {root} durable: {e}") from e

    def write_manifest(self, root: str, data: Union[bytes, Manifest]) -> None:
        """Every writer's index part gathered into the manifest's ``packed`` field
        (checked as readers check it), the parts deleted, then the manifest written: on
        files durably (the rename follows), on object stores kept for :meth:`commit`."""
        store, prefix = self.zarr.locate(root)
        m = data if isinstance(data, Manifest) else decode_manifest(data)
        with self._lock:
            own = self._own.pop(root, None)
        if not m.tensors:  # no array, no chunk, no part: nothing packed. The layout of
            # section 3, which every 1.x reader reads (a `packed` field would make readers
            # of 1.3 refuse a state of values alone)
            self.zarr.write_manifest(root, m)
            return
        others = m.save_world_size > 1 or own is None
        objects, rows, inner, parts, refs = gather_parts(store, prefix, own, others=others)
        if not others and len(rows) + len(refs) < sum(
            chunk_count(e.shape, e.chunk_shape) for e in m.tensors.values()
        ):  # parts of other writers all the same (a converter's workers, a second writer here)
            objects, rows, inner, parts, refs = gather_parts(store, prefix, own, others=True)
        arrays: Dict[str, Any] = {}
        for e in m.tensors.values():
            got = inner.get(e.array)
            if got is None and e.array not in inner:  # no chunk: the writer's choice
                got = ArrayLayout.create(
                    e.shape,
                    e.dtype,
                    e.chunk_shape,
                    shard_above_bytes=self.zarr.shard_above_bytes,
                    inner_chunk_bytes=self.zarr.inner_chunk_bytes,
                ).inner
            arrays[e.array] = got if got is None or isinstance(got, dict) else tuple(got)
        m.packed = build_index(objects, rows, arrays, refs, hashes=self.hashes)
        # (1.5) compressed arrays ([SP-PACK-12]) are a 1.5 construct, else 1.4 ([SP-VER-1])
        m.format_version = FORMAT_VERSION_1_5 if m.packed.codecs else FORMAT_VERSION_1_4
        self._check_bases(root, m.packed.bases)
        # encoded once, by the committer (the index checked as a reader checks it): on files
        # written durably (the rename follows); on object stores straight into the marker,
        # its array and object names below the save prefix, PUT at commit()
        self.zarr.committer.write_manifest(root, m)
        if parts:
            store.delete(parts)

    def _check_bases(self, root: str, bases: Sequence[Tuple[str, bytes]]) -> None:
        """Every base the index names still there with the identity recorded (a base
        deleted or replaced while the save ran fails the save, [SP-PACK-9])."""
        with self._lock:
            target = self._bases.get(root, (None, None))[0]
        for name, ident in bases:
            got = manifest_identity(sibling_path(str(target), name)) if target else None
            if got != ident:
                raise SaveFailedError(
                    f"incremental save of {target}: its base {name!r} was "
                    f"{'removed' if got is None else 'replaced'} while it ran; nothing was "
                    "committed ([SP-PACK-9])"
                )

    def commit(self, staging: str, path: str, *, overwrite: Overwrite) -> None:
        try:
            self.zarr.committer.publish(staging, path, overwrite=overwrite)
        finally:
            with self._lock:
                self._bases.pop(staging, None)

    def abort(self, staging: str) -> None:
        with self._lock:
            w = self._writers.pop(staging, None)
            self._crcs.pop(staging, None)
            self._own.pop(staging, None)
            self._bases.pop(staging, None)
        if w is not None:
            w.abandon()
        self.zarr.abort(staging)

    # -- reading and recovery: the Zarr backend's (it reads both layouts) ---------------
    def read_manifest(self, path: str) -> bytes:
        return self.zarr.read_manifest(path)

    def read_manifest_with_identity(self, path: str) -> Tuple[bytes, Optional[list[Any]]]:
        return self.zarr.read_manifest_with_identity(path)

    def checkpoint_identity(self, path: str) -> Optional[list[Any]]:
        return self.zarr.checkpoint_identity(path)

    def open_array_for_read(self, root: str, array_path: str, spec: ArraySpec, key: str) -> Any:
        return self.zarr.open_array_for_read(root, array_path, spec, key)

    def will_open(self, root: str, specs: Iterable[ArraySpec]) -> None:
        """A hint before arrays are opened: the Zarr backend's."""
        self.zarr.will_open(root, specs)

    def read_into(self, handle: Any, offset: Sequence[int], out: np.ndarray) -> Any:
        return self.zarr.read_into(handle, offset, out)

    def release(self, root: str) -> None:
        """The end (or start) of a load of ``root``: the Zarr backend's."""
        self.zarr.release(root)

    def prefetch(self, handle: Any, offset: Sequence[int], shape: Sequence[int]) -> None:
        self.zarr.prefetch(handle, offset, shape)

    def start_reads(self) -> None:
        self.zarr.start_reads()

    def verify_array(self, root: str, array_path: str, spec: ArraySpec, key: str) -> list[Any]:
        return self.zarr.verify_array(root, array_path, spec, key)

    def list_leftovers(self, directory: str) -> list[Any]:
        return self.zarr.list_leftovers(directory)

    def restore_leftover(self, leftover: str, path: str) -> bool:
        return self.zarr.restore_leftover(leftover, path)

    def remove_leftover(self, leftover: str) -> bool:
        return self.zarr.remove_leftover(leftover)

    @property
    def committer(self) -> Any:
        """The Zarr backend's committer (recovery and managers look it up on a backend)."""
        return self.zarr.committer


# ---------------------------------------------------------- the front ends' incremental saves
_SHARED: Optional[PackedBackend] = None  # of saves that ask for incremental but name no backend


def _packed(be: Any, what: str) -> PackedBackend:
    """``be`` as a packed backend (None: the process's shared one, so its write threads are
    made once, as the default backend's); InvalidOptionError for another backend."""
    global _SHARED
    if be is None:
        with _SHARED_LOCK:
            if _SHARED is None:
                _SHARED = PackedBackend()
            return _SHARED
    if isinstance(be, PackedBackend):
        return be
    raise InvalidOptionError(
        f"{what} needs the packed layout: pass backend=PackedBackend() (or no backend), not {be!r}"
    )


_SHARED_LOCK = threading.Lock()


def incremental_backend(be: Any, incremental: Union[None, bool, str]) -> Any:
    """The backend of a save with ``incremental`` (``sp.save`` and ``shardpoint_jax.save``;
    None or False: ``be`` unchanged): a :class:`PackedBackend` building on the base."""
    if incremental is None or incremental is False:
        return be
    return _packed(be, f"incremental={incremental!r}").with_incremental(incremental)


def step_backend(be: Any, base: Optional[str]) -> PackedBackend:
    """The backend of a manager's incremental save (``CheckpointManager(incremental=True)``
    of either front end): ``be`` (None: the shared one) recording chunk hashes, building on
    ``base``, the newest committed step before this one (None: a full save whose hashes the
    next one compares against)."""
    packed = _packed(be, "incremental=True")
    if base is not None:
        return packed.with_incremental(base)
    return packed if packed.hashes else packed.with_incremental(False)


from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:
    from shardpoint_core.transactions.protocol import StorageBackend

    def _is_storagebackend_packedbackend(x: PackedBackend) -> StorageBackend:
        return x
