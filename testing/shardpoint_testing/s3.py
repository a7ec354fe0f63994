"""A real S3-compatible server on loopback for tests, benchmarks and the cluster helper.

:class:`S3Server` starts moto's standalone server (``python -m moto.server``, from the
``moto[server]`` package) as a child process on ``127.0.0.1`` and a free port, creates a
bucket, and stops the process on :meth:`S3Server.stop`; given a host and a launcher it runs
elsewhere instead (the test cluster's storage host: ``Cluster.s3_server()``). The server
dies with the process that started it, also when that one is SIGKILLed (a watchdog on its
parent), so a killed test run leaves no server holding its port. Its :meth:`env` is the standard AWS
environment (``AWS_ENDPOINT_URL``, keys, region) that the S3 store reads, so a child process
(a gloo rank, the CLI) finds the server the same way a job finds real S3.

:class:`FaultProxy` sits between a client and the server (also on loopback) and answers
chosen requests itself with ``503 SlowDown`` or ``500 InternalError``, or drops the
connection, so tests see the throttling and server errors a real object store gives.

:class:`Requests` logs every request a store's client sends and groups them by round trip,
for tests pinning what a save or a load sends (torch and JAX front ends alike).

Example::

    with S3Server() as s3:
        os.environ.update(s3.env())
        sp.save(state, s3.url("run/step_1"))
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, Optional, Sequence
from urllib.parse import unquote, urlsplit

# How to start the server somewhere else: (argv, **Popen keyword arguments) -> the process
Launcher = Callable[..., subprocess.Popen]

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"


def _child_env(**extra: str) -> dict:
    """This environment for a server process, with this package importable there
    (``python -m shardpoint_testing.s3``) however this process found it."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=here + (os.pathsep + path if path else ""), **extra)


def _child_argv(*argv: str) -> list:
    """``python -m shardpoint_testing.s3 --parent <this pid> ...``: the child watches us."""
    return [sys.executable, "-m", "shardpoint_testing.s3", "--parent", str(os.getpid()), *argv]


