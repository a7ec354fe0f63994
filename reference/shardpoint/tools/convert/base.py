"""What every format module of :mod:`shardpoint.tools.convert` provides: a :class:`Source` that lists
tensors (path, shape, dtype) and reads them one at a time, and sinks that pull from a source.

Tensors are identified by their *tree path* (a tuple of str/int components): shardpoint keys
are ``encode_key(path)``, flat formats (safetensors, Megatron) use one-component paths so
their names are kept as they are. Memory stays bounded because a sink asks for one tensor
(or one block of rows) at a time and lets it go before the next.
"""

from __future__ import annotations

import math
import os
import secrets
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from shardpoint.tree import dtypes
from shardpoint_core.commit.base import Overwrite
from shardpoint_core.commit.posix import PosixCommitter
from shardpoint_core.format.errors import CheckpointExistsError, ConversionError, SaveFailedError
from shardpoint_core.stores.fsutil import fsync_dir
from shardpoint_core.format.keys import encode_key

Progress = Optional[Callable[[int], None]]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a source: where it sits in the tree, its global shape and dtype."""

    path: tuple
    shape: tuple
    dtype: torch.dtype

    @property
    def key(self) -> str:
        return key_of(self.path)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def key_of(path: tuple) -> str:
    """The shardpoint key of a path (for messages and diff output); falls back to repr."""
    try:
        return encode_key(path)
    except Exception:  # noqa: BLE001 - only used for display
        return repr(path)


def flat_name(path: tuple) -> str:
    """The name a flat format (safetensors, DCP FQN) gives a path: components joined by '.'."""
    return ".".join(str(c) for c in path)


@dataclass
class Source:
    """A readable checkpoint of some format. Subclasses fill the lists and implement
    :meth:`read`; :meth:`read_rows` defaults to slicing the whole tensor."""

    path: str
    format: str = ""
    tensors: list = field(default_factory=list)  # [TensorInfo], in the source's order
    values: dict = field(default_factory=dict)  # path -> plain value
    objects: dict = field(default_factory=dict)  # path -> [value per index]
    skipped: list = field(default_factory=list)  # [(key, reason)] entries not convertible

    def read(self, t: TensorInfo) -> torch.Tensor:
        """The whole tensor, on CPU, contiguous, in its own dtype."""
        raise NotImplementedError

    def read_rows(self, t: TensorInfo, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of dim 0 (the whole tensor for 0-d). Override to read less;
        this default reads the whole tensor once and keeps it until another is asked for."""
        last = self.__dict__.get("_last_read")
        if last is None or last[0] != t.path:
            self.__dict__["_last_read"] = None
            last = self.__dict__["_last_read"] = (t.path, self.read(t))
        return last[1] if not t.shape else last[1][start:stop]

    def check_unchanged(self) -> None:
        """Raise where the checkpoint read was replaced since it was opened (what was read
        may then mix two checkpoints); called after the last read, before anything built from
        them is published. A format that cannot tell checks nothing."""

    def close(self) -> None:
        """Release what the source holds open; a source holding nothing open has nothing to do."""

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def row_blocks(t: TensorInfo, block_bytes: int = 4 << 20) -> list:
    """``(start, stop)`` bands of dim 0 of about ``block_bytes`` each (one band for 0-d)."""
    if not t.shape:
        return [(0, 0)]
    row = max(1, math.prod(t.shape[1:]) * t.itemsize)
    step = max(1, block_bytes // row)
    return [(lo, min(t.shape[0], lo + step)) for lo in range(0, t.shape[0], step)] or [(0, 0)]


def limit_heap_growth(threshold: int = 1 << 20) -> bool:
    """Serve allocations above ``threshold`` from fresh mappings returned on free (glibc
    ``mallopt(M_MMAP_THRESHOLD)``). glibc otherwise raises that threshold each time a big
    block is freed, so tensor-sized buffers freed one after another stay on the heap and a
    streaming conversion's RSS creeps up with the checkpoint's size (measured: DCP -> shardpoint
    of 24 x 16 MiB, 195 MiB growth without, 99 MiB with). Process-wide, so the CLI calls it
    and library users may. Returns False where it does not apply (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, int(threshold)))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def die_with_parent() -> bool:
    """Have the kernel kill this process when its parent dies (Linux
    ``prctl(PR_SET_PDEATHSIG, SIGKILL)``). A conversion worker's parent is the fork server,
    which exits when the coordinator does: a killed ``convert --procs`` then leaves no worker
    writing into its staging behind it. Returns False where it does not apply."""
    import ctypes
    import signal
    import sys

    if sys.platform != "linux":
        return False
    parent = os.getppid()
    try:
        ok = ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False
    if ok and os.getppid() != parent:  # the parent died before the call took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return ok


def check_dtype(dt: torch.dtype, what: str) -> str:
    """The spec dtype name of a torch dtype, or a ConversionError naming the entry."""
    try:
        return dtypes.from_torch(dt, what).name
    except Exception as e:  # noqa: BLE001 - re-raised with the conversion's wording
        raise ConversionError(f"{what}: {e}") from None


def nest(items: Iterable[tuple], what: str = "tree") -> dict:
    """Nested dicts from ``(path, leaf)`` pairs: ``(("a", "b"), x)`` -> ``{"a": {"b": x}}``.
    A path under another leaf, or two leaves at one path, is a ConversionError."""
    root: dict = {}
    leaves: set = set()
    for path, leaf in items:
        node = root
        for i in range(len(path) - 1):
            if path[: i + 1] in leaves:
                raise ConversionError(
                    f"{what}: {key_of(path)!r} lies under "
                    f"{key_of(path[: i + 1])!r}, which is a leaf"
                )
            node = node.setdefault(path[i], {})
        if path in leaves or path[-1] in node:
            raise ConversionError(f"{what}: two entries map to {key_of(path)!r}")
        leaves.add(path)
        node[path[-1]] = leaf
    return root


def with_cli_flag(e: CheckpointExistsError) -> CheckpointExistsError:
    """``e`` naming the command-line spelling of the consent it mentions, if any."""
    text = str(e)
    if "overwrite='any'" in text:
        text += " (--overwrite-any on the command line)"
    elif "overwrite=True" in text:
        text += " (--overwrite on the command line)"
    out = CheckpointExistsError(text)
    out.spec_id = e.spec_id
    return out


@contextmanager
def staged_output(
    dst: str,
    overwrite: Overwrite,
    *,
    is_dir: bool,
    is_output: Callable[[str], bool],
    protect: Sequence[str] = (),
) -> Iterator[str]:
    """A hidden sibling to write into, published at ``dst`` by the committer when the block
    succeeds (removed when it fails), so a half-written conversion is never at ``dst``.
    ``is_output(path)``: whether what is at ``dst`` is a finished output of this format, the
    only thing ``overwrite=True`` replaces; nothing that holds a path of ``protect`` (the
    source) is ever replaced ([SP-COMMIT-5])."""
    dst = os.path.abspath(dst)
    c = PosixCommitter()
    try:
        c.check_target(dst, overwrite, protect, is_output)
    except CheckpointExistsError as e:
        raise with_cli_flag(e) from e
    token = secrets.token_hex(6)
    try:
        if is_dir:
            tmp = c.begin(dst, token)
        else:
            tmp = c.staging_for(dst, token)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
    except (OSError, SaveFailedError) as e:  # a parent that is a file, no permission
        raise ConversionError(
            f"cannot write the conversion beside {dst!r}: {e}; every "
            "parent of the destination must be a writable directory"
        ) from e
    try:
        yield tmp
        if is_dir:
            fsync_dir(tmp)  # the entries of the files written into it
        c.publish(tmp, dst, overwrite=overwrite, protect=protect, is_output=is_output)
    except BaseException:
        c.abort(tmp)
        raise
