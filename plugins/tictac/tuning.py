"""Priority scheduling's credit window and partition size, chosen by measurement inside the
run.

ByteScheduler tuned its partition size and credit by Bayesian optimisation over measured
iteration times. With two settings and a few candidates each (their grid), measuring each
pair in turn is enough, and it is the self-limiting rule too: the candidates include *off* (the transport's
default order and the server's whole step, what the run does without the plugin), so where
cross-iteration scheduling does not pay (on this machine, where the link's kernel work and
the server's updates compete with the workers' compute for the same cores) the run keeps
the default and the row says so with the measured times.

The schedule: after the warm-up (``start``, counted from the first iteration the run
executes, so a resumed run tunes as an uninterrupted one does), each candidate in turn for
``block`` iterations, the whole sequence ``rounds`` times (interleaved, so drift of the
machine's speed hits every candidate alike). Only the last iterations of a block are
timed: a block's first iteration still carries its predecessor's mode (an early update sends
the next iteration's parameters before that iteration begins), so a block is 2 iterations at
least. The choice is the candidate with the smallest median timed iteration; it is made once
every timed iteration has ended, so the iteration that starts before the last one has ended
keeps the last block's candidate.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

OFF = None
"""The candidate that schedules nothing: the default order, the whole optimizer step."""


@dataclass(frozen=True, order=True)
class Window:
    """One setting of priority scheduling: bytes in flight per link before the next transfer
    by priority starts, and the largest chunk a payload goes as (0: whole tensors)."""

    credit_bytes: int
    partition_bytes: int = 0

    @property
    def key(self) -> str:
        """The metric-name fragment of this setting (``credit_65536``, ``credit_65536_part_262144``)."""
        part = f"_part_{self.partition_bytes}" if self.partition_bytes else ""
        return f"credit_{self.credit_bytes}{part}"


Candidate = Window | None
"""A window, or :data:`OFF`."""


@dataclass
class WindowTuner:
    """One plugin instance's tuner (each rank measures its own iterations)."""

    candidates: tuple[Candidate, ...]
    start: int
    block: int = 2
    rounds: int = 2
    seconds: dict[int, float] = field(default_factory=dict)
    chosen: Candidate = OFF
    decided: bool = False
    first: int = 0
    """The iteration ``start`` counts its warm-up from (:meth:`begin_at`)."""

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("WindowTuner needs at least one candidate")
        # a block's first iteration is not timed: a block of 1 would time nothing (the
        # config refuses it: plugins.tictac.tune_block)
        self.block = max(2, self.block)
        self.rounds = max(1, self.rounds)
        if len(self.candidates) == 1:  # nothing to measure: that one from the start
            self.chosen, self.decided = self.candidates[0], True

    @classmethod
    def for_config(cls, config: Any) -> WindowTuner:
        """The tuner ``plugins.tictac`` asks for (``credit_bytes``, ``tune_credits``,
        ``partition_bytes``, ``tune_partitions``, ``tune_block``, ``tune_rounds``, ``force``;
        ``replan_iteration`` iterations after the run's first on)."""
        return cls(candidates_from(config.credit_bytes, config.tune_credits, config.force,
                                   config.partition_bytes, config.tune_partitions),
                   start=config.replan_iteration, block=config.tune_block,
                   rounds=config.tune_rounds)

    def begin_at(self, first: int) -> None:
        """Count the warm-up from ``first``, the first iteration the run executes: a run
        resumed from a checkpoint starts past 0, and counted from 0 its tuning window would
        be over (or half over) before it began. Ignored once an iteration was measured."""
        if not self.seconds:
            self.start += first - self.first
            self.first = first

    @property
    def end(self) -> int:
        """The first iteration after the tuning window."""
        return self.start + len(self.candidates) * self.block * self.rounds

    def _slot(self, iteration: int) -> tuple[Candidate, bool]:
        """(candidate, timed) of a tuning iteration."""
        offset = iteration - self.start
        which = (offset // self.block) % len(self.candidates)
        return self.candidates[which], offset % self.block != 0

    def candidate(self, iteration: int) -> Candidate:
        """What iteration ``iteration`` runs with."""
        if len(self.candidates) == 1:
            return self.candidates[0]
        if iteration < self.start:
            return OFF  # the warm-up: nothing is measured, nothing is changed
        if iteration < self.end:
            return self._slot(iteration)[0]
        if not self.decided and self._complete():
            self._decide()
        if self.decided:
            return self.chosen
        return self._slot(self.end - 1)[0]  # the last block's, until its time is in

    def record(self, iteration: int, seconds: float) -> None:
        if self.start <= iteration < self.end:
            self.seconds[iteration] = seconds

    def timed(self) -> dict[Candidate, list[float]]:
        """Each candidate's timed iterations so far, in seconds."""
        out: dict[Candidate, list[float]] = {c: [] for c in self.candidates}
        for iteration, s in sorted(self.seconds.items()):
            candidate, timed = self._slot(iteration)
            if timed:
                out[candidate].append(s)
        return out

    def _complete(self) -> bool:
        return all(self._slot(i)[1] is False or i in self.seconds
                   for i in range(self.start, self.end))

    def _decide(self) -> None:
        medians = {c: statistics.median(v) for c, v in self.timed().items() if v}
        self.chosen = min(medians, key=lambda c: (medians[c], c is not OFF))
        self.decided = True

    def describe(self) -> str:
        """The measured medians and the choice, for the report row."""
        parts = []
        for c, values in self.timed().items():
            if values:
                parts.append(f"{label(c)} {1e3 * statistics.median(values):.1f} ms")
        window = f"iterations {self.start}-{self.end - 1}"
        if not self.decided:
            return f"tuning over {window} not finished ({', '.join(parts) or 'nothing timed'})"
        n = self.rounds * (self.block - 1)
        return (f"measured over {window} (median of {n} timed iterations each): "
                f"{', '.join(parts)}; chose {label(self.chosen)}")


def label(candidate: Candidate) -> str:
    if candidate is OFF:
        return "off (default order, whole step)"
    part = (f", chunks of {candidate.partition_bytes} B" if candidate.partition_bytes
            else "")
    return f"credit {candidate.credit_bytes} B{part}"


def candidates_from(credit_bytes: int, tune_credits: Sequence[int], force: bool,
                    partition_bytes: int = 0,
                    tune_partitions: Sequence[int] = (0,)) -> tuple[Candidate, ...]:
    """Each setting ``>= 0`` is used as given, ``-1`` tunes over its list; the grid is
    their product, less the partitioned settings without a window (with no window every
    chunk starts at once: nothing to preempt), and *off* first unless ``force``. One fixed
    setting is that one only (nothing to measure)."""
    credits = [int(credit_bytes)] if credit_bytes >= 0 else [int(c) for c in tune_credits]
    parts = ([int(partition_bytes)] if partition_bytes >= 0
             else [int(p) for p in tune_partitions])
    grid = [Window(c, p) for c, p in itertools.product(credits, parts)]
    if credit_bytes < 0 or partition_bytes < 0:
        grid = [w for w in grid if w.credit_bytes or not w.partition_bytes]
    grid = list(dict.fromkeys(grid))
    if len(grid) == 1 and credit_bytes >= 0 and partition_bytes >= 0:
        return (grid[0],)
    return tuple(grid) if force else (OFF, *grid)
