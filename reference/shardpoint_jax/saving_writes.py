"""save()'s writes (spec/format.md section 9): the regions this process writes
(:func:`local_regions`: replica-0 shards and the local arrays it was elected for) and
:func:`write_regions`, which writes them chunk by chunk through the save's
:class:`~shardpoint_core.transactions.writer.CheckpointWriter` with a bounded window of
writes in flight (:class:`Writes`), makes them durable and names the tensor in any failure."""

from __future__ import annotations

from collections import deque
from typing import Any, Optional

import numpy as np

from shardpoint_core.format.spec import ArraySpec
from shardpoint_core.transactions.writer import CheckpointWriter
from shardpoint_jax import errors as E
from shardpoint_jax.saving_plan import LocalPlan
from shardpoint_jax.storage import chunk_pieces

# Bytes of writes in flight (each holds its encoded chunks, and for arrays on an accelerator
# a host copy): enough to keep the disk busy, bounded so a save adds little memory.
WRITE_AHEAD_BYTES = 64 << 20


class Writes:
    """Writes in flight, at most ``window`` bytes of them (the oldest is waited for before
    more start); every one is waited for before an error is raised, so none may still be
    writing into a staging directory that is being removed."""

    def __init__(self, window: int, writer: CheckpointWriter) -> None:
        self.queue: deque = deque()
        self.window, self.inflight, self.writer = window, 0, writer
        self.error: Optional[tuple] = None  # (key, exception) of the first failure

    def add(self, ops: list, nbytes: int, key: str) -> None:
        self.queue.append((ops, nbytes, key))
        self.inflight += nbytes
        while self.inflight > self.window and len(self.queue) > 1:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        ops, nbytes, key = self.queue.popleft()
        self.inflight -= nbytes
        try:
            self.writer.wait(ops)
        except Exception as e:  # noqa: BLE001 - the first one is raised by the caller
            self.error = self.error or (key, e)

    def drain(self) -> None:
        while self.queue:
            self._wait_oldest()


def local_regions(decision: dict, plan: LocalPlan, rank: int) -> list:
    """What this process writes, ``(key, array path, chunk shape, offset, data)``: replica-0 shards
    of global arrays, local arrays it was elected for [SP-GRID-1] [SP-REPL-1]; keys sorted,
    as the torch front end writes them (a packed save's data objects and index are then the
    same for the same state)."""
    out = []
    for key, a in sorted(plan.arrays.items(), key=lambda kv: kv[0]):
        entry = decision["tensors"][key]
        if a.size == 0:
            continue
        if decision["global"][key]:
            out += [
                (
                    key,
                    entry["array"],
                    entry["chunk_shape"],
                    [sl.start or 0 for sl in s.index],
                    s.data,
                )
                for s in a.addressable_shards
                if s.replica_id == 0
            ]
        elif decision["writers"][key] == rank:
            out.append((key, entry["array"], entry["chunk_shape"], [0] * a.ndim, a))
    return out


def write_regions(
    writer: CheckpointWriter, regions: list, tensors: dict, coordinator: bool
) -> dict:
    """Write ``regions`` (:func:`local_regions`; ``tensors``: the decision's entries) chunk
    by chunk through ``writer``, several at once (:class:`Writes`); then make what was
    written durable at once [SP-COMMIT-1]. Returns the crc32c of the units written, for the
    chunk tables ([SP-MAN-7]). The coordinator also creates the arrays nobody writes a chunk
    of (a zero dimension)."""
    handles: dict = {}

    def opened(key: str) -> Any:
        e = tensors[key]
        if e["array"] not in handles:
            handles[e["array"]] = writer.open_array(
                e["array"], ArraySpec(tuple(e["shape"]), e["dtype"], tuple(e["chunk_shape"]))
            )
        return handles[e["array"]]

    writes = Writes(WRITE_AHEAD_BYTES, writer)
    key = ""
    try:
        if coordinator:
            for key, e in tensors.items():
                if 0 in e["shape"]:
                    opened(key)
        for key, _array, chunk, off, data in regions:
            if writes.error is not None:
                break
            host = np.asarray(data)
            h = opened(key)
            writes.add(
                [writer.write(h, lo, piece) for lo, piece in chunk_pieces(off, host, chunk)],
                host.nbytes,
                key,
            )
    except Exception as e:  # noqa: BLE001 - reported as this tensor's write failure
        writes.error = writes.error or (key, e)
    finally:
        writes.drain()
    staging = writer.staging
    if writes.error is not None:
        key, failure = writes.error
        if isinstance(failure, E.ShardpointError):
            named = _naming(failure, key)
            if named is failure:
                raise failure
            raise named from failure
        raise E.SaveFailedError(
            f"tensor {key!r}: writing its chunks under {staging!r} failed: {_short(failure)}"
        ) from None
    try:
        return writer.flush()
    except OSError as e:
        raise E.SaveFailedError(
            f"making the chunks written under {staging!r} durable failed: {e}"
        ) from None


def _naming(e: E.ShardpointError, key: str) -> E.ShardpointError:
    """``e`` naming tensor ``key``, whose chunks were being written when it was raised,
    where it names none (the packed layout's writer names the data object it could not
    write, which holds the chunks of many tensors); the same class and rule."""
    text = str(e)
    if repr(key) in text:
        return e
    sid = e.spec_id
    body = text.split("] ", 1)[1] if sid and text.startswith(f"[{sid}] ") else text
    try:
        return type(e)(f"tensor {key!r}: {body}", spec_id=sid)
    except TypeError:  # a class built otherwise: as it is
        return e


def _short(e: BaseException) -> str:
    """A storage error in a line, less any status prefix."""
    text = str(e).replace("RESOURCE_EXHAUSTED: ", "").replace("INTERNAL: ", "")
    return text if len(text) < 400 else text[:400] + "..."
