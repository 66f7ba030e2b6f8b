"""Real, slow networks on one machine: network namespaces, veth pairs and ``tc``.

Two topologies (``cluster.network.topology``):

- ``shared``: every process of the run joins one fresh namespace (:class:`Namespace`) and
  talks over TCP on its ``lo``, which ``tc`` shapes. Every packet crosses ``lo`` once, so
  all links of the run share the limit (a shared bus).
- ``hosts``: every rank gets a namespace of its own, a "host" (:class:`HostNetwork`),
  joined to a switch namespace (a Linux bridge) by a veth pair. Each host's link is shaped
  on both ends (its ``eth0`` for what it sends, the switch's port for what it receives), so
  each link has its own bandwidth and one slow link (a straggler) can be configured, as on
  a real cluster with one NIC per machine.

In both, a child moves itself into its namespace first thing (:func:`enter`, a ``setns``
before any socket exists). The namespaces have no interface that leads out of them, so
nothing can leave the machine. Shaping: ``tbf`` limits the rate; ``netem`` adds delay when
a latency is set (it needs the kernel's ``sch_netem``; without it a one-line error). Every
namespace is deleted on exit, on error and on SIGTERM (see :class:`Namespace`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from accelopt.drivers.cluster.faults import process_gone
from accelopt.errors import UserError

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"
MTU = 9000
"""The MTU of every shaped device. The loopback's default (65536) made tbf's burst (a few
packets) 262 KB, more than a small model's parameters: a "50 Mbit/s" link then delivered
them at ~96 Mbit/s. 9000 keeps the burst at 36 KB and TCP/IP header overhead under 1%."""
HOST_SUBNET = "10.77.0"
"""Hosts are ``10.77.0.<rank + 1>/24`` on their private bridge (no route leads elsewhere)."""
MAX_HOSTS = 253


class ShapingError(UserError):
    """The shaped network cannot be set up on this machine."""


@dataclass(frozen=True)
class Shape:
    """One direction's limits: a rate (bits/s) and a one-way delay (seconds); None: none."""

    bandwidth_bps: int | None
    latency_s: float | None

    @property
    def limited(self) -> bool:
        return self.bandwidth_bps is not None or self.latency_s is not None

    @property
    def burst_bytes(self) -> int:
        """tbf's burst: a few packets or 1 ms of traffic. What leaves within it after the
        link was idle goes at the machine's speed, so a job that sends no more than this
        per iteration is not held to the rate at all (``outcome.unconstrained_link`` says
        so after the run)."""
        assert self.bandwidth_bps is not None
        return int(max(4 * (MTU + 14), self.bandwidth_bps / 8 * 0.001))  # 14: Ethernet header

    def tbf_args(self) -> list[str]:
        """Rate limit with a burst of a few packets (or 1 ms of traffic) and a 50 ms queue."""
        assert self.bandwidth_bps is not None
        rate_bytes = self.bandwidth_bps / 8
        burst = self.burst_bytes
        limit = int(max(4 * burst, rate_bytes * 0.05))
        return ["tbf", "rate", f"{self.bandwidth_bps}bit", "burst", str(burst), "limit", str(limit)]


@dataclass(frozen=True)
class Endpoint:
    """Where one rank lives: its namespace (None: the caller's), its address and the
    interface gloo must use to reach the other ranks."""

    namespace: str | None
    address: str
    interface: str


LOOPBACK = Endpoint(None, "127.0.0.1", "lo")


