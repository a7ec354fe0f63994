"""PyTorch Distributed Checkpoint (DCP) directories as a conversion source and sink.

Everything goes through ``torch.distributed.checkpoint`` itself: its ``FileSystemReader``
reads the metadata (DCP's own ``.metadata`` is a pickle that DCP loads: ``open_source``,
``convert`` and ``diff`` refuse it unless ``trust_pickle=True``), and tensors are read with ``dcp.load(..., no_dist=True)`` into
preallocated global tensors, a bounded batch of keys at a time, whatever world size saved
them. Bytes entries (``torch.save`` of a non-tensor object) are decoded with
``weights_only=True`` only; what that refuses is reported, never unpickled.

Writing uses ``dcp.save(..., no_dist=True)`` on a state dict of zero-stride placeholders
(shape and dtype only, no memory) with a planner that reads each tensor from the source when
DCP's writer asks for it, so one tensor is in memory at a time.
"""

from __future__ import annotations

import functools
import io
import os
import shutil
import warnings
from typing import Any

import torch

from shardpoint_core.commit.base import Overwrite
from shardpoint_core.format.errors import ConversionError, ShardpointError
from shardpoint_core.stores.fsutil import os_error_text
from shardpoint.tools.convert.base import (
    Progress,
    Source,
    TensorInfo,
    flat_name,
    key_of,
    nest,
    staged_output,
)

FORMAT = "dcp"


def is_dcp_output(path: str) -> bool:
    """Whether ``path`` is a DCP checkpoint directory (its ``.metadata`` file): the only
    thing ``overwrite=True`` replaces here."""
    return (
        os.path.isdir(path)
        and not os.path.islink(path)
        and os.path.isfile(os.path.join(path, ".metadata"))
    )


def is_dcp(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata"))


class Unreadable:
    """A bytes entry that ``weights_only`` refused, with the reason."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


@functools.lru_cache(maxsize=None)
def _planner_classes() -> tuple:
    """DCP's planner classes for reading a source (built on first use: DCP imports late)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SafeBytesLoadPlanner(DefaultLoadPlanner):
        """DCP's planner, decoding bytes entries with ``weights_only=True`` only."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                v = torch.load(value, weights_only=True, map_location="cpu")
            except Exception as e:  # noqa: BLE001 - recorded as the entry's reason
                msg = [ln.strip() for ln in str(e).splitlines() if "Unsupported global" in ln]
                v = Unreadable(
                    "needs pickle beyond torch.load(weights_only=True): "
                    + (msg[0] if msg else f"{type(e).__name__}: {e}")
                )
            self.original_state_dict[read_item.dest_index.fqn] = v

    class RowsLoadPlanner(SafeBytesLoadPlanner):
        """A load plan for bands of rows: ``state[fqn]`` holds rows ``starts[fqn]`` onwards of
        the saved tensor; DCP resolves only the saved chunks overlapping those rows."""

        def __init__(self, starts: dict) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.starts = starts

        def create_local_plan(self) -> LoadPlan:
            reads = []
            saved = self.metadata.state_dict_metadata if self.metadata is not None else {}
            for fqn, rows in self.state_dict.items():
                entry = saved.get(fqn)
                if not isinstance(entry, TensorStorageMetadata):  # DCP set up no tensor here
                    raise ConversionError(f"DCP's metadata has no tensor {fqn!r} to read rows of")
                off = (self.starts[fqn],) + (0,) * (rows.dim() - 1)
                chunk = ChunkStorageMetadata(offsets=torch.Size(off), sizes=rows.size())
                reads += create_read_items_for_chunk_list(fqn, entry, [chunk])
            self.plan = LoadPlan(reads)
            return self.plan

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            return self.state_dict[index.fqn]  # the rows; read items carry offsets in it

    return SafeBytesLoadPlanner, RowsLoadPlanner


def _load_planner() -> Any:
    return _planner_classes()[0](flatten_state_dict=False, flatten_sharded_tensors=False)


def dcp_load(path: str, state: dict, planner: Any = None) -> None:
    """``dcp.load`` of a flat ``{fqn: preallocated tensor or None}``, in this process only."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            dcp.load(
                state,
                storage_reader=dcp.FileSystemReader(path),
                planner=planner or _load_planner(),
                no_dist=True,
            )
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - per-rank failures
            if isinstance(e, CheckpointException):  # its str() is whole tracebacks
                why = "; ".join(f"{type(x).__name__}: {x}".strip() for x, _ in e.failures.values())
            else:
                why = str(e).strip()[:500]
            raise ConversionError(
                f"dcp.load from {path!r} failed for keys "
                f"{sorted(state)[:5]}: {why} (a missing, truncated or "
                "unreadable .distcp file?)"
            ) from None


