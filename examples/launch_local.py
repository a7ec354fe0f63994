"""Run an example's ``main()`` on N local gloo ranks when it was not started by torchrun.

``torchrun --nproc-per-node N example.py`` is the real way; ``python example.py`` forks N
ranks from this process instead (fast: torch is imported once) and fails if any rank fails.
"""

import multiprocessing as mp
import os
import socket
import sys


def _rank(main, rank, world, port):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    main()


def run_local(main, world: int) -> None:
    """``main()`` on every rank: under torchrun directly, else on ``world`` forked ranks."""
    if "RANK" in os.environ:
        main()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(main, r, world, port)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        if p.is_alive():
            p.kill()
    bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        sys.exit(f"ranks {bad} failed")
