"""The committers of :class:`~shardpoint_core.transactions.backend.ZarrBackend`, on its paths: a
local path goes to the POSIX committer (atomic rename of a staging directory, format.md 9),
a URL to the object-store committer of its bucket (a marker object, format.md 9.1). Both
implement :class:`~shardpoint_core.commit.base.Committer`; these only route each call."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple, Union

from shardpoint_core.commit.base import Overwrite
from shardpoint_core.commit.object_store import ObjectStoreCommitter
from shardpoint_core.commit.posix import PosixCommitter
from shardpoint_core.format.manifest import Manifest
from shardpoint_core.stores.base import ByteStore
from shardpoint_core.stores.location import locate
from shardpoint_core.stores.registry import is_local, url_of


class UrlCommitter:
    """The object-store committer on URLs: each call goes to the
    :class:`ObjectStoreCommitter` of the URL's bucket (``locate(url)`` -> store, key)."""

    name = "object-store-marker"

    def __init__(self, locate: Callable[[str], Tuple[ByteStore, str]]) -> None:
        self._locate = locate
        # staging URL -> what write_manifest was given, prepared (the committers of a
        # bucket are made per call; the manifest waits here for publish)
        self._pending: Dict[str, Tuple[bytes, bool]] = {}

    def _at(self, url: str) -> Tuple[ObjectStoreCommitter, str]:
        """The committer of ``url``'s bucket and the key of ``url`` in it."""
        store, key = self._locate(url)
        return ObjectStoreCommitter(store), key

    def state(self, target: str) -> str:
        c, k = self._at(target)
        return c.state(k)

    def check_target(self, target: str, overwrite: Overwrite) -> None:
        c, k = self._at(target)
        c.check_target(k, overwrite)

    def begin(self, target: str, token: str) -> str:
        c, k = self._at(target)
        return url_of(target, c.begin(k, token))

    def write_manifest(self, staging: str, data: Union[bytes, Manifest]) -> None:
        c, k = self._at(staging)
        self._pending[staging] = c.prepare_manifest(k, data)

    def publish(
        self,
        staging: str,
        target: str,
        *,
        overwrite: Overwrite,
        manifest: Optional[bytes] = None,
        marker: Optional[bytes] = None,
    ) -> None:
        pending = self._pending.pop(staging, None)
        if manifest is None and marker is None and pending is not None:
            marker, manifest = (pending[0], None) if pending[1] else (None, pending[0])
        c, k = self._at(target)
        c.publish(
            self._locate(staging)[1], k, overwrite=overwrite, manifest=manifest, marker=marker
        )

    def abort(self, staging: str) -> None:
        self._pending.pop(staging, None)
        c, k = self._at(staging)
        c.abort(k)

    def remove(self, target: str) -> bool:
        c, k = self._at(target)
        return c.remove(k)

    def leftovers(self, directory: str, *, now: Optional[float] = None) -> list[Any]:
        c, k = self._at(directory)
        return [
            replace(lo, path=url_of(directory, lo.path), target=url_of(directory, lo.target))
            for lo in c.leftovers(k, now=now)
        ]

    def restore(self, leftover: str, target: str) -> bool:
        c, k = self._at(leftover)
        return c.restore(k, self._locate(target)[1])

    def discard(self, leftover: str, *, now: Optional[float] = None) -> bool:
        c, k = self._at(leftover)
        return c.discard(k, now=now)


class PathCommitter:
    """Routes each call by its path: local paths to ``posix``, URLs to ``urls``. What only
    the POSIX committer has (``staging_for``, ``create_staging``, ``holds_checkpoints``...)
    is the POSIX committer's."""

    def __init__(self, posix: PosixCommitter, urls: UrlCommitter) -> None:
        self.posix, self.urls = posix, urls

    @property
    def name(self) -> str:
        return self.posix.name

    def __repr__(self) -> str:
        return f"PathCommitter({self.posix!r}, {self.urls.name})"

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.posix, attr)

    def of(self, path: str) -> Union[PosixCommitter, UrlCommitter]:
        """The committer of ``path``."""
        return self.posix if is_local(path) else self.urls

    def state(self, target: str) -> str:
        return self.of(target).state(target)

    def check_target(self, target: str, overwrite: Overwrite, *args: Any, **kw: Any) -> None:
        self.of(target).check_target(target, overwrite, *args, **kw)

    def begin(self, target: str, token: str) -> str:
        return self.of(target).begin(target, token)

    def write_manifest(self, staging: str, data: Any) -> None:
        self.of(staging).write_manifest(staging, data)

    def publish(self, staging: str, target: str, *, overwrite: Overwrite, **kw: Any) -> None:
        self.of(target).publish(staging, target, overwrite=overwrite, **kw)

    def abort(self, staging: str) -> None:
        self.of(staging).abort(staging)

    def remove(self, target: str) -> bool:
        return self.of(target).remove(target)

    def leftovers(self, directory: str, *, now: Optional[float] = None) -> list[Any]:
        return self.of(directory).leftovers(directory, now=now)

    def restore(self, leftover: str, target: str) -> bool:
        return self.of(leftover).restore(leftover, target)

    def discard(self, leftover: str, *, now: Optional[float] = None) -> bool:
        return self.of(leftover).discard(leftover, now=now)


_DEFAULT: Optional[PathCommitter] = None


def default_committer() -> PathCommitter:
    """The committer of the default backend's kind, for callers that publish or remove
    checkpoints without a backend of their own (managers, recovery): POSIX with ``fsync`` on
    local paths, the marker protocol on URLs (each located by
    :func:`~shardpoint_core.stores.location.locate`)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = PathCommitter(PosixCommitter(), UrlCommitter(lambda u: locate(u).pair()))
    return _DEFAULT


if TYPE_CHECKING:
    # static checks that the class satisfies the protocol it claims (runtime_checkable
    # compares method names only); mypy fails here on a regression
    from shardpoint_core.commit.base import Committer

    def _is_committer_urlcommitter(x: UrlCommitter) -> Committer:
        return x

    def _is_committer_pathcommitter(x: PathCommitter) -> Committer:
        return x
