"""Write a run's outputs to its directory, and read ``metrics.json`` back.

All files go through :func:`~accelopt.atomic.atomic_open`, so an interrupted run
leaves each output either absent, as before, or complete.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelopt.atomic import atomic_open
from accelopt.records import RunRecord
from accelopt.report.chrome_trace import trace_document
from accelopt.report.metrics import JOB_COLUMNS, finite_json, job_metrics, to_json_dict
from accelopt.report.timeline_png import draw, timeline_layout

if TYPE_CHECKING:
    from accelopt.report.renderer import TimelineRenderer

log = logging.getLogger(__name__)

METRICS_JSON = "metrics.json"
METRICS_CSV = "metrics.csv"
TRACE_JSON = "trace.json"
TIMELINE_PNG = "timeline.png"
_REQUIRED_KEYS = ("run", "summary", "jobs")


def _write_json(path: Path, document: dict[str, Any], indent: int | None = 2) -> Path:
    with atomic_open(path) as fh:
        # NaN/inf as null (strict readers reject NaN), in one encoding by the C encoder
        # (json.dump would encode in Python, chunk by chunk: seconds for a cluster's trace)
        fh.write(finite_json(document, indent))
        fh.write("\n")
    return path


def _write_csv(path: Path, record: RunRecord) -> Path:
    """One row per job; the header is written even for zero jobs so the file is self-describing."""
    with atomic_open(path, newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(JOB_COLUMNS))
        writer.writeheader()
        for job in record.jobs:
            writer.writerow(job_metrics(job))
    return path


def write_run_outputs(record: RunRecord, run_dir: Path,
                      renderer: TimelineRenderer | None = None) -> dict[str, Path]:
    """Write metrics.json, metrics.csv, trace.json and timeline.png into ``run_dir``.

    ``renderer``: a drawing process started as the jobs ended (:mod:`accelopt.report.renderer`);
    it draws the PNG while this writes the rest. If it cannot, the PNG is drawn here."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    png = run_dir / TIMELINE_PNG
    layout = timeline_layout(record)
    drawing = renderer if renderer is not None and renderer.submit(layout, png) else None
    paths = {
        METRICS_JSON: _write_json(run_dir / METRICS_JSON, to_json_dict(record)),
        METRICS_CSV: _write_csv(run_dir / METRICS_CSV, record),
        # Compact: traces of long runs get large and nobody reads them by eye.
        TRACE_JSON: _write_json(run_dir / TRACE_JSON, trace_document(record), indent=None),
    }
    failed = drawing.wait() if drawing is not None else "no drawing process"
    if failed is not None:
        if drawing is not None:
            log.debug("the timeline's drawing process did not draw it (%s); drawing it here",
                      failed)
        draw(layout, png)
    paths[TIMELINE_PNG] = png
    return paths


def load_metrics(run_dir: Path) -> dict[str, Any]:
    """Read ``metrics.json`` from a run directory (or the file itself) and sanity-check it.

    Raises a one-line ``ValueError`` naming the path, because the caller is usually a CLI
    command pointed at the wrong directory and a traceback would not tell the user that.
    """
    path = Path(run_dir)
    if path.is_dir() or path.suffix != ".json":
        path = path / METRICS_JSON

    def fail(reason: str) -> ValueError:
        return ValueError(f"{path} is not a metrics.json written by accelopt: {reason}")

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise fail("file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise fail(f"cannot read it ({type(exc).__name__}: {exc})") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise fail(f"invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(document, dict):
        raise fail(f"top level is a JSON {type(document).__name__}, expected an object")
    missing = [k for k in _REQUIRED_KEYS if k not in document]
    if missing:
        raise fail(f"missing key(s) {', '.join(missing)}")
    if not isinstance(document["jobs"], list):
        raise fail("'jobs' is not a list")
    return document
