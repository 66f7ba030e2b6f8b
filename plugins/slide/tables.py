"""LSH hash tables: L tables x 2**range_pow buckets of fixed capacity, and rebuild schedules.

Each table is written by exactly one thread (``prange`` over tables), neurons are inserted in
id order and the reservoir's random numbers come from a per-table seeded xorshift, so a
(re)build is deterministic whatever the thread count. ``counts`` keeps the number of inserts
a bucket has seen (a FIFO ring holds the last ``capacity`` of them; a reservoir keeps a
uniform sample of them); a bucket's valid entries are ``min(count, capacity)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

INSERTIONS: dict[str, int] = {"fifo": 0, "reservoir": 1}
SCHEDULES = ("fixed", "decay", "changed")


@njit(cache=True, inline="always")
def xorshift(state):
    """One step of xorshift64*; returns (new_state, random uint64)."""
    state ^= state >> np.uint64(12)
    state ^= state << np.uint64(25)
    state ^= state >> np.uint64(27)
    return state, state * np.uint64(2685821657736338717)


@njit(parallel=True, cache=True)
def build_tables(keys, tables, counts, reservoir, seed):
    """Fill every table from neuron keys (int32 [n, L]); one writer per table."""
    n = keys.shape[0]
    n_tables, _, cap = tables.shape
    for t in prange(n_tables):
        counts[t, :] = 0
        state = np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(t + 1)
        for i in range(n):
            b = keys[i, t]
            c = counts[t, b]
            if c < cap:
                tables[t, b, c] = i
            elif reservoir:
                state, r = xorshift(state)
                slot = r % np.uint64(c + 1)
                if slot < np.uint64(cap):
                    tables[t, b, slot] = i
            else:
                tables[t, b, c % cap] = i
            counts[t, b] = c + 1


def bucket_fill(counts: np.ndarray, capacity: int) -> dict[str, float]:
    """Occupancy statistics (for reports): mean entries per non-empty bucket, overflow share."""
    valid = np.minimum(counts, capacity)
    nonempty = valid > 0
    return {
        "nonempty_buckets": float(nonempty.mean()),
        "mean_fill": float(valid[nonempty].mean()) if nonempty.any() else 0.0,
        "overflowed": float((counts > capacity).mean()),
    }


@dataclass
class RebuildSchedule:
    """When to rebuild the tables.

    * ``fixed``: every ``period`` steps (the SLIDE code: 50);
    * ``decay``: gaps grow geometrically, ``period * growth**r`` after the r-th rebuild, capped
      at ``max_period`` (the paper's exponentially decaying rebuild frequency);
    * ``changed``: every ``period`` steps, rehash the neurons updated since the last build
      and rebuild only if more than ``change_threshold`` of all neurons changed a key
      (MONGOOSE's change-triggered rehashing).
    """

    kind: str = "fixed"
    period: int = 50
    growth: float = 1.5
    max_period: int = 2000
    change_threshold: float = 0.05
    next_at: int = 0
    rebuilds: int = 0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"rebuild schedule must be one of {', '.join(SCHEDULES)}")
        if self.period < 1:
            raise ValueError(f"rebuild period must be >= 1, got {self.period}")
        self.next_at = self.period

    def due(self, step: int) -> bool:
        """True when ``step`` (batches done) reaches the next rebuild or check point."""
        return step >= self.next_at

    def done(self, step: int, rebuilt: bool) -> None:
        """Record the decision taken at ``step`` and plan the next point."""
        if rebuilt:
            self.rebuilds += 1
        gap = self.period
        if self.kind == "decay":
            gap = self._decayed_gap()
        self.next_at = step + max(gap, 1)

    def _decayed_gap(self) -> int:
        """``period * growth**rebuilds`` capped at ``max_period``, compared in log space:
        the power itself overflowed (OverflowError) after enough rebuilds or a huge growth."""
        if self.growth > 1.0 and self.rebuilds * math.log(self.growth) >= math.log(
                max(self.max_period, 1) / self.period):
            return int(self.max_period)
        return int(min(self.max_period, round(self.period * self.growth**self.rebuilds)))