def die_with_parent(parent: int, poll_s: float = 0.2) -> None:
    """End this process as soon as ``parent`` is no longer its parent (it died, even by
    SIGKILL, and this one was re-parented). A watchdog thread, not ``PR_SET_PDEATHSIG``: that
    signal follows the parent *thread* that started the child, which may end long before
    the process does."""
    if os.getppid() != parent:  # died before we got here
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="die-with-parent").start()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto's S3 server in a child process on loopback, with one bucket (``bucket``)."""

    def __init__(
        self,
        bucket: str = "shardpoint-test",
        *,
        auth: bool = False,
        start_timeout_s: float = 60.0,
        host: str = "127.0.0.1",
        port: Optional[int] = None,
        launch: Optional[Launcher] = None,
    ) -> None:
        """``host``/``port``: where it listens (default: loopback, a free port). ``launch``:
        how to start it elsewhere, ``launch(argv, **popen_kwargs) -> Popen`` (the test
        cluster's :meth:`~shardpoint_testing.cluster.Cluster.popen_storage` starts it on the
        storage host, in a network namespace this process cannot reach): the server then
        creates its bucket itself and says when it is ready, and :meth:`client` and
        :meth:`make_bucket` work only from where ``host`` is reachable."""
        if launch is not None and auth:
            raise ValueError("auth=True needs the server on loopback (IAM is set up from here)")
        self.bucket = bucket
        self.auth = auth
        self._keys = (ACCESS_KEY, SECRET_KEY)
        self.host = host
        self.port = port or (free_port() if launch is None else 9000)
        self.endpoint = f"http://{host}:{self.port}"
        self._start_timeout_s = start_timeout_s
        self._launch = launch
        self._proc: Optional[subprocess.Popen] = None

    def _start_launched(self, env: dict) -> None:
        """Start ``python -m shardpoint_testing.s3 HOST PORT BUCKET`` through the launcher
        and wait for its ``ready`` line."""
        launch = self._launch
        assert launch is not None, "called where a launcher was given"
        self._proc = proc = launch(
            _child_argv("serve", self.host, str(self.port), self.bucket),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        out = proc.stdout
        assert out is not None, "the launcher was asked for a pipe"
        ready = threading.Event()

        def watch() -> None:
            for line in out:
                if line.strip() == b"ready":
                    ready.set()
                    return

        threading.Thread(target=watch, daemon=True).start()
        deadline = time.monotonic() + self._start_timeout_s
        while not ready.wait(0.05):
            if proc.poll() is not None or time.monotonic() > deadline:
                code = proc.poll()
                self.stop()
                raise RuntimeError(
                    f"the S3 server for {self.endpoint} "
                    + (
                        f"exited with {code} on start"
                        if code is not None
                        else f"was not ready within {self._start_timeout_s} s"
                    )
                )

    def start(self) -> "S3Server":
        """Start the server, wait until it answers, create the bucket."""
        env = _child_env(MOTO_ALLOW_NONEXISTENT_REGION="true")
        if self._launch is not None:
            self._start_launched(env)
            return self
        if self.auth:  # moto checks signatures and IAM after the first 3 requests
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
        self._proc = subprocess.Popen(
            _child_argv("moto", "-H", self.host, "-p", str(self.port)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self._proc.returncode} on start")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"moto server did not listen on {self.endpoint} within "
                        f"{self._start_timeout_s} s"
                    ) from None
                time.sleep(0.05)
        if self.auth:
            iam = self._boto("iam")
            iam.create_user(UserName="shardpoint")
            iam.put_user_policy(
                UserName="shardpoint",
                PolicyName="all",
                PolicyDocument=(
                    '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", '
                    '"Action": "*", "Resource": "*"}]}'
                ),
            )
            k = iam.create_access_key(UserName="shardpoint")["AccessKey"]
            self._keys = (k["AccessKeyId"], k["SecretAccessKey"])
        self.make_bucket(self.bucket)
        return self

    def credentials(self) -> Dict[str, str]:
        """Keys the server accepts, as :class:`~shardpoint_core.stores.s3.S3Options` fields."""
        return {
            "access_key_id": self._keys[0],
            "secret_access_key": self._keys[1],
            "region": REGION,
        }

    def _boto(self, service: str):
        import boto3
        from botocore.config import Config

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            aws_access_key_id=self._keys[0],
            aws_secret_access_key=self._keys[1],
            region_name=REGION,
            config=Config(retries={"max_attempts": 2}),
        )

    def client(self):
        """A boto3 S3 client for this server (for test set-up and inspection)."""
        return self._boto("s3")

    def make_bucket(self, name: str) -> None:
        """Create bucket ``name`` (tests that need a bucket of their own)."""
        self.client().create_bucket(Bucket=name)

    def objects(self, prefix: str = "", timeout: float = 60.0) -> Dict[str, int]:
        """What the server holds under ``prefix`` in the bucket, key -> size, listed with
        boto3 (not through shardpoint's stores); a launched server is listed from where it
        runs (the storage host), through the launcher."""
        if self._launch is None:
            return _list(self.client(), self.bucket, prefix)
        p = self._launch(
            _child_argv("list", self.endpoint, self.bucket, prefix),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_child_env(),
        )
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise RuntimeError(f"listing {self.url(prefix)} took over {timeout} s") from None
        if p.returncode != 0:
            raise RuntimeError(f"listing {self.url(prefix)} failed: {err.decode()[-2000:]}")
        return json.loads(out)

    def fresh_prefix(self, name: str = "t") -> str:
        """A prefix no other test uses: tests share one server and one bucket."""
        return f"{name}-{uuid.uuid4().hex[:12]}"

    def url(self, key: str = "") -> str:
        """``s3://<bucket>/<key>``."""
        return f"s3://{self.bucket}/{key}".rstrip("/")

    def env(self, endpoint: Optional[str] = None) -> Dict[str, str]:
        """The standard AWS environment that points clients at this server."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ACCESS_KEY_ID": self._keys[0],
            "AWS_SECRET_ACCESS_KEY": self._keys[1],
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
        }

    def stop(self) -> None:
        """Stop the server process (its objects are gone with it)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        if self._proc is not None and self._proc.stdout is not None:
            self._proc.stdout.close()
        self._proc = None

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# A fault rule sees (method, path, request number) and returns None (forward the request),
# or an HTTP status to answer with (503: SlowDown, 500: InternalError), or 0 to drop the
# connection without an answer. A negative value is a lost reply: the request is forwarded
# and applied by the server, then the client gets -value as status instead of the server's
# answer (LOST_REPLY, -1: the connection drops; -500: InternalError).
FaultRule = Callable[[str, str, int], Optional[int]]
LOST_REPLY = -1

_FAULT_BODY = {
    503: b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>",
    500: b"<Error><Code>InternalError</Code><Message>We encountered an internal error."
    b"</Message></Error>",
}


