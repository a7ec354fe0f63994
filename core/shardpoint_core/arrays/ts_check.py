"""TensorStore as a second, independent Zarr implementation over the same local files: the
cross-check of :class:`~shardpoint_core.transactions.backend.ZarrBackend` (``direct_reads=False`` /
``direct_writes=False``) and the reader on big-endian hosts.

Nothing here is on the default path, and TensorStore is imported only when one of these
functions runs (``pip install 'shardpoint[tensorstore]'``). Arrays are written with
``store_data_equal_to_fill_value`` (an all-zero chunk is still a stored chunk) and
``file_io_sync`` off (the backend's ``flush`` makes them durable at once), and read with
``fill_missing_data_reads: false`` (a missing chunk is an error, never silent zeros); one
``ts.Context`` is shared by all arrays of a backend.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any, Optional, Sequence

import numpy as np

from shardpoint_core.format.errors import CorruptCheckpointError, SaveFailedError, ShardpointError
from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.arrays.checks import check_metadata
from shardpoint_core.format.layout import fill_value


def _ts() -> Any:
    """TensorStore, imported only where it is used (the cross-check paths)."""
    try:
        import tensorstore
    except ImportError as e:
        from shardpoint_core.format.errors import InvalidOptionError

        raise InvalidOptionError(
            "ZarrBackend(direct_reads=False / direct_writes="
            "False) and big-endian hosts need TensorStore: pip install "
            "'shardpoint[tensorstore]'"
        ) from e
    return tensorstore


def region(handle: Any, offset: Sequence[int], shape: Sequence[int]) -> Any:
    """The TensorStore view of box ``offset``/``shape`` of ``handle``."""
    if not shape:
        return handle
    return handle[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


class TSHandle:
    """A stored array read through TensorStore alone."""

    def __init__(self, h: Any, key: str) -> None:
        self.ts, self.key = h, key


class LazyTS:
    """A TensorStore opened only on first need, once, from any thread."""

    def __init__(self, open_ts: Any) -> None:
        self._open_ts = open_ts
        self._ts: Any = None
        self._lock = threading.Lock()

    def tensorstore(self) -> Any:
        with self._lock:
            if self._ts is None:
                self._ts = self._open_ts()
            return self._ts


class TensorStoreCheck:
    """TensorStore over the local files of a checkpoint, with one shared ``ts.Context``."""

    def __init__(self, context: Optional[dict[str, Any]] = None) -> None:
        spec = dict(context or {})
        spec.setdefault("file_io_sync", False)  # the backend's flush syncs everything at once
        self.context_spec = spec
        self._context: Any = None
        self._lock = threading.Lock()

    @property
    def context(self) -> Any:
        """The ``ts.Context`` shared by these opens (made on first use)."""
        with self._lock:
            if self._context is None:
                self._context = _ts().Context(self.context_spec)
            return self._context

    @staticmethod
    def _spec(root: str, array_path: str) -> dict[str, Any]:
        return {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": os.path.join(root, array_path) + "/"},
        }

    def open_for_write(self, root: str, array_path: str, meta: dict[str, Any]) -> Any:
        """Create (or open: another rank may have) the array of zarr.json ``meta``."""
        s = self._spec(root, array_path)
        s.update(
            {"metadata": meta, "create": True, "open": True, "store_data_equal_to_fill_value": True}
        )
        try:
            return _ts().open(s, context=self.context).result()
        except ValueError as e:
            raise SaveFailedError(f"cannot create array {array_path!r} under {root}: {e}") from e

    def open_for_read(self, root: str, array_path: str, spec: ArraySpec, key: str) -> Any:
        s = self._spec(root, array_path)
        # Revalidate cached metadata and data once, at open: a checkpoint replaced in place
        # (overwrite=True) must never be read through entries cached from the old one.
        s.update(
            {
                "open": True,
                "fill_missing_data_reads": False,
                "recheck_cached_data": "open",
                "recheck_cached_metadata": "open",
            }
        )
        tsm = _ts()  # a missing TensorStore is a missing dependency, not corruption
        try:
            h = tsm.open(s, context=self.context).result()
        except ValueError as e:
            raise CorruptCheckpointError(
                f"tensor {key!r}: cannot open its array {array_path!r}: {e}", spec_id="SP-ARRAY-1"
            ) from e
        meta = h.spec(retain_context=False).to_json().get("metadata", {})
        check_metadata(h.domain.shape, meta, spec, key, array_path)
        return h

    @staticmethod
    def write(handle: Any, offset: Sequence[int], data: np.ndarray) -> Any:
        return region(handle, offset, data.shape).write(
            data, can_reference_source_data_indefinitely=True
        )

    @staticmethod
    def read_into(handle: TSHandle, offset: Sequence[int], out: np.ndarray) -> Any:
        return _ts().array(out, copy=False, write=True).write(region(handle.ts, offset, out.shape))

    def verify(self, root: str, array_path: str, spec: ArraySpec, key: str) -> list[Any]:
        """Every chunk read through TensorStore; one problem per damaged chunk."""
        try:
            h = self.open_for_read(root, array_path, spec, key)
        except ShardpointError as e:
            return [(e.spec_id or "SP-ARRAY-1", str(e))]
        problems = []
        meta = h.spec(retain_context=False).to_json().get("metadata", {})
        if meta.get("chunk_key_encoding", {}).get("name", "default") != "default":
            problems.append(
                (
                    "SP-ARRAY-3",
                    f"tensor {key!r}: chunk_key_encoding is "
                    f"{meta['chunk_key_encoding']!r}, not 'default'",
                )
            )
        if meta.get("fill_value") != fill_value(spec.dtype):
            problems.append(
                (
                    "SP-ARRAY-3",
                    f"tensor {key!r}: fill_value "
                    f"{meta.get('fill_value')!r} is not {fill_value(spec.dtype)!r}",
                )
            )
        shape, chunk = tuple(spec.shape), tuple(spec.chunk_shape)
        grid = [math.ceil(n / c) if c else 0 for n, c in zip(shape, chunk)]
        for idx in np.ndindex(*grid) if shape else [()]:
            off = tuple(i * c for i, c in zip(idx, chunk))
            sh = tuple(min(c, n - o) for c, n, o in zip(chunk, shape, off))
            try:
                region(h, off, sh).read().result()
            except ValueError as e:
                msg = str(e).split("[tensorstore_spec")[0].strip()
                sid = "SP-READ-2" if "NOT_FOUND" in msg else "SP-READ-3"
                problems.append((sid, f"tensor {key!r} chunk {list(idx)}: {msg}"))
        return problems
