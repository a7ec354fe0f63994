"""Orbax checkpoints (``orbax-checkpoint`` 0.12, the JAX ecosystem's format) as a conversion
source: a PyTree/Standard checkpoint directory, a ``CheckpointManager`` step directory (one
item per subdirectory, e.g. ``default/`` or ``state/`` and ``metrics/``), OCDBT or not, Zarr
v2 or v3, saved by one process or many, from arrays on any number of devices.

Everything goes through Orbax and TensorStore themselves: Orbax's metadata API gives the tree
(paths, shapes, dtypes, chunk shapes), Orbax builds each array's TensorStore read spec
(``type_handlers.get_json_tspec_read``, what its own restore opens) and TensorStore reads
windows of rows of it, a band of whole storage chunks at a time, so memory stays bounded by
the block asked for plus one band of Orbax's chunks (a chunk is stored compressed and is
decoded whole in any case). Nothing restores the whole tree. Measured on 4 x 64 MiB float32
arrays (one run): peak memory growth 62 MiB converting with Orbax chunks of 8 MiB, 203 MiB
with Orbax's default of one chunk per array (per device shard), against 463-479 MiB for
Orbax's own restore of the tree.

Python scalars Orbax stores as 0-d arrays become shardpoint values (as Orbax's
``ScalarHandler`` restores them); strings (``_strings.json``) and JSON items are read with
Orbax's own handlers. What shardpoint cannot hold (a dtype outside its table, an item of
another kind) is reported in ``skipped``. Orbax records a namedtuple as a dict of its fields,
so an optax state's keys name them (``opt_state/0/mu``). A missing or truncated file is a
ConversionError naming the array; Orbax keeps no checksums, so a flipped bit in its files
cannot be told from data (measured: one flipped byte, converted without error).

Orbax (and with it JAX) is imported only when an Orbax source is opened.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Optional

import torch

from shardpoint.tree import dtypes
from shardpoint_core.format.errors import ConversionError, UnsupportedValueError
from shardpoint.tools.convert.base import Source, TensorInfo, key_of

FORMAT = "orbax"
TREE_FILE = "_METADATA"  # a PyTree checkpoint's tree metadata
STEP_FILE = "_CHECKPOINT_METADATA"  # a checkpoint's (or a manager step's) metadata
LEGACY_AGGREGATE = "checkpoint"  # msgpack of leaves saved with aggregate=True
TMP_MARK = ".orbax-checkpoint-tmp"  # in the name of a save not yet committed


def _isfile(path: str, name: str) -> bool:
    return os.path.isfile(os.path.join(path, name))


def _steps(path: str) -> list:
    """The step directories of a ``CheckpointManager`` root: ``[(step, name)]``, by step."""
    out = []
    try:
        names = os.listdir(path)
    except OSError:
        return []
    for name in names:
        m = re.fullmatch(r"(?:.*?_)?(\d+)", name)
        if m and _isfile(os.path.join(path, name), STEP_FILE):
            out.append((int(m.group(1)), name))
    return sorted(out)


def _json_files(d: str) -> list:
    """The data files of a JSON item directory (not Orbax's commit marker)."""
    try:
        return sorted(
            n
            for n in os.listdir(d)
            if os.path.isfile(os.path.join(d, n))
            and n != "commit_success.txt"
            and not n.startswith((".", "_"))
        )
    except OSError:
        return []


def orbax_layout(path: str) -> Optional[str]:
    """``"tree"`` (a PyTree/Standard checkpoint), ``"step"`` (a CheckpointManager step of
    items), ``"root"`` (a CheckpointManager directory of steps) or None. File names only."""
    path = str(path)
    if not os.path.isdir(path):
        return None
    if _isfile(path, TREE_FILE) or _isfile(path, "manifest.ocdbt"):
        return "tree"
    if _isfile(path, STEP_FILE):
        return "step"
    return "root" if _steps(path) else None


def is_orbax(path: str) -> bool:
    return orbax_layout(path) is not None


def latest_step(path: str) -> str:
    """The newest step directory of a CheckpointManager root (what to convert)."""
    return os.path.join(str(path), _steps(str(path))[-1][1])


def _import_orbax() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ConversionError(
            f"reading an Orbax checkpoint needs the orbax-checkpoint "
            "package (and JAX): pip install orbax-checkpoint, or "
            f"shardpoint[orbax] ({e})"
        ) from None
    return ocp


def _why(e: BaseException) -> str:
    """The first line of a dependency's error, without its traceback."""
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:300] if s else ''}"


