"""Communication/computation metrics of a cluster run, from its timeline spans.

Per worker and iteration (TicTac, Hashemi et al. 2019): Mc = union length of the
communication intervals touching that worker, Pc = union length of its compute intervals,
U = makespan (first interval start to last interval end). Without overlap U = Mc + Pc, with
perfect overlap U = max(Mc, Pc), so the scheduling efficiency is
``E = (Mc + Pc - U) / (Mc + Pc - max(Mc, Pc))`` and the ratio ``a = Mc / Pc``.

E is reported as measured, not clamped: idle gaps (Python overhead between a transfer's end
and the next compute) can push it slightly below 0, which is worth seeing.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from accelopt.records import Span

WARMUP_ITERATIONS = 2


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def overlap_metrics(
    comm: Sequence[tuple[float, float]], compute: Sequence[tuple[float, float]]
) -> dict[str, float | None]:
    """Mc, Pc, U, E and a for one worker's iteration."""
    mc, pc = union_length(comm), union_length(compute)
    every = [*comm, *compute]
    makespan = (max(e for _, e in every) - min(s for s, _ in every)) if every else 0.0
    upper, lower = mc + pc, max(mc, pc)
    efficiency = (upper - makespan) / (upper - lower) if upper - lower > 1e-12 else None
    return {
        "mc_s": mc,
        "pc_s": pc,
        "iteration_makespan_s": makespan,
        "efficiency_e": efficiency,
        "ratio_a": mc / pc if pc > 0 else None,
        "speedup_potential_s": (upper - lower) / lower if lower > 0 else None,
    }


def _rank_of(process: str) -> int | None:
    # "rank 3 (worker)" -> 3
    parts = process.split()
    if len(parts) >= 2 and parts[0] == "rank" and parts[1].isdigit():
        return int(parts[1])
    return None


def per_worker_iteration(spans: Sequence[Span], workers: Sequence[int]) -> list[dict[str, Any]]:
    """One row per (worker rank, iteration): Mc, Pc, U, E, a, bytes moved, iteration time.

    Communication intervals are the link spans whose source or destination is the worker
    (an all-reduce bucket has destination -1 and counts for its source); compute intervals
    are the worker's own ``compute`` spans.
    """
    wanted = set(workers)
    comm: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    compute: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    moved: dict[tuple[int, int], int] = defaultdict(int)
    wall: dict[tuple[int, int], float] = {}
    for span in spans:
        it = span.args.get("iteration")
        if it is None:
            continue
        it = int(it)
        if span.category == "comm":
            for end in (span.args.get("source"), span.args.get("destination")):
                if end is not None and int(end) in wanted:
                    comm[(int(end), it)].append((span.start_s, span.end_s))
                    moved[(int(end), it)] += int(span.args.get("bytes", 0))
        elif span.category == "compute":
            rank = _rank_of(span.process)
            if rank in wanted:
                compute[(rank, it)].append((span.start_s, span.end_s))
        elif span.category == "iteration":
            rank = _rank_of(span.process)
            if rank in wanted:
                wall[(rank, it)] = span.end_s - span.start_s
    rows = []
    for key in sorted(set(comm) | set(compute)):
        row: dict[str, Any] = {"rank": key[0], "iteration": key[1]}
        row.update(overlap_metrics(comm.get(key, []), compute.get(key, [])))
        row["bytes"] = moved.get(key, 0)
        row["iteration_s"] = wall.get(key)
        rows.append(row)
    return rows


def link_bandwidth(spans: Sequence[Span]) -> list[float]:
    """Per iteration: all bytes moved / time at least one transfer was in flight (bits/s)."""
    by_iter: dict[int, list[Span]] = defaultdict(list)
    for span in spans:
        if span.category == "comm" and "iteration" in span.args:
            by_iter[int(span.args["iteration"])].append(span)
    out = []
    for it in sorted(by_iter):
        busy = union_length((s.start_s, s.end_s) for s in by_iter[it])
        nbytes = sum(int(s.args.get("bytes", 0)) for s in by_iter[it])
        if busy > 0:
            out.append(8 * nbytes / busy)
    return out


def _median(values: Iterable[float | None]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(
    rows: Sequence[dict[str, Any]],
    iteration_seconds: Sequence[float],
    bandwidth: Sequence[float] = (),
    warmup: int = WARMUP_ITERATIONS,
) -> dict[str, float | int | None]:
    """Run-level medians. ``X`` excludes the first ``warmup`` iterations (when the run has
    more); ``X_with_warmup`` includes every iteration."""
    out: dict[str, float | int | None] = {}
    keys = ("mc_s", "pc_s", "iteration_makespan_s", "efficiency_e", "ratio_a")
    n_iter = len(iteration_seconds)
    skip = warmup if n_iter > warmup else 0
    steady = [r for r in rows if r["iteration"] >= skip]
    for key in keys:
        out[key] = _median(r[key] for r in steady)
        out[f"{key}_with_warmup"] = _median(r[key] for r in rows)
    per_iter_bytes: dict[int, int] = defaultdict(int)
    for r in rows:
        per_iter_bytes[r["iteration"]] += r["bytes"]
    steady_iter = sorted(i for i in per_iter_bytes if i >= skip)
    out["iteration_s"] = _median(iteration_seconds[skip:])
    out["iteration_s_with_warmup"] = _median(iteration_seconds)
    for suffix, secs in (("", out["iteration_s"]), ("_with_warmup", out["iteration_s_with_warmup"])):
        out[f"iterations_per_s{suffix}"] = 1.0 / secs if secs else None
    out["achieved_bandwidth_bps"] = _median(bandwidth[skip:]) if len(bandwidth) > skip else _median(bandwidth)
    out["achieved_bandwidth_bps_with_warmup"] = _median(bandwidth)
    # each transfer touches two ends; per-worker bytes double count server<->worker links only
    # from the worker's side, so the per-iteration figure is the sum over workers
    out["worker_bytes_per_iteration"] = _median(per_iter_bytes[i] for i in steady_iter)
    out["warmup_iterations"] = skip
    return out
