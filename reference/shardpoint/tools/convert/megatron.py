"""Megatron-LM / Megatron-Core ``torch_dist`` checkpoints as a conversion source.

Such a directory is a DCP checkpoint (``.metadata`` + ``*.distcp``) plus ``metadata.json``
(``{"sharded_backend": "torch_dist", ...}``) and ``common.pt`` (the state that is the same on
every rank, written with ``torch.save``). Tensor keys are Megatron's sharded keys, kept as
they are (one path component each). Megatron's sharded objects are DCP bytes entries named
``<key>/shard_<offset>_<shape>``; they become shardpoint sharded objects with one value per
grid position. ``common.pt`` is loaded with ``weights_only=True`` only: when it holds more
(Megatron usually stores ``args`` as an ``argparse.Namespace``) it is refused with the reason,
unless ``skip_common`` converts the sharded state without it.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from shardpoint_core.format.errors import ConversionError
from shardpoint.tools.convert.base import key_of
from shardpoint.tools.convert.dcp import DCPSource, Unreadable
from shardpoint.tools.convert.torchsave import load_weights_only, walk_tree

FORMAT = "megatron"
_SHARD = re.compile(r"(?P<key>.+)/shard_(?P<off>\d+(?:\.\d+)*)_(?P<shape>\d+(?:\.\d+)*)\Z")


def is_megatron(path: str) -> bool:
    mj = os.path.join(path, "metadata.json")
    if not (os.path.isfile(mj) and os.path.isfile(os.path.join(path, ".metadata"))):
        return False
    try:
        with open(mj) as f:
            return json.load(f).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False


class MegatronSource(DCPSource):
    """A ``torch_dist`` checkpoint: the DCP part, sharded objects regrouped, ``common.pt``."""

    def __init__(self, path: str, *, skip_common: bool = False, **kw: Any) -> None:
        self._pieces: dict = {}
        self._common_tensors: dict = {}
        super().__init__(path, **kw)
        self.format = FORMAT
        for key, (shape, got) in self._pieces.items():
            n = math.prod(shape)
            if len(got) != n:
                self.skipped.append((key, f"sharded object has {len(got)} of {n} pieces"))
                continue
            self.objects[(key,)] = [got[i] for i in range(n)]
        common = os.path.join(self.path, "common.pt")
        if os.path.isfile(common):
            try:
                obj = load_weights_only(common, f"{common!r} (Megatron's common state)")
            except ConversionError as e:
                if not skip_common:
                    raise ConversionError(
                        f"{e}; or pass skip_common=True (--skip-common) to "
                        "convert the sharded state without it"
                    ) from None
                self.skipped.append(("common.pt", str(e)))
                return
            if not isinstance(obj, dict):
                raise ConversionError(f"{common!r} holds a {type(obj).__name__}, not a dict")
            walk_tree(obj, (), self, self._common_tensors)

    def add_bytes_entry(self, fqn: str, path: tuple, v: Any) -> None:
        m = _SHARD.match(fqn)
        if m is None or len(path) != 1:
            return super().add_bytes_entry(fqn, path, v)
        if isinstance(v, Unreadable):
            self.skipped.append((key_of(path), v.reason))
            return
        off = [int(x) for x in m["off"].split(".")]
        shape = [int(x) for x in m["shape"].split(".")]
        if len(off) != len(shape) or any(not 0 <= o < s for o, s in zip(off, shape)):
            return super().add_bytes_entry(fqn, path, v)
        idx = 0
        for o, s in zip(off, shape):
            idx = idx * s + o
        self._pieces.setdefault(m["key"], (tuple(shape), {}))[1][idx] = v

    def read(self, t: Any) -> Any:
        if t.path in self._common_tensors:
            return self._common_tensors[t.path].contiguous()
        return super().read(t)
