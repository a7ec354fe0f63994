"""A cluster on one machine: hosts as network namespaces joined by shaped links.

``Cluster(hosts=H, ranks_per_host=R, link=Link(mbit=1000))`` builds, as root:

- one network namespace per host (``10.23.0.<h+1>``), each host's ranks running in it under a
  hostname of its own (a UTS namespace), so they learn their host the way they do on a real
  cluster: ``socket.gethostname()``, the torchrun variables (``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``) and gloo bound to the host's interface
  (``GLOO_SOCKET_IFNAME=eth0``);
- a storage host (``10.23.0.250``) for a server that stands in for remote storage, reached
  over its own shaped link: :meth:`Cluster.s3_server` runs the S3-compatible server
  (:class:`~shardpoint_testing.s3.S3Server`, moto) there, so ranks save to and load from
  ``s3://`` over their links and the storage host's, as a cluster reaches an object store
  (:meth:`Cluster.popen_storage` starts any other server);
- a switch namespace holding a bridge; every host's link is a veth pair, shaped in both
  directions with ``tc tbf`` (rate; latency stays the veth's), so all of a host's traffic,
  exchange and storage, shares its link as it would share a NIC;
- a shared directory (``shared_dir``) standing in for a parallel file system;
- with ``host_memory=True``, each host's shared memory: a directory of its own below one the
  cluster makes in ``/dev/shm`` (the namespaces share this machine's), handed to its ranks as
  ``$SHARDPOINT_SHM_DIR`` (where the memory tier keeps its objects).

A host can be lost for real and replaced (:meth:`Cluster.lose_host`: its processes SIGKILLed,
its namespace and link deleted, its shared memory gone; :meth:`Cluster.replace_host`: a fresh
namespace at the same address under a new hostname, empty memory), as a job restarted on a
replacement machine sees it.

What it models: per-host network bandwidth, hosts that cannot reach each other
over loopback or shared memory by name, a host whose processes die or whose link is cut,
object storage behind a link of its own (every byte to and from ``s3://`` crosses the rank's
host link and the storage link, both shaped).
What it does not: the hosts share this machine's CPUs, memory and page cache, and file-system
I/O to ``shared_dir`` does not cross the links (it goes to the local disk at local speed, and a
second host reading a file finds it in the one page cache); only a storage server running on
the storage host is reached over shaped links. Namespaces cannot separate page caches, and
link latency is not shaped (no ``netem`` in this kernel).

Traffic goes only to addresses inside the namespaces this harness creates. Everything it
creates (namespaces, links, processes, the shared directory it made) is removed on exit, also
after a failure or an interrupt; it never deletes what it did not create.
:func:`unavailable_reason` says why a machine cannot host one (not root, no ``ip``/``tc``).
This module builds, changes and tears down the cluster; how a rank runs inside a host (the
namespaces it enters, its gloo group, :class:`ClusterJob`) is in
:mod:`shardpoint_testing.cluster_ranks`.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from shardpoint_testing.cluster_ranks import ClusterJob, _entry, _kill
from shardpoint_testing.cluster_ranks import enter_host as enter_host  # re-exported
from shardpoint_testing.launch import process_context

SUBNET = "10.23.0"
STORAGE_ADDR = f"{SUBNET}.250"
MASTER_PORT = 29523
_LIVE: list = []  # clusters not yet closed, torn down at interpreter exit


def unavailable_reason() -> Optional[str]:
    """Why a cluster cannot be built here (None when it can): it needs root (network
    namespaces, veth pairs, ``tc``) and the ``ip`` and ``tc`` tools."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "the test cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the test cluster needs root (ip netns, veth pairs, tc); run the tests as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the test cluster needs the {tool!r} tool (iproute2)"
    return None


@dataclass(frozen=True)
class Link:
    """One host's link: ``mbit`` per direction (None: unshaped), shaped with ``tc tbf`` on
    both ends of the host's veth pair. Latency is not shaped: ``netem`` is not in this
    machine's kernel (the links add ~0.05 ms of veth and bridge)."""

    mbit: Optional[float] = None

    def tbf(self) -> list:
        """The ``tc qdisc ... tbf`` arguments: a burst of 10 ms at the rate (at least 64 KiB,
        so a rate's first packets are not refused), a queue of 100 ms."""
        if self.mbit is None:
            raise ValueError("an unshaped link (mbit None) has no tbf arguments")
        burst = max(64 << 10, int(self.mbit * 1e6 / 8 * 0.01))
        return ["tbf", "rate", f"{self.mbit}mbit", "burst", str(burst), "latency", "100ms"]


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True)


