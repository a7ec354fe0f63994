"""Everything that renames or deletes checkpoint paths goes through the committer.

Walks the AST of every module of core/, reference/, conformance/ and testing/ and fails on a
call to ``os.rename``, ``os.replace``, ``shutil.rmtree``, ``os.unlink``, ``os.remove``,
``os.rmdir``, ``renameat2`` or a path object's ``unlink``/``rmdir``/``rename`` outside ``core/shardpoint_core/commit/``, except the short
allowlist below, each entry a caller's own scratch file with the reason. A new such call
fails the test (shown on a temporary copy of the tree).
"""

from __future__ import annotations

import ast
import functools
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["core", "reference", "testing", "conformance"]
COMMITTER = Path("core/shardpoint_core/commit")
FORBIDDEN = {
    ("os", "rename"),
    ("os", "replace"),
    ("os", "unlink"),
    ("os", "remove"),
    ("os", "rmdir"),
    ("shutil", "rmtree"),
    ("os", "renames"),
    ("os", "removedirs"),
}

PATH_METHODS = {"unlink", "rmdir", "rename", "rmtree"}  # str.replace is too common to flag

# (file, function called): why it is not a checkpoint path.
ALLOWED = {
    (
        "core/shardpoint_core/stores/shm_host.py",
        "os.unlink",
    ): "the shared-memory store's primitives (as FileStore's): delete, which the committers "
    "call on checkpoint keys, and put's own temporary files and those of dead writers",
    (
        "core/shardpoint_core/stores/shm_host.py",
        "os.rename",
    ): "the shared-memory store's put: its own temporary object and sidecar renamed onto the "
    "key (an atomic whole-object write, as a PUT is)",
    (
        "core/shardpoint_core/stores/shm_host.py",
        "os.rmdir",
    ): "the shared-memory store's delete pruning the directories its own delete emptied",
    (
        "core/shardpoint_core/stores/durable.py",
        "renameat2",
    ): "the syscall wrapper itself (exchange_dirs, RENAME_NOREPLACE): the POSIX committer is "
    "its only caller on checkpoint paths (the syscalls live in the stores rung)",
    (
        "core/shardpoint_core/stores/files.py",
        "os.unlink",
    ): "FileStore.delete, the byte store's primitive: the committers call it (object-store "
    "protocol), never anything else on a checkpoint path",
    (
        "core/shardpoint_core/stores/files.py",
        "os.rmdir",
    ): "FileStore.delete pruning the directories its own delete emptied",
    (
        "core/shardpoint_core/stores/tensorstore.py",
        "os.rmdir",
    ): "TensorStoreStore.delete (file driver) pruning the directories its own delete "
    "emptied, as FileStore does",
    (
        "reference/shardpoint/exchange/host.py",
        "os.unlink",
    ): "the host exchange's own shared-memory segment file, never a checkpoint",
    (
        "reference/shardpoint/exchange/host.py",
        ".unlink",
    ): "the same segment file, through the segment's own unlink()",
    (
        "reference/shardpoint/tools/demo.py",
        "shutil.rmtree",
    ): "the demo's own temporary directory (made by tempfile.mkdtemp)",
    (
        "conformance/shardpoint_conformance/faults.py",
        "shutil.rmtree",
    ): "the fault cases' own scratch roots under the suite's temporary directory",
    (
        "conformance/shardpoint_conformance/faults.py",
        "os.remove",
    ): "damages a scratch checkpoint the case itself wrote, on purpose (a missing chunk)",
    (
        "conformance/shardpoint_conformance/harness.py",
        "shutil.rmtree",
    ): "the harness's own per-case scratch directories, and its own temporary root "
    "(mkdtemp) once empty",
    (
        "conformance/shardpoint_conformance/runner.py",
        "shutil.rmtree",
    ): "the runner's own per-case scratch directories, and the run's own temporary root "
    "(mkdtemp) once empty",
    (
        "conformance/shardpoint_conformance/vectors.py",
        "shutil.rmtree",
    ): "a temporary copy of a test vector, made by the suite",
    (
        "conformance/shardpoint_conformance/broken_adapter.py",
        "os.remove",
    ): "the deliberately broken adapter damages its own output (it must fail the suite)",
    (
        "conformance/shardpoint_conformance/vector_damage.py",
        "os.remove",
    ): "damages a temporary copy of a vector on purpose (the invalid case it builds)",
    (
        "conformance/shardpoint_conformance/fuzz.py",
        "shutil.rmtree",
    ): "the fuzzer's own mutated copies and its own work directory (mkdtemp)",
    (
        "conformance/shardpoint_conformance/fuzz.py",
        "os.rmdir",
    ): "the memory cgroup the fuzzer itself created for its reader process",
    (
        "conformance/shardpoint_conformance/hostile.py",
        "os.rmdir",
    ): "the memory cgroup it created for one bounded read",
    (
        "testing/shardpoint_testing/launch.py",
        "shutil.rmtree",
    ): "the file-rendezvous directory run_world itself made (mkdtemp) for one world",
    (
        "testing/shardpoint_testing/cluster.py",
        "shutil.rmtree",
    ): "the shared and host-memory directories the test cluster itself made (mkdtemp), at "
    "teardown, and a lost host's memory below the latter (lose_host)",
    (
        "conformance/shardpoint_conformance/vector_damage_12.py",
        "shutil.rmtree",
    ): "empties a temporary copy of a vector it builds an invalid case from",
    (
        "conformance/shardpoint_conformance/vector_damage_12.py",
        "os.remove",
    ): "the same temporary copy's files",
    (
        "conformance/shardpoint_conformance/vector_damage_13.py",
        "shutil.rmtree",
    ): "replaces a chunk directory of a temporary copy of a vector by a file (1.3 case)",
    (
        "conformance/shardpoint_conformance/vector_damage_14.py",
        "os.remove",
    ): "damages a temporary copy of a vector on purpose (a missing or symlinked data "
    "object, the 1.4 cases)",
    (
        "conformance/shardpoint_conformance/vector_damage_13.py",
        "os.remove",
    ): "replaces a chunk file of a temporary copy of a vector by a directory (1.3 case)",
    (
        "conformance/shardpoint_conformance/vector_damage_14.py",
        "shutil.rmtree",
    ): "deletes the base/ of a temporary copy of the incremental vector (the missing-base "
    "case, [SP-PACK-9])",
}


