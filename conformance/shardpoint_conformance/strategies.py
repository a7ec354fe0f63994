"""Drawing whole checkpoint cases from a seed, and hypothesis strategies over them.

:func:`generate_case` is a pure function of ``(seed, save_world, load_world, profile)``: every
rank of a job calls it and gets the same case, and ``--replay SEED`` rebuilds a failing one.
The hypothesis strategies (:func:`cases`, :func:`dtypes`, :func:`shapes`) draw the seed and the
world sizes, so property tests shrink towards small worlds and early seeds.

Saving layouts: replicated plain tensors, a single owner (a pipeline stage), even / ceil-div
(``torch.chunk``, DTensor: empty last pieces at offset = dim size) / uneven splits (Megatron:
empty pieces at the sum of earlier sizes), 2-D grids with replicas, flattened ranges (ZeRO),
composed TP x PP x DP groups (DP replicating or ZeRO-flattening the TP block), and DTensor.
Several pieces of one tensor per rank (layer-stacked weights of a pipeline stage, MoE
experts, strided rows, several flattened ranges) and Megatron's replica ids (0 for one holder
of a region, 1 for every other) are drawn too.
Loading layouts draw independently from the same kinds (without replica ids) plus "skip"
(a subset load) and whole-tree loads without ``like``.
"""

from __future__ import annotations

import math
import random
from typing import Any, Optional, TypedDict

from shardpoint_core.format.keys import encode_key

from shardpoint_conformance.cases import SPEC_DTYPES, encode_value, grid_cell


class Profile(TypedDict):
    """How large a profile's cases are."""

    tensors: tuple[int, int]  # tensors per case (least, most)
    max_elems: int  # elements per tensor at most
    dtensor: float  # the probability of a DTensor layout


PROFILES: dict[str, Profile] = {
    "ci": {"tensors": (2, 5), "max_elems": 240, "dtensor": 0.0},
    "large": {"tensors": (3, 9), "max_elems": 40_000, "dtensor": 0.1},
}


