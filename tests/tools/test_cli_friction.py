"""Small things a first-time user trips on in the command line (issue 32): sizes printed
right when piped, a diff across naming conventions, an example in every ``--help``."""

import json

import torch

import shardpoint as sp
from shardpoint.tools.cli import main as cli


def run(capsys, *argv):
    rc = cli(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_inspect_total_is_the_checkpoint_size_when_piped(tmp_path, capsys):
    """The total line printed the table width (1 << 30 in a pipe) as the byte size."""
    p = str(tmp_path / "ck")
    sp.save({"w": torch.ones(12)}, p)  # 48 bytes of float32
    rc, out, _ = run(capsys, "inspect", p)  # capsys: not a terminal
    total = next(line for line in out.splitlines() if line.startswith("total:"))
    assert rc == 0 and "1 tensors, 48 B in 1 chunks" in total, total


def test_diff_of_a_safetensors_export_compares_every_tensor(tmp_path, capsys):
    """``model/weight`` and its safetensors name ``model.weight`` are one tensor: compared,
    not listed as 'only in A' and 'only in B' with 0 tensors compared."""
    ck, st = str(tmp_path / "ck"), str(tmp_path / "out.safetensors")
    sp.save(
        {
            "model": {"weight": torch.arange(12.0).reshape(3, 4), "layers.0.bias": torch.ones(4)},
            "step": 3,
        },
        ck,
    )
    assert run(capsys, "convert", ck, st)[0] == 0
    rc, out, _ = run(capsys, "diff", ck, st)
    assert rc == 0, out
    assert not [line for line in out.splitlines() if line.startswith("only in")], out
    assert "2 of 2 tensors in A (64 B) compared" in out and out.splitlines()[-1].startswith(
        "equal (bitwise)"
    )
    assert "not compared: step: only in A" in out and "tensors only" in out
    assert "2 key(s) matched by flat name" in out
    rc, out, _ = run(capsys, "diff", st, ck, "--json")
    d = json.loads(out)
    assert rc == 0 and d["compared_tensors"] == 2 and d["equal"]
    assert {"a": "model.weight", "b": "model/weight"} in d["renamed"]
    # a changed element is still found through the renamed key
    sp.save(
        {
            "model": {
                "weight": (torch.arange(12.0) + (torch.arange(12) == 5)).reshape(3, 4),
                "layers.0.bias": torch.ones(4),
            }
        },
        str(tmp_path / "ck2"),
    )
    rc, out, _ = run(capsys, "diff", str(tmp_path / "ck2"), st)
    assert rc == 1 and "differs:   model/weight: 1 of 12 elements, first at [1, 1]" in out


def test_diff_that_compared_no_tensor_says_so_and_fails(tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    sp.save({"enc": {"w": torch.ones(2)}}, a)
    sp.save({"dec": {"w": torch.ones(2)}}, b)
    rc, out, _ = run(capsys, "diff", a, b)
    assert rc == 1 and "NOTHING COMPARED: A has 1 tensor(s), B 1" in out
    assert "DIFFERENT (bitwise): 0 of 1 tensors in A" in out
    rc, out, _ = run(capsys, "diff", a, b, "--json")
    d = json.loads(out)
    assert rc == 1 and d["nothing_compared"] and not d["equal"]


def _commands(parser) -> list:
    """The names of a parser's sub-commands (from argparse's own sub-parser action)."""
    import argparse

    return [
        n for a in parser._actions if isinstance(a, argparse._SubParsersAction) for n in a.choices
    ]


def test_every_help_of_every_command_ends_with_examples(capsys):
    """``demo --help`` and ``conformance --help`` had no example; walk them all, nested
    conformance commands included, so that a new command without examples fails here."""
    from shardpoint.tools.cli import _parser
    from shardpoint_conformance.cli import _parser as conformance_parser

    argvs = [[]] + [[c] for c in _commands(_parser())]
    argvs += [["conformance", c] for c in _commands(conformance_parser())]
    assert ["demo"] in argvs and ["conformance", "fuzz"] in argvs and len(argvs) >= 12
    for argv in argvs:
        assert cli(argv + ["--help"]) == 0, argv
        out = capsys.readouterr().out
        assert "\nexamples:\n" in out, (argv, out)
        ex = out.split("\nexamples:\n")[1]
        lines = [
            ln.strip()
            for ln in ex.splitlines()
            if ln.startswith("  shardpoint") or ln.startswith("  torchrun")
        ]
        assert lines, (argv, ex)
        # each example runs the command whose help it is
        prefix = " ".join(["shardpoint"] + argv)
        assert any(ln.startswith(prefix) for ln in lines), (argv, lines)
