"""Store keys: the one rule every store applies before touching its backing storage.

A key is a relative ``/``-separated path below a store's root: no leading ``/``, no empty,
``.`` or ``..`` component, no NUL or backslash. A key breaking the rule could name something
outside the checkpoint (``../other``) on a file system, so stores refuse it with
:class:`~shardpoint_core.format.errors.InvalidKeyError` before any I/O.
"""

from __future__ import annotations

from shardpoint_core.format.errors import InvalidKeyError


def check_key(key: str) -> str:
    """``key`` unchanged when it is a valid store key; else :class:`InvalidKeyError` naming
    it and the rule."""
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"store key {key!r} is empty or not a string")
    if "\0" in key or "\\" in key:
        raise InvalidKeyError(f"store key {key!r} holds a NUL or a backslash")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise InvalidKeyError(
            f"store key {key!r} has an empty, '.' or '..' component (or "
            "starts or ends with '/'): it could name something outside the "
            "store's root"
        )
    return key


def check_prefix(prefix: str) -> str:
    """``prefix`` unchanged when it is ``""`` or a valid key possibly ending in ``/``."""
    if prefix == "":
        return prefix
    check_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix
