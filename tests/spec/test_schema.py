"""spec/schema/manifest.schema.json against every valid vector's manifest body.

The schema describes the decoded msgpack body with msgpack bin values replaced by the marker
``{"$bin": <length>}`` and extension values by ``{"$ext": <code>, "len": <length>}``
(the schema's own description says so); this file applies exactly that conversion.
"""

import json
import os
from pathlib import Path

import jsonschema
import msgpack
import pytest

ROOT = Path(__file__).resolve().parents[2] / "spec"
SCHEMA = json.loads((ROOT / "schema" / "manifest.schema.json").read_text())
VALID = sorted(os.listdir(ROOT / "vectors" / "valid"))


def marked(v):
    """Decoded msgpack -> the JSON form the schema describes."""
    if isinstance(v, bytes):
        return {"$bin": len(v)}
    if isinstance(v, msgpack.ExtType):
        return {"$ext": v.code, "len": len(v.data)}
    if isinstance(v, list):
        return [marked(x) for x in v]
    if isinstance(v, dict):
        return {k: marked(x) for k, x in v.items()}
    return v


def body(case):
    raw = (ROOT / "vectors" / "valid" / case / "checkpoint" / "manifest.msgpack").read_bytes()
    env = msgpack.unpackb(raw)
    return marked(
        msgpack.unpackb(
            env["body"], strict_map_key=False, ext_hook=lambda c, d: msgpack.ExtType(c, d)
        )
    )


def test_the_schema_is_a_valid_2020_12_schema():
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("case", VALID)
def test_manifest_bodies_match_the_schema(case):
    jsonschema.Draft202012Validator(SCHEMA).validate(body(case))


def _mutations(b):
    t0 = next(iter(b["tensors"]))
    yield "dtype outside the table", lambda x: x["tensors"][t0].update(dtype="float128")
    yield "array path with ..", lambda x: x["tensors"][t0].update(array="../x")
    yield "absolute array path", lambda x: x["tensors"][t0].update(array="/etc/x")
    yield (
        "chunk dim 0",
        lambda x: x["tensors"][t0].update(chunk_shape=[0] * len(x["tensors"][t0]["shape"]) or [0]),
    )
    yield "negative dim", lambda x: x["tensors"][t0].update(shape=[-1])
    yield "unknown field", lambda x: x.update(surprise=1)
    yield "unknown must-understand field", lambda x: x.update(v2={"must_understand": True})
    yield "unknown tensor field", lambda x: x["tensors"][t0].update(codec="zstd")
    yield "wrong format", lambda x: x.update(format="orbax")
    yield "version of three parts", lambda x: x.update(format_version=[1, 0, 0])
    yield "missing tree", lambda x: x.pop("tree")
    yield "leaf at the root", lambda x: x.update(tree={"value": 1})
    yield "object without values", lambda x: x["objects"].update(o={"count": 1})
    yield "object grid shape empty", lambda x: x["objects"]["rng"].update(shape=[])
    yield "object grid dimension 0", lambda x: x["objects"]["rng"].update(shape=[3, 0])
    yield "unknown object field", lambda x: x["objects"]["rng"].update(note=1)
    yield "unknown node kind", lambda x: x["tree"]["dict"].append(["z", {"set": []}])
    yield "list inside a value node", lambda x: x["tree"]["dict"].append(["z", {"value": [1]}])
    yield (
        "bad tensor origin",
        lambda x: x["tree"]["dict"].append(["z", {"tensor": "z", "origin": "jax"}]),
    )


@pytest.mark.parametrize("what", [w for w, _ in _mutations(body("nested_tree"))])
def test_schema_rejects_what_the_spec_forbids(what):
    b = body("nested_tree")
    edit = dict(_mutations(b))[what]
    edit(b)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(SCHEMA).validate(b)


def test_schema_accepts_what_the_spec_allows():
    b = body("nested_tree")
    b["later_minor_field"] = {"must_understand": False, "x": 1}
    b["extensions"]["vendor.note"] = {"must_understand": False}
    b["objects"]["rng"]["shape"] = [3, 1]  # a 1.1 object grid
    b["objects"]["rng"]["later"] = {"must_understand": False}
    b["created_unix"] = 1790000000  # a number, int or float
    jsonschema.Draft202012Validator(SCHEMA).validate(b)
