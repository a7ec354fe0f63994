"""Golden vectors: bytes reproduce exactly, every reader path reads them, errors match."""
import filecmp
import json
import os
from pathlib import Path

import jsonschema
import msgpack
import pytest

from shardpoint_conformance import vectors

ROOT = Path(__file__).resolve().parents[1] / "spec" / "vectors"
SCHEMA = json.loads((ROOT.parent / "schema" / "manifest.schema.json").read_text())


def _files(d):
    return sorted(str(p.relative_to(d)) for p in Path(d).rglob("*") if p.is_file())


def test_regenerated_vectors_are_byte_identical(tmp_path):
    vectors.generate(str(tmp_path))
    assert _files(tmp_path) == _files(ROOT), "the set of vector files drifted"
    for rel in _files(ROOT):
        assert filecmp.cmp(ROOT / rel, tmp_path / rel, shallow=False), f"bytes drifted: {rel}"


def test_every_vector_reads_as_expected():
    ok, text = vectors.check_vectors(str(ROOT))
    assert ok, text
    assert text.count(": ok") == len(os.listdir(ROOT / "valid")) + len(os.listdir(ROOT / "invalid"))


def _marked(v):
    """Decoded msgpack -> the JSON form the schema describes (bin and ext as markers)."""
    if isinstance(v, bytes):
        return {"$bin": len(v)}
    if isinstance(v, msgpack.ExtType):
        return {"$ext": v.code, "len": len(v.data)}
    if isinstance(v, list):
        return [_marked(x) for x in v]
    if isinstance(v, dict):
        return {k: _marked(x) for k, x in v.items()}
    return v


def _body(ckpt):
    env = msgpack.unpackb(open(os.path.join(ckpt, "manifest.msgpack"), "rb").read())
    return msgpack.unpackb(env["body"], strict_map_key=False,
                           ext_hook=lambda c, d: msgpack.ExtType(c, d))


@pytest.mark.parametrize("case", sorted(os.listdir(ROOT / "valid")))
def test_manifest_bodies_match_the_schema(case):
    jsonschema.validate(_marked(_body(ROOT / "valid" / case / "checkpoint")), SCHEMA)


def test_schema_rejects_what_the_spec_forbids():
    body = _marked(_body(ROOT / "valid" / "nested_tree" / "checkpoint"))
    bad_dtype = json.loads(json.dumps(body))
    next(iter(bad_dtype["tensors"].values()))["dtype"] = "float128"
    bad_path = json.loads(json.dumps(body))
    next(iter(bad_path["tensors"].values()))["array"] = "../x"
    bad_field = dict(body, surprise=1)
    for b in (bad_dtype, bad_path, bad_field):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(b, SCHEMA)
