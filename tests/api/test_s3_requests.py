"""Requests per checkpoint on a real S3-compatible server (moto's, on loopback): counted on
the client, per operation and object, for a save and a load, and how many round trips deep
they are. A request count and the order of round trips are deterministic (unlike time), so
they are what a test can hold the object-store path to.

A save: the target's check (the marker's HEAD and the listing, together), then two PUTs per
tensor (its zarr.json and its one chunk object, together), the staged manifest with the Zarr
group metadata ([SP-LAYOUT-5]: the save's root and tensors/), the marker (its If-None-Match is
the only check), and the delete of the staged copy: 5 round trips.
A load: the manifest's GET (its ETag is the identity checked at the end, no HEAD before it),
then per array its zarr.json GET and its first data GET together (a plain chunk, or a
shard's index by a suffix range), a shard's runs of inner chunks, and the identity HEAD."""

from collections import Counter

import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto")

import shardpoint as sp  # noqa: E402
from shardpoint_core.transactions.backend import ZarrBackend  # noqa: E402
from shardpoint_testing.s3 import Requests  # noqa: E402

LATENCY = 0.1  # s added to every request: requests in flight together overlap by far


def arrays(names, *what) -> Counter:
    return Counter(("PutObject", f"save-*/tensors/{k}/{w}") for k in names for w in what)


GROUPS = Counter(
    {
        ("PutObject", "save-*/zarr.json"): 1,  # the Zarr groups
        ("PutObject", "save-*/tensors/zarr.json"): 1,
    }
)


def test_requests_and_round_trips_of_save_load_and_overwrite(s3_env):
    url = s3_env.url(s3_env.fresh_prefix("requests") + "/ck")
    be = ZarrBackend(shard_above_bytes=1 << 16, inner_chunk_bytes=1 << 13)
    small = {f"s{i}": torch.full((100,), float(i)) for i in range(6)}
    state = {**small, "big": torch.arange(1 << 16, dtype=torch.float32)}  # 256 KiB: a shard
    n = len(state)
    marker = "manifest.msgpack"
    with Requests(be, url, LATENCY) as log:
        sp.save(state, url, backend=be)
        saved = log.take()
        out = sp.load(url, backend=be)
        loaded = log.take()
        sp.save(state, url, backend=be, overwrite=True)
        replaced = log.take()
    assert all(torch.equal(out[k], v) for k, v in state.items())

    lease = "save-*/lease.msgpack"
    assert len(saved) == 2 * n + 7, saved
    assert Requests.waves(saved) == [
        Counter({("HeadObject", marker): 1, ("ListObjectsV2", ""): 1}),  # the target's check
        Counter({("PutObject", lease): 1}),  # the save's claim [SP-COMMIT-16]
        arrays(state, "zarr.json", "c/0"),  # one chunk object per tensor here
        GROUPS,  # the Zarr groups [SP-LAYOUT-5]
        Counter({("PutObject", marker): 1}),  # the commit: If-None-Match, no HEAD
        Counter({("GetObject", lease): 1}),
    ], saved  # still ours: nothing to take back

    assert len(loaded) == 2 * n + 3, loaded
    first = Counter(
        {("GetObject", f"save-*/tensors/{k}/{w}"): 1 for k in state for w in ("zarr.json", "c/0")}
    )
    assert Requests.waves(loaded) == [
        Counter({("GetObject", marker): 1}),  # its ETag: the identity, no HEAD first
        first,  # zarr.json and the first data GET
        Counter({("GetObject", "save-*/tensors/big/c/0"): 1}),  # the shard's inner chunks
        Counter({("HeadObject", marker): 1}),
    ], loaded  # the identity, checked again
    shard = [
        r for m, k, r, *_ in sorted(loaded, key=lambda r: r[3]) if k == "save-*/tensors/big/c/0"
    ]
    # 256 KiB in 32 inner chunks of 8 KiB: the index by a suffix range, then one run
    assert shard == [f"bytes=-{32 * 16 + 4}", f"bytes=0-{32 * (8192 + 4) - 1}"], shard
    assert [r for m, k, r, *_ in loaded if k == "save-*/tensors/s0/c/0"] == [
        f"bytes=0-{100 * 4 + 4}"
    ]  # a plain chunk: one byte over its size

    assert len(replaced) == 2 * n + 11, replaced
    assert Requests.waves(replaced) == [
        Counter({("HeadObject", marker): 1, ("ListObjectsV2", ""): 1}),
        Counter({("PutObject", lease): 1}),
        arrays(state, "zarr.json", "c/0"),
        GROUPS,
        Counter({("GetObject", marker): 1}),  # the old marker and its ETag, one GET
        Counter(
            {
                ("PutObject", marker): 1,  # If-Match, while the replaced
                ("ListObjectsV2", ""): 1,
            }
        ),  # save's objects are listed
        Counter({("GetObject", lease): 1}),  # the lease, still ours
        Counter({("DeleteObjects", ""): 1}),  # the replaced save's objects,
        Counter({("DeleteObjects", ""): 1}),
    ], replaced  # then its lease


