"""The lease of a save on an object store ([SP-COMMIT-16], spec 1.3).

Nothing else on an object store tells a live save from a dead one, so a save says it is alive:
its coordinator writes ``<t>/save-<token>/lease.msgpack`` before anything else below its
prefix, and rewrites it every ``lease_s / 4`` seconds until it commits or aborts. The lease is
also what makes a prefix *ours*: recovery touches only prefixes whose lease names their token
(a user's ``exports/save-20240101/`` has none).

- Renewals are conditional (``If-Match`` on the lease's own version) where the store can, so
  a renewal never brings back a lease that recovery deleted: the renewer then knows the save
  was taken for dead and the commit refuses to publish.
- Recovery deletes an expired lease *first*, then reads the marker again, and deletes the rest
  only if the marker still does not name the prefix; the save, after its marker PUT, checks
  that its lease is still there, and takes its marker back if not. Between the two, a save
  that was paused longer than its lease (SIGSTOP, a GC pause, a stalled request) either
  finds out or finds its data whole; it never publishes deleted data.

Example::

    lease = start_lease(store, "run/step_5/save-a1b2c3d4e5f6", "a1b2c3d4e5f6")
    ...                                   # ranks write below the prefix
    state = stop_lease(store, "run/step_5/save-a1b2c3d4e5f6")   # before the marker's PUT
    assert not state.lost
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import msgpack

log = logging.getLogger("shardpoint")

LEASE_NAME = "lease.msgpack"
DEFAULT_LEASE_S = 120.0
_KIND = "shardpoint-save-lease"


def encode_lease(
    token: str, lease_s: float, reclaimed: bool = False, nonce: Optional[bytes] = None
) -> bytes:
    """The lease object's bytes: what it is, the save's token, how long it holds, whether
    recovery reclaimed it (declared the save dead; the save can then never commit), and a
    random nonce, so that a writer that reads a lease back knows whether it is its own."""
    data: bytes = msgpack.packb(
        {
            "kind": _KIND,
            "version": 1,
            "token": token,
            "lease_s": float(lease_s),
            "reclaimed": bool(reclaimed),
            "nonce": os.urandom(8) if nonce is None else nonce,
        },
        use_bin_type=True,
    )
    return data


def decode_lease(data: bytes, token: str) -> Optional[tuple[Any, ...]]:
    """``(duration in seconds, reclaimed)`` when ``data`` is the lease of ``token``, else None
    (not a lease, or another save's: the prefix is not this protocol's)."""
    if len(data) > 4096:
        return None
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:  # noqa: BLE001 - any undecodable bytes: not a lease
        return None
    if (
        not isinstance(m, dict)
        or m.get("kind") != _KIND
        or m.get("token") != token
        or not isinstance(m.get("lease_s"), (int, float))
        or not isinstance(m.get("reclaimed", False), bool)
    ):
        return None
    lease_s = float(m["lease_s"])
    return (lease_s, bool(m.get("reclaimed", False))) if 0 < lease_s < 1e7 else None


@dataclass
class LeaseState:
    """A live save's lease: ``version`` of the last write, ``lost`` once a renewal found the
    lease gone or changed (recovery took the save for dead)."""

    key: str
    data: bytes
    version: str
    lease_s: float
    lost: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    thread: Optional[threading.Thread] = None


_LIVE: Dict[str, LeaseState] = {}
_LOCK = threading.Lock()


def _id(store: Any, staging: str) -> str:
    return f"{getattr(store, 'url', id(store))}|{staging}"


def start_lease(
    store: Any, staging: str, token: str, lease_s: float = DEFAULT_LEASE_S
) -> LeaseState:
    """Write the lease of the save at ``staging`` (a fresh prefix: created only if absent
    where the store can) and start renewing it in one daemon thread."""
    data = encode_lease(token, lease_s)
    key = f"{staging}/{LEASE_NAME}"
    caps = store.capabilities
    try:
        version = (
            store.put(key, data, if_absent=True) if caps.conditional_put else store.put(key, data)
        )
    except FileExistsError as e:
        # A lost reply: the PUT landed, the client's retry found it ([SP-COMMIT-17]); the
        # nonce tells our own lease from another save's.
        try:
            mine = store.get(key) == data
        except FileNotFoundError:
            mine = False
        if not mine:
            from shardpoint_core.format.errors import SaveFailedError

            raise SaveFailedError(f"{key!r} exists already: the save token is not fresh") from e
        info = store.head(key)
        version = info.version if info is not None else ""
    st = LeaseState(key, data, version or "", lease_s)
    st.thread = threading.Thread(target=_renew, args=(store, st), daemon=True, name="sp-lease")
    st.thread.start()
    with _LOCK:
        _LIVE[_id(store, staging)] = st
    return st


def _renew(store: Any, st: LeaseState) -> None:
    """Rewrite the lease every quarter of its duration; stop for good once it is not this
    save's bytes any more (recovery reclaimed or removed it)."""
    every = max(st.lease_s / 4.0, 0.05)
    conditional = bool(getattr(store.capabilities, "conditional_replace", False))
    while not st.stop.wait(every):
        try:
            if conditional and st.version:
                st.version = store.put(st.key, st.data, if_match=st.version) or st.version
            else:
                if store.get(st.key) != st.data:
                    raise FileExistsError(st.key)
                st.version = store.put(st.key, st.data) or st.version
        except (FileExistsError, FileNotFoundError):
            st.lost = True  # recovery reclaimed it: this save was taken for dead
            log.warning(
                "shardpoint: the lease %s was reclaimed by recovery; this save will not commit",
                st.key,
            )
            return
        except Exception as e:  # noqa: BLE001 - a slow or failing store: try again later
            log.debug("shardpoint: renewing lease %s failed (%s); retrying", st.key, e)


