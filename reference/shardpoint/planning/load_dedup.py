"""The read-dedup load plan ([SP-LOAD-2]) computed on integer arrays.

A 4,096-rank load of a data-parallel job moves about a million (region, receiver) pairs, each
the same few numbers. They are planned as arrays: one row per chunk read, per part of a chunk
(its overlap with one requested region), and per (part, holder) pair, from which each rank's
:class:`~.plans.RankLoadWork` is cut on demand. Python loops run per distinct geometry
(tensors of equal shape, chunk grid and requested regions share it), never per transfer.
Pure: no I/O.
"""

from __future__ import annotations

from typing import Optional, Sequence

import msgpack
import numpy as np

from shardpoint.planning.chunk_table import build_parts, elect, expand
from shardpoint.planning.columns import Regions, gc_paused, pack_columns, unpack_columns
from shardpoint.planning.grid import chunk_part_arrays_many, region_pieces_many
from shardpoint.planning.plans import RankLoadWork, encode_load_work, narrowest_int


def _rank_dtype(world: int):
    # ranks as int16 when they fit: numpy's stable sort is a radix sort for 16-bit keys
    return np.int16 if world < 2**15 else np.int64


def _stable_order(keys: np.ndarray, world: int) -> tuple:
    """(order, starts): rows sorted by ``keys`` (ranks), stable; rank r's rows are
    ``order[starts[r]:starts[r + 1]]``."""
    order = np.argsort(keys.astype(_rank_dtype(world)), kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(keys, minlength=world))])
    return order, starts


