"""Agreement between the processes of a JAX job: gather to process 0 and broadcast back,
through the distributed runtime's key-value store (``jax.distributed.initialize``). Every
process calls save/load in the same order; each call gets a fresh key prefix. Waits are
bounded (``SHARDPOINT_JAX_TIMEOUT_S``, default 600 s): a dead process gives an error, not a
hang. With one process nothing is exchanged."""

from __future__ import annotations

import itertools
import os
from typing import Any

import jax

from shardpoint_jax.errors import SaveFailedError

_CALLS = itertools.count()


def _client():
    from jax._src import distributed  # the runtime client has no public accessor

    return distributed.global_state.client


class Comm:
    """One collective call's channel: ``gather`` to process 0, ``broadcast`` from it."""

    def __init__(self, what: str) -> None:
        self.rank = jax.process_index()
        self.world = jax.process_count()
        self.prefix = f"shardpoint_jax/{what}/{next(_CALLS)}"
        self.timeout_ms = int(float(os.environ.get("SHARDPOINT_JAX_TIMEOUT_S", "600")) * 1000)
        # JAX's runtime key-value client (untyped, private); used only where world > 1
        self.client: Any = _client() if self.world > 1 else None

    def _get(self, key: str) -> bytes:
        try:
            return self.client.blocking_key_value_get_bytes(key, self.timeout_ms)
        except Exception as e:  # noqa: BLE001 - a deadline or a lost coordinator
            raise SaveFailedError(
                f"process {self.rank}: no answer for {key!r} within "
                f"{self.timeout_ms / 1000:.0f}s ({type(e).__name__}: {e}); "
                "did every process call the same save/load?"
            ) from None

    def gather(self, step: str, data: bytes):
        """Every process sends ``data``; process 0 gets the list in process order."""
        if self.world == 1:
            return [data]
        self.client.key_value_set_bytes(f"{self.prefix}/{step}/{self.rank}", data)
        if self.rank != 0:
            return None
        return [self._get(f"{self.prefix}/{step}/{r}") for r in range(self.world)]

    def broadcast(self, step: str, data: bytes = b"") -> bytes:
        """Process 0's ``data`` on every process."""
        if self.world == 1:
            return data
        if self.rank == 0:
            self.client.key_value_set_bytes(f"{self.prefix}/{step}", data)
            return data
        return self._get(f"{self.prefix}/{step}")
