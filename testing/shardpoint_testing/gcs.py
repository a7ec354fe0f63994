"""A local Google Cloud Storage emulator for tests: ``gcp-storage-emulator`` (pure Python, from
the package index) in a child process on ``127.0.0.1`` and a free port, in memory, with one
bucket. It dies with the process that started it, also when that one is SIGKILLed.

What it does not do, and the tests therefore cannot check here: it ignores every precondition
(``ifGenerationMatch``), so a conditional write always succeeds. :meth:`GcsServer.env` turns
the store's conditional writes off (``SHARDPOINT_GCS_CONDITIONAL_WRITES=0``): the store and the
commit then run in the mode the spec gives stores without conditional writes
([SP-COMMIT-12]), honestly, instead of trusting conditions the server drops.

:class:`PreconditionProxy` puts them back for tests of the conditional mode: a proxy on
loopback in front of the emulator that checks ``ifGenerationMatch`` of each upload against the
object's current generation and answers ``412`` as GCS does, holding one lock over the check
and the forwarded write (so conditional writes through it are atomic among themselves).

Example::

    with GcsServer() as gcs:
        os.environ.update(gcs.env())
        sp.save(state, gcs.url("run/step_1"))
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, Optional
from urllib.parse import parse_qs, quote, urlsplit

from shardpoint_testing.s3 import _child_env, free_port


class GcsServer:
    """The GCS emulator in a child process on loopback, with one bucket (``bucket``)."""

    def __init__(self, bucket: str = "shardpoint-test", *, start_timeout_s: float = 60.0) -> None:
        self.bucket = bucket
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._start_timeout_s = start_timeout_s
        self._proc: Optional[subprocess.Popen] = None

    def start(self) -> "GcsServer":
        """Start the emulator with the bucket and wait until it answers."""
        # it dies with this process, also when this one is SIGKILLed (as the S3 server)
        code = (
            "import sys; from shardpoint_testing.s3 import die_with_parent; "
            "die_with_parent(int(sys.argv[1])); "
            "from gcp_storage_emulator.__main__ import main; sys.exit(main(sys.argv[2:]))"
        )
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                code,
                str(os.getpid()),
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--in-memory",
                "--default-bucket",
                self.bucket,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=_child_env(),
        )
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the GCS emulator exited with {self._proc.returncode} on start")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"the GCS emulator did not listen on {self.endpoint} "
                        f"within {self._start_timeout_s} s"
                    ) from None
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
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "SHARDPOINT_GCS_CONDITIONAL_WRITES": "0"}

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


class PreconditionProxy:
    """A proxy on loopback in front of a :class:`GcsServer` that enforces the generation
    preconditions (``ifGenerationMatch``) of uploads, which the emulator ignores; every other
    request is forwarded unchanged. :attr:`refused` counts the 412 answers."""

    def __init__(self, upstream: GcsServer, rule: Optional[Callable] = None) -> None:
        self.upstream = upstream
        self.rule = rule  # as FaultProxy's: a negative answer loses the reply
        self.requests = self.injected = 0
        self.refused = 0
        self._lock = threading.Lock()
        self._count = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _handle(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                parts = urlsplit(self.path)
                want = parse_qs(parts.query).get("ifGenerationMatch")
                if self.command == "POST" and parts.path.startswith("/upload/") and want:
                    with proxy._lock:  # check and write as one step
                        have = proxy._generation(parts.path.split("/")[5], parts.query, body)
                        if have != want[0]:
                            proxy.refused += 1
                            return self._answer(
                                412,
                                json.dumps(
                                    {
                                        "error": {
                                            "code": 412,
                                            "message": "At least one of the pre-conditions "
                                            "you specified did not hold.",
                                            "errors": [{"reason": "conditionNotMet"}],
                                        }
                                    }
                                ).encode(),
                            )
                        return self._forward(body)
                self._forward(body)

            def _forward(self, body: Optional[bytes]) -> None:
                status, headers, data = proxy._request(
                    self.command, self.path, body, dict(self.headers.items())
                )
                fault = None
                if proxy.rule is not None:
                    with proxy._count:  # _lock may be held (a conditional upload)
                        proxy.requests += 1
                        number = proxy.requests
                    fault = proxy.rule(self.command, self.path, number)
                if fault is not None and fault < 0:  # applied, then the reply is lost
                    with proxy._count:
                        proxy.injected += 1
                    if fault == -1:  # a reset, as a dropped connection
                        self.close_connection = True
                        self.connection.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                        self.connection.close()
                        return
                    return self._answer(
                        -fault,
                        json.dumps({"error": {"code": -fault, "message": "injected"}}).encode(),
                    )
                self._answer(status, data, headers)

            def _answer(self, status: int, data: bytes, headers: Optional[list] = None) -> None:
                self.send_response(status)
                for k, v in headers or [("Content-Type", "application/json")]:
                    if k.lower() not in (
                        "connection",
                        "transfer-encoding",
                        "content-length",
                        "keep-alive",
                        "server",
                        "date",
                    ):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _request(self, method: str, path: str, body: Optional[bytes], headers: dict) -> tuple:
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream.port, timeout=60)
        try:
            headers = {
                k: v
                for k, v in headers.items()
                if k.lower() not in ("connection", "keep-alive", "host")
            }
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.getheaders(), resp.read()
        finally:
            conn.close()

    def _generation(self, bucket: str, query: str, body: Optional[bytes]) -> str:
        """The current generation of the object an upload names ('0' where there is none):
        its name is in the query (media, resumable) or in the JSON part of a multipart body."""
        names = parse_qs(query).get("name")
        name: Optional[str] = names[0] if names else None
        if name is None and body:
            start = body.find(b"{")
            meta, _ = json.JSONDecoder().raw_decode(body[start:].decode("utf-8", "replace"))
            name = meta["name"]
        if name is None:  # an upload naming no object: nothing there to be newer than
            return "0"
        status, _, data = self._request(
            "GET", f"/storage/v1/b/{bucket}/o/{quote(name, safe='')}", None, {}
        )
        return str(json.loads(data)["generation"]) if status == 200 else "0"

    def env(self) -> Dict[str, str]:
        """The environment pointing gs:// stores at the proxy, conditional writes on."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "SHARDPOINT_GCS_CONDITIONAL_WRITES": "1"}

    def __enter__(self) -> "PreconditionProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
