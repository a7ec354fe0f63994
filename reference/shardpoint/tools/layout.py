"""Pictures of a tensor's layout in the terminal: its chunk grid (and which rank wrote each
chunk, where that is known), and a resharding load's plan (which rank reads which chunk and
where each part goes), drawn as boxes the way ``jax.debug.visualize_array_sharding`` draws a
sharding. ``shardpoint inspect --layout KEY`` prints them.

1-D and 2-D tensors are drawn whole (a 1-D tensor as one row); a tensor of more dimensions
by its first two, boxes that differ only along later dimensions sharing one drawn box (a
note says so). Sizes are proportional to the tensor's extents, at least one character.

Example::

    d = draw_load_plan(plan_load(requests, layouts), layouts["w"])
    print(d.plain)        # or rich.console.Console().print(d.text) for colours
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Sequence

from rich.text import Text

# background colours by rank (or chunk), with a text colour that reads on each
PALETTE = [
    "black on #7fb3d5",
    "black on #f5b7b1",
    "black on #a9dfbf",
    "black on #f9e79f",
    "black on #d2b4de",
    "black on #f0b27a",
    "black on #aed6f1",
    "black on #d5dbdb",
    "white on #2e86c1",
    "white on #c0392b",
    "white on #229954",
    "white on #7d3c98",
]
_UP, _DOWN, _LEFT, _RIGHT = 1, 2, 4, 8
_JOIN = {
    _LEFT | _RIGHT: "─",
    _UP | _DOWN: "│",
    _DOWN | _RIGHT: "┌",
    _DOWN | _LEFT: "┐",
    _UP | _RIGHT: "└",
    _UP | _LEFT: "┘",
    _UP | _DOWN | _RIGHT: "├",
    _UP | _DOWN | _LEFT: "┤",
    _LEFT | _RIGHT | _DOWN: "┬",
    _LEFT | _RIGHT | _UP: "┴",
    _UP | _DOWN | _LEFT | _RIGHT: "┼",
    _LEFT: "─",
    _RIGHT: "─",
    _UP: "│",
    _DOWN: "│",
}
MAX_ROWS, MAX_COLS = 16, 8  # chunk boxes drawn along each axis (finer grids are grouped)
MAX_EDGES = 64  # a finer picture is not drawn (its boxes would be unreadable)


class Rect(NamedTuple):
    """A box of a tensor: ``[lo, hi)`` in elements, its label and colour (palette index,
    -1: none). Boxes may overlap; a cell covered by several shows all their labels."""

    lo: tuple
    hi: tuple
    label: str
    color: int = -1


@dataclass
class Drawing:
    """A picture: ``text`` (rich, with colours), the boxes drawn (2-D ``[lo, hi)`` and the
    label), and notes on what the picture leaves out."""

    text: Text
    boxes: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def plain(self) -> str:
        return self.text.plain

    def __str__(self) -> str:
        return self.plain


def _as_2d(shape: Sequence[int]) -> tuple:
    """(rows, cols) drawn for ``shape``: a 0-d or 1-D tensor is one row."""
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, max(int(shape[0]), 1))
    return (max(int(shape[0]), 1), max(int(shape[1]), 1))


def _project(lo: Sequence[int], hi: Sequence[int]) -> tuple:
    if len(lo) == 0:
        return (0, 0), (1, 1)
    if len(lo) == 1:
        return (0, lo[0]), (1, hi[0])
    return (lo[0], lo[1]), (hi[0], hi[1])


def _sizes(edges: list, budget: int, least: int) -> list:
    """Characters for each interval between ``edges``: proportional to its extent, at least
    ``least``, about ``budget`` in all."""
    total = edges[-1] - edges[0]
    return [max(least, round((b - a) * budget / total)) for a, b in zip(edges, edges[1:])]


def _merge(cells: list, nr: int, nc: int) -> list:
    """Maximal rectangles of equal cells: ``[(r0, r1, c0, c1, key)]`` (a greedy sweep)."""
    seen = [[False] * nc for _ in range(nr)]
    out = []
    for i in range(nr):
        for j in range(nc):
            if seen[i][j]:
                continue
            key = cells[i][j]
            j1 = j + 1
            while j1 < nc and not seen[i][j1] and cells[i][j1] == key:
                j1 += 1
            i1 = i + 1
            while i1 < nr and all(not seen[i1][c] and cells[i1][c] == key for c in range(j, j1)):
                i1 += 1
            for a in range(i, i1):
                for b in range(j, j1):
                    seen[a][b] = True
            out.append((i, i1, j, j1, key))
    return out


def _label_lines(labels: tuple, width: int, height: int) -> list:
    """The lines written in a box: one label a line, as many as fit (``+N``: N more)."""
    lines = list(labels)
    if len(lines) > max(height, 1):
        keep = max(height, 1) - 1
        lines = lines[:keep] + [f"{lines[keep]} +{len(lines) - keep - 1}"]
    return [ln if len(ln) <= width else ln[: max(width - 1, 0)] + "…" for ln in lines]


def draw(
    shape: Sequence[int], rects: Sequence[Rect], *, width: int = 72, height: Optional[int] = None
) -> Drawing:
    """Draw ``rects`` over a tensor of ``shape`` in about ``width`` columns (``height``
    lines inside the frame; default: by the tensor's aspect, 1 to 10). Cells covered by the
    same boxes are merged into one drawn box labelled with their labels; uncovered cells
    are left blank."""
    rows, cols = _as_2d(shape)
    notes = []
    if len(shape) > 2:
        notes.append(
            f"drawn by dimensions 0 and 1 of {len(shape)} (shape "
            f"{'x'.join(map(str, shape))}); boxes along later dimensions share one"
        )
    flat = []
    for r in rects:
        lo, hi = _project(r.lo, r.hi)
        if hi[0] > lo[0] and hi[1] > lo[1]:
            flat.append((lo, hi, r.label, r.color))
    ys = sorted({0, rows} | {v for lo, hi, _, _ in flat for v in (lo[0], hi[0])})
    xs = sorted({0, cols} | {v for lo, hi, _, _ in flat for v in (lo[1], hi[1])})
    nr, nc = len(ys) - 1, len(xs) - 1
    if nr > MAX_EDGES or nc > MAX_EDGES:
        return Drawing(Text(f"(not drawn: {nr} x {nc} boxes are too many to read)"), [], notes)
    cells: list[list[tuple[str, ...]]] = [[() for _ in range(nc)] for _ in range(nr)]
    colors = [[-1] * nc for _ in range(nr)]
    yi = {v: i for i, v in enumerate(ys)}
    xi = {v: i for i, v in enumerate(xs)}
    for lo, hi, label, color in flat:
        for i in range(yi[lo[0]], yi[hi[0]]):
            for j in range(xi[lo[1]], xi[hi[1]]):
                if label not in cells[i][j]:
                    cells[i][j] = cells[i][j] + (label,)
                if colors[i][j] < 0:
                    colors[i][j] = color
    keyed = [[(cells[i][j], colors[i][j]) for j in range(nc)] for i in range(nr)]
    boxes = _merge(keyed, nr, nc)
    if height is None:  # by the aspect (characters are about 2.5 times as tall as wide)
        height = 1 if len(shape) < 2 else min(10, max(nr, round(width * rows / cols / 2.5)))
    least_w = 1 if nc > width // 3 else 3
    cw = _sizes(xs, max(width - nc - 1, nc), least_w)
    rh = _sizes(ys, max(height, nr), 1)
    X = [0]
    for w in cw:
        X.append(X[-1] + w + 1)
    Y = [0]
    for h in rh:
        Y.append(Y[-1] + h + 1)
    H, W = Y[-1] + 1, X[-1] + 1
    conn = [[0] * W for _ in range(H)]
    chars = [[" "] * W for _ in range(H)]
    style = [[""] * W for _ in range(H)]

    def hline(y: int, x0: int, x1: int) -> None:
        for x in range(x0, x1):
            conn[y][x] |= _RIGHT
            conn[y][x + 1] |= _LEFT

    def vline(x: int, y0: int, y1: int) -> None:
        for y in range(y0, y1):
            conn[y][x] |= _DOWN
            conn[y + 1][x] |= _UP

    drawn = []
    for i0, i1, j0, j1, (labels, color) in boxes:
        y0, y1, x0, x1 = Y[i0], Y[i1], X[j0], X[j1]
        hline(y0, x0, x1)
        hline(y1, x0, x1)
        vline(x0, y0, y1)
        vline(x1, y0, y1)
        st = PALETTE[color % len(PALETTE)] if color >= 0 and labels else ""
        for y in range(y0 + 1, y1):
            for x in range(x0 + 1, x1):
                style[y][x] = st
        lines = _label_lines(labels, x1 - x0 - 1, y1 - y0 - 1)
        top = y0 + 1 + (y1 - y0 - 1 - len(lines)) // 2
        for k, ln in enumerate(lines):
            left = x0 + 1 + (x1 - x0 - 1 - len(ln)) // 2
            for m, ch in enumerate(ln):
                chars[top + k][left + m] = ch
        drawn.append(((ys[i0], xs[j0]), (ys[i1], xs[j1]), " ".join(labels)))
    text = Text()
    for y in range(H):
        for x in range(W):
            ch = _JOIN.get(conn[y][x], chars[y][x]) if conn[y][x] else chars[y][x]
            text.append(ch, style=style[y][x] or None)
        if y < H - 1:
            text.append("\n")
    return Drawing(text, drawn, notes)


def chunk_name(index: Sequence[int]) -> str:
    """``c0,3``: a chunk by its grid coordinates (``c`` alone for a 0-d tensor's one chunk)."""
    return "c" + ",".join(map(str, index))


def _grid(shape: Sequence[int], chunk: Sequence[int]) -> tuple:
    return tuple(-(-s // c) if c else 1 for s, c in zip(shape, chunk))


def chunk_rects(
    shape: Sequence[int],
    chunk_shape: Sequence[int],
    writers: Optional[dict] = None,
    max_cells: tuple = (MAX_ROWS, MAX_COLS),
) -> tuple:
    """(rects, notes): a box per chunk of the grid, labelled with its coordinates and, where
    ``writers`` (chunk coordinates -> rank) knows it, the rank that wrote it, coloured by
    that rank (else by chunk). Grids finer than ``max_cells`` (rows, columns of boxes) are
    grouped, a box per block of chunks."""
    grid = _grid(shape, chunk_shape)
    notes = []
    drawn = list(grid[:2])
    limits = max_cells[-len(drawn) :] if drawn else ()
    group = [max(1, -(-g // m)) for g, m in zip(drawn, limits)]
    if any(g > 1 for g in group):
        notes.append(
            f"{'x'.join(map(str, grid))} chunks: each box is a block of up to "
            f"{'x'.join(map(str, group))} of them"
        )
    rects = []
    blocks = [range(0, g, k) for g, k in zip(drawn, group)]
    for n, start in enumerate(itertools.product(*blocks)):
        stop = [min(s + k, g) for s, k, g in zip(start, group, drawn)]
        lo = [s * c for s, c in zip(start, chunk_shape)]
        hi = [min(e * c, n) for e, c, n in zip(stop, chunk_shape, shape)]
        lo += [0] * (len(shape) - len(lo))
        hi += list(shape[len(hi) :])
        one = all(e - s == 1 for s, e in zip(start, stop))
        name = (
            chunk_name(start)
            if one
            else "c"
            + ",".join(f"{s}" if e - s == 1 else f"{s}-{e - 1}" for s, e in zip(start, stop))
        )
        if len(grid) > 2 and math.prod(grid[2:]) > 1:
            name += ",*"
        ranks = (
            sorted({writers[ix] for ix in writers if _within(ix, start, stop)}) if writers else []
        )
        label = name + ("" if not ranks else " r" + ",".join(map(str, ranks)))
        color = ranks[0] if ranks else n
        rects.append(Rect(tuple(lo), tuple(hi), label, color))
    return rects, notes


def _within(ix: tuple, start: Sequence[int], stop: Sequence[int]) -> bool:
    return all(s <= i < e for i, s, e in zip(ix, start, stop))


def draw_chunks(
    key: str,
    shape: Sequence[int],
    dtype: str,
    chunk_shape: Sequence[int],
    writers: Optional[dict] = None,
    *,
    width: int = 72,
    save_world_size: Optional[int] = None,
) -> Drawing:
    """The chunk grid of tensor ``key``, titled, each box a chunk (see :func:`chunk_rects`);
    without ``writers`` a note says the checkpoint does not record who wrote which chunk."""
    rects, notes = chunk_rects(
        shape, chunk_shape, writers, (MAX_ROWS, max(1, min(MAX_COLS * 2, (width - 1) // 11)))
    )
    d = draw(shape, rects, width=width)
    n = math.prod(_grid(shape, chunk_shape))
    by = f", saved by {save_world_size} rank(s)" if save_world_size else ""
    title = (
        f"{key}: {dtype}[{'x'.join(map(str, shape)) or ''}], {n} chunk(s) of "
        f"{'x'.join(map(str, chunk_shape)) or '()'}{by}"
    )
    if writers is None:
        notes.append(
            "the manifest does not record which rank wrote each chunk: boxes are "
            "chunks, labelled by grid coordinates"
        )
    d.notes = notes + d.notes
    d.text = Text(title + "\n") + d.text
    return d


def save_writers(plan: Any, key: str) -> dict:
    """``{chunk coordinates: rank}`` of tensor ``key`` from a save plan
    (:func:`shardpoint.planning.planner.plan_save`)."""
    chunk = plan.tensors[key].chunk_shape
    return {
        tuple(o // c for o, c in zip(w.offset, chunk)): r
        for r, work in enumerate(plan.ranks)
        for w in work.writes
        if w.key == key
    }


class Piece(NamedTuple):
    """Part of what destination rank ``dest`` loads: ``[lo, hi)`` of chunk ``chunk``, read
    from storage by rank ``reader`` (``dest`` itself, or a rank that sends it)."""

    dest: int
    reader: int
    chunk: tuple
    lo: tuple
    hi: tuple


def _chunk_of(offset: Sequence[int], chunk: Sequence[int]) -> tuple:
    return tuple(o // c if c else 0 for o, c in zip(offset, chunk))


def plan_pieces(works: Sequence[Any], key: str, chunk_shape: Sequence[int]) -> list:
    """Every :class:`Piece` of tensor ``key`` in a load plan (``works[r]``: rank ``r``'s
    :class:`~shardpoint.planning.plans.RankLoadWork`), in rank order."""
    out = []
    for d, w in enumerate(works):
        for op in w.reads:
            if op.key != key:
                continue
            c = _chunk_of(op.offset, chunk_shape)
            if op.direct is not None:
                hi = tuple(o + s for o, s in zip(op.offset, op.shape))
                out.append(Piece(d, d, c, tuple(op.offset), hi))
            for _q, _pi, bo, bs in op.local:
                out.append(Piece(d, d, c, tuple(bo), tuple(o + s for o, s in zip(bo, bs))))
        for t in w.recvs:
            if t.key == key:
                out.append(
                    Piece(
                        d,
                        t.src,
                        _chunk_of(t.box_offset, chunk_shape),
                        tuple(t.box_offset),
                        tuple(o + s for o, s in zip(t.box_offset, t.box_shape)),
                    )
                )
    return out


def _box(lo: Sequence[int], hi: Sequence[int]) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in zip(lo, hi)) + "]"


def draw_load_plan(
    works: Sequence[Any], layout: Any, *, width: int = 72, writers: Optional[dict] = None
) -> Drawing:
    """The load plan of one tensor (``layout``: its key, shape, dtype, chunk_shape): a box
    per part a destination rank gets, labelled ``c1,0 r2→r1`` (chunk c1,0, read by rank 2,
    sent to rank 1; ``c0,0 r0``: rank 0 reads its own), coloured by destination; then a line
    per rank saying which chunks it reads and what it receives from whom."""
    key, shape, chunk = layout.key, tuple(layout.shape), tuple(layout.chunk_shape)
    pieces = plan_pieces(works, key, chunk)
    rects = [
        Rect(
            p.lo,
            p.hi,
            chunk_name(p.chunk)
            + " "
            + (f"r{p.dest}" if p.reader == p.dest else f"r{p.reader}→r{p.dest}"),
            p.dest,
        )
        for p in pieces
    ]
    d = draw(shape, rects, width=width)
    lines = [
        f"load of {key}: {layout.dtype}[{'x'.join(map(str, shape))}] in chunks of "
        f"{'x'.join(map(str, chunk)) or '()'} into {len(works)} rank(s); a box per "
        "part a rank gets: its chunk, then rN (rank N reads it itself) or rA→rB (rank A "
        "reads it and sends it to rank B)"
    ]
    if writers:
        wr = ", ".join(f"{chunk_name(c)} by r{r}" for c, r in sorted(writers.items()))
        lines.append(f"saved: {wr}")
    per = []
    for r, w in enumerate(works):
        reads = sorted({_chunk_of(op.offset, chunk) for op in w.reads if op.key == key})
        names = [chunk_name(c) for c in reads[:8]]
        if len(reads) > 8:
            names.append(f"and {len(reads) - 8} more")
        recv = [p for p in pieces if p.dest == r and p.reader != r]
        got = [p for p in pieces if p.dest == r]
        what = ("reads " + ", ".join(names)) if reads else "reads nothing"
        if recv:
            what += "; receives " + ", ".join(
                f"{_box(p.lo, p.hi)} of {chunk_name(p.chunk)} from r{p.reader}" for p in recv[:4]
            )
            what += f" and {len(recv) - 4} more part(s)" if len(recv) > 4 else ""
        need = sum(math.prod(b - a for a, b in zip(p.lo, p.hi)) for p in got)
        per.append(f"  rank {r}: {what} ({need} element(s) in all)")
    d.text = Text("\n".join(lines) + "\n") + d.text + Text("\n" + "\n".join(per))
    return d


def even_requests(key: str, dtype: str, shape: Sequence[int], ranks: int) -> list:
    """Per-rank requests for ``key`` split evenly along dimension 0 (the split of DDP's
    replicas' FSDP shards and most tensor-parallel rows): what ``--load-ranks N`` plans."""
    from shardpoint.tree.model import Holding

    shape = tuple(shape)
    out = []
    n = shape[0] if shape else 1
    for r in range(ranks):
        a, b = r * n // ranks, (r + 1) * n // ranks
        if not shape:
            out.append([Holding(key, dtype, shape, (), (), None, (r,))])
        elif b > a:
            out.append(
                [
                    Holding(
                        key,
                        dtype,
                        shape,
                        (a,) + (0,) * (len(shape) - 1),
                        (b - a,) + shape[1:],
                        None,
                        (0,),
                    )
                ]
            )
        else:
            out.append([])
    return out