def test_a_layout_other_than_predicted_drops_the_early_read(s3_env):
    """A reader whose own writer would lay the array out otherwise (here: one plain chunk
    where the checkpoint has a shard) sends the plain chunk's read beside zarr.json, drops
    it when zarr.json says shard, and reads the shard by its index."""
    url = s3_env.url(s3_env.fresh_prefix("requests") + "/guess")
    x = torch.arange(1 << 16, dtype=torch.float32)
    sp.save(
        {"x": x}, url, backend=ZarrBackend(shard_above_bytes=1 << 16, inner_chunk_bytes=1 << 13)
    )
    be = ZarrBackend()  # would write 256 KiB as one plain chunk
    with Requests(be, url, LATENCY) as log:
        out = sp.load(url, backend=be)
        loaded = log.take()
    assert torch.equal(out["x"], x)
    waves = Requests.waves(loaded)
    assert waves[1] == Counter(
        {("GetObject", "save-*/tensors/x/zarr.json"): 1, ("GetObject", "save-*/tensors/x/c/0"): 1}
    ), waves
    ranges = [
        r for m, k, r, *_ in sorted(loaded, key=lambda r: r[3]) if k == "save-*/tensors/x/c/0"
    ]
    assert ranges == [
        f"bytes=0-{(1 << 18) + 4}",
        f"bytes=-{32 * 16 + 4}",
        f"bytes=0-{32 * (8192 + 4) - 1}",
    ], ranges


def test_a_checkpoint_replaced_after_the_manifest_read_fails_the_load(s3_env):
    """The identity a load checks at its end comes from its manifest GET's ETag: another
    save replacing the checkpoint right after that GET fails the load (never tensors of two
    saves)."""
    url = s3_env.url(s3_env.fresh_prefix("requests") + "/swap")
    sp.save({"w": torch.zeros(64), "b": torch.zeros(8)}, url)

    class ReplacedAfterManifest(ZarrBackend):
        def read_manifest_with_identity(self, path):
            got = super().read_manifest_with_identity(path)
            sp.save({"w": torch.ones(64), "b": torch.ones(8)}, path, overwrite=True)
            return got

    with pytest.raises(sp.LoadFailedError, match="replaced"):
        sp.load(url, backend=ReplacedAfterManifest())
    assert torch.equal(sp.load(url)["w"], torch.ones(64))


def test_a_region_reads_only_the_inner_chunks_it_meets(s3_env):
    url = s3_env.url(s3_env.fresh_prefix("requests") + "/part")
    be = ZarrBackend(shard_above_bytes=1 << 12, inner_chunk_bytes=1 << 10)
    x = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)  # 16 KiB: one shard
    sp.save({"x": x}, url, backend=be)
    like = {"x": sp.ShardedTensor(torch.empty(8, 64), (64, 64), (16, 0))}
    with Requests(be, url) as log:
        sp.load(url, like=like, backend=be)
        seen = log.take()
    assert torch.equal(like["x"].data, x[16:24])
    ranged = [r for m, k, r, *_ in seen if m == "GetObject" and "tensors/x/c/" in k]
    # inner chunks of 4 rows x 64: rows 16-24 are two of them, back to back: one ranged GET
    assert len(ranged) == 2 and ranged[0].startswith("bytes=-"), ranged
    lo, hi = (int(v) for v in ranged[1][len("bytes=") :].split("-"))
    assert hi - lo + 1 == 2 * (4 * 64 * 4 + 4)


