"""Export a run's spans as Chrome Trace Event Format, viewable in https://ui.perfetto.dev or
``chrome://tracing``.

Format reference: "Trace Event Format" (Google doc linked from the Catapult project). Each
``Span.process`` becomes a process and each ``(process, track)`` a thread (more than one
where spans of the track overlap without nesting: see :func:`_threads`); numeric ids are
given in order of first appearance so the same record always yields the same file (diffable,
testable).
"""

from __future__ import annotations

from typing import Any

from accelopt.records import RunRecord
from accelopt.report.metrics import finite

_US = 1_000_000.0
TELEMETRY_PROCESS = "telemetry"


def _us(seconds: float) -> float:
    """Seconds to microseconds, rounded to a nanosecond so float noise does not leak."""
    return round(seconds * _US, 3)


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _threads(record: RunRecord) -> list[str]:
    """The thread each span is drawn on: its track, or, where it overlaps a span of its track
    without nesting in it (transfers in flight together on one link), ``"<track> #2"`` and
    on. Complete events of one thread must nest: viewers drop the ones that do not
    (Perfetto counts them as ``slice_drop_overlapping_complete_event``), and a link track
    showed a fraction of its transfers."""
    threads = [span.track for span in record.spans]
    by_track: dict[tuple[str, str], list[int]] = {}
    for index, span in enumerate(record.spans):
        by_track.setdefault((span.process, span.track), []).append(index)
    for (_, track), indices in by_track.items():
        lanes: list[list[float]] = []  # each lane's stack of open spans' ends
        for index in sorted(indices, key=lambda i: (record.spans[i].start_s,
                                                    -record.spans[i].end_s, i)):
            span = record.spans[index]
            number = _lane(lanes, span.start_s, max(span.start_s, span.end_s))
            threads[index] = track if number == 0 else f"{track} #{number + 1}"
    return threads


def _lane(lanes: list[list[float]], start: float, end: float) -> int:
    """The first lane where a span ``[start, end]`` (spans come by start) follows the lane's
    spans or nests inside an open one; a new lane if none. Each lane is the stack of its
    open spans' ends, and takes this one's."""
    for number, stack in enumerate(lanes):
        while stack and stack[-1] <= start:
            stack.pop()
        if not stack or end <= stack[-1]:
            stack.append(end)
            return number
    lanes.append([end])
    return len(lanes) - 1


def _assign_ids(record: RunRecord, threads: list[str]
                ) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """pid per process and tid per (process, thread), numbered from 1 by first appearance."""
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    for span, thread in zip(record.spans, threads, strict=True):
        pids.setdefault(span.process, len(pids) + 1)
        tids.setdefault((span.process, thread), len(tids) + 1)
    return pids, tids


def _metadata_events(
    pids: dict[str, int], tids: dict[tuple[str, str], int]
) -> list[dict[str, Any]]:
    """Name processes and threads, and pin their order so viewers do not sort by name."""
    events: list[dict[str, Any]] = []
    for process, pid in pids.items():
        events.append(_meta("process_name", pid, 0, name=process))
        events.append(_meta("process_sort_index", pid, 0, sort_index=pid))
    for (process, track), tid in tids.items():
        events.append(_meta("thread_name", pids[process], tid, name=track))
        events.append(_meta("thread_sort_index", pids[process], tid, sort_index=tid))
    return events


def _job_names(record: RunRecord) -> tuple[dict[str, str], dict[str, str]]:
    """job id -> name, and name -> job id for the names only one job has."""
    infos = [r.job for r in record.jobs] + list(record.info.jobs)
    by_id = {info.job_id: info.name for info in infos}
    counts: dict[str, int] = {}
    for name in by_id.values():
        counts[name] = counts.get(name, 0) + 1
    by_name = {name: job_id for job_id, name in by_id.items() if counts[name] == 1}
    return by_id, by_name


def _iteration_span(name: str, args: dict[str, Any], by_id: dict[str, str],
                    by_name: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """An iteration span's event name and args in one convention whatever made it:
    ``args.job`` the job's id (as ``per_iteration.json`` and ``metrics.json`` name it),
    ``args.name`` its name, and the event ``"<name> iteration <i>"``. One process records
    its iterations under the job's name, a cluster rank under its id (named ``iteration
    <i>`` when the run has one job), so a script matching a job's spans across modes found
    none of one of them. Any other span is kept as it was."""
    job, iteration = args.get("job"), args.get("iteration")
    if job is None or iteration is None:
        return name, args
    job_id = str(job) if str(job) in by_id else by_name.get(str(job))
    if job_id is None:  # a job the record does not know: left as recorded
        return name, args
    return (f"{by_id[job_id]} iteration {iteration}",
            {**args, "job": job_id, "name": by_id[job_id]})


def _span_events(
    record: RunRecord, threads: list[str], pids: dict[str, int],
    tids: dict[tuple[str, str], int]
) -> list[dict[str, Any]]:
    events = []
    by_id, by_name = _job_names(record)
    for span, thread in zip(record.spans, threads, strict=True):
        name, args = span.name, span.args
        if span.category == "iteration":
            name, args = _iteration_span(name, args, by_id, by_name)
        events.append(
            {
                "name": name,
                "cat": span.category,
                "ph": "X",
                "ts": _us(span.start_s),
                # A span that ends before it starts is a recording bug; show it as an instant
                # rather than produce a negative duration that viewers silently drop.
                # (the end rounded, not the length: a span nested in another stays inside
                # it to the nanosecond)
                "dur": max(0.0, round(_us(span.end_s) - _us(span.start_s), 3)),
                "pid": pids[span.process],
                "tid": tids[(span.process, thread)],
                "args": dict(args),
            }
        )
    return events


def _counter_events(record: RunRecord, pid: int) -> list[dict[str, Any]]:
    """Telemetry as two counter tracks (utilisation %, memory MiB) in their own process."""
    events: list[dict[str, Any]] = []
    if not record.telemetry:
        return events
    events.append(_meta("process_name", pid, 0, name=TELEMETRY_PROCESS))
    events.append(_meta("process_sort_index", pid, 0, sort_index=pid))
    for sample in record.telemetry:
        what = "GPU" if sample.source == "nvml" else "process CPU"
        common = {"ph": "C", "pid": pid, "tid": 0, "ts": _us(sample.t_s), "cat": "telemetry"}
        if sample.utilization_pct is not None:  # a counter has no "not measured" value
            events.append({**common, "name": f"{what} utilization %",
                           "args": {"value": sample.utilization_pct}})
        events.append(
            {
                **common,
                "name": f"{what} memory MiB",
                "args": {"value": round(sample.memory_bytes / 2**20, 3)},
            }
        )
    return events


def chrome_trace(record: RunRecord) -> dict[str, Any]:
    """The record as a Chrome trace JSON object (``{"traceEvents": [...], ...}``), NaN and
    inf replaced by ``None``."""
    return finite(trace_document(record))


def trace_document(record: RunRecord) -> dict[str, Any]:
    """:func:`chrome_trace` before non-finite numbers are replaced: for a writer that
    encodes it with :func:`~accelopt.report.metrics.finite_json` (one encoding, not two)."""
    threads = _threads(record)
    pids, tids = _assign_ids(record, threads)
    events = _metadata_events(pids, tids)
    events += _span_events(record, threads, pids, tids)
    events += _counter_events(record, len(pids) + 1)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"run_dir": record.info.run_dir, "device": record.info.device},
    }
