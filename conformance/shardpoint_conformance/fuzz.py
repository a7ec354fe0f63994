"""Structure-aware fuzzing of the readers: mutated manifests, ``zarr.json`` files, shard
indexes and chunks, each read by ``sp.load``, ``read_metadata`` and ``verify``.

A run saves one small checkpoint (sharded and plain arrays, values, tuples, a sharded
object), then for each case copies it, applies one to three mutations drawn from a seeded
generator (decoded structure edited and re-sealed, so the checksums do not stop them at the
door) and hands the copy to a long-lived worker process running the three readers. A case
passes when every reader returns or raises a documented :class:`ShardpointError` (``verify``
must never raise); it fails on any other exception, a crash (signal), a hang (``timeout``)
or the worker going over its memory bound (a memory cgroup when one can be made here).

    shardpoint conformance fuzz --cases 10000 --seed 0 --memory 1GiB
    python -m shardpoint_conformance.fuzz --cases 200          # the CI's short run

Each failure is kept under ``--dir`` with the seed that reproduces it (``--replay SEED``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Optional

import crc32c
import msgpack

from shardpoint_conformance import hostile

_WORKER = r"""
import json, os, sys, traceback
os.environ.setdefault("OMP_NUM_THREADS", "1")
import shardpoint as sp
from shardpoint_core.format.errors import ShardpointError
from shardpoint_core.verify import verify_checkpoint
import torch
torch.set_num_threads(1)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    path = line.strip()
    out = {}
    for name, fn in (("read_metadata", lambda: sp.read_metadata(path).tree),
                     ("load", lambda: sp.load(path)),
                     ("verify", lambda: verify_checkpoint(path).spec_ids)):
        try:
            r = fn()
            out[name] = ["ok", r if name == "verify" else None]
        except ShardpointError as e:
            out[name] = ["documented", type(e).__name__, e.spec_id]
        except BaseException as e:
            out[name] = ["UNDOCUMENTED", type(e).__name__, str(e)[:300],
                         traceback.format_exc()[-1500:]]
    print(json.dumps(out), flush=True)