def _factorizations(w: int, parts: int) -> list:
    if parts == 1:
        return [(w,)]
    out = []
    for d in range(1, w + 1):
        if w % d == 0:
            out += [(d,) + rest for rest in _factorizations(w // d, parts - 1)]
    return out


def _shape(rng: random.Random, max_elems: int) -> list:
    ndim = rng.choices([0, 1, 2, 3, 4], [1, 3, 4, 2, 1])[0]
    while True:
        dims = []
        for _ in range(ndim):
            r = rng.random()
            if r < 0.07:
                dims.append(0)
            elif r < 0.2:
                dims.append(1)
            else:
                dims.append(rng.choice([2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 16, 17, 31, 64, 100]))
        if math.prod(dims) <= max_elems:
            return dims


def _cuts(rng: random.Random, n: int, k: int, mode: str) -> list:
    """``k`` (offset, size) pieces of a dimension of size ``n``."""
    if mode == "even" and n % k == 0:
        return [(i * (n // k), n // k) for i in range(k)]
    if mode in ("even", "ceil"):
        c = -(-n // k) if n else 0
        return [(min(i * c, n), max(0, min(c, n - i * c))) for i in range(k)]
    pts = sorted(rng.randint(0, n) for _ in range(k - 1))
    bounds = [0] + pts + [n]
    out = []
    for i in range(k):
        a, b = bounds[i], bounds[i + 1]
        # An empty piece may sit anywhere in [0, n] ([design 4b]); mostly Megatron's choice.
        out.append((rng.randint(0, n) if a == b and rng.random() < 0.3 else a, b - a))
    return out


def _flat_ranges(rng: random.Random, n: int, k: int) -> list:
    if rng.random() < 0.5:
        c = -(-n // k) if n else 0
        return [(min(i * c, n), min((i + 1) * c, n)) for i in range(k)]
    pts = sorted(rng.randint(0, n) for _ in range(k - 1))
    b = [0] + pts + [n]
    return [(b[i], b[i + 1]) for i in range(k)]


def _box(shape, dim_cuts: dict) -> tuple:
    off = [0] * len(shape)
    shp = list(shape)
    for d, (o, s) in dim_cuts.items():
        off[d], shp[d] = o, s
    return off, shp


def _layout(rng: random.Random, shape: list, world: int, saving: bool, dtensor: float) -> dict:
    nd = len(shape)
    kinds = ["replicated", "owner", "split", "flat", "composed", "pieces"]
    if nd >= 2:
        kinds.append("grid")
    if saving:
        kinds += ["split-replicas", "megatron-replicas"]
    else:
        kinds += ["skip", "owner"]
    if nd >= 1 and rng.random() < dtensor:
        d = rng.randrange(nd)
        place = rng.choice([f"S{d}", "R"])
        pieces = []
        for r in range(world):
            if place == "R":
                pieces.append([r, [0] * nd, list(shape), None, [r] if saving else [0]])
            else:
                o, s = _cuts(rng, shape[d], world, "ceil")[r]
                pieces.append([r, *_box(shape, {d: (o, s)}), None, [0]])
        return {"kind": f"dtensor {place}", "pieces": pieces}
    kind = rng.choice(kinds)
    if kind == "replicated" or (
        nd == 0 and kind in ("split", "grid", "split-replicas", "megatron-replicas")
    ):
        return {
            "kind": "replicated",
            "pieces": [[r, [0] * nd, list(shape), None, None] for r in range(world)],
        }
    if kind == "skip":
        return {"kind": "skip", "pieces": []}
    if kind == "owner":
        r = rng.randrange(world)
        return {"kind": f"owner r{r}", "pieces": [[r, [0] * nd, list(shape), None, [0]]]}
    if kind == "split":
        d, mode = rng.randrange(nd), rng.choice(["even", "ceil", "uneven"])
        cuts = _cuts(rng, shape[d], world, mode)
        return {
            "kind": f"split-{mode} d{d}",
            "pieces": [[r, *_box(shape, {d: cuts[r]}), None, [0]] for r in range(world)],
        }
    if kind == "split-replicas":
        k = rng.choice([f for f in range(1, world + 1) if world % f == 0])
        d = rng.randrange(nd)
        cuts = _cuts(rng, shape[d], k, rng.choice(["ceil", "uneven"]))
        return {
            "kind": f"split-replicas k{k} d{d}",
            "pieces": [[r, *_box(shape, {d: cuts[r % k]}), None, [r // k]] for r in range(world)],
        }
    if kind == "megatron-replicas":
        # Megatron's fully-parallel replica ids: 0 for one holder of a region, 1 for all others
        k = rng.choice([f for f in range(1, world + 1) if world % f == 0])
        d = rng.randrange(nd)
        cuts = _cuts(rng, shape[d], k, rng.choice(["even", "ceil", "uneven"]))
        return {
            "kind": f"megatron-replicas k{k} d{d}",
            "pieces": [
                [r, *_box(shape, {d: cuts[r % k]}), None, [0 if r < k else 1]] for r in range(world)
            ],
        }
    if kind == "pieces":
        return _pieces_layout(rng, shape, world)
    if kind == "grid":
        a, b, c = rng.choice(_factorizations(world, 3))
        d0, d1 = rng.sample(range(nd), 2)
        mode = rng.choice(["ceil", "uneven", "even"])
        c0, c1 = _cuts(rng, shape[d0], a, mode), _cuts(rng, shape[d1], b, mode)
        pieces = []
        for r in range(world):
            i, j, copy = r // (b * c), (r // c) % b, r % c
            pieces.append(
                [r, *_box(shape, {d0: c0[i], d1: c1[j]}), None, [copy] if saving else [0]]
            )
        return {"kind": f"grid {a}x{b}x{c} d{d0},{d1}", "pieces": pieces}
    if kind == "flat":
        rs = _flat_ranges(rng, math.prod(shape), world)
        return {
            "kind": "flat",
            "pieces": [[r, [0] * nd, list(shape), list(rs[r]), [0]] for r in range(world)],
        }
    # composed: rank = (pp, tp, dp) row-major; one pipeline stage owns the tensor, TP splits
    # it (replicates a 0-d one), DP replicates the TP block or ZeRO-flattens it.
    tp, pp, dp = rng.choice(_factorizations(world, 3))
    owner = rng.randrange(pp)
    zero = rng.random() < 0.5
    d = rng.randrange(nd) if nd else 0  # a 0-d tensor: no dimension to split, no draw
    tcuts = _cuts(rng, shape[d], tp, rng.choice(["ceil", "uneven"])) if nd else []
    pieces = []
    for r in range(world):
        p_i, t_i, d_i = r // (tp * dp), (r // dp) % tp, r % dp
        if p_i != owner:
            continue
        off, shp = _box(shape, {d: tcuts[t_i]}) if nd else ([], [])
        replica = [d_i] if nd else [t_i, d_i]
        flat = None
        if zero:
            flat = list(_flat_ranges(random.Random(t_i * 7919 + world), math.prod(shp), dp)[d_i])
            replica = [0] if nd else [t_i, 0]
        if not saving:
            replica = [0]
        pieces.append([r, off, shp, flat, replica])
    return {"kind": f"composed tp{tp}xpp{pp}xdp{dp}{'-zero' if zero else ''}", "pieces": pieces}


def _pieces_layout(rng: random.Random, shape: list, world: int) -> dict:
    """Several pieces of one tensor per rank (one ``ShardedPieces`` leaf): ``k >= world``
    slabs of a dimension, or ranges of the flattening, dealt to the ranks contiguously (a
    pipeline stage's layers) or round-robin (MoE experts, FSDP2 x TP strided rows)."""
    nd = len(shape)
    k = world * rng.choice([1, 2, 3])
    deal = rng.choice(["contig", "strided"])
    owner = [i * world // k if deal == "contig" else i % world for i in range(k)]
    if nd == 0 or rng.random() < 0.3:
        rs = _flat_ranges(rng, math.prod(shape), k)
        pieces = [[owner[i], [0] * nd, list(shape), list(rs[i]), [0]] for i in range(k)]
        return {"kind": f"pieces-flat-{deal} k{k}", "pieces": pieces}
    d = rng.randrange(nd)
    cuts = _cuts(rng, shape[d], k, rng.choice(["even", "ceil", "uneven"]))
    pieces = [[owner[i], *_box(shape, {d: cuts[i]}), None, [0]] for i in range(k)]
    return {"kind": f"pieces-{deal} k{k} d{d}", "pieces": pieces}


def _plain_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth < 2 and r < 0.15:
        return [_plain_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 2 and r < 0.3:
        return {f"k{i}": _plain_value(rng, depth + 1) for i in range(rng.randint(0, 3))}
    return rng.choice(
        [
            None,
            True,
            False,
            rng.randint(-(2**63), 2**64 - 1),
            rng.randint(-9, 9),
            rng.uniform(-1e6, 1e6),
            "",
            "épsilon/ünïcode",
            bytes(rng.randrange(256) for _ in range(rng.randint(0, 9))),
        ]
    )


def _object_grid(rng: random.Random, count: int) -> Optional[list]:
    """Half the time, a grid of two or three dimensions with ``count`` cells (e.g. (stage,
    tensor rank), trailing or leading 1s included); else None (a 1-D object, int indexes)."""
    if rng.random() < 0.5:
        return None
    a = rng.choice([f for f in range(1, count + 1) if count % f == 0])
    grid = [a, count // a]
    if rng.random() < 0.3:
        grid.insert(rng.randrange(3), 1)
    return grid


def generate_case(
    seed: int,
    save_world: int,
    load_world: int,
    profile: str = "ci",
    *,
    case_id: Optional[str] = None,
) -> dict:
    """One case, a pure function of its arguments (see :mod:`.cases` for the layout)."""
    prof = PROFILES[profile]
    rng = random.Random(f"shardpoint-conformance:{seed}:{save_world}:{load_world}:{profile}")
    n_t = rng.randint(*prof["tensors"])
    tensors: list[dict[str, Any]] = []  # the case's JSON-shaped parts
    values: list[dict[str, Any]] = []
    objects: list[dict[str, Any]] = []
    used = set()
    groups: list[str | int] = ["model", "optim", 0, "ema", "a b/c%", "~1"]
    for i in range(n_t):
        g = rng.choice(groups)
        names: list[str | int] = [i, f"w{i}", f"layer.{i}"]
        path = [g, rng.choice(names)]
        if rng.random() < 0.3:
            path.append("state")
        key = encode_key(tuple(path))
        if key in used:
            continue
        used.add(key)
        dtype = SPEC_DTYPES[rng.randrange(len(SPEC_DTYPES))]
        tensors.append(
            {"path": path, "key": key, "dtype": dtype, "shape": _shape(rng, prof["max_elems"])}
        )
    for j in range(rng.randint(0, 3)):
        values.append({"path": ["meta", f"v{j}"], "value": encode_value(_plain_value(rng))})
    save_objs, load_objs = {}, {}
    if rng.random() < 0.7:
        key = encode_key(("rng",))
        per = rng.choice([f for f in range(1, save_world + 1) if save_world % f == 0])
        count = save_world // per  # ``per`` ranks share each index, as replicas
        obj = {"path": ["rng"], "key": key, "count": count}
        megatron_ids = rng.random() < 0.5  # 0 for one holder of an index, 1 for the rest
        # A separate stream, so cases drawn before grids existed replay unchanged.
        grid = _object_grid(
            random.Random(
                f"shardpoint-conformance-grid:{seed}:{save_world}:{load_world}:{profile}"
            ),
            count,
        )
        if grid is not None:
            obj["shape"] = grid
        objects.append(obj)
        save_objs[key] = [
            [
                r,
                grid_cell(r % count, grid or count),
                [min(r // count, 1) if megatron_ids else r // count],
            ]
            for r in range(save_world)
        ]
        load_objs[key] = [[r, grid_cell((r + 1) % count, grid or count)] for r in range(load_world)]
    dt = prof["dtensor"]
    save = {
        "world": save_world,
        "objects": save_objs,
        "tensors": {t["key"]: _layout(rng, t["shape"], save_world, True, dt) for t in tensors},
    }
    load = {
        "world": load_world,
        "objects": load_objs,
        "like": rng.random() < 0.85,
        "tensors": {t["key"]: _layout(rng, t["shape"], load_world, False, dt) for t in tensors},
    }
    return {
        "seed": seed,
        "id": case_id or f"s{seed}",
        "profile": profile,
        "tensors": tensors,
        "values": values,
        "objects": objects,
        "save": save,
        "load": load,
    }


def case_plan(seed: int, n: int, save_worlds: list, load_worlds: list, profile: str) -> list:
    """``n`` cases covering every (save world, load world) pair in turn; case i has seed
    ``seed + i`` so ``--replay`` needs only that number and the two world sizes."""
    pairs = [(s, w) for s in save_worlds for w in load_worlds]
    return [
        generate_case(seed + i, *pairs[i % len(pairs)], profile, case_id=f"c{i:03d}")
        for i in range(n)
    ]


# -------------------------------------------------------------------------------- hypothesis
def cases(profile: str = "ci", max_world: int = 4):
    """Hypothesis strategy: whole cases (seed and world sizes drawn; shrinks to small ones)."""
    from hypothesis import strategies as st

    return st.builds(
        lambda s, a, b: generate_case(s, a, b, profile),
        st.integers(0, 2**32 - 1),
        st.integers(1, max_world),
        st.integers(1, max_world),
    )


def dtypes():
    from hypothesis import strategies as st

    return st.sampled_from(SPEC_DTYPES)


def shapes(max_elems: int = 240):
    from hypothesis import strategies as st

    return st.integers(0, 2**32 - 1).map(lambda s: _shape(random.Random(s), max_elems))