class DCPSource(Source):
    """A DCP checkpoint directory (``.metadata`` + ``*.distcp``), any saving world size."""

    def __init__(self, path: str, *, batch_bytes: int = 64 << 20, read_bytes: bool = True) -> None:
        super().__init__(str(path), FORMAT)
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            TensorStorageMetadata,
        )

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                md = FileSystemReader(self.path).read_metadata()
            except Exception as e:  # noqa: BLE001
                raise ConversionError(
                    f"{self.path!r}: DCP cannot read its .metadata: {type(e).__name__}: {e}"
                ) from None
        if not hasattr(md, "state_dict_metadata"):
            raise ConversionError(
                f"{self.path!r}: its .metadata unpickles to a "
                f"{type(md).__name__}, not DCP's Metadata"
            )
        pd = md.planner_data if isinstance(md.planner_data, dict) else {}
        self.batch_bytes = batch_bytes
        self.windows: dict = {}  # path -> (start, stop): the only rows to read of it
        self._fqn: dict = {}
        self._cache: dict = {}
        byte_keys = []
        for fqn, m in md.state_dict_metadata.items():
            path_ = tuple(pd.get(fqn) or (fqn,))
            if isinstance(m, TensorStorageMetadata):
                t = TensorInfo(path_, tuple(m.size), m.properties.dtype)
                self.tensors.append(t)
                self._fqn[t.path] = fqn
            elif isinstance(m, BytesStorageMetadata):
                byte_keys.append((fqn, path_))
            else:
                self.skipped.append((key_of(path_), f"DCP entry of kind {type(m).__name__}"))
        if byte_keys and read_bytes:
            state = {fqn: None for fqn, _ in byte_keys}
            dcp_load(self.path, state)
            for fqn, p in byte_keys:
                self.add_bytes_entry(fqn, p, state[fqn])

    def add_bytes_entry(self, fqn: str, path: tuple, v: Any) -> None:
        """A decoded bytes entry becomes a value, or a skipped line with its reason."""
        if isinstance(v, Unreadable):
            self.skipped.append((key_of(path), v.reason))
        else:
            self.values[path] = v

    def read(self, t: TensorInfo) -> torch.Tensor:
        if t.path not in self._cache:
            self._cache.clear()
            i = self.tensors.index(t)
            batch: list[TensorInfo] = []
            size = 0
            for u in self.tensors[i:]:
                if u.path not in self._fqn:
                    continue
                if batch and size + u.nbytes > self.batch_bytes:
                    break
                batch.append(u)
                size += u.nbytes
            state = {self._fqn[u.path]: torch.empty(u.shape, dtype=u.dtype) for u in batch}
            dcp_load(self.path, state)
            self._cache = {u.path: state[self._fqn[u.path]] for u in batch}
        return self._cache.pop(t.path)

    def read_rows(self, t: TensorInfo, start: int, stop: int) -> torch.Tensor:
        """With a window set for ``t`` (a worker of a multi-process conversion converts only
        those rows), DCP reads just the window, once; else the whole tensor, as in ``read``."""
        win = self.windows.get(t.path)
        if win is None or t.path not in self._fqn or not t.shape:
            return super().read_rows(t, start, stop)
        last = self.__dict__.get("_last_read")
        if last is None or last[0] != (t.path, win):
            self.__dict__["_last_read"] = None
            rows = torch.empty((win[1] - win[0],) + tuple(t.shape[1:]), dtype=t.dtype)
            fqn = self._fqn[t.path]
            dcp_load(self.path, {fqn: rows}, _planner_classes()[1]({fqn: win[0]}))
            last = self.__dict__["_last_read"] = ((t.path, win), rows)
        if not win[0] <= start <= stop <= win[1]:
            raise ConversionError(
                f"tensor {t.key!r}: rows {start}:{stop} asked for outside "
                f"the window {win[0]}:{win[1]} this process reads"
            )
        return last[1][start - win[0] : stop - win[0]]

    def close(self) -> None:
        self._cache.clear()
        self.__dict__.pop("_last_read", None)


