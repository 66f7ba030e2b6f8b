"""Priority scheduling's credit window, chosen by measurement inside the run.

ByteScheduler tuned its partition size and credit by Bayesian optimisation over measured
iteration times. With one setting to choose and a few candidates, measuring each in turn is
enough, and it is the self-limiting rule too: the candidates include *off* (the transport's
default order and the server's whole step, what the run does without the plugin), so where
cross-iteration scheduling does not pay (on this machine, where the link's kernel work and
the server's updates compete with the workers' compute for the same cores) the run keeps
the default and the row says so with the measured times.

The schedule: after the warm-up (``start``), each candidate in turn for ``block`` iterations,
the whole sequence ``rounds`` times (interleaved, so drift of the machine's speed hits every
candidate alike). Only the last iterations of a block are timed: a block's first iteration
still carries its predecessor's mode (an early update sends the next iteration's parameters
before that iteration begins). The choice is the candidate with the smallest median timed
iteration; it is made once every timed iteration has ended, so the iteration that starts
before the last one has ended keeps the last block's candidate.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

OFF = None
"""The candidate that schedules nothing: the default order, the whole optimizer step."""

Candidate = int | None
"""A credit window in bytes, or :data:`OFF`."""


@dataclass
class CreditTuner:
    """One plugin instance's tuner (each rank measures its own iterations)."""

    candidates: tuple[Candidate, ...]
    start: int
    block: int = 2
    rounds: int = 2
    seconds: dict[int, float] = field(default_factory=dict)
    chosen: Candidate = OFF
    decided: bool = False

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("CreditTuner needs at least one candidate")
        self.block = max(1, self.block)
        self.rounds = max(1, self.rounds)
        if len(self.candidates) == 1:  # nothing to measure: that one from the start
            self.chosen, self.decided = self.candidates[0], True

    @classmethod
    def for_config(cls, config: Any) -> CreditTuner:
        """The tuner ``plugins.tictac`` asks for (``credit_bytes``, ``tune_credits``,
        ``tune_block``, ``tune_rounds``, ``force``; from ``replan_iteration`` on)."""
        return cls(candidates_from(config.credit_bytes, config.tune_credits, config.force),
                   start=config.replan_iteration, block=config.tune_block,
                   rounds=config.tune_rounds)

    @property
    def end(self) -> int:
        """The first iteration after the tuning window."""
        return self.start + len(self.candidates) * self.block * self.rounds

    def _slot(self, iteration: int) -> tuple[Candidate, bool]:
        """(candidate, timed) of a tuning iteration."""
        offset = iteration - self.start
        which = (offset // self.block) % len(self.candidates)
        return self.candidates[which], self.block == 1 or offset % self.block != 0

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
        n = self.rounds * max(1, self.block - 1) if self.block > 1 else self.rounds
        return (f"measured over {window} (median of {n} timed iterations each): "
                f"{', '.join(parts)}; chose {label(self.chosen)}")


def label(candidate: Candidate) -> str:
    return "off (default order, whole step)" if candidate is OFF else f"credit {candidate} B"


def candidates_from(credit_bytes: int, tune_credits: Sequence[int],
                    force: bool) -> tuple[Candidate, ...]:
    """``credit_bytes >= 0``: that window only; ``-1``: tune over ``tune_credits``, and
    *off* first unless ``force``."""
    if credit_bytes >= 0:
        return (int(credit_bytes),)
    tuned = tuple(int(c) for c in tune_credits)
    return tuned if force else (OFF, *tuned)
