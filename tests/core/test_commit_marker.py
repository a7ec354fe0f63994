"""The object-store commit marker is encoded once and PUT once (issue 29): a writer hands the
committer its Manifest, which is encoded with every array path below the save prefix and PUT
unchanged; the bytes are those of the 1.2 path (encode, then move the array paths), so no
checkpoint byte changes; a marker naming anything outside its save prefix is refused."""

import uuid

import numpy as np
import pytest

from shardpoint_core.commit.object_store import (
    ObjectStoreCommitter,
    _rewrite_array_paths,
    encode_marker,
)
from shardpoint_core.format.errors import CorruptCheckpointError
from shardpoint_core.format.manifest import (
    Manifest,
    ObjectValues,
    TensorEntry,
    decode_manifest,
    encode_manifest,
)
from shardpoint_core.stores.memory import MemoryStore


def manifest():
    """A manifest as a writer builds it: tensors with and without a chunk table, a sharded
    object, plain values of every kind (numpy scalars, tuples, floats, bytes)."""
    tree = {
        "dict": [
            ["w", {"tensor": "w"}],
            ["B", {"tensor": "B"}],
            ["rng", {"object": "rng"}],
            ["lr", {"value": 0.1}],
            ["n", {"value": np.int64(7)}],
            ["f", {"value": np.float32(0.5)}],
            ["raw", {"value": b"\x00\xff"}],
            ["betas", {"tuple": [{"value": 0.9}, {"value": 0.999}]}],
        ]
    }
    tensors = {
        "w": TensorEntry("w", "tensors/w", (4, 3), "float32", (2, 3), b"\x01\x02\x03\x04" * 2),
        "B": TensorEntry("B", "tensors/B~1", (5,), "bfloat16", (5,)),
    }
    return Manifest(
        wire_tree=tree,
        tensors=tensors,
        objects={"rng": ObjectValues([1, "two", 3.0], (3,))},
        writer="shardpoint-py/test",
        created_unix=1700000000.25,
        save_world_size=3,
    )


def test_the_marker_encoded_once_is_the_bytes_of_the_rewrite():
    m = manifest()
    once = encode_marker(m, "save-0123456789ab")
    assert once == _rewrite_array_paths(encode_manifest(m), "save-0123456789ab", "test")
    assert sorted(e.array for e in decode_manifest(once).tensors.values()) == [
        "save-0123456789ab/tensors/B~1",
        "save-0123456789ab/tensors/w",
    ]


class CountingStore(MemoryStore):
    """A memory store that records every PUT's key and bytes."""

    def __init__(self):
        super().__init__()
        self.puts = []

    def put(self, key, data, **kw):
        self.puts.append(
            (
                key,
                b"".join(bytes(memoryview(d).cast("B")) for d in data)
                if isinstance(data, (list, tuple))
                else bytes(data),
            )
        )
        return super().put(key, data, **kw)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_save_puts_its_marker_once_and_nothing_manifest_like_below_its_prefix(overwrite):
    store = CountingStore()
    c = ObjectStoreCommitter(store)
    if overwrite:
        first = c.begin("ck", uuid.uuid4().hex[:12])
        c.write_manifest(first, manifest())
        c.publish(first, "ck", overwrite=False)
        store.puts.clear()
    staging = c.begin("ck", uuid.uuid4().hex[:12])
    m = manifest()
    c.write_manifest(staging, m)
    c.publish(staging, "ck", overwrite=overwrite)
    manifests = [(k, v) for k, v in store.puts if k.endswith("manifest.msgpack")]
    assert manifests == [("ck/manifest.msgpack", encode_marker(m, staging.rpartition("/")[2]))]
    assert store.get("ck/manifest.msgpack") == manifests[0][1]


def test_a_marker_naming_another_prefix_is_refused_and_nothing_committed():
    store = MemoryStore()
    c = ObjectStoreCommitter(store)
    staging = c.begin("ck", "0123456789ab")
    wrong = encode_marker(manifest(), "save-ba9876543210")  # another save's objects
    with pytest.raises(CorruptCheckpointError, match="SP-COMMIT-11"):
        c.publish(staging, "ck", overwrite=False, marker=wrong)
    assert c.state("ck") != "committed"
    c.abort(staging)
    assert list(store.list("ck/")) == []


def test_a_save_encodes_its_manifest_once_no_second_codec(monkeypatch, tmp_path):
    """``sp.save`` to an object store hands the committer the Manifest itself: it is encoded
    once, straight into the marker's bytes; the bytes-rewriting path (decode the envelope,
    move the array paths, encode again) is not taken, and ``encode_manifest`` runs once."""
    import torch

    import shardpoint as sp
    from shardpoint_core.commit import object_marker, object_store
    from shardpoint_core.format import manifest as codec

    def second_codec(*a, **k):
        raise AssertionError("the manifest went through the bytes-rewriting codec")

    calls = []
    real = codec.encode_manifest

    def counting(m):
        calls.append(1)
        return real(m)

    # each patched where the committer looks it up: publish in object_store, encode_marker
    # in object_marker
    monkeypatch.setattr(object_store, "_rewrite_array_paths", second_codec)
    monkeypatch.setattr(object_marker, "encode_manifest", counting)
    monkeypatch.setattr(codec, "encode_manifest", counting)
    url = "memory://marker-once/run/ck"
    sp.save({"w": torch.arange(6.0), "step": 3}, url)
    assert len(calls) == 1
    back = sp.load(url)
    assert torch.equal(back["w"], torch.arange(6.0)) and back["step"] == 3


def test_a_packed_marker_encoded_once_is_the_bytes_of_the_rewrite():
    """(1.4) The packed layout's data objects and array names move below the save prefix
    too: encoded once from the Manifest, the marker is the rewrite's bytes."""
    import os

    vec = os.path.join(os.path.dirname(__file__), "..", "..", "spec", "vectors", "valid")
    with open(os.path.join(vec, "packed_basic", "checkpoint", "manifest.msgpack"), "rb") as f:
        m = decode_manifest(f.read())
    assert m.packed is not None
    once = encode_marker(m, "save-0123456789ab")
    assert once == _rewrite_array_paths(encode_manifest(m), "save-0123456789ab", "test")
    back = decode_manifest(once)
    assert all(p.startswith("save-0123456789ab/") for p, _ in back.packed.objects)
