"""Key encoding: one unambiguous, filesystem-safe string for each path in a state tree.

A path is a tuple of components: ``str`` (dict key), ``int`` (dict key or sequence index).
Components are joined with ``/``. A ``str`` component is percent-encoded (UTF-8, every byte
outside ``[A-Za-z0-9_.-]`` becomes ``%XX`` with upper-case hex); if the result could be read
as an integer (``-?[0-9]+``) it gets a ``~`` prefix, which encoding never produces otherwise.
An ``int`` component is written in decimal. Empty strings, ``.`` and ``..`` are rejected.
See spec/format.md, section "Keys" ([SP-KEY-1] .. [SP-KEY-5]).
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Iterable, Sequence, Union

from shardpoint_core.format.errors import InvalidKeyError

Component = Union[str, int]
Path = tuple[Any, ...]  # tuple[Component, ...]

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_INT_RE = re.compile(r"-?[0-9]+\Z")
_PLAIN_RE = re.compile(r"[A-Za-z0-9_.\-]+\Z")
_ENCODED_STR_RE = re.compile(r"(?:[A-Za-z0-9_.\-]|%[0-9A-F]{2})+\Z")
MAX_KEY_BYTES = 4096


def encode_component(c: Component) -> str:
    """Encode one path component; raises :class:`InvalidKeyError` for unusable ones."""
    if isinstance(c, bool) or not isinstance(c, (str, int)):
        raise InvalidKeyError(
            f"dict key {c!r} of type {type(c).__name__} is not supported; use str or int keys",
            spec_id="SP-KEY-1",
        )
    if isinstance(c, int):
        if not -(1 << 63) <= c < (1 << 64):
            raise InvalidKeyError(
                f"integer key {c} is outside the 64-bit range the manifest "
                "can store; use a str key",
                spec_id="SP-KEY-1",
            )
        return str(c)
    if c in ("", ".", ".."):
        raise InvalidKeyError(
            f"key component {c!r} is not allowed (empty, '.' and '..' could escape or alias "
            "a directory); rename the dict key",
            spec_id="SP-KEY-2",
        )
    if _PLAIN_RE.match(c):  # safe characters only: the text itself (or ~text)
        return "~" + c if _INT_RE.match(c) else c
    try:
        raw = c.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidKeyError(
            f"key component {c!r} is not valid Unicode text (it holds a lone "
            "surrogate) and has no UTF-8 form; rename the dict key",
            spec_id="SP-KEY-1",
        ) from None
    out = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in raw)
    return "~" + out if _INT_RE.match(out) else out


def decode_component(s: str) -> Component:
    """Inverse of :func:`encode_component`; raises :class:`InvalidKeyError` on malformed text.

    Readers enforce the writers' rules too: ``""``, ``.`` and ``..`` are refused
    ([SP-KEY-2]) and an integer must be canonical and within the msgpack range ([SP-KEY-3]).
    """
    if s in ("", ".", ".."):
        raise InvalidKeyError(
            f"key component {s!r} is not allowed (empty, '.' and '..')", spec_id="SP-KEY-2"
        )
    if _INT_RE.match(s):  # a full match: the pattern ends with \Z
        if s != str(int(s)) or not -(1 << 63) <= int(s) < (1 << 64):
            raise InvalidKeyError(
                f"integer component {s!r} is not canonical or is outside -2^63 .. 2^64-1",
                spec_id="SP-KEY-3",
            )
        return int(s)
    body = s[1:] if s.startswith("~") else s
    if not _ENCODED_STR_RE.match(body) or (s.startswith("~") and not _INT_RE.match(body)):
        raise InvalidKeyError(f"malformed key component {s!r}", spec_id="SP-KEY-3")
    if "%" not in body:  # safe characters only: the text itself, canonical as checked
        return body
    raw = bytearray()
    i = 0
    while i < len(body):
        if body[i] == "%":
            raw.append(int(body[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.append(ord(body[i]))
            i += 1
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidKeyError(f"key component {s!r} is not valid UTF-8", spec_id="SP-KEY-3") from e
    if encode_component(text) != s:
        raise InvalidKeyError(f"key component {s!r} is not in canonical form", spec_id="SP-KEY-3")
    return text


def encode_key(path: Sequence[Component]) -> str:
    """Encode a tree path; the root itself (an empty path) is not a valid key."""
    if len(path) == 0:
        raise InvalidKeyError(
            "the root of the tree cannot be a leaf; wrap it in a dict", spec_id="SP-KEY-2"
        )
    key = "/".join(encode_component(c) for c in path)
    if len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidKeyError(
            f"key {key[:80]}... is longer than {MAX_KEY_BYTES} bytes", spec_id="SP-KEY-4"
        )
    return key


def decode_key(key: str) -> tuple[Any, ...]:
    """Decode a key read from a manifest, validating it strictly ([SP-KEY-3])."""
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"key {key!r} is not a non-empty string", spec_id="SP-KEY-3")
    parts = key.split("/")
    bad = next((p for p in parts if p in ("", ".", "..")), None)
    if bad is not None:  # [SP-ERR-2]: [SP-KEY-2] before [SP-KEY-3], whichever comes first
        raise InvalidKeyError(
            f"key {key[:80]!r} has the component {bad!r} (empty, '.' and '..' are not allowed)",
            spec_id="SP-KEY-2",
        )
    if len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidKeyError(
            f"key {key[:80]}... is longer than {MAX_KEY_BYTES} bytes", spec_id="SP-KEY-4"
        )
    return tuple(decode_component(p) for p in parts)


def format_path(path: Sequence[Component]) -> str:
    """Human-readable path for error messages, e.g. ``optim['state'][0]['exp_avg']``."""
    return "".join(f"[{c!r}]" for c in path) or "<root>"


def similar_keys(key: str, keys: Iterable[str], n: int = 3) -> list[Any]:
    """Keys close to ``key``, for "not in the checkpoint" errors: a typo, or a name with or
    without a prefix (DDP's ``module.``, torch.compile's ``_orig_mod.``)."""
    keys = list(keys)
    near = difflib.get_close_matches(key, keys, n=n, cutoff=0.6)
    if not near:
        tail = key.rsplit("/", 1)[-1]
        near = [k for k in keys if k.endswith(tail) or tail.endswith(k.rsplit("/", 1)[-1])][:n]
    return near
