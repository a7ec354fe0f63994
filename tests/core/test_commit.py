"""Commit races between real processes: two saves to one new path."""

import os

import torch


class _MeetAtCommit:
    """The real backend; ``commit`` first waits until the other process is about to commit
    too, so both renames race for the same fresh path."""

    def __init__(self, barrier):
        from shardpoint_core.transactions.resolve import get_backend

        self.inner, self.barrier = get_backend(), barrier

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def commit(self, staging, path, *, overwrite):
        self.barrier.wait(timeout=60)
        return self.inner.commit(staging, path, overwrite=overwrite)


def _racer(i, path, barrier, q):
    import shardpoint as sp

    try:
        sp.save({"w": torch.full((64,), float(i)), "who": i}, path, backend=_MeetAtCommit(barrier))
        q.put((i, "saved"))
    except sp.CheckpointExistsError as e:
        q.put((i, f"exists: {e}"))
    except BaseException as e:  # noqa: BLE001
        q.put((i, f"{type(e).__name__}: {e}"))


def test_two_saves_racing_to_one_new_path_never_replace_each_other(tmp_path):
    """[SP-COMMIT-2]: exactly one wins, the other gets CheckpointExistsError and its staging
    directory is removed; what is at the path is the winner's checkpoint, bitwise."""
    import shardpoint as sp
    from shardpoint_testing.launch import process_context

    ctx = process_context()  # forked from the preloaded server: no fresh torch import
    barrier, q = ctx.Barrier(2), ctx.Queue()
    path = str(tmp_path / "ckpt")
    procs = [ctx.Process(target=_racer, args=(i, path, barrier, q)) for i in (1, 2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert sorted(v.split(":")[0] for v in got.values()) == ["exists", "saved"], got
    winner = next(i for i, v in got.items() if v == "saved")
    back = sp.load(path)
    assert back["who"] == winner and torch.equal(back["w"], torch.full((64,), float(winner)))
    assert os.listdir(tmp_path) == ["ckpt"]  # the loser's staging directory is gone
