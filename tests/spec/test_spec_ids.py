"""Every requirement ID the code raises is defined in spec/, and every MUST carries an ID."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SPEC = "\n".join(p.read_text() for p in (REPO / "spec").glob("*.md"))
ID = re.compile(r"SP-[A-Z]+-\d+")


def test_ids_used_in_code_are_defined_in_the_spec():
    used = set()
    for d in ("core", "reference", "testing", "conformance"):
        for p in (REPO / d).rglob("*.py"):
            used |= set(ID.findall(p.read_text()))
    defined = set(re.findall(r"\[(SP-[A-Z]+-\d+)\]", SPEC))
    assert used - defined == set(), f"IDs used but not defined in spec/: {sorted(used - defined)}"


def test_every_must_in_the_normative_docs_has_an_id():
    for name in ("format.md", "versioning.md", "security.md"):
        text = (REPO / "spec" / name).read_text()
        # requirement items are list items or paragraphs; each one with MUST needs an ID
        for block in re.split(r"\n(?=- |\d+\. |\n)", text):
            if re.search(r"\bMUST\b", block) and not ID.search(block):
                raise AssertionError(
                    f"{name}: MUST without a requirement ID:\n{block.strip()[:300]}"
                )


def test_ids_are_defined_once():
    ids = re.findall(r"^\s*(?:- )?\[(SP-[A-Z]+-\d+)\]", SPEC, re.M)
    dupes = {i for i in ids if ids.count(i) > 1}
    assert not dupes, dupes


def test_ids_named_by_the_vectors_are_defined():
    import json

    defined = set(re.findall(r"\[(SP-[A-Z]+-\d+)\]", SPEC))
    named = {
        json.loads(p.read_text())["spec_id"]
        for p in (REPO / "spec" / "vectors" / "invalid").glob("*/expected.json")
    }
    assert named and named <= defined, sorted(named - defined)
