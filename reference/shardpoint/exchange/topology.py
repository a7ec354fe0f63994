"""Which host a rank runs on, as the launchers tell it.

The load cost model prices reads per host (a host's ranks share its page cache and its link)
and the dedup exchange moves bytes between same-host ranks through shared memory, so every
rank names its host. Ranks of one host must give the same name, ranks of different hosts
different names; a wrong "same" is safe (mapping a peer's segment fails and the group
exchange takes over) but prices the load wrongly.
"""

from __future__ import annotations

# the core's (the memory tier's side channel names hosts too, for both front ends)
from shardpoint_core.stores.peers import host_identity

__all__ = ["host_identity"]
