"""Everything a run writes or prints: metrics files, Chrome trace, timeline PNG, terminal
summary and progress bars. Reads :mod:`accelopt.records`; never touches the runtime.

The exports are imported on first use (PEP 562), so a process that needs one module of the
package (the timeline's drawing process, ``report/renderer.py``) does not import the rest
(rich's console, the metrics, the trace writer).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Imported now, not on first use: the function shares its name with its module, and once
# that module is imported (by anything) the package attribute of that name would be the
# module and ``from accelopt.report import chrome_trace`` would return it. Light: it
# imports only the records and the metrics.
from accelopt.report.chrome_trace import chrome_trace

_EXPORTS = {
    "JobProgress": "accelopt.report.progress",
    "job_metrics": "accelopt.report.metrics",
    "load_metrics": "accelopt.report.writer",
    "plot_timeline": "accelopt.report.timeline_png",
    "render_summary": "accelopt.report.summary",
    "run_metrics": "accelopt.report.metrics",
    "to_json_dict": "accelopt.report.metrics",
    "write_run_outputs": "accelopt.report.writer",
}

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

if TYPE_CHECKING:
    from accelopt.report.metrics import job_metrics, run_metrics, to_json_dict
    from accelopt.report.progress import JobProgress
    from accelopt.report.summary import render_summary
    from accelopt.report.timeline_png import plot_timeline
    from accelopt.report.writer import load_metrics, write_run_outputs


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'accelopt.report' has no attribute '{name}'")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