"""

BIG = [
    0,
    1,
    2,
    7,
    255,
    256,
    2**31 - 1,
    2**31,
    2**32,
    2**53,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 1,
    -1,
    -(2**63),
]


def _parse_size(s: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    s = s.strip().lower().rstrip("ib").rstrip("b") if s[-1:].isalpha() else s
    if s and s[-1] in units:
        return int(float(s[:-1]) * units[s[-1]])
    return int(s)


# ------------------------------------------------------------------------------ mutators
def _random_scalar(rng: random.Random) -> Any:
    return rng.choice(
        [
            None,
            True,
            False,
            rng.choice(BIG),
            1.5,
            float("nan"),
            -0.0,
            "",
            "../../etc",
            "float128",
            "x" * rng.choice([1, 300, 5000]),
            b"\x00",
            [],
            {},
            [[[]]],
            {"must_understand": False},
            {"must_understand": True},
            msgpack.ExtType(rng.choice([1, 2, 3, 5, -1]), os.urandom(rng.randint(0, 8))),
            hostile.nested_tuples(rng.choice([3, 200, 300, 600])),
        ]
    )


def _mutate_tree(node: Any, rng: random.Random, depth: int = 0) -> Any:
    """A copy of ``node`` with one random edit somewhere inside."""
    if isinstance(node, dict) and node and rng.random() < 0.8:
        k = rng.choice(list(node))
        op = rng.random()
        out = dict(node)
        if op < 0.15:
            del out[k]
        elif op < 0.25:
            out[
                rng.choice(["extra", 7, "must_understand", k + "_" if isinstance(k, str) else "k"])
            ] = _random_scalar(rng)
        elif op < 0.75:
            out[k] = _mutate_tree(node[k], rng, depth + 1)
        else:
            out[k] = _random_scalar(rng)
        return out
    if isinstance(node, list) and node and rng.random() < 0.8:
        i = rng.randrange(len(node))
        items = list(node)
        op = rng.random()
        if op < 0.15:
            del items[i]
        elif op < 0.25:
            items.insert(i, items[i])
        elif op < 0.75:
            items[i] = _mutate_tree(node[i], rng, depth + 1)
        else:
            items[i] = _random_scalar(rng)
        return items
    if isinstance(node, int) and not isinstance(node, bool) and rng.random() < 0.7:
        return rng.choice(BIG + [node + 1, node - 1, node * 2])
    return _random_scalar(rng)


def mutate_manifest(root: str, rng: random.Random) -> str:
    raw = open(os.path.join(root, hostile.MANIFEST), "rb").read()
    env = msgpack.unpackb(raw)
    body = msgpack.unpackb(env["body"], strict_map_key=False)
    r = rng.random()
    if r < 0.75:
        body = _mutate_tree(body, rng)
        new = msgpack.packb(body, use_bin_type=True)
        if rng.random() < 0.1:  # duplicated key: spelled in bytes (a dict cannot hold it)
            new = new.replace(b"\xa7objects", b"\xa7objects", 1)
        hostile.write_body(root, None, new)
        return "manifest body edited and re-sealed"
    if r < 0.85:
        data = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        open(os.path.join(root, hostile.MANIFEST), "wb").write(bytes(data))
        return "manifest bytes flipped"
    if r < 0.92:
        open(os.path.join(root, hostile.MANIFEST), "wb").write(raw[: rng.randrange(len(raw))])
        return "manifest truncated"
    b = env["body"]
    cut = rng.randrange(len(b))
    new = (
        b[:cut]
        + rng.choice([b"\x91" * 3000, b"\xdf\xff\xff\xff\xff", b"\xc1", b"\xdb\xff\xff\xff\xff"])
        + b[cut:]
    )
    hostile.write_body(root, None, new)
    return "manifest body spliced and re-sealed"


def _arrays(root: str) -> list:
    out = []
    for d, _s, fs in os.walk(os.path.join(root, "tensors")):
        if "zarr.json" in fs:
            out.append(d)
    return sorted(out)


def mutate_zarr_json(root: str, rng: random.Random) -> str:
    arr = rng.choice(_arrays(root))
    p = os.path.join(arr, "zarr.json")
    meta = json.load(open(p))
    r = rng.random()
    if r < 0.7:
        meta = _mutate_tree(meta, rng)
        text = json.dumps(meta, default=lambda o: repr(o), allow_nan=True)
    elif r < 0.8:
        text = json.dumps(meta)[:-1] + ',"shape":[1]}'  # a repeated name
    elif r < 0.9:
        text = json.dumps(meta)[:-1] + ',"attributes":{"x":' + "[" * 50000 + "]" * 50000 + "}}"
    else:
        text = json.dumps(meta)[: rng.randrange(len(json.dumps(meta)))]
    open(p, "w").write(text)
    return f"zarr.json of {os.path.relpath(arr, root)} edited"


def _chunk_files(root: str) -> list:
    out = []
    for arr in _arrays(root):
        c = os.path.join(arr, "c")
        if os.path.isfile(c):
            out.append((arr, c))
        for d, _s, fs in os.walk(c):
            out += [(arr, os.path.join(d, f)) for f in fs]
    return out


def mutate_shard_index(root: str, rng: random.Random) -> str:
    shards = []
    for arr, f in _chunk_files(root):
        meta = json.load(open(os.path.join(arr, "zarr.json")))
        codec = meta["codecs"][0]
        if codec.get("name") == "sharding_indexed":
            chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
            inner = codec["configuration"]["chunk_shape"]
            n = 1
            for c, i in zip(chunk, inner):
                n *= c // i
            shards.append((f, n))
    if not shards:
        return mutate_chunk(root, rng)
    f, n = rng.choice(shards)
    raw = bytearray(open(f, "rb").read())
    isz = 16 * n
    index = bytearray(raw[-isz - 4 : -4])
    for _ in range(rng.randint(1, 3)):
        e = rng.randrange(n)
        field = rng.randrange(2)
        r = rng.random()
        if r < 0.4:
            v = rng.choice(BIG + [2**64 - 1]) % 2**64
        elif r < 0.7:  # alias another entry
            other = rng.randrange(n)
            v = int.from_bytes(index[16 * other + 8 * field : 16 * other + 8 * field + 8], "little")
        else:
            old = int.from_bytes(index[16 * e + 8 * field : 16 * e + 8 * field + 8], "little")
            v = (old + rng.choice([-4, -1, 1, 4, 16])) % 2**64
        index[16 * e + 8 * field : 16 * e + 8 * field + 8] = v.to_bytes(8, "little")
    crc = crc32c.crc32c(bytes(index)) if rng.random() < 0.9 else rng.randrange(2**32)
    raw[-isz - 4 :] = bytes(index) + crc.to_bytes(4, "little")
    open(f, "wb").write(bytes(raw))
    return f"shard index of {os.path.relpath(f, root)} edited"


def mutate_chunk(root: str, rng: random.Random) -> str:
    _arr, f = rng.choice(_chunk_files(root))
    raw = bytearray(open(f, "rb").read())
    r = rng.random()
    if r < 0.5 and raw:
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    elif r < 0.75:
        raw = raw[: rng.randrange(len(raw) + 1)]
    else:
        raw += os.urandom(rng.randint(1, 64))
    open(f, "wb").write(bytes(raw))
    return f"chunk {os.path.relpath(f, root)} damaged"


MUTATORS: list = [
    (mutate_manifest, 4),
    (mutate_zarr_json, 3),
    (mutate_shard_index, 3),
    (mutate_chunk, 1),
]


def make_case(base: str, dst: str, seed: int) -> list:
    """Copy ``base`` to ``dst`` and apply the mutations drawn from ``seed``; returns what was
    done (the reproduction is the seed)."""
    rng = random.Random(seed)
    shutil.copytree(base, dst)
    done = []
    fns, weights = zip(*MUTATORS)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        fn = rng.choices(fns, weights)[0]
        try:
            done.append(fn(dst, rng))
        except (Exception, RecursionError) as e:  # noqa: BLE001 - an earlier mutation
            # left nothing this one can edit (a zarr.json no longer JSON): go on without it
            done.append(f"{fn.__name__} could not apply ({type(e).__name__}); skipped")
    return done


def write_base(path: str) -> None:
    """The checkpoint every case starts from (written by the library under test, in a
    subprocess so this module imports nothing of it)."""
    code = (
        "import sys, torch, numpy as np, shardpoint as sp\n"
        "from shardpoint_core.transactions.backend import ZarrBackend\n"
        "be = ZarrBackend(shard_above_bytes=128, inner_chunk_bytes=64)\n"
        "opts = sp.SaveOptions(plan=sp.PlanOptions(max_chunk_bytes=256))\n"
        "state = {'model': {'w': torch.arange(256, dtype=torch.float32).reshape(16, 16),\n"
        "                   'b': torch.ones(5, dtype=torch.bfloat16),\n"
        "                   'flags': torch.tensor([True, False, True])},\n"
        "         'opt': [torch.zeros(3, 4, dtype=torch.float64), (1, 2.5, 'x')],\n"
        "         'np': np.arange(6, dtype=np.int16), 'step': 7, 'blob': b'\\x00\\x01',\n"
        "         'rng': sp.ShardedObject({'seed': 3, 'state': torch.arange(4)}, 0, 1)}\n"
        "sp.save(state, sys.argv[1], backend=be, options=opts)\n"
    )
    subprocess.run([sys.executable, "-c", code, path], check=True, timeout=300, capture_output=True)


# -------------------------------------------------------------------------------- worker
class Worker:
    """One reader process fed checkpoint paths on stdin, in a memory cgroup when possible."""

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self.cgroup: Optional[str] = None
        self.proc: Optional[subprocess.Popen[str]] = None

    def start(self) -> None:
        code = _WORKER
        make = hostile._memory_cgroup()
        if make is not None and self.memory_bytes:
            base, limit_file, _swap = make(self.memory_bytes)
            self.cgroup = os.path.join(base, f"shardpoint_fuzz_{uuid.uuid4().hex[:12]}")
            os.mkdir(self.cgroup)
            with open(os.path.join(self.cgroup, limit_file), "w") as f:
                f.write(str(self.memory_bytes))
            code = (
                f"import os; open({os.path.join(self.cgroup, 'cgroup.procs')!r}, 'w')"
                f".write(str(os.getpid()))\n" + code
            )
        self.proc = proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        assert proc.stdout is not None and proc.stderr is not None, "started with pipes"
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"fuzz worker did not start: {proc.stderr.read()[-2000:]}")

    @property
    def bounded(self) -> bool:
        return self.cgroup is not None

    def read(self, path: str, timeout: float) -> dict:
        """The three readers' outcomes, or ``{"crash": ...}`` when the worker died or hung."""
        import select

        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self.start()
        assert self.proc is not None
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None, "started with pipes"
        stdin.write(path + "\n")
        stdin.flush()
        ready, _, _ = select.select([stdout], [], [], timeout)
        line = stdout.readline() if ready else ""
        if not line:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
                what = f"hang (no answer in {timeout:g} s)"
            else:
                rc = self.proc.returncode
                what = (
                    f"killed by signal {-rc}"
                    + (" (SIGKILL: over the memory bound?)" if rc == -9 else "")
                    if rc < 0
                    else f"exited with code {rc}"
                )
            err = self.proc.stderr.read()[-2000:] if self.proc.stderr else ""
            self.stop()
            return {"crash": what, "stderr": err}
        return json.loads(line)

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None
        if self.cgroup is not None:
            try:
                os.rmdir(self.cgroup)
            except OSError:
                pass
            self.cgroup = None


