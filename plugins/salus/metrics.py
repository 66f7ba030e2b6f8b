"""Sharing metrics: switch latency, device busy fraction, Jain's fairness, oracle SRPT.

Pure functions over recorded intervals, so the plugin, the service and the benchmarks compute
every figure the same way and tests can check them against hand-computed cases.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from accelopt.drivers.cluster.metrics import union_length


@dataclass(frozen=True)
class Interval:
    """One iteration of one job in one lane (seconds since the run started)."""

    job_id: str
    lane: str
    start_s: float
    end_s: float


def union_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of intervals (overlaps counted once)."""
    return union_length(intervals)


def busy_fraction(intervals: Sequence[Interval], start_s: float, end_s: float) -> float | None:
    """Fraction of [start, end] during which at least one iteration ran on the device."""
    span = end_s - start_s
    if span <= 0:
        return None
    return union_seconds([(i.start_s, i.end_s) for i in intervals]) / span


def jain(values: Sequence[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 = equal shares, 1/n = one takes all."""
    if not values:
        return None
    squares = sum(v * v for v in values)
    if squares == 0:
        return None
    return sum(values) ** 2 / (len(values) * squares)


def contention_fairness(
    intervals: Sequence[Interval],
    active: dict[str, tuple[float, float]],
    window_s: float,
) -> tuple[float | None, int]:
    """Mean Jain index of per-job service over windows in which >= 2 jobs were resident.

    ``active[job] = (admitted_s, left_s)``. A window counts only if at least two jobs were
    resident for the whole window (they all wanted the device); each such job's share is the
    iteration time it received inside the window. Returns (mean index, number of windows).
    """
    if window_s <= 0 or not active:
        return None, 0
    t0 = min(a for a, _ in active.values())
    t1 = max(b for _, b in active.values())
    indices = []
    t = t0
    while t + window_s <= t1 + 1e-12:
        w0, w1 = t, t + window_s
        resident = [j for j, (a, b) in active.items() if a <= w0 and b >= w1]
        if len(resident) >= 2:
            share = dict.fromkeys(resident, 0.0)
            for it in intervals:
                if it.job_id in share:
                    share[it.job_id] += max(0.0, min(it.end_s, w1) - max(it.start_s, w0))
            index = jain(list(share.values()))
            if index is not None:
                indices.append(index)
        t = w1
    if not indices:
        return None, 0
    return sum(indices) / len(indices), len(indices)


@dataclass(frozen=True)
class OracleJob:
    job_id: str
    arrival_s: float
    length_s: float


def oracle_srpt(jobs: Sequence[OracleJob]) -> dict[str, float]:
    """Completion times under preemptive shortest-remaining-processing-time on ONE server
    with exact job lengths and free preemption: the optimum for average JCT (Schrage 1968).

    Returns ``{job_id: completion time}`` (same clock as the arrivals).
    """
    order = sorted(jobs, key=lambda j: (j.arrival_s, j.job_id))
    heap: list[tuple[float, float, str]] = []  # (remaining, arrival, id)
    done: dict[str, float] = {}
    now = 0.0
    i = 0
    while i < len(order) or heap:
        if not heap:
            now = max(now, order[i].arrival_s)
        while i < len(order) and order[i].arrival_s <= now:
            heapq.heappush(heap, (order[i].length_s, order[i].arrival_s, order[i].job_id))
            i += 1
        remaining, arrival, job_id = heapq.heappop(heap)
        next_arrival = order[i].arrival_s if i < len(order) else math.inf
        if now + remaining <= next_arrival:
            now += remaining
            done[job_id] = now
        else:
            heapq.heappush(heap, (remaining - (next_arrival - now), arrival, job_id))
            now = next_arrival
    return done


def oracle_average_jct(jobs: Sequence[OracleJob]) -> float:
    finish = oracle_srpt(jobs)
    return sum(finish[j.job_id] - j.arrival_s for j in jobs) / len(jobs)
