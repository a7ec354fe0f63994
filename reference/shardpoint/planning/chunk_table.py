"""Chunks, their parts and one rank per chunk, on arrays: the core both planners share.

A *part* is the overlap of a chunk with one distinct region (:class:`~.columns.Regions`).
Tensors of equal geometry share one pattern (their parts computed once by
:func:`~.grid.chunk_part_arrays`); :func:`build_parts` lays every tensor's parts out in plan
order (keys sorted, then chunks, then parts) and :func:`elect` picks per chunk the rank that
writes (save) or reads (load) it. Python loops run per pattern, never per holder. Pure.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np

from shardpoint.planning.columns import Regions

_MIX = np.uint64(0x9E3779B97F4A7C15)


class Parts(NamedTuple):
    """Chunk rows (``c_*``, ``NC`` of them, in plan order) and part rows (``p_*``, grouped by
    chunk, in plan order); boxes padded to ``D`` dimensions (offsets 0, shapes 1).
    ``c_pat``/``c_idx``: the chunk's pattern and its index there; ``first``/``nparts``: the
    chunk's part rows; ``p_src``: the part's row in its pattern's part arrays, numbered
    across patterns (pattern ``j``'s rows first), so per-pattern tables index it."""

    D: int
    c_key: np.ndarray
    c_pat: np.ndarray
    c_idx: np.ndarray
    first: np.ndarray
    nparts: np.ndarray
    p_chunk: np.ndarray
    p_gi: np.ndarray
    p_pi: np.ndarray
    p_bo: np.ndarray
    p_bs: np.ndarray
    p_cnt: np.ndarray
    p_src: np.ndarray
    patterns: list


def pad_boxes(a: np.ndarray, D: int, fill: int) -> np.ndarray:
    n, nd = a.shape
    return a if nd >= D else np.hstack([a, np.full((n, D - nd), fill, np.int64)])


def build_parts(order: Sequence[tuple], D: int, pattern: Callable) -> Parts:
    """``order``: ``(key id, region ids)`` in plan order; ``pattern(key id, region ids)`` ->
    ``(pattern key, chunk_part_arrays(...))`` (computed once per pattern key)."""
    pats: dict = {}
    pat_list: list = []
    users: dict = {}
    nchunks = []
    for pos, (k, gis) in enumerate(order):
        pkey, make = pattern(k, gis)
        j = pats.get(pkey)
        if j is None:
            pc, li, pi, lo, ext, cnt, coff, cshp = make()
            j = pats[pkey] = len(pat_list)
            pat_list.append(
                (
                    pc,
                    li,
                    pi,
                    pad_boxes(lo, D, 0),
                    pad_boxes(ext, D, 1),
                    cnt,
                    pad_boxes(coff, D, 0),
                    pad_boxes(cshp, D, 1),
                )
            )
            users[j] = []
        users[j].append((pos, k, gis))
        nchunks.append(len(pat_list[j][6]))
    base = np.concatenate([[0], np.cumsum(np.array(nchunks, np.int64))]).astype(np.int64)
    NC = int(base[-1])
    cols: dict = {n: [] for n in ("chunk", "gi", "pi", "bo", "bs", "cnt", "src")}
    pbase = np.cumsum([0] + [len(p[0]) for p in pat_list]).tolist()
    c_key = np.zeros(NC, np.int64)
    c_pat = np.zeros(NC, np.int64)
    c_idx = np.zeros(NC, np.int64)
    for j, us in users.items():
        pc, li, pi, lo, ext, cnt, coff, _ = pat_list[j]
        K, C = len(us), len(coff)
        b = base[[u[0] for u in us]]
        G = np.array([u[2] for u in us], np.int64).reshape(K, -1)
        cols["chunk"].append((b[:, None] + pc[None, :]).ravel())
        cols["gi"].append(G[:, li].ravel())
        cols["pi"].append(np.tile(pi, K))
        cols["bo"].append(np.tile(lo, (K, 1)))
        cols["bs"].append(np.tile(ext, (K, 1)))
        cols["cnt"].append(np.tile(cnt, K))
        cols["src"].append(np.tile(np.arange(pbase[j], pbase[j + 1], dtype=np.int64), K))
        ids = (b[:, None] + np.arange(C)[None, :]).ravel()
        c_key[ids] = np.repeat(np.array([u[1] for u in us], np.int64), C)
        c_pat[ids] = j
        c_idx[ids] = np.tile(np.arange(C), K)
    cat = {
        n: (np.concatenate(v) if v else np.zeros((0, D) if n in ("bo", "bs") else 0, np.int64))
        for n, v in cols.items()
    }
    o = np.argsort(cat["chunk"], kind="stable")
    p_chunk = cat["chunk"][o]
    nparts = np.bincount(p_chunk, minlength=NC).astype(np.int64)
    return Parts(
        D,
        c_key,
        c_pat,
        c_idx,
        np.cumsum(nparts) - nparts,
        nparts,
        p_chunk,
        cat["gi"][o],
        cat["pi"][o],
        cat["bo"][o],
        cat["bs"][o],
        cat["cnt"][o],
        cat["src"][o],
        pat_list,
    )


def expand(rows: np.ndarray, first: np.ndarray, count: np.ndarray) -> tuple:
    """Each row repeated ``count`` times, with ``first, first + 1, ...`` beside it."""
    e_row = np.repeat(rows, count)
    cum = np.cumsum(count) - count
    e_pos = np.arange(len(e_row)) - np.repeat(cum, count) + np.repeat(first, count)
    return e_row, e_pos


def elect(t: Parts, regions: Regions, world: int, c_bytes: np.ndarray) -> tuple:
    """One rank per chunk among those holding most of it: ``(rank, entry)`` per chunk,
    ``entry`` the chosen holder row of a one-part chunk's region (-1 otherwise).

    A chunk of several parts goes, in turn by chunk number, to one of the ranks holding most
    of it; a chunk with one holder to that holder. Then the chunks of replicated regions are
    dealt to their holders (there and back, like cards), biggest first, per set of holders,
    the least busy holder first: data-parallel replicas share the work evenly.
    """
    NC = len(t.c_key)
    start = np.asarray(regions.start, np.int64)
    hold_rank = regions.hold_rank
    nh = np.diff(start)
    rank = np.zeros(NC, np.int64)
    entry = np.full(NC, -1, np.int64)
    one = t.nparts == 1
    many = ~one & (t.nparts > 0)
    if many.any():
        pm = np.flatnonzero(many[t.p_chunk])
        e_part, e_entry = expand(pm, start[t.p_gi[pm]], nh[t.p_gi[pm]])
        u, inv = np.unique(t.p_chunk[e_part] * world + hold_rank[e_entry], return_inverse=True)
        held = np.bincount(inv.ravel(), weights=t.p_cnt[e_part])
        uc, ur = u // world, u % world
        new = np.concatenate([[True], uc[1:] != uc[:-1]])
        cb = np.flatnonzero(new)
        gid = np.cumsum(new) - 1
        cand = held == np.maximum.reduceat(held, cb)[gid]
        ci = cand.astype(np.int64)
        cs = np.cumsum(ci)
        pos = cs - 1 - (cs - ci)[cb][gid]  # index among the chunk's candidates
        pick = uc[cb] % np.add.reduceat(ci, cb)
        sel = cand & (pos == pick[gid])
        rank[uc[sel]] = ur[sel]
    ids1 = np.flatnonzero(one)
    g1 = t.p_gi[t.first[ids1]]
    n1 = nh[g1]
    solo = n1 == 1
    entry[ids1[solo]] = start[g1[solo]]
    rank[ids1[solo]] = hold_rank[start[g1[solo]]]
    # what each rank has to do already, so the shared chunks go to the least busy first
    forced = many.copy()
    forced[ids1[solo]] = True
    busy = np.bincount(rank[forced], weights=c_bytes[forced], minlength=world)
    ids1, g1, n1 = ids1[~solo], g1[~solo], n1[~solo]
    hsig = (
        np.add.reduceat((hold_rank.astype(np.uint64) + np.uint64(1)) * _MIX, start[:-1])
        if len(nh)
        else np.zeros(0, np.uint64)
    )
    s1 = hsig[g1] ^ n1.astype(np.uint64)
    o1 = np.lexsort((ids1, -c_bytes[ids1], s1))
    ss = s1[o1]
    brk = np.concatenate([[True], ss[1:] != ss[:-1]]) if len(o1) else np.zeros(0, bool)
    grp = np.maximum.accumulate(np.where(brk, np.arange(len(o1)), 0))
    seq = np.empty(len(o1), np.int64)
    seq[o1] = np.arange(len(o1)) - grp
    lap, at = np.divmod(seq, np.maximum(n1, 1))
    at = np.where(lap % 2 == 1, n1 - 1 - at, at)  # snake order: every other lap reversed
    # per holder set, its positions ordered by how busy their rank is (ties: a rotation
    # derived from the set, so overlapping sets do not all start on one rank)
    turn = np.empty(len(ids1), np.int64)
    for a, b in zip(np.flatnonzero(brk).tolist(), np.flatnonzero(brk).tolist()[1:] + [len(o1)]):
        members = o1[a:b]
        g, n = int(g1[members[0]]), int(n1[members[0]])
        ranks_g = hold_rank[start[g] : start[g] + n]
        rot = (np.arange(n) - int(ss[a] % np.uint64(n))) % n
        perm = np.lexsort((rot, busy[ranks_g]))
        turn[members] = perm[at[members]]
    entry[ids1] = start[g1] + turn
    rank[ids1] = hold_rank[entry[ids1]]
    return rank, entry
