"""``torch.save`` files as a conversion source, loaded with ``weights_only=True`` only.

``weights_only`` is PyTorch's restricted unpickler (tensors, containers, plain scalars): a file
that needs anything beyond it (a module, an ``argparse.Namespace``, a custom class) would run
arbitrary code, so it is refused with PyTorch's reason. The file is memory-mapped where its
format allows, so tensors are paged in one at a time as they are converted.
"""

from __future__ import annotations

import math
import os
import warnings
import zipfile
from typing import Any

import torch

from shardpoint.tree.leaves import handler_for, is_container
from shardpoint_core.format.errors import ConversionError, ShardpointError
from shardpoint.tools.convert.base import Source, TensorInfo, key_of


def is_torch_save(path: str) -> bool:
    return os.path.isfile(path) and (
        zipfile.is_zipfile(path) or path.endswith((".pt", ".pth", ".bin", ".ckpt"))
    )


def load_weights_only(path: str, what: str) -> Any:
    """``torch.load(weights_only=True)`` or a ConversionError carrying PyTorch's reason."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - the unpickler's refusal, reported whole
            reason = (
                str(e).split("\n\n")[0]
                if "Weights only load failed" in str(e)
                else f"{type(e).__name__}: {e}"
            )
            first = [ln for ln in str(e).splitlines() if "Unsupported global" in ln]
            if not first and not zipfile.is_zipfile(path) or "zip archive" in str(e):
                # Not a refusal of some object: the bytes are not a torch.save file at all
                # (torch.save writes a zip archive; random bytes reach the legacy unpickler).
                parts = [ln.strip() for ln in str(e).split("\n\n") if ln.strip()]
                detail = (
                    parts[1]
                    if "WeightsUnpickler" in str(e) and len(parts) > 1
                    else str(e).split(". ")[0]
                )
                raise ConversionError(
                    f"{what} is not a readable torch.save file ({detail}): damaged, truncated "
                    "or another format; --from names the format when detection guessed it "
                    "from the file name"
                ) from None
            raise ConversionError(
                f"{what} cannot be loaded with torch.load(weights_only=True), and loading it "
                f"otherwise would execute pickled code: {(first or [reason])[0].strip()}; "
                "re-save it with plain tensors, dicts, lists and scalars (e.g. vars(args) "
                "instead of an argparse.Namespace)"
            ) from None


def walk_tree(obj: Any, path: tuple, src: Source, tensors: dict) -> None:
    """Split a loaded tree into tensors (into ``tensors``), values and skipped entries. Each
    leaf is classified by its leaf handler, as ``sp.save`` classifies it
    (:func:`shardpoint.tree.leaves.handler_for`); a list or tuple that holds only values is
    one value, as DCP holds it."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if type(k) not in (str, int) or isinstance(k, bool):
                src.skipped.append(
                    (key_of(path + (str(k),)), f"dict key {k!r} is not a str or int")
                )
                continue
            walk_tree(v, path + (k,), src, tensors)
    elif isinstance(obj, (list, tuple)) and any(
        is_container(x) or handler_for(x).kind != "value" for x in obj
    ):
        for i, v in enumerate(obj):
            walk_tree(v, path + (i,), src, tensors)
    else:
        _leaf(obj, path, src, tensors)


class _Out:
    """What a leaf handler's ``flatten`` appends to (see :class:`LeafHandler`)."""

    replica = (0,)

    def __init__(self) -> None:
        self.tensors: list = []
        self.objects: list = []


def _leaf(obj: Any, path: tuple, src: Source, tensors: dict) -> None:
    """One leaf: a whole tensor (of any registered kind) is converted, a value kept, and
    what a single file cannot hold whole (a piece of a sharded tensor, a cell of a sharded
    object, a tensor the format cannot store) is skipped with the reason."""
    h = handler_for(obj)
    if h.kind == "value":
        src.values[path] = obj
        return
    out, key = _Out(), key_of(path)
    try:
        h.flatten(obj, key, f"{h.kind} {key!r}", out)
    except ShardpointError as e:
        src.skipped.append((key, str(e)))
        return
    if out.objects:
        o = out.objects[0]
        if len(out.objects) != 1 or math.prod(o.count) != 1:
            src.skipped.append(
                (
                    key,
                    f"one cell of a sharded object of grid {o.count}; a "
                    "single file holds no other cell",
                )
            )
            return
        src.objects[path] = [o.value]
        return
    hs = [t.holding for t in out.tensors]
    if not hs:
        src.skipped.append((key, f"its leaf handler {h.name!r} gave no tensor"))
        return
    if len(hs) != 1 or hs[0].flat is not None or hs[0].shape != hs[0].global_shape:
        src.skipped.append(
            (
                key,
                f"a piece of a sharded tensor of global shape "
                f"{hs[0].global_shape}; a single file does not hold all of it",
            )
        )
        return
    tensors[path] = out.tensors[0].data
    src.tensors.append(TensorInfo(path, tuple(hs[0].global_shape), out.tensors[0].data.dtype))


class TorchSaveSource(Source):
    """A file written by ``torch.save`` (a state dict or any tree of tensors and scalars)."""

    def __init__(self, path: str) -> None:
        super().__init__(str(path), "torch")
        obj = load_weights_only(self.path, f"{self.path!r}")
        if isinstance(obj, torch.Tensor):
            obj = {"tensor": obj}
        if not isinstance(obj, (dict, list, tuple)):
            raise ConversionError(
                f"{self.path!r} holds a {type(obj).__name__}, not a tree of tensors"
            )
        self._tensors: dict = {}
        walk_tree(obj, (), self, self._tensors)

    def read(self, t: TensorInfo) -> torch.Tensor:
        return self._tensors[t.path].contiguous()

    def close(self) -> None:
        self._tensors.clear()
