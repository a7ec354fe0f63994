"""The contract every :class:`~shardpoint_core.commit.base.Committer` must pass, shipped for
third-party committers (like the store contract, :mod:`shardpoint_core.stores.testing`).

One situation, one behaviour, one error class, whatever the store: a committed checkpoint is
refused without ``overwrite`` (``CheckpointExistsError``), a bad ``overwrite`` value is an
``InvalidOptionError``, removing a location that holds something but no committed checkpoint
is a ``CheckpointNotFoundError`` and deletes nothing, a live save is never removed or
discarded, an abandoned one is a leftover that ``discard`` removes, and nothing that is not
a leftover is ever discarded. A new committer proves itself with a subclass::

    import pytest
    from shardpoint_core.commit.testing import CommitterTests, FileSite

    class TestMyCommitter(CommitterTests):
        @pytest.fixture
        def committer(self):
            return MyCommitter()

        @pytest.fixture
        def root(self, tmp_path):
            return str(tmp_path)          # a fresh, empty location; targets go below it

        @pytest.fixture
        def site(self):
            return FileSite()             # reads and writes bytes at the committer's locations

        def abandon(self, committer, staging):
            ...                           # what the death of the saving process does

Locations are what the committer takes: paths for a file-system committer, keys of its store
for :class:`~shardpoint_core.commit.object_store.ObjectStoreCommitter`, URLs for a router.
Needs pytest (test extras).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any, Callable, List, Optional, Protocol, Tuple

import pytest

from shardpoint_core.commit.base import Committer
from shardpoint_core.format.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    InvalidOptionError,
)
from shardpoint_core.format.manifest import Manifest, TensorEntry, decode_manifest, encode_manifest
from shardpoint_core.format.spec import MANIFEST_NAME
from shardpoint_core.stores.base import ByteStore

#: values of ``overwrite`` that every committer refuses with InvalidOptionError
BAD_OVERWRITES: Tuple[Any, ...] = ("yes", "no", "True", 1, 0, None, 2.0)
#: a time at which every abandoned save's lease (if the committer has leases) has expired
LATER_S = 10 * 24 * 3600.0


class Site(Protocol):
    """Bytes at a committer's locations, for the contract's own checks."""

    def join(self, location: str, name: str) -> str:
        """The location ``name`` below ``location``."""

    def put(self, location: str, rel: str, data: bytes) -> None:
        """Write ``data`` at ``rel`` (``/``-separated) below ``location``."""

    def get(self, location: str, rel: str) -> Optional[bytes]:
        """The bytes at ``rel`` below ``location``; None where there are none."""

    def keys(self, location: str) -> List[str]:
        """Every object (file) below ``location``, ``/``-separated and relative, sorted."""


class FileSite:
    """:class:`Site` of local paths."""

    def join(self, location: str, name: str) -> str:
        return os.path.join(location, name)

    def put(self, location: str, rel: str, data: bytes) -> None:
        p = os.path.join(location, *rel.split("/"))
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)

    def get(self, location: str, rel: str) -> Optional[bytes]:
        try:
            with open(os.path.join(location, *rel.split("/")), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def keys(self, location: str) -> List[str]:
        out = []
        for d, _dirs, files in os.walk(location):
            rel = os.path.relpath(d, location)
            out += [f if rel == "." else f"{rel}/{f}".replace(os.sep, "/") for f in files]
        return sorted(out)


class StoreSite:
    """:class:`Site` of locations that ``locate`` turns into (store, key): keys of one store
    (``StoreSite.of(store)``) or URLs (``StoreSite(lambda u: locate(u).pair(), url=True)``)."""

    def __init__(
        self, locate: Callable[[str], Tuple[ByteStore, str]], *, url: bool = False
    ) -> None:
        self._locate, self._url = locate, url

    @classmethod
    def of(cls, store: ByteStore) -> "StoreSite":
        return cls(lambda key: (store, key))

    def join(self, location: str, name: str) -> str:
        return f"{location.rstrip('/')}/{name}" if location else name

    def _key(self, location: str, rel: str = "") -> Tuple[ByteStore, str]:
        store, key = self._locate(location)
        return store, "/".join(p for p in (key.strip("/"), rel) if p)

    def put(self, location: str, rel: str, data: bytes) -> None:
        store, key = self._key(location, rel)
        store.put(key, data)

    def get(self, location: str, rel: str) -> Optional[bytes]:
        store, key = self._key(location, rel)
        try:
            return store.get(key)
        except FileNotFoundError:
            return None

    def keys(self, location: str) -> List[str]:
        store, key = self._key(location)
        prefix = f"{key}/" if key else ""
        return sorted(i.key[len(prefix) :] for i in store.list(prefix))


TENSORS = ("a", "b")


class CommitterTests:
    """pytest test methods of the committer contract. Subclasses provide the fixtures
    ``committer``, ``root`` (a fresh location, nothing below it) and ``site`` (a
    :class:`Site` of the committer's locations), and :meth:`abandon`."""

    #: True where ``overwrite="any"`` lets a save replace a location that holds something
    #: other than a checkpoint (a directory on a file system, deleting what it holds);
    #: False where nothing but a checkpoint is ever replaced (object stores, [SP-COMMIT-13])
    any_replaces_other_content: bool = False

    @pytest.fixture
    def committer(self) -> Committer:
        raise NotImplementedError("subclasses provide the committer under test")

    @pytest.fixture
    def root(self) -> str:
        raise NotImplementedError("subclasses provide a fresh, empty location")

    @pytest.fixture
    def site(self) -> Site:
        raise NotImplementedError("subclasses provide a Site of the committer's locations")

    def abandon(self, committer: Any, staging: str) -> None:
        """Make the save at ``staging`` look as it does once its process died: its lock
        released, its lease no longer renewed (judged at ``now + LATER_S``)."""
        raise NotImplementedError("subclasses say what the death of a saving process does")

    # -- helpers ------------------------------------------------------------------------
    @staticmethod
    def target(site: Site, root: str, name: str = "ck") -> str:
        return site.join(root, name)

    @staticmethod
    def stage(
        committer: Any,
        site: Site,
        target: str,
        label: str,
        token: Optional[str] = None,
        as_bytes: bool = False,
    ) -> str:
        """Begin a save of ``target`` and write what a save job writes below its staging
        location (each object names ``label``), the manifest last (a :class:`Manifest`, or
        its bytes with ``as_bytes``); returns the staging location (not yet published)."""
        staging: str = committer.begin(target, token or uuid.uuid4().hex[:12])
        for k in TENSORS:
            site.put(staging, f"tensors/{k}/zarr.json", f'{{"label": "{label}"}}'.encode())
            for c in range(2):
                site.put(staging, f"tensors/{k}/c/{c}", f"{label}:{k}:{c}".encode())
        m = Manifest(
            wire_tree={"dict": [[k, {"tensor": k}] for k in TENSORS]},
            tensors={k: TensorEntry(k, f"tensors/{k}", (2,), "uint8", (1,)) for k in TENSORS},
            objects={},
        )
        committer.write_manifest(staging, encode_manifest(m) if as_bytes else m)
        return staging

    @staticmethod
    def read(site: Site, target: str) -> str:
        """The label of the checkpoint at ``target``, following its manifest, asserting
        that every object it names is there and of one save."""
        data = site.get(target, MANIFEST_NAME)
        assert data is not None, f"no manifest at {target!r}"
        labels = set()
        for e in decode_manifest(data).tensors.values():
            meta = site.get(target, f"{e.array}/zarr.json")
            assert meta is not None, f"{target!r}: {e.array}/zarr.json is missing"
            labels.add(meta.decode().split('"')[3])
            for c in range(2):
                chunk = site.get(target, f"{e.array}/c/{c}")
                assert chunk is not None, f"{target!r}: {e.array}/c/{c} is missing"
                labels.add(chunk.decode().split(":")[0])
        assert len(labels) == 1, f"the checkpoint at {target!r} mixes saves: {labels}"
        return labels.pop()

    @staticmethod
    def labels_below(site: Site, location: str) -> set[str]:
        """The labels of every save object below ``location``."""
        out = set()
        for k in site.keys(location):
            data = site.get(location, k) or b""
            if "/c/" in k:
                out.add(data.decode().split(":")[0])
            elif k.endswith("/zarr.json") and b'"label"' in data:
                out.add(data.decode().split('"')[3])
        return out

    @staticmethod
    def later() -> float:
        return time.time() + LATER_S

    def commit(
        self,
        committer: Any,
        site: Site,
        target: str,
        label: str,
        overwrite: Any = False,
        as_bytes: bool = False,
    ) -> None:
        staging = self.stage(committer, site, target, label, as_bytes=as_bytes)
        committer.publish(staging, target, overwrite=overwrite)

    # -- what is there ------------------------------------------------------------------
    def test_is_a_committer(self, committer: Any) -> None:
        assert isinstance(committer, Committer)

    def test_state_through_a_save_and_its_removal(
        self, committer: Any, root: str, site: Site
    ) -> None:
        t = self.target(site, root)
        assert committer.state(t) == "missing"
        staging = self.stage(committer, site, t, "A")
        # beside the target (a rename) or below it (a marker): never committed before publish
        assert committer.state(t) in ("missing", "incomplete")
        committer.publish(staging, t, overwrite=False)
        assert committer.state(t) == "committed"
        assert self.read(site, t) == "A"
        assert committer.remove(t) is True
        assert committer.state(t) == "missing"
        assert site.keys(t) == []

    def test_other_content_is_incomplete(self, committer: Any, root: str, site: Site) -> None:
        t = self.target(site, root)
        site.put(t, "notes.txt", b"user data")
        assert committer.state(t) == "incomplete"

    # -- check_target -------------------------------------------------------------------
    def test_check_target_missing_accepts_every_overwrite(
        self, committer: Any, root: str, site: Site
    ) -> None:
        t = self.target(site, root)
        for ow in (False, True, "any"):
            committer.check_target(t, ow)
        assert committer.state(t) == "missing"

    def test_check_target_committed(self, committer: Any, root: str, site: Site) -> None:
        t = self.target(site, root)
        self.commit(committer, site, t, "A")
        with pytest.raises(CheckpointExistsError):
            committer.check_target(t, False)
        committer.check_target(t, True)
        committer.check_target(t, "any")
        assert self.read(site, t) == "A"

    def test_check_target_other_content(self, committer: Any, root: str, site: Site) -> None:
        t = self.target(site, root)
        site.put(t, "notes.txt", b"user data")
        for ow in (False, True):
            with pytest.raises(CheckpointExistsError):
                committer.check_target(t, ow)
        if self.any_replaces_other_content:
            committer.check_target(t, "any")
        else:
            with pytest.raises(CheckpointExistsError):
                committer.check_target(t, "any")
        assert site.get(t, "notes.txt") == b"user data"

    def test_bad_overwrite_values_refused(self, committer: Any, root: str, site: Site) -> None:
        t = self.target(site, root)
        self.commit(committer, site, t, "A")
        staging = self.stage(committer, site, t, "B")
        for bad in BAD_OVERWRITES:
            with pytest.raises(InvalidOptionError):
                committer.check_target(t, bad)
            with pytest.raises(InvalidOptionError):
                committer.publish(staging, t, overwrite=bad)
            assert self.read(site, t) == "A"
        committer.abort(staging)
        assert self.read(site, t) == "A"

    # -- a save ---------------------------------------------------------------------------
    def test_publish_fresh_leaves_nothing_else(self, committer: Any, root: str, site: Site) -> None:
        t = self.target(site, root)
        committer.check_target(t, False)
        self.commit(committer, site, t, "A")
        assert self.read(site, t) == "A"
        assert committer.leftovers(root, now=self.later()) == []

    def test_publish_without_overwrite_never_replaces(
        self, committer: Any, root: str, site: Site
    ) -> None:
        t = self.target(site, root)
        a = self.stage(committer, site, t, "A")
        b = self.stage(committer, site, t, "B")
        committer.publish(a, t, overwrite=False)
        with pytest.raises(CheckpointExistsError):
            committer.publish(b, t, overwrite=False)
        committer.abort(b)
        assert self.read(site, t) == "A"
        assert self.labels_below(site, root) == {"A"}
        assert committer.leftovers(root, now=self.later()) == []

    @pytest.mark.parametrize("overwrite", [True, "any"])
    def test_overwrite_replaces_and_deletes_the_old(
        self, committer: Any, root: str, site: Site, overwrite: Any
    ) -> None:
        t = self.target(site, root)
        self.commit(committer, site, t, "A")
        self.commit(committer, site, t, "B", overwrite=overwrite, as_bytes=True)
        assert self.read(site, t) == "B"
        assert self.labels_below(site, root) == {"B"}
        assert committer.leftovers(root, now=self.later()) == []

    def test_abort_removes_the_save_and_never_the_target(
        self, committer: Any, root: str, site: Site
    ) -> None:
        t = self.target(site, root)
        self.commit(committer, site, t, "A")
        b = self.stage(committer, site, t, "B")
        committer.abort(b)
        assert site.keys(b) == []
        assert self.read(site, t) == "A"
        assert self.labels_below(site, root) == {"A"}
        assert committer.leftovers(root, now=self.later()) == []

    # -- retention ------------------------------------------------------------------------
    def test_remove_a_missing_target(self, committer: Any, root: str, site: Site) -> None:
        assert committer.remove(self.target(site, root)) is False

    def test_remove_refuses_what_is_not_committed(
        self, committer: Any, root: str, site: Site
    ) -> None:
        t = self.target(site, root)
        site.put(t, "notes.txt", b"user data")
        site.put(t, "tensors/x/c/0", b"user data")
        with pytest.raises(CheckpointNotFoundError):
            committer.remove(t)
        assert site.keys(t) == ["notes.txt", "tensors/x/c/0"]

    def test_remove_leaves_a_live_save_alone(self, committer: Any, root: str, site: Site) -> None:
        """Retention during a save of the same target: the save's data is not the
        checkpoint's, and it commits whole afterwards."""
        t = self.target(site, root)
        self.commit(committer, site, t, "A")
        b = self.stage(committer, site, t, "B")
        assert committer.remove(t) is True
        assert committer.state(t) != "committed"
        assert committer.remove(t) is False  # only the live save is there now
        committer.publish(b, t, overwrite=True)
        assert self.read(site, t) == "B"
        assert self.labels_below(site, root) == {"B"}

    # -- leftovers ------------------------------------------------------------------------
    def test_a_live_save_is_in_use_and_never_discarded(
        self, committer: Any, root: str, site: Site
    ) -> None:
        t = self.target(site, root)
        b = self.stage(committer, site, t, "B")
        before = site.keys(b)
        los = committer.leftovers(root)
        assert [(lo.target, lo.kind, lo.in_use) for lo in los] == [(t, "tmp", True)]
        assert committer.discard(los[0].path) is False
        assert site.keys(b) == before
        committer.publish(b, t, overwrite=False)
        assert self.read(site, t) == "B"

    def test_an_abandoned_save_is_a_leftover_that_discard_removes(
        self, committer: Any, root: str, site: Site
    ) -> None:
        t = self.target(site, root)
        self.commit(committer, site, t, "A")
        b = self.stage(committer, site, t, "B")
        self.abandon(committer, b)
        later = self.later()
        los = committer.leftovers(root, now=later)
        assert [(lo.target, lo.kind, lo.in_use) for lo in los] == [(t, "tmp", False)]
        assert committer.discard(los[0].path, now=later) is True
        assert committer.leftovers(root, now=later) == []
        assert site.keys(b) == []
        assert self.read(site, t) == "A"
        assert self.labels_below(site, root) == {"A"}

    def test_discard_refuses_what_is_not_a_leftover(
        self, committer: Any, root: str, site: Site
    ) -> None:
        t = self.target(site, root)
        self.commit(committer, site, t, "A")
        other = self.target(site, root, "exports")
        site.put(other, "eval.json", b"user data")
        for loc in (t, other):
            with pytest.raises(InvalidOptionError):
                committer.discard(loc, now=self.later())
        assert self.read(site, t) == "A"
        assert site.get(other, "eval.json") == b"user data"

    def test_user_names_are_never_leftovers(self, committer: Any, root: str, site: Site) -> None:
        """Objects named like a save's (``save-20240101/``, ``step_00000001/save-<hex>/``)
        that the protocol did not write are not leftovers and survive every clean-up."""
        t = self.target(site, root)
        self.commit(committer, site, t, "A")
        user = {
            ("exports", "save-20240101/eval.json"),
            ("exports", "save-0123456789ab/notes.txt"),
            ("notes", "tmp-a1b2c3/x.txt"),
        }
        for name, rel in user:
            site.put(self.target(site, root, name), rel, b"user data")
        assert committer.leftovers(root, now=self.later()) == []
        for name, rel in user:
            assert site.get(self.target(site, root, name), rel) == b"user data"

    def test_restore_never_replaces_a_checkpoint(
        self, committer: Any, root: str, site: Site
    ) -> None:
        t = self.target(site, root)
        self.commit(committer, site, t, "A")
        b = self.stage(committer, site, t, "B")
        self.abandon(committer, b)
        (lo,) = committer.leftovers(root, now=self.later())
        with pytest.raises(CheckpointExistsError):
            committer.restore(lo.path, t)
        assert self.read(site, t) == "A"
        assert committer.discard(lo.path, now=self.later()) is True
