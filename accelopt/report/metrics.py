"""Turn a :class:`~accelopt.records.RunRecord` into flat, JSON-ready figures.

Every renderer (JSON, CSV, terminal summary) reads these dicts rather than the record, so the
numbers a user sees in the terminal are exactly the numbers written to disk.
Missing measurements are ``None`` (JSON ``null``), never ``0``: a job that never ran has no
JCT, and an average over zero jobs does not exist.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any

from accelopt.records import JobResult, RunRecord

JOB_COLUMNS: tuple[str, ...] = (
    "job_id",
    "name",
    "model",
    "status",
    "lane",
    "error",
    "arrival_s",
    "admitted_s",
    "first_start_s",
    "end_s",
    "jct_s",
    "queueing_s",
    "iterations",
    "samples",
    "throughput",
    "final_loss",
    "persistent_bytes",
    "peak_bytes",
    "ephemeral_bytes",
    "iteration_seconds",
    "quality_metric",
    "quality",
    "quality_samples",
    "quality_p_at_5",
    "quality_note",
    "diverged",
)
"""Column order of ``metrics.csv``; fixed so that files from different runs line up (a new
column goes last, so a reader by position keeps working)."""

TOP1_METRICS = ("accuracy", "p_at_1")
"""Held-out qualities where higher is better (``avg_quality``); perplexity is lower-better
and has its own ``avg_perplexity``."""

_PROFILE_FIELDS = ("persistent_bytes", "peak_bytes", "ephemeral_bytes", "iteration_seconds")


def clean(value: Any) -> Any:
    """Replace NaN/inf by ``None`` (recursively): strict JSON readers, Perfetto included,
    reject ``NaN`` and a diverged loss must not make the whole file unreadable."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def finite(document: Any) -> Any:
    """``document`` with NaN/inf replaced by ``None``, as :func:`clean`, but without walking
    it when it has none, which is nearly always: JSON's C encoder checks the whole document
    in a fraction of the walk's time (a cluster run's trace: 19,000 events, 0.48 s walked)."""
    try:
        json.dumps(document, allow_nan=False)
    except (ValueError, TypeError):
        return clean(document)
    return document