def write_dcp(
    src: Source,
    dst: str,
    *,
    overwrite: Overwrite = False,
    progress: Progress = None,
    thread_count: int = 1,
) -> list:
    """Write ``src`` as a DCP checkpoint (one rank's files) that ``dcp.load`` reads back into
    the same nested state dict. Values are stored as DCP bytes entries; sharded objects as the
    list of their values. Returns ``[(key, reason)]`` for what could not be written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    by_fqn: dict = {}
    leaves = []
    for t in src.tensors:
        by_fqn[flat_name(t.path)] = t
        leaves.append((t.path, torch.empty((), dtype=t.dtype).expand(t.shape)))
    leaves += list(src.values.items()) + [(p, list(v)) for p, v in src.objects.items()]
    if len({flat_name(p) for p, _ in leaves}) != len(leaves):
        raise ConversionError(
            f"{src.path!r}: two keys have the same DCP name once joined by '.'; rename one"
        )
    state = nest(leaves, f"converting {src.path!r} to DCP")

    class StreamingSavePlanner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            t = by_fqn.get(index.fqn)
            if t is None:
                return super().lookup_object(index)
            data = src.read(t)
            if tuple(data.shape) != tuple(t.shape) or data.dtype != t.dtype:
                raise ConversionError(
                    f"tensor {t.key!r}: the source read {data.dtype}"
                    f"{list(data.shape)}, its metadata says {t.dtype}"
                    f"{list(t.shape)}"
                )
            if progress:
                progress(t.nbytes)
            return data

    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    with staged_output(
        dst, overwrite, is_dir=True, is_output=is_dcp_output, protect=(src.path,)
    ) as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # One file per tensor: DCP's writer keeps every tensor of a file alive until the
            # file is done (torch 2.13, filesystem.py tensor_dict), so one file per rank would
            # hold the whole checkpoint in memory.
            try:
                dcp.save(
                    state,
                    storage_writer=dcp.FileSystemWriter(
                        tmp, thread_count=thread_count, single_file_per_rank=False
                    ),
                    planner=StreamingSavePlanner(),
                    no_dist=True,
                )
            except CheckpointException as e:  # its str() names only the failed ranks
                causes = [x for x, _ in e.failures.values()]
                if any(isinstance(x, ShardpointError) for x in causes):
                    raise next(x for x in causes if isinstance(x, ShardpointError)) from e
                # DCP's writer turns a full disk into "unexpected pos" RuntimeErrors: the free
                # space (the partial files are still there) tells what happened.
                free = shutil.disk_usage(os.path.dirname(tmp)).free
                full = (
                    (
                        f"; the file system holding {dst!r} has {free} bytes free, under the "
                        f"{src.total_bytes} the tensors need: free space on it or write "
                        "elsewhere"
                    )
                    if free < src.total_bytes
                    else ""
                )
                raise ConversionError(
                    f"writing DCP checkpoint {dst!r} failed: "
                    + "; ".join(os_error_text(x) for x in causes)
                    + full
                    + f"; nothing was written at {dst!r}"
                ) from e
        src.check_unchanged()  # nothing built from two checkpoints is published
    return []


__all__ = ["DCPSource", "write_dcp", "is_dcp", "dcp_load"]
