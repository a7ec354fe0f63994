"""safetensors files and Hugging Face directories (``model.safetensors.index.json`` + shards)
as a conversion source and sink.

Reading goes through the ``safetensors`` package (``safe_open``, one tensor or one block of
rows at a time). Writing streams: the header is computed from shapes and dtypes first, then
each tensor's bytes are appended in turn, so a shard never has to be in memory at once (the
package's ``save_file`` needs the whole shard as a dict). Files, index and ``__metadata__``
are laid out as Hugging Face's ``save_pretrained`` writes them.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from shardpoint_core.commit.base import Overwrite
from shardpoint_core.format.errors import ConversionError
from shardpoint.tree.views import to_numpy
from shardpoint.tools.convert.base import (
    Progress,
    Source,
    TensorInfo,
    flat_name,
    key_of,
    row_blocks,
    staged_output,
)

FORMAT = "safetensors"
INDEX_NAME = "model.safetensors.index.json"


def is_safetensors_output(path: str) -> bool:
    """Whether ``path`` is what this module writes (the only thing ``overwrite=True``
    replaces): a ``.safetensors`` file, or a directory holding only safetensors files and
    their index."""
    if os.path.islink(path):
        return False
    if os.path.isfile(path):
        return path.endswith(".safetensors")
    names = os.listdir(path) if os.path.isdir(path) else []
    return bool(names) and all(n.endswith(".safetensors") or n == INDEX_NAME for n in names)


SINGLE_NAME = "model.safetensors"

# safetensors dtype names <-> torch dtypes (the package's own table, restricted to the spec's)
ST_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
_ST_NAME = {v: k for k, v in ST_DTYPES.items()}


def is_safetensors(path: str) -> bool:
    if os.path.isdir(path):
        return any(
            n.endswith((".safetensors", ".safetensors.index.json")) for n in os.listdir(path)
        )
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{"


def _files_of(path: str) -> tuple:
    """(files in order, {name: file} from the index or None) of a file or HF directory."""
    if not os.path.isdir(path):
        return [path], None
    idx = sorted(n for n in os.listdir(path) if n.endswith(".safetensors.index.json"))
    if len(idx) > 1 and INDEX_NAME in idx:
        idx = [INDEX_NAME]
    if len(idx) > 1:
        raise ConversionError(
            f"{path!r} has several safetensors indexes {idx}; convert one "
            "file or pass a directory with one index"
        )
    if idx:
        try:
            with open(os.path.join(path, idx[0])) as f:
                wm = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConversionError(
                f"{idx[0]} in {path!r} is not a safetensors index with a 'weight_map': {e}"
            ) from None
        if not isinstance(wm, dict):
            raise ConversionError(f"{idx[0]}: 'weight_map' is not a map")
        for name, fn in wm.items():
            if (
                not isinstance(fn, str)
                or os.path.basename(fn) != fn
                or fn in (".", "..")
                or not os.path.isfile(os.path.join(path, fn))
            ):
                raise ConversionError(
                    f"{idx[0]}: tensor {name!r} is mapped to {fn!r}, which "
                    "is not a file in the same directory"
                )
        files = sorted(set(wm.values()))
        return [os.path.join(path, f) for f in files], wm
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise ConversionError(f"{path!r} has no .safetensors files")
    return [os.path.join(path, f) for f in files], None


class SafetensorsSource(Source):
    """One safetensors file, or a directory of shards (with or without an index)."""

    def __init__(self, path: str) -> None:
        try:  # an optional dependency: only reading safetensors needs it
            from safetensors import safe_open
        except ImportError:
            raise ConversionError(
                f"reading {str(path)!r} needs the safetensors package: pip "
                "install safetensors (or shardpoint[convert])"
            ) from None
        super().__init__(str(path), FORMAT)
        files, wm = _files_of(self.path)
        self._open: dict = {}
        self._where: dict = {}
        self.metadata: dict = {}
        for fn in files:
            try:
                h = safe_open(fn, framework="pt")
            except Exception as e:  # noqa: BLE001 - the package's own parse errors
                raise ConversionError(f"{fn!r} is not a readable safetensors file: {e}") from None
            self._open[fn] = h
            self.metadata.update(h.metadata() or {})
            for name in h.keys():
                if name in self._where:
                    raise ConversionError(
                        f"tensor {name!r} is in both "
                        f"{os.path.basename(self._where[name][0])} and "
                        f"{os.path.basename(fn)}"
                    )
                if wm is not None and wm.get(name) != os.path.basename(fn):
                    raise ConversionError(
                        f"tensor {name!r} is in {os.path.basename(fn)} but "
                        f"the index maps it to {wm.get(name)!r}"
                    )
                sl = h.get_slice(name)
                dt = ST_DTYPES.get(sl.get_dtype())
                if dt is None:
                    raise ConversionError(
                        f"tensor {name!r} has safetensors dtype "
                        f"{sl.get_dtype()}, which shardpoint does not define"
                    )
                t = TensorInfo((name,), tuple(sl.get_shape()), dt)
                self._where[name] = (fn, t)
                self.tensors.append(t)
        if wm is not None:
            lost = sorted(set(wm) - set(self._where))
            if lost:
                raise ConversionError(f"the index lists tensors no shard holds: {lost[:5]}")

    def read(self, t: TensorInfo) -> torch.Tensor:
        return self._open[self._where[t.path[0]][0]].get_tensor(t.path[0]).contiguous()

    def read_rows(self, t: TensorInfo, start: int, stop: int) -> torch.Tensor:
        if not t.shape:
            return self.read(t)
        sl = self._open[self._where[t.path[0]][0]].get_slice(t.path[0])
        return sl[start:stop].contiguous()

    def close(self) -> None:
        self._open.clear()


def parse_size(s: Any, what: str = "max shard size") -> int:
    """'5GB' (10**9), '2GiB' (2**30), '500MB', '100KiB' or a plain int of bytes."""
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(s), re.I)
    if not m:
        raise ConversionError(f"{what} {s!r} is not a size like 5GB, 2GiB or 500MB")
    unit = (m.group(2) or "B").upper()
    mult = 1
    if unit != "B":
        mult = (1024 if "I" in unit else 1000) ** ("KMGT".index(unit[0]) + 1)
    return int(float(m.group(1)) * mult)


def _shards(tensors: list, max_size: Optional[int]) -> list:
    """Split tensors into shards as Hugging Face does: in order, a new shard when the next
    tensor would push the current one past ``max_size`` (a bigger tensor gets its own)."""
    shards: list = [[]]
    size = 0
    for t in tensors:
        if max_size is not None and shards[-1] and size + t.nbytes > max_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def file_layout(items: list) -> tuple:
    """The header bytes of a safetensors file of ``items`` ``[(name, TensorInfo)]`` and where
    each tensor's data starts in the file (the same bytes whoever writes them)."""
    hdr: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, t in items:
        hdr[name] = {
            "dtype": _ST_NAME[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [off, off + t.nbytes],
        }
        off += t.nbytes
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    raw = struct.pack("<Q", len(raw)) + raw
    return raw, {name: len(raw) + hdr[name]["data_offsets"][0] for name, _ in items}


def write_rows_at(
    f: Any,
    src: Source,
    name: str,
    t: TensorInfo,
    start: int,
    stop: int,
    offset: int,
    progress: Progress,
) -> None:
    """Write rows ``start:stop`` of ``t`` into the open file ``f``, whose data for ``t``
    starts at ``offset``, a block of rows at a time."""
    row = math.prod(t.shape[1:]) * t.itemsize if t.shape else t.nbytes
    f.seek(offset + start * row)
    for lo, hi in row_blocks(t):
        lo, hi = max(lo, start), min(hi, stop) if t.shape else hi
        if t.shape and lo >= hi:
            continue
        data = src.read_rows(t, lo, hi)
        want = ((hi - lo,) + tuple(t.shape[1:])) if t.shape else ()
        if tuple(data.shape) != want or data.dtype != t.dtype:
            raise ConversionError(
                f"tensor {name!r}: the source read {data.dtype}"
                f"{list(data.shape)} for rows {lo}:{hi}, its "
                f"metadata says {t.dtype}{list(t.shape)}"
            )
        if data.numel():
            f.write(memoryview(to_numpy(data.contiguous()).reshape(-1).view(np.uint8)))
        if progress:
            progress(data.numel() * data.element_size())
        del data


def _write_file(fn: str, src: Source, items: list, progress: Progress) -> None:
    header, offsets = file_layout(items)
    with open(fn, "wb") as f:
        f.write(header)
        for name, t in items:
            write_rows_at(f, src, name, t, 0, t.shape[0] if t.shape else 0, offsets[name], progress)
        f.flush()
        os.fsync(f.fileno())


@dataclass
class FilesPlan:
    """The files a safetensors conversion writes: ``[(name, [(tensor name, TensorInfo)])]``
    (name None: ``dst`` is the one file), the index (None for one file), and what is not
    written ``[(key, reason)]``."""

    files: list
    index: Optional[dict]
    is_dir: bool
    skipped: list


def plan_files(src: Source, dst: str, max_shard_size: Any = None) -> FilesPlan:
    """Lay ``src`` out as Hugging Face does (see :func:`write_safetensors`). No I/O."""
    names: dict = {}
    for t in src.tensors:
        name = flat_name(t.path)
        if name in names:
            raise ConversionError(
                f"tensors {key_of(names[name].path)!r} and {t.key!r} would "
                f"both be named {name!r} in safetensors"
            )
        if t.dtype not in _ST_NAME:
            raise ConversionError(
                f"tensor {t.key!r} has dtype {t.dtype}, which safetensors cannot hold"
            )
        names[name] = t
    skipped = [(key_of(p), "a value: safetensors holds tensors only") for p in src.values]
    skipped += [
        (key_of(p), "a sharded object: safetensors holds tensors only") for p in src.objects
    ]
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    items = list(names.items())
    shards = _shards([t for _, t in items], limit)
    by_t = {id(t): n for n, t in items}
    if str(dst).endswith(".safetensors"):
        if len(shards) > 1:
            raise ConversionError(
                f"{len(shards)} shards of at most {max_shard_size} do not "
                f"fit the single file {dst!r}; give a directory instead"
            )
        return FilesPlan([(None, items)], None, False, skipped)
    if len(shards) == 1:
        return FilesPlan([(SINGLE_NAME, items)], None, True, skipped)
    n = len(shards)
    files, wm = [], {}
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = [(by_t[id(t)], t) for t in shard]
        files.append((fn, part))
        wm.update({name: fn for name, _ in part})
    index = {
        "metadata": {"total_size": sum(t.nbytes for _, t in items)},
        "weight_map": dict(sorted(wm.items())),
    }
    return FilesPlan(files, index, True, skipped)


def write_index(root: str, index: dict) -> None:
    """``model.safetensors.index.json`` in ``root``, durably."""
    with open(os.path.join(root, INDEX_NAME), "w") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_safetensors(
    src: Source,
    dst: str,
    *,
    max_shard_size: Any = None,
    overwrite: Overwrite = False,
    progress: Progress = None,
) -> list:
    """Write ``src`` as one safetensors file (``dst`` ending in ``.safetensors``) or a
    Hugging Face directory (``model.safetensors``, or shards plus
    ``model.safetensors.index.json`` when ``max_shard_size`` splits it). Values and objects
    have no place in safetensors: they are returned as ``[(key, reason)]``."""
    plan = plan_files(src, dst, max_shard_size)
    with staged_output(
        dst, overwrite, is_dir=plan.is_dir, is_output=is_safetensors_output, protect=(src.path,)
    ) as tmp:
        for fn, items in plan.files:
            _write_file(tmp if fn is None else os.path.join(tmp, fn), src, items, progress)
        if plan.index is not None:
            write_index(tmp, plan.index)
        src.check_unchanged()  # nothing built from two checkpoints is published
    return plan.skipped
