"""The fuzzer's report says what was checked: how many mutated copies each reader refused
with a documented error, accepted, or failed on; "verify: ok: 200" meant only "did not
crash" (issue 32). The command's own output is checked by tests/core/test_fuzz.py's short
run."""

from shardpoint_conformance import fuzz


def test_outcomes_are_counted_by_what_each_reader_did():
    outcomes: dict = {}
    for out in (
        {
            "read_metadata": ["ok", None],
            "load": ["documented", "CorruptCheckpointError", "SP-READ-3"],
            "verify": ["ok", ["SP-READ-3"]],
        },
        {"read_metadata": ["ok", None], "load": ["ok", None], "verify": ["ok", []]},
        {
            "read_metadata": ["documented", "UnsupportedFormatError", "SP-VER-1"],
            "load": ["UNDOCUMENTED", "TypeError", "x", ""],
            "verify": ["ok", ["SP-VER-1"]],
        },
        {"crash": "killed by signal 11", "stderr": ""},
    ):
        fuzz.tally(out, outcomes)
    rm, load, verify = fuzz.describe(outcomes)
    assert load == (
        "load: refused with a documented error: 1 (CorruptCheckpointError 1), "
        "accepted (read without error: the mutation left it readable): 1, "
        "undocumented error: 1, crashed: 1"
    )
    assert rm.startswith(
        "read_metadata: refused with a documented error: 1 "
        "(UnsupportedFormatError 1), accepted (read without error: the "
        "mutation left it readable): 2,"
    )
    assert verify.startswith(
        "verify: reported problems: 2, found no problem (the mutation "
        "harmless to it): 1, raised (verify must not): 0"
    )