def judge(out: dict) -> str:
    """'' when every reader returned or raised a documented error, else why not."""
    if "crash" in out:
        return f"reader process {out['crash']}: {out.get('stderr', '')[-300:]}"
    bad = [f"{name}: {r[1]}: {r[2]}" for name, r in out.items() if r[0] == "UNDOCUMENTED"]
    # The base class is what a dependency's exception was wrapped in: no rule, no class.
    bad += [
        f"{name}: bare ShardpointError"
        for name, r in out.items()
        if r[0] == "documented" and r[1] == "ShardpointError"
    ]
    return "; ".join(bad)


READERS = ("read_metadata", "load", "verify")


def tally(out: dict, outcomes: dict) -> None:
    """Count one case's worker output into ``outcomes`` under keys that say what happened:
    ``load: refused: CorruptCheckpointError``, ``load: accepted``, ``verify: reported
    problems``, ``verify: found no problem``, ``<reader>: UNDOCUMENTED: TypeError``,
    ``reader process: crashed``."""

    def add(k: str) -> None:
        outcomes[k] = outcomes.get(k, 0) + 1

    if "crash" in out:
        add("reader process: crashed")
    for name, r in out.items():
        if not isinstance(r, list):
            continue
        if r[0] == "ok" and name == "verify":
            add("verify: reported problems" if r[1] else "verify: found no problem")
        elif r[0] == "ok":
            add(f"{name}: accepted")
        elif r[0] == "documented":
            add(f"{name}: {'raised' if name == 'verify' else 'refused'}: {r[1]}")
        else:
            add(f"{name}: UNDOCUMENTED: {r[1]}")


