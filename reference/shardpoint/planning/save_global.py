"""The save plan as one message for every rank: who writes which chunk, the local copies and
the transfers, in columns; each rank cuts its own :class:`~.plans.RankSaveWork` from it.

Per-rank replies carry each transfer twice (its sender's and its receiver's) and the
coordinator encodes one per rank; this message is encoded once and broadcast, as the load's
dedup plan is (:func:`~.load_dedup.encode_global`).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Optional

import msgpack
import numpy as np

from shardpoint.planning.plans import ChunkWrite, RankSaveWork, Transfer, pack_ints, unpack_ints

SAVE_GLOBAL_TAG = "saveplan2"
# zlib level of the message: 6 is within ~15% of 9's size for a quarter of its time on the
# coordinator (the simulated 4,096-rank job's plan); 1 is nearly twice 6's size
SAVE_ZLIB_LEVEL = 6


@dataclass
class SaveColumns:
    """A save plan's writes and transfers as integer columns, in plan order. Keys are
    positions in ``sorted(tensors)``; boxes are ``D`` wide (offsets padded with 0, shapes
    with 1). Chunks: ``c_key``, ``c_writer``, ``c_dh``/``c_dp`` (the writer's holding and
    piece whose view covers the chunk, -1 if none), ``c_off``/``c_shp``. Local copies:
    ``l_chunk`` (non-decreasing), ``l_hold``, ``l_piece``, ``l_bo``/``l_bs``. Transfers:
    ``t_chunk`` (non-decreasing; the receiver is the chunk's writer), ``t_src``, ``t_hold``,
    ``t_piece``, ``t_bo``/``t_bs``. ``cr_rank``/``cr_key``: empty arrays a rank creates."""

    D: int
    c_key: np.ndarray
    c_writer: np.ndarray
    c_dh: np.ndarray
    c_dp: np.ndarray
    c_off: np.ndarray
    c_shp: np.ndarray
    l_chunk: np.ndarray
    l_hold: np.ndarray
    l_piece: np.ndarray
    l_bo: np.ndarray
    l_bs: np.ndarray
    t_chunk: np.ndarray
    t_src: np.ndarray
    t_hold: np.ndarray
    t_piece: np.ndarray
    t_bo: np.ndarray
    t_bs: np.ndarray
    cr_rank: np.ndarray
    cr_key: np.ndarray


_VEC = ("c_key", "c_dh", "c_dp", "l_hold", "l_piece", "t_hold", "t_piece", "cr_rank", "cr_key")
# sent as differences from the row before: non-decreasing (chunks), or stepping regularly
# (writers and senders take turns among a region's holders)
_DELTA = ("l_chunk", "t_chunk", "c_writer", "t_src")
_BOX = ("c_off", "c_shp", "l_bo", "l_bs", "t_bo", "t_bs")


def _pack_col(a: np.ndarray) -> list:
    return pack_ints(np.asarray(a, np.int64).reshape(1, -1))


def _pack_box(a: np.ndarray, D: int) -> list:
    # column by column (each dimension's values together): compresses better than rows
    a = np.asarray(a, np.int64)
    return pack_ints(np.ascontiguousarray(a.reshape(a.shape[0], D).T))


def encode_save_global(cols: SaveColumns, layouts: dict, stats: dict, staging: str) -> bytes:
    """The one message every rank gets: ``zlib(msgpack([tag, D, staging, layouts, stats,
    columns...]))``; ``layouts``: key -> ``[shape, dtype, chunk shape]`` (every key of the
    plan); columns as :func:`~.plans.pack_ints` tables in their narrowest types, some as
    differences, box offsets relative to their chunk's."""
    D = cols.D
    v = {n: getattr(cols, n) for n in _VEC + _BOX}
    v.update((n, np.diff(getattr(cols, n), prepend=0)) for n in _DELTA)
    # box offsets relative to their chunk's, chunk offsets as differences: a model's chunk
    # grids and pieces repeat, and zlib finds the repeats in small numbers
    v["l_bo"] = cols.l_bo - cols.c_off[cols.l_chunk]
    v["t_bo"] = cols.t_bo - cols.c_off[cols.t_chunk]
    v["c_off"] = np.diff(cols.c_off, axis=0, prepend=np.zeros((1, D), np.int64))
    body = [SAVE_GLOBAL_TAG, D, staging, [[k, *layouts[k]] for k in sorted(layouts)], stats]
    body += [_pack_col(v[n]) for n in _VEC + _DELTA]
    body += [_pack_box(v[n], D) for n in _BOX]
    return zlib.compress(msgpack.packb(body), SAVE_ZLIB_LEVEL)


def decode_save_global(msg: bytes) -> tuple:
    """``(staging, layouts, stats, SaveColumns)`` of :func:`encode_save_global`'s message."""
    body = msgpack.unpackb(zlib.decompress(msg), strict_map_key=False)
    if not body or body[0] != SAVE_GLOBAL_TAG:
        raise ValueError(f"not a save plan message (tag {body[0] if body else body!r})")
    _, D, staging, lays, stats = body[:5]
    rest = body[5:]
    vals: dict = {}
    for n, w in zip(_VEC, rest):
        vals[n] = unpack_ints(w).reshape(-1)
    rest = rest[len(_VEC) :]
    for n, w in zip(_DELTA, rest):
        vals[n] = np.cumsum(unpack_ints(w).reshape(-1))
    rest = rest[len(_DELTA) :]
    for n, w in zip(_BOX, rest):
        vals[n] = (
            np.ascontiguousarray(unpack_ints(w).T)
            if D
            else np.zeros(
                (len(vals[{"c": "c_key", "l": "l_hold", "t": "t_src"}[n[0]]]), 0), np.int64
            )
        )
    vals["c_off"] = np.cumsum(vals["c_off"], axis=0)
    vals["l_bo"] = vals["l_bo"] + vals["c_off"][vals["l_chunk"]]
    vals["t_bo"] = vals["t_bo"] + vals["c_off"][vals["t_chunk"]]
    layouts = {k: [s, d, c] for k, s, d, c in lays}
    return staging, layouts, stats, SaveColumns(D, **vals)


def save_work_from_global(msg: bytes, rank: int) -> tuple:
    """``(staging, layouts, stats, RankSaveWork)`` for ``rank``, cut from
    :func:`encode_save_global`'s message: the same work the per-rank reply carried."""
    staging, layouts, stats, cols = decode_save_global(msg)
    names = sorted(layouts)
    nds = [len(layouts[k][0]) for k in names]
    return staging, layouts, stats, cut_save_work(cols, rank, names, nds)


def cut_save_work(cols: SaveColumns, rank: int, names: list, nds: list) -> RankSaveWork:
    """Rank ``rank``'s writes (plan order), sends and receives (plan order, the exchange's)
    and arrays to create, from the columns; ``names``/``nds``: each key position's name and
    number of dimensions. Pure."""
    writer = cols.c_writer
    mine = np.flatnonzero(writer == rank)
    pos = np.full(len(writer), -1, np.int64)
    pos[mine] = np.arange(len(mine))
    # local copies of my chunks, grouped by chunk (l_chunk is non-decreasing)
    lsel = (
        np.flatnonzero(writer[cols.l_chunk] == rank) if len(cols.l_chunk) else np.zeros(0, np.int64)
    )
    local: dict = {}
    if len(lsel):
        lc = cols.l_chunk[lsel].tolist()
        lk = cols.c_key[cols.l_chunk[lsel]].tolist()
        for c, k, h, p, bo, bs in zip(
            lc,
            lk,
            cols.l_hold[lsel].tolist(),
            cols.l_piece[lsel].tolist(),
            cols.l_bo[lsel].tolist(),
            cols.l_bs[lsel].tolist(),
        ):
            nd = nds[k]
            local.setdefault(c, []).append((h, p, tuple(bo[:nd]), tuple(bs[:nd])))
    writes = []
    for c, k, dh, dp, o, s in zip(
        mine.tolist(),
        cols.c_key[mine].tolist(),
        cols.c_dh[mine].tolist(),
        cols.c_dp[mine].tolist(),
        cols.c_off[mine].tolist(),
        cols.c_shp[mine].tolist(),
    ):
        nd = nds[k]
        writes.append(
            ChunkWrite(
                names[k],
                tuple(o[:nd]),
                tuple(s[:nd]),
                None if dh < 0 else (dh, dp),
                local.get(c, []),
            )
        )
    tw = writer[cols.t_chunk] if len(cols.t_chunk) else np.zeros(0, np.int64)
    recv_i = np.flatnonzero(tw == rank)
    send_i = np.flatnonzero(cols.t_src == rank)
    # a send's destination ref: the chunk's index among its writer's writes
    dref = np.zeros(len(send_i), np.int64)
    if len(send_i):
        sc = cols.t_chunk[send_i]
        ws = np.unique(writer[sc])
        sub = np.flatnonzero(np.isin(writer, ws))
        order = np.argsort(writer[sub], kind="stable")
        sw = writer[sub][order]
        start = np.searchsorted(sw, sw, side="left")
        widx = np.empty(len(writer), np.int64)
        widx[sub[order]] = np.arange(len(sub)) - start
        dref = widx[sc]

    def transfers(ix: np.ndarray, dst_ref: np.ndarray) -> list:
        ch = cols.t_chunk[ix]
        out = []
        for s, d, k, h, p, bo, bs, r in zip(
            cols.t_src[ix].tolist(),
            writer[ch].tolist(),
            cols.c_key[ch].tolist(),
            cols.t_hold[ix].tolist(),
            cols.t_piece[ix].tolist(),
            cols.t_bo[ix].tolist(),
            cols.t_bs[ix].tolist(),
            dst_ref.tolist(),
        ):
            nd = nds[k]
            out.append(Transfer(s, d, names[k], tuple(bo[:nd]), tuple(bs[:nd]), (h, p), (r,)))
        return out

    sends = transfers(send_i, dref)
    recvs = transfers(recv_i, pos[cols.t_chunk[recv_i]])
    create = [names[k] for k in cols.cr_key[cols.cr_rank == rank].tolist()]
    return RankSaveWork(writes, sends, recvs, create)


def layouts_of(tensors: dict) -> dict:
    """key -> ``[shape, dtype, chunk shape]`` (lists), the form the save's ranks use."""
    return {k: [list(v.shape), v.dtype, list(v.chunk_shape)] for k, v in tensors.items()}


def ranks_from_columns(cols: SaveColumns, names: list, nds: list, world: int) -> list:
    """Every rank's :class:`~.plans.RankSaveWork` at once (what :func:`cut_save_work` gives
    each rank), for callers that want the whole plan as objects: tests, tools. ``save()``
    never builds them on the coordinator."""
    writer = cols.c_writer
    NC = len(writer)
    ow = np.argsort(writer, kind="stable")
    cnt = np.bincount(writer, minlength=world)
    widx = np.empty(NC, np.int64)
    widx[ow] = np.arange(NC) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    local: dict = {}
    for c, k, h, p, bo, bs in zip(
        cols.l_chunk.tolist(),
        cols.c_key[cols.l_chunk].tolist(),
        cols.l_hold.tolist(),
        cols.l_piece.tolist(),
        cols.l_bo.tolist(),
        cols.l_bs.tolist(),
    ):
        nd = nds[k]
        local.setdefault(c, []).append((h, p, tuple(bo[:nd]), tuple(bs[:nd])))
    writes = []
    for c, k, dh, dp, o, s in zip(
        ow.tolist(),
        cols.c_key[ow].tolist(),
        cols.c_dh[ow].tolist(),
        cols.c_dp[ow].tolist(),
        cols.c_off[ow].tolist(),
        cols.c_shp[ow].tolist(),
    ):
        nd = nds[k]
        writes.append(
            ChunkWrite(
                names[k],
                tuple(o[:nd]),
                tuple(s[:nd]),
                None if dh < 0 else (dh, dp),
                local.get(c, []),
            )
        )
    ch = cols.t_chunk
    dst = writer[ch] if len(ch) else np.zeros(0, np.int64)
    trs = []
    for s, d, k, h, p, bo, bs, r in zip(
        cols.t_src.tolist(),
        dst.tolist(),
        cols.c_key[ch].tolist(),
        cols.t_hold.tolist(),
        cols.t_piece.tolist(),
        cols.t_bo.tolist(),
        cols.t_bs.tolist(),
        widx[ch].tolist(),
    ):
        nd = nds[k]
        trs.append(Transfer(s, d, names[k], tuple(bo[:nd]), tuple(bs[:nd]), (h, p), (r,)))

    def split(items: list, of: np.ndarray) -> list:
        """``items`` (in plan order) per rank ``of``, each rank's in plan order."""
        o = np.argsort(of, kind="stable").tolist()
        srt = [items[i] for i in o]
        e = np.cumsum(np.bincount(of, minlength=world)).tolist()
        return [srt[a:b] for a, b in zip([0] + e[:-1], e)]

    ends = np.cumsum(cnt).tolist()
    per_w = [writes[a:b] for a, b in zip([0] + ends[:-1], ends)]
    creates: list = [[] for _ in range(world)]
    for r, k in zip(cols.cr_rank.tolist(), cols.cr_key.tolist()):
        creates[r].append(names[k])
    return [
        RankSaveWork(w, sd, rv, cr)
        for w, sd, rv, cr in zip(per_w, split(trs, cols.t_src), split(trs, dst), creates)
    ]


class SavePlan:
    """The global save plan: the merged tree, each tensor's layout, the objects' values,
    the stats, and every rank's work as columns (:class:`~.save_global.SaveColumns`, which
    ``save()`` broadcasts as they are); :attr:`ranks` builds the work as objects on first use."""

    __slots__ = ("tree", "tensors", "objects", "stats", "columns", "_ranks")

    def __init__(
        self,
        tree: Any,
        tensors: dict,
        objects: dict,
        ranks: Optional[list] = None,
        stats: Optional[dict] = None,
        columns: Any = None,
    ) -> None:
        self.tree, self.tensors, self.objects = tree, tensors, objects
        self.stats = stats if stats is not None else {}
        self.columns = columns
        self._ranks = ranks

    @property
    def ranks(self) -> list:
        """[:class:`RankSaveWork`], one per rank (built from :attr:`columns` once)."""
        if self._ranks is None:
            names = sorted(self.tensors)
            self._ranks = ranks_from_columns(
                self.columns,
                names,
                [len(self.tensors[k].shape) for k in names],
                self.stats["world_size"],
            )
        return self._ranks
