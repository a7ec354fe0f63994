"""Which host a rank runs on, as the launchers tell it.

The load cost model prices reads per host (a host's ranks share its page cache and its link)
and the dedup exchange moves bytes between same-host ranks through shared memory, so every
rank names its host. Ranks of one host must give the same name, ranks of different hosts
different names; a wrong "same" is safe (mapping a peer's segment fails and the group
exchange takes over) but prices the load wrongly.
"""

from __future__ import annotations

import os
import socket
from typing import Mapping, Optional


def host_identity(
    explicit: Optional[str] = None, environ: Optional[Mapping[str, str]] = None
) -> str:
    """This rank's host name, from the first of: ``explicit`` (``LoadOptions.host_id``); SLURM's
    ``SLURMD_NODENAME`` (the node ``srun`` placed the task on); the machine's hostname,
    qualified by torchrun's node rank (``GROUP_RANK``) when torchrun ran more than one node
    (``GROUP_WORLD_SIZE`` > 1), since containers on different nodes may share a hostname.
    """
    if explicit:
        return explicit
    env = os.environ if environ is None else environ
    node = env.get("SLURMD_NODENAME")
    if node:
        return node
    name = socket.gethostname()
    if env.get("GROUP_RANK") is not None and int(env.get("GROUP_WORLD_SIZE", "1") or 1) > 1:
        return f"{name}#node{env['GROUP_RANK']}"
    return name
