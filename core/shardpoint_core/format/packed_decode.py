"""The reader checks of the packed layout's index (format 1.4, spec/format.md section 13):
:func:`decode_packed` turns the manifest's field ``"packed"`` into a :class:`PackedIndex`,
applying every rule of [SP-PACK-2] to [SP-PACK-5] (and [SP-PACK-9], [SP-PACK-10],
[SP-PACK-12]) with whole-array operations, so a bad index fails with the rule it breaks in
bounded time and memory. Pure: values in, values out, no I/O."""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping, Optional, Sequence, Tuple

import numpy as np

from shardpoint_core.format import dtypes
from shardpoint_core.format.compression import stored_bounds
from shardpoint_core.format.errors import CorruptCheckpointError
from shardpoint_core.format.packed_index import (
    HASH_BYTES,
    IDENTITY_BYTES,
    MAX_OBJECTS,
    MAX_SIZE,
    RECORD,
    RECORD_BYTES,
    ArrayInfo,
    PackedIndex,
    chunk_count,
    is_zstd,
)

_COMPONENT = re.compile(r"[A-Za-z0-9_.~%\-]+\Z")
_WHERE = "manifest.msgpack: field 'packed'"


def _bad(msg: str, sid: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{_WHERE}: {msg}", spec_id=sid)


def _inner_units(chunk: Sequence[int], inner: Optional[Sequence[int]]) -> int:
    return 1 if inner is None else math.prod(c // i for c, i in zip(chunk, inner))


def _check_path(p: Any, what: str) -> str:
    """[SP-SEC-1] for an object path: relative, components of the safe set, no . or .."""
    if (
        not isinstance(p, str)
        or not p
        or any(not _COMPONENT.match(c) or c in (".", "..") for c in p.split("/"))
    ):
        raise _bad(f"{what} path {p!r} is not a safe relative path", "SP-SEC-1")
    return p


_KEYS = {"objects", "arrays", "index"}
_OPTIONAL = {"bases", "hashes"}  # (incremental, [SP-PACK-9], [SP-PACK-10])


def _form(value: Any) -> Tuple[list[Any], list[Any], bytes]:
    """The field's three entries, each of its form ([SP-PACK-2])."""
    if not (isinstance(value, dict) and _KEYS <= set(value) <= _KEYS | _OPTIONAL):
        raise _bad(
            "must be a map of 'objects', 'arrays' and 'index' (and, incremental, "
            "'bases' and 'hashes'), nothing else",
            "SP-PACK-2",
        )
    objs, arrs, raw = value["objects"], value["arrays"], value["index"]
    if not (isinstance(objs, list) and isinstance(arrs, list) and isinstance(raw, bytes)):
        raise _bad("'objects' and 'arrays' must be lists, 'index' a bin", "SP-PACK-2")
    for o in objs:
        if not (
            isinstance(o, list)
            and len(o) in (2, 3)
            and isinstance(o[0], str)
            and type(o[1]) is int
            and 0 <= o[1] < MAX_SIZE
            and (len(o) == 2 or type(o[2]) is int)
        ):
            raise _bad(
                f"object entry {o!r} is not [path, size] or [path, size, base] with "
                "0 <= size < 2^63",
                "SP-PACK-2",
            )
    for a in arrs:
        if not (
            isinstance(a, list)
            and len(a) in (2, 3)
            and isinstance(a[0], str)
            and (a[1] is None or isinstance(a[1], list))
            and (len(a) == 2 or (a[1] is None and isinstance(a[2], dict)))
        ):
            raise _bad(
                f"array entry {a!r} is not [name, inner chunk shape or nil] or "
                "[name, nil, codec object]",
                "SP-PACK-2",
            )
    return objs, arrs, raw


def _objects(objs: list[Any], names: Iterable[str]) -> None:
    """Object paths safe ([SP-SEC-1]), distinct, none inside another or an array name, none
    the manifest; at most 2^32-1 of them ([SP-PACK-2]). The objects of each base
    ([SP-PACK-9]) are compared among themselves: they lie in another checkpoint."""
    if len(objs) > MAX_OBJECTS:
        raise _bad(f"{len(objs)} objects, over the {MAX_OBJECTS} an index can name", "SP-PACK-2")
    spaces: dict[Any, list[Tuple[str, str]]] = {None: [(n + "/", "array") for n in names]}
    for o in objs:
        p = _check_path(o[0], "object")
        if p == "manifest.msgpack":
            raise _bad("an object path is manifest.msgpack", "SP-PACK-2")
        spaces.setdefault(o[2] if len(o) == 3 else None, []).append((p + "/", "object"))
    for every in spaces.values():
        every.sort()
        for (a, ka), (b, kb) in zip(every, every[1:]):
            if b.startswith(a):
                raise _bad(
                    f"{ka} path {a[:-1]!r} and {kb} path {b[:-1]!r}: equal, or one inside "
                    "the other",
                    "SP-PACK-2",
                )


def _bases(value: Any, objs: list[Any]) -> list[Tuple[str, bytes]]:
    """The bases ([SP-PACK-9]): ``[name, identity]`` each, the name one safe path component
    (a sibling of the checkpoint, never ``.`` or ``..``), distinct, the identity 32 bytes;
    each object's base number in range, each base named by an object."""
    bases = value.get("bases", [])
    if not isinstance(bases, list):
        raise _bad("'bases' must be a list of [name, identity]", "SP-PACK-9")
    out: list[Tuple[str, bytes]] = []
    for b in bases:
        if not (
            isinstance(b, list)
            and len(b) == 2
            and isinstance(b[0], str)
            and isinstance(b[1], bytes)
            and len(b[1]) == IDENTITY_BYTES
        ):
            raise _bad(f"base entry {b!r} is not [name, 32-byte identity]", "SP-PACK-9")
        name = b[0]
        if not _COMPONENT.match(name) or name in (".", ".."):
            raise _bad(
                f"base name {name!r} is not one safe path component (a base is a sibling "
                "of the checkpoint; nothing else is reachable)",
                "SP-PACK-9",
            )
        out.append((name, b[1]))
    if len({n for n, _i in out}) != len(out):
        raise _bad("a base is listed twice", "SP-PACK-9")
    used = set()
    for o in objs:
        if len(o) == 3:
            if not 0 <= o[2] < len(out):
                raise _bad(f"object {o[0]!r}: base number {o[2]} out of range", "SP-PACK-9")
            used.add(o[2])
    if len(used) != len(out):
        n = min(set(range(len(out))) - used)
        raise _bad(f"base {out[n][0]!r} is named by no object", "SP-PACK-9")
    return out


def _arrays(arrs: list[Any], by_name: Mapping[str, ArrayInfo]) -> list[Any]:
    """Each tensor entry's array named once, with a valid inner chunk shape ([SP-PACK-2],
    [SP-PACK-3]); returns ``[(name, inner, entry)]``."""
    seen: set[str] = set()
    out = []
    for name, inner, *_codec in arrs:
        e = by_name.get(name)
        if e is None or name in seen:
            raise _bad(
                f"array {name!r} "
                + ("is listed twice" if e is not None else "names no tensor entry"),
                "SP-PACK-2",
            )
        seen.add(name)
        chunk = tuple(e.chunk_shape)
        if inner is not None:
            ok = len(inner) == len(chunk) and all(
                type(k) is int and k >= 1 and c % k == 0 for k, c in zip(inner, chunk)
            )
            if not ok:
                raise _bad(
                    f"tensor {e.key!r}: inner chunk shape {inner!r} does not divide "
                    f"chunk shape {list(chunk)}",
                    "SP-PACK-3",
                )
            inner = tuple(inner) if chunk else None
        out.append((name, inner, e))
    if len(seen) != len(by_name):
        missing = sorted(set(by_name) - seen)[0]
        raise _bad(
            f"tensor {by_name[missing].key!r} (array {missing!r}) has no entry in 'arrays'",
            "SP-PACK-2",
        )
    return out


def decode_packed(value: Any, arrays: Mapping[str, ArrayInfo]) -> PackedIndex:
    """The field ``value`` checked against the tensor entries ``arrays`` (array name ->
    entry) by every rule of [SP-PACK-2] to [SP-PACK-5]; raises CorruptCheckpointError
    naming the rule, the tensor and the record."""
    objs, arrs, raw = _form(value)
    _objects(objs, arrays)
    listed = _arrays(arrs, arrays)
    bases = _bases(value, objs)
    if len(raw) % RECORD_BYTES:
        raise _bad(
            f"index of {len(raw)} bytes is not a whole number of {RECORD_BYTES}-byte records",
            "SP-PACK-4",
        )
    counts = [chunk_count(e.shape, e.chunk_shape) for _n, _i, e in listed]
    rec = np.frombuffer(raw, RECORD)
    if sum(counts) != len(rec):  # before any per-declared-chunk work ([SP-SEC-2])
        raise _bad(
            f"{len(rec)} records for the {sum(counts)} chunks of the arrays (every "
            f"chunk of every array exactly once){_first_miscounted(rec, listed, counts)}",
            "SP-PACK-4",
        )
    hashes = value.get("hashes")
    if hashes is not None and not (
        isinstance(hashes, bytes) and len(hashes) == HASH_BYTES * len(rec)
    ):
        raise _bad(
            f"'hashes' must be a bin of {HASH_BYTES} bytes per record "
            f"({HASH_BYTES * len(rec)} bytes)",
            "SP-PACK-10",
        )

    codecs = [a[2] if len(a) == 3 else None for a in arrs]

    def made() -> PackedIndex:
        return PackedIndex(
            [(o[0], o[1]) for o in objs],
            [(n, i) for n, i, _e in listed],
            rec,
            bases,
            [o[2] if len(o) == 3 else None for o in objs] if bases else None,
            hashes,
            codecs if any(c is not None for c in codecs) else None,
        )

    if len(rec) == 0:
        return made()
    a, c = rec["array"], rec["chunk"]
    if np.any(a >= len(listed)):
        raise _bad(
            f"record {int(np.argmax(a >= len(listed)))}: array number out of range", "SP-PACK-4"
        )
    up = (a[1:] > a[:-1]) | ((a[1:] == a[:-1]) & (c[1:] > c[:-1]))
    if not np.all(up):
        raise _bad(
            f"record {int(np.argmin(up)) + 1} is not after the one before it in "
            "(array, chunk) order (a chunk twice, or out of order)",
            "SP-PACK-4",
        )
    cap = np.array([min(n, 2**64 - 1) for n in counts], np.uint64)
    if np.any(c >= cap[a]):
        i = int(np.argmax(c >= cap[a]))
        raise _bad(
            f"record {i}: chunk {int(c[i])} outside the grid of tensor "
            f"{listed[int(a[i])][2].key!r}",
            "SP-PACK-4",
        )
    o = rec["object"]
    if np.any(o >= len(objs)):
        raise _bad(
            f"record {int(np.argmax(o >= len(objs)))}: object number out of range", "SP-PACK-4"
        )
    _check_lengths(rec, listed, objs, codecs)
    _check_overlaps(rec, objs)
    return made()


def _first_miscounted(rec: np.ndarray, listed: list[Any], counts: list[int]) -> str:
    """``: tensor 'k' ...``, the first tensor whose records are not its chunk count (work
    and memory per stored record and listed array, never per declared chunk)."""
    a = rec["array"]
    have = np.bincount(a[a < len(listed)], minlength=len(listed))
    for (name, _inner, e), n, want in zip(listed, have.tolist(), counts):
        if n != want:
            return f": tensor {e.key!r} (array {name!r}) has {n} records for its {want} chunks"
    return ""


def _check_lengths(
    rec: np.ndarray, listed: list[Any], objs: list[Any], codecs: Sequence[Any] = ()
) -> None:
    """Every record inside its object; a plain chunk's exact size, a shard at least its
    index, (1.5) a compressed chunk within the bounds of [SP-READ-9] ([SP-PACK-4],
    [SP-PACK-12]): so no record stands for more than 32768 times its bytes."""
    size = np.array([o[1] for o in objs], np.uint64)[rec["object"]]
    off, n = rec["offset"], rec["length"]
    out = (off > size) | (n > size - np.minimum(off, size))
    if np.any(out):
        i = int(np.argmax(out))
        raise _bad(
            f"record {i} (tensor {listed[int(rec['array'][i])][2].key!r}, chunk "
            f"{int(rec['chunk'][i])}): bytes {int(off[i])}+{int(n[i])} beyond its "
            f"object {objs[int(rec['object'][i])][0]!r} of {int(size[i])} bytes",
            "SP-PACK-4",
        )
    exact, least, most = [], [], []
    for k, (_name, inner, e) in enumerate(listed):
        item = dtypes.from_name(e.dtype).itemsize
        units = _inner_units(e.chunk_shape, inner)
        codec = codecs[k] if k < len(codecs) else None
        most.append(2**64 - 1)
        if codec is not None:  # (1.5) compressed; another codec: refused when opened
            exact.append(-1)
            lo, hi = stored_bounds(math.prod(e.chunk_shape) * item)
            least.append(lo if is_zstd(codec) else 0)
            most[-1] = min(hi, 2**64 - 1) if is_zstd(codec) else 2**64 - 1
        elif inner is None:
            exact.append(math.prod(e.chunk_shape) * item + 4)
            least.append(0)
        else:
            exact.append(-1)
            least.append(16 * units + 4)
    want = np.array([min(x, 2**64 - 1) if x >= 0 else 0 for x in exact], np.uint64)[rec["array"]]
    plain = np.array([x >= 0 for x in exact], bool)[rec["array"]]
    low = np.array(least, np.uint64)[rec["array"]]
    high = np.array(most, np.uint64)[rec["array"]]
    wrong = (plain & (n != want)) | (~plain & ((n < low) | (n > high)))
    if np.any(wrong):
        i = int(np.argmax(wrong))
        a = int(rec["array"][i])
        name, inner, e = listed[a]
        squeezed = a < len(codecs) and codecs[a] is not None
        if plain[i]:
            need, what = f"exactly {int(want[i])}", "plain chunk"
        elif squeezed:
            need, what = f"{int(low[i])} to {int(high[i])} ([SP-READ-9])", "compressed chunk"
        else:
            need, what = f"at least {int(low[i])}", "shard"
        raise _bad(
            f"record {i} (tensor {e.key!r}, chunk {int(rec['chunk'][i])}): length "
            f"{int(n[i])}, a {what} of it is {need} bytes",
            "SP-PACK-4",
        )


def _check_overlaps(rec: np.ndarray, objs: list[Any]) -> None:
    """No two records of one object share a byte ([SP-PACK-5])."""
    order = np.lexsort((rec["offset"], rec["object"]))
    o, off, n = rec["object"][order], rec["offset"][order], rec["length"][order]
    same = o[1:] == o[:-1]
    hit = same & (off[:-1] + n[:-1] > off[1:])
    if np.any(hit):
        j = int(np.argmax(hit))
        raise _bad(
            f"records {int(order[j])} and {int(order[j + 1])} overlap in object "
            f"{objs[int(o[j])][0]!r} (bytes from {int(off[j])} and {int(off[j + 1])})",
            "SP-PACK-5",
        )
