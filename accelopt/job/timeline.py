"""Compute spans of one job's iterations on a process's timeline (``forward``, ``backward``,
``optimizer`` on the ``compute`` track, waits on the ``wait`` track).

A cluster run needs them for its overlap figures (Mc, Pc, E: ``drivers/cluster/metrics.py``);
a one-process run does not record them (:data:`NO_TIMER`), so its hot path stays free of
bookkeeping. ``pause``/``resume`` cut a span where the process waits (a PS worker waiting for
a layer's parameters), so waiting never counts as compute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Record = Callable[..., None]
"""``record(name, track, start_s, end_s, category, **args)``"""


class PhaseTimer:
    def __init__(self, record: Record, clock: Callable[[], float]) -> None:
        self.record = record
        self.clock = clock
        self.name: str | None = None
        self.track = "compute"
        self.start = 0.0
        self.iteration = 0

    def begin(self, name: str, iteration: int, track: str = "compute") -> None:
        self.name, self.iteration, self.track, self.start = name, iteration, track, self.clock()

    def end(self) -> None:
        if self.name is not None:
            self.record(self.name, self.track, self.start, self.clock(), self.track,
                        iteration=self.iteration)
        self.name = None

    def waiting_from_here(self, label: str) -> None:
        """End the current compute span now and time the rest of it, until :meth:`end`, as
        a wait: after DDP's last bucket is ready, its backward only waits for the
        all-reduce (DDP blocks inside ``backward()`` until every bucket is reduced)."""
        if self.name is not None and self.track == "compute":
            iteration = self.iteration
            self.end()
            self.begin(label, iteration, track="wait")

    def wait(self, label: str, until: Callable[[], Any]) -> None:
        """Run ``until()`` (a blocking wait) as a ``wait`` span cut out of the current one."""
        name = self.name
        self.end()
        start = self.clock()
        until()
        self.record(label, "wait", start, self.clock(), "wait", iteration=self.iteration)
        if name is not None:
            self.begin(name, self.iteration)


class _NoTimer(PhaseTimer):
    """Records nothing (one-process runs)."""

    def __init__(self) -> None:
        super().__init__(lambda *a, **k: None, lambda: 0.0)

    def begin(self, name: str, iteration: int, track: str = "compute") -> None:
        pass

    def end(self) -> None:
        pass

    def waiting_from_here(self, label: str) -> None:
        pass

    def wait(self, label: str, until: Callable[[], Any]) -> None:
        until()


NO_TIMER = _NoTimer()
