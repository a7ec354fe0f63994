"""Tree-path keys (spec/format.md section 2): encode a path, check a stored key's form."""
from __future__ import annotations

import hashlib
import re
from typing import Sequence, Union

from shardpoint_jax.errors import InvalidKeyError

Component = Union[str, int]
SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
INTEGER = re.compile(r"-?[0-9]+")
CANONICAL_INT = re.compile(r"-?[1-9][0-9]*|0")
MAX_KEY_BYTES = 4096
INT64 = (-(2 ** 63), 2 ** 64 - 1)   # the msgpack int range (1.1)


def encode_component(c: Component) -> str:
    """One path component as it appears in a key [SP-KEY-1] [SP-KEY-2]."""
    if isinstance(c, bool) or not isinstance(c, (str, int)):
        raise InvalidKeyError(f"dict key {c!r} of type {type(c).__name__} is not supported; "
                              "use str or int keys", spec_id="SP-KEY-1")
    if isinstance(c, int):
        if not INT64[0] <= c <= INT64[1]:
            raise InvalidKeyError(f"integer key {c} is outside -2^63 .. 2^64-1",
                                  spec_id="SP-KEY-1")
        return str(c)
    if c in ("", ".", ".."):
        raise InvalidKeyError(f"key component {c!r} is not allowed; rename it",
                              spec_id="SP-KEY-2")
    try:
        raw = c.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidKeyError(f"key component {c!r} is not valid UTF-8 ({e.reason})",
                              spec_id="SP-KEY-1") from None
    out = "".join(chr(b) if b in SAFE else f"%{b:02X}" for b in raw)
    return "~" + out if INTEGER.fullmatch(out) else out


def encode_key(path: Sequence[Component]) -> str:
    """The key of a leaf at ``path`` [SP-KEY-4]."""
    if not path:
        raise InvalidKeyError("the root of the tree must be a dict, list or tuple, not a leaf",
                              spec_id="SP-KEY-2")
    key = "/".join(encode_component(c) for c in path)
    if len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidKeyError(f"key {key[:80]!r}... is {len(key.encode())} bytes; the limit "
                              f"is {MAX_KEY_BYTES}", spec_id="SP-KEY-4")
    return key


def decode_component(text: str) -> Component:
    """The component a canonical encoded component stands for [SP-KEY-3]."""
    if CANONICAL_INT.fullmatch(text):
        if not INT64[0] <= int(text) <= INT64[1]:
            raise InvalidKeyError(f"integer key component {text} is outside -2^63 .. 2^64-1",
                                  spec_id="SP-KEY-3")
        return int(text)
    body = text[1:] if text.startswith("~") else text
    if text.startswith("~") and not INTEGER.fullmatch(body):
        raise InvalidKeyError(f"key component {text!r}: '~' may only precede a decimal",
                              spec_id="SP-KEY-3")
    raw = bytearray()
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "%" and re.fullmatch(r"[0-9A-F]{2}", body[i + 1:i + 3]):
            raw.append(int(body[i + 1:i + 3], 16))
            i += 3
        elif ord(ch) < 128 and ord(ch) in SAFE:
            raw.append(ord(ch))
            i += 1
        else:
            raise InvalidKeyError(f"key component {text!r} is not canonical at {ch!r}",
                                  spec_id="SP-KEY-3")
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidKeyError(f"key component {text!r} does not decode to UTF-8",
                              spec_id="SP-KEY-3") from None
    if s in ("", ".", "..") or encode_component(s) != text:
        raise InvalidKeyError(f"key component {text!r} is not in canonical form",
                              spec_id="SP-KEY-3")
    return s


RESERVED = {"CON", "PRN", "AUX", "NUL"} | {f"{p}{i}" for p in ("COM", "LPT") for i in range(10)}
ESCAPE = re.compile(r"%[0-9A-F]{2}")


def case_suffixed(component: str) -> str:
    """``Encoder`` -> ``Encoder~1``: a mask of which letters (outside ``%XX``) are upper case."""
    letters = [ch for ch in ESCAPE.sub("", component) if ch.isascii() and ch.isalpha()]
    mask = sum(1 << i for i, ch in enumerate(letters) if ch.isupper())
    return f"{component}~{mask:x}" if mask else component


def array_path(key: str) -> str:
    """The portable array path of tensor ``key`` [SP-LAYOUT-4]."""
    parts = [case_suffixed(c) for c in key.split("/")]
    path = "tensors/" + "/".join(parts)
    if len(path.encode()) > 1024 or any(
            len(c.encode()) > 255 or c.endswith(".") or c.split(".")[0].upper() in RESERVED
            for c in parts):
        return "tensors/~h/" + hashlib.sha256(key.encode()).hexdigest()
    return path
