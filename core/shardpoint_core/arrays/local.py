"""What a checkpoint on a local file system needs beyond its byte store: zarr.json created
once by whichever rank comes first (``O_EXCL``), the manifest read with a clear error saying
what a path holds instead of a checkpoint (another format, a manager's root, one array), and
the identity of a commit (its manifest's inode, time and size)."""

from __future__ import annotations

import errno
import os
from typing import Any, Optional

from shardpoint_core.format.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from shardpoint_core.stores.fsutil import makedirs_below
from shardpoint_core.format.hints import path_hint
from shardpoint_core.format.manifest import TENSOR_DIR
from shardpoint_core.format.spec import MANIFEST_NAME
from shardpoint_core.arrays.checks import check_regular_file
from shardpoint_core.arrays.packed import PACKED_DIR

MAX_MANIFEST_BYTES = 1 << 30


def create_zarr_json(root: str, apath: str, data: bytes) -> None:
    """Write ``apath/zarr.json`` unless it exists (another rank writing chunks of the same
    array created it, with the same bytes: both derive it from the manifest's layout).
    ``root`` (the staging directory) must exist: it is never re-created here."""
    makedirs_below(root, apath)
    try:
        fd = os.open(
            os.path.join(apath, "zarr.json"),
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
            0o666,
        )
    except FileExistsError:
        return
    path = os.path.join(apath, "zarr.json")
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.EIO, "short write", path)
    except OSError as e:
        if e.filename is None and e.strerror:  # name the file (a full disk's ENOSPC does not)
            raise OSError(e.errno, e.strerror, path) from e
        raise
    finally:
        os.close(fd)


def not_a_checkpoint_hint(path: str) -> str:
    """What a path given for a checkpoint holds instead, for the error: another format (with
    the command converting it), a checkpoint's manifest or one of its arrays, or ``""``."""
    norm = os.path.normpath(path)
    if os.path.basename(norm) == MANIFEST_NAME:
        return f" (the checkpoint is its directory, {os.path.dirname(path) or '.'!r})"
    # (1.4) a packed checkpoint's data directory or one of its data files (whose bytes a
    # content sniffer could take for another format's)
    top = os.path.dirname(norm)
    what, ck = ("the data directory", top) if os.path.basename(norm) == PACKED_DIR else ("", "")
    if not what and os.path.basename(top) == PACKED_DIR:
        what, ck = "a data file", os.path.dirname(top)
    if what and os.path.isfile(os.path.join(ck, MANIFEST_NAME)):
        return f" (it is {what} of the packed checkpoint {ck or '.'!r}: load that directory)"
    if os.path.isfile(os.path.join(path, "zarr.json")):
        try:
            with open(os.path.join(path, "zarr.json"), "rb") as f:
                group = b'"group"' in f.read(4096)
        except OSError:
            group = False
        if group:  # [SP-LAYOUT-5]; a save's root without its manifest is no hint
            return (
                ""
                if os.path.isdir(os.path.join(path, "tensors"))
                else (
                    " (it is a Zarr group inside a checkpoint; the checkpoint is the directory "
                    f"holding {MANIFEST_NAME})"
                )
            )
        return " (it is one tensor's Zarr array; the checkpoint is the directory holding tensors/)"
    return path_hint(path)


def refuse_non_checkpoint(path: str) -> None:
    """A directory without a manifest that is not a save cut short (it has no ``tensors/``,
    no ``packed/`` and no array): a manager's root or another parent of checkpoints (say so,
    list the newest), an empty directory, or any other directory (``/etc``). Raises
    :class:`CheckpointNotFoundError` ("no checkpoint", exit 2 in the CLI); returns for a
    directory that looks like an uncommitted save ([SP-COMMIT-3]) of either layout."""
    if not os.path.isdir(path) or any(
        os.path.isdir(os.path.join(path, d)) for d in (TENSOR_DIR, PACKED_DIR)
    ):
        return
    try:
        names = os.listdir(path)
    except OSError:
        return
    if not_a_checkpoint_hint(path):
        return  # another format: the caller's hint names it
    found = []
    for n in names:
        mp = os.path.join(path, n, MANIFEST_NAME)
        try:
            found.append((os.stat(mp).st_mtime, n))
        except OSError:
            continue
    if found:
        newest = [n for _t, n in sorted(found, reverse=True)[:3]]
        raise CheckpointNotFoundError(
            f"{path!r} is not a checkpoint but a directory of {len(found)} checkpoint(s) (a "
            f"CheckpointManager's root or a parent of checkpoints); the newest: "
            + ", ".join(repr(os.path.join(path, n)) for n in newest)
            + "; pass one of them (or use CheckpointManager(root).latest_step())"
        )
    what = "an empty directory" if not names else "a directory without a manifest.msgpack"
    raise CheckpointNotFoundError(
        f"no checkpoint at {path!r}: it is {what} and holds no shardpoint checkpoint"
    )


def read_manifest(path: str, state: str) -> bytes:
    """The manifest of the checkpoint directory ``path`` (``state``: the committer's), or
    the error saying what ``path`` is instead."""
    if state == "missing":
        raise CheckpointNotFoundError(f"no checkpoint at {path!r}: the path does not exist")
    if state == "incomplete":
        refuse_non_checkpoint(path)
        other = not_a_checkpoint_hint(path)
        if not os.path.isdir(path) or other:
            what = "a file" if not os.path.isdir(path) else "a directory"
            raise CheckpointNotFoundError(f"{path!r} is {what}, not a shardpoint checkpoint{other}")
        raise IncompleteCheckpointError(
            f"{path!r} has no {MANIFEST_NAME}: it is not a checkpoint; an unfinished save "
            "(crashed or still running) or an incomplete copy (a copy must include "
            f"{MANIFEST_NAME}, best copied last)",
            spec_id="SP-COMMIT-3",
        )
    mpath = os.path.join(path, MANIFEST_NAME)
    try:
        size = check_regular_file(path, MANIFEST_NAME, "<manifest>")
    except FileNotFoundError as e:
        raise IncompleteCheckpointError(
            f"{path!r} has no {MANIFEST_NAME}: an unfinished save or an incomplete copy",
            spec_id="SP-COMMIT-3",
        ) from e
    if size > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(
            f"manifest of {path!r} is {size} bytes, over the {MAX_MANIFEST_BYTES}-byte cap",
            spec_id="SP-SEC-2",
        )
    return read_manifest_file(mpath, size)


def read_manifest_file(mpath: str, size: int) -> bytes:
    """The bytes of the manifest file ``mpath`` of ``size`` bytes (already checked against
    the cap): its envelope's headers first, so a file that is not exactly its envelope
    (a small manifest and gigabytes of garbage, sparse or not) is refused ([SP-MAN-1])
    after a read of a few bytes, not of the file."""
    from shardpoint_core.format.manifest import check_envelope_size

    with open(mpath, "rb") as f:
        check_envelope_size(lambda at, n: os.pread(f.fileno(), n, at), size, repr(mpath))
        return f.read(MAX_MANIFEST_BYTES + 1)


def checkpoint_identity(path: str) -> Optional[list[Any]]:
    """Which commit of ``path`` is there now: its manifest's inode, modification time and
    size (a commit renames a whole new directory into place, so each commit has its own
    manifest file); None when there is none. ``load`` compares it before and after its
    reads. Host-independent fields only: ranks on several hosts compare them."""
    try:
        st = os.stat(os.path.join(path, MANIFEST_NAME))
    except OSError:
        return None
    return [st.st_ino, st.st_mtime_ns, st.st_size]
