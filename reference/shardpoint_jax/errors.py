"""Errors of shardpoint_jax: one class per failure, named as in the spec's vectors
(``spec/vectors/invalid/*/expected.json``). ``spec_id`` carries the requirement broken; the
message starts with it in brackets, names the key, what was expected, what was found, the fix."""
from __future__ import annotations

from typing import Optional


class ShardpointError(Exception):
    """Base class of every error shardpoint_jax raises on purpose."""

    def __init__(self, message: str, *, spec_id: Optional[str] = None) -> None:
        self.spec_id = spec_id
        super().__init__(f"[{spec_id}] {message}" if spec_id else message)


class CheckpointNotFoundError(ShardpointError, FileNotFoundError):
    """Nothing exists at the path given to load."""


class CheckpointExistsError(ShardpointError, FileExistsError):
    """save(overwrite=False) found something at the target path."""


class IncompleteCheckpointError(ShardpointError):
    """A directory without manifest.msgpack: a save that crashed or is still running."""


class CorruptCheckpointError(ShardpointError):
    """Stored bytes that break the format: checksums, missing chunks, malformed manifest."""


class UnsupportedFormatError(ShardpointError):
    """A newer major version, or a must-understand field or codec this reader lacks."""


class InvalidKeyError(ShardpointError, ValueError):
    """A tree key that cannot be encoded (or a stored key not in canonical form)."""


class UnsupportedValueError(ShardpointError, TypeError):
    """A leaf that is neither an array, a sharded object nor a msgpack value."""


class InvalidShardingError(ShardpointError, ValueError):
    """Holdings that break the replica, coverage or object rules of a save."""


class LayoutMismatchError(ShardpointError, ValueError):
    """A load target that disagrees with the checkpoint (shape, dtype, grid, missing key)."""


class SaveFailedError(ShardpointError):
    """Another process of a collective save failed; nothing was committed."""


class ResourceLimitError(ShardpointError, MemoryError):
    """A well-formed checkpoint asks for more than this reader will allocate."""


class InvalidRequestError(ShardpointError, ValueError):
    """The request itself is wrong (a region outside the array, a bad argument)."""
