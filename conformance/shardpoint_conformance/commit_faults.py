"""Object-store commit faults that any implementation of format.md 9.1 must survive.

Each scenario takes a :class:`Rig`: a store reached directly, the same store reached through
a proxy that injects faults, a committer factory (the implementation under test, any class
with the :class:`~shardpoint_core.commit.base.Committer` methods) and ``stage`` (writes a
save's objects below its prefix). The rule checked is the first promise: the target holds the
previous checkpoint or the new one, whole, and nothing the protocol did not write is deleted.

* ``lost_reply``: the marker's PUT, or the lease's, is applied and its reply lost (dropped
  connection or 500); the client's retry gets 412 for its own object: the save must go on
  and report success [SP-COMMIT-17].
* ``lost_race``: another save's marker is there: the loser fails, and its abort deletes only
  its own prefix [SP-COMMIT-12].
* ``abort_after_commit``: an abort of a save whose marker landed deletes nothing.
* ``user_objects``: objects named like save prefixes (a user's ``save-20240101/``) beside and
  inside checkpoints survive recovery and retention [SP-COMMIT-15], [SP-COMMIT-16].
* ``stalled_save``: a save stops renewing its lease (a paused process), recovery reclaims it
  and removes its prefix, the save then publishes: refused, previous checkpoint whole
  [SP-COMMIT-16]. Needs ``Rig.pause``.
* ``blackhole``: an endpoint that accepts connections and never answers: a save's first
  request and a read fail with ``StoreUnavailableError`` naming the endpoint within the
  store's own stated bound, never a hang. Needs ``Rig.blackhole``.

Example (the reference on the tests' S3 server, ``tests/conformance/test_commit_faults.py``)::

    for name, scenario in SCENARIOS.items():
        scenario(rig)
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import msgpack

from shardpoint_core.format.errors import CheckpointExistsError, SaveFailedError
from shardpoint_core.format.manifest import Manifest, TensorEntry, decode_manifest, encode_manifest

LATER = 3600.0  # seconds after which every lease a scenario wrote has expired
LOST_REPLY = -1  # a proxy rule's answer: applied, then the connection dropped


@dataclass
class Rig:
    """What the scenarios need of a store and an implementation.

    ``store``: the store reached directly; ``faulty(rule)``: a context manager giving the same
    store reached through a proxy that applies ``rule(method, path, n)`` (None: forward; a
    negative status: apply, then lose the reply); ``committer(store)``: the implementation's
    committer over a store; ``pause(store, staging)``: make a running save stop renewing its
    lease, as a stopped process would (None: the scenario is skipped); ``quick``: one case
    of each kind rather than every combination (a CI's default run)."""

    store: Any
    faulty: Callable[[Callable], Any]
    committer: Callable[[Any], Any]
    pause: Optional[Callable[[Any, str], None]] = None
    quick: bool = False  # one case of each kind instead of every combination
    # ``blackhole(endpoint)``: (the implementation's store of this kind pointed at
    # ``endpoint``, the most seconds its options let one operation take); None: skipped
    blackhole: Optional[Callable[[str], tuple]] = None


def stage(store: Any, committer: Any, target: str, label: str) -> tuple:
    """Begin a save of ``target`` and write its objects (payloads name ``label``, so a mix of
    two saves is visible); returns (staging key, manifest bytes)."""
    staging = committer.begin(target, uuid.uuid4().hex)
    for k in ("a", "b"):
        store.put(f"{staging}/tensors/{k}/zarr.json", msgpack.packb({"save": label}))
        for c in range(2):
            store.put(f"{staging}/tensors/{k}/c/{c}", f"{label}:{k}:{c}".encode())
    tree = {"dict": [[k, {"tensor": k}] for k in ("a", "b")]}
    m = Manifest(
        wire_tree=tree,
        tensors={k: TensorEntry(k, f"tensors/{k}", (2,), "uint8", (1,)) for k in ("a", "b")},
        objects={},
    )
    return staging, encode_manifest(m)


def read(store: Any, target: str) -> str:
    """The one save every object of ``target``'s checkpoint names (raises on a mix or a
    missing object)."""
    m = decode_manifest(store.get(f"{target}/manifest.msgpack"))
    labels = set()
    for e in m.tensors.values():
        labels.add(msgpack.unpackb(store.get(f"{target}/{e.array}/zarr.json"))["save"])
        for c in range(2):
            labels.add(store.get(f"{target}/{e.array}/c/{c}").decode().split(":")[0])
    if len(labels) != 1:
        raise AssertionError(f"{target}: the checkpoint mixes saves {sorted(labels)}")
    return labels.pop()


def _upload(target: str, name: str, nth: int) -> Callable:
    """A rule's test for the upload of ``<target>/<name>``: S3's ``PUT .../<target>/<name>``;
    on GCS, whose upload URL does not name the object, the ``nth`` conditional upload
    (``ifGenerationMatch``): in these scenarios the lease is the first and the marker the
    second, every other object being written past the proxy."""
    seen: list = []

    def test(method: str, path: str) -> bool:
        if method == "PUT":
            return path.split("?")[0].endswith(f"/{target}/{name}") or (
                name == "lease.msgpack"
                and path.split("?")[0].endswith("/" + name)
                and f"/{target}/save-" in path
            )
        if method == "POST" and path.startswith("/upload/") and "ifGenerationMatch" in path:
            seen.append(path)
            return len(seen) == nth
        return False

    return test


def _once(test: Callable, fault: int) -> Callable:
    fired: list = []

    def rule(method: str, path: str, n: int) -> Optional[int]:
        if not fired and test(method, path):
            fired.append(n)
            return fault
        return None

    return rule


def _prefix(rig: Rig) -> str:
    return f"cf-{uuid.uuid4().hex[:10]}"


def lost_reply(rig: Rig) -> None:
    cases = [
        (f, o, u)
        for f in (LOST_REPLY, -500)
        for o in (False, True)
        for u in (("manifest.msgpack", 2), ("lease.msgpack", 1))
    ]
    if rig.quick:
        cases = [(LOST_REPLY, True, ("manifest.msgpack", 2)), (-500, False, ("lease.msgpack", 1))]
    for fault, overwrite, (name, nth) in cases:
        t = f"{_prefix(rig)}/t"
        if overwrite:
            c0 = rig.committer(rig.store)
            staging, m = stage(rig.store, c0, t, "old")
            c0.publish(staging, t, overwrite=False, manifest=m)
        with rig.faulty(_once(_upload(t, name, nth), fault)) as store:
            c = rig.committer(store)
            staging, m = stage(rig.store, c, t, f"new-{name}")
            c.publish(staging, t, overwrite=overwrite or name != "manifest.msgpack", manifest=m)
        got = read(rig.store, t)
        if got != f"new-{name}":
            raise AssertionError(
                f"lost reply to the {name} upload ({fault}, overwrite={overwrite}): {got}"
            )


def lost_race(rig: Rig) -> None:
    t = f"{_prefix(rig)}/t"
    c = rig.committer(rig.store)
    (a, ma), (b, mb) = stage(rig.store, c, t, "a"), stage(rig.store, c, t, "b")
    c.publish(a, t, overwrite=False, manifest=ma)
    try:
        c.publish(b, t, overwrite=False, manifest=mb)
    except CheckpointExistsError:
        c.abort(b)
    else:
        raise AssertionError("the second fresh save of one target committed too")
    if read(rig.store, t) != "a":
        raise AssertionError("the winner's checkpoint is not whole after the loser's abort")


def abort_after_commit(rig: Rig) -> None:
    t = f"{_prefix(rig)}/t"
    c = rig.committer(rig.store)
    staging, m = stage(rig.store, c, t, "one")
    c.publish(staging, t, overwrite=False, manifest=m)
    c.abort(staging)
    read(rig.store, t)


def user_objects(rig: Rig) -> None:
    root = _prefix(rig)
    c = rig.committer(rig.store)
    staging, m = stage(rig.store, c, f"{root}/step_00000001", "one")
    c.publish(staging, f"{root}/step_00000001", overwrite=False, manifest=m)
    mine = [
        f"{root}/exports/save-20240101/model.bin",
        f"{root}/step_00000001/save-20240101/eval_results.json",
    ]
    for k in mine:
        rig.store.put(k, b"user data")
    now = time.time() + LATER
    for lo in c.leftovers(root, now=now):
        c.discard(lo.path, now=now)
    c.remove(f"{root}/step_00000001")
    for k in mine:
        if rig.store.get(k) != b"user data":
            raise AssertionError(f"{k}: a user's object was deleted")


def stalled_save(rig: Rig) -> None:
    if rig.pause is None:
        return
    t = f"{_prefix(rig)}/t"
    c = rig.committer(rig.store)
    staging, m = stage(rig.store, c, t, "old")
    c.publish(staging, t, overwrite=False, manifest=m)
    staging, m = stage(rig.store, c, t, "paused")
    rig.pause(rig.store, staging)
    observer = rig.committer(rig.store)
    now = time.time() + LATER
    removed = [
        lo.path for lo in observer.leftovers(t, now=now) if observer.discard(lo.path, now=now)
    ]
    if removed != [staging]:
        raise AssertionError(f"recovery removed {removed}, not the paused save {staging}")
    try:
        c.publish(staging, t, overwrite=True, manifest=m)
    except SaveFailedError:
        pass
    else:
        raise AssertionError("a save whose prefix recovery removed committed")
    if read(rig.store, t) != "old":
        raise AssertionError("the previous checkpoint is not whole")


def blackhole(rig: Rig) -> None:
    if rig.blackhole is None:
        return
    import socket
    from shardpoint_core.format.errors import StoreUnavailableError
    from shardpoint_testing.probes import error_within

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # the kernel accepts into the backlog; nobody answers
    endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        store, bound = rig.blackhole(endpoint)
        for what, op in (
            ("a save's lease", lambda: rig.committer(store).begin("t", uuid.uuid4().hex)),
            ("a read", lambda: store.get("t/manifest.msgpack")),
        ):
            err = error_within(op, bound + 10, f"{what} against a blackhole")
            if not isinstance(err, StoreUnavailableError) or endpoint.split("//")[1] not in str(
                err
            ):
                raise AssertionError(
                    f"{what} against a blackhole: {err!r}, not a "
                    "StoreUnavailableError naming the endpoint"
                )
    finally:
        sock.close()


SCENARIOS: Dict[str, Callable[[Rig], None]] = {
    "lost_reply": lost_reply,
    "lost_race": lost_race,
    "abort_after_commit": abort_after_commit,
    "user_objects": user_objects,
    "stalled_save": stalled_save,
    "blackhole": blackhole,
}
