"""Key encoding ([SP-KEY-1]..[SP-KEY-5]): one canonical, path-safe string per tree path."""

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import shardpoint as sp
from shardpoint_core.format.keys import (
    MAX_KEY_BYTES,
    decode_component,
    decode_key,
    encode_component,
    encode_key,
)

TRICKY = [
    "0",
    "-1",
    "-0",
    "007",
    "~",
    "~1",
    "%",
    "%25",
    "/",
    "a/b",
    "//",
    "...",
    ".a",
    "a.",
    "é",
    "ü/n",
    "\x00",
    " ",
    "日本",
    "🙂",
    "a%2Fb",
    "+1",
    "1e3",
    "CON",
    "zarr.json",
    "c",
]
components = st.one_of(
    st.text(min_size=1, max_size=12).filter(lambda s: s not in (".", "..")),
    st.text(alphabet="0123456789-~%/.", min_size=1, max_size=6).filter(
        lambda s: s not in (".", "..")
    ),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from(TRICKY),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(components, min_size=1, max_size=6))
def test_round_trip_and_path_safety(path):
    key = encode_key(path)
    back = decode_key(key)
    assert back == tuple(path) and [type(c) for c in back] == [type(c) for c in path]
    parts = key.split("/")
    assert len(parts) == len(path)
    assert all(p not in ("", ".", "..") for p in parts)
    assert all(c.isascii() and c.isprintable() and c not in '\\:*?"<>| ' for c in key)
    assert encode_key(back) == key  # canonical: exactly one encoding


@settings(max_examples=200, deadline=None)
@given(components, components)
def test_distinct_components_never_collide(a, b):
    if a != b or type(a) is not type(b):
        assert encode_component(a) != encode_component(b)


@pytest.mark.parametrize(
    "path,key",
    [
        (["model", "layers.0.w"], "model/layers.0.w"),
        (["opt", 3], "opt/3"),
        (["x", "3"], "x/~3"),
        (["a/b c"], "a%2Fb%20c"),
        (["50%"], "50%25"),
        (["-3", -3], "~-3/-3"),
        (["~x"], "%7Ex"),
        (["ün"], "%C3%BCn"),
        ([0], "0"),
        (["0"], "~0"),
        (["-0"], "~-0"),
        ([2**64 - 1], str(2**64 - 1)),
    ],
)
def test_spec_examples(path, key):
    assert encode_key(path) == key and decode_key(key) == tuple(path)


@pytest.mark.parametrize("bad", ["", ".", ".."])
def test_empty_dot_and_dotdot_are_refused(bad):
    with pytest.raises(sp.InvalidKeyError) as e:
        encode_key(["ok", bad])
    assert e.value.spec_id == "SP-KEY-2" and repr(bad) in str(e.value)


@pytest.mark.parametrize(
    "bad", [True, False, 1.5, float("nan"), None, ("t",), b"x", 2**64, -(2**63) - 1, "\ud800"]
)
def test_unusable_component_types_are_refused(bad):
    with pytest.raises(sp.InvalidKeyError) as e:
        encode_key(["ok", bad])
    assert e.value.spec_id == "SP-KEY-1"


def test_root_is_not_a_key_and_long_keys_are_refused():
    with pytest.raises(sp.InvalidKeyError, match="root"):
        encode_key([])
    encode_key(["a" * MAX_KEY_BYTES])
    with pytest.raises(sp.InvalidKeyError) as e:
        encode_key(["a" * MAX_KEY_BYTES, "b"])
    assert e.value.spec_id == "SP-KEY-4"
    with pytest.raises(sp.InvalidKeyError):
        decode_key("a" * (MAX_KEY_BYTES + 1))


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "a//b",
        "/a",
        "a/",
        ".",
        "..",
        "a/../b",
        "%2f",
        "%7e",
        "~x",
        "~7x",
        "a~b",
        "01",
        "-0",
        "+1",
        "%ZZ",
        "%4",
        "%41",
        "%FF",
        "a b",
        "é",
        "~~1",
        "~",
        "%C3",
    ],
)
def test_readers_reject_non_canonical_keys(bad):
    with pytest.raises(sp.InvalidKeyError) as e:
        decode_key(bad)
    assert e.value.spec_id in ("SP-KEY-2", "SP-KEY-3", "SP-KEY-4")


def test_decode_rejects_non_strings():
    for bad in (None, 3, b"a"):
        with pytest.raises(sp.InvalidKeyError):
            decode_key(bad)
    with pytest.raises(sp.InvalidKeyError):
        decode_component("a/b")


@pytest.mark.parametrize("layout", ["per-array", "packed"])
def test_keys_of_a_saved_tree_are_the_array_directories(tmp_ckpt, layout):
    """Encoded keys name the arrays: directories of the per-array layout, the names the
    packed index lists (which name no file, [SP-PACK-1])."""
    import os
    import torch

    state = {
        "a/b": torch.ones(1),
        "..": {"~": torch.ones(1)},
        7: [torch.ones(1)],
        "7": torch.ones(1),
    }
    be = sp.ZarrBackend() if layout == "per-array" else None
    with pytest.raises(sp.InvalidKeyError):
        sp.save(state, tmp_ckpt, backend=be)
    del state[".."]
    sp.save(state, tmp_ckpt, backend=be)
    m = sp.read_metadata(tmp_ckpt)
    assert sorted(m.tensors) == ["7/0", "a%2Fb", "~7"]
    if layout == "per-array":
        assert sorted(os.listdir(f"{tmp_ckpt}/tensors")) == ["7", "a%2Fb", "zarr.json", "~7"]
    else:
        names = sorted(name for name, _inner in m.packed.arrays)
        assert names == ["tensors/7/0", "tensors/a%2Fb", "tensors/~7"]
        assert sorted(os.listdir(tmp_ckpt)) == ["manifest.msgpack", "packed"]
    back = sp.load(tmp_ckpt)
    assert set(back) == {"a/b", 7, "7"} and isinstance(back[7], list)
