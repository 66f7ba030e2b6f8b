"""Everything a run writes or prints: metrics files, Chrome trace, timeline PNG, terminal
summary and progress bars. Reads :mod:`accelopt.records`; never touches the runtime."""

from __future__ import annotations

from accelopt.report.chrome_trace import chrome_trace
from accelopt.report.metrics import job_metrics, run_metrics, to_json_dict
from accelopt.report.progress import JobProgress
from accelopt.report.summary import render_summary
from accelopt.report.timeline_png import plot_timeline
from accelopt.report.writer import load_metrics, write_run_outputs

__all__ = [
    "JobProgress",
    "chrome_trace",
    "job_metrics",
    "load_metrics",
    "plot_timeline",
    "render_summary",
    "run_metrics",
    "to_json_dict",
    "write_run_outputs",
]
