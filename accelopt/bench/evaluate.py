"""The quality column of ``accelopt bench``: each measured run's held-out top-1.

A speed-up that costs accuracy is not a gain, so the bench table puts what each plugin set
learned beside how fast it ran. Every run already scores each training job's final model on
its held-out set (``accelopt/job/quality.py``; accuracy for single-label data, P@1 for
multi-label data) and writes it into ``metrics.json``; this module reads it back: the mean
over the run's jobs scored by top-1, or ``None`` when none was (an inference-only workload,
``evaluate: false``, a dataset without a held-out set, a language model's perplexity).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from accelopt.report.metrics import TOP1_METRICS
from accelopt.report.writer import load_metrics

EVAL_METRIC = "top1"


def evaluate_run(run_dir: Path) -> float | None:
    """Mean held-out top-1 over the run's scored jobs (``None``: none scored)."""
    jobs = load_metrics(run_dir).get("jobs", [])
    scores = [j["quality"] for j in jobs if isinstance(j.get("quality"), (int, float))
              and j.get("quality_metric") in TOP1_METRICS]
    return statistics.fmean(scores) if scores else None