def test_one_zarr_json_put_per_array_however_many_writers(s3_env):
    """Two writers (two ranks' backends) of one array's chunks: only the writer of chunk 0
    PUTs zarr.json; an empty array (no chunk, no chunk-0 writer) gets it from its opener.
    The two backends share this process's store of the bucket, so one log sees both."""
    import numpy as np
    from shardpoint_core.format.spec import ArraySpec

    url = s3_env.url(s3_env.fresh_prefix("requests") + "/two")
    spec = ArraySpec((8, 4), "float32", (4, 4))
    ranks = [ZarrBackend(), ZarrBackend()]
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    with Requests(ranks[0], url) as log:
        for r, be in enumerate(ranks):
            h = be.open_array_for_write(url, "tensors/w", spec)
            be.wait([be.write(h, (4 * r, 0), x[4 * r : 4 * r + 4])])
            e = be.open_array_for_write(url, f"tensors/e{r}", ArraySpec((0, 4), "float32", (1, 4)))
            assert e is not None
            be.flush(url)
        metas = sorted(k for m, k, *_ in log.take() if m == "PutObject" and k.endswith("zarr.json"))
    assert metas == ["tensors/e0/zarr.json", "tensors/e1/zarr.json", "tensors/w/zarr.json"]
    out = np.empty_like(x)
    be = ZarrBackend()
    be.wait([be.read_into(be.open_array_for_read(url, "tensors/w", spec, "w"), (0, 0), out)])
    assert np.array_equal(out, x)


def test_chunks_and_shard_runs_of_a_region_are_read_together(s3_env, monkeypatch):
    """A region over several chunks, and a shard read in several runs: after the first
    round trip (zarr.json with the first chunk's read, or the shard's index), every other
    chunk and run is in flight at once, one round trip (one after another before)."""
    import numpy as np
    from shardpoint_core.format.spec import ArraySpec
    from shardpoint_core.arrays import array

    url = s3_env.url(s3_env.fresh_prefix("requests") + "/fan")
    spec = ArraySpec((16, 4), "float32", (4, 4))  # four plain chunks
    x = np.arange(64, dtype=np.float32).reshape(16, 4)
    big = ArraySpec((1 << 16,), "float32", (1 << 16,))  # one shard of 32 inner chunks
    y = np.arange(1 << 16, dtype=np.float32)
    be = ZarrBackend(shard_above_bytes=1 << 16, inner_chunk_bytes=1 << 13)
    h, g = (
        be.open_array_for_write(url, "tensors/x", spec),
        be.open_array_for_write(url, "tensors/y", big),
    )
    be.wait(
        [be.write(h, (4 * i, 0), x[4 * i : 4 * i + 4]) for i in range(4)] + [be.write(g, (0,), y)]
    )
    be.flush(url)
    monkeypatch.setattr(array, "MAX_SPAN_BYTES", 8192 + 4)  # one inner chunk per run
    out, back = np.empty_like(x), np.empty_like(y)
    with Requests(be, url, LATENCY) as log:
        be.wait([be.read_into(be.open_array_for_read(url, "tensors/x", spec, "x"), (0, 0), out)])
        xs = log.take()
        be.wait([be.read_into(be.open_array_for_read(url, "tensors/y", big, "y"), (0,), back)])
        ys = log.take()
    assert np.array_equal(out, x) and np.array_equal(back, y)
    assert Requests.waves(xs) == [
        Counter({("GetObject", "tensors/x/zarr.json"): 1, ("GetObject", "tensors/x/c/0/0"): 1}),
        Counter({("GetObject", f"tensors/x/c/{i}/0"): 1 for i in (1, 2, 3)}),
    ], xs
    assert Requests.waves(ys) == [
        Counter({("GetObject", "tensors/y/zarr.json"): 1, ("GetObject", "tensors/y/c/0"): 1}),
        Counter({("GetObject", "tensors/y/c/0"): 32}),
    ], ys  # the index, then 32 runs


def test_lazy_open_reads_the_manifest_with_its_identity_in_one_request(s3_env):
    """``sp.open`` takes the identity from the manifest's GET, as a load does (no HEAD
    before it)."""
    url = s3_env.url(s3_env.fresh_prefix("open") + "/ck")
    be = ZarrBackend()
    sp.save({"w": torch.arange(12.0)}, url, backend=be)
    marker = "manifest.msgpack"
    with Requests(be, url, LATENCY) as log:
        with sp.open(url, backend=be) as ck:
            opened = log.take()
            got = ck["w"][2:5].to_torch()
    assert torch.equal(got, torch.arange(2.0, 5.0))
    assert Requests.waves(opened) == [Counter({("GetObject", marker): 1})], opened
