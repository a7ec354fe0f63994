"""Key encoding and value encoding: exact, unambiguous, strict on input."""
import argparse

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given

import shardpoint as sp
from shardpoint import values
from shardpoint.keys import decode_key, encode_key

components = st.one_of(
    st.text(min_size=1).filter(lambda s: s not in (".", "..")),
    st.integers(-2**63, 2**63 - 1),
    st.sampled_from(["0", "-1", "~", "%", "/", "a/b", "~3", "007", "é", "\x00"]))


@given(st.lists(components, min_size=1, max_size=5))
def test_keys_round_trip_and_are_path_safe(path):
    key = encode_key(path)
    assert decode_key(key) == tuple(path)
    parts = key.split("/")
    assert len(parts) == len(path) and all(p not in ("", ".", "..") for p in parts)


def test_int_and_digit_string_keys_do_not_collide():
    assert encode_key([0]) == "0" and encode_key(["0"]) == "~0"
    assert encode_key(["-3"]) == "~-3" and encode_key([-3]) == "-3"
    assert encode_key(["~"]) == "%7E"


@pytest.mark.parametrize("bad", ["", ".", "..", True, 1.5, None, ("t",)])
def test_bad_components_are_refused(bad):
    with pytest.raises(sp.InvalidKeyError):
        encode_key(["ok", bad])


@pytest.mark.parametrize("bad", ["a//b", "%2f", "~x", "01", "%ZZ", "a b", ".."])
def test_non_canonical_keys_are_rejected_by_readers(bad):
    with pytest.raises(sp.InvalidKeyError):
        decode_key(bad)


@pytest.mark.parametrize("v", [None, True, -2**63, 2**64 - 1, 1.5, float("inf"), "é", b"\x00",
                               [1, [2, (3, b"x")]], {"a": {1: (None,)}}, (), np.float32(2.5),
                               np.int8(-3)])
def test_values_round_trip_exactly(v):
    back = values.unpack(values.pack(v))
    assert back == v and type(back) is type(v)


def test_array_values_keep_dtype_bits_and_kind():
    t = torch.tensor([1.5, -0.0], dtype=torch.bfloat16)
    back = values.unpack(values.pack({"t": t, "n": np.arange(3, dtype=np.uint16)}))
    assert back["t"].dtype == torch.bfloat16 and back["t"].view(torch.int16).equal(t.view(torch.int16))
    assert back["n"].dtype == np.uint16 and back["n"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("bad", [argparse.Namespace(a=1), {1, 2}, 2**64, object(), {1.5: 2}])
def test_refused_values_say_how_to_convert(bad):
    with pytest.raises(sp.UnsupportedValueError, match="rng"):
        values.check_value(bad, "state['rng']")
