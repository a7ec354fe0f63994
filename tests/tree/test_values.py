"""Value encoding ([SP-VALUE-1], [SP-VALUE-2]): every allowed kind round-trips exactly, by
type and by bits; everything else is refused with the key and a way to convert it."""

import argparse
import collections
import datetime
import enum
import fractions
import math
import pathlib

import hypothesis.strategies as st
import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings

import shardpoint as sp
from shardpoint.tree import dtypes
from shardpoint.tree import values


def same(a, b):
    """Equal by type and by bits, recursively (NaN == NaN, -0.0 != 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return math.copysign(1, a) == math.copysign(1, b) and (a == b or (a != a and b != b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and dtypes.torch_to_numpy(a.contiguous()).tobytes()
            == dtypes.torch_to_numpy(b).tobytes()
        )
    if isinstance(a, (np.ndarray, np.generic)):
        return (
            a.dtype == b.dtype
            and np.shape(a) == np.shape(b)
            and np.asarray(a).tobytes() == np.asarray(b).tobytes()
        )
    return a == b


def rt(v):
    values.check_value(v, "state['v']")
    return values.unpack(values.pack(v))


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10),
    st.binary(max_size=10),
)
plain = st.recursive(
    scalars,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.dictionaries(
            st.one_of(st.text(max_size=5), st.integers(-(2**63), 2**64 - 1)), kids, max_size=4
        ),
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(plain)
def test_plain_values_round_trip_exactly(v):
    assert same(rt(v), v)


@pytest.mark.parametrize(
    "v",
    [
        None,
        True,
        False,
        0,
        -(2**63),
        2**64 - 1,
        1.5,
        -0.0,
        float("inf"),
        float("nan"),
        "",
        "é🙂",
        b"",
        b"\x00\xff",
        [],
        (),
        {},
        [1, (2, [3, (4,)])],
        ((),),
        {"a": (1, 2), 3: [b"x"]},
        {-1: None, 2**64 - 1: 1},
    ],
)
def test_listed_values_round_trip(v):
    assert same(rt(v), v)


@pytest.mark.parametrize("d", list(dtypes.DTYPES.values()), ids=lambda d: d.name)
def test_small_tensors_arrays_and_numpy_scalars_keep_dtype_and_bits(d):
    raw = np.random.default_rng(3).integers(0, 256, 6 * d.itemsize, dtype=np.uint8)
    if d.name == "bool":
        raw &= 1
    a = raw.view(d.numpy).reshape(2, 3)
    t = dtypes.numpy_to_torch(a.copy())
    v = {
        "t": t,
        "t0": t[0, 0].clone(),
        "tT": t.t(),
        "a": a,
        "a0": np.asarray(a[0, 0]),
        "s": a[1, 2],
        "empty": t[:0],
    }
    back = rt(v)
    assert isinstance(back["s"], np.generic) and back["s"].dtype == d.numpy
    assert isinstance(back["a0"], np.ndarray) and back["a0"].shape == ()
    assert isinstance(back["t0"], torch.Tensor) and back["t0"].shape == ()
    for k in v:
        assert same(back[k], v[k] if k != "tT" else v[k].contiguous()), k


def test_bf16_tensor_and_special_bits():
    bits = np.array([0x7FC1, 0xFF81, 0x8000, 0x0001, 0x7F80], dtype=np.uint16)
    t = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    back = rt({"x": t, "g": t.requires_grad_(False)})
    assert back["x"].dtype == torch.bfloat16
    assert back["x"].view(torch.int16).numpy().view(np.uint16).tolist() == bits.tolist()
    f = np.array([0x7FC00001, 0x80000000], dtype=np.uint32).view(np.float32)
    assert rt(f).view(np.uint32).tolist() == [0x7FC00001, 0x80000000]


def test_tensor_that_needs_resolving_or_grad():
    x = torch.randn(3, dtype=torch.complex64, requires_grad=True)
    back = rt([x.conj(), x * 2, torch.randn(4)[::2]])
    assert torch.equal(back[0], x.detach().conj().resolve_conj())
    assert back[1].requires_grad is False and back[2].shape == (2,)


def test_big_endian_numpy_comes_back_native_with_the_same_values():
    a = np.arange(4, dtype=">u2")
    back = rt({"a": a, "s": a[3]})
    assert back["a"].dtype == np.dtype("=u2") and back["a"].tolist() == [0, 1, 2, 3]
    assert back["s"] == 3 and back["s"].dtype == np.uint16


class Color(enum.IntEnum):
    RED = 1


class Name(str):
    pass


@pytest.mark.parametrize(
    "bad,hint",
    [
        (argparse.Namespace(lr=0.1), "vars"),
        ({1, 2}, "set"),
        (frozenset(), "frozenset"),
        (lambda x: x, "function"),
        (object(), "object"),
        (Color.RED, "Color"),
        (Name("x"), "Name"),
        (np.str_("x"), "dtype"),
        (np.array(["a"]), "dtype"),
        (np.zeros(2, dtype=object), "dtype"),
        (np.zeros(1, dtype=np.longdouble), "dtype"),
        (2**64, "64-bit"),
        (-(2**63) - 1, "64-bit"),
        ({1.5: 2}, "dict key"),
        ({True: 1}, "dict key"),
        ({2**64: 1}, "dict key"),
        (datetime.date(2020, 1, 1), "date"),
        (pathlib.Path("/x"), "Path"),
        (fractions.Fraction(1, 3), "Fraction"),
        (1j, "complex"),
        (bytearray(b"x"), "bytearray"),
        (torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), "dtype"),
        (torch.ones(2, dtype=torch.float8_e4m3fnuz), "dtype"),
        (collections.deque([1]), "deque"),
        (range(3), "range"),
    ],
)
def test_refused_values_name_the_key_and_say_how_to_convert(bad, hint):
    with pytest.raises(sp.UnsupportedValueError) as e:
        values.check_value({"inner": [bad]}, "state['cfg']")
    msg = str(e.value)
    assert "state['cfg']['inner'][0]" in msg and hint in msg, msg
    assert e.value.spec_id in ("SP-VALUE-1", "SP-DTYPE-1")


def test_refused_leaf_in_a_save_names_the_path(tmp_ckpt):
    for bad in (argparse.Namespace(lr=0.1), Color.RED, {1, 2}):
        with pytest.raises(sp.UnsupportedValueError, match=r"state\['cfg'\]\['args'\]"):
            sp.save({"cfg": {"args": bad}}, tmp_ckpt)
    with pytest.raises(sp.UnsupportedValueError, match=r"state\['rng'\]\[1\]"):
        sp.save({"rng": sp.ShardedObject([1, {3}], 0, 1)}, tmp_ckpt)


def test_namespace_hint_is_actionable(tmp_ckpt):
    with pytest.raises(sp.UnsupportedValueError, match=r"vars\(ns\)"):
        sp.save({"args": argparse.Namespace(lr=0.1)}, tmp_ckpt)
    sp.save({"args": vars(argparse.Namespace(lr=0.1))}, tmp_ckpt)
    assert sp.load(tmp_ckpt) == {"args": {"lr": 0.1}}


def test_values_round_trip_through_a_checkpoint(tmp_ckpt):
    v = {
        "none": None,
        "t": (1, (2.5, "x")),
        "b": b"\x00",
        "big": 2**64 - 1,
        "neg": -(2**63),
        "nan": float("nan"),
        "nz": -0.0,
        "np": np.float16(1.5),
        "ml": ml_dtypes.bfloat16(2),
        "list": [np.int8(-1), {"k": (None,)}],
        5: "int key",
    }
    sp.save(v, tmp_ckpt)
    assert same(sp.load(tmp_ckpt), v)
    like = {k: (None if k not in ("t", "list") else v[k]) for k in v}
    assert same(sp.load(tmp_ckpt, like=like), v)


def test_malformed_array_extension_is_corrupt_not_a_crash():
    import msgpack

    for body in ([b"nope"], ["float32", [3], b"\x00" * 5, "numpy"], ["int128", [1], b"", "numpy"]):
        data = msgpack.packb(msgpack.ExtType(values.EXT_ARRAY, msgpack.packb(body)))
        with pytest.raises(sp.CorruptCheckpointError):
            values.unpack(data)
    with pytest.raises(sp.CorruptCheckpointError):
        values.unpack(msgpack.packb(msgpack.ExtType(9, b"")))