def stop_lease(store: Any, staging: str) -> Optional[LeaseState]:
    """Stop renewing the lease of ``staging`` (before the marker's PUT, or on abort); its
    state, or None when this process holds no lease for it."""
    with _LOCK:
        st = _LIVE.pop(_id(store, staging), None)
    if st is None:
        return None
    st.stop.set()
    if st.thread is not None and st.thread is not threading.current_thread():
        st.thread.join(timeout=max(60.0, st.lease_s))
    return st


def stop_all() -> None:
    """Stop every renewal this process runs (at interpreter exit: no store call may be in
    flight while the interpreter tears down; a lease left behind simply expires)."""
    with _LOCK:
        live = list(_LIVE.values())
        _LIVE.clear()
    for st in live:
        st.stop.set()
    for st in live:
        if st.thread is not None and st.thread is not threading.current_thread():
            st.thread.join(timeout=5.0)


atexit.register(stop_all)


@dataclass(frozen=True)
class LeaseInfo:
    """A save prefix's lease as recovery reads it: ``age`` seconds since its last renewal
    (store time against this host's clock), its ``lease_s``, whether it was ``reclaimed``,
    and the ``version`` it was read at."""

    age: float
    lease_s: float
    reclaimed: bool
    version: str

    @property
    def live(self) -> bool:
        """Renewed within its duration and not reclaimed: a save is (or may be) running."""
        return not self.reclaimed and self.age < self.lease_s


def read_lease(
    store: Any, staging: str, token: str, now: Optional[float] = None
) -> Optional[LeaseInfo]:
    """The lease of the save prefix ``staging``, or None when it holds no lease of ``token``
    (not a prefix this protocol wrote, or one written before spec 1.3)."""
    key = f"{staging}/{LEASE_NAME}"
    getv = getattr(store, "get_versioned", None)
    try:
        if getv is not None:
            data, info = getv(key, 4097)
        else:
            info = store.head(key)
            if info is None:
                return None
            data = store.get(key)
    except FileNotFoundError:
        return None
    got = decode_lease(data, token)
    if got is None or info is None:
        return None
    age = (time.time() if now is None else now) - info.mtime
    return LeaseInfo(age, got[0], got[1], info.version)


def reclaim_lease(store: Any, staging: str, token: str, info: LeaseInfo) -> bool:
    """Declare the save at ``staging`` dead: its lease is rewritten as reclaimed (If-Match the
    version recovery read, where the store can), so a renewal or a commit of that save fails
    from now on. False when the lease changed meanwhile (the save renewed it: alive)."""
    if info.reclaimed:
        return True
    key = f"{staging}/{LEASE_NAME}"
    data = encode_lease(token, info.lease_s, reclaimed=True, nonce=b"")
    try:
        if getattr(store.capabilities, "conditional_replace", False) and info.version:
            store.put(key, data, if_match=info.version)
        else:
            store.put(key, data)
    except (FileExistsError, FileNotFoundError):
        return False
    return True
