"""The side channel of the memory tier: a small request/response protocol over TCP by which a
host's :class:`~shardpoint_core.stores.shm.ShmStore` puts replicas into, and reads objects
from, the shared memory of other hosts.

Every rank of a job that uses the memory tier runs one :class:`PeerServer` (a thread of the
training process, serving its host's shared memory); a store talks to other hosts through
:class:`PeerClient`. The channel carries store operations only (put, get, head, list, delete),
never tensors or plans, and is private to one job: every request carries the job's token
(chosen by rank 0 and shared over the process group), and a request with another token is
refused. It is not a checkpoint format: nothing outside this module reads its frames.

A frame is a 4-byte little-endian length, a msgpack map (the header), then ``header["n"]``
bytes of payload. Requests name an ``op``; a response's ``status`` is one of ``ok``,
``missing`` (no such object on that host), ``damaged`` (the host's copy fails its crc32c),
``exists`` (a conditional put lost), ``budget`` (the host's memory budget would be exceeded)
or ``error``. Each payload travels with its crc32c, checked by the receiver.

Example::

    server = PeerServer(handler, token="t0k3n")      # handler: the host's store
    client = PeerClient(server.address, token="t0k3n")
    client.request({"op": "head", "key": "step_5/manifest.msgpack"})
"""
from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import msgpack

from shardpoint_core.format.errors import StoreUnavailableError
from shardpoint_core.stores.base import Buffer

log = logging.getLogger("shardpoint")
_LEN = struct.Struct("<I")
_MAX_HEADER = 64 << 20
Header = Dict[str, Any]
# A store's side of the channel: (request header, payload) -> (response header, payload
# buffers). Raising answers ``error`` with the exception's text.
Handler = Callable[[Header, bytearray], Tuple[Header, Sequence[Buffer]]]


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionResetError("peer closed the connection mid-frame")
        got += r
    return buf


def send_frame(sock: socket.socket, header: Header, bufs: Sequence[Buffer] = ()) -> None:
    """One frame: ``header`` (with ``n``, the payload's length, filled in) and ``bufs``."""
    views = [memoryview(b).cast("B") for b in bufs]
    header = dict(header, n=sum(v.nbytes for v in views))
    h = msgpack.packb(header, use_bin_type=True)
    sock.sendall(_LEN.pack(len(h)) + h)
    for v in views:
        if v.nbytes:
            sock.sendall(v)


def recv_frame(sock: socket.socket) -> Tuple[Header, bytearray]:
    """(header, payload) of the next frame; ``ConnectionError`` where the peer hung up."""
    (hn,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if hn > _MAX_HEADER:
        raise ConnectionError(f"peer frame header of {hn} bytes: not a shardpoint peer")
    header = msgpack.unpackb(bytes(_recv_exact(sock, hn)), raw=False)
    if not isinstance(header, dict):
        raise ConnectionError("peer frame header is not a map: not a shardpoint peer")
    n = int(header.get("n", 0))
    return header, _recv_exact(sock, n) if n else bytearray()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    handler: Handler
    token: str


class _Conn(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: _Server = self.server  # type: ignore[assignment]
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            try:
                header, payload = recv_frame(sock)
            except (ConnectionError, OSError, ValueError, msgpack.ExtraData):
                return
            if header.get("token") != server.token:
                send_frame(sock, {"status": "error", "msg": "wrong job token"})
                return
            try:
                resp, bufs = server.handler(header, payload)
            except Exception as e:  # noqa: BLE001 - answered to the caller, who raises
                resp, bufs = {"status": "error", "msg": f"{type(e).__name__}: {e}"}, ()
            try:
                send_frame(sock, resp, bufs)
            except OSError:
                return


class PeerServer:
    """Serves ``handler`` on a TCP port (all interfaces; ``port`` 0 picks a free one) from
    daemon threads, until :meth:`close`. ``address``: what other hosts connect to
    (``advertise`` host, the bound port)."""

    def __init__(self, handler: Handler, token: str, *, bind: str = "0.0.0.0",
                 port: int = 0, advertise: str = "127.0.0.1") -> None:
        self._srv = _Server((bind, port), _Conn)
        self._srv.handler, self._srv.token = handler, token
        self.address = f"{advertise}:{self._srv.server_address[1]}"
        self._thread = threading.Thread(target=self._srv.serve_forever, name="sp-shm-peer",
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and answering (connections being served end at their next frame)."""
        self._srv.shutdown()
        self._srv.server_close()


class PeerClient:
    """Requests to one peer server at ``address`` (``host:port``), over a small pool of kept
    connections (thread-safe). A peer that refuses, hangs up or times out (``timeout_s`` per
    frame) raises :class:`StoreUnavailableError` naming it; the connection is dropped."""

    def __init__(self, address: str, token: str, *, timeout_s: float = 60.0,
                 connect_timeout_s: float = 5.0) -> None:
        self.address, self._token = address, token
        host, _, port = address.rpartition(":")
        self._where = (host, int(port))
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._idle: List[socket.socket] = []
        self._lock = threading.Lock()

    def _connect(self) -> socket.socket:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        s = socket.create_connection(self._where, timeout=self.connect_timeout_s)
        s.settimeout(self.timeout_s)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def request(self, header: Header, bufs: Sequence[Buffer] = ()) -> Tuple[Header, bytearray]:
        """Send one request, return (response header, payload)."""
        try:
            s = self._connect()
        except OSError as e:
            raise StoreUnavailableError(f"memory-tier peer {self.address} refuses "
                                        f"{header.get('op')} ({e}): its host is down or its "
                                        "job is gone") from e
        try:
            send_frame(s, dict(header, token=self._token), bufs)
            resp, payload = recv_frame(s)
        except (OSError, ValueError, msgpack.ExtraData) as e:
            s.close()
            raise StoreUnavailableError(f"memory-tier peer {self.address} failed during "
                                        f"{header.get('op')} {header.get('key', '')!r} ({e}): "
                                        "its host is down or unreachable") from e
        with self._lock:
            self._idle.append(s)
        return resp, payload

    def close(self) -> None:
        """Close the kept connections."""
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()


def advertised_host() -> str:
    """An address other hosts can reach this one at: the host name's address where it
    resolves, else the loopback (one-host jobs, tests)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def request_or_none(client: PeerClient, header: Header,
                    bufs: Sequence[Buffer] = ()) -> Optional[Tuple[Header, bytearray]]:
    """:meth:`PeerClient.request`, or None where the peer is unreachable (logged): reads and
    deletes go on with the hosts that answer."""
    try:
        return client.request(header, bufs)
    except StoreUnavailableError as e:
        log.warning("%s", e)
        return None
