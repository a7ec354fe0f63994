"""The checks a reader of a packed checkpoint (format 1.4, spec/format.md section 13) makes
of the data objects a tensor's records name before it allocates anything for the tensor
([SP-PACK-7]: each exists and holds at least its declared size; on files also a regular
file below real directories, [SP-SEC-5], and no unchecked holes, [SP-SEC-6]): each object
once per load (a ``checked`` map per checkpoint root), and on object stores the HEADs of
many objects in flight together (:func:`start_checks`: every object a load will read,
before its tensors are opened, in one round trip).
"""

from __future__ import annotations

import os
import stat
import threading
from concurrent.futures import Future
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from shardpoint_core.arrays.packed import _bad, _join
from shardpoint_core.format.packed import PackedArray
from shardpoint_core.stores.base import ByteStore

_CHECKING = threading.Lock()  # guards the ``checked`` maps of check_objects
CHECKED_KEPT = 4096  # objects a ``checked`` map holds at most (memory stays flat)


def _seen(store: ByteStore, full: str, size: int) -> str:
    return f"{store.url}/{full}:{size}"


def check_objects(
    store: ByteStore,
    prefix: str,
    part: PackedArray,
    key: str,
    checked: Dict[str, Any],
    chunk: Sequence[int] = (),
    itemsize: int = 1,
    submit: Optional[Callable[..., Any]] = None,
) -> None:
    """Every object the array's records name exists, is a regular file below real
    directories on local files, and holds at least its declared size, before anything is
    allocated for the tensor ([SP-SEC-5], [SP-PACK-7]; missing: [SP-READ-2]). ``checked``:
    objects found sound already (key -> True) or being checked by another thread or by
    :func:`start_checks` (key -> its Future), so a load checks each once however many
    tensors open at the same time (where that check fails, or finds a sparse object, each
    tensor checks for itself and raises the error naming it). ``submit``: on object stores,
    the array's objects not checked yet are HEADed at once through it (a pool whose tasks
    wait on nothing), not one after another."""
    with _CHECKING:
        if len(checked) > CHECKED_KEPT:
            checked.clear()
    objects = part.object_numbers()
    if submit is not None and len(objects) > 1 and not store.capabilities.local_path:
        start_checks(store, prefix, [part], checked, submit)
    for o in objects:
        path, size = part.objects[o]
        full = _join(prefix, path)
        seen = _seen(store, full, size)
        with _CHECKING:
            got = checked.get(seen)
            if got is None:
                mine: Future[bool] = Future()
                checked[seen] = mine
        if got is True or (isinstance(got, Future) and got.result() is True):
            continue
        if got is not None:  # the other check failed or found holes: this tensor's own
            _check_object(store, full, path, size, part, o, key, chunk, itemsize)
            continue
        sound = False
        try:
            sound = _check_object(store, full, path, size, part, o, key, chunk, itemsize)
        finally:
            _settle(checked, seen, mine, sound)


def _settle(checked: Dict[str, Any], seen: str, mine: "Future[bool]", sound: bool) -> None:
    with _CHECKING:
        if sound:
            checked[seen] = True
        elif checked.get(seen) is mine:
            del checked[seen]
    mine.set_result(sound)


def start_checks(
    store: ByteStore,
    prefix: str,
    parts: Iterable[PackedArray],
    checked: Dict[str, Any],
    submit: Callable[..., Any],
) -> int:
    """Start the [SP-PACK-7] check (one HEAD) of every object of an object store that
    ``parts`` name and ``checked`` holds nothing for, each once and all at once through
    ``submit``; each is entered in ``checked`` as the Future its opens wait for (True: the
    object is sound; False, for any failure: each tensor's open checks it again itself and
    raises the error naming the tensor). Nothing is allocated for a tensor here, and
    nothing raised but an interrupt. At most :data:`CHECKED_KEPT` objects in all (the opens
    check any beyond). Returns how many were started."""
    if store.capabilities.local_path:  # files: the opens' lstat walk and sparse checks
        return 0
    todo: List[Tuple[str, int, str, "Future[bool]"]] = []
    done = set()
    for part in parts:
        for o in part.object_numbers():
            path, size = part.objects[o]
            full = _join(prefix, path)
            seen = _seen(store, full, size)
            if seen in done:
                continue
            done.add(seen)
            with _CHECKING:
                if seen in checked or len(checked) >= CHECKED_KEPT:
                    continue
                mine: Future[bool] = Future()
                checked[seen] = mine
            todo.append((full, size, seen, mine))
    for i, (full, size, seen, mine) in enumerate(todo):
        try:
            submit(_head_check, store, full, size, checked, seen, mine)
        except BaseException as e:  # a pool shut down: the opens check these themselves
            for _f, _s, seen2, mine2 in todo[i:]:
                _settle(checked, seen2, mine2, False)
            if not isinstance(e, Exception):  # an interrupt
                raise
            return i
    return len(todo)


def _head_check(
    store: ByteStore, full: str, size: int, checked: Dict[str, Any], seen: str, mine: Any
) -> None:
    """One object's [SP-PACK-7] check on an object store, for :func:`start_checks`."""
    sound = False
    try:
        info = store.head(full)
        sound = info is not None and info.size >= size
    except Exception:  # noqa: BLE001 - the open checks again and raises it, naming its tensor
        pass
    finally:
        _settle(checked, seen, mine, sound)


def _check_object(
    store: ByteStore,
    full: str,
    path: str,
    size: int,
    part: PackedArray,
    o: int,
    key: str,
    chunk: Sequence[int],
    itemsize: int,
) -> bool:
    """One object's checks (see :func:`check_objects`); False where it is sparse (each
    tensor then checks the holes of its own records)."""
    if store.capabilities.local_path:
        _lstat_walk(store, full, key, path)
    info = store.head(full)
    if info is None:
        raise _bad(key, path, "the data object is missing", "SP-READ-2")
    if info.size < size:
        raise _bad(
            key,
            path,
            f"the data object holds {info.size} bytes, the manifest declares {size} ([SP-PACK-7])",
            "SP-READ-3",
        )
    if not store.capabilities.local_path:
        return True
    from shardpoint_core.arrays.packed_sparse import check_sparse_object

    sparse = check_sparse_object(  # [SP-SEC-6]: holes checked before allocating
        store.path(full),  # type: ignore[attr-defined]
        part,
        o,
        key,
        chunk,
        itemsize,
    )
    return not sparse


def _lstat_walk(store: ByteStore, full: str, key: str, path: str) -> None:
    """[SP-SEC-5]: each directory on the way a real one, the object a regular file."""
    root = store.root  # type: ignore[attr-defined]
    p = root
    parts = full.split("/")
    for i, comp in enumerate(parts):
        p = os.path.join(p, comp)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return  # missing: head reports it as SP-READ-2
        last = i == len(parts) - 1
        if (last and not stat.S_ISREG(st.st_mode)) or (not last and not stat.S_ISDIR(st.st_mode)):
            raise _bad(
                key,
                path,
                f"{p} is not a regular {'file' if last else 'directory'} (a link or special file)",
                "SP-SEC-5",
            )
