"""Compare two checkpoints (any readable format) key by key and, for tensors, chunk by chunk.

Keys are matched by their path; a key left unmatched is then matched by its flat name (the
components joined by '.', as safetensors and DCP name tensors), so a safetensors export of
``model/weight`` is compared with it as ``model.weight``. Values and sharded objects of one
side that the other's format cannot hold (safetensors holds tensors only) are listed apart,
not as differences.

Reports keys only in one, shape/dtype differences and value differences: bitwise by default
(NaN payloads and -0.0 count), or within ``atol + rtol * |b|`` when a tolerance is given; for
each differing tensor the number of differing elements, the first one's index and the largest
absolute difference. Tensors are read a block of rows at a time, so memory stays bounded.

Example::

    rep = diff_checkpoints("ckpt/a", "ckpt/b")
    for t in rep.tensors:
        print(t.key, t.differing, t.first_index, t.max_abs_diff)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from shardpoint.tree import values as _values
from shardpoint.tools.convert import open_source
from shardpoint.tools.convert.base import Source, TensorInfo, flat_name, key_of
from shardpoint.tree.views import to_numpy

# formats whose files hold tensors only: a value or object of the other side cannot be there
TENSORS_ONLY = {"safetensors": "safetensors holds tensors only"}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass
class TensorDiff:
    """One tensor whose values differ."""

    key: str
    elements: int
    differing: int
    first_index: tuple
    max_abs_diff: Optional[float]

    def to_dict(self) -> dict:
        m = self.max_abs_diff
        return {
            "key": self.key,
            "elements": self.elements,
            "differing": self.differing,
            "first_index": list(self.first_index),
            "max_abs_diff": m if m is None or math.isfinite(m) else repr(m),
        }


@dataclass
class DiffReport:
    """Everything that differs between ``a`` and ``b`` (empty lists: equal)."""

    a: str
    b: str
    exact: bool = True
    atol: float = 0.0
    rtol: float = 0.0
    only_a: list = field(default_factory=list)
    only_b: list = field(default_factory=list)
    mismatched: list = field(default_factory=list)  # [(key, "shape (2, 3) vs (3, 2)")]
    tensors: list = field(default_factory=list)  # [TensorDiff]
    values: list = field(default_factory=list)  # [(key, repr a, repr b)]
    compared_tensors: int = 0
    compared_bytes: int = 0
    renamed: list = field(default_factory=list)  # [(key in A, key in B)] by flat name
    not_comparable: list = field(default_factory=list)  # [(key, "only in A: why")]
    tensors_a: int = 0
    tensors_b: int = 0

    @property
    def nothing_compared(self) -> bool:
        """Tensors on some side but none in both: no verdict on values was reached."""
        return self.compared_tensors == 0 and (self.tensors_a + self.tensors_b) > 0

    @property
    def equal(self) -> bool:
        return not (
            self.only_a
            or self.only_b
            or self.mismatched
            or self.tensors
            or self.values
            or self.nothing_compared
        )

    def to_dict(self) -> dict:
        return {
            "a": self.a,
            "b": self.b,
            "equal": self.equal,
            "exact": self.exact,
            "atol": self.atol,
            "rtol": self.rtol,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "mismatched": [{"key": k, "what": w} for k, w in self.mismatched],
            "tensors": [t.to_dict() for t in self.tensors],
            "values": [{"key": k, "a": x, "b": y} for k, x, y in self.values],
            "compared_tensors": self.compared_tensors,
            "compared_bytes": self.compared_bytes,
            "tensors_a": self.tensors_a,
            "tensors_b": self.tensors_b,
            "nothing_compared": self.nothing_compared,
            "renamed": [{"a": x, "b": y} for x, y in self.renamed],
            "not_comparable": [{"key": k, "why": w} for k, w in self.not_comparable],
        }


def _same_value(x: Any, y: Any) -> bool:
    try:
        return _values.pack(x) == _values.pack(y)
    except Exception:  # noqa: BLE001 - not packable: fall back to equality of reprs
        return repr(x) == repr(y)


def _bits_differ(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    an, bn = to_numpy(a).reshape(-1), to_numpy(b).reshape(-1)
    size = an.dtype.itemsize
    if size in _UINT:
        return an.view(_UINT[size]) != bn.view(_UINT[size])
    return (
        an.view(np.uint64).reshape(-1, size // 8) != bn.view(np.uint64).reshape(-1, size // 8)
    ).any(axis=1)


def _abs_diff(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """(|a - b| in float64, |b|, equal or both NaN) for a numeric block, flattened."""
    wide = torch.complex128 if a.is_complex() else torch.float64
    x, y = a.reshape(-1).to(wide), b.reshape(-1).to(wide)
    d = (x - y).abs()
    same = (x == y) | (torch.isnan(x) & torch.isnan(y))
    d[same] = 0.0
    return d, y.abs(), same


def compare_tensor(
    sa: Source,
    ta: TensorInfo,
    sb: Source,
    tb: TensorInfo,
    *,
    exact: bool,
    atol: float,
    rtol: float,
    block_elems: int = 4 << 20,
    progress: Optional[Callable] = None,
) -> Optional[TensorDiff]:
    """Compare one tensor present in both, a block of rows at a time; None if equal."""
    shape = tuple(ta.shape)
    n = math.prod(shape)
    row = math.prod(shape[1:]) if shape else 1
    rows = shape[0] if shape else 1
    step = max(1, block_elems // max(row, 1))
    differing = 0
    first: Optional[tuple[int, ...]] = None
    worst: Optional[float] = None
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        a, b = sa.read_rows(ta, lo, hi), sb.read_rows(tb, lo, hi)
        if a.numel():
            if exact:
                bad = _bits_differ(a, b)
            else:
                d, babs, same = _abs_diff(a, b)
                bad = (~((d <= atol + rtol * babs) | same)).numpy()
            nbad = int(bad.sum())
            if nbad:
                differing += nbad
                if first is None:
                    flat = lo * row + int(np.flatnonzero(bad)[0])
                    first = tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ()
                if a.dtype != torch.bool:
                    d, _, _ = _abs_diff(a, b)
                    m = float(d.max()) if not torch.isnan(d).any() else float("nan")
                    worst = m if worst is None or not m <= worst else worst
        if progress:
            progress(a.numel() * a.element_size())
        del a, b
    if first is None:  # set with the first differing element: none differed
        return None
    return TensorDiff(ta.key, n, differing, first, worst)


def match_flat_names(only_a: set, only_b: set) -> dict:
    """``{path in B: path in A}`` for unmatched paths whose flat names (components joined by
    '.') agree and name one path on each side (``("model", "weight")`` and
    ``("model.weight",)``); an ambiguous flat name matches nothing."""

    def by_name(paths: set) -> dict:
        out: dict = {}
        for p in paths:
            out.setdefault(flat_name(p), []).append(p)
        return {n: ps[0] for n, ps in out.items() if len(ps) == 1}

    na, nb = by_name(only_a), by_name(only_b)
    return {nb[n]: na[n] for n in na.keys() & nb.keys()}


def diff_sources(
    sa: Source,
    sb: Source,
    *,
    atol: Optional[float] = None,
    rtol: Optional[float] = None,
    progress: Optional[Callable] = None,
) -> DiffReport:
    """Compare two open sources (see :func:`diff_checkpoints`)."""
    exact = atol is None and rtol is None
    rep = DiffReport(sa.path, sb.path, exact, float(atol or 0.0), float(rtol or 0.0))
    ta = {t.path: t for t in sa.tensors}
    tb = {t.path: t for t in sb.tensors}
    rep.tensors_a, rep.tensors_b = len(ta), len(tb)
    va = {**sa.values, **{p: list(v) for p, v in sa.objects.items()}}
    vb = {**sb.values, **{p: list(v) for p, v in sb.objects.items()}}
    keys_a, keys_b = set(ta) | set(va), set(tb) | set(vb)
    ren = match_flat_names(keys_a - keys_b, keys_b - keys_a)
    if ren:  # B's entries under A's paths (the report names A's keys)
        rep.renamed = sorted((key_of(pa), key_of(pb)) for pb, pa in ren.items())
        tb = {ren.get(p, p): t for p, t in tb.items()}
        vb = {ren.get(p, p): v for p, v in vb.items()}
        keys_b = set(tb) | set(vb)
    rep.only_a = sorted(key_of(p) for p in keys_a - keys_b)
    rep.only_b = sorted(key_of(p) for p in keys_b - keys_a)
    for side, other, mine, only in (("A", sb, va, rep.only_a), ("B", sa, vb, rep.only_b)):
        why = TENSORS_ONLY.get(other.format)
        if why:  # a value the other format cannot hold is no difference between them
            out = {key_of(p) for p in mine} & set(only)
            rep.not_comparable += [
                (k, f"only in {side}: a value or object, and {why}") for k in sorted(out)
            ]
            only[:] = [k for k in only if k not in out]
    for p in sorted(keys_a & keys_b, key=key_of):
        k = key_of(p)
        if (p in ta) != (p in tb):
            rep.mismatched.append(
                (k, "a tensor in " + ("A" if p in ta else "B") + ", a value in the other")
            )
            continue
        if p not in ta:
            if not _same_value(va[p], vb[p]):
                rep.values.append((k, repr(va[p])[:200], repr(vb[p])[:200]))
            continue
        x, y = ta[p], tb[p]
        if x.shape != y.shape or x.dtype != y.dtype:
            what = []
            if x.shape != y.shape:
                what.append(f"shape {list(x.shape)} vs {list(y.shape)}")
            if x.dtype != y.dtype:
                what.append(f"dtype {str(x.dtype)[6:]} vs {str(y.dtype)[6:]}")
            rep.mismatched.append((k, ", ".join(what)))
            if progress:
                progress(x.nbytes)
            continue
        td = compare_tensor(
            sa, x, sb, y, exact=exact, atol=rep.atol, rtol=rep.rtol, progress=progress
        )
        rep.compared_tensors += 1
        rep.compared_bytes += x.nbytes
        if td is not None:
            rep.tensors.append(td)
    sa.check_unchanged()  # a checkpoint replaced while it was read: no mixed report
    sb.check_unchanged()
    return rep


def diff_checkpoints(
    a: str,
    b: str,
    *,
    atol: Optional[float] = None,
    rtol: Optional[float] = None,
    from_a: Optional[str] = None,
    from_b: Optional[str] = None,
    progress: Optional[Callable] = None,
    on_open: Optional[Callable] = None,
    trust_pickle: bool = False,
) -> DiffReport:
    """Compare the checkpoints at ``a`` and ``b`` (shardpoint or any format ``convert``
    reads). ``on_open(sa, sb)`` is called once both are open. A DCP or Megatron side needs
    ``trust_pickle=True``: their metadata is read by unpickling it."""
    with (
        open_source(a, from_a, trust_pickle=trust_pickle) as sa,
        open_source(b, from_b, trust_pickle=trust_pickle) as sb,
    ):
        if on_open:
            on_open(sa, sb)
        return diff_sources(sa, sb, atol=atol, rtol=rtol, progress=progress)