def finite_json(document: Any, indent: int | None = None) -> str:
    """``document`` as JSON text with NaN/inf written as ``null``: encoded once by the C
    encoder, and walked (:func:`clean`) only when that finds a non-finite number. Writing
    :func:`finite`'s result instead encodes a clean document twice (a cluster run's trace:
    ~0.1 s each time)."""
    try:
        return json.dumps(document, indent=indent, allow_nan=False)
    except ValueError:
        return json.dumps(clean(document), indent=indent, allow_nan=False)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile with linear interpolation (numpy's default method).

    Written out rather than imported so the report does not depend on numpy's API and an
    empty list gives ``None`` instead of a warning plus NaN.
    """
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def job_metrics(result: JobResult) -> dict[str, Any]:
    """One job as a flat dict with the keys of :data:`JOB_COLUMNS`, in that order.

    Profile fields are always present (``None`` without a profile) so every job has the same
    columns.
    """
    job = result.job
    row: dict[str, Any] = {
        "job_id": job.job_id,
        "name": job.name,
        "model": job.model,
        "status": result.status,
        "lane": result.lane,
        "error": result.error,
        "arrival_s": job.arrival_s,
        "admitted_s": result.admitted_s,
        "first_start_s": result.first_start_s,
        "end_s": result.end_s,
        "jct_s": result.jct_s,
        "queueing_s": result.queueing_s,
        "iterations": result.iterations_done,
        "samples": result.samples,
        "throughput": result.throughput,
        "final_loss": result.final_loss,
    }
    for name in _PROFILE_FIELDS:
        row[name] = getattr(job.profile, name) if job.profile is not None else None
    quality = result.quality
    row["quality_metric"] = quality.metric if quality is not None else None
    row["quality"] = quality.value if quality is not None else None
    row["quality_samples"] = quality.samples if quality is not None else None
    row["quality_p_at_5"] = quality.p_at_5 if quality is not None else None
    row["quality_note"] = result.quality_note
    # a job that trained to its end on a loss of nan is "done" (other code reads that
    # status); this is the per-job field a CI check reads to fail it
    row["diverged"] = result.diverged_at is not None
    return clean(row)


def quality_means(jobs: list[JobResult]) -> dict[str, float | None]:
    """``avg_quality`` (top-1 metrics) and ``avg_perplexity`` over the scored ones of
    ``jobs``: a run's, or (``run.compare``) only the jobs scored in every run compared."""
    scored = [j.quality for j in jobs if j.quality is not None]
    return {"avg_quality": _mean([q.value for q in scored if q.metric in TOP1_METRICS]),
            "avg_perplexity": _mean([q.value for q in scored if q.metric == "perplexity"])}


def _ran(job: JobResult) -> bool:
    """Whether ``job`` ran an iteration in the run (see :func:`_makespan`)."""
    return job.status != "rejected" and (job.first_start_s is not None
                                         or job.iterations_done > 0)


def _makespan(record: RunRecord) -> float | None:
    """The first arrival to the last completion, over the jobs that ran: a job rejected
    (turned away by admission control) stretched it to its rejection time. ``None`` when no
    job ran, or when the run stopped (``error``) with a job that had not ended: its end,
    and so the makespan, is unknown. In a resumed run every arrival is on its clock (a job
    that had arrived before the resume at a negative time: ``job/checkpoint.py``
    ``arrive_on_resumed_clock``); only a job resumed from checkpoints that recorded no clock
    completes its carried time after its end here, so the makespan holds every job's
    arrival plus its JCT.

    A job ran when it started an iteration (a first start, as its queueing delay counts it)
    or has iterations done (one resumed from a checkpoint that recorded no first start): a
    job that failed before its first iteration (while its memory was profiled) has neither,
    and its arrival stretched the makespan back to a time no job that ran had arrived by.
    A stopped run's job that had not ended, started or not, still makes it unknown: the
    stop marks a job that was waiting failed too, and it would have run after the stop."""
    if "error" in record.metrics and any(
            j.status != "rejected" and j.end_s is None for j in record.jobs):
        return None
    ran = [j for j in record.jobs if _ran(j)]
    ended = [j for j in ran if j.end_s is not None]
    if not ended:
        return None
    return max(j.end_s + j.carried_s for j in ended) - min(j.job.arrival_s for j in ran)


def run_metrics(record: RunRecord) -> dict[str, Any]:
    """Run-level figures. ``avg_jct_s``, ``p95_jct_s`` and ``avg_queueing_s`` are over the
    same jobs, those that finished (``status == "done"``): a failed job's time is no
    completion time, and its wait counted beside the finished jobs' JCTs would make the two
    figures describe different jobs (a plugin that failed a long-waiting job would move the
    queueing figure and not the JCT).
    ``n_failed`` and the jobs table say what the others did.

    ``record.metrics`` is merged last, so a figure the runtime or a plugin measured itself
    takes precedence over the one derived here.
    """
    jobs = record.jobs
    done = [j for j in jobs if j.status == "done"]
    jcts = [j.jct_s for j in done if j.jct_s is not None]
    queueing = [j.queueing_s for j in done if j.queueing_s is not None]
    makespan = _makespan(record)
    summary: dict[str, Any] = {
        "n_jobs": len(jobs),
        "n_done": len(done),
        "n_failed": sum(1 for j in jobs if j.status == "failed"),
        # done, diverged: weights not finite (or, not known, losses not finite to the end)
        "n_diverged": sum(1 for j in done if j.diverged_at is not None),
        "n_rejected": sum(1 for j in jobs if j.status == "rejected"),
        "avg_jct_s": _mean(jcts),
        "p95_jct_s": percentile(jcts, 95),
        "makespan_s": makespan,
        "avg_queueing_s": _mean(queueing),
        "duration_s": record.duration_s,
        **quality_means(jobs),
        # every run says its mode ("none": one process), so a script comparing runs of
        # either kind reads the same key (a cluster run's figures give it as well)
        "cluster_mode": record.info.cluster.mode,
    }
    summary.update(record.metrics)
    return clean(summary)


def to_json_dict(record: RunRecord) -> dict[str, Any]:
    """The whole record as the document stored in ``metrics.json``."""
    info = record.info
    return clean(
        {
            "run": {
                "run_dir": info.run_dir,
                "device": info.device,
                "plugins": list(info.plugins),
                "seed": info.seed,
                # always present (empty on a clean run): a reader of run.warnings, as the
                # docs name it, got a KeyError where there were none
                "warnings": list(record.warnings),
            },
            "summary": run_metrics(record),
            # per job: its columns, and its loss curve (one value per iteration it ran)
            "jobs": [{**job_metrics(j), "losses": list(j.losses)} for j in record.jobs],
            "plugins": [
                {"plugin": r.plugin, "summary": r.summary, "metrics": dict(r.metrics)}
                for r in record.plugin_rows
            ],
            "telemetry": {
                "note": record.telemetry_note,
                "samples": [asdict(s) for s in record.telemetry],
            },
        }
    )