class LoadWorks(Sequence):
    """Every rank's load work, planned as arrays; ``works[r]`` cuts rank ``r``'s
    :class:`RankLoadWork` (cached). ``read_bytes``: bytes read from storage in all;
    ``recv_bytes[r]``: bytes rank ``r`` receives."""

    def __init__(self, world: int, keys: list, ndims: list, D: int, a: dict):
        self.world, self.keys, self.ndims, self.D, self.a = world, keys, ndims, D, a
        self._cache: dict = {}
        self._pairs: Optional[tuple] = None  # made on first use (see the methods)
        self._best: Optional[tuple] = None
        self.read_bytes = int(a["read_bytes"])
        self.recv_bytes = a["recv_bytes"].tolist()

    def _orders(self) -> dict:
        """The local copies and transfers sorted by rank (what per-rank work is cut from),
        sorted on first use: a plan sent as :meth:`encode_global` never needs them."""
        a = self.a
        if "s_order" not in a:
            a["l_order"], a["l_starts"] = _stable_order(a["l_reader"], self.world)
            a["s_order"], a["s_starts"] = _stable_order(a["t_src"], self.world)
            a["v_order"], a["v_starts"] = _stable_order(a["t_dst"], self.world)
        return a

    def __len__(self) -> int:
        return self.world

    def __getitem__(self, r):
        if isinstance(r, slice):
            return [self[i] for i in range(*r.indices(self.world))]
        if r < 0:
            r += self.world
        if not 0 <= r < self.world:
            raise IndexError(r)
        w = self._cache.get(r)
        if w is None:
            w = self._cache[r] = self._cut(r)
        return w

    def __iter__(self):
        return (self[r] for r in range(self.world))

    def encode_all(self, layouts: dict) -> list:
        """Every rank's :meth:`RankLoadWork.to_bytes` message, built in one pass over the
        plan's arrays (a rank's rows are a slice of each table sorted by rank)."""
        a = self._orders()
        pos = {k: i for i, k in enumerate(sorted(layouts))}
        kmap = np.array([pos[k] for k in self.keys] or [0], np.int64)
        ch = a["read_order"]
        reads = [kmap[a["c_key"][ch]], a["c_dq"][ch], a["c_dp"][ch], a["c_lo"][ch], a["c_shp"][ch]]
        lsel = a["l_order"]
        lp = a["l_part"][lsel]
        locs = [
            a["c_ridx"][a["p_chunk"][lp]],
            a["l_q"][lsel],
            a["p_pi"][lp],
            a["p_bo"][lp],
            a["p_bs"][lp],
        ]
        tabs = [
            (reads, a["read_starts"]),
            (locs, a["l_starts"]),
            (self._transfer_cols(a["s_order"], kmap), a["s_starts"]),
            (self._transfer_cols(a["v_order"], kmap), a["v_starts"]),
        ]
        packed = []
        for cols, starts in tabs:
            lo = min((int(c.min()) for c in cols if c.size), default=0)
            hi = max((int(c.max()) for c in cols if c.size), default=0)
            t = narrowest_int(lo, hi)
            n = len(cols[0])
            w = sum(1 if c.ndim == 1 else c.shape[1] for c in cols)
            out = np.empty((n, w), t)
            j = 0
            for c in cols:
                k = 1 if c.ndim == 1 else c.shape[1]
                out[:, j : j + k] = c.reshape(n, k)
                j += k
            buf = memoryview(out.reshape(-1).view(np.uint8))
            rb = w * out.itemsize
            st = (starts * rb).tolist()
            rows = np.diff(starts).tolist()
            packed.append([(t, m, w, buf[x:y]) for m, x, y in zip(rows, st[:-1], st[1:])])
        return [
            encode_load_work(r, self.D, [list(p[r]) for p in packed]) for r in range(self.world)
        ]

    def _transfer_cols(self, sel: np.ndarray, kmap: np.ndarray) -> list:
        a = self.a
        p = a["t_part"][sel]
        c = a["p_chunk"][p]
        return [
            a["c_reader"][c],
            a["t_dst"][sel],
            kmap[a["c_key"][c]],
            a["c_ridx"][c],
            a["t_q"][sel],
            a["p_pi"][p],
            a["p_bo"][p],
            a["p_bs"][p],
        ]

    def direct_host_bytes(self, hosts: Sequence[str]) -> dict:
        """host -> bytes its ranks would read if every rank read for itself (the ``direct``
        strategy): per chunk, the most any one request of the host needs of it, in whole
        rows of the chunk (inner chunks split the first dimension)."""
        hid: dict = {}
        host_of = np.array([hid.setdefault(h, len(hid)) for h in hosts], np.int64)
        tot = self._direct_bytes_by(host_of, len(hid))
        return {h: int(tot[i]) for h, i in hid.items()}

    def direct_rank_bytes(self) -> list:
        """Per rank, the stored bytes it would read, check and narrow under ``direct``."""
        rc, best = self._rank_chunk_best()
        return (
            np.bincount(rc % self.world, weights=best, minlength=self.world)
            .astype(np.int64)
            .tolist()
        )

    def rank_traffic(self, hosts: Sequence[str], shm: bool) -> tuple:
        """Per rank under this (dedup) plan: bytes read from storage, bytes received from
        ranks on other hosts (or all, without ``shm``), bytes copied from same-host peers'
        shared memory (see host_exchange)."""
        a = self.a
        read = np.bincount(a["c_reader"], weights=a["c_bytes"], minlength=self.world)
        hid: dict = {}
        host_of = np.array([hid.setdefault(h, len(hid)) for h in hosts], np.int64)
        src = a["t_src"]  # each transfer's sender: its chunk's reader
        same = (host_of[src] == host_of[a["t_dst"]]) if shm else np.zeros(len(src), bool)
        tb = a["t_bytes"]
        cross = np.bincount(a["t_dst"][~same], weights=tb[~same], minlength=self.world)
        local = np.bincount(a["t_dst"][same], weights=tb[same], minlength=self.world)
        return ([int(x) for x in read], [int(x) for x in cross], [int(x) for x in local])

    def _direct_pairs(self) -> tuple:
        """Per (chunk, requested region, holder): the chunk, the bytes a direct read of it
        costs that holder, and the holder's rank. Computed once, shared by the per-host and
        per-rank figures."""
        if self._pairs is None:
            a = self.a
            p_chunk, p_gi = a["p_chunk"], a["p_gi"]
            G = len(a["start"]) - 1
            rows = a["p_bs"][:, 0] if self.D else np.ones(len(p_chunk), np.int64)
            # rows of a chunk one request of region g needs: its pieces' rows in that chunk
            u, inv = np.unique(p_chunk * G + p_gi, return_inverse=True)
            need = np.bincount(inv.ravel(), weights=rows).astype(np.int64)
            c, g = u // G, u % G
            full = a["c_full"][c]
            per = (
                np.ones(len(c), np.int64)
                if not self.D
                else np.minimum(need, full[:, 0]) * np.prod(full[:, 1:], axis=1)
            )
            per = per * a["c_item"][c]
            start, nh = a["start"], np.diff(a["start"])
            e_grp, e_entry = expand(np.arange(len(c)), start[g], nh[g])
            self._pairs = (c[e_grp], per[e_grp], a["hold_rank"][e_entry])
        return self._pairs

    def _rank_chunk_best(self) -> tuple:
        """Per distinct (chunk, rank) of the direct pairs, ascending: ``chunk * world + rank``
        and the most one request of that rank needs of that chunk. Grouped once (one sort of
        the pairs); the per-rank and per-host figures are both reductions of it."""
        if self._best is None:
            if not len(self.a["p_chunk"]):
                self._best = (np.zeros(0, np.int64), np.zeros(0, np.int64))
            else:
                ec, ep, er = self._direct_pairs()
                self._best = _group_max(ec * self.world + er, ep)
        return self._best

    def _direct_bytes_by(self, group_of: np.ndarray, n_groups: int) -> np.ndarray:
        """Direct-read bytes summed per group of ranks (``group_of[rank]``): per chunk, the
        most any one request within the group needs of it (the group shares its reads): the
        per-(chunk, rank) maxima reduced again per (chunk, group)."""
        rc, best = self._rank_chunk_best()
        if not len(rc):
            return np.zeros(n_groups, np.int64)
        key = (rc // self.world) * n_groups + group_of[rc % self.world]
        if (key[1:] >= key[:-1]).all():  # each group's ranks contiguous: already grouped
            cut = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
            ks, gbest = key[cut], np.maximum.reduceat(best, cut)
        else:
            ks, gbest = _group_max(key, best)
        return np.bincount(ks % n_groups, weights=gbest, minlength=n_groups).astype(np.int64)

    def _cut(self, r: int) -> RankLoadWork:
        a = self._orders()
        ch = a["read_order"][a["read_starts"][r] : a["read_starts"][r + 1]]
        reads = np.column_stack(
            [a["c_key"][ch], a["c_dq"][ch], a["c_dp"][ch], a["c_lo"][ch], a["c_shp"][ch]]
        )
        lp = a["l_part"][a["l_order"][a["l_starts"][r] : a["l_starts"][r + 1]]]
        lq = a["l_q"][a["l_order"][a["l_starts"][r] : a["l_starts"][r + 1]]]
        locs = np.column_stack(
            [a["c_ridx"][a["p_chunk"][lp]], lq, a["p_pi"][lp], a["p_bo"][lp], a["p_bs"][lp]]
        )

        def transfers(sel):
            p, c = a["t_part"][sel], a["p_chunk"][a["t_part"][sel]]
            return np.column_stack(
                [
                    a["c_reader"][c],
                    a["t_dst"][sel],
                    a["c_key"][c],
                    a["c_ridx"][c],
                    a["t_q"][sel],
                    a["p_pi"][p],
                    a["p_bo"][p],
                    a["p_bs"][p],
                ]
            )

        sends = transfers(a["s_order"][a["s_starts"][r] : a["s_starts"][r + 1]])
        recvs = transfers(a["v_order"][a["v_starts"][r] : a["v_starts"][r + 1]])
        return RankLoadWork(r, self.keys, self.ndims, self.D, reads, locs, sends, recvs)


def _group_max(key: np.ndarray, val: np.ndarray) -> tuple:
    """(distinct keys ascending, the largest ``val`` of each): one stable sort of ``key``
    (non-negative integers). The direct pairs come nearly sorted (by chunk, then by region,
    each region's holders ascending), which a stable sort (timsort) takes in a few runs;
    where every key is distinct (each rank needs a chunk through one region) the values
    are taken as they are, without a reduction."""
    o = np.argsort(key, kind="stable")
    ks = key[o]
    new = np.empty(len(ks), bool)
    new[:1] = True
    np.not_equal(ks[1:], ks[:-1], out=new[1:])
    if new.all():
        return ks, val[o]
    cut = np.flatnonzero(new)
    return ks[cut], np.maximum.reduceat(val[o], cut)


def plan_load_arrays(
    world: int, entries: list, regions: Regions, layouts: dict, itemsizes: list
) -> LoadWorks:
    """The dedup plan of the requests grouped in ``regions`` (keys ``entries``).

    Per chunk one reader among the ranks that need most of it (:func:`~.chunk_table.elect`:
    data-parallel replicas share the reads evenly). The reader reads the box spanning the
    chunk's requested parts, copies what its own requests need and sends the rest; a chunk
    needed by one request only is read straight into it.
    """
    D = max((len(e[2]) for e in entries), default=0)
    keys = [e[0] for e in entries]
    ndims = [len(e[2]) for e in entries]
    order = [
        (k, regions.by_key[k][0])
        for k in sorted(range(len(entries)), key=lambda i: entries[i][0])
        if k in regions.by_key
    ]

    # chunk geometry of each distinct (shape, chunk grid, requested regions), all at once
    pkey = {
        k: (entries[k][2], layouts[entries[k][0]].chunk_shape, regions.by_key[k][1])
        for k, _ in order
    }
    first_of: dict = {}  # geometry -> (key id, region ids) of its first tensor
    for k, gis in order:
        first_of.setdefault(pkey[k], (k, gis))
    specs = [
        (len(entries[k][2]), [regions.region(gi)[1:] for gi in gis]) for k, gis in first_of.values()
    ]
    geo = dict(
        zip(
            first_of,
            chunk_part_arrays_many(
                [(pk[0], pk[1], pa) for pk, pa in zip(first_of, region_pieces_many(specs))]
            ),
        )
    )
    t = build_parts(order, D, lambda k, _gis: (pkey[k], lambda: geo[pkey[k]]))
    NC, NP = len(t.c_key), len(t.p_chunk)
    c_key, p_chunk, p_gi, p_pi, p_bo, p_bs, first = (
        t.c_key,
        t.p_chunk,
        t.p_gi,
        t.p_pi,
        t.p_bo,
        t.p_bs,
        t.first,
    )
    item = np.array(itemsizes, np.int64)
    # read boxes: the parts' bounding box (the part itself for a one-part chunk)
    if NC:
        c_lo = np.minimum.reduceat(p_bo, first, axis=0)
        c_shp = np.maximum.reduceat(p_bo + p_bs, first, axis=0) - c_lo
    else:
        c_lo = c_shp = np.zeros((0, D), np.int64)
    c_bytes = np.prod(c_shp, axis=1) * item[c_key]
    reader, _ = elect(t, regions, world, c_bytes)
    start = np.asarray(regions.start, np.int64)
    hold_rank, hold_hidx = regions.hold_rank, regions.hold_hidx
    nh = np.diff(start)
    one = t.nparts == 1
    ids1 = np.flatnonzero(one)
    n1 = nh[p_gi[first[ids1]]]

    read_order, read_starts = _stable_order(reader, world)
    c_ridx = np.empty(NC, np.int64)
    c_ridx[read_order] = np.arange(NC) - read_starts[reader[read_order]]
    direct = np.zeros(NC, bool)
    direct[ids1[n1 == 1]] = True
    c_dq = np.full(NC, -1, np.int64)
    c_dp = np.full(NC, -1, np.int64)
    dch = np.flatnonzero(direct)
    c_dq[dch] = hold_hidx[start[p_gi[first[dch]]]]
    c_dp[dch] = p_pi[first[dch]]

    # (part, holder) pairs of the chunks not read straight into their one request
    px = np.flatnonzero(~direct[p_chunk]) if NP else np.zeros(0, np.int64)
    e_part, e_entry = expand(px, start[p_gi[px]], nh[p_gi[px]])
    e_rank = hold_rank[e_entry]
    e_reader = reader[p_chunk[e_part]]
    loc = e_rank == e_reader
    l_part, l_q = e_part[loc], hold_hidx[e_entry[loc]]
    x = ~loc
    t_part, t_dst, t_q, t_src = e_part[x], e_rank[x], hold_hidx[e_entry[x]], e_reader[x]
    # bytes per part, then per transfer (many transfers share a part: replicas)
    t_bytes = (
        (np.prod(p_bs, axis=1) * item[c_key[p_chunk]])[t_part] if NP else np.zeros(0, np.int64)
    )
    recv_bytes = np.bincount(t_dst, weights=t_bytes, minlength=world).astype(np.int64)
    a = dict(
        c_key=c_key,
        c_lo=c_lo,
        c_shp=c_shp,
        c_dq=c_dq,
        c_dp=c_dp,
        c_reader=reader,
        c_ridx=c_ridx,
        read_order=read_order,
        read_starts=read_starts,
        p_chunk=p_chunk,
        p_pi=p_pi,
        p_bo=p_bo,
        p_bs=p_bs,
        l_part=l_part,
        l_q=l_q,
        l_reader=e_reader[loc],
        t_part=t_part,
        t_dst=t_dst,
        t_q=t_q,
        t_src=t_src,
        recv_bytes=recv_bytes,
        p_gi=p_gi,
        start=start,
        hold_rank=hold_rank,
        hold_hidx=hold_hidx,
        c_item=item[c_key],
        c_full=(
            np.concatenate([p[7] for p in t.patterns])[
                np.cumsum([0] + [len(p[7]) for p in t.patterns[:-1]]).astype(np.int64)[t.c_pat]
                + t.c_idx
            ]
            if NC
            else np.zeros((0, D), np.int64)
        ),
        read_bytes=int(c_bytes.sum()),
        c_bytes=c_bytes,
        t_bytes=t_bytes,
    )
    return LoadWorks(world, keys, ndims, D, a)


GLOBAL_TAG = "loadplan2"
# zlib level of the global load plan: level 1 already shrinks it ~10x (its holder and part
# columns repeat); higher levels cost more coordinator time than they save
GLOBAL_ZLIB_LEVEL = 1


def encode_global(works: LoadWorks, layouts: dict) -> bytes:
    """The whole dedup plan as one message for every rank (``broadcast``): per chunk its key
    (a position in ``sorted(layouts)``), reader, direct target and read box; per part its
    chunk, requested region, piece and box; per region its holders (rank, request). Each
    rank cuts its own work from it (:func:`work_from_global`), so the coordinator sends this
    once instead of a million transfer rows split into per-rank messages. Tables go column
    by column, each in its narrowest type, zlib level 1 (:func:`~.columns.pack_columns`),
    with a region's holder ranks as differences (replicas' ranks are evenly spaced) and
    part rows' chunks as differences, which is what makes them compress."""
    a = works.a
    pos = {k: i for i, k in enumerate(sorted(layouts))}
    kmap = np.array([pos[k] for k in works.keys] or [0], np.int64)
    start, hr = a["start"], a["hold_rank"]
    nh = np.diff(start)
    f = start[:-1][nh > 0]
    d_hr = np.diff(hr, prepend=0) if len(hr) else hr
    d_hr[f] = hr[f]
    p_chunk = a["p_chunk"]
    tables = [
        [kmap[a["c_key"]], a["c_reader"], a["c_dq"], a["c_dp"], *a["c_lo"].T, *a["c_shp"].T],
        [
            np.diff(p_chunk, prepend=0) if len(p_chunk) else p_chunk,
            a["p_gi"],
            a["p_pi"],
            *a["p_bo"].T,
            *a["p_bs"].T,
        ],
        [nh],
        [d_hr, a["hold_hidx"]],
    ]
    return msgpack.packb(
        [GLOBAL_TAG, works.world, works.D, [pack_columns(t, GLOBAL_ZLIB_LEVEL) for t in tables]]
    )


def work_from_global(msg: bytes, rank: int, layouts: dict) -> RankLoadWork:
    """Rank ``rank``'s :class:`~.plans.RankLoadWork` cut from :func:`encode_global`'s message:
    the same rows, in the same order, as the coordinator's per-rank message
    (:meth:`LoadWorks.encode_all`) would carry (property-tested against it). Runs in the
    planning pause (:func:`~.columns.gc_paused`): its arrays are as short-lived as the
    coordinator's."""
    with gc_paused():
        return _work_from_global(msg, rank, layouts)


def _work_from_global(msg: bytes, rank: int, layouts: dict) -> RankLoadWork:
    tag, world, D, tabs = msgpack.unpackb(msg)
    if tag != GLOBAL_TAG:
        raise ValueError(f"not a global load plan message (tag {tag!r})")
    (nc, chc), (np_, ptc), (ng, (nh,)), (nhold, (d_hr, hq)) = map(unpack_columns, tabs)
    if len(chc) != 4 + 2 * D or len(ptc) != 3 + 2 * D or int(nh.sum()) != nhold:
        raise ValueError("a global load plan's tables do not fit together")
    i64 = np.int64
    ch = np.column_stack(chc).astype(i64) if nc else np.zeros((0, 4 + 2 * D), i64)
    pt = np.column_stack(ptc).astype(i64) if np_ else np.zeros((0, 3 + 2 * D), i64)
    nh, hq = nh.astype(i64), hq.astype(i64)
    start = np.concatenate([[0], np.cumsum(nh)]).astype(i64)
    cs = np.cumsum(d_hr, dtype=i64)
    base = np.zeros(ng, i64)
    f = start[:-1][nh > 0]
    base[nh > 0] = cs[f] - d_hr[f]
    hr = cs - np.repeat(base, nh)
    pt[:, 0] = np.cumsum(pt[:, 0])
    c_key, reader, c_dq = ch[:, 0], ch[:, 1], ch[:, 2]
    p_chunk, p_gi, p_pi = pt[:, 0], pt[:, 1], pt[:, 2]
    p_box = pt[:, 3:]
    NC = len(ch)
    # a chunk's index among its reader's reads (reads go in chunk order)
    o = np.argsort(reader, kind="stable")
    cnt = np.bincount(reader, minlength=world)
    c_ridx = np.empty(NC, np.int64)
    c_ridx[o] = np.arange(NC) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    direct = c_dq >= 0
    reads = ch[reader == rank][:, [0, 2, 3, *range(4, 4 + 2 * D)]]
    # the (part, holder) pairs of the chunks this rank reads, not straight into one request
    pm = np.flatnonzero((reader[p_chunk] == rank) & ~direct[p_chunk])
    e_part, e_entry = expand(pm, start[p_gi[pm]], nh[p_gi[pm]])
    loc = hr[e_entry] == rank
    lp = e_part[loc]
    locs = np.column_stack([c_ridx[p_chunk[lp]], hq[e_entry[loc]], p_pi[lp], p_box[lp]])
    sp, se = e_part[~loc], e_entry[~loc]
    sc = p_chunk[sp]
    sends = np.column_stack(
        [
            np.full(len(sp), rank, np.int64),
            hr[se],
            c_key[sc],
            c_ridx[sc],
            hq[se],
            p_pi[sp],
            p_box[sp],
        ]
    )
    # what this rank receives: the parts of the regions it requested, read by another rank
    mine = np.flatnonzero(hr == rank)
    g = np.searchsorted(start, mine, side="right") - 1
    po = np.argsort(p_gi, kind="stable")
    pcnt = np.bincount(p_gi, minlength=len(nh))
    pstart = np.cumsum(pcnt) - pcnt
    e_idx, at = expand(mine, pstart[g], pcnt[g])
    rp = po[at]
    rc = p_chunk[rp]
    keep = ~direct[rc] & (reader[rc] != rank)
    rp, rc, e_idx = rp[keep], rc[keep], e_idx[keep]
    srt = np.lexsort((e_idx, rp))  # in plan order: by part, then by holder
    rp, rc, e_idx = rp[srt], rc[srt], e_idx[srt]
    recvs = np.column_stack(
        [
            reader[rc],
            np.full(len(rp), rank, np.int64),
            c_key[rc],
            c_ridx[rc],
            hq[e_idx],
            p_pi[rp],
            p_box[rp],
        ]
    )
    keys = sorted(layouts)
    return RankLoadWork(
        rank, keys, [len(layouts[k].shape) for k in keys], D, reads, locs, sends, recvs
    )