@functools.lru_cache(maxsize=None)
def calls_outside_committer(root: Path) -> list:
    """``(file, 'mod.func', line)`` for each forbidden call under ``root``'s sources."""
    found = []
    for d in SOURCES:
        for f in sorted((root / d).rglob("*.py")):
            rel = f.relative_to(root)
            if COMMITTER in rel.parents:
                continue
            tree = ast.parse(f.read_text(), str(rel))
            aliases = {}  # a name bound by 'from os import rename' -> 'os.rename'
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module in ("os", "shutil"):
                    for a in node.names:
                        if (node.module, a.name) in FORBIDDEN:
                            aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                fn, name = node.func, None
                if (
                    isinstance(fn, ast.Attribute)
                    and isinstance(fn.value, ast.Name)
                    and (fn.value.id, fn.attr) in FORBIDDEN
                ):
                    name = f"{fn.value.id}.{fn.attr}"
                elif isinstance(fn, ast.Name) and fn.id in aliases:
                    name = aliases[fn.id]
                elif (isinstance(fn, ast.Name) and fn.id == "renameat2") or (
                    isinstance(fn, ast.Attribute) and fn.attr == "renameat2"
                ):
                    name = "renameat2"
                elif isinstance(fn, ast.Attribute) and fn.attr in PATH_METHODS:
                    name = f".{fn.attr}"  # pathlib.Path.unlink() and the like
                if name:
                    found.append((str(rel), name, node.lineno))
    return found


def violations(root: Path) -> list:
    return [c for c in calls_outside_committer(root) if (c[0], c[1]) not in ALLOWED]


def test_only_the_committer_renames_or_deletes_checkpoint_paths():
    assert violations(ROOT) == []


def test_every_allowlist_entry_is_still_needed():
    used = {(f, n) for f, n, _ in calls_outside_committer(ROOT)}
    assert set(ALLOWED) <= used, set(ALLOWED) - used


def test_a_new_call_is_caught(tmp_path):
    for d in SOURCES:
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "reference" / "shardpoint" / "api" / "sneaky.py").write_text(
        "import shutil\nfrom os import rename as mv\n\n"
        "def prune(p):\n    shutil.rmtree(p)\n    mv(p, p + '.x')\n    p.unlink()\n"
    )
    got = violations(tmp_path)
    assert ("reference/shardpoint/api/sneaky.py", "shutil.rmtree", 5) in got
    assert ("reference/shardpoint/api/sneaky.py", "os.rename", 6) in got
    assert ("reference/shardpoint/api/sneaky.py", ".unlink", 7) in got
