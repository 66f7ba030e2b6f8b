"""What a run measured, as plain data: the runtime fills these, ``accelopt.report`` writes them.

Keeping the record separate from both sides means a report can be re-rendered from a saved
``metrics.json`` and the runtime never formats output itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from accelopt.types import JobInfo, ReportRow, RunInfo

JobStatus = Literal["done", "failed", "rejected", "pending"]


@dataclass
class Span:
    """A timed interval on one track of the timeline (seconds since the run started).

    ``track`` groups spans into one row of the Chrome trace / PNG timeline, e.g.
    ``"lane default"``, ``"job mlp-a"``, ``"hooks"`` or ``"rank 1 link 0->1"``.
    """

    name: str
    track: str
    start_s: float
    end_s: float
    category: str = "iteration"
    args: dict[str, float | int | str] = field(default_factory=dict)
    process: str = "executor"


@dataclass
class TelemetrySample:
    """One sample of the machine: GPU utilisation/memory where pynvml sees a GPU, else the
    process's CPU percentage and resident memory."""

    t_s: float
    source: Literal["nvml", "process"]
    utilization_pct: float
    memory_bytes: int


@dataclass(frozen=True)
class Quality:
    """What a job learned: its final model's score on the held-out set
    (``accelopt/job/quality.py``)."""

    metric: str
    """``accuracy`` (single-label data) or ``p_at_1`` (multi-label: precision@1)."""
    value: float
    samples: int
    """Held-out points scored."""
    p_at_5: float | None = None
    """Multi-label data: precision@5 (the mean share of the five best-scored classes that
    are among a point's labels), the extreme-classification convention beside P@1."""
    note: str = ""
    """What to know about the score (``""``: nothing): a model whose output width is not
    the dataset's class count, which trains without an error."""


CANNOT_SCORE = "cannot score"
"""How :attr:`JobResult.quality_note` starts for a trained job whose held-out scoring
failed (as opposed to one with nothing to score: no held-out set, an inference job)."""


@dataclass
class JobResult:
    """Outcome and timing of one job.

    JCT (job completion time) is measured from arrival to the end of its last iteration;
    queueing delay from arrival to the start of its first iteration. In a resumed run the
    arrival is on that run's clock (negative for a job that had arrived before it:
    ``job/checkpoint.py`` ``arrive_on_resumed_clock``), so JCT and queueing delay count
    the time before the resume; ``carried_s`` serves checkpoints that recorded no clock.
    """

    job: JobInfo
    status: JobStatus = "pending"
    lane: str = ""
    error: str = ""
    admitted_s: float | None = None
    first_start_s: float | None = None
    end_s: float | None = None
    iterations_done: int = 0
    service_s: float = 0.0
    samples: int = 0
    final_loss: float | None = None
    losses: list[float] = field(default_factory=list)
    carried_s: float = 0.0
    """Time from arrival to the checkpoint this job was resumed from, where that run
    recorded no clock (0 otherwise: its arrival on the resumed clock counts that time)."""
    carried_queueing_s: float | None = None
    """The queueing delay it had before that checkpoint (``None``: it had not started)."""
    quality: Quality | None = None
    """The trained model on the held-out set (``None``: not scored, see ``quality_note``)."""
    quality_note: str = ""
    """Why there is no quality: no held-out set, an inference job, the job did not finish,
    ``evaluate: false``, or the one-line reason scoring failed; with a quality, its
    :attr:`Quality.note` (a model whose output width is not the class count)."""

    @property
    def jct_s(self) -> float | None:
        """Arrival to the last iteration's end; none for a job rejected before it ran (its
        ``end_s`` is when it was turned away, no completion: the CSV's column averaged it)."""
        if self.end_s is None or self.status == "rejected":
            return None
        return self.end_s - self.job.arrival_s + self.carried_s

    @property
    def queueing_s(self) -> float | None:
        if self.carried_queueing_s is not None:
            return self.carried_queueing_s
        return None if self.first_start_s is None else self.first_start_s - self.job.arrival_s

    @property
    def throughput(self) -> float | None:
        """Samples per second of the job's own service time."""
        return self.samples / self.service_s if self.service_s > 0 else None

    @property
    def diverged_at(self) -> int | None:
        """The index of the first recorded loss that is not finite (a NaN or inf, ``None``
        once it went through JSON from a rank), or ``None`` when every loss is finite: a
        job can train to its last iteration on a diverged loss, and must not be read as
        done well."""
        for i, loss in enumerate(self.losses):
            if loss is None or not math.isfinite(loss):
                return i
        return None


@dataclass
class RunRecord:
    """Everything one run measured."""

    info: RunInfo
    duration_s: float = 0.0
    jobs: list[JobResult] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    plugin_rows: list[ReportRow] = field(default_factory=list)
    telemetry: list[TelemetrySample] = field(default_factory=list)
    telemetry_note: str = ""
    metrics: dict[str, float | int | str] = field(default_factory=dict)
    """Run-level figures the runtime or a plugin measured (e.g. a cluster's E)."""
    summary: dict[str, Any] = field(default_factory=dict)
    """Once the run's outputs are written: ``metrics.json``'s ``summary`` (JCT statistics,
    makespan, duration, and :attr:`metrics`)."""
    warnings: list[str] = field(default_factory=list)
    """Settings this run was given that it could not use, or that distort what it measures
    (``runtime.run.setting_warnings``): kept in ``metrics.json``'s ``run`` section, so its
    figures are never read as measured under them (a one-process run given a shaped link)."""
