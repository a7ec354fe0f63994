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
import os
import socket
import socketserver
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import crc32c
import msgpack

from shardpoint_core.format.errors import StoreUnavailableError
from shardpoint_core.stores.base import Buffer

log = logging.getLogger("shardpoint")
_LEN = struct.Struct("<I")
_MAX_HEADER = 64 << 20
_PIECE = 4 << 20  # a streamed payload goes through a buffer of this size
Header = Dict[str, Any]


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


class Payload:
    """The payload of a received frame, still in the socket: read it whole
    (:meth:`read_all`) or stream it into a file (:meth:`copy_to`, no buffer of its size);
    what is left unread is drained before the connection serves the next frame."""

    def __init__(self, sock: socket.socket, n: int) -> None:
        self.sock, self.n, self.left = sock, n, n

    def read_all(self) -> bytearray:
        """The whole payload."""
        buf = _recv_exact(self.sock, self.left)
        self.left = 0
        return buf

    def copy_to(self, fd: int) -> int:
        """Write the payload at the start of ``fd``; returns its crc32c."""
        buf = bytearray(min(self.left, _PIECE))
        view, crc, pos = memoryview(buf), 0, 0
        while self.left:
            r = self.sock.recv_into(view, min(len(buf), self.left))
            if r == 0:
                raise ConnectionResetError("peer closed the connection mid-frame")
            self.left -= r
            crc = crc32c.crc32c(view[:r], value=crc)
            done = 0
            while done < r:
                done += os.pwrite(fd, view[done:r], pos + done)
            pos += r
        return crc

    def drain(self) -> None:
        """Read and drop what is left."""
        while self.left:
            self.left -= len(_recv_exact(self.sock, min(self.left, _PIECE)))


@dataclass
class SendFile:
    """A payload sent from an open file (``sendfile``: no copy through user memory); the
    sender closes ``fd``."""

    fd: int
    size: int


Body = Union[Sequence[Buffer], SendFile]
# A store's side of the channel: (request header, payload) -> (response header, body).
# Raising answers ``error`` with the exception's text.
Handler = Callable[[Header, Payload], Tuple[Header, Body]]


def send_frame(sock: socket.socket, header: Header, body: Body = ()) -> None:
    """One frame: ``header`` (with ``n``, the payload's length, filled in), then ``body``."""
    if isinstance(body, SendFile):
        with os.fdopen(body.fd, "rb") as f:
            h = msgpack.packb(dict(header, n=body.size), use_bin_type=True)
            sock.sendall(_LEN.pack(len(h)) + h)
            if body.size:
                sock.sendfile(f, 0, body.size)
        return
    views = [memoryview(b).cast("B") for b in body]
    h = msgpack.packb(dict(header, n=sum(v.nbytes for v in views)), use_bin_type=True)
    sock.sendall(_LEN.pack(len(h)) + h)
    for v in views:
        if v.nbytes:
            sock.sendall(v)


