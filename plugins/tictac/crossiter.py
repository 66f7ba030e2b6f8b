"""Discrete-event simulation of parameter-server *training* across iterations: the DAG
simulator (``simulate.py``) models one iteration with every parameter at the server at t = 0,
which cannot express the schedule priority scheduling changes, the one that crosses the
iteration boundary (a tensor updated early and sent while the last gradients are still on
the link).

The machine: one server, ``workers`` identical workers (one is simulated; every transfer is
all workers' copies back to back, so the server's link carries ``workers`` times its bytes),
and links as the cluster has them: ``shared`` (one bus for every byte, both directions:
the shaped loopback) or ``hosts`` (the server's link, full duplex: parameters down and
gradients up do not compete).

One iteration of a worker: forward in program order, each op once the parameters it reads
have arrived; backward in program order, a tensor's gradient posted when the last backward
op that touches it ends (the backward of its first forward user); then the next forward. The
server: with the default schedule, once every gradient of an iteration is in, one optimizer
step over all tensors, then every parameter posted in the transport's default (named) order;
with the early update, each tensor updated the moment its gradient is in (one update at a
time) and posted at once; a tensor's update costs the server ``tensor_s`` plus its bytes
at the update rate. A link sends the posted transfers first-posted first (the
transport's default; priority scheduling without a window), or, with a window, the
highest-priority posted transfer whenever it is free: parameters by the plan's order,
gradients first layer first; with partitioning a transfer goes as chunks that each compete
for the link with their tensor's priority. A unit on the link takes ``workers x (bytes /
bytes_per_s + message_s)``. Between two senders on one bus, the earlier posted goes first
(the kernel's queue).

What it does not model: the cores the ranks share (the server's updates, the early
parameters' arrival and the kernel's network work compete with the workers' backward on a
small machine), the bytes the window lets into the kernel's queue ahead of a better
transfer, and stragglers. ``measured.py`` reads from a real run the facts the oracle cannot
know (the forward/backward split, the per-transfer cost, the server's turnaround).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from accelopt_plugins.tictac.dag import RECV, Dag
from accelopt_plugins.tictac.measured import Measured


@dataclass(frozen=True)
class Schedule:
    """What a run does with its transfers: the default (no plugin) is all False / 0."""

    early_update: bool = False
    """The server updates each tensor as its gradient arrives and posts it at once."""
    by_priority: bool = False
    """A window: the link takes the best posted transfer, not the first posted."""
    partition_bytes: int = 0
    """Chunks of at most this many bytes (0: whole tensors)."""


DEFAULT = Schedule()


@dataclass
class Workload:
    """The facts the simulation needs, in the DAG's recv indices."""

    forward_s: list[float]
    backward_s: list[float]
    reads: list[list[int]]
    """Per forward op (program order): the recvs it reads."""
    grad_after: list[int]
    """Per recv: the backward op (index into ``backward_s``) whose end completes its
    gradient (-1: none reads it; the gradient is posted when backward ends)."""
    nbytes: list[int]
    param_priority: list[int]
    """Per recv: its rank in the parameters' priority order (0 first)."""

    @classmethod
    def from_dag(cls, dag: Dag, times: np.ndarray, order: Sequence[int]) -> Workload:
        """From a training DAG (``training_dag``) and its op times; ``order`` ranks the
        parameters (the plan's, e.g. TAC's)."""
        recv_index = {op: r for r, op in enumerate(dag.recvs)}
        backward = [op for op in dag.program if op in dag.backward_of]
        forward = [op for op in dag.program if op not in dag.backward_of]
        bwd_at = {dag.backward_of[op]: k for k, op in enumerate(backward)}
        reads: list[list[int]] = []
        first_user: dict[int, int] = {}
        for op in forward:
            rs = [recv_index[i] for i in dag.inputs[op] if dag.kinds[i] == RECV]
            reads.append(rs)
            for r in rs:
                first_user.setdefault(r, op)
        grad_after = [bwd_at.get(first_user[r], len(backward) - 1) if r in first_user else -1
                      for r in range(len(dag.recvs))]
        rank = {int(r): k for k, r in enumerate(order)}
        return cls([float(times[op]) for op in forward], [float(times[op]) for op in backward],
                   reads, grad_after, [int(dag.nbytes[op]) for op in dag.recvs],
                   [rank.get(r, len(rank) + r) for r in range(len(dag.recvs))])

    def problem(self) -> str:
        """Why these inputs cannot be simulated ('' : they can)."""
        n = len(self.nbytes)
        if not self.forward_s:
            return "the workload has no compute ops: nothing to simulate"
        if len(self.reads) != len(self.forward_s):
            return f"{len(self.reads)} read lists for {len(self.forward_s)} forward ops"
        if len(self.grad_after) != n or len(self.param_priority) != n:
            return (f"{len(self.grad_after)} gradients and {len(self.param_priority)} "
                    f"priorities for {n} parameters")
        bad = next((r for rs in self.reads for r in rs if not 0 <= r < n), None)
        if bad is not None:
            return f"an op reads parameter {bad}, the workload has {n}"
        if any(not -1 <= k < len(self.backward_s) for k in self.grad_after):
            return "a gradient is completed by a backward op that does not exist"
        return ""

    @property
    def compute_s(self) -> float:
        return sum(self.forward_s) + sum(self.backward_s)

    def with_compute(self, seconds: float) -> Workload:
        """The same workload with every op scaled so one iteration computes ``seconds``: the
        oracle times each op alone and at its fastest, a worker in a run is slower (its
        per-layer hooks, the cores it shares), so a run's measured compute calibrates it."""
        k = seconds / self.compute_s if self.compute_s > 0 else 1.0
        return dataclasses.replace(self, forward_s=[t * k for t in self.forward_s],
                                   backward_s=[t * k for t in self.backward_s])

    def with_phases(self, forward_s: float, backward_s: float) -> Workload:
        """The same workload with forward and backward each scaled to what a run measured:
        in a run, backward also posts every gradient, so the split moves, not only the sum."""
        def scaled(times: list[float], total: float) -> list[float]:
            have = sum(times)
            return [t * total / have for t in times] if have > 0 else times
        return dataclasses.replace(self, forward_s=scaled(self.forward_s, forward_s),
                                   backward_s=scaled(self.backward_s, backward_s))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        return cls(**data)


