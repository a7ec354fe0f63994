"""The [SP-PACK-7] checks a load starts ahead of its opens (``start_checks``, on an object
store: here memory://, a real in-process store): each object once however many tensors
name it, nothing for the objects already checked, a failed check left to the open that
needs the object (which raises the error naming its tensor), and nothing on files."""

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

import shardpoint as sp
from shardpoint_core.arrays.packed_checks import start_checks
from shardpoint_core.stores.location import locate
from shardpoint_core.transactions.packed import PackedBackend
from shardpoint_core.transactions.reader import CheckpointReader
from shardpoint_core.transactions.resolve import read_metadata


def _saved(path: str) -> tuple:
    state = {f"t{i}": np.full((1024,), i, np.float32) for i in range(3)}  # an object each
    sp.save(state, path, backend=PackedBackend(cap=4096))
    m = read_metadata(path)
    assert len(m.packed.objects) == 3
    return m, [e.packed for e in m.tensors.values()]


def test_each_object_once_and_a_failure_left_to_the_open():
    url = "memory://packed-checks/ck"
    m, parts = _saved(url)
    store, prefix = locate(url).pair()
    gone = m.tensors["t1"].packed.chunk(0)[0]
    store.delete([f"{prefix}/{gone}"])
    checked: dict = {}
    with ThreadPoolExecutor(4) as pool:
        assert start_checks(store, prefix, parts + parts, checked, pool.submit) == 3
        for f in [v for v in checked.values() if isinstance(v, Future)]:
            f.result(timeout=60)
        assert sorted(checked.values()) == [True, True]  # the missing one: not kept
        assert start_checks(store, prefix, parts, checked, pool.submit) == 1  # it again
    be = PackedBackend()
    r = CheckpointReader.open(url, backend=be)
    r.will_open(["t0", "t1", "t2"])
    r.array("t0")
    with pytest.raises(sp.CorruptCheckpointError) as e:
        r.array("t1")
    assert e.value.spec_id == "SP-READ-2" and "'t1'" in str(e.value) and gone in str(e.value)


def test_nothing_is_started_on_files(tmp_ckpt):
    _m, parts = _saved(tmp_ckpt)
    store, prefix = locate(tmp_ckpt).pair()
    checked: dict = {}
    assert start_checks(store, prefix, parts, checked, lambda *a: pytest.fail("a task")) == 0
    assert checked == {}
