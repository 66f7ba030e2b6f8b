"""The cluster section of a run config, validated once into plain values.

Every check fails with one line naming the key and the fix, before any process starts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from accelopt.drivers.cluster.netns import Shape
from accelopt.errors import ConfigError
from accelopt.types import ClusterInfo

MODES = ("ps", "allreduce")
TOPOLOGIES = ("shared", "hosts")
BACKENDS = ("auto", "gloo", "nccl")

_LINK = re.compile(r"^(?:(worker|server)(\d+)|(\d+))$")
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)\s*bit(?:/s)?\s*$", re.IGNORECASE)
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_rate(text: str, key: str = "cluster.network.bandwidth") -> int:
    """'1gbit' -> 1_000_000_000 bits/s (tc's units: k/m/g are powers of 10)."""
    match = _RATE.match(str(text))
    if not match:
        raise ConfigError(f"{key}: cannot read {text!r} as a rate; write e.g. 1gbit or 100mbit")
    number = float(match.group(1)) * _SCALE[match.group(2).lower()]
    if not math.isfinite(number):  # hundreds of digits: float() says inf, int() overflows
        raise ConfigError(f"{key}: {text!r} is not a finite rate; write e.g. 1gbit or 100mbit")
    bits = int(number)
    if bits < 8000:
        raise ConfigError(f"{key}: {text!r} is below 8kbit/s; give a larger rate")
    return bits


def parse_duration(text: str, key: str = "cluster.network.latency") -> float:
    """'1ms' -> 0.001 seconds."""
    match = _TIME.match(str(text))
    if not match:
        raise ConfigError(f"{key}: cannot read {text!r} as a duration; write e.g. 1ms or 200us")
    seconds = float(match.group(1)) * _SECONDS[match.group(2).lower()]
    if not math.isfinite(seconds):  # hundreds of digits: float() says inf
        raise ConfigError(f"{key}: {text!r} is not a finite duration; write e.g. 1ms or 200us")
    return seconds


def positive_number(value: Any, key: str, what: str, most: float) -> float:
    """``value`` as a float, refused in one line naming ``key`` unless it is a finite number
    in (0, ``most``]. Why not ``float(value) <= 0``: ``nan <= 0`` and ``inf <= 0`` are both
    false, so ``cluster.bucket_mb=nan`` passed that check and failed later as a raw
    ``ValueError`` (``inf``: an ``OverflowError``) from ``int(nan * 2**20)``, and
    ``cluster.timeout_s=nan`` reached ``timedelta`` inside a rank. ``most``: the largest
    value the consumers can hold (bytes in a C++ integer, seconds in a ``timedelta``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number > 0 ({what}), got {value!r}")
    if value <= 0:
        raise ConfigError(f"{key} must be > 0 ({what}), got {value!r}")
    if value > most:
        raise ConfigError(f"{key} must be at most {most:g} ({what}), got {value!r}")
    return float(value)


MAX_RANKS = 1024
"""The most processes a cluster run may have: each rank is a process with its own torch
(~0.3 GB), so a typo such as ``cluster.workers=100000`` started forking that many before
anything failed. 1024 is beyond any run on one machine and still lets torchrun spread
a large world over many."""
MAX_BUCKET_MB = 1e12
"""About 2**60 bytes: more than any model (a bucket that size holds the whole model), and
the bytes still fit the 64-bit integers DDP's ``bucket_cap_mb`` becomes."""
MAX_TIMEOUT_S = 1e9
"""About 32 years; ``timedelta`` (the process group's timeout) overflows near 8.6e13 s."""
NUMBERS: dict[str, tuple[float, str, float]] = {
    "bucket_mb": (1.0, "MiB per gradient bucket", MAX_BUCKET_MB),
    "timeout_s": (30.0, "seconds a rank waits for the others", MAX_TIMEOUT_S),
}
"""The ``cluster`` keys that are numbers: (default, what it is, largest taken). The other
keys are integers (``int()`` refuses nan) or strings parsed here (``network.bandwidth``,
``network.latency``: :func:`parse_rate`, :func:`parse_duration`)."""


def cluster_number(cluster: Any, key: str) -> float:
    """``cluster.<key>`` (one of :data:`NUMBERS`), checked by :func:`positive_number`: the
    one place every mode's reader (a one-process run's buckets, ``accelopt.attach``, the
    ranks' settings) goes through, so none of them sees a nan or inf."""
    default, what, most = NUMBERS[key]
    return positive_number(cluster.get(key, default), f"cluster.{key}", what, most)


def check_numbers(cluster: Any) -> None:
    """Every number of the ``cluster`` section (:data:`NUMBERS`), in one line each, whatever
    the mode: a run's validation calls it before anything starts."""
    for key in NUMBERS:
        cluster_number(cluster, key)


@dataclass(frozen=True)
class ClusterSettings:
    mode: str
    workers: int
    servers: int
    backend: str
    bucket_bytes: int
    timeout_s: float
    master_port: int
    bandwidth_bps: int | None
    latency_s: float | None
    topology: str = "shared"
    """``shared``: one shaped loopback for every rank; ``hosts``: one namespace per rank."""
    link_bandwidth_bps: tuple[tuple[int, int], ...] = ()
    """(rank, bits/s) of the links that differ from ``bandwidth_bps`` (hosts topology)."""

    @property
    def world_size(self) -> int:
        return self.workers + (self.servers if self.mode == "ps" else 0)

    @property
    def shaped(self) -> bool:
        """The ranks run in network namespaces of their own (not the machine's loopback)."""
        return self.network != "none"

    @property
    def network(self) -> str:
        """``none`` (the machine's loopback), ``shared`` or ``hosts``."""
        if self.topology == "hosts":
            return "hosts"
        return "shared" if self.bandwidth_bps is not None or self.latency_s is not None else "none"

    def link(self, rank: int) -> Shape:
        """The shape of rank ``rank``'s link (shared topology: the one loopback's)."""
        bandwidth = dict(self.link_bandwidth_bps).get(rank, self.bandwidth_bps)
        return Shape(bandwidth, self.latency_s)

    def links(self) -> list[Shape]:
        return [self.link(r) for r in range(self.world_size)]

    def link_name(self, rank: int) -> str:
        """``server0``, ``worker1``: how ``cluster.network.links`` names rank ``rank``."""
        if self.role(rank) == "server":
            return f"server{rank}"
        return f"worker{self.worker_index(rank)}"

    def role(self, rank: int) -> str:
        """PS mode: ranks 0..servers-1 are servers, the rest workers; all-reduce: all workers."""
        if self.mode == "ps" and rank < self.servers:
            return "server"
        return "worker"

    def worker_index(self, rank: int) -> int:
        return rank - self.servers if self.mode == "ps" else rank

    def worker_ranks(self) -> list[int]:
        first = self.servers if self.mode == "ps" else 0
        return list(range(first, first + self.workers))

    def server_ranks(self) -> list[int]:
        return list(range(self.servers)) if self.mode == "ps" else []

    def info(self, backend: str) -> ClusterInfo:
        """The record plugins see (``RunInfo.cluster``)."""
        return ClusterInfo(mode=self.mode, workers=self.workers,  # type: ignore[arg-type]
                           servers=self.servers, backend=backend,
                           bucket_bytes=self.bucket_bytes, timeout_s=self.timeout_s,
                           bandwidth_bps=self.bandwidth_bps, latency_s=self.latency_s,
                           topology=self.network,
                           link_bandwidth_bps=tuple(s.bandwidth_bps for s in self.links())
                           if self.network == "hosts" else ())


@dataclass(frozen=True)
class BackendChoice:
    """The process-group backend a run's ranks use, and why when it is not the obvious one."""

    backend: str
    """``gloo`` or ``nccl``: never ``auto``."""
    note: str | None = None
    """One line for the run's banner when ``auto`` chose gloo although CUDA is there."""


def choose_backend(settings: ClusterSettings, device: str, *, local_ranks: int,
                   cuda_devices: int) -> BackendChoice:
    """Resolve ``cluster.backend`` for ``local_ranks`` ranks on a machine with
    ``cuda_devices`` GPUs, ``device`` being ``run.device``.

    Why a rule and not simply "NCCL when CUDA is there": NCCL allows one rank per GPU in a
    communicator (it fails "Duplicate GPU detected" at the first collective), so ranks that
    would share a GPU cannot use it. ``auto`` then runs them on CPU over gloo and says so;
    an explicit ``nccl`` or ``run.device=cuda`` that cannot hold is refused before any
    process starts, naming the fix."""
    gpus = f"{cuda_devices} CUDA device" + ("s" if cuda_devices != 1 else "")
    ranks = f"{local_ranks} rank" + ("s" if local_ranks != 1 else "")
    fit = ("cluster.workers" + (" + cluster.servers" if settings.mode == "ps" else "")
           + f" <= {cuda_devices}")
    if device.startswith("cuda") and cuda_devices == 0:
        raise ConfigError(f"run.device={device} but no CUDA device is available; use "
                          "run.device=cpu or auto")
    if settings.backend == "nccl":
        if device == "cpu" or cuda_devices == 0:
            raise ConfigError(
                "cluster.backend=nccl needs CUDA devices"
                + (" and run.device=cpu asks for none" if device == "cpu"
                   else ", and none is available") + "; use cluster.backend=gloo or auto")
        if local_ranks > cuda_devices:
            raise ConfigError(
                f"cluster.backend=nccl: {ranks} on this machine but {gpus}, and NCCL needs "
                f"one device per rank; set {fit} or cluster.backend=gloo")
        return BackendChoice("nccl")
    if settings.backend == "gloo" and device.startswith("cuda"):
        raise ConfigError(f"run.device={device} with cluster.backend=gloo: gloo's ranks run on "
                          "CPU; use cluster.backend=auto or nccl, or run.device=cpu")
    if settings.backend == "gloo" or device == "cpu" or cuda_devices == 0:
        return BackendChoice("gloo")
    if local_ranks <= cuda_devices:
        return BackendChoice("nccl")
    if device != "auto":
        raise ConfigError(
            f"run.device={device} in a cluster run: {ranks} on this machine but {gpus}, and "
            f"NCCL needs one device per rank; set {fit}, or run.device=auto to run the "
            "ranks on CPU over gloo")
    return BackendChoice("gloo", (
        f"cluster: {ranks} share {gpus} and NCCL needs one device per rank, so the ranks "
        f"run on CPU over gloo ({fit} puts them on the GPU)"))


def bucket_bytes(cluster: Any) -> int:
    """``cluster.bucket_mb`` in bytes (also the buckets a one-process job records)."""
    return max(1, int(cluster_number(cluster, "bucket_mb") * 2**20))


_MODE_USES: dict[str, tuple[str, ...]] = {
    "none": ("bucket_mb",),
    "allreduce": ("workers", "backend", "bucket_mb", "timeout_s", "master_port", "network"),
}
"""The ``cluster`` keys each mode reads (a mode not named here, ``ps``, reads them all):
one process has no ranks, no process group and no links; all-reduce has no servers."""

_WHY_UNUSED = {
    "none": "cluster.mode=none runs one process (no ranks, no process group, no links); "
            "set cluster.mode=ps or cluster.mode=allreduce to use {them}",
    "allreduce": "cluster.mode=allreduce has no parameter servers (every rank is a worker); "
                 "set cluster.mode=ps to use {them}",
}


def unused_settings(cluster: Any) -> str | None:
    """One line naming the ``cluster`` keys set away from their defaults that this mode does
    not read, or ``None``. Why: ``cluster.network.bandwidth=100mbit`` on a one-process run
    shaped nothing and said nothing, so a run could be read as measured on a link it never
    had. A warning and not a refusal: a sweep over ``cluster.mode=none,ps`` with one
    bandwidth, or an experiment file's cluster run repeated with ``cluster.mode=none``, are
    meant (the workload and experiment files set these keys too)."""
    from accelopt.config import ClusterConfig

    mode = str(cluster.mode)
    uses = _MODE_USES.get(mode)
    if uses is None:
        return None
    defaults = ClusterConfig()
    unused = []
    for key, default in vars(defaults).items():
        if key == "mode" or key in uses:
            continue
        if key == "network":
            network = cluster.get("network") or {}
            unused += [f"cluster.network.{name}={network.get(name)}"
                       for name, value in vars(default).items()
                       if network.get(name, value) not in (value, None, "", {})]
        elif cluster.get(key, default) != default:
            unused.append(f"cluster.{key}={cluster.get(key)}")
    if not unused:
        return None
    them = "it" if len(unused) == 1 else "them"
    verb = "has" if len(unused) == 1 else "have"
    return f"{', '.join(unused)} {verb} no effect: " + _WHY_UNUSED[mode].format(them=them)


def local_info(cluster: Any) -> ClusterInfo:
    """``RunInfo.cluster`` of a one-process run (``cluster.mode=none``)."""
    return ClusterInfo(mode="none", workers=1, servers=0, backend="none",
                       bucket_bytes=bucket_bytes(cluster),
                       timeout_s=cluster_number(cluster, "timeout_s"))


def settings_from(cluster: Any) -> ClusterSettings:
    mode = str(cluster.mode)
    if mode not in MODES:
        raise ConfigError(
            f"cluster.mode: {mode!r} is not a distributed mode; use one of {', '.join(MODES)} "
            "(or none for one process)"
        )
    workers, servers = int(cluster.workers), int(cluster.servers)
    if workers < 1:
        raise ConfigError(f"cluster.workers must be >= 1, got {workers}")
    if mode == "ps" and servers < 1:
        raise ConfigError(f"cluster.servers must be >= 1 in ps mode, got {servers}")
    if workers + (servers if mode == "ps" else 0) > MAX_RANKS:
        raise ConfigError(f"cluster.workers + cluster.servers must be at most {MAX_RANKS} (one "
                          f"process each, with its own torch), got {workers} + "
                          f"{servers if mode == 'ps' else 0}; lower them")
    backend = str(cluster.backend)
    if backend not in BACKENDS:
        raise ConfigError(f"cluster.backend: {backend!r} unknown; use one of {', '.join(BACKENDS)}")
    check_numbers(cluster)
    port = int(cluster.master_port)
    if not 0 <= port < 65536:
        raise ConfigError(f"cluster.master_port must be in 0..65535 (0: pick a free one), got {port}")
    network = cluster.get("network") or {}
    bandwidth, latency = network.get("bandwidth"), network.get("latency")
    topology = str(network.get("topology") or "shared")
    if topology not in TOPOLOGIES:
        raise ConfigError(
            f"cluster.network.topology: {topology!r} unknown; use shared (one shaped loopback) "
            "or hosts (one network namespace per rank, a link each)"
        )
    settings = ClusterSettings(
        mode=mode,
        workers=workers,
        servers=servers if mode == "ps" else 0,
        backend=backend,
        bucket_bytes=bucket_bytes(cluster),
        timeout_s=cluster_number(cluster, "timeout_s"),
        master_port=port,
        bandwidth_bps=None if bandwidth in (None, "") else parse_rate(bandwidth),
        latency_s=None if latency in (None, "") else parse_duration(latency),
        topology=topology,
    )
    links = network.get("links") or {}
    if not links:
        return settings
    if not isinstance(links, Mapping):
        raise ConfigError(
            f"cluster.network.links: {links!r} is not a mapping; write e.g. "
            "'cluster.network.links={worker1:25mbit}'"
        )
    if topology != "hosts":
        raise ConfigError(
            "cluster.network.links gives links their own bandwidth, which needs "
            "cluster.network.topology=hosts (in the shared topology every rank shares one "
            "loopback)"
        )
    per_rank = {_link_rank(str(key), settings): parse_rate(value, f"cluster.network.links.{key}")
                for key, value in links.items()}
    return replace(settings, link_bandwidth_bps=tuple(sorted(per_rank.items())))


def _link_rank(key: str, settings: ClusterSettings) -> int:
    """``worker1`` / ``server0`` / ``3`` (a rank) -> the rank."""
    names = {settings.link_name(r): r for r in range(settings.world_size)}
    match = _LINK.match(key.strip())
    rank = None
    if match and match.group(3) is not None:
        rank = int(match.group(3))
    elif match:
        rank = names.get(key.strip())
    if rank is None or not 0 <= rank < settings.world_size:
        raise ConfigError(
            f"cluster.network.links: no rank {key!r} in this run; name one of "
            f"{', '.join(names)} (or a rank 0..{settings.world_size - 1})"
        )
    return rank
