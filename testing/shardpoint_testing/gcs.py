"""A local Google Cloud Storage emulator for tests: ``gcp-storage-emulator`` (pure Python, from
the package index) in a child process on ``127.0.0.1`` and a free port, in memory, with one
bucket.

What it does not do, and the tests therefore cannot check here: it ignores every precondition
(``ifGenerationMatch``), so a conditional write always succeeds. :meth:`GcsServer.env` turns
the store's conditional writes off (``SHARDPOINT_GCS_CONDITIONAL_WRITES=0``): the store and the
commit then run in the mode the spec gives stores without conditional writes
([SP-COMMIT-12]), honestly, instead of trusting conditions the server drops.

Example::

    with GcsServer() as gcs:
        os.environ.update(gcs.env())
        sp.save(state, gcs.url("run/step_1"))
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from typing import Dict, Optional

from shardpoint_testing.s3 import free_port


class GcsServer:
    """The GCS emulator in a child process on loopback, with one bucket (``bucket``)."""

    def __init__(self, bucket: str = "shardpoint-test", *,
                 start_timeout_s: float = 60.0) -> None:
        self.bucket = bucket
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._start_timeout_s = start_timeout_s
        self._proc: Optional[subprocess.Popen] = None

    def start(self) -> "GcsServer":
        """Start the emulator with the bucket and wait until it answers."""
        code = ("import sys; from gcp_storage_emulator.__main__ import main; "
                "sys.exit(main(sys.argv[1:]))")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code, "start", "--host", "127.0.0.1", "--port",
             str(self.port), "--in-memory", "--default-bucket", self.bucket],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the GCS emulator exited with {self._proc.returncode} "
                                   "on start")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the GCS emulator did not listen on {self.endpoint} "
                                       f"within {self._start_timeout_s} s")
                time.sleep(0.05)
        return self

    def fresh_prefix(self, name: str = "t") -> str:
        """A prefix no other test uses: tests share one emulator and one bucket."""
        return f"{name}-{uuid.uuid4().hex[:12]}"

    def url(self, key: str = "") -> str:
        """``gs://<bucket>/<key>``."""
        return f"gs://{self.bucket}/{key}".rstrip("/")

    def env(self) -> Dict[str, str]:
        """The environment that points the store (and child processes) at the emulator."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint,
                "SHARDPOINT_GCS_CONDITIONAL_WRITES": "0"}

    def stop(self) -> None:
        """Stop the emulator (its objects are gone with it)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        self._proc = None

    def __enter__(self) -> "GcsServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
