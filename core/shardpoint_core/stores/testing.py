"""The contract every :class:`~shardpoint_core.stores.base.ByteStore` must pass, shipped for
third-party stores (like zarr-python's ``StoreTests``).

A new store proves itself with a subclass and one fixture::

    import pytest
    from shardpoint_core.stores.testing import StoreTests, StoreStateMachine

    class TestMyStore(StoreTests):
        @pytest.fixture
        def store(self, tmp_path):
            return MyStore(str(tmp_path))        # an empty store, writable

    TestMyStoreModel = StoreStateMachine.for_store(lambda: MyStore(fresh_dir())).TestCase

The stateful machine drives random puts, deletes, conditional puts and reads against a
``dict`` model (trivially correct) and checks every answer. Keys in the machine always have
two components, so no key is a directory of another: a file system cannot hold both ``a`` and
``a/b``, and the contract does not ask it to. Needs pytest and hypothesis (test extras).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict

import numpy as np
import pytest

from shardpoint_core.format.errors import InvalidKeyError
from shardpoint_core.stores.base import Buffer, ByteStore, ObjectInfo, StoreCapabilities

BAD_KEYS = ["", "/abs", "a//b", "a/", "../up", "a/../../b", "./a", "a/./b", "a\0b", "a\\b"]


class StoreTests:
    """pytest test methods of the store contract; subclasses provide the ``store`` fixture
    (an empty, writable store; a fresh one per test)."""

    @pytest.fixture
    def store(self) -> ByteStore:
        raise NotImplementedError("subclasses provide an empty, writable store")

    def test_is_a_byte_store(self, store: ByteStore) -> None:
        assert isinstance(store, ByteStore)
        assert isinstance(store.capabilities, StoreCapabilities)
        assert isinstance(store.url, str) and store.url

    def test_put_get_round_trip_every_byte(self, store: ByteStore) -> None:
        data = bytes(range(256)) * 3
        store.put("a/b", data)
        assert store.get("a/b") == data

    def test_empty_object(self, store: ByteStore) -> None:
        store.put("empty", b"")
        assert store.get("empty") == b""
        info = store.head("empty")
        assert info is not None and info.size == 0
        assert [i.key for i in store.list()] == ["empty"]

    def test_missing_key(self, store: ByteStore) -> None:
        with pytest.raises(FileNotFoundError):
            store.get("nope")
        with pytest.raises(FileNotFoundError):
            store.get_range("nope", 0, 1)
        with pytest.raises(FileNotFoundError):
            store.read_into("nope", 0, memoryview(bytearray(1)))
        assert store.head("nope") is None
        store.put("dir/x", b"1")
        with pytest.raises(FileNotFoundError):  # a prefix of keys is not an object
            store.get("dir")
        assert store.head("dir") is None

    def test_vectored_put_concatenates(self, store: ByteStore) -> None:
        arr = np.arange(10, dtype="<u4")
        pieces: list[Buffer] = [b"ab", bytearray(b"cd"), memoryview(b"ef"), b"", arr]
        store.put("v", pieces)
        assert store.get("v") == b"abcdef" + arr.tobytes()

    def test_vectored_put_more_buffers_than_iov_max(self, store: ByteStore) -> None:
        pieces = [bytes([i % 251]) * (i % 7) for i in range(3000)]
        store.put("many/bufs", pieces)
        assert store.get("many/bufs") == b"".join(pieces)

    def test_overwrite_replaces_whole_object(self, store: ByteStore) -> None:
        store.put("k", b"0123456789")
        store.put("k", b"xy")
        assert store.get("k") == b"xy"
        info = store.head("k")
        assert info is not None and info.size == 2

    def test_put_if_absent(self, store: ByteStore) -> None:
        store.put("c/k", b"first", if_absent=True)
        with pytest.raises(FileExistsError):
            store.put("c/k", b"second", if_absent=True)
        assert store.get("c/k") == b"first"

    def test_get_range(self, store: ByteStore) -> None:
        store.put("r", b"0123456789")
        assert store.get_range("r", 0, 3) == b"012"
        assert store.get_range("r", 7, 3) == b"789"
        assert store.get_range("r", 8, 10) == b"89"  # fewer where the object ends
        assert store.get_range("r", 10, 4) == b""
        assert store.get_range("r", 4, 0) == b""

    def test_read_into(self, store: ByteStore) -> None:
        store.put("r", b"0123456789")
        out = bytearray(4)
        store.read_into("r", 3, memoryview(out))
        assert out == b"3456"
        arr = np.zeros(2, "<u2")
        store.read_into("r", 0, memoryview(arr).cast("B"))
        assert arr.tobytes() == b"0123"
        with pytest.raises(EOFError):
            store.read_into("r", 8, memoryview(bytearray(4)))

    def test_head(self, store: ByteStore) -> None:
        store.put("h/k", b"12345")
        info = store.head("h/k")
        assert isinstance(info, ObjectInfo)
        assert (info.key, info.size) == ("h/k", 5)
        assert info.mtime > 0

    def test_list_order_and_prefix(self, store: ByteStore) -> None:
        for k in ["b/2", "a/1", "a/10", "ab/x", "c", "a/2/deep/er"]:
            store.put(k, k.encode())
        assert [i.key for i in store.list()] == sorted(
            ["b/2", "a/1", "a/10", "ab/x", "c", "a/2/deep/er"]
        )
        assert [i.key for i in store.list("a/")] == ["a/1", "a/10", "a/2/deep/er"]
        assert [i.key for i in store.list("a")] == ["a/1", "a/10", "a/2/deep/er", "ab/x"]
        assert [i.key for i in store.list("a/1")] == ["a/1", "a/10"]
        assert [i.key for i in store.list("zz")] == []
        assert {i.key: i.size for i in store.list("b/")} == {"b/2": 3}

    def test_delete(self, store: ByteStore) -> None:
        store.put("d/1", b"x")
        store.put("d/2", b"y")
        store.delete(["d/1", "d/missing", "gone/too"])
        assert store.head("d/1") is None
        assert [i.key for i in store.list("d/")] == ["d/2"]
        store.delete(["d/2"])
        assert list(store.list()) == []
        store.put("d", b"now a key")  # the emptied prefix takes an object again
        assert store.get("d") == b"now a key"

    def test_bad_keys_refused_before_io(self, store: ByteStore) -> None:
        for bad in BAD_KEYS:
            with pytest.raises(InvalidKeyError):
                store.put(bad, b"x")
            with pytest.raises(InvalidKeyError):
                store.get(bad)
            with pytest.raises(InvalidKeyError):
                store.head(bad)
            with pytest.raises(InvalidKeyError):
                store.delete([bad])
        assert list(store.list()) == []

    def test_threads(self, store: ByteStore) -> None:
        errors: list[Any] = []

        def work(t: int) -> None:
            try:
                for i in range(20):
                    k = f"t{t}/c/{i}"
                    store.put(k, [k.encode(), bytes(i)])
                    assert store.get(k) == k.encode() + bytes(i)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        ts = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not errors, errors
        assert len(list(store.list())) == 160

    def test_make_durable(self, store: ByteStore) -> None:
        store.put("m/a", b"1")
        store.put("m/b", b"2")
        store.make_durable(["m/a"])
        store.make_durable()
        store.make_durable()  # nothing new: still fine
        assert store.get("m/a") + store.get("m/b") == b"12"


def _machine_base() -> Any:
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

    keys = st.builds(lambda a, b: f"{a}/{b}", st.sampled_from("abc"), st.sampled_from("xyz"))
    blobs = st.binary(max_size=64)

    class StoreStateMachine(RuleBasedStateMachine):
        """A store against a dict model; subclass with :meth:`for_store`."""

        make_store: Callable[[], ByteStore]

        @classmethod
        def for_store(cls, make_store: Callable[[], ByteStore]) -> type:
            """A machine class for stores made by ``make_store`` (an empty one per run);
            its ``TestCase`` attribute is the pytest/unittest test."""
            return type(f"{cls.__name__}For", (cls,), {"make_store": staticmethod(make_store)})

        def __init__(self) -> None:
            super().__init__()
            self.store = self.make_store()
            self.model: Dict[str, bytes] = {}

        @rule(key=keys, data=blobs, split=st.integers(0, 64))
        def put(self, key: str, data: bytes, split: int) -> None:
            self.store.put(key, [data[:split], data[split:]])
            self.model[key] = data

        @rule(key=keys, data=blobs)
        def put_if_absent(self, key: str, data: bytes) -> None:
            if key in self.model:
                with pytest.raises(FileExistsError):
                    self.store.put(key, data, if_absent=True)
            else:
                self.store.put(key, data, if_absent=True)
                self.model[key] = data

        @rule(key=keys)
        def get(self, key: str) -> None:
            if key in self.model:
                assert self.store.get(key) == self.model[key]
            else:
                with pytest.raises(FileNotFoundError):
                    self.store.get(key)

        @rule(key=keys, start=st.integers(0, 70), length=st.integers(0, 70))
        def get_range(self, key: str, start: int, length: int) -> None:
            if key in self.model:
                assert (
                    self.store.get_range(key, start, length)
                    == self.model[key][start : start + length]
                )

        @precondition(lambda self: bool(self.model))
        @rule(data=st.data())
        def read_into(self, data: Any) -> None:
            key = data.draw(st.sampled_from(sorted(self.model)))
            blob = self.model[key]
            start = data.draw(st.integers(0, len(blob)))
            n = data.draw(st.integers(0, len(blob) - start))
            out = bytearray(n)
            self.store.read_into(key, start, memoryview(out))
            assert bytes(out) == blob[start : start + n]

        @rule(ks=st.lists(keys, max_size=3))
        def delete(self, ks: list[Any]) -> None:
            self.store.delete(ks)
            for k in ks:
                self.model.pop(k, None)

        @rule()
        def make_durable(self) -> None:
            self.store.make_durable()

        @rule(prefix=st.sampled_from(["", "a", "a/", "b/y", "c/z", "q"]))
        def list_prefix(self, prefix: str) -> None:
            got = [(i.key, i.size) for i in self.store.list(prefix)]
            want = sorted((k, len(v)) for k, v in self.model.items() if k.startswith(prefix))
            assert got == want

        @invariant()
        def heads_agree(self) -> None:
            for k, v in self.model.items():
                info = self.store.head(k)
                assert info is not None and info.size == len(v), (k, info)

    return StoreStateMachine


def __getattr__(name: str) -> Any:
    # Built on first use, so importing StoreTests does not need hypothesis.
    if name == "StoreStateMachine":
        m = _machine_base()
        globals()[name] = m
        return m
    raise AttributeError(name)