def describe(outcomes: dict) -> list:
    """One line per reader saying what was checked: how many mutated copies each refused
    with a documented error (by class), accepted, or failed on (undocumented error, crash)."""
    crashed = outcomes.get("reader process: crashed", 0)
    lines = []
    for name in READERS:
        mine = {k[len(name) + 2 :]: v for k, v in outcomes.items() if k.startswith(name + ": ")}
        bad = sum(v for k, v in mine.items() if k.startswith("UNDOCUMENTED"))
        if name == "verify":
            raised = sum(v for k, v in mine.items() if k.startswith("raised"))
            lines.append(
                f"{name}: reported problems: {mine.get('reported problems', 0)}, "
                f"found no problem (the mutation harmless to it): "
                f"{mine.get('found no problem', 0)}, raised (verify must not): "
                f"{raised}, undocumented error: {bad}"
            )
            continue
        by = {k[len("refused: ") :]: v for k, v in mine.items() if k.startswith("refused: ")}
        why = ", ".join(f"{c} {n}" for c, n in sorted(by.items(), key=lambda x: -x[1]))
        lines.append(
            f"{name}: refused with a documented error: {sum(by.values())}"
            + (f" ({why})" if why else "")
            + ", accepted (read without error: the "
            f"mutation left it readable): {mine.get('accepted', 0)}, undocumented error: "
            f"{bad}, crashed: {crashed}"
        )
    return lines