def recv_frame(sock: socket.socket) -> Tuple[Header, Payload]:
    """(header, payload still to read) of the next frame; ``ConnectionError`` where the peer
    hung up."""
    (hn,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if hn > _MAX_HEADER:
        raise ConnectionError(f"peer frame header of {hn} bytes: not a shardpoint peer")
    header = msgpack.unpackb(bytes(_recv_exact(sock, hn)), raw=False)
    if not isinstance(header, dict):
        raise ConnectionError("peer frame header is not a map: not a shardpoint peer")
    return header, Payload(sock, int(header.get("n", 0)))


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    handler: Handler
    token: str
    closing = False


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
            if server.closing:  # closed: kept connections are dropped too
                return
            if header.get("token") != server.token:
                send_frame(sock, {"status": "error", "msg": "wrong job token"})
                return
            body: Body
            try:
                resp, body = server.handler(header, payload)
            except Exception as e:  # noqa: BLE001 - answered to the caller, who raises
                resp, body = {"status": "error", "msg": f"{type(e).__name__}: {e}"}, ()
            try:
                payload.drain()
                send_frame(sock, resp, body)
            except OSError:
                return


class PeerServer:
    """Serves ``handler`` on a TCP port (all interfaces; ``port`` 0 picks a free one) from
    daemon threads, until :meth:`close`. ``address``: what other hosts connect to
    (``advertise`` host, the bound port)."""

    def __init__(
        self,
        handler: Handler,
        token: str,
        *,
        bind: str = "0.0.0.0",
        port: int = 0,
        advertise: str = "127.0.0.1",
    ) -> None:
        self._srv = _Server((bind, port), _Conn)
        self._srv.handler, self._srv.token = handler, token
        self.address = f"{advertise}:{self._srv.server_address[1]}"
        self._thread = threading.Thread(
            target=self._srv.serve_forever,
            name="sp-shm-peer",
            kwargs={"poll_interval": 0.05},
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and answering: a kept connection is dropped at its next request."""
        self._srv.closing = True
        self._srv.shutdown()
        self._srv.server_close()


def _read_all(resp: Header, payload: Payload) -> bytearray:
    return payload.read_all()


class PeerClient:
    """Requests to one peer server at ``address`` (``host:port``), over a small pool of kept
    connections (thread-safe). A peer that refuses, hangs up or times out (``timeout_s`` per
    frame) raises :class:`StoreUnavailableError` naming it; the connection is dropped."""

    def __init__(
        self, address: str, token: str, *, timeout_s: float = 60.0, connect_timeout_s: float = 5.0
    ) -> None:
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

    def request(
        self, header: Header, body: Body = (), receive: Callable[[Header, Payload], Any] = _read_all
    ) -> Tuple[Header, Any]:
        """Send one request; return (response header, ``receive(header, payload)``: by
        default the whole payload)."""
        try:
            s = self._connect()
        except OSError as e:
            if isinstance(body, SendFile):
                os.close(body.fd)
            raise StoreUnavailableError(
                f"memory-tier peer {self.address} refuses "
                f"{header.get('op')} ({e}): its host is down or its "
                "job is gone"
            ) from e
        try:
            send_frame(s, dict(header, token=self._token), body)
            resp, payload = recv_frame(s)
            got = receive(resp, payload)
            payload.drain()
        except (OSError, ValueError, msgpack.ExtraData) as e:
            s.close()
            raise StoreUnavailableError(
                f"memory-tier peer {self.address} failed during "
                f"{header.get('op')} {header.get('key', '')!r} ({e}): "
                "its host is down or unreachable"
            ) from e
        with self._lock:
            self._idle.append(s)
        return resp, got

    def close(self) -> None:
        """Close the kept connections."""
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()


def advertised_host() -> str:
    """An address other hosts can reach this one at: ``$SHARDPOINT_SHM_ADVERTISE`` where set;
    else the local address of the route to the launcher's ``$MASTER_ADDR`` (the interface the
    process group reaches other hosts by); else the host name's address where it resolves;
    else the loopback (one-host jobs, tests)."""
    explicit = os.environ.get("SHARDPOINT_SHM_ADVERTISE")
    if explicit:
        return explicit
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, 9))  # no packet is sent: picks the route only
                return str(s.getsockname()[0])
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def host_identity(
    explicit: Optional[str] = None, environ: Optional[Mapping[str, str]] = None
) -> str:
    """This rank's host name, from the first of: ``explicit`` (``LoadOptions.host_id``, a memory tier's ``host_id``); SLURM's
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


def request_or_none(
    client: PeerClient,
    header: Header,
    body: Body = (),
    receive: Callable[[Header, Payload], Any] = _read_all,
) -> Optional[Tuple[Header, Any]]:
    """:meth:`PeerClient.request`, or None where the peer is unreachable (logged): reads and
    deletes go on with the hosts that answer."""
    try:
        return client.request(header, body, receive)
    except StoreUnavailableError as e:
        log.warning("%s", e)
        return None
