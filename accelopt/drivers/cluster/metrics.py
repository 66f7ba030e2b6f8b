"""Communication/computation metrics of a cluster run, from its timeline spans.

Per worker and iteration (TicTac, Hashemi et al. 2019): Mc = union length of the
communication intervals touching that worker, Pc = union length of its compute intervals,
U = makespan (first interval start to last interval end). Without overlap U = Mc + Pc, with
perfect overlap U = max(Mc, Pc), so the scheduling efficiency is
``E = (Mc + Pc - U) / (Mc + Pc - max(Mc, Pc))`` and the ratio ``a = Mc / Pc``.

An iteration is the worker's own iteration span (its ``iteration`` timeline span): Mc and
Pc are the communication and compute inside it, whichever iteration they belong to, and U is
its length. A one-job PS worker runs free, so iteration i's gradient pushes end inside
iteration i+1; counting them in i made U (its first start to its last end) longer than the
period, and E read -2.4 on a run whose workers idled a few milliseconds an iteration.

E is reported as measured, not clamped: idle time inside an iteration (waiting for the
server's update, Python between a transfer's end and the next compute) pushes it below 0,
which is worth seeing.
"""

from __future__ import annotations

import bisect
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
    comm: Sequence[tuple[float, float]], compute: Sequence[tuple[float, float]],
    makespan: float | None = None,
) -> dict[str, float | None]:
    """Mc, Pc, U, E and a for one worker's iteration; U is ``makespan`` when given (the
    iteration's length), else the intervals' first start to last end."""
    mc, pc = union_length(comm), union_length(compute)
    if makespan is None:
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
        "speedup_potential": (upper - lower) / lower if lower > 0 else None,  # min(a, 1/a)
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
    are the worker's own ``compute`` spans. Where the worker's ``iteration`` span is on the
    timeline, both are clipped to it and U is its length (the module docstring says why);
    an iteration without one groups them by the iteration they belong to. ``bytes`` are
    always the iteration's own transfers.
    """
    wanted = set(workers)
    comm: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    compute: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    moved: dict[tuple[int, int], int] = defaultdict(int)
    window: dict[tuple[int, int], tuple[float, float]] = {}
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
                window[(rank, it)] = (span.start_s, span.end_s)
    inside_comm, inside_compute = _by_window(comm, window), _by_window(compute, window)
    rows = []
    for key in sorted(set(comm) | set(compute)):
        row: dict[str, Any] = {"rank": key[0], "iteration": key[1]}
        span_of = window.get(key)
        length = span_of[1] - span_of[0] if span_of is not None else None
        if length is None:
            row.update(overlap_metrics(comm.get(key, []), compute.get(key, [])))
        else:
            row.update(overlap_metrics(inside_comm.get(key, []), inside_compute.get(key, []),
                                       makespan=length))
        row["bytes"] = moved.get(key, 0)
        row["iteration_s"] = length
        rows.append(row)
    return rows


def _by_window(
    intervals: dict[tuple[int, int], list[tuple[float, float]]],
    windows: dict[tuple[int, int], tuple[float, float]],
) -> dict[tuple[int, int], list[tuple[float, float]]]:
    """Each rank's intervals cut at its iteration windows: (rank, iteration) -> the parts
    inside that iteration's window, whichever iteration an interval belongs to."""
    per_rank: dict[int, list[tuple[float, float, int]]] = defaultdict(list)
    for (rank, it), (start, end) in windows.items():
        per_rank[rank].append((start, end, it))
    for spans in per_rank.values():
        spans.sort()
    starts = {rank: [w[0] for w in spans] for rank, spans in per_rank.items()}
    out: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for (rank, _), pieces in intervals.items():
        ordered = per_rank.get(rank)
        if not ordered:
            continue
        for start, end in pieces:
            # the windows are disjoint and sorted: walk back from the last one starting
            # before this interval ends while they still end after it starts
            k = bisect.bisect_left(starts[rank], end) - 1
            while k >= 0 and ordered[k][1] > start:
                w_start, w_end, it = ordered[k]
                out[(rank, it)].append((max(start, w_start), min(end, w_end)))
                k -= 1
    return out


def link_bandwidth(spans: Sequence[Span]) -> list[float]:
    """Per iteration: all bytes moved / time at least one transfer was in flight (bits/s).
    The bytes are what the ranks sent on their links (an all-reduce's, by its algorithm:
    ``transport.allreduce_wire_bytes``); an iteration that sent none (one rank alone) has
    no figure rather than 0 bit/s."""
    by_iter: dict[int, list[Span]] = defaultdict(list)
    for span in spans:
        if span.category == "comm" and "iteration" in span.args:
            by_iter[int(span.args["iteration"])].append(span)
    out = []
    for it in sorted(by_iter):
        busy = union_length((s.start_s, s.end_s) for s in by_iter[it])
        nbytes = sum(int(s.args.get("bytes", 0)) for s in by_iter[it])
        if busy > 0 and nbytes > 0:
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
    more); ``X_with_warmup`` includes every iteration. ``iteration_seconds``: the lengths of
    the iterations this run measured, in order. The warm-up counts from the first iteration
    this run measured, not from iteration 0: a run resumed from a checkpoint at iteration
    1400 warms up in its iterations 1400 and 1401 (its rows carry those numbers)."""
    out: dict[str, float | int | None] = {}
    keys = ("mc_s", "pc_s", "iteration_makespan_s", "efficiency_e", "ratio_a")
    n_iter = len(iteration_seconds)
    skip = warmup if n_iter > warmup else 0
    first = min((int(r["iteration"]) for r in rows), default=0)
    steady = [r for r in rows if r["iteration"] >= first + skip]
    for key in keys:
        out[key] = _median(r[key] for r in steady)
        out[f"{key}_with_warmup"] = _median(r[key] for r in rows)
    per_iter_bytes: dict[int, int] = defaultdict(int)
    for r in rows:
        per_iter_bytes[r["iteration"]] += r["bytes"]
    steady_iter = sorted(i for i in per_iter_bytes if i >= first + skip)
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