def run_fuzz(
    cases: int,
    seed: int = 0,
    memory_bytes: int = 1 << 30,
    workdir: str = "",
    timeout: float = 120.0,
    log: Callable[[str], None] = print,
    replay: Optional[int] = None,
) -> dict:
    """Run ``cases`` cases (seeds ``seed .. seed + cases - 1``, or the one ``replay``);
    returns a summary dict with the failures (seed, mutations, why)."""
    own = not workdir
    workdir = workdir or tempfile.mkdtemp(prefix="shardpoint-fuzz-")
    base = os.path.join(workdir, "base")
    if not os.path.isdir(base):
        write_base(base)
    worker = Worker(memory_bytes)
    worker.start()
    t0 = time.perf_counter()
    failures: list = []
    outcomes: dict = {}
    seeds = [replay] if replay is not None else range(seed, seed + cases)
    try:
        for n, s in enumerate(seeds):
            case = os.path.join(workdir, f"case_{s}")
            done = make_case(base, case, s)
            out = worker.read(case, timeout)
            why = judge(out)
            tally(out, outcomes)
            if why:
                failures.append({"seed": s, "mutations": done, "why": why})
                log(f"FAIL seed {s}: {done}: {why}")
            else:
                shutil.rmtree(case, ignore_errors=True)
            if (n + 1) % 500 == 0:
                log(f"{n + 1} cases, {len(failures)} failures, {time.perf_counter() - t0:.0f} s")
    finally:
        worker.stop()
        if own and not failures:
            shutil.rmtree(workdir, ignore_errors=True)
    return {
        "cases": len(seeds),
        "failures": failures,
        "seconds": time.perf_counter() - t0,
        "memory_bound": memory_bytes if hostile.supports_memory_cgroup() else None,
        "outcomes": dict(sorted(outcomes.items())),
        "workdir": workdir,
    }


def add_parser(sub: Any) -> None:
    from shardpoint_conformance.helptext import add_command

    f = add_command(
        sub,
        "fuzz",
        "structure-aware fuzzing of the readers (manifests, "
        "zarr.json, shard indexes, chunks) in a memory-bounded process",
        """
        shardpoint conformance fuzz --cases 200                 # the CI's short run
        shardpoint conformance fuzz --cases 10000 --seed 0 --memory 1GiB --dir fuzz-out
        shardpoint conformance fuzz --replay 4711 --dir fuzz-out  # one failing seed again""",
    )
    f.add_argument("--cases", type=int, default=1000)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--memory", default="1GiB", help="memory bound of the reader process")
    f.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    f.add_argument("--dir", default="", help="work directory (failing cases are kept)")
    f.add_argument("--replay", type=int, default=None, metavar="SEED")
    f.add_argument("--json", default=None, help="also write the summary as JSON here")


def main_args(a: argparse.Namespace) -> int:
    rep = run_fuzz(a.cases, a.seed, _parse_size(a.memory), a.dir, a.timeout, replay=a.replay)
    bound = (
        f"memory bound {rep['memory_bound'] >> 20} MiB (cgroup)"
        if rep["memory_bound"]
        else "no memory cgroup here: unbounded"
    )
    print(
        f"fuzz: {rep['cases']} mutated copies, each read by read_metadata, load and verify; "
        f"{len(rep['failures'])} failures (an undocumented error, a crash, a hang or over "
        f"the memory bound); {rep['seconds']:.0f} s, {bound}"
    )
    for line in describe(rep["outcomes"]):
        print(f"  {line}")
    if rep["failures"]:
        print(f"the failing cases are kept under {rep['workdir']} (--replay SEED runs one again)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=2, default=str)
    return 1 if rep["failures"] else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m shardpoint_conformance.fuzz")
    add_parser(p.add_subparsers(dest="cmd", required=False))
    argv = sys.argv[1:]
    sys.exit(main_args(p.parse_args(["fuzz"] + argv)))
