"""Convert checkpoints between shardpoint and the formats people already have.

Sources: shardpoint, DCP (any saving world size), Megatron ``torch_dist``, ``torch.save``
files, safetensors (one file or a Hugging Face directory of shards). Targets: shardpoint,
DCP, safetensors. Conversion streams one tensor at a time (bounded memory), keeps every dtype
bit for bit and reports what the target cannot hold instead of dropping it silently.

Example::

    from shardpoint.convert import convert
    rep = convert("hf_model/", "ckpt/hf")              # safetensors -> shardpoint
    convert("ckpt/hf", "out/", to="safetensors", max_shard_size="2GB")
    for key, reason in rep.skipped:
        print(key, reason)
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import CheckpointNotFoundError, ConversionError
from .base import Progress, Source, TensorInfo
from .dcp import DCPSource, is_dcp, write_dcp
from .hf_safetensors import SafetensorsSource, is_safetensors, write_safetensors
from .megatron import MegatronSource, is_megatron
from .native import ShardpointSource, is_shardpoint, write_shardpoint
from .torchsave import TorchSaveSource, is_torch_save

SOURCES = ("shardpoint", "dcp", "megatron", "torch", "safetensors")
TARGETS = ("shardpoint", "dcp", "safetensors")


@dataclass
class ConvertReport:
    """What a conversion did: counts, bytes, seconds, and ``skipped`` ``(key, reason)``."""

    src: str
    dst: str
    src_format: str
    dst_format: str
    tensors: int = 0
    bytes: int = 0
    values: int = 0
    objects: int = 0
    skipped: list = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["skipped"] = [{"key": k, "reason": r} for k, r in self.skipped]
        d["seconds"] = round(self.seconds, 3)
        return d


def detect_format(path: str) -> str:
    """The source format of ``path`` (one of :data:`SOURCES`), or a clear error."""
    path = str(path)
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"no such file or directory: {path!r}")
    if os.path.isdir(path):
        if is_shardpoint(path):
            return "shardpoint"
        if is_megatron(path):
            return "megatron"
        if is_dcp(path):
            return "dcp"
        if is_safetensors(path):
            return "safetensors"
    else:
        if is_safetensors(path):
            return "safetensors"
        if is_torch_save(path):
            return "torch"
    raise ConversionError(f"cannot tell the format of {path!r}: not a shardpoint checkpoint "
                          "(manifest.msgpack), DCP (.metadata), Megatron torch_dist "
                          "(metadata.json), safetensors or torch.save file; pass --from")


def open_source(path: str, fmt: Optional[str] = None, *, skip_common: bool = False,
                backend: Any = None) -> Source:
    """A :class:`Source` reading ``path`` as ``fmt`` (detected when None)."""
    fmt = fmt or detect_format(path)
    if not os.path.exists(str(path)):
        raise CheckpointNotFoundError(f"no such file or directory: {str(path)!r}")
    if fmt == "shardpoint":
        return ShardpointSource(path, backend)
    if fmt == "dcp":
        return DCPSource(path)
    if fmt == "megatron":
        return MegatronSource(path, skip_common=skip_common)
    if fmt == "torch":
        return TorchSaveSource(path)
    if fmt == "safetensors":
        return SafetensorsSource(path)
    raise ConversionError(f"unknown source format {fmt!r}; one of {', '.join(SOURCES)}")


def target_format(dst: str, src_format: str) -> str:
    """The target format when none is given: safetensors for a ``.safetensors`` path, else
    shardpoint (from anything but shardpoint itself)."""
    if str(dst).endswith(".safetensors"):
        return "safetensors"
    if src_format == "shardpoint":
        raise ConversionError("the source is already a shardpoint checkpoint; pass --to "
                              f"({', '.join(TARGETS)})")
    return "shardpoint"


def write(src: Source, dst: str, fmt: str, *, overwrite: bool = False,
          max_shard_size: Any = None, progress: Progress = None, backend: Any = None) -> list:
    """Write an open source as ``fmt``; returns ``[(key, reason)]`` not written."""
    if max_shard_size is not None and fmt != "safetensors":
        raise ConversionError("max_shard_size (--max-shard-size) applies to safetensors only")
    if fmt == "shardpoint":
        return write_shardpoint(src, dst, overwrite=overwrite, backend=backend,
                                progress=progress)
    if fmt == "dcp":
        return write_dcp(src, dst, overwrite=overwrite, progress=progress)
    if fmt == "safetensors":
        return write_safetensors(src, dst, max_shard_size=max_shard_size, overwrite=overwrite,
                                 progress=progress)
    raise ConversionError(f"unknown target format {fmt!r}; one of {', '.join(TARGETS)}")


def convert(src: str, dst: str, *, from_: Optional[str] = None, to: Optional[str] = None,
            overwrite: bool = False, max_shard_size: Any = None, skip_common: bool = False,
            progress: Progress = None, on_open: Any = None, backend: Any = None
            ) -> ConvertReport:
    """Convert the checkpoint at ``src`` into ``dst``. ``on_open(source)`` is called once
    the source is open (the CLI sizes its progress bar there)."""
    t0 = time.perf_counter()
    with open_source(src, from_, skip_common=skip_common, backend=backend) as s:
        fmt = to or target_format(dst, s.format)
        if os.path.abspath(str(src)) == os.path.abspath(str(dst)):
            raise ConversionError("source and destination are the same path")
        if on_open:
            on_open(s)
        rep = ConvertReport(str(src), str(dst), s.format, fmt, len(s.tensors), s.total_bytes,
                            len(s.values), len(s.objects), list(s.skipped))
        rep.skipped += write(s, dst, fmt, overwrite=overwrite, max_shard_size=max_shard_size,
                             progress=progress, backend=backend)
    rep.seconds = time.perf_counter() - t0
    return rep


__all__ = ["convert", "detect_format", "open_source", "write", "ConvertReport", "Source",
           "TensorInfo", "SOURCES", "TARGETS"]
