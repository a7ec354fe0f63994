"""The stage phase of a save: which view of the caller's tensors each chunk write and each
transfer reads, named in place (sync) or copied into the staging pool (async, so the caller
may change its tensors once staging returns). What :class:`~shardpoint.api.save_job.SaveJob`'s
stage methods run.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from shardpoint.api.staging import StagingPool, copy_pairs
from shardpoint.planning.planner import RankSaveWork
from shardpoint.tree.views import PieceViews, box_view, copy_into

ChunkDtype = Callable[[str], torch.dtype]  # a tensor's key -> its chunks' torch dtype


def piece_views(tensors: Any) -> PieceViews:
    """The flat tree's tensors (its ``tensors``) as pieces to cut views from."""
    # resolve_conj/resolve_neg: a lazily conjugated or negated view has no numpy form;
    # they copy only tensors carrying those bits.
    return PieceViews(
        [(lt.holding, lt.data.detach().resolve_conj().resolve_neg()) for lt in tensors]
    )


def direct_sources(work: RankSaveWork, src: PieceViews, chunk_dtype: ChunkDtype) -> tuple:
    """Sync: ``(sources, sends)``, per chunk write the tensor to write (a view of the
    caller's tensor where one piece covers the chunk, else a buffer assembled from the local
    pieces) and per transfer ``(dst rank, view)``."""
    sources: list = []
    for cw in work.writes:
        if cw.direct is not None:
            v, off = src(*cw.direct)
            sources.append(box_view(v, off, cw.offset, cw.shape))
            continue
        buf = torch.empty(cw.shape, dtype=chunk_dtype(cw.key))
        for hidx, pidx, bo, bs in cw.local:
            v, off = src(hidx, pidx)
            copy_into(box_view(buf, cw.offset, bo, bs), box_view(v, off, bo, bs))
        sources.append(buf)
    sends: list = []
    for tr in work.sends:
        v, off = src(*tr.src_ref)
        sends.append((tr.dst, box_view(v, off, tr.box_offset, tr.box_shape)))
    return sources, sends


def pool_sources(
    work: RankSaveWork, src: PieceViews, chunk_dtype: ChunkDtype, pool: StagingPool
) -> tuple:
    """Async: ``(sources, sends, alloc seconds, pool bytes)``, every byte this rank writes or
    sends copied into buffers of ``pool``, as :func:`direct_sources` names them."""
    send_views = []
    for tr in work.sends:
        v, off = src(*tr.src_ref)
        send_views.append(box_view(v, off, tr.box_offset, tr.box_shape))
    requests = [(tuple(cw.shape), chunk_dtype(cw.key)) for cw in work.writes]
    requests += [(tuple(v.shape), v.dtype) for v in send_views]
    bufs, alloc = pool.take(requests)
    nbytes = pool.nbytes
    sources = bufs[: len(work.writes)]
    pairs = []
    for cw, buf in zip(work.writes, sources):
        if cw.direct is not None:
            v, off = src(*cw.direct)
            pairs.append((buf, box_view(v, off, cw.offset, cw.shape)))
        for hidx, pidx, bo, bs in cw.local:
            v, off = src(hidx, pidx)
            pairs.append((box_view(buf, cw.offset, bo, bs), box_view(v, off, bo, bs)))
    pairs += list(zip(bufs[len(work.writes) :], send_views))
    copy_pairs(pairs)
    sends = [(tr.dst, b) for tr, b in zip(work.sends, bufs[len(work.writes) :])]
    return sources, sends, alloc, nbytes


def recv_views(work: RankSaveWork, sources: list) -> list:
    """Per transfer this rank receives, ``(src rank, view of the chunk buffer it fills)``."""
    return [
        (
            tr.src,
            box_view(
                sources[tr.dst_ref[0]],
                work.writes[tr.dst_ref[0]].offset,
                tr.box_offset,
                tr.box_shape,
            ),
        )
        for tr in work.recvs
    ]
