"""A fresh network namespace whose loopback is shaped with ``tc``: a real, slow network on
one machine.

All processes of a shaped run join the namespace (:func:`enter`, a ``setns`` in each child
before torch.distributed starts) and talk over real TCP on 127.0.0.1. The namespace has no
other interface, so nothing can leave the machine. Every packet between two processes
crosses ``lo`` once, so the limit is shared by all links of the run (a shared bus).

Shaping: ``tbf`` (token bucket) limits the rate; ``netem`` adds delay when a latency is set
(it needs the kernel's ``sch_netem``; a kernel without it gets a one-line error). The
namespace is deleted on exit, on error and on SIGTERM (see :class:`Namespace`).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass

from accelopt.errors import UserError

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"
LO_MTU = 9000
"""The namespace's loopback MTU. The kernel default (65536) made tbf's burst (a few packets)
262 KB, more than a small model's parameters: a "50 Mbit/s" link then delivered them at
~96 Mbit/s. 9000 keeps the burst at 36 KB and TCP/IP header overhead under 1%."""


class ShapingError(UserError):
    """The shaped network cannot be set up on this machine."""


@dataclass(frozen=True)
class Shape:
    bandwidth_bps: int | None
    latency_s: float | None

    def tbf_args(self) -> list[str]:
        """Rate limit with a burst of a few packets (or 1 ms of traffic) and a 50 ms queue."""
        assert self.bandwidth_bps is not None
        rate_bytes = self.bandwidth_bps / 8
        burst = int(max(4 * (LO_MTU + 14), rate_bytes * 0.001))  # 14: Ethernet header
        limit = int(max(4 * burst, rate_bytes * 0.05))
        return ["tbf", "rate", f"{self.bandwidth_bps}bit", "burst", str(burst), "limit", str(limit)]


def check_possible(shape: Shape) -> None:
    """Raise one line when shaping cannot work here (not root, no ip/tc)."""
    if os.geteuid() != 0:
        raise ShapingError(
            "cluster.network shaping needs root (network namespaces and tc); run as root or "
            "drop cluster.network.bandwidth/latency"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ShapingError(
                f"cluster.network shaping needs the `{tool}` command; install iproute2 "
                "(apt-get install iproute2) or drop cluster.network.bandwidth/latency"
            )


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


class Namespace:
    """``with Namespace(shape) as ns:`` creates ``accelopt-<random>``, brings its ``lo`` up,
    shapes it, and deletes it on leaving (also from ``atexit`` if the with-block is skipped
    by a hard exit of the interpreter)."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.name = f"accelopt-{secrets.token_hex(4)}"
        self._closed = True

    def __enter__(self) -> Namespace:
        check_possible(self.shape)
        made = _run("ip", "netns", "add", self.name)
        if made.returncode != 0:
            raise ShapingError(
                f"cannot create network namespace {self.name}: {made.stderr.strip()}; "
                "check that this container allows `ip netns add` (CAP_SYS_ADMIN)"
            )
        self._closed = False
        atexit.register(self.close)
        try:
            self._exec("ip", "link", "set", "lo", "mtu", str(LO_MTU))
            self._exec("ip", "link", "set", "lo", "up")
            self._shape()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def path(self) -> str:
        return os.path.join(NETNS_DIR, self.name)

    def _exec(self, *cmd: str) -> None:
        done = _run("ip", "netns", "exec", self.name, *cmd)
        if done.returncode != 0:
            raise ShapingError(f"`{' '.join(cmd)}` failed in {self.name}: {done.stderr.strip()}")

    def _shape(self) -> None:
        shape = self.shape
        if shape.bandwidth_bps is not None and shape.latency_s is not None:
            self._exec("tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", *shape.tbf_args())
            self._netem("parent", "1:1", "handle", "10:")
        elif shape.bandwidth_bps is not None:
            self._exec("tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", *shape.tbf_args())
        elif shape.latency_s is not None:
            self._netem("root", "handle", "1:")

    def _netem(self, *where: str) -> None:
        assert self.shape.latency_s is not None
        usec = max(1, round(self.shape.latency_s * 1e6))
        cmd = ("tc", "qdisc", "add", "dev", "lo", *where, "netem", "delay", f"{usec}us",
               "limit", "100000")
        done = _run("ip", "netns", "exec", self.name, *cmd)
        if done.returncode != 0:
            raise ShapingError(
                "cluster.network.latency needs the kernel's netem qdisc (sch_netem), which "
                f"this kernel refuses ({done.stderr.strip()}); load it (modprobe sch_netem) "
                "or drop cluster.network.latency"
            )

    def qdisc(self) -> str:
        done = _run("ip", "netns", "exec", self.name, "tc", "qdisc", "show", "dev", "lo")
        return done.stdout.strip()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _run("ip", "netns", "del", self.name)
        try:
            atexit.unregister(self.close)
        except Exception:  # noqa: BLE001 - interpreter shutting down
            pass


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


def loopback_tx_bytes() -> int | None:
    """Bytes sent on ``lo`` in this thread's namespace (IP packets incl. TCP/IP headers)."""
    try:
        with open("/proc/thread-self/net/dev") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return int(rest.split()[8])
    except OSError:
        return None
    return None


def leftover_namespaces() -> list[str]:
    """accelopt namespaces that still exist (tests check that runs clean up)."""
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith("accelopt-"))
    except FileNotFoundError:
        return []