class Cluster:
    """H hosts x R ranks in network namespaces; see the module docstring. Use as a context
    manager (or call :meth:`close`): ``with Cluster(2, 2) as c: c.run(fn, arg)``."""

    def __init__(
        self,
        hosts: int = 2,
        ranks_per_host: int = 1,
        link: Link = Link(),
        storage_link: Optional[Link] = None,
        shared_dir: Optional[str] = None,
        links: Optional[Sequence[Link]] = None,
        host_memory: bool = False,
    ):
        why = unavailable_reason()
        if why:
            raise RuntimeError(why)
        if not 1 <= hosts <= 200 or ranks_per_host < 1:
            raise ValueError(
                f"hosts must be 1..200 and ranks_per_host >= 1, got {hosts}, {ranks_per_host}"
            )
        self.hosts, self.ranks_per_host = hosts, ranks_per_host
        self.links = list(links) if links is not None else [link] * hosts
        if len(self.links) != hosts:
            raise ValueError(f"{len(self.links)} links for {hosts} hosts")
        self.storage_link = storage_link or link
        self.tag = "sp" + secrets.token_hex(3)
        self.switch = f"{self.tag}x"
        self.storage = f"{self.tag}s"
        self.host_ns = [f"{self.tag}h{h}" for h in range(hosts)]
        self.hostnames = [f"node{h}-{self.tag}" for h in range(hosts)]
        self._made_dir = shared_dir is None
        self.shared_dir = shared_dir or tempfile.mkdtemp(prefix=f"{self.tag}-shared-")
        #: the directory holding every host's shared memory (``host_memory=True``), else None
        self.memory_dir: Optional[str] = None
        if host_memory:
            self.memory_dir = tempfile.mkdtemp(
                prefix=f"{self.tag}-shm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
            )
        self._replaced = 0
        self._created: list = []  # namespaces made, in order
        self._procs: dict = {}  # host index (-1: storage) -> [Popen or Process]
        self._closed = False
        _LIVE.append(self)
        _exit_on_sigterm()
        self._reaper = self._start_reaper()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ building and teardown
    def _ns(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._created.append(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")

    def _veth(self, ns: str, idx: str, addr: str, link: Link) -> None:
        a, b = f"{self.tag}{idx}a", f"{self.tag}{idx}b"
        _sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        _sh("ip", "link", "set", a, "netns", ns)
        _sh("ip", "link", "set", b, "netns", self.switch)
        _sh("ip", "-n", ns, "link", "set", a, "name", "eth0")
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", self.switch, "link", "set", b, "master", "br0")
        _sh("ip", "-n", self.switch, "link", "set", b, "up")
        self._shape(ns, "eth0", link)
        self._shape(self.switch, b, link)

    @staticmethod
    def _shape(ns: str, dev: str, link: Link) -> None:
        if link.mbit:
            _sh(
                "ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *link.tbf()
            )

    def _build(self) -> None:
        self._ns(self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for h, ns in enumerate(self.host_ns):
            self._ns(ns)
            self._veth(ns, f"h{h}", self.addr(h), self.links[h])
        self._ns(self.storage)
        self._veth(self.storage, "s", STORAGE_ADDR, self.storage_link)

    def _start_reaper(self) -> subprocess.Popen:
        """A watchdog process that tears the cluster down if this process dies without
        :meth:`close` (SIGKILL): it knows the namespace names (made with this cluster's own
        random tag) and the directories it made, nothing else."""
        from shardpoint_testing.s3 import _child_env

        names = [self.switch, *self.host_ns, self.storage]
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardpoint_testing.cluster",
                "reap",
                str(os.getpid()),
                os.pathsep.join(self._made_dirs()),
                *names,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=_child_env(),
            start_new_session=True,
        )

    def close(self) -> None:
        """Kill what the cluster started, delete its namespaces (their links go with them)
        and the shared directory it made. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        _kill(self._reaper)  # we tear down ourselves; it only acts if we die first
        for procs in self._procs.values():
            for p in procs:
                _kill(p)
        _teardown(reversed(self._created), self._made_dirs())
        if self in _LIVE:
            _LIVE.remove(self)

    def _made_dirs(self) -> list:
        """The directories this cluster made (and so removes)."""
        made = [self.shared_dir] if self._made_dir else []
        return made + ([self.memory_dir] if self.memory_dir else [])

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------ topology
    def addr(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    @property
    def world(self) -> int:
        return self.hosts * self.ranks_per_host

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def cut_link(self, host: int) -> None:
        """Take ``host``'s link down at the switch (a pulled cable: no reset reaches either
        side, so the peers notice only by their timeouts)."""
        _sh("ip", "-n", self.switch, "link", "set", f"{self.tag}h{host}b", "down")

    def restore_link(self, host: int) -> None:
        _sh("ip", "-n", self.switch, "link", "set", f"{self.tag}h{host}b", "up")

    def kill_host(self, host: int) -> None:
        """SIGKILL every process running on ``host`` at once (a machine that died), then
        reap them."""
        procs = self._procs.get(host, [])
        for p in procs:
            try:
                if (p.poll() is None) if isinstance(p, subprocess.Popen) else p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
            except (OSError, ValueError, AssertionError):
                pass
        for p in procs:
            _kill(p)

    def host_memory(self, host: int) -> str:
        """``host``'s shared memory (``host_memory=True``): ``$SHARDPOINT_SHM_DIR`` of its
        ranks; a replacement host gets a new, empty one."""
        if self.memory_dir is None:
            raise ValueError("the cluster was built without host_memory=True")
        return os.path.join(self.memory_dir, self.hostnames[host])

    def lose_host(self, host: int) -> None:
        """``host`` is lost for good: every process on it SIGKILLed (:meth:`kill_host`),
        its link and namespace deleted, its shared memory gone. :meth:`replace_host` brings
        a replacement up at the same address."""
        ns = self.host_ns[host]
        if ns not in self._created:
            raise ValueError(f"host {host} is already lost")
        self.kill_host(host)
        self._procs.pop(host, None)
        _sh("ip", "-n", self.switch, "link", "del", f"{self.tag}h{host}b", check=False)
        _teardown([ns], [])
        self._created.remove(ns)
        if self.memory_dir is not None:
            shutil.rmtree(self.host_memory(host), ignore_errors=True)

    def replace_host(self, host: int) -> str:
        """A replacement for lost ``host``: a fresh namespace at the same address and
        index (the launcher gives its ranks the lost host's ranks), under a new hostname,
        with empty shared memory and a new link (its byte counters from zero). Returns the
        new hostname."""
        ns = self.host_ns[host]
        if ns in self._created:
            raise ValueError(f"host {host} is not lost: lose_host({host}) first")
        self._replaced += 1
        self.hostnames[host] = f"node{host}r{self._replaced}-{self.tag}"
        self._ns(ns)
        self._veth(ns, f"h{host}", self.addr(host), self.links[host])
        return self.hostnames[host]

    def popen_host(self, host: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Run ``argv`` on a host (its namespace and hostname); killed at close. ``host`` -1
        is the storage host."""
        ns = self.storage if host < 0 else self.host_ns[host]
        name = f"storage-{self.tag}" if host < 0 else self.hostnames[host]
        p = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "unshare",
                "--uts",
                "sh",
                "-c",
                'hostname "$0" && exec "$@"',
                name,
                *argv,
            ],
            **kw,
        )
        self._procs.setdefault(host, []).append(p)
        return p

    def popen_storage(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Run a storage server (the S3-compatible server) on the storage host, reachable
        from every host at :data:`STORAGE_ADDR` over the storage link."""
        return self.popen_host(-1, argv, **kw)

    def s3_server(self, bucket: str = "shardpoint-test", port: int = 9000) -> Any:
        """Start the S3-compatible server on the storage host (``http://10.23.0.250:9000``)
        with ``bucket``; stopped at :meth:`close` (or by its own ``stop``). Hand its
        :meth:`~shardpoint_testing.s3.S3Server.env` to the ranks (``run(..., env=...)``):
        the root namespace cannot reach it, the hosts can."""
        from shardpoint_testing.s3 import S3Server

        return S3Server(bucket, host=STORAGE_ADDR, port=port, launch=self.popen_storage).start()

    def rank_env(self, rank: int) -> dict:
        """The environment a rank gets, as torchrun sets it on a real cluster."""
        h = self.host_of(rank)
        return {
            "MASTER_ADDR": self.addr(0),
            "MASTER_PORT": str(MASTER_PORT),
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world),
            "LOCAL_RANK": str(rank % self.ranks_per_host),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_host),
            "GROUP_RANK": str(h),
            "GROUP_WORLD_SIZE": str(self.hosts),
            "NODE_RANK": str(h),
            "GLOO_SOCKET_IFNAME": "eth0",
            "OMP_NUM_THREADS": "1",
            **({"SHARDPOINT_SHM_DIR": self.host_memory(h)} if self.memory_dir else {}),
        }

    # ---------------------------------------------------------------------------- running
    def start(
        self, fn: Callable, *args: Any, pg_timeout: float = 60.0, env: Optional[dict] = None
    ) -> "ClusterJob":
        """Start ``fn(rank, world, *args)`` on every rank (a gloo group over the links), with
        ``env`` added to each rank's environment; returns the running job
        (:meth:`ClusterJob.wait`)."""
        ctx = process_context()  # forked from the launcher's preloaded fork server
        q = ctx.Queue()
        procs = []
        for r in range(self.world):
            h = self.host_of(r)
            p = ctx.Process(
                target=_entry,
                args=(
                    self.host_ns[h],
                    self.hostnames[h],
                    {**os.environ, **self.rank_env(r), **(env or {})},
                    fn,
                    r,
                    self.world,
                    args,
                    q,
                    pg_timeout,
                ),
                daemon=True,
            )
            p.start()
            self._procs.setdefault(h, []).append(p)
            procs.append(p)
        return ClusterJob(self, procs, q)

    def run(
        self,
        fn: Callable,
        *args: Any,
        timeout: float = 120.0,
        pg_timeout: float = 60.0,
        env: Optional[dict] = None,
    ) -> list:
        """``[fn(0, world, *args), ...]`` from every rank of the cluster; raises
        :class:`~shardpoint_testing.launch.RankFailure` when a rank fails or time runs out."""
        return self.start(fn, *args, pg_timeout=pg_timeout, env=env).wait(timeout)

    def link_bytes(self, host: int) -> int:
        """Bytes that crossed ``host``'s link (-1: the storage host's) so far, both ways, as
        the switch's end of the veth pair counts them."""
        dev = f"{self.tag}sb" if host < 0 else f"{self.tag}h{host}b"
        st = f"/sys/class/net/{dev}/statistics"
        out = _sh("ip", "netns", "exec", self.switch, "cat", f"{st}/rx_bytes", f"{st}/tx_bytes")
        return sum(int(x) for x in out.stdout.split())


def _teardown(namespaces: Any, made_dirs: Sequence[str]) -> None:
    """Delete ``namespaces`` (their links go with them) after ending the processes left in
    them (ours: only this harness enters them), and the directories the cluster made."""
    for ns in namespaces:
        out = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in out:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _sh("ip", "netns", "del", ns, check=False)
    for d in made_dirs:
        shutil.rmtree(d, ignore_errors=True)


def _reap(parent: int, made_dirs: str, namespaces: Sequence[str]) -> None:
    """The reaper's body: wait until ``parent`` is gone, then tear its cluster down."""
    while os.getppid() == parent:
        time.sleep(0.2)
    existing = set(_sh("ip", "netns", "list", check=False).stdout.split())
    dirs = [d for d in made_dirs.split(os.pathsep) if d]
    _teardown([ns for ns in reversed(namespaces) if ns in existing], dirs)


def _exit_on_sigterm() -> None:
    """A SIGTERM (``timeout``, a CI runner) ends the process through ``SystemExit``, so the
    clusters are torn down by their ``with`` blocks and the exit hook; a handler the program
    set itself is left alone."""
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    except ValueError:  # not the main thread
        pass


@atexit.register
def _close_all() -> None:
    for c in list(_LIVE):
        c.close()


if __name__ == "__main__":  # python -m shardpoint_testing.cluster reap PID DIRS NS...
    if sys.argv[1:2] == ["reap"]:
        _reap(int(sys.argv[2]), sys.argv[3], sys.argv[4:])
