"""Convert checkpoints between shardpoint and the formats people already have.

Sources: shardpoint, DCP (any saving world size), Megatron ``torch_dist``, ``torch.save``
files, safetensors (one file or a Hugging Face directory of shards), Orbax (a PyTree/Standard
checkpoint or a ``CheckpointManager`` step directory; needs ``orbax-checkpoint``, imported
only then). Targets: shardpoint, DCP, safetensors. Conversion streams one tensor at a time (bounded memory), keeps every dtype
bit for bit and reports what the target cannot hold instead of dropping it silently.

Example::

    from shardpoint.tools.convert import convert
    rep = convert("hf_model/", "ckpt/hf")              # safetensors -> shardpoint
    convert("orbax_ckpts/1000", "ckpt/jax")            # an Orbax step -> shardpoint
    convert("ckpt/hf", "out/", to="safetensors", max_shard_size="2GB")
    for key, reason in rep.skipped:
        print(key, reason)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from shardpoint_core.commit.base import Overwrite, check_overwrite
from shardpoint_core.format.errors import ConversionError, SaveFailedError, ShardpointError
from shardpoint_core.stores.fsutil import os_error_text
from shardpoint.tools.convert.base import Progress, Source, TensorInfo
from shardpoint.tools.convert.dcp import write_dcp
from shardpoint.tools.convert.hf_safetensors import write_safetensors
from shardpoint.tools.convert.native import write_shardpoint
from shardpoint.tools.convert.parallel import (
    WORKER_TIMEOUT_S,
    SourceSpec,
    start_workers_early,
    write_safetensors_parallel,
    write_shardpoint_parallel,
)
from shardpoint.tools.convert.sources import (  # noqa: F401 - re-exported
    PICKLED_METADATA,
    detect_format,
    foreign_format_hint,
    open_source,
)
from shardpoint.tools.formats import SOURCES, TARGETS  # noqa: E402


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
    procs: int = 1
    worker_peak_bytes: list = field(default_factory=list)  # per worker, when procs > 1

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["skipped"] = [{"key": k, "reason": r} for k, r in self.skipped]
        d["seconds"] = round(self.seconds, 3)
        return d


def target_format(dst: str, src_format: str) -> str:
    """The target format when none is given: safetensors for a ``.safetensors`` path, else
    shardpoint (from anything but shardpoint itself)."""
    if str(dst).endswith(".safetensors"):
        return "safetensors"
    if src_format == "shardpoint":
        raise ConversionError(
            f"the source is already a shardpoint checkpoint; pass --to ({', '.join(TARGETS)})"
        )
    return "shardpoint"


def write(
    src: Source,
    dst: str,
    fmt: str,
    *,
    overwrite: Overwrite = False,
    max_shard_size: Any = None,
    progress: Progress = None,
    backend: Any = None,
    procs: int = 1,
    max_chunk_bytes: int = 256 << 20,
    worker_timeout: float = WORKER_TIMEOUT_S,
    skip_common: bool = False,
    worker_peaks: Optional[list] = None,
    trust_pickle: bool = False,
) -> list:
    """Write an open source as ``fmt``; returns ``[(key, reason)]`` not written. With
    ``procs`` > 1, that many worker processes each open the source again and write their
    share (shardpoint and safetensors targets; see :mod:`shardpoint.tools.convert.parallel`);
    ``worker_peaks`` then receives each worker's peak memory growth in bytes."""
    from shardpoint_core.stores.registry import is_local, local_path

    if not is_local(dst) and fmt != "shardpoint":
        raise ConversionError(
            f"{str(dst)!r} is on an object store, which takes shardpoint "
            f"output only (a save through the object-store commit, format.md"
            f" 9.1); convert to {fmt} into a local path"
        )
    if fmt != "shardpoint":
        dst = local_path(dst, "convert")
    if max_shard_size is not None and fmt != "safetensors":
        raise ConversionError("max_shard_size (--max-shard-size) applies to safetensors only")
    if fmt not in TARGETS:
        raise ConversionError(f"unknown target format {fmt!r}; one of {', '.join(TARGETS)}")
    if isinstance(procs, bool) or not isinstance(procs, int) or procs < 1:
        raise ConversionError(f"procs (--procs) must be a whole number >= 1, not {procs!r}")
    if (
        isinstance(max_chunk_bytes, bool)
        or not isinstance(max_chunk_bytes, int)
        or max_chunk_bytes < 1
    ):
        raise ConversionError(
            f"max_chunk_bytes (--max-chunk-size) must be a positive number "
            f"of bytes, not {max_chunk_bytes!r}"
        )
    if procs > 1:
        if fmt == "dcp":
            raise ConversionError(
                "procs (--procs) > 1 applies to shardpoint and safetensors "
                "output; DCP output is written by one process (drop --procs)"
            )
        if backend is not None:
            raise ConversionError(
                "procs (--procs) > 1 writes with the default storage "
                "backend in every worker; a backend= object cannot be "
                "shared with worker processes (drop one of the two)"
            )
        spec = SourceSpec(src.path, src.format, skip_common, trust_pickle)
        if fmt == "shardpoint":
            return write_shardpoint_parallel(
                src,
                dst,
                spec,
                procs=procs,
                overwrite=overwrite,
                progress=progress,
                max_chunk_bytes=max_chunk_bytes,
                timeout=worker_timeout,
                worker_peaks=worker_peaks,
            )
        return write_safetensors_parallel(
            src,
            dst,
            spec,
            procs=procs,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            progress=progress,
            timeout=worker_timeout,
            worker_peaks=worker_peaks,
        )
    if fmt == "shardpoint":
        return write_shardpoint(
            src,
            dst,
            overwrite=overwrite,
            backend=backend,
            progress=progress,
            max_chunk_bytes=max_chunk_bytes,
        )
    if fmt == "dcp":
        return write_dcp(src, dst, overwrite=overwrite, progress=progress)
    return write_safetensors(
        src, dst, max_shard_size=max_shard_size, overwrite=overwrite, progress=progress
    )