class FaultProxy:
    """An HTTP proxy on loopback in front of an :class:`S3Server` that injects faults.

    ``rule`` decides per request; :attr:`injected` counts the faults answered. Every other
    request is forwarded unchanged (method, path, headers, body) and its answer relayed.
    """

    def __init__(self, upstream: S3Server, rule: FaultRule) -> None:
        self.upstream = upstream
        self.rule = rule
        self.injected = 0
        self.requests = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _handle(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                with proxy._lock:
                    proxy.requests += 1
                    number = proxy.requests
                fault = proxy.rule(self.command, self.path, number)
                if fault is not None and fault < 0:  # applied, then the reply is lost
                    conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream.port, timeout=60)
                    conn.request(
                        self.command,
                        self.path,
                        body=body,
                        headers={
                            k: v
                            for k, v in self.headers.items()
                            if k.lower() not in ("connection", "keep-alive")
                        },
                    )
                    conn.getresponse().read()
                    conn.close()
                    fault = 0 if fault == LOST_REPLY else -fault
                if fault is not None:
                    with proxy._lock:
                        proxy.injected += 1
                    if fault == 0:
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    payload = _FAULT_BODY.get(fault, b"<Error><Code>Fault</Code></Error>")
                    self.send_response(fault)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream.port, timeout=60)
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("connection", "keep-alive")
                }
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in (
                        "connection",
                        "transfer-encoding",
                        "content-length",
                        "keep-alive",
                        "server",
                        "date",
                    ):
                        self.send_header(k, v)
                # a HEAD's answer has no body but the object's length, relayed as it is
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def env(self) -> Dict[str, str]:
        """The AWS environment pointing clients at the proxy instead of the server."""
        return self.upstream.env(self.endpoint)

    def __enter__(self) -> "FaultProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve(host: str, port: int, bucket: str) -> None:
    """Run moto's S3 server in this process on ``host:port``, create ``bucket``, print
    ``ready`` and serve until terminated (what a launched :class:`S3Server` runs)."""
    import signal

    import boto3
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("MOTO_ALLOW_NONEXISTENT_REGION", "true")
    server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
    server.start()
    boto3.client(
        "s3",
        endpoint_url=f"http://{host}:{port}",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name=REGION,
    ).create_bucket(Bucket=bucket)
    print("ready", flush=True)

    def stop(*_: Any) -> None:
        server.stop()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    threading.Event().wait()


def _list(client, bucket: str, prefix: str) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out.update((o["Key"], o["Size"]) for o in page.get("Contents", []))
    return out


def _main(argv: Sequence[str]) -> None:
    """``[--parent PID] serve HOST PORT BUCKET`` (a launched server), ``[--parent PID] moto
    ARGS...`` (moto's own server, for the loopback one), ``list ENDPOINT BUCKET PREFIX``
    (print what the bucket holds as JSON)."""
    argv = list(argv)
    if argv[:1] == ["--parent"]:
        die_with_parent(int(argv[1]))
        argv = argv[2:]
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        host, port, bucket = rest
        serve(host, int(port), bucket)
    elif cmd == "moto":
        from moto.server import main as moto_main

        moto_main(rest)
    elif cmd == "list":
        import boto3

        endpoint, bucket, prefix = rest
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )
        print(json.dumps(_list(client, bucket, prefix)))
    else:
        raise SystemExit(f"shardpoint_testing.s3: unknown command {cmd!r}")


if __name__ == "__main__":
    _main(sys.argv[1:])


class Requests:
    """Every request a backend's S3 client sends: [operation, key below ``prefix`` (save
    prefixes as ``save-*``), Range, start, end]. ``latency`` seconds are added before each
    is sent, as a distant server's round trip would, so that requests sent together overlap
    and a request sent after another's answer starts after it ended: :meth:`waves` groups
    them by how many round trips deep they are. Use it as a context manager (the store's
    client is shared by the process: leaving takes the hooks off it). ``be``: anything whose
    ``locate(url)`` gives ``(store, key)`` (a ``ZarrBackend``)."""

    def __init__(self, be: Any, url: str, latency: float = 0.0) -> None:
        store, self.prefix = be.locate(url)
        self.latency = latency
        self.seen: list = []
        self._lock = threading.Lock()
        self._mine = threading.local()
        self.events = store.client.meta.events
        self.events.register("before-send.s3.*", self._send, unique_id="sp-test-requests")
        self.events.register("after-call.s3.*", self._done, unique_id="sp-test-answers")

    def __enter__(self) -> "Requests":
        return self

    def __exit__(self, *exc) -> None:
        self.events.unregister("before-send.s3.*", unique_id="sp-test-requests")
        self.events.unregister("after-call.s3.*", unique_id="sp-test-answers")

    def _send(self, request, event_name, **kw):
        path = unquote(urlsplit(request.url).path)
        key = path.split(f"/{self.prefix}/", 1)[-1] if f"/{self.prefix}/" in path else ""
        if key.startswith("save-"):
            key = "save-*/" + key.split("/", 1)[1]
        rng = request.headers.get("Range")
        rng = rng.decode() if isinstance(rng, bytes) else rng
        rec = [event_name.rsplit(".", 1)[-1], key, rng, time.perf_counter(), None]
        self._mine.rec = rec
        with self._lock:
            self.seen.append(rec)
        time.sleep(self.latency)

    def _done(self, **kw):
        self._mine.rec[4] = time.perf_counter()

    def take(self) -> list:
        with self._lock:
            out, self.seen = self.seen, []
        return out

    @staticmethod
    def waves(recs: list) -> list:
        """The requests by round trip: a request is one deeper than the deepest request that
        had ended when it started. Each wave is a Counter of (operation, key)."""
        recs = sorted(recs, key=lambda r: r[3])
        depth: list = []
        for i, r in enumerate(recs):
            depth.append(1 + max((depth[j] for j in range(i) if recs[j][4] <= r[3]), default=0))
        out: list[Counter] = [Counter() for _ in range(max(depth, default=0))]
        for r, d in zip(recs, depth):
            out[d - 1][(r[0], r[1])] += 1
        return out
