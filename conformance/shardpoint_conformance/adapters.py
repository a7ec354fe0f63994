"""The adapter protocol: how another implementation plugs into the harness without our code.

An adapter is a command line (``ADAPTER`` below, e.g. ``python my_jax_adapter.py``) that
implements three sub-commands. It runs as one process (world size 1).

``ADAPTER capabilities``
    Print one JSON object on stdout::

        {"name": "shardpoint-jax", "version": "0.1",
         "dtypes": ["bool", "int8", ..., "float8_e5m2"],       # spec dtype names it handles
         "features": ["values", "objects", "partial_read", "zero_size", "scalar",
                      "object_grid"]}

    Tensors of other dtypes and parts of a case needing a missing feature are left out of the
    cases given to that adapter, and the report says so (a skip with a reason, not a failure).

``ADAPTER write CASE.json DIR``
    Write, at ``DIR`` (which does not exist yet), the checkpoint the case describes, then exit
    0. The checkpoint must be complete and valid per spec/format.md when the command returns.

``ADAPTER read DIR CASE.json OUT_DIR``
    Read from the checkpoint at ``DIR`` what the case asks and write it to ``OUT_DIR``
    (created by the harness): for tensor ``i`` the region ``read`` (offset/shape, the whole
    tensor when absent) as ``OUT_DIR/<i>.npy``, and ``OUT_DIR/values.json`` =
    ``{"values": [v, ...], "objects": [[v, ...], ...]}`` in case order (values tagged as in
    the case). A checkpoint that breaks the spec must make ``read`` fail: exit non-zero and,
    where the failure matches a requirement, name its ID as ``[SP-...]`` on stderr.

The case file (``CASE.json``, version 1)::

    {"version": 1, "id": "a000",
     "tensors": [{"path": ["model", 0, "w"], "key": "model/0/w", "dtype": "bfloat16",
                  "shape": [5, 3], "file": "arrays/0.npy",
                  "read": {"offset": [1, 0], "shape": [3, 3]}}],
     "values":  [{"path": ["meta", "step"], "value": 7}],
     "objects": [{"path": ["rng"], "key": "rng", "values": [v0, v1]}]}

* ``path``: the tree path (str = dict key, int = dict key); ``key`` is its encoded key
  (spec/format.md, Keys). Containers are dicts.
* ``file``: the global tensor, relative to CASE.json, as a ``.npy`` file (little-endian,
  no pickle). numpy has no bfloat16 / float8 types, so **those dtypes travel as their raw
  bits**: ``bfloat16`` as ``<u2``, ``float8_e4m3fn`` and ``float8_e5m2`` as ``|u1``, the case's
  ``dtype`` naming the real type. Every other dtype uses its numpy type (``|b1`` for bool,
  ``<c8``/``<c16`` for complex). Read outputs follow the same convention.
* values: JSON, with bytes tagged as ``{"$b64": "<base64>"}``; lists and dicts are plain
  values (dicts with str keys). ``objects``: sharded objects; entry ``i`` of ``values`` is
  index ``i`` of ``count = len(values)``. Optional ``"shape"`` (only given to adapters listing
  the ``object_grid`` feature; spec 1.1 [SP-OBJ-1..4]): the object is a grid of that shape
  (product ``len(values)``), entry ``i`` of ``values`` is cell number ``i`` in row-major order,
  and ``read`` reports the values in that same flat order.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np

from shardpoint_conformance.cases import NUMPY_DTYPES, RAW_BITS, SPEC_DTYPES

FEATURES = ["values", "objects", "partial_read", "zero_size", "scalar", "object_grid"]
SPEC_ID = re.compile(r"\[(SP-[A-Z]+-\d+)\]")


def to_npy_array(a: np.ndarray, dtype: str) -> np.ndarray:
    """The array as it travels in a .npy file (raw bits for bf16/fp8)."""
    return a.view(RAW_BITS[dtype]) if dtype in RAW_BITS else a


def from_npy_array(a: np.ndarray, dtype: str) -> np.ndarray:
    want = RAW_BITS.get(dtype, NUMPY_DTYPES[dtype])
    if a.dtype.newbyteorder("=") != want.newbyteorder("=") or a.dtype.itemsize != want.itemsize:
        raise ValueError(f"npy dtype {a.dtype} does not match {dtype} (expected {want})")
    a = a.astype(want.newbyteorder("<"), copy=False)
    return a.view(NUMPY_DTYPES[dtype]) if dtype in RAW_BITS else a


def save_npy(path: str, a: np.ndarray, dtype: str) -> None:
    np.save(path, np.asarray(to_npy_array(a, dtype), order="C"), allow_pickle=False)


def load_npy(path: str, dtype: str) -> np.ndarray:
    return from_npy_array(np.load(path, allow_pickle=False), dtype)


class AdapterError(RuntimeError):
    """The adapter under test cannot be run or breaks the protocol before any case runs."""


@dataclass
class CallResult:
    ok: bool
    returncode: int
    stdout: str
    stderr: str

    @property
    def spec_ids(self) -> list:
        return sorted(set(SPEC_ID.findall(self.stderr + self.stdout)))

    def brief(self) -> str:
        tail = (self.stderr.strip() or self.stdout.strip()).splitlines()[-3:]
        return f"exit {self.returncode}: " + " | ".join(tail)[:500]


# The adapters shipped in this package: ``python -m`` one of them runs in a process forked from
# the launcher's fork server (torch and shardpoint already imported) instead of a fresh
# interpreter, which costs each call about as much CPU as the call's own work. Only these:
# they are this very package, so the preloaded modules are the ones the command would import;
# any other command (another implementation, another checkout) runs exactly as given.
SHIPPED = ("shardpoint_conformance.reference_adapter", "shardpoint_conformance.broken_adapter")


def _shipped_module(argv: list) -> Optional[str]:
    """The shipped adapter module ``argv`` runs with this interpreter, else None."""
    if (
        len(argv) >= 3
        and argv[1] == "-m"
        and argv[2] in SHIPPED
        and os.path.abspath(argv[0]) == os.path.abspath(sys.executable)
    ):  # this venv's
        return argv[2]
    return None


class CommandAdapter:
    """An adapter reached through its command line (no import of its code)."""

    def __init__(self, command: str, timeout: float = 120.0) -> None:
        self.argv = shlex.split(command)
        self.command = command
        self.timeout = timeout

    def _call(self, *args: str) -> CallResult:
        module = _shipped_module(self.argv)
        if module is not None:
            return self._call_forked(module, *self.argv[3:], *args)
        try:
            p = subprocess.run(
                self.argv + list(args), capture_output=True, text=True, timeout=self.timeout
            )
        except subprocess.TimeoutExpired as e:
            return CallResult(
                False,
                -1,
                str(e.stdout or ""),
                f"timed out after {self.timeout:.0f}s: {' '.join(args)}",
            )
        except OSError as e:
            return CallResult(False, -1, "", f"cannot run {self.command!r}: {e}")
        return CallResult(p.returncode == 0, p.returncode, p.stdout, p.stderr)

    def _call_forked(self, module: str, *argv: str) -> CallResult:
        """``python -m module argv...``, forked from the fork server (see ``SHIPPED``)."""
        from shardpoint_testing.launch import RankFailure, run_code

        code = f"import runpy; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
        try:
            p = run_code(code, *argv, timeout=self.timeout)
        except RankFailure:
            return CallResult(
                False, -1, "", f"timed out after {self.timeout:.0f}s: {' '.join(argv)}"
            )
        return CallResult(p.returncode == 0, p.returncode, p.stdout, p.stderr)

    def capabilities(self) -> dict:
        r = self._call("capabilities")
        if not r.ok:
            raise AdapterError(f"adapter capabilities failed: {r.brief()}")
        try:
            caps = json.loads(r.stdout)
        except ValueError:
            caps = None
        if not isinstance(caps, dict):
            raise AdapterError(
                f"{self.command!r} capabilities printed {r.stdout[:200]!r}, not "
                'a JSON object like {"name": ..., "dtypes": [...], '
                '"features": [...]}'
            )
        caps.setdefault("name", self.command)
        caps["dtypes"] = [d for d in caps.get("dtypes", []) if d in SPEC_DTYPES]
        caps["features"] = list(caps.get("features", []))
        return caps

    def write(self, case_json: str, out_dir: str) -> CallResult:
        return self._call("write", case_json, out_dir)

    def read(self, ckpt_dir: str, case_json: str, out_dir: str) -> CallResult:
        return self._call("read", ckpt_dir, case_json, out_dir)


def reference_adapter_command() -> str:
    return f"{shlex.quote(sys.executable)} -m shardpoint_conformance.reference_adapter"


def write_case_files(case: dict, arrays: dict, case_dir: str) -> str:
    """Write CASE.json and its arrays under ``case_dir``; returns the CASE.json path."""
    os.makedirs(os.path.join(case_dir, "arrays"), exist_ok=True)
    for t in case["tensors"]:
        save_npy(os.path.join(case_dir, t["file"]), arrays[t["key"]], t["dtype"])
    path = os.path.join(case_dir, "case.json")
    with open(path, "w") as f:
        json.dump(case, f, indent=1)
    return path


def read_case_files(case_json: str) -> tuple:
    """(case, {key: global array}) from a CASE.json written by :func:`write_case_files`."""
    with open(case_json) as f:
        case = json.load(f)
    base = os.path.dirname(os.path.abspath(case_json))
    arrays = {
        t["key"]: load_npy(os.path.join(base, t["file"]), t["dtype"]) for t in case["tensors"]
    }
    return case, arrays


def region_of(t: dict) -> tuple:
    r: Optional[dict] = t.get("read")
    if not r:
        return [0] * len(t["shape"]), list(t["shape"])
    return list(r["offset"]), list(r["shape"])
