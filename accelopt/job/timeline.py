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
        self.start = 0.0
        self.iteration = 0

    def begin(self, name: str, iteration: int) -> None:
        self.name, self.iteration, self.start = name, iteration, self.clock()

    def end(self) -> None:
        if self.name is not None:
            self.record(self.name, "compute", self.start, self.clock(), "compute",
                        iteration=self.iteration)
        self.name = None

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

    def begin(self, name: str, iteration: int) -> None:
        pass

    def end(self) -> None:
        pass

    def wait(self, label: str, until: Callable[[], Any]) -> None:
        until()


NO_TIMER = _NoTimer()
