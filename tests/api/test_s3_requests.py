"""Requests per checkpoint on a real S3-compatible server (moto's, on loopback): counted on
the client, per method and object, for a save and a load. A request count is deterministic
(unlike time), so it is what a test can hold the object-store path to: two PUTs per tensor
(its zarr.json and its one chunk object) plus the commit's few, and on load one GET per
zarr.json, one per plain chunk, and for a shard one suffix GET of its index (no HEAD first)
and one ranged GET per run of back-to-back inner chunks."""
import threading
from collections import Counter
from urllib.parse import unquote, urlsplit

import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto")

import shardpoint as sp  # noqa: E402
from shardpoint_core.zarr import ZarrBackend  # noqa: E402


class Requests:
    """Every request a backend's S3 client sends: (method, key below ``prefix``, Range)."""

    def __init__(self, be: ZarrBackend, url: str) -> None:
        store, self.prefix = be.locate(url)
        self.seen: list = []
        self._lock = threading.Lock()
        # The store is the process's one for the bucket, shared by every backend: the newest
        # log replaces an earlier test's, instead of both recording every request.
        events = store.client.meta.events
        events.unregister("before-send.s3.*", unique_id="sp-test-requests")
        events.register("before-send.s3.*", self._send, unique_id="sp-test-requests")

    def _send(self, request, **kw):
        path = unquote(urlsplit(request.url).path)
        key = path.split(f"/{self.prefix}/", 1)[-1] if f"/{self.prefix}/" in path else path
        rng = request.headers.get("Range")
        rng = rng.decode() if isinstance(rng, bytes) else rng
        with self._lock:
            self.seen.append((request.method, key, rng))

    def take(self) -> list:
        with self._lock:
            out, self.seen = self.seen, []
        return out


def test_requests_per_save_and_load(s3_env):
    url = s3_env.url(s3_env.fresh_prefix("requests") + "/ck")
    be = ZarrBackend(shard_above_bytes=1 << 16, inner_chunk_bytes=1 << 13)
    log = Requests(be, url)
    small = {f"s{i}": torch.full((100,), float(i)) for i in range(6)}
    state = {**small, "big": torch.arange(1 << 16, dtype=torch.float32)}   # 256 KiB: a shard
    n = len(state)
    sp.save(state, url, backend=be)
    saved = log.take()
    puts = [k for m, k, _r in saved if m == "PUT"]
    assert sum(k.endswith("/zarr.json") for k in puts) == n
    assert sum("/c/" in k for k in puts) == n               # one object per tensor's chunk
    assert len(puts) == 2 * n + 2                            # + the manifest and the marker
    assert len(saved) <= 2 * n + 8, saved                    # the commit's checks: a few

    out = sp.load(url, backend=be)
    loaded = log.take()
    assert all(torch.equal(out[k], v) for k, v in state.items())
    heads = [k for m, k, _r in loaded if m == "HEAD"]
    assert not [k for k in heads if "/c/" in k or k.endswith("zarr.json")], heads
    gets = Counter(k for m, k, _r in loaded if m == "GET")
    assert sum(v for k, v in gets.items() if k.endswith("/zarr.json")) == n
    for k in small:
        assert [c for c in gets if f"tensors/{k}/c/" in c] and \
            sum(v for c, v in gets.items() if f"tensors/{k}/c/" in c) == 1
    shard = [(r, k) for m, k, r in loaded if m == "GET" and "tensors/big/c/" in k]
    # 256 KiB in 32 inner chunks of 8 KiB: the index by a suffix range, then one run
    assert [r for r, _k in shard] == [f"bytes=-{32 * 16 + 4}", shard[1][0]], shard
    assert shard[1][0] == f"bytes=0-{32 * (8192 + 4) - 1}"
    assert len(loaded) <= 2 * n + 6, loaded                 # manifest, identity checks


def test_a_region_reads_only_the_inner_chunks_it_meets(s3_env):
    url = s3_env.url(s3_env.fresh_prefix("requests") + "/part")
    be = ZarrBackend(shard_above_bytes=1 << 12, inner_chunk_bytes=1 << 10)
    x = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)    # 16 KiB: one shard
    sp.save({"x": x}, url, backend=be)
    log = Requests(be, url)
    like = {"x": sp.ShardedTensor(torch.empty(8, 64), (64, 64), (16, 0))}
    sp.load(url, like=like, backend=be)
    assert torch.equal(like["x"].data, x[16:24])
    ranged = [r for m, k, r in log.take() if m == "GET" and "tensors/x/c/" in k]
    # inner chunks of 4 rows x 64: rows 16-24 are two of them, back to back: one ranged GET
    assert len(ranged) == 2 and ranged[0].startswith("bytes=-"), ranged
    lo, hi = (int(v) for v in ranged[1][len("bytes="):].split("-"))
    assert hi - lo + 1 == 2 * (4 * 64 * 4 + 4)


def test_one_zarr_json_put_per_array_however_many_writers(s3_env):
    """Two writers (two ranks' backends) of one array's chunks: only the writer of chunk 0
    PUTs zarr.json; an empty array (no chunk, no chunk-0 writer) gets it from its opener.
    The two backends share this process's store of the bucket, so one log sees both."""
    import numpy as np
    from shardpoint_core.storage import ArraySpec
    url = s3_env.url(s3_env.fresh_prefix("requests") + "/two")
    spec = ArraySpec((8, 4), "float32", (4, 4))
    ranks = [ZarrBackend(), ZarrBackend()]
    log = Requests(ranks[0], url)
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    for r, be in enumerate(ranks):
        h = be.open_array_for_write(url, "tensors/w", spec)
        be.wait([be.write(h, (4 * r, 0), x[4 * r:4 * r + 4])])
        e = be.open_array_for_write(url, f"tensors/e{r}", ArraySpec((0, 4), "float32", (1, 4)))
        assert e is not None
        be.flush(url)
    metas = sorted(k for m, k, _r in log.take() if m == "PUT" and k.endswith("zarr.json"))
    assert metas == ["tensors/e0/zarr.json", "tensors/e1/zarr.json", "tensors/w/zarr.json"]
    out = np.empty_like(x)
    be = ZarrBackend()
    be.wait([be.read_into(be.open_array_for_read(url, "tensors/w", spec, "w"), (0, 0), out)])
    assert np.array_equal(out, x)
