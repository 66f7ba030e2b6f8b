"""The quality column of ``accelopt bench``: each measured run's held-out quality.

A speed-up that costs accuracy is not a gain, so the bench table puts what each plugin set
learned beside how fast it ran. Every run already scores each training job's final model on
its held-out set (``accelopt/job/quality.py``; accuracy for single-label data, P@1 for
multi-label data, perplexity for a language model) and writes it into ``metrics.json``;
this module reads it back: the mean over the run's jobs scored by top-1, or, in a run
none of whose jobs has a top-1, the mean perplexity of its language models (a bench of an LM
said that no run was scored, and showed a plugin that cost perplexity by speed alone);
``None`` when no job was scored (an inference-only workload, ``evaluate: false``, a dataset
without a held-out set).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from accelopt.report.metrics import TOP1_METRICS
from accelopt.report.writer import load_metrics

EVAL_METRIC = "top1"
"""The quality column's name where runs score top-1 (accuracy, or P@1)."""
PERPLEXITY = "perplexity"
"""Its name where they score language models only (lower is better)."""


def evaluate_run(run_dir: Path) -> tuple[str, float] | None:
    """``(column, value)``: the mean held-out top-1 over the run's jobs scored by it, else
    the mean perplexity over those scored by perplexity; ``None``: no job was scored."""
    jobs = load_metrics(run_dir).get("jobs", [])
    scored = [j for j in jobs if isinstance(j.get("quality"), (int, float))]
    for column, metrics in ((EVAL_METRIC, TOP1_METRICS), (PERPLEXITY, (PERPLEXITY,))):
        scores = [j["quality"] for j in scored if j.get("quality_metric") in metrics]
        if scores:
            return column, statistics.fmean(scores)
    return None
