"""Which format a path holds, and a :class:`~.base.Source` reading it: the converters'
front door, used by :func:`shardpoint.tools.convert.convert`, by the conversion workers
(:mod:`.parallel`) and by readers' error hints."""

from __future__ import annotations

import os
from typing import Any, Optional

from shardpoint_core.format.errors import CheckpointNotFoundError, ConversionError
from shardpoint.tools.convert.base import Source
from shardpoint.tools.convert.dcp import DCPSource, is_dcp
from shardpoint.tools.convert.hf_safetensors import SafetensorsSource, is_safetensors
from shardpoint.tools.convert.megatron import MegatronSource, is_megatron
from shardpoint.tools.convert.native import ShardpointSource, is_shardpoint
from shardpoint.tools.convert.orbax import OrbaxSource, is_orbax, latest_step, orbax_layout
from shardpoint.tools.convert.torchsave import TorchSaveSource, is_torch_save
from shardpoint.tools.formats import NAMES as _NAMES, SOURCES


def detect_format(path: str) -> str:
    """The source format of ``path`` (one of :data:`SOURCES`), or a clear error."""
    path = str(path)
    if "://" in path and not path.startswith("file://"):
        return "shardpoint"  # object stores (s3://) hold shardpoint checkpoints only
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"no such file or directory: {path!r}")
    if os.path.isdir(path):
        if is_shardpoint(path):
            return "shardpoint"
        if is_megatron(path):
            return "megatron"
        if is_dcp(path):
            return "dcp"
        if is_orbax(path):
            return "orbax"
        if is_safetensors(path):
            return "safetensors"
    else:
        if is_safetensors(path):
            return "safetensors"
        if is_torch_save(path):
            return "torch"
    raise ConversionError(
        f"cannot tell the format of {path!r}: not a shardpoint checkpoint "
        "(manifest.msgpack), DCP (.metadata), Megatron torch_dist "
        "(metadata.json), Orbax (_METADATA, _CHECKPOINT_METADATA), "
        "safetensors or torch.save file; pass --from"
    )


def foreign_format_hint(path: str) -> str:
    """For a path that is not a shardpoint checkpoint: ``" (it is a DCP checkpoint: ...)"``
    naming the format it does hold and the command converting it, or ``""``. Cheap (file
    names and a few header bytes), for error messages of readers given the wrong path."""
    try:
        fmt = detect_format(path)
    except (OSError, ConversionError):
        return ""
    if fmt == "shardpoint":
        return ""
    if fmt == "orbax" and orbax_layout(path) == "root":
        return (
            f" (it is an Orbax CheckpointManager directory: convert one of its steps "
            f"with `shardpoint convert {latest_step(path)} DST` or "
            "shardpoint.convert.convert)"
        )
    name = _NAMES[fmt]
    article = "an" if name[0] in "AEIOU" else "a"
    if fmt in PICKLED_METADATA:
        return (
            f" (it holds {article} {name} checkpoint: convert it with `shardpoint convert "
            f"{path} DST --trust-pickle` if you trust where it came from: its .metadata "
            "is a pickle, read by unpickling it)"
        )
    return (
        f" (it holds {article} {name} checkpoint: convert it with "
        f"`shardpoint convert {path} DST` or shardpoint.convert.convert)"
    )


PICKLED_METADATA = ("dcp", "megatron")  # formats whose metadata only unpickling reads


def open_source(
    path: str,
    fmt: Optional[str] = None,
    *,
    skip_common: bool = False,
    backend: Any = None,
    tensors_only: bool = False,
    trust_pickle: bool = False,
) -> Source:
    """A :class:`Source` reading ``path`` as ``fmt`` (detected when None). ``tensors_only``
    skips decoding DCP bytes entries (a conversion worker needs the tensors only).
    DCP and Megatron sources, whose ``.metadata`` DCP reads by unpickling it (code in it
    runs), are refused with :class:`ConversionError` unless ``trust_pickle=True``: the caller
    opts in (``--trust-pickle``) for a checkpoint it trusts."""
    fmt = fmt or detect_format(path)
    if fmt == "shardpoint" and "://" in str(path):
        return ShardpointSource(path, backend)  # s3://...: the reader says what is missing
    if not os.path.exists(str(path)):
        raise CheckpointNotFoundError(f"no such file or directory: {str(path)!r}")
    if fmt in PICKLED_METADATA and not trust_pickle:
        raise ConversionError(
            f"{str(path)!r} is a {fmt} checkpoint: its .metadata is a pickle, which DCP reads "
            "by unpickling it (code in it would run); nothing was read. Pass --trust-pickle "
            "(trust_pickle=True) only if you trust where it came from"
        )
    if fmt == "shardpoint":
        return ShardpointSource(path, backend)
    if fmt == "dcp":
        return DCPSource(path, read_bytes=not tensors_only)
    if fmt == "megatron":
        return MegatronSource(path, skip_common=skip_common, read_bytes=not tensors_only)
    if fmt == "torch":
        return TorchSaveSource(path)
    if fmt == "safetensors":
        return SafetensorsSource(path)
    if fmt == "orbax":
        return OrbaxSource(path)
    raise ConversionError(f"unknown source format {fmt!r}; one of {', '.join(SOURCES)}")