class _Array:
    """Where an Orbax array lives: its item directory, Orbax's name for it, its layout."""

    def __init__(self, item: str, name: str, ocdbt: bool, zarr3: bool, chunk: tuple) -> None:
        self.item, self.name, self.ocdbt, self.zarr3, self.chunk = item, name, ocdbt, zarr3, chunk


class OrbaxSource(Source):
    """An Orbax checkpoint directory or CheckpointManager step directory (see the module)."""

    def __init__(self, path: str) -> None:
        super().__init__(str(path), FORMAT)
        layout = orbax_layout(self.path)
        if layout is None:
            raise ConversionError(
                f"{self.path!r} is not an Orbax checkpoint (no {TREE_FILE}, "
                f"{STEP_FILE} or manifest.ocdbt)"
            )
        if TMP_MARK in os.path.basename(os.path.normpath(self.path)):
            raise ConversionError(
                f"{self.path!r} is an Orbax save that did not finish (Orbax "
                "renames it when the save commits); convert a committed "
                "checkpoint"
            )
        if layout == "root":
            steps = _steps(self.path)
            raise ConversionError(
                f"{self.path!r} is an Orbax CheckpointManager directory of {len(steps)} steps "
                f"(the last: {', '.join(n for _, n in steps[-5:])}); convert one step: "
                f"`shardpoint convert {latest_step(self.path)} DST`"
            )
        self._ocp = _import_orbax()
        from orbax.checkpoint import type_handlers

        self._th = type_handlers
        self._contexts: dict = {}
        self._arrays: dict = {}  # path -> _Array
        self._store: Any = None  # (path, TensorStore) of the tensor being read
        self._band: Any = None  # (path, lo, hi, rows) last band of rows read
        if layout == "tree":
            self._add_tree((), self.path)
        else:
            self._add_step()

    # ------------------------------------------------------------------ listing
    def _add_step(self) -> None:
        """A manager step: each item subdirectory under its name, a lone ``default`` item
        (a manager of one unnamed item) at the root, as Orbax restores it."""
        try:
            with open(os.path.join(self.path, STEP_FILE)) as f:
                handlers = json.load(f).get("item_handlers")
        except (OSError, ValueError, AttributeError) as e:
            raise ConversionError(
                f"{self.path!r}: Orbax's {STEP_FILE} is not readable JSON: {e}"
            ) from None
        if not isinstance(handlers, dict):
            handlers = {
                n: None
                for n in sorted(os.listdir(self.path))
                if os.path.isdir(os.path.join(self.path, n))
            }
        items = sorted(handlers)
        if not items:
            raise ConversionError(f"{self.path!r}: an Orbax step directory with no items")
        for name in items:
            d = os.path.join(self.path, name)
            prefix = () if items == ["default"] else (name,)
            handler = str(handlers.get(name) or "")
            if orbax_layout(d) == "tree":
                self._add_tree(prefix, d)
            elif "Json" in handler or (not handler and len(_json_files(d)) == 1):
                self._add_json(prefix, d)
            else:
                self.skipped.append(
                    (
                        key_of((name,)),
                        f"Orbax item {name!r} was saved by "
                        f"{handler or 'an unknown handler'}; shardpoint converts "
                        "PyTree/Standard and JSON items",
                    )
                )

    def _add_json(self, prefix: tuple, d: str) -> None:
        """A JSON item (``JsonSave``; the file is named ``metadata``, or after the item as
        the manager's ``metrics`` is), read by Orbax's ``JsonCheckpointHandler``."""
        from etils import epath

        files = _json_files(d)
        if len(files) != 1:
            raise ConversionError(
                f"Orbax JSON item {d!r} holds {len(files)} data files {files[:5]}, not one"
            )
        try:
            v = self._ocp.JsonCheckpointHandler(filename=files[0]).restore(epath.Path(d))
        except Exception as e:  # noqa: BLE001 - the handler's own errors, reported
            raise ConversionError(f"Orbax JSON item {d!r} is not readable: {_why(e)}") from None
        self.values[prefix or (os.path.basename(d),)] = v

    def _add_tree(self, prefix: tuple, d: str) -> None:
        from etils import epath

        ocp = self._ocp
        item = epath.Path(os.path.abspath(d))
        try:
            md = ocp.PyTreeCheckpointHandler().metadata(item)
            ocdbt = bool(self._th.is_ocdbt_checkpoint(item))
        except Exception as e:  # noqa: BLE001 - Orbax's own parse errors
            raise ConversionError(
                f"{d!r}: Orbax cannot read the checkpoint's metadata (the "
                f"tree in {TREE_FILE}, each array's shape and dtype): "
                f"{_why(e)}; damaged or incomplete?"
            ) from None
        if _isfile(d, LEGACY_AGGREGATE):
            self.skipped.append(
                (
                    key_of(prefix) if prefix else "(root)",
                    f"{os.path.join(d, LEGACY_AGGREGATE)!r}: leaves saved with "
                    "Orbax's removed aggregate=True option (msgpack) are not "
                    "converted; restore the tree with Orbax and save it again",
                )
            )
        zarr3 = bool(getattr(md, "use_zarr3", False))
        strings: list[tuple[tuple, str]] = []  # (path, the string's name)
        for path, leaf in _walk(md.tree, prefix):
            # a tree that is one leaf (``save(path, array)``): shardpoint's root is a dict
            self._add_leaf(path or ("array",), leaf, str(item), ocdbt, zarr3, strings)
        if strings:
            self._read_strings(item, strings)

    def _add_leaf(
        self,
        path: tuple,
        leaf: Any,
        item: str,
        ocdbt: bool,
        zarr3: bool,
        strings: list[tuple[tuple, str]],
    ) -> None:
        value = self._ocp.metadata.value
        if leaf is None or isinstance(leaf, (dict, list, tuple)):  # None, empty containers
            self.values[path] = leaf
        elif isinstance(leaf, value.StringMetadata):
            strings.append((path, leaf.name))
        elif isinstance(leaf, value.ArrayMetadata):
            try:
                dt = dtypes.from_numpy(leaf.dtype, f"Orbax array {key_of(path)!r}")
            except UnsupportedValueError as e:
                self.skipped.append((key_of(path), str(e)))
                return
            chunk = tuple(getattr(leaf.storage, "chunk_shape", None) or leaf.shape)
            a = _Array(item, leaf.name, ocdbt, zarr3, chunk)
            if isinstance(leaf, value.ScalarMetadata):
                self.values[path] = self._read(path, a, dt, ()).item()
                return
            self.tensors.append(TensorInfo(path, tuple(leaf.shape), dt.torch))
            self._arrays[path] = a
        else:
            self.skipped.append(
                (
                    key_of(path),
                    f"Orbax leaf of kind {type(leaf).__name__}, which shardpoint does not convert",
                )
            )

    def _read_strings(self, item: Any, strings: list[tuple[tuple, str]]) -> None:
        """Strings through Orbax's ``StringHandler`` (``_strings.json``), in one call."""
        from orbax.checkpoint._src.asyncio_utils import run_sync

        ctx = self._context(False)
        infos = [
            self._th.ParamInfo(name=name, parent_dir=item, keypath=path, ts_context=ctx)
            for path, name in strings
        ]
        try:
            got = run_sync(self._th.StringHandler().deserialize(infos))
        except Exception as e:  # noqa: BLE001
            raise ConversionError(
                f"{str(item)!r}: Orbax cannot read its strings "
                f"(_strings.json) {[key_of(p) for p, _ in strings[:5]]}: "
                f"{_why(e)}"
            ) from None
        for (path, _), v in zip(strings, got):
            self.values[path] = v

    # ------------------------------------------------------------------ reading
    def _context(self, ocdbt: bool) -> Any:
        if ocdbt not in self._contexts:
            self._contexts[ocdbt] = self._th.get_ts_context(use_ocdbt=ocdbt)
        return self._contexts[ocdbt]

    def _open(self, path: tuple, a: _Array) -> Any:
        """The TensorStore of one Orbax array, opened with the spec Orbax's restore uses."""
        import tensorstore as ts
        from etils import epath

        if self._store is not None and self._store[0] == path:
            return self._store[1]
        self._store = None
        info = self._th.ParamInfo(
            name=a.name,
            parent_dir=epath.Path(a.item),
            is_ocdbt_checkpoint=a.ocdbt,
            use_zarr3=a.zarr3,
            ts_context=self._context(a.ocdbt),
            raise_array_data_missing_error=True,
        )
        try:
            spec = self._th.get_json_tspec_read(info, use_ocdbt=a.ocdbt)
            store = ts.open(spec, read=True, context=self._context(a.ocdbt)).result()
        except Exception as e:  # noqa: BLE001 - tensorstore's errors, named by the array
            raise self._damaged(path, a, e) from None
        self._store = (path, store)
        return store

    def _damaged(self, path: tuple, a: _Array, e: BaseException) -> ConversionError:
        return ConversionError(
            f"Orbax array {key_of(path)!r} (Orbax name {a.name!r} in {a.item!r}) cannot be "
            f"read: {_why(e)}; the checkpoint is damaged or incomplete (a missing or truncated "
            "file under d/ or ocdbt.process_*/?)"
        )

    def _read(self, path: tuple, a: _Array, dt: Any, box: tuple) -> torch.Tensor:
        store = self._open(path, a)
        try:
            arr = store[box].read().result() if box else store.read().result()
        except Exception as e:  # noqa: BLE001
            raise self._damaged(path, a, e) from None
        if arr.dtype != dt.numpy:
            raise ConversionError(
                f"Orbax array {key_of(path)!r}: stored as {arr.dtype}, its metadata says {dt.numpy}"
            )
        return dtypes.numpy_to_torch(arr)

    def read_band(self, t: TensorInfo, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` of ``t`` read from storage (the unit of I/O; :meth:`read_rows`
        asks for bands of whole storage chunks)."""
        dt = dtypes.from_torch(t.dtype)
        return self._read(t.path, self._arrays[t.path], dt, (slice(lo, hi),) if t.shape else ())

    def read_rows(self, t: TensorInfo, start: int, stop: int) -> torch.Tensor:
        if not t.shape:
            return self.read_band(t, 0, 0)
        b = self._band
        if b is None or b[0] != t.path or not b[1] <= start <= stop <= b[2]:
            self._band = None
            c = max(1, self._arrays[t.path].chunk[0] or 1)
            lo, hi = start // c * c, min(t.shape[0], math.ceil(stop / c) * c)
            b = self._band = (t.path, lo, hi, self.read_band(t, lo, hi))
        return b[3][start - b[1] : stop - b[1]]

    def read(self, t: TensorInfo) -> torch.Tensor:
        return self.read_rows(t, 0, t.shape[0] if t.shape else 0).contiguous()

    def close(self) -> None:
        self._store = self._band = None
        self._contexts.clear()


def _walk(node: Any, path: tuple):
    """``(path, leaf)`` of Orbax's metadata tree: dicts by key, lists and tuples by index;
    an empty container below the root is a leaf (a value)."""
    if isinstance(node, dict) and (node or not path):
        for k, v in node.items():
            yield from _walk(v, path + (k,))
    elif isinstance(node, (list, tuple)) and (node or not path):
        for i, v in enumerate(node):
            yield from _walk(v, path + (i,))
    else:
        yield path, node


__all__ = ["OrbaxSource", "is_orbax", "latest_step", "orbax_layout"]
