"""Every exception shardpoint raises on purpose, in one place.

All derive from :class:`ShardpointError`, so callers can catch the family. Messages name the
key, what was expected, what was found and, where there is one, the fix. ``spec_id`` carries
the requirement ID of ``spec/`` that the failure violates, when there is one, and
``category`` the spec's failure category (format.md section 10: ``corrupt``, ``incomplete``,
``unsupported``, ``layout-mismatch``, ``resource-limit``, ``caller-error``).
"""

from __future__ import annotations


class ShardpointError(Exception):
    """Base class of every error shardpoint raises deliberately."""

    category = "caller-error"

    def __init__(self, message: str, *, spec_id: str | None = None) -> None:
        self.spec_id = spec_id
        super().__init__(f"[{spec_id}] {message}" if spec_id else message)


class CheckpointNotFoundError(ShardpointError, FileNotFoundError):
    """The path does not exist, or holds nothing that looks like a checkpoint."""

    category = "incomplete"


class CheckpointExistsError(ShardpointError, FileExistsError):
    """``save(..., overwrite=False)`` found a committed checkpoint at the target path."""


class IncompleteCheckpointError(ShardpointError):
    """The directory exists but has no manifest: an unfinished save (crashed or still running)
    or an incomplete copy; either way not a checkpoint."""

    category = "incomplete"


class CorruptCheckpointError(ShardpointError):
    """Stored bytes fail a check: checksum mismatch, missing or truncated chunk, bad manifest."""

    category = "corrupt"


class UnsupportedFormatError(ShardpointError):
    """The checkpoint uses a format version or a must-understand feature this reader lacks."""

    category = "unsupported"


class ResourceLimitError(ShardpointError, MemoryError):
    """A well-formed checkpoint asks for more than this reader will allocate (a tensor larger
    than the memory at hand); load a subset or a shard of it with ``like`` instead."""

    category = "resource-limit"


class MemoryBudgetError(ShardpointError):
    """A save to the memory tier (``shm://``) would take a host's shared memory past the
    tier's budget; nothing more is written. The message names the host, the bytes held, asked
    and allowed: raise the budget, or keep fewer memory steps (the owner's retention)."""

    category = "resource-limit"


class InvalidKeyError(ShardpointError, ValueError):
    """A tree path cannot be encoded as a key (empty, '.', '..', or escapes the directory)."""


class UnsupportedValueError(ShardpointError, TypeError):
    """A leaf of the state tree is of a type the format cannot store without pickle."""


class InvalidShardingError(ShardpointError, ValueError):
    """The ranks' holdings break the replica or coverage rules (overlap, gap, disagreement)."""


class LayoutMismatchError(ShardpointError, ValueError):
    """What ``like`` asks for does not match the checkpoint (missing key, shape, dtype, count)."""

    category = "layout-mismatch"


class SaveFailedError(ShardpointError):
    """Some rank failed while saving; nothing was committed. The message names the rank(s)."""


class LoadFailedError(ShardpointError):
    """Some rank failed while loading; the message names the rank(s) and their errors."""


class RankLostError(SaveFailedError, LoadFailedError):
    """A collective over the process group failed on this rank: another rank died, was killed,
    hung past the group's timeout, or its connection broke. Raised by ``save`` (nothing was
    committed) and ``load`` alike, so it is both a SaveFailedError and a LoadFailedError."""


class ConversionError(ShardpointError):
    """A checkpoint of another format cannot be converted: unknown or ambiguous format, an entry
    that would need unrestricted unpickling, a dtype or key the target cannot hold."""


class InvalidOptionError(ShardpointError, ValueError):
    """An argument or option is outside what it accepts (an unknown load strategy, a count or
    rate that must be positive, a ``best_mode`` other than min/max); raised before any I/O."""


class StoreUnavailableError(ShardpointError, ConnectionError):
    """The store cannot be reached: the endpoint refuses or times out, or keeps answering with
    throttling or server errors after every retry. The message names the endpoint."""


class StoreAccessDeniedError(ShardpointError, PermissionError):
    """The store refuses the credentials (unknown key, bad signature, expired token) or they
    lack a permission, or none were found. The message names the bucket, the endpoint and where
    credentials are looked up."""


class StoreNotFoundError(ShardpointError, FileNotFoundError):
    """The store's container does not exist (an S3 bucket). The message names it."""

    category = "incomplete"


class UnsupportedStoreError(ShardpointError, ValueError):
    """A checkpoint path names a store this process cannot use: a URL scheme no store is
    registered for (``register_store`` adds one), or a store the operation does not support.
    The message names the scheme and the registered ones. Raised before any I/O: a URL is
    never taken for a local path."""


class CheckpointReferencedError(CheckpointExistsError):
    """A checkpoint that another committed checkpoint builds on (names as a base,
    [SP-PACK-11]) was to be deleted or replaced: refused, nothing deleted. Remove the
    checkpoints that refer to it first (or let a manager's retention do so)."""
