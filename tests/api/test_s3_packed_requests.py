"""Requests of a load of a packed checkpoint (the default layout) over several data objects
on the real S3 server (moto's, on loopback), grouped by round trip (deterministic, unlike
time; see tests/api/test_s3_requests.py): every data object a load will read is checked
([SP-PACK-7]: it exists and holds its declared size, before anything is allocated for a
tensor) by one HEAD, all of them in one round trip before the tensors are opened, and
only the objects of the tensors read. A missing or short object is the same documented
error as before, naming the tensor, the object and the rule."""

from collections import Counter

import numpy as np
import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto")

import shardpoint as sp  # noqa: E402
from shardpoint_core.format.manifest import Manifest, TensorEntry, array_path_for  # noqa: E402
from shardpoint_core.stores.location import locate  # noqa: E402
from shardpoint_core.transactions.packed import PackedBackend  # noqa: E402
from shardpoint_core.transactions.reader import CheckpointReader  # noqa: E402
from shardpoint_core.transactions.resolve import read_metadata  # noqa: E402
from shardpoint_core.transactions.writer import CheckpointWriter  # noqa: E402
from shardpoint_testing.s3 import Requests  # noqa: E402

LATENCY = 0.1  # s added to every request: requests in flight together overlap by far
MARKER = "manifest.msgpack"
N = 20  # tensors, one data object each: more than the 8 tensors a load opens at a time


def _state() -> dict:
    return {f"t{i:02d}": torch.full((1024,), float(i)) for i in range(N)}  # 4 KiB each


def _objects(url: str, keys=None) -> Counter:
    """The data objects of ``keys``' tensors (all: None), as the request log names them."""
    m = read_metadata(url)
    out = Counter()
    for k, e in m.tensors.items():
        if keys is None or k in keys:
            for o in e.packed.object_numbers():
                out[("save-*/" + e.packed.objects[o][0].split("/", 1)[1])] = 1
    return out


def _saved(s3_env, name: str) -> tuple:
    url = s3_env.url(s3_env.fresh_prefix("packed-requests") + "/" + name)
    be = PackedBackend(cap=4096)  # a data object per tensor
    state = _state()
    sp.save(state, url, backend=be)
    assert len(_objects(url)) == N
    return url, be, state


def test_a_packed_load_checks_every_data_object_in_one_round_trip(s3_env):
    """The manifest's GET, every data object's HEAD at once, one GET per object, the
    identity's HEAD: 4 round trips (before: each tensor's open sent its objects' HEADs,
    8 opens at a time, so 20 objects took 3 round trips of HEADs)."""
    url, be, state = _saved(s3_env, "all")
    objects = _objects(url)
    with Requests(be, url, LATENCY) as log:
        out = sp.load(url, backend=be)
        loaded = log.take()
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert Requests.waves(loaded) == [
        Counter({("GetObject", MARKER): 1}),
        Counter({("HeadObject", o): 1 for o in objects}),  # [SP-PACK-7], each object once
        Counter({("GetObject", o): 1 for o in objects}),
        Counter({("HeadObject", MARKER): 1}),  # the identity, checked again
    ], loaded


def test_a_partial_load_checks_only_the_objects_it_reads(s3_env):
    """A load of 3 of the 20 tensors (a rank's share) sends the HEADs of their 3 objects,
    none of the others'."""
    url, be, state = _saved(s3_env, "some")
    keys = ["t03", "t11", "t17"]
    objects = _objects(url, keys)
    assert len(objects) == 3
    like = {k: torch.empty(1024) for k in keys}
    with Requests(be, url, LATENCY) as log:
        sp.load(url, like=like, backend=be)
        loaded = log.take()
    assert all(torch.equal(like[k], state[k]) for k in keys)
    assert Requests.waves(loaded) == [
        Counter({("GetObject", MARKER): 1}),
        Counter({("HeadObject", o): 1 for o in objects}),
        Counter({("GetObject", o): 1 for o in objects}),
        Counter({("HeadObject", MARKER): 1}),
    ], loaded


def test_a_tensor_over_several_objects_checks_them_in_one_round_trip(s3_env):
    """One tensor whose 4 chunks lie in 4 data objects, opened alone (no load told the
    backend beforehand): its open sends the 4 HEADs at once (before: one after another)."""
    url = s3_env.url(s3_env.fresh_prefix("packed-requests") + "/one")
    w = np.arange(32 * 256, dtype=np.float32).reshape(32, 256)  # 4 chunks of 8 KiB
    entry = TensorEntry("w", array_path_for("w"), w.shape, "float32", (8, 256))
    be = PackedBackend(cap=8192)
    with CheckpointWriter.begin(url, backend=be) as wr:
        h = wr.open_array(entry.array, entry.spec)
        wr.wait([wr.write(h, (8 * i, 0), w[8 * i : 8 * i + 8]) for i in range(4)])
        wr.flush()
        wr.commit(Manifest({"dict": [["w", {"tensor": "w"}]]}, {"w": entry}, {}))
    objects = _objects(url)
    assert len(objects) == 4
    r = CheckpointReader.open(url, backend=be)
    with Requests(be, url, LATENCY) as log:
        a = r.array("w")
        opened = log.take()
    assert Requests.waves(opened) == [Counter({("HeadObject", o): 1 for o in objects})], opened
    out = np.empty_like(w)
    r.wait([r.read_into(a, (0, 0), out)])
    assert out.tobytes() == w.tobytes()
    r.close()


@pytest.mark.parametrize("damage", ["missing", "short"])
@pytest.mark.parametrize("how", ["load", "open"])
def test_a_missing_or_short_object_is_the_documented_error(s3_env, damage, how):
    """A data object deleted ([SP-READ-2]) or cut short of its declared size ([SP-READ-3],
    [SP-PACK-7]): the error names the tensor, the object and the rule, whether a load
    checked it ahead of the opens or an open checked it (``sp.open``)."""
    url, be, _ = _saved(s3_env, f"{damage}-{how}")
    m = read_metadata(url)
    part = m.tensors["t05"].packed
    path = part.chunk(0)[0]
    store, key = locate(url).pair()
    if damage == "missing":
        store.delete([f"{key}/{path}"])
    else:
        store.put(f"{key}/{path}", store.get(f"{key}/{path}")[:-1])
    rule = "SP-READ-2" if damage == "missing" else "SP-READ-3"
    with pytest.raises(sp.CorruptCheckpointError) as e:
        if how == "load":
            sp.load(url, backend=be)
        else:
            with sp.open(url, backend=be) as ck:
                ck["t05"][0:4].to_torch()
    assert e.value.spec_id == rule, e.value
    assert "'t05'" in str(e.value) and path in str(e.value), e.value
    if damage == "missing":
        assert "the data object is missing" in str(e.value)
    else:
        assert "SP-PACK-7" in str(e.value)
    got = sp.load(url, like={"t04": torch.empty(1024)}, backend=be)  # another object: sound
    assert torch.equal(got["t04"], torch.full((1024,), 4.0))