@dataclass
class Link:
    """The link-level facts: rate, per-message cost, workers, topology."""

    bytes_per_s: float
    message_s: float = 0.0
    workers: int = 1
    shared: bool = True
    """One bus for both directions (the shaped loopback), else the server's full-duplex link."""
    update_bytes_per_s: float = 2e9
    """The server's optimizer over a tensor's bytes (its per-tensor update time)."""
    tensor_s: float = 0.0
    """The server's fixed cost per tensor it averages, updates and posts (the Python around
    each update and send), paid in both schedules: one whole step costs
    ``n x tensor_s + bytes / update_bytes_per_s``."""


@dataclass
class Simulated:
    """One simulated run: every iteration's forward start, and the steady iteration time."""

    starts: list[float]
    iteration_s: float
    """Mean time between forward starts after ``warmup`` iterations."""
    link_busy_s: float
    """Busy time of the busiest link over the same window, per iteration."""


@dataclass(order=True)
class _Unit:
    key: tuple
    kind: str = field(compare=False)  # "param" | "grad"
    iteration: int = field(compare=False)
    recv: int = field(compare=False)
    nbytes: int = field(compare=False)
    last: bool = field(compare=False)


class _Sim:
    def __init__(self, work: Workload, link: Link, schedule: Schedule,
                 iterations: int) -> None:
        self.w, self.link, self.s, self.n = work, link, schedule, iterations
        self.t = 0.0
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = 0
        n_recv = len(work.nbytes)
        self.arrived = [[False] * n_recv for _ in range(iterations)]
        self.grads_in = [0] * iterations
        # senders' queues, and which link each uses
        self.queues: dict[str, list[_Unit]] = {"param": [], "grad": []}
        self.links = ["bus"] if link.shared else ["down", "up"]
        self.link_of = ({"param": "bus", "grad": "bus"} if link.shared
                        else {"param": "down", "grad": "up"})
        self.link_free = {name: True for name in self.links}
        self.busy: dict[str, list[tuple[float, float]]] = {name: [] for name in self.links}
        self.server_free_at = 0.0
        self.starts: list[float] = []
        self.it, self.op, self.computing = 0, 0, False
        self.ops = len(work.forward_s) + len(work.backward_s)
        self.grads_of: dict[int, list[int]] = {}
        for r, k in enumerate(work.grad_after):
            self.grads_of.setdefault(k if k >= 0 else len(work.backward_s) - 1, []).append(r)

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn))

    def run(self) -> None:
        self.post_params(0, range(len(self.w.nbytes)))
        self.try_compute()
        while self.events:
            self.t, _, fn = heapq.heappop(self.events)
            fn()

    # -- transfers ---------------------------------------------------------------------------

    def post(self, kind: str, iteration: int, recv: int) -> None:
        nbytes = self.w.nbytes[recv]
        part = self.s.partition_bytes if self.s.by_priority else 0
        chunks = max(1, -(-nbytes // part)) if part and nbytes > part else 1
        size = -(-nbytes // chunks)
        prio = self.w.param_priority[recv] if kind == "param" else recv
        for c in range(chunks):
            self.seq += 1
            key = (prio, self.t, self.seq) if self.s.by_priority else (self.t, self.seq)
            heapq.heappush(self.queues[kind], _Unit(
                key, kind, iteration, recv, min(size, nbytes - c * size), c == chunks - 1))
        self.pump(self.link_of[kind])

    def post_params(self, iteration: int, recvs: Sequence[int]) -> None:
        if iteration < self.n:
            for r in recvs:
                self.post("param", iteration, r)

    def pump(self, name: str) -> None:
        if not self.link_free[name]:
            return
        heads = [q[0] for kind, q in self.queues.items() if q and self.link_of[kind] == name]
        if not heads:
            return
        unit = min(heads, key=lambda u: (u.key[-2], u.key[-1]))  # between senders: FIFO
        heapq.heappop(self.queues[unit.kind])
        lk = self.link
        dur = lk.workers * (unit.nbytes / lk.bytes_per_s + lk.message_s)
        self.link_free[name] = False
        start = self.t
        self.busy[name].append((start, start + dur))

        def done() -> None:
            self.link_free[name] = True
            if unit.last:
                (self.param_in if unit.kind == "param" else self.grad_in)(unit)
            self.pump(name)

        self.at(start + dur, done)

    def param_in(self, unit: _Unit) -> None:
        self.arrived[unit.iteration][unit.recv] = True
        self.try_compute()

    def grad_in(self, unit: _Unit) -> None:
        i, r = unit.iteration, unit.recv
        self.grads_in[i] += 1
        w, lk = self.w, self.link
        if self.s.early_update:
            start = max(self.t, self.server_free_at)
            self.server_free_at = start + lk.tensor_s + w.nbytes[r] / lk.update_bytes_per_s
            self.at(self.server_free_at, lambda: self.post_params(i + 1, [r]))
        elif self.grads_in[i] == len(w.nbytes):
            start = max(self.t, self.server_free_at)
            self.server_free_at = (start + len(w.nbytes) * lk.tensor_s
                                   + sum(w.nbytes) / lk.update_bytes_per_s)
            self.at(self.server_free_at,
                    lambda: self.post_params(i + 1, range(len(w.nbytes))))

    # -- the worker ----------------------------------------------------------------------------

    def try_compute(self) -> None:
        if self.computing or self.it >= self.n:
            return
        w, k = self.w, self.op
        forward = k < len(w.forward_s)
        if forward and not all(self.arrived[self.it][r] for r in w.reads[k]):
            return  # waits: an arrival calls again
        if k == 0:
            self.starts.append(self.t)
        dur = w.forward_s[k] if forward else w.backward_s[k - len(w.forward_s)]
        self.computing = True

        def done() -> None:
            self.computing = False
            if not forward:
                for r in self.grads_of.get(k - len(w.forward_s), []):
                    self.post("grad", self.it, r)
            self.op += 1
            if self.op == self.ops:
                self.it, self.op = self.it + 1, 0
            self.try_compute()

        self.at(self.t + dur, done)


def simulate(work: Workload, link: Link, schedule: Schedule = DEFAULT, *,
             iterations: int = 10, warmup: int = 2) -> Simulated:
    """Simulate ``iterations`` iterations; the steady iteration time excludes the first
    ``warmup`` (the first pull has nothing to overlap with)."""
    if iterations < warmup + 2:
        raise ValueError(f"simulate needs iterations >= warmup + 2, got {iterations}")
    problem = work.problem()
    if problem:
        raise ValueError(problem)
    sim = _Sim(work, link, schedule, iterations)
    sim.run()
    starts = sim.starts
    lo, hi = starts[warmup], starts[-1]
    steady = (hi - lo) / (len(starts) - 1 - warmup)
    busiest = max(sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in spans)
                  for spans in sim.busy.values())
    return Simulated(starts, steady, busiest / (len(starts) - 1 - warmup))


def predict(work: Workload, link: Link,
            candidates: Sequence[Any]) -> tuple[dict[Any, float], dict[str, Any]]:
    """The steady iteration of the default (``None``) and of each priority candidate (a
    window with ``credit_bytes``, ``partition_bytes`` and ``key``: the early update, by
    priority where there is a window, chunked), and their inputs as :func:`saved` keeps
    them."""
    seconds: dict[Any, float] = {}
    schedules: dict[str, Schedule] = {}
    for candidate in dict.fromkeys((None, *candidates)):
        schedule = DEFAULT if candidate is None else Schedule(
            early_update=True, by_priority=candidate.credit_bytes > 0,
            partition_bytes=candidate.partition_bytes)
        schedules["off" if candidate is None else candidate.key] = schedule
        seconds[candidate] = simulate(work, link, schedule).iteration_s
    return seconds, saved(work, link, schedules)


def saved(work: Workload, link: Link, schedules: dict[str, Schedule]) -> dict[str, Any]:
    """A prediction's inputs as JSON (the plugin's ``plan-rank<r>.json``), so it can be
    simulated again, e.g. with a run's measured compute (:func:`resimulate`)."""
    return {"workload": work.to_dict(), "link": dataclasses.asdict(link),
            "schedules": {name: dataclasses.asdict(s) for name, s in schedules.items()}}


def resimulate(data: dict[str, Any], schedule: str, compute_s: float | None = None,
               measured: Measured | None = None) -> Simulated:
    """Simulate a saved prediction's ``schedule`` again: with the compute per iteration set
    to ``compute_s`` when given (every op scaled alike), or with what a run ``measured``
    (:func:`calibrated`)."""
    work, link = calibrated(data, measured)
    if measured is None and compute_s is not None:
        work = work.with_compute(compute_s)
    return simulate(work, link, Schedule(**data["schedules"][schedule]))


def calibrated(data: dict[str, Any], measured: Measured | None = None) -> tuple[Workload, Link]:
    """A saved prediction's workload and link, with what a run ``measured``
    (:mod:`~accelopt_plugins.tictac.measured`) where given: forward and backward scaled
    apart, the per-transfer cost, and the server's turnaround less its update time spread
    over its tensors as ``tensor_s``. Simulate any :class:`Schedule` on them."""
    work = Workload.from_dict(data["workload"])
    link = Link(**data["link"])
    if measured is not None:
        work = work.with_phases(measured.forward_s, measured.backward_s)
        update_s = sum(work.nbytes) / link.update_bytes_per_s
        link = dataclasses.replace(
            link, message_s=measured.message_s,
            tensor_s=max(0.0, measured.server_s - update_s) / max(1, len(work.nbytes)))
    return work, link