def convert(
    src: str,
    dst: str,
    *,
    from_: Optional[str] = None,
    to: Optional[str] = None,
    overwrite: Overwrite = False,
    max_shard_size: Any = None,
    skip_common: bool = False,
    progress: Progress = None,
    on_open: Any = None,
    backend: Any = None,
    procs: int = 1,
    max_chunk_bytes: int = 256 << 20,
    worker_timeout: float = WORKER_TIMEOUT_S,
    trust_pickle: bool = False,
) -> ConvertReport:
    """Convert the checkpoint at ``src`` into ``dst``. ``on_open(source)`` is called once
    the source is open (the CLI sizes its progress bar there).

    A DCP or Megatron source's ``.metadata`` is a pickle that only unpickling reads (code in
    it runs): such a source is refused with :class:`ConversionError`, before anything is
    read, unless ``trust_pickle=True`` (``--trust-pickle``), as ``diff`` does.

    ``procs`` > 1 converts with that many worker processes, shared out by bytes (big tensors
    by bands of rows), each reading only its share; the result is byte for byte what one
    process writes, committed once. A worker that fails, dies or reports nothing for
    ``worker_timeout`` seconds fails the conversion, and nothing appears at ``dst``.
    ``max_chunk_bytes`` bounds a shardpoint target's chunks (and so the unit of work).
    ``overwrite=True`` replaces a finished output of the target format at ``dst`` (or an
    empty directory); ``"any"`` also another directory, deleting what it holds; a file that
    is not such an output, a directory of checkpoints and a ``dst`` holding ``src`` are never
    replaced. An object-store ``dst`` (``s3://``, ``gs://``) takes shardpoint output, written
    and published like ``sp.save`` (format.md 9.1): ``overwrite`` replaces a committed
    checkpoint only, never objects that are not one ([SP-COMMIT-13]); ``backend`` then serves
    the source only."""
    t0 = time.perf_counter()
    from shardpoint_core.stores.registry import check_path, is_local, local_path

    overwrite = check_overwrite(overwrite)  # one type on every target, before any I/O
    if is_local(dst):
        dst = local_path(dst, "convert")
    else:  # s3://...: shardpoint output through the object-store commit (write())
        check_path(dst, "convert")  # a scheme nobody registered: refused, never a local dir
        dst = str(dst)
    if isinstance(procs, int) and procs > 1 and to != "dcp" and backend is None:
        start_workers_early()
    with open_source(
        src, from_, skip_common=skip_common, backend=backend, trust_pickle=trust_pickle
    ) as s:
        fmt = to or target_format(dst, s.format)
        if os.path.abspath(str(src)) == os.path.abspath(str(dst)):
            raise ConversionError("source and destination are the same path")
        if on_open:
            on_open(s)
        rep = ConvertReport(
            str(src),
            str(dst),
            s.format,
            fmt,
            len(s.tensors),
            s.total_bytes,
            len(s.values),
            len(s.objects),
            list(s.skipped),
            procs=procs,
        )
        try:
            rep.skipped += write(
                s,
                dst,
                fmt,
                overwrite=overwrite,
                max_shard_size=max_shard_size,
                progress=progress,
                backend=backend if is_local(dst) else None,  # URL: its own
                procs=procs,
                max_chunk_bytes=max_chunk_bytes,
                worker_timeout=worker_timeout,
                skip_common=skip_common,
                worker_peaks=rep.worker_peak_bytes,
                trust_pickle=trust_pickle,
            )
        except (OSError, SaveFailedError) as e:  # a full disk, a read-only one
            cause = e.__cause__ if isinstance(e, SaveFailedError) else e
            if not isinstance(cause, OSError) or isinstance(cause, ShardpointError):
                raise  # our own errors (some are OSErrors too) as they are
            # the packed writer's message names the tensor and file besides the cause and fix
            text = os_error_text(cause)
            raise ConversionError(
                f"converting {str(src)!r} to {str(dst)!r} failed: "
                f"{str(e) if text in str(e) else text}; nothing was written at "
                f"{str(dst)!r}"
            ) from e
    rep.seconds = time.perf_counter() - t0
    return rep


__all__ = [
    "convert",
    "detect_format",
    "foreign_format_hint",
    "open_source",
    "write",
    "ConvertReport",
    "Source",
    "TensorInfo",
    "SOURCES",
    "TARGETS",
]