def check_possible() -> None:
    """Raise one line when shaping cannot work here (not root, no ip/tc)."""
    if os.geteuid() != 0:
        raise ShapingError(
            "cluster.network shaping needs root (network namespaces and tc); run as root or "
            "drop cluster.network.bandwidth/latency/topology"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ShapingError(
                f"cluster.network shaping needs the `{tool}` command; install iproute2 "
                "(apt-get install iproute2) or drop cluster.network.bandwidth/latency/topology"
            )


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def _in(namespace: str, *cmd: str) -> None:
    """Run an iproute2 command (``ip ...`` or ``tc ...``) inside ``namespace``."""
    done = _run(cmd[0], "-n", namespace, *cmd[1:])
    if done.returncode != 0:
        raise ShapingError(f"`{' '.join(cmd)}` failed in {namespace}: {done.stderr.strip()}")


def _add_namespace(name: str) -> None:
    made = _run("ip", "netns", "add", name)
    if made.returncode != 0:
        raise ShapingError(
            f"cannot create network namespace {name}: {made.stderr.strip()}; "
            "check that this container allows `ip netns add` (CAP_SYS_ADMIN)"
        )


def shape_device(namespace: str, device: str, shape: Shape, *, delay: bool = True) -> None:
    """What leaves ``device`` in ``namespace``: tbf for the rate, netem (under the tbf, or
    alone) for the delay when ``delay``."""
    latency = shape.latency_s if delay else None
    if shape.bandwidth_bps is not None:
        _in(namespace, "tc", "qdisc", "add", "dev", device, "root", "handle", "1:",
            *shape.tbf_args())
    if latency is None:
        return
    where = ("parent", "1:1", "handle", "10:") if shape.bandwidth_bps is not None else (
        "root", "handle", "1:")
    usec = max(1, round(latency * 1e6))
    done = _run("tc", "-n", namespace, "qdisc", "add", "dev", device, *where, "netem",
                "delay", f"{usec}us", "limit", "100000")
    if done.returncode != 0:
        raise ShapingError(
            "cluster.network.latency needs the kernel's netem qdisc (sch_netem), which "
            f"this kernel refuses ({done.stderr.strip()}); load it (modprobe sch_netem) "
            "or drop cluster.network.latency"
        )


def qdisc(namespace: str, device: str) -> str:
    return _run("tc", "-n", namespace, "qdisc", "show", "dev", device).stdout.strip()


_Owner = TypeVar("_Owner", bound="_Namespaces")


class _Namespaces:
    """Owns namespaces: deletes them all on leaving, on error, and from ``atexit`` if the
    with-block is skipped by a hard exit of the interpreter."""

    def __init__(self) -> None:
        # the owner's pid in every name: a later run removes what a SIGKILLed one left
        self.token = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.names: list[str] = []
        self._closed = True

    def _build(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Owner) -> _Owner:
        check_possible()
        remove_orphaned_namespaces()
        self._closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add(self, name: str) -> str:
        _add_namespace(name)
        self.names.append(name)
        return name

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for name in reversed(self.names):
            _run("ip", "netns", "del", name)
        with contextlib.suppress(Exception):  # interpreter shutting down
            atexit.unregister(self.close)


class Namespace(_Namespaces):
    """``with Namespace(shape) as ns:`` creates ``accelopt-<pid>-<random>``, brings its ``lo`` up
    and shapes it: the ``shared`` topology."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.shape = shape
        self.name = f"accelopt-{self.token}"

    def _build(self) -> None:
        self._add(self.name)
        _in(self.name, "ip", "link", "set", "lo", "mtu", str(MTU))
        _in(self.name, "ip", "link", "set", "lo", "up")
        shape_device(self.name, "lo", self.shape)

    @property
    def path(self) -> str:
        return os.path.join(NETNS_DIR, self.name)

    def endpoints(self, world: int) -> list[Endpoint]:
        return [Endpoint(self.name, "127.0.0.1", "lo")] * world

    def qdisc(self) -> str:
        return qdisc(self.name, "lo")


class HostNetwork(_Namespaces):
    """``with HostNetwork(links) as net:`` creates one host namespace per link
    (``accelopt-<pid>-<random>-h<rank>``, address ``10.77.0.<rank+1>`` on ``eth0``) and a switch
    namespace (``accelopt-<pid>-<random>-sw``) whose bridge joins them: the ``hosts`` topology.
    ``links[r]`` shapes host r's link in both directions; a latency is added once per
    direction, on the sending host's ``eth0``, so any two hosts are that far apart."""

    def __init__(self, links: Sequence[Shape]) -> None:
        super().__init__()
        if not 1 <= len(links) <= MAX_HOSTS:
            raise ShapingError(
                f"cluster.network.topology=hosts supports 1..{MAX_HOSTS} ranks, got "
                f"{len(links)}; use topology=shared for more"
            )
        self.links = list(links)
        self.switch = f"accelopt-{self.token}-sw"
        self.hosts = [f"accelopt-{self.token}-h{r}" for r in range(len(links))]

    def _build(self) -> None:
        sw = self._add(self.switch)
        _in(sw, "ip", "link", "add", "br0", "type", "bridge")
        _in(sw, "ip", "link", "set", "br0", "up")
        for rank, (host, shape) in enumerate(zip(self.hosts, self.links, strict=True)):
            self._add(host)
            port = f"p{rank}"
            _in(sw, "ip", "link", "add", port, "mtu", str(MTU), "type", "veth", "peer",
                "name", "eth0", "mtu", str(MTU), "netns", host)
            _in(sw, "ip", "link", "set", port, "master", "br0")
            _in(sw, "ip", "link", "set", port, "up")
            _in(host, "ip", "addr", "add", f"{self.address(rank)}/24", "dev", "eth0")
            _in(host, "ip", "link", "set", "eth0", "up")
            _in(host, "ip", "link", "set", "lo", "up")
            shape_device(host, "eth0", shape)  # what the host sends
            shape_device(sw, port, shape, delay=False)  # what it receives

    @staticmethod
    def address(rank: int) -> str:
        return f"{HOST_SUBNET}.{rank + 1}"

    def endpoints(self, world: int) -> list[Endpoint]:
        assert world == len(self.hosts)
        return [Endpoint(h, self.address(r), "eth0") for r, h in enumerate(self.hosts)]

    def qdisc(self, rank: int) -> str:
        """Host ``rank``'s shaping, sending side then receiving side."""
        return qdisc(self.hosts[rank], "eth0") + "\n" + qdisc(self.switch, f"p{rank}")


@contextlib.contextmanager
def network(topology: str, links: Sequence[Shape]) -> Iterator[list[Endpoint]]:
    """The endpoints of ``len(links)`` ranks for ``topology`` (``none``: the machine's own
    loopback; ``shared``: one shaped namespace, ``links[0]``'s shape; ``hosts``: one
    namespace per rank), removed on leaving."""
    world = len(links)
    if topology == "none":
        yield [LOOPBACK] * world
    elif topology == "shared":
        with Namespace(links[0]) as ns:
            yield ns.endpoints(world)
    elif topology == "hosts":
        with HostNetwork(links) as net:
            yield net.endpoints(world)
    else:
        raise ShapingError(f"cluster.network.topology: {topology!r} unknown; use shared or hosts")


def enter(name: str) -> None:
    """Move the calling thread (and every thread/process it creates later) into namespace
    ``name``. Called first thing in each child, before any socket exists."""
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def tx_bytes(interface: str = "lo") -> int | None:
    """Bytes sent on ``interface`` in this thread's namespace (IP packets incl. TCP/IP
    headers)."""
    try:
        with open("/proc/thread-self/net/dev") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                if name.strip() == interface:
                    return int(rest.split()[8])
    except OSError:
        return None
    return None


def remove_orphaned_namespaces() -> list[str]:
    """Delete the namespaces of runs whose process is gone; return their names.

    Why: a launcher killed by SIGKILL (``timeout -s KILL`` in CI, the OOM killer) takes its
    ranks with it but cannot run its cleanup, and nothing else would ever delete its
    namespaces and their shaping. Each name carries its owner's pid
    (``accelopt-<pid>-<random>...``); only those whose pid no longer exists are removed, never a
    live run's, and never a name of another form."""
    removed = []
    for name in leftover_namespaces():
        pid = name.split("-")[1]
        if not pid.isdigit() or not process_gone(int(pid)):
            continue
        if _run("ip", "netns", "del", name).returncode == 0:
            removed.append(name)
    return removed


def leftover_namespaces() -> list[str]:
    """accelopt namespaces that still exist (tests check that runs clean up)."""
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith("accelopt-"))
    except FileNotFoundError:
        return []
