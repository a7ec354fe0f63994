"""Read-only, lazy access to one checkpoint: look at one tensor (or a slice of it) of a huge
checkpoint without loading the rest.

Example::

    import shardpoint as sp
    with sp.open("ckpt/step_100") as ckpt:
        print(ckpt.keys())
        w = ckpt["model/w"]                 # nothing read yet
        print(w.shape, w.dtype)
        block = w[10:20, :4].to_torch()     # reads only the chunks holding these elements

``ckpt[key]`` is a :class:`TensorView` for a tensor, the value itself for a value, and the
list of values for a sharded object. Slicing takes ints, slices with positive steps and
``...``; a slice of a view is a view.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import numpy as np
import torch

from shardpoint.tree import dtypes
from shardpoint_core.format.errors import LoadFailedError, ShardpointError
from shardpoint_core.format.keys import decode_key, encode_key, similar_keys
from shardpoint_core.format.manifest import Manifest, TensorEntry
from shardpoint_core.format.statetree import ObjectLeaf, TensorLeaf, iter_leaves
from shardpoint_core.transactions.protocol import StorageBackend
from shardpoint_core.transactions.reader import CheckpointReader
from shardpoint.tree.views import to_numpy


class TensorView:
    """A lazily read region of one stored tensor: per dimension a ``range`` of indices, and
    which dimensions an integer index removed."""

    def __init__(
        self,
        ckpt: "Checkpoint",
        entry: TensorEntry,
        ranges: Optional[tuple] = None,
        dropped: Optional[tuple] = None,
    ) -> None:
        self._ckpt, self.entry = ckpt, entry
        self._ranges = ranges if ranges is not None else tuple(range(n) for n in entry.shape)
        self._dropped = dropped if dropped is not None else (False,) * len(entry.shape)

    @property
    def key(self) -> str:
        return self.entry.key

    @property
    def shape(self) -> tuple:
        return tuple(len(r) for r, d in zip(self._ranges, self._dropped) if not d)

    @property
    def dtype(self) -> torch.dtype:
        return dtypes.from_name(self.entry.dtype).torch

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.from_name(self.entry.dtype).itemsize

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor view")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"TensorView({self.key!r}, shape={self.shape}, dtype={self.entry.dtype})"

    def __getitem__(self, idx: Any) -> "TensorView":
        if not isinstance(idx, tuple):
            idx = (idx,)
        if sum(1 for i in idx if i is Ellipsis) > 1:
            raise IndexError("an index can only have a single ellipsis ('...')")
        live = [d for d, dr in enumerate(self._dropped) if not dr]
        if Ellipsis in idx:
            e = idx.index(Ellipsis)
            idx = idx[:e] + (slice(None),) * (len(live) - len(idx) + 1) + idx[e + 1 :]
        if len(idx) > len(live):
            raise IndexError(
                f"too many indices for {self.key!r}: {len(idx)} for a {len(live)}-d view"
            )
        ranges, dropped = list(self._ranges), list(self._dropped)
        for d, i in zip(live, idx):
            r = ranges[d]
            if isinstance(i, slice):
                if i.step is not None and i.step <= 0:
                    raise IndexError(f"{self.key!r}: slice steps must be positive")
                ranges[d] = r[i]
            elif isinstance(i, (int, np.integer)) and not isinstance(i, bool):
                if not -len(r) <= int(i) < len(r):
                    raise IndexError(
                        f"index {int(i)} is out of bounds for dimension {d} of "
                        f"{self.key!r} (size {len(r)})"
                    )
                j = r[int(i)]
                ranges[d], dropped[d] = range(j, j + 1), True
            else:
                raise TypeError(
                    f"{self.key!r}: index with ints, slices and '...', not {type(i).__name__}"
                )
        return TensorView(self._ckpt, self.entry, tuple(ranges), tuple(dropped))

    def to_torch(self) -> torch.Tensor:
        """Read the view (only the chunks it touches) into a new CPU tensor."""
        off = tuple(r.start if len(r) else 0 for r in self._ranges)
        box = tuple((r[-1] - r.start + 1) if len(r) else 0 for r in self._ranges)
        buf = torch.empty(box, dtype=self.dtype)
        if buf.numel():
            self._ckpt.read_box(self.entry, off, buf)
        sel = tuple(
            0 if dr else slice(None, None, r.step) for r, dr in zip(self._ranges, self._dropped)
        )
        return (buf[sel] if sel else buf).contiguous()

    def to_numpy(self) -> np.ndarray:
        """Read the view into a numpy array (bfloat16 and float8 as ``ml_dtypes`` types)."""
        return to_numpy(self.to_torch())

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.to_numpy()
        return a if dtype is None else a.astype(dtype)


class Checkpoint:
    """A read-only handle on one committed checkpoint (see :func:`open`); its reads go
    through a :class:`~shardpoint_core.transactions.reader.CheckpointReader`."""

    def __init__(self, path: str, backend: Optional[StorageBackend] = None) -> None:
        # the manifest with the identity of its commit, checked after each read (see load())
        self._reader = CheckpointReader.open(path, backend=backend, call="open")
        self.path = self._reader.path
        self.manifest: Manifest = self._reader.manifest
        self.tree = self.manifest.tree  # nested dicts/lists/tuples, typed leaves
        self._leaves = {encode_key(p): leaf for p, leaf in iter_leaves(self.tree)}
        self._handles: dict = {}

    def keys(self) -> list:
        """Every leaf key (tensors, values, sharded objects), in tree order."""
        return list(self._leaves)

    def tensor_keys(self) -> list:
        return [k for k, leaf in self._leaves.items() if isinstance(leaf, TensorLeaf)]

    def __iter__(self):
        return iter(self._leaves)

    def __len__(self) -> int:
        return len(self._leaves)

    def __contains__(self, key: Any) -> bool:
        return self._norm(key) in self._leaves

    @staticmethod
    def _norm(key: Union[str, tuple]) -> str:
        return encode_key(key) if isinstance(key, tuple) else key

    def __getitem__(self, key: Union[str, tuple]) -> Any:
        k = self._norm(key)
        node = self._leaves.get(k)
        if node is None:
            near = [x for x in self._leaves if x.startswith(k.rstrip("/") + "/")][:5]
            like = [] if near else similar_keys(k, self._leaves)
            raise KeyError(
                f"{k!r} is not a key of {self.path!r}"
                + (f"; keys under it: {near}" if near else "")
                + (f"; similar keys: {like}" if like else "")
            )
        if isinstance(node, TensorLeaf):  # its entry, as the manifest's table types it
            return TensorView(self, self.manifest.tensors[node.entry.key])
        if isinstance(node, ObjectLeaf):
            return list(node.values)
        return node.value

    def read_box(self, e: TensorEntry, offset: tuple, out: torch.Tensor) -> None:
        """Fill ``out`` with the box of ``e`` at ``offset`` (reads the chunks it touches)."""
        r = self._reader
        if e.key not in self._handles:
            decode_key(e.key)
            self._handles[e.key] = r.array(e.key)
        try:
            r.wait([r.read_into(self._handles[e.key], offset, to_numpy(out))])
        except ShardpointError as err:
            # bytes of a newer save under the manifest read then fail their checks (a chunk
            # table, a size): the replacement is the cause to report, not damage
            self._check_unchanged(e, err)
            raise
        self._check_unchanged(e)

    def _check_unchanged(self, e: TensorEntry, cause: Optional[BaseException] = None) -> None:
        if not self._reader.unchanged():
            raise LoadFailedError(
                f"the checkpoint at {self.path!r} was replaced (or removed) by another save "
                f"since it was opened, so {e.key!r} read now would not belong to the manifest "
                "read then: open it again",
                spec_id="SP-COMMIT-14",
            ) from cause

    def close(self) -> None:
        """Drop the open arrays (and what the backend kept for them); reads still work,
        opening them again."""
        self._handles.clear()
        self._reader.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Checkpoint({self.path!r}: {len(self.manifest.tensors)} tensors, "
            f"{len(self._leaves)} keys)"
        )


def open(path: str, *, backend: Optional[StorageBackend] = None) -> Checkpoint:  # noqa: A001
    """A read-only, lazy handle on the checkpoint at ``path`` (nothing but the manifest is
    read until a tensor view is read)."""
    return Checkpoint(path, backend)
